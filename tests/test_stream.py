"""A stream of partial_fit / warm_start continuations in memory: each call grows the
path and the training set in buffers with spare rows (``_path._buffers.appended``)
instead of concatenating them anew, with the results of the concatenation, and never
changing what another holder of an earlier path or array sees."""

import copy
import io
import math
import pickle

import numpy as np
import pytest
import torch
from sklearn.frozen import FrozenEstimator

import skpathkernel._estimators._base as base
import skpathkernel._path._training as training
from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._path import _buffers

_ARRAYS = ("steps", "learning_rates", "_batch_indices", "_batch_offsets", "_state_steps",
           "_batch_weights", "_step_lrs")


def _concatenated(array, *parts):
    """The reference: the rows concatenated anew (what every call did before)."""
    if isinstance(array, torch.Tensor):
        return torch.cat([array, *parts])
    return np.concatenate([array, *parts])


def _data(n=40 * 20, n_features=6, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, n_features))
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int) + (X[:, 2] > 1)
    return X, y, rng.uniform(0.5, 2.0, size=n)


def _stream(est, X, y, w, calls, start=0, size=40):
    """``calls`` partial_fit calls on consecutive rows, every third one weighted."""
    for i in range(start, start + calls):
        rows = slice(size * i, size * (i + 1))
        kw = {"sample_weight": w[rows]} if i % 3 == 2 else {}
        if isinstance(est, PathKernelClassifier):
            kw["classes"] = np.unique(y)
        est.partial_fit(X[rows], y[rows], **kw)
    return est


def _path_arrays(est):
    """Copies of everything the fitted path and training set hold."""
    traj = est.trajectory_
    out = {"params": traj._params.clone(),
           **{f"state-{k}": v.clone() for k, v in traj._states.items()},
           "X_fit": np.array(est.X_fit_), "y_fit": np.array(est.network_.y_fit),
           "sample_weight": None if est.network_.sample_weight is None
           else np.array(est.network_.sample_weight)}
    out.update({name: None if getattr(traj, name) is None else np.array(getattr(traj, name))
                for name in _ARRAYS})
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is None or b[key] is None:
            assert a[key] is None and b[key] is None, key
        elif isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key].dtype == b[key].dtype, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("Est", [PathKernelClassifier, PathKernelMachine])
def test_a_streamed_path_is_the_concatenated_one_bit_for_bit(Est, monkeypatch):
    """20 calls (some weighted): the path, the training set, predictions, the exact
    decomposition and the attribution over the streamed path are those of the
    concatenating reference, to the bit. (An equivalence check: it passes on the code
    before the buffers too.)"""
    X, y, w = _data()
    if Est is PathKernelMachine:
        y = X @ np.linspace(-1, 1, X.shape[1])
    params = dict(hidden_layer_sizes=(16,), batch_size=20, random_state=0)
    tree = _stream(Est(**params), X, y, w, 20)
    with monkeypatch.context() as m:
        m.setattr(base, "appended", _concatenated)
        m.setattr(training, "appended", _concatenated)
        ref = _stream(Est(**params), X, y, w, 20)
    assert tree.trajectory_.n_steps == ref.trajectory_.n_steps == 40
    _assert_same(_path_arrays(tree), _path_arrays(ref))
    Q = X[:5] + 0.1
    np.testing.assert_array_equal(tree.predict(Q), ref.predict(Q))
    d_tree, d_ref = tree.decompose(Q), ref.decompose(Q)
    np.testing.assert_array_equal(d_tree.contributions, d_ref.contributions)
    np.testing.assert_array_equal(d_tree.prediction, d_ref.prediction)
    assert d_tree.error == d_ref.error
    a_tree, a_ref = tree.attribute(Q[:2]), ref.attribute(Q[:2])
    np.testing.assert_array_equal(np.asarray(a_tree), np.asarray(a_ref))
    # A pickle carries the filled rows, not the buffers' spare ones.
    assert len(pickle.dumps(tree)) == len(pickle.dumps(ref))


