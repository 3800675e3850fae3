"""A model trained with its path on disk, shipped with the path's directory elsewhere.

Its pickle (pickle, joblib, skops) references the directory by the absolute name it had:
loaded where the directory was moved, it is pointed at the new place with
``relocate_trajectory`` (``Trajectory.relocate``), which checks that the directory holds
this very path first and changes nothing otherwise. Every verb of the relocated model is
compared with the original's, computed before the move: the same arithmetic on the same
stored numbers, so bit for bit.
"""

import copy
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import joblib
import numpy as np
import pytest
import skops.io as sio
import torch
from numpy.testing import assert_array_equal

from skpathkernel import (
    PathKernelMachine,
    PathRecorder,
    RecordedNetwork,
    TangentFeatures,
    Trajectory,
)
from skpathkernel._path import _trajectory
from skpathkernel._path._storage import TrajectoryFileError
from skpathkernel.diagnostics import hessian_trace, loss_path

CHUNK = 3  # vectors per chunk file: several files, a partly filled last one
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NET = dict(hidden_layer_sizes=(6,), max_iter=4, batch_size=5, dtype="float64", tol=None,
           solver="adam", learning_rate_init=0.01, trajectory_storage="disk")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(_trajectory, "chunk_rows_for", lambda *args: CHUNK)


def _data(n=20, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, 2))
    return X, np.sin(2 * X[:, 0]) - X[:, 1]


def _trained(tmp_path, continued, random_state=0, name="model-path"):
    """A model whose path is saved in ``tmp_path / name``; ``continued``: partial_fit
    after fit, which keeps the training set beside the path (``data/``)."""
    X, y = _data()
    est = PathKernelMachine(**NET, random_state=random_state,
                            trajectory_dir=str(tmp_path / "tmp")).fit(X[:14], y[:14])
    if continued:
        est.partial_fit(X[14:], y[14:])
        assert os.path.isdir(os.path.join(est.trajectory_.directory, "data"))
    est.trajectory_.save(tmp_path / name)
    return est


def _verbs(model, Xq):
    """Every verb's result: the path read forwards and backwards, at a past point, and
    the training set."""
    d = model.decompose(Xq)
    out = {"predict": model.predict(Xq), "initial": d.initial,
           "contributions": d.contributions, "regularization": d.regularization,
           "attribute": model.attribute(Xq),
           "path_kernel": model.path_kernel_(Xq), "tangent_kernel": model.tangent_kernel_(Xq),
           "self_influence": model.self_influence()}
    if isinstance(model, PathKernelMachine):
        out["transform"] = model.transform(Xq)
        dist, ind = model.kneighbors(Xq, n_neighbors=4, kernel="tangent", step=2)
        out["kneighbors_dist"], out["kneighbors_ind"] = dist, ind
        out["parameters_1"] = model.trajectory_.parameters(1).numpy()
    return out


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert_array_equal(got[key], want[key], err_msg=key)


