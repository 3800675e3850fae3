"""Flatness of the circle task's solutions, by optimizer (figure 9's four).

Reports the Hutchinson trace of the training-loss Hessian at the end of training and at a
few points along the path, next to the test accuracy. The rows only report numbers: the
flatness paper's claim (the flattest interpolators generalize) is about interpolators of a
multi-index model, not a threshold this task could pass or fail.
"""

from __future__ import annotations

from ..diagnostics import hessian_trace_path
from ._common import circle_data, circle_fits
from ._report import Row

_OPTIMIZERS = ("sgd", "sgd+momentum", "adam", "rmsprop")


def flatness_section(ctx):
    """Tr H along the path of figure 9's circle-task networks (shared with figures 1, 9, 10)."""
    n_points, n_probes = (4, 50) if ctx.quick else (6, 200)
    _, _, X_test, y_test = circle_data(ctx)
    rows = []
    for name, clf in circle_fits(ctx, _OPTIMIZERS).items():
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
