"""Seeded fuzz of the per-layer rules: random small networks against ``torch.func``.

Each case draws a configuration people build (convolutions of every padding, stride,
dilation, groups and layout; transposed convolutions; token models with embeddings,
attention and encoder layers, masks, tied heads; raw parameters in elementwise ops; a
layer called twice; frozen parameters; float32) and checks the engine against a dense
per-sample Jacobian written here (``vmap(jacrev(functional_call))``, float64), which no
rule touches: the features, the Gram (trace, full, cross), with and without the
engine's own autograd safety net (which would hide a wrong rule behind the fallback),
and that ``layer_routes`` says the truth (no built-in rule rejected by the autograd
check; the fallback parameters are those of the layers it lists as such). A case may
also end in a clear error (``ValueError`` / ``TypeError``), never in a wrong number.

A fixed number of seeds runs in CI; by hand, more::

    PYTHONPATH=$PWD:tests python tests/test_rules_fuzz.py --cases 2000 [--start 0]
"""

import argparse
import copy
import math
import random
import sys
import time
import traceback
import warnings

import numpy as np
import pytest
import torch
from _reference import jacobian_loop
from test_rules import _Head  # body, tanh, flatten, Linear
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn import functional as F

from skpathkernel import PathRecorder
from skpathkernel._tangent import (
    tangent_features,
    tangent_gram,
    tangent_gram_diag,
    warn_on_fallback,
)
from skpathkernel._tangent._routes import DISAGREE, FALLBACK_SHARE
from skpathkernel.kernels import PathKernel, TangentKernel
from skpathkernel.rules import FallbackWarning, layer_routes

# The reference's vmap cross-check runs ops functorch batches slowly, and says so.
pytestmark = [pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
              pytest.mark.filterwarnings("ignore:Using padding='same' with even:UserWarning")]

RTOL = {torch.float64: 1e-10, torch.float32: 1e-4}
N_CASES = 50  # CI: about 20 s on one core (two-core machine, load 2-4)
N_X, N_Y = 3, 2


# ----------------------------------------------------------------------------- blocks

