"""The kernels, the diagnostics and the displays take a fitted Pipeline or search as
scikit-learn's users hold them: the network of the estimator inside, on the inputs the
pipeline's earlier steps produce.

The references are computed by hand: the transforms in NumPy from the training data
(the scaler's mean and standard deviation, the columns a ColumnTransformer selects), and
the Gram ``J J^T`` from a float64 per-sample autograd loop over the network at the
recorded point (``tests/_reference.py``); nothing comes from ``pipe[:-1].transform``
or from the kernels' own engine."""

import pickle
import re

import numpy as np
import pandas as pd
import pytest
from _reference import jacobian_loop, module_at
from sklearn.base import clone
from sklearn.compose import ColumnTransformer, TransformedTargetRegressor
from sklearn.ensemble import BaggingRegressor
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import GridSearchCV, RandomizedSearchCV
from sklearn.multioutput import MultiOutputRegressor, RegressorChain
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from sklearn.svm import SVC

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.diagnostics import hessian_trace, loss_path
from skpathkernel.kernels import PathKernel, TangentKernel, step_kernel
from skpathkernel.metrics import retrain_on_subsets
from skpathkernel.plotting import KernelEvolutionDisplay, KernelMatrixDisplay

LR = 0.05
NET = dict(hidden_layer_sizes=(5,), activation="tanh", solver="sgd", learning_rate_init=LR,
           max_iter=4, tol=None, record_every=1, dtype="float64", random_state=0)
SCALES = np.array([1.0, 10.0, 100.0])


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3)) * SCALES + [0.0, 5.0, -50.0]
    y = np.where(X[:, 0] + X[:, 1] / 10 > 0, 1, 0)
    return X, y


def _scaled(X, X_train):
    """StandardScaler by hand: the training data's mean and (population) deviation."""
    return (X - X_train.mean(axis=0)) / X_train.std(axis=0)


def _gram(est, Z, W=None, point=-1):
    """``trace(J(z) J(w)^T) / C`` from the per-sample autograd loop, in float64."""
    module = module_at(est, point)
    JZ = jacobian_loop(module, Z).numpy()
    JW = JZ if W is None else jacobian_loop(module, W).numpy()
    return np.einsum("ncp,mcp->nm", JZ, JW) / JZ.shape[1]


def _path_gram(est, Z, W=None):
    """Plain SGD, constant step size, every step recorded: ``sum_k lr J_k J_k^T`` over
    the points with a step leaving them."""
    return sum(LR * _gram(est, Z, W, point=k) for k in range(len(est.trajectory_) - 1))


def _pipelines(X, y):
    """Fitted pipelines and their transforms by hand, in the forms users build them."""
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    nested = make_pipeline(
        make_pipeline(StandardScaler(), "passthrough"),
        Pipeline([("none", None), ("tail", make_pipeline(FunctionTransformer(np.tanh),
                                                         PathKernelClassifier(**NET)))]))
    columns = make_pipeline(
        ColumnTransformer([("scale", StandardScaler(), ["a", "c"]),
                           ("keep", "passthrough", ["b"])]),
        PathKernelClassifier(**NET)).set_output(transform="pandas")
    return {
        "scaler": (make_pipeline(StandardScaler(), PathKernelClassifier(**NET)).fit(X, y),
                   X, lambda A: _scaled(A, X)),
        # Nested pipelines, passthrough and None steps: the network is two levels down.
        "nested": (nested.fit(X, y), X, lambda A: np.tanh(_scaled(A, X))),
        # A DataFrame by column names, and pandas output between the steps.
        "columns": (columns.fit(frame, y), frame,
                    lambda A: np.c_[_scaled(np.asarray(A)[:, [0, 2]], X[:, [0, 2]]),
                                    np.asarray(A)[:, 1]]),
    }


def _network(pipe):
    while isinstance(pipe, Pipeline):
        pipe = pipe[-1]
    return pipe


