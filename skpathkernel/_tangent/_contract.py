"""Contractions of one term's factors, and the cost model that picks one per term and call.

A term (:class:`._rules.Term`) of a rule layer gives, for every sample, output ``c`` and
parameter, the per-sample gradient ``G_c = sum_s delta[c, s] (outer) a[s]`` over the ``S``
positions where the weight is applied (``p x q``, block-diagonal in ``g`` groups). Two
contractions give the same Gram entries ``sum_c <G_c(x), G_c(x')>`` exactly:

* per-sample gradient blocks ("dense"): form ``G`` for every sample, ``N S C p q / g``
  multiply-adds (``M S C p q / g`` more for a second set ``Y``), then one GEMM of the
  blocks, ``N M C p q / g`` (``N M C^2 p q / g`` for the ``C x C`` blocks of "full"; half
  for a symmetric ``K(X, X)``). Memory: ``C p q / g`` numbers per sample of a block.
* position pairs ("pair"): ``sum_{s, s'} (a[s] . a'[s']) (delta[s] . delta'[s'])`` per
  group, ``N M S_x S_y (q + C p)`` multiply-adds (``q + C^2 p`` for "full"), never forming
  ``G``. Memory: ``S_x S_y (g + 2)`` numbers per pair of samples of two blocks (times
  ``C^2`` for "full").

One position (``S = 1``, ``g = 1``: nn.Linear on ``(n, d)``) is the rank-one case,
``(a . a') (delta . delta')`` at ``N M (q + C p)``: kept as it is. For ``S > 1`` the engine
takes the cheaper form by the counts above (:func:`gram_route`), and the dense form when a
single sample's blocks do not fit the memory budget's share. A convolution over many
positions (``S^2 (q + C p) >> C p q``) takes the dense form; a wide Linear on a few tokens
takes the pair form. A diagonal preconditioner (Adam, RMSprop) breaks the product
structure of the pair form: weighted Grams take the dense form for ``S > 1``, and when
every term's blocks fit the budget they are all formed once, scaled by ``sqrt(D)``
(``J D J'^T = (J sqrt(D)) (J' sqrt(D))^T``), and multiplied as an unweighted Gram. The
random projection never forms ``G``: ``sum_s (delta[s] . u) (a[s] . v)`` costs
``S k (C p + q)`` per sample.

An embedding's factor is one-hot (``a[s] = e_{i_s}``, ``q`` the table's rows): its term
carries the ids instead (``Term.rows``, an index term), so that no cost scales with the
vocabulary but the table's own blocks. Then ``a[s] . a'[s'] = [i_s == i'_s']``, one
comparison (the pair form costs ``N M S_x S_y (1 + C p)``), ``G`` is ``delta`` scattered
into the rows of the ids (``N C (rows p + S p)`` to form), ``a[s] . v = v[i_s]`` is a
gather, and a diagonal ``D`` keeps the pair form: the two sides of a pair meet in one
row, so ``D``'s row of the id scales one side's ``delta`` (:func:`index_scaled`).
"""

from __future__ import annotations

import dataclasses

import torch

from ._rules import Term

__all__ = ["dense_grad", "dense_rows", "densify", "gram_route", "grad_times", "index_scaled",
           "one_hot", "pair_diag", "pair_gram", "param_numel", "project_term", "rank_one",
           "row_order", "split_constant_inputs"]


def rank_one(term: Term) -> bool:
    """One position, one group: the Gram's ``(a . a') (delta . delta')`` form applies.

    Not for an index term (``term.rows``): its products are index equalities, which the
    position-pair contractions handle (one position is one pair)."""
    return term.delta.shape[2] == 1 and term.groups == 1 and term.rows is None


