"""TangentFeatures and TangentFeatureSVM against independent references."""

import gc
import os
import pickle
import warnings

import joblib
import numpy as np
import pytest
import sklearn
import torch
from _reference import features_loop, jacrev_features
from scipy.optimize import minimize
from sklearn.base import clone
from sklearn.calibration import CalibratedClassifierCV
from sklearn.datasets import make_blobs
from sklearn.exceptions import DataDimensionalityWarning
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import GridSearchCV, StratifiedKFold, train_test_split
from sklearn.svm import SVC
from sklearn.utils._param_validation import InvalidParameterError

from skpathkernel import (
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel import _tangent as tangent_engine
from skpathkernel.datasets import make_circle, make_ellipse
from skpathkernel.kernels import PathKernel, TangentKernel

SMALL = dict(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=0.02, max_iter=30,
             dtype="float64", random_state=0)


def _loop_features(est, X):
    """phi(x) by one autograd call per sample and output: flattened Jacobian / sqrt(C)."""
    return features_loop(est.module_, X)


@pytest.fixture
def circle():
    return make_circle(n_samples=60, random_state=0)


# ----------------------------------------------------------------------------- TangentFeatures
def test_default_trainer_follows_type_of_target(circle, regression_data):
    X, y = circle
    clf = TangentFeatures(random_state=0).fit(X, np.where(y > 0, "ring", "disk"))
    assert isinstance(clf.estimator_, PathKernelClassifier)
    assert clf.task_ == "classification" and clf.n_outputs_ == 1
    assert clf.classes_.tolist() == ["disk", "ring"]
    # The default trainer is the default classifier, seeded with random_state.
    ref = PathKernelClassifier(random_state=0).fit(X, np.where(y > 0, "ring", "disk"))
    np.testing.assert_array_equal(clf.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    Xr, yr = regression_data
    reg = TangentFeatures(random_state=0).fit(Xr, yr)
    assert isinstance(reg.estimator_, PathKernelMachine)
    assert reg.task_ == "regression" and not hasattr(reg, "classes_")
    # Integer-valued targets are classes to type_of_target; a PathKernelMachine regresses.
    ints = np.arange(len(Xr)) % 3
    assert TangentFeatures(PathKernelClassifier(**SMALL)).fit(Xr, ints).n_outputs_ == 3
    forced = TangentFeatures(PathKernelMachine(**SMALL)).fit(Xr, ints)
    assert forced.task_ == "regression" and forced.n_outputs_ == 1
    # The trainer's network, trained as the trainer alone trains it.
    reg = TangentFeatures(PathKernelMachine(**SMALL)).fit(Xr, yr)
    ref = PathKernelMachine(**SMALL).fit(Xr, yr)
    np.testing.assert_array_equal(reg.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    with pytest.raises(ValueError):
        TangentFeatures(PathKernelMachine(**SMALL)).fit(X, np.where(y > 0, "a", "b"))


@pytest.mark.parametrize("multi", [False, True])
def test_transform_matches_per_sample_autograd(regression_data, multi):
    X, y = regression_data
    y = np.column_stack([y, y**2]) if multi else y
    est = TangentFeatures(PathKernelMachine(**SMALL)).fit(X, y)
    phi = est.transform(X[:7])
    assert phi.shape == (7, est.n_params_ * (2 if multi else 1))
    np.testing.assert_allclose(phi, _loop_features(est, X[:7]), rtol=1e-12, atol=1e-14)
    names = est.get_feature_names_out()
    assert len(names) == phi.shape[1]
    expected = [f"{n}[{i}]" for n, p in est.module_.named_parameters() for i in range(p.numel())]
    assert names[: est.n_params_].tolist() == (
        [f"out0:{n}" for n in expected] if multi else expected
    )


def _n_jobs_data(n=300):
    # 300 rows: two row blocks of the serial call's fixed 256-row blocks (256 + 44).
    rng = np.random.RandomState(3)
    X = rng.uniform(-1, 1, size=(n, 3))
    return X, np.digitize(X @ [1.0, -2.0, 0.5], [-0.5, 0.5])  # 3 classes: C = 3 outputs


class _SelfBilinear(torch.nn.Module):
    # nn.Bilinear has no structured rule: the torch.func fallback.
    def __init__(self, d, k):
        super().__init__()
        self.bilinear = torch.nn.Bilinear(d, d, k)

    def forward(self, x):
        return self.bilinear(x, x)


def _conv_fallback(n_in, n_out):
    # A convolution (structured, summed over its positions) and a fallback layer.
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, n_in)), torch.nn.Conv1d(1, 2, 2),
                               torch.nn.Tanh(), torch.nn.Flatten(), _SelfBilinear(4, 3),
                               torch.nn.Tanh(), torch.nn.Linear(3, n_out))


