"""A/B of ``OODRankDetector(method="residual")``: the all-N score through the pivots'
Nystrom factor (this tree) against the pivots-only score of main (BEFORE), in one
process, on the same frozen networks, and against THEORY's formula evaluated densely
from the tangent features (a per-sample autograd loop in float64, then an SVD).

Per set-up and rtol (1e-6, the default, and 1e-5): the share of fresh in-distribution
points that ``contamination=0.05`` and ``0.2`` flag, the AUROC of fresh in-distribution
points against an OOD set, and the least ``fit`` / ``score_samples`` time of alternating
repeats.
Run from the repository root (it reads the old code with ``git show``)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_ood_residual_ab

and it writes ``benchmarks/results/ood_residual_ab.md``.
"""

import copy
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.frozen import FrozenEstimator
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split

import skpathkernel._analysis  # noqa: F401  (the parent package of the old module)
from benchmarks.bench_ood import friedman_case, kink_case
from skpathkernel import OODRankDetector, PathKernelClassifier, PathKernelMachine

BEFORE = "4a46127"  # main when the all-N score was measured
ROOT = Path(__file__).resolve().parents[1]
REPEATS = 5
SCORE_REPEATS = 21
RTOLS = (1e-6, 1e-5)
TANH = dict(
    activation="tanh",
    solver="adam",
    learning_rate_init=0.01,
    tol=None,
    normalize_y=False,
    dtype="float64",
    random_state=0,
)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_detector():
    """OODRankDetector as of BEFORE, importing its own copy of the span numerics."""
    tmp = Path(tempfile.mkdtemp())
    for name, path in (
        ("rg", "skpathkernel/_analysis/_rank_gap.py"),
        ("ood", "skpathkernel/_estimators/_ood.py"),
    ):
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{BEFORE}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (tmp / f"{name}.py").write_text(
            text.replace(
                "from .._analysis._rank_gap import", "from .._analysis._rank_gap_old import"
            )
        )
    _load("skpathkernel._analysis._rank_gap_old", tmp / "rg.py")
    return _load("skpathkernel._estimators._ood_old", tmp / "ood.py").OODRankDetector


def setups():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    inside = y < 5
    Xtr, Xte, ytr, _ = train_test_split(
        X[inside], y[inside], train_size=600, stratify=y[inside], random_state=0
    )
    net = PathKernelClassifier(
        hidden_layer_sizes=(8,), activation="tanh", max_iter=200, random_state=0
    ).fit(Xtr, ytr)
    yield ("digits 0-4, 8 tanh units, N = 600", net, Xtr, Xte, {"held-out digits 5-9": X[~inside]})
    rng = np.random.RandomState(0)
    Xtr, Xf = rng.normal(size=(3000, 5)), rng.normal(size=(2000, 5))
    net = PathKernelMachine(hidden_layer_sizes=(64,), max_iter=20, **TANH).fit(
        Xtr, np.sin(Xtr.sum(1))
    )
    yield (
        "5-D normal, 64 tanh units (449 parameters), N = 3000",
        net,
        Xtr,
        Xf,
        {"3x wider normal": 3 * rng.normal(size=(500, 5))},
    )
    rng = np.random.RandomState(21)
    for hidden, name, epochs in (
        ((3,), "saturated: 3 tanh units (13 parameters)", 50),
        ((40,), "mostly pivots: 40 tanh units (161 parameters)", 100),
    ):
        Xtr, Xf = rng.normal(size=(200, 2)), rng.normal(size=(2000, 2))
        net = PathKernelMachine(hidden_layer_sizes=hidden, max_iter=epochs, **TANH).fit(
            Xtr, np.sin(Xtr.sum(1))
        )
        yield (
            f"2-D normal, {name}, N = 200",
            net,
            Xtr,
            Xf,
            {"3x wider normal": 3 * rng.normal(size=(500, 2))},
        )
    Xtr, Xf = rng.normal(size=(40, 5)), rng.normal(size=(2000, 5))
    net = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=60, **TANH).fit(
        Xtr, np.sin(Xtr.sum(1))
    )
    yield (
        "full rank: 5-D normal, 16 tanh units (113 parameters), N = 40",
        net,
        Xtr,
        Xf,
        {"3x wider normal": 3 * rng.normal(size=(500, 5))},
    )
    for case in (friedman_case(True), kink_case(True)):
        X_in = case.X_in
        if case.name.startswith("ReLU kink"):
            # bench_ood's 100 points of [0, 2) put a standard error of 0.04 on a flagged
            # share of 0.2; 2000 from the same distribution, 0.009.
            X_in = np.random.RandomState(1).uniform(0, 2, size=(2000, 1))
        yield (
            f"{case.name} (bench_ood, quick network)",
            case.net,
            case.X_train,
            X_in,
            {k: v[0] for k, v in case.ood.items()},
        )


