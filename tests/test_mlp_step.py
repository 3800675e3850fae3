"""The hand-written gradient of plain MLPs against autograd's, bit for bit, and the cases
that must fall back to autograd."""

import numpy as np
import pytest
import torch
from numpy.testing import assert_array_equal

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._path._losses import LOSSES, Loss
from skpathkernel._path._mlp_step import MLPGradient

ACTIVATIONS = {
    "relu": torch.nn.ReLU,
    "tanh": torch.nn.Tanh,
    "gelu": torch.nn.GELU,
    "gelu-tanh": lambda: torch.nn.GELU(approximate="tanh"),
    "softplus": lambda: torch.nn.Softplus(beta=2.0, threshold=5.0),
    "identity": torch.nn.Identity,
    "logistic": torch.nn.Sigmoid,
}


def _net(d, widths, c, act, dtype, seed=0):
    torch.manual_seed(seed)
    sizes = [d, *widths]
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), ACTIVATIONS[act]()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], c)).to(dtype)


def _targets(kind, n, c, dtype, g):
    if kind == "squared_error":
        return torch.randn(n, c, generator=g, dtype=dtype)
    if kind == "multilabel":  # a 0/1 indicator in the network's dtype, as fit passes it
        return torch.randint(0, 2, (n, c), generator=g).to(dtype)
    return torch.randint(0, max(c, 2), (n,), generator=g)


def _autograd(net, loss, X, y):
    for p in net.parameters():
        p.grad = None
    value = loss(net(X), y)
    value.backward()
    return value.detach(), [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize(
    "loss_name,c", [("squared_error", 1), ("squared_error", 3), ("log_loss", 1), ("log_loss", 4),
                    ("multilabel", 3)]
)
@pytest.mark.parametrize(
    "n,d,widths", [(37, 5, (64, 64)), (1, 1, (1,)), (3, 2, (1, 7)), (200, 30, (16,))]
)
def test_gradient_and_loss_equal_autograd_bit_for_bit(n, d, widths, loss_name, c, act, dtype):
    g = torch.Generator().manual_seed(n + d)
    X = torch.randn(n, d, generator=g, dtype=dtype)
    y = _targets(loss_name, n, c, dtype, g)
    net = _net(d, widths, c, act, dtype)
    loss = LOSSES["log_loss" if loss_name == "multilabel" else loss_name]()
    ref_value, ref_grads = _autograd(net, loss, X, y)
    for p in net.parameters():
        p.grad = None
    gradient = MLPGradient.build(net, loss, X)
    assert gradient is not None
    value = gradient(X, y)
    assert_array_equal(value.numpy(), ref_value.numpy())
    for p, ref in zip(net.parameters(), ref_grads):
        assert p.grad.shape == ref.shape
        assert_array_equal(p.grad.numpy(), ref.numpy())


class _Custom(Loss):
    def per_sample(self, output, target):
        return (output - target).abs().mean(dim=1)


def _hooked():
    net = _net(3, (4,), 1, "tanh", torch.float32)
    net[0].register_forward_hook(lambda *a: None)
    return net


def _frozen():
    net = _net(3, (4,), 1, "tanh", torch.float32)
    net[0].bias.requires_grad_(False)
    return net


def _no_bias():
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4, bias=False), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    )


@pytest.mark.parametrize(
    "make,loss",
    [
        (lambda: _net(3, (4,), 1, "tanh", torch.float32), _Custom()),
        (_hooked, LOSSES["squared_error"]()),
        (_frozen, LOSSES["squared_error"]()),
        (_no_bias, LOSSES["squared_error"]()),
        (
            lambda: torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.Dropout(0.0), torch.nn.Linear(4, 1)
            ),
            LOSSES["squared_error"](),
        ),
        (
            lambda: torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 1)
            ),
            LOSSES["squared_error"](),
        ),
        (lambda: torch.nn.Linear(3, 1), LOSSES["squared_error"]()),
    ],
    ids=["custom-loss", "hook", "frozen", "no-bias", "dropout", "inplace", "not-sequential"],
)
def test_anything_else_falls_back_to_autograd(make, loss):
    assert MLPGradient.build(make(), loss, torch.randn(5, 3)) is None


def test_other_input_dtype_falls_back_to_autograd():
    net = _net(3, (4,), 1, "tanh", torch.float32)
    assert MLPGradient.build(net, LOSSES["squared_error"](), torch.randn(5, 3).double()) is None


def _module_factory(n_features, n_outputs):
    # The same architecture as the default network, but built by the user: autograd's
    # path is the reference the hand-written one must reproduce.
    return torch.nn.Sequential(
        torch.nn.Linear(n_features, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, n_outputs),
    )


class _Wrapped(torch.nn.Module):
    """The default network inside another module: trained through autograd."""

    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.net = _module_factory(n_features, n_outputs)

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize(
    "est_cls,y_kind",
    [(PathKernelClassifier, "binary"), (PathKernelClassifier, "multi"),
     (PathKernelClassifier, "multilabel"), (PathKernelMachine, "reg")],
)
def test_fitted_path_equals_the_autograd_trained_one(est_cls, y_kind):
    """The recorded path is the one autograd gives: the same network wrapped in a module
    that the hand-written gradient does not take is trained through autograd."""
    rng = np.random.RandomState(0)
    X = rng.randn(60, 4)
    y = {
        "binary": (X[:, 0] > 0).astype(int),
        "multi": rng.randint(0, 3, 60),
        "multilabel": np.c_[X[:, :2] > 0, rng.randint(0, 2, 60)].astype(int),
        "reg": X @ [1.0, -1.0, 0.5, 0.0],
    }[y_kind]
    kw = dict(max_iter=6, batch_size=16, tol=None, random_state=0)
    fast = est_cls(module=_module_factory, **kw).fit(X, y)
    slow = est_cls(module=_Wrapped, **kw).fit(X, y)
    assert_array_equal(fast.trajectory_._params.numpy(), slow.trajectory_._params.numpy())
    for key in fast.trajectory_.state_keys:
        assert_array_equal(
            fast.trajectory_.optimizer_state(-1)[key].numpy(),
            slow.trajectory_.optimizer_state(-1)[key].numpy(),
        )
    assert fast.loss_curve_ == slow.loss_curve_
