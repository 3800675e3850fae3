"""On-disk trajectories: the same path as in memory, chunk by chunk, and every fault named.

The reference for every number is the in-memory trajectory of the same seeded fit (or the
same user loop): recording is deterministic, so the points must be bit-identical and the
kernels and decompositions equal to round-off.
"""

import copy
import errno
import fcntl
import gc
import mmap
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import warnings
import weakref

import joblib
import numpy as np
import pytest
import torch
from _reference import sklearn_step_sizes
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.utils._param_validation import InvalidParameterError

from skpathkernel import (
    PathKernelMachine,
    PathRecorder,
    RecordedNetwork,
    TrainingDivergedError,
    Trajectory,
)
from skpathkernel._path import _storage, _trajectory
from skpathkernel._path._storage import TrajectoryFileError
from skpathkernel.kernels import PathKernel

CHUNK = 3  # vectors per chunk file in these tests: many files, and partial last ones


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *args: CHUNK)


@pytest.fixture
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    return X, np.sin(2 * X[:, 0]) - X[:, 1]


NET = dict(hidden_layer_sizes=(7,), max_iter=4, batch_size=5, dtype="float64", tol=None,
           random_state=0)


def _fit(X, y, storage="memory", **kw):
    return PathKernelMachine(**{**NET, **kw}, trajectory_storage=storage).fit(X, y)


def _assert_same_path(a: Trajectory, b: Trajectory):
    assert len(a) == len(b) and a.names == b.names and a.shapes == b.shapes
    assert_array_equal(a.steps, b.steps)
    assert_array_equal(a.learning_rates, b.learning_rates)
    assert a.n_steps == b.n_steps
    for x, y in zip(a.batches, b.batches):
        assert_array_equal(x, y)
    for k in range(len(a)):
        assert torch.equal(a.parameters(k), b.parameters(k)), k
    for k in range(len(a) - 1):
        Da, Db = a.preconditioner(k), b.preconditioner(k)
        assert (Da is None and Db is None) or torch.equal(Da, Db), k


def _chunk_files(traj, series="params"):
    return sorted(os.listdir(os.path.join(traj.directory, series)))


@pytest.mark.parametrize("solver, extra", [("sgd", {}), ("sgd", {"momentum": 0.5}),
                                           ("adam", {"alpha": 1e-3}), ("rmsprop", {})])
def test_disk_path_equals_memory_path(data, solver, extra):
    X, y = data
    mem = _fit(X, y, solver=solver, learning_rate_init=0.05, **extra)
    disk = _fit(X, y, "disk", solver=solver, learning_rate_init=0.05, **extra)
    traj = disk.trajectory_
    assert traj.storage == "disk" and mem.trajectory_.storage == "memory"
    assert traj.directory in repr(traj)
    # 17 points in chunks of 3: six files, the last one partial.
    assert _chunk_files(traj) == [f"{i:06d}.npy" for i in range(6)]
    _assert_same_path(mem.trajectory_, traj)
    assert_allclose(disk.predict(X), mem.predict(X), rtol=0, atol=0)
    K_mem = PathKernel(mem)(X, X[:5])
    assert_allclose(PathKernel(disk)(X, X[:5]), K_mem, rtol=1e-13, atol=1e-15)
    # The sweep over the path keeps at most two chunks per series in memory.
    assert len(traj._params.series._cache) <= 2
    d_mem, d_disk = mem.decompose(X[:3]), disk.decompose(X[:3])
    assert_allclose(d_disk.contributions, d_mem.contributions, rtol=1e-12, atol=1e-15)
    assert d_disk.error < 1e-10


STOPPED = dict(max_iter=30, early_stopping=True, n_iter_no_change=2, tol=0.0)


@pytest.mark.parametrize("kw, tail", [({"record_every": 3}, False),
                                      ({**STOPPED, "learning_rate_init": 0.03}, False),
                                      ({**STOPPED, "learning_rate_init": 0.01,
                                        "record_every": 2}, True)])
def test_disk_path_thinned_or_stopped_early(data, kw, tail):
    # An early stop that kept an earlier epoch uses fewer points than the files hold;
    # with record_every=2 that epoch ends between recorded points, so the path's last
    # point is held in memory (and saved with the description).
    X, y = data
    mem, disk = _fit(X, y, **kw), _fit(X, y, "disk", **kw)
    rows = disk.trajectory_._params
    assert (rows.tail is not None) == tail
    assert (rows.series.n_rows > rows.n) == ("early_stopping" in kw)
    _assert_same_path(mem.trajectory_, disk.trajectory_)
    assert_allclose(PathKernel(disk)(X), PathKernel(mem)(X), rtol=1e-13, atol=1e-15)


SCHEDULE = dict(solver="sgd", momentum=0.9, learning_rate="invscaling",
                learning_rate_init=0.05, power_t=0.5, record_every=3, normalize_y=False)


@pytest.mark.parametrize("storage, kw", [("memory", {}), ("disk", {}),
                                         ("disk", {"trajectory_compression": "float16"})])
def test_every_step_size_of_a_schedule_travels_with_the_path(data, storage, kw, tmp_path):
    """A thinned path whose step size changes inside its intervals (invscaling, 4 steps
    an epoch, a point every 3) keeps every step's, as sklearn's rule gives them, through
    save / load, pickling, the workers' shared copy and compressed storage; the unrolled
    scores read them back (equal to the path's in memory: no replay mismatch)."""
    X, y = data
    est = _fit(X, y, storage, **SCHEDULE, **kw)
    traj = est.trajectory_
    lrs = sklearn_step_sizes(SCHEDULE, len(X), 4, traj.n_steps)
    assert len(set(lrs[3:6])) == 2  # an epoch ends inside the interval of steps 3 to 5
    assert_array_equal(traj.step_learning_rates, lrs)
    mem = _fit(X, y, **SCHEDULE)
    # The interval means, as before, of the same steps.
    assert_array_equal(traj.learning_rates, mem.trajectory_.learning_rates)
    for k in range(len(traj) - 1):
        assert_allclose(traj.learning_rates[k],
                        lrs[traj.steps[k]:traj.steps[k + 1]].mean(), rtol=1e-15)
    target = tmp_path / ("saved" if storage == "disk" else "saved.pt")
    traj.save(target)
    copies = [Trajectory.load(target), pickle.loads(pickle.dumps(traj)),
              pickle.loads(pickle.dumps(traj.for_workers(by_reference=True)))]
    for other in copies:
        assert_array_equal(other.step_learning_rates, lrs)
        assert_array_equal(other.learning_rates, traj.learning_rates)
    if not kw:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an exact replay of every interval
            scores = RecordedNetwork(est.module_, copies[0], X_train=X, y_train=y
                                     ).attribute(X[:2], method="unrolled")
        assert scores.replay_error < 1e-13
        assert_allclose(scores, mem.attribute(X[:2], method="unrolled"), rtol=1e-13,
                        atol=1e-15)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_path_saved_before_step_sizes_were_kept_loads_as_before(data, storage, tmp_path):
    """A file or pickle without every step's step size (an older version's) loads with
    each step at its interval's mean, and its unrolled scores still say they miss."""
    X, y = data
    est = _fit(X, y, storage, **SCHEDULE)
    traj = est.trajectory_
    target = tmp_path / ("saved" if storage == "disk" else "saved.pt")
    traj.save(target)
    meta = target / "trajectory.pt" if storage == "disk" else target
    payload = torch.load(meta, weights_only=True)
    del payload["step_lrs"]
    torch.save(payload, meta)
    state = traj.__getstate__()
    del state["_step_lrs"], state["_step_group_lrs"]
    unpickled = object.__new__(Trajectory)
    unpickled.__setstate__(state)
    for old in (Trajectory.load(target), unpickled):
        assert old._step_lrs is None
        assert_array_equal(old.learning_rates, traj.learning_rates)
        assert_array_equal(old.step_learning_rates,
                           np.repeat(traj.learning_rates, np.diff(traj.steps)))
        net = RecordedNetwork(est.module_, old, X_train=X, y_train=y)
        with pytest.warns(UserWarning, match="miss the recorded path"):
            net.attribute(X[:2], method="unrolled")


@pytest.mark.parametrize("target_exists", [False, True])
def test_save_gives_the_directory_the_permissions_of_a_new_one(data, tmp_path,
                                                                target_exists):
    # The temporary directory is private (mkdtemp: 0o700) and a rename kept that: a
    # model saved by a training job's account could not be read by the service's.
    X, y = data
    est = _fit(X, y, "disk")
    assert os.stat(est.trajectory_.directory).st_mode & 0o777 == 0o700
    reference = tmp_path / "made"  # what a directory made here gets (the umask's)
    reference.mkdir()
    target = tmp_path / "saved"
    if target_exists:  # an empty directory given: its own permissions are kept
        target.mkdir()
        os.chmod(target, 0o750)
    expected = 0o750 if target_exists else os.stat(reference).st_mode & 0o7777
    est.trajectory_.save(target)
    assert os.stat(target).st_mode & 0o7777 == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made", "saved"]
    assert_array_equal(est.predict(X), _fit(X, y).predict(X))
    _assert_same_path(est.trajectory_, Trajectory.load(target))


def test_a_second_save_to_where_it_was_saved_moves_nothing(data, tmp_path):
    # It was refused as a directory that "exists and is not an empty directory": a
    # script run again, or a save after partial_fit extended the saved path, failed.
    X, y = data
    est = _fit(X, y, "disk", warm_start=True)
    target = tmp_path / "saved"
    est.trajectory_.save(target)
    inode = os.stat(target / "params" / "000000.npy").st_ino
    est.fit(X, y)  # extends the path in place, in the saved directory
    os.symlink(target, tmp_path / "link")
    for again in (target, tmp_path / "link"):
        est.trajectory_.save(again)
        assert est.trajectory_.directory == os.fspath(target)
        assert os.stat(target / "params" / "000000.npy").st_ino == inode
        _assert_same_path(est.trajectory_, Trajectory.load(target))
    assert len(est.trajectory_) == len(_fit(X, y, max_iter=8).trajectory_)
    # Where a temporary path is: kept from now on, as by any save.
    other = _fit(X, y, "disk")
    kept = other.trajectory_.directory
    other.trajectory_.save(kept)
    del other
    gc.collect()
    assert os.path.isdir(kept)
    shutil.rmtree(kept)


