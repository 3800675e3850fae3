"""Review s51 (1ce6ea0): the batching probe of layer_routes alone, every output (d818bae)
against one output (the fix), alternated in one process, medians of 5."""

import statistics
import time

import torch
from torch import nn

import skpathkernel._tangent._generic as G

torch.set_num_threads(1)
D, K = 512, 1000


class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.inp = nn.Linear(32, D)
        s.W = nn.Parameter(torch.randn(D, D) / D**0.5)
        s.head = nn.Linear(D, K)

    def forward(s, x):
        return s.head(torch.tanh(torch.tanh(s.inp(x)) @ s.W))


torch.manual_seed(0)
m = Net()
X = torch.randn(8, 32)
params = {k: v.detach() for k, v in m.named_parameters()}


def old(outputs):  # d818bae's probe: every output
    *_, free, _, jac = G._batched_jacobian(m, params, X, ["W"], outputs)
    out = G._run_batched(jac, free, X[:2])
    return out["W"].numel() * out["W"].element_size()


t = {"all": [], "one": []}
for _rep in range(5):
    for kind in ("all", "one"):
        c0 = time.process_time()
        if kind == "all":
            nbytes = old(range(K))
        else:
            G.unbatched(m, params, X, ["W"], range(K))
        t[kind].append(time.process_time() - c0)
print(
    f"probe alone, D={D} fallback {D * D} params, {K} outputs: every output "
    f"{statistics.median(t['all']):.3f} s CPU (Jacobian {nbytes / 2**20:.0f} MiB), one output "
    f"{statistics.median(t['one']):.4f} s CPU (Jacobian {2 * D * D * 4 / 2**20:.1f} MiB)"
)
