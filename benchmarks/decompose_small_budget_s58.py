"""torch's CPU peak of a small float32 exact decompose against memory_budget, or the
refusal's least budget: a 32-32-2 tanh MLP (P = 1,122) after two epochs of batches of 50
of 200 samples (SGD with its default momentum, or Adam), the float64 residual pass on or
switched off. Run with PYTHONPATH at the tree to measure (an extracted old tree for the
before):

PYTHONPATH=. python benchmarks/decompose_small_budget_s58.py sgd on 30 120000 150000 200000
(results: benchmarks/results/decompose_small_budget-s58.md)
"""
import sys
import warnings

import numpy as np
import torch

from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel import PathKernelMachine
from skpathkernel._analysis import _decomposition


def small_path(solver, n_queries):
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(200, 32))
    Y = np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 0]]
    est = PathKernelMachine(hidden_layer_sizes=(32,), solver=solver,
                            learning_rate_init=0.01, max_iter=2, batch_size=50,
                            dtype="float32", normalize_y=False, tol=None,
                            activation="tanh", random_state=0).fit(X, Y)
    return est, rng.uniform(-1, 1, size=(n_queries, 32))


def main(solver, on, n_queries, budgets):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if on == "off":
        _decomposition._residuals_in_float64 = lambda *a: False
    est, Xq = small_path(solver, n_queries)
    for budget in budgets:
        est.set_params(memory_budget=budget)
        try:
            est.decompose(Xq[:2])
            _, p = cpu_peak_bytes(lambda: est.decompose(Xq))
        except ValueError as e:
            print(budget, "refused", str(e).split("least ")[-1], flush=True)
            continue
        print(budget, p, round(p / budget, 3), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(float(b)) for b in sys.argv[4:]])