class Tokens(nn.Module):
    """Embedding, optional class token / position embedding / LayerScale, a Linear on
    the tokens (optionally applied twice), a norm, an attention block, a pooled or tied
    head. Masks are computed from the token ids, so they are per sample."""

    def __init__(self, r: random.Random, vocab, length, dim, n_out):
        super().__init__()
        self.pad = r.choice([None, 0, vocab - 1, -1])
        self.emb = nn.Embedding(vocab, dim, padding_idx=self.pad,
                                max_norm=r.choice([None] * 15 + [0.5]),
                                scale_grad_by_freq=r.random() < 0.1)
        self.cls = nn.Parameter(torch.randn(1, 1, dim)) if r.random() < 0.3 else None
        seq = length + (self.cls is not None)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) / 4) if r.random() < 0.4 else None
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5) if r.random() < 0.3 else None
        self.lin = nn.Linear(dim, dim, bias=r.random() < 0.7)
        self.twice = r.random() < 0.15
        self.norm = r.choice([None, "ln", "ln-plain", "ln-nobias", "gn"])
        if self.norm == "ln":
            self.ln = nn.LayerNorm(dim)
        elif self.norm == "ln-plain":
            self.ln = nn.LayerNorm(dim, elementwise_affine=False)
        elif self.norm == "ln-nobias":
            self.ln = nn.LayerNorm(dim, bias=False)
        self.batch_first = r.random() < 0.5
        self.mask = r.choice(["none", "padding", "causal", "both"])
        self.kind = r.choice(["mha", "mha", "cross", "encoder", "none"])
        heads = r.choice([1, 2])
        if self.kind == "mha":
            self.need_weights = r.random() < 0.5
            self.attn = nn.MultiheadAttention(
                dim, heads, bias=r.random() < 0.8, batch_first=self.batch_first,
                add_bias_kv=r.random() < 0.15, add_zero_attn=r.random() < 0.15)
        elif self.kind == "cross":  # keys and values of other widths (separate weights)
            self.need_weights = r.random() < 0.5
            self.kv = nn.Linear(dim, 3)
            self.attn = nn.MultiheadAttention(dim, heads, kdim=3, vdim=3,
                                              bias=r.random() < 0.8,
                                              batch_first=self.batch_first)
        elif self.kind == "encoder":
            self.attn = nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=6, dropout=r.choice([0.0, 0.1]),
                batch_first=self.batch_first,
                norm_first=r.random() < 0.5, activation=r.choice(["relu", "gelu"]),
                bias=r.random() < 0.8)
        self.tied = r.random() < 0.25
        if self.tied:
            self.head = nn.Linear(dim, vocab, bias=r.random() < 0.5)
            self.head.weight = self.emb.weight
        else:
            self.head = nn.Linear(dim, n_out)

    def forward(self, ids):
        h = self.emb(ids)
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1)
        if self.pos is not None:
            h = h + self.pos
        h = self.lin(h)
        if self.twice:
            h = self.lin(torch.tanh(h))
        if self.gamma is not None:
            h = self.gamma * h
        if self.norm in ("ln", "ln-plain", "ln-nobias"):
            h = self.ln(h)
        if self.kind != "none":
            h = self._attend(h, ids)
        pooled = h[:, 0] if self.tied else torch.tanh(h).mean(1)
        return self.head(pooled)

    def _attend(self, h, ids):
        S = h.shape[1]
        pad = None
        if self.mask in ("padding", "both") and self.pad is not None:
            pad = ids == (self.pad % self.emb.num_embeddings)
            if self.cls is not None:
                pad = torch.cat([torch.zeros_like(pad[:, :1]), pad], dim=1)
        causal = (torch.ones(S, S, dtype=torch.bool).triu(1)
                  if self.mask in ("causal", "both") else None)
        x = h if self.batch_first else h.transpose(0, 1)
        if self.kind == "mha":
            y = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal,
                          need_weights=self.need_weights)[0]
        elif self.kind == "cross":
            kv = torch.tanh(self.kv(x))
            y = self.attn(x, kv, kv, key_padding_mask=pad, attn_mask=causal,
                          need_weights=self.need_weights)[0]
        else:
            y = self.attn(x, src_mask=causal, src_key_padding_mask=pad,
                          is_causal=causal is not None and self.mask == "causal")
        return y if self.batch_first else y.transpose(0, 1)


