"""Long paths on disk: recording, the path kernel and the decomposition, disk versus memory.

A 64-512-512-1 tanh MLP (P = 295,937, the issue's P ~ 300k) trained with batch 128 on
1024 samples, every step recorded (float32, 1.2 MB per point, twice that with Adam).
Recording: the plain torch loop, the recorder in memory and the recorder on disk, repeats
interleaved. Path kernel and decomposition: the same trajectory in memory and on disk,
interleaved, time per recorded step and peak resident memory of the call (above its
start: the in-memory trajectory is resident before the call, the disk one is not).
Split over steps: ``PathKernel(split="steps", n_jobs=2)`` on loky workers reading the
on-disk chunks, against the serial sum.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from benchmarks.bench_training import _fmt, _plain_loop
from skpathkernel import PathKernelMachine
from skpathkernel._estimators._base import make_mlp
from skpathkernel._path._losses import SquaredError
from skpathkernel._path._training import train
from skpathkernel._path._trajectory import SolverSpec
from skpathkernel.kernels import PathKernel

NOTES = (
    "Sizes: P = 295,937 (the issue's P ~ 300k). The first rows use T = 40 to 400 so that "
    "both storages can be timed with interleaved repeats; the 'long path' rows are the "
    "issue's T = 5000 SGD steps (5.5 GiB of chunk files, deleted after each use): "
    "recording against the plain torch loop only (in memory the path would be 5.5 GiB "
    "resident, too much for one process on this shared 24 GiB machine), the path "
    "kernel and the decomposition over all 5000 steps once each, with their peak "
    "memory against the 1 GiB memory_budget. Chunk files of 1 MiB or more are written "
    "with O_DIRECT, so they are not in the page cache: every sweep reads them from the "
    "disk, the next chunk read ahead on a thread. The cores are shared with other jobs "
    "(load averages above): two workers have two idle cores only when the load is "
    "below 1."
)

N_TRAIN, BATCH, D_IN, HIDDEN = 1024, 128, 64, (512, 512)
STEPS_PER_EPOCH = math.ceil(N_TRAIN / BATCH)


def _data():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(N_TRAIN, D_IN)).astype(np.float32)
    return X, np.tanh(X[:, 0]) + 0.1 * X[:, 1]


def _probe():
    from benchmarks._serve import PeakRSS

    # Freed memory back to the system first, so that the peak above the entry level is
    # this call's, not a reuse of pages an earlier call left in the allocator.
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return PeakRSS()


def _plain(module, X, Y, solver, epochs, gen):
    # The baseline of the training benchmark: the same optimizer as the recorded loop.
    _plain_loop(module, X, Y, solver, 1e-3, BATCH, epochs, gen)


def _recorded(storage):
    def loop(module, X, Y, solver, epochs, gen):
        return train(module, X, Y, loss=SquaredError(), solver=solver, learning_rate=1e-3,
                     batch_size=BATCH, max_iter=epochs, shuffle=True, generator=gen,
                     record_every=1, storage=storage).trajectory
    return loop


def _interleaved(loops, base, Xt, Yt, solver, epochs, repeats):
    """Times of each training loop, repeats interleaved, and each one's peak memory."""
    times, peaks = {k: [] for k in loops}, {}
    for loop in loops.values():  # one-time costs (thread pools, lazy imports) first
        loop(copy.deepcopy(base), Xt, Yt, solver, 1, torch.Generator().manual_seed(0))
    for rep in range(repeats):
        for label, loop in loops.items():
            module = copy.deepcopy(base)
            gen = torch.Generator().manual_seed(0)
            with _probe() if rep == 0 else contextlib.nullcontext() as mem:
                start = time.perf_counter()
                out = loop(module, Xt, Yt, solver, epochs, gen)
                times[label].append(time.perf_counter() - start)
            if rep == 0:
                peaks[label] = mem.delta
            directory = getattr(out, "directory", None)
            del out
            gc.collect()
            # A recording's files go with it: the next one never finds the disk fuller.
            assert directory is None or not os.path.exists(directory)
    return times, peaks


