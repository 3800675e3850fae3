# ruff: noqa
"""Review of a864b1c (s52): adversarial scratch script, see benchmarks/results/review-rules-s52.md (run with PYTHONPATH at the repository root)."""

import torch
from torch.func import functional_call


def loop_jac(module, params, X):
    """(n, C, P) per-sample Jacobian by a plain autograd loop, one sample at a time."""
    names = list(params)
    rows = []
    for i in range(X.shape[0]):
        live = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        f = functional_call(module, live, (X[i : i + 1].clone(),)).reshape(-1)
        per_c = []
        for c in range(f.shape[0]):
            g = torch.autograd.grad(
                f[c], [live[k] for k in names], retain_graph=True, allow_unused=True
            )
            per_c.append(
                torch.cat(
                    [
                        (torch.zeros_like(live[k]) if gg is None else gg).reshape(-1)
                        for k, gg in zip(names, g)
                    ]
                )
            )
        rows.append(torch.stack(per_c))
    return torch.stack(rows)


def full_gram(J):
    return torch.einsum("ncp,mdp->ncmd", J, J)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())
