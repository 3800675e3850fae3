"""The span of a network's tangent features, from tangent-kernel Gram matrices alone.

A point's tangent feature ``phi(x) = d f(x; theta) / d theta`` lies in the span of the
training features when the network's behaviour at ``x`` is determined by what training
moved (Domingos' kernel-machine view; the rank gap of the extrapolation-failure figures).
Everything here works from Grams ``Theta(x, x') = <phi(x), phi(x')>`` (trace over the
outputs, the kernel of ``vec J(x) / sqrt(C)``), never from the Jacobian:

* :func:`numerical_rank`: the numerical rank of stacked features from their Gram, and
  :meth:`TangentSpan.rank_gap`, those of training and training + query features;
* :func:`pivoted_cholesky`: a greedy block pivoted Cholesky ``Theta ~= G G^T`` that keeps
  the training points whose features span all the others to within a tolerance (the
  ``N x N`` Gram is never held: columns are computed a block at a time);
* :class:`TangentSpan`: the training span of a fitted network and the relative residual
  of a query's feature outside it, outside the span of its best-aligned training features
  only (a local span), or its best cosine with one of them; each also leave-one-out, for
  training points scored against the others.

Used by :class:`~skpathkernel.OODRankDetector` and
:class:`~skpathkernel.plotting.RankGapDisplay`.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import torch

from .._device import to_input_tensor, to_numpy
from .._memory import rows_per_block
from .._modules import copy_module
from .._tangent import tangent_gram, tangent_gram_diag

__all__ = ["NetworkGram", "TangentSpan", "budget_rank", "numerical_rank", "pivoted_cholesky"]

BLOCK = 256  # pivots per Gram pass of the pivoted Cholesky
# A group of queries shares the Gram of the union of its neighbours, at most this many
# times n_neighbors points: large enough that a call's fixed cost (~10 ms: a capture of
# the network) is shared by many queries when their neighbours overlap, small enough that
# queries with disjoint neighbours do not pay for a large union Gram (measured at
# N = 20000: 8 and 32 were slower than 16).
UNION_NEIGHBOURS = 16
# Entries of a row block of the leave-one-out passes (8 MiB in float64; 32 MiB, with
# two such temporaries beside it, put 90 MiB on the fit's peak at N = r = 2000).
LOO_BLOCK = 2**20
# Rows of a leave-one-out block at least, whatever the budget: a triangular solve of this
# many rows costs several times its call's set-up (a block of 64 x r solves, two r x 64
# arrays, is 2 MB at r = 2000), and the budget's rank (budget_rank) counts two of them.
LOO_MIN_ROWS = 64
# Float64 vectors over the N points that a fit holds beside its arrays (the diagonal, the
# residuals, the leverages and their temporaries): measured, up to 11 at the peak of the
# leverages' pass.
POINT_VECTORS = 16


# Singular values of J relative to the largest below which the float64 Gram J J^T no
# longer resolves them: its eigenvalues carry round-off of about n eps (1e-14 to 1e-13 of
# the largest for hundreds to thousands of points), whose square roots are 1e-7.
RTOL_RESOLUTION = 1e-7


def numerical_rank(gram, rtol: float, top: float | None = None) -> int:
    """Numerical rank of ``J`` from its Gram ``G = J J^T``.

    Counts the singular values of ``J`` above ``rtol`` times ``top`` (default: the
    largest of them), with ``sigma_i = sqrt(max(eig_i(G), 0))`` (the Gram symmetrised
    first, so that its round-off cannot make eigenvalues complex). A ``top`` of another
    matrix never puts the threshold below what ``G`` resolves, ``RTOL_RESOLUTION`` times
    its own largest singular value.
    """
    sigma = _singular_values(gram)
    if top is not None:
        top = max(top, RTOL_RESOLUTION / rtol * sigma.max(initial=0.0))
    return _count_above(sigma, rtol, top)


def _singular_values(gram) -> np.ndarray:
    G = np.asarray(gram, dtype=np.float64)
    return np.sqrt(np.clip(np.linalg.eigvalsh((G + G.T) / 2), 0.0, None))


def _count_above(sigma: np.ndarray, rtol: float, top: float | None = None) -> int:
    top = sigma.max(initial=0.0) if top is None else top
    return 0 if top == 0 else int(np.count_nonzero(sigma > rtol * top))


class NetworkGram:
    """Tangent-kernel Grams (trace over outputs) of a fitted network, in float64.

    A float64 copy of the network at its final recorded parameters: the rank tolerance
    speaks of singular values down to ``rtol`` times the largest, below what a float32
    Gram resolves (its eigenvalues carry errors of ~1e-7 of the largest), so spans are
    computed in float64 whatever the training dtype.
    """

    def __init__(self, network):
        # A TrainedNetwork (skpathkernel._network._trained), or a fitted estimator exposing one as
        # network_ (benchmarks/bench_ood.py passes the estimator). Not network_of: the
        # engine sits below _network in the import graph (tests/test_imports.py), and the
        # detector, its one caller in the package, resolves the network with it first.
        network = getattr(network, "network_", network)
        self.device = torch.device(network.device)
        self.module = copy_module(network.module).to(dtype=torch.float64)
        traj = network.trajectory
        flat = traj.parameters(-1).to(device=self.device, dtype=torch.float64)
        self.params = dict(traj.unflatten(flat))
        self.budget = int(network.memory_budget)
        # The copy's bytes (module and flat parameters), held through a fit.
        copied = (flat, *self.module.parameters(), *self.module.buffers())
        self.nbytes = sum(t.nbytes for t in copied)

    def tensor(self, X) -> torch.Tensor:
        # Token ids stay int64; float inputs follow the float64 copy of the network.
        return to_input_tensor(np.asarray(X), dtype=torch.float64, device=self.device)

    def gram(self, X, Y=None, budget=None) -> torch.Tensor:
        """The Gram, its temporaries within ``budget`` (None: the network's)."""
        return tangent_gram(self.module, self.params, X, Y,
                            memory_budget=self.budget if budget is None else budget)

    def column_budget(self, X) -> int:
        """The engine's budget for the pivoting's Gram columns: a quarter of the
        network's, beside the factor (up to half, :func:`budget_rank`) and a block of
        columns with its updates (the last quarter); the whole budget where a quarter
        does not hold one sample's temporaries (the engine's refusal, before any work,
        on one point of ``X``): the budget of a few rows that fits one."""
        return self.budget_for_one(X, max(1, self.budget // 4))

    def budget_for_one(self, X, budget: int) -> int:
        """``budget`` where the engine takes one point of ``X`` (a tensor) within it, the
        network's whole budget otherwise (its refusal comes before any work)."""
        try:
            self.gram(X[:1], X[:1], budget=budget)
        except ValueError:
            return self.budget
        return budget

    def diag(self, X) -> torch.Tensor:
        """``Theta(x, x)`` of each point of ``X`` (a tensor), refused where it is not
        finite: every score reads it (the fit's jitter and spans, each query's residual),
        and a float64 overflow (inputs near 1e150) failed in ``torch.linalg.eigh``."""
        d = tangent_gram_diag(self.module, self.params, X, memory_budget=self.budget)
        check_finite_features(torch.isfinite(d))
        return d

    def rows_per_block(self, n_cols: int, what: str) -> int:
        """Rows of a block of Gram rows against ``n_cols`` columns, with temporaries."""
        return rows_per_block(self.budget, 4 * 8 * max(n_cols, 1), what)


def check_finite_features(finite) -> None:
    """Refuse inputs whose tangent features are not finite in float64 (``finite``: a
    bool per input, array or tensor): every score reads their squared norms and Grams,
    and an overflow (inputs near 1e150) failed inside ``torch.linalg.eigh`` or LAPACK."""
    n_bad = int((~finite).sum())
    if n_bad:
        raise ValueError(
            f"The tangent features of {n_bad} of these {len(finite)} inputs are not "
            "finite in float64 (their squared norm overflows): the inputs are too large "
            "for the network, or its outputs are not finite there. Scale X (e.g. "
            "StandardScaler).")


def _lazy_pages(device: torch.device) -> bool:
    """Whether an untouched allocation costs no resident memory (the CPU's virtual memory)."""
    return device.type == "cpu"


def pivoted_cholesky(column, diag, tol, max_rank, block=BLOCK):
    """Greedy block pivoted Cholesky ``Theta ~= G G^T`` of a PSD matrix given by columns.

    ``column(idx)`` returns ``Theta[:, idx]`` (N x b). Each pass computes the columns of the
    ``b`` points with the largest residual diagonal, pivots among them on their own
    ``b x b`` residual block (largest remaining residual first, skipping those the earlier
    ones already explain), then forms the new factor columns by one triangular solve.
    Stops when every residual diagonal ``||phi_i - P_L phi_i||^2`` is at most ``tol`` or at
    ``max_rank`` pivots. Returns the factor ``G`` (N x r) and the pivots (r,).
    """
    n = diag.shape[0]
    res = diag.clone()
    # G is held transposed, (max_rank, N) row-major and never zeroed: on a CPU its memory
    # is only faulted in as pivots fill its rows, so resident memory follows the rank
    # reached, with no growth copy (a column of a row-major (N, max_rank) G would touch
    # every page). A GPU allocates eagerly: there it grows by doubling.
    capacity = max_rank if _lazy_pages(diag.device) else min(max_rank, 2 * block)
    G = diag.new_empty((capacity, n)).T
    pivots: list[int] = []
    k = 0
    while k < max_rank:
        masked = res.clone()
        if pivots:
            masked[pivots] = -math.inf
        vals, cand = torch.topk(masked, min(block, max_rank - k, n - k))
        cand = cand[vals > tol]
        if cand.numel() == 0:
            break
        C = column(cand)
        if k:
            C -= G[:, :k] @ G[cand, :k].T
        # Pivot inside the block on its b x b residual S only (cheap rank-one updates),
        # then form the new factor columns for all N rows at once (BLAS-3):
        # G_new = C[:, J] L^{-T} with S[J, J] = L L^T.
        S = C[cand].clone()
        order: list[int] = []
        L_cols = []
        local = S.diagonal().clone()
        done = torch.zeros(len(cand), dtype=torch.bool, device=diag.device)
        while k + len(order) < max_rank:
            j = int(torch.argmax(torch.where(done, -math.inf, local)))
            if done[j] or local[j] <= tol:
                break
            col = S[:, j] / torch.sqrt(local[j])
            S -= torch.outer(col, col)
            local = S.diagonal().clone()
            done[j] = True
            order.append(j)
            L_cols.append(col)
        if not order:
            break
        J = torch.as_tensor(order, device=diag.device)
        L = torch.stack(L_cols, dim=1)[J]  # lower triangular in pivot order
        new = torch.linalg.solve_triangular(L, C[:, J].T, upper=False).T
        # The rows of the pivots are exact: this block's are L itself and the earlier
        # ones' are 0 (each lies in its own span). Solved, they carry round-off that a
        # tiny tolerance makes comparable to L's diagonal; set, the factor's rows at the
        # pivots are the Cholesky factor of Theta_LL, which the scores solve with.
        new[cand[J]] = L
        if pivots:
            new[pivots] = 0.0
        m = len(order)
        if k + m > G.shape[1]:
            grown = diag.new_empty((min(max_rank, max(2 * G.shape[1], k + m)), n))
            grown[:k] = G[:, :k].T
            G = grown.T
        G[:, k : k + m] = new
        k += m
        pivots.extend(int(cand[j]) for j in order)
        res -= (new * new).sum(1)
        res.clamp_(min=0.0)
    return G[:, :k], torch.as_tensor(pivots, dtype=torch.long)


def loo_relative_residuals(G, diag, lam, budget=None, overwrite=False):
    """Leave-one-out relative residuals of the training features, from ``Theta ~= G G^T``.

    Each point is scored as a query is by :meth:`TangentSpan.residuals`, against the
    others: off the diagonal the kernel is the factor's, ``g_i^T g_j``, on it the exact
    ``Theta_ii``, whose excess ``d_i = Theta_ii - ||g_i||^2`` (the feature's residual
    outside the pivots' span, at most ``lam`` when the factorisation is complete) adds
    to the variance. The posterior variance of point ``i`` given all the others under
    ``G G^T + lam I`` is ``1 / [(G G^T + lam I)^{-1}]_ii - lam``. With the thin QR
    ``G = Q R`` (``Q`` orthonormal to machine precision) and ``P P^T = R R^T + lam I``,
    ``[(G G^T + lam I)^{-1}]_ii = ||P^{-1} q_i||^2 + (1 - ||q_i||^2) / lam``. Returns
    the relative residuals and ``R`` (``R^T R = G^T G``, which the queries' scores take,
    :meth:`TangentSpan.factorize`). Its row blocks take what its arrays (``G``, ``Q``
    and four ``r x r``) leave of ``budget`` (None: ``LOO_BLOCK`` entries), ``G``
    counted with its storage's spare capacity (:func:`pivoted_cholesky`).
    ``overwrite``: the QR is made in ``G``'s memory, which then holds ``Q`` (no second
    ``N x r`` array; the same ``Q`` and ``R`` bit for bit).
    """
    if G.shape[1] == 0:
        return torch.ones_like(diag), None
    n, r = G.shape
    # The bytes the pass holds beside its blocks, with G's whole storage (allocated is
    # held, though a CPU may not have faulted in its untouched pages); Q in G's memory
    # takes none, but the count keeps Q's array where the storage is smaller, so the
    # blocks (and factorize's choice of this pass) are those of a separate Q.
    inplace = overwrite and G.stride(0) == 1
    held = qr_loo_bytes(n, r) + max(0, _storage_bytes(G) - (1 + inplace) * 8 * n * r)
    excess = (diag - row_norms2(G)).clamp(min=0)
    if inplace:
        # LAPACK's geqrf and orgqr (torch.linalg.qr's own calls) on G's column-major
        # view, in place.
        tau = G.new_empty(r)
        geqrf, tau = torch.geqrf(G, out=(G, tau))
        R = geqrf[:r].triu()
        Q = torch.linalg.householder_product(geqrf, tau, out=geqrf)
        del geqrf, tau
    else:
        Q, R = torch.linalg.qr(G)
    # A Cholesky factor, not the eigendecomposition R R^T = V S V^T (sum_j (Q V)_ij^2 /
    # (S_j + lam)): as close to the features' formula (measured), and the fit's one
    # r x r eigendecomposition is M's, which the queries' scores take.
    post = jittered_cholesky(R @ R.T, lam, overwrite=True)
    # Every point a pivot: Q is square and orthogonal, so 1 - ||q_i||^2 is exactly 0. Its
    # computed value is round-off (~1e-16), which a small jitter (1e-20 of the largest
    # eigenvalue at rtol=1e-10) turns into a large "explained" part of every point.
    complement = G.shape[1] < G.shape[0]
    inv_diag = torch.empty_like(diag)
    # Row blocks: P^{-1} Q^T is r x N, as large as G itself.
    step = _loo_rows(budget, held, r)
    for start in range(0, G.shape[0], step):
        Qb = Q[start : start + step]
        inv_diag[start : start + step] = row_norms2(
            torch.linalg.solve_triangular(post, Qb.T, upper=False).T
        )
        if complement:
            inv_diag[start : start + step] += (1.0 - row_norms2(Qb)).clamp(min=0) / lam
    var = (1.0 / inv_diag - lam).clamp(min=0) + excess
    return _relative(var, diag), R


def leverage_bytes(n: int, r: int) -> int:
    """Bytes the leverages' pass holds at its peak at ``r`` pivots of ``n`` points: the
    factor ``G`` (n x r), the pivots' Cholesky factor and that of ``M + lam I`` (made in
    ``M``'s place: r x r each), a row block of its solves (two ``LOO_MIN_ROWS x r``
    arrays at least), and the fit's vectors over the points (``POINT_VECTORS``)."""
    return 8 * (n * r + 2 * r * r + 2 * LOO_MIN_ROWS * r + POINT_VECTORS * n)


def qr_loo_bytes(n: int, r: int) -> int:
    """Bytes :func:`loo_relative_residuals` holds at least: the factor and the QR's ``Q``
    (``N x r`` each), four ``r x r`` (``L``, ``R``, ``R R^T``, its Cholesky factor), two
    blocks of ``LOO_MIN_ROWS`` rows, and the fit's vectors over the points
    (``POINT_VECTORS``). The fit makes ``Q`` in the factor's memory: the two ``N x r``
    count the factor's storage up to a capacity of ``2 r`` pivots (it is allocated for
    ``max_rank``, :func:`pivoted_cholesky`), and the pass's row blocks are sized beside
    any capacity beyond (then within :func:`leverage_bytes` at ``max_rank``)."""
    return 8 * (2 * n * r + 4 * r * r + 2 * LOO_MIN_ROWS * r + POINT_VECTORS * n)


def factor_bytes(n: int, r: int) -> int:
    """Bytes a fit without leave-one-out pass ("alignment") holds at ``r`` pivots of ``n``
    points: the factor ``G`` (n x r), the pivots' Cholesky factor (r x r) taken from it,
    and the fit's vectors over the points (``POINT_VECTORS``)."""
    return 8 * (n * r + r * r + POINT_VECTORS * n)


def budget_rank(budget: int, n: int, loo: bool = True) -> int:
    """The most pivots of ``n`` points whose factorisation stays within ``budget`` bytes.

    The ``N x r`` float64 factor in half of it, the Gram blocks of the pivoting in the
    other half; and the arrays held beside the factor in all of it: with ``loo``, the
    leverages' pass (:func:`leverage_bytes`, the cheaper of the two leave-one-out
    passes) whose ``r x r`` arrays at ``r ~ N`` are as large as the factor (counted, at
    ``N = r = 2000`` and a 62 MiB budget, the fit held twice the budget); without it
    (the "alignment" fit builds no leave-one-out arrays), the pivots' Cholesky factor
    only (:func:`factor_bytes`): charged the leverages' arrays, its rank at a 1 GiB
    budget and N = 10,000 was 6037 where the factor's half allows 6710. At least one
    pivot.
    """
    # The largest r with held(n, r) = a r^2 + b r + c <= budget, its coefficients read
    # off the byte count itself.
    held = leverage_bytes if loo else factor_bytes
    c = held(n, 0)
    a = (held(n, 2) - 2 * held(n, 1) + c) // 2
    b = held(n, 1) - c - a
    r = (math.isqrt(b * b + 4 * a * max(int(budget) - c, 0)) - b) // (2 * a)
    while r > 0 and held(n, r) > budget:  # isqrt's rounding
        r -= 1
    return max(1, min(int(budget) // (16 * max(n, 1)), r, n))


def _storage_bytes(G) -> int:
    """Bytes of ``G``'s storage: the factor with the capacity :func:`pivoted_cholesky`
    allocated for ``max_rank`` pivots and did not fill."""
    return G.untyped_storage().nbytes()


def _loo_rows(budget: int | None, held: int, r: int) -> int:
    """Rows of a leave-one-out block: two ``rows x r`` float64 arrays in what ``held``
    (the pass's bytes with its least blocks, :func:`qr_loo_bytes`,
    :func:`leverage_bytes`) leaves of ``budget`` beside those least blocks (None:
    ``LOO_BLOCK`` entries), at least ``LOO_MIN_ROWS``."""
    if budget is None:
        entries = LOO_BLOCK
    else:
        entries = min(LOO_BLOCK, (budget - held) // 16 + LOO_MIN_ROWS * max(r, 1))
    return max(LOO_MIN_ROWS, entries // max(r, 1))


def leverage_loo_relative_residuals(G, post, diag, lam, budget=None):
    """:func:`loo_relative_residuals` without its second ``N x r`` array (the QR's ``Q``).

    By Woodbury, ``[(G G^T + lam I)^{-1}]_ii = (1 - h_i) / lam`` with the leverage
    ``h_i = g_i^T (G^T G + lam I)^{-1} g_i = ||post^{-1} g_i||^2`` (``post`` the Cholesky
    factor of ``G^T G + lam I``), computed in row blocks of ``G``: the variance is
    ``lam h_i / (1 - h_i)``. ``1 - h_i`` cancels for a point far from the others' span
    (``1 - h_i = lam / (lam + var)``), so its relative residual is only as precise as
    ``h_i``: measured against the QR at rtol=1e-6, within 1.4e-6 (digits, N = 600) and
    1.9e-5 (N = 3000) relative, medians 6e-15 and 4e-7. Its row blocks take what
    :func:`leverage_bytes`' arrays leave of ``budget`` (None: ``LOO_BLOCK`` entries),
    ``G`` counted with its storage's spare capacity.
    """
    if G.shape[1] == 0:
        return torch.ones_like(diag)
    lev = torch.empty_like(diag)
    n, r = G.shape
    # G counted with its storage's spare capacity (:func:`pivoted_cholesky`).
    step = _loo_rows(budget, leverage_bytes(n, r) + _storage_bytes(G) - 8 * n * r, r)
    for start in range(0, G.shape[0], step):
        q = torch.linalg.solve_triangular(post, G[start : start + step].T, upper=False)
        lev[start : start + step] = row_norms2(q.T)
    h = lev.clamp(0.0, 1.0)
    var = lam * h / (1.0 - h).clamp(min=torch.finfo(h.dtype).eps)
    var = var + (diag - row_norms2(G)).clamp(min=0)
    return _relative(var, diag)


def jittered_cholesky(K, lam, overwrite=False, rebuild=None):
    """Lower triangular ``L`` with ``L L^T = K + lam I``, for a PSD Gram ``K`` and ``lam > 0``.

    Cholesky of the sum first. A jitter below the Gram's float64 round-off leaves the
    sum indefinite by round-off (the pivots' Gram at ``rtol=1e-10``, or 1e-8 on nearly
    dependent features, before the jitter was at least the pivots' Cholesky resolution;
    no fit measured since, at any ``rtol``); then ``L`` is the factor of ``K_+ + lam I``,
    with ``K_+`` the Gram without its negative (round-off) eigenvalues
    (:func:`_psd_part_cholesky`).
    ``overwrite``: ``K`` may be used as the sum's storage (no copy of it). ``rebuild``:
    the factor is made in ``K``'s own memory (no second ``r x r`` array), and
    ``rebuild(out)`` writes ``K`` into ``out`` again for the fallback (the factorisation
    destroyed it). Either way the fallback works in the sum's memory, with one more
    ``r x r`` array at its peak: where the sum is not factorised in place, the failed
    factor's, freed first.
    """
    W = K if overwrite or rebuild is not None else K.clone()
    W.diagonal().add_(lam)
    if rebuild is None:
        L, info = torch.linalg.cholesky_ex(W)
    else:
        # W is symmetric: its transpose, a column-major view, is the layout LAPACK
        # factorises in place (a row-major output took a copy), and the factor the same.
        info = torch.empty((), dtype=torch.int32, device=W.device)
        L, info = torch.linalg.cholesky_ex(W.T, out=(W.T, info))
    if int(info) == 0:
        return L
    del L
    if rebuild is None:
        W.diagonal().sub_(lam)
    else:
        rebuild(W)
    return _psd_part_cholesky(W, lam)


def _psd_part_cholesky(K, lam):
    """The lower triangular ``L`` with ``L L^T = K_+ + lam I``, made in ``K``'s memory.

    With ``K = V S V^T`` (one triangle of ``K`` read), ``C = V diag(sqrt(S_+ + lam))``
    has ``C C^T = K_+ + lam I``, and ``L = R^T`` for the R of ``C^T = Q R``: no sum of
    ``K`` and ``lam I`` is factorised, so round-off cannot make it indefinite. The
    eigendecomposition is LAPACK's ``syevr`` on the host, overwriting ``K`` (a CPU
    tensor's own memory) beside the eigenvectors: torch's ``syevd`` takes two more
    ``r x r`` of workspace. Then ``C^T`` goes into ``K`` and the QR is made there, the
    eigenvectors freed. At its peak it holds ``K`` and one ``r x r`` array (with the
    sum's symmetrised copy, the stacked ``[sqrt(S_+) V^T; sqrt(lam) I]`` and the QR's
    copy of it, it held about nine)."""
    host = K.cpu()
    S, V = scipy.linalg.eigh(host.T.numpy(), overwrite_a=True, check_finite=False,
                             driver="evr")
    del host
    V *= np.sqrt(np.clip(S, 0.0, None) + lam)
    # K row-major holds C: its transpose, a column-major view, holds C^T in the layout
    # that LAPACK's QR overwrites with R.
    K.copy_(torch.from_numpy(V))
    del V
    tau = K.new_empty(K.shape[0])
    R, _ = torch.geqrf(K.T, out=(K.T, tau))
    R.triu_()
    # The Cholesky factor is the one with a positive diagonal.
    R.mul_(torch.sign(R.diagonal()).unsqueeze(1))
    return K


def cholesky_resolution(chol, n_iter=30):
    """``r eps ||Theta_LL||_2``: the backward error of the Cholesky factor ``L`` (r x r) of
    ``Theta_LL = L L^T`` in its dtype, the least squared residual a solve with it resolves.

    ``||Theta_LL||_2`` by power iteration on ``L L^T`` (a lower bound that converges from
    below, kept at least the mean eigenvalue ``trace / r``): ``r^2`` per iteration.
    """
    r = chol.shape[0]
    top = float(row_norms2(chol).sum()) / r
    v = torch.ones(r, dtype=chol.dtype, device=chol.device)
    for _ in range(n_iter):
        w = chol @ (chol.T @ v)
        norm = float(torch.linalg.vector_norm(w))
        if norm == 0 or not math.isfinite(norm):
            break
        top = max(top, float(v @ w) / float(v @ v))
        v = w / norm
    return r * torch.finfo(chol.dtype).eps * top


def row_norms2(G):
    # Not (G * G).sum(1): that is an N x r temporary, the size of G itself.
    return torch.linalg.vector_norm(G, dim=1).square()


def _relative(var, diag):
    # A zero tangent feature lies in every span: its relative residual is 0.
    safe = torch.where(diag > 0, diag, torch.ones_like(diag))
    return torch.where(diag > 0, (var / safe).clamp(0, 1), torch.zeros_like(var)).sqrt()


def _explained(A, b):
    """``b_i^T A_i^{-1} b_i`` for a batch of SPD systems ``A`` (g, k, k) and ``b`` (g, k).

    Cholesky first; a system it rejects (a jitter below the Gram's round-off, for a tiny
    ``rtol``) falls back to the pseudo-inverse, which drops the directions round-off
    cannot resolve: ``sum_j (v_j^T b)^2 / s_j`` over the eigenpairs of ``A_i`` with
    ``|s_j|`` above ``torch.linalg.pinv``'s cutoff, ``k eps max_j |s_j|``. The eigenvectors
    are made in the rejected systems' copy, after the factor is freed: beside ``A`` the
    fallback holds at most one ``(g, k, k)`` array, as the factor did (``pinv`` and its
    product with ``b`` held up to five, and cancelled: up to 6e-3 off ``b^T A^+ b``
    relative, at eigenvalues of 1e-12 of the largest).
    """
    L, info = torch.linalg.cholesky_ex(A)
    out = torch.linalg.solve_triangular(L, b.unsqueeze(2), upper=False).square().sum((1, 2))
    del L
    bad = info > 0
    if bool(bad.any()):
        sub = A[bad]
        S = sub.new_empty(sub.shape[:-1])
        # Symmetric: the transposes, a batch of column-major views, are LAPACK's layout.
        S, V = torch.linalg.eigh(sub.mT, out=(S, sub.mT))
        y = (V.mT @ b[bad].unsqueeze(2)).squeeze(2)
        size = S.abs()
        cutoff = A.shape[-1] * torch.finfo(A.dtype).eps * size.amax(-1, keepdim=True)
        out[bad] = torch.where(size > cutoff, y.square() / S, 0.0).sum(-1)
    return out


def _span_variance(K, diag, chol, basis, leak, post, lam):
    """The posterior variance of :meth:`TangentSpan.residuals` for the columns of ``K =
    Theta(X_span, x)`` (r, b) and their ``Theta(x, x)``; its (r, b) temporaries are
    freed on return, before the next block's Gram."""
    if basis is not None:
        # (r, b) squares, reduced by products: no second (r, b) temporary.
        y = (basis @ K).square_()
        return diag - y.sum(0) + leak @ y
    c = torch.linalg.solve_triangular(chol, K, upper=False)
    # Without basis or post (a detector fitted before they existed) chol is the factor
    # of Theta_LL + lam I: the pivots alone.
    explained = row_norms2(c.T)
    if post is not None:
        z = torch.linalg.solve_triangular(post, c, upper=False)
        explained -= lam * row_norms2(z.T)
    return diag - explained


def _cosines(K, dx, dy):
    # A zero feature has no direction: its cosines are 0. Made in the scale's memory
    # (beside K: the scale and two masks, where four arrays were).
    cos = torch.outer(dx, dy).sqrt_()
    zero = cos > 0
    zero.logical_not_()
    cos.masked_fill_(zero, 1.0)
    torch.div(K, cos, out=cos)
    return cos.masked_fill_(zero, 0.0)


class TangentSpan:
    """The span of the tangent features of training points ``X``, and residuals outside it.

    Holds NumPy arrays only (the detector pickles them); every method takes the
    :class:`NetworkGram` of the network, built where it runs.

    Parameters
    ----------
    X : ndarray of shape (N, n_features) or (N, ...)
        The training points, in the form the network takes.
    diag : ndarray of shape (N,)
        ``Theta(x_i, x_i)``.
    lam : float
        The jitter added to every Gram of training features before it is factorised.
    X_span, chol, basis, eig, post : ndarray, default=None
        The pivots' inputs, the Cholesky factor ``L`` of their Gram ``Theta_LL``, and
        ``W^T L^{-1}`` (r x r) and ``S`` (r,) from the eigendecomposition ``M = W S W^T``
        of ``M = G^T G`` for the Nystrom factor ``G = Theta[:, L] L^{-T}`` of all N
        training features, or (the leverages' pass, without them) the Cholesky factor
        ``P`` of ``M + lam I`` (from :meth:`factorize`): the global span, used by
        :meth:`residuals`. Without ``basis`` or ``post`` (a detector fitted before they
        existed),
        ``chol`` is the factor of ``Theta_LL + lam I`` and a query is scored against the
        pivots alone.
    """

    def __init__(self, X, diag, lam, X_span=None, chol=None, basis=None, eig=None, post=None):
        self.X = X
        self.diag = np.asarray(diag, dtype=np.float64)
        self.lam = float(lam)
        self.X_span = X_span
        self.chol = chol
        self.basis = basis
        self.eig = eig
        self.post = post

    @staticmethod
    def rank_gap(gram, n_train: int, rtol: float) -> tuple[int, int]:
        """Numerical ranks of the first ``n_train`` features and of all of them, from the
        Gram of training and query points stacked (:func:`numerical_rank` of each).

        Both count singular values above ``rtol`` times the training features' largest:
        relative to its own, a query's large features raised the joint threshold and
        dropped training directions from the joint count (a negative gap). With one
        threshold the joint singular values interlace above the training ones, so
        ``rank_joint >= rank_train`` and the gap counts directions that the queries add,
        wherever the joint Gram resolves the threshold (above ``RTOL_RESOLUTION`` times
        its largest singular value, which a query ``rtol / RTOL_RESOLUTION`` times the
        training features' scale passes; the joint count's threshold stays there).
        """
        G = np.asarray(gram, dtype=np.float64)
        # A non-finite Gram failed in LAPACK's words ("Eigenvalues did not converge"). Its
        # diagonal bounds every entry (Cauchy-Schwarz): finite there, finite everywhere.
        check_finite_features(np.isfinite(np.diagonal(G)))
        sigma = _singular_values(G[:n_train, :n_train])
        top = sigma.max(initial=0.0) if n_train else None
        return _count_above(sigma, rtol, top), numerical_rank(G, rtol, top)

    @classmethod
    def jitter(cls, diag, rtol) -> float:
        """``lam = rtol**2 * max_i Theta(x_i, x_i)``: directions whose singular value is
        below ``rtol`` times the largest feature norm count as inside the span."""
        return float(rtol) ** 2 * float(np.max(diag, initial=0.0))

    @classmethod
    def factorize(cls, gram: NetworkGram, X, diag, lam, max_rank, *, block=BLOCK,
                  loo=False, score=True):
        """Pivoted Cholesky of the training Gram: the span, and leave-one-out residuals.

        Returns ``(span, pivots, complete, loo, reached)``: ``complete`` says whether the
        pivots reach the tolerance ``lam`` (False: stopped at ``max_rank``), ``reached``
        the largest squared residual of a training feature outside the pivots' span
        (``max_i ||phi_i - P_L phi_i||^2``, what ``lam`` bounds), ``loo`` the
        leave-one-out relative residuals of all N points, each against the N - 1 others
        as :meth:`residuals` scores a query against all N (None unless asked): from a
        thin QR of the factor (:func:`loo_relative_residuals`), or, when that QR's second
        ``N x r`` array would not fit in the budget beside the factor, from the leverages
        (:func:`leverage_loo_relative_residuals`).

        The factor ``G`` (N x r, ``Theta ~= G G^T``) is the Nystrom factor of the pivots,
        ``G = Theta[:, L] L^{-T}`` with ``L L^T = Theta_LL`` (its rows at the pivots are
        ``L``): kept are ``L`` and, for :meth:`residuals` (unless ``score`` is False and
        no ``loo`` is asked), ``W^T L^{-1}`` and ``S`` with ``G^T G = W S W^T``, or, from
        the leverages' pass, the Cholesky factor of ``G^T G + lam I``.

        The returned span's jitter is ``lam``, or ``L``'s resolution
        (:func:`cholesky_resolution`) where that is larger: the pivots are chosen at the
        tolerance ``lam`` in either case.
        """
        Xt = gram.tensor(X)
        diag_t = torch.as_tensor(diag, device=gram.device)
        n = X.shape[0]
        if float(diag_t.max()) > 0:
            engine = gram.column_budget(Xt)
            G, pivots = pivoted_cholesky(lambda idx: gram.gram(Xt, Xt[idx], budget=engine),
                                         diag_t, max(lam, 0.0), max_rank, block=block)
        else:  # every feature is zero (a dead network): the span is {0}
            G, pivots = diag_t.new_zeros((n, 0)), torch.zeros(0, dtype=torch.long)
        reached = float((diag_t - row_norms2(G)).clamp(min=0.0).max()) if n else 0.0
        complete = not (len(pivots) == max_rank < n and reached > lam)
        r = G.shape[1]
        X_span, chol, basis, eig, post = X[to_numpy(pivots)], None, None, None, None
        residuals = S = None
        if r:
            # The factor's rows at the pivots: L, lower triangular in pivot order.
            chol_t = G[pivots.to(G.device)].tril_()
            # A query's residual outside the pivots' span, Theta(x, x) - ||L^{-1}
            # k_L(x)||^2, cancels down to L's backward error; below it the jitter's leak
            # would be round-off (measured: N = 3000 points on 449 parameters, whose
            # residuals read -1.3e-11 of the largest diagonal at rtol=1e-6's 1e-12).
            lam = max(lam, cholesky_resolution(chol_t))
        if loo:
            # Without the vectors over the points and the least blocks, this chose the QR
            # at 1.05x the budget (N = 150, r = 42, 170 kB).
            if qr_loo_bytes(n, r) <= gram.budget:
                # The QR in G's memory (G is not needed after it): G's storage for
                # max_rank pivots and Q beside it held 1.066 times a 1.7 MB budget where
                # the tolerance stopped at 113 of 177 pivots (N = 600).
                residuals, R = loo_relative_residuals(G, diag_t, max(lam, 1e-300),
                                                      budget=gram.budget, overwrite=True)
                # The N x r factor is freed before M's eigendecomposition (the QR's Q was):
                # M, its eigenvectors and eigh's workspace (about 2 r^2) come after them.
                del G
                if r:
                    M = R.T @ R
                    del R
                    S, W = torch.linalg.eigh(M)
                    del M
            elif r:
                # The leverages' pass: the Cholesky factor of M + lam I (in M's memory)
                # beside G and L, and no r x r eigendecomposition (at r = 2000 it tripled
                # the fit's time): queries solve with the factor instead (two triangular
                # solves). Its arrays are those budget_rank counts. L is not needed
                # by the pass and is taken from G again after it: its room is the
                # Cholesky fallback's second r x r array (jittered_cholesky).
                del chol_t
                post = jittered_cholesky(G.T @ G, lam,
                                         rebuild=lambda out: torch.matmul(G.T, G, out=out))
                residuals = leverage_loo_relative_residuals(G, post, diag_t, lam,
                                                            budget=gram.budget)
                chol_t = G[pivots.to(G.device)].tril_()
            else:
                residuals = torch.ones_like(diag_t)
            residuals = to_numpy(residuals)
        elif r and score:
            S, W = torch.linalg.eigh(G.T @ G)
        if S is not None:
            # One product per query block (W^T L^{-1}) k_L(x): as precise, measured (1.3e-7
            # in the score, N = 3000), and at r = 445 to 2000 0.6 to 0.8 times the time of
            # the two triangular solves (L, then the factor of M + lam I).
            basis = to_numpy(torch.linalg.solve_triangular(chol_t.T, W, upper=True).T)
            eig = to_numpy(S.clamp(min=0))
        if r:
            chol = to_numpy(chol_t)
        if post is not None:
            post = to_numpy(post)
        return (cls(X, diag, lam, X_span, chol, basis, eig, post), to_numpy(pivots),
                complete, residuals, reached)

    # ------------------------------------------------------------------ global span
    def residuals(self, gram: NetworkGram, X) -> np.ndarray:
        """Relative residual of each ``phi(x)`` outside the span of all N training
        features: ``sqrt(1 - k(x)^T (Theta + lam I)^{-1} k(x) / Theta(x, x))``.

        Through the pivots' Nystrom factor ``G`` (:meth:`factorize`): ``k(x) ~= G c`` with
        ``c = L^{-1} k_L(x)``, ``k_L(x) = Theta(X_span, x)``, and ``Theta ~= G G^T``, so
        ``k^T (G G^T + lam I)^{-1} k = c^T M (M + lam I)^{-1} c = ||c||^2 - lam c^T
        (M + lam I)^{-1} c`` with ``M = G^T G = W S W^T`` (r x r). With ``y = W^T c``
        (one r x r product per query), the residual is ``Theta(x, x) - ||y||^2`` (outside
        the pivots' span, which cancels down to ``L``'s resolution) plus ``lam sum_j
        y_j^2 / (S_j + lam)`` (the jitter's leak inside it, no cancellation), the
        quantity the leave-one-out training residuals measure. From the leverages'
        pass, ``||c||^2`` and ``lam ||P^{-1} c||^2`` (``P P^T = M + lam I``) instead:
        two triangular solves.
        """
        Xt = gram.tensor(X)
        diag = gram.diag(Xt).to(torch.float64)
        if self.chol is None:
            return to_numpy(_relative(diag, diag))
        span = gram.tensor(self.X_span)
        chol = torch.as_tensor(self.chol, device=gram.device)
        basis = leak = post = None
        if self.basis is not None:
            basis = torch.as_tensor(self.basis, device=gram.device)
            leak = self.lam / (torch.as_tensor(self.eig, device=gram.device) + self.lam)
        elif self.post is not None:
            post = torch.as_tensor(self.post, device=gram.device)
        var = torch.empty_like(diag)
        # A block's two (r, b) arrays at a time (K and y, K and c, c and z) in half of the
        # budget, the engine's temporaries in what K and the vectors over the queries
        # leave, at least the other half (with the whole budget, and the previous
        # block's c and z still held, scoring a leverages' fit took 1.15 times a 1 MiB
        # budget at N = 1000).
        step = gram.rows_per_block(len(self.X_span), "score_samples")
        held = 8 * len(self.X_span) * min(step, X.shape[0]) + diag.nbytes + var.nbytes
        engine = gram.budget_for_one(Xt, max(gram.budget // 2, gram.budget - held))
        for start in range(0, X.shape[0], step):
            K = gram.gram(span, Xt[start : start + step], budget=engine).to(torch.float64)
            var[start : start + step] = _span_variance(
                K, diag[start : start + step], chol, basis, leak, post, self.lam)
            del K  # before the next block's Gram
        return to_numpy(_relative(var, diag))

    # ------------------------------------------------------------------ neighbours
    def _neighbours(self, gram, X, n_neighbors, exclude, what, held=0):
        """Best-aligned training features of each query: indices, Gram values, cosines.

        Row blocks of ``Theta(X, X_train)``; ``exclude[i]`` (a training index) is left
        out of row ``i``'s candidates (leave-one-out). Returns ``idx`` (n, k), ``kvals``
        (n, k), ``best`` (n,) cosine of the best-aligned one and ``dq`` (n,). ``held``:
        bytes the caller holds beside them (a whole training Gram), out of the engine's.
        """
        Xt, Rt = gram.tensor(X), gram.tensor(self.X)
        dq = gram.diag(Xt).to(torch.float64)
        dr = torch.as_tensor(self.diag, device=gram.device)
        n, N = X.shape[0], self.X.shape[0]
        k = max(1, min(n_neighbors, N - (exclude is not None)))
        idx = torch.empty((n, k), dtype=torch.long, device=gram.device)
        kvals = torch.empty((n, k), dtype=torch.float64, device=gram.device)
        best = torch.empty(n, dtype=torch.float64, device=gram.device)
        # A block of rows (K, its cosines and their masks: counted as four) in half of
        # the budget; the engine's own blocks (captures, products) in what the queries'
        # arrays and its output leave (they had the whole budget beside them), at least
        # the other half.
        step = rows_per_block(gram.budget // 2, 4 * 8 * N, what)
        held += sum(t.nbytes for t in (idx, kvals, best, dq)) + 8 * min(step, n) * N
        engine = gram.budget_for_one(Xt, max(gram.budget // 2, gram.budget - held))
        for start in range(0, n, step):
            stop = min(start + step, n)
            K = gram.gram(Xt[start:stop], Rt, budget=engine).to(torch.float64)
            cos = _cosines(K, dq[start:stop], dr)
            if exclude is not None:
                rows = torch.arange(stop - start, device=gram.device)
                cos[rows, torch.as_tensor(exclude[start:stop], device=gram.device)] = -math.inf
            top, nb = torch.topk(cos, k, dim=1)
            del cos
            idx[start:stop], best[start:stop] = nb, top[:, 0]
            kvals[start:stop] = K.gather(1, nb)
            del K  # before the next block's Gram
        return idx, kvals, best, dq

    def alignment(self, gram: NetworkGram, X, *, exclude=None) -> np.ndarray:
        """``max_i K_hat(x, x_i)``: the best cosine between ``phi(x)`` and a training
        feature (``exclude[j]``: a training index left out for query ``j``)."""
        _, _, best, _ = self._neighbours(gram, X, 1, exclude, "The alignment score")
        return to_numpy(best)

    def local_residuals(self, gram: NetworkGram, X, n_neighbors: int, *,
                        exclude=None) -> np.ndarray:
        """Relative residual of ``phi(x)`` outside the span of its ``n_neighbors``
        best-aligned training features (``exclude[j]``: left out for query ``j``).

        ``sqrt(1 - k_S(x)^T (Theta_SS + lam I)^{-1} k_S(x) / Theta(x, x))`` with ``S`` the
        neighbours: the global residual with the span restricted to them. The neighbours'
        Gram ``Theta_SS`` is read from the Gram of the union of the neighbours of a group
        of queries: queries are grouped by their best neighbour, so that a group shares
        most of its neighbours, and a union holds at most ``UNION_NEIGHBOURS *
        n_neighbors`` points. When the whole training Gram costs less than those unions
        together and fits in a quarter of the budget, it is computed once instead.

        The queries are scored a chunk at a time, whose neighbours (indices, kernel
        values, their groups' unions: about ``3 n_neighbors`` values a query) take a
        quarter of the budget; a group's union Gram another, and the engine's
        temporaries that compute it, then the group's systems, the other half.
        (:meth:`_neighbours` gives the engine what the chunk's arrays leave.)
        """
        n, N = X.shape[0], self.X.shape[0]
        k = max(1, min(n_neighbors, N - (exclude is not None)))
        # All at once, the neighbours of the fit's 2000 leave-one-out points and their
        # unions held 0.9 MB beside a 1 MiB budget (1.8 times it at the peak).
        chunk = rows_per_block(gram.budget // 4, 8 * (3 * k + 8), "The local residual score")
        engine = gram.budget_for_one(gram.tensor(X[:1]), gram.budget // 2)
        full = []  # the whole training Gram, once computed
        return np.concatenate([
            self._local_chunk(gram, X[start : start + chunk], n_neighbors,
                              None if exclude is None else exclude[start : start + chunk],
                              engine, full)
            for start in range(0, n, chunk)])

    def _local_chunk(self, gram, X, n_neighbors, exclude, engine, full):
        """:meth:`local_residuals` of a chunk of queries; ``full``: a list that holds
        the whole training Gram once one chunk has computed it."""
        # The whole training Gram of an earlier chunk is held beside this chunk's rows:
        # the engine had what they left as well (1.05 times a 1 MiB budget, N = 180,
        # 1024 hidden units, 1100 queries in three chunks).
        idx, kvals, _, dq = self._neighbours(gram, X, n_neighbors, exclude,
                                             "The local residual score",
                                             held=sum(t.nbytes for t in full))
        if self.lam <= 0:  # every training feature is zero: the span is {0}
            return to_numpy(_relative(dq, dq))
        n, k = idx.shape
        N = self.X.shape[0]
        # Each query of a group holds its k x k system, its factor and a temporary, in
        # half of the budget (beside the union's Gram; they had all of it).
        rows = rows_per_block(gram.budget // 2, 8 * 3 * k * k, "The local residual score")
        cap = max(k, min(math.isqrt(gram.budget // (4 * 8)), UNION_NEIGHBOURS * k))
        order = torch.argsort(idx[:, 0], stable=True)
        groups, start = [], 0
        while start < n:
            # Grow the group while the union of its neighbours stays under the cap.
            stop, union = start, torch.empty(0, dtype=torch.long, device=gram.device)
            while stop < n and stop - start < rows:
                grown = torch.unique(torch.cat([union, idx[order[stop]]]))
                if len(grown) > cap and stop > start:
                    break
                union, stop = grown, stop + 1
            groups.append((order[start:stop], union))
            start = stop
        Rt = gram.tensor(self.X)
        if not full and N * N <= sum(len(u) ** 2 for _, u in groups) \
                and 8 * N * N <= gram.budget // 4:
            full.append(gram.gram(Rt, budget=engine).to(torch.float64))
        explained = torch.empty(n, dtype=torch.float64, device=gram.device)
        for group, union in groups:
            if not full:
                KU, local = gram.gram(Rt[union], budget=engine).to(torch.float64), \
                    torch.searchsorted(union, idx[group])  # positions in the union
            else:
                KU, local = full[0], idx[group]
            A = KU[local.unsqueeze(2), local.unsqueeze(1)]  # (g, k, k)
            A.diagonal(dim1=1, dim2=2).add_(self.lam)
            explained[group] = _explained(A, kvals[group])
            del KU, A  # before the next group's Gram
        return to_numpy(_relative(dq - explained, dq))