@pytest.mark.filterwarnings("ignore::skpathkernel.rules.FallbackWarning")
# vmap's of nn.Bilinear in the reference
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("n_components", [None, 40])
@pytest.mark.parametrize("net", ["mlp-float32", "mlp-float64", "conv_fallback-float32"])
@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_transform_n_jobs_row_blocks_equal_serial_and_jacrev(backend, net, n_components,
                                                            feature_row_blocks):
    """n_jobs splits X into blocks of whole fixed-size (256-row) blocks of the serial
    call: each row is computed in the same block shape, padded alike, so the features
    equal the serial ones bit for bit, float32 included, on the structured routes
    (nn.Linear, a convolution's sum over positions) and the torch.func fallback."""
    X, y = _n_jobs_data()
    kind, dtype = net.split("-")
    module = dict(module=_conv_fallback) if kind == "conv_fallback" else {}
    clf = PathKernelClassifier(**{**SMALL, "dtype": dtype, "max_iter": 5, "tol": None},
                               **module).fit(X, y)
    tf = TangentFeatures(FrozenEstimator(clf), n_components=n_components,
                         random_state=0).fit(X)
    serial = tf.transform(X)
    with joblib.parallel_config(backend=backend):
        parallel = tf.set_params(n_jobs=2).transform(X)
        assert feature_row_blocks == [[256, 44]]
        # Not more than one fixed block: serial, whatever n_jobs says.
        np.testing.assert_array_equal(tf.transform(X[:200]), serial[:200])
        assert len(feature_row_blocks) == 1
    assert parallel.dtype == serial.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(parallel, serial)
    if n_components is None:
        ref = jacrev_features(clf, X)
        assert parallel.shape == ref.shape == (300, 3 * clf.n_params_)
        tol = 1e-13 if dtype == "float64" else 1e-6
        np.testing.assert_allclose(parallel, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_transform_n_jobs_ships_a_disk_path_by_reference():
    """Tasks get the path on disk by reference (for_workers): no pickling warning, the
    temporary directory stays the estimator's and goes with it."""
    X, y = _n_jobs_data()
    tf = TangentFeatures(PathKernelClassifier(**SMALL, tol=None, trajectory_storage="disk"))
    tf.fit(X, y)
    store = tf.trajectory_._store
    directory = store.directory
    serial = tf.transform(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with joblib.parallel_config(backend="loky"):
            parallel = tf.set_params(n_jobs=2).transform(X)
    np.testing.assert_array_equal(parallel, serial)
    np.testing.assert_allclose(parallel, jacrev_features(tf.estimator_, X), rtol=0,
                               atol=1e-13 * np.abs(serial).max())
    assert store.owned and os.path.isdir(directory)
    del tf, store
    gc.collect()
    assert not os.path.exists(directory)


def test_n_jobs_is_a_parameter_of_tangent_features(circle):
    X, y = circle
    tf = TangentFeatures(PathKernelClassifier(**SMALL, tol=None), n_jobs=2)
    assert tf.get_params()["n_jobs"] == 2 and clone(tf).n_jobs == 2
    assert TangentFeatures().get_params()["n_jobs"] is None
    with pytest.raises(InvalidParameterError, match="n_jobs"):
        TangentFeatures(PathKernelClassifier(**SMALL), n_jobs=1.5).fit(X, y)
    fitted = tf.fit(X, y)
    with pytest.raises(TypeError, match="n_jobs must be an int or None, got 'two'"):
        fitted.set_params(n_jobs="two").transform(X)
    # A pickle from before n_jobs (no n_jobs in its state) transforms serially.
    state = fitted.set_params(n_jobs=None).__getstate__()
    del state["n_jobs"]
    old = TangentFeatures.__new__(TangentFeatures)
    old.__setstate__(state)
    assert old.get_params()["n_jobs"] is None
    np.testing.assert_array_equal(old.transform(X), fitted.transform(X))


def test_normalize_gives_unit_rows_along_phi(circle):
    X, y = circle
    phi = TangentFeatures(PathKernelClassifier(**SMALL)).fit(X, y).transform(X)
    unit = TangentFeatures(PathKernelClassifier(**SMALL), normalize=True).fit(X, y).transform(X)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(unit * np.linalg.norm(phi, axis=1, keepdims=True), phi,
                               rtol=1e-10, atol=1e-12)


def test_projection_is_seeded_and_preserves_the_kernel(circle, monkeypatch):
    X, y = circle
    exact = TangentFeatures(PathKernelClassifier(**SMALL)).fit(X, y)
    K = exact.transform(X[:10]) @ exact.transform(X[:10]).T
    with pytest.warns(DataDimensionalityWarning, match="n_components=4000 > 33"):
        proj = TangentFeatures(PathKernelClassifier(**SMALL), n_components=4000,
                               random_state=0).fit(X, y)
    # The projection must not go through the dense features.
    monkeypatch.setattr(tangent_engine, "tangent_features", None)
    Z = proj.transform(X[:10])
    assert Z.shape == (10, 4000)
    # E[Z Z^T] = K; with 4000 components the relative error is a few percent.
    assert np.linalg.norm(Z @ Z.T - K) / np.linalg.norm(K) < 0.1
    again = TangentFeatures(PathKernelClassifier(**SMALL), n_components=4000,
                            random_state=0).fit(X, y).transform(X[:10])
    # The warning counts the exact features (2 inputs, 8 hidden units, one output: 33).
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataDimensionalityWarning)
        TangentFeatures(PathKernelClassifier(**SMALL), n_components=33).fit(X, y)
        # Three classes, three outputs: (2 * 8 + 8 + 8 * 3 + 3) * 3 = 153 exact features.
        y3 = np.arange(len(X)) % 3
        TangentFeatures(PathKernelClassifier(**SMALL), n_components=153).fit(X, y3)
    with pytest.warns(DataDimensionalityWarning, match="n_components=154 > 153"):
        TangentFeatures(PathKernelClassifier(**SMALL), n_components=154).fit(X, y3)
    np.testing.assert_array_equal(again, Z)
    other = TangentFeatures(PathKernelClassifier(**SMALL), n_components=4000,
                            random_state=1).fit(X, y)
    assert not np.allclose(other.transform(X[:10]), Z)
    names = proj.get_feature_names_out()
    assert names[0] == "tangentfeatures0" and names[-1] == "tangentfeatures3999"



@pytest.mark.parametrize("fitted, change", [
    (dict(), dict(n_components=5, random_state=0)),
    (dict(), dict(normalize=True)),
    (dict(n_components=5, random_state=0), dict(n_components=None)),
    (dict(n_components=5, random_state=0), dict(n_components=7, normalize=True)),
])
def test_set_params_takes_effect_at_the_next_fit(circle, fitted, change):
    """transform and the output names are the fit's, as SparseRandomProjection's (which
    reads n_components_ and components_): set_params without a refit changed the width
    of transform's output, and its names, without any projection drawn at fit."""
    X, y = circle
    est = TangentFeatures(PathKernelClassifier(**SMALL), **fitted).fit(X, y)
    before, names = est.transform(X[:10]), est.get_feature_names_out()
    est.set_params(**change)
    np.testing.assert_array_equal(est.transform(X[:10]), before)
    np.testing.assert_array_equal(est.get_feature_names_out(), names)
    # Refitted, the estimator is a fresh fit with the new parameters.
    fresh = TangentFeatures(PathKernelClassifier(**SMALL), **{**fitted, **change}).fit(X, y)
    est.fit(X, y)
    np.testing.assert_array_equal(est.transform(X[:10]), fresh.transform(X[:10]))
    np.testing.assert_array_equal(est.get_feature_names_out(), fresh.get_feature_names_out())
    assert est.transform(X[:10]).shape[1] == len(fresh.get_feature_names_out())


@pytest.mark.parametrize("n_components", [None, 5])
def test_a_fit_pickled_before_the_fitted_n_components_transforms(circle, n_components):
    """A TangentFeatures pickled before transform read the fit's n_components and
    normalize (neither in its state) loads and transforms as it did: with its parameters
    (an AttributeError on transform and get_feature_names_out before)."""
    X, y = circle
    est = TangentFeatures(PathKernelClassifier(**SMALL), n_components=n_components,
                          normalize=True, random_state=0).fit(X, y)
    state = dict(est.__getstate__())  # (object's __getstate__ is the __dict__ itself)
    del state["_n_components"], state["_normalize"]
    old = TangentFeatures.__new__(TangentFeatures)
    old.__setstate__(state)
    np.testing.assert_array_equal(old.transform(X[:5]), est.transform(X[:5]))
    np.testing.assert_array_equal(old.get_feature_names_out(), est.get_feature_names_out())
    unfitted = pickle.loads(pickle.dumps(TangentFeatures(n_components=3)))
    assert not hasattr(unfitted, "_n_components")


@pytest.mark.parametrize("svm_kernel", ["linear", "tangent"])
def test_svm_reads_its_fit_after_set_params(circle, svm_kernel):
    """The SVM reads what it was fitted on (features or Gram rows, normalized or not):
    set_params without a refit leaves its decisions as they were, a refit is a fresh fit."""
    X, y = circle
    est = TangentFeatureSVM(PathKernelClassifier(**SMALL), svm_kernel=svm_kernel, C=1.0)
    before = est.fit(X, y).decision_function(X[:10])
    change = dict(svm_kernel="path", normalize=False, C=10.0)
    np.testing.assert_array_equal(est.set_params(**change).decision_function(X[:10]), before)
    fresh = TangentFeatureSVM(PathKernelClassifier(**SMALL), **change).fit(X, y)
    np.testing.assert_array_equal(est.fit(X, y).decision_function(X[:10]),
                                  fresh.decision_function(X[:10]))

def test_pandas_in_and_out(circle):
    import pandas as pd
    X, y = circle
    df = pd.DataFrame(X, columns=["x1", "x2"])
    est = TangentFeatures(PathKernelClassifier(**SMALL)).set_output(transform="pandas")
    est.fit(df, y)
    assert est.feature_names_in_.tolist() == ["x1", "x2"]
    out = est.transform(df.iloc[:5])
    assert isinstance(out, pd.DataFrame)
    assert out.columns.tolist() == est.get_feature_names_out().tolist()
    np.testing.assert_allclose(out.to_numpy(), _loop_features(est, X[:5]), rtol=1e-12)


@pytest.mark.parametrize("cls,n_components", [(TangentFeatures, None), (TangentFeatures, 3),
                                              (TangentFeatureSVM, None)])
def test_feature_names_out_check_input_features_as_sklearn_does(circle, cls, n_components):
    """input_features were ignored, so names of other columns (or of another number of
    them) passed silently; scikit-learn's transformers check them against the fit's."""
    import pandas as pd
    from sklearn.utils.estimator_checks import check_transformer_get_feature_names_out_pandas
    X, y = circle
    params = {} if n_components is None else dict(n_components=n_components, random_state=0)
    est = cls(PathKernelClassifier(**SMALL), **params).fit(pd.DataFrame(X, columns=["a", "b"]), y)
    names = est.get_feature_names_out()
    np.testing.assert_array_equal(est.get_feature_names_out(["a", "b"]), names)
    with pytest.raises(ValueError, match="input_features is not equal to feature_names_in_"):
        est.get_feature_names_out(["b", "a"])
    unnamed = cls(PathKernelClassifier(**SMALL), **params).fit(X, y)
    np.testing.assert_array_equal(unnamed.get_feature_names_out(["u", "v"]), names)
    with pytest.raises(ValueError, match="input_features should have length equal"):
        unnamed.get_feature_names_out(["u", "v", "w"])
    # scikit-learn's own check of transformers' names (not among check_estimator's).
    check_transformer_get_feature_names_out_pandas(
        cls.__name__, cls(PathKernelClassifier(**SMALL), **params))


@pytest.mark.parametrize("cls", [PathKernelClassifier, PathKernelMachine])
def test_trainers_feature_names_out_check_input_features(circle, cls):
    """The trainers' own transform names its columns the same way, and ignored
    input_features too."""
    import pandas as pd
    from sklearn.utils.estimator_checks import check_transformer_get_feature_names_out_pandas
    X, y = circle
    est = cls(**SMALL).fit(pd.DataFrame(X, columns=["a", "b"]), y)
    names = est.get_feature_names_out()
    assert len(names) == est.transform(X[:2]).shape[1]
    np.testing.assert_array_equal(est.get_feature_names_out(["a", "b"]), names)
    with pytest.raises(ValueError, match="input_features is not equal to feature_names_in_"):
        est.get_feature_names_out(["b", "a"])
    with pytest.raises(ValueError, match="input_features should have length equal"):
        cls(**SMALL).fit(X, y).get_feature_names_out(["u", "v", "w"])
    check_transformer_get_feature_names_out_pandas(cls.__name__, cls(**SMALL))


# ----------------------------------------------------------------------------- TangentFeatureSVM
def _unit(F):
    return F / np.sqrt(np.einsum("ij,ij->i", F, F))[:, None]


@pytest.mark.parametrize("svm_kernel", ["linear", "tangent"])
def test_dataframe_fit_warns_of_no_missing_feature_names(circle, svm_kernel):
    """The linear SVM's features of X_fit_ (at fit) and of the validated rows (predict)
    were validated again as a new X: a DataFrame fit warned "X does not have valid
    feature names" on every call, with the right names given."""
    import warnings

    import pandas as pd
    X, y = circle
    df = pd.DataFrame(X, columns=["x1", "x2"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*feature names")
        est = TangentFeatureSVM(PathKernelClassifier(**SMALL), C=1.0,
                                svm_kernel=svm_kernel).fit(df, y)
        decision = est.decision_function(df[:9])
        assert est.score(df, y) > 0.5
    np.testing.assert_array_equal(est.predict(df[:9]), est.classes_[(decision > 0).astype(int)])
    np.testing.assert_array_equal(est.feature_names_in_, ["x1", "x2"])
    # Reordered columns are still refused.
    with pytest.raises(ValueError, match="feature names should match"):
        est.predict(df[["x2", "x1"]])


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_svm_equals_precomputed_tangent_kernel(circle, normalize):
    X, y = circle
    Xt = X[:9] * 0.9
    C = 3.0 if not normalize else 0.5  # a C that leaves some samples inside the margin
    lin = TangentFeatureSVM(PathKernelClassifier(**SMALL), C=C, svm_kernel="linear",
                            normalize=normalize).fit(X, y)
    tan = TangentFeatureSVM(PathKernelClassifier(**SMALL), C=C, svm_kernel="tangent",
                            normalize=normalize).fit(X, y)
    # The same SVM, reached through phi (libsvm's linear kernel) and through the
    # structured Gram that never forms phi.
    np.testing.assert_allclose(lin.decision_function(Xt), tan.decision_function(Xt),
                               rtol=1e-6, atol=1e-8)
    # And both equal an SVC fitted on autograd-loop features (scaled to unit rows by
    # hand when normalized).
    prep = _unit if normalize else (lambda F: F)
    F, Ft = prep(_loop_features(lin, X)), prep(_loop_features(lin, Xt))
    ref = SVC(kernel="linear", C=C).fit(F, y)
    np.testing.assert_allclose(lin.decision_function(Xt), ref.decision_function(Ft), rtol=1e-8)
    np.testing.assert_array_equal(lin.predict(Xt), ref.predict(Ft))
    # transform gives phi itself either way.
    np.testing.assert_allclose(lin.transform(Xt), _loop_features(lin, Xt), rtol=1e-12)
    if normalize:
        # Not the raw kernel's SVM: the normalization changes the decision values.
        raw = SVC(kernel="linear", C=C).fit(_loop_features(lin, X), y)
        assert not np.allclose(lin.decision_function(Xt),
                               raw.decision_function(_loop_features(lin, Xt)), rtol=1e-3)


@pytest.mark.parametrize("normalize", [False, True])
def test_path_svm_equals_svc_on_explicit_path_sum(circle, normalize):
    X, y = circle
    params = dict(SMALL, solver="sgd", learning_rate_init=0.1, max_iter=6)
    # Normalized, "auto" picks C = 1000 on this six-step path's nearly rank-deficient
    # Gram, where libsvm's 1e-3 stopping tolerance shows in the decision values; C = 1
    # keeps the comparison at round-off.
    est = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel="path",
                            normalize=normalize, C=1.0 if normalize else "auto").fit(X, y)
    # Full-batch SGD: K = sum_k lr * phi_k(x) . phi_k(x') over the points that a step leaves.
    probe = TangentFeatureSVM(PathKernelClassifier(**params)).fit(X, y)
    K_train = np.zeros((len(X), len(X)))
    K_test = np.zeros((9, len(X)))
    diag_test = np.zeros(9)
    for k in range(len(est.trajectory_) - 1):
        probe.module_.load_state_dict(est.trajectory_.state_dict(k))
        F, Ft = _loop_features(probe, X), _loop_features(probe, X[:9] * 0.9)
        K_train += est.trajectory_.learning_rates[k] * F @ F.T
        K_test += est.trajectory_.learning_rates[k] * Ft @ F.T
        diag_test += est.trajectory_.learning_rates[k] * np.einsum("ij,ij->i", Ft, Ft)
    if normalize:
        # Cosine normalization of the summed kernel (not of each step's).
        d = np.sqrt(np.diag(K_train))
        K_train, K_test = K_train / np.outer(d, d), K_test / np.outer(np.sqrt(diag_test), d)
    ref = SVC(kernel="precomputed", C=est.C_).fit(K_train, y)
    np.testing.assert_allclose(est.decision_function(X[:9] * 0.9), ref.decision_function(K_test),
                               rtol=1e-7, atol=1e-9)


def test_multiclass_string_labels_and_failed_fit_keeps_previous(regression_data):
    X, y = regression_data
    labels = np.array(["a", "b", "c"])[np.digitize(y, np.quantile(y, [0.33, 0.66]))]
    est = TangentFeatureSVM(PathKernelClassifier(**SMALL), C=10.0, svm_kernel="linear")
    est.fit(X, labels)
    assert est.classes_.tolist() == ["a", "b", "c"] and est.n_outputs_ == 3
    assert est.decision_function(X).shape == (len(X), 3)
    assert set(est.predict(X)) <= {"a", "b", "c"}
    assert est.score(X, labels) > 0.8
    svm, traj = est.svm_, est.trajectory_
    bad = X.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        est.fit(bad, labels)
    with pytest.raises(ValueError, match="class"):
        est.set_params(svm_kernel="tangent", normalize=False).fit(X, np.zeros(len(X)))
    assert est.svm_ is svm and est.trajectory_ is traj and est._svm_kernel == "linear"
    assert est._normalize is True
    # The linear SVM reads phi scaled to unit rows (normalize=True).
    np.testing.assert_array_equal(est.predict(X), svm.predict(_unit(est.transform(X))))


@pytest.mark.parametrize("svm_kernel", ["linear", "tangent", "path"])
def test_auto_C_of_a_normalized_kernel_is_on_the_documented_grid(circle, svm_kernel):
    """Normalized, C="auto"'s scale is 1: "linear" took the mean of its unit rows'
    rounded squared norms (C_ = 999.99999 in float32, where "tangent", the same SVM,
    chose 1000), and dead rows (phi = 0) moved the whole grid."""
    X, y = circle
    params = dict(SMALL, dtype="float32", max_iter=5 if svm_kernel == "path" else 30)
    est = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel=svm_kernel).fit(X, y)
    assert est.C_ in (0.1, 1.0, 10.0, 100.0, 1000.0)
    assert est.svm_.C == est.C_


@pytest.mark.parametrize("svm_kernel", ["tangent", "path", "linear"])
def test_small_svm_kernel_runs_on_one_thread_with_the_same_svm(circle, monkeypatch, svm_kernel):
    import torch

    from skpathkernel import kernels
    from skpathkernel._estimators import _features

    X, y = circle
    threads_seen = []
    for cls in (kernels.TangentKernel, kernels.PathKernel):
        def spy(self, *a, _gram=cls._gram, **k):
            threads_seen.append(torch.get_num_threads())
            return _gram(self, *a, **k)

        monkeypatch.setattr(cls, "_gram", spy)
    features = TangentFeatureSVM._tangent_features

    def counted_features(self, *a, **k):
        threads_seen.append(torch.get_num_threads())
        return features(self, *a, **k)

    monkeypatch.setattr(TangentFeatureSVM, "_tangent_features", counted_features)
    grams = []
    choose = _features._choose_C
    monkeypatch.setattr(_features, "_choose_C",
                        lambda gram, labels, *weights: grams.append(gram)
                        or choose(gram, labels, *weights))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = dict(SMALL, max_iter=5) if svm_kernel == "path" else SMALL
        est = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel=svm_kernel).fit(X, y)
        est.decision_function(X[:7])
        one = list(threads_seen)
        threads_seen.clear()
        # The reference: every kernel on torch's two threads, with the C chosen on one
        # (the Grams differ by rounding, which may tip a tie of C="auto"'s scores) and
        # with C="auto".
        monkeypatch.setattr(kernels, "KERNEL_SINGLE_THREAD_WORK", 0)
        ref = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel=svm_kernel,
                                C=est.C_).fit(X, y)
        ref_decision = ref.decision_function(X[:7])
        auto = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel=svm_kernel).fit(X, y)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    # 60 x 60 x 33 parameters: fit (training Gram or features) and the decision's rows on
    # one thread, and the caller's thread count left as it was.
    assert len(one) >= 2 and set(one) == {1}, one
    assert set(threads_seen) == {2} and after == 2, threads_seen
    np.testing.assert_allclose(est.decision_function(X[:7]), ref_decision, rtol=1e-12,
                               atol=1e-12)
    # The training Grams equal to rounding, and each run's C_ is the one that sklearn's
    # grid search picks on its own Gram (stratified 3-fold accuracy, the first best).
    assert len(grams) == 2
    np.testing.assert_allclose(grams[0], grams[1], rtol=1e-12, atol=1e-12)
    for fitted, gram in [(est, grams[0]), (auto, grams[1])]:
        # normalize=True (the default): the kernel's scale is 1.
        grid = [0.1, 1.0, 10.0, 100.0, 1000.0]
        search = GridSearchCV(SVC(kernel="precomputed"), {"C": grid},
                              cv=StratifiedKFold(3)).fit(gram, y)
        assert fitted.C_ == search.best_params_["C"]


