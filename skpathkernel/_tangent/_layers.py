"""The built-in rules: Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding, LayerNorm,
RMSNorm, GroupNorm, BatchNorm (eval), MultiheadAttention, PReLU; LSTM, GRU and RNN (from
:mod:`._recurrent`); and :func:`transposed_linear_rule` for a linear layer holding its weight
as ``(in, out)``, which the user registers for such a type (Hugging Face's ``Conv1D``).

Each is one small pure function from what the capture saw (:class:`._rules.Use`) and the
backprops to :class:`._rules.Term` objects, registered per type (subclasses that keep
the layer's ``forward`` take it: :func:`._rules.rule_for`). Every number a rule
needs (stride, padding, eps, running statistics, attention masks) is read from the call
the layer actually made, so a rule follows its layer's ``forward`` rather than its
attributes. Parameter-free layers (activations, pooling, flatten, residual adds, dropout
with p = 0) need no rule: the backprops flow through them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ._contract import dense_grad
from ._recurrent import GRU, LSTM, RNN
from ._rules import Rule, Term, Use, register_rule

__all__ = ["transposed_linear_rule"]


def _arg(use: Use, index: int, name: str, default=None):
    """Argument ``name`` of the call, positional at ``index`` or by keyword."""
    if len(use.args) > index:
        return use.args[index]
    return use.kwargs.get(name, default)


def _batched(ndim: int):
    return lambda layer, use: use.inputs[0].ndim >= ndim


# ----------------------------------------------------------------------------- Linear
def _linear_factors(layer, use, deltas, names):
    # z = a W^T + b at every position: d f_c / d W = sum_s delta_cs (outer) a_s.
    (a,), (delta,) = use.inputs, deltas
    n, C = delta.shape[:2]
    delta = delta.reshape(n, C, -1, delta.shape[-1])
    inputs = []
    if "weight" in names:
        inputs.append((names["weight"], a.reshape(n, -1, a.shape[-1])))
    if "bias" in names:
        inputs.append((names["bias"], None))
    return [Term(delta=delta, inputs=inputs)]


LINEAR = Rule(ops=(F.linear,), factors=_linear_factors, accepts=_batched(2))


# ------------------------------------------------------------ Linear, weight (in, out)
# torch's functions that compute x @ W (+ b) with W of shape (in, out): Hugging Face's
# GPT-2 projections (transformers.pytorch_utils.Conv1D) call torch.addmm on x's rows
# flattened, x.view(-1, in).
_IN_OUT_OPS = (torch.addmm, torch.matmul, torch.mm, torch.Tensor.matmul,
               torch.Tensor.__matmul__, torch.Tensor.mm)


def _dense(shape, strides) -> bool:
    """Whether a tensor of these sizes and strides covers ``prod(shape)`` consecutive
    elements once each (in some order of its axes)."""
    expected = 1
    for stride, size in sorted((t, z) for z, t in zip(shape, strides) if z != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _samples_first(x: torch.Tensor) -> torch.Tensor:
    """``x``, or ``x`` as ``(n, -1, d)`` where it is a contiguous ``(rows, d)`` view of
    the same memory as a tensor ``base`` of ``n`` sample-major blocks
    (``base.view(-1, d)``: Conv1D's ``x.view(-1, x.size(-1))``, of any layout of its
    input within a sample): then its rows are those blocks' rows, sample by sample.
    Whether ``base``'s first axis is the samples is checked by the capture (the rows of
    every site against the samples), as for any layer's input."""
    base = x._base
    if (x.ndim != 2 or base is None or base.ndim < 2 or not x.is_contiguous()
            or base.dtype != x.dtype or base.storage_offset() != x.storage_offset()
            or base.numel() != x.numel() or base.shape[0] == 0):
        return x
    n = base.shape[0]
    block = base.numel() // n
    if ((n > 1 and base.stride(0) != block) or block % x.shape[1]
            or not _dense(base.shape[1:], base.stride()[1:])):
        return x
    return x.view(n, -1, x.shape[1])


def _in_out_expand(layer, func, args, kwargs):
    if func is torch.addmm:
        # Positional, unscaled (Conv1D's call): anything else declines, to the fallback.
        if len(args) != 3 or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 \
                or set(kwargs) - {"beta", "alpha"}:
            return None
        b, x, w = args
    else:
        if len(args) != 2 or kwargs:
            return None
        (x, w), b = args, None
    if (not isinstance(x, torch.Tensor) or x.ndim < 2 or w.ndim != 2
            or (b is not None and tuple(b.shape) != (w.shape[1],))):
        return None
    a = _samples_first(x)
    rows = a.reshape(-1, a.shape[-1])
    z = (torch.mm(rows, w) if b is None else torch.addmm(b, rows, w))
    z = z.reshape(*a.shape[:-1], w.shape[1])
    # Handed on as a copy, as every site's output (an in-place op downstream, a ReLU's,
    # must not rewrite z: autograd then differentiates the rewritten tensor, or crashes
    # hooking a view of it), samples first: the layer's own view of it to (rows, out) is
    # one of sample-major memory, which a next such layer reads back per sample. (Copied
    # here, not left to the capture's copy of the view, ._capture._apart: that copy has no
    # sample-major _base, and a next such layer then falls back.)
    return z.clone().view(*x.shape[:-1], w.shape[1]), [(a, z)]


def _in_out_factors(weight: str, bias: str):
    def factors(layer, use, deltas, names):
        # z = a W + b at every position, W (in, out) = (q, p): d f_c / d W is
        # sum_s a_s (outer) delta_cs, nn.Linear's outer product transposed.
        (a,), (delta,) = use.inputs, deltas
        n, C = delta.shape[:2]
        delta = delta.reshape(n, C, -1, delta.shape[-1])
        inputs = []
        if weight in names:
            inputs.append((names[weight], a.reshape(n, -1, a.shape[-1])))
        if bias in names:
            inputs.append((names[bias], None))
        return [Term(delta=delta, inputs=inputs, transposed=True)]
    return factors


