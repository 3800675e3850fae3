"""hessian_trace / hessian_trace_path against exact Hessians of an independent loss."""

import copy
import pickle
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from skpathkernel import PathKernelClassifier, PathKernelMachine, PathRecorder
from skpathkernel.diagnostics import (
    HessianTrace,
    _rademacher,
    hessian_trace,
    hessian_trace_path,
    loss_path,
)


def _exact_loss(estimator, X, Y, step, weights=None):
    """theta -> training loss, written out by hand (no functional_call, no _losses).

    Independent of the code under test: the tanh MLP's forward pass from the recorded
    state_dict's shapes, and each loss from its textbook formula; ``weights``: the
    weighted mean ``sum_i w_i l_i / sum_i w_i`` (np.average's), else the plain mean.
    """
    sd = estimator.trajectory_.state_dict(step)
    names, shapes = list(sd), [v.shape for v in sd.values()]
    sizes = [int(np.prod(s)) for s in shapes]
    X = torch.as_tensor(np.array(X, dtype=np.float64))  # a copy: X_fit_ may be a memmap

    def loss(theta):
        parts = dict(zip(names, (p.reshape(s) for p, s in zip(theta.split(sizes), shapes))))
        n_layers = len(names) // 2
        h = X
        for i in range(n_layers):
            h = h @ parts[f"{2 * i}.weight"].T + parts[f"{2 * i}.bias"]
            if i < n_layers - 1:
                h = torch.tanh(h)
        if estimator.loss == "squared_error":
            per_sample = 0.5 * ((h - torch.as_tensor(Y).reshape(h.shape)) ** 2).mean(dim=1)
        elif h.shape[1] == 1:  # logistic loss on the margin: softplus(z) - y z
            z, t = h[:, 0], torch.as_tensor(Y, dtype=torch.float64)
            per_sample = torch.nn.functional.softplus(z) - t * z
        else:
            codes = torch.as_tensor(Y)  # softmax cross-entropy: logsumexp(z) - z_y
            per_sample = torch.logsumexp(h, dim=1) - h[torch.arange(len(h)), codes]
        if weights is None:
            return per_sample.mean()
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
        return (w * per_sample).sum() / w.sum()

    theta0 = estimator.trajectory_.parameters(step).to(torch.float64).clone()
    return loss, theta0


def _exact_hessian(estimator, step=-1, weights=None, X=None, Y=None):
    X = estimator.X_fit_ if X is None else X
    Y = estimator._Y_fit if Y is None else Y
    loss, theta = _exact_loss(estimator, X, Y, step, weights)
    return torch.autograd.functional.hessian(loss, theta).numpy()


def _quad(estimator, H, n_samples, random_state=0):
    """Every probe's exact ``v^T H v`` for the probes of ``random_state``."""
    V = _probes(random_state, n_samples, estimator.n_params_)
    return np.einsum("jp,pq,jq->j", V, H, V)


def _probes(random_state, n_samples, n_params):
    # The probe sequence hessian_trace draws for this random_state (same seed derivation).
    seed = int(np.random.RandomState(random_state).randint(np.iinfo(np.int32).max))
    like = torch.empty(n_params, dtype=torch.float64)
    return torch.stack(list(_rademacher(seed, n_samples, like))).numpy()


def _circle(n, n_classes, random_state):
    rng = np.random.RandomState(random_state)
    X = rng.normal(size=(n, 2))
    angle = np.arctan2(X[:, 1], X[:, 0]) + np.pi
    y = np.floor(angle / (2 * np.pi) * n_classes).astype(int) % n_classes
    return X, y


def _fitted(kind):
    rng = np.random.RandomState(0)
    # tanh (the old default, pinned): _exact_loss writes the tanh MLP out by hand.
    common = dict(max_iter=40, activation="tanh", dtype="float64", random_state=0)
    if kind == "regression":
        X = rng.uniform(-1, 1, size=(40, 3))
        y = np.sin(X @ np.array([1.0, -2.0, 0.5]))
        # alpha > 0 pins down that weight decay is not part of the estimated loss.
        return PathKernelMachine(hidden_layer_sizes=(10,), learning_rate_init=0.1,
                                 alpha=1e-2, **common).fit(X, y)  # P = 51
    if kind == "regression-2out-2layers":
        X = rng.uniform(-1, 1, size=(30, 2))
        Y = np.column_stack([np.sin(2 * X[:, 0]), X[:, 0] * X[:, 1]])
        return PathKernelMachine(hidden_layer_sizes=(8, 8), learning_rate_init=0.1,
                                 **common).fit(X, Y)  # P = 114
    if kind == "binary":
        X, y = _circle(40, 2, 0)
        return PathKernelClassifier(hidden_layer_sizes=(16,), solver="adam",
                                    learning_rate_init=0.02, **common).fit(X, y)  # P = 65
    if kind == "multiclass":
        X, y = _circle(45, 3, 0)
        return PathKernelClassifier(hidden_layer_sizes=(20,), solver="adam",
                                    learning_rate_init=0.02, **common).fit(X, y)  # P = 123
    if kind == "binary-squared":
        X, y = _circle(40, 2, 1)
        return PathKernelClassifier(hidden_layer_sizes=(16,), loss="squared_error",
                                    learning_rate_init=0.1, **common).fit(X, y)
    raise ValueError(kind)


