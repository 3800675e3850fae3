"""User trial s52: a scikit-learn power user and a hostile input tester.

Feeds bad input to every public method, kernel and function of skpathkernel and checks
that each call raises a clear error of the right type (not a torch traceback, not a silent
wrong answer) and leaves a fitted estimator bitwise as it was; then exercises the
scikit-learn power-user features (set_output, feature names, sample_weight, metadata
routing, clone, GridSearchCV(n_jobs=2), pickle, repr, labels).

Run from the repository root, pinned to one core (trial names select trials)::

    PYTHONPATH=. taskset -c 1 python benchmarks/trial_badinput.py [trial_bad_x ...]

Prints one line per probe: ``OK`` (the expected outcome), ``BAD`` (a finding) or
``NOTE``; the last line counts them. ``benchmarks/results/user_trial_badinput-s52.md``
reads the findings.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import tempfile
import traceback
import warnings

import numpy as np
import pandas as pd
import scipy.sparse as sp
import sklearn
import torch
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import skpathkernel
from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
    Trajectory,
    datasets,
    diagnostics,
    kernels,
    metrics,
    plotting,
)

torch.set_num_threads(1)
warnings.simplefilter("ignore")

RESULTS: list[tuple[str, str, str, str]] = []  # (verdict, target, case, what happened)
CLEAN = (ValueError, TypeError, IndexError, NotFittedError, KeyError)
TMP = tempfile.mkdtemp(prefix="trial_badinput_")


def _origin(exc) -> str:
    """The module of the innermost frame that raised ``exc``."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last.tb_frame.f_globals.get("__name__", "?") if last else "?"


def _unwrap(obj):
    return getattr(obj, "estimator_", obj)


def snapshot(est, probe):
    """Bitwise state of a fitted estimator: attributes by identity, network, outputs."""
    net = _unwrap(est)
    if hasattr(est, "score_samples"):
        out = est.score_samples(probe)
    elif hasattr(est, "predict"):
        out = est.predict(probe)
    else:
        out = est.transform(probe)
    return dict(
        keys=sorted(vars(est)),
        ids={k: id(v) for k, v in vars(est).items() if k not in est.get_params()},
        n=est.n_features_in_,
        names=list(getattr(est, "feature_names_in_", [])),
        module={k: v.clone() for k, v in net.module_.state_dict().items()},
        traj=net.trajectory_.parameters(-1).clone(),
        npoints=len(net.trajectory_),
        out=np.asarray(out).copy(),
    )


def same(a, b) -> str:
    for key in ("keys", "ids", "n", "names", "npoints"):
        if a[key] != b[key]:
            return f"{key} changed"
    for k, v in a["module"].items():
        if not torch.equal(v, b["module"][k]):
            return f"module {k} changed"
    if not torch.equal(a["traj"], b["traj"]):
        return "trajectory changed"
    if not np.array_equal(a["out"], b["out"], equal_nan=a["out"].dtype.kind in "fc"):
        return "outputs changed"
    return ""


def expect_error(target, case, call, est=None, probe=None, types=CLEAN, match=None):
    """``call()`` must raise one of ``types`` from outside torch, naming the problem
    (``match``: a word its message must hold), and leave ``est`` unchanged."""
    before = snapshot(est, probe) if est is not None else None
    try:
        out = call()
    except Exception as exc:  # the trial classifies every outcome
        msg = str(exc).replace("\n", " ")[:150]
        where = _origin(exc)
        verdict = "OK"
        why = f"{type(exc).__name__}: {msg}"
        if not isinstance(exc, types):
            verdict = "BAD"
        elif where.startswith("torch") or "torch" in type(exc).__module__:
            verdict, why = "BAD", f"[raised in {where}] " + why
        elif match is not None and match.lower() not in str(exc).lower():
            verdict, why = "BAD", f"[message lacks {match!r}] " + why
    else:
        verdict = "BAD"
        shape = getattr(out, "shape", None)
        why = f"returned {type(out).__name__}{'' if shape is None else shape} silently"
        if isinstance(out, np.ndarray) and out.dtype.kind == "f" and not np.isfinite(out).all():
            why += " (non-finite values)"
    if est is not None:
        change = same(before, snapshot(est, probe))
        if change:
            verdict, why = "BAD", f"{why}; AND {change}"
    RESULTS.append((verdict, target, case, why))


def expect_same(target, case, call, reference, rtol=0.0, atol=0.0):
    """``call()`` must succeed and agree with ``reference()`` (on float64 input)."""
    try:
        ref = reference()
        out = call()
        ok = _close(out, ref, rtol, atol)
        verdict = "OK" if ok else "BAD"
        why = "same result" if ok else f"differs: {_diff(out, ref)}"
    except Exception as exc:
        verdict = "BAD"
        why = f"{type(exc).__name__} in {_origin(exc)}: {str(exc)[:150]}"
    RESULTS.append((verdict, target, case, why))


def _arrays(out):
    if isinstance(out, tuple):
        return [np.asarray(o) for o in out]
    if hasattr(out, "contributions"):
        return [np.asarray(out.prediction), np.asarray(out.contributions)]
    if isinstance(out, (diagnostics.HessianTrace, diagnostics.HessianTracePath)):
        return [np.asarray(out.trace)]
    return [np.asarray(out)]


def _close(a, b, rtol, atol):
    A, B = _arrays(a), _arrays(b)
    if len(A) != len(B):
        return False
    for x, y in zip(A, B):
        if x.shape != y.shape:
            return False
        if x.dtype.kind in "fc":
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


def _diff(a, b):
    A, B = _arrays(a), _arrays(b)
    return "; ".join(
        f"shape {x.shape} vs {y.shape}"
        if x.shape != y.shape
        else (f"max|d|={np.max(np.abs(x - y)):.3g}" if x.dtype.kind in "fc" else "labels differ")
        for x, y in zip(A, B)
    )


# (target, case) -> why a probe's "BAD" outcome is the documented or scikit-learn
# behaviour: reported as NOTE with the reason.
ACCEPTED = {
    (
        "PathKernelMachine.score",
        "sample_weight negative",
    ): "as MLPRegressor.score: scikit-learn's metrics take negative weights",
    (
        "PathKernelClassifier.score",
        "sample_weight negative",
    ): "as MLPClassifier.score: scikit-learn's metrics take negative weights",
    ("kernels/methods", "PathKernel(stop=99)"): "documented: Python slice semantics",
    ("kernels/methods", "PathKernel(start=-99)"): "documented: Python slice semantics",
    (
        "kernels/methods",
        "path_weights(start=3, stop=1)",
    ): "documented slice semantics: an empty list",
    ("kernels/methods", "path_weights(stop=99)"): "documented: Python slice semantics",
    (
        "kernels/methods",
        "TangentKernel(eval_gradient='yes')",
    ): "as scikit-learn's kernels: eval_gradient is read by an if",
    (
        "linear_datamodeling_score",
        "strings",
    ): "numeric strings convert as np.asarray(float) converts them",
    (
        "linear_datamodeling_interval",
        "strings",
    ): "numeric strings convert as np.asarray(float) converts them",
    (
        "PathRecorder",
        "as_estimator(X NaN)",
    ): "deliberate (_training_data): kernels work, decompose/attribute refuse "
    "'Input X_train contains NaN'",
    (
        "PathRecorder",
        "as_estimator(y wrong length)",
    ): "deliberate: decompose/attribute refuse 'y_train has 5 rows but X_train has 12'",
    (
        "PathRecorder",
        "as_estimator(X wrong rows)",
    ): "deliberate: decompose refuses 'The trajectory's batches index 12 samples but "
    "X_train has 5'",
}


