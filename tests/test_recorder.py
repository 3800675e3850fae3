"""PathRecorder: a user's own loop, recorded, against the estimators and torch itself.

References are independent of the recorder: the estimators' own training loop (same
initialization and batches, replayed by hand through torch.optim), the scheduler's
``get_last_lr()`` collected in the loop, and the network's own outputs for the exactness
of the decomposition.
"""

import copy
import gc
import inspect
import io
import re
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from _reference import features_loop, jacobian_loop, module_at, own_loop
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.base import clone
from sklearn.utils import get_tags

from skpathkernel import (
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    RecordedNetwork,
    TangentFeatures,
    TangentKernel,
)
from skpathkernel._path._losses import LOSSES
from skpathkernel.rules import layer_routes

DOCS = Path(__file__).resolve().parents[1] / "docs"

SOLVERS = {
    "sgd-momentum-l2": (dict(solver="sgd", learning_rate_init=0.05, momentum=0.9, alpha=0.01),
                        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01,
                                                  nesterov=True)),
    "sgd-heavy-ball-l2": (dict(solver="sgd", learning_rate_init=0.05, momentum=0.9, alpha=0.01,
                               nesterovs_momentum=False),
                          lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9,
                                                    weight_decay=0.01)),
    "adam-l2": (dict(solver="adam", learning_rate_init=0.01, alpha=0.01),
                lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    "adamw": (dict(solver="adamw", learning_rate_init=0.01, alpha=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "rmsprop": (dict(solver="rmsprop", learning_rate_init=0.005),
                lambda p: torch.optim.RMSprop(p, lr=0.005)),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 2))
    return X, np.sin(3 * X[:, 0]) + X[:, 1], rng.uniform(-1, 1, size=(3, 2))


def _replay(est, make_optimizer, Y, loss, *, scheduler=None):
    """The user's loop: est's initial module and batches, driven by hand."""
    module = copy.deepcopy(est.module_)
    module.load_state_dict(est.trajectory_.state_dict(0))
    opt = make_optimizer(module.parameters())
    sched = None if scheduler is None else scheduler(opt)
    X = torch.as_tensor(est.X_fit_)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for idx in est.trajectory_.batches:
            opt.zero_grad()
            loss(module(X[idx]), Y[idx]).backward()
            rec.set_batch(idx)
            opt.step()
            if sched is not None:
                sched.step()
    return module, rec


def _tanh_mlp():
    """The seeded 2-5-1 tanh network of the hand-written loops, float64."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 1)).double()


def _assert_decomposes(module, net, Xq):
    """The decomposition's closure against the trained module's own outputs, and its
    reported error at round-off."""
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    res = net.decompose(Xq)
    assert_allclose(res.initial + res.contributions.sum(1) + res.regularization, truth,
                    rtol=0, atol=1e-12)
    assert res.error < 1e-12


def _assert_same_path(a, b):
    assert len(a) == len(b) and a.solver_spec.to_dict() == b.solver_spec.to_dict()
    assert_array_equal(a.steps, b.steps)
    assert_array_equal(a.learning_rates, b.learning_rates)
    assert all(np.array_equal(x, y) for x, y in zip(a.batches, b.batches))
    assert a.names == b.names and a.n_samples == b.n_samples
    for k in range(len(a)):
        assert_allclose(a.parameters(k), b.parameters(k), rtol=0, atol=1e-14)
    for k in range(len(a) - 1):
        sa, sb = a.optimizer_state(k), b.optimizer_state(k)
        assert sa.keys() == sb.keys()
        for key in sa:
            assert_allclose(sa[key], sb[key], rtol=0, atol=1e-14)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_recorded_loop_equals_the_estimator(data, solver):
    X, y, Xq = data
    params, make_opt = SOLVERS[solver]
    # 6 epochs of 4 minibatches = 24 steps; sgd runs 70 full-batch steps to also cross
    # the recorder's initial buffer capacity (64 steps) and exercise its growth.
    fit = dict(batch_size=None, max_iter=70) if solver.startswith("sgd") else dict(
        batch_size=3, max_iter=6)
    est = PathKernelMachine(hidden_layer_sizes=(5,), dtype="float64", random_state=0,
                            normalize_y=False, tol=None, **params, **fit).fit(X, y)
    Y = torch.as_tensor(y.reshape(-1, 1))
    module, rec = _replay(est, make_opt, Y, LOSSES["squared_error"]())
    _assert_same_path(rec.trajectory, est.trajectory_)
    net = rec.as_estimator(X, y, loss="squared_error")
    assert_allclose(net.predict(Xq)[:, 0], est.predict(Xq), atol=1e-12)
    assert_allclose(net.path_kernel_(Xq, X), est.path_kernel_(Xq, X), rtol=1e-10, atol=1e-12)
    assert_allclose(TangentKernel(net, step=3)(Xq), TangentKernel(est, step=3)(Xq),
                    rtol=1e-10, atol=1e-12)
    mine, ref = net.decompose(Xq), est.decompose(Xq)
    assert_allclose(mine.contributions, ref.contributions, rtol=1e-9, atol=1e-12)
    assert_allclose(mine.regularization, ref.regularization, rtol=1e-9, atol=1e-12)
    assert mine.error < 1e-10


def test_recorded_classifier_loop_and_a_callable_loss(data):
    X, _, Xq = data
    y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5])  # 3 classes
    clf = PathKernelClassifier(hidden_layer_sizes=(4,), solver="adam", learning_rate_init=0.02,
                               batch_size=4, max_iter=4, dtype="float64",
                               random_state=0).fit(X, y)
    Y = torch.as_tensor(y)
    _, rec = _replay(clf, lambda p: torch.optim.Adam(p, lr=0.02), Y, LOSSES["log_loss"]())
    _assert_same_path(rec.trajectory, clf.trajectory_)
    ref = clf.decompose(Xq)
    by_name = rec.as_estimator(X, y, loss="log_loss").decompose(Xq)

    def cross_entropy(output, target):
        return -torch.log_softmax(output, dim=1).gather(1, target[:, None])[:, 0]

    by_callable = rec.as_estimator(X, y, loss=cross_entropy).decompose(Xq)
    for res in (by_name, by_callable):
        assert_allclose(res.contributions, ref.contributions, rtol=1e-9, atol=1e-12)
        assert res.error < 1e-10


def test_errors_on_the_explained_output_name_every_choice(data):
    """A recorded multi-class loop's errors name output='margin' (and explain's 'all'):
    "pass output=<index>" alone hid the margin that y's labels are for."""
    X, _, Xq = data
    y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5])  # 3 classes
    clf = PathKernelClassifier(hidden_layer_sizes=(4,), solver="sgd", batch_size=4,
                               max_iter=2, dtype="float64", random_state=0).fit(X, y)
    _, rec = _replay(clf, lambda p: torch.optim.SGD(p, lr=1e-3), torch.as_tensor(y),
                     LOSSES["log_loss"]())
    net = rec.as_estimator(X, y, loss="log_loss")
    with pytest.raises(ValueError, match=r"3 outputs: pass output=<index> .*output='margin'"):
        net.attribute(Xq, y[:3])
    with pytest.raises(ValueError, match="output='margin', or output='all'"):
        net.network_.explain(Xq, 2)
    with pytest.raises(ValueError, match="'margin' or 'all' or an output index"):
        net.network_.explain(Xq, 2, output="bad")
    # The regressors' errors name no margin.
    with pytest.raises(ValueError, match=r"^output must be an output index in \[0, 1\)"):
        PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, random_state=0).fit(
            X, X[:, 0]).attribute(Xq, output=1)
    # What they name is taken.
    assert net.attribute(Xq, y[:3], output="margin").shape == (3, len(X))
    assert net.network_.explain(Xq, 2, output="all")[1].shape == (3, 2, 3)


def test_explain_ranks_the_attribution_by_its_size(data):
    """RecordedNetwork had no explain (only network_.explain): the recorded loop's
    explain is the attribution's largest |scores|, and every output's summed."""
    X, _, Xq = data
    y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5])  # 3 classes
    clf = PathKernelClassifier(hidden_layer_sizes=(4,), solver="sgd", batch_size=4,
                               max_iter=2, dtype="float64", random_state=0).fit(X, y)
    _, rec = _replay(clf, lambda p: torch.optim.SGD(p, lr=0.1), torch.as_tensor(y),
                     LOSSES["log_loss"]())
    net = rec.as_estimator(X, y, loss="log_loss")
    idx, contrib = net.explain(Xq, 4, output="margin")
    scores = net.attribute(Xq, output="margin")
    order = np.argsort(-np.abs(scores), axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(idx, order)
    assert_allclose(contrib[:, :, 0], np.take_along_axis(scores, order, axis=1))
    idx, contrib = net.explain(Xq, 3, output="all")
    parts = net.decompose(Xq).contributions
    total = np.abs(parts).sum(axis=2)
    np.testing.assert_array_equal(idx, np.argsort(-total, axis=1, kind="stable")[:, :3])
    assert_allclose(contrib, np.take_along_axis(parts, idx[:, :, None], axis=1))


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=12, cycle_momentum=False),
}


def _scheduled_loop(X, Y, make_opt, make_sched, *, n_steps=12, batch=4, record_every=1):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(),
                                 torch.nn.Linear(6, 1)).double()
    opt = make_opt(module.parameters())
    sched = make_sched(opt)
    gen = torch.Generator().manual_seed(1)
    used = []
    rec = PathRecorder(module, opt, n_samples=len(X), record_every=record_every)
    for _ in range(n_steps):
        idx = torch.randperm(len(X), generator=gen)[:batch]
        used.append(sched.get_last_lr()[0])  # the step size the coming step uses
        opt.zero_grad()
        (0.5 * (module(X[idx]) - Y[idx]) ** 2).mean().backward()
        rec.set_batch(idx)
        opt.step()
        sched.step()
    rec.close()
    return module, rec, np.array(used)


@pytest.mark.parametrize("schedule", list(SCHEDULERS))
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "sgd-nesterov", "adam"])
def test_scheduled_step_sizes_are_recorded_and_the_decomposition_is_exact(
        data, schedule, optimizer):
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    make_opt = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9,
                                                          nesterov=True),
                "adam": lambda p: torch.optim.Adam(p, lr=0.05)}[optimizer]
    module, rec, used = _scheduled_loop(Xt, Yt, make_opt, SCHEDULERS[schedule])
    traj = rec.trajectory
    assert len(np.unique(used)) > 1  # the schedule really varies the step size
    assert_allclose(traj.learning_rates, used, rtol=1e-15)
    net = RecordedNetwork(module, traj, X_train=X, y_train=y)
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    res = net.decompose(Xq)
    assert_allclose(res.prediction, truth, rtol=0, atol=1e-14)
    assert res.error < 1e-10
    # The check is sensitive to the step sizes: a constant one would not add up.
    traj.learning_rates[:] = used[0]
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        assert RecordedNetwork(module, traj, X_train=X, y_train=y).decompose(Xq).error > 1e-4