KINDS = ["regression", "regression-2out-2layers", "binary", "multiclass", "binary-squared"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("step", [0, -1])
def test_matches_exact_hessian_trace(kind, step):
    est = _fitted(kind)
    H = _exact_hessian(est, step)
    exact = float(np.trace(H))
    res = hessian_trace(est, n_samples=200, random_state=0, step=step)
    assert isinstance(res, HessianTrace)
    assert res.step == step % len(est.trajectory_)
    assert res.optimizer_step == est.trajectory_.steps[res.step]
    assert res.stderr > 0
    # The statistical claim: unbiased, within 4 standard errors.
    assert abs(res.trace - exact) < 4 * res.stderr, (res.trace, res.stderr, exact)
    # The deterministic one: every probe's v^T H v is the exact quadratic form.
    V = _probes(0, 200, est.n_params_)
    quad = np.einsum("jp,pq,jq->j", V, H, V)
    np.testing.assert_allclose(res.estimates, quad, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.stderr, quad.std(ddof=1) / np.sqrt(200), rtol=1e-10)


def test_batching_changes_nothing():
    est = _fitted("multiclass")
    full = hessian_trace(est, n_samples=12, random_state=3)
    for batch_size in (1, 7, 45, 1000):
        part = hessian_trace(est, n_samples=12, random_state=3, batch_size=batch_size)
        np.testing.assert_allclose(part.estimates, full.estimates, rtol=1e-10, atol=1e-12)


def test_seeded_determinism():
    est = _fitted("binary")
    a = hessian_trace(est, n_samples=20, random_state=5)
    b = hessian_trace(est, n_samples=20, random_state=np.random.RandomState(5))
    c = hessian_trace(est, n_samples=20, random_state=6)
    np.testing.assert_array_equal(a.estimates, b.estimates)
    assert not np.array_equal(a.estimates, c.estimates)


def test_estimator_and_global_rng_unchanged():
    est = _fitted("regression")
    before = {k: v.clone() for k, v in est.module_.state_dict().items()}
    traj_before = est.trajectory_.parameters(-1).clone()
    grads_before = [None if p.grad is None else p.grad.clone() for p in est.module_.parameters()]
    rng_before = torch.get_rng_state()
    hessian_trace(est, n_samples=5, random_state=0, step=0)
    hessian_trace_path(est, steps=[0, -1], n_samples=5, random_state=0)
    for k, v in est.module_.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # Training leaves the last step's .grad behind; the estimate must not add to it.
    for p, g in zip(est.module_.parameters(), grads_before):
        assert (p.grad is None) if g is None else torch.equal(p.grad, g)
    assert not est.module_.training
    torch.testing.assert_close(est.trajectory_.parameters(-1), traj_before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_path_equals_pointwise():
    est = _fitted("regression")
    path = hessian_trace_path(est, steps=[0, 20, -1], n_samples=10, random_state=1)
    assert path.steps.tolist() == [0, 20, 40] and len(path) == 3
    assert path.estimates.shape == (3, 10)
    for i, s in enumerate([0, 20, -1]):
        one = hessian_trace(est, n_samples=10, random_state=1, step=s)
        np.testing.assert_array_equal(path[i].estimates, one.estimates)
        assert path[i].trace == one.trace and path[i].step == one.step
    assert hessian_trace_path(est, steps=5, n_samples=2).steps.tolist() == [0, 10, 20, 30, 40]
    assert len(hessian_trace_path(est, n_samples=2)) == len(est.trajectory_)


def test_explicit_data_is_encoded_like_fit():
    X, y = _circle(45, 3, 0)
    labels = np.array(["a", "b", "c"])[y]
    est = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, dtype="float64",
                               activation="tanh", random_state=0).fit(X, labels)
    default = hessian_trace(est, n_samples=10, random_state=0)
    explicit = hessian_trace(est, X, labels, n_samples=10, random_state=0)
    np.testing.assert_array_equal(default.estimates, explicit.estimates)
    # A subset holding only some classes keeps fit's codes (the Hessian on the subset).
    mask = labels != "a"
    loss, theta = _exact_loss(est, X[mask], y[mask], -1)
    exact = torch.autograd.functional.hessian(loss, theta).numpy()
    sub = hessian_trace(est, X[mask], labels[mask], n_samples=10, random_state=0)
    V = _probes(0, 10, est.n_params_)
    np.testing.assert_allclose(sub.estimates, np.einsum("jp,pq,jq->j", V, exact, V),
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="not seen in fit"):
        hessian_trace(est, X[:3], ["a", "b", "z"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu():
    # Probes are drawn on the CPU: one seed, the same probes, on every device.
    X, y = _circle(45, 3, 0)
    kw = dict(hidden_layer_sizes=(12,), max_iter=10, dtype="float64", random_state=0)
    cpu = PathKernelClassifier(device="cpu", **kw).fit(X, y)
    gpu = PathKernelClassifier(device="cuda", **kw).fit(X, y)
    a = hessian_trace(cpu, n_samples=10, random_state=0, step=0)
    b = hessian_trace(gpu, n_samples=10, random_state=0, step=0)
    np.testing.assert_allclose(b.estimates, a.estimates, rtol=1e-9, atol=1e-12)


def test_float32_estimator():
    X, y = _circle(30, 2, 0)
    est = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, activation="tanh",
                               random_state=0).fit(X, y)
    res = hessian_trace(est, n_samples=10, random_state=0)
    exact = np.trace(_exact_hessian(est))
    assert isinstance(res.trace, float) and res.estimates.dtype == np.float64
    np.testing.assert_allclose(res.estimates, np.einsum(
        "jp,pq,jq->j", (V := _probes(0, 10, est.n_params_)), _exact_hessian(est), V),
        rtol=1e-4, atol=1e-6)
    assert abs(res.trace - exact) < 4 * res.stderr + 1e-5


def test_bad_input():
    X, y = _circle(20, 2, 0)
    with pytest.raises(NotFittedError):
        hessian_trace(PathKernelClassifier())
    with pytest.raises(NotFittedError):
        hessian_trace_path(PathKernelMachine())
    est = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0).fit(X, y)
    X_nan = X.copy()
    X_nan[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        hessian_trace(est, X_nan, y)
    with pytest.raises(ValueError, match="n_samples"):
        hessian_trace(est, n_samples=0)
    with pytest.raises(ValueError, match="batch_size"):
        hessian_trace(est, batch_size=0)
    with pytest.raises(ValueError, match="both X and y"):
        hessian_trace(est, X)
    with pytest.raises(ValueError, match="features"):
        hessian_trace(est, X[:, :1], y)
    with pytest.raises(ValueError, match="inconsistent"):
        hessian_trace(est, X, y[:-1])
    with pytest.raises(IndexError, match="out of range"):
        hessian_trace(est, step=len(est.trajectory_))
    with pytest.raises(ValueError, match="estimator"):
        hessian_trace(object())
    with pytest.raises(ValueError, match="steps"):
        hessian_trace_path(est, steps=[0.5])
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, random_state=0).fit(X, X)
    with pytest.raises(ValueError, match="outputs"):
        hessian_trace(reg, X, X[:, 0])


def test_a_bool_or_a_2d_array_of_steps_is_refused():
    # validate_params takes a bool for an int: step=True was the trace at point 1 and
    # steps=True one evenly spaced point, where kneighbors, the kernels and the
    # displays refuse a bool step. A 2-D steps was refused in words about y.
    X, y = _circle(20, 2, 0)
    est = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0).fit(X, y)
    with pytest.raises(TypeError, match="step must be an int, got True"):
        hessian_trace(est, step=True, n_samples=2)
    with pytest.raises(TypeError, match=r"'steps' parameter .* an int in the range.*Got True"):
        hessian_trace_path(est, steps=True, n_samples=2)
    with pytest.raises(ValueError, match=r"steps must be a 1-D sequence of integers"):
        hessian_trace_path(est, steps=[[0, 1]], n_samples=2)
    # The counts too: n_samples=True failed in np.zeros with "an integer is required",
    # batch_size=True ran batches of one.
    with pytest.raises(TypeError, match=r"'n_samples' parameter .* an int in the range .*Got True"):
        hessian_trace(est, n_samples=True)
    with pytest.raises(TypeError, match=r"'batch_size' parameter .* an int in the range.*Got True"):
        hessian_trace_path(est, n_samples=2, batch_size=True)
    assert hessian_trace(est, step=np.int64(1), n_samples=2).step == 1


