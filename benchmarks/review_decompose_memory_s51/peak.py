# ruff: noqa
"""Peak RSS growth of decompose on a small ResNet-like net (independent of the
change's probe.py): python peak.py BUDGET WIDTH LR [N_NODES] (float64). One run per process; VmHWM reset by
/proc/self/clear_refs (5) just before the call, growth = VmHWM after - VmRSS before."""
import sys
import warnings

import numpy as np
import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nets import record

torch.set_num_threads(1)


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.tanh(x + self.b(torch.tanh(self.bn(self.a(x)))))


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


budget, W, lr = int(float(sys.argv[1])), int(sys.argv[2]), float(sys.argv[3])
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, W, 3, padding=1), Res(W), nn.Conv2d(W, 2 * W, 3, 2, 1),
                  Res(2 * W), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * W, 3))
with torch.no_grad():
    m(torch.randn(8, 3, 16, 16))
m.eval()
X, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3)
rec = record(m, torch.optim.SGD(m.parameters(), lr=lr), X, y, 3)
est = rec.as_estimator(X, y, memory_budget=budget)
Xn = X.numpy()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        r = est.decompose(Xn, n_nodes=int(sys.argv[4]) if len(sys.argv) > 4 else None)
    except ValueError as e:
        print(f"budget {budget} refused: {str(e)[:120]}")
        sys.exit()
growth = status("VmHWM") - before
mem = any("memory_budget limited" in str(x.message) for x in w)
print(f"budget {budget} growth {growth} ratio {growth / budget:.2f} n {r.n_nodes.tolist()} "
      f"err {r.error:.3g} memwarn {mem} P {sum(p.numel() for p in m.parameters())}")
