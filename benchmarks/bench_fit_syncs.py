"""Host reads and dispatched ops per training step of default fits, and their CPU fit time:
a git ref's whole package against the working tree's, in one process (issue 30 item 5).

On a GPU every read of a tensor's value by the host (``.item()``, ``float(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``) waits until the GPU has run everything queued
before it, so the CPU cannot queue the next step's kernels ahead. There is no GPU here: the
reads are counted on the CPU, by proxy. A ``TorchDispatchMode`` counts every dispatched
aten op and those that read a value to the host (``_local_scalar_dense``, the op behind
``.item()`` / ``float`` / ``bool``, and the ops whose result's size depends on values:
``nonzero``, ``masked_select``, ``equal``, ``unique``); ``Tensor.tolist`` and
``Tensor.cpu``, which dispatch nothing on the CPU but copy to the host from a GPU, are
counted by wrapping them. Each count is over one whole fit (its per-fit reads included),
divided by its optimizer steps and its epochs.

Then each case's fit is timed (``time.process_time``, one torch thread), ref and tree
alternating, ``REPS`` times each (default 7); ``max_rel_diff`` is the largest difference
of the two fits' predictions relative to the largest (0: the same training).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_fit_syncs [REF] [RESULTS]``
(REF ``main``; RESULTS ``fit_syncs``). Writes ``benchmarks/results/RESULTS.md`` and
``.json``.
"""

import collections
import functools
import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits, load_iris
from sklearn.preprocessing import StandardScaler
from torch.utils._python_dispatch import TorchDispatchMode

import skpathkernel
from benchmarks._ab import ab_provenance, ab_row, write_ab
from benchmarks.bench_sample_weight_ab import _ref_package

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "diabetes, PathKernelMachine()": (load_diabetes, "PathKernelMachine", {}),
    "iris, PathKernelClassifier()": (load_iris, "PathKernelClassifier", {}),
    "digits, PathKernelClassifier()": (load_digits, "PathKernelClassifier", {}),
    "diabetes, early_stopping=True": (load_diabetes, "PathKernelMachine",
                                      dict(early_stopping=True)),
    "digits, sgd nesterov adaptive": (load_digits, "PathKernelClassifier",
                                      dict(solver="sgd", momentum=0.9,
                                           learning_rate="adaptive")),
}
_aten = torch.ops.aten
SYNCING = (_aten._local_scalar_dense.default, _aten.nonzero.default,
           _aten.masked_select.default, _aten.equal.default, _aten._unique2.default,
           _aten.unique_consecutive.default)


class _Counts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["ops"] += 1
        if func in SYNCING:
            self.counts["syncs"] += 1
        return func(*args, **(kwargs or {}))


def host_reads(make):
    """``make()``'s result and what it dispatched and read on the host: counts of
    ``ops`` (every dispatched aten op), ``syncs`` (those of ``SYNCING``), and the calls
    of ``tolist`` and ``cpu``."""
    mode = _Counts()

    def wrapped(name):
        original = getattr(torch.Tensor, name)

        def call(self, *args, **kwargs):
            mode.counts[name] += 1
            return original(self, *args, **kwargs)
        return call

    with mock.patch.object(torch.Tensor, "tolist", wrapped("tolist")), \
            mock.patch.object(torch.Tensor, "cpu", wrapped("cpu")), mode:
        out = make()
    return out, mode.counts


def _fit(cls, params, X, y):
    return cls(random_state=0, **params).fit(X, y)


def _data(load):
    X, y = load(return_X_y=True)
    return StandardScaler().fit_transform(X), y


def main(ref="main", results="fit_syncs"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "7"))
    old = _ref_package(ref)
    packages = {"ref": old, "tree": skpathkernel}
    rows, lines = [], []
    warnings.simplefilter("ignore")
    for case, (load, kind, params) in CASES.items():
        X, y = _data(load)
        fit = {side: functools.partial(_fit, getattr(pkg, kind), params, X, y)
               for side, pkg in packages.items()}
        counted = {}
        for side in ("ref", "tree"):
            est, counts = host_reads(fit[side])
            steps, epochs = int(est.t_), len(est.loss_curve_)  # optimizer steps, epochs
            counted[side] = dict(counts, steps=steps, epochs=epochs)
            lines.append(
                f"| {case} | {side} | {epochs} | {steps} | {counts['syncs']} | "
                f"{counts['syncs'] / steps:.2f} | {counts['syncs'] / epochs:.2f} | "
                f"{counts['tolist'] + counts['cpu']} | "
                f"{(counts['syncs'] + counts['tolist'] + counts['cpu']) / epochs:.2f} | "
                f"{counts['ops']} | {counts['ops'] / steps:.1f} |")
            print(lines[-1], flush=True)
        times, out = {"ref": [], "tree": []}, {}
        for _ in range(reps):
            for side in ("ref", "tree"):
                c0 = time.process_time()
                est = fit[side]()
                times[side].append(time.process_time() - c0)
                out[side] = (est.predict(X) if kind == "PathKernelMachine"
                             else est.predict_proba(X))
        diff = float(np.abs(out["ref"] - out["tree"]).max() / np.abs(out["ref"]).max())
        row = ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff,
                     counts={side: dict(c) for side, c in counted.items()})
        rows.append(row)
        print(f"{case}: ref {row['ref_median']:.3f} s, tree {row['tree_median']:.3f} s "
              f"(median ratio {row['ratio_median']:.3f}), diff {diff:.1e}", flush=True)
    prov = ab_provenance(ROOT, "bench_fit_syncs",
                         ["skpathkernel", "benchmarks/bench_fit_syncs.py"], ref, reps)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, f"Default fits' host reads per step, and CPU fit time: ref ({ref}) vs "
             "tree", "time.process_time", prov, rows, 3, machine=True)
    table = [
        "", "## Host reads and dispatched ops per fit", "",
        "Counted on the CPU over one whole fit (per-fit reads included). syncs: the "
        "dispatched ops that read a value to the host (`_local_scalar_dense`, behind "
        "`.item()` / `float(t)` / `bool(t)`; `nonzero`, `masked_select`, `equal`, "
        "`unique`). tolist + cpu: calls of `Tensor.tolist` and `Tensor.cpu`, which "
        "dispatch nothing on the CPU (here they read CPU tensors) but copy from a GPU. "
        "reads / epoch: syncs, tolist and cpu together, per epoch.", "",
        "| case | side | epochs | steps | syncs | syncs / step | syncs / epoch | "
        "tolist + cpu | reads / epoch | ops | ops / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *lines, "",
        "The GPU effect is not measured here (no GPU in this session): on a GPU a read "
        "waits for every kernel queued before it, so a read per step kept the CPU from "
        "queueing the next step while the GPU ran this one; `benchmarks/device_check.sh` "
        "times the default fits (the defaults group) on the next GPU run, and "
        "tests/test_cuda.py counts a fit's waits with torch's sync debug mode.", "",
        "Reads these counts cannot see, left as they were: on a GPU each epoch's batch "
        "order (and sample weights) goes to the device from pageable memory, which torch "
        "copies synchronously (once an epoch, right after the epoch loss's read, when "
        "the GPU has nothing queued); `trajectory_storage='disk'` copies every recorded "
        "point into its chunk's (unpinned) memory, a wait per step on a GPU; "
        "`PathRecorder` (an own loop) checks the parameters every step.",
    ]
    with open(out.with_suffix(".md"), "a") as f:
        f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
