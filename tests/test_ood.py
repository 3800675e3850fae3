"""OODRankDetector against dense-Jacobian references (per-sample autograd + NumPy)."""

import copy
import os
import re
import subprocess
import sys
import tracemalloc
import warnings
import weakref

import joblib
import numpy as np
import pytest
import scipy.linalg
import torch
from _reference import features_loop, module_at, own_loop
from sklearn.base import clone
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning, DataConversionWarning, NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.multiclass import type_of_target

from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    RecordedNetwork,
)
from skpathkernel._analysis import _rank_gap
from skpathkernel._analysis._rank_gap import pivoted_cholesky
from skpathkernel._estimators import _ood
from skpathkernel._reproduce._fig7 import _relu_network
from skpathkernel.datasets import make_linear_extrapolation

# The old defaults, pinned: tanh, a fixed number of epochs, raw regression targets.
SMALL = dict(hidden_layer_sizes=(16,), solver="adam", learning_rate_init=0.01, max_iter=60,
             activation="tanh", tol=None, normalize_y=False, dtype="float64", random_state=0)


NET = {k: v for k, v in SMALL.items() if k != "normalize_y"}


def trainer(y, **params):
    """The trainer OODRankDetector's default picks for y, with the small settings."""
    if y is not None and type_of_target(y) in ("binary", "multiclass"):
        return PathKernelClassifier(**{**NET, **params})
    return PathKernelMachine(**{**SMALL, **params})


def dense_features(det, X):
    """phi(x) by a per-sample autograd loop: rows of the flattened Jacobian / sqrt(C)."""
    return features_loop(det.estimator_.module_, X)


def lstsq_residual(Phi_train, Phi):
    """Relative residual of each row of Phi outside the row span of Phi_train."""
    coef, *_ = np.linalg.lstsq(Phi_train.T, Phi.T, rcond=None)
    res = Phi.T - Phi_train.T @ coef
    return np.linalg.norm(res, axis=0) / np.linalg.norm(Phi, axis=1)


def leave_one_out_scores(Phi):
    """The "residual" score of each row of Phi against the span of all the other rows."""
    return np.array([-lstsq_residual(np.delete(Phi, i, 0), Phi[i : i + 1])[0]
                     for i in range(len(Phi))])


def task_data(task, rng):
    X = rng.normal(size=(20, 5))
    if task == "regression":
        return X, np.sin(X @ rng.normal(size=5))
    if task == "classification":
        return X, np.arange(20) % 3
    return X, None


@pytest.mark.parametrize("task", ["regression", "classification", "reconstruction"])
def test_residual_score_matches_dense_lstsq(task):
    rng = np.random.RandomState(0)
    X, y = task_data(task, rng)
    det = OODRankDetector(trainer(y), method="residual").fit(X, y)
    assert det.task_ == task
    Xq = np.vstack([rng.normal(size=(6, 5)), 3 * rng.normal(size=(4, 5))])
    ref = lstsq_residual(dense_features(det, X), dense_features(det, Xq))
    # 20 generic features in >= 113 dimensions: full rank, every point is a pivot.
    assert det.rank_ == 20
    assert ref.min() > 0.05  # the check could fail: new points leave a 20-dim span
    np.testing.assert_allclose(-det.score_samples(Xq), ref, atol=1e-6)
    np.testing.assert_allclose(det.score_samples(X), 0.0, atol=1e-4)


def test_alignment_score_matches_dense_cosines():
    rng = np.random.RandomState(1)
    X, y = task_data("classification", rng)
    det = OODRankDetector(trainer(y), method="alignment").fit(X, y)
    Xq = rng.normal(size=(7, 5))
    P, Q = dense_features(det, X), dense_features(det, Xq)
    cos = (Q @ P.T) / np.outer(np.linalg.norm(Q, axis=1), np.linalg.norm(P, axis=1))
    np.testing.assert_allclose(det.score_samples(Xq), cos.max(axis=1), atol=1e-10)
    np.testing.assert_allclose(det.score_samples(X), 1.0, atol=1e-10)


@pytest.mark.parametrize("method", ["residual", "alignment"])
def test_contamination_is_a_quantile_of_leave_one_out_scores(method):
    rng = np.random.RandomState(2)
    X, y = task_data("regression", rng)
    det = OODRankDetector(trainer(y), method=method, contamination=0.25).fit(X, y)
    P = dense_features(det, X)
    if method == "residual":
        loo = leave_one_out_scores(P)
    else:
        cos = (P @ P.T) / np.outer(np.linalg.norm(P, axis=1), np.linalg.norm(P, axis=1))
        np.fill_diagonal(cos, -np.inf)
        loo = cos.max(axis=1)
    assert np.ptp(loo) > 0.05
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 25), atol=1e-6)
    # The offset is the false-positive rate of the leave-one-out scores: 25% of them.
    assert np.mean(loo < det.offset_ - 1e-9) == pytest.approx(0.25, abs=0.051)


def nystrom_residuals(P, pivots, lam, Q, loo=True):
    """THEORY's all-N score, ``1 - k(x)^T (Theta + lam I)^{-1} k(x) / Theta(x, x)``, with
    ``Theta`` and ``k(x)`` those of the pivots' Nystrom factor ``G = Theta[:, L] C^{-T}``
    (``C C^T = Theta_LL``): ``Theta ~= G G^T``, ``k(x) ~= G C^{-1} k_L(x)``. Dense
    features, one N x N solve; and (``loo``) the leave-one-out scores, each training
    point against the N - 1 others under the same factor (``Theta_ii`` exact)."""
    K = P @ P.T
    C = np.linalg.cholesky(K[np.ix_(pivots, pivots)])
    G = np.linalg.solve(C, K[:, pivots].T).T
    k = G @ np.linalg.solve(C, (P @ Q.T)[pivots])
    A = G @ G.T + lam * np.eye(len(P))
    dq = (Q * Q).sum(1)
    query = np.sqrt(np.clip(1 - np.einsum("ij,ij->j", k, np.linalg.solve(A, k)) / dq, 0, 1))
    if not loo:
        return query
    loo = []
    for i in range(len(P)):
        Gi = np.delete(G, i, 0)
        ki = Gi @ G[i]
        v = K[i, i] - ki @ np.linalg.solve(Gi @ Gi.T + lam * np.eye(len(P) - 1), ki)
        loo.append(-np.sqrt(np.clip(v / K[i, i], 0, 1)))
    return query, np.array(loo)


def theory_scores(P, Q, lam):
    """THEORY's score of each row of ``Q`` against all rows of ``P``, ``-sqrt(1 - k^T
    (Theta + lam I)^{-1} k / Theta(x, x))``, from the features' SVD ``P = U S V^T`` in
    float64 without cancellation: the posterior variance is the part of ``phi`` outside
    the span plus the jitter's leak inside it, ``sum_j (v_j^T phi)^2 lam / (S_j^2 + lam)``."""
    _, S, Vt = np.linalg.svd(P, full_matrices=False)
    proj = Q @ Vt.T
    outside = Q - proj @ Vt
    var = (outside * outside).sum(1) + (proj**2 * lam / (S**2 + lam)).sum(1)
    return -np.sqrt(np.clip(var / (Q * Q).sum(1), 0, 1))


def theory_leave_one_out(P, lam):
    """Brute force: each row of ``P`` scored by :func:`theory_scores` against the span of
    the others, the formula refitted without it."""
    return np.array([theory_scores(np.delete(P, i, 0), P[i : i + 1], lam)[0]
                     for i in range(len(P))])


@pytest.mark.parametrize("d, hidden, n, seed", [(2, (3,), 200, 21), (3, (16,), 500, 0),
                                                (5, (16,), 400, 0)])
def test_residual_score_and_leave_one_out_are_theorys_formula(d, hidden, n, seed):
    """At the default rtol, every training feature in the pivots' span (r = rank P < N):
    the score is THEORY's formula over all N points, and the leave-one-out scores that
    set offset_ are that formula refitted without each point. A query scored against the
    pivots alone, ``k_L^T (Theta_LL + lam I)^{-1} k_L``, was 1.3e-5, 5.6e-4 and 1.4e-4
    off, and offset_ 5 to 8 times the leave-one-out quantile (a non-pivot was scored as
    a query)."""
    rng = np.random.RandomState(seed)
    X = rng.normal(size=(n, d))
    y = np.sin(X.sum(1))
    det = OODRankDetector(trainer(y, hidden_layer_sizes=hidden, max_iter=60),
                          method="residual", contamination=0.2).fit(X, y)
    Xq = np.vstack([rng.normal(size=(200, d)), 3 * rng.normal(size=(50, d))])
    P, Q = dense_features(det, X), dense_features(det, Xq)
    assert det.rank_ == np.linalg.matrix_rank(P) < n
    # Measured within 1e-7: rtol, the scale of an in-distribution point's score.
    np.testing.assert_allclose(det.score_samples(Xq), theory_scores(P, Q, det.lambda_),
                               rtol=0, atol=det.rtol)
    gram = _rank_gap.NetworkGram(det.estimator_)
    span, _, _, loo, _ = _rank_gap.TangentSpan.factorize(
        gram, X, det._train_diag, _rank_gap.TangentSpan.jitter(det._train_diag, det.rtol),
        n, loo=True)
    assert span.lam == det.lambda_
    brute = theory_leave_one_out(P, det.lambda_)
    # Each is ~1e-6; measured within 1e-9 of the brute force.
    np.testing.assert_allclose(-loo, brute, rtol=0, atol=1e-8)
    np.testing.assert_allclose(det.offset_, np.percentile(brute, 20), rtol=0, atol=1e-8)


