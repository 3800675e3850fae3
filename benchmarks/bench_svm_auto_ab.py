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

``KERNELS=V`` (second round, ``svm_auto_ab2.md``): on the same normalized tangent Gram
``K`` (the unit rows ``u(x) = phi(x) / ||phi(x)||``), each with C="auto"'s grid and rule
unless said:

- ``N_rep5``: C by 5 repeats of stratified 3-fold CV (``RepeatedStratifiedKFold``,
  ``random_state=0``; the mean over the 15 folds), the smallest C on ties.
- ``N_bal``: ``class_weight="balanced"`` in the CV and the final SVM.
- ``N_cen``: the unit rows centred on their training mean, then unit again (a kernel
  correlation rather than a cosine).
- ``N_sq``: ``K**2`` (the degree-2 homogeneous polynomial kernel of ``u``).
- ``N_rbf``: ``exp(-||u - u'||^2) = exp(2K - 2)``, SVC's RBF kernel with
  ``gamma="scale"`` for centred unit rows.
- ``N_out``: ``K`` plus the cosine kernel of the network's softmax outputs.
- ``N_joint``: ``K`` or ``K**2`` and C chosen together by the same CV (``K`` on ties).
- ``T_mlpnet``: the default pipeline with MLPClassifier's network as trainer
  (``PathKernelClassifier(hidden_layer_sizes=(100,), activation="relu")``, its own fit).

The summary shows seeds 200 and above of a set as their own row (a fresh check of
variants chosen on seeds 0-199).

Data sets are ``bench_svm_normalize_ab.SETS`` (``H:*`` are not in the defaults benchmark).
``KERNELS=N`` in the environment leaves out the path kernel's columns (the costly ones:
one Gram per recorded point). One thread for torch and BLAS. Usage::

    python -m benchmarks.bench_svm_auto_ab wine 0 200 out.jsonl   # seeds 0..199
    python -m benchmarks.bench_svm_auto_ab --summary out.jsonl [more.jsonl ...]
"""

import json
import os
import time

import numpy as np
from sklearn.model_selection import RepeatedStratifiedKFold, StratifiedKFold, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from benchmarks._stats import paired, split_ratio
from skpathkernel import PathKernel, PathKernelClassifier, TangentFeatureSVM, TangentKernel

from .bench_svm_normalize_ab import AUTO, SETS, _acc, fitted_splits, main

KEYS = ("default", "net", "N_1se", "P_auto", "P_1se")
KEYS_V = ("default", "N_rep5", "N_bal", "N_cen", "N_sq", "N_rbf", "N_out", "N_joint",
          "T_mlpnet")
MLP_NET = dict(hidden_layer_sizes=(100,), activation="relu")


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


def _cv_means(K, y, splits, grid=AUTO, **kw):
    """Mean fold accuracy of each C of ``grid / mean diag`` (and the Cs)."""
    cands = [c / float(np.mean(np.diag(K))) for c in grid]
    return np.asarray([np.mean([
        _acc(K[np.ix_(tr, tr)], K[np.ix_(te, tr)], y[tr], y[te], C, **kw)
        for tr, te in splits]) for C in cands]), cands


def _auto(K, y, repeats=1, **kw):
    """C="auto"'s rule (the first best), with repeated folds and SVC options."""
    n = min(3, int(np.unique(y, return_counts=True)[1].min()))
    splits = (StratifiedKFold(n) if repeats == 1 else
              RepeatedStratifiedKFold(n_splits=n, n_repeats=repeats, random_state=0))
    means, cands = _cv_means(K, y, list(splits.split(K, y)), **kw)
    return cands[int(np.argmax(means))], float(means.max())


def _unit_cos(F):
    return F / np.linalg.norm(F, axis=1, keepdims=True)


def _softmax(z):
    z = z[:, None] * np.array([-0.5, 0.5]) if z.ndim == 1 else z
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _variants(rec, est, X_test, y_tr, y_te):
    """The ``KERNELS=V`` columns of one split (see the module docstring)."""
    kernel = TangentKernel(est, normalized=True)
    K = np.asarray(kernel(est.X_fit_), np.float64)
    Kt = np.asarray(kernel(X_test, est.X_fit_), np.float64)
    assert _auto(K, y_tr)[0] == est.C_
    rec["N_rep5"] = _acc(K, Kt, y_tr, y_te, _auto(K, y_tr, repeats=5)[0])
    C = _auto(K, y_tr, class_weight="balanced")[0]
    rec["N_bal"] = _acc(K, Kt, y_tr, y_te, C, class_weight="balanced")
    # Centring unit rows from their Gram (diagonal 1): u - m, with m the training mean.
    col, tot = K.mean(axis=0), K.mean()
    Kc = K - col[:, None] - col[None, :] + tot
    Kct = Kt - Kt.mean(axis=1)[:, None] - col[None, :] + tot
    d, dt = np.sqrt(np.diag(Kc)), np.sqrt(1 - 2 * Kt.mean(axis=1) + tot)
    Kc, Kct = Kc / np.outer(d, d), Kct / np.outer(dt, d)
    rec["N_cen"] = _acc(Kc, Kct, y_tr, y_te, _auto(Kc, y_tr)[0])
    rec["N_sq"] = _acc(K**2, Kt**2, y_tr, y_te, _auto(K**2, y_tr)[0])
    Kr, Krt = np.exp(2 * K - 2), np.exp(2 * Kt - 2)
    rec["N_rbf"] = _acc(Kr, Krt, y_tr, y_te, _auto(Kr, y_tr)[0])
    P = _unit_cos(_softmax(np.asarray(est.estimator_.decision_function(est.X_fit_))))
    Pt = _unit_cos(_softmax(np.asarray(est.estimator_.decision_function(X_test))))
    Ko, Kot = K + P @ P.T, Kt + Pt @ P.T
    rec["N_out"] = _acc(Ko, Kot, y_tr, y_te, _auto(Ko, y_tr)[0])
    (C1, s1), (C2, s2) = _auto(K, y_tr), _auto(K**2, y_tr)
    rec["N_joint"] = (_acc(K, Kt, y_tr, y_te, C1) if s1 >= s2
                      else _acc(K**2, Kt**2, y_tr, y_te, C2))