def test_save_is_a_rename_and_load_is_lazy(data, tmp_path):
    X, y = data
    est = _fit(X, y, "disk", solver="adam")
    traj = est.trajectory_
    old = traj.directory
    inode = os.stat(os.path.join(old, "params", "000000.npy")).st_ino
    target = tmp_path / "saved"
    traj.save(target)
    assert not os.path.exists(old) and traj.directory == os.fspath(target)
    # The same file, renamed: no copy was made.
    assert os.stat(target / "params" / "000000.npy").st_ino == inode
    loaded = Trajectory.load(target)
    assert loaded.storage == "disk" and len(loaded._params.series._cache) == 0
    _assert_same_path(traj, loaded)
    net = RecordedNetwork(est.module_, loaded)
    assert_allclose(net.path_kernel_(X), PathKernel(est)(X), rtol=1e-13, atol=1e-15)
    # Saved means kept: deleting every object leaves the directory.
    del est, traj, loaded, net
    gc.collect()
    assert (target / "trajectory.pt").exists()


def test_relative_directories_are_read_from_any_working_directory(data, tmp_path,
                                                                    monkeypatch):
    # A directory named relative to the working directory (trajectory_dir, save, load)
    # is the one it named then: after a chdir, and in a pickle loaded elsewhere, the same
    # files are read, and a temporary one is removed where it is.
    X, y = data
    K = PathKernel(_fit(X, y, solver="adam"))(X)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    est = _fit(X, y, "disk", solver="adam", trajectory_dir="temporary")
    monkeypatch.chdir(tmp_path / "b")
    assert_allclose(PathKernel(est)(X), K, rtol=1e-13, atol=1e-15)
    del est
    gc.collect()
    assert os.listdir(tmp_path / "a" / "temporary") == []

    monkeypatch.chdir(tmp_path / "a")
    est = _fit(X, y, "disk", solver="adam")
    est.trajectory_.save("saved")
    loaded = Trajectory.load("saved")
    blob = pickle.dumps(est)
    monkeypatch.chdir(tmp_path / "b")
    for traj in (est.trajectory_, loaded, pickle.loads(blob).trajectory_):
        assert traj.directory == os.fspath(tmp_path / "a" / "saved")
        assert_allclose(RecordedNetwork(est.module_, traj).path_kernel_(X), K, rtol=1e-13,
                        atol=1e-15)


def test_save_refuses_a_non_empty_target(data, tmp_path):
    X, y = data
    traj = _fit(X, y, "disk").trajectory_
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="busy"):
        traj.save(tmp_path / "busy")
    assert os.path.isdir(traj.directory)


def test_temporary_directory_goes_with_the_trajectory(data, tmp_path):
    X, y = data
    est = PathKernelMachine(**NET, trajectory_storage="disk", trajectory_dir=tmp_path / "t")
    est.fit(X, y)
    first = est.trajectory_.directory
    assert os.path.dirname(first) == os.fspath(tmp_path / "t")
    est.fit(X, y)  # a refit replaces the path: the old directory is deleted
    gc.collect()
    assert not os.path.exists(first) and os.path.isdir(est.trajectory_.directory)
    second = est.trajectory_.directory
    del est
    gc.collect()
    assert not os.path.exists(second)


@pytest.mark.parametrize("saved", ["original", "copy"])
def test_a_deep_copy_follows_its_directory_when_another_copy_saves_it(data, saved,
                                                                      tmp_path):
    # Deep copies read one directory; saving is a rename: the copy not saved kept the old
    # name and failed with "chunk file ... is missing".
    X, y = data
    est = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path / "t")
    ref = _fit(X, y, "memory", solver="adam")
    other = copy.deepcopy(est)
    mover, reader = (est, other) if saved == "original" else (other, est)
    mover.trajectory_.save(tmp_path / "saved")
    assert reader.trajectory_.directory == os.fspath(tmp_path / "saved")
    _assert_same_path(ref.trajectory_, reader.trajectory_)
    assert_array_equal(reader.decompose(X[:3]).contributions, ref.decompose(X[:3]).contributions)
    del est, other
    gc.collect()
    assert os.path.isdir(tmp_path / "saved")  # saved: no longer temporary


def test_pickle_references_the_directory_and_keeps_it(data):
    X, y = data
    est = _fit(X, y, "disk", solver="adam")
    directory = est.trajectory_.directory
    K = PathKernel(est)(X)
    with pytest.warns(UserWarning, match="Pickling references the on-disk trajectory"):
        blob = pickle.dumps(est)
    # A reference, not the points (the estimator's optimizer state, which a warm start
    # or partial_fit continues from, is pickled: it is not the path's).
    assert directory.encode() in blob
    assert not any(est.trajectory_.parameters(k).numpy().tobytes() in blob
                   for k in range(len(est.trajectory_) - 1))
    del est
    gc.collect()
    assert os.path.isdir(directory)
    back = pickle.loads(blob)
    assert back.trajectory_.directory == directory
    assert_allclose(PathKernel(back)(X), K, rtol=1e-13, atol=1e-15)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already kept: no second warning
        pickle.dumps(back)
    shutil.rmtree(directory)


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_temporary_directory_goes_without_the_cyclic_collector(data, solver, tmp_path):
    # A series and its store referenced each other: the directory of a refitted or deleted
    # estimator stayed on disk until the cyclic garbage collector ran (fits in a loop,
    # GridSearchCV's workers, each left its path behind meanwhile).
    X, y = data
    est = _fit(X, y, "disk", solver=solver, trajectory_dir=tmp_path)
    first = est.trajectory_.directory
    est.decompose(X[:2])
    gc.disable()
    try:
        est.fit(X, y)
        assert not os.path.exists(first)
        second = est.trajectory_.directory
        del est
        assert not os.path.exists(second)
    finally:
        gc.enable()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("refit", ["copy", "original", None])
def test_deep_copies_share_the_temporary_directory_and_the_last_removes_it(data, refit,
                                                                           tmp_path):
    # Unlike a pickle (read by another process, maybe after this one ended), a deep copy
    # lives in this process: the directory stays temporary, kept while any copy reads it.
    X, y = data
    est = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path)
    directory = est.trajectory_.directory
    K, pred = PathKernel(est)(X), est.predict(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is kept for good: no warning
        other = copy.deepcopy(est)
    assert other.trajectory_.directory == directory
    if refit == "copy":
        other.fit(X[::-1], y[::-1])
        other, est = est, other  # the untouched one reads the directory
    elif refit == "original":
        est.fit(X[::-1], y[::-1])
    else:
        del est
    gc.collect()
    assert os.path.isdir(directory)
    assert_array_equal(PathKernel(other)(X), K)
    assert_array_equal(other.predict(X), pred)
    del other
    gc.collect()
    assert not os.path.exists(directory)
    if refit is not None:  # the refit's own directory goes with it
        del est
        gc.collect()
    assert os.listdir(tmp_path) == []


def test_for_workers_pickles_a_reference_and_leaves_the_directory_temporary(data, tmp_path):
    X, y = data
    mem = _fit(X, y, "memory", solver="adam")
    assert mem.trajectory_.for_workers() is mem.trajectory_
    est = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path)
    traj = est.trajectory_
    directory = traj.directory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unlike pickling the trajectory: nothing kept
        blob = pickle.dumps(traj.for_workers())
    assert directory.encode() in blob and len(blob) < traj.nbytes
    back = pickle.loads(blob)
    _assert_same_path(back, mem.trajectory_)
    del back, est, traj
    gc.collect()
    assert not os.path.exists(directory)  # still the original's, removed with it


def test_missing_chunk_is_named_with_file_and_step(data, tmp_path):
    X, y = data
    est = _fit(X, y, "disk")
    est.trajectory_.save(tmp_path / "t")
    victim = tmp_path / "t" / "params" / "000002.npy"
    os.remove(victim)
    with pytest.raises(TrajectoryFileError, match=r"000002\.npy.*missing"):
        Trajectory.load(tmp_path / "t")
    # Removed after loading: named when read, with the recorded point and its step.
    with pytest.raises(TrajectoryFileError,
                       match=r"point ([6-8]) \(optimizer step \1\).*000002\.npy.*missing"):
        PathKernel(est)(X)
    assert isinstance(TrajectoryFileError("x"), OSError)


