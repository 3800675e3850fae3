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
``CheckpointFunction`` and ``_checkpoint_without_reentrant_generator`` (from torch 2.14
also its ``_impl``, which ``checkpoint`` calls; so a ``checkpoint`` imported by name or
bound in a ``functools.partial`` is covered), and the generator as
torch.distributed's composable ``checkpoint(module)`` imported it (where that module is
loaded: a network using it loaded it). The names are the process's, but what they do
is the thread's: a region runs plainly in a thread within a block, and as torch's
checkpoint in every other thread (a user's training beside an analysis keeps its
checkpointing, its memory and its recomputations). A region's ``context_fn`` forward
context is entered, as training enters it. The names are private:
:func:`dispatch_problem` checks at import that ``checkpoint`` still goes through them and
warns otherwise.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings

import torch
from torch.func import functional_call as _functional_call
from torch.utils.checkpoint import noop_context_fn

from ._modules import _SwitchedOff

__all__ = ["dispatch_problem", "functional_call", "plain_checkpoints", "plain_names",
           "warn_if_not_dispatched"]

# (module, name) of every place a checkpoint's implementation is looked up at call time.
# torch 2.14 moved the non-reentrant generator's body to ``..._impl`` (its arguments
# ``(fn, args, kwargs, *, options)``), which ``checkpoint`` and the composable
# ``checkpoint`` call directly, the old name kept as a shim for outside callers: both are
# replaced where they exist, so one switch covers the torch versions either side.
_GENERATOR, _GENERATOR_IMPL = ("_checkpoint_without_reentrant_generator",
                               "_checkpoint_without_reentrant_generator_impl")
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
_NAMES = (("torch.utils.checkpoint", "CheckpointFunction"),
          ("torch.utils.checkpoint", _GENERATOR),
          ("torch.utils.checkpoint", _GENERATOR_IMPL),
          (_COMPOSABLE, _GENERATOR),
          (_COMPOSABLE, _GENERATOR_IMPL))
_STATE: dict = {"holders": 0, "saved": None}
# The blocks this thread is in. The names are the process's, the plain calls this
# thread's: another thread's checkpoints (a user's training) stay torch's while they are
# installed. Process-wide plain calls had another thread's nested region, whose backward
# pass recomputed it in that window, run its inner checkpoint plainly: the outer
# recomputation then matched the wrong saved tensors (gradients off by 1.7, or a
# CheckpointError; tests/test_checkpointing.py). And a module imported within a block
# keeps the dispatcher it took, which reaches torch's own outside the blocks: torch's
# first checkpoint call imports torch._dynamo, which loads the composable checkpoint,
# and that had kept the plain generator for good (no checkpointing for FSDP2 after it).
_LOCAL = threading.local()


def _inside() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


class _PlainFunction:
    """``CheckpointFunction`` (reentrant) as installed: ``checkpoint`` calls
    ``CheckpointFunction.apply(function, preserve_rng_state, *args)``; within a block of
    this thread a plain call, else torch's (``original``)."""

    def __init__(self, original):
        self.original = original

    def apply(self, function, preserve_rng_state, *args):
        if _inside():
            return function(*args)
        return self.original.apply(function, preserve_rng_state, *args)

    def __getattr__(self, name):
        return getattr(self.original, name)


def _plain_steps(fn, preserve_rng_state=True, context_fn=noop_context_fn, *args, **kwargs):
    """``_checkpoint_without_reentrant_generator``'s two steps, less the checkpoint:
    ``checkpoint`` runs the function between them, here under ``context_fn``'s forward
    context (selective checkpointing's policy, or a context that changes values: the
    trained function ran under it). Also without gradients, where torch leaves it out:
    the engine's no-grad forward passes (predictions, the decompositions' values) compute
    the function that was trained and differentiated."""
    forward_context, _ = context_fn()
    with forward_context:
        yield


def _plain_steps_impl(fn, args, kwargs, *, context_fn=noop_context_fn, **options):
    """:func:`_plain_steps` for torch 2.14's ``_checkpoint_without_reentrant_generator_impl``,
    whose function's arguments come as a tuple and a dict before the options."""
    return _plain_steps(fn, context_fn=context_fn)


def _plain_generator(original, plain=_plain_steps):
    """A non-reentrant generator as installed: within a block of this thread ``plain``,
    else torch's (``original``)."""

    def generator(*args, **kwargs):
        return (plain if _inside() else original)(*args, **kwargs)

    return generator


_PLAIN = {"CheckpointFunction": _PlainFunction, _GENERATOR: _plain_generator,
          _GENERATOR_IMPL: lambda original: _plain_generator(original, _plain_steps_impl)}


