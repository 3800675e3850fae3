"""Training on Guo, He & Morel's circle task with each solver: the recorded path, measured."""

from __future__ import annotations

from ._common import CIRCLE_SOLVERS, circle_data, circle_fits, progress, save, subplots
from ._report import Row


def training_section(ctx):
    """Fit PathKernelClassifier on the circle task (figure 1a) with every solver.

    The fits are shared with figures 1, 9 and 10 through ``ctx.cache``.
    """
    _, _, X_test, y_test = circle_data(ctx)
    details, accuracies = [], []
    with progress("training", len(CIRCLE_SOLVERS)) as tick:
        fits = circle_fits(ctx, CIRCLE_SOLVERS)
        fig, ax = subplots(figsize=(6, 4))
        for name, clf in fits.items():
            acc = clf.score(X_test, y_test)
            accuracies.append(acc)
            traj = clf.trajectory_
            ax.semilogy(clf.loss_curve_, label=name)
            details.append({
                "solver": name,
                "final loss": f"{clf.loss_curve_[-1]:.4g}",
                "test acc": f"{acc:.3f}",
                "steps recorded": len(traj) - 1,
                "trajectory MiB": f"{traj.nbytes / 2**20:.1f}",
            })
            tick(name)
        ax.set_xlabel("epoch (minibatches of 32)")
        ax.set_ylabel("training loss")
        ax.legend(fontsize="small")
        png = save(ctx, fig, "training_loss.png")
    worst = min(accuracies)
    return [
        Row(
            figure="1a",
            claim="a 2-64-64-1 tanh MLP separates the circle from the inner disk, every solver",
            measured=f"lowest test accuracy over {len(CIRCLE_SOLVERS)} solvers: {worst:.3f} "
                     f"[{png}]",
            passed=worst >= 0.9,
            details=details,
        )
    ]
