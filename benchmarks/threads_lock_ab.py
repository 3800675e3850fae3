"""Single-thread cost of the module lock: tangent_gram with it (B) and without it (A,
the undecorated function, ``tangent_gram.__wrapped__``), alternated in one process,
CPU time, medians. Run pinned: taskset -c 1 python benchmarks/threads_lock_ab.py
"""
import statistics
import time

import torch
from torch import nn

from skpathkernel._modules import module_lock
from skpathkernel._tangent import tangent_gram


def main(rounds=61, n=1024):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                        nn.Linear(64, 2)).eval()
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).eval()
    for name, module, X in [("mlp", mlp, torch.randn(n, 10)),
                            ("cnn", cnn, torch.randn(n, 1, 8, 8))]:
        params = {k: v.detach() for k, v in module.named_parameters()}
        calls = {"A unlocked": tangent_gram.__wrapped__, "B locked": tangent_gram}
        times = {k: [] for k in calls}
        for fn in calls.values():  # warm-up
            fn(module, params, X)
        for _ in range(rounds):
            for key, fn in calls.items():
                t = time.process_time()
                fn(module, params, X)
                times[key].append(time.process_time() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name} N={n}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in med.items())
              + f", B/A {med['B locked'] / med['A unlocked']:.3f} ({rounds} rounds)")
    # The lock alone: one uncontended acquire and release per call.
    t = time.process_time()
    for _ in range(100_000):
        with module_lock(mlp):
            pass
    print(f"module_lock acquire+release: {1e6 * (time.process_time() - t) / 100_000:.2f} us")


if __name__ == "__main__":
    main()
