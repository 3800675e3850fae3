"""``output="full"``: every C x C block of the tangent and path kernels.

References: dense per-sample Jacobians from a plain autograd loop (tests/_reference.py),
contracted here with ``einsum`` (``K[i, j, c, d] = J_c(x_i) D J_d(y_j)^T``), and for the
path kernel summed over the recorded points with the weights of ``path_weights``.
"""

import copy

import numpy as np
import pytest
from _reference import jacobian_loop, module_at
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import WhiteKernel
from sklearn.kernel_ridge import KernelRidge
from sklearn.svm import SVC
from torch import nn

import skpathkernel._tangent._gram as gram_module
import skpathkernel._tangent._stacked as stacked_module
from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.kernels import (
    PathKernel,
    TangentKernel,
    full_to_matrix,
    matrix_to_full,
    path_weights,
    step_kernel,
)

F64 = dict(dtype="float64", device="cpu", random_state=0)
RTOL = 1e-10


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)
    assert err <= rtol, err


def _cnn(n_features_in, n_outputs):
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, n_outputs))


def _data(kind, n=13, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 1, 6, 6) if kind == "cnn" else (n, 3))
    if kind == "mlp":  # two regression outputs
        return X, np.stack([np.sin(X[:, 0]), X[:, 1] * X[:, 2]], axis=1)
    return X, np.arange(n) % 3


def _fit(kind, solver="sgd", **kw):
    X, y = _data(kind)
    params = dict(solver=solver, max_iter=4, batch_size=5, tol=None,
                  learning_rate_init=0.05 if solver == "sgd" else 0.01, **F64, **kw)
    if kind == "cnn":
        return PathKernelClassifier(module=_cnn, **params).fit(X, y), X
    cls = PathKernelMachine if kind == "mlp" else PathKernelClassifier
    return cls(hidden_layer_sizes=(7, 5), **params).fit(X, y), X


# Budgets that split these small Grams into row blocks (the CNN's formed per-sample
# gradient blocks need 240 kB for one sample's capture).
SMALL = {"mlp": 2**13, "classifier": 2**13, "cnn": 2**19}


def _budgeted(est, kind, budget):
    """The fitted network with its own memory budget: the kernels take it directly (the
    estimators' budget starts at 1 MiB, which these small Grams never fill)."""
    net = copy.copy(est.network_)
    net.memory_budget = SMALL[kind] if budget == "small" else 2**30
    return net


def _blocks(est, point, X, Y, D=None):
    """``(n, m, C, C)`` from the loop's Jacobians at recorded point ``point``."""
    JX = jacobian_loop(module_at(est, point), X).numpy()
    JY = jacobian_loop(module_at(est, point), Y).numpy()
    D = np.ones(JX.shape[2]) if D is None else D
    return np.einsum("ncp,p,mdp->nmcd", JX, D, JY)


