"""
===============================================
A small CNN on digit images: its kernel machine
===============================================

scikit-learn's bundled handwritten digits, fed to a convolutional network as images of
shape ``(n, 1, 8, 8)``: with ``module=``, every skpathkernel estimator and method takes
``X`` in the shape the network takes (no flattening and unflattening).

We train the CNN, then use what it learned three ways:

* its tangent features ``phi(x) = d f(x; theta_T) / d theta`` as the input of a linear SVM;
* its path kernel, the optimizer-weighted sum of the tangent kernels along the training
  path, over held-out images ordered by class;
* the exact decomposition of a prediction over the training images: which of them moved
  the network's output at a test digit, and by how much.
"""

# %%
# Images in, images everywhere
# ----------------------------
# The network is a callable ``(n_features_in, n_outputs) -> torch.nn.Module``; for image
# inputs ``n_features_in`` is the number of values per image (64). Smooth activations
# (tanh) keep the decomposition exact: it integrates the Jacobian along every step by
# quadrature, which a ReLU's kinks would spoil.
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import train_test_split
from torch import nn

from skpathkernel import PathKernelClassifier, TangentFeatureSVM
from skpathkernel.plotting import KernelMatrixDisplay

digits = load_digits()
images = (digits.images / 16.0).reshape(-1, 1, 8, 8)  # (n, channels, height, width)
X_train, X_test, y_train, y_test = train_test_split(
    images, digits.target, train_size=300, test_size=300, stratify=digits.target,
    random_state=0)


def cnn(n_features_in, n_outputs):
    return nn.Sequential(
        nn.Conv2d(1, 8, kernel_size=3), nn.Tanh(),             # 8 x 6 x 6
        nn.Conv2d(8, 8, kernel_size=3, stride=2), nn.Tanh(),   # 8 x 2 x 2
        nn.Flatten(), nn.Linear(32, n_outputs),
    )


params = dict(module=cnn, solver="adam", learning_rate_init=0.02, batch_size=100,
              max_iter=15, tol=None, random_state=0)
clf = PathKernelClassifier(**params).fit(X_train, y_train)
print(f"input shape {clf.input_shape_}, n_features_in_ = {clf.n_features_in_}, "
      f"{clf.n_params_} parameters, {len(clf.trajectory_) - 1} recorded steps")
print(f"CNN held-out accuracy: {clf.score(X_test, y_test):.3f}")

# %%
# Tangent features into an SVM
# ----------------------------
# :class:`~skpathkernel.TangentFeatureSVM` reads the same CNN (a ``FrozenEstimator`` is
# used as it is, not retrained), then trains a linear SVM whose
# input is ``phi(x)``, one row of ``n_params_ x 10`` features per image (the network has
# ten outputs; the rows' inner products are the trace tangent kernel).
svm = TangentFeatureSVM(FrozenEstimator(clf), svm_kernel="linear").fit(X_train, y_train)
print(f"linear SVM on the CNN's tangent features: {svm.score(X_test, y_test):.3f}")

# %%
# The path kernel over held-out digits
# ------------------------------------
# The normalized path kernel of 120 test images, ordered by class: the blocks on the
# diagonal show that the network's kernel groups digits by what they are.
fig, ax = plt.subplots(figsize=(5.5, 4.5))
KernelMatrixDisplay.from_estimator(clf, X_test[:120], y_test[:120], kernel="path", ax=ax)
_ = ax.set_title("normalized path kernel, test digits by class")

# %%
# Which training images made a prediction
# ---------------------------------------
# ``decompose`` splits ``f(x; theta_T)`` into ``f(x; theta_0)`` plus one contribution per
# training image along the recorded path, exactly (``error`` is the largest gap between
# the sum and the network). Summed by the training images' class, the contributions to
# the predicted logit read like a vote: the images of the predicted class push it up, the
# others down.
right = np.flatnonzero(clf.predict(X_test[:20]) == y_test[:20])[:3]
queries, labels = X_test[right], y_test[right]
res = clf.decompose(queries)
print(f"decomposition of {len(queries)} predictions: error {res.error:.2e} "
      f"(logits up to {np.abs(res.prediction).max():.1f})")

fig, axes = plt.subplots(1, len(queries), figsize=(9, 2.8), sharey=True)
for q, (ax, label) in enumerate(zip(axes, labels)):
    by_class = [res.contributions[q, y_train == c, label].sum() for c in range(10)]
    ax.bar(range(10), by_class, color=["C2" if c == label else "C7" for c in range(10)])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(10))
    ax.set_title(f"test digit {label}: logit {res.prediction[q, label]:.1f}", fontsize=9)
    ax.set_xlabel("class of the training images")
axes[0].set_ylabel("contribution to the logit")
fig.tight_layout()

# %%
# ``explain(..., output="all")`` ranks the training images by the size of their
# contribution summed over the ten logits (the default explains the predicted class's
# margin); the titles give each one's label and its share of the predicted logit.
# The largest movers are often images of other classes: they move several logits at once,
# their own class's up and the others down.
idx, contrib = clf.explain(queries, n_neighbors=5, output="all")
fig, axes = plt.subplots(len(queries), 6, figsize=(8, 4.4))
for row, (query, label, neighbours) in enumerate(zip(queries, labels, idx)):
    axes[row, 0].imshow(query[0], cmap="gray_r")
    axes[row, 0].set_title(f"test digit {label}", fontsize=8)
    for col, i in enumerate(neighbours, start=1):
        axes[row, col].imshow(X_train[i, 0], cmap="gray_r")
        axes[row, col].set_title(f"{y_train[i]}: {res.contributions[row, i, label]:+.2f}",
                                 fontsize=8)
for ax in axes.ravel():
    ax.set_xticks([])
    ax.set_yticks([])
fig.suptitle("largest contributions (training label: share of the predicted logit)")
fig.tight_layout()
plt.show()
