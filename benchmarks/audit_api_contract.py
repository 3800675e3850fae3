"""Audit of the public contract (API.md): run each stated behaviour on small CPU examples.

Prints one line per check, ``[ok]`` or ``[DIFF]``, with the numbers it measured; the
table in ``benchmarks/results/api_contract_audit-s49.md`` quotes them. Run from the
repository root: ``python -m benchmarks.audit_api_contract``.
"""

import contextlib
import copy
import inspect
import io
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import (
    ClassifierMixin,
    OutlierMixin,
    RegressorMixin,
    TransformerMixin,
    clone,
    is_classifier,
    is_outlier_detector,
    is_regressor,
)
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import Kernel
from sklearn.kernel_ridge import KernelRidge
from sklearn.model_selection import GridSearchCV
from sklearn.svm import SVC

from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
    Trajectory,
)
from skpathkernel import datasets as ds
from skpathkernel.diagnostics import hessian_trace

# The public methods that take X (the estimators have those of their kind).
X_METHODS = [
    "predict",
    "predict_proba",
    "decision_function",
    "transform",
    "decompose",
    "explain",
    "kneighbors",
    "attribute",
    "score_samples",
    "rank_gap",
]
SMALL = dict(hidden_layer_sizes=(8,), max_iter=5, random_state=0)
RESULTS = []


def check(name):
    def deco(fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn()
            ok, msg = out if isinstance(out, tuple) else (bool(out), "")
        except Exception as exc:
            ok, msg = False, f"raised {type(exc).__name__}: {exc}"[:400]
            traceback.print_exc(limit=2)
        RESULTS.append((name, ok, msg))
        print(f"[{'ok' if ok else 'DIFF'}] {name}: {msg}", flush=True)
        return fn

    return deco


rng = np.random.RandomState(0)
X = rng.randn(40, 3)
y = np.sin(X[:, 0]) + 0.1 * X[:, 1]
yc = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5)  # 3 classes
Xq = rng.randn(5, 3)


@check("activations relu/tanh/gelu/softplus/identity")
def _():
    for a in ["relu", "tanh", "gelu", "softplus", "identity"]:
        PathKernelMachine(activation=a, **SMALL).fit(X, y)
    return True, "all five fit"


@check("solvers sgd/adam/adamw/rmsprop, decompose exact error per solver (float64)")
def _():
    errs = {}
    for s in ["sgd", "adam", "adamw", "rmsprop"]:
        kw = dict(momentum=0.9) if s == "sgd" else {}
        est = PathKernelMachine(solver=s, dtype="float64", alpha=1e-3, **kw, **SMALL).fit(X, y)
        errs[s] = float(est.decompose(Xq).error)
    return max(errs.values()) < 1e-8, f"error {errs}"


@check("batch_size=None is full batch; int is minibatch")
def _():
    est = PathKernelMachine(batch_size=None, **SMALL).fit(X, y)
    t = est.trajectory_
    full = all(len(t.batch(k)) == len(X) for k in range(t.n_steps))
    est2 = PathKernelMachine(batch_size=8, **SMALL).fit(X, y)
    t2 = est2.trajectory_
    mini = all(len(t2.batch(k)) <= 8 for k in range(t2.n_steps))
    return full and mini, f"full-batch steps {t.n_steps} (5 epochs); minibatch steps {t2.n_steps}"


@check("classifier loss log_loss | squared_error")
def _():
    c1 = PathKernelClassifier(loss="log_loss", **SMALL).fit(X, yc)
    c2 = PathKernelClassifier(loss="squared_error", **SMALL).fit(X, yc)
    p = c1.predict_proba(Xq)
    return True, (
        f"log_loss: predict_proba rows sum {p.sum(1).round(6)}; squared_error: "
        f"predict {c2.predict(Xq)}, has predict_proba: {hasattr(c2, 'predict_proba')}"
    )


@check("record_every=1 records every step")
def _():
    est = PathKernelMachine(record_every=1, **SMALL).fit(X, y)
    t = est.trajectory_
    return list(t.steps) == list(range(len(t))), f"len {len(t)}, steps {list(t.steps)[:4]}..."


@check('device="cuda" without a GPU is a clear error')
def _():
    if torch.cuda.is_available():
        return True, "GPU present: not checked here"
    try:
        PathKernelMachine(device="cuda", **SMALL).fit(X, y)
    except Exception as exc:
        return "cuda" in str(exc).lower(), f"{type(exc).__name__}: {str(exc)[:160]}"
    return False, "no error"


@check("same seed -> identical results")
def _():
    a = PathKernelMachine(**SMALL).fit(X, y).predict(Xq)
    b = PathKernelMachine(**SMALL).fit(X, y).predict(Xq)
    return np.array_equal(a, b), f"max diff {np.abs(a - b).max()}"


