"""A/B of the autograd check's rows (session s54), one process, pinned, CPU time.

Variants, switched by replacing ``_capture.check_rows`` (the rows _prepare checks):
old (x0, x1: main before s54), new (the cycle x0, x1, x2, x0), flip (x0, x1, then a second
capture and check of x1, x0: swap.py's prototype), pairs (the cycle's pairs, three
captures and checks of two rows: what wide rows get). Also, as the floor of a check over
a whole block, one forward and backward pass with respect to the parameters over all N
rows. Run: ``taskset -c 0 python benchmarks/trials/reorder_check_s54/ab.py 9``.
"""

import statistics
import sys
import time

import torch
from torch import nn

import skpathkernel._tangent._capture as C
import skpathkernel._tangent._gram as G
from skpathkernel._tangent import tangent_gram
from skpathkernel._tangent._capture import check_rows

torch.set_num_threads(1)
VARIANTS = {"old": lambda X, budget: [X[:2]], "new": check_rows,
            "flip": lambda X, budget: [X[:2], X[[1, 0]]],
            "pairs": lambda X, budget: check_rows(X, 0)}


def mlp():
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 6 * 6, 10))


def block_pass(module, params, X):
    f = torch.func.functional_call(module, params, (X,))
    torch.autograd.grad((f * torch.randn_like(f)).sum(), list(params.values()))


def timed(fn, *args):
    t = time.process_time()
    fn(*args)
    return time.process_time() - t


def main(rounds):
    torch.manual_seed(0)
    for net_name, make, shape in [("mlp", mlp, (32,)), ("cnn", cnn, (3, 16, 16))]:
        module = make()
        params = {k: v.detach() for k, v in module.named_parameters()}
        leaves = {k: v.detach().requires_grad_(True) for k, v in module.named_parameters()}
        for N in (64, 1024):
            X = torch.randn(N, *shape)
            res = {k: [] for k in ("block", *VARIANTS, *(f"p_{v}" for v in VARIANTS))}
            for r in range(rounds + 1):  # round 0 warms up
                for name, rows in VARIANTS.items():
                    C.check_rows = rows
                    t = timed(tangent_gram, module, params, X)
                    p = timed(G._prepare, module, params, X, "trace",
                              G.DEFAULT_MEMORY_BUDGET)
                    if r:
                        res[name].append(t)
                        res[f"p_{name}"].append(p)
                t = timed(block_pass, module, leaves, X)
                if r:
                    res["block"].append(t)
            med = {k: statistics.median(v) for k, v in res.items()}
            ratios = [a / b for a, b in zip(res["new"], res["old"])]
            probe = " ".join(f"{v} {med[f'p_{v}'] * 1e3:.2f}" for v in VARIANTS)
            extra = " ".join(f"{v} {(med[f'p_{v}'] - med['p_old']) / med['old']:+.4f}"
                             for v in VARIANTS if v != "old")
            print(f"{net_name} N={N}: call old {med['old'] * 1e3:.1f} ms, new/old "
                  f"{med['new'] / med['old']:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f});"
                  f" probe+check ms: {probe}; extra probe time / old call: {extra}; "
                  f"block pass / old call {med['block'] / med['old']:.3f}", flush=True)
    C.check_rows = check_rows


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
