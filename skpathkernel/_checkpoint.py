"""Activation checkpointing run as plain calls in the engine's forward passes.

A network may checkpoint regions of its forward pass (``torch.utils.checkpoint.checkpoint``
with ``use_reentrant=False`` or ``True``, ``checkpoint_sequential``, HuggingFace's gradient
checkpointing): the region's saved tensors are dropped and the region is run again when
the backward pass needs them. The engine calls the module at the parameters of a recorded
point (``torch.func.functional_call``) and differentiates that graph after the call has
put the module's own parameters back, so the recomputation read the module's parameters,
not the call's: wrong values without an error at every other point of the path (the path
kernels, the decompositions, the attributions: 7.6e-5 to 4.4 relative on small regions,
benchmarks/results/checkpointing_matrix.md), and a ``CheckpointError`` where the call's
parameters differ from the module's in ``requires_grad`` (the generic fallback holds the
parameters it does not differentiate fixed, so the recomputation saved other tensors; a
BatchNorm in the region). A reentrant region also runs without a graph and refuses
``torch.autograd.grad``, and torch.func's transforms refuse the non-reentrant region's
saved-tensor hooks. Within the region, the checkpoint's own saved-tensor hooks also hid
its saved tensors from :class:`._tangent._saved.SavedWatch` (the in-place check, the
graph's bytes).

Checkpointing trades memory for a second forward of the region; the function is the
same. So within the engine's calls (:func:`functional_call`) every checkpointed region
runs as a plain call of its function: the graph, the values and the memory are those of
the network without checkpointing (what the memory budget's block sizes already
measure). Training (``module(X)`` and ``.backward()``) and a user's own loop keep their
checkpointing.

The switch replaces, for the duration of the calls, the names through which the
checkpoints dispatch, looked up at every call: ``torch.utils.checkpoint``'s
``CheckpointFunction`` and ``_checkpoint_without_reentrant_generator`` (so a ``checkpoint``
imported by name or bound in a ``functools.partial`` is covered), and the generator as
torch.distributed's composable ``checkpoint(module)`` imported it (where that module is
loaded: a network using it loaded it). Process-wide, so another thread's checkpointed
forward in that window runs plainly too (its values unchanged, its memory that of no
checkpointing).
"""

from __future__ import annotations

import sys
import threading

import torch.utils.checkpoint  # noqa: F401  (loaded: the switch's first site)
from torch.func import functional_call as _functional_call

from ._modules import _SwitchedOff

__all__ = ["functional_call", "plain_checkpoints", "plain_names"]

# (module, name) of every place a checkpoint's implementation is looked up at call time.
_NAMES = (("torch.utils.checkpoint", "CheckpointFunction"),
          ("torch.utils.checkpoint", "_checkpoint_without_reentrant_generator"),
          ("torch.distributed._composable.checkpoint_activation",
           "_checkpoint_without_reentrant_generator"))
_STATE: dict = {"holders": 0, "saved": None}


class _PlainFunction:
    """``CheckpointFunction`` (reentrant) as a plain call: ``checkpoint`` calls
    ``CheckpointFunction.apply(function, preserve_rng_state, *args)``."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        return function(*args)


def _plain_generator(*args, **kwargs):
    """``_checkpoint_without_reentrant_generator`` as a plain call: ``checkpoint`` runs
    the function between its two steps and expects it to stop after the second."""
    yield


_PLAIN = {"CheckpointFunction": _PlainFunction,
          "_checkpoint_without_reentrant_generator": _plain_generator}


def plain_names() -> tuple[tuple[str, str], ...]:
    """The ``(module, name)`` of ``_NAMES`` the switch replaces: those of the loaded
    modules that have the name."""
    return tuple((where, name) for where, name in _NAMES
                 if hasattr(sys.modules.get(where), name))


class plain_checkpoints(_SwitchedOff):
    """Run every checkpointed region (``torch.utils.checkpoint``'s, torch.distributed's
    composable ``checkpoint``) as a plain call of its function within the block
    (counted across threads: the names are put back when the last block ends)."""

    _lock, _state = threading.Lock(), _STATE

    @staticmethod
    def _get() -> dict:
        return {(where, name): getattr(sys.modules[where], name)
                for where, name in plain_names()}

    @staticmethod
    def _set(value) -> None:
        # False: the plain calls in, at the sites _get has just saved (_SwitchedOff saves
        # first); else the saved implementations back.
        for (where, name), impl in _STATE["saved"].items() if value is False \
                else value.items():
            setattr(sys.modules[where], name, _PLAIN[name] if value is False else impl)


def functional_call(module, parameter_and_buffer_dicts, args=None, kwargs=None, **options):
    """``torch.func.functional_call`` with its checkpointed regions run as plain calls
    (:func:`plain_checkpoints`), so that the graph it returns is differentiated at the
    parameters it was called with."""
    with plain_checkpoints():
        return _functional_call(module, parameter_and_buffer_dicts, args, kwargs, **options)
