"""The structured tangent engine against an independent per-sample autograd loop."""

import copy
import functools
import gc
import itertools
import math
import re
import threading
import time
import types
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _reference import jacobian_loop
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._nets import ResNet, ViT, _eval_batchnorm
from benchmarks.bench_gpu_choices import LongAttention, cpu_peak_bytes
from skpathkernel import _tangent
from skpathkernel._tangent import (
    _capture,
    _cnn,
    _gram,
    _layers,
    _stacked,
    capture,
    project_tangent_features,
    tangent_features,
    tangent_gram,
    tangent_gram_diag,
)
from skpathkernel.rules import layer_routes

RTOL = 1e-10


# ----------------------------------------------------------------------- modules
def _mlp(n_out):
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(),
                         nn.Linear(6, n_out))


class _RawParameter(nn.Module):
    """A hidden layer scaled by a raw nn.Parameter (no rule for this module itself)."""

    def __init__(self, n_out):
        super().__init__()
        self.lin = nn.Linear(3, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, n_out)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) * self.scale))


class _RawUnstructured(nn.Module):
    """Raw parameters read by a tensordot (no rule; ``x @ mix`` would be a site of the
    Linear rule, ._parameters.product_site) and twice (two elementwise sites, summed)."""

    def __init__(self, n_out):
        super().__init__()
        self.lin = nn.Linear(3, 8)
        self.mix = nn.Parameter(torch.randn(8, 8) / 3)
        self.gain = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, n_out)

    def forward(self, x):
        h = torch.tanh(torch.tensordot(self.lin(x), self.mix, dims=1))
        return self.head(h * self.gain + torch.tanh(h * self.gain))


class _LinearTwice(nn.Module):
    """One Linear applied twice per forward: its hook cannot tell the calls apart."""

    def __init__(self, n_out):
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.shared = nn.Linear(5, 5)
        self.head = nn.Linear(5, n_out)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.head(h)


class _ConvAndSequence(nn.Module):
    """Conv1d on reshaped input and a Linear on 3-D input: rules with positions."""

    def __init__(self, n_out):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 2)
        self.per_position = nn.Linear(2, 3)
        self.head = nn.Linear(6, n_out)

    def forward(self, x):
        h = torch.tanh(self.conv(x.unsqueeze(1)))  # (n, 2, 2)
        h = torch.tanh(self.per_position(h.transpose(1, 2)))  # (n, 2, 3): 3-D input
        return self.head(h.reshape(x.shape[0], -1))


class _ConvTranspose1dSubclass(nn.ConvTranspose1d):
    """nn.ConvTranspose1d's computation without its rule (a subclass overriding forward
    falls back until registered)."""

    def forward(self, x, output_size=None):
        return super().forward(x, output_size)


class _NoRule(nn.Module):
    """A layer without a rule (a ConvTranspose1d subclass): the generic fallback."""

    def __init__(self, n_out):
        super().__init__()
        self.up = _ConvTranspose1dSubclass(1, 2, 2)
        self.head = nn.Linear(8, n_out)

    def forward(self, x):
        h = self.up(x.unsqueeze(1))  # (n, 2, 4)
        return self.head(torch.tanh(h).reshape(x.shape[0], -1))


class _WeightReadOutside(nn.Module):
    """A Linear whose weight is also read by the parent's forward: invisible to hooks."""

    def __init__(self, n_out):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = nn.Linear(3, n_out)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) + 0.5 * x @ self.lin.weight))


MODULES = {"mlp": _mlp, "raw": _RawParameter, "rawother": _RawUnstructured,
           "twice": _LinearTwice,
           "conv": _ConvAndSequence, "norule": _NoRule, "outside": _WeightReadOutside}
FALLBACK = {
    "mlp": set(),
    "raw": set(),  # x * scale: the elementwise parameter rule
    "rawother": {"mix"},  # gain, read twice by *, is the sum of its two sites
    "twice": set(),  # its two calls are two uses, their terms summed
    "conv": set(),
    "norule": {"up.weight", "up.bias"},
    "outside": {"lin.weight", "lin.bias"},
}


def _make(kind, n_out, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    module = MODULES[kind](n_out).to(dtype)
    # Move away from the initialization so that every factor is generic.
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(9, 3, dtype=dtype)
    Y = torch.randn(5, 3, dtype=dtype)
    return module, params, X, Y


def _loop_jacobian(module, params, X):
    """(n, C, P): the autograd loop of tests/_reference.py on a float64 copy at params."""
    return jacobian_loop(_copy_with(module, params), X)


def _copy_with(module, params):
    import copy

    ref = copy.deepcopy(module).to(torch.float64)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
    return ref


def _close(a, b, rtol=RTOL):
    a, b = a.to(torch.float64), b.to(torch.float64)
    assert a.shape == b.shape
    scale = b.abs().max().clamp_min(1e-300)
    assert float((a - b).abs().max() / scale) <= rtol, float((a - b).abs().max() / scale)


# ----------------------------------------------------------------------- features
@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("n_out", [1, 3])
def test_features_match_loop(kind, n_out):
    module, params, X, _ = _make(kind, n_out)
    J = _loop_jacobian(module, params, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_features(module, params, X, output=n_out - 1), J[:, n_out - 1])
    trace = tangent_features(module, params, X)
    if n_out == 1:
        _close(trace, J[:, 0])
    else:
        _close(trace, J.reshape(len(X), -1) / math.sqrt(n_out))


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_fallback_routing(kind):
    module, params, X, _ = _make(kind, 2)
    cap = capture(module, params, X, [0, 1], memory_budget=2**20)
    # Only the parameter that is read outside its layer is found by the use watch.
    assert cap.exclude == ({"lin.weight"} if kind == "outside" else set())
    assert set(cap.fallback) == FALLBACK[kind]
    covered = [name for t in cap.terms for name, _ in t.inputs]
    assert sorted(covered) == sorted(params)


def test_tied_weights_are_summed_over_their_uses():
    # Two Linears sharing a weight (their biases their own) went whole to the fallback:
    # the weight's gradient is the sum of the two uses', one term of joined positions.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    module = nn.Sequential(nn.Linear(3, 4), a, nn.Tanh(), b, nn.Tanh(), nn.Linear(4, 1)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(6, 3, dtype=torch.float64)
    cap = capture(module, params, X, [0], memory_budget=2**20)
    assert cap.fallback == ()
    (weight,) = [t for t in cap.terms if t.inputs[0][0] == "1.weight"]
    assert weight.inputs[0][1] is not None and weight.delta.shape[2] == 2
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X), J[:, 0] @ J[:, 0].T)


def test_inplace_activation_after_linear():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(8, 3, dtype=torch.float64)
    cap = capture(module, params, X, [0, 1], memory_budget=2**20)
    assert cap.fallback == ()
    assert not cap.exclude
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))



class _InPlaceBlock(nn.Module):
    """Conv-BN-ReLU(inplace) twice and ``out += identity``: in-place ops on the outputs
    of rule layers (BatchNorm's), as torchvision's BasicBlock writes them."""

    def __init__(self, inplace=True):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 2, 3, padding=1), nn.BatchNorm2d(2)
        self.relu = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(2 * 4 * 4, 3)
        self.inplace = inplace

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.head(self.relu(out).flatten(1))


@pytest.mark.parametrize("inplace", [True, False])
def test_sites_handed_on_uncopied_unless_rewritten(inplace):
    # The layer outputs are handed on as they are (copy_sites=False) unless an in-place op
    # rewrites one; then the capture reruns with copies and the Gram stays exact.
    torch.manual_seed(0)
    module = _InPlaceBlock(inplace).double()
    for bn in (module.bn1, module.bn2):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    module.eval()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(40, 2, 4, 4, dtype=torch.float64)
    cap = capture(module, params, X, [0, 1, 2], memory_budget=2**20, copy_sites=False)
    assert cap.copied is inplace
    assert cap.fallback == ()
    assert capture(module, params, X, [0], memory_budget=2**20).copied
    J = _loop_jacobian(module, params, X)
    # A small budget: blocks of formed gradients captured in chunks.
    K = tangent_gram(module, params, X, memory_budget=2**20)
    _close(K, torch.einsum("ncp,mcp->nm", J, J) / 3)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


# ----------------------------------------------------------------------- Grams
@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("n_out", [1, 3])
def test_gram_matches_loop(kind, n_out):
    module, params, X, Y = _make(kind, n_out)
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    _close(tangent_gram(module, params, X, Y, output="full"), full)
    _close(tangent_gram(module, params, X, Y, output="trace"),
           torch.einsum("ncmc->nm", full) / n_out)
    _close(tangent_gram(module, params, X, Y, output=-1), full[:, -1, :, -1])
    _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", JX, JX) / n_out)
    _close(tangent_gram_diag(module, params, X),
           torch.einsum("ncp,ncp->n", JX, JX) / n_out)
    _close(tangent_gram_diag(module, params, X, output="full"),
           torch.einsum("ncp,ndp->ncd", JX, JX))


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_cross_parameter_gram_matches_loop(kind):
    """J(X; theta) J(Y; theta')^T with the two sides at different parameters."""
    module, params, X, Y = _make(kind, 2)
    other = {k: v + 0.2 * torch.randn_like(v) for k, v in params.items()}
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, other, Y)
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    _close(tangent_gram(module, params, X, Y, output="full", params_y=other), full)
    # Y omitted: X against itself at the other parameters, not the symmetric shortcut.
    JXo = _loop_jacobian(module, other, X)
    _close(tangent_gram(module, params, X, output="trace", params_y=other),
           torch.einsum("ncp,mcp->nm", JX, JXo) / 2)


@pytest.mark.parametrize("kind", ["mlp", "raw"])
def test_gram_symmetric_psd(kind):
    module, params, X, _ = _make(kind, 2)
    X = torch.cat([X, X[:3] + 1e-3])
    for output in ("trace", 0):
        K = tangent_gram(module, params, X, output=output)
        assert torch.equal(K, K.T)
        eig = torch.linalg.eigvalsh(K)
        assert float(eig.min()) >= -1e-10 * float(eig.max())
    Kf = tangent_gram(module, params, X, output="full").reshape(len(X) * 2, -1)
    assert torch.equal(Kf, Kf.T)
    eig = torch.linalg.eigvalsh(Kf)
    assert float(eig.min()) >= -1e-10 * float(eig.max())


def test_blocks_kept_between_column_blocks(monkeypatch):
    # A budget that holds all factors but not one block of everything: several row
    # blocks, captured once each and reused for every column block.
    module, params, X, _ = _make("mlp", 2)
    X = torch.cat([X] * 4)
    per_row = capture(module, params, X[:1], [0, 1], memory_budget=2**20).nbytes()
    calls, blocks = [], []
    real, real_init = _gram.capture, _gram._Blocks.__init__

    instances = []

    def spy_init(self, *args, **kw):
        real_init(self, *args, **kw)
        blocks.append(len(self.slices))
        instances.append(self)

    # Count block captures only (the one-sample probes of the misfit check are not blocks).
    monkeypatch.setattr(_gram, "capture",
                        lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    monkeypatch.setattr(_gram._Blocks, "__init__", spy_init)
    # check_hidden=False: the autograd check's own two-row capture is not a block.
    K = tangent_gram(module, params, X, memory_budget=2 * per_row * len(X) + 64,
                     check_hidden=False)
    assert blocks[0] > 2
    # Recomputing would capture n + n (n - 1) / 2 blocks; keeping captures each once.
    assert sum(rows > 1 for rows in calls) == blocks[0]
    calls.clear()
    _close(K, tangent_gram(module, params, X, check_hidden=False), 1e-13)
    assert sum(rows > 1 for rows in calls) == 1  # one block
    # A cross Gram keeps the column blocks (visited once per row block), not the rows.
    calls.clear()
    Y = X[:24] + 0.5
    K = tangent_gram(module, params, X, Y, memory_budget=2 * per_row * (len(X) + len(Y)) + 64,
                     check_hidden=False)
    n_rows, n_cols = blocks[-2], blocks[-1]
    assert n_rows > 2 and n_cols > 1
    assert sum(rows > 1 for rows in calls) == n_rows + n_cols
    assert len(instances[-2]._cache) == 0 and len(instances[-1]._cache) == n_cols
    _close(K, tangent_gram(module, params, X, Y), 1e-13)


def _at_smallest_budget(fn, *args, **kw):
    """Call fn with the smallest memory budget it accepts: one-sample blocks.

    A budget below one sample's needs is refused up front with the bytes it needs; raise
    the budget to what each refusal names until the call runs.
    """
    budget = 1
    while True:
        try:
            return fn(*args, memory_budget=budget, **kw)
        except ValueError as exc:
            found = re.search(r"needs ([\d,]+) bytes for a single sample", str(exc))
            if found is None:
                raise
            need = int(found.group(1).replace(",", ""))
            assert need > budget  # each refusal asks for more than it was given
            budget = need


@pytest.mark.parametrize("kind", ["mlp", "conv", "norule"])
@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_equals_unchunked(kind, weighted, monkeypatch):
    module, params, X, Y = _make(kind, 2)
    D = None
    if weighted:
        n_params = sum(p.numel() for p in params.values())
        D = torch.rand(n_params, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    blocks = []
    real = _gram._Blocks.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        blocks.append(len(self.slices))

    monkeypatch.setattr(_gram._Blocks, "__init__", spy)
    # The fallback at one row per block is slow: it checks "full" only.
    for output in ("trace", "full") if kind != "norule" else ("full",):
        kw = dict(output=output, diag_weight=D)
        for Z in (None, Y):
            big = tangent_gram(module, params, X, Z, **kw)
            small = _at_smallest_budget(tangent_gram, module, params, X, Z, **kw)
            _close(small, big, 1e-13)
        _close(_at_smallest_budget(tangent_gram_diag, module, params, X, **kw),
               tangent_gram_diag(module, params, X, **kw), 1e-13)
    _close(_at_smallest_budget(tangent_features, module, params, X),
           tangent_features(module, params, X), 1e-13)
    # The tiny budget really split the rows into blocks of one sample.
    assert max(blocks) == len(X)


@pytest.mark.parametrize("solver_like", ["adam", "rmsprop"])
@pytest.mark.parametrize("kind", ["mlp", "raw"])
def test_preconditioned_gram(kind, solver_like):
    module, params, X, Y = _make(kind, 2)
    # The diagonal preconditioners of Adam / RMSprop: 1 / (sqrt(v) + eps), v > 0.
    v = {k: torch.rand_like(p) ** 4 for k, p in params.items()}
    D = torch.cat([1.0 / (v[k].sqrt() + 1e-8).reshape(-1) for k in params])
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    full = torch.einsum("ncp,p,mdp->ncmd", JX, D, JY)
    _close(tangent_gram(module, params, X, Y, output="full", diag_weight=D), full)
    _close(tangent_gram(module, params, X, Y, diag_weight=D), torch.einsum("ncmc->nm", full) / 2)
    _close(tangent_gram(module, params, X, diag_weight=D),
           torch.einsum("ncp,p,mcp->nm", JX, D, JX) / 2)
    _close(tangent_gram_diag(module, params, X, output="full", diag_weight=D),
           torch.einsum("ncp,p,ndp->ncd", JX, D, JX))
    _close(tangent_gram_diag(module, params, X, output=1, diag_weight=D),
           torch.einsum("np,p,np->n", JX[:, 1], D, JX[:, 1]))


@pytest.mark.parametrize("kind", ["mlp", "conv", "norule"])
def test_preconditioned_gram_with_negative_weights(kind):
    # No square root of D: the blocks are scaled at every product instead of once.
    module, params, X, Y = _make(kind, 2)
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    D = torch.randn(JX.shape[2], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _close(tangent_gram(module, params, X, Y, output="full", diag_weight=D),
           torch.einsum("ncp,p,mdp->ncmd", JX, D, JY))
    _close(tangent_gram(module, params, X, diag_weight=D),
           torch.einsum("ncp,p,mcp->nm", JX, D, JX) / 2)


def test_float32_close_to_float64():
    module, params, X, Y = _make("mlp", 2)
    K64 = tangent_gram(module, params, X, Y)
    p32 = {k: v.float() for k, v in params.items()}
    K32 = tangent_gram(module.float(), p32, X.float(), Y.float())
    assert K32.dtype == torch.float32
    _close(K32, K64, 1e-5)


def test_bad_arguments():
    module, params, X, _ = _make("mlp", 2)
    with pytest.raises(ValueError, match="output"):
        tangent_gram(module, params, X, output="sum")
    with pytest.raises(ValueError, match="out of range"):
        tangent_gram(module, params, X, output=2)
    with pytest.raises(ValueError, match="diag_weight"):
        tangent_gram(module, params, X, diag_weight=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="n_components"):
        project_tangent_features(module, params, X, 0)


# ----------------------------------------------------------------------- projection
def _relative_error(module, params, X, k, seed, output="trace"):
    z = project_tangent_features(module, params, X, k, random_state=seed, output=output)
    if output == "full":
        est = torch.einsum("nck,mdk->ncmd", z, z)
    else:
        est = z @ z.T
    K = tangent_gram(module, params, X, output=output)
    return float((est - K).norm() / K.norm())


@pytest.mark.parametrize("kind", ["mlp", "raw"])
@pytest.mark.parametrize("output", ["trace", "full", 1])
def test_projection_converges(kind, output):
    module, params, X, _ = _make(kind, 2)
    errors = {k: sum(_relative_error(module, params, X, k, s, output) for s in range(3)) / 3
              for k in (16, 4096)}
    assert errors[4096] < 0.08
    # Monte-Carlo error decays like 1 / sqrt(k): 16x from k=16 to k=4096, allow 4x.
    assert errors[4096] < errors[16] / 4


def test_projection_is_seeded_and_budget_independent():
    module, params, X, _ = _make("raw", 2)
    a = project_tangent_features(module, params, X, 64, random_state=3)
    b = _at_smallest_budget(project_tangent_features, module, params, X, 64, random_state=3)
    c = project_tangent_features(module, params, X, 64, random_state=4)
    _close(b, a, 1e-13)
    assert torch.equal(a, project_tangent_features(module, params, X, 64, random_state=3))
    assert not torch.allclose(a, c)


def test_projection_never_forms_jacobian_for_linear_nets(monkeypatch):
    module, params, X, _ = _make("mlp", 2)
    expected = project_tangent_features(module, params, X, 32, random_state=0)

    def boom(*args, **kwargs):
        raise AssertionError("dense per-sample gradients were formed")

    monkeypatch.setattr(_capture, "per_sample_jacobian", boom)
    monkeypatch.setattr(_gram, "dense_grad", boom)
    monkeypatch.setattr(_tangent, "tangent_features", boom)
    monkeypatch.setattr(_gram, "tangent_features", boom)
    got = project_tangent_features(module, params, X, 32, random_state=0)
    assert torch.equal(got, expected)
    # The same guard does catch the dense route when a layer needs it.
    module, params, X, _ = _make("rawother", 2)
    with pytest.raises(AssertionError, match="dense"):
        project_tangent_features(module, params, X, 32, random_state=0)


class _SwitchableReuse(torch.nn.Module):
    """A weight read outside its layer's call, only once ``reuse`` is switched on."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(3, 5)
        self.l2 = torch.nn.Linear(5, 1)
        self.reuse = False

    def forward(self, x):
        out = self.l2(torch.tanh(self.l1(x)))
        if self.reuse:
            out = out + (x @ self.l1.weight.T).sum(1, keepdim=True)
        return out


def test_misfit_check_sees_a_module_changed_between_calls():
    torch.manual_seed(0)
    module = _SwitchableReuse().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(6, 3, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X), J[:, 0] @ J[:, 0].T)
    module.reuse = True  # same names and shapes, different use of l1.weight
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X), J[:, 0] @ J[:, 0].T)


class _ReuseOnPositiveInputs(torch.nn.Module):
    """The extra use of l1.weight has zero gradient on samples with x[0] < 0."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(3, 5)
        self.l2 = torch.nn.Linear(5, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) + torch.relu(x[:, :1]) * self.l1.weight.sum()


def test_misfit_check_is_not_fooled_by_the_first_sample():
    torch.manual_seed(0)
    module = _ReuseOnPositiveInputs().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(7, 3, dtype=torch.float64)
    X[0, 0] = -1.0  # the first sample hides the extra use
    X[-1, 0] = 1.0
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X), J[:, 0] @ J[:, 0].T)
    Y = torch.randn(4, 3, dtype=torch.float64)
    Y[:, 0] = -Y[:, 0].abs()  # all of Y hides it too; X's rows reveal it
    JY = _loop_jacobian(module, params, Y)
    _close(tangent_gram(module, params, Y, X), JY[:, 0] @ J[:, 0].T)


def test_params_y_is_matched_by_name():
    module, params, X, Y = _make("mlp", 1)
    other = {k: v + 0.1 for k, v in params.items()}
    shuffled = dict(reversed(list(other.items())))
    _close(tangent_gram(module, params, X, Y, params_y=shuffled),
           tangent_gram(module, params, X, Y, params_y=other))
    with pytest.raises(ValueError, match="same parameters"):
        tangent_gram(module, params, X, Y, params_y=dict(list(other.items())[:-1]))


# ------------------------------------------------------------ symmetric panels
@pytest.mark.parametrize("kind", ["mlp", "raw", "conv", "norule"])
@pytest.mark.parametrize("weighted", [False, True])
def test_symmetric_panels_match_loop(kind, weighted, monkeypatch):
    # Outer panels of 4 rows and inner ones of 2 on 9 samples: the last panel one row.
    module, params, X, _ = _make(kind, 2)
    JX = _loop_jacobian(module, params, X)
    D = torch.ones(JX.shape[2], dtype=JX.dtype)
    if weighted:
        D = torch.rand(JX.shape[2], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full = torch.einsum("ncp,p,mdp->ncmd", JX, D, JX)
    shapes = []
    real = _gram._gram_into
    monkeypatch.setattr(_gram, "_panel_rows", lambda device, width=0: (4, 2))
    monkeypatch.setattr(_gram, "_gram_into",
                        lambda out, *a: shapes.append(tuple(out.shape)) or real(out, *a))
    for output in ("trace", "full", 1):
        shapes.clear()
        K = tangent_gram(module, params, X, output=output, diag_weight=D if weighted else None)
        ref = (full if output == "full" else full[:, 1, :, 1] if output == 1
               else torch.einsum("ncmc->nm", full) / 2)
        _close(K, ref)
        # Right of each outer panel's square, then the square by inner panels, each
        # from the diagonal: nothing below the diagonal is computed.
        rows = [(4, 5), (2, 4), (2, 2), (4, 1), (2, 4), (2, 2), (1, 1)]
        assert [(sh[0], sh[2] if output == "full" else sh[1]) for sh in shapes] == rows
        flat = K.reshape(len(X) * (2 if output == "full" else 1), -1)
        assert torch.equal(flat, flat.T)


def test_symmetric_gram_over_many_real_panels():
    # More rows than one CPU panel: the default panels, against the loop.
    torch.manual_seed(0)
    module = _mlp(1).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(600, 3, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)[:, 0]
    K = tangent_gram(module, params, X)
    _close(K, J @ J.T)
    assert torch.equal(K, K.T)


# ------------------------------------------------- a parameter used at several sites
class _TiedTokens(nn.Module):
    """A token model whose output head reads the embedding table (``head.weight =
    tok.weight``), an attention layer between them."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(7, 8), nn.Embedding(3, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 7)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return self.head(self.layer(self.tok(ids) + self.pos(positions)).mean(1))


class _BlockTwice(nn.Module):
    """A residual block (LayerNorm, Linears on tokens, a Conv1d) applied twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = h + self.block(h)
            h = h + torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h.mean(1))


def _reused_first():
    """An MLP whose first Linear sits at two places of the Sequential."""
    first = nn.Linear(3, 3)
    return nn.Sequential(first, nn.Tanh(), first, nn.Tanh(), nn.Linear(3, 2))


SEVERAL_USES = {"tied": _TiedTokens, "block": _BlockTwice, "reused": _reused_first}


def _make_several(kind):
    torch.manual_seed(0)
    module = SEVERAL_USES[kind]().double().eval()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    if kind == "tied":
        X, Y = torch.randint(7, (9, 3)), torch.randint(7, (5, 3))
    else:
        shape = (3, 3) if kind == "block" else (3,)
        X, Y = torch.randn(9, *shape, dtype=torch.float64), torch.randn(5, *shape,
                                                                        dtype=torch.float64)
    return module, params, X, Y


@pytest.mark.parametrize("kind", sorted(SEVERAL_USES))
def test_several_uses_are_structured_and_match_loop(kind):
    # A tied weight and a layer called twice (or at two places) went whole to the
    # fallback; each use is now a term, summed per parameter (cross terms included).
    module, params, X, Y = _make_several(kind)
    cap = capture(module, params, X, [0], memory_budget=2**24)
    assert cap.fallback == ()
    routes = layer_routes(module, X, params=params)
    assert {r.route for r in routes} == {"rule"}, [(r.name, r.reason) for r in routes]
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    C = JX.shape[1]
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    _close(tangent_gram(module, params, X, Y, output="full"), full)
    _close(tangent_gram(module, params, X, Y), torch.einsum("ncmc->nm", full) / C)
    _close(tangent_gram(module, params, X, Y, output=1), full[:, 1, :, 1])
    _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", JX, JX) / C)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", JX, JX))
    _close(tangent_gram_diag(module, params, X), torch.einsum("ncp,ncp->n", JX, JX) / C)
    _close(tangent_gram_diag(module, params, X, output="full"),
           torch.einsum("ncp,ndp->ncd", JX, JX))
    _close(tangent_features(module, params, X, output="full"), JX)
    _close(tangent_features(module, params, X, output=0), JX[:, 0])
    # The two sides at different parameters.
    other = {k: v + 0.2 * torch.randn_like(v) for k, v in params.items()}
    JYo = _loop_jacobian(module, other, Y)
    _close(tangent_gram(module, params, X, Y, output="full", params_y=other),
           torch.einsum("ncp,mdp->ncmd", JX, JYo))
    # Blocks of one sample (the chunked capture) give the same.
    _close(_at_smallest_budget(tangent_gram, module, params, X, Y, output="full"), full)