class Twice(nn.Module):
    """One layer applied twice (its factors would need a sum over the calls)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


# ------------------------------------------------------------------------ generators
def _out_len(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _conv_case(r: random.Random, n_out):
    dims = r.choice([1, 1, 2, 2, 2, 3])
    sizes = [r.randint(4, 7) for _ in range(dims)]
    c_in = r.choice([1, 2, 3, 4])
    groups_kind = r.choice(["one", "one", "depthwise", "two"])
    if groups_kind == "depthwise":
        groups, c_out = c_in, c_in * r.choice([1, 2])
    elif groups_kind == "two" and c_in % 2 == 0:
        groups, c_out = 2, 2 * r.choice([1, 2])
    else:
        groups, c_out = 1, r.choice([1, 2, 3])
    kernel = tuple(r.randint(1, 3) for _ in range(dims))
    dilation = tuple(r.choice([1, 1, 2]) for _ in range(dims))
    transposed = r.random() < 0.2
    if transposed:
        stride = tuple(r.choice([1, 2]) for _ in range(dims))
        padding = tuple(r.randint(0, (k - 1) * d) for k, d in zip(kernel, dilation))
        out_pad = tuple(r.randint(0, max(s, d) - 1) for s, d in zip(stride, dilation))
        Conv = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[dims - 1]
        conv = Conv(c_in, c_out, kernel, stride=stride, padding=padding,
                    output_padding=out_pad, groups=groups, dilation=dilation,
                    bias=r.random() < 0.7)
    else:
        stride = tuple(r.choice([1, 1, 2]) for _ in range(dims))
        style = r.choice(["int", "tuple", "same", "same", "valid"])
        if style == "same":  # the output keeps the input's size; odd total padding
            stride = (1,) * dims  # goes right for an even (dilated) kernel
            kernel = tuple(r.choice([k, 2, 4]) for k in kernel)
            padding, pads = "same", [0] * dims
        elif style == "valid":
            padding, pads = "valid", [0] * dims
        else:
            pads = [r.randint(0, 2) for _ in range(dims)]
            padding = pads[0] if style == "int" else tuple(pads)
            pads = pads if style == "tuple" else [pads[0]] * dims
        mode = r.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
        if mode == "reflect" and any(p >= n for p, n in zip(pads, sizes)):
            mode = "zeros"
        Conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        conv = Conv(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation,
                    groups=groups, bias=r.random() < 0.7, padding_mode=mode)
    try:  # the output's shape, as torch computes it (or a configuration it refuses)
        with torch.no_grad():
            shape = list(conv(torch.zeros(1, c_in, *sizes)).shape[2:])
    except RuntimeError:
        return None
    layers = [conv]
    norm = r.choice([None, None, "bn", "bn-plain", "gn", "gn-plain", "in", "ln"])
    if norm in ("bn", "bn-plain"):
        bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](
            c_out, affine=norm == "bn")
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        layers.append(bn)
    elif norm in ("gn", "gn-plain"):
        g = r.choice([g for g in (1, 2, c_out) if c_out % g == 0])
        layers.append(nn.GroupNorm(g, c_out, affine=norm == "gn"))
    elif norm == "in":
        layers.append((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1](
            c_out, affine=True))
    elif norm == "ln":
        layers.append(nn.LayerNorm(shape[-r.randint(1, len(shape)):],
                                   elementwise_affine=r.random() < 0.8))
    body = nn.Sequential(*layers)
    if r.random() < 0.1:
        body = Twice(nn.Conv1d(c_in, c_in, 1) if dims == 1 else body)
        if dims != 1:
            return None
        body = nn.Sequential(body, *layers)
    net = _Head(body, c_out * math.prod(shape), n_out)
    make = lambda n, g: torch.randn(n, c_in, *sizes, generator=g)  # noqa: E731
    layout = None
    if dims >= 2 and r.random() < 0.3:
        layout = torch.channels_last if dims == 2 else torch.channels_last_3d
        if r.random() < 0.5:
            net = net.to(memory_format=layout)  # the weights too
    return net, make, layout


def _dense_case(r: random.Random, n_out):
    """Linear on 2-D or 3-D (token) inputs, raw parameters, PReLU, a layer called twice."""
    D = r.choice([2, 3, 4])
    tokens = r.random() < 0.5
    S = r.choice([2, 3]) if tokens else None
    lead = (r.choice([1, 2]),) if tokens and r.random() < 0.3 else ()  # Linear on 4-D

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, 4, bias=r.random() < 0.7)
            self.gamma = nn.Parameter(torch.rand(4) + 0.5) if r.random() < 0.4 else None
            self.shift = (nn.Parameter(torch.randn(*(((1, S, 4),) if tokens else ((4,),))[0]))
                          if r.random() < 0.4 else None)
            self.act = r.choice([nn.Tanh(), nn.Tanh(), nn.PReLU(), nn.RMSNorm(4)]
                                + ([] if lead else [nn.PReLU(S if tokens else 4)]))
            self.bn = None
            if not lead and r.random() < 0.25:  # channels on axis 1: the features, or the tokens
                self.bn = nn.BatchNorm1d(S if tokens else 4, affine=r.random() < 0.7)
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 2.0)
            self.twice = r.random() < 0.2
            self.b = nn.Linear(4, 4)
            self.head = nn.Linear(4, n_out)

        def forward(self, x):
            h = self.a(x)
            if self.gamma is not None:
                h = h * self.gamma
            if self.shift is not None:
                h = self.shift + h
            h = self.act(h)
            if self.bn is not None:
                h = self.bn(h)
            h = self.b(h)
            if self.twice:
                h = self.b(torch.tanh(h))
            h = torch.tanh(h)
            return self.head(h.flatten(1, -2).mean(1) if h.ndim >= 3 else h)

    shape = (*lead, S, D) if tokens else (D,)
    return Dense(), (lambda n, g: torch.randn(n, *shape, generator=g)), None


def _token_case(r: random.Random, n_out):
    vocab, length, dim = r.choice([5, 7]), r.choice([3, 4]), 4
    net = Tokens(r, vocab, length, dim, n_out)
    pad = net.pad

    def make(n, g):
        ids = torch.randint(0, vocab, (n, length), generator=g)
        if pad is not None:
            ids[:, 0] = (pad + 1) % vocab  # never every key masked
            ids[0, -1] = pad % vocab       # the padding row is read
        return ids

    return net, make, None


FAMILIES = (_conv_case, _conv_case, _dense_case, _token_case, _token_case)


def build_case(seed: int):
    """``(description, net, X, Y, dtype)`` for ``seed``, deterministic."""
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    while True:
        family = r.choice(FAMILIES)
        torch.manual_seed(r.randrange(2**31))
        n_out = r.choice([1, 2])
        built = family(r, n_out)
        if built is not None:
            break
    net, make, layout = built
    net = net.double().eval()
    # Some parameters frozen (requires_grad=False): held fixed, not differentiated.
    for p in net.parameters():
        if r.random() < 0.1:
            p.requires_grad_(False)
    X, Y = make(N_X, g), make(N_Y, g)
    if X.is_floating_point():
        X, Y = X.double(), Y.double()
    if layout is not None:
        X, Y = X.contiguous(memory_format=layout), Y.contiguous(memory_format=layout)
    dtype = torch.float32 if r.random() < 0.15 else torch.float64
    return f"seed {seed}: {family.__name__[1:-5]} {net!r}"[:4000], net, X, Y, dtype


# ------------------------------------------------------------------------- reference
def _params(net):
    return {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}


def reference_jacobian(net, params, X):
    """(n, C, P) per-sample Jacobian, columns in ``params`` order, by one autograd pass
    per sample and output (the truth), and whether ``vmap(jacrev)`` agrees with it.

    ``vmap(jacrev)`` is not the truth alone: for ``nn.PReLU`` it raises, or returns
    wrong numbers when the samples are as many as the outputs (torch 2.13).
    """
    J = _loop_jacobian(net, params, X)

    def f(p, x):
        return functional_call(net, p, (x.unsqueeze(0),)).reshape(-1)

    try:
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, X)
    except RuntimeError:
        return J, "raises"  # an op vmap cannot batch (embedding_renorm_, prelu)
    n = X.shape[0]
    V = torch.cat([jac[k].reshape(n, jac[k].shape[1], -1) for k in params], dim=2)
    agree = torch.allclose(V, J, rtol=1e-12, atol=1e-12 * max(float(J.abs().max()), 1e-4))
    return J, "agrees" if agree else "wrong"


def _vmap_runs(net, params, X):
    """Whether ``vmap(jacrev)`` of ``net``'s forward over ``params`` runs on ``X``."""

    def f(p, x):
        return functional_call(net, p, (x.unsqueeze(0),)).reshape(-1)

    try:
        vmap(jacrev(f), in_dims=(None, 0))(params, X)
    except RuntimeError:
        return False
    return True


