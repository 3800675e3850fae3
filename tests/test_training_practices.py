"""PathRecorder on the training practices of real runs: gradient clipping, parameter groups,
GradScaler, dropout, and the decomposition's warning when it is not exact.

References are independent of the recorder: the network's own outputs (the reconstruction
must meet them), torch's returned gradient norms and the optimizer's group settings
written out in the test, and the same run with the recorded correction removed (which
must then miss, and warn).
"""

import pickle
import warnings

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from skpathkernel import PathKernel, PathKernelMachine, PathRecorder, TangentKernel, Trajectory

N, STEPS = 16, 12


@pytest.fixture
def problem():
    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.uniform(-1, 1, size=(N, 3)))
    y = torch.sin(X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).reshape(-1, 1)
    Xq = torch.as_tensor(rng.uniform(-1, 1, size=(4, 3)))
    return X, y, Xq


def _mlp(seed=0, dropout=None):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(3, 16), torch.nn.Tanh()]
    if dropout is not None:
        layers.append(torch.nn.Dropout(dropout))
    layers += [torch.nn.Linear(16, 1)]
    return torch.nn.Sequential(*layers).double()


def _jacobian(module, traj, point, Xq):
    """(n_queries, P) Jacobian of the module's output at recorded point ``point``, by
    autograd one query at a time (independent of the kernels' engine)."""
    rows = []
    for x in Xq:
        flat = traj.parameters(point).clone().requires_grad_(True)
        params, start = {}, 0
        for name, shape in zip(traj.names, traj.shapes):
            size = int(np.prod(shape))
            params[name] = flat[start : start + size].view(shape)
            start += size
        out = torch.func.functional_call(module, params, (x[None],))[0, 0]
        rows.append(torch.autograd.grad(out, flat)[0])
    return torch.stack(rows)


def _batches(seed=1):
    rng = np.random.RandomState(seed)
    return [rng.choice(N, 8, replace=False) for _ in range(STEPS)]


def _loss(out, y):
    return (0.5 * (out - y) ** 2).mean()


def _relative(res):
    return res.error / np.abs(res.prediction).max()


