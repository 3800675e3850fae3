"""Device and dtype handling: the one place where NumPy meets torch."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

__all__ = [
    "resolve_device",
    "resolve_dtype",
    "seeded_torch",
    "to_input_tensor",
    "to_numpy",
    "to_tensor",
    "torch_threads",
]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cuda"`` without CUDA is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was requested but no CUDA device is available to torch "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}). "
            "Use device='auto' or device='cpu'."
        )
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    return _DTYPES[dtype]


def to_tensor(X: np.ndarray, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # torch cannot share read-only memory (e.g. a memmap): np.require copies only then.
    X = np.require(X, requirements=["C_CONTIGUOUS", "WRITEABLE"])
    return torch.as_tensor(X, device=device).to(dtype)


def to_input_tensor(X: np.ndarray, *, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A network's input: validated integer X (token ids) as int64, float X in ``dtype``."""
    if X.dtype.kind in "iu":
        return to_tensor(X, dtype=torch.int64, device=device)
    return to_tensor(X, dtype=dtype, device=device)


# A GPU tensor up to this size is copied into page-locked host memory of its own, which
# the array keeps (torch caches the block once the array is freed). A larger one keeps
# the pageable copy: page-locking gigabytes for a kernel matrix would hold them locked,
# and the staged copy through a bounded buffer (bench_gpu_ab's "staged" rows) has not
# run on a GPU yet.
_PINNED_BYTES = 2**26


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array (a view of a CPU tensor).

    From a GPU, a copy into fresh pageable memory ran at 1.3-1.6 GB/s for 32-128 MB
    float64 Grams, against 15-50 GB/s through page-locked memory (an H200,
    ``benchmarks/results/gpu_ab.md``: 3.1x at 8 MB, 30x at 32 MB).
    """
    t = t.detach()
    if t.device.type == "cuda" and t.nbytes <= _PINNED_BYTES:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t).numpy()
    return t.cpu().numpy()


@contextlib.contextmanager
def seeded_torch(seed: int, device: torch.device):
    """Run a block with torch's global RNG seeded, then restore the caller's RNG state.

    Module constructors draw their initial weights from the global generator; forking it
    gives reproducible initializations without changing the user's global random state.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run a block with torch's intra-op thread count set to ``n`` (``None``: unchanged)."""
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
