"""The meta-estimators take their network trainer as ``estimator=`` (issue 29).

TangentFeatures, TangentFeatureSVM and OODRankDetector own no training parameter: the
trainer's parameters reach the network, a FrozenEstimator's network is read without a
refit, nor is a RecordedNetwork (a user's own loop), GridSearchCV reaches the network as
``estimator__<name>``, and anything but a skpathkernel trainer is refused with a message
naming it.
"""

import inspect
import pickle
import re
import warnings

import numpy as np
import pytest
import sklearn
import torch
from _reference import features_loop, module_at, own_loop
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.base import clone
from sklearn.calibration import CalibratedClassifierCV
from sklearn.compose import TransformedTargetRegressor
from sklearn.datasets import make_multilabel_classification
from sklearn.ensemble import BaggingRegressor
from sklearn.exceptions import NotFittedError, UnsetMetadataPassedError
from sklearn.frozen import FrozenEstimator
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import GridSearchCV, KFold, cross_validate
from sklearn.multioutput import MultiOutputRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC
from sklearn.utils import get_tags
from sklearn.utils.multiclass import type_of_target

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
)
from skpathkernel.datasets import make_circle
from skpathkernel.metrics import retrain_on_subsets

SMALL = dict(hidden_layer_sizes=(8,), solver="adam", learning_rate_init=0.02, max_iter=20,
             tol=None, dtype="float64", random_state=0)
META = (TangentFeatures, TangentFeatureSVM, OODRankDetector)


