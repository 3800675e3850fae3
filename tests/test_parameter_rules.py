"""Raw parameters in elementwise additions, products and expands: the parameter rules.

Networks people train now (a vision transformer with a class token, a position
embedding and LayerScale gains; a ResNet) must run on rules only, with tangent features,
Grams and path kernels equal to an independent reference: per-sample Jacobians from a
plain autograd loop (tests/_reference.py), contracted here.
"""

import numpy as np
import pytest
import torch
from _reference import jacobian_loop, module_at
from torch import nn

import skpathkernel._tangent._gram as gram_module
from skpathkernel import PathKernelClassifier, PathKernelMachine, PathRecorder, TangentKernel
from skpathkernel._tangent import capture, tangent_features, tangent_gram, tangent_gram_diag
from skpathkernel.kernels import PathKernel, path_weights
from skpathkernel.rules import layer_routes

RTOL = 1e-10


def _close(a, b, rtol=RTOL):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
    assert err <= rtol, err


# ----------------------------------------------------------------------- networks
class Block(nn.Module):
    """A pre-norm encoder block written by hand, with LayerScale gains as raw
    parameters (CaiT): ``x + gamma * attn(norm(x))``, ``x + gamma * mlp(norm(x))``."""

    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma1 = nn.Parameter(torch.full((d,), 0.5))
        self.gamma2 = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.gamma1 * self.attn(h, h, h, need_weights=False)[0]
        return x + self.gamma2 * self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch-embedding convolution, a class token (``expand`` then ``torch.cat``), a
    position embedding added, a hand-written block and a pre-norm
    ``nn.TransformerEncoderLayer``, the class token's features to the head. With
    ``spare`` rows the position embedding has room for more tokens than it is given,
    and is read through ``self.pos_embed[:, :x.shape[1]]``."""

    def __init__(self, n_outputs=3, d=8, patch=4, side=8, spare=0):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        n_tokens = (side // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, n_tokens + spare, d) * 0.5)
        self.block = Block(d, 2)
        self.encoder = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True,
                                                  norm_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_outputs)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + (self.pos_embed[:, :x.shape[1]] if self.pos_embed.shape[1] > x.shape[1]
                 else self.pos_embed)
        x = self.encoder(self.block(x))
        return self.head(self.norm(x[:, 0]))


class Residual(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """Residual blocks, BatchNorm (in eval mode), global average pooling."""

    def __init__(self, n_outputs=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(4), nn.ReLU())
        self.layers = nn.Sequential(Residual(4, 4, 1), Residual(4, 8, 2))
        self.fc = nn.Linear(8, n_outputs)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _eval_resnet():
    torch.manual_seed(1)
    net = ResNet().double()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return net.eval()


def _vit():
    torch.manual_seed(0)
    return ViT().double().eval()


NETWORKS = {"vit": _vit, "resnet": _eval_resnet}


def _params(module):
    return {k: v.detach() for k, v in module.named_parameters()}


# ----------------------------------------------------------------------- Grams
@pytest.mark.parametrize("kind", sorted(NETWORKS))
def test_network_runs_on_rules_only(kind):
    module = NETWORKS[kind]()
    X = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    routes = layer_routes(module, X)
    assert [r for r in routes if r.route != "rule"] == []
    assert sum(r.n_params for r in routes) == sum(p.numel() for p in module.parameters())
    assert capture(module, _params(module), X, [0, 1, 2], memory_budget=2**24).fallback == ()


@pytest.fixture
def captured_rows(monkeypatch):
    """The rows of every capture the Gram runs: a small budget captures fewer at once."""
    rows = []
    original = gram_module.capture

    def spy(module, params, X, *args, **kwargs):
        rows.append(X.shape[0])
        return original(module, params, X, *args, **kwargs)

    monkeypatch.setattr(gram_module, "capture", spy)
    return rows


@pytest.mark.parametrize("kind", sorted(NETWORKS))
@pytest.mark.parametrize("budget", [2**30, 2**22])
def test_gram_matches_dense_jacobians(kind, budget, captured_rows, monkeypatch):
    # No floor on a capture's rows, and the eighth of the budget for a chunk (not what
    # the kept blocks leave, the CPU's wide chunks): the small budget then splits these
    # 7 rows.
    monkeypatch.setattr(gram_module, "MIN_CHUNK", 1)
    monkeypatch.setattr(gram_module, "_wide_chunks", lambda device: False)
    module = NETWORKS[kind]()
    X = torch.randn(7, 3, 8, 8, dtype=torch.float64)
    Y = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    params = _params(module)
    JX, JY = jacobian_loop(module, X), jacobian_loop(module, Y)
    kw = dict(memory_budget=budget)
    _close(tangent_features(module, params, X, output="full", **kw), JX)
    captured_rows.clear()
    _close(tangent_gram(module, params, X, output="full", **kw),
           torch.einsum("ncp,mdp->ncmd", JX, JX))
    if budget < 2**30:  # blocks (or chunks of a block) of fewer rows than X
        assert max(captured_rows[1:]) < len(X)
    _close(tangent_gram(module, params, X, Y, **kw), torch.einsum("ncp,mcp->nm", JX, JY) / 3)
    # A diagonal preconditioner (Adam's): the parameters' blocks scaled one by one.
    D = torch.rand(JX.shape[2], dtype=torch.float64) + 0.5
    _close(tangent_gram(module, params, X, Y, output=1, diag_weight=D, **kw),
           torch.einsum("np,p,mp->nm", JX[:, 1], D, JY[:, 1]))
    _close(tangent_gram_diag(module, params, X, diag_weight=D, **kw),
           torch.einsum("ncp,p,ncp->n", JX, D, JX) / 3)


def _vit_factory(n_features_in, n_outputs):
    torch.manual_seed(0)
    return ViT(n_outputs)


def test_vit_path_kernel_matches_the_weighted_sum():
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(8, 3, 8, 8)), np.arange(8) % 3
    est = PathKernelClassifier(module=_vit_factory, solver="adam", max_iter=2, batch_size=4,
                               tol=None, dtype="float64", device="cpu",
                               random_state=0).fit(X, y)
    traj = est.trajectory_
    K = PathKernel(est, output="full")(X)
    ref = 0.0
    for k, w in path_weights(traj):
        J = jacobian_loop(module_at(est, k), X)
        D = traj.preconditioner(k)
        ref = ref + w * torch.einsum("ncp,p,mdp->nmcd", J, D, J)
    _close(K, ref)
    _close(PathKernel(est)(X), torch.einsum("nmcc->nm", ref) / 3)


# ----------------------------------------------------------------------- the cases
class Ops(nn.Module):
    """Every registered form, each parameter read once: a + P, P + a, torch.add, a * P,
    P * a, torch.mul, expand, expand_as, broadcast_to; scalars and full-shape P too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        g = torch.Generator().manual_seed(0)
        shapes = dict(p1=(4,), p2=(1, 4), p3=(2, 4), m1=(4,), m2=(), m3=(1, 2, 1),
                      e1=(1, 1, 4), e2=(2, 1), e3=(1, 2, 4), a3=(4,))
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g)))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))[:, None, :].expand(-1, 2, -1)   # (n, 2, 4)
        h = torch.tanh(h + self.p1)
        h = torch.tanh(self.p2 + h)
        h = torch.tanh(torch.add(h, self.p3))
        h = torch.tanh(h * self.m1)
        h = torch.tanh(self.m2 * h)
        h = torch.tanh(torch.mul(h, self.m3))
        h = h + self.e1.expand(x.shape[0], -1, -1)
        h = h * self.e2.expand_as(h[:, :, :1])
        h = torch.tanh(h + torch.broadcast_to(self.e3, h.shape))
        h = torch.tanh(torch.add(self.a3, h))
        return self.head(h.reshape(x.shape[0], -1))


