"""nn.LSTM, nn.GRU and nn.RNN on their rules, against the plain per-sample autograd loop.

Every configuration a text or time-series classifier uses: batch first or not,
bidirectional, one or two layers, with and without biases, padded token ids masked out of
a mean over time, one output or several, Grams split into chunks by a small memory
budget. ``check_rule`` compares the factors with autograd directly (the engine's own
autograd check would otherwise send a wrong rule's layer to the exact fallback and hide
it); the Gram and features are compared with ``jacobian_loop``, and the layer must still
be on its rule afterwards; packed sequences too, against each sample run alone through
the packed path. Calls the rules decline go to the fallback, still exact, and the route's
reason says what declined them.
"""

import itertools
import warnings

import pytest
import torch
from _reference import jacobian_loop
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from skpathkernel._tangent import tangent_features, tangent_gram
from skpathkernel._tangent._capture import checked_capture
from skpathkernel._tangent._recurrent import _expand
from skpathkernel.rules import check_rule, layer_routes

CELLS = {"lstm": lambda *a, **k: nn.LSTM(*a, **k), "gru": lambda *a, **k: nn.GRU(*a, **k),
         "rnn_tanh": lambda *a, **k: nn.RNN(*a, **k),
         "rnn_relu": lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k)}
V, E, H, S = 9, 3, 4, 6


class _Classifier(nn.Module):
    """Embedding (padding id 0), the recurrent layer, the masked mean over time (or the
    last step), a Linear to ``n_out``; sequence-first layers take the transposed batch."""

    def __init__(self, cell, n_out, *, batch_first=True, mean=True, packed=False, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.rnn = CELLS[cell](E, H, batch_first=batch_first, **kw)
        width = H * (2 if self.rnn.bidirectional else 1)
        self.out = nn.Linear(getattr(self.rnn, "proj_size", 0) or width, n_out)
        self.mean, self.packed = mean, packed

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1)
        x = self.emb(ids)
        if self.packed:
            lengths = mask.sum((1, 2)).clamp_min(1).cpu()
            seq = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out = pad_packed_sequence(self.rnn(seq)[0], batch_first=True, total_length=S)[0]
        else:
            bf = self.rnn.batch_first
            out = self.rnn(x if bf else x.transpose(0, 1))[0]
            out = out if bf else out.transpose(0, 1)
        if not self.mean:
            return self.out(out[:, -1])
        m = mask.to(out.dtype)
        return self.out((out * m).sum(1) / m.sum(1).clamp_min(1))


def _ids(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, S), generator=gen)
    # Padded tails of different lengths (one sequence left whole).
    for i in range(1, n):
        ids[i, S - (i % S):] = 0
    return ids


def _net(cell, n_out=2, **kw):
    torch.manual_seed(0)
    return _Classifier(cell, n_out, **kw).double().eval()


def _routes(net, X):
    return {r.type: (r.route, r.reason) for r in layer_routes(net, X)}


def _close(a, b, rtol=1e-10):
    scale = b.abs().max()
    assert float((a - b).abs().max() / scale) <= rtol, float((a - b).abs().max() / scale)


CONFIGS = list(itertools.product(sorted(CELLS), (True, False), (False, True), (1, 2),
                                 (True, False)))


@pytest.mark.parametrize("cell,batch_first,bidirectional,num_layers,bias", CONFIGS)
def test_factors_match_autograd(cell, batch_first, bidirectional, num_layers, bias):
    net = _net(cell, batch_first=batch_first, bidirectional=bidirectional,
               num_layers=num_layers, bias=bias, mean=batch_first)
    X = _ids(5)
    assert check_rule(net, X, rtol=1e-10) <= 1e-10
    assert _routes(net, X)[type(net.rnn).__name__] == ("rule", "")