def test_residual_score_stays_above_the_grams_resolution_on_a_well_covered_span():
    """3000 points on 449 parameters, every direction covered (the features' smallest
    singular value 3.7e-7 of the largest): at rtol=1e-6 the jitter's leak, which is all
    an in-distribution point's residual is (1e-12 of the largest diagonal), lay below
    the round-off of ``Theta(x, x) - ||L^{-1} k_L(x)||^2`` through the 451 pivots (1e-11):
    the scores of fresh in-distribution points were 31% off THEORY's formula (median;
    the AUROC against a 3x wider normal fell from 0.984 to 0.925). The jitter now stays
    above the pivots' Cholesky resolution, and lambda_ says which it is."""
    rng = np.random.RandomState(0)
    X, fresh = rng.normal(size=(3000, 5)), rng.normal(size=(1000, 5))
    Xq = np.vstack([fresh, 3 * rng.normal(size=(250, 5))])
    net = PathKernelMachine(hidden_layer_sizes=(64,), max_iter=20, activation="tanh",
                            solver="adam", learning_rate_init=0.01, tol=None,
                            normalize_y=False, dtype="float64", random_state=0)
    det = OODRankDetector(net, method="residual").fit(X, np.sin(X.sum(1)))
    P, Q = dense_features(det, X), dense_features(det, Xq)
    nominal = det.rtol**2 * (P * P).sum(1).max()
    assert det.lambda_ > 5 * nominal  # measured 13.5: the resolution, not rtol, sets it
    ref = theory_scores(P, Q, det.lambda_)
    score = det.score_samples(Xq)
    # Measured: 2% (median), 1.5e-5 (largest difference); 31% and 1.1e-4 without the floor.
    assert np.median(np.abs(score - ref)[:1000] / -ref[:1000]) < 0.1
    np.testing.assert_allclose(score, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("hidden", [(3,), (40,)])
def test_residual_score_is_the_all_n_formula_through_the_pivots_factor(hidden):
    """The span saturates (r < N): a query was scored against the r pivots alone,
    ``k_L^T (Theta_LL + lam I)^{-1} k_L``, and a training point against the N - 1 others,
    two different quantities (a float contamination flagged 0.22 of new data for 0.05 on
    digits). Both are now THEORY's formula over all N points, through the factor."""
    rng = np.random.RandomState(21)
    X = rng.normal(size=(120, 2))
    y = np.sin(X.sum(1))
    # rtol=1e-4 keeps the dense N x N solve of the reference well conditioned.
    det = OODRankDetector(trainer(y, max_iter=50, hidden_layer_sizes=hidden),
                          method="residual", rtol=1e-4, contamination=0.2).fit(X, y)
    assert det.rank_ < len(X)
    Xq = np.vstack([rng.normal(size=(20, 2)), 3 * rng.normal(size=(10, 2))])
    P, Q = dense_features(det, X), dense_features(det, Xq)
    ref, loo = nystrom_residuals(P, det.pivots_, det.lambda_, Q)
    np.testing.assert_allclose(-det.score_samples(Xq), ref, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 20), rtol=1e-6)
    # In-sample: each training feature lies in the span, to the jitter's leak.
    assert np.all(-det.score_samples(X) < 2 * det.rtol)


def test_residual_leave_one_out_without_room_for_the_qr_uses_the_leverages():
    """Below the budget of the QR's second N x r array, the leave-one-out residuals come
    from the leverages of the same factor: the same offset as with room for the QR."""
    rng = np.random.RandomState(21)
    X = rng.normal(size=(120, 2))
    y = np.sin(X.sum(1))
    net = PathKernelMachine(**{**SMALL, "hidden_layer_sizes": (40,), "max_iter": 50}).fit(X, y)
    big = OODRankDetector(FrozenEstimator(net), method="residual", rtol=1e-4,
                          contamination=0.2).fit(X)
    r = big.rank_
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    # Room for the leverages' pass, not for the QR's second array beside the factor (at
    # the pivots the smaller Gram blocks take: 55 of the same tolerance).
    small_net.memory_budget = _rank_gap.leverage_bytes(120, r + 10)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_rank_gap, "loo_relative_residuals", None)  # the QR pass must not run
        small = OODRankDetector(FrozenEstimator(small_net), method="residual", rtol=1e-4,
                                contamination=0.2).fit(X)
    # (Smaller Gram blocks: other pivots, of the same tolerance.)
    assert small.rank_ < len(X) and small._basis is None
    P = dense_features(big, X)
    _, loo = nystrom_residuals(P, small.pivots_, small.lambda_, P[:1])
    np.testing.assert_allclose(small.offset_, np.percentile(loo, 20), rtol=1e-5)


