"""Review s51 (6cb6334): the one-point route without X_train gives no warning of a module that
draws at random without a known layer type (a miss, left)."""

import warnings

import numpy as np
import torch
from torch import nn

from skpathkernel import PathRecorder, TangentKernel


class SD(nn.Module):
    def __init__(s):
        super().__init__()
        s.body = nn.Linear(3, 3)
        s.head = nn.Linear(3, 1)

    def forward(s, x):
        b = s.body(x)
        if s.training:
            b = b * torch.empty(x.shape[0], 1, dtype=x.dtype).bernoulli_(0.5) / 0.5
        return s.head(x + b)


torch.manual_seed(0)
m = SD().double()
X = np.random.RandomState(0).normal(size=(8, 3))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    est = PathRecorder(m, torch.optim.SGD(m.parameters(), lr=0.0)).as_estimator()
    p1, p2 = est.predict(X), est.predict(X)
    K1, K2 = TangentKernel(est)(X), TangentKernel(est)(X)
print(
    "predict varies:",
    not np.allclose(p1, p2),
    "kernel varies:",
    not np.allclose(K1, K2),
    "warnings:",
    [str(x.message)[:80] for x in w],
)
