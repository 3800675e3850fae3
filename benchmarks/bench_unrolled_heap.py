"""The unrolled attribution with and without ``retained_heap`` (``skpathkernel/_memory.py``):
glibc's heap keeping freed memory for the next step against glibc's own settings.

malloc's settings are process-wide and cannot be read back, so each side runs in a fresh
process of its own (``ref``: ``_memory.RETAIN_HEAP = False``, glibc as it comes; ``tree``:
the package as it is), the two alternating, ``REPS`` times each (default 2). Each process
fits the case's network, calls it once to warm up (the first call of a process imports
what the routes need), then times a second call by ``time.process_time`` (page faults are
system time, which it counts) and reports its peak resident memory (``ru_maxrss``, the
whole process). Cases: ``benchmarks/bench_unrolled_routes.py``'s (``default``: the MLP
route, ``cnn-lr0.5``: forward over reverse, ``cnn-lr0.5-f64``: the double backward,
``tiny``: self-influence of a tiny MLP), one torch thread.

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_unrolled_heap [CASES]``.
Writes ``benchmarks/results/unrolled_heap`` ``.md`` and ``.json`` (another name by ``OUT``).
"""

import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks._ab import ab_provenance, ab_row, write_ab

ROOT = Path(__file__).resolve().parent.parent
CASES = "default,cnn-lr0.5,cnn-lr0.5-f64,tiny"


def _child(case: str, side: str) -> None:
    """One side's timed call, in this fresh process; its reply on stdout."""
    import torch

    import skpathkernel._memory as memory
    from benchmarks.bench_attribution import digits
    from benchmarks.bench_unrolled_routes import _call

    memory.RETAIN_HEAP = side == "tree"
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    call = _call(case, digits(False))
    call()
    start = time.process_time()
    scores = np.asarray(call())
    seconds = time.process_time() - start
    np.save(os.environ["SCORES"], scores)
    print(json.dumps(dict(seconds=seconds, maxrss_mib=resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024)))


def _side(case: str, side: str, scores: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_unrolled_heap", "--child",
                          case, side], cwd=ROOT, env=dict(os.environ, SCORES=str(scores)),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(names=CASES):
    reps = int(os.environ.get("REPS", "2"))
    load_before = os.getloadavg()
    rows = []
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for case in names.split(","):
        times, rss, files = {"ref": [], "tree": []}, {"ref": [], "tree": []}, {}
        for r in range(reps):
            for side in ("ref", "tree") if r % 2 == 0 else ("tree", "ref"):
                files[side] = tmp / f"heap_{case}_{side}.npy"
                reply = _side(case, side, files[side])
                times[side].append(reply["seconds"])
                rss[side].append(reply["maxrss_mib"])
        ref, tree = np.load(files["ref"]), np.load(files["tree"])
        row = ab_row(case, times, os.getloadavg()[0],
                     max_rel_diff=float(np.abs(ref - tree).max() / np.abs(ref).max()),
                     ref_maxrss_mib=max(rss["ref"]), tree_maxrss_mib=max(rss["tree"]))
        rows.append(row)
        print(f"{case}: glibc {row['ref_least']:.2f} s ({row['ref_maxrss_mib']:.0f} MiB), "
              f"retained {row['tree_least']:.2f} s ({row['tree_maxrss_mib']:.0f} MiB), "
              f"ratio {row['ratio_least']:.3f}", flush=True)
    prov = ab_provenance(ROOT, "bench_unrolled_heap",
                         ["skpathkernel/_memory.py", "skpathkernel/_analysis/_unrolled.py",
                          "benchmarks/bench_unrolled_heap.py"],
                         "glibc's heap as it comes (RETAIN_HEAP = False)", reps,
                         load_before=load_before,
                         peak_rss_mib={r["case"]: (r["ref_maxrss_mib"], r["tree_maxrss_mib"])
                                       for r in rows})
    write_ab(ROOT / "benchmarks" / "results" / os.environ.get("OUT", "unrolled_heap"),
             "Unrolled attribution: glibc's heap as it comes (ref) against retained_heap "
             "(tree), each side in its own process", "time.process_time", prov, rows, 2)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(*sys.argv[2:4])
    else:
        main(*sys.argv[1:])
