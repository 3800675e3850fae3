"""Tangent-feature SVMs against an RBF SVC on the inputs and an MLPClassifier.

Tasks: the seeds' circle (``make_circle(inner_radius_sq=0.9)``) and ellipse
(``make_ellipse``), train on ``random_state=0``, test on a fresh draw (``random_state=1``);
sklearn's digits (pixels / 16, stratified 70/30 split). TangentFeatureSVM trains its
network, then a linear SVM on phi(x) (``svm_kernel="linear"``) or an SVC on the path
kernel (``svm_kernel="path"``, recorded every k-th step: about 20 points on the path).
The MLPClassifier has the same hidden layers, solver, step size, epochs and full-batch
steps. Fit time includes the network's training; predict time is for the whole test set.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

NOTES = ("Digits use a one-hidden-layer (32) network, and the linear SVM on phi runs as "
         "svm_kernel='tangent' (the same SVM: the tangent kernel is the linear kernel of "
         "phi): phi(x) of a 10-output network is n_params x 10 wide, and SVC(kernel="
         "'linear') on the dense features of the (64, 64) network took 100-200 s on 1257 "
         "digits. Peak memory: extra resident memory during fit and "
         "predict, sampled every millisecond (in-process: a lower bound).")


# Full-batch steps, a fixed number of epochs, tanh: this table's setting (not the defaults).
PINNED = dict(batch_size=None, tol=None, activation="tanh")


def _tasks(quick):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from skpathkernel.datasets import make_circle, make_ellipse

    n = 300 if quick else 1000
    net2d = dict(hidden_layer_sizes=(64, 64), solver="adam", learning_rate_init=0.01,
                 max_iter=100 if quick else 300)
    tasks = {}
    for name, make in (("circle", lambda s: make_circle(n, inner_radius_sq=0.9,
                                                         random_state=s)),
                       ("ellipse", lambda s: make_ellipse(n, inner_radius_sq=0.9,
                                                          random_state=s))):
        X, y = make(0)
        X_test, y_test = make(1)
        tasks[name] = (X, y, X_test, y_test, net2d)
    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X / 16, y, test_size=0.3, stratify=y,
                                              random_state=0)
    net_digits = dict(hidden_layer_sizes=(32,), solver="sgd", learning_rate_init=0.1,
                      max_iter=30 if quick else 100)
    tasks["digits"] = (X_tr, y_tr, X_te, y_te, net_digits)
    return tasks


def run(quick: bool = False, device: str = "cpu") -> list[dict]:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.svm import SVC

    from benchmarks._serve import PeakRSS
    from skpathkernel import PathKernelClassifier, TangentFeatureSVM

    rows = []
    for task, (X, y, X_test, y_test, net) in _tasks(quick).items():
        record_every = max(1, net["max_iter"] // 20)
        n_train = len(X)
        linear_kind = "tangent" if task == "digits" else "linear"
        linear_name = ("TangentFeatureSVM linear" if linear_kind == "linear" else
                       "TangentFeatureSVM linear, as svm_kernel='tangent'")
        methods = {
            # The same SVM as svm_kernel="linear" (the tangent kernel is phi's linear
            # kernel); on digits "tangent" avoids SVC's 24100-wide dense features.
            linear_name: lambda net=net, kind=linear_kind: TangentFeatureSVM(
                PathKernelClassifier(**net, **PINNED, device=device, random_state=0),
                svm_kernel=kind),
            "TangentFeatureSVM path": lambda net=net, k=record_every: TangentFeatureSVM(
                PathKernelClassifier(**net, **PINNED, record_every=k, device=device,
                                     random_state=0), svm_kernel="path"),
            "SVC rbf gamma=scale (inputs)": lambda: SVC(kernel="rbf", gamma="scale"),
            "MLPClassifier": lambda net=net, n=n_train: MLPClassifier(
                **net, activation="tanh", momentum=0.0, nesterovs_momentum=False,
                tol=0.0, n_iter_no_change=net["max_iter"] + 1,
                batch_size=n,  # full batch, as the networks above (batch_size=None)
                random_state=0),
        }
        for name, make in methods.items():
            with warnings.catch_warnings():
                # liblinear / MLP stop at max_iter by design here (fixed work per row).
                warnings.simplefilter("ignore", ConvergenceWarning)
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    est = make().fit(X, y)
                    fit_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    acc = float(np.mean(est.predict(X_test) == y_test))
                    pred_s = time.perf_counter() - t0
            rows.append({"task": task, "n train / test": f"{len(X)} / {len(X_test)}",
                         "method": name, "test accuracy": f"{acc:.3f}",
                         "fit s": f"{fit_s:.2f}", "predict s": f"{pred_s:.2f}",
                         "peak memory": f"{mem.delta / 2**20:.1f} MiB"})
    return rows

