"""Hessian-vector products of a plain MLP's batch loss, by hand: the unrolled scores'
structured route.

For an ``nn.Sequential`` of Linear layers and elementwise activations (what
:func:`~skpathkernel._tangent.stacked_mlp` accepts), :class:`MLPStep` gives, for ``Q``
directions ``v`` at once, ``H v`` (``H`` the Hessian of the weighted batch loss
``sum_i beta_i l_i``) and every batch point's ``grad l_i . v``: Pearlmutter's R-operator,
one forward pass carrying the directions' tangents and one backward pass carrying
theirs. Tangents are laid out ``(B, Q, d)``, so that every product is one GEMM with the
directions folded into its rows or columns (``h V^T`` is ``(B, d_in) @ (d_in, Q d_out)``);
the activations' first and second derivatives (by autograd on the batch's ``(B, d)``
values: every activation :func:`stacked_mlp` accepts, with torch's own derivatives) and
the loss's ``C x C`` output Hessians (:meth:`~skpathkernel._path._losses.Loss.output_hessian`)
are taken once per step and only multiplied into the tangents, and the step's own
gradient comes from the same forward and backward pass (no module call). torch.func's
``vmap(jvp(grad))`` evaluates the same products, but runs the backward's derivative
formulas (torch's Python decompositions for jvp: GELU's alone were half of the default
classifier's step) on the directions' batched tensors.

Per Linear layer and step: ``12 B Q d_in d_out`` FLOPs (two GEMMs forward, four backward),
the same as a Hessian-vector product per direction.
"""

from __future__ import annotations

import torch
from torch import nn

from .._tangent._stacked import StackedMLP, _Linear

__all__ = ["MLPStep"]


