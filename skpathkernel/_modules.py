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

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["copy_module", "norm_hooks"]


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
