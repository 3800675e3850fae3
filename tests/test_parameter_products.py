"""Raw parameters read by a matrix product (``F.linear(x, P[, b])``, ``x @ P``,
``x @ P.T``, ``torch.addmm``): sites of the Linear rule (._parameters.product_site),
against per-sample autograd in float64; and the reads that still fall back, each with
its reason."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import jacobian_loop, module_at
from test_parameter_rules import _close  # relative max error <= 1e-10
from torch import nn

from skpathkernel import PathKernelMachine
from skpathkernel._tangent import capture, tangent_features, tangent_gram
from skpathkernel._tangent._capture import FREE_UNSTRUCTURED
from skpathkernel._tangent._parameters import (
    PRODUCT_LEFT,
    PRODUCT_NO_GRAD,
    PRODUCT_OTHER,
    PRODUCT_SHAPE,
    PRODUCT_VIEW,
)
from skpathkernel.kernels import PathKernel, path_weights
from skpathkernel.rules import layer_routes


def _params(module):
    return {k: v.detach() for k, v in module.named_parameters() if v.requires_grad}


# ----------------------------------------------------------------------- the networks
class LoRA(nn.Module):
    """A frozen Linear and a low-rank update in raw A (r, d), B (out, r), as the s49
    trial wrote it (benchmarks/results/user_trial_architectures-s49.md)."""

    def __init__(self, d, out, r=2):
        super().__init__()
        self.base = nn.Linear(d, out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, d) / d**0.5)
        self.B = nn.Parameter(torch.randn(out, r) / 2)

    def forward(self, x):
        return self.base(x) + x @ self.A.T @ self.B.T


class LoRANet(nn.Module):
    def __init__(self, d=6, n_out=3):
        super().__init__()
        self.l1, self.l2 = LoRA(d, 8), LoRA(8, n_out)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class RawMLP(nn.Module):
    """Research code's ``x @ W + b`` and ``F.linear(x, V, c)`` on sequences (n, L, d)."""

    def __init__(self, d=4, h=6, n_out=3):
        super().__init__()
        self.W, self.b = nn.Parameter(torch.randn(d, h) / 2), nn.Parameter(torch.randn(h))
        self.V, self.c = nn.Parameter(torch.randn(n_out, h) / 2), nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        h = torch.tanh(x @ self.W + self.b)
        return F.linear(h, self.V, self.c).mean(1)


class RawAttention(nn.Module):
    """Single-head self-attention with raw Wq, Wk, Wv (d, d) and a raw output Wo."""

    def __init__(self, d=5, n_out=2):
        super().__init__()
        self.Wq, self.Wk, self.Wv = (nn.Parameter(torch.randn(d, d) / d**0.5)
                                     for _ in range(3))
        self.Wo = nn.Parameter(torch.randn(n_out, d) / d**0.5)

    def forward(self, x):
        q, k, v = x @ self.Wq, x @ self.Wk, x @ self.Wv
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1]**0.5, dim=-1)
        return F.linear((att @ v).mean(1), self.Wo)


class Forms(nn.Module):
    """Every accepted form once: torch.matmul, Tensor.matmul, mm, addmm, x @ P.t(),
    P.mT, P.transpose, F.linear with the bias by keyword and with P.T; a weight read
    twice (joined positions) and a weight read by a product and elementwise (summed)."""

    def __init__(self, d=3):
        super().__init__()
        self.P = nn.ParameterList(nn.Parameter(torch.randn(d, d) / 2) for _ in range(9))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(d) / 2) for _ in range(3))
        self.U = nn.Parameter(torch.randn(d, d) / 2)
        self.G = nn.Parameter(torch.randn(d, d) / 2)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        P, b = self.P, self.b
        h = torch.tanh(torch.matmul(x, P[0]))
        h = torch.tanh(h.matmul(P[1]) + torch.mm(h, P[2].t()))
        h = torch.tanh(torch.addmm(b[0], h, P[3]) + h @ P[4].mT)
        h = torch.tanh(h @ P[5].transpose(0, 1) + F.linear(h, P[6], bias=b[1]))
        h = torch.tanh(F.linear(h, P[7].T, b[2]) + F.linear(h, P[8]))
        h = torch.tanh(h @ self.U)
        h = torch.tanh(h @ self.U)  # U read twice: one term, positions joined
        h = torch.tanh(h @ self.G + (h.unsqueeze(-1) * self.G).sum(1))  # and elementwise
        return self.head(h)


