"""PathRecorder.set_batch(indices, weights): a user's loop whose loss weighs each sample.

References, none of which reads the recorded path: the loop's own parameters and Adam
second moments copied from torch.optim after every step, each point's share of every step
rebuilt from per-sample gradients (one autograd call per sample) and the segment-averaged
Jacobian of the queries at Gauss-Legendre nodes; the trained module's own outputs for the
closure; an estimator fitted with ``sample_weight`` on the same path; and central finite
differences of the loop's own retraining with one point's weight moved.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
from _reference import gauss_nodes
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathKernelMachine, PathRecorder

N, STEPS, B = 12, 8, 6
RNG = np.random.RandomState(0)
X = torch.as_tensor(RNG.uniform(-1, 1, size=(N, 2)))
Y = (torch.sin(3 * X[:, 0]) + X[:, 1]).reshape(-1, 1)
XQ = RNG.uniform(-1, 1, size=(3, 2))
# Importance / class weights of the points, one negative (a loss the step ascends there).
W = torch.as_tensor(RNG.uniform(0.3, 2.0, size=N))
W[5] = -0.4
BATCHES = [np.random.RandomState(10 + t).choice(N, B, replace=False) for t in range(STEPS)]

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.03, betas=(0.8, 0.9)),
}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 1)).double()


def _per_sample(module, idx):
    return 0.5 * (module(X[idx]) - Y[idx]).pow(2).sum(1)


def _micro(idx, accumulate):
    return np.split(idx, [4]) if accumulate else [idx]


def _coefficients(idx, norm, n_micro):
    """Each sample's coefficient in the micro-batch's loss as the loop writes it below:
    ``(w * l).mean() / n_micro`` or ``(w * l).sum() / w.sum() / n_micro``."""
    w = W[idx]
    return (w / len(idx) if norm == "mean" else w / w.sum()) / n_micro


def _train(make_opt, norm, accumulate, *, record=True, u=None):
    """The user's loop. ``u``: point weights (N,) of the counterfactual training, each
    step's loss ``S_t sum u_i beta_i l_i / sum u_i beta_i`` (beta the loop's coefficients,
    S_t their sum over the step); returns the module, the recorder, the parameters after
    every step and Adam's second moments after every step (copied from torch.optim)."""
    module = _mlp()
    opt = make_opt(module.parameters())
    rec = PathRecorder(module, opt, n_samples=N) if record else None
    points = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    moments = []
    for idx in BATCHES:
        parts = _micro(idx, accumulate)
        opt.zero_grad()
        betas = [_coefficients(part, norm, len(parts)) for part in parts]
        if u is not None:
            S = sum(b.sum() for b in betas)
            total = sum((u[part] * b).sum() for part, b in zip(parts, betas))
        for part, beta in zip(parts, betas):
            w, per = W[part], _per_sample(module, part)
            if u is not None:
                (S * (u[part] * beta * per).sum() / total).backward()
            elif norm == "mean":
                ((w * per).mean() / len(parts)).backward()
            else:
                ((w * per).sum() / w.sum() / len(parts)).backward()
            if rec is not None:
                rec.set_batch(part, weights=beta)
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        if "exp_avg_sq" in opt.state[next(module.parameters())]:
            moments.append(torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1).clone()
                                      for p in module.parameters()]))
    if rec is not None:
        rec.close()
    return module, rec, points, moments


def _outputs_at(flat, Xq):
    module = _mlp()
    params, start = {}, 0
    for name, p in module.named_parameters():
        params[name] = flat[start : start + p.numel()].reshape(p.shape)
        start += p.numel()
    return torch.func.functional_call(module, params, (torch.as_tensor(Xq),))


def _jacobian(flat, Xq):
    """(Q, P): the gradient of each query's output at the parameters ``flat``."""
    flat = flat.detach().clone().requires_grad_(True)
    out = _outputs_at(flat, Xq)[:, 0]
    return torch.stack([torch.autograd.grad(out[q], flat, retain_graph=True)[0]
                        for q in range(len(out))])