def _dump_load(est, how, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pickle keeps a temporary directory, if any
        if how == "pickle":
            path.write_bytes(pickle.dumps(est))
            return lambda: pickle.loads(path.read_bytes())
        if how == "joblib":
            joblib.dump(est, path)
            return lambda: joblib.load(path)
        sio.dump(est, path)
    untrusted = sio.get_untrusted_types(file=path)
    assert all(t.startswith("skpathkernel.") for t in untrusted), untrusted
    return lambda: sio.load(path, trusted=untrusted)


@pytest.mark.parametrize("how", ["pickle", "joblib", "skops"])
@pytest.mark.parametrize("continued", [False, True])
def test_a_moved_model_is_relocated_and_every_verb_is_unchanged(tmp_path, how, continued):
    est = _trained(tmp_path, continued)
    old = est.trajectory_.directory
    Xq = _data(4, seed=1)[0]
    want = _verbs(est, Xq)
    load = _dump_load(est, how, tmp_path / "model.bin")
    new = str(tmp_path / "shipped" / "path")
    os.mkdir(tmp_path / "shipped")
    shutil.move(old, new)

    back = load()  # loads without the directory (the training set included)
    assert_array_equal(back.predict(Xq), want["predict"])
    for verb in (lambda: back.decompose(Xq), lambda: back.path_kernel_(Xq),
                 lambda: back.kneighbors(Xq, n_neighbors=4, kernel="tangent", step=2)):
        with pytest.raises(OSError, match="relocate_trajectory") as info:
            verb()
        assert old in str(info.value)
    assert back.relocate_trajectory(new) is back
    assert back.trajectory_.directory == new
    _assert_same(_verbs(back, Xq), want)
    # Writes go to the new place too: the path is continued there, as the original
    # would have been (the same calls on an in-memory copy of the same fit).
    mem = PathKernelMachine(**{**NET, "trajectory_storage": "memory"}, random_state=0)
    X, y = _data()
    mem.fit(X[:14], y[:14])
    if continued:
        mem.partial_fit(X[14:], y[14:])
    back.partial_fit(X[:6], y[:6])
    mem.partial_fit(X[:6], y[:6])
    assert back.trajectory_.directory == new and not os.path.exists(old)
    for k in range(len(mem.trajectory_)):
        assert torch.equal(back.trajectory_.parameters(k), mem.trajectory_.parameters(k))
    assert_array_equal(back.X_fit_, mem.X_fit_)
    _assert_same_path_reloaded(back.trajectory_, Trajectory.load(new))


def _assert_same_path_reloaded(a, b):
    assert len(a) == len(b)
    for k in range(len(a)):
        assert torch.equal(a.parameters(k), b.parameters(k))


SCRIPT = """
import pickle, sys
import numpy as np
import torch
torch.set_num_threads(int(sys.argv[4]))
with open(sys.argv[1], "rb") as f:
    est = pickle.load(f)
Xq = np.load(sys.argv[3])
try:
    est.decompose(Xq)
except OSError as exc:
    message = str(exc)
else:
    message = ""
d = est.relocate_trajectory(sys.argv[2]).decompose(Xq)
np.savez(sys.argv[3] + ".out.npz", contributions=d.contributions, initial=d.initial,
         kernel=est.path_kernel_(Xq), message=np.array(message))
"""


@pytest.mark.parametrize("continued", [False, True])
def test_a_model_moved_with_its_path_is_relocated_in_a_fresh_process(tmp_path, continued):
    est = _trained(tmp_path, continued)
    old = est.trajectory_.directory
    Xq = _data(3, seed=2)[0]
    d = est.decompose(Xq)
    kernel = est.path_kernel_(Xq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (tmp_path / "model.pkl").write_bytes(pickle.dumps(est))
    np.save(tmp_path / "Xq.npy", Xq)
    del est
    new = str(tmp_path / "elsewhere")
    shutil.move(old, new)
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model.pkl"), new,
                    str(tmp_path / "Xq.npy"), str(torch.get_num_threads())],
                   check=True, env=env, cwd=tmp_path)
    out = np.load(str(tmp_path / "Xq.npy") + ".out.npz")
    message = str(out["message"])
    assert old in message and "relocate_trajectory" in message
    assert_array_equal(out["contributions"], d.contributions)
    assert_array_equal(out["initial"], d.initial)
    assert_array_equal(out["kernel"], kernel)


def _refused(back, directory, error, match):
    """``relocate_trajectory(directory)`` refused, the model reading where it did."""
    before = back.trajectory_.directory
    with pytest.raises(error, match=match):
        back.relocate_trajectory(directory)
    assert back.trajectory_.directory == before


