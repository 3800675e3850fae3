"""The built-in per-layer rules against an independent per-sample autograd loop (float64).

Every rule (Conv1d/2d/3d, ConvTranspose1d/2d/3d, Linear on N-D inputs, Embedding,
LayerNorm, RMSNorm, GroupNorm, BatchNorm in eval mode, MultiheadAttention, PReLU, and
TransformerEncoderLayer or pre-norm RMSNorm blocks built from them) is
checked for the Gram (trace, full, one output, cross, symmetric, at two parameter points),
its diagonal, the features, the preconditioned (Adam / RMSprop) Gram of the path kernel,
and the seeded projection, to 1e-10 relative; both exact contractions of a term with
positions (gradient blocks and position pairs) are forced in turn.
"""

import copy
import math
import warnings

import pytest
import torch
from _reference import by_content, jacobian_loop
from torch import nn
from torch.nn import functional as F

from skpathkernel._tangent import (
    _generic,
    _gram,
    _layers,
    _projection,
    capture,
    hidden_reads,
    project_tangent_features,
    tangent_features,
    tangent_gram,
    tangent_gram_diag,
)
from skpathkernel.rules import Term, check_rule, layer_routes

RTOL = 1e-10


def _close(a, b, rtol=RTOL):
    a, b = a.to(torch.float64), b.to(torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = b.abs().max().clamp_min(1e-300)
    assert float((a - b).abs().max() / scale) <= rtol, float((a - b).abs().max() / scale)


def _loop(module, params, X):
    """(n, C, P) by the autograd loop on a copy of ``module`` holding ``params``."""
    ref = copy.deepcopy(module)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
    return jacobian_loop(ref, X)


def _case_loops(case, n_out, module, params, X, Y):
    """The loop's ``(J(X), J(Y))`` of ``_make(case, n_out)``'s network and inputs, computed
    once per process (the routes, outputs and functions of a case are several tests)."""
    return (by_content(_loop, module, params, X, key=case),
            by_content(_loop, module, params, Y, key=case))


# ------------------------------------------------------------------------- networks
class _Head(nn.Module):
    """``body`` then flatten and a Linear to ``n_out`` outputs (tanh between)."""

    def __init__(self, body, width, n_out):
        super().__init__()
        self.body, self.head = body, nn.Linear(width, n_out)

    def forward(self, x):
        h = self.body(x)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(torch.tanh(h).reshape(h.shape[0], -1))


class _SelfAttention(nn.Module):
    def __init__(self, mha, attn_mask=None, **kw):
        super().__init__()
        self.mha, self.kw = mha, kw
        # A buffer, so that ``.to(device)`` moves the mask with the weights.
        self.register_buffer("attn_mask", attn_mask)

    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.attn_mask, **self.kw)[0]


class _CrossAttention(nn.Module):
    """Queries from the first 3 positions, keys / values from all (other lengths)."""

    def __init__(self, mha, need_weights=True):
        super().__init__()
        self.mha, self.need_weights = mha, need_weights
        self.proj = nn.Linear(4, mha.kdim)

    def forward(self, x):
        kv = self.proj(x)
        return self.mha(x[:, :3], kv, kv, need_weights=self.need_weights)[0]


class _Tokens(nn.Module):
    """Token and position embeddings, an encoder, mean pooling, a head."""

    def __init__(self, n_out, vocab=7, d=8, layers=2, norm_first=False, S=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(S, d)
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=12, dropout=0.0,
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_out)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.encoder(self.tok(ids) + self.pos(positions))
        return self.head(h.mean(1))


class _RMSBlock(nn.Module):
    """A pre-norm (Llama-style) block: x + attn(rms(x)), then x + mlp(rms(x))."""

    def __init__(self, d, heads=2, ff=12, eps=None, causal=False):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)
        self.causal = causal

    def forward(self, x):
        h = self.norm1(x)
        S = x.shape[1]
        mask = (torch.triu(torch.ones(S, S, dtype=torch.bool, device=x.device), 1)
                if self.causal else None)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(F.silu(self.up(self.norm2(x))))


class _RMSTokens(nn.Module):
    """Token ids through an embedding, pre-norm RMSNorm blocks, a final RMSNorm, a head."""

    def __init__(self, n_out, vocab=7, d=8, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(_RMSBlock(d, eps=1e-6 if i else None, causal=True)
                                      for i in range(layers)))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, n_out)

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.tok(ids))).mean(1))


class _RMSVectors(nn.Module):
    """2-D ``(n, F)`` inputs, lifted to 3 tokens of 4 features, one pre-norm block."""

    def __init__(self, n_out, F_in=5, S=3, d=4):
        super().__init__()
        self.S, self.d = S, d
        self.lift = nn.Linear(F_in, S * d)
        self.block = _RMSBlock(d, eps=1e-5)
        self.norm = nn.RMSNorm(S * d, elementwise_affine=False)
        self.head = nn.Linear(S * d, n_out)

    def forward(self, x):
        h = self.block(self.lift(x).unflatten(1, (self.S, self.d)))
        return self.head(self.norm(h.flatten(1)))


class _Recurrent(nn.Module):
    """A recurrent layer as a user calls it: token ids through an embedding (padding id 0,
    the padded steps masked out of a mean over time) or float sequences; sequence-first
    layers get the transposed batch; ``pool`` the last output step, the last layer's
    final hidden state, or the masked mean over time; ``state``: an initial hidden (and
    cell) state computed from the input by a Linear, differentiated through."""

    def __init__(self, rnn, pool="last", vocab=None, state=False):
        super().__init__()
        self.rnn, self.pool = rnn, pool
        self.emb = None if vocab is None else nn.Embedding(vocab, rnn.input_size, padding_idx=0)
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        self.state = nn.Linear(rnn.input_size, layers * rnn.hidden_size) if state else None

    def forward(self, x):
        mask = None
        if self.emb is not None:
            mask = (x != 0).unsqueeze(-1)
            x = self.emb(x)
        hx = None
        if self.state is not None:
            h0 = torch.tanh(self.state(x.mean(1))).unflatten(1, (-1, self.rnn.hidden_size))
            h0 = h0.transpose(0, 1).contiguous()
            hx = (h0, 0.5 * h0) if isinstance(self.rnn, nn.LSTM) else h0
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        out, h = self.rnn(seq, hx)
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        if self.pool == "hidden":
            return (h[0] if isinstance(h, tuple) else h)[-1]
        if self.pool == "mean":
            mask = torch.ones_like(out[..., :1]) if mask is None else mask.to(out.dtype)
            return (out * mask).sum(1) / mask.sum(1).clamp_min(1)
        return out[:, -1]


def _bn_eval(bn):
    """BatchNorm with random running statistics, in eval mode."""
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return bn.eval()


