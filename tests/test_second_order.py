"""Analyses that differentiate twice, through layers whose fused torch kernels have no
second derivative (attention: ``attribute(method="unrolled")``,
``decompose(method="second_order")`` and ``hessian_trace`` raised on every
TransformerEncoderLayer) or a wrong one (weight norm: unrolled scores missed the
training's derivative silently). Checked against finite differences of first derivatives
(which the fused kernels get right) and against the same networks with the layer written
out by hand."""

import math
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import (
    forward_recursion,
    jacobian_loop,
    module_with,
    weight_finite_differences,
)
from test_rules_fuzz import _Clip  # tanh as a plain autograd.Function
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from skpathkernel import PathKernelMachine, RecordedNetwork
from skpathkernel._analysis import _decomposition
from skpathkernel._analysis._decomposition import _add_hvp_rows, _all_outputs_in_one_pass
from skpathkernel._second_order import twice_differentiable
from skpathkernel.diagnostics import hessian_trace

D, HEADS, LENGTH = 6, 2, 4


class Encoder(torch.nn.Module):
    """Tokens of 2 features, one post-norm encoder layer (GELU, no dropout), mean pool."""

    def __init__(self, n_outputs):
        super().__init__()
        self.inp = torch.nn.Linear(2, D)
        self.layer = torch.nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=8,
                                                      dropout=0.0, activation="gelu",
                                                      batch_first=True)
        self.head = torch.nn.Linear(D, n_outputs)

    def forward(self, x):
        return self.head(self.layer(self.inp(x.reshape(-1, LENGTH, 2))).mean(1))


