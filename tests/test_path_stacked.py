"""The path kernel over blocks of recorded points against a plain per-point autograd loop.

The reference forms every per-sample Jacobian row by ``torch.autograd.grad`` of one
output of one sample at one recorded point, scales it by that point's preconditioner and
weight, and sums ``J D J^T`` point by point: nothing of the engine's factors, routes,
blocks or panels.
"""

import copy
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest
import torch
from _reference import by_content
from numpy.testing import assert_allclose
from torch.func import functional_call

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._tangent import _stacked
from skpathkernel._tangent._stacked import _routes, stacked_mlp, stacked_path_sum
from skpathkernel.kernels import PathKernel, path_weights

RNG = np.random.RandomState(0)
X = RNG.randn(40, 4)
Y_CLS = RNG.randint(0, 3, 40)
Y_REG = np.sin(X[:, 0])


def _jacobian(module, params, x):
    """(n, C, P) per-sample Jacobians, one autograd call per sample and output."""
    names = list(params)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    rows = []
    for i in range(x.shape[0]):
        out = functional_call(module, leaves, (x[i : i + 1],))[0]
        per_output = []
        for c in range(out.shape[0]):
            grads = torch.autograd.grad(out[c], [leaves[k] for k in names], retain_graph=True)
            per_output.append(torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_output))
    return torch.stack(rows)


def _reference(est, A, B=None, start=0, stop=None, output="trace"):
    """sum_k w_k J_k(A) D_k J_k(B)^T, point by point."""
    net = est.network_
    traj = net.trajectory
    A = torch.as_tensor(A, dtype=torch.float64)
    B = A if B is None else torch.as_tensor(B, dtype=torch.float64)
    K = 0.0
    for k, w in path_weights(traj, start, stop):
        params = {name: p.double() for name, p in net.params_at(k).items()}
        ja, jb = (by_content(_jacobian, net.module, params, Z) for Z in (A, B))
        D = traj.preconditioner(min(k, len(traj) - 2))
        D = torch.ones(ja.shape[2], dtype=torch.float64) if D is None else D.double()
        if output == "full":
            K = K + w * torch.einsum("ncp,p,mdp->nmcd", ja, D, jb)
            continue
        if output != "trace":
            ja, jb = ja[:, output : output + 1], jb[:, output : output + 1]
        C = ja.shape[1]
        K = K + w * torch.einsum("ncp,p,mcp->nm", ja, D, jb) / C
    return K.numpy()


SOLVERS = [dict(solver="sgd", learning_rate_init=0.1),
           dict(solver="sgd", learning_rate_init=0.05, momentum=0.9),
           dict(solver="adam", learning_rate_init=0.01),
           dict(solver="rmsprop", learning_rate_init=0.01)]


def _fit(cls, solver, **kw):
    y = Y_CLS if cls is PathKernelClassifier else Y_REG
    return cls(hidden_layer_sizes=(6, 5), activation="tanh", max_iter=7, batch_size=16,
               tol=None, dtype="float64", random_state=0, **solver, **kw).fit(X, y)


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s["solver"] + str(s.get("momentum", "")))
@pytest.mark.parametrize("cls", [PathKernelClassifier, PathKernelMachine])
def test_path_kernel_matches_per_point_loop(cls, solver):
    # Three classes: several outputs ("units" route for a preconditioner); the regressor
    # has one output ("dense" route).
    est = _fit(cls, solver)
    assert stacked_mlp(est.network_.module, est.trajectory_.names) is not None
    ref = _reference(est, X[:9])
    assert_allclose(PathKernel(est)(X[:9]), ref, rtol=1e-10, atol=1e-13)
    cross = _reference(est, X[:5], X[20:31])
    assert_allclose(PathKernel(est)(X[:5], X[20:31]), cross, rtol=1e-10, atol=1e-13)
    assert_allclose(PathKernel(est).diag(X[20:31]), np.diag(_reference(est, X[20:31])),
                    rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("solver", SOLVERS[::2], ids=lambda s: s["solver"])
def test_thinned_range_and_single_output(solver):
    est = _fit(PathKernelClassifier, solver, record_every=3)
    assert len(est.trajectory_) < est.trajectory_.n_steps
    assert_allclose(PathKernel(est, start=1, stop=-1, output=2)(X[:6]),
                    _reference(est, X[:6], start=1, stop=-1, output=2), rtol=1e-10, atol=1e-13)
    K = PathKernel(est, normalized=True)(X[:6])
    ref = _reference(est, X[:6])
    d = np.sqrt(np.diag(ref))
    assert_allclose(K, ref / d[:, None] / d[None, :], rtol=1e-10, atol=1e-13)


def _stacked_inputs(est):
    """The fitted network's stacked layers, its parameters' layout in the trajectory's
    flat vector, ``load`` of the recorded points and whether they carry a D."""
    traj = est.trajectory_
    layout, start = {}, 0
    for name, shape in zip(traj.names, traj.shapes):
        layout[name] = (start, int(np.prod(shape)))
        start += layout[name][1]
    weighted = traj.solver_spec.name != "sgd"

    def load(points):
        theta = torch.stack([traj.parameters(k) for k in points])
        if not weighted:
            return theta, None
        return theta, torch.stack([traj.preconditioner(min(k, len(traj) - 2)) for k in points])

    return stacked_mlp(est.network_.module, traj.names), layout, load, weighted


@pytest.mark.parametrize("solver", SOLVERS[::2], ids=lambda s: s["solver"])
@pytest.mark.parametrize("block,panel", [(1, 4), (8, 5), (4, 256), (5, 3)])
def test_blocks_and_panels_that_do_not_divide(solver, block, panel):
    """Blocks of points and Gram panels of sizes that leave a remainder."""
    est = _fit(PathKernelClassifier, solver)
    weights = path_weights(est.trajectory_)
    assert len(weights) % block or block == 1
    mlp, layout, load, weighted = _stacked_inputs(est)
    A, B = torch.as_tensor(X[:11]), torch.as_tensor(X[11:18])
    K, dx, dy = stacked_path_sum(mlp, layout, load, weights, A, outputs=[0, 1, 2],
                                 trace_scale=1 / 3, weighted=weighted, memory_budget=2**30,
                                 diag=True, block=block, panel=panel)
    ref = _reference(est, X[:11])
    assert_allclose(K.numpy(), ref, rtol=1e-10, atol=1e-13)
    assert np.array_equal(K.numpy(), K.numpy().T)
    assert_allclose(dx.numpy(), np.diag(ref), rtol=1e-10, atol=1e-13)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, B, outputs=[1],
                               weighted=weighted, memory_budget=2**30, block=block, panel=panel)
    assert_allclose(K.numpy(), _reference(est, X[:11], X[11:18], output=1), rtol=1e-10,
                    atol=1e-13)


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s["solver"] + str(s.get("momentum", "")))
@pytest.mark.parametrize("block,panel,units", [(None, None, None), (8, 5, 4), (5, 3, 1)])
def test_full_blocks_over_blocks_of_points(solver, block, panel, units, monkeypatch):
    """output="full": rank-one blocks (SGD) and units (Adam, RMSprop), with blocks of
    points, panels and chunks of units that leave a remainder."""
    if units is not None:
        monkeypatch.setattr(_stacked, "_FULL_CHUNK", units)
    budget = 2**30
    est = _fit(PathKernelClassifier, solver)
    traj = est.trajectory_
    mlp, layout, load, weighted = _stacked_inputs(est)
    A, B = torch.as_tensor(X[:11]), torch.as_tensor(X[11:18])
    kw = dict(outputs=[0, 1, 2], weighted=weighted, memory_budget=budget, block=block,
              panel=panel, full=True)
    K, _, _ = stacked_path_sum(mlp, layout, load, path_weights(traj), A, **kw)
    assert K.shape == (11, 11, 3, 3)
    assert_allclose(K.numpy(), _reference(est, X[:11], output="full"), rtol=1e-10,
                    atol=1e-13)
    assert np.array_equal(K.numpy(), K.numpy().transpose(1, 0, 3, 2))
    K, _, _ = stacked_path_sum(mlp, layout, load, path_weights(traj), A, B, **kw)
    assert_allclose(K.numpy(), _reference(est, X[:11], X[11:18], output="full"), rtol=1e-10,
                    atol=1e-13)


