"""A fit that fails after its network trained keeps the previous fit whole (API.md,
"Errors and bad input": "nothing of a previous fit is lost").

A meta-estimator's fit trains a new network and then fits its own part on it (the SVM and
its calibration, the projection's check, the OOD span): a failure there must leave
``estimator_`` and everything read from it as they were, never a new network beside the
old SVM. What a meta-estimator's own fit refuses of the data given is refused before any
training. The reference is a deep copy taken before the failed call: every fitted
attribute by value, and the outputs of every method. (Failures in the network's own
training, divergence and the writes of a path on disk, are tested in test_faults.py and
test_storage_continued.py.)
"""

import copy
import warnings

import numpy as np
import pytest
import sklearn
import torch
from numpy.testing import assert_array_equal
from sklearn.calibration import CalibratedClassifierCV
from sklearn.exceptions import ConvergenceWarning, DataDimensionalityWarning
from sklearn.svm import SVC

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel._estimators import _base

RNG = np.random.RandomState(0)
X = RNG.normal(size=(24, 2))
Y = (X[:, 0] > 0).astype(int)
NET = dict(hidden_layer_sizes=(4,), max_iter=3, tol=None, random_state=0)

# The methods whose outputs a failed fit must leave as they were.
VERBS = ("predict", "predict_proba", "decision_function", "transform", "score_samples")


def _assert_same_value(a, b, where, depth=0):
    """``a`` equals ``b``, its deep copy, value for value (arrays and tensors bitwise)."""
    assert depth < 20, where
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, torch.nn.Module):
        _assert_same_value(a.state_dict(), b.state_dict(), where, depth + 1)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_value(a[key], b[key], f"{where}[{key!r}]", depth + 1)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same_value(u, v, f"{where}[{i}]", depth + 1)
    elif isinstance(a, (int, float, str, bool, type(None), np.generic)):
        assert a == b or (a != a and b != b), where
    elif isinstance(a, sklearn.base.BaseEstimator) or (
            type(a).__module__.startswith("skpathkernel") and hasattr(a, "__dict__")):
        # The fitted trainer, its TrainedNetwork and Trajectory: what they pickle (their
        # state without the caches that a use fills).
        assert type(a) is type(b), where
        _assert_same_value(a.__getstate__(), b.__getstate__(), where, depth + 1)


def _assert_same_fit(est, ref):
    """``est`` holds the fit of ``ref``, its copy from before: attributes and outputs."""
    assert sorted(vars(est)) == sorted(vars(ref))
    fitted = [key for key in vars(est) if key not in est.get_params()]
    _assert_same_value({k: vars(est)[k] for k in fitted}, {k: vars(ref)[k] for k in fitted},
                       type(est).__name__)
    net, ref_net = est.network_, ref.network_
    _assert_same_value(net.module, ref_net.module, "module")
    assert net.trajectory.n_steps == ref_net.trajectory.n_steps
    for k in range(net.trajectory.n_steps + 1):
        assert torch.equal(net.trajectory.parameters(k), ref_net.trajectory.parameters(k))
    assert_array_equal(est.X_fit_, ref.X_fit_)
    for verb in VERBS:
        if hasattr(ref, verb):
            _assert_same_value(getattr(est, verb)(X[:5]), getattr(ref, verb)(X[:5]), verb)


