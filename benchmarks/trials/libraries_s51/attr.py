"""attribute(method="unrolled") against central finite differences of retraining with one
point's weight moved in the loss sum(u l) / sum(u): ``python attr.py N model ...``.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402
import json
import sys
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
from models import build, data
from run import LR, STEPS, train


def retrain(name, X, y, u):
    module, _ = build(name)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        l = 0.5 * (module(X) - y).pow(2).mean(1)
        ((u * l).sum() / u.sum()).backward()
        opt.step()
    with torch.no_grad():
        return module(X[:2])[:, 0]


def main(name, n, eps=1e-6):
    module, kind = build(name)
    X = data(kind, n)
    C = module(X[:1]).shape[1]
    y = torch.randn(n, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rec = train(module, X, y)
    net = rec.as_estimator(X, y, loss="squared_error")
    t = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tau = np.asarray(net.attribute(X[:2], method="unrolled", output=0))
    cpu = time.process_time() - t
    fd = np.zeros((2, n))
    for i in range(n):
        up, dn = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        up[i] += eps
        dn[i] -= eps
        fd[:, i] = ((retrain(name, X, y, up) - retrain(name, X, y, dn)) / (2 * eps)).numpy()
    print(
        json.dumps(
            {
                "model": name,
                "attr_rel": float(np.abs(tau - fd).max() / np.abs(fd).max()),
                "max_fd": float(np.abs(fd).max()),
                "attr_cpu_s": cpu,
                "warnings": sorted(
                    {str(w.message)[:200] for w in caught if "2.14" not in str(w.message)}
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    for name in sys.argv[2:]:
        try:
            main(name, int(sys.argv[1]))
        except Exception:
            import traceback

            traceback.print_exc()
