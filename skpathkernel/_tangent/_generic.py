"""Generic fallback: per-sample Jacobians with torch.func, for layers without a rule.

Only the fallback parameters are differentiated (the others are held fixed), over a
chunk of samples at a time so that the Jacobian chunk stays under the memory budget.
Where ``vmap`` cannot batch an operation of the network (an embedding's in-place
``max_norm`` renormalisation; ``prelu``'s backward on 3-D inputs, torch 2.13), the chunk
is differentiated one sample and output at a time by plain autograd instead: the same
numbers, slower, rather than a functorch error.

``vmap`` can also be silently wrong: torch 2.13's batching of ``prelu``'s backward, for a
chunk with as many rows as outputs, returns every entry off the diagonal of (row, output)
wrong by tens of percent. So every chunk's first row is checked against plain autograd
(one backward per output for one sample, a small share of the chunk's cost): on a
mismatch the call warns and differentiates the rest by the loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch.func import jacrev, vmap

from .._checkpoint import functional_call
from .._device import forward_input
from .._memory import rows_per_block
from ._saved import differentiable_forward

__all__ = ["per_sample_jacobian", "strided"]


_UNBATCHED = "There is a performance drop because we have not yet implemented the batching"


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
    fixed, free, index, jac = _batched_jacobian(module, params, X, names, outputs)
    batched = True
    n_free = sum(v.numel() for v in free.values())
    # The Jacobian has the parameters' dtype (X may hold integer token ids); beside it,
    # the chunk's copy of its rows (forward_input).
    row_bytes = (4 * len(index) * n_free * free[names[0]].element_size()
                 + X[:1].numel() * X.element_size() + 1)
    chunk = rows_per_block(memory_budget, row_bytes, "A per-sample Jacobian of the fallback layers")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for start in range(0, X.shape[0], chunk):
        xb = X[start : start + chunk]
        out = None
        if batched:
            try:
                out = _run_batched(jac, free, xb)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                # An operation vmap does not batch: a genuine error of the network raises
                # again from the loop, with the network's own traceback.
                batched = False
        if out is not None and not _agrees(out, _looped(module, fixed, free, xb[:1], index)):
            warnings.warn(
                "torch.func's per-sample Jacobian of the fallback layers disagrees with "
                "plain autograd on a sample (a batching bug of torch.func for an operation "
                "of this network): these layers are differentiated one sample at a time "
                "instead (exact, slower).", UserWarning, stacklevel=2)
            batched, out = False, None
        if out is None:
            out = _looped(module, fixed, free, xb, index)
        for k in names:
            parts[k].append(out[k].reshape(xb.shape[0], len(index), -1).detach())
    return {k: torch.cat(v, dim=0) for k, v in parts.items()}


def _batched_jacobian(module, params, X, names, outputs):
    """The fixed and free parameters, the outputs' index and ``vmap(jacrev(f_single))``,
    ``f_single`` the outputs of one sample as a function of the free parameters."""
    fixed = {k: v.detach() for k, v in params.items() if k not in set(names)}
    free = {k: params[k].detach() for k in names}
    index = torch.as_tensor(list(outputs), device=X.device)

    def f_single(free_params, x):
        out = functional_call(module, {**fixed, **free_params}, (x.unsqueeze(0),))
        return out.reshape(-1).index_select(0, index)

    return fixed, free, index, vmap(jacrev(f_single), in_dims=(None, 0))


def _run_batched(jac, free, xb):
    with warnings.catch_warnings():
        # torch.func's note that an operation (weight_norm's backward, say) runs unbatched
        # inside vmap: one per operation and chunk wherever warnings are recorded or shown
        # "always" (pytest: 48 for a decompose and a Gram of a small weight_norm network).
        # The fallback's cost is reported once, by layer_routes and the fit's warning.
        warnings.filterwarnings("ignore", _UNBATCHED, UserWarning)
        # A copy: a module writing into its input would rewrite X's rows.
        return jac(free, forward_input(xb))


# How torch's CPU allocator says it is out of memory (a RuntimeError, not torch's
# OutOfMemoryError).
_ALLOCATION = "can't allocate memory"


def unbatched(module, params, X, names, outputs) -> str | None:
    """None where ``torch.func`` batches the per-sample Jacobian of ``names`` over the
    first two samples of ``X``, else the first line of its error: the fallback then
    differentiates one sample and output at a time (a backward pass of the whole network
    each), whatever its layers' share of the parameters. A Hugging Face model's forward
    branches on its mask's values, which ``vmap`` refuses."""
    # One output: whether vmap batches the forward does not depend on how many outputs
    # are differentiated, and the probe's Jacobian (2 x outputs x the fallback's
    # parameters, outside any memory budget) took 2.6 GB more for a 0.26M-parameter
    # fallback under 1000 outputs; a CPU allocation that fails is a RuntimeError too.
    *_, free, _, jac = _batched_jacobian(module, params, X, list(names), list(outputs)[:1])
    try:
        _run_batched(jac, free, X[:2])
    except torch.OutOfMemoryError:
        return None  # a chunk's question, not batching's
    except RuntimeError as error:
        if _ALLOCATION in str(error):
            return None  # the CPU's out-of-memory error: not batching's either
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return None


