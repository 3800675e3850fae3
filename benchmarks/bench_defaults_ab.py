"""Candidate default changes against the defaults and MLPClassifier / MLPRegressor.

The defaults benchmark (``bench_defaults``) finds the default network's test log loss above
MLPClassifier's on breast_cancer, digits and make_classification, and its R^2 on diabetes
below MLPRegressor's on standardized targets, with accuracy tied: it fits small training
sets closer. This script measures the candidate changes of a default against both.

Every data set of ``bench_defaults`` is split as there (``train_test_split(
random_state=s)``, s = 0 .. R-1) and every estimator is ``make_pipeline(StandardScaler(),
est)``: the trainer at its defaults (``default``), each candidate (the defaults with the
parameters its name gives), and the peer (``MLPClassifier(random_state=s)``, or
``MLPRegressor(random_state=s)`` on standardized targets in a
``TransformedTargetRegressor``). Each candidate is compared split by split with the default
and with the peer: the mean paired difference and twice its standard error, on the test
score (accuracy or R^2) and the test log loss (classifiers). Fit time is CPU time
(``time.process_time``) on one torch thread; the fits of a split run in a rotated order,
reversed every other split, so no candidate always runs first; *time x* is the median over
the splits of the candidate's fit time over the default's on the same split.

Usage (one thread for torch and BLAS; pin the process to a core for the times)::

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_defaults_ab OUT.md [R]

It writes the table to ``OUT.md`` and every split's numbers to ``OUT.splits.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks._stats import paired

ROOT = Path(__file__).resolve().parent.parent

# name -> the parameters it changes; "default" changes none.
CANDIDATES = {
    "default": {},
    "alpha=1e-3": {"alpha": 1e-3},
    "alpha=2e-3": {"alpha": 2e-3},
    "alpha=3e-3": {"alpha": 3e-3},
    "alpha=5e-3": {"alpha": 5e-3},
    "alpha=1e-2": {"alpha": 1e-2},
    "hidden_layer_sizes=(100,)": {"hidden_layer_sizes": (100,)},
    "hidden_layer_sizes=(64,)": {"hidden_layer_sizes": (64,)},
    "learning_rate_init=5e-4": {"learning_rate_init": 5e-4},
    "max_iter=100": {"max_iter": 100},
    "early_stopping=True": {"early_stopping": True},
    "early_stopping=True, n_iter_no_change=30": {"early_stopping": True,
                                                 "n_iter_no_change": 30},
    "solver='adamw', alpha=1": {"solver": "adamw", "alpha": 1.0},
}


def _fit(est, X_tr, y_tr, X_te, y_te):
    """(test score, test log loss or None, CPU fit seconds, epochs run)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import log_loss
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    pipe = make_pipeline(StandardScaler(), est)
    with warnings.catch_warnings():
        # max_iter ends most of these fits, in both libraries: the epochs column shows it.
        warnings.simplefilter("ignore", ConvergenceWarning)
        t0 = time.process_time()
        pipe.fit(X_tr, y_tr)
        fit_s = time.process_time() - t0
    loss = (log_loss(y_te, pipe.predict_proba(X_te), labels=pipe.classes_)
            if hasattr(pipe, "predict_proba") else None)
    return pipe.score(X_te, y_te), loss, fit_s, getattr(est, "regressor_", est).n_iter_


def _estimators(kind, seed):
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier, PathKernelMachine

    cls = PathKernelClassifier if kind == "clf" else PathKernelMachine
    ests = {name: cls(random_state=seed, device="cpu", **params)
            for name, params in CANDIDATES.items()}
    ests["peer"] = (MLPClassifier(random_state=seed) if kind == "clf" else
                    TransformedTargetRegressor(MLPRegressor(random_state=seed),
                                               transformer=StandardScaler()))
    return ests


def run(splits: int = 10) -> dict:
    """Per data set, per estimator: lists over the splits of score, loss, fit, epochs."""
    from sklearn.model_selection import train_test_split

    from benchmarks.bench_defaults import _datasets

    results = {}
    for name, (X, y, kind) in _datasets(False).items():
        recs: dict[str, dict[str, list]] = {}
        for seed in range(splits):
            X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=seed)
            jobs = list(_estimators(kind, seed).items())
            jobs = jobs[seed % len(jobs):] + jobs[:seed % len(jobs)]
            if seed % 2:
                jobs.reverse()
            for label, est in jobs:
                rec = recs.setdefault(label, {"score": [], "loss": [], "fit": [],
                                              "epochs": []})
                for key, value in zip(("score", "loss", "fit", "epochs"),
                                      _fit(est, X_tr, y_tr, X_te, y_te)):
                    rec[key].append(value)
        results[name] = {"kind": kind, "n_train": len(X_tr), "n_test": len(X_te),
                         "estimators": recs}
        print(f"{name}: done", file=sys.stderr, flush=True)
    return results


