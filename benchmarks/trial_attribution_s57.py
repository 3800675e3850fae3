"""Adversarial user trial (s57) of training-data attribution on the paths that the
MLP-parity features produce: step-size schedules ("invscaling", "adaptive"), Nesterov
momentum, Adam, warm starts, streams of ``partial_fit`` and thinned records.

Each case is checked against references that do not come from the package's own model
of the training:

- ``attribute(..., method="unrolled")`` claims ``d m(x_q) / d w_i`` of the trained output
  with respect to training point ``i``'s weight. The reference retrains the estimator
  from the same seed (same initialization and batch order) with that point's
  ``sample_weight`` moved to ``1 + h`` and ``1 - h`` (every other point at 1), and takes
  the central difference of its prediction (regressors) or margin (classifiers). Float64
  networks, ``h = 1e-5``: the difference's truncation error is about ``h**2`` times the
  third derivative, its round-off about ``1e-16 / h`` of the output.
- ``decompose``'s ``initial + contributions.sum(1) + regularization`` against the trained
  network's own ``predict`` (its ``error`` must bound the miss), and the exact split of
  ``attribute`` plus the initial output against the margin.
- The linear datamodeling score of the default classifier on the bundled printed digits,
  through ``skpathkernel.metrics``.

Run: ``PYTHONPATH=. python -m benchmarks.trial_attribution_s57 [--quick]``; the numbers
go to ``benchmarks/results/user_trial_attribution-s57.md`` (written by hand from the
printed output).
"""

import argparse
import platform
import tempfile
import time
import warnings

import numpy as np
import torch
from scipy.special import logsumexp
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.datasets import load_printed_digits
from skpathkernel.metrics import (
    linear_datamodeling_interval,
    linear_datamodeling_score,
    retrain_on_subsets,
)

H = 1e-5
N = 16
COMMON = dict(hidden_layer_sizes=(8,), activation="tanh", dtype="float64", random_state=0,
              device="cpu")


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=n)
    return X, y


def _margin(est, X, y):
    """TRAK's margin ``f_y - logsumexp_{k != y} f_k`` from decision_function."""
    f = est.decision_function(X)
    codes = np.searchsorted(est.classes_, y)
    if f.ndim == 1:
        return np.where(codes == 1, f, -f)
    own = f[np.arange(len(y)), codes]
    rest = f.copy()
    rest[np.arange(len(y)), codes] = -np.inf
    return own - logsumexp(rest, axis=1)


def finite_differences(fit, n_columns, read, h=H):
    """(n_queries, n_columns): central differences of ``read(fit(w))`` in each column's
    weight multiplier ``w`` (all others 1)."""
    columns = []
    for i in range(n_columns):
        up, down = np.ones(n_columns), np.ones(n_columns)
        up[i] += h
        down[i] -= h
        columns.append((read(fit(up)) - read(fit(down))) / (2 * h))
    return np.stack(columns, axis=-1)


def relative_error(scores, reference):
    return float(np.abs(np.asarray(scores) - reference).max() / np.abs(reference).max())


def check_decomposition(est, Xq):
    """(miss, reported error): decompose's sum against the trained network's outputs."""
    res = est.decompose(Xq)
    total = res.initial + res.contributions.sum(axis=1) + res.regularization
    pred = est.predict(Xq).reshape(len(Xq), -1) if not hasattr(est, "classes_") else \
        est.decision_function(Xq).reshape(len(Xq), -1)
    return float(np.abs(total - pred).max()), float(res.error)