def check(target, case, ok, why):
    RESULTS.append(("OK" if ok else "BAD", target, case, why))


def note(target, case, why):
    RESULTS.append(("NOTE", target, case, why))


# ---------------------------------------------------------------------------------------
# Data and estimators
# ---------------------------------------------------------------------------------------
RNG = np.random.RandomState(0)
X = RNG.normal(size=(12, 3))
Y_REG = X[:, 0] - X[:, 1]
Y_CLF = np.array(["a", "b", "c"] * 4)
SMALL = dict(hidden_layer_sizes=(4,), max_iter=3, random_state=0, dtype="float64")
Q = X[:4]


def make(name):
    return {
        "PathKernelMachine": lambda: PathKernelMachine(**SMALL),
        "PathKernelClassifier": lambda: PathKernelClassifier(**SMALL),
        "TangentFeatures": lambda: TangentFeatures(PathKernelClassifier(**SMALL)),
        "TangentFeatureSVM": lambda: TangentFeatureSVM(PathKernelClassifier(**SMALL)),
        "OODRankDetector": lambda: OODRankDetector(PathKernelClassifier(**SMALL)),
    }[name]()


def targets(name):
    return Y_REG if name == "PathKernelMachine" else Y_CLF


NAMES = [
    "PathKernelMachine",
    "PathKernelClassifier",
    "TangentFeatures",
    "TangentFeatureSVM",
    "OODRankDetector",
]
FITTED = {n: make(n).fit(X, targets(n)) for n in NAMES}


def _name(e):
    return type(e).__name__


def _y4(e, A):
    """Targets for ``A``: one per row, 4 where ``A`` has no rows to count."""
    shape = np.shape(A) if not isinstance(A, (str, type(None))) else ()
    return np.resize(targets(_name(e)), shape[0] if shape else 4)


def _no_none(A):
    # X=None / Y=None is documented there: the training set, the Gram of X with itself.
    return np.nan if A is None else A


# verb -> call(est, A); the methods and functions that take X.
VERBS = {
    "predict": lambda e, A: e.predict(A),
    "predict_proba": lambda e, A: e.predict_proba(A),
    "predict_log_proba": lambda e, A: e.predict_log_proba(A),
    "decision_function": lambda e, A: e.decision_function(A),
    "transform": lambda e, A: e.transform(A),
    "score_samples": lambda e, A: e.score_samples(A),
    "score": lambda e, A: e.score(A, _y4(e, A)),
    "decompose": lambda e, A: e.decompose(A),
    "attribute": lambda e, A: e.attribute(A),
    "explain": lambda e, A: e.explain(A, n_neighbors=2),
    "kneighbors": lambda e, A: e.kneighbors(_no_none(A), n_neighbors=2),
    "rank_gap": lambda e, A: e.rank_gap(A),
    "TangentKernel": lambda e, A: TangentKernel(e)(A),
    "TangentKernel(Q, A)": lambda e, A: TangentKernel(e)(Q, _no_none(A)),
    "TangentKernel.diag": lambda e, A: TangentKernel(e).diag(A),
    "PathKernel": lambda e, A: PathKernel(e)(A),
    "PathKernel.diag": lambda e, A: PathKernel(e).diag(A),
    "step_kernel": lambda e, A: kernels.step_kernel(e, A),
    "hessian_trace": lambda e, A: diagnostics.hessian_trace(
        e, A, _y4(e, A), n_samples=2, random_state=0
    ),
    "hessian_trace_path": lambda e, A: (
        diagnostics.hessian_trace_path(
            e, A, _y4(e, A), n_samples=2, random_state=0, steps=[0, -1]
        ).trace
    ),
    "loss_path": lambda e, A: diagnostics.loss_path(e, A, _y4(e, A), steps=[0, -1]),
}
OWN = {
    "predict",
    "predict_proba",
    "predict_log_proba",
    "decision_function",
    "transform",
    "score_samples",
    "score",
    "decompose",
    "attribute",
    "explain",
    "kneighbors",
    "rank_gap",
}


def verbs_of(name):
    est = FITTED[name]
    return [v for v in VERBS if v not in OWN or hasattr(est, v)]


def _nan_at_diagonal(A):
    return np.where(np.eye(*A.shape, dtype=bool), np.nan, A)


_obj = Q.astype(object)
_obj[0, 0] = "a"
# name -> A (bad X for a 3-feature fit)
BAD_X = {
    "NaN": _nan_at_diagonal(Q),
    "inf": np.where(np.eye(4, 3, dtype=bool), np.inf, Q),
    "-inf": np.where(np.eye(4, 3, dtype=bool), -np.inf, Q),
    "csr": sp.csr_matrix(Q),
    "csr_array": sp.csr_array(Q),
    "coo": sp.coo_matrix(Q),
    "0 rows": Q[:0],
    "0 cols": Q[:, :0],
    "1-D": Q[0],
    "scalar": np.float64(1.0),
    "3-D": Q[:, :, None],
    "wrong n_features": Q[:, :2],
    "object strings": _obj,
    "complex": Q.astype(complex),
    "str": "abc",
    "None": None,
    "ragged list": [[1.0, 2.0, 3.0], [1.0, 2.0]],
    "string DataFrame": pd.DataFrame({"x0": ["u"] * 4, "x1": Q[:, 1], "x2": Q[:, 2]}),
    "NaN DataFrame": pd.DataFrame(_nan_at_diagonal(Q), columns=["x0", "x1", "x2"]),
    "pd.NA nullable DataFrame": pd.DataFrame(
        {"x0": pd.array([1.0, None, 2.0, 3.0], dtype="Float64"), "x1": Q[:, 1], "x2": Q[:, 2]}
    ),
}


def _readonly(A):
    A = A.copy()
    A.flags.writeable = False
    return A


# name -> A (inputs that must work and agree with their float64 reference)
GOOD_X = {
    "float32": lambda: Q.astype(np.float32),
    "float16": lambda: Q.astype(np.float16),
    "int": lambda: np.round(Q * 4).astype(np.int64),
    "bool": lambda: Q > 0,
    "Fortran": lambda: np.asfortranarray(Q),
    "non-contiguous rows": lambda: np.repeat(Q, 2, axis=0)[::2],
    "non-contiguous cols": lambda: np.repeat(Q, 2, axis=1)[:, ::2],
    "list": lambda: Q.tolist(),
    "tuple of tuples": lambda: tuple(map(tuple, Q)),
    "read-only": lambda: _readonly(Q),
    "1 row": lambda: Q[:1],
    "big-endian": lambda: Q.astype(">f8"),
    "object float": lambda: Q.astype(object),
    "torch tensor": lambda: torch.as_tensor(Q),
    "DataFrame without names": lambda: pd.DataFrame(Q),
}
REF_X = {
    "float32": lambda: Q.astype(np.float32).astype(np.float64),
    "float16": lambda: Q.astype(np.float16).astype(np.float64),
    "int": lambda: np.round(Q * 4),
    "bool": lambda: (Q > 0).astype(np.float64),
    "1 row": lambda: Q[:1],
}


def _fresh(name):
    return copy.deepcopy(FITTED[name])


def trial_bad_x():
    for name in NAMES:
        for verb in verbs_of(name):
            for case, A in BAD_X.items():
                est = _fresh(name)
                expect_error(
                    f"{name}.{verb}",
                    f"X {case}",
                    lambda est=est, verb=verb, A=A: VERBS[verb](est, A),
                    est,
                    Q,
                )


