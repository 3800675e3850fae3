"""Independent references shared by the tests: plain per-sample autograd loops.

Nothing here uses skpathkernel's engine: every Jacobian is one ``torch.autograd.grad`` call
per sample and output, the slow and obviously correct way (or, in ``jacrev_features``,
torch.func's dense per-sample Jacobian).
"""

import copy
import math

import numpy as np
import torch

from skpathkernel import PathRecorder
from skpathkernel._path._training import make_optimizer as _make_optimizer

# References computed once per process by what they were computed at (see ``by_content``).
_BY_CONTENT = {}


def _bytes(t):
    return t.dtype, tuple(t.shape), t.detach().cpu().numpy().tobytes()


def by_content(fn, module, params, X, key=()):
    """``fn(module, params, X)``, computed once per process for the same ``key``, module
    (its repr: layers and activations; its train/eval modes and buffers, which the repr
    does not show), parameters and inputs: tests of several routes, outputs or layouts of
    one seeded case take the same slow reference, which is most of their time. A hit is
    the reference of exactly the network and inputs asked for; a module with hooks (which
    none of these shows) is never cached."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in module.modules()):
        return fn(module, params, X)
    content = (fn.__module__, fn.__qualname__, key, repr(module),
               tuple(m.training for m in module.modules()),
               tuple((k, _bytes(b)) for k, b in module.named_buffers()), _bytes(X),
               tuple((k, _bytes(v)) for k, v in params.items()))
    if content not in _BY_CONTENT:
        _BY_CONTENT[content] = fn(module, params, X)
    return _BY_CONTENT[content]


def module_at(est, point=-1, dtype=torch.float64):
    """A copy of ``est.module_`` holding the parameters of recorded point ``point``."""
    module = copy.deepcopy(est.module_).to(dtype)
    return _loaded(module, est.trajectory_.state_dict(point))


def _loaded(module, state):
    """``module`` holding ``state``: every recorded entry must land in it (buffers and
    unrecorded parameters may stay as they are; a name it lacks would be silently lost)."""
    result = module.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return module


def jacobian_loop(module, X):
    """(n, C, P) Jacobian, columns in ``module.parameters()`` (trajectory) order."""
    params = [p for p in module.parameters() if p.requires_grad]
    dtype = params[0].dtype
    rows = []
    X = torch.as_tensor(np.asarray(X))
    # Integer token ids stay integers (an embedding indexes with them).
    for x in X.to(dtype) if X.is_floating_point() else X:
        # Contiguous: torch 2.13 differentiates a grouped channels_last convolution of a
        # sample sliced from a channels_last batch wrongly (its CPU backward).
        out = module(x[None].contiguous()).reshape(-1)
        rows.append(torch.stack([
            # An unused parameter (a bias a patched forward leaves out) has zero gradient.
            torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                       for p, g in zip(params, torch.autograd.grad(
                           out[c], params, retain_graph=True, allow_unused=True))])
            for c in range(out.shape[0])
        ]))
    return torch.stack(rows).detach()


def features_loop(module, X):
    """phi(x) as ``transform`` defines it: the flattened Jacobian / sqrt(C), NumPy."""
    J = jacobian_loop(module, X)
    return (J.reshape(J.shape[0], -1) / np.sqrt(J.shape[1])).numpy()


def jacrev_features(est, X):
    """phi(x) from a dense float64 ``vmap(jacrev)`` of the module at the final point:
    the flattened (C, P) Jacobian / sqrt(C), columns in trajectory (parameters()) order."""
    module = module_at(est)
    params = {n: p.detach() for n, p in module.named_parameters()}

    def f(p, x):
        return torch.func.functional_call(module, p, (x[None],)).reshape(-1)

    J = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))(
        params, torch.as_tensor(X, dtype=torch.float64))
    J = torch.cat([J[n].reshape(len(X), -1, params[n].numel()) for n in params], dim=2)
    return (J.reshape(len(X), -1) / np.sqrt(J.shape[1])).numpy()


def gauss_nodes(n, panels=1):
    """Composite Gauss-Legendre nodes and weights on [0, 1]: ``panels`` x ``n`` nodes."""
    s, w = np.polynomial.legendre.leggauss(n)
    s, w = (s + 1) / 2, w / 2
    return (np.concatenate([(j + s) / panels for j in range(panels)]),
            np.concatenate([w / panels] * panels))


def _as_input(X):
    """Rows as the float64 module takes them: token ids stay integers."""
    X = torch.as_tensor(np.asarray(X))
    return X.double() if X.is_floating_point() else X


def module_with(est, flat):
    module = copy.deepcopy(est.module_).to(torch.float64)
    return _loaded(module, est.trajectory_.unflatten(flat.double()))


def forward_recursion(est, X_train, Y_train, per_sample_loss, X, nodes, sample_weight=None,
                      step_shares=None):
    """Contributions (n, N, C) and regularization (n, C) of the exact decomposition.

    The optimizer's recursion run FORWARD, keeping every training sample's own share of
    the momentum / Adam buffer, with per-sample loss gradients from one autograd call per
    sample and the segment-averaged Jacobian of the queries from the plain autograd loop
    at the quadrature ``nodes`` (``(s, w)`` on [0, 1], e.g. :func:`gauss_nodes`); float64.
    Nesterov (torch.optim.SGD): the step is ``-lr (g_t + momentum * buf_t)``, each sample's
    share of ``g_t`` kept apart from its share of the buffer. ``sample_weight`` (the fit's):
    sample i of a batch weighs ``s_i / sum_batch s`` in its loss (0 for a batch weighing
    0), computed here from the weights, not read from the trajectory; None: ``1 / |B|``.
    ``step_shares`` (a callable ``(t, batch) -> {i: weight}``): each sample's weight in step
    t's gradient instead (the expected weighting's pool of the step).
    """
    traj, spec = est.trajectory_, est.trajectory_.solver_spec
    N, P = len(X_train), traj.n_params
    s, w = nodes
    shares = torch.zeros(N, P, dtype=torch.float64)  # each sample's part of the buffer
    reg_buf = torch.zeros(P, dtype=torch.float64)
    memory = {"sgd": spec.momentum, "adam": spec.beta_1, "adamw": spec.beta_1}.get(spec.name, 0.0)
    nesterov = spec.name == "sgd" and spec.nesterov and spec.momentum > 0
    with torch.no_grad():
        n_out = module_with(est, traj.parameters(0))(_as_input(X[:1])).shape[1]
    contrib = np.zeros((len(X), N, n_out))
    reg = np.zeros((len(X), n_out))
    for t, batch in enumerate(traj.batches):
        theta, nxt = traj.parameters(t).double(), traj.parameters(t + 1).double()
        module = module_with(est, theta)
        adam_factor = 1 - memory if spec.name in ("adam", "adamw") else 1
        own = torch.zeros(N, P, dtype=torch.float64)  # this step's gradient, per sample
        if step_shares is not None:
            beta = step_shares(t, batch)
        elif sample_weight is None:
            beta = {i: 1.0 / len(batch) for i in batch}
        else:
            total = sum(float(sample_weight[i]) for i in batch)
            beta = {i: float(sample_weight[i]) / total if total > 0 else 0.0 for i in batch}
        for i in batch if step_shares is None else beta:
            out = module(_as_input(X_train[i : i + 1]))
            loss = per_sample_loss(out, Y_train[i : i + 1]).sum()
            grads = torch.autograd.grad(loss, list(module.parameters()))
            g = torch.cat([p.reshape(-1) for p in grads])
            shares[i] += g.detach() * beta[i] * adam_factor
            own[i] += g.detach() * beta[i]
        if spec.name != "adamw":  # AdamW's decay is decoupled: added to the step below
            reg_buf += spec.weight_decay * theta * adam_factor
        lr = traj.learning_rates[t]
        scale = lr / (1 - spec.beta_1 ** (t + 1)) if spec.name in ("adam", "adamw") else lr
        D = traj.preconditioner(t)
        D = torch.ones(P, dtype=torch.float64) if D is None else D.double()
        step_i = -scale * D * shares  # (N, P): sample i's part of this step
        step_reg = -scale * D * reg_buf
        if nesterov:
            step_i = -scale * D * (own + memory * shares)
            step_reg = -scale * D * (spec.weight_decay * theta + memory * reg_buf)
        if spec.name == "adamw":
            step_reg = step_reg - lr * spec.weight_decay * theta
        Jbar = sum(wk * jacobian_loop(module_with(est, theta + sk * (nxt - theta)), X)
                   for sk, wk in zip(s, w))
        contrib += torch.einsum("qcp,np->qnc", Jbar, step_i).numpy()
        reg += torch.einsum("qcp,p->qc", Jbar, step_reg).numpy()
        shares *= memory
        reg_buf *= memory
    return contrib, reg


def pin(x, value):
    """``value``'s value with ``x``'s derivative (straight through)."""
    return x + (torch.as_tensor(value, dtype=x.dtype) - x).detach()


def unrolled_replay(net, weights=None, sample_weight=None, step_sizes=None, pinned=False,
                    gradient_dtype=torch.float64):
    """The recorded training replayed as one differentiable float64 graph.

    Every step's loss is the weighted mean over its batch, ``sum w_i s_i l_i / sum w_i
    s_i``, with the per-point weights ``weights`` (a leaf tensor (N,); ones when None)
    times the fit's ``sample_weight`` (ones when None; a batch whose weights sum to 0 has
    no data gradient), and the
    optimizer's update written out from torch.optim's documented algorithms (SGD with
    heavy-ball or Nesterov momentum and L2, Adam, AdamW, RMSprop), so that autograd
    differentiates through it.
    Returns the final parameters as a name -> tensor dict. Every step must be recorded,
    or ``step_sizes`` (one per optimizer step, e.g. from the schedule's own rule) given:
    the path's recorded batches and initialization are read, its step sizes are not.

    ``pinned``: every step's values held at the record (the parameters after it, the
    recorded second moment, Adam's first moment as the recorded step implies it, and the
    batch weights as recorded, :meth:`Trajectory.batch_weights`),
    their derivatives the update's, and the inputs rounded to the path's dtype as the
    training took them: the derivative of the exact training map at the recorded states.
    A free float64 replay of a float32 path is another training, off the recorded one by
    the rounding of every step. ``gradient_dtype``: the loss and its gradient computed
    in it (autograd through a copy of the module), the rest in float64.
    """
    traj, spec, loss = net.trajectory, net.trajectory.solver_spec, net.loss
    X = _as_input(net.X_fit)
    if pinned:
        assert np.all(np.diff(traj.steps) == 1), "pinned: every step recorded"
        X = X.to(traj.dtype).double() if X.is_floating_point() else X
    Y = net.targets()
    Y = Y.double() if Y.is_floating_point() else Y
    N = len(X)
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights
    if sample_weight is not None:
        w = w * torch.as_tensor(np.asarray(sample_weight, dtype=np.float64))
    module = copy.deepcopy(net.module).to(gradient_dtype)
    X = X.to(gradient_dtype) if X.is_floating_point() else X
    Y = Y.to(gradient_dtype) if Y.is_floating_point() else Y
    names = list(traj.names)
    theta = [p.double().requires_grad_(True) for p in traj.state_dict(0).values()]
    m = [torch.zeros_like(p) for p in theta]
    v = [torch.zeros_like(p) for p in theta]
    wd = spec.weight_decay
    for t, batch in enumerate(traj.batches):
        lr = float(traj.learning_rates[t] if step_sizes is None else step_sizes[t])
        rows = torch.as_tensor(batch)
        out = torch.func.functional_call(
            module, {n: p.to(gradient_dtype) for n, p in zip(names, theta)}, (X[rows],))
        per = loss.per_sample(out.reshape(len(rows), -1), Y[rows])
        total = w[rows].sum()
        if total.item() > 0:
            share = w[rows] / total
            if pinned:  # the weights as the training applied them, recorded
                share = pin(share, torch.as_tensor(traj.batch_weights(t)))
            L = (share.to(gradient_dtype) * per).sum()
        else:
            L = (0 * per).sum()
        grads = [g.double() for g in torch.autograd.grad(L, theta, create_graph=True)]
        if pinned:
            after = traj.unflatten(traj.parameters(t + 1).double())
            state = {key: traj.unflatten(value.double())
                     for key, value in traj.optimizer_state(t).items() if key != "step"}
        new = []
        for k, (p, g) in enumerate(zip(theta, grads)):
            name = names[k]
            if spec.name != "adamw":
                g = g + wd * p
            if spec.name == "sgd":
                m[k] = g if t == 0 else spec.momentum * m[k] + g
                # torch.optim.SGD(nesterov=True) steps along g + momentum * buf.
                step = g + spec.momentum * m[k] if spec.nesterov else m[k]
                new.append(p - lr * step)
            elif spec.name in ("adam", "adamw"):
                if spec.name == "adamw":
                    p = p * (1 - lr * wd)
                m[k] = spec.beta_1 * m[k] + (1 - spec.beta_1) * g
                v[k] = spec.beta_2 * v[k] + (1 - spec.beta_2) * g * g
                c = t + 1
                if pinned:
                    v[k] = pin(v[k], state["exp_avg_sq"][name])
                den = _sqrt(v[k] / (1 - spec.beta_2**c)) + spec.epsilon
                if pinned:  # p - lr m / bc1 / den = after
                    m[k] = pin(m[k], (p - after[name]) * den * (1 - spec.beta_1**c) / lr)
                new.append(p - lr * (m[k] / (1 - spec.beta_1**c)) / den)
            else:  # rmsprop
                v[k] = spec.rmsprop_alpha * v[k] + (1 - spec.rmsprop_alpha) * g * g
                if pinned:
                    v[k] = pin(v[k], state["square_avg"][name])
                new.append(p - lr * g / (_sqrt(v[k]) + spec.epsilon))
            if pinned:
                new[-1] = pin(new[-1], after[name])
        theta = new
    return dict(zip(names, theta))


def _sqrt(v):
    """``sqrt(v)`` with derivative 0 where ``v = 0``: an entry whose gradient is exactly 0
    at every step (an attention key bias, which softmax cancels) keeps ``v = 0`` whatever
    the weights, while autograd's ``inf * 0`` at the root made its scores NaN."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, 1.0).sqrt(), 0.0)


