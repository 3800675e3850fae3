"""Attention that second derivatives run through.

``nn.MultiheadAttention`` (and so every ``nn.TransformerEncoderLayer``) calls
``scaled_dot_product_attention``, whose fused kernels (flash attention on the CPU; flash,
memory-efficient and cuDNN attention on CUDA) have a backward without a derivative and no
forward-mode rule: a double backward (a Hessian-vector product) or a forward-over-reverse
product through them raises. Their composite reference, the math backend, is made of
differentiable operations, computes the same function, and is what the analyses that
differentiate twice (``attribute(method="unrolled")``, ``decompose(method="second_order")``,
``hessian_trace``) run under.

torch's backend flags are process-wide, so :func:`twice_differentiable_attention` counts
the calls inside it: concurrent calls on joblib's threads leave the flags switched until the
last of them ends (each restoring its own entry state would switch the fused kernels back
under another thread mid-product). Each process (a loky worker) enters it itself.
"""

from __future__ import annotations

import contextlib
import threading

from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["twice_differentiable_attention"]

_LOCK = threading.Lock()
_active: list = []  # the entered sdpa_kernel context, and the number of calls inside it


@contextlib.contextmanager
def twice_differentiable_attention():
    """Run a block with attention on its math backend (see the module docstring)."""
    with _LOCK:
        if not _active:
            context = sdpa_kernel(SDPBackend.MATH)
            context.__enter__()
            _active.extend([context, 0])
        _active[1] += 1
    try:
        yield
    finally:
        with _LOCK:
            _active[1] -= 1
            if not _active[1]:
                context = _active[0]
                _active.clear()
                context.__exit__(None, None, None)