def test_what_another_holder_sees_never_changes():
    """A path or training set obtained after call k, an estimator's shallow copy, a
    pickle and a FrozenEstimator taken then: unchanged by the estimator's later calls,
    and the copies continue on their own (as the estimator did, from the same point),
    without changing the estimator's path in turn."""
    X, y, w = _data()
    est = _stream(PathKernelClassifier(hidden_layer_sizes=(8,), batch_size=20,
                                       random_state=0), X, y, w, 6)
    held_traj, held_X = est.trajectory_, est.X_fit_
    seen = _path_arrays(est)
    # FrozenEstimator holds the estimator it is given: a shallow copy shares the path.
    shallow, frozen = copy.copy(est), FrozenEstimator(copy.copy(est))
    pickled = pickle.loads(pickle.dumps(est))
    frozen_pred = frozen.predict(X[:50])
    _stream(est, X, y, w, 4, start=6)  # the owner appends in place
    after_est = _path_arrays(est)
    assert len(est.trajectory_) > len(held_traj)
    np.testing.assert_array_equal(held_X, seen["X_fit"])
    assert torch.equal(held_traj._params, seen["params"])
    assert torch.equal(held_traj._states["exp_avg_sq"], seen["state-exp_avg_sq"])
    _assert_same(_path_arrays(shallow), seen)
    _assert_same(_path_arrays(pickled), seen)
    np.testing.assert_array_equal(frozen.predict(X[:50]), frozen_pred)
    _assert_same(_path_arrays(frozen.estimator), seen)
    # The copies append after the estimator did, from the same rows: into buffers of
    # their own, with the estimator's results, and the estimator's path stays.
    for other in (shallow, pickled):
        _stream(other, X, y, w, 4, start=6)
        _assert_same(_path_arrays(other), after_est)
        _assert_same(_path_arrays(est), after_est)
    # A warm start from the held path's estimator state leaves the path held unchanged.
    warm = copy.copy(shallow).set_params(warm_start=True, max_iter=2, tol=None)
    warm.fit(X[:40], y[:40])
    _assert_same(_path_arrays(shallow), after_est)


def _distinct_buffers(arrays):
    """How many times the next array does not start in the previous one's memory."""
    def start(a):
        return a.data_ptr() if isinstance(a, torch.Tensor) else \
            a.__array_interface__["data"][0]
    return sum(start(a) != start(b) for a, b in zip(arrays, arrays[1:]))


def test_a_stream_copies_each_row_a_bounded_number_of_times():
    """n calls reallocate each array O(log n) times and copy O(n) rows in all (the
    concatenation: a new array at every call, O(n^2) rows). Every earlier array is kept
    alive, so a reused address cannot pass for an in-place append."""
    X, y, w = np.tile(_data()[0], (2, 1)), np.tile(_data()[1], 2), np.ones(1600)
    n_calls = 160
    est = PathKernelClassifier(hidden_layer_sizes=(4,), batch_size=10, random_state=0)
    before = _buffers.reallocations()
    kept = {"X_fit": [], "params": [], "steps": [], "state": []}
    for i in range(n_calls):
        _stream(est, X, y, w, 1, start=i, size=10)
        kept["X_fit"].append(est.X_fit_)
        kept["params"].append(est.trajectory_._params)
        kept["steps"].append(est.trajectory_.steps)
        kept["state"].append(est.trajectory_._states["exp_avg_sq"])
    counts = {k: v - before[k] for k, v in _buffers.reallocations().items()}
    bound = math.ceil(math.log2(n_calls)) + 1
    for name, arrays in kept.items():
        assert _distinct_buffers(arrays) <= bound, name
    # X, y, the points, their states and the five per-step arrays; the first call's
    # arrays are the fit's own (copied at the second).
    n_arrays = 2 + 2 + 5
    assert counts["reallocations"] <= n_arrays * bound
    # Each row is copied at most once per doubling that passes it: fewer than the final
    # rows in all, per array (the rows of the largest arrays: steps' batches, 10 each).
    assert counts["rows_copied"] <= n_arrays * 10 * (n_calls + 1)
    assert len(est.trajectory_) == n_calls + 1