# ----------------------------------------------------------------------------- seed figure 3
# Measured (seeds 0-3, 200 train / 200 test points, this network): the tangent-feature
# linear SVM scored 0.99-1.00 on both tasks; an RBF SVC on the raw inputs 0.89-0.92 on the
# circle and 0.635-0.695 on the ellipse.
FIG3 = dict(hidden_layer_sizes=(32, 32), solver="adam", learning_rate_init=0.01, max_iter=300,
            random_state=0)


@pytest.mark.parametrize("task", ["circle", "ellipse"])
def test_seed_figure_3_tangent_svm_beats_rbf(task):
    make = {"circle": lambda: make_circle(400, inner_radius_sq=0.9, random_state=0),
            "ellipse": lambda: make_ellipse(400, random_state=0)}[task]
    X, y = make()
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.5, random_state=0, stratify=y)
    tangent = TangentFeatureSVM(PathKernelClassifier(**FIG3)).fit(Xtr, ytr).score(Xte, yte)
    rbf = SVC(kernel="rbf").fit(Xtr, ytr).score(Xte, yte)
    assert tangent >= 0.95, (tangent, rbf)
    assert tangent > rbf, (tangent, rbf)


# ------------------------------------------------------- class_weight and probability (SVC's)
SHORT = dict(SMALL, max_iter=8, tol=None)


