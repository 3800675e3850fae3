"""Rules for raw parameters used directly in elementwise operations and matrix products.

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

The same holds for a basic-indexing view of ``P`` read by one of these operations (a
position embedding cut to the sequence's length, ``x + self.pos[:, :L]``,
``self.pos[:L]``, ``self.pos.narrow(1, 0, L)``): the view is read like ``P`` itself, and
its gradient is scattered into the entries of ``P`` that it holds (zero elsewhere); and
for ``P`` reshaped (``x * self.gamma.reshape(1, -1, 1, 1)``, ``view``, ``unsqueeze``: a
layer-scale gain over channels-first activations, as timm's ConvNeXt reads it), whose
gradient is the view's in ``P``'s own row-major order. The
indices of the view are integers and slices, Python numbers, the same for every sample of
the block; an index holding a tensor (advanced indexing, a bound kept as a tensor) is a
read like any other, and so is a view taken after the forward pass read a tensor's values
into Python (``int(mask.sum())``: the capture's ``_VALUE_READS``), which a bound may come
from.

As in opacus' ``grad_sample``, each case is one small pure function, registered for the
torch functions that reach :class:`torch.overrides.TorchFunctionMode` for it
(``x + P`` arrives as ``Tensor.add``). The result is a term with a constant input (the
parameter's gradient is its ``delta``), contracted as dense rows of ``P.numel()``.

A free 2-D parameter read as the weight of a linear map, ``F.linear(x, P)``, ``x @ P.T``
(``P.t()``, ``P.mT``, ``P.transpose(0, 1)``: ``P`` is ``(out, in)``), ``x @ P``,
``torch.matmul(x, P)``, ``torch.mm``, ``torch.addmm(b, x, P)`` (``P`` is ``(in, out)``),
its arguments by position or by keyword (``F.linear(input=x, weight=P, bias=b)``,
``torch.matmul(x, other=P)``: :func:`positional`), with the samples leading in ``x``
(``(n, ..., in)``, ``P`` broadcast over the samples and any sequence axes; or its rows
flattened, ``x.view(-1, in)``, ``x.reshape(-1, in)``, ``x.flatten(0, 1)`` of a tensor whose
first axis is the samples, as Hugging Face's ``Conv1D`` and hand-written transformer code
read them), runs as a site of the Linear rule itself (:func:`product_site`):
its per-sample gradient is ``sum_s delta_s (outer) x_s``, ``nn.Linear``'s (transposed for
``(in, out)``), and the capture hands the call to that rule's ``factors`` (and, for a
matrix product, the transposed rule's ``expand``), so the term keeps its two factors
(input ``x``, backprop ``delta``) and the Gram contracts them as a Linear's. A raw bias
read by the same ``F.linear`` or ``torch.addmm`` is that term's bias. This covers a
hand-written LoRA (``x @ self.A.T @ self.B.T``), ``x @ self.W + self.b``, attention with
raw ``Wq``, ``Wk``, ``Wv``, and a ``Linear`` subclass overriding ``forward`` with
``F.linear(x, self.weight, self.bias)``. A parameter read by a product and elementwise,
or by two products, gets the sum of its terms (:func:`._capture._summed_uses`).

A bias or gain added to or multiplied with such a product's output on flattened rows
(``x.view(-1, d) @ W + b``) is read on them per sample too (:func:`flattened_operand`).
Flattened rows are recognised through views alone (the memory of a tensor whose first axis
is the samples, :func:`._layers._samples_first`): rows kept flat through an elementwise op
(``torch.tanh(x.view(-1, d)) @ W``), or flattened by a copy (``x.mT.reshape(-1, d)``),
have no such base, and the product falls back (``NOT_SAMPLES``). Their number alone,
``n * s``, does not say which sample a row is of (``x.transpose(0, 1).reshape(-1, d)``
has as many), and the autograd check cannot tell the orders apart on a call of one
sample.

A free parameter read in any other way (a view of a view included; ``P @ x``, a batched
``P``, ``torch.einsum``, a slice of ``P`` read by a product), under disabled grad, or not
broadcast over the samples goes to the generic fallback, as before; a product's read says
why (``PRODUCT_*``, shown by ``layer_routes``).

A site's output is handed on as a rule layer's (:meth:`._capture._UseWatch._hand_on`): a
copy only where the capture copies sites, or where it is a view (``P.expand``); a site
run on flattened rows per sample is handed on viewed back to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._layers import _IN_OUT_OPS, LINEAR, _samples_first, transposed_linear_rule
from ._rules import Rule

__all__ = ["PARAMETER_OPS", "PARAMETER_VIEWS", "PRODUCT_OPS", "TRANSPOSED", "ParameterOp",
           "flattened_operand", "positional", "product_site", "register_parameter_op",
           "register_parameter_view", "scattered", "sum_to_shape", "transposed_view"]


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


# Views of a free parameter that a registered operation may read in its place: for each
# torch function, the basic index ``(slice, int, ...)`` its call takes from the parameter,
# or None where the call is not such a view.
PARAMETER_VIEWS: dict[Callable, Callable] = {}


def register_parameter_view(*funcs: Callable):
    """Register the decorated ``index(args, kwargs)`` for ``funcs``."""

    def decorate(index):
        for func in funcs:
            PARAMETER_VIEWS[func] = index
        return index

    return decorate


def _basic(item) -> bool:
    """Whether ``item`` of an index takes a view the same for every sample: an int, a
    slice of ints (its bounds computed as Python numbers, not tensors), ``...``, None."""
    if isinstance(item, slice):
        return all(b is None or type(b) is int for b in (item.start, item.stop, item.step))
    return type(item) is int or item is Ellipsis or item is None


@register_parameter_view(torch.Tensor.__getitem__)
def sliced(args, kwargs):
    """``P[:, :L]``, ``P[:L]``, ``P[0]``: the index, where it is basic."""
    if kwargs or len(args) != 2:
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return index if all(_basic(item) for item in index) else None


@register_parameter_view(torch.narrow, torch.Tensor.narrow)
def narrowed(args, kwargs):
    """``P.narrow(dim, start, length)``: the slice of ``dim``, as an index."""
    if kwargs or len(args) != 4 or not all(type(a) is int for a in args[1:]):
        return None
    dim, start, length = args[1:]
    if not -args[0].ndim <= dim < args[0].ndim:
        return None  # torch's own error, from the call as it runs
    dim %= args[0].ndim
    start += args[0].shape[dim] if start < 0 else 0
    return (slice(None),) * dim + (slice(start, start + length),)


def _sizes(sizes) -> bool:
    """Whether ``sizes`` of a reshape are Python ints (a shape, or -1), one tuple of them
    or several."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = sizes[0]
    return bool(sizes) and all(type(size) is int for size in sizes)


