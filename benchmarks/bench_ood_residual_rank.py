"""OODRankDetector(method="residual") at large rank: fit and score times, peak memory.

Compares this checkout's package with copies of earlier ones, each renamed (its
imports are relative) and put in a folder given by ``--compare NAME=FOLDER`` (the
folder holds the package ``NAME``), e.g. for commit 4a46127::

    git archive 4a46127 skpathkernel | tar -x -C /tmp/a && mv /tmp/a/skpathkernel /tmp/a/skpk_old
    python benchmarks/bench_ood_residual_rank.py --compare skpk_old=/tmp/a

Times: one process, the packages alternating within each repeat, one thread; the
least of the repeats. Memory: the peak resident set growth during the detector's fit,
each package in a fresh subprocess (Linux: the peak ``VmHWM`` is reset after the
network's fit through ``/proc/self/clear_refs``).
"""

import argparse
import importlib
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.frozen import FrozenEstimator

# (name, N, d, hidden units, budget): the first two at full rank r = N (8705
# parameters), by the QR's path (default budget) and by the leverages' (the factor in
# half of a tight budget).
CASES = [
    ("full rank, QR", 2000, 32, 256, None),
    ("full rank, leverages", 2000, 32, 256, 16 * 2000 * 2000 + 2**20),
    ("N=6000", 6000, 10, 128, None),
    ("N=3000", 3000, 10, 37, None),
]


def _data(N, d, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(N, d))
    return X, np.sin(X.sum(1)), rng.normal(size=(1000, d))


def _network(pk, N, d, H, budget):
    X, y, _ = _data(N, d)
    kw = {} if budget is None else {"memory_budget": budget}
    return pk.PathKernelMachine(
        hidden_layer_sizes=(H,),
        max_iter=1,
        activation="tanh",
        solver="adam",
        tol=None,
        dtype="float64",
        random_state=0,
        **kw,
    ).fit(X, y)


def _detector(pk, net, X):
    return pk.OODRankDetector(FrozenEstimator(net), method="residual").fit(X)


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def memory(name, case):
    """Peak RSS growth (MiB) of one fit, in this (fresh) process."""
    _, N, d, H, budget = CASES[case]
    pk = importlib.import_module(name)
    X, _, _ = _data(N, d)
    net = _network(pk, N, d, H, budget)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set to the current one
    base = _status("VmHWM")
    det = _detector(pk, net, X)
    peak = _status("VmHWM")
    print(f"{peak - base:.0f} {det.rank_}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    names, path = [], [os.getcwd()]
    for spec in args.compare:
        name, folder = spec.split("=")
        names.append(name)
        path.append(folder)
    names.append("skpathkernel")
    os.environ["PYTHONPATH"] = os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = path
    if args.memory:
        return memory(args.memory[0], int(args.memory[1]))
    pks = {name: importlib.import_module(name) for name in names}
    print(f"load average at start: {os.getloadavg()[0]:.2f}; one thread")
    for case, (label, N, d, H, budget) in enumerate(CASES):
        X, _, fresh = _data(N, d)
        nets = {name: _network(pk, N, d, H, budget) for name, pk in pks.items()}
        fit = {name: [] for name in names}
        score = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, pk in pks.items():
                t0 = time.perf_counter()
                det = _detector(pk, nets[name], X)
                t1 = time.perf_counter()
                det.score_samples(fresh)
                fit[name].append(t1 - t0)
                score[name].append(time.perf_counter() - t1)
        rss = {}
        for name in names:
            out = subprocess.run(
                [sys.executable, __file__, "--memory", name, str(case)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            rss[name] = out[0]
        print(
            f"\n{label}: N={N}, rank {det.rank_}, budget "
            f"{'default' if budget is None else f'{budget / 2**20:.0f} MiB'}, "
            f"load {os.getloadavg()[0]:.2f}"
        )
        ref = names[0]
        for name in names:
            print(
                f"  {name:14s} fit {min(fit[name]):6.2f} s (median "
                f"{np.median(fit[name]):6.2f}, {min(fit[name]) / min(fit[ref]):.2f}x "
                f"{ref}'s)  score 1000 {min(score[name]):6.3f} s (median "
                f"{np.median(score[name]):6.3f}, "
                f"{min(score[name]) / min(score[ref]):.2f}x)  peak RSS growth "
                f"{rss[name]} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
