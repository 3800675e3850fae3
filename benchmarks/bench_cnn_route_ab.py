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
from contextlib import ExitStack
from unittest import mock

from benchmarks.bench_vit_cuts_ab import alternated
from skpathkernel._tangent import _capture, _gram


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
    parser.add_argument("--budget", type=int, default=None)
    args = parser.parse_args(argv)
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, cut=args.cut),
               budget=args.budget)


if __name__ == "__main__":
    main()
