"""The processes of tests/test_distributed.py: a DDP training loop recorded by PathRecorder.

Started as processes of a ``forkserver`` context that preloads this module (or
``spawn`` where there is none); each writes what the test checks under
``out`` (the writer's trajectory, every rank's errors) instead of returning it.
"""

import contextlib
import copy
import datetime
import gc
import json
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from skpathkernel import PathRecorder, Trajectory

N, STEPS = 24, 6


def data():
    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.uniform(-1, 1, size=(N, 3)))
    y = torch.sin(X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).reshape(-1, 1)
    return X, y


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def shards(world: int, step: int, scenario: str = "ok") -> list[np.ndarray]:
    """The global batch of a step cut into one shard per rank; unequal for 3 ranks.
    Under "exhausted", rank 1 has run out of batches from step 4 on: its shard is
    empty, and rank 0's is the step's batch."""
    rng = np.random.RandomState(100 + step)
    batch = rng.choice(N, 12, replace=False)
    if scenario == "exhausted" and step >= 4:
        return [batch[:6], batch[:0]]
    sizes = [6, 6] if world == 2 else [5, 4, 3]
    return np.split(batch, np.cumsum(sizes)[:-1])


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def micro_batches(shard: np.ndarray, rank: int, scenario: str) -> list[np.ndarray]:
    """The micro-batches a rank accumulates its shard in: one, or under "accumulate"
    and "weighted" (gradient accumulation with ``no_sync``) 4 + 2 on rank 0 and 3 + 3 on
    rank 1, so that a point's weight depends on its micro-batch, not on its shard's
    size."""
    if scenario not in ("accumulate", "weighted"):
        return [shard]
    return np.split(shard, [4] if rank == 0 else [3])


# Under "weighted", rank 0's loss weighs its samples by these (importance weights).
WEIGHTS = torch.as_tensor(np.random.RandomState(7).uniform(0.2, 2.0, size=N))


def micro_loss(model, X, y, part, rank, n_micro, scenario):
    """A micro-batch's loss as the rank's backward() takes it, and the coefficients of its
    samples' losses in it where they are declared (None: the mean's default). Under
    "weighted", rank 0 weighs its samples, ``(w * l).sum() / w.sum() / n_micro``, and
    rank 1 takes the mean: a step mixes declared and default coefficients."""
    per = 0.5 * ((model(X[part]) - y[part]) ** 2).sum(1)
    if scenario == "weighted" and rank == 0:
        w = WEIGHTS[part]
        return (w * per).sum() / w.sum() / n_micro, w / w.sum() / n_micro
    return per.mean() / n_micro, None


def _resumed(model, opt, rec, rank, out):
    """Under "resume": a checkpoint (the state dicts, and the path the writer saves),
    then new objects loaded from it, as after a restart, every rank resuming the path."""
    ckpt = os.path.join(out, "checkpoint")
    state = copy.deepcopy({"model": model.module.state_dict(), "optim": opt.state_dict()})
    if rank == rec.writer_rank:
        rec.trajectory.save(ckpt)
    rec.close()
    dist.barrier()  # the path is saved
    module = mlp()
    module.load_state_dict(state["model"])
    model = DistributedDataParallel(module)
    opt = optimizer(model.parameters())
    opt.load_state_dict(state["optim"])
    return model, opt, PathRecorder(model, opt, n_samples=N, storage="disk",
                                    resume_from=Trajectory.load(ckpt))


def _run(rank, world, out, scenario):
    X, y = data()
    model = DistributedDataParallel(mlp())
    opt = optimizer(model.parameters())
    rec = PathRecorder(model, opt, n_samples=N, storage="disk", directory=out)
    errors = []
    for t in range(STEPS):
        if scenario == "resume" and t == STEPS // 2:
            model, opt, rec = _resumed(model, opt, rec, rank, out)
        idx = shards(world, t, scenario)[rank]
        opt.zero_grad()
        # DDP's loss: each rank's mean over its shard (the mean of its micro-batches'
        # means), the gradients averaged over ranks at the last backward.
        micro = micro_batches(idx, rank, scenario)
        for j, part in enumerate(micro):
            with model.no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                loss, weights = micro_loss(model, X, y, part, rank, len(micro), scenario)
                loss.backward()
            if len(micro) > 1:
                rec.set_batch(part, weights=weights)
        if scenario == "crash" and rank == 1 and t == 3:
            os._exit(1)  # after the all-reduce, before the step: the gather finds it gone
        if scenario == "out_of_range" and rank == 1 and t == 2:
            idx = np.append(idx, N)
        if scenario == "disagree" and rank == 1 and t == 2:
            rec._step += 1  # as if this rank's recorder had seen one step more
        if not (scenario == "undeclared" and rank == 1 and t == 2) and len(micro) == 1:
            rec.set_batch(idx)
        try:
            opt.step()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            break
    if rank == rec.writer_rank:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traj = rec.trajectory
        traj.save(os.path.join(out, "path"))
        errors += [f"warning: {w.message}" for w in caught]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "n_steps": rec.n_steps}, f)


