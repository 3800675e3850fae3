"""
================================================================
A small transformer on token ids: kernel and exact decomposition
================================================================

A sequence task a transformer learns in a few dozen steps: read four distinct tokens
and answer the one that comes first in sorted order (the smallest). The estimators take
the integer token ids as they are, ``X`` of shape ``(n, S)``, and hand them to the network
as int64, where an ``nn.Embedding`` reads them.

We look at the trained network as a kernel machine: its tangent kernel between held-out
sequences, and the exact decomposition of a held-out prediction over the training
sequences, which says which of them built the answer.
"""

# %%
# Token ids in, a transformer inside
# ----------------------------------
# Every sequence ends with a "query" token (id 10) whose output position gives the
# answer. The network is ``nn.TransformerEncoderLayer`` with dropout 0 (no randomness in
# the forward pass) and GELU, a smooth activation: the decomposition integrates the
# Jacobian along every step by quadrature, exact for smooth networks.
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from torch import nn

from skpathkernel import PathKernelClassifier
from skpathkernel.plotting import KernelMatrixDisplay

# The per-sample fallback of torch.func runs the fused CPU attention kernel one sample
# at a time and warns that it has no batching rule; the results are the same.
warnings.filterwarnings("ignore", message="There is a performance drop")

VOCAB, LENGTH, QUERY = 10, 4, 10
rng = np.random.RandomState(0)
sequences = np.array([rng.choice(VOCAB, LENGTH, replace=False) for _ in range(200)])
tokens = np.column_stack([sequences, np.full(len(sequences), QUERY)])  # (200, 5) int64
first = sequences.min(axis=1)  # the first token of the sorted sequence
X_train, X_test, y_train, y_test = tokens[:100], tokens[100:], first[:100], first[100:]


class TinyTransformer(nn.Module):
    def __init__(self, n_classes, d_model=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, d_model)
        self.position = nn.Parameter(0.1 * torch.randn(LENGTH + 1, d_model))
        self.encoder = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=32, dropout=0.0, activation="gelu",
            batch_first=True)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, token_ids):  # (n, S) int64
        h = self.embed(token_ids) + self.position
        return self.head(self.encoder(h)[:, -1])  # logits at the query position


def transformer(n_features_in, n_outputs):
    return TinyTransformer(n_outputs)


clf = PathKernelClassifier(module=transformer, solver="adam", learning_rate_init=0.03,
                           batch_size=None, max_iter=50, tol=None,
                           random_state=0).fit(X_train, y_train)
print(f"X_fit_ {clf.X_fit_.dtype} of shape {clf.X_fit_.shape}; {clf.n_params_} parameters; "
      f"classes {clf.classes_.tolist()}")
print(f"accuracy: training {clf.score(X_train, y_train):.3f}, "
      f"held-out {clf.score(X_test, y_test):.3f}")

# %%
# The tangent kernel between held-out sequences
# ---------------------------------------------
# The normalized tangent kernel at the end of training (the cosine between the sequences'
# tangent features), held-out sequences ordered by their answer: sequences with the same
# smallest token are close in the network's feature space.
fig, ax = plt.subplots(figsize=(5.5, 4.5))
KernelMatrixDisplay.from_estimator(clf, X_test, y_test, kernel="tangent", ax=ax)
_ = ax.set_title("normalized tangent kernel, held-out by answer")

# %%
# The exact decomposition of a held-out prediction
# -------------------------------------------------
# ``f(x; theta_T) = f(x; theta_0) + sum_i a_i(x)``: every training sequence's contribution
# along the recorded Adam path. ``error`` is the largest gap between that sum and the
# network's own logits. By default the quadrature chooses the number of nodes of each
# step to meet its share of ``tol``; ``n_nodes=5`` fixes five nodes per step instead. Both
# end at about the same error: what remains is the round-off of the float32 Adam path
# itself (Adam's normalisation amplifies it on near-zero gradients), which more nodes
# cannot remove and training in ``dtype="float64"`` lowers. Steps stopped at that floor
# raise a ``ConvergenceWarning``, caught and counted here.
query = X_test[:1]
for n_nodes in (None, 5):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        res = clf.decompose(query, n_nodes=n_nodes)
    print(f"n_nodes={n_nodes}: error {res.error:.1e} on logits up to "
          f"{np.abs(res.prediction).max():.1f} ({len(caught)} ConvergenceWarning)")

label = int(np.flatnonzero(clf.classes_ == clf.predict(query)[0])[0])
share = res.contributions[0, :, label]
by_answer = [share[y_train == c].sum() for c in clf.classes_]
fig, ax = plt.subplots(figsize=(5.5, 3.2))
ax.bar([str(c) for c in clf.classes_], by_answer,
       color=["C2" if i == label else "C7" for i in range(len(clf.classes_))])
ax.axhline(0, color="black", lw=0.8)
ax.set_xlabel("answer of the training sequences")
ax.set_ylabel(f"contribution to logit {clf.classes_[label]}")
ax.set_title(f"held-out {query[0, :LENGTH].tolist()}, predicted {clf.classes_[label]}: logit "
             f"{res.initial[0, label]:+.2f} at init, {res.prediction[0, label]:+.2f} trained",
             fontsize=9)
fig.tight_layout()

# %%
# The training sequences with the largest contributions to the predicted logit:
top = np.argsort(-np.abs(share))[:6]
for i in top:
    print(f"  {X_train[i, :LENGTH].tolist()} (answer {y_train[i]}): {share[i]:+.3f}")
plt.show()
