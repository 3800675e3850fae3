"""Figure 9: classification and tangent-kernel neighbourhoods for four optimizers."""

from __future__ import annotations

import numpy as np

from ._common import (
    circle_data,
    circle_fit,
    circle_settings,
    decision_regions,
    progress,
    save,
    subplots,
)
from ._fig1 import ANCHORS
from ._report import Row

OPTIMIZERS = ("sgd", "sgd+momentum", "adam", "rmsprop")


def figure9_section(ctx):
    """Decision regions (a-d) and final-step kernel neighbours (e-h) per optimizer."""
    from ..plotting import KernelNeighborsDisplay

    _, _, n_neighbors, _ = circle_settings(ctx)
    X, y, X_test, y_test = circle_data(ctx)
    details, accs, purities, eucls = [], [], [], []
    with progress("figure 9", len(OPTIMIZERS)) as tick:
        fig, axes = subplots(2, 4, figsize=(18, 9))
        for col, name in enumerate(OPTIMIZERS):
            est = circle_fit(ctx, name)
            acc = est.score(X_test, y_test)
            decision_regions(axes[0, col], est.decision_function, X, y,
                             title=f"({'abcd'[col]}) {name}: test acc {acc:.3f}")
            disp = KernelNeighborsDisplay.from_estimator(est, ANCHORS, n_neighbors, y=y,
                                                         ax=axes[1, col])
            purity = float(np.mean(disp.purity()))
            eucl = float(np.mean(KernelNeighborsDisplay(
                X, y, ANCHORS, np.argsort(((ANCHORS[:, None] - X[None]) ** 2).sum(-1),
                                          axis=1, kind="stable")[:, :n_neighbors]).purity()))
            axes[1, col].set_title(f"({'efgh'[col]}) {name}: {n_neighbors} nearest under "
                                   f"final K_hat, purity {purity:.2f}", fontsize="small")
            accs.append(acc)
            purities.append(purity)
            eucls.append(eucl)
            details.append({"optimizer": name, "test acc": f"{acc:.3f}",
                            "kernel neighbour purity": f"{purity:.2f}",
                            "Euclidean purity": f"{eucl:.2f}"})
            tick(name)
        png = save(ctx, fig, "fig9_optimizers.png")
    return [Row(
        "9", "every optimizer (SGD, SGDM, Adam, RMSprop) classifies the circle (>= 0.9) and "
        "its final kernel neighbourhoods are purer than Euclidean ones",
        f"lowest test accuracy {min(accs):.3f}; mean purity kernel/Euclidean: "
        + ", ".join(f"{n} {p:.2f}/{e:.2f}" for n, p, e in zip(OPTIMIZERS, purities, eucls))
        + f" [{png}]",
        min(accs) >= 0.9 and all(p > e for p, e in zip(purities, eucls)), details=details,
    )]