def _run_recorded_before_init(rank, world, port, out):
    """The recorder created before init_process_group (with the module and the optimizer,
    then wrapped in DDP): it records as one process, and DDP's all-reduce changes the
    gradients it saw from backward()."""
    X, y = data()
    module = mlp()
    opt = optimizer(module.parameters())
    rec = PathRecorder(module, opt, n_samples=N)
    _init(rank, world, port)
    model = DistributedDataParallel(module)
    errors = []
    idx = shards(world, 0)[rank]
    opt.zero_grad()
    (0.5 * (model(X[idx]) - y[idx]) ** 2).mean().backward()
    rec.set_batch(idx)
    try:
        opt.step()
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "n_steps": rec.n_steps}, f)


def _run_recorded_before_wrap(rank, world, out, scenario="recorded_before_wrap"):
    """Each rank its own initialization, the recorder (writing on rank 1) created on the
    module before DDP wraps it: DDP's construction copies rank 0's parameters over rank
    1's initial point. Two moves DDP does not make, each after the recorder's creation
    and before the first step, on every rank: under "rank0_writer_moved", the recorder
    created before wrapping but writing on rank 0, whose parameters DDP's copy leaves as
    they are; under "recorded_after_wrap_moved", the recorder created on the wrapper
    (writing on rank 1)."""
    import warnings

    X, y = data()
    torch.manual_seed(rank + 1)
    module = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 1)).double()
    opt = optimizer(module.parameters())
    writer = 0 if scenario == "rank0_writer_moved" else 1
    if scenario == "recorded_after_wrap_moved":
        model = DistributedDataParallel(module)
        rec = PathRecorder(model, opt, n_samples=N, writer_rank=writer)
    else:
        rec = PathRecorder(module, opt, n_samples=N, writer_rank=writer)
        model = DistributedDataParallel(module)
    if scenario != "recorded_before_wrap":
        with torch.no_grad():
            module[0].weight.mul_(0.5)
    idx = shards(world, 0)[rank]
    opt.zero_grad()
    (0.5 * (model(X[idx]) - y[idx]) ** 2).mean().backward()
    rec.set_batch(idx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": [f"warning: {w.message}" for w in caught],
                   "n_steps": rec.n_steps}, f)


def _init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)


def _destroy_process_group():
    """Free the group from here, last, as docs/user_guide/scripts/train_ddp.py does: freed
    by DDP's reducer in a collection (with the GIL held), gloo's join can wait forever on
    a worker thread that needs the GIL to drop a finished gather's tensors."""
    group = dist.group.WORLD
    gc.collect()  # DDP's wrapper, in reference cycles, while the group is held here
    dist.destroy_process_group()
    del group  # torch's ProcessGroup releases the GIL as it is freed


def main_logged(log, *args):
    """``main(*args)`` with the process's output (Python's and C++'s: fds 1 and 2) in the
    file ``log``. A forkserver's child writes where the server's output went, which is
    the capture of the test that started the server, not the test of this rank: the test
    shows this file instead."""
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    main(*args)


def main(rank, world, port, out, scenario):
    if scenario == "recorded_before_init":
        try:
            _run_recorded_before_init(rank, world, port, out)
        finally:
            _destroy_process_group()
        return
    _init(rank, world, port)
    try:
        if scenario in ("recorded_before_wrap", "rank0_writer_moved",
                        "recorded_after_wrap_moved"):
            _run_recorded_before_wrap(rank, world, out, scenario)
        else:
            _run(rank, world, out, scenario)
    finally:
        if scenario != "crash":
            _destroy_process_group()
