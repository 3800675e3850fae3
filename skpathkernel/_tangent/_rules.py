"""The rule contract: per-sample gradients of a layer as Kronecker factors with positions.

A layer with a rule reads its parameters through one call of its own operation (``ops``:
``F.linear`` for nn.Linear, ``F.conv2d`` for nn.Conv2d, ...). The capture
(:mod:`._capture`) records that call, a :class:`Use`: the operation's input ``a`` and output
``z`` (one such pair, a *site*, per operation; a rule may run its call as several sites,
see :attr:`Rule.expand`), then computes the backprops ``delta = d f_c / d z`` for every
requested output ``c``. The rule turns them into :class:`Term` objects.

A term covers one or more parameters that share a backprop. With positions (a weight
applied at many places of one sample: a convolution's patches, a Linear on ``(n, S, d)``
tokens, attention projections), the per-sample gradient of output ``c`` is a sum of outer
products over the positions ``s``::

    d f_c / d W = sum_s delta[c, s] (outer) a[s]        (p x q, row-major)

and ``delta[c, s]`` alone, summed over ``s``, when the input is ``None`` (a bias). The
engine contracts these factors directly, choosing per term and call between forming the
``p x q`` blocks and contracting position pairs (see :mod:`._contract`), so the Jacobian
of a rule layer is formed only where that is the cheaper exact contraction.

Rules are registered per module type (as opacus' grad_sample does). A subclass of a
registered type takes its nearest registered ancestor's rule when it changes nothing that
the ancestor's ``forward`` runs (:func:`rule_for`); one that overrides ``forward``, or a
method of the ancestor that ``forward`` may call, may compute something else, so it goes to
the generic fallback unless it is registered itself, or the rule reads nothing but its call
(``Rule.parameter_args``: nn.LayerNorm's, which timm's and torchvision's ``LayerNorm2d`` keep).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["RULES", "Rule", "Term", "Use", "get_rule", "overridden", "register_rule",
           "registered_ancestor", "rule_for"]


@dataclass
class Term:
    """Kronecker factors of the per-sample gradients of one or more parameters.

    Parameters
    ----------
    delta : torch.Tensor of shape (n_samples, n_outputs, n_positions, p)
        Backprop factor, shared by every parameter of the term. A 3-D
        ``(n_samples, n_outputs, p)`` tensor is read as one position.
    inputs : list of (str, torch.Tensor of shape (n_samples, n_positions, q) or None)
        Parameter name (a key of the ``params`` mapping) and its activation factor; a
        2-D ``(n_samples, q)`` factor is read as one position. ``None`` means the factor
        is the constant 1: the parameter has ``p`` entries and its gradient is ``delta``
        summed over the positions (a bias, an elementwise scale folded into ``delta``).
    groups : int, default=1
        Block-diagonal weights (grouped convolutions, packed attention projections of
        different inputs): ``p`` and ``q`` split into ``groups`` equal parts, part ``j`` of
        ``delta`` pairs with part ``j`` of ``a`` only, and the parameter has
        ``p * q / groups`` entries, ordered ``(groups, p / groups, q / groups)``
        row-major. ``None`` inputs ignore it.
    transposed : bool, default=False
        The parameter's entries are ordered ``(q, p)`` instead of ``(p, q)``: its
        gradient is ``sum_s a[s] (outer) delta[c, s]`` (an embedding table, whose rows are
        indexed by the one-hot ``a``). Not combined with ``groups``.
    rows : int, default=None
        With ``transposed``: each input is an integer ``(n_samples, n_positions)`` tensor
        of row indices in ``[0, rows)`` (an embedding's token ids) standing for its
        one-hot factor ``(n_samples, n_positions, rows)``, which is never formed. The
        engine contracts it from index equality (``a[s] . a'[s'] = [i_s == i'_s']``) and
        scatters ``delta`` into the indexed rows, so no cost scales with ``n * S * rows``.
        A position that must give no gradient (a padding index) has ``delta`` zero there.

    Notes
    -----
    Every parameter of the network is covered by exactly one term (the capture gives the
    parameters that no rule covers dense-Jacobian terms from the fallback: a ``None``
    input with ``delta`` the per-sample gradient itself; a parameter used at several
    sites, tied or called twice, gets the sum of its uses' terms as one).

    Examples
    --------
    The term of a weight ``(p, q) = (2, 3)`` with one position, as ``nn.Linear``'s rule
    builds it for 4 samples and 1 output:

    >>> import torch
    >>> from skpathkernel.rules import Term
    >>> term = Term(torch.randn(4, 1, 2), [("0.weight", torch.randn(4, 3))])
    >>> tuple(term.delta.shape), tuple(term.inputs[0][1].shape)
    ((4, 1, 1, 2), (4, 1, 3))
    """

    delta: torch.Tensor
    inputs: list[tuple[str, torch.Tensor | None]]
    groups: int = 1
    transposed: bool = False
    rows: int | None = None

    def __post_init__(self):
        if self.delta.ndim == 3:
            self.delta = self.delta.unsqueeze(2)
        if self.delta.ndim != 4:
            raise ValueError("Term.delta must have shape (n_samples, n_outputs, n_positions, "
                             f"p), got {tuple(self.delta.shape)}.")
        n, _, S, p = self.delta.shape
        if self.rows is not None:
            self._check_index(n, S)
            return
        inputs = []
        for name, a in self.inputs:
            if a is not None:
                if a.ndim == 2:
                    a = a.unsqueeze(1)
                if a.ndim != 3 or a.shape[:2] != (n, S):
                    raise ValueError(
                        f"The factor of {name!r} must have shape ({n}, {S}, q) to match "
                        f"delta {tuple(self.delta.shape)}, got {tuple(a.shape)}.")
                if a.shape[2] % self.groups:
                    raise ValueError(f"The factor of {name!r} has {a.shape[2]} columns, not "
                                     f"a multiple of groups={self.groups}.")
            inputs.append((name, a))
        self.inputs = inputs
        if p % self.groups:
            raise ValueError(f"delta has {p} columns, not a multiple of groups={self.groups}.")
        if self.transposed and self.groups != 1:
            raise ValueError("A transposed term cannot have groups.")

    def _check_index(self, n: int, S: int) -> None:
        if not self.transposed or self.groups != 1:
            raise ValueError("A term with rows= must be transposed, without groups.")
        if len(self.inputs) != 1:
            # The index contractions scale and scatter one table's rows.
            raise ValueError("A term with rows= takes one input, the table's row indices; "
                             f"got {len(self.inputs)}.")
        for name, a in self.inputs:
            if a is None or a.is_floating_point() or a.is_complex() or a.shape != (n, S):
                raise ValueError(
                    f"The index factor of {name!r} must be an integer tensor of shape "
                    f"({n}, {S}), got {None if a is None else (a.dtype, tuple(a.shape))}.")


@dataclass(frozen=True)
class Use:
    """One call of a rule layer's own operation, as the capture saw it.

    The capture builds it and passes it to a :class:`Rule`'s ``factors`` and ``accepts``.

    Parameters
    ----------
    func : callable
        The operation called (one of the rule's ``ops``).
    args, kwargs : tuple, dict
        Its arguments, with the layer's parameters in them (stride, padding, eps, ... are
        read from here, so that the rule follows the call actually made).
    inputs : tuple of torch.Tensor
        The input ``a`` of each site, samples first: ``args[0]`` for a rule without
        ``expand``.

    Examples
    --------
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from skpathkernel.rules import Use
    >>> x, w = torch.randn(4, 3), torch.randn(2, 3)
    >>> use = Use(F.linear, (x, w), {}, (x,))
    >>> use.func is F.linear, tuple(use.inputs[0].shape)
    (True, (4, 3))
    """

    func: Callable
    args: tuple
    kwargs: dict
    inputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A per-layer rule: how a layer's parameters are read, and their Kronecker factors.

    Parameters
    ----------
    ops : tuple of callable
        The torch functions through which the layer's own call reads its parameters
        (``(F.linear,)`` for nn.Linear). Exactly one call of one of them per call of the
        layer, by the layer itself and taking every differentiated parameter of the layer
        (and of its children: a rule layer owns its whole subtree), is a use; the layer
        goes to the fallback when a parameter of it is read in any other way. A layer
        called several times, or holding a weight tied to another rule layer's, has a
        use per call: the capture sums their terms per parameter.
    factors : callable ``(layer, use, deltas, names) -> list of Term``
        ``use`` is the :class:`Use`; ``deltas[i]`` is the backprop of site ``i``'s output
        ``z_i``, of shape ``(n_samples, n_outputs, *z_i.shape[1:])``; ``names`` maps the
        layer's local parameter names (``"weight"``, ``"out_proj.bias"``) to the keys of
        the ``params`` mapping, for the parameters that are differentiated. A parameter
        left without a term goes to the fallback.
    accepts : callable ``(layer, use) -> bool``, default=None
        Whether this call can use the rule (``None``: always); else the layer goes to the
        fallback.
    expand : callable ``(layer, func, args, kwargs) -> (out, sites) or None``, default=None
        Runs the layer's own call as several sites, for an operation whose parameters act
        on intermediate tensors (attention's projections): returns the call's result and
        a list of ``(a, z)`` pairs, samples first, where ``z`` is computed from ``a`` and the
        parameters by differentiable torch operations and the result from the ``z``.
        ``None`` declines (the call runs as is and the layer goes to the fallback), and so
        does a string, which says why (:func:`layer_routes` shows it). Without ``expand``
        the call is one site, ``(args[0], result)``.
    call_inputs : bool, default=False
        Call ``expand`` with a fifth argument, the positional arguments of the layer's own
        call (its ``forward``'s inputs): for what the operation's arguments do not carry
        (a ``PackedSequence``'s sample order, which ``torch.lstm`` does not take).
    parameter_args : dict of str to (int, str), default=None
        Where the call takes each of the layer's parameters: ``{name: (position,
        keyword)}`` (nn.LayerNorm's: ``{"weight": (2, "weight"), "bias": (3, "bias")}``).
        Given, it says the factors read the call alone (its arguments, its sites' inputs
        and outputs), nothing of the layer, and the capture checks that every call
        passes each parameter there (a call passing them swapped goes to the fallback).
        A subclass that overrides ``forward`` then keeps the rule of its registered
        ancestor (timm's and torchvision's ``LayerNorm2d`` permute to channels-last around
        ``F.layer_norm``): the capture guards it as any rule layer, a parameter read
        otherwise than once, in one call of the rule's op with all of the layer's
        parameters (scaled first, added again, a second call), sending the layer to the
        fallback, as do rows that are not the samples and, through the autograd check of
        the first rows, reads that torch functions do not see and rows that the forward
        pass reorders before the layer.

    Examples
    --------
    A rule for a layer that reads its weight through ``torch.tensordot``: the gradient of
    ``z = a W^T`` is the outer product of ``z``'s backprop and the input ``a``. (Read by
    ``F.linear(x, self.weight)`` or ``x @ self.weight.T``, a raw weight needs no rule: it
    is a site of the Linear rule, see :mod:`._parameters`.)

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import nn
    >>> from skpathkernel.rules import Rule, Term, check_rule, layer_routes, register_rule
    >>> class Proj(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(2, 3))
    ...     def forward(self, x):
    ...         return torch.tensordot(x, self.weight, dims=([1], [1]))
    >>> def factors(layer, use, deltas, names):
    ...     return [Term(deltas[0], [(names["weight"], use.inputs[0])])]
    >>> net = nn.Sequential(Proj(), nn.Tanh(), nn.Linear(2, 1))
    >>> X = torch.randn(4, 3)
    >>> [route.route for route in layer_routes(net, X)]
    ['fallback', 'rule']
    >>> register_rule(Proj, Rule(ops=(torch.tensordot,), factors=factors))
    >>> [route.route for route in layer_routes(net, X)]
    ['rule', 'rule']
    >>> bool(check_rule(net, X) < 1e-8)
    True
    """

    ops: tuple[Callable, ...]
    factors: Callable[[nn.Module, Use, tuple[torch.Tensor, ...], dict[str, str]], list[Term]]
    accepts: Callable[[nn.Module, Use], bool] | None = None
    expand: Callable[[nn.Module, Callable, tuple, dict],
                     tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]] | str | None] | None = None
    call_inputs: bool = False
    parameter_args: dict[str, tuple[int, str]] | None = None


