"""Figure 5: the digits network's kernel between handwritten and printed digits."""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import ConfusionMatrixDisplay, confusion_matrix
from sklearn.neighbors import KNeighborsClassifier
from sklearn.svm import SVC

from ..datasets import load_printed_digits
from ..plotting import KernelMatrixDisplay
from ._common import (
    digits_estimator,
    digits_fit,
    digits_reduced,
    digits_split,
    parallel_map,
    progress,
    save,
    scaled_printed,
    subplots,
    worker_context,
)
from ._report import Row

# What the paper states for figure 5 and what this run had to choose.
SETTINGS = [
    {"parameter": "training digits", "paper": "MNIST (28x28)",
     "ours": "scikit-learn's load_digits (8x8, ink scaled to [0, 1]; MNIST is not shipped)"},
    {"parameter": "training length", "paper": "200 epochs (panel b)",
     "ours": "200 epochs (100 full-batch steps in --quick)"},
    {"parameter": "kernel panels", "paper": "10 images per class of each domain, by class",
     "ours": "same: 10 held-out handwritten and 10 printed images per digit, interleaved"},
    {"parameter": "printed digits", "paper": "not stated (fonts, rendering)",
     "ours": "load_printed_digits: matplotlib's fonts rendered at 8x8"},
    {"parameter": "network", "paper": "not stated", "ours": "64-64 tanh MLP, 10 outputs"},
    {"parameter": "loss, optimizer, step, batch", "paper": "not stated",
     "ours": "log loss, Adam lr 0.003, batches of 64 (full batch in --quick)"},
    {"parameter": "claim of panel (c)", "paper": "a confusion matrix of the printed digits",
     "ours": "every row's diagonal is its maximum; the RBF SVC is a comparison the paper "
             "does not make"},
]


# The sweep of panel (c) (full run only): one change at a time from the digits network.
VARIANTS = [
    ("seed 1", dict(random_state=1)), ("seed 2", dict(random_state=2)),
    ("width 128", dict(hidden_layer_sizes=(128, 128))),
    ("depth 1", dict(hidden_layer_sizes=(64,))), ("depth 3", dict(hidden_layer_sizes=(64,) * 3)),
    ("ReLU", dict(activation="relu")),
    ("step x 0.3", dict(learning_rate_init=0.001)), ("step x 3", dict(learning_rate_init=0.01)),
    ("batch 256", dict(batch_size=256)), ("50 epochs", dict(max_iter=50)),
    ("SGD with momentum 0.9, lr 0.03", dict(solver="sgd", learning_rate_init=0.03,
                                            momentum=0.9)),
]


def sweep_reason(table) -> str:
    """Which printed digits fail panel (c)'s claim across the sweep's network cells, and
    whether the input-space classifiers pass it."""
    nets = [r for r in table if not r["cell"].startswith("input space")]
    inputs = [r for r in table if r["cell"].startswith("input space")]
    misses = {}
    for row in nets:
        for item in row["rows not dominated"].split("; "):
            if item != "-":
                digit, rest = item.split(": ")
                misses.setdefault(digit, []).append(rest.split("(as ")[1].rstrip(")"))
    worst = sorted(misses.items(), key=lambda kv: -len(kv[1]))
    return (f"{sum(r['claim'] == 'pass' for r in nets)} of {len(nets)} network cells pass "
            "(every setting swept: seeds, width, depth, activation, step, batch, length, "
            "optimizer, printed jitter); the rows that miss: "
            + "; ".join(f"printed {d} in {len(a)} cells (taken for "
                        f"{'/'.join(sorted(set(a)))})" for d, a in worst)
            + ". Input space: " + ", ".join(f"{r['cell'][13:]} {r['claim']}" for r in inputs)
            + ". The miss is the networks', on the 8x8 rendering of these digits, whatever "
            "the training setting; the paper's 28x28 MNIST network is not reproduced by an "
            "8x8 stand-in.")


def _row_of(cm, k):
    """``"k: diagonal vs largest other (as j)"``."""
    other = np.where(np.arange(len(cm)) == k, -1, cm[k])
    return f"{k}: {cm[k, k]} vs {other.max()} (as {other.argmax()})"


def _confusion_cell(name, y_true, pred, held_out=None):
    cm = confusion_matrix(y_true, pred, labels=np.arange(10))
    weak = [_row_of(cm, k) for k in range(10) if cm[k, k] <= np.delete(cm[k], k).max()]
    return {"cell": name, "held-out handwritten": "-" if held_out is None else
            f"{held_out:.3f}", "printed acc": f"{np.mean(pred == y_true):.3f}",
            "diagonal (digits 0-9)": " ".join(map(str, np.diag(cm))),
            "claim": "pass" if diagonal_dominates(cm) else "FAIL",
            "rows not dominated": "; ".join(weak) or "-"}


def _sweep_fit(ctx, name, change, X, y, X_hand, y_hand, X_print, y_print):
    est = digits_estimator(ctx, record_every=10**9, **change).fit(X, y)
    return _confusion_cell(name, y_print, est.predict(X_print), est.score(X_hand, y_hand))


