"""The stochastic Domingos formula (Guo, He & Morel's central result) and the formulas' orders.

**Expected versus realized.** Minibatch SGD with step size ``lr`` and batch ``B`` of ``N``
moves the prediction at ``x`` by ``sum_t lr J_bar_t(x) (1/B) sum_{i in B_t} g_{t,i}``
(the realized representation, exact: ``decompose(weighting="realized")``). Guo, He & Morel's
expected representation credits every sample at every step with weight ``1/N``
(``decompose(weighting="expected")``). Their difference along one path is a sum of
zero-mean minibatch noises: with batches drawn independently at every step (Guo, He & Morel's
diffusion approximation, ``dtheta = -grad L dt + sqrt(lr Sigma / B) dW``) its size at a
fixed training time ``lr * T`` is ``O(sqrt(lr (1/B - 1/N)))`` (the finite-population
variance of a batch mean). The section trains such paths with a loop of its own recorded
by :class:`~skpathkernel.PathRecorder` and fits the rate of the gap in ``lr`` and in
``B``. The estimators' minibatches are epoch reshuffles instead (every sample once per
epoch), where the noise of one epoch cancels to first order: their gap is measured and
reported next to it, with its own fitted rates, as a reading rather than a claim.

**Formula orders.** With the realized weighting, ``decompose(method="first_order")``
(Domingos' formula, ``J_t(x)`` at the start of each step) has an error of ``O(lr)`` at a
fixed training time, and ``method="second_order"`` (plus the curvature term) ``O(lr^2)``
(THEORY.md, interpolation formulas 1-2). Measured on full-batch gradient descent with the
estimators.

Both on a regression (``sin x``) and a classification task (the circle, logistic loss),
in float64 so that the measured gaps are far above round-off.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .. import PathKernelClassifier, PathKernelMachine, PathRecorder
from ..datasets import make_circle, make_sine
from ._common import progress, save, subplots
from ._report import Row

TRAINING_TIME = 1.6  # lr * number of steps: a whole number of epochs for every (lr, B)
N_TRAIN = 64
WIDTH = 16
# A fitted rate passes when it is within two standard errors (bootstrap over the random seeds) of
# the predicted one, and never closer than RATE_TOL is asked: the predictions are
# asymptotic (lr -> 0). A stochastic rate whose standard error exceeds MAX_SE cannot tell
# sqrt(lr) from lr or from no dependence at all: the row says it is inconclusive.
RATE_TOL = 0.1
MAX_SE = 0.15


def fit_rate(x, err):
    """Slope of ``log err`` against ``log x`` (least squares): ``err ~ x ** slope``."""
    x, err = np.asarray(x, dtype=float), np.asarray(err, dtype=float)
    if x.size < 2 or np.any(x <= 0) or np.any(~np.isfinite(err)) or np.any(err <= 0):
        return float("nan")
    return float(np.polyfit(np.log(x), np.log(err), 1)[0])


def fit_rate_se(x, sq_gaps, *, n_boot=400, seed=0):
    """Fitted rate of the RMS gap and its bootstrap standard error over the random seeds.

    ``sq_gaps[k, s]`` is seed ``s``'s mean-square gap at ``x[k]``; each point's seeds are
    resampled independently (the runs are).
    """
    sq_gaps = np.asarray(sq_gaps, dtype=float)
    rate = fit_rate(x, np.sqrt(sq_gaps.mean(axis=1)))
    rng = np.random.RandomState(seed)
    n_points, n_seeds = sq_gaps.shape
    boot = [fit_rate(x, np.sqrt(np.take_along_axis(
        sq_gaps, rng.randint(n_seeds, size=(n_points, n_seeds)), axis=1).mean(axis=1)))
        for _ in range(n_boot)]
    return rate, float(np.std(boot))


def rate_verdict(rate, expected, se=0.0):
    """The claim of a rate row: True / False, or None when ``se`` is too large to decide."""
    if not np.isfinite(rate):
        return False
    if se > MAX_SE:
        return None
    return bool(abs(rate - expected) <= max(2.0 * se, RATE_TOL))


def noise_scale(lr, batch, n):
    """Predicted size of the expected-vs-realized gap, up to a constant."""
    return np.sqrt(np.asarray(lr, float) * (1.0 / np.asarray(batch, float) - 1.0 / n))


def _task(name):
    """(X, y, queries, loss name) of the two tasks; classes of the circle as 0 / 1."""
    if name == "regression":
        X, y = make_sine(n_samples=N_TRAIN)
        Xq = np.linspace(-np.pi, np.pi, 16).reshape(-1, 1) * 0.97
        return X, y.reshape(-1, 1), Xq, "squared_error"
    X, y = make_circle(n_samples=N_TRAIN, inner_radius_sq=0.8, random_state=0)
    Xq, _ = make_circle(n_samples=16, inner_radius_sq=0.8, random_state=1)
    return X, (y > 0).astype(np.int64), Xq, "log_loss"


def _network(n_in, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1),
    ).double()


def iid_sgd_path(task, lr, batch, seed):
    """Plain SGD with a batch of ``batch`` drawn afresh at every step (Guo, He & Morel's model),
    for ``TRAINING_TIME / lr`` steps, recorded: a :class:`RecordedNetwork` (float64, CPU).

    The estimators cannot draw batches this way (they reshuffle once per epoch), so the
    loop is ours, recorded by :class:`~skpathkernel.PathRecorder` with each step's batch
    declared: its realized decomposition is exact (tested)."""
    X, y, _, loss_name = _task(task)
    Xt = torch.as_tensor(X, dtype=torch.float64)
    yt = torch.as_tensor(y, dtype=torch.float64)
    net = _network(X.shape[1], seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    rng = np.random.RandomState(1000 + seed)
    n_steps = int(round(TRAINING_TIME / lr))
    with PathRecorder(net, opt, n_samples=len(X)) as rec:
        for _ in range(n_steps):
            idx = rng.choice(len(X), batch, replace=False)
            opt.zero_grad()
            out = net(Xt[idx])
            # The batch mean of the declared per-sample loss: "squared_error" is
            # 1/2 (f - y)^2, "log_loss" on one margin the logistic loss on 0/1 targets.
            loss = (0.5 * (out - yt[idx]).pow(2).mean() if loss_name == "squared_error"
                    else F.binary_cross_entropy_with_logits(out[:, 0], yt[idx]))
            loss.backward()
            rec.set_batch(idx)
            opt.step()
    return rec.as_estimator(X, y, loss=loss_name)


def _plain_sgd(task, lr, batch_size, max_iter, seed):
    """The estimators' plain SGD on a task, every training parameter explicit, float64 on
    the CPU (networks of ~300 parameters: a device would only add transfers)."""
    X, y, _, loss_name = _task(task)
    cls = PathKernelMachine if task == "regression" else PathKernelClassifier
    return cls(hidden_layer_sizes=(WIDTH, WIDTH), activation="tanh", solver="sgd",
               learning_rate_init=lr, momentum=0.0, alpha=0.0, batch_size=batch_size,
               max_iter=max_iter, tol=None, shuffle=True, loss=loss_name, record_every=1,
               dtype="float64", device="cpu", random_state=seed,
               **({"normalize_y": False} if task == "regression" else {}),
               ).fit(X, y.ravel() if task == "regression" else y)


def reshuffled_sgd_path(task, lr, batch, seed):
    """The estimators' minibatch SGD (epoch reshuffles) for ``TRAINING_TIME / lr`` steps."""
    n_steps = int(round(TRAINING_TIME / lr))
    epochs, rest = divmod(n_steps * batch, N_TRAIN)
    if rest or not epochs:
        raise ValueError(f"lr={lr}, B={batch}: {n_steps} steps are not whole epochs.")
    return _plain_sgd(task, lr, batch, epochs, seed)


def gd_fit(task, lr):
    """Full-batch gradient descent for ``TRAINING_TIME / lr`` steps with the estimators."""
    return _plain_sgd(task, lr, None, int(round(TRAINING_TIME / lr)), 0)


def ms_gap(net, Xq, *, method="exact", weighting="realized"):
    """Mean square over the queries of the representation minus ``f(x; theta_T)``."""
    # "exact" with one Gauss-Legendre node (the midpoint) errs by O(lr^2) over the path,
    # 1e-4 here: far below the minibatch gaps (1e-2 to 1e-1) and a third of the
    # Jacobians of the float64 default.
    res = net.decompose(Xq, method=method, weighting=weighting,
                        n_nodes=1 if method == "exact" else None)
    return float(np.mean((res.reconstruction - res.prediction) ** 2))


def settings(ctx):
    """Seeds, (lrs at the middle batch, batches at the middle lr) of the gap sweeps, lrs of
    the order sweep. Quick mode measures the orders only: a gap's rate needs tens of seeds
    per point (the gap of one run is heavy-tailed: one seed carries ~1 degree of freedom),
    minutes that a smoke test should not spend on a row it could not decide."""
    if ctx.quick:
        return dict(seeds=0, lrs=(), batches=(), order_lrs=(0.1, 0.05, 0.025))
    return dict(seeds=40, lrs=(0.2, 0.1, 0.05, 0.025), batches=(2, 4, 8, 16),
                order_lrs=(0.1, 0.05, 0.025, 0.0125))


def gap_sweep(path, task, lrs, batches, seeds):
    """Mean-square gaps ``(n_points, seeds)`` along lr (at the middle batch) and along B
    (at the middle lr); the run at the middle of both is shared."""
    Xq = _task(task)[2]
    b_mid, lr_mid = batches[len(batches) // 2], lrs[len(lrs) // 2]
    runs = {}

    def gaps(lr, b):
        if (lr, b) not in runs:
            runs[lr, b] = [ms_gap(path(task, lr, b, s), Xq, weighting="expected")
                           for s in range(seeds)]
        return runs[lr, b]

    return {"lr": np.array([gaps(lr, b_mid) for lr in lrs]),
            "batch": np.array([gaps(lr_mid, b) for b in batches])}, b_mid, lr_mid


def _label(ax, **kw):
    """Axis labels and title, legend; no minor tick labels (they collide on log axes)."""
    from matplotlib.ticker import NullFormatter

    ax.set(**kw)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize="x-small")


def _fmt(a):
    return ", ".join(f"{v:.2g}" for v in a)


def _gap_part(task, cfg, axes, details, tick):
    """The i.i.d. gap's claim and the reshuffled gap's reading, drawn on two axes."""
    lrs, batches = np.array(cfg["lrs"]), np.array(cfg["batches"])
    claim = (f"{task}: the realized minibatch output departs from the expected (1/N) "
             "representation by the minibatch noise, O(sqrt(lr (1/B - 1/N))) at a fixed "
             f"training time lr T = {TRAINING_TIME:g} (i.i.d. batches; fitted rates within "
             f"two standard errors, at least {RATE_TOL}, of the predicted ones)")
    if not cfg["seeds"]:
        for ax in axes:
            ax.text(0.5, 0.5, "expected vs realized gap:\nfull run only", ha="center",
                    va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return [Row(f"stoch-{task[:5]}", claim, "not measured in --quick: a rate needs ~40 "
                    "seeds per point; run without --quick", None)]
    grids = {"lr": lrs, "batch": batches}
    sq, b_mid, lr_mid = gap_sweep(iid_sgd_path, task, lrs, batches, cfg["seeds"])
    pred = {"lr": fit_rate(lrs, noise_scale(lrs, b_mid, N_TRAIN)),
            "batch": fit_rate(batches, noise_scale(lr_mid, batches, N_TRAIN))}
    curves = {"i.i.d. batches": sq}
    tick(f"{task} i.i.d.")
    sq_s, _, _ = gap_sweep(reshuffled_sgd_path, task, lrs, batches, cfg["seeds"])
    curves["epoch reshuffles (estimators)"] = sq_s
    tick(f"{task} reshuffled")
    rms = {name: {k: np.sqrt(c[k].mean(axis=1)) for k in grids} for name, c in curves.items()}
    fits = {name: {k: fit_rate_se(grids[k], c[k]) for k in grids}
            for name, c in curves.items()}
    iid, shuf = rms["i.i.d. batches"], rms["epoch reshuffles (estimators)"]
    f_iid, f_shuf = fits["i.i.d. batches"], fits["epoch reshuffles (estimators)"]
    verdicts = [rate_verdict(f_iid[k][0], pred[k], f_iid[k][1]) for k in grids]
    passed = False if False in verdicts else (None if None in verdicts else True)
    text = "; ".join(
        f"vs {'lr' if k == 'lr' else 'B'} {_fmt(grids[k])}: {_fmt(iid[k])}, rate "
        f"{f_iid[k][0]:.2f} +- {f_iid[k][1]:.2f} (predicted {pred[k]:.2f})" for k in grids)
    if passed is None:
        text += f"; inconclusive: a standard error above {MAX_SE} (more seeds needed)"
    for ax, (key, label, fixed) in zip(axes, [("lr", "step size lr", f"B = {b_mid}"),
                                             ("batch", "batch size B", f"lr = {lr_mid:g}")]):
        grid = grids[key]
        for (name, g), mark in zip(rms.items(), ("o-", "s--")):
            f = fits[name][key]
            ax.loglog(grid, g[key], mark, label=f"{name}: rate {f[0]:.2f}")
            details.append({"task": task, "sampling": name, "varied": key,
                            "values": _fmt(grid), "RMS gap": _fmt(g[key]),
                            "rate": f"{f[0]:.2f} +- {f[1]:.2f}"})
        ref = (noise_scale(grid, b_mid, N_TRAIN) if key == "lr"
               else noise_scale(lr_mid, grid, N_TRAIN))
        ax.loglog(grid, ref * iid[key][0] / ref[0], "k:", lw=1,
                  label=f"sqrt(lr (1/B - 1/N)): rate {pred[key]:.2f}")
        _label(ax, xlabel=label, ylabel="RMS |expected - realized|",
               title=f"{task}: {fixed}, N = {N_TRAIN}, lr T = {TRAINING_TIME:g}")
    return [
        Row(f"stoch-{task[:5]}", claim, f"RMS gap {text}; {cfg['seeds']} seeds", passed),
        Row(f"stoch-{task[:5]}",
            f"{task}: the same gap with the estimators' epoch-reshuffled minibatches (a "
            "reading: Guo, He & Morel's diffusion model assumes independent batches)",
            f"RMS gap vs lr {_fmt(shuf['lr'])}, rate {f_shuf['lr'][0]:.2f} +- "
            f"{f_shuf['lr'][1]:.2f}; vs B {_fmt(shuf['batch'])}, rate "
            f"{f_shuf['batch'][0]:.2f} +- {f_shuf['batch'][1]:.2f}", None),
    ]


def _order_part(task, order_lrs, ax):
    """The first- and second-order formulas' errors against lr, with their rates."""
    Xq = _task(task)[2]
    orders = {m: np.sqrt([ms_gap(gd_fit(task, lr), Xq, method=m) for lr in order_lrs])
              for m in ("first_order", "second_order")}
    rate = {m: fit_rate(order_lrs, e) for m, e in orders.items()}
    for (m, e), mark in zip(orders.items(), "o^"):
        ax.loglog(order_lrs, e, mark + "-", label=f"{m}: rate {rate[m]:.2f}")
    _label(ax, xlabel="step size lr", ylabel="RMS formula error",
           title=f"{task}: full-batch GD, lr T = {TRAINING_TIME:g}")
    return Row(
        f"order-{task[:5]}",
        f"{task}: the first-order formula's error is O(lr) and the second-order one's "
        f"O(lr^2) at a fixed training time (fitted rates within {RATE_TOL} of 1 and 2; "
        "full-batch gradient descent)",
        f"RMS error vs lr {_fmt(order_lrs)}: first order {_fmt(orders['first_order'])} "
        f"(rate {rate['first_order']:.2f}), second order {_fmt(orders['second_order'])} "
        f"(rate {rate['second_order']:.2f})",
        bool(rate_verdict(rate["first_order"], 1.0) and rate_verdict(rate["second_order"], 2.0)),
    )


def stochastic_section(ctx):
    """Expected-vs-realized gaps (i.i.d. and reshuffled batches) and the formulas' orders."""
    cfg = settings(ctx)
    tasks = ("regression", "classification")
    rows, details = [], []
    with progress("stochastic formula", (3 if cfg["seeds"] else 1) * len(tasks)) as tick:
        fig, axes = subplots(2, 3, figsize=(16, 9), layout="constrained")
        for r, task in enumerate(tasks):
            rows += _gap_part(task, cfg, axes[r, :2], details, tick)
            rows.append(_order_part(task, np.array(cfg["order_lrs"]), axes[r, 2]))
            tick(f"{task} orders")
        png = save(ctx, fig, "stochastic_formula.png")
    rows[0].measured += f" [{png}]"
    rows[0].details = details
    return rows
