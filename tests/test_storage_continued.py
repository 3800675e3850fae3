"""partial_fit and warm_start with the trajectory on disk: one path, appended in place.

The reference for every number is the same calls with the path in memory (recording is
deterministic: the points must be bit-identical, and the analyses equal), and for the
decomposition the forward per-sample recursion of tests/_reference.py. Faults are
simulated where they happen: an exception in the chunk writer, a process killed in the
middle of a call (a child process that exits at that point), a directory or file removed
between calls, a copy of the estimator that extended the shared directory.
"""

import copy
import gc
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from _reference import forward_recursion, gauss_nodes, sklearn_step_sizes, unrolled_reference
from numpy.testing import assert_allclose, assert_array_equal

import skpathkernel
from skpathkernel import PathKernelClassifier, PathKernelMachine, Trajectory
from skpathkernel._estimators import _base
from skpathkernel._estimators._base import _on_disk
from skpathkernel._path import _storage, _trajectory
from skpathkernel._path._storage import TrajectoryFileError

CHUNK = 3  # vectors per chunk file: every call appends to a partly filled chunk


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *args: CHUNK)


NET = dict(hidden_layer_sizes=(5,), activation="tanh", batch_size=5, dtype="float64",
           tol=None, random_state=0, normalize_y=False)
SOLVERS = {
    "adam": dict(solver="adam", learning_rate_init=0.01, alpha=1e-3),
    "nesterov": dict(solver="sgd", learning_rate_init=0.05, momentum=0.5,
                     learning_rate="invscaling"),
    "rmsprop": dict(solver="rmsprop", learning_rate_init=0.01),
}


def _data(n=24, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, 2))
    return X, np.sin(2 * X[:, 0]) - X[:, 1]


CALLS = [np.arange(0, 7), np.arange(7, 15), np.arange(15, 24)]  # 2, 2 and 2 steps


def _stream(storage, calls=CALLS, X=None, y=None, est=None, **kw):
    if X is None:
        X, y = _data()
    est = est or PathKernelMachine(**{**NET, **kw}, trajectory_storage=storage)
    for rows in calls:
        est.partial_fit(X[rows], y[rows])
    return est


def _assert_same_path(a: Trajectory, b: Trajectory):
    assert len(a) == len(b) and a.n_steps == b.n_steps and a.n_samples == b.n_samples
    assert_array_equal(a.steps, b.steps)
    assert_array_equal(a.learning_rates, b.learning_rates)
    assert_array_equal(a._batch_indices, b._batch_indices)
    assert_array_equal(a._batch_offsets, b._batch_offsets)
    assert_array_equal(a._state_steps, b._state_steps)
    for k in range(len(a)):
        assert torch.equal(a.parameters(k), b.parameters(k)), k
    for k in range(len(a) - 1):
        for key in a.state_keys:
            assert torch.equal(a.optimizer_state(k)[key], b.optimizer_state(k)[key]), k


def _assert_same_analyses(disk, mem, Xq):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a thinned path's decomposition says it is not exact
        d_disk, d_mem = disk.decompose(Xq), mem.decompose(Xq)
        a_disk, a_mem = disk.attribute(Xq), mem.attribute(Xq)
    assert_allclose(d_disk.contributions, d_mem.contributions, rtol=0, atol=1e-14)
    assert abs(d_disk.error - d_mem.error) <= 1e-14
    if disk.trajectory_.record_every == 1:
        assert d_disk.error < 1e-10
    assert_allclose(a_disk, a_mem, rtol=0, atol=1e-14)
    assert_allclose(disk.path_kernel_(Xq, Xq[:2]), mem.path_kernel_(Xq, Xq[:2]), rtol=1e-13,
                    atol=1e-15)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_partial_fit_on_disk_equals_the_same_calls_in_memory(solver):
    X, y = _data()
    mem = _stream("memory", **SOLVERS[solver])
    disk = _stream("disk", **SOLVERS[solver])
    traj = disk.trajectory_
    assert traj.storage == "disk" and mem.trajectory_.storage == "memory"
    _assert_same_path(mem.trajectory_, traj)
    # The training set is what the calls received, kept in files beside the path.
    assert _on_disk(disk.X_fit_) and _on_disk(disk._Y_fit)
    assert_array_equal(disk.X_fit_, mem.X_fit_)
    assert_array_equal(disk._Y_fit, mem._Y_fit)
    assert disk.X_fit_.dtype == mem.X_fit_.dtype == X.dtype
    _assert_same_analyses(disk, mem, X[:3] + 0.1)
    # The directory describes the whole path and holds its training set: loadable alone.
    _assert_same_path(mem.trajectory_, Trajectory.load(traj.directory))
    data = os.path.join(traj.directory, "data")
    assert_array_equal(np.load(os.path.join(data, "X.npy")), X)
    assert_array_equal(np.load(os.path.join(data, "y.npy")), mem._Y_fit)


