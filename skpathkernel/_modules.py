"""torch modules as the estimators and analyses copy them.

torch's older weight-normalisation hooks (``nn.utils.weight_norm``,
``nn.utils.spectral_norm``; the parametrizations that replace them have no such issue)
keep the weight they compute at each forward pass as a plain attribute, a tensor with an
autograd history, which ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the
user (graph leaves) support the deepcopy protocol"): a warm start, a partial_fit, a
float64 copy for the decomposition or a replay raised on such a network.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import weakref

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ._device import differentiable

__all__ = ["copy_module", "cudnn_disabled", "cudnn_held", "fastpath_disabled",
           "fastpath_held", "has_fastpath", "module_lock", "norm_hooks", "recurrent_on_cuda",
           "running", "runs_module", "without_fastpath"]


def norm_hooks(layer: torch.nn.Module) -> list:
    """The weight- and spectral-normalisation hooks of ``layer`` (torch's older API)."""
    return [hook for hook in layer._forward_pre_hooks.values()
            if isinstance(hook, (WeightNorm, SpectralNorm))]


def copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)``, also of a module with a normalisation hook: the copy holds
    the weight it computed detached (the same values; the hook computes it again from the
    parameters at the next forward pass). Through deepcopy's memo, not on ``module``: the
    caller's module (``check_rule``'s, a ``RecordedNetwork``'s) keeps its weight's graph."""
    memo: dict = {}
    for layer in module.modules():
        for hook in norm_hooks(layer):
            weight = getattr(layer, hook.name, None)
            if isinstance(weight, torch.Tensor) and weight.grad_fn is not None:
                memo[id(weight)] = weight.detach().clone()
    return copy.deepcopy(module, memo)


# One lock per module. The computations on a fitted network run its module under
# torch.func.functional_call, which swaps the module's parameters for the call's, and the
# tangent engine hooks it: two of them on one network from different threads (a threaded
# server, pairwise_kernels(n_jobs=4), joblib's threading backend) see each other's
# parameters and captures, and raised "One of the differentiated Tensors does not require
# grad" or returned tangent features off by 70% of their scale, predictions by 0.9,
# without a word. They take turns instead; a verb's own n_jobs runs its tasks on copies of
# the module. Reentrant: a verb calls others (explain calls attribute).
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def module_lock(module: torch.nn.Module) -> threading.RLock:
    """The lock that every computation running ``module`` holds."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.RLock()
    return lock


class _SwitchedOff:
    """Run a block with one of torch's process-wide switches off, counted across the
    process's threads: restored to its value before the first of overlapping blocks when
    the last ends, also on an exception. The switch is the process's, not a thread's: the
    first verb to need it off saves and clears it, the last to end puts back what it
    saved, so that overlapping verbs on threads (n_jobs threads, a threaded server)
    neither turn it on under each other nor leave it off. Other work of the process runs
    with it off meanwhile (slower, not wrong; but a no-grad nn.TransformerEncoder forward
    outside every block, under a padding mask, that sees the attention switch turned off
    halfway raises torch's NestedTensor AssertionError: the package's own forwards, its
    input checks' included, run inside the block)."""

    _lock: threading.Lock
    _state: dict

    @staticmethod
    def _get() -> bool:
        raise NotImplementedError

    @staticmethod
    def _set(value: bool) -> None:
        raise NotImplementedError

    def __enter__(self):
        with self._lock:
            if not self._state["holders"]:
                self._state["saved"] = self._get()
                self._set(False)
            self._state["holders"] += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._state["holders"] -= 1
            if not self._state["holders"]:
                self._set(self._state["saved"])
                self._state["saved"] = None
        return False


# torch's cuDNN recurrent kernels (nn.LSTM, nn.GRU, nn.RNN on CUDA) have no backward in
# eval mode ("cudnn RNN backward can only be called in training mode"), no double
# backward and no vmap rule (aten::_cudnn_rnn): every analysis of a fitted recurrent
# network on a GPU (eval mode, gradients per sample, second derivatives) raised. Without
# cuDNN torch runs them as matrix products and fused cells, whose backward with
# create_graph is made of differentiable operations.
_CUDNN: dict = {"holders": 0, "saved": None}