def test_truncated_or_foreign_chunk_is_named(data, tmp_path):
    X, y = data
    est = _fit(X, y, "disk")
    traj = est.trajectory_
    traj.save(tmp_path / "t")
    chunk = tmp_path / "t" / "params" / "000001.npy"
    data_bytes = chunk.read_bytes()
    chunk.write_bytes(data_bytes[: len(data_bytes) // 2])
    traj._params.series._cache.clear()
    with pytest.raises(TrajectoryFileError, match=r"point 3 .*000001\.npy.*truncated"):
        traj.parameters(3)
    # A chunk file from another network's directory (other P): named, not misread.
    other = PathKernelMachine(**{**NET, "hidden_layer_sizes": (4,)},
                              trajectory_storage="disk").fit(X, y)
    shutil.copy(os.path.join(other.trajectory_.directory, "params", "000001.npy"), chunk)
    with pytest.raises(TrajectoryFileError, match=r"000001\.npy.*another network"):
        traj.parameters(4)
    # And a whole directory of another network, handed with this module: refused.
    other.trajectory_.save(tmp_path / "other")
    with pytest.raises(ValueError, match=r"other.*recorded from another network"):
        RecordedNetwork(est.module_, Trajectory.load(tmp_path / "other"))


def test_an_unreadable_file_is_named_as_such_not_as_corrupt(data, tmp_path, monkeypatch):
    # A file the process may not read (a directory saved private to another account)
    # was reported "truncated or corrupt: Permission denied" (a chunk), or "missing"
    # (the training set's file of a continued path). The refusal made here by hand:
    # this suite may run as root, whom permissions do not stop.
    X, y = data
    est = _fit(X, y, "disk")
    est.trajectory_.save(tmp_path / "t")
    refused = errno.EACCES, os.strerror(errno.EACCES)

    def read_chunk(path):
        raise PermissionError(*refused, path)

    monkeypatch.setattr(_storage, "_read_chunk", read_chunk)
    est.trajectory_._params.series.forget()
    with pytest.raises(TrajectoryFileError,
                       match=r"000000\.npy.*cannot be read: Permission denied") as info:
        est.trajectory_.parameters(0)
    assert "corrupt" not in str(info.value)
    monkeypatch.undo()
    stream = _fit(X, y, "disk", warm_start=True)
    stream.fit(X, y)  # continued: its training set is kept in files beside the path
    data_file = stream._disk_data[0].path
    getsize = os.path.getsize

    def refuse(path):
        if os.fspath(path) == data_file:
            raise PermissionError(*refused, path)
        return getsize(path)

    monkeypatch.setattr(os.path, "getsize", refuse)
    with pytest.raises(TrajectoryFileError,
                       match=r"training data file.*cannot be read: Permission denied"):
        stream._disk_data[0].array()
    monkeypatch.undo()
    # A file private to another account in a directory this process may read: its
    # size is read from the directory, and opening it is what is refused (a bare
    # PermissionError from np.memmap).
    memmap = np.memmap

    def refuse_open(path, *args, **kwargs):
        if os.fspath(path) == data_file:
            raise PermissionError(*refused, path)
        return memmap(path, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", refuse_open)
    with pytest.raises(TrajectoryFileError,
                       match=r"training data file.*cannot be read: Permission denied"):
        stream._disk_data[0].array()


def test_full_disk_keeps_recording_in_memory(data, monkeypatch, tmp_path):
    X, y = data
    mem = _fit(X, y, solver="adam")
    real = _storage._write_chunk
    calls = []

    def fill_up(path, array):
        calls.append(path)
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, array)

    monkeypatch.setattr(_storage, "_write_chunk", fill_up)
    with pytest.warns(UserWarning, match=r"\.npy.*optimizer step \d+.*No space left.*"
                                         "nothing recorded is lost"):
        disk = _fit(X, y, "disk", solver="adam")
    traj = disk.trajectory_
    # Nothing lost: every point and moment as recorded in memory.
    _assert_same_path(mem.trajectory_, traj)
    assert_allclose(PathKernel(disk)(X), PathKernel(mem)(X), rtol=1e-13, atol=1e-15)
    # Space is back: saving writes the chunks that were kept in memory.
    monkeypatch.setattr(_storage, "_write_chunk", real)
    traj.save(tmp_path / "t")
    assert len(_chunk_files(traj)) == 6 and len(_chunk_files(traj, "exp_avg_sq")) == 6
    _assert_same_path(mem.trajectory_, Trajectory.load(tmp_path / "t"))


def test_failed_fit_leaves_the_estimator_and_its_directory(data, tmp_path):
    X, y = data
    est = _fit(X, y, "disk")
    directory = est.trajectory_.directory
    with pytest.raises(ValueError):
        est.fit(X, np.full(len(X), np.inf))
    assert est.trajectory_.directory == directory and os.path.isdir(directory)


@pytest.mark.parametrize("error", [RuntimeError, MemoryError])
def test_a_fit_the_writer_failed_leaves_no_temporary_directory(data, error, monkeypatch,
                                                               tmp_path):
    # The writer's error, raised from the training thread, holds that thread's frames
    # (the series, the store): kept in the store's list of writes, which its finalizer
    # holds, it kept the store, and its directory, alive until the interpreter exits.
    X, y = data
    # One chunk for the whole path (as for any small network): the write that fails is
    # the last one, awaited at the end of the recording.
    monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *args: 1000)

    def crash(path, array):
        raise error("simulated failure in the writer")  # a new one: not kept by the test

    monkeypatch.setattr(_storage, "_write_chunk", crash)
    with pytest.raises(error):
        _fit(X, y, "disk", trajectory_dir=tmp_path)
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_auto_storage_chooses_by_size(data):
    X, y = data
    small = _fit(X, y, "auto", memory_budget=2**20)
    assert small.trajectory_.storage == "memory"
    # 20 epochs of 4 steps of a 2-300-1 network: 81 points x 1201 floats > 2**20 bytes.
    big = _fit(X, y, "auto", memory_budget=2**20, hidden_layer_sizes=(300,), max_iter=20)
    assert big.trajectory_.storage == "disk" and big.trajectory_.record_every == 1


def test_storage_parameters_are_validated(data):
    X, y = data
    with pytest.raises(InvalidParameterError, match="trajectory_storage"):
        _fit(X, y, "cloud")
    with pytest.raises(InvalidParameterError, match="trajectory_dir"):
        PathKernelMachine(trajectory_dir=3).fit(X, y)


def _record(storage, n_steps=11, **kw):
    torch.manual_seed(0)
    X, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 1, dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(3, 40), torch.nn.Tanh(),
                              torch.nn.Linear(40, 1)).double()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    rec = PathRecorder(net, opt, n_samples=12, storage=storage, **kw)
    mid = None
    for step in range(n_steps):
        idx = torch.arange(4) + 4 * (step % 3)
        opt.zero_grad()
        (0.5 * (net(X[idx]) - y[idx]) ** 2).mean().backward()
        rec.set_batch(idx)
        opt.step()
        if step == 4:  # read while recording goes on (the last chunk from its buffer)
            mid = rec.trajectory
            mid = (mid, [mid.parameters(k).clone() for k in range(len(mid))])
    rec.close()
    return rec, mid, X, y


@pytest.mark.parametrize("storage, kw", [("disk", {}), ("auto", {"memory_budget": 2**20})])
def test_path_recorder_on_disk(storage, kw, monkeypatch):
    if storage == "auto":  # 1/32 of the budget per chunk: 5 vectors of 201 float64
        monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *a: 5)
    n_steps = 700 if storage == "auto" else 11  # "auto" moves to disk past 2**20 bytes
    mem, mem_mid, X, y = _record("memory", n_steps)
    disk, disk_mid, _, _ = _record(storage, n_steps, **kw)
    assert disk.trajectory.storage == "disk"
    _assert_same_path(mem_mid[0], disk_mid[0])
    for a, b in zip(mem_mid[1], disk_mid[1]):
        assert torch.equal(a, b)
    _assert_same_path(mem.trajectory, disk.trajectory)
    if storage == "disk":
        a = mem.as_estimator(X, y).decompose(X[:2])
        b = disk.as_estimator(X, y).decompose(X[:2])
        assert_allclose(b.contributions, a.contributions, rtol=1e-12, atol=1e-15)



def _auto_recording(net, opt, X, y, steps, budget, read_each=True, before_read=None):
    """A loop recorded with storage="auto": the path, checked against the loop's own
    copies of every point (and of Adam's second moments), and the storage after each
    step (``read_each``; else the path is read once, after ``before_read()``)."""
    rec = PathRecorder(net, opt, n_samples=8, storage="auto", memory_budget=budget)
    points = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]
    moments, kept = [], []
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (net(X) - y) ** 2).mean().backward()
        rec.set_batch(np.arange(8))
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        if isinstance(opt, torch.optim.Adam):
            moments.append(torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1)
                                      for p in net.parameters()]))
        if read_each:
            kept.append(rec.trajectory.storage)
    if before_read is not None:
        before_read()
    traj = rec.trajectory
    assert len(traj) == len(points)
    for k, point in enumerate(points):
        assert torch.equal(traj.parameters(k), point)
    for k, moment in enumerate(moments):
        assert torch.equal(traj.optimizer_state(k)["exp_avg_sq"], moment)
    return traj, kept


def test_path_recorder_auto_bounds_its_first_buffers():
    """storage="auto" with an unknown number of steps preallocated 64 steps in memory
    whatever memory_budget said: with Adam, 20001 float64 parameters (160 kB a vector)
    held 10 steps, 3.4 MB, under a 1 MiB budget, and would have held 65 points before
    moving. The first buffers now fit in the budget (3 points and 2 second moments), the
    path moves to disk as it grows past it, and its points are the loop's own copies."""
    torch.manual_seed(0)
    X, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4000), torch.nn.Tanh(),
                              torch.nn.Linear(4000, 1)).double()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    _, kept = _auto_recording(net, opt, X, y, 10, 2**20)
    assert kept[:2] == ["memory"] * 2  # 3 points and 2 moments: 800 kB
    assert kept[-1] == "disk"


def _count_live_rows(monkeypatch, n_params, itemsize):
    """The most bytes of rows of ``n_params`` values alive at once, counted where memory
    is allocated: (rows, ``n_params``) tensors of ``torch.empty`` and anonymous memory
    mappings (``mmap.mmap(-1, n)``) of whole rows, the new one counted as it is made.
    The recorder's buffers, counted outside it. Returns a one-item list, updated as
    they come."""
    live, peak = [], [0]
    empty, mapping = torch.empty, mmap.mmap

    def count(obj, nbytes):
        live.append((weakref.ref(obj), nbytes))
        peak[0] = max(peak[0], sum(n for ref, n in live if ref() is not None))

    def counting_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dim() == 2 and t.shape[1] == n_params:
            count(t, t.numel() * t.element_size())
        return t

    def counting_mmap(fileno, length, *args, **kwargs):
        m = mapping(fileno, length, *args, **kwargs)
        if fileno == -1 and length % (n_params * itemsize) == 0:
            count(m, length)
        return m

    monkeypatch.setattr(torch, "empty", counting_empty)
    monkeypatch.setattr(mmap, "mmap", counting_mmap)
    return peak


