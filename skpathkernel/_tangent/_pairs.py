"""Query-by-sample products of the decomposition, from the layers' factors.

Private engine behind :mod:`skpathkernel._analysis._decomposition`. One step ``t`` of the exact
decomposition pairs the queries' segment-averaged Jacobian
``rho_t(x) = sum_k w_k J(x; theta_t + s_k dtheta_t)`` (quadrature nodes ``k``) with the
per-sample loss gradients ``g_i = J(x_i; theta_t)^T r_i`` of the step's batch. For a
parameter with a rule (:mod:`._rules`) both sides are factored: node ``k`` gives
``delta_k(x) (outer) a_k(x)`` per output, sample ``i`` gives ``dhat_i (outer) a_i`` with
``dhat_i = sum_c r_ic delta_ic``. So:

- plain SGD (no memory, ``D = I``): the pair term is
  ``sum_k w_k (delta_k(x) . dhat_i) (a_k(x) . a_i)``, two small GEMMs per layer
  (:func:`factor_shares`, sample-major, every node of a chunk in one GEMM per
  factor), the same cost as a tangent Gram;
- a diagonal preconditioner ``D`` and / or a momentum memory: the pair term
  ``(delta_x * dhat_i)^T D (a_x * a_i)`` has no rank-one form, and with memory the
  queries' side is the adjoint ``lambda_t = sum_{u>=t} m^(u-t) coef_u D_u rho_u``, a
  full ``(queries x outputs) x P`` buffer (:class:`Adjoint`). It is updated per layer
  by one batched GEMM over the nodes (``sum_k w_k delta_k a_k^T``, never a Jacobian
  per node) fused with ``D`` and then contracted with the batch, accumulated in
  float64: with the batch's formed per-sample gradients ``dhat_i (x) a_i``, one GEMM
  over the whole parameter, or, with few adjoint rows and wide inputs, as
  ``(lambda a_i) . dhat_i`` (:func:`formed_contraction`). Both passes run in chunks of rows that
  stay in cache, so the buffer is read and written once per step. The memory factor is
  kept out of the buffer (``lambda = z S``, :class:`Adjoint`), which saves the pass that
  would scale it.

Layers without a rule come as dense terms (``a = None``, ``delta`` their per-sample
Jacobian) and go through the same code as a bias. :func:`pair_terms` brings a capture's
terms to this layout: one position and one group (nn.Linear on ``(n, d)``) keeps its
factors; a term over several positions (convolutions, sequences), a grouped or a
transposed one (an embedding) is formed as per-sample gradients first
(:func:`._contract.densify`), which is the cheaper form here: the adjoint is a dense
``(queries x outputs) x P`` buffer anyway, and contracting it with ``S`` positions of
a sample's factors costs ``S`` times the product with the sample's formed gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._contract import densify, rank_one, split_constant_inputs
from ._rules import Term
from ._stacked import _Scratch

__all__ = ["Adjoint", "Flat", "directional", "factor_shares", "formed_contraction",
           "pair_terms", "prepare_directions"]

# Bytes of one chunk of adjoint rows: a chunk is updated, then contracted with the batch,
# while it is still in cache. On a CPU with 2 MiB of L2 per core, 1-4 MiB chunks were
# within a few percent of each other (2-W-W-2 MLPs, W = 256, 512) and 256 KiB chunks 20%
# slower (Python overhead per chunk); a GPU takes the whole buffer at once.
CHUNK_BYTES = 2**21
# The contraction with the batch sums terms that cancel (Adam's preconditioner spans many
# decades): in float32 its round-off was 1.8e-5 relative on 2-256-256-2 (AdamW, 40 steps),
# 4x the 4.6e-6 of float64 accumulation, which costs 1.35x the time (a float64 copy of
# each cached chunk, then a float64 GEMM). The buffer itself stays in the path's dtype.
ACCUMULATE = torch.float64
# Rows that hold a difference of two quadrature rules (the decomposition's check) are
# small next to the shares, and asked for to a fraction of them: their contraction's
# round-off, relative to their own size, is far under it in float32 (float64 costs
# 1.35x, above).
COARSE = torch.float32


@dataclass
class Flat:
    """A term in the layout this module contracts: ``delta (n, C, p)``, inputs
    ``(name, a)`` with ``a (n, q)`` (parameter ``(p, q)``) or ``None`` (``p`` entries)."""

    delta: torch.Tensor
    inputs: list[tuple[str, torch.Tensor | None]]


def pair_terms(terms: Sequence[Term]) -> list[Flat]:
    """A capture's terms in :class:`Flat` layout, in a fixed order for a fixed network.

    Rank-one terms keep their factors; the others (several positions, groups, a
    transposed parameter) become per-sample gradients, and a bias over several positions
    its summed ``delta``.
    """
    out = []
    for term in terms:
        for part in split_constant_inputs(term):
            if not (rank_one(part) and not part.transposed):
                part_terms = densify(part)
            else:
                part_terms = [part]
            out.extend(Flat(t.delta[:, :, 0], [(name, None if a is None else a[:, 0])
                                               for name, a in t.inputs])
                       for t in part_terms)
    return out


class _Prepared(dict):
    """:func:`prepare_directions`' directions by name, and the buffers they are written
    to (``scratch``, None: fresh tensors)."""

    scratch = None


def prepare_directions(*vectors: Mapping[str, torch.Tensor], scratch=None) -> dict:
    """The directions of :func:`directional` as its GEMMs read them, for several calls
    with the same directions: by name, ``(v, v[0] ** 2)`` with ``v`` (k, p, q) stacked
    over the directions (``p`` the parameter's first dimension, found at the call).

    ``scratch``: a :class:`._stacked._Scratch` whose buffers hold them (and the merged
    directions :func:`directional` adds), overwritten by the next call with the same
    scratch: a walk over the steps prepares each step's directions in the same memory
    instead of allocating and freeing their multi-MB copies at every step (which
    fragmented glibc's heap: ``benchmarks/results/user_trial_memory-s52.md``)."""
    out = _Prepared()
    out.scratch = scratch
    for name in vectors[0]:
        rows = [vec[name].reshape(vec[name].shape[0] if vec[name].dim() else 1, -1)
                for vec in vectors]
        if scratch is None:
            v = torch.stack(rows)
            out[name] = (v, v[0] ** 2)
            continue
        v = torch.stack(rows, out=scratch.get(("v", name), (len(rows), *rows[0].shape),
                                              rows[0].dtype))
        out[name] = (v, torch.pow(v[0], 2, out=scratch.get(("v2", name), v.shape[1:],
                                                              v.dtype)))
    return out


def directional(nodes: Sequence[Sequence[Flat]], weights: Sequence[float],
                *vectors: Mapping[str, torch.Tensor],
                prepared: dict | None = None,
                spread: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_k w_k J(x; node k) . v`` (n, C) in float64 from the factors, per ``v``.

    ``v[name]`` is a parameter-shaped direction in float64. The factors are promoted to
    float64 so that the products add no round-off of the factors' dtype to their own.
    Per term, all its inputs (a bias's is a column of ones) and all nodes go through one
    GEMM with the directions, and the sum over the nodes and the term's units is one
    batched product per query (nodes ``k`` and units ``p`` in one inner dimension):
    the exact decomposition calls this for every chunk of queries at every step, with
    ten to a hundred rows, so the number of torch calls is its cost (two einsums per
    input were most of its time in a profile of ``attribute`` on the default classifier).
    ``prepared``: the directions through :func:`prepare_directions` instead
    of ``vectors``; the merged directions of a term are kept in it for the next call.
    ``spread=False``: no spread (None), one GEMM less per term.

    Returns
    -------
    out : tensor of float64, shape (len(vectors), n, C)
    spread : tensor of float64, shape (n, C)
        The 2-norm of the terms of the first product,
        ``sqrt(sum_k w_k^2 sum_p (J_kp v_p)^2)``: the factors' relative round-off
        ``eps`` moves the product by about ``eps * spread``.
    """
    n, C = nodes[0][0].delta.shape[:2]
    if prepared is None:
        prepared = prepare_directions(*vectors)
    k, m = next(iter(prepared.values()))[0].shape[0], len(nodes)
    device = nodes[0][0].delta.device
    w = torch.as_tensor(weights, dtype=torch.float64, device=device)
    out = torch.zeros((n, C, k), dtype=torch.float64, device=device)
    norm = torch.zeros((n, C, 1), dtype=torch.float64, device=device) if spread else None
    for j, term in enumerate(nodes[0]):
        p = term.delta.shape[-1]
        # All nodes' backprops, weighted, nodes next to units: (n, C, m, p).
        d = torch.stack([node[j].delta for node in nodes], dim=2).to(torch.float64)
        d *= w.view(1, 1, m, 1)
        vt, v2t = _merged(prepared, term, k, p)
        # The term's inputs side by side, rows (query, node); a bias's input is 1.
        widths = [1 if a is None else a.shape[1] for _, a in term.inputs]
        A = torch.ones((n, m, sum(widths)), dtype=torch.float64, device=device)
        col = 0
        for i, width in enumerate(widths):
            if term.inputs[i][1] is not None:
                for s, node in enumerate(nodes):
                    A[:, s, col : col + width] = node[j].inputs[i][1]
            col += width
        A = A.view(n * m, -1)
        av = (A @ vt).view(n, m, k, p).transpose(1, 2).reshape(n, k, m * p)
        out += torch.bmm(d.view(n, C, m * p), av.transpose(1, 2))
        if spread:
            # sum_oj (delta_o v_oj a_j)^2 = (delta^2)^T (v^2) (a^2), one more GEMM.
            av2 = (A.square_() @ v2t).view(n, m * p, 1)
            norm += torch.bmm(d.square_().view(n, C, m * p), av2)
    out = out.permute(2, 0, 1).contiguous()
    return out, (norm.view(n, C).sqrt_() if spread else None)


def _merged(prepared: dict, term: Flat, k: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A term's directions, its inputs' side by side as ``directional``'s GEMMs read
    them: ``(q_all, k p)`` and the squared first direction ``(q_all, p)``; made once
    per ``prepared`` (the same step) and term."""
    # Keyed by the width too: two terms may read parameters of the same names.
    key = (p, *(name for name, _ in term.inputs))
    if key not in prepared:
        vs, v2s = [], []
        for name, _ in term.inputs:
            v, v2 = prepared[name]
            vs.append(v.reshape(k, p, -1))
            v2s.append(v2.reshape(p, -1))
        # Into the walk's held buffers where there are (prepare_directions' scratch).
        scratch, width = prepared.scratch, sum(v.shape[2] for v in vs)
        vt = None if scratch is None else scratch.get(("vt", key), (width, k * p), vs[0].dtype)
        v2t = None if scratch is None else scratch.get(("v2t", key), (width, p), v2s[0].dtype)
        prepared[key] = (torch.cat([v.reshape(k * p, -1).T for v in vs], out=vt),
                         torch.cat([v2.T for v2 in v2s], out=v2t))
    return prepared[key]


def factor_shares(nodes: Sequence[Sequence[Flat]], weights: Sequence[float],
                  batch: Sequence[Flat], dhat: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k w_k J(x; node k) J(x_i)^T r_i`` for every sample and query: (m, n, C).

    Plain SGD's pair term, ``D = I``: per term ``(dhat_i . delta_k(x))`` times the sum
    over its inputs of ``(a_i . a_k(x))`` (1 for a bias), in float64. Sample-major, as
    the decomposition adds a step's shares to the rows of its batch's samples (an
    ``index_add_`` of contiguous rows; query-major rows cost a scattered write per
    query and sample).
    All nodes' rows go through one GEMM per factor and the nodes are summed in one pass:
    the decomposition calls this per chunk of queries and step, with tens to hundreds
    of rows, where the number of torch calls is much of the cost.
    """
    m = len(nodes)
    w = torch.as_tensor(weights, dtype=torch.float64,
                        device=nodes[0][0].delta.device).view(1, m, 1, 1)
    out = None
    for j, (ty, dh) in enumerate(zip(batch, dhat)):
        n, C, p = nodes[0][j].delta.shape
        # One node's factors are read in place: a copy (what torch.cat makes of one
        # tensor) can take another float32 kernel, so a step of one node keeps the
        # query-major shares' bits; several nodes' rows stacked round at float32 level.
        d = (nodes[0][j].delta.reshape(n * C, p) if m == 1
             else torch.cat([node[j].delta.reshape(n * C, p) for node in nodes]))
        # Each GEMM in the orientation the query-major shares took: a transposed
        # product may run another float32 kernel (8e-8 relative measured on a chunk of
        # four queries); copied sample-major into float64 instead, one pass.
        Gd = _sample_major(d @ dh.T).view(-1, m, n, C)
        # The inputs' Gram, summed over the term's parameters (a bias's input is 1).
        Ga, ones = None, 0
        for i, (_, ay) in enumerate(ty.inputs):
            if ay is None:
                ones += 1
                continue
            ax = (nodes[0][j].inputs[i][1] if m == 1
                  else torch.cat([node[j].inputs[i][1] for node in nodes]))
            G = _sample_major(ax @ ay.T)
            Ga = G if Ga is None else Ga.add_(G)
        if Ga is None:
            Gd.mul_(ones * w)
        else:
            if ones:
                Ga.add_(ones)
            Gd.mul_(Ga.view(-1, m, n, 1).mul_(w))
        share = Gd[:, 0] if m == 1 else Gd.sum(1)
        out = share if out is None else out.add_(share)
    return out


def _sample_major(G: torch.Tensor) -> torch.Tensor:
    """A (rows, samples) product as float64 (samples, rows): one transposing copy."""
    return torch.empty((G.shape[1], G.shape[0]), dtype=torch.float64,
                       device=G.device).copy_(G.T)


class Adjoint:
    """The adjoint ``lambda = z S`` of a block of queries, stored per parameter.

    ``S[name]`` has shape ``(n * C, p, q)`` (a weight-like parameter with factors) or
    ``(n * C, p)`` (a bias, or a dense fallback term), rows ordered ``(query, output)``;
    ``z`` is a float. One step (:meth:`step`) sets ``lambda_t = m lambda_{t+1} + coef D
    rho_t``: ``z <- m z`` and ``S += (coef / z) D rho_t``, so that the memory costs no
    pass over the buffer (``S`` is rescaled when ``z`` gets small). Without memory
    (``m = 0``) ``S = D rho_t`` and ``z = coef``.

    The queries come in groups, each with its own quadrature nodes (the decomposition's
    chunks of queries, whose node counts differ): a group's rows are updated from its
    own nodes, with the products a buffer of that group alone would take, and the whole
    buffer is contracted with the batch at once. So the batch's formed gradients are made
    once per step, and the contraction's GEMM has every row of the block.

    Parameters
    ----------
    like : list of Flat
        Terms of a capture of the queries (only their shapes are used).
    memory : float
        The first-moment memory ``m`` (0 for RMSprop).
    n : int, optional
        The queries of the buffer, those of ``like`` by default.
    coarse : int, optional
        The first query whose rows are contracted with a batch in ``COARSE`` (float32)
        instead of ``ACCUMULATE``: rows that hold a difference small next to the
        shares (the decomposition's check of its quadrature), none by default.
    """

    def __init__(self, like: Sequence[Flat], memory: float, n: int | None = None,
                 coarse: int | None = None):
        self.memory = float(memory)
        self.z = None
        self.S: dict[str, torch.Tensor] = {}
        n0, C = like[0].delta.shape[:2]
        self.C = C
        self.rows = (n0 if n is None else n) * C
        self.coarse = self.rows if coarse is None else coarse * C
        delta = like[0].delta
        for term in like:
            p = term.delta.shape[2]
            for name, a in term.inputs:
                shape = (self.rows, p) if a is None else (self.rows, p, a.shape[1])
                self.S[name] = torch.zeros(shape, dtype=delta.dtype, device=delta.device)
        self.cpu = delta.device.type == "cpu"
        # The products with the batch, (rows, p, m), and a chunk's copies, held from step
        # to step (one of each, as large as the largest parameter's): fresh ones at every
        # step and parameter (tens of MB on a 1000-wide layer) were freed again at once,
        # and glibc's heap kept the fragments (``benchmarks/results/
        # user_trial_memory-s52.md``).
        self._held = _Scratch(delta.device)

    @staticmethod
    def scratch_bytes(rows: int, largest: int, dense: int, itemsize: int, *, cpu: bool,
                      update: bool, decay: bool) -> int:
        """The most bytes a step's pass holds beside the buffer of ``rows`` rows, whose
        largest parameter has ``largest`` entries per row, and its largest term without
        factors (a bias, a dense term) ``dense`` (``itemsize`` bytes each).

        A weight's chunk of rows (:meth:`_chunks`: at most ``CHUNK_BYTES`` on the CPU,
        all rows elsewhere) takes its products with the nodes in a scratch copy before
        the preconditioner (``update``: a memory and a preconditioner), a float64 copy
        for the contraction (a buffer in another dtype) and a float64 product with the
        decay (``decay``); a term without factors takes the same copies of all its rows.
        Measured on a 64-wide MLP on digits (Adam, float32): 492 of the 830 kB a query
        held, beside its 192 kB of buffer.
        """
        part = rows * largest * itemsize
        if cpu:  # a bound for every weight: a chunk holds one row at least
            part = min(part, max(CHUNK_BYTES, largest * itemsize))
        part = max(part, rows * dense * itemsize)
        copies = int(update) * itemsize + 8 * (int(itemsize != 8) + int(decay))
        return part // itemsize * copies

    def _chunks(self, S: torch.Tensor):
        """Row slices of ``S`` of about CHUNK_BYTES (all rows off the CPU)."""
        per_row = S[0].numel() * S.element_size()
        size = max(1, CHUNK_BYTES // per_row) if self.cpu else self.rows
        return [slice(i, min(i + size, self.rows)) for i in range(0, self.rows, size)]

    def step(self, groups: Sequence[tuple[slice, Sequence[Sequence[Flat]], Sequence[float]]],
             coef: float, D: Mapping[str, torch.Tensor] | None, batch: Sequence[Flat],
             dhat: Sequence[torch.Tensor], decay: Mapping[str, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Update to step t's adjoint and contract it with (a block of) the batch.

        Parameters
        ----------
        groups : list of (slice, list over nodes of list of Flat, list of float)
            Per group of queries: its queries (a slice of the buffer's), their factors
            at the group's quadrature nodes of step t and the nodes' weights. The groups
            cover the buffer's queries.
        coef : float
            The step's scale, ``-lr_t`` times Adam's bias correction.
        D : mapping of str to tensor or None
            The preconditioner per parameter (parameter-shaped), None for the identity.
        batch, dhat : list of Flat, list of tensor, or None
            The batch's factors at ``theta_t`` and, per term, its loss-gradient
            backprops ``dhat_i = sum_c r_ic delta_ic`` (m, p); None for
            a step without samples (the update alone).
        decay : mapping of str to tensor, optional
            L2 weight decay ``wd theta_t`` per parameter: ``lambda_t . decay`` is
            returned too.

        Returns
        -------
        shares : tensor of float64, shape (n * C, m), or None
            ``lambda_t . g_i`` for the m samples of the batch (None without a batch).
        reg : tensor of float64, shape (n * C,), or None
            ``lambda_t . decay``.
        """
        if self.memory:
            self.z = 1.0 if self.z is None else self.z * self.memory
            if self.z < 1e-6:
                # S alone would grow as m^-t: fold z in before it leaves the dtype's range.
                for S in self.S.values():
                    S.mul_(self.z)
                self.z = 1.0
            alpha = coef / self.z
        else:
            self.z, alpha = coef, 1.0
        return self._pass(groups, alpha, D, batch, dhat, decay)

    def add(self, groups: Sequence[tuple[slice, Sequence[Sequence[Flat]], Sequence[float]]],
            coef: float, D: Mapping[str, torch.Tensor] | None) -> None:
        """``lambda += coef D rho`` without a step of the memory (memory > 0 only).

        Nesterov's step: its own-gradient term ``direct_t D_t rho_t`` belongs to
        ``lambda_t`` but not to the memory carried to earlier steps, so it is added with
        :meth:`step` and taken off again here once the step's batch is contracted.

        Parameters
        ----------
        groups, D
            As in :meth:`step`, for the step just taken.
        coef : float
            The scale of ``D rho``.
        """
        if not self.memory:
            raise ValueError("Adjoint.add needs a first-moment memory (S holds lambda / z).")
        self._pass(groups, coef / self.z, D, None, None, None)

    def contract(self, batch: Sequence[Flat], dhat: Sequence[torch.Tensor]) -> torch.Tensor:
        """``lambda_t . g_i`` for another block of the step's batch, (n * C, m) float64."""
        return self._pass(None, None, None, batch, dhat, None)[0]

    def _pass(self, groups, alpha, D, batch, dhat, decay):
        """Update (``groups`` given) and / or contract (``batch`` given), term by term."""
        shares = None
        device = next(iter(self.S.values())).device
        reg = None if decay is None else torch.zeros(self.rows, dtype=torch.float64,
                                                     device=device)
        C = self.C
        like = groups[0][1][0] if groups is not None else batch
        for j, term in enumerate(like):
            # Per group: its rows of the buffer and the nodes' weighted backprops, rows
            # (query, output): (rows, p, n_nodes).
            U = None if groups is None else [
                (slice(g.start * C, g.stop * C), torch.stack(
                    [w * node[j].delta for node, w in zip(nodes, weights)], dim=-1
                ).reshape((g.stop - g.start) * C, term.delta.shape[2], len(nodes)))
                for g, nodes, weights in groups]
            for i, (name, _) in enumerate(term.inputs):
                S = self.S[name]
                d = None if D is None else D[name].reshape(S.shape[1:])
                v = None if decay is None else decay[name].reshape(S.shape[1:])
                a_b = None if batch is None else batch[j].inputs[i][1]
                part = None
                if S.ndim == 2:
                    for rows, Ug in U or ():
                        self._update_bias(S[rows], Ug, d, alpha)
                    if batch is not None:
                        part = S.to(ACCUMULATE) @ dhat[j].T.to(ACCUMULATE)
                    if v is not None:
                        reg += (S.to(ACCUMULATE) @ v.to(ACCUMULATE)).to(torch.float64)
                else:
                    UV = None
                    if U is not None:
                        UV = []
                        for (rows, Ug), (_, nodes, _) in zip(U, groups):
                            V = torch.stack([node[j].inputs[i][1] for node in nodes], dim=1)
                            # One row of V per query, shared by its C outputs.
                            UV.append((rows, Ug, V.repeat_interleave(C, dim=0) if C > 1
                                       else V))
                    part = self._weight(S, UV, d, alpha, a_b,
                                        None if batch is None else dhat[j], v, reg)
                if part is not None:
                    part = part.to(torch.float64)
                    shares = part if shares is None else shares.add_(part)
        if shares is not None:
            shares.mul_(self.z)
        return shares, None if reg is None else reg.mul_(self.z)

    def _update_bias(self, S, U, d, alpha):
        rho = U.sum(-1)
        if not self.memory:
            S.copy_(rho if d is None else rho.mul_(d))
        elif d is None:
            S.add_(rho, alpha=alpha)
        else:
            S.addcmul_(rho, d, value=alpha)

    def _weight(self, S, UV, d, alpha, a_b, dhat_b, v, reg):
        """Chunk by chunk: ``S += alpha d * (U @ V)`` (each group on its rows, when
        ``UV`` is given), then ``S . (dhat_i (x) a_i)`` and ``S . v`` while the chunk is
        in cache."""
        rows, p, q = S.shape
        m = 0 if a_b is None else a_b.shape[0]
        formed = a_b is not None and formed_contraction(rows, q)
        T1 = G = None
        if formed:
            # The batch's per-sample gradients dhat_i (x) a_i, (m, p q): each chunk of
            # rows is then one GEMM over the whole parameter, with no (rows, p, m)
            # intermediate and no pass over it.
            G = (dhat_b.to(ACCUMULATE)[:, :, None] * a_b.to(ACCUMULATE)[:, None, :])
            G = G.view(m, p * q)
            T1 = torch.empty((rows, m), dtype=ACCUMULATE, device=S.device)
        elif a_b is not None:
            T1 = self._held.get("T1", (rows, p, m), ACCUMULATE)
        A = None if a_b is None or formed else a_b.to(ACCUMULATE)
        # A float64 buffer's coarse rows are read in place: a float32 copy gained nothing.
        cut = self.coarse if S.dtype == COARSE else rows
        Tc = Gc = Ac = None
        chunks = self._chunks(S)
        if T1 is not None and cut < rows:
            # A chunk's coarse products, copied into T1's rows (one chunk's worth held).
            Tc = torch.empty((chunks[0].stop,) + T1.shape[1:], dtype=COARSE, device=S.device)
            if formed:
                Gc = (dhat_b.to(COARSE)[:, :, None] * a_b.to(COARSE)[:, None, :]).view(m, p * q)
            else:
                Ac = a_b.to(COARSE)
        scratch = wide = None
        if UV is not None and self.memory and d is not None:
            scratch = self._held.get("scratch", S[chunks[0]].shape, S.dtype)
        if S.dtype != ACCUMULATE and (T1 is not None or v is not None):
            wide = self._held.get("wide", S[chunks[0]].shape, ACCUMULATE)
        if v is not None:
            Sv = torch.empty((rows, p), dtype=ACCUMULATE, device=S.device)
            v = v.to(ACCUMULATE)
        for sl in chunks:
            Sc = S[sl]
            for g, U, V in UV or ():
                # The group's rows in this chunk, updated by the group's own products.
                lo, hi = max(sl.start, g.start), min(sl.stop, g.stop)
                if lo >= hi:
                    continue
                Sg, at = S[lo:hi], slice(lo - g.start, hi - g.start)
                if not self.memory:
                    torch.bmm(U[at], V[at], out=Sg)
                    if d is not None:
                        Sg.mul_(d)
                elif d is None:
                    Sg.baddbmm_(U[at], V[at], alpha=alpha)
                else:
                    tmp = scratch[: hi - lo]
                    torch.bmm(U[at], V[at], out=tmp)
                    Sg.addcmul_(tmp, d, value=alpha)
            if T1 is None and v is None:
                continue
            # The chunk's rows from k on are coarse; the float64 copy takes the others
            # (all of them for the decay's product).
            k = min(max(cut, sl.start), sl.stop)
            end = sl.stop if v is not None else k
            Sw = Sc if wide is None else wide[: end - sl.start].copy_(S[sl.start : end])
            for at, Sx, Gx, Ax, T in (
                    (slice(sl.start, k), Sw[: k - sl.start], G, A, T1),
                    (slice(0, sl.stop - k), S[k : sl.stop], Gc, Ac, Tc)):
                if T is None or at.start == at.stop:
                    continue
                if formed:
                    torch.mm(Sx.reshape(-1, p * q), Gx.T, out=T[at])
                else:
                    # (S a_i) for every sample: a GEMM over the layer's inputs q.
                    torch.matmul(Sx.reshape(-1, q), Ax.T, out=T[at].view(-1, m))
                if T is Tc:
                    T1[k : sl.stop].copy_(Tc[at])
            if v is not None:
                torch.sum(Sw * v, dim=-1, out=Sv[sl])
        if v is not None:
            reg += Sv.to(torch.float64).sum(-1)
        if T1 is None or formed:
            return T1
        # The sum over the layer's outputs p: (rows, p, m) . (m, p).
        return T1.mul_(dhat_b.T.to(ACCUMULATE)).sum(1)


def formed_contraction(rows: int, q: int) -> bool:
    """Whether the adjoint's ``rows`` contract a weight with inputs of width ``q``
    through the batch's formed per-sample gradients rather than its factors.

    Both forms take ``2 rows p q m`` FLOPs (``m`` samples, ``p`` outputs). The factors
    leave a ``(rows, p, m)`` product to be multiplied by ``dhat`` and summed over
    ``p``, two passes over memory; forming ``dhat_i (x) a_i`` is one pass over
    ``(m, p, q)``. So the formed gradients win when ``q <= rows``: measured on one
    thread (float64 accumulation, m = 200, a 64-65 layer), 0.0048 s against 0.0093 s
    per step at 100 rows and 0.044-0.056 s against 0.137 s at 1000 rows.
    """
    return q <= rows