def _loop_jacobian(net, params, X):
    """(n, C, P) by one autograd call per sample and output."""
    rows = []
    for x in X:
        live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        out = functional_call(net, live, (x.unsqueeze(0),)).reshape(-1)
        rows.append(torch.stack([torch.cat([
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(live.values(), torch.autograd.grad(
                out[c], list(live.values()), retain_graph=True, allow_unused=True))])
            for c in range(out.shape[0])]))
    return torch.stack(rows)


def _err(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    # Relative to the reference, or to 1e-4 where it vanishes (a bias a norm without
    # affine cancels): both sides are then round-off.
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-4))


def _cast(net, X, dtype):
    net = copy.deepcopy(net).to(dtype)
    return net, (X.to(dtype) if X.is_floating_point() else X)


CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)
REFUSALS = ("has max_norm=", "has scale_grad_by_freq=True")  # the fuzz's documented refusals


def check_case(seed: int, public: bool = False) -> str:
    """Check one case; returns "ok", "ok-fallback" or "error: ..." (a documented refusal).

    Raises AssertionError on a wrong number or an untruthful route.
    """
    desc, net, X, Y, dtype = build_case(seed)
    params = _params(net)
    if not params:
        return "ok"
    try:
        (J, vx), (JY, vy) = reference_jacobian(net, params, X), reference_jacobian(net, params, Y)
    except Exception as exc:  # the reference cannot run this case
        return f"skip (reference: {type(exc).__name__})"
    if not torch.isfinite(J).all():
        return "skip (reference not finite)"
    rtol = RTOL[dtype]
    tnet, TX = _cast(net, X, dtype)
    _, TY = _cast(net, Y, dtype)
    tparams = _params(tnet)
    try:
        routes = layer_routes(tnet, TX)
        phi = tangent_features(tnet, tparams, TX, output="full")
    except CLEAR_ERRORS as exc:
        # A refusal the package documents; any other error (a rule's own size check) is
        # a bug.
        assert any(why in str(exc) for why in REFUSALS), f"{exc!r}\n{desc}"
        return f"error: {type(exc).__name__}: {str(exc)[:120]}"
    errors = {"features": _err(phi, J)}
    # The rules alone: without the autograd check a wrong rule is not routed away.
    errors["features, rules alone"] = _err(
        tangent_features(tnet, tparams, TX, output="full", check_hidden=False), J)
    C = J.shape[1]
    K = torch.einsum("ncp,mdp->nmcd", J, JY)
    errors["gram full (X, Y)"] = _err(
        tangent_gram(tnet, tparams, TX, TY, output="full", blocks_last=True), K)
    KXX = torch.einsum("ncp,mcp->nm", J, J) / C
    errors["gram trace (X, X)"] = _err(tangent_gram(tnet, tparams, TX), KXX)
    errors["diagonal trace"] = _err(tangent_gram_diag(tnet, tparams, TX), KXX.diagonal())
    c = C - 1
    errors[f"gram output={c} (Y, X)"] = _err(tangent_gram(tnet, tparams, TY, TX, output=c),
                                             JY[:, c] @ J[:, c].T)
    bad = {k: v for k, v in errors.items() if not v <= rtol}
    assert not bad, f"relative errors above {rtol:g}: {bad}\n{desc}"
    # The routes say the truth: no built-in rule rejected by the autograd check.
    rejected = [r for r in routes if r.reason == DISAGREE]
    assert not rejected, f"rules rejected by autograd: {rejected}\n{desc}"
    # Every differentiated parameter is listed once, and the warning names the fallback.
    total = sum(p.numel() for p in params.values())
    assert sum(r.n_params for r in routes) == total, f"routes {routes}\n{desc}"
    slow = sum(r.n_params for r in routes if r.route == "fallback")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_on_fallback(tnet, TX)
    said = [w for w in caught if issubclass(w.category, FallbackWarning)]
    # (Or any, where torch.func cannot batch the network: the fallback loops over samples.)
    # Whether it can is asked here of vmap(jacrev) itself, not read from the routes. (It
    # runs on every fuzz network so far, torch's own layers, so this checks that the probe
    # never wrongly says a network loops; a network that does is
    # test_fallback_differentiates_one_sample_at_a_time_where_vmap_refuses.)
    loops = slow > 0 and not _vmap_runs(tnet, tparams, TX[:2])
    assert [r.loops for r in routes] == [loops and r.route == "fallback" for r in routes], (
        f"routes {routes}, vmap {'fails' if loops else 'runs'}\n{desc}")
    assert len(said) == (slow >= FALLBACK_SHARE * total or loops), (routes, said)
    top = sorted((r for r in routes if r.route == "fallback"), key=lambda r: -r.n_params)
    for r in top[:3] if said else []:
        assert f"{r.name or '(module)'} ({r.type}" in str(said[0].message), (r, said)
    if public:
        _check_public(seed, net, X, Y, params)
    status = "ok-fallback" if any(r.route == "fallback" for r in routes) else "ok"
    vmap_said = vx if vx != "agrees" else vy
    return status if vmap_said == "agrees" else f"{status} (vmap {vmap_said})"


