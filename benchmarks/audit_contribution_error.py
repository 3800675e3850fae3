"""Does ``decompose(method="exact")``'s ``error`` bound each contribution's error?

The node choice measures the quadrature error of step t on the step's SUM over its batch,
``|rho_t . dtheta_t - (f(theta_{t+1}) - f(theta_t))|``; a point's share
``rho_t . dtheta_t^(i)`` errs by ``delta_rho_t . dtheta_t^(i)``, which that residual does
not bound where the points' shares cancel (a full batch near convergence, minibatches).

For every case below, the estimator is fitted, and its network's ``decompose`` (network
units) is run at the default tol and at tol 1e-4 and 1e-3 (adaptive nodes). Each is
compared with a float64 reference of the same recorded path: the same decomposition with
REF_NODES (16) Gauss-Legendre nodes per step, the module and the recorded parameters cast to float64
(so a float32 path is judged against float64 arithmetic on its own points). That
reference is itself checked against an independent per-step loop on two tiny cases
(``audit_exact.Replay``: a plain torch.optim replay, per-sample shares carried through the
optimizer's memory, each step's Jacobian averaged by REF_NODES-node Gauss-Legendre with
jacrev).

Reported per run: ``error`` (the API's), ``tol * S`` (what the docs promise for the sum),
the worst absolute error of a single contribution over queries, points and outputs
(``contrib``), their ratios, the API's per-contribution estimate
(``Decomposition.contribution_error``, ``estimate``) against ``contrib``, the
cancellation ``sum_i |a_i| / |sum_i a_i|`` of the worst query, and whether a warning
fired.

Run: taskset -c 1 python benchmarks/audit_contribution_error.py [words of case names]
(results: benchmarks/results/contribution_error.md)
"""
from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import audit_exact

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis._decomposition import decompose as decompose_path
from skpathkernel._network._trained import network_of
from skpathkernel._path._trajectory import Trajectory
from skpathkernel._tangent import forward

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_error.md")
TOLS = (None, 1e-4, 1e-3)
# 16 Gauss-Legendre nodes per step: on the worst case 8, 16 and 32 fixed nodes agree to
# 5e-15 (contribution_error-before-check.md, --floor); 64 took most of the run's time.
REF_NODES = 16


def float64_path(traj):
    """The recorded path with its points and optimizer states cast to float64."""
    payload = traj._payload()
    payload["params"] = payload["params"].double()
    payload["states"] = {k: v.double() for k, v in payload["states"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "path.pt")
        torch.save(payload, path)
        return Trajectory.load(path)


def reference(net, Xq):
    """The REF_NODES-node float64 decomposition of the network's recorded path."""
    module = net.module
    traj = net.trajectory
    X_fit, Y_fit = net._training_data()
    if traj.dtype != torch.float64:
        module = copy.deepcopy(module).double()
        traj = float64_path(traj)
        X_fit = X_fit.double()
        Y_fit = Y_fit.double() if Y_fit.is_floating_point() else Y_fit
    Xq = torch.as_tensor(np.asarray(Xq), dtype=torch.float64).reshape(
        (len(Xq),) + tuple(X_fit.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, _ = decompose_path(module, traj, X_fit, Y_fit, net.loss, Xq, n_nodes=REF_NODES,
                                warn=False)
    return res


def measure(est, Xq, tol):
    net = network_of(est)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.process_time()
        res = net.decompose(Xq, tol=tol)
        cpu = time.process_time() - t0
    msgs = [type(m.message).__name__ for m in w
            if not issubclass(m.category, (DeprecationWarning, FutureWarning))]
    return res, msgs, cpu


# --------------------------------------------------------------------------- cases
def regression(n=40, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 4))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=n)
    return X, y, rng.normal(size=(6, 4))


def classification(n=60, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, 4))
    y = np.argmax(X @ rng.normal(size=(4, 3)) + 0.3 * rng.normal(size=(n, 3)), axis=1)
    return X, y, rng.normal(size=(6, 4))


def digits(n=300):
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    return X[:n], y[:n], X[n:n + 10]


class SmallCNN(nn.Module):
    def __init__(self, n_features_in=64, n_outputs=10):
        super().__init__()
        self.net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1),
                                 nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, padding=1),
                                 nn.Tanh(), nn.Flatten(), nn.Linear(64, n_outputs))

    def forward(self, x):
        return self.net(x)


