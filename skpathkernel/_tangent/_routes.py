"""Which layers of a network use a rule, which the fallback, and a rule's own check.

:func:`layer_routes` runs the same capture as every kernel computation on two samples and
reports each layer that holds parameters: its route, its parameter count, and why it falls
back. :func:`warn_on_fallback` turns a large fallback share into one warning (the
estimators call it once per fit). :func:`check_rule` compares the engine against
per-sample Jacobians by plain autograd, for a user who has just written a rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from .._modules import copy_module, runs_module
from .._path._training import drawing_layers
from .._warnings import caller_stacklevel, worst
from ._capture import capture, check_per_sample, checked_capture, forward
from ._generic import _looped, unbatched
from ._gram import DEFAULT_MEMORY_BUDGET, _resolve_output, tangent_features, tangent_gram
from ._rules import RULES, overridden, registered_ancestor, rule_for

__all__ = ["FallbackWarning", "LayerRoute", "check_rule", "layer_routes", "warn_on_fallback"]

#: Fallback share of the parameters from which :func:`warn_on_fallback` warns.
FALLBACK_SHARE = 0.1
# Said of every fallback layer where torch.func cannot batch the network (a Hugging Face
# model: a BERT's 256-parameter position table on the fallback made its tangent kernel
# 8.9x slower, no warning at 4.6% of the parameters).
LOOPS = ("torch.func cannot batch this network's forward, so the fallback differentiates "
         "it one sample and output at a time, a backward pass of the whole network each, "
         "however few parameters it holds")
DISAGREE = ("its factors disagree with autograd on a few samples (a wrong rule, a "
            "parameter read where torch functions do not see it, or a forward pass that "
            "reorders the samples before the layer, such as a sort of the batch by the "
            "data, or mixes them after it)")


class FallbackWarning(UserWarning):
    """Layers holding a large share of a network's parameters use the generic fallback.

    The fallback forms per-sample Jacobians with ``torch.func`` (exact, but slower and
    larger than the per-layer rules). See :func:`skpathkernel.rules.layer_routes` for the
    layers and the reasons, and :func:`skpathkernel.rules.register_rule` to add a rule.

    Examples
    --------
    A module that reads its parameter through a matrix product, for which no rule is
    registered:

    >>> import warnings
    >>> import numpy as np, torch
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.rules import FallbackWarning
    >>> class Scale(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = torch.nn.Parameter(torch.ones(1))
    ...     def forward(self, x):
    ...         return x @ self.w
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1)
    >>> est = PathKernelMachine(module=lambda n_in, n_out: Scale(), max_iter=2, tol=None,
    ...                         random_state=0)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     est = est.fit(X, X.ravel())
    >>> [w.category.__name__ for w in caught]
    ['FallbackWarning']
    """


class LayerRoute(NamedTuple):
    """One layer of a network and how the engine differentiates its parameters.

    Returned by :func:`layer_routes`; its fields are its parameters and attributes.

    Parameters
    ----------
    name : str
        The layer's path in ``module.named_modules()`` (``""`` for the module itself).
    type : str
        Its class name.
    route : str
        ``"rule"`` (structured factors) or ``"fallback"`` (``torch.func`` Jacobians).
    n_params : int
        Differentiated parameters it holds (a rule layer counts its whole subtree, as
        nn.MultiheadAttention holds its ``out_proj``); a parameter tied between layers
        counts at its first holder only, so that the sizes sum to the network's (an
        output head tied to an embedding is listed with 0).
    reason : str
        Why it falls back; empty on its rule.
    loops : bool, default=False
        Whether the fallback differentiates this layer one sample and output at a time,
        because ``torch.func`` cannot batch the network's forward (its ``reason`` then
        says so too); always False on a rule.

    Examples
    --------
    >>> import torch
    >>> from skpathkernel.rules import layer_routes
    >>> layer_routes(torch.nn.Linear(3, 2), torch.randn(4, 3))
    [LayerRoute(name='', type='Linear', route='rule', n_params=8, reason='', loops=False)]
    """

    name: str
    type: str
    route: str
    n_params: int
    reason: str
    loops: bool = False


def _as_input(module: nn.Module, X) -> torch.Tensor:
    """X as the module takes it: float in the parameters' dtype, integers as int64.

    Refused as the engine refuses it (:func:`._gram._prepare`): no samples (the probe's
    forward pass failed in a reshape), complex or boolean values (cast to int64 ids).
    """
    ref = next(module.parameters(), None)
    dtype = ref.dtype if ref is not None else torch.get_default_dtype()
    device = ref.device if ref is not None else torch.device("cpu")
    X = X if isinstance(X, torch.Tensor) else torch.as_tensor(np.asarray(X))
    if X.ndim < 1 or X.shape[0] == 0:
        raise ValueError("X must be a non-empty array of shape (n_samples, ...), got shape "
                         f"{tuple(X.shape)}.")
    if X.is_complex() or X.dtype == torch.bool:
        raise TypeError(f"X must hold real numbers or integer token ids, got {X.dtype}.")
    if X.is_floating_point():
        return X.to(device=device, dtype=dtype)
    return X.to(device=device, dtype=torch.int64)


def _type_path(kind: type) -> str:
    """``nn.LayerNorm`` for torch's layers, else the class's module and qualified name."""
    if kind.__module__.startswith("torch.nn.modules."):
        return f"nn.{kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _no_rule_reason(layer: nn.Module) -> str:
    kind = type(layer)
    if isinstance(layer, parametrize.ParametrizationList):
        return ("the parameters of a parametrization (torch.nn.utils.parametrize), from which "
                "it computes its layer's tensor; no rule covers them")
    if parametrize.is_parametrized(layer):
        # Its class is torch's Parametrized subclass: registering the base type's rule
        # for it would not help, its own call reads a computed tensor, not a parameter.
        return (f"a parametrization (torch.nn.utils.parametrize: weight_norm, spectral_norm, "
                f"...) computes {', '.join(layer.parametrizations)} from other parameters, "
                "which no rule covers")
    found = registered_ancestor(kind)
    if found is not None:
        # By import path: libraries name their subclasses as torch names the base (timm's
        # and Hugging Face's LayerNorm), and "register_rule(LayerNorm, get_rule(LayerNorm))"
        # told the user nothing.
        base = found[0]
        changed = ", ".join(overridden(kind, base))
        ops = " / ".join(dict.fromkeys(getattr(op, "__name__", repr(op))
                                       for op in RULES[base].ops))
        sub, base = _type_path(kind), _type_path(base)
        return (f"no rule for {sub}: it overrides {changed} of {base}, whose rule covers the "
                f"subclasses that keep its forward; if its forward reads its parameters in "
                f"one call of {ops} as {base}'s does, register_rule({sub}, get_rule({base}))")
    if next(layer.children(), None) is not None:
        return (f"parameters held by {kind.__name__} itself, which has no rule (a raw "
                "nn.Parameter used in its forward, other than in an elementwise +, * or "
                "expand of it, of a slice of it or of it reshaped, or as the weight or bias "
                "of x @ P, x @ P.T or F.linear(x, P, b))")
    return f"no rule registered for {kind.__name__}"


# Every fit of a user's module asks (warn_on_fallback), on the module in eval mode: with
# its lock, and without cuDNN for a recurrent one on CUDA, whose eval-mode kernel has no
# backward (the probe then failed, and the fit, catching it, named no fallback; a
# check_rule of such a module raised).
@runs_module(lambda module: module)
def layer_routes(module: nn.Module, X, *, params: Mapping[str, torch.Tensor] | None = None,
                 output: str | int = "trace") -> list[LayerRoute]:
    """List each layer holding parameters with its route (rule or fallback) and size.

    Runs the capture of the structured engine (and its autograd check for reads that torch
    functions do not see and for a forward pass that reorders the samples before a layer)
    on a few samples of ``X`` (the cycle ``x0, x1, xl, x0`` of its first two and last, of
    :func:`._capture.check_rows`), so the routes are those every kernel, feature and
    decomposition computation on such inputs takes; a symmetric Gram of at most 16 rows
    checks all of its rows instead (``_gram._own_check_rows``), and may send to the
    fallback a layer that a reordering on samples tying here hid from these few.

    Parameters
    ----------
    module : torch.nn.Module
        The network (in eval mode if it holds BatchNorm layers).
    X : array-like or torch.Tensor of shape (n_samples, ...)
        Inputs as the module takes them; integer arrays are token ids (int64).
    params : mapping of str to torch.Tensor, default=None
        The differentiated parameters; ``None`` takes the module's own that require grad.
    output : "trace", "full" or int, default="trace"
        The outputs differentiated (as in the kernels).

    Returns
    -------
    routes : list of LayerRoute
        In ``named_modules`` order; parameter-free layers (activations, pooling) are not
        listed, they need no rule.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from skpathkernel.rules import layer_routes
    >>> net = nn.Sequential(nn.Conv1d(1, 4, 3), nn.ReLU(), nn.InstanceNorm1d(4, affine=True),
    ...                     nn.Flatten(), nn.Linear(24, 2))
    >>> for route in layer_routes(net, torch.randn(5, 1, 8)):
    ...     print(route.name, route.type, route.route, route.n_params)
    0 Conv1d rule 16
    2 InstanceNorm1d fallback 8
    4 Linear rule 50
    """
    if params is None:
        params = {k: v.detach() for k, v in module.named_parameters() if v.requires_grad}
    params = dict(params)
    X = _as_input(module, X)
    check_per_sample(module)
    outputs, _ = _resolve_output(output, forward(module, params, X[:1]).shape[1])
    X, cap, hidden = checked_capture(module, params, X, outputs,
                                     memory_budget=DEFAULT_MEMORY_BUDGET, dense_fallback=False)
    reasons = dict(cap.reasons)
    if hidden:
        cap = capture(module, params, X, outputs, memory_budget=DEFAULT_MEMORY_BUDGET,
                      exclude=cap.exclude | hidden, dense_fallback=False)
        reasons.update(cap.reasons)
        why = DISAGREE
        draws = drawing_layers(module)
        if draws:
            # Then every pass draws anew, and no factors agree with another pass's.
            why += (f"; here layer {draws[0]!r} draws at random in training mode, so no "
                    "two passes agree: call module.eval()")
        # A layer on the steps of a time-major transpose, as many as the check's rows,
        # passes the capture's count of rows there and only the check sends it away: on
        # one row the count tells (the Gram was right either way; the reason is truer).
        alone = capture(module, params, X[:1], outputs, memory_budget=DEFAULT_MEMORY_BUDGET,
                        exclude=cap.exclude - hidden, dense_fallback=False).reasons
        reasons.update({name: alone.get(name, why) for name in hidden})
    fallback = set(cap.fallback)
    # (A layer drawing in training mode fails vmap too: its own reason above says more.)
    loops = (unbatched(module, params, X, sorted(fallback), outputs)
             if fallback and not drawing_layers(module) else None)
    # A tied parameter is named once, at its first holder: a later holder (an output
    # head tied to an embedding) is listed under that name, its size counted once.
    first_name: dict[int, str] = {}
    alias = {name: first_name.setdefault(id(p), name)
             for name, p in module.named_parameters(remove_duplicate=False)}
    routes = []
    taken: list[str] = []  # rule layers own their subtrees (as in the capture)
    for prefix, layer in module.named_modules():
        if any(prefix.startswith(t + ".") or t == "" for t in taken):
            continue
        if rule_for(type(layer)) is not None:
            taken.append(prefix)
            named = layer.named_parameters()
        else:
            named = layer.named_parameters(recurse=False)
        names = [f"{prefix}.{local}" if prefix else local for local, _ in named]
        own = [n for n in names if n in params]
        tied = [alias[n] for n in names if n not in params and alias.get(n, n) in params]
        if not own and not tied:
            continue
        size = sum(params[n].numel() for n in own)
        falls = [n for n in own + tied if n in fallback]
        if not falls:
            routes.append(LayerRoute(prefix, type(layer).__name__, "rule", size, ""))
            continue
        why = next((reasons[n] for n in falls if n in reasons), None)
        if why is None or (rule_for(type(layer)) is None
                           and registered_ancestor(type(layer)) is not None):
            # A subclass of a rule layer: registering its ancestor's rule for it is the
            # way to a rule, whatever its raw parameters' reads say.
            why = (_no_rule_reason(layer) if rule_for(type(layer)) is None
                   else "its rule gives a parameter no term")
        if loops is not None:
            why += f"; {LOOPS} ({loops})"
        routes.append(LayerRoute(prefix, type(layer).__name__, "fallback", size, why,
                                 loops is not None))
    return routes


def warn_on_fallback(module: nn.Module, X, *, share: float = FALLBACK_SHARE) -> None:
    """One :class:`FallbackWarning` when fallback layers hold ``share`` of the parameters,
    or any where torch.func cannot batch the network (the fallback then loops over samples).

    Called once per fit by the estimators, on their training inputs, and where a recorded
    loop's network is built with its training inputs (``PathRecorder.as_network``,
    ``RecordedNetwork``), on 64 of them; without them, on 64 of its first analysis's
    inputs. It never makes a fit fail: a network the capture
    cannot run on is left for the kernel computations to refuse with their own errors.
    """
    try:
        routes = layer_routes(module, X)
    except Exception:  # a diagnostic must not break a fit that trained
        return
    total = sum(r.n_params for r in routes)
    slow = [r for r in routes if r.route == "fallback"]
    held = sum(r.n_params for r in slow)
    if not total or (held < share * total and not any(r.loops for r in slow)):
        return
    listed = ", ".join(f"{r.name or '(module)'} ({r.type}, {r.n_params:,}: {r.reason})"
                       for r in sorted(slow, key=lambda r: -r.n_params)[:3])
    more = f" and {len(slow) - 3} more" if len(slow) > 3 else ""
    warnings.warn(
        f"Layers holding {held / total:.0%} of the network's parameters use the torch.func "
        f"fallback, which forms per-sample Jacobians: {listed}{more}. Kernels, tangent "
        "features and the decomposition stay exact but are slower and use more memory. See "
        "skpathkernel.rules.layer_routes for every layer, and register_rule to add a rule.",
        FallbackWarning, stacklevel=caller_stacklevel())


@runs_module(lambda module: module)  # its copy's features, as layer_routes' (above)
def check_rule(module: nn.Module, X, *, rtol: float = 1e-8) -> float:
    """Check the engine's tangent features and Gram of ``module`` against autograd.

    The reference is the per-sample Jacobian of the whole network in float64 by plain
    autograd, one backward pass per sample and output on that sample alone, which no rule
    touches (not ``torch.func``: its ``vmap(jacrev)`` of ``nn.PReLU`` raises, or is wrong
    when the samples are as many as the outputs, in torch 2.13). Use it after
    :func:`register_rule`: the layers with rules are then computed from their factors,
    and must agree.

    Parameters
    ----------
    module : torch.nn.Module
        The network; a float64 copy is checked.
    X : array-like or torch.Tensor of shape (n_samples, ...)
        A few inputs (the check forms their dense Jacobians).
    rtol : float, default=1e-8
        Largest relative difference accepted, ``max |A - B| / max |B|``.

    Returns
    -------
    error : float
        The largest relative difference of the features and the Gram.

    Raises
    ------
    AssertionError
        If the difference exceeds ``rtol`` (the message names the layers on their rules),
        or if the engine's own autograd check rejected a rule's factors (the layer then
        falls back: the results stay exact, the rule is wrong).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from skpathkernel.rules import check_rule
    >>> net = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 1))
    >>> bool(check_rule(net, torch.randn(4, 1, 8)) < 1e-8)
    True
    """
    ref = copy_module(module).to(torch.float64)
    X = _as_input(ref, X)
    params = {k: v.detach() for k, v in ref.named_parameters() if v.requires_grad}
    routes = layer_routes(ref, X, params=params)
    rejected = [f"{r.name or '(module)'} ({r.type})" for r in routes
                if r.reason.startswith(DISAGREE)]
    if rejected:
        why = DISAGREE.removeprefix("its factors ")
        raise AssertionError(f"The factors of {', '.join(rejected)} {why}: the engine sends "
                             "these layers to the fallback.")

    n_outputs = forward(ref, params, X[:1]).shape[1]
    jac = _looped(ref, {}, params, X, torch.arange(n_outputs, device=X.device))
    J = torch.cat([jac[k].reshape(X.shape[0], n_outputs, -1) for k in params], dim=2)
    phi = tangent_features(ref, params, X, output="full")
    K = tangent_gram(ref, params, X, output="full")
    errors = [float((phi - J).abs().max() / J.abs().max().clamp_min(1e-300)),
              float((K - torch.einsum("ncp,mdp->ncmd", J, J)).abs().max()
                    / K.abs().max().clamp_min(1e-300))]
    error = worst(errors)  # NaN if either is: a NaN Gram must not pass
    if not error <= rtol:
        ruled = [f"{r.name} ({r.type})" for r in routes if r.route == "rule"]
        raise AssertionError(
            f"The engine differs from autograd by {error:.3g} (relative), more than "
            f"rtol={rtol:g}. Layers on their rules: {', '.join(ruled) or 'none'}.")
    return error