def _check_public(seed, net, X, Y, params):
    """TangentKernel / PathKernel of a two-step SGD path recorded by PathRecorder."""
    net = copy.deepcopy(net)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        target = net(X) + torch.randn(net(X).shape, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05)
    points = [{k: v.clone() for k, v in _params(net).items()}]
    with PathRecorder(net, opt, n_samples=X.shape[0]) as rec:
        for _ in range(2):
            rec.set_batch(np.arange(X.shape[0]))
            opt.zero_grad()
            (0.5 * (net(X) - target).pow(2).sum(1).mean()).backward()
            opt.step()
            points.append({k: v.detach().clone() for k, v in _params(net).items()})
    est = rec.as_estimator(X, target)
    ref = copy.deepcopy(net)

    def jac_at(p, Z):
        with torch.no_grad():
            for k, v in ref.named_parameters():
                if k in p:
                    v.copy_(p[k])
        return reference_jacobian(ref, p, Z)[0]

    JX, JY = jac_at(points[-1], X), jac_at(points[-1], Y)
    C = JX.shape[1]
    errors = {
        "TangentKernel(X)": _err(TangentKernel(est)(X.numpy()),
                                 torch.einsum("ncp,mcp->nm", JX, JX) / C),
        "TangentKernel(X, Y) full": _err(TangentKernel(est, output="full")(X.numpy(),
                                                                            Y.numpy()),
                                         torch.einsum("ncp,mdp->nmcd", JX, JY)),
    }
    KP = sum(0.05 * torch.einsum("ncp,mcp->nm", jac_at(p, X), jac_at(p, Y)) / C
             for p in points[:-1])
    errors["PathKernel(X, Y)"] = _err(PathKernel(est)(X.numpy(), Y.numpy()), KP)
    bad = {k: v for k, v in errors.items() if not v <= 1e-10}
    assert not bad, f"seed {seed}: public API errors {bad}"


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", range(N_CASES))
def test_fuzzed_network_matches_torch_func(seed):
    check_case(seed, public=seed % 6 == 0)


