# ruff: noqa
"""Review of a864b1c (s52): adversarial scratch script, see benchmarks/results/review-rules-s52.md (run with PYTHONPATH at the repository root)."""

import os, sys, torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import loop_jac, full_gram, rel
from t1 import Conv1D, run
from skpathkernel._tangent import tangent_gram
from skpathkernel.rules import register_rule, transposed_linear_rule, layer_routes, check_rule

torch.set_default_dtype(torch.float64)


class MM(nn.Module):  # bias None, x @ W on any batch dims
    def __init__(self, nx, nf, how="at"):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.how = how

    def forward(self, x):
        if self.how == "at":
            return x @ self.weight
        if self.how == "matmul":
            return torch.matmul(x, self.weight)
        if self.how == "mm":
            return torch.mm(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        if self.how == "tmatmul":
            return x.matmul(self.weight)


register_rule(MM, transposed_linear_rule())


def seq(*mods, flat=True):
    class S(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.ModuleList(mods)

        def forward(self, x):
            for m in self.m:
                x = m(x) if isinstance(m, nn.Module) else m(x)
            return x.flatten(1) if flat else x

    return S()


class Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


class ViewOfView(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = Conv1D(3, 4)
        self.o = nn.Linear(3 * 3, 2)

    def forward(self, x):  # x (n, 12): root (n, 12) -> (n, 3, 4) -> (n*3, 4)
        h = torch.tanh(x)  # root
        return self.o(torch.tanh(self.c(h.view(h.shape[0], 3, 4))).flatten(1))


class Flat1D(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = Conv1D(3, 4)
        self.o = nn.Linear(9, 2)

    def forward(self, x):  # root 1-D
        h = torch.tanh(x).reshape(-1)
        return self.o(torch.tanh(self.c(h.view(x.shape[0], 3, 4))).flatten(1))


class TwiceCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = Conv1D(4, 4)
        self.o = nn.Linear(12, 2)

    def forward(self, x):
        return self.o(torch.tanh(self.c(torch.tanh(self.c(x)) * 1)).flatten(1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Conv1D(5, 4)
        self.b = Conv1D(5, 4)
        self.b.weight = self.a.weight
        self.o = nn.Linear(30, 2)

    def forward(self, x):
        return self.o(torch.cat([torch.tanh(self.a(x)), self.b(x * 1)], -1).flatten(1))


class TiedLinear(nn.Module):  # W (4,5) used as Conv1D's (in,out) and as Linear(5->4)'s (out,in)
    def __init__(self):
        super().__init__()
        self.a = Conv1D(5, 4)
        self.l = nn.Linear(5, 4)
        self.l.weight = self.a.weight
        self.o = nn.Linear(12, 2)

    def forward(self, x):
        return self.o(self.l(torch.tanh(self.a(x))).flatten(1))


class Scaled(nn.Module):
    def __init__(self, beta=1.0, alpha=1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(3))
        self.kw = dict(beta=beta, alpha=alpha)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, 4), self.weight, **self.kw).view(*x.shape[:-1], 3)


register_rule(Scaled, transposed_linear_rule())


class OutIn(nn.Module):  # (out, in) weight with the rule registered by mistake
    def __init__(self, how):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(3))
        self.how = how

    def forward(self, x):
        if self.how == "linear":
            return F.linear(x, self.weight, self.bias)
        if self.how == "T":
            return x @ self.weight.T + self.bias
        if self.how == "Wx":
            return torch.matmul(self.weight, x.transpose(-1, -2)).transpose(-1, -2)


register_rule(OutIn, transposed_linear_rule())


class SqOutIn(nn.Module):  # square (out, in) weight, "Wx" read: W @ x^T
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):  # x (n, 4): returns (W x_n^T)^T per sample
        return torch.matmul(self.weight, x.T).T


register_rule(SqOutIn, transposed_linear_rule())


class InputMutated(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = Conv1D(3, 4)
        self.o = nn.Linear(9 + 12, 2)

    def forward(self, x):
        h = torch.tanh(x)
        y = self.c(h)
        h.mul_(3.0)
        return self.o(torch.cat([y, h], -1).flatten(1))


class InputMutatedLin(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(4, 3)
        self.o = nn.Linear(9 + 12, 2)

    def forward(self, x):
        h = torch.tanh(x)
        y = self.c(h)
        h.mul_(3.0)
        return self.o(torch.cat([y, h], -1).flatten(1))


T = lambda f: Fn(f)
cases = {
    "3d B,T,in conv1d": lambda: (
        seq(Conv1D(5, 4), T(torch.tanh), Conv1D(2, 5)),
        torch.randn(5, 3, 4),
    ),
    "4d B,A,T,in conv1d": lambda: (
        seq(Conv1D(5, 4), T(torch.tanh), Conv1D(2, 5)),
        torch.randn(5, 2, 3, 4),
    ),
    "2d conv1d": lambda: (seq(Conv1D(5, 4), T(torch.tanh), Conv1D(2, 5)), torch.randn(5, 4)),
    "noncontig x (transposed input)": lambda: (
        seq(
            T(lambda x: torch.tanh(x).transpose(1, 2)),
            T(lambda x: x.reshape(x.shape[0], -1, 4)),
            Conv1D(3, 4),
        ),
        torch.randn(5, 4, 3),
    ),
    "MM @ transposed view": lambda: (
        seq(T(lambda x: torch.tanh(x).transpose(1, 2)), MM(4, 3, "at")),
        torch.randn(5, 4, 3),
    ),
    "MM matmul slice view": lambda: (
        seq(T(lambda x: torch.tanh(x)[:, 1:]), MM(4, 3, "matmul")),
        torch.randn(5, 3, 4),
    ),
    "MM mm": lambda: (seq(T(torch.tanh), MM(4, 3, "mm")), torch.randn(5, 3, 4)),
    "MM Tensor.matmul": lambda: (seq(T(torch.tanh), MM(4, 3, "tmatmul")), torch.randn(5, 3, 4)),
    "MM 2d": lambda: (seq(MM(4, 3, "at"), T(torch.tanh), MM(3, 2, "mm")), torch.randn(5, 4)),
    "view of view": lambda: (ViewOfView(), torch.randn(5, 12)),
    "1-D root": lambda: (Flat1D(), torch.randn(5, 12)),
    "called twice": lambda: (TwiceCall(), torch.randn(5, 3, 4)),
    "tied two conv1d": lambda: (Tied(), torch.randn(5, 3, 4)),
    "tied conv1d + linear (W and W^T)": lambda: (TiedLinear(), torch.randn(5, 3, 4)),
    "addmm beta=1 alpha=1 kw": lambda: (seq(Scaled()), torch.randn(5, 3, 4)),
    "addmm alpha=2": lambda: (seq(Scaled(alpha=2.0)), torch.randn(5, 3, 4)),
    "addmm beta=0.5": lambda: (seq(Scaled(beta=0.5)), torch.randn(5, 3, 4)),
    "(out,in) F.linear": lambda: (seq(OutIn("linear")), torch.randn(5, 3, 4)),
    "(out,in) x@W.T": lambda: (seq(OutIn("T")), torch.randn(5, 3, 4)),
    "(out,in) W@x^T": lambda: (seq(OutIn("Wx")), torch.randn(5, 3, 4)),
    "square W@x.T n=4": lambda: (seq(SqOutIn()), torch.randn(4, 4)),
    "square W@x.T n=5": lambda: (seq(SqOutIn()), torch.randn(5, 4)),
    "input mutated after (conv1d)": lambda: (InputMutated(), torch.randn(5, 3, 4)),
    "input mutated after (linear)": lambda: (InputMutatedLin(), torch.randn(5, 3, 4)),
}
if __name__ == "__main__":
    names = sys.argv[1:] or list(cases)
    for k in names:
        torch.manual_seed(0)
        net, X = cases[k]()
        try:
            run(k, net, X)
        except Exception as e:
            print(f"{k:40s} RAISES {type(e).__name__}: {str(e)[:200]}")
