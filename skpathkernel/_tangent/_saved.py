"""Forward passes whose saved tensors an in-place op rewrites afterwards.

``nn.ReLU(inplace=True)`` after ``nn.Tanh()`` (or ``nn.Sigmoid()``, ``nn.ELU()``: any
operation whose derivative reads its output, or an input another operation rewrites)
computes a well-defined function, but autograd refuses its backward pass ("modified by
an inplace operation"). The engine's forward passes whose graphs it differentiates (the
capture, the autograd check of a few samples, the fallback's loop) run under
:class:`SavedWatch`, and again with the saved tensors copy-on-write where one was
rewritten: the derivative of the function the network computes, as it would be with
every in-place operation out of place.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SavedWatch", "differentiable_forward", "tensors"]


def tensors(obj):
    """The tensors in ``obj`` (nested lists, tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors(item)


class SavedWatch:
    """Saved-tensor hooks for a forward pass whose graph is differentiated afterwards.

    A forward may write in place into a tensor that an earlier operation saved for its
    backward pass: ``nn.ReLU(inplace=True)`` after ``nn.Tanh()`` or ``nn.Sigmoid()``,
    whose derivatives read their outputs. The function is well defined (the plain-MLP
    route, :func:`._stacked.stacked_mlp`, gives each in-place activation a copy), but
    autograd refuses the backward pass, and under saved-tensor hooks (these) it does not
    check at all. Unguarded, this records every saved tensor with its version counter:
    :attr:`rewritten` says whether one moved by the end of the forward (autograd's own
    check). ``guard`` (for a second run of such a forward) holds each saved tensor
    copy-on-write instead: the first in-place write into its storage
    (:class:`_CopyOnWrite` sees every ATen op) copies it beforehand, so the backward
    reads the values the forward saved; only rewritten tensors are copied.
    ``graph`` (the capture's ``_GraphBytes``) counts the saved tensors and these copies.
    """

    def __init__(self, graph=None, guard: bool = False):
        self.graph, self.guard = graph, guard
        self.saved: list[tuple[torch.Tensor, int]] = []
        self.holders: dict[int, list[list[torch.Tensor]]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        # With ``graph``: every op's outputs, weakly, for :meth:`alive`.
        self.outputs: list[weakref.ref] | None = [] if graph is not None else None
        self._mode = (_CopyOnWrite(self) if guard or graph is not None
                      else contextlib.nullcontext())

    def _pack(self, t):
        if self.graph is not None:
            self.graph.add(t)
        # Detached (the same storage and version counter; autograd gives the unpacked
        # tensor its grad_fn back): an op's own output held as it is would keep its
        # grad_fn, which holds what this returns, a cycle through C++ that no garbage
        # collection frees, so a graph never differentiated to its end (the first run
        # of a forward run again, the layers below every differentiated output) leaked
        # (pytorch/pytorch#115255).
        t = t.detach()
        if not self.guard:
            self.saved.append((t, t._version))
            return t
        holder = [t]
        self.holders.setdefault(t.untyped_storage().data_ptr(), []).append(holder)
        return holder

    @staticmethod
    def _unpack(packed):
        return packed[0] if isinstance(packed, list) else packed

    def before_write(self, t: torch.Tensor) -> None:
        """Copy the saved tensors in ``t``'s storage before an op writes into it."""
        for holder in self.holders.pop(t.untyped_storage().data_ptr(), ()):
            holder[0] = holder[0].clone()
            if self.graph is not None:
                self.graph.add(holder[0])

    def alive(self) -> list[torch.Tensor]:
        """The tensors the forward's ops made that are still alive after it (``graph``
        only): besides the output, what something keeps beyond the saved tensors, such
        as a custom ``autograd.Function``'s ``ctx.x = t`` (outside
        ``save_for_backward``, which no hook sees) or a module caching an activation.
        The kept forward holds them too."""
        out = [t for ref in self.outputs or () if (t := ref()) is not None]
        self.outputs = []
        return out

    @property
    def rewritten(self) -> bool:
        """Whether an in-place op rewrote a saved tensor after it was saved (read once:
        the record is dropped)."""
        moved = any(t._version != version for t, version in self.saved)
        self.saved.clear()
        return moved

    def __enter__(self):
        self._hooks.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        # No write is watched past the forward: the graph alone holds the saved tensors
        # from here (freed with it, not with this watch).
        self.holders.clear()
        return self._hooks.__exit__(*exc)


class _CopyOnWrite(TorchDispatchMode):
    """Hands every tensor an ATen op is about to write into (its schema's written
    arguments: in-place and ``out=`` ops) to :meth:`SavedWatch.before_write`, and
    records the ops' outputs where the watch counts the graph."""

    def __init__(self, watch: SavedWatch):
        super().__init__()
        self.watch = watch

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this
        # says no, and that wrapper imports torch._dynamo at its first call: 1.5-2 s once
        # per process, for a mode that is never compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable and self.watch.holders:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in tensors(value):
                        self.watch.before_write(t)
        out = func(*args, **kwargs)
        if self.watch.outputs is not None:
            self.watch.outputs.extend(weakref.ref(t) for t in tensors(out))
        return out


def differentiable_forward(run):
    """``run()`` (a forward pass with grad enabled whose graph is differentiated
    afterwards), run again with saved tensors copy-on-write (:class:`SavedWatch`) where an
    in-place op rewrote one that the backward reads."""
    with SavedWatch() as watch:
        out = run()
    if not watch.rewritten:
        return out
    del out
    with SavedWatch(guard=True):
        return run()