@pytest.fixture(scope="module")
def circle():
    return make_circle(n_samples=60, random_state=0)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_at_most_ten_parameters_and_init_only_stores(cls):
    params = inspect.signature(cls.__init__).parameters
    assert len(params) - 1 <= 10
    assert list(params)[1] == "estimator" and params["estimator"].default is None
    est = cls(estimator="anything")  # validated at fit, as scikit-learn does
    assert est.get_params(deep=False)["estimator"] == "anything"


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_trainer_parameters_reach_the_network(cls, circle):
    X, y = circle
    net = PathKernelClassifier(**{**SMALL, "hidden_layer_sizes": (5, 3)}, activation="tanh")
    est = cls(net).fit(X, y)
    assert est.estimator_ is not net and not hasattr(net, "network_")  # a clone was fitted
    assert est.estimator_.get_params() == net.get_params()
    linear = [m for m in est.module_.modules() if isinstance(m, torch.nn.Linear)]
    assert [m.out_features for m in linear] == [5, 3, 1]
    assert any(isinstance(m, torch.nn.Tanh) for m in est.module_.modules())
    assert est.dtype_ == "float64" and est.n_params_ == 2 * 5 + 5 + 5 * 3 + 3 + 3 + 1
    assert len(est.loss_curve_) == SMALL["max_iter"]
    # The network is the trainer's own, trained as the trainer alone trains it.
    ref = clone(net).fit(X, y)
    np.testing.assert_array_equal(est.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    assert est.network_.trajectory is est.estimator_.trajectory_


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_a_frozen_trainer_is_read_as_it_is(cls, circle):
    X, y = circle
    clf = PathKernelClassifier(**SMALL).fit(X, y)
    net, traj, module = clf.network_, clf.trajectory_, clf.module_
    est = cls(FrozenEstimator(clf)).fit(X, y)
    # Not refitted: the same network object, trajectory and module.
    assert est.estimator_ is clf and clf.network_ is net
    assert est.trajectory_ is traj and est.module_ is module
    # clone (and so GridSearchCV) keeps the frozen trainer fitted.
    again = clone(est).fit(X, y)
    assert again.estimator_ is clf and clf.trajectory_ is traj
    # The same results as the meta-estimator that trains the same network itself.
    own = cls(PathKernelClassifier(**SMALL)).fit(X, y)
    Xq = X[:7] * 1.3
    method = {TangentFeatures: "transform", TangentFeatureSVM: "decision_function",
              OODRankDetector: "score_samples"}[cls]
    np.testing.assert_allclose(getattr(est, method)(Xq), getattr(own, method)(Xq),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_a_frozen_trainer_refuses_named_columns_in_another_order(cls, circle):
    """The frozen trainer's columns are the network's inputs: reordered ones were taken by
    position, silently computing on the wrong features (this estimator's own names are
    reset by its fit)."""
    pd = pytest.importorskip("pandas")
    X, y = circle
    df = pd.DataFrame(X, columns=["a", "b"])
    clf = PathKernelClassifier(**SMALL).fit(df, y)
    with pytest.raises(ValueError, match="feature names should match"):
        cls(FrozenEstimator(clf)).fit(df[["b", "a"]], y)
    est = cls(FrozenEstimator(clf)).fit(df, y)
    np.testing.assert_array_equal(est.feature_names_in_, ["a", "b"])
    phi = TangentFeatures(FrozenEstimator(clf)).fit(df, y).transform(df[:5])
    np.testing.assert_allclose(phi, features_loop(clf.module_, X[:5]), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_the_trainer_fitted_on_named_columns_keeps_their_names(cls, circle):
    """The trainer fitted here saw named columns, as MultiOutputRegressor's and
    TransformedTargetRegressor's inner estimators, given X as it is, see them: a kernel
    over estimator_ took reordered ones by position without a word, and its verbs warned
    that it was fitted without names."""
    pd = pytest.importorskip("pandas")
    X, y = circle
    df = pd.DataFrame(X, columns=["a", "b"])
    est = cls(PathKernelClassifier(**SMALL)).fit(df, y)
    assert_array_equal(est.estimator_.feature_names_in_, ["a", "b"])
    ref = MultiOutputRegressor(Ridge()).fit(df, np.c_[y, y])
    assert_array_equal(ref.estimators_[0].feature_names_in_, ["a", "b"])
    with pytest.raises(ValueError, match="feature names should match"):
        TangentKernel(est.estimator_)(df[["b", "a"]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        K = TangentKernel(est.estimator_)(df[:5], df)
        est.estimator_.predict(df[:5])
    phi = features_loop(est.module_, X)
    assert_allclose(K, phi[:5] @ phi.T, rtol=1e-10, atol=1e-12)
    # Unnamed X: no names, as before.
    assert not hasattr(cls(PathKernelClassifier(**SMALL)).fit(X, y).estimator_,
                       "feature_names_in_")


def test_a_frozen_trainer_reads_the_x_it_is_given(circle):
    X, y = circle
    clf = PathKernelClassifier(**SMALL).fit(X[:40], y[:40])
    svm = TangentFeatureSVM(FrozenEstimator(clf), svm_kernel="linear").fit(X[40:], y[40:])
    np.testing.assert_array_equal(svm.X_fit_, X[40:])
    phi = clf.transform(X[40:])
    unit = phi / np.sqrt((phi**2).sum(axis=1, keepdims=True))  # normalize=True: unit rows
    np.testing.assert_allclose(svm.svm_.support_vectors_, unit[svm.svm_.support_],
                               rtol=1e-12)
    with pytest.raises(ValueError, match="features"):
        TangentFeatures(FrozenEstimator(clf)).fit(X[:, :1], y)
    with pytest.raises(NotFittedError):
        TangentFeatureSVM(FrozenEstimator(PathKernelClassifier())).fit(X, y)


def _token_net(n_features_in, n_outputs):
    return torch.nn.Sequential(torch.nn.Embedding(6, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * n_features_in, n_outputs))


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_a_frozen_trainer_refuses_token_ids_beyond_its_embeddings(cls):
    """A frozen token network's X is checked as every later method checks it: ids beyond
    the embedding failed inside torch (an IndexError from OODRankDetector) or were kept
    as the span's points without a word (TangentFeatures)."""
    rng = np.random.RandomState(0)
    X, y = rng.randint(0, 6, size=(20, 4)), np.arange(20) % 2
    clf = PathKernelClassifier(module=_token_net, max_iter=2, dtype="float64",
                               random_state=0).fit(X, y)
    est = cls(FrozenEstimator(clf)).fit(X, y)
    with pytest.raises(ValueError, match=r"token id 7, out of range.*\[6\] rows"):
        est.fit(X + 2, y)
    # The previous fit is kept, and still reads the network.
    assert est.X_fit_.max() == 5
    np.testing.assert_allclose(est.tangent_kernel_(X[:3]),
                               clf.transform(X[:3]) @ clf.transform(X[:3]).T, rtol=1e-10)


def test_tangent_features_of_a_frozen_trainer_need_no_y(circle):
    # y is ignored with a FrozenEstimator: an unsupervised pipeline (fit(X), no y) on the
    # features of a fitted network must run, and give the network's own features.
    X, y = circle
    clf = PathKernelClassifier(**SMALL).fit(X, y)
    phi = make_pipeline(TangentFeatures(FrozenEstimator(clf))).fit_transform(X[:9])
    np.testing.assert_allclose(phi, features_loop(clf.module_, X[:9]), rtol=1e-10,
                               atol=1e-12)
    assert TangentFeatures(FrozenEstimator(clf)).fit(X).estimator_ is clf
    # A trainer that is trained needs y: sklearn's error, not a TypeError.
    with pytest.raises(ValueError, match="requires y.*FrozenEstimator"):
        TangentFeatures(PathKernelClassifier(**SMALL)).fit(X)
    # The tags say so as fit does: requires_y claimed y for a frozen trainer too.
    assert not get_tags(TangentFeatures(FrozenEstimator(clf))).target_tags.required
    assert get_tags(TangentFeatures(PathKernelClassifier(**SMALL))).target_tags.required
    assert get_tags(TangentFeatures()).target_tags.required


def test_grid_search_reaches_the_network_through_estimator(circle):
    X, y = circle
    grid = {"estimator__hidden_layer_sizes": [(2,), (12,)], "C": [1.0, 10.0]}
    search = GridSearchCV(TangentFeatureSVM(PathKernelClassifier(**SMALL)), grid, cv=2)
    search.fit(X, y)
    assert len(search.cv_results_["params"]) == 4
    best = search.best_estimator_
    width = best.estimator_.module_[0].out_features
    assert (width,) == search.best_params_["estimator__hidden_layer_sizes"]
    assert best.estimator_.hidden_layer_sizes == (width,)
    # Each candidate trained its own network: the widths give different fold scores.
    scores = search.cv_results_["mean_test_score"]
    assert len(set(np.round(scores, 12))) > 1
    # In a pipeline, the network is two levels down.
    pipe = make_pipeline(TangentFeatures(PathKernelClassifier(**SMALL), normalize=True),
                         LogisticRegression())
    search = GridSearchCV(
        pipe, {"tangentfeatures__estimator__hidden_layer_sizes": [(3,), (6,)]}, cv=2)
    best = search.fit(X, y).best_estimator_[0]
    assert best.n_params_ in (2 * 3 + 3 + 3 + 1, 2 * 6 + 6 + 6 + 1)
    # A detector's network too (scored by its mean score_samples).
    det = GridSearchCV(OODRankDetector(PathKernelMachine(**SMALL)),
                       {"estimator__hidden_layer_sizes": [(3,), (6,)]}, cv=2,
                       scoring=lambda est, X, y=None: float(np.mean(est.score_samples(X))))
    assert det.fit(X).best_estimator_.estimator_.hidden_layer_sizes in ((3,), (6,))


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_trainer_parameters_of_the_default_trainer_say_how_to_tune_them(cls, circle):
    """With estimator=None the trainer is made by fit: its parameters cannot be set
    before, and the error says to pass the trainer (scikit-learn's own meta-estimators
    raise "'NoneType' object has no attribute 'set_params'")."""
    X, y = circle
    est = cls()
    with pytest.raises(ValueError, match=r"Cannot set estimator__max_iter: .*estimator=None"
                                         r".*pass it as estimator="):
        est.set_params(estimator__max_iter=2)
    assert est.estimator is None
    with pytest.raises(ValueError, match="estimator=None"):
        GridSearchCV(cls(), {"estimator__hidden_layer_sizes": [(3,)]}, cv=2,
                     scoring=lambda est, X, y=None: 0.0).fit(X, y)
    # The trainer given in the same call, or set to None in it, decides.
    trainer = PathKernelClassifier(**SMALL)
    est.set_params(estimator=trainer, estimator__max_iter=2)
    assert est.estimator is trainer and trainer.max_iter == 2
    with pytest.raises(ValueError, match="estimator=None"):
        est.set_params(estimator=None, estimator__max_iter=3)
    assert est.estimator is trainer and trainer.max_iter == 2


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [Ridge(), FrozenEstimator(Ridge()), "net"],
                         ids=["Ridge", "frozen Ridge", "str"])
def test_a_non_trainer_estimator_is_refused_and_the_previous_fit_kept(cls, bad, circle):
    X, y = circle
    est = cls(PathKernelClassifier(**SMALL)).fit(X, y)
    traj = est.trajectory_
    error = (ValueError, TypeError)
    with pytest.raises(error, match="estimator") as info:
        est.set_params(estimator=bad).fit(X, y)
    if not isinstance(bad, str):
        assert "skpathkernel trainer" in str(info.value) and "Ridge" in str(info.value)
    assert est.trajectory_ is traj


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_a_trainer_class_instead_of_an_instance_is_named(cls, circle):
    """estimator=PathKernelClassifier (the call forgotten) passes the "has fit" check; it
    was refused as "got ABCMeta" (the class's metaclass), which named nothing."""
    X, y = circle
    est = cls(PathKernelClassifier(**SMALL)).fit(X, y)
    traj = est.trajectory_
    for bad in (PathKernelClassifier, FrozenEstimator(PathKernelClassifier)):
        with pytest.raises(TypeError, match=r"got the class PathKernelClassifier, not an "
                                            r"instance: pass PathKernelClassifier\(\.\.\.\)"):
            est.set_params(estimator=bad).fit(X, y)
        assert est.trajectory_ is traj


def test_tangent_feature_svm_takes_a_classifier_only(circle):
    X, y = circle
    with pytest.raises(TypeError, match="PathKernelClassifier.*got PathKernelMachine"):
        TangentFeatureSVM(PathKernelMachine(**SMALL)).fit(X, y)
    with pytest.raises(ValueError, match="Unknown label type: continuous"):
        TangentFeatureSVM(PathKernelClassifier(**SMALL)).fit(X, X[:, 0])


def test_the_default_trainer_is_seeded_by_random_state(circle):
    X, y = circle
    a = TangentFeatureSVM(random_state=3).fit(X, y)
    b = TangentFeatureSVM(random_state=3).fit(X, y)
    assert a.estimator_.random_state == 3 and a.estimator is None
    np.testing.assert_array_equal(a.trajectory_.parameters(-1), b.trajectory_.parameters(-1))
    ref = PathKernelClassifier(random_state=3).fit(X, y)
    np.testing.assert_array_equal(a.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))



@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_the_default_trainer_of_a_multilabel_indicator_is_a_classifier():
    """0/1 label columns are label sets, as MLPClassifier trains them, not regression
    targets: the default trainer is the classifier, with one sigmoid output per label."""
    X, Y = make_multilabel_classification(n_samples=40, n_features=4, n_classes=3,
                                          random_state=0)
    assert type_of_target(Y) == "multilabel-indicator"
    for est in (TangentFeatures(random_state=0), OODRankDetector(random_state=0)):
        est.fit(X, Y)
        assert isinstance(est.estimator_, PathKernelClassifier)
        proba = est.estimator_.predict_proba(X[:5])
        # Independent labels: each in (0, 1), rows not summing to 1 as a softmax's do.
        assert proba.shape == (5, 3) and not np.allclose(proba.sum(1), 1)


# ---------------------------------------------------------------- metadata routing
def _weighted_circle(circle):
    X, y = circle
    w = np.random.RandomState(1).uniform(0.2, 3.0, size=len(X))
    w[::7] = 0.0  # rows the detector's span leaves out
    return X, y, w


def _trainer(request=None):
    trainer = PathKernelClassifier(**SMALL)
    return trainer if request is None else trainer.set_fit_request(sample_weight=request)


@pytest.mark.parametrize("splitter", ["cross_validate", "GridSearchCV"])
def test_routing_gives_sample_weight_to_the_trainer_that_requests_it(circle, splitter):
    """With metadata routing, a trainer's set_fit_request(sample_weight=True) is what a
    search needs, as for scikit-learn's MultiOutputRegressor: the trainer is the explicit
    weighted fit on the rows it is given (TangentFeatures asked for its own request, and
    ignored the trainer's)."""
    X, y, w = _weighted_circle(circle)
    folds = list(KFold(2).split(X))
    with sklearn.config_context(enable_metadata_routing=True):
        est = TangentFeatures(_trainer(True))
        if splitter == "cross_validate":
            fitted = cross_validate(est, X, y, cv=folds, params={"sample_weight": w},
                                    scoring=lambda e, X, y: 0.0,
                                    return_estimator=True)["estimator"][0]
            rows = folds[0][0]
        else:
            search = GridSearchCV(est, {"normalize": [False, True]}, cv=folds,
                                  scoring=lambda e, X, y: 0.0)
            fitted, rows = search.fit(X, y, sample_weight=w).best_estimator_, slice(None)
    direct = PathKernelClassifier(**SMALL).fit(X[rows], y[rows], sample_weight=w[rows])
    unweighted = PathKernelClassifier(**SMALL).fit(X[rows], y[rows])
    got = fitted.estimator_.predict_proba(X)
    assert_array_equal(got, direct.predict_proba(X))
    assert np.abs(got - unweighted.predict_proba(X)).max() > 1e-3  # the weights matter


@pytest.mark.parametrize("cls", [TangentFeatureSVM, OODRankDetector], ids=lambda c: c.__name__)
def test_routing_keeps_sample_weight_from_a_trainer_that_declines_it(cls, circle):
    """set_fit_request(sample_weight=False) on the trainer: it trains unweighted, and the
    meta-estimator still uses the weights itself (the SVM's, the detector's span), as
    CalibratedClassifierCV keeps them for its calibrator; it is then the meta-estimator
    on the unweighted trainer, frozen (the trainer was given the weights regardless)."""
    X, y, w = _weighted_circle(circle)
    with sklearn.config_context(enable_metadata_routing=True):
        est = cls(_trainer(False)).fit(X, y, sample_weight=w)
    unweighted = PathKernelClassifier(**SMALL).fit(X, y)
    assert_array_equal(est.estimator_.predict_proba(X), unweighted.predict_proba(X))
    ref = cls(FrozenEstimator(unweighted)).fit(X, y, sample_weight=w)
    assert_array_equal(est.X_fit_, ref.X_fit_)
    assert_allclose(est.decision_function(X), ref.decision_function(X), rtol=1e-10,
                    atol=1e-12)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_routing_refuses_sample_weight_a_trainer_did_not_request(cls, circle):
    """As scikit-learn's meta-estimators: weights for a trainer that said nothing are an
    error naming it (they were silently given to it), raised before any training."""
    X, y, w = _weighted_circle(circle)
    est = cls(_trainer()).fit(X, y)
    before = est.estimator_
    with sklearn.config_context(enable_metadata_routing=True):
        with pytest.raises(UnsetMetadataPassedError,
                           match=r"PathKernelClassifier.fit, which is used within"):
            est.fit(X, y, sample_weight=w)
        # Without weights there is nothing to route: fit as before.
        assert cls(_trainer()).fit(X, y).estimator_.n_iter_ == before.n_iter_
        declined = _trainer(False)
    assert est.estimator_ is before  # the previous fit is kept
    # Without routing, the trainer gets them whatever its request says, as before.
    assert_array_equal(cls(declined).fit(X, y, sample_weight=w).estimator_.predict_proba(X),
                       _trainer().fit(X, y, sample_weight=w).predict_proba(X))


def test_routing_of_a_frozen_trainer_and_the_router(circle):
    """A FrozenEstimator is not fitted: nothing is routed to it, so weights for
    TangentFeatures (which only weighs its trainer's loss) go to no one, and the
    router says so; the SVM still takes its own."""
    X, y, w = _weighted_circle(circle)
    with sklearn.config_context(enable_metadata_routing=True):
        frozen = FrozenEstimator(_trainer(True).fit(X, y))
        for est, consumed in [(TangentFeatures(frozen), set()),
                              (TangentFeatures(_trainer(True)), {"sample_weight"}),
                              (TangentFeatures(_trainer(False)), set()),
                              (TangentFeatureSVM(frozen), set()),
                              (TangentFeatureSVM(frozen).set_fit_request(sample_weight=True),
                               {"sample_weight"})]:
            assert est.get_metadata_routing().consumes("fit", ["sample_weight"]) == consumed
        with pytest.raises(TypeError, match="not routed to any object"):
            TangentFeatures(frozen).fit(X, y, sample_weight=w)
        svm = TangentFeatureSVM(frozen).fit(X, y, sample_weight=w)
    assert_allclose(svm.decision_function(X), TangentFeatureSVM(frozen).fit(
        X, y, sample_weight=w).decision_function(X), rtol=1e-12)


def _output(est, X):
    """What each meta-estimator gives: features, SVM decisions, detector scores."""
    return est.transform(X) if isinstance(est, TangentFeatures) else est.decision_function(X)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_routing_takes_a_weight_under_the_trainers_alias(cls, circle):
    """set_fit_request(sample_weight="w") on the trainer, then fit(X, y, w=weights): the
    trainer is the explicit weighted fit, as through MultiOutputRegressor's and
    CalibratedClassifierCV's **fit_params (fit took no other keyword than sample_weight);
    the meta-estimator's own use of weights (the SVM's, the span's) reads sample_weight."""
    X, y, w = _weighted_circle(circle)
    pure = cls is TangentFeatures  # uses no weight itself
    with sklearn.config_context(enable_metadata_routing=True):
        aliased = cls(_trainer("w")).fit(X, y, w=w)
        both = None if pure else cls(_trainer("w")).fit(X, y, sample_weight=w, w=w)
    direct = PathKernelClassifier(**SMALL).fit(X, y, sample_weight=w)
    assert_array_equal(aliased.estimator_.predict_proba(X), direct.predict_proba(X))
    assert np.abs(direct.predict_proba(X)
                  - PathKernelClassifier(**SMALL).fit(X, y).predict_proba(X)).max() > 1e-3
    # Without routing, sample_weight goes to the trainer and the meta-estimator alike.
    explicit = cls(_trainer()).fit(X, y, sample_weight=w)
    if pure:
        assert_array_equal(_output(aliased, X), _output(explicit, X))
    else:
        assert_array_equal(_output(both, X), _output(explicit, X))
        # The weighted trainer, read unweighted by the SVM / the span.
        ref = cls(FrozenEstimator(direct)).fit(X, y)
        assert_array_equal(aliased.X_fit_, ref.X_fit_)
        assert_allclose(_output(aliased, X), _output(ref, X), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_routing_refuses_metadata_as_scikit_learns_meta_estimators(cls, circle):
    """Metadata routed to no one is refused as MultiOutputRegressor (a pure router, as
    TangentFeatures) and CalibratedClassifierCV (which weighs its own calibration, as
    the SVM and the detector) refuse it; without routing any metadata but sample_weight
    is refused as by BaggingRegressor, before any training, keeping the previous fit."""
    X, y, w = _weighted_circle(circle)
    pure = cls is TangentFeatures
    Y = np.column_stack([y, y]) if pure else y
    with sklearn.config_context(enable_metadata_routing=True):
        est = cls(_trainer("w")).fit(X, y)
        before = est.estimator_
        ref = (MultiOutputRegressor(Ridge().set_fit_request(sample_weight="w")) if pure
               else CalibratedClassifierCV(LogisticRegression().set_fit_request(
                   sample_weight="w")))
        for params in (dict(foo=w), dict(sample_weight=w)):
            try:
                clone(ref).fit(X, Y, **params)
            except TypeError as exc:  # the reference refuses: so must this one
                with pytest.raises(TypeError, match=re.escape(str(exc).split(" got ")[1])):
                    est.fit(X, y, **params)
            else:
                assert params == dict(sample_weight=w) and not pure
        assert est.estimator_ is before
    with pytest.raises(ValueError) as bagging:
        BaggingRegressor(Ridge()).fit(X, y, w=w)
    with pytest.raises(ValueError, match=re.escape(str(bagging.value).split(" is ")[1])):
        est.fit(X, y, w=w)
    assert est.estimator_ is before


@pytest.mark.parametrize("request_", [False, "frozen"])
def test_routing_fits_a_pure_router_without_weights(circle, request_):
    """A TangentFeatures whose trainer routes nothing (declined, or frozen) fits without
    weights, as MultiOutputRegressor(Ridge().set_fit_request(sample_weight=False)) does:
    its fit routed sample_weight=None, which no one takes, and was refused."""
    X, y = circle
    with sklearn.config_context(enable_metadata_routing=True):
        trainer = (FrozenEstimator(PathKernelClassifier(**SMALL).fit(X, y))
                   if request_ == "frozen" else _trainer(False))
        MultiOutputRegressor(Ridge().set_fit_request(sample_weight=False)).fit(
            X, np.column_stack([y, y]))
        routed = TangentFeatures(trainer).fit(X, y)
    assert_array_equal(routed.transform(X), TangentFeatures(trainer).fit(X, y).transform(X))


class _GroupedTrainer(PathKernelClassifier):
    """A trainer subclass that takes other metadata beside sample_weight."""

    def fit(self, X, y, sample_weight=None, groups=None):
        self.groups_seen_ = groups
        return super().fit(X, y, sample_weight=sample_weight)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_routing_passes_the_trainers_other_metadata(cls, circle):
    """Whatever the trainer requested reaches its fit, as MultiOutputRegressor passes
    routed metadata on: a subclass's groups were routed (not refused) and then dropped."""
    X, y = circle
    groups = np.arange(len(X)) % 3
    with sklearn.config_context(enable_metadata_routing=True):
        trainer = _GroupedTrainer(**SMALL).set_fit_request(groups=True, sample_weight=False)
        est = cls(trainer).fit(X, y, groups=groups)
    assert_array_equal(est.estimator_.groups_seen_, groups)


def _wrapped(net, how):
    return FrozenEstimator(net) if how == "frozen" else net


@pytest.mark.parametrize("how", ["frozen", "bare"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_tangent_features_of_an_own_loops_recorded_network(kind, how):
    """A network trained in the user's own loop (PathRecorder.as_estimator) gives its
    tangent features through TangentFeatures, as a frozen trainer does: the per-sample
    gradients of the module at the last recorded parameters. It was refused with a
    TypeError (only PathKernelMachine / PathKernelClassifier were taken)."""
    net, X = own_loop(kind)
    est = TangentFeatures(_wrapped(net, how)).fit(X[:16])  # no y: nothing is trained
    assert est.estimator_ is net and est.network_ is net.network_
    assert_array_equal(est.X_fit_, X[:16])
    Xq = np.concatenate([X[16:], 2.0 * X[:3]])
    ref = features_loop(module_at(net), Xq)  # C = 2 outputs: the Jacobian / sqrt(2)
    assert_allclose(est.transform(Xq), ref, rtol=1e-12, atol=1e-12)
    assert_allclose(est.fit_transform(X[:5]), features_loop(module_at(net), X[:5]),
                    rtol=1e-12, atol=1e-12)
    # The network's attributes, n_outputs_ counted on one sample (the loop declares it
    # nowhere); the training loop's are absent, as a missing fitted attribute is.
    assert (est.n_outputs_, est.n_params_, est.dtype_) == (2, net.n_params_, "float64")
    assert est.task_ == "regression" and est.trajectory_ is net.trajectory_
    for name in ("loss_curve_", "n_iter_", "t_", "validation_scores_", "best_loss_",
                 "classes_"):
        assert not hasattr(est, name)
    with pytest.raises(AttributeError, match="its estimator_, a RecordedNetwork, has no"):
        getattr(est, "loss_curve_")  # noqa: B009
    names = est.get_feature_names_out()
    assert len(names) == ref.shape[1] and names[0].startswith("out0:")
    tags = get_tags(est)
    assert not tags.target_tags.required and tags.input_tags.three_d_array
    assert tags.transformer_tags.preserves_dtype == ["float64"]
    # clone keeps it fitted, pickling keeps what transform reads.
    assert_allclose(clone(est).fit(X[:16]).transform(Xq), ref, rtol=1e-12, atol=1e-12)
    assert_allclose(pickle.loads(pickle.dumps(est)).transform(Xq), ref, rtol=1e-12,
                    atol=1e-12)
    # Another form than the recorded X_train's is refused, naming it.
    with pytest.raises(ValueError, match="expecting|shape"):
        est.fit(X[:, :2] if kind == "mlp" else X[:, :, :4])
    assert_allclose(est.transform(Xq), ref, rtol=1e-12, atol=1e-12)  # the previous fit


def test_tangent_features_of_a_recorded_network_without_training_inputs():
    """Without X_train the recorded network has no input form: fit's X sets it, once
    the module runs it; X the module cannot run is refused naming its shape."""
    net, X = own_loop("cnn", X_train=False)
    est = TangentFeatures(net).fit(X[:4])
    assert est.input_shape_ == (1, 6, 6)
    assert_allclose(est.transform(X[4:9]), features_loop(module_at(net), X[4:9]),
                    rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"could not take X of shape \(4, 1, 5, 5\)"):
        TangentFeatures(net).fit(X[:4, :, :5, :5])
    with pytest.raises(ValueError, match="shape"):
        est.transform(X[:2, :, :5, :5])


def test_a_recorded_classifier_feeds_the_tangent_feature_svm():
    """A RecordedNetwork declared with log_loss is a classifier of the user's loop: the
    SVM learns on its tangent features (unit rows); one declared otherwise is refused,
    naming its loss, as a PathKernelMachine is."""
    net, X = own_loop("mlp", loss="log_loss", n_outputs=3)
    y = np.argmax(X[:, :3], axis=1)
    svm = TangentFeatureSVM(FrozenEstimator(net), svm_kernel="linear").fit(X, y)
    phi = features_loop(module_at(net), X)
    unit = phi / np.linalg.norm(phi, axis=1, keepdims=True)
    assert_allclose(svm.svm_.support_vectors_, unit[svm.svm_.support_], rtol=1e-12,
                    atol=1e-12)
    assert_array_equal(svm.classes_, [0, 1, 2])
    assert TangentFeatures(net).fit(X).task_ == "classification"
    regressor, _ = own_loop("mlp")
    with pytest.raises(ValueError, match="trained as a classifier.*'squared_error'"):
        svm.set_params(estimator=regressor).fit(X, y)
    assert svm.estimator_ is net  # the previous fit is kept


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_the_refusal_of_a_wrong_estimator_names_a_recorded_network(cls, circle):
    X, y = circle
    with pytest.raises(TypeError, match=r"skpathkernel trainer.*or a RecordedNetwork "
                                        r"\(PathRecorder.as_estimator.*got Ridge"):
        cls(Ridge()).fit(X, y)


@pytest.mark.parametrize("cls", [TangentFeatures, TangentFeatureSVM, OODRankDetector])
def test_n_outputs_before_fit_is_named_as_the_other_fitted_attributes(cls):
    """n_outputs_ is counted by fit for a RecordedNetwork and read from the trainer
    otherwise: before fit it is absent as every fitted attribute is, named n_outputs_
    (the error named a private '_n_outputs_of_trainer')."""
    net, X = own_loop("mlp", loss="log_loss", n_outputs=3)
    est = cls(net)
    assert not hasattr(est, "n_outputs_")
    with pytest.raises(AttributeError, match=r"no attribute 'n_outputs_' \(not fitted\)"):
        est.n_outputs_  # noqa: B018
    est.fit(X, np.argmax(X[:, :3], axis=1))
    # Counted on one sample: the module's output columns, which the loop trained.
    assert est.n_outputs_ == module_at(net)(torch.as_tensor(X[:1])).shape[1] == 3


@pytest.mark.parametrize("cls", [TangentFeatures, TangentFeatureSVM, OODRankDetector])
def test_a_recorder_or_its_network_is_refused_naming_as_estimator(cls):
    """The recorder and its as_network are what an own loop holds: the refusal names the
    RecordedNetwork that takes their place (scikit-learn's parameter validation said
    only "must be an object implementing 'fit'", bare; wrapped, as_estimator went
    unnamed)."""
    net, X = own_loop("mlp", loss="log_loss", n_outputs=3)
    y = np.argmax(X[:, :3], axis=1)
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 3).double()
    with PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.1),
                      n_samples=len(X)) as recorder:
        pass
    with pytest.raises(TypeError, match=r"got PathRecorder: pass recorder\.as_estimator"):
        cls(recorder).fit(X, y)
    for network in (net.network_, FrozenEstimator(net.network_)):
        with pytest.raises(TypeError, match=r"got TrainedNetwork: pass the estimator "
                                            r".*recorder\.as_estimator"):
            cls(network).fit(X, y)


# ------------------------------------------------------------ a pipeline as estimator
# The meta-estimators read the network of a fitted Pipeline (or a refitted search) in a
# FrozenEstimator as the kernels do (pipeline_last_step): its last step's network, on X
# through the steps before it. An unfrozen Pipeline is cloned and fitted, as by
# scikit-learn's meta-estimators. The references transform X by hand (mean and standard
# deviation from NumPy) and differentiate the network sample by sample (features_loop).

def _scaled_data(circle):
    X, y = circle
    # Unit-free inputs would make the scaler nearly the identity.
    return X * [3.0, 0.5] + [1.0, -2.0], y


def _by_hand(X_train, X):
    return (X - X_train.mean(axis=0)) / X_train.std(axis=0)


def _final(est):
    return est.trajectory_.parameters(-1).numpy()


def _unit(phi):
    return phi / np.sqrt((phi**2).sum(axis=1, keepdims=True))


def _fitted_wrappers(X, y):
    """Fitted wrappers of a scaler and a trainer: ``(name, wrapper, trainer)``."""
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(X, y)
    search = GridSearchCV(make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)),
                          {"pathkernelclassifier__alpha": [1e-4, 1.0]}, cv=2).fit(X, y)
    # Frozen inside and out, and nested: followed in any order.
    nested = make_pipeline(StandardScaler(),
                           make_pipeline(FrozenEstimator(pipe[-1]))).fit(X, y)
    return [("pipeline", pipe, pipe[-1]),
            ("search", search, search.best_estimator_[-1]),
            ("nested", nested, pipe[-1])]


@pytest.mark.parametrize("kind", ["pipeline", "search", "nested"])
def test_tangent_features_of_a_frozen_pipeline_are_the_last_steps_at_the_scaled_x(
        circle, kind):
    X, y = _scaled_data(circle)
    _, wrapper, clf = next(w for w in _fitted_wrappers(X, y) if w[0] == kind)
    traj = clf.trajectory_
    est = TangentFeatures(FrozenEstimator(wrapper)).fit(X, y)
    # Nothing was fitted: the same fitted wrapper and network.
    assert est.estimator_ is wrapper and clf.trajectory_ is traj
    assert est.network_.trajectory is traj and est.n_params_ == clf.n_params_
    assert est.task_ == "classification"
    np.testing.assert_array_equal(est.classes_, [-1, 1])
    Xq = X[:7] * 1.3
    expected = features_loop(module_at(clf), _by_hand(X, Xq))
    np.testing.assert_allclose(est.transform(Xq), expected, rtol=1e-9, atol=1e-12)
    # The span's points are X as the network takes it.
    np.testing.assert_allclose(est.X_fit_, _by_hand(X, X), rtol=1e-12, atol=1e-12)
    assert est.n_features_in_ == 2 and est.input_shape_ == (2,)
    # The kernels of the meta-estimator take its X too (they follow it into the pipeline).
    np.testing.assert_allclose(est.tangent_kernel_(Xq), expected @ expected.T, rtol=1e-9,
                               atol=1e-12)
    # No y needed: an unsupervised use of a fitted network.
    np.testing.assert_allclose(TangentFeatures(FrozenEstimator(wrapper)).fit_transform(X),
                               features_loop(module_at(clf), _by_hand(X, X)), rtol=1e-9,
                               atol=1e-12)


def test_everything_tangent_features_exposes_follows_a_frozen_pipeline(circle):
    pd = pytest.importorskip("pandas")
    X, y = _scaled_data(circle)
    df = pd.DataFrame(X, columns=["a", "b"])
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(df, y)
    clf = pipe[-1]
    est = TangentFeatures(FrozenEstimator(pipe), n_components=5, random_state=3).fit(df)
    np.testing.assert_array_equal(est.feature_names_in_, ["a", "b"])
    # The projection is the bare network's at the scaled inputs (the same seed).
    bare = TangentFeatures(FrozenEstimator(clf), n_components=5, random_state=3).fit(
        _by_hand(X, X))
    np.testing.assert_allclose(est.transform(df[:6]), bare.transform(_by_hand(X, X[:6])),
                               rtol=1e-9, atol=1e-12)
    assert est.get_feature_names_out().tolist() == [f"tangentfeatures{k}" for k in range(5)]
    # Exact features: the parameters' names, and a DataFrame out with set_output.
    est = TangentFeatures(FrozenEstimator(pipe)).set_output(transform="pandas").fit(df)
    out = est.transform(df[:4])
    assert list(out.columns) == clf.get_feature_names_out().tolist()
    np.testing.assert_allclose(out.to_numpy(), features_loop(module_at(clf), _by_hand(
        X, X[:4])), rtol=1e-9, atol=1e-12)
    # Reordered or other columns are refused, before any work, the fit kept.
    for bad in (df[["b", "a"]], df.rename(columns={"a": "c"})):
        with pytest.raises(ValueError, match="feature names should match"):
            est.transform(bad[:4])
        with pytest.raises(ValueError, match="feature names should match"):
            est.fit(bad)
        assert est.estimator_ is pipe and list(est.feature_names_in_) == ["a", "b"]
    with (pytest.warns(UserWarning, match="valid feature names"),
          pytest.raises(ValueError, match="3 features")):
        est.transform(np.c_[X, X[:, :1]])
    # kneighbors: the training points of highest normalized kernel, by hand.
    phi = features_loop(module_at(clf), _by_hand(X, X))
    ind = est.kneighbors(df[:3], n_neighbors=4, return_distance=False)
    cos = _unit(phi[:3]) @ _unit(phi).T
    np.testing.assert_array_equal(np.sort(cos, axis=1)[:, ::-1][:, :4],
                                  np.take_along_axis(cos, ind, axis=1))


def test_tangent_feature_svm_of_a_frozen_pipeline_is_sklearns_svm_on_the_features(circle):
    X, y = _scaled_data(circle)
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(X, y)
    X_train, y_train, Xq = X[:40], y[:40], X[40:]
    svm = TangentFeatureSVM(FrozenEstimator(pipe), svm_kernel="linear", normalize=False,
                            C=1.0).fit(X_train, y_train)
    # The scaler is the pipeline's, fitted on all of X: not refitted on X_train.
    phi_train = features_loop(module_at(pipe[-1]), _by_hand(X, X_train))
    phi_q = features_loop(module_at(pipe[-1]), _by_hand(X, Xq))
    ref = SVC(kernel="linear", C=1.0).fit(phi_train, y_train)
    np.testing.assert_allclose(svm.decision_function(Xq), ref.decision_function(phi_q),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(svm.predict(Xq), ref.predict(phi_q))
    # The tangent kernel (the default) is the same SVM on the unit rows.
    svm = TangentFeatureSVM(FrozenEstimator(pipe), C=1.0).fit(X_train, y_train)
    ref = SVC(kernel="linear", C=1.0).fit(_unit(phi_train), y_train)
    np.testing.assert_allclose(svm.decision_function(Xq),
                               ref.decision_function(_unit(phi_q)), rtol=1e-6, atol=1e-8)
    # clone keeps the frozen pipeline; a pickle gives the same decisions.
    again = pickle.loads(pickle.dumps(clone(svm).fit(X_train, y_train)))
    assert clone(svm).estimator.estimator is pipe
    np.testing.assert_allclose(again.decision_function(Xq), svm.decision_function(Xq),
                               rtol=1e-12)


def test_ood_rank_detector_of_a_frozen_pipeline_spans_the_scaled_features(circle):
    X, y = _scaled_data(circle)
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(X, y)
    det = OODRankDetector(FrozenEstimator(pipe), method="alignment").fit(X)
    Xq = np.r_[X[:5] * 1.1, [[30.0, 9.0]]]
    phi = features_loop(module_at(pipe[-1]), _by_hand(X, X))
    phi_q = features_loop(module_at(pipe[-1]), _by_hand(X, Xq))
    # "alignment": the best cosine between phi(x) and a training feature.
    np.testing.assert_allclose(det.score_samples(Xq), (_unit(phi_q) @ _unit(phi).T).max(1),
                               rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(det.predict(Xq),
                                  np.where(det.decision_function(Xq) < 0, -1, 1))
    # The residual outside the span of all training features (the default method's
    # global variant) equals that of the bare network on the scaled inputs.
    res = OODRankDetector(FrozenEstimator(pipe), method="residual").fit(X)
    bare = OODRankDetector(FrozenEstimator(pipe[-1]), method="residual").fit(
        _by_hand(X, X))
    np.testing.assert_allclose(res.score_samples(Xq), bare.score_samples(_by_hand(X, Xq)),
                               rtol=1e-6, atol=1e-9)
    assert res.rank_gap(Xq) == bare.rank_gap(_by_hand(X, Xq))


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_an_unfrozen_pipeline_is_cloned_and_fitted(cls, circle):
    """fit clones the pipeline and fits it on X, y, as scikit-learn's meta-estimators
    fit theirs: its steps on X, its trainer on their output; the pipeline given is left
    unfitted."""
    X, y = _scaled_data(circle)
    given = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL))
    # The linear SVM on the raw features: sklearn's SVC on them is the reference.
    params = (dict(svm_kernel="linear", normalize=False, C=1.0)
              if cls is TangentFeatureSVM else {})
    est = cls(given, **params).fit(X, y)
    assert not hasattr(given[0], "mean_") and not hasattr(given[-1], "network_")
    fitted = est.estimator_
    assert fitted is not given and fitted[-1] is not given[-1]
    np.testing.assert_allclose(fitted[0].mean_, X.mean(axis=0), rtol=1e-12)
    # The trainer is the one fitted alone on the scaled X (same seed: the same path).
    own = PathKernelClassifier(**SMALL).fit(_by_hand(X, X), y)
    np.testing.assert_allclose(_final(est), _final(own), rtol=1e-9, atol=1e-12)
    Xq = X[:6] * 1.2
    phi = features_loop(module_at(own), _by_hand(X, Xq))
    if cls is TangentFeatures:
        np.testing.assert_allclose(est.transform(Xq), phi, rtol=1e-7, atol=1e-10)
    elif cls is TangentFeatureSVM:
        ref = SVC(kernel="linear", C=1.0).fit(features_loop(module_at(own), _by_hand(X, X)),
                                              y)
        np.testing.assert_allclose(est.decision_function(Xq), ref.decision_function(phi),
                                   rtol=1e-6, atol=1e-8)
    else:
        bare = cls(FrozenEstimator(own)).fit(_by_hand(X, X))
        np.testing.assert_allclose(est.score_samples(Xq), bare.score_samples(
            _by_hand(X, Xq)), rtol=1e-6, atol=1e-8)
    # clone, pickle, and a search over the pipeline's parameters.
    np.testing.assert_allclose(_final(clone(est).fit(X, y)), _final(est), rtol=1e-12)
    assert pickle.loads(pickle.dumps(est)).estimator_[0].mean_.tolist() == \
        fitted[0].mean_.tolist()
    grid = {"estimator__pathkernelclassifier__hidden_layer_sizes": [(3,), (5,)]}
    scoring = (None if cls is TangentFeatureSVM else
               lambda e, X, y=None: float(np.mean(
                   e.transform(X) if cls is TangentFeatures else e.score_samples(X))))
    search = GridSearchCV(cls(given, **params), grid, cv=2, scoring=scoring).fit(X, y)
    assert search.best_estimator_.n_params_ in (2 * 3 + 3 + 3 + 1, 2 * 5 + 5 + 5 + 1)


def test_the_detector_reconstructs_the_input_its_network_takes(circle):
    """fit(X) without y trains the network to reconstruct its own input: the pipeline's
    scaled X, not the X given."""
    X, _ = _scaled_data(circle)
    reg = dict(SMALL, max_iter=5)
    det = OODRankDetector(make_pipeline(StandardScaler(), PathKernelMachine(**reg))).fit(X)
    own = PathKernelMachine(**reg).fit(_by_hand(X, X), _by_hand(X, X))
    np.testing.assert_allclose(_final(det), _final(own), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_bad_input_through_a_pipeline_is_refused_and_the_fit_kept(cls, circle):
    X, y = _scaled_data(circle)
    given = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL))
    est = cls(given).fit(X, y)
    fitted, traj = est.estimator_, est.trajectory_
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        est.fit(X, y[:-1])
    with pytest.raises(ValueError, match="Input y contains NaN"):
        est.fit(X, np.where(np.arange(len(y)) == 3, np.nan, y))
    with pytest.raises(ValueError, match="Input X contains NaN"):
        est.fit(np.where(np.arange(len(y))[:, None] == 3, np.nan, X), y)
    assert est.estimator_ is fitted and est.trajectory_ is traj
    # The pipeline given was never fitted by the refused fits.
    assert not hasattr(given[0], "mean_")
    method = {TangentFeatures: "transform", TangentFeatureSVM: "decision_function",
              OODRankDetector: "score_samples"}[cls]
    with pytest.raises(ValueError, match="3 features"):
        getattr(est, method)(np.c_[X, X[:, :1]])


