"""Figure 2: fits of sin x and a square wave, and class blocks in the digits kernel."""

from __future__ import annotations

import numpy as np
from torch import nn

from .. import PathKernelClassifier, PathKernelMachine
from ..datasets import load_cifar10, make_sine, make_square_wave
from ..plotting import KernelMatrixDisplay
from ._common import (
    digits_fit,
    digits_reduced,
    digits_split,
    progress,
    quick_settings,
    save,
    subplots,
    training,
)
from ._report import Row


def _within_between(disp):
    """Mean off-diagonal within-class and mean between-class entries of K_hat."""
    B = disp.block_means()
    off = ~np.eye(len(B), dtype=bool)
    return float(np.mean(np.diag(B))), float(B[off].mean())


def _class_blocks(ctx, est, X_show, y_show, panels, what, png, tick):
    """Plot K_hat of the shown images at init and trained; returns the (within, between)
    pairs, the PNG name and the row's measured text."""
    fig, axes = subplots(1, 2, figsize=(12, 5.2))
    gaps = []
    for ax, label, step in zip(axes, panels, (0, -1)):
        disp = KernelMatrixDisplay.from_estimator(est, X_show, y_show, step=step, ax=ax)
        ax.set_title(f"{label}: {what}, 10 per class", fontsize="small")
        gaps.append(_within_between(disp))
        tick(label)
    png = save(ctx, fig, png)
    (w0, b0), (w1, b1) = gaps
    text = (f"within/between: init {w0:.3f}/{b0:.3f} (gap {w0 - b0:.3f}), trained "
            f"{w1:.3f}/{b1:.3f} (gap {w1 - b1:.3f})")
    return gaps, png, text


def blocks_form(init, trained) -> bool:
    """The claim of panels e-h: from ``(within, between)`` at init and trained, the
    within-minus-between gap grows and ends positive."""
    (w0, b0), (w1, b1) = init, trained
    return (w1 - b1) > (w0 - b0) and w1 > b1


def figure2_section(ctx):
    """Regression fits (a, c), their final kernels (b, d), digits kernels at init/end (e, f)."""
    steps = 300 if ctx.quick else 1000  # the caption's 1000 full-batch steps
    rows, pngs = [], []
    with progress("figure 2", 5) as tick:
        fig, axes = subplots(2, 2, figsize=(10, 8.5))
        for col, (name, maker, tol) in enumerate(
            [("sin x", make_sine, 0.05), ("square wave", make_square_wave, 0.3)]
        ):
            X, y = maker(n_samples=100)
            est = PathKernelMachine(
                hidden_layer_sizes=(64, 64), loss="squared_error", normalize_y=False,
                **training(ctx, solver="adam", learning_rate_init=0.01, batch_size=None,
                           max_iter=steps)).fit(X, y)
            rmse = float(np.sqrt(np.mean((est.predict(X) - y) ** 2)))
            ax = axes[0, col]
            ax.plot(X[:, 0], y, "k-", label="ground truth")
            ax.plot(X[:, 0], est.predict(X), "C0--", label="network")
            ax.set_title(f"({'ac'[col]}) {name}: RMSE {rmse:.3f}", fontsize="small")
            ax.legend(fontsize="small")
            KernelMatrixDisplay.from_estimator(est, X, ax=axes[1, col])
            axes[1, col].set_title(f"({'bd'[col]}) normalized tangent kernel, step {steps}",
                                   fontsize="small")
            rows.append(Row("2" + "ac"[col], f"the network fits {name} (training RMSE < {tol})",
                            f"RMSE {rmse:.4f} after {steps} Adam steps"
                            + quick_settings(ctx, f"{steps} steps (the full run and the "
                                                  "caption: 1000)"), rmse < tol))
            tick(name)
        pngs.append(save(ctx, fig, "fig2_regression.png"))

        est = digits_fit(ctx)
        _, _, X_show, y_show = digits_split(ctx)
        tick("digits fit")
        gaps, png, text = _class_blocks(ctx, est, X_show, y_show,
                                        ("(e) initialization", "(f) trained"), "digits",
                                        "fig2_digits_kernel.png", tick)
        pngs.append(png)
    rows.append(Row(
        "2e-f",
        "training makes digit classes blocks of the normalized kernel: within-class minus "
        "between-class mean K_hat grows (load_digits stands in for MNIST)",
        f"{text}{digits_reduced(ctx)} [{', '.join(pngs)}]", blocks_form(*gaps),
    ))
    rows += cifar_panels(ctx)
    return rows


def small_cnn(n_features, n_outputs):
    """A ``module=`` factory: 3072-vectors unflattened to 3x32x32, two strided tanh
    convolutions, 4x4 average pooling and a linear head (~19k parameters)."""
    if n_features != 3 * 32 * 32:
        raise ValueError(f"small_cnn takes CIFAR-10's 3072 features, got {n_features}.")
    # The estimators hand the module 2-D X: it unflattens the rows itself.
    return nn.Sequential(
        nn.Unflatten(1, (3, 32, 32)),
        nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.Tanh(),
        nn.Conv2d(16, 32, 5, stride=2, padding=2), nn.Tanh(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 4 * 4, n_outputs),
    )


def cifar_settings(ctx):
    """(training images per class, epochs): small in quick mode."""
    return (100, 5) if ctx.quick else (1000, 20)


def cifar_panels(ctx):
    """Figure 2 g-h: the normalized kernel of a small CNN on CIFAR-10 at init and trained,
    10 test images per class; only when CIFAR-10's python batches are on disk."""
    claim = ("CIFAR-10 (small CNN): training makes classes blocks of the normalized kernel "
             "(within-class minus between-class mean K_hat grows)")
    try:
        n_per_class, epochs = cifar_settings(ctx)
        X, y = load_cifar10(data_home=ctx.data_home, subset="train",
                            n_per_class=n_per_class, return_X_y=True)
        X_show, y_show = load_cifar10(data_home=ctx.data_home, subset="test", n_per_class=10,
                                      return_X_y=True)
    except FileNotFoundError as e:
        # load_cifar10's message names the missing file and how to provide it.
        return [Row("2g-h", claim, f"not run: {e}", None)]
    with progress("figure 2 g-h", 3) as tick:
        steps_per_epoch = -(-len(y) // 64)
        est = PathKernelClassifier(
            module=small_cnn, loss="log_loss", **training(
                ctx, solver="adam", learning_rate_init=1e-3, batch_size=64,
                max_iter=epochs, record_every=steps_per_epoch)).fit(X, y)
        tick("fit")
        gaps, png, text = _class_blocks(ctx, est, X_show, y_show,
                                        ("(g) initialization", "(h) trained"),
                                        "CIFAR-10 test images", "fig2_cifar10_kernel.png", tick)
    acc = est.score(X_show, y_show)
    return [Row(
        "2g-h", claim,
        f"{text}; {len(y)} training images, {epochs} epochs, test accuracy on the 100 shown "
        f"{acc:.2f} [{png}]", blocks_form(*gaps),
    )]