def recording_rows(epochs, repeats):
    rows = []
    X, y = _data()
    Xt, Yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.float32)).reshape(-1, 1)
    for solver_name in ("sgd", "adam"):
        torch.manual_seed(0)
        base = make_mlp(D_IN, 1, HIDDEN, "tanh")
        solver = SolverSpec(name=solver_name)
        loops = {"plain": _plain, "memory": _recorded("memory"), "disk": _recorded("disk")}
        times, peaks = _interleaved(loops, base, Xt, Yt, solver, epochs, repeats)
        plain = np.median(times["plain"])
        rows.append({
            "row": f"recording, {solver_name}, {epochs * STEPS_PER_EPOCH} steps",
            "plain torch s": _fmt(times["plain"]),
            "memory s": _fmt(times["memory"]),
            "disk s": _fmt(times["disk"]),
            "memory / plain": round(float(np.median(times["memory"]) / plain), 3),
            "disk / plain": round(float(np.median(times["disk"]) / plain), 3),
            "peak MiB plain / memory / disk": " / ".join(
                f"{peaks[k] / 2**20:.0f}" for k in loops),
        })
    return rows


def _fit(solver, epochs, storage):
    X, y = _data()
    return PathKernelMachine(hidden_layer_sizes=HIDDEN, activation="tanh", solver=solver,
                             learning_rate_init=1e-3, batch_size=BATCH, max_iter=epochs,
                             tol=None, record_every=1, normalize_y=False, device="cpu",
                             trajectory_storage=storage, random_state=0).fit(X, y), X


def _timed(call, repeats_out, peaks_out, label, rep):
    with _probe() if rep == 0 else contextlib.nullcontext() as mem:
        start = time.perf_counter()
        out = call()
        repeats_out[label].append(time.perf_counter() - start)
    if rep == 0:
        peaks_out[label] = mem.delta
    return out


def kernel_rows(solver, epochs, n_queries, repeats, decompose_queries):
    mem, X = _fit(solver, epochs, "memory")
    disk, _ = _fit(solver, epochs, "disk")
    T = disk.trajectory_.n_steps
    Xq = X[:n_queries]
    times, peaks, outs = {"memory": [], "disk": []}, {}, {}
    for rep in range(repeats):
        for label, est in (("memory", mem), ("disk", disk)):
            for series in disk.trajectory_._store.series.values():
                series.forget()  # every sweep reads the files
            outs[label] = _timed(lambda e=est: PathKernel(e)(Xq), times, peaks, label, rep)
    err = float(np.abs(outs["disk"] - outs["memory"]).max() / np.abs(outs["memory"]).max())
    rows = [{
        "row": f"path kernel, {solver}, N = {n_queries}, T = {T}",
        "memory s/step": f"{np.median(times['memory']) / T * 1e3:.1f} ms",
        "disk s/step": f"{np.median(times['disk']) / T * 1e3:.1f} ms",
        "disk / memory": round(float(np.median(times["disk"]) / np.median(times["memory"])),
                               3),
        "peak MiB of the call memory / disk": f"{peaks['memory'] / 2**20:.0f} / "
                                              f"{peaks['disk'] / 2**20:.0f}",
        "trajectory MiB (resident in memory)": f"{disk.trajectory_.nbytes / 2**20:.0f}",
        "max rel. difference": f"{err:.1e}",
    }]
    if decompose_queries:
        times, peaks, outs = {"memory": [], "disk": []}, {}, {}
        for rep in range(max(1, repeats - 1)):
            for label, est in (("memory", mem), ("disk", disk)):
                outs[label] = _timed(lambda e=est: e.decompose(X[:decompose_queries]), times,
                                     peaks, label, rep)
        rows.append({
            "row": f"decomposition, {solver}, {decompose_queries} queries, T = {T}",
            "memory s/step": f"{np.median(times['memory']) / T * 1e3:.1f} ms",
            "disk s/step": f"{np.median(times['disk']) / T * 1e3:.1f} ms",
            "disk / memory": round(float(np.median(times["disk"])
                                         / np.median(times["memory"])), 3),
            "peak MiB of the call memory / disk": f"{peaks['memory'] / 2**20:.0f} / "
                                                  f"{peaks['disk'] / 2**20:.0f}",
            "trajectory MiB (resident in memory)": f"{disk.trajectory_.nbytes / 2**20:.0f}",
            "max rel. difference": f"error {outs['disk'].error:.1e} / "
                                   f"{outs['memory'].error:.1e}",
        })
    return rows