def transposed_linear_rule(weight: str = "weight", bias: str = "bias") -> Rule:
    """A rule for a linear layer that holds its weight as ``(in_features, out_features)``.

    Such a layer computes ``x @ W + b`` (``torch.addmm(b, x, W)``, ``x @ W``,
    ``torch.matmul(x, W)``) where ``nn.Linear`` computes ``x @ W.T + b``: Hugging Face's
    ``transformers.pytorch_utils.Conv1D``, which GPT-2 uses for its projections, is one.
    The rule reads the call's input at every position (inputs ``(n, ..., in)``, or their
    rows flattened by ``x.view(-1, in)`` as ``Conv1D`` does) and gives the weight the
    transposed outer product of its input and backprop.

    Parameters
    ----------
    weight : str, default="weight"
        The layer's name for its ``(in, out)`` weight.
    bias : str, default="bias"
        The layer's name for its ``(out,)`` bias, if it has one. The layer must read both
        in one call (``torch.addmm``); a bias added apart (``x @ W + b``) sends the layer
        to the fallback.

    Returns
    -------
    rule : Rule
        Register it for the layer's type: ``register_rule(Conv1D, transposed_linear_rule())``.

    Examples
    --------
    A layer written as Hugging Face's ``Conv1D``:

    >>> import torch
    >>> from torch import nn
    >>> from skpathkernel.rules import (check_rule, layer_routes, register_rule,
    ...                                 transposed_linear_rule)
    >>> class Conv1D(nn.Module):
    ...     def __init__(self, nf, nx):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(nx, nf))
    ...         self.bias = nn.Parameter(torch.zeros(nf))
    ...     def forward(self, x):
    ...         out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    ...         return out.view(x.size()[:-1] + (self.weight.shape[1],))
    >>> net = nn.Sequential(Conv1D(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(20, 1))
    >>> X = torch.randn(6, 5, 3)
    >>> register_rule(Conv1D, transposed_linear_rule())
    >>> [route.route for route in layer_routes(net, X)]
    ['rule', 'rule']
    >>> bool(check_rule(net, X) < 1e-8)
    True
    """
    return Rule(ops=_IN_OUT_OPS, factors=_in_out_factors(weight, bias),
                expand=_in_out_expand)


# ------------------------------------------------------------------------ convolution
def _conv_padding(padding, kernel, dilation, dims):
    """``(left, right)`` zero padding per spatial dimension, as F.conv*d applies it."""
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * dims
        # "same": total dilation (k - 1), the odd one on the right (torch's convention).
        return [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
                for k, d in zip(kernel, dilation)]
    return [(p, p) for p in padding]


def _tuple(value, dims):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def _unfold(x, kernel, stride, dilation, size=None):
    """``F.unfold(x, kernel, dilation, stride)``, ``(n, c prod(kernel), L)``, by one strided
    copy, for any number of spatial dimensions (``x`` is ``(n, c, *spatial)``).

    The patches are a strided view of ``x``; copying it streams whole output rows, where
    ATen's CPU im2col measured 1.5-6x slower on a convolution's inputs (one thread).
    ``size`` gives the patches' grid (default: every window that fits ``x``); its
    windows must lie inside ``x``.
    """
    n, c, *spatial = x.shape
    if size is None:
        size = [(length - d * (k - 1) - 1) // s + 1
                for length, k, s, d in zip(spatial, kernel, stride, dilation)]
    s_n, s_c, *s_x = x.stride()
    view = x.as_strided((n, c, *kernel, *size),
                        (s_n, s_c, *(d * t for d, t in zip(dilation, s_x)),
                         *(s * t for s, t in zip(stride, s_x))), x.storage_offset())
    return view.reshape(n, c * math.prod(kernel), math.prod(size))


def _padded(x, pad):
    """``F.pad(x, pad)``, or ``x`` itself where ``pad`` is all zeros (F.pad copies it)."""
    return F.pad(x, pad) if any(pad) else x


def _conv_geometry(use, dilation_at):
    """(kernel, stride, padding, dilation, groups) of a convolution call: stride, padding
    and groups are arguments 3, 4 and 6 of F.conv*d and F.conv_transpose*d alike, the
    dilation ``dilation_at`` (5 and 7). A string padding ("same", "valid") stays one."""
    weight = _arg(use, 1, "weight")
    dims = weight.ndim - 2
    padding = _arg(use, 4, "padding", 0)
    if not isinstance(padding, str):
        padding = _tuple(padding, dims)
    return (tuple(weight.shape[2:]), _tuple(_arg(use, 3, "stride", 1), dims), padding,
            _tuple(_arg(use, dilation_at, "dilation", 1), dims),
            int(_arg(use, 6, "groups", 1)))


def _conv_factors(layer, use, deltas, names):
    (a,), (delta,) = use.inputs, deltas
    kernel, stride, padding, dilation, groups = _conv_geometry(use, dilation_at=5)
    pads = _conv_padding(padding, kernel, dilation, len(kernel))
    # F.pad lists the last dimension first; it copies even without padding (a 1x1
    # shortcut's whole input, four times its stride-2 patches): not then.
    x = _padded(a, [p for pair in reversed(pads) for p in pair])
    # Patches (n, L, c_in k_h k_w), channel-major as the weight's (c_out, c_in / g, k_h, k_w).
    patches = _unfold(x, kernel, stride, dilation).transpose(1, 2)
    n, C, c_out = delta.shape[:3]
    d = delta.reshape(n, C, c_out, -1).transpose(2, 3)
    inputs = []
    if "weight" in names:
        inputs.append((names["weight"], patches))
    if "bias" in names:
        inputs.append((names["bias"], None))
    return [Term(delta=d, inputs=inputs, groups=groups)]


def _conv_accepts(dims):
    return lambda layer, use: use.inputs[0].ndim == dims + 2


