"""Training parameters MLPClassifier users reach for: the step-size schedules, Nesterov
momentum, warm_start and partial_fit, and the warning when finite training diverges.

Schedules are checked against scikit-learn's rule written out here; continued paths
against one uninterrupted fit of the same steps and against the independent references
of tests/_reference.py (the forward per-sample recursion, autograd through an unrolled
replay, the path kernel as an explicit sum of loop Grams).
"""

import re
import warnings

import numpy as np
import pytest
import torch
from _reference import (
    forward_recursion,
    gauss_nodes,
    jacobian_loop,
    module_at,
    torch_optim_replay,
    unrolled_reference,
)
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier, MLPRegressor

from skpathkernel import (
    DivergenceWarning,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    TrainingDivergedError,
)

BASE = dict(hidden_layer_sizes=(6,), activation="tanh", normalize_y=False, dtype="float64",
            random_state=0)


def _data(n=16, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, 2))
    return X, np.sin(3 * X[:, 0]) + X[:, 1]


def _squared(out, y):
    return 0.5 * (out - y).pow(2).mean(dim=1)


def _steps_per_epoch(est, n):
    return -(-n // min(est.batch_size, n))


# ------------------------------------------------------------------ schedules
def _sklearn_invscaling(lr_init, power_t, n, n_epochs):
    """sklearn's SGDOptimizer.iteration_ends: after each epoch t += n_samples and the step
    size becomes lr_init / (t + 1) ** power_t; the first epoch uses lr_init."""
    lrs, t = [], 0
    for _ in range(n_epochs):
        lrs.append(lr_init if t == 0 else lr_init / (t + 1) ** power_t)
        t += n
    return np.array(lrs)


def _sklearn_adaptive(lr_init, losses, tol, n_iter_no_change):
    """MLPClassifier's _update_no_improvement_count with SGDOptimizer.trigger_stopping:
    the step size of every epoch, and the number of epochs run before it stops."""
    lr, best, count, lrs = lr_init, np.inf, 0, []
    for epoch, loss in enumerate(losses):
        lrs.append(lr)
        count = count + 1 if loss > best - tol else 0
        best = min(best, loss)
        if count > n_iter_no_change:
            if lr <= 1e-6:
                return np.array(lrs), epoch + 1
            lr /= 5.0
            count = 0
    return np.array(lrs), len(losses)


def test_invscaling_steps_follow_sklearns_rule():
    X, y = _data(20)
    est = PathKernelMachine(**BASE, solver="sgd", learning_rate="invscaling", power_t=0.3,
                            learning_rate_init=0.2, batch_size=8, max_iter=5, tol=None)
    est.fit(X, y)
    per_epoch = _sklearn_invscaling(0.2, 0.3, 20, 5)
    expected = np.repeat(per_epoch, _steps_per_epoch(est, 20))
    assert_allclose(est.trajectory_.learning_rates, expected, rtol=1e-15)
    assert len(np.unique(expected)) == 5  # the schedule really decays


def test_adaptive_divides_by_five_when_the_loss_stalls_and_stops_at_1e6():
    X, y = _data(20)
    # A tolerance no epoch can meet: every epoch counts as "no improvement".
    est = PathKernelMachine(**BASE, solver="sgd", learning_rate="adaptive",
                            learning_rate_init=1e-4, batch_size=10, max_iter=60, tol=10.0,
                            n_iter_no_change=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)  # it stops: no warning
        est.fit(X, y)
    lrs, n_epochs = _sklearn_adaptive(1e-4, est.loss_curve_, 10.0, 2)
    assert est.n_iter_ == n_epochs < 60
    assert_allclose(est.trajectory_.learning_rates, np.repeat(lrs, 2), rtol=1e-15)
    assert lrs[-1] <= 1e-6 < lrs[0]


def test_adaptive_with_a_real_stall():
    X, y = _data(20)
    est = PathKernelMachine(**BASE, solver="sgd", learning_rate="adaptive",
                            learning_rate_init=0.5, batch_size=None, max_iter=40, tol=1e-3,
                            n_iter_no_change=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(X, y)
    lrs, n_epochs = _sklearn_adaptive(0.5, est.loss_curve_, 1e-3, 1)
    assert est.n_iter_ == n_epochs
    assert_allclose(est.trajectory_.learning_rates, lrs, rtol=1e-15)



def test_the_convergence_warning_of_adaptive_names_its_rule():
    """With tol=10 the loss never improves by tol: "adaptive" divided its step size at
    every second epoch, and the warning said the loss "still improved by more than
    tol=10 within the last 2 epochs"."""
    X, y = _data()
    est = PathKernelMachine(**SCHEDULED, learning_rate="adaptive")
    est.set_params(tol=10.0, n_iter_no_change=1, max_iter=6)
    with pytest.warns(ConvergenceWarning) as record:
        est.fit(X, y)
    message = str(record[0].message)
    assert "still improved" not in message
    lr = est.trajectory_.learning_rates[-1]  # divided twice, after epochs 3 and 5
    assert lr == pytest.approx(0.1 / 25)
    assert "learning_rate='adaptive'" in message and f"it is {lr:g})" in message
    assert "2 consecutive epochs in which the training loss did not improve" in message

def test_adaptive_with_tol_none_keeps_its_step_size():
    """tol=None switches the stopping rule off (SGDClassifier's convention, whose
    "adaptive" schedule then never divides: its no-improvement count needs tol > -inf),
    so every step is at learning_rate_init: the path of the constant schedule."""
    X, y = _data(20)
    # A step size at which the loss often fails to improve on its best (21 of 29
    # epochs): the rule at tol 0 divided the step size 5 times (to 1.6e-4).
    params = dict(BASE, solver="sgd", learning_rate_init=0.5, batch_size=5, tol=None,
                  n_iter_no_change=1, max_iter=30)
    adaptive = PathKernelMachine(**params, learning_rate="adaptive").fit(X, y)
    constant = PathKernelMachine(**params, learning_rate="constant").fit(X, y)
    losses = np.array(constant.loss_curve_)
    assert np.sum(losses[1:] >= np.minimum.accumulate(losses)[:-1]) >= 2  # it stalls
    assert_array_equal(adaptive.trajectory_.learning_rates, 0.5)
    assert torch.equal(adaptive.trajectory_._params, constant.trajectory_._params)
    assert adaptive.n_iter_ == 30


@pytest.mark.parametrize("schedule", ["invscaling", "adaptive"])
def test_schedules_are_sgds_only(schedule):
    X, y = _data()
    est = PathKernelMachine(**BASE, solver="adam", learning_rate=schedule, max_iter=4,
                            batch_size=8, tol=None, learning_rate_init=0.01).fit(X, y)
    assert np.all(est.trajectory_.learning_rates == 0.01)


def test_nesterov_is_torchs_and_sklearns_default():
    X, y = _data()
    # scikit-learn's default, read from MLPClassifier itself.
    assert (PathKernelClassifier().nesterovs_momentum
            == PathKernelMachine().nesterovs_momentum
            == MLPClassifier().nesterovs_momentum is True)
    params = dict(BASE, solver="sgd", momentum=0.9, learning_rate_init=0.05, batch_size=8,
                  max_iter=3, tol=None)
    est = PathKernelMachine(**params).fit(X, y)
    heavy = PathKernelMachine(**params, nesterovs_momentum=False).fit(X, y)
    assert est.trajectory_.solver_spec.nesterov and not heavy.trajectory_.solver_spec.nesterov
    assert not torch.equal(est.trajectory_.parameters(-1), heavy.trajectory_.parameters(-1))
    # torch.optim.SGD(nesterov=True) replayed by hand: buf = mu buf + g, theta -= lr (g + mu buf).
    traj, module = est.trajectory_, module_at(est, 0)
    theta, buf = traj.parameters(0).double().clone(), None
    for t, batch in enumerate(traj.batches):
        torch.nn.utils.vector_to_parameters(theta, module.parameters())
        out = module(torch.as_tensor(X[batch]))
        loss = 0.5 * (out.ravel() - torch.as_tensor(y[batch])).pow(2).mean()
        g = torch.cat([p.reshape(-1) for p in torch.autograd.grad(loss, module.parameters())])
        buf = g if buf is None else 0.9 * buf + g
        theta = theta - 0.05 * (g + 0.9 * buf)
        assert_allclose(theta.detach(), traj.parameters(t + 1), rtol=0, atol=1e-12)
    # Without momentum there is no Nesterov step: plain SGD, as in scikit-learn.
    plain = PathKernelMachine(**{**params, "momentum": 0.0}).fit(X, y)
    assert not plain.trajectory_.solver_spec.nesterov
    # Its terms have no (coef, memory) form: asked for one, the trajectory says so.
    with pytest.raises(ValueError, match="direct=True"):
        est.trajectory_.step_coefficients()


def test_power_t_below_zero_is_refused_and_the_fit_kept():
    X, y = _data()
    est = PathKernelMachine(**BASE, max_iter=2, tol=None).fit(X, y)
    before = est.trajectory_
    with pytest.raises(ValueError, match="power_t"):
        est.set_params(power_t=-0.5).fit(X, y)
    assert est.trajectory_ is before


# ------------------------------------------------------------------ exactness
def _check_exact(est, X_train, Xq):
    """decompose, the path kernel and the unrolled attribution against the references."""
    res = est.decompose(Xq)
    Y = torch.as_tensor(np.asarray(est._Y_fit)).reshape(len(X_train), -1)
    contrib, reg = forward_recursion(est, X_train, Y, _squared, Xq, nodes=gauss_nodes(6))
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))
    assert res.error < 1e-9
    # The path kernel (continuous-time weighting) as an explicit sum over the recorded
    # steps of lr_k / (1 - momentum) J_k D_k J_k^T, D_k the optimizer's preconditioner.
    traj = est.trajectory_
    spec = traj.solver_spec
    memory = 1.0 / (1.0 - spec.momentum) if spec.name == "sgd" else 1.0
    K = 0.0
    for k in range(len(traj) - 1):
        J = jacobian_loop(module_at(est, k), Xq).numpy()
        D = traj.preconditioner(k)
        D = np.ones(J.shape[2]) if D is None else D.double().numpy()
        K = K + traj.learning_rates[k] * memory * np.einsum("ncp,p,mcp->nm", J, D, J)
    assert_allclose(PathKernel(est, memory="continuous")(Xq), K / J.shape[1], rtol=1e-10)
    scores = est.attribute(Xq, method="unrolled")
    ref = unrolled_reference(est.network_, Xq, np.ones((len(Xq), 1)))
    assert np.abs(scores - ref).max() <= 1e-8 * np.abs(ref).max()


