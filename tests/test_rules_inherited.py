"""Subclasses of layers with a rule, and the rule for a linear layer with an (in, out)
weight (Hugging Face's GPT-2 ``Conv1D``, written here in plain torch), against the
per-sample autograd loop."""

import abc
from typing import Generic, TypeVar

import pytest
import torch
from test_rules import _loop  # the autograd loop at given parameters
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from skpathkernel._tangent import tangent_features, tangent_gram
from skpathkernel._tangent._layers import _in_out_factors
from skpathkernel._tangent._rules import rule_for
from skpathkernel.rules import (
    Rule,
    check_rule,
    get_rule,
    layer_routes,
    transposed_linear_rule,
)


def _check(module, X, routes):
    """Routes as given, and the full Gram and the features equal to the loop's."""
    torch.manual_seed(1)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    got = layer_routes(module, X, params=params)
    assert [(r.name, r.route) for r in got] == routes, [(r.name, r.reason) for r in got]
    J = _loop(module, params, X)
    full = torch.einsum("ncp,mdp->ncmd", J, J)
    G = tangent_gram(module, params, X, output="full")
    assert float((G - full).abs().max() / full.abs().max()) < 1e-12
    phi = tangent_features(module, params, X, output="full")
    assert float((phi - J).abs().max() / J.abs().max()) < 1e-12
    return got


T = TypeVar("T")


# ------------------------------------------------------------------------- subclasses
class _Linear(nn.Linear):
    """Keeps nn.Linear's forward: only construction and printing differ."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.tag = "mine"

    def extra_repr(self):
        return "mine"


class _Conv(nn.Conv2d):
    pass


class _Norm(nn.LayerNorm):
    def reset_parameters(self):
        super().reset_parameters()
        with torch.no_grad():
            self.weight.fill_(1.5)

    def helper(self):  # a new method: nn.LayerNorm's forward cannot call it
        return self.eps


class _Deeper(_Linear):
    """Two levels below nn.Linear."""


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = _Conv(2, 3, 3, padding=1)
        self.norm = _Norm(3 * 4 * 4)
        self.lin = _Linear(48, 5)
        self.deep = _Deeper(5, 2)

    def forward(self, x):
        h = torch.tanh(self.norm(self.conv(x).flatten(1)))
        return self.deep(torch.tanh(self.lin(h)))


def test_a_subclass_keeping_forward_takes_its_ancestors_rule():
    # Rules matched exact types: each of these went to the fallback (exact, slower).
    module = _Net().double()
    X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    _check(module, X, [("conv", "rule"), ("norm", "rule"), ("lin", "rule"), ("deep", "rule")])


class _Scaled(nn.Linear):
    """Overrides forward: twice nn.Linear's output."""

    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


class _ConvForward(nn.Conv2d):
    """Overrides a method nn.Conv2d's forward calls."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight, bias) ** 2


class _ScaledConv(nn.Conv2d):
    """Overrides forward: twice nn.Conv2d's output."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_subclass_overriding_forward_falls_back_until_registered(registered):
    module = nn.Sequential(
        _Scaled(3, 4),
        nn.Tanh(),
        nn.Unflatten(1, (1, 2, 2)),
        _ConvForward(1, 2, 2),
        nn.Flatten(),
        nn.Linear(2, 1),
    ).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    # _Scaled's weight and bias, read by one F.linear as raw parameters of a layer
    # without a rule, are sites of the Linear rule already (free parameters read by a
    # matrix product, ._parameters.product_site).
    routes = _check(module, X, [("0", "rule"), ("3", "fallback"), ("5", "rule")])
    assert "it overrides _conv_forward of nn.Conv2d" in routes[1].reason
    name = f"{__name__}._ScaledConv"
    (route,) = layer_routes(_ScaledConv(1, 2, 2).double(), torch.randn(3, 1, 3, 3).double())
    assert route.route == "fallback" and route.reason == (
        f"no rule for {name}: it overrides forward of nn.Conv2d, whose rule covers the "
        "subclasses that keep its forward; if its forward reads its parameters in one "
        f"call of conv2d as nn.Conv2d's does, register_rule({name}, get_rule(nn.Conv2d))"
    )
    registered(_Scaled, get_rule(nn.Linear))
    registered(_ConvForward, get_rule(nn.Conv2d))
    _check(module, X, [("0", "rule"), ("3", "rule"), ("5", "rule")])