@pytest.mark.parametrize("solver, steps", [("sgd", 300), ("adam", 150)])
def test_path_recorder_auto_keeps_a_path_of_its_budget_within_it(solver, steps,
                                                                  monkeypatch):
    """storage="auto" doubled its buffers, holding the old and the new ones during the
    copy (up to 1.5 times the budget: 7.8 MB under 6 MiB here), and moved to disk where
    the doubled buffers would pass the budget: these paths of 0.96 of it (SGD 301 points,
    Adam 151 points and 150 moments of 20 kB) went to disk. Grown by parts, the buffers
    alive never pass the budget, counted where they are allocated, and the path stays in
    memory, equal to the loop's own copies."""
    budget = 6 * 2**20
    torch.manual_seed(0)
    X, y = torch.randn(8, 3), torch.randn(8, 1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1000), torch.nn.Tanh(),
                              torch.nn.Linear(1000, 1))
    opt = (torch.optim.SGD(net.parameters(), lr=0.01) if solver == "sgd"
           else torch.optim.Adam(net.parameters(), lr=1e-3))
    peak = _count_live_rows(monkeypatch, 5001, 4)
    recording = []  # the peak before the path is read (its join allocates)
    traj, _ = _auto_recording(net, opt, X, y, steps, budget, read_each=False,
                              before_read=lambda: recording.append(peak[0]))
    path = (len(traj) + (len(traj) - 1) * (solver == "adam")) * 5001 * 4
    assert 0.95 * budget < path <= budget
    # (At least the path: the count sees the buffers.)
    assert path <= recording[0] <= budget, (path, recording[0], budget)
    assert traj.storage == "memory"


def test_segments_join_releases_each_part_as_it_is_copied():
    """What a path read while recording is made of: the parts joined in order (against
    torch.cat of them), each part released once copied (no second whole copy held by
    the buffers), rows written after the joined ones kept, and the spare rows after
    them written by the next rows without touching the joined path."""
    from skpathkernel._path._buffers import Segments

    buf = Segments(lambda rows: torch.empty((rows, 4), dtype=torch.float64), 3)
    for rows in (5, 9, 10):
        buf.reserve(rows)
    for k in range(9):
        buf.slot(k).fill_(k)
    parts = [weakref.ref(p) for p in buf.parts]
    expected = torch.cat(buf.parts)[:9]
    whole, copied = buf.leading(7)
    assert copied and torch.equal(whole, expected[:7])
    # The parts that held rows 0-6 only are gone; the one holding rows 7 and 8 (written
    # after the 7 joined) is kept, in a view of its rows from 7 on.
    assert [ref() is None for ref in parts] == [True, True, False, True]
    assert len(buf) == 9 and torch.equal(buf[7], expected[7]) and torch.equal(buf[8], expected[8])
    view, copied = buf.leading(7)  # one part holds them now: a view, not a copy
    assert not copied and view.data_ptr() == whole.data_ptr()
    # A tail after the rows, and spare rows where nothing follows.
    tail = torch.full((4,), -1.0, dtype=torch.float64)
    whole, _ = buf.leading(9, tail)
    assert torch.equal(whole, torch.cat([expected, tail[None]]))
    assert len(buf) == 9  # the tail's row is the path's, not the buffers'
    # Spare rows after a joined path that nothing follows: the next rows are written
    # there, and the paths handed out keep their rows.
    buf.reserve(12)
    buf.slot(9).fill_(9)
    joined, copied = buf.leading(10, spare=2)
    assert copied and len(buf) == 12 and len(buf.parts) == 1
    buf.slot(10).fill_(10)
    nine = torch.full((1, 4), 9.0, dtype=torch.float64)
    assert torch.equal(joined, torch.cat([expected, nine]))
    assert buf.leading(11)[0].data_ptr() == joined.data_ptr()  # a view again
    assert torch.equal(whole, torch.cat([expected, tail[None]]))


@pytest.mark.parametrize("sizes", [(4,), (3, 1, 5), (2, 2, 2, 3)])
def test_segments_take_gives_the_rows_of_its_parts_as_indexing_does(sizes):
    """``Segments.take`` against NumPy's indexing of the parts concatenated, for rows
    within one part and across parts' boundaries, repeated, unsorted, negative (from the
    end, as indexing counts), none, and a 2-D index; out of range refused as indexing
    refuses it. The result is a copy, also for a 0-d index (one part's indexing with a
    0-d tensor gave a view of the buffer): writing it leaves the buffers alone."""
    from skpathkernel._path._buffers import Segments

    buf = Segments(lambda rows: torch.empty((rows, 3), dtype=torch.float64), sizes[0])
    for rows in np.cumsum(sizes)[1:]:
        buf.reserve(int(rows))
    n = len(buf)
    for k in range(n):
        buf.slot(k).copy_(torch.arange(3, dtype=torch.float64) + 10 * k)
    assert len(buf.parts) == len(sizes)
    reference = np.concatenate([p.numpy() for p in buf.parts])
    edge = sizes[0] % n  # the second part's first row (one part: its first)
    cases = [list(range(n)), [n - 1, 0], [edge - 1, edge, edge], [-1, -n, 2 - n], [],
             np.array([[0, n - 1], [1, -2]]), np.array([edge], dtype=np.int32)]
    for rows in cases:
        out = buf.take(rows)
        expected = reference[np.asarray(rows, dtype=np.int64)]
        assert out.dtype == torch.float64 and tuple(out.shape) == expected.shape, rows
        assert_array_equal(out.numpy(), expected)
    before = reference.copy()
    buf.take([0, n - 1]).fill_(-1.0)
    buf.take(np.int64(n - 1)).fill_(-1.0)  # a 0-d index: a row, copied too
    assert_array_equal(np.concatenate([p.numpy() for p in buf.parts]), before)
    for rows in ([n], [-n - 1], [0, n + 3]):
        with pytest.raises(IndexError):
            reference[rows]
        with pytest.raises(IndexError):
            buf.take(rows)


