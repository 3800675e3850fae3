"""Recording a DistributedDataParallel run against the same loop without recording, and
decompose on 2 joblib workers against the serial call.

DDP rows: gloo, 2 CPU processes, the 64-512-512-1 tanh MLP, global batches of 256;
per-step wall time on rank 0, median of the repeats, recorded and plain rounds
interleaved in the same processes (same background load); the recorder gathers the
shards' indices to rank 0 (two collectives per step) and copies the parameters there.
Decompose rows: float32 path of plain SGD on the same MLP (T steps of batches of 64,
``PathRecorder``, in memory), 200 queries on a short path (T=4, about 0.25 s of CPU
in all) and on a long one (T=64, several seconds: the case workers are for), split into
query blocks, and 10 queries split into step ranges (the cost model of
``step_ranges``), one torch thread per task. "2 serial at once" runs two whole serial
calls in two processes, the throughput that two workers could reach at best.
"critical path" is load-insensitive: the serial call's CPU time over the largest CPU
time of the shares the workers get, cut as ``decompose`` cuts them (each run here on one
thread, least of the repeats), the speed-up two free cores would give. The serial row
says where its wall time went (``/proc/thread-self/schedstat``): on a CPU, or waiting
for one (the run queue of a shared machine); the round-trip row is a joblib call with
the tasks' arguments (the network, its path and the query blocks) and no work.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import statistics
import tempfile
import time

import numpy as np
import torch

SIZES = [64, 512, 512, 1]
DDP_GOAL = 1.3  # recorded / plain per step, at most
JOBS_GOAL = 1.6  # serial / 2 workers, at least


def _mlp(seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, out, steps, repeats):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from skpathkernel import PathRecorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.randn(4096, SIZES[0]), dtype=torch.float32)
    y = torch.as_tensor(rng.randn(4096, 1), dtype=torch.float32)
    times = {"plain": [], "recorded": []}
    for _ in range(repeats):
        for mode in ("plain", "recorded"):
            model = DistributedDataParallel(_mlp())
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            rec = PathRecorder(model, opt, n_samples=len(X)) if mode == "recorded" else None
            for t in range(steps + 2):  # two warm-up steps
                if t == 2:
                    dist.barrier()
                    start = time.perf_counter()
                batch = np.random.RandomState(t).choice(len(X), 256, replace=False)
                idx = np.array_split(batch, world)[rank]
                opt.zero_grad()
                (0.5 * (model(X[idx]) - y[idx]) ** 2).mean().backward()
                if rec is not None:
                    rec.set_batch(idx)
                opt.step()
            dist.barrier()
            times[mode].append((time.perf_counter() - start) / steps)
            if rec is not None:
                rec.close()
    if rank == 0:
        with open(os.path.join(out, "ddp.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _ddp_rows(quick):
    import torch.multiprocessing as mp

    steps, repeats = (10, 3) if quick else (30, 5)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_ddp_worker, args=(2, _free_port(), out, steps, repeats), nprocs=2)
        with open(os.path.join(out, "ddp.json")) as f:
            times = json.load(f)
    plain, recorded = (statistics.median(times[m]) for m in ("plain", "recorded"))
    return [
        dict(case="DDP step, 2 gloo processes, batch 256", method="DDP without recording",
             median_ms=1e3 * plain, min_ms=1e3 * min(times["plain"]),
             max_ms=1e3 * max(times["plain"]), ratio=1.0, goal=""),
        dict(case="DDP step, 2 gloo processes, batch 256", method="DDP + PathRecorder",
             median_ms=1e3 * recorded, min_ms=1e3 * min(times["recorded"]),
             max_ms=1e3 * max(times["recorded"]), ratio=recorded / plain,
             goal=f"<= {DDP_GOAL} ({'met' if recorded / plain <= DDP_GOAL else 'missed'})"),
    ]


def _path(steps):
    from skpathkernel import PathRecorder

    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.randn(512, SIZES[0]), dtype=torch.float32)
    y = torch.as_tensor(rng.randn(512, 1), dtype=torch.float32)
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for t in range(steps):
            idx = np.random.RandomState(t).choice(len(X), 64, replace=False)
            opt.zero_grad()
            (0.5 * (module(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
    Xq = np.random.RandomState(1).randn(200, SIZES[0]).astype(np.float32)
    return rec.as_network(X, y), Xq


def _schedstat():
    """(ns on a CPU, ns waiting for one) of this thread, or None off Linux."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except OSError:
        return None
    return int(on_cpu), int(waiting)


def _serial(net, Xq):
    torch.set_num_threads(1)
    sched = _schedstat()
    start = time.perf_counter()
    res = net.decompose(Xq)
    wall = time.perf_counter() - start
    if sched is not None:
        after = _schedstat()
        sched = tuple(1e-9 * (b - a) for a, b in zip(sched, after))
    return wall, res, sched


def _no_work(X, net):
    return len(X)


def _cpu(func, repeats):
    times = []
    for _ in range(repeats):
        start = time.process_time()
        func()
        times.append(time.process_time() - start)
    return min(times)


