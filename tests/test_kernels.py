"""TangentKernel / PathKernel against explicit sums of per-sample-loop Grams."""

import pickle
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest
import torch
from _reference import jacobian_loop, module_at
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import WhiteKernel
from sklearn.kernel_ridge import KernelRidge
from sklearn.metrics.pairwise import pairwise_kernels
from sklearn.svm import SVC

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.kernels import PathKernel, TangentKernel, path_weights, step_kernel

RTOL = 1e-10


def _data(n=14, d=2, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, d))
    y = np.sin(2 * X[:, 0]) + X[:, 1] ** 2
    return X, y


def _fit(solver="sgd", momentum=0.0, record_every=1, multi=False, dtype="float64", **kw):
    X, y = _data()
    params = dict(hidden_layer_sizes=(6, 5), solver=solver, momentum=momentum,
                  learning_rate_init=0.05 if solver == "sgd" else 0.01, max_iter=6,
                  record_every=record_every, dtype=dtype, device="cpu", random_state=0, **kw)
    if multi:
        labels = np.digitize(y, np.quantile(y, [0.33, 0.66]))
        return PathKernelClassifier(batch_size=5, **params).fit(X, labels), X
    return PathKernelMachine(**params).fit(X, y), X


def _loop_jacobian(est, point, X):
    """(n, C, P) at recorded point ``point``: the autograd loop of tests/_reference.py."""
    return jacobian_loop(module_at(est, point), X).numpy()


def _loop_gram(est, point, X, Y, D=None, output="trace"):
    JX, JY = _loop_jacobian(est, point, X), _loop_jacobian(est, point, Y)
    D = np.ones(JX.shape[2]) if D is None else D
    full = np.einsum("ncp,p,mdp->ncmd", JX, D, JY)
    if output == "trace":
        return np.einsum("ncmc->nm", full) / JX.shape[1]
    return full[:, output, :, output]


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)
    assert err <= rtol, err


# ----------------------------------------------------------------------- values
@pytest.mark.parametrize("step", [0, 3, -1])
def test_tangent_kernel_matches_loop(step):
    est, X = _fit()
    Y = X[:5] + 0.3
    kernel = TangentKernel(est, step=step)
    K = kernel(X, Y)
    assert K.dtype == np.float64
    _close(K, _loop_gram(est, step, X, Y))
    _close(kernel(X), _loop_gram(est, step, X, X))
    _close(kernel.diag(X), np.diag(_loop_gram(est, step, X, X)))


def _explicit_path_kernel(est, X, Y, *, memory, start=0, stop=None, output="trace"):
    traj = est.trajectory_
    K = 0.0
    for k in list(range(len(traj) - 1))[start:stop]:
        D = traj.preconditioner(k)
        D = None if D is None else D.numpy()
        w = traj.learning_rates[k] * (traj.steps[k + 1] - traj.steps[k]) * memory
        K = K + w * _loop_gram(est, k, X, Y, D, output=output)
    return K


@pytest.mark.parametrize(
    "solver, momentum, memory",
    [("sgd", 0.0, 1.0), ("sgd", 0.5, 2.0), ("adam", 0.0, 1.0), ("adamw", 0.0, 1.0),
     ("rmsprop", 0.0, 1.0)],
)
def test_path_kernel_matches_explicit_sum(solver, momentum, memory):
    # The continuous-time weighting (memory factor 1 / (1 - momentum)); the default,
    # discrete one is checked against a replay of the optimizer in test_weighting.py.
    est, X = _fit(solver, momentum, record_every=2)
    assert np.all(np.diff(est.trajectory_.steps) == 2)  # weights must count the steps
    Y = X[:4] - 0.2
    _close(PathKernel(est, memory="continuous")(X, Y),
           _explicit_path_kernel(est, X, Y, memory=memory))
    _close(PathKernel(est, start=1, stop=-1, memory="continuous")(X, Y),
           _explicit_path_kernel(est, X, Y, memory=memory, start=1, stop=-1))
    K = PathKernel(est)(X)
    _close(np.diag(K), PathKernel(est).diag(X))
    assert np.array_equal(K, K.T)
    eig = np.linalg.eigvalsh(K)
    assert eig.min() >= -1e-10 * eig.max()


def test_path_weights():
    est, _ = _fit("sgd", 0.75, record_every=3)
    traj = est.trajectory_
    weights = path_weights(traj, memory="continuous")
    assert [k for k, _ in weights] == list(range(len(traj) - 1))
    lr = est.learning_rate_init
    expected = [lr * (traj.steps[k + 1] - traj.steps[k]) * 4.0 for k in range(len(traj) - 1)]
    np.testing.assert_allclose([w for _, w in weights], expected, rtol=1e-15)
    with pytest.raises(ValueError, match="empty"):
        PathKernel(est, start=3, stop=3)(np.zeros((2, 2)))


def test_multi_output_kernels():
    est, X = _fit("adam", multi=True)
    assert est.n_outputs_ == 3
    Y = X[:3]
    for output in ("trace", 2):
        _close(TangentKernel(est, output=output)(X, Y),
               _loop_gram(est, -1, X, Y, output=output))
    traj = est.trajectory_
    full = step_kernel(est, X, Y, step=2, output="full", preconditioned=True)
    JX, JY = _loop_jacobian(est, 2, X), _loop_jacobian(est, 2, Y)
    _close(full, np.einsum("ncp,p,mdp->nmcd", JX, traj.preconditioner(2).numpy(), JY))


