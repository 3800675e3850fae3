import os
import pickle
import threading

import numpy as np
import pytest
import torch
from numpy.testing import assert_array_equal

from skpathkernel import PathKernelMachine, Trajectory


@pytest.fixture
def fitted(regression_data):
    X, y = regression_data
    return PathKernelMachine(hidden_layer_sizes=(5,), solver="adam", batch_size=10,
                             max_iter=3, random_state=0).fit(X, y)


def _assert_same(a, b):
    assert len(a) == len(b) and a.names == b.names and a.shapes == b.shapes
    assert torch.equal(a._params, b._params)
    assert_array_equal(a.steps, b.steps)
    assert_array_equal(a.learning_rates, b.learning_rates)
    for x, y in zip(a.batches, b.batches):
        assert_array_equal(x, y)
    for key in a.state_keys:
        assert torch.equal(a.optimizer_state(1)[key], b.optimizer_state(1)[key])
    assert a.solver_spec == b.solver_spec and a.n_samples == b.n_samples


def test_save_load_round_trip_is_exact(fitted, tmp_path):
    path = tmp_path / "path.pt"
    fitted.trajectory_.save(path)
    loaded = Trajectory.load(path)
    _assert_same(fitted.trajectory_, loaded)
    # The file holds no pickled code: torch's weights-only loader reads it directly.
    torch.load(path, weights_only=True)


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"a": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a skpathkernel trajectory"):
        Trajectory.load(path)

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as fh:
        pickle.dump(Evil(), fh)
    with pytest.raises(pickle.UnpicklingError, match="not a skpathkernel trajectory"):
        Trajectory.load(evil)


def test_load_refuses_a_numpy_file_without_suggesting_unsafe_loading(tmp_path):
    # torch's weights-only loader refused a .npy file as it refuses a pickle of code, in
    # words that suggested rerunning torch.load with weights_only=False.
    path = tmp_path / "array.npy"
    np.save(path, np.ones(3))
    with pytest.raises(pickle.UnpicklingError, match="not a skpathkernel trajectory") as info:
        Trajectory.load(path)
    assert "weights_only=False" not in str(info.value)


@pytest.mark.parametrize("content", [b"not a trajectory", "npy"])
def test_every_file_that_is_not_a_trajectory_is_a_value_error(tmp_path, content):
    # Files that torch.load(weights_only=True) refuses raised UnpicklingError alone, and
    # an ``except ValueError`` (what every other such file raises) let them through;
    # they stay UnpicklingErrors, as torch raises them.
    path = tmp_path / "other.pt"
    if content == "npy":
        with open(path, "wb") as fh:
            np.save(fh, np.ones(3))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a skpathkernel trajectory file") as info:
        Trajectory.load(path)
    assert isinstance(info.value, pickle.UnpicklingError)


@pytest.mark.parametrize("content", ["empty", "truncated", "text", "four bytes", "one byte"])
def test_load_refuses_a_file_torch_cannot_read(fitted, tmp_path, content):
    # An empty file failed with a bare EOFError, a truncated one with torch's
    # RuntimeError about a zip archive, a text file with KeyError(<its first byte>),
    # four bytes with a struct.error, one byte with IndexError('pop from empty list').
    saved = tmp_path / "path.pt"
    fitted.trajectory_.save(saved)
    data = {"empty": b"", "truncated": saved.read_bytes()[:200], "text": b"hello",
            "four bytes": b"junk", "one byte": b"a"}[content]
    path = tmp_path / "bad.pt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="is not a skpathkernel trajectory file"):
        Trajectory.load(path)


@pytest.mark.parametrize("path", [3, None])
def test_save_and_load_refuse_a_path_of_another_type(fitted, path):
    # torch took them for file objects: an AttributeError about 'write' or 'seek' (and
    # os.path.isdir took an int for a file descriptor).
    with pytest.raises(TypeError, match="expected str, bytes or os.PathLike"):
        fitted.trajectory_.save(path)
    with pytest.raises(TypeError, match="expected str, bytes or os.PathLike"):
        Trajectory.load(path)


def test_unflatten_refuses_what_is_not_a_flat_parameter_tensor(fitted):
    # torch.split failed in its words on a wrong length; an array had no .split.
    traj = fitted.trajectory_
    with pytest.raises(ValueError, match=r"flat must have shape \(\.\.\., n_params\)"):
        traj.unflatten(torch.zeros(traj.n_params + 1))
    with pytest.raises(TypeError, match="flat must be a torch.Tensor"):
        traj.unflatten(np.zeros(traj.n_params))
    assert list(traj.unflatten(traj.parameters(0))) == list(traj.names)