def _tight_budget(net, params, X):
    """The smallest budget of the form 2^k that the Gram accepts: chunks of a few rows."""
    budget = 2**12
    while True:
        try:
            tangent_gram(net, params, X, memory_budget=budget)
            return budget
        except ValueError as exc:
            assert "for a single sample" in str(exc)
            budget *= 2


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("cell,kw", [
    ("lstm", dict(batch_first=True)),
    ("lstm", dict(batch_first=False, bidirectional=True, num_layers=2, bias=False)),
    ("gru", dict(batch_first=True, bidirectional=True, num_layers=2)),
    ("gru", dict(batch_first=False, bias=False, mean=False)),
    ("rnn_tanh", dict(batch_first=True, num_layers=2)),
    ("rnn_relu", dict(batch_first=False, bidirectional=True)),
    # Token ids, lengths from the padding, packed with enforce_sorted=False.
    ("lstm", dict(packed=True, bidirectional=True)),
    ("gru", dict(packed=True, num_layers=2)),
])
def test_gram_and_features_in_small_chunks_match_loop(cell, kw, n_out):
    net = _net(cell, n_out, **kw)
    params = {k: v.detach() for k, v in net.named_parameters()}
    X, Y = _ids(7), _ids(4, seed=1)
    JX, JY = jacobian_loop(net, X), jacobian_loop(net, Y)
    budget = _tight_budget(net, params, X)
    _close(tangent_gram(net, params, X, Y, output="full", memory_budget=budget),
           torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram(net, params, X, memory_budget=budget),
           torch.einsum("ncp,mcp->nm", JX, JX) / n_out)
    _close(tangent_features(net, params, X, output="full", memory_budget=budget), JX)
    assert _routes(net, X)[type(net.rnn).__name__] == ("rule", "")


@pytest.mark.parametrize("cell,kw,why", [
    ("lstm", dict(proj_size=2), "proj_size"),
])
def test_declined_calls_fall_back_exactly(cell, kw, why):
    net = _net(cell, **kw)
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _ids(5)
    route, reason = _routes(net, X)[type(net.rnn).__name__]
    # The reason names what declined the call, not only that the rule did.
    assert route == "fallback" and "declines this call" in reason and why in reason, reason
    J = jacobian_loop(net, X)
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


def test_dropout_between_layers_declines_in_training_only():
    net = _net("lstm", num_layers=2, dropout=0.5)
    X = _ids(4)
    assert _routes(net, X)["LSTM"][0] == "rule"  # eval: no dropout
    # In training mode the call draws dropout masks between the layers: not per-sample
    # factors of a fixed function, so the rule declines it, and says so.
    params = {k: v.detach() for k, v in net.named_parameters()}
    call = (torch.randn(4, S, E, dtype=torch.float64), (torch.zeros(2, 4, H).double(),) * 2,
            list(params.values())[1:9], True, 2, 0.5, True, False, True)
    assert net.rnn.__class__ is nn.LSTM
    why = _expand(net.rnn, torch.lstm, call, {})
    assert isinstance(why, str) and "dropout" in why and "training" in why
    call = (*call[:6], False, *call[7:])
    assert isinstance(_expand(net.rnn, torch.lstm, call, {})[1], list)
    # The packed call's own order: (data, batch_sizes, hx, params, has_biases,
    # num_layers, dropout, train, bidirectional).
    seq = pack_padded_sequence(torch.randn(4, S, E).double(), [6, 5, 5, 1], batch_first=True,
                               enforce_sorted=False)
    packed = (seq.data, seq.batch_sizes, call[1], call[2], True, 2, 0.5, True, False)
    why = _expand(net.rnn, torch.lstm, packed, {}, (seq,))
    assert isinstance(why, str) and "dropout" in why
    packed = (*packed[:7], False, False)
    assert isinstance(_expand(net.rnn, torch.lstm, packed, {}, (seq,))[1], list)
    # A packed call that does not come with the layer's PackedSequence has no sample order.
    assert "PackedSequence" in _expand(net.rnn, torch.lstm, packed, {}, ())


class _Packed(nn.Module):
    """Feature vectors padded after their length (the last column, 1 on the steps of the
    sequence, says which), packed, through the recurrent layer, unpacked; the outputs
    and ``h_n`` (and ``c_n``) both read. ``state``: an initial state computed from the
    input, passed in the samples' order (torch reorders it to the call's)."""

    def __init__(self, cell, enforce_sorted, state=False, **kw):
        super().__init__()
        self.rnn = CELLS[cell](E, H, batch_first=True, **kw)
        width = H * (2 if self.rnn.bidirectional else 1)
        self.layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        self.init = nn.Linear(E, self.layers * H) if state else None
        self.out = nn.Linear(width + 2 * H, 2)
        self.enforce_sorted = enforce_sorted

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long().cpu()
        seq = pack_padded_sequence(x[:, :, :E], lengths, batch_first=True,
                                   enforce_sorted=self.enforce_sorted)
        if self.init is None:
            out, state = self.rnn(seq)
        else:
            h0 = torch.tanh(self.init(x[:, 0, :E])).unflatten(1, (self.layers, H))
            h0 = h0.transpose(0, 1).contiguous()
            hx = (h0, torch.sin(h0)) if isinstance(self.rnn, nn.LSTM) else h0
            out, state = self.rnn(seq, hx)
        out = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        h = state[0][-1] if isinstance(state, tuple) else state[-1]
        c = state[1][0] if isinstance(state, tuple) else torch.cos(state[0])
        return self.out(torch.cat([out.sum(1), h, c], 1))


