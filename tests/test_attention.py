"""Analyses that differentiate twice, through nn.MultiheadAttention: torch's fused CPU
attention kernel has no double backward and no forward-mode rule, and
``attribute(method="unrolled")``, ``decompose(method="second_order")`` and
``hessian_trace`` raised on every TransformerEncoderLayer. Checked against finite
differences of first derivatives (which the fused kernel has) and against the same
network with its attention written out by hand."""

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import weight_finite_differences
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from skpathkernel import PathKernelMachine, RecordedNetwork
from skpathkernel._attention import twice_differentiable_attention
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


class ByHand(Encoder):
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


def _encoder(n_features, n_outputs):
    torch.manual_seed(0)
    return Encoder(n_outputs).eval()


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 2 * LENGTH))
    y = np.sin(X[:, 0]) + X[:, 3] * X[:, 5]
    est = PathKernelMachine(module=_encoder, solver="adam", learning_rate_init=0.02,
                            batch_size=5, max_iter=2, tol=None, normalize_y=False,
                            dtype="float64", random_state=0).fit(X, y)
    return est, X, y


def test_the_fused_kernel_has_no_second_derivative(fitted):
    # What the fix is for: if torch gains the derivative, the context becomes redundant.
    est, X, _ = fitted
    x = torch.as_tensor(X[:2]).requires_grad_(True)
    (g,) = torch.autograd.grad(est.module_(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.autograd.grad(g.sum(), x)


def test_unrolled_scores_equal_finite_differences_of_torch_optim(fitted):
    est, X, _ = fitted
    scores = est.attribute(X[:2], method="unrolled")
    points = (0, 6, 13)
    fd = weight_finite_differences(est.network_, X[:2], points)
    np.testing.assert_allclose(scores[:, points], fd, rtol=1e-6, atol=1e-9)
    assert scores.replay_error < 1e-12


def test_hessian_trace_probes_equal_finite_differences_of_the_gradient(fitted):
    est, X, y = fitted
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


def test_second_order_decomposition_equals_the_hand_written_attention(fitted):
    est, X, y = fitted
    hand = ByHand(1).double().eval()
    hand.load_state_dict(est.module_.state_dict())
    twin = RecordedNetwork(hand, est.trajectory_, X_train=X, y_train=y)
    Xq = X[:3]
    np.testing.assert_allclose(hand(torch.as_tensor(Xq)).detach().numpy(),
                               est.module_(torch.as_tensor(Xq)).detach().numpy(), rtol=1e-13)
    ours = est.decompose(Xq, method="second_order")
    ref = twin.decompose(Xq, method="second_order")
    np.testing.assert_allclose(ours.contributions, ref.contributions, rtol=1e-9, atol=1e-13)


def test_the_backend_switch_is_counted_across_threads_and_restored():
    """Concurrent calls (joblib's threads) keep the math backend until the last ends; each
    restoring its own entry state would re-enable the fused kernel under the other."""
    enabled = torch.backends.cuda.flash_sdp_enabled
    assert enabled()
    inside, release, seen = threading.Event(), threading.Event(), []

    def long_call():
        with twice_differentiable_attention():
            inside.set()
            release.wait(10)
            seen.append(enabled())

    worker = threading.Thread(target=long_call)
    worker.start()
    inside.wait(10)
    with twice_differentiable_attention():
        assert not enabled()
    assert not enabled()  # the other call is still inside
    release.set()
    worker.join()
    assert seen == [False] and enabled()
    # A user's own choice of backends is what it returns to.
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]):
        with twice_differentiable_attention():
            assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and not enabled()
