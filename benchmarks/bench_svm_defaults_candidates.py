"""Candidate default changes for TangentFeatureSVM() against MLPClassifier() (issue 30, item 6).

``svm_defaults_splits-s47.md`` found ``TangentFeatureSVM()`` below ``MLPClassifier()`` on
wine (-0.0014 +- 0.0008, 2 naive SE, 2000 splits), a deficit of the trained network (the
SVM minus its own network -0.0003). This script measures the smallest changes of the
defaults that might close it, split by split, with ``bench_defaults``' protocol: split
``s`` is ``train_test_split(X, y, random_state=s)``, every estimator is
``make_pipeline(StandardScaler(), est)`` with ``random_state=s``.

Per split it fits ``MLPClassifier(random_state=s)`` (``mlp``), the default pipeline
``TangentFeatureSVM(PathKernelClassifier(random_state=s))`` (``default``; ``net`` the same
network's own predictions, which are ``PathKernelClassifier()``'s) and, for each network
candidate ``c`` of ``NETS``, ``TangentFeatureSVM(PathKernelClassifier(random_state=s,
**NETS[c]))`` (``c``; ``c:net`` its network's predictions; ``t:c`` the pipeline's fit CPU
time, ``it:c`` its network's epochs). The fits of a split run in an order rotated by the
seed, reversed every other split, so no candidate always runs first. On the default's
network, without training another, two SVM-side candidates (``SVMS``):

- ``S_in``: the default's kernel (the cosine-normalized tangent kernel ``K``) plus the
  cosine kernel of the (standardized) inputs, ``K + x.x' / (|x| |x'|)``: the input
  space's linear kernel beside the network's, which neither earlier round tried.
- ``S_init``: the cosine-normalized tangent kernel at the initial parameters (step 0),
  the kernel of the untrained network.

Both choose ``C`` by ``C="auto"``'s rule on their own Gram; ``t:S_*`` is the default's fit
time plus that SVM stage's CPU time less the default's own SVM stage (recomputed here:
its Gram and ``C`` must equal the pipeline's, which is checked).

``BASELINE=0`` in the environment fits the network candidates only, for splits whose
``mlp`` / ``default`` / ``net`` the earlier rounds' records hold (``summary`` merges the
files by set and seed; their reproduction is checked on the splits this script refits).

One thread for torch and BLAS (``threadpool_limits(1)``, ``torch.set_num_threads(1)``).
Records (JSON lines, one per split) carry ``set``, ``seed`` and the columns above, so
``audit_svm_splits`` and the summary here read them with the earlier rounds' files (the
same ``set`` / ``seed`` / ``mlp`` / ``default`` / ``net`` keys). Usage::

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_svm_defaults_candidates \\
        wine 0 400 OUT.jsonl ["CANDIDATE;..."]
    python -m benchmarks.bench_svm_defaults_candidates --decompose   # alpha's exactness
    python -m benchmarks.bench_svm_defaults_candidates --summary OUT.jsonl [...] \\
        [--ranges 0:400,0:2000]
"""

import json
import os
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from benchmarks._stats import paired, split_ratio
from skpathkernel import PathKernelClassifier, TangentFeatureSVM, TangentKernel

from .bench_svm_auto_ab import _choose
from .bench_svm_normalize_ab import SETS, _acc

# Network candidates: the defaults with these parameters (one change each).
NETS = {
    "alpha=1e-4": dict(alpha=1e-4),
    "alpha=1e-3": dict(alpha=1e-3),
    "hidden=(100,)": dict(hidden_layer_sizes=(100,)),
    "hidden=(128,128)": dict(hidden_layer_sizes=(128, 128)),
    "tanh": dict(activation="tanh"),
    "softplus": dict(activation="softplus"),
    "max_iter=400": dict(max_iter=400),
    "tol=1e-5": dict(tol=1e-5),
    "batch_size=64": dict(batch_size=64),
    "lr=2e-3": dict(learning_rate_init=2e-3),
}
SVMS = ("S_in", "S_init")
# BASELINE=0: fit the candidates only (not MLPClassifier, the default or the SVM-side
# candidates), for splits whose mlp / default / net the earlier rounds' records hold.
BASELINE = os.environ.get("BASELINE", "1") != "0"


def _pipe(seed, **params):
    return make_pipeline(
        StandardScaler(), TangentFeatureSVM(PathKernelClassifier(random_state=seed, **params))
    )