def unrolled_reference(net, Xq, Wq, sample_weight=None, step_sizes=None, pinned=False,
                       gradient_dtype=torch.float64):
    """d (Wq[q] . f(Xq[q]; theta_T(w))) / d w at w = 1, (Q, N): autograd through
    :func:`unrolled_replay` with the weights as leaf tensors, one backward per query
    (``pinned``, ``gradient_dtype``: the replay's; pinned, the queries are rounded to
    the path's dtype)."""
    w = torch.ones(len(net.X_fit), dtype=torch.float64, requires_grad=True)
    params = unrolled_replay(net, w, sample_weight, step_sizes, pinned, gradient_dtype)
    module = copy.deepcopy(net.module).to(torch.float64)
    Xq = _as_input(Xq)
    if pinned and Xq.is_floating_point():
        Xq = Xq.to(net.trajectory.dtype).double()
    out = torch.func.functional_call(module, params, (Xq,)).reshape(len(Xq), -1)
    m = (out * torch.as_tensor(np.asarray(Wq, dtype=np.float64))).sum(1)
    return np.stack([torch.autograd.grad(m[q], w, retain_graph=True)[0].numpy()
                     for q in range(len(Xq))])


def weight_derivative(replay_outputs, n, i, h=1e-5):
    """``d replay_outputs(w) / d w_i`` at ``w = 1`` (n training weights) by central
    differences: the finite-difference check of the unrolled attribution."""
    up, down = np.ones(n), np.ones(n)
    up[i] += h
    down[i] -= h
    return (replay_outputs(up) - replay_outputs(down)) / (2 * h)