def test_another_models_directory_is_refused(tmp_path):
    # Same data, same settings, another seed: a path of the same steps, batches and
    # sizes, only the numbers differ (full batch: no shuffling tells them apart either).
    X, y = _data()
    est = PathKernelMachine(**{**NET, "batch_size": None}, random_state=0).fit(X, y)
    other = PathKernelMachine(**{**NET, "batch_size": None}, random_state=1).fit(X, y)
    est.trajectory_.save(tmp_path / "mine")
    other.trajectory_.save(tmp_path / "theirs")
    Xq = X[:3]
    want = _verbs(est, Xq)
    back = pickle.loads(pickle.dumps(est))
    shutil.move(tmp_path / "mine", tmp_path / "moved")
    _refused(back, tmp_path / "theirs", ValueError, "another recording's")
    _refused(back, tmp_path / "nowhere", FileNotFoundError, "no directory")
    back.relocate_trajectory(tmp_path / "moved")
    _assert_same(_verbs(back, Xq), want)


def test_a_directory_missing_a_file_is_refused_and_nothing_changes(tmp_path):
    est = _trained(tmp_path, continued=True)
    old = est.trajectory_.directory
    Xq = _data(3, seed=3)[0]
    want = _verbs(est, Xq)
    blob = pickle.dumps(est)
    new = tmp_path / "moved"
    shutil.move(old, new)
    back = pickle.loads(blob)
    for victim, match in [("params/000001.npy", "000001.npy.*missing"),
                          ("data/X.npy", "training data file.*missing"),
                          ("trajectory.pt", "trajectory.pt.*missing")]:
        shutil.move(new / victim, tmp_path / "aside")
        _refused(back, new, OSError, match)
        shutil.move(tmp_path / "aside", new / victim)
    # A chunk of another length (another network's file in its place).
    chunk = new / "params" / "000000.npy"
    shutil.copy(chunk, tmp_path / "aside")
    np.save(chunk, np.zeros((CHUNK, 3)))
    _refused(back, new, TrajectoryFileError, "another network's trajectory")
    shutil.copy(tmp_path / "aside", chunk)
    back.relocate_trajectory(new)
    _assert_same(_verbs(back, Xq), want)


def test_a_directory_that_a_copy_continued_is_refused(tmp_path):
    # The pickle's path is a prefix of what the directory describes now.
    est = _trained(tmp_path, continued=False)
    blob = pickle.dumps(est)
    X, y = _data()
    est.partial_fit(X[:5], y[:5])
    new = tmp_path / "moved"
    shutil.move(est.trajectory_.directory, new)
    _refused(pickle.loads(blob), new, ValueError, r"optimizer steps.*continued")


def test_a_path_in_memory_has_nothing_to_relocate(tmp_path):
    X, y = _data()
    est = PathKernelMachine(**{**NET, "trajectory_storage": "memory"}).fit(X, y)
    with pytest.raises(ValueError, match="in memory"):
        est.relocate_trajectory(tmp_path)
    with pytest.raises(ValueError, match="in memory"):
        est.trajectory_.relocate(tmp_path)


def test_a_trajectory_and_its_deep_copies_are_relocated(tmp_path):
    est = _trained(tmp_path, continued=False)
    traj = est.trajectory_
    want = [traj.parameters(k) for k in range(len(traj))]
    blob = pickle.dumps(traj)
    shutil.move(traj.directory, tmp_path / "moved")
    back = pickle.loads(blob)
    twin = copy.deepcopy(back)
    with pytest.raises(TrajectoryFileError, match="relocate"):
        back.parameters(0)
    assert back.relocate(tmp_path / "moved") is back
    for t in (back, twin):
        assert t.directory == str(tmp_path / "moved")
        for k, w in enumerate(want):
            assert torch.equal(t.parameters(k), w)


