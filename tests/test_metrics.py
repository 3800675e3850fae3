"""The linear datamodeling score, the retraining helper and ``attribute``, against closed
forms and brute force."""

import warnings

import numpy as np
import pytest
import torch
from _reference import jacobian_loop, module_at
from numpy.testing import assert_allclose, assert_array_equal
from scipy.special import logsumexp
from scipy.stats import bootstrap, spearmanr
from sklearn.base import BaseEstimator, clone
from sklearn.decomposition import PCA
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import GridSearchCV
from sklearn.neighbors import KNeighborsRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from skpathkernel import (
    AttributionScores,
    PathKernelClassifier,
    PathKernelMachine,
    RecordedNetwork,
    TangentFeatureSVM,
)
from skpathkernel.metrics import (
    ensemble_attribution,
    linear_datamodeling_interval,
    linear_datamodeling_score,
    retrain_on_subsets,
)


# --------------------------------------------------------------------------- the score
def _lds_brute_force(A, subsets, outputs):
    """Per query: Python sums over each subset's indices, then scipy's spearmanr."""
    values = []
    for q in range(A.shape[0]):
        predicted = [sum(A[q, i] for i in subset) for subset in subsets]
        values.append(spearmanr(predicted, outputs[:, q]).statistic)
    return np.array(values)


def test_lds_of_an_exact_datamodel_is_one_and_its_negation_minus_one():
    rng = np.random.RandomState(0)
    W = rng.normal(size=(4, 30))
    masks = rng.rand(25, 30) < 0.5
    outputs = masks @ W.T
    assert linear_datamodeling_score(W, masks, outputs) == pytest.approx(1.0)
    assert linear_datamodeling_score(-W, masks, outputs) == pytest.approx(-1.0)
    # Ranks only: any increasing transform of the outputs scores the same.
    assert linear_datamodeling_score(W, masks, np.exp(outputs / 10)) == pytest.approx(1.0)
    # A scale per query changes nothing either.
    assert linear_datamodeling_score(W * rng.uniform(1, 5, size=(4, 1)), masks,
                                     outputs) == pytest.approx(1.0)


def test_lds_equals_brute_force_with_ties_and_index_subsets():
    rng = np.random.RandomState(1)
    n_train, n_queries, m, size = 40, 6, 20, 20
    A = rng.normal(size=(n_queries, n_train))
    subsets = np.array([rng.choice(n_train, size, replace=False) for _ in range(m)])
    # Rounded outputs: ties, which Spearman ranks by their average.
    outputs = np.round(rng.normal(size=(m, n_queries)) + 0.3 * (
        np.array([A[:, s].sum(1) for s in subsets])), 0)
    expected = _lds_brute_force(A, subsets, outputs)
    raw = linear_datamodeling_score(A, subsets, outputs, multioutput="raw_values")
    assert_allclose(raw, expected, atol=1e-12)
    masks = np.zeros((m, n_train), dtype=bool)
    for j, s in enumerate(subsets):
        masks[j, s] = True
    assert_allclose(linear_datamodeling_score(A, masks, outputs, multioutput="raw_values"),
                    expected, atol=1e-12)
    assert linear_datamodeling_score(A, subsets, outputs) == pytest.approx(expected.mean())


def test_lds_leaves_out_queries_without_rank_correlation():
    rng = np.random.RandomState(2)
    A = rng.normal(size=(3, 10))
    A[1] = 0.0  # every subset predicts 0: no ranks
    masks = rng.rand(12, 10) < 0.5
    outputs = rng.normal(size=(12, 3))
    raw = linear_datamodeling_score(A, masks, outputs, multioutput="raw_values")
    assert np.isnan(raw[1]) and np.isfinite(raw[[0, 2]]).all()
    with pytest.warns(RuntimeWarning, match="1 of 3 queries"):
        mean = linear_datamodeling_score(A, masks, outputs)
    assert mean == pytest.approx(raw[[0, 2]].mean())


def test_lds_takes_index_subsets_of_different_sizes():
    # Bernoulli subsets as index lists have different sizes, which NumPy cannot stack:
    # the score and its interval were refused with NumPy's "inhomogeneous shape" error.
    rng = np.random.RandomState(2)
    n_train, n_queries, m = 30, 4, 15
    A = rng.normal(size=(n_queries, n_train))
    masks = rng.rand(m, n_train) < 0.5
    subsets = [np.flatnonzero(mask) for mask in masks]
    assert len({len(s) for s in subsets}) > 1
    outputs = masks @ A.T + rng.normal(size=(m, n_queries))
    expected = _lds_brute_force(A, subsets, outputs)
    assert_allclose(linear_datamodeling_score(A, subsets, outputs, multioutput="raw_values"),
                    expected, atol=1e-12)
    assert_allclose(linear_datamodeling_score(A, [list(s) for s in subsets], outputs),
                    expected.mean(), atol=1e-12)
    assert (linear_datamodeling_interval(A, subsets, outputs, random_state=0)
            == linear_datamodeling_interval(A, masks, outputs, random_state=0))


@pytest.mark.parametrize("bad, match", [
    (dict(subsets=[np.array([0, 1]), np.array([2, 3, 3])] * 3), "subset 1: each"),
    (dict(subsets=[np.array([0, 1]), np.array([2, 3, 10])] * 3), "outside"),
    (dict(subsets=[np.array([0.0, 1.0]), np.array([2.0, 3.0, 4.0])] * 3), "subset 0 has"),
    (dict(subsets=[np.array([0, 1]), np.array([[2, 3, 4]])] * 3), "1-D array"),
    (dict(subsets=[np.array([0, 1]), np.array([2, 3, 4])] * 2), r"\(4, 3\)"),
    (dict(subsets=np.ones((5, 9), dtype=bool)), "masks over 9"),
    (dict(subsets=np.full((5, 3), 10)), "outside"),
    (dict(subsets=np.ones((5, 10))), "boolean masks or integer"),
    # 0/1 masks stored as integers: rows of 0s and 1s, which as indices repeat.
    (dict(subsets=(np.arange(50).reshape(5, 10) % 3 == 0).astype(int)), "astype\\(bool\\)"),
    (dict(subsets=np.array([[0, 1, 1]] * 5)), "repeat an index"),
    (dict(subsets=np.ones(10, dtype=bool)), "2-D"),
    (dict(outputs=np.zeros((5, 4))), r"\(5, 3\)"),
    (dict(subsets=np.ones((1, 10), dtype=bool), outputs=np.zeros((1, 3))), "at least 2"),
    (dict(attributions=np.full((3, 10), np.nan)), "NaN"),
])
def test_lds_bad_input(bad, match):
    args = dict(attributions=np.zeros((3, 10)), subsets=np.ones((5, 10), dtype=bool),
                outputs=np.zeros((5, 3)))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_datamodeling_score(**args)