@pytest.mark.parametrize("per_output", ["mean", "sum"])
def test_a_misdeclared_loss_on_a_relu_network_is_not_blamed_on_the_quadrature(
        data, per_output):
    """A ReLU network's steps cross kinks, so the quadrature misses ``tol`` and says so;
    the closure check was then skipped, and a loop whose loss was not the declared one
    (summed over the outputs, where "squared_error" averages them) was blamed on the
    quadrature alone, with an error 500 times the steps' measured residuals. Those
    residuals bound what the quadrature can miss (the triangle inequality over the
    steps); the reference is the trained module's own output."""
    X, _, _ = data
    Y = np.stack([np.sin(3 * X[:, 0]), X[:, 1]], axis=1)
    Xq = X  # twelve queries: some cross a kink at every step
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(),
                                 torch.nn.Linear(32, 2)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for step in range(4):
            idx = np.arange(step % 2, len(X), 2)
            opt.zero_grad()
            sq = (module(torch.as_tensor(X[idx])) - torch.as_tensor(Y[idx])).pow(2)
            (0.5 * (sq.sum(1) if per_output == "sum" else sq).mean()).backward()
            rec.set_batch(idx)
            opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = rec.as_estimator(X, Y).decompose(Xq)
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    miss = np.abs(res.initial + res.contributions.sum(1) + res.regularization - truth).max()
    messages = [str(w.message) for w in caught]
    assert any("did not reach tol" in m for m in messages)  # the kinks
    misdeclared = miss > 100 * res.step_errors.sum()
    assert misdeclared == (per_output == "sum")
    assert any("reconstruction misses" in m for m in messages) == misdeclared


class _NoisyLatent(torch.nn.Module):
    """A VAE's reparameterisation written the natural way: the noise drawn in forward."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        h = self.enc(x)
        return self.dec(torch.tanh(h + 0.5 * torch.randn_like(h)))


def test_a_random_forward_is_named_by_the_quadrature_warning(data):
    """With noise drawn inside forward the exact quadrature never converges (every node
    draws anew); the warning named only relu and large steps, sending the user to the
    learning rate. It now names a forward that draws at random and what to do, and the
    miss is reported, not hidden."""
    X, y, _ = data
    torch.manual_seed(0)
    module = _NoisyLatent().double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(3):
            opt.zero_grad()
            (0.5 * (module(torch.as_tensor(X))[:, 0] - torch.as_tensor(y)).pow(2).mean()
             ).backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = rec.as_estimator(X, y)
        res = net.decompose(X[:3])
    messages = [str(w.message) for w in caught]
    assert any("different outputs for the same input" in m for m in messages)
    quadrature = [m for m in messages if "did not reach tol" in m]
    assert quadrature and "draws at random" in quadrature[0]
    assert "declare its draws as inputs" in quadrature[0]
    assert res.error > 1e-6


def _train_split(opt, kw, split, clip=None, scaler=None, steps=6):
    """A two-layer net trained by one optimizer or by one per layer (its parameters)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    X, Y = torch.randn(8, 3), torch.randn(8, 2)
    parts = [list(net[0].parameters()), list(net[2].parameters())]
    opts = [opt(p, **kw) for p in parts] if split else [opt(net.parameters(), **kw)]
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        loss = ((net(X) - Y) ** 2).mean()
        if scaler is None:
            loss.backward()
        else:  # an overflow in the first layer's gradients only
            scaler.scale(loss).backward()
            net[0].weight.grad[0, 0] = float("inf")
        for p in parts if clip == "part by part" else [net.parameters()] if clip else []:
            torch.nn.utils.clip_grad_norm_(p, 0.05)
        for o in opts:
            scaler.step(o) if scaler is not None else o.step()
        if scaler is not None:
            scaler.update()
    return torch.cat([p.detach().ravel() for p in net.parameters()])


def test_two_optimizers_train_as_one_where_the_error_says():
    """The refusal of a part's parameters advises an optimizer per part, saying that SGD,
    Adam, AdamW and RMSprop train as one optimizer does: bit for bit against the one
    optimizer, with their per-parameter state (momentum, amsgrad's maximum, centered
    averages, weight decay, foreach). The loop around them can break it, which the error
    said nothing of: gradients clipped part by part, and a GradScaler, which skips each
    optimizer's step on its own (one optimizer skips every parameter's)."""
    for opt, kw in [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=0.01)),
                    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.01)),
                    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
                    (torch.optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.5))]:
        assert torch.equal(_train_split(opt, kw, False), _train_split(opt, kw, True))
        assert torch.equal(_train_split(opt, kw, False, clip="all"),
                           _train_split(opt, kw, True, clip="all"))
    sgd = (torch.optim.SGD, dict(lr=0.1))
    assert not torch.allclose(_train_split(*sgd, False, clip="all"),
                              _train_split(*sgd, True, clip="part by part"))
    start = _train_split(*sgd, False, steps=0)
    one = _train_split(*sgd, False, scaler=torch.amp.GradScaler("cpu"), steps=1)
    two = _train_split(*sgd, True, scaler=torch.amp.GradScaler("cpu"), steps=1)
    assert torch.equal(one, start) and not torch.equal(two, start)
    enc, dec = torch.nn.Linear(3, 2), torch.nn.Linear(1, 3)
    with pytest.raises(ValueError, match="its own optimizer") as info:
        PathRecorder(dec, torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1))
    message = " ".join(str(info.value).split())
    assert "clipped over all the parameters" in message
    assert "scheduler stepped for each optimizer" in message
    assert "GradScaler" in message


def test_a_decoder_is_recorded_with_its_own_optimizer():
    """A VAE user recording the decoder alone, the latents ``z_i`` of each step declared
    with their images as targets: one optimizer over the whole VAE is refused, and the
    error said only why; it now says how (its own optimizer), and with two optimizers the
    decoder's decomposition at new latents closes on the decoder's own output."""
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(6, 3, generator=gen, dtype=torch.float64)
    eps = torch.randn(3, 6, 1, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    enc = torch.nn.Linear(3, 2).double()  # mu and log-variance of a 1-D latent
    dec = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.SiLU(),
                              torch.nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match="its own optimizer"):
        PathRecorder(dec, torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1))
    opt_e = torch.optim.SGD(enc.parameters(), lr=0.1)
    opt_d = torch.optim.Adam(dec.parameters(), lr=0.05)
    Z = torch.empty(18, 1, dtype=torch.float64)
    with PathRecorder(dec, opt_d, n_samples=18) as rec:
        for t in range(3):
            h = enc(X)
            z = h[:, :1] + torch.exp(0.5 * h[:, 1:]) * eps[t]
            Z[6 * t:6 * t + 6] = z.detach()
            kl = 0.5 * (h[:, :1] ** 2 + h[:, 1:].exp() - h[:, 1:] - 1).sum(1)
            loss = (0.5 * (dec(z) - X).pow(2).sum(1) + kl).mean()
            opt_e.zero_grad(), opt_d.zero_grad()
            loss.backward()
            rec.set_batch(np.arange(6 * t, 6 * t + 6))
            opt_e.step(), opt_d.step()

    def recon(out, y):
        return 0.5 * (out - y).pow(2).sum(1)

    Y = np.tile(X.numpy(), (3, 1))
    zq = np.linspace(-2, 2, 5).reshape(-1, 1)
    res = rec.as_estimator(Z.numpy(), Y, loss=recon).decompose(zq)
    with torch.no_grad():
        truth = dec(torch.as_tensor(zq)).numpy()
    assert_allclose(res.initial + res.contributions.sum(1) + res.regularization, truth,
                    rtol=0, atol=1e-12)


def test_record_every_keeps_the_total_step_size_and_the_last_point(data):
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))

    def sgd(p):
        return torch.optim.SGD(p, lr=0.05)

    full_module, full, used = _scheduled_loop(Xt, Yt, sgd, SCHEDULERS["step"], n_steps=11)
    _, every, _ = _scheduled_loop(Xt, Yt, sgd, SCHEDULERS["step"], n_steps=11,
                                  record_every=4)
    traj = every.trajectory
    assert_array_equal(traj.steps, [0, 4, 8, 11])
    # Each interval's weight in the path kernel is the sum of its steps' sizes.
    totals = traj.learning_rates * np.diff(traj.steps)
    assert_allclose(totals, [used[0:4].sum(), used[4:8].sum(), used[8:11].sum()], rtol=1e-14)
    for k, step in enumerate(traj.steps):
        assert torch.equal(traj.parameters(k), full.trajectory.parameters(step))
    # Kernels sum the recorded points with those weights: compare to the explicit sum.
    fnet = RecordedNetwork(full_module, full.trajectory)
    expected = sum(w * TangentKernel(fnet, step=int(s))(Xq)
                   for s, w in zip(traj.steps[:-1], totals))
    assert_allclose(PathKernel(RecordedNetwork(full_module, traj))(Xq), expected, rtol=1e-12)


def _small_adam(data):
    """Tensors of ``data``, a small seeded network in float64 and an Adam on it."""
    X, y, _ = data
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(),
                                 torch.nn.Linear(3, 1)).double()
    return (torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1)), module,
            torch.optim.Adam(module.parameters(), lr=0.01))


def test_reading_the_trajectory_midway_does_not_disturb_recording(data):
    Xt, Yt, module, opt = _small_adam(data)
    rec = PathRecorder(module, opt, record_every=3)
    snapshots = []
    for t in range(7):
        opt.zero_grad()
        (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
        opt.step()
        if t in (1, 4):
            snapshots.append(rec.trajectory)
    traj = rec.trajectory
    assert_array_equal(snapshots[0].steps, [0, 2])
    assert_array_equal(snapshots[1].steps, [0, 3, 5])
    assert_array_equal(traj.steps, [0, 3, 6, 7])
    assert torch.equal(snapshots[1].parameters(1), traj.parameters(1))
    assert torch.equal(traj.parameters(-1), torch.cat(
        [p.detach().reshape(-1) for p in module.parameters()]))
    assert traj.n_samples == 0 and traj.n_steps == 7


def test_parameters_and_state_given_new_storage_midway_are_recorded(data):
    # The recorder copies through flat views made once; a parameter given new storage
    # (p.data = ...) or an optimizer state replaced (new tensors) must be what is recorded
    # from then on, not the old storage the views were made of.
    # Values changed outside optimizer.step() are also warned about (that step's record
    # holds the jump): the storage is what this test is about.
    Xt, Yt, module, opt = _small_adam(data)
    points, states = [], []
    with PathRecorder(module, opt) as rec, pytest.warns(
            UserWarning, match=r"parameter\(s\) '0.weight' changed after optimizer step 1"):
        for t in range(6):
            if t == 2:
                first = next(module.parameters())
                first.data = first.data.clone() + 0.25  # new storage, new values
            if t == 4:
                for s in opt.state.values():  # the state: new tensors, new values
                    s["exp_avg_sq"] = s["exp_avg_sq"] * 2.0
            points.append(torch.cat([p.detach().reshape(-1).clone()
                                     for p in module.parameters()]))
            opt.zero_grad()
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            opt.step()
            states.append(torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1).clone()
                                     for p in module.parameters()]))
        points.append(torch.cat([p.detach().reshape(-1).clone()
                                 for p in module.parameters()]))
    traj = rec.trajectory
    for k in (1, 3, 5):  # before and after each change (point 2 predates the first one)
        assert torch.equal(traj.optimizer_state(k)["exp_avg_sq"], states[k])
    for k in (1, 3, 5, 6):
        assert torch.equal(traj.parameters(k), points[k])


@pytest.mark.parametrize("make_opt, match", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "maximize"),
    (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.RMSprop(p, centered=True), "centered"),
    (lambda p: torch.optim.RMSprop(p, momentum=0.5), "momentum"),
    (lambda p: torch.optim.Adam(p, differentiable=True), "differentiable"),
])
def test_unsupported_options_are_refused(make_opt, match):
    module = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=match):
        PathRecorder(module, make_opt(module.parameters()))


