"""Peak RSS of decompose against its memory_budget: ``python probe_decompose_memory.py
model N budget_bytes``.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, E501
import os
import resource
import sys
import time
import warnings

import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
from models import build, data
from run import train

name, n, budget = sys.argv[1], int(sys.argv[2]), int(float(sys.argv[3]))
m, kind = build(name)
X = data(kind, n)
y = torch.randn(n, 3, dtype=torch.float64)
net = train(m, X, y).as_estimator(X, y, memory_budget=budget)
import gc

gc.collect()


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


before = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.process_time()
res = net.decompose(X)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(
    f"{name} N={n} params={sum(p.numel() for p in m.parameters())} budget={budget / 2**20:.0f} MiB: rss before {before / 2**20:.0f} MiB, peak before {peak_before / 2**20:.0f} MiB, peak after decompose {peak / 2**20:.0f} MiB (growth {(peak - max(before, peak_before)) / 2**20:.0f} MiB), error {res.error:.2g}, {time.process_time() - t:.1f} s"
)
