"""Where ``Decomposition.contribution_error`` is not an upper estimate: kinks, large steps.

``contribution_error`` is the largest difference of one contribution between each step's
Gauss-Legendre rule of n nodes and the rule of n + 1, taken as the error of the rule
returned (the n + 1). That holds where a node more at least halves the error. Two cases
where it does not:

- a ReLU kink on a step's segment, at ``s = c`` before the first node of both rules
  (0.113 for 3 nodes, 0.069 for 4): both rules see only the integrand after the kink (a
  low-degree polynomial there, integrated exactly by both), so they agree to round-off
  while each misses the piece ``[0, c]``. The step's SUM sees the kink too, but where the
  points' parts of the step cancel (pairs of points with opposite targets) its residual
  can pass the tolerance while each point's share misses by far more. The query is
  placed so that a hidden unit's pre-activation crosses 0 at ``c`` on the path's one step;
  ``c = 0.3`` is a kink between nodes, for comparison.
- RMSprop's first step at lr 0.2 (every parameter moves by about 2), where a node more
  gains little: the difference of the two rules is under the returned rule's error.

Reference, independent of the package: ``audit_exact.Replay`` (a plain torch.optim
replay, each point's part of every step from per-sample autograd gradients), and each
query's Jacobian averaged over the recorded segment with ``torch.func.jacrev``: for the
ReLU network on the pieces between the first layer's kinks (the query's pre-activations
are linear in s), 8 Gauss-Legendre nodes per piece, exact there; for the smooth one
48-node Gauss-Legendre over the segment.

Beside them, whether the check of a step's sum (the warning that contribution_error
does not measure the error) fires on ordinary paths: the estimators' defaults on digits
and diabetes (float32), a small CNN, and float64 paths with momentum and weight decay,
Nesterov, Adam, AdamW, RMSprop and normalize_y with sample weights.

Run: taskset -c 1 python benchmarks/audit_contribution_kink.py
(results: benchmarks/results/contribution_error_kink.md)
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from torch.func import jacrev

sys.path.insert(0, os.path.dirname(__file__))
import audit_exact

from skpathkernel import PathKernelMachine

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_error_kink.md")
SMOOTH_NODES = 48


def segment_rule(rep, x, a, b, relu):
    """Nodes and weights on [0, 1] that integrate the query's Jacobian exactly (ReLU:
    split at the first layer's kinks) or to round-off (smooth)."""
    s, w = np.polynomial.legendre.leggauss(8 if relu else SMOOTH_NODES)
    s, w = (s + 1) / 2, w / 2
    if not relu:
        return list(zip(s, w))

    def pre(theta):
        W = theta[:rep.sizes[0]].reshape(rep.shapes[0])
        bias = theta[rep.sizes[0]:rep.sizes[0] + rep.sizes[1]]
        return (x @ W.T + bias)[0]

    z0, z1 = pre(a), pre(b)
    d = z1 - z0
    kinks = sorted(float(c) for c in (-z0[d != 0] / d[d != 0]).tolist() if 0 < c < 1)
    edges = [0.0] + kinks + [1.0]
    return [(lo + (hi - lo) * sk, (hi - lo) * wk)
            for lo, hi in zip(edges[:-1], edges[1:]) for sk, wk in zip(s, w)]


def reference(est, Y, Xq, relu):
    rep = audit_exact.Replay(est, Y, np.ones(len(Y)), track_shares=True)
    traj = est.trajectory_
    thetas = [torch.cat([traj.state_dict(k)[n].double().reshape(-1) for n in rep.names])
              for k in range(len(traj))]
    assert max(float((t - r).abs().max()) for t, r in zip(thetas, rep.thetas)) < 1e-12
    Xq = torch.as_tensor(Xq, dtype=torch.float64)
    out = 0
    for t, share in enumerate(rep.shares):
        a, b = thetas[t], thetas[t + 1]
        J = torch.stack([sum(wk * jacrev(lambda th, x=x: rep.f(th, x))(a + sk * (b - a))
                             for sk, wk in segment_rule(rep, x, a, b, relu))[0]
                         for x in Xq.split(1)])
        out = out + torch.einsum("qcp,ip->qic", J, share)
    S = max(float(rep.f(th, Xq).abs().max()) for th in thetas)
    return out.numpy(), S


