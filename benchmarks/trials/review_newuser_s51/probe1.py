# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
from _common import SMALL_MLP, data, err

from skpathkernel import PathKernel, PathKernelMachine, TangentKernel


def fit(**kw):
    X, y = data()
    return PathKernelMachine(**{**SMALL_MLP, "dtype": "float64", **kw}).fit(X, y), X, y


def check(name, K, ref, diff_from=None):
    e = err(K, ref)
    extra = "" if diff_from is None else f" (ref differs from old by {err(ref, diff_from):.2e})"
    print(f"{'BAD ' if e > 1e-10 else 'ok  '}{name}: err {e:.2e}{extra}")


for KC in (PathKernel, TangentKernel):
    print("==", KC.__name__)
    # refit in place
    est, X, y = fit()
    k = KC(est)
    old, _ = k(X, eval_gradient=True)
    net0 = est.network_
    est.set_params(random_state=3).fit(X, y)
    print("  refit: same network_ object?", est.network_ is net0)
    check("refit in place", k(X), KC(est)(X), old)
    # warm start
    est, X, y = fit(warm_start=True)
    k = KC(est)
    old, _ = k(X, eval_gradient=True)
    net0 = est.network_
    n0 = len(est.network_.trajectory)
    est.fit(X, y)
    print("  warm_start: same network_?", est.network_ is net0, n0, len(est.network_.trajectory))
    check("warm_start", k(X), KC(est)(X), old)
    # partial_fit
    est, X, y = fit()
    k = KC(est)
    old, _ = k(X, eval_gradient=True)
    net0 = est.network_
    est.partial_fit(X, y)
    print("  partial_fit: same network_?", est.network_ is net0)
    check("partial_fit", k(X), KC(est)(X), old)
    # X types
    est, X, y = fit()
    k = KC(est)
    old, _ = k(X, eval_gradient=True)
    check("X as list", k(X.tolist()), KC(est)(X.tolist()))
    check("X as tensor", k(torch.from_numpy(X)), KC(est)(torch.from_numpy(X)))
    check("X float32", k(X.astype(np.float32)), KC(est)(X.astype(np.float32)))
    check("k(X, X)", k(X, X), KC(est)(X, X))
    check("diag", k.diag(X), np.diag(KC(est)(X)))
    # parameters changed directly
    if KC is TangentKernel:
        k.step = 2
        check("k.step=2 attribute", k(X), KC(est, step=2)(X), old)
        k.step = -1
    else:
        k.start = 2
        check("k.start=2 attribute", k(X), KC(est, start=2)(X), old)
        k.start = 0
    k.normalized = True
    check("normalized attr", k(X), KC(est, normalized=True)(X), old)
    k.normalized = False
    k.output = 0
    check("output attr 0", k(X), KC(est, output=0)(X))
    k.output = "trace"
    # p.data = ...  / p.data.mul_ on module (frozen param? buffers)
    m = est.network_.module
    print("  module:", m)
    vs = [p._version for p in m.parameters()]
    p = next(m.parameters())
    p.data.mul_(2.0)
    print("  p.data.mul_ bumps version?", [q._version for q in m.parameters()] != vs)
    check("p.data.mul_ on module param", k(X), KC(est)(X), old)
    p.data = p.data / 2.0
    check("p.data = on module param", k(X), KC(est)(X), old)