def test_path_kernel_full_takes_the_stacked_route(monkeypatch):
    from skpathkernel import kernels

    est = _fit(PathKernelClassifier, SOLVERS[2])
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["full"])
        return stacked_path_sum(*args, **kwargs)

    monkeypatch.setattr(kernels, "stacked_path_sum", spy)
    K = PathKernel(est, output="full")(X[:6], X[30:34])
    assert calls == [True]
    assert_allclose(K, _reference(est, X[:6], X[30:34], output="full"), rtol=1e-10,
                    atol=1e-13)
    # The diagonal blocks alone: the step-by-step sum.
    d = PathKernel(est, output="full").diag(X[:6])
    assert calls == [True]
    assert_allclose(d, np.einsum("iicd->icd", _reference(est, X[:6], output="full")),
                    rtol=1e-10, atol=1e-13)


def test_float32_equals_step_by_step_to_rounding():
    est = PathKernelClassifier(hidden_layer_sizes=(16, 16), max_iter=10, batch_size=16,
                               tol=None, random_state=0).fit(X, Y_CLS)
    assert est.trajectory_.dtype == torch.float32
    ref = _reference(est, X[:12])
    K = PathKernel(est)(X[:12])
    assert K.dtype == np.float64
    assert np.abs(K - ref).max() <= 1e-5 * np.abs(ref).max()


def test_other_modules_take_the_general_route():
    """A module that is not a plain Sequential MLP (here: a forward hook that changes the
    output) is not rebuilt from its layers: the kernel is the module's own."""
    est = _fit(PathKernelMachine, SOLVERS[2])
    plain = PathKernel(est)(X[:6])
    handle = est.network_.module[0].register_forward_hook(lambda m, i, o: 2 * o)
    try:
        assert stacked_mlp(est.network_.module, est.trajectory_.names) is None
        hooked = PathKernel(est)(X[:6])
    finally:
        handle.remove()
    assert not np.allclose(hooked, plain)
    # The hook doubles the first layer's output: its own gradients double, and every
    # backprop through it as well (tanh' changes too), so compare with autograd directly.
    handle = est.network_.module[0].register_forward_hook(lambda m, i, o: 2 * o)
    try:
        assert_allclose(hooked, _reference(est, X[:6]), rtol=1e-10, atol=1e-13)
    finally:
        handle.remove()


def test_kneighbors_path_matches_the_reference():
    est = _fit(PathKernelClassifier, SOLVERS[2])
    Q = X[:4]
    K = _reference(est, Q, X)
    dq = np.array([_reference(est, Q[i : i + 1])[0, 0] for i in range(len(Q))])
    dt = np.diag(_reference(est, X))
    for normalized in (True, False):
        dist, ind = est.kneighbors(Q, n_neighbors=5, kernel="path", normalized=normalized)
        if normalized:
            sq = 2 - 2 * np.clip(K / np.sqrt(dq[:, None] * dt[None, :]), -1, 1)
        else:
            sq = dq[:, None] + dt[None, :] - 2 * K
        ref = np.sqrt(np.maximum(sq, 0))
        # A query is its own nearest point: the square root of a round-off of 1e-15.
        assert_allclose(dist, np.take_along_axis(ref, ind, axis=1), rtol=1e-8, atol=1e-6)
        assert_allclose(dist, np.sort(ref, axis=1)[:, :5], rtol=1e-8, atol=1e-6)
        assert np.array_equal(ind[:, 0], np.arange(len(Q)))


def test_explain_ranks_the_margin_and_all_outputs_on_request():
    est = _fit(PathKernelClassifier, SOLVERS[0])
    Q = X[:3]
    idx, contrib = est.explain(Q, n_neighbors=4)
    scores = est.attribute(Q)  # the predicted class's margin
    assert contrib.shape == (3, 4, 1)
    for q in range(3):
        ranked = np.argsort(-np.abs(scores[q]), kind="stable")[:4]
        assert np.array_equal(idx[q], ranked)
        assert_allclose(contrib[q, :, 0], scores[q, ranked])
    idx, contrib = est.explain(Q, n_neighbors=4, output="all")
    full = est.decompose(Q).contributions
    assert contrib.shape == (3, 4, 3)
    ranked = np.argsort(-np.abs(full).sum(2), axis=1, kind="stable")[:, :4]
    assert np.array_equal(idx, ranked)
    idx1, contrib1 = est.explain(Q, n_neighbors=4, output=1)
    assert_allclose(contrib1[:, :, 0], np.take_along_axis(full[:, :, 1], idx1, axis=1),
                    rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="'unrolled'"):
        est.explain(Q, method="unrolled")


def _module_reference(module, thetas, Ds, weights, A, B, outputs, full=False):
    """sum_k w_k J_k(A) D_k J_k(B)^T / C with the module's own autograd, point by point
    (``full``: the (n, m, C, C) blocks, not divided by C)."""
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for _, p in module.named_parameters()]
    K = 0.0
    for theta, D, w in zip(thetas, Ds, weights):
        params, s = {}, 0
        for name, shape in zip(names, shapes):
            params[name] = theta[s : s + shape.numel()].view(shape)
            s += shape.numel()
        ja = by_content(_jacobian, module, params, A)[:, outputs]
        jb = by_content(_jacobian, module, params, B)[:, outputs]
        if full:
            K = K + w * torch.einsum("ncp,p,mdp->nmcd", ja, D, jb)
        else:
            K = K + w * torch.einsum("ncp,p,mcp->nm", ja, D, jb) / len(outputs)
    return K


def _path_and_inputs(layers, weighted):
    """:func:`_random_path`, then 40 and 20 random inputs ``A`` and ``B`` and the points'
    weights ``ws`` alone."""
    path = _random_path(layers, weighted)
    A = torch.randn(40, 3, dtype=torch.float64)
    B = torch.randn(20, 3, dtype=torch.float64)
    return (*path, A, B, [w for _, w in path[5]])


