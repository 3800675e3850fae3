"""The FLOPs a call executes: ``torch.utils.flop_counter.FlopCounterMode`` (the
matmul-like ATen ops: GEMMs, convolutions and their backward, attention) plus by hand what
it cannot see in the structured Gram: SciPy's SYRK (``n (n + 1) k``, the upper triangle's
dot products) and CPU attention (``_scaled_dot_product_flash_attention_for_cpu``, no
formula in torch 2.13: ``4 B H S S' d`` forward, ``8 B H S S' d`` backward), and it
corrects the counter's weight gradient of a grouped convolution, which it counts as if
ungrouped (``groups`` times too many: the engine forms a convolution's per-sample weight
gradients as one convolution grouped by sample, :func:`skpathkernel._tangent._layers._conv_formed`).
Element-wise work counts no FLOPs, as in a roofline of GEMMs.
"""

from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from skpathkernel._tangent import _gram


def _t(shape):
    return [shape[1], shape[0], *shape[2:]]


class _Unseen(TorchDispatchMode):
    """Hands ``add`` the FLOPs of the attention ops the counter has no formula for, and
    the correction of its grouped convolutions' weight gradients."""

    def __init__(self, add):
        super().__init__()
        self.add = add

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name == "aten._scaled_dot_product_flash_attention_for_cpu":
            q, k = args[0], args[1]
            B, H, S, d = q.shape
            self.add(4 * B * H * S * k.shape[2] * d)
        elif name == "aten._scaled_dot_product_flash_attention_for_cpu_backward":
            q, k = args[1], args[2]
            B, H, S, d = q.shape
            self.add(8 * B * H * S * k.shape[2] * d)
        elif name == "aten.convolution_backward" and args[9] > 1 and args[10][1]:
            grad, x, w, transposed, groups = args[0], args[1], args[2], args[7], args[9]
            shapes = (grad.shape, x.shape) if transposed else (x.shape, grad.shape)
            counted = conv_flop_count(_t(shapes[0]), _t(shapes[1]), _t(w.shape))
            self.add(counted // groups - counted)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_syrk(add):
    """The engine's SYRKs (SciPy's, outside torch) report their FLOPs to ``add``."""
    syrk = _gram._syrk

    def counted(acc):
        update = syrk(acc)
        if update is None:
            return None

        def run(g, alpha=1.0):
            add(g.shape[0] * (g.shape[0] + 1) * g.shape[1])
            return update(g, alpha)

        return run

    _gram._syrk = counted
    try:
        yield
    finally:
        _gram._syrk = syrk


@contextlib.contextmanager
def counting(add):
    """The counter (a ``FlopCounterMode``) of what runs inside; ``add(flops)`` receives
    the hand-counted FLOPs (and corrections) as they happen."""
    with counted_syrk(add), FlopCounterMode(display=False) as counter, _Unseen(add):
        yield counter


def executed_flops(call):
    """``(result of call(), the FLOPs it executed)``."""
    extra = [0]

    def hand(flops):
        extra[0] += flops

    with counting(hand) as counter:
        result = call()
    return result, counter.get_total_flops() + extra[0]
