"""A/B of ``OODRankDetector(method="residual")``: the all-N score through the pivots'
Nystrom factor (this tree) against the pivots-only score of commit e913d43, in one
process, on the same frozen networks.

Per set-up: the share of fresh in-distribution points that ``contamination=0.05`` and
``0.2`` flag, the AUROC of fresh in-distribution points against an OOD set, the largest
score difference, and the least ``fit`` / ``score_samples`` time of alternating repeats.
Run from the repository root (it reads the old code with ``git show``)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_ood_residual_ab

and it writes ``benchmarks/results/ood_residual_ab.md``.
"""

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

BEFORE = "e913d43"
ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3
TANH = dict(activation="tanh", solver="adam", learning_rate_init=0.01, tol=None,
            normalize_y=False, dtype="float64", random_state=0)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_detector():
    """OODRankDetector as of BEFORE, importing its own copy of the span numerics."""
    tmp = Path(tempfile.mkdtemp())
    for name, path in (("rg", "skpathkernel/_analysis/_rank_gap.py"),
                       ("ood", "skpathkernel/_estimators/_ood.py")):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:{path}"],
                              check=True, capture_output=True, text=True).stdout
        (tmp / f"{name}.py").write_text(text.replace(
            "from .._analysis._rank_gap import", "from .._analysis._rank_gap_old import"))
    _load("skpathkernel._analysis._rank_gap_old", tmp / "rg.py")
    return _load("skpathkernel._estimators._ood_old", tmp / "ood.py").OODRankDetector


def setups():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    inside = y < 5
    Xtr, Xte, ytr, _ = train_test_split(X[inside], y[inside], train_size=600,
                                        stratify=y[inside], random_state=0)
    net = PathKernelClassifier(hidden_layer_sizes=(8,), activation="tanh", max_iter=200,
                               random_state=0).fit(Xtr, ytr)
    yield ("digits 0-4, 8 tanh units, N = 600", net, Xtr, Xte,
           {"held-out digits 5-9": X[~inside]})
    rng = np.random.RandomState(0)
    Xtr, Xf = rng.normal(size=(3000, 5)), rng.normal(size=(2000, 5))
    net = PathKernelMachine(hidden_layer_sizes=(64,), max_iter=20, **TANH).fit(
        Xtr, np.sin(Xtr.sum(1)))
    yield ("5-D normal, 64 tanh units (449 parameters), N = 3000", net, Xtr, Xf,
           {"3x wider normal": 3 * rng.normal(size=(500, 5))})
    rng = np.random.RandomState(21)
    for hidden, name, epochs in (((3,), "saturated: 3 tanh units (13 parameters)", 50),
                                 ((40,), "mostly pivots: 40 tanh units (161 parameters)", 100)):
        Xtr, Xf = rng.normal(size=(200, 2)), rng.normal(size=(2000, 2))
        net = PathKernelMachine(hidden_layer_sizes=hidden, max_iter=epochs, **TANH).fit(
            Xtr, np.sin(Xtr.sum(1)))
        yield (f"2-D normal, {name}, N = 200", net, Xtr, Xf,
               {"3x wider normal": 3 * rng.normal(size=(500, 2))})
    Xtr, Xf = rng.normal(size=(40, 5)), rng.normal(size=(2000, 5))
    net = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=60, **TANH).fit(
        Xtr, np.sin(Xtr.sum(1)))
    yield ("full rank: 5-D normal, 16 tanh units (113 parameters), N = 40", net, Xtr, Xf,
           {"3x wider normal": 3 * rng.normal(size=(500, 5))})
    for case in (friedman_case(True), kink_case(True)):
        yield (f"{case.name} (bench_ood, quick network)", case.net, case.X_train,
               case.X_in, {k: v[0] for k, v in case.ood.items()})


def measure(Old):
    rows = []
    for name, net, Xtr, Xfresh, ood in setups():
        Q = np.vstack([Xfresh, *ood.values()])
        n_f = len(Xfresh)
        times = {label: {"fit": [], "score": []} for label in ("before", "after")}
        scores, rank = {}, None
        for _ in range(REPEATS):
            for label, cls in (("before", Old), ("after", OODRankDetector)):
                start = time.perf_counter()
                det = cls(FrozenEstimator(net), method="residual").fit(Xtr)
                times[label]["fit"].append(time.perf_counter() - start)
                start = time.perf_counter()
                scores[label] = det.score_samples(Q)
                times[label]["score"].append(time.perf_counter() - start)
                rank = det.rank_
        row = dict(name=name, rank=f"{rank} / {len(Xtr)}", n_q=len(Q),
                   diff=np.abs(scores["before"] - scores["after"]).max())
        for label, cls in (("before", Old), ("after", OODRankDetector)):
            sc = scores[label]
            for c in (0.05, 0.2):
                offset = cls(FrozenEstimator(net), method="residual",
                             contamination=c).fit(Xtr).offset_
                row[f"{label} {c}"] = np.mean(sc[:n_f] < offset)
            start, aurocs = n_f, []
            for Xo in ood.values():
                so = sc[start : start + len(Xo)]
                start += len(Xo)
                aurocs.append(roc_auc_score(np.r_[np.zeros(n_f), np.ones(len(so))],
                                            -np.r_[sc[:n_f], so]))
            row[f"{label} auroc"] = " ".join(f"{a:.4f}" for a in aurocs)
            row[f"{label} fit"] = min(times[label]["fit"])
            row[f"{label} score"] = min(times[label]["score"])
        row["ood"] = ", ".join(ood)
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(rows, load_start, load_end, seconds):
    out = [
        "# OODRankDetector(method=\"residual\"): all-N score vs pivots only",
        "",
        f"`python -m benchmarks.bench_ood_residual_ab`: before = {BEFORE} (a query scored "
        "against the r pivots, the leave-one-out training scores mixed), after = this tree "
        "(THEORY's all-N formula through the pivots' Nystrom factor, for queries and the "
        "leave-one-out scores alike). Same frozen network for both, default rtol=1e-6. "
        f"Machine: 2-core AMD EPYC, shared; {platform.python_version()}, torch "
        f"{torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; load "
        f"average {load_start} at the start, {load_end} at the end; {seconds:.0f} s. "
        f"Times: least of {REPEATS} alternating repeats.",
        "",
        "## Flagged share of fresh in-distribution points, and AUROC",
        "",
        "| set-up | rank / N | contamination 0.05: before / after | 0.2: before / after "
        "| OOD set | AUROC before / after | max score change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['rank']} | {r['before 0.05']:.3f} / {r['after 0.05']:.3f} "
            f"| {r['before 0.2']:.3f} / {r['after 0.2']:.3f} | {r['ood']} "
            f"| {r['before auroc']} / {r['after auroc']} | {r['diff']:.3g} |")
    out += ["", "## Time (s)", "",
            "| set-up | fit before / after (ratio) | score_samples before / after (ratio) |",
            "|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['before fit']:.3f} / {r['after fit']:.3f} "
            f"({r['after fit'] / r['before fit']:.2f}) | {r['before score']:.3f} / "
            f"{r['after score']:.3f} (n = {r['n_q']}; "
            f"{r['after score'] / r['before score']:.2f}) |")
    return "\n".join(out) + "\n"


def _load_average():
    return os.getloadavg()[0].__round__(2)


def main():
    warnings.simplefilter("ignore")
    Old = old_detector()
    load_start, start = _load_average(), time.perf_counter()
    rows = measure(Old)
    text = markdown(rows, load_start, _load_average(), time.perf_counter() - start)
    (ROOT / "benchmarks" / "results" / "ood_residual_ab.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
