"""Layers that second derivatives run through correctly.

The analyses that differentiate twice (``attribute(method="unrolled")`` and
``self_influence``: a double backward per step; ``decompose(method="second_order")``: a
forward-over-reverse product; ``hessian_trace``: Hessian-vector products) meet two fused
torch kernels whose second derivatives are missing or wrong (torch 2.13):

- ``scaled_dot_product_attention``, which ``nn.MultiheadAttention`` (and so every
  ``nn.TransformerEncoderLayer``) calls: its fused kernels (flash attention on the CPU;
  flash, memory-efficient and cuDNN attention on CUDA) have a backward without a derivative
  and no forward-mode rule, so the analyses raised. Its math backend, made of
  differentiable operations, computes the same function.
- ``torch._weight_norm`` (``nn.utils.parametrizations.weight_norm`` and the older
  ``nn.utils.weight_norm``): its double backward returns a wrong ``v``-``v`` block of the
  Hessian (off by the size of the block itself against finite differences of the
  gradient), which made unrolled scores miss the training's derivative by 9e-3 without a
  word (``benchmarks/results/layers_audit.md``), and it has no forward-mode rule. The composition
  ``v * (g / norm_except_dim(v, 2, dim))``, its definition, computes the same function
  (to round-off: 1e-15 relative in float64, up to 7e-7 in float32) with correct
  derivatives of every order.

:func:`twice_differentiable` swaps both for the duration of a call. torch's attention
flags and the weight-norm function are process-wide, so the swap is counted: concurrent
calls on joblib's threads keep it until the last of them ends (each restoring its own
entry state would switch the fused kernels back under another thread mid-product). Each
process (a loky worker) enters it itself. Other threads of the process meanwhile compute
attention and weight norm through the same composite operations: the same functions to
round-off (a float32 fit of a weight-normed network on another thread can differ from one
run alone by about 1e-7), with the math backend's memory on long CUDA sequences, and a
user's ``sdpa_kernel`` context entered on another thread during the call and left after it
restores the flags it found (those of this swap), as torch's save-and-restore design does.
A weight-norm function bound by the user's own ``from torch import _weight_norm`` or a
TorchScript module is not swapped.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._validation import once_differentiable

__all__ = ["FORWARD_AD", "check_twice_differentiable", "twice_differentiable"]

# The module, not the function of the same name that torch.nn.utils re-exports: its
# WeightNorm hook calls the _weight_norm it imported.
_HOOK_MODULE = importlib.import_module("torch.nn.utils.weight_norm")
_LOCK = threading.Lock()


class _ForwardAD:
    """The lock every forward-mode product of the analyses holds.

    Forward-mode AD's dual levels are the process's, not a thread's: concurrent jvps on
    joblib's threads entered and left each other's level (wrong tangents, or torch's
    "invalid forward AD level" error). Its first holder also loads torch's forward-mode
    decompositions, whose import scripts them with the deprecated ``torch.jit.script``:
    at a process's first jvp, that DeprecationWarning raised under a user's
    ``-W error`` (or pytest's ``filterwarnings = error``). Loaded here, with the warning
    silenced, not at ``import skpathkernel``, which it would slow by about 0.7 s. The
    silencing is ``warnings.catch_warnings``, process-wide for the import's 0.7 s: a
    ``catch_warnings`` block of another thread entered and left in that window can keep
    or drop the filter after it (Python's warning filters are not thread-safe).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._loaded = False

    def __enter__(self):
        self._lock.acquire()
        try:
            if not self._loaded:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    importlib.import_module("torch._decomp.decompositions_for_jvp")
                self._loaded = True
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc_info):
        self._lock.release()


FORWARD_AD = _ForwardAD()
_state: dict = {}  # while swapped: the calls inside, the attention context, the fused op


def _composite_weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch._weight_norm``'s definition (``dim=-1``: the norm of the whole tensor)."""
    return v * (g / torch.norm_except_dim(v, 2, dim))


@contextlib.contextmanager
def twice_differentiable():
    """Run a block with attention on its math backend and weight norm composed of
    differentiable operations (see the module docstring)."""
    with _LOCK:
        if not _state:
            attention = sdpa_kernel(SDPBackend.MATH)
            attention.__enter__()
            _state.update(calls=0, attention=attention,
                          fused=(torch._weight_norm, _HOOK_MODULE._weight_norm))
            torch._weight_norm = _HOOK_MODULE._weight_norm = _composite_weight_norm
        _state["calls"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _state["calls"] -= 1
            if not _state["calls"]:
                torch._weight_norm, _HOOK_MODULE._weight_norm = _state["fused"]
                _state.pop("attention").__exit__(None, None, None)
                _state.clear()


def check_twice_differentiable(gradient: torch.Tensor) -> None:
    """Refuse a gradient whose graph goes through a backward that cannot be differentiated.

    A custom ``autograd.Function`` whose backward is ``@once_differentiable`` leaves an
    ``Error`` node in the graph of a gradient taken with ``create_graph=True``; torch then
    differentiates around that layer, so a Hessian-vector product through ``gradient``
    misses the layer's part without a word (unrolled scores 0.83 off finite differences on
    a review's network). The node is there only when the gradient's seed requires grad.
    One walk of the graph.
    """
    if once_differentiable(gradient):
        raise ValueError(
            "The network's backward cannot be differentiated: a custom "
            "torch.autograd.Function in it has a backward marked @once_differentiable, "
            "so the second derivatives these scores are made of (Hessian-vector products "
            "of the training loss) would miss that layer's part. Write its backward with "
            "differentiable torch operations (save what it needs with "
            "ctx.save_for_backward), or use a method that needs first derivatives only "
            "(attribute(method='exact'), decompose(method='exact')).")
