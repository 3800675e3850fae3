"""Per-sample gradients of a network, as factors, and the kernels they define.

Private engine behind :mod:`skpathkernel.kernels`, the tangent-feature estimators and the
decomposition: torch in, torch out (no NumPy). Layers with a registered rule
(:mod:`._rules` states the contract, :mod:`._layers` holds the built-in rules: Linear,
Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding, LayerNorm, RMSNorm, GroupNorm, BatchNorm
in eval mode, MultiheadAttention, PReLU; LSTM, GRU and RNN in :mod:`._recurrent`)
contribute Kronecker factors with a position axis, contracted by the cheaper exact form
(:mod:`._contract`); raw parameters read once by an elementwise +, * or expand (of
them or of a basic slice of them) take the rules of :mod:`._parameters`; everything
else goes through a chunked ``torch.func`` fallback (:mod:`._generic`). The public face
of the rules is :mod:`skpathkernel.rules`.
"""

from ._capture import Capture, capture, forward
from ._contract import dense_grad, dense_rows
from ._generic import per_sample_jacobian
from ._gram import (
    contracted_features,
    hidden_reads,
    tangent_features,
    tangent_gram,
    tangent_gram_diag,
)
from ._layers import transposed_linear_rule
from ._pairs import Adjoint, directional, factor_shares, pair_terms
from ._projection import project_tangent_features
from ._routes import FallbackWarning, LayerRoute, check_rule, layer_routes, warn_on_fallback
from ._rules import RULES, Rule, Term, Use, get_rule, register_rule
from ._stacked import block_forward_error, stacked_mlp, stacked_path_sum

__all__ = [
    "RULES",
    "Adjoint",
    "Capture",
    "FallbackWarning",
    "LayerRoute",
    "Rule",
    "Term",
    "Use",
    "capture",
    "check_rule",
    "contracted_features",
    "forward",
    "get_rule",
    "hidden_reads",
    "layer_routes",
    "per_sample_jacobian",
    "project_tangent_features",
    "register_rule",
    "tangent_features",
    "tangent_gram",
    "tangent_gram_diag",
    "transposed_linear_rule",
    "warn_on_fallback",
    "block_forward_error",
    "dense_grad",
    "dense_rows",
    "directional",
    "factor_shares",
    "pair_terms",
    "stacked_mlp",
    "stacked_path_sum",
]