def features(net, X):
    """phi(x): the flattened Jacobian / sqrt(C) at the final parameters, in float64, by
    one autograd call per sample and output (independent of the Gram engine)."""
    module = copy.deepcopy(net.module_).to(torch.float64)
    params = [p for p in module.parameters() if p.requires_grad]
    rows = []
    for x in torch.as_tensor(np.asarray(X), dtype=torch.float64):
        out = module(x[None]).reshape(-1)
        rows.append(
            torch.stack(
                [
                    torch.cat(
                        [
                            g.reshape(-1)
                            for g in torch.autograd.grad(out[c], params, retain_graph=True)
                        ]
                    )
                    for c in range(out.shape[0])
                ]
            ).reshape(-1)
            / np.sqrt(out.shape[0])
        )
    return torch.stack(rows).detach().numpy()


def dense_scores(F, Q, lam):
    """THEORY's score from the features, stably: queries ``Q`` against all N rows of
    ``F``, and each row of ``F`` against the N - 1 others (the decision's scores)."""
    U, S, Vt = np.linalg.svd(F, full_matrices=False)
    proj = Q @ Vt.T
    outside = Q - proj @ Vt
    # No cancellation: the part outside the span, plus the jitter's leak inside it.
    var = (outside * outside).sum(1) + (proj**2 * lam / (S**2 + lam)).sum(1)
    query = np.sqrt(np.clip(var / (Q * Q).sum(1), 0, 1))
    # Posterior variance of row i given the others: 1 / [(F F^T + lam I)^{-1}]_ii - lam.
    inv_diag = (U**2 / (S**2 + lam)).sum(1)
    if F.shape[0] > F.shape[1]:
        inv_diag += np.clip(1 - (U**2).sum(1), 0, None) / lam
    loo = np.sqrt(np.clip((1 / inv_diag - lam) / (F * F).sum(1), 0, 1))
    return -query, -loo


def auroc(scores, n_f, sizes):
    out, start = [], n_f
    for size in sizes:
        so = scores[start : start + size]
        start += size
        out.append(roc_auc_score(np.r_[np.zeros(n_f), np.ones(size)], -np.r_[scores[:n_f], so]))
    return " ".join(f"{a:.4f}" for a in out)


