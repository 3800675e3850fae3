"""One-process A/B of the plain-CNN capture (issue 31, session s47).

"ref" runs with the route switched off by patching the engine (:func:`skpathkernel.
_tangent._cnn.plain_cnn` as seen by the engine returns None: every chunk takes the
general capture), "new" as committed; the two sides alternate (order reversed every
round), ``time.process_time`` of ``tangent_gram(net, params, X)`` (trace, float32, one
torch thread) per call, then K compared bit for bit, and with
``--peak`` the peak of torch's CPU allocations of one more call per side (profiler memory
events, as the tests of ``memory_budget``) less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_cnn_route_ab
[NET@N ...] [--reps R] [--peak] [--cut route|pooled] [--budget BYTES]``; ``--cut
pooled``: "ref" is the route without :func:`skpathkernel._tangent._cnn.first_formed` (the
first convolution's gradients formed from its full backprops instead of its pooled ones);
``--budget``: the calls' ``memory_budget`` (default 1 GiB). Results:
``benchmarks/results/cnn_route_ab-s47.md``.
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
from skpathkernel._tangent import _capture, _gram, tangent_gram


def _side(side, cut="route"):
    stack = ExitStack()
    if side == "ref" and cut == "route":
        stack.enter_context(mock.patch.object(_gram, "plain_cnn", lambda *args: None))
    if side == "ref" and cut == "pooled":
        stack.enter_context(mock.patch.object(_capture, "pools_first", lambda *args: False))
    return stack


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=["cifar@1024"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peak", action="store_true")
    parser.add_argument("--cut", default="route", choices=["route", "pooled"])
    parser.add_argument("--budget", type=int, default=2**30, help="memory_budget (bytes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for case in args.cases:
        arch, n = case.split("@")
        net, params, X = _worker.gram_problem({"arch": arch, "n": int(n), "dtype": "float32"})
        times, K = {"ref": [], "new": []}, {}
        print(case, "load before", os.getloadavg(), flush=True)
        for side in ("ref", "new"):
            with _side(side, args.cut):
                K[side] = tangent_gram(net, params, X, memory_budget=args.budget)
        for r in range(args.reps):
            for side in (("ref", "new") if r % 2 == 0 else ("new", "ref")):
                with _side(side, args.cut):
                    t = time.process_time()
                    tangent_gram(net, params, X, memory_budget=args.budget)
                    times[side].append(time.process_time() - t)
            print(case, r, {s: round(v[-1], 3) for s, v in times.items()}, flush=True)
        diff = (K["new"].double() - K["ref"].double()).abs().max().item()
        scale = K["ref"].double().abs().max().item()
        med = {s: statistics.median(v) for s, v in times.items()}
        ratio = [b / a for a, b in zip(times["ref"], times["new"])]
        print(f"{case}: ref {med['ref']:.3f} s {[round(t, 3) for t in times['ref']]}, "
              f"new {med['new']:.3f} s {[round(t, 3) for t in times['new']]}; new/ref "
              f"median {med['new'] / med['ref']:.3f} (by round {min(ratio):.3f}-"
              f"{max(ratio):.3f}); max |dK| {diff:.3g} (rel {diff / scale:.3g}); bitwise "
              f"{torch.equal(K['new'], K['ref'])}; load after {os.getloadavg()}")
        if args.peak:
            for side in ("ref", "new"):
                with _side(side, args.cut):
                    _, peak = cpu_peak_bytes(functools.partial(
                        tangent_gram, net, params, X, memory_budget=args.budget))
                print(f"{case} {side} peak {(peak - K['ref'].nbytes) / 2**20:.1f} MiB",
                      flush=True)


if __name__ == "__main__":
    main()
