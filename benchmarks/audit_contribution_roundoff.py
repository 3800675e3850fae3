"""Can ``contribution_error`` estimate a float32 path's round-off? An audit of candidates.

On a float32 path the true error of one contribution (against a float64 16-node
reference of the same recorded path, ``audit_contribution_error.reference``) is mostly
the round-off of the float32 factors its shares are computed from, which the difference
of the n-node and (n+1)-node rules (``contribution_error``) does not measure. This audit
runs the package's ``_decomposition.py`` with a probe added to its walk (a copy loaded
beside the package; the arithmetic is unchanged), which sums per contribution over the
first walk's steps ``S1 = sum_t |s_t|``, ``S2 = sum_t s_t^2`` and the count ``n`` of nonzero shares
``s_t``, and scores three round-off estimates added to each contribution's difference (that of
the walk its chunk of queries keeps, as ``contribution_error`` is):

* ``lin``: ``2 eps32 S1`` (commit e36c5a4, reverted in 195c3b9);
* ``rw``: ``K_RW eps32 sqrt(S2)``, a random walk of independent per-share round-off;
* ``rwn``: ``K_RWN eps32 sqrt(n S2)``, a random walk over the n shares of the largest.

For each: the largest difference plus estimate (``est``), its ratio to the true error,
and the warning it would raise (P: PrecisionWarning, the estimate alone over tol * S;
C: ConvergenceWarning, the sum over it; -: none); ``K_min``, the coefficient that would
just reach the true error, and ``K_warn``, the one at which it first warns (tol * S).
Also a sampled calibration: the coefficient of ``S1`` measured on one random query and
four random training points (their true error beyond their difference), 500 draws: how
often the scaled estimate misses the path's true largest error, and how often it warns
where the true error is under tol * S. All in units of tol * S (the default tol, S the
largest |f| along the path).

Cases: the float32 cases of ``audit_check_rows.py``, two more seeds, two small CNNs,
converged full-batch Adam (random queries, and two of its training points as queries),
and long default paths: the default classifier on digits and regressor on diabetes at
the full ``max_iter``, the regressor on standardized diabetes (all 442 points, and
``max_iter=60`` on the first 100, 125, 150), plain and momentum SGD over 60 epochs.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_contribution_roundoff.py
[words] (results: benchmarks/results/contribution_roundoff.md; with words, only the
cases whose names hold one, printed and not written)
"""
import copy
import importlib.util
import os
import platform
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits
from sklearn.preprocessing import StandardScaler

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition as package
from skpathkernel._network._trained import network_of

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_roundoff.md")
EPS = float(torch.finfo(torch.float32).eps)
LIN, K_RW, K_RWN = 2.0, 15.0, 1.1
DRAWS = 500

# The probe, added to the walk of _factored_block: per contribution of the rule's rows,
# sum_t |s_t|, sum_t s_t^2, the count of nonzero s_t and max_t |s_t| (first walk only).
PROBE = '''
_PROBE = None


def _probe_add(probe, sub, s):
    s = s.double()
    probe[0].index_add_(0, sub, s.abs())
    probe[1].index_add_(0, sub, s * s)
    probe[2].index_add_(0, sub, (s != 0).double())
    torch.maximum(probe[3], torch.zeros_like(probe[3]).index_add_(0, sub, s.abs()),
                  out=probe[3])
'''
EDITS = [
    ("    parts = []\n",
     "    parts = []\n"
     "    probe = None\n"
     "    if _PROBE is not None and exact and rows.start not in _PROBE:\n"
     "        probe = _PROBE[rows.start] = [torch.zeros((N, n_q, n_out), dtype=torch.float64,"
     " device=device) for _ in range(4)]\n"),
    ("                        contrib[:, at].index_add_(0, sub, share)\n",
     "                        contrib[:, at].index_add_(0, sub, share)\n"
     "                        if probe is not None and at.start < n_q:\n"
     "                            _probe_add([p[:, at] for p in probe], sub, share)\n"),
    ("                contrib.index_add_(0, sub, share.T.view(-1, n_rows, n_out))\n",
     "                contrib.index_add_(0, sub, share.T.view(-1, n_rows, n_out))\n"
     "                if probe is not None:\n"
     "                    _probe_add(probe, sub, share[: n_q * n_out].T.view(-1, n_q, n_out))\n"),
]


