"""OODRankDetector: AUROC against standard baselines, and the cost of its factorisation.

AUROC: a network is trained on sklearn's digits 0-4 (70% train split); in-distribution
test points are the held-out 30% of 0-4, out-of-distribution sets are (a) sklearn digits
5-9, (b) printed digits 0-9 and (c) printed letters M, N, U, V, A (30 images per class,
rendered from matplotlib's fonts). Every baseline is measured in the same run on the same
split: IsolationForest, LocalOutlierFactor(novelty=True) and OneClassSVM on raw pixels,
the network's max-softmax, and GradNorm (Huang et al. 2021: the L1 norm of the gradient
of KL(uniform || softmax) with respect to the last layer's weights, computed in closed
form as ``||p - 1/C||_1 * ||h||_1``, h the last hidden activation).

Scale: time and peak resident memory of ``fit`` with a prefitted network (the
factorisation alone), each N in a fresh process so that the peaks do not mix.

``python -m benchmarks.bench_ood [--quick]`` prints both tables and writes
benchmarks/results_ood.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.ensemble import IsolationForest
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.neighbors import LocalOutlierFactor
from sklearn.svm import OneClassSVM

from skpathkernel import OODRankDetector, PathKernelClassifier
from skpathkernel.datasets import load_printed_digits, load_printed_letters

NETWORK = dict(hidden_layer_sizes=(64,), activation="tanh", solver="adam",
               learning_rate_init=1e-3, batch_size=64, tol=None, random_state=0)
EPOCHS = {False: 100, True: 20}
SCALE_N = {False: (2000, 5000, 20000), True: (2000,)}


def _data():
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    X_in, y_in = X[y < 5], y[y < 5]
    X_tr, X_te, y_tr, _ = train_test_split(X_in, y_in, test_size=0.3, stratify=y_in,
                                           random_state=0)
    ood = {
        "(a) digits 5-9": X[y >= 5],
        "(b) printed digits": load_printed_digits(n_per_class=30, return_X_y=True)[0] / 16,
        "(c) printed letters": load_printed_letters(n_per_class=30, return_X_y=True)[0] / 16,
    }
    return X_tr, y_tr, X_te, ood


def _auroc(s_in, s_out):
    labels = np.r_[np.ones(len(s_in)), np.zeros(len(s_out))]
    return roc_auc_score(labels, np.r_[s_in, s_out])


def _gradnorm(clf, X):
    """GradNorm, closed form: d KL(u || softmax(W h + b)) / dW = (p - u) h^T."""
    module = clf.module_
    with torch.no_grad():
        h = module[:-1](torch.as_tensor(X, dtype=torch.float32))
        p = torch.softmax(module[-1](h), dim=1)
        u = 1.0 / p.shape[1]
        return ((p - u).abs().sum(1) * h.abs().sum(1)).numpy().astype(np.float64)


def run(quick: bool = False, threads: int | None = None) -> list[dict]:
    """AUROC (higher = better) of every method on the three OOD sets; one dict per method."""
    # Standalone: both cores; under ``python -m benchmarks --threads N``: its limit.
    torch.set_num_threads(threads or 2)
    X_tr, y_tr, X_te, ood = _data()
    rows = []

    def add(method, score_fn, seconds):
        s_in = score_fn(X_te)
        row = {"method": method}
        row.update({name: round(float(_auroc(s_in, score_fn(X))), 4) for name, X in ood.items()})
        row["fit s"] = round(seconds, 1)
        rows.append(row)

    start = time.perf_counter()
    clf = PathKernelClassifier(**NETWORK, max_iter=EPOCHS[quick]).fit(X_tr, y_tr)
    train_s = time.perf_counter() - start
    for method, rtol in [("residual", 1e-6), ("residual", 1e-1), ("alignment", 1e-6)]:
        start = time.perf_counter()
        det = OODRankDetector(estimator=clf, method=method, rtol=rtol).fit(X_tr)
        add(f"OODRankDetector method={method} rtol={rtol:g} (rank {det.rank_})",
            det.score_samples, train_s + time.perf_counter() - start)
    add("max-softmax (same network)", lambda X: clf.predict_proba(X).max(1), train_s)
    add("GradNorm, last layer, L1 (same network)", lambda X: _gradnorm(clf, X), train_s)
    for name, est in [
        ("IsolationForest (pixels)", IsolationForest(random_state=0)),
        ("LocalOutlierFactor novelty=True (pixels)", LocalOutlierFactor(novelty=True)),
        ("OneClassSVM rbf gamma=scale nu=0.1 (pixels)", OneClassSVM(nu=0.1)),
    ]:
        start = time.perf_counter()
        est.fit(X_tr)
        add(name, est.score_samples, time.perf_counter() - start)
    return rows


_SCALE_CHILD = r"""
import json, resource, sys, time, warnings
import numpy as np, torch
from sklearn.datasets import load_digits
from skpathkernel import OODRankDetector, PathKernelClassifier
torch.set_num_threads(2)
n = int(sys.argv[1])
X, y = load_digits(return_X_y=True)
rng = np.random.RandomState(0)
idx = rng.randint(len(X), size=n)
X = X[idx] / 16 + 0.05 * rng.normal(size=(n, 64))  # jittered digits: N distinct inputs
clf = PathKernelClassifier(hidden_layer_sizes=(64,), solver="adam", learning_rate_init=1e-3,
                           batch_size=256, max_iter=2, activation="tanh", tol=None,
                           random_state=0).fit(X, y[idx])
