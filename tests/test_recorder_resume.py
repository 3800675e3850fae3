"""PathRecorder(resume_from=...): a recorded loop interrupted, checkpointed and resumed,
against the same loop run without the interruption.

The reference is the uninterrupted loop itself (the same seeded module, batches,
scheduler and clipping): where the arithmetic of the resumed loop is the same (torch's
state dicts restore every tensor bit for bit), the recorded path must be the same bit
for bit, and so must the kernels and the decomposition computed from it; the
decomposition's closure is checked against the trained module's own outputs.
"""

import copy
import io
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose, assert_array_equal

from skpathkernel import PathRecorder, Trajectory

N_STEPS, BREAK = 7, 3

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.02, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    # AdamW's usual groups: no decay on the biases, a step size of their own.
    "adamw-groups": lambda p: torch.optim.AdamW(
        [{"params": [q for q in p if q.ndim > 1]},
         {"params": [q for q in p if q.ndim == 1], "weight_decay": 0.0, "lr": 0.01}],
        lr=0.02, weight_decay=0.1),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(16, 2))
    return X, (np.sin(3 * X[:, :1]) + X[:, 1:]), rng.uniform(-1, 1, size=(3, 2))


def _setup(kind):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(),
                                 torch.nn.Linear(5, 1)).double()
    params = list(module.parameters())
    opt = OPTIMIZERS[kind](params)
    return module, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _steps(data, module, opt, sched, rec, start, stop):
    """Steps ``start:stop`` of the loop: minibatches of 4, norm clipping (recorded as
    gradient scales), the scheduler stepped after each step."""
    X, y = (torch.as_tensor(a) for a in data[:2])
    for t in range(start, stop):
        idx = torch.arange(4) + 4 * (t % 4)
        opt.zero_grad()
        (0.5 * (module(X[idx]) - y[idx]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        rec.set_batch(idx)
        opt.step()
        sched.step()


def _checkpoint(module, opt, sched):
    """The training state as a torch checkpoint holds it: serialized and read back."""
    buf = io.BytesIO()
    torch.save({"model": module.state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def _restored(kind, state):
    module, opt, sched = _setup(kind)  # new objects, as in a new process
    state = copy.deepcopy(state)  # load_state_dict keeps the optimizer's tensors
    module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    return module, opt, sched


def _interrupted(data, kind, storage, tmp, *, crash=True):
    """The loop stopped after BREAK steps by a checkpoint, then resumed in new objects.
    With ``crash``, the first run goes on past the checkpoint before it dies: the steps
    it recorded after it are lost, as the training that made them."""
    module, opt, sched = _setup(kind)
    rec = PathRecorder(module, opt, n_samples=len(data[0]), storage=storage, directory=tmp)
    _steps(data, module, opt, sched, rec, 0, BREAK)
    ckpt = os.path.join(tmp, "path" if storage == "disk" else "path.pt")
    rec.trajectory.save(ckpt)
    state = _checkpoint(module, opt, sched)
    if crash:
        _steps(data, module, opt, sched, rec, BREAK, BREAK + 2)
    del rec
    module, opt, sched = _restored(kind, state)
    rec = PathRecorder(module, opt, n_samples=len(data[0]), storage=storage,
                       resume_from=Trajectory.load(ckpt))
    assert rec.n_steps == BREAK
    _steps(data, module, opt, sched, rec, BREAK, N_STEPS)
    return module, rec, ckpt


def _assert_identical(a, b):
    """Every array of two recorded paths, bit for bit."""
    assert (len(a), a.n_steps, a.names, a.shapes, a.n_samples, a.storage) == (
        len(b), b.n_steps, b.names, b.shapes, b.n_samples, b.storage)
    assert a.solver_spec == b.solver_spec and a.record_every == b.record_every
    for name in ("steps", "learning_rates", "step_learning_rates", "gradient_scales"):
        assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for t in range(a.n_steps):
        assert_array_equal(a.batch(t), b.batch(t))
        assert_array_equal(a.batch_weights(t), b.batch_weights(t))
    for k in range(len(a)):
        assert torch.equal(a.parameters(k), b.parameters(k)), k
    for k in range(len(a) - 1):
        sa, sb = a.optimizer_state(k), b.optimizer_state(k)
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[key], sb[key]) for key in sa), k
        for x, y in ((a.step_size_scales(k), b.step_size_scales(k)),
                     (a.preconditioner(k), b.preconditioner(k))):
            assert (x is None and y is None) or torch.equal(x, y), k
    assert (a.weight_decays() is None and b.weight_decays() is None) or torch.equal(
        a.weight_decays(), b.weight_decays())


@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_resumed_loop_records_the_uninterrupted_path(data, kind, storage, tmp_path):
    X, y, Xq = data
    module, opt, sched = _setup(kind)
    whole = PathRecorder(module, opt, n_samples=len(X), storage=storage,
                         directory=tmp_path / "whole")
    _steps(data, module, opt, sched, whole, 0, N_STEPS)
    resumed_module, rec, ckpt = _interrupted(data, kind, storage, tmp_path)
    assert rec.n_steps == whole.n_steps == N_STEPS
    for p, q in zip(module.parameters(), resumed_module.parameters()):
        assert torch.equal(p, q)  # the training itself is the same
    a, b = whole.trajectory, rec.trajectory
    _assert_identical(a, b)
    if kind == "adamw-groups":
        assert b.step_size_scales(0) is not None and b.weight_decays() is not None
    if storage == "disk":
        assert b.directory == os.path.abspath(ckpt)  # recorded on into the checkpoint
    # The next checkpoint goes where the last one went, and loads as the whole path.
    b.save(ckpt)
    _assert_identical(a, Trajectory.load(ckpt))
    # What the path gives: the kernels and the decomposition of the same network.
    net_a = whole.as_estimator(X, y)
    net_b = rec.as_estimator(X, y)
    assert_array_equal(net_a.path_kernel_(Xq, X), net_b.path_kernel_(Xq, X))
    assert_array_equal(net_a.predict(Xq), net_b.predict(Xq))
    ra, rb = net_a.decompose(Xq), net_b.decompose(Xq)
    assert_array_equal(ra.contributions, rb.contributions)
    assert_array_equal(ra.initial, rb.initial)
    with torch.no_grad():
        truth = resumed_module(torch.as_tensor(Xq)).numpy()
    assert_allclose(rb.initial + rb.contributions.sum(1) + rb.regularization, truth,
                    rtol=0, atol=1e-12)
    assert rb.error < 1e-12


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["sgd-momentum", "adam"])
def test_a_compressed_path_resumes_bit_for_bit(data, kind, compression, tmp_path):
    """Stored as rounded steps, the path's last point is not the module's parameters:
    the resume takes them within that rounding, and the rows it appends continue the
    rounding's error feedback as the uninterrupted recording does."""
    module, opt, sched = _setup(kind)
    whole = PathRecorder(module, opt, n_samples=len(data[0]), storage="disk",
                         directory=tmp_path, compression=compression)
    _steps(data, module, opt, sched, whole, 0, N_STEPS)
    module, opt, sched = _setup(kind)
    rec = PathRecorder(module, opt, n_samples=len(data[0]), storage="disk",
                       directory=tmp_path, compression=compression)
    _steps(data, module, opt, sched, rec, 0, BREAK)
    rec.trajectory.save(tmp_path / "path")
    assert not torch.equal(rec.trajectory.parameters(-1), torch.cat(
        [p.detach().reshape(-1) for p in module.parameters()]))  # rounded
    state = _checkpoint(module, opt, sched)
    _steps(data, module, opt, sched, rec, BREAK, BREAK + 2)  # lost in the crash
    del rec
    module, opt, sched = _restored(kind, state)
    rec = PathRecorder(module, opt, n_samples=len(data[0]), storage="auto",
                       compression=compression, resume_from=Trajectory.load(tmp_path / "path"))
    _steps(data, module, opt, sched, rec, BREAK, N_STEPS)
    _assert_identical(whole.trajectory, rec.trajectory)
    # A module off the stored point by more than its rounding is another point.
    module, opt, sched = _restored(kind, state)
    with torch.no_grad():
        module[2].bias.add_(1e-2)
    with pytest.raises(ValueError, match="not the trajectory's last point"):
        PathRecorder(module, opt, n_samples=len(data[0]), storage="disk",
                     compression=compression, resume_from=Trajectory.load(tmp_path / "path"))


def test_a_loop_resumed_twice_and_from_a_path_without_steps(data, tmp_path):
    """Each resumed recorder is checkpointed and resumed again; a checkpoint taken
    before the first step resumes with a fresh optimizer."""
    module, opt, sched = _setup("adam")
    whole = PathRecorder(module, opt, n_samples=len(data[0]))
    _steps(data, module, opt, sched, whole, 0, N_STEPS)
    module, opt, sched = _setup("adam")
    path = None
    for start, stop in ((0, 0), (0, 2), (2, 5), (5, N_STEPS)):
        if start:
            module, opt, sched = _restored("adam", _checkpoint(module, opt, sched))
        rec = PathRecorder(module, opt, n_samples=len(data[0]), resume_from=path)
        _steps(data, module, opt, sched, rec, start, stop)
        rec.trajectory.save(tmp_path / "path.pt")
        path = Trajectory.load(tmp_path / "path.pt")
        rec.close()
    _assert_identical(whole.trajectory, path)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_thinned_path_resumed_on_its_grid(data, storage, tmp_path):
    """record_every counts from the resumed step: a break on the grid records the
    uninterrupted loop's points."""
    module, opt, sched = _setup("adam")
    whole = PathRecorder(module, opt, n_samples=len(data[0]), record_every=3,
                         storage=storage, directory=tmp_path)
    _steps(data, module, opt, sched, whole, 0, N_STEPS)
    module, opt, sched = _setup("adam")
    rec = PathRecorder(module, opt, n_samples=len(data[0]), record_every=3,
                       storage=storage, directory=tmp_path)
    _steps(data, module, opt, sched, rec, 0, 3)
    rec.trajectory.save(tmp_path / "path")
    rec.close()
    module, opt, sched = _restored("adam", _checkpoint(module, opt, sched))
    rec = PathRecorder(module, opt, n_samples=len(data[0]), record_every=3, storage=storage,
                       resume_from=Trajectory.load(tmp_path / "path"))
    _steps(data, module, opt, sched, rec, 3, N_STEPS)
    assert_array_equal(rec.trajectory.steps, [0, 3, 6, 7])
    _assert_identical(whole.trajectory, rec.trajectory)


def _snapshot(module, opt, path):
    """What a refused resume must leave as it was: the module's values, the
    optimizer's state and hooks, the parameters' hooks, the path (in memory and on
    disk)."""
    files = {}
    if path.storage == "disk":
        for folder, _, names in os.walk(path.directory):
            for name in names:
                with open(os.path.join(folder, name), "rb") as f:
                    files[os.path.join(folder, name)] = f.read()
    return (copy.deepcopy(module.state_dict()), copy.deepcopy(opt.state_dict()),
            len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
            [(len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {}))
             for p in module.parameters()],
            [path.parameters(k).clone() for k in range(len(path))], path.n_steps, files)


