"""TangentFeatureSVM() at its defaults against two variants, paired by split with MLPClassifier.

Each data set is split 75/25 (``train_test_split(random_state=s)``) and
``make_pipeline(StandardScaler(), TangentFeatureSVM(PathKernelClassifier(random_state=s)))``
is fitted as ``bench_defaults`` fits it: its test accuracy is ``default`` (the cosine-
normalized tangent kernel, ``C="auto"``); ``MLPClassifier(random_state=s)`` on the same
split is ``mlp``, the network's own predictions ``net``. On the same trained network:

- ``N_1se``: the normalized tangent Gram with C chosen by the one-standard-error rule
  (Breiman et al. 1984; Hastie, Tibshirani & Friedman, section 7.10) over C="auto"'s grid
  and folds: the smallest C (the widest margin) whose mean fold accuracy is within one
  standard error (over the folds) of the best.
- ``P_auto`` / ``P_1se``: the cosine-normalized path kernel (``PathKernel(normalized=True)``,
  ``svm_kernel="path"``) with C="auto"'s rule / the one-standard-error rule.

Data sets are ``bench_svm_normalize_ab.SETS`` (``H:*`` are not in the defaults benchmark).
``KERNELS=N`` in the environment leaves out the path kernel's columns (the costly ones:
one Gram per recorded point). One thread for torch and BLAS. Usage::

    python -m benchmarks.bench_svm_auto_ab wine 0 200 out.jsonl   # seeds 0..199
    python -m benchmarks.bench_svm_auto_ab --summary out.jsonl [more.jsonl ...]
"""

import json
import os

import numpy as np
from sklearn.model_selection import StratifiedKFold
from sklearn.svm import SVC

from skpathkernel import PathKernel, TangentKernel

from .bench_svm_normalize_ab import AUTO, _acc, fitted_splits, main

KEYS = ("default", "net", "N_1se", "P_auto", "P_1se")


def _fold_scores(K, y, C):
    n = min(3, int(np.unique(y, return_counts=True)[1].min()))
    return np.asarray([
        np.mean(SVC(kernel="precomputed", C=C).fit(K[np.ix_(tr, tr)], y[tr])
                .predict(K[np.ix_(te, tr)]) == y[te])
        for tr, te in StratifiedKFold(n).split(K, y)])


def _choose(K, y, rule):
    """C="auto"'s grid and folds; "first": its rule, "1se": the one-standard-error rule."""
    grid = [c / float(np.mean(np.diag(K))) for c in AUTO]
    scores = [_fold_scores(K, y, C) for C in grid]
    means = np.asarray([s.mean() for s in scores])
    best = int(np.argmax(means))  # the first (smallest C) among the best
    if rule == "first":
        return grid[best]
    se = scores[best].std(ddof=1) / np.sqrt(len(scores[best]))
    return grid[int(np.flatnonzero(means >= means[best] - se)[0])]


def run(name, seeds, out):
    for rec, est, X_test, y_tr, y_te in fitted_splits(name, seeds, "default"):
        kernels = {"N": TangentKernel(est, normalized=True),
                   "P": PathKernel(est, normalized=True)}
        for tag in os.environ.get("KERNELS", "N,P").split(","):
            kernel = kernels[tag]
            K = np.asarray(kernel(est.X_fit_), np.float64)
            K_test = np.asarray(kernel(X_test, est.X_fit_), np.float64)
            for rule in ("first", "1se"):
                if tag == "N" and rule == "first":
                    # The default itself: the same Gram and rule as its pipeline.
                    assert _choose(K, y_tr, rule) == est.C_
                    continue
                label = f"{tag}_{'auto' if rule == 'first' else rule}"
                rec[label] = _acc(K, K_test, y_tr, y_te, _choose(K, y_tr, rule))
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(name, {k: v for k, v in rec.items() if k != "set"}, flush=True)


def _diff(rows, key):
    """Mean of key - mlp over the rows that have key, twice its standard error, count."""
    d = np.asarray([r[key] - r["mlp"] for r in rows if key in r])
    if len(d) < 2:
        return None
    return d.mean(), 2 * d.std(ddof=1) / np.sqrt(len(d)), len(d)


def summary(paths):
    """Per data set and variant: the paired difference to MLPClassifier (+- 2 SE, splits);
    then per variant the sets below MLPClassifier, and the worst."""
    # Runs of the same split with other KERNELS are one record (same mlp and default).
    merged: dict = {}
    for line in (line for p in paths for line in open(p)):
        r = json.loads(line)
        merged.setdefault((r["set"], r["seed"]), {}).update(r)
    rows = list(merged.values())
    sets = list(dict.fromkeys(r["set"] for r in rows))
    print("| data set | MLPClassifier | " + " | ".join(KEYS) + " |")
    print("|---" * (2 + len(KEYS)) + "|")
    per_key = {k: [] for k in KEYS}
    for name in sets:
        rs = [r for r in rows if r["set"] == name]
        cells = []
        for k in KEYS:
            d = _diff(rs, k)
            if d is None:
                cells.append("")
                continue
            per_key[k].append((*d, name))
            cells.append(f"{d[0]:+.4f} (+-{d[1]:.4f}, {d[2]})")
        print(f"| {name} | {np.mean([r['mlp'] for r in rs]):.4f} | " + " | ".join(cells)
              + " |")
    print("\n| variant | sets | below MLPClassifier | below by more than 2 SE | worst |")
    print("|---|---|---|---|---|")
    for k, w in per_key.items():
        if w:
            m = min(w)
            print(f"| {k} | {len(w)} | {sum(x[0] < 0 for x in w)} | "
                  f"{sum(x[0] < -x[1] for x in w)} | {m[0]:+.4f} ({m[3]}) |")


if __name__ == "__main__":
    main(run, summary)
