"""The capture of a plain convolutional ``nn.Sequential``, its backprops computed by hand.

A network of exact ``nn.Conv2d`` / ``nn.ReLU`` / ``nn.MaxPool2d`` / ``nn.Flatten`` /
``nn.Linear`` layers without hooks, convolution blocks (each a convolution, then ReLUs and
at most one max-pool whose windows do not overlap) then a flattened Linear head (the
CIFAR CNN of the benchmark), has backprops that need no autograd graph:

- The head's backprop of output ``c`` is the one-hot ``e_c``, and its input's is row ``c``
  of its weight, the same for every sample.
- A block's ReLUs and max-pool pass each entry of the gradient at its output on unchanged
  or not at all: ``threshold_backward`` against the block's output (a ReLU's mask at the
  pool's argmax is the pooled output > 0), then added to zeros at the argmax (the
  forward's indices) as the max-pool's backward does: at the pooled resolution, for all
  the outputs in one call, written straight into the buffers the terms are formed from
  (no zero fill and scatter per output, no copy of every output's gradient).
- A convolution's input gradient is the ``convolution_backward`` call (input gradient
  only) that autograd's backward makes per output, once on the ``n C`` rows of all the
  outputs' backprops.

The backprops are the values autograd's backward passes give, bit for bit (selections,
and convolutions whose rows are computed alike in a larger batch), and the terms are then
built by the layers' rules from them (:func:`._capture.plain_cnn_capture`), so the Gram is
the general capture's; except where the caller forms the first convolution's gradients
and a max-pool follows it: they are formed from its pooled backprops instead
(:func:`first_formed`), the same values in other sums. Anything else (other layer types
or arguments, a parameter outside ``params``, a rule registered over the built-in ones,
hooks, global module hooks such as ``FlopCounterMode``'s) takes the general capture. On
the CIFAR CNN (N = 1024, ten outputs, one thread):
``benchmarks/results/cnn_route_ab-s47.md``; the forward's max-pools after a ReLU by the
channels-last kernel (:func:`_max_pool`) and the pooled backprops in :func:`first_formed`'s layout
(:func:`_pooled`): ``benchmarks/results/cifar_faults_ab-s48.md``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._layers import CONV2D, LINEAR, _conv_geometry, _conv_padding, _unfold
from ._rules import RULES, Term, Use
from ._stacked import _global_hooks, _hooked

__all__ = ["PlainCNN", "cnn_backprops", "plain_cnn"]


@dataclasses.dataclass(frozen=True)
class _Block:
    """A convolution and the ReLUs / max-pool after it, in order (``gates``)."""

    prefix: str
    conv: nn.Conv2d
    gates: tuple[nn.Module, ...]


@dataclasses.dataclass(frozen=True)
class PlainCNN:
    """A plain CNN's convolution blocks and its output Linear (prefixes as in ``params``)."""

    blocks: tuple[_Block, ...]
    head_prefix: str
    head: nn.Linear


def _tiling_pool(m: nn.Module) -> bool:
    """A max-pool whose windows tile its input: each entry is in at most one window."""
    k, s = m.kernel_size, m.stride if m.stride is not None else m.kernel_size
    k = (k, k) if isinstance(k, int) else tuple(k)
    s = (s, s) if isinstance(s, int) else tuple(s)
    pad = m.padding if isinstance(m.padding, (tuple, list)) else (m.padding,) * 2
    dil = m.dilation if isinstance(m.dilation, (tuple, list)) else (m.dilation,) * 2
    return (k == s and all(p == 0 for p in pad) and all(d == 1 for d in dil)
            and not m.ceil_mode and not m.return_indices)


