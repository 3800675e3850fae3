"""Audit of the exact promises on the layers people train (session 14).

Every analysis on tiny float64 ``module=`` networks built from the layers of CNNs, ResNets,
transformers, ViTs, RNNs and normalised layers, against the independent references of
``benchmarks/audit_exact.py`` (a plain torch.optim replay, jacrev, 24-node Gauss-Legendre,
finite differences of the replay with one point's weight perturbed):

* ``decompose`` (contributions vs the reference, reported vs true closure error, warned),
* ``attribute(method="unrolled")`` vs finite differences (and its ``replay_error``),
* ``path_kernel_`` vs the dense sum, tangent features (``transform``) vs jacrev,

then a user's own loop (``PathRecorder``): a ViT-like network, AdamW with two parameter
groups, a per-step cosine schedule and gradient clipping, unrolled scores vs finite
differences of the same loop rerun with weights.

Run: ``taskset -c 1 python benchmarks/audit_layers.py [OUT.md]`` (one thread; results:
``benchmarks/results/layers_audit.md``, which holds this run on main before the fixes and
after them).
"""
from __future__ import annotations

import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacrev

import skpathkernel
from benchmarks import audit_exact as ref
from skpathkernel import PathKernelClassifier, PathKernelMachine, PathRecorder, RecordedNetwork

torch.set_num_threads(1)
ref.GL_NODES = 24  # the ViT's steps need more nodes than 12 for 1e-15 contributions


def _image(x):
    return x.reshape(-1, 1, 4, 4)


class CNN(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.c1, self.pool = nn.Conv2d(1, 3, 3, padding=1), nn.AvgPool2d(2)
        self.c2, self.fc = nn.Conv2d(3, 4, 3, padding=1, stride=2), nn.Linear(4, n_out)

    def forward(self, x):
        h = self.pool(torch.tanh(self.c1(_image(x))))
        return self.fc(torch.tanh(self.c2(h)).flatten(1))


class ViT(nn.Module):
    """Patch conv, raw class token / position parameters, a LayerScale gain, a pre-norm
    encoder layer (GELU), LayerNorm, a linear head on the class token."""

    def __init__(self, n_out, d=6):
        super().__init__()
        self.embed = nn.Conv2d(1, d, 2, stride=2)
        self.cls = nn.Parameter(0.3 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.3 * torch.randn(1, 5, d))
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(d))
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, n_out)

    def forward(self, x):
        x = self.embed(_image(x)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x) * self.gain)[:, 0])


class Sequence(nn.Module):
    """A post-norm encoder layer (ReLU: its kinks leave the quadrature short of tol)."""

    def __init__(self, n_out, d=6):
        super().__init__()
        self.inp = nn.Linear(2, d)
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        return self.head(self.encoder(self.inp(x.reshape(-1, 8, 2))).mean(1))


class Residual(nn.Module):
    """Convolutions, BatchNorm in eval mode (running statistics away from 0 / 1), a
    residual addition, global average pooling."""

    def __init__(self, n_out, c=3):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn, self.bn2, self.head = nn.BatchNorm2d(c), nn.BatchNorm2d(c), nn.Linear(c, n_out)
        g = torch.Generator().manual_seed(1)
        for m in (self.bn, self.bn2):
            m.running_mean.copy_(0.1 * torch.randn(c, generator=g))
            m.running_var.copy_(1 + 0.2 * torch.rand(c, generator=g))
            m.eval()

    def forward(self, x):
        h = torch.tanh(self.bn(self.stem(_image(x))))
        return self.head(torch.tanh(h + self.bn2(self.conv(h))).mean((2, 3)))


class GRUNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.rnn, self.head = nn.GRU(2, 5, batch_first=True), nn.Linear(5, n_out)

    def forward(self, x):
        return self.head(self.rnn(x.reshape(-1, 8, 2))[0][:, -1])


class Unused(nn.Module):
    """A parameter the forward never reads (a head not trained yet)."""

    def __init__(self, n_out):
        super().__init__()
        self.used = nn.Sequential(nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, n_out))
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def _sequential(layers):
    return lambda n_out: nn.Sequential(*layers(n_out))


