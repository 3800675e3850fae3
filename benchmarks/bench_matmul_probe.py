"""How steady the Gram benchmark's GEMM probe is on this machine.

The roofline ratio of a Gram row divides the row's FLOPs by a torch.matmul rate measured
in the same run (since 2026-12-06 :func:`benchmarks._worker._gemm_probe`, timed beside
every call of the row; when this script was written, a probe timed apart, which is what
it compares). This script measures that rate
on the CIFAR CNN's probe shape (1024 x 65536 x 1024, float32, one thread) in several
rounds, two ways: the worker's (median of 5 wall-clock repeats, a fresh result each
time) and the path benchmark's (least of the repeats' CPU times into one preallocated
result). Usage: ``taskset -c 0 python -m benchmarks.bench_matmul_probe [ROUNDS] [OUT.md]``.
"""

import datetime
import os
import statistics
import subprocess
import sys
import time

import torch


def _rates(a, b, out, repeats=5):
    """(median wall rate with fresh results, least-CPU-time rate into ``out``)."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    wall = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        wall.append(time.perf_counter() - t0)
    cpu = []
    for _ in range(repeats):
        t0 = time.process_time()
        torch.matmul(a, b, out=out)
        cpu.append(time.process_time() - t0)
    return flops / statistics.median(wall) / 1e9, flops / min(cpu) / 1e9


def main(rounds=4, path=None):
    torch.set_num_threads(1)
    n, width = 1024, 65536
    a, b = torch.randn(n, width), torch.randn(width, n)
    out = a @ b
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for r in range(rounds):
        load = os.getloadavg()[0]
        fresh, kept = _rates(a, b, out)
        rows.append(f"| {r + 1} | {fresh:.1f} | {kept:.1f} | {load:.2f} |")
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    text = "\n".join([
        "# The Gram benchmark's GEMM probe, round after round",
        "",
        f"- Command: `python -m benchmarks.bench_matmul_probe {' '.join(sys.argv[1:])}`",
        f"- Commit: {commit}; date {now:%Y-%m-%d %H:%M} UTC;"
        f" torch {torch.__version__}, one thread; CPU affinity {sorted(os.sched_getaffinity(0))}",
        "",
        "torch.matmul on 1024 x 65536 x 1024 (float32), GFLOP/s. *fresh, median*: the Gram"
        " benchmark's probe (median of 5 wall-clock repeats, a new result each time);"
        " *kept, least*: least CPU time of 5 repeats into one preallocated result.",
        "",
        "| round | fresh, median | kept, least | load (1 min) |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    if path:
        with open(path, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, sys.argv[2] if len(sys.argv) > 2 else None)
