# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import gc
import warnings
import weakref

import numpy as np

warnings.simplefilter("ignore")
from skpathkernel import PathKernel, PathKernelMachine

rng = np.random.RandomState(0)
X = rng.normal(size=(20, 2))
y = X[:, 0]
est = PathKernelMachine(hidden_layer_sizes=(6,), max_iter=3, random_state=0, dtype="float64").fit(
    X, y
)
k = PathKernel(est)
k(X, eval_gradient=True)
old = weakref.ref(est.network_)
old_traj = weakref.ref(est.network_.trajectory)
est.set_params(random_state=1).fit(X, y)
gc.collect()
print(
    "old network alive after refit:",
    old() is not None,
    "old trajectory alive:",
    old_traj() is not None,
)