def test_nbytes_counts_parameters_and_state(fitted):
    traj = fitted.trajectory_
    P, n = traj.n_params, len(traj)
    # float32 parameters at every point, plus Adam's second moment at every step point.
    expected = 4 * P * (n + (n - 1))
    assert expected <= traj.nbytes < expected + 8 * (4 * traj.n_steps * 10 + 4 * n)


def test_indexing_and_views(fitted):
    traj = fitted.trajectory_
    assert torch.equal(traj.parameters(-1), traj.parameters(len(traj) - 1))
    with pytest.raises(IndexError):
        traj.parameters(len(traj))
    with pytest.raises(IndexError):
        traj.optimizer_state(len(traj) - 1)  # no step leaves the last point
    sd = traj.state_dict(1)
    sd["0.weight"].add_(1.0)  # a copy: the trajectory is not modified
    assert not torch.equal(sd["0.weight"], traj.state_dict(1)["0.weight"])
    assert [tuple(v.shape) for v in sd.values()] == [tuple(s) for s in traj.shapes]
    assert np.sum([np.prod(s) for s in traj.shapes]) == traj.n_params == fitted.n_params_


@pytest.mark.parametrize(("k", "error"), [
    ("last", IndexError), (99, IndexError), (-99, IndexError), (1.5, TypeError),
    ("0", TypeError), (True, TypeError)])
def test_step_size_scales_refuses_a_bad_point_on_a_path_of_one_step_size(fitted, k, error):
    # One parameter group: step_size_scales answered None for any k, out of range or not
    # an int, where preconditioner (the same points) refused it.
    traj = fitted.trajectory_
    k = len(traj) - 1 if k == "last" else k
    assert traj.step_size_scales(0) is None
    with pytest.raises(error, match="step point"):
        traj.preconditioner(k)
    with pytest.raises(error, match="step point"):
        traj.step_size_scales(k)


def test_a_path_too_large_for_memory_is_refused_before_training(regression_data, monkeypatch):
    import skpathkernel._path._trajectory as trajectory_module

    X, y = regression_data
    monkeypatch.setattr(trajectory_module, "_available_memory", lambda: 10_000)
    est = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=50, random_state=0)
    with pytest.raises(MemoryError, match=r"needs [\d,]+ bytes.*record_every=1"):
        est.fit(X, y)
    assert not hasattr(est, "module_")


def test_scalar_parameters_round_trip():
    # A 0-d parameter (a scalar gain) has an empty shape: unflattening must keep it 0-d.
    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.gain = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.gain * self.lin(x)

    from skpathkernel import PathRecorder

    module = Gain().double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    X = torch.randn(4, 2, dtype=torch.float64)
    with PathRecorder(module, opt, n_samples=4) as rec:
        for _ in range(2):
            opt.zero_grad()
            module(X).square().mean().backward()
            rec.set_batch(range(4))
            opt.step()
    state = rec.trajectory.state_dict(-1)
    assert state["gain"].shape == () and float(state["gain"]) == float(module.gain)


def test_in_memory_path_for_worker_processes_travels_by_reference(regression_data):
    """for_workers(by_reference=True): the pickle names a directory of the arrays, not
    the arrays; every unpickling in a process gives one mapped trajectory equal to the
    original (compared with the pickled copy by value); the directory is written once
    while the path is unchanged, again when a public array changes, and removed with
    the original; a process that cannot read it gets an error naming it."""
    import gc
    import os

    from skpathkernel._path import _storage
    from skpathkernel._path._trajectory import _open_shared_trajectory

    X, y = regression_data
    traj = PathKernelMachine(hidden_layer_sizes=(64,), solver="adam", max_iter=4,
                             tol=None, random_state=0).fit(X, y).trajectory_
    by_value = pickle.dumps(traj)
    shared = traj.for_workers(by_reference=True)
    directory = shared.__dict__["_shared_directory"]
    assert traj.for_workers(by_reference=True) is shared
    assert traj.for_workers() is traj  # by value unless asked
    sent = pickle.dumps(shared)
    assert len(sent) < 1000 < len(by_value) // 10
    _storage._shared_opened.clear()  # as in a fresh worker
    got, again = pickle.loads(sent), pickle.loads(sent)
    assert got is again
    _assert_same(got, pickle.loads(by_value))
    for k in range(len(traj)):
        assert torch.equal(got.parameters(k), traj.parameters(k))
    for k in range(len(traj) - 1):  # the states of the points a step leaves
        assert torch.equal(got.optimizer_state(k)["exp_avg_sq"],
                           traj.optimizer_state(k)["exp_avg_sq"])
    # A public array changed in place: a new directory with the new values.
    traj.learning_rates *= 2
    changed = traj.for_workers(by_reference=True)
    assert changed is not shared
    assert_array_equal(pickle.loads(pickle.dumps(changed)).learning_rates,
                       traj.learning_rates)
    new_directory = changed.__dict__["_shared_directory"]
    assert not os.path.exists(directory)  # the replaced one is gone
    del traj, shared, changed, got, again
    _storage._shared_opened.clear()
    gc.collect()
    assert not os.path.exists(new_directory)
    with pytest.raises(OSError, match="not readable here"):
        _open_shared_trajectory(new_directory)


