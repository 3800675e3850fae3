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