@pytest.mark.parametrize("kind", sorted(SEVERAL_USES))
def test_several_uses_preconditioned(kind):
    module, params, X, Y = _make_several(kind)
    assert capture(module, params, X, [0], memory_budget=2**24).fallback == ()
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    C = JX.shape[1]
    gen = torch.Generator().manual_seed(1)
    for D in (torch.rand(JX.shape[2], dtype=torch.float64, generator=gen),
              torch.randn(JX.shape[2], dtype=torch.float64, generator=gen)):
        full = torch.einsum("ncp,p,mdp->ncmd", JX, D, JY)
        _close(tangent_gram(module, params, X, Y, output="full", diag_weight=D), full)
        _close(tangent_gram(module, params, X, diag_weight=D),
               torch.einsum("ncp,p,mcp->nm", JX, D, JX) / C)
        _close(tangent_gram_diag(module, params, X, output="full", diag_weight=D),
               torch.einsum("ncp,p,ndp->ncd", JX, D, JX))


@pytest.mark.parametrize("kind", sorted(SEVERAL_USES))
def test_several_uses_projection_converges(kind):
    module, params, X, _ = _make_several(kind)
    assert capture(module, params, X, [0], memory_budget=2**24).fallback == ()
    JX = _loop_jacobian(module, params, X)
    K = torch.einsum("ncp,mcp->nm", JX, JX) / JX.shape[1]
    errors = {}
    for k in (16, 4096):
        z = [project_tangent_features(module, params, X, k, random_state=s) for s in range(3)]
        errors[k] = sum(float((zs @ zs.T - K).norm() / K.norm()) for zs in z) / 3
    assert errors[4096] < 0.08
    assert errors[4096] < errors[16] / 4


class _TiedDeclined(nn.Module):
    """``b`` shares ``a``'s weight but is applied to a constant (its rows are not the
    samples): both go to the fallback, ``a`` for sharing a weight with ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
        self.b.weight = self.a.weight
        self.register_buffer("const", torch.randn(5, 3))  # not 4 rows, as layer_routes takes

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)) + self.b(self.const).sum(0))


def test_a_tied_weight_follows_a_declined_holder_to_the_fallback():
    torch.manual_seed(0)
    module = _TiedDeclined().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(6, 3, dtype=torch.float64)
    cap = capture(module, params, X, [0], memory_budget=2**20)
    assert set(cap.fallback) == {"a.weight", "a.bias", "b.bias"}
    routes = {r.name: r for r in layer_routes(module, X, params=params)}
    assert routes["b"].reason == "the rows of its input are not the samples"
    assert routes["a"].reason.startswith("a parameter of it is shared with a layer that goes")
    assert routes["c"].route == "rule"
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X), J[:, 0] @ J[:, 0].T)


# ------------------------------------------------------------------- use watch
class _Square(torch.autograd.Function):
    generate_vmap_rule = True  # the fallback differentiates it under vmap

    @staticmethod
    def forward(w):
        return (w * w).sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return 2 * w * grad


class _ReadThrough(nn.Module):
    """l1.weight read outside l1 in one of several ways; "meta" reads only metadata."""

    def __init__(self, how, read_from_call=0):
        super().__init__()
        self.l1, self.l2, self.how = nn.Linear(3, 5), nn.Linear(5, 1), how
        self.calls, self.read_from_call = 0, read_from_call

    def forward(self, x):
        out = self.l2(torch.tanh(self.l1(x)))
        w = self.l1.weight
        if self.how == "property":
            return out + (x @ w.T[:, :1])
        if self.how == "function":  # a custom autograd.Function: forward runs without grad
            return out + _Square.apply(w) * x[:, :1]
        if self.how == "late":  # from the read_from_call-th forward on
            self.calls += 1
            return out + (x[:, :1] * w.sum() if self.calls > self.read_from_call else 0.0)
        assert w.shape == (5, 3) and w.size(0) == 5 and w.detach().dtype == x.dtype
        return out


@pytest.mark.parametrize("how", ["property", "function", "meta"])
def test_use_watch_routes_outside_reads_to_fallback(how):
    torch.manual_seed(0)
    module = _ReadThrough(how).double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(7, 3, dtype=torch.float64)
    cap = capture(module, params, X, [0], memory_budget=2**20)
    # Metadata reads leave the layer on its rule; any other read sends it to the fallback.
    assert cap.exclude == (set() if how == "meta" else {"l1.weight"})
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(tangent_gram(module, params, X), J @ J.T)
    _close(tangent_features(module, params, X), J)


def test_misfit_found_in_a_later_block_reroutes_every_block(monkeypatch):
    # The read outside l1 starts at the 4th forward: the 1-row forward, the probe and
    # block 0 see none, block 1 does (as a use that depends on the data would).
    torch.manual_seed(0)
    module = _ReadThrough("late", read_from_call=3).double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(2, 3, dtype=torch.float64)
    always = _ReadThrough("late").double()
    J = _loop_jacobian(always, params, X)[:, 0]
    starts = []
    real = _gram._prepared
    monkeypatch.setattr(_gram, "_prepared",
                        lambda *a, **k: starts.append(a[5]) or real(*a, **k))
    K = tangent_gram(module, params, X, memory_budget=1800)  # blocks of one row
    _close(K, J @ J.T)
    # The first pass routed l1 to its rule, met the read in block 1, started over.
    assert starts == [frozenset(), frozenset({"l1.weight"})]


def test_features_into_a_reused_buffer():
    module, params, X, _ = _make("mlp", 2)
    J = _loop_jacobian(module, params, X)
    buf = torch.full_like(J, float("nan"))  # every entry must be overwritten
    out = tangent_features(module, params, X, output="full", out=buf)
    assert out is buf
    _close(buf, J)
    _close(tangent_features(module, params, X, output=1, out=buf[:, :1]), J[:, 1])
    with pytest.raises(ValueError, match="out must be"):
        tangent_features(module, params, X, output="full", out=buf[:, :1])
    with pytest.raises(ValueError, match="out must be"):
        tangent_features(module, params, X, output="full", out=buf.float())


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class _RaisesInsideLayer(_TwoLayers):
    """l1 raises once (its pre-hook ran, its forward hook only with always_call)."""

    def forward(self, x):
        try:
            self.l1(x[:, :2])
        except RuntimeError:
            pass
        # The parent's own F.linear with l1's weight: after a stale l1 frame, it would
        # pass for l1's call.
        return super().forward(x) + F.linear(x, self.l1.weight)[:, :2]


@torch.jit.script
def _scripted_product(x, w):
    return x @ w.t()


class _ScriptedRead(_TwoLayers):
    """A read of l1.weight that torch functions do not see: the autograd check's case."""

    def forward(self, x):
        return super().forward(x) + _scripted_product(x, self.l1.weight)[:, :2]


class _ScriptedReadOnOneOutput(_TwoLayers):
    """The hidden read of l1.weight in one of the two outputs alone: the autograd check
    must judge every output, not all of them at once nor only one."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, x):
        read = _scripted_product(x, self.l1.weight)[:, :1]
        zero = torch.zeros_like(read)
        return super().forward(x) + torch.cat([zero, read] if self.output else [read, zero], 1)


def _hooked_read():
    module = _TwoLayers()
    module.l1.register_forward_hook(lambda m, args, out: out + args[0].square() @ m.weight.T)
    return module


def _hooked_scale():
    # An output transform by a forward hook, and an extra parameter on the rule layer.
    module = _TwoLayers()
    module.l1.register_parameter("scale", nn.Parameter(torch.linspace(0.5, 2.0, 4)))
    module.l1.register_forward_hook(lambda m, args, out: out * m.scale)
    return module


def _patched_forward():
    module = _TwoLayers()
    # Bound to the layer, so that the reference's deep copy rebinds it to its copy.
    module.l1.forward = types.MethodType(
        lambda self, x: F.linear(x, self.weight * self.weight, self.bias), module.l1)
    return module


def _patched_input():
    # The layer's own F.linear on a transformed input: still the rule, with that input.
    module = _TwoLayers()
    module.l1.forward = types.MethodType(
        lambda self, x: F.linear(2.0 * x + 1.0, self.weight, self.bias), module.l1)
    return module


_READS = [(_hooked_read, False), (_hooked_scale, False), (_patched_forward, False),
          (_patched_input, True), (_RaisesInsideLayer, False), (_ScriptedRead, False),
          (functools.partial(_ScriptedReadOnOneOutput, 0), False),
          (functools.partial(_ScriptedReadOnOneOutput, 1), False)]
# The reads hidden from torch functions: the autograd check's alone.
_HIDDEN = {_ScriptedRead, _ScriptedReadOnOneOutput}


# Every case with both checks; without the autograd check, the use watch alone must see
# every read except the one hidden from torch functions.
@pytest.mark.parametrize("make, rule_kept, numerical_check",
                         [(m, k, True) for m, k in _READS]
                         + [(m, k, False) for m, k in _READS
                            if getattr(m, "func", m) not in _HIDDEN])
def test_reads_in_hooks_patches_and_hidden_code(make, rule_kept, numerical_check, monkeypatch):
    fallback = _routing_against_loop(make, numerical_check, monkeypatch)
    assert ("l1.weight" in fallback) != rule_kept


@pytest.mark.parametrize("make, rule_kept", _READS)
@pytest.mark.parametrize("batched", [True, False])
def test_autograd_check_batched_or_per_output(make, rule_kept, batched, monkeypatch):
    # The one-sample autograd check by one batched backward pass over the outputs where it
    # fits an eighth of the budget (session s53), or one pass per output: either finds
    # every read (the hidden ones are its alone) and the Gram matches the dense Jacobians.
    monkeypatch.setattr(_gram, "BATCHED_CHECK", batched)
    # The check's passes alone: the captures' small passes batched too (s55) are not.
    monkeypatch.setattr(_capture, "SMALL_PASS_BYTES", 0)
    passes = []
    real = _capture._batched_grads
    monkeypatch.setattr(_capture, "_batched_grads",
                        lambda *a: passes.append(real(*a)) or passes[-1])
    fallback = _routing_against_loop(make, True, monkeypatch)
    assert ("l1.weight" in fallback) != rule_kept
    assert bool(passes) == batched
    assert all(p is not None for p in passes)  # batched, not fallen back


class _UnbatchableBackward(torch.autograd.Function):
    """Identity whose backward reads its gradient's value (data-dependent control flow):
    autograd cannot run it under a batched backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g if float(g.abs().sum()) >= 0 else -g


class _UnbatchableScriptedRead(_ScriptedReadOnOneOutput):
    """The hidden read of l1.weight on one output, behind a backward that cannot batch."""

    def forward(self, x):
        read = _scripted_product(x, self.l1.weight)[:, :1]
        zero = torch.zeros_like(read)
        h = torch.tanh(_UnbatchableBackward.apply(self.l1(x)))
        return self.l2(h) + torch.cat([zero, read] if self.output else [read, zero], 1)


@pytest.mark.parametrize("output", [0, 1])
def test_autograd_check_falls_back_per_output_where_autograd_cannot_batch(output,
                                                                          monkeypatch):
    # The batched check (session s53) on a backward autograd cannot batch: the pass is
    # tried, declined, and the per-output passes still find the read of l1.weight hidden
    # from torch functions on one output alone; the Gram matches the dense Jacobians.
    # The check's passes alone: the captures' small passes batched too (s55) are not.
    monkeypatch.setattr(_capture, "SMALL_PASS_BYTES", 0)
    passes = []
    real = _capture._batched_grads
    monkeypatch.setattr(_capture, "_batched_grads",
                        lambda *a: passes.append(real(*a)) or passes[-1])
    fallback = _routing_against_loop(
        functools.partial(_UnbatchableScriptedRead, output), True, monkeypatch)
    assert "l1.weight" in fallback
    assert passes and all(p is None for p in passes)


def _routing_against_loop(make, numerical_check, monkeypatch):
    """Gram and features of make() against the loop; the parameters sent to the fallback.

    ``numerical_check=False`` leaves the use watch alone (no autograd check).
    """
    if not numerical_check:
        monkeypatch.setattr(_capture, "_numerical_misfits", lambda *a: frozenset())
    torch.manual_seed(0)
    module = make().double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(7, 3, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(tangent_features(module, params, X, output="full"), J)
    return _gram._prepare(module, params, X, "full", 2**20)[3].fallback


def test_use_watch_ignores_hooks_fired_by_other_threads():
    layer = nn.Linear(2, 2)
    watch = _capture._UseWatch({}, {id(layer): (F.linear,)})
    other = threading.Thread(target=watch.enter, args=(layer,))
    other.start()
    other.join()
    assert watch.frames == []
    watch.enter(layer)
    other = threading.Thread(target=watch.leave, args=(layer,))
    other.start()
    other.join()
    assert len(watch.frames) == 1
    watch.leave(layer)
    assert watch.frames == [] and watch.factors[id(layer)] == [None]



class _Pause(nn.Module):
    """The identity, after a millisecond's sleep: another thread runs meanwhile, inside
    this forward pass's ``functional_call`` (one core is enough)."""

    def forward(self, x):
        time.sleep(1e-3)
        return x


@pytest.mark.parametrize("fn", ["gram", "diag", "features"])
def test_concurrent_engine_calls_on_one_module_match_the_loop(fn):
    # Engine calls on one module from several threads (joblib's threading backend, Dask's
    # threaded workers, a server sharing a network): each call's functional_call swapped
    # the module's parameters for its own and hooked its layers, so another call's forward
    # pass read them; 4 threads x 20 calls raised "One of the differentiated Tensors does
    # not require grad" or returned results off by up to 0.7 (old code, pinned to one
    # core: 12 to 24 of the 80 calls raised, in each of 5 runs of the 3 cases). Compared
    # with the autograd loop at the call's params.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), _Pause(),
                           nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    own = list(module.parameters())
    X = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)
    call, expected = {
        "gram": (lambda: tangent_gram(module, params, X),
                 torch.einsum("ncp,mcp->nm", J, J) / 2),  # trace: the mean over outputs
        "diag": (lambda: tangent_gram_diag(module, params, X),
                 torch.einsum("ncp,ncp->n", J, J) / 2),
        "features": (lambda: tangent_features(module, params, X, output="full"), J),
    }[fn]
    barrier = threading.Barrier(4)

    def task(_):
        out = []
        for _ in range(20):
            barrier.wait(timeout=60)
            try:
                out.append(call())
            except RuntimeError as exc:  # counted below, after every thread is done
                out.append(exc)
        return out

    with ThreadPoolExecutor(4) as pool:
        results = [r for rs in pool.map(task, range(4)) for r in rs]
    raised = [r for r in results if isinstance(r, Exception)]
    assert not raised, f"{len(raised)} of {len(results)} calls raised: {raised[0]}"
    for result in results:
        _close(result, expected)
    # The module holds its own parameters again.
    assert all(a is b for a, b in zip(module.parameters(), own, strict=True))

class _ConstantInput(_TwoLayers):
    """A Linear on a buffer (a FiLM-style shift): its rows are not the samples."""

    def __init__(self):
        super().__init__()
        self.register_buffer("code", torch.ones(1, 5))
        self.film = nn.Linear(5, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x) + self.film(self.code)))


class _Flipped(_TwoLayers):
    """Rows reversed before l1 and restored after: per sample the same function."""

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x.flip(0)).flip(0)))


def _bias_left_out():
    module = _TwoLayers()
    module.l1.forward = types.MethodType(lambda self, x: F.linear(x, self.weight), module.l1)
    return module