class BiasOnly(nn.Module):
    """Raw biases of products whose weight is no parameter (a buffer): torch.addmm and
    F.linear, the bias's term alone."""

    def __init__(self):
        super().__init__()
        self.b, self.c = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.register_buffer("C", torch.randn(3, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(torch.addmm(self.b, x, self.C)
                                    + F.linear(x, self.C.T, self.c)))


class TiedAutoencoder(nn.Module):
    """One raw W read in both orientations (encoder x @ W, decoder h @ W.T: a transposed
    and a Linear term of one parameter, summed) and a raw U by F.linear and u @ U."""

    def __init__(self, d=5, h=3):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d, h) / 2)
        self.b = nn.Parameter(torch.randn(h) / 2)
        self.U = nn.Parameter(torch.randn(h, d) / 2)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        h = torch.tanh(x @ self.W + self.b)
        u = torch.tanh(F.linear(x, self.U))
        return self.head(torch.tanh(h @ self.W.T + u @ self.U).mean(1))


class Keywords(nn.Module):
    """Every product passing its arguments by keyword, as torch takes them (s55):
    F.linear(x, weight=W), F.linear(input=, weight=, bias=), torch.matmul(input=, other=),
    Tensor.matmul(other=), torch.mm(input=, mat2=), Tensor.mm(mat2=), and torch.addmm with
    every argument by keyword and its default scales spelled out."""

    def __init__(self, d=3):
        super().__init__()
        self.P = nn.ParameterList(nn.Parameter(torch.randn(d, d) / 2) for _ in range(7))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(d) / 2) for _ in range(2))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        P, b = self.P, self.b
        h = torch.tanh(F.linear(x, weight=P[0]))
        h = torch.tanh(F.linear(input=h, bias=b[0], weight=P[1]))
        h = torch.tanh(torch.matmul(input=h, other=P[2]) + h.matmul(other=P[3].T))
        h = torch.tanh(torch.mm(input=h, mat2=P[4]) + h.mm(mat2=P[5]))
        h = torch.tanh(torch.addmm(input=b[1], mat1=h, mat2=P[6], beta=1, alpha=1.0))
        return self.head(h)


class Flattened(nn.Module):
    """Hand-written transformer/MLP-mixer code: products on the rows samples x positions,
    ``x.reshape(-1, d)`` / ``x.view(-1, d)`` / ``x.flatten(0, 1)`` and the output viewed
    back to ``(n, s, out)`` (s55: F.linear there fell back, "the rows of its input are not
    the samples", and so did a bias added or a gain multiplied on those rows, "not broadcast
    over the samples"), by position and by keyword; W3 read twice."""

    def __init__(self, d=4, h=5, n_out=3):
        super().__init__()
        self.W1, self.b1 = nn.Parameter(torch.randn(h, d) / 2), nn.Parameter(torch.randn(h))
        self.W2 = nn.Parameter(torch.randn(h, h) / 2)
        self.W3, self.b3 = nn.Parameter(torch.randn(h, h) / 2), nn.Parameter(torch.randn(h))
        self.W4 = nn.Parameter(torch.randn(n_out, h) / 2)
        self.b2, self.g = nn.Parameter(torch.randn(h)), nn.Parameter(torch.randn(1, h))

    def forward(self, x):
        n, s, d = x.shape
        h = torch.tanh(F.linear(x.reshape(-1, d), self.W1, self.b1).view(n, s, -1))
        h = torch.tanh(F.linear(input=h.view(n * s, -1), weight=self.W2).view(n, s, -1))
        h = torch.tanh((h.flatten(0, 1) @ self.W3.T + self.b3).unflatten(0, (n, s)))
        h = torch.tanh((torch.addmm(self.b2, h.flatten(0, 1), self.W3) * self.g).view(n, s, -1))
        return F.linear(h, self.W4).mean(1)


