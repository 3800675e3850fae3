"""User trial s52: sequence classifiers (LSTM, GRU, RNN, text CNN) against per-sample autograd.

What a user with text and time-series classifiers would check, with the public API only:
each network is trained in the user's own loop under ``PathRecorder`` (plain SGD, lr 0.05,
5 full-batch steps, loss ``0.5 * mean over outputs of (f - y)^2``), read through
``rec.as_estimator(X, y)``, and compared in float64 with references that use no part of
skpathkernel's engine:

- ``J_k``: per-sample Jacobians by one ``torch.autograd.grad`` per sample and output, each
  sample run alone through a fresh copy of the module holding recorded point ``k``;
- tangent kernel (``output="full"`` blocks and the trace / C), path kernel (full and
  trace: ``sum_k lr J_k J_k^T`` over the steps), ``transform`` (``J_T / sqrt(C)``),
  ``decompose`` (exact: its closure against the module's own forward; first order against
  ``-lr / N sum_k J_k(x) J_k(x_i)^T (f_k(x_i) - y_i) / C``) and
  ``attribute(method="unrolled", output=0)`` against central differences (eps 1e-6) of
  retraining with point ``i``'s weight ``u_i`` in the loss ``sum(u l) / sum(u)``.

A last row fits ``PathKernelClassifier(module=factory)`` on token ids and compares its
tangent kernel and ``transform`` at the final point with the loop.

Usage: ``taskset -c 0 python -m benchmarks.trial_sequence [OUT.json]`` (prints a Markdown
table; OUT defaults to ``benchmarks/results/user_trial_sequence-s52.json``).
"""

import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.frozen import FrozenEstimator
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from skpathkernel import PathKernelClassifier, PathRecorder, TangentFeatures
from skpathkernel.kernels import PathKernel, TangentKernel
from skpathkernel.rules import layer_routes

ROOT = Path(__file__).resolve().parent.parent
V, E, H, S, C, N = 12, 4, 5, 6, 2, 10
LR, STEPS, EPS = 0.05, 5, 1e-6


class TextRNN(nn.Module):
    """Embedding (padding id 0), a recurrent layer, a pooling, a Linear head."""

    def __init__(self, cell="lstm", pool="mean", packed=False, n_out=C, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell](E, H, **kw)
        self.pool, self.packed = pool, packed
        self.head = nn.Linear(H * (2 if self.rnn.bidirectional else 1), n_out)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).to(self.head.weight.dtype)
        x = self.emb(ids)
        bf = self.rnn.batch_first
        if self.packed:
            lengths = (ids != 0).sum(1).clamp_min(1).cpu()
            seq = pack_padded_sequence(x if bf else x.transpose(0, 1), lengths,
                                       batch_first=bf, enforce_sorted=False)
            out, h = self.rnn(seq)
            out = pad_packed_sequence(out, batch_first=True, total_length=S)[0]
        else:
            out, h = self.rnn(x if bf else x.transpose(0, 1))
            out = out if bf else out.transpose(0, 1)
        h = h[0] if isinstance(h, tuple) else h
        if self.pool == "last_hidden":  # the last layer's final state, both directions
            k = 2 if self.rnn.bidirectional else 1
            return self.head(torch.cat(list(h[-k:]), dim=1))
        if self.pool == "last_output":
            return self.head(out[:, -1])
        return self.head((out * mask).sum(1) / mask.sum(1).clamp_min(1))


class SeriesRNN(nn.Module):
    """A time-series classifier: float (n, S, 2) through a 2-layer tanh RNN, mean over time."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(2, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, C)

    def forward(self, x):
        return self.head(self.rnn(x)[0].mean(1))


class TextCNN(nn.Module):
    """Embedding, Conv1d over time (kernel 3, 'same'), tanh, masked mean, Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.conv = nn.Conv1d(E, 6, 3, padding=1)
        self.head = nn.Linear(6, C)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(1).to(self.head.weight.dtype)
        h = torch.tanh(self.conv(self.emb(ids).transpose(1, 2))) * mask
        return self.head(h.sum(2) / mask.sum(2).clamp_min(1))


MODELS = {
    "LSTM batch_first, last layer's final hidden state": lambda: TextRNN(
        "lstm", "last_hidden", batch_first=True),
    "LSTM bidirectional, 2 layers, masked mean": lambda: TextRNN(
        "lstm", num_layers=2, bidirectional=True, batch_first=True),
    "LSTM batch_first=False, bias=False, final hidden state": lambda: TextRNN(
        "lstm", "last_hidden", bias=False),
    "GRU batch_first=False, bidirectional, masked mean": lambda: TextRNN(
        "gru", bidirectional=True),
    "GRU 2 layers, bias=False, last output step": lambda: TextRNN(
        "gru", "last_output", num_layers=2, bias=False, batch_first=True),
    "RNN (tanh) time series, 2 layers, mean over time": SeriesRNN,
    "LSTM packed (pack_padded_sequence)": lambda: TextRNN(
        "lstm", "last_hidden", packed=True, batch_first=True),
    "GRU packed, bidirectional": lambda: TextRNN(
        "gru", "last_hidden", packed=True, bidirectional=True, batch_first=True),
    "TextCNN: Embedding, Conv1d, masked mean": TextCNN,
}


def _data(series, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(N, C, generator=gen, dtype=torch.float64)
    if series:
        return torch.randn(N, S, 2, generator=gen, dtype=torch.float64), y
    ids = torch.randint(1, V, (N, S), generator=gen)
    for i in range(N):  # padded tails of lengths 0 .. S - 1
        ids[i, S - (i % S):] = 0
    return ids, y


def jacobian(module, X):
    """(N, C, P) by one autograd pass per sample and output, each sample alone."""
    params = list(module.parameters())
    rows = []
    for i in range(len(X)):
        out = module(X[i : i + 1]).reshape(-1)
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            out[c], params, retain_graph=True)]) for c in range(out.numel())]))
    return torch.stack(rows).detach()


