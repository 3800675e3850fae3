"""fit / partial_fit with sample_weight: each batch's loss is the weighted mean over it,
the trajectory records the normalized weights, and decompose and attribute stay exact
against the independent references of tests/_reference.py, which compute every sample's
weight ``s_i / sum_batch s`` from the weights themselves."""

import copy
import pickle
import warnings

import numpy as np
import pytest
import sklearn
import torch
from _reference import (
    forward_recursion,
    gauss_nodes,
    unrolled_reference,
    unrolled_replay,
    weight_finite_differences,
)
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import GridSearchCV, KFold, StratifiedKFold, cross_val_score
from sklearn.svm import SVC

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
    Trajectory,
)
from skpathkernel._estimators._features import AUTO_C, _choose_C
from skpathkernel._path._losses import LOSSES
from skpathkernel._path._mlp_step import MLPGradient
from skpathkernel._path._trajectory import SolverSpec, TrajectoryRecorder
from skpathkernel.metrics import _replay


def _data(n=24, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 3))
    y = np.sin(X[:, 0]) + X[:, 1] - 0.5 * X[:, 2] ** 2
    w = rng.uniform(0.2, 3.0, size=n)
    w[[1, 5, 11]] = 0.0  # zero-weight points must work (and own nothing)
    return X, y, w


BASE = dict(hidden_layer_sizes=(6,), max_iter=3, tol=None, dtype="float64", random_state=0,
            batch_size=8)
REG = dict(BASE, normalize_y=False)  # the references train on y itself
SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate_init=0.1),
    "sgd-nesterov-l2": dict(solver="sgd", momentum=0.9, alpha=0.01, learning_rate_init=0.05),
    "sgd-heavy-ball": dict(solver="sgd", momentum=0.9, nesterovs_momentum=False,
                           learning_rate_init=0.05),
    "adam-l2": dict(solver="adam", alpha=0.01, learning_rate_init=0.02),
}


def _squared(out, t):
    return 0.5 * ((out - t) ** 2).mean(dim=1)


def _betas(traj):
    return np.concatenate([traj.batch_weights(t) for t in range(traj.n_steps)])


# ------------------------------------------------------------------ today's path
@pytest.mark.parametrize("cls", [PathKernelMachine, PathKernelClassifier])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_equal_weights_are_the_unweighted_fit_bit_for_bit(cls, dtype):
    X, y, _ = _data()
    y = y if cls is PathKernelMachine else (y > 0).astype(int)
    params = dict(BASE, dtype=dtype, solver="adam", learning_rate_init=0.01)
    plain = cls(**params).fit(X, y)
    for weights in (np.ones(len(X)), np.full(len(X), 2.5), [3] * len(X)):
        est = cls(**params).fit(X, y, sample_weight=weights)
        assert est.trajectory_._batch_weights is None
        assert_array_equal(est.trajectory_.parameters(-1), plain.trajectory_.parameters(-1))
        assert est.loss_curve_ == plain.loss_curve_


# ------------------------------------------------------------------ the training rule
def test_each_step_takes_the_weighted_mean_of_its_batch():
    """Every recorded step is torch.optim's step on the loss sum_i s_i l_i / sum_i s_i
    over the recorded batch (a plain autograd step, rerun here), and the recorded batch
    weights are those s_i / sum s."""
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS["sgd"]).fit(X, y, sample_weight=w)
    traj = est.trajectory_
    module = copy.deepcopy(est.module_)
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y).reshape(-1, 1)
    for t, batch in enumerate(traj.batches):
        assert_allclose(traj.batch_weights(t), w[batch] / w[batch].sum(), rtol=1e-15)
        module.load_state_dict(traj.state_dict(t))
        module.zero_grad()
        s = torch.as_tensor(w[batch])
        per = _squared(module(Xt[batch]), Yt[batch])
        ((s * per).sum() / s.sum()).backward()
        with torch.no_grad():
            stepped = torch.cat([(p - 0.1 * p.grad).reshape(-1) for p in module.parameters()])
        assert_allclose(stepped, traj.parameters(t + 1), rtol=0, atol=1e-14)


