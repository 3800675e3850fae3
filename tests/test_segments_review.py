"""Review s51 of PathRecorder's buffers grown by parts (``_buffers.Segments``): paths
read while recording goes on, against the loop's own per-step record (parameters,
optimizer states, steps, step sizes, batches), the arrays of earlier reads kept and
checked after later growths and joins, pickles and copies of joined paths, and the
memory mappings of the parts returned when recorders are dropped."""

import copy
import gc
import pickle

import numpy as np
import pytest
import torch

from skpathkernel import PathRecorder, Trajectory

# Reads at the first part's end (65 points), around it, and at later parts' ends.
READS = {1, 2, 3, 63, 64, 65, 66, 67, 97, 98, 129, 130, 131, 132, 160, 194, 195}


def _net(dtype, frozen, width=40):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(),
                              torch.nn.Linear(width, 1)).to(dtype)
    if frozen:
        net[0].bias.requires_grad_(False)
    return net


def _optimizer(net, solver, groups):
    trained = [p for p in net.parameters() if p.requires_grad]
    params = ([{"params": trained[:1], "lr": 0.02}, {"params": trained[1:]}] if groups
              else trained)
    if solver == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if solver == "momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.RMSprop(params, lr=1e-3)


def _check(traj, names, own, steps_done, every):
    """``traj`` against the loop's own record after ``steps_done`` steps (on disk with
    compression, the parameters to the compression's precision)."""
    lossy = traj.storage == "disk" and traj.compression is not None
    expected_steps = list(range(0, steps_done + 1, every))
    if expected_steps[-1] != steps_done:
        expected_steps.append(steps_done)
    np.testing.assert_array_equal(traj.steps, expected_steps)
    assert len(traj) == len(expected_steps)
    for k, step in enumerate(expected_steps):
        got = traj.state_dict(k)
        for name in names:
            if lossy:
                torch.testing.assert_close(got[name], own["params"][step][name],
                                           atol=2e-2, rtol=0)
            else:
                assert torch.equal(got[name], own["params"][step][name]), (k, step, name)
    for k, step in enumerate(expected_steps[:-1]):
        state = traj.optimizer_state(k)
        for key, value in own["states"][step + 1].items():
            assert torch.equal(state[key], value), (k, step, key)
    np.testing.assert_array_equal(traj.step_learning_rates, own["lrs"][:steps_done])
    assert traj.n_steps == steps_done
    for t in range(steps_done):
        np.testing.assert_array_equal(traj.batch(t), own["batches"][t])


