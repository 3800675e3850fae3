"""Generic fallback: per-sample Jacobians with torch.func, for layers without a rule.

Only the fallback parameters are differentiated (the others are held fixed), over a
chunk of samples at a time so that the Jacobian chunk stays under the memory budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.func import functional_call, jacrev, vmap

from .._memory import rows_per_block

__all__ = ["per_sample_jacobian"]


def per_sample_jacobian(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    names: Sequence[str],
    outputs: Sequence[int],
    *,
    memory_budget: int,
) -> dict[str, torch.Tensor]:
    """Per-sample Jacobians of the selected outputs with respect to ``names``.

    Returns a dict ``name -> (n_samples, len(outputs), numel)``. Samples are processed in
    chunks of rows such that the Jacobian chunk (with a factor 4 for jacrev's
    intermediates) fits in ``memory_budget`` bytes.
    """
    names = list(names)
    fixed = {k: v.detach() for k, v in params.items() if k not in set(names)}
    free = {k: params[k].detach() for k in names}
    index = torch.as_tensor(list(outputs), device=X.device)

    def f_single(free_params, x):
        out = functional_call(module, {**fixed, **free_params}, (x.unsqueeze(0),))
        return out.reshape(-1).index_select(0, index)

    jac = vmap(jacrev(f_single), in_dims=(None, 0))
    n_free = sum(v.numel() for v in free.values())
    # The Jacobian has the parameters' dtype (X may hold integer token ids).
    row_bytes = 4 * len(index) * n_free * free[names[0]].element_size() + 1
    chunk = rows_per_block(memory_budget, row_bytes, "A per-sample Jacobian of the fallback layers")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for start in range(0, X.shape[0], chunk):
        xb = X[start : start + chunk]
        out = jac(free, xb)
        for k in names:
            parts[k].append(out[k].reshape(xb.shape[0], len(index), -1).detach())
    return {k: torch.cat(v, dim=0) for k, v in parts.items()}