def _imbalanced(labels=("common", "rare")):
    """Overlapping classes, 48 against 12 (a multiple of 3 each: C="auto"'s stratified
    folds hold the classes in the proportions of the whole set)."""
    X, y = make_blobs(n_samples=[48, 12], centers=[[0, 0], [1.5, 1.5]], cluster_std=1.0,
                      random_state=2)
    return X, np.asarray(labels)[y]


def _svm_input(est, X, svm_kernel):
    """What the SVM reads, built from the fitted trainer by the public kernels and
    transform: unit rows of phi, or the cosine-normalized Gram against X_fit_."""
    if svm_kernel == "linear":
        # Divided by the norm rounded as the fit rounds it (summed in float64, divided in
        # the features' float32): libsvm stops at its tolerance (1e-3), where features an
        # ulp apart moved a fold's decision values by 1e-4.
        phi = est.transform(X)
        norms = np.sqrt(np.einsum("ij,ij->i", phi, phi, dtype=np.float64))[:, None]
        return phi / norms.astype(phi.dtype)
    kernel = {"tangent": TangentKernel, "path": PathKernel}[svm_kernel]
    return kernel(est.estimator_, normalized=True)(X, est.X_fit_)


def _platt_binary(scores, y, weights):
    """Platt's sigmoid (his smoothed targets, weighted log loss) fitted by scipy:
    P(y = classes[1] | s) = 1 / (1 + exp(a s + b))."""
    positive = y == np.unique(y)[1]
    n1, n0 = weights[positive].sum(), weights[~positive].sum()
    target = np.where(positive, (n1 + 1) / (n1 + 2), 1 / (n0 + 2))

    def loss(ab):
        z = -(ab[0] * scores + ab[1])
        return np.sum(weights * (np.logaddexp(0, z) - target * z))

    return minimize(loss, [0.0, 0.0], method="Nelder-Mead",
                    options=dict(xatol=1e-10, fatol=1e-14, maxiter=10_000)).x


