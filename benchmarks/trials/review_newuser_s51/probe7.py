# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import warnings

import numpy as np

warnings.simplefilter("ignore")
from _common import SMALL_MLP, data
from joblib import parallel_backend
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel
from sklearn.model_selection import GridSearchCV

import skpathkernel.kernels as kk
from skpathkernel import PathKernel, PathKernelMachine

X14, y14 = data()
est = PathKernelMachine(**SMALL_MLP, dtype="float64").fit(X14, y14)
rng = np.random.RandomState(0)
X = rng.uniform(-1, 1, size=(30, 2))
y = np.sin(2 * X[:, 0]) + X[:, 1] ** 2
log = []
orig = kk._NetworkKernel.__call__


def call(self, A, B=None, eval_gradient=False):
    memo = self.__dict__.get("_gram_memo")
    e = None if memo is None else memo.entry
    log.append((id(self) % 10000, len(A), B is None, eval_gradient, e is not None))
    return orig(self, A, B, eval_gradient)


kk._NetworkKernel.__call__ = call
eng = PathKernel._gram_blocks
n = []
PathKernel._gram_blocks = lambda self, A, B: n.append((len(A), B is None)) or eng(self, A, B)
for backend, jobs in (("threading", 2), ("threading", 1)):
    n.clear()
    log.clear()
    with parallel_backend(backend):
        GridSearchCV(
            GaussianProcessRegressor(
                ConstantKernel() * PathKernel(est) + WhiteKernel(), random_state=0
            ),
            {"alpha": [1e-10, 1e-3]},
            cv=3,
            n_jobs=jobs,
        ).fit(X, y)
    print(jobs, "grams (Y None):", sum(b for _, b in n), [a for a, b in n if b])
    seen = {}
    for kid, la, bn, eg, has in log:
        if bn and not eg and not has:
            print("  plain call without memo: kernel", kid, la)