BASE = dict(tol=None, random_state=0, device="cpu", n_iter_no_change=10**6, dtype="float64")
CASES = [
    # name, estimator, data, params
    ("tanh reg, full-batch SGD, 3000 it (converged)", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16,), activation="tanh", solver="sgd", batch_size=40,
          learning_rate_init=0.1, max_iter=3000, normalize_y=False)),
    ("tanh reg, full-batch SGD, 3000 it, float32", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16,), activation="tanh", solver="sgd", batch_size=40,
          learning_rate_init=0.1, max_iter=3000, normalize_y=False, dtype="float32")),
    ("gelu clf, full-batch SGD, 2000 it", PathKernelClassifier, classification,
     dict(hidden_layer_sizes=(16,), activation="gelu", solver="sgd", batch_size=60,
          learning_rate_init=0.2, max_iter=2000)),
    ("softplus reg, minibatch SGD (8), 100 ep", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16,), activation="softplus", solver="sgd", batch_size=8,
          learning_rate_init=0.05, max_iter=100, normalize_y=False)),
    ("tanh clf, minibatch Adam (10), 100 ep", PathKernelClassifier, classification,
     dict(hidden_layer_sizes=(16,), activation="tanh", solver="adam", batch_size=10,
          learning_rate_init=1e-2, max_iter=100)),
    ("gelu reg, full-batch Adam, 1500 it", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16, 16), activation="gelu", solver="adam", batch_size=40,
          learning_rate_init=1e-2, max_iter=1500, normalize_y=False)),
    ("gelu reg, full-batch Adam, 4000 it", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16, 16), activation="gelu", solver="adam", batch_size=40,
          learning_rate_init=1e-2, max_iter=4000, normalize_y=False)),
    ("gelu reg (100 points), full-batch Adam lr 3e-2, 2000 it", PathKernelMachine,
     lambda: regression(n=100),
     dict(hidden_layer_sizes=(16, 16), activation="gelu", solver="adam", batch_size=100,
          learning_rate_init=3e-2, max_iter=2000, normalize_y=False)),
    ("relu reg, full-batch SGD, 1000 it", PathKernelMachine, regression,
     dict(hidden_layer_sizes=(16,), activation="relu", solver="sgd", batch_size=40,
          learning_rate_init=0.1, max_iter=1000, normalize_y=False)),
    ("tanh CNN digits clf, minibatch SGD (50), 30 ep", PathKernelClassifier, digits,
     dict(module=SmallCNN, solver="sgd", batch_size=50, learning_rate_init=0.1,
          max_iter=30)),
    ("tanh CNN digits clf, minibatch SGD (50), 30 ep, float32", PathKernelClassifier,
     digits, dict(module=SmallCNN, solver="sgd", batch_size=50, learning_rate_init=0.1,
                  max_iter=30, dtype="float32")),
    ("digits clf, defaults (gelu 64x64, Adam, float32), 30 ep", PathKernelClassifier,
     digits, dict(max_iter=30, dtype="float32")),
    ("digits clf, full-batch SGD gelu, 500 it, float32", PathKernelClassifier, digits,
     dict(hidden_layer_sizes=(32,), solver="sgd", batch_size=300, learning_rate_init=0.5,
          max_iter=500, dtype="float32")),
]


def cancellation(contrib):
    """sum_i |a_i| / |sum_i a_i|, the largest over queries and outputs."""
    num = np.abs(contrib).sum(1)
    den = np.abs(contrib.sum(1))
    return float(np.max(num / np.maximum(den, 1e-300)))


def validate():
    """The 64-node reference against audit_exact's independent per-step loop."""
    audit_exact.GL_NODES = REF_NODES
    rows = []
    for solver, extra in (("sgd", dict(batch_size=20)), ("adam", dict(batch_size=5))):
        X, y, Xq = audit_exact.data("reg")
        est = PathKernelMachine(hidden_layer_sizes=(5,), activation="tanh", solver=solver,
                                max_iter=40, tol=None, random_state=0, dtype="float64",
                                device="cpu", normalize_y=False, learning_rate_init=0.1,
                                **extra)
        est.fit(X, y)
        idx = audit_exact.fit_rows(est, X)
        Y, _ = audit_exact.network_targets(est, y[idx], np.ones(len(idx)))
        rep = audit_exact.Replay(est, Y, np.ones(len(idx)), track_shares=True)
        A, _ = rep.contributions(torch.as_tensor(Xq))
        A = A.detach().numpy()
        ref = reference(network_of(est), Xq).contributions
        rows.append((solver, est.trajectory_.n_steps, float(np.abs(ref - A).max()),
                     float(np.abs(A).max())))
    return rows


