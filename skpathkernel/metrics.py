"""How well training-data attributions predict retraining: the linear datamodeling score.

The linear datamodeling score (LDS; Park et al. 2023, "TRAK: Attributing Model Behavior at
Scale", section 2.2) is the field's standard measure of an attribution method. Draw
``n_subsets`` random subsets ``S_j`` of the training set (each a fraction ``alpha``, 0.5
by default), retrain the model on each, and record its output ``f(x; S_j)`` at every query
``x`` (for classifiers, the margin ``log(p_y / (1 - p_y))`` of the query's label). An
attribution matrix ``tau`` (queries x training points) predicts that output by the sum of
the scores of the points the subset holds, ``g(x; S_j) = sum_{i in S_j} tau(x)_i``. The LDS
of a query is the Spearman rank correlation, over the subsets, between ``g(x; S_j)`` and
``f(x; S_j)``; the LDS of the method is its mean over the queries. 1 means the
attributions order the retrained models' outputs perfectly; 0, not at all.

:func:`retrain_on_subsets` runs the retraining for any scikit-learn estimator (``clone``
and ``fit`` on each subset, in parallel with joblib), :func:`linear_datamodeling_score`
computes the score from any attribution matrix, and :func:`linear_datamodeling_interval`
gives its bootstrap confidence interval over the subset draws. The attributions of a
fitted :class:`~skpathkernel.PathKernelClassifier` or
:class:`~skpathkernel.PathKernelMachine` come from its ``attribute`` method;
:func:`ensemble_attribution` averages them over several independently seeded fits
(TRAK's ensembling).
"""

from __future__ import annotations

import copy
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from joblib import Parallel, cpu_count, delayed, effective_n_jobs
from scipy.stats import rankdata
from sklearn.base import clone, is_classifier
from sklearn.pipeline import Pipeline
from sklearn.utils import check_array, check_random_state
from sklearn.utils._param_validation import HasMethods, Interval, StrOptions, validate_params

from ._analysis._attribution import check_indicator, label_codes, margin
from ._analysis._unrolled import AttributionScores
from ._estimators._base import BasePathKernelNetwork, _encode_like_fit
from ._estimators._meta import NetworkMetaEstimator
from ._modules import copy_module
from ._network._trained import _followed, network_of, pipeline_last_step, with_last_step
from ._parallel import limit_torch_threads
from ._path._recorder import RecordedNetwork
from ._path._training import (
    batch_betas,
    make_optimizer,
    set_learning_rate,
    training_step,
    trains_without_cudnn,
)
from ._progress import Progress
from ._validation import count
from ._warnings import caller_stacklevel, worst

__all__ = [
    "SubsetRetraining",
    "ensemble_attribution",
    "linear_datamodeling_interval",
    "linear_datamodeling_score",
    "retrain_on_subsets",
]


# --------------------------------------------------------------------------- the score
def _check_lds_inputs(attributions, subsets, outputs):
    """(masks (m, N) float, attributions (Q, N), outputs (m, Q)), checked against each other."""
    attributions = check_array(attributions, dtype=np.float64, input_name="attributions")
    n_queries, n_train = attributions.shape
    try:
        subsets = np.asarray(subsets)
    except ValueError:
        masks = _ragged_masks(subsets, n_train).astype(np.float64)
        return _checked_outputs(masks, attributions, outputs)
    if subsets.ndim != 2:
        raise ValueError("subsets must be 2-D: boolean masks (n_subsets, n_train) or "
                         f"training indices (n_subsets, subset_size), got shape "
                         f"{subsets.shape}.")
    masks = _stacked_masks(subsets, n_train, f"attributions score {n_train}")
    return _checked_outputs(masks.astype(np.float64), attributions, outputs)


def _stacked_masks(subsets: np.ndarray, n_train: int, against: str) -> np.ndarray:
    """Boolean masks (m, n_train) of 2-D ``subsets``, masks or index rows of one size
    (checked); ``against`` ends the message of masks of another width. The score and
    :func:`retrain_on_subsets` take the same subsets."""
    if subsets.dtype == bool:
        if subsets.shape[1] != n_train:
            raise ValueError(f"subsets are masks over {subsets.shape[1]} training points, "
                             f"but {against}.")
        return subsets
    if np.issubdtype(subsets.dtype, np.integer):
        _check_indices(subsets, n_train)
        masks = np.zeros((len(subsets), n_train), dtype=bool)
        np.put_along_axis(masks, subsets, True, axis=1)
        return masks
    raise TypeError(f"subsets must be boolean masks or integer indices, got dtype "
                    f"{subsets.dtype}.")


def _ragged_masks(subsets, n_train: int) -> np.ndarray:
    """Boolean masks (m, n_train) of index rows of different sizes (Bernoulli draws, a
    user's own lists, all points and all but a few), which NumPy cannot stack; each row
    is checked as a stacked one."""
    rows = [np.asarray(row) for row in subsets]
    for j, row in enumerate(rows):
        if row.ndim != 1 or not (row.size == 0 or np.issubdtype(row.dtype, np.integer)):
            raise TypeError(
                f"subsets of different sizes must each be a 1-D array of training "
                f"indices; subset {j} has shape {row.shape} and dtype {row.dtype}.") from None
    masks = np.zeros((len(rows), n_train), dtype=bool)
    for j, row in enumerate(rows):
        _check_indices(row[None], n_train, first=j)
        # An empty list is a float array, which NumPy refuses as indices.
        masks[j, row.astype(np.intp)] = True
    return masks