@pytest.fixture
def block_sizes(monkeypatch):
    """The row-block sizes the engine chose, to see that a small budget splits X."""
    sizes = []
    original = gram_module._block_size

    def spy(*args, **kwargs):
        sizes.append(original(*args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(gram_module, "_block_size", spy)
    return sizes


@pytest.mark.parametrize("kind, n_outputs", [("mlp", 2), ("cnn", 3), ("classifier", 3)])
@pytest.mark.parametrize("budget", ["large", "small"])
def test_tangent_kernel_full_matches_dense_jacobians(kind, n_outputs, budget, block_sizes):
    est, X = _fit(kind)
    Y = X[:5] + 0.25
    kernel = TangentKernel(_budgeted(est, kind, budget), output="full")
    K = kernel(X)
    assert K.shape == (len(X), len(X), n_outputs, n_outputs) and K.dtype == np.float64
    _close(K, _blocks(est, -1, X, X))
    # K(X, X) is symmetric as a matrix of blocks: K[i, j] = K[j, i]^T.
    np.testing.assert_array_equal(K, K.transpose(1, 0, 3, 2))
    _close(kernel(X, Y), _blocks(est, -1, X, Y))
    _close(kernel.diag(X), np.einsum("iicd->icd", _blocks(est, -1, X, X)))
    # The trace and one output are the blocks' trace and diagonal entries.
    KY = kernel(X, Y)
    _close(TangentKernel(est)(X, Y), np.einsum("nmcc->nm", KY) / n_outputs)
    _close(TangentKernel(est, output=1)(X, Y), KY[:, :, 1, 1])
    if budget == "small":
        assert min(block_sizes) < len(X)  # the small budget did split X into blocks


@pytest.mark.parametrize("kind", ["cnn", "classifier"])
def test_step_kernel_full_preconditioned(kind):
    est, X = _fit(kind, solver="adam")
    Y = X[:4] - 0.1
    D = est.trajectory_.preconditioner(2).numpy()
    K = step_kernel(est, X, Y, step=2, output="full", preconditioned=True)
    _close(K, _blocks(est, 2, X, Y, D))
    with pytest.raises(ValueError, match="scalar kernel"):
        step_kernel(est, X, output="full", normalized=True)


def _path_reference(est, X, Y):
    traj = est.trajectory_
    K = 0.0
    for k, w in path_weights(traj):
        D = traj.preconditioner(k)
        K = K + w * _blocks(est, k, X, Y, None if D is None else D.numpy())
    return K


@pytest.mark.parametrize("kind", ["classifier", "cnn"])
@pytest.mark.parametrize("solver, momentum", [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)])
@pytest.mark.parametrize("budget", ["large", "small"])
def test_path_kernel_full_matches_weighted_sum(kind, solver, momentum, budget,
                                              block_sizes):
    est, X = _fit(kind, solver=solver, momentum=momentum)
    Y = X[:4] + 0.3
    kernel = PathKernel(_budgeted(est, kind, budget), output="full")
    K = kernel(X)
    _close(K, _path_reference(est, X, X))
    _close(kernel(X, Y), _path_reference(est, X, Y))
    _close(kernel.diag(X), np.einsum("iicd->icd", K))
    # The trace kernel (a plain MLP's takes the stacked route) is the blocks' trace.
    _close(PathKernel(est)(X), np.einsum("nmcc->nm", K) / K.shape[2])
    if budget == "small":
        assert min(block_sizes) < len(X)


def test_path_kernel_full_jobs_and_split_steps():
    est, X = _fit("classifier", solver="adam")
    K = PathKernel(est, output="full")(X)
    _close(PathKernel(est, output="full", n_jobs=2)(X), K, 1e-13)
    _close(PathKernel(est, output="full", n_jobs=2, split="steps")(X), K, 1e-13)
    _close(TangentKernel(est, output="full", n_jobs=2).diag(X),
           TangentKernel(est, output="full").diag(X), 1e-13)


def test_full_to_matrix_and_back():
    rng = np.random.RandomState(0)
    K = rng.normal(size=(4, 3, 2, 2))
    G = full_to_matrix(K)
    expected = np.empty((8, 6))
    for i in range(4):
        for j in range(3):
            for c in range(2):
                for d in range(2):
                    expected[i * 2 + c, j * 2 + d] = K[i, j, c, d]
    np.testing.assert_array_equal(G, expected)
    np.testing.assert_array_equal(matrix_to_full(G, 2), K)
    with pytest.raises(ValueError, match="n_X, n_Y, C, C"):
        full_to_matrix(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="multiples"):
        matrix_to_full(np.zeros((5, 4)), 2)
    with pytest.raises(ValueError, match="positive int"):
        matrix_to_full(np.zeros((4, 4)), 0)


def test_full_matrix_is_the_kernel_of_the_flattened_outputs():
    # G = J J^T with the Jacobian of vec(F(X)) = F.reshape(-1): rows (sample, output).
    est, X = _fit("classifier")
    J = jacobian_loop(module_at(est), X).numpy()
    flat = J.reshape(-1, J.shape[2])
    _close(full_to_matrix(TangentKernel(est, output="full")(X)), flat @ flat.T)


def test_scikit_learn_consumers_get_a_clear_error():
    est, X = _fit("classifier")
    y = np.arange(len(X)) % 3
    for kernel in (TangentKernel(est, output="full"), PathKernel(est, output="full")):
        for model in (SVC(kernel=kernel), KernelRidge(kernel=kernel),
                      GaussianProcessRegressor(kernel=kernel, optimizer=None),
                      GaussianProcessRegressor(kernel=kernel + WhiteKernel(), optimizer=None)):
            with pytest.raises(ValueError, match="full_to_matrix"):
                model.fit(X, y)
        with pytest.raises(ValueError, match="scalar kernel"):
            type(kernel)(est, output="full", normalized=True)(X)
    # The documented way: a precomputed matrix of the flattened outputs.
    G = full_to_matrix(TangentKernel(est, output="full")(X))
    Y = np.eye(3)[y].reshape(-1)
    ridge = KernelRidge(kernel="precomputed", alpha=1e-2).fit(G, Y)
    alpha = np.linalg.solve(G + 1e-2 * np.eye(len(G)), Y)
    _close(ridge.dual_coef_, alpha, 1e-8)
    with pytest.raises(ValueError, match="'trace', 'full' or an int"):
        TangentKernel(est, output="blocks")(X)


def test_float32_network_full_blocks():
    X, y = _data("classifier")
    est = PathKernelClassifier(hidden_layer_sizes=(7,), max_iter=3, tol=None, dtype="float32",
                               device="cpu", random_state=0).fit(X, y)
    K = TangentKernel(est, output="full")(X)
    assert K.dtype == np.float64
    # The float64 loop at the float32 parameters: equal to float32 precision.
    _close(K, _blocks(est, -1, X, X), 1e-5)


def test_scikit_learn_consumers_are_found_past_a_subclass_override():
    # A user's subclass whose __call__ / diag add a frame between scikit-learn and the
    # kernel: the consumer is still scikit-learn, and the user's own call still gets the
    # blocks.
    class Logged(TangentKernel):
        def __call__(self, X, Y=None, eval_gradient=False):
            return super().__call__(X, Y, eval_gradient)

        def diag(self, X):
            return super().diag(X)

    est, X = _fit("classifier")
    y = np.arange(len(X)) % 3
    kernel = Logged(est, output="full")
    for model in (SVC(kernel=kernel), GaussianProcessRegressor(kernel=kernel, optimizer=None)):
        with pytest.raises(ValueError, match="full_to_matrix"):
            model.fit(X, y)
    J = jacobian_loop(module_at(est), X).numpy()
    _close(full_to_matrix(kernel(X)), J.reshape(-1, J.shape[2]) @ J.reshape(-1, J.shape[2]).T)
    _close(kernel.diag(X), np.einsum("ncp,ndp->ncd", J, J))


@pytest.mark.parametrize("kind", ["classifier", "mlp"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("budget", [2**30, 2**17])
def test_one_hidden_layer_sgd_full_by_tiles(kind, momentum, budget, monkeypatch):
    # One hidden layer and SGD: the blocks are written tile by tile (_tiles_full). Tiles
    # of 5 rows cut 13 samples raggedly (diagonal tiles split 3 + 2 and 2 + 1); 128 kB
    # sum the 12 points in blocks of 2 to 5, each added to the tiles the first one wrote.
    X, y = _data(kind)
    cls = PathKernelMachine if kind == "mlp" else PathKernelClassifier
    est = cls(hidden_layer_sizes=(6,), solver="sgd", momentum=momentum, max_iter=4,
              batch_size=5, tol=None, learning_rate_init=0.05, **F64).fit(X, y)
    monkeypatch.setattr(stacked_module, "_TILE", 5)
    calls = []
    original = stacked_module._tiles_full

    def spy(K, sides, *args):
        calls.append(sides.fx[0][0].shape[0])  # the block's points
        return original(K, sides, *args)

    monkeypatch.setattr(stacked_module, "_tiles_full", spy)
    net = copy.copy(est.network_)
    net.memory_budget = budget
    kernel = PathKernel(net, output="full")
    Y = X[:6] + 0.3
    K = kernel(X)
    _close(K, _path_reference(est, X, X))
    # Each block symmetric in the outputs and K(X, X) symmetric, exactly.
    np.testing.assert_array_equal(K, K.transpose(1, 0, 3, 2))
    np.testing.assert_array_equal(K, K.transpose(0, 1, 3, 2))
    _close(kernel(X, Y), _path_reference(est, X, Y))
    _close(kernel(Y, X), _path_reference(est, Y, X))
    n_points = len(path_weights(est.trajectory_))
    assert sum(calls) == 3 * n_points
    assert (len(calls) > 3) == (budget < 2**30)  # several blocks of points, or one


def test_float32_one_hidden_layer_sgd_path_full():
    # The tiles sum a block's points in float32 and write float64: float32 precision.
    X, y = _data("classifier", n=70)
    est = PathKernelClassifier(hidden_layer_sizes=(9,), solver="sgd", max_iter=3, tol=None,
                               batch_size=32, dtype="float32", device="cpu",
                               random_state=0).fit(X, y)
    K = PathKernel(est, output="full")(X)
    assert K.dtype == np.float64
    _close(K, _path_reference(est, X, X), 1e-5)
