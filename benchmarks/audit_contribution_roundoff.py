"""Does ``contribution_error`` cover a float32 path's round-off?

On a float32 path the true error of one contribution (against a float64 16-node
reference of the same recorded path, ``audit_contribution_error.reference``) is mostly
the round-off of the float32 factors the shares are computed from, which the difference
of the n-node and (n+1)-node rules does not measure. ``decompose`` adds to each
contribution's difference ``ROUNDOFF * eps32 * sum_t |share_t|``. Per case: the true
error, the previous code's ``contribution_error`` (OLD.py: another commit's
``_decomposition.py``), this code's and its round-off part, their ratio to the true
error, ``K_min`` (the smallest factor in place of ROUNDOFF that brings the largest
difference-plus-round-off up to the true error: 0 where the difference alone does) and
the warnings this code issues; in units of tol * S. Float32 cases of
``audit_check_rows.py``, two more seeds, two small CNNs and converged full-batch Adam.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_contribution_roundoff.py OLD.py
[OLD_COMMIT] (results: benchmarks/results/contribution_roundoff.md)
"""
import os
import platform
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from contribution_check_overhead import load_old

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition as new
from skpathkernel._network._trained import network_of

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_roundoff.md")
EPS = float(torch.finfo(torch.float32).eps)


def cases():
    yield from ((n, e, d) for n, e, d in audit_check_rows.cases() if "f64" not in n)
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    Xd, yd = load_diabetes(return_X_y=True)
    for seed in (3, 4):
        yield (f"digits f32 seed{seed}", PathKernelClassifier(max_iter=10, random_state=seed),
               (X[:300], y[:300], X[340:360]))
        yield (f"diabetes f32 seed{seed}", PathKernelMachine(max_iter=10, random_state=seed),
               (Xd[:300], yd[:300], Xd[340:360]))
    digits = (X[:300], y[:300], X[300:320])
    yield ("CNN digits f32, SGD (50), 30 ep",
           PathKernelClassifier(module=ace.SmallCNN, solver="sgd", batch_size=50,
                                learning_rate_init=0.1, max_iter=30, random_state=0), digits)
    yield ("CNN digits f32, Adam defaults, 10 ep",
           PathKernelClassifier(module=ace.SmallCNN, max_iter=10, random_state=0), digits)
    for seed in (0, 1, 2):
        # Full-batch Adam near convergence, whose contributions cancel to a few times the
        # prediction (tests/test_quadrature.py's path, in float32).
        rng = np.random.RandomState(seed)
        X = rng.normal(size=(20, 4))
        y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=20)
        yield (f"converged full-batch Adam (gelu 8x8, 20 points, 200 it) f32 seed{seed}",
               PathKernelMachine(hidden_layer_sizes=(8, 8), activation="gelu",
                                 solver="adam", batch_size=20, learning_rate_init=1e-2,
                                 max_iter=200, normalize_y=False, tol=None,
                                 n_iter_no_change=10**6, random_state=0),
               (X, y, rng.normal(size=(2, 4))))


def main(old_path, old_commit="the previous commit"):
    old = load_old(old_path)
    seen = {}
    check = new._contribution_check

    def keep(walk, first, *args, **kwargs):
        out = check(walk, first, *args, **kwargs)
        seen["pair"] = first[3]
        return out

    new._contribution_check = keep
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    lines = [
        "# Float32 round-off in decompose(method='exact')'s contribution_error", "",
        f"`python benchmarks/audit_contribution_roundoff.py OLD.py` at commit {commit} "
        f"against {old_commit} (torch {torch.__version__}, one thread, "
        f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}). "
        "In units of tol * S (the default tol, S the largest |f| along the path). `true`: "
        "the largest error of one contribution against a float64 16-node reference of "
        "the same recorded path. `K_min`: the factor in place of ROUNDOFF "
        f"({new.ROUNDOFF}) that would bring the largest `|difference| + K eps32 "
        "sum_t |share_t|` up to `true` (0: the difference alone does).", "",
        "| case | true | old contribution_error | new | of which round-off | new / true | "
        "K_min | warnings (new) |", "|---|---|---|---|---|---|---|---|"]
    for name, est, (X, y, Xq) in cases():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        net = network_of(est)
        X_fit, Y_fit = net._training_data()
        ref = ace.reference(net, Xq).contributions
        args = (net.module, net.trajectory, X_fit, Y_fit, net.loss, net.tensor(Xq))
        ro, _ = old.decompose(*args, memory_budget=net.memory_budget, warn=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new.decompose(*args, memory_budget=net.memory_budget)
        msgs = sorted({m.category.__name__ for m in caught
                       if not issubclass(m.category, (DeprecationWarning, FutureWarning))})
        rn, cn = new.decompose(*args, memory_budget=net.memory_budget, warn=False)
        ts = rn.tol * cn.scale
        true = float(np.abs(rn.contributions - ref).max())
        diff, size = np.abs(seen["pair"][0]), seen["pair"][2]
        lo, hi = 0.0, 100.0
        if diff.max() >= true:
            hi = 0.0
        for _ in range(60 if hi else 0):  # bisection of the factor
            k = (lo + hi) / 2
            lo, hi = (lo, k) if np.max(diff + k * EPS * size) >= true else (k, hi)
        row = (f"| {name} | {true / ts:.3g} | {ro.contribution_error / ts:.3g} | "
               f"{rn.contribution_error / ts:.3g} | {cn.roundoff / ts:.3g} | "
               f"{rn.contribution_error / true:.3g} | {hi:.2g} | "
               f"{', '.join(msgs) or 'none'} |")
        print(row, flush=True)
        lines.append(row)
    new._contribution_check = check
    with open(OUT, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