def load_probed():
    with open(package.__file__) as fh:
        source = fh.read()
    for old, new in EDITS:
        if source.count(old) != 1:
            raise RuntimeError(f"the probe's anchor is not unique in {package.__file__}: {old!r}")
        source = source.replace(old, new)
    source += PROBE
    spec = importlib.util.spec_from_loader("skpathkernel._analysis._probed", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = package.__file__
    sys.modules[spec.name] = module  # its dataclasses look their module up
    exec(compile(source, package.__file__, "exec"), module.__dict__)
    return module


def _full_batch_adam(seed):
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(20, 4))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=20)
    est = PathKernelMachine(hidden_layer_sizes=(8, 8), activation="gelu", solver="adam",
                            batch_size=20, learning_rate_init=1e-2, max_iter=200,
                            normalize_y=False, tol=None, n_iter_no_change=10**6,
                            random_state=0)
    return est, X, y, rng.normal(size=(2, 4))


def cases():
    yield from ((n, e, d) for n, e, d in audit_check_rows.cases() if "f64" not in n)
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    Xd, yd = load_diabetes(return_X_y=True)
    for seed in (3, 4):
        yield (f"digits f32 seed{seed}", PathKernelClassifier(max_iter=10, random_state=seed),
               (X[:300], y[:300], X[340:360]))
        yield (f"diabetes f32 seed{seed}", PathKernelMachine(max_iter=10, random_state=seed),
               (Xd[:300], yd[:300], Xd[340:360]))
    digits = (X[:300], y[:300], X[300:320])
    yield ("CNN digits f32, SGD (50), 30 ep",
           PathKernelClassifier(module=ace.SmallCNN, solver="sgd", batch_size=50,
                                learning_rate_init=0.1, max_iter=30, random_state=0), digits)
    yield ("CNN digits f32, Adam defaults, 10 ep",
           PathKernelClassifier(module=ace.SmallCNN, max_iter=10, random_state=0), digits)
    for seed in (0, 1, 2):
        # Full-batch Adam near convergence, whose contributions cancel to a few times the
        # prediction (tests/test_quadrature.py's path, in float32).
        est, Xa, ya, Xq = _full_batch_adam(seed)
        name = f"converged full-batch Adam (gelu 8x8, 20 points, 200 it) f32 seed{seed}"
        yield name, est, (Xa, ya, Xq)
        yield f"{name}, 2 training points as queries", est, (Xa, ya, Xa[:2])
    # Long default paths.
    yield "digits f32, defaults, full max_iter", PathKernelClassifier(random_state=0), digits
    for seed in (0, 2):
        yield (f"diabetes f32, defaults, full max_iter, seed{seed}",
               PathKernelMachine(random_state=seed), (Xd[:300], yd[:300], Xd[300:320]))
    Xs = StandardScaler().fit_transform(Xd)
    for seed in (0, 1):
        yield (f"diabetes (all 442, X standardized) f32, defaults, full max_iter, seed{seed}, "
               "20 training points as queries", PathKernelMachine(random_state=seed),
               (Xs, yd, Xs[:20]))
    for n in (100, 125, 150):
        for seed in (1, 2):
            est = PathKernelMachine(max_iter=60, random_state=seed)
            name = f"diabetes[:{n}] (X standardized) f32, max_iter=60, seed{seed}"
            yield f"{name}, next 20 as queries", est, (Xs[:n], yd[:n], Xs[n:n + 20])
            yield f"{name}, 20 training points as queries", est, (Xs[:n], yd[:n], Xs[:20])
    yield ("sgd digits f32, 60 ep", PathKernelClassifier(max_iter=60, random_state=0,
                                                         solver="sgd", momentum=0.0,
                                                         learning_rate_init=0.1), digits)
    yield ("sgd (momentum 0.9, Nesterov) digits f32, 60 ep",
           PathKernelClassifier(max_iter=60, random_state=0, solver="sgd",
                                learning_rate_init=0.05), digits)