def test_sparse_embeddings_are_refused_and_their_dense_twin_records_the_same_path():
    """``nn.Embedding(sparse=True)`` gives sparse gradients, on which the recorder's
    check of the step failed inside ``optimizer.step()`` with torch's
    "Could not run 'aten::ne.Tensor' with arguments from the 'SparseCPU' backend".
    Refused when the recorder is created, naming the layer; ``sparse=False``, as advised,
    trains the same path (torch's own sparse loop is the reference), which is recorded
    exactly, and which the sparse module describes as well (the kernels and the
    decomposition read its gradients densely)."""
    rng = np.random.RandomState(0)
    ids, y = torch.as_tensor(rng.randint(0, 7, size=(8, 3))), torch.randn(8, 1,
                                                                         dtype=torch.float64)

    def make(sparse):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(7, 2, sparse=sparse),
                                   torch.nn.Flatten(), torch.nn.Linear(6, 1)).double()

    def train(module, rec=None):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        if rec is not None:
            rec = rec(module, opt)
        for t in range(3):
            idx = np.arange(4) + 4 * (t % 2)
            opt.zero_grad()
            (0.5 * (module(ids[idx]) - y[idx]) ** 2).mean().backward()
            if rec is not None:
                rec.set_batch(idx)
            opt.step()
        return rec

    with pytest.raises(ValueError, match=r"Layer\(s\) '0' of the module are embeddings "
                                         "with sparse=True"):
        train(make(True), lambda m, o: PathRecorder(m, o, n_samples=8))
    truth = make(True)
    train(truth)
    dense = make(False)
    rec = train(dense, lambda m, o: PathRecorder(m, o, n_samples=8))
    for (name, p), q in zip(truth.named_parameters(), dense.parameters()):
        assert_allclose(q.detach(), p.detach(), rtol=0, atol=1e-15, err_msg=name)
    _assert_decomposes(dense, rec.as_network(ids, y), ids[:3].numpy())
    # The error's advice is the whole story: the sparse module (the same parameters) has
    # the recorded path's kernel and decomposition, so nothing else refuses it.
    kept = RecordedNetwork(truth, rec.trajectory, X_train=ids.numpy(), y_train=y.numpy())
    twin = RecordedNetwork(dense, rec.trajectory, X_train=ids.numpy(), y_train=y.numpy())
    assert_array_equal(PathKernel(kept)(ids.numpy()), PathKernel(twin)(ids.numpy()))
    assert_array_equal(kept.decompose(ids[:3].numpy()).contributions,
                       twin.decompose(ids[:3].numpy()).contributions)


def test_dampening_without_momentum_is_plain_sgd_and_recorded(data):
    """``dampening`` only scales SGD's momentum buffer: without momentum torch.optim
    ignores it, and the recorder refused an update rule it records exactly."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    paths = []
    for dampening in (0.0, 0.5):
        module = _tanh_mlp()
        opt = torch.optim.SGD(module.parameters(), lr=0.2, dampening=dampening)
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for t in range(4):
                idx = np.arange(6) + 6 * (t % 2)
                opt.zero_grad()
                (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
                rec.set_batch(idx)
                opt.step()
        paths.append(rec.trajectory)
        _assert_decomposes(module, rec.as_network(X, y), Xq)
    # torch's own plain SGD path, point for point.
    _assert_same_path(*paths)
    with pytest.raises(ValueError, match="dampening=0.5"):
        PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9,
                                             dampening=0.5))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_empty_batch_is_a_step_without_samples_and_decomposes_exactly(momentum):
    """set_batch([]) is a step whose loss holds no sample: with its zero gradient the
    decomposition still reconstructs the network's own prediction (momentum carries
    the earlier batches' gradients through it), while a step that trained on samples
    but declared none misses it, and decompose says so."""
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(8, 2)), rng.normal(size=(8, 1))
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    def record(declared_empty_trains):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(),
                                     torch.nn.Linear(3, 1)).double()
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=momentum)
        rec = PathRecorder(module, opt, n_samples=8)
        for t in range(4):
            opt.zero_grad()
            idx = np.arange(8)
            if t == 2 and not declared_empty_trains:
                idx = idx[:0]
                module(Xt[:1]).sum().mul(0).backward()  # a loss of no sample
            else:
                ((module(Xt[idx]) - yt[idx]) ** 2 / 2).sum(1).mean().backward()
            rec.set_batch(idx if t != 2 else [])
            opt.step()
        return rec.as_estimator(X, y), module

    net, module = record(declared_empty_trains=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = net.decompose(X[:3])
    with torch.no_grad():
        truth = module(Xt[:3]).numpy()
    assert_allclose(d.initial + d.contributions.sum(axis=1), truth, rtol=1e-10, atol=1e-12)
    net, _ = record(declared_empty_trains=True)
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        net.decompose(X[:3])


def test_misuse_is_a_clear_error():
    module = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="Adagrad"):
        PathRecorder(module, torch.optim.Adagrad(module.parameters()))
    groups = [{"params": [module.weight]}, {"params": [module.bias], "momentum": 0.5}]
    with pytest.raises(ValueError, match="group 1 .*momentum"):
        PathRecorder(module, torch.optim.SGD(groups, lr=0.1))
    with pytest.raises(ValueError, match="not parameters of the module"):
        PathRecorder(torch.nn.Linear(2, 1), torch.optim.SGD(module.parameters(), lr=0.1))
    opt = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already taken steps"):
        PathRecorder(module, opt)

    module = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        rec.set_batch([0, 4])
    module(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="no batch declared"):
        opt.step()
    # Refused before it was taken: the path ends before the step, and says so.
    with pytest.warns(UserWarning, match="ends after optimizer step -1"):
        assert rec.trajectory.n_steps == 0
    with pytest.raises(RuntimeError, match="stopped recording at optimizer step 0"):
        opt.step()
    rec.close()
    with pytest.raises(ValueError, match="n_samples"):
        PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.1)).set_batch([0])

    # A scheduler cycling beta_1 created after the recorder: refused at the step that
    # sees the change (one created before is refused at the recorder's creation, below).
    module = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    module(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="cycle_momentum"):
        opt.step()
    assert sched.last_epoch == 0


@pytest.mark.parametrize("make_optimizer, make_scheduler", [
    (lambda p: torch.optim.Adam(p, lr=0.1),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=5)),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=5)),
    # CyclicLR cycles momentum by default, turning plain SGD into momentum SGD.
    (lambda p: torch.optim.SGD(p, lr=0.1),
     lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1)),
])
def test_a_scheduler_cycling_momentum_created_before_the_recorder_is_refused_at_once(
        make_optimizer, make_scheduler):
    """OneCycleLR / CyclicLR with cycle_momentum=True change momentum or beta_1 as
    they go; created before the recorder, they were refused only at the first step
    after scheduler.step(), once the loop had run. Their constructors mark the groups
    (base_momentum / max_momentum), so the recorder refuses at its creation; one whose
    momentum does not cycle (the two equal) is recorded, as torch steps it."""
    module = torch.nn.Linear(2, 1)
    opt = make_optimizer(module.parameters())
    make_scheduler(opt)
    with pytest.raises(ValueError, match="cycle_momentum=False"):
        PathRecorder(module, opt)

    # base_momentum == max_momentum: the momentum stays; the lr schedule is recorded.
    X, y = torch.randn(6, 2), torch.randn(6, 1)
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4,
                                                base_momentum=0.9, max_momentum=0.9)
    lrs = []
    with PathRecorder(module, opt) as rec:
        for _ in range(3):
            opt.zero_grad()
            ((module(X) - y) ** 2).mean().backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert_allclose(rec.trajectory.learning_rates, lrs, rtol=1e-15)


def test_recorded_network_is_an_estimator_for_sklearn(data):
    X, y, Xq = data
    est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, dtype="float64",
                            random_state=0).fit(X, y)
    net = RecordedNetwork(est.module_, est.trajectory_)
    assert_allclose(clone(net.path_kernel_)(Xq), est.path_kernel_(Xq))
    assert_allclose(clone(net).tangent_kernel_(Xq), est.tangent_kernel_(Xq))
    with pytest.raises(ValueError, match="X_train"):
        net.decompose(Xq)
    with pytest.raises(ValueError, match="3 features"):
        RecordedNetwork(est.module_, est.trajectory_, X_train=X).path_kernel_(np.ones((2, 3)))


@pytest.mark.parametrize(("X_train", "y_train", "error", "match"), [
    (None, "nan", ValueError, "y_train contains NaN or infinity"),
    (None, "inf", ValueError, "y_train contains NaN or infinity"),
    ("sparse", None, TypeError, r"X_fit \(X_train\) must be dense"),
    (None, "sparse", TypeError, r"y_fit \(y_train\) must be dense"),
    ("scalar", None, ValueError, r"X_fit \(X_train\) must hold one row per sample"),
    (None, "scalar", ValueError, r"y_fit \(y_train\) must hold one row per sample"),
])
@pytest.mark.parametrize("verb", ["decompose", "attribute", "self_influence"])
def test_bad_training_data_of_a_recorded_network_is_refused(data, X_train, y_train, error,
                                                           match, verb):
    # Non-finite targets gave NaN contributions without a word; a sparse matrix or a
    # scalar became a 0-d array, one "sample" of shape (), and every call then failed in
    # words about the queries' shape or in len() of an unsized object.
    X, y, Xq = data
    est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, dtype="float64",
                            random_state=0).fit(X, y)
    bad = {"nan": np.where(np.arange(len(y)) == 0, np.nan, y), "inf": np.full(len(y), np.inf),
           "sparse": sp.csr_matrix(X if X_train else y.reshape(-1, 1)), "scalar": 3.0}
    X_train = X if X_train is None else bad[X_train]
    y_train = y if y_train is None else bad[y_train]
    with pytest.raises(error, match=match):
        net = RecordedNetwork(est.module_, est.trajectory_, X_train=X_train, y_train=y_train)
        getattr(net, verb)(*(() if verb == "self_influence" else (Xq,)))


@pytest.mark.parametrize("verb", ["predict", "tangent_kernel_", "path_kernel_"])
def test_a_recorded_network_without_x_train_refuses_what_its_module_cannot_take(verb):
    """Without ``X_train`` nothing fixes the input form, and any ``(n, ...)`` array is
    handed to the module: a wrong width or integers for a float network failed inside
    torch ("mat1 and mat2 shapes cannot be multiplied") from deep in a kernel. The
    module's own refusal is the reference; the network names X's shape and dtype, and
    keeps working on inputs it takes (token ids beyond an embedding are still refused
    at every call, not only at the first of their shape)."""
    X = torch.randn(6, 2, dtype=torch.float64)
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            module(X).pow(2).mean().backward()
            opt.step()
    net = rec.as_estimator()
    call = getattr(net, verb)
    for bad in (np.ones((3, 5)), np.ones((3, 2), dtype=np.int64)):
        with pytest.raises(RuntimeError):  # what the module itself says
            module(torch.as_tensor(bad))
        with pytest.raises(ValueError, match=rf"could not take X of shape \(3, \d\), "
                                             rf"handed to it as torch\.{bad.dtype}"):
            call(bad)
        # Still usable: the right form, again and again (the check is kept per form).
        for _ in range(2):
            got = call(X[:3].numpy())
            assert np.all(np.isfinite(got))
        if verb == "predict":
            assert_allclose(got, module(X[:3]).detach().numpy(), rtol=1e-12)
    ids = np.array([[0, 1, 2], [3, 4, 0]])
    emb = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Flatten(),
                              torch.nn.Linear(6, 1)).double()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with PathRecorder(emb, opt) as rec:
        opt.zero_grad()
        emb(torch.as_tensor(ids)).pow(2).mean().backward()
        opt.step()
    net = rec.as_estimator()
    getattr(net, verb)(ids)
    with pytest.raises(ValueError, match="token id 7, out of range"):
        getattr(net, verb)(np.where(ids == 4, 7, ids))


@pytest.mark.parametrize("form", ["width", "integers"])
def test_training_inputs_the_module_cannot_run_are_refused_naming_them(data, form):
    """``X_train`` fixes the form of every later ``X``: one of the wrong width, or
    integer features for a float network (taken as token ids), was accepted, and every
    right query was then refused in words about the query ("X has 2 features, but the
    network is expecting 1", "the network was fitted on integer token ids")."""
    X, y, Xq = data
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        opt.zero_grad()
        module(torch.as_tensor(X)).pow(2).mean().backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
    bad = X[:, :1] if form == "width" else np.round(3 * X).astype(np.int64)
    with pytest.raises(RuntimeError):  # what the module itself says
        module(torch.as_tensor(bad))
    match = rf"could not take X_train of shape \({len(X)}, {bad.shape[1]}\)"
    with pytest.raises(ValueError, match=match):
        rec.as_network(bad, y)
    with pytest.raises(ValueError, match=match):
        RecordedNetwork(module, rec.trajectory, X_train=bad, y_train=y)
    # The right training inputs still make a network that predicts what the module does.
    net = rec.as_estimator(X, y)
    with torch.no_grad():
        assert_allclose(net.predict(Xq), module(torch.as_tensor(Xq)).numpy(), rtol=1e-12)


class _ReturnsTuple(torch.nn.Module):
    """A network whose forward returns its output and a hidden state."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1).double()

    def forward(self, x):
        return self.lin(x), x


@pytest.mark.parametrize("X_train", [True, False])
def test_a_module_returning_a_tuple_is_refused_naming_what_it_returned(data, X_train):
    """Every analysis reads one output tensor with a row per sample: a recorded module
    returning ``(output, state)`` failed inside each kernel with "'tuple' object has no
    attribute 'reshape'". Refused when ``X_train`` is given, or at the first query."""
    X, y, Xq = data
    module = _ReturnsTuple()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        opt.zero_grad()
        module(torch.as_tensor(X))[0].pow(2).mean().backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
    match = r"must return one tensor of shape \(n_samples, \.\.\.\).*returned a tuple"
    with pytest.raises(TypeError, match=match):
        net = rec.as_estimator(X, y) if X_train else rec.as_estimator()
        TangentKernel(net)(Xq)


def test_a_module_on_the_meta_device_is_refused_naming_its_parameters():
    """A module built on the 'meta' device has no values to record: the recorder
    failed copying its initial point with torch's "Cannot copy out of meta tensor"."""
    with torch.device("meta"):
        module = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'weight', 'bias' .*'meta' device.*to_empty"):
        PathRecorder(module, opt)


def test_non_finite_parameters_are_refused_at_creation_and_divergence_is_warned(data):
    """A path with NaN parameters recorded without a word: its kernels then failed as an
    overflow "to be cured by scaling the inputs", and decompose blamed its quadrature.
    NaN initial parameters are refused at once, naming them; a step that leaves them
    non-finite is warned about once, naming the step, also when it is the last one."""
    X, _, Xq = data
    module = _tanh_mlp()
    with torch.no_grad():
        module[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="'0.weight' of the module hold NaN or inf"):
        PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.1))

    for diverged_at in (1, 2):
        module = _tanh_mlp()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        messages = []
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for step in range(3):
                opt.zero_grad()
                module(torch.as_tensor(X)).pow(2).mean().backward()
                if step == diverged_at:
                    module[2].bias.grad.fill_(float("nan"))
                rec.set_batch(np.arange(len(X)))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
                    assert rec.trajectory.n_steps == step + 1  # the last step: none checks it next
                messages += [str(w.message) for w in caught if "diverged" in str(w.message)]
                # The reference: the parameters themselves, after the step.
                assert all(torch.isfinite(p).all() for p in module.parameters()) == (
                    step < diverged_at)
        assert len(messages) == 1
        assert f"'2.bias' hold NaN or inf values after optimizer step {diverged_at}" in (
            messages[0])

    # The kernels of a diverged path name its parameters, not an overflow of the inputs.
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="'0.weight' hold NaN"):
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            opt.zero_grad()
            module(torch.as_tensor(X)).pow(2).mean().backward()
            module[0].weight.grad[0, 0] = float("nan")
            rec.set_batch(np.arange(len(X)))
            opt.step()
            net = rec.as_estimator(X)
    with torch.no_grad():
        assert not torch.isfinite(module(torch.as_tensor(Xq))).any()
    for kernel in (TangentKernel(net), PathKernel(net)):
        with pytest.raises(ValueError, match="parameters '0.weight' hold NaN or inf at the "
                                             "last recorded point"):
            kernel(Xq)


