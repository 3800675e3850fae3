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

Session 32 added the layers of NEW_NETS (LSTM, a pre-norm decoder layer with causal
self-attention and cross-attention, Conv1d, ConvTranspose2d / Upsample / PixelShuffle,
Conv3d, tied embeddings, PReLU / Hardswish / Mish, a key_padding_mask, Bilinear, a GRUCell
loop, dropout built in eval or training mode), and the columns: warnings at fit, the
replay against the recorded path (the true error is now against the recorded end of the
path, which a replay cannot reproduce when training drew at random), and
``decompose(method="second_order")`` against ``second_order_reference``.

Run: ``taskset -c 1 python benchmarks/audit_layers.py [OUT.md [NAME-SUBSTRING ...]]`` (one
thread; the substrings select networks and skip the loops; results:
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
from torch.nn.attention import SDPBackend, sdpa_kernel

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


# ------------------------------------------------- session 32: more layers people train
def _seq(x):
    return x.reshape(-1, 8, 2)


class LSTMNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.rnn, self.head = nn.LSTM(2, 4, batch_first=True), nn.Linear(4, n_out)

    def forward(self, x):
        return self.head(self.rnn(_seq(x))[1][0][-1])


class Decoder(nn.Module):
    """A pre-norm decoder layer: causal self-attention, cross-attention to a memory
    computed from the same input (a linear encoder of the pairs, tanh)."""

    def __init__(self, n_out, d=4):
        super().__init__()
        self.inp, self.mem = nn.Linear(2, d), nn.Linear(2, d)
        self.layer = nn.TransformerDecoderLayer(d, 2, dim_feedforward=6, dropout=0.0,
                                                activation="gelu", batch_first=True,
                                                norm_first=True)
        self.head = nn.Linear(d, n_out)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(8))

    def forward(self, x):
        x = _seq(x)
        out = self.layer(self.inp(x), torch.tanh(self.mem(x)),
                         tgt_mask=self.causal.to(x.dtype), tgt_is_causal=True)
        return self.head(out[:, -1])


class Conv1dNet(nn.Module):
    """A temporal conv net: dilation, padding="same", a grouped convolution."""

    def __init__(self, n_out):
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, padding="same", dilation=2)
        self.c2 = nn.Conv1d(4, 4, 3, padding="same", groups=2)
        self.head = nn.Linear(4, n_out)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(_seq(x).transpose(1, 2)))))
        return self.head(h.mean(2))


class UpDecoder(nn.Module):
    """A tiny image decoder: a transposed convolution, bilinear upsampling, a sub-pixel
    (PixelShuffle) convolution."""

    def __init__(self, n_out):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1)
        self.resize = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.sub, self.shuffle = nn.Conv2d(3, 4, 3, padding=1), nn.PixelShuffle(2)
        self.head = nn.Linear(16, n_out)

    def forward(self, x):
        h = torch.tanh(self.fc(x)).reshape(-1, 2, 2, 2)
        h = self.resize(torch.tanh(self.up(h)))              # (n, 3, 8, 8)
        h = self.shuffle(torch.tanh(self.sub(h)))            # (n, 1, 16, 16)
        return self.head(F.adaptive_avg_pool2d(h, 4).flatten(1))


class Tied(nn.Module):
    """Token ids (6 per sample; the float64 replay's are cast), an embedding whose weight
    is also the output projection's (weight tying), a head on the tied logits."""

    def __init__(self, n_out, vocab=5, d=4, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.emb.weight
        self.head = nn.Linear(vocab, n_out)

    def forward(self, x):
        h = torch.tanh(self.proj(self.emb(x.long()).mean(1)))
        return self.head(torch.tanh(self.out(h)))


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention with a key_padding_mask (each sequence's padding from its
    own input), masked mean pooling."""

    def __init__(self, n_out, d=4):
        super().__init__()
        self.inp = nn.Linear(2, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        x = _seq(x)
        length = 5 + (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
        pad = torch.arange(8) >= length[:, None]
        h = self.inp(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        keep = (~pad).to(x.dtype)[..., None]
        return self.head(torch.tanh((a * keep).sum(1) / keep.sum(1)))


class GRUCellLoop(nn.Module):
    """A GRUCell stepped over the sequence by the forward's own loop."""

    def __init__(self, n_out):
        super().__init__()
        self.cell, self.head = nn.GRUCell(2, 3), nn.Linear(3, n_out)

    def forward(self, x):
        x, h = _seq(x), None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


class BilinearNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.bil, self.head = nn.Bilinear(8, 8, 4), nn.Linear(4, n_out)

    def forward(self, x):
        return self.head(torch.tanh(self.bil(x[:, :8], x[:, 8:])))


def _dropout(train):
    def build(n_out):
        net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, n_out))
        return net.train(train)
    return build