def _image(shape):
    return lambda n, g: torch.randn(n, *shape, generator=g, dtype=torch.float64)


def _ids(S, vocab=7):
    return lambda n, g: torch.randint(0, vocab, (n, S), generator=g)


# name -> (factory(n_out) -> module, input maker)
CASES = {
    "conv2d": (lambda c: _Head(nn.Conv2d(2, 4, 3, padding=1), 4 * 25, c), _image((2, 5, 5))),
    "conv2d_stride_dilation_nobias": (
        lambda c: _Head(nn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2, bias=False),
                        4 * 9, c), _image((2, 5, 6))),
    "conv2d_groups": (lambda c: _Head(nn.Conv2d(4, 6, (2, 3), stride=(1, 2), groups=2),
                                      6 * 4 * 2, c), _image((4, 5, 5))),
    "conv2d_same_even_kernel": (lambda c: _Head(nn.Conv2d(2, 3, 4, padding="same"), 3 * 25, c),
                                _image((2, 5, 5))),
    "conv2d_reflect": (lambda c: _Head(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
                                       3 * 16, c), _image((2, 4, 4))),
    "conv1d": (lambda c: _Head(nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=1, groups=1),
                               4 * 4, c), _image((3, 7))),
    "conv1d_groups_dilation": (lambda c: _Head(nn.Conv1d(4, 4, 2, dilation=2, groups=4),
                                               4 * 5, c), _image((4, 7))),
    "conv3d_groups_dilation": (
        lambda c: _Head(nn.Conv3d(4, 2, (2, 3, 2), stride=(1, 2, 1), padding=1,
                                  dilation=(2, 1, 1), groups=2), 2 * 3 * 2 * 4, c),
        _image((4, 3, 4, 3))),
    # A small decoder: stride 2 with output_padding, then a dilated transposed convolution
    # whose output_padding is at least its stride (allowed below the dilation), no bias.
    "conv_transpose2d_decoder": (
        lambda c: _Head(nn.Sequential(
            nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(4, 2, (2, 3), stride=(1, 2), padding=(0, 1),
                               output_padding=(1, 0), dilation=(2, 1), bias=False)),
            2 * 7 * 11, c), _image((3, 2, 3))),
    "conv_transpose2d_groups": (
        lambda c: _Head(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1,
                                           groups=2), 6 * 6 * 6, c), _image((4, 3, 3))),
    "conv_transpose2d_output_size": (lambda c: _Head(_OutputSize(), 2 * 4 * 6, c),
                                     _image((3, 2, 3))),
    "conv_transpose1d_depthwise_dilation": (
        lambda c: _Head(nn.ConvTranspose1d(4, 4, 3, stride=3, padding=2, output_padding=2,
                                           dilation=2, groups=4), 4 * 12, c), _image((4, 4))),
    "conv_transpose3d": (
        lambda c: _Head(nn.ConvTranspose3d(2, 2, 2, stride=2, padding=1, output_padding=1),
                        2 * 3 * 3 * 5, c), _image((2, 2, 2, 3))),
    "linear_sequence": (lambda c: _Head(nn.Linear(3, 4), 5 * 4, c), _image((5, 3))),
    "linear_two_leading_dims": (lambda c: _Head(nn.Linear(3, 2), 2 * 3 * 2, c),
                                _image((2, 3, 3))),
    "embedding": (lambda c: _Head(nn.Embedding(6, 3, padding_idx=2), 4 * 3, c), _ids(4, 6)),
    # A table far wider than the ids read (an index term: no one-hot factor); ids repeat
    # within and across samples, and the padding row is among them.
    "embedding_wide_table": (lambda c: _Head(nn.Embedding(3000, 3, padding_idx=4), 4 * 3, c),
                             _ids(4, 9)),
    "embedding_one_id": (lambda c: _Head(nn.Embedding(500, 3), 3, c),
                         lambda n, g: torch.randint(0, 5, (n,), generator=g)),
    "layer_norm": (lambda c: _Head(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), 5 * 4, c),
                   _image((5, 3))),
    "layer_norm_2d_nobias": (lambda c: _Head(nn.LayerNorm((3, 4), bias=False), 12, c),
                             _image((3, 4))),
    "rms_norm": (lambda c: _Head(nn.Sequential(nn.Linear(3, 4), nn.RMSNorm(4)), 5 * 4, c),
                 _image((5, 3))),
    "rms_norm_vectors_eps": (lambda c: _Head(nn.Sequential(nn.Linear(3, 4),
                                                           nn.RMSNorm(4, eps=1e-2)), 4, c),
                             _image((3,))),
    "rms_norm_2d_default_eps": (lambda c: _Head(nn.RMSNorm((3, 4)), 12, c), _image((3, 4))),
    "rms_norm_no_affine": (lambda c: _Head(nn.Sequential(
        nn.Linear(3, 4), nn.RMSNorm(4, elementwise_affine=False)), 5 * 4, c), _image((5, 3))),
    "rms_transformer": (lambda c: _RMSTokens(c), _ids(5)),
    "rms_transformer_vectors": (lambda c: _RMSVectors(c), _image((5,))),
    "group_norm": (lambda c: _Head(nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)),
                                   4 * 9, c), _image((2, 5, 5))),
    "batch_norm1d": (lambda c: _Head(nn.Sequential(nn.Linear(3, 4), _bn_eval(nn.BatchNorm1d(4))),
                                     4, c), _image((3,))),
    "batch_norm1d_sequence": (lambda c: _Head(_bn_eval(nn.BatchNorm1d(3)), 15, c),
                              _image((3, 5))),
    "batch_norm2d": (lambda c: _Head(nn.Sequential(nn.Conv2d(2, 3, 3),
                                                   _bn_eval(nn.BatchNorm2d(3))), 27, c),
                     _image((2, 5, 5))),
    "mha_self": (lambda c: _Head(_SelfAttention(nn.MultiheadAttention(4, 2, batch_first=True)),
                                 5 * 4, c), _image((5, 4))),
    "mha_seq_first_masked": (
        lambda c: _Head(nn.Sequential(_Transpose(), _SelfAttention(
            nn.MultiheadAttention(4, 2), attn_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool),
                                                              1)), _Transpose()), 5 * 4, c),
        _image((5, 4))),
    "mha_cross_kdim": (lambda c: _Head(_CrossAttention(
        nn.MultiheadAttention(4, 2, kdim=3, vdim=3, batch_first=True)), 3 * 4, c),
        _image((5, 4))),
    # Without attention weights or masks the rule runs the attention core itself.
    "mha_self_no_weights": (lambda c: _Head(_SelfAttention(
        nn.MultiheadAttention(4, 2, batch_first=True), need_weights=False), 5 * 4, c),
        _image((5, 4))),
    "mha_seq_first_no_weights": (
        lambda c: _Head(nn.Sequential(_Transpose(), _SelfAttention(
            nn.MultiheadAttention(4, 2), need_weights=False), _Transpose()), 5 * 4, c),
        _image((5, 4))),
    "mha_cross_kdim_no_weights": (lambda c: _Head(_CrossAttention(
        nn.MultiheadAttention(4, 2, kdim=3, vdim=3, batch_first=True), need_weights=False),
        3 * 4, c), _image((5, 4))),
    "prelu_channels": (lambda c: _Head(nn.Sequential(nn.Conv1d(3, 4, 2), nn.PReLU(4)), 4 * 6, c),
                       _image((3, 7))),
    "prelu_sequence": (lambda c: _Head(nn.Sequential(nn.Linear(3, 4), nn.PReLU()), 5 * 4, c),
                       _image((5, 3))),
    "transformer": (lambda c: _Tokens(c), _ids(5)),
    "lstm": (lambda c: _Head(_Recurrent(nn.LSTM(3, 4, batch_first=True)), 4, c),
             _image((5, 3))),
    "lstm_seq_first_bidirectional_two_layers_nobias": (
        lambda c: _Head(_Recurrent(nn.LSTM(3, 4, num_layers=2, bidirectional=True, bias=False),
                                   "mean"), 8, c), _image((5, 3))),
    "lstm_padded_ids_state": (
        lambda c: _Head(_Recurrent(nn.LSTM(3, 4, num_layers=2, batch_first=True), "mean",
                                   vocab=7, state=True), 4, c), _ids(6)),
    "gru_padded_ids_bidirectional_two_layers": (
        lambda c: _Head(_Recurrent(nn.GRU(3, 4, num_layers=2, bidirectional=True,
                                          batch_first=True), "mean", vocab=7), 8, c), _ids(6)),
    "gru_seq_first_nobias_hidden": (
        lambda c: _Head(_Recurrent(nn.GRU(3, 4, bias=False), "hidden", state=True), 4, c),
        _image((5, 3))),
    "rnn_tanh_two_layers": (
        lambda c: _Head(_Recurrent(nn.RNN(3, 4, num_layers=2, batch_first=True), "hidden"),
                        4, c), _image((5, 3))),
    "rnn_relu_seq_first_bidirectional": (
        lambda c: _Head(_Recurrent(nn.RNN(3, 4, nonlinearity="relu", bidirectional=True),
                                   "mean", state=True), 8, c), _image((5, 3))),
    "transformer_norm_first": (lambda c: _Tokens(c, layers=1, norm_first=True), _ids(5)),
}


