"""PathRecorder under DistributedDataParallel: 2 and 3 CPU processes on the gloo backend.

The reference is a single-process run of the same global batches with DDP's loss (the
mean over ranks of each shard's mean loss), written out in the test; the decomposition's
reference is the network's own output.
"""

import json
import os
import re
import socket
import sys
import warnings
from multiprocessing import forkserver
from unittest import mock

import _ddp_worker as worker
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathRecorder, RecordedNetwork, Trajectory

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch built without torch.distributed / gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """Where the ranks start: forked from a forkserver that has imported the worker (torch,
    skpathkernel) and run nothing, so each rank starts in well under a second instead of
    importing them for 6-7 s as a spawned one does. A fork of this process instead would
    copy the OpenMP pool the tests' compute started, which a child cannot use; the server
    never computed, so its children are as fresh as spawned ones. The server is this
    process's (one per pytest-xdist worker), started at the first test and reused."""
    if "forkserver" not in mp.get_all_start_methods():  # Windows: spawn, as before
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # DDP's construction imports torch._dynamo (~800 modules, 3.5 s); then gc.freeze(),
    # so that a rank's gc.collect() skips the preloaded objects (1 s a rank).
    context.set_forkserver_preload([worker.__name__, "torch._dynamo", "_forkserver_frozen"])
    # Python 3.11's server does not take this process's sys.path (tests/, and this tree's
    # skpathkernel before an installed one): it could not import the worker, which it
    # skips in silence, or could import another skpathkernel. It gets it as PYTHONPATH.
    # Started once; for a later test, ensure_running() finds it alive.
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                         _SKPATHKERNEL_FORKSERVER="1"):
        forkserver.ensure_running()
    return context


def _spawn(world, tmp_path, scenario="ok"):
    out, port = str(tmp_path), _free_port()
    # Processes of their own, not mp.spawn's join: that one kills the other ranks when
    # one fails, and the crash test needs the survivor to finish.
    context = _context()
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = [context.Process(target=worker.main_logged,
                             args=(str(logs[r]), r, world, port, out, scenario))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)  # generous: a loaded machine imports torch slowly
        if p.is_alive():
            p.kill()
    for r, log in enumerate(logs):  # shown with a failure: a rank's traceback, gloo's log
        if log.exists() and log.stat().st_size:
            print(f"--- rank {r} (exit code {procs[r].exitcode}):\n{log.read_text()}")
    reports = {}
    for r in range(world):
        try:
            with open(tmp_path / f"rank{r}.json") as f:
                reports[r] = json.load(f)
        except FileNotFoundError:
            reports[r] = None
    return reports


def _single_process_path(world, scenario="ok"):
    """The reference: one process, the same global batches, DDP's loss."""
    X, y = worker.data()
    module = worker.mlp()
    opt = worker.optimizer(module.parameters())
    points = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    for t in range(worker.STEPS):
        opt.zero_grad()
        micro = [worker.micro_batches(s, r, scenario)
                 for r, s in enumerate(worker.shards(world, t, scenario))]
        # An empty shard's loss (the NaN mean of no rows) has a zero gradient: DDP
        # averages it in as the rank's, which the sum over the other ranks over `world`
        # is.
        loss = sum(worker.micro_loss(module, X, y, i, r, len(parts), scenario)[0]
                   for r, parts in enumerate(micro) for i in parts if len(i))
        (loss / world).backward()
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
    return module, torch.stack(points)


