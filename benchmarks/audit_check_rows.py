"""contribution_error and contributions of this commit's decompose against another
commit's ``_decomposition.py`` (OLD.py, loaded beside the package), both against the
true per-contribution error: a float64 16-node reference of the same recorded path
(``audit_contribution_error.reference``). Default float32 classifier and regressor,
float64 variants, plain SGD (the factor route), other seeds; in units of tol * S.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_check_rows.py OLD.py [words]
(numbers quoted in benchmarks/results/contribution_check_overhead.md)
"""
import os
import sys
import warnings

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits

sys.path.insert(0, os.path.dirname(__file__))
import audit_contribution_error as ace
from contribution_check_overhead import load_old

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition as new
from skpathkernel._network._trained import network_of

torch.set_num_threads(1)


def cases():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    digits = (X[:300], y[:300], X[300:320])
    Xd, yd = load_diabetes(return_X_y=True)
    diabetes = (Xd[:300], yd[:300], Xd[300:320])
    sgd = dict(solver="sgd", momentum=0.0, learning_rate_init=0.1)
    yield "digits f32", PathKernelClassifier(max_iter=10, random_state=0), digits
    yield "digits f64", PathKernelClassifier(max_iter=10, random_state=0, dtype="float64"), digits
    yield "diabetes f32", PathKernelMachine(max_iter=10, random_state=0), diabetes
    yield ("diabetes f64", PathKernelMachine(max_iter=10, random_state=0, dtype="float64"),
           diabetes)
    yield "sgd digits f32", PathKernelClassifier(max_iter=10, random_state=0, **sgd), digits
    yield ("sgd digits f32 wd",
           PathKernelClassifier(max_iter=10, random_state=0, alpha=1e-2, **sgd), digits)
    yield ("sgd digits f64 wd", PathKernelClassifier(max_iter=10, random_state=0, alpha=1e-2,
                                                     dtype="float64", **sgd), digits)
    for seed in (1, 2):
        yield (f"digits f32 seed{seed}", PathKernelClassifier(max_iter=10, random_state=seed),
               (X[:300], y[:300], X[320:340]))
        yield (f"diabetes f32 seed{seed}", PathKernelMachine(max_iter=10, random_state=seed),
               (Xd[:300], yd[:300], Xd[320:340]))


def fitted(cases, want=()):
    """``(name, net, Xq, args)`` per case whose name holds one of ``want`` (all without):
    the estimator fitted quietly, ``args`` those of ``decompose`` for its queries."""
    for name, est, (X, y, Xq) in cases:
        if want and not any(w in name for w in want):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        net = network_of(est)
        X_fit, Y_fit = net._training_data()
        yield name, net, Xq, (net.module, net.trajectory, X_fit, Y_fit, net.loss,
                              net.tensor(Xq))


def main(old_path, *want):
    old = load_old(old_path)
    for name, net, Xq, args in fitted(cases(), want):
        (ro, co), (rn, cn) = (m.decompose(*args, memory_budget=net.memory_budget, warn=False)
                              for m in (old, new))
        ref = ace.reference(net, Xq)
        ts = ro.tol * co.scale
        true_o, true_n = (np.abs(r.contributions - ref.contributions).max() for r in (ro, rn))
        moved = np.abs(rn.contributions - ro.contributions).max()
        big = np.abs(ro.contributions).max()
        print(f"{name}: contribution_error/(tol S) old {ro.contribution_error / ts:.3g} "
              f"new {rn.contribution_error / ts:.3g} | true error/(tol S) old "
              f"{true_o / ts:.3g} new {true_n / ts:.3g} | contributions moved "
              f"{moved / big:.2g} of the largest, regularization "
              f"{np.abs(rn.regularization - ro.regularization).max():.2g} | slow steps old "
              f"{len(co.slow)} new {len(cn.slow)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
