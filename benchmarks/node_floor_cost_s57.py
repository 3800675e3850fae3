"""CPU time of decompose (exact, float32) with the node choice's round-off rule (this
commit) against another commit's ``_decomposition.py`` (OLD.py), in one process,
alternated, medians, on paths whose node counts it changes (the default paths of
``roundoff_model_cost_s56.py`` keep theirs). Run pinned:

OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/node_floor_cost_s57.py OLD.py [rounds]
(results: benchmarks/results/node_floor-s57.md)
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import roundoff_model_cost_s56
from audit_contribution_roundoff import _full_batch_adam

from skpathkernel import PathKernelMachine

torch.set_num_threads(1)


def cases():
    est, Xa, ya, Xq = _full_batch_adam(2)
    yield ("converged full-batch Adam (gelu 8x8, 20 points, 200 it), seed 2, 2 random queries",
           est, (Xa, ya, Xq))
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(24, 3))
    y = np.sin(X @ np.array([1.0, -2.0, 0.5]))
    yield ("Adam (64, 64), 120 steps, every step, memory_budget 1 MiB, query 1 alone",
           PathKernelMachine(hidden_layer_sizes=(64, 64), solver="adam", max_iter=120,
                             learning_rate_init=1e-3, tol=None, record_every=1,
                             memory_budget=2**20, random_state=0), (X, y, X[1:2]))


if __name__ == "__main__":
    roundoff_model_cost_s56.main(*sys.argv[1:], cases=cases)