CONV1D = Rule(ops=(F.conv1d,), factors=_conv_factors, accepts=_conv_accepts(1))
CONV2D = Rule(ops=(F.conv2d,), factors=_conv_factors, accepts=_conv_accepts(2))
CONV3D = Rule(ops=(F.conv3d,), factors=_conv_factors, accepts=_conv_accepts(3))


def _conv_formed(use, deltas, names):
    """A 2-D convolution's terms with its weight's per-sample gradients formed, for a
    caller that forms them anyway (the tangent-kernel engine's gradient blocks); None
    where the patches' route (:func:`_conv_factors`, then one GEMM per sample) is kept.

    The samples are the groups of one grouped convolution's weight gradient (oneDNN's
    backward by weights on the CPU), which reads the input in place: no copy of the
    patches, ``S q`` floats per sample, where the block is ``C p q``. oneDNN's speed on
    such shapes is uneven, so the route is kept to where it was measured faster (float32,
    one CPU thread, operands out of cache, ``benchmarks/results/conv_formed_kernels.md``):
    more positions than outputs x channels (``S > C p``), at most 128 of them (``C p``), a
    kernel of several positions and whole rows of 16 floats (``q``). There it formed a
    chunk's blocks 1.02-1.29x as fast (the ResNet's 32 x 32 and 16 x 16 convolutions in its
    groups of two outputs, the most); outside, 0.49-1.03x (its 8 x 8 ones 0.84-0.93x,
    CIFAR's 32 -> 64 with ten outputs 0.49x, a 1x1 kernel, RGB inputs; more outputs of
    16 or 32 channels about even).
    """
    (a,), (delta,) = use.inputs, deltas
    kernel, stride, padding, dilation, groups = _conv_geometry(use, dilation_at=5)
    n, C, c_out = delta.shape[:3]
    c_in = a.shape[1]
    if (groups != 1 or isinstance(padding, str) or math.prod(kernel) == 1
            or not _grouped_backward_fits(C, c_out, math.prod(delta.shape[3:]),
                                          c_in * math.prod(kernel), a)):
        return None
    weight = _arg(use, 1, "weight")
    g = torch.nn.grad.conv2d_weight(
        a.reshape(1, n * c_in, *a.shape[2:]), (n * C * c_out, *weight.shape[1:]),
        delta.reshape(1, n * C * c_out, *delta.shape[3:]), stride, padding, dilation, n)
    terms = [Term(delta=g.view(n, C, 1, -1), inputs=[(names["weight"], None)])]
    if "bias" in names:
        # As _conv_factors's bias: the capture sums its positions.
        d = delta.reshape(n, C, c_out, -1).transpose(2, 3)
        terms.append(Term(delta=d, inputs=[(names["bias"], None)]))
    return terms


def _grouped_backward_fits(C: int, c_out: int, positions: int, q: int,
                           like: torch.Tensor) -> bool:
    """Whether :func:`_conv_formed` takes a convolution of ``C`` outputs, ``c_out``
    channels, ``positions`` output positions and patches of ``q`` entries (see there)."""
    return (like.device.type == "cpu" and like.dtype == torch.float32 and q % 16 == 0
            and C * c_out < positions and C * c_out <= 128)


# oneDNN's grouped backward by weights holds work buffers besides the gradients it
# returns: on an AVX2 CPU (Zen 3, torch 2.13, one thread) 2.0-3.2x them (3x3 kernels,
# strided or not), 5.1-6.6x dilated (16 channels, 6-16 output positions a side;
# benchmarks/results/host_zen3-s55.md). With the gradients themselves, at most this many
# times the term's formed block (:func:`formed_workspace`).
GROUPED_BACKWARD_BYTES = 7


def formed_workspace(term, itemsize: int) -> int:
    """Bytes per sample that forming ``term``'s weight by oneDNN's grouped backward
    (:func:`_conv_formed`) may hold beyond what a capture's estimate counts for the term
    (:meth:`._capture.Capture.capture_bytes`: four times its factors, whose patches this
    route never forms); 0 where the route would not take it.

    Where the positions are few for the block (``S`` just above ``C p``), the patches
    are small beside the gradients and their work buffers: a chunk of a cross Gram of
    ``tests/test_tangent.py``'s ``_WideConvs`` held 1.5% over its budget on an AVX2 CPU.
    Where they are many (the ResNet's and CIFAR's convolutions) this is 0. From the term's
    shapes alone: a Linear's term over positions of the same shapes is counted too, the
    estimate errs on the safe side there."""
    if term.groups != 1 or term.rows is not None or len(term.inputs) != 1:
        return 0
    (_, a), (_, C, S, p) = term.inputs[0], term.delta.shape
    if a is None or not _grouped_backward_fits(C, p, S, a.shape[-1], a):
        return 0
    return max(0, itemsize * (GROUPED_BACKWARD_BYTES * C * p - 4 * S) * a.shape[-1])


def formed_terms(rule, use, deltas, names, formed):
    """The terms of a rule layer's call with the parameters named in ``formed`` handed
    on as per-sample gradients (constant-input terms), where the layer has a cheaper way
    to form them than from its factors; None otherwise (``rule.factors`` then)."""
    if rule is CONV2D and names.get("weight") in formed:
        return _conv_formed(use, deltas, names)
    return None


