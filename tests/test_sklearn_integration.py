"""skpathkernel inside scikit-learn: kernels in sklearn models, pipelines, parallel search,
persistence (pickle, joblib, skops, across devices)."""

import io
import pickle
import re
import warnings
from pathlib import Path

import joblib
import numpy as np
import pytest
import skops.io as sio
import torch
from sklearn.base import clone
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.kernel_ridge import KernelRidge
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC, LinearSVC

import skpathkernel
from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel.datasets import make_circle
from skpathkernel.kernels import PathKernel, TangentKernel

# The old defaults, pinned: a fixed number of epochs (these small runs would warn of
# max_iter), tanh.
SMALL = dict(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=0.02, max_iter=20,
             tol=None, activation="tanh", dtype="float64", random_state=0)


@pytest.fixture(scope="module")
def circle():
    return make_circle(n_samples=60, random_state=0)


@pytest.fixture(scope="module")
def fitted(circle):
    X, y = circle
    return PathKernelClassifier(**SMALL).fit(X, y)


# ----------------------------------------------------------------------------- kernels
@pytest.fixture
def gram_calls(monkeypatch):
    """Shapes of every Gram the network kernels compute."""
    calls = []
    for cls in (TangentKernel, PathKernel):
        original = cls._gram

        def counted(self, X, Y, _original=original):
            calls.append((len(X), None if Y is None else len(Y)))
            return _original(self, X, Y)

        monkeypatch.setattr(cls, "_gram", counted)
    return calls


def test_svc_on_path_kernel_property_is_called_on_whole_matrices(fitted, circle, gram_calls):
    X, y = circle
    Xt = X[:10] * 1.1
    kernel = fitted.path_kernel_
    svc = SVC(kernel=kernel, C=5.0).fit(X, y)
    scores, labels = svc.decision_function(Xt), svc.predict(Xt)
    # One Gram for fit, one per prediction call: never one call per pair of samples.
    # SVC's fit calls kernel(X, X) with Y the same object as X: the symmetric K(X).
    assert gram_calls == [(60, None), (10, 60), (10, 60)]
    K, Kt = kernel(X), kernel(Xt, X)
    pre = SVC(kernel="precomputed", C=5.0).fit(K, y)
    np.testing.assert_array_equal(labels, pre.predict(Kt))
    # The same Gram as kernel(X), so the same solution (the rectangular route, taken
    # before, differed by float64 rounding, which libsvm's iterations amplified to
    # 1.03e-10 relative with scikit-learn 1.6.0 and NumPy 1.24).
    np.testing.assert_array_equal(scores, pre.decision_function(Kt))
    # The Gram is the explicit sum of step kernels (checked in test_kernels); here it must
    # at least be a symmetric PSD matrix, or libsvm's solution means nothing.
    np.testing.assert_allclose(K, K.T, rtol=1e-12)
    assert np.linalg.eigvalsh(K).min() > -1e-8 * np.abs(K).max()


def test_kernel_ridge_and_gpr_call_the_kernel_on_whole_matrices(circle, gram_calls):
    X, y = circle
    reg = PathKernelMachine(**SMALL).fit(X, y.astype(float))
    kernel = reg.tangent_kernel_
    ridge = KernelRidge(kernel=kernel, alpha=0.1).fit(X, y)
    ridge.predict(X[:5])
    gpr = GaussianProcessRegressor(kernel=kernel, alpha=0.1, optimizer=None).fit(X, y)
    mean = gpr.predict(X[:5])
    assert len(gram_calls) <= 5 and all(n >= 5 for n, _ in gram_calls), gram_calls
    assert (60, None) in gram_calls and (5, 60) in gram_calls
    # Noise alpha on the GP's training covariance is ridge's alpha: same posterior mean.
    np.testing.assert_allclose(mean, ridge.predict(X[:5]), rtol=1e-8)


def test_clone_of_svc_and_grid_search_keep_the_fitted_kernel(fitted, circle):
    X, y = circle
    svc = SVC(kernel=fitted.tangent_kernel_)
    copy = clone(svc)
    assert copy.kernel is not svc.kernel and copy.kernel.estimator is fitted
    search = GridSearchCV(svc, {"C": [0.1, 10.0]}, cv=3).fit(X, y)
    assert search.best_estimator_.kernel.estimator is fitted
    assert search.best_score_ > 0.5


# ----------------------------------------------------------------------------- pipelines
def test_pipeline_cross_val_score_and_clone(circle):
    X, y = circle
    params = dict(SMALL, hidden_layer_sizes=(16,), max_iter=150)
    pipe = make_pipeline(StandardScaler(),
                         TangentFeatures(PathKernelClassifier(**params), normalize=True),
                         LinearSVC())
    with warnings.catch_warnings():
        # Unit-norm tangent features keep liblinear well conditioned: it must converge.
        warnings.simplefilter("error")
        scores = cross_val_score(pipe, X, y, cv=3)
    assert scores.shape == (3,) and scores.mean() > 0.8
    unfitted = clone(pipe)
    assert unfitted.get_params()["tangentfeatures__normalize"] is True
    assert not hasattr(unfitted[1], "module_")
    pipe.fit(X, y)
    names = pipe[:-1].get_feature_names_out()
    assert len(names) == pipe[1].n_params_ and names[0] == "0.weight[0]"