def _padded(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), S, E + 1, generator=gen, dtype=torch.float64)
    valid = (torch.arange(S) < torch.tensor(lengths).unsqueeze(1)).double()
    x[:, :, :E] *= valid.unsqueeze(-1)
    x[:, :, -1] = valid
    return x


PACKED = [dict(), dict(bidirectional=True), dict(num_layers=2),
          dict(bidirectional=True, num_layers=2, bias=False)]


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("kw", PACKED)
@pytest.mark.parametrize("enforce_sorted", [False, True])
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_packed_sequences_on_the_rule_match_loop(cell, enforce_sorted, kw, state):
    # Lengths with ties, the full length and length 1; sorted when torch requires it.
    lengths = [6, 5, 5, 3, 1, 2, 1] if not enforce_sorted else [6, 5, 5, 3, 2, 1, 1]
    torch.manual_seed(0)
    net = _Packed(cell, enforce_sorted, state, **kw).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _padded(lengths)
    # The reference runs each sample alone through the packed path (a batch of one).
    J = jacobian_loop(net, X)
    route, reason = _routes(net, X)[type(net.rnn).__name__]
    if enforce_sorted:
        # Without the samples' order in the sequence the rule declines (see below).
        assert route == "fallback" and "enforce_sorted=False" in reason, reason
    else:
        assert (route, reason) == ("rule", "")
    assert check_rule(net, X, rtol=1e-10) <= 1e-10
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(tangent_features(net, params, X, output="full"), J)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_packed_batch_of_one_matches_loop(cell):
    torch.manual_seed(0)
    net = _Packed(cell, False, True, bidirectional=True, num_layers=2).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _padded([3])
    J = jacobian_loop(net, X)
    assert _routes(net, X)[type(net.rnn).__name__] == ("rule", "")
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(tangent_features(net, params, X, output="full"), J)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_torchs_refusal_of_a_batch_out_of_order_is_checked_in_order_silently(cell):
    # pack_padded_sequence(enforce_sorted=True) raises on the check's cycle (in no sorted
    # order) and would on its last pair: the check runs on x0, x1 in X's order, without a
    # warning (the network cannot reorder a batch it requires sorted).
    torch.manual_seed(0)
    net = _Packed(cell, True).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _padded([6, 5, 5, 3, 2, 1, 1])
    J = jacobian_loop(net, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = checked_capture(net, params, X, [0, 1], memory_budget=2**24)[0]
        K = tangent_gram(net, params, X, output="full")
    assert torch.equal(rows, X[:2])
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))


