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

A packed sequence (``nn.utils.rnn.PackedSequence``) reaches the fused call as its rows in
length order, ``batch_sizes`` rows per step, without the samples' order, which the rule
reads from the layer's own input (``Rule.call_inputs``). The rule runs it as the padded
batch in the samples' order, each row taking the steps of its own length and holding its
state after (``torch.where``): no gradient reaches a site's positions past a sample's end,
so each weight's per-sample gradient sums that sample's own steps; ``h0`` comes in and
``h_n`` goes out in the call's order. A packed sequence that does not carry the samples'
order (``enforce_sorted=True``, or built without ``sorted_indices``) is declined: its rows
may be the samples as the forward sorted them by length, which the rule cannot tell.

``proj_size``, dropout between layers in training mode and unbatched inputs are declined
(the layer goes to the fallback, and :func:`layer_routes` says which of them declined it).
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


def _packed(args) -> bool:
    """Whether the fused call is a packed one (``batch_sizes``, integers, second)."""
    return len(args) > 1 and isinstance(args[1], torch.Tensor) and not args[1].is_floating_point()


def _declined(layer, args, kwargs, packed) -> str | None:
    """Why the rule cannot run this call as its sites (None: it can)."""
    if kwargs or len(args) != 9 or not isinstance(args[3 if packed else 2], (list, tuple)):
        return "a call of the fused operation with arguments torch's forward does not pass"
    if getattr(layer, "proj_size", 0):
        return "proj_size (the rule has no factors for the projection of the hidden state)"
    if not packed and args[0].ndim != 3:
        return "an unbatched input (one sequence without a batch dimension)"
    dropout, train = args[6:8] if packed else args[5:7]
    if train and dropout > 0 and layer.num_layers > 1:
        return ("dropout between layers in training mode (a random mask per call, not a "
                "fixed function of the sample; in eval mode the rule applies)")
    return None


def _unpacked(args, call):
    """A packed call's input as the padded batch in the samples' order, samples first:
    ``(seq (n, T, q), h0, c0, lengths (n,), sorted, at)``; ``sorted`` the sample of each
    row of the call (length order: ``hx`` comes in that order and ``h_n`` goes out in it),
    ``at`` the flat position ``i * T + t`` of each packed row. A string: why not."""
    data, batch_sizes, hx = args[:3]
    sequence = call[0] if call else None
    if (not isinstance(sequence, nn.utils.rnn.PackedSequence)
            or sequence.batch_sizes is not batch_sizes):
        return "a packed call whose input is not the layer's PackedSequence"
    n, T = int(batch_sizes[0]), len(batch_sizes)
    if sequence.sorted_indices is None and n > 1:
        # Rows in length order as the forward gave them: the samples sorted by the forward
        # itself (sort, pack, put h_n back) look the same, and the autograd check of the
        # first rows misses it where they tie on the length (a Gram 27% off).
        return ("a packed sequence without its samples' order (enforce_sorted=True, or "
                "built without sorted_indices): its rows may be the samples as the forward "
                "sorted them, which the rule cannot tell; pack with enforce_sorted=False")
    rows = torch.arange(n)
    # (T, n): whether step t's batch holds row i. A row's length is its number of steps;
    # the packed rows are the held (t, i) in row-major order, as nonzero gives them.
    held = batch_sizes.unsqueeze(1) > rows
    lengths = held.sum(0)
    order = rows if sequence.sorted_indices is None else sequence.sorted_indices.cpu()
    steps, within = held.nonzero(as_tuple=True)
    device = data.device
    at = (order[within] * T + steps).to(device)
    seq = data.new_zeros(n * T, data.shape[1]).index_copy(0, at, data).unflatten(0, (n, T))
    back = torch.empty_like(order)
    back[order] = rows
    length = torch.empty_like(lengths)
    length[order] = lengths
    if isinstance(hx, (list, tuple)):
        h0, c0 = (s.index_select(1, back.to(device)) for s in hx)
    else:
        h0, c0 = hx.index_select(1, back.to(device)), None
    return seq, h0, c0, length.to(device), order.to(device), at


def _expand(layer, func, args, kwargs, call=()):
    """The fused call as a Python recurrence over the batch (see the module's notes), or
    why not."""
    # Unpacked: (input, hx, params, has_biases, num_layers, dropout, train,
    # bidirectional, batch_first); packed: (data, batch_sizes, hx, params, has_biases,
    # num_layers, dropout, train, bidirectional).
    mode = _MODES[func]
    packed = _packed(args)
    why = _declined(layer, args, kwargs, packed)
    if why is not None:
        return why
    if packed:
        unpacked = _unpacked(args, call)
        if isinstance(unpacked, str):
            return unpacked
        seq, h0, c0, lengths, order, at = unpacked
        params, num_layers, bidirectional = args[3], args[5], args[8]
        T = seq.shape[1]
        # Row i takes step t while t < its length; after, its state is held (its final
        # state, or, running backwards, its initial one until its last step). The
        # shortest length read once (not a device sync per step).
        shortest = int(lengths.min())
        live = [None if t < shortest else (lengths > t).unsqueeze(1) for t in range(T)]
    else:
        x, hx, params, _, num_layers, _, _, bidirectional, batch_first = args
        h0, c0 = hx if mode == "LSTM" else (hx, None)
        seq = x if batch_first else x.transpose(0, 1)
        T = seq.shape[1]
        live = [None] * T
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
            steps = range(T - 1, -1, -1) if d else range(T)
            hs, prev = [None] * T, [None] * T
            # The steps as one unbind, not T selections: each select's backward writes a
            # zero tensor the size of all the steps (T^2 traffic, 4.4 of a 6.7 s diagonal).
            gis = zi.unbind(1)
            probes = [None] * T if probe is None else probe.unbind(1)
            for t in steps:
                prev[t] = h
                h_t, c_t = _step(mode, gis[t], h, c, w_hh, b_hh, probes[t])
                if live[t] is None:
                    h, c = h_t, c_t
                else:
                    # A row past its end: no gradient reaches its step's sites.
                    h = torch.where(live[t], h_t, h)
                    c = None if c is None else torch.where(live[t], c_t, c)
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
    hidden = torch.stack(h_n)
    if packed:
        out = seq.flatten(0, 1).index_select(0, at)
        hidden = hidden.index_select(1, order)
        cell = None if c0 is None else torch.stack(c_n).index_select(1, order)
    else:
        out = seq if batch_first else seq.transpose(0, 1)
        cell = None if c0 is None else torch.stack(c_n)
    if mode == "LSTM":
        return (out, hidden, cell), sites
    return (out, hidden), sites


def _factors(layer, use, deltas, names):
    """Per (layer, direction): for RNN and LSTM one site, whose input is ``x_t`` and
    ``h_{t-1}`` side by side (their weights share the gates' backprop); for GRU two, the
    input projection's (``x_t``) and the hidden probe's (``h_{t-1}``)."""
    gru = use.func is torch.gru
    terms = []
    params = use.args[3 if _packed(use.args) else 2]
    for j, (local, ws) in enumerate(_cells(layer, params)):
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

LSTM = Rule(ops=(torch.lstm,), factors=_factors, expand=_expand, call_inputs=True)
GRU = Rule(ops=(torch.gru,), factors=_factors, expand=_expand, call_inputs=True)
RNN = Rule(ops=(torch.rnn_tanh, torch.rnn_relu), factors=_factors, expand=_expand,
           call_inputs=True)
