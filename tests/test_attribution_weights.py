"""``attribute(output=w)``: the attribution of a weighted sum of the outputs,
``sum_c w_c f_c(x)``, given as a weight vector (every query) or matrix (one row per query).

References: autograd through an unrolled replay with the contracted output
(tests/_reference.py), central differences of torch.optim's weighted replay and of
``sample_weight`` refits, forward passes of the recorded first and last points (the
exact split adds up to the weighted prediction), the margin's weights by autograd, and a
query-by-query loop.
"""

import numpy as np
import pytest
import torch
from _reference import (
    module_at,
    own_loop,
    torch_optim_replay,
    unrolled_reference,
    weight_derivative,
)
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernelClassifier, PathKernelMachine

W3 = np.array([0.7, -1.3, 0.4])


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(30, 3))
    return X, np.digitize(X[:, 0] + 0.5 * X[:, 1], [-0.5, 0.5])


@pytest.fixture(scope="module")
def clf(data):
    X, y = data
    return PathKernelClassifier(hidden_layer_sizes=(6,), activation="tanh", solver="adam",
                                learning_rate_init=0.05, batch_size=10, max_iter=3,
                                alpha=0.01, dtype="float64", random_state=0,
                                tol=None).fit(X, y)


def _rel(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def _margin_weights_autograd(logits, labels):
    """d/df (f_y - logsumexp_{k != y} f_k) at the logits, by autograd."""
    f = torch.tensor(logits, requires_grad=True)
    y = torch.as_tensor(labels)
    others = f.masked_fill(torch.nn.functional.one_hot(y, f.shape[1]).bool(), -torch.inf)
    (f.gather(1, y[:, None])[:, 0] - torch.logsumexp(others, dim=1)).sum().backward()
    return f.grad.numpy()


@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_weights_are_that_sum_of_the_per_output_scores(clf, data, method):
    X, _ = data
    Xq = X[:5]
    per_output = np.stack([np.asarray(clf.attribute(Xq, output=c, method=method))
                           for c in range(3)], axis=2)  # (Q, N, C)
    scores = clf.attribute(Xq, output=W3, method=method)
    assert scores.shape == (5, len(X)) and scores.dtype == np.float64
    assert_allclose(scores, per_output @ W3, rtol=0, atol=1e-13 * np.abs(scores).max())
    # A list, and a matrix of the same row for every query, are the same weights.
    assert_array_equal(clf.attribute(Xq, output=list(W3), method=method), scores)
    assert_array_equal(clf.attribute(Xq, output=np.tile(W3, (5, 1)), method=method), scores)
    # A one-hot weight vector is the int output.
    assert_array_equal(clf.attribute(Xq, output=[0, 1, 0], method=method),
                       per_output[:, :, 1])


def test_exact_scores_add_up_to_the_weighted_forward_outputs(clf, data):
    """No decomposition in the reference: the weighted logits of the trained network
    minus those of the recorded first point (forward passes) less the regularization
    is what the exact scores sum to; the regularization is read from decompose, whose
    own sum is checked against the same forward passes."""
    X, _ = data
    Xq = X[:6]
    with torch.no_grad():
        initial = module_at(clf, 0)(torch.as_tensor(Xq)).numpy()
    final = clf.decision_function(Xq)
    res = clf.decompose(Xq)
    assert_allclose(initial + res.contributions.sum(1) + res.regularization, final,
                    atol=1e-10)
    W = np.random.RandomState(1).normal(size=(6, 3))  # one row per query
    scores = clf.attribute(Xq, output=W)
    assert_allclose(scores.sum(1) + (res.regularization * W).sum(1),
                    ((final - initial) * W).sum(1), rtol=0, atol=1e-10)
    assert _rel(scores, np.einsum("qnc,qc->qn", res.contributions, W)) < 1e-12


def test_unrolled_weights_equal_autograd_and_finite_differences_of_the_replay(clf, data):
    """The derivative of ``w . f(x_q; theta_T(weights))``: autograd through an unrolled
    replay with the contracted output, and central differences of torch.optim's own
    weighted rerun of the recorded training, per query row."""
    X, _ = data
    Xq = X[:3] + 0.2
    W = np.array([[1.0, -1.0, 0.0], [0.2, 0.3, -2.0], [0.0, 0.0, 1.5]])
    scores = clf.attribute(Xq, output=W, method="unrolled")
    assert _rel(scores, unrolled_reference(clf.network_, Xq, W)) < 1e-8
    net = clf.network_

    def contracted(m):
        module = torch_optim_replay(net, m)
        with torch.no_grad():
            return (module(torch.as_tensor(Xq)).numpy() * W).sum(1)

    points = (0, 11, 25)
    fd = np.stack([weight_derivative(contracted, len(X), i) for i in points], axis=1)
    assert_allclose(scores[:, points], fd, rtol=1e-5, atol=1e-9 * np.abs(scores).max())


@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_the_margins_weights_are_the_margin(clf, data, method):
    """Per-query weights: the margin's gradient at the final logits (by autograd) is
    output="margin"; the same weights one query at a time are the same rows."""
    X, y = data
    Xq, yq = X[:5], y[[1, 0, 2, 2, 1]]
    W = _margin_weights_autograd(clf.decision_function(Xq), yq)
    scores = clf.attribute(Xq, output=W, method=method)
    assert_allclose(scores, clf.attribute(Xq, yq, method=method), rtol=0,
                    atol=1e-12 * np.abs(scores).max())
    looped = np.concatenate([clf.attribute(Xq[q:q + 1], output=W[q], method=method)
                             for q in range(len(Xq))])
    assert_allclose(scores, looped, rtol=0, atol=1e-12 * np.abs(scores).max())


def test_binary_margin_is_the_signed_logit(data):
    """One logit: the margin of class 1 is the logit, of class 0 its negative, per
    query (0/1 weights of shape (n_queries, 1))."""
    X, y = data
    binary = PathKernelClassifier(hidden_layer_sizes=(5,), solver="sgd", batch_size=None,
                                  learning_rate_init=0.5, max_iter=4, dtype="float64",
                                  random_state=0, tol=None).fit(X, y > 0)
    labels = np.array([True, False, False, True])
    sign = np.where(labels, 1.0, -1.0)[:, None]
    for method in ("exact", "unrolled"):
        assert_allclose(binary.attribute(X[:4], output=sign, method=method),
                        binary.attribute(X[:4], labels, method=method), rtol=1e-12,
                        atol=1e-15)
    assert_array_equal(binary.attribute(X[:4], output=[1.0]), binary.attribute(X[:4],
                                                                             output=0))
    # [0] is a weight of 0 on the one logit, not its index: refused, not zero scores.
    with pytest.raises(ValueError, match="all 0"):
        binary.attribute(X[:4], output=[0])


@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_recorded_loop_weights(method):
    """A recorded PyTorch loop (RecordedNetwork, and its TrainedNetwork): the weights'
    scores are that sum of the per-output scores, and for "unrolled" autograd through
    the replay; per-query rows are the query-by-query loop."""
    recorded, X = own_loop(n_outputs=2)
    Xq = X[:4] + 0.1
    w = np.array([2.0, -0.5])
    per_output = np.stack([recorded.attribute(Xq, output=c, method=method)
                           for c in range(2)], axis=2)
    scale = np.abs(per_output).max()
    for net in (recorded, recorded.network_):
        assert_allclose(net.attribute(Xq, output=w, method=method), per_output @ w,
                        rtol=0, atol=1e-12 * scale)
    W = np.random.RandomState(3).normal(size=(4, 2))
    scores = recorded.attribute(Xq, output=W, method=method)
    assert_allclose(scores, np.einsum("qnc,qc->qn", per_output, W), rtol=0,
                    atol=1e-12 * scale)
    looped = np.concatenate([recorded.attribute(Xq[q:q + 1], output=W[q], method=method)
                             for q in range(4)])
    assert_allclose(scores, looped, rtol=0, atol=1e-12 * scale)
    if method == "unrolled":
        assert _rel(scores, unrolled_reference(recorded.network_, Xq, W)) < 1e-8


def test_self_influence_and_explain_take_weights(clf, data):
    X, _ = data
    W = np.random.RandomState(2).normal(size=(len(X), 3))
    full = np.asarray(clf.attribute(clf.X_fit_, output=W, method="unrolled"))
    # Each training point's own row of the weights, on the diagonal.
    assert_allclose(clf.self_influence(output=W), np.diag(full), rtol=0,
                    atol=1e-12 * np.abs(full).max())
    per_output = np.stack([np.asarray(clf.self_influence(output=c)) for c in range(3)], 1)
    assert_allclose(clf.self_influence(output=W3), per_output @ W3, rtol=0,
                    atol=1e-12 * np.abs(per_output).max())
    scores = clf.attribute(X[:4], output=W3)
    idx, contrib = clf.explain(X[:4], 5, output=W3)
    assert_array_equal(idx, np.argsort(-np.abs(scores), axis=1, kind="stable")[:, :5])
    assert_allclose(contrib[:, :, 0], np.take_along_axis(scores, idx, axis=1))
    with pytest.raises(ValueError, match=r"shape \(3,\) or \(30, 3\)"):
        clf.self_influence(output=W[:4])


@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_regressor_weights_are_in_the_units_of_y(method):
    """normalize_y: the weights weigh the predictions in the units of y, as an int
    output's scores are (each output times its scale). Exact: the scores add up to the
    weighted predictions; unrolled: central differences of sample_weight refits (which
    standardize the targets anew)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(12, 3))
    y = np.column_stack([5 * np.sin(X[:, 0]) + 10, 0.1 * X[:, 1] * X[:, 2] - 4])
    params = dict(hidden_layer_sizes=(6,), activation="tanh", solver="sgd",
                  learning_rate_init=0.1, batch_size=None, max_iter=6, tol=None,
                  dtype="float64", random_state=0, normalize_y=True)
    est = PathKernelMachine(**params).fit(X, y)
    assert not np.allclose(est._y_scale, 1.0)
    Xq = X[:2] + 0.3
    w = np.array([0.5, 3.0])
    per_output = np.stack([est.attribute(Xq, output=c, method=method) for c in range(2)], 2)
    scores = est.attribute(Xq, output=w, method=method)
    assert_allclose(scores, per_output @ w, rtol=0, atol=1e-12 * np.abs(scores).max())
    if method == "exact":
        res = est.decompose(Xq)
        assert_allclose((res.initial + res.regularization) @ w + scores.sum(1),
                        est.predict(Xq) @ w, rtol=0, atol=1e-9)
        return
    # The refits' predictions at the queries and at the training points (whose own
    # columns are self_influence's), (queries + points, outputs, points).
    h, columns, at = 1e-5, [], np.vstack([Xq, X])
    for i in range(len(X)):
        up, down = np.ones(len(X)), np.ones(len(X))
        up[i] += h
        down[i] -= h
        columns.append((PathKernelMachine(**params).fit(X, y, sample_weight=up).predict(at)
                        - PathKernelMachine(**params).fit(X, y, sample_weight=down).predict(
                            at)) / (2 * h))
    fd = np.stack(columns, axis=2)
    assert _rel(scores, np.einsum("qcn,c->qn", fd[:2], w)) < 1e-6
    # self_influence weighs its points' predictions in the units of y too (each output
    # times its scale), a row per point or one for all.
    own = fd[2:][np.arange(len(X)), :, np.arange(len(X))]  # (points, outputs)
    W = np.random.default_rng(1).normal(size=(len(X), 2))
    assert _rel(est.self_influence(output=W), (own * W).sum(1)) < 1e-6
    assert _rel(est.self_influence(output=w), own @ w) < 1e-6


@pytest.mark.parametrize("output, match", [
    ([1.0, 2.0], r"shape \(3,\) or \(4, 3\).*got shape \(2,\)"),
    (np.ones((2, 3)), r"shape \(3,\) or \(4, 3\).*got shape \(2, 3\)"),
    (np.ones((4, 2)), r"shape \(3,\) or \(4, 3\).*got shape \(4, 2\)"),
    (np.ones((4, 3, 1)), r"shape \(3,\) or \(4, 3\).*got shape \(4, 3, 1\)"),
    ([1.0, np.nan, 0.0], "NaN or infinity"),
    (np.array([[1.0, 0.0, -np.inf]] * 4), "NaN or infinity"),
    (["a", "b", "c"], r"numbers of shape \(3,\) or \(4, 3\)"),
    ([[1.0, 2.0], [3.0]], r"numbers of shape \(3,\) or \(4, 3\)"),
    (1.5, r"or output weights of shape \(3,\)"),
    # All zero: the zero function, every score 0 (output=[0] meant as an index).
    ([0, 0, 0], "all 0.*pass an int"),
    (np.zeros((4, 3)), "all 0"),
    # Complex: float64 dropped the imaginary parts with only a ComplexWarning.
    (np.array([1.0 + 2.0j, 0.0, 0.0]), "real numbers of shape"),
])
@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_bad_weights_are_refused_and_change_nothing(clf, data, output, match, method):
    X, _ = data
    before = (clf.trajectory_.parameters(-1).clone(), clf.predict_proba(X[:4]))
    with pytest.raises(ValueError, match=match):
        clf.attribute(X[:4], output=output, method=method)
    assert torch.equal(clf.trajectory_.parameters(-1), before[0])
    assert_array_equal(clf.predict_proba(X[:4]), before[1])


def test_several_outputs_without_a_choice_name_the_weights():
    recorded, X = own_loop(n_outputs=2)
    with pytest.raises(ValueError, match=r"output=<weights of shape \(2,\)>"):
        recorded.attribute(X[:2])


@pytest.mark.parametrize("output, match", [
    ([1.0, 2.0], r"shape \(3,\) or \(30, 3\).*got shape \(2,\)"),
    (np.ones((4, 3)), r"shape \(3,\) or \(30, 3\).*got shape \(4, 3\)"),
    (np.full((30, 3), np.nan), "NaN or infinity"),
])
def test_self_influence_refuses_bad_weights(clf, output, match):
    with pytest.raises(ValueError, match=match):
        clf.self_influence(output=output)