class Unstructured(nn.Module):
    """Raw parameters that must fall back: read through ``alpha=``, by an operation
    without a rule, expanded to rows that are not the samples (``twice``, read by two
    registered operations, is structured: its two sites' gradients are summed)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.twice = nn.Parameter(torch.randn(4))
        self.alpha = nn.Parameter(torch.randn(4))
        self.power = nn.Parameter(torch.rand(4) + 1)
        self.rows = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        h = torch.tanh(h * self.twice) + self.twice
        h = torch.tanh(torch.add(h, self.alpha, alpha=2.0))
        h = (h * h + 1).pow(self.power)
        return self.head(h + self.rows.expand(3, 4).sum(0))


def _perturbed_on_rules(module, X):
    """Perturbed parameters, checked to run on rules alone, and written into ``module``
    so that the loop reference differentiates the same network."""
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    assert capture(module, params, X, [0, 1], memory_budget=2**20).fallback == ()
    assert {r.route for r in layer_routes(module, X, params=params)} == {"rule"}
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(params[name])
    return params


class _ReadTwice(nn.Module):
    """Raw parameters each read by two registered operations: a gain (``*`` then ``+``)
    and a class token (expanded to the rows, then added to every position)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.gain = nn.Parameter(torch.randn(4))
        self.token = nn.Parameter(torch.randn(1, 1, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x)).unsqueeze(1).expand(-1, 2, -1)
        h = torch.tanh(h * self.gain) + self.gain
        h = torch.cat([self.token.expand(x.shape[0], -1, -1), h], 1) + self.token
        return self.head(torch.tanh(h).mean(1))