def _exact(net, Xq):
    """The decomposition, which must not warn, and the truth it must reconstruct."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = net.decompose(Xq.numpy())
    with torch.no_grad():
        truth = net.module(Xq).numpy()
    assert_allclose(res.prediction, truth, rtol=0, atol=1e-13)
    assert_allclose(res.reconstruction, truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    return res


def _clipped_path(X, y, how="torch"):
    """SGD with every gradient's norm clipped to 0.05, by torch's ``clip_grad_norm_`` or
    the recorder's: the module, the recorder and the factors torch's returned norms give
    (``max_norm / (norm + 1e-6)``, 1 when unclipped)."""
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    factors = []
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches():
            opt.zero_grad()
            _loss(module(X[idx]), y[idx]).backward()
            if how == "torch":
                norm = torch.nn.utils.clip_grad_norm_(list(module.parameters()), 0.05)
            else:
                norm = rec.clip_grad_norm_(0.05)
            factors.append(min(1.0, 0.05 / (float(norm) + 1e-6)))
            rec.set_batch(idx)
            opt.step()
    assert min(factors) < 0.5  # the clip acted
    return module, rec, factors


@pytest.mark.parametrize("how", ["torch", "recorder"])
def test_norm_clipping_is_recorded_and_the_split_stays_exact(problem, how):
    X, y, Xq = problem
    _, rec, factors = _clipped_path(X, y, how)
    traj = rec.trajectory
    assert_allclose(traj.gradient_scales, factors, rtol=1e-14)
    net = rec.as_network(X, y)
    _exact(net, Xq)
    # Without the recorded factors the same path is far off, and says so.
    net.trajectory._gradient_scales = None
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        res = net.decompose(Xq.numpy())
    assert _relative(res) > 0.1


def test_gradient_accumulation_stays_exact(problem):
    X, y, Xq = problem
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.5)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches():
            opt.zero_grad()
            for half in (idx[:4], idx[4:]):
                (0.5 * _loss(module(X[half]), y[half])).backward()
            rec.set_batch(idx)
            opt.step()
    assert np.all(rec.trajectory.gradient_scales == 1.0)
    _exact(rec.as_network(X, y), Xq)


@pytest.mark.parametrize("change, match", [
    (lambda ps: torch.nn.utils.clip_grad_value_(ps, 1e-3), "value clipping"),
    (lambda ps: [p.grad.add_(1e-3 * torch.randn_like(p.grad)) for p in ps], "noise"),
    (lambda ps: ps[0].grad.mul_(0.5), "surgery"),
])
def test_per_entry_gradient_changes_are_refused_before_the_step(problem, change, match):
    X, y, _ = problem
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    rec = PathRecorder(module, opt, n_samples=N)
    idx = np.arange(8)
    opt.zero_grad()
    _loss(module(X[idx]), y[idx]).backward()
    rec.set_batch(idx)
    opt.step()
    before = [p.detach().clone() for p in module.parameters()]
    opt.zero_grad()
    _loss(module(X[idx]), y[idx]).backward()
    change(list(module.parameters()))
    rec.set_batch(idx)
    with pytest.raises(ValueError, match=match):
        opt.step()
    # Refused before the step: the parameters did not move and the record is whole.
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p, b)
    with pytest.warns(UserWarning, match="ends after optimizer step 0"):
        traj = rec.trajectory
    assert traj.n_steps == 1 and torch.equal(traj.parameters(-1),
                                             torch.cat([b.reshape(-1) for b in before]))


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd-momentum-l2"])
def test_parameter_groups_with_their_own_lr_and_weight_decay(problem, kind, tmp_path):
    X, y, Xq = problem
    module = _mlp()
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    if kind == "adamw":  # the usual groups: no decay and another step size on biases
        groups = [{"params": weights, "weight_decay": 0.1},
                  {"params": biases, "weight_decay": 0.0, "lr": 0.02}]
        opt = torch.optim.AdamW(groups, lr=0.01)
    elif kind == "sgd":
        opt = torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.1}], lr=0.4)
    else:
        groups = [{"params": weights, "weight_decay": 0.05},
                  {"params": biases, "weight_decay": 0.0, "lr": 0.1}]
        opt = torch.optim.SGD(groups, lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.9**t])
    used = []
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches():
            used.append([g["lr"] for g in opt.param_groups])
            opt.zero_grad()
            _loss(module(X[idx]), y[idx]).backward()
            rec.set_batch(idx)
            opt.step()
            sched.step()
    traj = rec.trajectory
    used = np.array(used)
    assert_allclose(traj.learning_rates, used.max(axis=1), rtol=1e-15)
    # Each parameter's step size relative to the recorded one, written out by name.
    k = 5
    expected = torch.cat([torch.full((p.numel(),), used[k, 0 if n.endswith("weight") else 1]
                                     / used[k].max(), dtype=torch.float64)
                          for n, p in module.named_parameters()])
    assert_allclose(traj.step_size_scales(k).numpy(), expected.numpy(), rtol=1e-15)
    if kind == "sgd":
        assert_allclose(traj.preconditioner(k).numpy(), expected.numpy(), rtol=1e-15)
        # The path kernel: each parameter's own step size at every step, against
        # sum_t J_t diag(lr of its group) J_t^T by autograd.
        is_w = torch.cat([torch.full((p.numel(),), n.endswith("weight"))
                          for n, p in module.named_parameters()])
        lrs = torch.as_tensor(used, dtype=torch.float64)
        ref = sum((J * torch.where(is_w, lrs[t, 0], lrs[t, 1])) @ J.T
                  for t, J in ((t, _jacobian(module, traj, t, Xq)) for t in range(STEPS)))
        assert_allclose(PathKernel(rec.as_network(X, y))(Xq.numpy()), ref.numpy(),
                        rtol=1e-10, atol=1e-14)
    net = rec.as_network(X, y)
    _exact(net, Xq)
    # Saved, loaded and pickled with what the groups recorded.
    traj.save(tmp_path / "path.pt")
    for copy in (Trajectory.load(tmp_path / "path.pt"), pickle.loads(pickle.dumps(traj))):
        assert_allclose(copy.step_size_scales(k).numpy(), expected.numpy(), rtol=0)
        assert torch.equal(copy.preconditioner(k) if kind != "sgd" else
                           copy.step_size_scales(k), traj.preconditioner(k) if kind != "sgd"
                           else traj.step_size_scales(k))
        wd = copy.weight_decays()
        assert (wd is None) == (kind == "sgd")
    # One step size for all would not add up: the check has teeth.
    net.trajectory._group_lrs = None
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        net.decompose(Xq.numpy())


def test_groups_that_differ_in_momentum_are_refused():
    module = _mlp()
    groups = [{"params": [module[0].weight]},
              {"params": [p for n, p in module.named_parameters() if n != "0.weight"],
               "betas": (0.8, 0.99)}]
    with pytest.raises(ValueError, match="group 1.*betas"):
        PathRecorder(module, torch.optim.Adam(groups, lr=0.01))


def _recorded_sgd(module, X, y):
    """Four minibatch SGD steps of ``module``, recorded."""
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches()[:4]:
            opt.zero_grad()
            _loss(module(X[idx]), y[idx]).backward()
            rec.set_batch(idx)
            opt.step()
    return rec


def _batch_norm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _spectral_norm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.Tanh(),
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(16, 1))).double()


class _StackedLSTM(torch.nn.Module):
    """The 3 features as a sequence of 3 steps through a two-layer LSTM, whose dropout
    between its layers draws in training mode (an attribute, not a Dropout module)."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(1, 4, num_layers=2, dropout=0.3, batch_first=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.rnn(x.unsqueeze(-1))[0][:, -1])