SCHEDULED = dict(BASE, solver="sgd", learning_rate_init=0.1, batch_size=5, tol=None)


@pytest.mark.parametrize("schedule", ["invscaling", "adaptive"])
def test_scheduled_paths_are_exact(schedule):
    X, y = _data()
    extra = dict(tol=10.0, n_iter_no_change=1) if schedule == "adaptive" else {}
    est = PathKernelMachine(**{**SCHEDULED, **extra}, learning_rate=schedule, max_iter=4)
    est.fit(X, y)
    assert len(np.unique(est.trajectory_.learning_rates)) > 1
    _check_exact(est, X, X[:3] + 0.1)


@pytest.mark.parametrize("alpha", [0.0, 0.01])
@pytest.mark.parametrize("schedule", ["constant", "invscaling"])
def test_nesterov_paths_are_exact(schedule, alpha):
    X, y = _data()
    est = PathKernelMachine(**SCHEDULED, learning_rate=schedule, momentum=0.9, alpha=alpha,
                            max_iter=4).fit(X, y)
    traj, Xq = est.trajectory_, X[:3] + 0.1
    assert traj.solver_spec.nesterov
    assert (len(np.unique(traj.learning_rates)) > 1) == (schedule == "invscaling")
    _check_exact(est, X, Xq)
    # The default ("discrete") path kernel as an explicit sum of loop Grams, each step's
    # gradient weighted by what it moved the end point: lr_t (g_t + mu buf_t) gives g_s
    # the weight lr_t (1 + mu) at t = s and lr_t mu^(t-s+1) after.
    lrs, mu = traj.learning_rates, 0.9
    T = traj.n_steps
    grams = [np.einsum("ncp,mcp->nm", J, J)
             for J in (jacobian_loop(module_at(est, k), Xq).numpy() for k in range(T))]
    W = [sum(lrs[t] * ((t == s) + mu ** (t - s + 1)) for t in range(s, T)) for s in range(T)]
    K = sum(w * G for w, G in zip(W, grams))
    assert_allclose(PathKernel(est)(Xq), K, rtol=1e-10)
    # Heavy-ball weights, sum_t lr_t mu^(t-s), would be far off: the check can fail.
    heavy = sum(sum(lrs[t] * mu ** (t - s) for t in range(s, T)) * G
                for s, G in enumerate(grams))
    assert np.abs(heavy - K).max() > 1e-2 * np.abs(K).max()