# ------------------------------------------------------------------ sample_weight
def _weighted_fit(kind, **params):
    """A tanh float64 fit with integer weights (zeros included) on minibatches of 8:
    the recorded per-batch normalized weights do not give the weights across batches."""
    rng = np.random.RandomState(1)
    common = dict(max_iter=6, activation="tanh", dtype="float64", random_state=0,
                  batch_size=8, tol=None, learning_rate_init=0.05, **params)
    if kind == "regression":
        X = rng.uniform(-1, 1, size=(30, 3))
        y = np.sin(X @ np.array([1.0, -2.0, 0.5]))
        est = PathKernelMachine(hidden_layer_sizes=(6,), normalize_y=False, **common)
    else:
        X, y = _circle(30, 3 if kind == "multiclass" else 2, 2)
        est = PathKernelClassifier(hidden_layer_sizes=(6,), **common)
    w = rng.randint(0, 5, size=len(X)).astype(np.float64)
    w[:2] = [0.0, 4.0]  # unequal whatever the draw
    return est, X, y, w


@pytest.mark.parametrize("kind", ["regression", "binary", "multiclass"])
def test_weighted_fit_estimates_the_hessian_of_the_weighted_mean_loss(kind):
    est, X, y, w = _weighted_fit(kind)
    est.fit(X, y, sample_weight=w)
    for step in (0, -1):
        H = _exact_hessian(est, step, weights=w)
        res = hessian_trace(est, n_samples=30, random_state=0, step=step)
        np.testing.assert_allclose(res.estimates, _quad(est, H, 30), rtol=1e-10, atol=1e-12)
        # Not the plain mean's (what was estimated before): the test tells them apart.
        plain = _quad(est, _exact_hessian(est, step), 30)
        assert np.max(np.abs(plain - res.estimates)) > 1e-3 * np.max(np.abs(plain))
    # The same with the weights given, in batches, and along the path.
    explicit = hessian_trace(est, X, y, sample_weight=w, n_samples=30, random_state=0,
                             batch_size=7)
    np.testing.assert_allclose(explicit.estimates, res.estimates, rtol=1e-10, atol=1e-12)
    path = hessian_trace_path(est, steps=[0, -1], n_samples=30, random_state=0)
    np.testing.assert_allclose(path[1].estimates, res.estimates, rtol=1e-10, atol=1e-12)
    # Relative weights: scaling them changes nothing.
    scaled = hessian_trace(est, X, y, sample_weight=3.5 * w, n_samples=30, random_state=0)
    np.testing.assert_allclose(scaled.estimates, res.estimates, rtol=1e-10, atol=1e-12)


