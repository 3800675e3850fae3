"""Figure 9: classification and kernel neighbourhoods for four optimizers.

The neighbourhoods are those of each optimizer's own kernel, the optimizer-weighted step
kernel ``K_t = J_t D_t J_t^T`` of THEORY.md (``D_t`` the identity for SGD and SGD with
momentum, Adam's and RMSprop's diagonal preconditioner otherwise), normalized; the plain
tangent kernel ``J_t J_t^T`` is reported next to it.
"""

from __future__ import annotations

import numpy as np

from ..kernels import step_kernel
from ..plotting import KernelNeighborsDisplay
from ._common import (
    circle_data,
    circle_fits,
    circle_settings,
    decision_regions,
    progress,
    quick_settings,
    save,
    subplots,
)
from ._fig1 import ANCHORS
from ._report import Row

OPTIMIZERS = ("sgd", "sgd+momentum", "adam", "rmsprop")


def kernel_neighbors(est, anchors, n_neighbors, *, step=-1, preconditioned=True):
    """Indices of each anchor's nearest training points under the normalized step kernel."""
    K = step_kernel(est, anchors, est.X_fit_, step=step, preconditioned=preconditioned,
                    normalized=True)
    return np.argsort(-K, axis=1, kind="stable")[:, :n_neighbors]


def purer_than_euclidean(accuracies, purities, euclidean) -> bool:
    """The claim: every optimizer classifies (>= 0.9) and its kernel's neighbourhoods are
    purer than the Euclidean ones."""
    return min(accuracies) >= 0.9 and all(p > e for p, e in zip(purities, euclidean))


def figure9_section(ctx):
    """Decision regions (a-d) and final-step K_t neighbours (e-h) per optimizer."""
    n, epochs, n_neighbors, _ = circle_settings(ctx)
    reduced = quick_settings(ctx, f"{n} points, {epochs} epochs, {n_neighbors} neighbours "
                                  "(the full run: 1000, 1000, 100)")
    X, y, X_test, y_test = circle_data(ctx)
    details, accs, purities, eucls = [], [], [], []
    eucl_nb = np.argsort(((ANCHORS[:, None] - X[None]) ** 2).sum(-1), axis=1,
                         kind="stable")[:, :n_neighbors]
    eucl = float(np.mean(KernelNeighborsDisplay(X, y, ANCHORS, eucl_nb).purity()))
    with progress("figure 9", len(OPTIMIZERS)) as tick:
        fits = circle_fits(ctx, OPTIMIZERS)
        fig, axes = subplots(2, 4, figsize=(18, 9))
        for col, (name, est) in enumerate(fits.items()):
            acc = est.score(X_test, y_test)
            decision_regions(axes[0, col], est.decision_function, X, y,
                             title=f"({'abcd'[col]}) {name}: test acc {acc:.3f}")
            disp = KernelNeighborsDisplay(
                X, y, ANCHORS, kernel_neighbors(est, ANCHORS, n_neighbors)
            ).plot(ax=axes[1, col])
            purity = float(np.mean(disp.purity()))
            plain = float(np.mean(KernelNeighborsDisplay(
                X, y, ANCHORS, kernel_neighbors(est, ANCHORS, n_neighbors,
                                                preconditioned=False)).purity()))
            axes[1, col].set_title(f"({'efgh'[col]}) {name}: {n_neighbors} nearest under "
                                   f"final K_hat (J D J^T), purity {purity:.2f}",
                                   fontsize="small")
            accs.append(acc)
            purities.append(purity)
            eucls.append(eucl)
            details.append({"optimizer": name, "test acc": f"{acc:.3f}",
                            "purity J D J^T": f"{purity:.2f}",
                            "purity J J^T": f"{plain:.2f}",
                            "Euclidean purity": f"{eucl:.2f}"})
            tick(name)
        png = save(ctx, fig, "fig9_optimizers.png")
    return [Row(
        "9", "every optimizer (SGD, SGDM, Adam, RMSprop) classifies the circle (>= 0.9) and "
        "the final neighbourhoods of its own normalized kernel K_t = J D_t J^T are purer than "
        "Euclidean ones",
        f"lowest test accuracy {min(accs):.3f}; mean purity K_t/Euclidean: "
        + ", ".join(f"{n} {p:.2f}/{e:.2f}" for n, p, e in zip(OPTIMIZERS, purities, eucls))
        + f"{reduced} [{png}]",
        purer_than_euclidean(accs, purities, eucls), details=details,
    )]