class _Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1)


class _OutputSize(nn.Module):
    """A transposed convolution told its output size: the call's output_padding is computed
    by its forward (here 1 along the height, 0 along the width)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)

    def forward(self, x):
        return self.up(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])


def _make(case, n_out, seed=0):
    torch.manual_seed(seed)
    factory, inputs = CASES[case]
    module = factory(n_out).double().eval()
    gen = torch.Generator().manual_seed(seed)
    params = {k: v.detach() + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
              for k, v in module.named_parameters()}
    return module, params, inputs(7, gen), inputs(4, gen)


def _forced(monkeypatch, route):
    """Force every term with positions through one of the two exact contractions."""
    if route is None:
        return
    real, real_diag = _gram.gram_route, _gram._diag_route

    # With a preconditioner only the gradient blocks are exact: left alone.
    def gram_route(term, n_x, n_y, mode, weighted, *args):
        chosen = real(term, n_x, n_y, mode, weighted, *args)
        return route if chosen in ("pair", "dense") and not weighted else chosen

    def diag_route(term, mode, weighted):
        chosen = real_diag(term, mode, weighted)
        return route if chosen in ("pair", "dense") and not weighted else chosen

    monkeypatch.setattr(_gram, "gram_route", gram_route)
    monkeypatch.setattr(_gram, "_diag_route", diag_route)


# ---------------------------------------------------------------- structured end to end
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_parameter_is_on_a_rule(case):
    module, params, X, _ = _make(case, 2)
    cap = capture(module, params, X, [0, 1], memory_budget=2**24)
    assert cap.fallback == ()
    assert not cap.exclude and not cap.declined


CONV_NEW = sorted(c for c in CASES if c.startswith(("conv_transpose", "conv3d")))


@pytest.mark.parametrize("case", CONV_NEW)
def test_transposed_and_3d_convolutions_are_reported_on_their_rules(case):
    # They went to the generic fallback (exact, slower): layer_routes says so per layer.
    module, params, X, _ = _make(case, 2)
    routes = [r for r in layer_routes(module, X) if r.type.startswith(("ConvTranspose",
                                                                        "Conv3d"))]
    assert routes and {r.route for r in routes} == {"rule"}, routes


ATTENTION = sorted(c for c in CASES if c.startswith(("mha", "transformer", "rms_transformer")))


@pytest.mark.parametrize("case", ATTENTION)
def test_attention_core_is_run_directly_where_torch_would(case, monkeypatch):
    """The attention rule computes the core itself (no identity projections) on the
    calls without weights, masks or a causal hint, and hands the others to torch's
    own function: the Gram tests below cover both, this checks that each ran."""
    chosen = []
    real = _layers._plain_attention
    monkeypatch.setattr(_layers, "_plain_attention",
                        lambda bound: chosen.append(real(bound)) or chosen[-1])
    module, params, X, _ = _make(case, 2)
    capture(module, params, X, [0, 1], memory_budget=2**24)
    direct = ("no_weights" in case or case.startswith("transformer")
              or case == "rms_transformer_vectors")  # the tokens' blocks are causal
    assert chosen and set(chosen) == {direct}


def test_attention_with_dropout_in_training_keeps_torchs_function():
    # Dropout on the attention weights is drawn inside torch's function in training mode;
    # the direct core has none, so only an eval-mode (or p = 0) call may take it.
    call = {"need_weights": False, "dropout_p": 0.5}
    assert not _layers._plain_attention({**call, "training": True})
    assert _layers._plain_attention({**call, "training": False})
    assert _layers._plain_attention({**call, "dropout_p": 0.0, "training": True})


# ------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("route", [None, "pair", "dense"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gram_and_diagonal_match_loop(case, route, monkeypatch):
    _forced(monkeypatch, route)
    module, params, X, Y = _make(case, 3)
    JX, JY = _case_loops(case, 3, module, params, X, Y)
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    _close(tangent_gram(module, params, X, Y, output="full"), full)
    _close(tangent_gram(module, params, X, Y), torch.einsum("ncmc->nm", full) / 3)
    _close(tangent_gram(module, params, X, Y, output=1), full[:, 1, :, 1])
    K = tangent_gram(module, params, X)
    _close(K, torch.einsum("ncp,mcp->nm", JX, JX) / 3)
    assert torch.equal(K, K.T)
    _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", JX, JX) / 3)
    _close(tangent_gram_diag(module, params, X, output="full"),
           torch.einsum("ncp,ndp->ncd", JX, JX))


@pytest.mark.parametrize("route", [None, "pair", "dense"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_preconditioned_and_cross_parameter_grams_match_loop(case, route, monkeypatch):
    # The path kernel's step Grams J D J^T with Adam / RMSprop's diagonal D, and the
    # decomposition's J(X; theta) J(Y; theta')^T.
    _forced(monkeypatch, route)
    module, params, X, Y = _make(case, 2)
    JX, JY = _case_loops(case, 2, module, params, X, Y)
    gen = torch.Generator().manual_seed(1)
    D = 1.0 / (torch.rand(JX.shape[2], generator=gen, dtype=torch.float64) ** 2 + 1e-8).sqrt()
    full = torch.einsum("ncp,p,mdp->ncmd", JX, D, JY)
    _close(tangent_gram(module, params, X, Y, output="full", diag_weight=D), full)
    _close(tangent_gram(module, params, X, diag_weight=D),
           torch.einsum("ncp,p,mcp->nm", JX, D, JX) / 2)
    _close(tangent_gram_diag(module, params, X, output="full", diag_weight=D),
           torch.einsum("ncp,p,ndp->ncd", JX, D, JX))
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
             for k, v in params.items()}
    JYo = by_content(_loop, module, other, Y, key=case)
    _close(tangent_gram(module, params, X, Y, output="full", params_y=other),
           torch.einsum("ncp,mdp->ncmd", JX, JYo))


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_backprops_match_loop(case, batched_backprops):
    # The GPU's one batched backward pass over the outputs (is_grads_batched), run on the
    # CPU: the same Gram, diagonal and features as the loop of per-sample autograd.
    module, params, X, Y = _make(case, 3)
    JX, JY = _case_loops(case, 3, module, params, X, Y)
    _close(tangent_gram(module, params, X, Y, output="full"),
           torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", JX, JX) / 3)
    _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", JX, JX) / 3)
    _close(tangent_features(module, params, X, output="full"), JX)
    # Every pass was batched (none fell back to the loop), and the autograd check on the
    # probe's rows found the factors right: no layer went to the generic fallback.
    assert batched_backprops and all(g is not None for g in batched_backprops)
    probe = _gram._prepare(module, params, X, "full", 2**24)[3]
    assert probe.fallback == () and probe.exclude == frozenset()


@pytest.mark.parametrize("case", sorted(CASES))
def test_features_match_loop(case):
    module, params, X, _ = _make(case, 3)
    J = by_content(_loop, module, params, X, key=case)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_features(module, params, X), J.reshape(len(J), -1) / math.sqrt(3))
    _close(tangent_features(module, params, X, output=2), J[:, 2])


def _projection_reference(module, params, X, J, k, seed, output):
    """``J R^T`` with the documented directions: ``u (x) v`` for a factored parameter
    (``u`` over (outputs, p), block-diagonal over groups, ``v`` over q / groups), dense
    Gaussian column chunks for the others."""
    n, C, _ = J.shape
    width = 1 if output == "full" else C
    cap = capture(module, params, X[:1], list(range(C)), memory_budget=2**24)
    kinds = {name: (t, a) for t in cap.terms for name, a in t.inputs}
    z = torch.zeros(n, C // width, k, dtype=J.dtype)
    start = 0
    for index, (name, p) in enumerate(params.items()):
        Jp = J[:, :, start : start + p.numel()]
        start += p.numel()
        term, a = kinds[name]
        rows = Jp.reshape(n, C // width, width * p.numel())
        if a is None:
            cols = width * term.delta.shape[3]
            G = torch.cat([_projection._gaussian(_projection._generator(seed, index, c),
                                                 (k, min(_projection._DENSE_CHUNK, cols - s)),
                                                 J)
                           for c, s in enumerate(range(0, cols, _projection._DENSE_CHUNK))],
                          dim=1)
            z += rows @ G.T
            continue
        gen = _projection._generator(seed, index)
        q_dim, pdim = a.shape[2], term.delta.shape[3]
        groups = 1 if term.transposed else term.groups
        U = _projection._gaussian(gen, (k, width * pdim), J)
        V = _projection._gaussian(gen, (k, q_dim // groups), J)
        Ug = U.reshape(k, width, groups, pdim // groups)
        if term.transposed:  # entries (q, p)
            R = torch.einsum("kwi,kl->kwli", Ug[:, :, 0], V)
        else:  # entries (g, p / g, q / g)
            R = torch.einsum("kwgi,kl->kwgil", Ug, V)
        z += rows @ R.reshape(k, -1).T
    z /= math.sqrt(k * (C if output == "trace" else 1))
    return z if output == "full" else z[:, 0]


@pytest.mark.parametrize("output", ["trace", "full", 0])
@pytest.mark.parametrize("case", sorted(CASES))
def test_projection_matches_its_definition(case, output):
    module, params, X, _ = _make(case, 2)
    J = by_content(_loop, module, params, X, key=case)
    if isinstance(output, int):
        J = J[:, output : output + 1]
    got = project_tangent_features(module, params, X, 16, random_state=5, output=output)
    _close(got, _projection_reference(module, params, X, J, 16, 5, output))


@pytest.mark.parametrize("case", ["conv2d_groups", "transformer", "embedding"])
def test_projection_estimates_the_gram(case):
    module, params, X, _ = _make(case, 2)
    K = tangent_gram(module, params, X)
    errors = []
    for k in (16, 4096):
        z = project_tangent_features(module, params, X, k, random_state=0)
        errors.append(float((z @ z.T - K).norm() / K.norm()))
    assert errors[1] < 0.1 and errors[1] < errors[0] / 4


# ------------------------------------------------------------- inputs, blocks, budget
@pytest.mark.parametrize("case", ["transformer", "conv2d_groups", "mha_cross_kdim"])
def test_small_budgets_split_rows_and_agree(case, monkeypatch):
    module, params, X, Y = _make(case, 2)
    sizes = []
    real = _gram._Blocks.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        sizes.append((len(self.slices), self.chunk))

    monkeypatch.setattr(_gram._Blocks, "__init__", spy)
    JX, JY = _loop(module, params, X), _loop(module, params, Y)
    # The smallest budget of the form 2^k that a Gram accepts: blocks of one or two rows.
    budget = 2**12
    while True:
        try:
            tangent_gram(module, params, X, Y, memory_budget=budget)
            break
        except ValueError as exc:
            assert "for a single sample" in str(exc)
            budget *= 2
    _close(tangent_gram(module, params, X, Y, output="full", memory_budget=budget),
           torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram(module, params, X, memory_budget=budget),
           torch.einsum("ncp,mcp->nm", JX, JX) / 2)
    _close(tangent_gram_diag(module, params, X, memory_budget=budget),
           torch.einsum("ncp,ncp->n", JX, JX) / 2)
    _close(tangent_features(module, params, X, output="full", memory_budget=budget), JX)
    z = project_tangent_features(module, params, X, 8, random_state=1, memory_budget=budget)
    _close(z, project_tangent_features(module, params, X, 8, random_state=1))
    assert max(n for n, _ in sizes) > 1  # the rows really were split


def test_token_ids_through_every_entry_point():
    module, params, X, _ = _make("transformer", 2)
    assert X.dtype == torch.int64
    assert hidden_reads(module, [params], [X]) == frozenset()
    K = tangent_gram(module, params, X)
    assert K.dtype == torch.float64
    with pytest.raises(ValueError, match="Y must be a torch.int64 tensor of shape"):
        tangent_gram(module, params, X, X.double())
    with pytest.raises(ValueError, match=r"shape \(n, 5\)"):
        tangent_gram(module, params, X, X[:, :4])


class _SparseTokens(nn.Module):
    """``sparse=True`` lookups, on their rule (an Embedding) or the fallback (a bag)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3, sparse=True, padding_idx=0)
        self.bag = nn.EmbeddingBag(7, 3, mode="sum", sparse=True)
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids).mean(1) + self.bag(ids)))