@check("trajectory_: len, steps, learning_rates, state_dict(k) loads into module_, batches")
def _():
    est = PathKernelMachine(
        solver="sgd", learning_rate_init=0.05, batch_size=16, normalize_y=False, **SMALL
    ).fit(X, y)
    t = est.trajectory_
    lr_ok = len(t.learning_rates) == len(t) - 1 and np.allclose(t.learning_rates, 0.05)
    m = copy.deepcopy(est.module_)
    Xt = torch.as_tensor(Xq, dtype=torch.float32)
    m.load_state_dict(t.state_dict(0))
    f0 = m(Xt).detach().numpy().ravel()
    m.load_state_dict(t.state_dict(-1))
    fT = m(Xt).detach().numpy().ravel()
    r = est.decompose(Xq)
    d0 = np.abs(f0 - r.initial.ravel()).max()
    dT = np.abs(fT - est.predict(Xq)).max()
    sizes = sorted({len(b) for b in t.batches})
    ok = lr_ok and len(t.batches) == t.n_steps and d0 < 1e-6 and dT < 1e-6
    return ok, (
        f"len {len(t)}, steps[-1] {t.steps[-1]}, learning_rates {t.learning_rates[:2]}, "
        f"{len(t.batches)} batches of sizes {sizes}; state_dict(0) -> decompose.initial "
        f"{d0:.1e}, state_dict(-1) -> predict {dT:.1e}"
    )


@check(
    "decompose: regularization holds weight decay; expected differs from realized on minibatches"
)
def _():
    e0 = PathKernelMachine(solver="sgd", dtype="float64", **SMALL).fit(X, y)
    e1 = PathKernelMachine(solver="sgd", dtype="float64", alpha=1e-2, **SMALL).fit(X, y)
    r0, r1 = e0.decompose(Xq), e1.decompose(Xq)
    em = PathKernelMachine(batch_size=8, dtype="float64", **SMALL).fit(X, y)
    rr, re = em.decompose(Xq), em.decompose(Xq, weighting="expected")
    ok = np.abs(r0.regularization).max() == 0 and np.abs(r1.regularization).max() > 0
    ok &= float(rr.error) < 1e-10 and not np.allclose(rr.contributions, re.contributions)
    return ok, (
        f"regularization alpha=0 {np.abs(r0.regularization).max():.1e}, alpha=1e-2 "
        f"{np.abs(r1.regularization).max():.2e} (error {float(r1.error):.1e}); "
        f"minibatch realized error {float(rr.error):.1e}, expected error {float(re.error):.2e}"
    )


@check("trajectory save/load without pickle")
def _():
    est = PathKernelMachine(**SMALL).fit(X, y)
    with tempfile.TemporaryDirectory() as d:
        est.trajectory_.save(d + "/t")
        t = Trajectory.load(d + "/t")
    same = all(torch.equal(t.parameters(k), est.trajectory_.parameters(k)) for k in range(len(t)))
    return same, f"{len(t)} points equal after save/load"


@check("fitted attributes (regressor, classifier, pandas)")
def _():
    import pandas as pd

    df = pd.DataFrame(X, columns=["a", "b", "c"])
    est = PathKernelMachine(**SMALL).fit(df, y)
    names = [
        "module_",
        "trajectory_",
        "loss_curve_",
        "n_iter_",
        "n_params_",
        "n_features_in_",
        "feature_names_in_",
        "path_kernel_",
        "tangent_kernel_",
    ]
    miss = [n for n in names if not hasattr(est, n)]
    clf = PathKernelClassifier(**SMALL).fit(X, yc)
    miss += [n for n in ["classes_"] if not hasattr(clf, n)]
    return not miss, f"missing {miss}; feature_names_in_ {list(est.feature_names_in_)}"


@check("decompose result shapes, all methods and weightings")
def _():
    clf = PathKernelClassifier(**SMALL).fit(X, yc)
    out = []
    for method in ["exact", "first_order", "second_order"]:
        for w in ["realized", "expected"]:
            r = clf.decompose(Xq, method=method, weighting=w)
            shapes = (
                r.initial.shape,
                r.contributions.shape,
                r.regularization.shape,
                r.prediction.shape,
            )
            closure = np.abs(
                r.initial + r.contributions.sum(1) + r.regularization - r.prediction
            ).max()
            out.append((method, w, shapes, float(r.error), float(closure)))
    ok = all(s == ((5, 3), (5, 40, 3), (5, 3), (5, 3)) for _, _, s, _, _ in out)
    ok &= all(abs(e - c) <= 1e-6 * max(1, c) for _, _, _, e, c in out)
    return ok, "; ".join(f"{m}/{w}: err {e:.2e}" for m, w, _, e, _ in out)


@check("decompose prediction == predict / decision_function")
def _():
    clf = PathKernelClassifier(**SMALL).fit(X, yc)
    r = clf.decompose(Xq)
    d = clf.decision_function(Xq)
    reg = PathKernelMachine(**SMALL).fit(X, y)
    r2 = reg.decompose(Xq)
    return (
        np.allclose(r.prediction, d, atol=1e-5)
        and np.allclose(r2.prediction.ravel(), reg.predict(Xq), atol=1e-5)
    ), (
        f"clf {np.abs(r.prediction - d).max():.1e}, reg "
        f"{np.abs(r2.prediction.ravel() - reg.predict(Xq)).max():.1e}"
    )


