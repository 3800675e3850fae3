"""Independent references shared by the tests: plain per-sample autograd loops.

Nothing here uses skpathkernel's engine: every Jacobian is one ``torch.autograd.grad`` call
per sample and output, the slow and obviously correct way.
"""

import copy

import numpy as np
import torch


def module_at(est, point=-1, dtype=torch.float64):
    """A copy of ``est.module_`` holding the parameters of recorded point ``point``."""
    module = copy.deepcopy(est.module_).to(dtype)
    module.load_state_dict(est.trajectory_.state_dict(point), strict=False)
    return module


def jacobian_loop(module, X):
    """(n, C, P) Jacobian, columns in ``module.parameters()`` (trajectory) order."""
    params = [p for p in module.parameters() if p.requires_grad]
    dtype = params[0].dtype
    rows = []
    X = torch.as_tensor(np.asarray(X))
    # Integer token ids stay integers (an embedding indexes with them).
    for x in X.to(dtype) if X.is_floating_point() else X:
        out = module(x[None]).reshape(-1)
        rows.append(torch.stack([
            # An unused parameter (a bias a patched forward leaves out) has zero gradient.
            torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                       for p, g in zip(params, torch.autograd.grad(
                           out[c], params, retain_graph=True, allow_unused=True))])
            for c in range(out.shape[0])
        ]))
    return torch.stack(rows).detach()


def features_loop(module, X):
    """phi(x) as ``transform`` defines it: the flattened Jacobian / sqrt(C), NumPy."""
    J = jacobian_loop(module, X)
    return (J.reshape(J.shape[0], -1) / np.sqrt(J.shape[1])).numpy()
