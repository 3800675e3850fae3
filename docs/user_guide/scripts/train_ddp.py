"""Record a DistributedDataParallel training run with PathRecorder, then decompose it.

Run with ``torchrun --nproc_per_node 2 train_ddp.py`` (CPU, gloo; NCCL when every rank
has a GPU). Every rank trains on its shard of each batch and declares it; rank 0 writes
the trajectory to ``ddp_path/`` and checks that the decomposition is exact.
"""

import gc
import os

import numpy as np
import torch
import torch.distributed as dist

# Before init_process_group: DDP imports this module on first use, and imported after
# init, its functions' defaults (``group=group.WORLD``) hold the process group, and gloo's
# threads with it, until the interpreter's exit.
import torch.distributed.nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from skpathkernel import PathRecorder, RecordedNetwork, Trajectory


def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" \
        else torch.device("cpu")

    rng = np.random.RandomState(0)  # the same data on every rank
    X = torch.as_tensor(rng.uniform(-1, 1, size=(256, 4)))
    y = torch.sin(X @ torch.tensor([1.0, -2.0, 0.5, 1.5], dtype=torch.float64))[:, None]
    # The dataset yields each sample's global index: what set_batch declares.
    data = TensorDataset(X, y, torch.arange(len(X)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)

    torch.manual_seed(0)  # the same initialization on every rank (DDP also broadcasts it)
    module = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(),
                                 torch.nn.Linear(32, 1)).double().to(device)
    model = DistributedDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = PathRecorder(model, opt, n_samples=len(X))  # on every rank; rank 0 writes
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb, idx in loader:
            opt.zero_grad()
            loss = (0.5 * (model(xb.to(device)) - yb.to(device)) ** 2).mean()
            loss.backward()
            rec.clip_grad_norm_(1.0)  # recorded: the per-point split stays exact
            rec.set_batch(idx)  # this rank's shard, as global indices
            opt.step()
    if rank == 0:
        traj = rec.trajectory
        traj.save("ddp_path")  # a file (memory) or the chunk directory (disk)
        print(f"{world} processes, {traj.n_steps} steps of {len(traj.batch(0))} samples")
        net = RecordedNetwork(module.cpu(), Trajectory.load("ddp_path"), X_train=X.numpy(),
                              y_train=y.numpy())
        res = net.decompose(X[:5].numpy())
        print(f"reconstruction error {res.error:.2e} "
              f"(largest |f| {np.abs(res.prediction).max():.2f})")
    dist.barrier()  # every rank leaves together
    # Free the process group last, from here: gloo joins its threads when the group is
    # freed, and a thread may still have to drop a finished collective's tensors, which
    # takes the GIL. Freed by DDP's reducer (its wrapper sits in reference cycles, and
    # a collection frees it holding the GIL) the join would wait on that thread and the
    # thread on the GIL: the rank hangs. torch's ProcessGroup releases the GIL as it is
    # freed, so the group is held here until the wrapper is collected, and dropped last.
    group = dist.group.WORLD
    del model, opt, rec
    gc.collect()
    dist.destroy_process_group()
    del group  # gloo's threads are joined here, while Python is whole


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
