"""Review s51 (6cb6334): a forward hook of the user's module fires during as_network's probe."""

import numpy as np
import torch
from torch import nn

from skpathkernel import PathRecorder

torch.manual_seed(0)
m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
seen = []
m[0].register_forward_hook(lambda mod, i, o: seen.append(o.shape[0]))
X = torch.randn(8, 3, dtype=torch.float64)
y = torch.randn(8, 1, dtype=torch.float64)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with PathRecorder(m, opt, n_samples=8) as rec:
    opt.zero_grad()
    ((m(X) - y) ** 2).mean().backward()
    rec.set_batch(np.arange(8))
    opt.step()
seen.clear()
rec.as_network(X, y)
print("hook calls during as_network:", seen)