def _assert_unchanged(before, after):
    (m0, o0, *hooks0, pts0, n0, files0), (m1, o1, *hooks1, pts1, n1, files1) = before, after
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)
    assert o0["param_groups"] == o1["param_groups"]
    assert o0["state"].keys() == o1["state"].keys()
    for i in o0["state"]:
        assert o0["state"][i].keys() == o1["state"][i].keys()
        assert all(torch.equal(torch.as_tensor(o0["state"][i][k]),
                               torch.as_tensor(o1["state"][i][k])) for k in o0["state"][i])
    assert hooks0 == hooks1 and n0 == n1 and files0 == files1
    assert all(torch.equal(a, b) for a, b in zip(pts0, pts1))


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_resume_that_does_not_continue_the_path_is_refused_and_changes_nothing(
        data, storage, tmp_path):
    n = len(data[0])

    def checkpoint(kind):
        """A recorded loop of ``kind`` stopped after BREAK steps: its saved state and
        path."""
        module, opt, sched = _setup(kind)
        rec = PathRecorder(module, opt, n_samples=n, storage=storage, directory=tmp_path)
        _steps(data, module, opt, sched, rec, 0, BREAK)
        ckpt = tmp_path / f"{kind}-{storage}"
        rec.trajectory.save(ckpt)
        rec.close()
        return _checkpoint(module, opt, sched), ckpt

    states = {kind: checkpoint(kind) for kind in ("adam", "sgd-momentum")}

    def refused(kind, match, change=lambda module, opt: None, make=None, exc=ValueError,
                **kwargs):
        state, ckpt = states[kind]
        module, opt, _ = _restored(kind, state)
        if make is not None:
            module, opt = make(module, opt)
        change(module, opt)
        path = Trajectory.load(ckpt)
        before = _snapshot(module, opt, path)
        with pytest.raises(exc, match=match):
            PathRecorder(module, opt, **{"n_samples": n, "storage": storage,
                                         "resume_from": path, **kwargs})
        _assert_unchanged(before, _snapshot(module, opt, path))
        # The same objects still resume where nothing is wrong with them.
        return module, opt, path

    def fresh(kind):
        return lambda module, opt: (module, OPTIMIZERS[kind](list(module.parameters())))

    def nudge(module, opt):
        with torch.no_grad():
            module[2].bias.add_(1e-12)

    # The wrong point: the module not loaded, or moved by a hair.
    def unloaded(module, opt):  # model.load_state_dict forgotten
        module, new, _ = _setup("adam")
        new.load_state_dict(opt.state_dict())
        return module, new

    refused("adam", "not the trajectory's last point", make=unloaded)
    refused("adam", "not the trajectory's last point", nudge)
    # The wrong optimizer state: a fresh optimizer, another checkpoint's, other moments.
    refused("adam", r"step counts are not the trajectory's 3 .*'0.weight' \(none\)",
            make=fresh("adam"))
    refused("sgd-momentum", "no momentum buffer for '0.weight'", make=fresh("sgd-momentum"))

    def earlier(module, opt):
        for st in opt.state.values():
            st["step"] -= 1
    refused("adam", r"'0.weight' \(2\)", earlier)

    def moments(module, opt):
        next(iter(opt.state.values()))["exp_avg_sq"].mul_(1.5)
    refused("adam", "exp_avg_sq is not the one the trajectory recorded", moments)
    # Other hyper-parameters, another optimizer.
    for change, what in ((lambda m, o: o.param_groups[0].update(betas=(0.8, 0.999)),
                          "beta_1=0.8"),
                         (lambda m, o: o.param_groups[0].update(weight_decay=0.0),
                          "weight_decay=0.0"),
                         (lambda m, o: o.param_groups[0].update(eps=1e-6), "epsilon")):
        refused("adam", what, change)
    refused("sgd-momentum", "momentum=0.5", lambda m, o: o.param_groups[0].update(
        momentum=0.5))
    refused("adam", "name='adamw'", make=lambda m, o: (m, torch.optim.AdamW(
        m.parameters(), lr=0.02, weight_decay=0.01)))
    refused("adam", "parameter groups", make=lambda m, o: (m, torch.optim.Adam(
        [{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}],
        lr=0.02, weight_decay=0.01)))
    # Other parameters: renamed (wrapped in a container), one frozen, another network.
    refused("adam", r"records '0.weight', '0.bias', .*, which this recorder does not; "
                    r"this recorder records '0.0.weight'",
            make=lambda m, o: (torch.nn.Sequential(m), o))
    refused("adam", r"the trajectory records '0.weight', which this recorder does not \(",
            lambda m, o: m[0].weight.requires_grad_(False))
    # Another training set's size; a path kept elsewhere than asked.
    refused("adam", "n_samples=16 training samples, the recorder's n_samples=17",
            n_samples=n + 1)
    refused("adam", "n_samples=None", n_samples=None)
    other = "disk" if storage == "memory" else "memory"
    refused("adam", f"storage={other!r} cannot continue it", storage=other)
    if storage == "disk":
        refused("adam", "compression='float16' cannot continue it", compression="float16")
    refused("adam", "resume_from must be a Trajectory", exc=TypeError,
            resume_from=str(states["adam"][1]))
    # And the right objects resume, once.
    state, ckpt = states["adam"]
    module, opt, _ = _restored("adam", state)
    first = PathRecorder(module, opt, n_samples=n, storage=storage,
                         resume_from=Trajectory.load(ckpt))
    assert first.n_steps == BREAK
    refused("adam", "another PathRecorder still records this optimizer; close",
            make=lambda m, o: (module, opt))
    first.close()


