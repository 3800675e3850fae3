"""``train_indices_``: the rows of fit's ``X`` that ``X_fit_`` holds.

With ``early_stopping`` (and in OODRankDetector, which drops zero-weight and repeated
rows) ``X_fit_`` is not ``X``, and every per-training-point output indexes ``X_fit_``: a
pandas user's ``X.iloc[idx]`` silently took other rows. The expected indices are found
from the data alone: each row of ``X_fit_`` matched against the (unique) rows of ``X``.
"""

import contextlib
import pickle

import numpy as np
import pandas as pd
import pytest
from numpy.testing import assert_array_equal
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.utils.validation import check_is_fitted

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    RecordedNetwork,
    TangentFeatures,
    TangentFeatureSVM,
)

SMALL = dict(hidden_layer_sizes=(6,), max_iter=4, tol=None, batch_size=8,
             dtype="float64", random_state=0)
STOPPING = dict(SMALL, early_stopping=True, validation_fraction=0.25, n_iter_no_change=2)


def _data(n=40, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 3))
    return X, np.sin(X[:, 0]) + X[:, 1], np.arange(n) % 2


def _matched_rows(X_fit, X):
    """For each row of X_fit, the one row of X equal to it (X's rows are distinct)."""
    equal = (X_fit[:, None, :] == X[None, :, :]).all(axis=2)
    assert (equal.sum(axis=1) == 1).all()
    return equal.argmax(axis=1)


def _check_map(est, X):
    rows = est.train_indices_
    assert rows.dtype.kind == "i" and rows.shape == (len(est.X_fit_),)
    assert_array_equal(rows, _matched_rows(est.X_fit_, X))
    assert np.array_equal(X[rows], est.X_fit_)
    return rows


@pytest.mark.parametrize("cls", [PathKernelClassifier, PathKernelMachine])
@pytest.mark.parametrize("weighted", [False, True])
def test_early_stopping_maps_X_fit_rows_to_X(cls, weighted):
    X, y_reg, y_cls = _data()
    y = y_cls if cls is PathKernelClassifier else y_reg
    w = np.random.RandomState(1).uniform(0.5, 2.0, size=len(X)) if weighted else None
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    est = cls(**STOPPING).fit(frame, y, sample_weight=w)
    rows = _check_map(est, X)
    assert len(rows) == len(X) - 10  # ceil(0.25 * 40) held out
    assert not np.array_equal(rows, np.arange(len(rows)))  # the check could fail
    # What the user does with an index of a training point: X.iloc[train_indices_[i]].
    idx = est.kneighbors(frame.iloc[rows[[3, 17]]], n_neighbors=1, return_distance=False)
    assert_array_equal(rows[idx[:, 0]], rows[[3, 17]])
    # Without early stopping, every row, in order.
    full = cls(**SMALL).fit(frame, y, sample_weight=w)
    assert_array_equal(full.train_indices_, np.arange(len(X)))


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_pickle_round_trip_keeps_the_map(storage, tmp_path):
    X, y, _ = _data()
    est = PathKernelMachine(**STOPPING, trajectory_storage=storage,
                            trajectory_dir=str(tmp_path) if storage == "disk" else None,
                            warm_start=storage == "disk").fit(X, y)
    with (pytest.warns(UserWarning, match="on-disk") if storage == "disk"
          else contextlib.nullcontext()):
        back = pickle.loads(pickle.dumps(est))
    assert_array_equal(back.train_indices_, est.train_indices_)
    _check_map(back, X)
    meta = TangentFeatures(PathKernelMachine(**STOPPING)).fit(X, y)
    back = pickle.loads(pickle.dumps(meta))
    assert_array_equal(back.train_indices_, meta.train_indices_)
    _check_map(back, X)
    # A fitted attribute: not there before fit, nor on a clone.
    check_is_fitted(est)
    for fitted in (est, meta):
        assert not hasattr(clone(fitted), "train_indices_")
    with pytest.raises(AttributeError, match="train_indices_.*not fitted"):
        _ = PathKernelMachine().train_indices_
    with pytest.raises(AttributeError, match="train_indices_.*not fitted"):
        _ = TangentFeatures().train_indices_


def test_skops_round_trip_keeps_the_map():
    sio = pytest.importorskip("skops.io")
    X, y, _ = _data()
    est = PathKernelMachine(**STOPPING).fit(X, y)
    blob = sio.dumps(est)
    back = sio.loads(blob, trusted=sio.get_untrusted_types(data=blob))
    assert_array_equal(back.train_indices_, est.train_indices_)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_warm_start_on_the_same_X_keeps_the_map_and_other_data_drops_it(storage, tmp_path):
    X, y, _ = _data()
    est = PathKernelMachine(**STOPPING, warm_start=True, trajectory_storage=storage,
                            trajectory_dir=str(tmp_path)).fit(X, y)
    first = _check_map(est, X).copy()
    est.fit(X, y)  # the same split (an int random_state): the same training rows
    assert est.trajectory_.n_samples == len(first)
    assert_array_equal(_check_map(est, X), first)
    X2, y2, _ = _data(seed=5)
    est.fit(X2, y2)  # appended: X_fit_ holds both calls' rows
    assert len(est.X_fit_) == 2 * len(first)
    assert est.train_indices_ is None
    est.fit(X2, y2)  # not the same training set as X_fit_ (both calls' rows): appended
    assert est.train_indices_ is None


