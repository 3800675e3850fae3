"""The kernel-machine decomposition against independent references.

The brute-force reference runs the optimizer's recursion FORWARD, keeping every training
sample's own share of the momentum / Adam buffer, with Jacobians from a plain per-sample
autograd loop; the library runs a backward adjoint recursion on structured Jacobians.
"""

import copy

import numpy as np
import pytest
import torch
from _reference import jacobian_loop, module_at
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernelClassifier, PathKernelMachine

# The old defaults, pinned: the targets as given, exactly max_iter epochs (the references
# replay that path), tanh; OLD adds the old solver for the calls that name none.
RAW = dict(normalize_y=False, tol=None, activation="tanh")
OLD = dict(RAW, solver="sgd")

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate_init=0.1),
    "sgd-momentum-l2": dict(solver="sgd", learning_rate_init=0.05, momentum=0.9, alpha=0.01),
    "adam-l2": dict(solver="adam", learning_rate_init=0.01, alpha=0.01),
    "adamw": dict(solver="adamw", learning_rate_init=0.01, alpha=0.1),
    "rmsprop-l2": dict(solver="rmsprop", learning_rate_init=0.005, alpha=0.01),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    return X, np.sin(3 * X[:, 0]) + X[:, 1], rng.uniform(-1, 1, size=(3, 2))


def _module_at(est, k):
    return module_at(est, k)


def _jacobian_loop(module, X):
    """(n, C, P) Jacobian by one autograd call per sample and output."""
    return jacobian_loop(module, X)


def _brute_force(est, X_train, Y_train, per_sample_loss, X, n_nodes=6):
    """Contributions (n, N, C) and regularization (n, C) by the forward per-sample recursion."""
    traj, spec = est.trajectory_, est.trajectory_.solver_spec
    N, P = len(X_train), traj.n_params
    s, w = np.polynomial.legendre.leggauss(n_nodes)
    s, w = (s + 1) / 2, w / 2
    shares = torch.zeros(N, P, dtype=torch.float64)  # each sample's part of the buffer
    reg_buf = torch.zeros(P, dtype=torch.float64)
    memory = {"sgd": spec.momentum, "adam": spec.beta_1, "adamw": spec.beta_1}.get(spec.name, 0.0)
    n_out = est.n_outputs_
    contrib = np.zeros((len(X), N, n_out))
    reg = np.zeros((len(X), n_out))
    for t, batch in enumerate(traj.batches):
        theta, nxt = traj.parameters(t).double(), traj.parameters(t + 1).double()
        module = _module_at(est, t)
        adam_factor = 1 - memory if spec.name in ("adam", "adamw") else 1
        for i in batch:
            out = module(torch.as_tensor(X_train[i : i + 1]))
            loss = per_sample_loss(out, Y_train[i : i + 1]).sum()
            grads = torch.autograd.grad(loss, list(module.parameters()))
            g = torch.cat([p.reshape(-1) for p in grads])
            shares[i] += g.detach() / len(batch) * adam_factor
        if spec.name != "adamw":  # AdamW's decay is decoupled: added to the step below
            reg_buf += spec.weight_decay * theta * adam_factor
        lr = traj.learning_rates[t]
        scale = lr / (1 - spec.beta_1 ** (t + 1)) if spec.name in ("adam", "adamw") else lr
        D = traj.preconditioner(t)
        D = torch.ones(P, dtype=torch.float64) if D is None else D.double()
        step_i = -scale * D * shares  # (N, P): sample i's part of this step
        step_reg = -scale * D * reg_buf
        if spec.name == "adamw":
            step_reg = step_reg - lr * spec.weight_decay * theta
        # Segment-averaged Jacobian of the queries by plain autograd at each node.
        Jbar = sum(wk * _jacobian_loop(_module_with(est, theta + sk * (nxt - theta)), X)
                   for sk, wk in zip(s, w))
        contrib += torch.einsum("qcp,np->qnc", Jbar, step_i).numpy()
        reg += torch.einsum("qcp,p->qc", Jbar, step_reg).numpy()
        shares *= memory
        reg_buf *= memory
    return contrib, reg


def _module_with(est, flat):
    module = copy.deepcopy(est.module_)
    module.load_state_dict(est.trajectory_.unflatten(flat))
    return module


