"""
=================================================
Training-data attribution and its LDS
=================================================

``attribute`` scores every training point's part in a prediction, one row per query and
one column per training point. How good are such scores? The linear datamodeling score
(LDS) of the TRAK paper asks whether adding up the scores of a random half of the
training set ranks what a network retrained on that half predicts.

This example computes the scores of a digits network, retrains it on random halves with
:func:`~skpathkernel.metrics.retrain_on_subsets`, and measures the LDS with its bootstrap
interval (:func:`~skpathkernel.metrics.linear_datamodeling_interval`).
"""

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from skpathkernel import PathKernelClassifier
from skpathkernel.metrics import (
    linear_datamodeling_interval,
    linear_datamodeling_score,
    retrain_on_subsets,
)

X, y = load_digits(return_X_y=True)
X_train, X_query, y_train, y_query = train_test_split(
    X / 16.0, y, train_size=200, test_size=10, stratify=y, random_state=0)

# Full-batch SGD: every step uses every training point, a short deterministic path.
clf = PathKernelClassifier(hidden_layer_sizes=(32,), activation="tanh", solver="sgd",
                           batch_size=None, learning_rate_init=0.5, momentum=0.9,
                           max_iter=60, tol=None, random_state=0).fit(X_train, y_train)
print(f"{clf.trajectory_.n_steps} steps, query accuracy {clf.score(X_query, y_query):.2f}")

# %%
# The scores
# ----------
# The default explains the margin ``log(p_y / (1 - p_y))`` of each query's label: the
# exact split of the path, whose entries add up (with the initial output) to the margin's
# linear part.
scores = clf.attribute(X_query, y_query)
print("scores:", scores.shape)
top = np.argsort(scores[0])[::-1][:5]
print("most helpful training points for query 0:", top, "labels", y_train[top],
      "query label", y_query[0])

# %%
# Retraining on random halves
# ---------------------------
# 20 random halves of the training set; each model is trained from scratch with its own
# seed (``protocol="independent"``, TRAK's protocol), and its margins at the queries are
# recorded.
truth = retrain_on_subsets(clf, X_train, y_train, X_query, y_query, n_subsets=20,
                           protocol="independent", random_state=0)
print("subsets:", truth.subsets.shape, "retrained margins:", truth.outputs.shape)

# %%
# The linear datamodeling score
# -----------------------------
# The scores predict the margin of the model trained on subset ``S`` as the sum of the
# scores of the points in ``S``; the LDS is the Spearman correlation between that sum and
# the retrained margin over the subsets, averaged over the queries. The interval
# resamples the subsets.
lds = linear_datamodeling_score(scores, truth.subsets, truth.outputs)
low, high = linear_datamodeling_interval(scores, truth.subsets, truth.outputs,
                                         random_state=0)
print(f"LDS {lds:.2f}, 95% interval [{low:.2f}, {high:.2f}]")

# %%
# Predicted against retrained
# ---------------------------
# Each point is one subset at one query. Queries differ in scale, so both axes are
# centred per query; the LDS only reads the ranks within each query.
predicted = truth.subsets @ np.asarray(scores).T  # (n_subsets, n_queries)
fig, ax = plt.subplots(figsize=(5, 4))
colors = np.broadcast_to(np.arange(len(y_query)), predicted.shape)
ax.scatter(truth.outputs - truth.outputs.mean(axis=0), predicted - predicted.mean(axis=0),
           c=colors.ravel(), cmap="tab10", s=10)
ax.set_xlabel("retrained margin (centred per query)")
ax.set_ylabel("sum of the subset's scores (centred)")
ax.set_title(f"LDS {lds:.2f} [{low:.2f}, {high:.2f}]")
fig.tight_layout()

# %%
# The user guide's "Training-data attribution" page compares the methods of ``attribute``
# by this score, and the other protocols of ``retrain_on_subsets``; the example
# :ref:`sphx_glr_auto_examples_plot_counterfactual_attribution.py` replays the recorded
# path without the removed points, the counterfactual that ``method="unrolled"`` predicts.
