"""Every estimator at its defaults against MLPClassifier() / MLPRegressor() at theirs.

Each data set is split 75/25 (``train_test_split(random_state=s)``) for seeds ``s = 0 ..
R-1``; every estimator is ``make_pipeline(StandardScaler(), Est(random_state=s))`` with
nothing else set, and MLPClassifier / MLPRegressor get the same split, seed and scaler.
Ours and sklearn's fits alternate (interleaved), so both see the same background load.
Scores are test accuracy (classifiers) or R^2 (regressors): the mean over the R splits,
and the paired difference ours - sklearn's with twice its standard error (a difference
inside +- 2 SE is not distinguishable from zero; the SE is Nadeau & Bengio's corrected one,
``benchmarks._stats.paired``, as the overlapping splits' differences are correlated).
Classifiers with ``predict_proba`` are also scored by test log loss, the same way (lower
is better). Regressors are compared with two peers on the same splits: ``MLPRegressor()``
as it comes (it does not scale the targets) and, the fair peer, ``MLPRegressor()`` on
standardized targets
(``TransformedTargetRegressor(MLPRegressor(), transformer=StandardScaler())``, as users
fit it; ours standardizes them by default). Fit times are medians over the splits.

Then, with the other core busy (a pure-Python busy loop in its own process, pinned to the
last core this process may use), every estimator is fitted again on the first
``BUSY_SPLITS`` splits, interleaved with sklearn's as above: the fit times of a machine
that another job shares (the benchmark's own process is not pinned).

``SKPATHKERNEL_BENCH_ESTIMATORS=TangentFeatureSVM`` (class names, comma-separated) runs
those estimators' rows only, each still paired with MLPClassifier / MLPRegressor on the
same splits; the run records it in its provenance.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np

from benchmarks._stats import paired

NOTES = (
    "Data sets: scikit-learn's bundled `load_iris`, `load_wine`, `load_breast_cancer`, "
    "`load_digits`, `load_diabetes`, and `make_classification(random_state=0)`, "
    "`make_moons(noise=0.3, random_state=0)` (scikit-learn's classifier-comparison "
    "example), `make_friedman1(random_state=0)`, `make_regression(random_state=0)` at "
    "their default sizes. The pipelines scale X only; the regressors' second peer row, "
    "*MLPRegressor(), y standardized*, is MLPRegressor() in a "
    "`TransformedTargetRegressor(transformer=StandardScaler())` (ours standardizes the "
    "targets itself, `normalize_y=True`). *log loss*: test log loss (classifiers with "
    "`predict_proba`; lower is better), mean over the splits and the paired difference "
    "with twice its standard error; *log loss verdict*: *at most* (ours lower), *above, "
    "within noise*, or *ABOVE* (beyond 2 SE). Every SE is Nadeau & Bengio's (2003) "
    "corrected resampled one, `sqrt((1/J + n_test/n_train) * s^2)` over the J splits "
    "(the splits overlap, so the naive `s / sqrt(J)` is too small). "
    "TangentFeatures (a transformer) and OODRankDetector (an outlier detector) have no "
    "test score to compare with an MLP; both train the same network as the rows above. "
    "*epochs*: median epochs run (both stop by tol / n_iter_no_change or at max_iter = "
    "200). *path*: median size of our recorded trajectory (every step kept, "
    "`record_every='auto'` under the 1 GiB `memory_budget`). *loss / norm growth*: the "
    "largest last / first epoch loss and final / initial parameter norm over the splits, "
    "which the divergence warning compares with 100 and 1000; *divergence warnings*: "
    "DivergenceWarnings raised (none expected). *busy*: the same fits, on the first "
    "splits, with a busy loop pinned to the other core. The last row sums the "
    "per-data-set median fit times.")

SPLITS = {False: 10, True: 3}
# A comma-separated subset of the estimators to run, by class name (e.g.
# "TangentFeatureSVM"); unset: all. Data sets left with none of them are skipped, and
# the rows that run are the same as in a run of all.
ESTIMATORS_ENV = "SKPATHKERNEL_BENCH_ESTIMATORS"
BUSY_SPLITS = {False: 5, True: 2}


@contextlib.contextmanager
def _other_core_busy():
    """A busy loop on the last core this process may use; yields whether one runs."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield False
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(proc.pid, {cores[-1]})
        time.sleep(0.2)  # let it start spinning
        yield True
    finally:
        proc.kill()
        proc.wait()


def _busy_fit_times(X, y, kind, quick, device):
    """Median fit times (ours per estimator, sklearn's per peer) with the other core
    busy."""
    from sklearn.model_selection import train_test_split

    ours: dict[str, list] = {}
    ref: dict[str, list] = {}
    with _other_core_busy() as busy:
        if not busy:
            return None
        for seed in range(BUSY_SPLITS[quick]):
            X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=seed)
            mine, peers = _estimators(kind, seed, device)
            jobs = [(label, est, ours) for label, est in mine.items()]
            jobs += [(label, est, ref) for label, est in peers.items()]
            if seed % 2:
                jobs.reverse()
            for label, est, times in jobs:
                times.setdefault(label, []).append(
                    _fit_score(est, X_tr, y_tr, X_te, y_te)[1])
    return ({label: statistics.median(t) for label, t in ours.items()},
            {label: statistics.median(t) for label, t in ref.items()})


