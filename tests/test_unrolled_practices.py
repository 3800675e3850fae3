"""attribute(method="unrolled") on the training practices of real runs: norm clipping,
parameter groups with their own step sizes and weight decays, and per-point batch weights
(DDP's unequal shards), alone and with momentum / Adam.

Two references, neither of which reads the recorded path: autograd through a plain torch
replay of the training written out in the test (each step's loss weighted by a leaf vector
``w``, the clip factor ``min(1, max_norm / (|g| + 1e-6))`` computed from ``w`` so that
autograd differentiates it, each group's step size and decay), and central finite
differences of torch.optim's own training (torch's ``clip_grad_norm_``, the optimizer's
groups) with one point's weight moved.
"""

import warnings

import numpy as np
import pytest
import torch
from _reference import pin

from skpathkernel import PathRecorder

N, STEPS, MAX_NORM = 16, 12, 0.3
RNG = np.random.RandomState(0)
X = torch.as_tensor(RNG.uniform(-1, 1, size=(N, 3)))
Y = torch.sin(X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).reshape(-1, 1)
XQ = torch.as_tensor(RNG.uniform(-1, 1, size=(3, 3)))
BATCHES = [np.random.RandomState(1 + t).choice(N, 8, replace=False) for t in range(STEPS)]
# DDP over two ranks with shards of 5 and 3 points: the loss is the mean of the shards'
# means, so a point weighs 1 / (2 * its shard's size).
BETA = np.r_[np.full(5, 1 / 10), np.full(3, 1 / 6)]

CASES = {
    "clip-sgd-momentum": dict(opt="sgd", lr=(0.5, 0.5), wd=(0.0, 0.0), clip=True),
    "groups-sgd-momentum": dict(opt="sgd", lr=(0.3, 0.1), wd=(0.05, 0.0), clip=False),
    "clip-groups-sgd-momentum": dict(opt="sgd", lr=(0.5, 0.2), wd=(0.05, 0.0), clip=True),
    "clip-groups-adamw": dict(opt="adamw", lr=(0.02, 0.05), wd=(0.1, 0.0), clip=True),
    "clip-groups-adam-l2": dict(opt="adam", lr=(0.02, 0.05), wd=(0.01, 0.0), clip=True),
    "clip-groups-rmsprop": dict(opt="rmsprop", lr=(0.01, 0.02), wd=(0.01, 0.0), clip=True),
    "groups-rmsprop-l2": dict(opt="rmsprop", lr=(0.005, 0.01), wd=(0.05, 0.0), clip=False),
    "clip-weights-sgd-momentum": dict(opt="sgd", lr=(0.5, 0.5), wd=(0.0, 0.0), clip=True,
                                      weights=True),
    "weights-groups-adam": dict(opt="adam", lr=(0.02, 0.05), wd=(0.0, 0.0), clip=False,
                                weights=True),
}


def _lr_at(case, t):
    """Each group's step size at step t: the biases' decays along the run (the weights'
    with ``decay_weights``)."""
    return (case["lr"][0] * case.get("decay_weights", 1.0)**t,
            case["lr"][1] * case.get("decay", 0.95)**t)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 1)).double()


def _is_weight(names):
    return [n.endswith("weight") for n in names]


def _beta(case):
    return torch.as_tensor(BETA if case.get("weights") else np.full(8, 1 / 8))


def _train(case, w, *, record=False, record_every=1, dtype=torch.float64):
    """torch.optim's own training with per-point weights ``w`` (N,) in every step's loss,
    ``sum_i w_i beta_i l_i / sum_i w_i beta_i``, in ``dtype``; returns the module (or the
    recorded network)."""
    module = _mlp().to(dtype)
    names = [n for n, _ in module.named_parameters()]
    params = list(module.parameters())
    groups = [{"params": [p for p, is_w in zip(params, _is_weight(names)) if is_w == want],
               "lr": lr, "weight_decay": wd}
              for want, lr, wd in zip((True, False), case["lr"], case["wd"])]
    if case["opt"] == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    elif case["opt"] == "adamw":
        opt = torch.optim.AdamW(groups, lr=0.1, betas=(0.8, 0.9))
    elif case["opt"] == "rmsprop":
        opt = torch.optim.RMSprop(groups, lr=0.1, alpha=0.9)
    else:
        opt = torch.optim.Adam(groups, lr=0.1, betas=(0.8, 0.9))
    rec = (PathRecorder(module, opt, n_samples=N, record_every=record_every) if record
           else None)
    beta, w, Xd, Yd = (v.to(dtype) for v in (_beta(case), w, X, Y))
    for t, idx in enumerate(BATCHES):
        for group, lr in zip(opt.param_groups, _lr_at(case, t)):
            group["lr"] = lr
        opt.zero_grad()
        per = 0.5 * (module(Xd[idx]) - Yd[idx]).pow(2).sum(1)
        wb = w[idx] * beta
        (wb * per).sum().div(wb.sum()).backward()
        if case["clip"]:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        if rec is not None:
            rec.set_batch(idx)
        opt.step()
    if rec is None:
        return module
    rec.close()
    net = rec.as_network(X, Y)
    if case.get("weights"):
        # What the recorder writes under DDP with these shards (tests/test_distributed.py
        # checks that it does): each entry's weight in its step's loss.
        net.trajectory._batch_weights = np.tile(BETA, STEPS)
    return net