def run(name, seeds, out):
    tags = os.environ.get("KERNELS", "N,P").split(",")
    X, y = SETS[name]()
    for rec, est, X_test, y_tr, y_te in fitted_splits(name, seeds, "default"):
        if "V" in tags:
            _variants(rec, est, X_test, y_tr, y_te)
            # T_mlpnet: its own fit on the same split (one BLAS thread: fitted_splits
            # holds the limit while suspended), CPU time as fitted_splits times the default.
            X_tr, X_te, y_tr2, y_te2 = train_test_split(X, y, random_state=rec["seed"])
            t = time.process_time()
            pipe = make_pipeline(StandardScaler(), TangentFeatureSVM(
                PathKernelClassifier(random_state=rec["seed"], **MLP_NET))).fit(X_tr, y_tr2)
            rec["t_mlpnet"] = time.process_time() - t
            rec["T_mlpnet"] = float(pipe.score(X_te, y_te2))
        kernels = {"N": TangentKernel(est, normalized=True),
                   "P": PathKernel(est, normalized=True)}
        for tag in (t for t in tags if t != "V"):
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
    """Mean of key - mlp over the rows that have key, twice its (corrected) standard
    error, count."""
    rs = [r for r in rows if key in r]
    if len(rs) < 2:
        return None
    p = paired([r[key] for r in rs], [r["mlp"] for r in rs],
               split_ratio(len(SETS[rs[0]["set"]]()[1])))
    return p.mean, 2 * p.se, p.splits


def summary(paths):
    """Per data set and variant: the paired difference to MLPClassifier (+- 2 SE, Nadeau &
    Bengio's corrected one as the splits overlap; splits);
    then per variant the sets below MLPClassifier, the worst and the sum over the held-out
    sets. Seeds 200 and above are their own row (``"<set> (seeds 200+)"``)."""
    # Runs of the same split with other KERNELS are one record (same mlp and default).
    merged: dict = {}
    for line in (line for p in paths for line in open(p)):
        r = json.loads(line)
        merged.setdefault((r["set"], r["seed"]), {}).update(r)
    rows = list(merged.values())
    for r in rows:
        r["row"] = r["set"] if r["seed"] < 200 else f"{r['set']} (seeds 200+)"
    keys = KEYS_V if any("N_rep5" in r for r in rows) else KEYS
    sets = list(dict.fromkeys(r["row"] for r in rows))
    print("| data set | MLPClassifier | " + " | ".join(keys) + " |")
    print("|---" * (2 + len(keys)) + "|")
    per_key = {k: [] for k in keys}
    for name in sets:
        rs = [r for r in rows if r["row"] == name]
        cells = []
        for k in keys:
            d = _diff(rs, k)
            if d is None:
                cells.append("")
                continue
            per_key[k].append((*d, name))
            cells.append(f"{d[0]:+.4f} (+-{d[1]:.4f}, {d[2]})")
        print(f"| {name} | {np.mean([r['mlp'] for r in rs]):.4f} | " + " | ".join(cells)
              + " |")
    print("\n| variant | sets | below MLPClassifier | below by more than 2 SE | worst | "
          "sum over the H: sets |")
    print("|---|---|---|---|---|---|")
    for k, w in per_key.items():
        if w:
            m = min(w)
            held = sum(x[0] for x in w if x[3].startswith("H:"))
            print(f"| {k} | {len(w)} | {sum(x[0] < 0 for x in w)} | "
                  f"{sum(x[0] < -x[1] for x in w)} | {m[0]:+.4f} ({m[3]}) | {held:+.4f} |")
    timed = [r for r in rows if "t_mlpnet" in r]
    if timed:
        # CPU time of both pipelines' fits, alternating in one process, split by split.
        print(f"\nT_mlpnet / default fit CPU time: median ratio over {len(timed)} splits "
              f"{np.median([r['t_mlpnet'] / r['t_ours'] for r in timed]):.2f}, total "
              f"{sum(r['t_mlpnet'] for r in timed) / sum(r['t_ours'] for r in timed):.2f}")


if __name__ == "__main__":
    main(run, summary)