def trial_good_x():
    for name in NAMES:
        for verb in verbs_of(name):
            est = FITTED[name]
            for case, make_A in GOOD_X.items():
                ref = REF_X.get(case, lambda: Q)
                expect_same(
                    f"{name}.{verb}",
                    f"X {case}",
                    lambda est=est, verb=verb, make_A=make_A: VERBS[verb](est, make_A()),
                    lambda est=est, verb=verb, ref=ref: VERBS[verb](est, ref()),
                    rtol=1e-12,
                    atol=1e-12,
                )


def trial_feature_names():
    """Fitted with names: other names, reordered, none; fitted without names: names."""
    cols = ["u", "v", "w"]
    Xdf = pd.DataFrame(X, columns=cols)
    for name in NAMES:
        est = make(name).fit(Xdf, targets(name))
        check(
            name,
            "feature_names_in_ after DataFrame fit",
            list(getattr(est, "feature_names_in_", [])) == cols,
            f"feature_names_in_={getattr(est, 'feature_names_in_', None)}",
        )
        for verb in verbs_of(name):
            for case, A in [
                ("other names", pd.DataFrame(Q, columns=["p", "q", "r"])),
                ("reordered names", pd.DataFrame(Q[:, [1, 0, 2]], columns=["v", "u", "w"])),
            ]:
                e2 = copy.deepcopy(est)
                expect_error(
                    f"{name}.{verb}",
                    f"fit with names, X {case}",
                    lambda e2=e2, verb=verb, A=A: VERBS[verb](e2, A),
                    e2,
                    Xdf.iloc[:4],
                    match="feature names",
                )
            # NumPy X on a named fit: scikit-learn warns and computes by position.
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    VERBS[verb](est, Q)
                    ok, err = True, ""
                except Exception as exc:
                    ok, err = False, f"{type(exc).__name__}: {exc}"
            warned = any("feature names" in str(x.message) for x in w)
            check(
                f"{name}.{verb}",
                "fit with names, X numpy",
                ok,
                ("works, warns" if warned else "works, no warning") if ok else err,
            )
        # A DataFrame on a NumPy fit: same numbers.
        est = FITTED[name]
        for verb in ("predict", "transform", "score_samples"):
            if not hasattr(est, verb):
                continue
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = VERBS[verb](est, pd.DataFrame(Q, columns=cols))
            ref = VERBS[verb](est, Q)
            check(
                f"{name}.{verb}",
                "fit without names, X DataFrame",
                _close(out, ref, 0, 0),
                f"same={_close(out, ref, 0, 0)} warned="
                f"{any('feature names' in str(x.message) for x in w)}",
            )
        if hasattr(est, "get_feature_names_out"):
            e = make(name).fit(Xdf, targets(name))
            try:
                names = e.get_feature_names_out()
                n_out = e.transform(Q[:1]).shape[1]
                check(
                    f"{name}.get_feature_names_out",
                    "length = transform width",
                    len(names) == n_out,
                    f"{len(names)} names for {n_out} columns",
                )
            except Exception as exc:
                check(f"{name}.get_feature_names_out", "call", False, repr(exc)[:150])
            expect_error(
                f"{name}.get_feature_names_out",
                "input_features wrong names",
                lambda e=e: e.get_feature_names_out(["a", "b", "c"]),
            )
            expect_error(
                f"{name}.get_feature_names_out",
                "input_features wrong length",
                lambda e=e: e.get_feature_names_out(["u", "v"]),
            )
            expect_error(
                f"{name}.get_feature_names_out",
                "unfitted",
                lambda name=name: make(name).get_feature_names_out(),
                types=(NotFittedError,),
            )


def trial_set_output():
    Xdf = pd.DataFrame(X, columns=["u", "v", "w"])
    for name in NAMES:
        est = make(name)
        if not hasattr(est, "set_output"):
            continue
        est.set_output(transform="pandas").fit(Xdf, targets(name))
        out = est.transform(Xdf.iloc[:3])
        ok = isinstance(out, pd.DataFrame) and list(out.columns) == list(
            est.get_feature_names_out()
        )
        check(
            name,
            "set_output(transform='pandas')",
            ok,
            f"{type(out).__name__}, columns match names: {ok}",
        )
        out = est.transform(Xdf.iloc[[5, 2, 7]])
        check(
            name,
            "set_output pandas keeps the index",
            isinstance(out, pd.DataFrame) and list(out.index) == [5, 2, 7],
            f"index {list(getattr(out, 'index', []))}",
        )
        for verb in ("predict", "decision_function", "predict_proba"):
            if hasattr(est, verb):
                o = getattr(est, verb)(Xdf.iloc[:3])
                check(
                    name,
                    f"set_output pandas leaves {verb} NumPy",
                    isinstance(o, np.ndarray),
                    type(o).__name__,
                )
        out = make(name).set_output(transform="pandas").fit_transform(Xdf, targets(name))
        check(
            name,
            "fit_transform with set_output pandas",
            isinstance(out, pd.DataFrame),
            type(out).__name__,
        )
        try:
            import polars  # noqa: F401
        except ImportError:
            note(name, "set_output polars", "polars not installed")
        else:
            out = make(name).set_output(transform="polars").fit(Xdf, targets(name)).transform(Q)
            check(
                name,
                "set_output polars",
                type(out).__module__.startswith("polars"),
                type(out).__name__,
            )
    pipe = make_pipeline(StandardScaler(), TangentFeatures(PathKernelClassifier(**SMALL)))
    pipe.set_output(transform="pandas")
    out = pipe.fit(Xdf, Y_CLF).transform(Xdf)
    check(
        "Pipeline(StandardScaler, TangentFeatures)",
        "set_output pandas",
        isinstance(out, pd.DataFrame),
        type(out).__name__,
    )


def _outputs(est, A):
    return est.predict(A) if isinstance(est, PathKernelMachine) else est.predict_proba(A)


def trial_sample_weight():
    w_int = np.array([1, 2, 1, 3, 1, 1, 2, 1, 1, 1, 2, 1])
    for name in ("PathKernelMachine", "PathKernelClassifier"):
        cls = type(FITTED[name])
        y = targets(name)
        # fit(X, y, w) == fit(repeat(X, w), repeat(y, w)) under full-batch training, where
        # the mean over the repeated rows is the weighted mean (brute force).
        for solver in ("sgd", "adam"):
            p = dict(SMALL, solver=solver, batch_size=None, learning_rate_init=0.05, max_iter=4)
            a = cls(**p).fit(X, y, sample_weight=w_int)
            b = cls(**p).fit(np.repeat(X, w_int, axis=0), np.repeat(y, w_int))
            d = np.max(np.abs(_outputs(a, Q) - _outputs(b, Q)))
            check(
                name,
                f"sample_weight == repetition (full batch, {solver})",
                d < 1e-10,
                f"max|d|={d:.2e}",
            )
        p = dict(SMALL, batch_size=None)
        w = np.linspace(0.5, 2, 12)
        a = cls(**p).fit(X, y, sample_weight=w)
        b = cls(**p).fit(X, y, sample_weight=3 * w)
        d = float(
            np.max(np.abs((a.trajectory_.parameters(-1) - b.trajectory_.parameters(-1)).numpy()))
        )
        check(name, "sample_weight scale invariance", d < 1e-12, f"max|d theta|={d:.2e}")
        w = np.ones(12)
        w[[2, 5]] = 0
        a = cls(**p).fit(X, y, sample_weight=w)
        b = cls(**p).fit(X[w > 0], y[w > 0])
        d = np.max(np.abs(_outputs(a, Q) - _outputs(b, Q)))
        check(name, "zero sample_weight == row dropped (full batch)", d < 1e-10, f"max|d|={d:.2e}")
        est = FITTED[name]
        w = np.linspace(0.1, 1, 12)
        s = est.score(X, y, sample_weight=w)
        metric = (
            sklearn.metrics.r2_score
            if name == "PathKernelMachine"
            else sklearn.metrics.accuracy_score
        )
        ref = metric(y, est.predict(X), sample_weight=w)
        check(name, "score(sample_weight) = sklearn metric", np.isclose(s, ref), f"{s} vs {ref}")
        for case, sw in {
            "wrong length": np.ones(5),
            "negative": -np.ones(12),
            "NaN entry": np.r_[np.nan, np.ones(11)],
            "inf entry": np.r_[np.inf, np.ones(11)],
            "2-D": np.ones((12, 1)),
            "all zero": np.zeros(12),
            "complex": np.ones(12, dtype=complex),
            "sparse": sp.csr_matrix(np.ones((12, 1))),
        }.items():
            for verb in ("fit", "partial_fit", "score"):
                est = _fresh(name)
                expect_error(
                    f"{name}.{verb}",
                    f"sample_weight {case}",
                    lambda est=est, verb=verb, sw=sw, y=y: getattr(est, verb)(
                        X, y, sample_weight=sw
                    ),
                    est,
                    Q,
                )
    for name in ("TangentFeatures", "TangentFeatureSVM", "OODRankDetector"):
        for case, sw in {
            "wrong length": np.ones(5),
            "negative": -np.ones(12),
            "NaN entry": np.r_[np.nan, np.ones(11)],
        }.items():
            est = _fresh(name)
            expect_error(
                f"{name}.fit",
                f"sample_weight {case}",
                lambda est=est, sw=sw, name=name: est.fit(X, targets(name), sample_weight=sw),
                est,
                Q,
            )


