"""decompose / attribute with n_jobs: query blocks on joblib workers equal the serial call.

The reference is the serial call itself; each block chooses its quadrature nodes for
``tol`` on its own, so the results agree to ``tol`` (1e-12 relative in float64), and the
warnings judge the joined result in the calling process.
"""

import joblib
import numpy as np
import pytest
from numpy.testing import assert_allclose

from skpathkernel import PathKernelMachine


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(30, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", max_iter=10,
                            dtype="float64", random_state=0).fit(X, y)
    return est, rng.uniform(-1, 1, size=(7, 2))


def _same(par, serial):
    size = np.abs(serial.prediction).max()
    # The forward passes of a block of rows round like those of all rows, to an ulp.
    assert_allclose(par.initial, serial.initial, rtol=1e-15)
    assert_allclose(par.prediction, serial.prediction, rtol=1e-15)
    assert_allclose(par.contributions, serial.contributions, rtol=0, atol=1e-12 * size)
    assert_allclose(par.regularization, serial.regularization, rtol=0, atol=1e-12 * size)
    assert par.error <= 1e-12 * size


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_n_jobs_matches_serial(fitted, backend):
    est, Xq = fitted
    serial = est.decompose(Xq)
    attribution = est.attribute(Xq)
    with joblib.parallel_config(backend=backend):
        _same(est.decompose(Xq, n_jobs=2), serial)
        got = est.attribute(Xq, n_jobs=2)
    assert_allclose(got, attribution, rtol=0, atol=1e-12 * np.abs(serial.prediction).max())


@pytest.mark.parametrize("backend", ["loky", "threading"])
@pytest.mark.parametrize("output", [None, "all"])
def test_explain_n_jobs_matches_serial(fitted, backend, output):
    """The serial explain, and the serial decomposition ranked by hand: the same points
    and contributions (agreeing to tol, as the blocks' nodes are their own)."""
    est, Xq = fitted
    idx, contrib = est.explain(Xq, n_neighbors=5, output=output)
    full = est.decompose(Xq).contributions[:, :, 0]
    by_hand = np.argsort(-np.abs(full), axis=1, kind="stable")[:, :5]
    assert np.array_equal(idx, by_hand)
    with joblib.parallel_config(backend=backend):
        got_idx, got = est.explain(Xq, n_neighbors=5, output=output, n_jobs=2)
    assert np.array_equal(got_idx, idx)
    size = np.abs(est.predict(Xq)).max()
    assert_allclose(got, contrib, rtol=0, atol=1e-12 * size)
    assert_allclose(got[:, :, 0], np.take_along_axis(full, idx, axis=1), rtol=0,
                    atol=1e-12 * size)


def test_workers_results_are_judged_here(fitted):
    est, Xq = fitted
    lrs = est.trajectory_.learning_rates
    recorded = lrs.copy()
    lrs *= 1.5  # a record that is not the training's
    try:
        with joblib.parallel_config(backend="loky"), \
                pytest.warns(UserWarning, match="misses the prediction") as caught:
            est.decompose(Xq, n_jobs=2)
        assert caught[0].filename == __file__
    finally:
        lrs[:] = recorded


@pytest.fixture(scope="module")
def sgd_fitted():
    rng = np.random.RandomState(1)
    X = rng.uniform(-1, 1, size=(40, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1] * X[:, 2]
    est = PathKernelMachine(hidden_layer_sizes=(16, 16), solver="sgd", batch_size=10,
                            learning_rate_init=0.2, max_iter=3, tol=None, dtype="float64",
                            random_state=0).fit(X, y)
    return est, rng.uniform(-1, 1, size=(9, 3))


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_plain_sgd_paths_split_their_steps(sgd_fitted, backend, monkeypatch):
    """Plain SGD's steps are independent: each worker takes a range of steps for every
    query, and the ranges' sums equal the serial decomposition, the contracted route
    (attribute) and explain included."""
    from skpathkernel._network import _trained

    est, Xq = sgd_fitted
    serial, attribution = est.decompose(Xq), est.attribute(Xq)
    idx, contrib = est.explain(Xq, n_neighbors=4)
    ranges = []
    run = _trained._decompose_steps

    def spy(start, stop, *args):
        ranges.append((start, stop))
        return run(start, stop, *args)

    if backend == "threading":  # in this process: the spy sees the split
        monkeypatch.setattr(_trained, "_decompose_steps", spy)
    with joblib.parallel_config(backend=backend):
        _same(est.decompose(Xq, n_jobs=2), serial)
        got = est.attribute(Xq, n_jobs=2)
        got_idx, got_contrib = est.explain(Xq, n_neighbors=4, n_jobs=2)
    n = len(est.trajectory_) - 1
    if backend == "threading":
        assert sorted(set(ranges)) == [(0, n // 2), (n // 2, n)]
    size = np.abs(serial.prediction).max()
    assert_allclose(got, attribution, rtol=0, atol=1e-12 * size)
    assert np.array_equal(got_idx, idx)
    assert_allclose(got_contrib, contrib, rtol=0, atol=1e-12 * size)


def test_many_queries_on_plain_sgd_split_the_queries(sgd_fitted, monkeypatch):
    """The cost model: 12 steps of 10 rows against 60 queries, whose reference f at every
    point would cost each step range more than the batches it saves."""
    from skpathkernel._network import _trained

    est, _ = sgd_fitted
    Xq = np.random.RandomState(5).uniform(-1, 1, size=(60, 3))
    serial = est.decompose(Xq)
    called = []
    for name in ("_decompose_steps", "_decompose_rows"):
        run = getattr(_trained, name)
        monkeypatch.setattr(_trained, name, lambda *a, run=run, name=name: (
            called.append(name), run(*a))[1])
    with joblib.parallel_config(backend="threading"):
        _same(est.decompose(Xq, n_jobs=2), serial)
    assert called == ["_decompose_rows"] * 2


def test_step_ranges_refused_where_the_adjoint_crosses_steps(fitted):
    from skpathkernel._analysis._decomposition import decompose

    est, Xq = fitted  # Adam
    net = est.network_
    X_fit, Y_fit = net._training_data()
    with pytest.raises(ValueError, match="plain SGD"):
        decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss, net.tensor(Xq),
                  intervals=(0, 2))
