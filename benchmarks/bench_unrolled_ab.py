"""One process A/B of the unrolled attribution (``skpathkernel/_analysis/_unrolled.py``):
a git ref's module against the working tree's, on the unrolled rows of
``benchmarks/bench_attribution.py`` (sklearn's digits, 1000 training points, plain SGD,
batch 128, 100 held-out queries, the margin of each query's label), with the time over
the same FLOP floor as ``benchmarks/results/attribution.md``.

Each case fits its network once (``bench_attribution.estimator``: the MLP 64-64-64-10 or
the CNN conv8-pool-conv16-fc10, tanh; ``lr0.5``: 10 epochs, 80 steps; ``lr0.1``: 30
epochs, 240 steps; ``adam``: Adam at ``learning_rate_init=1e-3``, 10 epochs; ``f64``: the
same training in float64), then times
``clf.attribute(X_query, y_query, method="unrolled")`` with each module in turn,
alternating, ``REPS`` times each (default 3), by ``time.process_time`` on one torch
thread. The floor: per step one forward-backward of the batch plus one Hessian-vector
product per query, matmul and convolution FLOPs by ``torch.utils.flop_counter``
(``bench_attribution._flop_floor``), over the best ``torch.matmul`` rate measured in this
process (``bench_attribution._gemm_rate``); time / floor uses each side's least time.
The largest relative difference is between the two modules' scores (max over entries of
the absolute difference, over the largest absolute score).

Usage: ``THREADS=1 taskset -c 0 python -m benchmarks.bench_unrolled_ab [REF] [CASES]``
(REF ``main``, CASES ``mlp-lr0.5,cnn-lr0.5,mlp-lr0.1,cnn-lr0.1,mlp-lr0.5-f64,
cnn-lr0.5-f64``). Writes ``benchmarks/results/unrolled_ab`` ``.md`` and ``.json``
(another name by ``OUT``; provenance: command, commit, ref, date, machine, load, cores).
"""

import json
import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import skpathkernel._analysis._unrolled as new
from benchmarks._ab import ab_provenance, ab_row, reference_module
from benchmarks.bench_attribution import _flop_floor, _gemm_rate, digits, estimator
from skpathkernel._network import _trained

ROOT = Path(__file__).resolve().parent.parent
MODULE = "skpathkernel/_analysis/_unrolled.py"
CASES = "mlp-lr0.5,cnn-lr0.5,mlp-lr0.1,cnn-lr0.1,mlp-lr0.5-f64,cnn-lr0.5-f64"


def _reference_module(ref):
    """The module at git ``ref``, imported beside the working tree's."""
    return reference_module(ROOT, ref, MODULE)


def _fit(case, data):
    model, setting, *rest = case.split("-")
    if setting == "adam":  # Adam at its usual step size, 10 epochs
        clf = estimator(model, False, lr=1e-3, epochs=10).set_params(solver="adam")
    else:
        clf = estimator(model, False, setting)
    if rest == ["f64"]:
        clf.set_params(dtype="float64")
    return model, clf.fit(data[0], data[1])


def _scores(clf, mod, data):
    with mock.patch.object(_trained, "unrolled_scores", mod.unrolled_scores), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.process_time()
        scores = clf.attribute(data[2], data[3], method="unrolled")
        return time.process_time() - t, np.asarray(scores)


def main(ref="main", names=CASES):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "3"))
    old = _reference_module(ref)
    data = digits(False)
    load_before = os.getloadavg()
    rate, shape = _gemm_rate([(1024, 1024, 1024), (100 * 128, 64, 64)])
    rows = []
    for case in names.split(","):
        model, clf = _fit(case, data)
        floor = _flop_floor(model, clf, len(data[2]))
        floor_s = floor["flops"] / rate
        times, scores = {"ref": [], "tree": []}, {}
        for r in range(reps):
            order = [("ref", old), ("tree", new)]
            for key, mod in order if r % 2 == 0 else order[::-1]:
                seconds, scores[key] = _scores(clf, mod, data)
                times[key].append(seconds)
        row = ab_row(case, times, os.getloadavg()[0], steps=floor["steps"],
                     floor_s=floor_s, dtype=clf.dtype_ if hasattr(clf, "dtype_") else "")
        row["max_rel_diff"] = float(np.abs(scores["ref"] - scores["tree"]).max()
                                    / np.abs(scores["ref"]).max())
        row["ref_over_floor"] = row["ref_least"] / floor_s
        row["tree_over_floor"] = row["tree_least"] / floor_s
        rows.append(row)
        print(f"{case}: ref {row['ref_least']:.2f} s (median {row['ref_median']:.2f}), "
              f"tree {row['tree_least']:.2f} s (median {row['tree_median']:.2f}), "
              f"ratio {row['ratio_least']:.3f} least, floor {floor_s:.2f} s, "
              f"max rel diff {row['max_rel_diff']:.1e}, load {row['load']:.2f}", flush=True)
    prov = ab_provenance(ROOT, "bench_unrolled_ab", [MODULE, "benchmarks/bench_unrolled_ab.py",
                                                     "benchmarks/_ab.py"], ref, reps,
                         load_before=load_before,
                         matmul_rate=f"{rate / 1e9:.1f} GFLOP/s ({shape})")
    _write(ROOT / "benchmarks" / "results" / os.environ.get("OUT", "unrolled_ab"), prov, rows)


def _write(out, prov, rows):
    out.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows),
                                                   indent=1, default=str))
    lines = ["# Unrolled attribution: one process A/B against a git ref", "",
             *(f"- {k}: {v}" for k, v in prov.items()), "",
             "From `benchmarks/bench_unrolled_ab.py`. CPU time (`time.process_time`, one "
             "torch thread) of `attribute(X_query, y_query, method=\"unrolled\")`, 100 "
             "queries, least and median of the repeats, the two sides alternating; ratio = "
             "ref / tree (above 1: the tree is faster). Floor: per step one forward-backward "
             "of the batch plus one Hessian-vector product per query (matmul and "
             "convolution FLOPs, torch.utils.flop_counter) over the matmul rate above; "
             "time / floor from the least times. Max rel. diff: the two sides' scores. "
             "A loaded machine: compare ratios, not times.", "",
             "| case | steps | floor (s) | ref least (s) | ref median | ref / floor | "
             "tree least (s) | tree median | tree / floor | ratio least | ratio median | "
             "max rel. diff | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['steps']} | {r['floor_s']:.2f} | "
                     f"{r['ref_least']:.2f} | {r['ref_median']:.2f} | "
                     f"{r['ref_over_floor']:.1f} | {r['tree_least']:.2f} | "
                     f"{r['tree_median']:.2f} | {r['tree_over_floor']:.1f} | "
                     f"{r['ratio_least']:.3f} | {r['ratio_median']:.3f} | "
                     f"{r['max_rel_diff']:.1e} | {r['load']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
