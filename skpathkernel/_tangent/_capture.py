"""One watched forward pass, one backward pass per output: the layers' factors.

The capture runs ``functional_call(module, params, (X,))`` under a torch-function mode
(:class:`_UseWatch`) that takes, for every layer with a rule (:mod:`._rules`), the input
``a`` and output ``z`` of each site of the layer's own operation (``F.linear`` for
nn.Linear; attention's projections for nn.MultiheadAttention); then, for every requested
output ``c``, ``grad(f[:, c].sum(), z)`` gives the backprops ``delta_c`` of all the sites at
once. Samples are independent (the modules have no cross-sample state; a BatchNorm that
normalises with batch statistics is refused, :func:`check_per_sample`), so the gradient of
the sum is the per-sample gradient.

A parameter used at several sites (a layer called twice per forward, or sitting at
several places of the module tree; a weight tied between rule layers, such as a language
model's embedding and output head) has the sum of the sites' gradients: every call is a
use, and :func:`_summed_uses` sums their terms into the parameter's one term (joining
their positions where the uses have one structure, so that the Gram's contractions give
the cross terms). A layer goes to the generic fallback instead (:mod:`._generic`) when its
rule does not accept one of its calls, when the rows of its input are not the samples,
when one of its parameters is read in any other way than a rule layer's own operation (a
parent's ``x @ self.lin.weight.T``, a forward hook, a patched ``forward``: see
:class:`_UseWatch`, and :func:`_numerical_misfits` for reads torch functions do not see),
or when it shares a parameter with a layer that goes there. The reason is kept per
parameter (``Capture.reasons``) for :func:`._routes.layer_routes`.

Parameters that no rule layer holds (a class token, a position embedding, a gain kept
as a raw ``nn.Parameter``) are watched too: each read through a registered elementwise
operation (:mod:`._parameters`), of the parameter or of a slice of it
(``x + self.pos[:, :L]``), broadcast over the samples, is a site whose backprop
gives their per-sample gradient (summed over the sites of a parameter read twice); a
2-D one read as a linear map's weight (``F.linear(x, P)``, ``x @ P``, ``x @ P.T``, with
the samples leading in ``x``), or a bias read with it, makes that call a site of the
Linear rule, factored as an ``nn.Linear``'s call; any other read leaves them to the
fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from .._checkpoint import functional_call
from .._device import forked_rng, forward_input
from .._network._inputs import check_outputs
from .._path._training import mode_dependent_layers, refused_in_mode
from .._warnings import caller_stacklevel
from . import _layers  # noqa: F401  (registers the built-in rules)
from ._cnn import cnn_backprops, first_formed, pools_first
from ._contract import dense_grad, grad_times, one_hot, param_numel, split_constant_inputs
from ._generic import per_sample_jacobian, strided
from ._layers import (
    BATCH_NORM,
    CONV1D,
    CONV2D,
    CONV3D,
    FoldedUse,
    fold_batch_norm,
    foldable,
    folded_terms,
    formed_terms,
    site_sums,
)
from ._parameters import (
    PRODUCT_NO_GRAD,
    PRODUCT_OPS,
    PRODUCT_OTHER,
    TRANSPOSED,
    broadcast_over_samples,
    flattened_operand,
    parameter_site,
    parameter_view,
    positional,
    product_site,
    scattered,
    transposed_view,
)
from ._rules import Rule, Term, Use, rule_for
from ._saved import SavedWatch, differentiable_forward
from ._saved import tensors as _tensors

__all__ = ["Capture", "capture", "check_functional_lookups", "check_lookups",
           "check_per_sample", "check_rows", "check_samples", "checked_capture", "forward",
           "plain_cnn_capture", "value_dtype"]

# Why a rule layer's parameters went to the fallback (reported by layer_routes).
READ_OUTSIDE = "a parameter is read outside the layer's own call"
SHARED = ("a parameter of it is shared with a layer that goes to the fallback ({}), so no "
          "use of it is factored")
FREE_UNSTRUCTURED = ("a raw nn.Parameter read in its forward by an elementwise +, * or expand "
                     "(of it or of a slice of it) that is not broadcast over the samples")
NOT_SAMPLES = "the rows of its input are not the samples"


# Embedding lookups whose backward divides a row's gradient by its token's count in the
# batch (``scale_grad_by_freq``): that flag's position in each function's arguments.
_FREQ_FLAG = {F.embedding: 5, F.embedding_bag: 5, torch.embedding: 3}
FREQ_SCALED = ("scale_grad_by_freq=True: its backward divides each row's gradient by the "
               "number of times its token occurs in the batch, which is not the derivative "
               "of the forward pass (and mixes the samples), so tangent features, kernels "
               "and decompositions, which need d f / d theta, would be wrong. Use "
               "scale_grad_by_freq=False.")


# Batch normalisation by the batch's own statistics (``training=True``), called as a
# function (a meta-learning model's ``F.batch_norm(h, None, None, w, b, training=True)``):
# that flag's position in each function's arguments. nn.BatchNorm layers are refused
# before the forward pass (:func:`check_per_sample`).
_BATCH_STATS = {F.batch_norm: 5, torch.batch_norm: 5}


def _refuse_batch_statistics(func, args, kwargs) -> None:
    """Refuse a batch-norm call (``func`` one of ``_BATCH_STATS``'s) with ``training=True``:
    a sample's output then depends on the other samples of the batch, and no per-sample
    gradient describes the network."""
    i = _BATCH_STATS[func]
    if kwargs.get("training", args[i] if len(args) > i else False):
        raise ValueError(
            f"A call of {getattr(func, '__name__', func)} has training=True: it normalises "
            "with the statistics of the batch, which mixes the samples, so per-sample "
            "gradients do not describe the network. Normalise with running statistics "
            "(training=False) before computing kernels or features.")


def _refuse_frequency_scaling(func, args, kwargs) -> None:
    """Refuse a lookup call (``func`` one of ``_FREQ_FLAG``'s) with the flag, whatever
    table it reads: a parameter, a tensor computed from one (``self.table * 2``), or a
    constant, as :func:`check_lookups` refuses the flag on any layer."""
    i = _FREQ_FLAG[func]
    if kwargs.get("scale_grad_by_freq", args[i] if len(args) > i else False):
        raise ValueError(f"A call of {getattr(func, '__name__', func)} has {FREQ_SCALED}")


@dataclass
class Capture:
    """Factors of the per-sample gradients of a block of samples.

    ``terms`` cover every parameter of ``params`` exactly once; ``fallback`` names the
    parameters whose terms are dense Jacobians from the generic fallback; ``exclude``
    names the parameters whose layers were sent to the fallback because a parameter of
    theirs is read outside the layer (given by the caller or found by this capture);
    ``declined`` those of rule layers sent there for another reason (called twice, an
    input the rule does not accept, rows that are not the samples) and the raw
    parameters that no elementwise rule covers, which every block of one call must route
    alike; ``reasons`` says why, per parameter of a rule layer.
    """

    terms: list[Term]
    fallback: tuple[str, ...]
    exclude: frozenset[str] = frozenset()
    declined: frozenset[str] = frozenset()
    reasons: dict[str, str] = field(default_factory=dict)
    #: Whether the rule layers' outputs were handed on as copies (see :func:`capture`'s
    #: ``copy_sites``).
    copied: bool = True
    #: Bytes of the tensors the forward pass saved for the backward passes (the graph
    #: that :func:`capture`'s ``kept`` holds), where ``measure_graph`` asked for them.
    graph_bytes: int = 0
    #: Whether the forward pass held its saved tensors copy-on-write (see
    #: :func:`capture`'s ``guard_saved``).
    guarded: bool = False
    #: Bytes of the forward pass's private copy of its rows (:func:`.forward_input`),
    #: alive for the whole capture beside its graph, backprops and factors, where no
    #: factor holds it (a first Linear's input is its weight's factor, in :meth:`nbytes`).
    input_bytes: int = 0
    #: Whether the capture may fold eval BatchNorms into the convolutions before them
    #: (see :func:`capture`'s ``fold_bn``): False once a capture found a folded
    #: convolution's output read elsewhere.
    fold_bn: bool = True

    def nbytes(self) -> int:
        size = 0
        for term in self.terms:
            size += term.delta.numel() * term.delta.element_size()
            size += sum(a.numel() * a.element_size() for _, a in term.inputs if a is not None)
        return size

    def capture_bytes(self) -> int:
        """What the capture of these rows holds at its peak, as the block and chunk plans
        estimate it: four times its factors (the graph, the backprops, the forming) and
        the copy of its rows; twice the graph where that is more (the saved tensors and
        the backward's products of their size). A forward pass whose graph dwarfs its
        factors (``Linear(8, 64)``, ``.repeat(1, 8192)``, then ``exp(sin(tanh(.)))``: 1
        kB of factors, 4 MiB of graph a row) was sized by its factors alone: one block
        of 64 rows, 512 MiB at any budget (``benchmarks/results/memory_repeat-s54.md``)."""
        return max(4 * self.nbytes(), 2 * self.graph_bytes) + self.input_bytes


def value_dtype(params: Mapping[str, torch.Tensor], X: torch.Tensor) -> torch.dtype:
    """The dtype of the engine's results: X's, or the parameters' for integer X (token
    ids, which an embedding maps into the parameters' dtype)."""
    if X.is_floating_point() or X.is_complex():
        return X.dtype
    for p in params.values():
        return p.dtype
    return torch.get_default_dtype()


def forward(module: torch.nn.Module, params: Mapping[str, torch.Tensor],
            X: torch.Tensor) -> torch.Tensor:
    """Network outputs ``(n_samples, n_outputs)`` at ``params``; a module that returns a
    tuple or a dict is refused, naming what to analyse (as a recorded network refuses
    it), rather than failing in the reshape. Only that: a module ending in ``.squeeze()``
    returns a 0-d tensor for one sample, which a recorded network takes."""
    with torch.no_grad():
        out = functional_call(module, dict(params), (forward_input(X),))
    if not isinstance(out, torch.Tensor):
        check_outputs(out, X.shape[0])  # its TypeError
    return out.reshape(X.shape[0], -1)


def check_per_sample(module: torch.nn.Module) -> None:
    """Refuse a module whose layers mix the samples of a batch, naming the layer.

    BatchNorm normalises with the batch's own statistics in training mode (and without
    running statistics in any mode): a sample's output then depends on the other samples,
    and no per-sample gradient describes the network. Embeddings: see
    :func:`check_lookups`.
    """
    check_lookups(module)
    for name, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and (
                layer.training or layer.running_mean is None or layer.running_var is None):
            why = ("is in training mode" if layer.training else "keeps no running statistics")
            raise ValueError(
                f"Layer {name or '(the module)'!r} ({type(layer).__name__}) {why}: it "
                "normalises with the statistics of the batch, which mixes the samples, so "
                "per-sample gradients do not describe the network. Call module.eval() (with "
                "track_running_stats=True) before computing kernels or features.")
    # The other layers that fit and PathRecorder refuse in training mode: per sample, but
    # each forward pass here (layer_routes, check_rule, the kernels) would move the
    # module's buffers (running statistics, spectral normalisation's singular vectors),
    # and with them the function the features are taken of.
    for name, layer, _ in mode_dependent_layers(module):
        if refused_in_mode(layer):
            # Per sample either way (BatchNorm's case is refused above): what they move.
            moved = ("its running statistics" if isinstance(layer, nn.modules.instancenorm
                                                            ._InstanceNorm)
                     else "the singular vectors its spectral normalisation divides by")
            raise ValueError(
                f"Layer {name!r} ({type(layer).__name__}) is in training mode: every "
                f"forward pass updates {moved} (buffers), so computing kernels or features "
                "would rewrite them and change the function they describe. Call "
                "module.eval() first.")


def check_lookups(module: torch.nn.Module) -> None:
    """Refuse an embedding layer whose lookup is not a function of the parameters.

    One with ``max_norm`` rescales the rows the batch reads in place, inside the forward
    pass: it would rewrite the parameters the kernel is computed at (a recorded point of
    the path), and a weight tied to it (an output head) would read rows that other
    samples rescaled. One with ``scale_grad_by_freq`` divides a row's gradient by its
    token's count in the batch: its backward is not the derivative of its forward, nor
    per-sample.
    """
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.scale_grad_by_freq:
            raise ValueError(f"Layer {name or '(the module)'!r} ({type(layer).__name__}) "
                             f"has {FREQ_SCALED}")
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.max_norm is not None:
            raise ValueError(
                f"Layer {name or '(the module)'!r} ({type(layer).__name__}) has "
                f"max_norm={layer.max_norm}: it renormalises its weight in place during the "
                "forward pass, which would rewrite the parameters the kernels and features "
                "are computed at and make a tied weight depend on the other samples. Use "
                "max_norm=None (renormalise the weight between steps instead).")


class _FrequencyWatch(TorchFunctionMode):
    """Refuses a functional lookup with ``scale_grad_by_freq`` (what :func:`check_lookups`
    cannot see on the layers); every other call runs as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FREQ_FLAG:
            _refuse_frequency_scaling(func, args, kwargs)
        return func(*args, **kwargs)


def check_functional_lookups(module: torch.nn.Module, params: Mapping[str, torch.Tensor],
                             X: torch.Tensor) -> None:
    """:func:`check_lookups` for the functional calls (``F.embedding(ids, self.table,
    scale_grad_by_freq=True)``): one forward pass at ``params`` on ``X`` (a row or two),
    for the computations that run no use watch of their own (the Hessian's trace). A
    module that draws at random draws from torch's generators, whose states are
    restored."""
    devices = [X.device] if X.device.type == "cuda" else []
    with torch.no_grad(), forked_rng(devices), _FrequencyWatch():
        functional_call(module, dict(params), (forward_input(X),))


def _inside(prefix: str, outer: str) -> bool:
    return outer == "" or prefix.startswith(outer + ".")


def _rule_layers(module, params, exclude=frozenset()):
    """Layers with a rule, their rule, and their differentiated parameters' names; the
    reasons of those left to the fallback, and the prefixes of every rule layer.

    A rule layer owns every parameter of its subtree (nn.MultiheadAttention reads its
    ``out_proj``'s): layers inside a rule layer are not rule layers themselves. A
    parameter is named by its key in ``params``, the first name ``named_parameters`` gives
    it: a weight tied to another module's (``head.weight = emb.weight``) is the same key in
    both layers, and a layer at several places of the tree is listed once (the use watch
    sees each of its calls). Layers holding a parameter named in ``exclude`` are left to
    the fallback; ``reasons`` says so for their parameters.
    """
    key = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        key.setdefault(id(p), name)
    layers, taken, reasons = [], [], {}
    for prefix, layer in module.named_modules():
        if any(_inside(prefix, outer) for outer in taken):
            continue
        rule = rule_for(type(layer))
        if rule is None:
            continue
        taken.append(prefix)
        names = {local: key[id(p)]
                 for local, p in layer.named_parameters(remove_duplicate=False)
                 if key[id(p)] in params}
        if not names:
            continue
        if exclude.intersection(names.values()):
            reasons.update(dict.fromkeys(names.values(), READ_OUTSIDE))
            continue
        layers.append((layer, rule, names))
    return layers, reasons, taken


def _free_parameters(module, params, layers_prefixes, exclude) -> list[str]:
    """Differentiated parameters that no rule layer owns, not tied, not excluded: the
    candidates for the elementwise parameter rules (:mod:`._parameters`)."""
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    free = []
    for name, p in module.named_parameters():
        if name not in params or name in exclude or uses[id(p)] > 1:
            continue
        owner = name.rpartition(".")[0]
        if not any(owner == t or _inside(owner, t) for t in layers_prefixes):
            free.append(name)
    return free


_LIKE = frozenset({torch.Tensor.to, torch.Tensor.type_as})
# Calls that hand a tensor's values to Python: a slice bound computed from them
# (``self.pos[:int(mask.sum(1).max())]``) may depend on the block's data, which the index
# of the view, a plain int, does not show. NumPy's reads count too
# (``int(lengths.max().numpy())``, ``np.asarray(t)``).
_VALUE_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
                          torch.Tensor.__index__, torch.Tensor.__float__,
                          torch.Tensor.__bool__, torch.Tensor.numpy,
                          torch.Tensor.__array__})


class _Declined:
    """The own call ran, but not as the rule's sites: why (the rule's ``expand`` may say)."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


_DECLINED = _Declined("its rule declines this call (see the rule's expand)")

# Reads of a tensor's metadata only (``x.dim()``, ``x.shape``): not a use of its values.
_METADATA = frozenset({"dim", "size", "__get__", "numel", "stride", "is_contiguous",
                       "is_floating_point", "__len__", "ndimension", "nelement",
                       "element_size", "get_device", "is_complex"})
_CONVOLUTIONS = (CONV1D, CONV2D, CONV3D)


class _Frame:
    """One running call of a rule layer: its own parameter read, once, gives the factors."""

    __slots__ = ("inputs", "layer", "use")

    def __init__(self, layer: int, inputs: tuple):
        self.layer, self.inputs = layer, inputs  # inputs: the layer's call's arguments
        self.use = None  # (Use, site outputs z), or a _Declined


class _UseWatch(TorchFunctionMode):
    """Sees how a forward pass reads the rule layers' parameters, and takes the factors.

    A rule only knows its layer's own operation (``F.linear(a, W, b)`` for nn.Linear):
    if a parameter is read any other way (``x @ self.lin.weight.T`` in a parent, a
    forward hook, a patched ``forward``, ``W * W`` inside the layer, a second
    ``F.linear`` with the same weight), the factors miss part of the gradient. Every
    torch function called during the forward passes through here. Exactly one call of
    one of the rule's ``ops`` per call of the innermost running rule layer, on that
    layer's own parameters (a tied weight is the own parameter of every rule layer
    holding it), is a use of the layer: it runs as the rule's sites (``(args[0], result)``,
    or the rule's ``expand``), whose inputs ``a`` and outputs ``z`` are the factors (the
    result is handed on as a copy, so an in-place op downstream cannot rewrite ``z``; with
    ``copy=False`` as it is, its version counter kept in ``handed`` for the caller to check
    that nothing rewrote it).
    Any other call that takes a watched parameter and returns a tensor gradients can
    flow through marks the parameter; so does any call under disabled grad (a custom
    ``autograd.Function``'s ``forward``, whose backward may route a gradient to it).
    Metadata reads (``.shape``, ``.size()``) return no tensor and are ignored. This is
    structural: it holds on every sample, whatever the parameter values. Code that torch
    functions do not see (TorchScript, C++ extensions, ``DisableTorchFunction``) is not
    watched here: :func:`_numerical_misfits` checks a few samples for it
    (:func:`check_rows`).

    The mode is thread-local; the hooks that maintain ``frames`` live on the module and
    fire in every thread, so they ignore calls from other threads.
    """

    def __init__(self, owners: dict[int, tuple[frozenset[int], str]], ops: dict[int, tuple],
                 layers: dict[int, tuple[nn.Module, Rule]] | None = None,
                 free: dict[int, tuple[str, torch.Tensor]] | None = None, copy: bool = True,
                 fold: bool = False):
        super().__init__()
        self.owners, self.ops, self.layers = owners, ops, layers or {}
        self.copy = copy
        # Eval BatchNorms folded into the convolution before them (:meth:`_fold`): the
        # last convolution output handed on, ``(tensor, frame)``, until something else
        # reads it; ``watched`` the ids of it and of the folded convolutions' outputs
        # (weakly held: the fold frees them), whose reading anywhere else is a ``broken``
        # fold.
        self.fold, self.broken = fold, False
        self.pending: tuple[torch.Tensor, _Frame] | None = None
        self.watched: dict[int, object] = {}
        self._consumed: int | None = None
        self.handed: list[tuple[torch.Tensor, int]] = []
        # Free parameters (no rule layer owns them): their reads through a registered
        # elementwise operation (:mod:`._parameters`) are sites; any other read is a miss.
        self.free = free or {}
        # The basic index of each view of a free parameter (``self.pos[:, :L]``), by the
        # view's id: the view is watched as its parameter (kept alive in ``free``).
        self.views: dict[int, tuple] = {}
        # Whether the forward read a tensor's values into Python before a view is taken:
        # then the view's bounds may come from the data, and it is a miss.
        self.values_read = False
        self.free_sites: dict[str, list] = {}
        self.free_misses: set[str] = set()
        # Matrix products reading free parameters as a linear map's weight and bias
        # (:func:`._parameters.product_site`), as ``(rule, names, use, sites)``; and why a
        # product that is none missed, by parameter (layer_routes says it).
        self.free_products: list[tuple] = []
        self.free_why: dict[str, str] = {}
        # The own call must take every differentiated parameter of its layer: the rule
        # gives each of them a term.
        self.expected: dict[int, set[str]] = {}
        for layers, name in owners.values():
            for layer in layers:
                self.expected.setdefault(layer, set()).add(name)
        self.thread = threading.get_ident()
        self.frames: list[_Frame] = []
        self.factors: dict[int, list] = {layer: [] for layer in ops}
        self.misfits: set[str] = set()

    def enter(self, layer, inputs: tuple = ()) -> None:
        if threading.get_ident() == self.thread:
            self.frames.append(_Frame(id(layer), inputs))

    def leave(self, layer) -> None:
        if threading.get_ident() != self.thread:
            return
        # Runs even when the layer raised (always_call): no frame outlives its call.
        while self.frames:
            frame = self.frames.pop()
            if frame.layer == id(layer):
                self.factors[frame.layer].append(frame.use)
                return

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = list(_tensors((args, kwargs)))
        if self.watched and any(id(t) in self.watched for t in tensors):
            return self._watched_call(func, types, args, kwargs, tensors)
        return self._call(func, types, args, kwargs, tensors)

    def _watched_call(self, func, types, args, kwargs, tensors):
        """A call reading a convolution's output that a BatchNorm may fold into, or has
        folded into (:meth:`_fold`): any read but the fold itself and metadata ends the
        first, and breaks the second (the capture then runs again without folding)."""
        self._consumed = None
        out = self._call(func, types, args, kwargs, tensors)
        if (getattr(func, "__name__", None) in _METADATA
                and next(_tensors(out), None) is None):
            return out
        for t in tensors:
            key = id(t)
            if key in self.watched and key != self._consumed:
                if self.watched.pop(key) is not None:
                    self.broken = True  # a folded convolution's output read elsewhere
                if self.pending is not None and self.pending[0] is t:
                    self.pending = None
        return out

    def _call(self, func, types, args, kwargs, tensors):
        owned = {self.owners[id(t)] for t in tensors if id(t) in self.owners}
        free = [self.free[id(t)] for t in tensors if id(t) in self.free] if self.free else []
        # A layer's own flag is refused before the forward, by check_lookups; this sees
        # the functional calls, whatever table they read (one computed from a watched
        # parameter, self.table * 2, is not watched itself). Every torch call of the
        # forward passes here: a membership test, not a function call, on each.
        if func in _VALUE_READS:
            self.values_read = True
        elif func in _FREQ_FLAG:
            _refuse_frequency_scaling(func, args, kwargs)
        elif func in _BATCH_STATS:
            _refuse_batch_statistics(func, args, kwargs)
        if free:
            if not owned:
                return self._free_call(func, args, kwargs, free)
            self.free_misses.update(name for name, _ in free)
        if not owned:
            return func(*args, **kwargs)
        top = self.frames[-1] if self.frames else None
        if (top is not None and top.use is None and func in self.ops[top.layer]
                and {name for _, name in owned} == self.expected[top.layer]
                and all(top.layer in layers for layers, _ in owned)
                and args and isinstance(args[0], torch.Tensor)):
            return self._own_call(top, func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _LIKE and not (args and id(args[0]) in self.owners):
            return out  # h.to(W), h.type_as(W): W only lends its dtype and device
        if any(not torch.is_grad_enabled() or o.requires_grad for o in _tensors(out)):
            self.misfits.update(name for _, name in owned)
        return out

    def _free_call(self, func, args, kwargs, free):
        """A call reading free parameters: a site when it is one registered operation on
        one of them or on a basic-indexing view of one, with grad enabled; such a view
        (``self.pos[:, :L]``) is watched in its turn; else a miss (the parameter falls
        back)."""
        if func in PRODUCT_OPS:
            return self._product_call(func, args, kwargs, free)
        site = index = None
        name, read = free[0]
        if len(free) == 1 and torch.is_grad_enabled():
            site = parameter_site(func, args, kwargs, read)
            if site is None and id(read) not in self.views:
                # P.T takes no bounds, so values read before it do not matter.
                index = (TRANSPOSED if transposed_view(func, args, kwargs, read)
                         else None if self.values_read
                         else parameter_view(func, args, kwargs, read))
        if site is not None and self.views.get(id(read)) == TRANSPOSED:
            site = None  # P.T is read as a site by a matrix product only
        flat = None
        if site is not None:
            a = flattened_operand(site, read.shape)
            if a is not None:
                # x.view(-1, d) @ W + b: run on the rows per sample, so the site's rows
                # are the samples; handed on as the rows the call would have given.
                args = tuple(a if t is site[1] else t for t in args)
                flat, site = site[1].shape, (site[0], a)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            site = index = None
        if index is not None:
            self.free[id(out)] = (name, out)
            self.views[id(out)] = index
            return out
        if site is not None:
            self.free_sites.setdefault(name, []).append(
                (*site, read.shape, self.views.get(id(read)), out))
            out = self._hand_on(out)
            return out if flat is None else out.view(*flat[:-1], out.shape[-1])
        if func in _LIKE and not (args and id(args[0]) in self.free):
            return out
        if any(not torch.is_grad_enabled() or o.requires_grad for o in _tensors(out)):
            self.free_misses.update(name for name, _ in free)
        return out

    def _product_call(self, func, args, kwargs, free):
        """A matrix product reading free parameters: a site of the Linear rule
        (:func:`._parameters.product_site`) where it reads them as a linear map's weight
        (and bias) with grad enabled, its output handed on as a rule layer's (:meth:`_hand_on`,
        viewed as the call's output where the site is its rows per sample; or the expand's
        own copy); else a miss, with its reason."""
        args, kwargs = positional(func, args, kwargs)
        found = (product_site(func, args, kwargs, {id(t): name for name, t in free},
                              self.views) if torch.is_grad_enabled() else PRODUCT_NO_GRAD)
        if not isinstance(found, str):
            rule, names, expand = found
            run = expand(None, func, args, kwargs)
            if run is None:
                found = PRODUCT_OTHER  # arguments the expand declines
            else:
                out, ((a, z),) = run
                self.free_products.append((rule, names, Use(func, args, kwargs, (a,)), (z,)))
                # z, or z viewed as flattened rows; z may itself be a view (F.linear with a
                # bias on (n, s, d) rows views addmm's output), whose views share its base.
                if out is z or out._base is (z._base if z._is_view() else z):
                    return self._hand_on(z).view(out.shape)
                return out  # the expand's own copy
        out = func(*args, **kwargs)
        if any(not torch.is_grad_enabled() or o.requires_grad for o in _tensors(out)):
            for name, _ in free:
                self.free_misses.add(name)
                self.free_why.setdefault(name, found)
        return out

    def _hand_on(self, out: torch.Tensor) -> torch.Tensor:
        """A site's output ``out`` as the rest of the forward pass gets it: a copy (see
        :func:`capture`'s ``copy_sites``; always for a view, whose hook would see the
        rewrites of its base), or ``out`` itself with its version kept in ``handed`` (which
        its views share: an in-place op on a view of it, the rows of a site run per
        sample, moves it too)."""
        if self.copy or out._is_view():
            return out.clone()
        self.handed.append((out, out._version))
        return out

    def _own_call(self, top: _Frame, func, args, kwargs):
        layer, rule = self.layers[top.layer]
        top.use = _DECLINED
        if rule.expand is None:
            if (rule is BATCH_NORM and self.pending is not None
                    and args[0] is self.pending[0]):
                return self._fold(top, func, args, kwargs)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                top.use = (Use(func, args, kwargs, (args[0],)), (out,))
                handed = self._hand_on(out)
                if self.fold and rule in _CONVOLUTIONS:
                    self._pend(handed, top)
                return handed
            return out
        expanded = (rule.expand(layer, func, args, kwargs, top.inputs) if rule.call_inputs
                    else rule.expand(layer, func, args, kwargs))
        if expanded is None or isinstance(expanded, str):
            if expanded:
                top.use = _Declined(f"its rule declines this call: {expanded}")
            return func(*args, **kwargs)
        out, sites = expanded
        if sites and all(isinstance(z, torch.Tensor) and z.requires_grad for _, z in sites):
            top.use = (Use(func, args, kwargs, tuple(a for a, _ in sites)),
                       tuple(z for _, z in sites))
            out = _apart(out, [z for _, z in sites])
        return out

    def _pend(self, handed: torch.Tensor, frame: _Frame) -> None:
        """A convolution's output handed on: an eval BatchNorm called on it next folds
        into it (:meth:`_fold`), unless something else reads it first."""
        if self.pending is not None:
            self.watched.pop(id(self.pending[0]), None)
        self.pending = (handed, frame)
        self.watched[id(handed)] = None

    def _fold(self, top: _Frame, func, args, kwargs):
        """The BatchNorm call ``func(*args, **kwargs)`` on the pending convolution's
        output, folded into the convolution where :func:`._layers.foldable` (else run as
        it is): its output is the convolution's site, with the BatchNorm's call as the
        convolution's :class:`._layers.FoldedUse`; the BatchNorm's own use has no site
        (its terms come with the convolution's). The convolution's output is no longer
        held (the graph's largest saving: a tensor per pair), and any later read of it
        breaks the fold."""
        z, frame = self.pending
        self.pending = None
        self.watched.pop(id(z), None)
        calls, conv = self.factors[frame.layer], frame.use
        if (not isinstance(conv, tuple) or not any(c is conv for c in calls)
                or not foldable(conv[0], func, args, kwargs)):
            return self._own_call(top, func, args, kwargs)  # as it is: nothing pends
        y = fold_batch_norm(conv[0], z, func, args, kwargs)
        site = conv[1][0]
        # The folded output's values are read by nothing of the capture: its site is its
        # gradient edge (the graph does not hold it, an in-place op downstream cannot
        # rewrite what the edge receives), so it is neither copied nor checked.
        edge = _EdgeSite(y)
        bn = Use(func, (edge, *args[1:]), kwargs, (edge,))
        folded = (FoldedUse(conv[0].func, conv[0].args, conv[0].kwargs, conv[0].inputs, bn=bn),
                  (edge,))
        calls[next(i for i, c in enumerate(calls) if c is conv)] = folded
        top.use = (bn, ())
        self.handed = [(t, v) for t, v in self.handed if t is not site]
        # The convolution's output read again later (a residual of the pre-norm values)
        # would miss its own backprop: such a read breaks the fold.
        key = id(z)
        self.watched[key] = weakref.ref(z, lambda _, key=key: self.watched.pop(key, None))
        self._consumed = key
        return y


def _apart(out, zs):
    """A rule's ``expand`` result (a tensor, or a tuple of them) with every tensor that
    shares memory with a site's output ``z`` copied, as :class:`_UseWatch` hands on a
    site's output: an in-place op downstream (``nn.ReLU(inplace=True)``) would rewrite
    ``z``, and the backprops would be those of the rewritten tensor (or, ``z`` a view,
    hooking it crashes the process). A rule that copies itself (MultiheadAttention's,
    :func:`._layers.transposed_linear_rule`'s) pays nothing more here."""
    held = {z.untyped_storage().data_ptr() for z in zs}

    def apart(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in held:
            return t.clone()
        return t

    return tuple(apart(t) for t in out) if isinstance(out, tuple) else apart(out)


class _HookSlot:
    """The hook of an :class:`_EdgeSite`, set for the backward passes of one capture
    (the tensor's hook stays on its node for the graph's life; it holds this slot, which
    holds nothing of the graph)."""

    __slots__ = ("fn",)

    def __init__(self):
        self.fn = None

    def __call__(self, grad):
        return None if self.fn is None else self.fn(grad)

    def remove(self) -> None:
        self.fn = None


class _EdgeSite:
    """A site's output held as its gradient edge, without its values: what
    :func:`_backprops` reads of a site (shape, dtype, device, a hook, the edge that
    ``autograd.grad`` takes), for a folded BatchNorm's output (:meth:`_UseWatch._fold`),
    whose memory the graph then does not hold."""

    __slots__ = ("edge", "shape", "dtype", "device", "_slot")
    requires_grad = True

    def __init__(self, y: torch.Tensor):
        self.edge = get_gradient_edge(y)
        self.shape, self.dtype, self.device = y.shape, y.dtype, y.device
        self._slot = _HookSlot()
        # Registered while the tensor lives: the hook stays on its node after it is freed
        # (and fires for the edge taken as an input of autograd.grad).
        y.register_hook(self._slot)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def register_hook(self, fn) -> _HookSlot:
        self._slot.fn = fn
        return self._slot

    def new_empty(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)


def _zeros(z) -> torch.Tensor:
    """Zeros like a site's output (the gradient of an output that does not reach it)."""
    return torch.zeros_like(z) if isinstance(z, torch.Tensor) else z.new_empty(z.shape).zero_()


def _grad_inputs(zs) -> list:
    """The sites as ``autograd.grad`` takes them (an :class:`_EdgeSite` by its edge)."""
    return [z.edge if isinstance(z, _EdgeSite) else z for z in zs]


def _why_declined(calls, rule, layer) -> str | None:
    """Why one capture cannot use a rule layer's recorded calls (None: it can)."""
    if not calls:
        return "the layer is not called by the forward pass"
    for call in calls:
        if call is None:
            return "the layer's call does not read its parameters through its rule's operation"
        if isinstance(call, _Declined):
            return call.why
        if rule.accepts is not None and not rule.accepts(layer, call[0]):
            return "its rule does not accept this call's input"
    return None


def _misplaced(calls, rule, names, owners) -> str | None:
    """Why a rule that reads its call alone cannot take these calls: one passes a
    parameter in another argument than the rule's (``Rule.parameter_args``)."""
    if rule.parameter_args is None:
        return None
    for use, _ in calls:
        for local, (at, keyword) in rule.parameter_args.items():
            if local not in names:
                continue
            arg = use.args[at] if len(use.args) > at else use.kwargs.get(keyword)
            owner = owners.get(id(arg))
            if owner is None or owner[1] != names[local]:
                return (f"its call passes its parameter {local!r} in another argument than "
                        f"{keyword!r}, where the rule reads it")
    return None


def _checked_terms(terms, layer, names, params) -> list[Term]:
    """A rule's terms, normalised, with every parameter's size checked (rule bugs)."""
    own = set(names.values())
    out = []
    for term in terms:
        for name, a in term.inputs:
            if name not in own:
                raise ValueError(f"The rule for {type(layer).__name__} returned a term for "
                                 f"{name!r}, which is not one of its layer's parameters "
                                 f"{sorted(own)}.")
            if param_numel(term, a) != params[name].numel():
                raise ValueError(
                    f"The rule for {type(layer).__name__} gives {name!r} "
                    f"{param_numel(term, a)} gradient entries per output, but the parameter "
                    f"has {params[name].numel()}.")
        out.extend(split_constant_inputs(term))
    return out


def capture(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    X: torch.Tensor,
    outputs: Sequence[int],
    *,
    memory_budget: int,
    exclude: frozenset[str] = frozenset(),
    dense_fallback: bool = True,
    weights: torch.Tensor | None = None,
    scratch: list[torch.Tensor] | None = None,
    index: bool = False,
    formed: frozenset[str] = frozenset(),
    copy_sites: bool = True,
    kept: dict | None = None,
    last: bool = True,
    measure_graph: bool = False,
    guard_saved: bool = False,
    fold_bn: bool = False,
) -> Capture:
    """Kronecker factors (rule layers) and dense Jacobians (the rest) for the rows of X.

    Parameters
    ----------
    module : torch.nn.Module
    params : mapping of str to torch.Tensor
        The differentiated parameters (the others are the module's own, held fixed).
    X : torch.Tensor of shape (n_samples, ...)
        Inputs as the module takes them (token ids as int64).
    outputs : sequence of int
        The outputs ``c`` whose gradients are wanted; ``delta`` has ``len(outputs)``
        columns in this order.
    memory_budget : int
        Bytes for the fallback's Jacobian chunks.
    exclude : frozenset of str, default=frozenset()
        Parameters whose layers must use the fallback, on top of those this capture finds
        read outside their layer (the returned ``Capture.exclude`` holds both).
    dense_fallback : bool, default=True
        Compute the fallback's dense Jacobians; ``False`` leaves the fallback parameters
        without terms (to learn the routes only).
    weights : torch.Tensor of shape (n_samples, len(outputs)), default=None
        Contract the outputs per row: ``delta`` has one column, the gradient of
        ``sum_c w_nc f_c(x_n)`` (one backward pass instead of one per output; the rows are
        independent samples, so row ``n``'s weights reach only its own factors).
    scratch : list of torch.Tensor, default=None
        Buffers that the backprops of several outputs are written into, grown and
        reused across calls (a fresh tensor faults in every page on first touch): for a
        caller that copies every term out of the capture before the next call, as the
        chunks of a block of formed gradients do; the terms are views into them.
    index : bool, default=False
        Keep index terms (:attr:`Term.rows`: an embedding's ids) as they are, for the
        tangent-kernel engine, which contracts them without a vocabulary-sized factor;
        otherwise their one-hot factors are formed (:func:`._contract.one_hot`), for the
        consumers that contract factors as matrices.
    formed : frozenset of str, default=frozenset()
        Parameters whose per-sample gradients the caller forms from the terms (the
        tangent-kernel engine's gradient blocks): a layer with a cheaper way to form them
        than from its factors hands them on formed, as constant-input terms
        (:func:`._layers.formed_terms`).
    copy_sites : bool, default=True
        Hand the rule layers' outputs on to the rest of the forward pass as copies, so
        that an in-place op downstream (``nn.ReLU(inplace=True)``, ``out += identity``)
        cannot rewrite a site's output. ``False`` hands them on as they are, and runs the
        capture again with copies (``Capture.copied``) where one was rewritten (its version
        counter moved). Uncopied, a capture of the ResNet's chunks took 0.93 of the time
        by medians over 40 alternating rounds (``benchmarks/results/gram_resnet_profile.md``).
    kept : dict, default=None
        Where the forward pass of these rows is kept for the captures of other outputs
        of the same rows (the output groups of a trace, :func:`._gram._output_groups`):
        an empty dict runs the forward pass and keeps it there with its graph (unless
        ``last``); a dict holding one reuses it, with the same ``exclude``. The caller
        counts the graph's bytes (``measure_graph``).
    last : bool, default=True
        With ``kept``: the last capture of these rows, which frees the graph.
    measure_graph : bool, default=False
        Count the bytes of the tensors the forward pass saves for the backward passes
        that belong to no parameter, buffer or ``X`` (``Capture.graph_bytes``), and of
        those its ops made that outlive it otherwise (a custom ``autograd.Function``'s
        ``ctx.y = t``, which no saved-tensor hook sees; :meth:`.SavedWatch.alive`).
    guard_saved : bool, default=False
        Hold the tensors the forward pass saves for its backward copy-on-write
        (:class:`SavedWatch`); the capture sets it itself, and runs again, where an
        in-place op rewrote one (``nn.ReLU(inplace=True)`` after ``nn.Tanh()``).
    fold_bn : bool, default=False
        Fold each eval BatchNorm called on a rule convolution's output, and on nothing
        else, into the convolution (:meth:`_UseWatch._fold`): the graph holds one tensor
        instead of two, the backward passes skip BatchNorm's backward. The capture runs
        again without folding (``Capture.fold_bn`` False) where a folded convolution's
        output is read elsewhere.
    """
    if kept:
        state = kept["forward"]
        if last:
            kept.clear()
        return _captured(module, params, X, outputs, memory_budget, dense_fallback, weights,
                         scratch, index, formed, *state, retain=not last)
    check_per_sample(module)
    layers, reasons, taken = _rule_layers(module, params, exclude)
    # Parameters that require grad give every layer output a graph back to f; only the
    # layer outputs are differentiated, so no parameter gradient is ever computed.
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    free = _free_parameters(module, params, taken, exclude)
    holders: dict[str, set[int]] = {}
    for layer, _, names in layers:
        for full in names.values():
            holders.setdefault(full, set()).add(id(layer))
    watch = _UseWatch({id(live[full]): (frozenset(ids), full) for full, ids in holders.items()},
                      {id(layer): rule.ops for layer, rule, _ in layers},
                      {id(layer): (layer, rule) for layer, rule, _ in layers},
                      {id(live[name]): (name, live[name]) for name in free}, copy_sites,
                      fold_bn)
    handles = []
    for layer, _, _ in layers:
        handles.append(layer.register_forward_pre_hook(watch.enter))
        handles.append(layer.register_forward_hook(lambda lay, args, out: watch.leave(lay),
                                                   always_call=True))
    # A copy of the rows: a module writing into its input would rewrite X. The copy is
    # new memory that a kept forward pass holds (a first layer's input): counted, X not.
    x_in = forward_input(X)
    counted = _GraphBytes(module, live, X) if measure_graph else None
    saved = SavedWatch(counted, guard_saved)
    try:
        with torch.enable_grad(), watch, saved:
            f = functional_call(module, live, (x_in,)).reshape(X.shape[0], -1)
    finally:
        for h in handles:
            h.remove()
    rewritten = any(z._version != version for z, version in watch.handed)
    # A tensor saved for the backward pass and rewritten in place afterwards (an in-place
    # activation after a Tanh): autograd would refuse the backward, or under the hooks
    # read the rewritten values; again with saved tensors copied before such writes.
    resaved = saved.rewritten
    if watch.misfits or rewritten or resaved or watch.broken:
        # Every parameter of a layer with a misread parameter goes to the fallback; a
        # site's output rewritten in place is handed on as a copy. The first pass's
        # graph goes first: the watch holds its layers' inputs and outputs, and with
        # them the whole graph, which would otherwise be alive beside the second one.
        misfits = frozenset(watch.misfits)
        fold_bn = fold_bn and not watch.broken
        del f, watch, saved, x_in, counted
        return capture(module, params, X, outputs, memory_budget=memory_budget,
                       exclude=exclude | misfits,
                       dense_fallback=dense_fallback, weights=weights, scratch=scratch,
                       index=index, formed=formed, copy_sites=copy_sites or rewritten,
                       kept=kept, last=last, measure_graph=measure_graph,
                       guard_saved=guard_saved or resaved,
                       fold_bn=fold_bn)

    # Taken now: the backward passes free the graph, and what it holds with it.
    alive = saved.alive() if measure_graph else ()
    accepted, declined = _accepted_layers(layers, watch, X, reasons)
    sites, products = _accepted_free(free, watch, params, X, reasons, declined)
    accepted += products
    state = (f, exclude, accepted, declined, sites, reasons, watch.copy)
    if kept is not None and not last:
        kept["forward"] = state
    cap = _captured(module, params, X, outputs, memory_budget, dense_fallback, weights,
                    scratch, index, formed, *state, retain=kept is not None and not last)
    if measure_graph:
        # The kept forward holds the sites' outputs and the layers' inputs too, and what
        # else its ops made that outlives it (a custom Function's ctx attributes).
        for t in alive:
            counted.add(t)
        for *_, use, zs in accepted:
            for t in (*use.inputs, *zs):
                counted.add(t)
        for *_, z in sites:
            counted.add(z)
        cap.graph_bytes = counted.nbytes
    cap.guarded = guard_saved
    cap.fold_bn = fold_bn
    held = {a.untyped_storage().data_ptr() for term in cap.terms for _, a in term.inputs
            if a is not None}
    storage = x_in.untyped_storage()
    cap.input_bytes = 0 if storage.data_ptr() in held else storage.nbytes()
    return cap


def _captured(module, params, X, outputs, memory_budget, dense_fallback, weights, scratch,
              index, formed, f, exclude, accepted, declined, sites, reasons, copied,
              retain=False) -> Capture:
    """:func:`capture` after its forward pass: the outputs' backward passes (``retain``:
    the graph kept for another capture of the same forward), the factors, the fallback."""
    reasons = dict(reasons)
    terms_by_name = _rule_terms(f, accepted, outputs, weights, params, reasons, sites,
                                scratch, formed, retain, memory_budget=memory_budget)
    del f

    # A rule layer's parameter that its rule leaves without a term (an extra parameter
    # registered on an nn.Linear) is covered by the fallback like any other.
    fallback = tuple(name for name in params if name not in terms_by_name)
    if fallback and dense_fallback:
        jac = per_sample_jacobian(module, params, X, fallback, outputs,
                                  memory_budget=memory_budget)
        for name in fallback:
            delta = jac[name]
            if weights is not None:
                delta = torch.einsum("nc...,nc->n...", delta,
                                     weights.to(delta.dtype)).unsqueeze(1)
            terms_by_name[name] = Term(delta=delta, inputs=[(name, None)])
    # Flat (trajectory) order of the terms' first parameters keeps every output stable.
    order = {name: i for i, name in enumerate(params)}
    unique = {id(t): t for t in terms_by_name.values()}.values()
    terms = sorted(unique, key=lambda t: order[t.inputs[0][0]])
    if not index:
        terms = [one_hot(t) for t in terms]
    return Capture(terms=terms, fallback=fallback, exclude=exclude,
                   declined=frozenset(declined), reasons=reasons, copied=copied)


def plain_cnn_capture(cnn, params, X, outputs, *, exclude=frozenset(), scratch=None,
                      formed=frozenset(), copied=True) -> Capture:
    """:func:`capture` of a plain CNN (``cnn`` from :func:`._cnn.plain_cnn`, every
    parameter in ``params``) with its backprops computed by hand
    (:func:`._cnn.cnn_backprops`): the same terms, bit for bit, without the use watch and
    the autograd graph; but for a first convolution formed from its pooled backprops
    (:func:`._cnn.first_formed`), the same values in other sums. ``copied`` is handed on as
    the capture's (nothing is rewritten in place here)."""
    params = dict(params)
    with torch.no_grad():
        # The first convolution's gradients formed from its pooled backprops where the
        # caller forms them (:func:`._cnn.first_formed`).
        pooled = (f"{cnn.blocks[0].prefix}.weight" in formed
                  and pools_first(cnn, X, len(outputs)))
        accepted, deltas, idx = cnn_backprops(
            cnn, params, X, outputs, lambda j, shape, like: _buffer(scratch, j, shape, like),
            pooled_first=pooled)
        reasons: dict[str, str] = {}
        first = []
        if pooled:
            (layer, _, names, use, _), accepted = accepted[0], accepted[1:]
            first = _checked_terms(first_formed(use, deltas[0], idx, names), layer, names,
                                   params)
            deltas = deltas[1:]
        terms_by_name = _rule_terms(None, accepted, outputs, None, params, reasons,
                                    scratch=scratch, formed=formed, backprops=deltas)
        for t in first:
            terms_by_name[t.inputs[0][0]] = t
    order = {name: i for i, name in enumerate(params)}
    unique = {id(t): t for t in terms_by_name.values()}.values()
    terms = sorted(unique, key=lambda t: order[t.inputs[0][0]])
    return Capture(terms=terms, fallback=(), exclude=exclude, reasons=reasons,
                   copied=copied)


class _GraphBytes:
    """Counts the bytes of the tensors a forward pass saves for its backward pass (and
    those :meth:`add` names), each storage once, except those of the parameters, the
    module's buffers and ``X``: what keeping the forward pass holds."""

    def __init__(self, module, live, X):
        self._skip = {t.untyped_storage().data_ptr()
                      for t in (*live.values(), *module.buffers(), X)}
        self._seen: set[int] = set()
        self.nbytes = 0

    def add(self, t):
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += storage.nbytes()


def _rows_are_samples(calls, n: int) -> bool:
    """Whether every input and site of the recorded ``(use, sites)`` calls has ``n`` rows,
    one per sample (else a constant input, a subset of the rows, a batch that is not the
    first axis: the factors cannot be per-sample)."""
    return all(t.shape[0] == n for use, zs in calls for t in (*use.inputs, *zs))


def _accepted_layers(layers, watch, X, reasons):
    """The calls of the rule layers that give per-sample factors, as ``(layer, rule,
    names, use, sites)`` (one per call: a layer called twice gives two), and the parameter
    names of the layers declined (their reasons in ``reasons``).

    A layer is declined when any of its calls is (the sum of the calls' gradients would
    miss that call's), and so is every layer sharing a parameter with a declined one (a
    tied weight's gradient is the sum over all its uses).
    """
    why_of = {}
    for layer, rule, names in layers:
        calls = watch.factors[id(layer)]
        # Every call read its parameters once through the rule's op (a call that never
        # read them, or read them another way, sends the layer to the fallback).
        why = _why_declined(calls, rule, layer) or _misplaced(calls, rule, names, watch.owners)
        if why is None and not _rows_are_samples(calls, X.shape[0]):
            why = NOT_SAMPLES
        if why is not None:
            why_of[id(layer)] = why
    # A declined layer takes the layers it shares a parameter with along (to a fixed
    # point: a chain of tied weights); their parameters keep the first layer's reason.
    out = {name: why for layer, _, names in layers if id(layer) in why_of
           for name, why in dict.fromkeys(names.values(), why_of[id(layer)]).items()}
    changed = bool(out)
    while changed:
        changed = False
        for layer, _, names in layers:
            shared = [out[name] for name in names.values() if name in out]
            if id(layer) not in why_of and shared:
                why_of[id(layer)] = SHARED.format(shared[0])
                out.update({name: shared[0] for name in names.values() if name not in out})
                changed = True
    accepted, declined = [], set()
    for layer, rule, names in layers:
        if id(layer) not in why_of:
            accepted.extend((layer, rule, names, *call) for call in watch.factors[id(layer)])
            continue
        declined.update(names.values())
        reasons.update(dict.fromkeys(names.values(), why_of[id(layer)]))
    # A tied weight is reported as shared where a layer holding it went along with it.
    for layer, _, names in layers:
        if id(layer) in why_of and why_of[id(layer)].startswith(SHARED[:30]):
            reasons.update(dict.fromkeys(names.values(), why_of[id(layer)]))
    return accepted, declined


def _accepted_free(free, watch, params, X, reasons, declined):
    """The sites of the free parameters read only by registered operations, broadcast
    over the samples, as ``(name, op, operand, shape, index, z)`` (one per read: a
    parameter read twice has two, whose gradients are summed; ``index`` the view's of a
    read through one, of ``shape``, else None), and the matrix products reading them as
    accepted rule calls ``(None, rule, names, use, sites)`` (:meth:`_UseWatch._product_call`,
    ``names`` cut to the accepted parameters); the others join ``declined`` (every block
    then routes them to the fallback alike)."""
    accepted = []
    n = X.shape[0]
    for name in free:
        calls = watch.free_sites.get(name, [])
        products = [(use, zs) for _, names, use, zs in watch.free_products
                    if name in names.values()]
        if name in watch.free_misses or not (calls or products):
            declined.add(name)  # the fallback's own reason (layer_routes) says why
            if name in watch.free_why:
                reasons[name] = watch.free_why[name]
            continue
        if not all(broadcast_over_samples(shape, z, n) for *_, shape, _, z in calls):
            declined.add(name)
            reasons[name] = FREE_UNSTRUCTURED
            continue
        if not _rows_are_samples(products, n):
            declined.add(name)
            reasons[name] = NOT_SAMPLES
            continue
        accepted.extend((name, *call) for call in calls)
    products = []
    for rule, names, use, zs in watch.free_products:
        names = {key: name for key, name in names.items() if name not in declined}
        if names:
            products.append((None, rule, names, use, zs))
    return accepted, products


def _rule_terms(f, accepted, outputs, weights, params, reasons, free=(),
                scratch=None, formed=frozenset(), retain=False,
                backprops=None, memory_budget=0) -> dict[str, Term]:
    """Each accepted layer's terms by parameter name: the backprops to its call's sites
    (one backward pass per output, or one for a contraction; ``backprops``: computed
    already, one per site in order), factored by its rule (the parameters of ``formed``
    possibly formed, see :func:`capture`); and the terms of the free parameters' sites
    (``free``, from :func:`_accepted_free`). ``memory_budget``: the capture's, which
    bounds a batched pass over the outputs (:func:`_small_pass`)."""
    terms_by_name: dict[str, Term] = {}
    if accepted or free:
        if backprops is None:
            zs = [z for *_, sites in accepted for z in sites] + [z for *_, z in free]
            # The scalars whose gradients are the factors' columns: the outputs, or their
            # per-row contraction (the backprops are linear in the output's seed).
            seeds = ([f[:, c].sum() for c in outputs] if weights is None
                     else [(f[:, list(outputs)] * weights.to(f.dtype)).sum()])
            reduced = _reduced_sites(accepted, len(seeds))
            backprops = _backprops(seeds, zs, scratch, retain, reduced, memory_budget)
        else:  # computed by hand (a plain CNN's, :mod:`._cnn`): every site's in full
            reduced = {}
        deltas = iter(_own_memory(backprops))
        # Every call's terms (a layer called twice, or holding a tied weight, gives a
        # parameter several), summed per parameter below.
        uses: list[Term] = []
        # The BatchNorms folded into their convolutions (no site of their own): their
        # terms come with the convolution's.
        folded = {id(use): (layer, names) for layer, _, names, use, sites in accepted
                  if not sites}
        j = 0
        for layer, rule, names, use, sites in accepted:
            if not sites:
                continue
            layer_deltas = tuple(next(deltas) for _ in sites)
            summed, j = reduced.get(j), j + len(sites)
            if summed is not None:
                uses.extend(_checked_terms(summed.terms(), layer, names, params))
                continue
            inputs = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                           for a in use.inputs)
            if isinstance(use, FoldedUse):
                uses.extend(_folded_terms(dataclasses.replace(use, inputs=inputs),
                                          layer_deltas[0], layer, names, folded, params,
                                          formed))
                continue
            use = Use(use.func, use.args, use.kwargs, inputs)
            with torch.no_grad():
                terms = formed_terms(rule, use, layer_deltas, names, formed) if formed \
                    else None
                if terms is None:
                    terms = rule.factors(layer, use, layer_deltas, names)
            uses.extend(_checked_terms(terms, layer, names, params))
        sums: dict[str, torch.Tensor] = {}
        for name, op, operand, shape, index, _ in free:
            delta = next(deltas)
            with torch.no_grad():
                g = op.grad(delta, shape, None if operand is None else operand.detach())
                if index is not None:  # a view's gradient, zero outside its entries
                    g = scattered(g, params[name].shape, index)
                if name in sums:  # a parameter read twice: the sum of its sites'
                    sums[name] = sums[name] + g
                    continue
            if g.untyped_storage().data_ptr() == delta.untyped_storage().data_ptr():
                g = g.clone()  # its own memory, as every delta's (see _own_memory)
            sums[name] = g
        # Summed with the terms of the uses: a free parameter read by a matrix product
        # (a rule call above) and elementwise too gets the sum of both.
        uses.extend(Term(delta=g, inputs=[(name, None)]) for name, g in sums.items())
        with torch.no_grad():
            terms_by_name = _summed_uses(uses)
        for *_, names, _, _ in accepted:
            for name in names.values():
                if name not in terms_by_name:
                    reasons[name] = "its rule gives this parameter no term"
    return terms_by_name


def _folded_terms(use, delta, layer, names, folded, params, formed) -> list[Term]:
    """The terms of a convolution and of the BatchNorm folded into it
    (:func:`._layers.folded_terms`), the BatchNorm's where its layer is accepted."""
    bn_layer, bn_names = folded.get(id(use.bn), (None, {}))
    with torch.no_grad():
        conv, bn = folded_terms(use, delta, names, bn_names, formed)
    out = _checked_terms(conv, layer, names, params)
    if bn_layer is not None:
        out += _checked_terms(bn, bn_layer, bn_names, params)
    return out


def _reduced_sites(accepted, n_out: int) -> dict:
    """The sites whose backprops are summed over their positions as the backward passes
    compute them (:func:`._layers.site_sums`: BatchNorm's), by their index among the
    accepted calls' sites: their backprops are neither copied into a buffer nor kept."""
    sums, j = {}, 0
    for _, rule, names, use, sites in accepted:
        if len(sites) == 1:
            summed = site_sums(rule, use, names, n_out)
            if summed is not None:
                sums[j] = summed
        j += len(sites)
    return sums


def _structure(term: Term):
    """What two terms must share for their positions to be joined: the parameters, and
    every field but the factors (``groups``, ``transposed``); None where a field is not
    comparable (a tensor)."""
    fields = tuple(getattr(term, f.name) for f in dataclasses.fields(term)
                   if f.name not in ("delta", "inputs"))
    if any(isinstance(v, torch.Tensor) for v in fields):
        return None
    # A factor's width; an index factor (``rows=``: ids, (n, S)) is joined as it is.
    return (tuple(name for name, _ in term.inputs), fields, term.delta.shape[3],
            tuple(None if a is None else a.shape[2:] for _, a in term.inputs))


def _joinable(terms: list[Term]) -> bool:
    keys = {_structure(t) for t in terms}
    return len(keys) == 1 and None not in keys


def _joined(terms: list[Term]) -> list[Term]:
    """Terms of one structure as one, their positions concatenated (normalised)."""
    t0 = terms[0]
    joined = dataclasses.replace(
        t0, delta=torch.cat([t.delta for t in terms], dim=2),
        inputs=[(name, None if a is None else torch.cat([t.inputs[k][1] for t in terms], dim=1))
                for k, (name, a) in enumerate(t0.inputs)])
    return split_constant_inputs(joined)


def _summed_uses(terms: list[Term]) -> dict[str, Term]:
    """Every parameter's one term, from the terms of all its uses (a rule layer called
    twice, a weight tied between two layers): the per-sample gradient of a parameter used
    at several sites is the sum of the sites' gradients.

    Terms of the same structure (one layer's calls: the same parameters and factor widths;
    else one parameter's part of them, as for two Linears sharing a weight but not their
    biases) are joined along the positions, ``sum_s delta[s] (outer) a[s]`` over the
    positions of every use, so the Gram's contractions (position pairs or gradient
    blocks) give the cross terms of the uses exactly. Uses of different structures (an
    embedding table read as the output head's weight: a transposed one-hot term and a
    Linear's) are formed as per-sample gradients (:func:`._contract.dense_grad`) and
    summed into one constant-input term, as the fallback's Jacobians are; the other
    parameters of their terms keep their factors.
    """
    count = Counter(name for t in terms for name, _ in t.inputs)
    by_name: dict[str, Term] = {}
    if all(k == 1 for k in count.values()):
        for t in terms:
            by_name.update(dict.fromkeys((name for name, _ in t.inputs), t))
        return by_name
    # Connected components of the terms, linked by a shared parameter.
    parent = list(range(len(terms)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, t in enumerate(terms):
        for name, _ in t.inputs:
            j = first.setdefault(name, i)
            parent[root(i)] = root(j)
    parts: dict[int, list[Term]] = {}
    for i, t in enumerate(terms):
        parts.setdefault(root(i), []).append(t)
    for part in parts.values():
        if len(part) == 1:
            merged = part
        elif _joinable(part):
            merged = _joined(part)  # one layer's calls: the whole terms
        else:
            shared = {name for t in part for name, _ in t.inputs if count[name] > 1}
            merged = []
            for t in part:
                rest = [(name, a) for name, a in t.inputs if name not in shared]
                if rest:
                    merged.extend(split_constant_inputs(dataclasses.replace(t, inputs=rest)))
            for name in sorted(shared):
                pieces = [dataclasses.replace(t, inputs=[(n, a)])
                          for t in part for n, a in t.inputs if n == name]
                if _joinable(pieces):
                    merged.extend(_joined(pieces))
                    continue
                # Summed in place: the sum and one use's gradients alive at a time.
                t0, a0 = pieces[0], pieces[0].inputs[0][1]
                g = t0.delta.new_empty((*t0.delta.shape[:2], param_numel(t0, a0)))
                dense_grad(t0, a0, out=g)
                for t in pieces[1:]:
                    g.add_(dense_grad(t, t.inputs[0][1]))
                merged.append(Term(delta=g, inputs=[(name, None)]))
        for t in merged:
            by_name.update(dict.fromkeys((name for name, _ in t.inputs), t))
    return by_name


def _backprops(seeds, zs, scratch=None, retain=False, sums=None,
               memory_budget=0) -> list[torch.Tensor | None]:
    """``(n, len(seeds), *z.shape[1:])`` for every site output ``z``: column ``i`` the
    gradient of ``seeds[i]`` (zeros where it does not reach ``z``).

    With several seeds each backward pass's gradients are copied into their column as
    it computes them (:func:`_hooked_backprops`), so that only one pass's gradients are alive
    besides the result (a list of all of them, stacked at the end, held the backprops
    twice). ``scratch`` (see :func:`capture`) holds their memory. ``sums`` maps the
    index of a site whose backprops are summed over their positions as they come
    (:func:`._layers.site_sums`) to what sums them: its entry of the result is None.
    """
    sums = sums or {}
    n_out = len(seeds)
    if n_out == 1:
        g = torch.autograd.grad(seeds[0], _grad_inputs(zs), retain_graph=retain,
                                allow_unused=True)
        for j, s in sums.items():
            s.add(0, g[j])
        return [None if j in sums else
                (_zeros(z) if gz is None else gz).detach().unsqueeze(1)
                for j, (z, gz) in enumerate(zip(zs, g))]
    out = [None if j in sums else _buffer(scratch, j, (z.shape[0], n_out, *z.shape[1:]), z)
           for j, z in enumerate(zs)]
    if ((_batches_backprops(seeds[0].device) or _small_pass(zs, n_out, memory_budget))
            and _batched_into(out, seeds, zs, sums)):
        return out
    return _hooked_backprops(seeds, zs, out, retain, sums)


def _into(buf, summed, i: int, grad) -> None:
    """A site's gradient of pass ``i`` (None: not reached) into column ``i`` of its
    buffer, or to what sums it (``summed``, see :func:`_backprops`)."""
    if summed is not None:
        summed.add(i, grad)
    elif grad is None:
        buf[:, i].zero_()
    else:
        buf[:, i].copy_(grad)


def _hooked_backprops(seeds, zs, out, retain, sums):
    """:func:`_backprops`'s columns written by hooks on the sites' outputs, as the
    backward pass computes each gradient (still in cache), instead of after the pass,
    when the pass's later steps have evicted the first ones; ``sums`` as there."""
    n_out = len(seeds)
    column = [0]
    done: set[int] = set()

    def hook(j, grad):
        _into(out[j], sums.get(j), column[0], grad)
        done.add(j)

    handles = [z.register_hook(functools.partial(hook, j)) for j, z in enumerate(zs)
               if z.requires_grad]
    try:
        for i, seed in enumerate(seeds):
            column[0] = i
            done.clear()
            g = torch.autograd.grad(seed, _grad_inputs(zs),
                                    retain_graph=retain or i < n_out - 1, allow_unused=True)
            # A site whose hook did not run (not reached: None) is written after the pass.
            for j, (buf, gz) in enumerate(zip(out, g)):
                if j not in done:
                    _into(buf, sums.get(j), i, gz)
            del g
    finally:
        for h in handles:
            h.remove()
    return out


def _batches_backprops(device: torch.device) -> bool:
    """Whether the outputs' backprops are one batched backward pass (``is_grads_batched``)
    instead of one pass per output: not yet, on any device, but for small passes
    (:func:`_small_pass`).

    On a GPU each pass is a few dozen launches whatever its rows: the batched pass took
    the image networks' Grams at N = 128 from 1.33x (cnn8) to 2.1x (ViT) faster on an
    H200, the same K to 1.2e-7 (``benchmarks/results/gpu_ab.md``, its prototype). But it
    holds every output's gradients at once (a second copy beside the backprops, and C
    times the backward's intermediates without parameters, such as attention scores),
    which the chunk plan (:func:`._gram._chunk_row_bytes`) does not count: 11.9 MiB of a
    16 MiB budget where the default held 2.8 on a long-sequence attention network, 49.5
    with wide chunks (``benchmarks/results/gpu_choices_cpu.md``). The next GPU run
    times it with its peak memory (``bench_gpu_ab``); it is taken once the plan counts it.
    On one CPU core it was 5-15% slower.
    """
    return False


#: The most bytes of the sites' gradients that :func:`_small_pass` batches.
SMALL_PASS_BYTES = 16 * 2**20


def _small_pass(zs, n_out: int, memory_budget: int) -> bool:
    """Whether the outputs' backward passes over the sites ``zs`` are small enough to be
    one batched pass on any device: their gradients, every output's at once, take at most
    :data:`SMALL_PASS_BYTES` and a 128th of ``memory_budget`` (8 MiB of the default).

    A pass over a few rows costs mostly its torch calls, whatever their sizes: one
    batched pass instead of 64 took a capture of the trial's U-Net (C = 64, 0.94 MB of
    gradients a row) from 73 to 43 ms of CPU time on 4 rows, 85 to 66 on 9; of the
    8 x 8 CNN and the MLP of ``benchmarks/results/small_gram-s55.md`` (C = 10) 0.6-0.8
    of the time up to 129 rows; the backprops the same bits (4.9e-7 of the largest on
    the MLP's one row). Over more rows the loop streams fewer bytes at once (the
    U-Net's 65 rows, 62 MB: 395 ms batched against 276). The batched pass holds every
    output's gradients and the backward's intermediates beside the buffers, which the
    chunk plan does not count: the captures' peaks rose by 0.9-1.8 times these bytes
    (U-Net 9 rows, CNN and MLP 65), so at most a 64th of the budget.
    """
    size = sum(n_out * math.prod(z.shape) * z.dtype.itemsize for z in zs)
    return size <= min(SMALL_PASS_BYTES, memory_budget // 128)


def _batched_grads(seeds, inputs) -> list[torch.Tensor | None] | None:
    """``(len(seeds), *x.shape)`` gradients of every seed for every input, by one batched
    backward pass (None where a seed does not reach the input); None where autograd
    cannot batch the pass (an ``autograd.Function`` without a vmap rule, the device's
    memory), with the graph kept for one pass per seed."""
    s = torch.stack(seeds)
    eye = torch.eye(len(seeds), dtype=s.dtype, device=s.device)
    try:
        return list(torch.autograd.grad(s, inputs, eye, retain_graph=True,
                                        is_grads_batched=True, allow_unused=True))
    except RuntimeError:
        return None


def _batched_into(out: list[torch.Tensor | None], seeds, zs, sums=None) -> bool:
    """The backprops of every seed by one batched backward pass, written into ``out``
    (summed by ``sums[j]`` where ``out[j]`` is None, see :func:`_backprops`); False, with
    nothing written, where :func:`_batched_grads` cannot batch them."""
    grads = _batched_grads(seeds, _grad_inputs(zs))
    if grads is None:
        return False
    for j, buf in enumerate(out):
        if buf is None:
            for i in range(len(seeds)):
                sums[j].add(i, None if grads[j] is None else grads[j][i])
        elif grads[j] is None:
            buf.zero_()
        else:
            buf.copy_(grads[j].transpose(0, 1))
        grads[j] = None  # one site's gradients at a time besides the result
    return True


def _buffer(scratch, j: int, shape, like: torch.Tensor) -> torch.Tensor:
    """Buffer ``j`` of ``scratch`` as a tensor of ``shape`` (grown when too small), or a
    new one without ``scratch``."""
    if scratch is None:
        return like.new_empty(shape)
    numel = math.prod(shape)
    while len(scratch) <= j:
        scratch.append(like.new_empty(0))
    buf = scratch[j]
    if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = scratch[j] = like.new_empty(numel)
    return buf[:numel].view(shape)


def _own_memory(deltas: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backprops, each in memory of its own.

    Autograd hands one tensor to both inputs of an addition (a residual ``h + f(h)``, a
    position embedding added to the tokens) and a view of it to the inputs of a
    ``torch.cat``: with one output, two sites' deltas can share memory, and a block
    scaled by ``sqrt(D)`` in place (:func:`._gram._scale`) would scale it twice.
    """
    seen: set[int] = set()
    out = []
    for d in deltas:
        if d is None:
            out.append(d)
            continue
        ptr = d.untyped_storage().data_ptr()
        if ptr in seen:
            d = d.clone()
        else:
            seen.add(ptr)
        out.append(d)
    return out


def _batch_check_bytes(cap: Capture, wrt: Sequence[torch.Tensor], n_out: int) -> int:
    """Bytes of :func:`_numerical_misfits`' batched pass over ``n_out`` outputs: every
    output's gradient of every input, and its own copy of the backward's intermediates
    (at most the rows' graph, ``cap.graph_bytes``)."""
    return n_out * (sum(t.numel() * t.element_size() for t in wrt) + cap.graph_bytes)


#: Distinct samples the autograd check takes (:func:`check_rows`).
CHECK_SAMPLES = 3
#: Copies of its rows that the check holds at once: the rows, the forward pass's copy,
#: the check's own and their gradient.
_CHECK_COPIES = 4
#: torch's refusal of a batch out of its order (``pack_padded_sequence`` and
#: ``pack_sequence`` with ``enforce_sorted=True``; torch 2.13: "`lengths` array must be
#: sorted in decreasing order when `enforce_sorted` is True. You can pass ...").
_UNSORTED_REFUSAL = ("must be sorted in decreasing order", "enforce_sorted")


def check_samples(n: int, k: int = CHECK_SAMPLES) -> list[int]:
    """The ``min(k, n)`` samples of ``n`` that the check takes: the first ``k - 1`` and
    the last (``0, 1, n - 1`` for three; the first alone for one). A tie of the checked
    samples on a sort's key hides the sort (:func:`check_rows`): a batch ordered or
    grouped by the key (sequences bucketed by length) ties on its first three far more
    often than on its first and last, and one interleaving the key's values (``1, 2, 3,
    1, 2, 3, 1``) on its first, middle and last, not on adjacent samples (session s55,
    ``benchmarks/results/reorder_check-s55.md``)."""
    if k >= n:
        return list(range(n))
    return [0] if k == 1 else [*range(k - 1), n - 1]


#: Rows from the end of ``X`` that :func:`_picks` compares with the rows checked before.
_LAST_TRIES = 4


def _picks(X: torch.Tensor, k: int = CHECK_SAMPLES,
           before: torch.Tensor | None = None) -> list[int]:
    """:func:`check_samples` of ``X`` (``k`` of them), its last sample the last of the
    ``_LAST_TRIES`` rows from the end that is unlike every row checked before it: ``X``'s
    first ``k - 1`` and the rows of ``before`` (a one-query cross check's query, checked
    ahead of ``Y``'s rows). A copy of one of those ties with it on every key: where
    ``X``'s last row repeats its first (a batch padded to a size by wrapping around, a
    closed curve sampled end to end), ``x0, x1, xl`` held two samples, and a sort by a key
    tying on ``x0, x1`` went unseen (tangent features 64-68% off; session s55's review),
    which ``x2`` of the first three saw; so did ``x, y0, yl`` where ``yl`` repeats ``y0``
    or is the query itself (a query from the training set; ``K(x, Y)`` 54-56% off, which
    ``y1`` of ``Y``'s first two saw)."""
    n = X.shape[0]
    picks = check_samples(n, k)
    if k < 2 or n <= k:
        return picks
    firsts = [X[j] for j in picks[:-1]] + ([] if before is None else list(before))
    for i in range(n - 1, max(n - 1 - _LAST_TRIES, k - 2), -1):
        if not any(torch.equal(X[i], row) for row in firsts):
            return [*picks[:-1], i]
    return picks


def check_rows(X: torch.Tensor, memory_budget: int) -> Sequence[torch.Tensor]:
    """The groups of rows :func:`_numerical_misfits` checks, each with a capture of its
    own: a cycle of the ``CHECK_SAMPLES`` samples of :func:`_picks` (the first two and
    the last of ``X``, or a row just before it unlike the first two) and the first again (``x0,
    x1, xl, x0``; ``x0, x1, x0`` for two; longer, ``x0, x1, xl, x0, x1``, where X has an
    axis of that length), or, where its copies of the rows do not fit an eighth of
    ``memory_budget`` (wide inputs: the probe of two rows was already the peak of a call
    with a small budget), the cycle's pairs (:class:`_CyclePairs`) one at a time (the
    probe's memory of two rows; three captures and checks). One sample is taken alone.

    The check weights each group's rows 1, 2, ... (see there), so it sees a forward pass
    that reorders the rows before a rule layer wherever the reordering moves a row of a
    group. A closed cycle is in no monotone order unless its keys tie: a sort of the
    batch by the data (by length before a packed RNN, by a score before a Linear),
    ascending or descending, moves a row of the cycle (or swaps a pair) unless the three
    samples tie on its key; two identical rows swapped give the same factors, so the
    cycle's repeated row is never a false alarm.
    """
    picks = _picks(X)
    k = len(picks)
    if k < 2:
        return [X[:1]]
    # The cycle's length differs from every other axis of X (``x0, x1, xl, x0, x1`` where
    # a sequence has 4 steps): the capture tells a layer's rows from the samples by their
    # count, and a time-major transpose of X puts the steps first.
    length = k + 1
    while length in X.shape[1:]:
        length += 1
    if _copies_fit(X, length, memory_budget):
        return [X[[picks[i % k] for i in range(length)]]]
    return _CyclePairs(X, picks)


def _copies_fit(X: torch.Tensor, rows: int, memory_budget: int) -> bool:
    """Whether the check's copies of ``rows`` rows like ``X``'s (:data:`_CHECK_COPIES`)
    fit an eighth of ``memory_budget``, as its groups of rows must (:func:`check_rows`,
    ``._gram._own_check_rows``)."""
    return _CHECK_COPIES * rows * X[0].numel() * X.element_size() <= memory_budget // 8


class _CyclePairs(Sequence):
    """The pairs of the cycle of ``X``'s rows ``picks`` (ascending): ``(x0, x1), (x1, xl),
    (xl, x0)``, all in a sort's order only where its keys tie. Each pair is made when
    read, so that the check holds two of its rows at a time (:func:`_checked` reads them
    in turn): a view of ``X`` where the two rows are adjacent, else a copy of the two (a
    network may flatten its batch, ``x.view(-1, d)``, which a strided view refuses)."""

    def __init__(self, X: torch.Tensor, picks: list[int]):
        self.X, self.picks = X, picks

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, i: int) -> torch.Tensor:
        i = range(len(self))[i]
        a, b = self.picks[i], self.picks[(i + 1) % len(self)]
        return self.X[a:b + 1] if b == a + 1 else self.X[[a, b]]


def checked_capture(module, params, X, outputs, *, memory_budget, batch_bytes=0,
                    in_order=None, **capture_kw):
    """The probe capture of the first group of :func:`check_rows` and the parameters that
    :func:`_numerical_misfits` sends to the fallback over every group: ``(rows, cap,
    misfits)``, ``cap`` the capture of ``rows`` (the other groups captured too, alike).

    ``in_order``: the groups of rows checked in their own order where ``X``'s raise
    (below), the first the probe; ``None`` takes ``[X[:2]]``. A cross check whose ``X``
    holds a query's rows and then ``Y``'s passes batches the Gram forms, the query's and
    ``Y``'s apart: ``x, y0`` is one it never forms (a network packing with
    ``enforce_sorted=True`` refused it where ``x`` was the shorter, and the call raised,
    sessions s54-s55).

    Where the check's rows raise, what a user would want decides the retry:

    - torch's refusal of a batch out of its order (``pack_padded_sequence`` with
      ``enforce_sorted=True`` raises on the cycle, which no sorted order holds): the check
      runs on the first two samples in ``X``'s order, silently, as before session s54. The
      network cannot reorder a batch it requires sorted, and an error of its own raises
      there again.
    - any other error (a network that refuses a sample twice in a batch, an out-of-memory
      error on the cycle's rows, a rule's error on them): the cycle's pairs, two distinct
      rows at a time, which see a sort as the cycle does; where they raise too, the first
      two samples in ``X``'s order, with a warning that names the cycle's error and says
      that a reordering of the batch before a layer then goes unseen. Re-raising would
      refuse a Gram that is right unless the network sorts its batch, which the check on
      ``X``'s order still verifies in every other respect (a hidden read); a silent retry
      hid the loss of the sort's detection and a genuine error alike.
    """
    def run(groups):
        return _checked(module, params, groups, outputs, memory_budget, batch_bytes,
                        capture_kw)

    retry = [X[:2]] if in_order is None else in_order
    groups = check_rows(X, memory_budget)
    try:
        return run(groups)
    except Exception as error:
        if in_order is None and X.shape[0] < 2:
            raise
        # The error's text only: its traceback holds the failed pass's tensors (an
        # out-of-memory error's among them) alive through the retry.
        refused = isinstance(error, RuntimeError) and all(
            s in str(error) for s in _UNSORTED_REFUSAL)
        why = f"{type(error).__name__}: {str(error).strip()[:300]}"
    cycle = len(groups) == 1
    del groups  # the cycle's rows, copied
    if refused:
        return run(retry)
    if cycle:
        try:
            return run(_CyclePairs(X, _picks(X)))
        except Exception:
            pass
    # The warning after the check: where x0, x1 raise too, the network's error alone.
    out = run(retry)
    warnings.warn(
        "The autograd check of the layers' rules raised on the rows it takes out of X's "
        f"order ({why}); it ran on samples in their own order instead (X's first two), where it "
        "cannot see a forward pass that reorders the batch (a sort by the data) before a "
        "layer: such a layer would keep its rule, and its part of the Gram be wrong.",
        UserWarning, stacklevel=caller_stacklevel())
    return out


def _checked(module, params, groups, outputs, memory_budget, batch_bytes, capture_kw):
    # The groups read in turn, each let go before the next is made (_CyclePairs).
    groups = iter(groups)
    first = next(groups)
    cap = capture(module, params, first, outputs, memory_budget=memory_budget,
                  **capture_kw)
    bad = _numerical_misfits(module, params, first, cap, outputs, batch_bytes)
    others = {k: v for k, v in capture_kw.items() if k not in ("exclude", "measure_graph")}
    for rows in groups:
        more = capture(module, params, rows, outputs, memory_budget=memory_budget,
                       exclude=cap.exclude, **others)
        bad |= _numerical_misfits(module, params, rows, more, outputs, batch_bytes)
        del rows, more
    return first, cap, bad


def _numerical_misfits(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    cap: Capture,
    outputs: Sequence[int],
    batch_bytes: int = 0,
) -> frozenset[str]:
    """Rule-covered parameters whose factors disagree with autograd on a few samples.

    ``batch_bytes``: the bytes that one batched backward pass over the outputs may take
    (:func:`_batch_check_bytes`); where it fits, the outputs' passes are that one pass on
    any device (on a few rows a pass per output is mostly the cost per operation: 0.61 of
    the check's CPU time on the trial's U-Net with 64 outputs, 0.69-1.06 with 10; session
    s53, ``benchmarks/results/gram_dense_route-s53.md``).

    The second line behind :class:`_UseWatch`, for what it cannot see: reads of a
    parameter hidden from torch functions (a TorchScript function or a C++ extension
    taking ``self.lin.weight`` in a parent's ``forward``), and rows reordered before a
    layer (``x.flip(0)``, ``x[x[:, 0].argsort()]`` undone after the layer) or mixed after
    it (``h + h.mean(0)``), which break the row-per-sample alignment of the factors (rows
    mixed before a layer and never unmixed are not seen there: the network is then not
    one of samples alone, which the engine assumes). One backward pass per
    output over the rows of ``x`` (a group of :func:`check_rows`, so that a sort shows;
    ``cap`` is their capture) catches these unless their gradient vanishes there; the
    parameters returned here must go to the fallback. It cannot see a reordering that
    leaves the checked rows in place: one that happens only in larger batches
    (``if len(x) > 8``), a sort whose key ties on the checked samples, or one that moves
    only rows past them; the layer then keeps its rule and its Gram is wrong.
    """
    covered = [name for term in cap.terms for name, _ in term.inputs
               if name not in cap.fallback]
    if not covered:
        return frozenset()
    factors = {name: (term, a) for term in cap.terms for name, a in term.inputs}
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    # Every parameter and a float input are differentiated too, so that every layer's
    # backward computes its input's gradient: asked for a GroupNorm's weight alone (behind
    # a fallback or frozen layer), torch 2.13's group_norm backward of a channels_last
    # input crashes the process (a segmentation fault).
    x_in = x.detach().requires_grad_(True) if x.is_floating_point() else x
    with torch.enable_grad():
        # A copy: a module writing into its input (x /= 255) may, not into a leaf.
        f = differentiable_forward(
            lambda: functional_call(module, live, (x_in * 1,))).reshape(x.shape[0], -1)
    dtype = value_dtype(params, x)
    # A weight's gradient g (rows x cols) is compared through a random direction v: g v
    # against the factors' G v (a sum over positions of delta (a . v)). A read the
    # factors miss adds E != 0 to g, and E v != 0 for almost every v: one pass over g
    # instead of forming the outer products and the difference.
    gen = torch.Generator(device=x.device).manual_seed(0)
    probes = {}
    for name, (term, a) in factors.items():
        if a is not None:
            cols = term.delta.shape[3] if term.transposed else a.shape[2] // term.groups
            probes[name] = torch.randn(cols, generator=gen, device=x.device, dtype=dtype)
    # The rows are weighted 1, 2, ... in one backward pass per output: a swap of rows
    # changes the weighted sum the factors predict, not the one autograd computes.
    w = torch.arange(1, x.shape[0] + 1, device=x.device, dtype=dtype)
    tol = 10 * torch.finfo(dtype).eps ** 0.5
    one = torch.ones((), dtype=dtype, device=x.device)
    # What the factors predict, every output's row at once (C, rows). The comparison is
    # vectorised and read back once: on a GPU each small op costs a launch, and this check
    # ran more ops than the Gram it guards (cnn8 at N = 128: 2262 of 3398).
    rules = [torch.einsum("n,ncr->cr", w, grad_times(*factors[name], probes.get(name, one)))
             for name in covered]
    seen = [[] for _ in covered]
    wrt = [live[n] for n in covered] + [p for n, p in live.items() if n not in set(covered)]
    wrt += [x_in] if x_in.requires_grad else []
    seeds = [f[:, c] @ w for c in outputs]
    fits = _batch_check_bytes(cap, wrt, len(seeds)) <= batch_bytes
    batched = (_batched_grads(seeds, wrt)
               if len(seeds) > 1 and (_batches_backprops(x.device) or fits) else None)
    if batched is not None:
        # (C, ...) per parameter: the outputs' sides at once.
        batched = [strided(g) for g in batched]
        seen = [torch.zeros_like(rule) if g is None
                else g.reshape(len(seeds), -1) if factors[name][1] is None
                else g.reshape(len(seeds), rule.shape[1], -1) @ probes[name]
                for name, g, rule in zip(covered, batched, rules)]
    else:
        for i, seed in enumerate(seeds):
            grads = torch.autograd.grad(seed, wrt, retain_graph=i < len(seeds) - 1,
                                        allow_unused=True)[:len(covered)]
            for rows, name, g, rule in zip(seen, covered, grads, rules):
                g = strided(g)
                if g is None:
                    rows.append(torch.zeros_like(rule[0]))
                else:
                    rows.append(g.reshape(-1) if factors[name][1] is None
                                else g.reshape(rule.shape[1], -1) @ probes[name])
        seen = [torch.stack(rows) for rows in seen]
    errors = torch.stack([(s - r).abs().amax(1) for s, r in zip(seen, rules)])
    # One scale per output: the largest entry of any parameter's two sides.
    scale = torch.stack([torch.maximum(s.abs().amax(1), r.abs().amax(1))
                         for s, r in zip(seen, rules)]).amax(0)
    misfit = (errors.double() > tol * scale.double().clamp_min(1e-30)).any(1)
    bad = {name for name, out in zip(covered, misfit.tolist()) if out}
    return frozenset(bad)
