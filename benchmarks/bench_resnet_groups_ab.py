"""One-process A/B of the kept-forward plan's output groups on the ResNet row (issue 31,
session s50).

"ref" runs with the cut switched off by patching the engine, "new" as in the tree; the
two sides alternate (order reversed every round), ``time.process_time`` of
``tangent_gram(net, params, X)`` (trace, float32, default 1 GiB budget unless
``--budget``, one torch thread) per call, then K compared, and with ``--peak`` the peak of
torch's CPU allocations of one more call per side less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_resnet_groups_ab CUT
[NET@N ...] [--reps R] [--peak]``; CUT one of:

- "estimate": "ref" as in the tree, whose chunk estimate
  (:func:`skpathkernel._tangent._gram._chunk_row_bytes`) counts every patch four times
  and keeps ten one-output groups on the benchmark ResNet at N = 1024; "new" with the
  patches of the convolutions that form their weights in the capture (on that network
  every one: each has its eval BatchNorm folded into it) counted once, the largest with
  its formed block (:func:`_tighter_chunk_row_bytes`, a prototype not kept): five
  two-output groups there;
- "input-grad": "ref" as in the tree (the folded convolutions' input gradients in
  :class:`skpathkernel._tangent._layers._BatchNormAfterConv`'s backward by
  ``convolution_backward`` given the input's shape as an expanded tensor), "new" by the
  transposed convolution, the same bits (:func:`_transposed_backward`, a prototype not
  kept).

Results: ``benchmarks/results/resnet_groups_ab-s50.md``.
"""

import functools
from contextlib import ExitStack
from unittest import mock

from torch.nn import functional as F

from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel._tangent import _gram, _layers


def _tighter_chunk_row_bytes(probe, kept, *_):
    """The estimate with every term's patches (the convolutions' factors) counted once,
    the largest with its formed block, instead of four times each: right only where
    every convolution forms its weight in the capture (the benchmark ResNet, all its
    convolutions folded). The other factors four times, as the tree's."""
    factors, transient = probe.nbytes(), 0
    for term in probe.terms:
        patches = sum(a.numel() * a.element_size() for _, a in term.inputs if a is not None)
        if patches and term.delta.shape[2] > 1:
            factors -= patches
            transient = max(transient,
                            patches + _gram._dense_bytes(term, term.delta.element_size()))
    return 8 * (4 * factors + transient + probe.input_bytes + kept)


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv_input_grad(dy, weight, shape, stride, padding, dilation, groups):
    """The input gradient of a convolution by ``weight`` whose input has ``shape``: the
    transposed convolution, its output padding the input rows no window reached."""
    kernel = weight.shape[2:]
    extra = [size - ((out - 1) * s - 2 * p + d * (k - 1) + 1)
             for size, out, s, p, d, k in zip(shape[2:], dy.shape[2:], stride, padding,
                                               dilation, kernel)]
    return _CONV_TRANSPOSE[len(kernel)](dy, weight, None, stride, padding, extra, groups,
                                        dilation)


@staticmethod
def _transposed_backward(ctx, dy):
    """:class:`skpathkernel._tangent._layers._BatchNormAfterConv`'s backward with the
    input gradient by :func:`_conv_input_grad`."""
    rest = (None,) * (5 + ctx.n_params)
    if not ctx.needs_input_grad[0]:
        return (None, *rest)
    weight, scale = ctx.saved_tensors
    scaled = weight * scale.reshape(-1, *(1,) * (weight.ndim - 1))
    return (_conv_input_grad(dy, scaled, ctx.shape, *ctx.geometry), *rest)


def _side(cut, side):
    stack = ExitStack()
    if side == "new" and cut == "estimate":
        stack.enter_context(mock.patch.object(_gram, "_chunk_row_bytes",
                                              _tighter_chunk_row_bytes))
    if side == "new" and cut == "input-grad":
        stack.enter_context(mock.patch.object(_layers._BatchNormAfterConv, "backward",
                                              _transposed_backward))
    return stack


def main(argv=None):
    args = parse(argv, "resnet@1024")
    if args.cut not in ("estimate", "input-grad"):
        raise SystemExit(f"unknown cut {args.cut!r}")
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, args.cut))


if __name__ == "__main__":
    main()