@pytest.mark.parametrize("svm_kernel", ["linear", "tangent", "path"])
@pytest.mark.parametrize("class_weight", ["balanced", "dict"])
@pytest.mark.parametrize("labels", [("common", "rare"), (2, 1)])
def test_class_weight_and_probability_are_svcs_on_the_same_features(svm_kernel, class_weight,
                                                                    labels):
    """The SVM is sklearn's SVC(class_weight=...) on the features / Gram that the public
    transform and kernels give, and predict_proba Platt's sigmoid on its out-of-fold
    decision values (stratified 5-fold, each fold's SVC with the class weights of the
    whole set, as libsvm's), the weights (mean 1) in both. Labels (2, 1): the rare class
    is the first; CalibratedClassifierCV handed {1: 4} on the labels' indices weighed the
    other class."""
    X, y = _imbalanced(labels)
    common, rare = labels
    whole = {common: len(y) / (2 * 48), rare: len(y) / (2 * 12)}
    class_weight, fold_weight = (("balanced", whole) if class_weight == "balanced"
                                 else ({rare: 4.0}, {rare: 4.0}))
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(X))
    est = TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0,
                            svm_kernel=svm_kernel, class_weight=class_weight,
                            probability=True).fit(X, y, sample_weight=w)
    Xt = X[::4] + 0.3
    F, Ft = _svm_input(est, X, svm_kernel), _svm_input(est, Xt, svm_kernel)
    # At mean 1, rounded as the fit rounds them (one ulp in a sample's C moved a fold's
    # decision values, and Platt's slope, by 7e-5).
    w1 = w * (len(w) / w.sum())
    kernel = "linear" if svm_kernel == "linear" else "precomputed"
    ref = SVC(kernel=kernel, C=1.0, class_weight=class_weight).fit(F, y, sample_weight=w1)
    np.testing.assert_allclose(est.decision_function(Xt), ref.decision_function(Ft),
                               rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(est.predict(Xt), ref.predict(Ft))
    # Out-of-fold decision values, each fold's SVC weighted as the whole one.
    oof = np.empty(len(y))
    for tr, te in StratifiedKFold(5).split(F, y):
        fold = SVC(kernel=kernel, C=1.0, class_weight=fold_weight)
        if kernel == "linear":
            oof[te] = fold.fit(F[tr], y[tr], sample_weight=w1[tr]).decision_function(F[te])
        else:
            oof[te] = fold.fit(F[np.ix_(tr, tr)], y[tr], sample_weight=w1[tr]) \
                .decision_function(F[np.ix_(te, tr)])
    a, b = _platt_binary(oof, y, w1)
    expected = 1 / (1 + np.exp(a * ref.decision_function(Ft) + b))
    proba = est.predict_proba(Xt)
    assert est.classes_.tolist() == sorted(labels)
    np.testing.assert_allclose(proba[:, 1], expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(est.predict_log_proba(Xt), np.log(proba), rtol=1e-12)
    # svm_ is the fit of probability=False.
    plain = TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0,
                              svm_kernel=svm_kernel, class_weight=class_weight).fit(
        X, y, sample_weight=w)
    np.testing.assert_array_equal(est.decision_function(Xt), plain.decision_function(Xt))


def test_multiclass_probability_is_sklearns_calibrated_svc():
    """Several classes: scikit-learn's replacement of SVC(probability=True),
    CalibratedClassifierCV(SVC, ensemble=False), on the same Gram (classes of 30, 20
    and 10: each of its folds' "balanced" weights are the whole set's)."""
    X, y = make_blobs(n_samples=[30, 20, 10], centers=[[0, 0], [1.5, 1.5], [0, 2]],
                      random_state=0)
    est = TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0, class_weight="balanced",
                            probability=True).fit(X, y)
    K, Kt = _svm_input(est, X, "tangent"), _svm_input(est, X[::3] * 1.1, "tangent")
    ref = CalibratedClassifierCV(SVC(kernel="precomputed", C=1.0, class_weight="balanced"),
                                 ensemble=False, cv=StratifiedKFold(5)).fit(K, y)
    np.testing.assert_allclose(est.predict_proba(X[::3] * 1.1), ref.predict_proba(Kt),
                               rtol=1e-7, atol=1e-10)
    # predict is the SVM's, not the argmax of the probabilities (as SVC's).
    svm = ref.calibrated_classifiers_[0].estimator
    np.testing.assert_array_equal(est.predict(X[::3] * 1.1), svm.predict(Kt))