def _sparse_loop(module, X):
    """(n, C, P) by the autograd loop, the sparse gradients made dense."""
    params = list(module.parameters())
    rows = []
    for x in X:
        out = module(x[None]).reshape(-1)
        rows.append(torch.stack([torch.cat([g.to_dense().reshape(-1) for g in torch.autograd.grad(
            out[c], params, retain_graph=True)]) for c in range(out.shape[0])]))
    return torch.stack(rows)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_sparse_embedding_gradients_are_read_densely():
    # autograd hands a sparse=True lookup's gradient as a sparse tensor: the rules' own
    # autograd check reshaped it (RuntimeError), and so did the fallback's loop.
    torch.manual_seed(0)
    module = _SparseTokens().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    g = torch.Generator().manual_seed(0)
    X, Y = _ids(4)(4, g), _ids(4)(3, g)
    X[0, 0] = 0  # the padding row is read
    J, JY = _sparse_loop(module, X), _sparse_loop(module, Y)
    assert [r.route for r in layer_routes(module, X)] == ["rule", "fallback", "rule"]
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, Y, output="full"), torch.einsum("ncp,mdp->ncmd", J, JY))
    _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", J, J) / 2)


class _Int32Lookups(nn.Module):
    """Token and position lookups by int32 ids, which F.embedding takes."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(7, 3, padding_idx=1), nn.Embedding(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], dtype=torch.int32).expand(len(ids), -1)
        h = self.emb(ids.to(torch.int32)) + self.pos(positions)
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_rule_takes_int32_ids(dtype):
    # The rule's one-hot factor (F.one_hot) took int64 ids only: a RuntimeError.
    torch.manual_seed(0)
    module = _Int32Lookups().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    g = torch.Generator().manual_seed(0)
    X, Y = (_ids(4)(n, g).to(dtype) for n in (4, 3))
    X[0, 0] = 1  # the padding row is read
    J, JY = jacobian_loop(module, X), jacobian_loop(module, Y)
    assert [r.route for r in layer_routes(module, X)] == ["rule"] * 3
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, Y, output="full"), torch.einsum("ncp,mdp->ncmd", J, JY))


class _TokenMeans(nn.Module):
    """Embedding, a Linear per token, mean pooling, a head; ``tied``: a language-model head
    sharing the embedding's table (its first outputs kept)."""

    def __init__(self, vocab, n_out=3, d=4, padding_idx=None, tied=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab if tied else n_out, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.n_out = n_out

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids)))).mean(1)[:, : self.n_out]