def sweep(ctx, est, X_train, y_train, X_hand, y_hand, X_print, y_print):
    """Panel (c)'s claim for the row's network on other printed renderings, for networks
    trained with one change each, and for the input-space classifiers."""
    rows = [_confusion_cell("the row's network", y_print, est.predict(X_print),
                            est.score(X_hand, y_hand))]
    for seed in (1, 2):
        Xp, yp = scaled_printed(load_printed_digits, n_per_class=10, random_state=seed)
        rows.append(_confusion_cell(f"the row's network, printed jitter seed {seed}", yp,
                                    est.predict(Xp)))
    data = (X_train, y_train, X_hand, y_hand, X_print, y_print)
    rows += parallel_map(_sweep_fit, [(worker_context(ctx), name, change, *data)
                                      for name, change in VARIANTS], n_jobs=ctx.n_jobs)
    for name, model in _input_models().items():
        model.fit(X_train, y_train)
        rows.append(_confusion_cell(f"input space: {name}", y_print, model.predict(X_print),
                                    model.score(X_hand, y_hand)))
    return rows


def _cross_domain(B):
    """Mean K_hat between handwritten k and printed k, and between handwritten k, printed l."""
    H, P = B[0::2, 1::2], B[1::2, 0::2]  # rows handwritten/cols printed, and transposed
    cross = (H + P.T) / 2
    off = ~np.eye(len(cross), dtype=bool)
    return float(np.mean(np.diag(cross))), float(cross[off].mean())


def _input_models():
    return {"RBF SVC": SVC(kernel="rbf", C=1.0, gamma="scale"),
            "1-NN": KNeighborsClassifier(n_neighbors=1),
            "logistic regression": LogisticRegression(C=1.0, max_iter=2000)}


def baselines(X, y, X_test, y_test):
    """Printed-digit accuracy of input-space classifiers trained on the same digits."""
    return {name: float(m.fit(X, y).score(X_test, y_test))
            for name, m in _input_models().items()}


def diagonal_dominates(cm) -> bool:
    """The claim of panel (c): in every row of the confusion matrix (true printed digit)
    the diagonal is the largest entry, strictly: each printed digit is predicted as itself
    more often than as any other digit."""
    cm = np.asarray(cm)
    off = np.where(np.eye(len(cm), dtype=bool), -np.inf, cm)
    return bool(np.all(np.diag(cm) > off.max(axis=1)))


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
        cm = ConfusionMatrixDisplay.from_predictions(
            y_print, pred, labels=np.arange(10), ax=axes[2], colorbar=False).confusion_matrix
        axes[2].set_title(f"(c) printed digits, network trained on load_digits: acc {acc:.2f}",
                          fontsize="small")
        png = save(ctx, fig, "fig5_printed_digits.png")
        tick("confusion")
    (s0, c0), (s1, c1) = stats.values()
    base = baselines(X_train, y_train, X_print, y_print)
    held_out = est.score(X_hand, y_hand)
    tables = [("the paper's settings and ours", SETTINGS)]
    if not ctx.quick:
        table = sweep(ctx, est, X_train, y_train, X_hand, y_hand, X_print, y_print)
        tables.append(("sweep: panel (c)'s claim, one change at a time (held-out: the "
                       "100 handwritten display digits)", table))
    diag = np.diag(cm)
    rivals = np.where(np.eye(10, dtype=bool), -1, cm).max(axis=1)
    weak = [f"{k}: {diag[k]} vs {rivals[k]}" for k in range(10) if diag[k] <= rivals[k]]
    return [
        Row("5a-b", "after training, handwritten and printed images of the same digit align "
            "(same-digit cross-domain K_hat above cross-digit, by more than at init)",
            f"same/cross-digit: init {s0:.3f}/{c0:.3f}, trained {s1:.3f}/{c1:.3f}"
            + digits_reduced(ctx),
            s1 > c1 and (s1 - c1) > (s0 - c0)),
        Row("5c", "the network trained on handwritten digits classifies printed digits: in "
            "the confusion matrix every printed digit is predicted as itself more often than "
            "as any other digit (each row's diagonal entry its strict maximum)",
            f"diagonal of the confusion matrix (of 10 per digit): {', '.join(map(str, diag))}"
            f"; accuracy {acc:.3f}"
            + (f"; rows not dominated by their diagonal (diagonal vs largest other): "
               f"{'; '.join(weak)}" if weak else "") + f"{digits_reduced(ctx)} [{png}]",
            diagonal_dominates(cm), tables=tables,
            # A failure always says why, or that its reason was not sought.
            reason=(None if diagonal_dominates(cm) else
                    "not sought in --quick, whose network trains 100 full-batch steps where "
                    "the paper's trains 200 epochs; the sweep that reads the reason runs "
                    "without --quick" if ctx.quick else sweep_reason(table))),
        Row("5c", "comparison (not in the paper): printed-digit accuracy of input-space "
            "classifiers trained on the same handwritten digits",
            f"on 100 printed digits: network {acc:.3f}, "
            + ", ".join(f"{k} {v:.3f}" for k, v in base.items())
            + f" (held-out handwritten: network {held_out:.3f})", None),
    ]
