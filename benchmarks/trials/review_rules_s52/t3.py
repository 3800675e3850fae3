# ruff: noqa
"""Review of a864b1c (s52): adversarial scratch script, see benchmarks/results/review-rules-s52.md (run with PYTHONPATH at the repository root)."""

import os, sys, torch, functools
from torch import nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import loop_jac, full_gram, rel
from t1 import run
from skpathkernel.rules import register_rule, get_rule, layer_routes
from skpathkernel._tangent._rules import RULES, rule_for

torch.set_default_dtype(torch.float64)


class GetattrLin(nn.Linear):
    def __getattr__(self, name):
        if name == "weight":
            return super().__getattr__("weight") * 2
        return super().__getattr__(name)


class WeightProp(nn.Linear):
    def __init__(self, n_in, n_out):
        nn.Module.__init__(self)
        self.in_features, self.out_features = n_in, n_out
        self.w0 = nn.Parameter(torch.randn(n_out, n_in))
        self.bias = nn.Parameter(torch.randn(n_out))

    @property
    def weight(self):
        return self.w0 * 2


class ConvFwd(nn.Conv2d):
    def _conv_forward(self, input, weight, bias):
        return F.conv2d(input, weight, bias, self.stride, 2, self.dilation, self.groups)[
            ..., 1:-1, 1:-1
        ]


class Mixin:
    def forward(self, x):
        return F.linear(x.flip(-1), self.weight, self.bias)


class MixinFirst(Mixin, nn.Linear):
    pass


class MixinLast(nn.Linear, Mixin):
    pass  # nn.Linear.forward wins


class PropMixin:
    @property
    def weight(self):  # after nn.Module in MRO: shadows the parameter anyway
        return self._parameters["weight"].flip(0)


class PropMixinLast(nn.Linear, PropMixin):
    pass


class PadConv(nn.Conv2d):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.padding_mode = "circular"
        self._reversed_padding_repeated_twice = [1, 1, 1, 1]


class EpsNorm(nn.LayerNorm):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.eps = 0.5


class EpsGN(nn.GroupNorm):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.eps = 0.3
        self.num_groups = 1  # forward reads self.num_groups


class BNsub(nn.BatchNorm2d):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.eps = 0.2
        self.momentum = None


class MyLin(nn.Linear):
    def __init__(self, *a):
        super().__init__(*a)


class Deeper(MyLin):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 3.0


class Deepest(Deeper):
    pass


class InstFwd(nn.Linear):
    def __init__(self, *a):
        super().__init__(*a)
        self.forward = lambda x: F.linear(x, self.weight, self.bias).flip(0)  # mixes samples


class HookLin(nn.Linear):
    def __init__(self, *a):
        super().__init__(*a)
        self.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        self.register_forward_hook(lambda m, args, out: out**2)


class SlotsDict(nn.Linear):
    __slots__ = ()


class ClsW(nn.Linear):
    weight_scale = 2.0


class NewMeth(nn.Linear):
    def weight2(self):
        return self.weight


class StaticFwd(nn.Linear):
    forward = staticmethod(lambda x: x)


class PartialFwd(nn.Linear):
    forward = functools.partialmethod(nn.Linear.forward)


class CallOverride(nn.Linear):
    def __call__(self, x):
        return super().__call__(x) * 2


class ConvTsub(nn.ConvTranspose2d):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.output_padding = (1, 1)


class EmbSub(nn.Embedding):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.padding_idx = 2
        self.max_norm = None


def net_lin(kind, n_in=4, n_out=3):
    torch.manual_seed(0)
    return nn.Sequential(kind(n_in, n_out), nn.Tanh(), nn.Linear(n_out, 2))


X4 = torch.randn(5, 4)
Ximg = torch.randn(4, 2, 5, 5)
cases = {
    "__getattr__": lambda: (net_lin(GetattrLin), X4),
    "weight property": lambda: (net_lin(WeightProp), X4),
    "_conv_forward": lambda: (
        nn.Sequential(ConvFwd(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2)),
        Ximg,
    ),
    "mixin forward first": lambda: (net_lin(MixinFirst), X4),
    "mixin last": lambda: (net_lin(MixinLast), X4),
    "padding_mode circular in init": lambda: (
        nn.Sequential(PadConv(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2)),
        Ximg,
    ),
    "LayerNorm eps=0.5 in init": lambda: (
        nn.Sequential(EpsNorm(4), nn.Tanh(), nn.Linear(4, 2)),
        X4,
    ),
    "GroupNorm eps,num_groups in init": lambda: (
        nn.Sequential(EpsGN(2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(50, 2)),
        Ximg,
    ),
    "BatchNorm eps/momentum init (eval)": lambda: (
        nn.Sequential(BNsub(2), nn.Tanh(), nn.Flatten(), nn.Linear(50, 2)).eval(),
        Ximg,
    ),
    "sub-sub, intermediate fwd": lambda: (net_lin(Deepest), X4),
    "instance forward": lambda: (net_lin(InstFwd), X4),
    "hooks in init": lambda: (net_lin(HookLin), X4),
    "__slots__": lambda: (net_lin(SlotsDict), X4),
    "class attr": lambda: (net_lin(ClsW), X4),
    "new method": lambda: (net_lin(NewMeth), X4),
    "staticmethod forward": lambda: (net_lin(StaticFwd, 4, 4), X4),
    "partialmethod forward": lambda: (net_lin(PartialFwd), X4),
    "__call__": lambda: (net_lin(CallOverride), X4),
    "ConvT output_padding init": lambda: (
        nn.Sequential(ConvTsub(2, 3, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)),
        Ximg,
    ),
    "Embedding padding_idx init": lambda: (
        nn.Sequential(EmbSub(6, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2)),
        torch.randint(0, 6, (5, 3)),
    ),
}


def parametrized():
    torch.manual_seed(0)
    net = net_lin(MyLin)

    class Double(nn.Module):
        def forward(self, w):
            return w * 2

    parametrize.register_parametrization(net[0], "weight", Double())
    return net, X4


cases["parametrized subclass"] = parametrized

if __name__ == "__main__":
    names = sys.argv[1:] or list(cases)
    for k in names:
        torch.manual_seed(0)
        net, X = cases[k]()
        if any(isinstance(m, nn.LazyLinear) for m in net.modules()):
            net(X)
        try:
            run(k, net, X)
        except Exception as e:
            print(f"{k:40s} RAISES {type(e).__name__}: {str(e)[:200]}")
