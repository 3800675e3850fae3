"""Bad input, for every public estimator, method and kernel (API.md, "Errors and bad input").

One table of bad inputs against one table of estimators and their methods: each call
must raise the right exception with a message naming the problem, and must leave a fitted
estimator exactly as it was (same attributes, same network, same predictions), failed
refits included.
"""

import collections
import copy
import re
import warnings
import weakref

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from numpy.testing import assert_array_equal
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder
from sklearn.utils._param_validation import InvalidParameterError

from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
)
from skpathkernel.diagnostics import hessian_trace, loss_path
from skpathkernel.kernels import step_kernel

# The string DataFrame case also warns that the estimators were fitted without names.
pytestmark = pytest.mark.filterwarnings("ignore:X has feature names:UserWarning")

SMALL = dict(hidden_layer_sizes=(4,), max_iter=3, random_state=0)  # float32: the default
RNG = np.random.RandomState(0)
X = RNG.normal(size=(12, 2))
Y_REG = X[:, 0] - X[:, 1]
Y_CLF = np.array(["a", "b", "c"] * 4)

def _meta(cls):
    """A factory of ``cls`` around a classifier trained with the given parameters."""
    def make(**params):
        return cls(PathKernelClassifier(**params))
    return make


# name -> (factory of training parameters, training targets, trained on class labels)
ESTIMATORS = {
    "PathKernelMachine": (PathKernelMachine, Y_REG, False),
    "PathKernelClassifier": (PathKernelClassifier, Y_CLF, True),
    "TangentFeatures": (_meta(TangentFeatures), Y_CLF, True),
    "TangentFeatureSVM": (_meta(TangentFeatureSVM), Y_CLF, True),
    "OODRankDetector": (_meta(OODRankDetector), Y_CLF, True),
}


def _network(est):
    return getattr(est, "estimator_", est)


def _y_for(est, n):
    y = ESTIMATORS[type(est).__name__][1]
    return np.resize(y, n)


# name -> call(estimator, X); only where the estimator has the method.
METHODS = {
    "predict": lambda e, A: e.predict(A),
    "predict_proba": lambda e, A: e.predict_proba(A),
    "decision_function": lambda e, A: e.decision_function(A),
    "transform": lambda e, A: e.transform(A),
    "score_samples": lambda e, A: e.score_samples(A),
    "decompose": lambda e, A: e.decompose(A),
    "explain": lambda e, A: e.explain(A, n_neighbors=2),
    "kneighbors": lambda e, A: e.kneighbors(A, n_neighbors=2),
    "rank_gap": lambda e, A: e.rank_gap(A),
    "TangentKernel": lambda e, A: TangentKernel(_network(e))(A),
    "TangentKernel(X, Y)": lambda e, A: TangentKernel(_network(e))(X[:2], A),
    "TangentKernel.diag": lambda e, A: TangentKernel(_network(e)).diag(A),
    "PathKernel": lambda e, A: PathKernel(_network(e))(A),
    "PathKernel.diag": lambda e, A: PathKernel(_network(e)).diag(A),
    "step_kernel": lambda e, A: step_kernel(_network(e), A),
    "hessian_trace": lambda e, A: hessian_trace(e, A, _y_for(e, np.shape(A)[0]), n_samples=2),
}
_OWN = {"predict", "predict_proba", "decision_function", "transform", "score_samples",
        "decompose", "explain", "kneighbors", "rank_gap"}

# name -> (X, exception, message)
BAD_X = {
    "NaN": (np.array([[np.nan, 0.0], [0.0, 1.0]]), ValueError, "NaN"),
    "inf": (np.array([[np.inf, 0.0], [0.0, 1.0]]), ValueError, "infinity"),
    "sparse": (sp.csr_matrix(np.ones((2, 2))), TypeError, "[Ss]parse"),
    "object column": (np.array([["a", 1.0], ["b", 2.0]], dtype=object), ValueError,
                      "could not convert string to float"),
    "string DataFrame": (pd.DataFrame({"a": ["x", "y"], "b": [1.0, 2.0]}), ValueError,
                         "could not convert string to float"),
    "1-D": (np.zeros(2), ValueError, "Expected 2D array"),
    "3-D": (np.zeros((2, 2, 1)), ValueError, "dim 3"),
    "0 samples": (np.zeros((0, 2)), ValueError, "0 sample"),
    "0 features": (np.zeros((2, 0)), ValueError, "0 feature"),
    "wrong n_features": (np.zeros((2, 3)), ValueError, "3 features.*expecting 2"),
    "complex": (np.zeros((2, 2), dtype=complex), ValueError, "[Cc]omplex"),
    "float32 overflow": (np.array([[1e300, 0.0], [0.0, 1.0]]), ValueError,
                         "too large for the network's dtype float32"),
}


@pytest.fixture(scope="module")
def fitted():
    with torch.random.fork_rng():
        return {name: make(**SMALL).fit(X, y) for name, (make, y, _) in ESTIMATORS.items()}


def _outputs(est):
    """The estimator's outputs on its first training rows, in its own input form
    (features, images, token ids)."""
    probe = est.X_fit_[:5]
    if hasattr(est, "score_samples"):
        return est.score_samples(probe)
    if hasattr(est, "predict"):
        return est.predict(probe)
    return est.transform(probe)