def test_the_epoch_loss_is_the_weighted_average_as_mlp():
    """Full batch: the epoch loss is np.average of the per-sample losses at theta_0."""
    X, y, w = _data()
    est = PathKernelMachine(**{**REG, "batch_size": None}, **SOLVERS["sgd"]).fit(
        X, y, sample_weight=w)
    module = copy.deepcopy(est.module_)
    module.load_state_dict(est.trajectory_.state_dict(0))
    with torch.no_grad():
        per = 0.5 * (module(torch.as_tensor(X))[:, 0].numpy() - y) ** 2
    assert_allclose(est.loss_curve_[0], np.average(per, weights=w), rtol=1e-13)


@pytest.mark.usefixtures("unrolled_route")
def test_a_batch_weighing_zero_has_no_data_gradient():
    X, y, w = _data()
    w[:8] = 0.0  # the first batch of every epoch, unshuffled
    est = PathKernelMachine(**{**REG, "shuffle": False}, **SOLVERS["sgd"]).fit(
        X, y, sample_weight=w)
    traj = est.trajectory_
    assert_array_equal(traj.batch_weights(0), np.zeros(8))
    # Plain SGD without weight decay: a step with no data gradient does not move.
    assert_array_equal(traj.parameters(0), traj.parameters(1))
    assert not np.array_equal(traj.parameters(1), traj.parameters(2))
    assert est.decompose(X[:3]).error < 1e-12
    # attribute: the zero-weight batch's points own nothing there (not 0/0); the rest as
    # autograd through the independent weighted replay and central finite differences.
    scores = np.asarray(est.attribute(X[:3], method="unrolled"))
    assert np.isfinite(scores).all()
    ref = unrolled_reference(est.network_, X[:3], np.ones((3, 1)), sample_weight=w)
    assert np.abs(scores - ref).max() <= 1e-8 * np.abs(ref).max()
    assert_array_equal(scores[:, :8], 0.0)
    fd = weight_finite_differences(est.network_, X[:2], (0, 9, 13), w)
    assert_allclose(scores[:2, [0, 9, 13]], fd, rtol=1e-5, atol=1e-9)


def test_weights_are_relative_and_alpha_is_not_weighted():
    X, y, w = _data()
    params = dict(BASE, **SOLVERS["sgd-nesterov-l2"])
    a = PathKernelMachine(**params).fit(X, y, sample_weight=w)
    b = PathKernelMachine(**params).fit(X, y, sample_weight=10 * w)
    assert_allclose(a.predict(X), b.predict(X), rtol=1e-12)


@pytest.mark.parametrize("loss,n_classes", [("squared_error", 0), ("log_loss", 2),
                                            ("log_loss", 3), ("log_loss", "multilabel")])
def test_hand_written_weighted_gradient_is_autograds(loss, n_classes):
    torch.manual_seed(0)
    # Two regression outputs: the squared error's mean over outputs is in the gradient.
    n_out = {0: 2, 2: 1, "multilabel": 3}.get(n_classes, n_classes)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.GELU(),
                                 torch.nn.Linear(5, n_out))
    X = torch.randn(7, 3)
    if n_classes == 0:
        Y = torch.randn(7, 2)
    elif n_classes == 2:
        Y = torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.float32)
    elif n_classes == "multilabel":  # a 0/1 indicator, as fit passes it
        Y = torch.randint(0, 2, (7, 3)).to(torch.float32)
    else:
        Y = torch.tensor([0, 1, 2, 0, 2, 1, 0])
    beta = torch.rand(7)
    beta = beta / beta.sum()
    lossf = LOSSES[loss]()
    gradient = MLPGradient.build(module, lossf, X)
    assert gradient is not None
    value = gradient(X, Y, beta)
    hand = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    ref = lossf.weighted(module(X), Y, beta)
    ref.backward()
    torch.testing.assert_close(value, ref.detach(), rtol=1e-6, atol=0)
    for h, p in zip(hand, module.parameters()):
        torch.testing.assert_close(h, p.grad, rtol=1e-5, atol=1e-7)


