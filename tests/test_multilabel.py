"""Multilabel indicator targets for PathKernelClassifier, as MLPClassifier has them.

Training against scikit-learn's own ``binary_log_loss`` and a plain autograd step; the
decomposition against the forward per-sample recursion of tests/_reference.py with a
logistic loss written out here (softplus(f) - y f, not the library's); the multilabel
margin's attribution against finite differences of a weighted torch.optim replay.
"""

import copy
import pickle
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from _reference import (
    forward_recursion,
    gauss_nodes,
    jacobian_loop,
    module_at,
    weight_derivative,
)
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.datasets import make_multilabel_classification
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.neural_network._base import LOSS_FUNCTIONS
from sklearn.preprocessing import scale

from skpathkernel import (
    PathKernelClassifier,
    TangentFeatures,
    TangentFeatureSVM,
    TrainedNetwork,
)
from skpathkernel.diagnostics import hessian_trace
from skpathkernel.metrics import retrain_on_subsets


def _data(n=30, n_labels=3, seed=0):
    X, Y = make_multilabel_classification(n_samples=n, n_features=4, n_classes=n_labels,
                                          n_labels=2, random_state=seed)
    return scale(X), Y


def _bce(out, target):
    """Per-sample logistic loss summed over the labels, written out (MLPClassifier's
    ``binary_log_loss`` times n_labels per sample): softplus(f) - y f."""
    target = target.to(out.dtype)
    return (torch.nn.functional.softplus(out) - target * out).sum(dim=1)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


F64 = dict(dtype="float64", tol=None, random_state=0, activation="tanh")
SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate_init=0.2),
    "sgd-momentum-l2": dict(solver="sgd", learning_rate_init=0.1, momentum=0.9, alpha=0.01),
    "adam-l2": dict(solver="adam", learning_rate_init=0.02, alpha=0.01),
}


def _fit(solver="sgd", *, hidden=(6,), max_iter=3, batch_size=8, **params):
    X, Y = _data()
    est = PathKernelClassifier(hidden_layer_sizes=hidden, max_iter=max_iter,
                               batch_size=batch_size, **{**F64, **SOLVERS[solver], **params})
    return est.fit(X, Y), X, Y


# ---------------------------------------------------------------- MLPClassifier's conventions
def test_outputs_follow_mlpclassifier_conventions():
    X, Y = _data(n=80, n_labels=4)
    est = PathKernelClassifier(hidden_layer_sizes=(16,), learning_rate_init=0.02,
                               max_iter=60, tol=None, random_state=0).fit(X, Y)
    mlp = MLPClassifier(hidden_layer_sizes=(16,), max_iter=5, random_state=0)
    with pytest.warns(Warning):
        mlp.fit(X, Y)
    assert_array_equal(est.classes_, mlp.classes_)
    assert est.n_outputs_ == mlp.n_outputs_ == 4
    pred, mlp_pred = est.predict(X), mlp.predict(X)
    assert pred.shape == mlp_pred.shape and pred.dtype == mlp_pred.dtype
    logits = est.decision_function(X)
    assert logits.shape == (80, 4)
    proba = est.predict_proba(X)
    assert proba.shape == mlp.predict_proba(X).shape
    assert_allclose(proba, _sigmoid(logits), rtol=1e-12)
    assert_allclose(est.predict_log_proba(X), np.log(_sigmoid(logits)), rtol=1e-10)
    assert_array_equal(pred, (proba > 0.5).astype(int))
    # score is the subset accuracy (every label of a sample right), sklearn's.
    assert est.score(X, Y) == np.mean(np.all(pred == Y, axis=1))
    assert 0.5 < est.score(X, Y) < 1.0  # it learned, and the test data are not trivial
    # Bool and float indicators are the same targets.
    same = PathKernelClassifier(**est.get_params()).fit(X, Y.astype(bool))
    assert_array_equal(same.decision_function(X), logits)


