"""
===========================================
Which training points made this prediction?
===========================================

A trained network is exactly a kernel machine over its training set along its path:
``f(x) = f(x; theta_0) + sum_i a_i(x) + regularization``.
:meth:`~skpathkernel.PathKernelMachine.decompose` gives every ``a_i(x)``;
:meth:`~skpathkernel.PathKernelMachine.explain` returns the largest.
"""

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from skpathkernel import PathKernelMachine
from skpathkernel.datasets import make_sine

X, y = make_sine(n_samples=40)
est = PathKernelMachine(hidden_layer_sizes=(16, 16), solver="adam", learning_rate_init=0.02,
                        max_iter=150, activation="tanh", batch_size=None, tol=None,
                        normalize_y=False, random_state=0).fit(X, y)

# %%
# The exact decomposition
# -----------------------
x = np.array([[1.0]])
res = est.decompose(x)
total = res.initial + res.contributions.sum(axis=1) + res.regularization
print(f"prediction {res.prediction[0, 0]:.4f}, rebuilt from the training points "
      f"{total[0, 0]:.4f}, error {res.error:.1e}")

# %%
# The training points that moved f(1.0) the most
# ----------------------------------------------
idx, contrib = est.explain(x, n_neighbors=5)
print("x of the top-5 points:", np.round(X[idx[0], 0], 2))

fig, ax = plt.subplots()
ax.bar(X[:, 0], res.contributions[0, :, 0], width=0.12)
ax.axvline(1.0, color="black", linestyle="--", label="query x = 1")
ax.set_xlabel("training input x_i")
ax.set_ylabel("contribution a_i(1.0)")
_ = ax.legend()