class cudnn_disabled(_SwitchedOff):
    """Run a block with cuDNN off (``torch.backends.cudnn.enabled``)."""

    _lock, _state = threading.Lock(), _CUDNN

    @staticmethod
    def _get() -> bool:
        return torch.backends.cudnn.enabled

    @staticmethod
    def _set(value: bool) -> None:
        torch.backends.cudnn.enabled = value


# The attention layers that take torch's inference fast path in eval mode when no input
# requires grad (no_grad, a forward at parameters that do not require grad, forward-mode
# AD): nn.TransformerEncoder then packs the sequences under src_key_padding_mask into a
# nested tensor and returns zeros at the padded positions, which the differentiable path
# computes like any other. Every gradient (training, tangent features, kernels) reads the
# differentiable path; predictions and the decomposition's values read the fast one: a
# float64 network pooling over all positions (tests/test_attention_fastpath.py) predicted
# 0.64 off its trained function, and its exact decomposition missed by 1.65 (vmap over
# forward-mode AD, the second-order decomposition, raised on the nested tensor). With
# the fast path off, every forward of a verb computes the function that was trained and
# differentiated.
_FASTPATH_LAYERS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoder,
                    torch.nn.TransformerEncoderLayer)
_FASTPATH: dict = {"holders": 0, "saved": None}


class fastpath_disabled(_SwitchedOff):
    """Run a block with torch's attention fast path off
    (``torch.backends.mha.set_fastpath_enabled``)."""

    _lock, _state = threading.Lock(), _FASTPATH

    @staticmethod
    def _get() -> bool:
        return torch.backends.mha.get_fastpath_enabled()

    @staticmethod
    def _set(value: bool) -> None:
        torch.backends.mha.set_fastpath_enabled(value)