def trial_y():
    """Bad y for fit / score / attribute."""
    for name in NAMES:
        y = targets(name)
        reg = name == "PathKernelMachine"
        cases = {
            "y wrong length": y[:5],
            "y 2-D column": None if reg else y[:, None],
            "y list": list(y),
            "y object with None": np.array(list(y[:-1]) + [None], dtype=object),
            "y complex": (Y_REG + 0j) if reg else None,
            "y bool": (Y_REG > 0) if reg else None,
            "y float16": Y_REG.astype(np.float16) if reg else None,
            "y strings for regressor": Y_CLF if reg else None,
            "y continuous for classifier": None if reg else Y_REG,
        }
        for case, yy in cases.items():
            if yy is None:
                continue
            est = _fresh(name)
            before = snapshot(est, Q)
            try:
                est.fit(X, yy)
                outcome = "fitted"
            except Exception as exc:
                outcome = f"{type(exc).__name__} in {_origin(exc)}: {str(exc)[:120]}"
            if case in ("y list", "y 2-D column", "y bool", "y float16"):
                check(f"{name}.fit", case, outcome == "fitted", outcome)
            else:
                change = same(before, snapshot(est, Q))
                ok = outcome != "fitted" and " in torch" not in outcome and not change
                check(f"{name}.fit", case, ok, outcome + (f"; AND {change}" if change else ""))
        est = _fresh(name)
        if hasattr(est, "score"):
            expect_error(
                f"{name}.score", "y wrong length", lambda est=est, y=y: est.score(Q, y[:3]), est, Q
            )
    for name in ("PathKernelMachine", "PathKernelClassifier"):
        y = targets(name)
        cases = {"y wrong length": y[:3], "y NaN": np.full(4, np.nan), "y 3-D": np.zeros((4, 1, 1))}
        if name == "PathKernelClassifier":
            cases["unseen label"] = np.array(["zz"] * 4)
        for case, yy in cases.items():
            est = _fresh(name)
            if name == "PathKernelMachine":
                # Documented: "Regressors: ignored" (scikit-learn's y=None convention).
                try:
                    est.attribute(Q, yy)
                    note(f"{name}.attribute", case, "ignored, as documented for regressors")
                except Exception as exc:
                    note(f"{name}.attribute", case, f"{type(exc).__name__}: {str(exc)[:100]}")
                continue
            expect_error(
                f"{name}.attribute", case, lambda est=est, yy=yy: est.attribute(Q, yy), est, Q
            )


def trial_fit_data():
    for name in NAMES:
        y = targets(name)
        cases = {
            "1 sample": (X[:1], y[:1]),
            "1 class": None if name == "PathKernelMachine" else (X, np.resize(y[:1], 12)),
            "X NaN": (_nan_at_diagonal(X), y),
            "X sparse": (sp.csr_matrix(X), y),
            "X object": (np.where(np.eye(12, 3, dtype=bool), "a", X.astype(object)), y),
            "X 3-D": (X[:, :, None], y),
            "X complex": (X.astype(complex), y),
            "X wrong rows": (X[:10], y),
            "X empty": (X[:0], y[:0]),
        }
        for case, data in cases.items():
            if data is None:
                continue
            est = _fresh(name)
            expect_error(f"{name}.fit", case, lambda est=est, d=data: est.fit(*d), est, Q)
        if hasattr(FITTED[name], "partial_fit"):
            for case, data in {
                "wrong n_features": (X[:, :2], y),
                "X NaN": (_nan_at_diagonal(X), y),
                "X sparse": (sp.csr_matrix(X), y),
                "new class": None
                if name == "PathKernelMachine"
                else (X, np.resize(["a", "zz"], 12)),
                "1-D X": (X[:, 0], y),
                "0 rows": (X[:0], y[:0]),
            }.items():
                if data is None:
                    continue
                est = _fresh(name)
                expect_error(
                    f"{name}.partial_fit", case, lambda est=est, d=data: est.partial_fit(*d), est, Q
                )
    # partial_fit after a fit with names: other names refused (scikit-learn's reset=False).
    for name in ("PathKernelMachine", "PathKernelClassifier"):
        y = targets(name)
        est = make(name).fit(pd.DataFrame(X, columns=["u", "v", "w"]), y)
        expect_error(
            f"{name}.partial_fit",
            "fit with names, X of other names",
            lambda est=est, y=y: est.partial_fit(pd.DataFrame(X, columns=["p", "q", "r"]), y),
            est,
            pd.DataFrame(Q, columns=["u", "v", "w"]),
            match="feature names",
        )
    for name in NAMES:
        y = targets(name)[:2] if name == "PathKernelMachine" else np.array(["a", "b"])
        try:
            make(name).fit(X[:2], y)
            check(f"{name}.fit", "2 samples", True, "fits")
        except Exception as exc:
            check(
                f"{name}.fit",
                "2 samples",
                isinstance(exc, ValueError) and "torch" not in _origin(exc),
                f"{type(exc).__name__}: {str(exc)[:120]}",
            )
    # Finite float64 inputs near 1e300: a clear error, or finite outputs (a float64
    # network may fit them); never a torch.linalg error or NaN.
    for name in NAMES:
        est = _fresh(name)
        before = snapshot(est, Q)
        try:
            est.fit(X * 1e300, targets(name))
            out = (est.transform if hasattr(est, "transform") else est.score_samples)(Q * 1e300)
            ok = bool(np.isfinite(out).all())
            why = f"fits; outputs finite: {ok}"
        except Exception as exc:
            ok = isinstance(exc, ValueError) and "torch" not in _origin(exc)
            why = f"{type(exc).__name__} in {_origin(exc)}: {str(exc)[:120]}"
            change = same(before, snapshot(est, Q))
            if change:
                ok, why = False, f"{why}; AND {change}"
        check(f"{name}.fit", "X * 1e300 (float64)", ok, why)


