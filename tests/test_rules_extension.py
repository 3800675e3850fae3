"""The public extension point: a user's rule for a custom layer, routes, the warning."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _reference import jacobian_loop
from torch import nn
from torch.nn.utils import parametrizations

import skpathkernel._tangent._generic as generic_module
from skpathkernel import PathKernelMachine, PathRecorder, RecordedNetwork
from skpathkernel._tangent import capture, tangent_features, tangent_gram
from skpathkernel.rules import (
    FallbackWarning,
    Rule,
    Term,
    check_rule,
    get_rule,
    layer_routes,
    register_rule,
)


class LayerScale(nn.Module):
    """A learned per-channel gain (as in CaiT / ConvNeXt): ``x * gamma``."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x * self.gamma


def _layer_scale_factors(layer, use, deltas, names):
    # z = x * gamma at every position s: d f_c / d gamma = sum_s delta_cs * x_s, a
    # constant-input term whose delta carries x.
    (x,), (delta,) = use.inputs, deltas
    n, C, d = delta.shape[0], delta.shape[1], delta.shape[-1]
    return [Term(delta=(delta * x.unsqueeze(1)).reshape(n, C, -1, d),
                 inputs=[(names["gamma"], None)])]


LAYER_SCALE = Rule(ops=(torch.Tensor.mul,), factors=_layer_scale_factors)


def _network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), LayerScale(4), nn.Tanh(),
                         nn.Linear(4, 4), LayerScale(4), nn.Linear(4, 2)).double()


def test_a_registered_rule_is_used_and_matches_the_loop(registered):
    module = _network()
    params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
    X = torch.randn(6, 3, dtype=torch.float64)
    # Unregistered, x * gamma takes the elementwise parameter rule already.
    routes = layer_routes(module, X)
    assert [(r.name, r.route) for r in routes] == [
        ("0", "rule"), ("1", "rule"), ("3", "rule"), ("4", "rule"), ("5", "rule")]
    assert routes[1].n_params == 4

    calls = []

    def counted(*args):
        calls.append(args[0])
        return _layer_scale_factors(*args)

    rule = Rule(ops=(torch.Tensor.mul,), factors=counted)
    registered(LayerScale, rule)
    assert get_rule(LayerScale) is rule
    assert all(r.route == "rule" for r in layer_routes(module, X))
    assert {id(layer) for layer in calls} == {id(module[1]), id(module[4])}
    assert capture(module, params, X, [0, 1], memory_budget=2**20).fallback == ()
    ref = module
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
    J = jacobian_loop(ref, X)
    K = tangent_gram(module, params, X, output="full")
    assert float((K - torch.einsum("ncp,mdp->ncmd", J, J)).abs().max() / K.abs().max()) < 1e-10
    phi = tangent_features(module, params, X, output="full")
    assert float((phi - J).abs().max() / J.abs().max()) < 1e-10
    assert check_rule(module, X, rtol=1e-10) < 1e-10


def test_check_rule_catches_a_wrong_rule(registered):
    def forgets_x(layer, use, deltas, names):
        (delta,) = deltas
        n, C, d = delta.shape[0], delta.shape[1], delta.shape[-1]
        return [Term(delta=delta.reshape(n, C, -1, d), inputs=[(names["gamma"], None)])]

    registered(LayerScale, Rule(ops=(torch.Tensor.mul,), factors=forgets_x))
    module, X = _network(), torch.randn(4, 3)
    # The engine's autograd check rejects the factors (results stay exact, by the
    # fallback); check_rule says so.
    assert {r.route for r in layer_routes(module, X) if r.type == "LayerScale"} == {"fallback"}
    with pytest.raises(AssertionError, match="1 .LayerScale., 4 .LayerScale. disagree with"):
        check_rule(module, X)