def _replay_contributions(name, norm, accumulate, points, moments, nodes):
    """Each point's part (Q, N) of the output's change, from per-sample gradients and
    the optimizer's update written out: SGD's buffer ``m = 0.9 m + g`` (``m = g`` first)
    and Adam's ``m = 0.8 m + 0.2 g``, stepped by ``-lr m`` and ``-lr m / bc1 /
    (sqrt(v / bc2) + eps)``, ``v`` torch's own after the step; each sample keeps its own
    share of ``m``. ``nodes``: the quadrature of the Jacobian over each step's segment."""
    P = points[0].numel()
    shares = torch.zeros(N, P, dtype=torch.float64)
    contrib = np.zeros((len(XQ), N))
    module = _mlp()
    params = list(module.parameters())
    for t, idx in enumerate(BATCHES):
        torch.nn.utils.vector_to_parameters(points[t], params)
        parts = _micro(idx, accumulate)
        own = torch.zeros(N, P, dtype=torch.float64)
        for part in parts:
            beta = _coefficients(part, norm, len(parts))
            for i, b in zip(part, beta):
                loss = _per_sample(module, [i]).sum()
                g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)])
                own[i] += b * g
        if name == "adam":
            shares = 0.8 * shares + 0.2 * own
            den = (moments[t] / (1 - 0.9 ** (t + 1))).sqrt() + 1e-8
            step = -0.03 / (1 - 0.8 ** (t + 1)) * shares / den
        else:
            shares = own if t == 0 else 0.9 * shares + own
            step = -0.1 * shares
        # The per-sample steps add up to torch.optim's own step.
        assert_allclose(step.sum(0), points[t + 1] - points[t], rtol=0, atol=1e-14)
        s, w = nodes
        Jbar = sum(wk * _jacobian(points[t] + sk * (points[t + 1] - points[t]), XQ)
                   for sk, wk in zip(s, w))
        contrib += (Jbar @ step.T).detach().numpy()
    return contrib


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-batch", "accumulate"])
@pytest.mark.parametrize("norm", ["mean", "sum"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_weighted_loop_decomposes_exactly_as_its_per_sample_replay(name, norm,
                                                                    accumulate):
    module, rec, points, moments = _train(OPTIMIZERS[name], norm, accumulate)
    traj = rec.trajectory
    for t, idx in enumerate(BATCHES):
        parts = _micro(idx, accumulate)
        assert_array_equal(traj.batch(t), idx)
        expected = np.concatenate([_coefficients(p, norm, len(parts)) for p in parts])
        assert_allclose(traj.batch_weights(t), expected, rtol=1e-15)
    net = rec.as_network(X.numpy(), Y.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = net.decompose(XQ)
    with torch.no_grad():
        truth = module(torch.as_tensor(XQ)).numpy()
    assert_allclose(res.initial + res.contributions.sum(1) + res.regularization, truth,
                    rtol=0, atol=1e-13)
    assert res.error < 1e-12
    ref = _replay_contributions(name, norm, accumulate, points, moments, gauss_nodes(8, 2))
    scale = np.abs(ref).max()
    assert_allclose(res.contributions[:, :, 0], ref, rtol=0, atol=1e-11 * scale)
    # Declared without its weights, the same loop is split as a mean: it misses.
    unweighted = rec.as_network(X.numpy(), Y.numpy())
    unweighted.trajectory._batch_weights = None
    with pytest.warns(UserWarning, match="misses the prediction"):
        assert unweighted.decompose(XQ).error > 1e-4


def test_weighted_loop_equals_the_estimator_with_sample_weight_for_every_analysis():
    """``(s * l).sum() / s.sum()`` on the estimator's batches, declared with ``s / s.sum()``,
    is the estimator's weighted training: every analysis (the approximate orders, the
    unrolled attribution, self-influence, the path kernel) reads the same weights."""
    s = np.abs(W.numpy()) + 0.1
    est = PathKernelMachine(hidden_layer_sizes=(5,), dtype="float64", random_state=0,
                            normalize_y=False, tol=None, solver="adam",
                            learning_rate_init=0.02, batch_size=4, max_iter=3,
                            alpha=0.0).fit(X.numpy(), Y.numpy()[:, 0], sample_weight=s)
    module = copy.deepcopy(est.module_)
    module.load_state_dict(est.trajectory_.state_dict(0))
    opt = torch.optim.Adam(module.parameters(), lr=0.02)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in est.trajectory_.batches:
            w = torch.as_tensor(s[idx])
            opt.zero_grad()
            ((w * _per_sample(module, idx)).sum() / w.sum()).backward()
            rec.set_batch(idx, weights=w / w.sum())
            opt.step()
    net = rec.as_estimator(X.numpy(), Y.numpy()[:, 0])
    assert_allclose(net.predict(XQ)[:, 0], est.predict(XQ), rtol=0, atol=1e-12)
    for method in ("exact", "first_order", "second_order"):
        mine, ref = net.decompose(XQ, method=method), est.decompose(XQ, method=method)
        assert_allclose(mine.contributions, ref.contributions, rtol=1e-9,
                        atol=1e-12 * np.abs(ref.contributions).max(), err_msg=method)
    mine = net.attribute(XQ, method="unrolled")
    ref = est.attribute(XQ, method="unrolled")
    assert_allclose(mine, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    assert_allclose(net.self_influence(), est.self_influence(), rtol=1e-9,
                    atol=1e-12 * np.abs(est.self_influence()).max())
    assert_allclose(net.path_kernel_(XQ, X.numpy()), est.path_kernel_(XQ, X.numpy()),
                    rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, norm, accumulate", [("sgd-momentum", "mean", True),
                                                    ("adam", "sum", False),
                                                    ("adam", "mean", True)])
def test_weighted_loop_attribution_matches_finite_differences_of_its_retraining(
        name, norm, accumulate):
    _, rec, _, _ = _train(OPTIMIZERS[name], norm, accumulate)
    net = rec.as_network(X.numpy(), Y.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = net.attribute(XQ, method="unrolled")
    assert scores.replay_error < 1e-12
    # Adam's steps bend sharply in the weights here: the central difference's error at
    # h = 1e-5 was 1.6e-6 of the scores (1.6e-8 at 1e-6, converging as h^2).
    h = 1e-6
    for i in (int(BATCHES[0][0]), 5, int(BATCHES[-1][-1])):  # 5: the negative weight
        up, down = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)
        up[i] += h
        down[i] -= h
        plus = _train(OPTIMIZERS[name], norm, accumulate, record=False, u=up)[0]
        minus = _train(OPTIMIZERS[name], norm, accumulate, record=False, u=down)[0]
        with torch.no_grad():
            xq = torch.as_tensor(XQ)
            fd = (plus(xq) - minus(xq))[:, 0].numpy() / (2 * h)
        assert_allclose(scores[:, i], fd, rtol=1e-6, atol=1e-7 * np.abs(scores).max())
    # Self-influence is the unrolled attribution's diagonal on the training inputs.
    full = net.attribute(X.numpy(), method="unrolled")
    assert_allclose(net.self_influence(), np.diag(full), rtol=1e-10,
                    atol=1e-13 * np.abs(full).max())


def _one_step_recorder():
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    return module, opt, PathRecorder(module, opt, n_samples=N)


@pytest.mark.parametrize("weights, match", [
    (np.ones(3), r"weights must have shape \(4,\), one per index of the batch, got "
                 r"shape \(3,\)"),
    (np.ones((4, 1)), r"shape \(4,\).*got shape \(4, 1\)"),
    (np.array([0.25, np.nan, 0.25, np.inf]), r"weights must be finite, but 2 of 4 are "
                                             r"not \(entry 1 is nan\)"),
    (np.array([True, False, True, True]), r"weights must be real numbers .*dtype bool"),
    (["a", "b", "c", "d"], r"weights must be real numbers"),
    (torch.ones(4, dtype=torch.complex128), r"weights must be real numbers, got a "
                                           r"torch.complex128 tensor"),
])
def test_bad_weights_are_refused_and_keep_what_was_declared(weights, match):
    module, opt, rec = _one_step_recorder()
    first, second = np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])
    loss = 0.5 * (_per_sample(module, first).mean() + _per_sample(module, second).mean())
    loss.backward()
    rec.set_batch(first, weights=np.full(4, 0.125))
    with pytest.raises(ValueError, match=match):
        rec.set_batch(second, weights=weights)
    # The refused call changed nothing: the first micro-batch is still declared, and
    # the second, declared again without weights, takes the default 1 / (2 * 4).
    rec.set_batch(second)
    opt.step()
    traj = rec.trajectory
    assert_array_equal(traj.batch(0), np.r_[first, second])
    assert traj._batch_weights is None  # all 1 / 8: the mean, stored as the default
    assert_allclose(traj.batch_weights(0), np.full(8, 0.125))


def test_weights_given_as_a_tensor_of_any_float_dtype_and_mixed_with_defaults():
    module, opt, rec = _one_step_recorder()
    first, second = np.array([0, 1, 2]), np.array([4, 5])
    w = torch.tensor([0.5, -0.25, 0.125], dtype=torch.bfloat16, requires_grad=True)
    ((w.double() * _per_sample(module, first)).sum() / 2
     + _per_sample(module, second).mean() / 2).backward()
    rec.set_batch(torch.as_tensor(first), weights=w / 2)
    rec.set_batch(second)  # the default: 1 / (n_micro * 2)
    opt.step()
    assert_allclose(rec.trajectory.batch_weights(0), [0.25, -0.125, 0.0625, 0.25, 0.25],
                    rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = rec.as_network(X.numpy(), Y.numpy()).decompose(XQ)
    assert res.error < 1e-13


def test_weights_that_cancel_decompose_but_the_unrolled_attribution_refuses_them():
    """A step whose coefficients sum to 0 (a contrastive pair) is split exactly; the
    unrolled attribution's re-weighted mean keeps the step's total, which is 0 there."""
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for t, idx in enumerate(BATCHES[:4]):
            beta = W[idx] / W[idx].sum()
            if t == 2:
                beta = torch.tensor([0.1, 0.2, -0.3, 0.5, -0.25, -0.25], dtype=torch.float64)
            opt.zero_grad()
            (beta * _per_sample(module, idx)).sum().backward()
            rec.set_batch(idx, weights=beta)
            opt.step()
    net = rec.as_network(X.numpy(), Y.numpy())
    res = net.decompose(XQ)
    with torch.no_grad():
        truth = module(torch.as_tensor(XQ)).numpy()
    assert_allclose(res.reconstruction, truth, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match=r"weights of 1 step\(s\) sum to 0 without all "
                                         r"being 0 \(first: step 2"):
        net.attribute(XQ, method="unrolled")
    with pytest.raises(ValueError, match="sum to 0 without all being 0"):
        net.self_influence()


def test_a_thinned_weighted_path_replays_its_intervals_with_their_weights():
    """record_every=2: the unrolled attribution replays the steps between two recorded
    points with each step's declared weights, and scores as on the full path."""

    def scores(every):
        module = _mlp()
        opt = OPTIMIZERS["adam"](module.parameters())
        with PathRecorder(module, opt, n_samples=N, record_every=every) as rec:
            for idx in BATCHES:
                parts = _micro(idx, True)
                opt.zero_grad()
                for part in parts:
                    w = W[part]
                    ((w * _per_sample(module, part)).mean() / 2).backward()
                    rec.set_batch(part, weights=w / len(part) / 2)
                opt.step()
        net = rec.as_network(X.numpy(), Y.numpy())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return net.attribute(XQ, method="unrolled")

    full, thinned = scores(1), scores(2)
    assert thinned.replay_error < 1e-12
    assert_allclose(thinned, full, rtol=0, atol=1e-13 * np.abs(full).max())
