# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import warnings

import numpy as np

warnings.simplefilter("ignore")
from _common import SMALL_MLP, data, err
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from skpathkernel import PathKernel, PathKernelMachine, TangentKernel

X, y = data()


def check(name, K, ref):
    e = err(K, ref)
    print(f"{'BAD ' if e > 1e-10 else 'ok  '}{name}: {e:.1e}")


p = SMALL_MLP
e32 = PathKernelMachine(dtype="float32", **p).fit(X, y)
k = PathKernel(e32)
k(X, eval_gradient=True)
X32 = X.astype(np.float32)
check("float32 net: float64 rows then float32 rows", k(X32), PathKernel(e32)(X32))
Xn = X + 1e-12
check("float32 net: rows +1e-12", k(Xn), PathKernel(e32)(Xn))
e64 = PathKernelMachine(dtype="float64", **p).fit(X, y)
for KC, kw in (
    (PathKernel, dict(output="full")),
    (PathKernel, dict(memory="continuous")),
    (PathKernel, dict(split="steps")),
    (PathKernel, dict(n_jobs=2)),
    (TangentKernel, dict(output="full")),
    (PathKernel, dict(stop=3)),
):
    k = KC(e64)
    k(X, eval_gradient=True)
    try:
        k.set_params(**kw)
        check(f"{KC.__name__} set_params({kw})", k(X), KC(e64, **kw)(X))
        k2 = KC(e64, **kw)
        k2(X, eval_gradient=True)
        check(f"{KC.__name__}({kw}) memo hit", k2(X), KC(e64, **kw)(X))
    except Exception as exc:
        print("skip", kw, type(exc).__name__, str(exc)[:80])
k = PathKernel(e64)
k(X, eval_gradient=True)
check(
    "set_params(estimator=FrozenEstimator(est))",
    k.set_params(estimator=FrozenEstimator(e64))(X),
    PathKernel(e64)(X),
)
twin = clone(e64).fit(X, y)
check("equal-content twin estimator", k.set_params(estimator=twin)(X), PathKernel(twin)(X))
try:
    PathKernel(make_pipeline(StandardScaler(), clone(e64)).fit(X, y))(X, eval_gradient=True)
    print("BAD pipeline accepted")
except TypeError as exc:
    print("ok  pipeline refused:", str(exc)[:80])
k = PathKernel(e64)
K, G = k(X, eval_gradient=True)
K2, G2 = k(X, eval_gradient=True)
print("second eval_gradient call is a fresh array:", K2 is not K, "gradient shape", G2.shape)
K2 += 1
check("caller's in-place change not in memo", k(X), PathKernel(e64)(X))
Y = X[:5] + 0.2
check("Y given after memo", k(X, Y), PathKernel(e64)(X, Y))
check("k(X, X) same object", k(X, X), PathKernel(e64)(X))
Xc = X.copy()
check("k(X, X.copy())", k(X, Xc), PathKernel(e64)(X, Xc))