@pytest.mark.parametrize("solver", [dict(solver="sgd", learning_rate="invscaling",
                                         learning_rate_init=0.1, momentum=0.5),
                                    dict(solver="adam", learning_rate_init=0.01, alpha=0.01)])
def test_warm_start_equals_one_fit_bit_for_bit_and_stays_exact(solver):
    X, y = _data()
    params = dict(BASE, batch_size=5, tol=None, **solver)
    whole = PathKernelMachine(**params, max_iter=5).fit(X, y)
    est = PathKernelMachine(**params, max_iter=2, warm_start=True).fit(X, y)
    est.set_params(max_iter=3).fit(X, y)
    a, b = whole.trajectory_, est.trajectory_
    assert torch.equal(a._params, b._params)
    for key in a.state_keys:
        assert torch.equal(a._states[key], b._states[key])
    assert_array_equal(a.steps, b.steps)
    assert_array_equal(a.learning_rates, b.learning_rates)
    assert_array_equal(a._batch_indices, b._batch_indices)
    assert_array_equal(a._state_steps, b._state_steps)
    assert est.loss_curve_ == whole.loss_curve_
    assert (est.n_iter_, est.t_) == (whole.n_iter_, whole.t_)
    assert est.X_fit_ is not None and len(est.X_fit_) == len(X)
    _check_exact(est, X, X[:3] + 0.1)


def test_warm_start_at_a_new_learning_rate_init_takes_it():
    """A warm start after set_params(learning_rate_init=...) steps at the new rate (as
    MLPClassifier's warm start does), from the same optimizer state: one exact path.
    partial_fit keeps the schedule's rate, as MLPClassifier's does."""
    X, y = _data()
    params = dict(BASE, solver="adam", batch_size=5, tol=None, max_iter=2)
    est = PathKernelMachine(**params, learning_rate_init=0.01, warm_start=True).fit(X, y)
    first = est.trajectory_.n_steps
    est.set_params(learning_rate_init=0.002).fit(X, y)
    lrs = est.trajectory_.learning_rates
    assert_array_equal(lrs[:first], 0.01)
    assert_array_equal(lrs[first:], 0.002)
    assert est.trajectory_.n_steps == 2 * first  # one path, extended
    _check_exact(est, X, X[:3] + 0.1)
    inc = PathKernelMachine(**params, learning_rate_init=0.01).partial_fit(X, y)
    inc.set_params(learning_rate_init=0.002).partial_fit(X, y)
    assert_array_equal(inc.trajectory_.learning_rates, 0.01)


@pytest.mark.parametrize("change", [dict(learning_rate_init=0.02), dict(power_t=0.9),
                                    dict(learning_rate="constant")])