class EncoderByHand(Encoder):
    """The same function and parameters, the attention written out (no fused kernel)."""

    def forward(self, x):
        h = self.inp(x.reshape(-1, LENGTH, 2))
        attn, layer = self.layer.self_attn, self.layer

        def heads(t):
            return t.reshape(*t.shape[:2], HEADS, D // HEADS).transpose(1, 2)

        q, k, v = map(heads, F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // HEADS), dim=-1) @ v
        h = layer.norm1(h + attn.out_proj(a.transpose(1, 2).reshape(h.shape)))
        h = layer.norm2(h + layer.linear2(F.gelu(layer.linear1(h))))
        return self.head(h.mean(1))


class Normed(torch.nn.Module):
    """A weight-normalised hidden layer (torch's parametrization, or its older hook)."""

    def __init__(self, n_outputs, hook=False, dim=0):
        super().__init__()
        layer = torch.nn.Linear(2 * LENGTH, D)
        if hook:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation
                self.hidden = torch.nn.utils.weight_norm(layer, dim=dim)
        else:
            self.hidden = torch.nn.utils.parametrizations.weight_norm(layer, dim=dim)
        self.head = torch.nn.Linear(D, n_outputs)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


class NormedByHand(torch.nn.Module):
    """The parametrized network's function, under the same parameter names."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Module()
        self.hidden.bias = torch.nn.Parameter(torch.zeros(D))
        self.hidden.parametrizations = torch.nn.Module()
        weight = self.hidden.parametrizations.weight = torch.nn.Module()
        weight.original0 = torch.nn.Parameter(torch.ones(D, 1))
        weight.original1 = torch.nn.Parameter(torch.ones(D, 2 * LENGTH))
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x):
        weight = self.hidden.parametrizations.weight
        g, v = weight.original0, weight.original1
        w = v * g / v.pow(2).sum(dim=1, keepdim=True).sqrt()
        return self.head(torch.tanh(F.linear(x, w, self.hidden.bias)))


def _encoder(n_features, n_outputs):
    torch.manual_seed(0)
    return Encoder(n_outputs).eval()


def _normed(n_features, n_outputs):
    torch.manual_seed(0)
    return Normed(n_outputs)


def _normed_hook(n_features, n_outputs):
    torch.manual_seed(0)
    return Normed(n_outputs, hook=True)


def _normed_whole(n_features, n_outputs):
    torch.manual_seed(0)
    return Normed(n_outputs, dim=None)  # one norm over the whole weight (dim -1)


def _normed_columns(n_features, n_outputs):
    torch.manual_seed(0)
    return Normed(n_outputs, hook=True, dim=1)


MODULES = {"attention": _encoder, "weight-norm": _normed, "weight-norm-hook": _normed_hook,
           "weight-norm-whole": _normed_whole, "weight-norm-columns": _normed_columns}


def _fit(name, solver="adam"):
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 2 * LENGTH))
    y = np.sin(X[:, 0]) + X[:, 3] * X[:, 5]
    lr = 0.02 if solver == "adam" else 0.1
    est = PathKernelMachine(module=MODULES[name], solver=solver, learning_rate_init=lr,
                            batch_size=5, max_iter=2, tol=None, normalize_y=False,
                            dtype="float64", random_state=0).fit(X, y)
    return est, X, y


@pytest.mark.parametrize("solver", ["sgd", "adam"])
@pytest.mark.parametrize("name", MODULES)
def test_unrolled_scores_equal_finite_differences_of_torch_optim(name, solver):
    est, X, _ = _fit(name, solver)
    scores = est.attribute(X[:2], method="unrolled")
    points = (0, 6, 13)
    fd = weight_finite_differences(est.network_, X[:2], points,
                                   build=lambda: MODULES[name](X.shape[1], 1))
    np.testing.assert_allclose(scores[:, points], fd, rtol=1e-6, atol=1e-9)
    # Adam's key bias, whose gradient is its rounding, reads 1.7e-12 in its steps' units.
    assert scores.replay_error < 1e-11


@pytest.mark.parametrize("name", MODULES)
def test_hessian_trace_probes_equal_finite_differences_of_the_gradient(name):
    est, X, y = _fit(name)
    res = hessian_trace(est, n_samples=4, random_state=0)
    traj, module = est.trajectory_, est.module_
    theta = traj.parameters(-1).to(torch.float64)
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y).reshape(-1, 1)

    def gradient(t):  # the mean squared-error loss's, first derivatives only
        t = t.clone().requires_grad_(True)
        out = functional_call(module, dict(traj.unflatten(t)), (Xt,))
        (g,) = torch.autograd.grad((0.5 * (out - Yt) ** 2).mean(), t)
        return g

    seed = int(np.random.RandomState(0).randint(np.iinfo(np.int32).max))
    generator = torch.Generator().manual_seed(seed)
    for estimate in res.estimates:
        v = (2 * torch.randint(0, 2, theta.shape, generator=generator, dtype=torch.int8)
             - 1).to(torch.float64)

        def central(h, v=v):
            return float(v @ (gradient(theta + h * v) - gradient(theta - h * v))) / (2 * h)

        reference = (4 * central(1e-4) - central(2e-4)) / 3  # Richardson: O(h^4)
        assert estimate == pytest.approx(reference, rel=1e-7)


@pytest.mark.parametrize("name, by_hand", [("attention", lambda: EncoderByHand(1)),
                                           ("weight-norm", NormedByHand)])
def test_second_order_decomposition_equals_the_layer_written_by_hand(name, by_hand):
    est, X, y = _fit(name)
    hand = by_hand().double().eval()
    hand.load_state_dict(est.module_.state_dict())
    Xq = torch.as_tensor(X[:3])
    np.testing.assert_allclose(hand(Xq).detach().numpy(), est.module_(Xq).detach().numpy(),
                               rtol=1e-13)
    twin = RecordedNetwork(hand, est.trajectory_, X_train=X, y_train=y)
    ours = est.decompose(X[:3], method="second_order")
    ref = twin.decompose(X[:3], method="second_order")
    np.testing.assert_allclose(ours.contributions, ref.contributions, rtol=1e-9, atol=1e-13)


class _ScaledNet(torch.nn.Module):
    """A learnt 0-d scale: its Hessian-vector block has no dimension after the outputs."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.a, self.b = torch.nn.Linear(n_in, 6), torch.nn.Linear(6, n_out)
        self.s = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.s) + x.pow(2).sum(1, keepdim=True) * self.s


def test_second_order_decomposition_of_a_module_with_a_scalar_parameter():
    """``J_t(x) + 1/2 (H_t(x) dtheta_t)^T`` against the forward per-sample recursion with
    the derivative along the step by central differences (nodes 0 and +-h); a 0-d
    parameter raised an IndexError in the Hessian-vector products."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(10, 2))
    y = np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 0]]
    est = PathKernelMachine(module=_ScaledNet, solver="adam", learning_rate_init=0.02,
                            alpha=0.01, batch_size=4, max_iter=2, dtype="float64",
                            normalize_y=False, tol=None, random_state=0).fit(X, y)
    res = est.decompose(X[:2] + 0.1, method="second_order")
    h = 1e-4
    nodes = (np.array([0.0, h, -h]), np.array([1.0, 1 / (4 * h), -1 / (4 * h)]))

    def squared(out, target):
        return 0.5 * (out - target).pow(2).mean(dim=1)

    contrib, reg = forward_recursion(est, X, torch.as_tensor(y), squared, X[:2] + 0.1, nodes)
    np.testing.assert_allclose(res.contributions, contrib, rtol=0,
                               atol=1e-7 * np.abs(contrib).max())
    np.testing.assert_allclose(res.regularization, reg, rtol=0, atol=1e-7 * np.abs(reg).max())


def test_the_swap_is_counted_across_threads_and_restored():
    """Concurrent calls (joblib's threads) keep the swap until the last ends; each
    restoring its own entry state would bring the fused kernels back under the other."""
    flash, fused = torch.backends.cuda.flash_sdp_enabled, torch._weight_norm
    assert flash()
    inside, release, seen = threading.Event(), threading.Event(), []

    def long_call():
        with twice_differentiable():
            inside.set()
            release.wait(10)
            seen.append((flash(), torch._weight_norm is fused))

    worker = threading.Thread(target=long_call)
    worker.start()
    inside.wait(10)
    with twice_differentiable():
        assert not flash() and torch._weight_norm is not fused
    assert not flash() and torch._weight_norm is not fused  # the other call is inside
    release.set()
    worker.join()
    assert seen == [(False, False)]
    assert flash() and torch._weight_norm is fused
    # A user's own choice of backends is what it returns to.
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]):
        with twice_differentiable():
            assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and not flash()


def test_the_swap_stays_until_the_last_call_ends_whichever_entered_first():
    """Overlapping calls that end in the order they began (first in, first out): a call
    restoring its own entry state would bring the fused kernels back under the later one,
    and leave the swap in place for good when that one ends."""
    flash, fused = torch.backends.cuda.flash_sdp_enabled, torch._weight_norm
    first_inside, first_may_end, second_inside, seen = (threading.Event(), threading.Event(),
                                                        threading.Event(), [])

    def first():
        with twice_differentiable():
            first_inside.set()
            first_may_end.wait(10)

    worker = threading.Thread(target=first)
    worker.start()
    first_inside.wait(10)

    def second():
        with twice_differentiable():
            second_inside.set()
            first_may_end.set()
            worker.join(10)  # the first call has ended: this one is still inside
            seen.append((flash(), torch._weight_norm is fused))

    second()
    assert seen == [(False, False)]
    assert flash() and torch._weight_norm is fused


class _OnceTanh(_Clip):
    """tanh whose backward is @once_differentiable, as custom CUDA-style layers write it."""

    backward = staticmethod(torch.autograd.function.once_differentiable(_Clip.backward))


class _OnceNet(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.a, self.b = torch.nn.Linear(n_features, 6), torch.nn.Linear(6, n_outputs)

    def forward(self, x):
        return self.b(_OnceTanh.apply(self.a(x)))


def test_a_backward_that_cannot_be_differentiated_is_refused_not_dropped():
    """torch differentiates around a @once_differentiable backward: the Hessian-vector
    products missed the layer's part (the unrolled scores were 0.83 off finite differences,
    the Hessian probes off too), silently. Refused, naming the cause; first-order methods
    still work. (The second-order decomposition raised functorch's RuntimeError about
    setup_context, which named no cause in the network.)"""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 3))
    est = PathKernelMachine(module=_OnceNet, max_iter=2, batch_size=5, tol=None,
                            dtype="float64", random_state=0).fit(X, np.sin(X[:, 0]))
    with pytest.raises(ValueError, match="once_differentiable"):
        est.attribute(X[:2], method="unrolled")
    with pytest.raises(ValueError, match="once_differentiable"):
        hessian_trace(est, n_samples=2, random_state=0)
    with pytest.raises(ValueError, match="once_differentiable"):
        est.decompose(X[:2], method="second_order")
    exact = est.attribute(X[:2], method="exact")
    assert np.all(np.isfinite(exact))


@pytest.mark.parametrize("call", ["attribute(X[:2], method='unrolled')",
                                  "decompose(X[:2], method='second_order')"])
def test_first_forward_mode_product_of_a_process_warns_of_nothing(call):
    """torch scripts its forward-mode decompositions at a process's first jvp, warning
    DeprecationWarning (torch.jit.script): under a user's warnings-as-errors the
    unrolled scores and the second-order decomposition raised. A fresh process each, every
    DeprecationWarning an error once the libraries are imported; the unrolled scores on
    their forward-over-reverse route, which this small a network would not take."""
    script = (
        "import warnings\n"
        "import numpy as np\n"
        "from skpathkernel import PathKernelMachine\n"
        "from skpathkernel._analysis import _unrolled\n"
        "_unrolled.FORWARD_WORK = 0\n"
        "X = np.random.RandomState(0).normal(size=(12, 3))\n"
        "est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, batch_size=4, tol=None,\n"
        "                        random_state=0).fit(X, X.sum(1))\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        f"est.{call}\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


class _LayerNormed(torch.nn.Module):
    """A hidden layer normalized with a learnt scale and shift (nn.LayerNorm), and a
    per-channel normalization with learnt affine parameters (nn.InstanceNorm1d)."""

    def __init__(self, n_features, n_outputs):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(n_features, 8), torch.nn.Linear(8, n_outputs)
        self.norm = torch.nn.LayerNorm(8)
        self.instance = torch.nn.InstanceNorm1d(2, affine=True)
        with torch.no_grad():  # away from the initial 1 and 0, which hide a wrong block
            for p in (*self.norm.parameters(), *self.instance.parameters()):
                p.add_(torch.rand(p.shape))

    def forward(self, x):
        h = self.norm(self.a(x))
        h = self.instance(h.reshape(-1, 2, 4)).reshape(-1, 8)
        return self.b(torch.tanh(h))


def _sequential_layer_norm(n_features, n_outputs):
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():  # away from the initial 1 and 0, which hide a wrong block
        for p in norm.parameters():
            p.add_(torch.rand(p.shape))
    return torch.nn.Sequential(torch.nn.Linear(n_features, 8), norm, torch.nn.Tanh(),
                               torch.nn.Linear(8, n_outputs))


def _sequential_conv(n_features, n_outputs):
    # On (n, 1, 6) inputs: the one-pass route (GroupNorm, unlike LayerNorm, is
    # differentiated right there), checked by the same reference.
    torch.manual_seed(0)
    group = torch.nn.GroupNorm(1, 3)
    with torch.no_grad():
        for p in group.parameters():
            p.add_(torch.rand(p.shape))
    return torch.nn.Sequential(torch.nn.Conv1d(1, 3, 3), group, torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(12, n_outputs))


def _normalize_hook(layer, inputs, out):
    return F.layer_norm(out, out.shape[-1:], layer.scale, layer.shift)


def _sequential_hooked_norm(n_features, n_outputs):
    # nn.Sequential of allowlisted types, but a forward hook (registered by the user, as
    # a patched forward could be) normalizes the Linear's output with learnt parameters:
    # the same layer norm, which the types alone do not show.
    torch.manual_seed(0)
    first = torch.nn.Linear(n_features, 8)
    first.scale = torch.nn.Parameter(1 + torch.rand(8))
    first.shift = torch.nn.Parameter(torch.rand(8))
    first.register_forward_hook(_normalize_hook)
    return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(8, n_outputs))


@pytest.mark.parametrize("name", ["layer-norm", "attention", "sequential-layer-norm",
                                  "sequential-conv", "sequential-hooked-norm"])
def test_second_order_decomposition_through_affine_normalization(name):
    """``J_t(x) + 1/2 (H_t(x) dtheta_t)^T`` against the forward per-sample recursion with
    the derivative along the step by central differences of first derivatives. torch
    differentiates the backward of an affine layer norm or instance norm wrongly when it
    is vmapped over the outputs (``jvp`` of ``jacrev``, torch 2.13): the products missed
    the curvature term by about 1% on every TransformerEncoderLayer (its post-norms),
    silently; the by-hand comparison above shares the layer norms, so it could not see
    it."""
    rng = np.random.RandomState(0)
    if name == "attention":
        est, X, y = _fit("attention")
        Y, Xq = torch.as_tensor(y).reshape(-1, 1), X[:2] + 0.1
    else:
        X = rng.uniform(-1, 1, size=(10, 3))
        Y = torch.as_tensor(np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 2]])
        module = {"layer-norm": _LayerNormed, "sequential-layer-norm": _sequential_layer_norm,
                  "sequential-conv": _sequential_conv,
                  "sequential-hooked-norm": _sequential_hooked_norm}[name]
        if name == "sequential-conv":
            X = rng.uniform(-1, 1, size=(10, 1, 6))
            Y = torch.as_tensor(np.c_[np.sin(3 * X[:, 0, 0]) + X[:, 0, 1], X[:, 0, 2]])
        est = PathKernelMachine(module=module, solver="adam", learning_rate_init=0.05,
                                batch_size=4, max_iter=2, dtype="float64",
                                normalize_y=False, tol=None, random_state=0).fit(X, Y)
        Xq = X[:2] + 0.1
    res, contrib, curvature = _second_order_and_its_reference(est, X, Y, Xq)
    assert curvature > 1e-3 * np.abs(contrib).max()  # the term this checks is not nothing
    np.testing.assert_allclose(res.contributions, contrib, rtol=0, atol=1e-6 * curvature)
    # Which route took it: one pass only for the layers torch differentiates right there.
    one_pass = _all_outputs_in_one_pass(est.module_, est.trajectory_)
    assert one_pass == (name == "sequential-conv")


def _every_batched_backward_safe_layer(n_features, n_outputs):
    """Each layer type of the one-pass allowlist but Embedding, on (n, 64) inputs, with
    affine parameters and running statistics away from their initial values."""
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Unflatten(1, (1, 4, 4, 4)), nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2), nn.Tanh(),
        nn.ConvTranspose3d(2, 2, 2), nn.MaxPool3d(2), nn.AvgPool3d(1),
        nn.AdaptiveAvgPool3d(2), nn.Flatten(2), nn.Unflatten(2, (2, 4)),
        nn.Conv2d(2, 3, (1, 2)), nn.BatchNorm2d(3), nn.GELU(),
        nn.ConvTranspose2d(3, 2, (1, 2)), nn.MaxPool2d((1, 2)), nn.AvgPool2d(1),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(2),
        nn.Conv1d(2, 4, 2), nn.GroupNorm(2, 4), nn.SiLU(), nn.ConvTranspose1d(4, 4, 2),
        nn.RMSNorm([4, 4]), nn.BatchNorm1d(4), nn.Sigmoid(), nn.MaxPool1d(2),
        nn.AvgPool1d(1), nn.AdaptiveAvgPool1d(2), nn.ReLU(), nn.Flatten(),
        nn.Linear(8, 6), nn.Softplus(), nn.Dropout(0.2), nn.Identity(), nn.ELU(),
        nn.Linear(6, 6), nn.LeakyReLU(0.1), nn.Mish(), nn.Hardtanh(-2, 2),
        nn.Linear(6, n_outputs))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d,
                              nn.BatchNorm3d)):
                for p in m.parameters():
                    p.add_(torch.rand(p.shape))
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def test_every_layer_of_the_one_pass_allowlist_gives_the_derivative_of_the_jacobian():
    """``(H_t(x) dtheta)^T`` by the one pass (``jvp`` of ``jacrev``) through every layer
    type the allowlist admits, against central differences of the per-sample Jacobian
    (a plain autograd loop) along dtheta: torch differentiates an affine layer norm's
    batched backward wrongly there (20% off on a Linear-LayerNorm-Tanh-Linear), so a
    layer type that joins the list, or a torch that breaks one in it, must show here."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(8, 64))
    Y = np.c_[np.sin(X[:, 0]) + X[:, 1], X[:, 2]]
    est = PathKernelMachine(module=_every_batched_backward_safe_layer, solver="adam",
                            learning_rate_init=0.05, batch_size=4, max_iter=1,
                            dtype="float64", normalize_y=False, tol=None,
                            random_state=0).fit(X, Y)
    traj, module = est.trajectory_, est.module_
    assert _all_outputs_in_one_pass(module, traj)
    theta = traj.parameters(1).to(torch.float64)
    delta = torch.as_tensor(rng.normal(size=theta.shape[0]))
    sizes = [int(np.prod(p.shape)) for _, p in module.named_parameters()]
    layout = dict(zip(traj.names, zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes)))
    Xq = torch.as_tensor(X[:3] + 0.1)
    hvp = torch.zeros(3, 2, theta.shape[0], dtype=torch.float64)
    _add_hvp_rows(module, traj, layout, theta, delta, Xq, hvp, 1.0, 2)
    h = 1e-4
    fd = (jacobian_loop(module_with(est, theta + h * delta), Xq)
          - jacobian_loop(module_with(est, theta - h * delta), Xq)) / (2 * h)
    assert fd.abs().max() > 1e-3
    np.testing.assert_allclose(hvp.numpy(), fd.numpy(), rtol=0, atol=1e-6 * fd.abs().max())