def test_sample_weight_weighs_explicit_data_and_overrides_the_fits():
    est, X, y, w = _weighted_fit("binary")
    est.fit(X, y, sample_weight=w)
    # X, y without weights: the plain mean over them.
    plain = hessian_trace(est, X[:20], y[:20], n_samples=20, random_state=0)
    H = _exact_hessian(est, X=X[:20], Y=y[:20])
    np.testing.assert_allclose(plain.estimates, _quad(est, H, 20), rtol=1e-10, atol=1e-12)
    v = np.arange(20, dtype=np.float64) % 3
    weighted = hessian_trace(est, X[:20], y[:20], sample_weight=v, n_samples=20,
                             random_state=0)
    H = _exact_hessian(est, weights=v, X=X[:20], Y=y[:20])
    np.testing.assert_allclose(weighted.estimates, _quad(est, H, 20), rtol=1e-10, atol=1e-12)
    # With X=None they replace the fit's: equal weights give the unweighted Hessian.
    ones = hessian_trace(est, sample_weight=np.ones(len(X)), n_samples=20, random_state=0)
    np.testing.assert_allclose(ones.estimates, _quad(est, _exact_hessian(est), 20),
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="Negative"):
        hessian_trace(est, sample_weight=-np.ones(len(X)))
    with pytest.raises(ValueError, match="shape"):
        hessian_trace(est, X[:5], y[:5], sample_weight=w)
    with pytest.raises(ValueError, match="[Zz]ero|sum"):
        hessian_trace(est, sample_weight=np.zeros(len(X)))


def test_replacing_the_training_inputs_of_a_weighted_fit():
    est, X, y, w = _weighted_fit("regression")
    est.fit(X, y, sample_weight=w)
    # The same samples in another container: the kept weights still weigh them.
    est.X_fit_ = np.array(X)
    _default_equals_weighted(est, w)
    # Other samples: refused, naming the fit's weights (it failed later, in hessian_trace,
    # with a shape error about a sample_weight nobody passed).
    with pytest.raises(ValueError, match="keeps the sample_weight of the 30"):
        est.X_fit_ = X[:20]
    np.testing.assert_array_equal(est.X_fit_, X)
    est.network_ = est.network_.replace(X_fit=X[:20], y_fit=est._Y_fit[:20],
                                        sample_weight=None)
    assert est.network_.sample_weight is None


def test_sparse_y_is_refused_clearly_where_fit_takes_none():
    for kind in ("regression", "binary"):
        est, X, y, _ = _weighted_fit(kind)
        est.fit(X, y)
        column = sp.csr_matrix(np.asarray(y, dtype=np.float64)[:, None])
        with pytest.raises(TypeError, match="multilabel indicator only.*dense"):
            hessian_trace(est, X, column)