def test_check_rule_fails_a_nan_gram(monkeypatch):
    """A Gram of NaN beside exact features fails the check: the larger of the two errors
    is NaN, which ``max`` would have dropped for the features' round-off."""
    import skpathkernel._tangent._routes as routes

    module, X = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    assert check_rule(module, X) < 1e-10
    monkeypatch.setattr(routes, "tangent_gram",
                        lambda *a, **k: torch.full_like(tangent_gram(*a, **k), float("nan")))
    with pytest.raises(AssertionError, match="differs from autograd by nan"):
        check_rule(module, X)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("n", "C"), [(2, 2), (3, 3), (4, 2), (3, 1)])
def test_check_rule_passes_prelu_whatever_the_samples_and_outputs(n, C):
    """nn.PReLU's rule is exact (against the autograd loop here), and check_rule says so:
    its reference was torch.func's vmap(jacrev), which for prelu returns wrong numbers
    when the samples are as many as the outputs (the check blamed the rules by 0.2-0.5)
    and raises otherwise (a RuntimeError of torch)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv1d(2, 4, 3), nn.PReLU(4), nn.Flatten(), nn.Linear(16, 4),
                           nn.PReLU(), nn.Linear(4, C)).double()
    X = torch.randn(n, 2, 6, dtype=torch.float64)
    assert [r.route for r in layer_routes(module, X)] == ["rule"] * 5
    params = {k: v.detach() for k, v in module.named_parameters()}
    J = jacobian_loop(module, X)
    phi = tangent_features(module, params, X, output="full")
    assert float((phi - J).abs().max() / J.abs().max()) < 1e-12
    assert check_rule(module, X, rtol=1e-12) < 1e-12


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_routes_name_a_parametrization_as_the_reason_it_falls_back(registered):
    """A weight-normed layer's class is torch's ParametrizedLinear: the reason told the
    user to register nn.Linear's rule for it, which reads the weight the parametrization
    computes and falls back all the same (numbers exact either way); and its parameters'
    holder was "a raw nn.Parameter used in its forward"."""
    torch.manual_seed(0)
    net = nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 4)), nn.Tanh(),
                        nn.Linear(4, 2)).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    routes = layer_routes(net, X)
    # The layer's own raw bias, read by its F.linear, is a free parameter on the Linear
    # rule's site (._parameters.product_site); the parametrization's tensors fall back.
    assert [(r.name, r.route) for r in routes] == [
        ("0", "rule"), ("0.parametrizations.weight", "fallback"), ("2", "rule")]
    assert routes[1].reason.startswith("the parameters of a parametrization")
    assert all("register_rule" not in r.reason and "raw nn.Parameter" not in r.reason
               for r in routes)
    # Following the old advice changes nothing: the layer still falls back, exactly.
    registered(type(net[0]), get_rule(nn.Linear))
    assert layer_routes(net, X)[0].route == "fallback"
    params = {k: v.detach() for k, v in net.named_parameters()}
    J = jacobian_loop(net, X)
    phi = tangent_features(net, params, X, output="full")
    assert float((phi - J).abs().max() / J.abs().max()) < 1e-12


@pytest.mark.parametrize(("X", "error", "match"), [
    (torch.empty(0, 3), ValueError, r"non-empty array of shape \(n_samples, \.\.\.\)"),
    (np.zeros((0, 3)), ValueError, r"got shape \(0, 3\)"),
    (torch.tensor(1.0), ValueError, r"got shape \(\)"),
    (torch.ones(2, 3, dtype=torch.complex128), TypeError, "real numbers or integer token ids"),
    (np.ones((2, 3), dtype=bool), TypeError, "got torch.bool"),
])
def test_routes_and_check_refuse_inputs_the_engine_refuses(X, error, match):
    # Empty X failed in a reshape of the probe's forward pass (a raw RuntimeError);
    # complex and boolean X were cast to int64 token ids.
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    for call in (layer_routes, check_rule):
        with pytest.raises(error, match=match):
            call(module, X)


class _Encoder(nn.Module):
    """A batch-first wrapper of an encoder layer of either layout."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.enc = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.enc(x) if self.batch_first else self.enc(x.transpose(0, 1)).transpose(0, 1)
        return self.head(h.mean(1))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_encoder_layer_routes_are_as_the_guide_says():
    """The guide and the rules' module say which layout of nn.TransformerEncoderLayer is
    structured end to end: they claimed every layout was."""
    torch.manual_seed(0)
    X = torch.randn(4, 5, 8, dtype=torch.float64)
    routes = layer_routes(_Encoder(batch_first=True).double().eval(), X)
    assert {r.route for r in routes} == {"rule"}
    module = _Encoder(batch_first=False).double().eval()
    routes = {r.name: r for r in layer_routes(module, X)}
    assert routes["enc.self_attn"].route == routes["head"].route == "rule"
    for name in ("enc.linear1", "enc.linear2", "enc.norm1", "enc.norm2"):
        assert routes[name].route == "fallback"
        assert routes[name].reason == "the rows of its input are not the samples"
    assert check_rule(module, X, rtol=1e-10) < 1e-10  # exact all the same
    guide = (Path(__file__).resolve().parent.parent
             / "docs/user_guide/custom_layers.rst").read_text()
    assert "``nn.TransformerEncoderLayer`` (``batch_first=True``" in guide