class _Recurrent(torch.nn.Module):
    """A batch_first recurrent layer on (n, 4, 2) sequences, a head on its last output;
    ``packed``: on packed sequences whose lengths, 2 to 4, each sample's first features
    set (as a padding mask would), the head on the last state."""

    def __init__(self, n_out, cell, packed=False):
        super().__init__()
        step = issubclass(cell, torch.nn.RNNCellBase)  # a cell, looped over the steps
        self.rnn = cell(2, 3) if step else cell(2, 3, batch_first=True)
        self.head = torch.nn.Linear(3, n_out)
        self.packed = packed

    def forward(self, x):
        x = x.reshape(-1, 4, 2)
        if self.packed:
            lengths = 2 + (x[:, 0, 0] > 0).long() + (x[:, 1, 0] > 0).long()
            h = self.rnn(torch.nn.utils.rnn.pack_padded_sequence(
                x, lengths.cpu(), batch_first=True, enforce_sorted=False))[1]
            return self.head((h[0] if isinstance(h, tuple) else h)[-1])
        if isinstance(self.rnn, torch.nn.RNNBase):
            return self.head(self.rnn(x)[0][:, -1])
        h = None
        for t in range(x.shape[1]):
            h = self.rnn(x[:, t], h)
        return self.head(h)