def _random_path(layers, weighted):
    """A float64 Sequential of ``layers``, five random points with their D and weights,
    and the stacked route's ``layout`` and ``load``."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*layers()).double()
    names = [n for n, _ in module.named_parameters()]
    mlp = stacked_mlp(module, names)
    assert mlp is not None
    P = sum(p.numel() for p in module.parameters())
    layout, s = {}, 0
    for name, p in module.named_parameters():
        layout[name] = (s, p.numel())
        s += p.numel()
    thetas = torch.randn(5, P, dtype=torch.float64)
    Ds = (torch.rand(5, P, dtype=torch.float64) + 0.1 if weighted
          else torch.ones(5, P, dtype=torch.float64))
    weights = [(k, 0.1 * (k + 1)) for k in range(5)]

    def load(points):
        return thetas[points], (Ds[points] if weighted else None)

    return module, mlp, layout, thetas, Ds, weights, load


LAYERS = [
    # An activation after the output layer: no one-hot backprops.
    lambda: [torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Sigmoid()],
    # Two Linears in a row, one without a bias, below the output layer.
    lambda: [torch.nn.Linear(3, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5, bias=False),
             torch.nn.Linear(5, 4)],
    # A single Linear: the output layer alone.
    lambda: [torch.nn.Linear(3, 4)],
    # The output layer right above the first: the merged layer is the first one.
    lambda: [torch.nn.Linear(3, 7), torch.nn.GELU(), torch.nn.Linear(7, 4, bias=False)],
    # Three hidden layers: a backprop written by a GEMM carried through another Linear.
    lambda: [torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6), torch.nn.GELU(),
             torch.nn.Linear(6, 5), torch.nn.SiLU(), torch.nn.Linear(5, 4)],
]
LAYER_IDS = ["sigmoid-out", "linear-linear", "single", "two-layers", "three-hidden"]


@pytest.mark.parametrize("layers", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
@pytest.mark.parametrize("outputs", [[0, 1, 2, 3], [2]], ids=["trace", "one"])
def test_every_layout_of_plain_mlp_matches_autograd(layers, weighted, outputs, monkeypatch):
    """Output layers with and without one-hot backprops, the layer below them, layers
    without a bias, and every route (units, dense, rank1), against the module's own
    autograd Jacobians; strips and panels of several sizes, and a symmetric Gram's
    strips to its last column (``panel=None``) with the dense layers' own strips of 16
    rows, which leave a remainder of 8, their squares on the diagonal halved down to 3
    rows (16 -> 8 -> 4 -> 2 + 2, 8 -> 4 -> 2 + 2)."""
    monkeypatch.setattr(_stacked, "_DENSE_STRIP", 16)
    monkeypatch.setattr(_stacked, "_DENSE_LEAF", 3)
    # 40 x 20: wide enough panels for the dense route of one-output layers.
    module, mlp, layout, thetas, Ds, weights, load, A, B, ws = _path_and_inputs(layers,
                                                                              weighted)
    ref = _module_reference(module, thetas, Ds, ws, A, A, outputs)
    cross = _module_reference(module, thetas, Ds, ws, A, B, outputs)
    if weighted and outputs == [2] and len(mlp.linears) > 1:
        assert "dense" in _routes(mlp, 1, True, 40, 20)
    strips = []
    real_strips = _stacked._dense_strips
    monkeypatch.setattr(_stacked, "_dense_strips",
                        lambda *a, **k: strips.append(1) or real_strips(*a, **k))
    for block, panel in [(2, 4), (5, 256), (1, 5), (3, None)]:
        strips.clear()
        K, dx, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=outputs,
                                    trace_scale=1 / len(outputs), weighted=weighted,
                                    memory_budget=2**30, diag=True, block=block,
                                    panel=panel)
        # The dense layers of a symmetric Gram's whole strips run in their own strips.
        dense = "dense" in _routes(mlp, len(outputs), weighted, 40, 40)
        assert bool(strips) == (panel is None and dense)
        assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
        assert np.array_equal(K.numpy(), K.numpy().T)
        assert_allclose(dx.numpy(), np.diag(ref.numpy()), rtol=1e-10, atol=1e-13)
        K, dx, dy = stacked_path_sum(mlp, layout, load, weights, A, B, outputs=outputs,
                                     trace_scale=1 / len(outputs), weighted=weighted,
                                     memory_budget=2**30, diag=True, block=block,
                                     panel=panel)
        assert_allclose(K.numpy(), cross.numpy(), rtol=1e-10, atol=1e-13)
        assert_allclose(dy.numpy(), np.diag(_module_reference(
            module, thetas, Ds, ws, B, B, outputs).numpy()), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("layers", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
@pytest.mark.parametrize("outputs", [[0, 1, 2, 3], [3, 1]], ids=["all", "two"])
def test_full_blocks_of_every_layout_match_autograd(layers, weighted, outputs, monkeypatch):
    """full=True with every output's backprop in every layer (no one-hot collapse), on
    symmetric Grams cut in strips thinner than the panels (16 rows in 256- and 20-wide
    panels, mirrored square by square) and in square panels, chunks of units that leave
    a remainder; exactly symmetric blocks."""
    monkeypatch.setattr(_stacked, "_FULL_CHUNK", 3)
    module, mlp, layout, thetas, Ds, weights, load, A, B, ws = _path_and_inputs(layers,
                                                                              weighted)
    ref = _module_reference(module, thetas, Ds, ws, A, A, outputs, full=True).numpy()
    cross = _module_reference(module, thetas, Ds, ws, A, B, outputs, full=True).numpy()
    kw = dict(outputs=outputs, weighted=weighted, memory_budget=2**30, full=True)
    for block, panel in [(2, 4), (5, 256), (3, 20)]:
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, block=block, panel=panel,
                                   **kw)
        assert K.shape == (40, 40, len(outputs), len(outputs))
        assert_allclose(K.numpy(), ref, rtol=1e-10, atol=1e-13)
        assert np.array_equal(K.numpy(), K.numpy().transpose(1, 0, 3, 2))
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, B, block=block,
                                   panel=panel, **kw)
        assert_allclose(K.numpy(), cross, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="no diagonal blocks"):
        stacked_path_sum(mlp, layout, load, weights, A, diag=True, **kw)


def _spy_panels(monkeypatch):
    """The list that every later call's panels, (rows, cols) slices, are appended to."""
    panels, real = [], _stacked._panels
    monkeypatch.setattr(_stacked, "_panels",
                        lambda *a: panels.append(list(real(*a))) or panels[-1])
    return panels


@pytest.mark.parametrize("layers", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
def test_launch_bound_tiling_matches_autograd(layers, weighted, monkeypatch):
    """The GPU's tiling (:func:`_launch_bound`), run on the CPU: whole panels, strips of
    a quarter of the rows, chunks bounded by the budget alone; the same sums as the
    module's autograd. With the CPU's panels and cache shrunk to 8 rows and 1 byte (one
    unit per chunk, 15 panels on the cross Gram), the launch-bound tiling still takes
    one panel per strip and every unit of a layer in one chunk; a small budget bounds
    its panels."""
    monkeypatch.setattr(_stacked, "_launch_bound", lambda device: True)
    monkeypatch.setattr(_stacked, "_PANEL", 8)
    monkeypatch.setattr(_stacked, "_CACHE", 1)
    module, mlp, layout, thetas, Ds, weights, load, A, B, ws = _path_and_inputs(layers,
                                                                              weighted)
    outputs = [0, 1, 2, 3]
    panels, chunks = _spy_panels(monkeypatch), []
    real_contract = _stacked._contract_panel
    monkeypatch.setattr(_stacked, "_contract_panel",
                        lambda *a: chunks.append(a[6]) or real_contract(*a))
    kw = dict(outputs=outputs, trace_scale=1 / 4, weighted=weighted, memory_budget=2**30,
              block=len(weights))
    K, dx, _ = stacked_path_sum(mlp, layout, load, weights, A, diag=True, **kw)
    assert_allclose(K.numpy(), _module_reference(module, thetas, Ds, ws, A, A, outputs),
                    rtol=1e-10, atol=1e-13)
    assert np.array_equal(K.numpy(), K.numpy().T)
    assert_allclose(dx.numpy(), np.diag(K.numpy()), rtol=1e-10, atol=1e-13)
    assert [(r.stop - r.start, c.stop - c.start) for r, c in panels[-1]] == [
        (16, 40), (16, 24), (8, 8)]
    assert chunks and min(c[0] for c in chunks) >= max(lin.d_out for lin in mlp.linears)
    cross = _module_reference(module, thetas, Ds, ws, A, B, outputs)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, B, **kw)
    assert_allclose(K.numpy(), cross, rtol=1e-10, atol=1e-13)
    assert [(r.stop - r.start, c.stop - c.start) for r, c in panels[-1]] == [(40, 20)]
    # A budget whose sixteenth holds 170 float64 products a point: panels of 13.
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, B, **{**kw, "block": 1,
                                                                    "memory_budget": 2**16})
    assert_allclose(K.numpy(), cross, rtol=1e-10, atol=1e-13)
    assert {(r.stop - r.start, c.stop - c.start) for r, c in panels[-1]} == {
        (13, 13), (13, 7), (1, 13), (1, 7)}
    kw.update(full=True, trace_scale=1.0)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, **kw)
    assert_allclose(K.numpy(), _module_reference(module, thetas, Ds, ws, A, A, outputs,
                                                 full=True), rtol=1e-10, atol=1e-13)