@pytest.mark.parametrize("loss", ["log_loss", "squared_error"])
def test_one_step_is_gradient_descent_on_the_loss(loss):
    """Full-batch SGD, one step: theta_1 = theta_0 - lr * grad of the mean over samples
    of the per-label losses summed (MLPClassifier's binary_log_loss; +-1 targets per label
    for squared_error), by plain autograd; the loss curve is sklearn's own loss."""
    X, Y = _data()
    est = PathKernelClassifier(hidden_layer_sizes=(5,), solver="sgd", learning_rate_init=0.3,
                               max_iter=1, batch_size=None, loss=loss,
                               **F64).fit(X, Y)
    module = module_at(est, 0)
    out = module(torch.as_tensor(X))
    target = torch.as_tensor(Y, dtype=torch.float64)
    if loss == "log_loss":
        value = _bce(out, target).mean()
        p = _sigmoid(out.detach().numpy())
        assert_allclose(est.loss_curve_[0], LOSS_FUNCTIONS["binary_log_loss"](Y, p),
                        rtol=1e-12)
    else:
        value = (0.5 * (out - (2 * target - 1)) ** 2).mean()
    grads = torch.autograd.grad(value, list(module.parameters()))
    step = torch.cat([g.reshape(-1) for g in grads])
    expected = est.trajectory_.parameters(0) - 0.3 * step
    assert_allclose(est.trajectory_.parameters(1).numpy(), expected.numpy(), rtol=0,
                    atol=1e-14)
    assert_allclose(est.loss_curve_[0], value.item(), rtol=1e-12)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_decomposition_is_exact_and_equals_the_forward_recursion(solver):
    est, X, Y = _fit(solver)
    Xq = X[:4]
    res = est.decompose(Xq)
    assert res.contributions.shape == (4, len(X), 3)
    logits = est.decision_function(Xq)
    assert_allclose(res.prediction, logits, rtol=1e-12)
    recon = res.initial + res.contributions.sum(1) + res.regularization
    assert np.abs(recon - logits).max() < 1e-12 * np.abs(logits).max()
    contrib, reg = forward_recursion(est, X, torch.as_tensor(Y, dtype=torch.float64), _bce, Xq,
                                     nodes=gauss_nodes(6))
    scale_ = np.abs(contrib).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale_)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale_, 1e-3))


def test_tangent_kernel_is_the_trace_kernel_of_the_label_logits():
    est, X, _ = _fit()
    J = jacobian_loop(module_at(est, -1), X[:5]).numpy()  # (n, L, P)
    K = np.einsum("acp,bcp->ab", J, J) / J.shape[1]
    assert_allclose(est.tangent_kernel_(X[:5]), K, rtol=1e-10, atol=1e-12)


def test_attribute_explains_the_signed_sum_of_the_label_logits():
    """The default output: the sum of the labels' logits, each signed by its predicted
    label (+ on, - off); with y, signed by the given labels; output=k: logit k."""
    est, X, Y = _fit("adam-l2", max_iter=4)
    Xq, Yq = X[:5], Y[:5]
    res = est.decompose(Xq)
    logits = est.decision_function(Xq)
    predicted = np.where(logits > 0, 1.0, -1.0)
    given = 2.0 * Yq - 1.0
    assert np.any(predicted != given)  # the two defaults differ on these queries
    scores = est.attribute(Xq)
    assert_allclose(scores, np.einsum("qnc,qc->qn", res.contributions, predicted),
                    rtol=0, atol=1e-12 * np.abs(scores).max())
    # Exact: initial + scores + regularization is the margin itself.
    margin = (predicted * logits).sum(1)
    assert_allclose((predicted * res.initial).sum(1) + scores.sum(1)
                    + (predicted * res.regularization).sum(1), margin, rtol=1e-10)
    assert_allclose(est.attribute(Xq, Yq), np.einsum("qnc,qc->qn", res.contributions, given),
                    rtol=0, atol=1e-12 * np.abs(scores).max())
    assert_allclose(est.attribute(Xq, output=2), res.contributions[:, :, 2], rtol=0,
                    atol=1e-12 * np.abs(scores).max())
    idx, contrib = est.explain(Xq, n_neighbors=4)
    assert_array_equal(idx, np.argsort(-np.abs(scores), axis=1, kind="stable")[:, :4])
    assert_allclose(contrib[:, :, 0], np.take_along_axis(scores, idx, axis=1))


