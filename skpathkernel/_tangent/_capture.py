"""One forward pass with hooks, one backward pass per output: the layers' factors.

The capture runs ``functional_call(module, params, (X,))`` with forward hooks on the
layers that have a rule (:mod:`._rules`), keeping each layer's input ``a`` and output
``z``; then, for every requested output ``c``, ``grad(f[:, c].sum(), z)`` gives the
backprops ``delta_c`` of all the layers at once. Samples are independent (the modules have
no cross-sample state), so the gradient of the sum is the per-sample gradient.

A layer goes to the generic fallback instead (:mod:`._generic`) when its rule does not
accept its input (e.g. a Linear on a 3-D input), when it runs more than once per forward
(its output hook would see only one of the calls), or when one of its parameters is shared
with another module (tied weights: the rule would see one use only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from ._generic import per_sample_jacobian
from ._rules import RULES, Term

__all__ = ["Capture", "capture", "forward", "misfit_parameters"]


@dataclass
class Capture:
    """Factors of the per-sample gradients of a block of samples.

    ``terms`` cover every parameter of ``params`` exactly once; ``fallback`` names the
    parameters whose terms are dense Jacobians from the generic fallback.
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
        Parameters whose layers must use the fallback (see :func:`misfit_parameters`).
    """
    layers = _rule_layers(module, params, exclude)
    seen: dict[int, list] = {id(layer): [] for layer, _, _ in layers}

    def hook(layer, args, output):
        seen[id(layer)].append((args[0] if args else None, output))
        # The layer hands on a copy: a later in-place op (ReLU(inplace=True)) then
        # rewrites the copy, and d f / d output stays the backprop of the layer's own z.
        return output.clone() if isinstance(output, torch.Tensor) else None

    handles = [layer.register_forward_hook(hook) for layer, _, _ in layers]
    # Parameters that require grad give every layer output a graph back to f; only the
    # layer outputs are differentiated, so no parameter gradient is ever computed.
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    try:
        with torch.enable_grad():
            f = functional_call(module, live, (X,)).reshape(X.shape[0], -1)
    finally:
        for h in handles:
            h.remove()

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
            delta = torch.stack([g[j] for g in grads], dim=1).detach()
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


def misfit_parameters(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    cap: Capture,
    outputs: Sequence[int],
) -> frozenset[str]:
    """Rule-covered parameters whose factors disagree with autograd on one sample.

    A rule only sees its layer's call. If a parameter is also read elsewhere (e.g.
    ``x @ self.lin.weight.T`` in a parent's ``forward``), the factors miss that part of
    the gradient, and nothing in the module structure says so. One backward pass per
    output on a single sample ``x`` (shape (1, n_features)) catches it: the parameters
    returned here must go to the fallback.
    """
    covered = [name for term in cap.terms for name, _ in term.inputs
               if name not in cap.fallback]
    if not covered:
        return frozenset()
    factors = {name: (term.delta, a) for term in cap.terms for name, a in term.inputs}
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        f = functional_call(module, live, (x,)).reshape(1, -1)
    tol = 10 * torch.finfo(x.dtype).eps ** 0.5
    bad = set()
    for i, c in enumerate(outputs):
        grads = torch.autograd.grad(f[0, c], [live[n] for n in covered],
                                    retain_graph=i < len(outputs) - 1, allow_unused=True)
        scale = max(float(g.abs().max()) for g in grads if g is not None) if any(
            g is not None for g in grads) else 0.0
        for name, g in zip(covered, grads):
            delta, a = factors[name]
            rule = delta[0, i] if a is None else torch.outer(delta[0, i], a[0])
            g = torch.zeros_like(rule) if g is None else g.reshape(rule.shape)
            if float((g - rule).abs().max()) > tol * max(scale, 1e-30):
                bad.add(name)
    return frozenset(bad)