def test_launch_bound_strips_and_fallback_to_the_cpu_tiling(monkeypatch):
    """On a symmetric Gram of 300 rows the GPU's strips are 75 rows (the CPU's 64), with
    the same sums; where one point of the GPU's tiling exceeds the budget but the CPU's
    fits, the CPU's is taken (not None, the step-by-step sum)."""
    monkeypatch.setattr(_stacked, "_launch_bound", lambda device: True)
    module, mlp, layout, thetas, Ds, weights, load = _random_path(LAYERS[2], False)
    A = torch.randn(300, 3, dtype=torch.float64)
    panels = _spy_panels(monkeypatch)
    kw = dict(outputs=[0, 1, 2, 3], trace_scale=1 / 4, weighted=False)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, memory_budget=2**30, **kw)
    ref = _module_reference(module, thetas, Ds, [w for _, w in weights], A, A, [0, 1, 2, 3])
    assert_allclose(K.numpy(), ref, rtol=1e-10, atol=1e-13)
    assert [r.stop - r.start for r, _ in panels[-1]] == [75] * 4
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, memory_budget=2**30,
                               launch_bound=False, **kw)
    assert [r.stop - r.start for r, _ in panels[-1]] == [64] * 4 + [44]
    # A budget that one point of the CPU's tiling fits and the GPU's does not (its panels
    # allowed the whole budget, so that its strips stay 75 rows there).
    monkeypatch.setattr(_stacked, "_GPU_SHARE", 1)
    sizes = {}
    real_rows = _stacked.rows_per_block
    monkeypatch.setattr(_stacked, "rows_per_block",
                        lambda budget, per_point, what: sizes.setdefault("cpu", per_point)
                        and real_rows(budget, per_point, what))
    stacked_path_sum(mlp, layout, load, weights, A, memory_budget=2**30, launch_bound=False,
                     **kw)
    budget = sizes["cpu"] + 8
    calls = []
    real_sum = _stacked.stacked_path_sum
    monkeypatch.setattr(_stacked, "stacked_path_sum",
                        lambda *a, **k: calls.append(k["launch_bound"]) or real_sum(*a, **k))
    K, _, _ = real_sum(mlp, layout, load, weights, A, memory_budget=budget, **kw)
    assert calls == [False]  # the GPU's tiling did not fit: the CPU's, once
    assert [r.stop - r.start for r, _ in panels[-1]] == [64] * 4 + [44]
    assert_allclose(K.numpy(), ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-tiling"])
@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
def test_tiles_of_rows_where_one_point_of_all_rows_exceeds_the_budget(weighted, gpu,
                                                                     monkeypatch):
    """Where one point's block over all the rows of X and Y exceeds the budget, the sum
    of tiles of them (the larger side halved until a point's block fits): the same Gram,
    diagonals and C x C blocks as the module's autograd. The route gave up there before
    (None), and the step-by-step sum ran, 10 to 70 times slower: the default Adam
    classifier's K(200 x 256) at 4 MiB took 44 s, 0.6 s at 8 MiB. With the GPU's tiling
    (the device's choice, as a CUDA input makes it), whose fallback to the CPU's wrote
    each tile to a new tensor, not the Gram's: all zeros (found by review)."""
    if gpu:
        monkeypatch.setattr(_stacked, "_launch_bound", lambda device: True)
    module, mlp, layout, thetas, Ds, weights, load = _random_path(LAYERS[4], weighted)
    A = torch.randn(24, 3, dtype=torch.float64)
    B = torch.randn(9, 3, dtype=torch.float64)
    sizes = []
    real_rows = _stacked.rows_per_block
    monkeypatch.setattr(_stacked, "rows_per_block",
                        lambda budget, per_point, what: sizes.append(per_point)
                        or real_rows(budget, per_point, what))
    kw = dict(outputs=[0, 1, 2, 3], weighted=weighted, launch_bound=None if gpu else False)
    stacked_path_sum(mlp, layout, load, weights, A, B, memory_budget=2**30,
                     trace_scale=1 / 4, **kw)
    budget = sizes[-1] // 2  # half of one point's block over the 33 rows
    # Every block of both sets of rows, from one loop over them: (33, 33, C, C).
    full = _module_reference(module, thetas, Ds, [w for _, w in weights], torch.cat([A, B]),
                             torch.cat([A, B]), kw["outputs"], full=True).numpy()
    trace = np.einsum("nmcc->nm", full) / 4
    a, b = slice(0, 24), slice(24, 33)
    for Y, cols in ((B, b), (None, a)):
        sizes.clear()
        K, dx, dy = stacked_path_sum(mlp, layout, load, weights, A, Y, memory_budget=budget,
                                     trace_scale=1 / 4, diag=True, **kw)
        assert len(sizes) > 2  # in tiles, each a point's block within the budget
        assert_allclose(K.numpy(), trace[a, cols], rtol=1e-10, atol=1e-13)
        assert_allclose(dx.numpy(), np.diag(trace)[a], rtol=1e-10, atol=1e-13)
        assert_allclose(dy.numpy(), np.diag(trace)[cols], rtol=1e-10, atol=1e-13)
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, Y, memory_budget=budget,
                                   full=True, **kw)
        assert_allclose(K.numpy(), full[a, cols], rtol=1e-10, atol=1e-13)


def test_launch_bound_strips_and_panels_at_size():
    """The GPU's strips and panels where the CPU's would be 64 rows and 256 columns."""
    assert _stacked._strip(1000, 1000, launch_bound=True) == 250
    assert _stacked._strip(20000, 2048, launch_bound=True) == 512
    assert _stacked._strip(1000, 256) == 64
    assert _stacked._launch_bound(torch.device("cpu")) is False
    assert _stacked._launch_bound(torch.device("cuda")) is True


def test_routes_by_cost():
    """The cost model's choices for the default classifier's layers (64-64-10, ten
    outputs): several backprops take the units route, the one backprop below the
    output layer the units route at N = 100 and the dense one (its gradients formed
    once for the whole Gram) at N = 1000, SGD rank1; the output layer is one-hot."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                 torch.nn.Linear(64, 64), torch.nn.GELU(),
                                 torch.nn.Linear(64, 10))
    mlp = stacked_mlp(module, [n for n, _ in module.named_parameters()])
    assert _routes(mlp, 10, True, 100, 100) == ["units", "units", "onehot"]
    assert _routes(mlp, 10, True, 1000, 1000) == ["units", "dense", "onehot"]
    assert _routes(mlp, 10, False, 100, 100) == ["rank1", "rank1", "onehot"]


@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
def test_dead_output_column_and_negative_weight_match_autograd(weighted):
    """A hidden unit that no output reads (a zero column of the output layer's weights,
    whose output rows' products the full blocks then take as 0) and a negative weight
    (the dense route's gradients then scaled on one side only, not by sqrt(w D) on
    both), against the module's own autograd Jacobians; the dense route is taken."""
    module, mlp, layout, thetas, Ds, weights, load = _random_path(LAYERS[3], weighted)
    s, size = layout["2.weight"]
    thetas[:, s : s + size].view(5, 4, 7)[:, :, 2] = 0
    weights = [(k, -w if k == 1 else w) for k, w in weights]
    ws = [w for _, w in weights]
    A = torch.randn(40, 3, dtype=torch.float64)
    if weighted:
        assert _routes(mlp, 1, True, 40, 40)[0] == "dense"
    ref = _module_reference(module, thetas, Ds, ws, A, A, [2])
    for panel in [16, None]:
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=[2],
                                   weighted=weighted, memory_budget=2**30, block=2,
                                   panel=panel)
        assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
        assert np.array_equal(K.numpy(), K.numpy().T)
    outputs = [0, 1, 2, 3]
    ref = _module_reference(module, thetas, Ds, ws, A, A, outputs, full=True).numpy()
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=outputs,
                               weighted=weighted, memory_budget=2**30, block=2, panel=16,
                               full=True)
    assert _routes(mlp, 4, weighted, 40, 40, full=True) == ["mixed", "onehot"]
    assert_allclose(K.numpy(), ref, rtol=1e-10, atol=1e-13)
    assert np.array_equal(K.numpy(), K.numpy().transpose(1, 0, 3, 2))


