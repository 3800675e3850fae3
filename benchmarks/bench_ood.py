"""OODRankDetector against the field's OOD detectors, on near- and far-OOD splits.

Five cases, one trained network each; every network-based detector scores with that same
network. Digits: a ``PathKernelClassifier`` (64 tanh units, Adam) trained on 70% of
sklearn's digits of some classes (0-4, 5-9 or the even ones), in-distribution test = the
other 30%; near-OOD = the held-out digit classes and printed letters that look like
digits (O I Z S G T B q); far-OOD = printed letters M N U V A and uniform-noise images.
Regression: the 1-6-1 ReLU network of figures 7-8 with a kink at the training domain's
edge, trained on y = 2x + 1 over [0, 2), far-OOD = 25 points of (2, 4], in-distribution =
100 uniform points of [0, 2); and Friedman #1 with the first two inputs in [0, 0.5)
(a quarter of the cube's support), far-OOD = both in [0.5, 1).

Detectors: OODRankDetector at its defaults and its other methods; pytorch-ood 0.4's
Mahalanobis, ViM, KNN, Energy, MaxLogit, ReAct and GradNorm on the network's last hidden
layer and logits, in the OOD peers venv (``benchmarks/setup_ood_peers.sh``; the features
are exported as NumPy arrays); the network's max-softmax; IsolationForest,
LocalOutlierFactor(novelty=True) and OneClassSVM on the inputs. AUROC: in-distribution
is the positive class, scores higher = more normal. FPR@95: the fraction of OOD points
scoring at or above the 5th percentile of the in-distribution scores (the OOD points a
threshold keeping 95% of in-distribution points lets through). Methods of one case run
in a rotating order over the repeats (interleaved); their times are medians.

Run by ``python -m benchmarks --only ood [--quick]``: the goals are the table, the
other sections go to :data:`NOTES`.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.ensemble import IsolationForest
from sklearn.frozen import FrozenEstimator
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.neighbors import LocalOutlierFactor
from sklearn.svm import OneClassSVM

from skpathkernel import OODRankDetector, PathKernelClassifier, PathKernelMachine
from skpathkernel._reproduce._fig7 import _relu_network
from skpathkernel.datasets import load_printed_letters, make_linear_extrapolation

ROOT = Path(__file__).resolve().parents[1]
# Every training parameter the tables were measured with, explicit (tol=None: exactly
# max_iter epochs), so that they do not move with the estimators' defaults.
NETWORK = dict(hidden_layer_sizes=(64,), activation="tanh", solver="adam",
               learning_rate_init=1e-3, batch_size=64, tol=None, random_state=0)
EPOCHS = {False: 100, True: 20}
LOOKALIKE = "OIZSGTBq"  # 0 1 2 5 6 7 8 9
DIGIT_CASES = {"digits 0-4": lambda c: c < 5, "digits 5-9": lambda c: c >= 5,
               "digits even": lambda c: c % 2 == 0}
REPEATS = {False: 3, True: 1}
DEFAULT = "OODRankDetector (defaults: local, 20 neighbours)"
OURS = {
    DEFAULT: {},
    "OODRankDetector method=residual": dict(method="residual"),
    "OODRankDetector method=alignment": dict(method="alignment"),
}
# The sweep behind the defaults: every split, AUROC only.
SWEEP = ([("local", k, 1e-6) for k in (5, 10, 20, 30, 50)]
         + [("local", 20, r) for r in (1e-2, 1e-1)]
         + [("residual", None, r) for r in (1e-6, 1e-2, 1e-1)]
         + [("alignment", None, 1e-6)])


@dataclass
class Case:
    name: str
    net: object
    X_train: np.ndarray
    y_train: np.ndarray
    X_in: np.ndarray
    ood: dict  # name -> (X, "near" | "far")
    train_s: float = 0.0
    scores: dict = field(default_factory=dict)  # method -> {set name: scores}
    times: dict = field(default_factory=dict)  # method -> [seconds]


# --------------------------------------------------------------------------- cases
def _digit_sets(rng):
    return {
        "look-alike letters": load_printed_letters(letters=LOOKALIKE, n_per_class=30,
                                                   return_X_y=True)[0] / 16,
        "letters MNUVA": load_printed_letters(n_per_class=30, return_X_y=True)[0] / 16,
        "uniform noise": rng.uniform(size=(300, 64)),
    }


def _timed_fit(est, *args):
    start = time.perf_counter()
    est.fit(*args)
    return est, time.perf_counter() - start


def digit_case(name, quick):
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    inside = DIGIT_CASES[name](y)
    X_tr, X_te, y_tr, _ = train_test_split(X[inside], y[inside], test_size=0.3,
                                           stratify=y[inside], random_state=0)
    net, seconds = _timed_fit(PathKernelClassifier(**NETWORK, max_iter=EPOCHS[quick]),
                              X_tr, y_tr)
    extra = _digit_sets(np.random.RandomState(0))
    ood = {"held-out digits": (X[~inside], "near"),
           "look-alike letters": (extra["look-alike letters"], "near"),
           "letters MNUVA": (extra["letters MNUVA"], "far"),
           "uniform noise": (extra["uniform noise"], "far")}
    return Case(name, net, X_tr, y_tr, X_te, ood, seconds)


def kink_case(quick):
    X, y, _, _ = make_linear_extrapolation(n_train=50, n_test=25)
    net, seconds = _timed_fit(
        PathKernelMachine(module=_relu_network([0.1, 0.4, 0.7, 1.0, 1.3, 2.0]), solver="adam",
                          learning_rate_init=0.003, max_iter=600 if quick else 2000,
                          batch_size=None, tol=None, normalize_y=False, dtype="float64",
                          random_state=0), X, y)
    X_in = np.random.RandomState(0).uniform(0, 2, size=(100, 1))
    # x = 2 itself sits on the kink, where the new unit is still off: beyond it only.
    beyond = np.linspace(2, 4, 26)[1:, None]
    return Case("ReLU kink (figs 7-8)", net, X, y, X_in,
                {"x in (2, 4]": (beyond, "far")}, seconds)


def friedman_case(quick):
    rng = np.random.RandomState(0)

    def draw(n, shifted):
        Z = rng.uniform(size=(n, 10))
        Z[:, :2] = 0.5 * Z[:, :2] + (0.5 if shifted else 0.0)
        f = (10 * np.sin(np.pi * Z[:, 0] * Z[:, 1]) + 20 * (Z[:, 2] - 0.5) ** 2
             + 10 * Z[:, 3] + 5 * Z[:, 4])
        return Z, f + rng.normal(size=n)

    X, y = draw(1000, False)
    X_in, _ = draw(300, False)
    X_out, _ = draw(300, True)
    net, seconds = _timed_fit(
        PathKernelMachine(**NETWORK, max_iter=50 if quick else 200, normalize_y=False),
        X, (y - y.mean()) / y.std())
    return Case("Friedman #1, x0 and x1 < 0.5", net, X, y, X_in,
                {"x0, x1 >= 0.5": (X_out, "far")}, seconds)


def cases(quick):
    out = [digit_case(name, quick) for name in DIGIT_CASES]
    return out + [kink_case(quick), friedman_case(quick)]


# --------------------------------------------------------------------------- metrics
def auroc(s_in, s_out):
    return float(roc_auc_score(np.r_[np.ones(len(s_in)), np.zeros(len(s_out))],
                               np.r_[s_in, s_out]))


def fpr95(s_in, s_out):
    return float(np.mean(s_out >= np.percentile(s_in, 5)))


# --------------------------------------------------------------------------- detectors
def _hidden(net, X):
    """Last hidden activations (the last nn.Linear's input) and logits, float64."""
    module = net.module_
    with torch.no_grad():
        h = module[:-1](torch.as_tensor(X, dtype=next(module.parameters()).dtype))
        return h.double().numpy(), module[-1](h).double().numpy()


def ood_peers_python() -> str | None:
    """The interpreter of the OOD peers venv (pytorch-ood), if there is one."""
    exe = (os.environ.get("SKPATHKERNEL_OOD_PEERS_PYTHON")
           or str(ROOT / ".venv-ood/bin/python"))
    return exe if Path(exe).exists() else None


def _pytorch_ood(case, queries, threads):
    """pytorch-ood's detectors in the peers venv: {name: (scores, seconds)}."""
    exe = ood_peers_python()
    if exe is None:
        return {}, "pytorch-ood skipped: no OOD peers venv (benchmarks/setup_ood_peers.sh)"
    h_tr, _ = _hidden(case.net, case.X_train)
    h_q, _ = _hidden(case.net, queries)
    classes = isinstance(case.net, PathKernelClassifier)
    labels = np.searchsorted(case.net.classes_, case.y_train) if classes else np.zeros(
        len(case.X_train), dtype=np.int64)
    data = dict(h_train=h_tr, h_query=h_q, y_train=labels, threads=threads)
    if classes:
        last = case.net.module_[-1]
        data.update(W=last.weight.detach().double().numpy(),
                    b=last.bias.detach().double().numpy())
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "in.npz"), Path(tmp, "out.npz")
        np.savez(src, **data)
        subprocess.run([exe, "-m", "benchmarks._ood_peers_worker", str(src), str(dst)],
                       cwd=ROOT, check=True, capture_output=True)
        with np.load(dst) as f:
            out = {k: f[k] for k in f.files}
    version = str(out.pop("versions"))
    names = [k for k in out if not k.endswith(" seconds")]
    return {k: (out[k], float(out[k + " seconds"])) for k in names}, version