NETS = {
    "cnn (conv, avg-pool)": CNN,
    "vit (patch conv, tokens, LayerScale, pre-norm attention)": ViT,
    "transformer (post-norm attention, ReLU)": Sequence,
    "resnet block (eval BatchNorm, residual)": Residual,
    "depthwise conv, adaptive pool": _sequential(lambda o: (
        nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(),
        nn.Conv2d(2, 2, 3, padding=1, groups=2), nn.Tanh(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(2, o))),
    "GroupNorm, SiLU": _sequential(lambda o: (
        nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4),
        nn.SiLU(), nn.Flatten(), nn.Linear(64, o))),
    "LayerNorm, GELU, Softplus": _sequential(lambda o: (
        nn.Linear(16, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8, bias=False),
        nn.Softplus(), nn.Linear(8, o))),
    "GRU": GRUNet,
    "weight norm (parametrization)": _sequential(lambda o: (
        nn.utils.parametrizations.weight_norm(nn.Linear(16, 8)), nn.Tanh(),
        nn.Linear(8, o))),
    "spectral norm, eval mode": _sequential(lambda o: (
        nn.utils.parametrizations.spectral_norm(nn.Linear(16, 8)).eval(), nn.Tanh(),
        nn.Linear(8, o))),
    "unused parameter": Unused,
}


def _factory(name):
    def build(n_features, n_outputs):
        torch.manual_seed(0)
        return NETS[name](n_outputs).double()
    return build


def _caught(fn):
    """fn's result and the messages of the warnings it raised, torch's own performance
    notes about missing batching rules left out."""
    out, msgs = ref.caught(fn)
    return out, [m for m in msgs if "performance drop" not in m]


def run_network(name, kind, solver):
    rng = np.random.RandomState(0)
    X, Xq = rng.normal(size=(14, 16)), rng.normal(size=(2, 16))
    Est = PathKernelMachine if kind == "regression" else PathKernelClassifier
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] if kind == "regression" else np.argmax(X[:, :3], 1)
    kw = dict(module=_factory(name), solver=solver, max_iter=2, batch_size=5, tol=None,
              random_state=0, dtype="float64", learning_rate_init=0.05)
    if Est is PathKernelMachine:
        kw["normalize_y"] = False
    if solver == "sgd":
        kw["momentum"] = 0.9
    est = Est(**kw)
    row = dict(network=name, task=f"{kind}, {solver}")
    try:
        _caught(lambda: est.fit(X, y))
    except Exception as exc:
        return {**row, "fit": f"{type(exc).__name__}: {exc}"[:120]}
    idx = ref.fit_rows(est, X)
    sw = np.ones(len(idx))
    Y, scale = ref.network_targets(est, np.asarray(y)[idx], sw)
    rep = ref.Replay(est, Y, sw, track_shares=True)
    s = 1.0 if scale is None else torch.as_tensor(scale)
    xq = torch.as_tensor(Xq)

    def part(key, fn):
        try:
            row.update(fn())
        except Exception as exc:
            row[key] = f"{type(exc).__name__}: {exc}"[:120]

    def decomposition():
        res, msgs = _caught(lambda: est.decompose(Xq))
        A, _ = rep.contributions(xq)
        recon = res.initial + res.contributions.sum(1) + res.regularization
        truth = (rep.f(rep.final, xq) * s).detach().numpy()
        return dict(contributions=ref.rel(res.contributions, (A * s).numpy()),
                    reported=float(res.error), true=float(np.abs(recon - truth).max()),
                    decompose_warned=bool(msgs))

    def unrolled():
        out = {} if Est is PathKernelMachine else dict(output=0)
        tau, msgs = _caught(lambda: est.attribute(Xq, None, method="unrolled", **out))
        rows, fd = [0, 5, 11], np.zeros((2, 3))
        for j, i in enumerate(rows):
            def central(h, i=i):
                outs = []
                for sign in (1, -1):
                    mult = torch.ones(len(idx), dtype=torch.float64)
                    mult[i] += sign * h
                    r = ref.Replay(est, Y, sw, mult=mult)
                    outs.append(r.f(r.final, xq).detach().numpy())
                return (outs[0] - outs[1]) / (2 * h)
            fd[:, j] = ((4 * central(1e-5) - central(2e-5)) / 3)[:, 0] * float(
                1 if scale is None else scale[0])
        return dict(unrolled=ref.rel(np.asarray(tau)[:, rows], fd),
                    replay_error=tau.replay_error, unrolled_warned=bool(msgs))

    def kernel():
        Xf = np.asarray(est.X_fit_)[:4]
        K, _ = _caught(lambda: est.path_kernel_(Xq, Xf))
        return dict(path_kernel=ref.rel(K, rep.path_kernel(xq, torch.as_tensor(Xf))
                                        .detach().numpy()))

    def features():
        Phi, _ = _caught(lambda: est.transform(Xq))
        traj = est.trajectory_
        J = jacrev(lambda t: functional_call(est.module_, dict(traj.unflatten(t)), (xq,)))(
            traj.parameters(-1).to(torch.float64))
        # The documented layout: the flattened Jacobian over sqrt(C), whose inner
        # products are the trace kernel over the C outputs.
        J = J.reshape(len(Xq), -1) / np.sqrt(est.n_outputs_)
        return dict(features=ref.rel(Phi, J.numpy()))

    part("contributions", decomposition)
    part("unrolled", unrolled)
    part("path_kernel", kernel)
    part("features", features)
    return row


