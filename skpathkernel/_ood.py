"""OODRankDetector: flag inputs whose tangent feature leaves the span of the training ones.

A trained network extrapolates badly where its tangent feature ``phi(x)`` has a component
outside ``span{phi(x_i)}`` (seed figures 7-8: a ReLU unit never active on the training
domain turns on at test time). The detector scores that component from tangent-kernel Gram
matrices alone (the Jacobian is never formed):

* ``method="residual"``: the relative residual
  ``s(x)^2 = 1 - k(x)^T (Theta + lam I)^{-1} k(x) / Theta(x, x)``, the noise-free Gaussian
  process posterior variance under the tangent kernel, normalised;
* ``method="alignment"``: ``max_i K_hat(x, x_i)``, the best cosine between ``phi(x)`` and a
  stored training feature (the seeds' "feature memory" view).

Scale: the ``N x N`` training Gram is never held. A greedy block pivoted Cholesky picks the
training points whose features span all the others to within the rank tolerance (columns
of the Gram are computed a block at a time, the ``N x r`` factor is the only large array),
so scoring a query costs one ``1 x r`` Gram row.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings

import numpy as np
import torch
from sklearn.base import OutlierMixin
from sklearn.utils._param_validation import HasMethods, Interval, StrOptions
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import check_is_fitted

from ._base import (
    FIT_CHECKS,
    BasePathKernelNetwork,
    _normalize_rows,
    check_representable,
    keep_previous_fit_on_error,
    rows_per_block,
)
from ._device import fitted_dtype, resolve_dtype, to_input_tensor, to_numpy
from ._inputs import FEATURES, TOKENS, fitted_input, validate_input
from ._machine import (
    _FITTED_ATTRS_DOC,
    _NORMALIZE_Y_DOC,
    _SHARED_PARAMS_DOC,
    PathKernelClassifier,
    PathKernelMachine,
)
from ._parallel import map_row_blocks
from ._tangent import tangent_gram, tangent_gram_diag

__all__ = ["OODRankDetector"]

_NETWORK_PARAMS = (
    "hidden_layer_sizes", "activation", "module", "solver", "learning_rate_init", "momentum",
    "alpha", "beta_1", "beta_2", "epsilon", "batch_size", "max_iter", "tol",
    "n_iter_no_change", "early_stopping", "validation_fraction", "shuffle",
    "record_every", "device", "dtype", "memory_budget", "trajectory_storage",
    "trajectory_dir", "trajectory_compression", "random_state", "verbose",
)
# Fitted attributes of the network that the detector exposes as its own.
_MIRRORED = ("module_", "trajectory_", "loss_curve_", "best_loss_", "validation_scores_",
             "best_validation_score_", "n_iter_", "t_", "n_params_", "n_outputs_", "device_")
# contamination="auto": a point is an outlier when more than half of the norm of phi(x)
# lies outside the training span (residual), or equivalently outside the direction of its
# best-aligned training feature (alignment: sqrt(1 - a^2) > 1/2 <=> a < sqrt(3)/2).
_AUTO_OFFSET = {"residual": -0.5, "alignment": math.sqrt(3.0) / 2.0}
_BLOCK = 256  # pivots per Gram pass of the pivoted Cholesky


class _Gram64:
    """Tangent-kernel Grams (trace over outputs) of a fitted network, in float64.

    A float64 copy of the network at its final recorded parameters: the rank tolerance
    speaks of singular values down to ``rtol`` times the largest, below what a float32
    Gram resolves (its eigenvalues carry errors of ~1e-7 of the largest), so the detector
    works in float64 whatever the training dtype.
    """

    def __init__(self, est):
        self.device = torch.device(est.device_)
        self.module = copy.deepcopy(est.module_).to(dtype=torch.float64)
        traj = est.trajectory_
        flat = traj.parameters(-1).to(device=self.device, dtype=torch.float64)
        self.params = dict(traj.unflatten(flat))
        self.budget = int(est.memory_budget)

    def tensor(self, X) -> torch.Tensor:
        # Token ids stay int64; float inputs follow the float64 copy of the network.
        return to_input_tensor(np.asarray(X), dtype=torch.float64, device=self.device)

    def gram(self, X, Y=None) -> torch.Tensor:
        return tangent_gram(self.module, self.params, X, Y, memory_budget=self.budget)

    def diag(self, X) -> torch.Tensor:
        return tangent_gram_diag(self.module, self.params, X, memory_budget=self.budget)

    def rows_per_block(self, n_cols: int, what: str) -> int:
        # A block of Gram rows against n_cols columns, plus its temporaries.
        return rows_per_block(self.budget, 4 * 8 * max(n_cols, 1), what)


def _lazy_pages(device: torch.device) -> bool:
    """Whether an untouched allocation costs no resident memory (the CPU's virtual memory)."""
    return device.type == "cpu"


def _pivoted_cholesky(column, diag, tol, max_rank, block=_BLOCK):
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


def _loo_relative_residuals(G, diag, lam):
    """Leave-one-out relative residuals of the training features, from ``Theta ~= G G^T``.

    The posterior variance of point ``i`` given all the others under ``G G^T + lam I`` is
    ``1 / [(G G^T + lam I)^{-1}]_ii - lam``. With the thin QR ``G = Q R`` and
    ``R R^T = V S V^T``, ``U = Q V`` is orthonormal to machine precision and
    ``[(G G^T + lam I)^{-1}]_ii = sum_j U_ij^2 / (S_j + lam) + (1 - ||U_i||^2) / lam``.
    """
    if G.shape[1] == 0:
        return torch.ones_like(diag)
    Q, R = torch.linalg.qr(G)
    S, V = torch.linalg.eigh(R @ R.T)
    weight = 1.0 / (S.clamp(min=0) + lam)
    inv_diag = torch.empty_like(diag)
    # Row blocks: U = Q V and the squares are N x r each, as large as G itself.
    step = max(1, 2**22 // max(G.shape[1], 1))
    for start in range(0, G.shape[0], step):
        Qb = Q[start : start + step]
        U = Qb @ V
        inv_diag[start : start + step] = ((U * U * weight).sum(1)
                                          + (1.0 - (Qb * Qb).sum(1)).clamp(min=0) / lam)
    var = (1.0 / inv_diag - lam).clamp(min=0)
    return _relative(var, diag)


def _row_norms2(G):
    # Not (G * G).sum(1): that is an N x r temporary, the size of G itself.
    return torch.linalg.vector_norm(G, dim=1).square()


def _relative(var, diag):
    # A zero tangent feature lies in every span: its relative residual is 0.
    safe = torch.where(diag > 0, diag, torch.ones_like(diag))
    return torch.where(diag > 0, (var / safe).clamp(0, 1), torch.zeros_like(var)).sqrt()


def _unwrap(estimator):
    # FrozenEstimator keeps a prefitted network across clone(); read the network inside.
    inner = getattr(estimator, "estimator", None)
    if type(estimator).__name__ == "FrozenEstimator" and inner is not None:
        return inner
    return estimator


def _never(self):
    return False


class OODRankDetector(OutlierMixin, BasePathKernelNetwork):
    """Out-of-distribution detector: the part of phi(x) outside span{{phi(x_i)}}.

    Trains a network (or takes a prefitted one) and flags inputs whose tangent feature
    ``phi(x) = d f(x; theta_T) / d theta`` is not explained by the training features: the
    rank gap of seed figures 7-8, scored per point from tangent-kernel Gram matrices
    alone (the Jacobian is never formed).

    Parameters
    ----------{shared}
    loss : {{"auto", "squared_error", "log_loss"}}, default="auto"
        "auto": "log_loss" for classification, "squared_error" otherwise (see ``task``).
    estimator : PathKernelMachine or PathKernelClassifier, default=None
        A fitted network to use instead of training one: ``fit(X)`` then only computes
        the factorisation of the span of ``phi(X)`` (pass ``estimator.X_fit_`` for the
        training span); the estimator is never retrained and ``y`` is ignored. The
        network parameters above are then unused. ``clone`` (and so ``GridSearchCV``)
        would return an unfitted copy of it: wrap it in
        :class:`sklearn.frozen.FrozenEstimator` to keep it fitted.
    task : {{"auto", "regression", "classification"}}, default="auto"
        What ``fit(X, y)`` trains on. "auto": classification when
        :func:`~sklearn.utils.multiclass.type_of_target` is "binary" or "multiclass" (note
        that integer-valued regression targets count as "multiclass"), regression
        otherwise. Without ``y`` the network is trained self-supervised, to reconstruct
        its input (``n_features_in_`` outputs, squared error on ``X`` itself).
    method : {{"residual", "alignment"}}, default="residual"
        "residual": ``score_samples(x) = -s(x)`` with the relative residual
        ``s(x)^2 = 1 - k(x)^T (Theta + lam I)^{{-1}} k(x) / Theta(x, x)``, where
        ``Theta`` is the tangent Gram (trace over outputs) at the final parameters,
        ``k(x) = Theta(X_span, x)``; ``s`` lies in [0, 1]: 0 inside the span, 1
        orthogonal to it. "alignment": ``score_samples(x) = max_i K_hat(x, x_i)`` over
        the training points, the normalised tangent kernel (cosine of the features).
    rtol : float, default=1e-6
        Rank tolerance, relative to singular values: a direction counts when its singular
        value exceeds ``rtol`` times the largest, i.e. its Gram eigenvalue exceeds
        ``rtol**2`` times the largest (singular values are square roots of Gram
        eigenvalues). The jitter is ``lam = rtol**2 * max_i Theta(x_i, x_i)``, and the
        factorisation keeps pivots until every training feature is within
        ``sqrt(lam) = rtol * max_i ||phi(x_i)||`` of their span. Grams are computed in
        float64 (see Notes), so one default serves float32 and float64 networks; below
        ~1e-7 the tolerance reaches float64's round-off on Gram eigenvalues.
    contamination : "auto" or float in (0, 0.5], default="auto"
        Sets ``offset_`` (IsolationForest's convention). "auto": a fixed offset, -0.5 for
        "residual" (an outlier has more than half of ``||phi(x)||`` outside the training
        span) and ``sqrt(3)/2`` for "alignment" (the same statement for the best-aligned
        training feature alone). A float: the ``contamination`` quantile of the
        *leave-one-out* training scores (each training point scored against the span of
        all the others), the false-positive rate this offset gives on new data from the
        training distribution. In-sample training scores are not used: every training
        feature lies in its own span, so they are ~0 (as ``LocalOutlierFactor`` with
        ``novelty=True``, predicting on the training set is not meaningful).
    max_rank : int, default=None
        Most pivots of the factorisation; None: as many as the ``N x r`` float64 factor
        allows in half of ``memory_budget`` (and at most N). When it is reached before
        the tolerance, a warning says so and the span is that of the ``r`` most
        independent training features.
    n_jobs : int, default=None
        Number of joblib workers for scoring (``score_samples``, ``decision_function``,
        ``predict``): the queries are split into one row block per worker and scored
        with ``Parallel(n_jobs)``, on loky processes or, under
        ``joblib.parallel_config(backend="dask")``, on a Dask cluster; each task runs
        torch with ``max(1, cpu_count // n_jobs)`` threads. Scores equal the serial ones.
        ``None`` means 1 unless in a joblib context; ``-1`` all workers. ``fit`` is
        serial.{normalize_y}

    Attributes
    ----------
    estimator_ : PathKernelMachine or PathKernelClassifier
        The fitted network (the given ``estimator`` itself when prefitted).
    task_ : {{"regression", "classification", "reconstruction"}}
        What the network was trained on.
    offset_ : float
        ``decision_function = score_samples - offset_``.
    lambda_ : float
        The jitter ``lam``.
    rank_ : int
        Rank ``r`` of the factorisation: the number of pivots.
    pivots_ : ndarray of shape (`rank_`,)
        Indices into ``X_fit_`` of the pivots, whose features span the others to within
        the tolerance, in the order they were chosen.{fitted}
    See Also
    --------
    sklearn.ensemble.IsolationForest : The offset convention followed here.
    PathKernelClassifier : The network a prefitted detector can wrap.

    Notes
    -----
    **Factorisation.** ``Theta = Theta(X_fit_, X_fit_)`` is never formed (at N = 20000 it
    would take 3.2 GB). A greedy block pivoted Cholesky (Nystrom with adaptively chosen
    landmarks) computes ``Theta[:, B]`` for blocks ``B`` of the 256 points with the largest
    residual diagonal, by the structured Gram engine, and keeps the ``r`` pivots ``L``.
    The score uses ``Theta_LL`` (r x r, Cholesky of ``Theta_LL + lam I``) and
    ``k(x) = Theta(X_L, x)``: identical to the formula above with all N points when
    ``r = N`` (full numerical rank), and otherwise the span of features that contains
    every training feature to within ``rtol * max_i ||phi(x_i)||``. Cost: time
    ``O(N r sum_l (d_in + C d_out) + N r b)``, memory ``O(N r)``; scoring ``O(n r)``.
    Measured on 2 CPU cores (64-64-10 tanh network, 1 GiB budget): N = 2000, r = 2000 in
    0.7 s; N = 5000, r = 4225 in 4 s; N = 20000 stops at max_rank = 3355 in 9 s, its peak
    0.8 GiB above the start of fit (benchmarks/results_ood.md).

    **Precision.** Grams come from a float64 copy of the network (same parameter values)
    on its device: float32 rounding would put noise eigenvalues at ~1e-7 of the largest,
    which a rank tolerance cannot see past.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import OODRankDetector
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(40, 2))
    >>> det = OODRankDetector(hidden_layer_sizes=(8,), max_iter=20, random_state=0).fit(X)
    >>> det.predict(X[:3]).tolist()
    [1, 1, 1]
    >>> det.score_samples(X[:3]).shape, det.rank_ <= 40
    ((3,), True)
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "loss": [StrOptions({"auto", "squared_error", "log_loss"})],
        "estimator": [HasMethods(["fit"]), None],
        "task": [StrOptions({"auto", "regression", "classification"})],
        "method": [StrOptions({"residual", "alignment"})],
        "rtol": [Interval(numbers.Real, 0, 1, closed="neither")],
        "contamination": [StrOptions({"auto"}), Interval(numbers.Real, 0, 0.5, closed="right")],
        "max_rank": [Interval(numbers.Integral, 1, None, closed="left"), None],
        "n_jobs": [numbers.Integral, None],
        "normalize_y": ["boolean"],
    }

    def __init__(
        self,
        hidden_layer_sizes=(64, 64),
        *,
        activation="gelu",
        module=None,
        solver="adam",
        learning_rate_init=1e-3,
        momentum=0.0,
        alpha=0.0,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        batch_size="auto",
        max_iter=200,
        tol=1e-4,
        n_iter_no_change=10,
        early_stopping=False,
        validation_fraction=0.1,
        shuffle=True,
        loss="auto",
        record_every="auto",
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        trajectory_storage="memory",
        trajectory_dir=None,
        trajectory_compression=None,
        random_state=None,
        verbose=0,
        estimator=None,
        task="auto",
        method="residual",
        rtol=1e-6,
        contamination="auto",
        max_rank=None,
        n_jobs=None,
        normalize_y=True,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init, momentum=momentum,
            alpha=alpha, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, tol=tol,
            n_iter_no_change=n_iter_no_change, early_stopping=early_stopping,
            validation_fraction=validation_fraction, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, trajectory_storage=trajectory_storage,
            trajectory_dir=trajectory_dir, trajectory_compression=trajectory_compression,
            random_state=random_state, verbose=verbose,
        )
        self.estimator = estimator
        self.task = task
        self.method = method
        self.rtol = rtol
        self.contamination = contamination
        self.max_rank = max_rank
        self.n_jobs = n_jobs
        self.normalize_y = normalize_y

    def _encode_targets(self, y):
        # Training is delegated to a PathKernelMachine / PathKernelClassifier (_train).
        raise NotImplementedError

    # ------------------------------------------------------------------ fitting
    def _train(self, X, y):
        net = {name: getattr(self, name) for name in _NETWORK_PARAMS}
        if y is None:
            if self.loss == "log_loss":
                raise ValueError("loss='log_loss' needs class labels y; got y=None.")
            X = self._validate_fit_data(X)
            est = PathKernelMachine(**net, loss="squared_error", normalize_y=self.normalize_y)
            # Every value of a sample is a target (its flat view for (n, ...) inputs).
            return est.fit(X, X.reshape(len(X), -1).astype(np.float64)), "reconstruction"
        X, y = self._validate_fit_data(X, y, multi_output=True)
        task = self.task
        if task == "auto":
            kind = type_of_target(y, input_name="y")
            task = "classification" if kind in ("binary", "multiclass") else "regression"
        if task == "classification":
            loss = "log_loss" if self.loss == "auto" else self.loss
            return PathKernelClassifier(**net, loss=loss).fit(X, y), task
        if self.loss == "log_loss":
            raise ValueError("loss='log_loss' is for classification; this task is regression.")
        return PathKernelMachine(**net, loss="squared_error",
                                 normalize_y=self.normalize_y).fit(X, y), task

    def _prefitted(self, X):
        est = _unwrap(self.estimator)
        if not isinstance(est, BasePathKernelNetwork):
            raise TypeError(
                "estimator must be a fitted PathKernelMachine or PathKernelClassifier "
                f"(optionally in a FrozenEstimator), got {type(est).__name__}."
            )
        check_is_fitted(est, "trajectory_")
        shape, kind = fitted_input(est)
        X = validate_input(self, X, reset=True, flexible=kind != FEATURES,
                           ensure_min_samples=FIT_CHECKS["ensure_min_samples"])
        check_representable(X, resolve_dtype(est.dtype))
        if kind == FEATURES and X.shape[1] != est.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features, but the estimator's network is expecting "
                f"{est.n_features_in_} features as input."
            )
        if (self.input_shape_, self._input_kind) != (shape, kind):
            raise ValueError(
                f"X has shape {X.shape} and dtype {X.dtype}, but the estimator's network "
                f"takes {'integer token ids' if kind == TOKENS else 'float X'} of shape "
                f"(n_samples, {', '.join(map(str, shape))})."
            )
        task = "classification" if isinstance(est, PathKernelClassifier) else "regression"
        return X, est, task

    @keep_previous_fit_on_error
    def fit(self, X, y=None):
        """Train the network (unless prefitted) and factorise the span of phi(X).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            Training inputs (with ``module``, any ``(n_samples, ...)`` array: floats, or
            integer token ids); with ``estimator``, the inputs whose features define the
            span (usually ``estimator.X_fit_``), in the form its network takes.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs), default=None
            Targets of the task (see ``task``); None trains the network to reconstruct X.
            Ignored with ``estimator``.

        Returns
        -------
        self : OODRankDetector
        """
        self._validate_params()
        if self.estimator is None:
            est, task = self._train(X, y)
            X = est.X_fit_
        else:
            X, est, task = self._prefitted(X)
        gram = _Gram64(est)
        n = X.shape[0]
        # A pass of the factorisation holds Gram columns (N values each, with their
        # temporaries) against all N points; refuse before any Gram when one does not fit.
        block = min(_BLOCK, gram.rows_per_block(n, f"fit ({n} training points)"))
        Xt = gram.tensor(X)
        diag = gram.diag(Xt).to(torch.float64)
        lam = float(self.rtol) ** 2 * float(diag.max())
        max_rank = self.max_rank
        if max_rank is None:
            max_rank = max(1, gram.budget // (2 * 8 * n))
        max_rank = min(int(max_rank), n)
        if float(diag.max()) > 0:
            G, pivots = _pivoted_cholesky(lambda idx: gram.gram(Xt, Xt[idx]), diag,
                                          max(lam, 0.0), max_rank, block=block)
        else:  # every feature is zero (a dead network): the span is {0}
            G, pivots = diag.new_zeros((n, 0)), torch.zeros(0, dtype=torch.long)
        if len(pivots) == max_rank < n and float((diag - _row_norms2(G)).max()) > lam:
            warnings.warn(
                f"The factorisation of the training span stopped at max_rank={max_rank} "
                "pivots before reaching the rank tolerance; residuals are relative to the "
                "span of those pivots. Raise max_rank or memory_budget, or rtol.",
                UserWarning, stacklevel=2,
            )
        X_span = X[to_numpy(pivots)]
        loo = None
        if self.contamination != "auto" and self.method == "residual":
            loo = -to_numpy(_loo_relative_residuals(G, diag, max(lam, 1e-300)))
        # The N x r factor is half the budget: freed before the r x r Gram of the span.
        del G
        chol = None
        if len(pivots):
            W = gram.gram(gram.tensor(X_span)).to(torch.float64)
            W.diagonal().add_(lam)
            chol = to_numpy(torch.linalg.cholesky(W))
            del W
        state = dict(estimator_=est, task_=task, lambda_=lam, rank_=int(len(pivots)),
                     pivots_=to_numpy(pivots).astype(np.intp), X_fit_=X, _X_span=X_span,
                     _chol=chol, _train_diag=to_numpy(diag))
        state.update({name: getattr(est, name) for name in _MIRRORED})
        if self.contamination == "auto":
            offset = _AUTO_OFFSET[self.method]
        else:
            if loo is None:
                loo = self._alignment(gram, X, X, to_numpy(diag), exclude_self=True)
            offset = float(np.percentile(loo, 100.0 * self.contamination))
        state["offset_"] = offset
        for name, value in state.items():
            setattr(self, name, value)
        return self

    # ------------------------------------------------------------------ scores
    def _relative_residuals(self, gram, X) -> np.ndarray:
        Xt = gram.tensor(X)
        diag = gram.diag(Xt).to(torch.float64)
        if self.rank_ == 0:
            return to_numpy(_relative(diag, diag))
        span = gram.tensor(self._X_span)
        chol = torch.as_tensor(self._chol, device=gram.device)
        explained = torch.empty_like(diag)
        step = gram.rows_per_block(self.rank_, "score_samples")
        for start in range(0, X.shape[0], step):
            K = gram.gram(span, Xt[start : start + step]).to(torch.float64)  # (r, b)
            q = torch.linalg.solve_triangular(chol, K, upper=False)
            explained[start : start + step] = (q * q).sum(0)
        return to_numpy(_relative(diag - explained, diag))

    def _alignment(self, gram, X, X_ref, ref_diag, *, exclude_self=False) -> np.ndarray:
        Xt, Rt = gram.tensor(X), gram.tensor(X_ref)
        dx = to_numpy(gram.diag(Xt).to(torch.float64))
        dr = np.asarray(ref_diag)
        out = np.empty(X.shape[0])
        step = gram.rows_per_block(X_ref.shape[0], "The alignment score")
        for start in range(0, X.shape[0], step):
            stop = min(start + step, X.shape[0])
            K = to_numpy(gram.gram(Xt[start:stop], Rt).to(torch.float64))
            K = _normalize_rows(K, dx[start:stop], dr)
            if exclude_self:
                K[np.arange(stop - start), np.arange(start, stop)] = -np.inf
            out[start:stop] = K.max(axis=1)
        return out

    def score_samples(self, X):
        """Normality of each sample: higher is more normal.

        "residual": ``-s(x)`` in [-1, 0]; "alignment": ``max_i K_hat(x, x_i)`` in
        [-1, 1]. A zero tangent feature (no parameter moves ``f(x)``) lies in every span
        and scores 0 (residual) or 0 (alignment, no direction).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)

        Returns
        -------
        scores : ndarray of shape (n_samples,)
        """
        X = self._validate_X(X)
        return np.concatenate(map_row_blocks(_score_rows, X, self.n_jobs, self))

    def decision_function(self, X):
        """``score_samples(X) - offset_``: negative for outliers.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)

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

        Returns
        -------
        labels : ndarray of shape (n_samples,)
        """
        return np.where(self.decision_function(X) >= 0, 1, -1)

    # The training features lie in their own span, so labels of the training set itself
    # say nothing (as LocalOutlierFactor(novelty=True), which also hides fit_predict).
    fit_predict = available_if(_never)(OutlierMixin.fit_predict)

    def rank_gap(self, X) -> tuple[int, int]:
        """Numerical ranks of the training features and of training + X features.

        ``rank_tau(J)`` counts the singular values of the stacked tangent features above
        ``rtol`` times the largest, computed as the eigenvalues of the float64 Gram
        ``J J^T`` (``numpy.linalg.eigvalsh``) above ``rtol**2`` times the largest
        (singular values are their square roots). ``rank_joint > rank_train`` is the
        seeds' sign of extrapolation: some ``phi(x)`` leaves the training span.

        Holds the ``(N + n)^2`` Gram (N training points, n queries): it must fit in a
        quarter of ``memory_budget`` (about 5000 points in all at the default 1 GiB).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)

        Returns
        -------
        rank_train : int
            ``rank_tau(J(X_fit_))``.
        rank_joint : int
            ``rank_tau(J([X_fit_; X]))``.
        """
        X = self._validate_X(X)
        gram = _Gram64(self.estimator_)
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
        return _numerical_rank(K[:n_train, :n_train], self.rtol), _numerical_rank(K, self.rtol)

    # ------------------------------------------------------------------ network views
    def _torch_dtype_device(self):
        # A prefitted network keeps its own dtype, whatever this detector's dtype says.
        return resolve_dtype(fitted_dtype(self.estimator_)), torch.device(self.estimator_.device_)

    @property
    def tangent_kernel_(self):
        """:class:`~skpathkernel.kernels.TangentKernel` of the network at its final step."""
        from .kernels import TangentKernel

        check_is_fitted(self)
        return TangentKernel(self.estimator_)

    @property
    def path_kernel_(self):
        """:class:`~skpathkernel.kernels.PathKernel` of the network's recorded path."""
        from .kernels import PathKernel

        check_is_fitted(self)
        return PathKernel(self.estimator_)

    def kneighbors(self, X, n_neighbors=100, *, kernel="tangent", step=-1, normalized=True,
                   return_distance=True):
        """Points of ``X_fit_`` nearest to each query under the network's kernel.

        See :meth:`PathKernelMachine.kneighbors`; the neighbours are taken among the
        detector's ``X_fit_`` (the span's points, also with a prefitted ``estimator``).
        """
        # Validated here, so that errors name this detector and its feature names.
        X = self._validate_X(X)
        view = copy.copy(self.estimator_)
        view.X_fit_ = self.X_fit_
        view.__dict__.pop("feature_names_in_", None)
        return view.kneighbors(X, n_neighbors, kernel=kernel, step=step,
                               normalized=normalized, return_distance=return_distance)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        # module_ mirrors estimator_.module_, which pickles itself (as NumPy arrays); the
        # base class would store it a second time without the spec that rebuilds it.
        state = dict(super(BasePathKernelNetwork, self).__getstate__())
        state.pop("module_", None)
        return state

    def __setstate__(self, state):
        super(BasePathKernelNetwork, self).__setstate__(dict(state))
        est = self.__dict__.get("estimator_")
        if est is not None:
            # The same objects as the network's own, and its device after loading (the
            # CPU when CUDA is missing here).
            self.module_, self.device_ = est.module_, est.device_

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        return tags


def _score_rows(X, detector):
    # One joblib task: score_samples of a row block (or of all of X when serial).
    gram = _Gram64(detector.estimator_)
    if detector.method == "residual":
        return -detector._relative_residuals(gram, X)
    return detector._alignment(gram, X, detector.X_fit_, detector._train_diag)


def _numerical_rank(K: np.ndarray, rtol: float) -> int:
    ev = np.linalg.eigvalsh(K)
    top = ev.max(initial=0.0)
    return int(np.sum(ev > rtol**2 * top)) if top > 0 else 0


OODRankDetector.__doc__ = OODRankDetector.__doc__.format(
    shared=_SHARED_PARAMS_DOC, fitted=_FITTED_ATTRS_DOC, normalize_y=_NORMALIZE_Y_DOC
)
