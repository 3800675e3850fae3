"""One-process A/B of eval BatchNorms folded into their convolutions (issue 31, session s49).

"ref" runs with the cut switched off by patching the engine, "new" as committed; the two
sides alternate (order reversed every round), ``time.process_time`` of
``tangent_gram(net, params, X)`` (trace, float32, default 1 GiB budget, one torch thread)
per call, then K compared, and with ``--peak`` the peak of torch's CPU allocations of one
more call per side (profiler memory events, as the tests of ``memory_budget``) less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_resnet_fold_ab CUT
[NET@N ...] [--reps R] [--peak]``; CUT one of:

- "fold": "ref" without the fold (:func:`skpathkernel._tangent._layers.foldable` patched
  to refuse every pair: the captures as before, and the probe's graph too large for the
  kept plan at N = 1024), "new" with it (and the kept plan it lets in);
- "fold-only": both sides without the kept plan
  (:func:`skpathkernel._tangent._gram._kept_forward_groups` patched to None), "ref"
  without the fold: the fold's own cut of the captures;
- "kept": both sides with the fold, "ref" without the kept plan: what keeping the forward
  passes adds.

Results: ``benchmarks/results/resnet_fold_ab-s49.md``.
"""

import functools
from contextlib import ExitStack
from unittest import mock

from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel._tangent import _capture, _gram


def _side(cut, side):
    stack = ExitStack()
    if side == "ref" and cut in ("fold", "fold-only"):
        stack.enter_context(mock.patch.object(_capture, "foldable", lambda *args: False))
    if cut == "fold-only" or (cut == "kept" and side == "ref"):
        stack.enter_context(mock.patch.object(_gram, "_kept_forward_groups",
                                              lambda *args: None))
    return stack


def main(argv=None):
    args = parse(argv, "resnet@1024")
    if args.cut not in ("fold", "fold-only", "kept"):
        raise SystemExit(f"unknown cut {args.cut!r}")
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, args.cut))


if __name__ == "__main__":
    main()