def peak_rows(solver, epoch_list, n_queries):
    """Peak memory of the on-disk path kernel as T grows: flat."""
    rows = []
    for epochs in epoch_list:
        disk, X = _fit(solver, epochs, "disk")
        gc.collect()
        with _probe() as mem:
            start = time.perf_counter()
            PathKernel(disk)(X[:n_queries])
            elapsed = time.perf_counter() - start
        T = disk.trajectory_.n_steps
        rows.append({
            "row": f"peak memory vs T, path kernel on disk, {solver}, N = {n_queries}",
            "T": T,
            "disk s/step": f"{elapsed / T * 1e3:.1f} ms",
            "peak MiB of the call memory / disk": f"- / {mem.delta / 2**20:.0f}",
            "trajectory MiB (resident in memory)": f"{disk.trajectory_.nbytes / 2**20:.0f}",
        })
        del disk
        gc.collect()
    return rows


def _whole_kernel(estimator, X):
    # A loky task: the serial path kernel, the whole path, in a worker process.
    return PathKernel(estimator)(X)


def split_rows(solver, epochs, n_queries, repeats):
    """Split over steps on two loky workers, and what two cores give at best right now.

    The ceiling: two whole serial calls at once on the two workers take ``t2`` where one
    alone takes ``t1``; ``2 t1 / t2`` is the speedup two equal halves could reach on the
    cores as the other jobs leave them (2 on two idle cores).
    """
    import joblib

    disk, X = _fit(solver, epochs, "disk")
    T = disk.trajectory_.n_steps
    Xq = X[:n_queries]
    reader = disk.network_.for_workers()  # pickles a reference to the on-disk path
    times = {"serial": [], "2 workers": [], "2 copies at once": []}
    outs = {}
    with joblib.parallel_config(backend="loky", n_jobs=2):  # start the workers once
        PathKernel(disk, split="steps")(Xq[:2])
    for _ in range(repeats):
        for label in times:
            start = time.perf_counter()
            if label == "serial":
                outs[label] = PathKernel(disk)(Xq)
            elif label == "2 workers":
                with joblib.parallel_config(backend="loky", n_jobs=2):
                    outs[label] = PathKernel(disk, split="steps")(Xq)
            else:
                joblib.Parallel(n_jobs=2, backend="loky")(
                    joblib.delayed(_whole_kernel)(reader, Xq) for _ in range(2))
            times[label].append(time.perf_counter() - start)
    err = float(np.abs(outs["2 workers"] - outs["serial"]).max()
                / np.abs(outs["serial"]).max())
    serial = np.median(times["serial"])
    return [{
        "row": f"path kernel split over steps, {solver}, N = {n_queries}, T = {T}",
        "serial s": _fmt(times["serial"]),
        "2 loky workers s": _fmt(times["2 workers"]),
        "speedup": round(float(serial / np.median(times["2 workers"])), 2),
        "ceiling: 2 serial calls at once s": _fmt(times["2 copies at once"]),
        "ceiling speedup": round(float(2 * serial / np.median(times["2 copies at once"])),
                                 2),
        "max rel. difference": f"{err:.1e}",
    }]