def trial_non_finite_loss():
    for name in ("PathKernelMachine", "PathKernelClassifier"):
        est = _fresh(name)
        before = snapshot(est, Q)
        old = est.get_params()
        est.set_params(learning_rate_init=1e6, solver="sgd", max_iter=30)
        try:
            est.fit(X * 100, targets(name))
            out = est.predict(Q)
            finite = np.all(np.isfinite(out)) if out.dtype.kind == "f" else True
            check(
                f"{name}.fit",
                "lr=1e6 diverges",
                finite,
                "fitted without error; predictions finite=" + str(finite),
            )
        except Exception as exc:
            est.set_params(**old)
            change = same(before, snapshot(est, Q))
            msg = str(exc)
            ok = "step" in msg and "learning_rate_init" in msg and not change
            check(
                f"{name}.fit",
                "lr=1e6 diverges",
                ok,
                f"{type(exc).__name__}: {msg[:160]}" + (f"; AND {change}" if change else ""),
            )


def trial_indices():
    est = FITTED["PathKernelClassifier"]
    traj = est.trajectory_
    n = len(traj)
    for meth in (
        "state_dict",
        "parameters",
        "optimizer_state",
        "preconditioner",
        "step_size_scales",
    ):
        for k in (n, -n - 1, 1.5, True, "0"):
            expect_error(
                f"Trajectory.{meth}", f"k={k!r}", lambda meth=meth, k=k: getattr(traj, meth)(k)
            )
    n_steps = traj.n_steps
    for meth in ("batch", "batch_weights", "pool"):
        for k in (n_steps, -n_steps - 1, 1.5, True):
            expect_error(
                f"Trajectory.{meth}", f"step={k!r}", lambda meth=meth, k=k: getattr(traj, meth)(k)
            )
    expect_error("Trajectory.unflatten", "wrong length", lambda: traj.unflatten(torch.zeros(3)))
    expect_error("Trajectory.unflatten", "numpy array", lambda: traj.unflatten(np.zeros(3)))
    expect_error(
        "Trajectory.save",
        "to an existing directory",
        lambda: traj.save(TMP),
        types=CLEAN + (OSError,),
    )
    expect_error(
        "Trajectory.load",
        "a missing file",
        lambda: Trajectory.load(os.path.join(TMP, "missing.pt")),
        types=CLEAN + (OSError,),
    )
    garbage = os.path.join(TMP, "garbage.pt")
    with open(garbage, "wb") as fh:
        fh.write(b"not a trajectory")
    expect_error(
        "Trajectory.load",
        "a file of garbage",
        lambda: Trajectory.load(garbage),
        types=CLEAN + (OSError,),
    )
    m = copy.deepcopy(est.module_)
    m.load_state_dict(traj.state_dict(0))
    check("Trajectory.state_dict(0)", "loads into module_", True, "loads")
    net = est
    nan_q = _nan_at_diagonal(Q)
    for case, call in {
        "TangentKernel(step=99)": lambda: TangentKernel(net, step=99)(Q),
        "TangentKernel(step=-99)": lambda: TangentKernel(net, step=-99)(Q),
        "TangentKernel(step=True)": lambda: TangentKernel(net, step=True)(Q),
        "TangentKernel(output=-4)": lambda: TangentKernel(net, output=-4)(Q),
        "TangentKernel(output='x')": lambda: TangentKernel(net, output="x")(Q),
        "TangentKernel(output=1.0)": lambda: TangentKernel(net, output=1.0)(Q),
        "PathKernel(start=3, stop=1)": lambda: PathKernel(net, start=3, stop=1)(Q),
        "PathKernel(stop=99)": lambda: PathKernel(net, stop=99)(Q),
        "PathKernel(start=-99)": lambda: PathKernel(net, start=-99)(Q),
        "PathKernel(memory='x')": lambda: PathKernel(net, memory="x")(Q),
        "PathKernel(split='x')": lambda: PathKernel(net, split="x")(Q),
        "PathKernel(n_jobs=0)": lambda: PathKernel(net, n_jobs=0)(Q),
        "PathKernel(n_jobs=1.5)": lambda: PathKernel(net, n_jobs=1.5)(Q),
        "TangentKernel(unfitted)": lambda: TangentKernel(PathKernelMachine())(Q),
        "TangentKernel(estimator=None)": lambda: TangentKernel(None)(Q),
        "TangentKernel(estimator=SVC)": lambda: TangentKernel(sklearn.svm.SVC())(Q),
        "TangentKernel(eval_gradient='yes')": lambda: TangentKernel(net)(Q, eval_gradient="y"),
        "step_kernel(step=99)": lambda: kernels.step_kernel(net, Q, step=99),
        "step_kernel(Y wrong n_features)": lambda: kernels.step_kernel(net, Q, Q[:, :2]),
        "step_kernel(Y NaN)": lambda: kernels.step_kernel(net, Q, nan_q),
        "path_weights(start=3, stop=1)": lambda: kernels.path_weights(traj, 3, 1),
        "path_weights(stop=99)": lambda: kernels.path_weights(traj, 0, 99),
        "path_weights(start=1.5)": lambda: kernels.path_weights(traj, 1.5),
        "path_weights(memory='x')": lambda: kernels.path_weights(traj, memory="x"),
        "path_weights(trajectory=array)": lambda: kernels.path_weights(np.zeros(3)),
        "full_to_matrix(2-D)": lambda: kernels.full_to_matrix(np.zeros((4, 4))),
        "full_to_matrix(blocks not square)": lambda: kernels.full_to_matrix(np.zeros((2, 3, 2, 3))),
        "matrix_to_full(n_outputs=3 for 4x4)": lambda: kernels.matrix_to_full(np.zeros((4, 4)), 3),
        "matrix_to_full(n_outputs=0)": lambda: kernels.matrix_to_full(np.zeros((4, 4)), 0),
        "matrix_to_full(1-D)": lambda: kernels.matrix_to_full(np.zeros(4), 2),
        "matrix_to_full(n_outputs=2.0)": lambda: kernels.matrix_to_full(np.zeros((4, 4)), 2.0),
        "matrix_to_full(n_outputs=True)": lambda: kernels.matrix_to_full(np.zeros((4, 4)), True),
        "explain(n_neighbors=1.5)": lambda: net.explain(Q, n_neighbors=1.5),
        "explain(output=9)": lambda: net.explain(Q, n_neighbors=2, output=9),
        "attribute(output=9)": lambda: net.attribute(Q, output=9),
        "attribute(output=-9)": lambda: net.attribute(Q, output=-9),
        "attribute(output='x')": lambda: net.attribute(Q, output="x"),
        "attribute(n_jobs=0)": lambda: net.attribute(Q, n_jobs=0),
        "self_influence(output=9)": lambda: net.self_influence(output=9),
        "self_influence(output=1.5)": lambda: net.self_influence(output=1.5),
        "kneighbors(step=-99)": lambda: net.kneighbors(Q, 2, step=-99),
        "kneighbors(return_distance='no')": lambda: net.kneighbors(Q, 2, return_distance="no"),
        "decompose(tol=-1)": lambda: net.decompose(Q, tol=-1.0),
        "decompose(tol=nan)": lambda: net.decompose(Q, tol=np.nan),
        "decompose(n_jobs=0)": lambda: net.decompose(Q, n_jobs=0),
        "decompose(n_nodes=True)": lambda: net.decompose(Q, n_nodes=True),
        "hessian_trace(step=1.5)": lambda: diagnostics.hessian_trace(net, step=1.5, n_samples=2),
        "hessian_trace(batch_size=0)": lambda: diagnostics.hessian_trace(
            net, n_samples=2, batch_size=0
        ),
        "hessian_trace(sample_weight wrong length)": lambda: diagnostics.hessian_trace(
            net, X, Y_CLF, sample_weight=np.ones(3), n_samples=2
        ),
        "hessian_trace(sample_weight negative)": lambda: diagnostics.hessian_trace(
            net, X, Y_CLF, sample_weight=-np.ones(12), n_samples=2
        ),
        "hessian_trace(sample_weight NaN)": lambda: diagnostics.hessian_trace(
            net, X, Y_CLF, sample_weight=np.full(12, np.nan), n_samples=2
        ),
        "hessian_trace(estimator unfitted)": lambda: diagnostics.hessian_trace(
            PathKernelMachine(), n_samples=2
        ),
        "hessian_trace(estimator=SVC)": lambda: diagnostics.hessian_trace(
            sklearn.svm.SVC(), n_samples=2
        ),
        "hessian_trace_path(steps=[99])": lambda: diagnostics.hessian_trace_path(
            net, steps=[99], n_samples=2
        ),
        "hessian_trace_path(steps=[])": lambda: diagnostics.hessian_trace_path(
            net, steps=[], n_samples=2
        ),
        "hessian_trace_path(steps=[[0]])": lambda: diagnostics.hessian_trace_path(
            net, steps=[[0]], n_samples=2
        ),
        "hessian_trace_path(steps=[0.5])": lambda: diagnostics.hessian_trace_path(
            net, steps=[0.5], n_samples=2
        ),
        "loss_path(steps=[1.5])": lambda: diagnostics.loss_path(net, steps=[1.5]),
        "loss_path(steps='all')": lambda: diagnostics.loss_path(net, steps="all"),
        "loss_path(steps=[True])": lambda: diagnostics.loss_path(net, steps=[True]),
        "loss_path(batch_size=0)": lambda: diagnostics.loss_path(net, batch_size=0),
        "loss_path(unseen labels)": lambda: diagnostics.loss_path(
            net, X, np.resize(["a", "zz"], 12)
        ),
    }.items():
        expect_error("kernels/methods", case, call, _fresh("PathKernelClassifier"), Q)


