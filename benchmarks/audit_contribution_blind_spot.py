"""Where ``Decomposition.contribution_error`` under-reads: a direction the sum cannot see.

The node choice and the per-contribution bound read each step's quadrature error from the
residual of the SUM of the points' shares, ``delta_J_t . dtheta_t`` along the step the
path took. Point i's share errs by ``delta_J_t . dtheta_t^(i)``. Where the points' moves
cancel in a parameter direction along which the query's gradient bends while f itself
changes linearly along the path, the sum's residual is round-off, the shares cancel
little, the bound (residuals times cancellation) is round-off too, and no walk is added:
each share keeps its quadrature error, unwarned.

The cases are custom modules built for that (``u`` moves, ``v``'s per-point moves cancel
pairwise and ``v`` stays 0): ``gate1``, one output ``u x0 + v sin(3u) x1`` with the pairs'
``x1`` flipped; ``gate2``, two outputs ``(u x0, v sin(3u) x1)`` with the pairs' second
target flipped; and, as a control, a tanh MLP (16 hidden) fitted on the ``gate2`` data.
Full-batch plain SGD, float64, 10 steps. Beside them, RMSprop's first step on a softplus
MLP (8 hidden, minibatches of 4 of 16 points, lr 0.05 and 0.06, seed 1), where the
normalised step's per-point parts are not the sum's: the estimate under-read there too.

The reference is independent of the package: per step, each point's update
``-lr grad L_i(theta_t) / n`` (torch autograd on the recorded parameters; the recorded
update is checked to be their sum), and the query's Jacobian averaged over the recorded
segment by 64-node Gauss-Legendre (``torch.func.jacrev``). For RMSprop each point's part
of the update comes from ``audit_exact.Replay`` (a plain torch.optim replay, per-sample
gradients through the optimizer's preconditioner), the quadrature the same.

Run: taskset -c 1 python benchmarks/audit_contribution_blind_spot.py
(results: benchmarks/results/contribution_error_blind_spot.md)
"""
from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from torch import nn
from torch.func import functional_call, jacrev

sys.path.insert(0, os.path.dirname(__file__))
import audit_exact

from skpathkernel import PathKernelMachine
from skpathkernel._analysis import _decomposition

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_error_blind_spot.md")
REF_NODES = 64
# The last: the default tol with no walk that raises the nodes (CHECK_RAISES = 0): the
# error the rule with a node more measures on the node choice's own walk.
CALLS = ({}, {"tol": 1e-6}, {"n_nodes": 2}, {"no_raise": True})


class Gate(nn.Module):
    """``u x0 + v sin(K u) x1`` (one output) or ``(u x0, v sin(K u) x1)`` (two)."""

    def __init__(self, n_outputs, K=3.0):
        super().__init__()
        self.u = nn.Parameter(torch.tensor([0.1]))
        self.v = nn.Parameter(torch.tensor([0.0]))
        self.K, self.two = K, n_outputs == 2

    def forward(self, x):
        a = self.u * x[:, :1]
        b = self.v * torch.sin(self.K * self.u) * x[:, 1:2]
        return torch.cat([a, b], 1) if self.two else a + b


def _shares_sgd(est, X, Y, f, flat):
    """Per step, each point's part of a plain SGD update (rows: the batch's points)."""
    traj = est.trajectory_
    for t in range(len(traj.batches)):
        th, th1 = flat(t), flat(t + 1)
        idx = np.asarray(traj.batches[t])
        p = th.clone().requires_grad_(True)
        G = torch.stack([torch.autograd.grad(
            0.5 * (f(p, X[i:i + 1]) - Y[i:i + 1]).pow(2).mean() / len(idx), p)[0]
            for i in idx])
        dth = -float(traj.learning_rates[t]) * G
        move = (th1 - th).abs().max()
        assert (dth.sum(0) - (th1 - th)).abs().max() <= 1e-10 * move
        yield t, idx, dth


def _shares_replay(est, Y):
    """Per step, each point's part of the update of a plain torch.optim replay."""
    replay = audit_exact.Replay(est, Y, np.ones(len(Y)), track_shares=True)
    for t, share in enumerate(replay.shares):
        yield t, np.arange(len(Y)), share


