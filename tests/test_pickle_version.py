"""Pickles stamped with the skpathkernel version that made them, as scikit-learn stamps
its own estimators': unpickled by another version (or made before the stamp), every
public object warns with InconsistentVersionWarning, which users can filter; under the
same version nothing warns and the objects are what they were."""

import pickle
import warnings

import joblib
import numpy as np
import pytest
import skops.io as sio
from numpy.testing import assert_array_equal
from sklearn.base import clone

import skpathkernel
from skpathkernel import (
    InconsistentVersionWarning,
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    RecordedNetwork,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
)
from skpathkernel import _warnings as _warnings_module

KEY = "_skpathkernel_version"
NET = dict(hidden_layer_sizes=(4,), max_iter=3, tol=None, random_state=0)


def _data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    return X, (X[:, 0] > 0).astype(int)


def _objects():
    """Every public class whose objects pickle their state, fitted."""
    X, y = _data()
    reg = PathKernelMachine(**NET).fit(X, y.astype(float))
    clf = PathKernelClassifier(**NET).fit(X, y)
    return {
        "PathKernelMachine": reg,
        "PathKernelClassifier": clf,
        "TangentFeatures": TangentFeatures(PathKernelMachine(**NET), n_components=3).fit(
            X, y.astype(float)),
        "TangentFeatureSVM": TangentFeatureSVM(PathKernelClassifier(**NET)).fit(X, y),
        "OODRankDetector": OODRankDetector(PathKernelClassifier(**NET)).fit(X, y),
        "RecordedNetwork": RecordedNetwork(reg.module_, reg.trajectory_, X_train=X,
                                           y_train=y.astype(float)),
        "TrainedNetwork": reg.network_,
        "Trajectory": reg.trajectory_,
        "PathKernel": PathKernel(reg),
        "TangentKernel": TangentKernel(clf),
    }


OBJECTS = list(_objects())


def _outputs(name, obj, X):
    """What each object computes, to compare a loaded one with the original."""
    if name == "Trajectory":
        return obj.parameters(-1).numpy()
    if name in ("PathKernel", "TangentKernel"):
        return obj(X)
    if name == "TrainedNetwork":
        return obj.outputs(X)
    if name == "OODRankDetector":
        return obj.score_samples(X)
    if name in ("TangentFeatures",):
        return obj.transform(X)
    return obj.predict(X)


@pytest.fixture(scope="module")
def objects():
    return _objects()


def _loads_quietly(blob):
    with warnings.catch_warnings():
        warnings.simplefilter("error", InconsistentVersionWarning)
        return pickle.loads(blob)


@pytest.mark.parametrize("name", OBJECTS)
def test_a_pickle_holds_the_version_and_loads_silently_under_it(objects, name):
    obj = objects[name]
    X = _data()[0][:3]
    # The stamp, read from the state pickle writes (not from the package's own code).
    assert obj.__getstate__()[KEY] == skpathkernel.__version__
    blob = pickle.dumps(obj)
    assert KEY.encode() in blob and skpathkernel.__version__.encode() in blob
    back = _loads_quietly(blob)
    assert KEY not in vars(back) and KEY not in vars(obj)
    assert_array_equal(_outputs(name, back, X), _outputs(name, obj, X))


@pytest.mark.parametrize("name", OBJECTS)
def test_a_pickle_of_another_version_warns_with_a_filterable_warning(objects, name,
                                                                       monkeypatch):
    obj = objects[name]
    X = _data()[0][:3]
    with monkeypatch.context() as m:
        m.setattr(_warnings_module, "__version__", "0.0.1")
        blob = pickle.dumps(obj)
    with pytest.warns(InconsistentVersionWarning) as record:
        back = pickle.loads(blob)
    warned = [w.message for w in record if isinstance(w.message, InconsistentVersionWarning)]
    mine = [w for w in warned if w.estimator_name == type(obj).__name__]
    assert len(mine) == 1 and mine[0].original_version == "0.0.1"
    assert mine[0].current_version == skpathkernel.__version__
    assert f"from skpathkernel version 0.0.1 when using version {skpathkernel.__version__}" \
        in str(mine[0])
    assert not hasattr(back, KEY)
    assert_array_equal(_outputs(name, back, X), _outputs(name, obj, X))
    # Filtered as any warning class is: then nothing warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=InconsistentVersionWarning)
        pickle.loads(blob)


def test_a_pickle_made_before_the_stamp_warns_of_an_unknown_version(objects):
    est = objects["PathKernelMachine"]
    state = est.__getstate__()
    del state[KEY]
    old = object.__new__(type(est))
    with pytest.warns(InconsistentVersionWarning, match="version unknown"):
        old.__setstate__(state)
    X = _data()[0][:3]
    assert_array_equal(old.predict(X), est.predict(X))


@pytest.mark.parametrize("how", ["joblib", "skops"])
def test_joblib_and_skops_round_trips_keep_the_stamp_out_of_the_object(objects, how,
                                                                      tmp_path):
    est = objects["PathKernelClassifier"]
    path = tmp_path / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("error", InconsistentVersionWarning)
        if how == "joblib":
            joblib.dump(est, path)
            back = joblib.load(path)
        else:
            sio.dump(est, path)
            back = sio.load(path, trusted=sio.get_untrusted_types(file=path))
    assert not hasattr(back, KEY)
    X = _data()[0]
    assert_array_equal(back.predict_proba(X), est.predict_proba(X))


def test_clone_and_kernel_comparisons_are_untouched(objects):
    est = objects["PathKernelMachine"]
    assert not hasattr(clone(est), KEY)
    assert clone(est).get_params() == est.get_params()
    for name in ("PathKernel", "TangentKernel"):
        kernel = objects[name]
        back = _loads_quietly(pickle.dumps(kernel))
        # The same hyper-parameters, and the kernel equal to itself and to a copy that
        # reads the same estimator (Kernel.__eq__ compares get_params).
        assert back.hyperparameters == kernel.hyperparameters
        assert kernel == kernel.clone_with_theta(kernel.theta)
        assert back == back.clone_with_theta(back.theta)