SGD_GROUPS = lambda p: torch.optim.SGD(  # noqa: E731
    [{"params": [q for q in p if q.ndim > 1]},
     {"params": [q for q in p if q.ndim == 1], "lr": 0.01, "weight_decay": 0.0}],
    lr=0.05, momentum=0.9, weight_decay=0.01)


def _sgd(kind):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(),
                                 torch.nn.Linear(5, 1)).double()
    opt = (SGD_GROUPS if kind == "sgd-groups" else OPTIMIZERS[kind])(
        list(module.parameters()))
    return module, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


@pytest.mark.parametrize("kind", ["sgd-momentum", "sgd-groups"])
def test_a_momentum_buffer_of_another_step_warns(data, kind):
    """Heavy-ball SGD keeps no step count: an optimizer checkpoint one step older than
    the module's was taken without a word, and the resumed loop, whose momentum
    restarted from the older buffer, trained on with a path whose decomposition missed
    the trained module's prediction by 2.6e-2 (|f| up to 0.29; only decompose warned).
    The last step tells it: theta_n = theta_(n-1) - lr * buf_n, up to two roundings,
    with each group's step size."""
    module, opt, sched = _sgd(kind)
    rec = PathRecorder(module, opt, n_samples=len(data[0]))
    _steps(data, module, opt, sched, rec, 0, BREAK - 1)
    older = _checkpoint(module, opt, sched)["optim"]
    _steps(data, module, opt, sched, rec, BREAK - 1, BREAK)
    path, state = rec.trajectory, _checkpoint(module, opt, sched)
    rec.close()
    for optim, right in ((older, False), (state["optim"], True)):
        module, opt, sched = _sgd(kind)
        module.load_state_dict(state["model"])
        opt.load_state_dict(copy.deepcopy(optim))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert PathRecorder(module, opt, n_samples=len(data[0]),
                                resume_from=path).n_steps == BREAK
        said = [str(w.message) for w in caught if "momentum buffers" in str(w.message)]
        assert not said if right else said and (
            "'0.weight', '0.bias', '2.weight', '2.bias' are not the ones" in said[0])


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_loop_that_clips_weights_resumes_before_the_clipping(data, storage, tmp_path):
    """A max-norm projection after each step, checkpointed between optimizer.step() and
    the projection (the path's last point is the step's), resumes bit for bit: the
    momentum that the last step's move does not give (the projection before it) warns,
    and refuses nothing."""
    def clip(module):
        with torch.no_grad():
            module[0].weight.clamp_(-0.3, 0.3)

    X, y = (torch.as_tensor(a) for a in data[:2])

    def steps(module, opt, rec, start, stop, last=True):
        for t in range(start, stop):
            idx = torch.arange(4) + 4 * (t % 4)
            opt.zero_grad()
            (0.5 * (module(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
            if t < stop - 1 or last:
                clip(module)

    kw = dict(n_samples=len(X), storage=storage, directory=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the projection, outside optimizer.step()
        module, opt, _ = _sgd("sgd-momentum")
        whole = PathRecorder(module, opt, **kw)
        steps(module, opt, whole, 0, N_STEPS)
        module, opt, _ = _sgd("sgd-momentum")
        rec = PathRecorder(module, opt, **kw)
        steps(module, opt, rec, 0, BREAK, last=False)
        rec.trajectory.save(tmp_path / "path")
        state = _checkpoint(module, opt, torch.optim.lr_scheduler.StepLR(opt, 1))
        rec.close()
        module, opt, _ = _sgd("sgd-momentum")
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        # Checkpointed after the projection: not the path's last point, which says why.
        kept = module[0].weight.detach().clone()
        clip(module)
        with pytest.raises(ValueError, match=r"not the trajectory's last point .* weight "
                                             r"clipping or a projection, saves them before"):
            PathRecorder(module, opt, resume_from=Trajectory.load(tmp_path / "path"), **kw)
        with torch.no_grad():
            module[0].weight.copy_(kept)
    with pytest.warns(UserWarning, match="momentum buffers of '0.weight' are not"):
        rec = PathRecorder(module, opt, resume_from=Trajectory.load(tmp_path / "path"),
                           **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip(module)
        steps(module, opt, rec, BREAK, N_STEPS)
        _assert_identical(whole.trajectory, rec.trajectory)


def test_an_optimizer_with_steps_names_the_resume(data):
    module, opt, sched = _setup("adam")
    rec = PathRecorder(module, opt, n_samples=len(data[0]))
    _steps(data, module, opt, sched, rec, 0, 2)
    with pytest.raises(ValueError, match=r"already taken steps.*resume_from=Trajectory"):
        PathRecorder(module, opt, n_samples=len(data[0]))


def test_a_recorder_refuses_pickling_and_copying_and_names_the_resume(data):
    """A pickled recorder came back without its hooks (torch.optim pickles none): the
    loaded loop trained on and recorded nothing more, silently; deepcopy failed in
    torch's words about graph leaves."""
    module, opt, sched = _setup("adam")
    rec = PathRecorder(module, opt, n_samples=len(data[0]))
    _steps(data, module, opt, sched, rec, 0, 2)
    # The fingerprints of the last step are no part of an autograd graph.
    assert rec._fingerprint is not None and rec._fingerprint.grad_fn is None
    match = r"cannot be pickled or copied.*resume_from=Trajectory\.load"
    for copier in (lambda: pickle.dumps((module, opt, rec)), lambda: copy.deepcopy(rec),
                   lambda: copy.copy(rec),
                   lambda: torch.save({"model": module, "optim": opt, "rec": rec},
                                      io.BytesIO())):
        with pytest.raises(TypeError, match=match):
            copier()
    # The module and the optimizer still pickle, and the recorder records on.
    pickle.loads(pickle.dumps((module, opt)))
    _steps(data, module, opt, sched, rec, 2, 4)
    assert rec.n_steps == 4 and rec.trajectory.n_steps == 4
