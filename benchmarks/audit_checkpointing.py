"""Activation checkpointing across the entry points (benchmarks/results/checkpointing_matrix.md).

Each (checkpointing mode, region, entry point) against the same network without
checkpointing: the per-sample autograd loop of it (float64) for the tangent kernel, the
step kernel at the first recorded point and the features; the fit of it for the path
kernel, decompose and attribute; the trained parameters; a path recorded by PathRecorder
from a user's own loop. ``python benchmarks/audit_checkpointing.py [regions] [modes]``
(comma-separated) prints one line per cell: ok, WRONG (relative error) or FAIL (the error).
"""

import copy
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.frozen import FrozenEstimator
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from skpathkernel import PathKernelMachine, PathRecorder, TangentFeatures
from skpathkernel.kernels import PathKernel, TangentKernel, step_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _reference import features_loop, jacobian_loop, module_at

H = 6
REGIONS = ["rule", "fallback", "inplace", "saved_inplace", "bn_eval", "dropout_eval"]
MODES = ["nonreentrant", "reentrant", "seq_nonreentrant", "seq_reentrant"]


class Odd(nn.Module):
    """A raw parameter read by ``cos`` and ``exp``: the generic fallback."""

    def __init__(self, h):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-0.5, 0.5, h))

    def forward(self, x):
        return x * torch.cos(self.w) + torch.sin(x * self.w.exp())


def region(kind):
    return {"rule": [nn.Linear(H, H), nn.Tanh()],
            "fallback": [nn.Linear(H, H), nn.Tanh(), Odd(H)],
            "inplace": [nn.Linear(H, H), nn.ReLU(inplace=True), nn.Tanh()],
            # Trained out of place, then the ReLU rewrites the output Tanh saved.
            "saved_inplace": [nn.Linear(H, H), nn.Tanh(), nn.ReLU()],
            "bn_eval": [nn.Linear(H, H), nn.BatchNorm1d(H), nn.Tanh()],
            "dropout_eval": [nn.Linear(H, H), nn.Dropout(0.3), nn.Tanh()]}[kind]


class Net(nn.Module):
    def __init__(self, n_in, n_out, kind, mode):
        super().__init__()
        self.mode = mode
        self.l1 = nn.Linear(n_in, H)
        self.body = nn.Sequential(*region(kind))
        self.out = nn.Linear(H, n_out)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.mode is None:
            h = self.body(h)
        elif self.mode in ("nonreentrant", "reentrant"):
            h = checkpoint(self.body, h, use_reentrant=self.mode == "reentrant")
        else:
            h = checkpoint_sequential(self.body, 2, h,
                                      use_reentrant=self.mode == "seq_reentrant")
        return self.out(h)


def build(kind, mode):
    def make(n_in, n_out):
        torch.manual_seed(1)
        net = Net(n_in, n_out, kind, mode)
        return net.eval() if kind.endswith("_eval") else net
    return make


RNG = np.random.RandomState(0)
X = RNG.normal(size=(16, 5))
Y = np.c_[X[:, 0] - X[:, 1] ** 2, np.sin(X[:, 2])]
Q = RNG.normal(size=(5, 5))