def trial_metrics():
    from scipy.stats import spearmanr

    rng = np.random.RandomState(1)
    n_sub, n_train, n_query = 8, 12, 4
    subsets = rng.rand(n_sub, n_train) < 0.5
    outputs = rng.normal(size=(n_sub, n_query))
    attr = rng.normal(size=(n_query, n_train))
    pred = subsets.astype(float) @ attr.T
    ref = np.mean([spearmanr(pred[:, j], outputs[:, j]).statistic for j in range(n_query)])
    try:
        got = metrics.linear_datamodeling_score(attr, subsets, outputs)
        check(
            "linear_datamodeling_score",
            "vs brute-force Spearman",
            np.isclose(got, ref),
            f"{got} vs {ref}",
        )
    except Exception as exc:
        check("linear_datamodeling_score", "vs brute force", False, repr(exc)[:150])
    for case, args in {
        "attributions NaN": (np.full_like(attr, np.nan), subsets, outputs),
        "outputs inf": (attr, subsets, np.full_like(outputs, np.inf)),
        "subsets wrong n_train": (attr, subsets[:, :5], outputs),
        "outputs wrong n_subsets": (attr, subsets, outputs[:3]),
        "attributions wrong n_query": (attr[:2], subsets, outputs),
        "subsets non-boolean floats": (attr, subsets * 0.5, outputs),
        "subsets 1-D": (attr, subsets[0], outputs),
        "attributions 3-D": (attr[:, :, None, None], subsets, outputs),
        "strings": (attr.astype(str), subsets, outputs),
        "sparse attributions": (sp.csr_matrix(attr), subsets, outputs),
        "1 subset": (attr, subsets[:1], outputs[:1]),
    }.items():
        expect_error(
            "linear_datamodeling_score", case, lambda a=args: metrics.linear_datamodeling_score(*a)
        )
        expect_error(
            "linear_datamodeling_interval",
            case,
            lambda a=args: metrics.linear_datamodeling_interval(*a, n_resamples=20, random_state=0),
        )
    expect_error(
        "linear_datamodeling_score",
        "multioutput='x'",
        lambda: metrics.linear_datamodeling_score(attr, subsets, outputs, multioutput="x"),
    )
    expect_error(
        "linear_datamodeling_interval",
        "confidence_level=1.5",
        lambda: metrics.linear_datamodeling_interval(attr, subsets, outputs, confidence_level=1.5),
    )
    expect_error(
        "linear_datamodeling_interval",
        "n_resamples=0",
        lambda: metrics.linear_datamodeling_interval(attr, subsets, outputs, n_resamples=0),
    )
    est = PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, random_state=0)
    for case, kw in {
        "X NaN": dict(X=_nan_at_diagonal(X)),
        "X_query wrong n_features": dict(X_query=Q[:, :2]),
        "X_query NaN": dict(X_query=_nan_at_diagonal(Q)),
        "y wrong length": dict(y=Y_REG[:5]),
        "y_query wrong length": dict(y_query=Y_REG[:2]),
        "subset_fraction=0": dict(subset_fraction=0.0),
        "subset_fraction=1.5": dict(subset_fraction=1.5),
        "n_subsets=0": dict(n_subsets=0),
        "n_subsets=True": dict(n_subsets=True),
        "subsets out-of-range index": dict(subsets=[[0, 1, 99]]),
        "subsets negative index": dict(subsets=[[0, 1, -1]]),
        "subsets bool wrong width": dict(subsets=np.ones((2, 5), dtype=bool)),
        "subsets float": dict(subsets=np.full((2, 12), 0.5)),
        "subsets empty": dict(subsets=np.zeros((2, 12), dtype=bool)),
        "subsets 3-D": dict(subsets=np.ones((2, 12, 1), dtype=bool)),
        "output='x'": dict(output="x"),
        "protocol='x'": dict(protocol="x"),
        "n_repeats=0": dict(n_repeats=0),
        "estimator=SVC": dict(estimator=sklearn.svm.SVC()),
        "X sparse": dict(X=sp.csr_matrix(X)),
    }.items():
        base = dict(estimator=est, X=X, y=Y_REG, X_query=Q, n_subsets=2, random_state=0)
        base.update(kw)
        expect_error("retrain_on_subsets", case, lambda b=base: metrics.retrain_on_subsets(**b))
    for case, kw in {
        "n_models=0": dict(n_models=0),
        "X_query wrong n_features": dict(X_query=Q[:, :2]),
        "X_query NaN": dict(X_query=_nan_at_diagonal(Q)),
        "y wrong length": dict(y=Y_REG[:5]),
        "bad attribute param": dict(method="x"),
    }.items():
        base = dict(estimator=est, X=X, y=Y_REG, X_query=Q, n_models=2, random_state=0)
        base.update(kw)
        expect_error("ensemble_attribution", case, lambda b=base: metrics.ensemble_attribution(**b))


