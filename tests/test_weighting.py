"""The path kernel's memory weighting against a replay of the optimizer itself.

The reference weights come from torch.optim, not from the library: one scalar parameter,
the optimizer class and hyper-parameters of the trajectory, its recorded step sizes, and a
unit gradient at one step (zero elsewhere). The parameter's total displacement is the
weight that step's gradient received. Adam and RMSprop get ``eps = 1e30``, which makes
their update linear in the gradient (``lr m_hat / eps``) without changing the first-moment
recursion or its bias correction.
"""

import re
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from _reference import jacobian_loop, module_at
from numpy.testing import assert_allclose
from sklearn.datasets import load_digits
from sklearn.model_selection import GridSearchCV
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from skpathkernel import PathKernelClassifier, PathKernelMachine, kernels
from skpathkernel.kernels import PathKernel, TangentKernel, path_weights

EPS = 1e30


def _replayed(traj, end=None, impulses=None):
    """W_s for the optimizer steps s < end (or those in ``impulses``), by torch.optim on
    an impulse gradient at step s, run to step ``end``."""
    spec = traj.solver_spec
    end = traj.n_steps if end is None else end
    point = np.searchsorted(traj.steps, np.arange(traj.n_steps), side="right") - 1
    lrs = traj.learning_rates[point]
    weights = []
    for s in range(end) if impulses is None else impulses:
        p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        if spec.name == "sgd":
            opt = torch.optim.SGD([p], lr=1.0, momentum=spec.momentum,
                                  nesterov=bool(spec.nesterov))
            scale = 1.0
        elif spec.name in ("adam", "adamw"):
            opt = torch.optim.Adam([p], lr=1.0, betas=(spec.beta_1, spec.beta_2), eps=EPS)
            scale = EPS
        else:
            opt = torch.optim.RMSprop([p], lr=1.0, alpha=spec.rmsprop_alpha, eps=EPS)
            scale = EPS
        for t in range(end):
            opt.param_groups[0]["lr"] = float(lrs[t])
            p.grad = torch.tensor([1.0 if t == s else 0.0], dtype=torch.float64)
            opt.step()
        weights.append(-float(p.detach()) * scale)
    return np.array(weights)


SOLVERS = {
    "sgd-momentum": dict(solver="sgd", momentum=0.8, learning_rate_init=0.05,
                         nesterovs_momentum=False),
    "sgd-nesterov": dict(solver="sgd", momentum=0.8, learning_rate_init=0.05),
    "adam": dict(solver="adam", learning_rate_init=0.01),
    "adamw": dict(solver="adamw", learning_rate_init=0.01, alpha=0.1),
    "rmsprop": dict(solver="rmsprop", learning_rate_init=0.005),
}


def _fit(name, record_every=1):
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=4, batch_size=4,
                            record_every=record_every, dtype="float64", random_state=0,
                            **SOLVERS[name]).fit(X, y)
    return est, X


@pytest.mark.parametrize("record_every", [1, 2])
@pytest.mark.parametrize("name", list(SOLVERS))
def test_discrete_path_kernel_equals_the_replayed_sum(name, record_every):
    est, X = _fit(name, record_every)
    traj = est.trajectory_
    Y = X[:4] - 0.3
    for start, stop in [(0, None), (1, -1)]:
        points = list(range(len(traj) - 1))[slice(start, stop)]
        end = int(traj.steps[points[-1] + 1])
        W = _replayed(traj, end)
        expected = 0.0
        for k in points:
            w = W[traj.steps[k] : traj.steps[k + 1]].sum()
            D = traj.preconditioner(k)
            D = np.ones(traj.n_params) if D is None else D.numpy()
            JX = jacobian_loop(module_at(est, k), X)[:, 0].numpy()
            JY = jacobian_loop(module_at(est, k), Y)[:, 0].numpy()
            expected = expected + w * (JX * D) @ JY.T
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            K = PathKernel(est, start=start, stop=stop)(X, Y)
        np.testing.assert_allclose(K, expected, rtol=1e-12)
        # A thinned path's kernel says it is a Riemann sum; an every-step one says nothing.
        assert [str(w.message)[:40] for w in rec] == (
            ["PathKernel: the path was recorded every "] if record_every > 1 else [])
    discrete = np.array([w for _, w in path_weights(traj)])
    continuous = np.array([w for _, w in path_weights(traj, memory="continuous")])
    if name == "rmsprop":
        np.testing.assert_array_equal(discrete, continuous)  # no memory: one weighting
    else:
        # The two differ where it matters: the last gradients had no time to act, and
        # Adam's bias correction gives the first ones up to ~3 lr.
        assert discrete[-1] < 0.9 * continuous[-1]
        if not name.startswith("sgd"):
            assert discrete[0] > 1.5 * continuous[0]