def test_the_autograd_step_and_the_hand_written_one_give_the_same_path():
    """The same network trained by the hand-written gradient and, behind a forward hook
    (which makes MLPGradient.build refuse it), by autograd: the same weighted path."""
    X, y, w = _data()
    calls = []

    def module(n_in, n_out, hooked=False):
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(n_in, 6), torch.nn.Tanh(),
                                  torch.nn.Linear(6, n_out))
        if hooked:
            net[0].register_forward_hook(lambda *args: calls.append(1))
        return net

    def hooked(n_in, n_out):
        return module(n_in, n_out, hooked=True)

    fits = [PathKernelMachine(**REG, **SOLVERS["adam-l2"], module=m).fit(
        X, y, sample_weight=w) for m in (module, hooked)]
    assert calls
    assert_allclose(fits[0].trajectory_.parameters(-1), fits[1].trajectory_.parameters(-1),
                    rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_weighted_decompose_is_exact_against_the_forward_recursion(solver):
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS[solver]).fit(X, y, sample_weight=w)
    Xq = X[:4]
    res = est.decompose(Xq)
    assert res.error < 1e-12
    assert_allclose(res.reconstruction, est.predict(Xq).reshape(-1, 1), rtol=0, atol=1e-12)
    contrib, reg = forward_recursion(est, X, torch.as_tensor(y).reshape(-1, 1), _squared, Xq,
                                     nodes=gauss_nodes(6), sample_weight=w)
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))
    # A point of zero weight owns nothing, exactly.
    assert_array_equal(res.contributions[:, w == 0], 0.0)


def test_weighted_classifier_decompose_is_exact():
    X, y, w = _data(n=30)
    labels = np.digitize(y, [-0.5, 0.5])
    est = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"]).fit(X, labels, sample_weight=w)
    res = est.decompose(X[:3])
    assert res.error < 1e-12
    assert_array_equal(res.contributions[:, w == 0], 0.0)


@pytest.mark.parametrize("solver", ["sgd-nesterov-l2", "sgd-heavy-ball", "adam-l2"])
def test_weighted_attribute_equals_autograd_through_the_replay(solver):
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS[solver]).fit(X, y, sample_weight=w)
    net = est.network_
    final = torch.cat([p.detach().reshape(-1) for p in unrolled_replay(net, None, w).values()])
    assert_allclose(final, est.trajectory_.parameters(-1), rtol=0, atol=1e-12)
    scores = est.attribute(X[:3], method="unrolled")
    ref = unrolled_reference(net, X[:3], np.ones((3, 1)), sample_weight=w)
    assert np.abs(scores - ref).max() <= 1e-8 * np.abs(ref).max()
    assert_array_equal(np.asarray(scores)[:, w == 0], 0.0)


def test_weighted_attribute_equals_finite_differences_of_a_point_weight():
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS["sgd-nesterov-l2"]).fit(X, y, sample_weight=w)
    scores = est.attribute(X[:2], method="unrolled")
    fd = weight_finite_differences(est.network_, X[:2], (0, 7, 13), w)
    assert_allclose(scores[:, [0, 7, 13]], fd, rtol=1e-5, atol=1e-9)