def k_for(diff, x, target):
    """The smallest K with max(diff + K eps x) >= target (bisection; 0 where diff is)."""
    if diff.max() >= target:
        return 0.0
    lo, hi = 0.0, 1e7
    for _ in range(90):
        k = (lo + hi) / 2
        lo, hi = (lo, k) if np.max(diff + k * EPS * x) >= target else (k, hi)
    return hi


def judged(diff, r, ts):
    """The reported error and the warning an estimate r added to diff would raise."""
    est = float(np.max(diff + r))
    word = "P" if r.max() > ts else "C" if est > ts else "-"
    return est, word


def sampled(diff, x, true, ts, rng):
    """Calibrate K on one query and four training points; P(miss), P(false warning)."""
    n_q, N = true.shape[:2]
    miss = false = 0
    for _ in range(DRAWS):
        q, ii = rng.randint(n_q), rng.choice(N, min(4, N), replace=False)
        k = np.max(np.maximum(true[q, ii] - diff[q, ii], 0) / (EPS * np.maximum(x[q, ii],
                                                                                1e-300)))
        est = np.max(diff + k * EPS * x)
        miss += est < true.max()
        false += est > ts and true.max() <= ts
    return miss / DRAWS, false / DRAWS


def sampling_cost(rounds=5):
    """CPU time of the cheapest sampled calibration's float64 walk (one query, 2 nodes per
    step, the recorded path cast to float64) against the decompose it would check (20
    queries, defaults), alternated in one process; median ratio."""
    X, y = load_digits(return_X_y=True)
    Xd, yd = load_diabetes(return_X_y=True)
    out = []
    for name, est, (Xt, yt, Xq) in [
            ("digits classifier, defaults, 10 ep", PathKernelClassifier(max_iter=10,
                                                                        random_state=0),
             (X[:300] / 16.0, y[:300], X[300:320] / 16.0)),
            ("diabetes regressor, defaults, 10 ep", PathKernelMachine(max_iter=10,
                                                                      random_state=0),
             (Xd[:300], yd[:300], Xd[300:320]))]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(Xt, yt)
        net = network_of(est)
        X_fit, Y_fit = net._training_data()
        m64, t64 = copy.deepcopy(net.module).double(), ace.float64_path(net.trajectory)
        Y64 = Y_fit.double() if Y_fit.is_floating_point() else Y_fit
        q64 = torch.as_tensor(Xq[:1], dtype=torch.float64)
        times = []
        for _ in range(rounds):
            t0 = time.process_time()
            package.decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss,
                              net.tensor(Xq), memory_budget=net.memory_budget, warn=False)
            t1 = time.process_time()
            package.decompose(m64, t64, X_fit.double(), Y64, net.loss, q64, n_nodes=2,
                              warn=False)
            times.append((t1 - t0, time.process_time() - t1))
        a, b = np.array(times).T
        out.append((name, np.median(a), np.median(b), np.median(b / a)))
        print(out[-1], flush=True)
    return out