@pytest.mark.parametrize("loss", ["log_loss", "squared_error"])
def test_the_network_explains_the_multilabel_margin_as_its_classifier(loss):
    """network_.attribute / explain / self_influence with output="margin" explain the
    signed sum of the label logits, as the estimator's (they took the softmax margin)."""
    est, X, Y = _fit("adam-l2", max_iter=4, loss=loss)
    net = est.network_
    assert net.multilabel
    Xq, Yq = X[:5], Y[:5]
    # The reference: the decomposition of every logit, signed by hand.
    res = net.decompose(Xq)
    logits = net.outputs(Xq)
    predicted = np.where(logits > 0, 1.0, -1.0)
    scores = net.attribute(Xq, output="margin")
    atol = 1e-12 * np.abs(scores).max()
    assert_allclose(scores, np.einsum("qnc,qc->qn", res.contributions, predicted), rtol=0,
                    atol=atol)
    assert_allclose((predicted * res.initial).sum(1) + scores.sum(1)
                    + (predicted * res.regularization).sum(1), (predicted * logits).sum(1),
                    rtol=1e-10)
    given = net.attribute(Xq, Yq, output="margin")
    assert_allclose(given, np.einsum("qnc,qc->qn", res.contributions, 2.0 * Yq - 1.0),
                    rtol=0, atol=atol)
    assert_array_equal(scores, est.attribute(Xq))
    assert_array_equal(given, est.attribute(Xq, Yq))
    for a, b in zip(net.explain(Xq, 4, output="margin"), est.explain(Xq, n_neighbors=4)):
        assert_array_equal(a, b)
    assert_array_equal(net.self_influence(output="margin"), est.self_influence())
    with pytest.raises(ValueError, match="indicator row"):
        net.attribute(Xq, Yq[:, :2], output="margin")
    with pytest.raises(ValueError, match="0/1"):
        net.attribute(Xq, 2 * Yq, output="margin")
    # Kept by the estimator's pickle, and by the network's own.
    assert pickle.loads(pickle.dumps(est)).network_.multilabel
    assert_array_equal(pickle.loads(pickle.dumps(net)).attribute(Xq, output="margin"), scores)


def test_a_network_built_by_hand_reads_multilabel_from_its_loss():
    est, X, Y = _fit()
    net = est.network_
    # log_loss trains a 2-D target as multilabel: so is its margin.
    built = TrainedNetwork(net.module, net.trajectory, loss="log_loss", X_fit=X, y_fit=Y)
    assert built.multilabel
    assert_array_equal(built.attribute(X[:3], output="margin"),
                       est.attribute(X[:3]))
    # squared_error's 2-D targets may be one-hot classes or regression: it must be said.
    sq = TrainedNetwork(net.module, net.trajectory, loss="squared_error", X_fit=X,
                        y_fit=2.0 * Y - 1.0)
    assert not sq.multilabel
    assert TrainedNetwork(net.module, net.trajectory, loss="squared_error", X_fit=X,
                          y_fit=2.0 * Y - 1.0, multilabel=True).multilabel
    labels = TrainedNetwork(net.module, net.trajectory, loss="log_loss", X_fit=X,
                            y_fit=Y.argmax(1))
    assert not labels.multilabel


def test_soft_and_single_column_targets_are_not_inferred_multilabel():
    """Only a 0/1 indicator of 2+ columns is a label set: soft targets (BCE on
    probabilities, which log_loss's 2-D branch computes) keep the softmax margin, and
    their multilabel margin is refused rather than counting every label as on."""
    est, X, Y = _fit()
    net = est.network_
    soft = np.clip(0.8 * Y + 0.1 + 0.05 * np.arange(Y.shape[1]), 0.0, 1.0)
    built = TrainedNetwork(net.module, net.trajectory, loss="log_loss", X_fit=X, y_fit=soft)
    assert not built.multilabel
    # The reference: the decomposition of every logit weighed by the gradient of the
    # softmax margin f_c - logsumexp_{k != c} f_k of the predicted class c.
    Xq = X[:5]
    res, logits = built.decompose(Xq), built.outputs(Xq)
    c = logits.argmax(1)
    others = np.where(np.arange(logits.shape[1]) == c[:, None], -np.inf, logits)
    grad = -np.exp(others - others.max(1, keepdims=True))
    grad /= -grad.sum(1, keepdims=True)
    grad[np.arange(len(c)), c] = 1.0
    scores = built.attribute(Xq, output="margin")
    assert_allclose(scores, np.einsum("qnc,qc->qn", res.contributions, grad), rtol=0,
                    atol=1e-12 * np.abs(scores).max())
    # Said explicitly, the multilabel margin of soft training targets has no labels.
    explicit = built.replace(multilabel=True)
    with pytest.raises(ValueError, match="0/1 training targets.*soft"):
        explicit.self_influence(output="margin")
    # One column (torch's BCEWithLogits layout of a binary task): not a label set.
    assert not TrainedNetwork(net.module, net.trajectory, loss="log_loss", X_fit=X,
                              y_fit=Y[:, :1]).multilabel
    # Several 0/1 columns stay multilabel, as log_loss trains them.
    assert TrainedNetwork(net.module, net.trajectory, loss="log_loss", X_fit=X,
                          y_fit=Y.astype(np.float32)).multilabel


