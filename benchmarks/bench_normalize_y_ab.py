"""One-process A/B of ``attribute(method="unrolled")`` on ``normalize_y`` regressors: a git
ref's whole package (the targets' mean and scale held at the fit's values) against the
working tree's (the sweep also takes the targets' products, every step, to differentiate
them: the cost this measures).

Each case fits the same regressor with both packages (the same training: the fits'
predictions are compared) on standardized ``load_diabetes`` and times
``attribute(X[:Q], method="unrolled")``, ref and tree alternating, ``REPS`` times each
(default 7), by ``time.process_time`` on one torch thread. ``max_rel_diff``: the largest
difference of the two packages' scores relative to the largest score (the moments'
part the ref leaves out); ``fit_diff`` the same of the predictions (0: one training).

Cases: the default network (a plain MLP: the hand-written products), and a network with
a LayerNorm (``module=``: forward over reverse or the double backward, as chosen).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_normalize_y_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``normalize_y_ab``). Writes ``benchmarks/results/RESULTS.md`` and
``.json``.
"""

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_diabetes
from sklearn.preprocessing import StandardScaler

import skpathkernel
from benchmarks._ab import ab_provenance, ab_row, write_ab
from benchmarks.bench_sample_weight_ab import _ref_package

ROOT = Path(__file__).resolve().parent.parent
Q = 20


def _layernorm_net(n_features, n_outputs):
    return torch.nn.Sequential(torch.nn.Linear(n_features, 32), torch.nn.LayerNorm(32),
                               torch.nn.Tanh(), torch.nn.Linear(32, n_outputs))


CASES = {
    "default MLP (64, 64), Adam, 30 epochs": dict(max_iter=30),
    "LayerNorm module, Adam, 30 epochs": dict(module=_layernorm_net, max_iter=30),
}


def _timed(est, X):
    c0 = time.process_time()
    scores = np.asarray(est.attribute(X[:Q], method="unrolled"))
    return time.process_time() - c0, scores


def main(ref="main", results="normalize_y_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "7"))
    old = _ref_package(ref)
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    rows = []
    for name, params in CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ests = {side: pkg.PathKernelMachine(random_state=0, tol=None, **params).fit(X, y)
                    for side, pkg in (("ref", old), ("tree", skpathkernel))}
            fit_diff = float(np.abs(ests["ref"].predict(X) - ests["tree"].predict(X)).max()
                             / np.abs(ests["ref"].predict(X)).max())
            times, scores = {"ref": [], "tree": []}, {}
            for _ in range(reps):
                for side in ("ref", "tree"):
                    t, scores[side] = _timed(ests[side], X)
                    times[side].append(t)
        diff = float(np.abs(scores["ref"] - scores["tree"]).max()
                     / np.abs(scores["tree"]).max())
        row = ab_row(name, times, os.getloadavg()[0], max_rel_diff=diff, fit_diff=fit_diff)
        rows.append(row)
        print(f"{name}: ref {row['ref_least']:.3f}/{row['ref_median']:.3f} s, tree "
              f"{row['tree_least']:.3f}/{statistics.median(times['tree']):.3f} s (ratio "
              f"least {row['ratio_least']:.3f}, median {row['ratio_median']:.3f}), scores "
              f"differ by {diff:.1e}, fits by {fit_diff:.1e}, load {row['load']:.2f}",
              flush=True)
    prov = ab_provenance(ROOT, "bench_normalize_y_ab",
                         ["skpathkernel", "benchmarks/bench_normalize_y_ab.py"], ref, reps)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, f"attribute(X[:{Q}], method='unrolled') of normalize_y regressors: ref "
             "(moments held) vs tree (moments differentiated)", "time.process_time", prov,
             rows, 3, columns=(("fits' max rel. diff", "fit_diff"),))


if __name__ == "__main__":
    main(*sys.argv[1:])