def main(*want):
    probed = load_probed()
    seen = {}
    check = probed._contribution_check

    def keep(walk, first, *args, **kwargs):
        # Each walk's difference: a chunk keeps the walk of its smallest largest one.
        diffs = [np.abs(first[3][0])]

        def recorded(plan=None):
            out = walk(plan)
            diffs.append(np.abs(out[3][0]))
            return out

        out = check(recorded, first, *args, **kwargs)
        diff = diffs[0].copy()
        for q in out[2]:
            diff[q.rows] = min((d[q.rows] for d in diffs), key=np.max)
        seen["diff"] = diff
        return out

    probed._contribution_check = keep
    rng = np.random.RandomState(0)
    rows = []
    for name, net, Xq, args in audit_check_rows.fitted(cases(), want):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            package.decompose(*args, memory_budget=net.memory_budget)
        main_warned = sorted({m.category.__name__ for m in caught if not issubclass(
            m.category, (DeprecationWarning, FutureWarning))})
        probed._PROBE = {}
        res, checks = probed.decompose(*args, memory_budget=net.memory_budget, warn=False)
        probe, probed._PROBE = probed._PROBE, None
        diff = seen["diff"]
        S1, S2, n = (np.concatenate([probe[k][i].permute(1, 0, 2).cpu().numpy()
                                     for k in sorted(probe)]) for i in range(3))
        ref = ace.reference(net, Xq).contributions
        ts = res.tol * checks.scale
        true = np.abs(res.contributions - ref)
        t = true.max()
        models = {"lin": (LIN, S1), "rw": (K_RW, np.sqrt(S2)), "rwn": (K_RWN, np.sqrt(n * S2))}
        row = [name, t / ts, res.contribution_error / ts, ", ".join(main_warned) or "none"]
        for k, x in models.values():
            est_, word = judged(diff, k * EPS * x, ts)
            row += [est_ / ts, est_ / t, word, k_for(diff, x, t),
                    k_for(diff, x, ts) if t < ts else float("nan")]
        row += list(sampled(diff, S1, true, ts, rng))
        rows.append(row)
        print(row, flush=True)
    probed._contribution_check = check
    if not want:
        write(rows, sampling_cost())


def write(rows, cost):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    lines = [
        "# Float32 round-off in decompose(method='exact')'s contribution_error: candidates",
        "", f"`python benchmarks/audit_contribution_roundoff.py` at commit {commit} (torch "
        f"{torch.__version__}, one thread, {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}). In units of tol * S (the default tol, 1e-6 in "
        "float32; S the largest |f| along the path). `true`: the largest error of one "
        "contribution against a float64 16-node reference of the same recorded path. "
        "`main`: the code's contribution_error (the two rules' difference) and its "
        "warnings. Per candidate estimate added to each contribution's difference "
        f"(`lin` = {LIN:g} eps32 sum_t abs(s_t), `rw` = {K_RW:g} eps32 sqrt(sum_t s_t^2), "
        f"`rwn` = {K_RWN:g} eps32 sqrt(n sum_t s_t^2)): the reported error, its ratio to "
        "`true`, the warning (P PrecisionWarning: the estimate alone over tol * S; C "
        "ConvergenceWarning; - none), `K_min` (the coefficient that just reaches `true`; "
        "0 where the difference does) and `K_warn` (the coefficient at which it first warns; "
        "only where `true` is under tol * S). `sampled`: K of `lin` calibrated on one "
        f"random query and 4 random training points, {DRAWS} draws: the share of draws "
        "whose estimate misses `true`, and that warn where `true` is under tol * S.", "",
        "| case | true | main | main warns | lin | lin/true | lin warns | lin K_min | "
        "lin K_warn | rw | rw/true | rw warns | rw K_min | rw K_warn | rwn | rwn/true | "
        "rwn warns | rwn K_min | rwn K_warn | sampled miss | sampled false warn |",
        "|" + "---|" * 21]
    for r in rows:
        cells = [r[0]] + [c if isinstance(c, str) else f"{c:.3g}" for c in r[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Cost of a sampled calibration: CPU time of a float64 walk of one query "
              "(2 nodes per step, the recorded path cast to float64) against the decompose "
              "it would check (20 queries, defaults), alternated, 5 rounds, medians.", "",
              "| case | decompose s | float64 one-query walk s | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {a:.3g} | {b:.3g} | {r:.3g} |" for n, a, b, r in cost]
    with open(OUT, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