def test_replay_protocol_keeps_the_recorded_weights():
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS["adam-l2"]).fit(X, y, sample_weight=w)
    # Keeping every point replays the trained network.
    assert_allclose(_replay(est, np.ones(len(X), bool)).predict(X), est.predict(X),
                    rtol=0, atol=1e-12)
    # Leaving point 3 out is the training with its weight 0 (the others' renormalized).
    keep = np.ones(len(X), bool)
    keep[3] = False
    ref = unrolled_replay(est.network_, None, w * keep)
    module = copy.deepcopy(est.module_)
    module.load_state_dict({k: v.detach() for k, v in ref.items()})
    with torch.no_grad():
        expected = module(torch.as_tensor(X))[:, 0].numpy()
    assert_allclose(_replay(est, keep).predict(X), expected, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ continued paths
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_partial_fit_mixes_weighted_and_unweighted_calls(storage, tmp_path):
    X, y, w = _data(n=30)
    est = PathKernelMachine(**REG, **SOLVERS["adam-l2"], trajectory_storage=storage,
                            trajectory_dir=tmp_path)
    parts = [slice(0, 10), slice(10, 20), slice(20, 30)]
    weights = [w[:10], None, w[20:]]
    for part, weight in zip(parts, weights):
        est.partial_fit(X[part], y[part], sample_weight=weight)
    traj = est.trajectory_
    # The whole stream's weights; an unweighted call's are equal (the batch mean).
    stream = np.concatenate([np.ones(10) if wt is None else wt for wt in weights])
    for t in range(traj.n_steps):
        s = stream[traj.batch(t)]
        assert_allclose(traj.batch_weights(t), s / s.sum(), rtol=1e-15)
    res = est.decompose(X[:3])
    assert res.error < 1e-12
    contrib, _ = forward_recursion(est, X, torch.as_tensor(y).reshape(-1, 1), _squared, X[:3],
                                   nodes=gauss_nodes(6), sample_weight=stream)
    assert_allclose(res.contributions, contrib, rtol=0,
                    atol=1e-10 * np.abs(contrib).max())
    if storage == "disk":
        loaded = Trajectory.load(traj.directory)
        assert_array_equal(_betas(loaded), _betas(traj))


def test_warm_start_unweighted_after_weighted_keeps_both_weightings():
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS["sgd"], warm_start=True)
    est.fit(X, y, sample_weight=w)
    n_first = est.trajectory_.n_steps
    first = _betas(est.trajectory_)
    est.fit(X, y)
    traj = est.trajectory_
    assert_array_equal(_betas(traj)[: len(first)], first)
    for t in range(n_first, traj.n_steps):
        assert_array_equal(traj.batch_weights(t), np.full(len(traj.batch(t)),
                                                          1 / len(traj.batch(t))))
    assert est.decompose(X[:3]).error < 1e-12