@pytest.mark.parametrize("share", [1.0, 0.6])
def test_residual_fit_stays_within_the_budget_at_full_rank(share):
    """memory_budget's contract at r ~ N, measured (torch's allocations during the fit):
    the budget's max_rank counted the N x r factor only, and the leverages' pass held two
    r x r arrays beside it and L, 1.8 times a budget that fits them (N = r = 150). Where
    the budget has room for its arrays (share 1) the rank is unchanged; below it (0.6)
    the rank is capped, with the warning. The scores are the all-N formula through the
    pivots' factor (dense features), and those of an ample budget where the rank is N."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(150, 5))
    y = np.sin(X.sum(1))
    Xq = np.vstack([rng.normal(size=(20, 5)), 3 * rng.normal(size=(10, 5))])
    net = PathKernelMachine(**{**SMALL, "hidden_layer_sizes": (64,), "max_iter": 30}).fit(X, y)
    params = dict(method="residual", rtol=1e-4, contamination=0.2)
    big = OODRankDetector(FrozenEstimator(net), **params).fit(X)
    assert big.rank_ == len(X)  # 449 parameters
    # The leverages' pass at r = N (no room for the QR's second N x r array): the factor,
    # L and the factor of M + lam I, two blocks of 64 rows and 16 vectors over the points.
    n = len(X)
    budget = int(share * 8 * (n * n + 2 * n * n + 2 * 64 * n + 16 * n))
    assert budget < 8 * (2 * 150 * 150 + 4 * 150 * 150)
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    small_net.memory_budget = budget
    OODRankDetector(FrozenEstimator(small_net), **params).fit(X[:20])  # one-time allocations
    det = OODRankDetector(FrozenEstimator(small_net), **params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, peak = cpu_peak_bytes(lambda: det.fit(X))
    capped = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert peak <= budget, (peak, budget)  # before: 1.79x (share 1), 1.92x (0.6)
    assert bool(capped) == (share < 1)
    assert det.rank_ == len(X) if share == 1 else det.rank_ < len(X)
    P, Q = dense_features(det, X), dense_features(det, Xq)
    query, loo = nystrom_residuals(P, det.pivots_, det.lambda_, Q)
    np.testing.assert_allclose(det.score_samples(Xq), -query, rtol=1e-5)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 20), rtol=1e-5)
    if share == 1:
        # Other pivot blocks and the leverages' pass instead of the QR: rounding.
        np.testing.assert_allclose(det.score_samples(Xq), big.score_samples(Xq), atol=1e-7)
        np.testing.assert_allclose(det.offset_, big.offset_, atol=1e-7)


def test_alignment_fit_scores_its_subset_beside_the_pivots_factor():
    """The alignment fit scores its training subset with the pivots' Cholesky factor
    (r x r float64) held beside it: sized from the whole budget, the scoring put the fit
    at 1.20x a 2 MB budget (N = 300, rank 259); it takes what the factor leaves."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(300, 5))
    net = PathKernelMachine(hidden_layer_sizes=(128,), max_iter=20, random_state=0,
                            solver="adam").fit(X, np.sin(X.sum(1)))
    budget = 2_000_000
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    small_net.memory_budget = budget
    det = OODRankDetector(FrozenEstimator(small_net), method="alignment", rtol=1e-6,
                          contamination=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        det.fit(X[:20])  # one-time allocations
        _, peak = cpu_peak_bytes(lambda: det.fit(X))
    assert det.rank_ > 200
    assert peak <= budget, (peak, budget)
    ample = OODRankDetector(FrozenEstimator(net), method="alignment", rtol=1e-6,
                            contamination=0.2).fit(X)
    np.testing.assert_allclose(det.offset_, ample.offset_, rtol=1e-12)


def _fit_under_budget(n, hidden, budget, method, rtol):
    """A detector fitted on ``n`` points of a one-hidden-layer network under ``budget``,
    and the peak of torch's allocations during the fit (after a first, smaller fit has
    made the one-time ones)."""
    X = np.random.RandomState(0).normal(size=(n, 5))
    net = PathKernelMachine(hidden_layer_sizes=(hidden,), max_iter=20, random_state=0,
                            solver="adam").fit(X, np.sin(X.sum(1)))
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    small_net.memory_budget = budget
    det = OODRankDetector(FrozenEstimator(small_net), method=method, rtol=rtol,
                          contamination=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        det.fit(X[:20])
        _, peak = cpu_peak_bytes(lambda: det.fit(X))
    return X, det, peak


@pytest.mark.parametrize("budget", [200_000, 600_000])
def test_alignment_rank_is_not_charged_the_leave_one_out_arrays(budget):
    """The alignment fit builds no leave-one-out arrays: charged the leverages' pass (two
    r x r arrays and two 64-row blocks beside the factor), its rank at a 600 kB budget
    (N = 200) was 124 where its own arrays allow more. The measured peak stays within
    the budget at the larger rank, and its scoring pass, sized from what L left without
    the fit's vectors over the points and the network's copy, held 1.035 times 200 kB
    (at the smaller rank). The pivots' features are independent."""
    n = 200
    X, det, peak = _fit_under_budget(n, 128, budget, "alignment", 1e-6)
    # The leverages' rank: the most r with the factor, two r x r arrays, two blocks of
    # 64 rows and 16 vectors over the points within the budget.
    charged = max(r for r in range(1, n + 1)
                  if 8 * (n * r + 2 * r * r + 2 * 64 * r + 16 * n) <= budget)
    assert peak <= budget, (peak, budget)  # was 1.035 times 200 kB
    assert det.rank_ > charged + 5, (det.rank_, charged)  # 58 and 182, were 50 and 124
    P = dense_features(det, X[det.pivots_])
    assert np.linalg.matrix_rank(P, tol=1e-6 * np.linalg.norm(P, 2)) == det.rank_


@pytest.mark.parametrize("budget", [160_000, 170_000])
def test_residual_fit_chooses_the_qr_only_where_its_blocks_and_vectors_fit(budget):
    """The leave-one-out pass takes the thin QR (a second N x r array) where the budget
    holds it, else the leverages. The choice counted the two N x r and four r x r arrays
    but not the fit's vectors over the points nor the least row blocks, and took the QR
    at 1.055 and 1.050 times these budgets (N = 150, a rank of 40-42 that the tolerance,
    not the budget, set)."""
    n = 150
    _, det, peak = _fit_under_budget(n, 5, budget, "residual", 1e-10)
    assert det.rank_ < _rank_gap.budget_rank(budget, n)  # the tolerance set the rank
    assert peak <= budget, (peak, budget)


def _queries(n):
    rng = np.random.RandomState(1)
    return np.vstack([rng.normal(size=(2 * n // 3, 5)), 3 * rng.normal(size=(n // 3, 5))])


@pytest.mark.parametrize(("n", "hidden"), [(1000, 16), (300, 128)])
def test_local_fit_and_scores_stay_within_the_budget(n, hidden):
    """method="local" at a 1 MiB budget held the neighbours of all its queries at once
    (indices, kernel values, the groups' unions: the fit's leave-one-out points),
    computed a group's union Gram beside the previous group's, and gave the engine the
    whole budget beside its output: the fit took 1.30 times the budget (N = 1000) and
    1.19 (128 hidden units), the scores of 300 queries 1.19. Queries are scored a chunk
    at a time (the fit's 1000 in three); the scores are the dense lstsq residuals on the
    best-aligned neighbours, the offset their leave-one-out quantile."""
    budget = 2**20
    X, det, peak = _fit_under_budget(n, hidden, budget, "local", 1e-6)
    Xq = _queries(300)
    scores, score_peak = cpu_peak_bytes(lambda: det.score_samples(Xq))
    assert peak <= budget, peak / budget
    assert score_peak <= budget, score_peak / budget
    P, Q = dense_features(det, X), dense_features(det, Xq)
    np.testing.assert_allclose(-scores, local_residual(P, Q, 20), atol=1e-6)
    loo = -local_residual(P, P, 20, exclude=np.arange(n))
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 20), atol=1e-6)


def test_residual_scores_of_a_leverages_fit_stay_within_the_budget():
    """Scoring held a row block's two (r, b) solves until the next block's Gram was
    computed beside them, by an engine given the whole budget: 1.08 times a 1 MiB budget
    (N = 1000 at the budget's rank, the leverages' fit; 900 queries in two blocks). The
    scores are the all-N formula through the pivots' factor (dense features)."""
    budget = 2**20
    X, det, _ = _fit_under_budget(1000, 64, budget, "residual", 1e-6)
    assert det._post is not None  # the leverages' pass: two triangular solves a block
    Xq = _queries(900)
    scores, peak = cpu_peak_bytes(lambda: det.score_samples(Xq))
    assert peak <= budget, peak / budget
    # Features of the float64 network the Grams are computed with (a float32 Jacobian
    # moved the scores by 1e-4: they cancel, Theta(x, x) - ||c||^2).
    module = copy.deepcopy(det.estimator_.module_).double()
    P, Q = features_loop(module, X), features_loop(module, Xq)
    # The all-N formula through its r x r form, k^T (G G^T + lam I)^{-1} k = c^T M (M +
    # lam I)^{-1} c (M = G^T G, k = G c): the N x N solve of nystrom_residuals is
    # ill-conditioned where 65 pivots leave every other direction at lam (1e-12 of the
    # largest; its round-off moved the scores by 1%).
    K = P @ P.T
    L = det.pivots_
    C = np.linalg.cholesky(K[np.ix_(L, L)])
    G = np.linalg.solve(C, K[:, L].T).T
    c = np.linalg.solve(C, (P[L] @ Q.T))
    M = G.T @ G
    explained = np.einsum("ij,ij->j", c, M @ np.linalg.solve(M + det.lambda_ * np.eye(len(L)), c))
    query = np.sqrt(np.clip(1 - explained / (Q * Q).sum(1), 0, 1))
    np.testing.assert_allclose(scores, -query, rtol=1e-6)


def test_residual_qr_fit_below_the_budgets_rank_makes_the_qr_in_the_factors_memory():
    """The factor is allocated for the budget's max_rank pivots (on a CPU its untouched
    pages are not resident, but allocated is held); where the tolerance stops the
    pivots well below it (113 of 177), that storage and the QR's Q beside it took 1.066
    times a 1.7 MB budget (N = 600). The QR is made in the factor's memory: the same
    Q and R bit for bit, so the same offset as a QR beside it, and the scores the
    all-N formula (dense features)."""
    budget, n = 1_700_000, 600
    X, det, peak = _fit_under_budget(n, 16, budget, "residual", 1e-4)
    assert det._post is None and det.rank_ < _rank_gap.budget_rank(budget, n) - 50
    assert peak <= budget, peak / budget
    real = _rank_gap.loo_relative_residuals
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_rank_gap, "loo_relative_residuals",
                  lambda *args, overwrite, **kwargs: real(*args, **kwargs))
        beside = clone(det).fit(X)
    assert np.array_equal(beside.pivots_, det.pivots_) and beside.offset_ == det.offset_
    Xq = _queries(30)
    module = copy.deepcopy(det.estimator_.module_).double()  # the Grams' float64 network
    P, Q = features_loop(module, X), features_loop(module, Xq)
    query = nystrom_residuals(P, det.pivots_, det.lambda_, Q, loo=False)
    # The span holds every direction (113 parameters): the scores are the jitter's leak,
    # ~1e-4, cancelled from the features' norms.
    np.testing.assert_allclose(det.score_samples(Xq), -query, rtol=1e-5, atol=1e-8)


def _peak_with_scipy_eigh(monkeypatch, fn):
    """``fn()``, the peak of its allocations (:func:`cpu_peak_bytes`) and its number of
    SciPy eigendecompositions. Their eigenvalues, eigenvectors and LAPACK workspace are
    NumPy memory, which torch's profiler does not see: each call's own peak
    (tracemalloc), then its outputs for as long as the eigenvectors live, are mirrored
    by torch allocations of their size."""
    real = scipy.linalg.eigh
    mirrors = {}

    def eigh(*args, **kwargs):
        tracemalloc.start()
        try:
            w, v = real(*args, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        torch.empty(peak, dtype=torch.uint8)  # freed at once: the call's peak
        mirrors[id(v)] = torch.empty(v.nbytes + w.nbytes, dtype=torch.uint8)
        weakref.finalize(v, mirrors.pop, id(v), None)
        eigh.calls += 1
        return w, v

    eigh.calls = 0
    monkeypatch.setattr(scipy.linalg, "eigh", eigh)
    out, peak = cpu_peak_bytes(fn)
    return out, peak, eigh.calls


def _reject_cholesky(monkeypatch):
    """``torch.linalg.cholesky_ex`` factorising as asked (in place where asked) but
    reporting every matrix (not batch) indefinite: jittered_cholesky's fallback, which
    no fit measured reached at any rtol (its jitter is at least the pivots' Cholesky
    resolution), on demand."""
    real = torch.linalg.cholesky_ex

    def rejecting(A, *args, **kwargs):
        L, info = real(A, *args, **kwargs)
        return L, torch.ones_like(info) if A.dim() == 2 else info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", rejecting)


@pytest.mark.parametrize("mode", ["copy", "overwrite", "rebuild"])
def test_cholesky_fallback_factors_the_psd_part_beside_one_array(mode, monkeypatch):
    """Where Cholesky rejects ``K + lam I`` (a jitter of 1e-20 below the round-off of a
    rank-deficient Gram), jittered_cholesky's factor satisfies ``L L^T = K_+ + lam I``,
    ``K_+`` the Gram without its negative eigenvalues (NumPy's eigh, float64), lower
    triangular with a positive diagonal. Beside ``K`` (and the sum's copy where ``K``
    is kept) the fallback held about nine ``r x r`` arrays (the symmetrised Gram, eigh's
    workspace, the stacked ``[sqrt(S_+) V^T; sqrt(lam) I]`` and the QR's copy of it);
    now one (the failed factor, then the eigenvectors) and LAPACK's vectors."""
    rng = np.random.RandomState(0)
    r = 200
    A = rng.normal(size=(r, 60)) * np.logspace(-3, 3, 60)
    K = A @ A.T
    lam = 1e-20 * np.abs(K).max()
    Kt = torch.as_tensor(K)
    _, info = torch.linalg.cholesky_ex(Kt + lam * torch.eye(r, dtype=Kt.dtype))
    assert info > 0
    s, v = np.linalg.eigh(K)
    expected = (v * np.clip(s, 0, None)) @ v.T + lam * np.eye(r)
    W = Kt.clone()
    kwargs = {"copy": {}, "overwrite": {"overwrite": True},
              "rebuild": {"rebuild": lambda out: out.copy_(Kt)}}[mode]
    L, peak, calls = _peak_with_scipy_eigh(
        monkeypatch, lambda: _rank_gap.jittered_cholesky(W, lam, **kwargs))
    assert peak <= 8 * ((mode == "copy") * r * r + r * r + 64 * r), peak / (8 * r * r)
    assert calls == 1
    L = L.numpy()
    assert np.array_equal(L, np.tril(L)) and (np.diag(L) > 0).all()
    np.testing.assert_allclose(L @ L.T, expected, rtol=0, atol=1e-13 * np.abs(K).max())
    if mode == "copy":
        assert torch.equal(W, Kt)


@pytest.mark.parametrize("room_for_qr", [False, True])
def test_residual_fit_on_the_cholesky_fallback_stays_within_the_budget(room_for_qr,
                                                                       monkeypatch):
    """jittered_cholesky's fallback held about nine ``r x r`` arrays beside the Gram: on
    it, a fit at N = r = 150 took 2.8 times a budget that holds its arrays (the
    leverages' pass) and 2.0 times (the QR's). It now works in the sum's memory with one
    more ``r x r`` array, for which the passes leave room (the leverages' pass takes L
    from G again after it), and the fit and the scores stay within the budget. The
    scores are the fit's without the fallback, and the all-N formula through the
    pivots' factor (dense features)."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(150, 5))
    Xq = np.vstack([rng.normal(size=(20, 5)), 3 * rng.normal(size=(10, 5))])
    net = PathKernelMachine(**{**SMALL, "hidden_layer_sizes": (64,), "max_iter": 30}).fit(
        X, np.sin(X.sum(1)))
    n = len(X)
    budget = (_rank_gap.qr_loo_bytes if room_for_qr else _rank_gap.leverage_bytes)(n, n)
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    small_net.memory_budget = budget
    params = dict(method="residual", rtol=1e-4, contamination=0.2)
    plain = OODRankDetector(FrozenEstimator(small_net), **params).fit(X)
    assert plain.rank_ == n and (plain._post is None) == room_for_qr
    det = OODRankDetector(FrozenEstimator(small_net), **params)
    det.fit(X[:20])  # one-time allocations
    _reject_cholesky(monkeypatch)
    _, fit_peak, calls = _peak_with_scipy_eigh(monkeypatch, lambda: det.fit(X))
    scores, score_peak = cpu_peak_bytes(lambda: det.score_samples(Xq))
    assert fit_peak <= budget, fit_peak / budget  # was 2.8 (leverages), 2.0 (QR)
    assert score_peak <= budget, score_peak / budget
    assert calls == 1 and det.rank_ == n
    np.testing.assert_allclose(scores, plain.score_samples(Xq), rtol=1e-7)
    np.testing.assert_allclose(det.offset_, plain.offset_, rtol=1e-7)
    P, Q = dense_features(det, X), dense_features(det, Xq)
    query, loo = nystrom_residuals(P, det.pivots_, det.lambda_, Q)
    np.testing.assert_allclose(scores, -query, rtol=1e-5)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 20), rtol=1e-5)


def test_local_fallback_is_the_pseudo_inverse_without_its_product():
    """The local score's systems that Cholesky rejects (``rtol`` of 1e-8 and below) take
    ``b^T A^+ b``, the pseudo-inverse without eigenvalues under ``pinv``'s cutoff. Formed
    by ``pinv`` and multiplied by ``b``, it held 4.2 ``(g, k, k)`` arrays beside ``A``
    (5.2 with every system rejected), where the group's budget counts three with ``A``,
    and the product cancelled: for ``b = A c`` (the neighbours' kernel row lies in their
    span) the exact value is ``c^T A c``, which it missed by up to 6e-3 relative (median
    6e-4) at eigenvalues down to 1e-12. From the eigenvectors, in the rejected systems'
    copy: the factor's one array at the peak, and 8e-15."""
    rng = np.random.RandomState(0)
    g, k = 256, 16
    basis, _ = np.linalg.qr(rng.normal(size=(g, k, k)))
    # A negative eigenvalue above the cutoff (k eps, kept, as pinv keeps it), zeros
    # under it; every fourth system positive definite (Cholesky's).
    eig = np.r_[np.logspace(0, -12, k - 3), -1e-14, 0.0, 0.0] * np.ones((g, 1))
    eig[::4] = np.logspace(0, -3, k)
    A = np.einsum("gij,gj,gkj->gik", basis, eig, basis)
    c = rng.normal(size=(g, k))
    b = np.einsum("gij,gj->gi", A, c)
    At, bt = torch.as_tensor(A), torch.as_tensor(b)
    _, info = torch.linalg.cholesky_ex(At)
    assert (info > 0).sum() == 3 * g // 4
    out, peak = cpu_peak_bytes(lambda: _rank_gap._explained(At, bt))
    assert peak <= 1.2 * At.nbytes, peak / At.nbytes  # was 4.2
    np.testing.assert_allclose(out.numpy(), np.einsum("gi,gij,gj->g", c, A, c),
                               rtol=1e-10)


@pytest.mark.parametrize("room_for_qr", [True, False])
def test_residual_fit_needs_no_svd_and_the_leverages_no_eigendecomposition(room_for_qr):
    """The fit's r x r work at large rank (benchmarks/results/ood_residual_ab.md, N = r =
    2000): an SVD of R (3.9 s) took 1.5x the pivots-only fit, and on the leverages' pass
    (no room for the QR) M's eigendecomposition beside its Cholesky factor 3.1x. Without
    either, the scores and the offset are still the all-N formula through the pivots'
    factor, evaluated from the features."""
    rng = np.random.RandomState(3)
    X = rng.normal(size=(120, 2))
    y = np.sin(X.sum(1))
    net = PathKernelMachine(**{**SMALL, "hidden_layer_sizes": (40,), "max_iter": 50}).fit(X, y)
    r = OODRankDetector(FrozenEstimator(net), method="residual", rtol=1e-4).fit(X).rank_
    if not room_for_qr:
        net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
        # Room for the leverages' pass (at the 49 pivots of the smaller Gram blocks), not
        # for the QR's second array.
        net.memory_budget = _rank_gap.leverage_bytes(120, r + 5)

    def refused(*args, **kwargs):
        raise AssertionError("not needed by the fit")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.linalg, "svd", refused)
        if not room_for_qr:
            m.setattr(torch.linalg, "eigh", refused)
        det = OODRankDetector(FrozenEstimator(net), method="residual", rtol=1e-4,
                              contamination=0.2).fit(X)
    Xq = np.vstack([rng.normal(size=(60, 2)), 3 * rng.normal(size=(20, 2))])
    P, Q = dense_features(det, X), dense_features(det, Xq)
    query, loo = nystrom_residuals(P, det.pivots_, det.lambda_, Q)
    np.testing.assert_allclose(det.score_samples(Xq), -query, rtol=1e-5)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 20), rtol=1e-5)


@pytest.mark.parametrize("kind", ["tanh", "relu_1d", "mostly_pivots"])
def test_a_contamination_is_the_false_positive_rate_on_new_data_when_the_span_saturates(kind):
    """More training points than directions: every residual is the jitter's O(rtol) leak.
    The exact leave-one-out residuals (each point against the N - 1 others) leaked several
    times less than a new point scored against the pivots, so contamination=0.1 put
    offset_ below every new point's score and flagged all of them; scoring the
    non-pivots as queries still left the pivots' exact residuals, and where most points
    are pivots ("mostly_pivots": 80 of 200) 0.1 flagged 0.2 of new data."""
    rng = np.random.RandomState(21)
    if kind in ("tanh", "mostly_pivots"):
        draw = lambda n: rng.normal(size=(n, 2))  # noqa: E731
        params = dict(hidden_layer_sizes=(3,) if kind == "tanh" else (40,))
    else:
        draw = lambda n: rng.uniform(0, 1, size=(n, 1))  # noqa: E731
        params = dict(hidden_layer_sizes=(8,), activation="relu")
    X = draw(200)
    y = np.sin(X.sum(1))
    det = OODRankDetector(trainer(y, max_iter=50, **params), method="residual",
                          contamination=0.1).fit(X, y)
    P = dense_features(det, X)
    if kind == "mostly_pivots":  # 161 parameters, a smoothly decaying spectrum
        assert len(X) // 4 < det.rank_ < len(X)
    else:
        assert np.linalg.matrix_rank(P) < len(X) // 4  # the reference: a saturated span
        assert det.rank_ < len(X) // 4
    # The documented meaning of a float: the share of new data from the training
    # distribution that predict flags: the coverage of a 10% quantile of 200 scores has
    # a standard error of sqrt(0.1 * 0.9 / 200) = 0.021; four of them either side.
    fresh = draw(2000)
    assert np.mean(det.predict(fresh) == -1) == pytest.approx(0.1, abs=0.085)


def test_a_contamination_is_the_false_positive_rate_on_held_out_digits():
    """Digits 0-4, 8 tanh units (444 pivots of 600 points, a nearly saturated span): a
    query scored against the pivots alone leaked more than a training point against
    the others, and contamination=0.05 / 0.2 flagged 0.116 / 0.794 of held-out digits
    0-4. The decision now reads the same all-N formula for both."""
    X, y = load_digits(return_X_y=True)
    inside = y < 5
    Xtr, Xte, ytr, _ = train_test_split(X[inside] / 16.0, y[inside], train_size=600,
                                        stratify=y[inside], random_state=0)
    # tol=None: the 200 epochs the measurement trained, without a convergence warning.
    net = PathKernelClassifier(hidden_layer_sizes=(8,), activation="tanh", max_iter=200,
                               tol=None, random_state=0).fit(Xtr, ytr)
    for c in (0.05, 0.2):
        det = OODRankDetector(FrozenEstimator(net), method="residual",
                              contamination=c).fit(Xtr)
        # Standard errors of the coverage: the quantile of 600 training scores and the
        # share of the 301 held-out points; four of them either side.
        se = np.sqrt(c * (1 - c) / len(Xtr)) + np.sqrt(c * (1 - c) / len(Xte))
        assert np.mean(det.predict(Xte) == -1) == pytest.approx(c, abs=4 * se)


@pytest.mark.parametrize("frozen, early_stopping", [(False, False), (True, False),
                                                    (False, True)])
def test_zero_weight_rows_are_absent_from_the_span_and_the_offset(frozen, early_stopping):
    """scikit-learn's weight 0: the row is absent. A span holding it scored it (and any
    point near it) as fully normal."""
    rng = np.random.RandomState(3)
    X, y = task_data("regression", rng)
    X[7] = 4.0  # far from the rest: in no span but one that holds it
    w = rng.uniform(0.5, 2.0, size=len(X))
    w[[2, 7, 13]] = 0.0
    est = trainer(y, early_stopping=early_stopping, validation_fraction=0.2)
    if frozen:
        est = FrozenEstimator(clone(est).fit(X, y, sample_weight=w))
    det = OODRankDetector(est, method="residual", contamination=0.25).fit(
        X, y, sample_weight=w)
    Xq = np.vstack([X[[2, 7, 13]], X[7] + 0.1, rng.normal(size=(3, 5))])
    if early_stopping:  # the span is the training part's (held-out rows 0, 6 kept)
        rows = det.estimator_._train_rows
        assert {2, 7, 13} <= set(rows)
        X, w = X[rows], w[rows]
    keep = w > 0
    np.testing.assert_array_equal(det.X_fit_, X[keep])
    P = dense_features(det, X)
    ref = lstsq_residual(P[keep], dense_features(det, Xq))
    assert ref[:4].min() > 0.05  # the check could fail: the dropped rows leave the span
    np.testing.assert_allclose(-det.score_samples(Xq), ref, atol=1e-6)
    # The offset: the quantile of the kept rows' leave-one-out residuals alone.
    loo = leave_one_out_scores(P[keep])
    # (The jitter lam moves a LOO residual of a point near the others' span by ~1e-5.)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 25), atol=5e-5)


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
def test_repeated_training_rows_are_one_point_of_the_span(method):
    """A repeated row adds nothing to the span, but its copy made its leave-one-out
    score 0: with every row twice the scores behind offset_ were all round-off, and a
    contamination of 0.25 put offset_ at -0.0 (every new point flagged)."""
    rng = np.random.RandomState(4)
    X, y = task_data("regression", rng)
    net = FrozenEstimator(trainer(y).fit(X, y))
    X_rep = np.vstack([X, X[::-1], X[:5]])
    det = OODRankDetector(net, method=method, n_neighbors=4,
                          contamination=0.25).fit(X_rep)
    np.testing.assert_array_equal(det.X_fit_, X)  # first occurrences, in order
    P = dense_features(det, X)
    if method == "residual":
        loo = leave_one_out_scores(P)
    elif method == "local":
        loo = -local_residual(P, P, 4, exclude=np.arange(len(X)))
    else:
        cos = (P @ P.T) / np.outer(np.linalg.norm(P, axis=1), np.linalg.norm(P, axis=1))
        np.fill_diagonal(cos, -np.inf)
        loo = cos.max(axis=1)
    assert np.percentile(loo, 25) < (0.99 if method == "alignment" else -0.01)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 25), atol=5e-5)
    # Queries see the span of the distinct rows: a local span of 4 distinct neighbours.
    Xq = np.vstack([X[:3] + 0.3 * rng.normal(size=(3, 5)), 3 * rng.normal(size=(3, 5))])
    Q = dense_features(det, Xq)
    ref = {"local": lambda: -local_residual(P, Q, 4),
           "residual": lambda: -lstsq_residual(P, Q),
           "alignment": lambda: (Q @ P.T / np.outer(np.linalg.norm(Q, axis=1),
                                                    np.linalg.norm(P, axis=1))).max(1)}
    np.testing.assert_allclose(det.score_samples(Xq), ref[method](), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2 distinct training points"):
        OODRankDetector(net, method=method).fit(np.repeat(X[:1], 5, axis=0))


def local_residual(Phi_train, Phi, k, exclude=None):
    """Relative residual of each row of Phi outside the span of its k best-aligned rows of
    Phi_train (by cosine; ``exclude[i]``: a row of Phi_train left out for row i), lstsq."""
    cos = (Phi @ Phi_train.T) / np.outer(np.linalg.norm(Phi, axis=1),
                                         np.linalg.norm(Phi_train, axis=1))
    if exclude is not None:
        cos[np.arange(len(Phi)), exclude] = -np.inf
    out = []
    for i, row in enumerate(cos):
        nb = np.argsort(-row, kind="stable")[:k]
        out.append(lstsq_residual(Phi_train[nb], Phi[i : i + 1])[0])
    return np.array(out)


def tukey_offset(loo, ceiling):
    q1, q3 = np.percentile(loo, [25, 75])
    return min(q1 - 1.5 * (q3 - q1), ceiling)


@pytest.mark.parametrize("task", ["regression", "classification", "reconstruction"])
@pytest.mark.parametrize("k", [1, 4, 25])
def test_local_residual_matches_dense_lstsq_on_best_aligned_neighbours(task, k):
    rng = np.random.RandomState(10)
    X, y = task_data(task, rng)
    det = OODRankDetector(trainer(y), method="local", n_neighbors=k).fit(X, y)
    Xq = np.vstack([rng.normal(size=(6, 5)), 3 * rng.normal(size=(4, 5))])
    P, Q = dense_features(det, X), dense_features(det, Xq)
    ref = local_residual(P, Q, min(k, len(X)))
    assert ref.min() > 0.05  # the check could fail: new points leave every local span
    np.testing.assert_allclose(-det.score_samples(Xq), ref, atol=1e-6)
    if k >= len(X):  # every training point is a neighbour: the global span
        np.testing.assert_allclose(ref, lstsq_residual(P, Q), atol=1e-10)
    if k == 1:  # one neighbour: the sine of the angle to the best-aligned feature
        cos = (Q @ P.T) / np.outer(np.linalg.norm(Q, axis=1), np.linalg.norm(P, axis=1))
        np.testing.assert_allclose(ref, np.sqrt(1 - cos.max(1) ** 2), atol=1e-7)


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
def test_auto_offset_is_tukeys_fence_of_leave_one_out_scores(method):
    rng = np.random.RandomState(3)
    X, y = task_data("regression", rng)
    det = OODRankDetector(trainer(y), method=method, n_neighbors=4).fit(X, y)
    P = dense_features(det, X)
    rows = np.arange(len(X))
    if method == "local":
        loo = -local_residual(P, P, 4, exclude=rows)
    elif method == "residual":
        loo = leave_one_out_scores(P)
    else:
        cos = (P @ P.T) / np.outer(np.linalg.norm(P, axis=1), np.linalg.norm(P, axis=1))
        np.fill_diagonal(cos, -np.inf)
        loo = cos.max(axis=1)
    ceiling = np.sqrt(1 - 1e-4) if method == "alignment" else -0.01
    assert np.ptp(loo) > 0.05  # a spread fence, not the floor
    # The fence weighs two quantiles by 2.5 and 1.5: the jitter's ~1e-6 on each residual
    # adds up to a few 1e-6 on it.
    np.testing.assert_allclose(det.offset_, tukey_offset(loo, ceiling), atol=1e-5)
    Xq = np.vstack([X[:3], 4 * rng.normal(size=(40, 5))])
    s, d, p = det.score_samples(Xq), det.decision_function(Xq), det.predict(Xq)
    np.testing.assert_allclose(d, s - det.offset_)
    np.testing.assert_array_equal(p, np.where(d >= 0, 1, -1))
    assert p.dtype.kind == "i" and set(np.unique(p)) == {-1, 1}
    assert np.all(p[:3] == 1)  # training points lie in their own span
    assert not hasattr(det, "fit_predict")
    # A refit with the local method drops the factorisation it does not compute.
    assert hasattr(det.set_params(method="residual").fit(X, y), "rank_")
    assert not hasattr(det.set_params(method="local").fit(X, y), "rank_")


def test_fit_predict_is_refused_with_its_reason_also_through_a_pipeline():
    # As LocalOutlierFactor(novelty=True): no fit_predict (every training point lies in its
    # own span, so in-sample labels say nothing), refused with the reason, not with
    # scikit-learn's bare "has no attribute" alone, which reads as a bug. available_if
    # raises its own message from the check's, so the reason is in the traceback's chain.
    def chain(exc):
        messages = []
        while exc is not None:
            messages.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        return "\n".join(messages)

    rng = np.random.RandomState(3)
    X, y = task_data("regression", rng)
    det = OODRankDetector(trainer(y), method="residual").fit(X, y)
    assert not hasattr(det, "fit_predict")
    with pytest.raises(AttributeError) as info:
        det.fit_predict(X, y)
    assert "no fit_predict: every training point" in chain(info.value)
    pipe = make_pipeline(StandardScaler(), OODRankDetector(trainer(None)))
    with pytest.raises(AttributeError) as info:
        pipe.fit_predict(X)
    assert "then predict(X_new)" in chain(info.value)


def test_leave_one_out_uses_an_evenly_spaced_subset_of_large_training_sets(monkeypatch):
    rng = np.random.RandomState(11)
    X, y = task_data("classification", rng)
    monkeypatch.setattr(_ood, "_LOO_POINTS", 7)
    det = OODRankDetector(trainer(y), n_neighbors=3, contamination=0.3).fit(X, y)
    sub = np.unique(np.linspace(0, len(X) - 1, 7).round().astype(int))
    assert len(sub) == 7
    P = dense_features(det, X)
    loo = -local_residual(P, P[sub], 3, exclude=sub)
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 30), atol=1e-6)


