"""Audit: thinned paths whose step size changes between two recorded points (session 14).

A path recorded every ``record_every > 1`` steps replays the steps between two recorded
points in ``attribute(method="unrolled")``. When a schedule changes the step size inside
such an interval (sklearn's ``invscaling`` every epoch, ``adaptive`` dividing by 5, a torch
scheduler under ``PathRecorder``), the replay needs every step's own step size. This
script measures, on tiny float64 problems, against references that do not read the
recorded step sizes:

* the unrolled scores against autograd through a plain functional replay (SGD with
  heavy-ball or Nesterov momentum written from torch.optim's documentation) whose step
  sizes come from the schedule's own rule (sklearn's, or the LambdaLR factor), and
  against central finite differences (h = 1e-5) of torch.optim's own training with one
  point's weight moved;
* ``replay_error`` and whether the replay warning fired;
* the discrete path-kernel weights (``kernels.path_weights``) against torch.optim on an
  impulse gradient with the rule's step sizes;
* ``retrain_on_subsets(protocol="replay")``'s retraining with every point kept against
  the recorded end point (estimator cases);
* the Riemann sums of a thinned path (the path kernel against the every-step path's,
  ``decompose``'s reported error) with each interval's mean step size (what the package
  uses) and, patched in the same process, with every step's own (``--riemann``).

Run with the package to measure on the import path, e.g.
``PYTHONPATH=. taskset -c 1 python benchmarks/audit_thinned_schedule.py`` (results:
``benchmarks/results/thinned_schedule.md``, which holds this branch's run and main's).
"""
from __future__ import annotations

import copy
import math
import sys
import warnings

import numpy as np
import torch

import skpathkernel
from skpathkernel import PathKernelMachine, PathRecorder
from skpathkernel.kernels import path_weights

torch.set_num_threads(1)
N, BATCH, EVERY, EPOCHS = 24, 5, 3, 6  # 5 steps an epoch: epochs end inside intervals
MOMENTUM = 0.9


