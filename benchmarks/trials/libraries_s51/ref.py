"""Independent references: per-sample autograd on a fresh copy at trajectory.state_dict(k).

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

import copy
import warnings

import torch


def jacobian(module, state, X):
    """(n, C, P) per-sample Jacobians by one autograd.grad per sample and output."""
    m = copy.deepcopy(module)
    m.load_state_dict(state, strict=False)
    names = list(state)
    params = dict(m.named_parameters())
    ps = [params[k] for k in names]
    rows = []
    for i in range(X.shape[0]):
        out = m(X[i : i + 1]).reshape(-1)
        rows.append(
            torch.stack(
                [
                    torch.cat(
                        [
                            g.reshape(-1)
                            for g in torch.autograd.grad(
                                out[c], ps, retain_graph=True, allow_unused=False
                            )
                        ]
                    )
                    for c in range(out.numel())
                ]
            )
        )
    return torch.stack(rows)


def full(J, J2=None):
    J2 = J if J2 is None else J2
    return torch.einsum("ncp,mdp->nmcd", J, J2)


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max())


def reported(title, fn):
    """Print ``fn()``'s result or error and the warnings it gave (not torch 2.14's import
    warning of an unpatched skpathkernel)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            print(f"== {title}: OK {fn()!r}"[:700])
        except Exception as e:
            print(f"== {title}: {type(e).__name__}: {e}"[:1200])
    for w in caught:
        if "torch 2.14" not in str(w.message):
            print(f"   warn {w.category.__name__}: {str(w.message)[:600]}")