@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_numpy_integer_output_is_an_output_index(cls):
    # An output index from NumPy (np.argmax, a grid over np.arange(C)) is the int it
    # holds: TangentKernel.diag raised "output must be 'trace', 'full' or an int, got
    # np.int64(2)" where __call__ took it, so GaussianProcessRegressor's return_std failed.
    est, X = _fit("sgd", multi=True)
    if cls is TangentKernel:  # against the autograd loop
        expected = _loop_gram(est, -1, X, X, output=2)
    else:  # plain SGD: every step weighs its learning rate
        expected = _explicit_path_kernel(est, X, X, memory=1.0, output=2)
    kernel = cls(est, output=np.int64(2))
    _close(kernel(X), expected)
    _close(kernel.diag(X), np.diag(expected))
    _close(cls(est, output=np.int64(2), n_jobs=2).diag(X), np.diag(expected))
    if cls is TangentKernel:
        _, target = _data()
        gpr = GaussianProcessRegressor(kernel=kernel + WhiteKernel(0.1, "fixed"),
                                       optimizer=None).fit(X, target)
        _, std = gpr.predict(X[:3], return_std=True)
        # The white noise enters the training covariance (with the GP's alpha=1e-10)
        # and the predicted variance, not the cross-covariance.
        Kw = expected + (0.1 + 1e-10) * np.eye(len(X))
        var = np.diag(expected)[:3] + 0.1 - np.einsum(
            "ij,ji->i", expected[:3], np.linalg.solve(Kw, expected[:, :3]))
        np.testing.assert_allclose(std, np.sqrt(var), rtol=1e-6)


def test_normalized():
    est, X = _fit("rmsprop")
    for kernel in (TangentKernel(est, normalized=True), PathKernel(est, normalized=True)):
        raw = clone(kernel).set_params(normalized=False)
        K, R = kernel(X), raw(X)
        d = np.sqrt(np.diag(R))
        _close(K, R / np.outer(d, d))
        np.testing.assert_allclose(np.diag(K), 1.0, rtol=1e-12)
        np.testing.assert_array_equal(kernel.diag(X), np.ones(len(X)))
        Y = X[:3] * 1.5
        dy = np.sqrt(raw.diag(Y))
        _close(kernel(X, Y), raw(X, Y) / np.outer(d, dy))


