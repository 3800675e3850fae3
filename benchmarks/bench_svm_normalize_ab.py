"""TangentFeatureSVM's SVM, raw or cosine-normalized kernel, against MLPClassifier.

One network per split: each data set is split 75/25 (``train_test_split(random_state=s)``),
``make_pipeline(StandardScaler(), TangentFeatureSVM(PathKernelClassifier(random_state=s)))``
is fitted as ``bench_defaults`` fits it (its score is ``cur``, the raw kernel with
``C="auto"``), and ``MLPClassifier(random_state=s)`` on the same split (``mlp``). On that
trained network, SVMs on Grams of the same training set are scored on the test rows:
``T_*`` the raw tangent kernel, ``N_*`` the cosine-normalized one
(``TangentKernel(normalized=True)``), ``E_*`` (unless ``LIGHT=1``) the sum of the raw
tangent kernels at 80 %, 90 % and 100 % of the path; ``*_C<c>`` a fixed ``C = c / mean
diag``, ``*_auto`` C="auto"'s rule (3-fold CV over (0.1, 1, 10, 100, 1000) / mean diag,
the smallest on ties), ``_auto_fine`` over a finer grid, ``_auto5`` 5 folds,
``_auto_last`` the largest C on ties, ``_auto_bal`` class_weight="balanced"; ``net`` the
network's own predictions. Data sets ``H:*`` are not in the defaults benchmark (held out).
One thread for torch and BLAS. Usage::

    python -m benchmarks.bench_svm_normalize_ab wine,iris 0 20 out.jsonl   # seeds 0..19
    python -m benchmarks.bench_svm_normalize_ab --summary out.jsonl [more.jsonl ...]

The summary prints, per data set and variant, the mean paired difference to
MLPClassifier with twice its standard error (paired by split; Nadeau & Bengio's corrected
one, ``benchmarks._stats.paired``: the splits overlap).
"""

import collections
import json
import os
import sys
import time
import warnings

import numpy as np
import torch
from sklearn import datasets as D
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import StratifiedKFold, train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC
from threadpoolctl import threadpool_limits

from benchmarks._stats import paired, split_ratio
from skpathkernel import PathKernelClassifier, TangentFeatureSVM, TangentKernel

LIGHT = os.environ.get("LIGHT") == "1"


def _digits_pair(a, b):
    X, y = D.load_digits(return_X_y=True)
    keep = (y == a) | (y == b)
    return X[keep], y[keep]


SETS = {
    "iris": lambda: D.load_iris(return_X_y=True),
    "wine": lambda: D.load_wine(return_X_y=True),
    "breast_cancer": lambda: D.load_breast_cancer(return_X_y=True),
    "make_classification": lambda: D.make_classification(random_state=0),
    "make_moons(noise=0.3)": lambda: D.make_moons(noise=0.3, random_state=0),
    "digits": lambda: D.load_digits(return_X_y=True),
    # Held out: not in the defaults benchmark.
    "H:mc(rs=1)": lambda: D.make_classification(random_state=1),
    "H:mc(200;10f;rs=2)": lambda: D.make_classification(200, 10, n_informative=5,
                                                         random_state=2),
    "H:mc(3cls;rs=3)": lambda: D.make_classification(150, 8, n_informative=4, n_classes=3,
                                                      random_state=3),
    "H:mc(flip.1;rs=4)": lambda: D.make_classification(120, 20, n_informative=3,
                                                        flip_y=0.1, random_state=4),
    "H:circles": lambda: D.make_circles(200, noise=0.1, factor=0.5, random_state=0),
    "H:gauss_quantiles": lambda: D.make_gaussian_quantiles(n_samples=200, n_features=2,
                                                           n_classes=3, random_state=0),
    "H:blobs": lambda: D.make_blobs(200, centers=4, cluster_std=2.5, random_state=0),
    "H:hastie": lambda: tuple(a[:300] for a in D.make_hastie_10_2(random_state=0)),
    "H:moons(n=200;.2)": lambda: D.make_moons(200, noise=0.2, random_state=5),
    "H:digits3v8": lambda: _digits_pair(3, 8),
    "H:digits1v7": lambda: _digits_pair(1, 7),
}
GRID = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 1000.0)
AUTO = (0.1, 1.0, 10.0, 100.0, 1000.0)  # C="auto"'s grid


def _acc(K, K_test, y, y_test, C, **kw):
    svm = SVC(kernel="precomputed", C=C, **kw).fit(K, y)
    return float(np.mean(svm.predict(K_test) == y_test))


def _choose(K, y, grid, folds=3, rule="first", **kw):
    """C="auto"'s rule, with the grid, folds, tie rule and class weights as parameters."""
    scale = float(np.mean(np.diag(K)))
    cands = [c / scale for c in grid]
    n = min(folds, int(np.unique(y, return_counts=True)[1].min()))
    if n < 2:
        return 1.0 / scale
    splits = list(StratifiedKFold(n).split(K, y))
    scores = np.asarray([
        np.mean([_acc(K[np.ix_(tr, tr)], K[np.ix_(te, tr)], y[tr], y[te], C, **kw)
                 for tr, te in splits])
        for C in cands])
    if rule == "first":
        return cands[int(np.argmax(scores))]
    return cands[len(scores) - 1 - int(np.argmax(scores[::-1]))]  # "last"


