"""Seeded random (Johnson-Lindenstrauss) projection of tangent features, never forming them.

For a parameter with factors ``delta`` (per output, ``p``) and ``a`` (``q``), its block of
the tangent features is ``vec(delta) (x) a``. Projecting it on a Kronecker-structured
Gaussian direction ``u (x) v`` (``u ~ N(0, I_p)``, ``v ~ N(0, I_q)``, independent) costs
``O(p + q)`` per sample and component instead of ``O(p q)``:

    z_k(x) = (delta(x) . u_k) (a(x) . v_k) / sqrt(k),

and ``E[(u (x) v)(u (x) v)^T] = I``, so ``E[z(x) . z(x')] = K(x, x')`` exactly (the variance
is somewhat larger than a dense Gaussian's; it still decays as ``1 / k``). A weight applied
at ``S`` positions (convolutions, sequences) projects each position's outer product and
sums, ``z_k(x) = sum_s (delta_s . u_k) (a_s . v_k)``: ``O(S (p + q))`` instead of forming
the ``p x q`` block; groups (block-diagonal weights) draw ``u`` over all of ``p`` and share
``v`` between them, which keeps ``E[(u (x) v)(u (x) v)^T] = I`` on the blocks. Parameters with
no factor structure (a bias, the generic fallback) are projected by dense Gaussian
matrices drawn in fixed-size column chunks, so memory stays bounded and the numbers do not
depend on the memory budget.

The random directions depend only on ``random_state``, the parameter's index in the flat
order, and its shape: they are drawn on the CPU (the same on every device).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ._capture import value_dtype
from ._contract import project_bytes, project_term
from ._gram import DEFAULT_MEMORY_BUDGET, _block_size, _Blocks, _consistent_routing, _prepare

__all__ = ["project_tangent_features"]

_DENSE_CHUNK = 2**14  # columns of a dense Gaussian block; fixed, so draws never change


def _generator(seed: int, *key: int) -> torch.Generator:
    mixed = seed
    for k in key:
        mixed = (mixed * 1_000_003 + k + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def _gaussian(gen: torch.Generator, shape, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(like.device, like.dtype)


def _dense_project(U: torch.Tensor, seed: int, key: tuple[int, ...], k: int) -> torch.Tensor:
    """``U (n, r) @ G^T`` with a Gaussian ``G (k, r)`` drawn chunk by chunk over columns."""
    out = None
    for c, start in enumerate(range(0, U.shape[1], _DENSE_CHUNK)):
        cols = U[:, start : start + _DENSE_CHUNK]
        G = _gaussian(_generator(seed, *key, c), (k, cols.shape[1]), U)
        part = cols @ G.T
        out = part if out is None else out.add_(part)
    return out


@_consistent_routing
def project_tangent_features(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    n_components: int,
    *,
    random_state: int | None = None,
    output: str | int = "trace",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    exclude: frozenset[str] = frozenset(),
    check_hidden: bool = True,
) -> torch.Tensor:
    """Random projection ``z`` of the tangent features with ``E[z(x) . z(x')] = K(x, x')``.

    Parameters
    ----------
    module, params, X, output, memory_budget
        As in :func:`tangent_features`.
    n_components : int
        Number of random components ``k``.
    random_state : int or None, default=None
        Seed of the random directions; ``None`` draws a fresh seed from torch's global RNG.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the generic fallback. Layers with a parameter
        read outside their own call are found by every capture and added to these.
    check_hidden : bool, default=True
        Run the autograd check of a few samples (:func:`._capture.check_rows`) for
        reads that torch functions do not see (TorchScript, C++ extensions) and for a
        forward pass that reorders the samples before a rule layer. A caller evaluating
        many points of one path runs it once with :func:`~._gram.hidden_reads` and passes
        the result as ``exclude``.

    Returns
    -------
    z : torch.Tensor of shape (n_samples, n_components), or (n_samples, C, n_components)
        for ``output="full"`` (the same directions for every output, so that
        ``z_c(x) . z_c'(x')`` estimates the ``(c, c')`` kernel block). For "trace" the
        direction also draws a Gaussian weight per output, and ``z`` is divided by
        ``sqrt(C)``, so that ``z . z'`` estimates ``trace(J J'^T) / C``.

    Notes
    -----
    The structured directions ``U (k, C p)`` and ``V (k, q)`` of every rule layer are
    drawn once and kept across row blocks: ``k * sum_l (C d_out + d_in)`` numbers, on top
    of the blocks' budget (16 MiB per 512 x 512 layer at ``k = 4096`` in float32).
    """
    k = int(n_components)
    if k < 1:
        raise ValueError(f"n_components must be a positive integer, got {n_components!r}.")
    if random_state is None:
        random_state = int(torch.randint(0, 2**62, (1,)).item())
    seed = int(random_state)
    params, outputs, mode, probe = _prepare(module, params, X, output, memory_budget, exclude,
                                            check_hidden)
    index = {name: i for i, name in enumerate(params)}
    n_out = len(outputs)
    dtype = value_dtype(params, X)
    itemsize = dtype.itemsize
    # "full" projects every output's delta with the same u; "trace" draws u over (C, p).
    width = 1 if mode == "full" else n_out
    per_row = probe.capture_bytes() + 2 * n_out * k * itemsize + max(
        [project_bytes(t, k, width, itemsize) for t in probe.terms], default=0)
    size = _block_size(X.shape[0], memory_budget, per_row)
    blocks = _Blocks(module, params, X, size, outputs, memory_budget, keep=False,
                     exclude=probe.exclude)
    z = torch.zeros((X.shape[0], n_out if mode == "full" else 1, k),
                    dtype=dtype, device=X.device)
    directions: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(len(blocks)):
        sl = blocks.slices[i]
        for term in blocks[i].terms:
            n, C, _, p = term.delta.shape
            for name, a in term.inputs:
                key = (index[name],)
                if a is None:
                    # Constant inputs have one position (the capture sums the others).
                    delta = term.delta[:, :, 0].reshape(n * C // width, width * p)
                    proj = _dense_project(delta, seed, key, k)
                else:
                    if name not in directions:
                        groups = 1 if term.transposed else term.groups
                        gen = _generator(seed, *key)
                        # An index term's V has a column per row of its table.
                        q = term.rows if term.rows is not None else a.shape[2] // groups
                        directions[name] = (_gaussian(gen, (k, width * p), term.delta),
                                            _gaussian(gen, (k, q), term.delta))
                    U, V = directions[name]
                    proj = project_term(term, a, U, V, width)
                z[sl] += proj.reshape(n, -1, k)
    z /= math.sqrt(k * (n_out if mode == "trace" else 1))
    return z if mode == "full" else z[:, 0, :]