def test_docstring_examples_run():
    import doctest

    from skpathkernel._path import _recorder

    result = doctest.testmod(_recorder, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_gan_generator_declared_pull_is_exact_and_a_wrong_declaration_shows():
    # The module documentation's claim: declaring r_i = dl/dG(z_i) with the linear loss
    # reproduces the optimizer's gradient, so the split is exact; a declaration that does
    # not reproduce it leaves an error of the size of the mismatch.
    from skpathkernel._reproduce._generative import linear_loss, train_gan

    net, G, _ = train_gan(n_steps=8, batch=8, width=6)
    zq = np.random.RandomState(0).randn(2, 2)
    with torch.no_grad():
        truth = G(torch.as_tensor(zq)).numpy()
    res = net.decompose(zq)
    assert_allclose(res.prediction, truth, rtol=0, atol=1e-14)
    assert res.error < 1e-12
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        wrong = RecordedNetwork(net.module_, net.trajectory_, X_train=net.X_train,
                                y_train=2 * net.y_train, loss=linear_loss).decompose(zq)
    moved = np.abs(res.prediction - res.initial).max()
    assert_allclose(wrong.error, np.abs(wrong.reconstruction - truth).max())
    assert wrong.error > 0.5 * moved  # declared twice the pull: about one move too far


def test_schedulers_created_after_the_recorder_and_agreeing_groups(data):
    X, y, _ = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(),
                                 torch.nn.Linear(3, 1)).double()
    groups = [{"params": module[0].parameters()}, {"params": module[2].parameters()}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.5)
    rec = PathRecorder(module, opt)
    # Created after the recorder, these add bookkeeping entries to the groups.
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                              cycle_momentum=False)
    used = []
    for _ in range(5):
        used.append(sched.get_last_lr()[0])
        opt.zero_grad()
        (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
        opt.step()
        sched.step()
    traj = rec.trajectory
    assert_allclose(traj.learning_rates, used, rtol=1e-15)
    assert traj.solver_spec.momentum == 0.5
    assert traj.names == tuple(n for n, _ in module.named_parameters())
    groups = [{"params": [module[0].weight]}, {"params": [module[0].bias],
                                               "momentum": 0.1}]
    with pytest.raises(ValueError, match="group 1"):
        PathRecorder(module, torch.optim.SGD(groups, lr=0.1))


@torch.jit.script
def _scripted_product(x, w):
    return x @ w.t()


class _ScriptedRead(torch.nn.Module):
    """A weight read hidden from torch functions: only the autograd check sees it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(2, 5), torch.nn.Linear(5, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) + 0.3 * _scripted_product(x, self.l1.weight)[:, :1]


def test_path_kernel_and_decomposition_see_a_hidden_read_checked_once(data):
    # The path kernel and the decomposition run the autograd check once per call (first,
    # middle and last points), then trust its routing at every step.
    from skpathkernel.kernels import path_weights

    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    torch.manual_seed(0)
    module = _ScriptedRead().double()
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(8):
            opt.zero_grad()
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    traj = rec.trajectory
    net = RecordedNetwork(module, traj, X_train=X, y_train=y)
    assert net.decompose(Xq).error < 1e-10

    def jac(k, Z):
        ref = copy.deepcopy(module)
        ref.load_state_dict(traj.state_dict(k))
        return jacobian_loop(ref, Z)[:, 0]

    expected = sum(w * (jac(k, Xq) @ jac(k, X).T).numpy() for k, w in path_weights(traj))
    assert_allclose(PathKernel(net)(Xq, X), expected, rtol=1e-10)


def test_one_logit_log_loss_takes_a_column_of_targets(data):
    """torch's BCEWithLogitsLoss layout, one logit and a (n, 1) column of 0/1 targets:
    the log loss equals torch's own, and the path recorded with it decomposes exactly as
    with the targets given flat (the column crashed with a size mismatch)."""
    X, _, Xq = data
    Xt = torch.as_tensor(X)
    y = (X[:, 0] > 0).astype(np.float64)
    Y = torch.as_tensor(y).reshape(-1, 1)
    module = _tanh_mlp()
    out = module(Xt)
    assert_allclose(LOSSES["log_loss"]()(out, Y).item(),
                    torch.nn.BCEWithLogitsLoss()(out, Y).item(), rtol=1e-14)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for start in range(0, 12, 4):
            idx = np.arange(start, start + 4)
            opt.zero_grad()
            torch.nn.BCEWithLogitsLoss()(module(Xt[idx]), Y[idx]).backward()
            rec.set_batch(idx)
            opt.step()
    column = rec.as_network(X, y.reshape(-1, 1), loss="log_loss").decompose(Xq)
    flat = rec.as_network(X, y, loss="log_loss").decompose(Xq)
    assert column.error < 1e-10 * max(1.0, np.abs(column.prediction).max())
    assert_allclose(column.contributions, flat.contributions, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("sizes", [(4, 4), (5, 3)])
def test_gradient_accumulation_declares_one_micro_batch_per_call(data, sizes):
    """(loss / n_micro).backward() per micro-batch, set_batch per micro-batch, one step:
    the step's batch is all the micro-batches (the last call alone was kept, and the
    decomposition missed the prediction by 1.4), weighted 1 / (n_micro n_j)."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(8):
            idx = torch.randperm(len(X), generator=gen)[:sum(sizes)]
            opt.zero_grad()
            for mb in idx.split(list(sizes)):
                ((0.5 * (module(Xt[mb]) - Yt[mb]) ** 2).mean() / len(sizes)).backward()
                rec.set_batch(mb)
            opt.step()
    assert all(len(b) == sum(sizes) for b in rec.trajectory.batches)
    _assert_decomposes(module, rec.as_network(X, y), Xq)


def _refused_as_never_zeroed(opt, rec):
    """Optimizer step 1 of a loop that never zeroed its gradients: refused."""
    with pytest.raises(ValueError, match=r"step 1 backward\(\) added the gradient onto a "
                       r"nonzero \.grad of parameter\(s\) '0.weight'"):
        opt.step()
    rec.close()


@pytest.mark.parametrize("zeroing", ["none", "set_to_none", "zeros", "data_zero",
                                     "autograd_grad"])