def test_forward_factors_against_per_point_modules():
    # The one forward both the Gram blocks (_factors) and the decomposition's stacked
    # capture read: outputs, layer inputs and activation derivatives of every point,
    # against the module itself at each point and autograd's elementwise derivative.
    from skpathkernel._analysis._decomposition import _StackedCapture

    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.GELU(), torch.nn.Linear(5, 4),
                                 torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    names = [n for n, _ in module.named_parameters()]
    mlp = stacked_mlp(module, names)
    layout, start = {}, 0
    for n, p in module.named_parameters():
        layout[n] = (start, p.numel())
        start += p.numel()
    theta = torch.randn(3, start, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)
    out, params, inputs, derivs = _stacked.forward_factors(mlp, theta, layout, x)
    assert [d is None for d in derivs] == [True, False, True, False, True]
    assert inputs[0].shape == (1, 6, 3)  # shared by the points
    for b in range(3):
        p = dict(zip(names, (theta[b, s : s + k].view_as(dict(module.named_parameters())[n])
                             for n, (s, k) in layout.items())))
        seen = {}
        hooks = [module[i].register_forward_hook(
            lambda m, a, o, i=i, seen=seen: seen.__setitem__(i, (a[0], o))) for i in range(5)]
        try:
            ref = functional_call(module, p, (x,))
        finally:
            for h in hooks:
                h.remove()
        assert_allclose(out[b].numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)
        for a, i in zip(inputs, (0, 2, 4)):
            assert_allclose(a[min(b, a.shape[0] - 1)].numpy(), seen[i][0].numpy(), rtol=1e-12)
        for i in (1, 3):
            z = seen[i][0].detach().requires_grad_(True)
            (d,) = torch.autograd.grad(module[i](z).sum(), z)
            assert_allclose(derivs[i][b].numpy(), d.numpy(), rtol=1e-12, atol=1e-15)
    # The decomposition's stacked capture reads that same forward.
    cap = _StackedCapture(mlp, layout)
    h, (p2, acts, d2) = cap.forward(theta, x)
    assert torch.equal(h, out)
    assert all(torch.equal(u, v) for u, v in zip(acts, inputs))


@pytest.fixture
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_syrk_updates_the_upper_triangle_only(dtype, one_torch_thread):
    """The BLAS SYRK behind the dense layers' strips on the CPU: on a row-major ``acc``
    whose both triangles hold values, it adds ``g g^T`` on and above the diagonal and
    leaves the strict lower triangle as it was (a swapped ``lower`` or ``trans`` would
    write the other triangle or ``g^T g``), against numpy's product."""
    rng = np.random.default_rng(0)
    acc0 = rng.standard_normal((37, 37))
    g = rng.standard_normal((37, 23))
    acc = torch.tensor(acc0, dtype=dtype)
    # Only a thread that holds the BLAS limit takes SciPy's products.
    assert _stacked._syrk(acc) is None
    with _stacked._blas_threads(1):
        update = _stacked._syrk(acc)
        assert update is not None
        update(torch.tensor(g, dtype=dtype))
    got = acc.double().numpy()
    want = acc0 + g @ g.T
    upper = np.triu_indices(37)
    lower = np.tril_indices(37, -1)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    assert_allclose(got[upper], want[upper], rtol=rtol, atol=rtol)
    assert_allclose(got[lower], acc0.astype(np.float32 if dtype == torch.float32
                                            else np.float64)[lower], rtol=0, atol=0)
    # CUDA tensors, other dtypes and several torch threads keep torch's products.
    assert _stacked._syrk(acc.to(torch.float16)) is None
    torch.set_num_threads(2)
    with _stacked._blas_threads(1):
        assert _stacked._syrk(acc) is None and _stacked._cpu_gemm(acc) is None


@pytest.mark.parametrize("layers", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("outputs", [[0, 1, 2, 3], [2]], ids=["trace", "one"])
def test_scipy_blas_route_matches_autograd(layers, outputs, monkeypatch, one_torch_thread):
    """On one torch thread the preconditioned kernel's "units" products and the dense
    layers' Grams go through SciPy's BLAS (GEMM per unit, SYRK of one triangle): taken
    here on every panel (``_BLAS_MIN`` 1), against the module's own autograd Jacobians,
    float64 and float32, with the BLAS libraries' thread limits restored after."""
    from threadpoolctl import threadpool_info

    module, mlp, layout, thetas, Ds, weights, load = _random_path(layers, True)
    A = torch.randn(40, 3, dtype=torch.float64)
    ws = [w for _, w in weights]
    ref = _module_reference(module, thetas, Ds, ws, A, A, outputs).numpy()
    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1)
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    calls = {"gemm": 0, "syrk": 0}
    real_gemm, real_syrk = _stacked._cpu_gemm, _stacked._syrk

    def gemm(t):
        f = real_gemm(t)
        return None if f is None else (
            lambda *a, **k: calls.__setitem__("gemm", calls["gemm"] + 1) or f(*a, **k))

    def syrk(acc):
        f = real_syrk(acc)
        return None if f is None else (
            lambda g: calls.__setitem__("syrk", calls["syrk"] + 1) or f(g))

    monkeypatch.setattr(_stacked, "_cpu_gemm", gemm)
    monkeypatch.setattr(_stacked, "_syrk", syrk)
    before = [(i["filepath"], i["num_threads"]) for i in threadpool_info()]
    routes = _routes(mlp, len(outputs), True, 40, 40)
    for dtype, rtol in [(torch.float64, 1e-10), (torch.float32, 2e-4)]:
        calls.update(gemm=0, syrk=0)

        def load_as(points, dtype=dtype):
            theta, D = load(points)
            return theta.to(dtype), D.to(dtype)

        K, _, _ = stacked_path_sum(mlp, layout, load_as, weights, A.to(dtype),
                                   outputs=outputs, trace_scale=1 / len(outputs),
                                   weighted=True, memory_budget=2**30, block=2)
        assert (calls["gemm"] > 0) == ("units" in routes)
        assert (calls["syrk"] > 0) == ("dense" in routes)
        assert_allclose(K.numpy(), ref, rtol=rtol, atol=rtol * np.abs(ref).max())
        assert np.array_equal(K.numpy(), K.numpy().T)
    # The full blocks: the "mixed" layer's one backprop scales the rows (C = 1) before
    # the GEMM of its units.
    full = _module_reference(module, thetas, Ds, ws, A, A, outputs, full=True).numpy()
    calls.update(gemm=0)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=outputs,
                               weighted=True, memory_budget=2**30, block=2, full=True)
    assert (calls["gemm"] > 0) == ("mixed" in _routes(mlp, len(outputs), True, 40, 40, full=True))
    assert_allclose(K.numpy(), full, rtol=1e-10, atol=1e-13)
    assert [(i["filepath"], i["num_threads"]) for i in threadpool_info()] == before
# Every activation type that stacked_mlp accepts, and the in-place variant of each
# that has one.
INPLACE = [torch.nn.ReLU(inplace=True), torch.nn.ELU(inplace=True),
           torch.nn.ELU(alpha=0.5, inplace=True), torch.nn.LeakyReLU(0.2, inplace=True),
           torch.nn.Hardtanh(-0.5, 2.0, inplace=True), torch.nn.SiLU(inplace=True),
           torch.nn.Mish(inplace=True)]