def test_partial_fit_on_disk_is_exact_against_the_forward_recursion():
    X, y = _data()
    est = _stream("disk", **SOLVERS["adam"])
    Xq = X[:3] + 0.1
    res = est.decompose(Xq)
    Y = torch.as_tensor(np.array(est._Y_fit)).reshape(len(X), -1)
    contrib, reg = forward_recursion(est, X, Y, lambda out, t: 0.5 * ((out - t) ** 2).sum(),
                                     Xq, nodes=gauss_nodes(6))
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))


@pytest.mark.parametrize("kw", [dict(record_every=3), dict(trajectory_compression="float16")],
                         ids=["thinned", "compressed"])
def test_partial_fit_on_disk_thinned_or_compressed(kw):
    # Compressed: the appended points continue the stored (rounded) path.
    X, y = _data()
    disk = _stream("disk", **SOLVERS["adam"], **kw)
    if "record_every" in kw:
        mem = _stream("memory", **SOLVERS["adam"], **kw)
        _assert_same_path(mem.trajectory_, disk.trajectory_)
        return
    mem = _stream("disk", **SOLVERS["adam"])  # uncompressed reference
    a, b = mem.trajectory_, disk.trajectory_
    # Every stored point within one float16 rounding of its step from the trained one.
    for k in range(1, len(a)):
        step = (a.parameters(k) - a.parameters(k - 1)).abs().max()
        assert (a.parameters(k) - b.parameters(k)).abs().max() <= 2.0**-10 * step + 1e-12
    # The files hold what this process read: a fresh reader gets the same points.
    loaded = Trajectory.load(b.directory)
    for k in range(len(b)):
        assert torch.equal(loaded.parameters(k), b.parameters(k))


def test_classifier_partial_fit_on_disk():
    X, y = _data()
    labels = np.digitize(y, [-0.5, 0.5])
    kw = {k: v for k, v in NET.items() if k != "normalize_y"}
    ests = [PathKernelClassifier(**kw, trajectory_storage=s) for s in ("memory", "disk")]
    for est in ests:
        for i, rows in enumerate(CALLS):
            est.partial_fit(X[rows], labels[rows], classes=[0, 1, 2] if i == 0 else None)
    mem, disk = ests
    _assert_same_path(mem.trajectory_, disk.trajectory_)
    assert_array_equal(disk._Y_fit, mem._Y_fit)
    _assert_same_analyses(disk, mem, X[:3] + 0.1)