@pytest.mark.parametrize("solver, every, storage, dtype, frozen, groups, compression", [
    ("adam", 1, "memory", torch.float32, False, False, None),
    ("adam", 3, "memory", torch.float32, False, False, None),
    ("momentum", 1, "memory", torch.float64, True, False, None),
    ("rmsprop", 3, "memory", torch.float32, True, True, None),
    ("adam", 1, "auto", torch.float32, False, False, None),
    ("adam", 3, "auto", torch.float64, True, True, None),
    ("adam", 3, "auto", torch.float32, False, False, "bfloat16"),
    ("momentum", 1, "auto", torch.float32, False, False, "float16"),
])
def test_reads_while_recording_match_the_loops_own_record(solver, every, storage, dtype,
                                                          frozen, groups, compression):
    """Every read, at the first part's end and around the later parts' ends, equals the
    loop's own per-step copies; the arrays of every earlier read keep their values after
    the later growths and joins (a released part they viewed would be garbage or
    unmapped). "auto" under a budget of ~190 points of Adam moves to disk mid-way, after
    joins."""
    net = _net(dtype, frozen, 40 if storage == "memory" else 1200)
    opt = _optimizer(net, solver, groups)
    n_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_rows = 2 if solver != "momentum" else 1  # a point and a state
    # "auto": ~190 steps' points within the budget.
    budget = n_rows * (190 // every) * n_params * itemsize if storage == "auto" else 2**30
    rec = PathRecorder(net, opt, record_every=every, n_samples=16, storage=storage,
                       memory_budget=budget, compression=compression)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    rng = np.random.default_rng(0)
    X, y = torch.randn(16, 3, dtype=dtype), torch.randn(16, 1, dtype=dtype)
    key = {"adam": "exp_avg_sq", "rmsprop": "square_avg"}.get(solver)
    own = {"params": [{n: p.detach().clone() for n, p in net.named_parameters()}],
           "states": [None], "lrs": [], "batches": []}
    held = []  # (read's arrays, their values when read)
    storages = []
    for t in range(1, 230):
        lr = (1e-2 if solver == "adam" else 1e-3) * (1 + 0.01 * t)
        for i, group in enumerate(opt.param_groups):  # the first group's: the path's
            group["lr"] = lr * (1 + i)
        batch = rng.choice(16, size=4, replace=False)
        opt.zero_grad()
        (0.5 * (net(X[batch]) - y[batch]) ** 2).mean().backward()
        rec.set_batch(batch)
        opt.step()
        own["params"].append({n: p.detach().clone() for n, p in net.named_parameters()})
        trained = [p for p in net.parameters() if p.requires_grad]
        own["states"].append({} if key is None else {
            key: torch.cat([opt.state[p][key].reshape(-1) for p in trained])})
        own["lrs"].append(lr * len(opt.param_groups))  # the largest group's
        own["batches"].append(batch)
        if t in READS:
            traj = rec.trajectory
            storages.append(traj.storage)
            _check(traj, names, own, t, every)
            if traj.storage == "memory":
                params = traj._params  # (its rows and last point apart, TailedRows)
                arrays = [*((params.rows, params.tail) if hasattr(params, "tail")
                            else (params,)), *traj._states.values()]
                held.append((arrays, [a.clone() for a in arrays]))
    gc.collect()
    _check(rec.trajectory, names, own, 229, every)
    for arrays, values in held:
        for array, value in zip(arrays, values):
            assert torch.equal(array, value)
            array.add_(0)  # touched in place: mapped, and writable
    if storage == "auto":
        assert storages[0] == "memory" and storages[-1] == "disk"


def _joined_path():
    net = _net(torch.float32, False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    rec = PathRecorder(net, opt, n_samples=16)
    X, y = torch.randn(16, 3), torch.randn(16, 1)
    for t in range(100):
        opt.zero_grad()
        (0.5 * (net(X) - y) ** 2).mean().backward()
        rec.set_batch(np.arange(16))
        opt.step()
        if t == 70:
            _ = rec.trajectory  # joined: later reads are views with spare rows after them
    return rec, rec.trajectory


def test_joined_path_pickles_copies_and_saves_its_own_rows(tmp_path):
    """A path whose tensor is a view of a joined mapping with spare rows after it:
    pickled, deep-copied and saved, it is its own points (not the spare rows), and the
    copies are writable, independent of the recorder that goes on writing."""
    rec, traj = _joined_path()
    params = traj._params.clone()
    assert traj._params.untyped_storage().nbytes() > params.numel() * 4  # spare rows
    loaded = pickle.loads(pickle.dumps(traj))
    deep = copy.deepcopy(traj)
    traj.save(tmp_path / "p")
    saved = Trajectory.load(tmp_path / "p")
    for out in (loaded, deep, saved):
        assert torch.equal(out._params, params)
        assert out._params.untyped_storage().nbytes() == params.numel() * 4 or out is deep
        assert out._params.data_ptr() != traj._params.data_ptr()
        out._params[0, 0] = 123.0  # writable, and not the recorder's
    assert pickle.dumps(traj) == pickle.dumps(traj)
    shared = np.asarray(traj._params)  # shares the mapping, kept alive by the array
    del rec, traj
    gc.collect()
    assert np.array_equal(shared, params.numpy())


def test_a_path_read_between_recorded_points_pickles_copies_saves_and_resumes(tmp_path):
    """A path read between recorded points holds its recorded rows and its last point
    apart (TailedRows): pickled, deep-copied and saved it is one tensor of its points,
    it keeps them while recording goes on, and a recorder resumes from it. Against the
    loop's own copies of the parameters."""
    net = _net(torch.float32, False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    rec = PathRecorder(net, opt, n_samples=16, record_every=3)
    X, y = torch.randn(16, 3), torch.randn(16, 1)
    own = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]

    def step(rec, net, opt):
        opt.zero_grad()
        (0.5 * (net(X) - y) ** 2).mean().backward()
        rec.set_batch(np.arange(16))
        opt.step()
        own.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))

    for _ in range(10):
        step(rec, net, opt)
    traj = rec.trajectory
    expected = torch.stack([own[t] for t in (0, 3, 6, 9, 10)])
    np.testing.assert_array_equal(traj.steps, [0, 3, 6, 9, 10])
    assert type(traj._params).__name__ == "TailedRows"
    checkpoint = copy.deepcopy((net.state_dict(), opt.state_dict()))
    traj.save(tmp_path / "p")
    for out in (pickle.loads(pickle.dumps(traj)), copy.deepcopy(traj),
                Trajectory.load(tmp_path / "p")):
        assert isinstance(out._params, torch.Tensor) and torch.equal(out._params, expected)
        assert out.nbytes == traj.nbytes
    for _ in range(5):  # the next recorded points take the rows after the path's
        step(rec, net, opt)
    assert all(torch.equal(traj.parameters(k), p) for k, p in enumerate(expected))
    np.testing.assert_array_equal(rec.trajectory.steps, [0, 3, 6, 9, 12, 15])
    # Resumed from the live path: its points, then the resumed loop's.
    del own[11:]
    net.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    rec.close()
    resumed = PathRecorder(net, opt, n_samples=16, record_every=3, resume_from=traj)
    for _ in range(4):
        step(resumed, net, opt)
    path = resumed.trajectory
    np.testing.assert_array_equal(path.steps, [0, 3, 6, 9, 10, 13, 14])
    assert all(torch.equal(path.parameters(k), own[t])
               for k, t in enumerate([0, 3, 6, 9, 10, 13, 14]))