@pytest.mark.parametrize("make, routed, numerical_check", [
    (_ConstantInput, "film.weight", False),  # the watch's row check alone
    (_Flipped, "l1.weight", True),  # only the autograd check of the rows sees a swap
    (_bias_left_out, "l1.weight", False),  # the own call must take every parameter
])
def test_rows_that_are_not_the_samples_and_partial_own_calls(make, routed, numerical_check,
                                                             monkeypatch):
    assert routed in _routing_against_loop(make, numerical_check, monkeypatch)


@pytest.mark.parametrize("make", [_ScriptedRead, functools.partial(_ScriptedReadOnOneOutput, 0),
                                  functools.partial(_ScriptedReadOnOneOutput, 1), _Flipped])
def test_batched_autograd_check_sees_what_the_loop_sees(make, batched_backprops,
                                                       monkeypatch):
    # The GPU's autograd check, all outputs in one batched backward pass, run on the CPU:
    # a hidden read on one output, and swapped rows, still send l1 to the fallback.
    assert "l1.weight" in _routing_against_loop(make, True, monkeypatch)
    assert batched_backprops and all(g is not None for g in batched_backprops)


class _SortedByScore(nn.Module):
    """The batch sorted by a score of the data before l1 and put back in the samples'
    order after it: per sample the same function, but l1's rows are the samples sorted."""

    def __init__(self, descending):
        super().__init__()
        self.descending = descending
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x):
        order = torch.sort(x[:, 0], descending=self.descending, stable=True).indices
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.l2(torch.tanh(self.l1(x[order])[back]))


def _sorted_by_score(descending):
    """The network, its parameters, and 9 rows whose first three come in its sort's order."""
    torch.manual_seed(0)
    module = _SortedByScore(descending).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(9, 3, dtype=torch.float64)
    score = torch.tensor([9, 8, 7, 1, 5, 3, 6, 2, 4])
    X[:, 0] = (score if descending else 10 - score).to(X.dtype)
    return module, params, X


@pytest.mark.parametrize("descending", [True, False])
def test_a_batch_sorted_by_the_data_before_a_layer_falls_back_exactly(descending):
    # The first samples already in the sort's order: the two-row autograd check saw no
    # reordering, l1 kept its rule, and the Gram paired sorted rows with the samples
    # (42-58% off). The check's cycle of rows x0, x1, xl, x0 is in no sorted order, so
    # the sort moves one of them (the features' check); so do its pairs, checked one at a
    # time where the rows are wide for the budget
    # (test_the_reordering_check_in_pairs_sees_a_sort). A symmetric Gram of these 9 rows
    # checks all of them (_gram._own_check_rows).
    module, params, X = _sorted_by_score(descending)
    J = _loop_jacobian(module, params, X)
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(tangent_gram(module, params, X, output="trace"),
           torch.einsum("ncp,mcp->nm", J, J) / 2)
    _close(tangent_features(module, params, X, output="full"), J)
    routes = {r.name: r for r in layer_routes(module, X)}
    assert routes["l1"].route == "fallback", routes["l1"]
    assert "reorders the samples" in routes["l1"].reason, routes["l1"].reason
    # Only the layer between the sort and the unsort: l2's rows are the samples.
    assert routes["l2"].route == "rule", routes["l2"]
    # The paths' route (hidden_reads once, then check_hidden=False) routes alike.
    exclude = _tangent.hidden_reads(module, [params], [X], output="full")
    assert "l1.weight" in exclude and "l2.weight" not in exclude
    _close(tangent_gram(module, params, X, output="full", exclude=exclude, check_hidden=False),
           torch.einsum("ncp,mdp->ncmd", J, J))


class _MixedAfter(nn.Module):
    """The samples mixed after l0 (``h + h.mean(0)``): l0's rows get the backprop of
    every sample's output, l1's and l2's rows are each their sample's (mixed) rows."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.l0(x))
        return self.l2(torch.tanh(self.l1(h + h.mean(0))))


def test_the_reason_puts_a_mix_of_the_samples_after_the_layer():
    # The autograd check sends away the layer before the mix (its factors disagree),
    # not the ones after it: the reason said the forward "mixes the samples before the
    # layer", the wrong side (session s54 review).
    torch.manual_seed(0)
    module = _MixedAfter().double()
    routes = {r.name: r for r in layer_routes(module, torch.randn(6, 3, dtype=torch.float64))}
    assert routes["l0"].route == "fallback", routes["l0"]
    assert "or mixes them after it" in routes["l0"].reason, routes["l0"].reason
    assert routes["l1"].route == routes["l2"].route == "rule", routes


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def _small_cnn():
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3, stride=2),
                         nn.Tanh(), nn.Flatten(), nn.Linear(16, 3))


@pytest.mark.parametrize("make, shape", [
    (lambda: _mlp(3), (3,)),
    (_small_cnn, (1, 8, 8)),
    (lambda: _Encoder().eval(), (5, 8)),
])
def test_the_reordering_check_keeps_per_sample_networks_on_their_rules(make, shape):
    # No false alarm: the check's repeated row and its weights agree with autograd
    # wherever the rows are the samples (an MLP, a CNN, a transformer encoder layer).
    torch.manual_seed(0)
    module = make().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(6, *shape, dtype=torch.float64)
    assert all(r.route == "rule" for r in layer_routes(module, X)), layer_routes(module, X)
    assert not _gram._prepare(module, params, X, "full", 2**24)[3].fallback
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))


def test_check_rows_close_a_cycle_of_the_first_two_and_last_samples():
    X = torch.arange(5.0)[:, None]

    def rows(X, budget=2**20):
        return [g[:, 0].tolist() for g in _capture.check_rows(X, budget)]

    # The first two and the last samples (session s55: the first three tie more often on
    # a sort's key, test_the_check_takes_the_last_sample).
    assert rows(X) == [[0, 1, 4, 0]]
    assert rows(X[:4]) == [[0, 1, 3, 0]]
    assert rows(X[:3]) == [[0, 1, 2, 0]]
    assert rows(X[:2]) == [[0, 1, 0]]
    assert rows(X[:1]) == [[0]]
    # A cycle as long as no other axis of X (its rows then cannot pass for the steps of a
    # time-major transpose of it): longer, still in no sorted order.
    assert rows(X.expand(5, 4)) == [[0, 1, 4, 0, 1]]
    assert rows(X[:2].expand(2, 3)) == [[0, 1, 0, 1]]
    # Rows too wide for the budget: the cycle's pairs, two rows at a time.
    assert rows(X, 64) == [[0, 1], [1, 4], [4, 0]]
    assert rows(X[:3], 64) == [[0, 1], [1, 2], [2, 0]]
    assert rows(X[:2], 64) == [[0, 1], [1, 0]]
    # Each pair contiguous (a network may flatten its batch, x.view(-1, d)).
    assert all(g.is_contiguous() for g in _capture.check_rows(X, 64))


@pytest.mark.parametrize("descending", [True, False])
def test_the_reordering_check_in_pairs_sees_a_sort(descending, monkeypatch):
    # Rows too wide for the cycle's copies in the budget (made so by counting a billion
    # copies): the pairs, each captured and checked alone, still send l1 to the fallback
    # (and the Gram is exact). Too wide for a small Gram's own rows alike: its check takes
    # the pairs too (s55 re-read: _gram held its own copy of the count, and the Gram
    # below was checked on all its rows, not on the pairs).
    monkeypatch.setattr(_capture, "_CHECK_COPIES", 10**9)
    module, params, X = _sorted_by_score(descending)
    budget = 2**20
    assert len(_capture.check_rows(X, budget)) == 3
    assert _gram._own_check_rows(X, budget) is None
    assert "l1.weight" in _gram._prepare(module, params, X, "full", budget)[3].fallback
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full", memory_budget=budget),
           torch.einsum("ncp,mdp->ncmd", J, J))


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("n_x", [1, 2])
def test_a_cross_gram_of_one_query_checks_ys_rows(n_x, descending):
    # K(x, Y) for one query (step_kernel's K(x, X_train)): the check of x alone has no
    # order to see, but Y's blocks are batches the forward sorts, and l1 kept its rule
    # (42-58% off). Y's first rows complete the check after X's.
    module, params, X = _sorted_by_score(descending)
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X[:n_x], X, output="full"),
           torch.einsum("ncp,mdp->ncmd", J[:n_x], J))


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("keys", [
    # A batch sorted or grouped by the sort's key (sequences bucketed by length): its
    # first three samples tie on it, the cycle x0, x1, x2 stayed in place, and l1 kept
    # its rule (the Gram 25-31% off before session s55); its last differs.
    [1, 1, 1, 2, 2, 2, 3, 3, 3],
    # The key's values interleaved: the first, middle and last samples tie (a choice of
    # three spread over X missed it, 37-40% off), adjacent samples do not.
    [1, 2, 3, 2, 1, 3, 2, 3, 1],
])
def test_the_check_takes_the_last_sample(keys, descending):
    module, params, X = _sorted_by_score(descending)
    X[:, 0] = torch.tensor(keys, dtype=X.dtype) * (1 if descending else -1)
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    assert {r.name: r.route for r in layer_routes(module, X)} == {"l1": "fallback",
                                                                  "l2": "rule"}
    # One query against such a batch: Y's first and last after it (x, y0, y8), where
    # x, y0, y1 tied on the grouped keys.
    _close(tangent_gram(module, params, X[1:2], X, output="full"),
           torch.einsum("ncp,mdp->ncmd", J[1:2], J))


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("repeated", [0, 1])
def test_the_check_takes_a_last_sample_unlike_the_first_two(repeated, descending):
    # X's last row a copy of x0 or x1 (a batch padded by wrapping around): x0, x1, xl held
    # two samples, tied on a key on which x0, x1 tie, and l1 kept its rule (features 64-68%
    # off; x2 of the first three saw the sort). The check takes the row before it.
    module, params, X = _sorted_by_score(descending)
    X[:, 0] = torch.tensor([5, 5, 1, 7, 2, 8, 3, 6, 4], dtype=X.dtype) * (
        1 if descending else -1)
    X[-1] = X[repeated]
    J = _loop_jacobian(module, params, X)
    # The features (a Gram of 9 rows checks all of them, _own_check_rows).
    _close(tangent_features(module, params, X, output="full"), J)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    assert {r.name: r.route for r in layer_routes(module, X)} == {"l1": "fallback",
                                                                  "l2": "rule"}
    assert [g[:, 0].tolist() for g in _capture.check_rows(X[:, :1], 2**20)] == [
        [X[i, 0].item() for i in (0, 1, 7, 0)]]


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("repeated", ["y0", "query"])
def test_a_one_query_check_takes_a_last_y_unlike_the_query_and_y0(repeated, descending):
    # K(x, Y) checks x, y0, yl: where Y's last row repeats y0 (wrap-around padding) or is
    # the query itself (a query from the training set), the check held two samples, tied
    # on a key on which x and y0 tie, and l1 kept its rule (54-56% off; y1 of the first
    # two saw the sort on c4c39914). The check takes Y's row before it.
    module, params, Y = _sorted_by_score(descending)
    Y[:, 0] = torch.tensor([5, 1, 7, 2, 8, 3, 6, 4, 5], dtype=Y.dtype) * (
        1 if descending else -1)
    x = Y[:1].clone()
    x[0, 1:] = torch.tensor([0.3, -0.7], dtype=Y.dtype)  # unlike y0, tied on the key
    Y[-1] = Y[0] if repeated == "y0" else x[0]
    J, Jx = _loop_jacobian(module, params, Y), _loop_jacobian(module, params, x)
    _close(tangent_gram(module, params, x, Y, output="full"),
           torch.einsum("ncp,mdp->ncmd", Jx, J))
    assert _capture._picks(Y, 2, before=x) == [0, 7]


def test_a_cross_gram_refuses_y_of_another_shape_before_any_work():
    # Bad input is refused before the check runs the network on X and Y's rows.
    module, params, X = _sorted_by_score(True)
    calls = []
    module.l1.register_forward_hook(lambda *args: calls.append(1))
    for Y in (torch.randn(4, 5, dtype=torch.float64), X.float()):
        with pytest.raises(ValueError, match="Y must be a torch.float64 tensor of shape"):
            tangent_gram(module, params, X[:1], Y)
    assert not calls


class _OfScalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(1, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x[:, None])))


def test_a_cross_gram_refuses_a_y_without_a_samples_axis():
    # X of scalar samples (n,) and Y a scalar: the trailing shapes agree, (), and Y was let
    # through to an IndexError after the network ran (Y.shape[0]).
    torch.manual_seed(0)
    module = _OfScalars().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    calls = []
    module.l1.register_forward_hook(lambda *args: calls.append(1))
    X = torch.randn(4, dtype=torch.float64)
    for x in (X, X[:1]):
        with pytest.raises(ValueError, match=r"Y must be a torch.float64 tensor of shape \(n\)"):
            tangent_gram(module, params, x, X[0])
    assert not calls
    # Y of scalars as X: the Gram against the loop.
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X[:1], X, output="full"),
           torch.einsum("ncp,mdp->ncmd", J[:1], J))


class _OneOfEach(_SortedByScore):
    """:class:`_SortedByScore` that refuses a batch holding a sample twice (as the check's
    cycle does)."""

    def forward(self, x):
        if len(torch.unique(x, dim=0)) < len(x):
            raise ValueError("the batch holds a sample twice")
        return super().forward(x)


def _oom_on_the_cycle(monkeypatch):
    """The check's pass out of memory on more than two rows."""
    misfits = _capture._numerical_misfits

    def check(module, params, x, *args):
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return misfits(module, params, x, *args)

    monkeypatch.setattr(_capture, "_numerical_misfits", check)


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("fails", ["repeated row", "out of memory"])
def test_a_check_failing_on_the_cycle_runs_on_its_pairs(fails, descending, monkeypatch):
    # Any error on the cycle sent the check to x0, x1 in X's order, silently, where the
    # sort shows no more: l1 kept its rule, the Gram 14% off (before session s55). The
    # cycle's pairs hold no row twice and two rows at a time, and see the sort.
    module, params, X = _sorted_by_score(descending)
    if fails == "repeated row":
        module = _OneOfEach(descending).double()
        module.load_state_dict(dict(params))
    else:
        _oom_on_the_cycle(monkeypatch)
    J = _loop_jacobian(module, params, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = tangent_gram(module, params, X, output="full")
        routes = {r.name: r.route for r in layer_routes(module, X)}
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))
    assert routes == {"l1": "fallback", "l2": "rule"}, routes


class _RefusesUnsorted(_TwoLayers):
    """A network that refuses a batch out of ascending order of its first feature with an
    error of its own (not torch's ``enforce_sorted`` refusal)."""

    def forward(self, x):
        if (x[1:, 0] < x[:-1, 0]).any():
            raise RuntimeError("the batch must be sorted by its first feature")
        return super().forward(x)


def _refuses_unsorted():
    """:class:`_RefusesUnsorted`, its parameters, and 6 rows in the order it requires."""
    torch.manual_seed(0)
    module = _RefusesUnsorted().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(6, 3, dtype=torch.float64)
    return module, params, X[X[:, 0].argsort()]


def test_a_check_failing_out_of_xs_order_warns_and_runs_in_order():
    # The cycle and its pairs raise: the check runs on x0, x1 in X's order, as before, but
    # says that a sort of the batch would go unseen (it was silent before session s55).
    module, params, X = _refuses_unsorted()
    with pytest.warns(UserWarning, match=r"raised on the rows it takes out of X's order "
                      r"\(RuntimeError: the batch must be sorted by its first feature\).*"
                      "reorders the batch"):
        rows, cap, hidden = _capture.checked_capture(module, params, X, [0, 1],
                                                     memory_budget=2**24)
    assert torch.equal(rows, X[:2]) and not hidden
    J = _loop_jacobian(module, params, X)
    with pytest.warns(UserWarning, match="reorders the batch"):
        K = tangent_gram(module, params, X, output="full")
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))
    # X out of the order it requires: the network's error, from x0, x1, and no warning.
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="sorted by its first"):
        warnings.simplefilter("error")
        _capture.checked_capture(module, params, X[[1, 0]], [0], memory_budget=2**24)


def test_a_one_query_check_failing_out_of_order_retries_on_batches_the_gram_forms():
    # K(x, Y) checks x, y0, yl: a network refusing a batch out of its order raised on the
    # cycle and its pairs, then on the retry x, y0 in their order, a batch the Gram never
    # forms (x alone, Y's blocks), and the call raised (sessions s54-s55). The retry takes
    # Y's first two and x apart.
    module, params, Y = _refuses_unsorted()
    x = Y[-1:] + 1
    J = _loop_jacobian(module, params, torch.cat([x, Y]))
    with pytest.warns(UserWarning, match="reorders the batch"):
        K = tangent_gram(module, params, x, Y, output="full")
    _close(K, torch.einsum("ncp,mdp->ncmd", J[:1], J[1:]))


class _HostSquare(torch.autograd.Function):
    """x^2 computed in NumPy: its backward leaves torch, so autograd cannot batch it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.from_numpy(x.detach().numpy() ** 2)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * x.detach().numpy() * g.detach().numpy())


class _HostActivation(_TwoLayers):
    def forward(self, x):
        return self.l2(_HostSquare.apply(self.l1(x)))


def test_unbatchable_backward_falls_back_to_one_pass_per_output(batched_backprops,
                                                               monkeypatch):
    # Where the batched pass raises, the outputs' passes run one at a time on the same
    # graph: the Gram is still the loop's, every layer still on its rule.
    assert _routing_against_loop(_HostActivation, True, monkeypatch) == ()
    assert batched_backprops and all(g is None for g in batched_backprops)


def test_lending_dtype_and_device_is_not_a_read():
    class Cast(_TwoLayers):
        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x)).to(self.l2.weight).type_as(self.l2.weight))

    module = Cast().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    cap = capture(module, params, torch.randn(4, 3, dtype=torch.float64), [0], memory_budget=2**20)
    assert cap.fallback == () and not cap.exclude


class _Tokens(nn.Module):
    """A Linear over 8 positions and a head of ``n_out``: blocks formed per sample."""

    def __init__(self, n_out):
        super().__init__()
        self.per_position = nn.Linear(4, 128)
        self.head = nn.Linear(1024, n_out)

    def forward(self, x):
        h = torch.tanh(self.per_position(x.reshape(x.shape[0], 8, 4)))
        return self.head(h.reshape(x.shape[0], -1))


def _keeps_all_at(probe, n, budget, columns, weight=None, Y=None):
    part = _gram._probe_outputs(probe, columns)
    dense, kept, _, _ = _gram._gram_plan(part, n, n if Y is None else len(Y), "trace",
                                         weight is not None, Y is None, budget, 8,
                                         weight is not None)
    share = _gram._dense_shares(part, kept, budget)[1] if dense else None
    return _gram._keeps_all(dense, kept, n + (0 if Y is None else len(Y)), budget, share)


def _budget_with_groups(probe, n_x, n_y, weight, symmetric, itemsize, count):
    """The smallest budget, on a 1/64-octave grid, that splits the outputs in ``count``
    groups; fails (rather than searching forever) when no budget up to 1 GiB does."""
    budget = 2**14
    while budget <= 2**30:
        if len(_gram._output_groups(probe, n_x, n_y, "trace", weight, symmetric, budget,
                                    itemsize)) == count:
            return budget
        budget = int(budget * 2 ** (1 / 64)) + 1
    pytest.fail(f"no budget splits the outputs in {count} groups")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_outputs_split_into_groups_whose_blocks_fit(weighted, cross, monkeypatch):
    # Blocks of 6 outputs that do not all fit the budget, but blocks of 3 do: the trace is
    # summed over two groups of outputs, each block captured once per group, instead of
    # capturing the column blocks again for every row block.
    torch.manual_seed(0)
    module = _Tokens(6).double()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    # Enough rows that the kept blocks, not one row's capture, bound the budget.
    X = torch.randn(200, 32, dtype=torch.float64)
    Y = torch.randn(120, 32, dtype=torch.float64) if cross else None
    n_params = sum(p.numel() for p in params.values())
    D = torch.rand(n_params, dtype=torch.float64) if weighted else None
    weight = None if D is None else _gram._Weighted(D)
    probe = capture(module, params, X[:1], list(range(6)), memory_budget=2**20)
    budget = _budget_with_groups(probe, len(X), len(X) if Y is None else len(Y), weight,
                                 Y is None, 8, 2)
    assert _keeps_all_at(probe, len(X), budget, range(3), weight, Y)
    assert not _keeps_all_at(probe, len(X), budget, range(6), weight, Y)
    assert _gram._output_groups(probe, len(X), len(X) if Y is None else len(Y), "trace",
                                weight, Y is None, budget, 8) == [[0, 1, 2], [3, 4, 5]]

    seen = []
    real = _gram.capture
    monkeypatch.setattr(_gram, "capture", lambda *a, **k: seen.append(
        (a[2].shape[0], tuple(a[3]))) or real(*a, **k))
    K = tangent_gram(module, params, X, Y, diag_weight=D, memory_budget=budget,
                     check_hidden=False)
    # Past the one-row probe of all six outputs: every row of each side captured once
    # per group, in chunks, group (0, 1, 2) first.
    groups = [outputs for _, outputs in seen[1:]]
    assert seen[0] == (1, tuple(range(6))) and groups == sorted(groups)
    rows = {g: sum(r for r, outputs in seen[1:] if outputs == g) for g in set(groups)}
    assert rows == dict.fromkeys([(0, 1, 2), (3, 4, 5)], len(X) + (0 if Y is None else len(Y)))
    JX = _loop_jacobian(module, params, X)
    JY = JX if Y is None else _loop_jacobian(module, params, Y)
    w = torch.ones(n_params, dtype=torch.float64) if D is None else D
    _close(K, torch.einsum("ncp,p,mcp->nm", JX, w, JY) / 6)
    # One output alone, "full" and a budget that holds everything: no groups.
    for output, b in ((2, budget), ("full", budget), ("trace", 2**30)):
        assert len(_gram._output_groups(probe if output == "trace" else
                                        _gram._probe_outputs(probe, [2]), len(X), len(X),
                                        output if isinstance(output, str) else "trace",
                                        weight, True, b, 8)) == 1


class _SmallResNet(nn.Module):
    """Conv stem with eval BatchNorm, a residual block, average pooling, ``n_out``
    outputs: the ResNet row's layers at a size whose blocks a test can hold."""

    def __init__(self, n_out):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(8), nn.ReLU())
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, n_out)

    def forward(self, x):
        h = self.stem(x)
        return self.head(torch.relu(h + self.bn(self.conv(h))).mean((2, 3)))


