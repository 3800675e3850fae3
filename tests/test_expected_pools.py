"""decompose(weighting="expected") credits each step to the points it could have drawn:
the data of the fit or partial_fit call that took it (its pool), each by its
probability of being in the batch times its weight, ``w_i / sum_pool w``. The reference
is the forward recursion of tests/_reference.py with those shares, which it computes
from the calls' own data and step counts, not from the recorded pools."""

import copy
import warnings

import numpy as np
import pytest
import torch
from _reference import forward_recursion, gauss_nodes
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernelMachine, Trajectory

PARAMS = dict(hidden_layer_sizes=(6,), max_iter=3, tol=None, dtype="float64",
              random_state=0, batch_size=8, normalize_y=False)
SOLVERS = {
    "sgd-heavy-ball": dict(solver="sgd", momentum=0.9, nesterovs_momentum=False,
                           learning_rate_init=0.05),
    "adam-l2": dict(solver="adam", alpha=0.01, learning_rate_init=0.02),
}
# Steps independent of each other: the first call's steps can be decomposed alone.
PLAIN = dict(solver="sgd", momentum=0.0, learning_rate_init=0.1)


def _squared(out, t):
    return 0.5 * ((out - t) ** 2).mean(dim=1)


def _data(n, shift, seed):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 3)) + shift
    return X, np.sin(X[:, 0]) + X[:, 1] - 0.5 * X[:, 2] ** 2


def _calls_shares(bounds, rows, weights):
    """Step t's shares: the rows of the call whose steps ``[bounds[c], bounds[c + 1])``
    hold t, each ``w_i / sum w`` over them (``1 / n`` unweighted)."""

    def shares(t, batch):
        c = int(np.searchsorted(bounds, t, side="right")) - 1
        r, w = rows[c], weights[c]
        w = np.ones(len(r)) if w is None else np.asarray(w, dtype=np.float64)
        return {int(i): float(wi / w.sum()) for i, wi in zip(r, w)}

    return shares


def _check_against_reference(est, X, y, Xq, shares):
    res = est.decompose(Xq, weighting="expected")
    contrib, reg = forward_recursion(est, X, torch.as_tensor(y).reshape(-1, 1), _squared,
                                     Xq, nodes=gauss_nodes(8), step_shares=shares)
    scale = np.abs(contrib).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-9 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-9 * max(scale, 1e-3))
    return res


def _first_call_only(est, Xq, n_steps):
    """The expected contributions of the first ``n_steps`` steps alone (plain SGD)."""
    kwargs = dict(method="exact", weighting="expected", intervals=(0, n_steps))
    return est.network_._decompose_block(Xq, None, kwargs)[0]


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_warm_start_on_other_data_credits_each_call_its_own_points(solver):
    """A warm start on shifted, weighted data: its steps credit only its own rows (a
    zero-weight row nothing), and the first fit's steps nothing of them."""
    X1, y1 = _data(20, 0.0, 0)
    X2, y2 = _data(16, 1.5, 1)
    w2 = np.random.RandomState(2).uniform(0.2, 3.0, size=len(X2))
    w2[[3, 7]] = 0.0
    est = PathKernelMachine(**PARAMS, **SOLVERS[solver], warm_start=True).fit(X1, y1)
    T1 = est.trajectory_.n_steps
    est.fit(X2, y2, sample_weight=w2)
    X, y = np.concatenate([X1, X2]), np.concatenate([y1, y2])
    assert_array_equal(est.X_fit_, X)
    Xq = np.concatenate([X1[:2], X2[:2]])
    shares = _calls_shares([0, T1], [np.arange(20), 20 + np.arange(16)], [None, w2])
    res = _check_against_reference(est, X, y, Xq, shares)
    assert_array_equal(res.contributions[:, 20 + np.flatnonzero(w2 == 0)], 0.0)
    # The pools the path reports, and through save and load.
    traj = est.trajectory_
    for t in (0, T1 - 1, T1, traj.n_steps - 1):
        idx, p = traj.pool(t)
        expected = shares(t, None)
        assert_array_equal(idx, sorted(expected))
        assert_allclose(p, [expected[i] for i in idx], rtol=1e-15)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_warm_start_pools_are_saved_and_pickled(storage, tmp_path):
    X1, y1 = _data(20, 0.0, 0)
    X2, y2 = _data(16, 1.5, 1)
    est = PathKernelMachine(**PARAMS, **SOLVERS["adam-l2"], warm_start=True,
                            trajectory_storage=storage, trajectory_dir=tmp_path).fit(X1, y1)
    est.fit(X2, y2, sample_weight=np.linspace(0.5, 2, 16))
    traj = est.trajectory_
    assert_array_equal(traj.pool(-1)[0], 20 + np.arange(16))
    traj.save(tmp_path / "path")
    copies = [Trajectory.load(tmp_path / "path"), copy.deepcopy(traj)]
    if storage == "disk":  # the directory the fit described
        copies.append(Trajectory.load(traj.directory))
    for other in copies:
        for t in range(traj.n_steps):
            for a, b in zip(other.pool(t), traj.pool(t)):
                assert_array_equal(a, b)