NEW_NETS = {
    "LSTM (batch_first, last hidden state)": LSTMNet,
    "decoder layer (causal, cross-attention, norm_first)": Decoder,
    "Conv1d (dilation, padding=same, groups)": Conv1dNet,
    "ConvTranspose2d, Upsample, PixelShuffle": UpDecoder,
    "Conv3d": _sequential(lambda o: (
        nn.Unflatten(1, (1, 2, 2, 4)), nn.Conv3d(1, 3, 2, padding=1), nn.Tanh(),
        nn.Conv3d(3, 2, (2, 2, 3), stride=(1, 1, 2)), nn.Tanh(), nn.Flatten(),
        nn.Linear(2 * 2 * 2 * 2, o))),
    "tied embedding / output weight": Tied,
    "tied embedding with padding_idx": lambda o: Tied(o, padding_idx=0),
    "GRUCell loop": GRUCellLoop,
    "PReLU, Hardswish, Mish": _sequential(lambda o: (
        nn.Linear(16, 8), nn.PReLU(), nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 6),
        nn.PReLU(6, 0.1), nn.Mish(), nn.Linear(6, o))),
    "MultiheadAttention, key_padding_mask": PaddedAttention,
    "Bilinear": BilinearNet,
    "dropout p=0.3, built in eval mode": _dropout(False),
    "dropout p=0.3, built in training mode": _dropout(True),
}
NETS.update(NEW_NETS)
# The networks fed token ids, and their vocabulary.
TOKENS = {"tied embedding / output weight": 5, "tied embedding with padding_idx": 5}


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
    if name in TOKENS:
        X, Xq = rng.randint(0, TOKENS[name], (14, 6)), rng.randint(0, TOKENS[name], (2, 6))
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
        _, msgs = _caught(lambda: est.fit(X, y))
    except Exception as exc:
        return {**row, "fit": f"{type(exc).__name__}: {exc}"[:120]}
    row["fit_warned"] = ", ".join(sorted({m.split(":")[0] for m in msgs})) or "no"
    idx = ref.fit_rows(est, X)
    sw = np.ones(len(idx))
    Y, scale = ref.network_targets(est, np.asarray(y)[idx], sw)
    rep = ref.Replay(est, Y, sw, track_shares=True)
    s = 1.0 if scale is None else torch.as_tensor(scale)
    xq = torch.as_tensor(Xq)
    # The recorded end of the path: the network the decomposition must add up to. The
    # replay reproduces it unless training drew at random (dropout in training mode).
    end = torch.cat([est.trajectory_.state_dict(-1)[n].to(torch.float64).reshape(-1)
                     for n in rep.names])
    row["replay_vs_path"] = ref.rel(rep.final, end)

    def part(key, fn):
        try:
            row.update(fn())
        except Exception as exc:
            row[key] = f"{type(exc).__name__}: {exc}"[:120]

    def decomposition():
        res, msgs = _caught(lambda: est.decompose(Xq))
        A, _ = rep.contributions(xq)
        recon = res.initial + res.contributions.sum(1) + res.regularization
        truth = (rep.f(end, xq) * s).detach().numpy()
        return dict(contributions=ref.rel(res.contributions, (A * s).numpy()),
                    reported=float(res.error), true=float(np.abs(recon - truth).max()),
                    decompose_warned=bool(msgs))

    def second_order():
        res, msgs = _caught(lambda: est.decompose(Xq, method="second_order"))
        A = second_order_reference(rep, xq)
        recon = res.initial + res.contributions.sum(1) + res.regularization
        truth = (rep.f(end, xq) * s).detach().numpy()
        return dict(second_order=ref.rel(res.contributions, (A * s).numpy()),
                    so_reported=float(res.error), so_true=float(np.abs(recon - truth).max()),
                    so_warned=bool(msgs))

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
    part("second_order", second_order)
    part("unrolled", unrolled)
    part("path_kernel", kernel)
    part("features", features)
    return row


def second_order_reference(rep, xq):
    """The second-order contributions: the shares of every step through
    ``rho_t(x) = J_t(x) + 1/2 (H_t(x) dtheta_t)^T``, one query and one output at a time
    by plain autograd (math attention), ``H_t dtheta_t`` by Richardson central differences
    of the first derivative along the step (torch's own double backward of weight norm is
    wrong, and jacrev of jacrev through a batched layer norm too)."""
    def gradients(theta, x):
        theta = theta.clone().requires_grad_(True)
        with sdpa_kernel(SDPBackend.MATH):
            out = rep.f(theta, x)[0]
            rows = [torch.autograd.grad(o, theta, retain_graph=True)[0] for o in out]
        return torch.stack(rows)

    total = 0
    for t in range(len(rep.shares)):
        a, d = rep.thetas[t], rep.thetas[t + 1] - rep.thetas[t]
        rows = []
        for n in range(len(xq)):
            x = xq[n:n + 1]

            def central(h, a=a, d=d, x=x):
                return (gradients(a + h * d, x) - gradients(a - h * d, x)) / (2 * h)
            hv = (4 * central(1e-4) - central(2e-4)) / 3
            rows.append(gradients(a, x) + 0.5 * hv)
        total = total + torch.einsum("ncp,ip->nic", torch.stack(rows), rep.shares[t])
    return total


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
           ("fit_warned", "fit warned"), ("replay_vs_path", "replay vs path"),
           ("contributions", "decompose: contributions vs ref"),
           ("reported", "reported error"), ("true", "true error"),
           ("decompose_warned", "warned"),
           ("second_order", "second order: contributions vs ref"),
           ("so_reported", "reported error"), ("so_true", "true error"),
           ("so_warned", "warned"), ("unrolled", "unrolled vs FD"),
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


def main(selected=()):
    rows = []
    for name in NETS:
        if selected and not any(k in name for k in selected):
            continue
        for kind, solver in (("regression", "sgd"), ("classification", "adam")):
            t0 = time.time()
            rows.append(run_network(name, kind, solver))
            print(rows[-1], f"{time.time() - t0:.1f}s", flush=True)
    for kind in ("regression", "classification") if not selected else ():
        for opt_name in ("adamw", "sgd"):
            rows.append(run_loop(kind, opt_name, 0.5))
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rows = main(sys.argv[2:])
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
