"""
==========
Quickstart
==========

Train a small network with :class:`~skpathkernel.PathKernelClassifier`, predict, look at
its recorded optimisation path and use its tangent kernel like any scikit-learn kernel.
"""

# %%
# Fit and predict
# ---------------
# The circle task of Guo, He & Morel (2026): +1 on the unit circle, -1 inside a disk of
# radius^2 0.8.
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from skpathkernel import PathKernelClassifier
from skpathkernel.datasets import make_circle

X, y = make_circle(n_samples=200, random_state=0)
X_test, y_test = make_circle(n_samples=200, random_state=1)
clf = PathKernelClassifier(hidden_layer_sizes=(32, 32), solver="sgd", learning_rate_init=0.5,
                           batch_size=32, max_iter=60, activation="tanh", tol=None,
                           random_state=0).fit(X, y)
print(f"test accuracy: {clf.score(X_test, y_test):.3f}")

# %%
# The recorded trajectory
# -----------------------
# Point 0 holds the initial parameters, point -1 the final ones; ``learning_rates[k]`` is
# the step taken from point k to point k + 1.
traj = clf.trajectory_
print(len(traj), "recorded points,", traj.n_params, "parameters")
drift = [float(np.linalg.norm(traj.parameters(k) - traj.parameters(0)))
         for k in range(len(traj))]
fig, ax = plt.subplots()
ax.plot(traj.steps, drift)
ax.set_xlabel("optimizer step")
_ = ax.set_ylabel("||theta_t - theta_0||")

# %%
# The tangent kernel
# ------------------
# ``tangent_kernel_`` is a :class:`sklearn.gaussian_process.kernels.Kernel`: a Gram matrix
# callable. Its normalized version is the cosine similarity of tangent features.
K = clf.tangent_kernel_(X[:5])
print(np.round(K, 3))