@pytest.mark.parametrize("available", [2_000_000, 700_000])
def test_path_recorder_auto_moves_to_disk_where_memory_is_short(available, monkeypatch):
    """storage="auto" under a memory_budget above the host's free memory raised
    MemoryError in the middle of the training loop (growing past 64 steps), or at the
    recorder's creation, where it can move to disk: it now does, with the loop's points.
    The host has ``available`` bytes less what the recorder's buffers hold (its first
    65 points take 1.3 MB; they grow by 3 rows, a chunk file's, after that)."""
    recorders = []
    init = _trajectory.TrajectoryRecorder.__init__

    def spy(self, *args, **kwargs):
        recorders.append(self)
        init(self, *args, **kwargs)

    def left():
        held = [getattr(rec, "_buf", None) for rec in recorders]
        return available - sum(b.nbytes for b in held
                               if b is not None and not isinstance(b, _storage.Series))

    monkeypatch.setattr(_trajectory.TrajectoryRecorder, "__init__", spy)
    monkeypatch.setattr(_trajectory, "_available_memory", left)
    torch.manual_seed(0)
    X, y = torch.randn(8, 3), torch.randn(8, 1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1000), torch.nn.Tanh(),
                              torch.nn.Linear(1000, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    # 101 points of 20 kB: 2.0 MB, which cannot all be held beside 10% of the host free.
    traj, _ = _auto_recording(net, opt, X, y, 100, 2**30)
    assert traj.storage == "disk"


def test_available_memory_counts_the_page_cache(tmp_path, monkeypatch):
    """The in-memory check read the free pages only (SC_AVPHYS_PAGES): the page cache
    that on-disk chunk files leave behind counted as taken, and 1 GB was refused with
    13.5 GB available. Linux's MemAvailable counts it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:            1000 kB\n"
                       "MemAvailable:   13509672 kB\nCached:          2681672 kB\n")
    monkeypatch.setattr(_trajectory, "_MEMINFO", str(meminfo), raising=False)
    assert _trajectory._available_memory() == 13509672 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")  # an old kernel: the free pages
    assert _trajectory._available_memory() == (os.sysconf("SC_AVPHYS_PAGES")
                                               * os.sysconf("SC_PAGE_SIZE"))


def test_path_recorder_refuses_bad_storage():
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="storage"):
        PathRecorder(net, opt, storage="tape")
    with pytest.raises(TypeError, match="directory"):
        PathRecorder(net, opt, storage="disk", directory=3)


@pytest.mark.parametrize("backend", ["loky", "threading"])
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_path_kernel_split_over_steps_equals_serial(data, backend, storage):
    X, y = data
    est = _fit(X, y, storage, solver="adam")
    Y = X[:5] + 0.1
    # Adam's "discrete" weights depend on where the summed range ends: the tasks' ranges
    # must take the whole range's weights.
    serial = [PathKernel(est)(X, Y), PathKernel(est, normalized=True)(X),
              PathKernel(est, start=3, stop=-2).diag(X),
              PathKernel(est, memory="continuous")(X)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # workers get a reference, the estimator keeps its
        with joblib.parallel_config(backend=backend, n_jobs=2):
            split = [PathKernel(est, split="steps")(X, Y),
                     PathKernel(est, normalized=True, split="steps")(X),
                     PathKernel(est, start=3, stop=-2, split="steps").diag(X),
                     PathKernel(est, memory="continuous", split="steps")(X)]
    for got, want in zip(split, serial):
        assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert est.trajectory_._store is None or est.trajectory_._store.owned
    with pytest.raises(ValueError, match="split"):
        PathKernel(est, split="columns")(X)


@pytest.mark.parametrize("compression, unit", [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
def test_compressed_steps_stay_within_one_rounding(data, compression, unit):
    # Reference: the same fit in memory, full precision. Each stored point is the
    # previous stored point plus the rounded step to the recorded one (error feedback):
    # within one rounding of that step, however long the chunk.
    X, y = data
    mem = _fit(X, y, solver="adam", learning_rate_init=0.05)
    low = _fit(X, y, "disk", solver="adam", learning_rate_init=0.05,
               trajectory_compression=compression)
    a, b = mem.trajectory_, low.trajectory_
    assert torch.equal(a.parameters(0), b.parameters(0))
    worst = 0.0
    for k in range(1, len(a)):
        step = (a.parameters(k) - b.parameters(k - 1)).abs()
        err = (b.parameters(k) - a.parameters(k)).abs()
        assert bool((err <= unit * step + 1e-15).all()), k
        worst = max(worst, float(err.max()))
    assert worst > 0  # it is lossy
    # Optimizer states are kept in full precision.
    assert torch.equal(a.preconditioner(5), b.preconditioner(5))
    assert b.nbytes < a.nbytes
    # The cost shows in the decomposition's error, not hidden: far above the exact
    # path's round-off, and of the order of the stored path's deviation.
    exact, lossy = mem.decompose(X[:4]), low.decompose(X[:4])
    assert exact.error < 1e-12 < 1e-8 < lossy.error < 1e-2
    K = PathKernel(mem)(X)
    assert_allclose(PathKernel(low)(X), K, rtol=0, atol=1e-3 * np.abs(K).max())


def test_compressed_reads_are_what_the_writer_kept(tmp_path):
    rec, mid, _, _ = _record("disk", compression="bfloat16")
    final = rec.trajectory  # chunks decoded from the files now
    for k, theta in enumerate(mid[1]):  # read mid-recording, partly from the write buffer
        assert torch.equal(theta, final.parameters(k)), k
    final.save(tmp_path / "t")
    loaded = Trajectory.load(tmp_path / "t")
    _assert_same_path(final, loaded)
    with pytest.raises(ValueError, match="compression"):
        PathRecorder(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(),
                                                             lr=0.1), compression="int8")


def test_compression_needs_the_disk(data):
    X, y = data
    with pytest.raises(ValueError, match="trajectory_storage='disk'"):
        _fit(X, y, trajectory_compression="float16")


def test_row_blocks_read_the_disk_path_by_reference(data):
    X, y = data
    est = _fit(X, y, "disk", solver="adam")
    serial = [PathKernel(est)(X), PathKernel(est).diag(X)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pickling of the owned directory
        with joblib.parallel_config(backend="loky", n_jobs=2):
            rows = [PathKernel(est)(X), PathKernel(est).diag(X)]
    for got, want in zip(rows, serial):
        assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert est.trajectory_._store.owned


def test_other_consumers_over_steps_read_the_disk_path(data):
    # explain, kneighbors under the path kernel, a Display along the path and the Hessian
    # trace along the path read points through the same accessors: same numbers.
    import matplotlib

    matplotlib.use("Agg")
    from skpathkernel.diagnostics import hessian_trace_path
    from skpathkernel.plotting import KernelEvolutionDisplay

    X, y = data
    mem, disk = _fit(X, y, solver="adam"), _fit(X, y, "disk", solver="adam")
    for a, b in zip(mem.explain(X[:3], n_neighbors=4), disk.explain(X[:3], n_neighbors=4)):
        assert_allclose(b, a, rtol=1e-12, atol=1e-15)
    for a, b in zip(mem.kneighbors(X[:3], 5, kernel="path"),
                    disk.kneighbors(X[:3], 5, kernel="path")):
        assert_allclose(b, a, rtol=1e-12, atol=1e-15)
    a = KernelEvolutionDisplay.from_estimator(mem, X[0], X[1:4]).kernel_values
    b = KernelEvolutionDisplay.from_estimator(disk, X[0], X[1:4]).kernel_values
    assert_allclose(b, a, rtol=1e-12, atol=1e-15)
    a = hessian_trace_path(mem, X, y, steps=[0, 5, -1], n_samples=4, random_state=0)
    b = hessian_trace_path(disk, X, y, steps=[0, 5, -1], n_samples=4, random_state=0)
    assert_allclose(b.trace, a.trace, rtol=1e-12)


def test_detector_scores_on_workers_read_the_disk_path_by_reference(data):
    from skpathkernel import OODRankDetector

    X, y = data
    det = OODRankDetector(PathKernelMachine(**NET, trajectory_storage="disk")).fit(X, y)
    Y = X[:6] + 0.3
    serial = det.score_samples(Y)
    det.set_params(n_jobs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with joblib.parallel_config(backend="loky"):
            blocks = det.score_samples(Y)
    # Row blocks change sums' order; scores near 0 show it (as in test_parallel.py).
    assert_allclose(blocks, serial, rtol=0, atol=1e-10)
    assert det.trajectory_._store.owned


@pytest.mark.parametrize("storage", ["memory", "disk", "auto"])
def test_a_module_with_one_parameter_tensor(storage, monkeypatch):
    # One parameter tensor (no bias), shaped (1, 4): recorded flat like any module.
    monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *a: 2)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1, bias=False).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    X = torch.randn(6, 4, dtype=torch.float64)
    thetas = [net.weight.detach().reshape(-1).clone()]
    with PathRecorder(net, opt, storage=storage, memory_budget=2**20) as rec:
        for _ in range(5):
            opt.zero_grad()
            net(X).pow(2).mean().backward()
            opt.step()
            thetas.append(net.weight.detach().reshape(-1).clone())
    traj = rec.trajectory
    for k, theta in enumerate(thetas):
        assert torch.equal(traj.parameters(k), theta)


def test_chunks_written_in_the_background_are_read_back_whole(monkeypatch, tmp_path):
    # A slow disk: each chunk's write is still going when the next vectors are recorded
    # and when a reader asks for it. Reference: the vectors handed to the series.
    real = _storage._write_chunk
    started = []

    def slow(path, array):
        started.append(path)
        time.sleep(0.2)
        real(path, array)

    monkeypatch.setattr(_storage, "_write_chunk", slow)
    store = _storage.ChunkStore.create(tmp_path, chunk_rows=2)
    series = store.add_series("params", 5, torch.float64)
    vectors = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for k in range(3):
        series.slot(k).copy_(vectors[k])
        series.commit(k, step=k)
        if k == 2:  # chunk 0 is being written, not yet on disk: reading waits for it
            deadline = time.monotonic() + 5  # the writer thread may not have run yet
            while not started and time.monotonic() < deadline:
                time.sleep(0.001)
            assert started and not os.path.exists(series.path(0))
            assert_array_equal(series.row(0), vectors[0])
    for k in range(3, 5):  # chunk 1 fills a second buffer while chunk 0's is written
        series.slot(k).copy_(vectors[k])
        series.commit(k, step=k)
    store.flush()
    for k in range(5):
        assert_array_equal(series.row(k), vectors[k])
    assert_array_equal(np.load(series.path(0)), vectors[:2].numpy())
    assert_array_equal(np.load(series.path(1)), vectors[2:4].numpy())
    assert_array_equal(np.load(series.path(2)), vectors[4:].numpy())


def _direct_io_works(directory) -> bool:
    if not _storage._O_DIRECT:
        return False
    try:
        os.close(os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT
                         | _storage._O_DIRECT))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("direct", [True, False])
def test_chunks_written_past_the_page_cache_read_back_bit_for_bit(
        data, monkeypatch, tmp_path, direct):
    # Every chunk through the O_DIRECT writer (page-aligned buffers, a 4096-byte header,
    # the last partial sector written normally), or every one through np.save: the same
    # vectors as the in-memory recording, and np.load reads the files.
    X, y = data
    monkeypatch.setattr(_storage, "_DIRECT_MIN_BYTES", 0)
    if not direct:
        monkeypatch.setattr(_storage, "_O_DIRECT", 0)
    mem = _fit(X, y, solver="adam")
    disk = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path)
    _assert_same_path(mem.trajectory_, disk.trajectory_)
    directory = disk.trajectory_.directory
    files = [os.path.join(directory, series, name) for series in ("params", "exp_avg_sq")
             for name in _chunk_files(disk.trajectory_, series)]
    header = 4096 if direct and _direct_io_works(tmp_path) else 128
    for path in files:
        array = np.load(path, allow_pickle=False)
        assert os.path.getsize(path) == header + array.nbytes
    traj = mem.trajectory_
    assert_array_equal(np.load(files[0], allow_pickle=False),
                       torch.stack([traj.parameters(k) for k in range(CHUNK)]))
    n = len(traj) - 1  # the moments' vectors; the last file holds those from `last` on
    last = (n - 1) // CHUNK * CHUNK
    assert_array_equal(np.load(files[-1], allow_pickle=False),
                       torch.stack([traj.optimizer_state(k)["exp_avg_sq"]
                                    for k in range(last, n)]))


def test_a_full_disk_in_the_direct_writer_keeps_the_chunk(data, monkeypatch, tmp_path):
    # The disk fills during a real (O_DIRECT or not) chunk write: no partial file is left,
    # the chunk stays in memory, and the path is the in-memory one.
    X, y = data
    monkeypatch.setattr(_storage, "_DIRECT_MIN_BYTES", 0)
    mem = _fit(X, y, solver="adam")
    real_open = os.open
    calls = []

    def refusing_open(path, flags, *args):
        if str(path).endswith(".tmp"):
            calls.append(path)
            if len(calls) > 3:
                raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(_storage.os, "open", refusing_open)
    with pytest.warns(UserWarning, match="No space left"):
        disk = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path)
    monkeypatch.setattr(_storage.os, "open", real_open)
    assert not [p for p in os.listdir(disk.trajectory_.directory + "/params")
                if p.endswith(".tmp")]
    _assert_same_path(mem.trajectory_, disk.trajectory_)


def test_read_ahead_gives_the_same_results_and_the_same_errors(data, monkeypatch):
    # The sweeps read the next chunk (the previous one for the decomposition's backward
    # adjoint) on a reader thread; with or without that, the kernels and decompositions
    # equal the in-memory ones, and a missing or truncated chunk raises the same error.
    X, y = data
    mem = _fit(X, y, solver="adam")
    K_mem, d_mem = PathKernel(mem)(X, X[:5]), mem.decompose(X[:3])
    real = _storage._read_chunk
    readers = []

    def spy(path):
        readers.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(_storage, "_read_chunk", spy)
    errors = {}
    for prefetch in (True, False):
        monkeypatch.setattr(_storage, "PREFETCH", prefetch)
        disk = _fit(X, y, "disk", solver="adam")
        readers.clear()
        assert_allclose(PathKernel(disk)(X, X[:5]), K_mem, rtol=1e-13, atol=1e-15)
        d_disk = disk.decompose(X[:3])
        assert_allclose(d_disk.contributions, d_mem.contributions, rtol=1e-12, atol=1e-15)
        read_ahead = sum("chunk-reader" in name for name in readers)
        assert (read_ahead >= len(_chunk_files(disk.trajectory_)) - 2) if prefetch \
            else read_ahead == 0
        series = disk.trajectory_._params.series
        assert len(series._cache) + (series._ahead is not None) <= 3
        os.rename(series.path(2), series.path(2) + ".away")
        for s in disk.trajectory_._store.series.values():
            s.forget()
        with pytest.raises(TrajectoryFileError, match=r"000002\.npy.*missing") as missing:
            PathKernel(disk)(X)
        os.rename(series.path(2) + ".away", series.path(2))
        path = series.path(3)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        for s in disk.trajectory_._store.series.values():
            s.forget()
        with pytest.raises(TrajectoryFileError, match=r"000003\.npy.*truncated") as cut:
            disk.decompose(X[:3])
        errors[prefetch] = (str(missing.value).replace(disk.trajectory_.directory, ""),
                            str(cut.value).replace(disk.trajectory_.directory, ""))
    assert errors[True] == errors[False]


TAIL = {**STOPPED, "learning_rate_init": 0.01, "record_every": 2}  # ends between points


def test_skops_round_trip_of_an_on_disk_estimator(data, monkeypatch):
    # skops persists what pickle does (a reference to the directory, a last point held in
    # memory, chunks a full disk kept in memory), trusting only skpathkernel's types; the
    # loaded estimator's kernel is the in-memory fit's.
    sio = pytest.importorskip("skops.io")
    X, y = data
    real = _storage._write_chunk

    def fill_up(path, array):
        if path.endswith("000002.npy"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, array)

    monkeypatch.setattr(_storage, "_write_chunk", fill_up)
    with pytest.warns(UserWarning, match="No space left"):
        est = _fit(X, y, "disk", **TAIL)
    monkeypatch.setattr(_storage, "_write_chunk", real)
    mem = _fit(X, y, **TAIL)
    traj = est.trajectory_
    assert traj._params.tail is not None and traj._params.series._memory
    with pytest.warns(UserWarning, match="Pickling references the on-disk trajectory"):
        blob = sio.dumps(est)
    untrusted = sio.get_untrusted_types(data=blob)
    assert all(t.startswith("skpathkernel.") for t in untrusted), untrusted
    back = sio.loads(blob, trusted=untrusted)
    assert back.trajectory_.directory == traj.directory
    _assert_same_path(mem.trajectory_, back.trajectory_)
    assert_allclose(PathKernel(back)(X), PathKernel(mem)(X), rtol=1e-13, atol=1e-15)
    shutil.rmtree(traj.directory)


def _record_and_read_in_child(X, y, queue):
    # The collections this child runs (its own below, and any a fit triggers) must not
    # reach the garbage it inherited from the pytest-xdist worker: a finalizer there that
    # writes to a descriptor shared with the parent (execnet's channel) can make the
    # parent worker look crashed ("node down: Not properly terminated", seen once in CI).
    gc.freeze()
    est = _fit(X, y, "disk", solver="adam")  # the writer thread, in this process
    queue.put(PathKernel(est)(X[:4]))  # the reader thread
    del est  # a child process exits without running finalizers: delete its directory
    gc.collect()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_its_own_background_threads(data):
    # The parent's writer and reader threads do not exist in a forked child (a joblib or
    # multiprocessing "fork" worker): it starts its own instead of queueing work forever.
    import multiprocessing

    X, y = data
    est = _fit(X, y, "disk", solver="adam")
    K = PathKernel(est)(X[:4])  # both threads now run in this process
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_record_and_read_in_child, args=(X, y, queue))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    assert_allclose(queue.get(timeout=5), K, rtol=1e-13, atol=1e-15)


def test_a_file_system_refusing_direct_writes_gets_ordinary_ones(monkeypatch, tmp_path):
    # O_DIRECT accepted at open but refused at write (an alignment the file system does
    # not take): the chunk is written the ordinary way, complete, nothing left behind.
    monkeypatch.setattr(_storage, "_DIRECT_MIN_BYTES", 0)

    def refuse(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(_storage.os, "pwrite", refuse)
    buffer = _storage.aligned_empty(3, 5000, torch.float64)
    buffer.copy_(torch.randn(3, 5000, dtype=torch.float64))
    path = str(tmp_path / "000000.npy")
    _storage._write_chunk(path, buffer.numpy())
    assert_array_equal(np.load(path, allow_pickle=False), buffer.numpy())
    assert os.listdir(tmp_path) == ["000000.npy"]


def _in_child(check) -> int:
    """Fork; the child runs ``check()`` (True: exit 0) and is killed if it hangs 20 s."""
    import signal

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:  # never return into pytest from the child
        code = 3
        try:
            signal.alarm(20)
            code = 0 if check() else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_dropping_its_copy_keeps_the_parents_directory(data):
    # A forked child holds a copy of the estimator, temporary trajectory included: when
    # that copy is collected there, the directory (the parent's) must stay.
    X, y = data
    est = _fit(X, y, "disk")
    K = PathKernel(_fit(X, y))(X[:4])  # reference: the in-memory fit
    directory = est.trajectory_.directory

    def drop():
        nonlocal est
        est = None
        gc.collect()
        return True

    assert _in_child(drop) == 0
    assert os.path.isdir(directory)
    assert_allclose(PathKernel(est)(X[:4]), K, rtol=1e-13, atol=1e-15)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_reads_a_chunk_the_parent_was_reading_ahead(data):
    # The parent's reader thread is busy when the process forks with a chunk queued to be
    # read ahead: that read never happens in the child, which reads the chunk itself
    # (reference: the file, read with plain numpy) instead of waiting forever.
    X, y = data
    est = _fit(X, y, "disk")
    series = est.trajectory_._params.series
    gate = threading.Event()
    _storage._on("reader", gate.wait)
    try:
        series.chunk(0)
        series.chunk(1)  # a forward sweep: chunk 2 is queued
        assert series._ahead[0] == 2 and not series._ahead[1].done()
        code = _in_child(lambda: np.array_equal(series.chunk(2).numpy(),
                                                np.load(series.path(2))))
    finally:
        gate.set()
    assert code == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_reads_a_chunk_the_parent_was_writing(monkeypatch, tmp_path):
    # The same with a chunk the parent's writer thread has not written yet, and with the
    # threads' lock held at the fork (another thread was starting a thread).
    store = _storage.ChunkStore.create(tmp_path, chunk_rows=2)
    series = store.add_series("params", 5, torch.float64)
    vectors = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gate = threading.Event()
    try:
        for k in range(3):
            series.slot(k).copy_(vectors[k])
            if k == 1:
                _storage._on("writer", gate.wait)
            series.commit(k, step=k)
        assert not series._writing[0].done()

        def read():
            with_lock = _storage._on("writer", lambda: 1).result() == 1
            return with_lock and all(torch.equal(series.row(k), vectors[k]) for k in range(3))

        with _storage._threads_lock:
            code = _in_child(read)
    finally:
        gate.set()
    assert code == 0
    store.flush()
    assert_array_equal(np.load(series.path(0)), vectors[:2].numpy())


def test_saving_while_a_chunk_is_read_ahead(data, monkeypatch, tmp_path):
    # save() renames the directory while the reader thread is about to read a chunk ahead;
    # were the read to run between the rename and the store learning its new place, it
    # would look in the old one. The chunk is read, not reported missing.
    X, y = data
    mem, disk = _fit(X, y), _fit(X, y, "disk")
    series = disk.trajectory_._params.series
    gate = threading.Event()
    _storage._on("reader", gate.wait)
    real = os.replace

    def rename_then_read(src, dst):
        real(src, dst)
        if src == disk.trajectory_.directory:
            gate.set()
            reading.exception()  # the read ahead, done now

    try:
        series.chunk(0)
        series.chunk(1)  # chunk 2 is queued to be read ahead
        reading = series._ahead[1]
        monkeypatch.setattr(_storage.os, "replace", rename_then_read)
        threading.Timer(0.2, gate.set).start()  # the reader is busy a while longer
        disk.trajectory_.save(tmp_path / "saved")
    finally:
        gate.set()
    monkeypatch.setattr(_storage.os, "replace", real)
    _assert_same_path(mem.trajectory_, disk.trajectory_)


def test_recording_releases_its_buffers(data):
    # After the fit only the chunks read are in memory: no write buffer, and no buffer of
    # rounded differences (compressed storage), is kept for the estimator's lifetime.
    X, y = data
    est = _fit(X, y, "disk", solver="adam", trajectory_compression="bfloat16")
    for series in est.trajectory_._store.series.values():
        assert series._buffer is None and series._spare is None and series._deltas is None


def test_a_step_float16_cannot_hold_is_refused(data):
    # float16 differences overflow past 65504: the stored path would turn to inf, then nan,
    # from a finite recorded one (the loop's parameters stay finite). The path is refused,
    # naming the vector, the step and a dtype that holds it; a run that diverges is still
    # reported as diverging.
    net = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    rec = PathRecorder(net, opt, n_samples=4, storage="disk", compression="float16")
    for step in range(4):
        net.weight.grad = torch.full_like(net.weight, -1e5 if step == 1 else 0.1)
        net.bias.grad = torch.zeros_like(net.bias)
        rec.set_batch(torch.arange(4))
        opt.step()
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    assert bool(torch.isfinite(theta).all()) and float(theta.abs().max()) > 65504
    with pytest.raises(ValueError, match=r"vector 2 .*optimizer step 2\).*1e\+05.*float16"
                                         r".*bfloat16"):
        _ = rec.trajectory
    rec.close()
    X, y = data
    with pytest.raises(TrainingDivergedError):
        _fit(X, 1e4 * y, "disk", solver="sgd", learning_rate_init=30.0,
             trajectory_compression="float16")


def _python(tmp_path, source: str, argument):
    """Run ``source`` in a fresh interpreter (killed, and the test failed, after 90 s)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([sys.executable, str(script), str(argument)], env=env,
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the script hung")


_AT_EXIT = """
import atexit, os, sys
import numpy as np
from skpathkernel import PathKernelMachine, Trajectory
from skpathkernel._path import _trajectory
from skpathkernel.kernels import PathKernel
_trajectory.chunk_rows_for = lambda *args: 3
rng = np.random.RandomState(0)
X = rng.uniform(-1, 1, size=(16, 2))
y = np.sin(2 * X[:, 0]) - X[:, 1]
kw = dict(hidden_layer_sizes=(7,), max_iter=4, batch_size=5, dtype="float64", tol=None,
          random_state=0)
mem = PathKernelMachine(**kw).fit(X, y)
disk = PathKernelMachine(**kw, trajectory_storage="disk").fit(X, y)

def at_exit():  # the background threads are shut down by now
    np.testing.assert_allclose(PathKernel(disk)(X), PathKernel(mem)(X), rtol=1e-13)
    disk.trajectory_.save(sys.argv[1])
    print("saved", len(Trajectory.load(sys.argv[1])) == len(mem.trajectory_))

atexit.register(at_exit)
"""


def test_an_on_disk_trajectory_is_read_and_saved_at_interpreter_exit(tmp_path):
    # An atexit handler runs after the interpreter has stopped the background threads: a
    # sweep's read ahead and save() still work there (in the calling thread).
    done = _python(tmp_path, _AT_EXIT, tmp_path / "saved")
    assert done.returncode == 0 and "saved True" in done.stdout, done.stderr[-2000:]
    assert _chunk_files(Trajectory.load(tmp_path / "saved"))


_ON_THE_WRITER = """
import sys, threading
import numpy as np, torch
from skpathkernel._path import _storage
store = _storage.ChunkStore.create(sys.argv[1], chunk_rows=2)
series = store.add_series("params", 5, torch.float64)
gate = threading.Event()
_storage._on("writer", gate.wait)
# The garbage collector may run the store's finalizer on any thread, the writer's too,
# while a write of the store is queued behind it.
finalizing = _storage._on("writer", store._finalizer)
store._pending.append(_storage._submit_write(series.path(0), np.zeros((2, 5))))
gate.set()
finalizing.result(timeout=20)
_storage._on("writer", lambda: None).result(timeout=20)
print("removed" if not __import__("os").path.exists(store.directory) else "kept")
"""


def test_a_store_finalized_on_the_writer_thread_does_not_stop_it(tmp_path):
    # Waiting there for the store's queued writes would wait for the writer itself: every
    # later write, and the interpreter's exit, would hang. The directory goes after them.
    done = _python(tmp_path, _ON_THE_WRITER, tmp_path)
    assert done.returncode == 0 and "removed" in done.stdout, done.stderr[-2000:]


def test_mapping_pages_ahead_leaves_contents_and_stops_when_told():
    # The recorder maps a buffer's pages on a background thread while the training thread
    # copies points into it: the mapping must never change what was written, and a run
    # that ends must stop it even where it waits for the writes to move on.
    from skpathkernel._path._storage import aligned_empty, populate

    buf = aligned_empty(8, 300_000, torch.float32)  # fresh memory, 9.6 MB
    values = torch.randn(3, 300_000, generator=torch.Generator().manual_seed(0))
    buf[:3] = values
    done = populate([buf[3:], buf[:5]])  # overlapping, unaligned ends: page rounding
    assert done == (os.uname().sysname == "Linux")
    assert torch.equal(buf[:3], values)
    buf[3:] = 1.0  # the mapped rows take writes as before
    assert torch.equal(buf[3:], torch.ones(5, 300_000))

    stop, finished = threading.Event(), []
    thread = threading.Thread(target=lambda: finished.append(
        populate([aligned_empty(8, 300_000, torch.float32)], stop, ahead=lambda: 0)))
    thread.start()
    time.sleep(0.05)
    assert not finished  # waiting: no write has moved on, nothing may be mapped
    stop.set()
    thread.join(timeout=5)
    assert finished and not thread.is_alive()


def test_an_interrupted_fit_leaves_no_page_mapping_thread_running(monkeypatch):
    # Ctrl-C in a long fit drops its recorder while the thread mapping the recording
    # buffers' pages is at work: it was told to stop but not waited for, and a script
    # that ended right after the interrupted fit aborted in it about half the time
    # ("terminate called without an active exception", exit status 134; the user trial
    # of s49). Dropping the recorder now waits for its thread. The mapping is slowed
    # here so that the thread is inside a call when the fit is interrupted.
    from skpathkernel._path import _training

    # Small chunks: a buffer that outlasts the mapping's lead without 64 MiB of pages.
    monkeypatch.setattr(_storage, "CHUNK_BYTES", 2**16)
    monkeypatch.setattr(_trajectory, "CHUNK_BYTES", 2**16)
    madvise, mapping = _storage._MADVISE, threading.Event()
    if madvise is not None:  # None: the kernel cannot map ahead, and no thread starts

        def slow_madvise(*args):
            mapping.set()
            time.sleep(0.3)
            return madvise(*args)

        monkeypatch.setattr(_storage, "_MADVISE", slow_madvise)
    epoch_loss, epochs = _training._epoch_loss, []

    def interrupted(*args, **kwargs):
        epochs.append(1)
        if len(epochs) == 3:
            mapping.wait(10)
            raise KeyboardInterrupt
        return epoch_loss(*args, **kwargs)

    monkeypatch.setattr(_training, "_epoch_loss", interrupted)
    rng = np.random.RandomState(0)
    X, y = rng.randn(400, 20), rng.randn(400)
    before = set(threading.enumerate())
    try:
        PathKernelMachine(hidden_layer_sizes=(32,), max_iter=2000, tol=None, device="cpu",
                          random_state=0).fit(X, y)
    except KeyboardInterrupt:
        pass
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert "skpathkernel-pages" not in left


@pytest.mark.parametrize("array", [
    np.arange(12.0).reshape(3, 4), np.arange(6, dtype=np.float32), np.float64(2.5),
    np.zeros((0, 5)), np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.arange(24, dtype=">f8").reshape(2, 3, 4), np.arange(5, dtype=np.int64)])
def test_chunks_read_without_ast(array, tmp_path, monkeypatch):
    """Chunk files read back equal to np.load, without ast.literal_eval (whose AST
    constructor state races between threads on CPython 3.11: python/cpython#106905)."""
    import ast

    from skpathkernel._path import _storage

    path = str(tmp_path / "chunk.npy")
    np.save(path, array, allow_pickle=False)
    expected = np.load(path, allow_pickle=False)

    def refuse(*args, **kwargs):
        raise AssertionError("ast.literal_eval called")

    monkeypatch.setattr(ast, "literal_eval", refuse)
    got = _storage._read_chunk(path)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected)
    assert got.flags.f_contiguous == expected.flags.f_contiguous



@pytest.mark.parametrize("error", [RuntimeError("simulated bug in the writer"),
                                   OSError(errno.ENOSPC, "No space left on device")])
def test_rewind_raises_an_unexpected_error_of_the_write_in_flight(error, monkeypatch, tmp_path):
    """A path's series extended by two rows whose chunk write fails, then rewound to the
    path (as a failed extension does): a full disk is the expected failure (a warning,
    nothing lost); any other error of the write is raised, after the rewind. Either
    way the series reads the path's rows, as recorded, and goes on from them."""
    store = _storage.ChunkStore.create(tmp_path, chunk_rows=CHUNK)
    series = store.add_series("params", 5, torch.float64)
    rows = torch.randn(7, 5, dtype=torch.float64)

    def record(ks):
        for k in ks:
            series.slot(k).copy_(rows[k])
            series.commit(k, step=k)

    record(range(4))  # chunk 0 whole, chunk 1 one row
    store.flush()
    series.rewind(4, append=True)

    def fail(path, array):
        raise error

    real = _storage._write_chunk
    monkeypatch.setattr(_storage, "_write_chunk", fail)
    record([4, 5])  # chunk 1 full: its write is in flight
    if isinstance(error, OSError):
        with pytest.warns(UserWarning, match="No space left.*nothing recorded is lost"):
            series.rewind(4, append=False)
    else:
        with pytest.raises(RuntimeError, match="simulated bug in the writer"):
            series.rewind(4, append=False)
    monkeypatch.setattr(_storage, "_write_chunk", real)
    assert series.n_rows == 4
    for k in range(4):
        assert torch.equal(series.row(k), rows[k]), k
    series.rewind(4, append=True)
    record([4, 5, 6])
    store.flush()
    for k in range(7):
        assert torch.equal(series.row(k), rows[k]), k


_MMAP_LOAD = """
import sys, warnings
import joblib, numpy as np
warnings.simplefilter("error")  # torch warns (once a process) on a read-only array
est = joblib.load(sys.argv[1], mmap_mode="r")
X = np.load(sys.argv[1] + ".X.npy")
np.savez(sys.argv[1] + ".out.npz", decompose=est.decompose(X[:3]).contributions,
         unrolled=est.attribute(X[:3], method="unrolled"), self=est.self_influence())
"""


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_an_estimator_loaded_with_mmap_mode_explains_without_warnings(data, storage,
                                                                      tmp_path):
    # joblib.load(..., mmap_mode="r") hands back read-only arrays: the batches went to
    # torch as they were, and decompose, attribute and self_influence warned that torch
    # "does not support non-writable tensors". In a fresh process: torch warns once.
    X, y = data
    est = _fit(X, y, storage, solver="adam", trajectory_dir=tmp_path)
    dump = str(tmp_path / "est.joblib")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the disk path's "Pickling references ..."
        joblib.dump(est, dump)
    np.save(dump + ".X.npy", X)
    out = _python(tmp_path, _MMAP_LOAD, dump)
    assert out.returncode == 0, out.stderr
    got = np.load(dump + ".out.npz")
    assert_array_equal(got["decompose"], est.decompose(X[:3]).contributions)
    assert_array_equal(got["unrolled"], est.attribute(X[:3], method="unrolled"))
    assert_array_equal(got["self"], est.self_influence())


@pytest.mark.parametrize("given", [False, True])
def test_a_save_to_another_file_system_cut_short_leaves_nothing_there(data, tmp_path,
                                                                     monkeypatch, given):
    # On another file system the save copies: a copy cut short (a full disk there) was
    # left at the target by shutil.move, and the next save there was refused as "not an
    # empty directory". Another file system made by hand: the directory's rename fails
    # with EXDEV, and the copy runs out of space at its second file.
    X, y = data
    est = _fit(X, y, "disk")
    source = est.trajectory_.directory
    target = tmp_path / "saved"
    if given:
        target.mkdir()
        os.chmod(target, 0o750)
    replace, rename, copyfile = os.replace, os.rename, shutil.copyfile

    def across(rename):
        def move(src, dst, *args, **kwargs):
            if os.path.isdir(src):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)
            return rename(src, dst, *args, **kwargs)
        return move

    copied = []

    def full(src, dst, *args, **kwargs):
        if copied:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        copied.append(src)
        return copyfile(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", across(replace))
    monkeypatch.setattr(os, "rename", across(rename))  # shutil.move's
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError):
        est.trajectory_.save(target)
    assert copied  # the copy began
    assert sorted(p.name for p in tmp_path.iterdir()) == (["saved"] if given else [])
    if given:
        assert list(target.iterdir()) == [] and os.stat(target).st_mode & 0o777 == 0o750
    assert est.trajectory_.directory == source
    _assert_same_path(est.trajectory_, _fit(X, y).trajectory_)
    # Room again: the same save copies the whole path there and removes the original.
    monkeypatch.setattr(shutil, "copyfile", copyfile)
    est.trajectory_.save(target)
    assert not os.path.exists(source) and est.trajectory_.directory == os.fspath(target)
    _assert_same_path(est.trajectory_, Trajectory.load(target))