def _loss(out, y):
    return 0.5 * (out - y).pow(2).mean(1)


def _train(module, X, y, u=None, recorder=False):
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    rec = PathRecorder(module, opt, n_samples=N) if recorder else None
    with rec if rec is not None else warnings.catch_warnings():
        for _ in range(STEPS):
            opt.zero_grad()
            li = _loss(module(X), y)
            (li.mean() if u is None else (u * li).sum() / u.sum()).backward()
            if rec is not None:
                rec.set_batch(np.arange(N))
            opt.step()
    return rec


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def check(name, factory, series=False):
    X, y = _data(series)
    torch.manual_seed(0)
    module = factory().double()
    init = {k: v.clone() for k, v in module.state_dict().items()}
    routes = [(r.name, r.type, r.route, r.reason) for r in layer_routes(module, X)]
    rec = _train(module, X, y, recorder=True)
    net = rec.as_estimator(X_train=X, y_train=y, loss="squared_error")
    traj = rec.trajectory
    ref = factory().double()
    Js, Fs = [], []
    for k in range(len(traj)):
        ref.load_state_dict(traj.state_dict(k), strict=False)
        Js.append(jacobian(ref, X))
        with torch.no_grad():
            Fs.append(ref(X))
    full = torch.einsum("ncp,mdp->nmcd", Js[-1], Js[-1]).numpy()
    path = sum(LR * torch.einsum("ncp,mdp->nmcd", J, J) for J in Js[:-1]).numpy()
    row = {"model": name, "routes": routes}
    row["TK full"] = _rel(TangentKernel(net, output="full")(X), full)
    row["TK trace"] = _rel(TangentKernel(net)(X), np.einsum("nmcc->nm", full) / C)
    row["PK full"] = _rel(PathKernel(net, output="full")(X), path)
    row["PK trace"] = _rel(PathKernel(net)(X), np.einsum("nmcc->nm", path) / C)
    phi = TangentFeatures(FrozenEstimator(net)).fit(X).transform(X)
    row["transform"] = _rel(phi, Js[-1].reshape(N, -1).numpy() / np.sqrt(C))
    res = net.decompose(X)
    recon = res.initial + res.contributions.sum(1) + res.regularization
    row["decompose closure"] = _rel(recon, Fs[-1].numpy())
    row["decompose error"] = float(res.error)
    first = 0
    for k in range(len(traj) - 1):
        g = torch.einsum("icp,ic->ip", Js[k], (Fs[k] - y) / C)
        first = first - LR / N * torch.einsum("ncp,ip->nic", Js[k], g)
    row["first order"] = _rel(net.decompose(X, method="first_order").contributions,
                              first.numpy())
    tau = np.asarray(net.attribute(X[:2], method="unrolled", output=0))
    fd = np.zeros((2, N))
    for i in range(N):
        vals = []
        for s in (1, -1):
            m = factory().double()
            m.load_state_dict(init)
            u = torch.ones(N, dtype=torch.float64)
            u[i] += s * EPS
            _train(m, X, y, u)
            with torch.no_grad():
                vals.append(m(X[:2])[:, 0].numpy())
        fd[:, i] = (vals[0] - vals[1]) / (2 * EPS)
    row["attribute unrolled vs FD"] = _rel(tau.reshape(fd.shape), fd)
    return row


def check_estimator():
    """``PathKernelClassifier(module=factory)`` on token ids, 3 classes: TK and transform at
    the end."""
    X, _ = _data(False)
    labels = np.arange(N) % 3
    clf = PathKernelClassifier(
        module=lambda n_features, n_outputs: TextRNN("gru", bidirectional=True, n_out=n_outputs,
                                                     batch_first=True),
        dtype="float64", solver="sgd", learning_rate_init=0.05, max_iter=3, tol=None,
        random_state=0).fit(X.numpy(), labels)
    module = clf.module_
    J = jacobian(module, X)
    c = J.shape[1]
    routes = [(r.name, r.type, r.route, r.reason) for r in layer_routes(module, X)]
    return {"model": "PathKernelClassifier(module=GRU bidirectional factory)", "routes": routes,
            "TK trace": _rel(clf.tangent_kernel_(X.numpy()),
                             torch.einsum("ncp,mcp->nm", J, J).numpy() / c),
            "transform": _rel(clf.transform(X.numpy()), J.reshape(N, -1).numpy() / np.sqrt(c))}


COLUMNS = ["TK full", "TK trace", "PK full", "PK trace", "transform", "decompose closure",
           "decompose error", "first order", "attribute unrolled vs FD"]


def main():
    torch.set_num_threads(1)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        ROOT / "benchmarks" / "results" / "user_trial_sequence-s52.json")
    rows = []
    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, factory in MODELS.items():
            rows.append(check(name, factory, series=factory is SeriesRNN))
            print(name, {k: v for k, v in rows[-1].items() if k in COLUMNS}, flush=True)
        rows.append(check_estimator())
    warned = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
    out.write_text(json.dumps(dict(rows=rows, warnings=warned,
                                   seconds=time.time() - start), indent=1))
    print("| model | routes (recurrent / conv layer) | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for r in rows:
        layer = [f"{t} {route}" + (f" ({why})" if why else "") for _, t, route, why in r["routes"]
                 if t not in ("Linear", "Embedding")]
        print(f"| {r['model']} | {'; '.join(layer)} | "
              + " | ".join(f"{r[k]:.1e}" if k in r else "-" for k in COLUMNS) + " |")
    for w in warned:
        print("-", w)


if __name__ == "__main__":
    main()