def test_warm_start_on_disk_is_one_path():
    X, y = _data()
    params = dict(NET, **SOLVERS["adam"])
    whole = PathKernelMachine(**params, max_iter=5).fit(X, y)
    est = PathKernelMachine(**params, max_iter=2, warm_start=True, trajectory_storage="disk")
    est.fit(X, y)
    directory = est.trajectory_.directory
    est.set_params(max_iter=3).fit(X, y)
    assert est.trajectory_.directory == directory
    _assert_same_path(whole.trajectory_, est.trajectory_)
    assert len(est.X_fit_) == len(X) and _on_disk(est.X_fit_)
    # On other data the training set grows on disk, as with partial_fit.
    X2, y2 = _data(10, seed=1)
    est.set_params(max_iter=1).fit(X2, y2)
    mem = PathKernelMachine(**params, max_iter=5, warm_start=True).fit(X, y)
    mem.set_params(max_iter=1).fit(X2, y2)
    _assert_same_path(mem.trajectory_, est.trajectory_)
    assert_array_equal(est.X_fit_, np.concatenate([X, X2]))
    _assert_same_analyses(est, mem, X[:3] + 0.1)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_warm_start_keeps_every_step_size_of_a_schedule(storage):
    """A warm start of an invscaling path thinned to every 3rd step: the first fit (one
    epoch, one step size) keeps none per step, the continuation changes it inside its
    intervals; the joined path holds sklearn's step size for every step, and its unrolled
    scores are the derivative of that training (autograd through a plain replay with
    sklearn's step sizes), without a replay warning."""
    X, y = _data()
    params = dict(NET, solver="sgd", momentum=0.9, learning_rate="invscaling",
                  learning_rate_init=0.05, power_t=0.5, record_every=3)
    est = PathKernelMachine(**params, max_iter=1, warm_start=True,
                            trajectory_storage=storage).fit(X, y)
    assert est.trajectory_._step_lrs is None
    est.set_params(max_iter=3).fit(X, y)
    traj = est.trajectory_
    lrs = sklearn_step_sizes(params, len(X), 5, traj.n_steps)
    assert traj.n_steps == 20 and len(set(lrs[8:11])) == 2  # steps 8-10: one interval
    assert_array_equal(traj.step_learning_rates, lrs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = est.attribute(X[:2], method="unrolled")
    assert scores.replay_error < 1e-13
    ref = unrolled_reference(est.network_, X[:2], np.ones((2, 1)), step_sizes=lrs)
    assert_allclose(scores, ref, rtol=0, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("record_every", [1, 2])
def test_warm_start_on_disk_after_early_stopping(record_every):
    # The first fit's path ends at its best epoch, before rows its series hold: the
    # warm start appends from that point, over the rows recorded past it. With
    # record_every=2 that epoch ends between recorded points: the path's last point is
    # held in memory, and written to the series as the warm start's first row.
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    y = np.sin(2 * X[:, 0]) - X[:, 1]
    params = dict(hidden_layer_sizes=(7,), batch_size=5, dtype="float64", random_state=0,
                  max_iter=30, early_stopping=True, n_iter_no_change=2, tol=0.0,
                  learning_rate_init=0.01, record_every=record_every, warm_start=True)
    ests = [PathKernelMachine(**params, trajectory_storage=s) for s in ("memory", "disk")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for est in ests:
            est.fit(X, y)
        rows = ests[1].trajectory_._params
        assert rows.series.n_rows > rows.n  # stopped before the last rows recorded
        assert (rows.tail is not None) == (record_every == 2)
        for est in ests:
            est.set_params(max_iter=3, early_stopping=False).fit(X, y)
    _assert_same_path(ests[0].trajectory_, ests[1].trajectory_)
    _assert_same_analyses(ests[1], ests[0], X[:3] + 0.1)


# ------------------------------------------------------------------ faults
def test_an_exception_in_the_writer_leaves_the_fit_and_the_directory(monkeypatch):
    X, y = _data()
    ref = _stream("memory", CALLS[:2], **SOLVERS["adam"])
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    directory = est.trajectory_.directory
    before = dict(est.__dict__)
    real, writes = _storage._write_chunk, []

    def crash(path, array):
        writes.append(path)
        if len(writes) == 2:
            raise RuntimeError("simulated crash in the writer")
        real(path, array)

    monkeypatch.setattr(_storage, "_write_chunk", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    monkeypatch.setattr(_storage, "_write_chunk", real)
    assert est.__dict__ == before
    # The directory describes the path of the first two calls, whole.
    _assert_same_path(ref.trajectory_, Trajectory.load(directory))
    _assert_same_path(ref.trajectory_, est.trajectory_)
    # And the estimator goes on from there as if nothing happened.
    est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    _assert_same_path(_stream("memory", **SOLVERS["adam"]).trajectory_, est.trajectory_)


@pytest.mark.parametrize("error", [RuntimeError("simulated error at the commit"),
                                   KeyboardInterrupt()])
def test_a_call_stopped_after_the_directory_described_it_keeps_the_fit(error, monkeypatch):
    # Past the training and the last write (the directory describes the longer path),
    # the fitted network is made: an error or an interrupt there left the kept fit's
    # series extended and the directory describing a path no estimator held, which
    # refused every later partial_fit ("described again since").
    X, y = _data()
    ref = _stream("memory", CALLS[:2], **SOLVERS["adam"])
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    directory = est.trajectory_.directory
    before = dict(est.__dict__)
    real = _base.TrainedNetwork

    def made(*args, **kwargs):
        assert Trajectory.load(directory).n_steps > ref.trajectory_.n_steps
        raise error

    monkeypatch.setattr(_base, "TrainedNetwork", made)
    with pytest.raises(type(error)):
        est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    monkeypatch.setattr(_base, "TrainedNetwork", real)
    assert est.__dict__ == before
    _assert_same_path(ref.trajectory_, est.trajectory_)
    _assert_same_path(ref.trajectory_, Trajectory.load(directory))
    est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    _assert_same_path(_stream("memory", **SOLVERS["adam"]).trajectory_, est.trajectory_)


def test_a_failed_rewind_does_not_hide_the_fit_error_nor_stop_the_others(monkeypatch):
    # The writer fails during the fit, and rewinding the first series fails too: every
    # series is still rewound, and the fit's own error is the one raised.
    X, y = _data()
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    before = dict(est.__dict__)
    real_write, writes = _storage._write_chunk, []
    real_rewind, rewound = _storage.Series.rewind, []

    def crash(path, array):
        writes.append(path)
        if len(writes) == 2:
            raise RuntimeError("simulated crash in the writer")
        real_write(path, array)

    def rewind(series, n_rows, *, append):
        real_rewind(series, n_rows, append=append)
        if not append:  # the rewinds of the failed fit's clean-up
            rewound.append(series)
            if len(rewound) == 1:
                raise ValueError("simulated error of the write in flight")

    monkeypatch.setattr(_storage, "_write_chunk", crash)
    monkeypatch.setattr(_storage.Series, "rewind", rewind)
    with pytest.warns(RuntimeWarning, match="simulated error of the write in flight"):
        with pytest.raises(RuntimeError, match="simulated crash"):
            est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    monkeypatch.setattr(_storage, "_write_chunk", real_write)
    monkeypatch.setattr(_storage.Series, "rewind", real_rewind)
    assert len(rewound) == 1 + len(est.trajectory_._states)
    assert est.__dict__ == before
    est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    _assert_same_path(_stream("memory", **SOLVERS["adam"]).trajectory_, est.trajectory_)


_CHILD = """
import os, sys
import numpy as np
from skpathkernel import PathKernelMachine
from skpathkernel._path import _storage, _trajectory
_trajectory.chunk_rows_for = lambda *args: 3
rng = np.random.RandomState(0)
X = rng.uniform(-1, 1, size=(24, 2)); y = np.sin(2 * X[:, 0]) - X[:, 1]
est = PathKernelMachine(**{net}, trajectory_storage="disk", trajectory_dir=sys.argv[1])
est.partial_fit(X[:7], y[:7]); est.partial_fit(X[7:15], y[7:15])
print(est.trajectory_.directory, flush=True)
if sys.argv[2] == "chunk":  # killed while the third call writes its second chunk file
    real, n = _storage._write_chunk, []
    def die(path, array):
        n.append(path)
        if len(n) == 2:
            os._exit(3)
        real(path, array)
    _storage._write_chunk = die
else:  # killed after the third call's rows were written, before the header is
    _storage._npy_header = lambda *args: os._exit(3)
est.partial_fit(X[15:], y[15:])
"""


@pytest.mark.parametrize("where", ["chunk", "data"])
def test_a_process_killed_mid_append_leaves_a_readable_path(where, tmp_path):
    code = _CHILD.format(net={**NET, **SOLVERS["adam"]})
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(skpathkernel.__file__)))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tmp_path), where],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 3, out.stderr
    directory = out.stdout.split()[-1]
    # The description is the last write of a call: the path of the first two calls,
    # which the files still hold whole, and their training rows.
    traj = Trajectory.load(directory)
    ref = _stream("memory", CALLS[:2], **SOLVERS["adam"])
    _assert_same_path(ref.trajectory_, traj)
    assert traj.n_steps == 4 and traj.n_samples == 15
    X, _ = _data()
    stored = np.load(os.path.join(directory, "data", "X.npy"))
    assert_array_equal(stored[: traj.n_samples], X[:15])