def _stacked_lstm():
    torch.manual_seed(0)
    return _StackedLSTM().double()


@pytest.mark.parametrize("make, layer", [
    (lambda: _mlp(dropout=0.2), r"layer '2' \(Dropout\(p=0.2.*random draws"),
    # An RNN has no p, and on CUDA cuDNN's RNN has no backward in eval mode.
    (_stacked_lstm, r"layer 'rnn' \(LSTM\(1, 4, num_layers=2.*random draws.*dropout=0, "
                    r"not layer"),
    (_batch_norm_mlp, r"layer '1' \(BatchNorm1d.*batch's own statistics"),
    (_spectral_norm_mlp, r"layer '2.parametrizations.weight.0' .*power iteration"),
], ids=["dropout", "lstm-dropout", "batchnorm", "spectral-norm"])
def test_training_mode_dropout_and_batch_norm_are_refused_naming_the_layer(problem, make,
                                                                          layer):
    X, y, Xq = problem
    module = make()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=N)
    idx = np.arange(8)
    _loss(module(X[idx]), y[idx]).backward()
    rec.set_batch(idx)
    with pytest.raises(RuntimeError, match=layer + ".*eval"):
        opt.step()
    rec.close()
    # In eval mode (no mask drawn; BatchNorm's running statistics fixed) the same network
    # records and decomposes exactly.
    module = make().eval()
    rec = _recorded_sgd(module, X, y)
    _exact(rec.as_network(X, y), Xq)


def test_batch_norm_without_running_statistics_is_refused_in_eval_mode_too(problem):
    # It normalises with the batch in either mode; the refusal said "is in training mode"
    # of a layer in eval mode and advised layer.eval(), which it already was in.
    X, y, _ = problem
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.BatchNorm1d(16, track_running_stats=False),
        torch.nn.Tanh(), torch.nn.Linear(16, 1)).double().eval()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=N)
    idx = np.arange(8)
    _loss(module(X[idx]), y[idx]).backward()
    rec.set_batch(idx)
    with pytest.raises(RuntimeError, match=r"(?s)layer '1' \(BatchNorm1d.*keeps no running "
                       r"statistics.*track_running_stats=True") as info:
        opt.step()
    assert "training mode" not in str(info.value)
    rec.close()