def test_float32_estimator():
    est32, X = _fit(dtype="float32")
    K = TangentKernel(est32)(X)
    assert K.dtype == np.float64
    _close(K, _loop_gram(est32, -1, X, X), 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_public_calls_return_the_engines_gram_exactly(dtype):
    # The kernels widen a float32 Gram to float64 as they write it and check their inputs
    # once: the result is the engine's Gram, converted, bit for bit, for every form of
    # the call (cross, one output, preconditioned).
    from skpathkernel._tangent import tangent_gram

    est, X = _fit("adam", multi=True, dtype=dtype)
    net, Y = est.network_, X[:5] * 1.5
    tol = 1e-5 if dtype == "float32" else RTOL
    Xt, Yt = net.tensor(X), net.tensor(Y)

    def engine(Z=None, step=-1, output="trace", D=None):
        K = tangent_gram(net.module, net.trajectory.unflatten(net.trajectory.parameters(step)),
                         Xt, Z, output=output, diag_weight=D)
        assert K.dtype == net.torch_dtype
        return K.double().numpy()

    for output in ("trace", 1):
        kernel = TangentKernel(est, output=output)
        for Z, Zt in ((None, None), (Y, Yt)):
            K = kernel(X, Z)
            assert K.dtype == np.float64
            np.testing.assert_array_equal(K, engine(Zt, output=output))
        # Row blocks give up the symmetry: equal up to round-off.
        _close(TangentKernel(est, output=output, n_jobs=2)(X), engine(output=output), tol)
    R = engine()
    d = np.sqrt(np.diag(R))
    # (normalized: the division rounds differently from the kernel's rsqrt products)
    _close(TangentKernel(est, normalized=True)(X), R / np.outer(d, d), 1e-15)
    D = net.trajectory.preconditioner(2)
    np.testing.assert_array_equal(step_kernel(est, X, Y, step=2, preconditioned=True),
                                  engine(Yt, step=2, D=D))
    full = step_kernel(est, X, step=3, output="full")
    np.testing.assert_array_equal(full, engine(step=3, output="full").transpose(0, 2, 1, 3))
    # And the engine is the loop's Gram.
    _close(full[:, :, 1, 1], _loop_gram(est, 3, X, X, output=1), tol)


# ----------------------------------------------------------------------- sklearn contract
def test_kernel_contract():
    est, X = _fit()
    kernel = TangentKernel(est)
    assert not kernel.is_stationary()
    assert kernel.theta.shape == (0,) and kernel.n_dims == 0
    assert kernel.hyperparameters == []
    K, grad = kernel(X, eval_gradient=True)
    assert grad.shape == (len(X), len(X), 0)
    with pytest.raises(ValueError, match="Gradient"):
        kernel(X, X, eval_gradient=True)
    assert "TangentKernel(PathKernelMachine" in repr(kernel)


def test_clone_keeps_fitted_estimator_and_pickles():
    est, X = _fit("adam")
    for kernel in (TangentKernel(est, step=2), PathKernel(est, start=1)):
        K = kernel(X)
        for other in (clone(kernel), kernel.clone_with_theta(np.array([])),
                      pickle.loads(pickle.dumps(kernel))):
            assert type(other) is type(kernel)
            assert other.get_params(deep=False).keys() == kernel.get_params(deep=False).keys()
            np.testing.assert_array_equal(other(X), K)
        assert clone(kernel).estimator is est


def test_svc_callable_equals_precomputed():
    est, X = _fit("sgd", multi=True)
    _, target = _data()
    y = np.digitize(target, np.quantile(target, [0.33, 0.66]))
    kernel = PathKernel(est, normalized=True)
    Xt = X[:6] + 0.05
    svc = SVC(kernel=kernel, C=10.0).fit(X, y)
    pre = SVC(kernel="precomputed", C=10.0).fit(kernel(X), y)
    np.testing.assert_array_equal(svc.predict(Xt), pre.predict(kernel(Xt, X)))
    np.testing.assert_allclose(svc.decision_function(Xt),
                               pre.decision_function(kernel(Xt, X)), rtol=1e-10)


def test_kernel_ridge_and_gaussian_process():
    est, X = _fit()
    _, y = _data()
    Xt = X[:4] + 0.1
    kernel = TangentKernel(est)
    K, Kt = kernel(X), kernel(Xt, X)
    ridge = KernelRidge(kernel=kernel, alpha=0.1).fit(X, y)
    np.testing.assert_allclose(ridge.predict(Xt), Kt @ np.linalg.solve(K + 0.1 * np.eye(len(X)), y),
                               rtol=1e-8)
    gpr = GaussianProcessRegressor(kernel=kernel + WhiteKernel(0.1, "fixed"),
                                   optimizer=None).fit(X, y)
    # The white noise enters only the training covariance: the posterior mean is ridge's.
    np.testing.assert_allclose(gpr.predict(Xt), ridge.predict(Xt), rtol=1e-8)
    mean, std = gpr.predict(Xt, return_std=True)
    assert np.all(np.isfinite(std)) and std.shape == (4,)
    # The default optimizer calls the kernel with eval_gradient=True through the Sum.
    GaussianProcessRegressor(kernel=kernel + WhiteKernel(0.1), random_state=0).fit(X, y)


def test_a_hyperparameter_search_computes_the_gram_once(monkeypatch):
    """GaussianProcessRegressor's optimizer asks a kernel around the path kernel for
    K(X, X) at every step, each time on a new clone: one Gram is computed, and the fit is
    the one of a precomputed Gram (the kernel's own, recomputed by a fresh copy)."""
    from sklearn.gaussian_process.kernels import ConstantKernel

    est, X = _fit()
    _, y = _data()
    calls = []
    engine = PathKernel._gram_blocks
    monkeypatch.setattr(PathKernel, "_gram_blocks",
                        lambda self, A, B: calls.append(len(A)) or engine(self, A, B))
    kernel = PathKernel(est)
    gpr = GaussianProcessRegressor(kernel=ConstantKernel() * kernel + WhiteKernel(),
                                   random_state=0).fit(X, y)
    assert calls == [len(X)]
    # Against the loop's Gram: the optimum's covariance and the posterior mean.
    G = sum(w * _loop_gram(est, t, X, X) for t, w in path_weights(est.trajectory_))
    amplitude, noise = np.exp(gpr.kernel_.theta)
    np.testing.assert_allclose(gpr.kernel_(X), amplitude * G + noise * np.eye(len(X)),
                               rtol=1e-8)
    Xt = X[:4] + 0.1
    Kt = amplitude * sum(w * _loop_gram(est, t, Xt, X)
                         for t, w in path_weights(est.trajectory_))
    alpha = np.linalg.solve(amplitude * G + (noise + 1e-10) * np.eye(len(X)), y)
    np.testing.assert_allclose(gpr.predict(Xt), Kt @ alpha, rtol=1e-6)


def test_a_search_after_set_params_memory_budget_computes_the_gram_once(monkeypatch):
    """After set_params(memory_budget=...) on the fitted estimator, network_of gives a
    new copy of its network at every call, and the memo never hit: one Gram per optimizer
    step. The memo's Gram is the one a fresh kernel (no memo) computes at that budget, bit
    for bit, and another budget, whose blocks round differently, gets its own."""
    from sklearn.gaussian_process.kernels import ConstantKernel

    est, X = _fit(dtype="float32")
    _, y = _data()
    calls = []
    engine = PathKernel._gram_blocks
    monkeypatch.setattr(PathKernel, "_gram_blocks",
                        lambda self, A, B: calls.append(len(A)) or engine(self, A, B))
    est.set_params(memory_budget=2**16)
    GaussianProcessRegressor(kernel=ConstantKernel() * PathKernel(est) + WhiteKernel(),
                             random_state=0).fit(X, y)
    assert calls == [len(X)]
    kernel = PathKernel(est)
    small, _ = kernel(X, eval_gradient=True)
    assert np.array_equal(kernel(X, eval_gradient=True)[0], small) and len(calls) == 2
    assert np.array_equal(small, PathKernel(est)(X))
    est.set_params(memory_budget=2**20)
    large, _ = kernel(X, eval_gradient=True)
    assert len(calls) == 4 and np.array_equal(large, PathKernel(est)(X))
    assert not np.array_equal(large, small)  # (else the test could not tell them apart)


def test_the_search_memo_follows_its_rows_parameters_and_network():
    est, X = _fit()
    kernel = PathKernel(est)
    K, _ = kernel(X, eval_gradient=True)
    K[0, 0] = 1e9                                  # the caller's array, not the memo
    _close(kernel(X), PathKernel(est)(X))
    X2 = X.copy()
    X2[3, 1] += 0.5
    _close(kernel(X2), PathKernel(est)(X2))
    _close(kernel.set_params(normalized=True)(X), PathKernel(est, normalized=True)(X))
    kernel.set_params(normalized=False)
    refit = clone(est).set_params(random_state=1).fit(X, _data()[1])
    _close(kernel.set_params(estimator=refit)(X), PathKernel(refit)(X))
    # The memo is this process's cache: not pickled.
    assert "_gram_memo" not in pickle.loads(pickle.dumps(kernel)).__dict__


def test_the_search_memo_follows_the_modules_buffers():
    # Eval-mode BatchNorm reads its running statistics from the module, not the path: a
    # module changed in place after the search's first call must not get the old Gram.
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(30, 2)), rng.normal(size=30)
    est = PathKernelMachine(
        module=lambda n_in, n_out: torch.nn.Sequential(
            torch.nn.Linear(n_in, 8), torch.nn.BatchNorm1d(8).eval(), torch.nn.Tanh(),
            torch.nn.Linear(8, n_out)),
        max_iter=5, tol=None, random_state=0).fit(X, y)
    for kernel_class in (TangentKernel, PathKernel):
        kernel = kernel_class(est)
        before, _ = kernel(X, eval_gradient=True)
        est.network_.module[1].running_var.mul_(3)
        after = kernel_class(est)(X)
        assert np.abs(after - before).max() > 1e-2
        _close(kernel(X), after)
        est.network_.module[1].running_var.div_(3)


