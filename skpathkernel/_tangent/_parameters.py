"""Rules for raw parameters used directly in elementwise operations.

Networks hold parameters outside any layer with a rule: a class token concatenated to the
patch tokens (``self.cls_token.expand(n, -1, -1)``), a position embedding added to them
(``x + self.pos_embed``), a LayerScale-style gain (``self.gamma * x``). Such a *free*
parameter ``P`` (one that no rule layer owns) is structured when the forward pass reads
it only through the operations registered here, with ``P`` broadcast over the samples.
Each such operation's output ``z`` is then a site like a rule layer's: its backprop
``delta = d f_c / d z`` gives the per-sample gradient of ``P`` directly (summed over the
sites where ``P`` is read more than once):

* ``z = x + P`` and ``z = P.expand(...)``: ``delta`` summed over the axes where ``P``
  was broadcast;
* ``z = x * P``: ``delta * x`` summed over those axes.

As in opacus' ``grad_sample``, each case is one small pure function, registered for the
torch functions that reach :class:`torch.overrides.TorchFunctionMode` for it
(``x + P`` arrives as ``Tensor.add``). The result is a term with a constant input (the
parameter's gradient is its ``delta``), contracted as dense rows of ``P.numel()``.

A free parameter read in any other way, under disabled grad, or not broadcast over the
samples goes to the generic fallback, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PARAMETER_OPS", "ParameterOp", "register_parameter_op", "sum_to_shape"]


@dataclass(frozen=True)
class ParameterOp:
    """How one registered operation reads a free parameter, and its per-sample gradient.

    ``binary``: the call is ``func(a, b)`` with the parameter one of two tensors (the other
    is the operand handed to ``grad``); otherwise the parameter is ``args[0]`` and the rest
    are sizes (``expand``). ``grad(delta, shape, operand)`` returns the per-sample gradient
    ``(n, C, numel)`` from the output's backprop ``delta (n, C, *z.shape[1:])``.
    """

    grad: Callable[[torch.Tensor, torch.Size, torch.Tensor | None], torch.Tensor]
    binary: bool


PARAMETER_OPS: dict[Callable, ParameterOp] = {}


def register_parameter_op(*funcs: Callable, binary: bool):
    """Register the decorated ``grad(delta, shape, operand)`` for ``funcs``."""

    def decorate(grad):
        for func in funcs:
            PARAMETER_OPS[func] = ParameterOp(grad, binary)
        return grad

    return decorate


def sum_to_shape(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``g (n, C, *z_shape[1:])`` summed over the axes where ``shape`` was broadcast to
    ``z``, as ``(n, C, prod(shape))`` in the parameter's row-major order.

    ``shape`` is aligned to the right of ``z``'s shape, and broadcast over the samples.
    """
    n, C = g.shape[:2]
    z_ndim = g.ndim - 1
    aligned = (1,) * (z_ndim - len(shape)) + tuple(shape)
    dims = [i + 1 for i in range(1, z_ndim) if aligned[i] == 1 and g.shape[i + 1] != 1]
    if dims:
        g = g.sum(dims, keepdim=True)
    return g.reshape(n, C, -1)


@register_parameter_op(torch.add, torch.Tensor.add, torch.Tensor.__add__,
                       torch.Tensor.__radd__, binary=True)
def added(delta, shape, operand):
    """``z = x + P``: the backprop summed where ``P`` was broadcast."""
    return sum_to_shape(delta, shape)


@register_parameter_op(torch.mul, torch.Tensor.mul, torch.Tensor.__mul__,
                       torch.Tensor.__rmul__, binary=True)
def multiplied(delta, shape, operand):
    """``z = x * P``: the backprop times ``x``, summed where ``P`` was broadcast."""
    z_shape = (delta.shape[0], *delta.shape[2:])
    return sum_to_shape(delta * operand.broadcast_to(z_shape).unsqueeze(1), shape)


@register_parameter_op(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to,
                       binary=False)
def expanded(delta, shape, operand):
    """``z = P.expand(n, ...)`` (a class token before ``torch.cat``): the backprop summed
    over the copies."""
    return sum_to_shape(delta, shape)


def parameter_site(func, args, kwargs, param: torch.Tensor):
    """``(op, operand)`` when ``func(*args, **kwargs)`` reads ``param`` as a registered
    operation does, else None."""
    op = PARAMETER_OPS.get(func)
    if op is None or kwargs:
        return None
    if not op.binary:
        return (op, None) if args and args[0] is param else None
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    a, b = args
    if (a is param) == (b is param):
        return None
    return op, (b if a is param else a)


def broadcast_over_samples(shape: torch.Size, z: torch.Tensor, n: int) -> bool:
    """Whether a parameter of ``shape`` reaches ``z``'s rows (the samples) by broadcast."""
    if z.ndim == 0 or z.shape[0] != n or len(shape) > z.ndim:
        return False
    return len(shape) < z.ndim or shape[0] == 1
