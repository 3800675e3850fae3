"""One-process A/B of cuts to the ResNet's tangent Gram (issue 31, session s47).

"ref" runs with the cuts named switched off by patching the engine, "new" as committed;
the two sides alternate (order reversed every round), ``time.process_time`` of
``tangent_gram(net, params, X)`` (trace, float32, default 1 GiB budget, one torch thread)
per call, then K compared, and with ``--peak`` the peak of torch's CPU allocations of one
more call per side (profiler memory events, as the tests of ``memory_budget``) less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_resnet_cuts_ab CUTS
[NET@N ...] [--reps R] [--peak]``; CUTS a comma-separated list of: "bn" (ref:
BatchNorm's per-sample weight and bias gradients by the rule from the copied backprops
instead of reduced by hooks, :func:`skpathkernel._tangent._capture._reduced_sites`),
"pad" (ref: a convolution's input copied by ``F.pad`` without padding too,
:func:`skpathkernel._tangent._layers._padded`).
CUTS "kernels" instead times BatchNorm's per-sample sums alone on the ResNet's chunk
shapes (36 rows, 16 x 1024, 32 x 256 and 64 x 64 channels x positions, one output):
x-hat, the product and the two sums (the rule before), the product and the sums alone,
and ``native_batch_norm_backward`` over the samples' channels (the hooks' sums); each
the median of 7 timings of 20 calls, CPU time.
Results: ``benchmarks/results/resnet_cuts_ab-s47.md`` (its "hot" cut, the backprops
copied after each backward pass instead of by hooks, measured 0.987 alone at N = 512;
that path has since been removed).
"""

import functools
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.bench_vit_cuts_ab import alternated, parse
from skpathkernel._tangent import _capture, _layers


def _side(cuts, side):
    stack = ExitStack()
    if side == "ref" and "bn" in cuts:
        stack.enter_context(mock.patch.object(_capture, "_reduced_sites",
                                              lambda *args: {}))
    if side == "ref" and "pad" in cuts:
        stack.enter_context(mock.patch.object(_layers, "_padded", F.pad))
    return stack


def _kernel_times(n, ch, S):
    """Median CPU time of BatchNorm's per-sample sums of one output, by each way."""
    d, a = torch.randn(n, ch, S), torch.randn(n, ch, S) * 2 + 0.3
    mean, var, eps = 0.1 * torch.randn(ch), 1 + 0.2 * torch.rand(ch), 1e-5
    xh = F.batch_norm(a, mean, var, None, None, False, 0.0, eps)
    out = torch.empty(n, 2, ch)
    stats = (mean.repeat(n), var.repeat(n))

    def rule():
        x = F.batch_norm(a, mean, var, None, None, False, 0.0, eps)
        torch.sum(d * x, 2, out=out[:, 0])
        torch.sum(d, 2, out=out[:, 1])

    def sums():
        torch.sum(d * xh, 2, out=out[:, 0])
        torch.sum(d, 2, out=out[:, 1])

    def folded():
        torch.ops.aten.native_batch_norm_backward(
            d.view(1, n * ch, S), a.view(1, n * ch, S), None, *stats, None, None, False,
            eps, [False, True, True])

    med = {}
    for name, fn in (("x-hat, product, sums", rule), ("product, sums", sums),
                     ("batch-norm backward", folded)):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(7):
            t = time.process_time()
            for _ in range(20):
                fn()
            ts.append((time.process_time() - t) / 20)
        med[name] = statistics.median(ts)
    return med


def kernels():
    """BatchNorm's per-sample weight and bias sums of one output, three ways, timed."""
    torch.manual_seed(0)
    for n, ch, S in [(36, 16, 1024), (36, 32, 256), (36, 64, 64)]:
        med = _kernel_times(n, ch, S)
        print(f"{n} x {ch} x {S}: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in med.items())
              + f"; backward / (x-hat, product, sums) "
              f"{med['batch-norm backward'] / med['x-hat, product, sums']:.2f}", flush=True)


def main(argv=None):
    args = parse(argv, "resnet@1024")
    cuts = set(args.cut.split(","))
    torch.set_num_threads(1)
    if cuts == {"kernels"}:
        kernels()
        return
    alternated(args.cases, args.reps, args.peak, functools.partial(_side, cuts))


if __name__ == "__main__":
    main()
