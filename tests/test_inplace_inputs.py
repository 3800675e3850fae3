"""A network that writes into its input (an in-place activation before its first layer
with parameters, ``x.mul_(2)`` in a forward).

No call may change the caller's X (a NumPy X shares its memory with the tensor the
network is handed), and every result must be that of the network on the X the caller
passed: the references are per-sample autograd loops (tests/_reference.py) of the same
network computing out of place, and fits of that network.
"""

import copy
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from _reference import features_loop, jacobian_loop, module_at
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.frozen import FrozenEstimator
from torch import nn

from skpathkernel import PathKernelMachine, TangentFeatures
from skpathkernel._path import _training
from skpathkernel._tangent import per_sample_jacobian, tangent_features, tangent_gram
from skpathkernel.diagnostics import hessian_trace, loss_path
from skpathkernel.kernels import PathKernel, TangentKernel, network_of, step_kernel

RTOL = 1e-10


class _Rescale(nn.Module):
    """``relu(2 x)``, written into ``x`` where ``inplace``: twice is ``relu(4 x)``, so a
    pass on rewritten rows shows (an idempotent ReLU alone would hide it)."""

    def __init__(self, inplace=True):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(2.0).relu_() if self.inplace else (2.0 * x).relu()


def _build(n_in, n_out):
    return nn.Sequential(_Rescale(), nn.Linear(n_in, 8), nn.Tanh(), nn.Linear(8, n_out))


def _build_relu(n_in, n_out):
    # The reviewer's network: nn.ReLU(inplace=True) on the input.
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(n_in, 8), nn.Tanh(),
                         nn.Linear(8, n_out))


def _out_of_place(module):
    """A copy of ``module`` computing the same function without writing into its input."""
    ref = copy.deepcopy(module)
    for layer in ref.modules():
        if isinstance(layer, _Rescale):
            layer.inplace = False
        elif isinstance(layer, nn.ReLU):
            layer.inplace = False
    return ref


_RNG = np.random.RandomState(0)
X_TRAIN = _RNG.normal(size=(24, 5))
Y_TRAIN = X_TRAIN[:, 0] - X_TRAIN[:, 1] ** 2
QUERIES = _RNG.normal(size=(7, 5))


