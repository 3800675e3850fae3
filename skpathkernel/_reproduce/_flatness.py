"""Flatness (seed 004) of the circle task's solutions, by optimizer (figure 9's four).

Reports the Hutchinson trace of the training-loss Hessian at the end of training and at a
few points along the path, next to the test accuracy. The rows only report numbers: the
seed's claim (the flattest interpolators generalize) is about interpolators of a
multi-index model, not a threshold this task could pass or fail.
"""

from __future__ import annotations

from ._report import Row
from ._training import _SOLVERS

_OPTIMIZERS = ("sgd", "sgd+momentum", "adam", "rmsprop")


def flatness_section(ctx):
    """Fit PathKernelClassifier on the circle task per optimizer; Tr H along its path."""
    from .. import PathKernelClassifier
    from ..datasets import make_circle
    from ..diagnostics import hessian_trace_path

    # Quick mode must stay under 20 s on 2 CPU cores, training included.
    if ctx.quick:
        n, epochs, hidden, n_points, n_probes = 200, 200, (32, 32), 4, 50
    else:
        n, epochs, hidden, n_points, n_probes = 1000, 2000, (64, 64), 6, 200
    X, y = make_circle(n_samples=n, inner_radius_sq=0.8, random_state=0)
    X_test, y_test = make_circle(n_samples=n, inner_radius_sq=0.8, random_state=1)
    rows = []
    for name in _OPTIMIZERS:
        clf = PathKernelClassifier(
            hidden_layer_sizes=hidden, max_iter=epochs, device=ctx.device,
            random_state=0, **_SOLVERS[name],
        ).fit(X, y)
        acc = clf.score(X_test, y_test)
        path = hessian_trace_path(clf, steps=n_points, n_samples=n_probes, random_state=0)
        end = path[-1]
        rows.append(Row(
            figure="9 / seed 004",
            claim=f"flatness: Tr H of the training loss at the end of training, {name}",
            measured=(f"Tr H = {end.trace:.4g} +- {end.stderr:.2g}; test acc {acc:.3f}; "
                      f"train loss {clf.loss_curve_[-1]:.3g}"),
            passed=None,
            details=[
                {"optimizer": name, "optimizer step": int(s), "Tr H": f"{t:.4g}",
                 "stderr": f"{se:.2g}"}
                for s, t, se in zip(path.optimizer_steps, path.trace, path.stderr)
            ],
        ))
    return rows