def test_balanced_moves_the_decisions_as_svcs_does():
    """On imbalanced classes "balanced" changes the predictions, towards the rare class,
    exactly as it changes SVC's on the same Gram (one frozen network for both)."""
    X, y = _imbalanced()
    clf = PathKernelClassifier(**SHORT).fit(X, y)
    K = TangentKernel(clf, normalized=True)(X)
    predictions = {}
    for class_weight in (None, "balanced"):
        est = TangentFeatureSVM(FrozenEstimator(clf), C=1.0, class_weight=class_weight)
        ref = SVC(kernel="precomputed", C=1.0, class_weight=class_weight).fit(K, y)
        predictions[class_weight] = est.fit(X, y).predict(X)
        np.testing.assert_array_equal(predictions[class_weight], ref.predict(K))
    rare = y == "rare"
    recall = {cw: np.mean(p[rare] == "rare") for cw, p in predictions.items()}
    assert recall["balanced"] > recall[None] + 0.2, recall


@pytest.mark.parametrize("class_weight", ["balanced", {"rare": 10.0}])
def test_auto_C_weighs_its_folds_by_class_weight(class_weight):
    """C="auto" is a grid search whose folds' SVMs weigh the classes as the final one does
    and whose score weighs them alike: with "balanced" (classes in the same proportion
    in every fold), sklearn's balanced accuracy."""
    X, y = _imbalanced()
    clf = PathKernelClassifier(**SHORT).fit(X, y)
    K = TangentKernel(clf, normalized=True)(X)
    if class_weight == "balanced":
        weights = {c: len(y) / (2 * np.sum(y == c)) for c in ("common", "rare")}
        scoring = "balanced_accuracy"
    else:
        weights = {"common": 1.0, **class_weight}

        def scoring(svm, K_te, y_te):
            return np.average(svm.predict(K_te) == y_te, weights=[weights[c] for c in y_te])
    search = GridSearchCV(SVC(kernel="precomputed", class_weight=weights),
                          {"C": [0.1, 1.0, 10.0, 100.0, 1000.0]}, scoring=scoring,
                          cv=StratifiedKFold(3)).fit(K, y)
    est = TangentFeatureSVM(FrozenEstimator(clf), class_weight=class_weight).fit(X, y)
    unweighted = TangentFeatureSVM(FrozenEstimator(clf)).fit(X, y)
    assert est.C_ == search.best_params_["C"]
    assert est.C_ != unweighted.C_  # the weights matter here