ACTIVATIONS = [
    torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.ReLU(), torch.nn.GELU(),
    torch.nn.GELU(approximate="tanh"), torch.nn.Softplus(),
    torch.nn.Softplus(beta=2.0, threshold=3.0), torch.nn.SiLU(), torch.nn.Mish(),
    torch.nn.ELU(), torch.nn.ELU(alpha=0.5), torch.nn.LeakyReLU(), torch.nn.LeakyReLU(0.2),
    torch.nn.Hardtanh(), torch.nn.Hardtanh(-0.5, 2.0), torch.nn.Identity()] + INPLACE


def test_activation_lists_cover_the_accepted_types():
    assert {type(a) for a in ACTIVATIONS} == set(_stacked._ELEMENTWISE)
    assert {type(a) for a in INPLACE} == {t for t in _stacked._ELEMENTWISE
                                          if "inplace" in t().__dict__}


def _activation_reference(act, dtype):
    """Inputs at the kinks (0 for relu, -0.5 and 2 for hardtanh), in the saturated tails
    and past softplus's threshold; the activation's output and autograd's gradient of its
    sum, computed without ``inplace``."""
    z = torch.cat([torch.linspace(-30, 30, 601, dtype=dtype), torch.zeros(3, dtype=dtype),
                   torch.tensor([-0.5, 2.0], dtype=dtype),
                   torch.randn(198, dtype=dtype)]).view(4, 201)
    leaf = z.clone().requires_grad_(True)
    plain = copy.deepcopy(act)
    if hasattr(plain, "inplace"):
        plain.inplace = False
    h_ref = plain(leaf)
    (d_ref,) = torch.autograd.grad(h_ref.sum(), leaf)
    return z, h_ref.detach(), d_ref


@pytest.mark.parametrize("act", ACTIVATIONS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activation_derivatives_equal_autograd(act, dtype):
    # The derivative the stacked forward reads (by the backward kernel, without a graph)
    # against autograd's gradient of the sum, bit for bit.
    z, h_ref, d_ref = _activation_reference(act, dtype)
    h, d = _stacked._derivative(act, z.clone())
    assert torch.equal(h, h_ref)
    assert torch.equal(d, d_ref)


@pytest.mark.parametrize("act", INPLACE, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activation_derivatives_by_autograd_take_inplace_modules(act, dtype, monkeypatch):
    # The autograd fallback (types without a backward kernel): an in-place module must
    # not overwrite the leaf it differentiates. Autograd's in-place ELU reads its output,
    # so the derivative equals to rounding there.
    monkeypatch.setattr(_stacked, "_BACKWARD", {})
    z, h_ref, d_ref = _activation_reference(act, dtype)
    h, d = _stacked._derivative(act, z.clone())
    assert torch.equal(h, h_ref)
    rtol = 1e-6 if dtype == torch.float32 else 1e-15
    assert_allclose(d.numpy(), d_ref.numpy(), rtol=rtol, atol=rtol)


def test_inplace_activations_in_the_stacked_route_match_autograd():
    """In-place activations everywhere, one before the first Linear (which must leave
    the caller's inputs as they were), against the module's own autograd Jacobians
    (given copies of the inputs, which its first activation overwrites)."""
    module, mlp, layout, thetas, Ds, weights, load = _random_path(lambda: [
        torch.nn.Hardtanh(-1.0, 1.0, inplace=True), torch.nn.Linear(3, 6),
        torch.nn.LeakyReLU(0.2, inplace=True), torch.nn.Linear(6, 5),
        torch.nn.ELU(inplace=True), torch.nn.Linear(5, 4)], True)
    A = 2 * torch.randn(30, 3, dtype=torch.float64)
    B = 2 * torch.randn(12, 3, dtype=torch.float64)
    A0, B0 = A.clone(), B.clone()
    ws = [w for _, w in weights]
    outputs = [0, 1, 2, 3]
    ref = _module_reference(module, thetas, Ds, ws, A.clone(), A.clone(), outputs)
    cross = _module_reference(module, thetas, Ds, ws, A.clone(), B.clone(), outputs)
    kw = dict(outputs=outputs, trace_scale=1 / 4, weighted=True, memory_budget=2**30,
              diag=True, block=2)
    K, dx, _ = stacked_path_sum(mlp, layout, load, weights, A, **kw)
    assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
    assert_allclose(dx.numpy(), np.diag(ref.numpy()), rtol=1e-10, atol=1e-13)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, B, **kw)
    assert_allclose(K.numpy(), cross.numpy(), rtol=1e-10, atol=1e-13)
    assert torch.equal(A, A0) and torch.equal(B, B0)


@pytest.mark.parametrize("solver", SOLVERS[::2], ids=lambda s: s["solver"])
def test_path_kernel_of_inplace_leaky_relu_network_matches_per_point_loop(solver,
                                                                          monkeypatch):
    from skpathkernel import kernels

    calls = []
    monkeypatch.setattr(kernels, "stacked_path_sum",
                        lambda *a, **k: calls.append(1) or stacked_path_sum(*a, **k))
    est = _fit(PathKernelClassifier, solver, module=lambda d, c: torch.nn.Sequential(
        torch.nn.Linear(d, 6), torch.nn.LeakyReLU(0.2, inplace=True), torch.nn.Linear(6, 5),
        torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(5, c)))
    assert stacked_mlp(est.network_.module, est.trajectory_.names) is not None
    assert_allclose(PathKernel(est)(X[:9]), _reference(est, X[:9]), rtol=1e-10, atol=1e-13)
    assert_allclose(PathKernel(est)(X[:5], X[20:31]), _reference(est, X[:5], X[20:31]),
                    rtol=1e-10, atol=1e-13)
    assert calls


def test_blas_route_only_where_the_thread_limit_is_process_wide():
    """threadpoolctl's ``info()`` of the BLAS libraries and SciPy's build: only OpenBLAS
    with its own pthreads (or a single-threaded build) keeps one limit for the whole
    process; OpenMP layers, MKL and BLIS may keep one per thread."""
    def lib(api, layer):
        return {"user_api": "blas", "internal_api": api, "threading_layer": layer}

    wide = _stacked._process_wide
    assert wide([lib("openblas", "pthreads")], "scipy-openblas")
    assert wide([lib("openblas", "pthreads"), lib("openblas", "disabled")], None)
    assert not wide([lib("openblas", "pthreads"), lib("openblas", "openmp")], "openblas")
    assert not wide([lib("mkl", "intel")], "mkl")
    assert not wide([lib("openblas", "pthreads"), lib("mkl", "intel")], "openblas")
    assert not wide([lib("blis", "pthreads")], None)
    assert not wide([], "openblas")
    assert not wide([lib("openblas", "pthreads")], "accelerate")


def _units_path():
    """A preconditioned path whose hidden layers take the "units" route."""
    path = _random_path(LAYERS[4], True)
    assert "units" in _routes(path[1], 4, True, 40, 40)
    return path


def _blas_threads_now():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_other_blas_builds_keep_torch_products(monkeypatch, one_torch_thread):
    # A BLAS whose limit may be per thread: no SciPy products, no limit set.
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    monkeypatch.setitem(_stacked._BLAS_STATE, "process_wide", False)
    module, mlp, layout, thetas, Ds, weights, load = _units_path()
    A = torch.randn(40, 3, dtype=torch.float64)
    assert _stacked._cpu_gemm(A) is None and _stacked._syrk(torch.zeros(4, 4)) is None
    limited = []
    monkeypatch.setattr(_stacked, "_blas_threads", lambda n: limited.append(n))
    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=[0, 1, 2, 3],
                               trace_scale=0.25, weighted=True, memory_budget=2**30, block=2)
    ref = _module_reference(module, thetas, Ds, [w for _, w in weights], A, A, [0, 1, 2, 3])
    assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
    assert limited == []