def _assert_decomposes_exactly(traj, module):
    """The recorded path's decomposition reconstructs the reference network's outputs,
    without a warning; returns the network and the queries."""
    X, y = worker.data()
    Xq = np.random.RandomState(5).uniform(-1, 1, size=(4, 3))
    net = RecordedNetwork(worker.mlp(), traj, X_train=X.numpy(), y_train=y.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = net.decompose(Xq)
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    assert_allclose(res.reconstruction, truth, rtol=0, atol=1e-12)
    return net, Xq


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_path_equals_one_process_and_decomposes_exactly(world, tmp_path):
    reports = _spawn(world, tmp_path)
    assert all(r == {"errors": [], "n_steps": worker.STEPS} for r in reports.values()), reports
    traj = Trajectory.load(tmp_path / "path")
    module, points = _single_process_path(world)
    assert len(traj) == worker.STEPS + 1
    for k in range(len(traj)):
        assert_allclose(traj.parameters(k).numpy(), points[k].numpy(), rtol=0, atol=1e-15)
    for t in range(worker.STEPS):
        shards = worker.shards(world, t)
        assert np.array_equal(traj.batch(t), np.concatenate(shards))
        # DDP averages the ranks' means: 1 / (R n_r) per sample of a shard of n_r.
        expected = np.concatenate([np.full(len(s), 1 / (world * len(s))) for s in shards])
        assert_allclose(traj.batch_weights(t), expected, rtol=1e-15)
    net, Xq = _assert_decomposes_exactly(traj, module)
    if world == 3:
        # Read as equal weights (one batch of 12), the unequal shards miss, and warn.
        net.network_.trajectory._batch_weights = None
        with pytest.warns(UserWarning, match="misses the prediction"):
            assert net.decompose(Xq).error > 1e-6


def _spawned_path_ends_as_one_process(tmp_path, scenario):
    """The path two ranks recorded in ``scenario``, checked to end where one process
    training on the same batches ends; with that process's module."""
    reports = _spawn(2, tmp_path, scenario)
    assert all(r == {"errors": [], "n_steps": worker.STEPS} for r in reports.values()), reports
    traj = Trajectory.load(tmp_path / "path")
    module, points = _single_process_path(2, scenario)
    assert_allclose(traj.parameters(-1).numpy(), points[-1].numpy(), rtol=0, atol=1e-14)
    return traj, module


def test_a_ddp_recording_resumes_from_a_checkpoint(tmp_path):
    # Halfway, every rank checkpoints (the writer saves the on-disk path), drops its
    # module, optimizer and recorder, and resumes in new ones with resume_from: the path
    # is the uninterrupted run's, which one process on the same batches replays.
    traj, module = _spawned_path_ends_as_one_process(tmp_path, "resume")
    _, points = _single_process_path(2)
    assert len(traj) == worker.STEPS + 1
    for k in range(len(traj)):
        assert_allclose(traj.parameters(k).numpy(), points[k].numpy(), rtol=0, atol=1e-15)
    for t in range(worker.STEPS):
        assert np.array_equal(traj.batch(t), np.concatenate(worker.shards(2, t)))
    _assert_decomposes_exactly(traj, module)


def test_ddp_gradient_accumulation_weighs_each_micro_batch(tmp_path):
    # Each rank accumulates its shard of 6 in micro-batches under no_sync (4 + 2 on rank
    # 0, 3 + 3 on rank 1): a point weighs 1 / (R m_r k) by its own micro-batch of k. The
    # shards being of one size, the weights were recorded as 1 / 12 for every point and
    # the decomposition missed the prediction by 0.26 (largest |f| 1.9).
    traj, module = _spawned_path_ends_as_one_process(tmp_path, "accumulate")
    for t in range(worker.STEPS):
        expected = np.concatenate([np.full(len(part), 1 / (2 * 2 * len(part)))
                                   for r, s in enumerate(worker.shards(2, t))
                                   for part in worker.micro_batches(s, r, "accumulate")])
        assert_allclose(traj.batch_weights(t), expected, rtol=1e-15)
    _assert_decomposes_exactly(traj, module)


def test_a_rank_out_of_batches_steps_with_an_empty_shard(tmp_path):
    # The route the distributed guide gives for uneven inputs instead of DDP's join(),
    # which the recorder does not take part in: rank 1 runs out of batches after step 3
    # and goes on stepping, forward and backward on no rows, set_batch of no index.
    # Rank 0's samples then weigh 1 / (2 * 6): DDP still averages over both ranks.
    traj, module = _spawned_path_ends_as_one_process(tmp_path, "exhausted")
    for t in range(worker.STEPS):
        shards = worker.shards(2, t, "exhausted")
        assert np.array_equal(traj.batch(t), np.concatenate(shards))
        assert_allclose(traj.batch_weights(t), np.full(len(traj.batch(t)), 1 / 12),
                        rtol=1e-15)
    assert len(traj.batch(worker.STEPS - 1)) == 6
    _assert_decomposes_exactly(traj, module)


def test_ddp_declared_loss_coefficients_are_gathered_over_the_ranks(tmp_path):
    # Rank 0 weighs its samples' losses, (w * l).sum() / w.sum() / n_micro per
    # micro-batch, and declares those coefficients; rank 1 takes the mean and declares
    # none: every rank sends its coefficients, the writer divides them by the number of
    # ranks (DDP's average), rank 1's being the default 1 / (n_micro k).
    traj, module = _spawned_path_ends_as_one_process(tmp_path, "weighted")
    for t in range(worker.STEPS):
        expected = []
        for r, s in enumerate(worker.shards(2, t)):
            parts = worker.micro_batches(s, r, "weighted")
            for part in parts:
                w = worker.WEIGHTS[part].numpy()
                expected.append(w / w.sum() / len(parts) / 2 if r == 0
                                else np.full(len(part), 1 / (2 * len(parts) * len(part))))
        assert_allclose(traj.batch_weights(t), np.concatenate(expected), rtol=1e-15)
    _assert_decomposes_exactly(traj, module)


@pytest.mark.slow
def test_a_recorder_created_before_init_process_group_says_so(tmp_path):
    # Created before the process group (with the module and the optimizer, then wrapped
    # in DDP), the recorder took the run for one process's and refused the all-reduced
    # gradients as "value clipping (clip_grad_value_), gradient noise or custom gradient
    # surgery". Every rank refuses the step (before it is taken), naming the cause.
    reports = _spawn(2, tmp_path, "recorded_before_init")
    for r in (0, 1):
        assert reports[r]["n_steps"] == 0, reports[r]
        (error,) = reports[r]["errors"]
        assert error.startswith("ValueError") and re.search(
            r"process group has 2 processes, while there was none when the recorder was "
            r"created.*Create the PathRecorder after init_process_group", error), error
        assert "clip_grad_value_" not in error


@pytest.mark.slow
def test_a_recorder_created_before_ddp_wraps_the_module_says_so(tmp_path):
    # Ranks initialized differently, the recorder created on the module before DDP's
    # construction copied rank 0's parameters: the writer (rank 1) recorded its own
    # initial point, which the path never took. It warned of a change "outside
    # optimizer.step()" naming clipping and re-initialisations, not DDP.
    reports = _spawn(2, tmp_path, "recorded_before_wrap")
    assert reports[0] == {"errors": [], "n_steps": 1}, reports[0]
    assert reports[1]["n_steps"] == 1
    (warning,) = reports[1]["errors"]
    assert re.search(r"changed since the recorder was created.*a recorder created before "
                     r"the module was wrapped sees DistributedDataParallel\(module\) copy "
                     r"rank 0's parameters to every rank: create it after wrapping",
                     warning), warning


@pytest.mark.slow
@pytest.mark.parametrize("scenario, writer", [("rank0_writer_moved", 0),
                                              ("recorded_after_wrap_moved", 1)])
def test_a_move_ddp_did_not_make_does_not_name_ddp(tmp_path, scenario, writer):
    # The parameters changed after the recorder's creation on every rank, by the loop
    # (as a load_state_dict would), not by DDP's copy of rank 0's: the writer is rank 0,
    # whose parameters that copy leaves as they are, or the recorder was created on the
    # wrapper, after the copy. The warning named DDP's copy and told the user to create
    # the recorder after wrapping.
    reports = _spawn(2, tmp_path, scenario)
    assert reports[1 - writer] == {"errors": [], "n_steps": 1}, reports
    (warning,) = reports[writer]["errors"]
    assert "'0.weight' changed since the recorder was created" in warning, warning
    assert "DistributedDataParallel" not in warning, warning


@pytest.mark.slow
@pytest.mark.parametrize("scenario, match", [
    ("out_of_range", r"rank 1 declared a wrong batch for optimizer step 2"),
    ("undeclared", r"rank 1 declared no batch \(set_batch\) for optimizer step 2"),
    ("disagree", r"rank 1 is at optimizer step 3, rank \d at 2|rank 0 is at optimizer "
                 r"step 2, rank 1 at 3"),
])
def test_a_bad_declaration_raises_on_every_rank_and_keeps_the_record(scenario, match,
                                                                      tmp_path):
    reports = _spawn(2, tmp_path, scenario)
    for r in (0, 1):
        assert any(e.startswith("ValueError") and re.search(match, e)
                   for e in reports[r]["errors"]), reports[r]
        assert reports[r]["n_steps"] == (3 if scenario == "disagree" and r == 1 else 2)
    traj = Trajectory.load(tmp_path / "path")
    _, points = _single_process_path(2)
    assert traj.n_steps == 2
    assert_allclose(traj.parameters(-1).numpy(), points[2].numpy(), rtol=0, atol=1e-15)


@pytest.mark.slow
def test_a_rank_that_crashes_leaves_a_readable_path_that_says_where_it_ends(tmp_path):
    reports = _spawn(2, tmp_path, "crash")
    assert reports[1] is None  # it died
    errors = reports[0]["errors"]
    assert errors[0].startswith("RuntimeError") and "gather of optimizer step 3" in errors[0]
    # What a timeout alone does not say: the ways a rank stops coming, DDP's join() one.
    assert "a rank died, or stopped taking the optimizer steps" in errors[0]
    assert "join()" in errors[0] and "set_batch([])" in errors[0]
    assert any("ends after optimizer step 2" in e for e in errors[1:]), errors
    traj = Trajectory.load(tmp_path / "path")
    _, points = _single_process_path(2)
    assert traj.n_steps == 3
    for k in range(4):
        assert_allclose(traj.parameters(k).numpy(), points[k].numpy(), rtol=0, atol=1e-15)


def test_a_ddp_wrapper_given_for_the_recorded_network_analyses_its_module():
    # PathRecorder records a DDP module through its .module: the path's parameters are
    # '0.weight', ..., the wrapper's 'module.0.weight', .... Handed the wrapper (the
    # `model` of the loop), RecordedNetwork analyses the module it wraps, as it does a
    # torch.compile'd one (it once refused the wrapper, naming `ddp.module`).
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(worker.mlp())
        opt = worker.optimizer(ddp.parameters())
        rec = PathRecorder(ddp, opt, n_samples=worker.N)
        X, y = worker.data()
        for t in range(2):
            idx = worker.shards(2, t)[0]
            opt.zero_grad()
            (0.5 * (ddp(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
        traj = rec.trajectory
    finally:
        torch.distributed.destroy_process_group()
    wrapped = RecordedNetwork(ddp, traj, X_train=X.numpy(), y_train=y.numpy())
    inner = RecordedNetwork(ddp.get_submodule("module"), traj, X_train=X.numpy(),
                            y_train=y.numpy())
    with torch.no_grad():
        truth = ddp.module(X[:3]).numpy()
    for net in (wrapped, inner):
        res = net.decompose(X[:3].numpy())
        assert_allclose(res.reconstruction, truth, rtol=0, atol=1e-12)
    assert_array_equal(wrapped.predict(X[:3].numpy()), inner.predict(X[:3].numpy()))
    # A module that is another network is refused as before, with no such hint.
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 1)).double()
    with pytest.raises(ValueError, match=r"the module's is of shape \(4, 3\)\.$"):
        RecordedNetwork(other, traj)


def test_a_failure_at_the_first_step_says_the_initial_point_is_kept():
    # A gather that failed at optimizer step 0 said "the trajectory ends after step -1".
    from skpathkernel._path._recorder import _kept

    assert _kept(0) == "the trajectory holds the initial point only"
    assert _kept(3) == "the trajectory ends after step 2"