def _grams(est, X_test, **kw):
    kernel = TangentKernel(est, **kw)
    return (np.asarray(kernel(est.X_fit_), np.float64),
            np.asarray(kernel(X_test, est.X_fit_), np.float64))


def fitted_splits(name, seeds, key, **svm_params):
    """Per split of ``name``: the record of MLPClassifier's and the pipeline's scores
    (the pipeline's under ``key``) and CPU times, the fitted TangentFeatureSVM, the
    scaled test inputs and both label arrays; the caller's work for the split runs on
    one BLAS thread too (the generator is suspended inside the limit)."""
    X, y = SETS[name]()
    for s in seeds:
        X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=s)
        rec = {"set": name, "seed": s}
        with threadpool_limits(1):
            t = time.process_time()
            mlp = make_pipeline(StandardScaler(), MLPClassifier(random_state=s)).fit(X_tr, y_tr)
            rec["mlp"] = float(mlp.score(X_te, y_te))
            rec["t_mlp"] = time.process_time() - t
            t = time.process_time()
            pipe = make_pipeline(StandardScaler(),
                                 TangentFeatureSVM(PathKernelClassifier(random_state=s),
                                                   **svm_params)).fit(X_tr, y_tr)
            rec["t_ours"] = time.process_time() - t
            rec[key] = float(pipe.score(X_te, y_te))
            est, X_test = pipe[-1], pipe[0].transform(X_te)
            # The SVM saw every training row (train_indices_ is arange(n) since 48da5b2,
            # None before).
            rows = est.estimator_.train_indices_
            assert rows is None or np.array_equal(rows, np.arange(len(y_tr)))
            rec["net"] = float(est.estimator_.score(X_test, y_te))
            yield rec, est, X_test, np.asarray(y_tr), np.asarray(y_te)


def run(name, seeds, out):
    for rec, est, X_test, y_tr, y_te in fitted_splits(name, seeds, "cur", normalize=False):
        t = time.process_time()
        grams = {"T": _grams(est, X_test)}
        rec["t_gram"] = time.process_time() - t
        grams["N"] = _grams(est, X_test, normalized=True)
        if not LIGHT:  # the sum of the tangent kernels of three points near the end
            last = len(est.trajectory_) - 1
            parts = [_grams(est, X_test, step=k)
                     for k in sorted({last, int(0.9 * last), int(0.8 * last)})]
            grams["E"] = tuple(sum(p[i] for p in parts) for i in (0, 1))
        for tag, (K, K_test) in grams.items():
            scale = float(np.mean(np.diag(K)))
            for c in GRID:
                rec[f"{tag}_C{c:g}"] = _acc(K, K_test, y_tr, y_te, c / scale)
            for label, kw in {"auto": {}, "auto_fine": dict(grid=GRID),
                              "auto5": dict(folds=5), "auto_last": dict(rule="last")}.items():
                C = _choose(K, y_tr, **{"grid": AUTO, **kw})
                rec[f"{tag}_{label}"] = _acc(K, K_test, y_tr, y_te, C)
            C = _choose(K, y_tr, AUTO, class_weight="balanced")
            rec[f"{tag}_auto_bal"] = _acc(K, K_test, y_tr, y_te, C,
                                          class_weight="balanced")
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(name, rec["seed"], rec["mlp"], rec["cur"], rec["T_auto"], rec["N_auto"], flush=True)


def summary(paths):
    rows = [json.loads(line) for p in paths for line in open(p)]
    by = collections.defaultdict(list)
    for r in rows:
        by[r["set"]].append(r)
    keys = ["cur", "net"] + [k for k in rows[-1] if k[:2] in ("T_", "N_", "E_")]
    keys = [k for k in keys if all(k in r for r in rows)]
    print("| data set | splits | MLPClassifier | " + " | ".join(keys) + " |")
    print("|---" * (3 + len(keys)) + "|")
    worst = {k: [] for k in keys}
    for name, rs in by.items():
        cells = []
        ratio = split_ratio(len(SETS[name]()[1]))
        for k in keys:
            p = paired([r[k] for r in rs], [r["mlp"] for r in rs], ratio)
            worst[k].append((p.mean, p.se, name))
            cells.append(f"{p.mean:+.4f} (+-{2 * p.se:.4f})")
        mean_mlp = np.mean([r["mlp"] for r in rs])
        print(f"| {name} | {len(rs)} | {mean_mlp:.4f} | " + " | ".join(cells) + " |")
    print("\n| variant | sets below MLPClassifier | below by more than 2 SE | worst | "
          "mean over sets |")
    print("|---|---|---|---|---|")
    for k in keys:
        w = worst[k]
        m = min(w)
        print(f"| {k} | {sum(x[0] < 0 for x in w)} | {sum(x[0] < -2 * x[1] for x in w)} | "
              f"{m[0]:+.4f} ({m[2]}) | {np.mean([x[0] for x in w]):+.4f} |")


def main(run, summary):
    """The command line of these A/B scripts: ``--summary FILE...`` or ``SETS FIRST STOP OUT``."""
    if sys.argv[1] == "--summary":
        summary(sys.argv[2:])
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", ConvergenceWarning)
    with open(sys.argv[4], "a") as out:
        for name in sys.argv[1].split(","):
            run(name, range(int(sys.argv[2]), int(sys.argv[3])), out)


if __name__ == "__main__":
    main(run, summary)
