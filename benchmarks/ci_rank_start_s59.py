"""What a test_distributed rank costs to start and run, spawned or forked from a forkserver.

One process, alternated rounds: each round starts one rank of tests/_ddp_worker.py (world
1, gloo, the "ok" scenario: six recorded DDP steps) by ``spawn`` and by the test's
forkserver context. The rank reports its own CPU time at its end (a process's CPU time
starts at zero, at the fork), and this process the wall time from ``start()`` to
``join()``. Run pinned: ``taskset -c 0 python benchmarks/ci_rank_start_s59.py``.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _ddp_worker as worker
import test_distributed


def rank(out, port):
    worker.main(0, 1, port, out, "ok")
    with open(os.path.join(out, "cpu.json"), "w") as f:
        json.dump(time.process_time(), f)


def one(context):
    out = tempfile.mkdtemp()
    start = time.perf_counter()
    p = context.Process(target=rank, args=(out, test_distributed._free_port()))
    p.start()
    p.join()
    wall = time.perf_counter() - start
    with open(os.path.join(out, "cpu.json")) as f:
        return wall, json.load(f)


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with open("/proc/loadavg") as f:
        print("load before:", f.read().split()[:3])
    start = time.perf_counter()
    forkserver = test_distributed._context()
    one(forkserver)  # the server's start, once per pytest-xdist worker
    print(f"forkserver start + first rank: {time.perf_counter() - start:.2f} s wall")
    spawn = test_distributed.mp.get_context("spawn")
    times = {"spawn": [], "forkserver": []}
    for _ in range(rounds):
        for name, context in (("spawn", spawn), ("forkserver", forkserver)):
            times[name].append(one(context))
    for name, rows in times.items():
        walls, cpus = zip(*rows)
        print(f"{name:10s} wall median {statistics.median(walls):6.2f} s (least "
              f"{min(walls):.2f}), rank CPU median {statistics.median(cpus):6.2f} s "
              f"(least {min(cpus):.2f})")
    with open("/proc/loadavg") as f:
        print("load after:", f.read().split()[:3])