def test_default_decision_flags_the_extrapolation_beyond_a_relu_kink():
    """The seeds' figures 7-8: a unit with its kink at the training domain's edge is never
    active in training; beyond it the default decision flags the test points, inside the
    domain none."""
    X, y, _, _ = make_linear_extrapolation(n_train=50, n_test=25)
    det = OODRankDetector(PathKernelMachine(
        module=_relu_network([0.1, 0.4, 0.7, 1.0, 1.3, 2.0]), solver="adam",
        learning_rate_init=0.003, max_iter=1000, dtype="float64", random_state=0)).fit(X, y)
    # The leave-one-out residuals are round-off (each training feature is in the span of
    # its neighbours on the same linear piece), so the floor sets the offset.
    assert det.offset_ == -0.01
    beyond = np.linspace(2, 4, 26)[1:, None]
    inside = np.random.RandomState(0).uniform(0, 2, size=(100, 1))
    P = dense_features(det, X)
    ref = local_residual(P, dense_features(det, beyond), 20)
    assert ref.min() > 0.05  # the reference itself: unit 6 adds a direction
    np.testing.assert_array_equal(det.predict(beyond), -1)
    np.testing.assert_array_equal(det.predict(inside), 1)


@pytest.mark.parametrize("kind", ["tanh_wide", "tanh_saturated", "relu_far"])
def test_rank_gap_matches_numpy_matrix_rank(kind):
    """Both ranks count singular values above rtol times the training features' largest
    (numpy's SVD of the dense features here): a far query's large features must not
    raise the joint threshold and drop the training directions from the joint count."""
    rng = np.random.RandomState(4)
    if kind == "tanh_wide":  # N < P: full rank, queries add directions
        X, y = rng.normal(size=(12, 3)), rng.normal(size=12)
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(8,))).fit(X, y)
        Xq = rng.normal(size=(5, X.shape[1]))
    elif kind == "tanh_saturated":  # N > P: the training features span all they can
        X, y = rng.normal(size=(80, 2)), rng.normal(size=80)
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(4,))).fit(X, y)
        Xq = rng.normal(size=(5, X.shape[1]))
    else:  # a ReLU network's features grow linearly: a query 1e6 away dwarfs them
        X = np.linspace(0, 1, 20)[:, None]
        y = 2 * X[:, 0] + 1
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(6,), activation="relu")).fit(X, y)
        Xq = np.array([[1e6]])
    P, Q = dense_features(det, X), dense_features(det, Xq)
    top = np.linalg.svd(P, compute_uv=False)[0]

    def rank(A):
        sv = np.linalg.svd(A, compute_uv=False)
        # Never below what a float64 Gram resolves: 1e-7 of the matrix's own largest.
        tol = max(det.rtol * top, 1e-7 * sv[0])
        # the reference must not sit on the threshold (else round-off decides it)
        assert not np.any(np.isclose(sv, tol, rtol=1e-2))
        return int(np.sum(sv > tol))

    if kind == "tanh_wide":  # every training feature independent: said so
        with pytest.warns(UserWarning, match="linearly independent"):
            rt, rj = det.rank_gap(Xq)
    else:
        rt, rj = det.rank_gap(Xq)
    assert (rt, rj) == (rank(P), rank(np.vstack([P, Q])))
    if kind == "tanh_wide":
        assert rj == rt + 5
    elif kind == "tanh_saturated":
        assert rj == rt == det.n_params_
    else:
        # Relative to the joint features' own largest, a training direction fell below
        # the threshold and the query's new one went unseen: the gap used to read 0.
        joint = np.linalg.svd(np.vstack([P, Q]), compute_uv=False)
        assert np.sum(joint > det.rtol * joint[0]) == rt
        assert rj == rt + 1



