"""``output="full"`` against the trace, in one process: the cost of the ``C x C`` blocks.

The goal (issue 31): the full kernel at most ``C`` times the trace's time. Each case
times the trace and the full kernel of the same network on the same inputs, alternating,
and reports the least CPU time (``time.process_time``, one torch thread) of ``--repeats``
rounds, so that other processes on shared cores do not enter the ratio. Usage::

    python -m benchmarks.bench_full_kernel [--quick] [--repeats 3]

writes ``benchmarks/results/full_kernel.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler
from torch import nn

from skpathkernel import PathKernelClassifier, kernels
from skpathkernel.kernels import PathKernel, TangentKernel

RESULTS = Path(__file__).parent / "results"


def _cnn(n_features_in, n_outputs):
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 64, n_outputs))


def _cases(quick: bool):
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    # (N, N, 10, 10) float64 blocks: 200 MB at N = 512.
    n = 256 if quick else 512
    n_cnn = 128 if quick else 256
    n_path = 128 if quick else 256
    common = dict(max_iter=3, tol=None, random_state=0, batch_size=128)
    mlp = PathKernelClassifier(hidden_layer_sizes=(256, 256), **common).fit(X[:n], y[:n])
    cnn = PathKernelClassifier(module=_cnn, **common).fit(X[:n_cnn], y[:n_cnn])
    adam = PathKernelClassifier(hidden_layer_sizes=(64,), **common).fit(X[:n_path],
                                                                      y[:n_path])
    sgd = PathKernelClassifier(hidden_layer_sizes=(64,), solver="sgd", **common).fit(
        X[:n_path], y[:n_path])
    stop = 6
    sizes = (64, 128) if quick else (128, 256, 512)
    sgd_rows = [
        (f"path (SGD, {stop} points, stacked), MLP 64-64-10, N={k}", 10,
         (lambda k=k: PathKernel(sgd, stop=stop)(X[:k])),
         (lambda k=k: PathKernel(sgd, stop=stop, output="full")(X[:k])), k)
        for k in sizes]
    return [
        (f"tangent, MLP 64-256-256-10, N={n}", 10,
         lambda: TangentKernel(mlp)(X[:n]), lambda: TangentKernel(mlp, output="full")(X[:n]),
         n),
        (f"tangent, CNN conv16-conv32-dense10 on 8x8, N={n_cnn}", 10,
         lambda: TangentKernel(cnn)(X[:n_cnn]),
         lambda: TangentKernel(cnn, output="full")(X[:n_cnn]), n_cnn),
        (f"path (Adam, {stop} points, step by step), MLP 64-64-10, N={n_path}", 10,
         lambda: _step_by_step(lambda: PathKernel(adam, stop=stop)(X[:n_path])),
         lambda: _step_by_step(lambda: PathKernel(adam, stop=stop, output="full")(
             X[:n_path])), n_path),
        (f"path (Adam, {stop} points, stacked), MLP 64-64-10, N={n_path}", 10,
         lambda: PathKernel(adam, stop=stop)(X[:n_path]),
         lambda: PathKernel(adam, stop=stop, output="full")(X[:n_path]), n_path),
    ] + sgd_rows


def _step_by_step(call):
    # The point-by-point route of the general engine (the stacked route off).
    with mock.patch.object(kernels, "_stacked_sum", lambda *a, **k: None):
        return call()


def _cpu(call) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, C, trace, full, n in _cases(args.quick):
        # The floor of any full result: a fresh (N, N, C, C) float64 array written once
        # (NumPy's allocation, huge pages where the kernel gives them).
        write = lambda n=n, C=C: np.ones((n, n, C, C))  # noqa: E731
        times = {"trace": [], "full": [], "write": []}
        for _ in range(args.repeats):  # alternating, so that load hits all alike
            times["trace"].append(_cpu(trace))
            times["full"].append(_cpu(full))
            times["write"].append(_cpu(write))
        t, f, w = min(times["trace"]), min(times["full"]), min(times["write"])
        rows.append(dict(case=name, C=C, trace_s=t, full_s=f, ratio=f / t, write_s=w,
                         write_ratio=w / t, load=os.getloadavg()[0]))
        print(f"{name}: trace {t:.3f}s full {f:.3f}s ratio {f / t:.2f} (C={C}); writing "
              f"the result {w:.3f}s = {w / t:.2f} traces", flush=True)
    suffix = "-quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"full_kernel{suffix}.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# output=\"full\" against the trace",
        "",
        "`python -m benchmarks.bench_full_kernel" + (" --quick" if args.quick else "") + "`:"
        f" least CPU time of {args.repeats} alternating rounds, one torch thread, float32,"
        f" load average {np.mean([r['load'] for r in rows]):.1f} on a shared 2-core"
        " machine. Goal: full at most C times the trace.",
        "",
        "`write`: `np.ones((N, N, C, C))`, a fresh float64 result written once, the"
        " memory-traffic floor of any full kernel.",
        "",
        "| case | C | trace (s) | full (s) | full / trace | write (s) | write / trace |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['case']} | {r['C']} | {r['trace_s']:.3f} | {r['full_s']:.3f} | "
              f"{r['ratio']:.2f} | {r['write_s']:.3f} | {r['write_ratio']:.2f} |"
              for r in rows]
    (RESULTS / f"full_kernel{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
