"""Rules for nn.RNN, nn.LSTM and nn.GRU: per-sample gradients as sums over time.

torch runs a recurrent layer as one fused call (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``, ``torch.rnn_relu``) that ``torch.func`` does not batch: its ``vmap``
loops over the samples, one small recurrence each. The rule's ``expand`` runs the same
recurrence in Python over the whole batch instead, one layer and direction at a time,
samples first, and exposes its pre-activations as sites (as opacus' DP-RNN modules do
with their ``RNNLinear`` cells). The gradient of a weight is then a sum over the time
steps ``t`` of outer products::

    d f / d W_ih = sum_t delta_t (outer) x_t,      d f / d W_hh = sum_t delta'_t (outer) h_{t-1}

``delta_t`` the backprop of the input projection ``x_t W_ih^T + b_ih`` (a site over all
steps at once, the steps its positions) and ``delta'_t`` that of the hidden projection
``h_{t-1} W_hh^T + b_hh``. For RNN and LSTM both projections enter the gates as a sum, so
``delta' = delta`` and one site per layer and direction serves every parameter; GRU
multiplies the new gate's hidden projection by its reset gate, so a zero probe added to
the hidden projections of every step is a second site whose backprop is ``delta'``.

Packed sequences, ``proj_size``, dropout between layers in training mode and unbatched
inputs are declined (the layer goes to the fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._rules import Rule, Term

__all__ = ["GRU", "LSTM", "RNN"]


def _cells(layer: nn.Module, params: list) -> list[tuple[list[str], list[torch.Tensor]]]:
    """The local names and tensors of each (layer, direction) of the call's flat weights,
    in torch's order: ``w_ih, w_hh[, b_ih, b_hh]`` per layer, the reverse direction
    second."""
    per = len(params) // (layer.num_layers * (2 if layer.bidirectional else 1))
    out = []
    for k in range(layer.num_layers):
        for suffix in ("", "_reverse")[: 2 if layer.bidirectional else 1]:
            names = [f"weight_ih_l{k}{suffix}", f"weight_hh_l{k}{suffix}",
                     f"bias_ih_l{k}{suffix}", f"bias_hh_l{k}{suffix}"][:per]
            start = len(out) * per
            out.append((names, list(params[start : start + per])))
    return out


def _step(mode: str, gi, h, c, w_hh, b_hh, probe):
    """One step: the gates' input projection ``gi`` (n, G H), state ``h`` (and ``c``)."""
    gh = F.linear(h, w_hh, b_hh)
    if probe is not None:
        gh = gh + probe
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, dim=1)
        hr, hz, hn = gh.chunk(3, dim=1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, c
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), c


def _expand(layer, func, args, kwargs):
    """The fused call as a Python recurrence over the batch (see the module's notes)."""
    # Unpacked: (input, hx, params, has_biases, num_layers, dropout, train,
    # bidirectional, batch_first); packed sequences put batch_sizes second.
    mode = _MODES[func]
    if (kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple))
            or getattr(layer, "proj_size", 0) or args[0].ndim != 3
            or (args[6] and args[5] > 0 and layer.num_layers > 1)):
        return None
    x, hx, params, _, num_layers, _, _, bidirectional, batch_first = args
    if mode == "LSTM":
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    seq = x if batch_first else x.transpose(0, 1)
    n, T = seq.shape[:2]
    n_dir = 2 if bidirectional else 1
    sites, h_n, c_n = [], [], []
    cells = _cells(layer, params)
    for k in range(num_layers):
        outs = []
        for d in range(n_dir):
            _, ws = cells[k * n_dir + d]
            w_ih, w_hh, b_ih, b_hh = (*ws, None, None)[:4]
            zi = F.linear(seq, w_ih, b_ih)
            probe = None
            if mode == "GRU":
                probe = zi.new_zeros(zi.shape).requires_grad_(True)
            h, c = h0[k * n_dir + d], None if c0 is None else c0[k * n_dir + d]
            order = range(T - 1, -1, -1) if d else range(T)
            hs, prev = [None] * T, [None] * T
            # The steps as one unbind, not T selections: each select's backward writes a
            # zero tensor the size of all the steps (T^2 traffic, 4.4 of a 6.7 s diagonal).
            gis = zi.unbind(1)
            probes = [None] * T if probe is None else probe.unbind(1)
            for t in order:
                prev[t] = h
                h, c = _step(mode, gis[t], h, c, w_hh, b_hh, probes[t])
                hs[t] = h
            a_h = torch.stack(prev, dim=1)
            if probe is None:
                sites.append((torch.cat([seq, a_h], dim=2), zi))
            else:
                sites += [(seq, zi), (a_h, probe)]
            outs.append(torch.stack(hs, dim=1))
            h_n.append(h)
            c_n.append(c)
        seq = torch.cat(outs, dim=2) if n_dir > 1 else outs[0]
    out = seq if batch_first else seq.transpose(0, 1)
    hidden = torch.stack(h_n)
    if mode == "LSTM":
        return (out, hidden, torch.stack(c_n)), sites
    return (out, hidden), sites


def _factors(layer, use, deltas, names):
    """Per (layer, direction): for RNN and LSTM one site, whose input is ``x_t`` and
    ``h_{t-1}`` side by side (their weights share the gates' backprop); for GRU two, the
    input projection's (``x_t``) and the hidden probe's (``h_{t-1}``)."""
    gru = use.func is torch.gru
    terms = []
    for j, (local, ws) in enumerate(_cells(layer, use.args[2])):
        w_ih, w_hh, *biases = local
        b_ih, b_hh = (*biases, None, None)[:2]
        if gru:
            a_x, a_h = use.inputs[2 * j], use.inputs[2 * j + 1]
            pairs = [(deltas[2 * j], ((w_ih, a_x), (b_ih, None))),
                     (deltas[2 * j + 1], ((w_hh, a_h), (b_hh, None)))]
        else:
            a = use.inputs[j]
            q = ws[0].shape[1]
            pairs = [(deltas[j], ((w_ih, a[..., :q]), (w_hh, a[..., q:]), (b_ih, None),
                                  (b_hh, None)))]
        for delta, inputs in pairs:
            inputs = [(names[k], a) for k, a in inputs if k is not None and k in names]
            if inputs:
                terms.append(Term(delta=delta, inputs=inputs))
    return terms


_MODES = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH",
          torch.rnn_relu: "RNN_RELU"}

LSTM = Rule(ops=(torch.lstm,), factors=_factors, expand=_expand)
GRU = Rule(ops=(torch.gru,), factors=_factors, expand=_expand)
RNN = Rule(ops=(torch.rnn_tanh, torch.rnn_relu), factors=_factors, expand=_expand)
