"""Memory-budget arithmetic shared by every blocked computation."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["FIXED_BLOCK", "feature_block_rows", "large_tensor", "map_fixed_blocks",
           "rows_per_block"]


def rows_per_block(memory_budget: int, row_bytes: int, what: str) -> int:
    """Rows of a block that take at most ``memory_budget`` bytes at ``row_bytes`` each.

    Refuses, before any work starts, a computation whose single row does not fit: the
    error names the bytes one row needs.
    """
    row_bytes = max(int(row_bytes), 1)
    if row_bytes > memory_budget:
        raise ValueError(
            f"{what} needs {row_bytes:,} bytes for a single sample, more than "
            f"memory_budget={int(memory_budget):,} bytes. Raise memory_budget to at least "
            f"{row_bytes:,}."
        )
    return max(1, int(memory_budget) // row_bytes)


def large_tensor(shape: tuple, dtype: torch.dtype, device: torch.device,
                 zero: bool = False) -> torch.Tensor:
    """A large result of ``shape``: unset, or zeros with ``zero``.

    On the CPU the memory is NumPy's, which asks the kernel for transparent huge pages
    on large arrays: first touching a fresh (256, 256, 10, 10) float64 array costs about
    7 ms there against 25 ms with torch's allocator (a page fault per 4 kB), on the CPUs
    measured. The tensor shares that memory: ``.numpy()`` returns it without a copy.
    """
    if torch.device(device).type != "cpu":
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy((np.zeros if zero else np.empty)(shape, dtype=np_dtype))


# Rows of one block of a prediction or of tangent features. Every block is this size (the
# last one padded by repeating its first row), so a row's float32 result never depends on
# which other rows were passed with it: GEMM kernels round differently for different row
# counts, and scikit-learn expects predict(X[i:i+1]) == predict(X)[i] (1e-7 absolute).
# A smaller block for small inputs would undo that: on the CPUs measured, the rows of a
# 1- or 2-row product differ from the same rows of a 256-row one (by 2e-8), and which
# row counts agree is the BLAS's choice (cuBLAS picks its algorithms by shape). A 1-row
# predict of the default network thus costs a 256-row forward: 0.59 ms against 0.41 ms
# unpadded, most of it validation.
FIXED_BLOCK = 256


def feature_block_rows(memory_budget: int, row_bytes: int, what: str) -> int:
    """Rows of a fixed-size block: ``FIXED_BLOCK``, fewer when the budget needs it."""
    return min(FIXED_BLOCK, rows_per_block(memory_budget, row_bytes, what))


def map_fixed_blocks(fn, X, block: int) -> np.ndarray:
    """``fn`` over row blocks of exactly ``block`` rows, concatenated (padding removed).

    ``X`` is a tensor or an array; ``fn`` returns an array with one row per input row.
    """
    # The padding repeats the block's first row as a broadcast view: indexing with a list
    # of row numbers cost more than the 256-row forward of a small network.
    if isinstance(X, torch.Tensor):
        def pad(xb, k):
            return torch.cat([xb, xb[:1].expand(k, *xb.shape[1:])])
    else:
        def pad(xb, k):
            return np.concatenate([xb, np.broadcast_to(xb[:1], (k, *xb.shape[1:]))])
    outs = []
    for start in range(0, X.shape[0], block):
        xb = X[start : start + block]
        n = xb.shape[0]
        if n < block:
            xb = pad(xb, block - n)
        outs.append(fn(xb)[:n])
    return np.concatenate(outs, axis=0)