def test_partial_fit_on_disjoint_data_credits_each_call_its_own_points():
    """The second call's points get exactly 0 from the first call's steps."""
    X1, y1 = _data(24, 0.0, 3)
    X2, y2 = _data(16, -1.0, 4)
    est = PathKernelMachine(**PARAMS, **PLAIN)
    est.partial_fit(X1, y1)
    T1 = est.trajectory_.n_steps
    est.partial_fit(X2, y2)
    X, y = np.concatenate([X1, X2]), np.concatenate([y1, y2])
    Xq = X[[0, 30]]
    shares = _calls_shares([0, T1], [np.arange(24), 24 + np.arange(16)], [None, None])
    _check_against_reference(est, X, y, Xq, shares)
    first = _first_call_only(est, Xq, T1).contributions
    assert_array_equal(first[:, 24:], 0.0)
    assert np.abs(first[:, :24]).min() > 0


def test_single_fit_and_early_stopping_credit_every_training_point():
    """One fit draws from all its rows (1 / N each), the held-out rows of early_stopping
    from none: they are not training points at all."""
    X, y = _data(40, 0.0, 5)
    est = PathKernelMachine(**PARAMS, **SOLVERS["adam-l2"], early_stopping=True,
                            validation_fraction=0.25).fit(X, y)
    X_fit = est.X_fit_
    N = len(X_fit)
    assert N == 30
    shares = _calls_shares([0], [np.arange(N)], [None])
    y_fit = est.network_.y_fit.reshape(-1)
    _check_against_reference(est, X_fit, y_fit, X[:3], shares)


def test_weighted_full_batch_expected_is_the_realized_split():
    """Full batch, the pool is the batch: the expected weighting follows sample_weight
    as the realized one does, and says nothing; a path without its pools' weights (a
    PathRecorder loop, a path saved before they were kept) credits 1/N and warns."""
    X, y = _data(24, 0.0, 6)
    w = np.random.RandomState(7).uniform(0.2, 3.0, size=len(X))
    est = PathKernelMachine(**{**PARAMS, "batch_size": None}, **SOLVERS["sgd-heavy-ball"]
                            ).fit(X, y, sample_weight=w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = est.decompose(X[:3], weighting="expected")
        realized = est.decompose(X[:3])
    assert_allclose(expected.contributions, realized.contributions, rtol=0,
                    atol=1e-12 * np.abs(realized.contributions).max())
    est.trajectory_._pools = est.trajectory_._pool_weights = None
    with pytest.warns(UserWarning, match="ignores those weights"):
        unweighted = est.decompose(X[:3], weighting="expected")
    assert unweighted.error > 1e3 * realized.error