def _methods(case):
    """Every in-process method of a case: name -> fit-and-score function of the queries."""
    net = case.net

    def ours(params):
        return lambda Q: OODRankDetector(FrozenEstimator(net), **params).fit(
            case.X_train).score_samples(Q)

    def on_inputs(make):
        return lambda Q: make().fit(case.X_train).score_samples(Q)

    methods = {name: ours(p) for name, p in OURS.items()}
    if isinstance(net, PathKernelClassifier):
        methods["max-softmax (same network)"] = lambda Q: net.predict_proba(Q).max(1)
    methods.update({
        "IsolationForest (inputs)": on_inputs(lambda: IsolationForest(random_state=0)),
        "LocalOutlierFactor novelty=True (inputs)":
            on_inputs(lambda: LocalOutlierFactor(novelty=True)),
        "OneClassSVM nu=0.1 (inputs)": on_inputs(lambda: OneClassSVM(nu=0.1)),
    })
    return methods


def score_case(case, repeats, threads):
    """Scores of every method on [in; every OOD set], methods interleaved over repeats."""
    names = list(case.ood)
    queries = np.vstack([case.X_in] + [case.ood[n][0] for n in names])
    cuts = np.cumsum([len(case.X_in)] + [len(case.ood[n][0]) for n in names])[:-1]

    def store(method, scores, seconds):
        parts = np.split(np.asarray(scores, dtype=np.float64), cuts)
        case.scores[method] = dict(zip(["in", *names], parts))
        case.times.setdefault(method, []).append(seconds)

    methods = _methods(case)
    order = list(methods)
    version = None
    for rep in range(repeats):
        k = rep % len(order)
        for method in order[k:] + order[:k]:
            start = time.perf_counter()
            scores = methods[method](queries)
            store(method, scores, time.perf_counter() - start)
        peers, version = _pytorch_ood(case, queries, threads)
        for method, (scores, seconds) in peers.items():
            store(f"{method} (pytorch-ood, same network)", scores, seconds)
    return version