def run_case(name, fit, n_columns, Xq, read, attribute_kwargs=None, notes=""):
    """Fit at w = 1, compare the unrolled scores to the finite differences."""
    t0 = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = fit(np.ones(n_columns))
        scores = est.attribute(Xq, method="unrolled", **(attribute_kwargs or {}))
    fit_warnings = sorted({f"{w.category.__name__}: {str(w.message)[:90]}" for w in caught})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fd = finite_differences(fit, n_columns, read)
    if scores.shape[1] != n_columns:
        # early_stopping's held-out rows train nothing: their columns are 0, the others
        # are the rows of X_fit_ that train_indices_ maps to X.
        full = np.zeros((len(Xq), n_columns))
        full[:, est.train_indices_] = scores
        notes = f"{notes} scores over train_indices_ ({scores.shape[1]} of {n_columns})"
        scores_cmp = full
    else:
        scores_cmp = scores
    err = relative_error(scores_cmp, fd)
    miss, reported = check_decomposition(est, Xq)
    traj = est.trajectory_
    lrs = np.unique(np.round(np.asarray(traj.learning_rates, dtype=float), 12))
    row = dict(case=name, steps=int(traj.steps[-1]), points=len(traj), columns=n_columns,
               max_abs_score=float(np.abs(fd).max()), rel_err=err,
               replay_error=float(np.max(scores.replay_error)),
               growth=float(np.max(scores.growth)), decomp_miss=miss,
               decomp_error=reported, n_lr=len(lrs), lr_min=float(lrs.min()),
               lr_max=float(lrs.max()), cpu_s=time.process_time() - t0,
               warnings=fit_warnings, notes=notes)
    print(f"{name}: rel err {err:.2e} (max |score| {row['max_abs_score']:.3g}), "
          f"replay_error {row['replay_error']:.1e}, growth {row['growth']:.3g}, "
          f"steps {row['steps']}, points {row['points']}, lr in [{row['lr_min']:.4g}, "
          f"{row['lr_max']:.4g}] ({row['n_lr']} values), decompose miss {miss:.1e} "
          f"<= error {reported:.1e}: {miss <= reported * 1.01 + 1e-15}, "
          f"{row['cpu_s']:.1f} s", flush=True)
    for w in fit_warnings:
        print("   warning:", w)
    return row, est, scores, fd


