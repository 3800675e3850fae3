"""Memory-budget arithmetic shared by every blocked computation, and the C library's
heap around the sweeps that allocate large temporaries at every step."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["FIXED_BLOCK", "feature_block_rows", "large_tensor", "map_fixed_blocks",
           "retained_heap", "rows_per_block"]


def rows_per_block(memory_budget: int, row_bytes: int, what: str,
                   unit: str = "a single sample") -> int:
    """Rows of a block that take at most ``memory_budget`` bytes at ``row_bytes`` each.

    Refuses, before any work starts, a computation whose single row does not fit: the
    error names the bytes one row needs, "for ``unit``" (what one row stands for, where
    the bytes count more than one sample's).
    """
    row_bytes = max(int(row_bytes), 1)
    if row_bytes > memory_budget:
        raise ValueError(
            f"{what} needs {row_bytes:,} bytes for {unit}, more than "
            f"memory_budget={int(memory_budget):,} bytes. Raise memory_budget to at least "
            f"{row_bytes:,}."
        )
    return max(1, int(memory_budget) // row_bytes)


# The results' dtypes that NumPy holds, with NumPy's name for each.
_NUMPY_DTYPES = {dtype: torch.empty((), dtype=dtype).numpy().dtype
                 for dtype in (torch.float16, torch.float32, torch.float64, torch.complex64,
                               torch.complex128)}


def large_tensor(shape: tuple, dtype: torch.dtype, device: torch.device,
                 zero: bool = False) -> torch.Tensor:
    """A large result of ``shape``: unset, or zeros with ``zero``.

    On the CPU the memory is NumPy's, which asks the kernel for transparent huge pages
    on large arrays: first touching a fresh (256, 256, 10, 10) float64 array costs about
    7 ms there against 25 ms with torch's allocator (a page fault per 4 kB), on the CPUs
    measured. The tensor shares that memory: ``.numpy()`` returns it without a copy.
    """
    np_dtype = _NUMPY_DTYPES.get(dtype)
    # NumPy has no bfloat16 (nor torch's float8 types): torch's allocator holds those.
    if torch.device(device).type != "cpu" or np_dtype is None:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
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


def map_fixed_blocks(fn, X, block: int, fill=None) -> np.ndarray:
    """``fn`` over row blocks of exactly ``block`` rows, concatenated (padding removed).

    ``X`` is a tensor or an array; ``fn`` returns an array with one row per input row.
    ``fill``: the row (of the form ``X[:1]``) that pads a short block; None: its first
    row. A row known to be well-behaved keeps ``fn``'s errors about the rows asked for
    (a kernel's count of non-finite entries counted every copy of an overflowing first
    row).
    """
    # The padding repeats one row as a broadcast view: indexing with a list of row
    # numbers cost more than the 256-row forward of a small network.
    if isinstance(X, torch.Tensor):
        def pad(xb, k):
            row = xb[:1] if fill is None else fill
            return torch.cat([xb, row.expand(k, *xb.shape[1:])])
    else:
        def pad(xb, k):
            row = xb[:1] if fill is None else fill
            return np.concatenate([xb, np.broadcast_to(row, (k, *xb.shape[1:]))])
    # The blocks are written into the result as they come: a list of them concatenated
    # at the end held the result twice (tangent features: the largest array of a call).
    out = None
    for start in range(0, X.shape[0], block):
        xb = X[start : start + block]
        n = xb.shape[0]
        if n < block:
            xb = pad(xb, block - n)
        part = np.asarray(fn(xb))[:n]
        if out is None:
            out = np.empty((X.shape[0], *part.shape[1:]), dtype=part.dtype)
        out[start : start + n] = part
        del part
    return np.concatenate([], axis=0) if out is None else out  # none: numpy's error


# glibc's malloc serves a large block by mmap and hands it back to the kernel when it is
# freed (above M_MMAP_THRESHOLD: 128 KiB at first, raised by glibc's own rule to the size
# of a freed block, up to 32 MiB), and returns the free top of its heap above
# M_TRIM_THRESHOLD (twice that): a step's tensors, allocated again at the next step, then
# fault in every 4 KiB page again, and the kernel zeroes it. A sweep over a recorded path
# allocates the same temporaries at every step (the forward-mode products of a small CNN's
# 100 queries: several (128, 100, 8, 8, 8) float32 tangents, 26 MB each); inside
# retained_heap() freed memory stays in the heap for the next step
# (benchmarks/results/unrolled_heap*.md). Afterwards the thresholds are the highest
# glibc's own rule can reach (the rule cannot be switched back on: this is permanent for
# the process) and the heap's free memory is returned. Below RETAIN_FROM bytes a step (by
# the caller's estimate) it does nothing: glibc's rule keeps up to twice its largest freed
# block by itself.
RETAIN_HEAP = True  # False: leave the C library's heap as it is (the benchmark's A/B)
RETAIN_FROM = 32 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_RETAINED = {_M_MMAP_THRESHOLD: 2**30, _M_TRIM_THRESHOLD: 2**31 - 1}
_RESTORED = {_M_MMAP_THRESHOLD: 32 * 2**20, _M_TRIM_THRESHOLD: 64 * 2**20}
# Environment variables by which a user tunes glibc's malloc, or replaces it.
_USER_MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_MMAP_MAX_")
_heap_lock = threading.Lock()
_heap_depth = 0
_libc = []  # glibc, loaded once, or None


def _glibc_malloc():
    """glibc, where it serves this process's malloc untuned by the user; else None."""
    if not RETAIN_HEAP:
        return None
    if any(name in os.environ for name in _USER_MALLOC) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") \
            or any(lib in os.environ.get("LD_PRELOAD", "")
                   for lib in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    if not _libc:
        libc = None
        if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
                libc.malloc_trim.argtypes = (ctypes.c_size_t,)
            except (OSError, AttributeError):
                libc = None
        _libc.append(libc)
    return _libc[0]


def _set(libc, values: dict) -> None:
    for param, value in values.items():
        # glibc before 2.35 refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2).
        if not libc.mallopt(param, value) and param == _M_MMAP_THRESHOLD:
            libc.mallopt(param, _RESTORED[param])


def _after_fork_in_child() -> None:
    """A child forked inside retained_heap() never leaves it: it starts outside, with a
    lock of its own (another thread may have held the parent's at the fork)."""
    global _heap_depth, _heap_lock
    _heap_lock = threading.Lock()
    if _heap_depth and _libc and _libc[0] is not None:
        _set(_libc[0], _RESTORED)
    _heap_depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def retained_heap(step_bytes: float):
    """Keep freed memory in glibc's heap for the duration (see ``RETAIN_HEAP``), for a
    sweep whose steps allocate about ``step_bytes`` of temporaries each (nothing below
    ``RETAIN_FROM``).

    Process-wide, as malloc's settings are: nested and concurrent uses (threads running
    query blocks) share one, and the last to leave restores the thresholds and returns
    the heap's free memory to the kernel (``malloc_trim``); memory allocated inside and
    freed after that stays in the heap. A thread other than the main one allocates from
    heaps of at most 64 MiB, so its larger blocks are mapped and unmapped as before.
    Elsewhere than under glibc, or where the environment tunes or replaces malloc, it
    does nothing (a ``mallopt`` called from code is not seen, and is overridden).
    """
    global _heap_depth
    libc = _glibc_malloc() if step_bytes >= RETAIN_FROM else None
    if libc is None:
        yield
        return
    with _heap_lock:
        if _heap_depth == 0:
            _set(libc, _RETAINED)
        _heap_depth += 1
    try:
        yield
    finally:
        with _heap_lock:
            _heap_depth -= 1
            if _heap_depth == 0:
                _set(libc, _RESTORED)
                libc.malloc_trim(0)
