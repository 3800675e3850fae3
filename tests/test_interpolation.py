"""The kernel-machine decomposition against independent references.

The brute-force reference runs the optimizer's recursion FORWARD, keeping every training
sample's own share of the momentum / Adam buffer, with Jacobians from a plain per-sample
autograd loop; the library runs a backward adjoint recursion on structured Jacobians.
"""


import gc
import re
import warnings
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _reference import forward_recursion, gauss_nodes, module_at
from numpy.testing import assert_allclose, assert_array_equal

from benchmarks.bench_thinned_checkpoints import held_vectors
from skpathkernel import PathKernelClassifier, PathKernelMachine

# The old defaults, pinned: the targets as given, exactly max_iter epochs (the references
# replay that path), tanh; OLD adds the old solver for the calls that name none.
RAW = dict(normalize_y=False, tol=None, activation="tanh")
OLD = dict(RAW, solver="sgd")

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate_init=0.1),
    "sgd-momentum-l2": dict(solver="sgd", learning_rate_init=0.05, momentum=0.9, alpha=0.01),
    "sgd-heavy-ball-l2": dict(solver="sgd", learning_rate_init=0.05, momentum=0.9, alpha=0.01,
                              nesterovs_momentum=False),
    "adam-l2": dict(solver="adam", learning_rate_init=0.01, alpha=0.01),
    "adamw": dict(solver="adamw", learning_rate_init=0.01, alpha=0.1),
    "rmsprop-l2": dict(solver="rmsprop", learning_rate_init=0.005, alpha=0.01),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    return X, np.sin(3 * X[:, 0]) + X[:, 1], rng.uniform(-1, 1, size=(3, 2))


def _module_at(est, k):
    return module_at(est, k)


def _brute_force(est, X_train, Y_train, per_sample_loss, X, n_nodes=6):
    """Contributions (n, N, C) and regularization (n, C) by the forward per-sample recursion."""
    return forward_recursion(est, X_train, Y_train, per_sample_loss, X,
                             nodes=gauss_nodes(n_nodes))


def _squared(out, y):
    return 0.5 * (out - y).pow(2).mean(dim=1)


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("batch_size", [None, 5])
def test_exact_contributions_equal_brute_force(data, name, batch_size):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6,), max_iter=3, batch_size=batch_size,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, y)
    res = est.decompose(X)
    Y = torch.as_tensor(y).reshape(-1, 1)
    contrib, reg = _brute_force(est, X_train, Y, _squared, X)
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))
    if est.alpha:
        assert np.abs(res.regularization).max() > 1e-6  # weight decay is really credited
    with torch.no_grad():
        X_t = torch.as_tensor(X)
        assert_allclose(res.initial, _module_at(est, 0)(X_t).numpy(), rtol=1e-12)
        assert_allclose(res.prediction, _module_at(est, -1)(X_t).numpy(), rtol=1e-12)


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("batch_size", [None, 7])
def test_exact_reproduces_the_network_regression(data, name, batch_size):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(16, 16), max_iter=15, batch_size=batch_size,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, y)
    res = est.decompose(X)
    recon = res.initial + res.contributions.sum(axis=1) + res.regularization
    assert_allclose(recon, res.prediction, rtol=1e-9, atol=1e-9)
    assert res.error <= 1e-9 * max(1.0, np.abs(res.prediction).max())
    assert_allclose(res.prediction[:, 0], est.predict(X), rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd-momentum-l2", "adam-l2", "adamw"])
@pytest.mark.parametrize("n_classes", [2, 3])
def test_exact_reproduces_the_network_classification(data, name, n_classes):
    X_train, y, X = data
    labels = np.digitize(y, np.quantile(y, np.linspace(0, 1, n_classes + 1)[1:-1]))
    clf = PathKernelClassifier(hidden_layer_sizes=(12,), max_iter=10, batch_size=6,
                               dtype="float64", random_state=0, **SOLVERS[name])
    clf.fit(X_train, labels)
    res = clf.decompose(X)
    n_out = 1 if n_classes == 2 else n_classes
    assert res.contributions.shape == (len(X), len(X_train), n_out)
    assert res.error <= 1e-9 * max(1.0, np.abs(res.prediction).max())
    expected = clf.decision_function(X).reshape(len(X), n_out)
    assert_allclose(res.prediction, expected, rtol=1e-12)


def test_first_and_second_order_converge_at_their_orders(data):
    """Same training time, half the step: first-order error halves, second-order quarters."""
    X_train, y, X = data
    errors = {"first_order": [], "second_order": []}
    for lr, steps in [(0.2, 20), (0.1, 40), (0.05, 80)]:
        est = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), learning_rate_init=lr,
                                max_iter=steps, dtype="float64", random_state=0)
        est.fit(X_train, y)
        for method in errors:
            errors[method].append(est.decompose(X, method=method).error)
    first, second = np.array(errors["first_order"]), np.array(errors["second_order"])
    assert np.all(second < first)
    assert_allclose(first[:-1] / first[1:], 2.0, rtol=0.25)
    assert_allclose(second[:-1] / second[1:], 4.0, rtol=0.3)


def test_expected_weighting(data):
    X_train, y, X = data
    full = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), max_iter=10, learning_rate_init=0.1,
                             dtype="float64", random_state=0).fit(X_train, y)
    assert_allclose(full.decompose(X, weighting="expected").contributions,
                    full.decompose(X).contributions, rtol=1e-12, atol=1e-15)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # full batch: expected is exact, nothing to say
        full.decompose(X, weighting="expected")
    mini = PathKernelMachine(**{**full.get_params(), "batch_size": 4}).fit(X_train, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        realized = mini.decompose(X)
    with pytest.warns(UserWarning, match=r"minibatches' deviation .* miss the prediction by "
                      r"(\S+) ") as rec:
        expected = mini.decompose(X, weighting="expected")
    assert realized.error < 1e-10 < expected.error  # honest: expected is an approximation
    assert expected.error < 0.5 * np.abs(realized.prediction - realized.initial).max()
    # The miss it states is the split's, measured here from the parts and the network.
    miss = np.abs(expected.initial + expected.contributions.sum(axis=1)
                  + expected.regularization - mini.predict(X).reshape(expected.prediction.shape)
                  ).max()
    said = float(re.search(r"miss the prediction by (\S+) ", str(rec[0].message)).group(1))
    assert_allclose(said, miss, rtol=1e-2)


def test_explain_agrees_with_sorted_contributions(data):
    X_train, y, X = data
    est = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), max_iter=5, dtype="float64",
                            learning_rate_init=0.01, random_state=0).fit(X_train, y)
    idx, contrib = est.explain(X, n_neighbors=4)
    full = est.decompose(X).contributions[:, :, 0]
    for q in range(len(X)):
        ranked = np.argsort(-np.abs(full[q]))[:4]
        assert_array_equal(np.sort(idx[q]), np.sort(ranked))
        assert_allclose(contrib[q, :, 0], full[q, idx[q]])
        assert np.all(np.diff(np.abs(contrib[q, :, 0])) <= 0)


def test_float32_error_is_at_round_off(data):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(32, 32), solver="adam", max_iter=30,
                            learning_rate_init=0.01, random_state=0).fit(X_train, y)
    res = est.decompose(X)
    change = np.abs(res.prediction - res.initial).max()
    assert change > 0.1
    assert res.error < 1e-5 * max(1.0, np.abs(res.prediction).max())


@pytest.mark.parametrize("solver, lr, every, loud", [("adam", 0.003, 4, True),
                                                     ("sgd", 0.1, 2, False)])