def _arguments(traj):
    """The constructor's arguments that rebuild ``traj``."""
    return dict(names=traj.names, shapes=traj.shapes, params=traj._params,
                steps=traj.steps, learning_rates=traj.learning_rates,
                batch_indices=traj._batch_indices, batch_offsets=traj._batch_offsets,
                states=traj._states, state_steps=traj._state_steps,
                solver=traj.solver_spec, n_samples=traj.n_samples,
                record_every=traj.record_every, step_lrs=traj._step_lrs,
                gradient_scales=np.ones(traj.n_steps),
                batch_weights=np.full(len(traj._batch_indices), 0.25))


@pytest.mark.parametrize("name, change, match", [
    ("names", lambda a: a["names"][:-1], "names"),
    ("shapes", lambda a: [*a["shapes"][:-1], (2, 2)], "names"),
    ("params", lambda a: a["params"][:0], "at least one point"),
    ("steps", lambda a: a["steps"][:-1], "steps"),
    ("steps", lambda a: a["steps"][::-1].copy(), "steps"),
    ("learning_rates", lambda a: a["learning_rates"][1:], "learning_rates"),
    ("batch_offsets", lambda a: a["batch_offsets"][::-1].copy(), "batch_offsets"),
    ("batch_indices", lambda a: a["batch_indices"] + 1, "batch_"),
    ("batch_indices", lambda a: a["batch_indices"][:-1], "batch_offsets"),
    ("state_steps", lambda a: a["state_steps"][:-1], "state_steps"),
    ("states", lambda a: {k: v[:-1] for k, v in a["states"].items()}, "states"),
    ("step_lrs", lambda a: a["step_lrs"][:-1], "step_lrs"),
    ("gradient_scales", lambda a: np.ones(len(a["steps"])), "gradient_scales"),
    ("batch_weights", lambda a: a["batch_weights"][:-1], "batch_weights"),
])
def test_constructor_refuses_arrays_that_do_not_fit(name, change, match):
    """A path built by hand (or read from an altered file) whose arrays disagree raised
    later, mid-analysis (an IndexError, or a sum over the wrong steps); the constructor
    names the array."""
    X = np.linspace(-1, 1, 15).reshape(-1, 1)
    est = PathKernelMachine(hidden_layer_sizes=(3,), solver="adam", max_iter=4, batch_size=4,
                            tol=None, record_every=2, random_state=0).fit(X, X.ravel() ** 2)
    args = _arguments(est.trajectory_)
    args["step_lrs"] = np.linspace(1e-3, 2e-3, est.trajectory_.n_steps)
    rebuilt = Trajectory(**args)
    assert_array_equal(rebuilt.step_learning_rates, args["step_lrs"])
    assert_array_equal(rebuilt.batch(-1), est.trajectory_.batch(-1))
    with pytest.raises(ValueError, match=match):
        Trajectory(**{**args, name: change(args)})


def test_recorder_path_with_parameter_groups_before_its_first_step():
    """Optimizer groups with their own weight decay and no step yet: no group step sizes
    to count the groups by, and the constructor's check must not refuse the path."""
    from skpathkernel import PathRecorder

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.Tanh(),
                                 torch.nn.Linear(3, 1)).double()
    opt = torch.optim.AdamW([{"params": module[0].parameters(), "weight_decay": 0.1},
                             {"params": module[2].parameters(), "weight_decay": 0.0}])
    with PathRecorder(module, opt, n_samples=5) as rec:
        pass
    decays = rec.trajectory.weight_decays()
    assert decays is not None and float(decays[0]) == 0.1 and float(decays[-1]) == 0.0