class _Refused(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise _Refused("simulated failure after the network trained")


def _as_error(category):
    def call(fit):
        with warnings.catch_warnings():
            warnings.simplefilter("error", category)
            fit()
    return call


# name -> (estimator, parameters of the failing refit, (error, message), how it fails)
AFTER_TRAINING = {
    "TangentFeatureSVM calibration": (
        TangentFeatureSVM(PathKernelClassifier(**NET), probability=True), {},
        (_Refused, None),
        lambda fit, mp: (mp.setattr(CalibratedClassifierCV, "fit", _refuse), fit())),
    "TangentFeatureSVM SVC": (
        TangentFeatureSVM(PathKernelClassifier(**NET)), {"C": 3.0},
        (_Refused, None), lambda fit, mp: (mp.setattr(SVC, "fit", _refuse), fit())),
    # The projection's warning, an error where warnings are.
    "TangentFeatures n_components": (
        TangentFeatures(PathKernelClassifier(**NET)), {"n_components": 10**4},
        (DataDimensionalityWarning, None),
        lambda fit, mp: _as_error(DataDimensionalityWarning)(fit)),
    # The span's factorisation stopped at max_rank: its warning, an error.
    "OODRankDetector span": (
        OODRankDetector(PathKernelClassifier(**NET), method="residual"), {"max_rank": 1},
        (ConvergenceWarning, None), lambda fit, mp: _as_error(ConvergenceWarning)(fit)),
}


@pytest.mark.parametrize("case", list(AFTER_TRAINING))
def test_a_fit_failing_after_its_network_trained_keeps_the_previous_fit(case, monkeypatch):
    template, params, error, fail = AFTER_TRAINING[case]
    est = sklearn.base.clone(template).fit(X, Y)
    ref = copy.deepcopy(est)
    trained = []
    real_train = _base.BasePathKernelNetwork._train
    monkeypatch.setattr(_base.BasePathKernelNetwork, "_train",
                        lambda *a, **k: trained.append(1) or real_train(*a, **k))
    # Other data and another network: a mix of the two fits could not pass for either.
    est.set_params(**params, estimator__random_state=1)
    with pytest.raises(error[0], match=error[1]):
        fail(lambda y=Y[::-1]: est.fit(X[::-1] * 2, y), monkeypatch)
    monkeypatch.undo()
    assert trained  # the new network trained: the failure came after it
    est.set_params(**ref.get_params(deep=False))
    est.set_params(estimator__random_state=0)
    _assert_same_fit(est, ref)


one_point = np.zeros(len(X))
one_point[3] = 1.0
two_copies = one_point.copy()
two_copies[4] = 1.0
X_copy = X.copy()
X_copy[4] = X_copy[3]

# name -> (meta-estimator, X, sample_weight, message): what its own fit refuses. With
# routing, its trainer declines the weights: it trains unweighted (it would refuse a
# weight 0 on every sample of a class), and only the meta-estimator's own fit reads them.
REFUSED = {
    "OOD one distinct row": (
        OODRankDetector, np.repeat(X[:1], len(X), axis=0), None,
        "at least 2 distinct training points.*got 1"),
    "OOD one positive-weight point": (
        OODRankDetector, X, one_point, "at least 2 distinct training points.*got 1"),
    "OOD two copies of a positive-weight point": (
        OODRankDetector, X_copy, two_copies, "at least 2 distinct training points.*got 1"),
    "SVM one class of positive weight": (
        TangentFeatureSVM, X, (Y == 1).astype(float),
        "sample_weight is 0 on every sample but those of class 1"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_data_the_meta_estimator_refuses_is_refused_before_any_training(case, monkeypatch):
    meta, X_bad, weights, match = REFUSED[case]
    with sklearn.config_context(enable_metadata_routing=True):
        est = meta(PathKernelClassifier(**NET).set_fit_request(sample_weight=False))
        est.fit(X, Y)
        ref = copy.deepcopy(est)
        trained = []
        monkeypatch.setattr(_base.BasePathKernelNetwork, "_train",
                            lambda *a, **k: trained.append(1))
        with pytest.raises(ValueError, match=match):
            est.fit(X_bad, Y, sample_weight=weights)
        monkeypatch.undo()
    assert not trained  # refused before the network trained for nothing
    _assert_same_fit(est, ref)


def test_calibration_folds_that_early_stopping_leaves_short_are_refused_before_training(
        monkeypatch):
    """Early stopping holds out 2 of class 1's 3 rows: the calibration's folds, which
    need 2 of every class the network trains on, are read from the split its fit will
    draw, and refused before it trains (they were refused after, at the cost of the
    fit); the previous fit is kept whole."""
    est = TangentFeatureSVM(PathKernelClassifier(**NET), probability=True).fit(X, Y)
    ref = copy.deepcopy(est)
    trained = []
    monkeypatch.setattr(_base.BasePathKernelNetwork, "_train",
                        lambda *a, **k: trained.append(1))
    est.set_params(estimator__early_stopping=True, estimator__validation_fraction=0.5,
                   estimator__random_state=1)
    with pytest.raises(ValueError, match="needs 2 samples of every class; class 1 has 1"):
        est.fit(X[::-1] * 2, np.r_[np.ones(3, int), np.zeros(len(X) - 3, int)])
    monkeypatch.undo()
    assert not trained
    est.set_params(**ref.get_params(deep=False))
    est.set_params(estimator__random_state=0)
    _assert_same_fit(est, ref)