# A module fixture's fitted estimator -> its outputs (_outputs). Computed once per
# estimator rather than once per test: OODRankDetector's score_samples, taken on every
# copy before and after its failing call, was most of this file's time.
_FITTED_OUTPUTS = weakref.WeakKeyDictionary()


def _fresh(fitted, key):
    """A private copy per test (a failing call that did change something must not leak),
    and its snapshot before the test's call.

    The copy's outputs before the call are those of the fixture's estimator, which no test
    changes: a deepcopy computes what its original does (a copy that did not would fail
    the test's comparison after the call, which computes the copy's own outputs). The
    original's outputs are taken before it is first copied, so that whatever a first
    call leaves behind (a cache) is in the copy as it was in the copy's own first call.
    """
    original = fitted[key]
    if original not in _FITTED_OUTPUTS:
        _FITTED_OUTPUTS[original] = _outputs(original)
    est = copy.deepcopy(original)
    return est, snapshot(est, out=_FITTED_OUTPUTS[original])


def snapshot(est, out=None):
    """What a failing call must leave as it was: every attribute, the network, the outputs
    (``out``: the outputs, when known to be the estimator's, see :func:`_fresh`)."""
    net = _network(est)
    if out is None:
        out = _outputs(est)
    params = est.get_params()
    return {
        "keys": sorted(vars(est)),
        # Fitted state by identity (a failing call may not replace any of it); parameters,
        # which the tests set and restore, by value.
        "ids": {k: id(v) for k, v in vars(est).items() if k not in params},
        "n_features_in_": est.n_features_in_,
        "names": getattr(est, "feature_names_in_", None),
        "params": est.get_params(deep=False),
        "module": {k: v.clone() for k, v in net.module_.state_dict().items()},
        "trajectory": net.trajectory_.parameters(-1).clone(),
        "out": out,
    }


def assert_unchanged(est, before):
    after = snapshot(est)
    assert after["keys"] == before["keys"]
    assert after["ids"] == before["ids"]
    assert after["n_features_in_"] == before["n_features_in_"]
    assert_array_equal(after["names"], before["names"])
    assert after["params"] == before["params"]
    for k, v in before["module"].items():
        assert torch.equal(after["module"][k], v), k
    assert torch.equal(after["trajectory"], before["trajectory"])
    assert_array_equal(after["out"], before["out"])


def _cases(names):
    return [(e, m) for e in ESTIMATORS for m in names
            if m not in _OWN or hasattr(ESTIMATORS[e][0](**SMALL), m)
            # decompose/explain: the kernel machines; not an attribute of the others.
            ]


CALLS = [(e, m) for e, m in _cases(METHODS)
         if not (m in ("decompose", "explain") and e not in ("PathKernelMachine",
                                                            "PathKernelClassifier"))
         and not (m == "predict_proba" and e not in ("PathKernelClassifier",))]


@pytest.mark.parametrize("case", list(BAD_X))
@pytest.mark.parametrize(("name", "method"), CALLS)
def test_bad_X_is_refused_and_changes_nothing(fitted, name, method, case):
    est, before = _fresh(fitted, name)
    A, error, match = BAD_X[case]
    with pytest.raises(error, match=match):
        METHODS[method](est, A)
    assert_unchanged(est, before)


@pytest.mark.parametrize(("name", "method"), CALLS)
def test_unfitted_is_not_fitted_error(name, method):
    est = ESTIMATORS[name][0](**SMALL)
    with pytest.raises(NotFittedError, match="not fitted"):
        METHODS[method](est, X)


def _one_class(name):
    return (X, np.zeros(len(X)), ValueError, "greater than one")


# name -> (X, y, exception, message); y=None: the estimator's own targets.
BAD_FIT = {
    "X NaN": (BAD_X["NaN"][0], None, ValueError, "NaN"),
    "X inf": (BAD_X["inf"][0], None, ValueError, "infinity"),
    "X sparse": (sp.csr_matrix(X), None, TypeError, r"sparse matrix.*sparse_threshold=0"),
    "X object column": (np.column_stack([X[:, 0].astype(object), ["a"] * 12]), None,
                        ValueError, "could not convert string to float"),
    "X 1-D": (X[:, 0], None, ValueError, "Expected 2D array"),
    "X 3-D": (X[:, :, None], None, ValueError, "dim 3"),
    "0 samples": (X[:0], "empty", ValueError, "0 sample"),
    "0 features": (X[:, :0], None, ValueError, "0 feature"),
    "1 sample": (X[:1], "first", ValueError, "1 sample"),
    "X float32 overflow": (X * 1e300, None, ValueError, "too large for the network's dtype"),
    "y NaN": (X, "nan", ValueError, "y contains NaN"),
    "y inf": (X, "inf", ValueError, "y contains infinity"),
    "y sparse": (X, "sparse", TypeError, "Sparse data was passed for y"),
    "y wrong length": (X, "short", ValueError, "inconsistent numbers of samples"),
    "y 3-D": (X, "3d", ValueError, "dim 3"),
    "y None": (X, "none", ValueError, "requires y to be passed"),
    # One class, and new features: the failed refit must not keep n_features_in_=3.
    # The class named as Python writes it, not NumPy 2's repr np.int64(0).
    "1 class": (np.hstack([X, X[:, :1]]), "one class", ValueError,
                r"greater than one; got 1 class \((-?\d+|'\w+')\)"),
}
_NO_Y_FIT = {"OODRankDetector"}  # y=None is its self-supervised fit


