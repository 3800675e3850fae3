"""One-process A/B of the autograd check for hidden reads: torch ops and CPU time.

``_tangent._capture._numerical_misfits`` runs once per ``tangent_gram`` call (and at a
path's first, middle and last points per path kernel): one backward pass per output over
two samples, compared with the rules' factors. The ref's function (``git show REF:...``)
is loaded beside the tree's and swapped in and out of the engine, the two sides
alternating; each case is ``tangent_gram`` (the trace Gram) on a network of
:mod:`benchmarks._nets`, timed by ``time.process_time`` on one torch thread. The ops
column counts the torch operations each side dispatches in one call (a
``TorchDispatchMode``; views and the backward passes' operations included): on a GPU
every one costs a kernel launch or at least the dispatcher's few microseconds, which
dominate calls this small (``results/gram_nets-quick-cuda.md``: roofline ratios 0.00-0.01).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_ops_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``ops_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _worker
from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel._tangent import _capture, _gram, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
REPS = 7
CASES = [("mlp 2-64-64-1", 128), ("cnn8", 128), ("cifar", 128), ("resnet", 64), ("vit", 64),
         ("transformer", 128)]


class _Count(TorchDispatchMode):
    """The number of torch operations dispatched inside the mode."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _problem(name, n):
    if name.startswith("mlp"):
        return _worker.gram_problem({"sizes": (2, 64, 64, 1), "n": n, "dtype": "float32"})
    return _worker.gram_problem({"arch": name, "n": n, "dtype": "float32"})


def main(ref="main", results="ops_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    ref_capture = reference_module(ROOT, ref, "skpathkernel/_tangent/_capture.py")
    sides = {"ref": ref_capture._numerical_misfits, "tree": _capture._numerical_misfits}
    rows = []
    for name, n in CASES:
        module, params, X = _problem(name, n)
        times, grams, ops = {"ref": [], "tree": []}, {}, {}
        for rep in range(REPS + 1):
            for side, fn in sides.items():
                _gram._numerical_misfits = fn
                start = time.process_time()
                grams[side] = tangent_gram(module, params, X)
                if rep:  # the first round warms up
                    times[side].append(time.process_time() - start)
        for side, fn in sides.items():
            _gram._numerical_misfits = fn
            with _Count() as count:
                tangent_gram(module, params, X)
            ops[side] = count.ops
        _gram._numerical_misfits = sides["tree"]
        diff = ((grams["ref"] - grams["tree"]).abs().max() / grams["ref"].abs().max()).item()
        rows.append(ab_row(f"{name}, N={n}", times, os.getloadavg()[0], max_rel_diff=diff,
                           ops_ref=ops["ref"], ops_tree=ops["tree"]))
        print(rows[-1]["case"], f"{rows[-1]['ratio_least']:.3f}", ops, flush=True)
    prov = ab_provenance(ROOT, "bench_ops_ab",
                         ["skpathkernel/_tangent/_capture.py", "benchmarks/bench_ops_ab.py"],
                         ref, REPS)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "The autograd check for hidden reads, vectorised: ref vs tree",
             "time.process_time", prov, rows, 4,
             columns=[("ops ref", "ops_ref"), ("ops tree", "ops_tree")])


if __name__ == "__main__":
    main(*sys.argv[1:])
