# ruff: noqa
"""Review of a864b1c (s52): adversarial scratch script, see benchmarks/results/review-rules-s52.md (run with PYTHONPATH at the repository root)."""

import os, sys, torch, warnings
import numpy as np
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import loop_jac, full_gram, rel
from t1 import Conv1D
from skpathkernel import PathRecorder
from skpathkernel.kernels import PathKernel, TangentKernel
from skpathkernel.rules import layer_routes

dtype = {"64": torch.float64, "32": torch.float32}[sys.argv[1]]
torch.set_default_dtype(dtype)
warnings.simplefilter("error", category=Warning) if sys.argv[2:] == ["strict"] else None


class Net(
    nn.Module
):  # GPT-2-like MLP block: c_fc -> in-place relu -> c_proj, chained c_attn -> c_proj
    def __init__(self):
        super().__init__()
        self.c_attn = Conv1D(6, 4)
        self.c_proj0 = Conv1D(4, 6)
        self.c_fc = Conv1D(8, 4)
        self.act = nn.ReLU(inplace=True)
        self.c_proj = Conv1D(4, 8, bias=False)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = x + self.c_proj0(self.c_attn(x))
        h = h + self.c_proj(self.act(self.c_fc(h)))
        return self.head(torch.tanh(h).flatten(1))


torch.manual_seed(0)
module = Net()
X = torch.randn(6, 3, 4)
print("routes", [(r.name, r.route) for r in layer_routes(module, X)])
y = torch.randn(6, 3)
opt = torch.optim.SGD(module.parameters(), lr=0.05)
with PathRecorder(module, opt, n_samples=len(X)) as rec:
    for _ in range(3):
        opt.zero_grad()
        (0.5 * (module(X) - y).pow(2).mean(1)).mean().backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
net = rec.as_estimator(X, y, loss="squared_error")
traj = rec.trajectory
K = TangentKernel(net, output="full")(X)
Kt = TangentKernel(net)(X)
P = PathKernel(net, output="full")(X)
res = net.decompose(X)


def ref_full(k):
    params = {n: torch.as_tensor(v).to(dtype) for n, v in traj.state_dict(k).items()}
    J = loop_jac(module, params, X).double()
    return torch.einsum("ncp,mdp->nmcd", J, J)


PR = sum(traj.learning_rates[k] * ref_full(k) for k in range(len(traj) - 1))
KR = ref_full(len(traj) - 1)
K, Kt, P = (torch.as_tensor(np.asarray(a)).double() for a in (K, Kt, P))
print("TK full", rel(K, KR.reshape(K.shape)))
print("TK trace", rel(Kt, torch.einsum("nmcc->nm", KR) / 3))
print("PK full", rel(P, PR.reshape(P.shape)))
with torch.no_grad():
    f = module(X).double().numpy()
recon = res.initial + res.contributions.sum(1) + res.regularization
print("decompose error", float(res.error), "gap", float(np.abs(recon - f).max()))