def _resnet_problem(n, dtype=torch.float64, n_out=3):
    """:class:`_SmallResNet` with random BatchNorm statistics, perturbed parameters and
    ``n`` random images."""
    torch.manual_seed(0)
    module = _SmallResNet(n_out)
    _bn_stats(module)
    module = module.eval().to(dtype)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    return module, params, torch.randn(n, 2, 6, 6, dtype=dtype)


def _old_backprops(monkeypatch):
    """The capture as before session s47's BatchNorm sums: BatchNorm's terms by its rule
    from its buffered backprops."""
    monkeypatch.setattr(_capture, "_reduced_sites", lambda *args: {})


class _TwoBranches(nn.Module):
    """Output 0 through an eval BatchNorm, output 1 through another branch: the
    BatchNorm's site gets no backprop from output 1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.other = nn.Conv2d(2, 3, 1, stride=2)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        a = self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
        return torch.cat([a, self.other(x).mean((1, 2, 3)).unsqueeze(1)], 1)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("output", ["trace", "full", 1])
def test_batch_norm_sums_are_taken_as_the_backward_passes_compute_them(output, channels_last,
                                                                        monkeypatch):
    # An eval BatchNorm's per-sample weight and bias gradients are its output's backprop
    # summed over the positions (times x-hat for the weight): summed by a hook as each
    # backward pass computes them (by BatchNorm's own backward over the samples'
    # channels; channels-last memory, which that cannot view, by x-hat and sums), its
    # backprops are neither copied into a buffer nor kept (two of the small ResNet's five
    # sites). Against the dense Jacobians, and in float32 against the Gram of the
    # backprops copied after each pass, the sums by the rule (as before: the same to
    # float32 rounding). Without the fold of each BatchNorm into the convolution before it
    # (test_batch_norm_folded_into_its_convolution), which leaves them no site.
    monkeypatch.setattr(_capture, "foldable", lambda *args: False)
    module, params, X = _resnet_problem(20)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
        X = X.contiguous(memory_format=torch.channels_last)
    kept = []
    real = _capture._backprops

    def backprops(*args):
        out = real(*args)
        kept.append([d is not None for d in out])
        return out

    monkeypatch.setattr(_capture, "_backprops", backprops)
    K = tangent_gram(module, params, X, output=output)
    # Every capture's sites: stem conv, stem BatchNorm, conv, BatchNorm, head.
    assert kept and all(k == [True, False, True, False, True] for k in kept)
    J = _loop_jacobian(module, params, X)
    ref = {"trace": lambda: torch.einsum("ncp,mcp->nm", J, J) / 3,
           "full": lambda: torch.einsum("ncp,mdp->ncmd", J, J),
           1: lambda: J[:, 1] @ J[:, 1].T}[output]()
    _close(K, ref)
    monkeypatch.setattr(_capture, "_backprops", real)
    module32 = module.float()
    params32 = {k: v.float() for k, v in params.items()}
    new = tangent_gram(module32, params32, X.float(), output=output)
    _close(new, ref, 1e-5)
    _old_backprops(monkeypatch)
    _close(new, tangent_gram(module32, params32, X.float(), output=output), 1e-6)


class _ConvBatchNorm(nn.Module):
    """Convolutions followed by eval BatchNorms, in the variants that the captures' fold
    (:meth:`._capture._UseWatch._fold`) must treat: ``kind`` picks the second pair's."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        conv = nn.Conv1d if kind == "conv1d" else nn.Conv2d
        bn = nn.BatchNorm1d if kind == "conv1d" else nn.BatchNorm2d
        self.conv1 = conv(2, 4, 3, padding=1, bias=False)
        self.bn1 = bn(4)
        groups, stride = (2, 2) if kind == "grouped, strided" else (1, 1)
        self.conv2 = conv(4, 4, 3, padding=1, bias=kind != "no bias", groups=groups,
                          stride=stride)
        self.bn2 = bn(4, affine=kind != "affine=False")
        self.relu = nn.ReLU(inplace=kind == "in-place ReLU")
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        z = self.conv2(h)
        if self.kind == "BatchNorm after a ReLU":
            y = self.bn2(torch.relu(z))
        elif self.kind == "output read after":
            y = self.bn2(z) + 0.5 * z
        elif self.kind == "output read before":
            a = 0.5 * z
            y = self.bn2(z) + a
        else:
            y = self.bn2(z)
        return self.head(self.relu(y).flatten(2).mean(2))


# Whether the second pair folds (the first always does; but a capture that finds a folded
# output read after its BatchNorm runs again without folding). A frozen layer is no rule
# layer: nothing to fold.
_FOLDS = {"plain": True, "no bias": True, "gamma zero": True, "affine=False": False,
          "BatchNorm after a ReLU": False, "output read after": False,
          "output read before": False, "in-place ReLU": True, "conv1d": True,
          "grouped, strided": True, "frozen convolution": False, "frozen BatchNorm": False}


def _conv_bn_problem(kind, dtype=torch.float64):
    torch.manual_seed(0)
    module = _ConvBatchNorm(kind)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            if m.affine:
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-0.5, 0.5)
    if kind == "gamma zero":
        module.bn1.weight.data[1] = 0.0
        module.bn2.weight.data[::2] = 0.0
    module = module.eval().to(dtype)
    frozen = {"frozen convolution": "conv2.", "frozen BatchNorm": "bn2."}.get(kind, "-")
    params = {k: v.detach() + 0.05 * torch.randn_like(v)
              for k, v in module.named_parameters() if not k.startswith(frozen)}
    shape = (2, 10) if kind == "conv1d" else (2, 5, 6)
    return module, params, torch.randn(7, *shape, dtype=dtype)


def _subset_jacobian(module, params, X):
    """(n, C, P) of the parameters in ``params`` alone (the others frozen), by the
    autograd loop on a float64 copy."""
    ref = copy.deepcopy(module).to(torch.float64)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.requires_grad_(name in params)
            if name in params:
                p.copy_(params[name])
    return jacobian_loop(ref, X)


def _term_gradients(cap, params):
    """(n, C, P): the per-sample gradients the capture's terms give, in ``params``'s
    order."""
    grads = {}
    for term in cap.terms:
        for name, a in term.inputs:
            grads[name] = _tangent._contract.dense_grad(term, a)
    return torch.cat([grads[name] for name in params], dim=2)


@pytest.mark.parametrize("kind", sorted(_FOLDS))
def test_batch_norm_folded_into_its_convolution(kind, monkeypatch):
    # An eval BatchNorm called on a convolution's output and on nothing else is folded
    # into it in the Gram's captures: its output is the convolution's site (a gradient
    # edge, its values not held), its backward goes straight to the convolution's input
    # by the scaled weight, the convolution's gradient is formed from that backprop and
    # scaled per channel, BatchNorm's weight gradient from <W, G> (no division by gamma:
    # gamma == 0 entries). Pairs that must not fold (affine=False, a BatchNorm after
    # another op, the output read elsewhere before or after the BatchNorm, frozen
    # BatchNorm parameters) are left as they are. Against the autograd loop of a float64
    # copy: the Gram, and the capture's per-sample gradients both where the caller forms
    # the weights (their gradients formed in the capture) and where it does not (the
    # pre-norm output recomputed for BatchNorm's weight gradient).
    module, params, X = _conv_bn_problem(kind)
    J = _subset_jacobian(module, params, X)
    folds = []
    real = _capture.fold_batch_norm
    monkeypatch.setattr(_capture, "fold_batch_norm",
                        lambda use, z, *a: folds.append(tuple(z.shape)) or real(use, z, *a))
    K = tangent_gram(module, params, X, output="full")
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))
    assert folds
    weights = frozenset(name for name in params if name.startswith("conv"))
    for formed in (frozenset(), weights):
        folds.clear()
        cap = capture(module, params, X, [0, 1, 2], memory_budget=2**24, formed=formed,
                      fold_bn=True, copy_sites=False)
        assert cap.fallback == ()
        _close(_term_gradients(cap, params), J)
        assert cap.fold_bn is (kind != "output read after")
        # The first pair folds in every capture that keeps folding, the second where it
        # may: a capture that found a folded output read elsewhere ran again unfolded.
        assert len(folds) == (1 + _FOLDS[kind] if cap.fold_bn else 2)
    module32 = module.float()
    params32 = {k: v.float() for k, v in params.items()}
    _close(tangent_gram(module32, params32, X.float(), output="full"),
           torch.einsum("ncp,mdp->ncmd", J, J), 1e-5)


def test_batch_norm_folded_into_a_convolution_formed_in_the_capture(monkeypatch):
    # Where the caller forms the weights, the capture forms them from the BatchNorm
    # output's backprop and scales them per channel, BatchNorm's weight gradient taken
    # from <W, G> (gamma == 0 entries: exact): by oneDNN's grouped weight gradient
    # (_layers._conv_formed: float32, 16 input channels, more positions than outputs x
    # channels) for the second convolution, from its patches for the first (2 input
    # channels). Against the autograd loop of a float64 copy, to float32 rounding.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                           nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1), nn.BatchNorm2d(8),
                           nn.ReLU(), nn.Flatten(2), _Mean(), nn.Linear(8, 3))
    for m in (module[1], module[4]):
        m.running_mean.uniform_(-0.5, 0.5)
        m.running_var.uniform_(0.5, 2.0)
        m.weight.data.uniform_(0.5, 1.5)
        m.bias.data.uniform_(-0.5, 0.5)
    module[4].weight.data[::3] = 0.0
    module.eval()
    params = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(7, 2, 6, 6)
    J = _subset_jacobian(module, params, X.double())
    formed = []
    real = _layers._conv_formed
    monkeypatch.setattr(_layers, "_conv_formed",
                        lambda *a: (lambda t: formed.append(t is not None) or t)(real(*a)))
    cap = capture(module, params, X, [0, 1, 2], memory_budget=2**24, copy_sites=False,
                  formed=frozenset({"0.weight", "3.weight"}), fold_bn=True)
    assert formed == [False, True]  # oneDNN's for the second convolution only
    assert all(t.inputs[0][1] is None for t in cap.terms  # both weights' formed
               if t.inputs[0][0] in ("0.weight", "3.weight"))
    _close(_term_gradients(cap, params), J, 1e-5)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J),
           1e-5)


def test_batch_norm_folded_into_a_1d_convolution_formed_from_its_patches(monkeypatch):
    # A folded convolution's weight formed in the capture takes oneDNN's grouped weight
    # gradient (_layers._conv_formed) for 2-D convolutions only, as an unfolded one
    # (formed_terms): a folded Conv1d took it too (s49 review). Against the autograd loop
    # of a float64 copy, to float32 rounding.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv1d(16, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(),
                           _Mean(), nn.Linear(4, 2))
    module[1].running_mean.uniform_(-0.5, 0.5)
    module[1].running_var.uniform_(0.5, 2.0)
    module.eval()
    params = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(3, 16, 40)
    J = _subset_jacobian(module, params, X.double())
    formed = []
    real = _layers._conv_formed
    monkeypatch.setattr(_layers, "_conv_formed",
                        lambda *a: (lambda t: formed.append(t is not None) or t)(real(*a)))
    cap = capture(module, params, X, [0, 1], memory_budget=2**24, copy_sites=False,
                  formed=frozenset({"0.weight"}), fold_bn=True)
    assert formed == []
    assert all(t.inputs[0][1] is None for t in cap.terms if t.inputs[0][0] == "0.weight")
    _close(_term_gradients(cap, params), J, 1e-5)


class _Mean(nn.Module):
    def forward(self, x):
        return x.mean(-1)


class _FoldInteractions(nn.Module):
    """Convolution + eval BatchNorm pairs in the settings the fold's own test
    (``_ConvBatchNorm``) leaves out: ``kind`` picks one."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 6, 3, padding=2, dilation=2, groups=3, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(6, momentum=None)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2, self.bn3 = nn.BatchNorm2d(6), nn.BatchNorm2d(6)
        if kind == "shared weight":
            self.conv3 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
            self.conv3.weight = self.conv2.weight
        if kind == "hooks":
            self.bn.register_forward_hook(lambda m, args, out: 2.0 * out + 0.1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        z = self.conv2(h)
        if self.kind == "two BatchNorms of one output":
            y = torch.relu(self.bn2(z)) + torch.tanh(self.bn3(z))
        elif self.kind == "convolution called twice":
            y = self.bn3(self.conv2(torch.relu(self.bn2(z))))
        elif self.kind == "shared weight":
            y = self.bn3(self.conv3(torch.relu(self.bn2(z))))
        else:
            y = self.bn2(z)
        return self.head(torch.relu(y).flatten(2).mean(2))


@pytest.mark.parametrize("kind", ["hooks", "two BatchNorms of one output",
                                  "convolution called twice", "shared weight"])
def test_batch_norm_fold_interactions(kind, monkeypatch):
    # The fold (session s49) under a depthwise, dilated, reflect-padded convolution whose
    # BatchNorm has momentum=None (eval: its running statistics), gammas of both signs
    # and exact zeros, with a forward hook rewriting a folded BatchNorm's output, two
    # BatchNorms reading one convolution's output (the second read breaks the fold: run
    # again unfolded), a convolution called twice, a weight shared by two convolutions.
    # K(X, X) and K(X, Y) ("full"), its diagonal and the tangent features against the
    # autograd loop of a float64 copy (review of the fold, s49; BatchNorm's scale taken
    # without gamma, or the convolution's bias left out of the shift, fails each kind but
    # the broken one, which runs unfolded).
    torch.manual_seed(0)
    module = _FoldInteractions(kind)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(-1.5, 1.5)
            m.weight.data[::3] = 0.0
            m.bias.data.uniform_(-0.5, 0.5)
    module = module.eval().double()
    params = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in module.named_parameters()}
    X, Y = torch.randn(7, 3, 6, 6, dtype=torch.float64), torch.randn(4, 3, 6, 6,
                                                                    dtype=torch.float64)
    JX, JY = _subset_jacobian(module, params, X), _subset_jacobian(module, params, Y)
    folds = []
    real = _capture.fold_batch_norm
    monkeypatch.setattr(_capture, "fold_batch_norm",
                        lambda use, z, *a: folds.append(1) or real(use, z, *a))
    # Without the one-sample autograd check, which would send a layer whose fold gave
    # wrong terms to the fallback (right, unfolded): the fold's own numbers.
    kw = {"check_hidden": False}
    _close(tangent_gram(module, params, X, output="full", **kw),
           torch.einsum("ncp,mdp->ncmd", JX, JX))
    _close(tangent_gram(module, params, X, Y, output="full", **kw),
           torch.einsum("ncp,mdp->ncmd", JX, JY))
    _close(tangent_gram_diag(module, params, X, **kw), torch.einsum("ncp,ncp->n", JX, JX) / 3)
    _close(tangent_features(module, params, X, output="full", **kw), JX)
    assert folds


def test_batch_norm_fold_keeps_the_forward_values_and_frees_the_outputs():
    # The folded BatchNorm's output is the layer's own eval batch norm of the
    # convolution's output, bit for bit (the network's outputs do not move), and neither
    # that output nor the convolution's is held by the capture: the probe's graph of the
    # small ResNet loses both tensors of each pair. The tests of memory_budget and of
    # the kept forward passes' bytes measure what the plan then holds.
    module, params, X = _resnet_problem(8, torch.float32)
    f = {}

    def run(fold):
        handle = module.head.register_forward_hook(
            lambda m, args, out: f.__setitem__(fold, out.detach().clone()))
        try:
            cap = capture(module, params, X, [0, 1], memory_budget=2**24,
                          measure_graph=True, copy_sites=False, fold_bn=fold)
        finally:
            handle.remove()
        return cap.graph_bytes

    unfolded, folded = run(False), run(True)
    assert torch.equal(f[False], f[True])
    # Two pairs of (n, 8, 6, 6) float32, a convolution's output and BatchNorm's each,
    # less the folds' saved scales (8 floats a pair).
    assert unfolded - folded == 2 * 2 * X.shape[0] * 8 * 36 * 4 - 2 * 8 * 4


def test_batch_norm_sums_of_an_output_that_does_not_reach_it_are_zero():
    # Output 1 does not depend on the BatchNorm: its sums are zero (no hook runs),
    # against the dense Jacobians, through both outputs' and one output's captures.
    torch.manual_seed(0)
    module = _TwoBranches()
    _bn_stats(module)
    module = module.eval().double()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(9, 2, 6, 6, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    _close(tangent_gram(module, params, X, output=1), J[:, 1] @ J[:, 1].T)
    _close(tangent_features(module, params, X, output="full"), J)
    cap = capture(module, params, X, [0, 1], memory_budget=2**20)
    bn = [t for t in cap.terms if t.inputs[0][0].startswith("bn.")]
    assert len(bn) == 2 and all(not t.delta[:, 1].any() and t.delta[:, 0].any() for t in bn)



class _BatchNormUsedTwice(nn.Module):
    """An eval BatchNorm whose output is read twice (its backprop the sum of two paths),
    feeding a second BatchNorm (whose input is the first one's output)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.bn2 = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)
        self.sq = nn.Linear(6, 3)

    def forward(self, x):
        z = self.bn(self.lin(x))
        return self.head(self.bn2(z)) + self.sq(z * z)


_BN_NETS = {
    "used twice, chained": lambda: _BatchNormUsedTwice(),
    # The in-place ReLU after a Tanh rewrites a saved tensor: the forward runs again with
    # its saved tensors copy-on-write (_saved.py); the hooks are registered after it.
    "rewritten saved tensor": lambda: nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.ReLU(inplace=True), nn.BatchNorm1d(6),
        nn.ReLU(inplace=True), nn.Linear(6, 3)),
    "last layer": lambda: nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3)),
}


@pytest.mark.parametrize("kind", sorted(_BN_NETS))
def test_batch_norm_sums_through_shared_rewritten_and_kept_graphs(kind):
    # The hooks' BatchNorm sums (review s47-rev3) where the site's backprop gathers two
    # paths, the forward runs twice for a rewritten saved tensor, the BatchNorm is the
    # output itself; through the Gram, a contraction (weights) and captures of output
    # groups sharing one kept forward pass (each group's hooks removed before the next):
    # against the autograd loop of an out-of-place float64 copy.
    torch.manual_seed(0)
    module = _BN_NETS[kind]()
    for m in module.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 1.5)
    module = module.eval().double()
    params = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(7, 5, dtype=torch.float64)
    ref = copy.deepcopy(module)
    for m in ref.modules():
        if hasattr(m, "inplace"):
            m.inplace = False
    J = _loop_jacobian(ref, params, X)
    _close(tangent_gram(module, params, X, output="full"), torch.einsum("ncp,mdp->ncmd", J, J))
    offsets = dict(zip(params, itertools.accumulate((p.numel() for p in params.values()),
                                                     initial=0)))
    bn = {f"{prefix}.{p}" for prefix, m in module.named_modules()
          if isinstance(m, nn.BatchNorm1d) for p in ("weight", "bias")}

    def check(cap, grads):
        # The terms that are per-sample gradients (constant inputs): BatchNorm's all.
        seen = set()
        for term in cap.terms:
            name = term.inputs[0][0]
            if term.inputs[0][1] is None:
                a = offsets[name]
                _close(term.delta.reshape(*grads.shape[:2], -1),
                       grads[:, :, a:a + params[name].numel()])
                seen.add(name)
        assert bn <= seen

    w = torch.randn(7, 3, dtype=torch.float64)
    check(capture(module, params, X, [0, 1, 2], memory_budget=2**24, weights=w),
          torch.einsum("ncp,nc->np", J, w).unsqueeze(1))
    kept, scratch = {}, []
    caps = [(capture(module, params, X, group, memory_budget=2**24, kept=kept, last=last,
                     scratch=scratch), group) for group, last in (([0, 1], False), ([2], True))]
    assert not kept
    for cap, group in caps:  # a hook left on the kept graph would rewrite the first's
        check(cap, J[:, group])