def test_a_parametrized_layer_keeps_the_fallback():
    # Its class is a subclass of nn.Linear whose weight property shadows the parameter
    # (it computes the weight from others): not covered by nn.Linear's rule.
    module = nn.Sequential(
        nn.Linear(3, 2), nn.Tanh(), parametrizations.weight_norm(nn.Linear(2, 2))
    ).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    # The layer's own raw bias, read by its F.linear, is a site of the Linear rule
    # (a free parameter read by a matrix product); the weight's parametrization falls back.
    routes = _check(
        module, X, [("0", "rule"), ("2", "rule"), ("2.parametrizations.weight", "fallback")]
    )
    assert routes[2].reason.startswith("the parameters of a parametrization")


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2))

    def forward(self, x):
        return x @ self.w


class _Child(_Base):
    pass


def test_a_rule_registered_later_reaches_subclasses_looked_up_before(registered):
    module = nn.Sequential(_Child(), nn.Tanh(), nn.Linear(2, 1)).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    # Without a rule, its raw w read by x @ w is a free parameter on the Linear rule's site.
    assert layer_routes(module, X)[0].route == "rule"
    assert rule_for(_Child) is None
    rule = transposed_linear_rule(weight="w")
    registered(_Base, rule)
    assert rule_for(_Child) is rule
    _check(module, X, [("0", "rule"), ("2", "rule")])


# ------------------------------------------------------------ linear, weight (in, out)
class Conv1D(nn.Module):
    """Hugging Face's transformers.pytorch_utils.Conv1D, as it is written there."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) / 4)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class _MatMul(nn.Module):
    """``x @ W`` without a bias."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)

    def forward(self, x):
        return x @ self.weight