NETS = {
    "bias_only": (BiasOnly, lambda: torch.randn(5, 3)),
    "tied": (TiedAutoencoder, lambda: torch.randn(5, 4, 5)),
    "lora": (LoRANet, lambda: torch.randn(6, 6)),
    "raw_mlp": (RawMLP, lambda: torch.randn(5, 7, 4)),
    "attention": (RawAttention, lambda: torch.randn(5, 4, 5)),
    "forms": (Forms, lambda: torch.randn(5, 3)),
    "keywords": (Keywords, lambda: torch.randn(5, 3)),
    "flattened": (Flattened, lambda: torch.randn(5, 3, 4)),
}


def _net(kind):
    torch.manual_seed(0)
    make, X = NETS[kind]
    return make().double(), X().double()


@pytest.mark.parametrize("kind", sorted(NETS))
def test_raw_matrix_products_run_on_the_linear_rule(kind):
    # Each of these went to the torch.func fallback (the s49 trial's LoRA: "A, B
    # fallback"); the capture now covers every raw parameter with a factored term.
    module, X = _net(kind)
    assert [(r.name, r.route) for r in layer_routes(module, X) if r.route != "rule"] == []
    params = _params(module)
    cap = capture(module, params, X, [0], memory_budget=2**22)
    assert cap.fallback == ()
    # The products' weights keep their factors (an input), not a formed gradient.
    factored = {name for t in cap.terms for name, a in t.inputs if a is not None}
    weights = {n for n, p in params.items() if p.ndim == 2 and n != "head.weight"}
    if kind == "forms":
        weights.discard("G")  # read by a product and elementwise: formed and summed
    if kind == "tied":
        weights -= {"W", "U"}  # read in both orientations: formed and summed
    if kind == "flattened":
        weights -= {"W3", "g"}  # W3 in both orientations; g an elementwise gain
    assert weights <= factored, weights - factored


@pytest.mark.parametrize("kind", sorted(NETS))
def test_raw_matrix_products_match_the_dense_jacobian(kind):
    module, X = _net(kind)
    torch.manual_seed(1)
    params = {k: v + 0.1 * torch.randn_like(v) for k, v in _params(module).items()}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in params:
                p.copy_(params[name])
    J = jacobian_loop(module, X)
    Y = X[:3] * 0.5
    JY = jacobian_loop(module, Y)
    full = torch.einsum("ncp,mdp->ncmd", J, JY)
    _close(tangent_gram(module, params, X, Y, output="full"), full)
    _close(tangent_gram(module, params, X, Y), torch.einsum("ncmc->nm", full) / J.shape[1])
    for c in range(J.shape[1]):
        _close(tangent_gram(module, params, X, Y, output=c), full[:, c, :, c])
    _close(tangent_features(module, params, X, output="full"), J)
    # The rule's own factors, without the autograd check of a few samples that would
    # send a wrong site to the fallback (exact, but hiding the rule's error).
    _close(tangent_features(module, params, X, output="full", check_hidden=False), J)


def _lora_factory(n_features_in, n_outputs):
    torch.manual_seed(0)
    return LoRANet(n_features_in, n_outputs)


def _attention_factory(n_features_in, n_outputs):
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (4, 5)), RawAttention(5, n_outputs))


@pytest.mark.parametrize("factory", [_lora_factory, _attention_factory])
def test_the_path_kernel_over_sgd_steps_matches_the_weighted_sum(factory):
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(6, 20))[:, : 6 if factory is _lora_factory else 20], \
        rng.normal(size=(6, 2))
    est = PathKernelMachine(module=factory, solver="sgd", max_iter=3, batch_size=3,
                            tol=None, dtype="float64", device="cpu", random_state=0).fit(X, y)
    traj = est.trajectory_
    ref = 0.0
    for k, w in path_weights(traj):
        J = jacobian_loop(module_at(est, k), X)
        assert traj.preconditioner(k) is None  # plain SGD: the Euclidean metric
        ref = ref + w * torch.einsum("ncp,mdp->nmcd", J, J)
    _close(PathKernel(est, output="full")(X), ref)
    _close(PathKernel(est)(X), torch.einsum("nmcc->nm", ref) / 2)