def test_interval_refuses_a_bool_n_resamples():
    # validate_params takes True for 1: np.empty(True) failed with "expected a sequence of
    # integers".
    rng = np.random.RandomState(0)
    with pytest.raises(TypeError,
                       match=r"'n_resamples' parameter .* must be an int in the range .*Got True"):
        linear_datamodeling_interval(rng.normal(size=(3, 10)), rng.rand(6, 10) < 0.5,
                                     rng.normal(size=(6, 3)), n_resamples=True)


def test_interval_matches_scipy_bootstrap_and_collapses_on_an_exact_datamodel():
    rng = np.random.RandomState(3)
    W = rng.normal(size=(8, 40))
    masks = rng.rand(30, 40) < 0.5
    outputs = masks @ W.T + rng.normal(scale=2.0, size=(30, 8))
    low, high = linear_datamodeling_interval(W, masks, outputs, n_resamples=3000,
                                             random_state=0)
    reference = bootstrap(
        (np.arange(30),), lambda rows: linear_datamodeling_score(W, masks[rows], outputs[rows]),
        vectorized=False, n_resamples=3000, method="percentile", random_state=0,
    ).confidence_interval
    # Two independent Monte Carlo estimates of the same percentiles.
    assert low == pytest.approx(reference.low, abs=0.03)
    assert high == pytest.approx(reference.high, abs=0.03)
    assert low < linear_datamodeling_score(W, masks, outputs) < high
    assert linear_datamodeling_interval(W, masks, masks @ W.T, n_resamples=50) == \
        pytest.approx((1.0, 1.0))
    narrow = linear_datamodeling_interval(W, masks, outputs, confidence_level=0.5,
                                          n_resamples=3000, random_state=0)
    assert low < narrow[0] < narrow[1] < high


# --------------------------------------------------------------------------- retraining
class _ZeroLinear(torch.nn.Module):
    """f(x) = w . x, w = 0 at initialization: one gradient step has a closed form."""

    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.linear = torch.nn.Linear(n_features, n_outputs, bias=False)
        torch.nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return self.linear(x)


def _zero_linear(n_features, n_outputs):
    return _ZeroLinear(n_features, n_outputs)


def test_retraining_and_lds_of_one_gradient_step_closed_form():
    """From w = 0, one full-batch step of 1/2 MSE gives w = lr / |S| sum_S y_i x_i: the
    retrained output is a sum over the subset, and the decomposition's contributions
    (lr / N) y_i x_i . z are that datamodel up to a constant: LDS = 1."""
    rng = np.random.RandomState(0)
    X, y, Z = rng.normal(size=(30, 4)), rng.normal(size=30), rng.normal(size=(6, 4))
    lr = 0.1
    est = PathKernelMachine(module=_zero_linear, solver="sgd", learning_rate_init=lr,
                            momentum=0.0, alpha=0.0, batch_size=None, max_iter=1,
                            shuffle=True, dtype="float64", random_state=0,
                            normalize_y=False, tol=None)
    res = retrain_on_subsets(est, X, y, Z, n_subsets=12, random_state=0)
    assert res.subsets.shape == (12, 30) and (res.subsets.sum(1) == 15).all()
    closed = np.array([(lr / 15) * (y[s] @ X[s]) @ Z.T for s in res.subsets])
    assert_allclose(res.outputs, closed, rtol=1e-12, atol=1e-14)
    assert res.output == "predict" and res.protocol == "independent"
    assert res.seeds.shape == (12, 1)
    scores = est.fit(X, y).attribute(Z)
    assert_allclose(scores, (lr / 30) * (Z @ X.T) * y, rtol=1e-12, atol=1e-14)
    assert linear_datamodeling_score(scores, res.subsets, res.outputs) == pytest.approx(1.0)
    # Full batch: the replay of the one recorded step on a subset is the same model.
    replay = retrain_on_subsets(est, X, y, Z, n_subsets=12, protocol="replay",
                                random_state=0)
    assert_array_equal(replay.subsets, res.subsets)
    assert_allclose(replay.outputs, closed, rtol=1e-12, atol=1e-14)


def _brute_force_outputs(est, X, y, Z, res, output):
    """Each model refitted here, in order, with the seed the helper reports."""
    out = np.empty_like(res.all_outputs)
    for j, mask in enumerate(res.subsets):
        for r in range(res.all_outputs.shape[1]):
            model = clone(est)
            if res.seeds is not None:
                model.set_params(random_state=int(res.seeds[j, r]))
            out[j, r] = output(model.fit(X[mask], y[mask]), Z)
    return out


@pytest.mark.parametrize("protocol", ["same_seed", "independent"])
def test_retraining_equals_a_loop_of_fits(protocol):
    rng = np.random.RandomState(1)
    X, y = rng.normal(size=(24, 3)), rng.normal(size=24)
    est = PathKernelMachine(hidden_layer_sizes=(5,), solver="sgd", learning_rate_init=0.05,
                            momentum=0.0, alpha=0.0, batch_size=8, max_iter=3, shuffle=True,
                            dtype="float64", random_state=7, tol=None)
    res = retrain_on_subsets(est, X, y, X[:4], n_subsets=3, protocol=protocol, n_repeats=2,
                             random_state=0)
    expected = _brute_force_outputs(est, X, y, X[:4], res, lambda m, Z: m.predict(Z))
    assert_allclose(res.all_outputs, expected, rtol=1e-12)
    assert_allclose(res.outputs, expected.mean(1), rtol=1e-12)
    if protocol == "same_seed":
        assert res.seeds is None
        # One seed: the repeats are the same model.
        assert_array_equal(res.all_outputs[:, 0], res.all_outputs[:, 1])
    else:
        assert len(np.unique(res.seeds)) == res.seeds.size


