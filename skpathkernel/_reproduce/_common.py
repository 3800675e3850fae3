"""What the figure sections share: progress, saving figures, the shared fitted networks."""

from __future__ import annotations

import os
import time

import numpy as np
from joblib import Parallel, delayed
from sklearn.datasets import load_digits

from .. import PathKernelClassifier
from .._device import torch_threads
from .._progress import Progress
from ..datasets import make_circle
from ._report import Context

# Guo, He & Morel's circle task (figures 1, 9, 10): learning rates that train it reliably with each
# solver, minibatches of CIRCLE_BATCH (the papers' stochastic setting: with full-batch
# gradient descent the kernel neighbourhoods of figure 1 barely move in 300 epochs).
CIRCLE_BATCH = 32
CIRCLE_SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate_init=0.5),
    "sgd+momentum": dict(solver="sgd", learning_rate_init=0.1, momentum=0.9),
    "adam": dict(solver="adam", learning_rate_init=0.01),
    "adamw": dict(solver="adamw", learning_rate_init=0.01, alpha=1e-3),
    "rmsprop": dict(solver="rmsprop", learning_rate_init=0.005),
}


def training(ctx, *, solver, learning_rate_init, batch_size, max_iter, random_state=0,
             **kw):
    """Every training parameter of an estimator, explicit: the figures must not move when
    the estimators' defaults do. ``kw`` overrides the fixed ones (momentum, alpha, ...)."""
    # tol=None: exactly max_iter epochs, the papers' fixed-length paths (no stopping rule).
    params = dict(activation="tanh", solver=solver, learning_rate_init=learning_rate_init,
                  momentum=0.0, nesterovs_momentum=False, alpha=0.0, beta_1=0.9,
                  beta_2=0.999, epsilon=1e-8, batch_size=batch_size, max_iter=max_iter,
                  tol=None, shuffle=True, record_every=1, dtype="float32", device=ctx.device,
                  random_state=random_state)
    params.update(kw)
    return params


def progress(desc: str, total: int) -> Progress:
    """One bar per figure; without tqdm, a single line when the figure is done."""
    return Progress(desc, total, end="{desc}: {n}/{total} done")


def worker_context(ctx):
    """The context without its cache of fitted networks: what a worker process needs."""
    return Context(out=ctx.out, quick=ctx.quick, device=ctx.device, data_home=ctx.data_home,
                   n_jobs=ctx.n_jobs)


# CPU seconds spent by worker processes on parallel_map's calls, summed over the run: the
# main process's own clock does not see them.
_WORKER_CPU = [0.0]


def worker_cpu() -> float:
    """CPU seconds that worker processes spent on :func:`parallel_map` calls so far."""
    return _WORKER_CPU[0]


def _timed(func, args):
    # One torch thread: a joblib worker process starts with torch's default (every core),
    # two such workers on two cores would oversubscribe.
    start = time.process_time()
    with torch_threads(1):
        result = func(*args)
    return result, time.process_time() - start, os.getpid()


def parallel_map(func, jobs, *, n_jobs) -> list:
    """``[func(*args) for args in jobs]`` over ``n_jobs`` processes (joblib's loky; 1: in
    this process), each call on one torch thread; the workers' CPU time is counted."""
    done = Parallel(n_jobs=n_jobs)(delayed(_timed)(func, args) for args in jobs)
    _WORKER_CPU[0] += sum(cpu for _, cpu, pid in done if pid != os.getpid())
    return [result for result, _, _ in done]


