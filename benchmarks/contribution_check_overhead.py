"""CPU-time cost of decompose(method="exact")'s per-contribution check.

The check against an earlier one (``OLD.py``: another commit's ``_decomposition.py``,
loaded beside the package as a module of it), alternated in one process, ``decompose`` called as the
estimators call it (network units, one query block, no warnings): per round one call of
each, order swapped every round; the median of the rounds' time ratios. Cases: the
estimators' defaults on digits (classifier) and diabetes (regressor), and the check's
bad case, converged full-batch Adam (tests/test_quadrature.py's path, 200 iterations),
and the diabetes regressor in float64.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/contribution_check_overhead.py OLD.py
[OLD_COMMIT] [OUT.md] (OLD.py: ``git show OLD_COMMIT:skpathkernel/_analysis/_decomposition.py``;
results: benchmarks/results/contribution_check_overhead.md unless OUT.md is given)
"""
import importlib.util
import os
import platform
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition as new
from skpathkernel._network._trained import network_of

torch.set_num_threads(1)
ROUNDS = 9
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_check_overhead.md")


def load_old(path):
    spec = importlib.util.spec_from_file_location("skpathkernel._analysis._old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cases():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    yield ("digits classifier, defaults (float32 Adam, 64x64 gelu), 300 points, 10 ep, "
           "20 queries", PathKernelClassifier(max_iter=10, random_state=0),
           X[:300], y[:300], X[300:320])
    X, y = load_diabetes(return_X_y=True)
    yield ("diabetes regressor, defaults, 300 points, 10 ep, 20 queries",
           PathKernelMachine(max_iter=10, random_state=0), X[:300], y[:300], X[300:320])
    yield ("diabetes regressor, float64, 300 points, 10 ep, 20 queries",
           PathKernelMachine(max_iter=10, random_state=0, dtype="float64"),
           X[:300], y[:300], X[300:320])
    rng = np.random.RandomState(0)
    X = rng.normal(size=(20, 4))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=20)
    yield ("converged full-batch Adam (gelu 8x8, float64, 200 it), 1 query",
           PathKernelMachine(hidden_layer_sizes=(8, 8), activation="gelu", solver="adam",
                             batch_size=20, learning_rate_init=1e-2, max_iter=200,
                             normalize_y=False, tol=None, n_iter_no_change=10**6,
                             dtype="float64", random_state=0),
           X, y, rng.normal(size=(6, 4))[:1])


def main(old_path, old_commit="the module before the check", path=OUT):
    old = load_old(old_path)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    lines = ["# Cost of the per-contribution check of decompose(method='exact')", "",
             f"`python benchmarks/contribution_check_overhead.py` at commit {commit} "
             f"against {old_commit} (torch {torch.__version__}, one "
             f"thread, {platform.processor() or platform.machine()}, "
             f"{time.strftime('%Y-%m-%d')}). CPU time (`time.process_time`) of one "
             f"`decompose` call each, alternated in one process, {ROUNDS} rounds; "
             "ratio = this commit / the other, the median of the rounds' ratios.", "",
             "| case | other s (median) | this s (median) | ratio (median) | "
             "ratio min-max | walks | contribution_error / (tol*S) |",
             "|---|---|---|---|---|---|---|"]
    for name, est, X, y, Xq in cases():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        net = network_of(est)
        X_fit, Y_fit = net._training_data()
        Xt = net.tensor(Xq)
        args = (net.module, net.trajectory, X_fit, Y_fit, net.loss, Xt)
        walks = []
        run = new._run
        new._run = lambda *a, walks=walks, run=run, **k: walks.append(1) or run(*a, **k)
        times = {"old": [], "new": []}
        res = None
        for k in range(ROUNDS):
            order = ("old", "new") if k % 2 == 0 else ("new", "old")
            for which in order:
                module = old if which == "old" else new
                walks.clear()
                t0 = time.process_time()
                out, checks = module.decompose(*args, memory_budget=net.memory_budget,
                                               warn=False)
                times[which].append(time.process_time() - t0)
                if which == "new":
                    res, n_walks = (out, checks), len(walks)
        new._run = run
        ratios = np.array(times["new"]) / np.array(times["old"])
        result, checks = res
        rel = result.contribution_error / (result.tol * checks.scale)
        row = (f"| {name} | {np.median(times['old']):.2f} | {np.median(times['new']):.2f} | "
               f"{np.median(ratios):.3f} | {ratios.min():.3f}-{ratios.max():.3f} | "
               f"{n_walks} | {rel:.2g} |")
        print(row, flush=True)
        lines.append(row)
    lines.append("")
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:4])
