"""The training engine against independent references: a fresh torch.optim replay of the
recorded batches, closed-form update rules, and losses recomputed with NumPy / sklearn."""

import copy

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.metrics import log_loss

from skpathkernel import PathKernelClassifier, PathKernelMachine, TrainingDivergedError

SOLVERS = [
    dict(solver="sgd", learning_rate_init=0.1),
    dict(solver="sgd", learning_rate_init=0.05, momentum=0.9),
    dict(solver="sgd", learning_rate_init=0.05, momentum=0.5, alpha=0.01),
    dict(solver="adam", learning_rate_init=0.01),
    dict(solver="adam", learning_rate_init=0.01, alpha=0.01, beta_1=0.8, beta_2=0.99),
    dict(solver="adamw", learning_rate_init=0.01, alpha=0.05),
    dict(solver="rmsprop", learning_rate_init=0.005, alpha=0.01),
]
SOLVER_IDS = ["sgd", "sgd-mom", "sgd-mom-l2", "adam", "adam-l2-betas", "adamw-wd", "rmsprop-l2"]


def _reference_optimizer(params, est):
    """The torch.optim optimizer the estimator's parameters describe, built independently."""
    lr, wd = est.learning_rate_init, est.alpha
    betas = (est.beta_1, est.beta_2)
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=est.momentum, weight_decay=wd),
        "adam": lambda: torch.optim.Adam(params, lr=lr, betas=betas, eps=est.epsilon,
                                         weight_decay=wd),
        "adamw": lambda: torch.optim.AdamW(params, lr=lr, betas=betas, eps=est.epsilon,
                                           weight_decay=wd),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=lr, eps=est.epsilon, weight_decay=wd),
    }[est.solver]()


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _replay(est, X, Y, per_sample_loss):
    """Replay the recorded batches through a fresh module and optimizer; return the points."""
    module = copy.deepcopy(est.module_)
    module.load_state_dict(est.trajectory_.state_dict(0))
    opt = _reference_optimizer(list(module.parameters()), est)
    X_t = torch.as_tensor(X, dtype=torch.float64)
    points = [_flat(module)]
    for batch in est.trajectory_.batches:
        idx = torch.as_tensor(batch)
        opt.zero_grad()
        per_sample_loss(module(X_t[idx]), Y[idx]).mean().backward()
        opt.step()
        points.append(_flat(module))
    return torch.stack(points), opt


def _squared(out, y):
    return 0.5 * (out - y).pow(2).mean(dim=1)


@pytest.mark.parametrize("params", SOLVERS, ids=SOLVER_IDS)
@pytest.mark.parametrize("batch_size", [None, 7])
def test_recorded_path_equals_torch_optim_replay(regression_data, params, batch_size):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=4, batch_size=batch_size,
                            dtype="float64", random_state=0, **params).fit(X, y)
    Y = torch.as_tensor(y, dtype=torch.float64).reshape(-1, 1)
    points, opt = _replay(est, X, Y, _squared)
    traj = est.trajectory_
    assert len(traj) == len(points) == traj.n_steps + 1
    assert_allclose(traj._params.numpy(), points.numpy(), rtol=1e-12, atol=1e-14)
    assert_array_equal(traj.steps, np.arange(len(traj)))
    assert_allclose(traj.learning_rates, params["learning_rate_init"])
    # The recorded optimizer state of the last step equals the replayed optimizer's state.
    for key in traj.state_keys:
        replayed = torch.cat([opt.state[p][key].reshape(-1) for p in opt.param_groups[0]["params"]])
        assert_allclose(traj.optimizer_state(-1)[key].numpy(), replayed.numpy(), rtol=1e-12)


@pytest.mark.parametrize("solver", ["adam", "adamw", "rmsprop"])
def test_preconditioner_reproduces_the_update_rule(regression_data, solver):
    """Closed form: theta_{k+1} - theta_k = -lr * D_k * direction_k (- lr * wd * theta_k for
    AdamW), with the direction computed independently: Adam's bias-corrected first moment
    accumulated by hand from autograd gradients, RMSprop's gradient itself."""
    X, y = regression_data
    lr, wd, beta_1 = 0.01, 0.1 if solver == "adamw" else 0.0, 0.8
    est = PathKernelMachine(hidden_layer_sizes=(4,), solver=solver, learning_rate_init=lr,
                            alpha=wd, beta_1=beta_1, max_iter=4, dtype="float64",
                            random_state=1).fit(X, y)
    traj = est.trajectory_
    m = torch.zeros(traj.n_params, dtype=torch.float64)
    for k in range(len(traj) - 1):
        module = copy.deepcopy(est.module_)
        module.load_state_dict(traj.state_dict(k))
        out = module(torch.as_tensor(X))
        _squared(out, torch.as_tensor(y).reshape(-1, 1)).mean().backward()
        grad = _flat_grad(module)
        state = traj.optimizer_state(k)
        assert float(state["step"]) == k + 1
        if solver == "rmsprop":
            direction = grad
        else:
            m = beta_1 * m + (1 - beta_1) * grad
            direction = m / (1 - beta_1 ** (k + 1))
        expected = -lr * traj.preconditioner(k) * direction - lr * wd * traj.parameters(k)
        step = traj.parameters(k + 1) - traj.parameters(k)
        assert_allclose(step.numpy(), expected.numpy(), rtol=1e-9, atol=1e-15)