@pytest.mark.parametrize("kind", ["plain", "padding", "int32", "tied", "transformer"])
def test_embedding_lookups_never_form_a_one_hot(kind, monkeypatch):
    # The rule's factor was F.one_hot(ids, vocab), (n, S, vocab): its Gram cost and memory
    # grew with n S vocab (2.4 s against 0.8 s for dense per-sample gradients at vocab
    # 30,000, S = 16, n = 64). The ids are now the factor, contracted by index equality
    # or scattered into the table's rows: nothing may build the one-hot.
    def refuse(*args, **kwargs):
        raise AssertionError("a one-hot factor was formed")

    vocab = 4000
    torch.manual_seed(0)
    module = (_Tokens(3, vocab=vocab, d=4, layers=1) if kind == "transformer" else
              _TokenMeans(vocab, padding_idx=7 if kind == "padding" else None,
                          tied=kind == "tied")).double().eval()
    params = {k: v.detach() for k, v in module.named_parameters()}
    g = torch.Generator().manual_seed(0)
    X, Y = (torch.randint(0, 12, (n, 5), generator=g) for n in (6, 4))
    X[0, :3], X[1, 2], Y[0, 4] = 7, 7, 7  # repeated ids within and across samples
    if kind == "int32":
        X, Y = X.int(), Y.int()
    JX, JY = jacobian_loop(module, X), jacobian_loop(module, Y)
    D = torch.rand(JX.shape[2], generator=g, dtype=torch.float64) + 0.1
    monkeypatch.setattr(F, "one_hot", refuse)
    C = JX.shape[1]
    for route in (None, "pair", "dense"):
        with monkeypatch.context() as m:
            _forced(m, route)
            _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", JX, JX) / C)
            _close(tangent_gram(module, params, X, Y, output="full"),
                   torch.einsum("ncp,mdp->ncmd", JX, JY))
            _close(tangent_gram(module, params, X, Y, output=1), JX[:, 1] @ JY[:, 1].T)
            _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", JX, JX) / C)
            _close(tangent_gram_diag(module, params, X, output="full"),
                   torch.einsum("ncp,ndp->ncd", JX, JX))
    # A preconditioner scales each position's delta by its id's row of D (sqrt(D) on both
    # sides where D >= 0 and the blocks fit, D on one side otherwise).
    negative = D * torch.where(torch.arange(len(D)) % 3 == 0, -1.0, 1.0).double()
    small = 2**25 if kind == "tied" else 2**21  # a tied table's Jacobian is dense
    for weight, budget in ((D, 2**28), (negative, 2**28), (D, small), (negative, small)):
        kw = {"diag_weight": weight, "memory_budget": budget}
        _close(tangent_gram(module, params, X, Y, output="full", **kw),
               torch.einsum("ncp,p,mdp->ncmd", JX, weight, JY))
        _close(tangent_gram(module, params, X, **kw),
               torch.einsum("ncp,p,mcp->nm", JX, weight, JX) / C)
        _close(tangent_gram_diag(module, params, X, output="full", **kw),
               torch.einsum("ncp,p,ndp->ncd", JX, weight, JX))
    _close(tangent_features(module, params, X, output="full"), JX)
    _close(tangent_features(module, params, X), JX.reshape(len(JX), -1) / math.sqrt(C))
    z = project_tangent_features(module, params, X, 8, random_state=3, output="full")
    monkeypatch.undo()  # the reference's directions read the one-hot factor's width
    _close(z, _projection_reference(module, params, X, JX, 8, 3, "full"))