def plain_cnn(module: nn.Module, names) -> PlainCNN | None:
    """The module as a :class:`PlainCNN`, or None when it is anything else.

    ``names``: the differentiated parameters, which must be exactly the layers' weights
    and biases. Exact types without hooks or a patched ``forward`` only, and the built-in
    rules for nn.Conv2d and nn.Linear.
    """
    if (type(module) is not nn.Sequential or _hooked(module) or _global_hooks()
            or RULES.get(nn.Conv2d) is not CONV2D or RULES.get(nn.Linear) is not LINEAR):
        return None
    # Every entry, a module listed twice included (a stateless ReLU or max-pool reused, as
    # the benchmark's CNNs do); a layer with parameters listed twice names a parameter
    # that ``names`` lacks (``named_parameters`` gives it once), and is refused below.
    children = list(module._modules.items())
    if len(children) < 3 or any(child is None for _, child in children):
        return None
    blocks, seen, i = [], [], 0
    while i < len(children) and type(children[i][1]) is nn.Conv2d:
        prefix, conv = children[i]
        if (_hooked(conv) or conv.padding_mode != "zeros" or isinstance(conv.padding, str)
                or conv.transposed):
            return None
        seen += [f"{prefix}.weight"] + ([] if conv.bias is None else [f"{prefix}.bias"])
        gates, pools = [], 0
        i += 1
        while i < len(children) and type(children[i][1]) in (nn.ReLU, nn.MaxPool2d):
            gate = children[i][1]
            if _hooked(gate) or (type(gate) is nn.MaxPool2d and not _tiling_pool(gate)):
                return None
            pools += type(gate) is nn.MaxPool2d
            gates.append(gate)
            i += 1
        if pools > 1:
            return None
        blocks.append(_Block(prefix, conv, tuple(gates)))
    if not blocks or len(children) != i + 2:
        return None
    (_, flat), (head_prefix, head) = children[i], children[i + 1]
    if (type(flat) is not nn.Flatten or _hooked(flat) or flat.start_dim != 1
            or flat.end_dim != -1 or type(head) is not nn.Linear or _hooked(head)):
        return None
    seen += [f"{head_prefix}.weight"] + ([] if head.bias is None else [f"{head_prefix}.bias"])
    if sorted(seen) != sorted(names) or len(set(seen)) != len(seen):
        return None
    return PlainCNN(tuple(blocks), head_prefix, head)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def cnn_backprops(cnn: PlainCNN, params, X: torch.Tensor, outputs, buffer,
                  pooled_first=False):
    """The forward pass and every output's backprops at the layers' sites, by hand.

    ``buffer(j, shape, like)`` gives the backprops' memory of the ``j``-th site (the
    convolutions in order, then the head; then buffers for the convolutions' input
    gradients). Returns ``(calls, deltas, idx)``: per rule layer ``(layer, rule, names,
    use, sites)`` as :func:`._capture._accepted_layers` gives them, the backprops
    ``(n, C, *z.shape[1:])`` of the sites in that order (the first one's at its pooled
    output with ``pooled_first``, see :func:`_backward`), and the first block's pool's
    argmax (None without a pool).
    """
    calls, saved = _forward(cnn, params, X)
    return calls, _backward(calls, saved, outputs, buffer, pooled_first), saved[0][1]


