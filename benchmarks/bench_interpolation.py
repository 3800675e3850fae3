"""Exact decomposition of 100 queries versus the training time of the path it decomposes.

The goal (issue 4) is <= 5x the training time on the CPU for the MLPs of the kernel
benchmark. Each row trains once (timed) and decomposes once (timed), interleaved repeats.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from skpathkernel import PathKernelMachine

CASES = [
    # name, hidden, n_train, batch, solver, momentum, epochs (full, quick)
    ("64-512-512-1 sgd full-batch", (512, 512), 1024, None, "sgd", 0.0, (20, 5)),
    ("64-512-512-1 sgd batch 128", (512, 512), 1024, 128, "sgd", 0.0, (2, 1)),
    ("64-512-512-1 sgd+momentum batch 128", (512, 512), 1024, 128, "sgd", 0.9, (2, 1)),
    ("64-512-512-1 adam batch 128", (512, 512), 1024, 128, "adam", 0.0, (2, 1)),
    ("2-64-64-1 adam batch 32", (64, 64), 400, 32, "adam", 0.0, (10, 3)),
]


def run(quick: bool = False, repeats: int = 3, n_queries: int = 100,
        device: str = "cpu") -> list[dict]:
    from benchmarks.bench_training import _probe

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # A throwaway fit and decomposition first: the first call in a process pays one-time
    # costs (thread pools, lazy imports) that belong to neither column.
    warm = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=2, tol=None, random_state=0)
    warm.fit(np.zeros((4, 2)), np.zeros(4)).decompose(np.zeros((1, 2)))
    rows = []
    for name, hidden, n, batch, solver, momentum, epochs in CASES:
        epochs = epochs[1] if quick else epochs[0]
        rng = np.random.RandomState(0)
        d_in = 2 if hidden == (64, 64) else 64
        X = rng.normal(size=(n, d_in)).astype(np.float32)
        y = np.tanh(X[:, 0]) + 0.1 * X[:, 1]
        est = PathKernelMachine(hidden_layer_sizes=hidden, solver=solver, momentum=momentum,
                                learning_rate_init=1e-3, batch_size=batch, max_iter=epochs,
                                activation="tanh", tol=None, record_every=1,
                                normalize_y=False, device=device, random_state=0)
        t_train, t_dec, errors = [], [], []
        for rep in range(1 if quick else repeats):
            start = time.perf_counter()
            est.fit(X, y)
            t_train.append(time.perf_counter() - start)
            # fit and decompose return host arrays: no device sync needed around them.
            with _probe(torch.device(device)) as mem:
                start = time.perf_counter()
                res = est.decompose(X[:n_queries])
                t_dec.append(time.perf_counter() - start)
            if rep == 0:
                peak = mem.delta
            errors.append(res.error)
        rows.append({
            "case": name,
            "steps": est.t_,
            "train s": f"{np.median(t_train):.2f}",
            f"decompose {n_queries} s": f"{np.median(t_dec):.2f}",
            "decompose / train": round(float(np.median(t_dec) / np.median(t_train)), 1),
            "max error": f"{max(errors):.1e}",
            "peak memory of decompose": f"{peak / 2**20:.1f} MiB",
        })
    return rows


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(row)