# ----------------------------------------------------------------- a user's own loop
STEPS, BATCH = 10, 4


def _groups(net, decay):
    matrices = [p for n, p in net.named_parameters()
                if p.ndim >= 2 and "pos" not in n and "cls" not in n]
    rest = [p for p in net.parameters() if all(p is not m for m in matrices)]
    return [dict(params=matrices, weight_decay=decay), dict(params=rest, weight_decay=0.0)]


def _loop(kind, X, y, opt_name, clip, w=None, record=False):
    torch.manual_seed(0)
    net = ViT(1 if kind == "regression" else 3).double().eval()
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    opt = (torch.optim.AdamW(_groups(net, 0.05), lr=0.02) if opt_name == "adamw" else
           torch.optim.SGD(_groups(net, 0.01), lr=0.05, momentum=0.9, nesterov=True))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    gen = torch.Generator().manual_seed(0)
    w = torch.ones(len(X), dtype=torch.float64) if w is None else torch.as_tensor(w)
    rec = PathRecorder(net, opt, n_samples=len(X)) if record else None
    for _ in range(STEPS):
        batch = torch.randperm(len(X), generator=gen)[:BATCH]
        if rec is not None:
            rec.set_batch(batch.numpy())
        opt.zero_grad()
        out = net(Xt[batch])
        per = (0.5 * (out[:, 0] - yt[batch]) ** 2 if kind == "regression"
               else F.cross_entropy(out, yt[batch], reduction="none"))
        ((per * w[batch]).sum() / w[batch].sum()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        sched.step()
    if rec is not None:
        rec.close()
    return net, None if rec is None else rec.trajectory


def run_loop(kind, opt_name, clip):
    rng = np.random.RandomState(0)
    X, Xq = rng.normal(size=(12, 16)), rng.normal(size=(2, 16))
    y = np.sin(X[:, 0]) if kind == "regression" else np.argmax(X[:, :3], 1)
    row = dict(network="ViT in a PathRecorder loop",
               task=f"{kind}, {opt_name}, two groups, cosine schedule, clip {clip}")
    try:
        net, traj = _loop(kind, X, y, opt_name, clip, record=True)
        rn = RecordedNetwork(net, traj, X_train=X, y_train=y,
                             loss="squared_error" if kind == "regression" else "log_loss")
        out = {} if kind == "regression" else dict(output=0)
        tau, msgs = _caught(lambda: rn.attribute(Xq, method="unrolled", **out))
    except Exception as exc:
        return {**row, "unrolled": f"{type(exc).__name__}: {exc}"[:120]}
    xq = torch.as_tensor(Xq)

    def outputs(m):
        trained, _ = _loop(kind, X, y, opt_name, clip, w=m)
        with torch.no_grad():
            return trained(xq)[:, 0].numpy()

    rows, fd = [0, 5, 9], np.zeros((2, 3))
    for j, i in enumerate(rows):
        def central(h, i=i):
            up, down = np.ones(len(X)), np.ones(len(X))
            up[i] += h
            down[i] -= h
            return (outputs(up) - outputs(down)) / (2 * h)
        fd[:, j] = (4 * central(1e-5) - central(2e-5)) / 3
    return {**row, "unrolled": ref.rel(np.asarray(tau)[:, rows], fd),
            "replay_error": tau.replay_error, "unrolled_warned": bool(msgs)}


COLUMNS = [("network", "network"), ("task", "task, solver"), ("fit", "fit"),
           ("contributions", "decompose: contributions vs ref"),
           ("reported", "reported error"), ("true", "true error"),
           ("decompose_warned", "warned"), ("unrolled", "unrolled vs FD"),
           ("replay_error", "replay_error"), ("unrolled_warned", "warned"),
           ("path_kernel", "path kernel vs ref"), ("features", "features vs jacrev")]


def table(rows):
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, bool):
            return "yes" if v else "no"
        return f"{v:.1e}" if isinstance(v, float) else str(v).replace("|", "/")

    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main():
    rows = []
    for name in NETS:
        for kind, solver in (("regression", "sgd"), ("classification", "adam")):
            t0 = time.time()
            rows.append(run_network(name, kind, solver))
            print(rows[-1], f"{time.time() - t0:.1f}s", flush=True)
    for kind in ("regression", "classification"):
        for opt_name in ("adamw", "sgd"):
            rows.append(run_loop(kind, opt_name, 0.5))
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rows = main()
    commit = subprocess.run(["git", "-C", str(Path(skpathkernel.__file__).parents[1]),
                             "rev-parse", "--short=10", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    header = (f"- Commit {commit}; torch {torch.__version__}; Python "
              f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    text = header + "\n\n" + table(rows) + "\n"
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            fh.write(text)