def _svm_stage(est, X_test, y_tr, y_te):
    """The SVM-side candidates' scores on the default's network, and their SVM stages'
    CPU times against the default's own (its Gram and C, recomputed and checked)."""
    X_fit = est.X_fit_
    out, times = {}, {}
    t = time.process_time()
    kernel = TangentKernel(est, normalized=True)
    K, Kt = (np.asarray(kernel(X_fit), np.float64), np.asarray(kernel(X_test, X_fit), np.float64))
    C = _choose(K, y_tr, "first")
    base = _acc(K, Kt, y_tr, y_te, C)
    times["N"] = time.process_time() - t
    assert C == est.C_, (C, est.C_)
    out["N_check"] = base
    t = time.process_time()
    K, Kt = (np.asarray(kernel(X_fit), np.float64), np.asarray(kernel(X_test, X_fit), np.float64))
    U = X_fit / np.linalg.norm(X_fit, axis=1, keepdims=True)
    Ut = X_test / np.linalg.norm(X_test, axis=1, keepdims=True)
    Ki, Kit = K + U @ U.T, Kt + Ut @ U.T
    out["S_in"] = _acc(Ki, Kit, y_tr, y_te, _choose(Ki, y_tr, "first"))
    times["S_in"] = time.process_time() - t
    t = time.process_time()
    init = TangentKernel(est, step=0, normalized=True)
    K0, K0t = (np.asarray(init(X_fit), np.float64), np.asarray(init(X_test, X_fit), np.float64))
    out["S_init"] = _acc(K0, K0t, y_tr, y_te, _choose(K0, y_tr, "first"))
    times["S_init"] = time.process_time() - t
    return out, times


def run(name, seeds, out, cands):
    X, y = SETS[name]()
    for s in seeds:
        X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=s)
        rec = {"set": name, "seed": s}
        jobs = ["mlp", "default", *cands] if BASELINE else list(cands)
        k = s % len(jobs)
        jobs = jobs[k:] + jobs[:k]
        if s % 2:
            jobs = jobs[::-1]
        with threadpool_limits(1):
            for job in jobs:
                t = time.process_time()
                if job == "mlp":
                    m = make_pipeline(StandardScaler(), MLPClassifier(random_state=s))
                    m.fit(X_tr, y_tr)
                    rec["t:mlp"] = time.process_time() - t
                    rec["mlp"] = float(m.score(X_te, y_te))
                    rec["it:mlp"] = int(m[-1].n_iter_)
                    continue
                pipe = _pipe(s, **({} if job == "default" else NETS[job]))
                pipe.fit(X_tr, y_tr)
                rec[f"t:{job}"] = time.process_time() - t
                rec[job] = float(pipe.score(X_te, y_te))
                est, X_test = pipe[-1], pipe[0].transform(X_te)
                rec[f"{job}:net" if job != "default" else "net"] = float(
                    est.estimator_.score(X_test, y_te)
                )
                rec[f"it:{job}"] = int(est.estimator_.n_iter_)
                if job == "default":
                    default = (est, X_test)
            if BASELINE:
                scores, times = _svm_stage(*default, np.asarray(y_tr), np.asarray(y_te))
        if BASELINE:
            assert scores.pop("N_check") == rec["default"]
            rec.update(scores)
            for v in SVMS:
                rec[f"t:{v}"] = rec["t:default"] + times[v] - times["N"]
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(
            name,
            s,
            {
                k: v
                for k, v in rec.items()
                if not k.startswith(("t:", "it:")) and k not in ("set", "seed")
            },
            flush=True,
        )


def _time_cells(rs, key):
    """Fit time against the default (median of the per-split ratios, ratio of the totals)
    and against MLPClassifier (ratio of the totals), over the records (as written, not
    merged: one process's times) that timed all three."""
    base = "default" if key == "net" else key.split(":")[0]
    tk = "t:" + base
    timed = [r for r in rs if tk in r and "t:default" in r and "t:mlp" in r]
    if not timed or key.endswith(":net"):
        return "", ""
    to_mlp = f"{sum(r[tk] for r in timed) / sum(r['t:mlp'] for r in timed):.2f}x"
    if base == "default":
        return "", to_mlp
    med = np.median([r[tk] / r["t:default"] for r in timed])
    tot = sum(r[tk] for r in timed) / sum(r["t:default"] for r in timed)
    return f"{med:.2f}x, {tot:.2f}x ({len(timed)})", to_mlp