@register_parameter_view(torch.Tensor.reshape, torch.reshape, torch.Tensor.view,
                         torch.Tensor.unsqueeze, torch.unsqueeze)
def reshaped(args, kwargs):
    """``P.reshape(1, -1, 1, 1)``, ``P.view(...)``, ``P.unsqueeze(-1)`` (a per-channel
    gain laid out against channels-first activations): every entry of ``P``, in its
    row-major order, so the view's gradient is ``P``'s reshaped (the empty index, all of
    ``P``). Sizes held in tensors, and ``view(dtype)``, are not such views."""
    if kwargs or len(args) < 2 or not _sizes(args[1:]):
        return None
    return ()


def scattered(g: torch.Tensor, shape: torch.Size, index: tuple) -> torch.Tensor:
    """``g (n, C, view.numel())``, the gradient of the view ``P[index]``, as the gradient
    of ``P`` of ``shape``: ``(n, C, prod(shape))``, zero outside the view's entries."""
    n, C = g.shape[:2]
    out = g.new_zeros((n, C, *shape))
    target = out[(slice(None), slice(None), *index)]
    target.copy_(g.reshape(target.shape))
    return out.reshape(n, C, -1)


def parameter_view(func, args, kwargs, param: torch.Tensor):
    """The basic index of ``param`` that ``func(*args, **kwargs)`` reads as a view, else
    None."""
    index = PARAMETER_VIEWS.get(func)
    if index is None or not args or args[0] is not param:
        return None
    return index(args, kwargs)


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


def flattened_operand(site, shape: torch.Size) -> torch.Tensor | None:
    """For the site ``(op, operand)`` of a binary operation on a parameter of ``shape``
    whose operand is a matrix product's output on rows flattened from sample-major memory
    (``x.view(-1, d) @ W + b``: :func:`._layers._samples_first`), that operand per sample,
    ``(n, -1, d)``, where the parameter broadcasts over the rows alone (``(d,)``,
    ``(1, d)``); else None. The operation on it is the same, its rows the samples."""
    op, operand = site
    if operand is None or len(shape) > 2 or (len(shape) == 2 and shape[0] != 1):
        return None
    a = _samples_first(operand)
    return None if a is operand else a