@pytest.mark.parametrize("name", list(SOLVERS))
def test_continuous_weights_are_the_replayed_long_run_limit(name):
    """memory="continuous" is the weight of a gradient far from both ends of a long run:
    the replay of 600 steps at the recorded step size, impulse at step 300."""
    est, _ = _fit(name)
    traj = est.trajectory_
    lr = float(traj.learning_rates[0])

    class Long:  # a constant-step trajectory of 600 steps, for the replay only
        solver_spec = traj.solver_spec
        n_steps = 600
        steps = np.arange(601)
        learning_rates = np.full(600, lr)

    limit = _replayed(Long, impulses=[300])[0] / lr
    continuous = [w for _, w in path_weights(traj, memory="continuous")]
    np.testing.assert_allclose(continuous, lr * limit, rtol=1e-10)


@pytest.mark.parametrize("nesterov", [False, True])
def test_first_order_decomposition_speaks_of_the_discrete_path_kernel(nesterov):
    """On a network linear in its parameters (J constant, D = I), the first-order and the
    exact decompositions are sum_s W_s K(x, x_i) r_{s,i} / N with the discrete weights
    W_s of the path kernel, and not with the continuous ones."""
    rng = np.random.RandomState(1)
    X = rng.uniform(-1, 1, size=(10, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3
    est = PathKernelMachine(module=lambda n_in, n_out: torch.nn.Linear(n_in, n_out),
                            normalize_y=False, tol=None, solver="sgd", momentum=0.9,
                            nesterovs_momentum=nesterov,
                            learning_rate_init=0.05, max_iter=12, dtype="float64",
                            random_state=0).fit(X, y)
    traj = est.trajectory_
    Xq = X[:3] + 0.1
    first, exact = est.decompose(Xq, method="first_order"), est.decompose(Xq)
    np.testing.assert_allclose(first.contributions, exact.contributions, rtol=1e-10)
    # Residuals of squared_error (1/2 mean): f - y at every step, from a plain forward.
    r = np.stack([module_at(est, t)(torch.as_tensor(X)).detach().numpy()[:, 0] - y
                  for t in range(traj.n_steps)])
    J = np.hstack([X, np.ones((len(X), 1))])
    Jq = np.hstack([Xq, np.ones((len(Xq), 1))])
    K = Jq @ J.T  # the tangent kernel, the same at every step
    for memory in ("discrete", "continuous"):
        W = np.array([w for _, w in path_weights(traj, memory=memory)])
        formula = -(K[:, :, None] * (W[:, None] * r).sum(0)[None, :, None]) / len(X)
        gap = np.abs(formula - exact.contributions).max() / np.abs(exact.contributions).max()
        assert (gap < 1e-10) if memory == "discrete" else (gap > 1e-2)


def test_first_order_expected_reads_each_update_with_its_own_steps_jacobian():
    """With heavy-ball momentum, method="first_order", weighting="expected" is not the
    path kernel's form sum_s W_s K_s(x, x_i) r_{s,i} / N on a nonlinear network: the
    gradient of step s enters every later update t with weight lr_t mu^(t-s) (replayed
    here by torch.optim on an impulse gradient) and each update is read with its own
    step's Jacobian, sum_s sum_{t>=s} lr_t mu^(t-s) J_t(x) J_s(x_i) r_{s,i} / N (the
    documented formula, from the plain autograd loop); plain SGD is the path kernel's
    form."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    Xq = X[:3] + 0.1
    for momentum in (0.0, 0.9):
        est = PathKernelMachine(hidden_layer_sizes=(5,), activation="tanh", max_iter=4,
                                batch_size=4, solver="sgd", learning_rate_init=0.1,
                                momentum=momentum, nesterovs_momentum=False, tol=None,
                                normalize_y=False, dtype="float64",
                                random_state=0).fit(X, y)
        traj = est.trajectory_
        T = traj.n_steps
        applied = np.zeros((T, T))  # [s, t]: the weight update t gives step s's gradient
        for s in range(T):
            p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.SGD([p], lr=1.0, momentum=momentum)
            for t in range(T):
                opt.param_groups[0]["lr"] = float(traj.learning_rates[t])
                p.grad = torch.tensor([1.0 if t == s else 0.0], dtype=torch.float64)
                before = float(p.detach())
                opt.step()
                applied[s, t] = before - float(p.detach())
        Jq = [jacobian_loop(module_at(est, t), Xq)[:, 0].numpy() for t in range(T)]
        Jx = [jacobian_loop(module_at(est, t), X)[:, 0].numpy() for t in range(T)]
        r = [module_at(est, t)(torch.as_tensor(X)).detach().numpy()[:, 0] - y
             for t in range(T)]
        own = -sum(applied[s, t] * (Jq[t] @ Jx[s].T) * r[s] for s in range(T)
                   for t in range(s, T)) / len(X)
        W = dict(path_weights(traj))
        kernel_form = -sum(W[s] * (Jq[s] @ Jx[s].T) * r[s] for s in range(T)) / len(X)
        scores = est.attribute(Xq, method="first_order", weighting="expected")
        scale = np.abs(own).max()
        assert_allclose(scores, own, rtol=0, atol=1e-10 * scale)
        gap = np.abs(kernel_form - own).max() / scale
        assert (gap < 1e-10) if momentum == 0.0 else (gap > 1e-2)


def test_memory_is_validated():
    est, X = _fit("adam")
    with pytest.raises(ValueError, match="memory must be 'discrete' or 'continuous'"):
        PathKernel(est, memory="exact")(X)
    with pytest.raises(ValueError, match="memory must be"):
        path_weights(est.trajectory_, memory=None)


@pytest.mark.parametrize("name", ["sgd", "sgd-momentum", "adam"])
def test_thinned_kernel_estimates_its_error_against_the_every_step_kernel(name):
    """On a path recorded every k steps the kernel is a Riemann sum; its warning states an
    estimate of the error, its difference from the sum at twice the spacing (rebuilt
    here from one-point tangent kernels where the weights do not depend on the range:
    plain SGD), whose size follows the true error (against the every-step kernel of the
    same training, itself checked against dense Jacobians above)."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(40, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    solver = (dict(solver="sgd", momentum=0.0, learning_rate_init=0.05) if name == "sgd"
              else SOLVERS[name])
    params = dict(hidden_layer_sizes=(8,), max_iter=30, batch_size=8, dtype="float64",
                  tol=None, random_state=0, **solver)
    full = PathKernelMachine(**params).fit(X, y).path_kernel_(X)
    for every in (2, 5):
        thin = PathKernelMachine(**params, record_every=every).fit(X, y)
        with pytest.warns(UserWarning, match=r"differ by (\S+) of the kernel") as rec:
            K = thin.path_kernel_(X)
        said = float(re.search(r"differ by (\S+) of", str(rec[0].message)).group(1))
        true = np.abs(K - full).max() / np.abs(full).max()
        assert true > 1e-4  # thinning changed the kernel
        assert true / 2 < said < 5 * true, (every, said, true)
        # Once per path and range: a second call (an SVC's predict) sums the path once
        # and says nothing more (the estimate is the path's, said at the first call).
        counted = mock.Mock(wraps=kernels._path_sum)
        with mock.patch.object(kernels, "_path_sum", counted), warnings.catch_warnings():
            warnings.simplefilter("error")
            thin.path_kernel_(X[:7])
        assert counted.call_count == 1
        if name == "sgd":
            points = path_weights(thin.trajectory_)
            steps = [TangentKernel(thin, step=k)(X) for k, _ in points]
            w = [w for _, w in points]
            K_h = sum(wk * Kk for wk, Kk in zip(w, steps))
            # Each pair's weights on its first point; a last unpaired point keeps its own.
            K_2h = sum((w[i] + (w[i + 1] if i + 1 < len(w) else 0)) * steps[i]
                       for i in range(0, len(w), 2))
            assert_allclose(said, np.abs(K_2h - K_h).max() / np.abs(K_h).max(), rtol=0.05)


def test_thinned_kernel_warns_once_per_path_under_a_grid_search():
    """GridSearchCV over an SVC on a thinned path's kernel: one warning, where Python's
    once-per-line filter showed it at every task (12 times for the 22 calls of
    examples/plot_path_kernel_svc.py): scikit-learn runs each (candidate, fold) in a
    catch_warnings block, which resets that filter's registry. A second search on the
    same path says nothing more; another range of it is another estimate, said once."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(30, 2))
    y = (X[:, 0] * X[:, 1] > 0).astype(int)
    net = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=12, batch_size=None,
                               record_every=3, tol=None, random_state=0).fit(X, y)
    calls = mock.Mock(wraps=kernels._path_sum)

    def search(**kw):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("default")  # Python's own: once per calling line
            GridSearchCV(SVC(kernel=PathKernel(net, normalized=True, **kw)),
                         {"C": [0.1, 1.0, 10.0]}, cv=3).fit(X, y)
        return [w for w in rec if "recorded every 3 optimizer steps" in str(w.message)]

    with mock.patch.object(kernels, "_path_sum", calls):
        first = search()
    # 9 fits, 9 scores and the refit, each one kernel call (its Gram in one sum).
    assert calls.call_count > 19
    assert len(first) == 1
    assert search() == []
    assert len(search(start=1)) == 1


def test_thinned_kernel_warning_made_an_error_raises_at_every_call():
    """A filter that turns the thinned path's warning into an error raises at every
    call, as Python's own registry lets an error filter do: the first call kept the
    estimate as said, and the next returned the Riemann sum silently."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(20, 2))
    net = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=9, batch_size=None,
                            record_every=3, tol=None, random_state=0).fit(X, X[:, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(UserWarning, match="recorded every 3 optimizer steps"):
                net.path_kernel_(X[:4])
    # Said once it is shown.
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            net.path_kernel_(X[:4])
    assert len([w for w in rec if "recorded every 3" in str(w.message)]) == 1


@pytest.mark.parametrize("normalized", [False, True])
def test_path_kneighbors_on_a_thinned_path_warns_once(normalized):
    """kneighbors(kernel="path") on queries sums the path itself (Gram and diagonals in one
    walk), past the kernel's call: it says once, as the kernel does, that the path is a
    Riemann sum (it said nothing, or, normalized, at every call)."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(20, 2))
    net = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=9, batch_size=None,
                            record_every=3, tol=None, random_state=0).fit(X, X[:, 0])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            net.kneighbors(X[:3], 2, kernel="path", normalized=normalized)
    assert [str(w.message)[:40] for w in rec] == ["PathKernel: the path was recorded every "]
    assert rec[0].filename == __file__


@pytest.mark.parametrize("epochs, every", [(15, 3), (10, 3), (21, 4), (12, 3), (6, 3)])
def test_thinned_kernel_estimate_with_an_odd_count_or_a_short_last_interval(epochs, every):
    """Five or seven recorded points, a last interval shorter than the others (10 steps
    every 3), or two points to sum (6 every 3, the fewest with an estimate): the estimate
    still follows the true error. (Comparing the sums over the even and the odd points
    alone, which then cover different steps, said 14-48 times the true error here.)"""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    y = np.sin(X[:, 0])
    params = dict(hidden_layer_sizes=(6,), solver="sgd", batch_size=None,
                  learning_rate_init=0.05, max_iter=epochs, tol=None, dtype="float64",
                  random_state=0)
    full = PathKernelMachine(**params).fit(X, y).path_kernel_(X)
    thin = PathKernelMachine(**params, record_every=every).fit(X, y)
    assert thin.trajectory_.n_steps == epochs
    with pytest.warns(UserWarning, match=r"differ by (\S+) of the kernel") as rec:
        K = thin.path_kernel_(X)
    said = float(re.search(r"differ by (\S+) of", str(rec[0].message)).group(1))
    true = np.abs(K - full).max() / np.abs(full).max()
    assert true > 1e-3
    assert true / 2 < said < 3 * true, (said, true)


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_path_kernel_across_a_warm_start_with_torch_optims_own_preconditioner(name):
    """A fit continued by warm_start at another learning_rate_init (the optimizer's step
    count and second moments go on): the path kernel over a range that straddles the
    restart equals the sum of J D J^T with D read from torch.optim's own state in a plain
    replay of the training (not from the trajectory) and the impulse-replayed weights."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=2, batch_size=4, alpha=0.01,
                            normalize_y=False, tol=None, dtype="float64", random_state=0,
                            warm_start=True, **SOLVERS[name]).fit(X, y)
    first = est.trajectory_.n_steps
    est.set_params(learning_rate_init=0.3 * est.learning_rate_init).fit(X, y)
    traj = est.trajectory_
    assert traj.n_steps == 2 * first and traj.learning_rates[-1] < traj.learning_rates[0]
    module = module_at(est, 0)
    params = [p for p in module.parameters()]
    opt = (torch.optim.Adam(params, lr=1.0, betas=(est.beta_1, est.beta_2),
                            eps=est.epsilon, weight_decay=est.alpha) if name == "adam"
           else torch.optim.RMSprop(params, lr=1.0, alpha=0.99, eps=est.epsilon,
                                    weight_decay=est.alpha))
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y).reshape(-1, 1)
    D = []
    for t, batch in enumerate(traj.batches):
        opt.param_groups[0]["lr"] = float(traj.learning_rates[t])
        opt.zero_grad()
        rows = torch.as_tensor(batch)
        (0.5 * (module(Xt[rows]) - yt[rows]).pow(2).mean()).backward()
        opt.step()
        v, count = [], None
        for p in params:
            state = opt.state[p]
            if name == "adam":
                count = float(state["step"])
                v.append(state["exp_avg_sq"].reshape(-1) / (1 - est.beta_2 ** count))
            else:
                v.append(state["square_avg"].reshape(-1))
        D.append((1.0 / (torch.cat(v).sqrt() + est.epsilon)).numpy())
    # The replay is the training: it ends where the record ends.
    end = torch.cat([p.detach().reshape(-1) for p in params])
    np.testing.assert_allclose(end.numpy(), traj.parameters(-1).numpy(), rtol=0, atol=1e-14)
    Y = X[:4] - 0.3
    for start, stop in [(0, None), (first - 2, first + 3)]:
        points = list(range(len(traj) - 1))[slice(start, stop)]
        W = _replayed(traj, points[-1] + 1)
        expected = 0.0
        for k in points:
            JX = jacobian_loop(module_at(est, k), X)[:, 0].numpy()
            JY = jacobian_loop(module_at(est, k), Y)[:, 0].numpy()
            expected = expected + W[k] * (JX * D[k]) @ JY.T
        np.testing.assert_allclose(PathKernel(est, start=start, stop=stop)(X, Y), expected,
                                   rtol=1e-12)


def test_thinned_kernel_estimate_of_the_default_classifier():
    """The default classifier (Adam, batches of 200) on 1000 standardised digits,
    recorded every 5 steps: against the every-step kernel of the same training (its end
    point identical), the kernel is off by 8.1e-3 of its largest entry. The even / odd
    comparison said 1.6e-3 there (five times too little); the sum at twice the spacing
    says 1.0e-2."""
    X, y = load_digits(return_X_y=True)
    X, y = StandardScaler().fit_transform(X)[:1000], y[:1000]
    thin = PathKernelClassifier(random_state=0, record_every=5).fit(X, y)
    every = PathKernelClassifier(random_state=0).fit(X, y)
    assert torch.equal(thin.trajectory_.parameters(-1), every.trajectory_.parameters(-1))
    with pytest.warns(UserWarning, match=r"differ by (\S+) of the kernel") as rec:
        K = thin.path_kernel_(X[:64])
    said = float(re.search(r"differ by (\S+) of", str(rec[0].message)).group(1))
    full = every.path_kernel_(X[:64])
    true = np.abs(K - full).max() / np.abs(full).max()
    assert true > 1e-3
    assert true / 2 < said < 3 * true, (said, true)
