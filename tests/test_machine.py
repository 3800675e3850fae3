"""Estimator-level tangent features, kernels and neighbours against independent loops."""


import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from _reference import features_loop, module_at, zero_feature_network
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.exceptions import DataConversionWarning, NotFittedError
from sklearn.neighbors import NearestNeighbors
from sklearn.neural_network import MLPRegressor

from skpathkernel import (
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    RecordedNetwork,
    TangentKernel,
)


def _phi_loop(est, X, k=-1):
    return features_loop(module_at(est, k), X)


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(25, 3))
    y = np.digitize(X[:, 0], [-0.5, 0.5])
    clf = PathKernelClassifier(hidden_layer_sizes=(7,), solver="adam", max_iter=10,
                               dtype="float64", random_state=0).fit(X, y)
    reg = PathKernelMachine(hidden_layer_sizes=(7, 5), max_iter=10, dtype="float64",
                            random_state=0).fit(X, y.astype(float))
    return X, clf, reg


def test_transform_equals_autograd_loop(fitted):
    X, clf, reg = fitted
    assert_allclose(reg.transform(X), _phi_loop(reg, X), rtol=1e-10, atol=1e-12)
    phi = clf.transform(X)  # 3 classes: the flattened Jacobian / sqrt(3)
    assert phi.shape == (len(X), 3 * clf.n_params_)
    assert_allclose(phi, _phi_loop(clf, X), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalized", [True, False])
def test_kneighbors_equals_brute_force(fitted, normalized):
    X, _, reg = fitted
    Q = X[:4] + 0.1
    pq, pt = _phi_loop(reg, Q), _phi_loop(reg, X)
    if normalized:
        pq /= np.linalg.norm(pq, axis=1, keepdims=True)
        pt /= np.linalg.norm(pt, axis=1, keepdims=True)
    brute = np.linalg.norm(pq[:, None, :] - pt[None, :, :], axis=2)
    dist, ind = reg.kneighbors(Q, n_neighbors=6, normalized=normalized)
    assert_array_equal(ind, np.argsort(brute, axis=1, kind="stable")[:, :6])
    assert_allclose(dist, np.sort(brute, axis=1)[:, :6], rtol=1e-7, atol=1e-7)
    assert_array_equal(reg.kneighbors(Q, 6, normalized=normalized, return_distance=False), ind)


def test_kneighbors_at_initialization_and_path(fitted):
    X, _, reg = fitted
    p0 = _phi_loop(reg, X, k=0)
    p0 /= np.linalg.norm(p0, axis=1, keepdims=True)
    _, ind = reg.kneighbors(X[:3], n_neighbors=4, step=0)
    assert_array_equal(ind, np.argsort(-(p0[:3] @ p0.T), axis=1, kind="stable")[:, :4])
    _, ind_path = reg.kneighbors(X[:3], n_neighbors=4, kernel="path")
    assert_array_equal(ind_path[:, 0], [0, 1, 2])  # each point is its own nearest
    with pytest.raises(ValueError, match="n_neighbors must be an integer in"):
        reg.kneighbors(X, n_neighbors=len(X) + 1)
    with pytest.raises(ValueError, match="kernel must be"):
        reg.kneighbors(X, n_neighbors=2, kernel="rbf")
    # The path kernel has no step: one passed is refused, not silently ignored.
    with pytest.raises(ValueError, match="step=0 applies to kernel='tangent'"):
        reg.kneighbors(X[:3], n_neighbors=4, kernel="path", step=0)


@pytest.mark.parametrize("normalized", [True, False])
def test_kneighbors_of_the_training_set_exclude_the_point_itself(fitted, normalized):
    """X=None: scikit-learn's neighbours of each training point among the others, here
    NearestNeighbors' own on the dense Jacobian features."""
    X, _, reg = fitted
    phi = _phi_loop(reg, X)
    if normalized:
        phi /= np.linalg.norm(phi, axis=1, keepdims=True)
    ref_dist, ref_ind = NearestNeighbors(algorithm="brute").fit(phi).kneighbors(n_neighbors=6)
    dist, ind = reg.kneighbors(n_neighbors=6, normalized=normalized)
    assert_array_equal(ind, ref_ind)
    assert_allclose(dist, ref_dist, rtol=1e-7, atol=1e-7)
    assert_array_equal(reg.kneighbors(None, 6, normalized=normalized, return_distance=False),
                       ind)
    # As many as there are other points, and no more (sklearn's n_neighbors < n_samples_fit).
    assert reg.kneighbors(n_neighbors=len(X) - 1, return_distance=False).shape == (
        len(X), len(X) - 1)
    with pytest.raises(ValueError, match=rf"in \[1, {len(X) - 1}\] .*less one"):
        reg.kneighbors(n_neighbors=len(X))


def test_kneighbors_of_the_training_set_under_the_path_kernel(fitted):
    """The path kernel's own training Gram as distances, NearestNeighbors' X=None on them."""
    X, _, reg = fitted
    K = reg.path_kernel_(X)
    d = np.diag(K)
    D = np.sqrt(np.maximum(d[:, None] + d[None, :] - 2 * K, 0))
    ref_dist, ref_ind = NearestNeighbors(metric="precomputed").fit(D).kneighbors(n_neighbors=4)
    dist, ind = reg.kneighbors(n_neighbors=4, kernel="path", normalized=False)
    assert_array_equal(ind, ref_ind)
    assert_allclose(dist, ref_dist, rtol=1e-7, atol=1e-7)


def test_kneighbors_of_the_training_set_keep_a_duplicate():
    """A point is not its own neighbour, but its exact duplicate is (at distance 0), as in
    scikit-learn, however its own distance to itself rounds."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(12, 2))
    X[7] = X[3]
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=3, tol=None, dtype="float64",
                            random_state=0).fit(X, X[:, 0])
    dist, ind = est.kneighbors(n_neighbors=2, normalized=False)
    assert not np.any(ind == np.arange(len(X))[:, None])
    assert (ind[3, 0], ind[7, 0]) == (7, 3)
    assert_allclose(dist[[3, 7], 0], 0, atol=1e-7)
    # The network's own kneighbors (a RecordedNetwork's network_) does the same.
    net = RecordedNetwork(est.module_, est.trajectory_, X_train=X, y_train=X[:, 0])
    assert_array_equal(net.network_.kneighbors(n_neighbors=2, normalized=False)[1], ind)


def test_kernel_attributes(fitted):
    X, clf, _ = fitted
    K = clf.tangent_kernel_(X)
    phi = _phi_loop(clf, X)
    assert_allclose(K, phi @ phi.T, rtol=1e-9, atol=1e-12)
    unfitted = PathKernelMachine()
    assert not hasattr(unfitted, "path_kernel_")
    with pytest.raises(NotFittedError):
        unfitted.tangent_kernel_  # noqa: B018


def test_set_params_dtype_after_fit_keeps_the_fitted_network_usable(fitted):
    """dtype is a parameter of the next fit; the fitted network keeps its own (dtype_)."""
    import pickle

    X, _, _ = fitted
    rng = np.random.RandomState(1)
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=3, random_state=0)
    est.fit(X, rng.normal(size=len(X)))
    before = (est.predict(X), est.tangent_kernel_(X[:4]), est.decompose(X[:2]).prediction)
    est.set_params(dtype="float64")
    assert est.dtype_ == "float32"
    after = (est.predict(X), est.tangent_kernel_(X[:4]), est.decompose(X[:2]).prediction)
    for a, b in zip(before, after):
        assert_array_equal(a, b)
    loaded = pickle.loads(pickle.dumps(est))
    assert next(loaded.module_.parameters()).dtype == torch.float32
    assert_array_equal(loaded.predict(X), before[0])


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("n_classes", [2, 3, "multilabel"])
def test_predict_log_proba_is_finite_where_probabilities_round_to_zero(n_classes):
    """np.log(predict_proba) gave -inf beyond a margin of about 37 (1 - p rounds to 0);
    the log-probabilities come from the margins: -logaddexp(0, -s) per sigmoid, s minus
    its log-sum-exp per softmax, written here with NumPy alone."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(60, 2))
    if n_classes == "multilabel":
        y = np.column_stack([X[:, 0] > 0, X[:, 1] > 0, X.sum(1) > 0]).astype(int)
    else:
        y = np.digitize(X[:, 0], np.linspace(-1, 1, n_classes + 1)[1:-1])
    clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=20, dtype="float64",
                               random_state=0).fit(X, y)
    Q = np.vstack([X[:5], 1e4 * X[:5]])  # far queries: margins in the thousands
    s = clf.decision_function(Q)
    if n_classes == "multilabel":
        expected = -np.logaddexp(0, -s)
    elif n_classes == 2:
        expected = np.column_stack([-np.logaddexp(0, s), -np.logaddexp(0, -s)])
    else:
        expected = s - np.logaddexp.reduce(s, axis=1, keepdims=True)
    assert np.abs(s[5:]).max() > 100  # saturated: predict_proba rounds to 0 there
    log_p = clf.predict_log_proba(Q)
    assert np.isfinite(log_p).all()
    assert_allclose(log_p, expected, rtol=1e-12, atol=1e-12)
    # predict_proba agrees down to its tiny probabilities (1 - expit(s) rounded them to 0;
    # below 1e-300 lie float64's subnormals, which expit itself flushes).
    assert_allclose(np.exp(log_p), clf.predict_proba(Q), rtol=1e-10, atol=1e-300)