def _conv_transpose_factors(layer, use, deltas, names):
    # F.conv_transpose*d(a, W) is the adjoint of F.conv*d(., W) with the same stride,
    # padding, dilation and groups: z[o] = sum over (i, k) with i s + k d - p = o of
    # W[:, :, k]^T a[i]. So d f_c / d W[:, :, k] = sum_i a[i] (outer) delta_c[i s + k d - p],
    # the convolution's rule with the roles swapped: the patches are the backprop's
    # (zero-padded by p, one per input position i), the other factor the input itself
    # (as opacus' grad_sample unfolds the backprop for a transposed convolution).
    # output_padding only lengthens z at the end: every window of the padded backprop at
    # an input position lies inside it (the last one ends output_padding before its end).
    (a,), (delta,) = use.inputs, deltas
    # F.conv_transpose*d(input, weight, bias, stride, padding, output_padding, groups,
    # dilation): no string padding.
    kernel, stride, padding, dilation, groups = _conv_geometry(use, dilation_at=7)
    n, C, c_out = delta.shape[:3]
    c_in = a.shape[1]
    terms = []
    if "weight" in names:
        x = _padded(delta.reshape(n * C, c_out, *delta.shape[3:]),
                    [p for p in reversed(padding) for _ in range(2)])
        # (n, C, L, c_out k_h k_w) at the L = prod(a.shape[2:]) input positions, the
        # columns channel-major as the weight's (c_in, c_out / g, k_h, k_w).
        patches = _unfold(x, kernel, stride, dilation, a.shape[2:])
        L = patches.shape[2]
        d = patches.reshape(n, C, -1, L).transpose(2, 3)
        ins = a.reshape(n, c_in, L)
        if groups == 1:
            # The weight's rows are the input's channels: a transposed term, entries (q, p).
            terms.append(Term(delta=d, inputs=[(names["weight"], ins.transpose(1, 2))],
                              transposed=True))
        else:
            # Group j's input channels pair with its output channels only, and a transposed
            # term has no groups: the per-sample gradient itself, (c_in / g, c_out / g
            # k_h k_w) per group (a constant-input term). As many multiply-adds as the
            # ungrouped factors' blocks would take over g; spreading the groups over g
            # times the positions instead measured 1.9x slower than the fallback on a
            # depthwise (g = 64) decoder.
            grad = (ins.reshape(n, 1, groups, c_in // groups, L)
                    @ d.unflatten(3, (groups, -1)).transpose(2, 3))
            terms.append(Term(delta=grad.reshape(n, C, -1), inputs=[(names["weight"], None)]))
    if "bias" in names:
        terms.append(Term(delta=delta.reshape(n, C, c_out, -1).sum(3),
                          inputs=[(names["bias"], None)]))
    return terms


CONV_TRANSPOSE1D = Rule(ops=(F.conv_transpose1d,), factors=_conv_transpose_factors,
                        accepts=_conv_accepts(1))
CONV_TRANSPOSE2D = Rule(ops=(F.conv_transpose2d,), factors=_conv_transpose_factors,
                        accepts=_conv_accepts(2))
CONV_TRANSPOSE3D = Rule(ops=(F.conv_transpose3d,), factors=_conv_transpose_factors,
                        accepts=_conv_accepts(3))


# -------------------------------------------------------------------------- Embedding
def _embedding_accepts(layer, use):
    # max_norm renormalises the table in place; scale_grad_by_freq scales a gradient by
    # the counts of the whole batch: neither is a per-sample function of the weights.
    return (use.inputs[0].ndim >= 1 and _arg(use, 3, "max_norm") is None
            and not _arg(use, 5, "scale_grad_by_freq", False))


def _embedding_factors(layer, use, deltas, names):
    # z_s = W[i_s]: d f_c / d W = sum_s onehot(i_s) (outer) delta_cs, rows of the table
    # first, hence the transposed term. The one-hot factor (n, S, rows) is left to the
    # ids (an index term): a 30,000-token vocabulary made it the whole cost.
    (index,), (delta,) = use.inputs, deltas
    weight = _arg(use, 1, "weight")
    n, C = delta.shape[:2]
    ids = index.reshape(n, -1)
    d = delta.reshape(n, C, ids.shape[1], delta.shape[-1])
    padding_idx = _arg(use, 2, "padding_idx")
    if padding_idx is not None:
        # F.embedding gives that row no gradient: its positions' backprops are dropped.
        keep = ids != padding_idx % weight.shape[0]
        d = d * keep.reshape(n, 1, -1, 1).to(d.dtype)
    return [Term(delta=d, inputs=[(names["weight"], ids)], transposed=True,
                 rows=weight.shape[0])]


EMBEDDING = Rule(ops=(F.embedding,), factors=_embedding_factors, accepts=_embedding_accepts)


# ----------------------------------------------------------------------- normalisation
def _affine_terms(delta, xhat, names):
    """``z = xhat * w + b`` per channel: ``d f / d w = sum_s delta_s * xhat_s`` and
    ``d f / d b = sum_s delta_s``, both constant-input terms.

    ``delta`` is ``(n, C, S, channels)`` and ``xhat`` ``(n, S, channels)``.
    """
    terms = []
    if "weight" in names:
        terms.append(Term(delta=delta * xhat.unsqueeze(1), inputs=[(names["weight"], None)]))
    if "bias" in names:
        terms.append(Term(delta=delta, inputs=[(names["bias"], None)]))
    return terms


def _channel_terms(delta, xhat, names):
    """:func:`_affine_terms` of channel-first ``delta (n, C, ch, *sp)`` and
    ``xhat (n, ch, *sp)``, summed over the positions here, as one-position terms.

    The positions are the last, contiguous axis: summed along it, the product and the
    sums stream memory once (through the channels-last views of :func:`_affine_terms`
    and strided sums after them: 1.1-2.3x the time, in a ResNet's captures and alone).
    """
    n, C, ch = delta.shape[:3]
    d = delta.reshape(n, C, ch, -1)
    terms = []
    if "weight" in names:
        xh = xhat.reshape(n, 1, ch, -1)
        terms.append(Term(delta=(d * xh).sum(3), inputs=[(names["weight"], None)]))
    if "bias" in names:
        terms.append(Term(delta=d.sum(3), inputs=[(names["bias"], None)]))
    return terms


def _layer_norm_factors(layer, use, deltas, names):
    (a,), (delta,) = use.inputs, deltas
    shape = tuple(_arg(use, 1, "normalized_shape"))
    xhat = F.layer_norm(a, shape, None, None, _arg(use, 4, "eps", 1e-5))
    n, C = delta.shape[:2]
    width = math.prod(shape)
    return _affine_terms(delta.reshape(n, C, -1, width), xhat.reshape(n, -1, width), names)


def _layer_norm_accepts(layer, use):
    # The normalised dimensions must leave the samples' axis alone.
    return use.inputs[0].ndim > len(tuple(_arg(use, 1, "normalized_shape")))


# Everything from the call (shape, eps): subclasses that override forward keep it
# (timm's and torchvision's LayerNorm2d, channels-last around F.layer_norm).
LAYER_NORM = Rule(ops=(F.layer_norm,), factors=_layer_norm_factors, accepts=_layer_norm_accepts,
                  parameter_args={"weight": (2, "weight"), "bias": (3, "bias")})


def _rms_shape(use: Use) -> tuple[int, ...]:
    shape = _arg(use, 1, "normalized_shape")
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _rms_norm_factors(layer, use, deltas, names):
    # z = x / rms(x) * w, rms over the normalised (trailing) dimensions: d f / d w is
    # sum_s delta_s * x_s / rms(x_s), LayerNorm's weight term (no bias, no centring).
    # The normalised input is torch's own, with the call's eps (None: torch's default
    # for the input's dtype).
    (a,), (delta,) = use.inputs, deltas
    shape = _rms_shape(use)
    xhat = F.rms_norm(a, shape, None, _arg(use, 3, "eps"))
    n, C = delta.shape[:2]
    width = math.prod(shape)
    return _affine_terms(delta.reshape(n, C, -1, width), xhat.reshape(n, -1, width), names)


def _rms_norm_accepts(layer, use):
    # As LayerNorm's: the normalised dimensions must leave the samples' axis alone.
    return use.inputs[0].ndim > len(_rms_shape(use))


RMS_NORM = Rule(ops=(F.rms_norm,), factors=_rms_norm_factors, accepts=_rms_norm_accepts)


def _group_norm_factors(layer, use, deltas, names):
    (a,), (delta,) = use.inputs, deltas
    xhat = F.group_norm(a, _arg(use, 1, "num_groups"), None, None, _arg(use, 4, "eps", 1e-5))
    return _channel_terms(delta, xhat, names)


GROUP_NORM = Rule(ops=(F.group_norm,), factors=_group_norm_factors, accepts=_batched(2))


def _batch_norm_accepts(layer, use):
    # Eval mode with running statistics only: otherwise the statistics of the batch mix
    # the samples (the capture refuses such a module before this is asked).
    return (use.inputs[0].ndim >= 2 and not _arg(use, 5, "training", False)
            and _arg(use, 1, "running_mean") is not None
            and _arg(use, 2, "running_var") is not None)


def _batch_norm_factors(layer, use, deltas, names):
    (a,), (delta,) = use.inputs, deltas
    xhat = F.batch_norm(a, _arg(use, 1, "running_mean"), _arg(use, 2, "running_var"),
                        None, None, False, 0.0, _arg(use, 7, "eps", 1e-5))
    return _channel_terms(delta, xhat, names)


BATCH_NORM = Rule(ops=(F.batch_norm,), factors=_batch_norm_factors, accepts=_batch_norm_accepts)


class _ChannelSums:
    """BatchNorm's (eval) per-sample weight and bias gradients, ``sum_s delta_s * xhat_s``
    and ``sum_s delta_s`` per channel (:func:`_channel_terms`), summed output by output
    as the capture's backward passes compute each backprop (:meth:`add`, from a hook on
    the site's output, while the backprop is still in cache), instead of from the
    backprops of all the outputs copied into a buffer and read again.

    Both sums come from one ``native_batch_norm_backward`` in eval mode over the samples'
    channels taken as channels of one sample (``(1, n ch, *positions)`` views, the
    running statistics repeated per sample; its input gradient not asked for): one pass
    over the backprop and the layer's input, without x-hat nor the product in memory.
    On the ResNet's chunk shapes (36 rows, one output, one thread) it took 0.11-0.29 of
    the time of x-hat, the product and the two sums, 0.39-0.62 of the product and the
    sums alone (``benchmarks/results/resnet_cuts_ab-s47.md``).
    Its sums run in another order than :func:`_channel_terms`'s, ``invstd sum_s (a_s -
    mean) delta_s`` for the weight: the same to float32 rounding, not bit for bit. A
    backprop or input whose channels cannot be viewed so (channels-last memory) is summed
    as :func:`_channel_terms` does.
    """

    def __init__(self, use, names, n_out: int):
        a = use.inputs[0].detach()
        n, ch = a.shape[:2]
        self.shape = (n, ch)
        self.names = names
        self.a = a
        self.mean, self.var = _arg(use, 1, "running_mean"), _arg(use, 2, "running_var")
        self.eps = _arg(use, 7, "eps", 1e-5)
        self.folded = _channels_folded(a)
        self.stats = None if self.folded is None else (self.mean.repeat(n),
                                                       self.var.repeat(n))
        self.xhat = None
        self.weight = a.new_empty((n, n_out, ch)) if "weight" in names else None
        self.bias = a.new_empty((n, n_out, ch)) if "bias" in names else None

    def add(self, i: int, delta: torch.Tensor | None) -> None:
        """Output ``i``'s backprop, shaped as the layer's output (None: zero)."""
        outs = [out for out in (self.weight, self.bias) if out is not None]
        if delta is None:
            for out in outs:
                out[:, i].zero_()
            return
        d = None if self.folded is None else _channels_folded(delta)
        if d is not None:
            _, gw, gb = torch.ops.aten.native_batch_norm_backward(
                d, self.folded, None, *self.stats, None, None, False, self.eps,
                [False, self.weight is not None, self.bias is not None])
            for out, g in zip((self.weight, self.bias), (gw, gb)):
                if out is not None:
                    out[:, i] = g.view(self.shape)
            return
        if self.xhat is None:
            self.xhat = F.batch_norm(self.a, self.mean, self.var, None, None, False, 0.0,
                                     self.eps).reshape(*self.shape, -1)
        d = delta.reshape(self.xhat.shape)
        if self.weight is not None:
            torch.sum(d * self.xhat, 2, out=self.weight[:, i])
        if self.bias is not None:
            torch.sum(d, 2, out=self.bias[:, i])

    def terms(self) -> list[Term]:
        terms = []
        if self.weight is not None:
            terms.append(Term(delta=self.weight, inputs=[(self.names["weight"], None)]))
        if self.bias is not None:
            terms.append(Term(delta=self.bias, inputs=[(self.names["bias"], None)]))
        return terms


def _channels_folded(x: torch.Tensor) -> torch.Tensor | None:
    """``(n, ch, *positions)`` viewed as ``(1, n ch, positions)``, or None where its
    memory does not allow a view (channels-last)."""
    try:
        return x.view(1, x.shape[0] * x.shape[1], -1)
    except RuntimeError:
        return None


def site_sums(rule, use, names, n_out):
    """A :class:`_ChannelSums` for a rule layer's call whose terms are its one site's
    backprop summed over the positions (BatchNorm in eval mode), given each output's
    backprop as it is computed; None otherwise (the backprops then go to
    ``rule.factors``)."""
    if rule is not BATCH_NORM or not names:  # accepted: 2-D or more, eval mode
        return None
    return _ChannelSums(use, names, n_out)


# ---------------------------------------------------- BatchNorm (eval) after a convolution
@dataclass(frozen=True)
class FoldedUse(Use):
    """A convolution's call whose output went into an eval BatchNorm's call and nowhere
    else (``bn``, that call's :class:`Use`): the capture folds the two
    (:func:`fold_batch_norm`), and the convolution's site is the BatchNorm's output."""

    bn: Use | None = None


def foldable(use: Use, func, args, kwargs) -> bool:
    """Whether the eval BatchNorm call ``func(*args, **kwargs)`` on the output of the
    convolution call ``use`` (a rule's, F.conv1d/2d/3d) folds into it: running
    statistics, no batch statistics, a numeric padding (the input gradient is taken by
    ``convolution_backward``, which takes no string)."""
    return (use.func in (F.conv1d, F.conv2d, F.conv3d)
            and not isinstance(_arg(use, 4, "padding", 0), str)
            and _batch_norm_accepts(None, Use(func, args, kwargs, (args[0],))))


class _BatchNormAfterConv(torch.autograd.Function):
    """An eval BatchNorm ``y = z s + b'`` (per channel) of a convolution's output ``z``,
    whose backward goes to the convolution's input ``x`` by the scaled weight ``W s``:
    one input gradient instead of BatchNorm's backward and then the convolution's, and
    ``z`` is not saved. ``params``: the live parameters of both calls, so that ``y``
    requires grad where the BatchNorm's output did (their gradients are never asked
    for: the capture differentiates only the sites)."""

    @staticmethod
    def forward(ctx, x, weight, scale, geometry, bn, z, *params):
        func, args, kwargs = bn
        ctx.geometry, ctx.shape, ctx.n_params = geometry, x.shape, len(params)
        # The weight and its scale, not their product: the weight is the parameter's
        # memory, which a kept graph does not hold again.
        ctx.save_for_backward(weight, scale)
        return func(z, *args[1:], **kwargs)

    @staticmethod
    def backward(ctx, dy):
        rest = (None,) * (5 + ctx.n_params)
        if not ctx.needs_input_grad[0]:
            return (None, *rest)
        weight, scale = ctx.saved_tensors
        scaled = weight * scale.reshape(-1, *(1,) * (weight.ndim - 1))
        stride, padding, dilation, groups = ctx.geometry
        # Only the input's shape is read (as torch.nn.grad.conv2d_input passes it).
        x = dy.new_empty(1).expand(ctx.shape)
        dx = torch.ops.aten.convolution_backward(
            dy, x, scaled, None, stride, padding, dilation, False, [0] * len(stride), groups,
            (True, False, False))[0]
        return (dx, *rest)


def _bn_scale(bn: Use) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 / sqrt(var + eps)`` and the BatchNorm's scale ``s = gamma / sqrt(var + eps)``
    per channel (``gamma`` 1 without an affine weight)."""
    invstd = torch.rsqrt(_arg(bn, 2, "running_var").detach() + _arg(bn, 7, "eps", 1e-5))
    gamma = _arg(bn, 3, "weight")
    return invstd, invstd if gamma is None else gamma.detach() * invstd


def fold_batch_norm(use: Use, z: torch.Tensor, func, args, kwargs) -> torch.Tensor:
    """The eval BatchNorm call ``func(z, *args[1:], **kwargs)`` on the output ``z`` of
    the convolution call ``use`` (:func:`foldable`), its values bit for bit, as the
    output of :class:`_BatchNormAfterConv`: the backward passes skip BatchNorm's
    backward, and the graph does not hold ``z``."""
    x, weight = use.inputs[0], _arg(use, 1, "weight")
    kernel, stride, padding, dilation, groups = _conv_geometry(use, dilation_at=5)
    _, scale = _bn_scale(Use(func, args, kwargs, ()))
    params = [t for t in (weight, _arg(use, 2, "bias"), *args[1:5])
              if isinstance(t, torch.Tensor) and t.requires_grad]
    return _BatchNormAfterConv.apply(x, weight.detach(), scale,
                                     (stride, padding, dilation, groups),
                                     (func, args, kwargs), z.detach(), *params)


def _formed_weight(use: Use, delta: torch.Tensor, name: str) -> torch.Tensor:
    """A convolution's per-sample weight gradients ``(n, C, numel)`` for the backprop
    ``delta`` at its output, in the weight's flat order, in memory of their own."""
    n, C = delta.shape[:2]
    # As formed_terms: the grouped weight gradient for 2-D convolutions only (where it
    # was measured), else from the patches.
    terms = formed_terms(CONV2D if use.func is F.conv2d else None, use, (delta,),
                         {"weight": name}, {name})
    if terms is not None:
        return terms[0].delta.view(n, C, -1)
    (term,) = _conv_factors(None, use, (delta,), {"weight": name})
    return dense_grad(term, term.inputs[0][1])


def folded_terms(use: FoldedUse, delta: torch.Tensor, names, bn_names,
                 formed) -> tuple[list[Term], list[Term]]:
    """The terms of a convolution and of the eval BatchNorm folded after it
    (:func:`fold_batch_norm`), from the backprop ``delta`` at the BatchNorm's output:
    ``(convolution's terms, BatchNorm's terms)`` (those of ``bn_names``; none where the
    BatchNorm's parameters go elsewhere).

    The convolution's output ``z`` is not kept. Its backprop is ``delta s`` per channel
    (``s = gamma / sqrt(var + eps)``): a weight in ``formed`` is formed from ``delta``
    and scaled by ``s`` afterwards (a block of ``c_out q`` per sample instead of ``delta``'s
    ``c_out S``), otherwise its factor is ``delta s``. BatchNorm's weight gradient
    ``sum_p delta_p (z_p - mean) / sqrt(var + eps)`` needs ``sum_p delta_p z_p``: with a
    formed weight that is ``<W, G>`` per output channel (``G`` the weight's gradient from
    ``delta``, ``z = W * x + b``), else ``z`` recomputed without its bias, once per capture.
    No division by ``gamma``: exact where it is 0. In other sums than the unfolded
    layers': the same to float32 rounding. (Not kept: the weights that
    :func:`_conv_formed` declines left to the caller's forming from their factors, the
    backprop scaled in place and ``z`` recomputed: the benchmark ResNet's call 1.033 of
    the time by medians, ``benchmarks/results/resnet_fold_ab-s49.md``.)
    """
    n, C = delta.shape[:2]
    bn = use.bn
    weight = _arg(use, 1, "weight").detach()
    bias = _arg(use, 2, "bias")
    c_out = weight.shape[0]
    invstd, scale = _bn_scale(bn)
    d = delta.reshape(n, C, c_out, -1)
    sums = d.sum(3)
    wants = "weight" in bn_names
    conv, zsum = [], None
    if names.get("weight") in formed:
        g = _formed_weight(use, delta, names["weight"])
        gw = g.view(n, C, c_out, -1)
        if wants:
            zsum = (gw * weight.reshape(c_out, -1)).sum(3)
        gw.mul_(scale.reshape(c_out, 1))
        conv.append(Term(delta=g.view(n, C, 1, -1), inputs=[(names["weight"], None)]))
        if "bias" in names:
            conv.append(Term(delta=sums * scale, inputs=[(names["bias"], None)]))
    else:
        if wants:
            args, kwargs = list(use.args), dict(use.kwargs)
            args[:2] = use.inputs[0], weight
            if len(args) > 2:
                args[2] = None
            else:
                kwargs.pop("bias", None)
            z = use.func(*args, **kwargs)
            zsum = (d * z.reshape(n, 1, c_out, -1)).sum(3)
            del z
        if names:
            scaled = delta * scale.reshape(c_out, *(1,) * (delta.ndim - 3))
            conv = _conv_factors(None, use, (scaled,), names)
    out = []
    if wants:
        # sum_p delta_p (z_p - mean), z_p = (W * x)_p + b.
        shift = -_arg(bn, 1, "running_mean").detach()
        if bias is not None:
            shift = shift + bias.detach()
        out.append(Term(delta=(zsum + shift * sums) * invstd, inputs=[(bn_names["weight"], None)]))
    if "bias" in bn_names:
        out.append(Term(delta=sums, inputs=[(bn_names["bias"], None)]))
    return conv, out


# ------------------------------------------------------------------------------ PReLU
def _prelu_accepts(layer, use):
    # One weight per channel of axis 1 needs that axis (an unbatched 1-D input is the
    # channels themselves, not samples); one weight for all takes any input.
    return use.inputs[0].ndim >= 2 or _arg(use, 1, "weight").numel() == 1


def _prelu_factors(layer, use, deltas, names):
    # z = max(0, a) + w min(0, a): d f_c / d w = sum over the channel's positions of
    # delta_c * min(0, a), a constant-input term. A rule, not the fallback: vmap(jacrev)
    # of prelu's backward raises, or for as many samples as outputs returns wrong
    # numbers (torch 2.13), where this is exact.
    (a,), (delta,) = use.inputs, deltas
    n, C = delta.shape[:2]
    g = delta * a.clamp(max=0).unsqueeze(1)
    width = _arg(use, 1, "weight").numel()
    g = g.reshape(n, C, width, -1) if width > 1 else g.reshape(n, C, 1, -1)
    return [Term(delta=g.sum(3), inputs=[(names["weight"], None)])]


PRELU = Rule(ops=(F.prelu,), factors=_prelu_factors, accepts=_prelu_accepts)


# ------------------------------------------------------------------ MultiheadAttention
_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
             "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p",
             "out_proj_weight", "out_proj_bias")