def _y(kind, y):
    if kind is None:
        return y
    return {
        "empty": y[:0], "first": y[:1], "short": y[:5], "none": None,
        "nan": np.where(np.arange(len(y)) == 0, np.nan, np.arange(len(y)) % 2),
        "inf": np.where(np.arange(len(y)) == 0, np.inf, np.arange(len(y)) % 2),
        "sparse": sp.csr_matrix(np.arange(len(y), dtype=float).reshape(-1, 1)),
        "3d": np.zeros((len(y), 1, 1)),
        "one class": np.resize(y[:1], len(y)),
    }[kind]


FIT_CASES = [(e, c) for e in ESTIMATORS for c in BAD_FIT
             if not (c == "1 class" and not ESTIMATORS[e][2])
             and not (c == "y None" and e in _NO_Y_FIT)]


@pytest.mark.parametrize(("name", "case"), FIT_CASES)
def test_bad_fit_data_is_refused_and_the_previous_fit_kept(fitted, name, case):
    est, before = _fresh(fitted, name)
    A, kind, error, match = BAD_FIT[case]
    with pytest.raises(error, match=match):
        est.fit(A, _y(kind, ESTIMATORS[name][1]))
    assert_unchanged(est, before)


def test_a_failed_refit_keeps_the_previous_feature_names():
    # validate_data(reset=True) renames the features before training; a fit that then
    # fails must give the old names back.
    df = pd.DataFrame(X, columns=["u", "v"])
    est = PathKernelClassifier(**SMALL).fit(df, Y_CLF)
    with pytest.raises(ValueError, match="greater than one"):
        est.fit(pd.DataFrame(X, columns=["p", "q"]), np.zeros(len(X)))
    assert_array_equal(est.feature_names_in_, ["u", "v"])
    est.predict(df)


# Parameters -> (estimators it applies to, message); InvalidParameterError is both a
# ValueError and a TypeError, as scikit-learn's.
ALL = tuple(ESTIMATORS)
BAD_PARAMS = [
    (dict(solver="lbfgs"), ALL, "'solver' parameter"),
    (dict(learning_rate_init=-1), ALL, "'learning_rate_init' parameter"),
    (dict(learning_rate_init=np.nan), ALL, "'learning_rate_init' parameter"),
    (dict(batch_size=0), ALL, "'batch_size' parameter"),
    (dict(max_iter=0), ALL, "'max_iter' parameter"),
    # Interval(Integral) takes a bool for 0 or 1: True trained one epoch silently.
    (dict(max_iter=True), ALL, "'max_iter' parameter"),
    (dict(momentum=1.0), ALL, "'momentum' parameter"),
    (dict(alpha=-1.0), ALL, "'alpha' parameter"),
    (dict(activation="sigmoid"), ALL, "'activation' parameter"),
    (dict(device="tpu"), ALL, "'device' parameter"),
    (dict(dtype="float16"), ALL, "'dtype' parameter"),
    (dict(memory_budget=10), ALL, "'memory_budget' parameter"),
    (dict(record_every=0), ALL, "'record_every' parameter"),
    (dict(loss="hinge"), ALL, "'loss' parameter"),
    (dict(module=3), ALL, "'module' parameter"),
    (dict(hidden_layer_sizes="wide"), ALL, "'hidden_layer_sizes' parameter"),
    (dict(hidden_layer_sizes=(0,)), ALL, r"hidden_layer_sizes must contain positive integers"),
    (dict(hidden_layer_sizes=(2.5,)), ALL, r"hidden_layer_sizes must contain positive integers"),
    # int(True) built a width-1 layer silently, unlike hidden_layer_sizes=True (refused).
    (dict(hidden_layer_sizes=(8, True)), ALL,
     r"hidden_layer_sizes must contain positive integers"),
    (dict(method="x"), ("OODRankDetector",), "'method' parameter"),
    (dict(rtol=0.0), ("OODRankDetector",), "'rtol' parameter"),
    (dict(n_neighbors=0), ("OODRankDetector",), "'n_neighbors' parameter"),
    (dict(n_neighbors=True), ("OODRankDetector",), "'n_neighbors' parameter"),
    (dict(contamination=0.9), ("OODRankDetector",), "'contamination' parameter"),
    (dict(max_rank=0), ("OODRankDetector",), "'max_rank' parameter"),
    (dict(estimator="net"), ("OODRankDetector", "TangentFeatures", "TangentFeatureSVM"),
     "'estimator' parameter"),
    (dict(n_components=0), ("TangentFeatures",), "'n_components' parameter"),
    (dict(n_components=True), ("TangentFeatures",), "'n_components' parameter"),
    (dict(svm_kernel="rbf"), ("TangentFeatureSVM",), "'svm_kernel' parameter"),
    (dict(C=0.0), ("TangentFeatureSVM",), "'C' parameter"),
]


def _not_a_module(n_in, n_out):
    return "not a module"


