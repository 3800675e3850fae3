"""Figure 3: a linear SVM on learned tangent features versus an RBF SVM on inputs."""

from __future__ import annotations

import warnings

from sklearn.exceptions import ConvergenceWarning
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer
from sklearn.svm import SVC, LinearSVC

from .. import PathKernelClassifier
from ..datasets import make_circle, make_ellipse
from ._common import decision_regions, progress, quick_settings, save, subplots, training
from ._report import Row

# The ellipse's point is a contrast: RBF on raw inputs fails where tangent features
# succeed. "Fails" is read as at least CONTRAST more test errors per point.
CONTRAST = 0.10


def solves_as_well(acc_tangent, acc_rbf) -> bool:
    """The circle's claim: the tangent-feature SVM solves it, as well as the RBF SVM."""
    return acc_tangent >= 0.95 and acc_tangent >= acc_rbf - 0.02


def beats_rbf(acc_tangent, acc_rbf) -> bool:
    """The ellipse's claim: the tangent-feature SVM solves it and the RBF SVM does not."""
    return acc_tangent >= 0.95 and acc_tangent - acc_rbf >= CONTRAST


def figure3_section(ctx):
    """Circle (inner 0.9) and ellipse (100 x1^2 + x2^2): tangent-feature LinearSVC vs RBF."""
    n, epochs = (300, 300) if ctx.quick else (1000, 1000)
    reduced = quick_settings(ctx, f"{n} points, {epochs} epochs (the full run: 1000, 1000)")
    tasks = {
        "circle": lambda s: make_circle(n_samples=n, inner_radius_sq=0.9, random_state=s),
        "ellipse": lambda s: make_ellipse(n_samples=n, inner_radius_sq=0.9, random_state=s),
    }
    rows, details = [], []
    with progress("figure 3", 2 * len(tasks)) as tick:
        fig, axes = subplots(2, 2, figsize=(10, 9))
        for col, (name, make) in enumerate(tasks.items()):
            X, y = make(0)
            X_test, y_test = make(1)
            net = PathKernelClassifier(
                hidden_layer_sizes=(64, 64), loss="log_loss",
                **training(ctx, solver="adam", learning_rate_init=0.01, batch_size=None,
                           max_iter=epochs)).fit(X, y)
            tick(f"{name} fit")
            # Each sample is represented by phi(x) = d f(x; theta_T) / d theta only;
            # liblinear's dual solver shuffles, so its seed fixes the reported accuracy.
            tangent_svm = make_pipeline(FunctionTransformer(net.transform),
                                        LinearSVC(C=1.0, random_state=0))
            with warnings.catch_warnings():
                # liblinear stops at max_iter on thousands of unscaled tangent features;
                # raising it tripled the section's time without changing the accuracy.
                warnings.simplefilter("ignore", ConvergenceWarning)
                tangent_svm.fit(X, y)
            rbf = SVC(kernel="rbf", gamma="scale").fit(X, y)
            acc_t = tangent_svm.score(X_test, y_test)
            acc_r = rbf.score(X_test, y_test)
            res = 50 if ctx.quick else 120
            decision_regions(axes[0, col],
                             tangent_svm.decision_function, X, y,
                             resolution=res,
                             title=f"({'ab'[col]}) linear SVM on tangent features, {name}: "
                                   f"test acc {acc_t:.3f}")
            decision_regions(axes[1, col], rbf.decision_function, X, y, resolution=res,
                             title=f"({'cd'[col]}) RBF SVM on inputs, {name}: "
                                   f"test acc {acc_r:.3f}")
            details.append({"task": name, "tangent LinearSVC": f"{acc_t:.3f}",
                            "RBF SVC": f"{acc_r:.3f}",
                            "network": f"{net.score(X_test, y_test):.3f}"})
            if name == "circle":
                rows.append(Row(
                    "3a", "on the isotropic circle a linear SVM on learned tangent features "
                    "solves the task as well as an RBF SVM on inputs (tangent >= 0.95 and "
                    "at most 0.02 below RBF)",
                    f"test accuracy: tangent LinearSVC {acc_t:.3f}, RBF SVC {acc_r:.3f}"
                    + reduced, solves_as_well(acc_t, acc_r)))
            else:
                rows.append(Row(
                    "3b", "(this package's reading of panels b and d: the caption states no "
                    "result) on the anisotropic ellipse the tangent-feature SVM succeeds "
                    "where the RBF SVM on inputs fails (tangent >= 0.95 and at least "
                    f"{CONTRAST:.2f} above RBF)",
                    f"test accuracy: tangent LinearSVC {acc_t:.3f}, RBF SVC {acc_r:.3f} "
                    f"(margin {acc_t - acc_r:.3f})" + reduced, beats_rbf(acc_t, acc_r)))
            tick(f"{name} svm")
        png = save(ctx, fig, "fig3_tangent_svm.png")
    rows[-1].measured += f" [{png}]"
    rows[-1].details = details
    return rows

