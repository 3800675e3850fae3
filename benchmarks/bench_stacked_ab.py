"""One process A/B of the stacked path kernel (``skpathkernel/_tangent/_stacked.py``):
a git ref's module against the working tree's, on the default Adam classifier's
``path_kernel_(X[:1000])`` (standardised digits, 1000 training points).

The call's arguments to ``stacked_path_sum`` are captured once (the fitted estimator's
parameters and preconditioners at its first 63 recorded points; the call's block size is
21),
then each case runs both modules alternately, ``REPS`` times each (default 8), timed by
``time.thread_time`` on one torch thread:

- ``sides``: one block's forward and backward over its 21 points (``_block_sides``) and
  the "units" layer's backprops laid out for SciPy's GEMMs (``_contiguous_units``), each
  module's work buffers kept from one call to the next as they are from one block to the
  next within a call;
- ``block8`` / ``block21``: ``stacked_path_sum`` over the first 8 / 21 points, one block;
- ``blocks63``: over the first 63 points in blocks of 21 (three blocks, as the call's
  25 blocks: what is kept from block to block counts).

Usage: ``THREADS=1 taskset -c 0 python -m benchmarks.bench_stacked_ab [REF] [CASES]``
(REF ``main``, CASES ``sides,block8,block21,blocks63``). Writes ``benchmarks/results/stacked_ab``
``.md`` and ``.json`` (provenance: command, commit, ref, date, machine, load, cores).
"""

import dataclasses
import inspect
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

import skpathkernel._tangent._stacked as new
from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel import PathKernelClassifier, kernels

ROOT = Path(__file__).resolve().parent.parent
MODULE = "skpathkernel/_tangent/_stacked.py"


class _Captured(Exception):
    pass


def _reference_module(ref):
    """The module at git ``ref``, imported beside the working tree's."""
    return reference_module(ROOT, ref, MODULE)


def _capture(points):
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    est = PathKernelClassifier(random_state=0).fit(X[:1000], y[:1000])
    cap = {}

    def record(mlp, layout, load, weights, Xt, Yt=None, **kw):
        cap.update(mlp=mlp, layout=layout, weights=weights[:points], X=Xt, kw=kw)
        cap["theta"], cap["D"] = load([k for k, _ in weights[:points]])
        raise _Captured

    with mock.patch.object(kernels, "stacked_path_sum", record):
        try:
            est.path_kernel_(X[:1000])
        except _Captured:
            pass
    return cap


def _as(mod, mlp):
    """``mlp`` rebuilt from ``mod``'s own layer records (its functions test their type)."""
    items = tuple(mod._Linear(**dataclasses.asdict(it)) if dataclasses.is_dataclass(it)
                  else it for it in mlp.items)
    return mod.StackedMLP(items, mlp.n_inputs)


def _cases(cap, mods):
    kw, layout, X = cap["kw"], cap["layout"], cap["X"]
    index = {k: i for i, (k, _) in enumerate(cap["weights"])}

    def load(points):
        rows = [index[k] for k in points]
        return cap["theta"][rows], cap["D"][rows]

    def block(n, size):
        def run(mod):
            return mod.stacked_path_sum(_as(mod, cap["mlp"]), layout, load,
                                        cap["weights"][:n], X, None, block=size, **kw)[0]
        return run

    def sides(mod):
        mlp = _as(mod, cap["mlp"])
        routes = [None if r == "dense" else r
                  for r in mod._routes(mlp, len(kw["outputs"]), True, len(X), len(X))]
        scratch = mods[mod]
        w = torch.tensor([wk * kw["trace_scale"] for _, wk in cap["weights"]])
        s = mod._block_sides(mlp, layout, cap["theta"][:21], cap["D"][:21], w[:21], X, None,
                             kw["outputs"],
                             torch.as_tensor(kw["outputs"]), routes, False, scratch)
        # A module whose copies take no buffers has no scratch parameter (chosen by the
        # signature: a TypeError inside the call must not be retried as another call).
        takes = len(inspect.signature(mod._contiguous_units).parameters) > 2
        with mod._blas_threads(1):
            mod._contiguous_units(s, routes, *([scratch] if takes else []))
        # The block's backprops (a copy: the buffers are reused by the next call), compared
        # between the two modules like the Grams of the other cases.
        return torch.cat([d.reshape(-1) for _, d in s.fx if d is not None])

    return {"sides": sides, "block8": block(8, 8), "block21": block(21, 21),
            "blocks63": block(63, 21)}


def main(ref="main", names="sides,block8,block21,blocks63"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "8"))
    old = _reference_module(ref)
    cap = _capture(63)
    mods = {old: old._Scratch(cap["X"].device), new: new._Scratch(cap["X"].device)}
    cases = _cases(cap, mods)
    load_before = os.getloadavg()
    rows = []
    for name in names.split(","):
        f = cases[name]
        times = {"ref": [], "tree": []}
        grams = {}
        for r in range(reps):
            order = [("ref", old), ("tree", new)]
            for key, mod in order if r % 2 == 0 else order[::-1]:
                t = time.thread_time()
                grams[key] = f(mod)
                times[key].append(time.thread_time() - t)
        row = ab_row(name, times, os.getloadavg()[0])
        if grams["ref"] is not None:
            diff = (grams["ref"] - grams["tree"]).abs().max() / grams["ref"].abs().max()
            row["max_rel_diff"] = float(diff)
        rows.append(row)
        print(f"{name}: ref {row['ref_least']:.4f} s (median {row['ref_median']:.4f}), "
              f"tree {row['tree_least']:.4f} s (median {row['tree_median']:.4f}), "
              f"ratio {row['ratio_least']:.3f} least, {row['ratio_median']:.3f} median, "
              f"load {row['load']:.2f}", flush=True)
    prov = ab_provenance(ROOT, "bench_stacked_ab", [MODULE, "benchmarks/bench_stacked_ab.py",
                                                    "benchmarks/_ab.py"], ref, reps,
                         load_before=load_before)
    write_ab(ROOT / "benchmarks" / "results" / "stacked_ab",
             "Stacked path kernel: one process A/B against a git ref", "time.thread_time",
             prov, rows, 4)


if __name__ == "__main__":
    main(*sys.argv[1:])