def _squared(out, y):
    return 0.5 * (out - y).pow(2).mean(dim=1)


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("batch_size", [None, 5])
def test_exact_contributions_equal_brute_force(data, name, batch_size):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(6,), max_iter=3, batch_size=batch_size,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, y)
    res = est.decompose(X)
    Y = torch.as_tensor(y).reshape(-1, 1)
    contrib, reg = _brute_force(est, X_train, Y, _squared, X)
    scale = np.abs(res.contributions).max()
    assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    assert_allclose(res.regularization, reg, rtol=0, atol=1e-10 * max(scale, 1e-3))
    if est.alpha:
        assert np.abs(res.regularization).max() > 1e-6  # weight decay is really credited
    with torch.no_grad():
        X_t = torch.as_tensor(X)
        assert_allclose(res.initial, _module_at(est, 0)(X_t).numpy(), rtol=1e-12)
        assert_allclose(res.prediction, _module_at(est, -1)(X_t).numpy(), rtol=1e-12)


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("batch_size", [None, 7])
def test_exact_reproduces_the_network_regression(data, name, batch_size):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(16, 16), max_iter=15, batch_size=batch_size,
                            dtype="float64", random_state=0, **SOLVERS[name]).fit(X_train, y)
    res = est.decompose(X)
    recon = res.initial + res.contributions.sum(axis=1) + res.regularization
    assert_allclose(recon, res.prediction, rtol=1e-9, atol=1e-9)
    assert res.error <= 1e-9 * max(1.0, np.abs(res.prediction).max())
    assert_allclose(res.prediction[:, 0], est.predict(X), rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd-momentum-l2", "adam-l2", "adamw"])
@pytest.mark.parametrize("n_classes", [2, 3])
def test_exact_reproduces_the_network_classification(data, name, n_classes):
    X_train, y, X = data
    labels = np.digitize(y, np.quantile(y, np.linspace(0, 1, n_classes + 1)[1:-1]))
    clf = PathKernelClassifier(hidden_layer_sizes=(12,), max_iter=10, batch_size=6,
                               dtype="float64", random_state=0, **SOLVERS[name])
    clf.fit(X_train, labels)
    res = clf.decompose(X)
    n_out = 1 if n_classes == 2 else n_classes
    assert res.contributions.shape == (len(X), len(X_train), n_out)
    assert res.error <= 1e-9 * max(1.0, np.abs(res.prediction).max())
    expected = clf.decision_function(X).reshape(len(X), n_out)
    assert_allclose(res.prediction, expected, rtol=1e-12)


def test_first_and_second_order_converge_at_their_orders(data):
    """Same training time, half the step: first-order error halves, second-order quarters."""
    X_train, y, X = data
    errors = {"first_order": [], "second_order": []}
    for lr, steps in [(0.2, 20), (0.1, 40), (0.05, 80)]:
        est = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), learning_rate_init=lr,
                                max_iter=steps, dtype="float64", random_state=0)
        est.fit(X_train, y)
        for method in errors:
            errors[method].append(est.decompose(X, method=method).error)
    first, second = np.array(errors["first_order"]), np.array(errors["second_order"])
    assert np.all(second < first)
    assert_allclose(first[:-1] / first[1:], 2.0, rtol=0.25)
    assert_allclose(second[:-1] / second[1:], 4.0, rtol=0.3)


def test_expected_weighting(data):
    X_train, y, X = data
    full = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), max_iter=10, learning_rate_init=0.1,
                             dtype="float64", random_state=0).fit(X_train, y)
    assert_allclose(full.decompose(X, weighting="expected").contributions,
                    full.decompose(X).contributions, rtol=1e-12, atol=1e-15)
    mini = PathKernelMachine(**{**full.get_params(), "batch_size": 4}).fit(X_train, y)
    realized = mini.decompose(X)
    expected = mini.decompose(X, weighting="expected")
    assert realized.error < 1e-10 < expected.error  # honest: expected is an approximation
    assert expected.error < 0.5 * np.abs(realized.prediction - realized.initial).max()


def test_explain_agrees_with_sorted_contributions(data):
    X_train, y, X = data
    est = PathKernelMachine(**OLD, hidden_layer_sizes=(8,), max_iter=5, dtype="float64",
                            learning_rate_init=0.01, random_state=0).fit(X_train, y)
    idx, contrib = est.explain(X, n_neighbors=4)
    full = est.decompose(X).contributions[:, :, 0]
    for q in range(len(X)):
        ranked = np.argsort(-np.abs(full[q]))[:4]
        assert_array_equal(np.sort(idx[q]), np.sort(ranked))
        assert_allclose(contrib[q, :, 0], full[q, idx[q]])
        assert np.all(np.diff(np.abs(contrib[q, :, 0])) <= 0)


def test_float32_error_is_at_round_off(data):
    X_train, y, X = data
    est = PathKernelMachine(**RAW, hidden_layer_sizes=(32, 32), solver="adam", max_iter=30,
                            learning_rate_init=0.01, random_state=0).fit(X_train, y)
    res = est.decompose(X)
    change = np.abs(res.prediction - res.initial).max()
    assert change > 0.1
    assert res.error < 1e-5 * max(1.0, np.abs(res.prediction).max())


def test_needs_every_step_recorded(data):
    X_train, y, X = data
    est = PathKernelMachine(**OLD, hidden_layer_sizes=(4,), max_iter=4, record_every=2,
                            learning_rate_init=0.01, random_state=0).fit(X_train, y)
    with pytest.raises(ValueError, match="record_every=1"):
        est.decompose(X)
    with pytest.raises(ValueError, match="method must be"):
        est.decompose(X, method="zeroth")


@pytest.mark.parametrize("method", ["exact", "first_order"])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_sgd_fast_path_equals_the_dense_adjoint(data, method, batch_size, monkeypatch):
    """Plain SGD's factor-Gram path against the general adjoint path (checked above by
    brute force for every solver), on a module with a fallback layer too."""
    import skpathkernel._interpolation as interpolation

    class WithRaw(torch.nn.Module):  # a raw parameter: no rule, goes to the fallback
        def __init__(self, n_in, n_out):
            super().__init__()
            self.lin = torch.nn.Linear(n_in, 6)
            self.scale = torch.nn.Parameter(torch.ones(6))
            self.out = torch.nn.Linear(6, n_out)

        def forward(self, x):
            return self.out(torch.tanh(self.lin(x)) * self.scale)

    X_train, y, X = data
    est = PathKernelMachine(**OLD, module=WithRaw, max_iter=6, batch_size=batch_size, alpha=0.05,
                            learning_rate_init=0.1, dtype="float64", random_state=0)
    est.fit(X_train, y)
    assert interpolation._structured(est.trajectory_, method)
    fast = est.decompose(X, method=method)
    monkeypatch.setattr(interpolation, "_structured", lambda traj, method: False)
    dense = est.decompose(X, method=method)
    assert_allclose(fast.contributions, dense.contributions, rtol=1e-10, atol=1e-13)
    assert_allclose(fast.regularization, dense.regularization, rtol=1e-10, atol=1e-13)
    assert np.abs(fast.regularization).max() > 1e-4
    assert fast.error == pytest.approx(dense.error, abs=1e-12)
