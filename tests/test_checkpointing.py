"""Networks with activation checkpointing (``torch.utils.checkpoint``: reentrant, not
reentrant, ``checkpoint_sequential``), as large transformers are trained.

Checkpointing changes memory, not the function: every result must be that of the same
network without checkpointing. The references are per-sample autograd loops
(tests/_reference.py) of that network, and fits of it. The engine's forward passes are
called at a recorded point's parameters, away from the module's own: a region recomputed
in the backward pass read the module's parameters instead (wrong values, no error), the
generic fallback's recomputation failed (``CheckpointError``), and a reentrant region
refused ``autograd.grad``.
"""

import contextlib
import copy
import functools
import inspect
import sys
import threading
import types
import warnings
from importlib import import_module

import numpy as np
import pytest
import torch
from _reference import features_loop, jacobian_loop, module_at
from numpy.testing import assert_allclose
from sklearn.frozen import FrozenEstimator
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from benchmarks.audit_checkpointing import REGIONS, Odd, build, plain, set_mode
from benchmarks.audit_checkpointing import Q as QUERIES
from benchmarks.audit_checkpointing import X as X_TRAIN
from benchmarks.audit_checkpointing import Y as Y_TRAIN
from benchmarks.audit_checkpointing import fit as _fit
from skpathkernel import PathKernelMachine, PathRecorder, TangentFeatures
from skpathkernel._checkpoint import (
    _NAMES,
    dispatch_problem,
    plain_checkpoints,
    plain_names,
    warn_if_not_dispatched,
)
from skpathkernel._network._trained import module_outputs
from skpathkernel._tangent import per_sample_jacobian, tangent_features, tangent_gram
from skpathkernel.kernels import PathKernel, TangentKernel, step_kernel

RTOL = 1e-10
MODES = ["nonreentrant", "reentrant", "seq_nonreentrant", "seq_reentrant"]


def _module(kind, mode, n_in=5, n_out=2):
    """The audit's network (Linear, Tanh, a region checkpointed as ``mode`` says, Linear);
    ``saved_inplace``'s ReLU writes in place into the output Tanh saved."""
    module = build(kind, mode)(n_in, n_out)
    set_mode(module, mode, inplace=True if kind == "saved_inplace" else None)
    return module


def _engine_matches_the_loop(module, ref_module):
    """tangent_gram, tangent_features and per_sample_jacobian of ``module`` at parameters
    that are not its own (a recorded point's) against the autograd loop of
    ``ref_module`` (``module`` without checkpointing) holding them; ``module``'s own
    parameters are left as they were."""
    own = [p.detach().clone() for p in module.parameters()]
    params = {k: v.detach() + 0.3 * torch.randn_like(v) for k, v in module.named_parameters()}
    ref_module.load_state_dict(params, strict=False)
    X = torch.from_numpy(QUERIES.copy())
    J = jacobian_loop(ref_module, QUERIES.copy())
    K_ref = torch.einsum("icp,jcp->ij", J, J) / 2
    tol = RTOL * float(K_ref.abs().max())
    assert_allclose(tangent_gram(module, params, X), K_ref, rtol=RTOL, atol=tol)
    assert_allclose(tangent_gram(module, params, X, X[:3].clone()), K_ref[:, :3],
                    rtol=RTOL, atol=tol)
    assert_allclose(tangent_features(module, params, X, output="full"), J, rtol=RTOL,
                    atol=RTOL * float(J.abs().max()))
    jac = per_sample_jacobian(module, params, X, list(params), [0, 1], memory_budget=2**20)
    assert_allclose(torch.cat([jac[k] for k in params], dim=2), J, rtol=RTOL,
                    atol=RTOL * float(J.abs().max()))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), own))


@pytest.mark.parametrize("kind", REGIONS)
@pytest.mark.parametrize("mode", MODES)
def test_engine_at_other_parameters_matches_the_plain_loop(kind, mode):
    """tangent_gram, tangent_features and the fallback's per_sample_jacobian at parameters
    that are not the module's own (a recorded point's), against the autograd loop of the
    network without checkpointing holding them."""
    torch.manual_seed(0)
    module = _module(kind, mode).double().eval()
    with torch.no_grad():  # BatchNorm's running statistics away from 0 and 1
        for m in module.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    ref_module = plain(module)
    _engine_matches_the_loop(module, ref_module)


@pytest.fixture(scope="module")
def twins():
    return {kind: _fit(kind, None) for kind in ("rule", "fallback")}