def test_classifier_partial_fit_takes_mlps_positional_order():
    """MLPClassifier (sklearn >= 1.7): partial_fit(X, y, sample_weight, classes). Weights
    passed positionally train weighted on every call (the recorded betas are s / sum s),
    and a later call's classes must be the fitted ones, as sklearn checks."""
    X, y, w = _data()
    labels = (y > 0).astype(int)
    params = dict(BASE, **SOLVERS["sgd"], shuffle=False)
    est = PathKernelClassifier(**params).partial_fit(X[:16], labels[:16], w[:16], [0, 1])
    est.partial_fit(X[16:], labels[16:], w[16:])
    ref = PathKernelClassifier(**params).partial_fit(X[:16], labels[:16], classes=[0, 1],
                                                     sample_weight=w[:16])
    ref.partial_fit(X[16:], labels[16:], sample_weight=w[16:])
    assert_array_equal(est.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    traj = est.trajectory_
    for t in range(traj.n_steps):
        s = w[traj.batch(t)]
        assert_allclose(traj.batch_weights(t), s / s.sum(), rtol=1e-15)
    before = est.trajectory_
    with pytest.raises(ValueError, match="classes"):
        est.partial_fit(X[:4], labels[:4], None, [0, 1, 2])
    assert est.trajectory_ is before
    est.partial_fit(X[:4], labels[:4], classes=np.array([1, 0]))  # the same classes


# ------------------------------------------------------------------ early stopping
@pytest.mark.parametrize("multilabel", [False, True])
def test_early_stopping_scores_the_held_out_samples_with_their_weights(multilabel):
    X, y, w = _data(n=60)
    labels = (y > 0).astype(int)
    if multilabel:  # subset accuracy, weighted
        labels = np.c_[labels, X[:, 0] > 0].astype(int)
    est = PathKernelClassifier(**{**BASE, "max_iter": 4}, **SOLVERS["adam-l2"],
                               early_stopping=True, validation_fraction=0.3).fit(
        X, labels, sample_weight=w)
    val = np.setdiff1d(np.arange(len(X)), est._train_rows)
    assert est.best_validation_score_ == pytest.approx(
        est.score(X[val], labels[val], sample_weight=w[val]), abs=1e-15)
    assert est.decompose(X[:2]).error < 1e-12


def test_regressor_early_stopping_scores_weighted_r2():
    """The validation score is R^2 weighted by the held-out weights (MLPRegressor's)."""
    X, y, w = _data(n=60)
    est = PathKernelMachine(**{**REG, "max_iter": 4}, **SOLVERS["adam-l2"],
                            early_stopping=True, validation_fraction=0.3).fit(
        X, y, sample_weight=w)
    val = np.setdiff1d(np.arange(len(X)), est._train_rows)
    res = y[val] - est.predict(X[val])
    mean = np.average(y[val], weights=w[val])
    r2 = 1 - np.sum(w[val] * res**2) / np.sum(w[val] * (y[val] - mean) ** 2)
    assert est.validation_scores_[-1] == pytest.approx(r2, rel=1e-12)
    assert est.validation_scores_[-1] != pytest.approx(
        1 - np.sum(res**2) / np.sum((y[val] - y[val].mean()) ** 2), rel=1e-6)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("weights,match", [
    (-np.ones(24), "Negative values"),
    (np.ones(23), "(?i)sample.weight"),
    (np.ones((24, 2)), "(?i)sample.weight"),
    (np.zeros(24), "zero"),
])
def test_bad_weights_are_refused_and_the_fit_kept(weights, match):
    X, y, _ = _data()
    est = PathKernelMachine(**REG, **SOLVERS["sgd"]).fit(X, y)
    before = est.trajectory_
    with pytest.raises(ValueError, match=match):
        est.fit(X, y, sample_weight=weights)
    assert est.trajectory_ is before
    with pytest.raises(ValueError, match=match):
        est.partial_fit(X, y, sample_weight=weights)
    assert est.trajectory_ is before


def test_weights_leaving_one_class_are_refused():
    X, y, _ = _data(n=30)
    labels = (y > 0).astype(int)
    with pytest.raises(ValueError, match=r"those of class 1: "):
        PathKernelClassifier(**BASE).fit(X, labels, sample_weight=labels.astype(float))
    with pytest.raises(ValueError, match=r"those of class 'b': "):
        PathKernelClassifier(**BASE).fit(X, np.where(labels, "b", "a"),
                                         sample_weight=labels.astype(float))
    # Early stopping: the network learns from the training part, which must keep two
    # classes with positive weight (one class-0 row weighted, held out by this split).
    w = labels.astype(float)
    es = dict(BASE, early_stopping=True, validation_fraction=0.2, random_state=0)
    from_split = PathKernelClassifier(**es).fit(X, labels)._train_rows
    w[np.setdiff1d(np.flatnonzero(labels == 0), from_split)[0]] = 1.0
    with pytest.raises(ValueError, match="training part but those of class 1"):
        PathKernelClassifier(**es).fit(X, labels, sample_weight=w)


# ------------------------------------------------------------------ model selection
def test_grid_search_and_cross_val_score_route_sample_weight():
    X, y, w = _data(n=40)
    labels = (y > 0).astype(int)
    est = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        search = GridSearchCV(est, {"alpha": [0.0, 0.1]}, cv=2).fit(X, labels,
                                                                    sample_weight=w)
        scores = cross_val_score(est, X, labels, cv=KFold(2),
                                 params={"sample_weight": w})
    assert search.best_estimator_.trajectory_._batch_weights is not None
    # The weights reach each fold's fit: the first fold's model is the weighted fit.
    train = np.arange(20, 40)
    direct = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"]).fit(
        X[train], labels[train], sample_weight=w[train])
    assert scores[0] == direct.score(X[:20], labels[:20])


def test_the_recorder_fills_the_mean_for_unweighted_steps_around_weighted_ones():
    """Weights given from the second step on: the first step (and the last, unweighted)
    weigh 1 / |B| each, as Trajectory.batch_weights reads an unweighted path."""
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    rec = TrajectoryRecorder([p], ["p"], n_steps=3, record_every=1, solver=SolverSpec("sgd"),
                             n_samples=7, batch_size=2, dtype=torch.float64)
    rec.record_point(0)
    batches = [np.array([0, 1]), np.array([2, 3, 4]), np.array([5, 6])]
    weights = [None, np.array([0.5, 0.25, 0.25]), None]
    for step, (batch, w) in enumerate(zip(batches, weights)):
        rec.record_batch(batch, w)
        rec.record_step(step, 0.1, None)
        rec.record_point(step + 1)
    traj = rec.finish(3)
    assert_array_equal(traj.batch_weights(0), [0.5, 0.5])
    assert_array_equal(traj.batch_weights(1), [0.5, 0.25, 0.25])
    assert_array_equal(traj.batch_weights(2), [0.5, 0.5])