def test_probability_methods_exist_only_with_probability():
    X, y = _imbalanced()
    assert not hasattr(TangentFeatureSVM(), "predict_proba")
    assert not hasattr(TangentFeatureSVM(), "predict_log_proba")
    assert hasattr(TangentFeatureSVM(probability=True), "predict_proba")
    net = PathKernelClassifier(**SHORT)
    est = TangentFeatureSVM(net, C=1.0).fit(X, y)
    assert not hasattr(est, "predict_proba") and not hasattr(est, "calibrated_svm_")
    with pytest.raises(AttributeError, match="predict_proba") as info:
        est.predict_proba(X)
    assert "fitted with probability=False" in str(info.value.__cause__)
    # Fitted, the fit's choice: set_params changes no fitted SVM.
    assert not hasattr(est.set_params(probability=True), "predict_log_proba")
    est.fit(X, y)
    assert hasattr(est, "predict_proba") and hasattr(est, "predict_log_proba")
    assert not hasattr(est.set_params(probability=False).fit(X, y), "predict_proba")
    assert not hasattr(est, "calibrated_svm_")  # the earlier fit's model is gone


def test_bad_class_weight_and_too_small_a_class_fail_before_training(monkeypatch):
    """A label that is not a class (which SVC lets through where every class has a
    weight), a negative or zero weight, and probability=True with a class of one sample are
    refused before the network trains, and the previous fit is kept."""
    X, y = _imbalanced()
    est = TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0).fit(X, y)
    svm, trainer, before = est.svm_, est.estimator_, est.decision_function(X)
    monkeypatch.setattr(PathKernelClassifier, "fit",
                        lambda *a, **k: pytest.fail("the network was trained"))
    with pytest.raises(ValueError, match=r"class_weight has weights for \['other'\], which "
                                         r"are not classes of y: \['common', 'rare'\]"):
        est.set_params(class_weight={"common": 1, "rare": 2, "other": 3}).fit(X, y)
    with pytest.raises(ValueError, match="finite and positive; got {'rare': -1}"):
        est.set_params(class_weight={"rare": -1}).fit(X, y)
    # SVC fits a class of weight 0 with C = 0 and fails on non-finite dual coefficients.
    with pytest.raises(ValueError, match="finite and positive; got {'rare': 0.0}"):
        est.set_params(class_weight={"rare": 0.0}).fit(X, y)
    one = y.copy()
    one[np.flatnonzero(y == "rare")[1:]] = "common"
    with pytest.raises(ValueError, match="needs 2 samples of every class; class 'rare' has 1"):
        est.set_params(class_weight=None, probability=True).fit(X, one)
    with pytest.raises(ValueError, match="class_weight"):
        est.set_params(class_weight="unbalanced").fit(X, y)
    assert est.svm_ is svm and est.estimator_ is trainer
    np.testing.assert_array_equal(est.decision_function(X), before)
    assert not hasattr(est, "calibrated_svm_")


def test_probability_survives_pickle_and_routing():
    X, y = _imbalanced()
    w = np.random.default_rng(1).uniform(0.5, 2.0, len(X))
    est = TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0,
                            class_weight="balanced", probability=True).fit(X, y, sample_weight=w)
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(again.predict_proba(X), est.predict_proba(X))
    # With metadata routing, the calibration's SVC asks for the weights it is given.
    with sklearn.config_context(enable_metadata_routing=True):
        trainer = PathKernelClassifier(**SHORT).set_fit_request(
            sample_weight=True)
        routed = TangentFeatureSVM(trainer, C=1.0, class_weight="balanced", probability=True)
        routed.set_fit_request(sample_weight=True).fit(X, y, sample_weight=w)
    np.testing.assert_allclose(routed.predict_proba(X), est.predict_proba(X), rtol=1e-12)
    # A fit pickled before class_weight and probability existed loads with their defaults.
    state = dict(TangentFeatureSVM(PathKernelClassifier(**SHORT), C=1.0)
                 .fit(X, y).__getstate__())
    del state["class_weight"], state["probability"]
    old = TangentFeatureSVM.__new__(TangentFeatureSVM)
    old.__setstate__(state)
    assert old.get_params()["class_weight"] is None and not hasattr(old, "predict_proba")
    assert clone(old).get_params()["probability"] is False


def test_probability_with_a_class_early_stopping_leaves_one_sample_of_says_so():
    """y's two samples of a class pass the check before training; early stopping then
    holds one out, and the refusal said the class "has 1", which y contradicted."""
    X, y = _imbalanced()
    y = y.copy()
    y[np.flatnonzero(y == "rare")[2:]] = "common"
    net = PathKernelClassifier(**{**SHORT, "early_stopping": True,
                                  "validation_fraction": 0.3})
    with pytest.raises(ValueError, match=r"class 'rare' has 1 of the rows the network "
                                         r"trains on \(early stopping holds out 18 "):
        TangentFeatureSVM(net, probability=True).fit(X, y)


def test_probability_refuses_early_stopping_leaving_one_sample_before_training(monkeypatch):
    """The refusal came only after the network had trained (a configuration error cost a
    whole fit): the split that early stopping draws is known before it trains.

    3 'rare' samples in 60 with validation_fraction=0.5: the stratified split gives the
    training part 1 or 2 of them, by the draw (a tie of remainders), so the refusal
    depends on the seed, and must come exactly where the fit's own split leaves one.
    """
    X, y = _imbalanced()
    y = y.copy()
    y[np.flatnonzero(y == "rare")[3:]] = "common"
    trained = []
    fit = PathKernelClassifier._fit

    def spy(self, *args, **kwargs):
        trained.append(self.random_state)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(PathKernelClassifier, "_fit", spy)
    outcomes = set()
    for seed in [*range(8), np.random.RandomState(3), None]:
        if seed is None:
            # random_state=None draws from NumPy's legacy global generator.
            np.random.seed(5)  # noqa: NPY002
        net = PathKernelClassifier(**{**SHORT, "early_stopping": True,
                                      "validation_fraction": 0.5, "random_state": seed})
        trained.clear()
        try:
            est = TangentFeatureSVM(net, C=1.0, probability=True).fit(X, y)
        except ValueError as error:
            assert "class 'rare' has 1 of the rows the network trains on" in str(error)
            assert not trained, f"random_state={seed}: refused after training"
            outcomes.add("refused")
            continue
        assert trained
        assert np.sum(y[est.train_indices_] == "rare") == 2
        outcomes.add("fitted")
        if seed is None:
            # Reading the split did not draw from NumPy's global generator: the network
            # is the one a fit from the same global state trains.
            np.random.seed(5)  # noqa: NPY002
            alone = clone(net).fit(X, y)
            np.testing.assert_array_equal(est.train_indices_, alone.train_indices_)
            np.testing.assert_array_equal(est.estimator_.predict_proba(X),
                                          alone.predict_proba(X))
    assert outcomes == {"refused", "fitted"}