@pytest.mark.parametrize("kind", ["scaler", "nested", "columns"])
def test_kernels_of_a_pipeline_are_its_networks_on_the_transformed_inputs(data, kind):
    """TangentKernel(pipe) raised TypeError ("pass its last step, pipe[-1], on inputs
    transformed by the steps before it"): it is that kernel, on raw inputs."""
    X, y = data
    pipe, raw, by_hand = _pipelines(X, y)[kind]
    est = _network(pipe)
    A, B = raw[:7], raw[7:12]
    ZA, ZB = by_hand(A), by_hand(B)
    np.testing.assert_allclose(TangentKernel(pipe)(A), _gram(est, ZA), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(TangentKernel(pipe)(A, B), _gram(est, ZA, ZB), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(TangentKernel(pipe).diag(A), np.diag(_gram(est, ZA)),
                               rtol=1e-9)
    np.testing.assert_allclose(step_kernel(pipe, A, B, step=0), _gram(est, ZA, ZB, point=0),
                               rtol=1e-9, atol=1e-12)
    path = _path_gram(est, ZA)
    kernel = PathKernel(pipe)
    np.testing.assert_allclose(kernel(A), path, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(kernel.diag(A), np.diag(path), rtol=1e-9)
    # Two workers: the rows split before the network, after the steps, as serially.
    np.testing.assert_allclose(PathKernel(pipe, n_jobs=2)(A, B), _path_gram(est, ZA, ZB),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(TangentKernel(pipe, normalized=True, n_jobs=2)(A),
                               TangentKernel(pipe, normalized=True)(A), rtol=1e-12)


def test_svc_on_a_pipelines_kernel_is_svc_on_the_hand_computed_gram(data):
    X, y = data
    pipe, _, by_hand = _pipelines(X, y)["scaler"]
    train, test = slice(0, 18), slice(18, None)
    Z = by_hand(X)
    for kernel, gram in ((TangentKernel(pipe), _gram), (PathKernel(pipe), _path_gram)):
        svc = SVC(kernel=kernel, C=10.0).fit(X[train], y[train])
        ref = SVC(kernel="precomputed", C=10.0).fit(gram(pipe[-1], Z[train]), y[train])
        np.testing.assert_allclose(
            svc.decision_function(X[test]),
            ref.decision_function(gram(pipe[-1], Z[test], Z[train])), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("search", [GridSearchCV, RandomizedSearchCV])
def test_a_refitted_search_stands_for_its_best_estimator(data, search):
    """A search over a pipeline: its best_estimator_ (a pipeline, refitted on all of X),
    on X as the search got it; SVC on its kernel is SVC on the hand-computed Gram."""
    X, y = data
    grid = {"pathkernelclassifier__alpha": [0.0, 0.1]}
    kw = dict(n_iter=2, random_state=0) if search is RandomizedSearchCV else {}
    found = search(make_pipeline(StandardScaler(), PathKernelClassifier(**NET)), grid,
                   cv=2, **kw).fit(X, y)
    est = found.best_estimator_[-1]
    Z = _scaled(X, X)
    np.testing.assert_allclose(TangentKernel(found)(X[:6], X[6:9]),
                               _gram(est, Z[:6], Z[6:9]), rtol=1e-9, atol=1e-12)
    svc = SVC(kernel=PathKernel(found)).fit(X[:18], y[:18])
    ref = SVC(kernel="precomputed").fit(_path_gram(est, Z[:18]), y[:18])
    np.testing.assert_allclose(svc.decision_function(X[18:]),
                               ref.decision_function(_path_gram(est, Z[18:], Z[:18])),
                               rtol=1e-7, atol=1e-9)
    # A search of the estimator itself: X as it is.
    plain = search(PathKernelClassifier(**NET), {"alpha": [0.0]}, cv=2,
                   **({} if search is GridSearchCV else dict(n_iter=1))).fit(X[:, :1], y)
    np.testing.assert_allclose(TangentKernel(plain)(X[:5, :1]),
                               _gram(plain.best_estimator_, X[:5, :1]), rtol=1e-9,
                               atol=1e-12)


def test_a_search_over_frozen_pipelines_compares_their_networks(data):
    """The guide compares fitted networks in a search as frozen ones
    (kernel__estimator: [FrozenEstimator(a), FrozenEstimator(b)]); a frozen pipeline
    forwards no network_ and was refused in every fit of the search."""
    X, y = data
    pipes = [make_pipeline(StandardScaler(), PathKernelClassifier(
        **{**NET, "random_state": seed})).fit(X, y) for seed in (0, 1)]
    Z = _scaled(X, X)
    np.testing.assert_allclose(TangentKernel(FrozenEstimator(pipes[1]))(X[:5]),
                               _gram(pipes[1][-1], Z[:5]), rtol=1e-9, atol=1e-12)
    search = GridSearchCV(SVC(kernel=TangentKernel(pipes[0])),
                          {"kernel__estimator": [FrozenEstimator(p) for p in pipes]},
                          cv=2, error_score="raise").fit(X[:18], y[:18])
    chosen = search.best_estimator_.kernel.estimator.estimator
    assert any(chosen is p for p in pipes)
    ref = SVC(kernel="precomputed").fit(_gram(chosen[-1], Z[:18]), y[:18])
    np.testing.assert_allclose(search.decision_function(X[18:]),
                               ref.decision_function(_gram(chosen[-1], Z[18:], Z[:18])),
                               rtol=1e-7, atol=1e-9)


def test_the_diagnostics_and_displays_follow_a_search_of_a_pipeline(data):
    """hessian_trace, loss_path and the displays took a Pipeline (s54) but refused a search
    around one: they read the same network as its last step on hand-scaled inputs."""
    X, y = data
    found = GridSearchCV(make_pipeline(StandardScaler(), PathKernelClassifier(**NET)),
                         {"pathkernelclassifier__alpha": [0.0]}, cv=2).fit(X, y)
    est, Z = found.best_estimator_[-1], _scaled(X, X)
    np.testing.assert_allclose(loss_path(found, X, y), loss_path(est, Z, y), rtol=1e-12)
    a = hessian_trace(found, X, y, n_samples=4, random_state=0)
    b = hessian_trace(est, Z, y, n_samples=4, random_state=0)
    np.testing.assert_allclose(a.estimates, b.estimates, rtol=1e-12)
    shown = KernelMatrixDisplay.from_estimator(found, X[:6], normalized=False).kernel_matrix
    np.testing.assert_allclose(shown, _gram(est, Z[:6]), rtol=1e-9, atol=1e-12)
    # The one-input display, whose x has no sample axis, through the search too.
    evolution = KernelEvolutionDisplay.from_estimator(found, X[0], X[1:4], normalized=False)
    np.testing.assert_allclose(evolution.kernel_values[-1], _gram(est, Z[:1], Z[1:4])[0],
                               rtol=1e-9)


def test_column_names_are_checked_by_the_pipelines_steps(data):
    """A DataFrame reaches the ColumnTransformer by its names: reordered columns give the
    same kernel (the transformer selects by name), missing ones are refused."""
    X, y = data
    pipe, frame, by_hand = _pipelines(X, y)["columns"]
    K = TangentKernel(pipe)(frame[:5])
    np.testing.assert_allclose(K, _gram(pipe[-1], by_hand(frame[:5])), rtol=1e-9,
                               atol=1e-12)
    with pytest.raises((ValueError, KeyError), match="b"):
        TangentKernel(pipe)(frame[["a", "c"]][:5])


def test_a_kernel_holding_a_pipeline_is_an_sklearn_kernel(data):
    X, y = data
    pipe, _, _ = _pipelines(X, y)["scaler"]
    kernel = PathKernel(pipe, normalized=True)
    assert kernel.get_params()["estimator"] is pipe
    assert clone(kernel).estimator is pipe and clone(kernel) == kernel
    assert kernel.theta.shape == (0,) and kernel.bounds.size == 0
    other = make_pipeline(StandardScaler(), PathKernelClassifier(**NET)).fit(X, y)
    assert kernel.set_params(estimator=other).estimator is other
    assert kernel != PathKernel(pipe, normalized=True)
    with pytest.raises(ValueError, match="estimator__"):
        kernel.set_params(estimator__steps=[])
    copy = pickle.loads(pickle.dumps(TangentKernel(pipe)))
    np.testing.assert_allclose(copy(X[:5]), _gram(pipe[-1], _scaled(X[:5], X)), rtol=1e-9,
                               atol=1e-12)


def test_the_gram_memo_sees_the_rows_after_the_steps_and_a_refitted_pipeline(data):
    """The memo of a search's Gram (K(X, eval_gradient=True)) keys the rows the network
    sees: refitting the scaler alone, or the whole pipeline, gives the new Gram."""
    X, y = data
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**NET)).fit(X, y)
    kernel = TangentKernel(pipe)
    A = X[:6]
    K, grad = kernel(A, eval_gradient=True)
    np.testing.assert_allclose(K, _gram(pipe[-1], _scaled(A, X)), rtol=1e-9, atol=1e-12)
    assert grad.shape == (6, 6, 0)
    pipe[0].fit(X[:12])  # another scaling, the same network
    np.testing.assert_allclose(kernel(A, eval_gradient=True)[0],
                               _gram(pipe[-1], _scaled(A, X[:12])), rtol=1e-9, atol=1e-12)
    pipe.fit(X[::-1] * 2, y[::-1])  # another network and scaling
    np.testing.assert_allclose(kernel(A, eval_gradient=True)[0],
                               _gram(pipe[-1], _scaled(A, 2 * X)), rtol=1e-9, atol=1e-12)


def _regression():
    rng = np.random.RandomState(1)
    X = rng.normal(size=(16, 3))
    return X, 0.5 * np.tanh(X[:, 0] - X[:, 1])


@pytest.mark.parametrize("wrapper", ["bag", "multi_output", "chain", "transformed_target",
                                     "pipeline_of_transformed", "search_of_transformed",
                                     "pipeline_of_bag", "pipeline_of_multi_output",
                                     "search_of_chain"])
def test_wrappers_whose_network_saw_other_inputs_or_targets_keep_their_hints(wrapper):
    X, y = _regression()
    reg = PathKernelMachine(**NET)
    ttr = TransformedTargetRegressor(reg, func=np.arctanh, inverse_func=np.tanh,
                                     check_inverse=False)
    obj, hint = {
        "bag": (BaggingRegressor(reg, n_estimators=2, max_features=2, random_state=0),
                r"estimators_\[0\] holds one"),
        "multi_output": (MultiOutputRegressor(reg), "one fitted estimator per target"),
        "chain": (RegressorChain(reg), r"estimators_\[0\] holds one"),
        "transformed_target": (ttr, "regressor_, whose network was trained on the "
                                    "transformed targets"),
        "pipeline_of_transformed": (make_pipeline(StandardScaler(), ttr),
                                    re.escape("pipe[-1].regressor_") + ".*"
                                    + re.escape("pipe[:-1].transform(X)")),
        "search_of_transformed": (GridSearchCV(ttr, {"regressor__alpha": [0.0]}, cv=2),
                                  re.escape("best_estimator_.regressor_")),
        # Inside a pipeline or a search, the bag's and the per-target hints name the way
        # to them (they said "Pipeline exposes no fitted network" and nothing more).
        "pipeline_of_bag": (make_pipeline(StandardScaler(), BaggingRegressor(
            reg, n_estimators=2, max_features=2, random_state=0)),
            re.escape("pipe[-1].estimators_[0] holds one")),
        "pipeline_of_multi_output": (make_pipeline(StandardScaler(), MultiOutputRegressor(reg)),
                                     re.escape("pipe[-1].estimators_[i]") + ".*"
                                     + re.escape("pipe[:-1].transform(X)")),
        "search_of_chain": (GridSearchCV(RegressorChain(reg), {"order": [None]}, cv=2),
                            re.escape("best_estimator_.estimators_[0] holds one")),
    }[wrapper]
    multi = wrapper in ("multi_output", "chain", "pipeline_of_multi_output",
                        "search_of_chain")
    obj.fit(X, np.c_[y, -y] if multi else y)
    for call in (lambda: TangentKernel(obj)(X), lambda: PathKernel(obj).diag(X),
                 lambda: step_kernel(obj, X), lambda: loss_path(obj),
                 lambda: KernelMatrixDisplay.from_estimator(obj, X[:4])):
        with pytest.raises(TypeError, match=hint):
            call()


def test_unfitted_pipelines_and_searches_and_refit_false_are_refused(data):
    X, y = data
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**NET))
    search = GridSearchCV(pipe, {"pathkernelclassifier__alpha": [0.0]}, cv=2)
    for obj in (pipe, search):
        for call in (lambda o: TangentKernel(o)(X), lambda o: PathKernel(o).diag(X),
                     lambda o: hessian_trace(o, X, y)):
            with pytest.raises(NotFittedError):
                call(obj)
    no_refit = clone(search).set_params(refit=False).fit(X, y)
    with pytest.raises(TypeError, match="refit=False keeps no fitted estimator"):
        TangentKernel(no_refit)(X)
    # Also where a pipeline holds it (the message said only "exposes no fitted network").
    inside = make_pipeline(StandardScaler(), GridSearchCV(
        PathKernelClassifier(**NET), {"alpha": [0.0]}, cv=2, refit=False)).fit(X, y)
    with pytest.raises(TypeError, match="refit=False keeps no fitted estimator"):
        TangentKernel(inside)(X)
    # A pipeline ending in passthrough holds no network.
    ends = make_pipeline(StandardScaler(), "passthrough").fit(X, y)
    with pytest.raises(TypeError, match="exposes no fitted network"):
        TangentKernel(ends)(X)


def test_a_search_fitted_again_without_refit_is_not_read_through_its_old_best(data):
    """scikit-learn leaves the best_estimator_ of an earlier refit=True fit on a search
    fitted again with refit=False, and its predict refuses it (refit=False): the kernels,
    the diagnostics and the replay read it as the search's, silently, a network the
    search's last fit never chose (other data here, three times the scale)."""
    X, y = data
    search = GridSearchCV(make_pipeline(StandardScaler(), PathKernelClassifier(**NET)),
                          {"pathkernelclassifier__alpha": [0.0]}, cv=2).fit(X, y)
    search.set_params(refit=False).fit(X[:12] * 3, y[:12])
    assert hasattr(search, "best_estimator_")  # the stale one, as scikit-learn leaves it
    with pytest.raises(AttributeError):
        search.predict(X[:2])
    for call in (lambda: TangentKernel(search)(X), lambda: PathKernel(search).diag(X),
                 lambda: step_kernel(search, X), lambda: loss_path(search, X, y),
                 lambda: KernelMatrixDisplay.from_estimator(search, X[:4]),
                 lambda: retrain_on_subsets(search, X, y, X[:2], y[:2], n_subsets=2,
                                            protocol="replay")):
        with pytest.raises(TypeError, match="refit=False"):
            call()


def test_the_one_input_display_checks_the_names_of_an_input_the_steps_leave(data):
    """KernelEvolutionDisplay takes its x through the wrapper as a one-row frame, then
    the row: through a FrozenEstimator, a search or a passthrough pipeline no step checks
    the frame's names, and the row (a Series) has none to check, so an x of reordered
    columns was read by position (a refused one in the network's own display)."""
    X, y = data
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    net = PathKernelClassifier(**NET).fit(frame, y)
    search = GridSearchCV(PathKernelClassifier(**NET), {"alpha": [0.0]}, cv=2).fit(frame, y)
    through = Pipeline([("keep", "passthrough"), ("net", PathKernelClassifier(**NET))])
    through.fit(frame, y)
    for wrapped, est in ((FrozenEstimator(net), net), (search, search.best_estimator_),
                         (through, through[-1])):
        shown = KernelEvolutionDisplay.from_estimator(wrapped, frame.iloc[0], frame[1:4],
                                                      normalized=False)
        np.testing.assert_allclose(shown.kernel_values[-1], _gram(est, X[:1], X[1:4])[0],
                                   rtol=1e-9)
        for x in (frame.iloc[0][["c", "b", "a"]], frame[["c", "b", "a"]][:1]):
            with pytest.raises(ValueError, match="feature names"):
                KernelEvolutionDisplay.from_estimator(wrapped, x, frame[1:4])
