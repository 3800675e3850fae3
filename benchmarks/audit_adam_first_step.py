"""Audit: does Adam's first step flag the default paths whose unrolled scores fail?

``benchmarks/results/unrolled_activation.md`` found 3 of 9 default (gelu, Adam) digits
paths whose scores predict replays to an LDS of 0.28-0.56 without an
``UnstablePathWarning`` (growth 3.08-24.5, under Adam's limit of 100), each amplifying
most at its first step. This collects, per Adam path, candidate statistics
(``AttributionScores.amplification`` and ``growth``, the share of the first step's
gradients under 100 and 1e4 ``epsilon`` read from the recorded second moment, and the
share of the scores that the first step's small-gradient parameters carry) and sets them
against the replays' verdict, on:

* the Adam paths of ``benchmarks/audit_unstable_growth.py`` (the defaults benchmark's
  nine data sets, seeds 0-2, and its larger ``learning_rate_init`` contrasts): refitted
  here (the same split, estimator and seed; the growth is checked against the recorded
  one to rtol 1e-6, so the path is the one it replayed), the quality of their replays
  read from ``benchmarks/results/unstable_growth.json``;
* the paths of ``benchmarks/audit_unrolled_activation.py`` at its sizes (1000, 128) and
  (400, 200) (its split of 20 queries; the 50-query split draws other paths and is left
  out), tanh and gelu, seeds 0-2: refitted and replayed here with ``audit_unstable_growth``'s
  removals (30 single points, 20 groups of 10, 20 halves) for the first 10 queries, so
  that both sets are judged alike.

Verdicts: as ``audit_unstable_growth`` (a query fails where its single removals'
Spearman is under 0.5, a path where half its queries do), and by the halves: the median
over the queries of the halves' Spearman under 0.5 or under 0.7.

``mechanism`` wraps the adjoint of Adam's update at the first step (count 1) to split
its term ``u_0`` (the step's own derivative, ``-lr eps / (|g| + eps)^2`` times the
adjoint, and the later steps' share through the moments), and replays the scores
computed without the term on the parameters whose first gradient is under 100 eps.

``more DEFAULTS.json ACTIVATION.json``: the defaults' data sets and the activation
paths at seeds 3-5, all replayed here, to check a limit chosen on the others.

Usage: ``python -m benchmarks.audit_adam_first_step {growth|activation|mechanism}
OUT.json``, then ``python -m benchmarks.audit_adam_first_step report MECHANISM.json
OUT.md GROWTH.json ACTIVATION.json`` (writes OUT.md's tables and the rows as OUT.json).
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import numpy as np
import torch

from benchmarks import audit_unstable_growth as ug

EPS_BANDS = (1e2, 1e4)
ACTIVATION_SIZES = ((1000, 128), (400, 200))


def _first_step(est):
    """Statistics of the recorded path's first step, from its second moment."""
    traj = est.trajectory_
    spec = traj.solver_spec
    v = traj.optimizer_state(0)["exp_avg_sq"].double()
    # Adam's first second moment is (1 - beta_2) g_0^2: the first step's gradient.
    g = (v / (1.0 - spec.beta_2)).sqrt()
    eps = spec.epsilon
    live = g > 0
    out = {"n_params": int(g.numel()), "zero grad": float((~live).double().mean())}
    for band in EPS_BANDS:
        out[f"grad < {band:g} eps"] = float(((g < band * eps) & live).double().mean())
    # The first step's derivative in g, lr * eps / (|g| + eps)^2, against lr / |g| (the
    # step's own scale): eps |g| / (|g| + eps)^2, 1/4 at |g| = eps.
    ratio = eps * g / (g + eps) ** 2
    out["max eps|g|/(|g|+eps)^2"] = float(ratio.max())
    return out


def _stats(est, scores):
    amp = np.nan_to_num(np.asarray(scores.amplification, float), nan=1.0)
    log_above = np.log(np.maximum(amp, 1.0))
    return {
        "growth": np.asarray(scores.growth, float).tolist(),
        "amp0": float(amp[0]),
        "amp1": float(amp[1]) if len(amp) > 1 else 1.0,
        "amp max": float(amp.max()),
        "amp max after 0": float(amp[1:].max()) if len(amp) > 1 else 1.0,
        "amp argmax": int(np.argmax(amp)),
        "prod above 1, first 10": float(np.exp(log_above[:10].sum())),
        "prod above 1, all": float(np.exp(log_above.sum())),
        **_first_step(est),
    }