@check("explain(X, n_neighbors=10): largest |contribution|")
def _():
    reg = PathKernelMachine(**SMALL).fit(X, y)
    e = reg.explain(Xq)
    r = reg.decompose(Xq)
    idx = getattr(e, "indices", e[0] if isinstance(e, tuple) else None)
    con = r.contributions[:, :, 0]
    ref = np.argsort(-np.abs(con), axis=1)[:, :10]
    same = all(set(np.asarray(idx)[i].tolist()) == set(ref[i].tolist()) for i in range(5))
    return same, f"type {type(e).__name__}, indices shape {np.asarray(idx).shape}"


@check("kneighbors(X, n_neighbors=100, kernel=tangent|path, step=-1, normalized=True)")
def _():
    reg = PathKernelMachine(**SMALL).fit(X, y)
    out = []
    for k in ["tangent", "path"]:
        res = reg.kneighbors(Xq, n_neighbors=10, kernel=k)
        out.append((k, [np.asarray(a).shape for a in res]))
    dist, ind = reg.kneighbors(Xq, n_neighbors=10, kernel="tangent")
    K = reg.tangent_kernel_(Xq, X)
    kq = np.diag(reg.tangent_kernel_(Xq))
    kx = np.diag(reg.tangent_kernel_(X))
    Kn = K / np.sqrt(np.outer(kq, kx))
    ref = np.argsort(-Kn, axis=1)[:, :10]
    same = np.array_equal(np.sort(ind, 1), np.sort(ref, 1))
    return same, f"{out}; matches cosine-normalized brute force: {same}"


@check("path_kernel_/tangent_kernel_ in SVC, KernelRidge, GaussianProcessRegressor")
def _():
    reg = PathKernelMachine(**SMALL).fit(X, y)
    clf = PathKernelClassifier(**SMALL).fit(X, yc)
    SVC(kernel=clf.path_kernel_).fit(X, yc).predict(Xq)
    SVC(kernel=clf.tangent_kernel_).fit(X, yc).predict(Xq)
    KernelRidge(kernel=reg.tangent_kernel_).fit(X, y).predict(Xq)
    KernelRidge(kernel=reg.path_kernel_).fit(X, y).predict(Xq)
    try:
        GaussianProcessRegressor(kernel=reg.path_kernel_).fit(X, y)
        gp_default = "fits"
    except np.linalg.LinAlgError as exc:
        gp_default = f"LinAlgError ({str(exc)[-50:]})"
    # kernels.rst: float32 Grams are PSD to round-off only; give an alpha above it
    for k in [reg.path_kernel_, reg.tangent_kernel_]:
        alpha = 1e-6 * np.trace(k(X))
        GaussianProcessRegressor(kernel=k, alpha=alpha).fit(X, y).predict(Xq)
    return (
        True,
        f"GPR default alpha on float32 n_params={reg.n_params_}, n=40: {gp_default}; "
        f"with alpha=1e-6 tr K: fits; types {type(reg.path_kernel_).__name__}, "
        f"{type(reg.tangent_kernel_).__name__}",
    )


@check("transform(X) = tangent features at final parameters (vs autograd loop)")
def _():
    reg = PathKernelMachine(dtype="float64", **SMALL).fit(X, y)
    phi = reg.transform(Xq)
    m = reg.module_
    rows = []
    for x in Xq:
        m.zero_grad()
        out = m(torch.as_tensor(x[None], dtype=torch.float64)).sum()
        g = torch.autograd.grad(out, list(m.parameters()))
        rows.append(torch.cat([a.reshape(-1) for a in g]).numpy())
    ref = np.array(rows)
    return np.allclose(
        phi, ref, atol=1e-10
    ), f"phi {phi.shape}, max diff {np.abs(phi - ref).max():.1e}"


@check("meta-estimators: default estimator of the right kind; fit clones; Frozen used as is")
def _():
    out = []
    for cls, yy in [(TangentFeatures, y), (TangentFeatureSVM, yc), (OODRankDetector, None)]:
        m = cls().fit(X, yy) if yy is not None else cls().fit(X)
        out.append((cls.__name__, type(m.estimator_).__name__))
    base = PathKernelClassifier(**SMALL)
    tf = TangentFeatures(estimator=base).fit(X, yc)
    cloned = tf.estimator_ is not base and not hasattr(base, "trajectory_")
    fitted = PathKernelClassifier(**SMALL).fit(X, yc)
    before = fitted.trajectory_.parameters(-1).clone()
    tf2 = TangentFeatures(estimator=FrozenEstimator(fitted)).fit(X[:10], yc[:10])
    frozen_ok = torch.equal(fitted.trajectory_.parameters(-1), before) and np.allclose(
        tf2.transform(Xq), fitted.transform(Xq)
    )
    return cloned and frozen_ok, f"{out}; clone: {cloned}; frozen unchanged and used: {frozen_ok}"


@check("GridSearchCV reaches estimator__hidden_layer_sizes")
def _():
    gs = GridSearchCV(
        TangentFeatureSVM(estimator=PathKernelClassifier(**SMALL)),
        {"estimator__hidden_layer_sizes": [(4,), (8,)]},
        cv=2,
    ).fit(X, yc)
    return True, f"best {gs.best_params_}"