def _default_equals_weighted(est, weights, n_samples=10):
    res = hessian_trace(est, n_samples=n_samples, random_state=0)
    H = _exact_hessian(est, weights=weights)
    np.testing.assert_allclose(res.estimates, _quad(est, H, n_samples), rtol=1e-10,
                               atol=1e-12)
    return res


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_the_fits_weights_survive_pickle_and_partial_fit(storage, tmp_path):
    est, X, y, w = _weighted_fit("regression", trajectory_storage=storage,
                                 trajectory_dir=tmp_path)
    # Weighted, unweighted, weighted calls: the training set's weights are each call's
    # at mean 1 (every batch normalizes its own), 1 for the unweighted call's samples.
    est.partial_fit(X[:10], y[:10], sample_weight=w[:10])
    est.partial_fit(X[10:20], y[10:20])
    est.partial_fit(X[20:], y[20:], sample_weight=w[20:])
    stream = np.concatenate([w[:10] / w[:10].mean(), np.ones(10), w[20:] / w[20:].mean()])
    np.testing.assert_array_equal(est.X_fit_, X)
    res = _default_equals_weighted(est, stream)
    for back in (pickle.loads(pickle.dumps(est)), copy.deepcopy(est)):
        again = hessian_trace(back, n_samples=10, random_state=0)
        np.testing.assert_array_equal(again.estimates, res.estimates)
    # Unweighted calls only: the plain mean, as before weights were kept.
    plain = clone(est).partial_fit(X[:10], y[:10]).partial_fit(X[10:], y[10:])
    assert plain.network_.sample_weight is None
    _default_equals_weighted(plain, None)


def _stream(weights, n_samples=10):
    """Three partial_fit calls of 10 samples with ``weights`` (None: unweighted), and
    their hessian_trace."""
    est, X, y, _ = _weighted_fit("regression")
    for k, v in enumerate(weights):
        est.partial_fit(X[10 * k:10 * (k + 1)], y[10 * k:10 * (k + 1)], sample_weight=v)
    return est, hessian_trace(est, n_samples=n_samples, random_state=0)


def test_a_calls_weight_scale_which_training_never_sees_changes_nothing():
    _, _, _, w = _weighted_fit("regression")
    w1, w2, w3 = w[:10], 1.0 + w[10:20], w[20:]
    est, res = _stream([w1, w2, w3])
    # x1000 on the second call: the same path bit for bit (each batch normalizes its
    # weights), hence the same kept weights and Hessian (they were 14% apart).
    big, res_big = _stream([w1, 1000 * w2, w3])
    np.testing.assert_array_equal(big.trajectory_.parameters(-1),
                                  est.trajectory_.parameters(-1))
    np.testing.assert_allclose(res_big.estimates, res.estimates, rtol=1e-12)
    np.testing.assert_allclose(big.network_.sample_weight, est.network_.sample_weight,
                               rtol=1e-14)
    # Against the dense Hessian of the loss with every call's weights at mean 1.
    _default_equals_weighted(big, np.concatenate([v / v.mean() for v in (w1, w2, w3)]))


def test_equal_weights_in_a_later_call_are_an_unweighted_call():
    _, _, _, w = _weighted_fit("regression")
    w1 = 1.0 + w[:10]
    plain, res = _stream([w1, None, None])
    tens, res_tens = _stream([w1, np.full(10, 10.0), None])
    np.testing.assert_array_equal(tens.trajectory_.parameters(-1),
                                  plain.trajectory_.parameters(-1))
    np.testing.assert_array_equal(tens.network_.sample_weight, plain.network_.sample_weight)
    np.testing.assert_array_equal(res_tens.estimates, res.estimates)
    _default_equals_weighted(tens, np.r_[w1 / w1.mean(), np.ones(20)])
    # Continuous: a 1e-9 change of one weight moves the Hessian by about as much (it
    # jumped by 9%: near-equal weights were kept as given, equal ones as 1).
    near = np.full(10, 10.0)
    near[-1] += 1e-9
    _, res_near = _stream([w1, near, None])
    np.testing.assert_allclose(res_near.estimates, res.estimates, rtol=1e-6)


