"""Figure 5: the digits network's kernel between handwritten and printed digits."""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import ConfusionMatrixDisplay
from sklearn.neighbors import KNeighborsClassifier
from sklearn.svm import SVC

from ..datasets import load_printed_digits
from ..plotting import KernelMatrixDisplay
from ._common import digits_fit, digits_split, progress, save, scaled_printed, subplots
from ._report import Row


def _cross_domain(B):
    """Mean K_hat between handwritten k and printed k, and between handwritten k, printed l."""
    H, P = B[0::2, 1::2], B[1::2, 0::2]  # rows handwritten/cols printed, and transposed
    cross = (H + P.T) / 2
    off = ~np.eye(len(cross), dtype=bool)
    return float(np.mean(np.diag(cross))), float(cross[off].mean())


def baselines(X, y, X_test, y_test):
    """Printed-digit accuracy of input-space classifiers trained on the same digits."""
    models = {"RBF SVC": SVC(kernel="rbf", C=1.0, gamma="scale"),
              "1-NN": KNeighborsClassifier(n_neighbors=1),
              "logistic regression": LogisticRegression(C=1.0, max_iter=2000)}
    return {name: float(m.fit(X, y).score(X_test, y_test)) for name, m in models.items()}


def transfers(acc_network, acc_baseline) -> bool:
    """The claim: the network transfers to printed digits at least as well as the
    input-space RBF SVM (the paper's own raw-input baseline, figure 3) trained on the
    same handwritten digits."""
    return acc_network >= acc_baseline


def figure5_section(ctx):
    """Interleaved blocks [handwritten k; printed k], at init and trained; confusion matrix."""
    with progress("figure 5", 4) as tick:
        est = digits_fit(ctx)
        X_train, y_train, X_hand, y_hand = digits_split(ctx)
        X_print, y_print = scaled_printed(load_printed_digits, n_per_class=10)
        tick("data")
        # Block 2k: handwritten k, block 2k + 1: printed k (the caption's index layout).
        X = np.vstack([X_hand, X_print])
        group = np.concatenate([2 * y_hand, 2 * y_print + 1])
        names = [f"{'hp'[g % 2]}{g // 2}" for g in range(20)]
        fig, axes = subplots(1, 3, figsize=(19, 5.6))
        stats = {}
        for ax, (label, step) in zip(axes, [("(a) initialization", 0), ("(b) trained", -1)]):
            disp = KernelMatrixDisplay.from_estimator(est, X, group, step=step, ax=ax,
                                                      display_labels=names,
                                                      )
            ax.tick_params(labelsize=6)
            ax.set_title(f"{label}: h = load_digits, p = printed", fontsize="small")
            stats[label] = _cross_domain(disp.block_means())
            tick(label)
        pred = est.predict(X_print)
        acc = float(np.mean(pred == y_print))
        ConfusionMatrixDisplay.from_predictions(y_print, pred, ax=axes[2], colorbar=False)
        axes[2].set_title(f"(c) printed digits, network trained on load_digits: acc {acc:.2f}",
                          fontsize="small")
        png = save(ctx, fig, "fig5_printed_digits.png")
        tick("confusion")
    (s0, c0), (s1, c1) = stats.values()
    base = baselines(X_train, y_train, X_print, y_print)
    held_out = est.score(X_hand, y_hand)
    return [
        Row("5a-b", "after training, handwritten and printed images of the same digit align "
            "(same-digit cross-domain K_hat above cross-digit, by more than at init)",
            f"same/cross-digit: init {s0:.3f}/{c0:.3f}, trained {s1:.3f}/{c1:.3f}",
            s1 > c1 and (s1 - c1) > (s0 - c0)),
        Row("5c", "the load_digits-trained network classifies out-of-domain printed digits at "
            "least as well as an RBF SVM on pixels trained on the same digits",
            f"accuracy on 100 printed digits: network {acc:.3f}, "
            + ", ".join(f"{k} {v:.3f}" for k, v in base.items())
            + f" (held-out handwritten: network {held_out:.3f}) [{png}]",
            transfers(acc, base["RBF SVC"])),
    ]