def _forward(cnn: PlainCNN, params, X: torch.Tensor):
    """The forward pass: the rule layers' calls (:func:`cnn_backprops`) and, per block,
    what its backward needs: ``(ref, idx, input, conv args, output shape)``."""
    h = X  # read only: no operation here writes into its input
    calls, saved = [], []
    for block in cnn.blocks:
        conv = block.conv
        w = params[f"{block.prefix}.weight"]
        b = None if conv.bias is None else params[f"{block.prefix}.bias"]
        args = (h, w, b, conv.stride, conv.padding, conv.dilation, conv.groups)
        z = F.conv2d(*args)
        names = {"weight": f"{block.prefix}.weight"}
        if b is not None:
            names["bias"] = f"{block.prefix}.bias"
        calls.append((conv, CONV2D, names, Use(F.conv2d, args, {}, (h,)), (z,)))
        # The ReLUs' masks, at the pool's argmax, are the block's output > 0 (with a ReLU
        # before the pool, the window's maximum is its argmax's ReLU output; ReLUs after
        # it see that maximum): ``ref``, None without a ReLU. ``idx``: the pool's argmax.
        # A ReLU right before the pool is applied by :func:`_max_pool`.
        ref, idx, out, gates = None, None, z, block.gates
        for i, gate in enumerate(gates):
            if type(gate) is nn.ReLU:
                if i + 1 == len(gates) or type(gates[i + 1]) is not nn.MaxPool2d:
                    out = ref = torch.relu(out)
                continue
            relu = i > 0 and type(gates[i - 1]) is nn.ReLU
            out, idx = _max_pool(out, _pair(gate.kernel_size), relu)
            ref = out if relu or ref is not None else None
        saved.append((ref, idx, h, args, out.shape[1:]))
        h = out
    head = cnn.head
    wh = params[f"{cnn.head_prefix}.weight"]
    bh = None if head.bias is None else params[f"{cnn.head_prefix}.bias"]
    a = h.flatten(1)
    args = (a, wh, bh)
    f = F.linear(*args)
    names = {"weight": f"{cnn.head_prefix}.weight"}
    if bh is not None:
        names["bias"] = f"{cnn.head_prefix}.bias"
    calls.append((head, LINEAR, names, Use(F.linear, args, {}, (a,)), (f,)))
    return calls, saved