# --------------------------------------------------------------------------- tables
def _markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _peer(method):
    return not method.startswith("OODRankDetector")


def case_table(case):
    rows = []
    for method, parts in case.scores.items():
        row = {"method": method}
        for name, (_, kind) in case.ood.items():
            row[f"{name} ({kind})"] = (f"{auroc(parts['in'], parts[name]):.4f} / "
                                       f"{fpr95(parts['in'], parts[name]):.3f}")
        row["fit + score s (median)"] = f"{statistics.median(case.times[method]):.2f}"
        rows.append(row)
    return rows


def goal_rows(all_cases):
    """Per split: the defaults against the best peer; the goals of the issue."""
    rows = []
    for case in all_cases:
        for name, (_, kind) in case.ood.items():
            ours = case.scores[DEFAULT]
            a, f = auroc(ours["in"], ours[name]), fpr95(ours["in"], ours[name])
            peers = {m: auroc(p["in"], p[name]) for m, p in case.scores.items() if _peer(m)}
            best = max(peers, key=peers.get)
            bp = case.scores[best]
            met = a > peers[best] if kind == "near" else a >= 0.99
            rows.append({
                "case": case.name, "OOD set": f"{name} ({kind})",
                "defaults AUROC / FPR@95": f"{a:.4f} / {f:.3f}",
                "best peer": best,
                "its AUROC / FPR@95": f"{peers[best]:.4f} / {fpr95(bp['in'], bp[name]):.3f}",
                "goal": ("above every peer" if kind == "near" else "AUROC >= 0.99")
                        + (": met" if met else ": NOT met"),
            })
    return rows


