"""One watched forward pass, one backward pass per output: the layers' factors.

The capture runs ``functional_call(module, params, (X,))`` under a torch-function mode
(:class:`_UseWatch`) that takes, for every layer with a rule (:mod:`._rules`), the input
``a`` and output ``z`` of the layer's own operation (``F.linear`` for nn.Linear); then, for
every requested output ``c``, ``grad(f[:, c].sum(), z)`` gives the backprops ``delta_c``
of all the layers at once. Samples are independent (the modules have no cross-sample
state), so the gradient of the sum is the per-sample gradient.

A layer goes to the generic fallback instead (:mod:`._generic`) when its rule does not
accept its input (e.g. a Linear on a 3-D input), when it runs more than once per forward
(its factors would need a sum over the calls), when one of its parameters is shared with
another module (tied weights: the rule would see one use only), or when one of its
parameters is read in any other way than the layer's own operation (a parent's
``x @ self.lin.weight.T``, a forward hook, a patched ``forward``: see
:class:`_UseWatch`, and :func:`_numerical_misfits` for reads torch functions do not see).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ._generic import per_sample_jacobian
from ._rules import RULES, Term

__all__ = ["Capture", "capture", "forward", "value_dtype"]


def value_dtype(params: Mapping[str, torch.Tensor], X: torch.Tensor) -> torch.dtype:
    """The dtype of the engine's results: X's, or the parameters' for integer X (token
    ids, which an embedding maps into the parameters' dtype)."""
    if X.is_floating_point() or X.is_complex():
        return X.dtype
    return next(iter(params.values())).dtype


@dataclass
class Capture:
    """Factors of the per-sample gradients of a block of samples.

    ``terms`` cover every parameter of ``params`` exactly once; ``fallback`` names the
    parameters whose terms are dense Jacobians from the generic fallback; ``exclude``
    names the parameters whose layers were sent to the fallback because a parameter of
    theirs is read outside the layer (given by the caller or found by this capture).
    """

    terms: list[Term]
    fallback: tuple[str, ...]
    exclude: frozenset[str] = frozenset()

    def nbytes(self) -> int:
        size = 0
        for term in self.terms:
            size += term.delta.numel() * term.delta.element_size()
            size += sum(a.numel() * a.element_size() for _, a in term.inputs if a is not None)
        return size


def forward(module: torch.nn.Module, params: Mapping[str, torch.Tensor],
            X: torch.Tensor) -> torch.Tensor:
    """Network outputs ``(n_samples, n_outputs)`` at ``params``."""
    with torch.no_grad():
        out = functional_call(module, dict(params), (X,))
    return out.reshape(X.shape[0], -1)


def _rule_layers(module, params, exclude=frozenset()):
    """Layers with a rule, their rule, and their differentiated parameters' names.

    Layers holding a parameter named in ``exclude`` are left to the fallback.
    """
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    layers = []
    for prefix, layer in module.named_modules():
        rule = RULES.get(type(layer))
        if rule is None:
            continue
        names = {}
        shared = False
        for local, p in layer.named_parameters(recurse=False):
            full = f"{prefix}.{local}" if prefix else local
            shared |= uses[id(p)] > 1
            if full in params:
                names[local] = full
        if names and not shared and not exclude.intersection(names.values()):
            layers.append((layer, rule, names))
    return layers


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


_LIKE = frozenset({torch.Tensor.to, torch.Tensor.type_as})


class _Frame:
    """One running call of a rule layer: its own parameter read, once, gives the factors."""

    __slots__ = ("layer", "factors")

    def __init__(self, layer: int):
        self.layer = layer
        self.factors: tuple[torch.Tensor, torch.Tensor] | None = None