def test_rank_gap_warns_where_in_distribution_points_gap_as_well():
    """With more parameters than training points every training feature is independent
    (numpy's rank of the dense features: N), so held-out points of the training
    distribution add their directions exactly as outliers do (the user guide's digits
    example: (400, 405) for both): rank_gap says so. Where the features saturate their
    span (N > P), a gap is the seeds' sign, and nothing is said."""
    rng = np.random.RandomState(4)
    X, y = rng.normal(size=(12, 3)), rng.normal(size=12)
    det = OODRankDetector(trainer(y, hidden_layer_sizes=(8,))).fit(X, y)
    inside, outside = rng.normal(size=(4, 3)), 6 + rng.normal(size=(4, 3))
    Phi = dense_features(det, X)
    assert np.linalg.matrix_rank(Phi) == len(X)
    for Xq in (inside, outside):
        with pytest.warns(UserWarning, match=r"linearly independent \(rank_train = N = 12\)"):
            gap = det.rank_gap(Xq)
        joint = np.vstack([Phi, dense_features(det, Xq)])
        assert gap == (12, np.linalg.matrix_rank(joint)) == (12, 16)
    X, y = rng.normal(size=(80, 2)), rng.normal(size=80)
    det = OODRankDetector(trainer(y, hidden_layer_sizes=(4,))).fit(X, y)
    assert np.linalg.matrix_rank(dense_features(det, X)) < len(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        det.rank_gap(rng.normal(size=(5, 2)))

def test_seed_figures_7_8_rank_gap_of_a_unit_never_active_in_training():
    X, y, Xt, yt = make_linear_extrapolation(n_train=50, n_test=25)
    # A small initial output slope (6 x 0.2 < 2) lets training raise it without pushing
    # kinks out of the domain (with 6 x 0.5 the last kinks drift to its right edge).
    params = dict(solver="adam", learning_rate_init=0.003, max_iter=1000, dtype="float64",
                  random_state=0)
    results = {}
    for name, kinks in [("inside", [0.1, 0.4, 0.7, 1.0, 1.3, 1.6]),
                        ("outside", [0.1, 0.4, 0.7, 1.0, 1.3, 2.0])]:
        det = OODRankDetector(PathKernelMachine(module=_relu_network(kinks), **params),
                              method="residual").fit(X, y)
        first = det.estimator_.module_[0]
        w, b = first.weight.detach().numpy()[:, 0], first.bias.detach().numpy()
        test_loss = 0.5 * np.mean((det.estimator_.predict(Xt) - yt) ** 2)
        rt, rj = det.rank_gap(Xt)
        results[name] = dict(kinks=-b / w, w=w, loss=test_loss, gap=rj - rt,
                             score=det.score_samples(Xt), rank=det.rank_, n=len(X))
    inside, outside = results["inside"], results["outside"]
    # Figure 8, left: every unit is active on part of the training domain after training.
    assert np.all(inside["w"] > 0) and np.all(inside["kinks"] < X.max())
    assert inside["gap"] == 0
    assert np.all(inside["score"] > -1e-3)
    # Figure 8, right: unit 6 never saw a training point, so it never moved ...
    assert outside["kinks"][5] == pytest.approx(2.0, abs=1e-12)
    assert outside["w"][5] == pytest.approx(1.0, abs=1e-12)
    # ... and turns on at test time: new tangent directions, a larger test loss.
    assert outside["gap"] >= 1
    assert outside["score"][1:].max() < -0.05
    assert outside["loss"] > 10 * inside["loss"]
    # The span saturates: far fewer pivots than training points (the low-rank path).
    assert inside["rank"] < inside["n"] // 2


def test_low_rank_factor_matches_dense_lstsq_when_span_saturates():
    X, y, Xt, _ = make_linear_extrapolation(n_train=50, n_test=25)
    net = PathKernelMachine(module=_relu_network([0.1, 0.4, 0.7, 1.0, 1.3, 2.0]), solver="adam",
                            learning_rate_init=0.01, max_iter=300, dtype="float64",
                            random_state=0)
    det = OODRankDetector(net, method="residual").fit(X, y)
    assert det.rank_ < 20
    ref = lstsq_residual(dense_features(det, X), dense_features(det, Xt[1:]))
    np.testing.assert_allclose(-det.score_samples(Xt[1:]), ref, atol=1e-5)


@pytest.mark.parametrize("lazy", [True, False])
def test_pivoted_cholesky_recovers_a_low_rank_psd_matrix_over_several_blocks(lazy,
                                                                             monkeypatch):
    # lazy=False is the GPU's factor, grown by doubling from 2 blocks (8 columns) to 9.
    monkeypatch.setattr(_rank_gap, "_lazy_pages", lambda device: lazy)
    rng = np.random.RandomState(5)
    F = rng.normal(size=(60, 9)) * np.logspace(0, -2, 9)
    A = torch.as_tensor(F @ F.T)
    G, piv = pivoted_cholesky(lambda idx: A[:, idx], A.diagonal().clone(), 1e-12 * A.max(),
                               max_rank=60, block=4)
    assert len(piv) == 9 and len(set(piv.tolist())) == 9
    np.testing.assert_allclose((G @ G.T).numpy(), A.numpy(), atol=1e-9)


def test_max_rank_truncation_warns():
    """A cap that stops the factorisation before rtol is a miss of the tolerance: a
    ConvergenceWarning (a UserWarning, as before) that says how far the span is from it."""
    rng = np.random.RandomState(6)
    X, y = task_data("regression", rng)
    with pytest.warns(ConvergenceWarning, match="max_rank=5") as rec:
        det = OODRankDetector(trainer(y), method="residual", max_rank=5).fit(X, y)
    assert det.rank_ == 5 and len(det.pivots_) == 5
    message = str(next(w.message for w in rec if w.category is ConvergenceWarning))
    achieved = float(re.search(r"lies ([\d.e+-]+) times the largest", message).group(1))
    # The farthest training feature from the pivots' span, by dense least squares.
    Phi = dense_features(det, X)
    coef, *_ = np.linalg.lstsq(Phi[det.pivots_].T, Phi.T, rcond=None)
    far = np.linalg.norm(Phi.T - Phi[det.pivots_].T @ coef, axis=0).max()
    assert achieved == pytest.approx(far / np.linalg.norm(Phi, axis=1).max(), rel=1e-2)
    assert achieved > det.rtol


def test_fits_warnings_point_at_the_callers_line():
    """fit's own warnings (an rtol below float64's resolution, a max_rank reached) named
    skpathkernel/_estimators/_base.py, the line of the decorator that keeps a previous
    fit on error, which also made Python's once-per-location filter merge them."""
    rng = np.random.RandomState(6)
    X, y = task_data("regression", rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OODRankDetector(trainer(y), method="residual", rtol=1e-9, max_rank=3).fit(X, y)
    categories = {type(w.message) for w in caught if w.filename == __file__}
    assert {UserWarning, ConvergenceWarning} <= categories, [
        (w.category.__name__, w.filename) for w in caught]


def test_frozen_estimator_is_not_retrained_and_survives_clone():
    rng = np.random.RandomState(7)
    X, y = task_data("classification", rng)
    clf = PathKernelClassifier(**NET).fit(X, y)
    traj, curve, net = clf.trajectory_, list(clf.loss_curve_), clf.network_
    det = OODRankDetector(FrozenEstimator(clf)).fit(X)
    assert det.estimator_ is clf and clf.trajectory_ is traj and clf.loss_curve_ == curve
    assert clf.network_ is net and det.trajectory_ is traj and det.task_ == "classification"
    own = OODRankDetector(trainer(y)).fit(X, y)  # same settings: the same network
    Xq = rng.normal(size=(5, 5))
    np.testing.assert_allclose(det.score_samples(Xq), own.score_samples(Xq), atol=1e-10)
    frozen = clone(OODRankDetector(FrozenEstimator(clf)))
    np.testing.assert_allclose(frozen.fit(X).score_samples(Xq), det.score_samples(Xq))
    assert frozen.estimator_ is clf
    with pytest.raises(NotFittedError):
        OODRankDetector(FrozenEstimator(PathKernelClassifier())).fit(X)
    # Unfrozen, a trainer is cloned and fitted: a classifier cannot learn X without y.
    with pytest.raises(ValueError, match="reconstruct X.*FrozenEstimator"):
        OODRankDetector(clf).fit(X)
    refit = OODRankDetector(clf).fit(X, y)
    assert refit.estimator_ is not clf and clf.trajectory_ is traj


def test_float32_network_scores_like_its_float64_evaluation():
    rng = np.random.RandomState(8)
    X, y = task_data("regression", rng)
    det = OODRankDetector(trainer(y, dtype="float32"), method="residual").fit(X, y)
    Xq = rng.normal(size=(5, 5))
    module = det.estimator_.module_
    det.estimator_.module_ = module.double()  # the reference: the same weights in float64
    ref = lstsq_residual(dense_features(det, X), dense_features(det, Xq))
    det.estimator_.module_ = module.float()
    np.testing.assert_allclose(-det.score_samples(Xq), ref, atol=1e-6)


def test_errors():
    rng = np.random.RandomState(9)
    X, y = task_data("regression", rng)
    with pytest.raises(NotFittedError):
        OODRankDetector().score_samples(X)
    det = OODRankDetector(trainer(y)).fit(X, y)
    with pytest.raises(ValueError, match="features"):
        det.score_samples(X[:, :3])
    with pytest.raises(ValueError, match="memory_budget"):
        OODRankDetector(trainer(y, memory_budget=2**20)).fit(X, y).rank_gap(
            rng.normal(size=(200, 5)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        det.fit(X, y)  # refits cleanly


def _token_net(n_features_in, n_outputs):
    return torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * n_features_in, n_outputs))


def _sequence_net(n_features_in, n_outputs):
    # A Linear on (n, 4, 3), shared over the 4 positions.
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(20, n_outputs))


@pytest.mark.parametrize("kind", ["tokens", "sequences"])
@pytest.mark.parametrize("method", ["local", "residual"])
def test_token_ids_and_sequences_score_like_the_dense_reference(kind, method):
    """With ``module=``, X of shape (n, ...): token ids reach the embedding as integers,
    sequences keep their axes, and the scores are the dense residuals of their features."""
    rng = np.random.RandomState(14)
    if kind == "tokens":
        # Token 5 never occurs in training: its embedding row is a direction no training
        # feature has (the features are sums over positions, so the others' are spanned).
        X, Xq, module = rng.randint(0, 5, size=(24, 3)), rng.randint(0, 6, size=(8, 3)), _token_net
        Xq[::2, 0] = 5
    else:
        X, Xq, module = rng.normal(size=(24, 4, 3)), 2 * rng.normal(size=(8, 4, 3)), _sequence_net
    y = np.arange(24) % 2
    params = {k: v for k, v in SMALL.items() if k not in ("hidden_layer_sizes", "normalize_y")}
    det = OODRankDetector(PathKernelClassifier(module=module, **params), method=method,
                          n_neighbors=4).fit(X, y)
    assert det.input_shape_ == X.shape[1:]
    P, Q = dense_features(det, X), dense_features(det, Xq)
    # 24 rows of 3 tokens of 5 repeat some: a repeated row is one point of a local span.
    P = P[np.unique(X.reshape(len(X), -1), axis=0, return_index=True)[1]]
    ref = local_residual(P, Q, 4) if method == "local" else lstsq_residual(P, Q)
    assert ref.max() > 0.05  # the check could fail: some queries leave the span
    # Queries inside the span score O(rtol) = 1e-6, not 0: the jitter lam (rtol=1e-6).
    np.testing.assert_allclose(-det.score_samples(Xq), ref, atol=1e-5)
    with pytest.raises(ValueError, match="features|shape"):  # another trailing shape
        det.score_samples(Xq[:, :2])
    if kind == "tokens":
        # Without y the network would regress the id codes: refused before any training,
        # and the fitted detector is kept; the default MLP takes integers as features.
        before = det.score_samples(Xq)
        with pytest.raises(ValueError, match="token ids.*pass targets y.*FrozenEstimator"):
            det.set_params(estimator=PathKernelMachine(module=module, **params)).fit(X)
        np.testing.assert_array_equal(det.score_samples(Xq), before)
        OODRankDetector(PathKernelMachine(**params), n_neighbors=4).fit(X)


def test_scores_stay_the_fitted_methods_after_set_params():
    """The scores are those of the fit's method and neighbours, which offset_ and the
    factorisation belong to: set_params without a refit changes nothing fitted (a
    "local" fit scored with "residual" read -1 for every point, training points too)."""
    rng = np.random.RandomState(0)
    X, y = task_data("regression", rng)
    Xq = np.vstack([X[:3], 4 * rng.normal(size=(3, 5))])
    det = OODRankDetector(trainer(y), method="local", n_neighbors=5, rtol=1e-6).fit(X, y)
    scores, labels, gap = det.score_samples(Xq), det.predict(Xq), det.rank_gap(Xq)
    for change in (dict(method="residual"), dict(method="alignment"), dict(n_neighbors=2),
                   dict(rtol=0.5)):
        det.set_params(**change)
        np.testing.assert_array_equal(det.score_samples(Xq), scores)
        np.testing.assert_array_equal(det.predict(Xq), labels)
        assert det.rank_gap(Xq) == gap
        # A refit takes the new parameters: the scores were the fit's, not frozen ones.
        refit = clone(det).fit(X, y)
        if "rtol" not in change:
            assert not np.array_equal(refit.score_samples(Xq), scores), change
        det.set_params(method="local", n_neighbors=5, rtol=1e-6)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_span_of_one_positive_weight_point_is_refused(frozen):
    """One point spans one direction and leaves no leave-one-out score to set offset_ (it
    read NaN, and every point, the training point too, an outlier); the previous fit
    is kept."""
    rng = np.random.RandomState(0)
    X, y = task_data("regression", rng)
    w = np.zeros(len(X))
    w[4] = 1.0
    est = trainer(y)
    if frozen:
        est = FrozenEstimator(clone(est).fit(X, y))
    det = OODRankDetector(est, method="alignment").fit(X, y)
    before = det.score_samples(X[:3])
    with pytest.raises(ValueError,
                       match="at least 2 distinct training points of positive weight for its "
                             "span; got 1"):
        det.fit(X, y, sample_weight=w)
    np.testing.assert_array_equal(det.score_samples(X[:3]), before)
    assert len(det.X_fit_) == len(X)
    w[5] = 1.0  # two points: a span and a leave-one-out score each
    assert np.isfinite(det.fit(X, y, sample_weight=w).offset_)


@pytest.mark.parametrize("method", ["residual", "alignment"])
def test_a_rank_tolerance_below_the_grams_round_off_factorises(method):
    """rtol=1e-10 puts the jitter (1e-20 of the largest Gram eigenvalue) below the float64
    round-off of the pivots' Gram: ``Theta_LL + lam I`` came out indefinite and fit
    crashed in torch.linalg.cholesky ("not positive-definite"), for a valid rtol."""
    rng = np.random.RandomState(1)
    X = rng.normal(size=(60, 2))
    y = np.sin(X.sum(1))
    with pytest.warns(UserWarning, match="rtol=1e-10 is below 1e-07"):
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(6,)), method=method,
                              rtol=1e-10).fit(X, y)
    assert np.isfinite(det.offset_) and det.rank_ <= len(X)
    Xq = 3 * rng.normal(size=(5, 2))
    P, Q = dense_features(det, X), dense_features(det, Xq)
    assert P.shape[1] == 25 and np.linalg.matrix_rank(P) == 25  # N > P: a full span
    if method == "residual":
        # Every query lies in the span of 60 features that span all 25 directions. The
        # jitter rtol**2 (1e-20) is far below what the pivots' Cholesky factor resolves,
        # and the score is THEORY's formula at that resolution, lambda_, to its round-off
        # (measured 0.6%).
        assert det.lambda_ > 1e3 * det.rtol**2 * (P * P).sum(1).max()
        np.testing.assert_allclose(det.score_samples(Xq), theory_scores(P, Q, det.lambda_),
                                   rtol=0.02)
        np.testing.assert_allclose(-det.score_samples(Xq), lstsq_residual(P, Q), atol=1e-3)
    else:
        cos = (Q @ P.T) / np.outer(np.linalg.norm(Q, axis=1), np.linalg.norm(P, axis=1))
        np.testing.assert_allclose(det.score_samples(Xq), cos.max(axis=1), atol=1e-10)