def sweep_rows(all_cases):
    """AUROC of each setting of OODRankDetector on every split (same networks)."""
    rows = []
    for method, k, rtol in SWEEP:
        params = dict(method=method, rtol=rtol)
        label = f"{method}" + (f" n_neighbors={k}" if k else "") + f" rtol={rtol:g}"
        if k:
            params["n_neighbors"] = k
        row = {"setting": label}
        near, far = [], []
        for case in all_cases:
            names = list(case.ood)
            queries = np.vstack([case.X_in] + [case.ood[n][0] for n in names])
            s = OODRankDetector(FrozenEstimator(case.net), **params).fit(
                case.X_train).score_samples(queries)
            parts = np.split(s, np.cumsum([len(case.X_in)]
                                          + [len(case.ood[n][0]) for n in names])[:-1])
            for name, part in zip(names, parts[1:]):
                kind = case.ood[name][1]
                value = auroc(parts[0], part)
                row[_short(case.name, name)] = f"{value:.4f}"
                if kind == "near":
                    best = max(auroc(p["in"], p[name])
                               for m, p in case.scores.items() if _peer(m))
                    near.append(value - best)
                else:
                    far.append(value)
        row["min near-OOD margin over best peer"] = f"{min(near):+.4f}"
        row["min far-OOD AUROC"] = f"{min(far):.4f}"
        rows.append(row)
    return rows


def _short(case, name):
    short = {"held-out digits": "held", "look-alike letters": "look",
             "letters MNUVA": "MNUVA", "uniform noise": "noise"}
    if case.startswith("digits"):
        return f"{case.split()[1]} {short[name]}"
    return "kink" if case.startswith("ReLU") else "Friedman"


def decision_rows(all_cases):
    """predict() at the defaults: flagged fractions; and the previous default's."""
    rows = []
    for case in all_cases:
        for label, params, fixed in [
            ("defaults (local, Tukey fence of leave-one-out residuals)", {}, None),
            ("previous defaults (residual, fixed offset -0.5)", dict(method="residual"), -0.5),
        ]:
            det = OODRankDetector(FrozenEstimator(case.net), **params).fit(case.X_train)
            offset = det.offset_ if fixed is None else fixed

            def flagged(X, det=det, offset=offset):
                return float(np.mean(det.score_samples(X) < offset))

            rows.append({"case": case.name, "decision": label, "offset_": f"{offset:.4f}",
                         "flagged in-distribution": f"{flagged(case.X_in):.3f}",
                         "flagged OOD": "; ".join(f"{n} ({k}) {flagged(X):.3f}"
                                                  for n, (X, k) in case.ood.items())})
    return rows