def test_normalize_y_standardizes_with_the_weighted_moments():
    """A sample of weight 2 counts as two, as in StandardScaler(sample_weight=...)."""
    X, y, w = _data()
    est = PathKernelMachine(**BASE, **SOLVERS["sgd"]).fit(X, y, sample_weight=w)
    repeated = np.repeat(y, np.round(4 * w).astype(int))  # w on a grid of 1/4
    est4 = PathKernelMachine(**BASE, **SOLVERS["sgd"]).fit(
        X, y, sample_weight=np.round(4 * w) / 4)
    assert_allclose(est4._y_mean, [repeated.mean()], rtol=1e-14)
    assert_allclose(est4._y_scale, [repeated.std()], rtol=1e-14)
    assert not np.allclose(est._y_mean, y.mean())


# ------------------------------------------------------------------ meta-estimators
def test_tangent_features_pass_the_weights_to_the_trainer():
    X, y, w = _data()
    tf = TangentFeatures(PathKernelMachine(**REG, **SOLVERS["sgd"])).fit(X, y, sample_weight=w)
    direct = PathKernelMachine(**REG, **SOLVERS["sgd"]).fit(X, y, sample_weight=w)
    assert_array_equal(tf.trajectory_.parameters(-1), direct.trajectory_.parameters(-1))
    assert_array_equal(tf.transform(X[:3]), direct.transform(X[:3]))


@pytest.mark.parametrize("task", ["classification", "regression", "reconstruction"])
def test_ood_detector_passes_the_weights_to_the_trainer(task):
    X, y, w = _data()
    if task == "classification":
        trainer, target = PathKernelClassifier(**BASE, **SOLVERS["sgd"]), (y > 0).astype(int)
    else:
        trainer = PathKernelMachine(**REG, **SOLVERS["adam-l2"])
        target = y if task == "regression" else None
    det = OODRankDetector(trainer, method="residual").fit(X, target, sample_weight=w)
    # The trainer fitted directly with the same weights (the reconstruction's targets
    # are X itself): the same path, bit for bit.
    direct = clone(trainer).fit(X, X if target is None else target, sample_weight=w)
    assert det.task_ == task
    assert_array_equal(det.trajectory_.parameters(-1), direct.trajectory_.parameters(-1))
    assert_array_equal(_betas(det.trajectory_), _betas(direct.trajectory_))
    unweighted = clone(trainer).fit(X, X if target is None else target)
    assert not np.array_equal(det.trajectory_.parameters(-1),
                              unweighted.trajectory_.parameters(-1))
    # The span is the training points' of positive weight (weight 0: absent).
    assert_array_equal(det.X_fit_, X[w > 0])
    # In the span: residual ~0 (the jitter, rtol=1e-6 relative), as every training point.
    assert det.score_samples(X[w > 0]).min() > -1e-4


@pytest.mark.parametrize("reconstruct", [False, True])
def test_ood_detector_with_0_1_weights_is_the_detector_of_the_kept_rows(reconstruct):
    """scikit-learn's contract where a span can keep it: weight 0 is a removed row."""
    X, y, w = _data()
    w = (w > 0).astype(np.float64)
    target = None if reconstruct else y
    # Full batch: a minibatch holds other rows once the zero-weight ones are dropped.
    trainer = PathKernelMachine(**{**REG, "batch_size": len(X)})
    det = OODRankDetector(trainer, random_state=0).fit(X, target, sample_weight=w)
    kept = OODRankDetector(trainer, random_state=0).fit(
        X[w > 0], None if reconstruct else y[w > 0])
    # To rounding (the trainer's weighted mean vs the plain one): ~3e-13 measured.
    assert_allclose(det.decision_function(X), kept.decision_function(X), rtol=0, atol=1e-9)
    assert_allclose(det.offset_, kept.offset_, rtol=0, atol=1e-9)