def _looped(module, fixed, free, X, index) -> dict[str, torch.Tensor]:
    """``vmap(jacrev(f_single))(free, X)`` by one autograd pass per sample and output.

    Clones of the free parameters are differentiated, so that an operation writing into
    its parameter (``F.embedding``'s ``max_norm``) leaves the caller's tensors alone.
    """
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in free}
    for x in X:
        live = {k: v.clone().requires_grad_(True) for k, v in free.items()}
        with torch.enable_grad():
            # Contiguous: torch 2.13's CPU conv2d backward gives a grouped channels_last
            # weight a wrong gradient for one sample sliced from a channels_last batch
            # (strides (4, 1, 28, 4)), 8.6 off on a 4-channel example; the forward is right.
            # A copy (a module may write into its input), contiguous.
            # Its saved tensors copy-on-write where an in-place op rewrites one (vmap
            # refuses such a network, and so does plain autograd).
            out = differentiable_forward(lambda x=x, live=live: functional_call(
                module, {**fixed, **live},
                (x.unsqueeze(0).clone(memory_format=torch.contiguous_format),)))
            out = out.reshape(-1).index_select(0, index)
            # Parameters the forward never reads (a module it does not call) have a zero
            # Jacobian, and then the output has no graph at all.
            per_output = [torch.autograd.grad(out[c], list(live.values()),
                                              retain_graph=c < len(index) - 1,
                                              allow_unused=True)
                          if out.requires_grad else [None] * len(live)
                          for c in range(len(index))]
        for j, (k, p) in enumerate(live.items()):
            rows[k].append(torch.stack([torch.zeros_like(p) if g[j] is None else strided(g[j])
                                        for g in per_output]))
    return {k: torch.stack(v) for k, v in rows.items()}


def strided(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` as a dense tensor: autograd hands an embedding's ``sparse=True`` gradient as a
    sparse COO tensor, which cannot be reshaped or stacked with dense ones."""
    return g if g is None or g.layout == torch.strided else g.to_dense()


def _agrees(batched: dict[str, torch.Tensor], first: dict[str, torch.Tensor]) -> bool:
    """Whether the batched Jacobian's first row equals the loop's (``first``, one row),
    to the tolerance of the rules' own autograd check (10 sqrt(eps) of the row's scale)."""
    got = torch.cat([batched[k][:1].reshape(-1) for k in first])
    ref = torch.cat([v.reshape(-1) for v in first.values()])
    scale = ref.abs().max()
    tol = 10 * torch.finfo(ref.dtype).eps ** 0.5
    return bool((got - ref).abs().max() <= tol * scale) if scale > 0 else bool(
        got.abs().max() <= tol)
