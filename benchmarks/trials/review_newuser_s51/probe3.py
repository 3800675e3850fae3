# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import copy
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

warnings.simplefilter("ignore")
from _common import SMALL_MLP, data, err
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel

from skpathkernel import PathKernel, PathKernelMachine

X, y = data(n=40)
est = PathKernelMachine(**SMALL_MLP, dtype="float64").fit(X, y)
rng = np.random.RandomState(0)
rng.uniform(size=80)  # the draws of the rows before, as the recorded run had them


# threads: clones of one kernel, different rows of the same shape
k = PathKernel(est)
Xs = [X[rng.permutation(40)[:20]] for _ in range(8)]
refs = [PathKernel(est)(A) for A in Xs]
bad = 0


def work(i):
    c = clone(k)
    out = []
    for r in range(6):
        j = (i + r) % 8
        K, _ = c(Xs[j], eval_gradient=True)
        K2 = c(Xs[j])
        out.append(max(err(K, refs[j]), err(K2, refs[j])))
    return max(out)


with ThreadPoolExecutor(8) as ex:
    errs = list(ex.map(work, range(16)))
print("threads max err", max(errs))
# API
k = PathKernel(est)
k(X, eval_gradient=True)
c = clone(k)
print(
    "clone shares memo:",
    c.__dict__.get("_gram_memo") is k._gram_memo,
    "eq:",
    c == k,
    "params equal:",
    c.get_params() == k.get_params(),
)
print(
    "theta",
    k.theta,
    "hyperparameters",
    k.hyperparameters,
    "n_dims",
    k.n_dims,
    "bounds",
    k.bounds.shape,
)
cw = k.clone_with_theta(k.theta)
print("clone_with_theta shares:", cw.__dict__.get("_gram_memo") is k._gram_memo)
d = copy.deepcopy(k)
print(
    "deepcopy memo:",
    "_gram_memo" in d.__dict__,
    d.__dict__.get("_gram_memo") is k.__dict__.get("_gram_memo"),
)
cc = copy.copy(k)
print("copy.copy memo shared:", cc.__dict__.get("_gram_memo") is k._gram_memo)
p = pickle.loads(pickle.dumps(k))
print("pickle memo:", "_gram_memo" in p.__dict__, err(p(X), PathKernel(est)(X)))
print("k still has memo after pickle:", "_gram_memo" in k.__dict__)
print("get_params keys", sorted(k.get_params()))
# FrozenEstimator
fk = PathKernel(FrozenEstimator(est))
K1, _ = fk(X, eval_gradient=True)
print("Frozen err", err(fk(X), PathKernel(est)(X)))
# GPR: number of Gram computations
calls = []
orig = PathKernel._gram_blocks

PathKernel._gram_blocks = lambda self, A, B: calls.append(len(A)) or orig(self, A, B)
gpr = GaussianProcessRegressor(
    ConstantKernel() * PathKernel(est) + WhiteKernel(), random_state=0, n_restarts_optimizer=2
).fit(X, y)
print("GPR computations:", calls)
calls.clear()
est.set_params(memory_budget=2**28)
gpr = GaussianProcessRegressor(
    ConstantKernel() * PathKernel(est) + WhiteKernel(), random_state=0
).fit(X, y)
print("GPR computations after set_params(memory_budget):", len(calls))
est.set_params(memory_budget=2**30)
# GridSearchCV threading over GPR alpha
from joblib import parallel_backend
from sklearn.model_selection import GridSearchCV

calls.clear()
gs = GridSearchCV(
    GaussianProcessRegressor(ConstantKernel() * PathKernel(est) + WhiteKernel(), random_state=0),
    {"alpha": [1e-10, 1e-3]},
    cv=3,
    n_jobs=2,
)
with parallel_backend("threading"):
    gs.fit(X, y)
print("GridSearch threads computations:", len(calls), calls[:10])
# reference: serial without memo
PathKernel._gram_blocks = orig
import skpathkernel.kernels as kk

scores_thr = gs.cv_results_["mean_test_score"]


class NoMemo(kk._GramMemo):
    def lookup(self, *a):
        return None

    def store(self, *a):
        pass


_orig_memo = kk._GramMemo
kk._GramMemo = NoMemo
gs2 = GridSearchCV(
    GaussianProcessRegressor(ConstantKernel() * PathKernel(est) + WhiteKernel(), random_state=0),
    {"alpha": [1e-10, 1e-3]},
    cv=3,
    n_jobs=1,
).fit(X, y)
print("scores threaded+memo", scores_thr, "serial no memo", gs2.cv_results_["mean_test_score"])
# two fits of one GPR kernel (a loop over alpha): clones of the same kernel
kk._GramMemo = _orig_memo
calls.clear()
PathKernel._gram_blocks = lambda self, A, B: calls.append(len(A)) or orig(self, A, B)
kern = ConstantKernel() * PathKernel(est) + WhiteKernel()
for a in (1e-10, 1e-3, 1e-1):
    GaussianProcessRegressor(kern, alpha=a, random_state=0).fit(X, y)
print("three GPR fits of one kernel: computations", len(calls))
PathKernel._gram_blocks = orig