def test_residual_leave_one_out_at_a_tiny_rtol_when_every_point_is_a_pivot():
    """With every training point a pivot, the exact leave-one-out pass added
    ``(1 - ||Q_i||^2) / lam``, round-off of a square orthogonal Q (exactly 0) divided by a
    jitter of 1e-20: it explained every point and moved offset_ by 4e-4 at rtol=1e-10."""
    rng = np.random.RandomState(2)
    X, y = task_data("regression", rng)
    with pytest.warns(UserWarning, match="counts directions that are round-off"):
        det = OODRankDetector(trainer(y), method="residual", rtol=1e-10,
                              contamination=0.25).fit(X, y)
    assert det.rank_ == len(X)
    P = dense_features(det, X)
    loo = leave_one_out_scores(P)
    assert np.ptp(loo) > 0.05
    np.testing.assert_allclose(det.offset_, np.percentile(loo, 25), atol=1e-7)


def test_a_rank_tolerance_below_float64s_resolution_warns_and_counts_round_off():
    """The warning's claim: at rtol=1e-10 a network of 25 parameters gets a span of more
    than 25 directions (round-off counted), the numbers its ranks cannot reach; at 1e-7
    neither the warning nor the excess."""
    rng = np.random.RandomState(1)
    X = rng.normal(size=(60, 2))
    y = np.sin(X.sum(1))
    Xq = 3 * rng.normal(size=(5, 2))
    with pytest.warns(UserWarning, match="round-off"):
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(6,)), method="residual",
                              rtol=1e-10).fit(X, y)
    assert dense_features(det, X).shape[1] == 25
    assert det.rank_ > 25 and max(det.rank_gap(Xq)) > 25
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        det = OODRankDetector(trainer(y, hidden_layer_sizes=(6,)), method="residual",
                              rtol=1e-7).fit(X, y)
    assert det.rank_ <= 25 and max(det.rank_gap(Xq)) <= 25