@pytest.mark.parametrize("cell, packed", [
    (torch.nn.LSTM, False), (torch.nn.GRU, False), (torch.nn.RNN, False),
    (torch.nn.GRUCell, False), (torch.nn.LSTM, True), (torch.nn.GRU, True)])
def test_second_order_decomposition_of_a_recurrent_network(cell, packed):
    """``J_t(x) + 1/2 (H_t(x) dtheta_t)^T`` against the forward per-sample recursion with
    the derivative along the step by central differences of first derivatives (a plain
    autograd loop). torch's recurrent kernels have no vmap rule for their forward-mode
    derivative: every second-order decomposition of an LSTM, GRU, RNN or a loop of their
    cells raised a shape error. ``pack_padded_sequence`` has no forward-mode derivative at
    all, and torch.func cannot differentiate its backward: on packed sequences it raised
    torch's NotImplementedError ("Trying to use forward AD with _pack_padded_sequence"),
    or a RuntimeError where the lengths came from the input."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(10, 8))
    Y = torch.as_tensor(np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 2] * X[:, 7]])

    def build(n_features, n_outputs):
        torch.manual_seed(0)
        return _Recurrent(n_outputs, cell, packed)

    est = PathKernelMachine(module=build, solver="adam", learning_rate_init=0.05,
                            batch_size=4, max_iter=2, dtype="float64", normalize_y=False,
                            tol=None, random_state=0).fit(X, Y)
    Xq = X[:2] + 0.1
    res, contrib, curvature = _second_order_and_its_reference(est, X, Y, Xq)
    assert curvature > 1e-4 * np.abs(contrib).max()  # the term this checks is not nothing
    np.testing.assert_allclose(res.contributions, contrib, rtol=0, atol=1e-6 * curvature)


def _second_order_and_its_reference(est, X, Y, Xq):
    """``decompose(method="second_order")`` of a squared-error fit, the forward
    recursion's contributions with the step's second derivative by central differences
    of first derivatives, and the size of the curvature term (reference less first
    order)."""
    res = est.decompose(Xq, method="second_order")
    h = 1e-4
    nodes = (np.array([0.0, h, -h]), np.array([1.0, 1 / (4 * h), -1 / (4 * h)]))

    def squared(out, target):
        return 0.5 * (out - target).pow(2).mean(dim=1)

    contrib, _ = forward_recursion(est, X, Y, squared, Xq, nodes)
    first = est.decompose(Xq, method="first_order").contributions
    return res, contrib, np.abs(contrib - first).max()


class _Normed(torch.nn.Module):
    """A layer norm (the per-output route) and a learnt 0-d scale."""

    def __init__(self, n_features, n_outputs):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm = torch.nn.Linear(n_features, 6), torch.nn.LayerNorm(6)
        self.b, self.scale = torch.nn.Linear(6, n_outputs), torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.scale


def _tanh_mlp(n_features, n_outputs):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(n_features, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, n_outputs))


def _lstm(n_features, n_outputs):
    torch.manual_seed(0)
    return _Recurrent(n_outputs, torch.nn.LSTM)


def _recurrent_data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(10, 8))
    return X, np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 2] * X[:, 7]]


@pytest.mark.parametrize("build", [_tanh_mlp, _Normed, _lstm])
def test_the_double_backward_route_gives_the_forward_mode_products(build, monkeypatch):
    """Where forward-mode AD has no derivative for an operation (a packed sequence),
    the curvature products are taken by plain autograd's double backward: the same
    numbers as the forward-mode route, on networks that both take (all outputs in one
    pass, one output at a time with a 0-d parameter, one query at a time)."""
    X, Y = _recurrent_data()
    est = PathKernelMachine(module=build, solver="adam", learning_rate_init=0.05,
                            batch_size=4, max_iter=2, dtype="float64", normalize_y=False,
                            tol=None, random_state=0).fit(X, Y)
    Xq = X[:4] + 0.1
    fast = est.decompose(Xq, method="second_order").contributions
    first = est.decompose(Xq, method="first_order").contributions
    assert np.abs(fast - first).max() > 1e-3 * np.abs(fast).max()  # a curvature term

    def no_forward_ad(*args, **kwargs):
        raise NotImplementedError("Trying to use forward AD with _pack_padded_sequence")

    calls = []
    by_autograd = _decomposition._hvp_by_autograd
    monkeypatch.setattr(_decomposition, "jvp", no_forward_ad)
    monkeypatch.setattr(_decomposition, "_hvp_by_autograd",
                        lambda *a: calls.append(1) or by_autograd(*a))
    slow = est.decompose(Xq, method="second_order").contributions
    assert calls
    np.testing.assert_allclose(slow, fast, rtol=0, atol=1e-12 * np.abs(fast).max())


def test_a_float32_lstm_has_its_second_order_decomposition():
    """torch's float32 LSTM on the CPU (oneDNN's mkldnn_rnn_layer) has no forward-mode
    derivative: its second-order decomposition raised NotImplementedError before the
    double backward took it. Against the float64 fit of the same network and batches."""
    X, Y = _recurrent_data()
    res = {}
    for dtype in ("float32", "float64"):
        est = PathKernelMachine(module=_lstm, solver="adam", learning_rate_init=0.05,
                                batch_size=4, max_iter=2, dtype=dtype, normalize_y=False,
                                tol=None, random_state=0).fit(X, Y)
        res[dtype] = est.decompose(X[:3] + 0.1, method="second_order").contributions
    scale = np.abs(res["float64"]).max()
    np.testing.assert_allclose(res["float32"], res["float64"], rtol=0, atol=1e-5 * scale)


class _DetachedTanh(torch.autograd.Function):
    """tanh whose backward reads a detached copy of its output: differentiating the
    backward misses the activation's own curvature, and nothing marks it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.y = y.detach().clone()
        return y

    @staticmethod
    def backward(ctx, g):
        return g * (1 - ctx.y * ctx.y)


class _DetachedNet(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(n_features, 6), torch.nn.Linear(6, n_outputs)

    def forward(self, x):
        return self.b(_DetachedTanh.apply(self.a(x)))


def test_only_a_missing_forward_derivative_falls_back_to_the_double_backward():
    """A custom autograd.Function without setup_context is refused by torch.func
    (RuntimeError): the fallback for packed sequences took every RuntimeError, and
    differentiated this one's backward twice, which reads a detached tensor: the
    curvature term came out 3% off, without a word. It raises torch's error again."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 3))
    est = PathKernelMachine(module=_DetachedNet, max_iter=5, batch_size=5, tol=None,
                            learning_rate_init=0.1, dtype="float64",
                            random_state=0).fit(X, np.sin(X[:, 0]))
    with pytest.raises(RuntimeError, match="setup_context"):
        est.decompose(X[:3], method="second_order")
