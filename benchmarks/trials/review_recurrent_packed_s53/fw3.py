import warnings

import numpy as np
import torch
from torch import nn

from skpathkernel import PathRecorder


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.sin(x) * self.s.exp()


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 8)
        self.s = Scale()
        self.b = nn.Linear(8, 1)
        self.noise = False

    def forward(self, x):
        h = self.s(self.a(x))
        return self.b(h + 0.1 * torch.randn_like(h) if self.noise else h)


torch.manual_seed(0)
m = Noisy()
X, y = torch.randn(16, 3), torch.randn(16)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
with PathRecorder(m, opt, n_samples=16) as rec:
    rec.set_batch(np.arange(16))
    opt.zero_grad()
    (0.5 * (m(X)[:, 0] - y) ** 2).mean().backward()
    opt.step()
for noise in (False, True):
    m.noise = noise
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rec.as_network(X, y)
    print("noise", noise, [(x.category.__name__, x.lineno) for x in w])
