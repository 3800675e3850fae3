"""DDP at scale, a user's trial: 3 and 4 gloo ranks on CPU, recorded by PathRecorder.

What a user's loop does that tests/test_distributed.py does not all do at once:
``DistributedSampler(drop_last=False)`` (it pads the last round by repeating samples, so
a global batch can hold one sample twice), batches of 5 whose last one per epoch is short,
gradient accumulation under ``no_sync`` in micro-batches of 2 (even ranks) or 3 (odd
ranks), and the last rank slower than the others (a sleep before each step). The reference
is one process taking the same global batches with DDP's loss (the mean over ranks of each
rank's mean of its micro-batches' means); the decomposition's is the network's output.

Run: ``PYTHONPATH=. python benchmarks/trial_ddp_scale.py [WORLD[:BATCH] ...]`` (default
3 and 4 ranks, batches of 5; one JSON line per trial on stdout). Batches of 20 put the
whole epoch in one step, where the sampler's padding repeats a sample within the batch.
"""

import datetime
import gc
import json
import os
import socket
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from skpathkernel import PathRecorder, RecordedNetwork, Trajectory
from tests._ddp_worker import mlp  # the MLP of tests/test_distributed.py

N, BATCH, EPOCHS, SLOW_S = 50, 5, 2, 0.05


def data():
    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.uniform(-1, 1, size=(N, 3)))
    y = torch.sin(X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).reshape(-1, 1)
    return X, y


def micro_size(rank):
    return 2 if rank % 2 == 0 else 3


def rank_main(rank, world, port, out, batch):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    X, y = data()
    dataset = TensorDataset(X, y, torch.arange(N))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=0, drop_last=False)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    model = DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    rec = PathRecorder(model, opt, n_samples=N)
    steps = []  # per step, this rank's micro-batches (global indices)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb, idx in loader:
            opt.zero_grad()
            parts = torch.split(torch.arange(len(idx)), micro_size(rank))
            for j, part in enumerate(parts):
                sync = j == len(parts) - 1
                with model.no_sync() if not sync else torch.enable_grad():
                    loss = (0.5 * ((model(xb[part]) - yb[part]) ** 2).sum(1)).mean()
                    (loss / len(parts)).backward()
                if len(parts) > 1:
                    rec.set_batch(idx[part].numpy())
            if len(parts) == 1:
                rec.set_batch(idx.numpy())
            if rank == world - 1:
                time.sleep(SLOW_S)  # the slow rank: the others wait in the gather
            opt.step()
            steps.append([idx[part].tolist() for part in parts])
    if rank == 0:
        rec.trajectory.save(os.path.join(out, "path"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(steps, f)
    dist.barrier()
    group = dist.group.WORLD  # freed last (see docs/user_guide/distributed.rst)
    del model, opt, rec
    gc.collect()
    dist.destroy_process_group()
    del group


def reference(world, per_rank):
    """One process, the same global batches, DDP's loss; the path and each step's
    expected (batch, weights)."""
    X, y = data()
    module = mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
    points = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    batches = []
    for t in range(len(per_rank[0])):
        opt.zero_grad()
        loss, batch, weights = 0.0, [], []
        for r in range(world):
            parts = per_rank[r][t]
            for part in parts:
                part = torch.as_tensor(part)
                loss = loss + (0.5 * ((module(X[part]) - y[part]) ** 2).sum(1)).mean() \
                    / len(parts)
                batch += part.tolist()
                weights += [1.0 / (world * len(parts) * len(part))] * len(part)
        (loss / world).backward()
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        batches.append((np.array(batch), np.array(weights)))
    return module, torch.stack(points), batches


def trial(world, batch=BATCH):
    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        procs = [context.Process(target=rank_main, args=(r, world, port, out, batch))
                 for r in range(world)]
        start = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        wall = time.perf_counter() - start
        codes = [p.exitcode for p in procs]
        per_rank = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
        traj = Trajectory.load(os.path.join(out, "path"))
        module, points, batches = reference(world, per_rank)
        X, y = data()
        path_err = max(float((torch.as_tensor(traj.parameters(k)) - points[k]).abs().max())
                       for k in range(len(traj)))
        batch_equal = all(np.array_equal(traj.batch(t), b)
                          for t, (b, _) in enumerate(batches))
        weight_err = max(float(np.abs((traj.batch_weights(t) if traj.batch_weights(t)
                                       is not None else 1 / len(b)) - w).max())
                         for t, (b, w) in enumerate(batches))
        duplicates = sum(len(b) - len(np.unique(b)) for b, _ in batches)
        sizes = sorted({len(b) for b, _ in batches})
        Xq = np.random.RandomState(5).uniform(-1, 1, size=(4, 3))
        net = RecordedNetwork(mlp(), traj, X_train=X.numpy(), y_train=y.numpy())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = net.decompose(Xq)
        with torch.no_grad():
            truth = module(torch.as_tensor(Xq)).numpy()
        return {"world": world, "batch": batch, "exit_codes": codes, "steps": traj.n_steps,
                "global_batch_sizes": sizes, "duplicated_samples_in_batches": duplicates,
                "max_path_error_vs_one_process": path_err, "batches_equal": batch_equal,
                "max_batch_weight_error": weight_err,
                "max_reconstruction_error_vs_network": float(np.abs(
                    res.reconstruction - truth).max()),
                "decompose_error": float(res.error),
                "largest_abs_f": float(np.abs(truth).max()),
                "warnings": [str(w.message)[:200] for w in caught], "wall_s": round(wall, 1)}


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["3", "4"]:
        print(json.dumps(trial(*map(int, arg.split(":")))), flush=True)
