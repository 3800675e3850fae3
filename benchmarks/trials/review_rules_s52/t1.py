# ruff: noqa
"""Review of a864b1c (s52): adversarial scratch script, see benchmarks/results/review-rules-s52.md (run with PYTHONPATH at the repository root)."""

import os, sys, torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import loop_jac, full_gram, rel
from skpathkernel._tangent import tangent_gram
from skpathkernel.rules import register_rule, transposed_linear_rule, layer_routes, check_rule

torch.set_default_dtype(torch.float64)


class Conv1D(nn.Module):
    def __init__(self, nf, nx, bias=True):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1) if bias else None

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        if self.bias is None:
            out = x.view(-1, x.size(-1)) @ self.weight
        else:
            out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(size_out)


register_rule(Conv1D, transposed_linear_rule())


def run(name, net, X, **kw):
    torch.manual_seed(3)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in net.named_parameters()}
    routes = [(r.name, r.route) for r in layer_routes(net, X, params=params)]
    J = loop_jac(net, params, X)
    G = tangent_gram(net, params, X, output="full", **kw)
    print(f"{name:40s} err={rel(G, full_gram(J)):.2e} routes={routes}")


class InplaceAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.c1 = Conv1D(6, 4)
        self.c2 = Conv1D(2, 6)
        self.act = act

    def forward(self, x):
        h = self.c1(x)
        h = self.act(h)
        return self.c2(h).flatten(1)


torch.manual_seed(0)
X = torch.randn(5, 3, 4)
cases = {
    "relu inplace": lambda: InplaceAct(nn.ReLU(inplace=True)),
    "tanh_": lambda: InplaceAct(lambda h: h.tanh_()),
    "mul_ 2": lambda: InplaceAct(lambda h: h.mul_(2)),
    "add_ 0.3": lambda: InplaceAct(lambda h: h.add_(0.3)),
    "relu not inplace": lambda: InplaceAct(nn.ReLU()),
}


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = Conv1D(6, 4)
        self.c2 = Conv1D(2, 6)

    def forward(self, x):
        return self.c2(self.c1(x)).flatten(1)


cases["chain"] = Chain

if __name__ == "__main__":
    k = sys.argv[1]
    run(k, cases[k](), X)