# --------------------------------------------------------------------------- multi-output
def _stacked_residuals(net, X_train, Q, n_neighbors=None):
    """Relative residual of the C rows of J(x) outside the span of the stacked per-output
    rows of the training Jacobians (THEORY.md's definition), from the "full" Grams; over
    the rows of the n_neighbors best-aligned (trace cosine) training points if given."""
    from skpathkernel._tangent import tangent_gram, tangent_gram_diag

    module = copy.deepcopy(net.module_).double()
    traj = net.trajectory_
    params = dict(traj.unflatten(traj.parameters(-1).double()))
    Xt, Qt = torch.as_tensor(X_train), torch.as_tensor(Q)
    Ktt = tangent_gram(module, params, Xt, output="full").numpy()
    n, c = Ktt.shape[:2]
    Ktt = Ktt.reshape(n * c, n * c)
    Kq = tangent_gram(module, params, Qt, Xt, output="full").numpy().reshape(len(Q), c, n * c)
    norms = np.einsum("mcc->m", tangent_gram_diag(module, params, Qt, output="full").numpy())
    lam = 1e-12 * np.diag(Ktt).max()
    if n_neighbors is None:
        L = np.linalg.cholesky(Ktt + lam * np.eye(n * c))
        q = np.linalg.solve(L, Kq.reshape(len(Q) * c, n * c).T)
        explained = (q * q).sum(0).reshape(len(Q), c).sum(1)
    else:
        trace_tt = np.einsum("icic->i", Ktt.reshape(n, c, n, c))
        trace_q = np.einsum("mcic->mi", Kq.reshape(len(Q), c, n, c))
        cos = trace_q / np.sqrt(np.outer(norms, trace_tt))
        explained = np.empty(len(Q))
        for i, row in enumerate(cos):
            rows_ = (np.argsort(-row)[:n_neighbors, None] * c + np.arange(c)).ravel()
            A = Ktt[np.ix_(rows_, rows_)] + lam * np.eye(len(rows_))
            q = np.linalg.solve(np.linalg.cholesky(A), Kq[i][:, rows_].T)
            explained[i] = (q * q).sum()
    return np.sqrt(np.clip(1 - explained / norms, 0, 1))