def torch_optim_replay(net, weights, build=None, step_sizes=None):
    """The recorded training rerun by torch.optim itself (the training's own optimizer,
    not an analysis) with per-point weights in every step's loss (weighted mean over the
    batch); returns the module at the final parameters. ``build``: makes a fresh module of
    the same architecture, for one that cannot be copied (torch's weight-norm hook).
    ``step_sizes``: one per optimizer step (else the recorded ones, every step recorded)."""
    traj = net.trajectory
    module = (copy.deepcopy(net.module) if build is None else build()).double()
    module.load_state_dict(traj.state_dict(0), strict=False)
    X, Y = torch.as_tensor(np.asarray(net.X_fit, dtype=np.float64)), net.targets()
    w = torch.as_tensor(weights)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _make_optimizer(params, traj.solver_spec, float(traj.learning_rates[0]))
    for t, batch in enumerate(traj.batches):
        for group in opt.param_groups:
            group["lr"] = float(traj.learning_rates[t] if step_sizes is None
                                else step_sizes[t])
        opt.zero_grad()
        rows = torch.as_tensor(batch)
        per = net.loss.per_sample(module(X[rows]), Y[rows])
        total = w[rows].sum()
        # A batch of zero weights has no data gradient (the estimator's definition).
        ((w[rows] * per).sum() / total if total.item() > 0 else (0 * per).sum()).backward()
        opt.step()
    return module