def test_a_gradient_added_onto_the_last_steps_is_refused(data, zeroing):
    """A loop without zero_grad() steps with the running sum of every batch's gradient,
    which the record credited to each step's batch alone: recorded without a word, the
    decomposition then missed the prediction. Every way of starting a step from a zero
    (or fresh) gradient records as before and decomposes to its prediction."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    params = list(module.parameters())
    rec = PathRecorder(module, opt, n_samples=len(X))
    for t in range(5):
        idx = np.arange(t, t + 6) % len(X)
        loss = (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean()
        if zeroing == "set_to_none":
            opt.zero_grad()
        elif zeroing == "zeros":
            opt.zero_grad(set_to_none=False)
        elif zeroing == "data_zero":  # the pre-1.0 idiom, which no version counter sees
            for p in params:
                if p.grad is not None:
                    p.grad.data.zero_()
        if zeroing == "autograd_grad":  # gradients assigned, never accumulated
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        else:
            loss.backward()
        rec.set_batch(idx)
        if zeroing == "none" and t == 1:
            _refused_as_never_zeroed(opt, rec)
            return
        opt.step()
    rec.close()
    assert zeroing != "none"
    _assert_decomposes(module, rec.as_network(X, y), Xq)


@pytest.mark.parametrize("loop", ["dcgan_discriminator", "undetached_generator",
                                  "diagnostic", "diagnostic_data_zero",
                                  "diagnostic_never_zeroed"])
def test_a_backward_before_zero_grad_is_not_a_gradient_left_over(data, loop):
    """A backward() that reaches the recorded parameters after their step and before
    their zero_grad() (DCGAN's generator loss reaching the discriminator, D's loss on an
    undetached G(z) reaching the generator, a diagnostic gradient after the step) adds
    onto the step's gradient, which the zero_grad() then clears: such loops were
    refused as never zeroing. They decompose to the trained module's own outputs, zeroed
    in any way; one that never zeroes is refused still."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(2 if loop == "undetached_generator" else 1,
                                                2), torch.nn.Tanh()).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=len(X))
    for t in range(5):
        idx = np.arange(t, t + 6) % len(X)
        if loop == "undetached_generator":  # D's step on G(x), G not detached
            opt_other.zero_grad()
            other(module(Xt[idx]).expand(-1, 2)).sum().backward()
            opt_other.step()
        if loop == "diagnostic_data_zero":  # which no version counter sees
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
        elif loop != "diagnostic_never_zeroed":
            opt.zero_grad()
        (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
        rec.set_batch(idx)
        if loop == "diagnostic_never_zeroed" and t == 1:
            _refused_as_never_zeroed(opt, rec)
            return
        opt.step()
        if loop == "dcgan_discriminator":  # G's step through the recorded D
            opt_other.zero_grad()
            (-module(other(Xt[idx, :1]))).mean().backward()
            opt_other.step()
        elif loop.startswith("diagnostic"):  # a held-out gradient's norm, say
            (0.5 * (module(Xt[:3]) - Yt[:3]) ** 2).mean().backward()
    rec.close()
    assert loop != "diagnostic_never_zeroed"
    _assert_decomposes(module, rec.as_network(X, y), Xq)


@pytest.mark.parametrize("kept", ["module and optimizer", "nothing"])
def test_a_recorder_dropped_without_close_is_freed_and_records_no_more(data, kept):
    """A recorder never close()d stayed alive after its last reference went, with its
    path, its module and its optimizer, even all three dropped (review s51): the bound
    methods in its hooks held it, those of the parameters from the tensors' C++ side,
    which the garbage collector does not see. Weak references tell what is freed; the
    loop trained on afterwards against the same loop that never had a recorder (bit for
    bit), and the path read before against its own copy."""
    X, y, _ = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))

    def train(module, opt, rec, steps):
        for t in range(steps):
            idx = np.arange(t % 3, len(X), 3)
            opt.zero_grad()
            (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
            if rec is not None:
                rec.set_batch(idx)
            opt.step()

    module = _tanh_mlp()
    twin = copy.deepcopy(module)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    rec = PathRecorder(module, opt, n_samples=len(X), record_every=2)
    train(module, opt, rec, 5)
    train(twin, twin_opt, None, 5)
    traj = rec.trajectory
    points = [traj.parameters(k).clone() for k in range(len(traj))]
    alive = [weakref.ref(rec), weakref.ref(rec._recorder)]
    del rec
    if kept == "nothing":
        alive += [weakref.ref(module), weakref.ref(opt)]
        del module, opt
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)
    assert all(torch.equal(traj.parameters(k), p) for k, p in enumerate(points))
    if kept == "nothing":
        return
    assert all(not p._backward_hooks and not p._post_accumulate_grad_hooks
               for p in module.parameters())
    # The optimizer's step hooks are left as no-ops (see the test below), removed by
    # the next recorder of it (there).
    hooks = [*opt._optimizer_step_pre_hooks.values(),
             *opt._optimizer_step_post_hooks.values()]
    assert len(hooks) == 2 and all(h.recorder is None for h in hooks)
    train(module, opt, None, 4)
    train(twin, twin_opt, None, 4)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), twin.parameters()))


def test_a_recorder_freed_by_the_collector_during_a_step_leaves_the_step_whole(data):
    """A recorder dropped in a reference cycle is freed by the garbage collector, which
    runs at any allocation: there in a later step hook of its optimizer (here a hook
    that collects, a second recorder's after it), while optimizer.step() iterated over
    the hooks, and its finalizer's removal of its step hook raised "OrderedDict mutated
    during iteration" out of the user's step (review s52). Against the same loop
    without recorders, bit for bit, and the second recorder's path against its own
    copies of the parameters; the freed recorder's step hooks, left as no-ops, are
    removed by the next recorder of the optimizer."""
    X, y, _ = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    twin = copy.deepcopy(module)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    first = PathRecorder(module, opt, n_samples=len(X))
    first.cycle = first  # freed by the collector only
    freed = weakref.ref(first)
    del first
    opt.register_step_pre_hook(lambda *args: (gc.collect(), None)[1])
    opt.register_step_post_hook(lambda *args: (gc.collect(), None)[1])
    second = PathRecorder(module, opt, n_samples=len(X))
    own = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    gc.disable()  # only the hooks collect, inside the steps
    try:
        for t in range(4):
            idx = np.arange(t % 3, len(X), 3)
            for net, o in ((module, opt), (twin, twin_opt)):
                o.zero_grad()
                (0.5 * (net(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
                if net is module:
                    live = freed()
                    if live is not None:
                        live.set_batch(idx)
                    del live
                    second.set_batch(idx)
                o.step()
            own.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
    finally:
        gc.enable()
    assert freed() is None
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), twin.parameters()))
    path = second.trajectory
    assert len(path) == 5
    assert all(torch.equal(path.parameters(k), p) for k, p in enumerate(own))
    second.close()
    fresh = torch.optim.Adam(module.parameters(), lr=0.01)
    fresh._optimizer_step_pre_hooks = opt._optimizer_step_pre_hooks
    fresh._optimizer_step_post_hooks = opt._optimizer_step_post_hooks
    ours = [h for h in (*fresh._optimizer_step_pre_hooks.values(),
                        *fresh._optimizer_step_post_hooks.values())
            if hasattr(h, "recorder")]
    assert len(ours) == 2 and all(h.recorder is None for h in ours)
    PathRecorder(module, fresh, n_samples=len(X)).close()
    assert len(fresh._optimizer_step_pre_hooks) == len(fresh._optimizer_step_post_hooks) == 1


def test_sending_the_recorded_module_to_another_process_does_not_warn(data):
    """torch.multiprocessing pickles a module's parameters with a warning for each
    tensor hook, which it drops: the recorder's zero_grad check warned of itself, as
    a functools.partial, for every parameter."""
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=len(data[0])), warnings.catch_warnings():
        warnings.simplefilter("error")
        ForkingPickler(io.BytesIO()).dump(module)


def test_frozen_parameters_are_constants_and_freezing_midway_is_refused(data):
    """A parameter frozen before recording (the fine-tuning idiom, frozen but still
    handed to the optimizer) crashed the recorder with "cannot register a hook"; one
    frozen or unfrozen mid-training was recorded as stepping while torch.optim skipped
    it (decomposition off by 0.02-1e6), or refused as "value clipping"."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))

    def loop(frozen, toggle_at=None, set_to_none=True):
        module = _tanh_mlp()
        module[0].weight.requires_grad_(not frozen)
        opt = torch.optim.Adam(module.parameters(), lr=0.05)
        rec = PathRecorder(module, opt, n_samples=len(X))
        for t in range(6):
            if t == toggle_at:
                module[0].weight.requires_grad_(frozen)
            opt.zero_grad(set_to_none=set_to_none)
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
        return module, rec

    module, rec = loop(frozen=True)
    assert "0.weight" not in rec.trajectory.names
    _assert_decomposes(module, rec.as_network(X, y), Xq)
    for set_to_none in (True, False):
        with pytest.raises(ValueError, match=r"step 2 parameter '0.weight' is frozen"):
            loop(frozen=False, toggle_at=2, set_to_none=set_to_none)
    with pytest.raises(ValueError, match=r"'0.weight' is unfrozen"):
        loop(frozen=True, toggle_at=2)


def _recorded_full_batch(module, opt, X, y, steps=4):
    """``steps`` full-batch steps of ``opt`` on ``module``'s squared error, recorded."""
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    return rec