def multioutput_rows(all_cases):
    rows = []
    for case in all_cases:
        if not isinstance(case.net, PathKernelClassifier):
            continue
        names = [n for n in case.ood if case.ood[n][1] == "near"] + ["letters MNUVA"]
        queries = np.vstack([case.X_in] + [case.ood[n][0] for n in names])
        cuts = np.cumsum([len(case.X_in)] + [len(case.ood[n][0]) for n in names])[:-1]
        for span, k in [("global", None), ("local, 20 neighbours", 20)]:
            trace = OODRankDetector(FrozenEstimator(case.net), method="residual" if k is None
                                    else "local").fit(case.X_train).score_samples(queries)
            stacked = -_stacked_residuals(case.net, case.X_train, queries, k)
            for label, s in [("trace Gram (the code)", trace),
                             ("stacked per-output rows (THEORY.md)", stacked)]:
                parts = np.split(s, cuts)
                row = {"case": case.name, "span": span, "Gram": label}
                row.update({n: f"{auroc(parts[0], p):.4f}" for n, p in zip(names, parts[1:])})
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- scale
SCALE_N = {False: 20000, True: 2000}
_SCALE_CHILD = r"""
import json, pickle, sys, time, warnings
import numpy as np, torch
from sklearn.frozen import FrozenEstimator
from sklearn.metrics import roc_auc_score
from benchmarks._serve import PeakRSS
from skpathkernel import OODRankDetector
from skpathkernel._analysis._rank_gap import NetworkGram, TangentSpan
torch.set_num_threads(int(sys.argv[3]))
with open(sys.argv[1], "rb") as f:
    net, X, sets = pickle.load(f)
what = sys.argv[2]
with warnings.catch_warnings(record=True) as caught, PeakRSS() as fit_peak:
    warnings.simplefilter("always")
    start = time.perf_counter()
    if what == "exact":  # the reference: the whole span, no budget, no leave-one-out
        gram = NetworkGram(net)
        gram.budget = 2**34
        diag = gram.diag(gram.tensor(X)).numpy()
        span, piv, complete, _, _ = TangentSpan.factorize(gram, X, diag,
                                                          1e-12 * diag.max(), len(X))
        rank = len(piv)
        score = lambda A: -span.residuals(gram, A)
    else:
        det = OODRankDetector(FrozenEstimator(net), method=what).fit(X)
        rank = getattr(det, "rank_", None)
        score = det.score_samples
    fit_s = time.perf_counter() - start
with PeakRSS() as score_peak:
    start = time.perf_counter()
    scores = {k: score(v) for k, v in sets.items()}
    score_s = time.perf_counter() - start
aurocs = {k: float(roc_auc_score(np.r_[np.ones(len(scores["in"])), np.zeros(len(v))],
                                 np.r_[scores["in"], v])) for k, v in scores.items() if k != "in"}
print(json.dumps(dict(rank=rank, fit_s=fit_s, score_s=score_s,
                      n_queries=sum(map(len, sets.values())),
                      fit_peak=fit_peak.delta, score_peak=score_peak.delta, aurocs=aurocs,
                      truncated=any("max_rank" in str(w.message) for w in caught),
                      scores={k: v.tolist() for k, v in scores.items()})))
"""


def _scale_problem(quick):
    """Digits 0-4 drawn N times with pixel noise (sd 0.05), the test sets likewise."""
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    inside = y < 5
    X_tr, X_te, y_tr, _ = train_test_split(X[inside], y[inside], test_size=0.3,
                                           stratify=y[inside], random_state=0)
    rng = np.random.RandomState(0)
    n = SCALE_N[quick]
    idx = rng.randint(len(X_tr), size=n)

    def jitter(A):
        return A + 0.05 * rng.normal(size=A.shape)

    X_train = jitter(X_tr[idx])
    extra = _digit_sets(rng)
    sets = {"in": jitter(X_te), "held-out digits": jitter(X[~inside]),
            "look-alike letters": jitter(extra["look-alike letters"]),
            "letters MNUVA": jitter(extra["letters MNUVA"]),
            "uniform noise": extra["uniform noise"]}
    net = PathKernelClassifier(**{**NETWORK, "batch_size": 256}, max_iter=2).fit(
        X_train, y_tr[idx])
    return net, X_train, sets


