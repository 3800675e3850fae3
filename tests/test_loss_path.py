"""loss_path against a plain loop: each recorded point loaded into a copy of the module,
a forward pass and torch's own per-sample loss."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.exceptions import NotFittedError

from skpathkernel import PathKernelClassifier, PathKernelMachine, PathRecorder, TangentFeatures
from skpathkernel.diagnostics import loss_path


def _reference(module, state_dicts, X, target, loss):
    """Per-sample losses (n, n_points) by a plain loop; ``target`` in the loss's terms
    (class codes, a 0/1 float column, standardized regression targets)."""
    X = torch.as_tensor(np.array(X, dtype=np.float64))
    target = torch.as_tensor(np.asarray(target))
    module = copy.deepcopy(module).double().eval()
    columns = []
    for sd in state_dicts:
        module.load_state_dict(sd)
        with torch.no_grad():
            out = module(X)
        if loss == "mse":
            per_sample = 0.5 * F.mse_loss(out, target.reshape(out.shape).double(),
                                          reduction="none").mean(dim=1)
        elif loss == "bce":
            per_sample = F.binary_cross_entropy_with_logits(out[:, 0], target.double(),
                                                            reduction="none")
        else:
            per_sample = F.cross_entropy(out, target.long(), reduction="none")
        columns.append(per_sample.numpy())
    return np.column_stack(columns)


def _points(est):
    return [est.trajectory_.state_dict(k) for k in range(len(est.trajectory_))]


def _fitted(kind, **params):
    rng = np.random.RandomState(0)
    X = rng.normal(size=(50, 3))
    common = dict(hidden_layer_sizes=(7,), max_iter=8, tol=None, dtype="float64",
                  random_state=0, batch_size=16, **params)
    if kind == "regression":
        # Targets far from unit scale: normalize_y's units show.
        Y = np.column_stack([10 + 5 * np.sin(X[:, 0]), -3 + 0.1 * X[:, 1] * X[:, 2]])
        # early_stopping: X_fit_ is a subset of X, train_indices_ maps it.
        est = PathKernelMachine(normalize_y=True, early_stopping=True, **common)
        return est, X, Y
    labels = np.array(["a", "b", "c"])[: 2 if kind == "binary" else 3]
    y = labels[(X[:, 0] > 0).astype(int) + (kind == "multiclass") * (X[:, 1] > 0.5)]
    return PathKernelClassifier(early_stopping=True, **common), X, y


def _target_and_loss(est, y):
    """The targets in the loss's terms, computed here from the labels given to fit."""
    if isinstance(est, PathKernelClassifier):
        codes = np.searchsorted(est.classes_, y)
        return codes, "bce" if len(est.classes_) == 2 else "ce"
    return y, "mse"


