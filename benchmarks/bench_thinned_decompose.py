"""The exact decomposition of a thinned path (its unrecorded steps replayed) against the
same training recorded at every step.

The default Adam classifier (float32) on 500 standardised digits, batches of 50, 10
epochs (100 optimizer steps), fitted twice with the same seed: ``record_every=1`` and
``record_every=K`` (default 5). ``decompose(X[:Q])`` (method "exact", all ten outputs)
of each path, the two alternating ``REPS`` times (default 5) in one process, timed by
``time.process_time`` on one torch thread; then, in a fresh process per path, the peak
resident memory a second call adds over the process's before it (``/proc/self/statm``
sampled every 2 ms) and the most the replay held at once (its kept intervals and the
first moments' checkpoints), and the largest difference of the two splits'
contributions relative to the largest.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_thinned_decompose
[K] [Q] [REPS]``. Writes ``benchmarks/results/thinned_decompose.md``.
"""

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

from skpathkernel import PathKernelClassifier
from skpathkernel._analysis import _decomposition

ROOT = Path(__file__).resolve().parent.parent


def _fit(every):
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:500]
    est = PathKernelClassifier(solver="adam", batch_size=50, max_iter=10, tol=None,
                               record_every=every, random_state=0).fit(X, y[:500])
    return est, X


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak(call) -> int:
    """The peak resident memory ``call()`` adds, sampled every 2 ms."""
    before, peak, done = _rss(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        call()
    finally:
        done.set()
        thread.join()
    return max(peak[0], _rss()) - before


def _held(view) -> int:
    """Bytes of the distinct storages the replay holds: its kept intervals, the moments'
    checkpoints and segment, the moment carried to the next interval."""
    replay = view.replay
    return _decomposition._nbytes([
        list(view._kept.values()),
        [] if replay._moments is None else [m for m in replay._moments[1].values()
                                            if m is not None],
        [m for m in replay._segment.values() if m is not None],
        [] if view._carry is None or view._carry[1] is None else [view._carry[1]]])


def memory(every, Q):
    """Print the peak resident memory a second call adds, and the most the replay held
    (0 for a path recorded at every step)."""
    torch.set_num_threads(1)
    est, X = _fit(every)
    est.decompose(X[:Q])  # lazily built state first
    held, interval = [0], _decomposition.EveryStep._interval

    def counting(self, j):
        out = interval(self, j)
        held[0] = max(held[0], _held(self))
        return out

    _decomposition.EveryStep._interval = counting
    print(_peak(lambda: est.decompose(X[:Q])), held[0])


def main(K=5, Q=10, reps=5):
    torch.set_num_threads(1)
    (every, X), (thinned, _) = _fit(1), _fit(K)
    assert len(thinned.trajectory_) < len(every.trajectory_)
    times, out = {"every step": [], f"every {K}": []}, {}
    for _ in range(reps):
        for name, est in (("every step", every), (f"every {K}", thinned)):
            t0 = time.process_time()
            out[name] = est.decompose(X[:Q])
            times[name].append(time.process_time() - t0)
    ref = out["every step"].contributions
    diff = float(np.abs(out[f"every {K}"].contributions - ref).max() / np.abs(ref).max())
    peaks = {}
    for name, k in (("every step", 1), (f"every {K}", K)):
        run = subprocess.run([sys.executable, "-m", "benchmarks.bench_thinned_decompose",
                              "--memory", str(k), str(Q)], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        peaks[name] = [int(v) for v in run.stdout.split()[-2:]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    lines = [
        "# Exact decomposition of a thinned path (replayed) against the every-step path", "",
        f"- command: `OMP_NUM_THREADS=1 taskset -c 1 python -m "
        f"benchmarks.bench_thinned_decompose {K} {Q} {reps}`",
        f"- commit: {commit} (working tree)", f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {platform.processor() or platform.machine()}, "
        f"load {os.getloadavg()[0]:.2f} at the end",
        f"- case: default Adam classifier (float32), 500 standardised digits, batch 50, "
        f"{every.trajectory_.n_steps} steps; decompose(X[:{Q}]), method='exact', ten "
        "outputs", "",
        "`time.process_time` per call, one torch thread, the two paths alternating; "
        "peak memory: what a second call adds to the resident set, in a fresh process "
        "per path.", "",
        "| path | points | least (s) | median (s) | median / every step's | "
        "peak added (MB) | held by the replay (MB) | replay_error | error |",
        "|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(times["every step"])
    for name, est in (("every step", every), (f"every {K}", thinned)):
        res = out[name]
        lines.append(
            f"| {name} | {len(est.trajectory_)} | {min(times[name]):.3f} | "
            f"{statistics.median(times[name]):.3f} | "
            f"{statistics.median(times[name]) / base:.2f} | {peaks[name][0] / 1e6:.1f} | "
            f"{peaks[name][1] / 1e6:.2f} | "
            f"{'-' if res.replay_error is None else f'{res.replay_error:.1e}'} | "
            f"{res.error:.1e} |")
    P = every.trajectory_.n_params
    lines += ["", f"Contributions of the two splits: largest difference {diff:.1e} of the "
              f"largest contribution. One parameter vector: {P} float32 values, "
              f"{4 * P / 1e6:.3f} MB. The resident set's peak moves by a few MB from run "
              "to run (the allocator's reuse); what the replay held is exact.", ""]
    text = "\n".join(lines)
    (ROOT / "benchmarks" / "results" / "thinned_decompose.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:
        memory(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(*(int(a) for a in sys.argv[1:]))