def test_normalized_features_are_unit_rows_where_the_float32_norm_overflows():
    """A float32 row of tangent features whose squared norm passes float32's range (an
    input at 1e25: features near 1e25, finite) became a zero row, with NumPy's overflow
    warning, under normalize=True; the normalized kernel refuses such inputs, naming the
    overflow, and the linear SVM on the unit rows predicted from its intercept alone."""
    import copy

    X, y = make_circle(n_samples=40, random_state=0)
    params = dict(hidden_layer_sizes=(8,), activation="relu", max_iter=5, tol=None,
                  random_state=0)
    Xq = np.vstack([X[:3], 1e25 * X[3:4]])
    tf = TangentFeatures(PathKernelClassifier(**params), normalize=True).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        phi = tf.transform(Xq)
    # Reference: float64 per-sample gradients of the final network, normalized in float64.
    ref = features_loop(copy.deepcopy(tf.module_).double(), Xq)
    assert np.linalg.norm(ref[-1]) > 1e20  # the squared norm overflows float32
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(phi, ref, atol=1e-6)
    svm = TangentFeatureSVM(PathKernelClassifier(**params), svm_kernel="linear", C=1.0).fit(X, y)
    train = features_loop(copy.deepcopy(svm.module_).double(), X)
    train /= np.linalg.norm(train, axis=1, keepdims=True)
    expected = SVC(kernel="linear", C=1.0).fit(train, y).decision_function(ref)
    np.testing.assert_allclose(svm.decision_function(Xq), expected, atol=1e-4)


def test_weights_routed_past_the_trainer_leaving_one_class_to_the_svm_refused_before_training(
        monkeypatch):
    """With metadata routing, a trainer that declines sample_weight trains on every row
    of early stopping's training part, while the SVM takes the weights on those rows:
    weights 0 on a class there (and positive on its held-out rows, which y's own check
    saw) failed in libsvm's words ("all samples with positive weights belong to the same
    class") after the network had trained."""
    X, y = _imbalanced()
    net = PathKernelClassifier(**{**SHORT, "early_stopping": True})
    rows = clone(net).fit(X, y).train_indices_  # the split of the same seed
    w = np.ones(len(y))
    w[rows[y[rows] == "rare"]] = 0.0
    assert w[y == "rare"].sum() > 0
    trained = []
    fit = PathKernelClassifier._fit
    monkeypatch.setattr(PathKernelClassifier, "_fit",
                        lambda self, *a, **k: trained.append(1) or fit(self, *a, **k))
    with sklearn.config_context(enable_metadata_routing=True):
        for probability in (False, True):
            est = TangentFeatureSVM(clone(net).set_fit_request(sample_weight=False), C=1.0,
                                    probability=probability)
            with pytest.raises(ValueError, match="sample_weight is 0 on every sample of "
                                                 "early_stopping's training part but those "
                                                 "of class 'common'"):
                est.set_fit_request(sample_weight=True).fit(X, y, sample_weight=w)
            assert not trained


@pytest.mark.parametrize("bad", [{"validation_fraction": 1.5},
                                 {"random_state": np.random.default_rng(0)}])
def test_probability_reads_early_stopping_split_after_the_trainer_checks_its_params(bad):
    """Reading the split before training must not read parameters that the trainer
    refuses: its own error, naming the parameter, as its fit alone gives it (they were
    read as a split of -30 training samples, and as a seed NumPy refused)."""
    X, y = _imbalanced()
    net = PathKernelClassifier(**{**SHORT, "early_stopping": True, **bad})
    name = next(iter(bad))
    with pytest.raises(InvalidParameterError, match=f"'{name}' parameter of "
                                                    "PathKernelClassifier must be"):
        clone(net).fit(X, y)
    with pytest.raises(InvalidParameterError, match=f"'{name}' parameter of "
                                                    "PathKernelClassifier must be"):
        TangentFeatureSVM(net, probability=True).fit(X, y)


@pytest.mark.parametrize("svm_kernel", ["tangent", "path"])
def test_an_overflowing_kernel_row_is_counted_over_the_rows_asked_for(svm_kernel):
    """predict pads a short block to 256 rows with copies of its first row: an input
    whose float32 kernel overflows, first in its block, was reported with the
    non-finite entries of every copy (15120 for 5 queries against 60 training points,
    more than the 300 entries asked for); the count is the kernel's own on these rows."""
    X, y = make_circle(n_samples=60, random_state=0)
    net = PathKernelClassifier(hidden_layer_sizes=(8,), activation="relu", max_iter=5,
                               tol=None, random_state=0)
    svm = TangentFeatureSVM(net, svm_kernel=svm_kernel, C=1.0).fit(X, y)
    Xq = np.vstack([1e30 * X[:1], X[1:5]])
    kernel = {"tangent": TangentKernel, "path": PathKernel}[svm_kernel]
    with pytest.raises(ValueError, match="non-finite entries") as direct:
        kernel(svm, normalized=True)(Xq, svm.X_fit_)
    count = int(str(direct.value).split("The kernel has ")[1].split()[0])
    assert 0 < count <= Xq.shape[0] * len(svm.X_fit_)
    with pytest.raises(ValueError, match=f"The kernel has {count} non-finite entries"):
        svm.predict(Xq)