def trial_recorder():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(Y_REG)[:, None]
    with PathRecorder(net, opt, n_samples=12) as rec:
        for _ in range(3):
            rec.set_batch(np.arange(12))
            opt.zero_grad()
            loss = 0.5 * ((net(Xt) - yt) ** 2).mean()
            loss.backward()
            opt.step()
    for case, call in {
        "set_batch(out-of-range)": lambda: rec.set_batch([0, 99]),
        "set_batch(negative)": lambda: rec.set_batch([-1, 0]),
        "set_batch(floats)": lambda: rec.set_batch([0.5, 1.0]),
        "set_batch(2-D)": lambda: rec.set_batch([[0, 1]]),
        "set_batch(weights wrong length)": lambda: rec.set_batch([0, 1], weights=[1.0]),
        "set_batch(weights NaN)": lambda: rec.set_batch([0, 1], weights=[np.nan, 1.0]),
        "as_estimator(X wrong n_features)": lambda: rec.as_estimator(X[:, :2], Y_REG),
        "as_estimator(X NaN)": lambda: rec.as_estimator(_nan_at_diagonal(X), Y_REG),
        "as_estimator(y wrong length)": lambda: rec.as_estimator(X, Y_REG[:5]),
        "as_estimator(X wrong rows)": lambda: rec.as_estimator(X[:5], Y_REG[:5]),
        "as_estimator(loss='x')": lambda: rec.as_estimator(X, Y_REG, loss="x"),
        "as_estimator(sparse X)": lambda: rec.as_estimator(sp.csr_matrix(X), Y_REG),
        "as_estimator(memory_budget=0)": lambda: rec.as_estimator(X, Y_REG, memory_budget=0),
        "clip_grad_norm_(max_norm=nan)": lambda: rec.clip_grad_norm_(np.nan),
        "clip_grad_norm_(max_norm=-1)": lambda: rec.clip_grad_norm_(-1.0),
    }.items():
        expect_error("PathRecorder", case, call)
    rn = rec.as_estimator(X, Y_REG)
    check(
        "RecordedNetwork.predict",
        "== module(X)",
        np.allclose(
            rn.predict(Q).ravel(),
            net(torch.as_tensor(Q)).detach().numpy().ravel(),
            rtol=0,
            atol=1e-12,
        ),
        "",
    )
    for case, A in BAD_X.items():
        for verb in ("predict", "decompose", "attribute"):
            expect_error(
                f"RecordedNetwork.{verb}", f"X {case}", lambda verb=verb, A=A: getattr(rn, verb)(A)
            )
    for case, make_A in GOOD_X.items():
        refA = REF_X.get(case, lambda: Q)
        expect_same(
            "RecordedNetwork.predict",
            f"X {case}",
            lambda make_A=make_A: rn.predict(make_A()),
            lambda refA=refA: rn.predict(refA()),
            rtol=1e-12,
            atol=1e-12,
        )


def trial_plotting():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Fitted with names: a DataFrame of other names must be refused.
    named = pd.DataFrame(X, columns=["u", "v", "w"])
    est = make("PathKernelClassifier").fit(named, Y_CLF)
    od = make("OODRankDetector").fit(named, Y_CLF)
    nan_q = _nan_at_diagonal(Q)
    displays = {
        "KernelMatrixDisplay": (est, lambda A: plotting.KernelMatrixDisplay.from_estimator(est, A)),
        "KernelNeighborsDisplay": (
            est,
            lambda A: plotting.KernelNeighborsDisplay.from_estimator(est, A),
        ),
        "KernelEvolutionDisplay": (
            est,
            lambda A: plotting.KernelEvolutionDisplay.from_estimator(est, A),
        ),
        "RankGapDisplay": (od, lambda A: plotting.RankGapDisplay.from_estimator(od, A)),
        "TangentEmbeddingDisplay": (
            est,
            lambda A: plotting.TangentEmbeddingDisplay.from_estimator(est, A),
        ),
    }
    for disp, (_, call) in displays.items():
        for case, A in {
            "X NaN": nan_q,
            "X wrong n_features": Q[:, :2],
            "X sparse": sp.csr_matrix(Q),
            "X 0 rows": Q[:0],
            "X other names": pd.DataFrame(Q, columns=["p", "q", "r"]),
        }.items():
            expect_error(f"plotting.{disp}", case, lambda call=call, A=A: call(A))
        plt.close("all")
    expect_error(
        "plotting.KernelMatrixDisplay",
        "unfitted",
        lambda: plotting.KernelMatrixDisplay.from_estimator(PathKernelClassifier(), Q),
        types=(NotFittedError,),
    )
    plt.close("all")


def trial_datasets():
    for fn in (
        "make_circle",
        "make_ellipse",
        "make_sine",
        "make_square_wave",
        "make_linear_extrapolation",
    ):
        f = getattr(datasets, fn)
        seeded = fn != "make_linear_extrapolation"  # a grid: no randomness, no random_state
        a, b = (f(random_state=0), f(random_state=0)) if seeded else (f(), f())
        check(
            f"datasets.{fn}", "deterministic", all(np.array_equal(x, y) for x, y in zip(a, b)), ""
        )
        for case, kw in {
            "n_samples=0": dict(n_samples=0),
            "n_samples=-1": dict(n_samples=-1),
            "n_samples=1.5": dict(n_samples=1.5),
            "n_samples=True": dict(n_samples=True),
            "noise=-1": dict(noise=-1.0),
            "noise=nan": dict(noise=np.nan),
            "random_state='x'": dict(random_state="x"),
        }.items():
            try:
                f(**kw)
                check(f"datasets.{fn}", case, False, "returned silently")
            except TypeError as exc:
                if "unexpected keyword" in str(exc):
                    continue
                check(f"datasets.{fn}", case, True, f"TypeError: {str(exc)[:120]}")
            except ValueError as exc:
                check(f"datasets.{fn}", case, True, f"{type(exc).__name__}: {str(exc)[:120]}")
            except Exception as exc:
                check(f"datasets.{fn}", case, False, f"{type(exc).__name__}: {str(exc)[:120]}")