def _recorded(tmp_path, name, seed=0, compiled=False):
    """A user loop's RecordedNetwork, its path on disk saved in ``tmp_path / name``
    (``compiled``: the loop runs, and the network holds, ``torch.compile(module)``)."""
    X, y = _data()
    Xt = torch.as_tensor(X)
    yt = torch.as_tensor(y).reshape(-1, 1)
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(),
                                 torch.nn.Linear(5, 1)).double()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    if compiled:
        module = torch.compile(module, backend="eager")  # no C++ compiler needed
    with PathRecorder(module, optimizer, n_samples=len(X), storage="disk",
                      directory=tmp_path / "tmp") as rec:
        for _ in range(7):
            optimizer.zero_grad()
            (0.5 * (module(Xt) - yt).pow(2).mean()).backward()
            rec.set_batch(np.arange(len(X)))
            optimizer.step()
    rec.trajectory.save(tmp_path / name)
    return RecordedNetwork(module, rec.trajectory, X_train=X, y_train=y)


def test_a_recorded_network_is_relocated(tmp_path):
    X, y = _data()
    model = _recorded(tmp_path, "loop")
    Xq = X[:3] + 0.1
    want = _verbs(model, Xq)
    blob = pickle.dumps(model)
    shutil.move(tmp_path / "loop", tmp_path / "moved")
    back = pickle.loads(blob)
    with pytest.raises(OSError, match="relocate_trajectory"):
        back.predict(Xq)  # a RecordedNetwork's predict reads the path's last point
    assert back.relocate_trajectory(tmp_path / "moved") is back
    _assert_same(_verbs(back, Xq), want)


def test_a_meta_estimator_relocates_its_trainers_path(tmp_path):
    X, y = _data()
    meta = TangentFeatures(PathKernelMachine(**NET, random_state=0)).fit(X, y)
    meta.estimator_.trajectory_.save(tmp_path / "path")
    Xq = X[:3]
    want = meta.network_.decompose(Xq).contributions
    blob = pickle.dumps(meta)
    shutil.move(tmp_path / "path", tmp_path / "moved")
    back = pickle.loads(blob)
    assert back.relocate_trajectory(tmp_path / "moved") is back
    assert back.estimator_.trajectory_.directory == str(tmp_path / "moved")
    assert_array_equal(back.network_.decompose(Xq).contributions, want)


def test_a_compressed_path_is_relocated(tmp_path):
    # Chunk files of a first vector and rounded differences: other file shapes checked.
    X, y = _data()
    est = PathKernelMachine(**NET, trajectory_compression="bfloat16",
                            random_state=0).fit(X, y)
    est.trajectory_.save(tmp_path / "path")
    Xq = X[:3]
    want = _verbs(est, Xq)
    blob = pickle.dumps(est)
    shutil.move(tmp_path / "path", tmp_path / "moved")
    back = pickle.loads(blob).relocate_trajectory(tmp_path / "moved")
    assert back.trajectory_.compression == "bfloat16"
    _assert_same(_verbs(back, Xq), want)


def test_relocating_only_the_trajectory_of_a_loaded_estimator_is_refused_by_partial_fit(
        tmp_path):
    # trajectory_.relocate re-points the path but not the training set the estimator
    # could not read when loaded: partial_fit got as far as a TypeError on it.
    est = _trained(tmp_path, continued=True)
    X_fit, blob = est.X_fit_.copy(), pickle.dumps(est)
    new = tmp_path / "moved"
    shutil.move(tmp_path / "model-path", new)
    loaded = pickle.loads(blob)
    loaded.trajectory_.relocate(new)
    n_steps = loaded.trajectory_.n_steps
    X, y = _data()
    with pytest.raises(TrajectoryFileError, match="relocate_trajectory"):
        loaded.partial_fit(X[:5], y[:5])
    assert loaded.trajectory_.n_steps == n_steps
    # The estimator's own relocation reads it, and the path goes on from there.
    loaded.relocate_trajectory(new).partial_fit(X[:5], y[:5])
    assert loaded.trajectory_.n_steps > n_steps
    assert_array_equal(loaded.X_fit_, np.concatenate([X_fit, X[:5]]))


