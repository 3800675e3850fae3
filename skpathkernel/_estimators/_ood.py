"""OODRankDetector: flag inputs whose tangent feature leaves the span of the training ones.

A trained network extrapolates badly where its tangent feature ``phi(x)`` has a component
outside ``span{phi(x_i)}`` (the extrapolation-failure figures of Domingos-style kernel
analyses: a ReLU unit never active on the training domain turns on at test time). The
detector scores that component from tangent-kernel Gram matrices alone, with the span
numerics of :mod:`skpathkernel._analysis._rank_gap`:

* ``method="local"`` (default): the relative residual of ``phi(x)`` outside the span of
  its ``n_neighbors`` best-aligned training features;
* ``method="residual"``: the relative residual outside the span of all training features,
  ``s(x)^2 = 1 - k(x)^T (Theta + lam I)^{-1} k(x) / Theta(x, x)``, the noise-free Gaussian
  process posterior variance under the tangent kernel, normalised;
* ``method="alignment"``: ``max_i K_hat(x, x_i)``, the best cosine between ``phi(x)`` and
  a stored training feature (the "feature memory" view).

``contamination="auto"`` places ``offset_`` at Tukey's upper fence of the leave-one-out
training residuals (each training point scored against the others), never below 1% of
the feature's norm.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings

import numpy as np
import torch
from sklearn.base import OutlierMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.metaestimators import available_if

from .._analysis._rank_gap import (
    BLOCK,
    POINT_VECTORS,
    RTOL_RESOLUTION,
    NetworkGram,
    TangentSpan,
    budget_rank,
)
from .._device import to_numpy
from .._modules import runs_module
from .._network._trained import network_of
from .._parallel import by_reference, map_row_blocks, n_row_blocks
from .._path._training import warn_drawing_now
from .._validation import count, validate_params
from .._warnings import caller_stacklevel
from ._base import keep_previous_fit_on_error
from ._machine import PathKernelClassifier, PathKernelMachine
from ._meta import (
    ESTIMATOR_DOC,
    FITTED_DOC,
    NetworkMetaEstimator,
    flat_targets,
    trained_task,
    trainer_for,
)

__all__ = ["OODRankDetector"]

# contamination="auto": never flag a point with less than this fraction of ||phi(x)||
# outside the span (for "alignment": outside the direction of its best-aligned training
# feature, cos > sqrt(1 - 0.01^2)). It matters where the leave-one-out residuals collapse
# to round-off (training features that span each other exactly, as a piecewise-linear
# ReLU network on 1-D inputs), so that the fence does not sit at round-off level.
_MIN_RESIDUAL = 0.01
_AUTO_CEILING = {"local": -_MIN_RESIDUAL, "residual": -_MIN_RESIDUAL,
                 "alignment": math.sqrt(1.0 - _MIN_RESIDUAL**2)}
# Leave-one-out scores of at most this many training points (evenly spaced in X_fit_) set
# offset_ for "local" and "alignment": each costs a Gram row against all N training
# points, and a quantile or a fence of 2000 values is already precise.
_LOO_POINTS = 2000


def _auto_offset(loo_scores, method) -> float:
    """Tukey's fence below the leave-one-out scores, capped at the residual floor.

    ``Q1 - 1.5 IQR`` of the scores (higher = more normal): the textbook boundary of
    outliers of a sample, here the training points each scored against the others.
    """
    q1, q3 = np.percentile(loo_scores, [25, 75])
    return float(min(q1 - 1.5 * (q3 - q1), _AUTO_CEILING[method]))


def _loo_subset(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, _LOO_POINTS)).round().astype(np.intp))


def _distinct_rows(X: np.ndarray) -> np.ndarray:
    """Mask of the first occurrence of each distinct row of ``X`` (any trailing shape).

    Rows are compared by their bytes, hashed (a row at a time: no sorted copy of ``X``);
    a row whose hash is an earlier row's is dropped only when it equals that row.
    """
    flat = X.reshape(len(X), -1)
    keys = np.fromiter((hash(row.tobytes()) for row in flat), dtype=np.int64,
                       count=len(flat))
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    first = first[inverse.ravel()]
    keep = first == np.arange(len(flat))
    for i in np.flatnonzero(~keep):
        keep[i] = not np.array_equal(flat[i], flat[first[i]])
    return keep


def _no_fit_predict(self):
    # A check that raises names the reason, as LocalOutlierFactor(novelty=True)'s does;
    # one that returns False gets scikit-learn's bare "has no attribute", which reads as
    # a bug (Pipeline.fit_predict repeats it). hasattr stays False either way.
    raise AttributeError(
        f"{type(self).__name__} has no fit_predict: every training point lies in the span "
        "of the training features and scores as normal in-sample, so labels of the "
        "training set itself would say nothing. Use fit(X_train) and then predict(X_new); "
        "offset_ is set from the leave-one-out scores of the training points."
    )


# The scores run the trained network's module (a float64 copy is taken of it): its lock.
_runs_detector_module = runs_module(lambda det: network_of(det).module,
                                     check=warn_drawing_now)


# The fitted span's arrays, which the scores hand to torch.
_SPAN_ARRAYS = ("_train_diag", "_chol", "_basis", "_eig", "_post")


class OODRankDetector(OutlierMixin, NetworkMetaEstimator):
    """Out-of-distribution detector: the part of phi(x) outside span{{phi(x_i)}}.

    Fits a network trainer (or reads a fitted one in a ``FrozenEstimator``, or a
    :class:`RecordedNetwork` of your own training loop) and flags
    inputs whose tangent feature ``phi(x) = d f(x; theta_T) / d theta`` is not explained
    by the training features: the rank gap of figures 7-8 of Guo, He & Morel (2026),
    scored per point from tangent-kernel Gram matrices alone (the Jacobian is never
    formed).

    Parameters
    ----------{estimator}
        None: a default-constructed trainer chosen by ``fit``'s targets. Without ``y``
        the network is trained self-supervised, to reconstruct its input
        (``n_features_in_`` outputs, squared error on ``X`` itself): a
        :class:`PathKernelMachine`, which a given trainer must then be. With ``y``: a
        :class:`PathKernelClassifier` when
        :func:`~sklearn.utils.multiclass.type_of_target` is "binary", "multiclass"
        (note that integer-valued regression targets count as "multiclass") or
        "multilabel-indicator", a
        :class:`PathKernelMachine` otherwise. With a ``FrozenEstimator`` or a
        :class:`RecordedNetwork` (your own loop's network), ``fit(X)`` only computes
        the factorisation of the span of ``phi(X)`` (pass ``estimator.X_fit_``, or
        the recorded loop's training inputs, for the training span) and ``y`` is
        ignored.
    method : {{"local", "residual", "alignment"}}, default="local"
        What ``score_samples`` measures (higher = more normal). With
        ``Theta`` the tangent Gram (trace over outputs) at the final parameters:

        - "local": ``-s_S(x)``, the relative residual of ``phi(x)`` outside the span of
          its ``n_neighbors`` best-aligned training features ``S`` (largest cosine
          ``K_hat(x, x_i)``), ``s_S(x)^2 = 1 - k_S(x)^T (Theta_SS + lam I)^{{-1}}
          k_S(x) / Theta(x, x)``; in [-1, 0].
        - "residual": the same outside the span of all N training features, ``k(x) =
          Theta(X_fit_, x)`` (THEORY's score, the normalised posterior variance),
          evaluated through the pivots' factorisation at the jitter ``lambda_`` (see
          Notes): 0 inside the span, -1 orthogonal to it.
        - "alignment": ``max_i K_hat(x, x_i)``, the best cosine between ``phi(x)`` and a
          training feature; in [-1, 1].

        "local" interpolates between the other two: with ``n_neighbors=1`` its residual
        is ``sqrt(1 - a^2)`` for the best cosine ``a``, with ``n_neighbors >= N`` it is
        "residual". It is the default because it led on every near-OOD split measured
        (held-out digit classes and letters that look like digits; see the user guide),
        where a high-dimensional global span also contains new classes; "residual" is
        better on smooth low-dimensional tabular data, and is the one ``rank_`` and
        ``pivots_`` describe.
    n_neighbors : int, default=20
        Training features whose span scores a query with ``method="local"`` (at most
        N; N - 1 for the leave-one-out scores). 20, as
        :class:`~sklearn.neighbors.LocalOutlierFactor`: fewer track the nearest feature
        (closer to "alignment"), more the global span.
    rtol : float, default=1e-6
        Rank tolerance, relative to singular values: a direction counts when its singular
        value exceeds ``rtol`` times the largest, i.e. its Gram eigenvalue exceeds
        ``rtol**2`` times the largest (singular values are square roots of Gram
        eigenvalues). The jitter is ``lam = rtol**2 * max_i Theta(x_i, x_i)``, and the
        factorisation keeps pivots until every training feature is within
        ``sqrt(lam) = rtol * max_i ||phi(x_i)||`` of their span. Grams are computed in
        float64 (see Notes), so one default serves float32 and float64 networks; below
        ~1e-7 the tolerance reaches float64's round-off on Gram eigenvalues, and the
        span (``rank_``, ``rank_gap``) also counts directions that are round-off (more
        than the network has parameters, on a small one): ``fit`` warns. The
        detection (AUROC on the user guide's benchmark) barely moves between 1e-6 and
        1e-2, though the scores themselves can (where the features' spectrum decays
        smoothly); above, the jitter hides the small new directions of an
        extrapolating ReLU unit.
    contamination : "auto" or float in (0, 0.5], default="auto"
        Sets ``offset_`` (IsolationForest's convention) from the *leave-one-out*
        training scores: each training point scored against the others, the scores new
        data from the training distribution gets, for an evenly spaced subset of at
        most 2000 training points. "auto": Tukey's fence ``Q1 - 1.5 IQR`` of those
        scores, but never a point with less than 1% of ``||phi(x)||`` outside the span
        (``offset_ <= -0.01``; ``sqrt(1 - 0.01**2)`` for "alignment"): that floor decides
        when the training features span each other exactly and their leave-one-out
        residuals are round-off. A float: the ``contamination`` quantile of those
        scores, the false-positive rate the offset gives on new data from the training
        distribution. In-sample training scores are not used: every training feature
        lies in its own span, so they are ~0 (as ``LocalOutlierFactor`` with
        ``novelty=True``, predicting on the training set is not meaningful).

        With "residual", every training point is scored (all N, not a subset) against
        the N - 1 others by the same all-N formula, through the same factor, as new
        data is against all N: where the span saturates, both are the jitter's
        ``O(rtol)`` leak, and the quantile is the false-positive rate on new data (0.050
        for 0.05 on digits 0-4 with 8 hidden units, 444 pivots of 600 points, where a
        query scored against the pivots alone flagged 0.116).
    max_rank : int, default=None
        Most pivots of the factorisation ("residual" and "alignment"); None: as many as
        ``memory_budget`` allows (and at most N): the ``N x r`` float64 factor in half
        of it (the Gram columns of the pivoting in the other half), and in all of it
        the factor with the leave-one-out pass's two ``r x r`` arrays (``N r + 2 r^2``
        float64, "residual") or with the pivots' Cholesky factor (``N r + r^2``,
        "alignment"). A larger ``max_rank`` is capped at that number too.
        When either bound is reached before the tolerance, a ``ConvergenceWarning`` says so, with
        how far the farthest training feature lies from the span (relative to the
        largest feature norm, in ``rtol``'s units), and the span is that of the ``r``
        most independent training features.
    n_jobs : int, default=None
        Number of joblib workers for scoring (``score_samples``, ``decision_function``,
        ``predict``): the queries are split into one row block per worker and scored
        with ``Parallel(n_jobs)``, on loky processes or, under
        ``joblib.parallel_config(backend="dask")``, on a Dask cluster; each task runs
        torch with ``max(1, cpu_count // n_jobs)`` threads. Scores equal the serial
        ones to round-off (a worker's row blocks are matrix products of other shapes).
        ``None`` means 1 unless in a joblib context; ``-1`` all workers. ``fit`` is
        serial.
    random_state : int, RandomState instance or None, default=None
        Seeds the default trainer (``estimator=None``); a given trainer keeps its own.
        Scoring is deterministic.

    Attributes
    ----------
    task_ : {{"regression", "classification", "reconstruction"}}
        What the network was trained on ("classification" for a
        :class:`RecordedNetwork` declared with ``loss="log_loss"``).
    offset_ : float
        ``decision_function = score_samples - offset_``.
    lambda_ : float
        The jitter ``lam = rtol**2 * max_i Theta(x_i, x_i)``. With "residual", never
        below what the pivots' Cholesky factor ``L`` resolves, ``r eps ||Theta_LL||_2``
        (its backward error, ``eps`` float64's): below that an in-distribution point's
        score, the jitter's leak alone, would be round-off (see Notes).
    rank_ : int
        Rank ``r`` of the factorisation: the number of pivots. Only with
        ``method="residual"`` or ``"alignment"`` ("local" factorises nothing).
    pivots_ : ndarray of shape (`rank_`,)
        Rows of ``X_fit_`` (``train_indices_`` maps them to ``X``) of the pivots, whose
        features span the others to within the tolerance, in the order they were
        chosen. As ``rank_``.{fitted}
    See Also
    --------
    sklearn.ensemble.IsolationForest : The offset convention followed here.
    PathKernelClassifier : A trainer; fitted, in a ``FrozenEstimator``, its network is read.

    Notes
    -----
    ``Theta = Theta(X_fit_, X_fit_)`` is never formed (at N = 20000 it would take
    3.2 GB).

    **Local spans** ("local", "alignment"). A query's row ``Theta(x, X_fit_)`` (row
    blocks in half of ``memory_budget``, the engine's temporaries in what they leave)
    gives its best-aligned training features; the Gram of those neighbours comes from
    the Gram of the union of the neighbours of a group of queries (at most 16
    ``n_neighbors`` points), or from the whole training Gram, computed once, when that
    is cheaper and fits in a quarter of the budget. "local" scores its queries a chunk
    at a time, whose neighbours take a quarter of the budget. Cost: ``O(n N)`` kernel
    entries for ``n`` queries, memory ``O(b N)`` for row blocks of ``b`` queries, and
    the same again for the leave-one-out scores of ``fit``.
    Measured on 2 loaded CPU cores (64-unit tanh network, 1 GiB budget): N = 20000 fits
    in 52 s with a peak of 0.70 GiB above the start of fit, and scores 1857 queries in
    62 s (benchmarks/results/ood.md).

    **Factorisation** ("residual"; also run by "alignment" for ``rank_``). A greedy
    block pivoted Cholesky (Nystrom with adaptively chosen landmarks) computes
    ``Theta[:, B]`` for blocks ``B`` of the 256 points with the largest residual
    diagonal, by the structured Gram engine, and keeps the ``r`` pivots ``L``: the
    Nystrom factor ``G = Theta[:, L] L^{{-T}}`` (N x r, ``L L^T = Theta_LL``,
    ``Theta ~= G G^T`` to within the tolerance on every diagonal entry). The score is
    the formula above with all N points through it: ``k(x) ~= G c`` with ``c =
    L^{{-1}} k_L(x)``, ``k_L(x) = Theta(X_L, x)``, and ``k^T (G G^T + lam I)^{{-1}} k =
    c^T M (M + lam I)^{{-1}} c`` with ``M = G^T G = W S W^T`` (r x r, decomposed at
    fit). With ``y = W^T c`` the posterior variance is ``Theta(x, x) - ||y||^2`` (outside
    the pivots' span) plus ``lam sum_j y_j^2 / (S_j + lam)`` (the jitter's leak inside
    it): ``r`` kernel entries and one ``r x r`` product per query (two triangular solves
    where the leverages' pass left the Cholesky factor of ``M + lam I`` instead of
    ``W``). The first part
    cancels down to ``L``'s backward error, ``r eps ||Theta_LL||_2``; where N points
    cover every parameter direction the leak ``lam`` at ``rtol=1e-6`` lay below it (1e-12
    against 1.35e-11 of the largest diagonal, 3000 points on 449 parameters, whose
    fresh in-distribution scores were 31% round-off), so ``lambda_`` is at least that
    (the pivots are still chosen at ``rtol``). The leave-one-out
    scores of ``offset_`` are the same formula for each training point against the N
    - 1 others, from a thin QR of ``G`` (or, when its second ``N x r`` array does not
    fit in the budget beside the factor, from the leverages ``g_i^T (M + lam I)^{{-1}}
    g_i``). The dense formula (at ``lambda_``) where the pivots span every training
    feature (``r`` the features' rank: measured within 2e-5 of it evaluated from the
    features, and the leave-one-out scores within 1e-8 of refits without each point),
    and otherwise its value with ``Theta`` replaced by the factor, which matches every
    training feature to within ``rtol * max_i ||phi(x_i)||``. Cost: time
    ``O(N r sum_l (d_in + C d_out) + N r b + N r^2 + r^3)``, memory ``O(N r + r^2)``;
    scoring ``O(n r^2)`` besides its ``n r`` kernel entries. At N = 20000 the same
    network's span needs 4226 pivots; the 1 GiB budget holds 3355, and the truncated
    span's AUROCs were within +0.007 / +0.009 of the exact one's (not lower) on the
    benchmark's splits (measured when a query was scored against the pivots alone).

    **Multi-output networks.** Every Gram is the trace kernel: the span of
    ``vec J(x) / sqrt(C)``, in which a point is inside when its whole Jacobian is one
    combination of the training ones. The span of the ``N C`` per-output rows
    ``J_c(x_i)`` is larger; measured on three digits networks it separates 0.01-0.02
    AUROC worse with the global span and equally with local spans, at ``C**2`` times the
    cost, so it is not used.

    **Precision.** Grams come from a float64 copy of the network (same parameter values)
    on its device: float32 rounding would put noise eigenvalues at ~1e-7 of the largest,
    which a rank tolerance cannot see past.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.frozen import FrozenEstimator
    >>> from skpathkernel import OODRankDetector, PathKernelMachine
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(40, 2))
    >>> net = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=20, tol=None, random_state=0)
    >>> det = OODRankDetector(net).fit(X)  # trained to reconstruct X
    >>> det.task_, det.predict(X[:3]).tolist()
    ('reconstruction', [1, 1, 1])
    >>> det.score_samples(X[:3]).shape, bool(det.offset_ <= -0.01)
    ((3,), True)
    >>> frozen = FrozenEstimator(det.estimator_)  # the same network, not retrained
    >>> glob = OODRankDetector(frozen, method="residual").fit(X)
    >>> glob.estimator_ is det.estimator_, glob.rank_ <= 40
    (True, True)
    """

    _parameter_constraints = {
        **NetworkMetaEstimator._parameter_constraints,
        "method": [StrOptions({"local", "residual", "alignment"})],
        "n_neighbors": [count(1)],
        "rtol": [Interval(numbers.Real, 0, 1, closed="neither")],
        "contamination": [StrOptions({"auto"}), Interval(numbers.Real, 0, 0.5, closed="right")],
        "max_rank": [count(1), None],
        "n_jobs": [numbers.Integral, None],
    }

    def __init__(self, estimator=None, *, method="local", n_neighbors=20, rtol=1e-6,
                 contamination="auto", max_rank=None, n_jobs=None, random_state=None):
        self.estimator = estimator
        self.method = method
        self.n_neighbors = n_neighbors
        self.rtol = rtol
        self.contamination = contamination
        self.max_rank = max_rank
        self.n_jobs = n_jobs
        self.random_state = random_state

    # ------------------------------------------------------------------ fitting
    def _default_trainer(self, y):
        if y is None:
            return PathKernelMachine(random_state=self.random_state)
        return trainer_for(y, self.random_state)

    def _fit_network(self, X, y, sample_weight=None, fit_params=None):
        """Fit the trainer (or read a frozen one) with ``sample_weight``:
        ``(span points, task)``. The span's points are ``X_fit_``'s rows of positive
        weight, which ``X_fit_`` then holds alone."""
        reconstruct = y is None
        inner, frozen = self._trainer()
        if reconstruct and not frozen and isinstance(inner, PathKernelClassifier):
            raise ValueError(
                "fit(X) without y trains the network to reconstruct X, which needs a "
                "PathKernelMachine, not a PathKernelClassifier; pass class labels y, or "
                "wrap a fitted classifier in sklearn.frozen.FrozenEstimator to read its "
                "network as it is."
            )
        _, _, frozen, weights = self._fit_trainer(
            X, None if frozen else y, target=flat_targets if reconstruct else None,
            sample_weight=sample_weight, fit_params=fit_params)
        if weights is not None:
            # Those of X_fit_'s rows (early stopping's training part): read from the
            # weights given, which routing may have kept from the trainer.
            weights = weights[self.train_indices_]
        # Each row left out of X_fit_ leaves train_indices_ too: it maps the span's
        # points to X.
        if weights is not None and not np.all(weights > 0):
            # scikit-learn's weight 0: the row is absent. Here a span would otherwise
            # hold it, and score it (and any point near it) as fully normal.
            self._keep_rows(weights > 0)
        # A repeated row adds nothing to the span, but its copy left its leave-one-out
        # score at 0: with every row twice, offset_ sat at round-off and predict flagged
        # all new data (contamination=0.05: 1.000 of held-out digits 0-4), and the copies
        # took half of each local span's n_neighbors.
        distinct = _distinct_rows(self.X_fit_)
        if not np.all(distinct):
            self._keep_rows(distinct)
        if len(self.X_fit_) < 2:
            # Early stopping held out the others: known only now.
            self._too_few_points(len(self.X_fit_))
        task = trained_task(self._network_estimator)
        if task == "regression" and reconstruct and not frozen:
            task = "reconstruction"
        # The span's points: those trained on (not the early-stopping hold-out), or the
        # X given with a frozen trainer.
        return self.X_fit_, task

    def _check_weighted(self, X, y, sample_weight):
        inner, frozen = self._trainer()
        if (y is None and not frozen and inner is not None and inner.module is not None
                and np.issubdtype(X.dtype, np.integer)):
            # With a module, integer X (as the network takes it, after a pipeline's
            # steps) is token ids: reconstructing them regresses category codes as
            # numbers, a task without meaning whose network's span would then define
            # "normal".
            raise ValueError(
                "fit(X) without y trains the network to reconstruct X, but integer X "
                "with a module is token ids, categories that a regression on their codes "
                "does not model: pass targets y for the network to learn, or wrap a fitted "
                "trainer in sklearn.frozen.FrozenEstimator to read its network as it is."
            )
        # Before any training: the span's points are among these rows.
        rows = X if sample_weight is None else X[sample_weight > 0]
        n_points = np.count_nonzero(_distinct_rows(rows))
        if n_points < 2:
            self._too_few_points(n_points)

    def _too_few_points(self, n_points):
        # One point spans one direction: its leave-one-out score, which sets offset_,
        # has no other point to be scored against.
        raise ValueError(
            f"{type(self).__name__} needs at least 2 distinct training points of "
            f"positive weight for its span; got {n_points} (the other rows "
            "repeat them or have sample_weight 0).")

    def _keep_rows(self, mask):
        self.X_fit_, self.train_indices_ = self.X_fit_[mask], self.train_indices_[mask]

    @keep_previous_fit_on_error
    def fit(self, X, y=None, sample_weight=None, **fit_params):
        """Fit the network trainer (unless frozen) and set up the span of phi(X).

        Computes the training features' norms, the factorisation of their span
        ("residual", "alignment") and the leave-one-out scores that set ``offset_``.

        ``sample_weight`` weighs the samples in the trainer's loss (its ``fit``
        receives them, as from :class:`TangentFeatures`), and a sample of weight 0 is
        absent, as in scikit-learn: the span and the leave-one-out scores are those of
        the training points of positive weight, which ``X_fit_`` holds (a zero-weight
        point would otherwise lie in the span and score as fully normal). Positive
        weights weigh neither: a span has no weights (a direction is in it or not), a
        repeated point adds nothing to it, and the leave-one-out scores behind
        ``offset_`` are unweighted quantiles. So a row of ``X`` repeated is one point
        (``X_fit_`` holds its first occurrence; ``train_indices_`` maps ``X_fit_``'s
        rows to ``X``), as a weight of 2 is: its copy would
        otherwise lie in the span of the others, its leave-one-out score 0, and a
        training set of repeated rows (oversampled, or every row twice) would put
        ``offset_`` at round-off, where ``predict`` flags all new data.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Training inputs (with a trainer's ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids); with a ``FrozenEstimator``, the inputs whose
            features define the span (usually its ``X_fit_``), in the form its network
            takes (a pipeline's: as the pipeline takes them, its training ``X``).
        y : array-like of shape (n_samples,) or (n_samples, n_outputs), default=None
            Targets of the task (see ``estimator``); None trains the network to
            reconstruct X. Ignored with a ``FrozenEstimator``.
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of the samples in the trainer's loss (relative, as the trainer
            takes them; see above). Validated before any training; ``None`` or equal
            weights: the trainer's ``fit`` is called without them. With a
            ``FrozenEstimator`` (nothing is trained) only their zeros count: those rows
            of ``X`` are left out of the span. With
            ``sklearn.set_config(enable_metadata_routing=True)`` the trainer receives
            them only where it requested them (``set_fit_request(sample_weight=True)``;
            an error where it did not say), and their zeros leave rows out of the span
            either way.
        **fit_params : dict
            Only with ``sklearn.set_config(enable_metadata_routing=True)``: metadata
            routed to the trainer's ``fit`` (an unfrozen ``Pipeline`` given as
            ``estimator`` routes each of its steps what it requested, as
            ``Pipeline.fit`` does), such as a weight under the alias the trainer
            requested (``set_fit_request(sample_weight="w")``, then ``fit(X, y,
            w=weights)``), as scikit-learn's ``MultiOutputRegressor`` routes them; the
            zeros that leave rows out of the span are ``sample_weight``'s alone. Without
            routing they are refused, as by ``BaggingRegressor``.

        Returns
        -------
        self : OODRankDetector
        """
        validate_params(self)
        if self.rtol < RTOL_RESOLUTION:
            warnings.warn(
                f"rtol={self.rtol:g} is below {RTOL_RESOLUTION:g}, the float64 Gram's "
                "resolution of singular values relative to the largest: the span "
                "(rank_, rank_gap, the pivots) then also counts directions that are "
                "round-off, and the jitter rtol**2 of the largest Gram eigenvalue "
                "regularises nothing. Use rtol >= 1e-7.",
                UserWarning, stacklevel=caller_stacklevel(),
            )
        X, task = self._fit_network(X, y, sample_weight, fit_params)
        return self._fit_span(X, task)

    # A frozen estimator's module left drawing (dropout in training mode) gave every fit
    # its own span and offset_, silently, where the scores warned.
    @_runs_detector_module
    def _fit_span(self, X, task):
        """The span of the training features ``X`` and the scores that set ``offset_``."""
        gram = NetworkGram(self.network_)
        n = X.shape[0]
        # Every method holds blocks of Gram rows (N values each, with their temporaries)
        # against all N points; refuse before any Gram when one does not fit.
        block = min(BLOCK, gram.rows_per_block(n, f"fit ({n} training points)"))
        diag = to_numpy(gram.diag(gram.tensor(X)).to(torch.float64))
        lam = TangentSpan.jitter(diag, self.rtol)
        # The scores are those of this fit's method, whatever set_params says later
        # (offset_ and the factorisation are this method's).
        state = dict(task_=task, lambda_=lam, _train_diag=diag, _method=self.method,
                     _n_neighbors=self.n_neighbors, _rtol=self.rtol)
        if self.method == "local":
            span = TangentSpan(X, diag, lam)
        else:
            if self.method == "residual":
                fits = budget_rank(gram.budget, n)
            else:
                # No leave-one-out arrays: the factor, L and the network's float64
                # copy (12 kB beside a 342 kB budget put the fit at 1.001 times it).
                fits = budget_rank(gram.budget - gram.nbytes, n, loo=False)
            # A max_rank beyond what the budget holds is capped too (honoured, the fit
            # held 1.97 / 1.04 times a 356 kB budget, "residual" / "alignment", at
            # max_rank = N = 150): memory_budget bounds every array of the fit, and the
            # warning below names the bound reached.
            max_rank = min(fits if self.max_rank is None else int(self.max_rank), fits, n)
            # The pivots' Gram columns beside the factor: a quarter of the budget, the
            # engine's temporaries another (factorize); the factor takes half
            # (budget_rank). In all of it, they took 1.7 times an 8 MiB budget with the
            # factor at N = 1000.
            pivot_block = max(1, min(block, gram.budget // 4 // (4 * 8 * n)))
            span, pivots, complete, loo, reached = TangentSpan.factorize(
                gram, X, diag, lam, max_rank, block=pivot_block,
                loo=self.method == "residual",
                score=self.method == "residual")
            if not complete:
                # In rtol's units: the distance of the farthest training feature from the
                # pivots' span, relative to the largest feature norm.
                achieved = math.sqrt(reached / max(float(np.max(diag)), 1e-300))
                bound = (f"max_rank={max_rank}" if self.max_rank is not None
                         and int(self.max_rank) <= fits else
                         f"{max_rank}, the most that memory_budget="
                         f"{gram.budget:,} bytes holds,")
                warnings.warn(
                    f"The factorisation of the training span stopped at {bound} "
                    f"pivots before reaching the rank tolerance rtol={self.rtol:g}: a "
                    f"training feature lies {achieved:.3g} times the largest feature norm "
                    "outside the span of those pivots, and residuals are relative to that "
                    "span. Raise max_rank or memory_budget, or rtol; method='local' needs "
                    "no factorisation.",
                    ConvergenceWarning, stacklevel=caller_stacklevel(),
                )
            state.update(rank_=int(len(pivots)), pivots_=pivots.astype(np.intp),
                         _X_span=span.X_span, _chol=span.chol, _basis=span.basis,
                         _eig=span.eig, _post=span.post)
            if self.method == "residual":
                # The score's jitter: lam, or the pivots' Cholesky resolution if larger.
                state["lambda_"] = span.lam
        if self.method == "residual":
            # Every training point against the N - 1 others, as a query is scored against
            # all N (the same all-N formula, through the same factor): all N come with
            # the factorisation. (Against the pivots alone, a query's residual leaked more
            # than a training point's against all the others, and a float contamination
            # flagged several times its share of new data.)
            scores = -loo
        else:
            # Each training point of an evenly spaced subset scored against all the others,
            # beside the pivots' factor (alignment: r x r float64, within half of the
            # budget at budget_rank's rank) and the fit's vectors over the points, in what
            # they leave: sized from the whole budget, the fit took 1.2 times a 2 MB one
            # (N = 300, r = 259), and from what the factor alone left, 1.035 times a
            # 200 kB one (N = 200, r = 50).
            sub = _loo_subset(n)
            held = 0 if span.chol is None else span.chol.nbytes + 8 * POINT_VECTORS * n
            if held:
                gram = copy.copy(gram)
                gram.budget = gram.budget_for_one(
                    gram.tensor(X[:1]), max(gram.budget - held, gram.budget // 2))
            scores = _scores(self.method, self.n_neighbors, span, gram, X[sub], exclude=sub)
        if self.contamination == "auto":
            offset = _auto_offset(scores, self.method)
        else:
            offset = float(np.percentile(scores, 100.0 * self.contamination))
        state["offset_"] = offset
        if self.method == "local":  # a previous fit's factorisation describes nothing now
            for name in ("rank_", "pivots_", "_X_span", "_chol", "_basis", "_eig",
                         "_post"):
                self.__dict__.pop(name, None)
        for name, value in state.items():
            setattr(self, name, value)
        return self

    def __setstate__(self, state):
        # joblib.load(..., mmap_mode="r") hands back read-only arrays, and the scores pass
        # the fitted span's to torch, which warned that it "does not support non-writable
        # tensors": writable copies, once (small next to the path, which loading copies).
        state = {key: np.array(value) if key in _SPAN_ARRAYS and isinstance(value, np.ndarray)
                 and not value.flags.writeable else value for key, value in state.items()}
        super().__setstate__(state)

    # ------------------------------------------------------------------ scores
    def _span(self) -> TangentSpan:
        return TangentSpan(self.X_fit_, self._train_diag, self.lambda_,
                           getattr(self, "_X_span", None), getattr(self, "_chol", None),
                           getattr(self, "_basis", None), getattr(self, "_eig", None),
                           getattr(self, "_post", None))

    @_runs_detector_module
    def score_samples(self, X):
        """Normality of each sample: higher is more normal.

        "local": ``-s_S(x)``, the residual outside the span of its ``n_neighbors``
        best-aligned training features, and "residual": ``-s(x)``, outside the whole
        training span, both in [-1, 0]; "alignment": ``max_i K_hat(x, x_i)`` in [-1, 1].
        A zero tangent feature (no parameter moves ``f(x)``) lies in every span and
        scores 0 ("local", "residual") or 0 ("alignment": no direction).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Samples in the form the network was fitted on (see ``input_shape_``).

        Returns
        -------
        scores : ndarray of shape (n_samples,)
        """
        X = self._validate_X(X)
        net = self.network_
        n_blocks = n_row_blocks(self.n_jobs, X)
        if n_blocks > 1:
            # Workers get an on-disk trajectory by reference, and loky processes an
            # in-memory one as the name of its shared files (TrainedNetwork.for_workers).
            net = net.for_workers(by_reference=by_reference(n_blocks))
        return np.concatenate(map_row_blocks(_score_rows, X, self.n_jobs, self._method,
                                             self._n_neighbors, self._span(), net))

    def decision_function(self, X):
        """``score_samples(X) - offset_``: negative for outliers.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Samples in the form the network was fitted on (see ``input_shape_``).

        Returns
        -------
        decision : ndarray of shape (n_samples,)
        """
        return self.score_samples(X) - self.offset_

    def predict(self, X):
        """+1 for inliers, -1 for outliers (``decision_function < 0``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Samples in the form the network was fitted on (see ``input_shape_``).

        Returns
        -------
        labels : ndarray of shape (n_samples,)
        """
        return np.where(self.decision_function(X) >= 0, 1, -1)

    # The training features lie in their own span, so labels of the training set itself
    # say nothing (as LocalOutlierFactor(novelty=True), which also hides fit_predict).
    fit_predict = available_if(_no_fit_predict)(OutlierMixin.fit_predict)

    @_runs_detector_module
    def rank_gap(self, X) -> tuple[int, int]:
        """Numerical ranks of the training features and of training + X features.

        ``rank_tau(J)`` counts the singular values of the stacked tangent features above
        ``rtol`` (the fit's, as the span's) times the training features' largest, for
        both ranks, computed from the eigenvalues of the float64 Gram ``J J^T``
        (``numpy.linalg.eigvalsh``; singular values are their square roots). One
        threshold for both: the joint singular values interlace above the training
        ones, so ``rank_joint >= rank_train`` (relative to its own largest, a far query
        raised the joint threshold and hid directions). The joint threshold never falls
        below what its Gram resolves, 1e-7 times its own largest singular value: a query
        whose features exceed the training features' by more than ``rtol / 1e-7``
        raises it all the same, and the gap can then read low, or negative (a ReLU
        network trained on ``[0, 1]``, at the default ``rtol``: -1 for a query at 1e10).
        ``rank_joint > rank_train`` is Guo, He & Morel's sign of extrapolation: some
        ``phi(x)`` leaves the training span. It is that sign only where the training
        features saturate their span (``rank_train < N``, as in the seeds' 1-6-1 ReLU
        network): where every training feature is independent (``rank_train == N``,
        more parameters than training points, as a digits network), held-out points of
        the training distribution add their directions too, and a ``UserWarning``
        says so when a gap is found.

        Holds the ``(N + n)^2`` Gram (N training points, n queries): it must fit in a
        quarter of ``memory_budget`` (about 5000 points in all at the default 1 GiB).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Samples in the form the network was fitted on (see ``input_shape_``).

        Returns
        -------
        rank_train : int
            ``rank_tau(J(X_fit_))``.
        rank_joint : int
            ``rank_tau(J([X_fit_; X]))``.
        """
        X = self._validate_X(X)
        gram = NetworkGram(self.network_)
        n_train = self.X_fit_.shape[0]
        total = n_train + X.shape[0]
        nbytes = 8 * total**2
        if nbytes > gram.budget // 4:
            raise ValueError(
                f"rank_gap needs the {total} x {total} float64 Gram of the training and "
                f"query points, {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB), more than a "
                f"quarter of memory_budget={gram.budget:,} bytes; pass fewer points or "
                f"raise memory_budget to at least {4 * nbytes:,}."
            )
        K = to_numpy(gram.gram(gram.tensor(np.concatenate([self.X_fit_, X]))).to(torch.float64))
        rank_train, rank_joint = TangentSpan.rank_gap(K, n_train, self._rtol)
        if rank_train == n_train and rank_joint > rank_train:
            # Every training feature independent: nothing saturates the span, so a new
            # point of the training distribution adds its direction as an outlier does.
            warnings.warn(
                f"The {n_train} training features are linearly independent (rank_train "
                f"= N = {n_train}): the span is not saturated, so any new point, of the "
                "training distribution or not, can add a direction, and the gap does not "
                "tell them apart here. Compare with the gap of held-out in-distribution "
                "points, or rank queries by score_samples.",
                UserWarning, stacklevel=caller_stacklevel(),
            )
        return rank_train, rank_joint


def _scores(method, n_neighbors, span, gram, X, exclude=None):
    """score_samples of ``X`` (higher = more normal); ``exclude``: leave-one-out."""
    if method == "local":
        return -span.local_residuals(gram, X, n_neighbors, exclude=exclude)
    if method == "alignment":
        return span.alignment(gram, X, exclude=exclude)
    return -span.residuals(gram, X)


def _score_rows(X, method, n_neighbors, span, net):
    # One joblib task: score_samples of a row block (or of all of X when serial).
    return _scores(method, n_neighbors, span, NetworkGram(net), X)


OODRankDetector.__doc__ = OODRankDetector.__doc__.format(estimator=ESTIMATOR_DOC,
                                                          fitted=FITTED_DOC)
