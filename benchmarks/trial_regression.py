"""User trial s53: a regression / Gaussian-process user (see
benchmarks/results/user_trial_regression-s53.md).

Run from the repository root: ``PYTHONPATH=. python benchmarks/trial_regression.py``.
One line per probe: ``OK``, ``BAD`` (a finding) or ``NOTE`` (a behaviour judged right,
with the reason); measured errors are printed on the probe's line; the last line counts
them. Every reference is computed here, independently of the package: a float64 dense
Jacobian by ``torch.func.jacrev`` for the kernels, a closed-form NumPy GP and kernel
ridge on the same Gram.
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from collections import Counter

import numpy as np
import pandas as pd
import torch
from sklearn.base import clone
from sklearn.compose import TransformedTargetRegressor
from sklearn.exceptions import DataConversionWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import Ridge
from sklearn.metrics import mean_squared_error, r2_score
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.multioutput import MultiOutputRegressor
from sklearn.neural_network import MLPRegressor
from sklearn.svm import SVR

from skpathkernel import PathKernelMachine, TangentFeatures
from skpathkernel.kernels import PathKernel, TangentKernel, path_weights

torch.set_num_threads(1)
COUNTS: Counter = Counter()


def report(kind, what, detail=""):
    COUNTS[kind] += 1
    print(f"{kind:4s} {what}" + (f": {detail}" if detail else ""), flush=True)


def check(ok, what, detail=""):
    report("OK" if ok else "BAD", what, detail)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def raises(fn, *types):
    try:
        fn()
    except types as exc:
        return exc
    return None


# --------------------------------------------------------------------------- data
rng = np.random.RandomState(0)
N, D = 40, 3
X = rng.uniform(-2, 2, size=(N, D))
y = np.sin(X[:, 0]) + 0.5 * X[:, 1] + 0.1 * rng.randn(N)
Y2 = np.c_[y, np.cos(X[:, 2]) + 0.1 * rng.randn(N)]
Xq = rng.uniform(-2, 2, size=(7, D))


def machine(**kw):
    params = dict(hidden_layer_sizes=(16,), activation="tanh", solver="adam",
                  learning_rate_init=0.01, max_iter=25, tol=None, batch_size=20,
                  dtype="float64", random_state=0)
    params.update(kw)
    return PathKernelMachine(**params)


# --------------------------------------------------------------------------- references
def dense_jacobian(est, X, k=-1):
    """float64 J (n, C, P) at point k of the path: torch.func.jacrev over the flat
    parameter vector (the kernel's value does not depend on its order), the module
    copied and run in float64, its buffers and frozen parameters as they are."""
    traj = est.trajectory_
    mod64 = copy.deepcopy(est.module_).to(torch.float64).eval()
    fixed = {n: t.detach() for n, t in [*mod64.named_parameters(), *mod64.named_buffers()]
             if n not in traj.names}
    flat = traj.parameters(k).detach().to(torch.float64).clone()
    x = torch.as_tensor(np.asarray(X, np.float64))

    def f(theta):
        params = dict(traj.unflatten(theta))
        out = torch.func.functional_call(mod64, {**params, **fixed}, (x,))
        return out.reshape(len(x), -1)

    return torch.func.jacrev(f)(flat).numpy()  # (n, C, P)


def ref_tangent(est, A, B, k=-1):
    JA, JB = dense_jacobian(est, A, k), dense_jacobian(est, B, k)
    C = JA.shape[1]
    return np.einsum("icp,jcp->ij", JA, JB) / C


def ref_path(est, A, B):
    traj = est.trajectory_
    K = 0.0
    for k, w in path_weights(traj):
        JA, JB = dense_jacobian(est, A, k), dense_jacobian(est, B, k)
        Dk = traj.preconditioner(k)
        Dk = np.ones(JA.shape[2]) if Dk is None else Dk.to(torch.float64).numpy()
        K = K + w * np.einsum("icp,p,jcp->ij", JA, Dk, JB) / JA.shape[1]
    return K


def closed_form_gp(K, Ks, Kss, y, alpha):
    """Posterior mean / cov of a zero-mean GP (normalize_y=False), by np.linalg.solve."""
    A = K + alpha * np.eye(len(K))
    mean = Ks @ np.linalg.solve(A, y)
    cov = Kss - Ks @ np.linalg.solve(A, Ks.T)
    sign, logdet = np.linalg.slogdet(A)
    lml = -0.5 * y @ np.linalg.solve(A, y) - 0.5 * logdet - 0.5 * len(y) * np.log(2 * np.pi)
    return mean, cov, lml


# --------------------------------------------------------------------------- A. regressor
def trial_regressor():
    est = machine().fit(X, y)
    p = est.predict(X)
    check(p.shape == (N,) and p.dtype == np.float64, "predict (n,) float64 for y (n,)",
          f"{p.shape} {p.dtype}")
    check(abs(est.score(X, y) - r2_score(y, p)) < 1e-12, "score = r2_score")
    sw = rng.uniform(0.5, 2, N)
    check(abs(est.score(X, y, sample_weight=sw) - r2_score(y, p, sample_weight=sw)) < 1e-12,
          "score(sample_weight) = r2_score(sample_weight)")

    # y of shape (n, 1): as MLPRegressor (a DataConversionWarning, 1-D predictions)
    shapes = {}
    for e in (MLPRegressor(hidden_layer_sizes=(4,), max_iter=5, random_state=0), Ridge(),
              KernelRidge(), machine()):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            e.fit(X, y[:, None])
        warned = any(issubclass(x.category, DataConversionWarning) for x in w)
        shapes[type(e).__name__] = (e.predict(X).shape, warned)
    report("NOTE", "y (n, 1) in scikit-learn", str(shapes))
    col = machine()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        col.fit(X, y[:, None])
    warned = any(issubclass(x.category, DataConversionWarning) for x in w)
    pc = col.predict(X)
    check(pc.shape == (N,) and warned, "y (n, 1): predict (n,) with a DataConversionWarning "
          "(MLPRegressor's)", f"{pc.shape}, warned={warned}")
    check(np.array_equal(pc.ravel(), p), "y (n, 1) fits the network of y (n,), bitwise")
    check(col.n_outputs_ == 1, "y (n, 1): n_outputs_ 1")

    # float32 network: predict dtype
    e32 = machine(dtype="float32").fit(X, y)
    p32 = e32.predict(X)
    report("NOTE" if p32.dtype == np.float64 else "BAD", "float32 network predicts",
           str(p32.dtype) + " (MLPRegressor predicts float64 on float64 X)")
    pXf = est.predict(X.astype(np.float32))
    check(pXf.dtype == np.float64, "float64 network on float32 X predicts float64",
          str(pXf.dtype))

    # multi-output
    mo = machine().fit(X, Y2)
    pm = mo.predict(X)
    check(pm.shape == (N, 2), "multi-output predict (n, 2)", str(pm.shape))
    check(abs(mo.score(X, Y2) - r2_score(Y2, pm)) < 1e-12,
          "multi-output score = r2_score (uniform_average)")

    # sample_weight: integer weights = repetition (full batch)
    fb = dict(batch_size=N, solver="sgd", learning_rate_init=0.05, shuffle=False)
    w = rng.randint(0, 3, N)
    w[0] = 2
    a = machine(**fb).fit(X, y, sample_weight=w)
    rep = np.repeat(np.arange(N), w)
    b = machine(**{**fb, "batch_size": len(rep)}).fit(X[rep], y[rep])
    err = rel(a.predict(Xq), b.predict(Xq))
    check(err < 1e-10, "integer sample_weight = repeated rows (full-batch SGD)",
          f"rel. error {err:.1e}")

    # TransformedTargetRegressor
    ttr = TransformedTargetRegressor(regressor=machine(), func=np.log1p,
                                     inverse_func=np.expm1).fit(X, np.abs(y))
    pt = ttr.predict(X)
    ref = np.expm1(machine().fit(X, np.log1p(np.abs(y))).predict(X))
    check(pt.shape == (N,) and rel(pt, ref) < 1e-12,
          "TransformedTargetRegressor = fit on func(y), inverse_func of predict",
          f"{pt.shape}, rel {rel(pt, ref):.1e}")
    with warnings.catch_warnings(record=True) as wr:
        warnings.simplefilter("always")
        ttr2 = TransformedTargetRegressor(regressor=machine(), func=np.log1p,
                                          inverse_func=np.expm1,
                                          check_inverse=True).fit(X, np.abs(y))
    dcw = [x for x in wr if issubclass(x.category, DataConversionWarning)]
    check(not dcw and ttr2.predict(X).shape == (N,),
          "TransformedTargetRegressor (which fits the regressor on a (n, 1) y "
          "internally when 1-D) warns nothing, predicts (n,)",
          f"{len(dcw)} DataConversionWarning(s)")
    ttr3 = TransformedTargetRegressor(regressor=machine()).fit(X, y)
    check(np.array_equal(ttr3.predict(X), p), "TTR identity = bare regressor, bitwise")

    # MultiOutputRegressor
    mor = MultiOutputRegressor(machine()).fit(X, Y2)
    ref = np.c_[machine().fit(X, Y2[:, 0]).predict(X), machine().fit(X, Y2[:, 1]).predict(X)]
    check(np.array_equal(mor.predict(X), ref), "MultiOutputRegressor = one fit per column")
    mor_w = MultiOutputRegressor(machine()).fit(X, Y2, sample_weight=sw)
    ref_w = machine().fit(X, Y2[:, 0], sample_weight=sw).predict(X)
    check(np.array_equal(mor_w.predict(X)[:, 0], ref_w), "MultiOutputRegressor sample_weight")

    # cross_val_score with regression scorers
    cv = KFold(4, shuffle=True, random_state=0)
    for scoring, metric in (("neg_mean_squared_error",
                             lambda t, q: -mean_squared_error(t, q)),
                            ("r2", r2_score)):
        s = cross_val_score(machine(), X, y, cv=cv, scoring=scoring)
        manual = [metric(y[te], machine().fit(X[tr], y[tr]).predict(X[te]))
                  for tr, te in cv.split(X)]
        check(np.allclose(s, manual, rtol=0, atol=1e-12), f"cross_val_score {scoring}",
              np.array2string(s, precision=3))
    s = cross_val_score(machine(), X, Y2, cv=cv, scoring="neg_mean_absolute_error")
    check(s.shape == (4,) and np.all(s < 0), "cross_val_score multi-output MAE")

    # GridSearchCV over kernel params (KernelRidge on the fitted network's kernels)
    from sklearn.frozen import FrozenEstimator
    gs = GridSearchCV(KernelRidge(kernel=PathKernel(est)),
                      {"kernel__normalized": [False, True], "alpha": [1e-3, 1e-1]},
                      cv=3).fit(X, y)
    manual = {}
    for norm in (False, True):
        for al in (1e-3, 1e-1):
            sc = []
            for tr, te in KFold(3).split(X):
                kr = KernelRidge(kernel=PathKernel(est, normalized=norm), alpha=al)
                sc.append(kr.fit(X[tr], y[tr]).score(X[te], y[te]))
            manual[(norm, al)] = np.mean(sc)
    best = max(manual, key=manual.get)
    got = (gs.best_params_["kernel__normalized"], gs.best_params_["alpha"])
    check(got == best and abs(gs.best_score_ - manual[best]) < 1e-10,
          "GridSearchCV over kernel__normalized x alpha = manual loop", f"{got}")
    gs2 = GridSearchCV(KernelRidge(kernel=TangentKernel(est)),
                       {"kernel__estimator": [FrozenEstimator(est), FrozenEstimator(mo)],
                        "kernel__step": [0, -1]}, cv=3, error_score="raise").fit(X, y)
    check(np.isfinite(gs2.best_score_), "GridSearchCV over kernel__estimator (frozen) x step")
    check(pickle.loads(pickle.dumps(est)).predict(Xq).tolist() == est.predict(Xq).tolist(),
          "pickle round trip")


# --------------------------------------------------------------------------- B. kernels
def trial_kernels():
    est = machine().fit(X, y)
    mo = machine().fit(X, Y2)
    sgd = machine(solver="sgd", momentum=0.9, learning_rate_init=0.02).fit(X, y)
    for name, kern, ref in (
            ("TangentKernel", TangentKernel(est), lambda A, B: ref_tangent(est, A, B)),
            ("TangentKernel step=0", TangentKernel(est, step=0),
             lambda A, B: ref_tangent(est, A, B, 0)),
            ("TangentKernel multi-output trace", TangentKernel(mo),
             lambda A, B: ref_tangent(mo, A, B)),
            ("PathKernel (Adam)", PathKernel(est), lambda A, B: ref_path(est, A, B)),
            ("PathKernel (SGD, Nesterov momentum)", PathKernel(sgd),
             lambda A, B: ref_path(sgd, A, B))):
        K, Kr = kern(X), ref(X, X)
        e1 = rel(K, Kr)
        Kq, Kqr = kern(Xq, X), ref(Xq, X)
        e2 = rel(Kq, Kqr)
        check(max(e1, e2) < 1e-10, f"{name} = float64 dense-Jacobian J J^T",
              f"K(X) rel {e1:.1e}, K(Xq, X) rel {e2:.1e}")
        e3 = rel(kern.diag(Xq), np.diag(kern(Xq)))
        check(e3 < 1e-12, f"{name}.diag(X) = np.diag(K(X))", f"rel {e3:.1e}")
        check(np.array_equal(K, K.T), f"{name} K(X) exactly symmetric")
    e32 = machine(dtype="float32").fit(X, y)
    K32 = TangentKernel(e32)(X)
    Kr = ref_tangent(e32, X, X)
    report("NOTE", "float32 network's TangentKernel vs float64 dense J J^T at the same "
           "(float32) parameters", f"rel {rel(K32, Kr):.1e} (float32 round-off)")
    check(TangentKernel(est)(X.astype(np.float32)).dtype == np.float64,
          "K of float32 X on a float64 network is float64")
    e = rel(TangentKernel(est)(X.astype(np.float32)),
            TangentKernel(est)(X.astype(np.float32).astype(np.float64)))
    check(e == 0, "K(float32 X) = K(X cast to float64)", f"rel {e:.1e}")

    # sklearn kernel API
    k = TangentKernel(est)
    fixed = RBF(length_scale_bounds="fixed")  # scikit-learn's kernel with nothing to tune
    check(k.theta.shape == fixed.theta.shape == (0,) and k.bounds.shape == fixed.bounds.shape
          and k.n_dims == 0 and k.hyperparameters == [],
          "theta, bounds, n_dims, hyperparameters as a fixed RBF's",
          f"theta {k.theta.shape}, bounds {k.bounds.shape} (RBF fixed: {fixed.bounds.shape})")
    check(k.is_stationary() is False and k.requires_vector_input is True,
          "is_stationary False, requires_vector_input True")
    Kg, G = k(X, eval_gradient=True)
    check(G.shape == (N, N, 0) and np.array_equal(Kg, k(X)), "eval_gradient: (K, (n, n, 0))")
    exc = raises(lambda: k(X, Xq, eval_gradient=True), ValueError)
    check(exc is not None, "eval_gradient with Y: ValueError, as sklearn's kernels")
    c = clone(k)
    check(c.estimator is est and c.get_params() == k.get_params(), "clone keeps the estimator")
    comp = ConstantKernel(2.0) * k + WhiteKernel(0.1)
    check(comp.theta.shape == (2,) and comp.n_dims == 2, "composition theta: 2 (constant, noise)",
          str(comp.hyperparameters))
    Kc, Gc = comp(X, eval_gradient=True)
    e = rel(Kc, 2.0 * ref_tangent(est, X, X) + 0.1 * np.eye(N))
    check(e < 1e-10, "C * K + White = closed form", f"rel {e:.1e}")
    # gradient wrt log(constant) = 2 K, wrt log(noise) = 0.1 I: finite differences
    eps = 1e-6
    th = comp.theta.copy()
    fd = []
    for i in range(2):
        tp, tm = th.copy(), th.copy()
        tp[i] += eps
        tm[i] -= eps
        fd.append((comp.clone_with_theta(tp)(X) - comp.clone_with_theta(tm)(X)) / (2 * eps))
    e = rel(Gc, np.stack(fd, axis=-1))
    check(e < 1e-6, "composition K_gradient = central finite differences", f"rel {e:.1e}")
    ckp = comp.get_params()
    check("k1__k2" in ckp and ckp["k1__k2"] is k, "get_params of a composition reaches the kernel")
    c2 = clone(comp)
    check(np.array_equal(c2(X), comp(X)), "clone of a composition: the same Gram")
    check(pickle.loads(pickle.dumps(k))(Xq, X).tolist() == k(Xq, X).tolist(),
          "pickle of the kernel")
    report("NOTE", "repr", repr(comp))

    # pandas: a network fitted on named columns
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    ed = machine().fit(df, y)
    kd = TangentKernel(ed)
    check(np.array_equal(kd(df), kd(X)), "K(DataFrame) = K(array)")
    exc = raises(lambda: kd(df[["c", "b", "a"]]), ValueError)
    check(exc is not None and "feature names" in str(exc), "reordered columns refused",
          str(exc)[:80] if exc else "silently")
    gpr = GaussianProcessRegressor(kernel=kd + WhiteKernel(), normalize_y=True).fit(df, y)
    check(np.allclose(gpr.predict(df[:5]), gpr.predict(X[:5]), rtol=0, atol=1e-12),
          "GaussianProcessRegressor on a DataFrame")
    exc = raises(lambda: gpr.predict(df[["c", "b", "a"]][:5]), ValueError)
    report("NOTE" if exc is None else "OK",
           "GaussianProcessRegressor.predict(reordered DataFrame)",
           "refused" if exc else "GPR validates to NumPy before the kernel sees names "
           "(scikit-learn's GPR, as with RBF: GPR keeps no feature_names_in_ check)")
    # meta-estimator: a kernel over TangentFeatures' estimator_
    tf = TangentFeatures(machine()).fit(df, y)
    exc_meta = raises(lambda: TangentKernel(tf)(df[["c", "b", "a"]]), ValueError)
    check(exc_meta is not None, "kernel over the meta-estimator refuses reordered columns")
    exc_in = raises(lambda: TangentKernel(tf.estimator_)(df[["c", "b", "a"]]), ValueError)
    check(exc_in is not None, "kernel over the meta-estimator's estimator_ refuses reordered "
          "columns (as MultiOutputRegressor's estimators_ know the names)",
          "refused" if exc_in else "silently taken by position (estimator_ was fitted on "
          "the validated array, without names)")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tf.estimator_.predict(df[:3])
    names_warn = [x for x in w if "feature names" in str(x.message)]
    check(not names_warn, "estimator_.predict(the fit's DataFrame) warns nothing",
          str(names_warn[0].message)[:90] if names_warn else "")


# --------------------------------------------------------------------------- C. GP / KRR / SVR
def trial_gp():
    est = machine().fit(X, y)
    Kxx, Kqx, Kqq = (ref_tangent(est, X, X), ref_tangent(est, Xq, X),
                     ref_tangent(est, Xq, Xq))
    alpha = 1e-2
    gpr = GaussianProcessRegressor(kernel=TangentKernel(est), alpha=alpha,
                                   optimizer=None).fit(X, y)
    mean, std = gpr.predict(Xq, return_std=True)
    _, cov = gpr.predict(Xq, return_cov=True)
    m_ref, c_ref, lml_ref = closed_form_gp(Kxx, Kqx, Kqq, y, alpha)
    em, ec = rel(mean, m_ref), rel(cov, c_ref)
    es = rel(std, np.sqrt(np.clip(np.diag(c_ref), 0, None)))
    check(max(em, es, ec) < 1e-8, "GPR(optimizer=None) mean / std / cov = closed form",
          f"mean {em:.1e}, std {es:.1e}, cov {ec:.1e}")
    el = abs(gpr.log_marginal_likelihood_value_ - lml_ref) / abs(lml_ref)
    check(el < 1e-10, "log_marginal_likelihood_value_ = closed form", f"rel {el:.1e}")
    check(gpr.log_marginal_likelihood().shape == () if hasattr(
        gpr.log_marginal_likelihood(), "shape") else True,
          "log_marginal_likelihood() with the empty theta")
    lml, grad = gpr.log_marginal_likelihood(gpr.kernel_.theta, eval_gradient=True)
    check(grad.shape == (0,) and abs(lml - lml_ref) / abs(lml_ref) < 1e-10,
          "log_marginal_likelihood(theta, eval_gradient=True): (lml, (0,))")
    s = gpr.sample_y(Xq, n_samples=4000, random_state=0)
    e = np.max(np.abs(s.mean(1) - m_ref)) / np.sqrt(np.max(np.diag(c_ref)))
    check(s.shape == (7, 4000) and e < 0.1, "sample_y: shape and mean", f"|mean err|/sd {e:.3f}")
    # default optimizer: nothing to optimize on the bare kernel
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        gd = GaussianProcessRegressor(kernel=TangentKernel(est), alpha=alpha).fit(X, y)
    check(np.array_equal(gd.predict(Xq), gpr.predict(Xq)),
          "default optimizer on the bare kernel = optimizer=None",
          f"{len(w)} warning(s)")
    # C * K + White, default optimizer with restarts
    kern = ConstantKernel(1.0, (1e-3, 1e3)) * TangentKernel(est) + WhiteKernel(1e-1, (1e-5, 1e1))
    g = GaussianProcessRegressor(kernel=kern, n_restarts_optimizer=2, random_state=0).fit(X, y)
    c, nl = g.kernel_.k1.k1.constant_value, g.kernel_.k2.noise_level
    m_ref, c_ref, lml_ref = closed_form_gp(c * Kxx, c * Kqx, c * Kqq + nl * 0, y, nl + 1e-10)
    mean, std = g.predict(Xq, return_std=True)
    # predictive std of GPR with WhiteKernel includes the noise (kernel_.diag adds it)
    std_ref = np.sqrt(np.diag(c_ref) + nl)
    check(max(rel(mean, m_ref), rel(std, std_ref)) < 1e-7,
          "C * K + White, optimised: mean / std = closed form at the optimum",
          f"c {c:.3g}, noise {nl:.3g}, mean {rel(mean, m_ref):.1e}, std {rel(std, std_ref):.1e}")
    # the optimum is a stationary point of the closed-form lml in (log c, log noise)
    def lml_at(lc, ln):
        return closed_form_gp(np.exp(lc) * Kxx, Kqx, Kqq, y, np.exp(ln) + 1e-10)[2]
    lc, ln = np.log(c), np.log(nl)
    h = 1e-4
    gr = [(lml_at(lc + h, ln) - lml_at(lc - h, ln)) / (2 * h),
          (lml_at(lc, ln + h) - lml_at(lc, ln - h)) / (2 * h)]
    check(max(map(abs, gr)) < 1e-2, "optimised theta is a stationary point of the closed-form "
          "log marginal likelihood", f"d lml / d log theta = {np.round(gr, 5).tolist()}")
    e = abs(g.log_marginal_likelihood_value_ - lml_at(lc, ln)) / abs(lml_at(lc, ln))
    check(e < 1e-9, "log_marginal_likelihood_value_ at the optimum = closed form", f"{e:.1e}")
    check(g.kernel_.theta.shape == (2,) and np.allclose(np.exp(g.kernel_.theta), [c, nl]),
          "kernel_.theta = log(constant, noise)")
    # normalize_y with PathKernel
    gp2 = GaussianProcessRegressor(kernel=ConstantKernel() * PathKernel(est) + WhiteKernel(),
                                   normalize_y=True).fit(X, y)
    check(np.isfinite(gp2.log_marginal_likelihood_value_), "PathKernel GP, normalize_y",
          repr(gp2.kernel_))
    # multi-output GP
    mo_gp = GaussianProcessRegressor(kernel=TangentKernel(est), alpha=alpha,
                                     optimizer=None).fit(X, Y2)
    mm, ms = mo_gp.predict(Xq, return_std=True)
    ref = np.c_[closed_form_gp(Kxx, Kqx, Kqq, Y2[:, 0], alpha)[0],
                closed_form_gp(Kxx, Kqx, Kqq, Y2[:, 1], alpha)[0]]
    check(mm.shape == (7, 2) and ms.shape == (7, 2) and rel(mm, ref) < 1e-8,
          "multi-output y in GPR: (n, 2) mean and std", f"rel {rel(mm, ref):.1e}")
    # a GP on a column y (n, 1)
    m1 = GaussianProcessRegressor(kernel=TangentKernel(est), alpha=alpha,
                                  optimizer=None).fit(X, y[:, None]).predict(Xq)
    report("NOTE", "GPR on y (n, 1) predicts", f"{m1.shape} (scikit-learn's own)")

    # KernelRidge: closed form
    for name, kern, Kr, Kqr in (("TangentKernel", TangentKernel(est), Kxx, Kqx),
                                ("PathKernel", PathKernel(est), ref_path(est, X, X),
                                 ref_path(est, Xq, X))):
        kr = KernelRidge(kernel=kern, alpha=0.1).fit(X, y)
        ref = Kqr @ np.linalg.solve(Kr + 0.1 * np.eye(N), y)
        e = rel(kr.predict(Xq), ref)
        check(e < 1e-8, f"KernelRidge({name}) = closed form", f"rel {e:.1e}")
        krm = KernelRidge(kernel=kern, alpha=0.1).fit(X, Y2)
        ref = Kqr @ np.linalg.solve(Kr + 0.1 * np.eye(N), Y2)
        check(rel(krm.predict(Xq), ref) < 1e-8, f"KernelRidge({name}) multi-output")
        kr32 = KernelRidge(kernel=kern, alpha=0.1).fit(X.astype(np.float32), y)
        report("NOTE", f"KernelRidge({name}) on float32 X", "max |diff| vs float64 X "
               f"{np.max(np.abs(kr32.predict(Xq.astype(np.float32)) - kr.predict(Xq))):.1e}")
        # SVR with the kernel as a callable and precomputed: same predictions
        sv = SVR(kernel=kern, C=10.0, epsilon=0.01).fit(X, y)
        sp = SVR(kernel="precomputed", C=10.0, epsilon=0.01).fit(Kr, y)
        e = rel(sv.predict(Xq), sp.predict(Kqr))
        check(e < 1e-6, f"SVR(kernel={name}) = SVR(precomputed dense-Jacobian Gram)",
              f"rel {e:.1e}")
        sw = rng.uniform(0.5, 2, N)
        a = KernelRidge(kernel=kern, alpha=0.1).fit(X, y, sample_weight=sw).predict(Xq)
        W = np.sqrt(sw)
        ref = Kqr @ (W * np.linalg.solve(W[:, None] * Kr * W + 0.1 * np.eye(N), W * y))
        check(rel(a, ref) < 1e-8, f"KernelRidge({name}, sample_weight) = closed form",
              f"rel {rel(a, ref):.1e}")
    # GridSearchCV over GPR kernel's inner parameters
    gs = GridSearchCV(GaussianProcessRegressor(kernel=TangentKernel(est) + WhiteKernel()),
                      {"kernel__k1__step": [0, -1]}, cv=3).fit(X, y)
    check(gs.best_params_["kernel__k1__step"] in (0, -1), "GridSearchCV over kernel__k1__step",
          str(gs.best_params_))


# --------------------------------------------------------------------------- D. more
def trial_more():
    from sklearn.gaussian_process.kernels import Exponentiation
    from sklearn.model_selection import cross_val_predict

    est = machine().fit(X, y)
    mo = machine().fit(X, Y2)
    JX, JQ = dense_jacobian(mo, X), dense_jacobian(mo, Xq)
    for c in (0, 1):
        e = rel(TangentKernel(mo, output=c)(Xq, X), JQ[:, c] @ JX[:, c].T)
        check(e < 1e-10, f"TangentKernel(output={c}) = J_c J_c^T", f"rel {e:.1e}")
    Kr = ref_tangent(est, X, X)
    Kqr = ref_tangent(est, Xq, X)
    dq = np.diag(ref_tangent(est, Xq, Xq))
    e = rel(TangentKernel(est, normalized=True)(Xq, X),
            Kqr / np.sqrt(np.outer(dq, np.diag(Kr))))
    check(e < 1e-10, "normalized=True = K / sqrt(k(x,x) k(x',x'))", f"rel {e:.1e}")
    check(np.array_equal(TangentKernel(est, normalized=True).diag(Xq), np.ones(len(Xq))),
          "normalized diag = 1")
    e = rel(TangentKernel(est, n_jobs=2)(X), TangentKernel(est)(X))
    check(e < 1e-12, "n_jobs=2 = serial", f"rel {e:.1e}")
    k = TangentKernel(est)
    e = rel((k + 1.0)(Xq, X), Kqr + 1.0)
    check(e < 1e-10, "K + 1.0 (a ConstantKernel)", f"rel {e:.1e}")
    e = rel(Exponentiation(k, 2.0)(Xq, X), Kqr ** 2)
    check(e < 1e-10, "K ** 2 (Exponentiation)", f"rel {e:.1e}")
    e = rel((k * k).diag(Xq), dq ** 2)
    check(e < 1e-10, "(K * K).diag", f"rel {e:.1e}")
    exc = raises(lambda: GaussianProcessRegressor(
        kernel=TangentKernel(mo, output="full")).fit(X, y), ValueError)
    check(exc is not None and "full_to_matrix" in str(exc),
          "output='full' in GPR refused naming full_to_matrix", str(exc)[:90] if exc else "")
    # The GP's memo of the Gram follows a network that trains further.
    w = machine(warm_start=True).fit(X, y)
    g = GaussianProcessRegressor(kernel=ConstantKernel() * TangentKernel(w) + WhiteKernel())
    g.fit(X, y)
    before = g.kernel.k1.k2(X)
    w.partial_fit(X, y)
    after = g.kernel.k1.k2(X, eval_gradient=True)[0]
    e = rel(after, ref_tangent(w, X, X))
    check(not np.array_equal(before, after) and e < 1e-10,
          "the kernel's Gram memo follows partial_fit (a GP refitted sees the new network)",
          f"rel {e:.1e}")
    # Searches in parallel (loky pickles the kernel with its fitted estimator).
    grid = {"alpha": [1e-2, 1e-1], "kernel__normalized": [False, True]}
    g1 = GridSearchCV(KernelRidge(kernel=PathKernel(est)), grid, cv=3).fit(X, y)
    g2 = GridSearchCV(KernelRidge(kernel=PathKernel(est)), grid, cv=3, n_jobs=2).fit(X, y)
    e = np.max(np.abs(g1.cv_results_["mean_test_score"] - g2.cv_results_["mean_test_score"]))
    check(e < 1e-12, "GridSearchCV(n_jobs=2) = n_jobs=1", f"max |diff| {e:.1e}")
    cvp = cross_val_predict(machine(), X, Y2, cv=KFold(4))
    ref = np.zeros_like(Y2)
    for tr, te in KFold(4).split(X):
        ref[te] = machine().fit(X[tr], Y2[tr]).predict(X[te])
    check(np.array_equal(cvp, ref), "cross_val_predict multi-output = manual loop")
    # A GP on the network's tangent kernel vs KernelRidge: the same mean for alpha equal.
    gp = GaussianProcessRegressor(kernel=k, alpha=0.1, optimizer=None).fit(X, y)
    kr = KernelRidge(kernel=k, alpha=0.1).fit(X, y)
    e = rel(gp.predict(Xq), kr.predict(Xq))
    check(e < 1e-10, "GP mean = KernelRidge prediction (same alpha)", f"rel {e:.1e}")
    wrappers = {
        "regressor_": TransformedTargetRegressor(regressor=machine()).fit(X, y),
        "estimators_[i]": MultiOutputRegressor(machine()).fit(X, Y2),
        "best_estimator_": GridSearchCV(machine(), {"alpha": [1e-4]}, cv=2).fit(X, y),
    }
    for where, wrapper in wrappers.items():
        exc = raises(lambda w=wrapper: TangentKernel(w)(Xq), TypeError)
        check(exc is not None and where in str(exc),
              f"TangentKernel({type(wrapper).__name__}) names {where} in its TypeError",
              str(exc)[-110:] if exc else "no error")


TRIALS = {"regressor": trial_regressor, "kernels": trial_kernels, "gp": trial_gp,
          "more": trial_more}

if __name__ == "__main__":
    for name in sys.argv[1:] or TRIALS:
        print(f"# {name}", flush=True)
        TRIALS[name]()
    print(" ".join(f"{k} {v}" for k, v in sorted(COUNTS.items())))