@pytest.mark.parametrize(("name", "params", "match"), [
    (name, params, match) for params, names, match in BAD_PARAMS for name in names
] + [(name, dict(module=_not_a_module), "module must be a callable.*returned str")
     for name in ALL], ids=lambda v: v.__name__ if callable(v) else str(
         {k: getattr(x, "__name__", x) for k, x in v.items()} if isinstance(v, dict) else v))
def test_bad_parameters_are_refused_and_the_previous_fit_kept(fitted, name, params, match):
    est, before = _fresh(fitted, name)
    # A meta-estimator's training parameters are its trainer's: estimator__<name>.
    own = est.get_params(deep=False)
    params = {k if k in own else f"estimator__{k}": v for k, v in params.items()}
    old = est.get_params()
    est.set_params(**params)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        est.fit(X, ESTIMATORS[name][1])
    if "parameter" in match:
        assert isinstance(info.value, InvalidParameterError)
    est.set_params(**{k: old[k] for k in params})
    assert_unchanged(est, before)


# Bad arguments of the methods: (estimators, call, exception, message).
KM = ("PathKernelMachine", "PathKernelClassifier")
BAD_ARGS = {
    "decompose(method)": (KM, lambda e: e.decompose(X[:2], method="x"), ValueError,
                          "method must be 'exact'"),
    "decompose(weighting)": (KM, lambda e: e.decompose(X[:2], weighting="x"), ValueError,
                             "weighting must be"),
    "decompose(n_nodes=0)": (KM, lambda e: e.decompose(X[:2], n_nodes=0), ValueError,
                             "n_nodes must be a positive integer"),
    "decompose(n_nodes=2.5)": (KM, lambda e: e.decompose(X[:2], n_nodes=2.5), ValueError,
                               "n_nodes must be a positive integer"),
    "decompose(n_nodes and tol)": (KM, lambda e: e.decompose(X[:2], n_nodes=3, tol=1e-3),
                                   ValueError, "Pass n_nodes .* or tol .*, not both"),
    "attribute(n_nodes and tol)": (KM, lambda e: e.attribute(X[:2], n_nodes=3, tol=1e-3),
                                   ValueError, "Pass n_nodes .* or tol .*, not both"),
    # A classifier's labels with an output index explain nothing but were ignored
    # unchecked, whatever their number.
    "attribute(y, output)": (("PathKernelClassifier",),
                             lambda e: e.attribute(X[:2], np.zeros(5, int), output=0),
                             ValueError, r"y must hold one label per query, shape \(2,\)"),
    "explain(n_neighbors=0)": (KM, lambda e: e.explain(X[:2], n_neighbors=0), ValueError,
                               r"n_neighbors must be an integer in \[1, 12\]"),
    "explain(n_neighbors=13)": (KM, lambda e: e.explain(X[:2], n_neighbors=13), ValueError,
                                r"n_neighbors must be an integer in \[1, 12\]"),
    "explain(method)": (KM, lambda e: e.explain(X[:2], method="x"), ValueError,
                        "method must be"),
    # An array for a string option: "truth value of an array is ambiguous" from the
    # option's own check, where the message names the argument.
    "decompose(method=array)": (KM, lambda e: e.decompose(X[:2], method=np.ones(2)),
                                ValueError, "method must be 'exact'"),
    "decompose(weighting=array)": (KM, lambda e: e.decompose(X[:2], weighting=np.ones(2)),
                                   ValueError, "weighting must be"),
    "attribute(method=array)": (KM, lambda e: e.attribute(X[:2], method=np.ones(2)),
                                ValueError, "method must be 'unrolled'"),
    "explain(method=array)": (KM, lambda e: e.explain(X[:2], method=np.ones(2)), ValueError,
                              "method must be"),
    "kneighbors(kernel=array)": (ALL, lambda e: e.kneighbors(X[:2], 2, kernel=np.ones(2)),
                                 ValueError, "kernel must be 'tangent' or 'path'"),
    "kneighbors(normalized=array)": (
        ALL, lambda e: e.kneighbors(X[:2], 2, normalized=np.ones(2)), TypeError,
        "normalized must be a bool"),
    # Read by an ``if`` after the kernel's work: "no" returned the distances anyway.
    "kneighbors(return_distance='no')": (
        ALL, lambda e: e.kneighbors(X[:2], 2, return_distance="no"), TypeError,
        "return_distance must be a bool"),
    "kneighbors(return_distance=array)": (
        ALL, lambda e: e.kneighbors(X[:2], 2, return_distance=np.ones(2)), TypeError,
        "return_distance must be a bool"),
    "kneighbors(n_neighbors=0)": (ALL, lambda e: e.kneighbors(X[:2], n_neighbors=0),
                                  ValueError, r"n_neighbors must be an integer in \[1, 12\]"),
    "kneighbors(n_neighbors=True)": (ALL, lambda e: e.kneighbors(X[:2], n_neighbors=True),
                                     ValueError, "n_neighbors must be an integer"),
    "kneighbors(n_neighbors > n)": (ALL, lambda e: e.kneighbors(X[:2], n_neighbors=13),
                                    ValueError, "n_neighbors must be an integer"),
    "kneighbors(kernel)": (ALL, lambda e: e.kneighbors(X[:2], 2, kernel="rbf"), ValueError,
                           "kernel must be 'tangent' or 'path'"),
    "kneighbors(step=1.5)": (ALL, lambda e: e.kneighbors(X[:2], 2, step=1.5), TypeError,
                             "step must be an int"),
    "kneighbors(step out of range)": (ALL, lambda e: e.kneighbors(X[:2], 2, step=99),
                                      IndexError, "step 99 is out of range"),
    "TangentKernel(step=1.5)": (ALL, lambda e: TangentKernel(_network(e), step=1.5)(X),
                                TypeError, "step must be an int"),
    "TangentKernel(output=7)": (ALL, lambda e: TangentKernel(_network(e), output=7)(X),
                                ValueError, "output=7 is out of range"),
    "TangentKernel(normalized='yes')": (
        ALL, lambda e: TangentKernel(_network(e), normalized="yes").diag(X), TypeError,
        "normalized must be a bool"),
    "PathKernel(start=1.5)": (ALL, lambda e: PathKernel(_network(e), start=1.5)(X),
                              TypeError, "start must be an int"),
    "PathKernel(empty range)": (ALL, lambda e: PathKernel(_network(e), start=50)(X),
                                ValueError, "range of recorded points.*is empty"),
    "kernel gradient with Y": (ALL, lambda e: TangentKernel(_network(e))(X, X, True),
                               ValueError, "Gradient can only be evaluated when Y is None"),
    "step_kernel(preconditioned='x')": (
        ALL, lambda e: step_kernel(_network(e), X, preconditioned="x"), TypeError,
        "preconditioned must be a bool"),
    "hessian_trace(n_samples=0)": (ALL, lambda e: hessian_trace(e, n_samples=0),
                                   InvalidParameterError, "'n_samples' parameter"),
    "hessian_trace(step out of range)": (ALL, lambda e: hessian_trace(e, step=99, n_samples=2),
                                         IndexError, "step 99 is out of range"),
    "hessian_trace(X without y)": (ALL, lambda e: hessian_trace(e, X, n_samples=2), ValueError,
                                   "Pass both X and y"),
    "hessian_trace(y NaN)": (ALL, lambda e: hessian_trace(
        e, X, np.full(len(X), np.nan), n_samples=2), ValueError, "NaN"),
    "hessian_trace(unseen label)": (
        ("PathKernelClassifier", "TangentFeatureSVM"),
        lambda e: hessian_trace(e, X, np.resize(["a", "z"], len(X)), n_samples=2), ValueError,
        "labels not seen in fit"),
    "loss_path(step out of range)": (ALL, lambda e: loss_path(e, steps=[0, 99]), IndexError,
                                     "step 99 is out of range"),
    "loss_path(X without y)": (ALL, lambda e: loss_path(e, X), ValueError, "Pass both X and y"),
    "loss_path(y of another length)": (ALL, lambda e: loss_path(e, X, _y_for(e, len(X) - 1)),
                                       ValueError, "inconsistent numbers of samples"),
}