def sklearn_step_sizes(p, n_steps, steps_per_epoch=5, n=N):
    """sklearn's rule (``_fit_stochastic`` / ``SGDOptimizer``): invscaling starts epoch
    e at ``lr0 / (e n + 1) ** power_t`` (lr0 for e = 0); adaptive divides by 5 after an
    epoch with more than ``n_iter_no_change`` epochs without improving by ``tol`` (here
    a tol no epoch meets, so every epoch after the first counts)."""
    lr, count, out = p["learning_rate_init"], 0, []
    for e in range(-(-n_steps // steps_per_epoch)):
        if p["learning_rate"] == "invscaling":
            lr = p["learning_rate_init"] / (e * n + 1) ** p["power_t"] if e else lr
        out.append(lr)
        if p["learning_rate"] == "adaptive":
            count = count + 1 if e else 0
            if count > p["n_iter_no_change"]:
                lr, count = lr / 5.0, 0
    return np.repeat(out, steps_per_epoch)[:n_steps]


CASES = {
    "invscaling-sgd": dict(momentum=0.0, learning_rate="invscaling",
                           learning_rate_init=0.2, power_t=0.5),
    "invscaling-heavy-ball": dict(momentum=MOMENTUM, nesterovs_momentum=False,
                                  learning_rate="invscaling", learning_rate_init=0.05,
                                  power_t=0.5),
    "invscaling-nesterov": dict(momentum=MOMENTUM, learning_rate="invscaling",
                                learning_rate_init=0.05, power_t=0.5),
    "adaptive-nesterov": dict(momentum=MOMENTUM, learning_rate="adaptive",
                              learning_rate_init=0.05, tol=1e10, n_iter_no_change=1),
}


def data():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(N, 3))
    return X, np.sin(X[:, 0]) + X[:, 1] - 0.5 * X[:, 2] ** 2


def functional_final(module, theta0, batches, lrs, w, X, Y, momentum, nesterov):
    """Plain SGD (torch.optim.SGD's documented update) as one graph in the weights w."""
    names = [n for n, _ in module.named_parameters()]
    theta = [t.clone().requires_grad_(True) for t in theta0]
    buf = None
    for t, b in enumerate(batches):
        rows = torch.as_tensor(b)
        out = torch.func.functional_call(module, dict(zip(names, theta)), (X[rows],))
        per = 0.5 * (out.reshape(len(b), -1) - Y[rows]).pow(2).mean(1)
        loss = (w[rows] * per).sum() / w[rows].sum()
        g = torch.autograd.grad(loss, theta, create_graph=True)
        if momentum:
            buf = list(g) if buf is None else [momentum * m + gi for m, gi in zip(buf, g)]
            d = [gi + momentum * m for gi, m in zip(g, buf)] if nesterov else buf
        else:
            d = g
        theta = [p - lrs[t] * di for p, di in zip(theta, d)]
    return dict(zip(names, theta))


def torch_optim_final(module, theta0, batches, lrs, w, X, Y, momentum, nesterov):
    module = copy.deepcopy(module)
    with torch.no_grad():
        for p, t in zip(module.parameters(), theta0):
            p.copy_(t)
    opt = torch.optim.SGD(module.parameters(), lr=1.0, momentum=momentum,
                          nesterov=nesterov and momentum > 0)
    for t, b in enumerate(batches):
        opt.param_groups[0]["lr"] = float(lrs[t])
        opt.zero_grad()
        rows = torch.as_tensor(b)
        per = 0.5 * (module(X[rows]).reshape(len(b), -1) - Y[rows]).pow(2).mean(1)
        ((w[rows] * per).sum() / w[rows].sum()).backward()
        opt.step()
    return module


def references(module, theta0, batches, lrs, X, Y, Xq, momentum, nesterov, points):
    w = torch.ones(len(X), dtype=torch.float64, requires_grad=True)
    final = functional_final(module, theta0, batches, lrs, w, X, Y, momentum, nesterov)
    out = torch.func.functional_call(module, final, (Xq,))[:, 0]
    auto = np.stack([torch.autograd.grad(out[q], w, retain_graph=True)[0].numpy()
                     for q in range(len(Xq))])
    h, fd = 1e-5, []
    for i in points:
        outs = []
        for s in (1, -1):
            wi = torch.ones(len(X), dtype=torch.float64)
            wi[i] += s * h
            trained = torch_optim_final(module, theta0, batches, lrs, wi, X, Y, momentum,
                                        nesterov)
            with torch.no_grad():
                outs.append(trained(Xq)[:, 0].numpy())
        fd.append((outs[0] - outs[1]) / (2 * h))
    end = torch.cat([p.detach().reshape(-1) for p in final.values()])
    return auto, np.stack(fd, axis=1), end


def impulse_weights(traj, lrs, momentum, nesterov):
    """W_s by torch.optim on a unit gradient at step s (zero elsewhere), per interval."""
    W = []
    for s in range(traj.n_steps):
        p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([p], lr=1.0, momentum=momentum,
                              nesterov=nesterov and momentum > 0)
        for t in range(traj.n_steps):
            opt.param_groups[0]["lr"] = float(lrs[t])
            p.grad = torch.tensor([1.0 if t == s else 0.0], dtype=torch.float64)
            opt.step()
        W.append(-float(p.detach()))
    W = np.array(W)
    return np.array([W[traj.steps[k]:traj.steps[k + 1]].sum() for k in range(len(traj) - 1)])


def rel(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def measure(net, traj, lrs, X, Y, Xq, momentum, nesterov, module):
    theta0 = [v.double() for v in traj.state_dict(0).values()]
    batches = traj.batches
    points = [int(traj.batch(traj.n_steps - 1)[0]), int(traj.batch(7)[0])]
    auto, fd, end = references(module, theta0, batches, lrs, torch.as_tensor(X),
                               torch.as_tensor(Y).reshape(len(X), -1), torch.as_tensor(Xq),
                               momentum, nesterov, points)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = net.attribute(Xq, method="unrolled")
    warned = any("miss the recorded path" in str(w.message) for w in caught)
    weights = np.array([w for _, w in path_weights(traj)])
    return {
        "ref end vs record": float((end - traj.parameters(-1)).abs().max()
                                   / traj.parameters(-1).abs().max()),
        "scores vs autograd": rel(scores, auto),
        "scores vs FD": rel(np.asarray(scores)[:, points], fd),
        "autograd vs FD": rel(auto[:, points], fd),
        "replay_error": float(scores.replay_error),
        "warned": warned,
        "path_weights vs impulses": rel(weights, impulse_weights(traj, lrs, momentum,
                                                                 nesterov)),
    }


def estimator_case(name):
    p = CASES[name]
    X, y = data()
    est = PathKernelMachine(hidden_layer_sizes=(8, 8), solver="sgd", max_iter=EPOCHS,
                            batch_size=BATCH, record_every=EVERY, dtype="float64",
                            random_state=0, normalize_y=False,
                            **{"tol": None, **p})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adaptive's tol: no convergence
        est.fit(X, y)
    traj = est.trajectory_
    lrs = sklearn_step_sizes(p, traj.n_steps)
    nesterov = p.get("nesterovs_momentum", True)
    row = measure(est, traj, lrs, X, y, X[:3], p["momentum"], nesterov, est.module_)
    from skpathkernel.metrics import _replay  # the replay protocol's retraining
    kept = _replay(est, np.ones(len(X), bool)).module_
    flat = torch.cat([q.detach().reshape(-1) for q in kept.parameters()])
    row["replay protocol vs record"] = float((flat - traj.parameters(-1)).abs().max()
                                             / traj.parameters(-1).abs().max())
    return row


def recorder_case():
    """A torch loop with LambdaLR (0.9 ** t every step), SGD Nesterov, record_every=3."""
    X, y = data()
    Xt, Yt = torch.as_tensor(X), torch.as_tensor(y).reshape(-1, 1)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 1)).double()
    theta0 = [p.detach().clone() for p in module.parameters()]
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=MOMENTUM, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t)
    gen = torch.Generator().manual_seed(0)
    rec = PathRecorder(module, opt, n_samples=N, record_every=EVERY)
    for _ in range(20):
        idx = torch.randperm(N, generator=gen)[:BATCH]
        rec.set_batch(idx.numpy())
        opt.zero_grad()
        (0.5 * (module(Xt[idx]) - Yt[idx]).pow(2).mean()).backward()
        opt.step()
        sched.step()
    rec.close()
    net = rec.as_network(X, y.reshape(-1, 1))
    traj = net.trajectory
    lrs = 0.1 * 0.9 ** np.arange(traj.n_steps)
    fresh = copy.deepcopy(module)
    with torch.no_grad():
        for p, t in zip(fresh.parameters(), theta0):
            p.copy_(t)
    return measure(net, traj, lrs, X, y, X[:3], MOMENTUM, True, fresh)