def _ttr(X, y):
    return TransformedTargetRegressor(PathKernelMachine(**SMALL), func=np.log1p,
                                      inverse_func=np.expm1).fit(X, y + 1.0)


@pytest.mark.parametrize("cls", [TangentFeatures, OODRankDetector],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("wrapped", ["bag", "multioutput", "target", "refit=False"])
def test_wrappers_whose_network_saw_other_inputs_keep_the_resolvers_hint(cls, wrapped,
                                                                         circle):
    X, y = _scaled_data(circle)
    y = y.astype(float)
    inner = {
        "bag": lambda: BaggingRegressor(PathKernelMachine(**SMALL), n_estimators=2,
                                        random_state=0).fit(X, y),
        "multioutput": lambda: MultiOutputRegressor(PathKernelMachine(**SMALL)).fit(
            X, np.c_[y, y]),
        "target": lambda: _ttr(X, y),
        "refit=False": lambda: GridSearchCV(PathKernelMachine(**SMALL),
                                            {"alpha": [1e-4, 1.0]}, cv=2,
                                            refit=False).fit(X, y),
    }[wrapped]()
    hint = {"bag": r"estimators_\[0\] holds one", "multioutput": r"estimators_\[i\]",
            "target": r"regressor_, whose network was trained on the transformed",
            "refit=False": "refit=True"}[wrapped]
    est = cls(PathKernelMachine(**SMALL)).fit(X, y)
    traj = est.trajectory_
    for given in (FrozenEstimator(make_pipeline(StandardScaler().fit(X), inner)),
                  FrozenEstimator(inner)):
        with pytest.raises(TypeError, match=f"skpathkernel trainer.*{hint}"):
            est.set_params(estimator=given).fit(X, y)
        assert est.trajectory_ is traj


def test_a_search_or_a_frozen_step_in_an_unfrozen_estimator_is_refused(circle):
    X, y = _scaled_data(circle)
    clf = PathKernelClassifier(**SMALL).fit(X, y)
    search = GridSearchCV(PathKernelClassifier(**SMALL), {"alpha": [1e-4, 1.0]}, cv=2)
    with pytest.raises(TypeError, match="got GridSearchCV: a search fits its candidates "
                                        "itself; fit it, and pass it in sklearn.frozen"):
        TangentFeatures(search).fit(X, y)
    for given in (search.fit(X, y), make_pipeline(StandardScaler(), FrozenEstimator(clf))):
        with pytest.raises(TypeError, match="Wrap the fitted .* in sklearn.frozen"):
            TangentFeatures(given).fit(X, y)
        # Frozen, the same is read as it is.
        TangentFeatures(FrozenEstimator(given.fit(X, y) if given is not search
                                        else given)).fit(X)


def test_replay_refuses_a_meta_estimator_reading_a_pipeline(circle):
    X, y = _scaled_data(circle)
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(X, y)
    svm = TangentFeatureSVM(FrozenEstimator(pipe)).fit(X, y)
    with pytest.raises(ValueError, match="TangentFeatureSVM reads the path of its "):
        retrain_on_subsets(svm, X, y, X[:2], y[:2], protocol="replay", n_subsets=2)


@pytest.mark.parametrize("routing", [False, True])
def test_sample_weight_reaches_the_trainer_of_an_unfrozen_pipeline(circle, routing):
    """The trainer at the end of the pipeline is weighted as one given alone (with
    metadata routing, where it requested the weights); the steps are fitted unweighted
    (with routing, where they declined them: one that did not say is an error, as in
    scikit-learn's Pipeline; see test_routing_reaches_the_steps_of_an_unfrozen_pipeline)."""
    X, y = _scaled_data(circle)
    w = np.linspace(0.5, 2.0, len(y))
    with sklearn.config_context(enable_metadata_routing=routing):
        trainer, scaler = PathKernelClassifier(**SMALL), StandardScaler()
        if routing:
            trainer.set_fit_request(sample_weight=True)
            scaler.set_fit_request(sample_weight=False)
        est = TangentFeatures(make_pipeline(scaler, trainer)).fit(
            X, y, sample_weight=w)
        own = PathKernelClassifier(**SMALL).fit(_by_hand(X, X), y, sample_weight=w)
    np.testing.assert_allclose(_final(est), _final(own), rtol=1e-9, atol=1e-12)
    unweighted = PathKernelClassifier(**SMALL).fit(_by_hand(X, X), y)
    assert not np.allclose(_final(est), _final(unweighted), rtol=1e-6)


def _weighted_scaled(X, w):
    mean = np.average(X, axis=0, weights=w)
    return (X - mean) / np.sqrt(np.average((X - mean) ** 2, axis=0, weights=w))


@pytest.mark.parametrize("cls", META, ids=lambda c: c.__name__)
def test_routing_reaches_the_steps_of_an_unfrozen_pipeline(cls, circle):
    """With metadata routing, the pipeline routes on to its own steps, as under
    scikit-learn's meta-estimators: a scaler that requested the weight is the weighted
    scaler (by hand: np.average), down a nested pipeline and under an alias, and a
    trainer that declined it is the unweighted fit on what the scaler made. The weight
    was refused before (the router held the trainer alone, which declined)."""
    X, y = _scaled_data(circle)
    w = np.linspace(0.5, 2.0, len(y))
    v = w[::-1].copy()
    with sklearn.config_context(enable_metadata_routing=True):
        trainer = PathKernelClassifier(**SMALL).set_fit_request(sample_weight=False)
        inner = make_pipeline(StandardScaler().set_fit_request(sample_weight="v"), trainer)
        given = make_pipeline(StandardScaler().set_fit_request(sample_weight=True), inner)
        est = cls(given).fit(X, y, sample_weight=w, v=v)
        own = PathKernelClassifier(**SMALL).fit(_weighted_scaled(_weighted_scaled(X, w), v), y)
        # Nobody asked for it: refused, naming the step that did not say.
        with pytest.raises(UnsetMetadataPassedError, match="StandardScaler"):
            cls(make_pipeline(StandardScaler(), clone(trainer))).fit(X, y, sample_weight=w)
    assert not hasattr(given[0], "mean_")
    np.testing.assert_allclose(est.estimator_[0].mean_, np.average(X, axis=0, weights=w),
                               rtol=1e-12)
    np.testing.assert_allclose(_final(est), _final(own), rtol=1e-9, atol=1e-12)
    unweighted = PathKernelClassifier(**SMALL).fit(_by_hand(X, X), y)
    assert not np.allclose(_final(est), _final(unweighted), rtol=1e-6)


@pytest.mark.parametrize("wrap", ["trainer", "pipeline"])
@pytest.mark.parametrize("cls", [TangentFeatures, OODRankDetector], ids=lambda c: c.__name__)
def test_kneighbors_of_a_frozen_trainer_indexes_the_x_given_to_fit(cls, wrap, circle):
    # The frozen network was trained on all 60 rows; the meta-estimator is fitted on 15
    # of them (its X_fit_, the span's points): kneighbors' indices index those 15, with
    # the neighbours of highest normalized kernel among them, by hand.
    X, y = _scaled_data(circle)
    piped = wrap == "pipeline"
    if piped:
        fitted = make_pipeline(StandardScaler(), PathKernelClassifier(**SMALL)).fit(X, y)
        clf = fitted[-1]
    else:
        fitted = clf = PathKernelClassifier(**SMALL).fit(X, y)
    X_span, Xq = X[10:25], X[40:44]
    est = cls(FrozenEstimator(fitted)).fit(X_span)
    assert len(est.X_fit_) == len(X_span)
    phi, phi_q = (features_loop(module_at(clf), _by_hand(X, A) if piped else A)
                  for A in (X_span, Xq))
    cos = _unit(phi_q) @ _unit(phi).T
    dist, ind = est.kneighbors(Xq, n_neighbors=4)
    np.testing.assert_array_equal(ind, np.argsort(-cos, axis=1, kind="stable")[:, :4])
    np.testing.assert_allclose(dist, np.sqrt(np.maximum(
        2 - 2 * np.take_along_axis(cos, ind, axis=1), 0)), rtol=1e-7, atol=1e-9)
    # Without X: every span point's neighbours among the other span points.
    cos = _unit(phi) @ _unit(phi).T
    np.fill_diagonal(cos, -np.inf)
    np.testing.assert_array_equal(est.kneighbors(n_neighbors=3, return_distance=False),
                                  np.argsort(-cos, axis=1, kind="stable")[:, :3])


def test_kneighbors_of_the_detector_skips_the_rows_of_weight_zero(circle):
    # The detector's X_fit_ keeps the rows of positive weight: kneighbors indexes them,
    # not the trainer's training set (all the rows).
    X, y = _scaled_data(circle)
    w = np.ones(len(X))
    w[::3] = 0
    det = OODRankDetector(PathKernelClassifier(**SMALL)).fit(X, y, sample_weight=w)
    np.testing.assert_array_equal(det.X_fit_, X[w > 0])
    clf = det.estimator_
    phi, phi_q = (features_loop(module_at(clf), A) for A in (X[w > 0], X[:5]))
    cos = _unit(phi_q) @ _unit(phi).T
    ind = det.kneighbors(X[:5], n_neighbors=3, return_distance=False)
    np.testing.assert_array_equal(ind, np.argsort(-cos, axis=1, kind="stable")[:, :3])


class _FlatNet(torch.nn.Sequential):
    """A module factory for (n, 2, 3) inputs: flattened, then a small MLP."""

    def __init__(self, n_features_in, n_outputs):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(6, 4), torch.nn.Tanh(),
                         torch.nn.Linear(4, n_outputs))


