"""
=============================================
Grid search and large Grams on a Dask cluster
=============================================

Every skpathkernel estimator and kernel pickles to workers (the network travels as
NumPy arrays), so scikit-learn's :class:`~sklearn.model_selection.GridSearchCV` runs
them on a :mod:`dask.distributed` cluster through joblib's dask backend, with the same
``cv_results_`` as serially. The kernels' own ``n_jobs`` splits a large Gram into row
blocks that fan out the same way.

This example starts a :class:`~dask.distributed.LocalCluster` with
``processes=False`` (two workers as threads of this process), which starts in a fraction
of a second and needs no ``if __name__ == "__main__"`` guard. A real deployment uses
``processes=True`` (the default) or a remote scheduler's address: nothing else changes.
The timings below come from whatever machine built the docs; on two shared cores,
expect little speed-up from the blocks themselves, the point is that the same code scales
out. A grid search that runs many times faster than ``2x`` on two workers is the thread
rule at work: serially torch runs one thread per core and they contend on a busy machine,
while each worker task runs torch with its share of the cores (one thread here).
"""

# %%
import time

import joblib
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from dask.distributed import Client, LocalCluster
from sklearn.model_selection import GridSearchCV

from skpathkernel import PathKernelClassifier, TangentFeatureSVM
from skpathkernel.datasets import make_circle
from skpathkernel.kernels import TangentKernel

cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                       dashboard_address=":0")
client = Client(cluster)

X, y = make_circle(n_samples=100, random_state=0)
network = PathKernelClassifier(hidden_layer_sizes=(16,), solver="adam",
                               learning_rate_init=0.02,
                               max_iter=30, activation="tanh", batch_size=None, tol=None,
                               device="cpu", dtype="float64", random_state=0)
svm = TangentFeatureSVM(network, svm_kernel="linear")
grid = {"C": [0.1, 10.0], "estimator__learning_rate_init": [0.01, 0.05]}

# %%
# The same grid search, serially and on the cluster
# --------------------------------------------------
# ``parallel_config(backend="dask")`` sends scikit-learn's joblib tasks (one fit per
# candidate and fold) to the cluster's workers.
start = time.perf_counter()
serial = GridSearchCV(svm, grid, cv=3, n_jobs=1).fit(X, y)
t_serial = time.perf_counter() - start

start = time.perf_counter()
with joblib.parallel_config(backend="dask"):
    on_dask = GridSearchCV(svm, grid, cv=3, n_jobs=-1).fit(X, y)
t_dask = time.perf_counter() - start

same = np.allclose(serial.cv_results_["mean_test_score"],
                   on_dask.cv_results_["mean_test_score"], rtol=1e-12, atol=0)
print(f"serial {t_serial:.1f} s, dask {t_dask:.1f} s; identical cv_results_: {same}")
print("best parameters:", on_dask.best_params_)

# %%
# A Gram in row blocks
# --------------------
# ``n_jobs=-1`` splits the rows of ``K(X, X)`` into one block per worker (here two);
# each task limits torch to its share of the cores. The result equals the serial Gram to
# float64 round-off.
net = on_dask.best_estimator_
X_big, _ = make_circle(n_samples=600, random_state=1)
K_serial = TangentKernel(net)(X_big)
with joblib.parallel_config(backend="dask"):
    K_blocks = TangentKernel(net, n_jobs=-1)(X_big)
print("max |difference| / max |K|:",
      f"{np.abs(K_blocks - K_serial).max() / np.abs(K_serial).max():.1e}")

client.close()
cluster.close()

# %%
# The grid's scores, serial and on the cluster
# --------------------------------------------
params = [f"C={p['C']}\nlr={p['estimator__learning_rate_init']}"
          for p in serial.cv_results_["params"]]
pos = np.arange(len(params))
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.bar(pos - 0.2, serial.cv_results_["mean_test_score"], width=0.4, label="n_jobs=1")
ax.bar(pos + 0.2, on_dask.cv_results_["mean_test_score"], width=0.4,
       label="dask, 2 workers")
ax.set_xticks(pos, params, fontsize=8)
ax.set_ylim(0.4, 1.0)
ax.set_ylabel("mean CV accuracy")
ax.legend(loc="lower right")
fig.tight_layout()
plt.show()