def plain_names() -> tuple[tuple[str, str], ...]:
    """The ``(module, name)`` of ``_NAMES`` the switch replaces: those of the loaded
    modules that have the name."""
    return tuple((where, name) for where, name in _NAMES
                 if hasattr(sys.modules.get(where), name))


class plain_checkpoints(_SwitchedOff):
    """Run every checkpointed region (``torch.utils.checkpoint``'s, torch.distributed's
    composable ``checkpoint``) that this thread meets within the block as a plain call of
    its function. The names are replaced process-wide while any thread is in a block
    (counted across threads: put back when the last block ends); other threads'
    checkpoints go through them to torch's own."""

    _lock, _state = threading.Lock(), _STATE

    @staticmethod
    def _get() -> dict:
        return {(where, name): getattr(sys.modules[where], name)
                for where, name in plain_names()}

    @staticmethod
    def _set(value) -> None:
        # False: the dispatchers in, wrapping the implementations _get has just saved
        # (_SwitchedOff saves first); else the saved implementations back.
        for (where, name), impl in _STATE["saved"].items() if value is False \
                else value.items():
            setattr(sys.modules[where], name, _PLAIN[name](impl) if value is False else impl)

    def __enter__(self):
        super().__enter__()
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _LOCAL.depth -= 1
        return super().__exit__(*exc)


def functional_call(module, parameter_and_buffer_dicts, args=None, kwargs=None, **options):
    """``torch.func.functional_call`` with its checkpointed regions run as plain calls
    (:func:`plain_checkpoints`), so that the graph it returns is differentiated at the
    parameters it was called with."""
    with plain_checkpoints():
        return _functional_call(module, parameter_and_buffer_dicts, args, kwargs, **options)


def _keeping(saved: list):
    """A saved-tensor pack hook that keeps what it is given in ``saved``."""

    def pack(t):
        saved.append(t)
        return t

    return pack


def _same(t):
    return t


def dispatch_problem() -> str | None:
    """None where ``torch.utils.checkpoint.checkpoint`` (reentrant and not) runs its
    function as a plain call within :func:`plain_checkpoints`, and
    ``checkpoint_sequential`` goes through it; else a sentence naming the variants that
    do not.

    The switch replaces private names of torch: a torch that renamed or bypassed them
    would leave every checkpointed region to recompute at the module's own parameters
    again (wrong values without an error). Probed with ``exp`` on a tensor of two zeros:
    a plain region saves ``exp``'s output under the caller's saved-tensor hooks (torch's
    non-reentrant checkpoint hides it under its own) and its output has ``exp``'s
    backward (torch's reentrant one: ``CheckpointFunctionBackward``).
    """
    ck = sys.modules["torch.utils.checkpoint"]
    # Under torch's dynamo-disabling wrapper, whose first call imports torch._dynamo (a
    # second at import, and it loads torch.distributed's composable checkpoint).
    checkpoint = inspect.unwrap(ck.checkpoint)
    x = torch.zeros(2, requires_grad=True)
    plain_backward, exp_x = type(torch.exp(x).grad_fn), torch.ones(2)
    missed = []
    for reentrant in (False, True):
        saved: list = []
        with (torch.enable_grad(), plain_checkpoints(),
              torch.autograd.graph.saved_tensors_hooks(_keeping(saved), _same)):
            out = checkpoint(torch.exp, x, use_reentrant=reentrant)
        # exp saves its output, exp(0) = 1 (torch's checkpoints save their input, 0, under
        # the caller's hooks).
        if type(out.grad_fn) is not plain_backward or not any(torch.equal(t, exp_x)
                                                              for t in saved):
            missed.append(f"checkpoint(use_reentrant={reentrant})")
    sequential = inspect.unwrap(ck.checkpoint_sequential)
    if "checkpoint" not in sequential.__code__.co_names or sequential.__globals__ is not vars(ck):
        missed.append("checkpoint_sequential")
    if not missed:
        return None
    return (f"torch {torch.__version__}'s activation checkpointing no longer goes through "
            "the names skpathkernel replaces (torch.utils.checkpoint's CheckpointFunction, "
            f"{_GENERATOR} and {_GENERATOR_IMPL}) for " + ", ".join(missed) + ": a "
            "network with checkpointed regions gets wrong kernels, features, decompositions "
            "and attributions at the recorded points (or an error); turn its checkpointing "
            "off before analysing it.")


def warn_if_not_dispatched() -> None:
    """Warn (``RuntimeWarning``) where :func:`dispatch_problem` finds one: at import, once."""
    problem = dispatch_problem()
    if problem is not None:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)


warn_if_not_dispatched()