@pytest.mark.parametrize("protocol", ["same_seed", "independent"])
def test_retraining_a_pipeline_seeds_its_steps(protocol):
    """A Pipeline (the README's scaler before the network) and an estimator without a
    random_state are retrained as any estimator: the seed goes to the network's step,
    by its own name (set_params(random_state=...) failed on the Pipeline, and
    "same_seed" refused both as unseeded)."""
    rng = np.random.RandomState(1)
    X, y = rng.normal(size=(24, 3)), rng.normal(size=24)
    net = PathKernelMachine(hidden_layer_sizes=(5,), batch_size=8, max_iter=3,
                            dtype="float64", random_state=7, tol=None)
    pipe = make_pipeline(StandardScaler(), net)
    res = retrain_on_subsets(pipe, X, y, X[:4], n_subsets=3, protocol=protocol, n_repeats=2,
                             random_state=0)
    out = np.empty_like(res.all_outputs)
    for j, mask in enumerate(res.subsets):
        for r in range(2):
            model = clone(net)
            if protocol == "independent":
                model.set_params(random_state=int(res.seeds[j, r]))
            scaler = StandardScaler().fit(X[mask])
            out[j, r] = model.fit(scaler.transform(X[mask]), y[mask]).predict(
                scaler.transform(X[:4]))
    assert_allclose(res.all_outputs, out, rtol=1e-12)
    # The repeats differ by their seeds alone.
    assert (protocol == "independent") == (not np.array_equal(res.all_outputs[:, 0],
                                                              res.all_outputs[:, 1]))
    knn = retrain_on_subsets(KNeighborsRegressor(n_neighbors=3), X, y, X[:4], n_subsets=3,
                             protocol=protocol, random_state=0)
    for mask, outputs in zip(knn.subsets, knn.outputs):
        assert_allclose(outputs, KNeighborsRegressor(n_neighbors=3).fit(
            X[mask], y[mask]).predict(X[:4]))
    with pytest.raises(ValueError, match="pathkernelmachine__random_state is None"):
        retrain_on_subsets(make_pipeline(StandardScaler(), clone(net).set_params(
            random_state=None)), X, y, X[:4], n_subsets=3, protocol="same_seed")


def _softmax_margin(proba, y):
    p = proba[np.arange(len(y)), y]
    return np.log(p) - np.log1p(-p)


@pytest.mark.parametrize("n_classes", [2, 3])
def test_retraining_margin_is_log_odds_of_the_label(n_classes):
    rng = np.random.RandomState(2)
    X = rng.normal(size=(60, 3))
    y = np.digitize(X[:, 0], [-0.4, 0.4][: n_classes - 1])
    est = LogisticRegression()
    res = retrain_on_subsets(est, X, y, X[:10], y[:10], n_subsets=4, random_state=0,
                             n_jobs=2)
    assert res.output == "margin"
    # log(p_y / (1 - p_y)) from predict_proba: independent of the decision_function route.
    expected = _brute_force_outputs(est, X, y, X[:10], res,
                                    lambda m, Z: _softmax_margin(m.predict_proba(Z), y[:10]))
    assert_allclose(res.all_outputs, expected, rtol=1e-9, atol=1e-9)


def _replay_loop(est, keep, Z):
    """Plain SGD by hand from the recorded initialization over the recorded batches."""
    module = module_at(est, 0)
    X = torch.as_tensor(est.X_fit_)
    y = torch.as_tensor(est._Y_fit)
    for t, batch in enumerate(est.trajectory_.batches):
        kept = torch.as_tensor(batch[keep[batch]])
        if len(kept) == 0:
            continue
        loss = torch.nn.functional.cross_entropy(module(X[kept]), y[kept])
        grads = torch.autograd.grad(loss, list(module.parameters()))
        with torch.no_grad():
            for p, g in zip(module.parameters(), grads):
                p -= float(est.trajectory_.learning_rates[t]) * g
    with torch.no_grad():
        return module(torch.as_tensor(Z)).numpy()


def test_replay_equals_a_hand_written_sgd_loop_over_the_recorded_batches():
    rng = np.random.RandomState(6)
    X = rng.normal(size=(40, 3))
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    est = PathKernelClassifier(hidden_layer_sizes=(5,), solver="sgd", learning_rate_init=0.3,
                               momentum=0.0, alpha=0.0, batch_size=6, max_iter=3,
                               shuffle=True, loss="log_loss", dtype="float64",
                               random_state=0, tol=None).fit(X, y)
    res = retrain_on_subsets(est, X, y, X[:7], y[:7], n_subsets=4, protocol="replay",
                             subset_fraction=0.3, random_state=0, n_jobs=2)
    assert res.seeds is None and res.protocol == "replay"
    for mask, outputs in zip(res.subsets, res.outputs):
        logits = _replay_loop(est, mask, X[:7])
        assert_allclose(outputs, logits[np.arange(7), y[:7]] - logsumexp(
            np.where(np.eye(3)[y[:7]] > 0, -np.inf, logits), axis=1), rtol=1e-10)
    with pytest.raises(ValueError, match="training set"):
        retrain_on_subsets(est, X + 1, y, X[:7], y[:7], n_subsets=2, protocol="replay")


@pytest.mark.parametrize("protocol", ["same_seed", "independent", "replay"])
def test_retraining_on_given_subsets(protocol):
    """``subsets=`` retrains on the caller's subsets (masks or index rows, e.g. the model
    without the points an attribution ranks first), as a loop of fits or of replays."""
    rng = np.random.RandomState(6)
    X = rng.normal(size=(40, 3))
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    est = PathKernelClassifier(hidden_layer_sizes=(5,), solver="sgd", learning_rate_init=0.3,
                               momentum=0.0, alpha=0.0, batch_size=6, max_iter=3,
                               shuffle=True, dtype="float64", random_state=0, tol=None)
    if protocol == "replay":
        est.fit(X, y)
    masks = np.ones((3, 40), dtype=bool)
    masks[0, [3, 17, 22]] = False                   # without three chosen points
    masks[1, :20] = False
    masks[2, rng.choice(40, 15, replace=False)] = False
    res = retrain_on_subsets(est, X, y, X[:7], y[:7], subsets=masks, protocol=protocol,
                             n_repeats=2, random_state=0)
    assert_array_equal(res.subsets, masks)
    assert res.outputs.shape == (3, 7)
    if protocol == "replay":
        for mask, outputs in zip(masks, res.outputs):
            logits = _replay_loop(est, mask, X[:7])
            assert_allclose(outputs, logits[np.arange(7), y[:7]] - logsumexp(
                np.where(np.eye(3)[y[:7]] > 0, -np.inf, logits), axis=1), rtol=1e-10)
    else:
        def label_margin(model, Z):
            f = model.decision_function(Z)
            return f[np.arange(7), y[:7]] - logsumexp(
                np.where(np.eye(3)[y[:7]] > 0, -np.inf, f), axis=1)

        expected = _brute_force_outputs(est, X, y, X[:7], res, label_margin)
        assert_allclose(res.all_outputs, expected, rtol=1e-12)
    # The same subsets as rows of training indices (one size: the last mask's).
    rows = np.array([np.flatnonzero(masks[2])])
    again = retrain_on_subsets(est, X, y, X[:7], y[:7], subsets=rows, protocol=protocol,
                               n_repeats=2, random_state=0)
    assert_array_equal(again.subsets, masks[2:])
    if protocol != "independent":
        assert_allclose(again.outputs, res.outputs[2:], rtol=1e-12)
        # Rows of different sizes: every point, and all but three.
        ragged = [np.arange(40), np.flatnonzero(masks[0])]
        both = retrain_on_subsets(est, X, y, X[:7], y[:7], subsets=ragged, protocol=protocol)
        assert_array_equal(both.subsets, np.vstack([np.ones(40, dtype=bool), masks[0]]))
        assert_allclose(both.outputs[1], res.outputs[0], rtol=1e-12)