# ------------------------------------------------------------ regressions found by it
class _Clip(torch.autograd.Function):
    """A custom activation without a vmap rule (``vmap`` refuses it): tanh, with its
    derivative, written as a plain autograd.Function."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _ClipLayer(nn.Module):
    def forward(self, x):
        return _Clip.apply(x)


def _features_and_reference(net, X):
    params = _params(net)
    return (tangent_features(net, params, X, output="full", check_hidden=False),
            _loop_jacobian(net, params, X))


@pytest.mark.parametrize("body, shape", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU()), (4,)),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU(4)), (4,)),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU()), (3, 4)),
    (lambda: nn.Sequential(nn.Conv1d(3, 2, 2), nn.PReLU(2), nn.Flatten()), (3, 4)),
])
def test_prelu_is_on_its_rule_and_exact(body, shape):
    # Its fallback, vmap(jacrev), raised for most row counts and returned wrong numbers
    # for as many rows as outputs (here 2 and 2), torch 2.13.
    torch.manual_seed(0)
    body = body()
    width = body(torch.zeros(1, *shape)).numel()
    net = nn.Sequential(body, nn.Tanh(), nn.Flatten(), nn.Linear(width, 2)).double()
    with torch.no_grad():
        net[0][1].weight.uniform_(0.1, 0.6)
    X = torch.randn(2, *shape, dtype=torch.float64)
    phi, J = _features_and_reference(net, X)
    assert _err(phi, J) <= 1e-12
    assert [r.route for r in layer_routes(net, X)] == ["rule"] * 3


def test_embedding_max_norm_is_refused_and_its_weight_left_alone():
    # It went to the fallback, whose vmap cannot batch embedding_renorm_ (a functorch
    # error); computed otherwise, the forward renormalised the caller's parameters in
    # place and a tied head read rows that other samples had rescaled (wrong numbers).
    torch.manual_seed(0)
    net = Tokens(random.Random(3), 7, 4, 4, 1).double().eval()
    net.emb = nn.Embedding(7, 4, max_norm=0.5).double()
    ids = torch.randint(0, 7, (3, 4))
    params = _params(net)
    before = {k: v.clone() for k, v in params.items()}
    for call in (lambda: tangent_features(net, params, ids),
                 lambda: tangent_gram(net, params, ids), lambda: layer_routes(net, ids)):
        with pytest.raises(ValueError, match=r"'emb' \(Embedding\) has max_norm=0.5"):
            call()
    assert all(torch.equal(params[k], before[k]) for k in params)


def test_embedding_scale_grad_by_freq_is_refused():
    # Its backward divides a row's gradient by the token's count in the batch: not
    # d f / d theta. A token occurring twice in a sample read half its finite difference
    # in transform, and decompose missed by 4e-3 blaming its quadrature.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(7, 3, scale_grad_by_freq=True), nn.Flatten(),
                        nn.Linear(12, 2)).double()
    ids = torch.tensor([[1, 1, 2, 3], [4, 5, 6, 0]])
    params = _params(net)
    flagged = torch.autograd.grad(net(ids[:1]).sum(), net[0].weight)[0]
    net[0].scale_grad_by_freq = False
    true = torch.autograd.grad(net(ids[:1]).sum(), net[0].weight)[0]
    net[0].scale_grad_by_freq = True
    # Token 1 occurs twice in the sample: the flag halves its row of the gradient.
    torch.testing.assert_close(flagged[1], true[1] / 2)
    assert true[1].abs().max() > 0
    for call in (lambda: tangent_features(net, params, ids),
                 lambda: tangent_gram(net, params, ids), lambda: layer_routes(net, ids)):
        with pytest.raises(ValueError, match=r"'0' \(Embedding\) has scale_grad_by_freq"):
            call()
    # The functional lookup, on a raw parameter or on a table computed from it (which
    # no watch owns): the rule-less fallback differentiated it by autograd, with the
    # flag's scaling (off by 0.1 from the same network without).
    for scale in (None, 2.0):
        lookup = _FunctionalLookup(scale).double()
        params = _params(lookup)
        for compute in (tangent_features, tangent_gram):
            with pytest.raises(ValueError,
                               match="A call of embedding has scale_grad_by_freq"):
                compute(lookup, params, ids)
        lookup.flag = False
        phi = tangent_features(lookup, params, ids, output="full")
        J = jacobian_loop(lookup, ids)
        assert torch.allclose(phi.reshape(J.shape), J, atol=1e-12)


class _FunctionalLookup(nn.Module):
    """``F.embedding`` on a raw parameter, or (``scale``) on a table computed from it."""

    def __init__(self, scale=None):
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 3))
        self.head = nn.Linear(12, 2)
        self.flag, self.scale = True, scale

    def forward(self, ids):
        table = self.table if self.scale is None else self.table * self.scale
        return self.head(F.embedding(ids, table, scale_grad_by_freq=self.flag).flatten(1))


class _FallbackRMSNorm(nn.RMSNorm):
    """nn.RMSNorm under a type without a rule (a subclass overriding forward): a layer on
    the fallback whose vmap(jacrev) is right."""

    def forward(self, x):
        return super().forward(x)


def test_fallback_differentiates_one_sample_at_a_time_where_vmap_refuses():
    # An RMSNorm on the fallback before an autograd.Function without a vmap rule: the
    # fallback's vmap(jacrev) raised; it now loops over the samples, to the same numbers.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), _FallbackRMSNorm(4), _ClipLayer(),
                        nn.Linear(4, 3)).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    routes = layer_routes(net, X)
    assert [r.route for r in routes] == ["rule", "fallback", "rule"]
    # The routes say the fallback loops, as vmap(jacrev) itself refuses the network.
    assert not _vmap_runs(net, _params(net), X[:2])
    assert [r.loops for r in routes] == [False, True, False]
    phi, J = _features_and_reference(net, X)
    assert _err(phi, J) <= 1e-12
    K = tangent_gram(net, _params(net), X, X[:2], output="full", blocks_last=True)
    assert _err(K, torch.einsum("ncp,mdp->nmcd", J, J[:2])) <= 1e-12


class _RawPReLU(nn.Module):
    """``F.prelu`` on a raw parameter: no rule reads it, the fallback does."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.3]))

    def forward(self, x):
        return F.prelu(x, self.w)