def test_a_network_pickled_before_multilabel_and_sample_weight_reads_them():
    """An old pickle has neither attribute: replace() needs them in __dict__, and the
    margin is the one a network built from the same arguments has."""
    est, X, Y = _fit()
    net = est.network_
    old = copy.copy(net)
    for name in ("multilabel", "sample_weight"):
        del old.__dict__[name]
    back = pickle.loads(pickle.dumps(old))
    assert back.sample_weight is None
    assert back.multilabel == TrainedNetwork(net.module, net.trajectory, loss="log_loss",
                                             X_fit=X, y_fit=Y).multilabel is True
    w = np.arange(len(X), dtype=np.float64)
    assert_array_equal(back.replace(sample_weight=w).sample_weight, w)
    assert back.replace(multilabel=False).multilabel is False
    assert_array_equal(back.attribute(X[:3], output="margin"), est.attribute(X[:3]))


def _weighted_replay(est, weights, X, Y):
    """The recorded path rerun by torch.optim (SGD with Nesterov momentum and L2) with
    per-point weights in every step's loss (weighted mean over the batch)."""
    traj = est.trajectory_
    module = module_at(est, 0)
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    X, Y, w = torch.as_tensor(X), torch.as_tensor(Y, dtype=torch.float64), torch.as_tensor(
        weights)
    for t, batch in enumerate(traj.batches):
        for group in opt.param_groups:
            group["lr"] = float(traj.learning_rates[t])
        opt.zero_grad()
        rows = torch.as_tensor(batch)
        per = _bce(module(X[rows]), Y[rows])
        ((w[rows] * per).sum() / w[rows].sum()).backward()
        opt.step()
    return module


def test_unrolled_attribute_equals_finite_differences_of_a_weighted_replay():
    est, X, Y = _fit("sgd-momentum-l2", max_iter=3)
    Xq, Yq = X[:3], Y[:3]
    # The reference's replay lands on the recorded path.
    final = [p.detach().reshape(-1) for p in
             _weighted_replay(est, np.ones(len(X)), X, Y).parameters()]
    assert_allclose(torch.cat(final).numpy(), est.trajectory_.parameters(-1).numpy(),
                    rtol=0, atol=1e-12)
    scores = est.attribute(Xq, Yq, method="unrolled")

    def margins(w):  # of the queries' given label sets
        module = _weighted_replay(est, w, X, Y)
        with torch.no_grad():
            return ((2.0 * Yq - 1.0) * module(torch.as_tensor(Xq)).numpy()).sum(1)

    for i in (0, 11, 23):
        assert_allclose(scores[:, i], weight_derivative(margins, len(X), i), rtol=1e-5,
                        atol=1e-9)