def riemann_ab(n_seeds=6):
    """The thinned path kernel (against the every-step path's) and decompose's error, with
    step_coefficients taking each interval's mean (the package) or every step's own (a
    patch), alternated in one process over seeds, momenta and record_every 3 / 4."""
    from skpathkernel import Trajectory
    from skpathkernel.kernels import PathKernel

    mean_rule = Trajectory.step_coefficients

    def per_step(self, direct=False):
        # SGD's (coef, memory, direct) with every step's own size (the cases are SGD).
        coef, memory = self.step_learning_rates.copy(), float(self.solver_spec.momentum)
        lead = np.zeros_like(coef)
        if self.solver_spec.nesterov and memory:
            coef, lead = coef * memory, coef
        return (coef, memory, lead) if direct else (coef, memory)

    X, y = data()
    rows = {"kernel vs every-step": [], "decompose error": []}
    for seed in range(n_seeds):
        for kw in (dict(momentum=MOMENTUM, nesterovs_momentum=False), dict(momentum=MOMENTUM),
                   dict(momentum=0.0)):
            for every in (3, 4):
                def fit(e, kw=kw, seed=seed):
                    return PathKernelMachine(
                        hidden_layer_sizes=(8, 8), solver="sgd", learning_rate="invscaling",
                        power_t=0.5, learning_rate_init=0.2 if not kw["momentum"] else 0.05,
                        max_iter=EPOCHS, batch_size=BATCH, record_every=e, tol=None,
                        dtype="float64", random_state=seed, normalize_y=False,
                        **kw).fit(X, y)
                full, thin = fit(1), fit(every)
                K1 = PathKernel(full)(X[:6], X[:3])
                got = []
                for rule in (mean_rule, per_step):
                    Trajectory.step_coefficients = rule
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")  # thinned: not exact, says so
                            K = PathKernel(thin)(X[:6], X[:3])
                            err = thin.decompose(X[:3]).error
                    finally:
                        Trajectory.step_coefficients = mean_rule
                    got.append((rel(K, K1), float(err)))
                rows["kernel vs every-step"].append([g[0] for g in got])
                rows["decompose error"].append([g[1] for g in got])
    print("| quantity (36 paths) | median, interval means | median, every step's own | "
          "every step's own closer on | equal on |")
    print("|---|---|---|---|---|")
    for name, v in rows.items():
        v = np.array(v)
        same = np.isclose(v[:, 0], v[:, 1], rtol=1e-9)
        better = (v[:, 1] < v[:, 0]) & ~same
        print(f"| {name} | {np.median(v[:, 0]):.3g} | {np.median(v[:, 1]):.3g} | "
              f"{int(better.sum())} | {int(same.sum())} |")
    print()


def main(label):
    print(f"## {label} ({skpathkernel.__file__})\n")
    cols = None
    for name in [*CASES, "recorder-lambdalr-nesterov"]:
        row = recorder_case() if name.startswith("recorder") else estimator_case(name)
        if cols is None:
            cols = list(row) + (["replay protocol vs record"]
                                if "replay protocol vs record" not in row else [])
            print("| case | " + " | ".join(cols) + " |")
            print("|---" * (len(cols) + 1) + "|")
        cells = []
        for c in cols:
            v = row.get(c, "")
            cells.append(("yes" if v else "no") if isinstance(v, bool) else
                         (f"{v:.1e}" if isinstance(v, float) and math.isfinite(v) else str(v)))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print()


if __name__ == "__main__":
    if "--riemann" in sys.argv:
        riemann_ab()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "run")
