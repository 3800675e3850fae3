"""The decomposition's per-step kernels from the factors against autograd Jacobians.

``directional`` (the quadrature's ``sum_k w_k J(x; node k) . v`` and its spread) and
``factor_shares`` (plain SGD's pair terms ``sum_k w_k J(x; node k) J(x_i)^T r_i``) are
checked on their own, on a capture with weight, bias and dense (no rule) terms, several
nodes and outputs, against per-sample Jacobians from ``torch.func.jacrev`` in float64.
"""

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from torch import nn
from torch.func import functional_call, jacrev, vmap

from skpathkernel._tangent import capture, pair_terms
from skpathkernel._tangent._pairs import (
    Adjoint,
    directional,
    factor_shares,
    prepare_directions,
)


class _Scale(nn.Module):
    """A layer without a rule: its parameter comes as a dense term."""

    def __init__(self, d):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x):
        return x * self.s


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), _Scale(5), nn.Linear(5, 4), nn.Tanh(),
                         nn.Linear(4, 3)).double()


def _points(net, m):
    """``m`` parameter points around the module's."""
    gen = torch.Generator().manual_seed(1)
    base = dict(net.named_parameters())
    return [{k: (v + 0.1 * k_ * torch.randn(v.shape, generator=gen, dtype=v.dtype)).detach()
             for k, v in base.items()} for k_ in range(m)]


def _jacobians(net, params, X):
    """(n, C, P) per-sample Jacobians, parameters in ``params``' order."""
    def f(p, x):
        return functional_call(net, p, (x[None],))[0]
    J = vmap(jacrev(f), in_dims=(None, 0))(params, X)
    return torch.cat([J[k].reshape(len(X), J[k].shape[1], -1) for k in params], dim=2)


def _flat(params):
    return torch.cat([v.reshape(-1) for v in params.values()])


def _capture(net, params, X, weights=None):
    cap = capture(net, params, X, list(range(3)), memory_budget=2**26, weights=weights)
    return pair_terms(cap.terms)


@pytest.mark.parametrize("m", [1, 3])
def test_directional_equals_jacobian_products(m):
    net, X = _net(), torch.randn(7, 3, generator=torch.Generator().manual_seed(2),
                                 dtype=torch.float64)
    points, w = _points(net, m), np.random.RandomState(0).uniform(0.2, 1.0, m).tolist()
    nodes = [_capture(net, p, X) for p in points]
    assert any(a is None and len(t.inputs) == 1 for t in nodes[0] for _, a in t.inputs)
    gen = torch.Generator().manual_seed(3)
    vs = [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
           for k, v in points[0].items()} for _ in range(2)]
    out, spread = directional(nodes, w, *vs)
    prepared = prepare_directions(*vs)
    again = directional(nodes, w, prepared=prepared)
    assert_allclose(again[0].numpy(), out.numpy(), rtol=1e-14, atol=0)
    J = [_jacobians(net, p, X) for p in points]  # (n, C, P) per node
    for i, v in enumerate(vs):
        ref = sum(wk * Jk @ _flat(v) for wk, Jk in zip(w, J))
        assert_allclose(out[i].numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)
    terms = torch.stack([wk * Jk * _flat(vs[0]) for wk, Jk in zip(w, J)])
    assert_allclose(spread.numpy(), terms.pow(2).sum((0, 3)).sqrt().numpy(), rtol=1e-12)


@pytest.mark.parametrize("m", [1, 2])
def test_factor_shares_equal_jacobian_products(m):
    net = _net()
    gen = torch.Generator().manual_seed(4)
    X, Xb = (torch.randn(k, 3, generator=gen, dtype=torch.float64) for k in (6, 9))
    R = torch.randn(9, 3, generator=gen, dtype=torch.float64)  # loss residuals
    points, w = _points(net, m + 1), np.random.RandomState(1).uniform(0.2, 1.0, m).tolist()
    nodes = [_capture(net, p, X) for p in points[:m]]
    batch = _capture(net, points[m], Xb, weights=R)
    dhat = [t.delta[:, 0] for t in batch]
    got = factor_shares(nodes, w, batch, dhat)  # (B, n, C)
    Jb = _jacobians(net, points[m], Xb)
    g = torch.einsum("icp,ic->ip", Jb, R)  # per-sample loss gradients
    ref = sum(wk * torch.einsum("ncp,ip->inc", _jacobians(net, p, X), g)
              for wk, p in zip(w, points[:m]))
    assert got.shape == (9, 6, 3)
    assert_allclose(got.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12 * ref.abs().max().item())


@pytest.mark.parametrize("n_q", [1, 4])  # 1: the first layer contracts by its factors
def test_adjoint_coarse_rows_equal_jacobian_products(n_q):
    # The decomposition's check rows (a difference of two rules, small next to the
    # shares) are contracted in float32: within float32 round-off of their own size,
    # while the other rows keep the float64 contraction.
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    gen = torch.Generator().manual_seed(6)
    X, Xb = (torch.randn(k, 8, generator=gen, dtype=torch.float64) for k in (n_q, 9))
    R = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    points = [{k: v.float().double() for k, v in p.items()} for p in _points(net, 3)]
    w = [0.3, 0.7]
    low = [1e-4 * wk for wk in w]  # the check's rows: a small difference

    def f32(p):
        return {k: v.float() for k, v in p.items()}

    net32 = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    nodes = [pair_terms(capture(net32, f32(p), X.float(), list(range(3)),
                                memory_budget=2**26).terms) for p in points[:2]]
    batch = pair_terms(capture(net32, f32(points[2]), Xb.float(), list(range(3)),
                               memory_budget=2**26, weights=R.float()).terms)
    dhat = [t.delta[:, 0] for t in batch]
    coef = -0.1
    adjoint = Adjoint(nodes[0], 0.9, 2 * n_q, coarse=n_q)
    groups = [(slice(0, n_q), nodes, w), (slice(n_q, 2 * n_q), nodes, low)]
    shares, _ = adjoint.step(groups, coef, None, batch, dhat)  # (2 n_q C, B)
    g = torch.einsum("icp,ic->ip", _jacobians(net, points[2], Xb), R)
    J = [_jacobians(net, p, X) for p in points[:2]]
    for rows, weights in ((slice(0, n_q * 3), w), (slice(n_q * 3, 2 * n_q * 3), low)):
        ref = coef * sum(wk * torch.einsum("ncp,ip->nci", Jk, g)
                         for wk, Jk in zip(weights, J)).reshape(n_q * 3, 9)
        assert_allclose(shares[rows].numpy(), ref.numpy(), rtol=0,
                        atol=1e-5 * ref.abs().max().item())