def test_another_n_features_is_refused_and_nothing_is_lost():
    X, y = _data()
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    before = dict(est.__dict__)
    with pytest.raises(ValueError, match="features"):
        est.partial_fit(np.hstack([X[CALLS[2]], X[CALLS[2]]]), y[CALLS[2]])
    assert est.__dict__ == before
    est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    _assert_same_path(_stream("memory", **SOLVERS["adam"]).trajectory_, est.trajectory_)


@pytest.mark.parametrize("victim, match", [("", "is gone"),
                                           ("data/X.npy", "training data file.*missing"),
                                           ("trajectory.pt", "description.*missing")])
def test_a_removed_directory_or_file_is_named_before_any_work(victim, match):
    X, y = _data()
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    path = os.path.join(est.trajectory_.directory, victim)
    before = dict(est.__dict__)
    if victim:
        os.remove(path)
    else:
        shutil.rmtree(path)
    with pytest.raises(TrajectoryFileError, match=match):
        est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    assert est.__dict__ == before


@pytest.fixture
def make_read_only(monkeypatch):
    """Make a directory read-only by its permissions; as root, who writes anyway, the
    store's check also sees it as a read-only mount would show it (``os.access``)."""

    def make(directory):
        directory = os.fspath(directory)
        for root, _, files in os.walk(directory):
            for name in files:
                os.chmod(os.path.join(root, name), 0o444)
            os.chmod(root, 0o555)
        if os.access(directory, os.W_OK):
            real, inside = os.access, os.path.abspath(directory)

            def access(path, mode, *args, **kwargs):
                path = os.path.abspath(path)
                if mode & os.W_OK and (path == inside or path.startswith(inside + os.sep)):
                    return False
                return real(path, mode, *args, **kwargs)

            monkeypatch.setattr(_storage.os, "access", access)
        assert not _storage.os.access(directory, os.W_OK)

    return make