def param_numel(term: Term, a: torch.Tensor | None) -> int:
    """Entries of the parameter that ``a`` (one of ``term.inputs``) stands for."""
    p = term.delta.shape[3]
    if a is None:
        return p
    return p * (term.rows if term.rows is not None else a.shape[2] // term.groups)


def one_hot(term: Term) -> Term:
    """An index term (``term.rows``) with its one-hot ``(n, S, rows)`` factors formed, for
    the consumers that contract factors as matrices (path-kernel pairs, decompositions);
    other terms as they are."""
    if term.rows is None:
        return term
    dtype = term.delta.dtype
    return Term(delta=term.delta, transposed=True,
                inputs=[(name, torch.nn.functional.one_hot(a.long(), term.rows).to(dtype))
                        for name, a in term.inputs])


def index_scaled(term: Term, values: torch.Tensor) -> Term:
    """An index term with each position's ``delta`` multiplied by its id's row of
    ``values`` (the parameter's ``rows * p`` entries, flat: a diagonal preconditioner or
    its square root).

    A one-hot row meets only its own row of the table: ``<G, D G'>`` is the position-pair
    sum of ``[i_s == i'_s'] (delta[s] * D[i_s]) . delta'[s']``, the unweighted pair Gram
    of this term and the other side's.
    """
    ((name, a),) = term.inputs
    n, C, S, p = term.delta.shape
    rows = values.reshape(term.rows, p)[a.long()].to(term.delta.dtype)  # (n, S, p)
    return dataclasses.replace(term, delta=term.delta * rows.unsqueeze(1))


def _rows_flat(term: Term, a: torch.Tensor) -> torch.Tensor:
    """Flat row of every ``(sample, output, position)`` in an ``(n C rows, p)`` block."""
    n, C, S, _ = term.delta.shape
    base = torch.arange(n * C, device=a.device).reshape(n, C, 1) * term.rows
    return (base + a.long().unsqueeze(1)).reshape(-1)


def split_constant_inputs(term: Term) -> list[Term]:
    """Normalise a term: constant (``None``) inputs get their own one-position term.

    A bias's gradient is ``delta`` summed over the positions: summed once here, it is a
    small dense term. Only a rank-one, untransposed term keeps a weight and its bias
    together (the Gram's ``(a . a' + 1)`` shortcut).
    """
    constant = [(name, a) for name, a in term.inputs if a is None]
    factored = [(name, a) for name, a in term.inputs if a is not None]
    if not constant or factored and rank_one(term) and not term.transposed:
        return [term]
    delta = term.delta if term.delta.shape[2] == 1 else term.delta.sum(2, keepdim=True)
    summed = Term(delta=delta, inputs=constant)
    if not factored:
        return [summed]
    return [dataclasses.replace(term, inputs=factored), summed]


def _grouped(term: Term, a: torch.Tensor):
    """``delta`` as ``(n, C, S, g, p / g)`` and ``a`` as ``(n, S, g, q / g)``."""
    n, C, S, p = term.delta.shape
    g = term.groups
    return term.delta.reshape(n, C, S, g, p // g), a.reshape(n, S, g, a.shape[2] // g)


def row_order(term: Term, a: torch.Tensor | None) -> str:
    """The order :func:`dense_grad` forms a sample's row in with ``order="any"``.

    "flat", or "qp": the ``C p x q`` block of a term with positions formed transposed,
    ``q x C p``. A GEMM whose result rows are not a whole number of 16 floats (a
    convolution on RGB or 1x1 inputs: 27, 75 or 9 patch columns) measured 1.5-2.5x slower
    than the same product transposed on the CPUs tried (one thread, AVX-512); rows of
    ``C p`` outputs x channels are whole.
    """
    if a is None or term.transposed or term.groups != 1:
        return "flat"
    _, C, S, p = term.delta.shape
    q = a.shape[2]
    return "qp" if S > 1 and q % 16 and not C * p % 16 else "flat"


def dense_grad(term: Term, a: torch.Tensor | None,
               out: torch.Tensor | None = None, order: str = "flat") -> torch.Tensor:
    """Per-sample gradients ``(n, C, numel)`` of one parameter of ``term``.

    ``out`` (a possibly strided ``(n, C, numel)`` view) receives them: for the rank-one
    case without a temporary (a fresh tensor of this size costs a page fault per 4 KiB on
    first touch). ``order``: "flat", each output's gradient in the parameter's flat
    order; "any", each sample's ``C numel`` entries in the order :func:`row_order` picks
    by shape, the same for every sample and call: only for products of whole rows (a
    trace Gram without a preconditioner), where the order of the entries cancels.
    """
    delta = term.delta
    n, C, S, p = delta.shape
    if order == "any" and row_order(term, a) == "qp":
        # (q x S) @ (S x C p): a convolution's patches and delta are both position-last
        # in memory, so neither transpose is a copy.
        q = a.shape[2]
        d = delta.transpose(2, 3).reshape(n, C * p, S).transpose(1, 2)
        if out is not None and out.is_contiguous():
            torch.bmm(a.transpose(1, 2), d, out=out.view(n, q, C * p))
            return out
        G = torch.bmm(a.transpose(1, 2), d).reshape(n, C, -1)
        return G if out is None else out.copy_(G)
    if a is None:
        g = delta[:, :, 0] if S == 1 else delta.sum(2)
        return g if out is None else out.copy_(g)
    if term.rows is not None:
        # The (rows, p) table of each sample and output: delta scattered into the rows of
        # the ids, n C S p additions, instead of a product with the one-hot factor.
        G = delta.new_zeros((n, C, term.rows * p)) if out is None else out.zero_()
        if G.is_contiguous():
            flat = G.view(n * C * term.rows, p)
            flat.index_add_(0, _rows_flat(term, a), delta.reshape(n * C * S, p))
        else:
            # A strided view (a parameter's columns of the features): in place.
            shape = (n, C, S)
            at = (torch.arange(n, device=a.device).reshape(n, 1, 1).expand(shape),
                  torch.arange(C, device=a.device).reshape(1, C, 1).expand(shape),
                  a.long().unsqueeze(1).expand(shape))
            G.unflatten(2, (term.rows, p)).index_put_(at, delta, accumulate=True)
        return G
    if S == 1 and term.groups == 1 and not term.transposed:
        d = delta[:, :, 0]
        if out is None:
            return (d.unsqueeze(-1) * a.reshape(n, 1, 1, -1)).reshape(n, C, -1)
        torch.mul(d.unsqueeze(-1), a.reshape(n, 1, 1, -1), out=out.unflatten(2, (p, -1)))
        return out
    if term.transposed:
        G = torch.einsum("ncsp,nsq->ncqp", delta, a)
    elif term.groups == 1:
        # One GEMM per sample, (C p x S) @ (S x q): a convolution's delta arrives
        # position-last in memory, so the transpose is free.
        dT = delta.transpose(2, 3).reshape(n, C * p, S)
        q = a.shape[2]
        if out is not None and out.is_contiguous():
            torch.bmm(dT, a, out=out.view(n, C * p, q))
            return out
        G = torch.bmm(dT, a)
    else:
        dg, ag = _grouped(term, a)
        G = torch.einsum("ncsgi,nsgj->ncgij", dg, ag)
    G = G.reshape(n, C, -1)
    return G if out is None else out.copy_(G)


def dense_rows(terms: list[Term], layout: dict[str, tuple[int, int]],
               out: torch.Tensor) -> torch.Tensor:
    """Every term's per-sample gradients written into their columns of ``out`` (n, C, P):
    ``layout`` maps each parameter to its ``(start, numel)`` in the flat vector."""
    for term in terms:
        for name, a in term.inputs:
            start, numel = layout[name]
            dense_grad(term, a, out=out[:, :, start : start + numel])
    return out


def densify(term: Term, order: str = "flat") -> list[Term]:
    """The term as dense per-sample gradients: one ``None``-input term per parameter,
    each owning its tensor (constant inputs sharing ``delta`` get copies); ``order`` as
    :func:`dense_grad`'s."""
    shared = len(term.inputs) > 1
    return [Term(delta=(dense_grad(term, a).clone() if a is None and shared
                        else dense_grad(term, a, order=order)).unsqueeze(2),
                 inputs=[(name, None)])
            for name, a in term.inputs]


def _input_products(tx: Term, ty: Term) -> torch.Tensor:
    """``sum_inputs a a'^T`` per group: ``(g, n S_x, m S_y)``; a constant input adds 1."""
    n, _, S, _ = tx.delta.shape
    m, _, T, _ = ty.delta.shape
    g = tx.groups
    A, ones = None, 0
    for (_, ax), (_, ay) in zip(tx.inputs, ty.inputs):
        if ax is None:
            ones += 1
            continue
        if tx.rows is not None:
            # One-hot rows: their product is 1 where the ids agree.
            prod = (ax.reshape(1, n * S, 1) == ay.reshape(1, 1, m * T)).to(tx.delta.dtype)
            A = prod if A is None else A.add_(prod)
            continue
        qg = ax.shape[2] // g
        xa = ax.reshape(n * S, g, qg).transpose(0, 1)
        ya = ay.reshape(m * T, g, qg).transpose(0, 1)
        prod = torch.bmm(xa, ya.transpose(1, 2))
        A = prod if A is None else A.add_(prod)
    if ones:
        A += ones
    return A


def pair_gram(tx: Term, ty: Term, mode: str) -> torch.Tensor:
    """Gram block of one term from position pairs: ``(n, m)`` trace or ``(n, C, m, C)``."""
    n, C, S, p = tx.delta.shape
    m, _, T, _ = ty.delta.shape
    g = tx.groups
    pg = p // g
    A = _input_products(tx, ty)
    if mode == "full":
        dx = tx.delta.reshape(n, C, S, g, pg).permute(3, 0, 2, 1, 4).reshape(g, n * S * C, pg)
        dy = ty.delta.reshape(m, C, T, g, pg).permute(3, 0, 2, 1, 4).reshape(g, m * T * C, pg)
        D = torch.bmm(dx, dy.transpose(1, 2)).reshape(g, n, S, C, m, T, C)
        return D.mul_(A.reshape(g, n, S, 1, m, T, 1)).sum((0, 2, 5))
    dx = tx.delta.reshape(n, C, S, g, pg).permute(3, 0, 2, 1, 4).reshape(g, n * S, C * pg)
    dy = ty.delta.reshape(m, C, T, g, pg).permute(3, 0, 2, 1, 4).reshape(g, m * T, C * pg)
    H = torch.bmm(dx, dy.transpose(1, 2)).mul_(A).sum(0).reshape(n, S, m, T).sum((1, 3))
    return H / C if C > 1 else H


def pair_diag(term: Term, mode: str, left: Term | None = None) -> torch.Tensor:
    """``K(x, x)`` of one term from position pairs: ``(n,)`` trace or ``(n, C, C)``.

    ``left``: the term with another ``delta`` on the left of each product (an index
    term scaled by a preconditioner, :func:`index_scaled`)."""
    n, C, S, p = term.delta.shape
    g = term.groups
    A = 0
    for _, a in term.inputs:
        if a is None:
            A = A + 1
            continue
        if term.rows is not None:
            A = A + (a.unsqueeze(2) == a.unsqueeze(1)).to(term.delta.dtype).unsqueeze(1)
            continue
        ag = a.reshape(n, S, g, -1)
        A = A + torch.einsum("nsgj,ntgj->ngst", ag, ag)
    delta = term.delta.reshape(n, C, S, g, p // g)
    E = torch.einsum("ngst,nctgi->ncsgi", A, delta)
    if left is not None:
        delta = left.delta.reshape(n, C, S, g, p // g)
    if mode == "full":
        return torch.einsum("ncsgi,ndsgi->ncd", delta, E)
    return (delta * E).sum((1, 2, 3, 4)) / C


def pair_diag_bytes(term: Term, itemsize: int) -> int:
    """Bytes of :func:`pair_diag`'s intermediates per sample."""
    _, C, S, p = term.delta.shape
    return itemsize * (term.groups * S * S + 2 * C * S * p)


def grad_times(term: Term, a: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """``G v`` per sample and output: the parameter as a matrix ``(rows, cols)`` in flat
    order (``(p, q / g)``, or ``(q, p)`` when transposed) times ``v`` of size ``cols``.

    A constant input is a ``(p, 1)`` matrix. Returns ``(n, C, rows)``; used by the
    autograd check, which compares gradients through a random ``v`` without forming them.
    """
    n, C, S, p = term.delta.shape
    if a is None:
        return term.delta.sum(2) * v
    if term.rows is not None:
        out = term.delta.new_zeros(n * C * term.rows)
        return out.index_add_(0, _rows_flat(term, a), (term.delta @ v).reshape(-1)).reshape(
            n, C, term.rows)
    if term.transposed:
        return torch.einsum("nsq,ncsp,p->ncq", a, term.delta, v)
    dg, ag = _grouped(term, a)
    return torch.einsum("ncsgi,nsg->ncgi", dg, ag @ v).reshape(n, C, p)


def project_term(term: Term, a: torch.Tensor, U: torch.Tensor, V: torch.Tensor,
                 width: int) -> torch.Tensor:
    """``sum_s (delta[s] . u_k) (a[s] . v_k)`` per sample: ``(n, C / width, k)``.

    ``U (k, width * p)``: a direction over ``width`` outputs (all of them for "trace",
    one for "full") and ``p``; ``V (k, q / g)``, shared by the groups (each group's block
    of ``U`` is independent, so ``E[(U (x) V)(U (x) V)^T] = I`` over the block-diagonal).
    """
    n, C, S, p = term.delta.shape
    k = U.shape[0]
    if S == 1 and term.groups == 1 and term.rows is None:
        delta = term.delta.reshape(n * C // width, width * p)
        return (delta @ U.T).reshape(n, -1, k) * (a[:, 0] @ V.T).unsqueeze(1)
    g = 1 if term.transposed else term.groups
    pg = p // g
    d = term.delta.reshape(n, C // width, width, S, g, pg)
    Dp = torch.einsum("ncwsgi,kwgi->ncsgk", d, U.reshape(k, width, g, pg))
    # (n, S, g, k); a one-hot row picks V's column of its id.
    Ap = V.T[a.long()].unsqueeze(2) if term.rows is not None else a.reshape(n, S, g, -1) @ V.T
    return torch.einsum("ncsgk,nsgk->nck", Dp, Ap)


def project_bytes(term: Term, k: int, width: int, itemsize: int) -> int:
    """Bytes of :func:`project_term`'s intermediates per sample."""
    _, C, S, _ = term.delta.shape
    g = 1 if term.transposed else term.groups
    return itemsize * S * g * k * (C // width + 1)


def gram_route(term: Term, n_x: int, n_y: int, mode: str, weighted: bool, symmetric: bool,
               row_limit: int, itemsize: int) -> str:
    """How a Gram contracts ``term``: "rank1", "pair" or "dense" (see the module docs).

    ``term`` is a one-sample probe; ``row_limit`` is the bytes one sample's kept factors
    may take. Terms without factored inputs are already dense.
    """
    factored = [a for _, a in term.inputs if a is not None]
    if not factored:
        return "dense"
    if weighted and term.rows is None:
        # No factorised form with D: rank-one terms form their blocks lazily per panel
        # (small next to the GEMM), the others once per row block. An index term keeps
        # its position pairs, each delta scaled by its row of D (:func:`index_scaled`).
        return "rank1" if rank_one(term) and not term.transposed else "dense"
    if rank_one(term):
        return "rank1"
    _, C, S, p = term.delta.shape
    numel = sum(param_numel(term, a) for a in factored)
    c2 = C * C if mode == "full" else C
    pairs = n_x * n_y / (2 if symmetric else 1)
    rows = n_x + (0 if symmetric else n_y)
    if term.rows is not None:
        # Index terms: one comparison per position pair; blocks zeroed then scattered.
        q, form = len(factored), C * (numel + S * p)
    else:
        q, form = sum(a.shape[2] for a in factored), S * C * numel
    dense = pairs * c2 * numel + rows * form
    pair = pairs * S * S * (q + c2 * p)
    if C * numel * itemsize > row_limit:
        return "pair"
    return "dense" if dense <= pair else "pair"


def pair_bytes(term: Term, mode: str, itemsize: int) -> int:
    """Bytes per pair of samples of :func:`pair_gram`'s intermediates."""
    _, C, S, _ = term.delta.shape
    c2 = C * C if mode == "full" else 1
    return itemsize * S * S * (term.groups * (1 + 2 * c2))