def _maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_recorders_dropped_return_their_mappings():
    """Many recorders grown past several parts and read, then dropped: the process's
    memory mappings do not grow with their number (a part never unmapped would)."""
    def one():
        rec, traj = _joined_path()
        traj.parameters(0)

    for _ in range(3):
        one()
    gc.collect()
    before = _maps()
    for _ in range(30):
        one()
    gc.collect()
    assert _maps() - before < 10


def _sgd_loop_checked(storage, budget, steps, every, record_every=1):
    """A 4,001-parameter SGD loop under a PathRecorder, its path read every ``every``
    steps; the last read checked against the loop's own record of every point (its
    points at the steps recorded; each read's last point against the current one)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1000), torch.nn.Tanh(),
                              torch.nn.Linear(1000, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    rec = PathRecorder(net, opt, n_samples=8, storage=storage, memory_budget=budget,
                       record_every=record_every)
    X, y = torch.randn(8, 3), torch.randn(8, 1)
    points = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]
    for t in range(steps):
        opt.zero_grad()
        (0.5 * (net(X) - y) ** 2).mean().backward()
        rec.set_batch(np.arange(8))
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        if (t + 1) % every == 0:
            traj = rec.trajectory
            assert torch.equal(traj.parameters(-1), points[-1])
    assert traj.storage == "memory"
    steps = [*range(0, len(points), record_every), len(points) - 1][:len(traj)]
    np.testing.assert_array_equal(traj.steps, steps)
    assert all(torch.equal(traj.parameters(k), points[t]) for k, t in enumerate(steps))
    return points


def _count_rows_allocated(monkeypatch):
    """A list whose item counts the rows of growing buffers allocated from now on."""
    from skpathkernel._path import _trajectory

    allocated = [0]
    mapped = _trajectory.mapped_empty

    def counting(rows, n_cols, dtype):
        allocated[0] += rows
        return mapped(rows, n_cols, dtype)

    monkeypatch.setattr(_trajectory, "mapped_empty", counting)
    return allocated


@pytest.mark.parametrize("storage, budget", [("memory", 2**20), ("auto", 2**23)])
@pytest.mark.parametrize("every", [1, 10])
def test_frequent_reads_copy_each_point_a_bounded_number_of_times(every, storage, budget,
                                                                  monkeypatch):
    """A loop that reads its path every step or every 10 (a user checkpointing, or
    logging from it): each read after the buffers grew a part joins the parts into one
    new tensor. The joined tensor had spare rows for one part only (one row here: 20 kB
    rows, parts of 32 kB under a 1 MiB budget), so the whole path was copied again every
    part: 300 steps read at each copied ~45000 rows (quadratic; measured with 300,000
    parameters, 1.7 times the loop's CPU time, review-segments-s51.md). Spare rows as
    many as the path's (mapped, resident only once written) copy each point O(1)
    times, as bad1034's doubling did; under "auto" (parts of 13 rows here) the first
    join leaves room for all that the budget holds, so that no later join holds the
    joined path beside its copy (twice the path resident: 115 MiB under a 64 MiB
    budget, review-segments-s51.md). Counted where the rows are allocated."""
    allocated = _count_rows_allocated(monkeypatch)
    points = _sgd_loop_checked(storage, budget, 300, every)
    # Doubling: each point in about 2 joins, plus the spare rows (2 x 301 rows at most
    # beyond the path); the old parts' rows: the path once more.
    assert allocated[0] <= 6 * len(points), allocated[0]


@pytest.mark.parametrize("storage, budget", [("memory", 2**20), ("auto", 2**23)])
def test_reads_between_recorded_points_copy_each_point_a_bounded_number_of_times(
        storage, budget, monkeypatch):
    """record_every=3, the path read every step: two reads in three end between recorded
    points, with the current parameters as the last point. Joined to the recorded rows
    in one tensor, that point made every such read copy the whole path, and the read
    after it too (no spare row left: the next recorded point takes the tail's row):
    quadratic, 1.44 times bad1034's CPU time at 300,000 parameters (review-segments-s51).
    The last point is kept apart now. Counted where the rows are allocated; every read's
    last point and the final path against the loop's own record."""
    allocated = _count_rows_allocated(monkeypatch)
    points = _sgd_loop_checked(storage, budget, 300, 1, record_every=3)
    # 101 recorded points: joins at doubled sizes, the spare rows, the old parts' rows.
    assert allocated[0] <= 6 * len(points[::3]), allocated[0]


def test_a_long_path_in_memory_takes_few_mappings(monkeypatch):
    """Storage "memory" under a small budget: parts of one 16 kB row each (a chunk of
    32 kB) made one memory mapping per step, and Linux allows 65,530 per process; parts
    that grow with the path keep their number logarithmic. Counted where they are
    allocated; the path checked against the loop's own record."""
    from skpathkernel._path import _trajectory

    parts = [0]
    mapped = _trajectory.mapped_empty

    def counting(rows, n_cols, dtype):
        parts[0] += 1
        return mapped(rows, n_cols, dtype)

    monkeypatch.setattr(_trajectory, "mapped_empty", counting)
    _sgd_loop_checked("memory", 2**20, 1500, 1500)
    assert parts[0] <= 150, parts[0]