def test_a_rule_with_wrong_sizes_is_named(registered):
    def too_wide(layer, use, deltas, names):
        (x,), (delta,) = use.inputs, deltas
        return [Term(delta=delta.reshape(len(x), delta.shape[1], -1)[:, :, None],
                     inputs=[(names["gamma"], x.reshape(len(x), 1, -1))])]

    registered(LayerScale, Rule(ops=(torch.Tensor.mul,), factors=too_wide))
    module = _network()
    with pytest.raises(ValueError, match="rule for LayerScale gives '1.gamma' 16 gradient"):
        tangent_gram(module, dict(module.named_parameters()), torch.randn(3, 3,
                                                                         dtype=torch.float64))


def test_bad_registrations():
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        register_rule(int, LAYER_SCALE)
    with pytest.raises(TypeError, match="must be a Rule"):
        register_rule(LayerScale, _layer_scale_factors)
    with pytest.raises(ValueError, match="ops"):
        register_rule(LayerScale, Rule(ops=(), factors=_layer_scale_factors))


class _MyLinear(nn.Linear):
    """A subclass overriding forward: not covered by nn.Linear's rule until registered
    (one keeping nn.Linear's forward takes its rule: tests/test_rules_inherited.py). It
    reads its weight by ``torch.einsum``, which no free parameter's site takes (s55:
    ``F.linear(x, weight=self.weight, bias=self.bias)``, as this test read it before, is a
    matrix-product site of the Linear rule, ._parameters.product_site, like the call by
    position)."""

    def forward(self, x):
        return torch.einsum("ni,oi->no", x, self.weight) + self.bias