def _bn_stats(module):
    """Random running statistics for every BatchNorm2d of ``module``."""
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.8, 1.2)


@pytest.mark.parametrize("padding", [0, 1])
def test_unpadded_convolution_patches_are_not_copied_by_pad(padding, monkeypatch):
    # F.pad copies its input even with no padding (a 1x1 stride-2 shortcut's whole input,
    # four times its patches): a convolution without padding takes its patches from the
    # input itself. Against the dense Jacobians.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 3, 1, stride=2, padding=padding), nn.ReLU(),
                           nn.Conv2d(3, 4, 3, padding=padding), nn.Flatten(),
                           nn.LazyLinear(2)).double()
    X = torch.randn(7, 2, 8, 8, dtype=torch.float64)
    module(X)
    params = {k: v.detach() for k, v in module.named_parameters()}
    pads = []
    real = F.pad
    monkeypatch.setattr(F, "pad", lambda x, pad, *a, **k: pads.append(tuple(pad))
                        or real(x, pad, *a, **k))
    K = tangent_gram(module, params, X, output="full")
    assert all(any(p) for p in pads) and bool(pads) == bool(padding)
    monkeypatch.setattr(F, "pad", real)
    J = _loop_jacobian(module, params, X)
    _close(K, torch.einsum("ncp,mdp->ncmd", J, J))


def _record_syrks(monkeypatch):
    """Record the rows and alpha of every SYRK update, and the terms added after them."""
    alphas, panel_terms = [], []
    real_syrk, real_add = _gram._syrk, _gram._add_upper

    def syrk(acc):
        update = real_syrk(acc)
        return lambda g, alpha: alphas.append((g.shape, alpha)) or update(g, alpha)

    monkeypatch.setattr(_gram, "_syrk", syrk)
    monkeypatch.setattr(_gram, "_add_upper", lambda K, terms, *a: panel_terms.append(
        [t.inputs[0][0] for t in terms]) or real_add(K, terms, *a))
    return alphas, panel_terms