def regressor_cases(quick):
    X, y = _data()
    Xq = np.array([[0.3, -0.2, 0.5], [-0.7, 0.4, 0.1], [1.0, 1.0, -1.0]])
    rows = []

    def plain(params):
        def fit(w):
            return PathKernelMachine(**COMMON, **params).fit(X, y, sample_weight=w)
        return fit

    sgd = dict(solver="sgd", batch_size=4, tol=None, momentum=0.0)
    cases = {
        "sgd invscaling (batch 4, 8 epochs)": dict(
            sgd, learning_rate="invscaling", learning_rate_init=0.5, power_t=0.5,
            max_iter=8),
        "sgd nesterov 0.9 (batch 4, 8 epochs)": dict(
            sgd, momentum=0.9, nesterovs_momentum=True, learning_rate_init=0.05,
            max_iter=8),
        "sgd heavy-ball 0.9 invscaling, record_every=3": dict(
            sgd, momentum=0.9, nesterovs_momentum=False, learning_rate="invscaling",
            learning_rate_init=0.1, max_iter=8, record_every=3),
        "sgd nesterov invscaling, record_every=5": dict(
            sgd, momentum=0.9, learning_rate="invscaling", learning_rate_init=0.1,
            max_iter=8, record_every=5),
        "adam (batch 4, 8 epochs)": dict(
            solver="adam", batch_size=4, tol=None, learning_rate_init=0.02, max_iter=8),
        "adam record_every=3": dict(
            solver="adam", batch_size=4, tol=None, learning_rate_init=0.02, max_iter=8,
            record_every=3),
        "adamw alpha=0.01 (batch 4)": dict(
            solver="adamw", batch_size=4, tol=None, learning_rate_init=0.02, max_iter=8,
            alpha=0.01),
    }
    for name, params in cases.items():
        rows.append(run_case(name, plain(params), N, Xq, lambda e: e.predict(Xq))[0])

    # "adaptive" in a regime where the step size drops: full batch, a tol the loss
    # cannot keep beating, patience 2.
    adaptive = dict(solver="sgd", batch_size=None, momentum=0.9, learning_rate="adaptive",
                    learning_rate_init=0.2, tol=0.05, n_iter_no_change=2, max_iter=30)
    rows.append(run_case("sgd nesterov adaptive (full batch, tol 0.05)", plain(adaptive), N,
                         Xq, lambda e: e.predict(Xq))[0])
    adaptive_mb = dict(adaptive, batch_size=4, learning_rate_init=0.05, record_every=2)
    rows.append(run_case("sgd nesterov adaptive (batch 4, record_every=2)",
                         plain(adaptive_mb), N, Xq, lambda e: e.predict(Xq))[0])

    # warm start: two fits on the same data (the second continues the path).
    for solver_name, params in {
        "sgd nesterov": dict(sgd, momentum=0.9, learning_rate_init=0.05, max_iter=4),
        "sgd invscaling": dict(sgd, learning_rate="invscaling", learning_rate_init=0.5,
                               max_iter=4),
        "adam": dict(solver="adam", batch_size=4, tol=None, learning_rate_init=0.02,
                     max_iter=4),
    }.items():
        def warm(w, params=params):
            est = PathKernelMachine(**COMMON, **params, warm_start=True)
            est.fit(X, y, sample_weight=w)
            est.set_params(max_iter=3)
            return est.fit(X, y, sample_weight=w)
        rows.append(run_case(f"warm start, {solver_name} (4 + 3 epochs)", warm, N, Xq,
                             lambda e: e.predict(Xq))[0])

    # warm start with a changed learning rate in between (a new schedule start).
    def warm_lr(w):
        est = PathKernelMachine(**COMMON, **dict(sgd, momentum=0.9, learning_rate_init=0.05,
                                                 max_iter=4), warm_start=True)
        est.fit(X, y, sample_weight=w)
        est.set_params(max_iter=3, learning_rate_init=0.01)
        return est.fit(X, y, sample_weight=w)
    rows.append(run_case("warm start, nesterov, lr 0.05 then 0.01", warm_lr, N, Xq,
                         lambda e: e.predict(Xq))[0])

    # partial_fit: a stream of calls on the same rows (sklearn's epoch loop), each call
    # its own columns; and on disjoint chunks.
    calls = 3
    for solver_name, params in {
        "sgd nesterov": dict(solver="sgd", momentum=0.9, learning_rate_init=0.05,
                             batch_size=4),
        "sgd invscaling": dict(solver="sgd", learning_rate="invscaling",
                               learning_rate_init=0.5, batch_size=4),
        "adam": dict(solver="adam", learning_rate_init=0.02, batch_size=4),
    }.items():
        def stream(w, params=params):
            est = PathKernelMachine(**COMMON, **params)
            for k in range(calls):
                est.partial_fit(X, y, sample_weight=w[k * N:(k + 1) * N])
            return est
        rows.append(run_case(f"partial_fit x{calls} same rows, {solver_name}", stream,
                             calls * N, Xq, lambda e: e.predict(Xq))[0])

    chunks = np.array_split(np.arange(N), 4)

    def chunked(w):
        est = PathKernelMachine(**COMMON, solver="sgd", momentum=0.9,
                                learning_rate="invscaling", learning_rate_init=0.3,
                                batch_size=3)
        for c in chunks:
            est.partial_fit(X[c], y[c], sample_weight=w[c])
        return est
    rows.append(run_case("partial_fit x4 disjoint chunks, nesterov invscaling", chunked, N,
                         Xq, lambda e: e.predict(Xq))[0])

    # a point that appears in every partial_fit call: its weight in all of them at once
    # is the sum of its columns.
    return rows


