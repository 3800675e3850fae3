"""The node choice on a synthetic step (``_Quadrature.choose`` alone), this commit against
another commit's ``_decomposition.py`` (OLD.py): 8 float32 steps of equal share (tol
1e-6, S = 1), whose rule of n nodes misses by a quadrature error ``A eps32 rho^(n-1)``
plus a round-off ``R eps32``, the terms' 2-norm falling as 1/sqrt(n); with ``learnt``,
the first step walked is pure round-off (10 eps32, flat) and raises the floor the others
assume. Per row: the steps that neither got their nodes (the error under the budget or
4 eps * spread) nor are measured (the two rules' difference at least the error of the
rule with a node more, which is returned), the worst difference / error among steps
short of their nodes, and the nodes evaluated over all tries.

Run: python benchmarks/node_probe_model_s58.py OLD.py
(results: benchmarks/results/node_probe-s58.md)
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from contribution_check_overhead import load_old

from skpathkernel._analysis import _decomposition as new

EPS = float(torch.finfo(torch.float32).eps)


def run(module, rho, A, R, learnt, n_steps=8):
    quad = module._Quadrature(n_steps, tol=1e-6, n_nodes=None, changes=np.ones(n_steps),
                              scale=1.0, dtype=torch.float32)

    def error(n):
        return EPS * A * rho ** (n - 1)

    evaluated = 0
    for t in reversed(range(n_steps)):
        flat = learnt and t == n_steps - 1

        def evaluate(n, flat=flat):
            nonlocal evaluated
            evaluated += n
            r = 10 * EPS if flat else error(n) + R * EPS
            return (torch.full((1, 1), r, dtype=torch.float64),
                    torch.full((1, 1), n ** -0.5, dtype=torch.float64), n)

        quad.choose(t, evaluate, torch.zeros(1, 1, dtype=torch.float64), 0.0)
    bad, worst = 0, math.inf
    for t in range(n_steps - learnt):
        n = int(quad.n_used[t])
        if error(n) <= max(quad.budgets[t], 4 * EPS / math.sqrt(n)):
            continue
        ratio = (error(n) - error(n + 1)) / error(n + 1)
        bad += ratio < 1 - 1e-9
        worst = min(worst, ratio)
    return bad, worst, evaluated, int(quad.n_used.max())


def main(old_path):
    old = load_old(old_path)
    print("| learnt floor | A | R | rho | old: short & under-read, min diff/err, nodes "
          "evaluated, max | new: the same |")
    print("|---|---|---|---|---|---|")
    for learnt, A in ((True, 30), (False, 60), (False, 90)):
        for R in (0.0, 0.3):
            for rho in (0.3, 0.5, 0.7, 0.85, 0.9):
                row = [str(learnt), str(A), str(R), str(rho)]
                for module in (old, new):
                    bad, worst, evaluated, top = run(module, rho, A, R, learnt)
                    row.append(f"{bad}, {worst:.3g}, {evaluated}, {top}")
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