def has_fastpath(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a layer with torch's attention fast path."""
    return any(isinstance(layer, _FASTPATH_LAYERS) for layer in module.modules())


def without_fastpath(module: torch.nn.Module):
    """:class:`fastpath_disabled` where ``module`` holds an attention layer, else a block
    as it is: for a fit, whose gradients read the differentiable path, and whose losses
    without a graph (the divergence guard's, early stopping's scores) must read it too."""
    return fastpath_disabled() if has_fastpath(module) else contextlib.nullcontext()


class eager_calls:
    """Run a block with the modules of ``module`` that ``nn.Module.compile()`` compiled in
    place called eagerly (their ``_compiled_call_impl`` set aside, restored after).

    The analyses trace the module's forward themselves (the use watch, ``torch.func``):
    a compiled call hid the layers' calls from the watch on its first runs, so every
    layer went to the fallback with a wrong reason, and dynamo recompiled the module for
    every grad mode and shape until its limit. A ``torch.compile(module)`` wrapper is
    unwrapped where the path is recorded (the same eager forward)."""

    def __init__(self, module: torch.nn.Module):
        self.compiled = [(layer, layer._compiled_call_impl) for layer in module.modules()
                         if getattr(layer, "_compiled_call_impl", None) is not None]

    def __enter__(self):
        for layer, _ in self.compiled:
            layer._compiled_call_impl = None
        return self

    def __exit__(self, *exc):
        for layer, call in self.compiled:
            layer._compiled_call_impl = call
        return False


def fastpath_held() -> bool:
    """Whether a :class:`fastpath_disabled` block is running in this process (see
    :func:`cudnn_held`)."""
    return _FASTPATH["holders"] > 0


def cudnn_held() -> bool:
    """Whether a :class:`cudnn_disabled` block is running in this process: a task that
    this thread hands to another process (joblib's loky, a Dask worker) then runs in
    one too."""
    return _CUDNN["holders"] > 0


def _cuda_in_use() -> bool:
    # No tensor is on CUDA before torch initialised it: one call on a CPU-only machine.
    return torch.cuda.is_initialized()


def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def recurrent_on_cuda(module: torch.nn.Module, *, eval_only: bool = False,
                      cells: bool = False) -> bool:
    """Whether ``module`` holds an ``nn.RNNBase`` (LSTM, GRU, RNN: the layers cuDNN runs;
    torch's cells never use it) with its parameters on CUDA; ``eval_only``: one in eval
    mode (whose cuDNN kernel has no backward at all); ``cells``: or a cell (LSTMCell,
    GRUCell, RNNCell). Without building names, as
    :func:`~._path._training.warn_drawing_now`'s scan, and without a scan when nothing is
    on CUDA."""
    if not _cuda_in_use():
        return False
    kinds = (torch.nn.RNNBase, torch.nn.RNNCellBase) if cells else torch.nn.RNNBase
    stack = [module]
    while stack:
        layer = stack.pop()
        if layer is None:  # a child registered as None
            continue
        if isinstance(layer, kinds) and not (eval_only and layer.training):
            # Its own parameters, and those of its parametrizations (a parametrized
            # weight lives in layer.parametrizations: one with every weight parametrized
            # holds none of its own).
            if any(_on_cuda(p) for p in layer.parameters()):
                return True
        stack.extend(layer._modules.values())
    return False


# The modules each thread is running a verb on, with how many verbs deep: a verb that
# another calls (explain calls attribute, which calls decompose and outputs) is part of
# the outer one's call, and what the caller must hear of once per call is checked there.
_RUNNING = threading.local()


class running:
    """Hold :func:`module_lock` of ``module`` for a verb that runs it; ``check(module)``
    first when no other verb on ``module`` is running in this thread (the one the user
    called, whichever verbs it calls), which also turns cuDNN off for the call when
    ``module`` is recurrent on CUDA (:func:`recurrent_on_cuda`), and torch's attention
    fast path when it holds an attention layer (:func:`has_fastpath`), and runs the call
    with autograd on, out of the caller's ``no_grad`` or ``inference_mode``
    (:class:`~skpathkernel._device.differentiable`). A class, not a
    generator: a warning that ``check`` points at the user's line must find no frame of
    ``contextlib`` on the way."""

    def __init__(self, module: torch.nn.Module, check=None):
        self.module, self.check = module, check

    def __enter__(self):
        self.lock = module_lock(self.module)
        self.lock.acquire()
        self.switches = []
        try:
            depth = _RUNNING.__dict__.setdefault("depth", {})
            key = self.key = id(self.module)  # alive while it is running
            outermost = key not in depth
            if outermost:
                # The user's torch.no_grad() or inference_mode() around the verb: the
                # analyses differentiate the network (verbs the outer one calls run in
                # whatever mode it set).
                self.switches.append(differentiable().__enter__())
            if self.check is not None and outermost:
                self.check(self.module)
            if outermost and recurrent_on_cuda(self.module):
                self.switches.append(cudnn_disabled().__enter__())
            if outermost and has_fastpath(self.module):
                self.switches.append(fastpath_disabled().__enter__())
            if outermost:
                self.switches.append(eager_calls(self.module).__enter__())
            depth[key] = depth.get(key, 0) + 1
        except BaseException:  # a warning turned into an error
            self._release()
            raise
        return self

    def __exit__(self, *exc):
        depth = _RUNNING.depth
        depth[self.key] -= 1
        if not depth[self.key]:
            del depth[self.key]
        self._release(*exc)
        return False

    def _release(self, *exc):
        try:
            for switch in reversed(self.switches):  # the last entered, the first left
                switch.__exit__(*exc)
        finally:
            self.lock.release()


def runs_module(module_of, check=None):
    """Decorate a method (or a function of a fitted estimator) that runs a fitted
    network's module: it holds :func:`module_lock` of ``module_of(first argument)`` (None,
    or an exception such as NotFittedError: no module yet, it runs as it is and raises its
    own error), with ``check`` as :func:`running` calls it."""

    def decorate(method):
        # The first argument by its name too: a public function (rules.layer_routes,
        # check_rule) may be called with module=...
        first = next(iter(inspect.signature(method).parameters))

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            try:
                module = module_of(args[0] if args else kwargs[first])
            except Exception:
                module = None
            if module is None:
                return method(*args, **kwargs)
            with running(module, check):
                return method(*args, **kwargs)

        return wrapper

    return decorate