def _close(got, want, rtol=1e-9):
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("kind", ["rule", "fallback"])
@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_estimators_train_and_analyse_as_the_plain_network(twins, kind, mode):
    """Training through ``module=`` (its own backward passes keep the checkpointing), then
    every analysis along the path: the fit of the same network without checkpointing, and
    the autograd loop at the first recorded point (away from the module's parameters)."""
    twin = twins[kind]
    est = _fit(kind, mode)
    _close(est.trajectory_.parameters(-1).numpy(), twin.trajectory_.parameters(-1).numpy(),
           rtol=1e-12)
    J0 = jacobian_loop(plain(module_at(est, 0)), QUERIES).reshape(len(QUERIES), -1).numpy()
    _close(step_kernel(est, QUERIES, step=0), J0 @ J0.T / 2)
    _close(TangentKernel(est)(QUERIES, X_TRAIN[:3]), TangentKernel(twin)(QUERIES, X_TRAIN[:3]))
    _close(PathKernel(est)(QUERIES), PathKernel(twin)(QUERIES))
    phi = features_loop(plain(module_at(est)), QUERIES)
    _close(est.transform(QUERIES), phi)
    _close(TangentFeatures(FrozenEstimator(est)).fit(X_TRAIN).transform(QUERIES), phi)
    for method in ("exact", "first_order"):
        got, want = est.decompose(QUERIES, method=method), twin.decompose(QUERIES, method=method)
        _close(got.contributions, want.contributions)
        _close(got.prediction, want.prediction)
    for method in ("exact", "unrolled"):
        _close(est.attribute(QUERIES, method=method, output=0),
               twin.attribute(QUERIES, method=method, output=0))


def _recorded(mode):
    """A path recorded from the user's own loop (``.backward()``), as an estimator."""
    module = _module("fallback", mode).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    X, Y = torch.from_numpy(X_TRAIN), torch.from_numpy(Y_TRAIN)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for i in range(3):
            idx = np.arange(8 * (i % 2), 8 * (i % 2) + 8)
            rec.set_batch(idx)
            opt.zero_grad()
            (0.5 * (module(X[idx]) - Y[idx]) ** 2).mean().backward()
            opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rec.as_estimator(X_TRAIN, Y_TRAIN)


@pytest.mark.parametrize("mode", ["nonreentrant", "seq_reentrant"])
def test_a_recorded_path_analyses_as_the_plain_network(mode):
    est, twin = _recorded(mode), _recorded(None)
    _close(TangentKernel(est)(QUERIES), TangentKernel(twin)(QUERIES))
    _close(PathKernel(est)(QUERIES), PathKernel(twin)(QUERIES))
    _close(est.decompose(QUERIES).contributions, twin.decompose(QUERIES).contributions)


def test_the_switch_restores_torch_checkpoint_and_nests():
    # The switch finds what it replaces in this torch: a torch that renames it must fail
    # here, not silently leave the regions to recompute at the module's own parameters.
    import_module("torch.distributed._composable.checkpoint_activation")
    # Each module holds one of the non-reentrant generator's names at least (torch 2.14
    # added the _impl, and the composable checkpoint imports only that one).
    found = {(where, name.removesuffix("_impl")) for where, name in plain_names()}
    assert found == {(where, name.removesuffix("_impl")) for where, name in _NAMES}
    torch_checkpoint = sys.modules["torch.utils.checkpoint"]
    before = {site: getattr(sys.modules[site[0]], site[1]) for site in plain_names()}
    module = _module("rule", "nonreentrant").double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(KeyError, match="raised inside"), plain_checkpoints():
        with plain_checkpoints():
            assert torch_checkpoint.CheckpointFunction is not before[_NAMES[0]]
        assert torch_checkpoint.CheckpointFunction is not before[_NAMES[0]]
        raise KeyError("raised inside")
    assert {site: getattr(sys.modules[site[0]], site[1]) for site in plain_names()} == before
    # Outside the switch the region is checkpointed again: its saved tensors go to the
    # checkpoint's own hooks, not to an outer hook; inside it, plainly, they all do.
    seen = {True: 0, False: 0}

    def counted(inside):
        def pack(t):
            seen[inside] += 1
            return t
        switch = plain_checkpoints() if inside else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), switch:
            out = module(x)
        return torch.autograd.grad(out.sum(), x)[0]

    assert_allclose(counted(True), counted(False), rtol=1e-12)
    assert seen[True] > seen[False] > 0