def test_embedding_route_follows_the_cost_model():
    # Position pairs cost one id comparison each, the table's blocks vocab x d per
    # sample: a wide table pairs positions, a narrow one forms its blocks.
    routes = {}
    for vocab in (10, 30000):
        module = _TokenMeans(vocab, d=32).eval()
        params = {k: v.detach() for k, v in module.named_parameters()}
        X = torch.randint(0, vocab, (1, 16))
        probe = capture(module, params, X, [0, 1, 2], memory_budget=2**28, index=True)
        (term,) = [t for t in probe.terms if t.inputs[0][0] == "emb.weight"]
        assert term.rows == vocab and term.inputs[0][1].shape == (1, 16)
        routes[vocab] = _gram.gram_route(term, 64, 64, "trace", False, True, 2**28, 4)
    assert routes == {10: "dense", 30000: "pair"}


class _TupleOut(nn.Module):
    """Returns its logits with a second tensor (or in a dict), as many models do."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(3, 2)

    def forward(self, x):
        z = self.lin(x)
        return (z, z.sum(1)) if self.kind == "tuple" else {"logits": z}


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_layer_routes_and_check_rule_name_an_output_that_is_not_a_tensor(kind):
    # They failed in a reshape (AttributeError: 'tuple' object has no attribute 'reshape');
    # a recorded network of the same module is refused with this message. The Gram and
    # the features count the outputs by the same forward (they failed so until s49's
    # review moved the refusal from layer_routes' own count into it).
    net = _TupleOut(kind)
    params = dict(net.named_parameters())
    for call in (lambda: layer_routes(net, torch.randn(3, 3)),
                 lambda: check_rule(net, torch.randn(3, 3)),
                 lambda: tangent_gram(net, params, torch.randn(3, 3)),
                 lambda: tangent_features(net, params, torch.randn(3, 3))):
        with pytest.raises(TypeError, match=f"must return one tensor.*returned a {kind}"):
            call()


class _Squeezed(nn.Module):
    """A one-output regression net ending in ``.squeeze()``: (n,) for n samples, a 0-d
    tensor for one."""

    def __init__(self, squeeze=True):
        super().__init__()
        torch.manual_seed(0)
        self.squeeze, self.a, self.b = squeeze, nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x):
        z = self.b(torch.tanh(self.a(x)))
        return z.squeeze() if self.squeeze else z


def test_layer_routes_and_check_rule_take_a_squeezed_output():
    # The refusal of tuple outputs also refused the 0-d output such a module gives for
    # the one sample the outputs are counted on (ValueError "returned shape () for 1
    # sample(s)"), which a recorded network of it takes.
    X = torch.randn(5, 3, dtype=torch.float64)
    net, plain = _Squeezed().double(), _Squeezed(squeeze=False).double()
    assert net(X[:1]).ndim == 0
    assert ([r.route for r in layer_routes(net, X)]
            == [r.route for r in layer_routes(plain, X)] == ["rule", "rule"])
    assert check_rule(net, X) < 1e-10


def test_index_term_is_validated():
    delta = torch.randn(2, 1, 3, 4)
    with pytest.raises(ValueError, match="must be an integer tensor of shape"):
        Term(delta, [("w", torch.randn(2, 3))], transposed=True, rows=5)
    with pytest.raises(ValueError, match="must be transposed"):
        Term(delta, [("w", torch.zeros(2, 3, dtype=torch.long))], rows=5)
    # The index contractions read one table's ids: a second input was taken, unread.
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="takes one input"):
        Term(delta, [("w", ids), ("v", ids)], transposed=True, rows=5)


# ------------------------------------------------------------------- the refusals
def test_train_mode_batch_norm_is_refused_naming_the_layer():
    module, params, X, _ = _make("batch_norm2d", 2)
    module.body[1].train()
    for call in (lambda: tangent_gram(module, params, X),
                 lambda: tangent_features(module, params, X),
                 lambda: tangent_gram_diag(module, params, X),
                 lambda: project_tangent_features(module, params, X, 4, random_state=0)):
        with pytest.raises(ValueError, match=r"'body\.1' \(BatchNorm2d\) is in training mode"):
            call()
    module.body[1].eval()
    module.body[1].running_mean = module.body[1].running_var = None  # batch statistics
    with pytest.raises(ValueError, match="keeps no running statistics"):
        tangent_gram(module, params, X)


class _FunctionalBatchNorm(nn.Module):
    """A meta-learning model's batch norm: ``F.batch_norm`` with or without the batch's
    statistics."""

    def __init__(self, training):
        super().__init__()
        self.training_stats = training
        self.conv, self.head = nn.Conv1d(2, 3, 3), nn.Linear(12, 2)
        self.w, self.b = nn.Parameter(torch.rand(3) + 0.5), nn.Parameter(torch.randn(3))
        self.register_buffer("mean", torch.randn(3))
        self.register_buffer("var", torch.rand(3) + 0.5)

    def forward(self, x):
        h = F.batch_norm(self.conv(x), self.mean, self.var, self.w, self.b,
                         training=self.training_stats)
        return self.head(torch.tanh(h).flatten(1))


def test_functional_batch_statistics_are_refused():
    # F.batch_norm(training=True) mixes the samples: the Gram was 10% off the per-sample
    # loop's, silently (nn.BatchNorm layers in training mode were refused already).
    torch.manual_seed(0)
    X = torch.randn(5, 2, 6, dtype=torch.float64)
    module = _FunctionalBatchNorm(training=True).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    for call in (lambda: tangent_gram(module, params, X),
                 lambda: tangent_features(module, params, X),
                 lambda: tangent_gram_diag(module, params, X),
                 lambda: layer_routes(module, X)):
        with pytest.raises(ValueError, match="batch_norm has training=True"):
            call()
    module.training_stats = False  # running statistics: per sample, and exact
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class _ConvReadOutside(nn.Module):
    """A convolution whose weight is also read by the parent, and one used twice (on its
    rule: the two calls' terms summed)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.twice = nn.Conv2d(2, 2, 3, padding=1)
        self.norm = nn.LayerNorm(2)
        self.head = nn.Linear(2 * 16, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x)) + self.conv.weight.sum()
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        h = self.norm(h.transpose(1, 3)) * self.norm.weight  # LayerNorm weight read again
        return self.head(h.reshape(len(h), -1))


