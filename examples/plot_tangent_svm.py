"""
=====================================================
SVM on learned tangent features versus an RBF kernel
=====================================================

Figure 3 of Guo, He & Morel (2026): a linear SVM whose inputs are a trained network's
tangent features ``phi(x) = d f(x; theta_T) / d theta`` (each sample is represented by
``phi(x)``, not by its coordinates), against an SVC with a Gaussian RBF kernel on the raw
inputs.

Two tasks: the isotropic circle (``x1^2 + x2^2 <= 0.9`` versus the unit circle) and the
anisotropic ellipse (``100 x1^2 + x2^2 <= 0.9`` versus ``= 1``). The RBF kernel measures
distances isotropically, so the ellipse's thin direction defeats it; the tangent features
have learned the geometry of the task.
"""

# %%
# Data and models
# ---------------
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC

from skpathkernel import PathKernelClassifier, TangentFeatureSVM
from skpathkernel.datasets import make_circle, make_ellipse

tasks = {
    "circle": make_circle(400, inner_radius_sq=0.9, random_state=0),
    "ellipse": make_ellipse(400, inner_radius_sq=0.9, anisotropy=100.0, random_state=0),
}

models = {}
for name, (X, y) in tasks.items():
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.5, random_state=0, stratify=y
    )
    network = PathKernelClassifier(hidden_layer_sizes=(32, 32), solver="adam",
                                   learning_rate_init=0.01, max_iter=300, activation="tanh",
                                   batch_size=None, tol=None, random_state=0)
    tangent = TangentFeatureSVM(network, svm_kernel="linear")
    tangent.fit(X_train, y_train)
    rbf = SVC(kernel="rbf").fit(X_train, y_train)
    models[name] = (tangent, rbf, X_test, y_test)
    print(f"{name:8s} held-out accuracy: tangent-feature linear SVM "
          f"{tangent.score(X_test, y_test):.3f}, RBF SVC on inputs {rbf.score(X_test, y_test):.3f}")

# %%
# Decision regions
# ----------------
# Top row: the linear SVM on tangent features (panels a, b of the seed); bottom row: the
# RBF SVC on the raw inputs (panels c, d). Test points are drawn on top.
fig, axes = plt.subplots(2, 2, figsize=(8, 8))
for col, (name, (tangent, rbf, X_test, y_test)) in enumerate(models.items()):
    X = tasks[name][0]
    pad = 0.1 * np.ptp(X, axis=0)
    g1, g2 = np.meshgrid(np.linspace(X[:, 0].min() - pad[0], X[:, 0].max() + pad[0], 150),
                         np.linspace(X[:, 1].min() - pad[1], X[:, 1].max() + pad[1], 150))
    grid = np.column_stack([g1.ravel(), g2.ravel()])
    for row, (label, model) in enumerate([("tangent features, linear SVM", tangent),
                                          ("raw inputs, RBF SVC", rbf)]):
        ax = axes[row, col]
        ax.contourf(g1, g2, model.predict(grid).reshape(g1.shape), alpha=0.3, cmap="coolwarm")
        ax.scatter(X_test[:, 0], X_test[:, 1], c=y_test, s=8, cmap="coolwarm")
        ax.set_title(f"{name}: {label}\naccuracy {model.score(X_test, y_test):.3f}",
                     fontsize=9)
fig.tight_layout()
plt.show()