def test_a_frozen_search_of_images_counts_the_values_per_sample():
    # n_features_in_ is the values per sample of an (n, ...) input, as for the trainer
    # alone (scikit-learn's count, shape[1], said 2 and refused every flat row of 6 with
    # "X has 6 features, but ... is expecting 2"); the features are the best network's.
    rng = np.random.RandomState(0)
    X = rng.randn(30, 2, 3)
    y = X.reshape(30, -1).sum(axis=1)
    trainer = PathKernelMachine(module=_FlatNet, max_iter=5, tol=None, random_state=0,
                                dtype="float64")
    search = GridSearchCV(trainer, {"alpha": [0.0, 0.1]}, cv=2).fit(X, y)
    est = TangentFeatures(FrozenEstimator(search)).fit(X)
    alone = TangentFeatures(FrozenEstimator(search.best_estimator_)).fit(X)
    assert est.n_features_in_ == alone.n_features_in_ == 6
    assert est.input_shape_ == (2, 3)
    np.testing.assert_allclose(est.transform(X[:4]),
                               features_loop(module_at(search.best_estimator_), X[:4]),
                               rtol=1e-10, atol=1e-12)
    # A flat row of the 6 values is refused as the trainer alone refuses it.
    with pytest.raises(ValueError, match=r"shape \(n_samples, 2, 3\)"):
        est.transform(X[:3].reshape(3, 6))
    with pytest.raises(ValueError, match=r"shape \(3, 2, 4\)"):
        est.transform(rng.randn(3, 2, 4))
