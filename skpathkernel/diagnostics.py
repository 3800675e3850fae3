"""Diagnostics of a trained network: the flatness of its training loss.

Flatness is measured, as in the "flat interpolators generalize" literature (Hochreiter &
Schmidhuber; Keskar et al. 2017), by the
trace of the Hessian of the empirical loss with respect to the parameters,
``Tr H(theta) = Tr d^2/dtheta^2 (1/n) sum_i l(y_i, f(x_i; theta))`` (for a fit with
``sample_weight``, of the weighted mean loss ``sum_i w_i l_i / sum_i w_i`` it minimized).

The trace is estimated by Hutchinson's estimator ``Tr H = E_v[v^T H v]`` with Rademacher
probes ``v`` (entries +-1). Each ``v^T H v`` costs one Hessian-vector product by double
backward: no ``P x P`` Hessian is formed, memory stays that of a gradient. The network is
evaluated at a recorded point of the optimisation path with
:func:`torch.func.functional_call`, so the fitted estimator is never modified.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.utils import check_array, check_random_state
from sklearn.utils._param_validation import HasMethods, validate_params
from sklearn.utils.validation import check_consistent_length, check_is_fitted, column_or_1d

from ._checkpoint import functional_call
from ._device import forward_input
from ._estimators._base import _check_weights, data_like_fit
from ._memory import rows_per_block
from ._modules import runs_module
from ._network._trained import (
    _as_array,
    network_of,
    output_block_rows,
    pipeline_last_step,
)
from ._path._recorder import RecordedNetwork
from ._path._training import warn_drawing_now
from ._second_order import check_twice_differentiable, twice_differentiable
from ._tangent._capture import check_functional_lookups, check_lookups
from ._validation import check_index, count

__all__ = ["HessianTrace", "HessianTracePath", "hessian_trace", "hessian_trace_path",
           "loss_path"]


@dataclass
class HessianTrace:
    """Hutchinson estimate of the trace of the training-loss Hessian at one recorded point.

    Returned by :func:`hessian_trace`; its fields are its parameters and attributes.

    Parameters
    ----------
    trace : float
        The estimate, the mean of ``estimates``.
    stderr : float
        Its standard error: the sample standard deviation (``ddof=1``) of ``estimates``
        divided by ``sqrt(n_samples)``; NaN for a single probe.
    estimates : ndarray of shape (n_samples,)
        ``v^T H v`` for every Rademacher probe ``v``.
    step : int
        The recorded point (``0 <= step < len(trajectory_)``; 0 is the initialization).
    optimizer_step : int
        The optimizer step after which that point was recorded, ``trajectory_.steps[step]``.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.diagnostics import hessian_trace
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1)
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=5, tol=None,
    ...                         random_state=0).fit(X, X.ravel())
    >>> res = hessian_trace(est, n_samples=10, random_state=0)
    >>> res.estimates.shape, res.step == len(est.trajectory_) - 1
    ((10,), True)
    """

    trace: float
    stderr: float
    estimates: np.ndarray
    step: int
    optimizer_step: int


@dataclass
class HessianTracePath:
    """Hutchinson estimates of the Hessian trace at several recorded points.

    The same probes are used at every point, so differences along the path carry less
    noise than independent estimates would (common random numbers).

    Returned by :func:`hessian_trace_path`; its fields are its parameters and attributes.
    ``result[i]`` is the :class:`HessianTrace` of the ``i``-th point.

    Parameters
    ----------
    trace : ndarray of shape (n_points,)
        The estimate at each point, the mean of its row of ``estimates``.
    stderr : ndarray of shape (n_points,)
        Their standard errors, as :class:`HessianTrace`'s ``stderr``.
    estimates : ndarray of shape (n_points, n_samples)
        ``v^T H v`` for every Rademacher probe ``v``, the same probes at every point.
    steps : ndarray of shape (n_points,)
        The recorded points, non-negative and in the order asked for.
    optimizer_steps : ndarray of shape (n_points,)
        ``trajectory_.steps[steps]``.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.diagnostics import hessian_trace_path
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1)
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=5, tol=None,
    ...                         random_state=0).fit(X, X.ravel())
    >>> res = hessian_trace_path(est, steps=[0, -1], n_samples=10, random_state=0)
    >>> len(res), res.estimates.shape, res.steps.tolist() == [0, len(est.trajectory_) - 1]
    (2, (2, 10), True)
    >>> bool(res[1].trace == res.trace[1])
    True
    """

    trace: np.ndarray
    stderr: np.ndarray
    estimates: np.ndarray
    steps: np.ndarray
    optimizer_steps: np.ndarray

    def __getitem__(self, i: int) -> HessianTrace:
        """The estimate at the ``i``-th point asked for, as a :class:`HessianTrace`."""
        return HessianTrace(
            trace=float(self.trace[i]), stderr=float(self.stderr[i]),
            estimates=self.estimates[i], step=int(self.steps[i]),
            optimizer_step=int(self.optimizer_steps[i]),
        )

    def __len__(self) -> int:
        return len(self.steps)


# Any estimator: network_of reads the network of a network estimator, of a
# RecordedNetwork and of a FrozenEstimator's estimator; pipeline_last_step gives a
# Pipeline's last step and a refitted search's best_estimator_. Any other (a bag,
# TransformedTargetRegressor) network_of refuses with its hint (the estimator inside to
# pass), as the kernels and the displays do. The classes listed
# beside HasMethods(["fit"]) before, all with fit, only named private classes in
# validate_params' message.
_ESTIMATOR = [HasMethods(["fit"])]

_COMMON_CONSTRAINTS = {
    "estimator": _ESTIMATOR,
    "X": ["array-like", None],
    "y": ["array-like", "sparse matrix", None],
    "sample_weight": ["array-like", None],
    "n_samples": [count(1)],
    "random_state": ["random_state"],
    "batch_size": [count(1), None],
}


@validate_params(
    {**_COMMON_CONSTRAINTS, "step": [numbers.Integral]},
    prefer_skip_nested_validation=True,
)
def hessian_trace(estimator, X=None, y=None, *, sample_weight=None, n_samples=100,
                  random_state=None, step=-1, batch_size=None):
    """Trace of the Hessian of the training loss at a recorded point, by Hutchinson.

    Estimates ``Tr H`` with ``H = d^2 L / dtheta^2`` and ``L(theta) = (1/n) sum_i
    l(y_i, f(x_i; theta))`` the mean per-sample loss the estimator trains with
    (``estimator.loss``), as ``mean_j v_j^T H v_j`` over ``n_samples`` Rademacher probes.
    For an estimator fitted with ``sample_weight``, ``L`` on its training data is the
    weighted mean ``sum_i w_i l_i / sum_i w_i`` with the fit's weights (``np.average``'s,
    the objective each batch's weighted mean estimates), unless ``sample_weight`` says
    otherwise.
    The estimate is unbiased; its standard error is reported with it. Each probe costs one
    Hessian-vector product (double backward) per batch of samples; a ``P x P`` Hessian is
    never formed.

    The loss is the data term only: L2 weight decay (``alpha``) is *not* included. For the
    solvers that add it to the gradient (sgd, adam, rmsprop) the regularised objective
    ``L + alpha / 2 ||theta||^2`` has trace ``Tr H + alpha * n_params_``; for adamw the
    decay is decoupled and belongs to no loss.

    Parameters
    ----------
    estimator : fitted skpathkernel estimator
        PathKernelMachine or PathKernelClassifier (its network and training loss); a
        meta-estimator (TangentFeatures, TangentFeatureSVM, OODRankDetector) stands for
        its ``estimator_``, a :class:`~sklearn.frozen.FrozenEstimator` for the estimator
        it holds; a :class:`~skpathkernel.RecordedNetwork` (a loop recorded by
        :class:`~skpathkernel.PathRecorder`, with its ``loss``) is the network it holds,
        and its ``y`` is in the terms of that loss, as its ``y_train``. Its network is
        evaluated as it is (``module_`` is in evaluation mode after ``fit``) with the
        parameters of recorded point ``step``; the estimator is not modified. A fitted
        :class:`~sklearn.pipeline.Pipeline` ending in one stands for its last step,
        ``pipe[-1]`` (whose ``X_fit_`` are the transformed training inputs), with an
        explicit ``X`` transformed by the steps before it, ``pipe[:-1].transform(X)``
        (``y`` as it is: a pipeline passes it unchanged to the last step's fit), as
        :mod:`skpathkernel.plotting`'s displays take it; a search refitted on the whole
        data (``refit=True``) stands for its ``best_estimator_``, a pipeline or not.
        Other wrappers (``TransformedTargetRegressor``, a bag, one estimator per output)
        are refused with a ``TypeError`` naming the estimator inside to pass.
    X : array-like of shape (n_samples_X, n_features) or (n_samples_X, ...), default=None
        Inputs, in the form of the training inputs (``input_shape_``). ``None``: the
        training inputs ``X_fit_``.
    y : array-like of shape (n_samples_X,) or (n_samples_X, n_outputs), default=None
        Targets, encoded as ``fit`` encodes them (classifiers map labels through
        ``classes_``; a label not seen in ``fit`` is an error; a multilabel classifier's
        indicator may be sparse, as in its ``fit``). Required with ``X``;
        ``None`` with ``X=None``: the training targets.
    sample_weight : array-like of shape (n_samples_X,), default=None
        Weights of the samples in the mean loss, relative (``np.average``'s; non-negative,
        not all 0). ``None``: the weights of the fit (those ``fit`` and ``partial_fit``
        received, each call's rescaled to mean 1, as training sees them; 1 for a call
        without them) with ``X=None``, equal weights with an
        explicit ``X``. With ``X=None`` they weigh the training samples, in the order of
        ``X_fit_`` (equal weights: the unweighted Hessian of a weighted fit).
    n_samples : int, default=100
        Number of Rademacher probes.
    random_state : int, RandomState instance or None, default=None
        Seeds the probes (drawn from a local :class:`torch.Generator`, on the CPU, so that
        a seed gives the same probes on every device; torch's global RNG is untouched).
    step : int, default=-1
        Recorded point of ``trajectory_``: 0 is the initialization, -1 the end of training.
    batch_size : int, default=None
        Samples per Hessian-vector product; the products of the batches are summed with
        weights ``n_batch / n`` (their share of the weights), which is exactly the product
        of the mean loss. ``None``: as
        many as the estimator's ``memory_budget`` allows (all of them on small data).

    Returns
    -------
    result : HessianTrace
        ``trace``, ``stderr``, ``estimates`` (per probe), ``step``, ``optimizer_step``.

    See Also
    --------
    hessian_trace_path : The same estimate at several points of the path.

    Notes
    -----
    For a Rademacher probe ``Var(v^T H v) = 2 sum_{i != j} H_ij^2``: the off-diagonal
    curvature sets the number of probes needed. ``stderr`` is the probes' standard
    deviation over ``sqrt(n_samples)``; their distribution is skewed, so that with a few
    tens of probes ``trace +- 1.96 stderr`` covers ``Tr H`` less often than 95%.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.diagnostics import hessian_trace
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=20, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> res = hessian_trace(est, n_samples=50, random_state=0)
    >>> res.estimates.shape, res.step, bool(res.trace > 0), bool(res.stderr < res.trace)
    ((50,), 20, True, True)
    """
    # validate_params takes a bool for an int: step=True was the trace at point 1, where
    # kneighbors, the kernels and the displays refuse it.
    step = check_index(step, "step")
    estimator, X = pipeline_last_step(estimator, X)
    path = _hessian_traces(estimator, X, y, sample_weight, [step], n_samples, random_state,
                           batch_size)
    return path[0]


@validate_params(
    {**_COMMON_CONSTRAINTS, "steps": ["array-like", count(1), None]},
    prefer_skip_nested_validation=True,
)
def hessian_trace_path(estimator, X=None, y=None, *, sample_weight=None, steps=None,
                       n_samples=100, random_state=None, batch_size=None):
    """Trace of the training-loss Hessian along the recorded optimisation path.

    :func:`hessian_trace` at several recorded points, with the same probes at every point
    (so that the change along the path is estimated with less noise than the traces
    themselves). Cost: ``len(steps)`` times that of one :func:`hessian_trace`.

    Parameters
    ----------
    estimator, X, y, sample_weight, n_samples, random_state, batch_size
        As in :func:`hessian_trace`. The fit's weights are the same at every point:
        after a ``warm_start`` on the same data with other weights, the points
        recorded before it were trained under the previous fit's.
    steps : array-like of int, int or None, default=None
        Recorded points (0 is the initialization, negative indices count from the end).
        An int ``m``: ``m`` points evenly spaced from the first to the last (duplicates
        dropped). ``None``: every recorded point.

    Returns
    -------
    result : HessianTracePath
        Arrays ``trace``, ``stderr``, ``steps``, ``optimizer_steps`` (one entry per point)
        and ``estimates`` (points x probes); ``result[i]`` is point ``i`` as a
        :class:`HessianTrace`.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.diagnostics import hessian_trace_path
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=20, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> path = hessian_trace_path(est, steps=3, n_samples=20, random_state=0)
    >>> path.steps.tolist(), path.optimizer_steps.tolist(), path.trace.shape
    ([0, 10, 20], [0, 10, 20], (3,))
    """
    estimator, X = pipeline_last_step(estimator, X)
    check_is_fitted(estimator)
    steps = _steps_asked(steps, len(network_of(estimator).trajectory))
    return _hessian_traces(estimator, X, y, sample_weight, steps, n_samples,
                           random_state, batch_size)


@validate_params(
    {
        "estimator": _ESTIMATOR,
        "X": ["array-like", None],
        "y": ["array-like", "sparse matrix", None],
        "steps": ["array-like", count(1), None],
        "batch_size": [count(1), None],
    },
    prefer_skip_nested_validation=True,
)
def loss_path(estimator, X=None, y=None, *, steps=None, batch_size=None):
    """Per-sample training loss at recorded points of the optimisation path.

    ``l(y_i, f(x_i; theta_k))`` for every sample ``i`` and recorded point ``k``, with
    ``l`` the per-sample loss the estimator trains with (``estimator.loss``): the log loss
    of a classifier (binary cross-entropy on its one logit, softmax cross-entropy on
    several, summed over the labels of a multilabel one), ``1/2 mean_c (f_c - y_c)^2`` of a
    regressor, a :class:`~skpathkernel.RecordedNetwork`'s own loss. The data term only:
    L2 weight decay (``alpha``) is not included, and the losses are not weighted by
    ``sample_weight`` (a weighted fit minimised ``sum_i w_i l_i / sum_i w_i`` of these
    same ``l_i``).

    A regressor fitted with ``normalize_y=True`` trained on standardized targets
    ``(y - mean) / scale``, and its losses are in those units, as training minimised
    them: the squared error in the units of ``y`` divided by ``scale**2`` (per output).

    The path's statistics are "training dynamics" scores of the samples: the loss summed
    (or averaged) over the path ranks mislabeled training points (Pleiss et al. 2020's
    area under the margin; the mean and variability of the given label's probability,
    ``exp(-loss)`` for a single-label classifier, are Swayamdipta et al. 2020's dataset
    cartography). Cost: one forward pass per sample and point, no gradient.

    Parameters
    ----------
    estimator : fitted skpathkernel estimator
        As in :func:`hessian_trace` (a meta-estimator stands for its ``estimator_``, a
        ``FrozenEstimator`` for the estimator it holds, a
        :class:`~skpathkernel.RecordedNetwork` for the network it holds, with its
        ``loss``, a fitted Pipeline for its last step on transformed inputs, a refitted
        search for its ``best_estimator_``). The network is evaluated as it is, with the
        parameters of each recorded point; the estimator is not modified.
    X : array-like of shape (n_samples_X, n_features) or (n_samples_X, ...), default=None
        Inputs, in the form of the training inputs. ``None``: the training inputs
        ``X_fit_``, whose rows are those of the ``X`` given to ``fit``
        mapped by ``train_indices_`` (they differ where ``early_stopping`` held rows out).
    y : array-like of shape (n_samples_X,) or (n_samples_X, n_outputs), default=None
        Targets, encoded as ``fit`` encodes them (classifiers map labels through
        ``classes_``; a label not seen in ``fit`` is an error; a multilabel classifier's
        indicator may be sparse, as in its ``fit``; a regressor's are standardized as its
        fit's were). Required with ``X``; ``None`` with ``X=None``: the training targets.
    steps : array-like of int, int or None, default=None
        Recorded points (0 is the initialization, negative indices count from the end).
        An int ``m``: ``m`` points evenly spaced from the first to the last (duplicates
        dropped). ``None``: every recorded point.
    batch_size : int, default=None
        Samples per forward pass. ``None``: as many as the estimator's ``memory_budget``
        allows.

    Returns
    -------
    losses : ndarray of shape (n_samples_X, n_steps), dtype float64
        ``losses[i, j]``: the loss of sample ``i`` at the ``j``-th point of ``steps``,
        computed in the network's dtype.

    See Also
    --------
    hessian_trace_path : The curvature of the mean training loss along the path.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.datasets import load_breast_cancer
    >>> from sklearn.preprocessing import StandardScaler
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.diagnostics import loss_path
    >>> X, y = load_breast_cancer(return_X_y=True)
    >>> X = StandardScaler().fit_transform(X[:200]); y = y[:200].copy()
    >>> y[:10] = 1 - y[:10]                       # ten flipped labels
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(16,), max_iter=50, tol=None,
    ...                            random_state=0).fit(X, y)
    >>> losses = loss_path(clf)                   # one row per row of clf.X_fit_
    >>> losses.shape == (len(clf.X_fit_), len(clf.trajectory_))
    True
    >>> suspects = clf.train_indices_[losses.sum(axis=1).argsort()[::-1][:10]]
    >>> int(np.isin(suspects, np.arange(10)).sum())   # flipped ones among the top 10
    9
    """
    estimator, X = pipeline_last_step(estimator, X)
    check_is_fitted(estimator)
    steps = _steps_asked(steps, len(network_of(estimator).trajectory))
    return _loss_path(estimator, X, y, steps, batch_size)


# --------------------------------------------------------------------------- engine
def _steps_asked(steps, n_points: int) -> list:
    """The ``steps`` parameter of the path functions as a list of ints (not yet checked
    against ``n_points``, which the engines do with the other input)."""
    if steps is None:
        return list(range(n_points))
    if isinstance(steps, numbers.Integral):
        return list(np.unique(np.round(np.linspace(0, n_points - 1, int(steps)))
                              .astype(np.int64)))
    if np.ndim(steps) != 1:  # column_or_1d's message would call it y
        raise ValueError(f"steps must be a 1-D sequence of integers, got shape "
                         f"{np.shape(steps)}.")
    steps = column_or_1d(check_array(steps, ensure_2d=False, dtype=None))
    if steps.size == 0 or not np.issubdtype(steps.dtype, np.integer):
        raise ValueError(f"steps must be a non-empty sequence of integers, got {steps!r}.")
    return list(steps)


def _points(steps, traj) -> list[int]:
    """``steps`` as non-negative indices of ``traj``'s recorded points."""
    points = []
    for s in steps:
        s = int(s)
        if not -len(traj) <= s < len(traj):
            raise IndexError(f"step {s} is out of range for {len(traj)} recorded points.")
        points.append(s % len(traj))
    return points


@runs_module(lambda estimator: network_of(estimator).module, check=warn_drawing_now)
def _loss_path(estimator, X, y, steps, batch_size) -> np.ndarray:
    net = network_of(estimator)
    traj = net.trajectory
    points = _points(steps, traj)
    Xt, Yt, _ = _data(estimator, net, X, y, None)
    net._check_loss(Xt, Yt)  # a user's loss, on the outputs flattened per sample
    # The loss the network was fitted with, not the current parameter (see set_params).
    loss = net.loss
    n = Xt.shape[0]
    block = batch_size or int(min(max(n, 1), output_block_rows(
        net.memory_budget, _widths(net, Xt), net.torch_dtype, fixed=False)))
    losses = np.empty((n, len(points)), dtype=np.float64)
    with torch.no_grad():
        for j, k in enumerate(points):
            # The network's dtype, not X's: token ids are int64.
            params = traj.unflatten(traj.parameters(k).to(device=Xt.device,
                                                          dtype=net.torch_dtype))
            for start in range(0, n, block):
                xb, yb = Xt[start : start + block], Yt[start : start + block]
                f = functional_call(net.module, params, (forward_input(xb),)).reshape(len(xb), -1)
                losses[start : start + len(xb), j] = (
                    loss.per_sample(f, yb).to(torch.float64).cpu().numpy())
    return losses


@runs_module(lambda estimator: network_of(estimator).module, check=warn_drawing_now)
def _hessian_traces(estimator, X, y, sample_weight, steps, n_samples, random_state,
                    batch_size):
    check_is_fitted(estimator)
    net = network_of(estimator)
    # An embedding's max_norm would rewrite the recorded parameters in place, and its
    # scale_grad_by_freq make a backward that is not the loss's derivative.
    check_lookups(net.module)
    traj = net.trajectory
    points = _points(steps, traj)
    Xt, Yt, weights = _data(estimator, net, X, y, sample_weight)
    net._check_loss(Xt, Yt)  # a user's loss, on the outputs flattened per sample
    # The network's loss is the one it was fitted with, not the current parameter, which
    # set_params may have changed since.
    loss = net.loss
    block = batch_size or _default_batch_size(net, Xt)
    # One seed, one probe sequence: the same probes at every point and for every batch, so
    # that batching changes nothing but round-off.
    seed = int(check_random_state(random_state).randint(np.iinfo(np.int32).max))
    estimates = np.zeros((len(points), n_samples), dtype=np.float64)
    # The same flag on a functional lookup of a parameter (F.embedding in a forward).
    check_functional_lookups(net.module, traj.unflatten(traj.parameters(points[0]).to(
        device=Xt.device, dtype=net.torch_dtype)), Xt[:2])
    # The network's dtype, not X's: token ids are int64.
    for row, k in zip(estimates, points):
        theta = traj.parameters(k).to(device=Xt.device, dtype=net.torch_dtype)
        row[:] = _quadratic_forms(net.module, traj, theta, Xt, Yt, weights, loss, block,
                                  seed, n_samples)
    se = (estimates.std(axis=1, ddof=1) / np.sqrt(n_samples) if n_samples > 1
          else np.full(len(points), np.nan))
    points = np.asarray(points, dtype=np.int64)
    return HessianTracePath(
        trace=estimates.mean(axis=1), stderr=se, estimates=estimates, steps=points,
        optimizer_steps=np.asarray(traj.steps)[points],
    )


def _quadratic_forms(module, traj, theta, X, Y, weights, loss, block, seed,
                     n_samples) -> np.ndarray:
    """``v_j^T H v_j`` for every probe, summed over batches of ``block`` samples.
    ``weights``: the samples' weights divided by their sum (None: the plain mean)."""
    n = X.shape[0]
    # Accumulated on the device, in float64 whatever the network's dtype: one host sync at
    # the end rather than one per probe and batch.
    out = torch.zeros(n_samples, dtype=torch.float64, device=X.device)
    # A fresh leaf: gradients flow to it through the views unflatten makes, and nothing
    # reaches module_ (whose parameters functional_call only replaces for this call).
    theta = theta.detach().clone().requires_grad_(True)
    params = dict(traj.unflatten(theta))
    with torch.enable_grad(), twice_differentiable():
        for start in range(0, n, block):
            xb, yb = X[start : start + block], Y[start : start + block]
            # sum / n, not mean: the batches' Hessians then add up to that of the mean loss.
            # Outputs flattened per sample (n, C), as every loss is called.
            f = functional_call(module, params, (forward_input(xb),)).reshape(len(xb), -1)
            per_sample = loss.per_sample(f, yb)
            batch_loss = (per_sample.sum() / n if weights is None
                          else (per_sample * weights[start : start + block]).sum())
            # A seed that requires grad: a @once_differentiable backward then leaves the
            # node check_twice_differentiable finds (with a plain seed torch differentiates
            # around it, and the probes would miss that layer's part without a word).
            seed_one = torch.ones((), dtype=batch_loss.dtype, device=batch_loss.device,
                                  requires_grad=True)
            (grad,) = torch.autograd.grad(batch_loss, theta, grad_outputs=seed_one,
                                          create_graph=True)
            if start == 0:
                check_twice_differentiable(grad)
            for j, v in enumerate(_rademacher(seed, n_samples, theta)):
                (hv,) = torch.autograd.grad(grad, theta, grad_outputs=v, retain_graph=True)
                out[j] += torch.dot(v, hv).to(torch.float64)
    return out.cpu().numpy()


def _rademacher(seed: int, n_samples: int, like: torch.Tensor) -> Iterator[torch.Tensor]:
    """The probe sequence of ``seed``: drawn on the CPU, one at a time (memory O(P))."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n_samples):
        signs = torch.randint(0, 2, like.shape, generator=generator, dtype=torch.int8)
        yield (2 * signs - 1).to(device=like.device, dtype=like.dtype)


def _default_batch_size(net, X: torch.Tensor) -> int:
    # Double backward keeps each layer's activations, their gradients and the second-order
    # graph over them: budget ~16 values per sample per unit, as _forward budgets 8. In
    # the network's dtype (the fitted one, not the dtype parameter of a next fit).
    itemsize = torch.empty((), dtype=net.torch_dtype).element_size()
    width = sum(_widths(net, X))
    return int(min(len(X), rows_per_block(net.memory_budget, 16 * width * itemsize,
                                          "hessian_trace")))


def _widths(net, X: torch.Tensor) -> list[int]:
    """Values per sample of the input and of every activation, the block sizes' measure.

    Measured on ``X`` where the network keeps no training inputs (a recorded loop's):
    without it ``activation_widths`` fails on anything but 2-D features."""
    if not len(X):
        return [1]
    return [X[0].numel(), *net.activation_widths(X[:1].cpu().numpy())]


def _data(estimator, net, X, y, sample_weight):
    """Inputs and encoded targets as tensors on the network's device and dtype, and the
    samples' weights divided by their sum (None: the plain mean)."""
    if X is None and y is None:
        # Loaded where its directory was not: say so, and how to relocate, rather than
        # fail on the missing training set.
        net._check_fit_read()
        X, Xt, Yt = net.X_fit, net.tensor(net.X_fit), net.targets()
        weights = net.sample_weight if sample_weight is None else sample_weight
    elif X is None or y is None:
        raise ValueError(
            "Pass both X and y (the loss needs targets), or neither to use the training "
            "data."
        )
    elif isinstance(estimator, RecordedNetwork):
        # A user's loop: X in the network's input form, y as its y_train was given (in the
        # terms of its loss), with no estimator's encoding to apply.
        X = net.check(X)
        Y = _as_array(y, "y")
        check_consistent_length(X, Y)
        Xt, Yt, weights = net.tensor(X), net.replace(y_fit=Y).targets(), sample_weight
    else:
        X, Y = data_like_fit(estimator, X, y)
        Xt, Yt, weights = net.tensor(X), net.replace(y_fit=Y).targets(), sample_weight
    # fit's checks: one finite non-negative weight per sample, not all 0; equal weights
    # are the plain mean and take its code path.
    weights = _check_weights(weights, X)
    if weights is not None:
        # Normalized in float64, then in the network's dtype as its losses are.
        weights = torch.as_tensor(weights / weights.sum(), dtype=net.torch_dtype,
                                  device=Xt.device)
    return Xt, Yt, weights
