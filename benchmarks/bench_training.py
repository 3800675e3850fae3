"""Training with path recording versus the same plain torch loop without it.

Both loops run the same module, optimizer, batches and loss; the only difference is the
recorder (a copy of the parameters, and of the optimizer state, per step). Reported as the
ratio recorded / plain, measured interleaved in one run.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time

import numpy as np
import torch

from skpathkernel._estimators._base import make_mlp
from skpathkernel._path._losses import SquaredError
from skpathkernel._path._training import make_optimizer, train
from skpathkernel._path._trajectory import SolverSpec

CASES = [
    # name, layer sizes, n_samples, batch_size, solver, epochs (full, quick)
    ("2-64-64-1 full-batch sgd", (2, [64, 64], 1), 400, None, "sgd", (300, 100)),
    ("2-64-64-1 batch 32 adam", (2, [64, 64], 1), 400, 32, "adam", (30, 10)),
    ("64-512-512-1 batch 128 sgd", (64, [512, 512], 1), 1024, 128, "sgd", (4, 2)),
    ("64-512-512-1 batch 128 adam", (64, [512, 512], 1), 1024, 128, "adam", (4, 2)),
]


def _plain_loop(module, X, Y, solver, lr, batch_size, epochs, generator):
    loss = SquaredError()
    opt = make_optimizer(list(module.parameters()), solver, lr)
    n = X.shape[0]
    B = n if batch_size is None else batch_size
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if B < n else torch.arange(n)
        for b in range(math.ceil(n / B)):
            idx = order[b * B : (b + 1) * B]
            opt.zero_grad(set_to_none=True)
            loss(module(X[idx]), Y[idx]).backward()
            opt.step()


def _recorded_loop(module, X, Y, solver, lr, batch_size, epochs, generator):
    train(module, X, Y, loss=SquaredError(), solver=solver, learning_rate=lr,
          batch_size=batch_size, max_iter=epochs, shuffle=True, generator=generator,
          record_every=1)


def _probe(device):
    """Peak-memory probe of the device: RSS sampler on the CPU, CUDA allocator stats."""
    if device.type == "cuda":
        from benchmarks._worker import CudaPeak

        return CudaPeak(device)
    from benchmarks._serve import PeakRSS

    return PeakRSS()


def run(quick: bool = False, repeats: int | None = None, device: str = "cpu") -> list[dict]:
    repeats = repeats or (3 if quick else 5)
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name, (d_in, hidden, d_out), n, batch, solver_name, epochs in CASES:
        epochs = epochs[1] if quick else epochs[0]
        torch.manual_seed(0)
        base = make_mlp(d_in, d_out, hidden, "tanh")
        X = torch.randn(n, d_in)
        Y = torch.randn(n, d_out)
        base, X, Y = base.to(device), X.to(device), Y.to(device)
        peaks = {}
        solver = SolverSpec(name=solver_name)
        times = {"plain": [], "recorded": []}
        for rep in range(repeats):
            for label, loop in (("plain", _plain_loop), ("recorded", _recorded_loop)):
                module = copy.deepcopy(base)
                gen = torch.Generator().manual_seed(0)
                # The first repeat also measures the peak memory (the sampler's overhead
                # lands in one repeat of each method, alike).
                with _probe(device) if rep == 0 else contextlib.nullcontext() as mem:
                    sync()
                    start = time.perf_counter()
                    loop(module, X, Y, solver, 1e-3, batch, epochs, gen)
                    sync()
                    times[label].append(time.perf_counter() - start)
                if rep == 0:
                    peaks[label] = mem.delta
        plain, rec = np.median(times["plain"]), np.median(times["recorded"])
        rows.append({
            "case": name,
            "epochs": epochs,
            "plain s (median, min-max)": _fmt(times["plain"]),
            "recorded s (median, min-max)": _fmt(times["recorded"]),
            "recorded / plain": round(float(rec / plain), 3),
            "peak memory plain / recorded": f"{peaks['plain'] / 2**20:.1f} / "
                                            f"{peaks['recorded'] / 2**20:.1f} MiB",
        })
    return rows


def _fmt(ts):
    return f"{np.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})"

