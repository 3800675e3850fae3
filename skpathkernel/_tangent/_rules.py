"""Per-layer rules: per-sample gradients of a layer as Kronecker factors.

A rule turns what a forward hook saw (the layer's input activations ``a``) and what the
per-output backward passes gave (the backprops ``delta = d f_c / d z`` for the layer's
output ``z``) into :class:`Term` objects. A term says: for every parameter it names, the
per-sample gradient of output ``c`` is ``delta[:, c, :] (outer) A`` flattened row-major,
or ``delta[:, c, :]`` alone when ``A`` is ``None``. The kernel engine contracts these
factors directly, so the per-sample gradients (the Jacobian) are never formed.

Rules are registered by exact module type (as opacus' grad_sample does): a subclass may
override ``forward`` and silently break the rule, so it goes to the generic fallback
unless it is registered itself. Register Conv / Embedding / LayerNorm rules here with
:func:`register_rule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["RULES", "Rule", "Term", "register_rule"]


@dataclass
class Term:
    """Kronecker factors of the per-sample gradients of one or more parameters.

    Attributes
    ----------
    delta : torch.Tensor of shape (n_samples, n_outputs, p)
        Backprop factor, shared by every parameter of the term.
    inputs : list of (str, torch.Tensor of shape (n_samples, q) or None)
        Parameter name (a key of the ``params`` mapping) and its activation factor;
        ``None`` means the factor is the constant 1 (``q = 1``), as for a bias. The
        parameter has ``p * q`` entries, ordered ``(p, q)`` row-major.
    """

    delta: torch.Tensor
    inputs: list[tuple[str, torch.Tensor | None]]


@dataclass(frozen=True)
class Rule:
    """A registered per-layer rule.

    ``ops`` are the torch functions through which the layer's own call reads its
    parameters (``F.linear`` for nn.Linear): the capture takes ``a`` and ``z`` from the
    first argument and the result of that one call, and sends the layer to the fallback
    if its parameters are read in any other way. ``accepts(layer, a)`` says whether one
    call's input can use the rule (else the layer goes to the fallback);
    ``factors(layer, a, delta, names)`` returns the terms, where ``names`` maps the
    layer's local parameter names (``"weight"``) to the keys of the ``params`` mapping,
    for the parameters that are differentiated. Parameters of the layer left without a
    term go to the fallback.
    """

    accepts: Callable[[nn.Module, torch.Tensor], bool]
    factors: Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, str]], list[Term]]
    ops: tuple[Callable, ...] = ()


RULES: dict[type, Rule] = {}


def register_rule(module_type: type, rule: Rule) -> None:
    """Register ``rule`` for modules whose type is exactly ``module_type``."""
    RULES[module_type] = rule


def _linear_accepts(layer: nn.Module, a: torch.Tensor) -> bool:
    # Leading batch dimensions other than the sample one (sequences) would need a sum
    # over positions, which the rank-one factorisation below does not represent.
    return a.ndim == 2


def _linear_factors(layer, a, delta, names):
    # z = a W^T + b: d f_c / d W = delta_c (outer) a, d f_c / d b = delta_c.
    inputs = []
    if "weight" in names:
        inputs.append((names["weight"], a))
    if "bias" in names:
        inputs.append((names["bias"], None))
    return [Term(delta=delta, inputs=inputs)]


register_rule(nn.Linear, Rule(accepts=_linear_accepts, factors=_linear_factors,
                              ops=(F.linear,)))