def test_own_forward_passes_raise_no_checkpoint_warning():
    """The fit's and the verbs' own forward passes without gradients (the input checks,
    the random-forward probe, predict) run the regions plainly too: a reentrant region
    under no_grad warned "None of the inputs have requires_grad=True" from each of them,
    though nothing is differentiated there."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = PathKernelMachine(module=build("rule", "reentrant"), max_iter=2, tol=None,
                                dtype="float64", random_state=0).fit(X_TRAIN, Y_TRAIN)
        est.predict(QUERIES)
        est.score(X_TRAIN, Y_TRAIN)
    assert not [w for w in caught if "requires_grad=True" in str(w.message)]


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch built without torch.distributed")
def test_composable_checkpoint_matches_the_plain_loop():
    """torch.distributed's composable ``checkpoint(module)`` (FSDP2's activation
    checkpointing) imported the generator by name: the switch replaces it there too.
    Before, the capture's second backward pass failed in torch's recomputation."""
    checkpoint_module = import_module("torch.distributed._composable").checkpoint
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 6), nn.Tanh(),
                                                                 Odd(6)),
                        nn.Linear(6, 2)).double()
    ref_module = copy.deepcopy(net)
    checkpoint_module(net[2])
    _engine_matches_the_loop(net, ref_module)


class _Selective(nn.Module):
    """A region under selective activation checkpointing (``context_fn``): the matrix
    products saved, the rest recomputed."""

    def __init__(self, selective=True):
        super().__init__()
        self.selective = selective
        self.a, self.c = nn.Linear(5, 6), nn.Linear(6, 2)
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Odd(6))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.selective:
            h = checkpoint(self.b, h, use_reentrant=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, _save_products))
        else:
            h = self.b(h)
        return self.c(h)


def _save_products(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                 torch.ops.aten.addmm.default)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def test_selective_checkpoint_matches_the_plain_loop():
    """Selective activation checkpointing runs plainly too (its policy does not change
    the function). Before, a Gram away from the module's parameters was wrong without an
    error, and the capture's second backward pass raised ("Trying to backward an extra
    time ... under selective activation checkpoint")."""
    torch.manual_seed(0)
    net = _Selective().double()
    _engine_matches_the_loop(net, _Selective(selective=False).double())


class _Nested(nn.Module):
    """A non-reentrant region holding another: recomputing the outer one in the backward
    pass runs the inner ``checkpoint`` again, and matches the tensors it saves by count."""

    def __init__(self, checkpointed=True):
        super().__init__()
        self.checkpointed = checkpointed
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))

    def _outer(self, h):
        h = torch.tanh(self.a(h))
        h = checkpoint(self.inner, h, use_reentrant=False) if self.checkpointed else self.inner(h)
        return torch.sin(self.b(h)) * h

    def forward(self, x):
        h = checkpoint(self._outer, x, use_reentrant=False) if self.checkpointed else self._outer(x)
        return self.c(h)


def test_another_threads_training_keeps_its_checkpointing():
    """The switch is the process's, the plain calls the thread's in a block: a user's
    training thread whose backward pass recomputes a nested region while an analysis
    runs elsewhere keeps torch's checkpoint. Before, its inner checkpoint ran plainly in
    the recomputation, the outer one matched the wrong saved tensors and the gradients
    were off by 1.7 without an error (6 rows: the shapes agree); its forward passes in
    that window also lost their memory savings."""
    torch.manual_seed(0)
    net, ref = _Nested().double(), _Nested(checkpointed=False).double()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(ref(x).sum(), [x, *ref.parameters()])
    forward_done, analysis_in, got, saved = threading.Event(), threading.Event(), {}, []

    def training():
        out = net(x)
        forward_done.set()
        analysis_in.wait()
        got["grads"] = torch.autograd.grad(out.sum(), [x, *net.parameters()])
        # A forward in the window: torch's checkpoint hides the regions' saved tensors
        # from an outer hook (only the head's Linear saves x's activations here).
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            net(x)

    thread = threading.Thread(target=training)
    thread.start()
    forward_done.wait()
    with plain_checkpoints():
        analysis_in.set()
        thread.join()
    for g, w in zip(got["grads"], want):
        assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        n_checkpointed = len(saved)
        ref(x)
    assert n_checkpointed < len(saved) - n_checkpointed


class _Scaled(nn.Module):
    """A region under a ``context_fn`` whose forward context changes the function (a
    scale its layer reads, as a fake-quantisation switch would): training runs the
    region, and its recomputation, under it."""

    scale = 1.0

    def __init__(self, checkpointed=True):
        super().__init__()
        self.checkpointed = checkpointed
        self.a, self.b, self.c = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def _region(self, h):
        return torch.tanh(self.b(h) * type(self).scale)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.checkpointed:
            return self.c(checkpoint(self._region, h, use_reentrant=False,
                                     context_fn=lambda: (_scaled(), _scaled())))
        with _scaled():
            return self.c(self._region(h))