def subplots(*args, **kwargs):
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(ctx, fig, name) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(ctx.out, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


def quick_settings(ctx, settings: str) -> str:
    """A row's reduced settings, appended to its measured text in a quick run (the
    report's header says "mode: quick", the row says by how much)."""
    return f"; quick settings: {settings}" if ctx.quick else ""


def circle_settings(ctx):
    """(n_samples, epochs, n_neighbors, mid epoch): the paper's 100 neighbours out of ~1000
    points and its 200th epoch of 1000; quick keeps both ratios (10 % and 20 %)."""
    return (400, 100, 40, 20) if ctx.quick else (1000, 1000, 100, 200)


def steps_per_epoch(ctx):
    return -(-circle_settings(ctx)[0] // CIRCLE_BATCH)


def circle_data(ctx):
    n = circle_settings(ctx)[0]
    X, y = make_circle(n_samples=n, inner_radius_sq=0.8, random_state=0)
    X_test, y_test = make_circle(n_samples=n, inner_radius_sq=0.8, random_state=1)
    return X, y, X_test, y_test


def _circle_fit(ctx, solver):
    X, y, _, _ = circle_data(ctx)
    epochs = circle_settings(ctx)[1]
    return PathKernelClassifier(
        hidden_layer_sizes=(64, 64), loss="log_loss", **training(
            ctx, max_iter=epochs, batch_size=CIRCLE_BATCH,
            # Full runs keep one point per epoch (31k steps would be ~2 GiB per solver).
            record_every=1 if ctx.quick else steps_per_epoch(ctx),
            **CIRCLE_SOLVERS[solver]),
    ).fit(X, y)


def circle_fit(ctx, solver):
    """The 2-64-64-1 tanh network trained on figure 1's circle task with one solver."""
    key = ("circle", solver)
    if key not in ctx.cache:
        ctx.cache[key] = _circle_fit(ctx, solver)
    return ctx.cache[key]


def circle_fits(ctx, solvers):
    """:func:`circle_fit` for several solvers, the missing fits spread over ``ctx.n_jobs``
    processes in the full run (32k steps each; quick fits take a second, less than
    starting a worker)."""
    missing = [s for s in solvers if ("circle", s) not in ctx.cache]
    fits = parallel_map(_circle_fit, [(worker_context(ctx), s) for s in missing],
                        n_jobs=1 if ctx.quick else ctx.n_jobs)
    ctx.cache.update({("circle", s): est for s, est in zip(missing, fits)})
    return {s: ctx.cache["circle", s] for s in solvers}


def digits_split(ctx):
    """sklearn's 8x8 digits (standing in for MNIST), ink scaled to [0, 1]: a training set
    and a held-out display set of 10 images per class ordered by class."""
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    rng = np.random.RandomState(0)
    perm = rng.permutation(len(y))
    X, y = X[perm], y[perm]
    show = np.concatenate([np.flatnonzero(y == c)[:10] for c in range(10)])
    rest = np.setdiff1d(np.arange(len(y)), show)
    n_train = 600 if ctx.quick else len(rest)
    train = rest[:n_train]
    return X[train], y[train], X[show], y[show]


def digits_reduced(ctx, epochs=200) -> str:
    """:func:`quick_settings` of the rows that read the digits network (``epochs``: the
    full run's)."""
    return quick_settings(ctx, "600 training digits, 100 full-batch epochs (the full run: "
                               f"1697, {epochs} epochs in batches of 64)")


def digits_estimator(ctx, *, hidden_layer_sizes=(64, 64), **change):
    """The digits network's estimator, unfitted; ``change`` overrides training parameters
    (the sweep of figure 5c)."""
    params = dict(solver="adam", learning_rate_init=0.003,
                  batch_size=None if ctx.quick else 64, max_iter=100 if ctx.quick else 200,
                  # Minibatch runs take ~27 steps an epoch: keep about one point per epoch.
                  record_every=1 if ctx.quick else 20)
    params.update(change)
    return PathKernelClassifier(hidden_layer_sizes=hidden_layer_sizes, loss="log_loss",
                                **training(ctx, **params))


def digits_fit(ctx, *, max_iter=None):
    """A 64-64-64-10 tanh network trained on digits 0-9 (figures 2e-f, 5, 6); ``max_iter``
    replaces the number of epochs (figure 6's caption reads its network at the 300th,
    figure 5's at the 200th)."""
    key = ("digits", max_iter)
    if key not in ctx.cache:
        X, y, _, _ = digits_split(ctx)
        change = {} if max_iter is None else {"max_iter": max_iter}
        ctx.cache[key] = digits_estimator(ctx, **change).fit(X, y)
    return ctx.cache[key]


def scaled_printed(loader, **kw):
    X, y = loader(return_X_y=True, **kw)
    return X / 16.0, y


def decision_regions(ax, predict, X, y, *, resolution=150, pad=0.15, title=None):
    """Predicted labels on a grid behind the training points."""
    lo, hi = X.min(axis=0) - pad * np.ptp(X, axis=0), X.max(axis=0) + pad * np.ptp(X, axis=0)
    g0, g1 = np.meshgrid(np.linspace(lo[0], hi[0], resolution),
                         np.linspace(lo[1], hi[1], resolution))
    Z = predict(np.column_stack([g0.ravel(), g1.ravel()])).reshape(g0.shape)
    ax.contourf(g0, g1, Z, levels=[-np.inf, 0, np.inf], colors=["#9ecae1", "#fcbba1"],
                alpha=0.8)
    ax.scatter(X[:, 0], X[:, 1], c=y, cmap="coolwarm", s=5, linewidths=0)
    ax.set_aspect("equal", adjustable="datalim")
    if title:
        ax.set_title(title, fontsize="small")


def purity_table(displays):
    """Mean neighbour purity of each named KernelNeighborsDisplay."""
    return {name: float(np.mean(d.purity())) for name, d in displays.items()}