@pytest.mark.parametrize("subsets, match", [
    (np.ones((2, 19), dtype=bool), "over 19 training points"),
    (np.zeros((2, 20), dtype=bool), "keeps no training point"),
    (np.ones(20, dtype=bool), "2-D"),
    (np.full((2, 20), 0.5), "dtype"),
    (np.array([[0, 0, 1]]), "repeat an index"),
    ([np.arange(3), np.arange(4.0)], "1-D array of training indices"),
    ([np.arange(3), np.array([1, 25])], "outside"),
])
def test_retraining_given_subsets_bad_input(subsets, match):
    rng = np.random.RandomState(5)
    X, y = rng.normal(size=(20, 2)), rng.normal(size=20)
    with pytest.raises((ValueError, TypeError), match=match):
        retrain_on_subsets(Ridge(), X, y, X[:3], subsets=subsets)


def test_index_rows_of_different_sizes_take_an_empty_list():
    """An empty subset given as ``[]`` (a float array to NumPy) raised an IndexError from
    the mask's indexing: the LDS takes it as the empty subset it is, and the retraining
    refuses it as one."""
    rng = np.random.RandomState(3)
    masks = rng.rand(6, 10) < 0.5
    masks[-1] = False
    attributions = rng.normal(size=(2, 10))
    outputs = masks @ attributions.T + rng.normal(size=(6, 2))
    rows = [np.flatnonzero(m).tolist() for m in masks]
    assert rows[-1] == []
    assert_allclose(linear_datamodeling_score(attributions, rows, outputs),
                    linear_datamodeling_score(attributions, masks, outputs), rtol=0)
    X, y = rng.normal(size=(10, 2)), rng.normal(size=10)
    with pytest.raises(ValueError, match="subset 5 keeps no training point"):
        retrain_on_subsets(Ridge(), X, y, X[:2], subsets=rows)


def test_replay_refuses_targets_other_than_the_fits():
    """The replay retrains on the targets recorded with the path: other labels (flipped
    ones, to ask what relabelling does) were replaced by them without a word."""
    rng = np.random.RandomState(6)
    X = rng.normal(size=(24, 2))
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    common = dict(hidden_layer_sizes=(4,), max_iter=2, batch_size=8, dtype="float64",
                  random_state=0, tol=None)
    clf = PathKernelClassifier(**common).fit(X, y)
    flipped = y.copy()
    flipped[:3] = (flipped[:3] + 1) % 3
    with pytest.raises(ValueError, match="own training targets"):
        retrain_on_subsets(clf, X, flipped, X[:2], y[:2], n_subsets=2, protocol="replay")
    with pytest.raises(ValueError, match="multilabel indicator"):  # kind, any output
        retrain_on_subsets(clf, X, np.eye(3)[y], X[:2], n_subsets=2, protocol="replay",
                           output=lambda m, Z: m.predict(Z))
    reg = PathKernelMachine(**common).fit(X, X[:, 0] * 10.0)
    with pytest.raises(ValueError, match="own training targets"):
        retrain_on_subsets(reg, X, X[:, 1], X[:2], n_subsets=2, protocol="replay")
    # Early stopping trains on X_fit_ only: the error names it.
    early = PathKernelClassifier(**{**common, "max_iter": 3}, early_stopping=True,
                                 validation_fraction=0.25, n_iter_no_change=5).fit(X, y)
    with pytest.raises(ValueError, match="X_fit_"):
        retrain_on_subsets(early, X, y, X[:2], y[:2], n_subsets=2, protocol="replay")
    # A recorded loop's network is fitted, but its loop is the user's to rerun.
    with pytest.raises(ValueError, match="RecordedNetwork's path comes from a loop"):
        retrain_on_subsets(RecordedNetwork(reg.module_, reg.trajectory_, X_train=X,
                                           y_train=X[:, 0] * 10.0),
                           X, X[:, 0] * 10.0, X[:2], n_subsets=2, protocol="replay")
    # The fit's own targets, in any form fit takes them, replay.
    res = retrain_on_subsets(reg, X, list(X[:, 0] * 10.0), X[:2], n_subsets=2,
                             protocol="replay", random_state=0)
    assert res.outputs.shape == (2, 2)
    labels = np.array(["a", "b", "c"])
    named = PathKernelClassifier(**common).fit(X, labels[y])
    res = retrain_on_subsets(named, X, labels[y], X[:2], labels[y[:2]], n_subsets=2,
                             protocol="replay", random_state=0)
    assert np.isfinite(res.outputs).all()


def test_retraining_parallel_equals_serial_and_accepts_a_callable():
    rng = np.random.RandomState(3)
    X, y = rng.normal(size=(40, 3)), rng.normal(size=40)

    def first_coef(model, Z):
        return np.full(len(Z), model.coef_[0])

    serial = retrain_on_subsets(Ridge(), X, y, X[:3], n_subsets=5, random_state=0,
                                output=first_coef)
    parallel = retrain_on_subsets(Ridge(), X, y, X[:3], n_subsets=5, random_state=0,
                                  output=first_coef, n_jobs=2)
    assert_array_equal(serial.subsets, parallel.subsets)
    assert_allclose(serial.outputs, parallel.outputs, rtol=1e-12)
    assert serial.output == "first_coef"
    coef = [Ridge().fit(X[m], y[m]).coef_[0] for m in serial.subsets]
    assert_allclose(serial.outputs[:, 0], coef, rtol=1e-12)