def classifier_cases(quick):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(18, 3))
    y = np.argmax(X @ rng.normal(size=(3, 3)), axis=1)
    Xq, yq = X[:3] + 0.2, y[:3]
    rows = []
    params = dict(solver="sgd", momentum=0.9, learning_rate="invscaling",
                  learning_rate_init=0.5, batch_size=5, tol=None, max_iter=6)

    def fit(w):
        return PathKernelClassifier(**COMMON, **params).fit(X, y, sample_weight=w)
    rows.append(run_case("classifier 3 classes, nesterov invscaling (margin)", fit, len(X),
                         Xq, lambda e: _margin(e, Xq, yq),
                         attribute_kwargs=dict(y=yq))[0])

    def stream(w):
        est = PathKernelClassifier(**COMMON, **dict(params, solver="adam",
                                                    learning_rate_init=0.02))
        est.partial_fit(X[:9], y[:9], classes=np.unique(y), sample_weight=w[:9])
        return est.partial_fit(X[9:], y[9:], sample_weight=w[9:])
    rows.append(run_case("classifier partial_fit x2, adam (margin)", stream, len(X), Xq,
                         lambda e: _margin(e, Xq, yq), attribute_kwargs=dict(y=yq))[0])
    return rows


def extra_cases(quick):
    """Less-trodden combinations: early stopping inside a warm start, a path on disk
    continued by partial_fit, record_every="auto" thinned by a small memory_budget, a
    two-output regressor's weighted output, shuffle=False, one-row partial_fit calls."""
    X, y = _data()
    Xq = np.array([[0.3, -0.2, 0.5], [-0.7, 0.4, 0.1]])
    rows = []
    nesterov = dict(solver="sgd", momentum=0.9, learning_rate_init=0.05, batch_size=4)

    def warm_early(w):
        est = PathKernelMachine(**COMMON, **nesterov, early_stopping=True,
                                validation_fraction=0.25, n_iter_no_change=2, tol=1e-3,
                                max_iter=12, warm_start=True)
        est.fit(X, y, sample_weight=w)
        return est.fit(X, y, sample_weight=w)
    est = warm_early(np.ones(N))
    rows.append(run_case(f"warm start x2, early stopping (X_fit_ {len(est.X_fit_)} rows)",
                         warm_early, N, Xq, lambda e: e.predict(Xq))[0])

    with tempfile.TemporaryDirectory(prefix="s57disk") as root:
        def disk_stream(w):
            est = PathKernelMachine(**COMMON, **nesterov, trajectory_storage="disk",
                                    trajectory_dir=tempfile.mkdtemp(dir=root))
            est.partial_fit(X[:8], y[:8], sample_weight=w[:8])
            return est.partial_fit(X[8:], y[8:], sample_weight=w[8:])
        rows.append(run_case("partial_fit x2 on disk, nesterov", disk_stream, N, Xq,
                             lambda e: e.predict(Xq))[0])

    def thinned_auto(w):
        # 1281 parameters in float64: the smallest budget (1 MiB) holds about 100 points.
        return PathKernelMachine(**{**COMMON, "hidden_layer_sizes": (256,)}, **nesterov,
                                 learning_rate="invscaling", max_iter=60, tol=None,
                                 memory_budget=2**20).fit(X, y, sample_weight=w)
    rows.append(run_case("record_every='auto', 240 steps of 1281 parameters in 1 MiB",
                         thinned_auto, N, Xq, lambda e: e.predict(Xq))[0])

    Y2 = np.column_stack([y, 3 * X[:, 0] - X[:, 2] ** 2 + 5])
    weights = np.array([1.0, -2.0])

    def two_outputs(w):
        return PathKernelMachine(**COMMON, solver="adam", learning_rate_init=0.02,
                                 batch_size=4, max_iter=6, tol=None).fit(
            X, Y2, sample_weight=w)
    rows.append(run_case("two outputs, output=[1, -2], adam", two_outputs, N, Xq,
                         lambda e: e.predict(Xq) @ weights,
                         attribute_kwargs=dict(output=weights))[0])

    def warm_other(w):
        # A warm start on other rows appends them: X_fit_ is 10 + 16 rows, normalize_y's
        # moments the first fit's 10.
        est = PathKernelMachine(**COMMON, **nesterov, learning_rate="invscaling",
                                max_iter=4, tol=None, warm_start=True)
        est.fit(X[:10], y[:10], sample_weight=w[:10])
        return est.fit(X, y, sample_weight=w[10:])
    rows.append(run_case("warm start on other rows (10, then all 16)", warm_other, 26, Xq,
                         lambda e: e.predict(Xq))[0])

    def adaptive_stream(w):
        est = PathKernelMachine(**COMMON, **dict(nesterov, learning_rate_init=0.1),
                                learning_rate="adaptive", tol=0.05, n_iter_no_change=1)
        for k in range(6):
            est.partial_fit(X[2 * k:2 * k + 6], y[2 * k:2 * k + 6],
                            sample_weight=w[6 * k:6 * k + 6])
        return est
    rows.append(run_case("partial_fit x6 overlapping chunks, adaptive", adaptive_stream, 36,
                         Xq, lambda e: e.predict(Xq))[0])

    def ordered(w):
        return PathKernelMachine(**COMMON, **nesterov, shuffle=False, max_iter=6,
                                 tol=None).fit(X, y, sample_weight=w)
    rows.append(run_case("shuffle=False, nesterov", ordered, N, Xq,
                         lambda e: e.predict(Xq))[0])

    def one_row_stream(w):
        # normalize_y=False: its moments would be the first call's 2 rows only (see the
        # results file: the default diverges here).
        est = PathKernelMachine(**COMMON, solver="sgd", momentum=0.9, normalize_y=False,
                                learning_rate="invscaling", learning_rate_init=0.05)
        # The first call needs 2 rows (a 1-sample fit is refused), later calls may have 1.
        est.partial_fit(X[:2], y[:2], sample_weight=w[:2])
        for i in range(2, N):
            est.partial_fit(X[i:i + 1], y[i:i + 1], sample_weight=w[i:i + 1])
        return est
    rows.append(run_case("partial_fit 2 rows then one row per call, nesterov invscaling",
                         one_row_stream, N, Xq, lambda e: e.predict(Xq))[0])
    return rows