def test_a_raw_parameter_read_twice_is_summed_over_its_sites():
    # Read by two registered operations, it went to the fallback: each read is a site,
    # and its per-sample gradient the sum of the two sites'.
    torch.manual_seed(0)
    module = _ReadTwice().double()
    X, Y = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    params = _perturbed_on_rules(module, X)
    JX, JY = jacobian_loop(module, X), jacobian_loop(module, Y)
    _close(tangent_features(module, params, X, output="full"), JX)
    _close(tangent_gram(module, params, X, Y, output="full"), torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", JX, JX) / 2)


def test_unstructured_raw_parameters_fall_back_exactly():
    torch.manual_seed(0)
    module = Unstructured().double()
    X = torch.randn(5, 3, dtype=torch.float64)
    params = _params(module)
    cap = capture(module, params, X, [0, 1], memory_budget=2**20)
    assert set(cap.fallback) == {"alpha", "power", "rows"}
    (route,) = [r for r in layer_routes(module, X) if r.route == "fallback"]
    assert (route.name, route.n_params) == ("", 16)
    J = jacobian_loop(module, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


# ----------------------------------------------------------------------- sliced reads
class CausalAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        n, L, d = x.shape
        q, k, v = self.qkv(x).reshape(n, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(h.transpose(1, 2).reshape(n, L, d))


class SlicedGPT(nn.Module):
    """Token embedding plus ``self.pos_embed[:L]`` (a (block_size, d) table longer than the
    sequences), one pre-norm causal block, the last token's logits. ``read`` picks the
    read of the position table: ``"slice"``, ``"narrow"``, ``"step"`` (every other row),
    ``"int"`` (the slice plus row ``L``, two views of one table), or those that must fall
    back: ``"index"`` (advanced indexing by a tensor of positions), ``"view"`` (a slice
    of a slice), ``"value"`` (a bound read from the ids' values) and ``"numpy"`` (the same
    bound read through NumPy)."""

    def __init__(self, read="slice", vocab=11, d=8, block_size=11):
        super().__init__()
        self.read = read
        self.tok = nn.Embedding(vocab, d)
        self.pos_embed = nn.Parameter(torch.randn(block_size, d) * 0.5)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalAttention(d, 2)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        L = ids.shape[1]
        if self.read == "slice":
            pos = self.pos_embed[:L]
        elif self.read == "narrow":
            pos = self.pos_embed.narrow(0, 1, L)
        elif self.read == "step":
            pos = self.pos_embed[1:2 * L:2]
        elif self.read == "int":
            pos = self.pos_embed[:L]
        elif self.read == "view":
            pos = self.pos_embed[:L + 1][1:]
        elif self.read == "value":
            pos = self.pos_embed[:int((ids >= 0).sum(1).max())]
        elif self.read == "numpy":
            pos = self.pos_embed[:int((ids >= 0).sum(1).max().numpy())]
        else:
            pos = self.pos_embed[torch.arange(L, device=ids.device)]
        x = self.tok(ids) + pos
        if self.read == "int":
            x = x + self.pos_embed[L]
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(x[:, -1])


def _sliced_vit():
    torch.manual_seed(0)
    return ViT(spare=4).double().eval(), torch.randn(6, 3, 8, 8, dtype=torch.float64)


def _sliced_gpt(read="slice"):
    torch.manual_seed(0)
    return SlicedGPT(read).double().eval(), torch.randint(0, 11, (6, 5))


def _one_point(module):
    """``module`` at its parameters as a one-point recorded path (the public route for
    a network trained elsewhere)."""
    return PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator()


SLICED = {"vit": _sliced_vit, "gpt": _sliced_gpt,
          **{f"gpt-{read}": lambda read=read: _sliced_gpt(read)
             for read in ("narrow", "step", "int")}}


@pytest.mark.parametrize("kind", sorted(SLICED))
def test_a_position_embedding_read_through_a_slice_runs_on_its_rule(kind):
    # x + self.pos[:, :L] went to the fallback: the slice is a view of the parameter,
    # read by a registered +, whose gradient lands in the view's rows (zero in the rest).
    module, X = SLICED[kind]()
    # Fewer positions than the table has rows: the rows past them have zero gradient.
    tokens = X.shape[1] if X.ndim == 2 else 5
    assert module.pos_embed.shape[-2] > tokens
    routes = layer_routes(module, X)
    assert [r for r in routes if r.route != "rule"] == []
    assert sum(r.n_params for r in routes) == sum(p.numel() for p in module.parameters())
    params = _params(module)
    assert capture(module, params, X, [0, 1, 2], memory_budget=2**24).fallback == ()
    J = jacobian_loop(module, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    net = _one_point(module)
    _close(TangentKernel(net)(X.numpy()), torch.einsum("ncp,mcp->nm", J, J) / 3)
    _close(TangentKernel(net, output="full")(X.numpy()), torch.einsum("ncp,mdp->nmcd", J, J))


@pytest.mark.parametrize("read", ["index", "view", "value", "numpy"])
def test_a_position_table_read_otherwise_falls_back_exactly(read):
    # Advanced indexing (self.pos[idx]) copies the rows it reads, a view of a view is not
    # one the rule follows, and a bound computed from the data may differ per block: the
    # table goes to the fallback, exact.
    module, X = _sliced_gpt(read)
    params = _params(module)
    assert capture(module, params, X, [0, 1, 2], memory_budget=2**24).fallback == ("pos_embed",)
    (route,) = [r for r in layer_routes(module, X) if r.route == "fallback"]
    assert route.n_params == module.pos_embed.numel()
    J = jacobian_loop(module, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(TangentKernel(_one_point(module), output="full")(X.numpy()),
           torch.einsum("ncp,mdp->nmcd", J, J))


class Views(nn.Module):
    """Raw parameters read through basic-indexing views by the registered operations: an
    int and a step (``A[1, ::2]``), ``...`` (``B[..., 1:6]``), ``None`` (``P[None, :4]``),
    a negative dim and start (``E.narrow(-1, -5, 5)``), a view expanded."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 20)
        g = torch.Generator().manual_seed(0)
        shapes = dict(A=(3, 8, 5), B=(4, 7), P=(6, 5), E=(4, 6), T=(2, 1, 5))
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g)))
        self.head = nn.Linear(25, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x)).reshape(-1, 4, 5)
        h = torch.tanh(h + self.A[1, ::2])
        h = torch.tanh(h * self.B[..., 1:6])
        h = torch.tanh(h + self.P[None, :4])
        h = torch.tanh(h + self.E.narrow(-1, -5, 5))
        h = torch.cat([self.T[-1:].expand(x.shape[0], -1, -1), h], 1)
        return self.head(h.reshape(x.shape[0], -1))


@pytest.mark.parametrize("make", [Ops, Views], ids=["registered forms", "basic indices"])
def test_every_form_matches_the_loop(make):
    torch.manual_seed(0)
    module = make().double()
    X = torch.randn(5, 3, dtype=torch.float64)
    params = _perturbed_on_rules(module, X)
    J = jacobian_loop(module, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


class ReshapedGains(nn.Module):
    """Per-channel gains laid out against channels-first activations by a reshape of the
    raw parameter, as timm's ConvNeXt block reads its layer scale
    (``x.mul(self.gamma.reshape(1, -1, 1, 1))``): ``read`` picks ``reshape``, ``view``,
    ``torch.reshape`` (a shape tuple) or ``unsqueeze`` (then a ``(C, 1)`` parameter, the
    gain of a ``(n, C, L)`` sequence)."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.linspace(0.2, 1.1, 4, dtype=torch.float64))
        self.beta = nn.Parameter(torch.linspace(-0.3, 0.3, 4, dtype=torch.float64))
        self.head = nn.Linear(4 * 16, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        if self.read == "reshape":
            h = h.mul(self.gamma.reshape(1, -1, 1, 1)) + self.beta.reshape(1, -1, 1, 1)
        elif self.read == "view":
            h = h * self.gamma.view(-1, 1, 1) + self.beta.view(1, 4, 1, 1)
        elif self.read == "torch.reshape":
            h = torch.mul(h, torch.reshape(self.gamma, (1, -1, 1, 1))) + self.beta[:, None, None]
        else:  # unsqueeze: a (n, C, L) sequence
            h = h.flatten(2) * self.gamma.unsqueeze(-1) + self.beta.unsqueeze(1)
        return self.head(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("read", ["reshape", "view", "torch.reshape", "unsqueeze"])
def test_a_gain_read_through_a_reshape_runs_on_its_rule(read):
    # timm's ConvNeXt gamma, x.mul(self.gamma.reshape(1, -1, 1, 1)), went to the fallback
    # ("a raw nn.Parameter used ... other than in an elementwise +, *"): the reshape is a
    # view holding every entry of the parameter in its order.
    torch.manual_seed(0)
    module = ReshapedGains(read).double().eval()
    X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    routes = layer_routes(module, X)
    assert [r for r in routes if r.route != "rule"] == []
    params = _params(module)
    assert capture(module, params, X, [0, 1, 2], memory_budget=2**24).fallback == ()
    J = jacobian_loop(module, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(TangentKernel(_one_point(module), output="full")(X.numpy()),
           torch.einsum("ncp,mdp->nmcd", J, J))


def test_a_reshape_of_a_slice_or_by_tensor_sizes_falls_back_exactly():
    # A view of a view, and a view whose sizes are tensors, stay on the fallback.
    class Odd(ReshapedGains):
        def forward(self, x):
            h = torch.tanh(self.conv(x))
            size = torch.tensor(-1)
            h = h * self.gamma[:4].reshape(1, -1, 1, 1) + self.beta.reshape(size, 1, 1)
            return self.head(torch.tanh(h).flatten(1))

    torch.manual_seed(0)
    module = Odd("reshape").double().eval()
    X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    params = _params(module)
    fallback = capture(module, params, X, [0, 1, 2], memory_budget=2**24).fallback
    assert set(fallback) == {"gamma", "beta"}
    J = jacobian_loop(module, X)
    _close(tangent_features(module, params, X, output="full"), J)


class _Reads(nn.Module):
    """Raw parameters read through reshapes whose layout is not the broadcast's obvious
    one: a ``(C*H,)`` vector read as ``(C, H, 1)``; a ``(C, H)`` matrix read as ``(H, C)``
    (a reshape, not a transpose: the entries move to other positions); a non-contiguous
    ``(C, H)`` parameter (a transpose's storage) through ``reshape`` and ``unsqueeze``;
    ``unsqueeze(1)`` against ``(n, C, W, H)``; a gain read twice, through a view and
    directly."""

    C, H, W = 3, 4, 2

    def __init__(self, n_outputs=2):
        super().__init__()
        C, H, W = self.C, self.H, self.W
        g = torch.Generator().manual_seed(1)
        self.conv = nn.Conv2d(2, C, 1)
        self.a = nn.Parameter(torch.randn(C, generator=g) * 0.5 + 1)
        self.b = nn.Parameter(torch.randn(C * H, generator=g) * 0.5)
        self.q = nn.Parameter(torch.randn(C, H, generator=g) * 0.5 + 1)
        self.t = nn.Parameter(torch.randn(H, C, generator=g).t() * 0.5)
        self.u = nn.Parameter(torch.randn(C, H, generator=g) * 0.5)
        self.head = nn.Linear(C * H * W, n_outputs)

    def forward(self, x):
        C, H = self.C, self.H
        h = torch.tanh(self.conv(x))                                    # (n, C, H, W)
        h = torch.tanh(h + self.b.reshape(C, H, 1))
        h = (h.permute(0, 3, 2, 1) * self.q.reshape(H, C)).permute(0, 3, 2, 1)
        h = torch.tanh(h * self.t.reshape(1, C, H, 1) + self.t.unsqueeze(-1))
        h = (h.transpose(2, 3) + self.u.unsqueeze(1)).transpose(2, 3)
        h = h * self.a.view(-1, 1, 1) + (h.transpose(1, 3) * self.a).transpose(1, 3)
        return self.head(torch.tanh(h).flatten(1))


def _reads_factory(n_features_in, n_outputs):
    torch.manual_seed(0)
    return _Reads(n_outputs)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_reshaped_reads_match_the_loop_along_a_path(dtype):
    # The reshape/view/unsqueeze reads of 4b3ecc7 (a review of it, s51): features, Gram,
    # the path kernel over a trained path and the exact decomposition, against per-sample
    # autograd, in both precisions.
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(6, 2, 4, 2)), rng.normal(size=6)
    module = _reads_factory(None, 1).to(getattr(torch, dtype))
    Xt = torch.as_tensor(X, dtype=module.a.dtype)
    assert [r.name for r in layer_routes(module, Xt) if r.route != "rule"] == []
    rtol = RTOL if dtype == "float64" else 2e-6
    params = _params(module)
    J = jacobian_loop(module, Xt)
    _close(tangent_features(module, params, Xt, output="full"), J, rtol)
    _close(tangent_gram(module, params, Xt, output="full"), torch.einsum("ncp,mdp->ncmd", J, J),
           rtol)
    est = PathKernelMachine(module=_reads_factory, solver="adam", max_iter=2, batch_size=3,
                            tol=None, dtype=dtype, device="cpu", random_state=0).fit(X, y)
    traj = est.trajectory_
    ref = 0.0
    for k, w in path_weights(traj):
        Jk = jacobian_loop(module_at(est, k), X)
        ref = ref + w * torch.einsum("ncp,p,mcp->nm", Jk, traj.preconditioner(k), Jk)
    _close(PathKernel(est)(X), ref, rtol)
    res = est.decompose(X[:3])
    _close(res.reconstruction, est.predict(X[:3]).reshape(res.reconstruction.shape),
           1e-9 if dtype == "float64" else 1e-4)
