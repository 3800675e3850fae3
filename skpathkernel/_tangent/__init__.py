"""Per-sample gradients of a network, as factors, and the kernels they define.

Private engine behind :mod:`skpathkernel.kernels` and the tangent-feature estimators:
torch in, torch out (no NumPy). Layers with a registered rule (:mod:`._rules`, nn.Linear
today) contribute Kronecker factors and never materialise their per-sample gradients;
everything else goes through a chunked ``torch.func`` fallback (:mod:`._generic`).
"""

from ._capture import capture, forward
from ._generic import per_sample_jacobian
from ._gram import hidden_reads, tangent_features, tangent_gram, tangent_gram_diag
from ._projection import project_tangent_features
from ._rules import RULES, Rule, Term, register_rule

__all__ = [
    "RULES",
    "Rule",
    "Term",
    "capture",
    "forward",
    "hidden_reads",
    "per_sample_jacobian",
    "project_tangent_features",
    "register_rule",
    "tangent_features",
    "tangent_gram",
    "tangent_gram_diag",
]