def _bn_frozen_machine():
    # Eval-mode BatchNorm and a frozen layer: what the Gram reads from the module, not
    # from the path.
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(30, 2)), rng.normal(size=30)

    def module(n_in, n_out):
        net = torch.nn.Sequential(
            torch.nn.Linear(n_in, 8), torch.nn.BatchNorm1d(8).eval(), torch.nn.Tanh(),
            torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, n_out))
        net[3].requires_grad_(False)
        return net

    est = PathKernelMachine(module=module, max_iter=5, tol=None, random_state=0,
                            dtype="float64").fit(X, y)
    return est, X


@pytest.mark.parametrize("kernel_class", [TangentKernel, PathKernel])
@pytest.mark.parametrize("change", ["buffer .data", "frozen .data", "eps", "layer"])
def test_the_search_memo_follows_the_module_beyond_version_counters(kernel_class, change):
    """``p.data`` edits keep the version counters, and a layer's setting or the layer
    itself is no tensor: the memo answered them with the old Gram."""
    est, X = _bn_frozen_machine()
    module = est.network_.module
    kernel = kernel_class(est)
    before, _ = kernel(X, eval_gradient=True)
    if change == "buffer .data":
        module[1].running_var.data.mul_(3)
    elif change == "frozen .data":
        module[3].weight.data.mul_(2)
    elif change == "eps":
        module[1].eps = 0.5
    else:
        module[2] = torch.nn.ReLU()
    after = kernel_class(est)(X)                   # a kernel without a memo
    assert np.abs(after - before).max() > 1e-2 * np.abs(before).max()
    _close(kernel(X), after)
    _close(kernel(X, eval_gradient=True)[0], after)


def test_the_search_memo_does_not_answer_for_a_module_in_training_mode():
    est, X = _bn_frozen_machine()
    kernel = PathKernel(est)
    kernel(X, eval_gradient=True)
    est.network_.module.train()
    with pytest.raises(ValueError, match="training mode"):
        kernel(X)


def test_the_search_memo_keeps_no_refitted_network_alive():
    # The memo of a kernel that outlives a refit held the old network, path included.
    import gc
    import weakref

    est, X = _fit()
    kernel = PathKernel(est)
    kernel(X, eval_gradient=True)
    old = weakref.ref(est.network_.trajectory)
    est.set_params(random_state=1).fit(X, _data()[1])
    gc.collect()
    assert old() is None
    _close(kernel(X), PathKernel(est)(X))


def test_a_threaded_search_computes_one_gram_per_fit(monkeypatch):
    """GridSearchCV's threads fit clones of one kernel on different folds: each fit
    computes its Gram once (a memo shared by the clones evicted the other threads' Gram
    at every optimizer step), and each gets its own rows' Gram."""
    from joblib import parallel_backend
    from sklearn.gaussian_process.kernels import ConstantKernel
    from sklearn.model_selection import GridSearchCV, KFold

    est, _ = _fit()
    X, y = _data(n=30)
    grams = []
    engine = PathKernel._gram_blocks

    def counted(self, A, B):
        K = engine(self, A, B)
        if B is None:
            grams.append((A.copy(), K))
        return K

    monkeypatch.setattr(PathKernel, "_gram_blocks", counted)
    search = GridSearchCV(
        GaussianProcessRegressor(ConstantKernel() * PathKernel(est) + WhiteKernel(),
                                 random_state=0),
        {"alpha": [1e-10, 1e-3]}, cv=3, n_jobs=2)
    with parallel_backend("threading"):
        search.fit(X, y)
    assert len(grams) == 2 * 3 + 1
    # The Grams computed are of each fit's own rows (the folds' training rows, once per
    # alpha, then all of X for the refit), each against the autograd loop's: a memo
    # answering a fit with another fold's Gram leaves one of them out.
    folds = [X[train] for train, _ in KFold(3).split(X)]
    assert sorted(A.tobytes() for A, _ in grams) == sorted(
        [A.tobytes() for A in folds] * 2 + [X.tobytes()])
    for A, K in grams:
        _close(K, sum(w * _loop_gram(est, t, A, A) for t, w in path_weights(est.trajectory_)))


def test_input_validation():
    est, X = _fit()
    kernel = PathKernel(est)
    with pytest.raises(ValueError, match="NaN|infinity"):
        kernel(np.array([[np.nan, 0.0]]))
    with pytest.raises(ValueError, match="3 features"):
        kernel(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="2D"):
        kernel.diag(np.zeros(3))
    with pytest.raises(ValueError, match="output"):
        TangentKernel(est, output="all")(X)
    with pytest.raises(IndexError, match="step"):
        TangentKernel(est, step=1000)(X)
    with pytest.raises(NotFittedError):
        TangentKernel(PathKernelMachine())(X)