def _activation_derivatives(act: nn.Module, z: torch.Tensor):
    """``act(z)``, its elementwise first and second derivatives at ``z`` (the second None
    where it is zero: an activation whose derivative does not depend on ``z``)."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        # An in-place activation may not overwrite a leaf that requires grad: a copy.
        h = act(z.clone() if getattr(act, "inplace", False) else z)
        (s1,) = torch.autograd.grad(h.sum(), z, create_graph=True)
        s2 = None
        if s1.requires_grad:
            (s2,) = torch.autograd.grad(s1.sum(), z, allow_unused=True)
    return h.detach(), s1.detach(), s2


def _buffer(scratch: dict, key, shape, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``shape`` kept in ``scratch`` across calls: the tangents are megabytes
    a step, and fresh ones cost a page fault per 4 KiB at every step (the products of
    the default classifier's 100 queries ran at a fifth of the GEMM rate that way)."""
    buf = scratch.get(key)
    if (buf is None or buf.shape != shape or buf.dtype != like.dtype
            or buf.device != like.device):
        buf = scratch[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buf


class MLPStep:
    """One optimizer step's batch through a plain MLP: the batch loss gradient by one
    forward and one backward pass by hand, whose values :meth:`products` reuses.

    ``layout`` maps every parameter to its ``(start, numel)`` in the flat ``theta``, all
    of them the Linear layers' (:func:`~skpathkernel._tangent.stacked_mlp`); ``beta``
    (B,) weighs the per-sample losses of the batch ``X`` (B, d_in) with targets ``Y``;
    ``scratch``, a dict kept by the caller across steps, holds the tangents' buffers;
    ``targets``: :meth:`products` also gives the targets' products (see there).
    """

    def __init__(self, mlp: StackedMLP, layout: dict, theta: torch.Tensor, X: torch.Tensor,
                 Y: torch.Tensor, loss, beta: torch.Tensor, scratch: dict | None = None,
                 targets: bool = False):
        self.mlp, self.layout, self.theta = mlp, layout, theta
        self.scratch = {} if scratch is None else scratch
        h, kept = X, []  # per item: its input (a Linear) or (s1, s2) (an activation)
        for it in mlp.items:
            if isinstance(it, _Linear):
                kept.append(h)
                W, b = self._params(theta, it)
                h = h @ W.T if b is None else torch.addmm(b, h, W.T)
            elif type(it) is nn.Identity:
                kept.append(None)
            else:
                h, s1, s2 = _activation_derivatives(it, h)
                kept.append((s1, s2))
        self.kept, self.first = kept, next(
            i for i, it in enumerate(mlp.items) if isinstance(it, _Linear))
        self.residuals = loss.residuals(h, Y)  # (B, C)
        # sum_i beta_i d^2 l_i / df_i^2, transposed for Rf_i @ H_i^T.
        self.hessian = loss.output_hessian(h, Y).transpose(1, 2) * beta[:, None, None]
        # sum_i beta_i d^2 l_i / df_i dy_i: the targets' products from the same tangents.
        self.cross = (loss.target_hessian(h, Y) * beta[:, None, None]) if targets else None
        # The backward pass: every item's output gradient (B, d), and the parameters'.
        g = self.residuals * beta[:, None]
        self.grads = [None] * len(mlp.items)
        self.gradient = torch.empty_like(theta)
        for i in reversed(range(self.first, len(mlp.items))):
            it, k = mlp.items[i], kept[i]
            self.grads[i] = g
            if isinstance(it, _Linear):
                s, size = layout[it.weight]
                torch.mm(g.T, k, out=self.gradient[s : s + size].view(it.d_out, it.d_in))
                if it.bias is not None:
                    s, size = layout[it.bias]
                    torch.sum(g, 0, out=self.gradient[s : s + size])
                if i > self.first:
                    g = g @ self._params(theta, it)[0]
            elif k is not None:
                g = g * k[0]

    def _params(self, flat: torch.Tensor, lin: _Linear):
        """The layer's weight (..., d_out, d_in) and bias (..., d_out) or None in ``flat``
        (P,) or (Q, P)."""
        s, size = self.layout[lin.weight]
        W = flat[..., s : s + size].unflatten(-1, (lin.d_out, lin.d_in))
        if lin.bias is None:
            return W, None
        s, size = self.layout[lin.bias]
        return W, flat[..., s : s + size]

    def products(self, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]:
        """``H v`` (Q, P), every batch point's ``grad l_i . v`` (Q, B) for each row ``v``
        of ``V`` (Q, P), ``H`` the Hessian of ``sum_i beta_i l_i`` at the step's point,
        and, when built with ``targets``, ``beta_i d (grad l_i . v) / d y_i`` (Q, B, C)
        (else None)."""
        mlp, scratch, kept = self.mlp, self.scratch, self.kept
        B, Q = self.residuals.shape[0], V.shape[0]
        Rh, tangents = None, []  # the tangents (B, Q, d) of every item's input; None: 0
        for i, it in enumerate(mlp.items):
            tangents.append(Rh)
            if isinstance(it, _Linear):
                W, _ = self._params(self.theta, it)
                VW, Vb = self._params(V, it)
                # h V_q^T for every q: (B, d_in) @ (d_in, Q d_out).
                Vt = _buffer(scratch, (i, "V"), (it.d_in, Q, it.d_out), V)
                Vt.copy_(VW.permute(2, 0, 1))
                Rz = _buffer(scratch, (i, "R"), (B, Q, it.d_out), V)
                torch.mm(kept[i], Vt.view(it.d_in, -1), out=Rz.view(B, -1))
                if Rh is not None:
                    Rz.view(B * Q, it.d_out).addmm_(Rh.view(B * Q, it.d_in), W.T)
                if Vb is not None:
                    Rz += Vb
                Rh = Rz
            elif kept[i] is not None and Rh is not None:
                Rh = torch.mul(Rh, kept[i][0][:, None],
                               out=_buffer(scratch, (i, "R"), Rh.shape, V))
        # grad l_i . v: the tangent of l_i, r_i . Rf_i.
        D = torch.einsum("bc,bqc->qb", self.residuals, Rh)
        E = None if self.cross is None else torch.einsum("bqc,bct->qbt", Rh, self.cross)
        Rg = torch.bmm(Rh, self.hessian)
        HV = torch.empty_like(V)
        for i in reversed(range(self.first, len(mlp.items))):
            it, g = mlp.items[i], self.grads[i]
            if isinstance(it, _Linear):
                W, _ = self._params(self.theta, it)
                VW, Vb = self._params(V, it)
                Rh_in = tangents[i]
                s, size = self.layout[it.weight]
                HVW = HV[:, s : s + size].view(Q, it.d_out, it.d_in)
                # sum_i Rg_iq h_i^T + g_i Rh_iq^T: (Q d_out, B) @ (B, d_in) and
                # (d_out, B) @ (B, Q d_in).
                prod = _buffer(scratch, (i, "HV"), (Q * it.d_out, it.d_in), V)
                torch.mm(Rg.view(B, -1).T, kept[i], out=prod)
                HVW.copy_(prod.view(Q, it.d_out, it.d_in))
                if Rh_in is not None:
                    prod = _buffer(scratch, (i, "HVT"), (it.d_out, Q * it.d_in), V)
                    torch.mm(g.T, Rh_in.view(B, -1), out=prod)
                    HVW += prod.view(it.d_out, Q, it.d_in).transpose(0, 1)
                if Vb is not None:
                    s, size = self.layout[it.bias]
                    HV[:, s : s + size] = torch.sum(
                        Rg, 0, out=_buffer(scratch, (i, "HVb"), (Q, it.d_out), V))
                if i == self.first:
                    break
                # Rg W + g V_q for every q: (B Q, d_out) @ (d_out, d_in) and
                # (B, d_out) @ (d_out, Q d_in).
                Vt = _buffer(scratch, (i, "VT"), (it.d_out, Q, it.d_in), V)
                Vt.copy_(VW.transpose(0, 1))
                below = _buffer(scratch, (i, "Rg"), (B, Q, it.d_in), V)
                torch.mm(Rg.view(B * Q, it.d_out), W, out=below.view(B * Q, it.d_in))
                below.view(B, -1).addmm_(g, Vt.view(it.d_out, -1))
                Rg = below
            elif kept[i] is not None:
                s1, s2 = kept[i]
                Rg.mul_(s1[:, None])
                if s2 is not None and tangents[i] is not None:
                    Rg.addcmul_(tangents[i], (s2 * g)[:, None])
        return HV, D, E