def test_misuse_of_the_new_layers_goes_to_the_fallback():
    torch.manual_seed(0)
    module = _ConvReadOutside().double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    cap = _gram._prepare(module, params, X, "full", 2**24)[3]
    assert set(cap.fallback) == {"conv.weight", "conv.bias", "norm.weight", "norm.bias"}
    J = _loop(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


# ------------------------------------------------------------------------- RMSNorm
RMS = sorted(c for c in CASES if c.startswith("rms"))


@pytest.mark.parametrize("case", RMS)
def test_rms_norm_is_reported_on_its_rule(case):
    # nn.RMSNorm had no rule: layer_routes reported it on the generic fallback.
    module, params, X, _ = _make(case, 2)
    routes = layer_routes(module, X, params=params)
    affine = [name for name, m in module.named_modules()
              if isinstance(m, nn.RMSNorm) and m.weight is not None]
    assert [r.name for r in routes if r.type == "RMSNorm"] == affine
    assert {r.route for r in routes} == {"rule"}, [(r.name, r.reason) for r in routes]


class _MyRMSNorm(nn.RMSNorm):
    """A subclass overriding forward: it falls back until registered."""

    def forward(self, x):
        return super().forward(x)


def test_an_rms_norm_subclass_falls_back_to_the_same_numbers():
    torch.manual_seed(0)
    module = _Head(nn.Sequential(nn.Linear(3, 4), _MyRMSNorm(4)), 5 * 4, 2).double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(6, 5, 3, dtype=torch.float64)
    assert [r.route for r in layer_routes(module, X)] == ["rule", "fallback", "rule"]
    J = _loop(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


@pytest.mark.parametrize("case", RMS)
def test_rms_norm_rules_in_float32_match_the_float64_loop(case):
    # The rule in float32 (its normalised input from torch's float32 rms_norm, eps=None
    # meaning float32's machine epsilon there), against the float64 loop at the same
    # parameters and inputs (rounded to float32): they differ by float32 rounding only.
    module, params, X, Y = _make(case, 3)
    p32 = {k: v.float() for k, v in params.items()}
    X32, Y32 = ((Z.float() if Z.is_floating_point() else Z) for Z in (X, Y))
    m32 = copy.deepcopy(module).float()
    p64 = {k: v.double() for k, v in p32.items()}
    X64, Y64 = ((Z.double() if Z.is_floating_point() else Z) for Z in (X32, Y32))
    JX, JY = _loop(module, p64, X64), _loop(module, p64, Y64)
    assert {r.route for r in layer_routes(m32, X32, params=p32)} == {"rule"}
    rtol = 2e-5
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    _close(tangent_gram(m32, p32, X32, Y32, output="full"), full, rtol)
    _close(tangent_gram(m32, p32, X32, Y32, output=1), full[:, 1, :, 1], rtol)
    _close(tangent_gram(m32, p32, X32), torch.einsum("ncp,mcp->nm", JX, JX) / 3, rtol)
    _close(tangent_gram_diag(m32, p32, X32), torch.einsum("ncp,ncp->n", JX, JX) / 3, rtol)
    _close(tangent_features(m32, p32, X32, output="full"), JX, rtol)
    gen = torch.Generator().manual_seed(1)
    D = 1.0 / (torch.rand(JX.shape[2], generator=gen, dtype=torch.float64) + 0.1)
    _close(tangent_gram(m32, p32, X32, Y32, output="full", diag_weight=D.float()),
           torch.einsum("ncp,p,mdp->ncmd", JX, D, JY), rtol)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_rules_on_cuda_match_the_cpu(case):
    # The rules and contractions use the device of the tensors they are given: the same
    # float64 numbers on a GPU (the projection's directions are drawn on the CPU), and
    # float32 there within 1e-5 of them.
    module, params, X, Y = _make(case, 2)
    cuda = torch.device("cuda")
    on = {k: v.to(cuda) for k, v in params.items()}
    gpu = copy.deepcopy(module).to(cuda)
    gen = torch.Generator().manual_seed(2)
    D = torch.rand(sum(p.numel() for p in params.values()), generator=gen,
                   dtype=torch.float64) + 0.5
    calls = [
        lambda m, p, x, y, d: tangent_gram(m, p, x, y, output="full"),
        lambda m, p, x, y, d: tangent_gram(m, p, x),
        lambda m, p, x, y, d: tangent_gram(m, p, x, y, diag_weight=d),
        lambda m, p, x, y, d: tangent_gram_diag(m, p, x, output="full"),
        lambda m, p, x, y, d: tangent_features(m, p, x),
        lambda m, p, x, y, d: project_tangent_features(m, p, x, 8, random_state=0),
    ]
    for call in calls:
        ref = call(module, params, X, Y, D)
        got = call(gpu, on, X.to(cuda), Y.to(cuda), D.to(cuda))
        assert got.device.type == "cuda"
        _close(got.cpu(), ref)
        single = {k: v.float() for k, v in on.items()}
        x32, y32 = ((t.to(cuda).float() if t.is_floating_point() else t.to(cuda))
                    for t in (X, Y))
        _close(call(copy.deepcopy(gpu).float(), single, x32, y32, D.to(cuda)).cpu(), ref, 1e-5)
    # The GPU's batched autograd check finds the rules' factors right, as the CPU's loop
    # does: no layer on the fallback, whose results would agree just the same.
    probe = _gram._prepare(gpu, on, X.to(cuda), "full", 2**24)[3]
    assert probe.fallback == () and probe.exclude == frozenset()


@pytest.mark.parametrize("shape, kernel, stride, dilation", [
    ((2, 3, 7, 6), (3, 3), (1, 1), (1, 1)),
    ((2, 4, 9, 8), (2, 3), (2, 1), (1, 2)),
    ((1, 2, 1, 11), (1, 3), (1, 3), (1, 2)),
    ((3, 1, 5, 5), (5, 5), (1, 1), (1, 1)),
])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset_view"])
def test_conv_patches_equal_unfold(shape, kernel, stride, dilation, layout):
    # The conv rule's patches are a strided copy of the input: the same numbers as
    # F.unfold for every stride, dilation and memory layout of the input.
    from torch.nn import functional as F

    from skpathkernel._tangent._layers import _unfold

    x = torch.randn(shape[0], shape[1], shape[2] + 1, shape[3] + 2, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x = x[:, :, 1:, 2:] if layout == "offset_view" else x[:, :, :-1, :-2]
    expected = F.unfold(x, kernel, dilation=dilation, stride=stride)
    assert torch.equal(_unfold(x, kernel, stride, dilation), expected)


def test_narrow_patch_blocks_are_formed_transposed_only_for_a_trace(monkeypatch):
    # RGB 3x3 patches (q = 27 columns) and C p = 2 x 8 = 16 rows: a trace without D forms
    # each sample's block as q x C p (its entries' order cancels in the row products);
    # every output's block, one output and a preconditioned Gram keep the flat order.
    from skpathkernel._tangent import _contract

    _forced(monkeypatch, "dense")
    orders = []
    real = _contract.row_order
    monkeypatch.setattr(_contract, "row_order", lambda *a: orders.append(real(*a)) or orders[-1])
    torch.manual_seed(0)
    module = _Head(nn.Conv2d(3, 8, 3, padding=1), 8 * 36, 2).double().eval()
    gen = torch.Generator().manual_seed(0)
    params = {k: v.detach() for k, v in module.named_parameters()}
    X, Y = _image((3, 6, 6))(7, gen), _image((3, 6, 6))(4, gen)
    JX, JY = _loop(module, params, X), _loop(module, params, Y)
    _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", JX, JX) / 2)
    _close(tangent_gram(module, params, X, Y), torch.einsum("ncp,mcp->nm", JX, JY) / 2)
    assert "qp" in orders
    orders.clear()
    D = torch.rand(JX.shape[2], generator=gen, dtype=torch.float64) + 0.5
    _close(tangent_gram(module, params, X, Y, output="full"),
           torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram(module, params, X, output=1), JX[:, 1] @ JX[:, 1].T)
    _close(tangent_gram(module, params, X, Y, diag_weight=D),
           torch.einsum("ncp,p,mcp->nm", JX, D, JY) / 2)
    assert "qp" not in orders


def test_any_row_order_is_a_permutation_of_the_flat_rows():
    from skpathkernel._tangent._contract import dense_grad, row_order
    from skpathkernel.rules import Term

    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(5, 2, 8, 9, generator=gen, dtype=torch.float64)
    a = torch.randn(5, 27, 9, generator=gen, dtype=torch.float64).transpose(1, 2)
    term = Term(delta.transpose(2, 3), [("w", a)])
    assert row_order(term, a) == "qp"
    flat, anyorder = dense_grad(term, a), dense_grad(term, a, order="any")
    # Per sample: the outer products summed over positions, written out independently.
    expected = torch.einsum("ncsp,nsq->ncpq", term.delta, a).reshape(5, 2, -1)
    torch.testing.assert_close(flat, expected, rtol=1e-13, atol=0)
    assert not torch.equal(anyorder, flat)
    torch.testing.assert_close(anyorder.reshape(5, -1).sort(1).values,
                               flat.reshape(5, -1).sort(1).values, rtol=1e-13, atol=0)
    # Row products are those of the flat rows; the buffer form writes the same numbers.
    torch.testing.assert_close(anyorder.reshape(5, -1) @ anyorder.reshape(5, -1).T,
                               flat.reshape(5, -1) @ flat.reshape(5, -1).T, rtol=1e-13, atol=0)
    out = torch.empty(5, 2, 8 * 27, dtype=torch.float64)
    assert dense_grad(term, a, out=out, order="any") is out
    assert torch.equal(out, anyorder)
    # One position, or a constant input, keeps the flat order.
    assert row_order(Term(term.delta[:, :, :1], [("w", a[:, :1])]), a[:, :1]) == "flat"
    assert row_order(term, None) == "flat"


@pytest.mark.parametrize("kind", ["instance_norm", "spectral_norm"])
def test_layers_that_move_buffers_in_training_mode_are_refused(kind):
    """A tracking InstanceNorm or a spectral normalisation in training mode moves its
    buffers at every forward pass: the routes' and kernels' passes rewrote the user's
    running statistics / singular vectors (fit and PathRecorder refuse them already).
    In eval mode they are fixed per-sample functions, exact against the loop."""
    torch.manual_seed(0)
    if kind == "instance_norm":
        module = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, affine=True,
                                                                     track_running_stats=True),
                               nn.Flatten(), nn.Linear(12, 2)).double()
    else:
        module = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6 * 2, 4)),
                               nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(5, 2, 6, dtype=torch.float64)
    if kind == "spectral_norm":
        X = X.flatten(1)
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = copy.deepcopy(dict(module.named_buffers()))
    for call in (lambda: tangent_gram(module, params, X), lambda: layer_routes(module, X)):
        with pytest.raises(ValueError, match="is in training mode"):
            call()
    for name, b in module.named_buffers():
        assert torch.equal(b, buffers[name]), name  # refused before any forward pass
    module.eval()
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


