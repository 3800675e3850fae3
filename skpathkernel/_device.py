"""Device and dtype handling: the one place where NumPy meets torch."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

__all__ = [
    "differentiable",
    "forked_rng",
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
    if any(stride < 0 for stride in X.strides):
        # NumPy calls an axis of length 1 contiguous whatever its stride, so a row of a
        # reversed view (X[::-1][:1]) passes np.require; torch refuses a negative stride.
        X = X.copy()
    return torch.as_tensor(X, device=device).to(dtype)


def to_input_tensor(X: np.ndarray, *, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A network's input: validated integer X (token ids) as int64, float X in ``dtype``."""
    if X.dtype.kind in "iu":
        return to_tensor(X, dtype=torch.int64, device=device)
    return to_tensor(X, dtype=dtype, device=device)


def forward_input(X: torch.Tensor) -> torch.Tensor:
    """A private copy of ``X`` (same layout) for one forward pass of the user's network.

    A network may write into its input (``nn.ReLU(inplace=True)`` before its first layer
    with parameters, ``x.mul_(2)`` in a forward): on ``X`` itself that rewrites the
    caller's array (a NumPy ``X`` shares its memory with the tensor), and every later pass
    would read the rewritten rows. The copy costs a pass over the rows, against a forward
    (and backward) of the network on them.
    """
    return X.clone()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array (a view of a CPU tensor).

    From a GPU, into fresh pageable memory: 1.3-1.6 GB/s for 32-128 MB float64 Grams on
    an H200, where page-locked memory took 15-50 GB/s (``benchmarks/results/gpu_ab.md``).
    Arrays of their own in page-locked memory would keep it locked as long as the user
    keeps them (torch caches the blocks, rounded up to a power of two); a reused staging
    buffer avoids that, and ``benchmarks/bench_gpu_ab.py`` times it for the next GPU run.
    """
    return t.detach().cpu().numpy()


class differentiable:
    """Run a block with autograd on, whatever the caller's ``torch.no_grad()`` or
    ``torch.inference_mode()``, and give the caller its modes back after it.

    Users commonly call analyses inside such a block; every verb that differentiates the
    network needs a graph, and an inference tensor (one created in inference mode) cannot
    be saved for backward, so the block also leaves inference mode: the tensors the verb
    makes from NumPy inside it are ordinary ones. Both modes are per thread. A class, not
    a generator, for :class:`skpathkernel._modules.running` (no ``contextlib`` frame).
    """

    def __enter__(self):
        # Leaving inference mode first, enabling gradients second; their exits in the
        # opposite order: inference_mode's exit restores the whole autograd state it
        # found, grad mode included.
        self._modes = (torch.inference_mode(False), torch.enable_grad())
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        # torch's modes take the three exception arguments; a release on a failed entry
        # (:class:`skpathkernel._modules.running`) gives none.
        exc = exc or (None, None, None)
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False


# torch's global generators are the process's, shared by its threads: two fits on threads
# (joblib's threading backend, a multi-threaded Dask worker) seeding and drawing from them
# at once took each other's draws (another initialization for the same random_state), and
# a fork's restore rewound the other's generator mid-draw. Every fork here holds this lock
# (reentrant: a seeded construction may run a forked probe); a long one that draws nothing
# (the training of a network without a layer that draws) holds it to seed and to restore
# only.
_RNG_LOCK = threading.RLock()
# The non-exclusive seeded blocks running (on threads), and the caller's generator states
# from before the first of them: the CPU's, and each CUDA device's by index.
_OPEN: dict = {"blocks": 0, "cuda": {}}


@contextlib.contextmanager
def forked_rng(devices=()):
    """:func:`torch.random.fork_rng` of ``devices`` (CUDA devices; the CPU's always),
    one thread of this process at a time."""
    with _RNG_LOCK, torch.random.fork_rng(devices=list(devices)):
        yield


def _seed(seed: int, device: torch.device) -> None:
    # The generators that are forked, not torch.manual_seed's: it seeds every CUDA
    # device (and MPS, XPU), of which only ``device`` is restored, so a fit (one on
    # the CPU too) left the caller's other generators reseeded for good.
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def seeded_torch(seed: int, device: torch.device, *, exclusive: bool = True):
    """Run a block with torch's global RNG seeded, then restore the caller's RNG state.

    Module constructors draw their initial weights from the global generator; forking it
    gives reproducible initializations without changing the user's global random state.
    ``exclusive``: the block runs alone among this process's forks (a construction, whose
    draws are then those of ``seed`` whatever other non-exclusive blocks do). False, for
    a long block that draws nothing (the training of a network without a layer that
    draws): only the seeding and the restoring are, so that concurrent fits still train
    concurrently; a draw in such a block would interleave with another thread's, even
    an exclusive block's.
    """
    devices = [device] if device.type == "cuda" else []
    if exclusive:
        with forked_rng(devices):
            _seed(seed, device)
            yield
        return
    with _RNG_LOCK:
        # The caller's states, saved by the first of the overlapping blocks and restored
        # by the last: each saving and restoring its own, a block entered while another
        # ran saved that one's seeded state, and restored it last for good.
        if not _OPEN["blocks"]:
            _OPEN["cpu"] = torch.get_rng_state()
        for d in devices:
            key = d.index if d.index is not None else torch.cuda.current_device()
            if key not in _OPEN["cuda"]:
                _OPEN["cuda"][key] = torch.cuda.get_rng_state(key)
        _OPEN["blocks"] += 1
    try:
        with _RNG_LOCK:
            _seed(seed, device)
        yield
    finally:
        with _RNG_LOCK:
            _OPEN["blocks"] -= 1
            if not _OPEN["blocks"]:
                torch.set_rng_state(_OPEN.pop("cpu"))
                for key, state in _OPEN["cuda"].items():
                    torch.cuda.set_rng_state(state, key)
                _OPEN["cuda"] = {}



# torch's intra-op thread count, as torch 2.13 keeps it (measured on its OpenMP build;
# tests/test_parallel.py pins it): each thread has its own count, which its parallel
# regions use (OpenMP's and MKL's per-thread settings), and set_num_threads sets the
# calling thread's. It also records the value process-wide, and a thread takes the value
# recorded last, by any thread, when it first uses torch (at::init_num_threads). Setting
# and restoring a count in one thread thus restores that thread's, but leaves the value
# for new threads at whatever the last restore wrote: a lowered one when a thread first
# used torch while another thread's limit was in force. So the blocks of torch_threads
# count the changes in force in the process and put the recorded value back when the
# last one ends. The lock covers the settings only, never the computations.
_THREADS_LOCK = threading.Lock()
_THREADS = {"in_force": 0, "inherited": 0}


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run a block with torch's intra-op thread count set to ``n`` (``None``: unchanged).

    The count is the calling thread's (torch keeps one per thread), so blocks on
    concurrent threads each run with their own. After the block the caller has its count
    back, and so does the value torch gives a thread on its first use of torch, whatever
    the order in which concurrent blocks end. While a block runs, a thread using torch
    for the first time starts from its ``n`` (torch records the value set last, by any
    thread, for new threads; no torch call sets a thread's count without it), and a
    ``torch.set_num_threads`` by another thread is not kept for new threads.
    """
    previous = torch.get_num_threads()
    if n is None or n == previous:
        yield
        return
    with _THREADS_LOCK:
        if not _THREADS["in_force"]:
            # The value new threads take: this thread takes it now, as a new one would.
            torch.init_num_threads()
            _THREADS["inherited"] = torch.get_num_threads()
        _THREADS["in_force"] += 1
        try:
            torch.set_num_threads(n)
        except BaseException:
            _restore_threads(previous)
            raise
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _restore_threads(previous)


def _restore_threads(previous: int) -> None:
    """Give this thread its ``previous`` count back, and new threads theirs once no
    change of :func:`torch_threads` is in force. Called with ``_THREADS_LOCK`` held."""
    torch.set_num_threads(previous)
    _THREADS["in_force"] -= 1
    if not _THREADS["in_force"] and previous != _THREADS["inherited"]:
        # This thread's count differs from new threads' (another thread set one since
        # it started, or it started during a limit): only another thread can record it.
        setter = threading.Thread(target=torch.set_num_threads,
                                  args=(_THREADS["inherited"],))
        setter.start()
        setter.join()