@check("TangentFeatures: dense (n, n_params); n_components; normalize=False; names; pandas")
def _():
    tf = TangentFeatures(estimator=PathKernelMachine(**SMALL)).fit(X, y)
    phi = tf.transform(Xq)
    n_params = tf.estimator_.n_params_
    ok = phi.shape == (5, n_params) and isinstance(phi, np.ndarray)
    tfp = TangentFeatures(estimator=PathKernelMachine(**SMALL), n_components=7, random_state=0).fit(
        X, y
    )
    z1, z2 = tfp.transform(Xq), clone(tfp).fit(X, y).transform(Xq)
    ok &= z1.shape == (5, 7) and np.array_equal(z1, z2)
    names = tf.get_feature_names_out()
    ok &= len(names) == n_params
    tf.set_output(transform="pandas")
    df = tf.transform(Xq)
    ok &= type(df).__name__ == "DataFrame"
    return ok, (
        f"phi {phi.shape} (n_params {n_params}), JL {z1.shape} seeded repeatable, "
        f"names[0] {names[0]!r}, pandas {type(df).__name__}; "
        f"default normalize={TangentFeatures().normalize}"
    )


@check("TangentFeatureSVM: svm_kernel linear|tangent|path, transform, svm_")
def _():
    out = []
    for k in ["linear", "tangent", "path"]:
        m = TangentFeatureSVM(estimator=PathKernelClassifier(**SMALL), svm_kernel=k, C=1.0).fit(
            X, yc
        )
        out.append((k, type(m.svm_).__name__, round(m.score(X, yc), 3), m.transform(Xq).shape))
    return True, str(out)


@check(
    "OODRankDetector: methods, fit with/without y, score_samples, decision_function, "
    "predict, rank_gap"
)
def _():
    out = []
    ok = True
    for method in ["local", "residual", "alignment"]:
        for yy in [None, y]:
            d = OODRankDetector(estimator=PathKernelMachine(**SMALL), method=method, n_neighbors=10)
            d.fit(X, yy) if yy is not None else d.fit(X)
            s = d.score_samples(Xq)
            df = d.decision_function(Xq)
            p = d.predict(Xq)
            ok &= np.allclose(df, s - d.offset_) and set(p) <= {1, -1}
            out.append(method)
    d = OODRankDetector(
        estimator=PathKernelMachine(**SMALL), method="residual", contamination=0.1
    ).fit(X)
    Xnew = rng.randn(400, 3)
    frac = float(np.mean(d.predict(Xnew) == -1))
    rg = d.rank_gap(Xq)
    return (
        ok,
        f"decision = score - offset_, predict in +-1; contamination=0.1 -> fresh "
        f"in-distribution outlier frac {frac:.3f}; rank_gap {rg}",
    )


@check(
    "PathKernel/TangentKernel: Kernel subclass, __call__, eval_gradient, diag, stationary, "
    "clone, output, normalized"
)
def _():
    reg = PathKernelMachine(**SMALL).fit(X, np.c_[y, -y])
    msgs, ok = [], True
    for K in [TangentKernel(reg), PathKernel(reg)]:
        ok &= isinstance(K, Kernel) and not K.is_stationary() and len(K.hyperparameters) == 0
        G = K(Xq)
        Gg, dG = K(Xq, eval_gradient=True)
        ok &= np.allclose(np.diag(G), K.diag(Xq), rtol=1e-5) and dG.shape == (5, 5, 0)
        Kc = clone(K)
        ok &= np.allclose(Kc(Xq, X), K(Xq, X))
        tr = K(Xq)
        k0 = clone(K).set_params(output=0)(Xq)
        k1 = clone(K).set_params(output=1)(Xq)
        ok &= np.allclose(tr, (k0 + k1) / 2, rtol=1e-4)  # trace / C (kernels.rst)
        kn = clone(K).set_params(normalized=True)(Xq)
        ok &= np.allclose(np.diag(kn), 1, atol=1e-5)
        msgs.append(f"{type(K).__name__}: trace == (K_0 + K_1) / 2, normalized diag 1")
    # "TangentKernel at one recorded step (default: the final one)"
    ok &= np.allclose(TangentKernel(reg)(Xq), TangentKernel(reg, step=len(reg.trajectory_) - 1)(Xq))
    return ok, "; ".join(msgs)