def test_kneighbors_of_a_single_training_sample_says_why_there_is_none():
    # A recorded loop over one sample (the estimators need two to fit).
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=1)
    X = torch.ones((1, 2))
    for _ in range(2):
        opt.zero_grad()
        module(X).square().mean().backward()
        rec.set_batch([0])
        opt.step()
    net = rec.as_network(X, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="at least 2 training samples"):
        net.kneighbors(n_neighbors=1)
    # With queries, the one sample is every query's neighbour.
    assert_array_equal(net.kneighbors(np.zeros((2, 2), dtype=np.float32), n_neighbors=1,
                                      return_distance=False), [[0], [0]])


@pytest.mark.parametrize("query", [False, True])
def test_kneighbors_distances_stay_within_the_memory_budget(query):
    """Blocks of queries: the N x N distances of X=None (or Q x N) are never held at
    once past memory_budget; the neighbours are those of the one-block call."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(1500, 3))
    # float64: the blocks' kernel rounds as the symmetric one-pass Gram does not, and a
    # float32 cosine near 1 moves sqrt(2 - 2 cos) by 1e-4.
    common = dict(hidden_layer_sizes=(4,), max_iter=2, tol=None, dtype="float64",
                  random_state=0)
    small = PathKernelMachine(memory_budget=2**20, **common).fit(X, X[:, 0])
    large = PathKernelMachine(**common).fit(X, X[:, 0])
    Xq = X[:700] + 0.01 if query else None
    tracemalloc.start()
    dist, ind = small.kneighbors(Xq, n_neighbors=5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**20  # one block's arrays; the whole 1500 x 1500 float64 is 17 MiB
    ref_dist, ref_ind = large.kneighbors(Xq, n_neighbors=5)
    assert_array_equal(ind, ref_ind)
    assert_allclose(dist, ref_dist, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["tangent", "path"])
def test_kneighbors_normalized_places_a_zero_feature_as_the_normalized_kernel_does(kernel):
    """A network without biases has a zero tangent feature at x = 0 (tanh(0) = 0). The
    normalized kernel and its diag are 0 there (the feature has no direction); the
    distances are those of its Gram, sqrt(K(x, x) + K(y, y) - 2 K(x, y)): 1 from every
    other point, 0 from another zero (kneighbors put it at sqrt(2) from everything, its
    own duplicate included), and for the tangent kernel those of the normalized dense
    Jacobian features, a zero feature left at the origin."""
    net, X = zero_feature_network()
    module = net.module
    rng = np.random.RandomState(1)
    Q = np.vstack([np.zeros((1, 2)), rng.normal(size=(2, 2))])
    Z = np.vstack([Q, X])
    k = (TangentKernel if kernel == "tangent" else PathKernel)(net, normalized=True)
    K = k(Z)
    d = np.diag(K)
    assert_array_equal(d, k.diag(Z))
    assert_array_equal(d[[0, 5, 8]], 0.0)  # the zero query and the two zero rows
    brute = np.sqrt(np.maximum(d[:, None] + d[None, :] - 2 * K, 0))
    if kernel == "tangent":
        phi = features_loop(module, Z)
        norm = np.linalg.norm(phi, axis=1, keepdims=True)
        phi = np.divide(phi, norm, out=np.zeros_like(phi), where=norm > 0)
        assert_allclose(brute, np.linalg.norm(phi[:, None] - phi[None, :], axis=2),
                        rtol=1e-7, atol=1e-7)
    dist, ind = net.kneighbors(Q, n_neighbors=8, kernel=kernel, normalized=True)
    assert_allclose(dist, np.sort(brute[:3, 3:], axis=1), rtol=1e-10, atol=1e-10)
    assert_allclose(np.take_along_axis(brute[:3, 3:], ind, axis=1), dist, atol=1e-10)
    assert_array_equal(ind[0, :2], [2, 5])  # the zero query's nearest: the zero rows
    assert_allclose(dist[0], [0, 0, 1, 1, 1, 1, 1, 1], atol=1e-12)
    # The training set against itself (X=None): the two zero rows each other's nearest.
    own = brute[3:, 3:] + np.diag(np.full(8, np.inf))
    dist, ind = net.kneighbors(n_neighbors=7, kernel=kernel, normalized=True)
    assert_allclose(dist, np.sort(own, axis=1)[:, :7], rtol=1e-10, atol=1e-10)
    assert (ind[2, 0], ind[5, 0]) == (5, 2)


class _SqrtHead(torch.nn.Module):
    """``lin(x) * sqrt(5 - x_0)``: finite on the training inputs (x_0 < 5), NaN beyond."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.lin(x) * torch.sqrt(5 - x[:, :1])


