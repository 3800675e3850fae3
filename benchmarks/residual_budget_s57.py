"""torch's CPU peak of a float32 exact decompose against memory_budget (the test's
paths, tests/test_memory.py::_float32_path), or the refusal's least budget. Run with
PYTHONPATH at the tree to measure (an extracted old tree for the before):

PYTHONPATH=. python benchmarks/residual_budget_s57.py sgd 1563000 1722000
(results: benchmarks/results/residual_budget-s57.md)
"""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_memory import _float32_path

from benchmarks.bench_gpu_choices import cpu_peak_bytes

warnings.simplefilter("ignore")
torch.set_num_threads(1)
est, Xq = _float32_path(sys.argv[1])
for budget in [int(float(b)) for b in sys.argv[2:]]:
    est.set_params(memory_budget=budget)
    try:
        est.decompose(Xq[:2])
    except ValueError as e:
        print(budget, "refused", str(e).split("least ")[-1], flush=True)
        continue
    _, p = cpu_peak_bytes(lambda: est.decompose(Xq))
    print(budget, round(p / budget, 3), flush=True)