def _set_blas_threads(n):
    """The BLAS libraries' limit set to ``n`` from a thread that then ends (threadpoolctl
    3.8+ lets a live thread that set OpenBLAS's limit keep control of it)."""
    import threading

    from threadpoolctl import threadpool_limits

    t = threading.Thread(target=lambda: threadpool_limits(limits=n, user_api="blas"))
    t.start()
    t.join()
    assert set(_blas_threads_now()) == {n}


@pytest.fixture
def blas_threads_3():
    before = _blas_threads_now()
    _set_blas_threads(3)
    yield
    _set_blas_threads(max(before))


def test_blas_limit_restored_after_an_error(monkeypatch, one_torch_thread, blas_threads_3):
    """The limit of one thread holds inside the call and the libraries' own limit (3
    here) comes back when a route raises."""
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    monkeypatch.setitem(_stacked._BLAS_STATE, "process_wide", True)
    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1)
    module, mlp, layout, thetas, Ds, weights, load = _units_path()
    A = torch.randn(40, 3, dtype=torch.float64)
    inside = []

    def failing(*args, **kwargs):
        inside.append(_blas_threads_now())
        raise RuntimeError("a route failed")

    monkeypatch.setattr(_stacked, "_units", failing)
    with pytest.raises(RuntimeError, match="a route failed"):
        stacked_path_sum(mlp, layout, load, weights, A, outputs=[0, 1, 2, 3],
                         trace_scale=0.25, weighted=True, memory_budget=2**30, block=2)
    assert inside and set(inside[0]) == {1}
    assert set(_blas_threads_now()) == {3}
    assert not _stacked._holds_blas() and _stacked._BLAS_OWNER.acquire(blocking=False)
    _stacked._BLAS_OWNER.release()


def test_blas_limit_under_concurrent_calls(monkeypatch, one_torch_thread, blas_threads_3):
    """Two threads in the route at once: the first enters and limits BLAS to one
    thread, the second enters while it holds the limit and takes torch's products; the
    first leaves, restoring the libraries' limit (3 here) while the second still
    computes; nothing is left limited. The first result equals a call alone, the second
    a call alone by torch's products. Where this process's BLAS may keep a limit per
    thread, neither call sets one."""
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    import threading

    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1)
    module, mlp, layout, thetas, Ds, weights, load = _units_path()
    A = torch.randn(40, 3, dtype=torch.float64)
    kw = dict(outputs=[0, 1, 2, 3], trace_scale=0.25, weighted=True, memory_budget=2**30,
              block=2)
    alone = stacked_path_sum(mlp, layout, load, weights, A, **kw)[0]
    with monkeypatch.context() as m:
        m.setitem(_stacked._BLAS_STATE, "process_wide", False)
        alone_torch = stacked_path_sum(mlp, layout, load, weights, A, **kw)[0]
    ref = _module_reference(module, thetas, Ds, [w for _, w in weights], A, A, [0, 1, 2, 3])
    for K in (alone, alone_torch):
        assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
    wide = _stacked._blas_process_wide()
    real_units = _stacked._units
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()
    seen, results, errors, scipy_used = {}, {}, [], {}
    started = threading.local()

    def units(*args, **kwargs):
        name = threading.current_thread().name
        scipy_used.setdefault(name, set()).add(_stacked._cpu_gemm(A) is not None)
        if not getattr(started, "yes", False):
            started.yes = True
            if name == "first":
                first_in.set()
                assert second_in.wait(30)
                seen["both"] = _blas_threads_now()
            else:
                second_in.set()
                assert first_done.wait(30)
                seen["second alone"] = _blas_threads_now()
        return real_units(*args, **kwargs)

    monkeypatch.setattr(_stacked, "_units", units)

    def run(name):
        try:
            torch.set_num_threads(1)
            results[name] = stacked_path_sum(mlp, layout, load, weights, A, **kw)[0]
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            if name == "first":
                first_done.set()

    first = threading.Thread(target=run, args=("first",), name="first")
    second = threading.Thread(target=run, args=("second",), name="second")
    first.start()
    assert first_in.wait(30)
    second.start()
    first.join(60)
    second.join(60)
    assert not errors, errors
    assert set(seen["both"]) == ({1} if wide else {3})
    assert set(seen["second alone"]) == {3}
    assert set(_blas_threads_now()) == {3}
    assert scipy_used == {"first": {wide}, "second": {False}}
    assert torch.equal(results["first"], alone)
    assert torch.equal(results["second"], alone_torch)


def test_units_relaid_out_only_for_scipy_panels(monkeypatch, one_torch_thread):
    """The "units" layers' backprops are copied into SciPy's layout only where its GEMMs
    take the panels (``_BLAS_MIN`` entries; here strips of 16 rows and 40 columns, 640
    entries); the kernel equals autograd's either way."""
    module, mlp, layout, thetas, Ds, weights, load = _units_path()
    A = torch.randn(40, 3, dtype=torch.float64)
    ref = _module_reference(module, thetas, Ds, [w for _, w in weights], A, A, [0, 1, 2, 3])
    relaid, real = [], _stacked._contiguous_units
    monkeypatch.setattr(_stacked, "_contiguous_units",
                        lambda *a: relaid.append(1) or real(*a))
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    for blas_min, expected in [(641, False), (640, True)]:
        monkeypatch.setattr(_stacked, "_BLAS_MIN", blas_min)
        relaid.clear()
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=[0, 1, 2, 3],
                                   trace_scale=0.25, weighted=True, memory_budget=2**30,
                                   block=2)
        assert bool(relaid) == (expected and _stacked._blas_process_wide())
        assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)



@pytest.mark.parametrize("units_scipy", [False, True], ids=["torch", "scipy"])
def test_units_library_follows_units_scipy(units_scipy, monkeypatch, one_torch_thread):
    """The trace's "units" panels go to SciPy's GEMMs (and its backprops to their
    layout) only where ``_UNITS_SCIPY`` says so; the "dense" layers' SYRK and the full
    blocks' "mixed" panels either way; the kernel equals autograd's both ways."""
    module, mlp, layout, thetas, Ds, weights, load = _random_path(LAYERS[4], True)
    A = torch.randn(40, 3, dtype=torch.float64)
    outputs = [0, 1, 2, 3]
    ws = [w for _, w in weights]
    routes = _routes(mlp, len(outputs), True, 40, 40)
    assert "units" in routes and "dense" in routes
    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1)
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", units_scipy)
    calls = {"units_gemm": 0, "syrk": 0, "relaid": 0}
    real_units, real_syrk, real_gemm = _stacked._units, _stacked._syrk, _stacked._cpu_gemm

    def units(*args, **kwargs):
        # SciPy's GEMM counted only when it is called from the "units" route.
        def gemm(t):
            f = real_gemm(t)
            return None if f is None else (
                lambda *a, **k: calls.__setitem__("units_gemm", calls["units_gemm"] + 1)
                or f(*a, **k))
        with monkeypatch.context() as m:
            m.setattr(_stacked, "_cpu_gemm", gemm)
            return real_units(*args, **kwargs)

    def syrk(acc):
        f = real_syrk(acc)
        return None if f is None else (
            lambda g: calls.__setitem__("syrk", calls["syrk"] + 1) or f(g))

    real_relaid = _stacked._contiguous_units
    monkeypatch.setattr(_stacked, "_units", units)
    monkeypatch.setattr(_stacked, "_syrk", syrk)
    monkeypatch.setattr(_stacked, "_contiguous_units",
                        lambda *a: calls.__setitem__("relaid", 1) or real_relaid(*a))
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=outputs,
                               trace_scale=0.25, weighted=True, memory_budget=2**30, block=2)
    ref = _module_reference(module, thetas, Ds, ws, A, A, outputs)
    assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
    wide = _stacked._blas_process_wide()
    assert calls["syrk"] > 0 if wide else calls["syrk"] == 0
    assert (calls["units_gemm"] > 0) == (units_scipy and wide)
    assert bool(calls["relaid"]) == (units_scipy and wide)
    # The full blocks of one hidden layer: the "mixed" panels keep SciPy's GEMMs.
    module, mlp, layout, thetas, Ds, weights, load = _random_path(LAYERS[3], True)
    assert "mixed" in _routes(mlp, len(outputs), True, 40, 40, full=True)
    calls.update(units_gemm=0)
    K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, outputs=outputs,
                               weighted=True, memory_budget=2**30, block=2, full=True)
    full = _module_reference(module, thetas, Ds, [w for _, w in weights], A, A, outputs,
                             full=True)
    assert_allclose(K.numpy(), full.numpy(), rtol=1e-10, atol=1e-13)
    assert (calls["units_gemm"] > 0) == wide