def weight_finite_differences(net, Xq, points, sample_weight=None, h=1e-5, build=None,
                              step_sizes=None):
    """Central differences of the first output at ``Xq`` of :func:`torch_optim_replay`
    with respect to a multiplier of each of ``points``' weight, at 1: (Q, len(points)).
    ``sample_weight``: the fit's weights, which the multipliers scale (ones when None)."""
    base = np.ones(len(net.X_fit)) if sample_weight is None else np.asarray(sample_weight)

    def outputs(m):
        module = torch_optim_replay(net, base * m, build, step_sizes)
        with torch.no_grad():
            return module(torch.as_tensor(np.asarray(Xq))).numpy()[:, 0]

    return np.stack([weight_derivative(outputs, len(base), i, h) for i in points], axis=1)


def sklearn_step_sizes(params, n, steps_per_epoch, n_steps):
    """Each optimizer step's step size by sklearn's rule (written from sklearn's
    ``_fit_stochastic`` and ``SGDOptimizer``, not read from a recorded path).

    invscaling: an epoch starts at ``learning_rate_init / (t_ + 1) ** power_t`` with
    ``t_`` the samples seen before it (``iteration_ends(self.t_)`` after
    ``self.t_ += n_samples``), the first epoch at ``learning_rate_init``. adaptive: after
    an epoch with more than ``n_iter_no_change`` epochs in a row without improving the
    best loss by ``tol``, divided by 5."""
    lr0 = params["learning_rate_init"]
    epoch_lrs, lr, count, best = [], lr0, 0, math.inf
    for e in range(-(-n_steps // steps_per_epoch)):
        if params["learning_rate"] == "invscaling":
            lr = lr0 if e == 0 else lr0 / (e * n + 1) ** params.get("power_t", 0.5)
        epoch_lrs.append(lr)
        if params["learning_rate"] == "adaptive":
            # The losses are finite and far below tol: only the first epoch (best = inf)
            # improves.
            count = count + 1 if best < math.inf else 0
            best = 0.0
            if count > params["n_iter_no_change"]:
                lr, count = lr / 5.0, 0
    return np.repeat(epoch_lrs, steps_per_epoch)[:n_steps]


def zero_feature_network():
    """``(network, X)``: a recorded network without biases, whose tangent feature is zero
    at x = 0 (tanh(0) = 0), three SGD steps on ``X``, eight rows of which rows 2 and 5
    are 0."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2, 4, bias=False), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 1, bias=False)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = PathRecorder(module, opt, n_samples=8)
    X = np.random.RandomState(0).normal(size=(8, 2))
    X[[2, 5]] = 0.0
    y = np.sin(X[:, :1])
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for _ in range(3):
        opt.zero_grad()
        (module(Xt) - yt).square().mean().backward()
        rec.set_batch(np.arange(8))
        opt.step()
    return rec.as_network(X, y), X


def own_loop(kind="mlp", loss="squared_error", n_outputs=2, X_train=True, seed=0):
    """``(recorded, X)``: a float64 network trained in a plain PyTorch loop of minibatch
    Adam steps, recorded by PathRecorder and returned as ``as_estimator``'s
    RecordedNetwork (with ``X_train`` and its targets, or without either). ``kind``:
    "mlp" on 3 features, "cnn" (a convolution) on 1 x 6 x 6 images; 24 samples."""
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    if kind == "mlp":
        X = rng.normal(size=(24, 3))
        module = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, n_outputs))
    else:
        X = rng.normal(size=(24, 1, 6, 6))
        module = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Tanh(),
                                     torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, n_outputs))
    module = module.double()
    flat = X.reshape(len(X), -1)
    if loss == "log_loss":
        y = np.argmax(flat[:, :n_outputs], axis=1)
        per_sample = lambda out, t: torch.nn.functional.cross_entropy(  # noqa: E731
            out, t, reduction="none")
    else:
        y = np.tanh(flat[:, :n_outputs] + flat[:, -n_outputs:])
        per_sample = lambda out, t: 0.5 * (out - t).square().mean(dim=1)  # noqa: E731
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for epoch in range(3):
            for batch in np.array_split(np.random.RandomState(epoch).permutation(24), 3):
                rec.set_batch(batch)
                opt.zero_grad()
                per_sample(module(Xt[batch]), yt[batch]).mean().backward()
                opt.step()
    recorded = (rec.as_estimator(X, y, loss=loss) if X_train
                else rec.as_estimator(loss=loss))
    return recorded, X
