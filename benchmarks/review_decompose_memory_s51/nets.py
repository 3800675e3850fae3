# ruff: noqa
"""Recorded nets for the s51 review of decompose's memory cap (shared by the probes)."""
import numpy as np
import torch
from torch import nn

from skpathkernel import PathRecorder


class Attn(nn.Module):
    def __init__(self, d=8, T=4, C=2):
        super().__init__()
        self.emb = nn.Linear(3, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d * T, C)
        self.T, self.d = T, d

    def forward(self, x):
        h = self.emb(x.view(x.shape[0], self.T, 3))
        a = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / self.d ** 0.5, -1)
        h = self.ln(h + a @ self.v(h))
        return self.out(torch.tanh(h).flatten(1))


def make(name, opt_name, dtype, steps=4, lr=None):
    torch.manual_seed(0)
    n = 6
    if name == "mlp":
        m = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
        X = torch.randn(n, 5)
    elif name == "cnn":
        m = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Tanh(),
                          nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.Tanh(),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
        X = torch.randn(n, 3, 8, 8)
    else:
        m = Attn()
        X = torch.randn(n, 12)
    m = m.to(dtype)
    if name == "cnn":  # eval-mode BatchNorm with non-trivial running stats
        with torch.no_grad():
            m.train()
            m(X.to(dtype))
        m.eval()
    X = X.to(dtype)
    y = torch.randn(n, 2, dtype=dtype)
    if opt_name == "sgd1":  # plain SGD, no momentum or decay
        opt = torch.optim.SGD(m.parameters(), lr=lr)
    elif opt_name == "sgd":
        opt = torch.optim.SGD(m.parameters(), lr=lr or 0.3, momentum=0.5, weight_decay=1e-3)
    else:
        opt = torch.optim.Adam(m.parameters(), lr=lr or 0.02, weight_decay=1e-3)
    return record(m, opt, X, y, steps), m, X, y


def record(m, opt, X, y, steps):
    """Full-batch steps on the mean squared error, recorded."""
    with PathRecorder(m, opt, n_samples=len(X)) as rec:
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * (m(X) - y).pow(2).mean(1)).mean().backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    return rec