RULES: dict[type, Rule] = {}


def register_rule(module_type: type, rule: Rule) -> None:
    """Register ``rule`` for the modules of type ``module_type`` and its plain subclasses.

    A rule registered for a type replaces the one registered before it (the built-in
    rules included). A subclass takes the rule of its nearest registered ancestor when it
    overrides none of the ancestor's methods but construction and printing
    (``__init__``, ``reset_parameters``, ``extra_repr``): the ancestor's ``forward`` then
    makes the same call. A subclass that overrides ``forward`` (or a method ``forward``
    may call, such as ``_conv_forward``) falls back until it is registered itself, once
    its ``forward`` is known to read its parameters through the same call, unless the
    ancestor's rule reads its call alone (``Rule.parameter_args``: nn.LayerNorm's).

    Parameters
    ----------
    module_type : type
        A subclass of ``torch.nn.Module``.
    rule : Rule
        Its rule.

    Examples
    --------
    A subclass of ``nn.Linear`` that keeps ``nn.Linear``'s ``forward`` takes its rule; one
    that overrides it (here of ``nn.Conv1d``) is registered once its ``forward`` is known
    to make the same call (a ``Linear`` subclass whose ``forward`` calls
    ``F.linear(x, self.weight, self.bias)`` needs none: its raw parameters are then sites
    of the Linear rule, see :mod:`._parameters`):

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import nn
    >>> from skpathkernel.rules import get_rule, layer_routes, register_rule
    >>> class MyLinear(nn.Linear):
    ...     pass
    >>> layer_routes(MyLinear(3, 2), torch.randn(4, 3))[0].route
    'rule'
    >>> class Scaled(nn.Conv1d):
    ...     def forward(self, x):
    ...         return 2 * F.conv1d(x, self.weight, self.bias)
    >>> layer_routes(Scaled(3, 2, 3), torch.randn(4, 3, 5))[0].route
    'fallback'
    >>> register_rule(Scaled, get_rule(nn.Conv1d))
    >>> layer_routes(Scaled(3, 2, 3), torch.randn(4, 3, 5))[0].route
    'rule'
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be a torch.nn.Module subclass, got {module_type!r}.")
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a Rule, got {type(rule).__name__}.")
    if not rule.ops:
        raise ValueError("rule.ops must name at least one torch function.")
    RULES[module_type] = rule


def get_rule(module_type: type) -> Rule | None:
    """The rule registered for exactly ``module_type``, or ``None``.

    Parameters
    ----------
    module_type : type
        A subclass of ``torch.nn.Module``.

    Returns
    -------
    rule : Rule or None
        Reuse it for a subclass whose ``forward`` makes the same call:
        ``register_rule(MyLinear, get_rule(nn.Linear))``.

    Examples
    --------
    >>> import torch.nn.functional as F
    >>> from torch import nn
    >>> from skpathkernel.rules import get_rule
    >>> get_rule(nn.Linear).ops == (F.linear,)
    True
    >>> get_rule(nn.Bilinear) is None
    True
    """
    return RULES.get(module_type)


# What a subclass may define over its registered ancestor without changing what the
# ancestor's forward computes: construction, initialisation, printing, class bookkeeping.
_INERT = frozenset({
    "__init__", "reset_parameters", "extra_repr", "__repr__", "__doc__", "__module__",
    "__qualname__", "__dict__", "__weakref__", "__annotations__", "__annotate__",
    "__annotate_func__", "__annotations_cache__", "__firstlineno__",
    "__static_attributes__", "__slotnames__", "__orig_bases__", "__parameters__",
    "__constants__", "_version", "__type_params__", "__new__", "__init_subclass__",
    "__getstate__", "__setstate__", "_load_from_state_dict",
    # abc.ABC's and typing.Generic's bookkeeping (a slot of __slots__ is a descriptor of
    # its own, which counts).
    "__slots__", "__abstractmethods__", "_abc_impl", "_is_protocol",
})


def overridden(module_type: type, ancestor: type) -> list[str]:
    """Names that ``module_type``'s lookup finds in a class that is not one of
    ``ancestor``'s (the subclass's own, or a mixin's, wherever the mixin sits in the MRO)
    and that ``ancestor`` has too, but the inert ones (:data:`_INERT`), and the class
    attributes such classes add that are not methods: what may make the ancestor's
    ``forward`` compute something else. (A property or class attribute shadows the module's
    parameters and buffers, which ``nn.Module`` finds only when normal lookup fails:
    parametrize's ``weight`` property reads a computed tensor; so does a mixin's listed
    after the layer, ``class Norm(nn.LayerNorm, Mixin)``, which comes after ``nn.Module``
    in the MRO but before ``object`` and the parameters.)"""
    mro = module_type.__mro__
    bases = set(ancestor.__mro__)
    names = set()
    for klass in mro:
        if klass in bases:
            continue
        for name, value in vars(klass).items():
            if name in _INERT or name in names:
                continue
            # The class that module_type's lookup of the name finds first: a mixin's name
            # that the ancestor's own classes define before it changes nothing.
            if (next(k for k in mro if name in vars(k)) is klass
                    and (hasattr(ancestor, name) or not isinstance(value, _METHODS))):
                names.add(name)
    return sorted(names)


_METHODS = (types.FunctionType, staticmethod, classmethod)


def registered_ancestor(module_type: type) -> tuple[type, bool] | None:
    """The nearest registered proper ancestor of ``module_type`` and whether its rule
    covers ``module_type`` (nothing of it :func:`overridden`), or ``None``.

    Not cached: a class may be patched after a lookup (``MyNorm.forward = ...``), and
    :func:`overridden` takes about 2 microseconds, what a cache lookup took."""
    found = next((k for k in module_type.__mro__[1:] if k in RULES), None)
    if found is None:
        return None
    return found, not overridden(module_type, found)


def rule_for(module_type: type) -> Rule | None:
    """The rule the capture uses for ``module_type``: its own, or else that of its nearest
    registered ancestor when it overrides none of the ancestor's methods (see
    :func:`register_rule`) or the rule reads its call alone (``parameter_args``); ``None``
    sends its modules to the fallback."""
    rule = RULES.get(module_type)
    if rule is not None:
        return rule
    inherited = registered_ancestor(module_type)
    if inherited is None:
        return None
    rule = RULES[inherited[0]]
    return rule if inherited[1] or rule.parameter_args is not None else None