class _UseWatch(TorchFunctionMode):
    """Sees how a forward pass reads the rule layers' parameters, and takes the factors.

    A rule only knows its layer's own operation (``F.linear(a, W, b)`` for nn.Linear):
    if a parameter is read any other way (``x @ self.lin.weight.T`` in a parent, a
    forward hook, a patched ``forward``, ``W * W`` inside the layer, a second
    ``F.linear`` with the same weight), the factors miss part of the gradient. Every
    torch function called during the forward passes through here. Exactly one call of
    one of the rule's ``ops`` by the innermost running rule layer, on that layer's own
    parameters, is the layer's use: its input ``a`` and output ``z`` are the factors
    (``z`` is handed on as a copy, so an in-place op downstream cannot rewrite it). Any
    other call that takes a watched parameter and returns a tensor gradients can flow
    through marks the parameter; so does any call under disabled grad (a custom
    ``autograd.Function``'s ``forward``, whose backward may route a gradient to it).
    Metadata reads (``.shape``, ``.size()``) return no tensor and are ignored. This is
    structural: it holds on every sample, whatever the parameter values. Code that torch
    functions do not see (TorchScript, C++ extensions, ``DisableTorchFunction``) is not
    watched here: :func:`_numerical_misfits` checks one sample for it.

    The mode is thread-local; the hooks that maintain ``frames`` live on the module and
    fire in every thread, so they ignore calls from other threads.
    """

    def __init__(self, owners: dict[int, tuple[int, str]], ops: dict[int, tuple]):
        super().__init__()
        self.owners, self.ops = owners, ops
        # The own call must take every differentiated parameter of its layer: the rule
        # gives each of them a term.
        self.expected: dict[int, set[str]] = {}
        for layer, name in owners.values():
            self.expected.setdefault(layer, set()).add(name)
        self.thread = threading.get_ident()
        self.frames: list[_Frame] = []
        self.factors: dict[int, list] = {layer: [] for layer in ops}
        self.misfits: set[str] = set()

    def enter(self, layer) -> None:
        if threading.get_ident() == self.thread:
            self.frames.append(_Frame(id(layer)))

    def leave(self, layer) -> None:
        if threading.get_ident() != self.thread:
            return
        # Runs even when the layer raised (always_call): no frame outlives its call.
        while self.frames:
            frame = self.frames.pop()
            if frame.layer == id(layer):
                self.factors[frame.layer].append(frame.factors)
                return

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owned = {self.owners[id(t)] for t in _tensors((args, kwargs)) if id(t) in self.owners}
        if not owned:
            return out
        top = self.frames[-1] if self.frames else None
        if (top is not None and top.factors is None and func in self.ops[top.layer]
                and {name for _, name in owned} == self.expected[top.layer]
                and all(layer == top.layer for layer, _ in owned)
                and args and isinstance(args[0], torch.Tensor)
                and isinstance(out, torch.Tensor) and out.requires_grad):
            top.factors = (args[0], out)
            return out.clone()
        if func in _LIKE and not (args and id(args[0]) in self.owners):
            return out  # h.to(W), h.type_as(W): W only lends its dtype and device
        if any(not torch.is_grad_enabled() or o.requires_grad for o in _tensors(out)):
            self.misfits.update(name for _, name in owned)
        return out


def capture(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    outputs: Sequence[int],
    *,
    memory_budget: int,
    exclude: frozenset[str] = frozenset(),
) -> Capture:
    """Kronecker factors (rule layers) and dense Jacobians (the rest) for the rows of X.

    Parameters
    ----------
    module : torch.nn.Module
    params : mapping of str to torch.Tensor
        The differentiated parameters (the others are the module's own, held fixed).
    X : torch.Tensor of shape (n_samples, n_features)
    outputs : sequence of int
        The outputs ``c`` whose gradients are wanted; ``delta`` has ``len(outputs)``
        columns in this order.
    memory_budget : int
        Bytes for the fallback's Jacobian chunks.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the fallback, on top of those this capture finds
        read outside their layer (the returned ``Capture.exclude`` holds both).
    """
    layers = _rule_layers(module, params, exclude)
    # Parameters that require grad give every layer output a graph back to f; only the
    # layer outputs are differentiated, so no parameter gradient is ever computed.
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    watch = _UseWatch({id(live[full]): (id(layer), full)
                       for layer, _, names in layers for full in names.values()},
                      {id(layer): rule.ops for layer, rule, _ in layers})
    handles = []
    for layer, _, _ in layers:
        handles.append(layer.register_forward_pre_hook(lambda lay, args: watch.enter(lay)))
        handles.append(layer.register_forward_hook(lambda lay, args, out: watch.leave(lay),
                                                   always_call=True))
    try:
        with torch.enable_grad(), watch:
            f = functional_call(module, live, (X,)).reshape(X.shape[0], -1)
    finally:
        for h in handles:
            h.remove()
    if watch.misfits:
        # Every parameter of a layer with a misread parameter goes to the fallback.
        return capture(module, params, X, outputs, memory_budget=memory_budget,
                       exclude=exclude | frozenset(watch.misfits))

    accepted, unaligned = [], set()
    for layer, rule, names in layers:
        calls = watch.factors[id(layer)]
        # One call that read its parameters once through the rule's op; a layer called
        # twice (its factors would need a sum) or that never read them goes to the fallback.
        if len(calls) != 1 or calls[0] is None or not rule.accepts(layer, calls[0][0]):
            continue
        a, z = calls[0]
        if a.shape[0] != X.shape[0] or z.shape[0] != X.shape[0]:
            # Rows that are not the samples (a constant input, a subset of the rows): the
            # factors cannot be per-sample. Marked, so that every block routes it alike.
            unaligned.update(names.values())
            continue
        accepted.append((layer, rule, names, a.detach(), z))
    if unaligned:
        return capture(module, params, X, outputs, memory_budget=memory_budget,
                       exclude=exclude | frozenset(unaligned))

    terms_by_name: dict[str, Term] = {}
    if accepted:
        zs = [z for *_, z in accepted]
        grads = []
        for i, c in enumerate(outputs):
            g = torch.autograd.grad(f[:, c].sum(), zs, retain_graph=i < len(outputs) - 1,
                                    allow_unused=True)
            grads.append([torch.zeros_like(z) if gz is None else gz for z, gz in zip(zs, g)])
        for j, (layer, rule, names, a, _) in enumerate(accepted):
            delta = (grads[0][j].unsqueeze(1) if len(grads) == 1
                     else torch.stack([g[j] for g in grads], dim=1)).detach()
            for term in rule.factors(layer, a, delta, names):
                for name, _ in term.inputs:
                    terms_by_name[name] = term
    del f, live

    # A rule layer's parameter that its rule leaves without a term (an extra parameter
    # registered on an nn.Linear) is covered by the fallback like any other.
    fallback = tuple(name for name in params if name not in terms_by_name)
    if fallback:
        jac = per_sample_jacobian(module, params, X, fallback, outputs,
                                  memory_budget=memory_budget)
        for name in fallback:
            terms_by_name[name] = Term(delta=jac[name], inputs=[(name, None)])
    # Flat (trajectory) order of the terms' first parameters keeps every output stable.
    order = {name: i for i, name in enumerate(params)}
    unique = {id(t): t for t in terms_by_name.values()}.values()
    terms = sorted(unique, key=lambda t: order[t.inputs[0][0]])
    return Capture(terms=terms, fallback=fallback, exclude=exclude)


