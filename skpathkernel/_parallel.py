"""Row blocks through joblib, with torch threads that fit the cores.

Large Grams and detector scores split their rows into one block per joblib worker and
run them with ``Parallel(n_jobs)(delayed(...))``: the same code runs serially, on loky
processes, on threads, or on a Dask cluster under ``joblib.parallel_config(backend="dask")``.

The thread rule: ``n_jobs`` tasks times torch's intra-op threads per task stay within the
cores. Each block task sets ``torch.set_num_threads(max(1, cpu_count() // n_jobs))`` (with
``cpu_count`` read on the worker) and restores the previous value when it ends. torch keeps
the count per thread, so concurrent tasks on threads each run with their own; it also
records the value set last for threads that first use torch later, which
:func:`~skpathkernel._device.torch_threads` puts back when the last limit ends.
Training inside a Dask worker (``GridSearchCV`` under the dask backend) follows the same rule
through :func:`dask_worker_threads`.
"""

from __future__ import annotations

import contextlib
import numbers
import sys

import numpy as np
import torch
from joblib import Parallel, cpu_count, delayed, effective_n_jobs
from joblib.parallel import LokyBackend, MultiprocessingBackend, get_active_backend

from ._device import torch_threads
from ._modules import cudnn_disabled, cudnn_held, fastpath_disabled, fastpath_held

__all__ = ["dask_worker_threads", "limit_torch_threads", "local_processes", "map_calls",
           "map_ranges", "map_row_blocks", "n_row_blocks", "n_tasks"]


def limit_torch_threads(n: int | None):
    """Run a block with at most ``n`` torch intra-op threads, then restore the count.

    The calling thread's count, safe on concurrent threads: see :func:`torch_threads`.
    """
    return torch_threads(n if n is not None and n < torch.get_num_threads() else None)


def _run(func, n_tasks, call, without_cudnn=False, without_fastpath=False):
    # Evaluated on the worker: its own cores, shared by the n_tasks concurrent calls.
    # cuDNN off where the caller had it off for a recurrent network on CUDA, the
    # attention fast path where the caller had it off (_modules.running): the switches
    # are a process's, and a worker process has its own.
    with limit_torch_threads(max(1, cpu_count() // n_tasks)), (
            cudnn_disabled() if without_cudnn else contextlib.nullcontext()), (
            fastpath_disabled() if without_fastpath else contextlib.nullcontext()):
        return func(*call)


def map_calls(func, n_jobs, calls: list) -> list:
    """``[func(*call) for call in calls]``: here for one call, else through joblib, one
    task per call with the torch threads of the rule above (and cuDNN off where it is off
    here for a verb: see :func:`~._modules.cudnn_disabled`; the attention fast path
    likewise)."""
    if len(calls) == 1:
        return [func(*calls[0])]
    switches = cudnn_held(), fastpath_held()
    return Parallel(n_jobs=n_jobs)(delayed(_run)(func, len(calls), call, *switches)
                                   for call in calls)


def _ranges(n_tasks: int, n_items: int, align: int = 1) -> list[tuple[int, int]]:
    """``range(n_items)`` cut into at most ``n_tasks`` contiguous ``(start, stop)``
    ranges, each starting at a multiple of ``align``."""
    n_units = -(-n_items // align)
    bounds = np.minimum(np.linspace(0, n_units, min(n_tasks, n_units) + 1).astype(int)
                        * align, n_items)
    return [(int(start), int(stop)) for start, stop in zip(bounds[:-1], bounds[1:])]


def n_row_blocks(n_jobs, X) -> int:
    """Number of row blocks of ``X``: one per joblib worker, at most one per row.

    One inside a Dask task (a ``GridSearchCV`` fit on the cluster, say): the cluster
    already runs a task per slot, and a nested fan-out would oversubscribe its cores.
    """
    return n_tasks(n_jobs, X.shape[0])


def n_tasks(n_jobs, n_items: int) -> int:
    """Tasks :func:`map_ranges` runs for ``n_items`` items (one inside a Dask task).

    Every ``n_jobs`` of the package passes here first, so this is where a wrong one is
    named: joblib's own errors for a string or a float do not say which parameter.
    """
    if n_jobs is not None and not isinstance(n_jobs, numbers.Integral):
        raise TypeError(f"n_jobs must be an int or None, got {n_jobs!r}.")
    if dask_worker_threads() is not None:
        return 1
    return max(1, min(effective_n_jobs(n_jobs), n_items))


def map_ranges(func, n_items: int, n_jobs, *args) -> list:
    """``[func(start, stop, *args) for each range]`` through joblib, in order.

    ``range(n_items)`` cut into one contiguous range per joblib worker (the same rule
    as :func:`map_row_blocks`): the path kernel's sum over steps split into step ranges.
    With a single worker ``func(0, n_items, *args)`` runs here.
    """
    return map_calls(func, n_jobs, [(start, stop, *args) for start, stop
                                   in _ranges(n_tasks(n_jobs, n_items), n_items)])


def map_row_blocks(func, X, n_jobs, *args, align: int = 1) -> list:
    """``[func(X[rows], *args) for rows in blocks]`` through joblib, in row order.

    One contiguous block per joblib worker (``effective_n_jobs(n_jobs)``, at most one per
    row), each starting at a multiple of ``align`` rows. With a single worker
    ``func(X, *args)`` runs here, unchanged.
    """
    n_tasks = n_row_blocks(n_jobs, X)
    # The blocks are sliced here: each task pickles its own rows, not the whole X.
    calls = ([(X, *args)] if n_tasks == 1 else
             [(X[start:stop], *args) for start, stop in _ranges(n_tasks, X.shape[0],
                                                                align)])
    return map_calls(func, n_jobs, calls)


def local_processes() -> bool:
    """Whether joblib's active backend runs tasks in processes of this machine (loky,
    multiprocessing): their arguments can name files here instead of carrying them."""
    return isinstance(get_active_backend()[0], (LokyBackend, MultiprocessingBackend))


def by_reference(n_tasks: int) -> bool:
    """Whether ``n_tasks`` tasks should get an in-memory path as the name of its shared
    files (``for_workers(by_reference=...)``): more than one task (a single one runs
    here, unpickled), on processes of this machine."""
    return n_tasks > 1 and local_processes()


def dask_worker_threads() -> int | None:
    """Torch threads for a task running on a Dask worker; None outside one.

    The worker process's cores shared by the task slots of every Dask worker in it
    (``LocalCluster(processes=False)`` runs several in one process), and never more
    than torch already uses: Dask's nanny starts worker processes with
    ``OMP_NUM_THREADS=1``, which torch reads at import.
    """
    if "distributed" not in sys.modules:  # no worker here, and no import cost
        return None
    from distributed import Worker, get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None
    instances = getattr(Worker, "_instances", None) or [worker]
    slots = sum(getattr(getattr(w, "state", None), "nthreads", 0) for w in instances) or 1
    return max(1, min(torch.get_num_threads(), cpu_count() // slots))
