"""torchvision ConvNeXt left in training mode: analyses drawing anew at every call.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, F403, F405
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
from models import *
from run import train

from skpathkernel.kernels import TangentKernel

warnings.simplefilter("always")
torch.manual_seed(0)
m, _ = build("tv_convnext_small")
m.train()
X = data("img", 6)
y = torch.randn(6, 3, dtype=torch.float64)
rec = train(m, X, y)
net = rec.as_estimator(X, y)
K1 = TangentKernel(net)(X)
K2 = TangentKernel(net)(X)
print("TK twice, rel diff:", np.abs(K1 - K2).max() / np.abs(K1).max())
p1 = net.predict(X) if hasattr(net, "predict") else None
print("predict twice:", np.abs(net.predict(X) - net.predict(X)).max())
r1, r2 = net.decompose(X), net.decompose(X)
print("decompose twice:", np.abs(r1.contributions - r2.contributions).max(), r1.error, r2.error)