def long_rows(solver, epochs, n_queries, decompose_queries, repeats):
    """The issue's row: T = 5000 recorded steps on disk (6 GB for SGD), against plain torch.

    In memory the same path would be 5.5 GiB resident, more than one process should take
    on this shared 24 GiB machine, so recording is compared with the plain loop only.
    Each recording's directory is deleted before the next one is written.
    """
    free = shutil.disk_usage(tempfile.gettempdir()).free
    need = 2.5 * epochs * STEPS_PER_EPOCH * 295_937 * 4
    if free < need:
        return [{"row": f"long path, {solver}: skipped, {free / 2**30:.0f} GiB free on the "
                        f"temporary disk, {need / 2**30:.0f} GiB needed"}]
    X, y = _data()
    Xt, Yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.float32)).reshape(-1, 1)
    torch.manual_seed(0)
    base = make_mlp(D_IN, 1, HIDDEN, "tanh")
    spec = SolverSpec(name=solver)
    loops = {"plain": _plain, "disk": _recorded("disk")}
    times, peaks = _interleaved(loops, base, Xt, Yt, spec, epochs, repeats)
    T = epochs * STEPS_PER_EPOCH
    rows = [{
        "row": f"long path: recording, {solver}, {T} steps (in memory: not run, "
               f"{T * 295_937 * 4 / 2**30:.1f} GiB)",
        "plain torch s": _fmt(times["plain"]),
        "disk s": _fmt(times["disk"]),
        "disk / plain": round(float(np.median(times["disk"]) / np.median(times["plain"])), 3),
        "peak MiB plain / memory / disk": f"{peaks['plain'] / 2**20:.0f} / - / "
                                          f"{peaks['disk'] / 2**20:.0f}",
    }]
    disk, X = _fit(solver, epochs, "disk")
    directory = disk.trajectory_.directory
    size = disk.trajectory_.nbytes
    calls = {f"path kernel, N = {n_queries}": lambda e=disk: PathKernel(e)(X[:n_queries]),
             f"decomposition, {decompose_queries} queries":
                 lambda e=disk: e.decompose(X[:decompose_queries])}
    for label, call in calls.items():
        for series in disk.trajectory_._store.series.values():
            series.forget()
        with _probe() as mem:
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
        rows.append({
            "row": f"long path: {label}, {solver}, T = {T}, on disk (budget 1024 MiB)",
            "disk s/step": f"{elapsed / T * 1e3:.1f} ms",
            "peak MiB of the call memory / disk": f"- / {mem.delta / 2**20:.0f}",
            "trajectory MiB (resident in memory)": f"{size / 2**20:.0f}",
            "T": T,
        })
    del disk, calls, call, series
    gc.collect()
    assert not os.path.exists(directory)
    return rows


def partial_fit_rows(n_calls: int, repeats: int) -> list[dict]:
    """``partial_fit`` on a stream of digits, path on disk against in memory.

    The default classifier (after StandardScaler) fed scikit-learn's digits in
    ``n_calls`` chunks; the two streams run call by call in this process, each call timed
    in CPU time of the whole process (the writer thread's file writes count) on one torch
    thread and in wall time. Per call the least of ``repeats`` streams; the ratio is of
    the sums over the stream.
    """
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    chunks = np.array_split(np.arange(len(X)), n_calls)
    cpu = {s: np.full(n_calls, np.inf) for s in ("memory", "disk")}
    wall = {s: np.full(n_calls, np.inf) for s in ("memory", "disk")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            ests = {s: PathKernelClassifier(random_state=0, trajectory_storage=s)
                    for s in cpu}
            for i, rows in enumerate(chunks):
                for s, est in ests.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    est.partial_fit(X[rows], y[rows], classes=np.arange(10))
                    cpu[s][i] = min(cpu[s][i], time.process_time() - c0)
                    wall[s][i] = min(wall[s][i], time.perf_counter() - w0)
            n_steps = ests["disk"].trajectory_.n_steps
            del ests
            gc.collect()
    finally:
        torch.set_num_threads(threads)
    out = []
    for what, t in (("CPU", cpu), ("wall", wall)):
        out.append({
            "row": f"partial_fit, digits in {n_calls} calls ({n_steps} steps), {what} time",
            "memory s/call": f"{t['memory'].mean() * 1e3:.1f} ms",
            "disk s/call": f"{t['disk'].mean() * 1e3:.1f} ms",
            "disk / memory": f"{t['disk'].sum() / t['memory'].sum():.2f}x",
            "last call disk / memory": f"{t['disk'][-1] / t['memory'][-1]:.2f}x",
        })
    return out


def run(quick: bool = False) -> list[dict]:
    reps = 2 if quick else 3
    ep = 5 if quick else 25  # 40 or 200 steps
    rows = recording_rows(ep, reps + 2)  # short calls: more repeats against the noise
    rows += kernel_rows("sgd", ep, 64, reps, decompose_queries=4)
    rows += kernel_rows("adam", 2 if quick else 6, 64, reps, decompose_queries=0)
    rows += peak_rows("sgd", (2, 10) if quick else (5, 25, 50), 64)  # T = 40 .. 400
    rows += split_rows("sgd", ep, 256, reps + 2)
    rows += partial_fit_rows(18, reps + 2)
    if not quick:  # the size: P = 296k, T = 5000 steps, 5.5 GiB on disk
        rows += long_rows("sgd", 625, 64, 4, 3)
    return rows