def test_the_fallback_does_not_repeat_torch_funcs_unbatched_operation_note():
    """weight_norm's backward has no vmap batching rule: torch.func said so at every
    chunk (about 100 warnings per decompose of a recorded weight_norm network); the
    fallback's cost is reported once, by layer_routes. The values stay the loop's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 5)), nn.Tanh(),
                           nn.Linear(5, 2)).double()
    X = torch.randn(6, 3, dtype=torch.float64)
    params = {k: v.detach() for k, v in module.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = tangent_gram(module, params, X, output="full")
    J = jacobian_loop(module, X)
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))
    # The parametrization's tensors fall back; the Linear's raw bias, read by its
    # F.linear as a free parameter, is on the Linear rule's site.
    assert [r.route for r in layer_routes(module, X)][:2] == ["rule", "fallback"]


def test_the_per_sample_loop_is_right_for_channels_last_batches():
    """torch 2.13's CPU conv2d backward gives a grouped channels_last weight a wrong
    gradient for one sample sliced from a channels_last batch; the fallback's loop (and
    check_rule's reference) slice samples so. Reference: finite differences."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 2, (1, 3), stride=(1, 2), padding=(1, 1), groups=2).double()
    conv = conv.to(memory_format=torch.channels_last)
    X = torch.randn(3, 4, 7, 7, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    params = {k: v.detach() for k, v in conv.named_parameters()}
    J = _generic.per_sample_jacobian(conv, params, X, ["weight"], [0],
                                     memory_budget=2**20)["weight"]
    # The loop route: torch.func's vmap would batch the same computation correctly.
    looped = _generic._looped(conv, {"bias": params["bias"]}, {"weight": params["weight"]},
                              X, torch.tensor([0]))["weight"]
    w0, h = params["weight"], 1e-6
    for i in range(len(X)):
        fd = torch.empty(w0.numel(), dtype=torch.float64)
        for k in range(w0.numel()):
            e = torch.zeros(w0.numel(), dtype=torch.float64)
            e[k] = h
            f = [torch.func.functional_call(conv, {"weight": w0 + s * e.reshape(w0.shape),
                                                   "bias": params["bias"]},
                                            (X[i:i + 1],)).reshape(-1)[0] for s in (1, -1)]
            fd[k] = (f[0] - f[1]) / (2 * h)
        _close(looped[i].reshape(-1), fd, rtol=1e-7)
        _close(J[i].reshape(-1), fd, rtol=1e-7)