class _CNN(torch.nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.c = torch.nn.Conv2d(1, 2, 3)
        self.l = torch.nn.Linear(2 * 4 * 4, n_out)

    def forward(self, x):
        return self.l(torch.tanh(self.c(x)).flatten(1))


class _Tok(torch.nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.e = torch.nn.Embedding(10, 4)
        self.l = torch.nn.Linear(4, n_out)

    def forward(self, x):
        return self.l(self.e(x).mean(1))


@check("N-D inputs with module=: images, sequences, int tokens; every method same shapes")
def _():
    Xi = rng.randn(30, 1, 6, 6)
    Xs = rng.randn(30, 5, 3)
    Xt = rng.randint(0, 10, size=(30, 5))
    yy = (rng.rand(30) > 0.5).astype(int)
    out = []
    for XX, mod in [
        (Xi, lambda i, o: _CNN(o)),
        (Xs, lambda i, o: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(15, o))),
        (Xt, lambda i, o: _Tok(o)),
    ]:
        c = PathKernelClassifier(module=mod, max_iter=3, random_state=0).fit(XX, yy)
        c.predict(XX[:3])
        c.transform(XX[:3])
        c.decompose(XX[:3])
        c.kneighbors(XX[:3], 5)
        c.path_kernel_(XX[:3], XX[:4])
        c.explain(XX[:3], 3)
        out.append(XX.shape)
    return True, f"fit/predict/transform/decompose/kneighbors/path_kernel_/explain on {out}"


def _bad_inputs():
    Xn = Xq.copy()
    Xn[0, 0] = np.nan
    Xi = Xq.copy()
    Xi[0, 0] = np.inf
    Xo = np.array([["a", 1.0, 2.0]] * 5, dtype=object)
    return {
        "nan": Xn,
        "inf": Xi,
        "n_features": Xq[:, :2],
        "sparse": sp.csr_matrix(Xq),
        "object": Xo,
        "1-D": Xq[0],
    }


def _methods(est):
    ms = {}
    for name in X_METHODS:
        if hasattr(est, name):
            ms[name] = getattr(est, name)
    for attr in ["path_kernel_", "tangent_kernel_"]:
        try:
            ms[attr] = getattr(est, attr)
        except AttributeError:
            pass
    return ms


def _estimators():
    return [
        PathKernelMachine(**SMALL).fit(X, y),
        PathKernelClassifier(**SMALL).fit(X, yc),
        TangentFeatures(estimator=PathKernelMachine(**SMALL)).fit(X, y),
        TangentFeatureSVM(estimator=PathKernelClassifier(**SMALL)).fit(X, yc),
        OODRankDetector(estimator=PathKernelMachine(**SMALL)).fit(X),
    ]


@check("bad X at every method: ValueError/TypeError naming the problem")
def _():
    bad = []
    for est in _estimators():
        for mname, m in _methods(est).items():
            for kind, XX in _bad_inputs().items():
                try:
                    m(XX)
                except (ValueError, TypeError) as exc:
                    msg = str(exc).lower()
                    keys = {
                        "nan": ["nan"],
                        "inf": ["inf"],
                        "n_features": ["feature"],
                        "sparse": ["sparse"],
                        "object": ["float", "string", "convert", "object"],
                        "1-D": ["2d", "2-d", "reshape", "dimension"],
                    }[kind]
                    if not any(k in msg for k in keys):
                        bad.append(
                            f"{type(est).__name__}.{mname}[{kind}]: unclear "
                            f"{type(exc).__name__}: {str(exc)[:100]}"
                        )
                except Exception as exc:
                    bad.append(
                        f"{type(est).__name__}.{mname}[{kind}]: "
                        f"{type(exc).__name__}: {str(exc)[:100]}"
                    )
                else:
                    bad.append(f"{type(est).__name__}.{mname}[{kind}]: no error")
    print("\n".join(bad))
    return not bad, f"{len(bad)} cases without a clear error: {bad[:6]}"


@check("unfitted: every method raises NotFittedError")
def _():
    bad = []
    for est in [
        PathKernelMachine(),
        PathKernelClassifier(),
        TangentFeatures(),
        TangentFeatureSVM(),
        OODRankDetector(),
    ]:
        for name in [*X_METHODS, "self_influence", "get_feature_names_out"]:
            if not hasattr(est, name):
                continue
            try:
                if name == "self_influence":
                    getattr(est, name)()
                elif name == "get_feature_names_out":
                    getattr(est, name)()
                else:
                    getattr(est, name)(Xq)
            except NotFittedError:
                continue
            except Exception as exc:
                bad.append(f"{type(est).__name__}.{name}: {type(exc).__name__}: {str(exc)[:80]}")
            else:
                bad.append(f"{type(est).__name__}.{name}: no error")
        for attr in ["path_kernel_", "tangent_kernel_"]:
            try:
                getattr(est, attr)
            except (NotFittedError, AttributeError):
                pass
    print("\n".join(bad))
    return not bad, f"{len(bad)}: {bad[:6]}"


def _snapshot(est):
    out = {}
    for name in ["predict", "transform", "score_samples"]:
        if hasattr(est, name):
            try:
                out[name] = np.asarray(getattr(est, name)(Xq), dtype=float)
            except Exception as exc:
                out[name] = repr(exc)
    out["keys"] = sorted(k for k in vars(est) if k.endswith("_"))
    return out


def _same(a, b):
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


@check("bad fit input: error, and the previous fit kept")
def _():
    # (X, y) of each bad fit; y None: the estimator's own targets, cut to X's rows
    cases = {
        "nan X": lambda: (_bad_inputs()["nan"], None),
        "sparse X": lambda: (sp.csr_matrix(X), None),
        "object X": lambda: (np.array([["a", 1.0, 2.0]] * 40, dtype=object), None),
        "1 sample": lambda: (X[:1], None),
        "nan y": lambda: (X, np.where(np.arange(40) == 0, np.nan, 1.0)),
        "wrong y length": lambda: (X, y[:30]),
    }
    bad, seen = [], []
    for est in _estimators():
        classifier = hasattr(est, "classes_")
        yy = None if isinstance(est, OODRankDetector) else (yc if classifier else y)
        before = _snapshot(est)
        local = dict(cases)
        if classifier:
            local["1 class"] = lambda: (X, np.zeros(40, int))
        for kind, make in local.items():
            XX, y2 = make()
            if y2 is None and yy is not None:
                y2 = yy[: XX.shape[0]]
            try:
                est.fit(XX, y2) if y2 is not None else est.fit(XX)
            except (ValueError, TypeError) as exc:
                seen.append(f"{type(est).__name__}[{kind}]: {str(exc)[:40]}")
            except Exception as exc:
                bad.append(f"{type(est).__name__}[{kind}]: {type(exc).__name__}: {str(exc)[:100]}")
            else:
                bad.append(f"{type(est).__name__}[{kind}]: no error")
            if not _same(before, _snapshot(est)):
                bad.append(f"{type(est).__name__}[{kind}]: previous fit changed")
    print("\n".join(seen))
    return not bad, f"{len(seen)} refused with the fit kept, {len(bad)} bad: {bad[:8]}"


@check("non-finite training loss: clear error naming the step and learning_rate_init; no NaN kept")
def _():
    est = PathKernelMachine(**SMALL).fit(X, y)
    before = est.predict(Xq)
    msgs = []
    for cls, yy in [(PathKernelMachine, y), (PathKernelClassifier, yc)]:
        e = cls(
            hidden_layer_sizes=(8,),
            solver="sgd",
            learning_rate_init=1e8,
            max_iter=20,
            tol=None,
            random_state=0,
        )
        try:
            e.fit(X, yy)
        except ValueError as exc:
            msgs.append(str(exc)[:200])
        else:
            msgs.append(f"no error, predictions finite: {np.isfinite(e.predict(Xq)).all()}")
    est.set_params(solver="sgd", learning_rate_init=1e8, tol=None, max_iter=20)
    try:
        est.fit(X, y)
    except ValueError:
        pass
    kept = np.array_equal(est.predict(Xq), before)
    ok = all("step" in m and "learning_rate_init" in m for m in msgs) and kept
    return ok, f"{msgs}; previous fit kept: {kept}"


@check("fitted estimator pickles and predicts the same")
def _():
    est = PathKernelMachine(**SMALL).fit(X, y)
    e2 = pickle.loads(pickle.dumps(est))
    return np.array_equal(e2.predict(Xq), est.predict(Xq)), "pickle round trip"


@check("kneighbors default n_neighbors=100 on fewer training points")
def _():
    reg = PathKernelMachine(**SMALL).fit(X, y)
    try:
        dist, ind = reg.kneighbors(Xq)
    except ValueError as exc:
        return True, f"ValueError: {str(exc)[:150]}"
    return True, f"returned {ind.shape} (clipped to the 40 training points)"


@check("verbose > 0 shows tqdm progress")
def _():

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        PathKernelMachine(verbose=1, **SMALL).fit(X, y)
    txt = buf.getvalue()
    return ("it/s" in txt or "%|" in txt or "epoch" in txt.lower()), repr(txt[-120:])


@check("hessian_trace: .trace, .stderr vs dense Hessian trace (float64), any recorded step")
def _():

    reg = PathKernelMachine(
        hidden_layer_sizes=(4,), max_iter=5, dtype="float64", normalize_y=False, random_state=0
    ).fit(X, y)
    m = copy.deepcopy(reg.module_)
    names = [n for n, _ in m.named_parameters()]
    shapes = [p.shape for p in m.parameters()]
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    out = []
    for step in [0, -1]:
        theta0 = reg.trajectory_.parameters(step).clone()

        def loss(theta):
            params, i = {}, 0
            for n, sh in zip(names, shapes):
                k = int(np.prod(sh))
                params[n] = theta[i : i + k].reshape(sh)
                i += k
            f = torch.func.functional_call(m, params, (Xt,)).reshape(-1)
            return 0.5 * ((f - yt) ** 2).mean()

        H = torch.autograd.functional.hessian(loss, theta0)
        ref = float(torch.trace(H))
        r = hessian_trace(reg, n_samples=4000, random_state=0, step=step)
        out.append((step, ref, float(r.trace), float(r.stderr)))
    ok = all(abs(t - ref) < 4 * se for _, ref, t, se in out)
    return ok, "; ".join(
        f"step {s}: dense {ref:.5f}, hutchinson {t:.5f} +- {se:.5f}" for s, ref, t, se in out
    )


@check("datasets deterministic with random_state; printed glyphs 8x8")
def _():

    out = []
    for name in ["make_circle", "make_ellipse", "make_sine", "make_square_wave"]:
        a = getattr(ds, name)(random_state=0)
        b = getattr(ds, name)(random_state=0)
        same = all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b))
        out.append((name, same))
    out.append(
        (
            "make_linear_extrapolation (no randomness)",
            all(
                np.array_equal(u, v)
                for u, v in zip(ds.make_linear_extrapolation(), ds.make_linear_extrapolation())
            ),
        )
    )
    d = ds.load_printed_digits()
    lt = ds.load_printed_letters()
    shape = (d.images.shape[1:], lt.images.shape[1:])
    ok = all(s for _, s in out) and shape == ((8, 8), (8, 8))
    return ok, f"{out}; images {shape}, digits {d.data.shape}, letters {lt.data.shape}"


