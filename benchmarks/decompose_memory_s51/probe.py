"""Peak RSS growth of ``decompose`` on a narrow ResNet against its memory_budget:
``python probe.py WIDTH N BUDGET_BYTES DTYPE [SIDE]``. One run per process.

Plain-torch ResNet-18 structure (BasicBlocks [2, 2, 2, 2], BatchNorm in eval mode,
global average pool), base width WIDTH (torchvision's is 64), 3 SGD steps recorded
under PathRecorder as in benchmarks/trials/libraries_s51/run.py. The peak is VmHWM after
resetting it (/proc/self/clear_refs 5) just before the call.
"""

# ruff: noqa: E402, E501
import os
import sys
import time
import warnings

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)
warnings.simplefilter("ignore")
from skpathkernel import PathRecorder


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, w, classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.pool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], w
        for i, c in enumerate((w, 2 * w, 4 * w, 8 * w)):
            for j in range(2):
                layers.append(Block(cin, c, 2 if (j == 0 and i > 0) else 1))
                cin = c
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layers(x).mean((2, 3))
        return self.fc(x)


def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(w, n, budget, dtype):
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    m = ResNet(w).to(dtype).eval()
    X = torch.randn(n, 3, 32, 32, dtype=dtype)
    y = torch.randn(n, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with PathRecorder(m, opt, n_samples=n) as rec:
        for _ in range(3):
            opt.zero_grad()
            (0.5 * (m(X) - y).pow(2).mean(1)).mean().backward()
            rec.set_batch(np.arange(n))
            opt.step()
    net = rec.as_estimator(X, y, loss="squared_error", memory_budget=budget)
    import gc

    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    before = rss()
    t = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = net.decompose(X)
    grow = hwm() - before
    warned = sorted({w.category.__name__ for w in caught})
    print(
        f"w={w} N={n} P={sum(p.numel() for p in m.parameters())} {dtype} budget={budget / 2**20:.0f} MiB "
        f"growth={grow / 2**20:.0f} MiB ratio={grow / budget:.2f} err={res.error:.2g} cpu={time.process_time() - t:.1f}s nodes={list(res.n_nodes)} warned={warned}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(float(sys.argv[3])), sys.argv[4])
