"""The default estimator's path-kernel verbs on digits against their FLOP floors (issue 35).

``PathKernelClassifier(random_state=0)`` (Adam) and ``solver="sgd",
learning_rate_init=0.1`` (plain SGD: ``decompose``'s factor route) on 1000 standardised
digits, 100 queries; every call once (``time.process_time``, torch on the run's threads).
The floor counts the products a route cannot avoid, per recorded step ``t`` with batch
``B_t`` (all ``N`` training points with ``weighting="expected"``), ``Q`` queries, ``C``
outputs (1 for ``attribute`` / ``explain``: the contracted margin), layers of ``q = d_in +
1`` inputs and ``p = d_out`` units, ``P`` parameters:

- ``path_kernel_``: ``path_flops`` of ``_tangent/_stacked.py`` (halved where symmetric);
- plain SGD's ``decompose`` / ``attribute`` (the factor route): a path kernel between the
  queries' ``C`` outputs and the batch's loss gradients, ``2 Q B_t (q + C p)`` per hidden
  layer and ``2 Q B_t q`` for the one-hot output layer;
- Adam's (the adjoint route): the adjoint contracted with the batch's per-sample
  gradients, ``2 Q C P B_t``.

``method="exact"`` counts one quadrature node per step (a lower bound: steps take one to
a few). The forward and backward passes (``O((Q + B_t) P C)``) are not counted. Floor time
at the float64 rate for the adjoint route (its contraction accumulates in float64), else
at the float32 rate, of one 512 x 512 x 512 ``torch.matmul`` into a preallocated result (least
of 5), measured in the run.

Run by ``python -m benchmarks --only verbs_floor --threads 1``.
"""

from __future__ import annotations

import os
import time

import numpy as np

SIZES = {False: dict(n_train=1000, n_query=100), True: dict(n_train=300, n_query=20)}


def _layers(clf):
    from torch import nn

    lins = [m for m in clf.network_.module.modules() if isinstance(m, nn.Linear)]
    return [(m.in_features + (m.bias is not None), m.out_features) for m in lins]


def _pair_flops(layers, Q, B, C, route):
    """One step's pair products, ``B`` training rows (see the module docstring)."""
    if route == "adjoint":
        return 2.0 * Q * C * B * sum(q * p for q, p in layers)
    total = 0.0
    for li, (q, p) in enumerate(layers):
        total += 2.0 * Q * B * (q if li == len(layers) - 1 else q + C * p)
    return total


def _calls(clf, Xq, X, rates):
    """``(name, call, floor FLOPs, rate)`` of every call on the fitted ``clf``."""
    from skpathkernel._tangent._stacked import path_flops, stacked_mlp

    traj = clf.trajectory_
    layers, C, Q, N = _layers(clf), len(clf.classes_), len(Xq), len(X)
    sizes = np.array([len(b) for b in traj.batches])
    sgd = clf.solver == "sgd"
    route = "factor" if sgd else "adjoint"
    # The adjoint's contraction accumulates in float64 (_pairs.ACCUMULATE).
    pair_rate = rates["float32" if sgd else "float64"]
    module = clf.network_.module
    mlp = stacked_mlp(module, [n for n, _ in module.named_parameters()])
    T = traj.n_steps + 1

    def pairs(c, expected=False):
        return sum(_pair_flops(layers, Q, N if expected else b, c, route) for b in sizes)

    return [
        ("path_kernel_(Xq)", lambda: clf.path_kernel_(Xq),
         T * path_flops(mlp, Q, Q, C, not sgd, True), rates["float32"]),
        ("path_kernel_(Xq, X)", lambda: clf.path_kernel_(Xq, X),
         T * path_flops(mlp, Q, N, C, not sgd, False), rates["float32"]),
        ('decompose(Xq, method="first_order")',
         lambda: clf.decompose(Xq, method="first_order"), pairs(C), pair_rate),
        ('decompose(Xq, method="first_order", weighting="expected")',
         lambda: clf.decompose(Xq, method="first_order", weighting="expected"),
         pairs(C, True), pair_rate),
        ('attribute(Xq, method="first_order")',
         lambda: clf.attribute(Xq, method="first_order"), pairs(1), pair_rate),
        ('attribute(Xq, method="first_order", weighting="expected")',
         lambda: clf.attribute(Xq, method="first_order", weighting="expected"),
         pairs(1, True), pair_rate),
        ("attribute(Xq) (exact)", lambda: clf.attribute(Xq), pairs(1), pair_rate),
        ("explain(Xq)", lambda: clf.explain(Xq), pairs(1), pair_rate),
    ]


def run(quick: bool = False) -> list[dict]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from benchmarks.bench_interpolation import matmul_rate
    from skpathkernel import PathKernelClassifier

    size = SIZES[quick]
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)[: size["n_train"]].astype(np.float32)
    y = y[: size["n_train"]]
    Xq = X[: size["n_query"]]
    rates = {name: matmul_rate(512, dtype=getattr(torch, name), least=True)
             for name in ("float32", "float64")}
    only = os.environ.get("SKPATHKERNEL_BENCH_CALLS")
    rows = []
    for solver in ("sgd", "adam"):
        kw = dict(solver="sgd", learning_rate_init=0.1) if solver == "sgd" else {}
        clf = PathKernelClassifier(random_state=0, **kw).fit(X, y)
        for name, call, flops, rate in _calls(clf, Xq, X, rates):
            if only is not None and not any(k in name for k in only.split("|")):
                continue
            load = os.getloadavg()[0]
            start = time.process_time()
            call()
            t = time.process_time() - start
            floor = flops / rate
            rows.append({"solver": solver, "steps": clf.trajectory_.n_steps, "call": name,
                         "CPU time": f"{t:.2f} s", "floor GFLOP": f"{flops / 1e9:.2f}",
                         "floor time": f"{floor:.3g} s", "time / floor": f"{t / floor:.1f}",
                         "load at start": f"{load:.2f}", "_seconds": t, "_flops": flops})
            print("verbs_floor:", solver, name, f"{t:.2f} s, floor {floor:.3g} s", flush=True)
    global NOTES
    NOTES = (f"{len(X)} training digits, {len(Xq)} queries; GEMM rates "
             f"{rates['float32'] / 1e9:.0f} GFLOP/s (float32) and "
             f"{rates['float64'] / 1e9:.0f} GFLOP/s (float64), one 512^3 matmul, least of 5. "
             "SKPATHKERNEL_BENCH_CALLS (a |-separated list of substrings of the calls) runs "
             "part of the table.")
    return rows


NOTES = ""
