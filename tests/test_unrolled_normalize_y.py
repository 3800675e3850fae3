"""The unrolled attribution of regressors whose targets ``normalize_y`` standardizes.

A refit with other sample weights standardizes its targets anew, so the derivative of
its prediction with respect to a point's weight has a part through the targets' mean and
scale. The references are central finite differences of such refits, written here: each
point's ``sample_weight`` moved up and down, the estimator fitted again from the same
seed (the same initialization and batches), its prediction differenced.
"""

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernelMachine
from skpathkernel._analysis import _unrolled
from skpathkernel.metrics import _replay, retrain_on_subsets

H = 1e-5
COMMON = dict(activation="tanh", max_iter=6, tol=None, dtype="float64", random_state=0)
SOLVERS = {
    "sgd_full_batch": dict(solver="sgd", learning_rate_init=0.1, batch_size=None),
    "adam_batches": dict(solver="adam", learning_rate_init=0.02, batch_size=5),
}


def _data(n=12, constant=False):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3))
    y = np.column_stack([5 * np.sin(X[:, 0]) + 10,
                         np.full(n, 3.0) if constant else X[:, 1] * X[:, 2] - 4])
    weights = rng.uniform(0.5, 2.0, size=n)
    return X, y, weights


def _finite_differences(fit, n, predict):
    """Central differences of ``predict(fit(w))`` in each point's weight multiplier."""
    columns = []
    for i in range(n):
        up, down = np.ones(n), np.ones(n)
        up[i] += H
        down[i] -= H
        columns.append((predict(fit(up)) - predict(fit(down))) / (2 * H))
    return np.stack(columns, axis=-1)


def _max_error(scores, reference):
    return np.abs(np.asarray(scores) - reference).max() / np.abs(reference).max()


@pytest.fixture(params=["mlp_products", "forward_over_reverse", "double_backward"])
def route(request, monkeypatch):
    """Each of the sweep's three product routes (the targets' products come from each)."""
    if request.param != "mlp_products":
        monkeypatch.setattr(_unrolled, "MLP_PRODUCTS", False)
        monkeypatch.setattr(_unrolled, "FORWARD_WORK",
                            0.0 if request.param == "forward_over_reverse" else np.inf)
    return request.param


@pytest.mark.parametrize("solver", SOLVERS)
def test_scores_are_the_derivative_of_weighted_refits(route, solver):
    X, y, s = _data()
    params = dict(hidden_layer_sizes=(6,), **SOLVERS[solver], **COMMON)
    est = PathKernelMachine(**params).fit(X, y, sample_weight=s)
    Xq = X[:2] + 0.3
    fd = _finite_differences(
        lambda w: PathKernelMachine(**params).fit(X, y, sample_weight=s * w), len(y),
        lambda e: e.predict(Xq))  # (queries, outputs, points)
    for output in (0, 1):
        scores = est.attribute(Xq, method="unrolled", output=output)
        assert _max_error(scores, fd[:, output]) < 1e-6
    # The moments' part is what a held mean and scale leave out: well above the tolerance.
    held = PathKernelMachine(normalize_y=False, **params).fit(
        X, (y - est._y_mean) / est._y_scale, sample_weight=s)
    held_scores = est._y_scale[0] * np.asarray(held.attribute(Xq, method="unrolled",
                                                              output=0))
    assert _max_error(held_scores, fd[:, 0]) > 1e-3


def test_self_influence_and_a_constant_column(route):
    X, y, s = _data(constant=True)
    params = dict(hidden_layer_sizes=(6,), **SOLVERS["adam_batches"], **COMMON)
    est = PathKernelMachine(**params).fit(X, y, sample_weight=s)
    assert est._y_scale[1] == 1.0  # only centered
    fd = _finite_differences(
        lambda w: PathKernelMachine(**params).fit(X, y, sample_weight=s * w), len(y),
        lambda e: e.predict(X))
    for output in (0, 1):
        own = est.self_influence(output=output)
        assert _max_error(own, np.diagonal(fd[:, output])) < 1e-6
        assert _max_error(est.attribute(X[:3], method="unrolled", output=output),
                          fd[:3, output]) < 1e-6


def test_partial_fit_moments_of_the_first_call_only():
    """partial_fit keeps the first call's moments: only its points move them."""
    X, y, s = _data(n=14)
    y = y[:, 0]
    params = dict(hidden_layer_sizes=(5,), **SOLVERS["adam_batches"], **COMMON)
    first, second = slice(0, 8), slice(8, 14)

    def fit(w):
        est = PathKernelMachine(**params)
        est.partial_fit(X[first], y[first], sample_weight=(s * w)[first])
        return est.partial_fit(X[second], y[second], sample_weight=(s * w)[second])

    est = fit(np.ones(len(y)))
    assert est._y_moment_rows == 8
    Xq = X[:2] - 0.2
    fd = _finite_differences(fit, len(y), lambda e: e.predict(Xq))
    assert _max_error(est.attribute(Xq, method="unrolled"), fd) < 1e-6