def test_ood_detector_validates_the_weights_of_a_frozen_trainer():
    X, y, w = _data()
    fitted = PathKernelMachine(**REG, **SOLVERS["sgd"]).fit(X, y)
    # Positive weights do not weigh the span: only the zeros count (rows left out).
    frozen = OODRankDetector(FrozenEstimator(fitted)).fit(X, sample_weight=w)
    plain = OODRankDetector(FrozenEstimator(fitted)).fit(X[w > 0])
    assert frozen.offset_ == plain.offset_
    assert_array_equal(frozen.X_fit_, X[w > 0])
    with pytest.raises(ValueError, match="Negative"):
        OODRankDetector(FrozenEstimator(fitted)).fit(X, sample_weight=-w)
    with pytest.raises(ValueError, match="shape"):
        OODRankDetector(PathKernelMachine(**REG)).fit(X, y, sample_weight=w[:-1])


class _NoWeightsTrainer(PathKernelClassifier):
    """A user's trainer whose fit takes no sample_weight (as before weights existed)."""

    def fit(self, X, y):
        return super().fit(X, y)


def test_meta_estimators_call_a_trainer_without_weights_as_before():
    X, y, _ = _data(n=30)
    labels = (y > 0).astype(int)
    trainer = _NoWeightsTrainer(**BASE, **SOLVERS["sgd"])
    direct = PathKernelClassifier(**BASE, **SOLVERS["sgd"]).fit(X, labels)
    for meta in (TangentFeatures(trainer), TangentFeatureSVM(trainer, C=1.0)):
        meta.fit(X, labels)
        assert_array_equal(meta.trajectory_.parameters(-1), direct.trajectory_.parameters(-1))
        # Equal weights are no weights: the trainer is called without them either.
        meta.fit(X, labels, sample_weight=np.full(len(X), 3.0))
        assert_array_equal(meta.trajectory_.parameters(-1), direct.trajectory_.parameters(-1))


@pytest.mark.parametrize("C", [1.0, "auto"])
def test_tangent_feature_svm_weights_the_trainer_and_the_svm(C):
    X, y, w = _data(n=40)
    labels = (y > 0).astype(int)
    net = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"])
    svm = TangentFeatureSVM(net, C=C).fit(X, labels, sample_weight=w)
    direct = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"]).fit(X, labels, sample_weight=w)
    assert_array_equal(svm.trajectory_.parameters(-1), direct.trajectory_.parameters(-1))
    # The SVM: an SVC on the normalized tangent Gram with the weights rescaled to mean 1,
    # rounded as the fit rounds them: libsvm stops at tol=1e-3, and weights up to 2 ulps
    # apart ((w * n) / sum against w * (n / sum)) moved its dual coefficients by 5e-4 on
    # an AMD EPYC (the Intel hosts happened to give the same coefficients).
    gram = TangentKernel(direct, normalized=True)(X)
    ref = SVC(kernel="precomputed", C=svm.C_).fit(gram, labels,
                                                  sample_weight=w * (len(w) / w.sum()))
    assert_allclose(svm.svm_.dual_coef_, ref.dual_coef_, rtol=1e-10, atol=1e-12)
    assert_array_equal(svm.svm_.support_, ref.support_)
    # Equal weights are the unweighted fit.
    plain = TangentFeatureSVM(net, C=C).fit(X, labels)
    same = TangentFeatureSVM(net, C=C).fit(X, labels, sample_weight=np.full(len(X), 7.0))
    assert_array_equal(plain.decision_function(X), same.decision_function(X))


def _reference_C(gram, labels, w):
    """A reference loop: StratifiedKFold(3), SVC per fold with the fold's weights, the
    hits averaged with the held-out weights, the smallest C among the best; folds whose
    training part has one class of positive weight (or held-out part none) not scored."""
    scale = np.mean(np.diag(gram))
    scores = []
    for C in AUTO_C:
        fold_scores = []
        for tr, te in StratifiedKFold(3).split(gram, labels):
            if len(set(labels[tr][w[tr] > 0])) < 2 or w[te].sum() == 0:
                continue
            svc = SVC(kernel="precomputed", C=C / scale).fit(gram[np.ix_(tr, tr)], labels[tr],
                                                             sample_weight=w[tr])
            hits = svc.predict(gram[np.ix_(te, tr)]) == labels[te]
            fold_scores.append(np.sum(hits * w[te]) / np.sum(w[te]))
        scores.append(np.mean(fold_scores) if fold_scores else 0.0)
    return AUTO_C[int(np.argmax(scores))] / scale