def test_grid_search_clones_the_kernel_with_its_estimator():
    from sklearn.model_selection import GridSearchCV

    est, X = _fit("sgd", multi=True)
    _, target = _data()
    y = np.digitize(target, np.quantile(target, [0.5]))
    search = GridSearchCV(SVC(kernel=TangentKernel(est, normalized=True)), {"C": [0.1, 10.0]},
                          cv=2).fit(X, y)
    assert search.best_estimator_.kernel.estimator is est
    assert search.predict(X).shape == (len(X),)


@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_setting_the_estimators_parameters_through_the_kernel_is_refused(cls):
    """``kernel__estimator__<name>`` in a search would set a parameter of the one fitted
    estimator that every clone of the kernel shares, refit nothing, and give every
    candidate the same Gram; it is refused, the estimator's parameters untouched."""
    from sklearn.frozen import FrozenEstimator
    from sklearn.model_selection import GridSearchCV, KFold

    est, X = _fit("sgd", multi=True)
    _, target = _data()
    y = np.digitize(target, np.quantile(target, [0.33, 0.66]))
    before = est.get_params()
    kernel = cls(est)
    with pytest.raises(ValueError, match="estimator__alpha.*would not refit"):
        clone(kernel).set_params(step=0, estimator__alpha=0.5)
    search = GridSearchCV(SVC(kernel=kernel), {"kernel__estimator__alpha": [0.0, 0.5]}, cv=2,
                          error_score="raise")
    with pytest.raises(ValueError, match="estimator__alpha"):
        search.fit(X, y)
    assert est.get_params() == before
    # The kernel's own parameters, and another fitted estimator, are still set.
    other = clone(est).set_params(random_state=1, tol=None).fit(X, y)
    assert clone(kernel).set_params(estimator=other, normalized=True).estimator is other
    np.testing.assert_allclose(clone(kernel).set_params(estimator=other)(X[:4]),
                               cls(other)(X[:4]), rtol=1e-12)
    # The search the user guide shows: fitted networks as frozen candidates, each scored
    # as an SVC on its precomputed Gram.
    search = GridSearchCV(SVC(kernel=kernel), {"kernel__estimator": [FrozenEstimator(est),
                                                                    FrozenEstimator(other)]},
                          cv=KFold(2), error_score="raise").fit(X, y)
    for candidate, score in zip((est, other), search.cv_results_["mean_test_score"]):
        K = cls(candidate)(X)
        folds = [SVC(kernel="precomputed").fit(K[np.ix_(tr, tr)], y[tr])
                 .score(K[np.ix_(te, tr)], y[te]) for tr, te in KFold(2).split(X)]
        assert score == pytest.approx(np.mean(folds), abs=1e-12)


@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_a_small_kernel_runs_on_one_thread_and_restores_the_callers(cls, monkeypatch):
    # As a user calls it (SVC(kernel=...) calls it the same way): below the work
    # threshold on one torch thread, above it on the caller's, the same K either way,
    # against the per-sample autograd loop.
    import torch

    from skpathkernel import kernels

    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(20, 2))
    y = np.sin(3 * X[:, 0])
    est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=3, dtype="float64",
                            random_state=0).fit(X, y)
    seen = []

    def spy(self, *a, _gram=cls._gram, **k):
        seen.append(torch.get_num_threads())
        return _gram(self, *a, **k)

    monkeypatch.setattr(cls, "_gram", spy)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = cls(est)(X[:5], X)
        after = torch.get_num_threads()
        monkeypatch.setattr(kernels, "KERNEL_SINGLE_THREAD_WORK", 0)
        large = cls(est)(X[:5], X)
    finally:
        torch.set_num_threads(previous)
    assert seen == [1, 2] and after == 2
    np.testing.assert_allclose(small, large, rtol=1e-12, atol=1e-14)
    if cls is TangentKernel:
        J5, J = (_loop_jacobian(est, -1, Z)[:, 0] for Z in (X[:5], X))
        np.testing.assert_allclose(small, J5 @ J.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", [TangentKernel, PathKernel, lambda est: step_kernel],
                         ids=["TangentKernel", "PathKernel", "step_kernel"])
def test_dataframe_columns_are_checked_against_the_fit_feature_names(kernel):
    # A DataFrame whose columns are in another order than at fit is another input: the
    # estimator's verbs refuse it, and so must its kernels (they computed on the
    # columns by position, a silently wrong Gram).
    X, y = _data(n=8, d=3)
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, tol=None, dtype="float64",
                            random_state=0).fit(df, y)
    k = kernel(est)
    call = (lambda Z, W=None: k(est, Z, W)) if k is step_kernel else k
    J = jacobian_loop(module_at(est, -1), X)[:, 0]
    if kernel is TangentKernel:  # against the autograd loop: K = J J^T
        np.testing.assert_allclose(call(df), (J @ J.T).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(call(df), call(X))  # the names in order change nothing
    for bad in (df[["c", "b", "a"]], df.rename(columns={"a": "z"})):
        with pytest.raises(ValueError, match="feature names"):
            call(bad)
        with pytest.raises(ValueError, match="feature names"):
            call(X, bad)
    with warnings.catch_warnings():
        # SVC hands the kernel NumPy arrays: no warning about their lack of names.
        warnings.simplefilter("error")
        SVC(kernel=est.tangent_kernel_).fit(df, y > np.median(y))


def test_a_dataframe_for_an_estimator_fitted_without_names_is_taken_silently():
    # As its verbs take it (a RecordedNetwork holds no feature names): no warning.
    X, y = _data(n=8, d=3)
    est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, tol=None, dtype="float64",
                            random_state=0).fit(X, y)
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(TangentKernel(est)(df), TangentKernel(est)(X))


