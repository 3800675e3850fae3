"""
=======================================
How the tangent kernel evolves (fig 10)
=======================================

:class:`~skpathkernel.plotting.KernelEvolutionDisplay` follows the normalized tangent
kernel ``K_hat_t(x, y)`` along the recorded path: on the circle task every pair drifts
apart, the points of opposite classes the most (from 0.74 and 0.66 at initialization to
0.39 and 0.29), the point of the same class the least (from 0.92 to 0.65). They do not
decay toward 0, as the caption of figure 10 says they do (``skpathkernel reproduce``
reports that row).
"""

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from skpathkernel import PathKernelClassifier
from skpathkernel.datasets import make_circle
from skpathkernel.plotting import KernelEvolutionDisplay, KernelMatrixDisplay

X, y = make_circle(n_samples=200, random_state=0)
clf = PathKernelClassifier(hidden_layer_sizes=(32, 32), solver="sgd", learning_rate_init=0.5,
                           batch_size=32, max_iter=40, activation="tanh", tol=None,
                           random_state=0).fit(X, y)

# %%
# x = (0, 0) is inside the disk (-1); (0.5, 0) too; (1, 0) and (1.2, 0) are outside (+1).
Y = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [1.2, 0.0]])
disp = KernelEvolutionDisplay.from_estimator(clf, [0.0, 0.0], Y)
print("initial K_hat:", np.round(disp.kernel_values[0], 3))
print("final K_hat:  ", np.round(disp.kernel_values[-1], 3))

# %%
# The whole matrix, at initialization and after training, samples ordered by class
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, step in zip(axes, [0, -1]):
    KernelMatrixDisplay.from_estimator(clf, X[:60], y[:60], step=step, ax=ax)