def test_a_subclass_falls_back_with_the_registration_to_make():
    module = nn.Sequential(_MyLinear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    route = layer_routes(module, X)[0]
    assert route.route == "fallback"
    assert f"register_rule({__name__}._MyLinear, get_rule(nn.Linear))" in route.reason


class _KeywordLinear(nn.Linear):
    """A subclass overriding forward with nn.Linear's call, the arguments by keyword."""

    def forward(self, x):
        return nn.functional.linear(x, weight=self.weight, bias=self.bias)


def test_a_subclass_runs_on_the_rule_registered_or_not(registered):
    # Unregistered, its raw parameters are a product site of the Linear rule (s55: the
    # keyword call fell back); registered, the layer's own rule: the same numbers.
    module = nn.Sequential(_KeywordLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    J = jacobian_loop(module, X)
    params = dict(module.named_parameters())
    for register in (False, True):
        if register:
            registered(_KeywordLinear, get_rule(nn.Linear))
        assert [r.route for r in layer_routes(module, X)] == ["rule", "rule"]
        K = tangent_gram(module, params, X, output="full")
        assert torch.allclose(K, torch.einsum("ncp,mdp->ncmd", J, J), rtol=1e-10, atol=1e-12)


class Linear(nn.Linear):
    """A library's subclass named as torch's layer, overriding forward (as timm's
    LayerNorm does; nn.LayerNorm's rule now reaches such subclasses, nn.Linear's not)."""

    def forward(self, x):  # the weight by einsum, as _MyLinear's
        return torch.einsum("ni,oi->no", x, self.weight) + self.bias


def test_a_subclass_named_as_its_base_is_told_apart_from_it():
    # The reason read "register_rule(LayerNorm, get_rule(LayerNorm))" for timm's
    # LayerNorm: the two classes are now named by their import paths.
    module = nn.Sequential(nn.Linear(3, 4), Linear(4, 4), nn.Linear(4, 1)).double()
    route = layer_routes(module, torch.randn(4, 3, dtype=torch.float64))[1]
    assert route.route == "fallback"
    assert (f"no rule for {__name__}.Linear: it overrides forward of nn.Linear, "
            "whose rule covers the subclasses that keep its forward; if its forward reads "
            "its parameters in one call of linear as nn.Linear's does, "
            f"register_rule({__name__}.Linear, get_rule(nn.Linear))") == route.reason


def test_routes_say_why_a_layer_falls_back():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)
            self.emb = nn.Embedding(5, 3)

        def forward(self, x):
            h = self.a(torch.tanh(self.a(x))) + self.emb(torch.arange(3))[0]
            return self.b(h) + self.a.weight.sum()

    routes = {r.name: r for r in layer_routes(Twice().double(),
                                              torch.randn(4, 3, dtype=torch.float64))}
    assert routes["a"].reason == "a parameter is read outside the layer's own call"
    assert routes["emb"].reason == "the rows of its input are not the samples"
    assert routes["b"].route == "rule"


class _TiedHead(nn.Module):
    """A language-model head sharing the embedding's weight (no bias of its own)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def test_routes_list_a_head_whose_only_weight_is_tied():
    # The head held no parameter under its own name (named_parameters names the tied
    # weight at the embedding), so layer_routes left it out of the listing; both are on
    # their rules (the tied weight's term sums its two uses).
    net = _TiedHead()
    routes = {r.name: r for r in layer_routes(net, torch.randint(10, (5, 3)))}
    assert set(routes) == {"emb", "head"}
    assert routes["head"].route == "rule"
    assert routes["head"].reason == ""
    assert sum(r.n_params for r in routes.values()) == sum(p.numel() for p in net.parameters())


def test_routes_of_a_layer_used_twice_and_of_tied_weights():
    # The same nn.Linear at two places of a Sequential, and two Linears sharing a weight,
    # went to the fallback; each use is now a term of the rule, summed per parameter.
    lin = nn.Linear(4, 4)
    X = torch.randn(3, 4)
    twice = layer_routes(nn.Sequential(lin, nn.Tanh(), lin), X)
    assert [(r.name, r.route) for r in twice] == [("0", "rule")]
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    tied = layer_routes(nn.Sequential(a, nn.Tanh(), b), X)
    assert [(r.route, r.reason) for r in tied] == [("rule", "")] * 2
    # Exact either way: the features are the autograd loop's.
    for net in (nn.Sequential(lin, nn.Tanh(), lin), nn.Sequential(a, nn.Tanh(), b)):
        net = net.double()
        X64 = X.double()
        params = {k: v.detach() for k, v in net.named_parameters()}
        J = jacobian_loop(net, X64)
        phi = tangent_features(net, params, X64, output="full")
        assert torch.allclose(phi.reshape(J.shape), J, atol=1e-12)


def test_routes_name_a_training_mode_dropout_as_the_reason_rules_disagree():
    """Every pass of a training-mode Dropout draws anew, so the autograd check rejects
    the rules of the layers around it: the reason said "a wrong rule, or a parameter
    read where torch functions do not see it", and never named the dropout."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1)).double()
    X = torch.randn(3, 4, dtype=torch.float64)
    routes = layer_routes(net, X)
    assert [r.route for r in routes] == ["fallback", "fallback"]
    for r in routes:
        assert r.reason.startswith("its factors disagree with autograd")
        assert r.reason.endswith("layer '1' draws at random in training mode, so no two "
                                 "passes agree: call module.eval()")
    assert [r.route for r in layer_routes(net.eval(), X)] == ["rule", "rule"]
    with pytest.raises(AssertionError, match="disagree with autograd"):
        check_rule(net.train(), X)