@pytest.mark.parametrize(("name", "case"), [
    (name, case) for case, (names, *_) in BAD_ARGS.items() for name in names
])
def test_bad_method_arguments_are_refused_and_change_nothing(fitted, name, case):
    est, before = _fresh(fitted, name)
    _, call, error, match = BAD_ARGS[case]
    with pytest.raises(error, match=match):
        call(est)
    assert_unchanged(est, before)


@pytest.mark.parametrize("weight", [np.nan, np.inf])
@pytest.mark.parametrize(("name", "verb"), [(name, "fit") for name in ALL] + [
    (name, "partial_fit") for name in KM])
def test_a_non_finite_scalar_sample_weight_is_refused(fitted, name, verb, weight):
    # scikit-learn checks an array of weights but broadcasts a scalar unchecked: a NaN
    # one failed fit as a diverged loss, or with "sample_weight is 0 on every sample" for
    # a classifier, and partial_fit recorded a step of loss 0 that moved nothing.
    est, before = _fresh(fitted, name)
    n_points = len(_network(est).trajectory_)
    y = ESTIMATORS[name][1]
    with pytest.raises(ValueError, match="sample_weight must be finite"):
        getattr(est, verb)(X, y, sample_weight=weight)
    assert_unchanged(est, before)
    assert len(_network(est).trajectory_) == n_points


@pytest.mark.parametrize(("classes", "match"), [
    (np.array(["a", np.nan, "b", "c"], dtype=object), "contains NaN"),
    ([0.0, np.nan, 1.0], "classes contains NaN"),
    ("abc", r"classes must be a 1-D array-like of labels, got shape \(\)"),
    ([["a", "b", "c"]], r"classes must be a 1-D array-like of labels, got shape \(1, 3\)"),
])
def test_partial_fit_refuses_bad_classes(fitted, classes, match):
    # A NaN among the classes became a class of its own: a network with an output for
    # it, and labels predicted as floats. A string was refused in words about y.
    with pytest.raises(ValueError, match=match):
        PathKernelClassifier(**SMALL).partial_fit(X, Y_CLF, classes=classes)
    est, before = _fresh(fitted, "PathKernelClassifier")
    with pytest.raises(ValueError, match=match):
        est.partial_fit(X, Y_CLF, classes=classes)
    assert_unchanged(est, before)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("columns", [["u", "w"], ["v", "u"]])