def test_retraining_progress(capsys):
    pytest.importorskip("tqdm")
    rng = np.random.RandomState(4)
    X, y = rng.normal(size=(20, 2)), rng.normal(size=20)
    retrain_on_subsets(Ridge(), X, y, X[:2], n_subsets=3, random_state=0, verbose=1)
    assert "3/3" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    (dict(estimator=Ridge(), output="margin"), "for classifiers"),
    (dict(estimator=LogisticRegression()), "y_query"),
    # Labels of another number of queries than X_query's: dropped unchecked where the
    # output does not read them (a regressor's "predict", a callable).
    (dict(y_query=np.zeros(5)), r"X_query has 3 rows but y_query has shape \(5,\)"),
    (dict(y_query=np.zeros(5), output=lambda m, Z: m.predict(Z)), "y_query has shape"),
    (dict(estimator=LogisticRegression(), y_query=np.zeros(2)), "y_query has shape"),
    (dict(estimator=PathKernelMachine(random_state=None), protocol="same_seed"),
     "random_state"),
    (dict(estimator=PathKernelMachine(random_state=0), protocol="replay"), "fit it"),
    (dict(subset_fraction=0.01), "at least one"),
    (dict(output=lambda m, Z: np.zeros((len(Z), 2))), "one value per query"),
    (dict(n_subsets=1), "n_subsets"),
    (dict(protocol="other"), "protocol"),
    # None or a string failed in is_classifier with an AttributeError about
    # __sklearn_tags__.
    (dict(estimator=None), "'estimator' parameter"),
    (dict(estimator="ridge"), "'estimator' parameter"),
])
def test_retraining_bad_input(kwargs, match):
    rng = np.random.RandomState(5)
    X, y = rng.normal(size=(20, 2)), np.arange(20) % 2
    args = dict(estimator=Ridge(), X=X, y=y, X_query=X[:3], n_subsets=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        retrain_on_subsets(**args)


def test_retraining_subset_without_a_class_is_a_clear_error():
    X = np.arange(20.0).reshape(-1, 1)
    y = np.r_[np.zeros(10, int), np.ones(9, int), 2]  # class 2 holds one sample
    with pytest.raises(ValueError, match="holds no sample of class"):
        retrain_on_subsets(LogisticRegression(), X, y, X[:2], y[:2], n_subsets=6,
                           random_state=0)



class _WarningRidge(Ridge):
    """Ridge that warns in every fit, as an unconverged network does (and once more on
    subsets holding the first point)."""

    def __init__(self, alpha=1.0, first=None):
        super().__init__(alpha=alpha)
        self.first = first

    def fit(self, X, y, sample_weight=None):
        warnings.warn("every fit", UserWarning, stacklevel=2)
        if X[0, 0] == self.first:
            warnings.warn("holds the first point", RuntimeWarning, stacklevel=2)
        return super().fit(X, y, sample_weight)


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_retraining_raises_each_fits_warning_once_at_the_callers_line(n_jobs):
    """Every fit's warnings come back from the workers, each distinct one once, at the
    caller's line: 50 subsets of an unconverged network printed 50 ConvergenceWarnings at
    joblib's line, and a process worker's could not be caught or filtered at all."""
    rng = np.random.RandomState(6)
    X, y = rng.normal(size=(20, 2)), rng.normal(size=20)
    est = _WarningRidge(first=X[0, 0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = retrain_on_subsets(est, X, y, X[:2], n_subsets=6, random_state=0,
                                 n_jobs=n_jobs)
    assert 0 < res.subsets[:, 0].sum() < 6  # some subsets hold the first point
    assert sorted((w.category.__name__, str(w.message)) for w in caught) == [
        ("RuntimeWarning", "holds the first point"), ("UserWarning", "every fit")]
    assert {w.filename for w in caught} == {__file__}
    # The outputs are the fits' own.
    fits = [Ridge().fit(X[m], y[m]).predict(X[:2]) for m in res.subsets]
    assert_allclose(res.outputs, fits, rtol=1e-12)


def test_replay_warnings_come_once_at_the_callers_line():
    """A replay's own warning (here: no point left of those that gave normalize_y's
    moments), raised by every replay that meets it, comes once."""
    X = np.linspace(-1, 1, 10).reshape(-1, 1)
    y = np.sin(3 * X).ravel()
    est = PathKernelMachine(hidden_layer_sizes=(3,), random_state=0, dtype="float64")
    est.partial_fit(X[:4], y[:4]).partial_fit(X[4:], y[4:])
    masks = np.ones((3, 10), dtype=bool)
    masks[:2, :4] = False  # two replays keep none of the first call's rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        retrain_on_subsets(est, X, y, X[:2], subsets=masks, protocol="replay")
    held = [w for w in caught if "keeps none of the first 4" in str(w.message)]
    assert len(held) == 1
    assert held[0].filename == __file__


# --------------------------------------------------------------------------- attribute
@pytest.fixture(scope="module")
def classifiers():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(30, 3))
    y3 = np.digitize(X[:, 0], [-0.5, 0.5])
    common = dict(hidden_layer_sizes=(6,), activation="tanh", momentum=0.0, alpha=0.0,
                  shuffle=True, loss="log_loss", dtype="float64", random_state=0, tol=None)
    sgd = PathKernelClassifier(solver="sgd", learning_rate_init=0.5, batch_size=10,
                               max_iter=3, **common).fit(X, y3)
    adam = PathKernelClassifier(solver="adam", learning_rate_init=0.05, batch_size=None,
                                max_iter=4, **common).fit(X, y3)
    binary = PathKernelClassifier(solver="sgd", learning_rate_init=0.5, batch_size=None,
                                  max_iter=5, **common).fit(X, y3 > 0)
    return X, y3, sgd, adam, binary


def _margin_weights_autograd(logits, labels):
    """d/df (f_y - logsumexp_{k != y} f_k) at the final logits, by autograd."""
    f = torch.tensor(logits, requires_grad=True)
    y = torch.as_tensor(labels)
    others = f.masked_fill(torch.nn.functional.one_hot(y, f.shape[1]).bool(), -torch.inf)
    margin = f.gather(1, y[:, None])[:, 0] - torch.logsumexp(others, dim=1)
    margin.sum().backward()
    return f.grad.numpy()


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_attribute_is_the_margin_weighted_decomposition(classifiers, which):
    X, y, sgd, adam, _ = classifiers
    clf = {"sgd": sgd, "adam": adam}[which]
    Xq, yq = X[:5], y[[1, 0, 2, 2, 1]]  # labels that are not all the predicted ones
    for method, weighting in [("exact", "realized"), ("first_order", "expected")]:
        res = clf.decompose(Xq, method=method, weighting=weighting)
        W = _margin_weights_autograd(res.prediction, yq)
        expected = np.einsum("qnc,qc->qn", res.contributions, W)
        scores = clf.attribute(Xq, yq, method=method, weighting=weighting)
        assert scores.shape == (5, len(X)) and scores.dtype == np.float64
        assert_allclose(scores, expected, rtol=1e-9, atol=1e-12)
    # Exact: the linear part of the margin is reproduced to round-off.
    res = clf.decompose(Xq)
    W = _margin_weights_autograd(res.prediction, yq)
    total = np.einsum("qc,qc->q", res.initial, W) + clf.attribute(Xq, yq).sum(1)
    assert_allclose(total, np.einsum("qc,qc->q", res.prediction, W), atol=1e-10)


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_attribute_scores_add_up_to_the_forward_margin(classifiers, which):
    """No decomposition in the reference: the margin's linear part at the final logits
    (decision_function, autograd weights) minus the same at the initial network (a forward
    pass of the recorded first point) is what the contracted scores sum to."""
    X, y, sgd, adam, _ = classifiers
    clf = {"sgd": sgd, "adam": adam}[which]
    Xq, yq = X[:6], y[[1, 0, 2, 2, 1, 0]]
    logits = clf.decision_function(Xq)
    W = _margin_weights_autograd(logits, yq)
    with torch.no_grad():
        initial = module_at(clf, 0)(torch.as_tensor(Xq)).numpy()
    scores = clf.attribute(Xq, yq)
    assert_allclose(np.einsum("qc,qc->q", initial, W) + scores.sum(1),
                    np.einsum("qc,qc->q", logits, W), rtol=0, atol=1e-10)


def test_attribute_binary_margin_is_exact_and_default_label_is_the_prediction(classifiers):
    X, y, sgd, _, binary = classifiers
    labels = y[:6] > 0
    sign = np.where(labels, 1.0, -1.0)
    scores = binary.attribute(X[:6], labels)
    res = binary.decompose(X[:6])
    assert_allclose(scores, sign[:, None] * res.contributions[:, :, 0], rtol=1e-12)
    margin = sign * binary.decision_function(X[:6])
    assert_allclose(sign * res.initial[:, 0] + scores.sum(1), margin, atol=1e-10)
    assert_allclose(binary.attribute(X[:6]), binary.attribute(X[:6], binary.predict(X[:6])))
    assert_allclose(sgd.attribute(X[:4]), sgd.attribute(X[:4], sgd.predict(X[:4])))


def test_attribute_first_order_expected_is_tracin_over_every_step(classifiers):
    """Domingos' path-kernel form: sum_t lr / N w . J_t(x) J_t(x_i)^T (-r_{t,i}), by a
    per-sample autograd loop at every recorded point."""
    X, y, sgd, _, _ = classifiers
    Xq, yq = X[:3], y[:3]
    traj = sgd.trajectory_
    logits = sgd.decision_function(Xq)
    W = _margin_weights_autograd(logits, yq)
    expected = np.zeros((3, len(X)))
    for t in range(traj.n_steps):
        module = module_at(sgd, t)
        Jq = jacobian_loop(module, Xq).numpy()  # (Q, C, P)
        Jx = jacobian_loop(module, X).numpy()   # (N, C, P)
        with torch.no_grad():
            p = torch.softmax(module(torch.as_tensor(X)), dim=1).numpy()
        residual = p - np.eye(3)[y]  # d loss / d f for softmax cross-entropy
        grads = np.einsum("nc,ncp->np", residual, Jx)
        expected -= float(traj.learning_rates[t]) / len(X) * np.einsum(
            "qc,qcp,np->qn", W, Jq, grads)
    scores = sgd.attribute(Xq, yq, method="first_order", weighting="expected")
    assert_allclose(scores, expected, rtol=1e-8, atol=1e-12)


def test_attribute_outputs_and_regressors(classifiers):
    X, y, sgd, _, _ = classifiers
    res = sgd.decompose(X[:4])
    assert_allclose(sgd.attribute(X[:4], output=2), res.contributions[:, :, 2], rtol=1e-10,
                    atol=1e-14)
    # normalize_y: the scores in the units of y, like decompose's (each output its scale).
    reg = PathKernelMachine(hidden_layer_sizes=(4,), solver="sgd", learning_rate_init=0.1,
                            momentum=0.0, alpha=0.01, batch_size=None, max_iter=3,
                            dtype="float64", random_state=0, tol=None, normalize_y=True)
    multi = clone(reg).fit(X, np.c_[X[:, 0], 5 * X[:, 1]])
    res = multi.decompose(X[:3])
    assert_allclose(multi.attribute(X[:3], output=1), res.contributions[:, :, 1],
                    rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="2 outputs"):
        multi.attribute(X[:3])
    single = clone(reg).fit(X, X[:, 0])
    res = single.decompose(X[:3])
    scores = single.attribute(X[:3])
    assert_allclose(scores, res.contributions[:, :, 0], rtol=1e-10, atol=1e-14)
    # The scores add up to the prediction in the units of y.
    assert_allclose(res.initial[:, 0] + scores.sum(1) + res.regularization[:, 0],
                    single.predict(X[:3]), atol=1e-10)
    with pytest.raises(ValueError, match="for classifiers"):
        single.attribute(X[:3], output="margin")


@pytest.mark.parametrize("kwargs, match", [
    (dict(y=np.array([0, 1])), "one label per query"),
    (dict(y=np.array([0, 1, 7])), "not trained on"),
    (dict(output=3), "output index"),
    (dict(output="logit"), "output"),
    (dict(method="exactly"), "method"),
    (dict(weighting="both"), "weighting"),
])
def test_attribute_bad_input(classifiers, kwargs, match):
    X, _, sgd, _, _ = classifiers
    before = sgd.trajectory_.parameters(-1).clone()
    with pytest.raises(ValueError, match=match):
        sgd.attribute(X[:3], **kwargs)
    assert torch.equal(sgd.trajectory_.parameters(-1), before)


def test_recorded_network_attribute_equals_the_estimators(classifiers):
    from skpathkernel import RecordedNetwork

    X, y, sgd, _, _ = classifiers
    net = RecordedNetwork(sgd.module_, sgd.trajectory_, X_train=X, y_train=y, loss="log_loss")
    labels = np.array([2, 0, 1, 1])
    assert_allclose(net.attribute(X[:4], labels, output="margin"),
                    sgd.attribute(X[:4], labels), rtol=1e-10, atol=1e-14)
    assert_allclose(net.attribute(X[:4], output="margin"), sgd.attribute(X[:4]), rtol=1e-10,
                    atol=1e-14)
    assert_allclose(net.attribute(X[:4], output=1), sgd.attribute(X[:4], output=1),
                    rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="3 outputs"):
        net.attribute(X[:4])
    with pytest.raises(ValueError, match="class indices"):
        net.attribute(X[:4], np.array([0, 1, 2, 3]), output="margin")


# --------------------------------------------------------------------------- ensembles
def _drawn_seeds(random_state, n_models):
    """The seeds ensemble_attribution documents: randint(2**31 - 1) from random_state."""
    return np.random.RandomState(random_state).randint(2**31 - 1, size=n_models)


@pytest.fixture(scope="module")
def ensemble_setup():
    rng = np.random.RandomState(8)
    X = rng.normal(size=(24, 3))
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    est = PathKernelClassifier(hidden_layer_sizes=(5,), activation="tanh", solver="sgd",
                               learning_rate_init=0.1, momentum=0.0, alpha=0.0,
                               batch_size=8, max_iter=3, shuffle=True, loss="log_loss",
                               dtype="float64", tol=None)
    return X, y, est


@pytest.mark.parametrize("method", ["unrolled", "exact"])
def test_ensemble_is_the_mean_of_fits_with_the_drawn_seeds(ensemble_setup, method):
    X, y, est = ensemble_setup
    Z, labels = X[:4], y[:4]
    members = [clone(est).set_params(random_state=int(seed)).fit(X, y).attribute(
        Z, labels, method=method) for seed in _drawn_seeds(3, 3)]
    scores = ensemble_attribution(est, X, y, Z, labels, n_models=3, random_state=3,
                                  method=method)
    assert scores.shape == (4, 24) and scores.dtype == np.float64
    assert_allclose(scores, np.mean(members, axis=0), rtol=1e-12, atol=1e-15)
    # Three different models, not one three times.
    assert not np.allclose(members[0], members[1])
    if method == "unrolled":
        assert isinstance(scores, AttributionScores)
        assert_array_equal(scores.growth, np.max([m.growth for m in members], axis=0))
    else:
        assert getattr(scores, "growth", None) is None
    # Processes: the same scores; a fitted estimator is cloned, not refitted or reused.
    fitted = clone(est).set_params(random_state=0).fit(X, y)
    before = fitted.trajectory_.parameters(-1).clone()
    parallel = ensemble_attribution(fitted, X, y, Z, labels, n_models=3, random_state=3,
                                    n_jobs=2, method=method)
    assert_allclose(parallel, scores, rtol=1e-12, atol=1e-15)
    assert torch.equal(fitted.trajectory_.parameters(-1), before)


def test_ensemble_of_one_model_is_a_single_fit(ensemble_setup):
    X, y, est = ensemble_setup
    seed = int(_drawn_seeds(11, 1)[0])
    single = clone(est).set_params(random_state=seed).fit(X, y).attribute(X[:3], y[:3])
    assert_array_equal(ensemble_attribution(est, X, y, X[:3], y[:3], n_models=1,
                                            random_state=11), single)


def test_ensemble_replay_error_keeps_a_nan(ensemble_setup, monkeypatch):
    """A member whose replay matched nothing (NaN) makes the ensemble's replay_error NaN:
    the largest finite one would read as a replay that matched."""
    import skpathkernel.metrics as metrics

    X, y, est = ensemble_setup
    one = metrics._attribute_one
    calls = []

    def second_is_nan(*args):
        scores, caught = one(*args)
        calls.append(None)
        if len(calls) == 2:
            scores.replay_error = float("nan")
        return scores, caught

    monkeypatch.setattr(metrics, "_attribute_one", second_is_nan)
    scores = ensemble_attribution(est, X, y, X[:2], y[:2], n_models=3, random_state=3,
                                  method="unrolled")
    assert np.isnan(scores.replay_error)


def test_ensemble_keeps_the_largest_gradient_sensitivity(ensemble_setup):
    """float32 Adam members measure how far float32 gradients move their scores; the
    ensemble reports the largest (it was dropped: None, read as nothing to report)."""
    X, y, est = ensemble_setup
    est = clone(est).set_params(solver="adam", learning_rate_init=0.01, dtype="float32")
    members = [clone(est).set_params(random_state=int(seed)).fit(X, y).attribute(
        X[:2], y[:2], method="unrolled") for seed in _drawn_seeds(5, 2)]
    sensitivities = [m.gradient_sensitivity for m in members]
    assert all(s is not None and np.isfinite(s) for s in sensitivities)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a member's own sensitivity warning
        scores = ensemble_attribution(est, X, y, X[:2], y[:2], n_models=2, random_state=5,
                                      method="unrolled")
    assert scores.gradient_sensitivity == max(sensitivities)


class _NoisyAttributor(BaseEstimator):
    """Scores drawn from its own seed; warns on odd seeds (a stand-in for an unstable path)."""

    def __init__(self, random_state=None):
        self.random_state = random_state

    def fit(self, X, y):
        self.n_train_ = len(X)
        return self

    def attribute(self, X_query, y_query=None, scale=1.0):
        if self.random_state % 2:
            warnings.warn("odd seed", UserWarning, stacklevel=2)
        rng = np.random.RandomState(self.random_state)
        return scale * rng.normal(size=(len(X_query), self.n_train_))


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_ensemble_forwards_attribute_params_and_warnings(n_jobs):
    X, y = np.zeros((7, 2)), np.zeros(7)
    seeds = _drawn_seeds(5, 6)
    assert (seeds % 2).any()
    expected = np.mean([2.0 * np.random.RandomState(s).normal(size=(3, 7)) for s in seeds],
                       axis=0)
    with pytest.warns(UserWarning, match="odd seed") as record:
        scores = ensemble_attribution(_NoisyAttributor(), X, y, X[:3], n_models=6,
                                      random_state=5, n_jobs=n_jobs, scale=2.0)
    # Raised again here, from process workers too, once per distinct warning, at this
    # line (it was scikit-learn's validate_params wrapper's).
    odd = [w for w in record if "odd seed" in str(w.message)]
    assert len(odd) == 1
    assert odd[0].filename == __file__
    assert_allclose(scores, expected, rtol=1e-12)


class _NoSeed(BaseEstimator):
    def fit(self, X, y):
        return self

    def attribute(self, X_query, y_query=None):
        return np.zeros((len(X_query), 1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_models=0), "n_models"),
    (dict(n_models=2.5), "n_models"),
    (dict(estimator=Ridge()), "estimator"),
    (dict(estimator=_NoSeed()), "random_state"),
    (dict(y=np.arange(5)), "samples"),
    (dict(random_state="seed"), "random_state"),
])
def test_ensemble_bad_input(ensemble_setup, kwargs, match):
    X, y, est = ensemble_setup
    args = dict(estimator=est, X=X, y=y, X_query=X[:2], n_models=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ensemble_attribution(**args)


def test_ensemble_docstring_example_runs():
    import doctest

    from skpathkernel import metrics

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = finder.find(metrics.ensemble_attribution, "ensemble_attribution",
                          globs={})
    result = runner.run(test)
    assert result.attempted > 0 and result.failed == 0


def test_replay_of_a_meta_estimator_names_its_trainer():
    """A fitted TangentFeatureSVM (or TangentFeatures, OODRankDetector) has a recorded
    path, its trainer's: the replay's refusal said it came "from a loop of your own", as
    for a RecordedNetwork, and unfitted it asked to fit it first, which did not help."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 2))
    y = (X[:, 0] > 0).astype(int)
    trainer = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, dtype="float64",
                                   random_state=0, tol=None)
    meta = TangentFeatureSVM(trainer)
    for est in (meta, clone(meta).fit(X, y)):
        with pytest.raises(ValueError, match="TangentFeatureSVM reads the path of its "
                                             "estimator: pass that trainer"):
            retrain_on_subsets(est, X, y, X[:2], y[:2], n_subsets=2, protocol="replay")
    # The trainer it names replays.
    fitted = clone(meta).fit(X, y)
    res = retrain_on_subsets(fitted.estimator_, X, y, X[:2], y[:2], n_subsets=2,
                             protocol="replay")
    assert res.outputs.shape == (2, 2)


def test_replay_of_a_pipeline_or_search_replays_its_network_on_the_transformed_inputs():
    """A fitted Pipeline ending in a trainer was refused (s54: "pass its last step with
    the inputs it was trained on"): it replays that step's path on X through the scaler,
    which stays fitted, against the hand-written loop on hand-scaled inputs; a search
    around it likewise, and a callable output is called with the pipeline and the raw
    queries, as the other protocols call it."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(30, 3)) * [1.0, 10.0, 0.1]
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    net = PathKernelClassifier(hidden_layer_sizes=(4,), solver="sgd", learning_rate_init=0.1,
                               batch_size=8, max_iter=2, dtype="float64", random_state=0,
                               tol=None)
    pipe = make_pipeline(StandardScaler(), net).fit(X, y)
    search = GridSearchCV(make_pipeline(StandardScaler(), clone(net)),
                          {"pathkernelclassifier__alpha": [0.0]}, cv=2).fit(X, y)
    Z = (X[:2] - X.mean(axis=0)) / X.std(axis=0)
    seen = []

    def first_logit(model, X_query):
        seen.append((type(model).__name__, np.array_equal(np.asarray(X_query), X[:2])))
        return model.decision_function(X_query)[:, 0]

    for fitted, trainer in ((pipe, pipe[-1]), (search, search.best_estimator_[-1])):
        res = retrain_on_subsets(fitted, X, y, X[:2], y[:2], n_subsets=2, protocol="replay",
                                 random_state=0)
        logit = retrain_on_subsets(fitted, X, y, X[:2], n_subsets=2, protocol="replay",
                                   random_state=0, output=first_logit)
        for mask, out, first in zip(res.subsets, res.outputs, logit.outputs):
            logits = _replay_loop(trainer, mask, Z)
            assert_allclose(out, logits[np.arange(2), y[:2]] - logsumexp(
                np.where(np.eye(3)[y[:2]] > 0, -np.inf, logits), axis=1), rtol=1e-10)
            assert_allclose(first, logits[:, 0], rtol=1e-10)
        # The fitted pipeline is left as it was: its trainer's network is not replaced.
        assert_allclose(fitted.decision_function(X[:2]), trainer.decision_function(
            Z), rtol=1e-12)
    assert {name for name, _ in seen} == {"Pipeline", "GridSearchCV"}
    assert all(raw for _, raw in seen)
    with pytest.raises(ValueError, match="a Ridge records none"):
        retrain_on_subsets(Ridge().fit(X, y), X, y, X[:2], n_subsets=2, protocol="replay")
    with pytest.raises(NotFittedError):
        retrain_on_subsets(clone(pipe), X, y, X[:2], y[:2], n_subsets=2, protocol="replay")


def _scaled_by(A, scales):
    return A * scales


def test_replay_of_a_pipeline_whose_fit_transform_rounds_apart_from_its_transform():
    """Pipeline.fit trains the network on fit_transform's output, which PCA computes
    another way than transform (U S against X V^T), 1e-13 apart: the replay refused the
    training set itself as "not X_fit_". It replays, against the hand-written loop on
    the hand-projected queries; other inputs are still refused."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3)) * [1.0, 10.0, 100.0]
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    pipe = make_pipeline(PCA(2, svd_solver="full"), PathKernelClassifier(
        hidden_layer_sizes=(4,), solver="sgd", learning_rate_init=0.1, batch_size=8,
        max_iter=2, dtype="float64", random_state=0, tol=None)).fit(X, y)
    pca = pipe[0]
    Z = (X[:2] - X.mean(axis=0)) @ pca.components_.T
    # The premise: the network's training inputs are not transform(X) bit for bit.
    assert not np.array_equal(pipe[-1].X_fit_, pipe[:-1].transform(X))
    res = retrain_on_subsets(pipe, X, y, X[:2], y[:2], n_subsets=2, protocol="replay",
                             random_state=0)
    for mask, out in zip(res.subsets, res.outputs):
        logits = _replay_loop(pipe[-1], mask, Z)
        assert_allclose(out, logits[np.arange(2), y[:2]] - logsumexp(
            np.where(np.eye(3)[y[:2]] > 0, -np.inf, logits), axis=1), rtol=1e-10)
    for other in (X[::-1], X * (1 + 1e-6)):
        with pytest.raises(ValueError, match="training set"):
            retrain_on_subsets(pipe, other, y, X[:2], y[:2], n_subsets=2, protocol="replay")
    # The round-off allowed is each feature's: a change of the smallest feature alone
    # (1e6 times smaller than the largest here, after the steps) is another X.
    scales = np.array([1e6, 1.0, 1e-3])
    wide = make_pipeline(FunctionTransformer(_scaled_by, kw_args={"scales": scales}),
                         # A step small enough for inputs of a million.
                         clone(pipe[-1]).set_params(learning_rate_init=1e-14)).fit(X, y)
    retrain_on_subsets(wide, X, y, X[:2], y[:2], n_subsets=2, protocol="replay")
    with pytest.raises(ValueError, match="training set"):
        retrain_on_subsets(wide, X * [1.0, 1.0, 1.1], y, X[:2], y[:2], n_subsets=2,
                           protocol="replay")