def _check_indices(subsets: np.ndarray, n_train: int, first: int = 0) -> None:
    """Refuse index rows ``(m, size)`` outside ``[0, n_train)`` or repeating an index;
    ``first`` numbers the first row in the messages."""
    if subsets.size and (subsets.min() < 0 or subsets.max() >= n_train):
        raise ValueError(f"subsets hold training indices outside [0, {n_train}).")
    # A subset holds each point once: a repeated index is not a subset, and is what
    # 0/1 masks stored as integers look like (rows of 0s and 1s, read as indices).
    repeated = np.flatnonzero((np.diff(np.sort(subsets, axis=1), axis=1) == 0).any(axis=1))
    if len(repeated):
        raise ValueError(
            f"subsets given as training indices repeat an index (subset "
            f"{first + repeated[0]}: each point is in a subset once). 0/1 masks must be "
            "boolean: pass subsets.astype(bool).")


def _checked_outputs(masks, attributions, outputs):
    """``outputs`` checked against the masks and attributions; the three, as returned by
    :func:`_check_lds_inputs`."""
    n_queries = attributions.shape[0]
    outputs = check_array(outputs, dtype=np.float64, input_name="outputs")
    if outputs.shape != (len(masks), n_queries):
        raise ValueError(f"outputs must have shape (n_subsets, n_queries) = "
                         f"({len(masks)}, {n_queries}), got {outputs.shape}.")
    if len(masks) < 2:
        raise ValueError(f"A rank correlation needs at least 2 subsets, got {len(masks)}.")
    return masks, attributions, outputs