class _Block(nn.Module):
    """GPT-2's attention and MLP written with Conv1D (causal, two heads, pre-norm)."""

    def __init__(self, d=8, S=5):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.mlp_proj = Conv1D(2 * d, d), _MatMul(2 * d, d)
        self.head = nn.Linear(S * d, 3)
        self.d = d

    def forward(self, x):
        n, S, d = x.shape
        q, k, v = self.c_attn(self.ln(x)).split(d, dim=2)
        q, k, v = (t.view(n, S, 2, d // 2).transpose(1, 2) for t in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(h.transpose(1, 2).reshape(n, S, d))
        x = x + self.mlp_proj(torch.tanh(self.c_fc(x)))
        return self.head(x.flatten(1))


def test_the_transposed_linear_rule_matches_the_loop(registered):
    torch.manual_seed(0)
    module = _Block().double()
    X = torch.randn(6, 5, 8, dtype=torch.float64)
    names = ["ln", "c_attn", "c_proj", "c_fc", "mlp_proj", "head"]
    # Unregistered, their raw weights and biases are free parameters read by torch.addmm
    # and x @ W: sites of the same rule already (._parameters.product_site).
    _check(module, X, [(n, "rule") for n in names])
    registered(Conv1D, transposed_linear_rule())
    registered(_MatMul, transposed_linear_rule())
    _check(module, X, [(n, "rule") for n in names])
    # Output-weighted (the trace), and a second set of inputs.
    assert check_rule(module, X[:4], rtol=1e-12) < 1e-12
    # Vectors (n, d): one position.
    vec = nn.Sequential(Conv1D(4, 3), nn.Tanh(), Conv1D(2, 4)).double()
    _check(vec, torch.randn(5, 3, dtype=torch.float64), [("0", "rule"), ("2", "rule")])


def test_a_broken_transposed_linear_rule_is_caught(registered):
    # The rule's weight term with its sign flipped: the capture's autograd probe finds it
    # and sends the layer to the fallback, so the results stay exact but the route says so.
    def flipped(layer, use, deltas, names):
        terms = _in_out_factors("weight", "bias")(layer, use, deltas, names)
        return [type(t)(delta=-t.delta, inputs=t.inputs, transposed=True) for t in terms]

    good = transposed_linear_rule()
    registered(Conv1D, Rule(ops=good.ops, factors=flipped, expand=good.expand))
    torch.manual_seed(0)
    module = nn.Sequential(Conv1D(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(20, 1)).double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    routes = _check(module, X, [("0", "fallback"), ("3", "rule")])
    assert "disagree" in routes[0].reason
    with pytest.raises(AssertionError, match=r"0 \(Conv1D\) disagree with autograd"):
        check_rule(module, X)


class _SequenceFirst(Conv1D):
    """Flattens its rows position by position: the rows are not sample-major."""

    def forward(self, x):
        return super().forward(x.transpose(0, 1).contiguous()).transpose(0, 1)


class _Sliced(Conv1D):
    """Reads a contiguous slice of a larger tensor's rows: not that tensor's samples."""

    def forward(self, x):
        big = torch.cat([x, x.flip(0)]).reshape(-1, x.shape[-1])
        out = torch.addmm(self.bias, big[: x.shape[0] * x.shape[1]], self.weight)
        return out.view(*x.shape[:-1], self.nf)


@pytest.mark.parametrize("kind", [_SequenceFirst, _Sliced])
def test_rows_that_are_not_the_samples_fall_back(registered, kind):
    registered(kind, transposed_linear_rule())
    torch.manual_seed(0)
    module = nn.Sequential(kind(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(20, 1)).double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    routes = _check(module, X, [("0", "fallback"), ("3", "rule")])
    assert routes[0].reason == "the rows of its input are not the samples"


class _Scaled1D(Conv1D):
    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, alpha=2.0)
        return out.view(*x.shape[:-1], self.nf)


def test_a_scaled_addmm_is_declined(registered):
    registered(_Scaled1D, transposed_linear_rule())
    module = nn.Sequential(_Scaled1D(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(20, 1)).double()
    routes = _check(
        module, torch.randn(4, 5, 3, dtype=torch.float64), [("0", "fallback"), ("3", "rule")]
    )
    assert "declines" in routes[0].reason


# ----------------------------------------------------------------------- review (s52)
class _Swapped:
    """A mixin whose properties hand nn.LayerNorm's forward the parameters swapped.

    Listed after nn.LayerNorm, it comes after nn.Module in the MRO: the properties still
    shadow the parameters (nn.Module finds those only when normal lookup fails)."""

    @property
    def weight(self):
        return self._parameters["bias"]

    @property
    def bias(self):
        return self._parameters["weight"]


class _SwappedNorm(nn.LayerNorm, _Swapped):
    def __init__(self, d):
        nn.Module.__init__(self)
        self.normalized_shape, self.eps, self.elementwise_affine = (d,), 1e-5, True
        self._parameters["weight"] = nn.Parameter(torch.randn(d))
        self._parameters["bias"] = nn.Parameter(torch.randn(d))


def _features_unchecked(module, X):
    """The features without the autograd probe (``check_hidden=False``, as a caller that
    ran :func:`hidden_reads` passes), against the loop: only the routes guard them."""
    torch.manual_seed(1)
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    J = _loop(module, params, X)
    phi = tangent_features(module, params, X, output="full", check_hidden=False)
    return float((phi - J).abs().max() / J.abs().max())


def test_a_mixin_after_nn_module_is_seen():
    # The rule reads the parameters by name: with weight and bias swapped in the call it
    # gave each the other's gradient (features 0.37 off, the Gram, a sum over both, not).
    torch.manual_seed(0)
    module = nn.Sequential(_SwappedNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(6, 4, dtype=torch.float64)
    route = layer_routes(module, X)[0]
    assert route.route == "fallback"
    # nn.LayerNorm's rule reads its call alone, so overriding subclasses keep it; the
    # capture checks which argument holds which parameter.
    assert "passes its parameter 'weight' in another argument than 'weight'" in route.reason
    assert _features_unchecked(module, X) < 1e-12


def test_a_class_patched_after_a_lookup_is_seen():
    class Lin(nn.Linear):
        pass

    torch.manual_seed(0)
    module = nn.Sequential(Lin(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(6, 4, dtype=torch.float64)
    assert layer_routes(module, X)[0].route == "rule"
    # The rows reversed around the call: each row's factors are another sample's (the
    # shapes agree; only the autograd probe, left out here, would see it). The parameters
    # are scaled first: read by F.linear alone they would be free parameters on the Linear
    # rule's site, whose rows only that probe checks too, as every rule site's.
    Lin.forward = lambda self, x: F.linear(x.flip(0), self.weight * 1,
                                           self.bias * 1).flip(0)
    assert "it overrides forward of nn.Linear" in layer_routes(module, X)[0].reason
    assert _features_unchecked(module, X) < 1e-12


class _Conv1DNoBias(Conv1D):
    def __init__(self, nf, nx):
        super().__init__(nf, nx)
        self.bias = None

    def forward(self, x):
        return (x.view(-1, x.size(-1)) @ self.weight).view(*x.shape[:-1], self.nf)


class _Rewrites(nn.Module):
    """GPT-2's MLP with an in-place activation after c_fc, and two Conv1D chained."""

    def __init__(self, act, n_out, d=4, S=3):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(6, d), Conv1D(d, 6)
        self.c_fc, self.act, self.mlp_proj = Conv1D(8, d), act, _Conv1DNoBias(d, 8)
        self.head = nn.Linear(S * d, n_out)

    def forward(self, x):
        x = x + self.c_proj(self.c_attn(x))
        x = x + self.mlp_proj(self.act(self.c_fc(x)))
        return self.head(torch.tanh(x).flatten(1))


class _Double(nn.Module):
    def forward(self, x):
        return x.mul_(2)


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), _Double()], ids=["relu_", "mul_"])
def test_an_in_place_op_after_a_transposed_linear_layer(registered, act, n_out):
    # The layer's output was handed on as a view of its site's output: an in-place op on
    # it rewrote the site, which crashed the process (a segmentation fault hooking the
    # view, n_out = 3) or sent the layer to the fallback through the autograd probe
    # (n_out = 1). The second of two chained layers read the first's (rows, out) output,
    # not sample-major, and fell back.
    registered(Conv1D, transposed_linear_rule())
    registered(_Conv1DNoBias, transposed_linear_rule())
    torch.manual_seed(0)
    module = _Rewrites(act, n_out).double()
    X = torch.randn(5, 3, 4, dtype=torch.float64)
    names = ["c_attn", "c_proj", "c_fc", "mlp_proj", "head"]
    _check(module, X, [(n, "rule") for n in names])


class _Abstract(nn.Linear, abc.ABC):
    """abc.ABC's bookkeeping (``__slots__``, ``_abc_impl``) shadows no parameter."""


class _Generic(nn.Linear, Generic[T]):
    pass


def test_abc_and_generic_bases_keep_the_rule():
    module = nn.Sequential(_Abstract(3, 4), nn.Tanh(), _Generic[int](4, 1)).double()
    _check(module, torch.randn(5, 3, dtype=torch.float64), [("0", "rule"), ("2", "rule")])


class _ConvForward1D(Conv1D):
    # Its weight read by an einsum: no rule, and no free parameter's site either (x @ W
    # would be one, ._parameters.product_site).
    def forward(self, x):
        return torch.einsum("nsi,io->nso", x, self.weight) + self.bias


def test_the_reason_names_each_operation_once(registered):
    registered(Conv1D, transposed_linear_rule())
    module = nn.Sequential(_ConvForward1D(2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 1))
    reason = layer_routes(module.double(), torch.randn(3, 4, 3, dtype=torch.float64))[0].reason
    assert "in one call of addmm / matmul / mm / __matmul__ as " in reason


# ------------------------------------------------- LayerNorm subclasses overriding forward
class _TimmLayerNorm2d(nn.LayerNorm):
    """timm.layers.LayerNorm2d as timm 1.0.31 writes it (fast_norm off): the channels of an
    NCHW tensor normalised, channels-last around F.layer_norm."""

    def __init__(self, num_channels, eps=1e-6, affine=True):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine)
        self._fast_norm = False

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _TorchvisionLayerNorm2d(nn.LayerNorm):
    """torchvision.models.convnext.LayerNorm2d as torchvision 0.29.1 writes it."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class _OtherShape(nn.LayerNorm):
    """Does something else than nn.LayerNorm, exactly read by the rule all the same: one
    call over the last two axes, eps of its own, the output scaled and shifted."""

    def forward(self, x):
        return 3 * F.layer_norm(x, x.shape[-2:], self.weight, self.bias, 1e-3) - 1


class _Stem(nn.Module):
    """A ConvNeXt-like stem and block: conv, channel LayerNorm, depthwise conv, norm."""

    def __init__(self, norm, norm2=None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 2, stride=2)
        self.norm = norm(4)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.norm2 = (norm2 or norm)(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(self.conv(x))
        h = h + torch.tanh(self.norm2(self.dw(h)))
        return self.head(h.mean((2, 3)))


_ON_RULE = [("conv", "rule"), ("norm", "rule"), ("dw", "rule"), ("norm2", "rule"),
            ("head", "rule")]


@pytest.mark.parametrize("norm", [_TimmLayerNorm2d, _TorchvisionLayerNorm2d])
def test_layer_norm_subclasses_overriding_forward_keep_the_rule(norm):
    # timm's and torchvision's LayerNorm2d went to the fallback (1.34-1.52x the ConvNeXt
    # kernel's time) until registered by hand; nn.LayerNorm's rule reads its call alone.
    torch.manual_seed(0)
    module = _Stem(norm).double()
    X = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    _check(module, X, _ON_RULE)
    assert check_rule(module, X, rtol=1e-10) <= 1e-10


def test_a_layer_norm_override_computing_something_else_is_read_exactly():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 12), nn.Unflatten(1, (3, 4)), _OtherShape((3, 4)),
                           nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).double()
    X = torch.randn(5, 6, dtype=torch.float64)
    _check(module, X, [("0", "rule"), ("2", "rule"), ("5", "rule")])


class _ScaledWeight(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, 2 * self.weight, self.bias, self.eps)


class _BiasTwice(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps) + self.bias


class _TwoCalls(nn.LayerNorm):
    def forward(self, x):
        y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(y, self.normalized_shape, self.weight, self.bias, self.eps)


class _SwappedCall(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, weight=self.bias, bias=self.weight)


class _RowsReversed(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x.flip(0), self.normalized_shape, self.weight, self.bias).flip(0)


@pytest.mark.parametrize("norm,why", [
    (_ScaledWeight, "read outside the layer's own call"),
    (_BiasTwice, "read outside the layer's own call"),
    (_TwoCalls, "read outside the layer's own call"),
    (_SwappedCall, "passes its parameter 'weight' in another argument than 'weight'"),
    (_RowsReversed, "disagree"),
])
def test_layer_norm_overrides_the_rule_cannot_read_fall_back(norm, why):
    # Each would make the rule's factors wrong; the capture sends them to the exact
    # fallback (the reversed rows through the autograd check of a few samples).
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), norm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    routes = _check(module, X, [("0", "rule"), ("1", "fallback"), ("3", "rule")])
    assert why in routes[1].reason, routes[1].reason