from benchmarks._serve import rss
before = rss() / 1024  # current resident KiB: the high-water mark would hide the growth
start = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    det = OODRankDetector(estimator=clf).fit(X)
fit_s = time.perf_counter() - start
start = time.perf_counter()
det.score_samples(X[:1000])
score_s = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(dict(n=n, rank=det.rank_, fit_s=fit_s, score_1000_s=score_s,
                      rss_before_mib=before / 1024, rss_peak_mib=peak / 1024,
                      truncated=any("max_rank" in str(w.message) for w in caught))))
"""


_SCALE_NOTES = """\
Notes. "fit s" of the network rows includes training the shared classifier; the detector
rows add their factorisation. The GradNorm row is the last-layer, L1 variant (closed form),
not the full tangent-feature norm. The peak is the process's high-water mark (training
included, when higher) minus the resident memory at the start of `fit`. At N = 20000 the
1 GiB budget allows an N x 3355 float64 factor (half the budget), and the span needs more
pivots (N = 5000 already needed 4225), so that fit stops at max_rank with its warning;
`memory_budget=2**32` would run it to the tolerance. A float `contamination` with
`method="residual"` adds the leave-one-out pass, whose QR holds a second N x r array:
about the whole budget at the largest rank.
"""


def run_scale(quick: bool = False) -> list[dict]:
    """Factorisation time and peak RSS at each N (fresh process each), 1 GiB budget."""
    rows = []
    root = Path(__file__).resolve().parents[1]
    for n in SCALE_N[quick]:
        out = subprocess.run([sys.executable, "-c", _SCALE_CHILD, str(n)], cwd=root,
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({
            "N train": r["n"],
            "rank r": r["rank"],
            "stopped at max_rank": r["truncated"],
            "fit s (factorisation)": round(r["fit_s"], 1),
            "score 1000 queries s": round(r["score_1000_s"], 2),
            "peak RSS above the start of fit, MiB":
                f"{r['rss_peak_mib'] - r['rss_before_mib']:.0f}",
        })
    return rows


def _markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(quick: bool = False) -> str:
    auroc, scale = run(quick), run_scale(quick)
    text = (
        "# OODRankDetector benchmark\n\n"
        f"`python -m benchmarks.bench_ood{' --quick' if quick else ''}`, CPU, 2 threads, "
        f"torch {torch.__version__}.\n\n"
        "## AUROC: trained on sklearn digits 0-4, in-distribution = held-out 0-4\n\n"
        + _markdown(auroc)
        + "\n\n## Factorisation cost (prefitted 64-64-10 tanh network, memory_budget 1 GiB)\n\n"
        + _markdown(scale) + "\n\n" + _SCALE_NOTES
    )
    return text


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    text = main(quick)
    print(text)
    Path(__file__).with_name("results_ood.md").write_text(text)