@pytest.mark.parametrize("budget", [2**24, 20 * 2**10])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_one_query_against_a_batch_torch_packs_sorted_matches_loop(cell, budget):
    # K(x, Y) of one query shorter than Y's first sequence (step_kernel(x, X_train) with
    # torch's default enforce_sorted=True): the check's rows x, y0, yl and its retry x, y0
    # in their order are batches the Gram never forms, refused as out of order, and the
    # call raised torch's refusal (sessions s54-s55); the Gram packs x alone and Y's
    # sorted blocks. The 20 KiB budget takes the cycle's pairs from the start.
    torch.manual_seed(0)
    net = _Packed(cell, True).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    Y, x = _padded([6, 5, 5, 3, 2, 1, 1]), _padded([2], seed=1)
    J = jacobian_loop(net, torch.cat([x, Y]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = tangent_gram(net, params, x, Y, output="full", memory_budget=budget)
    _close(K, torch.einsum("ncp,mdp->ncmd", J[:1], J[1:]))


class _SortedByTheForward(nn.Module):
    """The idiom from before ``enforce_sorted=False``: the forward sorts the batch by
    length, packs it sorted, and puts ``h_n`` back in the samples' order. The packed
    call's rows are then the samples reordered, which its sequence does not say."""

    def __init__(self, cell):
        super().__init__()
        self.rnn = CELLS[cell](E, H, batch_first=True)
        self.out = nn.Linear(H, 2)

    enforce_sorted = True

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long()
        lengths, order = torch.sort(lengths, descending=True, stable=True)
        seq = pack_padded_sequence(x[order, :, :E], lengths.cpu(), batch_first=True,
                                   enforce_sorted=self.enforce_sorted)
        state = self.rnn(seq)[1]
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.out((state[0] if isinstance(state, tuple) else state)[-1][back])


class _SortedThenPackedUnsorted(_SortedByTheForward):
    """:class:`_SortedByTheForward` packed with ``enforce_sorted=False``: the packed
    sequence's own order is then the identity (its rows came sorted), so it says nothing
    of the forward's sort; only the autograd check of the rows can see it."""

    enforce_sorted = False


@pytest.mark.parametrize("make, seed, why", [
    (_SortedByTheForward, 0, "enforce_sorted=False"),
    # The autograd check of x0, x1 saw no reordering where they came sorted (before
    # session s54): the rule took the sorted rows for the samples, the Gram 23-27% off.
    (_SortedThenPackedUnsorted, 1, "reorders the samples"),
])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_packed_sequence_without_its_samples_order_falls_back_exactly(cell, make, seed,
                                                                        why):
    # The first two samples already sorted: a Gram off by 27% where the rule took the
    # rows the forward sorted for the samples.
    torch.manual_seed(seed)
    net = make(cell).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _padded([6, 5, 1, 3, 2, 6, 4])
    J = jacobian_loop(net, X)
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    route, reason = _routes(net, X)[type(net.rnn).__name__]
    assert route == "fallback" and why in reason, reason
    # A batch of one has no order to lose.
    assert _routes(net, X[:1])[type(net.rnn).__name__] == ("rule", "")


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_packed_sequences_sorted_by_torch_keep_their_rule(cell):
    # No false alarm: torch's own sort of enforce_sorted=False, whatever order the first
    # samples come in (ascending here, the reverse of the packed order).
    torch.manual_seed(0)
    net = _Packed(cell, False).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = _padded([1, 3, 6, 2, 5, 4])
    J = jacobian_loop(net, X)
    assert _routes(net, X)[type(net.rnn).__name__] == ("rule", "")
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class _Seq2Seq(nn.Module):
    """An encoder whose initial state is computed from the input, its final ``(h_n, c_n)``
    (both directions, both layers, the cell state too) read into the output, and a decoder
    fed back its own prediction one step at a time (the same module called per step)."""

    def __init__(self, cell, batch_first):
        super().__init__()
        self.enc = CELLS[cell](E, H, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.dec = CELLS[cell](E, H, num_layers=2, batch_first=batch_first)
        self.state = nn.Linear(E, 4 * H)
        self.proj = nn.Linear(H, E)
        self.head = nn.Linear(8 * H + E, 2)

    def forward(self, x):
        bf = self.enc.batch_first
        h0 = torch.tanh(self.state(x[:, 0])).unflatten(1, (4, H)).transpose(0, 1)
        hx = (h0, torch.sin(h0)) if isinstance(self.enc, nn.LSTM) else h0.contiguous()
        _, state = self.enc(x if bf else x.transpose(0, 1), hx)
        parts = state if isinstance(state, tuple) else (state,)
        read = torch.cat([s.transpose(0, 1).flatten(1) for s in parts], 1)
        if len(parts) == 1:
            read = torch.cat([read, read], 1)
        # The decoder starts from the encoder's forward-direction states of both layers.
        hx = tuple(s[0::2] for s in parts) if len(parts) == 2 else parts[0][0::2]
        y = x[:, -1:] if bf else x[:, -1:].transpose(0, 1)
        for _ in range(3):
            o, hx = self.dec(y, hx)
            y = torch.tanh(self.proj(o if bf else o.transpose(0, 1)))
            y = y if bf else y.transpose(0, 1)
        return self.head(torch.cat([read, y.reshape(x.shape[0], E)], 1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_initial_states_final_states_and_decoder_loop_match_loop(cell, batch_first):
    # Initial states computed from the input, h_n and c_n read (the cell state's
    # gradient), a decoder called once per step: against the plain per-sample loop.
    torch.manual_seed(0)
    net = _Seq2Seq(cell, batch_first).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = torch.randn(5, S, E, dtype=torch.float64)
    J = jacobian_loop(net, X)
    assert check_rule(net, X, rtol=1e-10) <= 1e-10
    _close(tangent_gram(net, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    routes = {r.name: r.route for r in layer_routes(net, X)}
    assert routes["enc"] == routes["dec"] == "rule", routes
