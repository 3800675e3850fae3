"""
====================================
The path kernel in an SVC and a grid
====================================

A network's path kernel (Domingos' kernel, summed along its recorded optimisation path)
plugs into :class:`sklearn.svm.SVC` as a callable kernel and into
:class:`~sklearn.model_selection.GridSearchCV` like any other.
"""

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from sklearn.model_selection import GridSearchCV
from sklearn.svm import SVC

from skpathkernel import PathKernelClassifier
from skpathkernel.datasets import make_ellipse
from skpathkernel.kernels import PathKernel

X, y = make_ellipse(n_samples=200, random_state=0)
X_test, y_test = make_ellipse(n_samples=200, random_state=1)
# record_every=10 keeps every 10th point: the path kernel becomes a Riemann sum over 30
# points instead of 300, ten times cheaper to evaluate. The kernel's first call on the
# path says so, once, with a UserWarning that estimates the sum's error (0.05 of the
# largest entry here); record_every=1 gives the every-step kernel.
net = PathKernelClassifier(hidden_layer_sizes=(32, 32), solver="adam", learning_rate_init=0.01,
                           max_iter=300, record_every=10, activation="tanh", batch_size=None,
                           tol=None, random_state=0).fit(X, y)

# %%
# The path kernel as an SVC kernel
# --------------------------------
# Normalized, so that the SVM's C does not depend on the kernel's scale.
svc = SVC(kernel=PathKernel(net, normalized=True)).fit(X, y)
print(f"network {net.score(X_test, y_test):.3f}, SVC on its path kernel "
      f"{svc.score(X_test, y_test):.3f}")

# %%
# Tuning C with GridSearchCV
# --------------------------
# The kernel keeps its fitted network through ``clone``, so cross-validation refits only
# the SVM.
search = GridSearchCV(SVC(kernel=PathKernel(net, normalized=True)), {"C": [0.1, 1.0, 10.0]},
                      cv=3).fit(X, y)
print("best C:", search.best_params_["C"], f"test accuracy {search.score(X_test, y_test):.3f}")

fig, ax = plt.subplots()
ax.plot([0.1, 1.0, 10.0], search.cv_results_["mean_test_score"], "o-")
ax.set_xscale("log")
ax.set_xlabel("C")
_ = ax.set_ylabel("cross-validated accuracy")
