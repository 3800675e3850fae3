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
    quick_settings,
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


def _drops(purities, n_neighbors):
    """Where a purity falls by more than one neighbour to the next checkpoint, counted in
    neighbours: as fractions, 31/40 - 32/40 < -1/40 in floating point, and a drop of one
    neighbour read as more than one for 24 of the 40 possible counts."""
    counts = np.rint(np.asarray(purities) * n_neighbors)
    return np.diff(counts, axis=0) < -1


def sharpens_progressively(purities, euclidean, n_neighbors) -> bool:
    """The claim, for each anchor's neighbourhood (the caption's "these kernel
    neighborhoods"): its purity never drops by more than one neighbour
    (``1 / n_neighbors``) from a checkpoint to the next and ends above its initial value;
    the mean purity ends above the Euclidean neighbourhoods'. ``purities``: (checkpoints,
    anchors). (The mean over the anchors alone, checked before, passed while one
    anchor's purity fell from 0.72 to 0.60.)"""
    p = np.asarray(purities, dtype=float).reshape(len(purities), -1)
    steady = not np.any(_drops(p, n_neighbors))
    return steady and bool(np.all(p[-1] > p[0])) and float(p[-1].mean()) > euclidean


def sharpening_misses(purities, euclidean, n_neighbors, labels, anchors=ANCHORS) -> str:
    """Where :func:`sharpens_progressively` fails: each anchor's drops of more than one
    neighbour, an anchor that does not end above its start, a mean below Euclidean."""
    p = np.asarray(purities, dtype=float).reshape(len(purities), -1)
    out = []
    for j, a in enumerate(anchors):
        name = f"anchor ({a[0]:.2f}, {a[1]:.2f})"
        for i in np.flatnonzero(_drops(p[:, j], n_neighbors)):
            out.append(f"{name} drops from {p[i, j]:.2f} to {p[i + 1, j]:.2f} between "
                       f"{labels[i]} and {labels[i + 1]}")
        if p[-1, j] <= p[0, j]:
            out.append(f"{name} ends at {p[-1, j]:.2f}, not above its {p[0, j]:.2f} at init")
    if p[-1].mean() <= euclidean:
        out.append(f"the mean ends at {p[-1].mean():.3f}, not above Euclidean {euclidean:.3f}")
    return "; ".join(out)


def checkpoint_purities(est, y, n_neighbors, points) -> np.ndarray:
    """Each anchor's neighbour purity under K_hat at each recorded point: (points, anchors)."""
    X = est.X_fit_
    out = []
    for k in points:
        nb = est.kneighbors(ANCHORS, n_neighbors, step=int(k), return_distance=False)
        out.append(KernelNeighborsDisplay(X, y, ANCHORS, nb).purity())
    return np.asarray(out, dtype=float)


def figure1_section(ctx):
    """Neighbour purity under K_hat_t at six checkpoints versus Euclidean neighbourhoods."""
    _, epochs, n_neighbors, mid = circle_settings(ctx)
    X, y, X_test, y_test = circle_data(ctx)
    reduced = quick_settings(ctx, f"{len(y)} points, {epochs} epochs, {n_neighbors} "
                                  "neighbours (the full run: 1000, 1000, 100)")
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
        ax.plot(ck_epochs, purities.mean(axis=1), "o-", label="normalized tangent kernel")
        for j, a in enumerate(ANCHORS):
            ax.plot(ck_epochs, purities[:, j], ":", lw=1,
                    label=f"anchor ({a[0]:.2f}, {a[1]:.2f})")
        ax.axhline(eucl, color="grey", ls="--", label="Euclidean")
        ax.set(xlabel="epoch", ylabel="neighbour purity",
               title="(g) purity at the checkpoints")
        ax.legend(fontsize="small")
        axes[1, 3].axis("off")
        tick("checkpoints")
        png = save(ctx, fig, "fig1_neighbourhoods.png")
    acc = est.score(X_test, y_test)
    measured = ", ".join(f"epoch {e} {p:.3f}" for e, p in zip(ck_epochs, purities.mean(1)))
    passed = sharpens_progressively(purities, eucl, n_neighbors)
    labels = ["init" if e == 0 else f"epoch {e}" for e in ck_epochs]
    return [
        Row("1b", "minibatch SGD separates the circle from the disk",
            f"test accuracy {acc:.3f}" + reduced, acc >= 0.9),
        Row("1c-f",
            f"training progressively sharpens the {n_neighbors} normalized-kernel neighbours "
            "of each anchor into label-homogeneous sets: its purity at init, 20/40/60/80 % "
            f"and the end of training never drops by more than 1/{n_neighbors} between "
            "checkpoints and ends above its init; the mean ends above Euclidean",
            f"mean label purity: Euclidean {eucl:.3f}, {measured}{reduced} [{png}]",
            passed,
            details=[{"anchor": f"({a[0]:.2f}, {a[1]:.2f})",
                      "Euclidean": f"{displays['Euclidean'].purity()[j]:.2f}",
                      **{lab: f"{purities[i, j]:.2f}" for i, lab in enumerate(labels)}}
                     for j, a in enumerate(ANCHORS)],
            reason=None if passed else sharpening_misses(purities, eucl, n_neighbors, labels)),
    ]