def test_outputs_refuse_a_batch_norm_put_back_in_training_mode(problem):
    """The kernels and features refused a BatchNorm in training mode at analysis time,
    but predict ran it: each query normalised with the statistics of its block (padding
    rows included) and the running statistics were overwritten, so every later analysis
    described another network. The outputs refuse it now, naming the layer, and leave
    the buffers as they were."""
    X, y, Xq = problem
    module = _batch_norm_mlp().eval()
    rec = _recorded_sgd(module, X, y)
    net = rec.as_estimator(X, y)
    with torch.no_grad():
        truth = module(Xq).numpy()
    module.train()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    for outputs in (net.predict, rec.as_network(X, y).outputs):
        with pytest.raises(ValueError, match=r"(?s)Layer '1' \(BatchNorm1d\) is in "
                           r"training mode.*module.eval\(\)"):
            outputs(Xq.numpy())
    for k, v in module.state_dict().items():
        assert torch.equal(v, state[k]), k
    module.eval()
    assert_allclose(net.predict(Xq.numpy()), truth, rtol=0, atol=1e-13)


def test_outputs_accept_an_instance_norm_without_running_statistics_in_training_mode(
        problem):
    """An InstanceNorm without running statistics normalises each sample by its own
    statistics and moves no buffer, in either mode: fit, PathRecorder and the kernels
    accept it in training mode, but the outputs' mode check refused it as a BatchNorm
    (predict failed on a network that decompose described). The outputs are the
    module's own forward, row by row."""
    X, y, Xq = problem
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Unflatten(1, (2, 4)), torch.nn.InstanceNorm1d(2),
        torch.nn.Flatten(), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    assert module.training
    rec = _recorded_sgd(module, X, y)
    with torch.no_grad():
        truth = torch.cat([module(x[None]) for x in Xq]).numpy()
    net = rec.as_estimator(X, y)
    assert_allclose(net.predict(Xq.numpy()).reshape(truth.shape), truth, rtol=1e-12,
                    atol=1e-13)
    assert_allclose(rec.as_network(X, y).outputs(Xq.numpy()), truth, rtol=1e-12,
                    atol=1e-13)
    # Tracking running statistics, it moves them in training mode: refused as before.
    module[2] = torch.nn.InstanceNorm1d(2, track_running_stats=True).double()
    with pytest.raises(ValueError, match=r"Layer '2' \(InstanceNorm1d\) is in training"):
        rec.as_network(X, y).outputs(Xq.numpy())


@pytest.mark.parametrize("stale", [True, False])
def test_a_clip_over_gradients_outside_the_record_is_named_by_the_unrolled_scores(problem,
                                                                                 stale):
    """Fine-tuning after pretraining in the same process: the frozen layer, not given to
    the optimizer, keeps the .grad of its last pretraining step, and
    clip_grad_norm_(module.parameters()) counts it in its norm (and scales it). The
    decomposition stays exact (the factor applied is recorded), but the unrolled scores
    differentiate the factor as the norm of the recorded gradients: they warned that
    the factors were not one clip's, with a changed max_norm as the only cause named.
    The warning names the parameters that hold gradients outside the record; with
    their .grad set to None there is none."""
    X, y, Xq = problem
    module = _mlp()
    pre = torch.optim.SGD(module.parameters(), lr=0.1)
    pre.zero_grad()
    _loss(module(X), 2 * y).backward()  # "pretraining": every .grad is set
    pre.step()
    module[0].requires_grad_(False)
    if not stale:
        module.zero_grad(set_to_none=True)
    # The idiom that leaves the frozen layer's .grad alone: zero_grad clears the
    # optimizer's parameters only.
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches()[:6]:
            opt.zero_grad()
            _loss(module(X[idx]), y[idx]).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.05)
            rec.set_batch(idx)
            opt.step()
    assert (np.asarray(rec.trajectory.gradient_scales) < 0.5).all()  # every step clipped
    net = rec.as_network(X, y)
    _exact(net, Xq)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.attribute(Xq.numpy(), method="unrolled")
    named = [w for w in caught if "outside the record hold gradients (0.weight, 0.bias)"
             in str(w.message)]
    assert len(named) == stale
    if not stale:
        assert not caught


