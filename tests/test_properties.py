"""Property-based tests (hypothesis): random small networks, dtypes and data.

The profile (conftest.py) is derandomized with no deadline, so CI sees the same examples
every run; each test keeps max_examples small.
"""

import copy
import re

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernel, PathKernelMachine, TangentKernel


class _Scaled(torch.nn.Module):
    """Linear -> elementwise learned scale -> tanh -> Linear: a layer without a rule."""

    def __init__(self, n_in, n_out, width=5):
        super().__init__()
        self.a = torch.nn.Linear(n_in, width)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.b = torch.nn.Linear(width, n_out)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) * self.scale))


def _scaled(n_in, n_out):
    return _Scaled(n_in, n_out)


@st.composite
def problems(draw):
    """A fitted small network (MLP of random shape, or a module without a rule) and data."""
    dtype = draw(st.sampled_from(["float32", "float64"]))
    n, d, c = draw(st.integers(3, 8)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    values = st.floats(-2, 2, allow_nan=False, width=32)
    X = np.asarray(draw(st.lists(values, min_size=n * d, max_size=n * d))).reshape(n, d)
    y = np.asarray(draw(st.lists(values, min_size=n * c, max_size=n * c))).reshape(n, c)
    if draw(st.booleans()):
        net = dict(hidden_layer_sizes=tuple(draw(st.lists(st.integers(1, 6), min_size=1,
                                                          max_size=2))),
                   activation=draw(st.sampled_from(["tanh", "relu", "logistic", "gelu", "softplus",
                                                    "identity"])))
    else:
        net = dict(module=_scaled)
    est = PathKernelMachine(
        **net, solver=draw(st.sampled_from(["sgd", "adam", "rmsprop"])),
        batch_size=draw(st.sampled_from([None, 2])), learning_rate_init=0.02,
        max_iter=draw(st.integers(1, 3)), dtype=dtype, random_state=draw(st.integers(0, 99)),
    )
    return est, X, y


def _tol(est):
    return 1e-9 if est.dtype == "float64" else 1e-4


@settings(max_examples=12)
@given(problems())
def test_tangent_gram_is_symmetric_psd_and_normalized_diagonal_is_one(problem):
    est, X, y = problem
    est.fit(X, y)
    for kernel in (TangentKernel(est), PathKernel(est)):  # Adam/RMSprop: D > 0, still PSD
        K = kernel(X)
        assert_array_equal(K, K.T)
        scale = max(np.abs(K).max(), 1e-300)
        assert np.linalg.eigvalsh(K).min() >= -_tol(est) * len(X) * scale
        assert_allclose(kernel.diag(X), np.diag(K), rtol=_tol(est), atol=_tol(est) * scale)
    raw = TangentKernel(est).diag(X)
    normalized = TangentKernel(est, normalized=True)
    Kn = normalized(X)
    live = raw > 0
    assert_allclose(np.diag(Kn)[live], 1.0, rtol=_tol(est))
    assert_array_equal(np.diag(Kn)[~live], 0.0)
    assert_array_equal(normalized.diag(X), live.astype(float))
    assert np.all(np.abs(Kn) <= 1 + _tol(est))


@settings(max_examples=10)
@given(problems())
def test_exact_decomposition_error_is_round_off(problem):
    est, X, y = problem
    est.fit(X, y)
    res = est.decompose(X[:3])
    scale = max(np.abs(res.prediction).max(), np.abs(res.initial).max(),
                np.abs(res.contributions).sum(axis=1).max(), 1e-12)
    limit = 1e-9 if est.dtype == "float64" else 1e-4
    assert res.error / scale < limit, (res.error, scale)
    assert_allclose(res.reconstruction, res.prediction, atol=limit * scale)


@settings(max_examples=10)
@given(problems(), st.sampled_from([512, 4096]))
def test_chunked_equals_unchunked(problem, budget):
    est, X, y = problem
    est.fit(X, y)
    small = copy.copy(est)
    small.memory_budget = budget  # below fit's minimum: blocks of one or a few rows
    tol = dict(rtol=_tol(est), atol=_tol(est) * 1e-3)

    def at_small(fn):
        # A budget below one sample's needs is refused, naming the bytes: grant those.
        while True:
            try:
                return fn(small)
            except ValueError as exc:
                found = re.search(r"needs ([\d,]+) bytes for a single sample", str(exc))
                if found is None:
                    raise
                small.memory_budget = int(found.group(1).replace(",", ""))

    assert_allclose(at_small(lambda e: e.predict(X)), est.predict(X), **tol)
    assert_allclose(at_small(lambda e: e.transform(X)), est.transform(X), **tol)
    assert_allclose(at_small(lambda e: TangentKernel(e)(X)), TangentKernel(est)(X), **tol)
    assert_allclose(at_small(lambda e: PathKernel(e)(X[:2], X)), PathKernel(est)(X[:2], X),
                    **tol)


@settings(max_examples=8)
@given(problems())
def test_fit_is_deterministic_for_a_seed(problem):
    est, X, y = problem
    a = copy.deepcopy(est).fit(X, y)
    b = copy.deepcopy(est).fit(X, y)
    assert torch.equal(a.trajectory_._params, b.trajectory_._params)
    for s, t in zip(a.trajectory_.batches, b.trajectory_.batches):
        assert_array_equal(s, t)
    assert_array_equal(a.predict(X), b.predict(X))
    assert a.loss_curve_ == b.loss_curve_


def _dead_at_zero(n_in, n_out):
    # ReLU units with negative biases and no output bias: phi(0) = 0 exactly.
    net = torch.nn.Sequential(torch.nn.Linear(n_in, 4), torch.nn.ReLU(),
                              torch.nn.Linear(4, n_out, bias=False))
    with torch.no_grad():
        net[0].bias.fill_(-1.0)
    return net


def test_normalized_kernel_of_a_zero_feature_is_zero_in_gram_and_diag():
    X = np.array([[0.0, 0.0], [3.0, 1.0], [2.0, 3.0], [-3.0, 2.0]])
    est = PathKernelMachine(module=_dead_at_zero, max_iter=1, learning_rate_init=1e-3,
                            dtype="float64", random_state=0).fit(X, X[:, 0])
    assert TangentKernel(est).diag(X[:1])[0] == 0.0
    for kernel in (TangentKernel(est, normalized=True), PathKernel(est, normalized=True)):
        K = kernel(X)
        assert_array_equal(kernel.diag(X), np.diag(K))
        assert K[0, 0] == 0.0 and np.isclose(np.diag(K), 1.0).any()