def measure(Old):
    rows = []
    for name, net, Xtr, Xfresh, ood in setups():
        Q = np.vstack([Xfresh, *ood.values()])
        n_f, sizes = len(Xfresh), [len(v) for v in ood.values()]
        F, FQ = features(net, Xtr), features(net, Q)
        for rtol in RTOLS:
            times = {label: {"fit": [], "score": []} for label in ("before", "after")}
            scores, dets = {}, {}
            for _ in range(REPEATS):
                for label, cls in (("before", Old), ("after", OODRankDetector)):
                    start = time.perf_counter()
                    dets[label] = cls(FrozenEstimator(net), method="residual", rtol=rtol).fit(Xtr)
                    times[label]["fit"].append(time.perf_counter() - start)
            # Scoring is cheap and its times jitter on a shared machine: more repeats.
            for _ in range(SCORE_REPEATS):
                for label in ("before", "after"):
                    start = time.perf_counter()
                    scores[label] = dets[label].score_samples(Q)
                    times[label]["score"].append(time.perf_counter() - start)
            start = time.perf_counter()
            scores["dense"], loo = dense_scores(F, FQ, rtol**2 * (F * F).sum(1).max())
            dense_time = time.perf_counter() - start
            after = dets["after"]
            # THEORY's formula at the jitter the score uses (lambda_, floored).
            at_lambda, _ = dense_scores(F, FQ, after.lambda_)
            row = dict(
                name=name,
                rtol=rtol,
                rank=f"{after.rank_} / {len(Xtr)}",
                n_q=len(Q),
                P=f"{F.shape[1]}, {np.linalg.matrix_rank(F)}",
                dense_time=dense_time,
                lam=after.lambda_ / (rtol**2 * after._train_diag.max()),
                diff=np.abs(scores["after"] - scores["dense"]).max(),
                diff_lambda=np.abs(scores["after"] - at_lambda).max(),
            )
            for label, cls in (("before", Old), ("after", OODRankDetector), ("dense", None)):
                sc = scores[label]
                for c in (0.05, 0.2):
                    if cls is None:
                        offset = np.percentile(loo, 100 * c)
                    else:
                        offset = (
                            cls(FrozenEstimator(net), method="residual", rtol=rtol, contamination=c)
                            .fit(Xtr)
                            .offset_
                        )
                    row[f"{label} {c}"] = np.mean(sc[:n_f] < offset)
                row[f"{label} auroc"] = auroc(sc, n_f, sizes)
                if cls is not None:
                    row[f"{label} fit"] = min(times[label]["fit"])
                    row[f"{label} score"] = min(times[label]["score"])
            row["ood"] = ", ".join(ood)
            rows.append(row)
            print(row, flush=True)
    return rows


def markdown(rows, load_start, load_end, seconds, commit):
    out = [
        '# OODRankDetector(method="residual"): all-N score vs pivots only vs dense',
        "",
        f"`OMP_NUM_THREADS=1 python -m benchmarks.bench_ood_residual_ab` on {commit} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): before = main at "
        f"{BEFORE} (a query scored against the r pivots alone), after = this tree "
        "(THEORY's all-N formula through the pivots' Nystrom factor, for queries and the "
        "leave-one-out scores alike, its jitter at least the pivots' Cholesky resolution "
        "`r eps ||Theta_LL||_2`), dense = THEORY's formula from the tangent features "
        "(per-sample autograd in float64, an SVD; queries against all N, and the "
        "leave-one-out scores from U) at `lam = rtol**2 max_i Theta(x_i, x_i)`. Same frozen "
        f"network for all three. Machine: 2-core AMD EPYC, shared; "
        f"{platform.python_version()}, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; load average {load_start} "
        f"at the start, {load_end} at the end; {seconds:.0f} s. Times: least of "
        f"{REPEATS} (fit) and {SCORE_REPEATS} (score_samples) alternating repeats.",
        "",
        "## Flagged share of fresh in-distribution points, and AUROC",
        "",
        "`P, rank`: parameters, and the numerical rank of the training features (NumPy's "
        "`matrix_rank`); `lam / rtol^2`: after's jitter `lambda_` over the nominal "
        "`rtol**2 max_i Theta_ii` (above 1 where the Cholesky resolution floors it); "
        "`max |after - dense|`: largest score difference, against dense at the nominal "
        "jitter and (second) at after's `lambda_`, in units of the score.",
        "",
        "| set-up | rtol | rank_ / N (P, rank) | lam / rtol^2 | contamination 0.05: before "
        "/ after / dense | 0.2: before / after / dense | OOD set | AUROC before / after / "
        "dense | max \\|after - dense\\| |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['rtol']:g} | {r['rank']} ({r['P']}) | {r['lam']:.3g} "
            f"| {r['before 0.05']:.3f} / {r['after 0.05']:.3f} / {r['dense 0.05']:.3f} "
            f"| {r['before 0.2']:.3f} / {r['after 0.2']:.3f} / {r['dense 0.2']:.3f} "
            f"| {r['ood']} | {r['before auroc']} / {r['after auroc']} / "
            f"{r['dense auroc']} | {r['diff']:.3g}, {r['diff_lambda']:.3g} |"
        )
    out += [
        "",
        "## Time (s)",
        "",
        "| set-up | rtol | fit before / after (ratio) | score_samples before / after "
        "(ratio) | dense (features' SVD and scores, features not counted) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['rtol']:g} | {r['before fit']:.3f} / {r['after fit']:.3f} "
            f"({r['after fit'] / r['before fit']:.2f}) | {r['before score']:.3f} / "
            f"{r['after score']:.3f} (n = {r['n_q']}; "
            f"{r['after score'] / r['before score']:.2f}) | {r['dense_time']:.3f} |"
        )
    fit = [r["after fit"] / r["before fit"] for r in rows]
    score = [r["after score"] / r["before score"] for r in rows]
    out += [
        "",
        f"Ratios after / before over all rows: fit {min(fit):.2f}-{max(fit):.2f}, "
        f"score_samples {min(score):.2f}-{max(score):.2f}.",
        "",
        NOTES,
    ]
    return "\n".join(out) + "\n"