def test_appended_grows_geometrically_and_copies_only_for_non_owners():
    x = np.arange(3.0)
    views = [x]
    for i in range(40):
        views.append(_buffers.appended(views[-1], np.array([float(i)])))
    capacities = sorted({len(v.base) for v in views[1:]})
    assert all(b >= 2 * a for a, b in zip(capacities, capacities[1:]))
    np.testing.assert_array_equal(views[-1], np.concatenate([x, np.arange(40.0)]))
    # An older view appended to again: a new buffer, the newer view unchanged.
    newer = views[-1].copy()
    side = _buffers.appended(views[10], np.array([-1.0]))
    np.testing.assert_array_equal(views[-1], newer)
    assert not np.shares_memory(side, views[-1])
    np.testing.assert_array_equal(side, np.concatenate([views[10], [-1.0]]))
    # np.concatenate's dtype: an int buffer extended by floats becomes float.
    ints = _buffers.appended(np.arange(2), np.arange(2))
    assert _buffers.appended(ints, np.array([0.5])).dtype == np.float64
    with pytest.raises(ValueError, match="cannot follow rows of shape"):
        _buffers.appended(np.zeros((2, 3)), np.zeros((1, 1)))
    # Pickles and torch.save carry the filled rows only.
    assert len(pickle.dumps(views[-1])) == len(pickle.dumps(views[-1].copy()))
    t = _buffers.appended(torch.zeros(5, 3), torch.ones(1, 3))
    saved = io.BytesIO()
    torch.save(_buffers.compact(t), saved)
    alone = io.BytesIO()
    torch.save(t.clone(), alone)
    assert len(saved.getvalue()) == len(alone.getvalue())


def test_a_saved_streamed_path_holds_no_spare_rows(tmp_path):
    X, y, w = _data()
    est = _stream(PathKernelClassifier(hidden_layer_sizes=(8,), batch_size=20,
                                       random_state=0), X, y, w, 5)
    traj = est.trajectory_
    assert traj._params._base is not None  # a view of a buffer with spare rows
    # One file name: torch.save names the archive's records after it.
    (tmp_path / "streamed").mkdir()
    (tmp_path / "compact").mkdir()
    traj.save(tmp_path / "streamed" / "path.pt")
    compact = copy.copy(traj)
    compact._params = traj._params.clone()
    compact._states = {k: v.clone() for k, v in traj._states.items()}
    compact.save(tmp_path / "compact" / "path.pt")
    sizes = [(tmp_path / d / "path.pt").stat().st_size for d in ("streamed", "compact")]
    assert sizes[0] == sizes[1]
    loaded = type(traj).load(tmp_path / "streamed" / "path.pt")
    assert torch.equal(loaded._params, traj._params)


def test_a_disk_stream_is_the_memory_stream():
    """On disk the per-step arrays grow in buffers too (the points in the chunk files):
    the streamed path is the one streamed in memory, read from the files too."""
    X, y, w = _data()
    params = dict(hidden_layer_sizes=(8,), batch_size=20, random_state=0)
    est = _stream(PathKernelClassifier(**params, trajectory_storage="disk"), X, y, w, 10)
    memory = _stream(PathKernelClassifier(**params), X, y, w, 10)
    from_files = est.trajectory_.for_workers()  # a reader of the chunk files
    for traj in (est.trajectory_, from_files):
        assert len(traj) == len(memory.trajectory_) == 21
        for k in range(len(traj)):
            assert torch.equal(traj.parameters(k), memory.trajectory_.parameters(k))
            if k < len(traj) - 1:
                assert torch.equal(traj.optimizer_state(k)["exp_avg_sq"],
                                   memory.trajectory_.optimizer_state(k)["exp_avg_sq"])
        for name in _ARRAYS:
            ours, theirs = getattr(traj, name), getattr(memory.trajectory_, name)
            assert (ours is None and theirs is None) or np.array_equal(ours, theirs), name
    np.testing.assert_array_equal(est.X_fit_, memory.X_fit_)
    np.testing.assert_array_equal(est.predict(X[:30]), memory.predict(X[:30]))