@pytest.mark.parametrize("n_classes", [None, 2, 3])
def test_predict_warns_of_rows_where_the_network_outputs_nan(n_classes):
    """A classifier's predict labelled a row whose logits are NaN as classes_[0] (argmax of
    NaN, NaN > 0 False), without a word."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(30, 2))
    y = X[:, 0] if n_classes is None else np.arange(30) % n_classes
    cls = PathKernelMachine if n_classes is None else PathKernelClassifier
    est = cls(module=_SqrtHead, max_iter=3, tol=None, random_state=0).fit(X, y)
    Q = np.vstack([X[:3], [[7.0, 0.0], [9.0, 1.0]]])
    with torch.no_grad():
        own = est.module_(torch.as_tensor(Q, dtype=torch.float32)).numpy()
    assert np.isfinite(own[:3]).all() and np.isnan(own[3:]).all()
    verbs = [est.predict] + ([] if n_classes is None else
                             [est.decision_function, est.predict_proba])
    for verb in verbs:
        with pytest.warns(RuntimeWarning, match=r"NaN or inf at 2 of 5 inputs \(rows 3, 4\)"):
            verb(Q)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            verb(Q[:3])
    rec = RecordedNetwork(est.module_, est.trajectory_, X_train=X)
    with pytest.warns(RuntimeWarning, match="NaN or inf at 2 of 5"):
        rec.predict(Q)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_column_target_predicts_1d_as_mlp_regressor(method):
    # scikit-learn's MLPRegressor takes a column y (n, 1) as 1-D, with a
    # DataConversionWarning, and predicts (n,); PathKernelMachine predicted (n, 1).
    rng = np.random.RandomState(0)
    X = rng.normal(size=(20, 3))
    y = X[:, 0] - X[:, 1] ** 2
    mlp = MLPRegressor(hidden_layer_sizes=(4,), max_iter=2, random_state=0)
    with pytest.warns(DataConversionWarning, match="column-vector y"):
        getattr(mlp, method)(X, y[:, None])
    params = dict(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
                  random_state=0)
    with pytest.warns(DataConversionWarning, match="column-vector y"):
        column = getattr(PathKernelMachine(**params), method)(X, y[:, None])
    flat = getattr(PathKernelMachine(**params), method)(X, y)
    assert column.predict(X).shape == mlp.predict(X).shape == (len(X),)
    assert column.n_outputs_ == mlp.n_outputs_ == 1
    assert_array_equal(column.predict(X), flat.predict(X))
    # Two columns stay two, as MLPRegressor's.
    two = PathKernelMachine(**params).fit(X, np.c_[y, -y])
    assert two.predict(X).shape == (len(X), 2)
