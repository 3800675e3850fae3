"""What ``attribute`` costs next to ``decompose`` on a 10-class network (issue 24).

``attribute`` decomposes one scalar output per query, ``w_q . f(x_q)``; ``decompose``
all C = 10 outputs. The contracted route (``_decomposition.decompose(weights=...)``)
backpropagates the contracted output once per query capture and keeps one row per query
on the query side of every product, so it should cost about a single-output
decomposition. Measured on sklearn's digits with bench_attribution's MLP (64-64-10 tanh,
float32, the exact method to the default ``tol``), per solver: plain SGD (the factor
route), SGD with momentum and Adam (the adjoint route), and the dense route (forced, as
``second_order`` takes it). The reference for "a single-output decomposition" is the same
MLP with one output (trained on y / 9 with the squared loss, same solver and steps),
decomposed by ``decompose``. The three calls alternate in every repeat (the first call of
each is a warm-up, not counted), so load changes hit both alike; the ratio per repeat is
reported as median / min / max, with the load average before and after.

Run by ``python -m benchmarks --only attribute_cost [--quick]``.
"""

from __future__ import annotations

import time

import numpy as np

SIZES = {False: dict(n_train=1000, n_query=100, epochs=10, repeats=3),
         True: dict(n_train=200, n_query=20, epochs=2, repeats=3)}
SOLVERS = {
    "sgd (factor route)": dict(solver="sgd", learning_rate_init=0.5, momentum=0.0),
    "sgd momentum 0.9 (adjoint route)": dict(solver="sgd", learning_rate_init=0.1,
                                             momentum=0.9),
    "adam (adjoint route)": dict(solver="adam", learning_rate_init=0.005),
    "sgd (dense route, forced)": dict(solver="sgd", learning_rate_init=0.5, momentum=0.0),
}


def _load():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def run(quick: bool = False, only: str | None = None) -> list[dict]:
    """One row per solver (``only``: the solvers whose label contains it)."""
    global NOTES
    from sklearn.datasets import load_digits

    import skpathkernel._analysis._decomposition as interpolation
    from skpathkernel import PathKernelClassifier, PathKernelMachine

    size = SIZES[quick]
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    rng = np.random.RandomState(0)
    order = rng.permutation(len(X))
    train, query = order[: size["n_train"]], order[-size["n_query"]:]
    rows = []
    for label, solver in SOLVERS.items():
        if only is not None and only not in label:
            continue
        clf = PathKernelClassifier(
            hidden_layer_sizes=(64, 64), activation="tanh", alpha=0.0, batch_size=128,
            shuffle=True, loss="log_loss", tol=None, dtype="float32", random_state=0,
            max_iter=size["epochs"], **solver).fit(X[train], y[train])
        single = PathKernelMachine(
            hidden_layer_sizes=(64, 64), activation="tanh", alpha=0.0, batch_size=128,
            shuffle=True, normalize_y=False, tol=None, dtype="float32", random_state=0,
            max_iter=size["epochs"], **solver).fit(X[train], y[train] / 9.0)
        dense = "dense" in label
        original = interpolation._route
        if dense:
            interpolation._route = lambda traj, method: "dense"
        try:
            Xq, yq = X[query], y[query]
            calls = {"decompose": lambda clf=clf, Xq=Xq: clf.decompose(Xq),
                     "attribute": lambda clf=clf, Xq=Xq, yq=yq: clf.attribute(Xq, yq),
                     "single": lambda single=single, Xq=Xq: single.decompose(Xq)}
            times = {k: [] for k in calls}
            load_before = _load()
            for rep in range(size["repeats"] + 1):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if rep:  # the first of each is a warm-up
                        times[name].append(time.perf_counter() - start)
            load_after = _load()
        finally:
            interpolation._route = original
        ratio = np.array(times["decompose"]) / np.array(times["attribute"])
        vs_single = np.median(np.array(times["attribute"]) / np.array(times["single"]))
        rows.append({
            "solver": label, "steps": len(clf.trajectory_) - 1,
            "decompose (10 outputs)": f"{np.median(times['decompose']):.2f} s",
            "attribute": f"{np.median(times['attribute']):.2f} s",
            "decompose / attribute": f"{np.median(ratio):.1f} ({ratio.min():.1f}-"
                                     f"{ratio.max():.1f})",
            "decompose (1 output)": f"{np.median(times['single']):.2f} s",
            "attribute / 1-output": f"{vs_single:.2f}",
            "load before -> after": f"{load_before} -> {load_after}",
            "_times": times})
        print(f"attribute_cost: {label}: " + ", ".join(
            f"{k} {v}" for k, v in rows[-1].items() if k not in ("solver", "_times")),
            flush=True)
    NOTES = (f"{size['n_train']} training digits, {size['n_query']} queries, "
             f"{size['epochs']} epochs of batch 128, MLP 64-64-10 tanh in float32, "
             "method='exact' to the default tol; "
             f"{size['repeats']} interleaved repeats after a warm-up. Ratio = decompose time "
             "/ attribute time per repeat: median (min-max); decompose (1 output): the same "
             "MLP with one output, and attribute's time over it (median of the per-repeat "
             "ratios).")
    return rows


NOTES = ""