def kink_case(c):
    """Full-batch plain SGD, one step, pairs of points with opposite targets; a query
    whose hidden unit (the one of largest output weight) crosses 0 at s = c."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(6, 2))
    X, y = np.vstack([x, x]), np.r_[5 * np.ones(6), -5 * np.ones(6)]
    est = PathKernelMachine(
        solver="sgd", momentum=0.0, alpha=0.0, batch_size=12, learning_rate_init=0.05,
        max_iter=1, tol=None, normalize_y=False, n_iter_no_change=10**6, dtype="float64",
        random_state=0, hidden_layer_sizes=(8,), activation="relu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X, y)
    sd0, sd1 = (list(est.trajectory_.state_dict(k).values()) for k in (0, 1))
    W0, b0, w2 = sd0[0].double().numpy(), sd0[1].double().numpy(), sd0[2].double().numpy()
    W1, b1 = sd1[0].double().numpy(), sd1[1].double().numpy()
    k = int(np.argmax(np.abs(w2[0])))
    x0, u = rng.normal(size=2), W0[k] / np.linalg.norm(W0[k])
    Wc, bc = W0[k] + c * (W1[k] - W0[k]), b0[k] + c * (b1[k] - b0[k])
    xq = x0 - (Wc @ x0 + bc) / (Wc @ u) * u  # on the unit's kink at s = c
    return est, y, xq[None], True


def large_step_case():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(
        solver="rmsprop", batch_size=6, learning_rate_init=0.2, max_iter=1, tol=None,
        normalize_y=False, n_iter_no_change=10**6, dtype="float64", random_state=0,
        hidden_layer_sizes=(16,), activation="tanh", alpha=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X, y)
    return est, y, X[:3] + 0.1, False


def ordinary():
    """(name, estimator, X, y, queries) of paths whose steps a node more does gain on."""
    from sklearn.datasets import load_diabetes, load_digits

    from skpathkernel import PathKernelClassifier

    X, y = load_digits(return_X_y=True)
    X, y = X[:300] / 16, y[:300]
    Xd, yd = load_diabetes(return_X_y=True)
    Xd, yd = Xd[:300], yd[:300]

    def cnn(i, o):
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 4, 3), torch.nn.Tanh(),
            torch.nn.Flatten(), torch.nn.Linear(144, o))

    yield "digits classifier, defaults, 10 ep", PathKernelClassifier(
        max_iter=10, random_state=0), X, y, X[:20]
    yield "digits classifier, defaults, 30 ep", PathKernelClassifier(
        max_iter=30, random_state=1), X, y, X[:16]
    yield "digits classifier, SGD with momentum", PathKernelClassifier(
        solver="sgd", max_iter=10, random_state=0), X, y, X[:16]
    yield "digits classifier, tanh, RMSprop", PathKernelClassifier(
        solver="rmsprop", activation="tanh", max_iter=10, random_state=0), X, y, X[:16]
    yield "digits classifier, small CNN", PathKernelClassifier(
        module=cnn, max_iter=5, random_state=0), X, y, X[:10]
    yield "diabetes regressor, defaults, 10 ep", PathKernelMachine(
        max_iter=10, random_state=0), Xd, yd, Xd[:20]
    yield "diabetes regressor, defaults, 40 ep", PathKernelMachine(
        max_iter=40, random_state=1), Xd, yd, Xd[:16]
    yield "diabetes regressor, full-batch SGD", PathKernelMachine(
        solver="sgd", momentum=0.0, batch_size=300, max_iter=30, random_state=0), Xd, yd, Xd[:16]
    yield "diabetes regressor, float64", PathKernelMachine(
        max_iter=10, random_state=0, dtype="float64"), Xd, yd, Xd[:20]
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    base = dict(solver="sgd", momentum=0.0, alpha=0.0, batch_size=8, learning_rate_init=0.05,
                max_iter=5, tol=None, normalize_y=False, n_iter_no_change=10**6,
                dtype="float64", random_state=0, hidden_layer_sizes=(16,),
                activation="gelu")
    for name, kw in [("momentum 0.9, weight decay", dict(momentum=0.9, alpha=1e-2)),
                     ("Nesterov", dict(momentum=0.9, nesterovs_momentum=True)),
                     ("Adam first step, lr 0.1", dict(solver="adam", batch_size=6,
                                                      learning_rate_init=0.1, max_iter=1)),
                     ("AdamW, tanh", dict(solver="adamw", alpha=0.05, batch_size=6,
                                          activation="tanh", max_iter=3)),
                     ("RMSprop first step, lr 0.05", dict(solver="rmsprop", batch_size=6,
                                                          max_iter=1))]:
        yield f"gelu MLP, float64, {name}", PathKernelMachine(**{**base, **kw}), X, y, X[:3]
    yield "gelu MLP, float64, normalize_y", PathKernelMachine(
        **{**base, "normalize_y": True, "solver": "adam"}), X, 10 * y + 3, X[:3]


def main():
    cases = [("ReLU kink at s = 0.01, cancelling pairs", kink_case(0.01),
              ({}, {"tol": 1e-6}, {"tol": 1e-4}, {"n_nodes": 3})),
             ("ReLU kink at s = 0.3, cancelling pairs", kink_case(0.3),
              ({}, {"tol": 1e-6}, {"tol": 1e-4}, {"n_nodes": 3})),
             ("RMSprop first step, tanh MLP, lr 0.2", large_step_case(),
              ({}, {"tol": 1e-6}, {"tol": 1e-3}))]
    rows = []
    for name, (est, y, Xq, relu), calls in cases:
        ref, S = reference(est, torch.as_tensor(y, dtype=torch.float64).reshape(-1, 1),
                           Xq, relu)
        for kw in calls:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                res = est.decompose(Xq, **kw)
            true = float(np.abs(res.contributions - ref.reshape(res.contributions.shape)).max())
            allowed = (res.tol if res.tol is not None else 1e-10) * S
            caught = [w for w in rec if issubclass(w.category, ConvergenceWarning)]
            said = " ".join(str(w.message) for w in caught)
            warned = ("over tol" if "single contribution's quadrature error" in said
                      else "not measured" if "does not measure" in said
                      else "steps failed" if "did not reach" in said
                      else "sum only" if caught else "no")
            rows.append((name, ", ".join(f"{k}={v}" for k, v in kw.items()) or "default tol",
                         res.contribution_error, true, allowed, float(res.step_errors.max()),
                         f"{res.n_nodes.min()}-{res.n_nodes.max()}", warned))
            print(rows[-1], flush=True)
    quiet = []
    for name, est, X, y, Xq in ordinary():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        for kw in ({}, {"tol": 1e-6}) if est.dtype == "float64" else ({},):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                res = est.decompose(Xq, **kw)
            said = [str(w.message) for w in rec if issubclass(w.category, ConvergenceWarning)]
            quiet.append((name, ", ".join(f"{k}={v}" for k, v in kw.items()) or "default tol",
                          res.contribution_error,
                          "yes" if any("does not measure" in m for m in said) else "no",
                          len(said)))
            print(quiet[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    with open(OUT, "w") as fh:
        fh.write("# contribution_error where a node more does not halve the error\n\n")
        fh.write(f"`python benchmarks/audit_contribution_kink.py` at commit {commit} "
                 f"(torch {torch.__version__}, {platform.machine()}, one thread). "
                 "Reference: a plain torch.optim replay's per-point parts of each step, "
                 "each query's Jacobian integrated over the segment exactly (ReLU: "
                 f"between its kinks) or with {SMOOTH_NODES}-node Gauss-Legendre (see the "
                 "script). S: the query's largest |f| along the path; allowed: tol * S, "
                 "with fixed n_nodes 1e-10 * S. warned: over tol (the per-contribution "
                 "warning), not measured (a step's sum by the rule with a node more "
                 "misses by over twice the two rules' difference), steps failed (the "
                 "quadrature's), sum only (the sums' residuals), no.\n\n")
        fh.write("| case | call | contribution_error | true error | true / "
                 "contribution_error | allowed | largest step residual | nodes | "
                 "warned |\n|---|---|---|---|---|---|---|---|---|\n")
        for name, call, ce, true, allowed, step, nodes, warned in rows:
            fh.write(f"| {name} | {call} | {ce:.3g} | {true:.3g} | "
                     f"{true / max(ce, 1e-300):.3g} | {allowed:.3g} | {step:.3g} | {nodes} | "
                     f"{warned} |\n")
        fh.write("\nOrdinary paths: whether the sum's check of the pair warns (the "
                 "warning that contribution_error does not measure the error), and the "
                 "ConvergenceWarnings in all.\n\n| path | call | contribution_error | "
                 "sum's check warned | ConvergenceWarnings |\n|---|---|---|---|---|\n")
        for name, call, ce, warned, n in quiet:
            fh.write(f"| {name} | {call} | {ce:.3g} | {warned} | {n} |\n")


if __name__ == "__main__":
    main()