def _datasets(quick: bool):
    from sklearn.datasets import (
        load_breast_cancer,
        load_diabetes,
        load_digits,
        load_iris,
        load_wine,
        make_classification,
        make_friedman1,
        make_moons,
        make_regression,
    )

    sets = {
        "iris": (*load_iris(return_X_y=True), "clf"),
        "wine": (*load_wine(return_X_y=True), "clf"),
        "breast_cancer": (*load_breast_cancer(return_X_y=True), "clf"),
        "digits": (*load_digits(return_X_y=True), "clf"),
        "make_classification": (*make_classification(random_state=0), "clf"),
        "make_moons(noise=0.3)": (*make_moons(noise=0.3, random_state=0), "clf"),
        "diabetes": (*load_diabetes(return_X_y=True), "reg"),
        "make_friedman1": (*make_friedman1(random_state=0), "reg"),
        "make_regression": (*make_regression(random_state=0), "reg"),
    }
    if quick:
        sets = {k: sets[k] for k in ("iris", "digits", "diabetes")}
    return sets


def _estimators(kind, seed, device):
    """Ours (label -> estimator) and sklearn's peers (label -> estimator), the first peer
    the one at its defaults."""
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier, PathKernelMachine, TangentFeatureSVM

    if kind == "clf":
        mine = {
            "PathKernelClassifier()": PathKernelClassifier(random_state=seed, device=device),
            "TangentFeatureSVM()": TangentFeatureSVM(
                PathKernelClassifier(random_state=seed, device=device)),
        }
        peers = {"MLPClassifier()": MLPClassifier(random_state=seed)}
    else:
        mine = {"PathKernelMachine()": PathKernelMachine(random_state=seed, device=device)}
        # Ours standardizes the targets (normalize_y=True); MLPRegressor() does not, so
        # the fair peer is MLPRegressor on standardized targets, as users fit it.
        peers = {"MLPRegressor()": MLPRegressor(random_state=seed),
                 "MLPRegressor(), y standardized": TransformedTargetRegressor(
                     MLPRegressor(random_state=seed), transformer=StandardScaler())}
    chosen = os.environ.get(ESTIMATORS_ENV)
    if chosen:
        names = {n.strip() for n in chosen.split(",")}
        mine = {label: est for label, est in mine.items() if label.split("(")[0] in names}
    return mine, peers


def _fit_score(est, X_tr, y_tr, X_te, y_te):
    """(test score, fit seconds, divergence warnings, test log loss or None)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import log_loss
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import DivergenceWarning

    pipe = make_pipeline(StandardScaler(), est)
    with warnings.catch_warnings(record=True) as caught:
        # Both libraries warn when max_iter ends a fit; the epochs column shows it. The
        # divergence warning (a ConvergenceWarning) is counted: none is expected here.
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("always", DivergenceWarning)
        t0 = time.perf_counter()
        pipe.fit(X_tr, y_tr)
        fit_s = time.perf_counter() - t0
    diverged = sum(issubclass(w.category, DivergenceWarning) for w in caught)
    # labels: a test split may miss a class the training split has.
    loss = (log_loss(y_te, pipe.predict_proba(X_te), labels=pipe.classes_)
            if hasattr(pipe, "predict_proba") else None)
    return pipe.score(X_te, y_te), fit_s, diverged, loss


def _n_iter(est):
    """Epochs run (a TransformedTargetRegressor's through its fitted regressor)."""
    return getattr(est, "regressor_", est).n_iter_


def _growth(est):
    """(last / first epoch loss, final / initial parameter norm) of our fitted network:
    what the divergence warning compares with its thresholds (100 and 1000)."""
    traj = est.trajectory_
    return (est.loss_curve_[-1] / est.loss_curve_[0],
            float(traj.parameters(-1).norm() / traj.parameters(0).norm()))


def run(quick: bool = False, device: str = "cpu") -> list[dict]:
    from sklearn.model_selection import train_test_split

    rows = []
    # Median fit times per data set, ours and the at-defaults peer's, per estimator.
    ours_fit: dict[str, list] = {}
    ref_fit: dict[str, list] = {}
    busy_ours: dict[str, list] = {}  # the same with the other core busy
    busy_ref: dict[str, list] = {}
    for name, (X, y, kind) in _datasets(quick).items():
        if not _estimators(kind, 0, device)[0]:
            continue  # none of the chosen estimators is for this kind of target
        ours: dict[str, dict[str, list]] = {}
        refs: dict[str, dict[str, list]] = {}
        for seed in range(SPLITS[quick]):
            X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=seed)
            mine, peers = _estimators(kind, seed, device)
            jobs = [(label, est, False) for label, est in mine.items()]
            jobs += [(label, est, True) for label, est in peers.items()]
            if seed % 2:  # alternate who goes first: neither always runs on a cold cache
                jobs.reverse()
            for label, est, peer in jobs:
                score, fit_s, diverged, loss = _fit_score(est, X_tr, y_tr, X_te, y_te)
                rec = (refs if peer else ours).setdefault(
                    label, {"score": [], "fit": [], "epochs": [], "loss": [], "path": [],
                            "growth": [], "diverged": 0})
                rec["score"].append(score)
                rec["fit"].append(fit_s)
                rec["epochs"].append(_n_iter(est))
                rec["loss"].append(loss)
                if not peer:
                    net = est.estimator_ if hasattr(est, "estimator_") else est
                    rec["path"].append(est.trajectory_.nbytes / 2**20)
                    rec["growth"].append(_growth(net))
                    rec["diverged"] += diverged
        busy = _busy_fit_times(X, y, kind, quick, device)
        first_peer = next(iter(refs))
        for label, rec in ours.items():
            ours_fit.setdefault(label, []).append(statistics.median(rec["fit"]))
            ref_fit.setdefault(label, []).append(statistics.median(refs[first_peer]["fit"]))
            if busy is not None:
                busy_ours.setdefault(label, []).append(busy[0][label])
                busy_ref.setdefault(label, []).append(busy[1][first_peer])
            for sk_name, ref in refs.items():
                rows.append(_row(name, len(X_tr), len(X_te), label, rec, sk_name, ref, busy))
    row = {"data set": "total (sum of medians)",
           "fit s ours / sklearn's": _total(ours_fit, ref_fit)}
    if busy_ours:
        row["busy: fit s ours / sklearn's"] = _total(busy_ours, busy_ref)
    rows.append(row)
    return rows