@pytest.mark.parametrize("kind", ["binary", "multiclass", "regression"])
def test_matches_a_loop_over_the_recorded_points(kind):
    est, X, y = _fitted(kind)
    est.fit(X, y)
    rows = est.train_indices_
    assert len(rows) < len(X)  # early_stopping held rows out
    Y = y[rows]
    if kind == "regression":
        # What training minimised: the standardized targets of the rows trained on.
        Y = (Y - Y.mean(axis=0)) / Y.std(axis=0)
    target, loss = _target_and_loss(est, Y)
    expected = _reference(est.module_, _points(est), X[rows], target, loss)

    before = [p.detach().clone() for p in est.module_.parameters()]
    got = loss_path(est)
    assert got.dtype == np.float64 and got.shape == (len(rows), len(est.trajectory_))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    # The estimator is not modified.
    for p, q in zip(est.module_.parameters(), before):
        assert torch.equal(p, q)

    # Explicit data (the rows trained on, as labels) gives the same values.
    np.testing.assert_allclose(loss_path(est, X[rows], y[rows]), expected, rtol=1e-12,
                               atol=1e-14)
    # Selected points, negative indices, an even spacing, blocks of 7 rows.
    np.testing.assert_allclose(loss_path(est, steps=[-1, 0, 3]), expected[:, [-1, 0, 3]],
                               rtol=1e-12, atol=1e-14)
    n = len(est.trajectory_)
    np.testing.assert_allclose(loss_path(est, steps=3),
                               expected[:, [0, round((n - 1) / 2), n - 1]], rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_allclose(loss_path(est, batch_size=7), expected, rtol=1e-12,
                               atol=1e-14)


def test_held_out_rows():
    # The rows early_stopping held out are any data: their losses along the path.
    est, X, y = _fitted("multiclass")
    est.fit(X, y)
    held = np.setdiff1d(np.arange(len(X)), est.train_indices_)
    target, loss = _target_and_loss(est, y[held])
    np.testing.assert_allclose(loss_path(est, X[held], y[held]),
                               _reference(est.module_, _points(est), X[held], target, loss),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["binary", "regression"])
def test_a_weighted_fit_gives_unweighted_per_sample_losses(kind):
    est, X, y = _fitted(kind)
    w = np.random.RandomState(1).randint(0, 4, size=len(X)).astype(np.float64)
    est.set_params(early_stopping=False).fit(X, y, sample_weight=w)
    Y = y
    if kind == "regression":
        # normalize_y's moments of a weighted fit are the weighted ones.
        mean = np.average(y, axis=0, weights=w)
        Y = (y - mean) / np.sqrt(np.average((y - mean) ** 2, axis=0, weights=w))
    target, loss = _target_and_loss(est, Y)
    np.testing.assert_allclose(loss_path(est),
                               _reference(est.module_, _points(est), X, target, loss),
                               rtol=1e-12, atol=1e-14)


def test_float32_estimator():
    est, X, y = _fitted("multiclass")
    est.set_params(dtype="float32").fit(X, y)
    target, loss = _target_and_loss(est, y[est.train_indices_])
    expected = _reference(est.module_, _points(est), X[est.train_indices_], target, loss)
    got = loss_path(est)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_meta_estimator_stands_for_its_estimator():
    est, X, y = _fitted("binary")
    meta = TangentFeatures(est).fit(X, y)
    np.testing.assert_array_equal(loss_path(meta), loss_path(meta.estimator_))


@pytest.mark.parametrize("loss", ["squared_error", "log_loss"])
def test_a_recorded_loop(loss):
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3))
    y = rng.normal(size=(24, 2)) if loss == "squared_error" else rng.randint(0, 3, size=24)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 2 if loss == "squared_error" else 3)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = PathRecorder(net, opt, n_samples=len(X))
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    states = [copy.deepcopy(net.state_dict())]
    for _ in range(4):
        opt.zero_grad()
        out = net(Xt)
        (0.5 * F.mse_loss(out, yt) if loss == "squared_error"
         else F.cross_entropy(out, yt)).backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
        states.append(copy.deepcopy(net.state_dict()))
    recorded = rec.as_estimator(X, y, loss=loss)
    expected = _reference(net, states, X, y, "mse" if loss == "squared_error" else "ce")
    np.testing.assert_allclose(loss_path(recorded), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(loss_path(recorded, X[:5], y[:5], steps=[-1]),
                               expected[:5, -1:], rtol=1e-12, atol=1e-14)


def test_bad_input():
    with pytest.raises(NotFittedError):
        loss_path(PathKernelClassifier())
    est, X, y = _fitted("multiclass")
    est.fit(X, y)
    before = [p.detach().clone() for p in est.module_.parameters()]
    n = len(est.trajectory_)
    with pytest.raises(ValueError, match="inconsistent"):
        loss_path(est, X, y[:-1])
    with pytest.raises(IndexError, match=f"step {n} is out of range for {n} recorded"):
        loss_path(est, steps=[0, n])
    with pytest.raises(IndexError, match="out of range"):
        loss_path(est, steps=[-n - 1])
    with pytest.raises(ValueError, match="both X and y"):
        loss_path(est, X)
    with pytest.raises(ValueError, match="labels not seen in fit"):
        loss_path(est, X[:2], ["a", "z"])
    with pytest.raises(ValueError, match="features"):
        loss_path(est, X[:, :2], y)
    with pytest.raises(ValueError, match="steps must be a non-empty sequence of integers"):
        loss_path(est, steps=[0.5])
    with pytest.raises(ValueError, match="steps must be a 1-D sequence"):
        loss_path(est, steps=[[0, 1]])
    with pytest.raises(ValueError, match="'batch_size' parameter"):
        loss_path(est, batch_size=0)
    with pytest.raises(ValueError, match="'estimator' parameter"):
        loss_path(object())
    for p, q in zip(est.module_.parameters(), before):
        assert torch.equal(p, q)
    assert len(est.trajectory_) == n