_SAVER = """
import os
import sys
from skpathkernel import Trajectory
os.fsync = lambda fd: None  # this test is about names; fsync (milliseconds) has its own
source, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
trajectory = Trajectory.load(source)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(n):
    trajectory.save(target)
"""


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_concurrent_saves_to_one_place_never_show_a_partial_file(data, tmp_path, storage):
    # Two processes save to one place again and again (in memory: one file, two paths;
    # on disk: the directory's description, rewritten by each) while this one loads it:
    # every load is one of the paths saved, whole, and no save fails. A fixed name
    # aside (trajectory.pt.tmp) made them write one file: one process renamed the
    # other's half-written file into place, and the other's rename then failed.
    X, y = data
    paths = [_fit(X, y, storage, random_state=seed).trajectory_ for seed in (0, 1)]
    if storage == "memory":
        sources = [tmp_path / "a.pt", tmp_path / "b.pt"]
        target = tmp_path / "shared.pt"
    else:
        sources = [tmp_path / "shared", tmp_path / "shared"]
        target = tmp_path / "shared"
        paths = paths[:1]
    for path, source in zip(paths, sources):
        path.save(source)
    savers = [subprocess.Popen([sys.executable, "-c", _SAVER, str(source), str(target),
                                "300"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_child_env())
              for source in sources]
    for saver in savers:
        assert saver.stdout.readline() == "ready\n", saver.stderr.read()
    for saver in savers:
        saver.stdin.write("go\n")
        saver.stdin.flush()
    loads = 0
    while any(saver.poll() is None for saver in savers) or not loads:
        if storage == "memory" and not os.path.exists(target):
            continue  # before the first rename
        got = Trajectory.load(target)
        # One of the paths saved: its last point (the first one compared whole below).
        assert any(torch.equal(got.parameters(-1), path.parameters(-1))
                   for path in paths)
        if not loads:
            _assert_same_path(got, next(path for path in paths if torch.equal(
                got.parameters(-1), path.parameters(-1))))
        loads += 1
    for saver in savers:
        _, err = saver.communicate()
        assert saver.returncode == 0, err
    assert loads > 1
    assert not [name for _, _, files in os.walk(tmp_path) for name in files
                if name.endswith(".tmp")]


def _child_env():
    # This checkout's skpathkernel in the savers, as in this process.
    root = os.path.dirname(os.path.dirname(os.path.abspath(_storage.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_a_description_that_fails_to_write_leaves_the_old_one_and_no_file_aside(
        data, tmp_path, monkeypatch):
    X, y = data
    traj = _fit(X, y, "disk").trajectory_
    traj.save(tmp_path / "path")
    before = (tmp_path / "path" / "trajectory.pt").read_bytes()

    real_save = torch.save

    def failing_save(payload, f):  # the disk full once the file aside is written
        real_save(payload, f)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_storage.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        traj.save(tmp_path / "path")
    monkeypatch.undo()
    assert (tmp_path / "path" / "trajectory.pt").read_bytes() == before
    assert not [name for _, _, files in os.walk(tmp_path) for name in files
                if name.endswith(".tmp")]
    _assert_same_path(Trajectory.load(tmp_path / "path"), traj)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_save_is_durable_before_its_description_is_in_place(data, tmp_path, monkeypatch,
                                                               storage):
    # The files a saved description names are fsynced before it is renamed into place,
    # the description itself too, and the folders holding the new names after: a power
    # failure cannot leave a description (or a chunk file) renamed but empty.
    X, y = data
    est = _fit(X, y, storage, solver="adam", trajectory_dir=tmp_path / "tmp")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):  # which file: its inode, which a rename keeps
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst)

    def inode(path):
        st = os.stat(path)
        return st.st_dev, st.st_ino

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = str(tmp_path / ("saved.pt" if storage == "memory" else "saved"))
    est.trajectory_.save(target)
    monkeypatch.undo()
    described = target if storage == "memory" else os.path.join(target, "trajectory.pt")
    last = max(i for i, e in enumerate(events) if e == ("replace", described))
    before = {file for kind, file in events[:last] if kind == "fsync"}
    after = {file for kind, file in events[last:] if kind == "fsync"}
    # The description in place is the file synced before its rename...
    assert inode(described) in before
    if os.name == "posix":  # ...and its folder after it (elsewhere folders are not opened)
        assert inode(os.path.dirname(described)) in after
    if storage == "disk":
        files = [os.path.join(folder, name) for folder, _, names in os.walk(target)
                 for name in names if name.endswith(".npy")]
        assert files and {inode(f) for f in files} <= before  # every chunk file
        if os.name == "posix":
            # The chunk files' folders, and the saved directory's new name in its parent.
            folders = {os.path.dirname(f) for f in files} | {str(tmp_path)}
            assert {inode(f) for f in folders} <= before | after
        # A temporary directory is not synced: a fit's own description costs no fsync.
        events.clear()
        monkeypatch.setattr(os, "fsync", fsync)
        _fit(X, y, storage, solver="adam", trajectory_dir=tmp_path / "tmp")
        monkeypatch.undo()
        assert not events


def test_a_kept_directory_is_synced_where_fsync_needs_a_writable_handle(data, tmp_path,
                                                                        monkeypatch):
    # Windows's os.fsync (_commit, FlushFileBuffers) fails with EBADF on a handle opened
    # read-only: the chunk files, synced before their description, were opened so, and
    # every save of an on-disk path failed there. Emulated here: os.name "nt" and an
    # fsync that refuses a read-only descriptor as _commit does.
    X, y = data
    est = _fit(X, y, "disk", solver="adam", trajectory_dir=tmp_path / "tmp")
    real_fsync, synced = os.fsync, []

    def commit(fd):
        if os.name != "nt":  # the real one, where the emulation is off
            return real_fsync(fd)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        synced.append(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", commit)
    monkeypatch.setattr(os, "name", "nt")
    try:
        est.trajectory_.save(tmp_path / "saved")
    finally:  # before pytest reports a failure, which reads os.name
        monkeypatch.undo()
    # The chunk files and the description, each once.
    files = [name for _, _, names in os.walk(tmp_path / "saved") for name in names]
    assert len(synced) == len(files)
    _assert_same_path(Trajectory.load(tmp_path / "saved"), est.trajectory_)
