# ruff: noqa: E402, E501
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import sys
import time
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
torch.set_num_threads(1)
from skpathkernel import PathKernel, PathKernelMachine

rng = np.random.RandomState(0)
X = rng.normal(size=(200, 16))
y = rng.normal(size=200)


def module(n_in, n_out):
    layers = [torch.nn.Linear(n_in, 64)]
    for _ in range(20):
        layers += [torch.nn.BatchNorm1d(64).eval(), torch.nn.Tanh(), torch.nn.Linear(64, 64)]
    layers += [torch.nn.Linear(64, n_out)]
    return torch.nn.Sequential(*layers)


est = PathKernelMachine(module=module, max_iter=2, tol=None, random_state=0, batch_size=50).fit(
    X, y
)
k = PathKernel(est)
t = time.process_time()
k(X, eval_gradient=True)
full = time.process_time() - t
hits = []
for _ in range(21):
    t = time.process_time()
    k(X, eval_gradient=True)
    hits.append(time.process_time() - t)
print(
    f"{sys.argv[1]}: params {est.network_.n_params}, modules {len(list(est.network_.module.modules()))}, path points {len(est.network_.trajectory)}; Gram computed {full * 1e3:.1f} ms CPU; memo hit median {np.median(hits) * 1e3:.2f} ms CPU (21 calls)"
)