def _spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of every column of ``a`` with the same column of ``b``.

    Average ranks for ties (scipy.stats.spearmanr's convention); NaN where a column is
    constant.
    """
    ra = rankdata(a, axis=0)
    rb = rankdata(b, axis=0)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    denom = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = (ra * rb).sum(axis=0) / denom
    rho[denom == 0] = np.nan
    return np.clip(rho, -1.0, 1.0)


_LDS_PARAMS = {
    "attributions": ["array-like"],
    "subsets": ["array-like"],
    "outputs": ["array-like"],
}


@validate_params(
    {**_LDS_PARAMS, "multioutput": [StrOptions({"uniform_average", "raw_values"})]},
    prefer_skip_nested_validation=True,
)
def linear_datamodeling_score(attributions, subsets, outputs, *,
                              multioutput: str = "uniform_average"):
    """Linear datamodeling score (LDS) of an attribution matrix against retrained models.

    For every query ``q``, the Spearman rank correlation over the subsets ``j`` between the
    attribution's prediction ``sum_{i in S_j} attributions[q, i]`` and the retrained
    model's output ``outputs[j, q]``; then the mean over the queries (TRAK's protocol).

    Parameters
    ----------
    attributions : array-like of shape (n_queries, n_train)
        Scores of every training point for every query, larger = pushes the output up
        (e.g. :meth:`PathKernelClassifier.attribute
        <skpathkernel.PathKernelClassifier.attribute>`). A method whose scores have the
        opposite sign convention gets the opposite LDS.
    subsets : array-like of shape (n_subsets, n_train) or (n_subsets, subset_size)
        The training subsets: boolean masks, or the training indices of each subset
        (each index once; integer 0/1 masks are refused, as indices they repeat), or a
        list of index arrays of different sizes.
    outputs : array-like of shape (n_subsets, n_queries)
        The output of the model retrained on each subset at each query
        (the ``outputs`` of a :class:`SubsetRetraining`).
    multioutput : {"uniform_average", "raw_values"}, default="uniform_average"
        "raw_values" returns the LDS of every query.

    Returns
    -------
    score : float or ndarray of shape (n_queries,)
        The mean LDS over the queries, or each query's. A query whose prediction or
        output is the same on every subset has no rank correlation: it is NaN in the
        raw values and left out of the mean, with a warning.

    See Also
    --------
    retrain_on_subsets : Retrains an estimator on random subsets.
    linear_datamodeling_interval : Bootstrap confidence interval over the subsets.

    Examples
    --------
    A model whose output is a sum over its training points is its own perfect datamodel:

    >>> import numpy as np
    >>> from skpathkernel.metrics import linear_datamodeling_score
    >>> rng = np.random.RandomState(0)
    >>> weights = rng.normal(size=(3, 20))            # 3 queries, 20 training points
    >>> masks = rng.rand(30, 20) < 0.5                # 30 random subsets
    >>> outputs = masks @ weights.T                   # the "retrained" outputs
    >>> float(linear_datamodeling_score(weights, masks, outputs))
    1.0
    >>> float(linear_datamodeling_score(-weights, masks, outputs))
    -1.0
    """
    masks, attributions, outputs = _check_lds_inputs(attributions, subsets, outputs)
    per_query = _spearman_columns(masks @ attributions.T, outputs)
    if multioutput == "raw_values":
        return per_query
    undefined = int(np.isnan(per_query).sum())
    if undefined:
        warnings.warn(
            f"{undefined} of {len(per_query)} queries have a constant prediction or output "
            "over the subsets (no rank correlation); they are left out of the mean.",
            RuntimeWarning, stacklevel=2,
        )
    if undefined == len(per_query):
        return float("nan")
    return float(np.nanmean(per_query))


@validate_params(
    {**_LDS_PARAMS,
     "confidence_level": [Interval(numbers.Real, 0, 1, closed="neither")],
     "n_resamples": [count(1)],
     "random_state": ["random_state"]},
    prefer_skip_nested_validation=True,
)
def linear_datamodeling_interval(attributions, subsets, outputs, *,
                                 confidence_level: float = 0.95, n_resamples: int = 1000,
                                 random_state=None) -> tuple[float, float]:
    """Bootstrap confidence interval of the LDS over the subset draws.

    The subsets are resampled with replacement ``n_resamples`` times and the mean LDS is
    recomputed on each resample; the interval is the percentile interval of those
    values (queries with no rank correlation in a resample are left out of its mean).
    It measures how much the score depends on which subsets were drawn, the dominant
    noise of an LDS estimate with tens of subsets; the retrained models are not refitted.

    Parameters
    ----------
    attributions : array-like of shape (n_queries, n_train)
        Score matrix, one row per query and one column per training point.
    subsets : array-like of shape (n_subsets, n_train) or (n_subsets, subset_size)
        Which training points each subset holds, one row per subset
        (``SubsetRetraining.subsets``), in any form :func:`linear_datamodeling_score` takes.
    outputs : array-like of shape (n_subsets, n_queries)
        As in :func:`linear_datamodeling_score`.
    confidence_level : float, default=0.95
        Coverage of the interval.
    n_resamples : int, default=1000
        Number of bootstrap resamples of the subsets.
    random_state : int, RandomState instance or None, default=None
        Seeds the resampling.

    Returns
    -------
    low, high : float
        The interval's bounds.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel.metrics import linear_datamodeling_interval
    >>> rng = np.random.RandomState(0)
    >>> weights = rng.normal(size=(5, 40))
    >>> masks = rng.rand(50, 40) < 0.5
    >>> outputs = masks @ weights.T + rng.normal(scale=2.0, size=(50, 5))
    >>> low, high = linear_datamodeling_interval(weights, masks, outputs, random_state=0)
    >>> bool(0 < low < high < 1)
    True
    """
    masks, attributions, outputs = _check_lds_inputs(attributions, subsets, outputs)
    predictions = masks @ attributions.T
    rng = check_random_state(random_state)
    m = len(masks)
    values = np.empty(n_resamples)
    for b in range(n_resamples):
        rows = rng.randint(m, size=m)
        per_query = _spearman_columns(predictions[rows], outputs[rows])
        values[b] = np.nanmean(per_query) if np.isfinite(per_query).any() else np.nan
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    tail = (1.0 - confidence_level) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


# --------------------------------------------------------------------------- retraining
@dataclass
class SubsetRetraining:
    """Models retrained on training subsets, and their outputs at the queries.

    Returned by :func:`retrain_on_subsets`; its fields are its parameters and attributes.

    Parameters
    ----------
    subsets : ndarray of shape (n_subsets, n_train), dtype bool
        Which training points each subset holds.
    outputs : ndarray of shape (n_subsets, n_queries)
        The retrained models' output at every query, averaged over the ``n_repeats``
        models of each subset: the ``outputs`` argument of
        :func:`linear_datamodeling_score`.
    all_outputs : ndarray of shape (n_subsets, n_repeats, n_queries)
        Every model's outputs.
    seeds : ndarray of shape (n_subsets, n_repeats) or None
        The ``random_state`` each model was fitted with (``protocol="independent"``);
        None for the other protocols.
    output : str
        The output function: "margin", "decision_function", "predict" or the callable's
        name.
    protocol : str
        "independent", "same_seed" or "replay".

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import Ridge
    >>> from skpathkernel.metrics import SubsetRetraining, retrain_on_subsets
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(20, 2)); y = X @ [1.0, -1.0]
    >>> res = retrain_on_subsets(Ridge(), X, y, X[:3], n_subsets=4, n_repeats=2,
    ...                          random_state=0)
    >>> isinstance(res, SubsetRetraining), res.all_outputs.shape, res.seeds.shape
    (True, (4, 2, 3), (4, 2))
    >>> bool(np.allclose(res.outputs, res.all_outputs.mean(axis=1)))
    True
    >>> res.output, res.protocol
    ('predict', 'independent')
    """

    subsets: np.ndarray
    outputs: np.ndarray
    all_outputs: np.ndarray
    seeds: np.ndarray | None
    output: str
    protocol: str


def _query_outputs(estimator, X_query, output, codes) -> np.ndarray:
    """The output function at the queries, one float per query."""
    if callable(output):
        values = output(estimator, X_query)
    elif output == "margin":
        values = margin(estimator.decision_function(X_query), codes)
    else:
        values = getattr(estimator, output)(X_query)
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (len(X_query),):
        raise ValueError(
            f"The output function must give one value per query, shape ({len(X_query)},); "
            f"it gave {values.shape}. For several outputs pass a callable "
            "output(estimator, X_query) that selects one."
        )
    return values


def _replay(estimator, keep: np.ndarray):
    """The fitted network retrained along its own recorded path on the kept points only.

    Same initialization, same optimizer and step sizes, and every step's recorded batch
    with the left-out points removed (its loss the mean over the points that remain, or
    their weighted mean with the recorded batch weights of a fit with ``sample_weight``;
    a step whose batch lost every point is skipped), on targets that ``normalize_y``
    standardizes over the kept points. Returns a shallow copy of the
    estimator holding the retrained network, for the output functions; of a fitted
    pipeline or search, a copy holding it in place of the trainer inside, whose
    transformers stay fitted (the path is the trainer's alone).
    """
    trainer = pipeline_last_step(estimator)[0]
    return with_last_step(estimator, _replay_trainer(trainer, keep))


def _replay_trainer(estimator, keep: np.ndarray):
    """:func:`_replay` of a fitted skpathkernel trainer itself."""
    net = network_of(estimator)
    traj = net.trajectory
    module = copy_module(net.module)
    module.load_state_dict(traj.state_dict(0), strict=False)
    device = net.torch_device
    X, Y, loss = net.tensor(net.X_fit), net.targets(), net.loss
    model = copy.copy(estimator)
    restandardized = (estimator._kept_standardization(keep)
                      if isinstance(estimator, BasePathKernelNetwork) else None)
    if restandardized is not None:
        # A refit on the kept points standardizes their targets anew (normalize_y).
        targets, model._y_mean, model._y_scale = restandardized
        Y = torch.as_tensor(targets, dtype=Y.dtype, device=Y.device).reshape(Y.shape)
    optimizer = make_optimizer([p for p in module.parameters() if p.requires_grad],
                               traj.solver_spec, float(traj.learning_rates[0]))
    # Each step's own step size, also between the points of a thinned path.
    step_lrs = traj.step_learning_rates
    weighted = traj._batch_weights is not None
    # The fitted module is in eval mode: a recurrent one on CUDA trains without cuDNN.
    with trains_without_cudnn(module):
        for t, batch in enumerate(traj.batches):
            mask = keep[batch]
            kept = batch[mask]
            if not len(kept):
                continue
            set_learning_rate(optimizer, float(step_lrs[t]))
            rows = torch.as_tensor(kept, device=device)
            weights = None
            if weighted:
                beta = traj.batch_weights(t)
                # The recorded weights where the whole batch is kept: the trained step.
                weights = (torch.as_tensor(beta, dtype=traj.dtype, device=device)
                           if mask.all() else
                           batch_betas(beta, np.flatnonzero(mask), traj.dtype, device)[0])
            training_step(module, optimizer, loss, X[rows], Y[rows], weights=weights)
    model.module_ = module.eval()
    return model


def _fit_one(estimator, X, y, X_query, output, codes, classes, n_tasks, keep=None):
    """Fit one model on a subset (on a joblib worker); its outputs and the warnings it
    raised (see :func:`_RecordingWarnings`).

    With ``keep`` (a mask over the fitted estimator's training set) the model is the
    replay of the estimator's path on the kept points instead.
    """
    # The worker's cores are shared by the concurrent fits.
    with limit_torch_threads(max(1, cpu_count() // n_tasks)), \
            _RecordingWarnings() as caught:
        if keep is not None:
            return _query_outputs(_replay(estimator, keep), X_query, output, codes), caught
        estimator.fit(X, y)
        if classes is not None and not np.array_equal(estimator.classes_, classes):
            missing = sorted(set(classes.tolist()) - set(estimator.classes_.tolist()))
            raise ValueError(
                f"A training subset holds no sample of class(es) {missing[:5]}, so its "
                "model has no margin for them; use a larger subset_fraction."
            )
        return _query_outputs(estimator, X_query, output, codes), caught


class _RecordingWarnings(warnings.catch_warnings):
    """Every warning a joblib task raises, kept as ``(message, category)`` pairs for
    :func:`_warn_once_each` in the caller's process: a process worker's would only reach
    its stderr, where the caller's filters do not apply (not even ``catch_warnings``),
    and a fit's each came again at joblib's line, once per fit."""

    def __init__(self):
        super().__init__(record=True)

    def __enter__(self):
        self._caught = super().__enter__()
        warnings.simplefilter("always")
        self.pairs = []
        return self.pairs

    def __exit__(self, *exc_info):
        self.pairs.extend((w.message, w.category) for w in self._caught)
        return super().__exit__(*exc_info)


def _warn_once_each(caught_lists) -> None:
    """Raise again, at the user's line, each distinct warning the tasks recorded
    (:class:`_RecordingWarnings`), in the order first seen: once, however many models
    raised it."""
    seen = set()
    for caught in caught_lists:
        for message, category in caught:
            key = (str(message), category)
            if key not in seen:
                seen.add(key)
                warnings.warn(message, category, stacklevel=caller_stacklevel())


@validate_params(
    {
        # What clone takes: None or a string failed in is_classifier, in words about
        # __sklearn_tags__.
        "estimator": [HasMethods(["fit", "get_params"])],
        "X": ["array-like"],
        "y": ["array-like"],
        "X_query": ["array-like"],
        "y_query": ["array-like", None],
        "n_subsets": [count(2)],
        "subset_fraction": [Interval(numbers.Real, 0, 1, closed="neither")],
        "subsets": ["array-like", None],
        "output": [StrOptions({"auto", "margin", "decision_function", "predict"}),
                   callable],
        "protocol": [StrOptions({"independent", "same_seed", "replay"})],
        "n_repeats": [count(1)],
        "random_state": ["random_state"],
        "n_jobs": [numbers.Integral, None],
        "verbose": ["verbose"],
    },
    prefer_skip_nested_validation=True,
)
def retrain_on_subsets(
    estimator,
    X,
    y,
    X_query,
    y_query=None,
    *,
    n_subsets: int = 50,
    subset_fraction: float = 0.5,
    subsets=None,
    output: str | Callable = "auto",
    protocol: str = "independent",
    n_repeats: int = 1,
    random_state=None,
    n_jobs: int | None = None,
    verbose: int = 0,
) -> SubsetRetraining:
    """Retrain an estimator on training subsets (random or given); record its query outputs.

    The ground truth of the linear datamodeling score (TRAK's protocol): ``n_subsets``
    subsets, each ``round(subset_fraction * n_train)`` training points drawn uniformly
    without replacement; on each, ``n_repeats`` clones of ``estimator``
    (``sklearn.base.clone``: same parameters, unfitted) are fitted and their outputs at
    ``X_query`` averaged.

    Parameters
    ----------
    estimator : estimator object
        Any scikit-learn estimator; it is cloned, never fitted itself.
    X : array-like of shape (n_train, ...)
        The full training set; indexed along its first axis.
    y : array-like of shape (n_train,) or (n_train, n_targets)
        Training targets.
    X_query : array-like of shape (n_queries, ...)
        The queries whose outputs are recorded.
    y_query : array-like of shape (n_queries,) or (n_queries, n_labels), default=None
        The queries' labels, needed by ``output="margin"`` (0/1 indicator rows for a
        multilabel classifier, whose margin is ``attribute``'s: the sum of the
        label logits signed by the query's labels).
    n_subsets : int, default=50
        Number of random subsets, one retraining each.
    subset_fraction : float, default=0.5
        TRAK's ``alpha``.
    subsets : array-like of shape (n_subsets, n_train), default=None
        The training subsets to retrain on, instead of random draws: boolean masks, or
        rows of training indices (as :func:`linear_datamodeling_score` takes them), e.g.
        ``~np.isin(np.arange(n_train), S)[None]`` for the model without the points
        ``S``, whose change ``attribute(..., method="unrolled")`` predicts. Each must
        keep at least one point. ``n_subsets`` and ``subset_fraction`` are then unused,
        and the returned ``subsets`` are these, as boolean masks.
    output : {"auto", "margin", "decision_function", "predict"} or callable, default="auto"
        What is recorded per query. "margin" (the "auto" choice for classifiers) is
        ``log(p_y / (1 - p_y)) = f_y - logsumexp_{k != y} f_k`` from
        ``decision_function``, ``p`` the softmax (sigmoid for one output) of its logits:
        TRAK's output function. "auto" records ``predict`` for regressors. A callable is
        called as ``output(fitted_estimator, X_query)`` and returns one value per query.
    protocol : {"independent", "same_seed", "replay"}, default="independent"
        How each model is retrained.

        - "independent" (TRAK's protocol): each model is fitted with its own
          ``random_state`` drawn from ``random_state``: new initialization and
          minibatch order. The seed goes to every ``random_state`` parameter of the
          estimator and of those inside it (a Pipeline's steps, a meta-estimator's
          ``estimator``); an estimator without one is refitted as it is.
        - "same_seed": every model is fitted with the estimator's own ``random_state``
          (every one inside it, which must be set): the same initialization and
          random stream. Full-batch training then differs only by the data;
          minibatches are drawn from the same stream over a smaller set, so they
          differ.
        - "replay" (skpathkernel estimators, fitted on ``X, y``, which must be
          ``X_fit_`` and its targets: other targets are refused): the estimator's own
          recorded path replayed without the left-out points: its initialization, its
          optimizer and step sizes, and every step's recorded minibatch minus the
          left-out points (the loss averaged over the points that remain, with the
          step's recorded weights renormalized over them for a ``sample_weight`` fit;
          a step left empty is skipped, where ``fit(X, y, sample_weight=mask)``
          steps on a zero-weight minibatch all the same (momentum, Adam's moments and
          weight decay still move the parameters), so the two agree only where no
          recorded minibatch is emptied or training is plain SGD without ``alpha``;
          a regressor's ``normalize_y`` targets
          standardized anew over the kept points, as a refit standardizes them).
          The counterfactual whose first-order
          prediction is ``attribute(..., method="unrolled")`` summed over the kept
          points. The only protocol that follows a weighted fit's weights: the
          others refit with ``fit(X, y)``, unweighted. A fitted Pipeline ending in
          one (or a search refitted on one, its ``best_estimator_``) replays the
          network's path on ``X`` through the steps before it, which stay fitted as
          they are (the path is the network's alone; the other protocols refit them
          on each subset); the outputs are read through the pipeline.
    n_repeats : int, default=1
        Models per subset; their outputs are averaged (only "independent" gives
        different models).
    random_state : int, RandomState instance or None, default=None
        Seeds the subsets and, with ``protocol="independent"``, the models' seeds.
    n_jobs : int, default=None
        Fits run in parallel by joblib (``-1``: every core); each fit limits torch to its
        share of the cores. ``None`` means 1 unless in a ``joblib.parallel_config``
        context. The fits' warnings (a ``ConvergenceWarning`` of each unconverged
        model, say) are raised again here, from process workers too, each distinct
        one once.
    verbose : int, default=0
        A progress bar over the fits (tqdm when installed).

    Returns
    -------
    result : SubsetRetraining
        ``subsets`` (masks) and ``outputs``: the arguments of
        :func:`linear_datamodeling_score`.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import Ridge
    >>> from skpathkernel.metrics import retrain_on_subsets
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(30, 3)); y = X @ [1.0, -2.0, 0.5]
    >>> res = retrain_on_subsets(Ridge(), X, y, X[:4], n_subsets=5, random_state=0)
    >>> res.subsets.shape, res.outputs.shape
    ((5, 30), (5, 4))
    >>> int(res.subsets.sum(axis=1)[0])
    15
    >>> without = np.ones((1, 30), dtype=bool); without[0, :3] = False   # your own subset
    >>> retrain_on_subsets(Ridge(), X, y, X[:4], subsets=without).outputs.shape
    (1, 4)
    """
    n_train, size = _subset_size(X, y, subset_fraction)
    masks = None if subsets is None else _given_subsets(subsets, n_train)
    _check_protocol(protocol, estimator, X, y)
    output, codes, classes = _resolve_output(estimator, output, y, X_query, y_query,
                                             fitted=protocol == "replay")
    rng = check_random_state(random_state)
    if masks is None:
        masks, seeds = _draw_subsets(rng, n_subsets, n_train, size,
                                     n_repeats if protocol == "independent" else None)
    else:
        n_subsets = len(masks)
        seeds = (rng.randint(np.iinfo(np.int32).max, size=(n_subsets, n_repeats))
                 if protocol == "independent" else None)
    n_tasks = max(1, min(effective_n_jobs(n_jobs), n_subsets * n_repeats))
    jobs = [(j, r) for j in range(n_subsets) for r in range(n_repeats)]
    if protocol == "replay":
        tasks = (delayed(_fit_one)(estimator, None, None, X_query, output, codes, None,
                                   n_tasks, keep=masks[j]) for j, _ in jobs)
    else:
        tasks = _subset_fits(estimator, X, y, masks, seeds, jobs, X_query, output, codes,
                             classes, n_tasks)
    results = Parallel(n_jobs=n_jobs, return_as="generator")(tasks)
    all_outputs = np.empty((n_subsets, n_repeats, len(X_query)))
    # The generator runs to its end, so that a progress bar closes.
    bar = Progress("retrain_on_subsets", len(jobs), enabled=bool(verbose),
                   each="{desc}: {n}/{total} models fitted")
    caught = []
    for k, (values, warned) in enumerate(bar.iterate(results)):
        all_outputs[jobs[k]] = values
        caught.append(warned)
    _warn_once_each(caught)
    name = output if isinstance(output, str) else getattr(output, "__name__", "callable")
    return SubsetRetraining(subsets=masks, outputs=all_outputs.mean(axis=1),
                            all_outputs=all_outputs, seeds=seeds, output=name,
                            protocol=protocol)


def _subset_size(X, y, subset_fraction) -> tuple[int, int]:
    """(training points, points per subset), checked to leave at least one in and out."""
    n_train = len(X)
    if len(y) != n_train:
        raise ValueError(f"X has {n_train} samples but y has {len(y)}.")
    size = int(round(subset_fraction * n_train))
    if not 1 <= size < n_train:
        raise ValueError(f"subset_fraction={subset_fraction} gives subsets of {size} of "
                         f"{n_train} training points; it must leave at least one in and out.")
    return n_train, size


def _given_subsets(subsets, n_train: int) -> np.ndarray:
    """The caller's ``subsets`` (boolean masks or index rows) as masks (m, n_train)."""
    try:
        subsets = np.asarray(subsets)
    except ValueError:
        subsets = _ragged_masks(subsets, n_train)
    if subsets.ndim != 2 or not len(subsets):
        raise ValueError("subsets must be 2-D and hold at least one subset: boolean masks "
                         "(n_subsets, n_train) or rows of training indices, got shape "
                         f"{subsets.shape}.")
    # A copy: the caller's masks are returned in the result.
    masks = _stacked_masks(subsets, n_train, f"X has {n_train}").copy()
    empty = np.flatnonzero(~masks.any(axis=1))
    if len(empty):
        raise ValueError(f"subset {empty[0]} keeps no training point; each must keep one.")
    return masks


def _draw_subsets(rng, n_subsets, n_train, size, n_repeats):
    """Masks (n_subsets, n_train) of ``size`` points each; with ``n_repeats``, a seed per
    model (n_subsets, n_repeats), else None."""
    masks = np.zeros((n_subsets, n_train), dtype=bool)
    for j in range(n_subsets):
        masks[j, rng.choice(n_train, size, replace=False)] = True
    seeds = (None if n_repeats is None
             else rng.randint(np.iinfo(np.int32).max, size=(n_subsets, n_repeats)))
    return masks, seeds


def _subset_fits(estimator, X, y, masks, seeds, jobs, X_query, output, codes, classes,
                 n_tasks):
    """The joblib tasks fitting a clone of ``estimator`` on each job's subset."""
    X_arr = X if hasattr(X, "iloc") else np.asarray(X)
    y_arr = y if hasattr(y, "iloc") else np.asarray(y)

    def take(a, rows):
        return a.iloc[rows] if hasattr(a, "iloc") else a[rows]

    keys = _seed_params(estimator)

    def model(j, r):
        est = clone(estimator)
        if seeds is not None and keys:
            est.set_params(**dict.fromkeys(keys, int(seeds[j, r])))
        return est

    return (delayed(_fit_one)(model(j, r), take(X_arr, masks[j]), take(y_arr, masks[j]),
                              X_query, output, codes, classes, n_tasks)
            for j, r in jobs)


def _resolve_output(estimator, output, y, X_query, y_query, fitted=False):
    """(output, the queries' label codes, the classes): the last two for "margin" only.

    ``fitted`` (the replay protocol, whose models are the fitted estimator's path rerun):
    the margin is the one the estimator's targets define, and ``y`` must be of their kind.
    """
    classifier = is_classifier(estimator)
    if output == "auto":
        output = "margin" if classifier else "predict"
    if y_query is not None:
        # Checked whatever the output reads: labels of other queries than X_query's are a
        # mistake even where only "margin" would use them (they were dropped unchecked).
        y_query = np.asarray(y_query)
        if np.shape(y_query)[:1] != (len(X_query),):
            raise ValueError(f"X_query has {len(X_query)} rows but y_query has shape "
                             f"{np.shape(y_query)}: one label (row) per query.")
    if output != "margin":
        return output, None, None
    if not classifier:
        raise ValueError("output='margin' is for classifiers; use 'predict' or a callable.")
    if y_query is None:
        raise ValueError("output='margin' needs the queries' labels: pass y_query.")
    # With ``fitted``, y is the estimator's own targets (_check_replayable).
    indicator = np.ndim(y) == 2 and np.shape(y)[1] > 1
    # Multilabel (a column is labels): the signed sum of the label logits, attribute's.
    if indicator:
        return output, check_indicator(y_query, np.shape(y)[1]), None
    classes = estimator.classes_ if fitted else np.unique(np.asarray(y))
    return output, label_codes(classes, y_query), classes


def _seed_params(estimator) -> list[str]:
    """The ``random_state`` parameters of ``estimator`` and of the estimators inside it
    (a Pipeline's steps, a meta-estimator's ``estimator``), as ``set_params`` names
    them: where a model's seed must go. Empty for an estimator without randomness."""
    return sorted(key for key in estimator.get_params(deep=True)
                  if key.rpartition("__")[2] == "random_state")


def _check_protocol(protocol, estimator, X, y) -> None:
    if protocol == "same_seed":
        params = estimator.get_params(deep=True)
        unset = [key for key in _seed_params(estimator) if params[key] is None]
        if unset:
            verb, it = ("is", "it") if len(unset) == 1 else ("are", "them")
            raise ValueError("protocol='same_seed' retrains every model with the "
                             f"estimator's own seeds, but {', '.join(unset)} {verb} None (a "
                             f"fresh seed each fit): set {it} to an int.")
    if protocol == "replay":
        _check_replayable(estimator, X, y)


def _check_replayable(estimator, X, y) -> None:
    """The replay protocol needs a fitted skpathkernel estimator trained on X, y itself
    (in a fitted pipeline or search: the one inside, on X through the steps before it).

    The replay trains on the targets recorded with the path: a ``y`` that differs (other
    labels, another task) would be replaced by them without a word.
    """
    X_given = X
    # A meta-estimator on the way (a pipeline's last step, or one reading a pipeline of
    # its own, which the resolver follows into it) is refused as one given alone.
    meta = next((step for step in _followed(estimator)
                 if isinstance(step, NetworkMetaEstimator)), None)
    resolved, X = pipeline_last_step(estimator, X)
    if meta is not None:
        resolved = meta
    if resolved is estimator and (isinstance(estimator, Pipeline)
                                  or hasattr(estimator, "cv_results_")):
        # Not followed: unfitted (NotFittedError), or a wrapper whose network saw other
        # inputs or targets, refused with the way to it.
        network_of(estimator)
    estimator = resolved
    if isinstance(estimator, RecordedNetwork):
        # Fitted already, so "fit it first" would not help.
        raise ValueError(f"protocol='replay' replays the training of a fitted "
                         f"PathKernelMachine or PathKernelClassifier; a "
                         f"{type(estimator).__name__}'s path comes from a loop of your "
                         "own (its optimizer, schedule and clipping), which retraining "
                         "on a subset reruns.")
    if isinstance(estimator, NetworkMetaEstimator):
        # Its path is its trainer's, recorded by the trainer's fit (not a loop of the
        # user's), and fitting the meta-estimator does not make it replayable.
        raise ValueError(f"protocol='replay' replays the training of a fitted "
                         f"PathKernelMachine or PathKernelClassifier; a "
                         f"{type(estimator).__name__} reads the path of its estimator: "
                         "pass that trainer, fitted on X, y (its estimator_), instead.")
    if not isinstance(estimator, BasePathKernelNetwork):
        raise ValueError("protocol='replay' replays the recorded path of a fitted "
                         "PathKernelMachine or PathKernelClassifier; a "
                         f"{type(estimator).__name__} records none.")
    if not hasattr(estimator, "trajectory_"):
        raise ValueError("protocol='replay' replays the recorded path of a fitted "
                         "skpathkernel estimator; fit it on X, y first.")
    X_fit = estimator.X_fit_
    if np.shape(X) != X_fit.shape or not _is_training_set(X, X_fit, exact=X is X_given):
        raise ValueError("protocol='replay' needs X to be the estimator's training set, "
                         "X_fit_ (its recorded batches index it): without the samples "
                         "that early_stopping held out, and those of every partial_fit "
                         "call in order.")
    if is_classifier(estimator):
        indicator = np.ndim(y) == 2 and np.shape(y)[1] > 1
        if indicator != getattr(estimator, "_multilabel", False):
            kinds = ("class labels", "a multilabel indicator")
            raise ValueError(f"y is {kinds[indicator]} but the estimator was trained on "
                             f"{kinds[not indicator]}: the replay retrains on its own "
                             "targets; pass its training targets.")
    Y = np.asarray(_encode_like_fit(estimator, y), dtype=np.float64)
    Y_fit = np.asarray(network_of(estimator).y_fit, dtype=np.float64)
    # The same encoding of the same values: equal but for round-off.
    if Y.size != Y_fit.size or not np.allclose(Y.reshape(Y_fit.shape), Y_fit, rtol=1e-9,
                                               atol=0.0):
        raise ValueError("protocol='replay' retrains on the estimator's own training "
                         "targets, recorded with its path, so y must be those of X_fit_; "
                         "other targets are retrained with protocol='independent' or "
                         "'same_seed'.")


def _is_training_set(X, X_fit, exact: bool) -> bool:
    """Whether ``X`` (of ``X_fit``'s shape) holds the rows ``X_fit``, in order.

    Not ``exact``: ``X`` came through a pipeline's ``transform``, where its fit trained the
    network on ``fit_transform``'s output, which a transformer may compute another way
    (PCA: ``U S`` against ``(X - mean) V^T``, 1e-13 apart), so equal to round-off: each
    feature within ``sqrt(eps)`` of its largest value (of ``sqrt(eps)`` times the largest
    of all, for a feature near zero), far below what other rows or another order change.
    Per feature: a tolerance of the largest feature's scale would pass any change of a
    feature a million times smaller."""
    X = np.asarray(X, dtype=X_fit.dtype)
    if exact or not np.issubdtype(X_fit.dtype, np.floating):
        return np.array_equal(X, X_fit)
    root = np.sqrt(np.finfo(X_fit.dtype).eps)
    scale = np.abs(X_fit).max(axis=0)
    scale = np.maximum(scale, root * scale.max(initial=0.0))
    return bool(np.all(np.abs(X - X_fit) <= root * scale))


# --------------------------------------------------------------------------- ensembles
def _attribute_one(estimator, X, y, X_query, y_query, attribute_params, n_tasks):
    """Fit one seeded clone (on a joblib worker); its scores and the warnings it raised.

    The warnings travel back with the scores, since a process worker's would be lost.
    """
    with limit_torch_threads(max(1, cpu_count() // n_tasks)), \
            _RecordingWarnings() as caught:
        scores = estimator.fit(X, y).attribute(X_query, y_query, **attribute_params)
    return scores, caught


@validate_params(
    {
        "estimator": [HasMethods(["fit", "attribute", "get_params", "set_params"])],
        "X": ["array-like"],
        "y": ["array-like"],
        "X_query": ["array-like"],
        "y_query": ["array-like", None],
        "n_models": [count(1)],
        "random_state": ["random_state"],
        "n_jobs": [numbers.Integral, None],
    },
    prefer_skip_nested_validation=True,
)
def ensemble_attribution(estimator, X, y, X_query, y_query=None, *, n_models: int = 5,
                         random_state=None, n_jobs: int | None = None,
                         **attribute_params) -> np.ndarray:
    """Attribution scores averaged over independently seeded fits of an estimator.

    ``n_models`` clones of ``estimator`` (``sklearn.base.clone``: same parameters,
    unfitted), each with its own ``random_state`` drawn from ``random_state`` (new
    initialization and minibatch order), are fitted on ``X, y``; each attributes the
    queries with ``attribute(X_query, y_query, **attribute_params)`` and the scores are
    averaged. The ensemble's mean predicts the output averaged over retrainings from
    fresh seeds, which a single model's scores predict only up to the model's own
    randomness: TRAK's ensembling (Park et al. 2023, section 3.2), whose linear
    datamodeling score under ``retrain_on_subsets(protocol="independent")`` rises with
    the number of models.

    Parameters
    ----------
    estimator : skpathkernel estimator
        A :class:`~skpathkernel.PathKernelClassifier` or
        :class:`~skpathkernel.PathKernelMachine` (any estimator with ``fit``,
        ``attribute`` and a ``random_state`` parameter), fitted or not: it is cloned,
        never fitted itself.
    X : array-like of shape (n_train, n_features) or (n_train, ...)
        Training inputs (N-D for a ``module=`` network: images, sequences, token ids).
    y : array-like of shape (n_train,) or (n_train, n_targets)
        Training targets.
    X_query : array-like of shape (n_queries, n_features) or (n_queries, ...)
        The queries whose outputs are recorded, in the form of ``X``.
    y_query : array-like of shape (n_queries,), default=None
        Passed to ``attribute``: classifiers explain the margin of these labels (None:
        each model's predicted class).
    n_models : int, default=5
        Number of models fitted and averaged.
    random_state : int, RandomState instance or None, default=None
        Seeds the models' seeds: model ``k`` is fitted with
        ``random_state=RandomState(random_state).randint(2**31 - 1, size=n_models)[k]``.
    n_jobs : int, default=None
        Models fitted and attributed in parallel by joblib (``-1``: every core); each
        limits torch to its share of the cores. ``None`` means 1 unless in a
        ``joblib.parallel_config`` context.
    **attribute_params
        Keyword arguments of ``attribute``: ``method``, ``weighting``, ``output``,
        ``n_nodes``, ``tol``. (``n_jobs`` is the ensemble's own, above: each model's
        ``attribute`` runs its query blocks serially.)

    Returns
    -------
    scores : ndarray of shape (n_queries, n_train)
        Float64, the mean of the models' scores. With ``method="unrolled"`` an
        :class:`~skpathkernel.AttributionScores` whose ``growth`` is, per query, the
        largest of the models' (the ensemble is as trustworthy as its least stable
        member) and whose ``replay_error`` and ``gradient_sensitivity`` are the
        largest (None where no model measured one); ``amplification`` is None.
        Warnings the models raised (such as
        :class:`~skpathkernel.UnstablePathWarning`) are raised again here.

    See Also
    --------
    retrain_on_subsets : The retrained models (``protocol="independent"``) to score it
        against.
    linear_datamodeling_score : The score.

    Examples
    --------
    >>> from sklearn.datasets import make_classification
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.metrics import ensemble_attribution
    >>> X, y = make_classification(n_samples=40, n_features=4, random_state=0)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), solver="sgd",
    ...                            learning_rate_init=0.1, max_iter=20, tol=None)
    >>> scores = ensemble_attribution(clf, X, y, X[:3], y[:3], n_models=3,
    ...                               random_state=0, method="unrolled")
    >>> scores.shape
    (3, 40)
    """
    if "random_state" not in estimator.get_params(deep=False):
        raise ValueError(f"{type(estimator).__name__} has no random_state parameter: "
                         "the ensemble's models need their own seeds.")
    X_arr = X if hasattr(X, "iloc") else np.asarray(X)
    y_arr = y if hasattr(y, "iloc") else np.asarray(y)
    if len(y_arr) != len(X_arr):
        raise ValueError(f"X has {len(X_arr)} samples but y has {len(y_arr)}.")
    rng = check_random_state(random_state)
    seeds = rng.randint(np.iinfo(np.int32).max, size=n_models)

    def model(seed):
        est = clone(estimator)
        est.set_params(random_state=int(seed))
        return est

    n_tasks = max(1, min(effective_n_jobs(n_jobs), n_models))
    results = Parallel(n_jobs=n_jobs)(
        delayed(_attribute_one)(model(seed), X_arr, y_arr, X_query, y_query,
                                attribute_params, n_tasks) for seed in seeds)
    _warn_once_each(caught for _, caught in results)
    members = [scores for scores, _ in results]
    mean = np.mean([np.asarray(s, dtype=np.float64) for s in members], axis=0)
    growths = [getattr(s, "growth", None) for s in members]
    if all(g is not None for g in growths):
        mean = mean.view(AttributionScores)
        mean.growth = np.max(growths, axis=0)
        errors = [s.replay_error for s in members if s.replay_error is not None]
        mean.replay_error = worst(errors)
        # The float32 gradients' reach: the least robust member's, as growth (NaN kept).
        mean.gradient_sensitivity = worst(
            s.gradient_sensitivity for s in members if s.gradient_sensitivity is not None)
    return mean