@contextlib.contextmanager
def _scaled():
    _Scaled.scale = 3.0
    try:
        yield
    finally:
        _Scaled.scale = 1.0


def test_context_fn_forward_context_runs_in_the_engine():
    """The forward context of ``context_fn`` is part of the function that was trained
    (torch runs the region under it where gradients are on): the engine's plain region
    runs under it too, in its no-grad forward passes as well (where torch leaves it
    out), so that predictions and gradients are of one function. Before, the engine left
    it out: a Gram and outputs of another function."""
    torch.manual_seed(0)
    net, ref = _Scaled().double(), _Scaled(checkpointed=False).double()
    _engine_matches_the_loop(net, ref)
    X = torch.from_numpy(QUERIES.copy())
    with torch.no_grad():
        want = ref(X).numpy()
    params = {k: v.detach() for k, v in ref.named_parameters()}  # the loop's, not net's
    assert_allclose(module_outputs(net, X, block=2, params=params), want, rtol=1e-12,
                    atol=1e-12)


def test_a_torch_that_bypasses_the_names_is_reported(monkeypatch):
    """A torch whose ``checkpoint`` no longer goes through the names the switch replaces
    (simulated: torch's own ``checkpoint`` code looking them up under other names) would
    leave the regions to recompute at the module's parameters: the import-time check
    warns, naming each variant missed. This torch passes it."""
    assert dispatch_problem() is None
    ck = sys.modules["torch.utils.checkpoint"]
    renamed = {"CheckpointFunction": "_CheckpointFunctionV2",
               "_checkpoint_without_reentrant_generator": "_generator_v2",
               "_checkpoint_without_reentrant_generator_impl": "_generator_impl_v2"}
    # The function that looks the names up: checkpoint itself, or from torch 2.14 the
    # _checkpoint_impl it calls (checkpoint under torch's dynamo-disable wrapper).
    holder = next(name for name in ("checkpoint", "_checkpoint_impl")
                  if "CheckpointFunction" in inspect.unwrap(getattr(ck, name)).__code__.co_names)
    original = inspect.unwrap(getattr(ck, holder))
    code = original.__code__
    moved = types.FunctionType(code.replace(co_names=tuple(renamed.get(n, n)
                                                           for n in code.co_names)),
                               ck.__dict__, holder, original.__defaults__)
    moved.__kwdefaults__ = original.__kwdefaults__
    for old, new in renamed.items():
        if hasattr(ck, old):
            monkeypatch.setattr(ck, new, getattr(ck, old), raising=False)
            monkeypatch.delattr(ck, old)
    monkeypatch.setattr(ck, holder, moved)
    with pytest.warns(RuntimeWarning, match="no longer goes through") as record:
        warn_if_not_dispatched()
    message = str(record[0].message)
    for variant in ("checkpoint(use_reentrant=False)", "checkpoint(use_reentrant=True)"):
        assert variant in message


def test_a_name_imported_within_the_switch_checkpoints_after_it():
    """A module imported while a block runs takes the installed name: torch's first
    ``checkpoint`` call imports torch._dynamo, which loads torch.distributed's composable
    ``checkpoint`` (FSDP2's), so the first analysis of a checkpointed network left that
    module holding the plain generator for good, and a user's composable checkpointing
    afterwards saved every activation (3 tensors where it saves 1, its input). The name
    now reaches torch's own generator outside the blocks."""
    with plain_checkpoints():
        scope: dict = {}
        exec("from torch.utils.checkpoint import _checkpoint_without_reentrant_generator "
             "as generator", scope)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)

    def saved_by(run):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = run()
        return saved, out

    def checkpointed():  # as torch.distributed's composable checkpoint drives it
        steps = scope["generator"](layer, True, noop_context_fn, "default", False, True, x)
        next(steps)
        out = layer(x)
        with pytest.raises(StopIteration):
            next(steps)
        return out

    saved, out = saved_by(checkpointed)
    assert len(saved) == 1 and saved[0] is x  # the input only: the rest is recomputed
    assert len(saved_by(lambda: layer(x))[0]) > 1
    (g,) = torch.autograd.grad(out.sum(), x)
    assert_allclose(g, torch.autograd.grad(layer(x).sum(), x)[0], rtol=1e-6)