# ------------------------------------------------------------------- still the fallback
class Read(nn.Module):
    """A raw ``P`` read by one product that is not a linear map's weight on samples."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.P = nn.Parameter(torch.randn(4, 4) / 2)
        self.P3 = nn.Parameter(torch.randn(3, 4, 4) / 2)
        self.head = nn.Linear(4, 2)
        self.register_buffer("c", torch.randn(1, 4))

    def forward(self, x):  # x (n, 3, 4)
        if self.read == "left":
            h = (self.P @ x.mT).mT
        elif self.read == "batched":
            h = (x.unsqueeze(1) @ self.P3).mean(1)
        elif self.read == "einsum":
            h = torch.einsum("nli,io->nlo", x, self.P)
        elif self.read == "no_grad":
            with torch.no_grad():
                h = x @ self.P
            h = h + x
        elif self.read == "slice":
            h = x[..., :3] @ self.P[:3]
        elif self.read == "rows":
            h = (x.transpose(0, 1) @ self.P).transpose(0, 1)
        elif self.read == "transposed_elementwise":  # P.T is watched for products only
            h = (x.unsqueeze(-1) * self.P.T).sum(-1)
        elif self.read == "broadcast_constant_bias":  # the transposed rule's expand declines
            h = torch.addmm(self.c, x.reshape(-1, 4), self.P).view(x.shape)
        elif self.read == "flat_copy":  # reshape copies: its rows' owners are not seen
            h = F.linear(x.transpose(1, 2).reshape(-1, 4), self.P).view(x.shape)
        elif self.read == "scaled":  # addmm's alpha=2, by keyword: no Linear site
            h = torch.addmm(self.c[0], x.reshape(-1, 4), self.P, alpha=2).view(x.shape)
        elif self.read == "flat_bias":  # a bias on rows from a copy (as flat_copy's)
            h = (x.transpose(1, 2).reshape(-1, 4) + self.P[0]).view(x.shape)
        elif self.read == "flat_rows":  # rows kept flat through tanh: their owners unseen
            h = (torch.tanh(x.reshape(-1, 4)) @ self.P).view(x.shape)
        elif self.read == "out":  # a keyword that is no argument of a site
            h = torch.matmul(x, self.P, out=None)
        return self.head(torch.tanh(h).mean(1))


FALLBACK = {"left": ("P", PRODUCT_LEFT), "batched": ("P3", PRODUCT_SHAPE),
            "einsum": ("P", None), "no_grad": ("P", PRODUCT_NO_GRAD),
            "slice": ("P", PRODUCT_VIEW),
            "rows": ("P", "the rows of its input are not the samples"),
            "transposed_elementwise": ("P", None),
            "broadcast_constant_bias": ("P", PRODUCT_OTHER),
            "flat_copy": ("P", "the rows of its input are not the samples"),
            "scaled": ("P", PRODUCT_OTHER), "out": ("P", PRODUCT_OTHER),
            "flat_bias": ("P", FREE_UNSTRUCTURED),
            "flat_rows": ("P", "the rows of its input are not the samples")}


@pytest.mark.parametrize("read", sorted(FALLBACK))
def test_other_reads_fall_back_exactly_with_their_reason(read):
    torch.manual_seed(0)
    module = Read(read).double()
    X = torch.randn(5, 3, 4, dtype=torch.float64)
    name, why = FALLBACK[read]
    used = {n for n, p in module.named_parameters()
            if n in ("P", "P3", "head.weight", "head.bias")}
    params = {k: v.detach() for k, v in module.named_parameters() if k in used}
    if read != "batched":
        params.pop("P3")
    else:
        params.pop("P")
    cap = capture(module, params, X, [0, 1], memory_budget=2**22)
    assert name in cap.fallback
    (route,) = [r for r in layer_routes(module, X, params=params) if r.route == "fallback"]
    assert route.name == ""
    if why is None:  # no product at all: the holder's own reason
        assert "no rule" in route.reason or "raw nn.Parameter" in route.reason, route.reason
    else:
        assert route.reason == why, route.reason
    # Exact all the same (the fallback's Jacobians), against the loop.
    for p in module.parameters():
        p.requires_grad_(False)
    for k in params:
        module.get_parameter(k).requires_grad_(True)
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class _MaskedLoRA(LoRA):
    """A value read into Python (mask code's branch) before ``self.A.T``: a transpose
    takes no bounds from the data, so it stays a site (a slice taken then would not)."""

    def forward(self, x):
        if bool((x != 0).all()):
            x = x * 1.0
        return super().forward(x)


def test_a_transpose_after_a_value_read_stays_a_site():
    torch.manual_seed(0)
    module = nn.Sequential(_MaskedLoRA(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    X = torch.randn(5, 4, dtype=torch.float64)
    assert [r.route for r in layer_routes(module, X)] == ["rule", "rule"]
    params = _params(module)
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class _BroadcastBias(nn.Module):
    """F.linear with a raw bias that it broadcasts (shape (1,) or (1, out)): the rule's
    bias term has one entry per output feature, so the call falls back (it raised a
    ValueError, "gives 'b' 4 gradient entries per output, but the parameter has 1")."""

    def __init__(self, shape):
        super().__init__()
        self.P = nn.Parameter(torch.randn(4, 3) / 2)
        self.b = nn.Parameter(torch.randn(shape))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.P, self.b)))


@pytest.mark.parametrize("shape", [(1,), (1, 4)])
def test_a_broadcast_bias_falls_back_exactly(shape):
    torch.manual_seed(0)
    module = _BroadcastBias(shape).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    params = _params(module)
    route = layer_routes(module, X)[0]
    assert (route.route, route.reason) == ("fallback", PRODUCT_SHAPE)
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class _Projections(nn.Module):
    """Attention's q, k, v of one input x, by raw products (x @ Wq, F.linear(x, Wk),
    torch.matmul(x, Wv)), by the same on its rows flattened, or by nn.Linear layers of the
    same shapes."""

    def __init__(self, read, d=4):
        super().__init__()
        self.read = read
        lin = [nn.Linear(d, d, bias=False) for _ in range(3)]
        if read != "layers":
            self.Wq, self.Wk, self.Wv = (nn.Parameter(m.weight.detach().clone()) for m in lin)
        else:
            self.q, self.k, self.v = lin

    def forward(self, x):
        if self.read == "raw":
            q, k, v = x @ self.Wq.T, F.linear(x, self.Wk), torch.matmul(x, self.Wv.T)
        elif self.read == "flat":
            rows = x.reshape(-1, x.shape[-1])
            q, k, v = (F.linear(rows, self.Wq).view(x.shape), (rows @ self.Wk.T).view(x.shape),
                       torch.matmul(rows, self.Wv.T).view(x.shape))
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(q @ k.mT, dim=-1)
        return (att @ v).mean(1)


@pytest.mark.parametrize("copy_sites", [False, True])
def test_raw_products_hold_what_linear_layers_hold(copy_sites):
    # The engine hands sites on uncopied (capture's copy_sites=False); the raw products
    # copied their outputs all the same (s54: F.linear's site, and x @ P through the
    # transposed rule's expand), q, k and v held twice by the graph (the sites and the
    # copies that q @ k.mT and att @ v save). Now as nn.Linear's: the same graph bytes,
    # also for products on flattened rows (s55: F.linear's fell back, x @ P's copied),
    # their sites viewed back.
    torch.manual_seed(0)
    X = torch.randn(6, 5, 4, dtype=torch.float64)
    held = {}
    for read in ("raw", "flat", "layers"):
        torch.manual_seed(0)
        module = _Projections(read).double()
        cap = capture(module, _params(module), X, [0, 1], memory_budget=2**22,
                      measure_graph=True, copy_sites=copy_sites)
        assert cap.fallback == ()
        held[read] = cap.graph_bytes
        # x is read by the three products: their terms hold it, not copies of it.
        inputs = {a.untyped_storage().data_ptr() for t in cap.terms for _, a in t.inputs
                  if a is not None}
        assert len(inputs) == 1
    assert held["raw"] == held["flat"] == held["layers"]


class _InPlace(nn.Module):
    """Raw products' and elementwise reads' outputs rewritten in place downstream (relu_,
    +=, mul_, add_): the sites the engine hands on uncopied must then be copied (the
    capture's version check) for the backprops to be the sites'."""

    def __init__(self):
        super().__init__()
        self.W, self.b = nn.Parameter(torch.randn(5, 4) / 2), nn.Parameter(torch.randn(5))
        self.V = nn.Parameter(torch.randn(4, 5) / 2)
        self.pos, self.gamma = nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(5))
        self.U, self.c = nn.Parameter(torch.randn(5, 4) / 2), nn.Parameter(torch.randn(5))
        self.L, self.e = nn.Parameter(torch.randn(5, 4) / 2), nn.Parameter(torch.randn(5))
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        n, s, d = x.shape
        h = F.linear(x, self.W, self.b).relu_()
        u = x @ self.V
        u += 1.0
        h = h + self.pos  # elementwise sites, rewritten in place too
        h.mul_(0.5)
        g = self.gamma * h
        # Sites run per sample on flattened rows, handed on as views of them.
        r = F.linear(x.view(-1, d), self.U).relu_()
        r = (r + self.c).tanh_().view(n, s, -1)
        # F.linear with a bias on 3-D rows returns a view of addmm's output (torch 2.13):
        # the flattened rows' output is a view of that view's base, not of the site.
        e = F.linear(x.view(-1, d), self.L, self.e).relu_().view(n, s, -1)
        return self.head(torch.tanh(g.add_(u) + r + e).mean(1))


def test_a_raw_product_rewritten_in_place_is_exact():
    torch.manual_seed(0)
    module = _InPlace().double()
    X = torch.randn(5, 3, 4, dtype=torch.float64)
    assert [r.route for r in layer_routes(module, X)] == ["rule", "rule"]
    params = _params(module)
    cap = capture(module, params, X, [0], memory_budget=2**22, copy_sites=False)
    assert cap.copied and cap.fallback == ()
    J = jacobian_loop(module, X)
    full = torch.einsum("ncp,mdp->ncmd", J, J)
    _close(tangent_gram(module, params, X, output="full"), full)
    _close(tangent_gram(module, params, X), torch.einsum("ncmc->nm", full) / 2)
    _close(tangent_features(module, params, X, output="full", check_hidden=False), J)


class _TimeMajor(nn.Module):
    """Rows flattened position-major (RNN-style code: ``x.transpose(0, 1)`` made
    contiguous, or that viewed as ``(n, s, d)`` and cloned, a tensor whose first axis is n
    but whose blocks mix the samples), read by ``x @ W``, ``F.linear`` and a bias on the rows,
    then viewed back per sample: the rows' count can equal the samples' (``s == n``), which
    the capture's row check alone cannot tell from sample-major rows (s55 review)."""

    def __init__(self, kind, d=3):
        super().__init__()
        self.kind = kind
        self.W, self.b = nn.Parameter(torch.randn(d, 5) / 2), nn.Parameter(torch.randn(5))
        self.U = nn.Parameter(torch.randn(5, d) / 2)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        n, s, d = x.shape
        if self.kind == "relabelled":
            rows = x.transpose(0, 1).contiguous().view(n, s, d).clone().view(-1, d)
        else:
            rows = x.transpose(0, 1).contiguous().view(-1, d)
        h = torch.tanh(rows @ self.W + self.b) + torch.tanh(F.linear(rows, self.U))
        return self.head(h.view(s, n, -1).transpose(0, 1)).mean(1)


@pytest.mark.parametrize("kind", ["time_major", "relabelled"])
@pytest.mark.parametrize("n", [3, 4])
def test_position_major_rows_are_exact(kind, n):
    # s == n == 4 also equals the check's cycle of rows (x0, x1, xl, x0): the rows pass
    # the row check there, and the autograd check has to send W, b, U to the fallback.
    torch.manual_seed(0)
    module = _TimeMajor(kind).double()
    X = torch.randn(n, n if kind == "time_major" else 3, 3, dtype=torch.float64)
    params = _params(module)
    J = jacobian_loop(module, X)
    Y = X[:2] * 0.5
    full = torch.einsum("ncp,mdp->ncmd", J, jacobian_loop(module, Y))
    _close(tangent_gram(module, params, X, Y, output="full"), full)
    _close(tangent_features(module, params, X, output="full"), J)
    routes = {r.name: r for r in layer_routes(module, X)}
    assert routes[""].route == "fallback" and routes["head"].route == "rule"