@pytest.mark.parametrize("output", ["trace", 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_symmetric_gram_of_formed_blocks_by_syrk(output, dtype, monkeypatch):
    # A symmetric block of 130 rows: the convolutions' formed blocks (dense rows) take a
    # BLAS SYRK each (the upper triangle, mirrored) where SciPy's BLAS is a process-wide
    # OpenBLAS, the head's rank-one term is added by panels of rows (elsewhere the panels
    # take every term); against the dense Jacobians, exactly symmetric, and a float64 K
    # is the float32 one converted bit for bit.
    module, params, X = _resnet_problem(130, dtype)
    alphas, panel_terms = _record_syrks(monkeypatch)
    K = tangent_gram(module, params, X, output=output, check_hidden=False)
    if _stacked._blas_process_wide():
        # The two convolutions' formed weights and the BatchNorms' weights and biases by
        # SYRK, 1 / C each; the head's weight and bias (rank-one, kept factored) added by
        # panels of rows after them.
        alpha = 1 / 3 if output == "trace" else 1
        assert [(shape[0], a) for shape, a in alphas] == [(130, alpha)] * 6
        assert panel_terms == [["head.weight"]]
    else:
        assert not alphas and not panel_terms
    assert torch.equal(K, K.T)
    J = _loop_jacobian(module, params, X)
    ref = torch.einsum("ncp,mcp->nm", J, J) / 3 if output == "trace" else J[:, 2] @ J[:, 2].T
    _close(K, ref, 1e-5 if dtype == torch.float32 else RTOL)
    if dtype == torch.float32:
        wide = tangent_gram(module, params, X, output=output, check_hidden=False,
                            out_dtype=torch.float64)
        assert torch.equal(wide, K.to(torch.float64))
    # Below SYRK_MIN_ROWS the panels take every term: the same K to rounding.
    monkeypatch.setattr(_gram, "SYRK_MIN_ROWS", 131)
    alphas.clear()
    _close(tangent_gram(module, params, X, output=output, check_hidden=False), K,
           1e-5 if dtype == torch.float32 else 1e-13)
    assert not alphas


class _TinyUNet(nn.Module):
    """The user trial's DDPM denoiser (benchmarks/trial_generative.py) at a test's size:
    an embedding of the timestep read from the input, GroupNorm, a strided convolution,
    ConvTranspose2d and a skip; the whole predicted image is the output."""

    def __init__(self, c=4):
        super().__init__()
        self.temb = nn.Embedding(5, c)
        self.cin = nn.Conv2d(1, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.upt = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.out = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(self, x):
        t = x[:, 1, 0, 0].round().long()
        h = F.silu(self.norm(self.cin(x[:, :1]) + self.temb(t)[:, :, None, None]))
        return self.out(torch.cat([self.upt(F.silu(self.down(h))), h], 1)).flatten(1)


def _unet_problem(n, dtype):
    torch.manual_seed(0)
    module = _TinyUNet().to(dtype)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.cat([torch.randn(n, 1, 4, 4, dtype=dtype),
                   torch.randint(5, (n, 1, 1, 1)).to(dtype).expand(n, 1, 4, 4)], 1)
    return module, params, X


@pytest.mark.parametrize("problem, n, n_out", [("resnet", 45, 3), ("resnet", 130, 1),
                                               ("unet", 9, 16)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_gram_of_formed_blocks_by_syrk(problem, n, n_out, dtype, monkeypatch):
    # "full" blocks of formed gradients (session s53): a symmetric block is the square of
    # its (n C) rows of sample and output, one SYRK per formed term and the other terms
    # (the head's rank-one term; the U-Net's embedding and position pairs) added by panels
    # of samples; the blocks off the diagonal (a small budget), K(X, Y) and blocks_last take
    # one GEMM per term into the block's square. Against the dense float64 Jacobians:
    # an odd n, one output, 16 outputs; exactly symmetric; a float64 K of a float32
    # network is the float32 K converted bit for bit.
    if problem == "unet":
        module, params, X = _unet_problem(n, dtype)
    else:
        module, params, X = _resnet_problem(n, dtype, n_out)
    Y = X[: n // 2 + 1] * 0.5
    alphas, panel_terms = _record_syrks(monkeypatch)
    kw = dict(output="full", check_hidden=False)
    K = tangent_gram(module, params, X, **kw)
    if _stacked._blas_process_wide():
        assert alphas and all(a == 1 and shape[0] == n * n_out for shape, a in alphas)
        # The U-Net's embedding (an index term) and its 2 x 2 strided convolution (four
        # positions: position pairs) by panels.
        assert panel_terms == [["temb.weight", "down.weight"] if problem == "unet"
                               else ["head.weight"]]
    C = n_out
    assert torch.equal(K, K.permute(2, 3, 0, 1))
    JX, JY = _loop_jacobian(module, params, X), _loop_jacobian(module, params, Y)
    rtol = 1e-5 if dtype == torch.float32 else RTOL
    _close(K, torch.einsum("ncp,mdp->ncmd", JX, JX), rtol)
    _close(tangent_gram(module, params, X, Y, **kw), torch.einsum("ncp,mdp->ncmd", JX, JY),
           rtol)
    last = tangent_gram(module, params, X, blocks_last=True, **kw)
    assert torch.equal(last, K.permute(0, 2, 1, 3))
    if dtype == torch.float32:
        wide = tangent_gram(module, params, X, out_dtype=torch.float64, **kw)
        assert torch.equal(wide, K.to(torch.float64))
    # A small budget: chunks of a few rows (the U-Net: several row blocks, the diagonal
    # ones by panels, the others by one GEMM per term into their squares).
    squares = []
    real = _gram._square
    monkeypatch.setattr(_gram, "_square", lambda out: squares.append(out.shape) or real(out))
    split = tangent_gram(module, params, X, memory_budget=2**21, **kw)
    if problem == "unet":
        assert any(shape[0] != shape[2] for shape in squares)
    assert torch.equal(split, split.permute(2, 3, 0, 1))
    _close(split, K, rtol)
    # The panels of every term, as before session s53: the same K to rounding.
    monkeypatch.setattr(_gram, "FULL_SYRK", False)
    alphas.clear()
    _close(tangent_gram(module, params, X, **kw), K, 1e-5 if dtype == torch.float32 else 1e-13)
    assert not alphas
    assert C == K.shape[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scalar_head_is_added_as_one_product(dtype, monkeypatch):
    # The head of a scalar output, one backprop number g per sample, is added as F F^T,
    # F = [g a, g], instead of (A A^T + 1) * (g g^T): against the dense Jacobians in one
    # block of all rows (the panels), in blocks of rows (the blocks off the diagonal),
    # K(X, Y) and "full"; exactly symmetric, and a float64 K is the float32 one converted
    # bit for bit.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Linear(16, 1)).to(dtype)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X, Y = torch.randn(300, 5, dtype=dtype), torch.randn(70, 5, dtype=dtype)
    widths = []
    real = _gram._folded
    monkeypatch.setattr(_gram, "_folded", lambda terms, weight, *rest: widths.extend(
        t.delta.shape[3] for t in real(terms, weight, *rest) if t.inputs[0][0] == "4.weight")
        or real(terms, weight, *rest))
    JX, JY = _loop_jacobian(module, params, X)[:, 0], _loop_jacobian(module, params, Y)[:, 0]
    rtol = 1e-5 if dtype == torch.float32 else RTOL
    for budget in (2**30, 2**17):
        widths.clear()
        K = tangent_gram(module, params, X, memory_budget=budget)
        # The head's 16 weights and its bias: one row of 17.
        assert widths and set(widths) == {17}
        assert torch.equal(K, K.T)
        _close(K, JX @ JX.T, rtol)
        wide = tangent_gram(module, params, X, memory_budget=budget, out_dtype=torch.float64)
        assert torch.equal(wide, K.to(torch.float64))
        _close(tangent_gram(module, params, X, Y, memory_budget=budget), JX @ JY.T, rtol)
        full = tangent_gram(module, params, X, Y, output="full", memory_budget=budget)
        _close(full[:, 0, :, 0], JX @ JY.T, rtol)


def test_float64_gram_of_a_float32_block_takes_the_float32_route(monkeypatch):
    # One symmetric block of 400 rows of formed blocks (2,000+ numbers each): at a small
    # budget the SYRK's square does not fit an eighth of it, for a float32 K (which the
    # SYRK could write into directly) as for a float64 one, so both take the panels; at a
    # large budget both take the SYRK. Either way the float64 K is the float32 one
    # converted bit for bit (the SYRK and the panels round differently).
    module, params, X = _resnet_problem(400, torch.float32)
    routes, blocks = [], []
    real_block, real_syrk_block = _gram._symmetric_block, _gram._syrk_block
    monkeypatch.setattr(_gram, "_symmetric_block", lambda terms, mode, w, layout, out, *a: (
        blocks.append(tuple(out.shape)) or real_block(terms, mode, w, layout, out, *a)))
    monkeypatch.setattr(_gram, "_syrk_block", lambda *a: routes.append(real_syrk_block(*a))
                        or routes[-1])
    syrk = _stacked._blas_process_wide()
    J = _loop_jacobian(module, params, X)
    ref = torch.einsum("ncp,mcp->nm", J, J) / 3
    for budget, expected in ((19 * 2**18, False), (2**30, syrk)):
        grams = []
        for out_dtype in (torch.float32, torch.float64):
            routes.clear()
            blocks.clear()
            grams.append(tangent_gram(module, params, X, memory_budget=budget,
                                      check_hidden=False, out_dtype=out_dtype))
            # One block of all rows, and the SYRK's square over an eighth of the small
            # budget.
            assert blocks == [(400, 400)] and routes == [expected]
            assert (4 * 400 * 400 > budget // 8) == (budget < 2**30)
        assert torch.equal(grams[1], grams[0].to(torch.float64))
        _close(grams[1], ref, 1e-5)


@pytest.mark.parametrize("signs", ["mixed", "nonnegative"])
def test_weighted_symmetric_gram_of_formed_blocks_and_the_syrk(signs, monkeypatch):
    # A preconditioned symmetric Gram of 130 rows: with D >= 0 the blocks are formed
    # scaled by sqrt(D) and the SYRK takes them (where SciPy's BLAS allows); a D with
    # negative entries reaches the products as a weight, and the SYRK (unweighted) must
    # not take its formed blocks. Against the dense Jacobians' J D J^T.
    module, params, X = _resnet_problem(130)
    n_params = sum(p.numel() for p in params.values())
    D = torch.rand(n_params, dtype=torch.float64) + 0.5
    if signs == "mixed":
        D[::3] *= -1
    alphas, _ = _record_syrks(monkeypatch)
    K = tangent_gram(module, params, X, diag_weight=D, check_hidden=False)
    assert bool(alphas) == (signs == "nonnegative" and _stacked._blas_process_wide())
    J = _loop_jacobian(module, params, X)
    _close(K, torch.einsum("ncp,p,mcp->nm", J, D, J) / 3)
    assert torch.equal(K, K.T)


def test_syrk_into_a_strided_view_or_its_own_square_within_the_budget():
    # Blocks of a larger Gram are strided views: the SYRK's square is then a buffer of
    # its own, written into the view once; taken only where it and the other terms'
    # panel fit the bytes given, also into a contiguous block. 300 rows: the triangle is
    # mirrored in more than one panel of rows. Where SciPy's BLAS is not a process-wide
    # OpenBLAS, nothing is written and the panels compute the block.
    torch.manual_seed(0)
    module = _SmallResNet(3).double().eval()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(300, 2, 6, 6, dtype=torch.float64)
    cap = capture(module, params, X, [0, 1, 2], memory_budget=2**30)
    terms = _gram._formed(cap.terms, frozenset({"stem.0.weight", "conv.weight"}), order="any")
    layout = _gram._layout(params)
    ref = torch.empty(300, 300, dtype=torch.float64)
    _gram._symmetric_panels(terms, "trace", None, layout, ref)
    J = _loop_jacobian(module, params, X)
    _close(ref, torch.einsum("ncp,mcp->nm", J, J) / 3)
    syrk = _stacked._blas_process_wide()

    def block(rows, out, spare):
        # The SYRK where expected (nothing written where not), else the panels.
        taken = _gram._syrk_block(rows, "trace", None, layout, out, spare)
        assert taken == (syrk and spare >= need)
        if not taken:
            assert out.isnan().all()
            _gram._symmetric_panels(rows, "trace", None, layout, out)

    # The square (300^2) and the head's rank-one panel: 256 rows, the block and its
    # two factors' products.
    need = 300 * 300 * 8 + 256 * 300 * 3 * 8
    assert _gram._syrk_bytes([t for t in terms if t.inputs[0][0] == "head.weight"], 300,
                             "trace", 8) == need
    whole = torch.full((300, 400), math.nan, dtype=torch.float64)
    view = whole[:, 50:350]
    assert not _gram._syrk_block(terms, "trace", None, layout, view, need - 1)
    assert whole.isnan().all()
    block(terms, view, need)
    _close(view, ref, 1e-13)
    assert torch.equal(view, view.T)
    assert whole[:, :50].isnan().all() and whole[:, 350:].isnan().all()
    # Into a contiguous block directly (within the same bytes: the same route as the
    # view's), the same Gram bit for bit.
    direct = torch.full((300, 300), math.nan, dtype=torch.float64)
    assert not _gram._syrk_block(terms, "trace", None, layout, direct, need - 1)
    block(terms, direct, need)
    assert torch.equal(direct, view)
    # Dense rows alone (no panels before the SYRKs): from zero, not from the buffer.
    rows = [t for t in terms if t.inputs[0][0] != "head.weight"]
    assert len(rows) == len(terms) - 1
    _gram._symmetric_panels(rows, "trace", None, layout, ref)
    direct.fill_(math.nan)
    need = 300 * 300 * 8
    block(rows, direct, need)
    _close(direct, ref, 1e-13)


@pytest.mark.parametrize("launch_bound", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_conv_trace_at_a_small_budget_in_output_groups_and_chunks(cross, launch_bound,
                                                                  monkeypatch):
    # The ResNet row's plan at N = 1024 (its ten outputs' formed blocks exceed the
    # budget: groups of outputs, each block formed a chunk of rows at a time), set up
    # by the budget alone: the smallest one (1/64-octave grid) that splits the six
    # outputs in three groups. Every row of each side is captured once per group, in
    # chunks smaller than the block, and K is the dense Jacobians' trace. On a GPU
    # (``launch_bound``) the chunks are larger, within what the kept blocks and the
    # groups' two sums leave of the budget.
    monkeypatch.setattr(_gram, "_wide_chunks", lambda device: launch_bound)
    torch.manual_seed(0)
    module = _SmallResNet(6).double()
    _bn_stats(module)
    module.eval()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(160, 2, 6, 6, dtype=torch.float64)
    Y = torch.randn(60, 2, 6, 6, dtype=torch.float64) if cross else None
    n_y = len(X) if Y is None else len(Y)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    budget = _budget_with_groups(probe, len(X), n_y, None, Y is None, 8, 3)
    while launch_bound:
        # The largest budget (same grid) of three groups: room for the GPU's wider chunks.
        wider = int(budget * 2 ** (1 / 64)) + 1
        if len(_gram._output_groups(probe, len(X), n_y, "trace", None, Y is None, wider,
                                    8)) != 3:
            break
        budget = wider
    groups = _gram._output_groups(probe, len(X), n_y, "trace", None, Y is None, budget, 8)
    assert sum(groups, []) == list(range(6))
    chunks = set()
    for columns in groups:
        part = _gram._probe_outputs(probe, columns)
        dense, kept, _, _ = _gram._gram_plan(part, len(X), n_y, "trace", False, Y is None,
                                             budget, 8)
        assert dense, "the convolutions' terms must be formed for this test"
        chunk, share = _gram._dense_shares(part, kept, budget)
        # The kept blocks in their share, a chunk's capture in the rest.
        assert kept * (len(X) + (0 if Y is None else n_y)) <= share
        assert share + chunk * _gram._chunk_row_bytes(part, kept) // 8 <= budget
        chunks.add(chunk)
    (chunk,) = chunks
    assert chunk < n_y

    seen = []
    real = _gram.capture
    monkeypatch.setattr(_gram, "capture", lambda *a, **k: seen.append(
        (a[2].shape[0], tuple(a[3]))) or real(*a, **k))
    K = tangent_gram(module, params, X, Y, memory_budget=budget, check_hidden=False)
    assert seen[0] == (1, tuple(range(6)))
    assert [outputs for _, outputs in seen[1:]] == sorted(outputs for _, outputs in seen[1:])
    sums = 8 * len(X) * n_y * 2
    for columns in groups:
        rows = [r for r, outputs in seen[1:] if outputs == tuple(columns)]
        assert sum(rows) == len(X) + (0 if Y is None else n_y)
        if not launch_bound:
            assert max(rows) == chunk
            continue
        part = _gram._probe_outputs(probe, columns)
        kept = _gram._gram_plan(part, len(X), n_y, "trace", False, Y is None, budget, 8)[1]
        captured = _gram._chunk_row_bytes(part, kept) // 8
        # (At three groups the symmetric plan leaves no room for more rows; the cross
        # plan does.)
        assert max(rows) > chunk if cross else max(rows) == chunk
        assert max(rows) * captured + kept * (len(X) + (0 if Y is None else n_y)) + sums \
            <= budget
    JX = _loop_jacobian(module, params, X)
    JY = JX if Y is None else _loop_jacobian(module, params, Y)
    _close(K, torch.einsum("ncp,mcp->nm", JX, JY) / 6)


def test_grouped_float64_output_is_the_converted_float32_gram():
    torch.manual_seed(1)
    module = _Tokens(4)
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(200, 32)
    probe = capture(module, params, X[:1], list(range(4)), memory_budget=2**20)
    budget = _budget_with_groups(probe, len(X), len(X), None, True, 4, 2)
    ref = tangent_gram(module, params, X, memory_budget=budget)
    K = tangent_gram(module, params, X, memory_budget=budget, out_dtype=torch.float64)
    assert torch.equal(K, ref.to(torch.float64))
    _close(ref, tangent_gram(module, params, X), 1e-5)


# ------------------------------------------------------------ wider output dtype
@pytest.mark.parametrize("kind", ["mlp", "conv", "norule"])
@pytest.mark.parametrize("weighted", [False, True])
def test_float64_output_of_a_float32_gram_is_the_converted_gram(kind, weighted, monkeypatch):
    # A float32 network's K written as float64 panel by panel is, bit for bit, its float32
    # Gram converted afterwards: one block and panels of 4 and 2 rows, many blocks at the
    # smallest budget, symmetric and cross, every output form.
    module, params, X, Y = _make(kind, 2, dtype=torch.float32)
    D = None
    if weighted:
        n_params = sum(p.numel() for p in params.values())
        D = torch.rand(n_params, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(_gram, "_panel_rows", lambda device, width=0: (4, 2))
    # The fallback at one row per block is slow: it checks "full" only.
    for output in ("trace", 1, "full") if kind != "norule" else ("full",):
        for Z in (None, Y):
            kw = dict(output=output, diag_weight=D)
            ref = tangent_gram(module, params, X, Z, **kw)
            assert ref.dtype == torch.float32
            K = tangent_gram(module, params, X, Z, out_dtype=torch.float64, **kw)
            assert K.dtype == torch.float64 and torch.equal(K, ref.to(torch.float64))
            small = _at_smallest_budget(tangent_gram, module, params, X, Z, **kw)
            wide = _at_smallest_budget(tangent_gram, module, params, X, Z,
                                       out_dtype=torch.float64, **kw)
            assert torch.equal(wide, small.to(torch.float64))
    # And against the float64 autograd loop, to float32 round-off.
    J = _loop_jacobian(module, params, X)
    weight = torch.ones(J.shape[2], dtype=torch.float64) if D is None else D.double()
    full = torch.einsum("ncp,p,mdp->ncmd", J, weight, J)
    _close(tangent_gram(module, params, X, output="full", diag_weight=D,
                        out_dtype=torch.float64), full, 1e-5)


@pytest.mark.parametrize("output", ["trace", 1])
def test_small_captures_grow_to_min_chunk_within_a_quarter_of_the_budget(output, monkeypatch):
    # A budget whose eighth holds 4 rows of a capture, and whose quarter 8: the blocks
    # are captured 8 rows at a time (the floor, lowered here to 12, capped by the
    # quarter), with the blocks in the rest, and K still equals J J^T.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(),
                           nn.Conv2d(4, 3, 3, padding=1), nn.Flatten(),
                           nn.Linear(3 * 36, 3)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(30, 2, 6, 6, dtype=torch.float64)
    _, outputs, mode, probe = _gram._prepare(module, params, X, output, 2**30)
    dense, kept, _, _ = _gram._gram_plan(probe, 30, 30, mode, False, True, 2**30, 8)
    assert dense, "the convolutions' terms must be formed for this test"
    captured = probe.capture_bytes() + kept
    budget = 32 * captured
    monkeypatch.setattr(_gram, "MIN_CHUNK", 12)
    # The eighth's plan (the CPU's wide chunks would take what the blocks leave).
    monkeypatch.setattr(_gram, "_wide_chunks", lambda device: False)
    chunks = []
    real = _gram._Blocks.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        chunks.append(self.chunk)

    monkeypatch.setattr(_gram._Blocks, "__init__", spy)
    K = tangent_gram(module, params, X, output=output, memory_budget=budget)
    assert chunks == [8]
    J = jacobian_loop(module, X)
    J = J if output == "trace" else J[:, output : output + 1]
    expected = torch.einsum("ncp,mcp->nm", J, J) / J.shape[1]
    assert torch.allclose(K, expected, rtol=RTOL, atol=RTOL * expected.abs().max())


@pytest.mark.parametrize("cross", [False, True])
def test_launch_bound_chunks_take_what_the_kept_blocks_leave(cross, monkeypatch):
    # On a GPU (forced here) a capture costs its launches whatever its rows: where every
    # formed block is kept, a chunk takes what they and a block pair's products leave of
    # the budget, not an eighth of it. Fewer, larger captures, the same K as the loop,
    # and what the plan holds stays within the budget.
    module, params, X = _resnet_problem(90)
    Y = torch.randn(40, 2, 6, 6, dtype=torch.float64) if cross else None
    n_y, n_kept = (90, 90) if Y is None else (40, 130)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    dense, kept, _, _ = _gram._gram_plan(probe, 90, n_y, "trace", False, Y is None, 2**30, 8)
    assert dense, "the convolutions' terms must be formed for this test"
    captured = _gram._chunk_row_bytes(probe, kept) // 8
    # A budget whose eighth holds 8 rows of a capture and that keeps every block.
    budget = 64 * captured + kept * n_kept
    cpu_chunk, share = _gram._dense_shares(probe, kept, budget)
    assert _gram._keeps_all(dense, kept, n_kept, budget, share)

    def captures(launch_bound):
        monkeypatch.setattr(_gram, "_wide_chunks", lambda device: launch_bound)
        seen = []
        real = _gram.capture
        monkeypatch.setattr(_gram, "capture", lambda *a, **k: seen.append(a[2].shape[0])
                            or real(*a, **k))
        K, peak = cpu_peak_bytes(lambda: tangent_gram(module, params, X, Y, memory_budget=budget,
                                                      check_hidden=False))
        monkeypatch.setattr(_gram, "capture", real)
        # Measured, not the plan's own arithmetic: what the call held besides K.
        assert peak - K.nbytes <= budget, (launch_bound, peak - K.nbytes, budget)
        return K, seen[1:]  # after the probe

    K_cpu, cpu = captures(False)
    K_gpu, gpu = captures(True)
    assert max(cpu) == cpu_chunk < max(gpu)
    assert sum(cpu) == sum(gpu) == 90 + (0 if Y is None else 40)
    assert len(gpu) < len(cpu)
    JX = _loop_jacobian(module, params, X)
    JY = JX if Y is None else _loop_jacobian(module, params, Y)
    expected = torch.einsum("ncp,mcp->nm", JX, JY) / 3
    _close(K_gpu, expected)
    _close(K_cpu, expected)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("make", [LongAttention, lambda: _resnet_problem(1)[0].float(),
                                  lambda: _WideConvs(2)])
def test_a_grams_peak_memory_stays_within_the_budget(make, cross):
    # The contract of memory_budget: what a Gram holds besides its result stays within it,
    # measured (a budget of a few row blocks), also where the backward's largest
    # tensors belong to no parameter.
    torch.manual_seed(0)
    module = make()
    shape = (128, 8) if isinstance(module, LongAttention) else (2, 6, 6)
    X = torch.randn(48, *shape)
    Y = torch.randn(20, *shape) if cross else None
    params = {k: v.detach() for k, v in module.named_parameters()}
    # A few row blocks: the attention's capture needs 5.4 MiB for one sample.
    budget = 2**24 if isinstance(module, LongAttention) else 2**22
    tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
    K, peak = cpu_peak_bytes(lambda: tangent_gram(module, params, X, Y, memory_budget=budget))
    assert 0 < peak - K.nbytes <= budget, (peak - K.nbytes, budget)


def test_grouped_backwards_work_buffers_are_counted_by_the_chunk_plan():
    # oneDNN's grouped backward by weights (_layers._conv_formed) holds work buffers
    # besides the gradients it returns, sized by the library for the CPU: on an AVX2 one
    # 5x them for _WideConvs' dilated convolution, whose few positions give it small
    # patches, so that the chunk plan's four times its factors fell short (its Gram above
    # held 1.5% over the budget there). Measured on this CPU in a chunk of 8 rows of two
    # outputs: the call's peak within what the chunk plan counts for the layer (four times
    # its factors and _layers.formed_workspace). (The strided one has fewer positions
    # than outputs x channels: the patches' route.)
    torch.manual_seed(0)
    module = _WideConvs(2)
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(8, 2, 6, 6)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    counted = {t.inputs[0][0]: (4 * _gram._term_bytes(t), _layers.formed_workspace(t, 4))
               for t in probe.terms}
    assert [name for name, (_, extra) in counted.items() if extra] == ["conv.weight"]
    with torch.no_grad():
        a = F.pad(torch.relu(module.stem(X)), (2, 2, 2, 2), mode="reflect")
    weight = module.conv.weight
    delta = torch.randn(8, 2, 16, 6, 6)

    def formed():
        return torch.nn.grad.conv2d_weight(
            a.reshape(1, -1, *a.shape[2:]), (8 * 2 * 16, *weight.shape[1:]),
            delta.reshape(1, -1, 6, 6), 1, 0, 2, 8)

    formed()  # one-time allocations
    g, peak = cpu_peak_bytes(formed)
    assert g.nbytes < peak <= 8 * sum(counted["conv.weight"]), (peak, counted)
    # The call measured is the per-sample weight gradients (summed: the batch's).
    assert torch.allclose(g.view(8, 2, *weight.shape).sum((0, 1)), torch.func.grad(
        lambda w: (F.conv2d(a, w, dilation=2) * delta.sum(1)).sum())(weight), atol=1e-4)


def test_output_groups_of_unequal_widths_stay_within_the_budget():
    # Five outputs in two groups of unequal widths (two and three outputs): the second
    # group's wider blocks are formed in the buffers of the first's. Growing them one at a
    # time while the narrower ones were still held took the largest of the first group's
    # blocks beside all of the second's, beyond the budget; measured, not the plan's
    # arithmetic.
    module, params, X = _resnet_problem(160, torch.float32, n_out=5)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    budget = _budget_with_groups(probe, len(X), len(X), None, True, 4, 2)
    groups = _gram._output_groups(probe, len(X), len(X), "trace", None, True, budget, 4)
    assert sorted(map(len, groups)) == [2, 3]
    tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
    K, peak = cpu_peak_bytes(lambda: tangent_gram(module, params, X, memory_budget=budget,
                                                  check_hidden=False))
    assert peak - K.nbytes <= budget, (peak - K.nbytes, budget)
    JX = _loop_jacobian(module.double(), {k: v.double() for k, v in params.items()},
                        X.double())
    _close(K.double(), torch.einsum("ncp,mcp->nm", JX, JX) / 5, 1e-5)


class _WideConvs(nn.Module):
    """Convolutions whose weights' per-sample gradients a float32 Gram on the CPU forms
    by a grouped convolution backward (16 input channels, 3x3 kernels, more positions
    than outputs x channels), one dilated with a bias and reflected padding, one strided,
    after a stem that keeps the patches (18-wide)."""

    def __init__(self, n_out):
        super().__init__()
        self.stem = nn.Conv2d(2, 16, 3, padding=1, bias=False)
        self.conv = nn.Conv2d(16, 16, 3, padding=2, dilation=2, padding_mode="reflect")
        self.down = nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(16, n_out)

    def forward(self, x):
        h = torch.relu(self.conv(torch.relu(self.stem(x))))
        return self.head(torch.relu(self.down(h)).mean((2, 3)))


@pytest.mark.parametrize("output, weighted, layout", [
    ("trace", False, torch.contiguous_format), ("trace", True, torch.contiguous_format),
    ("full", False, torch.contiguous_format), ("trace", False, torch.channels_last)])
def test_convolutions_formed_by_a_grouped_backward(output, weighted, layout, monkeypatch):
    # The two wide convolutions' blocks are formed by the grouped backward, the stem's
    # from its patches; K against the float64 dense Jacobians, and the patches' route
    # (every layer declined) to float32 rounding; also on channels-last images, whose
    # activations the convolutions keep channels-last.
    torch.manual_seed(0)
    module = _WideConvs(2)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(40, 2, 12, 12).contiguous(memory_format=layout)
    n_params = sum(p.numel() for p in params.values())
    D = torch.rand(n_params) + 0.5 if weighted else None
    routed = set()
    real = _layers._conv_formed

    def spy(use, deltas, names):
        terms = real(use, deltas, names)
        if terms is not None:
            routed.add(names["weight"])
        return terms

    monkeypatch.setattr(_layers, "_conv_formed", spy)
    K = tangent_gram(module, params, X, output=output, diag_weight=D, check_hidden=False)
    assert routed == {"conv.weight", "down.weight"}
    J = _loop_jacobian(module, params, X)
    JD = J if D is None else J * D.double()
    ref = (torch.einsum("ncp,mcp->nm", JD, J) / 2 if output == "trace"
           else torch.einsum("ncp,mdp->ncmd", JD, J))
    _close(K, ref, 1e-5)
    monkeypatch.setattr(_capture, "formed_terms", lambda *args: None)
    _close(K, tangent_gram(module, params, X, output=output, diag_weight=D,
                           check_hidden=False), 1e-5)



def test_bfloat16_gram_is_held_by_torch_where_numpy_has_no_such_dtype():
    # The large results are NumPy's memory on the CPU, which has no bfloat16: a bfloat16
    # network's Gram (of every output mode) is torch's, and matches the loop's.
    module, params, X, Y = _make("mlp", 2)
    module = module.to(torch.bfloat16)
    params = {k: v.to(torch.bfloat16) for k, v in params.items()}
    X, Y = X.to(torch.bfloat16), Y.to(torch.bfloat16)
    # The loop in float64 at the same (bfloat16) points.
    JX, JY = (_loop_jacobian(module, params, Z.double()) for Z in (X, Y))
    full = torch.einsum("ncp,mdp->ncmd", JX, JY)
    for output, want in (("trace", torch.einsum("ncmc->nm", full) / 2),
                         (1, full[:, 1, :, 1]), ("full", full)):
        K = tangent_gram(module, params, X, Y, output=output)
        assert K.dtype == torch.bfloat16
        _close(K, want, 3e-2)


# The plain MLPs of :func:`._gram._plain_mlp_gram`'s route (one output): its factors
# without a capture, in one arena.
_PLAIN = {
    "tanh": lambda: nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                                  nn.Linear(12, 1)),
    "relu no bias": lambda: nn.Sequential(nn.Linear(5, 16, bias=False), nn.ReLU(),
                                          nn.Linear(16, 1, bias=False)),
    "gelu, silu": lambda: nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 12),
                                        nn.SiLU(), nn.Linear(12, 1)),
    "sigmoid then tanh": lambda: nn.Sequential(nn.Linear(5, 16), nn.Sigmoid(), nn.Tanh(),
                                               nn.Linear(16, 1)),
    "in-place relu": lambda: nn.Sequential(nn.Linear(5, 16), nn.ReLU(inplace=True),
                                           nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 1)),
    "activation first, identity, no activation between": lambda: nn.Sequential(
        nn.Tanh(), nn.Linear(5, 16), nn.Identity(), nn.Linear(16, 12), nn.ELU(),
        nn.Linear(12, 1)),
    # Autograd differentiates elu_ from its output: other bits than ELU's from its input.
    "in-place elu": lambda: nn.Sequential(nn.Linear(5, 16), nn.ELU(alpha=0.7, inplace=True),
                                          nn.Linear(16, 1)),
    # Heads of 64 inputs or a multiple (:func:`._gram._head_in_fold`): the last hidden
    # Linear writes into the folded head's rows where one activation in place follows it,
    # or none; a fresh activation's output, or a second activation, is folded as before.
    "tanh, 64 into the head": lambda: nn.Sequential(nn.Linear(5, 16), nn.Tanh(),
                                                    nn.Linear(16, 64), nn.Tanh(),
                                                    nn.Linear(64, 1)),
    "relu no bias, 64 into the head": lambda: nn.Sequential(
        nn.Linear(5, 16, bias=False), nn.ReLU(), nn.Linear(16, 64, bias=False),
        nn.ReLU(inplace=True), nn.Linear(64, 1, bias=False)),
    "sigmoid, identity, 128 into the head": lambda: nn.Sequential(
        nn.Linear(5, 128), nn.Sigmoid(), nn.Identity(), nn.Linear(128, 1)),
    "no activation, 64 into the head": lambda: nn.Sequential(nn.Linear(5, 64),
                                                             nn.Linear(64, 1)),
    "gelu, 64 into the head": lambda: nn.Sequential(nn.Linear(5, 64), nn.GELU(),
                                                    nn.Linear(64, 1)),
    "sigmoid then tanh, 64 into the head": lambda: nn.Sequential(
        nn.Linear(5, 64), nn.Sigmoid(), nn.Tanh(), nn.Linear(64, 1)),
}


@pytest.mark.parametrize("kind", sorted(_PLAIN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_mlp_route_matches_dense_jacobian(kind, dtype, monkeypatch):
    # K(X, X) of a plain one-output MLP takes the route without a capture: against the
    # dense Jacobians of the autograd loop, exactly symmetric, a float64 K the float32 one
    # converted bit for bit; and the same bits as the general route (the capture's
    # factors, by autograd).
    torch.manual_seed(0)
    module = _PLAIN[kind]().to(dtype)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(300, 5, dtype=dtype)
    taken = []
    real = _stacked.gram_factors
    monkeypatch.setattr(_gram, "gram_factors", lambda *a: taken.append(1) or real(*a))
    K = tangent_gram(module, params, X)
    assert taken
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(K, J @ J.T, 1e-5 if dtype == torch.float32 else RTOL)
    assert torch.equal(K, K.T)
    for output in (0, -1):
        assert torch.equal(tangent_gram(module, params, X, output=output), K)
    assert torch.equal(tangent_gram(module, params, X, out_dtype=torch.float64),
                       K.to(torch.float64))
    monkeypatch.setattr(_gram, "_plain_mlp_gram", lambda *a: None)
    assert torch.equal(tangent_gram(module, params, X), K)


@pytest.mark.parametrize("kind", sorted(k for k in _PLAIN if "into the head" in k))
def test_plain_mlp_route_writes_the_heads_input_into_its_folded_rows(kind, monkeypatch):
    # Where one activation in place (or none) follows the last hidden Linear and the head
    # has a multiple of 64 inputs, the factors write that Linear's output into the folded
    # head's rows, which are then the head's input itself; elsewhere its own buffer. K:
    # test_plain_mlp_route_matches_dense_jacobian's checks on the same networks.
    torch.manual_seed(5)
    module = _PLAIN[kind]()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(70, 5)
    seen = []
    real = _stacked.gram_factors

    def spy(mlp, p, X, arena, last_out=None):
        factors = real(mlp, p, X, arena, last_out)
        seen.append(last_out is not None and factors[-1][1] is last_out)
        return factors

    monkeypatch.setattr(_gram, "gram_factors", spy)
    K = tangent_gram(module, params, X)
    assert seen == [kind.split(",")[0] not in ("gelu", "sigmoid then tanh")]
    # Against the float64 dense Jacobian of the same network.
    J = _loop_jacobian(module.double(), {k: v.double() for k, v in params.items()},
                       X.double())[:, 0]
    _close(K.double(), J @ J.T, 1e-5)


@pytest.mark.parametrize("out_dtype", [None, torch.float64])
def test_plain_mlp_route_panels_of_a_wide_folded_layer(out_dtype, monkeypatch):
    # A layer of one output folds into rows of its d_in + 1 inputs: 16,384 here, the
    # width at which _panel_rows chooses wider panels. The route's panels keep the rows
    # that its arena was sized for (the layers' backprop widths, as the general route
    # chooses them): a float64 K of a float32 network overran the arena's panel
    # (RuntimeError) and a float32 K had other bits than the general route's.
    torch.manual_seed(3)
    module = nn.Sequential(nn.Linear(16383, 1), nn.Tanh(), nn.Linear(1, 1))
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(300, 16383)
    taken = []
    real = _stacked.gram_factors
    monkeypatch.setattr(_gram, "gram_factors", lambda *a: taken.append(1) or real(*a))
    K = tangent_gram(module, params, X, out_dtype=out_dtype)
    assert taken
    J = _loop_jacobian(module.double(), {k: v.double() for k, v in params.items()},
                       X.double())[:, 0]
    _close(K.double(), J @ J.T, 1e-5)
    monkeypatch.setattr(_gram, "_plain_mlp_gram", lambda *a: None)
    assert torch.equal(tangent_gram(module, params, X, out_dtype=out_dtype), K)


def test_plain_mlp_route_is_left_where_it_does_not_apply(monkeypatch):
    # Hooks, several outputs, a Y, a preconditioner, a budget that needs blocks, and a
    # module whose forward is not its layers' (a class-level patch, which the type checks
    # do not see) take the general route, and still match the dense Jacobians.
    taken = []
    real = _stacked.gram_factors
    monkeypatch.setattr(_gram, "gram_factors", lambda *a: taken.append(1) or real(*a))
    torch.manual_seed(1)
    module = _PLAIN["tanh"]().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(40, 5, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(tangent_gram(module, params, X, X[:7]), J @ J[:7].T)
    _close(tangent_gram(module, params, X, diag_weight=torch.ones(sum(
        p.numel() for p in params.values()), dtype=torch.float64)), J @ J.T)
    _close(tangent_gram(module, params, X, memory_budget=2**15), J @ J.T)
    assert not taken
    two = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    p2 = {k: v.detach() for k, v in two.named_parameters()}
    J2 = _loop_jacobian(two, p2, X)
    _close(tangent_gram(two, p2, X), torch.einsum("ncp,mcp->nm", J2, J2) / 2)
    handle = module[1].register_forward_hook(lambda m, i, o: o * 2)
    try:
        Jh = _loop_jacobian(module, params, X)[:, 0]
        _close(tangent_gram(module, params, X), Jh @ Jh.T)
    finally:
        handle.remove()
    assert not taken
    # Patched on the class: the route's first-sample check sees the difference.
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: torch.tanh(2 * x))
    Jp = _loop_jacobian(module, params, X)[:, 0]
    _close(tangent_gram(module, params, X), Jp @ Jp.T)
    assert taken  # the route ran, then gave way


def _small_vit(n, dtype=torch.float64, n_out=4):
    """benchmarks/_nets.py's ViT (patch-embedding conv, class token, position embedding,
    a pre-norm encoder layer with attention, LayerNorm, Linear head) at a test's size."""
    torch.manual_seed(0)
    module = ViT(3, 8, 4, 16, 2, 32, 1, n_out).to(dtype).eval()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    return module, params, torch.randn(n, 3, 8, 8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_output_groups_share_one_forward_pass_per_chunk(dtype, monkeypatch):
    # Budgets that split the four outputs into groups, and whose rest beside the graphs
    # of every row still holds a group's blocks: each chunk's forward pass is run once,
    # its graph kept from the first group's capture to the last's, instead of one forward
    # pass per group; the chunks, whose graphs are counted with the kept ones, take what
    # the blocks leave. The same K as the autograd loop, every row forwarded once, and
    # what the call holds (the graphs included) stays within the budget, measured.
    module, params, X = _small_vit(96, dtype)
    n, size = len(X), X.element_size()
    probe = _gram._prepare(module, params, X, "trace", 2**30, check_hidden=False)[3]
    assert probe.graph_bytes > 0

    def kept_groups(budget):
        return (len(_gram._output_groups(probe, n, n, "trace", None, True, budget, size)) > 1
                and _gram._kept_forward_groups(probe, n, "trace", None, budget, size))

    budget = 2**16
    while budget <= 2**30 and not kept_groups(budget):
        budget = int(budget * 2 ** (1 / 16)) + 1
    assert budget <= 2**30, "no budget splits the outputs and keeps the graphs"
    # One-output groups: where they hold two, a chunk's estimate (_chunk_row_bytes) falls
    # short on this network with or without kept forward passes (up to 1.4x the budget
    # held, measured), which is the estimate's, not this plan's.
    budgets = [b for b in (int(budget * 2 ** (k / 8)) for k in range(8))
               if kept_groups(b) and max(map(len, kept_groups(b))) == 1]
    J = _loop_jacobian(module, {k: v.double() for k, v in params.items()}, X.double())
    expected = torch.einsum("ncp,mcp->nm", J, J) / 4
    real_forward, real_chunk = _tangent._capture.functional_call, _gram._launch_bound_chunk
    wider = []
    monkeypatch.setattr(_gram, "_launch_bound_chunk", lambda *a: wider.append(
        real_chunk(*a) > real_chunk(*a[:7])) or real_chunk(*a))
    for budget in budgets:
        assert len(_gram._kept_forward_groups(probe, n, "trace", None, budget, size)) > 1
        tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
        forwarded = []
        monkeypatch.setattr(_tangent._capture, "functional_call",
                            lambda m, p, args, *a, seen=forwarded, **k: seen.append(
                                args[0].shape[0]) or real_forward(m, p, args, *a, **k))
        K, peak = cpu_peak_bytes(functools.partial(tangent_gram, module, params, X,
                                                   memory_budget=budget, check_hidden=False))
        monkeypatch.setattr(_tangent._capture, "functional_call", real_forward)
        assert peak - K.nbytes <= budget, (peak - K.nbytes, budget)
        # The probe's row (its outputs, its capture), then every row once, not once per
        # group.
        assert forwarded[:2] == [1, 1] and sum(forwarded[2:]) == n, forwarded
        _close(K, expected, RTOL if dtype == torch.float64 else 1e-5)
    # Some budget's chunks are wider for the graphs counted apart.
    assert len(budgets) > 1 and any(wider)


def test_plain_mlp_route_takes_parameters_and_inputs_that_require_grad(monkeypatch):
    # The module's own parameters (requires_grad=True) and an X that requires grad: the
    # route's out= products refused them (RuntimeError) where the capture took them.
    torch.manual_seed(2)
    module = _PLAIN["tanh"]().double()
    params = dict(module.named_parameters())
    X = torch.randn(30, 5, dtype=torch.float64, requires_grad=True)
    taken = []
    real = _stacked.gram_factors
    monkeypatch.setattr(_gram, "gram_factors", lambda *a: taken.append(1) or real(*a))
    K = tangent_gram(module, params, X)
    assert taken and not K.requires_grad
    J = _loop_jacobian(module, params, X.detach())[:, 0]
    _close(K, J @ J.T)


def test_plain_mlp_route_sums_the_layers_in_the_order_of_params(monkeypatch):
    # The general route sums the layers' terms in the order of their parameters in
    # ``params``; the route summed them in the module's order: other bits for a dict in
    # another order (the reversed one here).
    torch.manual_seed(3)
    module = _PLAIN["tanh"]().double()
    params = {k: v.detach() for k, v in reversed(list(module.named_parameters()))}
    X = torch.randn(60, 5, dtype=torch.float64)
    taken = []
    real = _stacked.gram_factors
    monkeypatch.setattr(_gram, "gram_factors", lambda *a: taken.append(1) or real(*a))
    K = tangent_gram(module, params, X)
    assert taken  # else both calls below are the general route's, equal by themselves
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(K, J @ J.T)
    monkeypatch.setattr(_gram, "_plain_mlp_gram", lambda *a: None)
    assert torch.equal(tangent_gram(module, params, X), K)


def test_plain_mlp_route_leaves_the_inputs_alone(monkeypatch):
    # An in-place activation before the first Linear: the route's check of the module's
    # forward on the first sample overwrote the caller's first row. (The route is taken:
    # the general route, which copies the rows, would pass this anyway.)
    torch.manual_seed(4)
    module = nn.Sequential(nn.ELU(inplace=True), nn.Linear(5, 8), nn.Tanh(),
                           nn.Linear(8, 1)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = -torch.rand(10, 5, dtype=torch.float64)
    X0 = X.clone()
    general = []
    real_prepare = _gram._prepare
    monkeypatch.setattr(_gram, "_prepare", lambda *a: general.append(1) or real_prepare(*a))
    K = tangent_gram(module, params, X)
    assert not general
    assert torch.equal(X, X0)
    J = _loop_jacobian(module, params, X0.clone())[:, 0]
    _close(K, J @ J.T)


def test_plain_mlp_route_refuses_parameters_of_other_shapes():
    # A bias of shape (1,) broadcast over the layer's units: the general route refuses
    # it; the route took it for one entry per unit and returned another Gram.
    module = _PLAIN["tanh"]().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    params["0.bias"] = torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="'0.bias' 16 gradient entries per output"):
        tangent_gram(module, params, torch.randn(8, 5, dtype=torch.float64))


def test_plain_mlp_route_keeps_an_output_that_cancels(monkeypatch):
    # The route's check of the module's forward on the first sample compared the
    # difference with the output itself: an output that cancels to near 0 (here 1e-3 of
    # its terms' size) made a rounding difference of the module's own GEMMs (emulated:
    # 2 eps of the terms) look like another forward, and the call left the route.
    torch.manual_seed(5)
    module = _PLAIN["tanh"]()
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    X = torch.randn(50, 5)
    with torch.no_grad():
        hidden = module[:-1](X[:1])
        size = float((hidden.abs() @ params["4.weight"].abs().T).max())
        params["4.bias"] = 1e-3 * size - hidden @ params["4.weight"].T
        params["4.bias"] = params["4.bias"].reshape(1)
    real = _gram.forward
    eps = torch.finfo(torch.float32).eps
    monkeypatch.setattr(_gram, "forward", lambda *a: real(*a) + 2 * eps * size)
    general = []
    real_prepare = _gram._prepare
    monkeypatch.setattr(_gram, "_prepare", lambda *a: general.append(1) or real_prepare(*a))
    K = tangent_gram(module, params, X)
    assert not general  # the route's K
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(K, J @ J.T, 1e-5)


def _forwarded_gram(module, params, X, budget, monkeypatch):
    """``tangent_gram`` at ``budget`` (without the autograd check): K, the peak of what
    it holds beside K (torch's allocations, measured), and the rows of each forward pass
    of its captures."""
    tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
    forwarded = []
    real = _tangent._capture.functional_call
    monkeypatch.setattr(_tangent._capture, "functional_call",
                        lambda m, p, args, *a, **k: forwarded.append(args[0].shape[0])
                        or real(m, p, args, *a, **k))
    try:
        K, peak = cpu_peak_bytes(functools.partial(tangent_gram, module, params, X,
                                                   memory_budget=budget, check_hidden=False))
    finally:
        monkeypatch.setattr(_tangent._capture, "functional_call", real)
    return K, peak - K.nbytes, forwarded


def test_kept_forward_passes_of_groups_of_other_widths(monkeypatch):
    # An MLP's factors (no formed blocks) are cut into blocks sized by the group's width:
    # groups of 2 and 3 outputs cut the rows apart, and each group's captures kept their
    # own forward passes instead of finding the first group's (twice the forward passes,
    # every row's graph held twice). The rows of every group's captures are the same:
    # each row forwarded once, the same K as the autograd loop, within the budget.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                           nn.Linear(32, 7)).double()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(37, 5, dtype=torch.float64)
    n, size = len(X), X.element_size()
    probe = _gram._prepare(module, params, X, "trace", 2**30, check_hidden=False)[3]
    J = _loop_jacobian(module, params, X)
    expected = torch.einsum("ncp,mcp->nm", J, J) / 7
    plans = {}
    budget = 2**14
    while budget <= 2**24:
        kept = _gram._kept_forward_groups(probe, n, "trace", None, budget, size)
        if kept and len(kept) > 1 and len({len(g) for g in kept}) > 1 and len(
                _gram._output_groups(probe, n, n, "trace", None, True, budget, size)) > 1:
            plans.setdefault(tuple(map(len, kept)), budget)
        budget = int(budget * 2 ** (1 / 8)) + 1
    assert plans, "no budget keeps the forward passes of groups of several widths"
    for budget in plans.values():
        K, held, forwarded = _forwarded_gram(module, params, X, budget, monkeypatch)
        assert forwarded[:2] == [1, 1] and sum(forwarded[2:]) == n, forwarded
        assert held <= budget, (held, budget)
        _close(K, expected)


@pytest.mark.parametrize("net", ["vit", "cnn"])
def test_output_groups_hold_their_panels_in_the_budget(net, monkeypatch):
    # Where every formed block is kept, the symmetric Gram is one block whose panels'
    # products were left out of the budget: on the small ViT, whose patch embedding goes
    # by position pairs in groups of two outputs, groups of two held 1.46x the budget.
    # Every plan of groups of two or three outputs, measured: within the budget, the same
    # K as the autograd loop.
    if net == "vit":
        module, params, X = _small_vit(96, torch.float64)
    else:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Flatten(), nn.Linear(64, 6)).double()
        params = {k: v.detach() + 0.1 * torch.randn_like(v)
                  for k, v in module.named_parameters()}
        X = torch.randn(64, 3, 8, 8, dtype=torch.float64)
    n, size = len(X), X.element_size()
    probe = _gram._prepare(module, params, X, "trace", 2**30, check_hidden=False)[3]
    C = probe.terms[0].delta.shape[1]
    J = _loop_jacobian(module, params, X)
    expected = torch.einsum("ncp,mcp->nm", J, J) / C
    plans = {}
    budget = 2**16
    while budget <= 2**28:
        groups = _gram._output_groups(probe, n, n, "trace", None, True, budget, size)
        kept = _gram._kept_forward_groups(probe, n, "trace", None, budget, size)
        used = kept if kept and len(kept) > 1 and len(groups) > 1 else groups
        if max(map(len, used)) in (2, 3):
            plans.setdefault((tuple(map(len, groups)), used is kept), budget)
        budget = int(budget * 2 ** (1 / 8)) + 1
    assert plans, "no budget groups two or three outputs"
    for budget in plans.values():
        K, held, _ = _forwarded_gram(module, params, X, budget, monkeypatch)
        assert held <= budget, (held, budget)
        _close(K, expected)


def _jacrev_jacobian(module, params, X):
    """(n, C, P): ``torch.func.jacrev`` of the whole batch's outputs, a float64 copy at
    params (the rows are independent samples: row n's outputs depend on sample n only)."""
    ref = _copy_with(module, params)
    p = {k: v.detach().clone() for k, v in ref.named_parameters()}
    jac = torch.func.jacrev(lambda q: torch.func.functional_call(ref, q, (X.double(),)))(p)
    n, C = jac[next(iter(params))].shape[:2]
    return torch.cat([jac[k].reshape(n, C, -1) for k in params], 2)


def _small_resnet(n, n_out, dtype, side=8):
    """benchmarks/_nets.py's ResNet (stem, three residual blocks, the last two stride-2
    with 1x1 shortcuts, eval BatchNorms after every convolution) at a test's size."""
    torch.manual_seed(0)
    module = _eval_batchnorm(ResNet(3, (4, 8, 12), n_out)).to(dtype)
    params = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in module.named_parameters()}
    return module, params, torch.randn(n, 3, side, side, dtype=dtype)


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_folded_resnet_gram_against_jacrev(n_out, dtype, monkeypatch):
    # benchmarks/_nets.py's ResNet at a test's size (eval BatchNorms folded into all nine
    # convolutions, whose input gradients then go by the scaled weight; stride-2 3x3 and
    # 1x1 convolutions on even sides, which leave an input row no window reads): K
    # against the float64 jacrev J J^T / C at the default budget and at budgets that
    # split the rows into chunks, within each budget (torch's allocations, measured).
    module, params, X = _small_resnet(37, n_out, dtype)
    J = _jacrev_jacobian(module, params, X)
    expected = torch.einsum("ncp,mcp->nm", J, J) / n_out
    rtol = RTOL if dtype == torch.float64 else 1e-5
    folds = []
    real_fold = _capture.fold_batch_norm
    monkeypatch.setattr(_capture, "fold_batch_norm",
                        lambda use, z, *a: folds.append(1) or real_fold(use, z, *a))
    _close(tangent_gram(module, params, X), expected, rtol)
    assert len(folds) % 9 == 0 and folds  # every convolution folded, in every capture
    captures = {}  # by budget
    for budget in (int(2**21 * 2 ** (k / 2)) + 12345 for k in range(6)):  # 2 to 11 MiB
        try:
            K, held, forwarded = _forwarded_gram(module, params, X, budget, monkeypatch)
        except ValueError:  # below the least budget this network takes
            continue
        assert held <= budget, (held, budget)
        _close(K, expected, rtol)
        captures[budget] = len(forwarded) - 2  # the probe's two forward passes aside
    # Three budgets taken, the rows in several chunks at some.
    assert len(captures) >= 3 and max(captures.values()) > 1, captures


def test_kept_forward_passes_never_refuse_a_budget_the_groups_hold(monkeypatch):
    # On a few rows, the rest of the budget beside the graphs can be too small for a
    # block's single row where the groups' check (_fitting_groups) does not see it: the
    # call refused (naming a budget less than the one given) where the groups' plan with
    # a forward pass per group holds the budget. At every budget of a 1/8-octave grid
    # that this plan holds, the call computes K (the autograd loop's).
    module, params, X = _small_vit(3, torch.float64, n_out=10)
    J = _loop_jacobian(module, params, X)
    expected = torch.einsum("ncp,mcp->nm", J, J) / 10
    real = _gram._kept_forward_groups
    held, budget = 0, 2**16
    while budget <= 2**19:
        monkeypatch.setattr(_gram, "_kept_forward_groups", lambda *a: None)
        try:
            tangent_gram(module, params, X, memory_budget=budget)
        except ValueError:
            budget = int(budget * 2 ** (1 / 8)) + 1
            continue
        finally:
            monkeypatch.setattr(_gram, "_kept_forward_groups", real)
        _close(tangent_gram(module, params, X, memory_budget=budget), expected)
        held += 1
        budget = int(budget * 2 ** (1 / 8)) + 1
    assert held > 5


def test_graph_bytes_count_the_forward_pass_copy_of_its_rows():
    # A kept forward pass holds the copy of its rows that the first Linear saved (its
    # input, a factor of the weight's gradient): new memory beside the caller's X, which
    # the graph's bytes must count (they counted only the 2-wide outputs when they
    # skipped the copy instead of X).
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(50, 2))
    params = dict(module.named_parameters())
    X = torch.randn(16, 50)
    cap = capture(module, params, X, [0, 1], memory_budget=2**30, measure_graph=True)
    assert cap.graph_bytes >= X.nbytes


# ------------------------------------------ in-place ops on tensors saved for the backward
class _Doubled(nn.Module):
    """``2 x``, written into ``x`` where ``inplace`` (after a Sigmoid, whose derivative
    reads its output: the rewritten output would give a wrong one, not just an error)."""

    def __init__(self, inplace=True):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(2.0) if self.inplace else 2.0 * x


def _saved_rewriters():
    torch.manual_seed(0)
    return {
        "tanh_relu": (nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.ReLU(inplace=True),
                                    nn.Linear(6, 3)), (3,)),
        "sigmoid_doubled": (nn.Sequential(nn.Linear(3, 6), nn.Sigmoid(), _Doubled(),
                                          nn.Linear(6, 2)), (3,)),
        "elu_elu": (nn.Sequential(nn.Linear(3, 6), nn.ELU(inplace=True), nn.ELU(inplace=True),
                                  nn.Linear(6, 1)), (3,)),
        "cnn": (nn.Sequential(nn.Conv1d(2, 3, 3), nn.Sigmoid(), nn.ReLU(inplace=True),
                              nn.Flatten(), nn.Linear(12, 2)), (2, 6)),
    }


def _out_of_place(module):
    """The same function without in-place ops: the independent reference's network."""
    ref = copy.deepcopy(module)
    for layer in ref.modules():
        if hasattr(layer, "inplace"):
            layer.inplace = False
    return ref


@pytest.mark.parametrize("name", list(_saved_rewriters()))
@pytest.mark.parametrize("fallback", [False, True])
def test_in_place_op_on_a_saved_tensor_matches_the_out_of_place_loop(name, fallback):
    # nn.ReLU(inplace=True) after nn.Tanh() rewrites the output Tanh saved for its
    # derivative: autograd refused the capture's backward pass ("modified by an inplace
    # operation"), for every route but the one-output plain MLP's. The function is that
    # of the network out of place; its per-sample autograd loop is the reference.
    net, shape = _saved_rewriters()[name]
    net = net.double()
    params = dict(net.named_parameters())
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(7, *shape, generator=gen, dtype=torch.float64)
    Y = torch.randn(4, *shape, generator=gen, dtype=torch.float64)
    J = jacobian_loop(_out_of_place(net), X)
    JY = jacobian_loop(_out_of_place(net), Y)
    C = J.shape[1]
    # The fallback (torch.func's vmap refuses, so its autograd loop) for the first layer.
    exclude = frozenset({"0.weight", "0.bias"}) if fallback else frozenset()
    kw = dict(exclude=exclude, memory_budget=2**16)  # several blocks and chunks
    K = tangent_gram(net, params, X, **kw)
    ref = torch.einsum("ncp,mcp->nm", J, J) / C
    torch.testing.assert_close(K, ref, rtol=RTOL, atol=RTOL * ref.abs().max())
    KXY = tangent_gram(net, params, X, Y, output="full", **kw)
    torch.testing.assert_close(KXY, torch.einsum("ncp,mdp->ncmd", J, JY), rtol=RTOL,
                               atol=RTOL * ref.abs().max())
    d = tangent_gram_diag(net, params, X, **kw)
    torch.testing.assert_close(d, torch.diagonal(ref), rtol=RTOL, atol=0.0)
    phi = tangent_features(net, params, X, exclude=exclude)
    torch.testing.assert_close(phi.reshape(7, -1), J.reshape(7, -1) / math.sqrt(C),
                               rtol=RTOL, atol=RTOL * J.abs().max())
    # The caller's network still computes in place: nothing was switched on it.
    assert all(getattr(m, "inplace", True) for m in net.modules() if hasattr(m, "inplace"))


class _Made(TorchDispatchMode):
    """Weak references to the ``(rows, width)`` tensors the ops under it make."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.refs = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.refs.append(weakref.ref(out))
        return out

    def alive(self):
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("fallback", [False, True])
def test_no_activation_outlives_the_capture(inplace, fallback):
    # The saved-tensor hooks held an op's own output (Tanh's, ReLU's) as it was, grad_fn
    # and all: a cycle through C++ that gc cannot free, so every graph not differentiated
    # to its end leaked: the in-place network's first run (2 activations a capture),
    # the Tanh below the fallback's layer (1). Reference: none survives the call.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.ReLU(inplace=inplace),
                           nn.LayerNorm(32), nn.Linear(32, 3))
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(64, 8)
    exclude = frozenset({"0.weight", "0.bias"}) if fallback else frozenset()
    for call in (lambda: capture(module, params, X, [0, 1], memory_budget=2**30,
                                 exclude=exclude),
                 lambda: capture(module, params, X, [0, 1], memory_budget=2**30,
                                 exclude=exclude, measure_graph=True),
                 lambda: tangent_gram(module, params, X, exclude=exclude)):
        made = _Made((64, 32))
        with made:
            call()
        assert made.refs and made.alive() == 0


@pytest.mark.parametrize("measure_graph", [False, True])
def test_running_again_holds_one_forward_at_a_time(measure_graph):
    # A capture that runs its forward again (here with the saved tensors copy-on-write)
    # kept the first run's graph alive through the second, held by its watch of the
    # layers' inputs and outputs: 16 of the 2 x 4 MiB activations more than the network
    # out of place. Reference: the out-of-place network's capture, which runs once.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.ReLU(inplace=True),
                        nn.Linear(512, 512), nn.Tanh(), nn.ReLU(inplace=True),
                        nn.Linear(512, 10))
    twin = _out_of_place(net)
    X = torch.randn(2048, 64)
    caps, peaks = [], []
    for module in (net, twin):
        params = {k: v.detach() for k, v in module.named_parameters()}
        cap, peak = cpu_peak_bytes(functools.partial(
            capture, module, params, X, [0, 1], memory_budget=2**30,
            measure_graph=measure_graph))
        caps.append(cap.guarded)
        peaks.append(peak)
    assert caps == [True, False]
    assert peaks[0] <= peaks[1], [p / 2**20 for p in peaks]


def test_a_rewritten_saved_tensor_is_copied_once_and_counted():
    # The capture runs again with the saved tensors copy-on-write: only the rewritten
    # Tanh output is copied, and counted in the kept graph's bytes, which then hold what
    # the network out of place holds (Tanh's output and ReLU's, 6 float64 per row each).
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.ReLU(inplace=True),
                        nn.Linear(6, 1)).double()
    twin = _out_of_place(net)
    X = torch.randn(5, 3, dtype=torch.float64)
    params = dict(net.named_parameters())
    cap = capture(net, params, X, [0], memory_budget=2**20, measure_graph=True)
    ref = capture(twin, dict(twin.named_parameters()), X, [0], memory_budget=2**20,
                  measure_graph=True)
    assert cap.guarded and not ref.guarded
    assert cap.graph_bytes == ref.graph_bytes


# ------------------------------------------- the capture's copy of its rows in the plans
@pytest.mark.parametrize("call", ["gram", "cross", "features"])
def test_the_captures_copy_of_its_rows_is_within_the_budget(call):
    # Every capture runs the network on a copy of its rows (forward_input), alive for
    # the whole capture. With a wide input and narrow factors (an 8x8 pool before the
    # first Linear: 48 KiB of input per row, 0.8 KiB of factors) the plans, which
    # counted four times the factors and not the copy, held 2-4x the budget
    # (benchmarks/results/input_copy_bytes-s47.md).
    torch.manual_seed(0)
    module = nn.Sequential(nn.AvgPool2d(8), nn.Flatten(), nn.Linear(192, 10))
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(96, 3, 64, 64)
    budget = 2**19
    run = {"gram": lambda: tangent_gram(module, params, X, memory_budget=budget),
           "cross": lambda: tangent_gram(module, params, X, X[:40], memory_budget=budget),
           "features": lambda: tangent_features(module, params, X, output=0,
                                                memory_budget=budget)}[call]
    tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
    out, peak = cpu_peak_bytes(run)
    assert 0 < peak - out.nbytes <= budget, (peak - out.nbytes, budget)
    J = _loop_jacobian(module.double(), {k: v.double() for k, v in params.items()},
                       X.double())
    want = {"gram": lambda: torch.einsum("ncp,mcp->nm", J, J) / 10,
            "cross": lambda: torch.einsum("ncp,mcp->nm", J, J[:40]) / 10,
            "features": lambda: J[:, 0]}[call]()
    _close(out.double(), want, 1e-5)


class _CtxHeld(torch.autograd.Function):
    """``tanh``, its output kept on ``ctx`` outside ``save_for_backward``."""

    @staticmethod
    def forward(ctx, x):
        ctx.y = torch.tanh(x)
        return ctx.y.clone()

    @staticmethod
    def backward(ctx, g):
        return g * (1 - ctx.y * ctx.y)


class _CtxSaved(torch.autograd.Function):
    """The same, its output saved by ``save_for_backward`` (which the hooks see)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _FunctionNet(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.first, self.head = nn.Linear(4, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.function.apply(self.first(x)))


def test_graph_bytes_count_what_a_function_keeps_on_ctx():
    # A custom autograd.Function keeping a tensor on ctx (not save_for_backward): no
    # saved-tensor hook sees it, yet the kept forward holds it. The graph's bytes count
    # every tensor the forward's ops made that outlives the forward: those of the same
    # network saving it by save_for_backward (they missed its 16 x 64 float32 before).
    X = torch.randn(16, 4)
    counts = []
    for function in (_CtxHeld, _CtxSaved):
        torch.manual_seed(0)
        module = _FunctionNet(function)
        params = dict(module.named_parameters())
        cap = capture(module, params, X, [0], memory_budget=2**30, measure_graph=True)
        counts.append(cap.graph_bytes)
        J = _loop_jacobian(module, {k: v.detach() for k, v in params.items()}, X)
        _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", J, J), 1e-5)
    assert counts[0] == counts[1]


def _held_bytes(fn) -> int:
    """Bytes of torch's CPU allocations made during ``fn()`` and still alive after it
    (profiler memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_graph_bytes_are_what_a_kept_forward_of_the_chunks_holds(dtype):
    # The output groups share one kept forward pass per chunk where the graphs of all
    # the rows fit (_kept_forward_groups), by the probe's graph bytes per row. The probe
    # counted them on a capture that hands the sites' outputs on as copies, the chunks
    # hand them on uncopied: 13% more than a kept forward of the chunks holds, which cost
    # the benchmark's ViT (N = 1024, 1 GiB) its kept plan. Reference: the bytes that a
    # chunk's capture keeping its forward pass for later groups leaves allocated.
    module, params, X = _small_vit(64, dtype)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    rows, kept = 32, {}

    def first_group():
        capture(module, params, X[:rows], [0], memory_budget=2**30, index=True,
                kept=kept, last=False, copy_sites=False)

    held = _held_bytes(first_group)
    assert kept and held > 0
    assert abs(probe.graph_bytes * rows - held) <= 0.02 * held, (probe.graph_bytes * rows,
                                                                 held)
    cap = capture(module, params, X[:rows], [1], memory_budget=2**30, index=True, kept=kept,
                  last=True, copy_sites=False)
    assert not kept and cap.terms


class _MaskedEncoder(nn.Module):
    """A post-norm encoder layer (GELU, dropout in eval) under a padding mask read from
    the data: the attention runs torch's own core (not the plain path)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, activation="gelu",
                                                batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        pad = x[..., 0] > 1.0
        pad[:, 0] = False
        return self.head(self.layer(self.embed(x), src_key_padding_mask=pad).mean(1))


@pytest.mark.parametrize("make", ["inplace_block", "small_resnet", "tanh_relu_",
                                  "masked_encoder"])
def test_graph_bytes_do_not_undercount_rewritten_sites(make):
    # The probe counts the graph uncopied, as the chunks run; where an in-place op
    # rewrites a site's output (ReLU(inplace) after BatchNorm, ``out += x``) or a saved
    # tensor (ReLU(inplace) after Tanh), both captures run again with copies, and the
    # probe's bytes must then count them: the kept plan spends the budget on its count.
    # Reference: what a kept forward of 32 rows leaves allocated (a mask's and the
    # attention core's per-call constants, counted on the probe's two rows, read a few
    # percent over there).
    torch.manual_seed(0)
    module, shape = {
        "inplace_block": lambda: (_InPlaceBlock(), (2, 4, 4)),
        # BatchNorms folded into their convolutions: neither output held (s49).
        "small_resnet": lambda: (_SmallResNet(3), (2, 6, 6)),
        "tanh_relu_": lambda: (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.ReLU(inplace=True),
                                             nn.Linear(6, 3)), (4,)),
        "masked_encoder": lambda: (_MaskedEncoder(), (6, 4)),
    }[make]()
    module = module.double().eval()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(64, *shape, dtype=torch.float64)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    rows, kept = 32, {}
    held = _held_bytes(lambda: capture(module, params, X[:rows], [0], memory_budget=2**30,
                                       index=True, kept=kept, last=False, copy_sites=False,
                                       fold_bn=True))
    assert kept and held > 0
    kept.clear()
    assert 0.98 * held <= probe.graph_bytes * rows <= 1.1 * held, (probe.graph_bytes * rows,
                                                                    held)


# The plain CNNs of the captures' hand-computed backprops (:mod:`._tangent._cnn`).
def _pool():
    return nn.MaxPool2d(2)


_PLAIN_CNN = {
    "conv-relu-pool x2 (the CIFAR CNN's layout)": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), _pool(), nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(), _pool(), nn.Flatten(), nn.Linear(6 * 2 * 2, 3)),
    "one pool module listed twice, in-place ReLUs": lambda: (lambda pool: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), pool,
        nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(inplace=True), pool, nn.Flatten(),
        nn.Linear(6 * 2 * 2, 3)))(_pool()),
    "pool before ReLU, no biases, stride 2": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), _pool(), nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False), nn.ReLU(), nn.Flatten(),
        nn.Linear(6 * 2 * 2, 3, bias=False)),
    "no gates, three convolutions, groups and dilation": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.Conv2d(4, 6, 3, groups=2, dilation=(1, 2)), nn.ReLU(),
        nn.Conv2d(6, 2, 1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 2, 3)),
    "a pool whose windows leave a row (7 x 7 by 2)": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 2), nn.ReLU(), _pool(), nn.Conv2d(4, 5, 2), nn.ReLU(),
        nn.Flatten(), nn.Linear(5 * 2 * 2, 3)),
    "conv-relu-pool, one block": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), _pool(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3)),
    "conv-pool without a ReLU, then conv-relu-pool": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), _pool(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
        _pool(), nn.Flatten(), nn.Linear(6 * 2 * 2, 3)),
    "a pool to 1 x 1, then a 1 x 1 convolution": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(6), nn.Conv2d(4, 6, 1), nn.ReLU(),
        nn.Flatten(), nn.Linear(6, 3)),
}