def _threaded_calls(call, n_threads=4, rounds=20):
    """``call()`` from ``n_threads`` threads released together, ``rounds`` times over;
    the first exception raised is raised here, after every thread has finished."""
    barrier = threading.Barrier(n_threads)

    def task(_):
        results = []
        for _ in range(rounds):
            try:
                barrier.wait(timeout=60)
                results.append(call())
            except Exception as exc:  # the other threads must not wait for this one
                barrier.abort()
                return exc
        return results

    with ThreadPoolExecutor(n_threads) as pool:
        outcomes = list(pool.map(task, range(n_threads)))
    for outcome in outcomes:
        if isinstance(outcome, Exception) and not isinstance(outcome,
                                                             threading.BrokenBarrierError):
            raise outcome
    return [r for outcome in outcomes for r in outcome]


# Each of them saw the other calls' parameters: "the stacked route computes outputs that
# differ from the module's by 0.21", "torch.func's per-sample Jacobian ... disagrees".
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_concurrent_calls_from_threads_match_the_loop(cls):
    # pairwise_kernels(n_jobs=...) and KernelPCA(n_jobs=...) call a kernel from joblib's
    # threads, all on one estimator. Its network's module is hooked by the engine at each
    # call: shared by concurrent calls, they raised "One of the differentiated Tensors
    # does not require grad" or returned Grams off by 50% without a word.
    X, y = _data(n=40)
    est = PathKernelMachine(hidden_layer_sizes=(16, 16), solver="sgd", learning_rate_init=0.05,
                            max_iter=3, tol=None, dtype="float64", device="cpu",
                            random_state=0).fit(X, y)
    kernel = cls(est)
    if cls is TangentKernel:  # against the autograd loop: K = J J^T
        expected = _loop_gram(est, -1, X, X)
    else:
        expected = _explicit_path_kernel(est, X, X, memory=1.0)  # plain SGD
    for K in _threaded_calls(lambda: kernel(X)):
        _close(K, expected)
    for K in _threaded_calls(lambda: kernel(X[:10], X)):
        _close(K, expected[:10])
    for d in _threaded_calls(lambda: kernel.diag(X)):
        _close(d, np.diag(expected))
    _close(pairwise_kernels(X, metric=kernel, n_jobs=4), expected)