def _mha_bind(args, kwargs) -> dict:
    bound = dict(zip(_MHA_ARGS, args))
    bound.update(kwargs)
    return bound


def _plain_attention(b: dict) -> bool:
    """Whether the call is ``scaled_dot_product_attention`` on the projected heads alone:
    no attention weights asked for, no mask, no causal hint, no zero or static keys, no
    dropout on the weights (torch's function draws it in training mode)."""
    dropout = b.get("training", True) and b.get("dropout_p", 0.0) > 0
    return (not dropout and not b.get("need_weights", True) and b.get("attn_mask") is None
            and b.get("key_padding_mask") is None and not b.get("is_causal", False)
            and not b.get("add_zero_attn", False) and b.get("static_k") is None
            and b.get("static_v") is None)


def _packed_heads(z: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """q, k and v of a packed in-projection's output ``z (n, S, 3E)``, as the
    ``(n, heads, S, E / heads)`` views that attention takes.

    Split by ``unbind`` of a ``(n, S, 3, heads, E / heads)`` view: the backward pass
    stacks the three gradients straight into ``z``'s layout, the projection's ``(n S, 3E)``
    rows, in one copy. (Chunks of ``z``'s sequence-first transpose cost a ``cat`` into
    that transpose and then a copy back to rows.)
    """
    return [t.transpose(1, 2) for t in z.unflatten(-1, (3, heads, -1)).unbind(2)]


def _mha_expand(layer, func, args, kwargs):
    """F.multi_head_attention_forward as three sites: in-projection(s), core, out-projection.

    The projections are computed here, samples first; the attention core (masks, scaling,
    softmax, dropout, weights) is torch's own call, given the projected q, k, v with
    identity projections (exact: each output is ``x * 1`` plus zeros).
    """
    b = _mha_bind(args, kwargs)
    query, key, value = b["query"], b["key"], b["value"]
    if (query.ndim != 3 or b.get("bias_k") is not None or b.get("bias_v") is not None
            or (b.get("training", True) and b.get("dropout_p", 0.0) > 0)):
        return None  # unbatched, learned key/value biases, active dropout: the fallback
    E = int(b["embed_dim_to_check"])
    bias = b.get("in_proj_bias")
    separate = b.get("use_separate_proj_weight", False)
    if not separate and query is key and key is value:
        xb = query.transpose(0, 1)
        z = F.linear(xb, b["in_proj_weight"], bias)
        sites = [(xb, z)]
        q, k, v = z.transpose(0, 1).chunk(3, dim=-1)
    else:
        weights = ((b["q_proj_weight"], b["k_proj_weight"], b["v_proj_weight"]) if separate
                   else b["in_proj_weight"].chunk(3))
        biases = (None,) * 3 if bias is None else bias.chunk(3)
        sites = []
        for x, w, bb in zip((query, key, value), weights, biases):
            xb = x.transpose(0, 1)
            sites.append((xb, F.linear(xb, w, bb)))
        q, k, v = (z.transpose(0, 1) for _, z in sites)
    if _plain_attention(b):
        # The core alone, as torch computes it without weights or masks: identity
        # projections would add four E x E products to every forward and backward pass.
        heads = int(b["num_heads"])
        q, k, v = (_packed_heads(sites[0][1], heads) if len(sites) == 1 else
                   (z.transpose(0, 1).unflatten(-1, (heads, E // heads)).transpose(1, 2)
                    for z in (q, k, v)))
        cb = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        attn = None
    else:
        eye = torch.eye(E, dtype=q.dtype, device=q.device)
        inner = {**b, "query": q, "key": k, "value": v, "in_proj_weight": None,
                 "in_proj_bias": None, "use_separate_proj_weight": True, "q_proj_weight": eye,
                 "k_proj_weight": eye, "v_proj_weight": eye, "out_proj_weight": eye,
                 "out_proj_bias": None}
        core, attn = func(**inner)
        cb = core.transpose(0, 1)
    z_out = F.linear(cb, b["out_proj_weight"], b.get("out_proj_bias"))
    sites.append((cb, z_out))
    # A copy: an in-place operation downstream must not rewrite the site's output.
    return (z_out.transpose(0, 1).clone(), attn), sites


def _mha_factors(layer, use, deltas, names):
    b = _mha_bind(use.args, use.kwargs)
    *ins, out = use.inputs
    *d_ins, d_out = deltas
    terms = []
    if len(ins) == 1:  # self-attention, packed: one (3E x E) Kronecker factor
        inputs = [(names[k], a) for k, a in (("in_proj_weight", ins[0]), ("in_proj_bias", None))
                  if k in names]
        if inputs:
            terms.append(Term(delta=d_ins[0], inputs=inputs))
    else:
        # q, k, v from different inputs (lengths may differ: zero positions pad them).
        S = max(a.shape[1] for a in ins)
        pad = [(F.pad(a, (0, 0, 0, S - a.shape[1])), F.pad(d, (0, 0, 0, S - d.shape[2])))
               for a, d in zip(ins, d_ins)]
        if b.get("use_separate_proj_weight", False):
            for key, (a, d) in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), pad):
                if key in names:
                    terms.append(Term(delta=d, inputs=[(names[key], a)]))
        elif "in_proj_weight" in names:
            terms.append(Term(delta=torch.cat([d for _, d in pad], dim=3),
                              inputs=[(names["in_proj_weight"],
                                       torch.cat([a for a, _ in pad], dim=2))], groups=3))
        if "in_proj_bias" in names:
            terms.append(Term(delta=torch.cat([d.sum(2, keepdim=True) for d in d_ins], dim=3),
                              inputs=[(names["in_proj_bias"], None)]))
    inputs = [(names[k], a) for k, a in (("out_proj.weight", out), ("out_proj.bias", None))
              if k in names]
    if inputs:
        terms.append(Term(delta=d_out, inputs=inputs))
    return terms


MULTIHEAD_ATTENTION = Rule(ops=(F.multi_head_attention_forward,), factors=_mha_factors,
                           expand=_mha_expand)


for _type, _rule in [(nn.Linear, LINEAR), (nn.Conv1d, CONV1D), (nn.Conv2d, CONV2D),
                     (nn.Conv3d, CONV3D), (nn.ConvTranspose1d, CONV_TRANSPOSE1D),
                     (nn.ConvTranspose2d, CONV_TRANSPOSE2D),
                     (nn.ConvTranspose3d, CONV_TRANSPOSE3D),
                     (nn.Embedding, EMBEDDING), (nn.LayerNorm, LAYER_NORM),
                     (nn.RMSNorm, RMS_NORM),
                     (nn.GroupNorm, GROUP_NORM), (nn.BatchNorm1d, BATCH_NORM),
                     (nn.BatchNorm2d, BATCH_NORM), (nn.MultiheadAttention, MULTIHEAD_ATTENTION),
                     (nn.PReLU, PRELU), (nn.LSTM, LSTM), (nn.GRU, GRU), (nn.RNN, RNN),
                     # MultiheadAttention's out_proj type, whose forward is nn.Linear's own.
                     (nn.modules.linear.NonDynamicallyQuantizableLinear, LINEAR)]:
    register_rule(_type, _rule)
