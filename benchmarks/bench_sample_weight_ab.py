"""One-process A/B of the default fit without weights: a git ref's whole package against
the working tree's (``sample_weight`` added a branch per step to the training loop, the
recorder and the hand-written gradient; the unweighted fit must not slow down), and the
tree's fit with non-uniform weights beside them.

The ref's ``skpathkernel`` is extracted by ``git archive`` and imported as ``skp_ref``
(its imports are relative). Each case fits the default estimator on a standardized
bundled data set, ref and tree alternating, ``REPS`` times each (default 7), timed by
``time.process_time`` on one torch thread; then the tree with weights
``1 + (i % 3)`` (``weighted_least`` / ``weighted_median``). ``max_rel_diff``: the largest
difference of the ref's and the tree's predictions relative to the largest prediction
(0: bit-identical).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_sample_weight_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``sample_weight_ab``). Writes ``benchmarks/results/RESULTS.md``
and ``.json``.
"""

import importlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris, load_wine
from sklearn.preprocessing import StandardScaler

import skpathkernel
from benchmarks._ab import ab_provenance, ab_row, write_ab

ROOT = Path(__file__).resolve().parent.parent
SETS = {"iris": (load_iris, "PathKernelClassifier"), "wine": (load_wine, "PathKernelClassifier"),
        "breast_cancer": (load_breast_cancer, "PathKernelClassifier"),
        "diabetes": (load_diabetes, "PathKernelMachine")}


def _ref_package(ref):
    """The package at git ``ref``, imported as ``skp_ref``."""
    folder = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", ref, "skpathkernel"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(folder, filter="data")
    (folder / "skpathkernel").rename(folder / "skp_ref")
    sys.path.insert(0, str(folder))
    return importlib.import_module("skp_ref")


def _cpu_fit(cls, X, y, **fit):
    c0 = time.process_time()
    est = cls(random_state=0).fit(X, y, **fit)
    return time.process_time() - c0, est


def main(ref="main", results="sample_weight_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "7"))
    old = _ref_package(ref)
    rows = []
    for name, (load, kind) in SETS.items():
        X, y = load(return_X_y=True)
        X = StandardScaler().fit_transform(X)
        w = 1.0 + np.arange(len(y)) % 3
        times, weighted = {"ref": [], "tree": []}, []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(reps):
                t_ref, est_ref = _cpu_fit(getattr(old, kind), X, y)
                t_tree, est_tree = _cpu_fit(getattr(skpathkernel, kind), X, y)
                t_w, _ = _cpu_fit(getattr(skpathkernel, kind), X, y, sample_weight=w)
                times["ref"].append(t_ref)
                times["tree"].append(t_tree)
                weighted.append(t_w)
        out_ref, out_tree = (e.predict(X) if kind == "PathKernelMachine" else
                             e.predict_proba(X) for e in (est_ref, est_tree))
        diff = float(np.abs(out_ref - out_tree).max() / np.abs(out_ref).max())
        row = ab_row(name, times, os.getloadavg()[0], max_rel_diff=diff,
                     weighted_least=min(weighted),
                     weighted_median=statistics.median(weighted))
        rows.append(row)
        print(f"{name}: ref {row['ref_least']:.3f}/{row['ref_median']:.3f} s, tree "
              f"{row['tree_least']:.3f}/{row['tree_median']:.3f} s (ratio least "
              f"{row['ratio_least']:.3f}, median {row['ratio_median']:.3f}), weighted "
              f"{min(weighted):.3f}/{statistics.median(weighted):.3f} s, max rel diff "
              f"{diff:.1e}, load {row['load']:.2f}", flush=True)
    prov = ab_provenance(ROOT, "bench_sample_weight_ab",
                         ["skpathkernel", "benchmarks/bench_sample_weight_ab.py"], ref, reps)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, "Default fits without sample_weight: ref vs tree (and the tree weighted)",
             "time.process_time", prov, rows, 3)
    # The weighted column, beside the table.
    with out.with_suffix(".md").open("a") as f:
        f.write("\nThe tree's fit with weights `1 + (i % 3)` (least / median, s): "
                + ", ".join(f"{r['case']} {r['weighted_least']:.3f} / "
                            f"{r['weighted_median']:.3f}" for r in rows) + ".\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
