"""Figure 6: the digits network's kernel between digits and unseen letters."""

from __future__ import annotations

import numpy as np

from ._common import digits_fit, digits_split, progress, save, scaled_printed, subplots
from ._report import Row

LETTERS = ("M", "N", "U", "V", "A")


def figure6_section(ctx):
    """Digits (10 per class) then letters M, N, U, V, A (10 each), at init and trained."""
    from ..datasets import load_printed_letters
    from ..plotting import KernelMatrixDisplay

    with progress("figure 6", 3) as tick:
        est = digits_fit(ctx)
        _, _, X_dig, y_dig = digits_split(ctx)
        X_let, y_let = scaled_printed(load_printed_letters, letters=LETTERS, n_per_class=10)
        tick("data")
        X = np.vstack([X_dig, X_let])
        group = np.concatenate([y_dig, 10 + y_let])
        names = [str(d) for d in range(10)] + list(LETTERS)
        n_dig = len(y_dig)
        fig, axes = subplots(1, 2, figsize=(13, 5.6))
        stats = {}
        for ax, (label, step) in zip(axes, [("(a) initialization", 0), ("(b) trained", -1)]):
            disp = KernelMatrixDisplay.from_estimator(est, X, group, step=step, ax=ax,
                                                      display_labels=names,
                                                      )
            # The digit / letter boundary, thicker.
            ax.axhline(n_dig - 0.5, color="red", linestyle="--", linewidth=1.2)
            ax.axvline(n_dig - 0.5, color="red", linestyle="--", linewidth=1.2)
            ax.set_title(f"{label}: digits 0-9, letters {''.join(LETTERS)}", fontsize="small")
            K = disp.kernel_matrix
            dd = K[:n_dig, :n_dig][~np.eye(n_dig, dtype=bool)].mean()
            ld = K[n_dig:, :n_dig]
            # The alignment score of the feature-memory view: best match among the digits.
            best_dd = np.max(np.where(np.eye(n_dig, dtype=bool), -np.inf, K[:n_dig, :n_dig]),
                             axis=1).mean()
            stats[label] = (float(dd), float(ld.mean()), float(best_dd),
                            float(ld.max(axis=1).mean()))
            tick(label)
        png = save(ctx, fig, "fig6_letters.png")
    (dd0, ld0, _, _), (dd1, ld1, bdd1, bld1) = stats.values()
    return [
        Row("6a-b", "unseen letters align less with the stored digit features than digits "
            "with each other (mean K_hat letters-digits below digits-digits, trained)",
            f"digits-digits / letters-digits: init {dd0:.3f}/{ld0:.3f}, trained "
            f"{dd1:.3f}/{ld1:.3f}; best match: digits {bdd1:.3f}, letters {bld1:.3f} [{png}]",
            ld1 < dd1),
    ]
