"""resnet18's float32 Grams (skpathkernel, torch.func) against the float64 one.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402
import copy
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
from models import build, data
from run import train
from timing import torch_func_gram

from skpathkernel.kernels import TangentKernel

m32, _ = build("tv_resnet18", dtype=torch.float32)
X = data("img", 8).float()
y = torch.zeros(8, 3)
net32 = train(m32, X, y, steps=1).as_estimator(X, y)
params = {k: v.detach() for k, v in m32.named_parameters()}
K32 = np.asarray(TangentKernel(net32)(X))
Ktf = np.asarray(torch_func_gram(m32, params, X))
m64 = copy.deepcopy(m32).double()
net64 = train(m64, X.double(), y.double(), steps=0).as_estimator(X.double(), y.double())
K64 = np.asarray(TangentKernel(net64)(X.double()))


def r(a):
    return float(np.abs(a - K64).max() / np.abs(K64).max())


print(f"float32 skpathkernel vs float64: {r(K32):.2g}; torch.func float32 vs float64: {r(Ktf):.2g}")