def _replay(case, w, factors=None, traj=None):
    """The same training as one differentiable graph in ``w`` (the optimizers' documented
    updates written out), final outputs at the queries (Q,). ``factors``: clip factors
    held constant instead of computed from ``w``. ``traj``: a recorded (float32) path
    whose values every step is held at (its points, second moments, Adam's first moment
    as its step implies it, batch weights), their derivatives the update's, from its
    initialization and with the inputs rounded as the training took them: the
    derivative of the training map at the recorded states."""
    module = _mlp()
    names = [n for n, _ in module.named_parameters()]
    theta = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    Xd, XQd = X, XQ
    if traj is not None:
        theta = [p.double().requires_grad_(True) for p in traj.state_dict(0).values()]
        Xd, XQd = (v.to(traj.dtype).double() for v in (X, XQ))
    is_w = _is_weight(names)
    m = [torch.zeros_like(p) for p in theta]
    v = [torch.zeros_like(p) for p in theta]
    b1, b2, eps = 0.8, 0.9, 1e-8
    beta = _beta(case)
    for t, idx in enumerate(BATCHES):
        out = torch.func.functional_call(module, dict(zip(names, theta)), (Xd[idx],))
        per = 0.5 * (out - Y[idx]).pow(2).sum(1)
        wb = w[idx] * beta
        share = wb / wb.sum()
        if traj is not None:
            share = pin(share, traj.batch_weights(t))
            after = list(traj.unflatten(traj.parameters(t + 1).double()).values())
            state = {k: list(traj.unflatten(s.double()).values())
                     for k, s in traj.optimizer_state(t).items() if k != "step"}
        grads = torch.autograd.grad((share * per).sum(), theta, create_graph=True)
        if case["clip"]:
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            factor = (torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0) if factors is None
                      else float(factors[t]))
            grads = [factor * g for g in grads]
        lrs = _lr_at(case, t)
        new = []
        for k, (p, g) in enumerate(zip(theta, grads)):
            lr, wd = lrs[0 if is_w[k] else 1], case["wd"][0 if is_w[k] else 1]
            if case["opt"] == "adamw":
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
            if case["opt"] == "sgd":
                m[k] = g if t == 0 else 0.9 * m[k] + g
                new.append(p - lr * m[k])
            elif case["opt"] == "rmsprop":
                v[k] = 0.9 * v[k] + 0.1 * g * g
                if traj is not None:
                    v[k] = pin(v[k], state["square_avg"][k])
                new.append(p - lr * g / (v[k].sqrt() + eps))
            else:
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                if traj is not None:
                    v[k] = pin(v[k], state["exp_avg_sq"][k])
                den = (v[k] / (1 - b2 ** (t + 1))).sqrt() + eps
                if traj is not None:  # p - lr m / bc1 / den = the recorded point
                    m[k] = pin(m[k], (p - after[k]) * den * (1 - b1 ** (t + 1)) / lr)
                new.append(p - lr * m[k] / (1 - b1 ** (t + 1)) / den)
            if traj is not None:
                new[-1] = pin(new[-1], after[k])
        theta = new
    return torch.func.functional_call(module, dict(zip(names, theta)), (XQd,))[:, 0]


def _autograd_reference(case, factors=None, traj=None):
    w = torch.ones(N, dtype=torch.float64, requires_grad=True)
    out = _replay(case, w, factors, traj)
    return np.stack([torch.autograd.grad(out[q], w, retain_graph=True)[0].numpy()
                     for q in range(len(XQ))])


def _scores(case, record_every=1):
    net = _train(case, torch.ones(N, dtype=torch.float64), record=True,
                 record_every=record_every)
    traj = net.trajectory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: neither the replay nor the clip check warns
        scores = net.attribute(XQ.numpy(), method="unrolled")
    return scores, traj


def _rel(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.usefixtures("unrolled_route")
def test_unrolled_is_the_derivative_of_the_training_with_these_practices(name):
    case = CASES[name]
    scores, traj = _scores(case)
    if case["clip"]:
        assert traj.gradient_scales.min() < 0.7  # the clip acted
        assert (traj.gradient_scales == 1.0).any()  # and some steps it did not clip
    assert scores.replay_error < 1e-12
    ref = _autograd_reference(case)
    assert _rel(scores, ref) < 1e-12, _rel(scores, ref)


@pytest.mark.parametrize("name", ["clip-groups-sgd-momentum", "clip-weights-sgd-momentum",
                                  "clip-groups-adamw"])
def test_unrolled_matches_finite_differences_of_torch_optim(name):
    case = CASES[name]
    scores, _ = _scores(case)
    h = 1e-5
    for i in (int(BATCHES[0][0]), int(BATCHES[-1][-1])):
        up, down = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)
        up[i] += h
        down[i] -= h
        plus, minus = _train(case, up), _train(case, down)
        with torch.no_grad():
            fd = (plus(XQ) - minus(XQ))[:, 0].numpy() / (2 * h)
        np.testing.assert_allclose(scores[:, i], fd, rtol=1e-6,
                                   atol=1e-7 * np.abs(scores).max())