@pytest.mark.parametrize("solver", ["sgd", "nesterov", "adam"])
@pytest.mark.parametrize("kw", [{}, {"n_jobs": 2, "split": "steps"}])
def test_path_kernel_weighs_group_step_sizes_where_momentum_carries_the_gradient(solver, kw):
    """Parameter groups on their own schedules (a LambdaLR per group) with momentum: a
    step's gradient moves group g's parameters in the later updates at those updates'
    step sizes of g. The kernel scaled it by its own step's group ratio instead: 0.16
    off the optimizer's replayed weights (SGD, momentum 0.7), 0.03 with Adam."""
    from skpathkernel import PathRecorder

    torch.manual_seed(0)
    X, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                              torch.nn.Linear(5, 1)).double()
    groups = [{"params": net[0].parameters(), "lr": 0.1},
              {"params": net[2].parameters(), "lr": 0.03}]
    mu, b1 = 0.7, 0.9
    opt = (torch.optim.Adam(groups, lr=0.1, betas=(b1, 0.999)) if solver == "adam" else
           torch.optim.SGD(groups, lr=0.1, momentum=mu, nesterov=solver == "nesterov"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5**e])
    params = list(net.parameters())
    group_of = torch.cat([torch.full((p.numel(),), 0 if i < 2 else 1)
                          for i, p in enumerate(params)])
    T, points, lrs, D = 6, [], [], []
    with PathRecorder(net, opt, n_samples=16) as rec:
        for t in range(T):
            points.append([p.detach().clone() for p in params])
            idx = torch.arange(4) + 4 * (t % 4)
            opt.zero_grad()
            (0.5 * (net(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            lrs.append(torch.tensor([g["lr"] for g in opt.param_groups],
                                    dtype=torch.float64)[group_of])
            opt.step()
            if solver == "adam":
                v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
                D.append(1 / ((v / (1 - 0.999 ** (t + 1))).sqrt() + 1e-8))
            else:
                D.append(torch.ones(len(group_of), dtype=torch.float64))
            sched.step()
    # The replayed weight of step s's gradient, per parameter: every later update's step
    # size times the gradient's share in it (its momentum buffer / Adam's first moment).
    ref = 0.0
    for s in range(T):
        if solver == "adam":
            W = sum(lrs[t] * (1 - b1) * b1 ** (t - s) / (1 - b1 ** (t + 1)) for t in range(s, T))
        else:
            W = sum(lrs[t] * mu ** (t - s) for t in range(s, T))
            if solver == "nesterov":
                W = lrs[s] + mu * W
        with torch.no_grad():
            for p, value in zip(params, points[s]):
                p.copy_(value)
        J = torch.from_numpy(jacobian_loop(net, X.numpy())[:, 0].numpy())
        ref = ref + ((J * (W * D[s])) @ J.T).numpy()
    _close(PathKernel(rec.as_estimator(X, y), **kw)(X.numpy()), ref, rtol=1e-12)


def test_path_kernel_range_bounds_are_a_slices():
    """start and stop are documented as "int or None" with slice semantics: start=None
    was refused ("start must be an int, got None."), and path_weights took a bool start
    or stop for 0 or 1 silently."""
    est, X = _fit()
    n_points = len(est.trajectory_) - 1
    np.testing.assert_array_equal(PathKernel(est, start=None)(X), PathKernel(est)(X))
    np.testing.assert_array_equal(PathKernel(est, start=None, stop=2).diag(X),
                                  PathKernel(est, start=0, stop=2).diag(X))
    assert [k for k, _ in path_weights(est.trajectory_, None, None)] == list(range(n_points))
    for bounds in ({"start": True}, {"stop": False}, {"start": 1.0}, {"stop": "2"}):
        with pytest.raises(TypeError, match="must be an int or None"):
            path_weights(est.trajectory_, **bounds)
    with pytest.raises(TypeError, match="start must be an int or None"):
        PathKernel(est, start=True)(X)


def test_path_weights_refuses_what_is_not_a_trajectory():
    # The estimator instead of its trajectory_ failed with an AttributeError about .steps.
    est, _ = _fit()
    for wrong in (est, np.zeros(3), None):
        with pytest.raises(TypeError, match="trajectory must be a Trajectory.*trajectory_"):
            path_weights(wrong)
    assert path_weights(est.trajectory_) == path_weights(est.trajectory_, 0, None)


@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_y_that_is_x_is_the_symmetric_gram(cls):
    """SVC's fit calls kernel(X, X) with Y the same object as X: the general route took
    2.7 times as long as kernel(X) for a path kernel and gave a Gram asymmetric by
    round-off (1e-7 of a float32 network's largest entry, 1e-14 in float64), so SVC
    trained on another matrix than kernel(X). scikit-learn's pairwise functions take
    Y is X as K(X, X)."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(200, 5))
    y = np.sin(3 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(32, 32), solver="adam", max_iter=3,
                            batch_size=50, tol=None, dtype="float32", device="cpu",
                            random_state=0).fit(X, y)
    kernel = cls(est)
    K = kernel(X, X)
    assert np.array_equal(K, K.T)
    assert np.array_equal(K, kernel(X))
    assert np.array_equal(step_kernel(est, X, X, preconditioned=True),
                          step_kernel(est, X, preconditioned=True))
    # A copy of X is other rows as far as identity goes: the same numbers up to round-off.
    _close(kernel(X, X.copy()), K, rtol=1e-6)
    labels = (y > np.median(y)).astype(int)
    svc = SVC(kernel=kernel).fit(X, labels)
    pre = SVC(kernel="precomputed").fit(K, labels)
    np.testing.assert_array_equal(svc.dual_coef_, pre.dual_coef_)


@pytest.mark.parametrize("kernel", [TangentKernel, PathKernel])
@pytest.mark.parametrize("n_jobs", [None, 2])
def test_normalized_gram_is_a_cosine_matrix_to_the_last_bit(kernel, n_jobs):
    """A normalized K(X) is exactly symmetric with an exact unit diagonal and entries in
    [-1, 1] (Cauchy-Schwarz), on a float32 network, as its float64 loop reference is
    to rounding; row blocks on two workers too (their triangles rounded apart)."""
    est, X = _fit(solver="adam", dtype="float32")
    X = np.vstack([X, X[:3]])  # duplicated rows: cosine 1, where rounding overstepped
    K = kernel(est, normalized=True, n_jobs=n_jobs)(X)
    np.testing.assert_array_equal(K, K.T)
    np.testing.assert_array_equal(np.diag(K), 1.0)
    assert np.abs(K).max() <= 1.0
    if kernel is TangentKernel:
        G = _loop_gram(est, -1, X, X)
        d = np.sqrt(np.diag(G))
        _close(K, G / np.outer(d, d), rtol=1e-6)


def test_a_gram_that_overflows_its_dtype_is_refused():
    """A float32 ReLU network's features grow linearly with the input: at 1e20 the Gram
    and its factors reach float32's range (3.4e38). It held inf without a word while
    predict stayed finite; float64 holds it, as the loop reference gives it."""
    X = np.linspace(0, 1, 20)[:, None]
    Q = np.array([[1e20], [0.5]])
    fits = {dtype: PathKernelMachine(hidden_layer_sizes=(6,), activation="relu", max_iter=5,
                                     dtype=dtype, random_state=0).fit(X, 2 * X[:, 0] + 1)
            for dtype in ("float32", "float64")}
    assert np.isfinite(fits["float32"].predict(Q)).all()
    # The kernel itself is near float32's largest value (the structured route's
    # factors, ||x||^2 = 1e40 among them, pass it).
    J = _loop_jacobian(fits["float32"], -1, Q)[:, 0]
    assert np.einsum("np,np->n", J, J)[0] > 1e36
    for call in (lambda e: TangentKernel(e)(Q), lambda e: TangentKernel(e).diag(Q),
                 lambda e: step_kernel(e, Q), lambda e: PathKernel(e)(Q)):
        with pytest.raises(ValueError, match="non-finite entries.*float32.*dtype='float64'"):
            call(fits["float32"])
        assert np.isfinite(call(fits["float64"])).all()
    _close(TangentKernel(fits["float64"])(Q), _loop_gram(fits["float64"], -1, Q, Q),
           rtol=1e-12)


def test_a_normalized_gram_whose_norm_overflows_is_refused_not_read_as_dead():
    """The normalised kernels divide by the diagonal: a squared norm that overflowed to inf
    gave scale 0, the dead network's, and cosines 0 (1 on the diagonal) that passed the
    finiteness check."""
    X = np.linspace(0, 1, 20)[:, None]
    Q = np.array([[1e20], [0.5]])
    est = PathKernelMachine(hidden_layer_sizes=(6,), activation="relu", max_iter=5,
                            dtype="float32", random_state=0).fit(X, 2 * X[:, 0] + 1)
    for call in (lambda: TangentKernel(est, normalized=True)(Q),
                 lambda: TangentKernel(est, normalized=True)(Q, X[:3]),
                 lambda: step_kernel(est, Q, normalized=True),
                 lambda: PathKernel(est, normalized=True)(Q)):
        with pytest.raises(ValueError, match="non-finite entries.*float32"):
            call()


def test_a_float64_gram_that_overflows_is_refused_without_suggesting_float64():
    """The refusal named dtype='float64' as the way out to a network fitted in float64."""
    X = np.linspace(0, 1, 20)[:, None]
    est = PathKernelMachine(hidden_layer_sizes=(6,), activation="relu", max_iter=5,
                            dtype="float64", random_state=0).fit(X, 2 * X[:, 0] + 1)
    with pytest.raises(ValueError, match="non-finite entries.*float64") as info:
        TangentKernel(est)(np.array([[1e160], [0.5]]))
    assert "dtype='float64'" not in str(info.value)
    assert "Scale the inputs" in str(info.value)


class _MaskedAttention(torch.nn.Module):
    """Token ids (0 pads) through a hand-written attention that masks the padding keys
    with -inf: a sequence of padding alone has every key masked, a softmax of -inf only,
    NaN in any dtype."""

    def __init__(self, n_out, vocab=6, d=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.head = torch.nn.Linear(d, n_out)

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill((ids == 0)[:, None, :], float("-inf"))
        return self.head((scores.softmax(-1) @ v).mean(1))


def test_a_gram_of_a_network_that_returns_nan_names_its_outputs_not_overflow():
    """At a sequence of padding alone the module's own output is NaN; the refusal said the
    features overflowed float32 and advised dtype='float64', which computes the same NaN."""
    rng = np.random.RandomState(0)
    X = rng.randint(1, 6, size=(20, 4))
    est = PathKernelMachine(module=lambda n_in, n_out: _MaskedAttention(n_out), max_iter=2,
                            tol=None, dtype="float64", random_state=0).fit(X, X.mean(axis=1))
    Q = np.vstack([X[:2], np.zeros((1, 4), dtype=np.int64)])
    with torch.no_grad():
        assert torch.isnan(est.module_(torch.as_tensor(Q[2:]))).all()
    for call in (lambda: TangentKernel(est)(Q), lambda: TangentKernel(est).diag(Q),
                 lambda: TangentKernel(est)(X, Q), lambda: step_kernel(est, Q),
                 lambda: PathKernel(est)(Q), lambda: PathKernel(est, normalized=True)(Q)):
        with pytest.raises(ValueError, match="own outputs are NaN or inf at 1 of") as info:
            call()
        assert "overflow" not in str(info.value)
    assert np.isfinite(TangentKernel(est)(Q[:2])).all()


@pytest.mark.parametrize("cls", [TangentKernel, PathKernel])
def test_row_split_full_gram_averages_with_the_block_transpose(cls):
    """K(X) split into row blocks (n_jobs) is made symmetric by its mean with the
    transpose: for output="full", the (n, n, C, C) blocks' transpose K[j, i] = K[i, j]^T,
    which the 2-D transpose failed to broadcast against."""
    est, X = _fit("adam", multi=True, dtype="float64")
    serial = cls(est, output="full")(X)
    assert serial.ndim == 4 and serial.shape[2] > 1
    split = cls(est, output="full", n_jobs=2)(X)
    _close(split, serial, RTOL)
    np.testing.assert_array_equal(split, split.transpose(1, 0, 3, 2))


def test_the_finiteness_check_warns_of_nothing_and_refuses_as_before():
    """The check sums K first: inf and -inf entries (an overflowed Gram's off-diagonal
    entries take both signs) summed to NaN with a RuntimeWarning before the refusal, and
    a finite K whose sum overflows came back with one."""
    from skpathkernel import kernels

    est, X = _fit()
    net = kernels.network_of(est)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = np.array([[np.inf, -np.inf], [-np.inf, np.inf]])
        with pytest.raises(ValueError, match="The kernel has 4 non-finite entries"):
            kernels._check_finite(K, net)
        big = np.full((3, 3), 1e308)
        assert kernels._check_finite(big, net) is big


def test_gaussian_process_needs_float64_or_an_alpha_above_float32_round_off():
    # What the kernels page tells a GaussianProcessRegressor user: a singular Gram (more
    # points than parameters) of a float32 network has negative eigenvalues at float32's
    # round-off, below the regressor's default alpha=1e-10, so its Cholesky fails; float64
    # or an alpha of a small fraction of the trace works. If the engine ever makes float32
    # Grams PSD to float64's precision, this fails and the page's advice is to be revised.
    Xr = np.linspace(-2, 2, 120).reshape(-1, 1)
    yr = np.sin(2 * Xr).ravel()
    params = dict(hidden_layer_sizes=(16,), max_iter=20, tol=None, random_state=0)
    reg32 = PathKernelMachine(dtype="float32", **params).fit(Xr, yr)
    reg64 = PathKernelMachine(dtype="float64", **params).fit(Xr, yr)
    assert reg32.n_params_ < len(Xr)
    K = PathKernel(reg32)(Xr)
    eig = np.linalg.eigvalsh(K)
    # Negative, and of float32's round-off (not float64's, not an error of the kernel).
    assert -1e-5 * eig.max() < eig.min() < -100 * np.finfo(np.float64).eps * eig.max()
    with pytest.raises(np.linalg.LinAlgError, match="not returning a positive definite"):
        GaussianProcessRegressor(kernel=PathKernel(reg32)).fit(Xr, yr)
    gpr = GaussianProcessRegressor(kernel=PathKernel(reg32), alpha=1e-6 * np.trace(K))
    assert gpr.fit(Xr, yr).score(Xr, yr) > 0.9
    assert GaussianProcessRegressor(kernel=PathKernel(reg64)).fit(Xr, yr).score(Xr, yr) > 0.9