def test_thinned_path_that_cannot_be_replayed_warns_of_its_miss(solver, lr, every, loud,
                                                                 monkeypatch):
    """Where the unrecorded steps cannot be replayed (the reason stood in for here; a
    real one below), each interval's steps take their batches' gradients (and Adam's
    preconditioner) at the interval's first point: Adam's preconditioner moves most inside
    the first intervals, so that recorded every 4 steps its contributions miss the logit
    f(x_T) by more than f(x_T) - f(x_0), and the warning states that ratio, recomputed
    here from plain forward passes at the path's ends, and why nothing was replayed.
    Thinned SGD misses by less than 1% of the change: it still warns, without the loud
    phrase. Replayed, the same path is split exactly, silently."""
    import skpathkernel._analysis._decomposition as interpolation

    rng = np.random.RandomState(0)
    X = rng.normal(size=(40, 4))
    y = (X[:, 0] + X[:, 1] > 0).astype(int)
    est = PathKernelClassifier(hidden_layer_sizes=(16,), activation="tanh", solver=solver,
                               learning_rate_init=lr, max_iter=5, batch_size=8,
                               record_every=every, tol=None, dtype="float64",
                               random_state=0).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replayed = est.decompose(X[:5])
    assert replayed.replay_error < 1e-13
    assert replayed.error < 1e-12 * np.abs(replayed.prediction).max()

    def refused(traj, module, what):
        raise ValueError(f"{what} stands in for a refusal.")

    monkeypatch.setattr(interpolation, "check_replayable", refused)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        res = est.decompose(X[:5])
    assert res.replay_error is None
    with torch.no_grad():
        X_t = torch.as_tensor(X[:5])
        f_0, f_T = (module_at(est, k)(X_t).numpy() for k in (0, -1))
    miss = np.abs(f_0 + res.contributions.sum(axis=1) + res.regularization - f_T).max()
    relative = miss / np.abs(f_T - f_0).max()
    assert res.error == pytest.approx(miss, rel=1e-9)
    said = [str(w.message) for w in rec if "recorded every" in str(w.message)]
    assert (relative > 1, relative > 0.01) == (loud, loud)
    assert len(said) == 1
    ratio = re.search(r"Decomposition.error\), (\S+) times the largest change", said[0])
    assert ratio.group(1) == f"{relative:.2g}"
    assert ("more than the change itself" in said[0]) == loud
    assert "cannot be replayed (the replay of the unrecorded steps stands in" in said[0]
    assert "record_every=1" in said[0]


def test_thinned_path_with_undeclared_batches_is_not_replayed():
    """A recorded loop whose step declared an empty batch: its steps are not replayed
    (the replay takes an empty batch for an undeclared one, whose data it does not
    know), and the warning says so."""
    from skpathkernel import PathRecorder, RecordedNetwork

    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(12, 2)), rng.normal(size=12)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)[:, None]
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 1)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)
    with PathRecorder(module, opt, n_samples=len(X), record_every=2) as rec:
        for step in range(6):
            opt.zero_grad()
            batch = np.arange(4 * (step % 3), 4 * (step % 3) + 4)
            if step == 3:  # a step of the momentum alone
                batch = np.arange(0)
            rec.set_batch(batch)
            residual = module(Xt[batch]) - yt[batch]
            (0.5 * residual.pow(2).sum() / max(len(batch), 1)).backward()
            opt.step()
    net = RecordedNetwork(module, rec.trajectory, X_train=X, y_train=y)
    with pytest.warns(UserWarning, match="cannot be replayed") as record:
        res = net.decompose(X[:2])
    assert res.replay_error is None
    said = [str(w.message) for w in record if "cannot be replayed" in str(w.message)]
    assert "1 of 6 steps declare none (first: step 3)" in said[0]


# Every solver of SOLVERS but Nesterov's on minibatches (the thinned path's steps are
# replayed: the every-step path's split, to round-off).
THINNED = ["sgd", "sgd-momentum-l2", "sgd-heavy-ball-l2", "adam-l2", "adamw", "rmsprop-l2"]


def _twice(X_train, y, name, normalize_y=False, **extra):
    """The same training recorded at every step and every third step."""
    params = dict(RAW, normalize_y=normalize_y, hidden_layer_sizes=(6,), max_iter=12,
                  batch_size=4, dtype="float64", random_state=0, **SOLVERS[name], **extra)
    every = PathKernelMachine(**params).fit(X_train, y)
    thinned = PathKernelMachine(**params, record_every=3).fit(X_train, y)
    traj = thinned.trajectory_
    assert traj.record_every == 3 and len(traj) - 1 < traj.n_steps
    return every, thinned


def _tiled(res, k):
    """``res``'s split of the queries, for the queries repeated ``k`` times."""
    return SimpleNamespace(**{name: np.concatenate([getattr(res, name)] * k)
                              for name in ("contributions", "regularization", "prediction")})