def test_hessian_trace_refuses_other_columns_than_the_fits(name, columns):
    # A meta-estimator hands its estimator_ the values only: a DataFrame of other or
    # reordered columns passed the estimator_'s checks and was read by position.
    make, y, _ = ESTIMATORS[name]
    est = make(**SMALL).fit(pd.DataFrame(X, columns=["u", "v"]), y)
    with warnings.catch_warnings():
        # The fit's own columns without a word: a meta-estimator's estimator_ warned
        # "X has feature names, but PathKernelClassifier was fitted without feature names".
        warnings.simplefilter("error", UserWarning)
        hessian_trace(est, pd.DataFrame(X, columns=["u", "v"]), y, n_samples=2)
    with pytest.raises(ValueError, match="feature names should match"):
        hessian_trace(est, pd.DataFrame(X, columns=columns), y, n_samples=2)


@pytest.mark.parametrize(("label", "shown"), [(1, "(1)"), ("a", "('a')"), (2.0, "(2.0)")])
def test_a_one_class_fit_names_the_class_as_written(label, shown):
    # numpy 2's repr showed np.int64(1) / np.str_('a') for the user's 1 / 'a'.
    with pytest.raises(ValueError, match=f"got 1 class {re.escape(shown)}"):
        PathKernelClassifier(**SMALL).fit(X, np.full(len(X), label))


@pytest.mark.parametrize("name", ALL)
def test_hessian_trace_runs_for_every_estimator(fitted, name):
    # The meta-estimators' networks (their estimator_) included.
    res = hessian_trace(fitted[name], n_samples=3, random_state=0)
    assert np.isfinite(res.trace)


# --------------------------------------------------------------------------- (n, ...) inputs
# With a module, X may be images or token ids: every method checks the shape and dtype fit
# saw, names what it expects, and leaves the estimator as it was.
def _cnn(n_features_in, n_outputs):
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, stride=2), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(18, n_outputs))


def _token_net(n_features_in, n_outputs):
    return torch.nn.Sequential(torch.nn.Embedding(6, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * n_features_in, n_outputs))


IMAGES = RNG.uniform(size=(12, 1, 8, 8))
TOKEN_IDS = RNG.randint(0, 6, size=(12, 3))
ND = {"images": (_cnn, IMAGES), "tokens": (_token_net, TOKEN_IDS)}


def _with(A, index, value):
    A = A.copy()
    A[index] = value
    return A


# kind -> case -> (X, exception, message)
BAD_ND_X = {
    "images": {
        "NaN": (_with(IMAGES[:2], (0, 0, 3, 3), np.nan), ValueError, "NaN"),
        "inf": (_with(IMAGES[:2], (1, 0, 0, 0), np.inf), ValueError, "infinity"),
        "wrong trailing shape": (np.zeros((2, 1, 8, 7)), ValueError,
                                 r"shape \(2, 1, 8, 7\).*of shape \(n_samples, 1, 8, 8\)"),
        "flat rows": (np.zeros((2, 64)), ValueError, r"of shape \(n_samples, 1, 8, 8\)"),
        "integers": (np.ones((2, 1, 8, 8), dtype=np.uint8), ValueError,
                     "integer dtype uint8.*fitted on float inputs"),
        "1-D": (np.zeros(2), ValueError, r"shape \(2,\)"),
        "sparse": (sp.csr_matrix(np.ones((2, 64))), TypeError, "[Ss]parse"),
        "0 features": (np.zeros((2, 1, 0, 8)), ValueError, "0 feature"),
        "complex": (np.zeros((2, 1, 8, 8), dtype=complex), ValueError, "[Cc]omplex"),
        "float32 overflow": (_with(IMAGES[:2], (0, 0, 0, 0), 1e300), ValueError,
                             "too large for the network's dtype float32"),
    },
    "tokens": {
        "float ids": (TOKEN_IDS[:2].astype(float), ValueError,
                      "fitted on integer token ids.*int64"),
        "NaN": (np.array([[np.nan, 1.0, 2.0]]), ValueError, "NaN"),
        "negative id": (_with(TOKEN_IDS[:2], (0, 1), -1), ValueError, "non-negative"),
        "id beyond the embedding": (_with(TOKEN_IDS[:2], (1, 2), 99), ValueError,
                                    r"token id 99, out of range.*\[6\] rows"),
        # In the words of sequences, not of features, from every method and kernel.
        "wrong length": (np.zeros((2, 4), dtype=int), ValueError,
                         r"shape \(2, 4\).*\(n_samples, 3\).*pad \(or cut\) every sequence"
                         r" to the fit's length, 3"),
        "3-D ids": (np.zeros((2, 3, 1), dtype=int), ValueError,
                    r"shape \(2, 3, 1\).*of shape \(n_samples, 3\)"),
        "sparse": (sp.csr_matrix(np.ones((2, 3), dtype=int)), TypeError, "[Ss]parse"),
    },
}
# The kernels also take flat rows of n_features_in_ values (GaussianProcessRegressor and
# KernelRidge pass 2-D arrays only): "flat rows" are good input there.
_KERNELS = {"TangentKernel", "TangentKernel(X, Y)", "TangentKernel.diag", "PathKernel",
            "PathKernel.diag", "step_kernel"}