def test_a_read_only_path_reads_and_is_refused_before_any_work(make_read_only, tmp_path):
    # A path kept where it cannot be written (a read-only share of saved models) is read
    # as it is, and refused at once when continued: not after training, with a warning
    # about a full disk, then the file system's error for one of the path's files.
    X, y = _data()
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    est.trajectory_.save(tmp_path / "saved")
    make_read_only(tmp_path / "saved")
    _assert_same_analyses(est, _stream("memory", CALLS[:2], **SOLVERS["adam"]), X[:3] + 0.1)
    before = dict(est.__dict__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about writes that failed
        with pytest.raises(TrajectoryFileError, match=r"saved'? is read-only.*Nothing was"):
            est.partial_fit(X[CALLS[2]], y[CALLS[2]])
    assert est.__dict__ == before


@pytest.mark.parametrize("change, match", [
    (dict(trajectory_storage="memory"), r"kept\s+on disk"),
    (dict(trajectory_compression="bfloat16"), "compression=None"),
])
def test_continuing_a_disk_path_elsewhere_is_refused(change, match):
    X, y = _data()
    est = _stream("disk", CALLS[:1], **SOLVERS["adam"]).set_params(**change)
    before = dict(est.__dict__)
    with pytest.raises(ValueError, match=match):
        est.partial_fit(X[CALLS[1]], y[CALLS[1]])
    assert est.__dict__ == before
    # "auto" follows the path where it is.
    est.set_params(trajectory_storage="auto", trajectory_compression=None)
    est.partial_fit(X[CALLS[1]], y[CALLS[1]])
    assert est.trajectory_.storage == "disk"


def test_an_estimator_saved_without_optimizer_state_is_not_continued():
    # Pickles of on-disk estimators from before partial_fit took disk paths hold none:
    # continuing would restart Adam's moments in the middle of the path.
    X, y = _data()
    est = _stream("disk", CALLS[:1], **SOLVERS["adam"])
    est._resume = None
    before = dict(est.__dict__)
    with pytest.raises(ValueError, match="no optimizer state"):
        est.partial_fit(X[CALLS[1]], y[CALLS[1]])
    assert est.__dict__ == before


@pytest.mark.parametrize("make_copy", ["pickle", "deepcopy", "copy"])
def test_a_copy_cannot_overwrite_what_another_appended(make_copy):
    X, y = _data()
    est = _stream("disk", CALLS[:1], **SOLVERS["adam"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickling keeps the temporary directory
        other = {"pickle": lambda e: pickle.loads(pickle.dumps(e)), "deepcopy": copy.deepcopy,
                 "copy": copy.copy}[make_copy](est)
    est.partial_fit(X[CALLS[1]], y[CALLS[1]])
    before = dict(other.__dict__)
    with pytest.raises(TrajectoryFileError, match="another copy"):
        other.partial_fit(X[CALLS[2]], y[CALLS[2]])
    assert other.__dict__ == before
    # The copy still reads its own, shorter path; the original went on unharmed.
    _assert_same_path(_stream("memory", CALLS[:1], **SOLVERS["adam"]).trajectory_,
                      other.trajectory_)
    assert len(other.X_fit_) == len(CALLS[0])
    _assert_same_path(_stream("memory", CALLS[:2], **SOLVERS["adam"]).trajectory_,
                      est.trajectory_)
    if make_copy != "copy":
        shutil.rmtree(est.trajectory_.directory)


# ------------------------------------------------------------------ persistence
@pytest.mark.parametrize("how", ["pickle", "skops"])
def test_pickling_references_the_path_and_its_training_set(how):
    # As for any on-disk path: a pickle references the directory (kept from then on),
    # now with the training set in it; the loaded estimator reads both and continues.
    X, y = _data(200)
    calls = [np.arange(0, 90), np.arange(90, 150), np.arange(150, 200)]
    est = _stream("disk", calls[:2], X=X, y=y, **SOLVERS["adam"])
    directory = est.trajectory_.directory
    if how == "skops":
        sio = pytest.importorskip("skops.io")
        with pytest.warns(UserWarning, match="Pickling references the on-disk trajectory"):
            blob = sio.dumps(est)
        untrusted = sio.get_untrusted_types(data=blob)
        assert all(t.startswith("skpathkernel.") for t in untrusted), untrusted
        load = lambda b: sio.loads(b, trusted=untrusted)  # noqa: E731
    else:
        with pytest.warns(UserWarning, match="Pickling references the on-disk trajectory"):
            blob = pickle.dumps(est)
        load = pickle.loads
        assert directory.encode() in blob
    assert X[3:5].tobytes() not in blob  # the rows stay in their file
    del est
    gc.collect()
    back = load(blob)
    assert back.trajectory_.directory == directory and _on_disk(back.X_fit_)
    mem = _stream("memory", calls[:2], X=X, y=y, **SOLVERS["adam"])
    assert_array_equal(back.X_fit_, mem.X_fit_)
    _assert_same_analyses(back, mem, X[:3] + 0.1)
    back.partial_fit(X[calls[2]], y[calls[2]])
    mem.partial_fit(X[calls[2]], y[calls[2]])
    _assert_same_path(mem.trajectory_, back.trajectory_)
    assert_array_equal(back.X_fit_, X)
    shutil.rmtree(directory)


def test_save_moves_the_training_set_with_the_path(tmp_path):
    X, y = _data()
    est = _stream("disk", CALLS[:2], **SOLVERS["adam"])
    est.trajectory_.save(tmp_path / "saved")
    assert os.path.exists(tmp_path / "saved" / "data" / "X.npy")
    est.partial_fit(X[CALLS[2]], y[CALLS[2]])  # appends where the path now is
    mem = _stream("memory", **SOLVERS["adam"])
    _assert_same_path(mem.trajectory_, Trajectory.load(tmp_path / "saved"))
    assert_array_equal(np.load(tmp_path / "saved" / "data" / "X.npy"), X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saved: kept already, nothing to say
        back = pickle.loads(pickle.dumps(est))
    assert_array_equal(back.X_fit_, X)