def test_the_path_diagnostics_of_a_loaded_model_say_to_relocate_it(tmp_path):
    # Their default data, the training set, is unread where the directory was not:
    # they failed on it with an AttributeError, not the error naming the remedy.
    est = _trained(tmp_path, continued=True)
    want = loss_path(est)
    blob = pickle.dumps(est)
    new = tmp_path / "moved"
    shutil.move(tmp_path / "model-path", new)
    loaded = pickle.loads(blob)
    for diagnostic in (loss_path, hessian_trace):
        with pytest.raises(TrajectoryFileError, match="relocate_trajectory"):
            diagnostic(loaded)
    assert_array_equal(loss_path(loaded.relocate_trajectory(new)), want)


def _saved_before_ids(directory):
    """``directory``'s description as a skpathkernel that wrote no recording identity
    wrote it."""
    meta = os.path.join(directory, "trajectory.pt")
    payload = torch.load(meta, weights_only=True)
    del payload["storage"]["id"]
    torch.save(payload, meta)


@pytest.mark.parametrize("compression", [None, "float16", "bfloat16"])
def test_directories_saved_before_recording_ids_are_told_apart_by_their_last_point(
        tmp_path, compression):
    # Same data and settings, another seed, full batch: the descriptions are equal but
    # for the identities, which neither side has here; the vectors tell the paths apart.
    X, y = _data()
    kw = {**NET, "batch_size": None, "trajectory_compression": compression}
    est = PathKernelMachine(**kw, random_state=0).fit(X, y)
    other = PathKernelMachine(**kw, random_state=1).fit(X, y)
    assert est.trajectory_._params.tail is None  # the last point is in the chunk files
    est.trajectory_.save(tmp_path / "mine")
    other.trajectory_.save(tmp_path / "theirs")
    for name in ("mine", "theirs"):
        _saved_before_ids(tmp_path / name)
    Xq = X[:3]
    want = _verbs(est, Xq)
    blob = pickle.dumps(est)
    shutil.move(tmp_path / "mine", tmp_path / "moved")
    # A recording made with identities, or a pickle of one: told from these by that.
    _refused(pickle.loads(blob), tmp_path / "moved", ValueError, "identity: none")
    back = pickle.loads(blob)
    back.trajectory_._store.id = None  # as pickled before identities were kept
    _refused(back, tmp_path / "theirs", ValueError, "not this model's parameters")
    # A bare trajectory holds no point to compare: refused, saying what does.
    traj = pickle.loads(pickle.dumps(back.trajectory_))
    with pytest.raises(ValueError, match="Trajectory.load"):
        traj.relocate(tmp_path / "moved")
    assert traj.directory == str(tmp_path / "mine")
    # Reading the stored point warns of nothing (torch warned once per process that the
    # mapped file's memory was not writable: every time here).
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            back.relocate_trajectory(tmp_path / "moved")
    finally:
        torch.set_warn_always(always)
    _assert_same(_verbs(back, Xq), want)


# compiled: the network's parameters are compared under the compiled module's own
# names (its OptimizedModule's are "_orig_mod."-prefixed, which refused every directory
# as holding "none of the path's points", advising relocate_trajectory itself).
@pytest.mark.parametrize("compiled", [False, True])
def test_a_recorded_network_saved_before_recording_ids_is_told_from_another(tmp_path,
                                                                            compiled):
    X, y = _data()
    models = []
    for seed in (0, 1):
        models.append(_recorded(tmp_path, f"loop{seed}", seed, compiled))
        _saved_before_ids(tmp_path / f"loop{seed}")
        models[-1].trajectory._store.id = None  # as pickled before identities were kept
    Xq = X[:3] + 0.1
    want = _verbs(models[0], Xq)
    blob = pickle.dumps(models[0])
    shutil.move(tmp_path / "loop0", tmp_path / "moved")
    back = pickle.loads(blob)
    with pytest.raises(ValueError, match="not this model's parameters"):
        back.relocate_trajectory(tmp_path / "loop1")
    assert back.trajectory.directory == str(tmp_path / "loop0")
    back.relocate_trajectory(tmp_path / "moved")
    _assert_same(_verbs(back, Xq), want)