def test_warm_start_and_early_stopping_keep_the_weights_trained_on():
    est, X, y, w = _weighted_fit("regression", warm_start=True)
    est.fit(X, y, sample_weight=w)
    v = np.where(w > 0, 5.0 - w, 1.0)
    # The same data again with other weights: the latest fit's objective.
    est.fit(X, y, sample_weight=v)
    _default_equals_weighted(est, v)
    est.fit(X, y)
    assert est.network_.sample_weight is None
    # Other data: the training set grows, each part with its weights.
    est.fit(X[:12], y[:12], sample_weight=w[:12])
    np.testing.assert_allclose(est.network_.sample_weight,
                               np.r_[np.ones(len(X)), w[:12] / w[:12].mean()], rtol=1e-15)
    _default_equals_weighted(est, np.r_[np.ones(len(X)), w[:12] / w[:12].mean()])
    # Early stopping trains on a part: its weights, in X_fit_'s order.
    stop, *_ = _weighted_fit("binary", early_stopping=True, validation_fraction=0.3)
    _, Xc, yc, wc = _weighted_fit("binary")
    stop.fit(Xc, yc, sample_weight=wc + 1)
    np.testing.assert_array_equal(stop.X_fit_, Xc[stop._train_rows])
    _default_equals_weighted(stop, (wc + 1)[stop._train_rows])


@pytest.mark.slow
def test_reproduce_flatness_section(tmp_path):
    from skpathkernel._reproduce import SECTIONS
    from skpathkernel._reproduce._report import Context

    ctx = Context(out=str(tmp_path), quick=True, device="cpu")
    rows = SECTIONS["flatness"](ctx)
    assert [r.claim.rsplit(", ", 1)[1] for r in rows] == ["sgd", "sgd+momentum", "adam",
                                                          "rmsprop"]
    for r in rows:
        assert r.passed is None and "Tr H = " in r.measured and "test acc" in r.measured
        steps = [d["optimizer step"] for d in r.details]
        # Four evenly spread points of the shared circle fit, from the start to the end.
        fit = ctx.cache[("circle", r.claim.rsplit(", ", 1)[1])]
        assert len(steps) == 4 and steps[0] == 0 and steps[-1] == fit.t_
        assert np.all(np.diff(steps) > 0)
        assert all(np.isfinite(float(d["Tr H"])) for d in r.details)


class _FunctionalLookup(torch.nn.Module):
    """A table read by ``F.embedding`` in the forward, not an nn.Embedding layer; with
    ``scale``, a table computed from the parameter; with ``noise``, a forward that draws
    from torch's generator in every mode."""

    def __init__(self, n_outputs, flag, scale=None, noise=0.0):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(6, 3))
        self.head = torch.nn.Linear(12, n_outputs)
        self.flag, self.scale, self.noise = flag, scale, noise

    def forward(self, ids):
        table = self.table if self.scale is None else self.table * self.scale
        lookup = torch.nn.functional.embedding(ids, table, scale_grad_by_freq=self.flag)
        h = lookup.flatten(1)
        return self.head(h + self.noise * torch.randn_like(h))


def _lookup_fit(**kw):
    rng = np.random.RandomState(0)
    X = rng.randint(0, 6, size=(20, 4))
    y = np.sin(X.sum(1).astype(float))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forward that draws warns at fit
        est = PathKernelMachine(module=lambda i, o: _FunctionalLookup(o, False, **kw),
                                max_iter=3, tol=None, dtype="float64",
                                random_state=0).fit(X, y)
    return est, X, y


@pytest.mark.parametrize("scale", [None, 2.0])
def test_a_functional_lookup_scaled_by_frequency_is_refused(scale):
    """The flag on a functional lookup of a parameter, or of a table computed from one,
    gives the same wrong backward as the layer's; trained without it, the same
    network's trace is computed."""
    est, X, y = _lookup_fit(scale=scale)
    assert np.isfinite(hessian_trace(est, X, y, n_samples=2, random_state=0).estimates).all()
    est.module_.flag = True
    with pytest.raises(ValueError, match="A call of embedding has scale_grad_by_freq=True"):
        hessian_trace(est, X, y, n_samples=2, random_state=0)


def test_the_lookup_check_leaves_the_random_streams_as_they_were(monkeypatch):
    """Its forward pass draws where the module draws, from generators whose states are
    restored: the trace and the caller's next draw are those without the check."""
    from skpathkernel import diagnostics

    est, X, y = _lookup_fit(noise=0.1)

    def trace_and_next_draw():
        torch.manual_seed(0)
        trace = hessian_trace(est, X, y, n_samples=3, random_state=0).estimates
        return trace, torch.rand(1)

    trace_and_next_draw()  # the first call measures the activation widths: a forward (kept)
    checked = trace_and_next_draw()
    monkeypatch.setattr(diagnostics, "check_functional_lookups", lambda *a: None)
    unchecked = trace_and_next_draw()
    np.testing.assert_array_equal(checked[0], unchecked[0])
    assert torch.equal(checked[1], unchecked[1])


