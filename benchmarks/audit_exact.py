"""Adversarial audit of skpathkernel's "exact" promises (session 13, helper "exact").

For a sweep of training configurations on tiny problems, compares
  * decompose(method="exact") against an independent reference: a plain torch.optim
    replay of training (written from the user guide, not from the package), per-sample
    shares of every update tracked through the optimizer's linear memory, and each step's
    Jacobian averaged over the segment by 12-node Gauss-Legendre with torch.func.jacrev;
  * attribute(method="unrolled") against central finite differences of the same replay
    with one training point's weight multiplied by 1 +- h;
  * path_kernel_ against sum_s w_s J_s(x) D_s J_s(y)^T / C from jacrev, D from the replay's
    torch.optim state, w the documented discrete memory weights;
and records for each: max relative error vs the reference, the error the code reports,
whether it warned.

Run: taskset -c 0 python benchmarks/audit_exact.py [case-substring ...]
(results: benchmarks/results/exact_audit.md)
"""
from __future__ import annotations

import copy
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, jacrev

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.kernels import PathKernel, TangentKernel

torch.set_num_threads(1)
GL_NODES = 12


# --------------------------------------------------------------------------- replay
class Replay:
    """Plain torch.optim replay of a fitted estimator's recorded training.

    Uses only public, documented things: the module's architecture (module_), the initial
    parameters (trajectory_.state_dict(0)), the batches and step sizes the run recorded,
    the training set X_fit_ and the estimator's hyper-parameters.  Losses, targets,
    weighting, weight decay and the optimizer come from the user guide.
    """

    def __init__(self, est, Y, sw, mult=None, track_shares=False, dtype=torch.float64):
        self.est = est
        traj = est.trajectory_
        self.module = copy.deepcopy(est.module_).to(dtype)
        self.names = [n for n, _ in self.module.named_parameters()]
        self.shapes = [p.shape for _, p in self.module.named_parameters()]
        self.sizes = [p.numel() for _, p in self.module.named_parameters()]
        sd0 = traj.state_dict(0)
        theta0 = torch.cat([sd0[n].to(dtype).reshape(-1) for n in self.names])
        self.X = torch.as_tensor(np.asarray(est.X_fit_), dtype=dtype)
        self.Y = Y
        self.sw = torch.as_tensor(sw, dtype=dtype)
        self.mult = torch.ones(len(self.X), dtype=dtype) if mult is None else mult
        self.dtype = dtype
        self.run(theta0, traj, track_shares)

    def f(self, theta, x):
        params, o = {}, 0
        for n, s, k in zip(self.names, self.shapes, self.sizes):
            params[n] = theta[o:o + k].reshape(s)
            o += k
        out = functional_call(self.module, params, (x,))
        return out.reshape(len(x), -1)

    def per_sample_loss(self, theta, idx):
        out = self.f(theta, self.X[idx])
        y = self.Y[idx]
        est = self.est
        if isinstance(est, PathKernelMachine) or est.loss == "squared_error":
            return 0.5 * (out - y).pow(2).mean(dim=1)
        if out.shape[1] == 1:  # binary: logistic loss on one margin, y in {0, 1}
            return F.binary_cross_entropy_with_logits(out[:, 0], y, reduction="none")
        if y.dim() == 2:  # multilabel: logistic loss summed over the labels
            return F.binary_cross_entropy_with_logits(out, y, reduction="none").sum(1)
        return F.cross_entropy(out, y, reduction="none")

    def make_opt(self, p):
        e = self.est
        wd = e.alpha
        if e.solver == "sgd":
            return torch.optim.SGD([p], lr=1.0, momentum=e.momentum,
                                   nesterov=bool(e.nesterovs_momentum and e.momentum > 0),
                                   weight_decay=wd)
        if e.solver == "adam":
            return torch.optim.Adam([p], lr=1.0, betas=(e.beta_1, e.beta_2), eps=e.epsilon,
                                    weight_decay=wd)
        if e.solver == "adamw":
            return torch.optim.AdamW([p], lr=1.0, betas=(e.beta_1, e.beta_2), eps=e.epsilon,
                                     weight_decay=wd)
        return torch.optim.RMSprop([p], lr=1.0, alpha=0.99, eps=e.epsilon, weight_decay=wd)

    def precond(self, state):
        e = self.est
        if e.solver == "sgd":
            return None
        v = state["exp_avg_sq"] if e.solver != "rmsprop" else state["square_avg"]
        if e.solver == "rmsprop":
            return 1.0 / (v.sqrt() + e.epsilon)
        t = float(state["step"])
        return 1.0 / ((v / (1 - e.beta_2 ** t)).sqrt() + e.epsilon)

    def run(self, theta0, traj, track):
        p = theta0.clone().requires_grad_(True)
        opt = self.make_opt(p)
        batches, lrs = traj.batches, np.asarray(traj.learning_rates, dtype=np.float64)
        assert traj.record_every == 1 or not track
        n_steps = len(batches)
        self.thetas, self.D, self.lrs, self.counts = [], [], [], []
        self.shares, self.reg_share = [], []
        N, P = len(self.X), p.numel()
        if track:
            buf = torch.zeros(N, P, dtype=self.dtype)
            rbuf = torch.zeros(P, dtype=self.dtype)
        for t in range(n_steps):
            idx = torch.as_tensor(np.asarray(batches[t]), dtype=torch.long)
            s = self.sw[idx] * self.mult[idx]
            theta_t = p.detach().clone()
            lr = float(lrs[t]) if traj.record_every == 1 else self.schedule(t, batches)
            if s.sum() > 0:
                loss = (self.per_sample_loss(p, idx) * s).sum() / s.sum()
                (g,) = torch.autograd.grad(loss, p)
            else:
                g = torch.zeros_like(p)
            if track:
                G = torch.zeros(N, P, dtype=self.dtype)
                if s.sum() > 0:
                    for j, i in enumerate(idx.tolist()):
                        if s[j] == 0:
                            continue
                        li = self.per_sample_loss(p, idx[j:j + 1])[0] * s[j] / s.sum()
                        (gi,) = torch.autograd.grad(li, p)
                        G[i] += gi
            p.grad = g.clone()
            opt.param_groups[0]["lr"] = lr
            opt.step()
            state = opt.state[p]
            D = self.precond(state)
            theta_next = p.detach().clone()
            self.thetas.append(theta_t)
            self.D.append(D)
            self.lrs.append(lr)
            self.counts.append(float(state["step"]) if "step" in state else t + 1)
            if track:
                share, reg = self.split(G, theta_t, D, lr, buf, rbuf, state, t)
                total = share.sum(0) + reg
                err = (total - (theta_next - theta_t)).abs().max().item()
                scale = (theta_next - theta_t).abs().max().item()
                assert err <= 1e-8 * max(scale, 1e-300), ("share split", err, scale)
                self.shares.append(share)
                self.reg_share.append(reg)
        self.thetas.append(p.detach().clone())
        self.final = p.detach().clone()

    def schedule(self, t, batches):
        """Step t's size from the documented schedules (thinned paths record means)."""
        e = self.est
        if e.learning_rate == "constant" or e.solver != "sgd":
            return float(e.learning_rate_init)
        if e.learning_rate == "invscaling":
            n = len(self.X)
            seen = sum(len(b) for b in batches[:t])
            return float(e.learning_rate_init / ((seen // n) * n + 1) ** e.power_t)
        raise RuntimeError("no replay of 'adaptive' on a thinned path")

    def split(self, G, theta, D, lr, buf, rbuf, state, t):
        """Each sample's share of the update, and what no sample owns (weight decay)."""
        e = self.est
        wd = e.alpha
        R = wd * theta if (wd > 0 and e.solver != "adamw") else torch.zeros_like(theta)
        if e.solver == "sgd":
            mu = e.momentum
            if mu > 0:
                buf.mul_(mu).add_(G)
                rbuf.mul_(mu).add_(R)
                if e.nesterovs_momentum:
                    return -lr * (G + mu * buf), -lr * (R + mu * rbuf)
                return -lr * buf.clone(), -lr * rbuf.clone()
            return -lr * G, -lr * R
        if e.solver == "rmsprop":
            return -lr * G * D, -lr * R * D
        b1 = e.beta_1
        buf.mul_(b1).add_((1 - b1) * G)
        rbuf.mul_(b1).add_((1 - b1) * R)
        step = float(state["step"])
        c = lr / (1 - b1 ** step)
        share, reg = -c * buf * D, -c * rbuf * D
        if e.solver == "adamw":
            reg = reg - lr * wd * theta
        return share, reg

    # ---------------------------------------------------------------- references
    def jac(self, theta, x):
        return jacrev(lambda th: self.f(th, x))(theta)  # (n, C, P)

    def contributions(self, Xq):
        nodes, wts = np.polynomial.legendre.leggauss(GL_NODES)
        nodes, wts = (nodes + 1) / 2, wts / 2
        A = 0
        Areg = 0
        for t in range(len(self.shares)):
            a, b = self.thetas[t], self.thetas[t + 1]
            Jbar = sum(w * self.jac(a + s * (b - a), Xq) for s, w in zip(nodes, wts))
            A = A + torch.einsum("ncp,ip->nic", Jbar, self.shares[t])
            Areg = Areg + torch.einsum("ncp,p->nc", Jbar, self.reg_share[t])
        return A, Areg

    def memory_weights(self, start, stop):
        e = self.est
        T = len(self.lrs)
        stop = T if stop is None else stop
        w = np.zeros(T)
        if e.solver == "sgd" and e.momentum > 0:
            mu = e.momentum
            nest = e.nesterovs_momentum
            c = [mu * self.lrs[t] if nest else self.lrs[t] for t in range(T)]
            for s in range(start, stop):
                w[s] = sum(c[t] * mu ** (t - s) for t in range(s, stop)) + (
                    self.lrs[s] if nest else 0)
        elif e.solver in ("adam", "adamw"):
            b1 = e.beta_1
            c = [self.lrs[t] * (1 - b1) / (1 - b1 ** self.counts[t]) for t in range(T)]
            for s in range(start, stop):
                w[s] = sum(c[t] * b1 ** (t - s) for t in range(s, stop))
        else:
            w[start:stop] = self.lrs[start:stop]
        return w

    def path_kernel(self, Xa, Xb, start=0, stop=None):
        w = self.memory_weights(start, stop)
        stop = len(self.lrs) if stop is None else stop
        K = 0
        for s in range(start, stop):
            Ja, Jb = self.jac(self.thetas[s], Xa), self.jac(self.thetas[s], Xb)
            if self.D[s] is not None:
                Jb = Jb * self.D[s]
            C = Ja.shape[1]
            K = K + w[s] * torch.einsum("acp,bcp->ab", Ja, Jb) / C
        return K

    def tangent_kernel(self, Xa, Xb, k):
        Ja, Jb = self.jac(self.thetas[k], Xa), self.jac(self.thetas[k], Xb)
        return torch.einsum("acp,bcp->ab", Ja, Jb) / Ja.shape[1]


# --------------------------------------------------------------------------- helpers
def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    msgs = [f"{type(x.message).__name__ if hasattr(x.message, '__class__') else ''}: "
            f"{str(x.message)[:90]}" for x in w
            if not issubclass(x.category, (DeprecationWarning, FutureWarning))]
    return out, msgs


def fit_rows(est, X_all):
    """Index of each X_fit_ row in X_all (exact match)."""
    look = {tuple(r): i for i, r in enumerate(np.asarray(X_all))}
    return np.array([look[tuple(r)] for r in np.asarray(est.X_fit_)])


def network_targets(est, y_rows, sw_rows, with_mean=False):
    """(targets as the network learns them, their scale[, their mean])."""
    if isinstance(est, PathKernelMachine):
        Y = np.asarray(y_rows, dtype=np.float64).reshape(len(y_rows), -1)
        mean, std = np.zeros(Y.shape[1]), np.ones(Y.shape[1])
        if est.normalize_y:
            w = sw_rows if sw_rows is not None else np.ones(len(Y))
            mean = np.average(Y, axis=0, weights=w)
            std = np.sqrt(np.average((Y - mean) ** 2, axis=0, weights=w))
            std[std == 0] = 1
            Y = (Y - mean) / std
        return (torch.as_tensor(Y), std) + ((mean,) if with_mean else ())
    y = np.asarray(y_rows)
    if y.ndim == 2:  # multilabel
        if est.loss == "squared_error":
            return torch.as_tensor(2.0 * y - 1), None
        return torch.as_tensor(y, dtype=torch.float64), None
    codes = np.searchsorted(est.classes_, y)
    if len(est.classes_) == 2:
        if est.loss == "squared_error":
            return torch.as_tensor(2.0 * codes - 1).reshape(-1, 1), None
        return torch.as_tensor(codes, dtype=torch.float64), None
    if est.loss == "squared_error":
        return torch.as_tensor(np.eye(len(est.classes_))[codes]), None
    return torch.as_tensor(codes, dtype=torch.long), None


def data(kind, n=20, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 3))
    if kind == "reg":
        y = np.sin(X[:, 0]) + 0.5 * X[:, 1] + 0.1 * rng.normal(size=n)
    elif kind == "reg2":
        y = np.c_[np.sin(X[:, 0]), X[:, 1] * X[:, 2]]
    elif kind == "bin":
        y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int)
    elif kind == "multi":
        y = np.argmax(X @ rng.normal(size=(3, 3)), axis=1)
    elif kind == "multilabel":
        y = (X @ rng.normal(size=(3, 3)) > 0).astype(int)
    Xq = rng.normal(size=(3, 3))
    return X, y, Xq


BASE = dict(hidden_layer_sizes=(5,), activation="tanh", max_iter=6, tol=None,
            random_state=0, dtype="float64", device="cpu")


# --------------------------------------------------------------------------- one case
def run_case(name, kind, params, fit="fit", sw=None, chunks=None, warm=None, fd=True,
             pk_range=None, rows=None):
    X, y, Xq = data(kind)
    Est = PathKernelMachine if kind.startswith("reg") else PathKernelClassifier
    kw = dict(BASE)
    kw.update(params)
    if Est is PathKernelMachine and "normalize_y" not in kw:
        kw["normalize_y"] = False
    est = Est(**kw)
    fit_warn = []
    if fit == "fit":
        _, fit_warn = caught(lambda: est.fit(X, y, sample_weight=sw))
        if warm is not None:
            est.set_params(warm_start=True, **warm)
            _, w2 = caught(lambda: est.fit(X, y, sample_weight=sw))
            fit_warn += w2
        X_all, y_all, sw_all = X, y, sw
    else:  # partial_fit over chunks of rows
        Xs, ys, sws = [], [], []
        for k, sl in enumerate(chunks):
            extra = {}
            if Est is PathKernelClassifier and k == 0:
                extra["classes"] = np.unique(y) if y.ndim == 1 else np.arange(y.shape[1])
            csw = None if sw is None else sw[sl]
            _, w2 = caught(lambda sl=sl, csw=csw, extra=extra: est.partial_fit(
                X[sl], y[sl], sample_weight=csw, **extra))
            fit_warn += w2
            Xs.append(X[sl]), ys.append(y[sl]), sws.append(
                np.ones(len(X[sl])) if sw is None else sw[sl])
        X_all, y_all, sw_all = np.concatenate(Xs), np.concatenate(ys), np.concatenate(sws)
    idx = fit_rows(est, X_all)
    sw_rows = np.ones(len(idx)) if sw_all is None else np.asarray(sw_all)[idx]
    Y, scale = network_targets(est, np.asarray(y_all)[idx], sw_rows)
    traj = est.trajectory_
    row = dict(case=name, steps=traj.n_steps, every=traj.record_every)
    exact_path = traj.record_every == 1 and est.dtype == "float64"
    rep = None
    if traj.record_every == 1:
        rep = Replay(est, Y, sw_rows, track_shares=exact_path)
        # The replay must reproduce the recorded path: otherwise my reference is wrong.
        end = torch.cat([traj.state_dict(-1)[n].to(torch.float64).reshape(-1)
                         for n in rep.names])
        row["replay_vs_path"] = rel(rep.final, end)

    # ---- decompose
    res, msgs = caught(lambda: est.decompose(Xq))
    closure = res.initial + res.contributions.sum(1) + res.regularization - res.prediction
    row["dec_reported"] = float(res.error)
    row["dec_true_closure"] = float(np.abs(closure).max())
    pred = est.decision_function(Xq) if Est is PathKernelClassifier else est.predict(Xq)
    pred = np.asarray(pred, dtype=np.float64).reshape(len(Xq), -1)
    net_true = None
    if rep is not None:
        net_true = rep.f(rep.final, torch.as_tensor(Xq)).detach().numpy()
        mean = 0
        if Est is PathKernelMachine and est.normalize_y:
            mean = pred - scale * net_true  # predict = mean + scale f
        true_pred = (scale * net_true + mean) if Est is PathKernelMachine else net_true
        row["dec_pred_vs_replay"] = rel(res.prediction, true_pred)
        # error vs the truth: initial + sum + reg against the replayed network
        recon = res.initial + res.contributions.sum(1) + res.regularization
        row["dec_true_error"] = float(np.abs(recon - true_pred).max())
        if exact_path:
            A, Areg = rep.contributions(torch.as_tensor(Xq))
            s = 1.0 if scale is None else torch.as_tensor(scale)
            A, Areg = (A * s).numpy(), (Areg * s).numpy()
            row["dec_contrib_rel"] = rel(res.contributions, A)
            row["dec_reg_abs"] = float(np.abs(res.regularization - Areg).max())
    row["dec_warn"] = msgs

    # ---- attribute(method="unrolled"), central differences of the replay
    if fd and rep is not None:
        yq = None
        out_kw = {}
        if Est is PathKernelMachine and y.ndim == 2:
            out_kw = dict(output=0)
        if Est is PathKernelClassifier:
            if y.ndim == 2 or len(est.classes_) > 2:
                out_kw = dict(output=0)
            else:
                yq = est.classes_[[1, 0, 1]]
        tau, msgs = caught(lambda: est.attribute(Xq, yq, method="unrolled", **out_kw))
        rows_fd = rows if rows is not None else list(range(0, len(idx), 4))
        ref = np.zeros((len(Xq), len(rows_fd)))
        xq = torch.as_tensor(Xq)

        def central(i, h):
            outs = []
            for sgn in (1, -1):
                mult = torch.ones(len(idx), dtype=torch.float64)
                mult[i] += sgn * h
                if Est is PathKernelMachine:
                    # A refit with these weights standardizes its targets anew
                    # (normalize_y): the prediction mean + scale * f in y's units.
                    Yw, std, mean = network_targets(est, np.asarray(y_all)[idx],
                                                    sw_rows * mult.numpy(), with_mean=True)
                    r = Replay(est, Yw, sw_rows, mult=mult)
                    outs.append(mean + std * r.f(r.final, xq).detach().numpy())
                    continue
                r = Replay(est, Y, sw_rows, mult=mult)
                outs.append(r.f(r.final, xq).detach().numpy())
            return (outs[0] - outs[1]) / (2 * h)

        for j, i in enumerate(rows_fd):
            # Richardson: O(h^4), for paths whose weight derivative is strongly curved
            # (RMSprop with a tiny second moment: plain O(h^2) differences miss by 1e-3).
            d = (4 * central(i, 1e-5) - central(i, 2e-5)) / 3
            if Est is PathKernelMachine:
                ref[:, j] = d[:, 0]
            elif out_kw:
                ref[:, j] = d[:, 0]
            else:
                sign = np.where(yq == est.classes_[1], 1.0, -1.0)
                ref[:, j] = sign * d[:, 0]
        got = np.asarray(tau)[:, rows_fd]
        row["unr_rel"] = rel(got, ref)
        row["unr_replay_error"] = getattr(tau, "replay_error", None)
        row["unr_warn"] = msgs

    # ---- path kernel and tangent kernel
    if rep is not None and traj.record_every == 1:
        xq = torch.as_tensor(Xq)
        xf = torch.as_tensor(np.asarray(est.X_fit_)[:4])
        K, msgs = caught(lambda: est.path_kernel_(Xq, np.asarray(est.X_fit_)[:4]))
        Kref = rep.path_kernel(xq, xf).detach().numpy()
        row["pk_rel"] = rel(K, Kref)
        row["pk_warn"] = msgs
        if pk_range is not None:
            a, b = pk_range
            K2 = PathKernel(est, start=a, stop=b)(Xq, np.asarray(est.X_fit_)[:4])
            row["pk_range_rel"] = rel(K2, rep.path_kernel(xq, xf, a, b).detach().numpy())
            Kt = TangentKernel(est, step=a)(Xq, np.asarray(est.X_fit_)[:4])
            row["tk_rel"] = rel(Kt, rep.tangent_kernel(xq, xf, a).detach().numpy())
    elif traj.record_every > 1:
        K, msgs = caught(lambda: est.path_kernel_(Xq, np.asarray(est.X_fit_)[:4]))
        row["pk_warn"] = msgs
        tau, msgs = caught(lambda: est.attribute(Xq, None if Est is PathKernelMachine
                                                 else None, method="unrolled",
                                                 **({} if Est is PathKernelClassifier
                                                    or y.ndim == 1 else {"output": 0})))
        row["unr_replay_error"] = getattr(tau, "replay_error", None)
        row["unr_warn"] = msgs
    row["fit_warn"] = fit_warn
    return row


CASES = [
    ("sgd-full", "reg", dict(solver="sgd", learning_rate_init=0.1, batch_size=None), {}),
    ("sgd-mom-nesterov-minibatch", "reg", dict(solver="sgd", learning_rate_init=0.05,
                                              momentum=0.9, batch_size=7), {}),
    ("sgd-mom-heavyball-alpha", "reg", dict(solver="sgd", learning_rate_init=0.05,
                                           momentum=0.8, nesterovs_momentum=False,
                                           alpha=0.01, batch_size=8), dict(pk_range=(2, 9))),
    ("sgd-invscaling", "bin", dict(solver="sgd", learning_rate_init=0.5,
                                   learning_rate="invscaling", batch_size=6), {}),
    ("sgd-adaptive", "multi", dict(solver="sgd", learning_rate_init=0.5, tol=1e-1,
                                   n_iter_no_change=1, learning_rate="adaptive",
                                   max_iter=8, batch_size=10), {}),
    ("adam-minibatch-alpha", "reg2", dict(solver="adam", learning_rate_init=0.05, alpha=0.01,
                                          batch_size=7, normalize_y=True), dict(pk_range=(3, 10))),
    ("adamw-alpha", "bin", dict(solver="adamw", learning_rate_init=0.05, alpha=0.05,
                                batch_size=7), {}),
    ("rmsprop-alpha", "reg", dict(solver="rmsprop", learning_rate_init=0.01, alpha=0.01,
                                  batch_size=7), {}),
    ("adam-early-stopping", "bin", dict(solver="adam", learning_rate_init=0.05,
                                        early_stopping=True, validation_fraction=0.2,
                                        max_iter=8, batch_size=5), {}),
    ("adam-warm-start-lr", "reg", dict(solver="adam", learning_rate_init=0.05, max_iter=3,
                                       batch_size=7),
     dict(warm=dict(learning_rate_init=0.01, max_iter=3))),
    ("sgd-mom-warm-start-lr", "multi", dict(solver="sgd", momentum=0.9,
                                            learning_rate_init=0.1, max_iter=3,
                                            batch_size=7),
     dict(warm=dict(learning_rate_init=0.02, max_iter=3))),
    ("adam-partial-fit-3", "reg", dict(solver="adam", learning_rate_init=0.05, batch_size=4),
     dict(fit="partial", chunks=[slice(0, 7), slice(7, 13), slice(13, 20)])),
    ("sgd-partial-fit-3-mlabel", "multilabel", dict(solver="sgd", momentum=0.5,
                                                    learning_rate_init=0.3, batch_size=4),
     dict(fit="partial", chunks=[slice(0, 7), slice(7, 13), slice(13, 20)])),
    ("adam-sw-zeros", "bin", dict(solver="adam", learning_rate_init=0.05, batch_size=5),
     dict(sw=np.r_[np.zeros(6), np.linspace(0.5, 2, 14)])),
    ("sgd-sw-zeros-full", "reg", dict(solver="sgd", learning_rate_init=0.1, batch_size=None,
                                      momentum=0.5),
     dict(sw=np.r_[np.zeros(5), np.linspace(0.5, 2, 15)])),
    ("rmsprop-multilabel", "multilabel", dict(solver="rmsprop", learning_rate_init=0.01,
                                              batch_size=6), {}),
    ("adam-multilabel-sqerr", "multilabel", dict(solver="adam", learning_rate_init=0.02,
                                                 loss="squared_error", batch_size=6), {}),
    ("adam-record-every-3", "reg", dict(solver="adam", learning_rate_init=0.05, batch_size=4,
                                        record_every=3), {}),
    ("sgd-record-every-2", "bin", dict(solver="sgd", learning_rate_init=0.5, batch_size=5,
                                       record_every=2), {}),
    ("adam-disk", "reg", dict(solver="adam", learning_rate_init=0.05, batch_size=7,
                              trajectory_storage="disk"), dict(pk_range=(1, 5))),
    ("adam-float32", "reg", dict(solver="adam", learning_rate_init=0.05, batch_size=7,
                                 dtype="float32"), {}),
    ("sgd-float32-mom", "multi", dict(solver="sgd", momentum=0.9, learning_rate_init=0.1,
                                      batch_size=7, dtype="float32"), {}),
    ("adam-disk-float16-compressed", "reg", dict(solver="adam", learning_rate_init=0.05,
                                                 batch_size=7, trajectory_storage="disk",
                                                 trajectory_compression="float16"), {}),
    ("rmsprop-disk-float16-compressed", "reg", dict(solver="rmsprop", learning_rate_init=0.01,
                                                    batch_size=7, trajectory_storage="disk",
                                                    trajectory_compression="float16"), {}),
    ("adam-disk-float16-compressed-f32", "reg", dict(solver="adam", learning_rate_init=0.05,
                                                     batch_size=7, trajectory_storage="disk",
                                                     trajectory_compression="float16",
                                                     dtype="float32"), {}),
    ("sgd-disk-bfloat16-compressed", "bin", dict(solver="sgd", learning_rate_init=0.5,
                                                 batch_size=7, trajectory_storage="disk",
                                                 trajectory_compression="bfloat16"), {}),
    ("relu-adam", "reg", dict(solver="adam", activation="relu", learning_rate_init=0.05,
                              batch_size=7), dict(fd=False)),
    ("adam-large-steps", "reg", dict(solver="adam", learning_rate_init=0.5, batch_size=7), {}),
]


def main(selected):
    rows = []
    for name, kind, params, extra in CASES:
        if selected and not any(s in name for s in selected):
            continue
        t0 = time.time()
        try:
            row = run_case(name, kind, params, **extra)
        except Exception as exc:  # a failing case is a finding too
            row = dict(case=name, exception=f"{type(exc).__name__}: {exc}"[:300])
        row["secs"] = round(time.time() - t0, 1)
        rows.append(row)
        print({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
    return rows


def table(rows):
    def f(v):
        return "" if v is None else (f"{v:.1e}" if isinstance(v, float) else str(v))

    def w(v):
        return "" if v is None else ("yes" if v else "no")

    lines = ["| case | steps (every) | replay vs record | decompose: contributions vs ref "
             "| reported error | true error | warned | unrolled vs FD | replay_error "
             "| warned | path kernel vs ref | warned |",
             "|" + "---|" * 12]
    for r in rows:
        if "exception" in r:
            lines.append(f"| {r['case']} | exception: {r['exception']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['case']} | {r['steps']} ({r['every']}) | {f(r.get('replay_vs_path'))} "
            f"| {f(r.get('dec_contrib_rel'))} | {f(r.get('dec_reported'))} "
            f"| {f(r.get('dec_true_error', r.get('dec_true_closure')))} "
            f"| {w(r.get('dec_warn'))} | {f(r.get('unr_rel'))} "
            f"| {f(r.get('unr_replay_error'))} | {w(r.get('unr_warn'))} "
            f"| {f(r.get('pk_rel'))} | {w(r.get('pk_warn'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    out = main(sys.argv[1:])
    print(table(out))