def _cnn_spy(monkeypatch):
    taken = []
    real = _gram.plain_cnn_capture
    monkeypatch.setattr(_gram, "plain_cnn_capture",
                        lambda *a, **k: taken.append(1) or real(*a, **k))
    return taken


@pytest.mark.parametrize("kind", sorted(_PLAIN_CNN))
def test_plain_cnn_route_matches_dense_jacobian(kind, monkeypatch):
    # A plain CNN's captures compute its backprops by hand: against the dense Jacobians
    # of the autograd loop (float64) for the trace, one output, full blocks, a Y and a
    # preconditioner; the hand-made backprops are autograd's bits (the general capture's
    # K bit for bit without the first convolution formed from its pooled backprops), and
    # with it, K to rounding; in float32 too, where the convolutions are oneDNN's.
    torch.manual_seed(0)
    module = _PLAIN_CNN[kind]().double()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    side = 8 if "7 x 7" not in kind else 7
    X = torch.randn(40, 3, side, side, dtype=torch.float64)
    J = _loop_jacobian(module, params, X)
    D = torch.rand(J.shape[2], dtype=torch.float64) + 0.5
    taken = _cnn_spy(monkeypatch)
    pooled = []
    real_first, real_pools = _capture.first_formed, _capture.pools_first
    # These small convolutions' patches at the argmax outsize their backprop buffers
    # (pools_first declines them for the budget): as if they had many outputs.
    monkeypatch.setattr(_capture, "pools_first", lambda cnn, X, C: real_pools(cnn, X, 10**6))
    monkeypatch.setattr(_capture, "first_formed",
                        lambda *a: pooled.append(1) or real_first(*a))
    calls = {"trace": {}, "one": dict(output=1), "full": dict(output="full"),
             "D": dict(diag_weight=D), "chunks": dict(memory_budget=2**20)}

    def grams(dtype=torch.float64):
        m = module.to(dtype)
        p = {k: v.to(dtype) for k, v in params.items()}
        out = {key: tangent_gram(m, p, X.to(dtype), **kw) for key, kw in calls.items()}
        out["Y"] = tangent_gram(m, p, X.to(dtype), X[:7].to(dtype))
        module.double()
        return out

    got, got32 = grams(), grams(torch.float32)
    assert len(taken) >= 12
    if kind.startswith(("conv-relu-pool", "conv-pool")):
        assert pooled  # the first convolution's gradients formed from its pooled backprops
    _close(got["trace"], torch.einsum("ncp,mcp->nm", J, J) / 3)
    _close(got["one"], J[:, 1] @ J[:, 1].T)
    _close(got["full"], torch.einsum("ncp,mdp->ncmd", J, J))
    _close(got["Y"], torch.einsum("ncp,mcp->nm", J, J[:7]) / 3)
    _close(got["D"], torch.einsum("ncp,mcp->nm", J * D, J) / 3)
    _close(got["chunks"], got["trace"])
    _close(got32["trace"], got["trace"], 1e-5)
    monkeypatch.setattr(_capture, "pools_first", lambda *a: False)
    exact, exact32 = grams(), grams(torch.float32)
    monkeypatch.setattr(_gram, "plain_cnn", lambda *a: None)
    general, general32 = grams(), grams(torch.float32)
    for key in general:
        assert torch.equal(exact[key], general[key]), key
        # float32: equal to rounding, not bitwise: the two routes' convolutions run on
        # different batch shapes, for which oneDNN picks different kernels on some CPUs
        # (bit-equal on an Intel Xeon, 1.0e-7 apart relative to the largest entry on an AMD EPYC).
        _close(exact32[key], general32[key], 1e-6)
        _close(got[key], general[key], 1e-12)
        _close(got32[key], general32[key], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_cnn_max_pool_picks_the_nchw_kernels_argmax(dtype):
    # The route pools a ReLU's output by the channels-last kernel (_cnn._max_pool): the
    # values and argmax of F.max_pool2d on NCHW rows (autograd's), bit for bit, where
    # windows tie (a few integer values, a ReLU's zeros), hold a NaN or -inf, or leave a
    # row or column out; with several channels' vectors and their tails, one channel, 1 x 1
    # results. In NCHW strides: channels-last ones pass for contiguous where the results
    # are 1 x 1 or have one channel, and a convolution on them took oneDNN's channels-last
    # path (other bits than autograd's).
    torch.manual_seed(0)
    for shape, k in [((5, 4, 8, 8), (2, 2)), ((3, 2, 7, 9), (2, 2)), ((2, 3, 9, 9), (3, 3)),
                     ((2, 3, 8, 9), (2, 3)), ((1, 1, 2, 2), (2, 2)), ((3, 1, 9, 8), (3, 2)),
                     ((2, 17, 5, 7), (2, 2)), ((2, 64, 4, 4), (4, 4)), ((1, 5, 6, 6), (1, 1))]:
        z = torch.randint(-2, 3, shape).to(dtype)
        special = z.clone()
        special.view(-1)[::7] = float("nan")
        special.view(-1)[3::11] = float("-inf")
        for x in (z, torch.relu(z), torch.randn(shape, dtype=dtype), special):
            for relu in (False, True):
                got = _cnn._max_pool(x, k, relu)
                want = F.max_pool2d(torch.relu(x) if relu else x, k, k, 0, 1, False, True)
                assert got[0].stride() == want[0].stride() == want[0].contiguous().stride()
                assert got[1].stride() == want[1].stride()
                assert torch.equal(got[1], want[1])
                assert torch.equal(got[0].nan_to_num(7.0), want[0].nan_to_num(7.0))


def test_plain_cnn_route_is_left_where_it_does_not_apply(monkeypatch):
    # Overlapping pool windows, a hook, a padding mode, a head of two Linears, a parameter
    # left out of params, and a layer of a subclass take the general capture.
    taken = _cnn_spy(monkeypatch)
    torch.manual_seed(1)

    class Conv(nn.Conv2d):
        pass

    def net(conv=nn.Conv2d, pool=_pool, head=None, **kw):
        head = head or (nn.Linear(4 * 2 * 2, 2),)
        return nn.Sequential(conv(3, 4, 3, padding=1, **kw), nn.ReLU(), pool(), pool(),
                             nn.Flatten(), *head).double()

    X = torch.randn(12, 3, 8, 8, dtype=torch.float64)
    cases = [net(pool=lambda: nn.MaxPool2d(3, 2, 1)), net(padding_mode="reflect"),
             net(head=(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 2))), net(conv=Conv)]
    hooked = net()
    hooked[1].register_forward_hook(lambda m, i, o: o * 2)
    cases.append(hooked)
    for module in cases:
        params = {k: v.detach() for k, v in module.named_parameters()}
        J = _loop_jacobian(module, params, X)
        _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", J, J) / 2)
    module = net()
    params = {k: v.detach() for k, v in module.named_parameters()}
    J = _loop_jacobian(module, params, X)
    J = torch.cat([J[:, :, :108], J[:, :, 112:]], 2)  # the first bias (4 entries) fixed
    del params["0.bias"]
    _close(tangent_gram(module, params, X), torch.einsum("ncp,mcp->nm", J, J) / 2)
    assert not taken