class _ThreadProbe(PathKernelClassifier):
    """Records torch's intra-op thread count seen while fitting."""

    def fit(self, X, y):
        super().fit(X, y)
        self.torch_threads_in_fit_ = torch.get_num_threads()
        return self


def _threads_scorer(est, X, y):
    return est.torch_threads_in_fit_


def _search(n_jobs, X, y):
    grid = {"learning_rate_init": [0.01, 0.05]}
    scoring = {"accuracy": "accuracy", "threads": _threads_scorer}
    return GridSearchCV(_ThreadProbe(**{**SMALL, "max_iter": 15}), grid, cv=2, n_jobs=n_jobs,
                        scoring=scoring, refit="accuracy").fit(X, y)


def test_grid_search_in_workers_limits_torch_threads_and_matches_serial(circle):
    X, y = circle
    serial = _search(1, X, y)
    parallel = _search(2, X, y)
    np.testing.assert_allclose(parallel.cv_results_["mean_test_accuracy"],
                               serial.cv_results_["mean_test_accuracy"], rtol=1e-12)
    # joblib's loky workers start with OMP_NUM_THREADS = cpu_count // n_jobs, and torch's
    # OpenMP pool reads it when it starts: the workers do not oversubscribe the cores.
    expected = max(joblib.cpu_count() // 2, 1)
    threads = parallel.cv_results_["mean_test_threads"]
    np.testing.assert_array_equal(threads, expected)
    # The limit comes from joblib, not from a default: another cap gives another count.
    other = 1 if expected > 1 else 2
    with joblib.parallel_config(backend="loky", inner_max_num_threads=other):
        capped = _search(2, X, y)
    np.testing.assert_array_equal(capped.cv_results_["mean_test_threads"], other)


# ----------------------------------------------------------------------------- persistence
def _estimators(circle):
    X, y = circle
    return [
        PathKernelClassifier(**SMALL).fit(X, y),
        TangentFeatures(PathKernelClassifier(**SMALL), n_components=16,
                        random_state=0).fit(X, y),
        TangentFeatureSVM(PathKernelClassifier(**SMALL), svm_kernel="path").fit(X, y),
        OODRankDetector(PathKernelMachine(**SMALL)).fit(X),
    ]


def _assert_same_fit(a, b, X):
    for method in ("predict", "decision_function", "transform"):
        if hasattr(a, method):
            np.testing.assert_array_equal(getattr(b, method)(X), getattr(a, method)(X))
    ta, tb = a.trajectory_, b.trajectory_
    assert len(ta) == len(tb) and ta.state_keys == tb.state_keys
    for k in range(len(ta)):
        assert torch.equal(ta.parameters(k), tb.parameters(k))
    for k in range(len(ta) - 1):
        for key, value in ta.optimizer_state(k).items():
            assert torch.equal(value, tb.optimizer_state(k)[key])
    np.testing.assert_array_equal(np.concatenate(ta.batches), np.concatenate(tb.batches))
    for pa, pb in zip(a.module_.parameters(), b.module_.parameters()):
        assert torch.equal(pa, pb) and pa.dtype == pb.dtype


def test_pickle_and_joblib_round_trips_are_exact(circle):
    X, _ = circle
    for est in _estimators(circle):
        _assert_same_fit(est, pickle.loads(pickle.dumps(est)), X)
        buffer = io.BytesIO()
        joblib.dump(est, buffer)
        buffer.seek(0)
        _assert_same_fit(est, joblib.load(buffer), X)
        # Pickling does not disturb the pickled estimator.
        assert isinstance(est.module_, torch.nn.Module)
    decomposed = _estimators(circle)[0]
    again = pickle.loads(pickle.dumps(decomposed))
    np.testing.assert_array_equal(again.decompose(X[:3]).contributions,
                                  decomposed.decompose(X[:3]).contributions)


def test_cuda_trained_estimator_loads_on_the_cpu_with_a_warning(circle, monkeypatch):
    X, y = circle
    est = PathKernelClassifier(**SMALL).fit(X, y)
    expected, phi = est.decision_function(X), est.transform(X[:4])
    # What a CUDA fit leaves behind: device_="cuda". The state carries NumPy arrays only,
    # so the module's device at pickling time does not matter.
    est.device_ = "cuda"
    blob = pickle.dumps(est)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="trained on CUDA.*loaded onto the CPU"):
        loaded = pickle.loads(blob)
    assert loaded.device_ == "cpu"
    assert all(p.device.type == "cpu" for p in loaded.module_.parameters())
    np.testing.assert_array_equal(loaded.decision_function(X), expected)
    np.testing.assert_array_equal(loaded.transform(X[:4]), phi)


def test_skops_round_trip_trusts_only_skpathkernel_types(circle):
    X, _ = circle
    for est in _estimators(circle):
        blob = sio.dumps(est)
        untrusted = sio.get_untrusted_types(data=blob)
        assert untrusted, "skops must ask to trust the estimator's own types"
        assert all(t.startswith("skpathkernel.") for t in untrusted), untrusted
        _assert_same_fit(est, sio.loads(blob, trusted=untrusted), X)


def test_every_torch_load_is_weights_only():
    source = Path(skpathkernel.__file__).parent
    calls = 0
    for path in source.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            calls += 1
            depth, end = 0, match.end() - 1
            for end in range(match.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            assert "weights_only=True" in text[match.start() : end], f"{path}: {match.start()}"
    assert calls >= 1  # Trajectory.load