def test_partial_fit_maps_its_first_call_only():
    X, y, _ = _data()
    est = PathKernelMachine(**SMALL).partial_fit(X[:20], y[:20])
    assert_array_equal(est.train_indices_, np.arange(20))
    est.partial_fit(X[:20], y[:20])  # each call's rows are appended, the same ones too
    assert len(est.X_fit_) == 40 and est.train_indices_ is None
    est.fit(X, y)  # a new fit (warm_start=False) maps again
    _check_map(est, X)


def test_failed_fit_leaves_the_previous_map():
    X, _, y = _data()
    est = PathKernelClassifier(**STOPPING).fit(X, y)
    before = est.train_indices_
    bad = y.copy()
    bad[0] = 7  # a class of one sample: the stratified split refuses it
    with pytest.raises(ValueError, match="early_stopping"):
        est.fit(X[::-1], bad)
    assert est.train_indices_ is before
    det = OODRankDetector(PathKernelMachine(**STOPPING)).fit(X)
    before = det.train_indices_
    # Refused after the trainer's fit, when the span's rows are set.
    with pytest.raises(ValueError, match="2 distinct training points"):
        det.fit(np.repeat(X[:1], len(X), axis=0))
    assert det.train_indices_ is before


@pytest.mark.parametrize("meta", [TangentFeatures, TangentFeatureSVM])
def test_meta_estimators_map_to_their_X(meta):
    X, _, y = _data()
    est = meta(PathKernelClassifier(**STOPPING)).fit(X, y)
    rows = _check_map(est, X)
    assert len(rows) == 30
    assert_array_equal(rows, est.estimator_.train_indices_)
    # A frozen trainer fitted on other rows: X_fit_ is this X, its map is the trainer's.
    trainer = PathKernelClassifier(**STOPPING).fit(X[:36], y[:36])
    frozen = meta(FrozenEstimator(trainer)).fit(X[4:], y[4:])
    assert_array_equal(_check_map(frozen, X[4:]), np.arange(36))
    _check_map(frozen.estimator_, X[:36])


def _with_repeats(seed=0):
    X, y, _ = _data(30, seed)
    order = np.random.RandomState(seed).permutation(np.r_[np.arange(30), [3, 3, 8, 21, 29]])
    return X[order], y[order]


def _expected_ood_rows(trainer_rows, X, w):
    """The trainer's rows of positive weight, each distinct row at its first occurrence."""
    rows = trainer_rows if w is None else trainer_rows[w[trainer_rows] > 0]
    _, first = np.unique(X[rows], axis=0, return_index=True)
    return rows[np.sort(first)]


@pytest.mark.parametrize("weighted", [False, True])
def test_ood_composes_early_stopping_with_its_dropped_rows(weighted):
    X, y = _with_repeats()
    w = None
    if weighted:
        w = np.random.RandomState(2).uniform(0.5, 2.0, size=len(X))
        w[[0, 5, 11]] = 0.0
    det = OODRankDetector(PathKernelMachine(**STOPPING)).fit(X, y, sample_weight=w)
    trainer_rows = det.estimator_.train_indices_
    assert np.array_equal(X[trainer_rows], det.estimator_.X_fit_)
    rows = det.train_indices_
    assert_array_equal(rows, _expected_ood_rows(trainer_rows, X, w))
    assert np.array_equal(X[rows], det.X_fit_)
    assert len(rows) < len(trainer_rows) < len(X)  # both drops happened
    # Frozen: the span's X is the one given here.
    frozen = OODRankDetector(FrozenEstimator(det.estimator_)).fit(X, sample_weight=w)
    assert_array_equal(frozen.train_indices_, _expected_ood_rows(np.arange(len(X)), X, w))
    assert np.array_equal(X[frozen.train_indices_], frozen.X_fit_)
    back = pickle.loads(pickle.dumps(det))
    assert_array_equal(back.train_indices_, rows)


def test_recorded_network_maps_its_X_train():
    X, y, _ = _data(12)
    est = PathKernelMachine(**SMALL).fit(X, y)
    net = RecordedNetwork(est.module_, est.trajectory_, X_train=X, y_train=y)
    assert_array_equal(net.train_indices_, np.arange(len(X)))
    assert RecordedNetwork(est.module_, est.trajectory_).train_indices_ is None
    meta = TangentFeatures(net).fit(X[2:])
    assert_array_equal(meta.train_indices_, np.arange(len(X) - 2))
