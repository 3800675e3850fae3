"""CPU time of decompose (exact, float32, defaults) with the measured round-off
(this commit: a float64 forward of every step's batch for its residuals' round-off)
against another commit's ``_decomposition.py`` (OLD.py: the fixed coefficient), in one
process, alternated, medians. Run pinned:

OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/roundoff_model_cost_s56.py OLD.py [rounds]
(results: benchmarks/results/roundoff_model-s56.md)
"""
import os
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from audit_contribution_roundoff import _full_batch_adam
from contribution_check_overhead import load_old

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition as new

torch.set_num_threads(1)


def cases():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    yield ("digits classifier, defaults, 300 points, 10 ep, 20 queries",
           PathKernelClassifier(max_iter=10, random_state=0), (X[:300], y[:300], X[300:320]))
    Xd, yd = load_diabetes(return_X_y=True)
    yield ("diabetes regressor, defaults, 300 points, 10 ep, 20 queries",
           PathKernelMachine(max_iter=10, random_state=0), (Xd[:300], yd[:300], Xd[300:320]))
    est, Xa, ya, _ = _full_batch_adam(1)
    yield ("converged full-batch Adam (gelu 8x8, 20 points, 200 it), seed 1, 2 training "
           "points as queries", est, (Xa, ya, Xa[:2]))
    yield ("CNN digits, Adam defaults, 10 ep, 20 queries",
           PathKernelClassifier(module=ace.SmallCNN, max_iter=10, random_state=0),
           (X[:300], y[:300], X[300:320]))


def main(old_path, rounds=5, cases=cases):
    old = load_old(old_path)
    print(f"load {open('/proc/loadavg').read().strip()}")
    print("| case | old s | new s | new / old |")
    print("|---|---|---|---|")
    for name, net, _, args in audit_check_rows.fitted(cases()):
        times = []
        for r in range(int(rounds)):
            pair = []
            for module in ((old, new) if r % 2 == 0 else (new, old)):
                t0 = time.process_time()
                module.decompose(*args, memory_budget=net.memory_budget, warn=False)
                pair.append((module is new, time.process_time() - t0))
            times.append(dict(pair))
        a = np.array([t[False] for t in times])
        b = np.array([t[True] for t in times])
        print(f"| {name} | {np.median(a):.3f} | {np.median(b):.3f} | "
              f"{np.median(b / a):.3f} |", flush=True)
    print(f"load {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