ND_METHODS = {**METHODS, "TangentKernel(X, Y)":
              lambda e, A: TangentKernel(_network(e))(e.X_fit_[:2], A)}


@pytest.fixture(scope="module")
def fitted_nd():
    with torch.random.fork_rng():
        return {(name, kind): make(**SMALL, module=module).fit(Xk, y)
                for name, (make, y, _) in ESTIMATORS.items()
                for kind, (module, Xk) in ND.items()}


# The kernels validate X from the fitted form alone, whatever the estimator: two of them
# stand for all five there (the estimators' own methods are all checked).
_KERNEL_ESTIMATORS = ("PathKernelClassifier", "OODRankDetector")


@pytest.mark.parametrize(("name", "method", "kind", "case"), [
    (name, method, kind, case) for name, method in CALLS for kind in BAD_ND_X
    for case in BAD_ND_X[kind]
    if not (case == "flat rows" and method in _KERNELS)
    and (method not in _KERNELS or name in _KERNEL_ESTIMATORS)
])
def test_bad_nd_X_is_refused_and_changes_nothing(fitted_nd, name, method, kind, case):
    est, before = _fresh(fitted_nd, (name, kind))
    A, error, match = BAD_ND_X[kind][case]
    with pytest.raises(error, match=match):
        ND_METHODS[method](est, A)
    assert_unchanged(est, before)


# kind -> case -> (X, exception, message): refits of a fitted estimator, which must keep it.
BAD_ND_FIT = {
    "images": {
        # With a module, integer X is token ids: a network without an embedding cannot
        # take them, and says so before any training.
        "integers for a float network": (
            (IMAGES * 255).astype(np.uint8), ValueError,
            r"could not take X of shape \(12, 1, 8, 8\), handed to it as torch.int64.*"
            r"nn.Embedding"),
        # 6 x 6 images leave the CNN 8 values to flatten where its head takes 18.
        "wrong trailing shape": (IMAGES[:, :, :6, :6], ValueError,
                                 r"could not take X of shape \(12, 1, 6, 6\)"),
        "NaN": (_with(IMAGES, (3, 0, 1, 1), np.nan), ValueError, "NaN"),
        "0 features": (IMAGES[:, :, :0], ValueError, "0 feature"),
        "1 sample": (IMAGES[:1], ValueError, "1 sample"),
    },
    "tokens": {
        "float ids": (TOKEN_IDS.astype(float), ValueError,
                      "could not take X.*torch.float32.*must be integers"),
        "ids beyond the embedding": (TOKEN_IDS + 10, ValueError,
                                     r"largest token id is 15.*embeddings have \[6\] rows"),
        "negative ids": (TOKEN_IDS - 1, ValueError, "non-negative"),
    },
}


@pytest.mark.parametrize(("kind", "case"), [(k, c) for k in BAD_ND_FIT for c in BAD_ND_FIT[k]])
@pytest.mark.parametrize("name", ALL)
def test_bad_nd_fit_data_is_refused_and_the_previous_fit_kept(fitted_nd, name, kind, case):
    est, before = _fresh(fitted_nd, (name, kind))
    A, error, match = BAD_ND_FIT[kind][case]
    with pytest.raises(error, match=match):
        est.fit(A, _y_for(est, len(A)))
    assert_unchanged(est, before)


@pytest.mark.parametrize("cls", [TangentFeatures, TangentFeatureSVM, OODRankDetector])
def test_a_frozen_trainer_refuses_inputs_of_another_form(fitted_nd, cls):
    net = fitted_nd["PathKernelClassifier", "images"]
    with pytest.raises(ValueError, match=r"takes float X of shape \(n_samples, 1, 8, 8\)"):
        cls(FrozenEstimator(net)).fit(IMAGES.reshape(12, -1), Y_CLF)
    tokens = fitted_nd["PathKernelClassifier", "tokens"]
    with pytest.raises(ValueError, match="takes integer token ids"):
        cls(FrozenEstimator(tokens)).fit(TOKEN_IDS.astype(float), Y_CLF)


def test_the_default_network_keeps_two_dimensional_features():
    # Without a module, X stays 2-D features; integer features are converted to floats.
    with pytest.raises(ValueError, match="dim 4"):
        PathKernelMachine(**SMALL).fit(IMAGES, Y_REG)
    est = PathKernelMachine(**SMALL).fit(TOKEN_IDS, Y_REG)
    assert est.X_fit_.dtype == np.float64 and est.input_shape_ == (3,)


class _Tuple(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return (self.lin(x),)


class _Output(collections.OrderedDict):
    """Hugging Face's ModelOutput in a few lines: a dict whose values are attributes."""

    __getattr__ = collections.OrderedDict.__getitem__


class _ModelOutput(_Tuple):
    def forward(self, x):
        return _Output(logits=self.lin(x))


class _Transposed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).T