NOTES = """## Reading

- AUROC at the default rtol=1e-6: after >= before on every set-up, and within 0.0004 of
  dense. At rtol=1e-5 the one drop is Friedman #1, 0.9950 -> 0.9947 (dense 0.9947).
- The floor (`lam / rtol^2` > 1): where N points cover every parameter direction, an
  in-distribution point's posterior variance is the jitter's leak alone (`rtol^2` of the
  largest diagonal), and `Theta(x, x) - ||L^{-1} k_L(x)||^2` resolves it only to `L`'s
  backward error `r eps ||Theta_LL||_2`: 13.5 times the nominal jitter on the 5-D
  set-up, where the all-N score without the floor had AUROC 0.925 (and its fresh
  in-distribution scores were 31% off the dense formula, median). With the floor the
  score is the dense formula at `lambda_` to 1.2e-5 (second difference column) wherever
  the pivots span the features (`rank_` >= rank), and its AUROC matches dense at the
  nominal jitter; raising rtol to 1e-5 instead gives the same AUROCs.
- Where `rank_` < rank (mostly pivots; Friedman at 1e-5) the score is the formula with
  `Theta` replaced by the pivots' factor, which drops the directions below the
  tolerance: 0.007-0.011 off dense (mostly pivots), 9e-5 (Friedman), and its
  leave-one-out quantile flags 0.256-0.270 of fresh data for 0.2 (dense 0.236 and 0.190;
  before 0.289 and 0.670).
- ReLU kink: fresh points are 2000 draws from the training interval [0, 2) (bench_ood's
  100 put a standard error of 0.04 on a share of 0.2); after flags 0.035 / 0.160 for
  0.05 / 0.2, exactly what dense flags, before 0.061 / 0.221. Every in-domain feature
  lies in the span (the linear pieces), so every score there is the jitter's leak
  (~1e-6): the quantile orders leaks, and the 50 training points lie on a grid
  (`linspace`), where removing one doubles the gap that a fresh uniform point sees.
- Times: after's fit adds the floor's power iteration and drops before's pivots-only
  leave-one-out pass; its one r x r eigendecomposition is M's (before's: R R^T's); a
  query costs one r x r product, before's one triangular solve (large rank: below).
"""


LARGE_RANK = "## Large rank"


def _load_average():
    return os.getloadavg()[0].__round__(2)


def main():
    warnings.simplefilter("ignore")
    Old = old_detector()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    load_start, start = _load_average(), time.perf_counter()
    rows = measure(Old)
    text = markdown(rows, load_start, _load_average(), time.perf_counter() - start, commit)
    out = ROOT / "benchmarks" / "results" / "ood_residual_ab.md"
    # The large-rank section comes from bench_ood_residual_rank.py: kept as it was.
    if out.exists() and LARGE_RANK in out.read_text():
        text = text.rstrip("\n") + "\n\n" + LARGE_RANK + out.read_text().split(LARGE_RANK, 1)[1]
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