def test_float32_scores_against_refits():
    """A float32 path: its scores against finite differences of float64 refits (the
    float32 training rounds otherwise: 3.4e-5 measured, float64's 3.8e-10)."""
    X, y, s = _data(n=30)
    params = dict(hidden_layer_sizes=(8,), **SOLVERS["adam_batches"], **COMMON)
    est32 = PathKernelMachine(**{**params, "dtype": "float32"}).fit(X, y, sample_weight=s)
    fd = _finite_differences(
        lambda w: PathKernelMachine(**params).fit(X, y, sample_weight=s * w), len(y),
        lambda e: e.predict(X[:4])[:, 1])
    assert _max_error(est32.attribute(X[:4], method="unrolled", output=1), fd) < 1e-3


def test_replay_restandardizes_the_kept_targets():
    """The replay of the path on a subset is a full-batch refit with the others' weight
    set to 0, whose targets are standardized over the kept points."""
    X, y, s = _data(n=16)
    params = dict(hidden_layer_sizes=(6,), **SOLVERS["sgd_full_batch"], **COMMON)
    est = PathKernelMachine(**params).fit(X, y, sample_weight=s)
    Xq = X[:3] + 0.1
    for output in (0, 1):
        res = retrain_on_subsets(est, X, y, Xq, n_subsets=3, subset_fraction=0.5,
                                 protocol="replay", random_state=0,
                                 output=lambda e, Z, k=output: e.predict(Z)[:, k])
        for mask, outputs in zip(res.subsets, res.outputs):
            refit = PathKernelMachine(**params).fit(X, y, sample_weight=s * mask)
            np.testing.assert_allclose(outputs, refit.predict(Xq)[:, output], rtol=1e-10,
                                       atol=1e-10)


def test_replay_of_a_subset_that_leaves_a_column_constant():
    """The kept points' targets of a column are all equal: a refit only centers it
    (scale 1 in y's units), and so does the replay."""
    X, y, s = _data(n=16)
    y[:, 1] = np.where(np.arange(16) < 8, 3.0, 7.0)
    params = dict(hidden_layer_sizes=(6,), **SOLVERS["sgd_full_batch"], **COMMON)
    est = PathKernelMachine(**params).fit(X, y, sample_weight=s)
    mask = np.arange(16) < 8
    replay = _replay(est, mask)
    refit = PathKernelMachine(**params).fit(X, y, sample_weight=s * mask)
    assert_allclose(replay._y_scale, refit._y_scale, rtol=1e-12)
    assert_allclose(replay.predict(X), refit.predict(X), rtol=1e-10, atol=1e-10)


def test_replay_without_the_moments_rows_holds_them_and_says_so():
    X, y, s = _data(n=14)
    params = dict(hidden_layer_sizes=(5,), **SOLVERS["sgd_full_batch"], **COMMON)
    est = PathKernelMachine(**params).partial_fit(X[:4], y[:4]).partial_fit(X[4:], y[4:])
    with pytest.warns(UserWarning, match="keeps none of the first 4 training points"):
        replay = _replay(est, np.arange(14) >= 4)
    assert_array_equal(replay._y_scale, est._y_scale)


def test_warm_start_with_other_weights_holds_the_moments():
    X, y, s = _data()
    params = dict(hidden_layer_sizes=(6,), **SOLVERS["sgd_full_batch"], **COMMON)
    est = PathKernelMachine(warm_start=True, **params).fit(X, y, sample_weight=s)
    est.fit(X, y, sample_weight=s[::-1].copy())  # same data: the second fit's weights
    with pytest.warns(UserWarning, match="not the weighted moments"):
        scores = est.attribute(X[:2], method="unrolled", output=0)
    held = est.network_._attribute(X[:2], None, method="unrolled", weighting="realized",
                                   output=0, n_nodes=None, tol=None, n_jobs=None,
                                   margin="no", scale=est._y_scale)
    np.testing.assert_array_equal(scores, held)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu(route):
    """Each route's targets' products on the device: the CPU's scores (float64, the
    same training)."""
    X, y, s = _data()
    params = dict(hidden_layer_sizes=(6,), **SOLVERS["adam_batches"], **COMMON)
    gpu, cpu = (PathKernelMachine(device=d, **params).fit(X, y, sample_weight=s)
                for d in ("cuda", "cpu"))
    for output in (0, 1):
        np.testing.assert_allclose(
            gpu.attribute(X[:3], method="unrolled", output=output),
            cpu.attribute(X[:3], method="unrolled", output=output), rtol=1e-9, atol=1e-12)
