"""Every estimator and kernel on a dask.distributed cluster, through joblib's dask backend:
the same cv_results_, Grams and scores as serially, and torch threads within the cores.

Deselect with ``-m "not dask"`` (needs ``dask[distributed]``, in the ``test`` extra).
"""

import gc
import os
import threading
import warnings

import joblib
import numpy as np
import pytest
import torch
from _reference import jacrev_features
from numpy.testing import assert_allclose
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import Ridge
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel._parallel import map_row_blocks, n_row_blocks
from skpathkernel.kernels import PathKernel, TangentKernel

pytestmark = pytest.mark.dask

NET = dict(hidden_layer_sizes=(6,), max_iter=8, dtype="float64", device="cpu",
           random_state=0)


@pytest.fixture(scope="module")
def client():
    # Imported here, so that `-m "not dask"` collects this file without dask installed.
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(36, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    return X, y, (y > np.median(y)).astype(int)


def _mean_square_score(est, X, y=None):
    # The residual score is the square root of a GP variance ratio: round-off of order
    # 1e-16 in the ratio shows as ~1e-10 in a score of ~1e-6, not in its square.
    return float(np.mean(est.score_samples(X) ** 2))


def _searches(X, y, labels):
    fitted = PathKernelMachine(**NET).fit(X, y)
    return {
        "PathKernelMachine": (PathKernelMachine(**NET),
                              {"learning_rate_init": [0.01, 0.05]}, y, None),
        "PathKernelClassifier": (PathKernelClassifier(**NET),
                                 {"solver": ["sgd", "adam"]}, labels, None),
        "TangentFeatures": (make_pipeline(TangentFeatures(PathKernelMachine(**NET)), Ridge()),
                            {"ridge__alpha": [0.1, 1.0]}, y, None),
        "TangentFeatureSVM": (TangentFeatureSVM(PathKernelClassifier(**NET), svm_kernel="path"),
                              {"C": [0.5, 2.0]}, labels, None),
        "OODRankDetector": (OODRankDetector(PathKernelMachine(**NET)),
                            {"method": ["residual", "alignment"]}, None, _mean_square_score),
        "TangentKernel": (KernelRidge(kernel=TangentKernel(fitted, normalized=True)),
                          {"alpha": [1e-2, 1.0]}, y, None),
        # n_jobs inside a cluster task: serial there (no nested fan-out).
        "PathKernel": (KernelRidge(kernel=PathKernel(fitted, n_jobs=2)),
                       {"alpha": [1e-2, 1.0]}, y, None),
    }


@pytest.mark.parametrize("name", ["PathKernelMachine", "PathKernelClassifier",
                                  "TangentFeatures", "TangentFeatureSVM", "OODRankDetector",
                                  "TangentKernel", "PathKernel"])
def test_grid_search_on_the_cluster_matches_serial(client, data, name):
    X, y, labels = data
    est, grid, target, scoring = _searches(X, y, labels)[name]
    reference = clone(est)
    if name == "PathKernel":  # truly serial: its kernel's n_jobs=2 would start loky here
        reference.set_params(kernel__n_jobs=None)
    serial = GridSearchCV(reference, grid, cv=3, n_jobs=1, scoring=scoring).fit(X, target)
    with joblib.parallel_config(backend="dask"):
        search = GridSearchCV(est, grid, cv=3, n_jobs=-1, scoring=scoring).fit(X, target)
    for key in ("mean_test_score", "std_test_score", "split0_test_score",
                "split2_test_score"):
        assert_allclose(search.cv_results_[key], serial.cv_results_[key], rtol=1e-12,
                        atol=1e-14, err_msg=key)
    np.testing.assert_array_equal(search.cv_results_["rank_test_score"],
                                  serial.cv_results_["rank_test_score"])


def test_grams_and_scores_fan_out_to_the_cluster(client, data):
    X, y, _ = data
    est = PathKernelMachine(solver="adam", **NET).fit(X, y)
    Y = X[:7] + 0.1
    det = OODRankDetector(FrozenEstimator(est)).fit(X)
    # Residual scores compared squared (see _mean_square_score).
    serial = [TangentKernel(est)(X), PathKernel(est, normalized=True)(X, Y),
              PathKernel(est).diag(X), det.score_samples(Y) ** 2]
    det.set_params(n_jobs=-1)
    with joblib.parallel_config(backend="dask"):
        assert joblib.effective_n_jobs(-1) == 2
        blocks = [TangentKernel(est, n_jobs=-1)(X),
                  PathKernel(est, normalized=True, n_jobs=-1)(X, Y),
                  PathKernel(est, n_jobs=-1).diag(X), det.score_samples(Y) ** 2]
    # An absolute floor of 1e-14: the squared residual scores are fractions of a feature's
    # norm, and near 1e-12 their rounding reached 1e-15 (seen with NumPy 1.24 / SciPy 1.10).
    for got, want in zip(blocks, serial):
        assert_allclose(got, want, rtol=1e-12, atol=1e-12 * max(np.abs(want).max(), 1e-2))


def _threads(X_rows):
    return np.full((len(X_rows), 1), torch.get_num_threads())


def _fit_and_record_threads(X, y):
    # Runs on a worker: the threads torch uses while the network trains there.
    seen = []

    def module(n_in, n_out):
        net = torch.nn.Sequential(torch.nn.Linear(n_in, 4), torch.nn.Tanh(),
                                  torch.nn.Linear(4, n_out))
        net.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        return net

    PathKernelMachine(module=module, max_iter=3, device="cpu", random_state=0).fit(X, y)
    return sorted(set(seen)), threading.current_thread().name


def test_torch_threads_fit_the_cores_on_workers(client, data):
    from dask.distributed import Client, LocalCluster

    X, y, _ = data
    cores = joblib.cpu_count()
    with joblib.parallel_config(backend="dask"):
        out = np.vstack(map_row_blocks(_threads, X, -1))
    assert 2 * out.max() <= max(cores, 2)
    seen, _ = client.submit(_fit_and_record_threads, X, y, pure=False).result()
    # Blocks do not fan out again from inside a cluster task.
    assert client.submit(n_row_blocks, -1, X, pure=False).result() == 1
    assert seen and 2 * max(seen) <= max(cores, 2)
    # Workers as threads of this process: torch's default there is every core, per
    # thread; training and the blocks lower it to the share of each task slot.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as local:
        seen, name = local.submit(_fit_and_record_threads, X, y, pure=False).result()
        assert "Dask" in name and 2 * max(seen) <= max(cores, 2)
        with joblib.parallel_config(backend="dask", client=local):
            out = np.vstack(map_row_blocks(_threads, X, -1))
        assert 2 * out.max() <= max(cores, 2)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_path_kernel_split_over_steps_on_the_cluster(client, data, storage):
    # Each worker process sums its range of steps, reading its own chunk files of the
    # shared on-disk trajectory; the partial sums add up to the serial kernel.
    X, y, _ = data
    est = PathKernelMachine(solver="adam", trajectory_storage=storage, **NET).fit(X, y)
    Y = X[:7] + 0.1
    serial = [PathKernel(est)(X, Y), PathKernel(est, normalized=True)(X),
              PathKernel(est).diag(X)]
    with joblib.parallel_config(backend="dask"):
        split = [PathKernel(est, n_jobs=-1, split="steps")(X, Y),
                 PathKernel(est, n_jobs=-1, normalized=True, split="steps")(X),
                 PathKernel(est, n_jobs=-1, split="steps").diag(X)]
    for got, want in zip(split, serial):
        assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    if storage == "disk":  # the workers only referenced it: still this estimator's own
        assert est.trajectory_._store.owned


def test_decompose_and_attribute_query_blocks_on_the_cluster(client, data):
    # The on-disk path travels as a reference to its directory; the blocks choose their
    # quadrature nodes on their own, so they agree with the serial call to tol.
    X, y, _ = data
    est = PathKernelMachine(solver="adam", trajectory_storage="disk", **NET).fit(X, y)
    Xq = X[:9] + 0.05
    serial, scores = est.decompose(Xq), est.attribute(Xq)
    idx, contrib = est.explain(Xq, n_neighbors=4)
    with joblib.parallel_config(backend="dask"):
        split, split_scores = est.decompose(Xq, n_jobs=-1), est.attribute(Xq, n_jobs=-1)
        split_idx, split_contrib = est.explain(Xq, n_neighbors=4, n_jobs=-1)
    size = np.abs(serial.prediction).max()
    assert np.array_equal(split_idx, idx)
    assert_allclose(split_contrib, contrib, rtol=0, atol=1e-12 * size)
    assert_allclose(split.contributions, serial.contributions, rtol=0, atol=1e-12 * size)
    assert_allclose(split.reconstruction, serial.prediction, rtol=0, atol=1e-12 * size)
    assert_allclose(split_scores, scores, rtol=0, atol=1e-12 * size)
    assert est.trajectory_._store.owned  # the workers only referenced it


def test_tangent_features_transform_blocks_on_the_cluster(client, feature_row_blocks):
    """TangentFeatures(n_jobs=-1) under the dask backend: two row blocks (whole 256-row
    blocks of the serial call) on the workers, the serial features bit for bit, the
    on-disk path sent by reference (no pickling of the path: its temporary directory
    goes with the estimator)."""
    rng = np.random.RandomState(1)
    X = rng.uniform(-1, 1, size=(300, 2))
    tf = TangentFeatures(PathKernelMachine(solver="adam", trajectory_storage="disk", **NET))
    tf.fit(X, np.sin(2 * X[:, 0]) + X[:, 1])
    serial = tf.transform(X)
    store = tf.trajectory_._store
    directory = store.directory
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with joblib.parallel_config(backend="dask"):
            parallel = tf.set_params(n_jobs=-1).transform(X)
    assert feature_row_blocks == [[256, 44]]
    assert not [w for w in seen if "Pickling references" in str(w.message)]
    np.testing.assert_array_equal(parallel, serial)
    assert_allclose(parallel, jacrev_features(tf.estimator_, X), rtol=0,
                    atol=1e-13 * np.abs(serial).max())
    assert store.owned and os.path.isdir(directory)
    del tf, store
    gc.collect()
    assert not os.path.exists(directory)
