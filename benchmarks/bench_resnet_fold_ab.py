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
  passes adds;
- "patches": both sides with the fold, "ref" with every folded convolution's weight in the
  caller's formed set formed in the capture (from its patches where
  :func:`skpathkernel._tangent._layers._conv_formed` declines it: the fold's first
  version), "new" with those left to the caller's forming, the backprop scaled.

Results: ``benchmarks/results/resnet_fold_ab-s49.md``.
"""

import functools
from contextlib import ExitStack
from unittest import mock

from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel._tangent import _capture, _gram, _layers
from skpathkernel._tangent._contract import dense_grad
from skpathkernel._tangent._rules import Term

_CONV_FORMED = _layers._conv_formed


def _formed_everywhere(use, deltas, names):
    """:func:`skpathkernel._tangent._layers._conv_formed`, or where it declines, the
    weight's gradients formed from its patches (one GEMM per sample), as a constant-input
    term."""
    terms = _CONV_FORMED(use, deltas, names)
    if terms is not None:
        return terms
    n, C = deltas[0].shape[:2]
    (term,) = _layers._conv_factors(None, use, deltas, {"weight": names["weight"]})
    g = dense_grad(term, term.inputs[0][1])
    return [Term(delta=g.view(n, C, 1, -1), inputs=[(names["weight"], None)])]


def _side(cut, side):
    stack = ExitStack()
    if side == "ref" and cut in ("fold", "fold-only"):
        stack.enter_context(mock.patch.object(_capture, "foldable", lambda *args: False))
    if side == "ref" and cut == "patches":
        stack.enter_context(mock.patch.object(_layers, "_conv_formed", _formed_everywhere))
    if cut == "fold-only" or (cut == "kept" and side == "ref"):
        stack.enter_context(mock.patch.object(_gram, "_kept_forward_groups",
                                              lambda *args: None))
    return stack


def main(argv=None):
    args = parse(argv, "resnet@1024")
    if args.cut not in ("fold", "fold-only", "kept", "patches"):
        raise SystemExit(f"unknown cut {args.cut!r}")
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, args.cut))


if __name__ == "__main__":
    main()