def test_partial_fit_continues_its_schedule_after_set_params(change):
    """MLPClassifier's partial_fit keeps its optimizer, schedule and all, across calls:
    a stream's step sizes under "invscaling" stay learning_rate_init / (t + 1) ** power_t
    of its first call. They were recomputed from the new values (0.02 / sqrt(t + 1)
    after set_params(learning_rate_init=0.02)). The next fit takes the new values."""
    X, y = _data(20)
    params = dict(SCHEDULED, learning_rate="invscaling", power_t=0.5, batch_size=20)
    est = PathKernelMachine(**params).partial_fit(X, y)
    est.set_params(**change)
    for _ in range(3):
        est.partial_fit(X, y)
    assert_allclose(est.trajectory_.learning_rates, _sklearn_invscaling(0.1, 0.5, 20, 4),
                    rtol=1e-15)
    _check_exact(est, np.tile(X, (4, 1)), X[:3] + 0.1)
    new = {**params, **change}
    est.set_params(warm_start=True, max_iter=1).fit(X, y)
    expected = (new["learning_rate_init"] / (4 * 20 + 1) ** new["power_t"]
                if new["learning_rate"] == "invscaling" else new["learning_rate_init"])
    assert_allclose(est.trajectory_.learning_rates[-1], expected, rtol=1e-15)



@pytest.mark.parametrize("first, then", [("invscaling", "constant"),
                                         ("adaptive", "constant"),
                                         ("invscaling", "adaptive")])
