"""torch modules as the estimators and analyses copy them.

torch's older weight-normalisation hooks (``nn.utils.weight_norm``,
``nn.utils.spectral_norm``; the parametrizations that replace them have no such issue)
keep the weight they compute at each forward pass as a plain attribute, a tensor with an
autograd history, which ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the
user (graph leaves) support the deepcopy protocol"): a warm start, a partial_fit, a
float64 copy for the decomposition or a replay raised on such a network.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["copy_module", "module_lock", "norm_hooks", "running", "runs_module"]


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


# The modules each thread is running a verb on, with how many verbs deep: a verb that
# another calls (explain calls attribute, which calls decompose and outputs) is part of
# the outer one's call, and what the caller must hear of once per call is checked there.
_RUNNING = threading.local()


class running:
    """Hold :func:`module_lock` of ``module`` for a verb that runs it; ``check(module)``
    first when no other verb on ``module`` is running in this thread (the one the user
    called, whichever verbs it calls). A class, not a generator: a warning that ``check``
    points at the user's line must find no frame of ``contextlib`` on the way."""

    def __init__(self, module: torch.nn.Module, check=None):
        self.module, self.check = module, check

    def __enter__(self):
        self.lock = module_lock(self.module)
        self.lock.acquire()
        try:
            depth = _RUNNING.__dict__.setdefault("depth", {})
            key = self.key = id(self.module)  # alive while it is running
            if self.check is not None and key not in depth:
                self.check(self.module)
            depth[key] = depth.get(key, 0) + 1
        except BaseException:  # a warning turned into an error
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc):
        depth = _RUNNING.depth
        depth[self.key] -= 1
        if not depth[self.key]:
            del depth[self.key]
        self.lock.release()
        return False


def runs_module(module_of, check=None):
    """Decorate a method (or a function of a fitted estimator) that runs a fitted
    network's module: it holds :func:`module_lock` of ``module_of(first argument)`` (None,
    or an exception such as NotFittedError: no module yet, it runs as it is and raises its
    own error), with ``check`` as :func:`running` calls it."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            try:
                module = module_of(self)
            except Exception:
                module = None
            if module is None:
                return method(self, *args, **kwargs)
            with running(module, check):
                return method(self, *args, **kwargs)

        return wrapper

    return decorate