def _numerical_misfits(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    cap: Capture,
    outputs: Sequence[int],
) -> frozenset[str]:
    """Rule-covered parameters whose factors disagree with autograd on a few samples.

    The second line behind :class:`_UseWatch`, for what it cannot see: reads of a
    parameter hidden from torch functions (a TorchScript function or a C++ extension
    taking ``self.lin.weight`` in a parent's ``forward``), and rows reordered before a
    layer (``x.flip(0)``), which break the row-per-sample alignment of the factors. One
    backward pass per output over the rows of ``x`` (two where there are two, so that
    a swap shows; ``cap`` is their capture) catches these unless their gradient
    vanishes there; the parameters returned here must go to the fallback.
    """
    covered = [name for term in cap.terms for name, _ in term.inputs
               if name not in cap.fallback]
    if not covered:
        return frozenset()
    factors = {name: (term.delta, a) for term in cap.terms for name, a in term.inputs}
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        f = functional_call(module, live, (x,)).reshape(x.shape[0], -1)
    # A weight's gradient g (p x q) is compared through a random direction v: g v against
    # delta (a . v). A read the factors miss adds E != 0 to g, and E v != 0 for almost
    # every v: one pass over g instead of forming the outer product and the difference.
    gen = torch.Generator(device=x.device).manual_seed(0)
    dtype = value_dtype(params, x)
    probes = {name: torch.randn(a.shape[1], 1, generator=gen, device=x.device, dtype=dtype)
              for name, (_, a) in factors.items() if a is not None}
    # The rows are weighted 1, 2, ... in one backward pass per output: a swap of rows
    # changes the weighted sum the factors predict, not the one autograd computes.
    w = torch.arange(1, x.shape[0] + 1, device=x.device, dtype=dtype)
    tol = 10 * torch.finfo(dtype).eps ** 0.5
    bad = set()
    for i, c in enumerate(outputs):
        grads = torch.autograd.grad(f[:, c] @ w, [live[n] for n in covered],
                                    retain_graph=i < len(outputs) - 1, allow_unused=True)
        errors, scales = [], []
        for name, g in zip(covered, grads):
            delta, a = factors[name]
            if a is None:
                rule, seen = w @ delta[:, i], g
            else:
                rule = (w * (a @ probes[name])[:, 0]) @ delta[:, i]
                seen = None if g is None else (g.reshape(len(rule), -1) @ probes[name])[:, 0]
            seen = torch.zeros_like(rule) if seen is None else seen.reshape(rule.shape)
            errors.append((seen - rule).abs().max())
            scales.append(torch.maximum(seen.abs().max(), rule.abs().max()))
        scale = float(torch.stack(scales).max())
        for name, err in zip(covered, torch.stack(errors).tolist()):
            if err > tol * max(scale, 1e-30):
                bad.add(name)
    return frozenset(bad)
