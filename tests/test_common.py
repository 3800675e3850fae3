"""scikit-learn's own estimator checks on every public estimator.

Twice: constructed with their defaults (what a new user gets: float32, Adam, minibatches,
the stopping rule), and with small float64 settings (the exactness configuration).
"""

import re
import traceback
from unittest import mock

import numpy as np
import torch
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils import estimator_checks
from sklearn.utils.estimator_checks import parametrize_with_checks

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
)

DEFAULTS = [
    PathKernelMachine(),
    PathKernelClassifier(),
    TangentFeatures(),
    TangentFeatureSVM(),
    OODRankDetector(),
]

# Small, fast float64 settings that still learn sklearn's check data sets.
FAST = dict(hidden_layer_sizes=(16,), solver="adam", learning_rate_init=0.02, max_iter=150,
            dtype="float64", random_state=0)


class _MLP:
    """A module factory whose repr (the test id) is the same in every xdist worker."""

    def __call__(self, n_features_in, n_outputs):
        return torch.nn.Sequential(torch.nn.Linear(n_features_in, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, n_outputs))

    def __repr__(self):
        return "mlp"


# A user's module on 2-D X: n_features_in_, feature names and the rest of the checks hold
# as for the default network, except integer X, which is token ids with a module.
WITH_MODULE = PathKernelClassifier(**{**FAST, "module": _MLP()})

# The trainer at the end of a pipeline, cloned and fitted by the meta-estimator's fit.
PIPED = [
    TangentFeatures(make_pipeline(StandardScaler(), PathKernelClassifier(**FAST))),
    TangentFeatureSVM(make_pipeline(StandardScaler(), PathKernelClassifier(**FAST))),
    OODRankDetector(make_pipeline(StandardScaler(), PathKernelMachine(**FAST))),
]

ESTIMATORS = [
    *DEFAULTS,
    WITH_MODULE,
    PathKernelMachine(**FAST),
    PathKernelClassifier(**FAST),
    TangentFeatures(PathKernelClassifier(**FAST)),
    TangentFeatures(PathKernelMachine(**FAST), n_components=8, normalize=True,
                    random_state=0),
    TangentFeatureSVM(PathKernelClassifier(**FAST)),
    TangentFeatureSVM(PathKernelClassifier(**FAST), svm_kernel="linear"),
    TangentFeatureSVM(PathKernelClassifier(**FAST), normalize=False),
    # predict_proba and predict_log_proba exist: the checks of probabilities run.
    TangentFeatureSVM(PathKernelClassifier(**FAST), class_weight="balanced", probability=True),
    OODRankDetector(PathKernelMachine(**FAST)),
    *PIPED,
]

# Each expected failure, with its reason.
_IN_SPAN = ("every training feature lies in its own tangent span, so no training point can be "
            "an outlier (like LocalOutlierFactor(novelty=True)); offset_ for a float "
            "contamination is a quantile of leave-one-out scores instead")
_TOKEN_IDS = ("with a module, integer X is token ids handed to it as int64, which this MLP "
              "(no embedding) refuses with a clear error; the default network converts them")
# Weighted rows and repeated rows train the same full-batch path (sklearn's data set has
# 15 rows, inside one default batch), the float64 settings pass; float32 rounds the
# weighted mean and the mean over repeated rows differently, by about 3e-7 absolute,
# above the check's rtol=1e-7. (Minibatches would differ in kind: batched SGD is not
# invariant to repeating samples, MLPClassifier's xfail.) Held to float32's level by
# test_sklearn_estimator_checks (_float32_rounding) rather than listed as expected to fail.
# SVC itself fails the check (scikit-learn 1.9 lists it as SVC's expected failure): on
# the check's data, libsvm's fit with zero-weight rows differs from the fit without them
# (0.035 in the one-vs-one decision values), and TangentFeatureSVM differs from the fit on
# repeated rows by 2.4 whether or not its C is rescaled for its mean-one weights.
_SVM_WEIGHTS = ("scikit-learn's SVC fails this check itself (its expected failure in "
                "scikit-learn 1.9: libsvm's fit with zero-weight rows is not the fit without "
                "them); besides, the SVM's weights are relative (rescaled to mean 1, so that "
                "C keeps its meaning), and C='auto' cross-validates over rows, which "
                "repetition moves between folds")
_UNWEIGHTED_STEPS = ("sample_weight reaches the pipeline's trainer alone, as Pipeline.fit(X, y) "
                     "weighs no step: repeated rows move the scaler's mean and scale, "
                     "weighted rows do not")
