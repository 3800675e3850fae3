"""Figure 1: kernel neighbourhoods of anchors sharpen progressively into label-homogeneous
sets."""

from __future__ import annotations

import numpy as np

from ..plotting import KernelNeighborsDisplay
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
# Where "progressively" is measured: the paper's panels (init, epoch 200 of 1000, end)
# and the fifths of training in between.
CHECKPOINTS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def sharpens_progressively(purities, euclidean, n_neighbors) -> bool:
    """The claim: mean purity never drops by more than one neighbour per anchor
    (``1 / n_neighbors``) from a checkpoint to the next, and ends above both its
    initial value and the Euclidean neighbourhoods'."""
    p = np.asarray(purities, dtype=float)
    steady = bool(np.all(np.diff(p) >= -1.0 / n_neighbors))
    return steady and p[-1] > p[0] and p[-1] > euclidean


def checkpoint_purities(est, y, n_neighbors, points):
    """Mean neighbour purity of the anchors under K_hat at each recorded point."""
    X = est.X_fit_
    out = []
    for k in points:
        nb = est.kneighbors(ANCHORS, n_neighbors, step=int(k), return_distance=False)
        out.append(float(np.mean(KernelNeighborsDisplay(X, y, ANCHORS, nb).purity())))
    return out


def figure1_section(ctx):
    """Neighbour purity under K_hat_t at six checkpoints versus Euclidean neighbourhoods."""
    _, epochs, n_neighbors, mid = circle_settings(ctx)
    X, y, X_test, y_test = circle_data(ctx)
    with progress("figure 1", 7) as tick:
        est = circle_fit(ctx, "sgd")
        tick("fit")
        steps = est.trajectory_.steps
        spe = steps_per_epoch(ctx)
        ck_epochs = [int(round(f * epochs)) for f in CHECKPOINTS]
        points = [min(int(np.searchsorted(steps, e * spe)), len(steps) - 1) for e in ck_epochs]
        mid_point = points[ck_epochs.index(mid)]
        fig, axes = subplots(2, 4, figsize=(17, 8.8), layout="constrained")
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
            ax.set_title(f"({letter}) {name}:\n" + displays[name].title, fontsize="x-small")
            tick(name)
        purities = checkpoint_purities(est, y, n_neighbors, points)
        eucl = purity_table(displays)["Euclidean"]
        ax = axes[1, 2]
        ax.plot(ck_epochs, purities, "o-", label="normalized tangent kernel")
        ax.axhline(eucl, color="grey", ls="--", label="Euclidean")
        ax.set(xlabel="epoch", ylabel="mean neighbour purity",
               title="(g) purity at the checkpoints")
        ax.legend(fontsize="small")
        axes[1, 3].axis("off")
        tick("checkpoints")
        png = save(ctx, fig, "fig1_neighbourhoods.png")
    acc = est.score(X_test, y_test)
    measured = ", ".join(f"epoch {e} {p:.3f}" for e, p in zip(ck_epochs, purities))
    return [
        Row("1b", "minibatch SGD separates the circle from the disk", f"test accuracy {acc:.3f}",
            acc >= 0.9),
        Row("1c-f",
            f"training progressively sharpens the {n_neighbors} normalized-kernel neighbours "
            "of anchors into label-homogeneous sets: mean purity at init, 20/40/60/80 % and "
            f"the end of training never drops by more than 1/{n_neighbors} between "
            "checkpoints and ends above init and Euclidean",
            f"mean label purity: Euclidean {eucl:.3f}, {measured} [{png}]",
            sharpens_progressively(purities, eucl, n_neighbors),
            details=[{"anchor": f"({a[0]:.2f}, {a[1]:.2f})",
                      **{k: f"{d.purity()[i]:.2f}" for k, d in displays.items()}}
                     for i, a in enumerate(ANCHORS)]),
    ]