def _fit(build=_build, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PathKernelMachine(module=build, max_iter=4, tol=None, dtype="float64",
                                 random_state=0, **kw).fit(X_TRAIN.copy(), Y_TRAIN)


@pytest.fixture(scope="module")
def est():
    return _fit()


def _reference_gram(est, A, B):
    """J(A) J(B)^T by the autograd loop of the out-of-place network, on copies."""
    ref = _out_of_place(module_at(est))
    JA = jacobian_loop(ref, A.copy()).reshape(len(A), -1).numpy()
    JB = jacobian_loop(ref, B.copy()).reshape(len(B), -1).numpy()
    return JA @ JB.T


def _unchanged(call, X):
    """``call(X)`` on a copy of ``X``, asserting that the copy is bitwise unchanged."""
    mine = X.copy()
    out = call(mine)
    assert_array_equal(mine, X)
    return out


@pytest.mark.parametrize("build", [_build, _build_relu])
def test_tangent_kernel_leaves_x_alone_and_matches_the_loop(build):
    est = _fit(build)
    ref = _reference_gram(est, QUERIES, QUERIES)
    K = _unchanged(TangentKernel(est), QUERIES)
    assert_allclose(K, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())
    K2 = _unchanged(lambda Q: TangentKernel(est)(Q, Q.copy()), QUERIES)
    assert_allclose(K2, K, rtol=RTOL, atol=RTOL * np.abs(ref).max())
    d = _unchanged(TangentKernel(est).diag, QUERIES)
    assert_allclose(d, np.diag(ref), rtol=RTOL)
    # A torch X: its own memory, which the kernel must not write either.
    Xt = torch.from_numpy(QUERIES.copy())
    Kt = TangentKernel(est)(Xt)
    assert_array_equal(Xt.numpy(), QUERIES)
    assert_allclose(Kt, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


def test_features_leave_x_alone_and_match_the_loop(est):
    ref = features_loop(_out_of_place(module_at(est)), QUERIES.copy())
    features = TangentFeatures(FrozenEstimator(est)).fit(X_TRAIN.copy())
    for transform in (est.transform, features.transform):
        phi = _unchanged(transform, QUERIES)
        assert_allclose(phi, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


def test_path_and_step_kernels_leave_x_alone(est):
    K = _unchanged(PathKernel(est), QUERIES)
    assert_allclose(_unchanged(lambda Q: PathKernel(est)(Q, Q.copy()), QUERIES), K,
                    rtol=RTOL, atol=RTOL * np.abs(K).max())
    _unchanged(PathKernel(est).diag, QUERIES)
    # The step kernel at the last recorded point is the tangent kernel there.
    Ks = _unchanged(lambda Q: step_kernel(est, Q, step=-1), QUERIES)
    ref = _reference_gram(est, QUERIES, QUERIES)
    assert_allclose(Ks, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


@pytest.mark.parametrize("kw", [{}, {"batch_size": 5}])
def test_fit_leaves_x_alone_and_trains_as_the_out_of_place_network(kw):
    X = X_TRAIN.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = PathKernelMachine(module=_build, max_iter=4, tol=None, dtype="float64",
                                random_state=0, **kw).fit(X, Y_TRAIN)
        twin = PathKernelMachine(module=lambda n_in, n_out: _out_of_place(_build(n_in, n_out)),
                                 max_iter=4, tol=None, dtype="float64", random_state=0,
                                 **kw).fit(X_TRAIN.copy(), Y_TRAIN)
    assert_array_equal(X, X_TRAIN)
    assert_allclose(est.trajectory_.parameters(-1).numpy(),
                    twin.trajectory_.parameters(-1).numpy(), rtol=1e-12, atol=1e-14)
    assert_allclose(_unchanged(est.predict, QUERIES), twin.predict(QUERIES), rtol=1e-12)


def test_decompose_and_attribute_leave_x_alone(est):
    twin = _fit(lambda n_in, n_out: _out_of_place(_build(n_in, n_out)))
    for method in ("exact", "first_order", "second_order"):
        got = _unchanged(lambda Q, m=method: est.decompose(Q, method=m), QUERIES)
        want = twin.decompose(QUERIES.copy(), method=method)
        for name in ("contributions", "initial", "prediction"):
            assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-12)
    # attribute replays the training on the fitted rows: they must stay as fitted too.
    for method in ("exact", "unrolled"):
        got = _unchanged(lambda Q, m=method: est.attribute(Q, method=m, output=0), QUERIES)
        want = twin.attribute(QUERIES.copy(), method=method, output=0)
        assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-12)
    assert_array_equal(network_of(est).X_fit, X_TRAIN)


def test_diagnostics_leave_x_alone(est):
    y = QUERIES[:, 0].copy()
    _unchanged(lambda Q: hessian_trace(est, Q, y, n_samples=2, random_state=0), QUERIES)
    _unchanged(lambda Q: loss_path(est, Q, y), QUERIES)


@pytest.mark.parametrize("exclude", [frozenset(), frozenset({"1.weight", "1.bias"})])
def test_engine_and_generic_fallback_leave_x_alone(exclude):
    """tangent_gram and tangent_features on a torch X, with the first Linear on the rules'
    route or on the generic fallback (per-sample Jacobians by torch.func)."""
    torch.manual_seed(0)
    module = _build(5, 2).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.from_numpy(QUERIES.copy())
    J = jacobian_loop(_out_of_place(module), QUERIES.copy())
    ref = torch.einsum("icp,jcp->ij", J, J) / 2  # the trace kernel: a mean over outputs
    K = tangent_gram(module, params, X, exclude=exclude)
    assert_array_equal(X.numpy(), QUERIES)
    assert_allclose(K, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    assert_allclose(tangent_gram(module, params, X, X.clone(), exclude=exclude), ref,
                    rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    phi = tangent_features(module, params, X, output="full")
    assert_array_equal(X.numpy(), QUERIES)
    assert_allclose(phi, J, rtol=RTOL, atol=RTOL * float(J.abs().max()))
    jac = per_sample_jacobian(module, params, X, list(params), [0, 1], memory_budget=2**20)
    assert_array_equal(X.numpy(), QUERIES)
    got = torch.cat([jac[k] for k in params], dim=2)
    assert_allclose(got, J, rtol=RTOL, atol=RTOL * float(J.abs().max()))


def test_initial_loss_of_a_run_away_first_epoch_leaves_x_alone():
    """A first epoch whose loss runs away (over DIVERGENCE_LOSS_RATIO times its first
    batch's) has the divergence check compare with the initial network's loss on every
    row (_initial_loss): a forward pass of its own, after the first epoch, on rows of X
    itself. Without a copy of them it rewrote the caller's X, and the second epoch
    trained on the rewritten rows (no other test reaches that pass)."""
    calls = []
    initial_loss = _training._initial_loss

    def spy(*args, **kwargs):
        calls.append(1)
        return initial_loss(*args, **kwargs)

    params = dict(max_iter=2, tol=None, dtype="float64", solver="sgd",
                  learning_rate_init=3.0, batch_size=5, random_state=0)
    X = X_TRAIN.copy()
    with warnings.catch_warnings(), mock.patch.object(_training, "_initial_loss", spy):
        warnings.simplefilter("ignore")
        est = PathKernelMachine(module=_build, **params).fit(X, Y_TRAIN)
        twin = PathKernelMachine(
            module=lambda n_in, n_out: _out_of_place(_build(n_in, n_out)),
            **params).fit(X_TRAIN.copy(), Y_TRAIN)
    assert len(calls) == 2  # the pass this test is about ran, in each fit
    assert_array_equal(X, X_TRAIN)
    assert_allclose(est.loss_curve_, twin.loss_curve_, rtol=1e-12)


def _build_saved(n_in, n_out):
    # nn.ReLU(inplace=True) rewrites the output Tanh saved for its derivative.
    return nn.Sequential(nn.Linear(n_in, 8), nn.Tanh(), nn.ReLU(inplace=True),
                         nn.Linear(8, n_out))


def test_kernels_and_features_of_an_in_place_op_on_a_saved_tensor():
    # Autograd refuses this network's backward pass, so it is trained out of place and
    # handed to the kernels in place (a model trained elsewhere); the general route
    # failed with "modified by an inplace operation" for two outputs, K(X, Y), the
    # features and the path kernel. References: the out-of-place network's loop.
    Y2 = np.c_[Y_TRAIN, X_TRAIN[:, 2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = PathKernelMachine(module=lambda n_in, n_out: _out_of_place(
            _build_saved(n_in, n_out)), max_iter=4, tol=None, dtype="float64",
            random_state=0).fit(X_TRAIN.copy(), Y2)
    twin = copy.deepcopy(est)
    for layer in est.module_.modules():
        if isinstance(layer, nn.ReLU):
            layer.inplace = True
    ref = _reference_gram(est, QUERIES, QUERIES) / 2
    tol = RTOL * np.abs(ref).max()
    assert_allclose(TangentKernel(est)(QUERIES), ref, rtol=RTOL, atol=tol)
    assert_allclose(TangentKernel(est)(QUERIES, X_TRAIN[:3]),
                    _reference_gram(est, QUERIES, X_TRAIN[:3]) / 2, rtol=RTOL, atol=tol)
    phi = features_loop(_out_of_place(module_at(est)), QUERIES.copy())
    assert_allclose(est.transform(QUERIES), phi, rtol=RTOL, atol=RTOL * np.abs(phi).max())
    Ks = step_kernel(est, QUERIES, step=0)
    ref0 = _reference_gram_at(est, 0, QUERIES) / 2
    assert_allclose(Ks, ref0, rtol=RTOL, atol=RTOL * np.abs(ref0).max())
    K = PathKernel(est)(QUERIES)
    assert_allclose(K, PathKernel(twin)(QUERIES), rtol=RTOL, atol=RTOL * np.abs(K).max())


def _reference_gram_at(est, point, A):
    ref = _out_of_place(module_at(est, point))
    J = jacobian_loop(ref, A.copy()).reshape(len(A), -1).numpy()
    return J @ J.T
