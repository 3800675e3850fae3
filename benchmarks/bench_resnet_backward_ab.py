"""One-process A/B of cuts to the ResNet Gram's backward passes (issue 31, session s48).

"ref" runs with the cuts named switched off by patching the engine, "new" as committed;
the two sides alternate (order reversed every round), ``time.process_time`` of
``tangent_gram(net, params, X)`` (trace, float32, default 1 GiB budget, one torch thread)
per call, then K compared, and with ``--peak`` the peak of torch's CPU allocations of one
more call per side less K (:func:`benchmarks.bench_vit_cuts_ab.alternated`).

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_resnet_backward_ab CUTS
[NET@N ...] [--reps R] [--peak]``; CUTS a comma-separated list of: "pointwise" (ref: a
capture's 1x1 convolutions by ``F.conv2d`` and autograd's backward, oneDNN's, instead of
:class:`skpathkernel._tangent._layers._PointwiseConv2d`'s matmul,
:func:`skpathkernel._tangent._layers.site_call`).
CUTS "kernels" instead times the input gradient of the ResNet's 1x1 stride-2 shortcuts
alone on its chunk shapes (36 rows): oneDNN's ``convolution_backward`` against the
matmul, alternated, medians of 9 rounds of 10 calls, CPU time.
Results: ``benchmarks/results/resnet_backward_ab-s48.md``.
"""

import functools
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch

from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel._tangent import _capture


def _side(cuts, side):
    stack = ExitStack()
    if side == "ref" and "pointwise" in cuts:
        stack.enter_context(mock.patch.object(
            _capture, "site_call", lambda rule, func, args, kwargs: func(*args, **kwargs)))
    return stack


def _onednn(g, x, w):
    return torch.ops.aten.convolution_backward(
        g, x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [True, False, False])[0]


def _matmul(g, x, w):
    (n, c_in), c_out = x.shape[:2], w.shape[0]
    out = g.new_zeros(x.shape)
    out[:, :, ::2, ::2] = torch.matmul(w.view(c_out, c_in).T,
                                       g.reshape(n, c_out, -1)).view(n, c_in, *g.shape[2:])
    return out


def kernels(n=36, reps=10, rounds=9):
    """The shortcuts' input gradients, oneDNN's and the matmul, alternated."""
    torch.manual_seed(0)
    for c_in, c_out, side in [(16, 32, 32), (32, 64, 16)]:
        x, w = torch.randn(n, c_in, side, side), torch.randn(c_out, c_in, 1, 1)
        g = torch.randn(n, c_out, side // 2, side // 2)
        sides = {"oneDNN": _onednn, "matmul": _matmul}
        assert torch.allclose(_onednn(g, x, w), _matmul(g, x, w), atol=1e-4)
        times = {k: [] for k in sides}
        for _ in range(rounds):
            for k, fn in sides.items():
                t = time.process_time()
                for _ in range(reps):
                    fn(g, x, w)
                times[k].append((time.process_time() - t) / reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{n} x {c_in} x {side}^2 -> {c_out}: "
              + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in med.items())
              + f"; matmul / oneDNN {med['matmul'] / med['oneDNN']:.2f}", flush=True)


def main(argv=None):
    args = parse(argv, "resnet@1024")
    torch.set_num_threads(1)
    if args.cut == "kernels":
        return kernels()
    return alternated(args.cases, args.reps, args.peak,
                      functools.partial(_side, set(args.cut.split(","))))


if __name__ == "__main__":
    main()