def run_scale(quick, threads):
    """Each method's fit in a fresh process (peaks do not mix), 1 GiB budget."""
    net, X, sets = _scale_problem(quick)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "problem.pkl")
        with open(path, "wb") as f:
            pickle.dump((net, X, sets), f)
        for what in ("local", "residual", "exact"):
            out = subprocess.run([sys.executable, "-c", _SCALE_CHILD, str(path), what,
                                  str(threads)], cwd=ROOT, capture_output=True, text=True,
                                 check=True)
            results[what] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"bench_ood: scale {what} done", file=sys.stderr, flush=True)
    exact = results["exact"]
    rows = []
    labels = {"local": "defaults (local, 20 neighbours)",
              "residual": "method=residual, 1 GiB budget",
              "exact": "method=residual, exact span (reference, no budget)"}
    for what, r in results.items():
        row = {"N": len(X), "route": labels[what],
               "rank": r["rank"] if r["rank"] is not None else "-",
               "stopped at max_rank": r["truncated"] if what == "residual" else "-",
               "fit s": f"{r['fit_s']:.1f}",
               f"score {r['n_queries']} queries s": f"{r['score_s']:.1f}",
               "peak RSS of fit above its start, MiB": f"{r['fit_peak'] / 2**20:.0f}"}
        for name, value in r["aurocs"].items():
            row[name] = f"{value:.4f} ({value - exact['aurocs'][name]:+.4f})"
        dev = max(np.abs(np.subtract(r["scores"][k], exact["scores"][k])).max() for k in sets)
        row["max score deviation from exact"] = f"{dev:.3f}" if what == "residual" else "-"
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- runner
_METHOD_NOTES = """\
Every network-based detector scores with the same trained network. pytorch-ood runs in
its own venv (torch 2.14.1 + torchvision 0.29.1, which pytorch-ood imports; the main
environment's torch 2.13.0+cpu cannot load PyPI's torchvision) on the network's last
hidden activations, logits and last layer exported as NumPy arrays. Settings: KNN k = 50
(pytorch-ood's default, the KNN paper's CIFAR-10 value) and k = 1 (that paper's k / N
ratio at these N, ~630 training points); ViM d = 32 (half the 64 features, pytorch-ood's
own fallback); ReAct at its 90th percentile with the energy score (a tanh network: its
clipping is designed for ReLU activations, reported as it runs); GradNorm on the last
layer's weight (the paper's choice); Mahalanobis on features without input
perturbation. Regression networks have no logits: only Mahalanobis (one class) and KNN
apply there. Every AUROC is deterministic (seeded data and training); times are medians
of the interleaved repeats and include fitting each detector (not training the network).
"""


def run(quick: bool = False, threads: int | None = None) -> list[dict]:
    """Per split: the defaults' AUROC / FPR@95 against the best peer (the goals); every
    other section of the report goes to :data:`NOTES`."""
    global NOTES
    all_cases, version = _measure(quick, threads)
    sections = [
        f"Threads: {threads or 2} (torch, here and in the children); "
        f"{version or 'pytorch-ood: -'}; {REPEATS[quick]} interleaved repeats.\n\n"
        + _METHOD_NOTES]
    for case in all_cases:
        sections.append(
            f"## {case.name}: AUROC / FPR@95 (network trained in {case.train_s:.1f} s)\n\n"
            + _markdown(case_table(case)))
    sections.append(
        "## Choosing the defaults: AUROC of each setting on every split\n\n"
        "Columns: case and OOD set (held = held-out digit classes, look = look-alike "
        "letters, both near-OOD; MNUVA letters, noise, kink and Friedman far-OOD). "
        "Margin: the setting's AUROC minus the best peer's, worst near-OOD split.\n\n"
        + _markdown(sweep_rows(all_cases)))
    sections.append(
        "## The default decision: fraction flagged by predict()\n\n"
        + _markdown(decision_rows(all_cases)))
    sections.append(
        "## Multi-output networks: trace Gram or stacked per-output rows (AUROC)\n\n"
        + _markdown(multioutput_rows(all_cases)))
    sections.append(
        f"## Scale: N = {SCALE_N[quick]} noisy digits 0-4 (64 tanh units, 2 epochs), "
        "memory_budget 1 GiB; AUROC (difference to the exact span)\n\n"
        + _markdown(run_scale(quick, threads or 2)))
    NOTES = "\n\n".join(sections)
    return goal_rows(all_cases)


NOTES = _METHOD_NOTES


def _measure(quick, threads):
    torch.set_num_threads(threads or 2)
    all_cases = cases(quick)
    version = None
    for case in all_cases:
        version = score_case(case, REPEATS[quick], threads or 2) or version
        print(f"bench_ood: {case.name} scored", file=sys.stderr, flush=True)
    return all_cases, version