def broadcast_over_samples(shape: torch.Size, z: torch.Tensor, n: int) -> bool:
    """Whether a parameter of ``shape`` reaches ``z``'s rows (the samples) by broadcast."""
    if z.ndim == 0 or z.shape[0] != n or len(shape) > z.ndim:
        return False
    return len(shape) < z.ndim or shape[0] == 1


# ------------------------------------------------------------------ matrix products
# A free 2-D parameter read as the weight of a linear map, ``F.linear(x, P[, b])``,
# ``x @ P``, ``torch.matmul(x, P)``, ``torch.addmm(b, x, P)`` or any of these with ``P.T``:
# its per-sample gradient is the Linear rule's, so the call is run as a site of that rule
# (``LINEAR``: the weight ``(out, in)``, or the transposed one ``(in, out)``), whose
# factors (input ``x``, backprop ``delta``) give the term.
IN_OUT = transposed_linear_rule()
PRODUCT_OPS = frozenset((F.linear, *_IN_OUT_OPS))

# The watched view ``P.T`` of a free parameter (``P.t()``, ``P.mT``, ``P.transpose(0, 1)``)
# is marked by this in place of a basic index: only a matrix product reads it as a site.
TRANSPOSED = "T"
_TRANSPOSES = frozenset((torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.t,
                         torch.t))

# Why a matrix product reading a free parameter is not such a site (layer_routes says it).
PRODUCT_LEFT = ("a raw nn.Parameter read as the left factor of a matrix product (P @ x), "
                "whose rows are then not the samples; only x @ P, x @ P.T and "
                "F.linear(x, P[, b]) with the samples leading in x are structured")
PRODUCT_SHAPE = ("a raw nn.Parameter read by a matrix product as a weight that is not 2-D "
                 "(a batched P), or by one whose input x has fewer than 2 axes (no sample "
                 "axis), or as a bias that is not of shape (out,) (broadcast)")
PRODUCT_VIEW = ("a raw nn.Parameter read by a matrix product through a view other than P.T "
                "(a slice of it, it reshaped)")
PRODUCT_NO_GRAD = "a raw nn.Parameter read by a matrix product under disabled grad"
PRODUCT_OTHER = ("a raw nn.Parameter read by a matrix product in a call whose arguments are "
                 "not (x, P[, b]) as x @ P, x @ P.T or F.linear(x, P[, b]) take them")


def transposed_view(func, args, kwargs, param: torch.Tensor) -> bool:
    """Whether ``func(*args, **kwargs)`` takes the transpose of the 2-D ``param``."""
    if kwargs or not args or args[0] is not param or param.ndim != 2:
        return False
    if func in _TRANSPOSES:
        return len(args) == 1
    if func in (torch.Tensor.transpose, torch.transpose):
        return (len(args) == 3 and all(type(d) is int and -2 <= d < 2 for d in args[1:])
                and args[1] % 2 != args[2] % 2)
    return False


# The names torch gives each matrix product's arguments, in their positional order: a
# call passing some by keyword (``F.linear(x, weight=W, bias=b)``,
# ``torch.matmul(input=x, other=W)``) is read as the same call passing them by position.
_ARGUMENT_NAMES = {F.linear: ("input", "weight", "bias"), torch.matmul: ("input", "other"),
                   torch.mm: ("input", "mat2"), torch.addmm: ("input", "mat1", "mat2"),
                   torch.Tensor.matmul: ("self", "other"), torch.Tensor.mm: ("self", "mat2"),
                   torch.Tensor.__matmul__: ("self", "other")}