def test_retraining_records_the_multilabel_margin_of_the_replayed_models():
    """retrain_on_subsets(protocol="replay"), the counterfactual that linear_datamodeling_score
    compares attribute with: each subset's replay is the weighted torch.optim replay with
    weights 1 on the kept points and 0 on the others (full batch: no step is left empty)."""
    est, X, Y = _fit("sgd-momentum-l2", batch_size=None)
    Xq, Yq = X[:3], Y[:3]
    sub = retrain_on_subsets(est, X, Y, Xq, Yq, n_subsets=2, protocol="replay",
                             random_state=0)
    for mask, outputs in zip(sub.subsets, sub.outputs):
        module = _weighted_replay(est, mask.astype(np.float64), X, Y)
        with torch.no_grad():
            out = module(torch.as_tensor(Xq)).numpy()
        assert_allclose(outputs, ((2.0 * Yq - 1.0) * out).sum(1), rtol=1e-10)
    with pytest.raises(ValueError, match="label columns"):
        retrain_on_subsets(est, X, Y, Xq, Yq[:, :2], n_subsets=2, protocol="replay")
    # The replay's models are this estimator's: targets of another kind are refused (one
    # label column recorded a softmax margin that attribute does not split, silently).
    with pytest.raises(ValueError, match="trained on a multilabel indicator"):
        retrain_on_subsets(est, X, Y[:, 0], Xq, Yq[:, 0], n_subsets=2, protocol="replay")
    labels = Y.argmax(1)
    clf = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=2, **F64).fit(X, labels)
    with pytest.raises(ValueError, match="trained on class labels"):
        retrain_on_subsets(clf, X, Y, Xq, Yq, n_subsets=2, protocol="replay")


