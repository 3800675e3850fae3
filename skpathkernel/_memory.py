"""Memory-budget arithmetic shared by every blocked computation."""

from __future__ import annotations

__all__ = ["rows_per_block"]


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