@pytest.mark.parametrize("method", ["residual", "alignment"])
def test_max_rank_beyond_the_budget_is_capped_by_it(method):
    """An explicit max_rank above what memory_budget holds was honoured: the fit held
    1.97 ("residual") and 1.04 ("alignment") times the budget at max_rank = N. It is
    capped at the budget's rank, the same fit as max_rank=None, and the warning names
    the budget as the bound reached."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(150, 5))
    net = PathKernelMachine(**{**SMALL, "hidden_layer_sizes": (64,), "max_iter": 30}).fit(
        X, np.sin(X.sum(1)))
    n = len(X)
    budget = 4 * (3 * n * n + 2 * 64 * n + 16 * n)  # half of the leverages' pass at r = N
    small_net = copy.copy(net)  # the budget is set on a copy, below validation's 1 MiB
    small_net.memory_budget = budget
    params = dict(method=method, rtol=1e-4)
    OODRankDetector(FrozenEstimator(small_net), **params).fit(X[:20])  # one-time allocations
    auto = OODRankDetector(FrozenEstimator(small_net), **params)
    with pytest.warns(ConvergenceWarning, match=f"the most that memory_budget={budget:,}"):
        auto.fit(X)
    det = OODRankDetector(FrozenEstimator(small_net), max_rank=n, **params)
    with pytest.warns(ConvergenceWarning, match=f"the most that memory_budget={budget:,}"):
        _, peak = cpu_peak_bytes(lambda: det.fit(X))
    assert peak <= budget, (peak, budget)
    assert det.rank_ == auto.rank_ < n
    np.testing.assert_array_equal(det.pivots_, auto.pivots_)
    # Below the budget's rank, max_rank is the bound, and the warning says so.
    with pytest.warns(ConvergenceWarning, match=f"max_rank={auto.rank_ - 5} pivots"):
        low = OODRankDetector(FrozenEstimator(small_net), max_rank=auto.rank_ - 5,
                              **params).fit(X)
    assert low.rank_ == auto.rank_ - 5


def _dense_scores(method, P, Q, k):
    """score_samples (of Q) and leave-one-out scores (of P) from the dense features."""
    if method == "residual":
        return -lstsq_residual(P, Q), leave_one_out_scores(P)
    if method == "local":
        return -local_residual(P, Q, k), -local_residual(P, P, k, exclude=np.arange(len(P)))

    def cos(A):
        return (A @ P.T) / np.outer(np.linalg.norm(A, axis=1), np.linalg.norm(P, axis=1))
    own = cos(P)
    np.fill_diagonal(own, -np.inf)
    return cos(Q).max(axis=1), own.max(axis=1)


@pytest.mark.parametrize("how", ["frozen", "bare"])
@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_an_own_loops_recorded_network_scores_like_the_dense_reference(kind, method, how):
    """OOD detection for a network trained in the user's own loop (PathRecorder's
    RecordedNetwork, bare or frozen): the span of its training features at the last
    recorded parameters, scored as the dense lstsq / cosine references of its per-sample
    gradients score it, and offset_ Tukey's fence of their leave-one-out scores. It was
    refused with a TypeError."""
    net, X = own_loop(kind)
    est = FrozenEstimator(net) if how == "frozen" else net
    det = OODRankDetector(est, method=method, n_neighbors=4).fit(X[:16])
    assert det.estimator_ is net and det.task_ == "regression" and det.n_outputs_ == 2
    Xq = np.concatenate([X[16:], 3.0 * X[:3]])
    module = module_at(net)
    P, Q = features_loop(module, X[:16]), features_loop(module, Xq)
    ref, loo = _dense_scores(method, P, Q, 4)
    if method != "alignment":
        assert ref.max() < -0.01  # the check could fail: new points leave the spans
    np.testing.assert_allclose(det.score_samples(Xq), ref, atol=1e-6)
    ceiling = np.sqrt(1 - 1e-4) if method == "alignment" else -0.01
    np.testing.assert_allclose(det.offset_, tukey_offset(loo, ceiling), atol=1e-5)
    # Without X_train the recorded network takes fit's X as its form.
    bare, _ = own_loop(kind, X_train=False)
    np.testing.assert_allclose(
        OODRankDetector(bare, method=method, n_neighbors=4).fit(X[:16]).score_samples(Xq),
        det.score_samples(Xq), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="could not take X"):
        OODRankDetector(bare).fit(X[:16].reshape(16, -1)[:, :2])


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
def test_a_recorded_network_scores_as_the_frozen_trainer_of_its_path(method):
    """The same network and path, as a RecordedNetwork or as the fitted trainer that
    recorded it in a FrozenEstimator: the same span, offset_, scores and rank gap."""
    rng = np.random.RandomState(12)
    X, y = task_data("classification", rng)
    clf = PathKernelClassifier(**NET).fit(X, y)
    net = RecordedNetwork(clf.module_, clf.trajectory_, X_train=X, y_train=y,
                          loss="log_loss")
    det = OODRankDetector(net, method=method, n_neighbors=5).fit(X)
    ref = OODRankDetector(FrozenEstimator(clf), method=method, n_neighbors=5).fit(X)
    assert det.task_ == ref.task_ == "classification"
    assert det.n_outputs_ == ref.n_outputs_ == 3
    Xq = rng.normal(size=(6, 5))
    np.testing.assert_allclose(det.score_samples(Xq), ref.score_samples(Xq), rtol=1e-12,
                               atol=1e-12)
    assert det.offset_ == pytest.approx(ref.offset_, rel=1e-12, abs=1e-12)
    assert det.rank_gap(Xq) == ref.rank_gap(Xq)
    assert not hasattr(det, "loss_curve_") and hasattr(ref, "loss_curve_")


_MMAP_SCORES = """
import sys, warnings
import joblib, numpy as np
warnings.simplefilter("error")  # torch warns (once a process) on a read-only array
det = joblib.load(sys.argv[1], mmap_mode="r")
X = np.load(sys.argv[1] + ".X.npy")
np.save(sys.argv[1] + ".out.npy", det.score_samples(X))
"""


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
def test_a_detector_loaded_with_mmap_mode_scores_without_warnings(method, tmp_path):
    # joblib.load(..., mmap_mode="r") hands back read-only arrays: the fitted span's
    # went to torch as they were, and every score warned that torch "does not support
    # non-writable tensors". In a fresh process: torch warns once a process.
    X, y = load_digits(return_X_y=True)
    X, y = X[:120] / 16, y[:120]
    det = OODRankDetector(trainer(y, max_iter=3, tol=None), method=method).fit(X, y)
    dump = str(tmp_path / "det.joblib")
    joblib.dump(det, dump)
    np.save(dump + ".X.npy", X[:30])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _MMAP_SCORES, dump], env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(np.load(dump + ".out.npy"), det.score_samples(X[:30]))


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
def test_tangent_features_that_overflow_float64_are_refused_and_change_nothing(method):
    # Finite float64 inputs near 1e300 train a float64 network to a finite loss, but their
    # tangent features' squared norms overflow the detector's float64 Gram: the fit failed
    # inside torch.linalg.eigh ("failed to converge"), rank_gap in LAPACK's words.
    rng = np.random.RandomState(0)
    X, y = rng.normal(size=(12, 3)), np.arange(12) % 3
    det = OODRankDetector(PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3,
                                               dtype="float64", random_state=0),
                          method=method).fit(X, y)
    before = det.score_samples(X[:3]), det.rank_gap(X[:3])
    trained = det.estimator_.trajectory_.parameters(-1).clone()
    assert np.isfinite(det.estimator_.predict_proba(X[:2] * 1e300)).all()  # the network: finite
    # rank_gap: 2 of the 14 points stacked, the 12 training points first.
    match = r"tangent features of 2 of these (2|14) inputs are not finite in float64"
    for verb in (det.score_samples, det.decision_function, det.predict, det.rank_gap):
        with pytest.raises(ValueError, match=match):
            verb(X[:2] * 1e300)
    with pytest.raises(ValueError, match="tangent features of 12 of these 12 inputs"):
        det.fit(X * 1e300, y)
    np.testing.assert_array_equal(det.score_samples(X[:3]), before[0])
    assert det.rank_gap(X[:3]) == before[1]
    assert torch.equal(det.estimator_.trajectory_.parameters(-1), trained)


def test_reconstructing_a_single_feature_trains_on_it_as_1d_targets():
    # The reconstruction targets of one-feature X are a column, which PathKernelMachine
    # takes as MLPRegressor does (1-D, with a DataConversionWarning): the detector passes
    # them 1-D, warning nothing the user did not do, and trains the same network.
    X = np.random.RandomState(0).normal(size=(20, 1))
    params = dict(hidden_layer_sizes=(3,), max_iter=2, tol=None, dtype="float64",
                  random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataConversionWarning)
        det = OODRankDetector(PathKernelMachine(**params)).fit(X)
    ref = PathKernelMachine(**params).fit(X, X[:, 0])
    np.testing.assert_array_equal(det.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    assert det.n_outputs_ == 1
