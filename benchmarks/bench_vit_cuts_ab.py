"""One-process A/B of cuts to the ViT's tangent Gram (issue 31, session s46).

"ref" runs with the cut switched off by patching the engine, "new" as committed; the two
sides alternate (order reversed every round), ``time.process_time`` of
``tangent_gram(net, params, X)`` (trace, float32, default 1 GiB budget, one torch thread)
per call, then K compared bit for bit, and the peak of torch's CPU allocations of one
more call per side (profiler memory events, as the tests of ``memory_budget``) less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_vit_cuts_ab CUT
[NET@N ...] [--reps R] [--peak]``; CUT is "kept": "ref" without
:func:`skpathkernel._tangent._gram._kept_forward_groups` (the output groups' captures each
run their own forward pass), "new" with it (one forward pass per chunk, its graph kept for
every group). CUT "probe" (session s48): "ref" with the probe's capture of
:func:`skpathkernel._tangent._gram._prepare` handing the sites' outputs on as copies (its
graph's bytes, which decide the kept plan, then count them), "new" uncopied, as the chunks
run. CUT "heads" (s48): "ref" with q, k and v of the attention's packed in-projection
split by chunks of its sequence-first transpose, "new" by
:func:`skpathkernel._tangent._layers._packed_heads`. Results:
``benchmarks/results/vit_cuts_ab-s46.md``, ``vit_cuts_ab-s48.md``.
"""

import argparse
import functools
import os
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch

from benchmarks import _worker
from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import _gram, _layers, tangent_gram


def _chunked_heads(z, heads):
    """:func:`skpathkernel._tangent._layers._packed_heads` as it was before s48."""
    E = z.shape[-1] // 3
    return [t.transpose(0, 1).unflatten(-1, (heads, E // heads)).transpose(1, 2)
            for t in z.transpose(0, 1).chunk(3, dim=-1)]


def _side(cut, side):
    stack = ExitStack()
    if side == "ref" and cut == "counted":
        real = _gram._launch_bound_chunk
        stack.enter_context(mock.patch.object(
            _gram, "_launch_bound_chunk", lambda *args: real(*args[:7])))
    if side == "ref" and cut == "probe":
        # The probe's capture with copied sites (before s48): its graph's bytes then count
        # a copy of every site's output that the chunks' uncopied captures do not hold.
        real_capture = _gram.capture
        stack.enter_context(mock.patch.object(_gram, "capture", lambda *a, **k: real_capture(
            *a, **({**k, "copy_sites": True} if k.get("measure_graph") else k))))
    if side == "ref" and cut == "heads":
        # q, k and v of a packed in-projection split by chunks of its sequence-first
        # transpose (before s48): the backward pass cats their gradients into that
        # transpose, then copies it back to the projection's rows.
        stack.enter_context(mock.patch.object(_layers, "_packed_heads", _chunked_heads))
    if side == "ref" and cut == "kept":
        stack.enter_context(mock.patch.object(_gram, "_kept_forward_groups",
                                              lambda *args: None))
    return stack


def alternated(cases, reps, peak, side, budget=None, problem=None):
    """Time, compare and (``peak``) measure ``tangent_gram`` on each ``NET@N`` case, the
    sides "ref" and "new" alternating ``reps`` times, each run inside ``side(name)``;
    ``budget``: the calls' ``memory_budget`` (None: the default); ``problem``: the case's
    ``(module, params, X, kwargs of tangent_gram)`` (None: the trace of ``NET@N``)."""
    torch.set_num_threads(1)
    kwargs = {} if budget is None else {"memory_budget": budget}
    for case in cases:
        if problem is None:
            arch, n = case.split("@")
            net, params, X = _worker.gram_problem({"arch": arch, "n": int(n),
                                                   "dtype": "float32"})
            extra = {}
        else:
            net, params, X, extra = problem(case)
        gram = functools.partial(tangent_gram, net, params, X, **kwargs, **extra)
        times, K = {"ref": [], "new": []}, {}
        print(case, "load before", os.getloadavg(), flush=True)
        for name in ("ref", "new"):
            with side(name):
                K[name] = gram()
        for r in range(reps):
            for name in (("ref", "new") if r % 2 == 0 else ("new", "ref")):
                with side(name):
                    t = time.process_time()
                    gram()
                    times[name].append(time.process_time() - t)
            print(case, r, {s: round(v[-1], 3) for s, v in times.items()}, flush=True)
        diff = (K["new"].double() - K["ref"].double()).abs().max().item()
        scale = K["ref"].double().abs().max().item()
        med = {s: statistics.median(v) for s, v in times.items()}
        ratio = [b / a for a, b in zip(times["ref"], times["new"])]
        print(f"{case}: ref {med['ref']:.3f} s {times['ref']}, new {med['new']:.3f} s "
              f"{times['new']}; new/ref median {med['new'] / med['ref']:.3f} "
              f"(by round {min(ratio):.3f}-{max(ratio):.3f}); max |dK| {diff:.3g} "
              f"(rel {diff / scale:.3g}); bitwise {torch.equal(K['new'], K['ref'])}; load after "
              f"{os.getloadavg()}")
        if peak:
            for name in ("ref", "new"):
                with side(name):
                    _, top = cpu_peak_bytes(gram)
                print(f"{case} {name} peak {(top - K['ref'].nbytes) / 2**20:.1f} MiB")


def parse(argv, case):
    """The A/B scripts' arguments: the cut, the cases (default ``case``), reps, peak."""
    parser = argparse.ArgumentParser()
    parser.add_argument("cut")
    parser.add_argument("cases", nargs="*", default=[case])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peak", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv, "vit@1024")
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, args.cut))


if __name__ == "__main__":
    main()