def test_thinned_clipped_path_replays_its_intervals_exactly():
    """record_every=2: the unrecorded steps are replayed with their recorded factors and
    group step sizes, and the clip's derivative taken on the replayed gradients (the step
    sizes held within each interval: a thinned path records one per interval)."""
    case = {**CASES["clip-groups-sgd-momentum"], "decay": 1.0}
    full, _ = _scores(case)
    thin, traj = _scores(case, record_every=2)
    assert len(traj) < STEPS
    assert thin.replay_error < 1e-10
    assert _rel(thin, full) < 1e-9


@pytest.mark.parametrize("name, decay_weights", [("clip-groups-sgd-momentum", 1.0),
                                                 ("groups-sgd-momentum", 0.9),
                                                 ("clip-groups-adamw", 0.9)])
def test_thinned_path_replays_a_scheduler_inside_its_intervals(name, decay_weights):
    """record_every=3 with the groups' step sizes decaying at every step (a scheduler):
    every step's group step sizes are kept and replayed, the scores are the independent
    reference's (step sizes from the schedule, not the record) and nothing warns. With
    ``decay_weights=1`` only the smaller group's step size varies (the largest, the
    path's learning_rates, does not); otherwise both do."""
    case = {**CASES[name], "decay_weights": decay_weights}
    thin, traj = _scores(case, record_every=3)
    assert len(traj) < STEPS and traj.record_every == 3
    assert thin.replay_error < 1e-12
    assert _rel(thin, _autograd_reference(case)) < 1e-12
    lrs = np.array([_lr_at(case, t) for t in range(STEPS)])
    np.testing.assert_allclose(traj.step_learning_rates, lrs.max(1), rtol=1e-15)
    # Each interval's step size scale is the ratio of its groups' total step sizes (the
    # path kernel's weights of its point).
    for k in range(len(traj) - 1):
        seg = lrs[traj.steps[k]:traj.steps[k + 1]]
        total = traj.learning_rates[k] * len(seg)
        scales = traj.step_size_scales(k)
        scales = np.ones(traj.n_params) if scales is None else scales.numpy()
        groups = np.repeat([0 if w else 1 for w in _is_weight(traj.names)],
                           [int(np.prod(s)) for s in traj.shapes])
        np.testing.assert_allclose(total * scales, seg.sum(0)[groups], rtol=1e-14)


@pytest.mark.parametrize("name", ["clip-groups-adamw", "clip-groups-adam-l2",
                                  "clip-groups-rmsprop", "groups-rmsprop-l2",
                                  "weights-groups-adam"])
@pytest.mark.usefixtures("unrolled_route")
def test_float32_paths_with_these_practices_are_scored_at_their_states(name):
    """A float32 training with these practices: the scores are the derivative of the
    training map at the recorded states (the replay held at the record) to float32
    round-off. With the step's coupled weight decay and batch weights in float32 beside
    its float64 gradient, groups-rmsprop-l2 was 1.0e-5 off it (2e-7 to 2e-6 now), a
    review's paths 1.2e-5 (Adam, clipped) to 3.6e-4 (RMSprop, groups). The clipped
    RMSprop path's float32 record, divided by sqrt(v), leaves it 5.4e-6 off on an Intel
    Xeon host (under 3e-6 on an AMD EPYC one): its bar is 1e-5, 36x under that bug's."""
    case = CASES[name]
    net = _train(case, torch.ones(N, dtype=torch.float64), record=True, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what float32 gradients would move: not this test's
        scores = net.attribute(XQ.numpy(), method="unrolled")
    bar = 1e-5 if name == "clip-groups-rmsprop" else 3e-6
    assert _rel(scores, _autograd_reference(case, traj=net.trajectory)) < bar


def test_the_clip_derivative_is_needed():
    """Treating the recorded factors as constants (the derivative without d c / d w) is
    far from the reference: the test above has teeth."""
    case = CASES["clip-sgd-momentum"]
    scores, traj = _scores(case)
    naive = _autograd_reference(case, factors=traj.gradient_scales)
    assert _rel(naive, np.asarray(scores)) > 0.05


def test_factors_that_are_not_a_norm_clip_are_reported():
    """A constant factor of 0.5 on every gradient looks like clipping with a max_norm
    that changes at every step: the scores say they differentiate it as one."""
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in BATCHES:
            opt.zero_grad()
            (0.5 * (module(X[idx]) - Y[idx]).pow(2).sum(1)).mean().backward()
            for p in module.parameters():
                p.grad.mul_(0.5)
            rec.set_batch(idx)
            opt.step()
    assert np.allclose(rec.trajectory.gradient_scales, 0.5)
    with pytest.warns(UserWarning, match="not those of one clip_grad_norm_"):
        rec.as_network(X, Y).attribute(XQ.numpy(), method="unrolled")