def _scaled_run(module, X, y, half=None, make_opt=None, clip=True):
    """A GradScaler loop (the forward under ``torch.autocast`` with ``half``), an overflow
    at step 3, clipping after unscaling (or neither with ``clip=False``); returns the
    recorder, the points the parameters took, the batches and torch's clip factors of the
    steps taken."""
    make_opt = make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.5))
    opt = make_opt(module.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    points = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    taken, factors = [], []
    with PathRecorder(module, opt, n_samples=N, grad_scaler=scaler) as rec:
        for t, idx in enumerate(_batches()):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
                out = module(X[idx])
            assert out.dtype == (half or X.dtype)
            loss = _loss(out.to(X.dtype), y[idx])
            if t == 3:  # an overflow: GradScaler skips the step
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            rec.set_batch(idx)
            norm = 0.0
            if clip:
                scaler.unscale_(opt)
                norm = float(rec.clip_grad_norm_(0.1))
            scaler.step(opt)
            scaler.update()
            now = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            if not torch.equal(now, points[-1]):
                points.append(now)
                taken.append(idx)
                factors.append(min(1.0, 0.1 / (norm + 1e-6)))
    traj = rec.trajectory
    assert traj.n_steps == STEPS - 1 == len(taken)
    for k, (point, idx) in enumerate(zip(points, [*taken, None])):
        assert torch.equal(traj.parameters(k), point)
        if idx is not None:
            assert np.array_equal(traj.batch(k), idx)
    return rec, factors


def test_grad_scaler_skipped_steps_are_not_steps_and_the_scale_is_undone(problem):
    X, y, Xq = problem
    rec, factors = _scaled_run(_mlp(), X, y)
    # Clipped after unscaling, recorded as such.
    assert_allclose(rec.trajectory.gradient_scales, factors, rtol=1e-14)
    assert min(factors) < 0.9
    _exact(rec.as_network(X, y), Xq)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
], ids=["sgd", "adam"])
@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_with_a_fused_optimizer(problem, make_opt, clip):
    """A fused optimizer takes the GradScaler's scale and overflow flag into its own
    kernel: ``scaler.step`` calls ``optimizer.step()`` even on an overflow (the kernel
    leaves the parameters alone), and the gradients it sees are still scaled unless
    ``unscale_`` ran. The skipped step must not be recorded, and the recorded factor
    must be the one the kernel applied (1 here, or the clip's)."""
    X, y, Xq = problem
    rec, factors = _scaled_run(_mlp(), X, y, make_opt=make_opt, clip=clip)
    assert_allclose(rec.trajectory.gradient_scales, factors if clip else 1.0, rtol=1e-14)
    _exact(rec.as_network(X, y), Xq)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_grad_scaler_under_cpu_autocast(problem, half):
    """Mixed precision as people train it: the forward in half precision under
    torch.autocast, the loss scaled by a GradScaler, unscaled and clipped before the
    step. The record is the training's (its points, the skipped step left out, torch's
    clip factors); the decomposition and the unrolled scores recompute the steps in
    float32, which misses what the half-precision forward made by its round-off, and
    they say so instead of passing as exact."""
    X, y, Xq = (t.float() for t in problem)
    rec, factors = _scaled_run(_mlp().float(), X, y, half)
    assert_allclose(rec.trajectory.gradient_scales, factors, rtol=1e-6)
    assert min(factors) < 0.5
    net = rec.as_network(X, y)
    with pytest.warns(UserWarning, match="reconstruction misses the prediction"):
        res = net.decompose(Xq.numpy())
    change = np.abs(res.prediction - res.initial).max()
    # The size of a half-precision forward's round-off, far above float32's floor.
    assert 1e-5 < res.error / change < 1e-2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = net.attribute(Xq.numpy(), method="unrolled")
    assert 1e-5 < scores.replay_error < 1e-1
    # Warned exactly when above the limit the unrolled scores allow float32 round-off.
    warned = any("miss the recorded path" in str(w.message) for w in caught)
    assert warned == (scores.replay_error > 1e-3)