def test_features_of_a_frozen_backbone_are_the_trained_parameters_gradients(data):
    """Fine-tuning: a backbone frozen (requires_grad=False, still handed to the
    optimizer) and a layer the optimizer is not given (requires_grad left True) are
    constants of the path: phi(x) and the kernels are the gradients with respect to the
    parameters the optimizer trains, with no column for the others (the own-loop guide
    says so)."""
    X, y, Xq = data
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5),
                                 torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    module[0].requires_grad_(False)
    opt = torch.optim.SGD([*module[0].parameters(), *module[4].parameters()], lr=0.1,
                          momentum=0.9)
    rec = _recorded_full_batch(module, opt, X, y)
    assert list(rec.trajectory.names) == ["4.weight", "4.bias"]
    # The autograd Jacobian over the head alone, on a copy with the rest frozen.
    head_only = copy.deepcopy(module)
    head_only[2].requires_grad_(False)
    J = jacobian_loop(head_only, Xq)[:, 0].numpy()
    net = rec.as_estimator(X, y)
    assert_allclose(TangentFeatures(net).fit(X).transform(Xq), J, rtol=1e-12, atol=1e-14)
    assert_allclose(TangentKernel(net)(Xq), J @ J.T, rtol=1e-12, atol=1e-14)
    _assert_decomposes(module, net, Xq)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_frozen_parameter_left_with_a_gradient_is_refused_before_it_moves(data, make_opt,
                                                                           set_to_none):
    """Fine-tuning after pretraining in the same process, with
    zero_grad(set_to_none=False): a frozen layer handed to the optimizer keeps the
    (zeroed) .grad of its last pretraining step, and torch.optim steps every parameter
    that has one, frozen or not: AdamW's weight decay moved the frozen layer while the
    record held it as a constant, and the recorder blamed "another optimizer, or an
    in-place change" one step later (so it did for SGD's step of zero, which moves
    nothing but writes in place). It is refused before the step; with the default
    zero_grad() the layer is a constant of an exact path."""
    X, y, Xq = data
    module = _tanh_mlp()
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    (0.5 * (module(Xt) - 2 * Yt) ** 2).mean().backward()  # "pretraining" sets every .grad
    module[0].requires_grad_(False)
    frozen = module[0].weight.detach().clone()
    opt = make_opt(module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = PathRecorder(module, opt, n_samples=len(X))
        for _ in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
            rec.set_batch(np.arange(len(X)))
            if not set_to_none:
                with pytest.raises(ValueError, match=r"step 0 parameter '0.weight' is "
                                   r"frozen \(requires_grad=False\) but holds a gradient"
                                   r".*set_to_none=True"):
                    opt.step()
                break
            opt.step()
        rec.close()
    assert torch.equal(module[0].weight, frozen)
    if set_to_none:
        _assert_decomposes(module, rec.as_network(X, y), Xq)


def test_a_compiled_module_is_recorded_under_its_own_names(data):
    """torch.compile wraps the module in an OptimizedModule that holds its parameters
    under '_orig_mod.' names: the path was recorded under those, and the analyses ran the
    compiled forward, which dynamo recompiled for their calls until its limit, with its
    warnings. The recorder and RecordedNetwork read the module it compiled, as they read
    the one DistributedDataParallel wraps."""
    X, y, Xq = data
    module = _tanh_mlp()
    compiled = torch.compile(module, backend="eager")  # no C++ compiler needed
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    rec = _recorded_full_batch(compiled, opt, X, y)
    assert list(rec.trajectory.names) == [n for n, _ in module.named_parameters()]
    for net in (rec.as_network(X, y), rec.as_estimator(X, y).network_,
                RecordedNetwork(compiled, rec.trajectory, X_train=X, y_train=y).network_):
        assert net.module is module
    _assert_decomposes(module, rec.as_network(X, y), Xq)


def test_a_module_compiled_in_place_is_analysed_on_its_rules_and_stays_compiled(data):
    """``module.compile()`` compiles in place, with no wrapper to unwrap: the analyses ran
    the compiled call, which hid the layers' calls from the capture on its first runs,
    so layer_routes sent every layer to the fallback ("a parameter is read outside the
    layer's own call") and dynamo recompiled the module for each grad mode and shape.
    They now run it eagerly, and leave it compiled."""
    X, y, Xq = data
    module = _tanh_mlp()
    module.compile(backend="aot_eager")  # no C++ compiler; "eager" never hid the calls
    compiled_call = module._compiled_call_impl
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = _recorded_full_batch(module, opt, X, y)
    assert [r.route for r in layer_routes(module, Xq)] == ["rule", "rule"]
    K = TangentKernel(rec.as_estimator(X, y))(Xq, X)
    ref = copy.deepcopy(module)
    ref._compiled_call_impl = None
    J, J_train = jacobian_loop(ref, Xq), jacobian_loop(ref, X)
    assert_allclose(K, torch.einsum("ncp,mcp->nm", J, J_train).numpy(), rtol=1e-12, atol=0)
    _assert_decomposes(module, rec.as_network(X, y), Xq)
    assert module._compiled_call_impl is compiled_call


class _OwnForward(torch.nn.Module):
    """The 2-5-1 tanh network with a forward of its own (dynamo compiles user code; a
    Sequential of torch's layers it runs as they are)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(2, 5), torch.nn.Linear(5, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_analyses_of_a_module_compiled_in_place_compile_nothing_and_restore_it(data):
    """Every graph dynamo compiles is counted by the backend: the analyses ran the
    compiled call and compiled 15 more graphs (one per grad mode and shape, until
    dynamo's limit); run eagerly, they compile none, the user's loop after them
    compiles none either (the same cached graph), and a verb that raises leaves the
    compiled call in place."""
    X, y, Xq = data
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    module = _OwnForward().double()
    module.compile(backend=counting)
    compiled_call = module._compiled_call_impl
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = _recorded_full_batch(module, opt, X, y)
    n_trained = len(graphs)
    assert n_trained >= 1  # the loop ran compiled
    layer_routes(module, Xq)
    TangentKernel(rec.as_estimator(X, y))(Xq, X)
    rec.as_network(X, y).decompose(Xq)
    assert len(graphs) == n_trained
    with pytest.raises(RuntimeError):
        layer_routes(module, np.ones((2, 7)))
    assert module._compiled_call_impl is compiled_call
    _recorded_full_batch(module, opt, X, y, steps=2)
    assert len(graphs) == n_trained


def test_a_parameter_group_added_midway_is_refused_naming_it():
    module = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD([module.weight], lr=0.1)
    with PathRecorder(module, opt):
        opt.add_param_group({"params": [module.bias]})
        module(torch.ones(1, 2)).sum().backward()
        with pytest.raises(ValueError, match="add_param_group"):
            opt.step()


class _Routed(torch.nn.Module):
    """Two tanh experts, each input routed to one by the sign of its first feature: a
    batch of one sign leaves the other expert out of the graph (no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
            for _ in range(2))

    def forward(self, x):
        out = torch.zeros(len(x), 1, dtype=x.dtype)
        for expert, mask in zip(self.experts, (x[:, 0] > 0, x[:, 0] <= 0)):
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]))
        return out


def test_a_parameter_without_a_gradient_at_a_step_keeps_its_zeroed_one(data):
    """With ``zero_grad(set_to_none=False)`` a parameter that the step's batch leaves out
    of the graph keeps a zero gradient, which the optimizer uses (momentum and weight
    decay go on). The recorder compared it with the gradient an earlier backward() gave
    it and refused the step as "value clipping"."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    pos, neg = np.flatnonzero(X[:, 0] > 0), np.flatnonzero(X[:, 0] <= 0)
    # Both experts at the first step (a gradient for each), then one at a time.
    batches = [np.r_[pos[:2], neg[:2]], pos[:3], neg[:3], pos[1:4], pos[2:5], neg[1:4]]
    module = _Routed().double()
    opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for idx in batches:
            opt.zero_grad(set_to_none=False)
            (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
    assert rec.trajectory.n_steps == len(batches)
    _assert_decomposes(module, rec.as_network(X, y), Xq)


def _record_routed(data, batches, make_opt, zero_grad=False):
    """A routed two-expert network trained on ``batches`` by ``make_opt``'s optimizer
    (``zero_grad``: missing gradients given as zeros before each step), recorded; its
    decomposition of the queries and every warning said meanwhile."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _Routed().double()
    opt = make_opt(module.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for idx in batches:
                opt.zero_grad()
                (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
                if zero_grad:
                    for p in module.parameters():
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                rec.set_batch(idx)
                opt.step()
        res = rec.as_network(X, y).decompose(Xq)
    return module, res, caught


@pytest.mark.parametrize("make_opt, moves", [
    (lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), True),
    (lambda p: torch.optim.Adam(p, lr=0.05), True),
    (lambda p: torch.optim.RMSprop(p, lr=0.01, weight_decay=0.1), True),
    (lambda p: torch.optim.SGD(p, lr=0.2), False),
    (lambda p: torch.optim.RMSprop(p, lr=0.01), False),
], ids=["sgd-momentum", "adam", "rmsprop-l2", "sgd", "rmsprop"])
def test_a_parameter_the_optimizer_skips_for_want_of_a_gradient_warns(data, make_opt,
                                                                       moves):
    """With the default ``zero_grad()`` a parameter that the step's batch leaves out of
    the graph has no gradient, and torch.optim skips it: no momentum, Adam moment or
    weight decay moves it, where the recorded path's decomposition steps it with a zero
    gradient. Where that differs, the recorder says so at the step, naming the
    parameter, instead of the decomposition missing without a reason."""
    X, y, Xq = data
    pos, neg = np.flatnonzero(X[:, 0] > 0), np.flatnonzero(X[:, 0] <= 0)
    batches = [np.r_[pos[:2], neg[:2]], pos[:3], neg[:3], pos[1:4], pos[2:5], neg[1:4]]
    module, res, caught = _record_routed(data, batches, make_opt)
    said = [str(w.message) for w in caught if "no gradient" in str(w.message)]
    missed = [w for w in caught if "misses the prediction" in str(w.message)]
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    change = np.abs(truth - res.initial).max()
    if moves:
        assert len(said) == 1  # once, at the first such step
        assert "optimizer step 1" in said[0] and "'experts.1.0.weight'" in said[0]
        # It matters: the decomposition misses, and says so too.
        assert missed and np.abs(res.reconstruction - truth).max() > 1e-4 * change
    else:
        assert not said and not missed
        assert_allclose(res.reconstruction, truth, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.05),
    lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.0),
], ids=["adam", "adamw"])
@pytest.mark.parametrize("zero_grad", [False, True])
def test_an_adam_parameter_skipped_at_the_first_step_warns_when_it_trains(data, make_opt,
                                                                         zero_grad):
    """Adam counts each parameter's own steps for its bias corrections. A parameter with
    no gradient at the first step has no state yet, so torch.optim's skip moves nothing
    then, but from the next step on it is corrected with one step fewer than the others,
    where the recorded path counts every step: the recorder said nothing (only
    decompose's error did). A zero gradient instead of none keeps the counts together
    and the record exact, as the warning advises."""
    X, y, Xq = data
    pos, neg = np.flatnonzero(X[:, 0] > 0), np.flatnonzero(X[:, 0] <= 0)
    # Expert 1 (negative inputs) is left out at the first step only.
    batches = [pos[:3], *(np.r_[pos[k:k + 2], neg[k:k + 2]] for k in range(4))]
    module, res, caught = _record_routed(data, batches, make_opt, zero_grad=zero_grad)
    said = [str(w.message) for w in caught if "fewer Adam steps" in str(w.message)]
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    miss = np.abs(res.reconstruction - truth).max()
    if zero_grad:
        assert not said
        assert miss < 1e-12
    else:
        assert len(said) == 1  # once, at the first step it trains
        assert "optimizer step 1" in said[0] and "'experts.1.0.weight'" in said[0]
        assert "'experts.0.0.weight'" not in said[0]
        # It matters: the decomposition misses the module's own outputs.
        assert miss > 1e-4 * np.abs(truth - res.initial).max()