def reference(est, Xq, Y):
    """Per-point shares of every step (see the module) and the queries' largest |f|."""
    traj = est.trajectory_
    module = copy.deepcopy(est.module_).double()
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for _, p in module.named_parameters()]

    def flat(k):
        sd = traj.state_dict(k)
        return torch.cat([sd[n].double().reshape(-1) for n in names])

    def f(theta, x):
        params, o = {}, 0
        for n, s in zip(names, shapes):
            params[n] = theta[o:o + s.numel()].reshape(s)
            o += s.numel()
        return functional_call(module, params, (x,)).reshape(len(x), -1)

    X = torch.as_tensor(np.asarray(est.X_fit_), dtype=torch.float64)
    Y = torch.as_tensor(Y, dtype=torch.float64).reshape(len(X), -1)
    Xq = torch.as_tensor(Xq, dtype=torch.float64)
    s, w = np.polynomial.legendre.leggauss(REF_NODES)
    s, w = (s + 1) / 2, w / 2
    out = None
    parts = (_shares_sgd(est, X, Y, f, flat) if est.solver == "sgd"
             else _shares_replay(est, Y))
    for t, idx, dth in parts:
        th, th1 = flat(t), flat(t + 1)
        J = sum(wk * jacrev(lambda q: f(q, Xq))(th + sk * (th1 - th)) for sk, wk in zip(s, w))
        share = torch.einsum("qcp,bp->qbc", J, dth)
        if out is None:
            out = torch.zeros(len(Xq), len(X), share.shape[2], dtype=torch.float64)
        out[:, idx] += share
    return out.numpy(), float(max(f(flat(k), Xq).abs().max() for k in range(len(traj))))


def cases():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(6, 2)) + 1
    Xq = rng.normal(size=(2, 2)) + 1
    X1 = np.vstack([x, x * [1, -1]])
    X2 = np.vstack([x, x])
    Y2 = np.column_stack([5 * X2[:, 0], np.r_[2 * np.ones(6), -2 * np.ones(6)]])
    yield "gate1", dict(module=lambda i, o: Gate(1)), X1, 5 * X1[:, 0], Xq
    yield "gate2", dict(module=lambda i, o: Gate(2)), X2, Y2, Xq
    yield "tanh MLP, gate2's data", dict(hidden_layer_sizes=(16,)), X2, Y2, Xq
    rng = np.random.RandomState(1)
    X = rng.normal(size=(16, 3))
    Xq = rng.normal(size=(3, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    for lr in (0.05, 0.06):
        yield f"RMSprop first step, softplus MLP, lr {lr}", dict(
            solver="rmsprop", batch_size=4, learning_rate_init=lr, max_iter=1,
            hidden_layer_sizes=(8,), activation="softplus", random_state=1), X, y, Xq


def main():
    rows = []
    for name, params, X, Y, Xq in cases():
        kw = dict(solver="sgd", momentum=0.0, alpha=0.0, batch_size=len(X),
                  learning_rate_init=0.05, max_iter=10, tol=None, normalize_y=False,
                  n_iter_no_change=10**6, dtype="float64", random_state=0,
                  activation="tanh")
        est = PathKernelMachine(**{**kw, **params})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, Y)
        ref, S = reference(est, Xq, Y)
        for kw in CALLS:
            raises = _decomposition.CHECK_RAISES
            if kw.get("no_raise"):
                _decomposition.CHECK_RAISES = 0
            try:
                with warnings.catch_warnings(record=True) as rec:
                    warnings.simplefilter("always")
                    res = est.decompose(Xq, **{k: v for k, v in kw.items()
                                               if k != "no_raise"})
            finally:
                _decomposition.CHECK_RAISES = raises
            true = float(np.abs(res.contributions.reshape(ref.shape) - ref).max())
            allowed = (kw.get("tol") or res.tol if "n_nodes" not in kw else 1e-10) * S
            warned = any("single contribution" in str(w.message) for w in rec
                         if issubclass(w.category, ConvergenceWarning))
            rows.append((name, kw, res.contribution_error, true, allowed, res.error,
                         f"{res.n_nodes.min()}-{res.n_nodes.max()}", warned))
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    with open(OUT, "w") as fh:
        fh.write("# contribution_error where the points' moves cancel in a direction f's "
                 "change does not see\n\n")
        fh.write(f"`python benchmarks/audit_contribution_blind_spot.py` at commit {commit} "
                 f"(torch {torch.__version__}, {platform.machine()}, one thread). Reference: "
                 f"a per-sample loop with {REF_NODES}-node Gauss-Legendre per step "
                 "(see the script). S: the queries' largest |f| along the path; allowed: "
                 "tol * S, with fixed n_nodes 1e-10 * S.\n\n")
        fh.write("| case | call | contribution_error | true error | allowed | "
                 "contribution_error / allowed | true / allowed | error (sum) | nodes | "
                 "contribution warned |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for name, kw, ce, true, allowed, err, nodes, warned in rows:
            call = ("default tol, no raise" if kw.get("no_raise") else
                    ", ".join(f"{k}={v}" for k, v in kw.items()) or "default tol")
            fh.write(f"| {name} | {call} | {ce:.3g} | {true:.3g} | {allowed:.3g} | "
                     f"{ce / allowed:.3g} | {true / allowed:.3g} | {err:.3g} | {nodes} | "
                     f"{'yes' if warned else 'no'} |\n")


if __name__ == "__main__":
    main()