def fit(kind, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PathKernelMachine(module=build(kind, mode), max_iter=3, tol=None,
                                 dtype="float64", random_state=0, batch_size=8).fit(X, Y)


def set_mode(module, mode, inplace=None):
    """``module``'s checkpointing ``mode`` (None: none) and, unless None, its ReLUs'
    ``inplace``."""
    for m in module.modules():
        if isinstance(m, Net):
            m.mode = mode
        if inplace is not None and isinstance(m, nn.ReLU):
            m.inplace = inplace


def relative_error(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


def plain(module):
    """A copy of ``module`` without checkpointing, computing out of place, in eval mode."""
    m = copy.deepcopy(module)
    for x in m.modules():
        if isinstance(x, Net):
            x.mode = None
        if isinstance(x, nn.ReLU):
            x.inplace = False
    return m.eval()


def gram_loop(est, point=-1):
    J = jacobian_loop(plain(module_at(est, point)), Q).reshape(len(Q), -1).numpy()
    return J @ J.T / Y.shape[1]


def entries(est, twin):
    """name -> thunk giving (got, want)."""
    def decomposed(method):
        a, b = est.decompose(Q, method=method), twin.decompose(Q, method=method)
        return (np.r_[a.contributions.ravel(), a.prediction.ravel()],
                np.r_[b.contributions.ravel(), b.prediction.ravel()])

    def attributed(method):
        return (np.asarray(est.attribute(Q, method=method, output=0)),
                np.asarray(twin.attribute(Q, method=method, output=0)))

    phi = lambda: features_loop(plain(module_at(est)), Q)  # noqa: E731
    return {
        "TangentKernel": lambda: (TangentKernel(est)(Q), gram_loop(est)),
        "TK_XY": lambda: (TangentKernel(est)(Q, X[:3]), TangentKernel(twin)(Q, X[:3])),
        "step_kernel0": lambda: (step_kernel(est, Q, step=0), gram_loop(est, 0)),
        "PathKernel": lambda: (PathKernel(est)(Q), PathKernel(twin)(Q)),
        "transform": lambda: (est.transform(Q), phi()),
        "TangentFeatures": lambda: (
            TangentFeatures(FrozenEstimator(est)).fit(X).transform(Q), phi()),
        "decompose": lambda: decomposed("exact"),
        "decompose_1st": lambda: decomposed("first_order"),
        "attribute": lambda: attributed("exact"),
        "attribute_unrolled": lambda: attributed("unrolled"),
    }


def recorded(kind, mode):
    module = build(kind, mode)(5, 2).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    Xt, Yt = torch.from_numpy(X), torch.from_numpy(Y)
    with PathRecorder(module, opt, n_samples=16) as rec:
        for i in range(3):
            idx = np.arange(8 * (i % 2), 8 * (i % 2) + 8)
            rec.set_batch(idx)
            opt.zero_grad()
            (0.5 * (module(Xt[idx]) - Yt[idx]) ** 2).mean().backward()
            opt.step()
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rec.as_estimator(X, Y)


def recorder_entry(kind, mode):
    def summary(est):
        return np.r_[TangentKernel(est)(Q).ravel(), PathKernel(est)(Q).ravel(),
                     est.decompose(Q).contributions.ravel()]
    return summary(recorded(kind, mode)), summary(recorded(kind, None))


def cell(thunk, tol=1e-9):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, want = thunk()
        err = relative_error(got, want)
        return ("ok" if err <= tol else "WRONG"), f"{err:.1e}"
    except Exception as ex:  # the matrix records every failure
        return "FAIL", f"{type(ex).__name__}: {str(ex).splitlines()[0][:110]}"


def run(kinds, modes):
    for kind in kinds:
        twin = fit(kind, None)
        for mode in modes:
            res = {}
            if kind == "saved_inplace":
                est = copy.deepcopy(twin)
                set_mode(est.module_, mode, inplace=True)
            else:
                try:
                    est = fit(kind, mode)
                    res["train"] = cell(lambda est=est, twin=twin: (
                        est.trajectory_.parameters(-1).numpy(),
                        twin.trajectory_.parameters(-1).numpy()), tol=1e-12)
                except Exception as ex:  # the matrix records every failure
                    res["train"] = "FAIL", f"{type(ex).__name__}: {str(ex)[:110]}"
                    est = copy.deepcopy(twin)
                    set_mode(est.module_, mode)
            for name, thunk in entries(est, twin).items():
                res[name] = cell(thunk)
            if kind != "saved_inplace":
                res["recorder"] = cell(lambda kind=kind, mode=mode: recorder_entry(kind, mode))
            for name, (status, detail) in res.items():
                print(f"{kind:14s} {mode:16s} {name:20s} {status:5s} {detail}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1].split(",") if len(sys.argv) > 1 else REGIONS,
        sys.argv[2].split(",") if len(sys.argv) > 2 else MODES)