def _worse(recs, label, ref, ratio):
    """The metrics on which ``label`` is worse than ``ref`` beyond 2 SE."""
    out = []
    p = paired(recs[label]["score"], recs[ref]["score"], ratio)
    if p.mean < -2 * p.se:
        out.append("score")
    if recs[label]["loss"][0] is not None:
        p = paired(recs[label]["loss"], recs[ref]["loss"], ratio)
        if p.mean > 2 * p.se:
            out.append("log loss")
    return ", ".join(out) or "none"


def _cell(a, b, ratio):
    p = paired(a, b, ratio)
    return f"{p.mean:+.4f} (+-{2 * p.se:.4f})"


def report(results: dict, splits: int, command: str, elapsed: float, load) -> str:
    import sklearn
    import torch

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    lines = ["# Candidate defaults against the defaults and MLPClassifier / MLPRegressor",
             "", "Provenance, written by the run:", "",
             f"- Command: `{command}`" + (
                 f", with `OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}`"
                 if "OMP_NUM_THREADS" in os.environ else ""),
             f"- Commit: {git('rev-parse', '--short=10', 'HEAD')} (tree dirty: "
             f"{'yes' if git('status', '--porcelain', '--untracked-files=no') else 'no'})",
             f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall time "
             f"{elapsed:.0f} s",
             f"- Machine: {platform.processor() or platform.machine()}, cores this process "
             f"may use: {sorted(os.sched_getaffinity(0))}, torch {torch.__version__} "
             f"({torch.get_num_threads()} thread), scikit-learn {sklearn.__version__}, "
             f"Python {platform.python_version()}",
             f"- Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}",
             "", f"From `benchmarks/bench_defaults_ab.py`, {splits} splits per data set.",
             "*vs default* / *vs peer*: the candidate's mean paired difference (candidate - "
             "other) with twice its standard error (Nadeau & Bengio's 2003 corrected resampled "
             "SE, `sqrt((1/J + n_test/n_train) * s^2)` over the J splits: the splits "
             "overlap, so the naive `s / sqrt(J)` is too small); *worse beyond 2 SE*: the "
             "metrics on which it is (score lower, log loss higher). *fit s*: median CPU seconds; "
             "*time x*: median over the splits of the candidate's fit time over the "
             "default's. The peer is MLPClassifier() (classifiers) or MLPRegressor() on "
             "standardized targets (regressors).", ""]
    head = ["data set", "estimator", "score", "score vs default", "score vs peer",
            "log loss", "log loss vs default", "log loss vs peer", "worse than default",
            "worse than peer", "epochs", "fit s", "time x"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = dict.fromkeys([*CANDIDATES, "peer"], 0.0)
    for name, res in results.items():
        recs = res["estimators"]
        ratio = res["n_test"] / res["n_train"]
        for label, rec in recs.items():
            totals[label] += statistics.median(rec["fit"])
            is_clf = rec["loss"][0] is not None
            other = label not in ("default", "peer")
            row = [name, label, f"{np.mean(rec['score']):.4f}",
                   _cell(rec["score"], recs["default"]["score"], ratio) if label != "default"
                   else "", _cell(rec["score"], recs["peer"]["score"], ratio) if label != "peer"
                   else "",
                   f"{np.mean(rec['loss']):.4f}" if is_clf else "n/a",
                   _cell(rec["loss"], recs["default"]["loss"], ratio) if is_clf and
                   label != "default" else "",
                   _cell(rec["loss"], recs["peer"]["loss"], ratio) if is_clf and label != "peer"
                   else "",
                   _worse(recs, label, "default", ratio) if other else "",
                   _worse(recs, label, "peer", ratio) if label != "peer" else "",
                   f"{statistics.median(rec['epochs']):.0f}",
                   f"{statistics.median(rec['fit']):.3f}",
                   f"{statistics.median(np.divide(rec['fit'], recs['default']['fit'])):.2f}x"
                   if label != "default" else ""]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Sum over the data sets of the median fit times (CPU s): " + "; ".join(
        f"{label} {t:.2f} ({t / totals['default']:.2f}x)" for label, t in totals.items()),
        ""]
    return "\n".join(lines)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    splits = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    results = run(splits)
    elapsed = time.perf_counter() - t0
    load.append(os.getloadavg()[0])
    command = "python -m benchmarks.bench_defaults_ab " + " ".join(sys.argv[1:])
    out.write_text(report(results, splits, command, elapsed, load))
    # Not OUT.json: tests/test_docs_numbers.py reads a results file's .json as its
    # numbers, and thousands of raw per-split values would hold almost any quote.
    out.with_name(out.stem + ".splits.json").write_text(json.dumps(results, indent=1))