def test_choose_C_scores_folds_by_weighted_accuracy():
    # Data on which scoring the weighted folds unweighted chooses another C.
    rng = np.random.RandomState(1)
    F = rng.normal(size=(30, 4))
    labels = (F[:, 0] + 0.8 * rng.normal(size=30) > 0).astype(int)
    w = rng.choice([0.05, 1.0, 5.0], size=30)
    gram = F @ F.T
    assert _choose_C(gram, labels, w) == pytest.approx(_reference_C(gram, labels, w),
                                                       rel=1e-15)
    # Weighted and unweighted choices differ on these data (the weights matter).
    assert _choose_C(gram, labels, w) != _choose_C(gram, labels)


def test_choose_C_skips_folds_left_with_one_weighted_class():
    """Class 1 has positive weight on its first 3 rows only: the first fold's training
    part weighs class 1 at 0 (libsvm refuses it); C="auto" scores the other folds."""
    X, y, _ = _data(n=30)
    labels = (X[:, 0] > 0).astype(int)
    w = np.ones(30)
    w[np.flatnonzero(labels == 1)[3:]] = 0.0
    net = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"])
    svm = TangentFeatureSVM(net, C="auto").fit(X, labels, sample_weight=w)
    gram = TangentKernel(svm.estimator_, normalized=True)(X)
    assert svm.C_ == pytest.approx(_reference_C(gram, labels, w), rel=1e-12)
    # No fold left: every weight in the first fold's held-out part, so that fold's
    # training part weighs nothing and the others' held-out parts nothing: 1 / scale.
    w1 = np.zeros(30)
    w1[next(StratifiedKFold(3).split(gram, labels))[1]] = 1.0
    assert _choose_C(gram, labels, w1) == pytest.approx(1 / np.mean(np.diag(gram)), rel=1e-15)


def test_weights_survive_pickle_and_save(tmp_path):
    X, y, w = _data()
    est = PathKernelMachine(**REG, **SOLVERS["adam-l2"]).fit(X, y, sample_weight=w)
    back = pickle.loads(pickle.dumps(est))
    assert_array_equal(_betas(back.trajectory_), _betas(est.trajectory_))
    assert back.decompose(X[:2]).error < 1e-12
    est.trajectory_.save(tmp_path / "path.pt")
    assert_array_equal(_betas(Trajectory.load(tmp_path / "path.pt")), _betas(est.trajectory_))


def test_metadata_routing_requests_sample_weight():
    X, y, w = _data(n=40)
    labels = (y > 0).astype(int)
    with sklearn.config_context(enable_metadata_routing=True):
        est = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"]).set_fit_request(
            sample_weight=True).set_score_request(sample_weight=False)
        scores = cross_val_score(est, X, labels, cv=KFold(2), params={"sample_weight": w})
    train = np.arange(20, 40)
    direct = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"]).fit(
        X[train], labels[train], sample_weight=w[train])
    assert scores[0] == direct.score(X[:20], labels[:20])


def _token_module(n_features, n_outputs):
    return torch.nn.Sequential(torch.nn.Embedding(6, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * n_features, n_outputs))


def test_token_ids_train_with_weights_in_the_parameters_dtype():
    """Integer X (token ids, autograd's step): the weights take the parameters' dtype."""
    rng = np.random.RandomState(0)
    X = rng.randint(0, 6, size=(20, 4))
    y = (X[:, 0] > 2).astype(int)
    w = rng.uniform(0, 2, size=20)
    est = PathKernelClassifier(**BASE, **SOLVERS["adam-l2"], module=_token_module).fit(
        X, y, sample_weight=w)
    traj = est.trajectory_
    for t in range(traj.n_steps):
        s = w[traj.batch(t)]
        assert_allclose(traj.batch_weights(t), s / s.sum(), rtol=1e-15)
    assert est.decompose(X[:3]).error < 1e-12