# ---------------------------------------------------------------------- the warning
class _Fallback(nn.Module):
    def __init__(self, n_in, n_out, slow):
        super().__init__()
        self.fast = nn.Linear(n_in, 8)
        self.slow = (_MyLinear if slow else nn.Linear)(8, 8)
        self.head = nn.Linear(8, n_out)

    def forward(self, x):
        return self.head(torch.tanh(self.slow(torch.tanh(self.fast(x)))))


@pytest.mark.parametrize("slow", [False, True])
def test_one_warning_per_fit_when_fallback_layers_hold_much(slow):
    X = np.random.RandomState(0).uniform(-1, 1, size=(12, 3))
    y = X[:, 0]
    est = PathKernelMachine(module=lambda n_in, n_out: _Fallback(n_in, n_out, slow),
                            max_iter=2, random_state=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        est.fit(X, y)
    fallback = [w for w in seen if issubclass(w.category, FallbackWarning)]
    assert len(fallback) == (1 if slow else 0)
    if slow:
        # 72 of 113 parameters: the share, the layer and the reason are named.
        assert "64%" in str(fallback[0].message) and "slow (_MyLinear, 72" in str(
            fallback[0].message)


def _fallback_loop(slow):
    """``(X, module, recorder)``: two SGD steps of a plain loop on ``_Fallback``."""
    X = np.random.RandomState(0).uniform(-1, 1, size=(12, 3))
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(X[:, :1])
    torch.manual_seed(0)
    module = _Fallback(3, 1, slow).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            opt.step()
    return X, module, rec


def _assert_one_fallback_warning(seen, slow):
    """The slow layer's FallbackWarning, once and at the user's line; none without it."""
    fallback = [w for w in seen if issubclass(w.category, FallbackWarning)]
    assert len(fallback) == (1 if slow else 0)
    if slow:
        assert "slow (_MyLinear, 72" in str(fallback[0].message)
        assert fallback[0].filename == __file__  # the user's line


@pytest.mark.parametrize("slow", [False, True])
def test_a_recorded_loop_warns_as_the_fit_does(slow):
    # A user's own loop reached the same fallback without a word: only the estimators'
    # fit warned. Building its network with the training inputs now warns the same.
    X, module, rec = _fallback_loop(slow)
    for build in (lambda: rec.as_network(X), lambda: RecordedNetwork(module, rec.trajectory,
                                                                      X_train=X)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            build()
        _assert_one_fallback_warning(seen, slow)


@pytest.mark.parametrize("slow", [False, True])
def test_a_recorded_loop_without_its_training_inputs_warns_at_its_first_analysis(slow):
    # Without X_train (a pretrained model's one-point path, as_network()) nothing probed
    # the routes: the loop's kernels took the fallback without the warning the fit and a
    # loop with X_train give. Its first analysis's inputs are probed, once.
    X, module, rec = _fallback_loop(slow)
    J = torch.func.jacrev(lambda p: torch.func.functional_call(
        module, p, (torch.as_tensor(X[:4]),)))(dict(module.named_parameters()))
    J = torch.cat([j.reshape(4, -1) for j in J.values()], dim=1).detach().numpy()
    for build in (rec.as_estimator, lambda: RecordedNetwork(module, rec.trajectory)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            net = build()
            assert not [w for w in seen if issubclass(w.category, FallbackWarning)]
            K = net.tangent_kernel_(X[:4])
            net.tangent_kernel_(X[:4])  # once: the second analysis says nothing more
            # Nor one of inputs of another form, checked anew (float32 rows).
            net.tangent_kernel_(X[:4].astype(np.float32))
        # The kernel the warning is about, the dense Jacobian's (by torch.func).
        np.testing.assert_allclose(K, J @ J.T, rtol=1e-10)
        _assert_one_fallback_warning(seen, slow)


def test_the_user_guide_code_runs(registered):
    guide = Path(__file__).resolve().parent.parent / "docs/user_guide/custom_layers.rst"
    # The block after a ``skip: next`` needs timm, torchvision and transformers.
    found = re.findall(r"(\.\. skip: next\n\n)?\.\. code-block:: python\n\n(.*?)(?=\n\S)",
                       guide.read_text(), flags=re.S)
    blocks = [block for skip, block in found if not skip]
    assert (len(blocks), len(found)) == (6, 7)
    namespace = {}
    for block in blocks:
        exec(compile(re.sub(r"^    ", "", block, flags=re.M), str(guide), "exec"), namespace)
    assert namespace["error"] < 1e-10
    # The checkpointing section's two fits, with and without the region.
    assert namespace["K_checkpointed"].shape == (5, 5)
    # The table lookup's rule hands the engine ids (an index term), and is used.
    tokens, ids = namespace["tokens"], namespace["ids"]
    assert [r.route for r in layer_routes(tokens, ids)] == ["rule", "rule"]
    # A subclass keeping nn.Linear's forward, and one registered.
    mixed = namespace["mixed"]
    assert [r.route for r in layer_routes(mixed, namespace["X_mixed"])] == ["rule", "rule"]


class _MaskBranch(nn.Module):
    """A Hugging Face model's pattern: the forward branches on its mask's values (which
    torch.func's vmap refuses), and a small raw parameter read by a tensordot (a
    position table read by rows that are not the samples, in the trial) falls back."""

    def __init__(self, n_outputs=2):
        super().__init__()
        self.emb = nn.Embedding(12, 16)
        self.body = nn.Linear(16, 64)
        self.mix = nn.Parameter(torch.randn(64, 2) / 8)
        self.head = nn.Linear(2, n_outputs)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).to(self.mix.dtype)
        h = torch.tanh(torch.tensordot(self.body(self.emb(ids)), self.mix, dims=1))
        if (mask == 1).all():  # data-dependent control flow, as HF's mask code has
            pooled = h.mean(1)
        else:
            pooled = (h * mask).sum(1) / mask.sum(1).clamp_min(1)
        return self.head(pooled)


def test_routes_and_the_fit_say_when_the_fallback_cannot_batch_the_network():
    # A 2-layer Hugging Face BERT's position table (4.6% of its parameters) fell back
    # without a warning, and its tangent kernel took 8.9x the time of the same model on
    # rules: vmap refuses the model's forward, so the fallback looped over the samples.
    torch.manual_seed(0)
    module = _MaskBranch().double()
    ids = torch.randint(0, 12, (6, 5))
    routes = {r.name: r for r in layer_routes(module, ids)}
    assert routes[""].route == "fallback"
    assert sum(r.n_params for r in routes.values() if r.route == "fallback") < 0.1 * sum(
        r.n_params for r in routes.values())
    assert routes[""].loops and not routes["head"].loops
    assert "torch.func cannot batch this network's forward" in routes[""].reason
    assert "one sample and output at a time" in routes[""].reason
    assert routes["head"].route == "rule"
    est = PathKernelMachine(module=lambda n_in, n_out: _MaskBranch(n_out), max_iter=1, tol=None,
                            dtype="float64", random_state=0)
    with pytest.warns(FallbackWarning, match=r"(?s)cannot batch.*one sample and output"):
        est.fit(ids.numpy(), np.arange(6.0))
    # Where vmap batches it, the reason is the fallback's own, and a small share is quiet.
    module.forward = lambda ids: module.head(torch.tanh(torch.tensordot(
        module.body(module.emb(ids)), module.mix, dims=1)).mean(1))
    (route,) = [r for r in layer_routes(module, ids) if r.route == "fallback"]
    assert not route.loops and "cannot batch" not in route.reason


class _WideFallback(nn.Module):
    """A raw matrix read by a tensordot (the fallback) under a head of many outputs,
    as an ImageNet classifier's 1000."""

    def __init__(self, width=48, n_outputs=200):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.mix = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x):
        return self.head(torch.tanh(torch.tensordot(torch.tanh(self.inp(x)), self.mix,
                                                    dims=1)))


def test_the_batching_probe_differentiates_one_output_whatever_their_number(monkeypatch):
    # layer_routes' probe of whether torch.func batches the network formed the Jacobian
    # of every output for two samples, outside the memory budget: 2.6 GB more at a fit of
    # a 0.26M-parameter fallback under 1000 outputs (benchmarks/results/
    # review-libs-s51.md). Batching does not depend on the outputs' number: one is probed.
    formed = []
    run = generic_module._run_batched

    def spy(jac, free, xb):
        out = run(jac, free, xb)
        formed.append(max(v.numel() for v in out.values()))
        return out

    monkeypatch.setattr(generic_module, "_run_batched", spy)
    torch.manual_seed(0)
    module = _WideFallback().double()
    routes = {r.name: r for r in layer_routes(module, torch.randn(4, 5, dtype=torch.float64))}
    assert routes[""].route == "fallback" and not routes[""].loops
    assert "cannot batch" not in routes[""].reason
    assert formed and max(formed) <= 2 * module.mix.numel(), formed


def test_a_probe_out_of_cpu_memory_is_not_called_a_batching_failure(monkeypatch):
    # torch's CPU allocator fails with a RuntimeError, which the probe read as vmap
    # refusing the network: the routes then said the fallback loops over the samples,
    # and every fit warned at any share.
    def out_of_memory(jac, free, xb):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                           "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "40000000000 bytes.")

    monkeypatch.setattr(generic_module, "_run_batched", out_of_memory)
    torch.manual_seed(0)
    module = _WideFallback(n_outputs=2).double()
    route = [r for r in layer_routes(module, torch.randn(4, 5, dtype=torch.float64))
             if r.route == "fallback"]
    assert [r.name for r in route] == [""]
    assert not route[0].loops and "cannot batch" not in route[0].reason, route[0].reason


class _Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def _expand_returning_z(layer, func, args, kwargs):
    z = func(*args, **kwargs)
    return z, [(args[0], z)]


def _proj_factors(layer, use, deltas, names):
    return [Term(deltas[0], [(names["weight"], use.inputs[0])])]


@pytest.mark.parametrize("n_out", [1, 3])
def test_an_expand_handing_on_its_site_output_is_copied(registered, n_out):
    # A user's expand returning z itself: the in-place ReLU after it rewrote the site,
    # whose backprops were then the ReLU output's (features 0.05 and 0.10 off without the
    # autograd probe, which is how a path kernel calls the engine after hidden_reads).
    registered(
        _Proj,
        Rule(ops=(torch.nn.functional.linear,), factors=_proj_factors, expand=_expand_returning_z),
    )
    torch.manual_seed(0)
    net = nn.Sequential(_Proj(), nn.ReLU(inplace=True), nn.Linear(3, n_out)).double()
    X = torch.randn(5, 4, dtype=torch.float64)
    params = dict(net.named_parameters())
    assert [r.route for r in layer_routes(net, X)] == ["rule", "rule"]
    J = jacobian_loop(net, X)
    phi = tangent_features(net, params, X, output="full", check_hidden=False)
    assert float((phi - J).abs().max() / J.abs().max()) < 1e-12