@pytest.mark.parametrize("flag", [dict(scale_grad_by_freq=True), dict(max_norm=1.0)])
def test_an_embedding_whose_lookup_is_not_a_function_of_the_parameters_is_refused(flag):
    """scale_grad_by_freq makes a backward that is not the loss's derivative (the trace
    read 6.94 with it, 7.37 without, at the same parameters and probes); max_norm would
    rewrite the recorded parameters in place. As the kernels and decompositions refuse
    them."""
    rng = np.random.RandomState(0)
    X = rng.randint(0, 6, size=(20, 4))
    y = np.sin(X.sum(1).astype(float))
    est = PathKernelMachine(module=lambda i, o: torch.nn.Sequential(
        torch.nn.Embedding(6, 3, **flag), torch.nn.Flatten(), torch.nn.Linear(12, o)),
        max_iter=3, tol=None, dtype="float64", random_state=0).fit(X, y)
    before = est.trajectory_.parameters(-1).clone()
    with pytest.raises(ValueError, match=f"'0' \\(Embedding\\) has {next(iter(flag))}="):
        hessian_trace(est, X, y, n_samples=4, random_state=0)
    assert torch.equal(est.trajectory_.parameters(-1), before)


@pytest.mark.parametrize("loss", ["squared_error", "log_loss"])
def test_a_recorded_loop_is_estimated_like_an_estimator(loss):
    # A RecordedNetwork (a user's loop recorded by PathRecorder) is taken where the
    # library takes a fitted estimator: each probe is v^T H v of the loss its y_train is
    # in the terms of, H from a dense Hessian of that loss written out by hand.
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3))
    y = (rng.normal(size=(24, 2)) if loss == "squared_error"
         else rng.randint(0, 3, size=24))
    torch.manual_seed(0)
    n_out = 2 if loss == "squared_error" else 3
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, n_out)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = PathRecorder(net, opt, n_samples=len(X))
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for _ in range(4):
        opt.zero_grad()
        out = net(Xt)
        batch_loss = (0.5 * ((out - yt) ** 2).mean(dim=1).mean() if loss == "squared_error"
                      else torch.nn.functional.cross_entropy(out, yt))
        batch_loss.backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
    recorded = rec.as_estimator(X, y, loss=loss)

    shapes = [p.shape for p in net.parameters()]
    sizes = [int(np.prod(s)) for s in shapes]

    def mean_loss(theta):
        W1, b1, W2, b2 = (p.reshape(s) for p, s in zip(theta.split(sizes), shapes))
        h = torch.tanh(Xt @ W1.T + b1) @ W2.T + b2
        if loss == "squared_error":
            return (0.5 * ((h - yt) ** 2).mean(dim=1)).mean()
        return (torch.logsumexp(h, dim=1) - h[torch.arange(len(h)), yt]).mean()

    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    H = torch.autograd.functional.hessian(mean_loss, theta).numpy()
    V = _probes(0, 30, theta.numel())
    exact = np.einsum("jp,pq,jq->j", V, H, V)

    res = hessian_trace(recorded, n_samples=30, random_state=0)
    np.testing.assert_allclose(res.estimates, exact, rtol=1e-10, atol=1e-12)
    explicit = hessian_trace(recorded, X, y, n_samples=30, random_state=0)
    np.testing.assert_allclose(explicit.estimates, exact, rtol=1e-10, atol=1e-12)
    path = hessian_trace_path(recorded, steps=[-1], n_samples=30, random_state=0)
    np.testing.assert_allclose(path.estimates[0], exact, rtol=1e-10, atol=1e-12)