@check("plotting Displays: from_estimator and plot(ax=None)")
def _():
    import matplotlib

    matplotlib.use("Agg")
    from skpathkernel import plotting as pl

    clf = PathKernelClassifier(**SMALL).fit(X, yc)
    ood = OODRankDetector(estimator=PathKernelMachine(**SMALL)).fit(X)
    out = []
    for name in [
        "KernelMatrixDisplay",
        "KernelNeighborsDisplay",
        "KernelEvolutionDisplay",
        "RankGapDisplay",
        "TangentEmbeddingDisplay",
    ]:
        cls = getattr(pl, name)
        has = hasattr(cls, "from_estimator") and hasattr(cls, "plot")
        out.append((name, has))

    sigs = {n: str(inspect.signature(getattr(pl, n).plot)) for n, _ in out}
    disp = pl.KernelMatrixDisplay.from_estimator(clf, X[:10])
    disp.plot()
    pl.RankGapDisplay.from_estimator(ood, X, Xq)
    return all(h for _, h in out) and all("ax=None" in v for v in sigs.values()), str(sigs)


@check("command line: skpathkernel info; python -m skpathkernel; reproduce options")
def _():

    r1 = subprocess.run(
        [sys.executable, "-m", "skpathkernel", "info"], capture_output=True, text=True, timeout=120
    )
    r2 = subprocess.run(
        [sys.executable, "-m", "skpathkernel", "reproduce", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    script = shutil.which("skpathkernel")
    ok = r1.returncode == 0 and all(o in r2.stdout for o in ["--out", "--quick", "--device"])
    return ok, f"info rc {r1.returncode}: {r1.stdout.splitlines()[:3]}; script {script}"


@check("TangentFeatures.transform vs estimator_.transform; TangentFeatureSVM.transform is phi")
def _():
    tf = TangentFeatures(estimator=PathKernelMachine(**SMALL)).fit(X, y)
    sv = TangentFeatureSVM(estimator=PathKernelClassifier(**SMALL)).fit(X, yc)
    return (
        np.array_equal(tf.transform(Xq), tf.estimator_.transform(Xq))
        and np.array_equal(sv.transform(Xq), sv.estimator_.transform(Xq))
    ), "equal"


@check("classifier: binary and multi-class, predict_proba and decision_function shapes")
def _():
    yb = (X[:, 0] > 0).astype(int)
    b = PathKernelClassifier(**SMALL).fit(X, yb)
    m = PathKernelClassifier(**SMALL).fit(X, yc)
    return True, (
        f"binary proba {b.predict_proba(Xq).shape}, decision {b.decision_function(Xq).shape}; "
        f"3-class proba {m.predict_proba(Xq).shape}, decision {m.decision_function(Xq).shape}"
    )


@check("bad X at kernels, hessian_trace; bad method options; out-of-range step")
def _():

    reg = PathKernelMachine(**SMALL).fit(X, y)
    calls = {
        "TangentKernel": TangentKernel(reg),
        "TangentKernel.diag": TangentKernel(reg).diag,
        "PathKernel": PathKernel(reg),
        "PathKernel.diag": PathKernel(reg).diag,
        "PathKernel(Xq, Y)": lambda A: PathKernel(reg)(Xq, A),
        "hessian_trace": lambda A: hessian_trace(reg, A, y[:5], n_samples=2),
    }
    bad, seen = [], []
    for name, f in calls.items():
        for kind, A in _bad_inputs().items():
            if kind == "1-D":
                continue
            try:
                f(A)
            except (ValueError, TypeError) as exc:
                seen.append(f"{name}[{kind}]")
                del exc
            except Exception as exc:
                bad.append(f"{name}[{kind}]: {type(exc).__name__}")
            else:
                bad.append(f"{name}[{kind}]: no error")
    other = {}
    for name, call in [
        ("decompose(method='bogus')", lambda: reg.decompose(Xq, method="bogus")),
        ("kneighbors(kernel='bogus')", lambda: reg.kneighbors(Xq, 5, kernel="bogus")),
        ("explain(n_neighbors=41)", lambda: reg.explain(Xq, 41)),
        ("kneighbors(step=99)", lambda: reg.kneighbors(Xq, 5, step=99)),
        ("TangentKernel(step=99)", lambda: TangentKernel(reg, step=99)(Xq)),
        ("TangentKernel(output=5)", lambda: TangentKernel(reg, output=5)(Xq)),
    ]:
        try:
            call()
        except Exception as exc:
            other[name] = f"{type(exc).__name__}: {str(exc)[:70]}"
        else:
            other[name] = "no error"
    return not bad, f"{len(seen)} clear errors, bad {bad}; {other}"


@check("OOD scores and rank_gap vs brute force on phi (float64)")
def _():
    reg = PathKernelMachine(
        hidden_layer_sizes=(4,),
        dtype="float64",
        **{k: v for k, v in SMALL.items() if k != "hidden_layer_sizes"},
    ).fit(X[:12], y[:12])
    Xtr = X[:12]
    P = reg.transform(Xtr)
    Q = reg.transform(Xq)
    out, ok = [], True
    # residual: relative residual of phi(x) outside span(phi(X_fit_)), as -s
    coef, *_ = np.linalg.lstsq(P.T, Q.T, rcond=None)
    resid = np.linalg.norm(Q.T - P.T @ coef, axis=0) / np.linalg.norm(Q, axis=1)
    d = OODRankDetector(estimator=FrozenEstimator(reg), method="residual").fit(Xtr)
    diff = np.abs(d.score_samples(Xq) + resid).max()
    ok &= diff < 1e-5
    out.append(f"residual vs lstsq {diff:.1e} (n_params {P.shape[1]}, N 12)")
    cos = (Q @ P.T) / np.outer(np.linalg.norm(Q, axis=1), np.linalg.norm(P, axis=1))
    d = OODRankDetector(estimator=FrozenEstimator(reg), method="alignment").fit(Xtr)
    diff = np.abs(d.score_samples(Xq) - cos.max(1)).max()
    ok &= diff < 1e-8
    out.append(f"alignment vs max cosine {diff:.1e}")
    sv_t = np.linalg.svd(P, compute_uv=False)
    sv_j = np.linalg.svd(np.vstack([P, Q]), compute_uv=False)
    tau = 1e-6 * sv_t[0]
    ref = (int((sv_t > tau).sum()), int((sv_j > tau).sum()))
    got = d.rank_gap(Xq)
    ok &= tuple(got) == ref
    out.append(f"rank_gap {got} vs SVD {ref}")
    return ok, "; ".join(out)


@check("kneighbors(kernel='path', step=k, normalized=False) vs brute force")
def _():
    reg = PathKernelMachine(solver="sgd", dtype="float64", **SMALL).fit(X, y)
    out, ok = [], True
    for kernel, step, norm in [("path", -1, True), ("path", -1, False), ("tangent", 0, False)]:
        dist, ind = reg.kneighbors(Xq, n_neighbors=5, kernel=kernel, step=step, normalized=norm)
        if kernel == "path":
            k = PathKernel(reg)
        else:
            k = TangentKernel(reg, step=step)
        K, kq, kx = k(Xq, X), k.diag(Xq), k.diag(X)
        # normalized: largest cosine; raw: smallest feature-space distance (docstring)
        score = K / np.sqrt(np.outer(kq, kx)) if norm else -(kq[:, None] + kx - 2 * K)
        ref = np.argsort(-score, axis=1, kind="stable")[:, :5]
        same = np.array_equal(np.sort(ind, 1), np.sort(ref, 1))
        ok &= same
        out.append(f"{kernel} step {step} normalized {norm}: {same}")
    try:
        reg.kneighbors(Xq, n_neighbors=5, kernel="path", step=3)
        out.append("path with step=3: no error")
    except ValueError as exc:
        out.append(f"path with step=3: ValueError ({str(exc)[:60]})")
    return ok, "; ".join(out)


@check("sklearn roles: Transformer / Classifier / Outlier / Regressor mixins and tags")
def _():
    ok = (
        issubclass(TangentFeatures, TransformerMixin)
        and issubclass(TangentFeatureSVM, ClassifierMixin)
        and issubclass(OODRankDetector, OutlierMixin)
        and issubclass(PathKernelMachine, RegressorMixin)
        and issubclass(PathKernelClassifier, ClassifierMixin)
        and is_regressor(PathKernelMachine())
        and is_classifier(PathKernelClassifier())
        and is_classifier(TangentFeatureSVM())
        and is_outlier_detector(OODRankDetector())
    )
    return ok, "all five"


@check("losses: 1/2 mean squared error over all entries; log_loss mean cross-entropy")
def _():
    kw = dict(
        hidden_layer_sizes=(8,),
        max_iter=3,
        random_state=0,
        batch_size=None,
        solver="sgd",
        dtype="float64",
        tol=None,
    )

    def f0(est):
        m = copy.deepcopy(est.module_)
        m.load_state_dict(est.trajectory_.state_dict(0))
        return m(torch.as_tensor(X)).detach().numpy().reshape(len(X), -1)

    out = []
    Y = np.c_[3 * y + 5, X[:, 1]]
    r = PathKernelMachine(**kw).fit(X, Y)
    Ys = (Y - Y.mean(0)) / Y.std(0)  # normalize_y=True trains on standardized targets
    out.append((r.loss_curve_[0], 0.5 * np.mean((f0(r) - Ys) ** 2)))
    c = PathKernelClassifier(**kw).fit(X, yc)
    F = f0(c)
    F = F - F.max(1, keepdims=True)
    lp = F - np.log(np.exp(F).sum(1, keepdims=True))
    out.append((c.loss_curve_[0], -lp[np.arange(len(X)), yc].mean()))
    ok = all(abs(a - b) < 1e-12 for a, b in out)
    return ok, (
        f"full-batch epoch-1 loss vs formula at theta_0: regressor (2 outputs) "
        f"{out[0][0]:.6f} / {out[0][1]:.6f}, classifier {out[1][0]:.6f} / {out[1][1]:.6f}"
    )


if __name__ == "__main__":
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    n_bad = sum(not ok for _, ok, _ in RESULTS)
    print(f"\n{len(RESULTS)} checks, {n_bad} differences")