def stream_trap():
    """normalize_y's moments come from the first partial_fit call only: a stream whose
    first call holds 2 rows trains on targets scaled by their half-difference."""
    X, y = _data()
    for normalize_y in (True, False):
        est = PathKernelMachine(**COMMON, solver="sgd", momentum=0.9,
                                learning_rate="invscaling", learning_rate_init=0.05,
                                normalize_y=normalize_y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.partial_fit(X[:2], y[:2])
            for i in range(2, N):
                est.partial_fit(X[i:i + 1], y[i:i + 1])
        print(f"stream of 1-row calls, normalize_y={normalize_y}: scale "
              f"{est._y_scale}, std(y) {y.std():.3f}, max loss {max(est.loss_curve_):.3g}, "
              f"warnings {[w.category.__name__ for w in caught]}", flush=True)


def _reference_split(est, Xq, nodes=24):
    """Per-point contributions ``(n_queries, n_train)`` and the weight-decay term, from a
    plain float64 torch replay of the training (independent of the package's split):
    the recorded initial point, batches and per-step step sizes, torch.optim's update
    rules written out (SGD heavy ball / Nesterov with ``alpha`` as weight decay; Adam),
    each point's share of every step its part of the optimizer's linear state, each
    step's query Jacobian averaged over the segment by ``nodes``-point Gauss-Legendre.
    Also returns the replay's largest miss of the recorded points."""
    traj = est.trajectory_
    module = est.module_
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for _, p in module.named_parameters()]
    sizes = [int(np.prod(s)) for s in shapes]

    def unflat(theta):
        return dict(zip(names, (t.reshape(s) for t, s in zip(theta.split(sizes), shapes))))

    def f(theta, x):
        return torch.func.functional_call(module, unflat(theta), (x,))[..., 0]

    X = torch.as_tensor(np.asarray(est.X_fit_), dtype=torch.float64)
    Y = torch.as_tensor(np.asarray(est.network_.y_fit), dtype=torch.float64).reshape(len(X))
    Q = torch.as_tensor(Xq, dtype=torch.float64)
    theta = traj.parameters(0).to(torch.float64).clone()
    n, P = len(X), theta.numel()
    spec = traj.solver_spec
    mu = float(getattr(spec, "momentum", 0.0) or 0.0)
    nesterov = bool(getattr(spec, "nesterov", False))
    alpha = float(getattr(spec, "weight_decay", 0.0) or 0.0)
    share = torch.zeros(n, P, dtype=torch.float64)  # momentum buffer / Adam's m, per point
    reg_share = torch.zeros(P, dtype=torch.float64)
    v = torch.zeros(P, dtype=torch.float64)
    t_nodes, t_weights = np.polynomial.legendre.leggauss(nodes)
    t_nodes, t_weights = (t_nodes + 1) / 2, t_weights / 2
    contributions = torch.zeros(len(Q), n, dtype=torch.float64)
    regularization = torch.zeros(len(Q), dtype=torch.float64)
    per_sample = torch.func.vmap(torch.func.grad(
        lambda th, x, y: 0.5 * (f(th, x[None])[0] - y) ** 2), in_dims=(None, 0, 0))
    lrs = traj.step_learning_rates
    recorded = {int(s): k for k, s in enumerate(traj.steps)}
    miss = 0.0
    for step, batch in enumerate(traj.batches):
        batch = torch.as_tensor(np.asarray(batch), dtype=torch.long)
        g = per_sample(theta, X[batch], Y[batch]) / len(batch)  # mean loss's shares
        lr = float(lrs[step])
        if spec.name == "sgd":
            step_share = torch.zeros(n, P, dtype=torch.float64).index_add_(0, batch, g)
            step_reg = alpha * theta
            if mu and step > 0:
                share, reg_share = mu * share + step_share, mu * reg_share + step_reg
            elif mu:
                share, reg_share = step_share.clone(), step_reg.clone()
            else:
                share, reg_share = step_share, step_reg
            if mu and nesterov:
                d_share, d_reg = step_share + mu * share, step_reg + mu * reg_share
            else:
                d_share, d_reg = share, reg_share
            delta_share, delta_reg = -lr * d_share, -lr * d_reg
        elif spec.name == "adam" and not alpha:
            b1, b2, eps = spec.beta_1, spec.beta_2, spec.epsilon
            step_share = torch.zeros(n, P, dtype=torch.float64).index_add_(0, batch, g)
            share = b1 * share + (1 - b1) * step_share
            v = b2 * v + (1 - b2) * g.sum(0) ** 2
            k = step + 1
            denom = (v / (1 - b2 ** k)).sqrt() + eps
            delta_share = -lr / (1 - b1 ** k) * share / denom
            delta_reg = torch.zeros(P, dtype=torch.float64)
        else:
            raise NotImplementedError(spec.name)
        delta = delta_share.sum(0) + delta_reg
        J = sum(w * torch.func.jacrev(f)(theta + t * delta, Q)
                for t, w in zip(t_nodes, t_weights))  # (queries, P)
        contributions += J @ delta_share.T
        regularization += J @ delta_reg
        theta = theta + delta
        if step + 1 in recorded:
            point = traj.parameters(recorded[step + 1]).to(torch.float64)
            miss = max(miss, float((theta - point).abs().max()))
    return contributions.numpy(), regularization.numpy(), miss