def test_a_recorded_conv_loop_without_training_inputs():
    # hessian_trace_path and loss_path with no X_train: the block size is measured on the
    # X given (activation_widths() with nothing to measure on raised a TypeError). Each
    # sample's loss and every probe's v^T H v against the loss written out with F.conv2d.
    rng = np.random.RandomState(0)
    X = rng.normal(size=(12, 1, 4, 4))
    y = rng.normal(size=(12, 2))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(),
                              torch.nn.Linear(8, 2)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = PathRecorder(net, opt, n_samples=len(X))
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for _ in range(3):
        opt.zero_grad()
        (0.5 * torch.nn.functional.mse_loss(net(Xt), yt)).backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
    recorded = rec.as_estimator(loss="squared_error")
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]

    def per_sample(theta):
        w1, b1, w2, b2 = (p.reshape(s) for p, s in zip(theta.split(sizes), shapes))
        h = torch.nn.functional.conv2d(Xt, w1, b1).reshape(len(Xt), -1) @ w2.T + b2
        return 0.5 * ((h - yt) ** 2).mean(dim=1)

    def loss(theta):
        return per_sample(theta).mean()

    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    np.testing.assert_allclose(loss_path(recorded, X, y, steps=[-1])[:, 0],
                               per_sample(theta).detach().numpy(), rtol=1e-12, atol=1e-14)
    H = torch.autograd.functional.hessian(loss, theta).numpy()
    V = _probes(0, 20, len(theta))
    res = hessian_trace_path(recorded, X, y, steps=[-1], n_samples=20, random_state=0)
    np.testing.assert_allclose(res.estimates[0], np.einsum("jp,pq,jq->j", V, H, V),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("function", [hessian_trace, hessian_trace_path, loss_path])
def test_a_pipeline_stands_for_its_last_step_on_transformed_inputs(function):
    """A Pipeline was admitted by validate_params only to be refused with the kernels'
    hint (pass pipe[-1] on pipe[:-1].transform(X)); the displays take one. It now
    stands for its last step on the inputs the steps before it give, as doing that by
    hand: the same probes give the same numbers, and the trace is the exact trace of
    the last step's loss on the transformed inputs. A bag, whose network saw a sample
    of the rows, is still refused with its hint."""
    from sklearn.ensemble import BaggingRegressor

    X = np.random.RandomState(0).normal(size=(16, 2)) * [1.0, 5.0] + 3.0
    y = np.sin(X[:, 0]) + 0.1 * X[:, 1]
    net = dict(hidden_layer_sizes=(3,), activation="tanh", max_iter=3, tol=None,
               dtype="float64", normalize_y=False, random_state=0)
    pipe = make_pipeline(StandardScaler(), PathKernelMachine(**net)).fit(X, y)
    est, Z = pipe[-1], pipe[:-1].transform(X)
    assert np.abs(Z - X).max() > 1  # the steps change the inputs: the check can fail
    kw = {} if function is loss_path else {"n_samples": 5, "random_state": 0}
    results = [(function(pipe, **kw), function(est, **kw)),
               (function(pipe, X[:7], y[:7], **kw), function(est, Z[:7], y[:7], **kw))]
    for got, by_hand in results:
        got = got if function is loss_path else got.estimates
        by_hand = by_hand if function is loss_path else by_hand.estimates
        np.testing.assert_allclose(got, by_hand, rtol=1e-12, atol=1e-14)
    exact = np.trace(_exact_hessian(est, X=Z, Y=y))
    res = hessian_trace(pipe, X, y, n_samples=400, random_state=0)
    assert abs(res.trace - exact) < 4 * res.stderr
    bag = BaggingRegressor(PathKernelMachine(**net), n_estimators=2, random_state=0).fit(X, y)
    with pytest.raises(TypeError, match=r"estimators_\[0\] holds one"):
        function(bag)


def test_a_frozen_estimator_stands_for_the_estimator_it_holds():
    """The kernels and displays read a FrozenEstimator's network (network_of forwards
    to it); hessian_trace, hessian_trace_path and loss_path refused it in validate_params,
    naming private classes. Its trace is the exact trace of the network it holds, with
    the same probes as the estimator's own, and so are its path and losses."""
    X = np.random.RandomState(0).uniform(-1, 1, size=(12, 2))
    y = np.digitize(X[:, 0], [-0.3, 0.3])
    clf = PathKernelClassifier(hidden_layer_sizes=(3,), activation="tanh", max_iter=3,
                               tol=None, dtype="float64", random_state=0).fit(X, y)
    frozen = FrozenEstimator(clf)
    res = hessian_trace(frozen, n_samples=400, random_state=0)
    exact = np.trace(_exact_hessian(clf))
    assert abs(res.trace - exact) < 4 * res.stderr
    np.testing.assert_array_equal(
        res.estimates, hessian_trace(clf, n_samples=400, random_state=0).estimates)
    np.testing.assert_array_equal(
        hessian_trace_path(frozen, X[:5], y[:5], steps=[0, -1], n_samples=5,
                           random_state=0).estimates,
        hessian_trace_path(clf, X[:5], y[:5], steps=[0, -1], n_samples=5,
                           random_state=0).estimates)
    np.testing.assert_array_equal(loss_path(frozen), loss_path(clf))


@pytest.mark.parametrize("function", [hessian_trace, loss_path])
def test_a_pipeline_ending_in_a_wrapper_gets_the_whole_way_to_its_network(function):
    """Review of s54: a pipeline whose last step is a wrapper (here a
    TransformedTargetRegressor) was unwrapped to that step first, whose refusal named
    regressor_ without the pipeline's part (main named pipe[-1].regressor_, on
    pipe[:-1].transform(X)); the displays lost it the same way."""
    from sklearn.compose import TransformedTargetRegressor

    from skpathkernel.plotting import KernelMatrixDisplay

    X = np.random.RandomState(0).normal(size=(12, 2))
    y = np.sin(X[:, 0])
    pipe = make_pipeline(StandardScaler(), TransformedTargetRegressor(
        PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, tol=None, random_state=0),
        func=np.exp, inverse_func=np.log)).fit(X, y)
    way = r"pipe\[-1\]\.regressor_, .*pipe\[:-1\]\.transform\(X\)"
    with pytest.raises(TypeError, match=way):
        function(pipe)
    with pytest.raises(TypeError, match=way):
        KernelMatrixDisplay.from_estimator(pipe, X)