def test_warm_start_with_another_schedule_starts_it_at_learning_rate_init(first, then):
    """"constant" is learning_rate_init throughout: a warm start that switched to it
    kept stepping with the size the previous schedule had decayed to (0.013 or 0.004
    for 0.1), as did one switching to "adaptive". The path stays exact."""
    X, y = _data(30)
    params = {**SCHEDULED, "tol": 10.0, "n_iter_no_change": 1}
    est = PathKernelMachine(**params, learning_rate=first, max_iter=6, warm_start=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # "adaptive" runs them all
        est.fit(X, y)
    n_before = est.trajectory_.n_steps
    assert est.trajectory_.learning_rates[-1] < 0.05  # the schedule moved the step size
    est.set_params(learning_rate=then, max_iter=2, tol=None).fit(X, y)
    assert_array_equal(est.trajectory_.learning_rates[n_before:], 0.1)
    assert est.decompose(X[:3]).error < 1e-10

def test_partial_fit_equals_one_fit_and_indexes_the_concatenation():
    X, y = _data()
    params = dict(BASE, solver="adam", learning_rate_init=0.01, batch_size=5, tol=None)
    whole = PathKernelMachine(**params, max_iter=3).fit(X, y)
    est = PathKernelMachine(**params)
    for _ in range(3):
        est.partial_fit(X, y)
    assert torch.equal(est.trajectory_._params, whole.trajectory_._params)
    assert est.loss_curve_ == whole.loss_curve_ and est.n_iter_ == 3
    # The training set is what the calls received, in order; the batches index into it.
    assert_array_equal(est.X_fit_, np.concatenate([X, X, X]))
    assert_array_equal(est.trajectory_._batch_indices % len(X),
                       whole.trajectory_._batch_indices)
    steps = _steps_per_epoch(est, len(X))
    for t, batch in enumerate(est.trajectory_.batches):
        assert np.all(batch // len(X) == t // steps)
    _check_exact(est, est.X_fit_, X[:3] + 0.1)


def test_partial_fit_on_chunks_is_exact_over_the_stream():
    X, y = _data(24)
    est = PathKernelMachine(**SCHEDULED, learning_rate="invscaling", momentum=0.5)
    chunks = np.array_split(np.arange(24), 3)
    for rows in chunks:
        est.partial_fit(X[rows], y[rows])
    assert_array_equal(est.X_fit_, X)
    assert est.trajectory_.n_samples == 24
    # invscaling's t counts the samples of every call so far.
    assert_allclose(est.trajectory_.learning_rates[-1], 0.1 / (16 + 1) ** 0.5, rtol=1e-15)
    _check_exact(est, X, X[:3] + 0.1)


@pytest.mark.parametrize("Est", [PathKernelMachine, PathKernelClassifier])
def test_a_stream_may_start_with_a_single_sample(Est):
    """MLPRegressor and MLPClassifier take a stream one sample at a time from its first
    call on; so do the estimators (their fit needs two). The path is torch.optim's over
    the same rows, and the regressor's decomposes exactly."""
    X, y = _data(8)
    params, first = dict(BASE), {}
    if Est is PathKernelClassifier:
        y, first = (y > 0).astype(int), {"classes": [0, 1]}
        del params["normalize_y"]
    sk = (MLPClassifier if Est is PathKernelClassifier else MLPRegressor)(max_iter=1)
    sk.partial_fit(X[:1], y[:1], **first)  # the behaviour matched
    est = Est(**params, solver="adam", learning_rate_init=0.01, tol=None)
    for i in range(len(X)):
        est.partial_fit(X[i:i + 1], y[i:i + 1], **(first if i == 0 else {}))
    assert est.n_iter_ == 8 and est.trajectory_.n_steps == 8
    assert_array_equal(est.X_fit_, X)
    replay = torch_optim_replay(est.network_, np.ones(len(X)))
    for ours, ref in zip(module_at(est).parameters(), replay.parameters()):
        assert_allclose(ours.detach().numpy(), ref.detach().numpy(), rtol=0, atol=1e-13)
    if Est is PathKernelMachine:
        _check_exact(est, X, X[:3] + 0.1)


def test_warm_start_on_other_data_extends_the_training_set():
    X, y = _data(24)
    est = PathKernelMachine(**BASE, solver="adam", learning_rate_init=0.01, batch_size=6,
                            tol=None, max_iter=2, warm_start=True)
    est.fit(X[:12], y[:12]).fit(X[12:], y[12:])
    assert_array_equal(est.X_fit_, X)
    assert est.trajectory_.n_steps == 8
    assert all(np.all(b >= 12) for b in est.trajectory_.batches[4:])
    _check_exact(est, X, X[:3] + 0.1)


def test_warm_start_continues_after_early_stopping_at_the_best_epoch():
    X, y = _data(40)
    est = PathKernelMachine(**BASE, solver="adam", learning_rate_init=0.05, batch_size=8,
                            early_stopping=True, validation_fraction=0.25, tol=1e-12,
                            n_iter_no_change=1, max_iter=8, warm_start=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(X, y)
        first = est.trajectory_.n_steps
        est.fit(X, y)
    assert est.trajectory_.n_steps > first
    assert len(est.X_fit_) == 30  # the same split: the same training set
    _check_exact(est, est.X_fit_, X[:2] + 0.1)


def test_classifier_partial_fit_classes():
    X, y = _data(30)
    labels = np.digitize(y, [-0.5, 0.5])
    clf = PathKernelClassifier(**{k: v for k, v in BASE.items() if k != "normalize_y"},
                               batch_size=10, tol=None)
    with pytest.raises(ValueError, match="classes must be passed"):
        clf.partial_fit(X[:10], labels[:10])
    clf.partial_fit(X[:10], labels[:10], classes=[0, 1, 2])
    clf.partial_fit(X[10:], labels[10:])
    assert clf.classes_.tolist() == [0, 1, 2] and clf.n_outputs_ == 3
    before = (clf.trajectory_, clf.n_iter_, clf.X_fit_)
    with pytest.raises(ValueError, match="classes not in classes_"):
        clf.partial_fit(X[:5], np.array([0, 1, 3, 0, 1]))
    assert (clf.trajectory_, clf.n_iter_, clf.X_fit_) == before
    assert len(clf.predict(X)) == 30


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("change, match", [
    (dict(hidden_layer_sizes=(7,)), "continue the fitted network"),
    (dict(activation="relu"), "continue the fitted network"),
    (dict(solver="sgd"), "solver='sgd' \\(was 'adam'\\).*one\\s+optimizer"),
    (dict(beta_2=0.9), "beta_2=0.9 \\(was 0.999\\).*one\\s+optimizer"),
    # Named by the estimator's parameter: the refusal printed SolverSpec(...,
    # weight_decay=0.1, ...), a name the user never set.
    (dict(alpha=0.1), "which alpha=0.1 \\(was 0\\) would"),
    (dict(dtype="float32"), "cannot continue"),
    (dict(trajectory_storage="disk"), "kept\\s+in memory"),
])
def test_continuing_with_another_network_or_optimizer_is_refused(change, match):
    X, y = _data()
    est = PathKernelMachine(**BASE, max_iter=2, tol=None, warm_start=True).fit(X, y)
    est.set_params(**change)
    state = dict(est.__dict__)
    with pytest.raises(ValueError, match=match):
        est.fit(X, y)
    assert est.__dict__ == state
    with pytest.raises(ValueError, match=match):
        est.partial_fit(X, y)
    assert est.__dict__ == state



@pytest.mark.parametrize("solver, change", [
    ("sgd", dict(beta_1=0.5, beta_2=0.9, epsilon=1e-3)),
    ("sgd", dict(nesterovs_momentum=False)),  # without momentum there is no Nesterov
    ("rmsprop", dict(beta_1=0.5, beta_2=0.9, momentum=0.5)),
    ("adam", dict(momentum=0.9)),
])
def test_continuing_after_changing_what_the_solver_ignores(solver, change):
    """Only the hyper-parameters the solver's update reads make another optimizer:
    sgd's path after set_params(beta_1=...) was refused as "one optimizer", though
    adam's after set_params(momentum=...) continued (scikit-learn ignores both)."""
    X, y = _data()
    params = dict(BASE, solver=solver, learning_rate_init=0.01, batch_size=5, tol=None)
    whole = PathKernelMachine(**params, max_iter=4).fit(X, y)
    est = PathKernelMachine(**params, max_iter=2, warm_start=True).fit(X, y)
    est.set_params(**change).fit(X, y)
    assert torch.equal(est.trajectory_._params, whole.trajectory_._params)
    assert est.trajectory_.solver_spec == whole.trajectory_.solver_spec
    est.partial_fit(X, y)
    assert est.n_iter_ == 5

def test_partial_fit_refuses_early_stopping_and_other_features():
    X, y = _data()
    est = PathKernelMachine(**BASE, early_stopping=True)
    with pytest.raises(ValueError, match="early_stopping"):
        est.partial_fit(X, y)
    assert not hasattr(est, "network_")
    est = PathKernelMachine(**BASE).partial_fit(X, y)
    state = dict(est.__dict__)
    with pytest.raises(ValueError, match="features"):
        est.partial_fit(X[:, :1], y)
    assert est.__dict__ == state


def _warnings_of(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ConvergenceWarning)
        fit()
    return [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("kw, clipped", [
    (dict(batch_size=20), True),
    (dict(batch_size=16), False),
    (dict(batch_size="auto"), False),
    # early stopping trains on 12 of the 16 samples: 14 is more than that.
    (dict(batch_size=14, early_stopping=True, validation_fraction=0.25), True),
])
def test_batch_size_above_the_training_samples_warns_as_mlpregressor(kw, clipped):
    """MLPRegressor warns that a batch_size larger than the training samples is clipped
    (full-batch steps); so does the estimator, at the user's line, naming both sizes."""
    X, y = _data(16)
    theirs = _warnings_of(lambda: MLPRegressor(max_iter=2, random_state=0, **kw).fit(X, y))
    assert bool(theirs) == clipped
    ours = _warnings_of(lambda: PathKernelMachine(**BASE, max_iter=2, **kw).fit(X, y))
    assert [w.filename for w in ours] == [__file__] * clipped
    if clipped:
        assert f"batch_size={kw['batch_size']}" in str(ours[0].message)
    if "early_stopping" not in kw:  # partial_fit, one pass over each call's samples
        ours = _warnings_of(lambda: PathKernelMachine(**BASE, **kw).partial_fit(X, y))
        assert len(ours) == clipped


def test_warm_start_false_starts_over():
    X, y = _data()
    est = PathKernelMachine(**BASE, max_iter=2, tol=None).fit(X, y)
    est.fit(X, y)
    assert est.n_iter_ == 2 and est.trajectory_.n_steps == 2


# ------------------------------------------------------------------ divergence
def _small_regression():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(50, 4))
    return X, X @ rng.normal(size=4) + 0.1 * rng.normal(size=50)



def test_a_continued_fit_that_overflows_names_the_step_along_the_path():
    """loss_curve_, n_iter_ and trajectory_.steps count along the whole path: the error
    of a warm start that overflows named its step and epoch within that fit (step 1,
    epoch 0) after 25 steps and 5 epochs."""
    X, y = _data(40)
    est = PathKernelMachine(**BASE, solver="sgd", learning_rate_init=0.1, batch_size=8,
                            max_iter=5, tol=None, warm_start=True).fit(X, y)
    assert (est.n_iter_, est.trajectory_.n_steps) == (5, 25)
    est.set_params(learning_rate_init=1e150)
    with pytest.raises(TrainingDivergedError) as raised:
        est.fit(X, y)
    step, epoch = (int(v) for v in
                   re.search(r"step (\d+) \(epoch (\d+)\)", str(raised.value)).groups())
    assert step >= 25 and epoch == 5 + (step - 25) // 5
    assert est.n_iter_ == 5  # the fitted state is the previous one

def test_finite_divergence_warns_with_epoch_loss_and_rate():
    X, y = _small_regression()
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=1e6,
                            random_state=0)
    with pytest.warns(DivergenceWarning) as record:
        est.fit(X, y)
    message = str(record[0].message)
    assert "epoch 0" in message and "1e+06" in message
    assert f"{est.loss_curve_[-1]:.3g}" in message
    assert issubclass(DivergenceWarning, ConvergenceWarning)
    assert est.score(X, y) < -1e6  # what the warning is about


def test_loss_that_ends_far_above_its_start_warns():
    X, y = _small_regression()
    # A linear model under full-batch gradient descent 10% past its stability limit
    # 2 / L: the loss grows geometrically, finite for these epochs; the parameters grow
    # less than 1000-fold, so the loss is what warns.
    A = np.c_[X, np.ones(len(X))]
    lr = 1.1 * 2 / np.linalg.eigvalsh(A.T @ A / len(X)).max()
    est = PathKernelMachine(hidden_layer_sizes=(), solver="sgd", learning_rate_init=lr,
                            batch_size=None, max_iter=20, tol=None, normalize_y=False,
                            random_state=0)
    with pytest.warns(DivergenceWarning, match="times the .* it started from") as record:
        est.fit(X, y)
    assert est.loss_curve_[-1] > 100 * est.loss_curve_[0]
    first = next(e for e, v in enumerate(est.loss_curve_) if v > 100 * est.loss_curve_[0])
    assert f"at epoch {first} " in str(record[0].message)


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_a_blow_up_within_the_first_epoch_warns(kind):
    """Adam at learning_rate_init=1 runs away inside its first epoch, whose mean loss
    then holds the blow-up: the start is the initial network's loss on the first batch.
    The regressor ends far above it; the classifier settles at chance, back near its
    start but not below (the first epoch's mean was hundreds of times it)."""
    from sklearn.datasets import load_diabetes, load_digits
    from sklearn.preprocessing import StandardScaler

    if kind == "regression":
        X, y = load_diabetes(return_X_y=True)
        est = PathKernelMachine(solver="adam", learning_rate_init=1.0, max_iter=30,
                                random_state=0)
    else:
        X, y = load_digits(return_X_y=True)
        est = PathKernelClassifier(solver="adam", learning_rate_init=1.0, max_iter=30,
                                   random_state=0)
    X = StandardScaler().fit_transform(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("always", DivergenceWarning)
        with pytest.warns(DivergenceWarning, match="at epoch 0 the training loss") as record:
            est.fit(X, y)
    message = next(str(w.message) for w in record if w.category is DivergenceWarning)
    start = float(message.split("times the ")[1].split(" it started")[0])
    assert est.loss_curve_[0] > 100 * start  # the first epoch's mean holds the blow-up
    assert est.loss_curve_[-1] >= start
    # What the warning is about: the fit predicts nothing.
    assert est.score(X, y) < (0 if kind == "regression" else 0.2)


def test_a_first_batch_unlike_the_rest_does_not_make_a_healthy_fit_warn():
    """The first batch's loss only says when to measure the start: a batch of zero
    targets (97% of them) or of zero sample weights has a loss near or at 0, which as
    the start made these healthy fits warn."""
    rng = np.random.RandomState(0)
    X = rng.randn(1000, 5)
    y = np.where(rng.rand(1000) < 0.03, 20 + 5 * X[:, 0], 0.0)
    from sklearn.datasets import load_diabetes
    from sklearn.preprocessing import StandardScaler

    Xd, yd = load_diabetes(return_X_y=True)
    Xd = StandardScaler().fit_transform(Xd)
    weights = np.ones(len(yd))
    weights[:32] = 0
    cases = [(PathKernelMachine(max_iter=60, batch_size=32, random_state=0), X, y, None),
             (PathKernelMachine(max_iter=50, batch_size=32, shuffle=False, random_state=0),
              Xd, yd, weights)]
    for est, Xc, yc, w in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            warnings.simplefilter("error", DivergenceWarning)
            est.fit(Xc, yc, sample_weight=w)
        assert est.loss_curve_[-1] < est.loss_curve_[0]


def test_measuring_the_start_leaves_training_and_the_random_streams_as_they_were(
        monkeypatch):
    """The initial network's loss on every row is one more forward pass in training
    modes: a dropout layer draws there, from generators whose states are restored."""
    from skpathkernel._path import _training

    rng = np.random.RandomState(0)
    X = rng.normal(size=(400, 4))
    y = X @ rng.normal(size=4)

    def fit():
        torch.manual_seed(0)
        est = PathKernelMachine(module=lambda i, o: torch.nn.Sequential(
            torch.nn.Linear(i, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(),
            torch.nn.Linear(16, o)), solver="adam", learning_rate_init=10.0, batch_size=40,
            max_iter=3, tol=None, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        return est.trajectory_.parameters(-1), torch.rand(1)

    calls = []
    measure = _training._initial_loss
    monkeypatch.setattr(_training, "_initial_loss",
                        lambda *a: calls.append(1) or measure(*a))
    measured = fit()
    assert calls  # the first epoch ran away: the start was measured
    monkeypatch.setattr(_training, "_start_loss", lambda first, batch, initial: first)
    plain = fit()
    assert torch.equal(measured[0], plain[0]) and torch.equal(measured[1], plain[1])


def test_growing_parameters_with_a_falling_loss_do_not_warn():
    X, y = _small_regression()
    # Features in tiny units: the linear weights must grow ~5000-fold, and do, healthily.
    est = PathKernelMachine(hidden_layer_sizes=(), solver="adam", learning_rate_init=10.0,
                            max_iter=300, tol=None, dtype="float64", random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        est.fit(X * 1e-3, y)
    traj = est.trajectory_
    assert traj.parameters(-1).norm() > 1000 * traj.parameters(0).norm()
    assert est.score(X * 1e-3, y) > 0.99



def test_a_stream_whose_targets_grow_does_not_warn_of_divergence():
    """A continued fit compares with the path's initial network on its own rows: later
    partial_fit calls on targets 1000 times the first call's have a loss far above the
    path's start (which warned, suggesting a smaller learning_rate_init) while training
    is healthy; running away on the same rows still warns."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(200, 2))
    y = np.r_[0.01 * X[:50, 0], 10 * X[50:, 0]]
    est = PathKernelMachine(hidden_layer_sizes=(16,), learning_rate_init=0.01,
                            normalize_y=False, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        for chunk in np.array_split(np.arange(200), 4):
            est.partial_fit(X[chunk], y[chunk])
    curve = est.loss_curve_
    assert min(curve[1:]) > 100 * curve[0]  # what the path's start alone called divergence
    assert curve[-1] < curve[1]
    X, y = _small_regression()
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=10.0,
                            normalize_y=False, random_state=0).partial_fit(X, y)
    start = f"times the {est.loss_curve_[0]:.3g} it started from"
    with pytest.warns(DivergenceWarning, match=start):
        est.partial_fit(X, y)

def test_defaults_do_not_raise_the_divergence_warning():
    # The defaults benchmark's data sets (benchmarks/bench_defaults.py) at the defaults.
    from sklearn.datasets import load_diabetes, load_iris, make_moons
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    cases = [(PathKernelClassifier, load_iris(return_X_y=True)),
             (PathKernelClassifier, make_moons(noise=0.3, random_state=0)),
             (PathKernelMachine, load_diabetes(return_X_y=True))]
    for cls, (X, y) in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            warnings.simplefilter("error", DivergenceWarning)
            make_pipeline(StandardScaler(), cls(random_state=0, max_iter=60)).fit(X, y)


# ------------------------------------------------------------------ TangentFeatureSVM's C
@pytest.mark.parametrize("normalize", [False, True])
def test_svm_auto_C_is_the_cross_validated_choice(normalize):
    from sklearn.datasets import load_iris
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.svm import SVC

    from skpathkernel import TangentFeatureSVM, TangentKernel

    X, y = load_iris(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    net = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=30, tol=None,
                               random_state=0)
    svm = TangentFeatureSVM(net, normalize=normalize).fit(X, y)
    K = TangentKernel(svm)(X, X).astype(np.float64)
    if normalize:  # cosine normalization by hand: unit diagonal, so the grid is AUTO_C itself
        d = np.sqrt(np.diag(K))
        K = K / np.outer(d, d)
    grid = np.array([0.1, 1, 10, 100, 1000]) / np.mean(np.diag(K))  # the documented grid
    # scikit-learn's own search over the same grid and folds is the reference: mean fold
    # accuracy, the first (smallest) C among the best.
    search = GridSearchCV(SVC(kernel="precomputed"), {"C": list(grid)},
                          cv=StratifiedKFold(3)).fit(K, y)
    assert svm.C_ == pytest.approx(search.best_params_["C"], rel=1e-12)
    assert svm.svm_.C == svm.C_
    fixed = TangentFeatureSVM(net, C=2.5).fit(X, y)
    assert fixed.C_ == 2.5 == fixed.svm_.C


# ------------------------------------------------------------------ per-epoch bookkeeping
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [[75], [200, 131], [200, 200, 26]])
def test_epoch_loss_is_the_size_weighted_mean_of_the_batch_losses(dtype, sizes):
    from skpathkernel._path._training import _epoch_loss

    rng = np.random.RandomState(len(sizes))
    sizes_t = torch.tensor(sizes, dtype=dtype)
    for scale in (1e-30, 1e-3, 1.0, 1e20, 1e36):
        losses = [torch.tensor(v, dtype=dtype) for v in scale * rng.rand(len(sizes))]
        # Each loss times its batch size in the losses' dtype, summed in float64.
        expected = float((torch.stack(losses) * sizes_t).double().sum()) / sum(sizes)
        assert _epoch_loss(losses, sizes_t, float(sum(sizes)), 0, 0, 1e-3) == expected
    for bad in (float("nan"), float("inf")):
        for i in range(len(sizes)):
            losses = [torch.tensor(0.5, dtype=dtype) for _ in sizes]
            losses[i] = torch.tensor(bad, dtype=dtype)
            with pytest.raises(TrainingDivergedError, match=f"optimizer step {7 + i} "):
                _epoch_loss(losses, sizes_t, float(sum(sizes)), 7, 3, 1e-3)


def test_divergence_norms_read_from_the_path_equal_the_ones_taken_each_epoch(monkeypatch):
    from skpathkernel._path import _training

    seen = []
    original = _training._warn_if_diverging

    def spy(first_loss, loss_curve, norms, lr, epoch0=0):
        seen.append(list(norms))
        return original(first_loss, loss_curve, norms, lr, epoch0)

    monkeypatch.setattr(_training, "_warn_if_diverging", spy)
    X, y = _small_regression()
    # One step an epoch: every epoch's end is recorded with record_every=1 (norms read
    # from the path once the loss went up), not with 3 (norms taken as the epochs run).
    for record_every in (1, 3):
        est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=1e6,
                                batch_size=None, max_iter=12, tol=None, random_state=0,
                                record_every=record_every)
        with pytest.warns(DivergenceWarning):
            est.fit(X, y)
    lazy, eager = seen
    assert est.loss_curve_[-1] > est.loss_curve_[0]
    assert len(lazy) == len(eager) == 13
    assert lazy == eager  # the same floats
    traj = est.trajectory_
    assert eager[-1] == pytest.approx(float(traj.parameters(-1).double().norm()), rel=1e-6)


def test_logistic_activation_is_mlpclassifiers_sigmoid():
    """activation="logistic" (MLPClassifier's name): MLPClassifier's own forward pass
    (``_forward_pass_fast``), given our trained weights, returns our probabilities; the
    hand-written step equals autograd's gradient of that network (test_mlp_step.py) and
    the path decomposes exactly."""
    X, _ = _data(30)
    y = (X[:, 0] * X[:, 1] > 0).astype(int)
    est = PathKernelClassifier(hidden_layer_sizes=(6,), activation="logistic", max_iter=20,
                               solver="sgd", learning_rate_init=0.5, dtype="float64",
                               random_state=0).fit(X, y)
    assert [type(m) for m in est.module_][1] is torch.nn.Sigmoid
    mlp = MLPClassifier(hidden_layer_sizes=(6,), activation="logistic", max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp.fit(X, y)
    linears = [m for m in est.module_ if isinstance(m, torch.nn.Linear)]
    mlp.coefs_ = [lin.weight.detach().numpy().T.copy() for lin in linears]
    mlp.intercepts_ = [lin.bias.detach().numpy().copy() for lin in linears]
    assert_allclose(est.predict_proba(X), mlp.predict_proba(X), rtol=1e-12, atol=1e-14)
    res = est.decompose(X[:4])
    assert res.error < 1e-10 * max(1.0, np.abs(res.prediction).max())