def contribution_cases():
    """decompose's per-point contributions against :func:`_reference_split`, within its
    ``contribution_error``; their sum against f(x) - f(x0)."""
    X, y = _data()
    Xq = np.array([[0.3, -0.2, 0.5], [-0.7, 0.4, 0.1], [1.0, 1.0, -1.0]])
    base = dict(batch_size=4, max_iter=8, tol=None, normalize_y=False)
    out = []
    for name, params in {
        "heavy ball invscaling alpha=0.01 record_every=3": dict(
            solver="sgd", momentum=0.9, nesterovs_momentum=False, alpha=0.01,
            learning_rate="invscaling", learning_rate_init=0.1, record_every=3),
        "nesterov invscaling record_every=1": dict(
            solver="sgd", momentum=0.9, learning_rate="invscaling",
            learning_rate_init=0.1),
        "nesterov adaptive full batch": dict(
            solver="sgd", momentum=0.9, learning_rate="adaptive", learning_rate_init=0.2,
            batch_size=None, tol=0.05, n_iter_no_change=2, max_iter=30),
        "adam record_every=3": dict(solver="adam", learning_rate_init=0.02,
                                    record_every=3),
    }.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = PathKernelMachine(**COMMON, **{**base, **params}).fit(X, y)
            res = est.decompose(Xq)
        ref, reg, miss = _reference_split(est, Xq)
        got = res.contributions[:, :, 0]
        diff = float(np.abs(got - ref).max())
        reg_diff = float(np.abs(res.regularization[:, 0] - reg).max())
        pred = est.predict(Xq)
        sum_miss = float(np.abs(res.initial[:, 0] + got.sum(1) + res.regularization[:, 0]
                                - pred).max())
        print(f"contributions, {name}: |decompose - reference| {diff:.1e} (largest "
              f"{np.abs(ref).max():.3g}), contribution_error "
              f"{float(np.max(res.contribution_error)):.1e}, regularization diff "
              f"{reg_diff:.1e}, reference replay miss {miss:.1e}; sum miss {sum_miss:.1e} "
              f"<= error {float(res.error):.1e}", flush=True)
        out.append(dict(case=name, diff=diff, contribution_error=float(
            np.max(res.contribution_error)), reg_diff=reg_diff, replay_miss=miss,
            sum_miss=sum_miss, error=float(res.error)))
    return out