def main(selected):
    lines = []
    host = platform.processor() or platform.machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    lines += [
        "# Per-contribution quadrature error of decompose(method='exact')",
        "",
        f"`python benchmarks/audit_contribution_error.py` at commit {commit} (torch "
        f"{torch.__version__}, one thread, {host}, {time.strftime('%Y-%m-%d')}).",
        "Network units (`network_of(est).decompose`). `contrib`: the worst absolute error "
        "of one contribution over queries, training points and outputs, against a "
        f"float64 reference of the same recorded path ({REF_NODES} Gauss-Legendre nodes "
        "per step; float32 paths cast to float64). `tol*S`: the error the tolerance "
        "allows the sum (S the largest |f| along the path, as the node choice uses it). "
        "`estimate`: `Decomposition.contribution_error`, the check's own figure "
        "(`est/contrib` against the reference's). "
        "`cancel`: the largest `sum_i |a_i| / |sum_i a_i|` over queries and outputs.",
        "",
    ]
    val = validate()
    lines += ["Reference check (tiny tanh (5,) MLP, 20 points, 40 epochs, float64): the "
              f"{REF_NODES}-node decomposition against audit_exact's torch.optim replay "
              "with per-sample shares and 64-node jacrev quadrature:", "",
              "| solver | steps | max abs diff | max abs contribution |", "|---|---|---|---|"]
    lines += [f"| {s} | {n} | {d:.1e} | {m:.2g} |" for s, n, d, m in val]
    lines += ["", "| case | tol | nodes (median/max) | error | tol*S | contrib | "
              "contrib/error | contrib/(tol*S) | estimate | est/contrib | sum err vs ref | "
              "cancel | warned | cpu s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, Est, make, params in CASES:
        if selected and not any(s in name for s in selected):
            continue
        X, y, Xq = make()
        est = Est(**{**BASE, **params})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        ref = reference(network_of(est), Xq)
        scale = None
        for tol in TOLS:
            res, msgs, cpu = measure(est, Xq, tol)
            err = np.abs(res.contributions - ref.contributions).max()
            sum_err = np.abs(res.contributions.sum(1) - ref.contributions.sum(1)).max()
            f_path = float(np.abs(np.r_[res.initial.ravel(), res.prediction.ravel()]).max())
            scale = f_path if scale is None else scale
            allowed = res.tol * _path_scale(est, Xq)
            nodes = res.n_nodes
            row = (f"| {name} | {'default' if tol is None else tol} ({res.tol:.0e}) | "
                   f"{int(np.median(nodes))}/{int(nodes.max())} | {res.error:.1e} | "
                   f"{allowed:.1e} | {err:.1e} | {err / max(res.error, 1e-300):.2g} | "
                   f"{err / allowed:.2g} | {res.contribution_error:.1e} | "
                   f"{res.contribution_error / max(err, 1e-300):.2g} | {sum_err:.1e} | "
                   f"{cancellation(ref.contributions):.3g} | "
                   f"{', '.join(sorted(set(msgs))) or 'no'} | {cpu:.1f} |")
            print(row, flush=True)
            lines.append(row)
    lines.append("")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    if selected:  # a run of some cases says which
        lines.insert(3, "Cases run: those whose names contain "
                     + ", ".join(f"`{s}`" for s in selected) + ".")
    with open(OUT, "w") as fh:
        fh.write("\n".join(lines))


def _path_scale(est, Xq):
    """S: the largest |f| of the queries along the recorded path (network units)."""
    net = network_of(est)
    traj = net.trajectory
    Xt = net.tensor(Xq)
    best = 0.0
    with torch.no_grad():
        for k in range(len(traj)):
            params = dict(traj.unflatten(traj.parameters(k)))
            best = max(best, float(forward(net.module, params, Xt).abs().max()))
    return best


def floor(name="full-batch Adam, 4000 it"):
    """Quadrature or round-off? The case's contribution errors with fixed node counts
    (appended to the results file)."""
    _, Est, make, params = next(c for c in CASES if name in c[0])
    X, y, Xq = make()
    est = Est(**{**BASE, **params})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X, y)
    ref = reference(network_of(est), Xq).contributions
    lines = ["", f"Quadrature or round-off: *{name}* (float64) with fixed node counts "
             "against the same reference (`python benchmarks/audit_contribution_error.py "
             "--floor`):", "", "| nodes | contrib | estimate | max abs contribution | "
             "error |", "|---|---|---|---|---|"]
    for n_nodes in (None, 8, 16, 32):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = network_of(est).decompose(Xq, n_nodes=n_nodes)
        lines.append(f"| {'adaptive (default tol)' if n_nodes is None else n_nodes} | "
                     f"{np.abs(res.contributions - ref).max():.1e} | "
                     f"{res.contribution_error:.1e} | "
                     f"{np.abs(res.contributions).max():.3g} | {res.error:.1e} |")
        print(lines[-1], flush=True)
    with open(OUT, "a") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--floor"]:
        floor()
    else:
        main(sys.argv[1:])
