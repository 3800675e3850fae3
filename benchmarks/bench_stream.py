"""Per-call time of a ``partial_fit`` stream: one process A/B against a git ref (before
the growable buffers of ``_path/_buffers.py``).

The default ``PathKernelClassifier`` (one hidden layer of 100 units, Adam) on the 1797
standardized digits, each call 50 consecutive rows (cycling): one Adam step per call.
Two estimators stream side by side, alternating call by call (which goes first
alternates too): ``ref`` continues its path with the ref's ``_continued_path`` and
``extend_trajectory`` (each imported from the ref beside the tree's and put in the
tree's place for its calls; they concatenated the path and the training set at every
call), ``tree`` with the working tree's. Each call is timed by ``time.process_time``;
the table gives each side's median and mean per call over calls 1-250 and 1251-1500
(and the ratio of the late window to the early one). The two sides' paths are checked
equal to the bit at the end.

``solo``: each side streaming alone (the tree, then the ref), the same windows: without
the other side's copies of the whole path between its calls.

``disk``: the same A/B with ``trajectory_storage="disk"``, calls 1-250 and 651-900 of a
900-call stream (the chunk files hold 935 points: the window ends inside the first
chunk, whose filled part every call reads back and rewrites, in both).

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_stream [REF]
[CASES] [RESULTS]`` (REF c629f67, CASES ``memory,solo,disk``, RESULTS ``stream``). Writes
``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

import skpathkernel._estimators._base as base
from benchmarks._ab import ab_provenance, reference_module
from skpathkernel import PathKernelClassifier

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["skpathkernel/_estimators/_base.py", "skpathkernel/_path/_training.py",
           "skpathkernel/_path/_buffers.py", "skpathkernel/_path/_trajectory.py"]
SIZE = 50
_TREE = base._continued_path


def _windows(times, windows):
    return {f"{a}-{b}": dict(median_ms=1e3 * statistics.median(times[a - 1:b]),
                             mean_ms=1e3 * statistics.fmean(times[a - 1:b]))
            for a, b in windows}


def _call(est, X, y, classes, i):
    start = (i * SIZE) % (len(X) - SIZE)
    rows = slice(start, start + SIZE)
    t = time.process_time()
    est.partial_fit(X[rows], y[rows], classes=classes)
    return time.process_time() - t


def ab_case(ref_mod, X, y, storage="memory", n_calls=1500,
            windows=((1, 250), (1251, 1500))):
    classes = np.unique(y)
    sides = {side: PathKernelClassifier(random_state=0, trajectory_storage=storage)
             for side in ("ref", "tree")}
    funcs = {"ref": ref_mod._continued_path, "tree": base._continued_path}
    times = {"ref": [], "tree": []}
    try:
        for i in range(n_calls):
            order = ("ref", "tree") if i % 2 == 0 else ("tree", "ref")
            for side in order:
                base._continued_path = funcs[side]
                times[side].append(_call(sides[side], X, y, classes, i))
    finally:
        base._continued_path = funcs["tree"]
    a, b = (s.trajectory_ for s in sides.values())
    same = len(a) == len(b) and all(
        torch.equal(a.parameters(k), b.parameters(k)) for k in range(len(a))) and all(
        torch.equal(a.optimizer_state(k)[key], b.optimizer_state(k)[key])
        for k in range(len(a) - 1) for key in a.state_keys) and np.array_equal(
        sides["ref"].X_fit_, sides["tree"].X_fit_)
    row = dict(case=storage, n_calls=n_calls, same_path=bool(same),
               note=f"paths and X_fit_ equal to the bit: {bool(same)}",
               points_mib=b._points_nbytes() / 2**20,
               X_fit_mib=sides["tree"].X_fit_.nbytes / 2**20,
               windows={side: _windows(t, windows) for side, t in times.items()},
               times=times)
    if storage == "disk":
        row["note"] += f"; chunk_rows {b._store.chunk_rows}"
    return row


def solo_case(ref_mod, X, y, n_calls=1500, windows=((1, 250), (1251, 1500))):
    """Each side streaming alone, the tree first: in the alternating case the ref's
    copies of the whole path, between two of the tree's calls, leave those to start on
    evicted caches (and a busier allocator) as the path grows."""
    classes = np.unique(y)
    times = {}
    try:
        for side, func in (("tree", base._continued_path), ("ref", ref_mod._continued_path)):
            base._continued_path = func
            est = PathKernelClassifier(random_state=0)
            times[side] = [_call(est, X, y, classes, i) for i in range(n_calls)]
    finally:
        base._continued_path = _TREE
    return dict(case="solo", n_calls=n_calls, note="each side alone, the tree first",
                points_mib=est.trajectory_._points_nbytes()
                / 2**20, windows={side: _windows(t, windows) for side, t in times.items()},
                times=times)


def _cpu():
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")


def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else "c629f67"
    cases = (sys.argv[2] if len(sys.argv) > 2 else "memory,solo,disk").split(",")
    out = ROOT / "benchmarks" / "results" / (sys.argv[3] if len(sys.argv) > 3 else "stream")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    ref_training = reference_module(ROOT, ref, "skpathkernel/_path/_training.py")
    ref_base = reference_module(ROOT, ref, "skpathkernel/_estimators/_base.py")
    ref_base.extend_trajectory = ref_training.extend_trajectory
    prov = ab_provenance(ROOT, "bench_stream", MODULES + ["benchmarks/bench_stream.py"],
                         ref, 1, cpu=_cpu(), shared="2 cores shared with other helpers' runs",
                         load_before=os.getloadavg())
    rows = []
    for case in cases:
        row = (solo_case(ref_base, X, y) if case == "solo" else
               ab_case(ref_base, X, y, case) if case == "memory" else
               ab_case(ref_base, X, y, case, 900, ((1, 250), (651, 900))))
        rows.append(row)
        print(case, json.dumps(row["windows"]), flush=True)
    prov["load_after"] = os.getloadavg()
    out.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows)))
    lines = [f"# A partial_fit stream's per-call time: one process A/B against {ref}", "",
             *(f"- {k}: {v}" for k, v in prov.items()), "",
             "CPU time (`time.process_time`) per `partial_fit` call (one 50-sample Adam "
             "step of the default classifier on the digits), median and mean over each "
             "window of calls; the two sides alternate call by call. late/early: the "
             "late window's median over the early one's (1: constant per call).", "",
             "| case | side | window | median (ms) | mean (ms) |", "|---|---|---|---|---|"]
    for row in rows:
        for side, wins in row["windows"].items():
            for name, w in wins.items():
                lines.append(f"| {row['case']} | {side} | calls {name} | "
                             f"{w['median_ms']:.1f} | {w['mean_ms']:.1f} |")
    lines += ["", "| case | side | late/early (median) | calls | points held (MiB) | "
              "other |", "|---|---|---|---|---|---|"]
    for row in rows:
        for side, wins in row["windows"].items():
            early, late = (w["median_ms"] for w in wins.values())
            lines.append(f"| {row['case']} | {side} | {late / early:.2f} | "
                         f"{row['n_calls']} | {row['points_mib']:.1f} | {row['note']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