def exact_split_cases():
    """attribute(method="exact") + initial = margin on the new paths (classifier)."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(30, 4))
    y = (X[:, 0] + X[:, 1] ** 2 > 0.5).astype(int)
    out = []
    for name, params in {
        "nesterov invscaling": dict(solver="sgd", momentum=0.9, learning_rate="invscaling",
                                    learning_rate_init=0.5, batch_size=8, max_iter=10),
        "adaptive": dict(solver="sgd", momentum=0.9, learning_rate="adaptive",
                         learning_rate_init=0.3, batch_size=None, tol=0.05,
                         n_iter_no_change=2, max_iter=30),
        "adam record_every=4": dict(solver="adam", learning_rate_init=0.01, batch_size=8,
                                    max_iter=10, record_every=4),
    }.items():
        params.setdefault("tol", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clf = PathKernelClassifier(**COMMON, **params).fit(X, y)
            scores = clf.attribute(X[:5], y[:5])
            res = clf.decompose(X[:5])
        sign = 2 * y[:5] - 1
        initial = res.initial[:, 0] * sign
        reg = res.regularization[:, 0] * sign
        miss = float(np.abs(initial + scores.sum(1) + reg - _margin(clf, X[:5], y[:5])).max())
        print(f"exact split, {name}: |initial + sum + reg - margin| {miss:.1e}, "
              f"decompose error {res.error:.1e}, points {len(clf.trajectory_)}, "
              f"steps {clf.trajectory_.steps[-1]}", flush=True)
        out.append(dict(case=name, miss=miss, error=float(res.error),
                        points=len(clf.trajectory_), steps=int(clf.trajectory_.steps[-1])))
    return out


def lds_case(quick):
    """LDS of the default classifier on the bundled printed digits, bare and inside a
    Pipeline (StandardScaler first), through skpathkernel.metrics."""
    X, y = load_printed_digits(n_per_class=32, return_X_y=True)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(X))
    n_train, n_query = (200, 10) if quick else (300, 20)
    tr, te = order[:n_train], order[n_train:n_train + n_query]
    X_train, y_train, X_test, y_test = X[tr] / 16, y[tr], X[te] / 16, y[te]
    n_subsets = 10 if quick else 20
    results = {}
    for label, model in (("bare", PathKernelClassifier(random_state=0)),
                         ("pipeline", make_pipeline(StandardScaler(),
                                                    PathKernelClassifier(random_state=0)))):
        t0 = time.process_time()
        model.fit(X_train, y_train)
        fit_s = time.process_time() - t0
        clf = model[-1] if label == "pipeline" else model
        Xq = model[:-1].transform(X_test) if label == "pipeline" else X_test
        acc = model.score(X_test, y_test)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.process_time()
            unrolled = clf.attribute(Xq, y_test, method="unrolled")
            t_unrolled = time.process_time() - t0
            t0 = time.process_time()
            exact = clf.attribute(Xq, y_test)
            t_exact = time.process_time() - t0
        print(f"LDS ({label}): default classifier on {n_train} printed digits, {n_query} "
              f"queries, solver {clf.solver}, {clf.n_iter_} epochs, {clf.t_} steps, "
              f"{len(clf.trajectory_)} points, test acc {acc:.3f}, fit {fit_s:.1f} s, "
              f"unrolled {t_unrolled:.1f} s, exact {t_exact:.1f} s; growth max "
              f"{np.max(unrolled.growth):.3g}, amplification[0] "
              f"{float(np.asarray(unrolled.amplification)[0]):.3g}, gradient_sensitivity "
              f"{unrolled.gradient_sensitivity}", flush=True)
        for w in caught:
            print("   warning:", w.category.__name__, str(w.message)[:200])
        for protocol in ("replay", "same_seed", "independent"):
            t0 = time.time()
            truth = retrain_on_subsets(model, X_train, y_train, X_test, y_test,
                                       n_subsets=n_subsets, protocol=protocol,
                                       random_state=0, n_jobs=2)
            wall = time.time() - t0
            for method, scores in (("unrolled", unrolled), ("exact", exact)):
                lds = linear_datamodeling_score(scores, truth.subsets, truth.outputs)
                low, high = linear_datamodeling_interval(scores, truth.subsets,
                                                         truth.outputs, random_state=0)
                results[(label, protocol, method)] = (lds, low, high)
                print(f"  LDS {label} {protocol:11s} {method:8s}: {lds:.3f} [{low:.3f}, "
                      f"{high:.3f}] ({n_subsets} half subsets, retraining {wall:.0f} s "
                      "wall)", flush=True)
    return results


def lds_epsilon():
    """The pipeline's replay LDS in float64 at Adam's default epsilon and at 1e-4: is its
    low LDS float32 round-off, or Adam's first-step non-linearity?"""
    X, y = load_printed_digits(n_per_class=32, return_X_y=True)
    order = np.random.default_rng(0).permutation(len(X))
    tr, te = order[:300], order[300:320]
    X_train, y_train, X_test, y_test = X[tr] / 16, y[tr], X[te] / 16, y[te]
    for eps in (1e-8, 1e-4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = make_pipeline(StandardScaler(), PathKernelClassifier(
                random_state=0, dtype="float64", epsilon=eps)).fit(X_train, y_train)
            clf = pipe[-1]
            scores = clf.attribute(pipe[:-1].transform(X_test), y_test, method="unrolled")
            truth = retrain_on_subsets(pipe, X_train, y_train, X_test, y_test,
                                       n_subsets=20, protocol="replay", random_state=0,
                                       n_jobs=2)
        lds = linear_datamodeling_score(scores, truth.subsets, truth.outputs)
        print(f"pipeline float64 epsilon={eps:g}: {clf.n_iter_} epochs, growth "
              f"{np.max(scores.growth):.3g}, amplification[0] "
              f"{float(scores.amplification[0]):.3g}, replay LDS unrolled {lds:.3f}",
              flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["regressor", "classifier", "extra",
                                           "contributions", "exact", "lds",
                                           "lds-epsilon"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    if args.only in (None, "regressor"):
        regressor_cases(args.quick)
    if args.only in (None, "classifier"):
        classifier_cases(args.quick)
    if args.only in (None, "extra"):
        extra_cases(args.quick)
        stream_trap()
    if args.only in (None, "contributions"):
        contribution_cases()
    if args.only in (None, "exact"):
        exact_split_cases()
    if args.only in (None, "lds"):
        lds_case(args.quick)
    if args.only in (None, "lds-epsilon"):
        lds_epsilon()


if __name__ == "__main__":
    main()