EXPECTED_FAILED_CHECKS = {
    "TangentFeatureSVM": {"check_sample_weight_equivalence_on_dense_data": _SVM_WEIGHTS},
    "OODRankDetector": {
        "check_outliers_train": _IN_SPAN,
        "check_outliers_train(readonly_memmap=True)": _IN_SPAN,
    },
}


def _expected_failed_checks(estimator):
    if estimator is WITH_MODULE:
        return {"check_estimators_dtypes": _TOKEN_IDS,
                "check_classifier_data_not_an_array": _TOKEN_IDS,
                # sklearn's sample-weight checks fit on integer X.
                "check_sample_weights_pandas_series": _TOKEN_IDS,
                "check_sample_weights_not_an_array": _TOKEN_IDS,
                "check_sample_weights_shape": _TOKEN_IDS}
    expected = dict(EXPECTED_FAILED_CHECKS.get(type(estimator).__name__, {}))
    if any(estimator is e for e in PIPED):
        expected.setdefault("check_sample_weight_equivalence_on_dense_data", _UNWEIGHTED_STEPS)
    return expected


def _float32_rounding(estimator, check) -> bool:
    """Whether ``check`` compares the float32 defaults at float64's tolerance
    (see above): not an expected failure, whose strict xpass another BLAS's
    rounding (or a GPU's) would turn red, but a check held to float32's precision."""
    name = getattr(check, "func", check).__name__
    return (name == "check_sample_weight_equivalence_on_dense_data"
            and any(estimator is e for e in DEFAULTS)
            and not isinstance(estimator, TangentFeatureSVM))


def _platt_argmax(estimator, check) -> bool:
    """Whether ``check`` asks a probability=True TangentFeatureSVM for predict to be
    the argmax of predict_proba: predict is the SVM's (as SVC's), and Platt's sigmoid,
    fitted on out-of-fold decision values, crosses 1/2 a little off the SVM's 0, as
    scikit-learn documents of SVC(probability=True) (which its own checks run without
    probabilities). Held to a few disagreements near the boundary instead of listed as
    expected to fail: one sample of 200 here, which another BLAS's rounding could move.
    Only that comparison is relaxed (:func:`_tolerant_argmax`): the check's binary problem
    fails it, and catching its AssertionError skipped the rest, the multi-class problem
    (fit, predict_proba's shape and sums, malformed inputs, predict_log_proba) included."""
    name = getattr(check, "func", check).__name__
    return (name == "check_classifiers_train" and isinstance(estimator, TangentFeatureSVM)
            and estimator.probability)


def _tolerant_argmax(assert_array_equal, compared):
    """``assert_array_equal``, except where the check compares ``np.argmax(y_prob)`` with
    ``predict``: there at most 2% of the rows may differ (see :func:`_platt_argmax`).
    ``compared`` collects the number of rows of each such comparison."""
    def compare(actual, desired, *args, **kwargs):
        if "np.argmax(y_prob" not in (traceback.extract_stack(limit=2)[0].line or ""):
            return assert_array_equal(actual, desired, *args, **kwargs)
        actual, desired = np.asarray(actual), np.asarray(desired)
        assert actual.shape == desired.shape, (actual.shape, desired.shape)
        compared.append(len(desired))
        mismatched = int(np.count_nonzero(actual != desired))
        assert mismatched <= 0.02 * len(desired), (mismatched, len(desired))
    return compare


# Strict: an expected failure that passes fails the test, so that a reason which no longer
# holds (a fixed behaviour, a changed check) is seen rather than kept as an xpass.
@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks,
                         xfail_strict=True)
def test_sklearn_estimator_checks(estimator, check):
    if _platt_argmax(estimator, check):
        compared = []
        with mock.patch.object(estimator_checks, "assert_array_equal",
                               _tolerant_argmax(estimator_checks.assert_array_equal, compared)):
            check(estimator)
        # Both problems reached the comparison: none was skipped, and the relaxation
        # goes when the check no longer makes it.
        assert compared == [200, 300], compared
        return
    if not _float32_rounding(estimator, check):
        check(estimator)
        return
    # The check's rtol=1e-7 is below float32's rounding of the weighted
    # against the repeated rows' mean; hold the difference to float32's level instead
    # (relative, or absolute on these O(1) outputs, where features near 0 differ by ulps).
    try:
        check(estimator)
    except AssertionError as exc:
        found = {kind: re.search(rf"Max {kind} difference among violations: ([0-9.eE+-]+)",
                                 str(exc)) for kind in ("absolute", "relative")}
        assert all(found.values()), str(exc)
        assert min(float(m.group(1)) for m in found.values()) < 1e-5, str(exc)
