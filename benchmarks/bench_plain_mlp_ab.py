"""One-process A/B of the plain-MLP Gram route (issue 31's MLP row, session s50).

"ref" is the route as it is at a git ref (default: the session's base, b9f9409): its
``_plain_mlp_gram`` from that commit's ``skpathkernel/_tangent/_gram.py``, with that
commit's ``_stacked.py`` for the factors (:func:`benchmarks._ab.reference_module`),
patched into the working tree's engine; "new" is the working tree's. Everything else
(the public call's wrapper, the general route) is the working tree's on both sides.

Per case (the quick gram group's tanh MLPs, ``SIZES@N``), two calls alternate, their
order reversed every round, ``time.process_time`` per call: the public call
``TangentKernel(net)(X)`` (NumPy float32 in, float64 K out; ``net`` a one-point
``PathRecorder`` path, as the benchmark's headline row) and the engine's
``tangent_gram`` (float32 K). The GEMM probe of the benchmark's roofline (``N x width x
N``, :func:`benchmarks._worker._gemm_probe`) is timed once per round for the ratio
"full products at the probe's rate / median call". Then K of both sides compared
(max |dK| / max |K|, and whether bit for bit), and with ``--peak`` the peak of torch's
CPU allocations of one more engine call per side, less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_plain_mlp_ab
[SIZES@N ...] [--reps R] [--ref REF] [--peak] [--out PATH]``, SIZES like
``64-512-512-1``; default ``64-512-512-1@1024``. ``--out``: write PATH.md and PATH.json
(:func:`benchmarks._ab.write_ab`). Results: ``benchmarks/results/plain_mlp_ab-s50.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from benchmarks import _worker
from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel import PathRecorder, TangentKernel
from skpathkernel._tangent import _gram
from skpathkernel._tangent._gram import tangent_gram

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["skpathkernel/_tangent/_gram.py", "skpathkernel/_tangent/_stacked.py"]


def _reference(ref: str):
    """The route at ``ref``: its ``_plain_mlp_gram``, reading that commit's factors."""
    stacked = reference_module(ROOT, ref, MODULES[1])
    gram = reference_module(ROOT, ref, MODULES[0])
    for name in ("Arena", "gram_factor_sizes", "gram_factors", "stacked_mlp"):
        setattr(gram, name, getattr(stacked, name))
    return gram._plain_mlp_gram


def _full_flops(sizes, n):
    """The roofline's full products (:func:`benchmarks._worker._roofline`)."""
    return sum(2 * n * n * (a + b) + 3 * n * n for a, b in zip(sizes[:-1], sizes[1:]))


def run_case(case, reps, ref_route, peak):
    sizes, n = case.split("@")
    sizes, n = [int(s) for s in sizes.split("-")], int(n)
    module, params, X = _worker.gram_problem({"sizes": sizes, "n": n, "dtype": "float32"})
    net = PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator()
    X_user = X.numpy()
    calls = {"public": lambda: TangentKernel(net)(X_user),
             "engine": lambda: tangent_gram(module, params, X)}
    probe, probe_flops = _worker._gemm_probe(n, max(sizes[1:-1]), X)

    def side(name):
        if name == "ref":
            return mock.patch.object(_gram, "_plain_mlp_gram", ref_route)
        return mock.patch.object(_gram, "_plain_mlp_gram", _gram._plain_mlp_gram)

    out = {}
    for call in calls:
        for name in ("ref", "new"):
            with side(name):
                calls[call]()
                out[(call, name)] = calls[call]()
    times = {(call, name): [] for call in calls for name in ("ref", "new")}
    probes = []
    order = [(call, name) for call in calls for name in ("ref", "new")]
    print(case, "load before", os.getloadavg(), flush=True)
    for r in range(reps):
        t = time.process_time()
        probe()
        probes.append(time.process_time() - t)
        for call, name in (order if r % 2 == 0 else order[::-1]):
            with side(name):
                t = time.process_time()
                out[(call, name)] = calls[call]()
                times[(call, name)].append(time.process_time() - t)
    load = os.getloadavg()[0]
    rate = probe_flops / statistics.median(probes)
    rows = []
    for call in calls:
        ref = np.asarray(out[(call, "ref")], dtype=np.float64)
        new = np.asarray(out[(call, "new")], dtype=np.float64)
        row = ab_row(f"{case} {call}", {"ref": times[(call, "ref")],
                                       "tree": times[(call, "new")]}, load,
                     max_rel_diff=float(np.abs(new - ref).max() / np.abs(ref).max()),
                     bitwise=bool(np.array_equal(new, ref)),
                     rate_gflops=round(rate / 1e9, 1),
                     roof_ref=round(_full_flops(sizes, n) / rate
                                    / statistics.median(times[(call, "ref")]), 3),
                     roof_tree=round(_full_flops(sizes, n) / rate
                                     / statistics.median(times[(call, "new")]), 3))
        ratios = sorted(b / a for a, b in zip(row["ref_times"], row["tree_times"]))
        row["by_round"] = f"{ratios[0]:.3f}-{ratios[-1]:.3f}"
        if peak and call == "engine":
            for name in ("ref", "new"):
                with side(name):
                    K, top = cpu_peak_bytes(calls[call])
                row[f"peak_{name}_mib"] = round((top - K.nbytes) / 2**20, 1)
        print(f"{row['case']}: ref {row['ref_median'] * 1e3:.2f} ms, new "
              f"{row['tree_median'] * 1e3:.2f} ms, new/ref {1 / row['ratio_median']:.3f} "
              f"(by round {row['by_round']}), roofline {row['roof_ref']} -> "
              f"{row['roof_tree']} at {row['rate_gflops']} GFLOP/s, diff "
              f"{row['max_rel_diff']:.1e}, bitwise {row['bitwise']}, load {load:.2f}"
              + (f", peak ref {row['peak_ref_mib']} MiB new {row['peak_new_mib']} MiB"
                 if "peak_new_mib" in row else ""), flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=["64-512-512-1@1024"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ref", default="b9f9409")
    parser.add_argument("--peak", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ref_route = _reference(args.ref)
    rows = [row for case in args.cases
            for row in run_case(case, args.reps, ref_route, args.peak)]
    if args.out:
        prov = ab_provenance(ROOT, "bench_plain_mlp_ab", MODULES + [
            "benchmarks/bench_plain_mlp_ab.py"], args.ref, args.reps,
            load_end=os.getloadavg())
        write_ab(Path(args.out), "Plain-MLP Gram route: A/B against " + args.ref,
                 "time.process_time", prov, rows, 5,
                 columns=[("new / ref by round", "by_round"), ("bitwise", "bitwise"),
                          ("probe GFLOP/s", "rate_gflops"), ("roofline ref", "roof_ref"),
                          ("roofline new", "roof_tree"), ("peak ref MiB", "peak_ref_mib"),
                          ("peak new MiB", "peak_new_mib")], machine=True)


if __name__ == "__main__":
    main()
