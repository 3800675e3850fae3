"""Where `decompose`'s excess over `memory_budget` lives (s52 trial,
`benchmarks/results/user_trial_memory-s52.md`): the growth of one call in a fresh process,
what stays resident after it, the tensors alive, and what `gc.collect()` and glibc's
`malloc_trim(0)` give back. Needs `python -m benchmarks.trial_memory_budget setup mlp`.

    taskset -c 0 python -m benchmarks.trial_memory_budget_heap BUDGET N_QUERIES
    MALLOC_MMAP_THRESHOLD_=4194304 taskset -c 0 python -m benchmarks.trial_memory_budget_heap ...
"""

import ctypes
import gc
import sys
import time
import warnings

import torch

from benchmarks.trial_memory_budget import _load, _status


def main(budget: int, n: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    est, X, _ = _load("mlp", budget)
    rss0 = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    c = time.process_time()
    est.decompose(X[:n])
    print(
        "growth MiB",
        (_status("VmHWM") - rss0) >> 20,
        "cpu",
        round(time.process_time() - c, 1),
        flush=True,
    )
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    print({k: _status(k) >> 20 for k in keys}, "rss0", rss0 >> 20)
    big = [
        (tuple(o.shape), o.dtype)
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and o.numel() * o.element_size() > 2**22
    ]
    print("tensors over 4 MiB alive", big)
    print("collected", gc.collect(), "RssAnon after gc", _status("RssAnon") >> 20)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print("RssAnon after malloc_trim", _status("RssAnon") >> 20)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