def _assert_same_split(res, ref, rel=1e-10):
    scale = np.abs(ref.contributions).max()
    assert_allclose(res.contributions, ref.contributions, rtol=0, atol=rel * scale)
    assert_allclose(res.regularization, ref.regularization, rtol=0,
                    atol=rel * max(scale, 1e-3))
    assert_allclose(res.prediction, ref.prediction, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("name", THINNED)
@pytest.mark.parametrize("normalize_y", [False, True])
def test_thinned_path_is_split_as_the_every_step_path(data, name, normalize_y, monkeypatch):
    """record_every=3: the steps between recorded points are replayed from the record
    (batches, step sizes, weight decay; the first moments from the initialization), so
    the thinned path's decomposition is the every-step path's, every method, to
    round-off, silently: its closure error is round-off and its replay mismatch too.
    The dense route takes the same steps. (The every-step path's split is checked
    against the brute-force recursion above.)"""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    every, thinned = _twice(X_train, y, name, normalize_y)
    results = {}
    for method in ("exact", "first_order"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            res = results[method] = thinned.decompose(X, method=method)
        _assert_same_split(res, every.decompose(X, method=method))
        assert res.replay_error < 1e-13
    assert res.error > 1e-4 * np.abs(res.prediction - res.initial).max()  # first_order
    # The exact split checked above (a second call would compute the same numbers).
    exact = results["exact"]
    assert exact.error <= 1e-12 * np.abs(exact.prediction).max()
    # Every optimizer step is a step of the split, with its own residual.
    assert exact.step_errors.shape == exact.n_nodes.shape == (thinned.trajectory_.n_steps,)
    monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = thinned.decompose(X, n_nodes=4)
    monkeypatch.undo()
    _assert_same_split(dense, thinned.decompose(X, n_nodes=4))


def test_thinned_path_equals_the_brute_force_of_the_every_step_training():
    """Adam recorded every 2 steps: every contribution is the brute-force split of the
    same training recorded at every step (the forward per-sample recursion), where the
    frozen-interval split missed a single point's by more than 1.5 times its closure
    error and their sums by more than 10 times. first_order on the thinned path is the
    every-step path's too (the formula's own error, not the thinning's)."""
    rng = np.random.default_rng(0)
    X_train = rng.normal(size=(48, 2))
    y = np.tanh(X_train[:, 0] - X_train[:, 1]) + 0.3 * rng.normal(size=48)
    X = X_train[:6]
    params = dict(RAW, solver="adam", learning_rate_init=0.01, hidden_layer_sizes=(16,),
                  max_iter=20, dtype="float64", random_state=0)
    every = PathKernelMachine(**params).fit(X_train, y)
    thinned = PathKernelMachine(**params, record_every=2).fit(X_train, y)
    truth, reg = forward_recursion(every, X_train, torch.as_tensor(y).reshape(-1, 1),
                                   _squared, X, nodes=gauss_nodes(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = thinned.decompose(X)
        first = thinned.decompose(X, method="first_order")
    scale = np.abs(np.asarray(truth)).max()
    assert_allclose(res.contributions, np.asarray(truth), rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, np.asarray(reg), rtol=0, atol=1e-10 * scale)
    _assert_same_split(first, every.decompose(X, method="first_order"))


@pytest.mark.parametrize("name", ["sgd-momentum-l2", "adam-l2"])
def test_thinned_path_whose_replay_misses_the_record_warns(data, name):
    """A recorded point moved off the training (here by hand): the interval before it,
    replayed, misses it by the measured mismatch, which the result reports and the
    warning quotes with the closure's miss."""
    X_train, y, X = data
    _, thinned = _twice(X_train, y, name)
    traj = thinned.trajectory_
    moved = traj.parameters(3) - traj.parameters(2)
    shift = 1e-3 * moved.norm() * torch.linspace(-1, 1, traj.n_params, dtype=traj.dtype)
    traj._params[3] += shift
    with pytest.warns(UserWarning, match="replayed from the record, miss") as record:
        res = thinned.decompose(X)
    # The interval into the moved point misses it by the shift (the one leaving it, by
    # about as much).
    expected = float(shift.norm() / (traj.parameters(3) - traj.parameters(2)).norm())
    assert expected * (1 - 1e-6) <= res.replay_error < 3 * expected
    said = [str(w.message) for w in record if "replayed from the record" in str(w.message)]
    assert len(said) == 1
    assert f"{res.replay_error:.2g} relative" in said[0]
    assert f"{res.error:.3g}" in said[0]
    assert res.error > 1e-8 * np.abs(res.prediction).max()  # the closure shows it too


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_thinned_path_on_disk_and_in_workers_is_split_as_the_every_step_path(data, name):
    """The replay reads a path stored on disk as one in memory, and the workers of
    n_jobs (query blocks; plain SGD's step ranges, cut at recorded points) each replay
    their share: the every-step path's split. attribute and explain read it too."""
    X_train, y, X = data
    every, disk = _twice(X_train, y, name, trajectory_storage="disk")
    assert disk.trajectory_.storage == "disk"
    ref = every.decompose(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same_split(disk.decompose(X), ref)
        # Each query's split is the every-step path's, ``ref`` three times over (the
        # every-step call on the three copies gives it to 1e-16: no second reference).
        _assert_same_split(disk.decompose(np.r_[X, X, X], n_jobs=2), _tiled(ref, 3))
        scores = disk.attribute(X)
    assert_allclose(scores, every.attribute(X), rtol=0,
                    atol=1e-10 * np.abs(scores).max())
    (index, values), (index_ref, values_ref) = (e.explain(X, n_neighbors=3)
                                                for e in (disk, every))
    assert_array_equal(index, index_ref)
    assert_allclose(values, values_ref, rtol=0, atol=1e-10 * np.abs(values_ref).max())


class _WithRaw(torch.nn.Module):
    """A raw parameter (no rule: the fallback's dense terms) next to two Linear layers."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, 6)
        self.scale = torch.nn.Parameter(torch.ones(6))
        self.out = torch.nn.Linear(6, n_out)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)) * self.scale)


@pytest.mark.parametrize("name", ["sgd", "sgd-momentum-l2", "sgd-heavy-ball-l2", "adam-l2",
                                  "adamw", "rmsprop-l2"])
@pytest.mark.parametrize("method", ["exact", "first_order"])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_routes_agree(data, name, method, batch_size, monkeypatch):
    """The factor-Gram route (plain SGD), the pair engine's adjoint and the dense route
    give the same decomposition (the dense one is checked above by brute force), on a
    module with a fallback layer too, at the same nodes."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    est = PathKernelMachine(**RAW, module=_WithRaw, max_iter=6, batch_size=batch_size,
                            dtype="float64", random_state=0, **SOLVERS[name])
    est.fit(X_train, y)
    default = "factor" if name == "sgd" else "adjoint"
    assert interpolation._route(est.trajectory_, method) == default
    routes = ["adjoint", "dense"] + (["factor"] if name == "sgd" else [])
    results = {}
    for route in routes:
        monkeypatch.setattr(interpolation, "_route", lambda traj, method, r=route: r)
        results[route] = est.decompose(X, method=method, n_nodes=4)
    ref = results.pop("dense")
    for res in results.values():
        assert_allclose(res.contributions, ref.contributions, rtol=1e-10, atol=1e-13)
        assert_allclose(res.regularization, ref.regularization, rtol=1e-10, atol=1e-13)
        assert res.error == pytest.approx(ref.error, abs=1e-12)
    if est.alpha:
        assert np.abs(ref.regularization).max() > 1e-4


@pytest.mark.parametrize("name", ["sgd", "adam-l2"])
@pytest.mark.parametrize("route", ["default", "dense"])
def test_weights_contract_the_fallback_and_first_order(data, name, route, monkeypatch):
    """A parameter without a rule (the fallback's contracted Jacobian) and the methods
    with one capture per step: the full decomposition contracted."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1]]
    est = PathKernelMachine(**RAW, module=_WithRaw, max_iter=3, batch_size=5,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, Y)
    if route == "dense":
        monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    W = np.random.RandomState(2).normal(size=(len(X), 2))
    methods = ["exact", "first_order"] + (["second_order"] if route == "dense" else [])
    for method in methods:
        n_nodes = 3 if method == "exact" else None
        _assert_contracts(_contracted(est, X, W, n_nodes, method),
                          est.decompose(X, method=method, n_nodes=n_nodes), W)


@pytest.mark.parametrize("nesterov", [False, True])
def test_long_momentum_run_keeps_the_adjoint_in_range(data, nesterov, monkeypatch):
    """The adjoint buffer stores lambda / m^k and folds the factor in when it would leave
    the dtype's range (every 20 steps at m = 0.5): 45 steps against the dense route."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(4,), solver="sgd", momentum=0.5,
                            nesterovs_momentum=nesterov,
                            learning_rate_init=0.05, max_iter=45, dtype="float64",
                            random_state=0).fit(X_train, y)
    adjoint = est.decompose(X, n_nodes=1)
    monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    dense = est.decompose(X, n_nodes=1)
    assert_allclose(adjoint.contributions, dense.contributions, rtol=1e-10,
                    atol=1e-13 * np.abs(dense.contributions).max())
    assert adjoint.error == pytest.approx(dense.error, rel=1e-6, abs=1e-14)


class _Attention(torch.nn.Module):
    """Token ids through an embedding, a LayerNorm and self-attention: every term of
    these rules carries a position axis (and the embedding's is transposed)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = torch.nn.Linear(4 * n_in, n_out)

    def forward(self, x):
        h = self.norm(self.embed(x))
        return self.out(torch.tanh(self.attn(h, h, h, need_weights=False)[0]).flatten(1))


def _cnn(n_in, n_out):
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Tanh(),
                               torch.nn.Conv2d(4, 4, 3, groups=2), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, n_out))


def _contracted(est, X, W, n_nodes=None, method="exact"):
    """The weights= route: the decomposition of ``w_q . y(x_q)``, one output, in the units
    of y: with normalize_y, ``w . y = w . mean + (w * scale) . f``."""
    mean, scale = est._y_mean, est._y_scale
    if scale is None:
        return est.network_.decompose(est._validate_X(X), method=method, n_nodes=n_nodes,
                                      weights=W)
    res = est.network_.decompose(est._validate_X(X), method=method, n_nodes=n_nodes,
                                 weights=W * np.ravel(scale))
    shift = (W @ np.ravel(mean))[:, None]
    res.initial, res.prediction = res.initial + shift, res.prediction + shift
    return res


def _assert_contracts(part, full, W, rel=1e-10):
    """``part`` is ``full`` with every term contracted with the queries' weights."""
    def contract(a):
        return np.einsum("qc,qc->q", a, W)[:, None]
    scale = np.abs(full.contributions).max() * np.abs(W).sum(1).max()
    assert part.contributions.shape == full.contributions.shape[:2] + (1,)
    assert_allclose(part.contributions[:, :, 0],
                    np.einsum("qnc,qc->qn", full.contributions, W), rtol=0, atol=rel * scale)
    assert_allclose(part.regularization, contract(full.regularization), rtol=0,
                    atol=rel * max(scale, 1e-3))
    assert_allclose(part.initial, contract(full.initial), rtol=1e-13, atol=1e-14)
    assert_allclose(part.prediction, contract(full.prediction), rtol=1e-13, atol=1e-14)


# Every solver on its route, a thinned path, normalize_y's units, and the dense route.
CONTRACTED = {**{name: (name, {}, False) for name in SOLVERS},
              "sgd-thinned": ("sgd", dict(max_iter=6, record_every=3), False),
              "adam-thinned": ("adam-l2", dict(max_iter=6, record_every=3), False),
              "adam-normalize_y": ("adam-l2", dict(normalize_y=True), False),
              "momentum-dense": ("sgd-momentum-l2", {}, True),
              "rmsprop-dense": ("rmsprop-l2", {}, True)}


@pytest.mark.parametrize("case", list(CONTRACTED))
def test_weights_decompose_the_contracted_output(data, case, monkeypatch):
    """decompose(weights=W) is the full decomposition contracted with W, every term, on
    every route and solver (the contracted captures against the full ones contracted
    after the split), and its own error control holds on the contracted output."""
    import warnings

    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    name, extra, dense = CONTRACTED[case]
    if dense:
        monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    Y = np.c_[y, 3 * X_train[:, 0] - 1, X_train[:, 1] ** 2]
    est = PathKernelMachine(**{**RAW, "hidden_layer_sizes": (5,), "max_iter": 3,
                               "batch_size": 5, "dtype": "float64", "random_state": 0,
                               **SOLVERS[name], **extra}).fit(X_train, Y)
    W = np.random.RandomState(1).normal(size=(len(X), 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a thinned path too: replayed, exact
        # The same nodes: the two agree to round-off.
        _assert_contracts(_contracted(est, X, W, n_nodes=3), est.decompose(X, n_nodes=3), W)
        # Error control on the contracted output: each its own nodes, both to tol.
        part, full = _contracted(est, X, W), est.decompose(X)
    _assert_contracts(part, full, W)
    assert part.tol == full.tol == 1e-12
    # A thinned path's unrecorded steps are replayed: each is a step of the split.
    assert part.step_errors.shape == (est.trajectory_.n_steps,)
    assert part.error <= 1e-10 * np.abs(part.prediction).max()
    assert part.step_errors.max() <= 1e-10 * np.abs(part.prediction).max()
    if extra.get("normalize_y"):  # in the units of y: the prediction is w . predict(X)
        assert_allclose(part.prediction[:, 0], np.einsum("qc,qc->q", est.predict(X), W),
                        rtol=1e-12)
    else:  # (normalize_y maps the weights first: the estimators pass the right shape)
        with pytest.raises(ValueError, match=r"weights must have shape \(3, 3\)"):
            _contracted(est, X, W[:, :2])


@pytest.mark.parametrize("solver", [dict(solver="sgd", learning_rate_init=0.1),
                                    dict(solver="adam", learning_rate_init=0.02, alpha=0.01)])
@pytest.mark.parametrize("kind", ["cnn", "tokens"])
def test_layers_with_positions_decompose_like_the_brute_force(kind, solver, monkeypatch):
    """Rules with a position axis (convolutions, grouped ones, an embedding, LayerNorm,
    attention) in the factor-Gram, adjoint and dense routes, against the forward
    per-sample recursion with plain autograd Jacobians, at the same nodes."""
    import skpathkernel._analysis._decomposition as interpolation
    from skpathkernel.rules import layer_routes

    rng = np.random.RandomState(0)
    if kind == "cnn":
        module, X_train = _cnn, rng.uniform(-1, 1, size=(10, 1, 5, 5))
    else:
        module, X_train = _Attention, rng.randint(0, 5, size=(10, 3))
    y = rng.uniform(-1, 1, size=10)
    est = PathKernelMachine(**RAW, module=module, max_iter=3, batch_size=4,
                            dtype="float64", random_state=0, **solver).fit(X_train, y)
    routes = layer_routes(est.module_, X_train[:2])
    assert routes and all(r.route == "rule" for r in routes)
    Xq = X_train[:3]
    res = est.decompose(Xq, n_nodes=3)
    contrib, reg = forward_recursion(est, X_train, torch.as_tensor(y).reshape(-1, 1),
                                     _squared, Xq, nodes=gauss_nodes(3))
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))
    # Error control on the same path: floating-point precision.
    exact = est.decompose(Xq)
    assert exact.error <= 1e-10 * np.abs(exact.prediction).max()
    monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    dense = est.decompose(Xq, n_nodes=3)
    assert_allclose(dense.contributions, contrib, rtol=0, atol=1e-10 * scale)


@pytest.mark.parametrize("solver", [dict(solver="sgd", learning_rate_init=0.1),
                                    dict(solver="adam", learning_rate_init=0.02, alpha=0.01)])
@pytest.mark.parametrize("kind", ["cnn", "tokens"])
def test_weights_contract_layers_with_positions(kind, solver, monkeypatch):
    """The contracted captures of convolutions and of a token model (integer inputs,
    module=) on the factor / adjoint and dense routes: the full decomposition contracted."""
    import skpathkernel._analysis._decomposition as interpolation

    rng = np.random.RandomState(0)
    if kind == "cnn":
        module, X_train = _cnn, rng.uniform(-1, 1, size=(10, 1, 5, 5))
    else:
        module, X_train = _Attention, rng.randint(0, 5, size=(10, 3))
    est = PathKernelMachine(**RAW, module=module, max_iter=3, batch_size=4, dtype="float64",
                            random_state=0, **solver).fit(X_train, rng.uniform(-1, 1, (10, 3)))
    Xq, W = X_train[:3], rng.normal(size=(3, 3))
    _assert_contracts(_contracted(est, Xq, W, n_nodes=3), est.decompose(Xq, n_nodes=3), W)
    part = _contracted(est, Xq, W)
    assert part.error <= 1e-10 * np.abs(part.prediction).max()
    monkeypatch.setattr(interpolation, "_route", lambda traj, method: "dense")
    _assert_contracts(_contracted(est, Xq, W, n_nodes=3), est.decompose(Xq, n_nodes=3), W)


@pytest.mark.parametrize("name", ["sgd-momentum-l2", "adam-l2", "rmsprop-l2"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("formed", [True, False])
def test_adjoint_contraction_forms_equal_brute_force(data, name, dtype, formed, monkeypatch):
    """The adjoint's contraction with the batch through the batch's formed per-sample
    gradients and through its factors, each forced on every layer, with three outputs
    and their contraction with query weights, against the forward per-sample recursion
    (float64 over the recorded parameters)."""
    import skpathkernel._tangent._pairs as pairs

    calls = []

    def forced(rows, q):
        calls.append((rows, q))
        return formed

    monkeypatch.setattr(pairs, "formed_contraction", forced)
    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1], X_train[:, 0] ** 2]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6, 5), max_iter=3, batch_size=5,
                            dtype=dtype, random_state=0, **SOLVERS[name]).fit(X_train, Y)
    res = est.decompose(X, n_nodes=6)
    assert calls  # the forced choice was taken
    contrib, reg = _brute_force(est, X_train, torch.as_tensor(Y), _squared, X)
    scale = np.abs(contrib).max()
    rel = 1e-10 if dtype == "float64" else 2e-5
    assert_allclose(res.contributions, contrib, rtol=0, atol=rel * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=rel * max(scale, 1e-3))
    W = np.random.RandomState(3).normal(size=(len(X), 3))
    part = _contracted(est, X, W, n_nodes=6)
    _assert_contracts(part, res, W, rel=rel)


@pytest.mark.parametrize("name", ["sgd", "adam-l2"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_stacked_captures_equal_the_capture_engine(data, name, dtype, monkeypatch):
    """A plain MLP's captures by one batched pass over a step's nodes (and the batch's
    without hooks) give the capture engine's decomposition, of every output and
    contracted, and float64 the forward per-sample recursion's."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1]]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6, 5), max_iter=3, batch_size=5,
                            dtype=dtype, random_state=0, **SOLVERS[name]).fit(X_train, Y)
    W = np.random.RandomState(4).normal(size=(len(X), 2))
    used = []
    stacked_capture = interpolation._StackedCapture.capture

    def spy(self, thetas, *args):
        used.append(len(thetas))
        return stacked_capture(self, thetas, *args)

    monkeypatch.setattr(interpolation._StackedCapture, "capture", spy)
    stacked, stacked_w = est.decompose(X, n_nodes=4), _contracted(est, X, W, n_nodes=4)
    # Every step's four nodes and the per-contribution check's five in one pass (the
    # steps' captures made ahead, one block).
    assert (4 + 5) * (len(est.trajectory_) - 1) in used
    monkeypatch.setattr(interpolation._StackedCapture, "matches", lambda *args: False)
    used.clear()
    general, general_w = est.decompose(X, n_nodes=4), _contracted(est, X, W, n_nodes=4)
    assert not used
    rel = 1e-12 if dtype == "float64" else 1e-5
    for a, b in ((stacked, general), (stacked_w, general_w)):
        scale = np.abs(b.contributions).max()
        assert_allclose(a.contributions, b.contributions, rtol=0, atol=rel * scale)
        assert_allclose(a.regularization, b.regularization, rtol=0,
                        atol=rel * max(scale, 1e-3))
        assert a.error == pytest.approx(b.error, rel=1e-3, abs=rel * scale)
    if dtype == "float64":
        contrib, reg = _brute_force(est, X_train, torch.as_tensor(Y), _squared, X, n_nodes=4)
        scale = np.abs(contrib).max()
        assert_allclose(stacked.contributions, contrib, rtol=0, atol=1e-10 * scale)
        assert_allclose(stacked.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))


@pytest.mark.parametrize("name", ["sgd", "adam-l2"])
@pytest.mark.parametrize("first", [torch.nn.Tanh, torch.nn.Identity])
def test_stacked_captures_with_an_activation_before_the_first_linear(data, name, first,
                                                                     monkeypatch):
    """An nn.Sequential that starts with an elementwise layer (its derivative has the
    inputs' width) takes the stacked captures and gives the forward per-sample
    recursion's decomposition (the backward went past the first Linear and failed on
    the widths: RuntimeError)."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1]]

    def net(n_in, n_out):
        return torch.nn.Sequential(first(), torch.nn.Linear(n_in, 6), torch.nn.Tanh(),
                                   torch.nn.Linear(6, n_out))

    est = PathKernelMachine(**RAW, module=net, max_iter=3, batch_size=5, dtype="float64",
                            random_state=0, **SOLVERS[name]).fit(X_train, Y)
    used = []
    backward = interpolation._StackedCapture.backward
    monkeypatch.setattr(interpolation._StackedCapture, "backward",
                        lambda self, *args: used.append(1) or backward(self, *args))
    res = est.decompose(X, n_nodes=4)
    assert len(used) > 2  # beyond the check's captures: the stacked route was taken
    contrib, reg = _brute_force(est, X_train, torch.as_tensor(Y), _squared, X, n_nodes=4)
    scale = np.abs(contrib).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))


def test_stacked_captures_that_disagree_are_not_used(data, monkeypatch):
    """A stacked pass that does not reproduce the capture engine's factors (here a wrong
    activation derivative) is refused: the general captures give the exact result."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6,), max_iter=3, batch_size=5,
                            dtype="float64", random_state=0, **SOLVERS["adam-l2"])
    est.fit(X_train, y)
    from skpathkernel._tangent import _stacked

    derivative = _stacked._derivative

    def wrong(act, z):
        h, d = derivative(act, z)
        return h, 1.01 * d

    # The stacked forward's derivative (shared with the Gram blocks, unused here).
    monkeypatch.setattr(_stacked, "_derivative", wrong)
    used = []
    monkeypatch.setattr(interpolation._StackedCapture, "backward",
                        lambda self, *args, _b=interpolation._StackedCapture.backward:
                        used.append(1) or _b(self, *args))
    res = est.decompose(X, n_nodes=6)
    assert 1 <= len(used) <= 2  # the check's captures only
    contrib, reg = _brute_force(est, X_train, torch.as_tensor(y).reshape(-1, 1), _squared, X)
    assert_allclose(res.contributions, contrib, rtol=0,
                    atol=1e-10 * np.abs(contrib).max())


@pytest.mark.parametrize("name", ["sgd-momentum-l2", "adam-l2"])
@pytest.mark.parametrize("formed", [True, False])
def test_chunks_with_different_nodes_share_the_adjoint(data, name, formed, monkeypatch):
    """The chunks of a query block share one adjoint buffer, each chunk's rows updated
    from its own quadrature nodes: three chunks at 1, 2 and 3 nodes per step, every
    output, against the forward per-sample recursion of each chunk at its own nodes
    (a chunk updated from another's nodes misses by the quadrature's error)."""
    import skpathkernel._analysis._decomposition as interpolation
    import skpathkernel._network._trained as trained
    import skpathkernel._tangent._pairs as pairs

    monkeypatch.setattr(pairs, "formed_contraction", lambda rows, q: formed)
    monkeypatch.setattr(trained, "node_chunk", lambda *args: 2)
    counts = iter([1, 2, 3])
    init = interpolation._Quadrature.__init__

    def per_chunk(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fixed = next(counts)

    monkeypatch.setattr(interpolation._Quadrature, "__init__", per_chunk)
    # One walk at the forced counts: the per-contribution check would walk the path
    # again with more nodes (a 1-node chunk's contributions miss tol).
    monkeypatch.setattr(interpolation, "_contribution_check",
                        lambda walk, first, *args, **kwargs: (*first[:3], None))
    X_train, y, _ = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1], X_train[:, 0] ** 2]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6, 5), max_iter=3, batch_size=5,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, Y)
    Xq = np.random.RandomState(5).uniform(-1, 1, size=(6, 2))
    res = est.decompose(Xq)  # adaptive: chunks of node_chunk's 2 queries
    assert next(counts, None) is None  # three chunks, one block
    for k in range(3):
        rows = slice(2 * k, 2 * k + 2)
        contrib, reg = forward_recursion(est, X_train, torch.as_tensor(Y), _squared,
                                         Xq[rows], nodes=gauss_nodes(k + 1))
        scale = np.abs(contrib).max()
        assert_allclose(res.contributions[rows], contrib, rtol=0, atol=1e-10 * scale)
        assert_allclose(res.regularization[rows], reg, rtol=0, atol=1e-10 * max(scale, 1e-3))


@pytest.mark.parametrize("name", ["sgd", "adam-l2"])
@pytest.mark.parametrize("batch_size", [4, 5])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_blocks_of_steps_give_the_step_by_step_numbers(data, name, batch_size, dtype,
                                                       monkeypatch):
    """Blocks of 1, 2 and 3 recorded steps captured in one stacked pass (the batches,
    and the queries' nodes made ahead) give the step-by-step decomposition, bit for bit
    in float64 (to float32 rounding in float32: measured 6e-9 relative on plain SGD's
    batches, where a batched GEMM may take another kernel), and the forward per-sample
    recursion's. Batches of 4 of the 16 samples: the blocks of 3 steps cross the epochs'
    boundaries; of 5: the epochs' last batch (1 sample) cuts the blocks of equal
    batches. Adaptive nodes too (blocks made ahead at a count that a step then does not
    try) and a memory budget that leaves one step per pass."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1]]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6, 5), max_iter=3,
                            batch_size=batch_size, dtype=dtype, random_state=0,
                            **SOLVERS[name]).fit(X_train, Y)
    T = len(est.trajectory_) - 1
    sizes = [len(b) for b in est.trajectory_.batches]
    passes = {"batch": [], "nodes": []}
    forward = interpolation._StackedCapture.forward

    def spy(self, thetas, X_rows):
        # Own rows per point: a block of batches; shared rows: the queries' nodes. A
        # float32 path's float64 pass over a block's batches measures the residuals'
        # round-off (_Context._residuals64), no capture.
        if thetas.dtype != getattr(torch, dtype):
            pass
        elif X_rows.dim() == 3:
            passes["batch"].append(len(thetas))
        elif len(X_rows) == len(X):
            passes["nodes"].append(len(thetas))
        return forward(self, thetas, X_rows)

    monkeypatch.setattr(interpolation._StackedCapture, "forward", spy)
    results = {}
    for block in (1, 2, 3):
        monkeypatch.setattr(interpolation, "STEP_BLOCK", block)
        for key in passes:
            passes[key].clear()
        results[block] = est.decompose(X, n_nodes=4), est.decompose(X)
        # The walk's blocks, last step first, cut where the batch size changes.
        expected, run = [], []
        for t in reversed(range(T)):
            if run and (len(run) == block or sizes[run[-1]] != sizes[t]):
                expected.append(len(run))
                run = []
            run.append(t)
        expected.append(len(run))
        # Where a pass holds two steps, a block of one runs as a pass of two (torch's
        # batched GEMM of one matrix is another kernel: _StackedCapture.batched).
        assert passes["batch"] == [max(k, 2) if block > 1 else k for k in expected] * 2
        if block == 3 and batch_size == 4:  # steps 8 to 6 and 4 to 2: two epochs each
            assert expected == [3, 3, 3, 3]
        # The fixed count's nodes: 4 per step and the per-contribution check's 5, blocks
        # of `block` steps.
        assert passes["nodes"][: -(-T // block)] == [9 * len(range(t, max(-1, t - block), -1))
                                                      for t in range(T - 1, -1, -block)]
    fixed_1, adaptive_1 = results[1]
    # Blocks of 2 and 3 steps (and their blocks of one, passed as two): the same
    # numbers, bit for bit in float32 too.
    for a, b in zip(results[2], results[3]):
        assert_array_equal(a.contributions, b.contributions)
        assert_array_equal(a.regularization, b.regularization)
    for block in (2, 3):
        fixed, adaptive = results[block]
        for a, b in ((fixed, fixed_1), (adaptive, adaptive_1)):
            if dtype == "float64":
                assert_array_equal(a.contributions, b.contributions)
                assert_array_equal(a.regularization, b.regularization)
            else:  # a float32 batched GEMM may round as another kernel (6e-9 measured)
                scale = np.abs(b.contributions).max()
                assert_allclose(a.contributions, b.contributions, rtol=0, atol=1e-6 * scale)
                assert_allclose(a.regularization, b.regularization, rtol=0,
                                atol=1e-6 * max(scale, 1e-3))
        assert_array_equal(adaptive.n_nodes, adaptive_1.n_nodes)
    contrib, reg = _brute_force(est, X_train, torch.as_tensor(Y), _squared, X, n_nodes=4)
    scale = np.abs(contrib).max()
    rel = 1e-10 if dtype == "float64" else 2e-5
    for fixed, _ in results.values():
        assert_allclose(fixed.contributions, contrib, rtol=0, atol=rel * scale)
        assert_allclose(fixed.regularization, reg, rtol=0, atol=rel * max(scale, 1e-3))
    # A budget whose eighth holds less than two steps' batches: one step per pass (32 KiB:
    # beside a step's parameter points and the per-contribution check's rows, 24 KiB held
    # no batch of 4 rows).
    monkeypatch.setattr(interpolation, "STEP_BLOCK", 3)
    passes["batch"].clear()
    small = est.set_params(memory_budget=2**15).decompose(X, n_nodes=4)
    est.set_params(memory_budget=2**30)
    assert passes["batch"] and set(passes["batch"]) == {1}
    # The tiny budget also cuts the adjoint's and the shares' buffers (their sums in
    # another order): equal to the dtype's rounding, not bit for bit.
    assert_allclose(small.contributions, fixed_1.contributions, rtol=0,
                    atol=(1e-13 if dtype == "float64" else 1e-6)
                    * np.abs(fixed_1.contributions).max())


@pytest.mark.parametrize("name", ["sgd", "adam-l2", "adamw"])
@pytest.mark.parametrize("weighting", ["realized", "expected"])
def test_first_order_blocks_of_steps(data, name, weighting, monkeypatch):
    """``method="first_order"`` captures the queries at ``theta_t`` for blocks of 1, 2
    and 3 steps in one stacked pass: the forward per-sample recursion's numbers with the
    Jacobian at each step's start (the node ``s = 0`` of weight 1), in float64, and the
    same numbers whatever the block. Plain SGD's L2 decay and AdamW's decoupled one
    enter as the products of the step's capture with the decay direction."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    Y = np.c_[y, X_train[:, 0] * X_train[:, 1]]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6, 5), max_iter=3, batch_size=4,
                            dtype="float64", random_state=0,
                            **SOLVERS[name]).fit(X_train, Y)
    nodes_passes = []
    forward = interpolation._StackedCapture.forward

    def spy(self, thetas, X_rows):
        if X_rows.dim() == 2 and len(X_rows) == len(X):
            nodes_passes.append(len(thetas))
        return forward(self, thetas, X_rows)

    monkeypatch.setattr(interpolation._StackedCapture, "forward", spy)
    results = {}
    for block in (1, 2, 3):
        monkeypatch.setattr(interpolation, "STEP_BLOCK", block)
        nodes_passes.clear()
        results[block] = est.decompose(X, method="first_order", weighting=weighting)
        # One point per step (theta_t), in passes of up to `block` steps.
        assert max(nodes_passes) == block
    if weighting == "realized":
        contrib, reg = forward_recursion(est, X_train, torch.as_tensor(Y), _squared, X,
                                         nodes=(np.array([0.0]), np.array([1.0])))
        scale = np.abs(contrib).max()
        assert_allclose(results[3].contributions, contrib, rtol=0, atol=1e-12 * scale)
        assert_allclose(results[3].regularization, reg, rtol=0,
                        atol=1e-12 * max(scale, 1e-3))
    for block in (1, 2):
        scale = np.abs(results[3].contributions).max()
        assert_allclose(results[block].contributions, results[3].contributions, rtol=0,
                        atol=1e-13 * scale)


def _adam_path(n_train, n_queries, batch_size=8, dtype="float32", lr=0.01,
               memory_budget=2**30):
    rng = np.random.RandomState(0)
    X_train = rng.uniform(-1, 1, size=(n_train, 2))
    y = np.sin(3 * X_train[:, 0]) + X_train[:, 1]
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(16, 16), max_iter=4,
                            batch_size=batch_size, dtype=dtype, random_state=0,
                            solver="adam", learning_rate_init=lr, memory_budget=memory_budget)
    return est.fit(X_train, y), rng.uniform(-1, 1, size=(n_queries, 2))


def _storage_bytes(captures) -> int:
    """Bytes of the distinct storages under nested lists of captures' terms."""
    seen, todo = {}, [captures]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif x is not None:  # a term (an input without factor is None)
            todo.append(x.delta)
            todo.extend(a for _, a in x.inputs)
    return sum(seen.values())


@pytest.mark.parametrize("engine", ["stacked", "general"])
def test_captures_made_ahead_are_the_ones_used(engine, monkeypatch):
    """The queries' captures at the nodes of a block of steps are made at the count the
    steps then try: the capture engine's (no set-up to share) one step at a time, every
    one used; the stacked ones for a block of steps at the count a chunk's step before
    ended with (a fixed count: every step's), the lowered and raised tries one step
    alone. Counted against the step-by-step call, whose captures are exactly those the
    walk reads, with the same numbers."""
    import skpathkernel._analysis._decomposition as interpolation

    est, X = _adam_path(32, 24)
    T = len(est.trajectory_) - 1
    # The queries' rows: a chunk of 4 (adaptive nodes), or all 24; a batch has 8.
    queries = (interpolation.node_chunk(est.trajectory_, "exact", len(X)), len(X))
    made = {"points": 0, "passes": 0}
    if engine == "general":
        monkeypatch.setattr(interpolation._StackedCapture, "matches", lambda *args: False)
        general = interpolation._Context.general_capture

        def spy(self, flat, X_rows, weights=None):
            made["points"] += len(X_rows) in queries
            return general(self, flat, X_rows, weights)

        monkeypatch.setattr(interpolation._Context, "general_capture", spy)
    else:
        stacked = interpolation._StackedCapture.capture

        def spy(self, thetas, X_rows, *args):
            if len(X_rows) in queries:
                made["points"] += len(thetas)
                made["passes"] += 1
            return stacked(self, thetas, X_rows, *args)

        monkeypatch.setattr(interpolation._StackedCapture, "capture", spy)
    for n_nodes in (None, 3):
        results, counts = {}, {}
        for block in (1, 16):
            monkeypatch.setattr(interpolation, "STEP_BLOCK", block)
            made.update(points=0, passes=0)
            results[block] = est.decompose(X, n_nodes=n_nodes)
            counts[block] = dict(made)
        assert_array_equal(results[16].contributions, results[1].contributions)
        assert_array_equal(results[16].n_nodes, results[1].n_nodes)
        used = counts[1]["points"]
        assert used >= T * (6 if n_nodes is None else 3)  # six chunks, or 3 nodes
        if engine == "general" or n_nodes is not None:
            assert counts[16]["points"] == used
        else:  # a lowered try's count, then the step's own: at most a few blocks unused
            assert counts[16]["points"] <= 1.25 * used
        if engine == "stacked" and n_nodes is not None:  # the 16 steps in one pass
            assert counts[16]["passes"] == 1


def test_captures_held_ahead_stay_within_the_budget(monkeypatch):
    """What the chunks of queries hold for their next steps (the captures of blocks of
    steps made ahead) stays within an eighth of the memory budget, with four chunks
    whose counts change: the distinct storages held, after every capture. Blocks of
    several steps are still made (a float64 path whose counts settle), and the numbers
    are the step-by-step ones."""
    import skpathkernel._analysis._decomposition as interpolation

    # (2**24 made no block ahead once the captures held the check's nodes too.)
    budget = 2**25
    est, X = _adam_path(64, 128, batch_size=16, dtype="float64", lr=0.001,
                        memory_budget=budget)
    held = []
    nodes = interpolation._NodesAhead.nodes

    def spy(self, *args):
        out = nodes(self, *args)
        held.append(_storage_bytes([capture for capture, _ in self._made.values()]))
        return out

    monkeypatch.setattr(interpolation._NodesAhead, "nodes", spy)
    res = est.decompose(X)
    assert 0 < max(held) <= budget // 8
    monkeypatch.setattr(interpolation, "STEP_BLOCK", 1)
    assert_array_equal(res.contributions, est.decompose(X).contributions)


@pytest.mark.parametrize("room", [None, 26000])
def test_kept_batches_are_charged_once_per_storage(room, monkeypatch):
    """Query blocks that keep the batches' captures for the next block: the steps of one
    stacked pass share its storage, charged once (all 16 steps fit the room the query
    blocks leave), and a later block captures each step not kept once, none left over: with
    a smaller room (26 kB; a float32 path keeps its residuals' round-off too) too, where
    steps kept lie between steps that are not (the
    12-sample batches fit after a block of 16-sample ones did not). The numbers are
    those of one query block."""
    import skpathkernel._analysis._decomposition as interpolation

    est, X = _adam_path(60, 128, batch_size=16)  # batches of 16, 16, 16 and 12
    reference = est.decompose(X)
    T = len(est.trajectory_) - 1
    # With the per-contribution check's rows: 2**19 + 2**17 before them; with the blocks
    # of steps made ahead charged the float64 pass of their residuals' round-off, 2**20
    # before (it held one step a block: no storage shared by several steps).
    budget = 1_500_000
    path_dtype = est.trajectory_.parameters(0).dtype
    contexts, blocks, captured = [], [], []
    init, factored = interpolation._Context.__init__, interpolation._factored_block
    forward = interpolation._StackedCapture.forward

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        contexts.append(self)
        if room is not None:
            self._kept_room = room
        self.initial_room = self._kept_room  # a quarter of what the query blocks leave

    def spy_block(*args, **kwargs):
        blocks.append(1)
        return factored(*args, **kwargs)

    def spy_forward(self, thetas, X_rows):
        # Own rows per point: a pass over steps' batches (not the float64 pass that
        # measures a float32 path's residuals' round-off: _Context._residuals64).
        if X_rows.dim() == 3 and thetas.dtype == path_dtype:
            # (a step alone runs as two, the point repeated: a view of stride 0)
            captured.append(len(thetas) if thetas.stride(0) else 1)
        return forward(self, thetas, X_rows)

    monkeypatch.setattr(interpolation._Context, "__init__", spy_init)
    monkeypatch.setattr(interpolation, "_factored_block", spy_block)
    monkeypatch.setattr(interpolation._StackedCapture, "forward", spy_forward)
    res = est.set_params(memory_budget=budget).decompose(X)
    ctx = contexts[-1]
    assert ctx.keep_batches and len(blocks) > 1
    kept = list(ctx._kept.values())
    assert ctx.initial_room - ctx._kept_room == _storage_bytes(kept)
    if room is None:
        assert len(kept) == T
    else:  # kept steps between steps not kept (the walk goes from step T - 1 down)
        assert min(ctx._kept) < T - len(kept)
        assert max(captured) > 1
    assert not ctx._ahead
    assert sum(captured) == T + (T - len(kept)) * (len(blocks) - 1)
    assert_array_equal(res.contributions, reference.contributions)


@pytest.mark.parametrize("kind", ["regressor", "classifier"])
def test_second_order_stays_within_the_budget(kind, monkeypatch):
    """decompose / attribute(method="second_order") hold through the walk a query
    block's buffers (lambda and rho, Q x C x P), a batch's per-sample loss gradients
    (B x P), and form the Hessian-vector products of the queries (torch.func held about
    3.6 times their (q, C, P) result at once, peak RSS on the default MLPs): together
    within the memory budget. The query blocks and the products' blocks that a small
    budget cuts give the numbers of one block."""
    import skpathkernel._analysis._decomposition as interpolation

    rng = np.random.RandomState(0)
    X_train = rng.uniform(-1, 1, size=(40, 2))
    Xq = rng.uniform(-1, 1, size=(24, 2))
    if kind == "regressor":
        Y = np.c_[np.sin(3 * X_train[:, 0]), X_train[:, 1]]
        est = PathKernelMachine(**RAW, hidden_layer_sizes=(16, 16), max_iter=3,
                                dtype="float64", random_state=0).fit(X_train, Y)
    else:
        y = (X_train[:, 0] > 0).astype(int) + (X_train[:, 1] > 0)
        est = PathKernelClassifier(hidden_layer_sizes=(16, 16), max_iter=3,
                                   dtype="float64", random_state=0).fit(X_train, y)

    def run():
        if kind == "regressor":
            return est.decompose(Xq, method="second_order").contributions
        return est.attribute(Xq, method="second_order")

    reference = run()
    P, C, itemsize = est.n_params_, est.n_outputs_, 8
    budget = 64 * P * itemsize
    held, products = [], []
    dense_block, vmap = interpolation._dense_block, interpolation.vmap

    def spy_block(ctx, Xq, *args, **kwargs):
        n_res = 1 if ctx.weights is not None else C
        held.append((2 * Xq.shape[0] * n_res + min(ctx.b_block, len(ctx.X_train))) * P
                    * itemsize)
        return dense_block(ctx, Xq, *args, **kwargs)

    def spy_vmap(fn):
        def call(x):
            out = vmap(fn)(x)
            products.append(sum(t.nbytes for t in out.values()))
            return out
        return call

    monkeypatch.setattr(interpolation, "_dense_block", spy_block)
    monkeypatch.setattr(interpolation, "vmap", spy_vmap)
    est.set_params(memory_budget=budget)
    small = run()
    assert len(held) > 1 and len(products) > len(held)  # both cut in blocks
    assert max(held) + 4 * max(products) <= budget
    assert_allclose(small, reference, rtol=0, atol=1e-12 * np.abs(reference).max())


def test_second_order_primals_are_not_views_of_the_path(monkeypatch):
    """Forward-mode AD gives a view's tangent the size of its base, and a recorded point
    is a view of the whole stored path: the Hessian-vector products' primals have their
    own storage, or every product fills a tangent of the path's size per parameter (the
    peak grew with the number of recorded points: 101 MiB a call at 211 points of an
    18k-parameter MLP, 14 MiB with copies)."""
    import skpathkernel._analysis._decomposition as interpolation

    rng = np.random.RandomState(0)
    X_train = rng.uniform(-1, 1, size=(24, 2))
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(8,), max_iter=4, batch_size=6,
                            dtype="float64", random_state=0).fit(X_train, X_train[:, 0])
    path_bytes = est.trajectory_.parameters(0).untyped_storage().nbytes()
    assert path_bytes >= 10 * est.n_params_ * 8  # the points share one storage
    seen = []
    jvp = interpolation.jvp

    def spy(fn, primals, tangents):
        seen.extend((p.untyped_storage().nbytes(), p.numel() * p.element_size())
                    for p in primals[0].values())
        return jvp(fn, primals, tangents)

    monkeypatch.setattr(interpolation, "jvp", spy)
    est.decompose(X_train[:3], method="second_order")
    assert seen and all(storage == own for storage, own in seen)


@pytest.mark.parametrize("every", [3, 20])
def test_thinned_path_holds_its_replayed_intervals_briefly(data, every, monkeypatch):
    """The replay holds a few intervals: intervals longer than the blocks of steps
    captured ahead one at a time (those blocks stop at the interval's first step),
    shorter ones as many as a block spans and one more. Each interval is replayed once
    for the reference outputs (first first) and once for the walk back, and the split
    is the every-step path's."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    params = dict(RAW, hidden_layer_sizes=(6,), max_iter=15, batch_size=2, dtype="float64",
                  random_state=0, **SOLVERS["adam-l2"])
    full = PathKernelMachine(**params).fit(X_train, y)
    thinned = PathKernelMachine(**params, record_every=every).fit(X_train, y)
    n_steps = thinned.trajectory_.n_steps  # 120
    calls, held = [], []
    interval = interpolation.EveryStep._interval

    def counting(self, j):
        if j not in self._kept:
            calls.append(j)
        out = interval(self, j)
        held.append(len(self._kept))
        return out

    monkeypatch.setattr(interpolation.EveryStep, "_interval", counting)
    res = thinned.decompose(X)
    _assert_same_split(res, full.decompose(X))
    n_intervals = len(thinned.trajectory_) - 1
    limit = 1 if every > interpolation.STEP_BLOCK else -(-interpolation.STEP_BLOCK // every) + 1
    assert max(held) == limit
    # The reference outputs' pass and the walk's (and the middle point's, for the
    # engine's check of hidden reads, before them).
    assert len(calls) <= 2 * n_intervals + 1 and n_steps == 120


@pytest.mark.parametrize("every", [3, 20])
def test_thinned_path_frees_an_interval_before_replaying_the_next(data, every, monkeypatch):
    """An interval is replayed once the intervals it displaces are let go, not next to
    them: intervals longer than the blocks made ahead are held alone while one is
    replayed (2 k vectors at most, not 4 k), shorter ones one fewer than the most held.
    Counted when the replay runs, against the every-step path's split."""
    import skpathkernel._analysis._decomposition as interpolation
    import skpathkernel._analysis._unrolled as unrolled

    X_train, y, X = data
    params = dict(RAW, hidden_layer_sizes=(6,), max_iter=15, batch_size=2, dtype="float64",
                  random_state=0, **SOLVERS["adam-l2"])
    full = PathKernelMachine(**params).fit(X_train, y)
    thinned = PathKernelMachine(**params, record_every=every).fit(X_train, y)
    paths, held = [], []
    init, interval = interpolation.EveryStep.__init__, unrolled.Replay.interval

    def tracked_init(self, replay, *args):
        paths.append(self)
        init(self, replay, *args)

    def counting(self, j, *args, **kwargs):
        held.extend(len(p._kept) for p in paths if p.replay is self)
        return interval(self, j, *args, **kwargs)

    monkeypatch.setattr(interpolation.EveryStep, "__init__", tracked_init)
    monkeypatch.setattr(unrolled.Replay, "interval", counting)
    _assert_same_split(thinned.decompose(X), full.decompose(X))
    limit = 1 if every > interpolation.STEP_BLOCK else -(-interpolation.STEP_BLOCK // every) + 1
    assert held and max(held) == limit - 1


def test_thinned_path_replay_is_freed_when_the_call_returns(data, monkeypatch):
    # The replayed path's vectors go with the call, not at the garbage collector's next
    # pass: nothing of it is left once decompose returns, with the collector off.
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    params = dict(RAW, hidden_layer_sizes=(8,), max_iter=4, batch_size=4, solver="adam",
                  dtype="float64", random_state=0)
    est = PathKernelMachine(**params, record_every=4).fit(X_train, y)
    paths = []
    init = interpolation.EveryStep.__init__

    def tracked_init(self, *args):
        paths.append(weakref.ref(self))
        init(self, *args)

    monkeypatch.setattr(interpolation.EveryStep, "__init__", tracked_init)
    gc.collect()
    gc.disable()
    try:
        res = est.decompose(X)
        assert len(paths) == 1 and paths[0]() is None
    finally:
        gc.enable()
    _assert_same_split(res, PathKernelMachine(**params).fit(X_train, y).decompose(X))


def test_thinned_path_replay_is_checkpointed_within_memory_budget(data, monkeypatch):
    """Intervals of k = 64 steps whose 2 k replayed vectors exceed a quarter of
    memory_budget keep checkpoints and replay one piece at a time: the vectors held (read
    from the replay's containers after every read of a point or state) stay within
    ``per_mark * ceil(k / every) + 2 * 2 * every <= budget / 4``, where the unbounded
    replay holds about 2 k; the split is the unbounded replay's to the last bit and the
    every-step path's to 1e-10."""
    import skpathkernel._analysis._decomposition as interpolation

    X_train, y, X = data
    params = dict(RAW, hidden_layer_sizes=(40,), max_iter=16, batch_size=2, dtype="float64",
                  random_state=0, **SOLVERS["adam-l2"])
    full = PathKernelMachine(**params).fit(X_train, y)
    k = 64
    thinned = PathKernelMachine(**params, record_every=k).fit(X_train, y)
    P = thinned.trajectory_.n_params
    room = 60  # vectors: the least checkpointing of Adam (3 per mark) needs 56
    budget = 4 * room * P * 8
    thinned.memory_budget = budget
    paths, held = [], []
    init = interpolation.EveryStep.__init__

    def tracked_init(self, replay, *args):
        paths.append(self)
        init(self, replay, *args)

    def counted(read):
        def counting(self, t):
            out = read(self, t)
            held.append(held_vectors(self, P))
            return out
        return counting

    monkeypatch.setattr(interpolation.EveryStep, "__init__", tracked_init)
    for name in ("_params_at", "_state_at"):
        monkeypatch.setattr(interpolation.EveryStep, name,
                            counted(getattr(interpolation.EveryStep, name)))
    with monkeypatch.context() as m:  # the replay not bounded by the budget
        m.setattr(interpolation, "REPLAY_SHARE", 1e-300)
        unbounded = thinned.decompose(X)
    assert max(held) >= 2 * k - 1 and paths[-1]._every is None
    held.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = thinned.decompose(X)
    assert not [w for w in record if "more than memory_budget" in str(w.message)]
    every = paths[-1]._every
    assert every is not None and 3 * -(-k // every) + 4 * every <= room
    assert 0 < max(held) <= 3 * -(-k // every) + 4 * every <= room
    np.testing.assert_array_equal(res.contributions, unbounded.contributions)
    np.testing.assert_array_equal(res.regularization, unbounded.regularization)
    _assert_same_split(res, full.decompose(X))
    # Below the least checkpointing (56 vectors at every = 8), the pieces that hold the
    # least, the split unchanged: silently within the whole budget (a path thinned by
    # "auto" leaves its replay little room), with a warning past it.
    for vectors, over in ((4 * 50, False), (50, True)):
        thinned.memory_budget = vectors * P * 8
        held.clear()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            res = thinned.decompose(X)
        warned = [str(w.message) for w in record if "more than memory_budget" in str(w.message)]
        assert len(warned) == over
        if over:
            assert "holds 56 vectors" in warned[0]
            assert f"at least {4 * 56 * P * 8:,} bytes" in warned[0]
        assert paths[-1]._every == 8 and max(held) <= 3 * 8 + 4 * 8
        if over:  # the other blocks smaller too: another order of the same sums
            _assert_same_split(res, unbounded)
        else:
            np.testing.assert_array_equal(res.contributions, unbounded.contributions)