def test_momentum_buffer_follows_from_consecutive_points(regression_data):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(4,), momentum=0.9, learning_rate_init=0.05,
                            max_iter=3, dtype="float64", random_state=0).fit(X, y)
    Y = torch.as_tensor(y, dtype=torch.float64).reshape(-1, 1)
    _, opt = _replay(est, X, Y, _squared)
    buf = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                     for p in opt.param_groups[0]["params"]])
    traj = est.trajectory_
    implied = -(traj.parameters(-1) - traj.parameters(-2)) / est.learning_rate_init
    assert_allclose(implied.numpy(), buf.numpy(), rtol=1e-9, atol=1e-14)


def _flat_grad(module):
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def test_classifier_replay_log_loss_multiclass():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(30, 2))
    y = np.array(["a", "b", "c"])[rng.randint(0, 3, 30)]
    clf = PathKernelClassifier(hidden_layer_sizes=(6,), solver="adam", learning_rate_init=0.05,
                               batch_size=8, max_iter=3, dtype="float64", random_state=0)
    clf.fit(X, y)
    codes = torch.as_tensor(np.searchsorted(clf.classes_, y))

    def ce(out, target):
        return torch.nn.functional.cross_entropy(out, target, reduction="none")

    points, _ = _replay(clf, X, codes, ce)
    assert_allclose(clf.trajectory_._params.numpy(), points.numpy(), rtol=1e-12, atol=1e-14)


def test_state_dict_endpoints(regression_data):
    X, y = regression_data
    created = []

    def factory(n_in, n_out):
        module = torch.nn.Sequential(torch.nn.Linear(n_in, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, n_out))
        created.append(copy.deepcopy(module.state_dict()))
        return module

    est = PathKernelMachine(module=factory, max_iter=5, learning_rate_init=0.1,
                            random_state=3).fit(X, y)
    traj = est.trajectory_
    for name, value in created[0].items():
        assert torch.equal(traj.state_dict(0)[name], value.to(traj.dtype))
    fresh = factory(X.shape[1], 1)
    fresh.load_state_dict(traj.state_dict(-1))
    with torch.no_grad():
        out = fresh(torch.as_tensor(X, dtype=torch.float32))[:, 0].numpy()
    assert_allclose(out, est.predict(X), rtol=1e-6)
    # Training moved the parameters.
    assert not torch.equal(traj.parameters(0), traj.parameters(-1))


def test_batches_cover_every_sample_once_per_epoch(regression_data):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(3,), batch_size=5, max_iter=3,
                            random_state=0).fit(X, y)
    batches = est.trajectory_.batches
    per_epoch = int(np.ceil(len(X) / 5))
    assert len(batches) == 3 * per_epoch == est.t_
    orders = []
    for e in range(3):
        epoch = np.concatenate(batches[e * per_epoch : (e + 1) * per_epoch])
        assert_array_equal(np.sort(epoch), np.arange(len(X)))
        orders.append(epoch)
    assert not np.array_equal(orders[0], orders[1])  # reshuffled between epochs
    noshuffle = PathKernelMachine(hidden_layer_sizes=(3,), batch_size=5, max_iter=2,
                                  shuffle=False, random_state=0).fit(X, y)
    assert_array_equal(np.concatenate(noshuffle.trajectory_.batches[:per_epoch]),
                       np.arange(len(X)))


def test_loss_curve_matches_numpy_and_sklearn(regression_data):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=3, learning_rate_init=0.1,
                            dtype="float64", random_state=0).fit(X, y)
    for epoch in range(3):  # full batch: epoch e's loss is the loss at point e
        module = copy.deepcopy(est.module_)
        module.load_state_dict(est.trajectory_.state_dict(epoch))
        with torch.no_grad():
            pred = module(torch.as_tensor(X))[:, 0].numpy()
        assert_allclose(est.loss_curve_[epoch], 0.5 * np.mean((pred - y) ** 2), rtol=1e-12)

    yc = (y > 0).astype(int)
    clf = PathKernelClassifier(hidden_layer_sizes=(5,), max_iter=2, dtype="float64",
                               random_state=0).fit(X, yc)
    module = copy.deepcopy(clf.module_)
    module.load_state_dict(clf.trajectory_.state_dict(1))
    with torch.no_grad():
        p = torch.sigmoid(module(torch.as_tensor(X))[:, 0]).numpy()
    assert_allclose(clf.loss_curve_[1], log_loss(yc, p), rtol=1e-10)


