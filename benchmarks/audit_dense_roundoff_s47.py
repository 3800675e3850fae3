"""The dense route's float32 round-off estimate against the float64 reference (s47).

``decompose``'s dense route (Jacobians at the nodes; the route the tests check the
others against, reached with ``_route`` forced) took no round-off estimate on a float32
path: its ``contribution_error`` was the two rules' difference alone. It now adds
``ROUNDOFF * eps32 * sum_t |share_t|`` from its own sums of the shares' sizes, as the
adjoint and factor routes do. Per case, relative to S (the largest |f| along the path,
units of 1e-6 * S): ``true``, the largest error of one contribution of the dense
float32 decomposition against the float64 12-node decomposition of the same recorded
path (points and optimizer states cast to float64); ``before``: the difference alone
(what the dense route reported); ``after``: its contribution_error now; the adjoint
(default) route's true error and contribution_error on the same path. Deterministic (no
timing). The dense route's adjoint is float64 as of this audit's commit: with the
float32 one it had (a full P-vector per query output carried through every step), the
route's own error was 0.0465-4.64, over its estimate on seed2 (4.64 against 3.93; the
table below the main one, from this script's run before that change). On Adam paths
the float64 reference itself does not close exactly (its float64 gradients rebuild
steps the float32 training did not take: ``contribution_roundoff-s46.md``, ``R``), so
``true`` carries that too.

Run: OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.audit_dense_roundoff_s47
(writes benchmarks/results/dense_roundoff-s47.md)
"""

import copy
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning

import skpathkernel._analysis._decomposition as module
from benchmarks.audit_contribution_roundoff import _full_batch_adam
from skpathkernel import PathKernelClassifier
from skpathkernel._analysis._decomposition import decompose
from skpathkernel._network._trained import network_of
from skpathkernel._path._trajectory import Trajectory

ROOT = Path(__file__).resolve().parent.parent
BEFORE = [
    "| case | dense true | dense before (difference alone) | dense after | after >= true "
    "| adjoint true | adjoint estimate |",
    "|---|---|---|---|---|---|---|",
    "| converged full-batch Adam f32 seed0, 2 training points | 2.63 | 0.235 | 3.88 | yes "
    "| 1.5 | 3.66 |",
    "| converged full-batch Adam f32 seed1, 2 training points | 1.05 | 0.0691 | 1.87 | yes "
    "| 1.1 | 1.87 |",
    "| converged full-batch Adam f32 seed2, 2 training points | 4.64 | 0.121 | 3.93 | no "
    "| 1.73 | 3.94 |",
    "| digits default classifier f32, 10 epochs, 20 queries | 0.0465 | 0.0215 | 0.124 | yes "
    "| 0.0297 | 0.112 |",
]


def _adam(seed):
    est, X, y, _ = _full_batch_adam(seed)
    est.set_params(dtype="float32").fit(X, y)
    return est, network_of(est)._training_data()[0][:2].double().numpy()


def _digits():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    est = PathKernelClassifier(max_iter=10, random_state=0).fit(X[:300], y[:300])
    return est, X[300:320]


def _reference(est, Xq):
    net = network_of(est)
    payload = net.trajectory._payload()
    payload["params"] = payload["params"].double()
    payload["states"] = {k: v.double() for k, v in payload["states"].items()}
    X_fit, Y_fit = net._training_data()
    Y_fit = Y_fit.double() if Y_fit.is_floating_point() else Y_fit
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(payload, Path(tmp) / "path.pt")
        ref, _ = decompose(copy.deepcopy(net.module).double(),
                           Trajectory.load(str(Path(tmp) / "path.pt")), X_fit.double(),
                           Y_fit, net.loss, torch.as_tensor(Xq, dtype=torch.float64),
                           n_nodes=12, warn=False)
    return ref.contributions


def _decomposed(est, Xq, route):
    net = network_of(est)
    X_fit, Y_fit = net._training_data()
    real = module._route
    if route == "dense":
        module._route = lambda traj, method: "dense"
    try:
        return decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss,
                         net.tensor(Xq), warn=False)
    finally:
        module._route = real


def main():
    torch.set_num_threads(1)
    cases = {f"converged full-batch Adam f32 seed{s}, 2 training points": (_adam, s)
             for s in range(3)}
    cases["digits default classifier f32, 10 epochs, 20 queries"] = (_digits, None)
    rows = []
    for name, (make, arg) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            est, Xq = make(arg) if arg is not None else make()
        ref = _reference(est, Xq)
        (dense, checks), (adjoint, _) = (_decomposed(est, Xq, r) for r in ("dense", "adj"))
        S = checks.scale  # the network's units: contributions of a classifier are too
        miss = np.abs(dense.contributions - ref).max()
        true, adjoint_true = (miss / S / 1e-6,
                              np.abs(adjoint.contributions - ref).max() / S / 1e-6)
        rows.append(f"| {name} | {true:.3g} | {checks.difference / S / 1e-6:.3g} | "
                    f"{dense.contribution_error / S / 1e-6:.3g} | "
                    f"{'yes' if dense.contribution_error >= miss else 'no'} | "
                    f"{adjoint_true:.3g} | {adjoint.contribution_error / S / 1e-6:.3g} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# The dense route's float32 round-off estimate (s47)", "",
        f"`OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.audit_dense_roundoff_s47`, "
        f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}. Units of 1e-6 * S.", "",
        "| case | dense true | dense before (difference alone) | dense after | "
        "after >= true | adjoint true | adjoint estimate |",
        "|---|---|---|---|---|---|---|", *rows, "",
        "Before the dense route's float64 adjoint (its float32 one; the same script, run "
        "at the same commit less that change, load 7.0):", "", *BEFORE, ""])
    (ROOT / "benchmarks" / "results" / "dense_roundoff-s47.md").write_text(text)


if __name__ == "__main__":
    main()
