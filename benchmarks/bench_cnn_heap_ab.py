"""One-process A/B of the CIFAR CNN's capture cuts of session s48 (issue 31).

"ref" runs with a cut switched off by patching, "new" as committed; the sides alternate
(order reversed every round), ``time.process_time`` of ``tangent_gram(net, params, X)``
(trace, float32, one torch thread) per call, then K compared, and with ``--peak`` the peak
of torch's CPU allocations of one more call per side less K (:mod:`.bench_vit_cuts_ab`'s
``alternated``). The cuts:

- ``heap``: measured, not kept: with the chunks of a formed block after the first
  captured inside :func:`skpathkernel._memory.retained_heap` (ref: ``RETAIN_HEAP``
  False); a no-op on the committed code, which does not call it;
- ``pool``: the plain-CNN route's max-pools by the channels-last kernel
  (:func:`skpathkernel._tangent._cnn._max_pool`; ref: ``F.max_pool2d`` on NCHW rows);
- ``layout``: the first convolution's pooled backprops written in
  :func:`skpathkernel._tangent._cnn.first_formed`'s layout (ref: in ``(n, C, c, h, w)``,
  copied there);
- ``all``: every cut.

A ``retained_heap`` sets glibc's thresholds for good when it first leaves (see
:mod:`skpathkernel._memory`): in one process, "ref" calls after the first "new" one run on
the heap "new" left. ``--processes`` therefore runs every call of a side in a fresh
process instead (a warm-up call, then ``--calls`` timed calls; the sides' processes
alternating, ``--reps`` rounds), K compared across the first round's processes.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_cnn_heap_ab CUT
[NET@N ...] [--reps R] [--peak] [--processes [--calls M]]``. Results:
``benchmarks/results/cifar_faults_ab-s48.md``.
"""

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks import _worker
from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel import _memory
from skpathkernel._tangent import _cnn
from skpathkernel._tangent._gram import tangent_gram


def _nchw_pool(z, k, relu=False):
    return F.max_pool2d(torch.relu(z) if relu else z, k, k, 0, 1, False, True)


def _copied_pooled(buf, g, ref):
    return g if ref is None else torch.ops.aten.threshold_backward(g, ref.unsqueeze(1), 0)


def _side(cut, side):
    stack = ExitStack()
    if side == "ref":
        if cut in ("heap", "all"):
            stack.enter_context(mock.patch.object(_memory, "RETAIN_HEAP", False))
        if cut in ("pool", "all"):
            stack.enter_context(mock.patch.object(_cnn, "_max_pool", _nchw_pool))
        if cut in ("layout", "all"):
            stack.enter_context(mock.patch.object(_cnn, "_pooled", _copied_pooled))
    return stack


def _child(cut, case, side, calls, out):
    """One side's calls in this (fresh) process: a warm-up, then ``calls`` timed ones."""
    torch.set_num_threads(1)
    arch, n = case.split("@")
    net, params, X = _worker.gram_problem({"arch": arch, "n": int(n), "dtype": "float32"})
    with _side(cut, side):
        K = tangent_gram(net, params, X)
        times = []
        for _ in range(calls):
            t = time.process_time()
            tangent_gram(net, params, X)
            times.append(time.process_time() - t)
    torch.save({"K": K, "times": times}, out)


def _processes(args):
    for case in args.cases:
        print(case, "load before", os.getloadavg(), flush=True)
        times, K = {"ref": [], "new": []}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.reps):
                for side in (("ref", "new") if r % 2 == 0 else ("new", "ref")):
                    out = os.path.join(tmp, f"{side}{r}.pt")
                    subprocess.run([sys.executable, "-m", "benchmarks.bench_cnn_heap_ab",
                                    args.cut, case, "--child", side, "--calls",
                                    str(args.calls), "--out", out], check=True)
                    got = torch.load(out)
                    times[side].append(statistics.median(got["times"]))
                    K.setdefault(side, got["K"])
                print(case, r, {s: round(v[-1], 3) for s, v in times.items()}, flush=True)
        med = {s: statistics.median(v) for s, v in times.items()}
        ratio = [b / a for a, b in zip(times["ref"], times["new"])]
        diff = (K["new"].double() - K["ref"].double()).abs().max().item()
        scale = K["ref"].double().abs().max().item()
        print(f"{case} (fresh processes, median of {args.calls} calls each): ref "
              f"{med['ref']:.3f} s {times['ref']}, new {med['new']:.3f} s {times['new']}; "
              f"new/ref median {med['new'] / med['ref']:.3f} (by round {min(ratio):.3f}-"
              f"{max(ratio):.3f}); max |dK| {diff:.3g} (rel {diff / scale:.3g}); load after "
              f"{os.getloadavg()}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--processes", action="store_true")
    extra.add_argument("--calls", type=int, default=2)
    extra.add_argument("--child")
    extra.add_argument("--out")
    more, rest = extra.parse_known_args(argv)
    args = parse(rest, "cifar@1024")
    if args.cut not in ("heap", "pool", "layout", "all"):
        raise SystemExit(f"unknown cut {args.cut!r}: heap, pool, layout or all")
    if more.child:
        _child(args.cut, args.cases[0], more.child, more.calls, more.out)
    elif more.processes:
        args.calls = more.calls
        _processes(args)
    else:
        alternated(args.cases, args.reps, args.peak, functools.partial(_side, args.cut))


if __name__ == "__main__":
    main()