def summary(paths, ranges=None):
    """Per data set, seed range and candidate: the mean paired difference to
    MLPClassifier with 2 naive and 2 corrected SE (``benchmarks._stats.paired``), the
    splits below / equal / above it and the net count of test samples; the difference to
    the default (2 naive SE) and the splits where the two differ; the median epochs; the
    fit time against the default and against MLPClassifier. Records of one (set, seed) in
    several files are merged (the earlier rounds' files give ``mlp`` / ``default`` /
    ``net`` where this script did not refit them); only splits with a candidate count."""
    merged: dict = {}
    raw = []
    for line in (line for p in paths for line in open(p)):
        r = json.loads(line)
        merged.setdefault((r["set"], r["seed"]), {}).update(r)
        raw.append(r)
    cand_keys = (*NETS, *[f"{c}:net" for c in NETS], *SVMS)
    rows = [r for r in merged.values() if any(k in r for k in cand_keys)]
    keys = ["default", "net"] + [k for k in cand_keys if any(k in r for r in rows)]
    print(
        "| data set | seeds | candidate | splits | MLPClassifier | cand. - MLPClassifier "
        "| +- 2 naive SE | +- 2 corrected SE | below / equal / above | net test samples "
        "| cand. - default | +- 2 naive SE | differs from default | epochs (median) "
        "| fit time / default (median, total; splits) | fit time / MLPClassifier (total) |"
    )
    print("|---" * 16 + "|")
    for name in dict.fromkeys(r["set"] for r in rows):
        n = len(SETS[name]()[1])
        n_test, ratio = int(np.ceil(0.25 * n)), split_ratio(n)
        for lo, hi in ranges or [(0, 10**9)]:
            for key in keys:
                rs = sorted(
                    (
                        r
                        for r in rows
                        if r["set"] == name
                        and lo <= r["seed"] < hi
                        and key in r
                        and "mlp" in r
                        and "default" in r
                    ),
                    key=lambda r: r["seed"],
                )
                if len(rs) < 2:
                    continue
                a, m = np.array([r[key] for r in rs]), np.array([r["mlp"] for r in rs])
                p = paired(a, m, ratio)
                q = paired(a, [r["default"] for r in rs], ratio)
                d = np.rint((a - m) * n_test).astype(int)
                e = np.rint((a - np.array([r["default"] for r in rs])) * n_test).astype(int)
                it_key = "it:default" if key == "net" else "it:" + key.split(":")[0]
                it = [r[it_key] for r in rs if it_key in r]
                tcell, tm = _time_cells(
                    [q for q in raw if q["set"] == name and lo <= q["seed"] < hi], key
                )
                label = {"default": "TangentFeatureSVM()", "net": "PathKernelClassifier()"}
                print(
                    f"| {name} | {rs[0]['seed']}-{rs[-1]['seed']} | {label.get(key, key)} "
                    f"| {p.splits} | {m.mean():.4f} | {p.mean:+.4f} | +-{2 * p.naive_se:.4f} "
                    f"| +-{2 * p.se:.4f} | {(d < 0).sum()} / {(d == 0).sum()} / "
                    f"{(d > 0).sum()} | {d.sum():+d} | {q.mean:+.4f} | "
                    f"+-{2 * q.naive_se:.4f} | {(e != 0).sum()} | "
                    f"{np.median(it) if it else ''} | {tcell} | {tm} |"
                )
    # The defaults benchmark's total: per data set the mean fit time per split over the
    # records that timed MLPClassifier, the default and the candidate, summed over the sets.
    for key in (k for k in keys[2:] if not k.endswith(":net")):
        tot = {"t:mlp": 0.0, "t:default": 0.0, "t:" + key: 0.0}
        sets = []
        for name in dict.fromkeys(r["set"] for r in rows):
            timed = [q for q in raw if q["set"] == name and all(k in q for k in tot)]
            if timed:
                sets.append(f"{name} {len(timed)}")
                for k in tot:
                    tot[k] += float(np.mean([q[k] for q in timed]))
        if sets:
            print(
                f"\n{key}: fit time summed over the data sets ({', '.join(sets)} timed "
                f"splits): default / MLPClassifier {tot['t:default'] / tot['t:mlp']:.2f}x, "
                f"{key} / MLPClassifier {tot['t:' + key] / tot['t:mlp']:.2f}x, {key} / "
                f"default {tot['t:' + key] / tot['t:default']:.2f}x"
            )


def decompose_check(seeds=(0, 1), alphas=(0.0, 1e-4, 1e-3)):
    """Whether ``decompose`` stays exact with weight decay: the default network on wine's
    split ``s`` (StandardScaler fitted on its training rows), ``alpha`` as given, float32
    and float64, decomposed on 20 test rows: its ``error`` (the largest ``|initial + sum
    of contributions + regularization - prediction|``) and the size of the
    ``regularization`` term (the part of each prediction no training point owns)."""
    X, y = SETS["wine"]()
    for s in seeds:
        X_tr, X_te, y_tr, _ = train_test_split(X, y, random_state=s)
        scaler = StandardScaler().fit(X_tr)
        A, B = scaler.transform(X_tr), scaler.transform(X_te)[:20]
        for alpha in alphas:
            for dtype in ("float32", "float64"):
                net = PathKernelClassifier(random_state=s, alpha=alpha, dtype=dtype)
                r = net.fit(A, y_tr).decompose(B)
                print(
                    f"| {s} | {alpha:g} | {dtype} | {net.n_iter_} | {float(np.max(r.error)):.1e} "
                    f"| {np.abs(np.asarray(r.prediction)).max():.3f} "
                    f"| {np.abs(np.asarray(r.regularization)).max():.3f} |",
                    flush=True,
                )


def main(argv):
    if argv[0] == "--decompose":
        torch.set_num_threads(1)
        warnings.simplefilter("ignore", ConvergenceWarning)
        decompose_check()
        return
    if argv[0] == "--summary":
        ranges = None
        if "--ranges" in argv:
            i = argv.index("--ranges")
            ranges = [tuple(int(x) for x in r.split(":")) for r in argv[i + 1].split(",")]
            argv = argv[:i] + argv[i + 2 :]
        summary(argv[1:], ranges)
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", ConvergenceWarning)
    cands = argv[4].split(";") if len(argv) > 4 else list(NETS)
    with open(argv[3], "a") as out:
        for name in argv[0].split(","):
            run(name, range(int(argv[1]), int(argv[2])), out, cands)


if __name__ == "__main__":
    main(sys.argv[1:])