def positional(func, args, kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the matrix product ``func`` with the arguments passed by
    keyword moved to their positions (the call unchanged), and ``torch.addmm``'s
    ``beta=1``, ``alpha=1`` dropped (its default, no scaling); what is left in ``kwargs``
    (``out=``, another scale) is no argument of a site."""
    names = _ARGUMENT_NAMES.get(func)
    if not kwargs or names is None:
        return args, kwargs
    kwargs = dict(kwargs)
    args = list(args)
    for name in names[len(args):]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    if func is torch.addmm:
        for scale in ("beta", "alpha"):
            if type(kwargs.get(scale)) in (int, float) and kwargs[scale] == 1:
                del kwargs[scale]
    return tuple(args), kwargs


def _bias_of(func, args, kwargs):
    """The arguments of a linear call, ``(x, w, b)`` (all it passes: a free parameter
    in it is one of these), None where the call passes others (``args`` and ``kwargs``
    as :func:`positional` gives them)."""
    if kwargs:
        return None
    if func is F.linear:
        if not 2 <= len(args) <= 3:
            return None
        return args[0], args[1], args[2] if len(args) == 3 else None
    if func is torch.addmm:
        if len(args) != 3:
            return None
        return args[1], args[2], args[0]
    if len(args) != 2:
        return None
    return args[0], args[1], None


def _linear_expand(layer, func, args, kwargs):
    """``F.linear(x, P[, b])`` (arguments by position) as a site: on an input whose rows
    are flattened, ``x.view(-1, in)`` of sample-major memory, the call runs on them per
    sample (``(n, -1, in)``, :func:`._layers._samples_first`, as the transposed rule's
    expand reads them), and its output is the call's own, ``(rows, out)``, as a view of
    the site ``z`` (the capture hands on ``z`` or its copy, then views it so); otherwise one
    site ``(x, z)``."""
    x = args[0]
    a = _samples_first(x)
    z = func(a, *args[1:])
    return (z if a is x else z.view(*x.shape[:-1], z.shape[-1])), [(a, z)]


def _matmul_expand(layer, func, args, kwargs):
    """``x @ P``, ``torch.addmm(b, x, P)`` (arguments by position) as a site: on an input
    whose rows are flattened, ``x @ P`` runs on them per sample as :func:`_linear_expand`
    does (``torch.matmul`` folds them back into the one product), and ``torch.addmm`` as
    the transposed rule's expand (which copies its output: ``addmm`` takes no samples
    axis); otherwise one site ``(x, z)``."""
    x = args[1] if func is torch.addmm else args[0]
    a = _samples_first(x)
    if a is x:
        z = func(*args)
        return z, [(x, z)]
    if func is torch.addmm:
        return IN_OUT.expand(layer, func, args, kwargs)
    z = torch.matmul(a, args[1])
    return z.view(*x.shape[:-1], z.shape[-1]), [(a, z)]


def product_site(func, args, kwargs, free: dict[int, str], views: dict[int, tuple | str]
                 ) -> tuple[Rule, dict[str, str], Callable | None] | str:
    """How the matrix product ``func(*args, **kwargs)`` (``func`` one of ``PRODUCT_OPS``)
    reads the free parameters ``free`` (their names by the id of the tensor read, a
    parameter or a view of one with its index or ``TRANSPOSED`` in ``views``).

    Returns ``(rule, names, expand)``: the rule whose factors give the gradient (the
    Linear's for a weight ``(out, in)``: ``F.linear(x, P)``, ``x @ P.T``; the transposed
    one for ``(in, out)``: ``x @ P``, ``F.linear(x, P.T)``), the parameters it covers
    (``{"weight": ..., "bias": ...}``), and the ``expand`` the call runs as
    (:func:`_linear_expand`, :func:`_matmul_expand`: both read an input's rows flattened
    as ``x.view(-1, d)`` sample by sample); else why not. The
    arguments are those :func:`positional` gives (passed by keyword or not).
    """
    parts = _bias_of(func, args, kwargs)
    if parts is None:
        return PRODUCT_OTHER
    x, w, b = parts
    if isinstance(x, torch.Tensor) and id(x) in free:
        return PRODUCT_LEFT
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return PRODUCT_OTHER
    if w.ndim != 2 or x.ndim < 2:
        return PRODUCT_SHAPE
    names = {}
    transposed = func is not F.linear
    if id(w) in free:
        view = views.get(id(w))
        if view is not None and view != TRANSPOSED:
            return PRODUCT_VIEW
        transposed ^= view == TRANSPOSED
        names["weight"] = free[id(w)]
    if isinstance(b, torch.Tensor) and id(b) in free:
        if id(b) in views:
            return PRODUCT_VIEW
        # F.linear broadcasts a bias of shape (1,) or (n, out); the rule's bias term is
        # one entry per output feature.
        if tuple(b.shape) != (w.shape[0 if func is F.linear else 1],):
            return PRODUCT_SHAPE
        names["bias"] = free[id(b)]
    return (IN_OUT if transposed else LINEAR, names,
            _linear_expand if func is F.linear else _matmul_expand)