def test_a_part_of_the_module_trained_by_another_optimizer_warns_naming_it(data):
    """A second optimizer on part of the module (the head with SGD, the body with Adam)
    moves parameters that the record holds as constants, read at their current values
    whenever a recorded point is evaluated: the recorded initial network was not the
    trained one's, and nothing said why (decompose's miss listed other causes)."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    with torch.no_grad():
        start = module(torch.as_tensor(Xq)).numpy()
    body = torch.optim.Adam(module[0].parameters(), lr=0.05)
    head = torch.optim.SGD(module[2].parameters(), lr=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, body, n_samples=len(X)) as rec:
            for _ in range(4):
                body.zero_grad()
                head.zero_grad()
                (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
                rec.set_batch(np.arange(len(X)))
                body.step()
                head.step()
        res = rec.as_network(X, y).decompose(Xq)
    said = [str(w.message) for w in caught if "changed since the recorder" in str(w.message)]
    assert len(said) == 1  # once, at the first step after the head moved
    assert "optimizer step 1" in said[0] and "'2.weight', '2.bias'" in said[0]
    assert "'0.weight'" not in said[0]
    # It matters: the recorded start is not the module's own at the start.
    assert np.abs(res.initial - start).max() > 1e-3


def test_a_step_after_an_overflow_compares_only_its_own_gradients(data):
    """An overflow that a GradScaler skips runs no step hook: the gradients its
    backward() gave stayed the reference of the next step, where a parameter that the
    next batch leaves out (zeroed by ``zero_grad(set_to_none=False)``) was compared with
    the overflow's infinite one, and the step's factor was recorded as the new loss
    scale (512) instead of 1."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    pos, every = np.flatnonzero(X[:, 0] > 0), np.arange(len(X))
    batches = [every, every, every, pos[:3], pos[1:4]]  # the overflow at step 2
    module = _Routed().double()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with PathRecorder(module, opt, n_samples=len(X), grad_scaler=scaler) as rec:
        for t, idx in enumerate(batches):
            opt.zero_grad(set_to_none=False)
            loss = (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean()
            scaler.scale(loss * (float("inf") if t == 2 else 1.0)).backward()
            rec.set_batch(idx)
            scaler.step(opt)
            scaler.update()
    assert rec.trajectory.n_steps == len(batches) - 1
    assert_array_equal(rec.trajectory.gradient_scales, np.ones(len(batches) - 1))
    _assert_decomposes(module, rec.as_network(X, y), Xq)



@pytest.mark.parametrize("passed", [False, True])
def test_a_grad_scaler_not_given_to_the_recorder_is_warned(data, passed):
    """A GradScaler the recorder is not given unscales the gradients by exactly
    ``2**-k`` between backward() and the step, which the recorder took for a norm clip:
    every step's share came out ``2**k`` times too small and only decompose's closure
    warning said that something (not what) was wrong. The step now warns, naming
    grad_scaler; given it, the loop is recorded exactly and nothing warns."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, opt, n_samples=len(X),
                          grad_scaler=scaler if passed else None) as rec:
            for _ in range(3):
                opt.zero_grad()
                scaler.scale((0.5 * (module(Xt) - Yt) ** 2).mean()).backward()
                rec.set_batch(np.arange(len(X)))
                scaler.step(opt)
                scaler.update()
    said = [str(w.message) for w in caught if "grad_scaler=scaler" in str(w.message)]
    if passed:
        assert said == []
        _assert_decomposes(module, rec.as_network(X, y), Xq)
    else:
        assert len(said) == 1 and "step 0" in said[0] and "2**-10" in said[0], said
        with torch.no_grad():
            truth = module(torch.as_tensor(Xq)).numpy()
        with pytest.warns(UserWarning, match="misses the prediction"):
            res = rec.as_network(X, y).decompose(Xq)
        miss = np.abs(res.initial + res.contributions.sum(1) + res.regularization - truth)
        assert miss.max() > 1e-3  # what the warning is about



def test_gradients_divided_by_a_power_of_two_by_hand_are_not_taken_for_a_grad_scaler(
        data):
    """Gradient accumulation that divides the summed gradients by n_micro = 2 after the
    micro-batches' backward() (each declared with its coefficients) is recorded exactly,
    but its factor, exactly 0.5, was warned as a GradScaler's unscaling. The warning
    now asks for a GradScaler taking the step; the loop stays exact and silent."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.5)
    halves = np.array_split(np.arange(len(X)), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for _ in range(3):
                opt.zero_grad()
                for idx in halves:
                    (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
                    rec.set_batch(idx, weights=np.full(len(idx), 1 / len(idx)))
                for p in module.parameters():
                    p.grad /= 2
                opt.step()
        net = rec.as_network(X, y)
        assert_array_equal(rec.trajectory.gradient_scales, [0.5] * 3)
        _assert_decomposes(module, net, Xq)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_grad_scaler_not_given_is_warned_when_a_clip_follows_its_unscaling(data,
                                                                             enabled):
    """scaler.unscale_, then a norm clip active at every step: the factor is 2**-k times
    the clip's, never a power of two, so no step was warned although every share came
    out 2**k times too small. The GradScaler taking the step is what warns now; a
    disabled one (GradScaler(enabled=use_amp)) scales nothing, and the clip alone is
    recorded exactly, without a word."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=enabled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for _ in range(2):
                opt.zero_grad()
                scaler.scale((0.5 * (module(Xt) - Yt) ** 2).mean()).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1e-3)
                rec.set_batch(np.arange(len(X)))
                scaler.step(opt)
                scaler.update()
    said = [str(w.message) for w in caught if "taken by a torch.amp.GradScaler" in
            str(w.message)]
    if enabled:
        assert len(said) == 1 and "step 0" in said[0], said
    else:
        assert said == []
        _assert_decomposes(module, rec.as_network(X, y), Xq)


def test_a_declared_clip_of_a_power_of_two_is_not_taken_for_a_grad_scaler(data):
    """recorder.clip_grad_norm_ declares its factor; one that comes out exactly 0.5 (a
    max_norm of half the gradients' norm) was still warned as a GradScaler's unscaling
    (the power-of-two check ran before the declared factor was compared). The
    recorder knows it is a clip: the loop is recorded exactly and nothing warns."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for _ in range(2):
                opt.zero_grad()
                (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
                norm = torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in module.parameters()]))
                rec.clip_grad_norm_(float(0.5 * (norm + 1e-6)))
                assert rec._declared_scale == 0.5  # the case under test
                rec.set_batch(np.arange(len(X)))
                opt.step()
        net = rec.as_network(X, y)
    assert_array_equal(rec.trajectory.gradient_scales, [0.5, 0.5])
    _assert_decomposes(module, net, Xq)


@pytest.mark.parametrize("max_norm", [float("nan"), -1.0, "1", True, None])
def test_clip_grad_norm_refuses_a_bad_max_norm_before_changing_a_gradient(data, max_norm):
    """torch takes a NaN max_norm (every gradient became NaN) and a negative one (every
    gradient reversed, a factor of -1 / norm), and the recorder recorded either step."""
    X, y, _ = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
            rec.clip_grad_norm_(max_norm)
        for p, g in zip(module.parameters(), grads):
            assert torch.equal(p.grad, g)
        # A valid call after the refused one is torch's own clip.
        ref = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        assert torch.allclose(rec.clip_grad_norm_(torch.tensor(float("inf"))), ref,
                              rtol=1e-12, atol=0)
        rec.set_batch(np.arange(len(X)))
        opt.step()


@pytest.mark.parametrize(("budget", "error", "match"), [
    (2**20 - 1, ValueError, "memory_budget must be at least 1,048,576 bytes, got 1048575"),
    (-5, ValueError, "memory_budget must be at least 1,048,576 bytes, got -5"),
    (float(2**30), TypeError, "memory_budget must be an int, got 1073741824.0"),
    (True, TypeError, "memory_budget must be an int, got True"),
    ("x", TypeError, "memory_budget must be an int, got 'x'"),
])
def test_a_recorder_refuses_a_bad_memory_budget_as_the_estimators_do(budget, error, match):
    # The recorder took its own check (a ValueError for a float or a string) where
    # RecordedNetwork raised a TypeError; the floor stays the estimators' 2**20.
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    with pytest.raises(error, match=match):
        PathRecorder(module, opt, memory_budget=budget)
    # Nothing of the refused recorder is left on the module: a valid one records alone.
    with PathRecorder(module, opt, n_samples=4, memory_budget=np.int64(2**20)) as rec:
        module(torch.ones(4, module[0].in_features, dtype=torch.float64)).sum().backward()
        rec.set_batch(np.arange(4))
        opt.step()
    assert rec.trajectory.n_steps == 1


@pytest.mark.parametrize(("budget", "error", "match"), [
    (0, ValueError, "memory_budget must be a positive number of bytes, got 0"),
    (-5, ValueError, "memory_budget must be a positive number of bytes, got -5"),
    (1.5, TypeError, "memory_budget must be an int, got 1.5"),
    (True, TypeError, "memory_budget must be an int, got True"),
    ("x", TypeError, "memory_budget must be an int, got 'x'"),
])
def test_a_recorded_network_refuses_a_bad_memory_budget_when_built(data, budget, error,
                                                                   match):
    # int() took 1.5 and True for 1 byte and 0 or -5 silently (the first kernel then
    # failed in words about its block); "x" failed in int()'s words.
    X, y, Xq = data
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        (0.5 * (module(torch.as_tensor(X)) - torch.as_tensor(y)[:, None]) ** 2).mean(
        ).backward()
        rec.set_batch(np.arange(len(X)))
        opt.step()
    for build in (rec.as_estimator, rec.as_network,
                  lambda X, y, memory_budget: RecordedNetwork(
                      module, rec.trajectory, X_train=X, y_train=y,
                      memory_budget=memory_budget)):
        with pytest.raises(error, match=match):
            build(X, y, memory_budget=budget)
    # A small valid budget (NumPy's int too) computes the default budget's kernel.
    small = rec.as_estimator(X, y, memory_budget=np.int64(2000))
    assert_allclose(TangentKernel(small)(Xq), TangentKernel(rec.as_estimator(X, y))(Xq),
                    rtol=1e-13, atol=0)


_MOVED = r"recorded parameter\(s\) .* changed"


def _clamp(module, step):  # WGAN's weight clipping, through .data
    for p in module.parameters():
        p.data.clamp_(-0.02, 0.02)


def _max_norm(module, step):  # a max-norm projection of each unit's incoming weights
    with torch.no_grad():
        module[0].weight.renorm_(2, 0, 0.5)


def _reload(module, step):  # load_state_dict of another state (a restart from a checkpoint)
    module.load_state_dict({k: v * 0.5 for k, v in module.state_dict().items()})


def _reinit(module, step):  # an in-place re-initialisation of one layer
    torch.nn.init.normal_(module[2].weight, std=0.1)


@pytest.mark.parametrize("change, names", [
    (_clamp, "'0.weight', '0.bias', '2.weight', '2.bias'"),
    (_max_norm, "'0.weight'"),
    (_reload, "'0.weight', '0.bias', '2.weight', '2.bias'"),
    (_reinit, "'2.weight'"),
])
def test_recorded_parameters_changed_between_steps_warn_once_naming_them(
        data, change, names):
    """A recorded parameter changed between two optimizer steps (weight clipping, a
    max-norm projection, load_state_dict, a re-initialisation) is recorded as part of
    the next step, which its gradient does not explain: the decomposition missed the
    trained module's outputs, and nothing said why. Warned once, naming the parameters
    and the step; recording goes on (the miss is the record's, as decompose reports)."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for t in range(5):
                opt.zero_grad()
                (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
                rec.set_batch(np.arange(len(X)))
                opt.step()
                if t in (1, 3):
                    change(module, t)
        net = rec.as_network(X, y)
        res = net.decompose(Xq)
    said = [str(w.message) for w in caught if re.search(_MOVED, str(w.message))]
    assert len(said) == 1, said  # once, at the first step after the first change
    assert f"parameter(s) {names} changed after optimizer step 1" in said[0]
    assert "part of optimizer step 2" in said[0]
    assert rec.n_steps == 5
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    miss = np.abs(res.initial + res.contributions.sum(1) + res.regularization - truth).max()
    assert miss > 1e-3 * np.abs(truth - res.initial).max()
    assert res.error >= 0.5 * miss  # decompose reports the miss it has


def test_equal_values_given_new_storage_or_reloaded_are_not_warned(data):
    """Equal values in new storage (p.data = p.data.clone(), a device round trip) or
    written again (load_state_dict of the current state, which bumps the version
    counters) change nothing the record describes: no warning, and the decomposition
    stays exact."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + _MOVED)
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for t in range(4):
                opt.zero_grad()
                (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
                rec.set_batch(np.arange(len(X)))
                opt.step()
                if t == 1:
                    for p in module.parameters():
                        p.data = p.data.clone()
                if t == 2:
                    module.load_state_dict(copy.deepcopy(module.state_dict()))
    _assert_decomposes(module, rec.as_network(X, y), Xq)


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
    lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-2, foreach=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, fused=True),
    lambda p: torch.optim.Adam(p, lr=0.05, foreach=False),
    lambda p: torch.optim.Adam(p, lr=0.05, fused=True),
    lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
    lambda p: torch.optim.RMSprop(p, lr=0.01, foreach=False),
    lambda p: torch.optim.RMSprop(p, lr=0.01, foreach=True),
])
@pytest.mark.parametrize("scaled", [False, True])
def test_ordinary_loops_do_not_warn_of_parameters_changed_between_steps(
        data, make_optimizer, scaled):
    """Only optimizer.step() moves the recorded parameters of an ordinary loop:
    forward, backward, zero_grad, gradient accumulation, norm clipping (it writes the
    gradients), a GradScaler's unscale_ / step / update (an overflow it skips
    included) and a scheduler never trigger the warning."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = make_optimizer(module.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    halves = np.array_split(np.arange(len(X)), 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + _MOVED)
        with PathRecorder(module, opt, n_samples=len(X), grad_scaler=scaler) as rec:
            for t in range(5):
                opt.zero_grad()
                for idx in halves:  # two accumulated micro-batches
                    loss = (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean() / 2
                    if scaled:
                        loss = scaler.scale(loss * (float("inf") if t == 2 else 1.0))
                    loss.backward()
                    rec.set_batch(idx)
                if scaled:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(module.parameters(), 0.05)
                if scaled:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                sched.step()
    assert rec.n_steps == (4 if scaled else 5)


def test_a_change_before_the_first_step_is_warned_as_part_of_step_0():
    """The initial point is recorded when the recorder is created: a parameter changed
    after that and before the first step is recorded as part of step 0."""
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt)
    initial = rec.trajectory.parameters(0).clone()
    with torch.no_grad():
        module[2].bias.add_(1.0)
    module(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
    with pytest.warns(UserWarning, match=r"parameter\(s\) '2.bias' changed since the "
                      r"recorder was created.* part of optimizer step 0"):
        opt.step()
    rec.close()
    assert torch.equal(rec.trajectory.parameters(0), initial)


def _replace_optimizer(module, opt):  # a new optimizer the recorder does not hook
    return torch.optim.SGD(module.parameters(), lr=0.05)


def _keep_optimizer(module, opt):  # the recorder closed, training goes on
    return opt


@pytest.mark.parametrize("after", [_replace_optimizer, _keep_optimizer])
def test_steps_taken_after_the_last_recorded_one_are_warned(data, after):
    """Steps the recorder does not see after its last recorded one (an optimizer
    replaced mid-training, training continued after the with-block) left a trajectory
    that ends before the module's current parameters: as_network's decomposition
    reported an error at round-off while missing the module's outputs, without a word.
    Reading the trajectory now warns; a recording that ends with its last step stays
    silent and exact."""
    X, y, Xq = data
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y.reshape(-1, 1))
    module = _tanh_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)

    def step(opt):
        opt.zero_grad()
        (0.5 * (module(Xt) - Yt) ** 2).mean().backward()
        opt.step()

    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(3):
            rec.set_batch(np.arange(len(X)))
            step(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_decomposes(module, rec.as_network(X, y), Xq)
    opt = after(module, opt)
    for _ in range(2):
        step(opt)
    with pytest.warns(UserWarning, match="changed after optimizer step 2, the last one "
                      "recorded, and no recorded step explains"):
        net = rec.as_network(X, y)
    with torch.no_grad():
        truth = module(torch.as_tensor(Xq)).numpy()
    res = net.decompose(Xq)
    miss = np.abs(res.initial + res.contributions.sum(1) + res.regularization - truth)
    assert miss.max() > 1e-3  # the numbers the warning is about



def test_a_module_converted_after_recording_is_not_taken_for_a_moved_one(data):
    """module.double() after the with-block changes the parameters' dtype, not their
    values; their norms, computed in float64 instead of float32, differed in the last
    bits and reading the trajectory warned that steps the recorder did not see had moved
    the module. The check now compares the values in the dtype they were recorded in:
    silent, with the trajectory's last point the module's converted parameters."""
    X, y, _ = data
    module = _tanh_mlp().float()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)
    rec = _recorded_full_batch(module, opt, X.astype(np.float32), y.astype(np.float32),
                               steps=3)
    module.double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traj = rec.trajectory
    last = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    assert torch.equal(traj.parameters(3).double(), last)


def _changed(value):
    """A value of an optimizer option other than its default ``value``."""
    if isinstance(value, bool) or value is None:
        return not value
    if isinstance(value, tuple):  # betas
        return tuple(b / 2 for b in value)
    return value / 2 if value else 0.5


def test_the_refused_options_are_those_the_user_guide_lists():
    """Every option of the four optimizers' constructors, set away from its default one
    at a time (SGD from momentum=0.9, where dampening applies), is recorded or refused by
    the recorder itself; the refused ones are exactly those own_loop.rst lists (it
    omitted RMSprop's momentum and differentiable), each refused with an error naming the
    option and its default. foreach and fused only choose an implementation; capturable
    asks for a device the parameters are not on (torch refuses its CPU step)."""
    text = " ".join((DOCS / "user_guide" / "own_loop.rst").read_text().split())
    listed = re.search(r"Options that change the update rule in ways the decomposition "
                       r"does not model \((.*?)\) are refused", text).group(1)
    names = set(re.findall(r"``(\w+)``", listed))
    # "``centered`` and ``momentum`` of RMSprop": SGD's momentum is recorded.
    pair = re.search(r"``(\w+)`` and ``(\w+)`` of RMSprop", listed)
    rmsprop_only = set(pair.groups()) if pair else set()
    module = torch.nn.Linear(2, 1)
    refused, expected = set(), set()
    for cls, base in [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                      (torch.optim.Adam, {}), (torch.optim.AdamW, {}),
                      (torch.optim.RMSprop, {})]:
        params = inspect.signature(cls.__init__).parameters
        for option, p in params.items():
            if option in ("self", "params", "foreach", "fused", "capturable"):
                continue
            value = _changed(base.get(option, p.default))
            opt = cls(module.parameters(), **{**base, option: value})
            try:
                PathRecorder(module, opt)
            except ValueError as e:
                refused.add((cls.__name__, option))
                default = p.default
                assert f"with {option}={value!r}" in str(e)
                assert f"Use {option}={default!r}" in str(e)
            if option in names and (option not in rmsprop_only or cls is torch.optim.RMSprop):
                expected.add((cls.__name__, option))
    assert refused == expected
    assert ("RMSprop", "momentum") in refused and ("SGD", "momentum") not in refused


def _tangent_distances(net, Xq, X_fit, step, normalized):
    """Brute-force kneighbors distances: per-sample autograd Jacobians at ``step`` (float64),
    the trace kernel, and the feature-space distance (cosine-normalised or raw)."""
    JQ, JF = jacobian_loop(module_at(net, step), Xq), jacobian_loop(module_at(net, step), X_fit)
    C = JQ.shape[1]
    K = np.einsum("qcp,ncp->qn", JQ, JF) / C
    dq, df = np.einsum("qcp,qcp->q", JQ, JQ) / C, np.einsum("ncp,ncp->n", JF, JF) / C
    if normalized:
        return np.sqrt(np.clip(2.0 - 2.0 * K / np.sqrt(dq[:, None] * df[None, :]), 0, None))
    return np.sqrt(np.clip(dq[:, None] + df[None, :] - 2.0 * K, 0, None))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_recorded_network_transforms_and_finds_neighbours_as_the_estimators(kind):
    """The s49 trial: a RecordedNetwork (a user's own loop) had no kneighbors nor
    transform, which the estimators and TrainedNetwork have. transform is a per-sample
    autograd loop's flattened Jacobian / sqrt(C); kneighbors is the argsort of the
    hand-computed tangent-kernel distances, queries given or the training set itself
    (a point not its own neighbour)."""
    net, X = own_loop(kind, n_outputs=2)
    Xq = X[:5] + 0.1
    phi = net.transform(Xq)
    assert phi.dtype == np.float64 and phi.shape == (5, 2 * net.n_params_)
    assert_allclose(phi, features_loop(module_at(net), Xq), rtol=1e-10, atol=1e-12)
    for step, normalized in [(-1, True), (0, False)]:
        D = _tangent_distances(net, Xq, X, step, normalized)
        dist, ind = net.kneighbors(Xq, 4, step=step, normalized=normalized)
        assert_array_equal(ind, np.argsort(D, axis=1, kind="stable")[:, :4])
        assert_allclose(dist, np.take_along_axis(D, ind, axis=1), rtol=1e-8, atol=1e-10)
    D = _tangent_distances(net, X, X, -1, True)
    np.fill_diagonal(D, np.inf)  # a training point is not its own neighbour
    ind = net.kneighbors(n_neighbors=3, return_distance=False)
    assert_array_equal(ind, np.argsort(D, axis=1, kind="stable")[:, :3])


def test_recorded_network_without_x_train_transforms_but_has_no_neighbours():
    """Without X_train the outputs per sample are counted on X (an own loop declares
    none), so transform works; kneighbors needs the training inputs and says so."""
    net, X = own_loop(n_outputs=3, X_train=False)
    assert_allclose(net.transform(X[:4]), features_loop(module_at(net), X[:4]),
                    rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="kneighbors needs the training inputs"):
        net.kneighbors(X[:2], 1)
    with pytest.raises(ValueError, match=r"could not take X of shape \(2, 5\)"):
        net.transform(np.ones((2, 5)))


def _named_recorded(n_outputs=2):
    """A RecordedNetwork of an own loop whose X_train is a DataFrame, and its values."""
    pd = pytest.importorskip("pandas")
    net, X = own_loop("mlp", n_outputs=n_outputs)
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    return RecordedNetwork(net.module, net.trajectory, X_train=df, y_train=net.y_train,
                           loss=net.loss), df, X


def test_a_recorded_network_refuses_columns_other_than_x_trains():
    """X_train's column names are feature_names_in_, checked as the estimators check
    them: a reordered DataFrame was read by position, silently computing on the wrong
    features."""
    net, df, X = _named_recorded()
    assert_array_equal(net.feature_names_in_, ["a", "b", "c"])
    reordered, renamed = df[["c", "a", "b"]], df.rename(columns={"a": "z"})
    calls = [net.transform, net.predict, net.decompose, net.attribute,
             lambda Z: net.explain(Z, 2), lambda Z: net.kneighbors(Z, 2),
             net.tangent_kernel_]
    for bad in (reordered, renamed):
        for call in calls:
            with pytest.raises(ValueError, match="feature names"):
                call(bad[:3])
    # The same columns in their order: the values, as the per-sample autograd loop.
    assert_allclose(net.transform(df[:4]), features_loop(module_at(net), X[:4]),
                    rtol=1e-10, atol=1e-12)
    # Values without names warn, as scikit-learn's estimators do, and are taken.
    with pytest.warns(UserWarning, match="does not have valid feature names"):
        assert_allclose(net.transform(X[:4]), net.transform(df[:4]), rtol=1e-12)
    # Without names in X_train, nothing was declared: no names, nothing checked.
    plain = RecordedNetwork(net.module, net.trajectory, X_train=X, y_train=net.y_train,
                            loss=net.loss)
    assert not hasattr(plain, "feature_names_in_")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_allclose(plain.transform(reordered[:3]), plain.transform(X[:3, [2, 0, 1]]),
                        rtol=1e-12)


@pytest.mark.parametrize("n_outputs", [1, 2])
def test_a_recorded_network_sets_its_transforms_output(n_outputs):
    """set_output(transform="pandas") as the estimators' transformers: the tangent
    features as a DataFrame named by the parameters (per output when several), the
    index of X kept; fit_transform as fit (nothing) then transform."""
    pd = pytest.importorskip("pandas")
    net, df, X = _named_recorded(n_outputs)
    names = [f"{name}[{i}]" for name, p in net.module.named_parameters()
             for i in range(p.numel())]
    if n_outputs > 1:
        names = [f"out{c}:{n}" for c in range(n_outputs) for n in names]
    assert net.get_feature_names_out().tolist() == names
    with pytest.raises(ValueError, match="input_features is not equal"):
        net.get_feature_names_out(["x", "y", "z"])
    out = clone(net).set_output(transform="pandas").transform(df.iloc[5:9])
    assert isinstance(out, pd.DataFrame) and list(out.columns) == names
    assert list(out.index) == [5, 6, 7, 8]
    assert_allclose(out.to_numpy(), features_loop(module_at(net), X[5:9]), rtol=1e-10,
                    atol=1e-12)
    phi = net.set_output(transform="pandas").fit_transform(df[:3])
    assert isinstance(phi, pd.DataFrame)
    # The network's dtype comes out, as the estimators' transformers declare.
    assert get_tags(net).transformer_tags.preserves_dtype == ["float64"]
    # Without X_train the outputs cannot be counted: said, not guessed.
    bare = RecordedNetwork(net.module, net.trajectory)
    with pytest.raises(ValueError, match="X_train"):
        bare.get_feature_names_out()