def test_plain_cnn_route_stays_within_the_budget_with_a_wide_first_convolution(monkeypatch):
    # One output of a CNN whose first convolution is 7 x 7: forming its gradients from
    # the pooled backprops gathers 147 patch entries at each of 32 channels' argmax,
    # 1.7x the (n, 1, 32, 256) backprop buffer the plan counts for them, and the rows of
    # patches besides; the peak was 1.4x the budget. Measured, not the plan's arithmetic;
    # K against the autograd loop's dense Jacobian.
    taken = _cnn_spy(monkeypatch)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 32, 7, padding=3), nn.ReLU(), _pool(),
                           nn.Conv2d(32, 8, 3, padding=1), nn.ReLU(), _pool(), nn.Flatten(),
                           nn.Linear(8 * 4 * 4, 2))
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(64, 3, 16, 16)
    budget = 2**24
    tangent_gram(module, params, X[:2], output=0, memory_budget=budget)  # one-time allocations
    K, peak = cpu_peak_bytes(lambda: tangent_gram(module, params, X, output=0,
                                                  memory_budget=budget))
    assert taken
    assert peak - K.nbytes <= budget, (peak - K.nbytes, budget)
    J = _loop_jacobian(module, params, X)[:, 0]
    _close(K, J @ J.T, 1e-5)


def test_plain_cnn_route_pools_within_the_budget(monkeypatch):
    # One output of a CNN with a wide first convolution and a Y, at about the least budget
    # the plan accepts: the forward's peak is part of the call's. Pooling by the
    # channels-last kernel on a copy of the ReLU's output beside it (then the results'
    # NCHW copies beside that) took the peak to 1.10x the budget (0.94x on NCHW rows);
    # the ReLU written in channels-last memory, freed before the copies, keeps the NCHW
    # pool's peak. Measured, not the plan's arithmetic; K against the autograd loop's
    # dense Jacobian.
    taken = _cnn_spy(monkeypatch)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3),
                           nn.Conv2d(128, 2, 1), nn.MaxPool2d(2), nn.Flatten(),
                           nn.Linear(2 * 4 * 4, 2))
    params = {k: v.detach() for k, v in module.named_parameters()}
    X, Y = torch.randn(48, 3, 24, 24), torch.randn(20, 3, 24, 24)
    budget = 12_700_000
    tangent_gram(module, params, X[:2], Y[:2], output=0, memory_budget=budget)  # one-time
    K, peak = cpu_peak_bytes(lambda: tangent_gram(module, params, X, Y, output=0,
                                                  memory_budget=budget))
    assert taken
    assert peak - K.nbytes <= budget, (peak - K.nbytes, budget)
    J, JY = _loop_jacobian(module, params, X)[:, 0], _loop_jacobian(module, params, Y)[:, 0]
    _close(K, J @ JY.T, 1e-5)


def test_trace_features_hold_the_jacobian_once():
    """``tangent_features(output="trace")`` with several outputs scales its Jacobian in
    place: a scaled copy beside the unscaled one held the result twice (peak 2.0x it)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 4))
    params = dict(module.named_parameters())
    X = torch.randn(300, 20)
    phi, peak = cpu_peak_bytes(lambda: tangent_features(module, params, X))
    assert peak < 1.5 * phi.nbytes, (peak, phi.nbytes)
    J = _loop_jacobian(module, {k: v.detach() for k, v in params.items()}, X)
    _close(phi, J.reshape(300, -1) / 2, 1e-5)
