"""The kernel-machine representation: every prediction split over the training points.

For every recorded step, ``f(x; theta_{t+1}) - f(x; theta_t) = rho_t(x) . dtheta_t`` where
the row vector ``rho_t(x)`` is

- ``exact``: the segment-averaged Jacobian ``int_0^1 J(x; theta_t + s dtheta_t) ds`` by
  Gauss-Legendre quadrature (exact up to quadrature and floating-point error);
- ``first_order``: ``J_t(x)`` (Domingos' formula, error O(lr));
- ``second_order``: ``J_t(x) + 1/2 (H_t(x) dtheta_t)^T`` (adds the curvature term, O(lr^2)).

Every solver's step is linear in the per-step loss gradients ``d_s``:
``dtheta_t = -lr_t c_t D_t sum_{s<=t} w^{t-s} d_s (+ decoupled weight decay)`` with memory
``w`` = momentum (SGD), beta_1 (Adam / AdamW) or 0 (plain SGD, RMSprop), ``c_t`` = 1 or
Adam's ``(1 - beta_1) / (1 - beta_1^t)``, and ``D_t`` the recorded diagonal preconditioner.
``d_s = (1/|B_s|) sum_{i in B_s} J_s(x_i)^T r_{s,i} + wd * theta_s`` (L2 solvers).
So ``f(x; theta_T) - f(x; theta_0) = sum_s lambda_s(x) . d_s`` with the adjoint
``lambda_s = nu_s + w lambda_{s+1}``, ``nu_t = -lr_t c_t D_t rho_t(x)``, computed backwards
over the steps with ONE (queries x outputs x P) buffer: no N x P x T tensor is formed.
Sample ``i``'s contribution is ``a_i(x) = sum_{s: i in B_s} lambda_s(x) . J_s(x_i)^T r_{s,i}
/ |B_s|``; weight decay goes to ``regularization``.

Cost per step (Q queries, C outputs, P parameters, B batch): ``n_nodes`` Jacobians of the
Q queries, the per-sample loss gradients of the batch, and one (Q C) x P x B product; memory
O(Q C P + B P) in blocks under the memory budget.

Plain SGD (no momentum, D = I: Domingos' setting) has a
structured fast path: with no memory, ``lambda_t = -lr_t rho_t(x)``, so sample i's share of
step t is ``-lr_t / |B_t| sum_k w_k J(x; theta_t^k) J(x_i; theta_t)^T r_{t,i}``: a
cross-parameter tangent Gram between the queries at the quadrature nodes and the batch at
``theta_t``, computed from the layers' factors (O(Q B sum_l (d_in + C d_out)) per node for
nn.Linear) without forming any Jacobian; L2 weight decay is one Jacobian-vector product.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call, jacrev, jvp, vmap

from ._losses import Loss
from ._memory import rows_per_block
from ._tangent import forward, hidden_reads, tangent_features, tangent_gram
from ._trajectory import Trajectory

__all__ = ["Decomposition", "decompose"]


@dataclass
class Decomposition:
    """A prediction decomposed over the training points.

    ``initial + contributions.sum(axis=1) + regularization`` equals ``prediction`` up to
    ``error`` (exact for ``method="exact"``, the formula's own error otherwise).

    Attributes
    ----------
    initial : ndarray of shape (n_queries, n_outputs)
        f(X; theta_0), the network at initialization.
    contributions : ndarray of shape (n_queries, n_train, n_outputs)
        a_i(x): how much training point i moved the prediction at x.
    regularization : ndarray of shape (n_queries, n_outputs)
        What no training point owns (weight decay).
    prediction : ndarray of shape (n_queries, n_outputs)
        f(X; theta_T), the trained network.
    error : float
        max |initial + sum(contributions) + regularization - prediction|.
    method, weighting : str
    """

    initial: np.ndarray
    contributions: np.ndarray
    regularization: np.ndarray
    prediction: np.ndarray
    error: float
    method: str
    weighting: str

    @property
    def reconstruction(self) -> np.ndarray:
        """``initial + contributions.sum(axis=1) + regularization``."""
        return self.initial + self.contributions.sum(axis=1) + self.regularization


def default_n_nodes(dtype: torch.dtype, solver: str = "sgd") -> int:
    """Gauss-Legendre nodes per step that reach the dtype's round-off (measured).

    The quadrature error falls like ``|dtheta|^(2 n)``. Measured max error on a
    2-16-16-1 tanh MLP, 15 full-batch steps, by nodes n = 1..6 (float64):
    sgd 1e-5, 3e-10, 1e-14, 4e-16; adam 2e-4, 4e-8, 7e-12, 9e-16; rmsprop (whose early
    steps are ~10 lr, the second moment starting at 0) 7e-3, 4e-5, 2e-7, 6e-10, 2e-12, 4e-15.
    float32 reaches its round-off (~1e-7) at n = 3 for all three.
    """
    if dtype == torch.float32:
        return 3
    return 6 if solver == "rmsprop" else 5


def _solver_coefficients(traj: Trajectory, t: int) -> tuple[float, float]:
    """(step scale ``-lr_t c_t``, memory ``w``) of the solver at step t."""
    spec = traj.solver_spec
    lr = float(traj.learning_rates[t])
    if spec.name in ("adam", "adamw"):
        step = float(traj.optimizer_state(t)["step"])
        return -lr * (1.0 - spec.beta_1) / (1.0 - spec.beta_1**step), spec.beta_1
    if spec.name == "sgd":
        return -lr, spec.momentum
    return -lr, 0.0


def _params(traj: Trajectory, flat: torch.Tensor):
    return dict(traj.unflatten(flat))


def _hvp_rows(module, traj, theta, delta, X) -> torch.Tensor:
    """(H_t(x) dtheta)^T for every query: the derivative of J(x) along dtheta (Q, C, P)."""
    params, tangent = _params(traj, theta), _params(traj, delta)

    def f_single(p, x):
        return functional_call(module, p, (x.unsqueeze(0),))[0]

    def row(x):
        return jvp(lambda p: jacrev(f_single)(p, x), (params,), (tangent,))[1]

    out = vmap(row)(X)
    return torch.cat([out[name].flatten(start_dim=2) for name in traj.names], dim=2)


def _rows(module, traj, theta, delta, X, method, nodes, budget, buffers, checked) -> torch.Tensor:
    """The per-step row vectors rho_t(x), shape (Q, C, P), in ``buffers["rho"]``.

    The (Q, C, P) buffers are reused across steps: fresh ones of this size would fault
    in their pages on every step (about 0.4 ms per MB on a CPU, the dominant cost).
    """
    rho = buffers["rho"]

    def jac(flat, out):
        return tangent_features(module, _params(traj, flat), X, output="full",
                                memory_budget=budget, out=out, **checked)

    if method == "exact":
        s, w = nodes
        jac(theta + float(s[0]) * delta, rho).mul_(float(w[0]))
        for sk, wk in zip(s[1:], w[1:]):
            rho.add_(jac(theta + float(sk) * delta, buffers["node"]), alpha=float(wk))
        return rho
    jac(theta, rho)
    if method == "second_order":
        rho.add_(_hvp_rows(module, traj, theta, delta, X), alpha=0.5)
    return rho


def _loss_gradients(module, traj, theta, X, Y, loss: Loss, budget, J, checked) -> torch.Tensor:
    """Per-sample loss gradients J(x_i)^T r_i at theta, shape (B, P), built in ``J``.

    ``J`` is a reused (B, C, P) buffer; the result is a view of it (C = 1) or a sum over
    its outputs.
    """
    params = _params(traj, theta)
    r = loss.residuals(forward(module, params, X), Y)
    tangent_features(module, params, X, output="full", memory_budget=budget, out=J, **checked)
    J.mul_(r.to(J.dtype).unsqueeze(-1))
    return J[:, 0] if J.shape[1] == 1 else J.sum(1)


def _structured(traj: Trajectory, method: str) -> bool:
    """Whether the factor-Gram fast path applies: plain SGD, first-order or exact rows."""
    spec = traj.solver_spec
    return spec.name == "sgd" and spec.momentum == 0 and method != "second_order"


class _Contracted(torch.nn.Module):
    """``w . f(x)``: the outputs contracted with per-row weights carried in the input row.

    A row ``[vec(x), w]`` gives ``w . f(x)``, whose per-sample gradient is ``J(x)^T w``:
    one scalar output explained costs the engine a single-output Gram instead of the
    ``C x C`` blocks of every output pair.
    """

    def __init__(self, module: torch.nn.Module, sample_shape: tuple[int, ...]):
        super().__init__()
        self.inner = module
        self.sample_shape = tuple(sample_shape)
        self.n_features = int(np.prod(self.sample_shape, dtype=np.int64))

    def forward(self, z):
        x = z[:, : self.n_features].reshape(z.shape[0], *self.sample_shape)
        f = self.inner(x).reshape(z.shape[0], -1)
        return (f * z[:, self.n_features :]).sum(1, keepdim=True)


def _step_shares(module, params_k, params_t, X, Xb, r, weights, budget, checked):
    """``J(x; params_k) J(x_b; params_t)^T r_b`` for every query and batch row, (Q, B, C).

    With ``weights`` (Q, C) the shares of the contracted output ``w_q . f``, (Q, B, 1),
    through :class:`_Contracted` on both sides (the batch rows carry their residuals).
    """
    if weights is None or not X.is_floating_point():
        # Integer inputs (token ids) cannot ride in a float row with their weights.
        G = tangent_gram(module, params_k, X, Xb, output="full", params_y=params_t,
                         memory_budget=budget, **checked)
        share = torch.einsum("qcbd,bd->qbc", G, r.to(G.dtype))
        if weights is not None:
            share = torch.einsum("qbc,qc->qb", share, weights.to(G.dtype)).unsqueeze(-1)
        return share
    wrapped = _Contracted(module, X.shape[1:])
    G = tangent_gram(
        wrapped, {f"inner.{k}": v for k, v in params_k.items()},
        torch.cat([X.flatten(1), weights.to(X.dtype)], 1),
        torch.cat([Xb.flatten(1), r.to(X.dtype)], 1), output=0,
        params_y={f"inner.{k}": v for k, v in params_t.items()}, memory_budget=budget,
        check_hidden=False, exclude=frozenset(f"inner.{k}" for k in checked["exclude"]),
    )
    return G.unsqueeze(-1)


def _decompose_sgd(module, traj, X_train, Y_train, loss, X, weights, *, method, weighting,
                   nodes, memory_budget, checked):
    """Contributions (Q, N, C) and regularization (Q, C) for plain SGD, step by step.

    With ``weights`` (Q, C), those of the contracted output ``w_q . f``: C = 1.
    """
    device = X.device
    N = X_train.shape[0]
    wd = traj.solver_spec.weight_decay
    s_nodes, w_nodes = nodes if method == "exact" else ((0.0,), (1.0,))
    contrib = reg = None
    batches = traj.batches
    for t in range(traj.n_steps):
        theta = traj.parameters(t).to(device)
        delta = traj.parameters(t + 1).to(device) - theta
        lr = float(traj.learning_rates[t])
        idx = (torch.as_tensor(batches[t], device=device) if weighting == "realized"
               else torch.arange(N, device=device))
        params_t = _params(traj, theta)
        r = loss.residuals(forward(module, params_t, X_train[idx]), Y_train[idx])
        decay = _params(traj, wd * theta) if wd else None
        for sk, wk in zip(s_nodes, w_nodes):
            params_k = _params(traj, theta + float(sk) * delta)
            share = _step_shares(module, params_k, params_t, X, X_train[idx], r, weights,
                                 memory_budget, checked)
            share = share.double().mul_(-lr * float(wk) / len(idx))
            if contrib is None:
                n_out = share.shape[2]
                contrib = torch.zeros((X.shape[0], N, n_out), dtype=torch.float64,
                                      device=device)
                reg = torch.zeros((X.shape[0], n_out), dtype=torch.float64, device=device)
            contrib.index_add_(1, idx, share)
            if decay is not None:
                # L2's share of the step, -lr * wd * theta_t, seen through J(x; theta_t^k).
                _, jv = jvp(lambda p: functional_call(module, p, (X,)), (params_k,), (decay,))
                jv = jv.reshape(X.shape[0], -1).double()
                if weights is not None:
                    jv = (jv * weights.double()).sum(1, keepdim=True)
                reg -= lr * float(wk) * jv
    return contrib.cpu().numpy(), reg.cpu().numpy()


def decompose(
    module: torch.nn.Module,
    traj: Trajectory,
    X_train: torch.Tensor,
    Y_train: torch.Tensor,
    loss: Loss,
    X: torch.Tensor,
    *,
    method: str = "exact",
    weighting: str = "realized",
    n_nodes: int | None = None,
    memory_budget: int = 2**30,
    weights: torch.Tensor | None = None,
) -> Decomposition:
    """Decompose ``f(X; theta_T)`` over the training points along ``traj`` (see module doc).

    ``weights`` (n_queries, C) decomposes the scalar output ``w_q . f(x_q)`` of each query
    instead (the result has one output): exactly the outputs' decomposition contracted
    with the weights, at a fraction of its cost (no ``C x C`` blocks).
    """
    if traj.record_every != 1:
        raise ValueError(
            "The per-training-point decomposition needs every optimizer step recorded "
            f"(record_every=1); this path was recorded with record_every={traj.record_every}."
        )
    device, dtype = X.device, traj.dtype
    theta_0 = traj.parameters(0).to(device)
    theta_T = traj.parameters(-1).to(device)
    initial = forward(module, _params(traj, theta_0), X)
    prediction = forward(module, _params(traj, theta_T), X)
    n_q, n_out = prediction.shape
    if weights is not None:
        if weights.shape != (n_q, n_out):
            raise ValueError(f"weights must have shape ({n_q}, {n_out}), got "
                             f"{tuple(weights.shape)}.")
        weights = weights.to(device=device, dtype=dtype)
        initial = (initial * weights).sum(1, keepdim=True)
        prediction = (prediction * weights).sum(1, keepdim=True)
    # Outputs of the result: the network's, or the one contracted output.
    n_res = 1 if weights is not None else n_out
    P, N = traj.n_params, X_train.shape[0]
    n_nodes = default_n_nodes(dtype, traj.solver) if n_nodes is None else n_nodes
    g_s, g_w = np.polynomial.legendre.leggauss(n_nodes)
    nodes = ((g_s + 1.0) / 2.0, g_w / 2.0)
    # The engine's autograd check for hidden reads runs once, at the path's first, middle
    # and last points, instead of in each of the (n_nodes + 1) x T engine calls.
    middle = traj.parameters(len(traj) // 2).to(device)
    checked = dict(check_hidden=False, exclude=hidden_reads(
        module, [_params(traj, t) for t in (theta_0, middle, theta_T)], [X, X_train],
        output="full", memory_budget=memory_budget))
    if _structured(traj, method):
        # Per query row: its (C x B x C) Gram block and share, float64, B <= N.
        q_rows = rows_per_block(memory_budget, 4 * n_out * n_res * N * 8,
                                "The decomposition's query-by-batch Gram")
        parts = [
            _decompose_sgd(module, traj, X_train, Y_train, loss, X[q0 : q0 + q_rows],
                           None if weights is None else weights[q0 : q0 + q_rows],
                           method=method, weighting=weighting, nodes=nodes,
                           memory_budget=memory_budget, checked=checked)
            for q0 in range(0, n_q, q_rows)
        ]
        contributions = np.concatenate([c for c, _ in parts])
        regularization = np.concatenate([r for _, r in parts])
        return _result(initial, prediction, contributions, regularization, method, weighting)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # lambda, rho and the quadrature temporaries: ~4 (Q x C x P) buffers per query block.
    q_block = rows_per_block(memory_budget, 4 * n_out * P * itemsize,
                             "The decomposition's adjoint buffers")
    # A batch's per-sample Jacobians (B x C x P) and loss gradients (B x P).
    b_block = rows_per_block(memory_budget, 2 * (n_out + 1) * P * itemsize,
                             "The decomposition's per-sample loss gradients")
    contributions = np.zeros((n_q, N, n_res))
    regularization = np.zeros((n_q, n_res))
    spec = traj.solver_spec
    decoupled = spec.name == "adamw"
    batches = traj.batches
    for q0 in range(0, n_q, q_block):
        Xq = X[q0 : q0 + q_block]
        Wq = None if weights is None else weights[q0 : q0 + q_block]
        lam = torch.zeros((Xq.shape[0], n_res, P), dtype=dtype, device=device)
        buffers = {name: torch.empty((Xq.shape[0], n_out, P), dtype=dtype, device=device)
                   for name in (("rho", "node") if method == "exact" else ("rho",))}
        J = torch.empty((min(b_block, N), n_out, P), dtype=dtype, device=device)
        contrib = torch.zeros((Xq.shape[0], N, n_res), dtype=torch.float64, device=device)
        reg = torch.zeros((Xq.shape[0], n_res), dtype=torch.float64, device=device)
        nxt = traj.parameters(len(traj) - 1).to(device)
        for t in reversed(range(traj.n_steps)):
            theta = traj.parameters(t).to(device)
            delta = nxt - theta
            nxt = theta
            rho = _rows(module, traj, theta, delta, Xq, method, nodes, memory_budget, buffers,
                        checked)
            if Wq is not None:
                rho = torch.einsum("qcp,qc->qp", rho, Wq).unsqueeze(1)
            scale, memory = _solver_coefficients(traj, t)
            D = traj.preconditioner(t)
            # lambda_t = scale * D * rho_t + memory * lambda_{t+1}, in place: the (Q, C, P)
            # buffers dominate the cost, so every avoided pass over them counts.
            lam.mul_(memory)
            if D is None:
                lam.add_(rho, alpha=scale)
            else:
                lam.addcmul_(rho, D.to(device), value=scale)
            if spec.weight_decay:
                if decoupled:
                    decay = -float(traj.learning_rates[t]) * spec.weight_decay * theta
                    reg += (rho @ decay).double()
                else:
                    reg += (lam @ (spec.weight_decay * theta)).double()
            idx = (torch.as_tensor(batches[t], device=device) if weighting == "realized"
                   else torch.arange(N, device=device))
            for b0 in range(0, len(idx), b_block):
                sub = idx[b0 : b0 + b_block]
                G = _loss_gradients(module, traj, theta, X_train[sub], Y_train[sub], loss,
                                    memory_budget, J[: len(sub)], checked)
                share = (lam.flatten(0, 1) @ G.T).unflatten(0, lam.shape[:2])
                share = share.transpose(1, 2).double() / len(idx)
                contrib.index_add_(1, sub, share)
        contributions[q0 : q0 + q_block] = contrib.cpu().numpy()
        regularization[q0 : q0 + q_block] = reg.cpu().numpy()
    return _result(initial, prediction, contributions, regularization, method, weighting)


def _result(initial, prediction, contributions, regularization, method, weighting):
    result = Decomposition(
        initial=initial.double().cpu().numpy(),
        contributions=contributions,
        regularization=regularization,
        prediction=prediction.double().cpu().numpy(),
        error=0.0,
        method=method,
        weighting=weighting,
    )
    if len(result.prediction):
        result.error = float(np.max(np.abs(result.reconstruction - result.prediction)))
    return result