@pytest.mark.parametrize("vendor, mkl, expected", [
    ("GenuineIntel", True, False),   # measured: torch's MKL products win
    ("GenuineIntel", False, True),   # not measured: SciPy's GEMMs, as before
    ("AuthenticAMD", True, True),    # measured: SciPy's GEMMs win
    ("HygonGenuine", True, True),
    ("", True, True),
])
def test_units_scipy_by_vendor_and_mkl(vendor, mkl, expected):
    assert _stacked._units_scipy(vendor, mkl) is expected


def test_units_scipy_set_from_this_cpu():
    assert _stacked._UNITS_SCIPY is _stacked._units_scipy(
        _stacked._cpu_vendor(), torch.backends.mkl.is_available())


def test_cpu_vendor(tmp_path, monkeypatch):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert _stacked._cpu_vendor(str(x86)) == "AuthenticAMD"
    # An ARM /proc/cpuinfo names no vendor: "".
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")
    # The platform seen by the module only (the interpreter's sys.platform untouched).
    monkeypatch.setattr(_stacked, "sys", types.SimpleNamespace(platform="linux"))
    assert _stacked._cpu_vendor(str(arm)) == ""
    assert _stacked._cpu_vendor(str(tmp_path / "missing")) == ""
    # Windows: the processor identifier names it.
    monkeypatch.setattr(_stacked, "sys", types.SimpleNamespace(platform="win32"))
    monkeypatch.setenv("PROCESSOR_IDENTIFIER",
                       "Intel64 Family 6 Model 143 Stepping 8, GenuineIntel")
    assert _stacked._cpu_vendor(str(tmp_path / "missing")) == "GenuineIntel"


@pytest.mark.parametrize("sgemm", [False, True], ids=["torch", "scipy"])
@pytest.mark.parametrize("weighted", [False, True], ids=["sgd", "preconditioned"])
def test_backprop_buffers_reused_over_blocks(sgemm, weighted, monkeypatch, one_torch_thread):
    """The backprops that GEMMs write, and their copies in SciPy's layout, go to buffers
    reused by every block of points (fresh ones cost page faults): over blocks of 2, 2
    and 1 points, a network of three hidden layers (a GEMM-written backprop carried
    through another Linear's GEMM: one buffer per layer) and ``K(X, Y)`` (one per side),
    against the module's own autograd Jacobians; each buffer is allocated once."""
    module, mlp, layout, thetas, Ds, weights, load, A, B, ws = _path_and_inputs(LAYERS[4],
                                                                              weighted)
    outputs = [0, 1, 2, 3]
    monkeypatch.setattr(_stacked, "_BLAS_MIN", 1 if sgemm else 2**62)
    monkeypatch.setattr(_stacked, "_UNITS_SCIPY", True)
    seen = []
    real_get = _stacked._Scratch.get

    def get(self, name, shape, dtype):
        buf = real_get(self, name, shape, dtype)
        if name.startswith(("delta_", "units_")):
            seen.append((name, buf.untyped_storage().data_ptr()))
        return buf

    monkeypatch.setattr(_stacked._Scratch, "get", get)
    for Y in (None, B):
        seen.clear()
        ref = _module_reference(module, thetas, Ds, ws, A, A if Y is None else Y, outputs)
        K, _, _ = stacked_path_sum(mlp, layout, load, weights, A, Y, outputs=outputs,
                                   trace_scale=0.25, weighted=weighted,
                                   memory_budget=2**30, block=2)
        assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-13)
        names = {name for name, _ in seen}
        # Two GEMM-written backprops per side (the layer below the output layer keeps
        # one backprop, formed without a GEMM), and SciPy's copies where it takes them.
        sides = "x" if Y is None else "xy"
        assert {n for n in names if n.startswith("delta_")} == {
            f"delta_{s}{li}" for s in sides for li in (1, 2)}
        copies = {n for n in names if n.startswith("units_")}
        assert bool(copies) == (sgemm and weighted and "units" in _routes(mlp, 4, True, 40, 40))
        # Every block took the same buffer of each name.
        assert len(set(seen)) == len(names)
        assert len(seen) == 3 * len(names)


@pytest.mark.parametrize("reused", ["activation", "linear"])
def test_a_module_used_twice_is_not_a_stacked_mlp(reused):
    """named_children() lists a reused instance once: a Sequential that applies one Tanh
    (or one Linear) twice was read as a shorter network (the unrolled scores' MLP route
    missed autograd by 0.36-2.0). It takes the general engine."""
    lin, act = torch.nn.Linear(4, 4), torch.nn.Tanh()
    layers = ([torch.nn.Linear(3, 4), act, lin, act, torch.nn.Linear(4, 1)]
              if reused == "activation" else
              [torch.nn.Linear(3, 4), torch.nn.Tanh(), lin, torch.nn.Tanh(), lin])
    module = torch.nn.Sequential(*layers)
    names = [n for n, _ in module.named_parameters()]
    assert stacked_mlp(module, names) is None
    distinct = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 1))
    assert stacked_mlp(distinct, [n for n, _ in distinct.named_parameters()]) is not None


def test_a_block_of_points_is_made_after_the_last_is_released(monkeypatch):
    """The blocks of points take the budget one at a time: the last block's factors are
    released before the next block's are made (both held at once took twice the
    budget's points)."""
    est = PathKernelMachine(hidden_layer_sizes=(16, 16), max_iter=4, batch_size=10,
                            random_state=0).fit(X, Y_REG)
    made = []
    block_sides = _stacked._block_sides

    def spy(*args, **kwargs):
        alive = [r() is not None for r in made]
        sides = block_sides(*args, **kwargs)
        made.append(weakref.ref(sides.fy[0][0]))  # a fresh tensor of the block's own
        spy.alive.extend(alive)
        return sides

    spy.alive = []
    monkeypatch.setattr(_stacked, "_block_sides", spy)
    # Blocks of a few points: a budget of a few points' factors.
    PathKernel(est.set_params(memory_budget=2**17))(X)
    assert len(made) > 2 and not any(spy.alive)


_PEAK_SCRIPT = """
import ctypes, gc, sys
import numpy as np
from skpathkernel import PathKernelMachine

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

rng = np.random.RandomState(0)
X = rng.randn(500, 10).astype(np.float32)
est = PathKernelMachine(hidden_layer_sizes=(128, 128), max_iter=3, batch_size=100, tol=None,
                        memory_budget=2**24, random_state=0, device="cpu").fit(X, X[:, 0])
Xq = X[:100]
est.path_kernel_(Xq, X)  # torch's and the BLAS's one-off allocations
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
est.path_kernel_(Xq, X)
print(status("VmHWM") - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_path_kernel_peak_memory_stays_within_the_budget(tmp_path):
    """The stacked path sum's blocks of points, sized by its per-point estimate, hold at
    most the memory budget: peak RSS of a fresh process over a warmed-up call, 16 MiB
    budget, 100 x 500 Gram of an 18k-parameter MLP over 16 points (its naive N x P x T
    factors: 640 MB). The factors' pass held about twice the factors it returns, and
    the last block stayed alive beside the next: 1.6x to 1.85x the budget measured
    before, 1.05x to 1.16x after."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[-1])
    assert peak <= 1.35 * 2**24