def test_a_wrongly_declared_batch_warns_in_decompose_attribute_and_explain(problem):
    X, y, Xq = problem
    module = _mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=N) as rec:
        for idx in _batches():
            opt.zero_grad()
            _loss(module(X[idx]), y[idx]).backward()
            rec.set_batch(idx[:4])  # half of the batch: a partial declaration
            opt.step()
    net = rec.as_network(X, y)
    with pytest.warns(UserWarning, match=r"misses the prediction by .* partly declared"):
        res = net.decompose(Xq.numpy())
    assert _relative(res) > 0.01
    with pytest.warns(UserWarning, match="misses the prediction"):
        net.attribute(Xq.numpy())
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="sgd", max_iter=5,
                            dtype="float64", random_state=0).fit(X.numpy(), y.numpy().ravel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.explain(Xq.numpy(), n_neighbors=3)
    est.trajectory_.learning_rates[:] *= 1.5  # a record that is not the training's
    with pytest.warns(UserWarning, match="misses the prediction") as caught:
        est.explain(Xq.numpy(), n_neighbors=3)
    assert caught[0].filename == __file__  # at the caller's line


def test_path_kernel_of_a_clipped_path_weights_each_step_by_its_factor(problem):
    X, y, Xq = problem
    module, rec, factors = _clipped_path(X, y)
    traj = rec.trajectory
    # Independent reference: sum_t lr * c_t * J(x; theta_t) J(x'; theta_t)^T, Jacobians of
    # the module by autograd at each recorded point.
    grams = [0.5 * (J @ J.T) for J in (_jacobian(module, traj, t, Xq) for t in range(STEPS))]
    ref = sum(c * G for c, G in zip(factors, grams, strict=True))
    K = PathKernel(rec.as_network(X, y))(Xq.numpy())
    assert_allclose(K, ref.numpy(), rtol=1e-10, atol=1e-14)
    # The same path weighted by lr alone (the factors left out) is another kernel.
    unweighted = sum(grams).numpy()
    assert np.abs(K - unweighted).max() > 0.1 * np.abs(unweighted).max()


class _StochasticDepth(torch.nn.Module):
    """A residual branch dropped per sample in training mode, as torchvision's
    StochasticDepth and timm's DropPath do it: no layer type the recorder knows draws."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 3))
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        branch = self.body(x)
        if self.training:
            keep = torch.empty(x.shape[0], 1, dtype=x.dtype).bernoulli_(1 - self.p)
            branch = branch * keep / (1 - self.p)
        return self.head(x + branch)


def test_a_recorded_module_that_draws_without_a_known_layer_type_is_warned_of(problem):
    # torchvision's ConvNeXt left in training mode: the recorder took the steps, and the
    # analyses drew new masks at every call without a word (kernels, predictions and
    # decompositions varied from call to call). Probed when the network is built.
    X, y, Xq = problem
    torch.manual_seed(0)
    module = _StochasticDepth().double()
    rec = _recorded_sgd(module, X, y)
    match = r"(?s)different outputs for the same input.*stochastic depth.*vary from call"
    with pytest.warns(UserWarning, match=match):
        rec.as_network(X, y)
    with pytest.warns(UserWarning, match=match):
        rec.as_estimator(X, y).predict(Xq.numpy())
    # In eval mode it is one fixed function: no warning, and the path decomposes (the
    # training's draws miss, which decompose reports, as the message says).
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec.as_network(X, y)
    torch.manual_seed(0)
    module = _StochasticDepth().double().eval()
    _exact(_recorded_sgd(module, X, y).as_network(X, y), Xq)


def test_a_one_point_recorded_module_that_draws_is_warned_of_at_its_first_analysis(problem):
    # The route for a network trained elsewhere, PathRecorder(model, SGD(lr=0))
    # .as_estimator(), has no X_train to probe: a stochastic-depth module left in training
    # mode drew anew at every prediction and kernel without a word (s51 review). The first
    # analysis's inputs are probed instead, once per network.
    X, _, Xq = problem
    torch.manual_seed(0)
    module = _StochasticDepth().double()
    est = PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator()
    match = r"(?s)different outputs for the same input.*vary from call"
    with pytest.warns(UserWarning, match=match):
        first = est.predict(Xq.numpy())
    assert not np.allclose(first, est.predict(Xq.numpy()))  # what the warning is about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.predict(Xq.numpy())
        TangentKernel(est)(X.numpy()[:4])
    assert not [w for w in caught if "different outputs" in str(w.message)]  # once
    module.eval()
    est = PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.predict(Xq.numpy())
        net = est.network_
    # The probe ran on a copy: the module's state and the caller's generator stay.
    module.train()
    state, rng = module.state_dict(), torch.get_rng_state()
    net.__dict__["_taken"] = set()
    net.__dict__["_probe_draws"] = True
    with pytest.warns(UserWarning, match=match):
        net.check(Xq.numpy())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in state.items())