@pytest.mark.parametrize("body,n,wrong", [(_RawPReLU, 2, True), (_RawPReLU, 3, False),
                                          (lambda: _FallbackRMSNorm(5), 3, False)])
def test_fallback_checks_vmap_against_autograd_and_loops_when_it_is_wrong(body, n, wrong):
    # torch 2.13's vmap(jacrev) of prelu's backward on chunks of as many rows as outputs
    # (two) is wrong off the (row, output) diagonal without an error: the fallback checks
    # each chunk's first row against autograd, warns and loops. Three rows: the probe's
    # chunk is the autograd check's cycle of five rows (two before session s54, which
    # warned), the block's three, so vmap is right and nothing warns. An RMSNorm's is
    # right: no warning.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), body(), nn.Linear(5, 2)).double()
    X = torch.randn(n, 4, dtype=torch.float64)
    assert [r.route for r in layer_routes(net, X)] == ["rule", "fallback", "rule"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        phi = tangent_features(net, _params(net), X, output="full")
    assert _err(phi, _loop_jacobian(net, _params(net), X)) <= 1e-12
    disagreed = [w for w in caught if "disagrees with plain autograd" in str(w.message)]
    assert bool(disagreed) == wrong


class _ConvTranspose2dSubclass(nn.ConvTranspose2d):
    """nn.ConvTranspose2d's computation on the fallback (a subclass overriding forward)."""

    def forward(self, x, output_size=None):
        return super().forward(x, output_size)


@pytest.mark.parametrize("frozen", [False, True])
def test_group_norm_behind_a_fallback_or_frozen_layer_on_channels_last_inputs(frozen):
    # The autograd check asked for the rule layers' gradients alone: torch 2.13's
    # group_norm backward, asked for the weight's and not the input's of a channels_last
    # tensor, crashed the process (a segmentation fault).
    torch.manual_seed(0)
    first = nn.Conv2d(2, 3, 2) if frozen else _ConvTranspose2dSubclass(2, 3, 2, padding=1)
    net = _Head(nn.Sequential(first, nn.GroupNorm(1, 3)), 3 * 9, 2).double()
    first.requires_grad_(not frozen)
    X = torch.randn(3, 2, 4, 4, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    routes = ["rule", "rule"] if frozen else ["fallback", "rule", "rule"]
    assert [r.route for r in layer_routes(net, X)] == routes
    phi = tangent_features(net, _params(net), X, output="full")
    assert _err(phi, _loop_jacobian(net, _params(net), X)) <= 1e-12


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--public-every", type=int, default=6)
    parser.add_argument("--width", type=int, default=400, help="characters per failure")
    parser.add_argument("--verbose", action="store_true", help="name each seed first")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts, failures = {}, []
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.cases):
        if args.verbose:
            print(f"seed {seed} ...", flush=True)
        try:
            status = check_case(seed, public=seed % args.public_every == 0)
        except Exception as exc:
            status = "FAIL"
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if "skpathkernel" in f.filename or "test_rules_fuzz" in f.filename]
            where = f"{frames[-1].filename.rpartition('/')[2]}:{frames[-1].lineno}"
            failures.append((seed, f"{type(exc).__name__}: {exc}"[:args.width], where))
        key = status.split(":")[0] if status.startswith(("error", "skip")) else status
        counts[key] = counts.get(key, 0) + 1
        if status.startswith(("error", "skip")):
            print(f"seed {seed}: {status}")
    for seed, msg, where in failures:
        print(f"--- FAIL seed {seed} at {where}\n{msg}")
    print(f"{args.cases} cases in {time.perf_counter() - t0:.0f} s: {counts}; "
          f"failed seeds {[s for s, *_ in failures]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