def default_paths(out, seeds):
    """The defaults benchmark's data sets at other seeds, replayed here as
    audit_unstable_growth replays its paths: a check of a limit chosen on the others."""
    from skpathkernel import PathKernelClassifier, PathKernelMachine

    rows = []
    for name, (X, y, kind) in ug._datasets().items():
        for seed in seeds:
            X_train, y_train, X_query, y_query = ug._split(X, y, seed)
            cls = PathKernelClassifier if kind == "clf" else PathKernelMachine
            est = cls(random_state=seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = ug._audit_path(f"{name}, defaults", est, X_train, y_train, X_query,
                                     y_query, seed)
                scores = est.attribute(X_query, y_query if kind == "clf" else None,
                                       method="unrolled")
            row = {"set": "defaults, more seeds", "path": rec["path"], "seed": seed,
                   **_stats(est, scores), **_small_share(est, X_query, y_query),
                   "quality": rec["quality"], "same path": True}
            rows.append(row)
            print(_line(row), flush=True)
            json.dump(rows, open(out, "w"), indent=1)


def growth_paths(out):
    """The Adam paths of audit_unstable_growth: statistics, quality from its json."""
    from skpathkernel import PathKernelClassifier, PathKernelMachine

    recorded = {(p["path"], p["seed"]): p
                for p in json.load(open("benchmarks/results/unstable_growth.json"))}
    data = ug._datasets()
    jobs = [(f"{name}, defaults", name, {}, kind) for name, (_, _, kind) in data.items()]
    jobs += [(label, name, params, "clf") for label, name, params in ug._contrasts()
             if params.get("solver", "adam") == "adam"]
    rows = []
    for label, name, params, kind in jobs:
        X, y, _ = data[name]
        for seed in ug.SEEDS[False]:
            X_train, y_train, X_query, y_query = ug._split(X, y, seed)
            cls = PathKernelClassifier if kind == "clf" else PathKernelMachine
            est = cls(random_state=seed, **params).fit(X_train, y_train)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scores = est.attribute(X_query, y_query if kind == "clf" else None,
                                       method="unrolled")
            rec = recorded[(label, seed)]
            row = {"set": "unstable_growth", "path": label, "seed": seed,
                   **_stats(est, scores), **_small_share(est, X_query, y_query),
                   "quality": rec["quality"],
                   "recorded growth": rec["growth"]}
            same = np.allclose(row["growth"], rec["growth"], rtol=1e-6, equal_nan=True)
            row["same path"] = bool(same)
            rows.append(row)
            print(_line(row), flush=True)
            json.dump(rows, open(out, "w"), indent=1)


def activation_paths(out, lds=False, seeds=(0, 1, 2)):
    """The paths of audit_unrolled_activation, replayed with audit_unstable_growth's
    removals (its N_QUERIES queries)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from skpathkernel import PathKernelClassifier
    from skpathkernel.metrics import linear_datamodeling_score, retrain_on_subsets

    X, y = load_digits(return_X_y=True)
    rows = []
    for n_train, batch in ACTIVATION_SIZES:
        for activation in ("gelu", "tanh"):
            for seed in seeds:
                # The activation audit's split and queries (its 20), the first N_QUERIES.
                X_train, X_test, y_train, y_test = train_test_split(
                    X / 16, y, train_size=n_train, test_size=20, random_state=seed)
                X_test, y_test = X_test[:ug.N_QUERIES], y_test[:ug.N_QUERIES]
                est = PathKernelClassifier(hidden_layer_sizes=(64, 64),
                                           activation=activation, batch_size=batch,
                                           max_iter=30, tol=None, random_state=seed)
                rec = ug._audit_path(f"digits {n_train}, batch {batch}, {activation}", est,
                                     X_train, y_train, X_test, y_test, seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    scores = est.attribute(X_test, y_test, method="unrolled")
                    row = {"set": "unrolled_activation", "path": rec["path"],
                           "seed": seed, **_stats(est, scores),
                           **_small_share(est, X_test, y_test), "quality": rec["quality"],
                           "same path": bool(np.allclose(scores.growth, rec["growth"]))}
                    if lds:
                        res = retrain_on_subsets(est, X_train, y_train, X_test, y_test,
                                                 n_subsets=30, subset_fraction=0.5,
                                                 protocol="replay", random_state=seed)
                        row["lds 0.5"] = float(linear_datamodeling_score(
                            scores, res.subsets, res.outputs))
                rows.append(row)
                print(_line(row), flush=True)
                json.dump(rows, open(out, "w"), indent=1)


def _verdicts(row):
    single = [q["spearman"] for q in row["quality"]["single"]]
    half = [q["spearman"] for q in row["quality"]["half"]]
    return {"single rho": float(np.nanmedian(single)),
            "half rho": float(np.nanmedian(half)),
            "fails": bool(np.mean([not s >= ug.FAIL_SPEARMAN for s in single]) >= 0.5),
            "fails half": bool(np.nanmedian(half) < ug.FAIL_SPEARMAN)}


def _line(row):
    v = _verdicts(row)
    return (f"{row['path']} seed {row['seed']}: growth {np.nanmax(row['growth']):.3g} "
            f"amp0 {row['amp0']:.3g} amp max {row['amp max']:.3g} (step "
            f"{row['amp argmax']}) prod10 {row['prod above 1, first 10']:.3g} "
            f"small grad {row['grad < 100 eps']:.3g} single rho {v['single rho']:.3f} "
            f"half rho {v['half rho']:.3f} same {row['same path']}")


CANDIDATES = (("amplification[0]", "amp0"), ("amplification[1]", "amp1"),
              ("max amplification", "amp max"),
              ("max amplification after step 0", "amp max after 0"),
              ("product of amplification above 1, first 10 steps",
               "prod above 1, first 10"),
              ("product of amplification above 1, all steps", "prod above 1, all"),
              ("growth (path max)", "growth max"),
              ("share of step-0 gradients under 100 eps", "grad < 100 eps"),
              ("scores' share from step 0's params of |g| < 100 eps", "small share"),
              ("the same, largest query's", "small share max query"),
              ("share of step-0 gradients under 1e4 eps", "grad < 10000 eps"))


def _auc(values, failed):
    return ug._auc(values, failed)


VERDICTS = (("fails", "single removals' median Spearman under 0.5 (audit_unstable_growth's: "
                        "half the queries under 0.5)"),
            ("fails half", "halves' median Spearman under 0.5"),
            ("fails half 0.7", "halves' median Spearman under 0.7"))
THRESHOLDS = {"amp0": (1.5, 2.0, 2.4, 3.0, 5.0), "amp max": (1.5, 2.0, 2.4, 3.0, 5.0),
              "small share": (0.1, 0.2, 0.3, 0.4, 0.5, 0.7)}


def report(files, mechanism_file, out):
    rows = [r for f in files for r in json.load(open(f))]
    for r in rows:
        r.update(_verdicts(r))
        r["fails half 0.7"] = bool(r["half rho"] < 0.7)
        r["growth max"] = float(np.nanmax(r["growth"]))
    lines = ["| set | path | seed | growth max | amp[0] | max amp (step) | "
             "prod amp>1 first 10 | step-0 grads < 100 eps | scores' share from them | "
             "single rho | half rho |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['path']} | {r['seed']} | {r['growth max']:.3g} | "
            f"{r['amp0']:.3g} | {r['amp max']:.3g} ({r['amp argmax']}) | "
            f"{r['prod above 1, first 10']:.3g} | {r['grad < 100 eps']:.2g} | "
            f"{r['small share']:.3f} | {r['single rho']:.3f} | {r['half rho']:.3f} |")
    for verdict, label in VERDICTS:
        failed = np.array([r[verdict] for r in rows])
        lines += ["", f"Failing by {label}: {failed.sum()} of {len(rows)} paths.", "",
                  "| statistic | AUC | largest on a sound path | failing paths above it |",
                  "|---|---|---|---|"]
        for name, key in CANDIDATES:
            vals = np.array([r[key] for r in rows], float)
            sound_max = np.nanmax(vals[~failed])
            lines.append(f"| {name} | {_auc(vals, failed):.3f} | {sound_max:.3g} | "
                         f"{int(np.sum(vals[failed] > sound_max))} of {failed.sum()} |")
        lines += ["", "| statistic > threshold | failing flagged | sound flagged "
                  "(which) |", "|---|---|---|"]
        for key, limits in THRESHOLDS.items():
            for limit in limits:
                flag = np.array([r[key] > limit for r in rows])
                which = "; ".join(f"{r['path']} seed {r['seed']}"
                                  for r, f, bad in zip(rows, flag, failed) if f and not bad)
                lines.append(f"| {key} > {limit:g} | {int((flag & failed).sum())} of "
                             f"{failed.sum()} | {int((flag & ~failed).sum())} of "
                             f"{(~failed).sum()}{' (' + which + ')' if which else ''} |")
    if mechanism_file:
        lines += ["", "Mechanism: the first step's term of the adjoint on the parameters "
                  "whose first gradient is under 100 eps, dropped (*drop small*) or the "
                  "step's own derivative dropped (*drop own*), against the scores as "
                  "computed; the same replays (30 singles, 20 halves).", "",
                  "| path | params < 100 eps | \\|a_1\\| | \\|u_0\\| | own | later "
                  "steps | on small params | amp[0] as computed / drop small / drop own | "
                  "growth | single rho | half rho |", "|---|---|---|---|---|---|---|---|"
                  "---|---|---|"]
        for r in json.load(open(mechanism_file)):
            def cell(key, fmt, r=r):
                return " / ".join(f"{r[m][key]:{fmt}}"
                                  for m in ("as computed", "drop small", "drop own"))

            lines.append(
                f"| {r['path']} | {r['small params']} | {r['|a_1|']:.3g} | "
                f"{r['|u_0|']:.3g} | {r['|u_0| own']:.3g} | {r['|u_0| later steps']:.3g} | "
                f"{r['|u_0| on small']:.3g} | {cell('amp0', '.3g')} | "
                f"{cell('growth max', '.3g')} | {cell('single rho', '.3f')} | "
                f"{cell('half rho', '.3f')} |")
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
        with open(out.replace(".md", ".json"), "w") as f:
            json.dump(rows, f, indent=1)


# --------------------------------------------------------------------------- mechanism
# The first step's term of the adjoint, split: which parameters carry it, and what the
# scores and their replays read without it. The adjoint of Adam's update is wrapped, at
# the step whose count is 1, to record its parts and optionally drop some.
_MODE = {"mode": None}
_INFO = {}


def _first_step_adjoint(spec, step, a, d):
    from skpathkernel._analysis import _unrolled

    adjoint = _unrolled._adam_adjoint
    if step.count != 1:
        return adjoint(spec, step, a, d)
    b1, b2 = spec.beta_1, spec.beta_2
    g = (step.v / (1.0 - b2)).sqrt()
    # The later steps' share of u (through the first and second moments they carry).
    future = torch.zeros_like(a["theta"])
    if a.get("v") is not None:
        future = future + a["v"] * (2.0 * (1.0 - b2) * d)
    if a.get("m") is not None:
        future = future + (1.0 - b1) * a["m"]
    a_theta = a["theta"].norm()
    u, new = adjoint(spec, step, a, d)
    own = u - future  # the step's own: -lr eps / (|g| + eps)^2 times the adjoint
    small = (g > 0) & (g < EPS_BANDS[0] * spec.epsilon)
    _INFO.update({"|a_1|": float(a_theta), "|u_0|": float(u.norm()),
                  "|u_0| own": float(own.norm()), "|u_0| later steps": float(future.norm()),
                  "|u_0| on small": float(u[:, small].norm()),
                  "small params": int(small.sum())})
    if _MODE["mode"] == "drop small":
        u = u.clone()
        u[:, small] = 0.0
    elif _MODE["mode"] == "drop own":
        u = future
    return u, new


def _small_share(est, X_query, y_query):
    """How much of the scores the first step's small-gradient parameters carry: the
    relative change (Frobenius, and the largest query's) of the scores without their
    term of the first step's adjoint."""
    from skpathkernel._analysis import _unrolled

    _unrolled._SOLVERS["adam"] = (_unrolled._adam_step, _first_step_adjoint)
    y_query = y_query if hasattr(est, "classes_") else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODE["mode"] = None
            full = np.asarray(est.attribute(X_query, y_query, method="unrolled"))
            _MODE["mode"] = "drop small"
            rest = np.asarray(est.attribute(X_query, y_query, method="unrolled"))
    finally:
        _MODE["mode"] = None
        _unrolled._SOLVERS["adam"] = (_unrolled._adam_step, _unrolled._adam_adjoint)
    per_query = np.linalg.norm(full - rest, axis=1) / np.linalg.norm(full, axis=1)
    return {"small share": float(np.linalg.norm(full - rest) / np.linalg.norm(full)),
            "small share max query": float(np.nanmax(per_query))}


MECHANISM_PATHS = {
    "digits 1000, batch 128, gelu seed 0": ("digits-gelu", 1000, 128, 0),
    "digits 1000, batch 128, gelu seed 1": ("digits-gelu", 1000, 128, 1),
    "digits 1000, batch 128, gelu seed 2": ("digits-gelu", 1000, 128, 2),
    "digits 400, batch 200, gelu seed 0": ("digits-gelu", 400, 200, 0),
    "iris, defaults seed 0": ("iris", {}, None, 0),
    "make_regression, defaults seed 1": ("make_regression", {}, None, 1),
    "iris, defaults but learning_rate_init=0.01 seed 0": (
        "iris", {"learning_rate_init": 0.01}, None, 0),
    "breast_cancer, defaults but learning_rate_init=0.01 seed 0": (
        "breast_cancer", {"learning_rate_init": 0.01}, None, 0),
}


def _mechanism_path(label):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from skpathkernel import PathKernelClassifier, PathKernelMachine

    name, a, b, seed = MECHANISM_PATHS[label]
    if name == "digits-gelu":
        X, y = load_digits(return_X_y=True)
        X_train, X_test, y_train, y_test = train_test_split(
            X / 16, y, train_size=a, test_size=20, random_state=seed)
        est = PathKernelClassifier(hidden_layer_sizes=(64, 64), activation="gelu",
                                   batch_size=b, max_iter=30, tol=None, random_state=seed)
        return est, X_train, y_train, X_test[:ug.N_QUERIES], y_test[:ug.N_QUERIES]
    X, y, kind = ug._datasets()[name]
    X_train, y_train, X_query, y_query = ug._split(X, y, seed)
    cls = PathKernelClassifier if kind == "clf" else PathKernelMachine
    return cls(random_state=seed, **a), X_train, y_train, X_query, y_query


def mechanism(out):
    """Per path: the first step's adjoint term split by parameter, and the replays'
    quality of the scores without its small-gradient parameters."""
    from skpathkernel._analysis import _unrolled

    _unrolled._SOLVERS["adam"] = (_unrolled._adam_step, _first_step_adjoint)
    rows = []
    for label in MECHANISM_PATHS:
        est, X_train, y_train, X_query, y_query = _mechanism_path(label)
        seed = MECHANISM_PATHS[label][3]
        row = {"path": label}
        for mode in (None, "drop small", "drop own"):
            _MODE["mode"] = mode
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = ug._audit_path(label, est, X_train, y_train, X_query, y_query, seed)
                scores = est.attribute(X_query, y_query if hasattr(est, "classes_")
                                       else None, method="unrolled")
            key = mode or "as computed"
            row[key] = {"amp0": float(scores.amplification[0]),
                        "growth max": float(np.nanmax(scores.growth)),
                        **{k: v for k, v in _verdicts(rec).items()}}
            row.update(_INFO)
            print(label, key, row[key], _INFO, flush=True)
        rows.append(row)
        json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    what, *files = sys.argv[1:]
    start = time.process_time()
    if what == "growth":
        growth_paths(files[0])
    elif what == "activation":
        activation_paths(files[0], lds="lds" in files[1:])
    elif what == "more":
        # more OUT_DEFAULTS.json OUT_ACTIVATION.json: seeds 3-5 of both sets.
        activation_paths(files[1], seeds=(3, 4, 5))
        default_paths(files[0], seeds=(3, 4, 5))
    elif what == "mechanism":
        mechanism(files[0])
    elif what == "report":
        # report MECHANISM.json OUT.md PATHS.json ...
        report(files[2:], files[0], files[1])
    print(f"cpu {time.process_time() - start:.0f} s")
