"""Figure 1: kernel neighbourhoods of anchors sharpen into label-homogeneous sets."""

from __future__ import annotations

import numpy as np

from ._common import (
    circle_data,
    circle_fit,
    circle_settings,
    decision_regions,
    progress,
    purity_table,
    save,
    steps_per_epoch,
    subplots,
)
from ._report import Row

# Anchors close to the gap between the disk (radius sqrt(0.8) = 0.89) and the circle:
# where Euclidean neighbourhoods mix both classes.
ANCHORS = np.array([[0.95, 0.0], [-0.66, 0.66], [0.05, -0.93]])


def figure1_section(ctx):
    """Neighbour purity under K_hat_t at init / ~10 % of training / end versus Euclidean."""
    from ..plotting import KernelNeighborsDisplay

    _, epochs, n_neighbors, mid = circle_settings(ctx)
    X, y, X_test, y_test = circle_data(ctx)
    with progress("figure 1", 6) as tick:
        est = circle_fit(ctx, "sgd")
        tick("fit")
        mid_point = int(np.searchsorted(est.trajectory_.steps, mid * steps_per_epoch(ctx)))
        fig, axes = subplots(2, 3, figsize=(13, 8.8))
        ax = axes[0, 0]
        ax.scatter(X[:, 0], X[:, 1], c=y, cmap="coolwarm", s=5)
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_title("(a) circle (+1) vs disk x1²+x2² ≤ 0.8 (-1)", fontsize="small")
        decision_regions(axes[0, 1], est.decision_function, X, y,
                         title="(b) minibatch SGD decision regions after training")
        tick("regions")
        panels = {
            "Euclidean": dict(kernel="euclidean"),
            "init": dict(step=0),
            f"epoch {mid}": dict(step=mid_point),
            f"end (epoch {epochs})": dict(step=-1),
        }
        displays = {}
        for ax, (name, kw), letter in zip(axes.ravel()[2:], panels.items(), "cdef"):
            displays[name] = KernelNeighborsDisplay.from_estimator(
                est, ANCHORS, n_neighbors, y=y, ax=ax, **kw)
            ax.set_title(f"({letter}) {name}: " + displays[name].title, fontsize="x-small")
            tick(name)
        png = save(ctx, fig, "fig1_neighbourhoods.png")
    purity = purity_table(displays)
    end, init, eucl = purity[f"end (epoch {epochs})"], purity["init"], purity["Euclidean"]
    acc = est.score(X_test, y_test)
    measured = ", ".join(f"{k} {v:.2f}" for k, v in purity.items())
    return [
        Row("1b", "minibatch SGD separates the circle from the disk", f"test accuracy {acc:.3f}",
            acc >= 0.9),
        Row("1c-f",
            f"training sharpens the {n_neighbors} normalized-kernel neighbours of anchors "
            "into label-homogeneous sets (purity at the end above init and Euclidean)",
            f"mean label purity: {measured} [{png}]",
            end > init and end > eucl,
            details=[{"anchor": f"({a[0]:.2f}, {a[1]:.2f})",
                      **{k: f"{d.purity()[i]:.2f}" for k, d in displays.items()}}
                     for i, a in enumerate(ANCHORS)]),
    ]