def _max_pool(z: torch.Tensor, k: tuple[int, int],
              relu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.max_pool2d`` of tiling windows ``k`` with its argmax, of ``torch.relu(z)`` with
    ``relu``; NCHW-contiguous.

    With ``relu`` by the channels-last kernel, the ReLU written in its layout: the same
    values and indices (the first maximum of each window, NaN included) as on NCHW rows,
    whose kernel is scalar. On the CIFAR CNN's 32 x 32 and 16 x 16 rows (23 rows, one
    thread) 1.25 and 0.53 ms against 3.57 and 1.94 with a channels-last copy of the
    ReLU's output (``benchmarks/results/cifar_faults_ab-s48.md``); the ReLU written there
    instead, the chunk's forward 4.56 ms against that copy's 5.97 and the NCHW pool's
    8.59 (``benchmarks/results/cnn_pool_budget-s48.md``). Without a ReLU to write, a
    channels-last copy of ``z`` (the convolution's output, held as the layer's site) is
    memory the plan does not count: on NCHW rows then (and for 1 x 1 windows, whose
    results are as large as their input). The ReLU's copy is freed before the results'
    NCHW copies, the argmax's first: the forward's peak is the NCHW pool's
    (``benchmarks/results/cnn_pool_budget-s48.md``).
    """
    if not relu or k == (1, 1):
        return F.max_pool2d(torch.relu(z) if relu else z, k, k, 0, 1, False, True)
    x = torch.empty_like(z, memory_format=torch.channels_last)
    torch.clamp_min(z, 0, out=x)  # torch.relu's operation (and bits), into x's layout
    out, idx = F.max_pool2d(x, k, k, 0, 1, False, True)
    del x
    # NCHW strides even where channels-last ones pass for contiguous (1 x 1 results, one
    # channel): a convolution on them took oneDNN's channels-last path, other bits.
    idx_nchw = idx.clone(memory_format=torch.contiguous_format)
    del idx
    return out.clone(memory_format=torch.contiguous_format), idx_nchw


def _backward(calls, saved, outputs, buffer, pooled_first=False):
    """Every output's backprops at the sites of ``calls`` (:func:`_forward`'s).

    ``pooled_first``: the first convolution's are left at its block's pooled output,
    ReLU-gated, ``(n, C, c, h, w)`` (:func:`first_formed` forms its gradients from them).
    """
    f, wh = calls[-1][4][0], calls[-1][3].args[1]
    n, C, nb = f.shape[0], len(outputs), len(saved)
    # The sites' buffers in order (``buffer`` grows a list of them); with
    # ``pooled_first`` the first is the pooled backprops', laid out ``(n, c, C, h, w)``:
    # :func:`first_formed` multiplies each channel's ``C x L`` rows.
    deltas = [buffer(j, (n, saved[0][4][0], C, *saved[0][4][1:]) if j == 0 and pooled_first
                     else (n, C, *calls[j][4][0].shape[1:]), calls[j][4][0])
              for j in range(nb + 1)]
    # The head's backprops: output c's gradient of f[:, c].sum() is the one-hot e_c.
    d_head = deltas[nb]
    d_head.zero_()
    d_head[:, torch.arange(C, device=f.device), torch.as_tensor(outputs, device=f.device)] = 1
    # The head's input's: row c of its weight for every sample (the one-hot row times the
    # weight, exactly), shaped as the last block's output; every output at once.
    g = wh[list(outputs)].reshape(1, C, *saved[-1][4])
    ref, idx = saved[-1][:2]
    if nb == 1 and pooled_first:
        deltas[0] = _pooled(deltas[0], g.expand(n, *g.shape[1:]), ref)
        return deltas
    _gate(deltas[nb - 1], g, None if ref is None else ref.unsqueeze(1),
          None if idx is None else idx.unsqueeze(1))
    for j in range(nb - 1, 0, -1):
        a_in, args = saved[j][2:4]
        ref, idx = saved[j - 1][:2]
        w, d = args[1], deltas[j]
        # The convolution's input gradient for every output at once: one call of the
        # convolution_backward (input gradient only) that autograd's backward makes per
        # output, on the n C rows of the backprops (the same bits per row; measured
        # 1.04-1.18x as fast as C calls on a 16-row chunk of the CIFAR CNN). The data
        # gradient does not depend on the input's values: an input of its shape, in a
        # buffer reused by the chunks, its contents whatever they are (a fresh tensor
        # each call made it up to 1.6x slower: oneDNN reads it, its pages fault in).
        shape = (n * C, *a_in.shape[1:])
        g = torch.ops.aten.convolution_backward(
            d.reshape(n * C, *d.shape[2:]), buffer(2 * nb - j, shape, a_in).view(shape), w,
            None if args[2] is None else [w.shape[0]], list(args[3]), list(args[4]),
            list(args[5]), False, [0, 0], args[6], [True, False, False])[0]
        g = g.view(n, C, *g.shape[1:])
        if j == 1 and pooled_first:
            deltas[0] = _pooled(deltas[0], g, ref)
            break
        _gate(deltas[j - 1], g, None if ref is None else ref.unsqueeze(1),
              None if idx is None else idx.unsqueeze(1))
    return deltas


def _pooled(buf: torch.Tensor, g: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """The gradient ``g`` at a block's pooled output, ReLU-gated (:func:`_gate` without
    the scatter to the convolution's output), written into ``buf`` ``(n, c, C, h, w)``;
    returned as its ``(n, C, c, h, w)`` view.

    Written in :func:`first_formed`'s layout as it is computed: a copy of it there took
    0.075 s of the CIFAR CNN's call (N = 1024, ten outputs).
    """
    out = buf.transpose(1, 2)
    if ref is None:
        return out.copy_(g)
    return torch.ops.aten.threshold_backward.grad_input(g, ref.unsqueeze(1), 0,
                                                        grad_input=out)


def pools_first(cnn: PlainCNN, X: torch.Tensor, n_outputs: int) -> bool:
    """Whether the first block's gradients are formed from its pooled backprops
    (:func:`first_formed`): a max-pool after it, no groups, and the gather no larger
    than the backprop buffer it replaces.

    The memory budget's plan counts that buffer, ``(n, C, c_out, S)`` at the
    convolution's ``S`` positions, not :func:`first_formed`'s rows of patches ``(n S,
    q)`` and the ``(n c_out, L, q)`` patches at the ``L`` windows' argmax: with one output
    and a 7 x 7 convolution those took the peak to 1.4-1.5x the budget. The CIFAR CNN's ten
    outputs of a 3 x 3 one leave them 0.76 of the buffer.
    """
    block = cnn.blocks[0]
    conv = block.conv
    pool = next((g for g in block.gates if type(g) is nn.MaxPool2d), None)
    if conv.groups != 1 or pool is None:
        return False
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in zip(
        X.shape[2:], _pair(conv.padding), _pair(conv.dilation), _pair(conv.kernel_size),
        _pair(conv.stride))]
    S = out[0] * out[1]
    L = math.prod(size // k for size, k in zip(out, _pair(pool.kernel_size)))
    q, c_out = conv.weight[0].numel(), conv.out_channels
    return q * (S + c_out * L) <= n_outputs * c_out * S


def first_formed(use: Use, pooled: torch.Tensor, idx: torch.Tensor, names) -> list[Term]:
    """The first convolution's per-sample gradients from its pooled backprops
    (``pooled``, ``(n, C, c_out, h, w)``, :func:`_backward`'s ``pooled_first``) and the
    pool's argmax ``idx``: constant-input terms, the weight's ``(n, C, 1, c_out q)`` in its
    flat order, the bias's ``(n, C, 1, c_out)``.

    Its backprop at the convolution's output is zero but at each window's argmax, so the
    weight's gradient of channel ``o`` is the pooled gradients times the patches at that
    channel's argmax positions: one GEMM ``(C x L) @ (L x q)`` per sample and channel
    over the ``L`` windows, a quarter of the products over every position, and no
    backprop buffer at the convolution's resolution. The same values as the rule's
    factors formed (:func:`._layers._conv_factors`), in other sums: not the same bits.
    """
    (a,) = use.inputs
    kernel, stride, padding, dilation, _ = _conv_geometry(use, dilation_at=5)
    pads = _conv_padding(padding, kernel, dilation, len(kernel))
    x = F.pad(a, [p for pair in reversed(pads) for p in pair])
    patches = _unfold(x, kernel, stride, dilation)  # (n, q, S)
    n, q, S = patches.shape
    C, c_out = pooled.shape[1:3]
    L = idx.shape[2] * idx.shape[3]
    rows = patches.transpose(1, 2).reshape(n * S, q)
    at = (idx.reshape(n, c_out * L) + torch.arange(n, device=idx.device).mul_(S)[:, None])
    picked = rows.index_select(0, at.reshape(-1)).view(n * c_out, L, q)
    gg = pooled.flatten(3)  # (n, C, c_out, L), channels outermost in memory (_pooled)
    G = torch.bmm(gg.transpose(1, 2).reshape(n * c_out, C, L), picked)
    weight = G.view(n, c_out, C, q).transpose(1, 2).reshape(n, C, 1, c_out * q)
    terms = [Term(delta=weight, inputs=[(names["weight"], None)])]
    if "bias" in names:
        terms.append(Term(delta=gg.sum(3).unsqueeze(2), inputs=[(names["bias"], None)]))
    return terms


def _gate(out: torch.Tensor, g: torch.Tensor, ref: torch.Tensor | None,
          idx: torch.Tensor | None) -> None:
    """The gradient ``g`` at a block's output passed back through its ReLUs (``ref``: the
    block's output, whose entries > 0 pass) and max-pool (``idx``: its argmax) to the
    convolution's output, written into ``out``; broadcast over leading dimensions.

    Autograd's operations in the same order of values: ``threshold_backward`` (the ReLU's
    backward, here at the pooled resolution), then ``0 + g`` added at the argmax, as
    ``max_pool2d_with_indices_backward`` does (the same bits, signed zeros included).
    """
    if ref is not None:
        g = torch.ops.aten.threshold_backward(g, ref, 0)
    if idx is None:
        out.copy_(g)
        return
    out.zero_()
    src = g.expand(*out.shape[:-2], *g.shape[-2:]).flatten(-2)
    out.flatten(-2).scatter_add_(-1, idx.flatten(-2).expand(src.shape), src)