def test_self_influence_is_the_margin_of_the_training_label_set():
    est, X, Y = _fit("adam-l2", max_iter=2)
    assert np.any((est.decision_function(X) > 0) != Y)  # labels differ from predictions
    diagonal = np.diag(est.attribute(X, Y, method="unrolled"))
    assert_allclose(est.self_influence(), diagonal, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- training variants
def test_partial_fit_is_fit_over_the_concatenated_stream():
    X, Y = _data(n=40)
    kw = dict(hidden_layer_sizes=(6,), solver="sgd", learning_rate_init=0.1, batch_size=20,
              shuffle=False, **F64)
    est = PathKernelClassifier(**kw)
    est.partial_fit(X[:20], Y[:20], classes=np.arange(3)).partial_fit(X[20:], Y[20:])
    assert_array_equal(est.classes_, [0, 1, 2])
    assert est.X_fit_.shape == (40, 4) and est._Y_fit.shape == (40, 3)
    res = est.decompose(X[:3])
    assert res.error < 1e-12 * np.abs(res.prediction).max()
    # The same two steps as one fit's first epoch on the whole set.
    one = PathKernelClassifier(**{**kw, "max_iter": 1}).fit(X, Y)
    assert_allclose(est.trajectory_.parameters(-1).numpy(),
                    one.trajectory_.parameters(-1).numpy(), rtol=0, atol=1e-15)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_early_stopping_holds_out_without_stratification_and_scores_subset_accuracy():
    # A label combination seen once cannot be stratified; MLPClassifier does not try.
    X, Y = _data(n=40, n_labels=5)
    combos = np.unique(Y, axis=0, return_counts=True)[1]
    assert combos.min() == 1
    est = PathKernelClassifier(hidden_layer_sizes=(8,), learning_rate_init=0.02,
                               early_stopping=True, validation_fraction=0.25, max_iter=30,
                               n_iter_no_change=30, **{**F64, "tol": 1e-4}).fit(X, Y)
    val = np.setdiff1d(np.arange(40), est._train_rows)
    assert len(val) == 10
    pred = est.predict(X[val])
    # The fitted network is the best epoch's: its validation score is that epoch's.
    assert est.best_validation_score_ == np.mean(np.all(pred == Y[val], axis=1))
    assert max(est.validation_scores_) == est.best_validation_score_


def test_pickle_keeps_the_multilabel_outputs():
    est, X, _ = _fit()
    back = pickle.loads(pickle.dumps(est))
    assert_array_equal(back.predict(X), est.predict(X))
    assert_array_equal(back.self_influence(), est.self_influence())


@pytest.mark.parametrize("container", [sp.csr_matrix, sp.csr_array, sp.csc_matrix])
def test_sparse_indicator_targets_are_taken_as_mlpclassifier_takes_them(container):
    """scikit-learn 1.9's MLPClassifier fits a sparse label indicator as its dense
    array; so does this classifier (densified at the boundary), in every entry point."""
    X, Y = _data()
    kw = dict(hidden_layer_sizes=(6,), max_iter=3, batch_size=8, **F64, **SOLVERS["sgd"])
    dense = PathKernelClassifier(**kw).fit(X, Y)
    sparse = PathKernelClassifier(**kw).fit(X, container(Y))
    assert_array_equal(sparse.trajectory_.parameters(-1), dense.trajectory_.parameters(-1))
    assert_array_equal(sparse.predict(X), dense.predict(X))
    assert sparse.score(X, container(Y)) == dense.score(X, Y)
    streamed = PathKernelClassifier(**kw).partial_fit(X[:15], container(Y[:15]),
                                                      classes=np.arange(3))
    streamed.partial_fit(X[15:], container(Y[15:]))
    reference = PathKernelClassifier(**kw).partial_fit(X[:15], Y[:15], classes=np.arange(3))
    reference.partial_fit(X[15:], Y[15:])
    assert_array_equal(streamed.trajectory_.parameters(-1),
                       reference.trajectory_.parameters(-1))
    assert_array_equal(dense.attribute(X[:3], container(Y[:3])),
                       dense.attribute(X[:3], Y[:3]))
    # And its network_'s, as a TrainedNetwork explains the multilabel margin.
    assert_array_equal(dense.network_.attribute(X[:3], container(Y[:3]), output="margin"),
                       dense.attribute(X[:3], Y[:3]))
    full = hessian_trace(dense, X, Y, n_samples=3, random_state=0)
    assert_array_equal(hessian_trace(dense, X, container(Y), n_samples=3,
                                     random_state=0).estimates, full.estimates)
    # As MLPClassifier: the labels of the dense indicator are checked; a sparse column
    # is refused (MLPClassifier's TypeError).
    mlp = MLPClassifier(hidden_layer_sizes=(6,), max_iter=2, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        assert_array_equal(mlp.fit(X, container(Y)).classes_, sparse.classes_)
    with pytest.raises(ValueError, match="0/1"):
        PathKernelClassifier(**kw).fit(X, container(2 * Y))
    with pytest.raises(TypeError, match="Sparse data was passed for y"):
        PathKernelClassifier(**kw).fit(X, container(Y[:, :1]))


def test_hessian_trace_takes_indicator_targets():
    est, X, Y = _fit()
    full = hessian_trace(est, n_samples=4, random_state=0)
    given = hessian_trace(est, X, Y, n_samples=4, random_state=0)
    assert np.isfinite(full.trace) and given.trace == full.trace
    with pytest.raises(ValueError, match="label columns"):
        hessian_trace(est, X, Y[:, :2], n_samples=4, random_state=0)


# ---------------------------------------------------------------- meta-estimators
def test_tangent_features_ride_on_a_multilabel_trainer():
    X, Y = _data()
    trainer = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=5, **F64)
    tf = TangentFeatures(trainer).fit(X, Y)
    assert tf.task_ == "classification"
    assert_array_equal(tf.classes_, [0, 1, 2])
    ref = copy.deepcopy(trainer).fit(X, Y)
    assert_array_equal(tf.transform(X[:4]), ref.transform(X[:4]))
    assert tf.transform(X[:4]).shape == (4, 3 * ref.n_params_)


class _Counting:
    calls = 0

    def __call__(self, n_features, n_outputs):
        _Counting.calls += 1
        return torch.nn.Sequential(torch.nn.Linear(n_features, 4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, n_outputs))


def test_tangent_feature_svm_refuses_multilabel_before_any_work():
    X, Y = _data()
    _Counting.calls = 0
    svm = TangentFeatureSVM(PathKernelClassifier(module=_Counting(), max_iter=2))
    with pytest.raises(ValueError, match="multilabel indicator.*OneVsRestClassifier"):
        svm.fit(X, Y)
    assert _Counting.calls == 0 and not hasattr(svm, "estimator_")


# ---------------------------------------------------------------- bad input
def _state(est, X):
    return (est.trajectory_.parameters(-1).numpy().copy(), est.n_iter_, est.classes_.copy(),
            est._multilabel, est.predict(X).copy(), len(est.X_fit_))


def _assert_same(a, b):
    for u, v in zip(a, b):
        assert_array_equal(u, v)


@pytest.mark.parametrize("case", ["labels_after_multilabel", "multilabel_after_labels",
                                  "warm_labels_after_multilabel", "more_columns",
                                  "fewer_columns", "not_01"])
def test_bad_continuations_are_refused_and_change_nothing(case):
    X, Y = _data()
    labels = Y.sum(1) % 3  # class labels 0..2: encoded against the same classes_
    first, then = {"multilabel_after_labels": (labels, Y)}.get(case, (Y, None))
    est = PathKernelClassifier(hidden_layer_sizes=(5,), max_iter=2,
                               warm_start=case.startswith("warm"), **F64).fit(X, first)
    before = _state(est, X)
    then = {
        "labels_after_multilabel": labels, "warm_labels_after_multilabel": labels,
        "more_columns": np.c_[Y, Y[:, :1]], "fewer_columns": Y[:, :2], "not_01": 2 * Y,
    }.get(case, then)
    match = {"more_columns": "4 label columns", "fewer_columns": "2 label columns",
             "not_01": "0/1"}.get(case, "trained on")
    with pytest.raises(ValueError, match=match):
        if case.startswith("warm"):
            est.fit(X, then)
        else:
            est.partial_fit(X, then)
    _assert_same(_state(est, X), before)


@pytest.mark.parametrize("y, match", [
    (lambda Y: 2 * Y, r"0/1 \(or bool\) indicators; y holds \[2\]"),
    (lambda Y: 2 * Y - 1, r"y holds \[-1\]"),
    (lambda Y: Y + (np.arange(len(Y))[:, None] % 4 == 0), "got multiclass-multioutput"),
])
def test_targets_that_are_not_01_indicators_are_refused(y, match):
    X, Y = _data()
    with pytest.raises(ValueError, match=match):
        PathKernelClassifier(max_iter=1).fit(X, y(Y))


def test_partial_fit_classes_must_be_the_label_columns():
    X, Y = _data()
    est = PathKernelClassifier(max_iter=1)
    with pytest.raises(ValueError, match=r"classes \(partial_fit's.*\[0, 1\]"):
        est.partial_fit(X, Y, classes=[0, 1])
    assert not hasattr(est, "network_")
    with pytest.raises(ValueError, match="classes must be passed"):
        est.partial_fit(X, Y)


def test_query_labels_must_be_indicator_rows_of_the_fitted_columns():
    est, X, Y = _fit()
    with pytest.raises(ValueError, match=r"indicator row per query, shape \(2, 3\)"):
        est.attribute(X[:2], Y[:2, 0])
    with pytest.raises(ValueError, match=r"indicator row per query"):
        est.attribute(X[:2], Y[:2, :2])
    with pytest.raises(ValueError, match="0/1"):
        est.attribute(X[:2], 2 * Y[:2])


def test_sample_weight_with_multilabel_targets():
    """A weighted multilabel fit: every step is the weighted-mean logistic step of the
    independent replay, decompose closes, and attribute is the derivative of the replayed
    margin with respect to a multiplier of each point's weight. One weighted sample is a
    valid multilabel training set (each label is its own binary problem)."""
    X, Y = _data()
    s = np.random.RandomState(1).rand(len(X))
    s[:5] = 0.0
    est = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=3, batch_size=8,
                               **{**F64, **SOLVERS["sgd-momentum-l2"]})
    est.fit(X, Y, sample_weight=s)
    final = [p.detach().reshape(-1) for p in _weighted_replay(est, s, X, Y).parameters()]
    assert_allclose(torch.cat(final).numpy(), est.trajectory_.parameters(-1).numpy(),
                    rtol=0, atol=1e-12)
    assert est.decompose(X[:3]).error < 1e-12
    Xq, Yq = X[:3], Y[:3]
    scores = est.attribute(Xq, Yq, method="unrolled")
    assert_array_equal(scores[:, :5], 0.0)

    def margins(m):
        module = _weighted_replay(est, s * m, X, Y)
        with torch.no_grad():
            return ((2.0 * Yq - 1.0) * module(torch.as_tensor(Xq)).numpy()).sum(1)

    for i in (7, 19):
        assert_allclose(scores[:, i], weight_derivative(margins, len(X), i), rtol=1e-5,
                        atol=1e-9)
    one = np.r_[np.zeros(len(X) - 1), 1.0]
    est = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=2, **F64).fit(
        X, Y, sample_weight=one)
    assert est.predict(X[:2]).shape == (2, Y.shape[1])