def _row(name, n_train, n_test, label, rec, sk_name, ref, busy):
    """The table's row of one estimator of ours against one peer on one data set."""
    p = paired(rec["score"], ref["score"], n_test / n_train)
    mean_diff, two_se = p.mean, 2 * p.se
    verdict = ("at least" if mean_diff >= 0 else
               "below, within noise" if mean_diff >= -two_se else "BELOW")
    ratio = statistics.median(rec["fit"]) / statistics.median(ref["fit"])
    if rec["loss"][0] is None or ref["loss"][0] is None:
        loss_cells = {"log loss ours / sklearn's": "n/a",
                      "log loss ours - sklearn's (+- 2 SE)": "n/a",
                      "log loss verdict": "n/a"}
    else:
        q = paired(rec["loss"], ref["loss"], n_test / n_train)
        loss_diff, loss_se = q.mean, 2 * q.se
        loss_cells = {
            "log loss ours / sklearn's": f"{np.mean(rec['loss']):.3f} / "
                                         f"{np.mean(ref['loss']):.3f}",
            "log loss ours - sklearn's (+- 2 SE)": f"{loss_diff:+.3f} (+-{loss_se:.3f})",
            "log loss verdict": ("at most" if loss_diff <= 0 else
                                 "above, within noise" if loss_diff <= loss_se else
                                 "ABOVE")}
    return {
        "data set": name,
        "n train / test": f"{n_train} / {n_test}",
        "estimator": label,
        "ours: mean (min)": f"{np.mean(rec['score']):.3f} ({min(rec['score']):.3f})",
        "sklearn's: mean (min)": f"{sk_name} {np.mean(ref['score']):.3f} "
                                 f"({min(ref['score']):.3f})",
        "ours - sklearn's (+- 2 SE)": f"{mean_diff:+.3f} (+-{two_se:.3f})",
        "verdict": verdict,
        **loss_cells,
        "fit s ours / sklearn's": f"{statistics.median(rec['fit']):.2f} / "
                                  f"{statistics.median(ref['fit']):.2f}",
        "time ratio": f"{ratio:.2f}x",
        "busy: fit s ours / sklearn's": "n/a (one core)" if busy is None else
            f"{busy[0][label]:.2f} / {busy[1][sk_name]:.2f}",
        "busy: time ratio": "n/a" if busy is None else
            f"{busy[0][label] / busy[1][sk_name]:.2f}x",
        "epochs ours / sklearn's": f"{statistics.median(rec['epochs']):.0f} / "
                                   f"{statistics.median(ref['epochs']):.0f}",
        "path": f"{statistics.median(rec['path']):.1f} MiB",
        "loss / norm growth (max)": f"{max(g[0] for g in rec['growth']):.2f} / "
                                    f"{max(g[1] for g in rec['growth']):.2f}",
        "divergence warnings": rec["diverged"],
        "splits": len(rec["score"]),
    }


def _total(ours_fit: dict, ref_fit: dict) -> str:
    """The sum over the data sets of the median fit times, per estimator of ours."""
    parts = []
    for label, times in ours_fit.items():
        total, ref = sum(times), sum(ref_fit[label])
        parts.append(f"{label} {total:.2f} / {ref:.2f} s = {total / ref:.2f}x")
    return "; ".join(parts)

