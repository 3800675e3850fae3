"""One forward pass with hooks, one backward pass per output: the layers' factors.

The capture runs ``functional_call(module, params, (X,))`` with forward hooks on the
layers that have a rule (:mod:`._rules`), keeping each layer's input ``a`` and output
``z``; then, for every requested output ``c``, ``grad(f[:, c].sum(), z)`` gives the
backprops ``delta_c`` of all the layers at once. Samples are independent (the modules have
no cross-sample state), so the gradient of the sum is the per-sample gradient.

A layer goes to the generic fallback instead (:mod:`._generic`) when its rule does not
accept its input (e.g. a Linear on a 3-D input), when it runs more than once per forward
(its output hook would see only one of the calls), or when one of its parameters is shared
with another module (tied weights: the rule would see one use only), or when one of its
parameters is read outside the layer's own call (see :class:`_UseWatch`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ._generic import per_sample_jacobian
from ._rules import RULES, Term

__all__ = ["Capture", "capture", "forward"]


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


class _UseWatch(TorchFunctionMode):
    """Names the rule-layer parameters that a forward pass reads outside their layer.

    A rule only sees its layer's call: if a weight is also read elsewhere (e.g.
    ``x @ self.lin.weight.T`` in a parent's ``forward``), the factors miss that part of
    the gradient. Every torch function called during the forward passes through here;
    a call that takes one of the watched parameters while the innermost running rule
    layer is not its owner, and that returns a tensor gradients can flow through, marks
    the parameter. This is structural, so it holds for every sample and every value of
    the parameters (a numerical probe on a few samples can miss a use whose gradient
    vanishes there). A call under disabled grad (a custom ``autograd.Function``'s
    ``forward``) is marked too: its backward may route a gradient to the parameter.
    Metadata reads (``.shape``, ``.size()``) return no tensor and are ignored. Code that
    torch functions do not see (TorchScript functions, C++ extensions) is not watched.
    """

    def __init__(self, owners: dict[int, tuple[int, str]]):
        super().__init__()
        self.owners = owners
        self.running: list[int] = []
        self.misfits: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            owner = self.owners.get(id(t))
            if owner is None or (self.running and self.running[-1] == owner[0]):
                continue
            grad_off = not torch.is_grad_enabled()
            if any(grad_off or o.requires_grad for o in _tensors(out)):
                self.misfits.add(owner[1])
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
    seen: dict[int, list] = {id(layer): [] for layer, _, _ in layers}
    # Parameters that require grad give every layer output a graph back to f; only the
    # layer outputs are differentiated, so no parameter gradient is ever computed.
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    watch = _UseWatch({id(live[full]): (id(layer), full)
                       for layer, _, names in layers for full in names.values()})

    def pre_hook(layer, args):
        watch.running.append(id(layer))

    def hook(layer, args, output):
        watch.running.pop()
        seen[id(layer)].append((args[0] if args else None, output))
        # The layer hands on a copy: a later in-place op (ReLU(inplace=True)) then
        # rewrites the copy, and d f / d output stays the backprop of the layer's own z.
        return output.clone() if isinstance(output, torch.Tensor) else None

    handles = [h for layer, _, _ in layers for h in (layer.register_forward_pre_hook(pre_hook),
                                                      layer.register_forward_hook(hook))]
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

    accepted = []
    for layer, rule, names in layers:
        calls = seen[id(layer)]
        if (len(calls) == 1 and isinstance(calls[0][0], torch.Tensor)
                and isinstance(calls[0][1], torch.Tensor) and calls[0][1].requires_grad
                and rule.accepts(layer, calls[0][0])):
            accepted.append((layer, rule, names, calls[0][0].detach(), calls[0][1]))
    covered = {name for *_, names, _, _ in accepted for name in names.values()}

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
                terms_by_name[term.inputs[0][0]] = term
    del f, live

    fallback = tuple(name for name in params if name not in covered)
    if fallback:
        jac = per_sample_jacobian(module, params, X, fallback, outputs,
                                  memory_budget=memory_budget)
        for name in fallback:
            terms_by_name[name] = Term(delta=jac[name], inputs=[(name, None)])
    # Flat (trajectory) order of the terms' first parameters keeps every output stable.
    order = {name: i for i, name in enumerate(params)}
    terms = sorted(terms_by_name.values(), key=lambda t: order[t.inputs[0][0]])
    return Capture(terms=terms, fallback=fallback, exclude=exclude)
