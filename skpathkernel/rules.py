"""Per-layer gradient rules of the structured engine, and what falls back.

skpathkernel computes tangent features, tangent and path kernels, and the exact
decomposition from per-layer *rules*: for a layer whose weight ``W`` is applied at
positions ``s`` (one for a Linear on vectors, the patches of a convolution, the tokens of
a sequence), the per-sample gradient of output ``c`` is
``sum_s delta[c, s] (outer) a[s]``, where ``a`` is what the layer's own operation reads
and ``delta`` its backprop. The engine contracts these factors directly and never forms
the Jacobian where that is cheaper. Built-in rules cover ``nn.Linear`` (inputs of any
rank), ``nn.Conv1d`` / ``2d`` / ``3d``, ``nn.ConvTranspose1d`` / ``2d`` / ``3d``,
``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, ``nn.BatchNorm1d`` /
``nn.BatchNorm2d`` in eval mode,
``nn.MultiheadAttention`` (so ``nn.TransformerEncoderLayer`` with ``batch_first=True`` is
structured end to end; with torch's default ``batch_first=False`` its feed-forward layers
and norms read sequence-first ``(S, n, d)`` tensors, whose rows are not the samples, and
fall back), ``nn.PReLU`` and ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (packed sequences too, with
``enforce_sorted=False``; not ``proj_size`` or dropout in training mode), and their subclasses
that keep their ``forward``; a linear layer holding its weight as ``(in, out)`` (Hugging
Face's GPT-2 ``Conv1D``) takes :func:`transposed_linear_rule` once registered.
A raw ``nn.Parameter`` that no such layer holds is structured when the forward pass
reads it once in an elementwise ``x + P``, ``x * P`` or ``P.expand(...)`` broadcast over
the samples (class tokens, position embeddings, LayerScale gains), or reads a basic slice
of it that way (``x + self.pos[:, :L]``): its per-sample gradient is the backprop summed
over the broadcast axes (times ``x`` for a product), written into the sliced entries.
Any other layer with parameters uses an exact ``torch.func`` fallback, which forms
per-sample Jacobians: :func:`layer_routes` lists each layer's route, the estimators warn
(:class:`FallbackWarning`) when fallback layers hold a large share of the parameters (or
any, where ``torch.func`` cannot batch the network and the fallback loops over samples), and
:func:`register_rule` adds a rule for your own layer (see the user guide, "Custom
layers"; :func:`check_rule` checks it against plain autograd).
"""

from ._tangent import (
    FallbackWarning,
    LayerRoute,
    Rule,
    Term,
    Use,
    check_rule,
    get_rule,
    layer_routes,
    register_rule,
    transposed_linear_rule,
)

__all__ = [
    "FallbackWarning",
    "LayerRoute",
    "Rule",
    "Term",
    "Use",
    "check_rule",
    "get_rule",
    "layer_routes",
    "register_rule",
    "transposed_linear_rule",
]