class _Squeezed(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.lin(x).squeeze()


# A module= factory whose network returns another number of values per sample than the
# estimator reads: each trained without a word, or failed later deep inside.
_WRONG_WIDTH = {
    # three classes on one output: predict named two of them
    "three classes, one output": (PathKernelClassifier, np.arange(24) % 3,
                                  lambda i, o: torch.nn.Linear(i, 1), ValueError,
                                  r"returned shape \(2, 1\).*3 value\(s\) per sample.*"
                                  r"one logit per class"),
    # four outputs for three classes: an IndexError in predict
    "three classes, four outputs": (PathKernelClassifier, np.arange(24) % 3,
                                    lambda i, o: torch.nn.Linear(i, o + 1), ValueError,
                                    r"returned shape \(2, 4\)"),
    # two logits for a binary problem: a dtype RuntimeError inside the loss
    "binary, two logits": (PathKernelClassifier, np.arange(24) % 2,
                           lambda i, o: torch.nn.Linear(i, 2), ValueError,
                           r"binary classifier's network has one output"),
    # two target columns from one output: both predicted columns the same
    "two targets, one output": (PathKernelMachine, np.c_[np.arange(24.0), -np.arange(24.0)],
                                lambda i, o: torch.nn.Linear(i, 1), ValueError,
                                r"2 value\(s\) per sample.*one per column of y"),
    # the right number of values, the samples on the second axis: read row by row, each
    # "sample" would be an output's values over the batch
    "outputs first": (PathKernelClassifier, np.arange(24) % 3,
                      lambda i, o: _Transposed(torch.nn.Linear(i, o)), ValueError,
                      r"returned shape \(3, 2\) for 2 sample"),
    "a tuple": (PathKernelMachine, np.arange(24.0), _Tuple, TypeError,
                r"must return one tensor of shape \(n_samples, 1\); it returned a tuple"),
    # a library model's dict-like output: the error said what it got, not what to do
    "a ModelOutput": (PathKernelClassifier, np.arange(24) % 3, _ModelOutput, TypeError,
                      r"returned a _Output. Wrap it in a module whose forward returns the "
                      r"output to analyse \(e.g. module\(x\)\[0\], or module\(x\).logits"),
    # a network, not a factory: its forward was called on the two sizes
    "a module instance": (PathKernelMachine, np.arange(24.0), torch.nn.Linear(3, 1),
                          TypeError, r"not a network: got a Linear instance"),
}


@pytest.mark.parametrize("case", list(_WRONG_WIDTH))
def test_a_module_of_another_output_width_is_refused_before_training(case):
    cls, y, module, error, match = _WRONG_WIDTH[case]
    X = np.random.RandomState(0).normal(size=(24, 3))
    params = dict(solver="sgd", max_iter=2, tol=None, random_state=0)
    right = cls(module=lambda i, o: torch.nn.Linear(i, o), **params).fit(X, y)
    factory, before = right.module, snapshot(right)
    with pytest.raises(error, match=match):
        right.set_params(module=module).fit(X, y)
    assert_unchanged(right.set_params(module=factory), before)
    # (A one-output network returning (n,) is accepted and trains as one returning
    # (n, 1): tests/test_training.py compares the two.)


def test_a_squeezed_network_output_is_taken_as_its_values_per_sample():
    """A network ending in .squeeze() drops the batch axis of a single sample only: it is
    n_outputs values per sample on every batch of two or more, and trains as the same
    network without it (the width check, run on one row, refused it)."""
    X = np.random.RandomState(0).normal(size=(24, 3))
    y = np.arange(24) % 3
    params = dict(solver="sgd", max_iter=3, tol=None, dtype="float64", random_state=0)
    plain = PathKernelClassifier(module=lambda i, o: torch.nn.Linear(i, o), **params)
    squeezed = PathKernelClassifier(module=_Squeezed, **params)
    assert_array_equal(squeezed.fit(X, y).trajectory_.parameters(-1),
                       plain.fit(X, y).trajectory_.parameters(-1))
    assert_array_equal(squeezed.predict_proba(X[:1]), plain.predict_proba(X[:1]))
    # A stream's later partial_fit of one sample: a batch of one, whose squeezed (3,)
    # output the training reads as one row, as the plain network's (1, 3).
    for est in (plain, squeezed):
        est.partial_fit(X[:1], y[:1])
    assert_array_equal(squeezed.trajectory_.parameters(-1), plain.trajectory_.parameters(-1))


@pytest.mark.parametrize("name", ["PathKernelClassifier", "TangentFeatureSVM", "OODRankDetector"])
def test_sparse_X_names_the_pipeline_settings_that_densify(fitted, name):
    # OneHotEncoder's default output is sparse: the message must say how to get dense
    # output inside a Pipeline (where X.toarray() cannot be called), and that works.
    X_cat = np.array([["a", "x"], ["b", "y"], ["c", "x"], ["a", "y"]] * 3)
    make = ESTIMATORS[name][0]
    with pytest.raises(TypeError, match=r"sparse matrix.*sparse_output=False"):
        make_pipeline(OneHotEncoder(), make(**SMALL)).fit(X_cat, Y_CLF)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_iter=3 does not converge
        make_pipeline(OneHotEncoder(sparse_output=False), make(**SMALL)).fit(X_cat, Y_CLF)
    est, before = _fresh(fitted, name)
    with pytest.raises(TypeError, match=r"sparse matrix.*sparse_threshold=0"):
        est.predict(sp.csr_matrix(X))
    with pytest.raises(TypeError, match=r"sparse matrix.*sparse_output=False"):
        TangentKernel(est)(sp.csr_matrix(X))
    assert_unchanged(est, before)
