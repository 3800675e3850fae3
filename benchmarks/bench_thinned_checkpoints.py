"""A long interval's replay checkpointed within ``memory_budget`` against the replay
that holds the whole interval.

An MLP 20-200-200-1 (44,601 float64 parameters, 0.36 MB a vector) trained with Adam on
64 random samples, batches of 32, 256 epochs (512 optimizer steps) recorded every 256
steps; ``decompose(X[:2])``. The replay holds whole intervals (``REPLAY_SHARE`` patched
to leave the budget unread: the replay before checkpointing) or checkpoints them within
a quarter of ``memory_budget=BUDGET``. In a fresh process per mode: the peak resident
memory a call adds over the process's before it (``/proc/self/statm`` sampled every
2 ms) and the most (P,) vectors the replay held at once (its intervals, checkpoints and
pieces, read after every point or state it gives); then both modes alternating ``REPS``
times in one process, timed by ``time.process_time`` on one torch thread, and whether
their contributions are equal to the last bit; the vectors held at
``memory_budget=2**24``, below the least checkpointing.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_thinned_checkpoints
[BUDGET_LOG2] [REPS]``. Writes ``benchmarks/results/thinned_checkpoints.md``.
"""

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_thinned_decompose import _peak
from skpathkernel import PathKernelMachine
from skpathkernel._analysis import _decomposition

ROOT = Path(__file__).resolve().parent.parent


def _fit():
    rng = np.random.RandomState(0)
    X = rng.standard_normal((64, 20))
    y = np.sin(X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(200, 200), solver="adam", batch_size=32,
                            max_iter=256, tol=None, dtype="float64", record_every=256,
                            random_state=0).fit(X, y)
    return est, X


def _call(est, X, budget, bounded):
    est.memory_budget = budget
    share = _decomposition.REPLAY_SHARE
    _decomposition.REPLAY_SHARE = share if bounded else 1e-300
    try:
        return est.decompose(X[:2])
    finally:
        _decomposition.REPLAY_SHARE = share


def held_vectors(path, n_params: int) -> int:
    """The distinct (P,) vectors an :class:`EveryStep` holds now: its intervals,
    checkpoints and pieces (tensors sharing a storage counted once)."""
    seen: set[int] = set()

    def visit(x):
        if isinstance(x, torch.Tensor):
            if x.shape == (n_params,):
                seen.add(x.untyped_storage().data_ptr())
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit([path._kept, path._marks, path._pieces])
    return len(seen)


def _held(est, X, budget, bounded):
    """The most (P,) vectors the replay held, and its checkpoints' spacing."""
    P, held, paths = est.trajectory_.n_params, [0], []
    cls = _decomposition.EveryStep
    init, reads = cls.__init__, (cls._params_at, cls._state_at)

    def tracked(self, *args):
        paths.append(self)
        init(self, *args)

    def counted(read):
        def counting(self, t):
            out = read(self, t)
            held[0] = max(held[0], held_vectors(self, P))
            return out
        return counting

    cls.__init__ = tracked
    cls._params_at, cls._state_at = counted(reads[0]), counted(reads[1])
    try:
        _call(est, X, budget, bounded)
    finally:
        cls.__init__ = init
        cls._params_at, cls._state_at = reads
    return held[0], paths[-1]._every


def _child(budget, bounded):
    torch.set_num_threads(1)
    est, X = _fit()
    _call(est, X, budget, bounded)  # warm
    peak = _peak(lambda: _call(est, X, budget, bounded))
    held, every = _held(est, X, budget, bounded)
    print(peak, held, every)


def main(log2=28, reps=3):
    budget = 2**log2
    torch.set_num_threads(1)
    measures = {}
    for bounded in (False, True):
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_thinned_checkpoints",
                              "--child", str(budget), str(int(bounded))],
                             capture_output=True, text=True, cwd=ROOT, check=True)
        peak, held, every = out.stdout.split()[-3:]
        measures[bounded] = int(peak), int(held), every
    est, X = _fit()
    small = _held(est, X, 2**24, True)  # below the least checkpointing
    times = {False: [], True: []}
    res = {}
    for _ in range(reps):
        for bounded in (False, True):
            start = time.process_time()
            res[bounded] = _call(est, X, budget, bounded)
            times[bounded].append(time.process_time() - start)
    same = np.array_equal(res[True].contributions, res[False].contributions)
    vector = est.trajectory_.n_params * 8 / 1e6
    base = statistics.median(times[False])
    rows = []
    for bounded, name in ((False, "whole intervals (before)"), (True, "checkpointed")):
        peak, held, every = measures[bounded]
        med = statistics.median(times[bounded])
        rows.append(f"| {name} | {every} | {held} | {held * vector:.1f} | {peak / 1e6:.1f} "
                    f"| {min(times[bounded]):.2f} | {med:.2f} | {med / base:.2f} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    lines = [
        "# A thinned path's replay checkpointed within memory_budget", "",
        "- command: `OMP_NUM_THREADS=1 taskset -c 1 python -m "
        f"benchmarks.bench_thinned_checkpoints {log2} {reps}`",
        f"- commit: {commit} (working tree)",
        f"- date: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC",
        f"- machine: {platform.machine()}, load {os.getloadavg()[0]:.2f} at the end",
        f"- case: MLP 20-200-200-1, Adam, float64 ({est.trajectory_.n_params:,} "
        f"parameters, {vector:.2f} MB a vector), 64 samples, batch 32, 512 steps recorded "
        f"every 256; decompose(X[:2]), memory_budget=2**{log2} ({budget:,} bytes; the "
        "replay's share a quarter)", "",
        "Peak: what a second call adds to the resident set, in a fresh process per mode; "
        "held: the most (P,) vectors the replay's intervals, checkpoints and pieces held "
        "at once. Times: `time.process_time`, one torch thread, the modes alternating "
        f"{reps} times in one process.", "",
        "| replay | steps between checkpoints | vectors held | held (MB) | peak added (MB) "
        "| least (s) | median (s) | median / before |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"Contributions of the two modes equal to the last bit: {same}.", "",
        f"memory_budget=2**24 (a quarter holds {2**22 // (est.trajectory_.n_params * 8)} "
        f"vectors, below the least checkpointing): {small[0]} vectors held, "
        f"{small[1]} steps between checkpoints (the pieces that hold the least).", ""]
    text = "\n".join(lines)
    (ROOT / "benchmarks" / "results" / "thinned_checkpoints.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(int(sys.argv[2]), bool(int(sys.argv[3])))
    else:
        main(*(int(a) for a in sys.argv[1:]))