def _critical_path(net, Xq, repeats):
    """Serial CPU time over the largest worker share's, the shares cut as decompose
    cuts them for two workers."""
    from skpathkernel._analysis._decomposition import node_chunk, step_ranges
    from skpathkernel._parallel import _ranges

    kw = dict(method="exact", weighting="realized", n_nodes=None, tol=None,
              chunk=node_chunk(net.trajectory, "exact", len(Xq)))
    ranges = step_ranges(net.trajectory, "exact", "realized", len(Xq), 2)
    if ranges is not None:
        shares = [(Xq, {**kw, "intervals": r}) for r in ranges]
    else:  # cut at the node choice's chunks, as decompose cuts them
        blocks = _ranges(2, len(Xq), kw["chunk"])
        shares = [(Xq[a:b], kw) for a, b in blocks]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = _cpu(lambda: net._decompose_block(Xq, None, kw), repeats)
        worst = max(_cpu(lambda s=s: net._decompose_block(s[0], None, s[1]), repeats)
                    for s in shares)
    finally:
        torch.set_num_threads(threads)
    split = (f"step ranges {ranges}" if ranges is not None
             else "query blocks of " + " and ".join(str(len(s[0])) for s in shares))
    return serial, worst, split


def _jobs_rows(quick, steps=None, n_queries=200):
    from joblib import Parallel, delayed

    repeats = 2 if quick else 3
    steps = steps or (2 if quick else 4)
    net, Xq = _path(steps)
    Xq = Xq[:n_queries]
    threads = torch.get_num_threads()
    serial, parallel, ceiling, trip, sched = [], [], [], [], []
    workers = Parallel(n_jobs=2, backend="loky")
    workers(delayed(_serial)(net, Xq[:2]) for _ in range(2))  # start and warm the workers
    shipped = net.for_workers(by_reference=True)  # as decompose sends it to loky
    try:
        for _ in range(repeats):
            t, ref, where = _serial(net, Xq)
            serial.append(t)
            sched.append(where)
            start = time.perf_counter()
            workers(delayed(_no_work)(Xq[s], shipped)
                    for s in (slice(0, len(Xq) // 2), slice(len(Xq) // 2, None)))
            trip.append(time.perf_counter() - start)
            start = time.perf_counter()
            with_workers = net.decompose(Xq, n_jobs=2)
            parallel.append(time.perf_counter() - start)
            start = time.perf_counter()
            workers(delayed(_serial)(net, Xq) for _ in range(2))
            ceiling.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    size = float(np.abs(ref.prediction).max())
    agree = float(np.abs(with_workers.contributions - ref.contributions).max()) / size
    s, p, c, r = (statistics.median(v) for v in (serial, parallel, ceiling, trip))
    cpu_serial, cpu_share, split = _critical_path(net, Xq, repeats + 2)
    case = f"decompose, {n_queries} queries, T={steps}"
    where = ""
    if sched[0] is not None:
        on_cpu, waiting = (1e3 * statistics.median(x[i] for x in sched) for i in (0, 1))
        where = (f"on a CPU {on_cpu:.0f} ms, waiting for one {waiting:.0f} ms "
                 "(medians; no other wait)")
    return [
        dict(case=case, method="serial (1 thread)", median_ms=1e3 * s,
             min_ms=1e3 * min(serial), max_ms=1e3 * max(serial), ratio=1.0, goal=where),
        dict(case=case, method="n_jobs=2 (loky)", median_ms=1e3 * p,
             min_ms=1e3 * min(parallel), max_ms=1e3 * max(parallel), ratio=s / p,
             goal=f">= {JOBS_GOAL} ({'met' if s / p >= JOBS_GOAL else 'missed'}); "
                  f"max |difference| / max |f| = {agree:.1e}"),
        dict(case=case, method="2 serial calls at once (ceiling)", median_ms=1e3 * c,
             min_ms=1e3 * min(ceiling), max_ms=1e3 * max(ceiling), ratio=2 * s / c,
             goal="throughput of two workers at best"),
        dict(case=case, method="critical path (CPU of the larger share)",
             median_ms=1e3 * cpu_share, min_ms=1e3 * cpu_share, max_ms=1e3 * cpu_share,
             ratio=cpu_serial / cpu_share,
             goal=f">= {JOBS_GOAL} ({'met' if cpu_serial / cpu_share >= JOBS_GOAL else 'missed'}"
                  f" on two free cores); serial CPU {1e3 * cpu_serial:.0f} ms; {split}"),
        dict(case=case, method="loky round trip of the arguments, no work", median_ms=1e3 * r,
             min_ms=1e3 * min(trip), max_ms=1e3 * max(trip), ratio=r / s,
             goal=f"the network with its path ({net.trajectory.nbytes / 1e6:.1f} MB "
                  f"{net.trajectory.storage}, sent as {len(pickle.dumps(shipped)) / 1e3:.0f} "
                  "kB: the path by reference) and the query blocks, to warm workers"),
    ]


def run(quick: bool = False) -> list[dict]:
    return (_ddp_rows(quick) + _jobs_rows(quick)
            + _jobs_rows(quick, steps=16 if quick else 64)
            + _jobs_rows(quick, steps=4 if quick else 8, n_queries=10))


NOTES = ("`ratio`: recorded / plain per step for the DDP rows; serial time over the "
         "row's time for the decompose rows (the ceiling row: two calls' work over its "
         "time; the critical-path row: serial CPU time over the larger worker share's; "
         "the round-trip row: its time over the serial call's). "
         "Measured on a shared machine under load: compare the ratios, measured in the "
         "same run, not the absolute times; where the ceiling row is far below 2 the "
         "machine had no second core to give, and the critical-path row says what two "
         "free cores would.")