class _Net(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.lin(x)


def trial_power_user():
    for name in NAMES:
        est = FITTED[name]
        c = clone(est)
        check(
            name,
            "clone after fit is unfitted",
            not hasattr(c, "trajectory_") and not hasattr(c, "n_features_in_"),
            str(sorted(k for k in vars(c) if k.endswith("_"))),
        )
        e2 = pickle.loads(pickle.dumps(est))
        check(
            name,
            "pickle round trip",
            np.array_equal(snapshot(est, Q)["out"], snapshot(e2, Q)["out"]),
            "",
        )
        key = "estimator__alpha" if "estimator" in est.get_params(deep=False) else "alpha"
        r = repr(make(name).set_params(**{key: 0.5}))
        check(name, "repr shows changed param", "alpha=0.5" in r, r[:120].replace("\n", " "))
        p = make(name).get_params(deep=True)
        check(
            name,
            "get_params(deep=True) nested",
            "estimator__hidden_layer_sizes" in p or "hidden_layer_sizes" in p,
            f"{len(p)} keys",
        )
    est = FITTED["PathKernelMachine"]
    from sklearn.kernel_ridge import KernelRidge

    for K in (TangentKernel(est), PathKernel(est)):
        K2 = pickle.loads(pickle.dumps(K))
        check(type(K).__name__, "pickle round trip", np.array_equal(K(Q), K2(Q)), "")
        check(type(K).__name__, "clone", np.array_equal(K(Q), clone(K)(Q)), "")
        r = repr(type(K)(est, normalized=True))
        check(type(K).__name__, "repr with changed params", "normalized=True" in r, r[:150])
        kr = KernelRidge(kernel=K).fit(X, Y_REG)
        check(type(K).__name__, "KernelRidge(kernel=K)", np.isfinite(kr.predict(Q)).all(), "")
    e = PathKernelMachine(module=_Net, max_iter=2, random_state=0)
    p = e.get_params(deep=True)
    check(
        "PathKernelMachine(module=Net)", "get_params(deep=True)", "module" in p, str(list(p))[:150]
    )
    try:
        clone(e.fit(X, Y_REG))
        e2 = pickle.loads(pickle.dumps(e))
        check(
            "PathKernelMachine(module=Net)",
            "clone and pickle after fit",
            np.array_equal(e.predict(Q), e2.predict(Q)),
            "",
        )
    except Exception as exc:
        check("PathKernelMachine(module=Net)", "clone and pickle after fit", False, repr(exc)[:150])
    for labels in (
        np.array(["cat", "dog", "eel"] * 4),
        np.array([3, 7, 11] * 4),
        np.array([-1, 1] * 6),
        np.array([True, False] * 6),
        np.array([1.0, 2.0, 4.0] * 4),
        pd.Series(pd.Categorical(["u", "v", "w"] * 4)),
    ):
        arr = np.asarray(labels)
        for name in ("PathKernelClassifier", "TangentFeatureSVM"):
            e = make(name).fit(X, labels)
            pred = e.predict(Q)
            ok = (
                set(np.unique(pred)) <= set(np.unique(arr))
                and np.asarray(e.classes_).dtype == np.unique(arr).dtype
            )
            check(
                name,
                f"labels {arr[:3]} ({arr.dtype})",
                ok,
                f"classes_={e.classes_}, predict dtype {pred.dtype}",
            )
            if not hasattr(e, "predict_proba"):  # TangentFeatureSVM: its SVC's probability
                continue
            pr = e.predict_proba(Q)
            check(
                name,
                f"predict_proba columns = classes_ ({arr.dtype})",
                pr.shape[1] == len(e.classes_),
                str(pr.shape),
            )
    Ymo = np.column_stack([Y_REG, -Y_REG])
    e = PathKernelMachine(**SMALL).fit(X, Ymo)
    check(
        "PathKernelMachine", "multi-output y", e.predict(Q).shape == (4, 2), str(e.predict(Q).shape)
    )
    e = PathKernelMachine(**SMALL).fit(X, Ymo[:, :1])
    note("PathKernelMachine", "y of shape (n, 1)", f"predict shape {e.predict(Q).shape}")
    Yml = (X[:, :2] > 0).astype(int)
    try:
        e = PathKernelClassifier(**SMALL).fit(X, Yml)
        check(
            "PathKernelClassifier",
            "multilabel y",
            e.predict(Q).shape == (4, 2),
            f"predict {e.predict(Q).shape}, proba {e.predict_proba(Q).shape}",
        )
    except Exception as exc:
        note("PathKernelClassifier", "multilabel y", repr(exc)[:150])
    gs = GridSearchCV(PathKernelClassifier(**SMALL), {"alpha": [0.0, 0.1]}, cv=2, n_jobs=2)
    gs.fit(X, Y_CLF)
    check(
        "GridSearchCV(n_jobs=2)",
        "PathKernelClassifier",
        hasattr(gs, "best_params_"),
        str(gs.best_params_),
    )
    gs = GridSearchCV(
        TangentFeatureSVM(PathKernelClassifier(**SMALL)),
        {"estimator__hidden_layer_sizes": [(3,), (4,)], "C": [1.0, 2.0]},
        cv=2,
        n_jobs=2,
    )
    gs.fit(X, Y_CLF)
    check("GridSearchCV(n_jobs=2)", "TangentFeatureSVM estimator__", True, str(gs.best_params_))
    s = cross_val_score(PathKernelMachine(**SMALL), X, Y_REG, cv=3)
    check("cross_val_score", "PathKernelMachine", np.isfinite(s).all(), str(s))
    s = cross_val_score(
        OODRankDetector(PathKernelClassifier(**SMALL)),
        X,
        Y_CLF,
        cv=3,
        scoring=lambda e, A, y: float(np.mean(e.predict(A) == 1)),
    )
    check("cross_val_score", "OODRankDetector custom scorer", np.isfinite(s).all(), str(s))
    w = np.array([1, 2, 1, 3, 1, 1, 2, 1, 1, 1, 2, 1], dtype=float)

    def routed(name):
        # A meta-estimator routes the weight to its trainer, which requests it itself
        # (scikit-learn's routing: each consumer states its requests).
        if name in NAMES[:2]:
            return make(name).set_fit_request(sample_weight=True)
        inner = PathKernelClassifier(**SMALL).set_fit_request(sample_weight=True)
        return type(make(name))(inner).set_fit_request(sample_weight=True)

    with sklearn.config_context(enable_metadata_routing=True):
        for name in NAMES:
            pipe = make_pipeline(
                StandardScaler().set_fit_request(sample_weight=False), routed(name)
            )
            try:
                pipe.fit(X, targets(name), sample_weight=w)
                direct = routed(name).fit(
                    StandardScaler().fit_transform(X), targets(name), sample_weight=w
                )
                unweighted = routed(name).fit(StandardScaler().fit_transform(X), targets(name))
                a, b, c = (
                    _unwrap(e).trajectory_.parameters(-1) for e in (pipe[-1], direct, unweighted)
                )
                check(
                    name,
                    "metadata routing: Pipeline sample_weight == direct, != none",
                    torch.equal(a, b) and not torch.equal(a, c),
                    "",
                )
            except Exception as exc:
                check(name, "metadata routing: Pipeline sample_weight", False, repr(exc)[:150])
            try:
                inner = routed(name)
                if hasattr(inner, "set_score_request"):
                    inner.set_score_request(sample_weight=True)
                key = "alpha" if name in NAMES[:2] else "estimator__alpha"
                scoring = None if hasattr(inner, "score") else (lambda e, A, y: 0.0)
                gs = GridSearchCV(
                    inner, {key: [0.0, 0.1]}, cv=2, scoring=scoring, error_score="raise"
                )
                gs.fit(X, targets(name), sample_weight=w)
                check(name, "metadata routing: GridSearchCV sample_weight", True, "")
            except Exception as exc:
                check(name, "metadata routing: GridSearchCV sample_weight", False, repr(exc)[:300])
            try:
                make_pipeline(make(name)).fit(X, targets(name), sample_weight=w)
                check(
                    name,
                    "routing on, sample_weight not requested -> error",
                    False,
                    "fitted silently",
                )
            except Exception as exc:
                check(
                    name,
                    "routing on, sample_weight not requested -> error",
                    isinstance(exc, (ValueError, TypeError)),
                    type(exc).__name__ + ": " + str(exc)[:100],
                )
    for name in NAMES:
        for verb in verbs_of(name):
            e = make(name)
            expect_error(
                f"{name}.{verb}",
                "unfitted",
                lambda e=e, verb=verb: VERBS[verb](e, Q),
                types=(NotFittedError,),
            )
        if hasattr(make(name), "self_influence"):
            expect_error(
                f"{name}.self_influence",
                "unfitted",
                lambda name=name: make(name).self_influence(),
                types=(NotFittedError,),
            )


TRIALS = [
    trial_bad_x,
    trial_good_x,
    trial_feature_names,
    trial_set_output,
    trial_sample_weight,
    trial_y,
    trial_fit_data,
    trial_non_finite_loss,
    trial_indices,
    trial_metrics,
    trial_recorder,
    trial_plotting,
    trial_datasets,
    trial_power_user,
]


def main(argv):
    only = set(argv[1:])
    for trial in TRIALS:
        if only and trial.__name__ not in only:
            continue
        n0 = len(RESULTS)
        try:
            trial()
        except Exception:
            RESULTS.append(
                (
                    "BAD",
                    trial.__name__,
                    "trial crashed",
                    traceback.format_exc().replace("\n", " | ")[-600:],
                )
            )
        print(f"# {trial.__name__}: {len(RESULTS) - n0} probes", file=sys.stderr, flush=True)
    for i, (verdict, target, case, why) in enumerate(RESULTS):
        if verdict == "BAD" and (target, case) in ACCEPTED:
            RESULTS[i] = ("NOTE", target, case, f"{why} -- {ACCEPTED[target, case]}")
    for verdict, target, case, why in RESULTS:
        print(f"{verdict}\t{target}\t{case}\t{why}")
    counts = {v: sum(r[0] == v for r in RESULTS) for v in ("OK", "BAD", "NOTE")}
    print(
        f"# skpathkernel {skpathkernel.__version__}, sklearn {sklearn.__version__}, "
        f"torch {torch.__version__}: {counts}"
    )


if __name__ == "__main__":
    main(sys.argv)
