"""Quadrature nodes of the exact decomposition; BatchNorm in training mode in a loop.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, F403, F405
import time
import warnings

import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
from models import *
from run import train

for name in ("tv_vit", "timm_mixer"):
    m, kind = build(name)
    X = data(kind, 6)
    y = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    net = train(m, X, y).as_estimator(X, y)
    for tol in (None, 1e-8):
        t = time.process_time()
        res = net.decompose(X, tol=tol)
        dt = time.process_time() - t
        print(name, "tol", tol, "n_nodes", res.n_nodes, f"error {res.error:.2g}", f"cpu {dt:.2f} s")
# BN train mode in the user's own loop
import torchvision

m = torchvision.models.resnet18(num_classes=3)
X = torch.randn(4, 3, 32, 32)
y = torch.randn(4, 3)
try:
    train(m, X, y, steps=1)
except Exception as e:
    print("own loop, resnet18 in train mode:", type(e).__name__, str(e)[:400])