def test_the_recorder_waits_for_the_copies_on_the_parameters_gpu(monkeypatch):
    """From a GPU the recorded points are copied into pinned memory asynchronously, and
    read after a synchronization. It waited for the current device only: a module on
    another GPU ("cuda:1") had its points read before their copies had landed. Emulated
    on the CPU: the recorder's parameters taken for cuda:1's, and every wait recorded."""
    from skpathkernel._path._trajectory import SolverSpec, TrajectoryRecorder

    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    rec = TrajectoryRecorder([p], ["p"], n_steps=None, record_every=1,
                             solver=SolverSpec("sgd"), n_samples=4, batch_size=2,
                             dtype=torch.float64)
    rec._non_blocking, rec._devices = True, (torch.device("cuda", 1),)
    rec.record_point(0)
    for step in range(2 * TrajectoryRecorder._INITIAL_STEPS):  # grows its buffers
        rec.record_batch(np.array([0, 1]))
        rec.record_step(step, 0.1, None)
        rec.record_point(step + 1)
    rec.points_in_memory([1])
    traj = rec.finish()
    assert len(traj) == 2 * TrajectoryRecorder._INITIAL_STEPS + 1
    # The read of points and the end (a growth adds buffers and copies nothing: it no
    # longer waits).
    assert len(waits) >= 2
    assert all(d is not None and torch.device(d) == torch.device("cuda", 1) for d in waits), waits


def test_a_failed_save_leaves_the_file_saved_before(fitted, tmp_path, monkeypatch):
    # torch.save truncated the file before writing: a save that failed part way (here an
    # object torch cannot pickle; a full disk or a stopped process alike) destroyed the
    # trajectory saved there before, and a reader meanwhile saw a partial file.
    # (A lock: torch.save cannot pickle it, and fails once the file is open.)
    path = tmp_path / "path.pt"
    fitted.trajectory_.save(path)
    before = path.read_bytes()
    payload = fitted.trajectory_._payload()
    monkeypatch.setattr(Trajectory, "_payload",
                        lambda self: {**payload, "unwritable": threading.Lock()})
    with pytest.raises(TypeError, match="cannot pickle"):
        fitted.trajectory_.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    _assert_same(fitted.trajectory_, Trajectory.load(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["path.pt"]



@pytest.mark.parametrize("where, error", [("missing/path.pt", FileNotFoundError),
                                          ("", IsADirectoryError)])
def test_save_where_no_file_can_be_written_names_the_path(fitted, tmp_path, where, error):
    # torch.save raised a RuntimeError (a missing folder; a directory or a folder the
    # process may not write: "open file failed", without the file's name).
    path = tmp_path / where
    with pytest.raises(error) as info:
        fitted.trajectory_.save(path)
    assert info.value.filename == os.fspath(path)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_load_refuses_a_file_cut_anywhere(fitted, tmp_path):
    # Cut at most places, torch's reader failed with a bare OSError(22, 'Invalid
    # argument'), naming no file (and at others with a RuntimeError or EOFError).
    saved = tmp_path / "path.pt"
    fitted.trajectory_.save(saved)
    data = saved.read_bytes()
    path = tmp_path / "cut.pt"
    for n in range(0, len(data), max(1, len(data) // 40)):
        path.write_bytes(data[:n])
        with pytest.raises(ValueError, match="cut.pt' is not a skpathkernel trajectory"):
            Trajectory.load(path)


def test_a_save_over_a_file_keeps_its_link_and_permissions(fitted, tmp_path):
    # Written aside and renamed, the save replaced a link by a file (the file it named,
    # which torch.save wrote through to, kept the old trajectory) and gave the file the
    # umask's permissions (a file 0o640 for a service's group came back 0o644, or 0o600
    # under a job's umask 0o077: the service could no longer read it).
    real, link = tmp_path / "real.pt", tmp_path / "link.pt"
    real.write_bytes(b"an older trajectory")
    real.chmod(0o640)
    link.symlink_to(real)
    old_umask = os.umask(0o077)
    try:
        fitted.trajectory_.save(link)
    finally:
        os.umask(old_umask)
    assert link.is_symlink() and os.readlink(link) == os.fspath(real)
    _assert_same(fitted.trajectory_, Trajectory.load(real))
    assert real.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pt", "real.pt"]


def test_a_save_over_a_file_the_process_may_not_write_is_refused(fitted, tmp_path,
                                                                 monkeypatch):
    # torch.save opened the file to write and was refused one made read-only (to keep
    # it); the rename over it needs the folder's permission alone, and replaced it. The
    # refusal made here by hand: this suite may run as root, whom permissions do not stop.
    path = tmp_path / "kept.pt"
    path.write_bytes(b"a trajectory kept")
    path.chmod(0o444)
    access = os.access

    def refuse(p, mode, *args, **kwargs):
        if os.fspath(p) == os.fspath(path) and mode & os.W_OK:
            return False
        return access(p, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", refuse)
    with pytest.raises(PermissionError) as info:
        fitted.trajectory_.save(path)
    assert info.value.filename == os.fspath(path)
    assert path.read_bytes() == b"a trajectory kept"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.pt"]