@pytest.mark.parametrize("record_every, n_steps, expected",
                         [(3, 10, [0, 3, 6, 9, 10]), (5, 10, [0, 5, 10]), (1, 3, [0, 1, 2, 3])])
def test_record_every(regression_data, record_every, n_steps, expected):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(3,), solver="adam", max_iter=n_steps,
                            record_every=record_every, dtype="float64", random_state=0)
    est.fit(X, y)
    full = PathKernelMachine(**{**est.get_params(), "record_every": 1}).fit(X, y)
    traj = est.trajectory_
    assert_array_equal(traj.steps, expected)
    assert len(traj.learning_rates) == len(traj) - 1
    assert traj.n_steps == n_steps
    for k, step in enumerate(expected):
        assert torch.equal(traj.parameters(k), full.trajectory_.parameters(step))
    for k, step in enumerate(expected[:-1]):
        assert torch.equal(traj.optimizer_state(k)["exp_avg_sq"],
                           full.trajectory_.optimizer_state(step)["exp_avg_sq"])


def test_same_seed_identical_different_seed_differs(regression_data):
    X, y = regression_data
    kw = dict(hidden_layer_sizes=(8,), batch_size=6, max_iter=3, solver="adam")
    a = PathKernelMachine(random_state=42, **kw).fit(X, y)
    b = PathKernelMachine(random_state=42, **kw).fit(X, y)
    c = PathKernelMachine(random_state=43, **kw).fit(X, y)
    assert_array_equal(a.predict(X), b.predict(X))
    assert torch.equal(a.trajectory_._params, b.trajectory_._params)
    assert not np.array_equal(a.predict(X), c.predict(X))


def test_global_torch_rng_untouched(regression_data):
    X, y = regression_data
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, batch_size=5,
                      random_state=0).fit(X, y)
    assert torch.equal(torch.rand(3), expected)


def test_divergence_names_step_and_keeps_previous_fit(regression_data):
    X, y = regression_data
    est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, learning_rate_init=0.05,
                            random_state=0).fit(X, y)
    before = est.predict(X)
    traj = est.trajectory_
    est.set_params(learning_rate_init=1e6, activation="identity", max_iter=50)
    with pytest.raises(TrainingDivergedError, match=r"step \d+.*smaller learning_rate_init"):
        est.fit(X * 1e3, y)
    assert isinstance(TrainingDivergedError("x"), ValueError)
    assert est.trajectory_ is traj
    est.set_params(learning_rate_init=0.05, activation="tanh", max_iter=5)
    assert_array_equal(est.predict(X), before)


def test_cuda_without_cuda_is_a_clear_error(regression_data, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    X, y = regression_data
    with pytest.raises(ValueError, match="device='cuda'.*no CUDA device"):
        PathKernelMachine(device="cuda", max_iter=1).fit(X, y)


def test_output_shapes_and_probabilities(regression_data):
    X, y = regression_data
    Y2 = np.column_stack([y, -y, 2 * y])
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, random_state=0).fit(X, Y2)
    assert reg.predict(X).shape == (len(X), 3) and reg.n_outputs_ == 3
    assert reg.predict(X).dtype == np.float64
    yc = np.digitize(y, [-0.3, 0.3])
    clf = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, random_state=0).fit(X, yc)
    proba = clf.predict_proba(X)
    assert proba.shape == (len(X), 3)
    assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    assert_array_equal(clf.classes_[proba.argmax(axis=1)], clf.predict(X))
    binary = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, random_state=0)
    binary.fit(X, np.where(y > 0, "pos", "neg"))
    assert binary.decision_function(X).shape == (len(X),)
    assert_array_equal(binary.predict(X),
                       np.where(binary.decision_function(X) > 0, "pos", "neg"))
    sq = PathKernelClassifier(hidden_layer_sizes=(4,), loss="squared_error", max_iter=2,
                              random_state=0).fit(X, yc)
    assert not hasattr(sq, "predict_proba")
    assert sq.predict(X).shape == (len(X),)


def test_one_class_is_rejected(regression_data):
    X, _ = regression_data
    with pytest.raises(ValueError, match="greater than one"):
        PathKernelClassifier(max_iter=1).fit(X, np.zeros(len(X)))


def test_float32_predictions_are_batch_invariant_to_round_off():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(300, 5))
    y = X @ rng.normal(size=5)
    est = PathKernelMachine(hidden_layer_sizes=(64, 64), max_iter=3, random_state=0).fit(X, y)
    full = est.predict(X)
    pieces = np.concatenate([est.predict(X[i : i + 7]) for i in range(0, len(X), 7)])
    assert_allclose(pieces, full, rtol=1e-5, atol=1e-6)
