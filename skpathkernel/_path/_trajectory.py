"""The recorded optimisation path of a trained network.

A :class:`Trajectory` holds everything the kernels and the exact decomposition need to
replay training without re-running it: the parameters at every recorded point, the step
sizes, the sample indices of every optimizer step's batch and the optimizer state (Adam /
RMSprop second moments, momentum buffers) at every recorded step.

Everything lives on the CPU in the parameter dtype, in buffers preallocated at the start
of training, so that recording a point costs one copy and no allocation; or, for paths
longer than memory allows, the per-point vectors live in chunk files on disk, read
lazily behind the same accessors (:mod:`skpathkernel._path._storage`).
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import shutil
import stat
import struct
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .._validation import check_index
from .._warnings import VersionedStateMixin
from ._buffers import Segments, TailedRows, compact, dense, mapped_empty
from ._storage import (
    CHUNK_BYTES,
    META_FILE,
    ChunkStore,
    DiskRows,
    Series,
    TrajectoryFileError,
    chunk_rows_for,
    dtype_name,
    open_shared,
    populate,
    replace_durably,
    share_arrays,
)

__all__ = ["Trajectory"]

_FORMAT_VERSION = 1

# What a recorder may know beyond the plain update rule, each None by default: saved,
# loaded and pickled alike (a path saved or pickled before one existed reads None).
_EXTRAS = ("gradient_scales", "batch_weights", "group_lrs", "param_groups",
           "group_weight_decays", "step_lrs", "step_group_lrs", "pools", "pool_weights")

# Optimizer state recorded per solver, named as torch.optim names it: the second moments
# that define the preconditioner D_t. First moments and momentum buffers are not stored:
# with every step recorded they follow from consecutive points (heavy-ball SGD: buf_t =
# -(theta_{t+1} - theta_t) / lr; Nesterov: that minus the step's gradient, over the
# momentum), and neither the kernels nor the decomposition need them, so storing them
# would only double the recording cost.
SOLVER_STATE_KEYS = {
    "sgd": (),
    "adam": ("exp_avg_sq",),
    "adamw": ("exp_avg_sq",),
    "rmsprop": ("square_avg",),
}


class UnpicklingError(pickle.UnpicklingError, ValueError):
    """A file that ``torch.load(weights_only=True)`` refused: ``pickle``'s
    UnpicklingError, as torch raises it, and a ValueError as every other file that is not
    a trajectory (an ``except ValueError`` around ``Trajectory.load`` let it through)."""


@dataclass(frozen=True)
class SolverSpec:
    """The optimizer that produced a trajectory, with torch.optim's hyper-parameters.

    ``weight_decay`` is L2 added to the gradient for sgd/adam/rmsprop and decoupled
    (``theta <- theta - lr * weight_decay * theta``) for adamw, as in torch.optim.
    """

    name: str
    momentum: float = 0.0
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8
    rmsprop_alpha: float = 0.99
    weight_decay: float = 0.0
    # SGD's Nesterov momentum (torch.optim.SGD(nesterov=True)); only with momentum > 0.
    nesterov: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "momentum": float(self.momentum),
            "beta_1": float(self.beta_1),
            "beta_2": float(self.beta_2),
            "epsilon": float(self.epsilon),
            "rmsprop_alpha": float(self.rmsprop_alpha),
            "weight_decay": float(self.weight_decay),
            "nesterov": bool(self.nesterov),
        }

    @property
    def state_keys(self) -> tuple[str, ...]:
        return SOLVER_STATE_KEYS[self.name]


class Trajectory(VersionedStateMixin):
    """The recorded optimisation path of a network trained by a torch optimizer.

    Point ``k`` (``0 <= k < len(self)``) is the parameter vector after optimizer step
    ``steps[k]``; point 0 is the initialization and point -1 the end of training. The step
    from point ``k`` to point ``k + 1`` used the step size ``learning_rates[k]`` and, for
    solvers with state, the optimizer state ``optimizer_state(k)`` *after* the first
    optimizer step taken from point ``k`` (the state that scaled that step).

    Trajectories are built by the estimators (``est.trajectory_``) and by
    :class:`~skpathkernel.PathRecorder` for your own loop; users read them, save
    them with :meth:`save` and load them with :meth:`load`.

    Parameters
    ----------
    names : sequence of str
        The parameter tensors' names, in flat order (``module.named_parameters()``).
    shapes : sequence of sequence of int
        Their shapes, in the same order.
    params : torch.Tensor of shape (n_points, n_params)
        The flat parameter vector at every recorded point (or on-disk rows of it).
    steps : array-like of int of shape (n_points,)
        See ``steps`` below.
    learning_rates : array-like of shape (n_points - 1,)
        See ``learning_rates`` below.
    batch_indices : array-like of int
        The sample indices of every optimizer step's batch, concatenated.
    batch_offsets : array-like of int of shape (n_steps + 1,)
        Step ``t``'s batch is ``batch_indices[batch_offsets[t]:batch_offsets[t + 1]]``.
    states : dict of str to torch.Tensor
        The solver's state (e.g. Adam's moments) at every point with a step leaving it,
        one flat row per point.
    state_steps : array-like of int of shape (n_points - 1,)
        The solver's step count in each of those states.
    solver : SolverSpec
        The optimizer's rule and hyper-parameters (given as :attr:`solver`'s name).
    n_samples : int
        See ``n_samples`` below.
    record_every : int
        See ``record_every`` below.
    gradient_scales : array-like of shape (n_steps,), default=None
        The factor each step's gradient was multiplied by (gradient clipping); None: 1.
    batch_weights : array-like, default=None
        The weight of every entry of ``batch_indices`` in its step's loss; None: the
        batch mean.
    group_lrs : array-like of shape (n_points - 1, n_groups), default=None
        Each optimizer parameter group's step size at each point (its mean over the
        interval's steps when it varies there); None: one step size.
    param_groups : sequence of int, default=None
        The group of each parameter tensor, in the order of ``names``.
    group_weight_decays : sequence of float, default=None
        Each group's weight decay; None: the solver's for every parameter.
    step_lrs : array-like of shape (n_steps,), default=None
        Every optimizer step's step size (the largest group's), kept where it varies
        inside a recorded interval; None: each step takes its interval's
        ``learning_rates[k]``. See ``step_learning_rates`` below.
    step_group_lrs : array-like of shape (n_steps, n_groups), default=None
        Every optimizer step's step size per parameter group, kept where one varies
        inside a recorded interval; None: each step takes its interval's ``group_lrs``.
    pools : array-like of int of shape (n_calls, 3), default=None
        The training rows each training call drew its batches from: row ``c`` is
        ``(first_step, start, stop)``, the call's first optimizer step and its rows
        ``start:stop`` of the training set (a ``warm_start`` fit or ``partial_fit`` on
        new data appends its rows after the earlier ones). The estimators record them;
        None (a :class:`~skpathkernel.PathRecorder` loop, a path saved before they were
        kept): every step drew from all ``n_samples``. See :meth:`pool`.
    pool_weights : array-like of shape (sum of the pools' sizes,), default=None
        Each pool's ``sample_weight``, concatenated in the order of ``pools`` (an
        unweighted call's rows 1); None: every call unweighted.

    Attributes
    ----------
    steps : ndarray of shape (n_points,)
        Optimizer step index of each recorded point (0 for the initialization).
    learning_rates : ndarray of shape (n_points - 1,)
        Entry ``k``: the step size of the optimizer steps from point ``k`` to ``k + 1``
        (their mean when a learning-rate scheduler changed it between two recorded
        points, so that ``learning_rates[k] * (steps[k + 1] - steps[k])`` is the
        interval's total step size; with ``record_every=1`` it is each step's own).
    step_learning_rates : ndarray of shape (n_steps,)
        Each optimizer step's own step size (read-only property), recorded or not: the
        scheduler's value inside a thinned interval (``record_every > 1``), which the
        unrolled attribution replays. A path saved before these were kept gives its
        interval's ``learning_rates[k]`` for each step.
    solver : str
        ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"rmsprop"``.
    n_samples : int
        Number of training samples the batches index into.
    record_every : int
        Points are recorded every ``record_every`` optimizer steps (plus the last one).

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, tol=None,
    ...                         random_state=0).fit(X, y)
    >>> traj = est.trajectory_
    >>> len(traj), int(traj.steps[-1])
    (6, 5)
    >>> sorted(traj.state_dict(-1))[:2]
    ['0.bias', '0.weight']
    """

    def __init__(
        self,
        *,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        params: torch.Tensor,
        steps: np.ndarray,
        learning_rates: np.ndarray,
        batch_indices: np.ndarray,
        batch_offsets: np.ndarray,
        states: dict[str, torch.Tensor],
        state_steps: np.ndarray,
        solver: SolverSpec,
        n_samples: int,
        record_every: int,
        gradient_scales: np.ndarray | None = None,
        batch_weights: np.ndarray | None = None,
        group_lrs: np.ndarray | None = None,
        param_groups: Sequence[int] | None = None,
        group_weight_decays: Sequence[float] | None = None,
        step_lrs: np.ndarray | None = None,
        step_group_lrs: np.ndarray | None = None,
        pools: np.ndarray | None = None,
        pool_weights: np.ndarray | None = None,
    ):
        self._names = tuple(names)
        self._shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self._params = params
        self.steps = np.asarray(steps, dtype=np.int64)
        self.learning_rates = np.asarray(learning_rates, dtype=np.float64)
        self._batch_indices = np.asarray(batch_indices, dtype=np.int64)
        self._batch_offsets = np.asarray(batch_offsets, dtype=np.int64)
        self._states = dict(states)
        self._state_steps = np.asarray(state_steps, dtype=np.int64)
        self.solver_spec = solver
        self.n_samples = int(n_samples)
        self.record_every = int(record_every)
        # Set here, not by _attach: the recorder's finish() knows them, PathRecorder's
        # _attach (the group step sizes) must not reset them.
        self._step_lrs = None if step_lrs is None else np.asarray(step_lrs, np.float64)
        self._pools = None if pools is None else np.asarray(pools, np.int64).reshape(-1, 3)
        self._pool_weights = (None if pool_weights is None
                              else np.asarray(pool_weights, np.float64))
        self._attach(gradient_scales=gradient_scales, batch_weights=batch_weights,
                     group_lrs=group_lrs, param_groups=param_groups,
                     group_weight_decays=group_weight_decays,
                     step_group_lrs=step_group_lrs)

    def _attach(self, *, gradient_scales=None, batch_weights=None, group_lrs=None,
                param_groups=None, group_weight_decays=None,
                step_group_lrs=None) -> Trajectory:
        """Set what a recorder knows beyond the plain update rule (None: the default).

        ``group_lrs`` holds each interval's mean step size per group (the first step's
        where they do not vary), ``step_group_lrs`` every step's, (n_steps, n_groups),
        kept only where some group's varies inside an interval."""
        self._gradient_scales = (None if gradient_scales is None
                                 else np.asarray(gradient_scales, dtype=np.float64))
        self._batch_weights = (None if batch_weights is None
                               else np.asarray(batch_weights, dtype=np.float64))
        self._group_lrs = None if group_lrs is None else np.asarray(group_lrs, np.float64)
        self._step_group_lrs = (None if step_group_lrs is None
                                else np.asarray(step_group_lrs, np.float64))
        self._param_groups = None if param_groups is None else tuple(int(g) for g in
                                                                     param_groups)
        self._group_weight_decays = (None if group_weight_decays is None else
                                     np.asarray(group_weight_decays, dtype=np.float64))
        self._check_consistent()
        return self

    def _check_consistent(self) -> None:
        """Raise a ValueError naming the first array whose shape or values do not fit
        the others: a path built by hand or read from an altered file would otherwise
        fail later, in the middle of an analysis, with an IndexError or a wrong sum."""
        n_points, n_params = (tuple(self._params.shape) + (None, None))[:2]
        size = sum(int(np.prod(s, dtype=np.int64)) for s in self._shapes)
        if len(self._names) != len(self._shapes) or size != n_params:
            raise ValueError(
                f"names ({len(self._names)}) and shapes ({len(self._shapes)}, {size} "
                f"values) must describe the {n_params} columns of params, one name per "
                "shape.")
        if n_points is None or n_points < 1:
            raise ValueError("params must hold at least one point, (n_points, n_params).")
        offsets, indices = self._batch_offsets, self._batch_indices
        n_steps = len(offsets) - 1
        if (offsets.ndim != 1 or n_steps < 0 or offsets[0] != 0
                or np.any(np.diff(offsets) < 0) or offsets[-1] != len(indices)):
            raise ValueError(
                "batch_offsets must be non-decreasing from 0 to len(batch_indices) "
                f"({len(indices)}), one entry per optimizer step and one more.")
        if len(indices) and (indices.min() < 0 or indices.max() >= self.n_samples):
            raise ValueError(
                f"batch_indices must index into the n_samples={self.n_samples} training "
                f"samples; they span [{indices.min()}, {indices.max()}].")
        steps = self.steps
        if (steps.shape != (n_points,) or steps[0] != 0 or np.any(np.diff(steps) <= 0)
                or steps[-1] != n_steps):
            raise ValueError(
                f"steps must increase from 0 to the {n_steps} optimizer steps of "
                f"batch_offsets, one entry per recorded point ({n_points}).")
        n_groups = None if self._group_lrs is None else self._group_lrs.shape[-1]
        expected = {
            "learning_rates": (self.learning_rates, (n_points - 1,)),
            "state_steps": (self._state_steps, (n_points - 1,)),
            "gradient_scales": (self._gradient_scales, (n_steps,)),
            "batch_weights": (self._batch_weights, (len(indices),)),
            "step_lrs": (self._step_lrs, (n_steps,)),
            "group_lrs": (self._group_lrs, (n_points - 1, n_groups)),
            # Without group_lrs (a recorder's path before its first step) the number of
            # groups is not known here.
            "step_group_lrs": (self._step_group_lrs,
                               None if n_groups is None else (n_steps, n_groups)),
            "group_weight_decays": (self._group_weight_decays,
                                    None if n_groups is None else (n_groups,)),
            **{f"states[{key!r}]": (rows, (n_points - 1, n_params))
               for key, rows in self._states.items()},
        }
        for name, (value, shape) in expected.items():
            if value is None or shape is None or tuple(value.shape) == shape:
                continue
            where = (" (with parameter groups: n_groups from group_lrs)"
                     if n_groups is not None and n_groups in shape else "")
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; this path of {n_points} recorded "
                f"points and {n_steps} optimizer steps needs {shape}{where}.")
        self._check_pools(n_steps)
        groups = self._param_groups
        if groups is not None and (len(groups) != len(self._names) or (
                n_groups is not None and any(not 0 <= g < n_groups for g in groups))):
            raise ValueError(
                f"param_groups must give one group in [0, {n_groups}) per parameter "
                f"tensor ({len(self._names)}); got {list(groups)}.")

    def _check_pools(self, n_steps: int) -> None:
        """Refuse pools that do not cover the steps from step 0 in order, or rows
        outside the training set, or weights that do not fit them."""
        pools, weights = self._pools, self._pool_weights
        if pools is None:
            if weights is not None:
                raise ValueError("pool_weights needs the pools they weigh.")
            return
        first, start, stop = pools.T
        if (not len(pools) or first[0] != 0 or np.any(np.diff(first) < 0)
                or first[-1] > n_steps or np.any(start < 0) or np.any(stop <= start)
                or np.any(stop > self.n_samples)):
            raise ValueError(
                "pools must hold one (first_step, start, stop) row per training call, "
                f"first steps non-decreasing from 0 to at most n_steps={n_steps}, and "
                f"non-empty row ranges within the n_samples={self.n_samples} training "
                f"samples; got {pools.tolist()}.")
        if weights is not None:
            size = int((stop - start).sum())
            bounds = np.concatenate([[0], np.cumsum(stop - start)])
            if (weights.shape != (size,) or not np.all(np.isfinite(weights))
                    or np.any(weights < 0)
                    or np.any(np.add.reduceat(weights, bounds[:-1]) <= 0)):
                raise ValueError(
                    f"pool_weights must hold one finite, non-negative weight per row of "
                    f"the pools ({size}), not all 0 in any pool; got shape "
                    f"{weights.shape}.")

    # ------------------------------------------------------------------ storage
    @property
    def storage(self) -> str:
        """``"memory"``, or ``"disk"`` for a trajectory read lazily from chunk files."""
        return "disk" if isinstance(self._params, DiskRows) else "memory"

    @property
    def directory(self) -> str | None:
        """The directory of an on-disk trajectory (None in memory).

        A temporary directory (the estimators' and :class:`~skpathkernel.PathRecorder`'s
        own, under ``trajectory_dir`` / ``directory``) is deleted with the last object
        using it; :meth:`save` moves it elsewhere and keeps it.
        """
        return self._params.series.store.directory if self.storage == "disk" else None

    @property
    def compression(self) -> str | None:
        """``"float16"`` or ``"bfloat16"`` for an on-disk path whose points are stored as
        rounded steps (lossy, see ``trajectory_compression``); None when they are exact."""
        if self.storage != "disk" or self._params.series.delta_dtype is None:
            return None
        return dtype_name(self._params.series.delta_dtype)

    @property
    def _store(self):
        return self._params.series.store if self.storage == "disk" else None

    def _read(self, rows, k: int, what: str) -> torch.Tensor:
        try:
            return rows[k]
        except TrajectoryFileError as exc:
            step = int(self.steps[k]) if k < len(self.steps) else k
            raise TrajectoryFileError(
                f"Cannot read the {what} at recorded point {k} (optimizer step {step}): "
                f"{exc}") from None

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self._params.shape[0])

    def __repr__(self) -> str:
        where = "" if self.directory is None else f", directory={self.directory!r}"
        return (
            f"Trajectory(solver={self.solver!r}, n_points={len(self)}, "
            f"n_steps={self.n_steps}, n_params={self.n_params}, "
            f"nbytes={self.nbytes}{where})"
        )

    @property
    def solver(self) -> str:
        """Name of the optimizer: "sgd", "adam", "adamw" or "rmsprop"."""
        return self.solver_spec.name

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names, in ``module.named_parameters()`` order."""
        return self._names

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Parameter shapes, in the order of :attr:`names`."""
        return self._shapes

    @property
    def n_params(self) -> int:
        """Number of scalar parameters ``P``, the length of a flat parameter vector."""
        return int(self._params.shape[1])

    @property
    def n_steps(self) -> int:
        """Number of optimizer steps taken (recorded or not)."""
        return len(self._batch_offsets) - 1

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the recorded parameters."""
        return self._params.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the recorded path, in memory or on disk (see :attr:`storage`)."""
        arrays = [self.steps, self.learning_rates, self._batch_indices, self._batch_offsets,
                  *(a for a in (self._step_lrs, self._step_group_lrs, self._pools,
                                self._pool_weights) if a is not None)]
        return self._points_nbytes() + sum(a.nbytes for a in arrays)

    def _points_nbytes(self) -> int:
        """Bytes of the points (parameters and optimizer states): what
        ``record_every="auto"`` bounds by ``memory_budget`` in one fit."""
        tensors = [self._params, *self._states.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def batches(self) -> list[np.ndarray]:
        """Sample indices of the batch of every optimizer step (``n_steps`` arrays)."""
        idx, off = self._batch_indices, self._batch_offsets
        return [idx[off[t] : off[t + 1]] for t in range(self.n_steps)]

    def batch(self, step: int) -> np.ndarray:
        """Sample indices of the batch used by optimizer step ``step``.

        Parameters
        ----------
        step : int
            Optimizer step, ``0 <= step < n_steps``; negative values count from the end.

        Returns
        -------
        indices : ndarray of int of shape (batch_size,)
            Indices into the training set.
        """
        step = check_index(step, "step", n=self.n_steps)
        return self._batch_indices[self._batch_offsets[step] : self._batch_offsets[step + 1]]

    @property
    def gradient_scales(self) -> np.ndarray:
        """The factor each optimizer step's gradient was multiplied by, (n_steps,).

        1 for a step taken with the loss's gradient; ``max_norm / (norm + 1e-6)`` for a
        step whose gradient ``torch.nn.utils.clip_grad_norm_`` clipped (recorded by
        :class:`~skpathkernel.PathRecorder`). Weight decay is not scaled: torch.optim
        adds it after clipping.
        """
        if self._gradient_scales is None:
            return np.ones(self.n_steps)
        return self._gradient_scales[: self.n_steps]

    @property
    def step_learning_rates(self) -> np.ndarray:
        """Each optimizer step's step size, (n_steps,) float64.

        With ``record_every=1``, ``learning_rates``. On a thinned path, the step size
        each step took, kept when a schedule (``learning_rate="invscaling"`` or
        ``"adaptive"``, a torch learning-rate scheduler under
        :class:`~skpathkernel.PathRecorder`) changed it between two recorded points;
        otherwise, and on paths saved before they were kept, each step's interval's
        ``learning_rates[k]``. With parameter groups, the largest group's.
        """
        if self._step_lrs is not None:
            return self._step_lrs[: self.n_steps]
        return np.repeat(self.learning_rates, np.diff(self.steps))

    def _step_size_scales_at(self, t: int, k: int) -> torch.Tensor | None:
        """:meth:`step_size_scales` of optimizer step ``t`` (in the interval leaving
        point ``k``): its own groups' step sizes over :attr:`step_learning_rates` where
        they were kept, else the interval's."""
        if self._step_group_lrs is None:
            return self.step_size_scales(k)
        return self._group_scales(self._step_group_lrs[t], float(self.step_learning_rates[t]))

    def _group_scales(self, lrs: np.ndarray, ref: float) -> torch.Tensor | None:
        """Each parameter's group step size ``lrs[g]`` over ``ref`` (None: all equal)."""
        if np.all(lrs == ref):
            return None
        scales = lrs / ref if ref else np.zeros_like(lrs)
        return self._per_parameter(scales[list(self._param_groups)])

    def batch_weights(self, step: int) -> np.ndarray:
        """The weight of each sample of :meth:`batch` in the step's loss.

        ``1 / batch_size`` for a loss that averages over its batch; under
        DistributedDataParallel with shards of different sizes, ``1 / (n_ranks *
        shard_size)`` for each sample of a shard (DDP averages the ranks' mean losses);
        a recorded loop's own coefficients where it declared them
        (:meth:`PathRecorder.set_batch <skpathkernel.PathRecorder.set_batch>`'s
        ``weights``): the step's gradient is ``sum_i weights[i] grad l_i``.

        Parameters
        ----------
        step : int
            Optimizer step, ``0 <= step < n_steps``; negative values count from the end.

        Returns
        -------
        weights : ndarray of shape (batch_size,)
            One weight per index of :meth:`batch`, in its order.
        """
        step = check_index(step, "step", n=self.n_steps)
        start, stop = self._batch_offsets[step], self._batch_offsets[step + 1]
        if self._batch_weights is None:
            return mean_batch_weights(self._batch_offsets[step : step + 2])
        return self._batch_weights[start:stop]

    def pool(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The training points optimizer step ``step`` drew its batch from, and each
        one's expected weight in the step's gradient.

        The pool is the data of the training call that took the step (``fit``,
        ``partial_fit``, a ``warm_start`` fit on other data: its rows of the training
        set, see ``pools``); a point's expected weight is its probability of being in
        the batch times its weight in the batch's loss, ``w_i / sum_pool w`` under the
        call's ``sample_weight``, ``1 / |pool|`` without. A path whose pools were not
        recorded (a :class:`~skpathkernel.PathRecorder` loop) draws from all
        ``n_samples`` points, each ``1 / n_samples``. These are the weights of
        ``decompose(weighting="expected")``.

        Parameters
        ----------
        step : int
            Optimizer step, ``0 <= step < n_steps``; negative values count from the end.

        Returns
        -------
        indices : ndarray of int
            The pool's rows of the training set, increasing.
        weights : ndarray of float64
            Their expected weights, summing to 1.
        """
        step = check_index(step, "step", n=self.n_steps)
        if self._pools is None:
            return np.arange(self.n_samples), np.full(self.n_samples, 1.0 / self.n_samples)
        # The last call starting at or before the step (a call that took no step shares
        # its first step with the next one).
        c = int(np.searchsorted(self._pools[:, 0], step, side="right")) - 1
        start, stop = (int(v) for v in self._pools[c, 1:])
        if self._pool_weights is None:
            return np.arange(start, stop), np.full(stop - start, 1.0 / (stop - start))
        offset = int((self._pools[:c, 2] - self._pools[:c, 1]).sum())
        w = self._pool_weights[offset : offset + stop - start]
        return np.arange(start, stop), w / w.sum()

    def _all_pools(self) -> tuple[np.ndarray, np.ndarray]:
        """``pools`` and ``pool_weights``, one pool of all rows and unit weights where
        they are None."""
        pools = (np.array([[0, 0, self.n_samples]], dtype=np.int64) if self._pools is None
                 else self._pools)
        weights = (np.ones(int((pools[:, 2] - pools[:, 1]).sum()))
                   if self._pool_weights is None else self._pool_weights)
        return pools, weights

    def _all_batch_weights(self) -> np.ndarray:
        """:meth:`batch_weights` of every step, concatenated (as ``batch_indices``)."""
        if self._batch_weights is not None:
            return self._batch_weights
        return mean_batch_weights(self._batch_offsets)

    def _per_parameter(self, values) -> torch.Tensor:
        """One value per parameter tensor (its group's), repeated over its entries."""
        sizes = [int(np.prod(s)) for s in self._shapes]
        return torch.repeat_interleave(torch.as_tensor(values, dtype=torch.float64),
                                       torch.as_tensor(sizes))

    def step_size_scales(self, k: int) -> torch.Tensor | None:
        """Each parameter's step size relative to ``learning_rates[k]``, (P,) float64.

        None when every parameter takes ``learning_rates[k]`` (one parameter group, or
        groups with one step size). With optimizer parameter groups of their own step
        sizes, ``learning_rates[k]`` is the largest and each parameter's scale is its
        group's step size over it (included in :meth:`preconditioner`).

        Parameters
        ----------
        k : int
            Recorded point the step leaves, ``0 <= k < len(self) - 1``; negative values
            count from the end.

        Returns
        -------
        scales : torch.Tensor of shape (n_params,) or None
            The scales, in the order of :attr:`names`.
        """
        # Checked first: a path of one step size answered None for any k, 99 and "0"
        # included, where one of several step sizes refused them.
        k = check_index(k, "step point", n=len(self) - 1)
        if self._group_lrs is None:
            return None
        return self._group_scales(self._group_lrs[k], float(self.learning_rates[k]))

    def weight_decays(self) -> torch.Tensor | None:
        """Each parameter's weight decay, (P,) float64; None when all take the solver's.

        Returns
        -------
        decays : torch.Tensor of shape (n_params,) or None
            Every parameter's weight decay (its optimizer group's), in the order of
            :attr:`names`; None when every group takes the solver's.
        """
        if self._group_weight_decays is None:
            return None
        return self._per_parameter(self._group_weight_decays[list(self._param_groups)])

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Names of the recorded optimizer state tensors (empty for SGD)."""
        return tuple(self._states)

    def _point(self, k: int) -> int:
        return check_index(k, "point", n=len(self))

    def parameters(self, k: int = -1) -> torch.Tensor:
        """Flat parameter vector (P,) at point ``k`` (a read-only view: clone to modify).

        Parameters
        ----------
        k : int, default=-1
            Recorded point, ``0 <= k < len(self)``; negative values count from the end.

        Returns
        -------
        params : torch.Tensor of shape (n_params,)
            The parameters, in the order of :attr:`names`.
        """
        return self._read(self._params, self._point(k), "parameters")

    def state_dict(self, k: int = -1) -> OrderedDict[str, torch.Tensor]:
        """The module's parameters at point ``k``, loadable with ``load_state_dict``.

        Only the recorded parameters are included: those the optimizer trained, not the
        buffers (BatchNorm's running statistics) nor parameters frozen with
        ``requires_grad=False``, which the path never moves. Load with ``strict=False``
        into a module that holds either.

        Parameters
        ----------
        k : int, default=-1
            Recorded point, ``0 <= k < len(self)``; negative values count from the end.

        Returns
        -------
        state_dict : OrderedDict of str to torch.Tensor
            Parameter name to a copy of the parameter.
        """
        return OrderedDict(zip(self._names, self._unflatten(self.parameters(k).clone())))

    def optimizer_state(self, k: int = -1) -> dict[str, torch.Tensor]:
        """Flat optimizer state tensors (P,) that scaled the step leaving point ``k``.

        Keys follow torch.optim: ``exp_avg_sq`` (Adam, AdamW), ``square_avg`` (RMSprop), none
        for SGD, plus ``"step"``, the optimizer's step count, as a scalar tensor. First
        moments and momentum buffers are not recorded: they follow from consecutive points.
        Valid for ``0 <= k < len(self) - 1``.

        Parameters
        ----------
        k : int, default=-1
            Recorded point the step leaves; negative values count from the end.

        Returns
        -------
        state : dict of str to torch.Tensor
            State name to a flat tensor of shape (n_params,), and ``"step"``.
        """
        k = check_index(k, "step point", n=len(self) - 1)
        out = {key: self._read(val, k, key) for key, val in self._states.items()}
        out["step"] = torch.tensor(float(self._state_steps[k]), dtype=torch.float64)
        return out

    def preconditioner(self, k: int = -1) -> torch.Tensor | None:
        """Diagonal ``D_k`` (P,) of the optimizer at the step leaving point ``k``.

        ``None`` for SGD (the identity). Adam / AdamW: ``1 / (sqrt(v_hat) + eps)`` with
        torch.optim's bias correction; RMSprop: ``1 / (sqrt(v) + eps)``. Times
        :meth:`step_size_scales` when parameter groups took their own step sizes.

        Parameters
        ----------
        k : int, default=-1
            Recorded point the step leaves; negative values count from the end.

        Returns
        -------
        diagonal : torch.Tensor of shape (n_params,) or None
            The diagonal, None for SGD with one step size for every parameter.
        """
        return self._preconditioner_into(k, None)

    def _preconditioner_into(self, k: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """:meth:`preconditioner`, written to ``out`` (P,) where its dtype and device are
        the optimizer state's (the same arithmetic in place): a walk over the steps
        reuses one buffer instead of five fresh P-vectors a step."""
        scales = self.step_size_scales(k) if self._group_lrs is not None else None
        return self._preconditioner(k, scales, out)

    def _preconditioner(self, k: int, scales: torch.Tensor | None,
                        out: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`preconditioner` with ``scales`` (P,) in place of :meth:`step_size_scales`
        (None: the optimizer's diagonal alone): the path kernel weighs a step's gradient
        by the step sizes of the later updates that its momentum carries it into.
        ``out``: see :meth:`_preconditioner_into`."""
        spec = self.solver_spec
        if spec.name == "sgd":
            return None if scales is None else scales.to(self.dtype)
        state = self.optimizer_state(k)
        adam = spec.name in ("adam", "adamw")
        v = state["exp_avg_sq"] if adam else state["square_avg"]
        # One chain of in-place operations on a fresh vector or on ``out``: 1.0 / x is
        # x.reciprocal() * 1.0, the same numbers as torch.optim's.
        if out is not None and (out.shape, out.dtype, out.device) == (v.shape, v.dtype,
                                                                       v.device):
            denom = torch.sqrt(v, out=out)
        else:
            denom = v.sqrt()
        if adam:
            denom.div_((1.0 - spec.beta_2 ** float(state["step"])) ** 0.5)
        D = denom.add_(spec.epsilon).reciprocal_()
        return D if scales is None else D.mul_(scales.to(D.dtype))

    def step_coefficients(
        self, direct: bool = False
    ) -> tuple[np.ndarray, float] | tuple[np.ndarray, float, np.ndarray]:
        """The solver's first-moment recursion over the optimizer steps.

        Every supported solver's update is
        ``dtheta_t = -D_t (direct_t g_t + coef_t sum_{s<=t} memory^(t-s) g_s)`` (plus
        decoupled weight decay), ``g_s`` the step's gradient and ``D_t`` the
        :meth:`preconditioner`. ``direct_t`` is 0 but for SGD with Nesterov momentum,
        whose update ``-lr_t (g_t + momentum * buf_t)`` takes the step's own gradient
        once outside the momentum buffer ``buf_t = sum_{s<=t} momentum^(t-s) g_s``.

        Parameters
        ----------
        direct : bool, default=False
            Also return ``direct``. A Nesterov path has no ``(coef, memory)`` form, so
            without it a Nesterov path raises rather than return a recursion that
            misses its steps.

        Returns
        -------
        coef : ndarray of shape (n_steps,)
            ``lr_t`` for SGD (``momentum * lr_t`` with Nesterov momentum) and RMSprop;
            ``lr_t (1 - beta_1) / (1 - beta_1^count_t)`` (the bias-corrected first
            moment) for Adam / AdamW. A step that was not recorded
            (``record_every > 1``) takes its interval's mean step size: the path kernel
            and the decomposition of a thinned path are Riemann sums over the recorded
            points, which each interval's own step sizes made no closer to the
            every-step sums (measured: ``benchmarks/results/thinned_schedule.md``); the
            unrolled attribution replays :attr:`step_learning_rates` instead.
        memory : float
            Momentum for SGD, ``beta_1`` for Adam / AdamW, 0 for RMSprop.
        direct : ndarray of shape (n_steps,)
            Only with ``direct=True``: ``lr_t`` for SGD with Nesterov momentum, else 0.

        Raises
        ------
        ValueError
            For a Nesterov path without ``direct=True``.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = np.sin(3 * X).ravel()
        >>> est = PathKernelMachine(hidden_layer_sizes=(4,), solver="sgd", momentum=0.5,
        ...                         learning_rate_init=0.1, max_iter=2, tol=None,
        ...                         random_state=0).fit(X, y)
        >>> coef, memory, direct = est.trajectory_.step_coefficients(direct=True)
        >>> coef.round(6).tolist(), memory, direct.round(6).tolist()
        ([0.05, 0.05], 0.5, [0.1, 0.1])
        """
        spec = self.solver_spec
        nesterov = spec.name == "sgd" and bool(spec.nesterov) and spec.momentum > 0
        if nesterov and not direct:
            raise ValueError(
                "This path was trained with Nesterov momentum (nesterovs_momentum=True), "
                "whose update lr_t (g_t + momentum * buf_t) is not a heavy-ball recursion "
                "(coef, memory): call step_coefficients(direct=True) for its terms."
            )
        steps = self.steps
        index = np.arange(self.n_steps)
        point = np.searchsorted(steps, index, side="right") - 1
        coef = self.learning_rates[point].astype(np.float64)
        lead = np.zeros_like(coef)
        if spec.name in ("adam", "adamw"):
            # Adam's own step count: the recorded one of the interval's first step.
            count = (self._state_steps[point] + index - steps[point]).astype(np.float64)
            coef, memory = coef * (1.0 - spec.beta_1) / (1.0 - spec.beta_1**count), spec.beta_1
        elif spec.name == "sgd":
            memory = spec.momentum
            if nesterov:
                coef, lead = coef * memory, coef
        else:
            memory = 0.0
        return (coef, float(memory), lead) if direct else (coef, float(memory))

    def unflatten(self, flat: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        """Split a flat (..., P) tensor into named parameter-shaped views.

        Parameters
        ----------
        flat : torch.Tensor of shape (..., n_params)
            Flat vectors in the order of :attr:`names`.

        Returns
        -------
        params : OrderedDict of str to torch.Tensor
            Parameter name to a view of shape ``(..., *shape)``.
        """
        # Checked here, not in _unflatten (the library's own calls): torch.split failed
        # in its words on a wrong length, and a NumPy array had no .split.
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"flat must be a torch.Tensor, got {type(flat).__name__}.")
        if flat.ndim == 0 or flat.shape[-1] != self.n_params:
            raise ValueError(f"flat must have shape (..., n_params) = (..., {self.n_params}), "
                             f"got {tuple(flat.shape)}.")
        return OrderedDict(zip(self._names, self._unflatten(flat)))

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        lead = flat.shape[:-1]
        sizes = [int(np.prod(s)) for s in self._shapes]
        parts = torch.split(flat, sizes, dim=-1)
        # A tuple, not unpacked: 0-d parameters (a scalar gain) have empty shapes.
        return [p.reshape((*lead, *s)) for p, s in zip(parts, self._shapes)]

    # --------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the trajectory to ``path`` as tensors and plain values only.

        In memory, ``path`` is one file, read back with ``torch.load(...,
        weights_only=True)``, which never executes code from the file (unlike pickle).
        It is written aside and renamed over ``path``: a save that fails leaves the file
        there as it was, and a process loading ``path`` meanwhile reads the old file or
        the new one, whole.

        On disk (:attr:`storage` ``"disk"``) saving is a rename, not a copy: the
        trajectory's directory becomes ``path`` (which must not exist, or be an empty
        directory, or be where it was saved before: a second save there moves nothing and
        rewrites the description), with its description in ``path/trajectory.pt``; it is
        no longer temporary, and this object reads from its new place. Chunks that a full
        disk kept in memory during recording are written there now.

        Parameters
        ----------
        path : str or os.PathLike
            File (in memory) or directory (on disk) to write.
        """
        # A TypeError naming the argument: torch.save took an int or None for a file
        # object and failed with an AttributeError.
        path = os.fspath(path)
        store = self._store
        if store is None:
            _save_aside(self._payload(), path)
            return
        store.flush()
        store.move(path)
        store.write_meta(self._payload())

    def _payload(self) -> dict:
        payload = {
            "format": "skpathkernel.Trajectory",
            "version": _FORMAT_VERSION,
            "names": list(self._names),
            "shapes": [list(s) for s in self._shapes],
            # Alone in their storage: torch.save writes a view's whole storage (a
            # continued path's buffer has spare rows, see _buffers.appended).
            "params": compact(self._params) if self.storage == "memory" else None,
            "steps": torch.from_numpy(self.steps),
            "learning_rates": torch.from_numpy(self.learning_rates),
            "batch_indices": torch.from_numpy(self._batch_indices),
            "batch_offsets": torch.from_numpy(self._batch_offsets),
            "states": {k: compact(v) if self.storage == "memory" else None
                       for k, v in self._states.items()},
            "state_steps": torch.from_numpy(self._state_steps),
            "solver": self.solver_spec.to_dict(),
            "n_samples": self.n_samples,
            "record_every": self.record_every,
        }
        for key, value in self._extras().items():
            if value is not None:
                payload[key] = (torch.from_numpy(np.asarray(value)) if key != "param_groups"
                                else list(value))
        if self.storage == "disk":
            # The vectors stay in the chunk files: the description says how many of each
            # series this path uses (a run stopped early uses a prefix) and its last point
            # when that one is held in memory.
            payload["params"] = None
            payload["states"] = {key: None for key in self._states}
            payload["storage"] = {
                "id": self._store.id,
                "chunk_rows": self._store.chunk_rows,
                "n_params": self.n_params,
                "dtype": dtype_name(self.dtype),
                "compression": dtype_name(self._params.series.delta_dtype),
                "rows": {"params": self._params.n,
                         **{key: rows.n for key, rows in self._states.items()}},
                "tail": self._params.tail,
            }
        return payload

    def _extras(self) -> dict:
        return {key: getattr(self, "_" + key) for key in _EXTRAS}

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trajectory:
        """Read a trajectory written by :meth:`save` (safely: ``weights_only=True``).

        A directory (an on-disk trajectory) is opened lazily: its chunk files are read
        when points are, and only their headers are checked now.

        Parameters
        ----------
        path : str or os.PathLike
            A file or directory written by :meth:`save`.

        Returns
        -------
        trajectory : Trajectory
            The trajectory read.
        """
        # An int was taken for a file descriptor by os.path.isdir, then for a file object
        # by torch.load, which failed with an AttributeError.
        path = os.fspath(path)
        directory = path if os.path.isdir(path) else None
        payload = _read_description(path, directory)
        params, states = payload["params"], payload["states"]
        if directory is not None:
            params, states = _open_series(directory, payload)
        return cls(
            names=payload["names"],
            shapes=payload["shapes"],
            params=params,
            steps=payload["steps"].numpy(),
            learning_rates=payload["learning_rates"].numpy(),
            batch_indices=payload["batch_indices"].numpy(),
            batch_offsets=payload["batch_offsets"].numpy(),
            states=states,
            state_steps=payload["state_steps"].numpy(),
            solver=SolverSpec(**payload["solver"]),
            n_samples=payload["n_samples"],
            record_every=payload["record_every"],
            **{key: (value.numpy() if isinstance(value, torch.Tensor) else value)
               for key, value in payload.items() if key in _EXTRAS},
        )

    def _write_meta(self) -> None:
        """Describe an on-disk path in its directory (a warning when the disk refuses)."""
        try:
            self._store.write_meta(self._payload())
        except OSError as exc:
            warnings.warn(f"Could not describe the on-disk trajectory in "
                          f"{self.directory!r}: {exc}. It stays readable here; "
                          "trajectory.save(path) writes the description.", UserWarning,
                          stacklevel=3)

    def relocate(self, directory: str | os.PathLike) -> Trajectory:
        """Read this on-disk trajectory from ``directory``, where its files were moved.

        A pickle of a model trained with ``trajectory_storage="disk"`` references its
        path's directory by the absolute name it had (see the user guide's "Saving and
        loading"). Shipped with the pickle to another machine or place, the directory
        is elsewhere: this points the trajectory there. Nothing is moved or written
        (:meth:`save` is the call that moves the files). An estimator's path, with the
        training set kept beside it, is re-pointed by the estimator's
        ``relocate_trajectory``.

        ``directory`` must hold this recording: its description (``trajectory.pt``)
        names the same recording and describes this very path (its steps, batches,
        step sizes, solver and sizes), and every chunk file the path reads is there
        with vectors of this path's length and dtype (only the files' headers are
        read). A directory and an object both saved before recording identities were
        written are told apart by the path's last point instead: the one held in
        memory, or, through the estimator's or RecordedNetwork's
        ``relocate_trajectory``, the network's parameters (this method, holding
        neither, refuses; ``Trajectory.load(directory)`` reads such a directory).
        Otherwise nothing changes and an error says why. Copies of this object in this
        process (``copy.deepcopy``) read from the new place too.

        Parameters
        ----------
        directory : str or os.PathLike
            The trajectory's directory at its new place.

        Returns
        -------
        self : Trajectory
            This trajectory, reading from ``directory``.

        Raises
        ------
        ValueError
            For a trajectory in memory, or a directory holding another recording's path
            (or this recording at another length: a copy continued it since).
        FileNotFoundError
            If ``directory`` or its description is not there.
        TrajectoryFileError
            If a chunk file of the path is missing or not this path's (an ``OSError``).

        Examples
        --------
        >>> import pickle, shutil, tempfile
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
        >>> tmp = tempfile.mkdtemp()
        >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None,
        ...                         trajectory_storage="disk", random_state=0).fit(X, y)
        >>> est.trajectory_.save(tmp + "/path")
        >>> first = est.trajectory_.parameters(0)
        >>> blob = pickle.dumps(est.trajectory_)
        >>> _ = shutil.move(tmp + "/path", tmp + "/shipped")
        >>> traj = pickle.loads(blob).relocate(tmp + "/shipped")
        >>> traj.directory == tmp + "/shipped"
        True
        >>> bool((traj.parameters(0) == first).all())
        True
        >>> shutil.rmtree(tmp)
        """
        return self._relocate(directory)

    def _relocate(self, directory, module: torch.nn.Module | None = None) -> Trajectory:
        """:meth:`relocate`, the path's last point compared with ``module``'s parameters
        where no recording identity tells (see :meth:`_check_holds`)."""
        store = self._store
        if store is None:
            raise ValueError("This trajectory is in memory: it has no directory to "
                             "relocate (only an on-disk trajectory reads one).")
        directory = os.path.abspath(os.fspath(directory))
        self._check_holds(directory, module)
        store.relocate(directory, self.n_steps)
        return self

    def _check_holds(self, directory: str, module: torch.nn.Module | None = None) -> None:
        """Refuse (nothing changed) a ``directory`` that does not hold this path.

        The recording identities decide where both sides have one. Where neither has (a
        directory saved, and an object pickled, before identities were written), two
        paths of the same settings and data differ only in their vectors: the path's
        last stored point is compared with ``module``'s parameters (the network that
        holds this path, trained to that point), or with the last point held in memory.
        """
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                errno.ENOENT, "Cannot relocate the trajectory: there is no directory",
                directory)
        there = _read_description(directory, directory)
        store = self._store
        ours = self._payload()
        theirs_id = there.get("storage", {}).get("id")
        if store.id is not None and theirs_id is not None and theirs_id != store.id:
            raise ValueError(
                f"Cannot relocate the trajectory to {directory!r}: the path recorded "
                f"there is another recording's (recording {theirs_id}, this trajectory "
                f"is recording {store.id}). Nothing was changed.")
        if (store.id is None) != (theirs_id is None):
            # A recording keeps its identity in every description it writes: one side
            # without one was recorded before identities were, the other after.
            there_is = "none" if theirs_id is None else theirs_id
            raise ValueError(
                f"Cannot relocate the trajectory to {directory!r}: the path recorded "
                f"there is another recording's (its recording identity: {there_is}, this "
                f"trajectory's: {'none' if store.id is None else store.id}; one was "
                "recorded by a skpathkernel that wrote none). Nothing was changed.")
        differs = _first_difference(ours, there)
        if differs is not None:
            n_there = len(there.get("batch_offsets", ())) - 1
            if n_there != self.n_steps:
                why = (f"it describes a path of {n_there} optimizer steps, this one has "
                       f"{self.n_steps} (a copy continued it since, with partial_fit "
                       "or warm_start, or it is another model's)")
            else:
                why = f"its description differs from this path's in {differs!r}"
            raise ValueError(
                f"Cannot relocate the trajectory to {directory!r}: {why}. The directory "
                "does not hold this path. Nothing was changed.")
        for rows in (self._params, *self._states.values()):
            rows.series.check_files(directory, rows.n)
        if store.id is None and self._params.tail is None:
            self._check_last_point(directory, module)

    def _check_last_point(self, directory: str, module: torch.nn.Module | None) -> None:
        """Refuse a ``directory`` whose last stored point is not ``module``'s parameters.

        Stored as recorded, the point is the parameters cast to the path's dtype, bit for
        bit. Compressed (float16 or bfloat16 differences with error feedback), it is
        within one rounding of the difference from the point stored before it.
        """
        where = f"Cannot relocate the trajectory to {directory!r}: "
        theirs = ("neither its description nor this trajectory names a recording (both "
                  "were written before skpathkernel wrote recording identities)")
        params = None if module is None else dict(
            module.named_parameters(remove_duplicate=False))
        if params is None or any(name not in params for name in self._names):
            raise ValueError(
                f"{where}{theirs}, and this object holds none of the path's points to "
                "compare with the directory's. Relocate it with the estimator's or "
                "RecordedNetwork's relocate_trajectory, which compares the path's last "
                "point with the network's parameters, or read the directory with "
                "Trajectory.load(directory). Nothing was changed.")
        ours = host_vector([params[name] for name in self._names], self.dtype)
        series, k = self._params.series, self._params.n - 1
        chunk, i = divmod(k, series.chunk_rows)
        stored = series.stored_chunk(directory, chunk, self._params.n)
        # A chunk's first point is stored in full.
        if not is_stored_point(ours, stored[i], None if i == 0 else stored[i - 1],
                               series.delta_dtype):
            raise ValueError(
                f"{where}{theirs}, and the last point stored there is not this model's "
                "parameters: the directory holds another model's path (of the same "
                "settings and data). Nothing was changed.")

    def for_workers(self, *, by_reference: bool = False) -> Trajectory:
        """This path as a reference to its directory, for tasks pickled to workers.

        Pickling an on-disk trajectory itself keeps its temporary directory for good (the
        user guide's persistence page); tasks that read it in another process (a joblib or Dask
        worker) get this copy instead, which pickles as a reference to the directory and
        never removes it. Keep the original alive while the tasks run: its directory is
        removed with it.

        Parameters
        ----------
        by_reference : bool, default=False
            For worker processes of this machine (loky): a trajectory in memory is
            written once to a temporary directory (``/dev/shm`` where it has room) that
            the workers map, and pickles as its name; the directory is reused by later
            calls and removed with the original. Otherwise a trajectory in memory is
            returned as it is (pickled by value: workers on other machines).

        Returns
        -------
        trajectory : Trajectory
            On disk, a copy reading the same chunk files; in memory, ``self`` or its
            shared copy.
        """
        store = self._store
        if store is None:
            return self._shared() if by_reference else self
        store.flush()
        reader = ChunkStore(store.directory, chunk_rows=store.chunk_rows, owned=False,
                            id=store.id)

        def view(rows):
            series = Series(reader, rows.series.name, rows.series.n_params,
                            rows.series.dtype, rows.series.n_rows,
                            delta_dtype=rows.series.delta_dtype)
            series._memory = rows.series._memory
            return DiskRows(series, rows.n, rows.tail, rows.start)

        out = copy.copy(self)
        out._params = view(self._params)
        out._states = {key: view(rows) for key, rows in self._states.items()}
        return out

    def _shared(self) -> Trajectory:
        """A copy of this in-memory path that pickles as the name of a directory of
        its arrays (:func:`~skpathkernel._path._storage.share_arrays`), written at the
        first call and kept while the path's vectors stay the same objects and the rest
        (step sizes, batches: public arrays, changed in place by some) pickles the same."""
        state = self.__getstate__()
        arrays = {"params": state.pop("_params"),
                  **{"state-" + k: v for k, v in state.pop("_states").items()}}
        key = (id(self._params), tuple(self._params.shape),
               tuple((k, id(v)) for k, v in self._states.items()),
               pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
        kept = self.__dict__.get("_shared_copy")
        if kept is not None and kept[0] == key:
            return kept[1]
        directory = share_arrays(arrays, state)
        out = copy.copy(self)
        out.__dict__["_shared_directory"] = directory
        if kept is not None:
            kept[2]()
        # Removed with this object (its copy is referenced only from here).
        remove = weakref.finalize(self, shutil.rmtree, directory, True)
        self.__dict__["_shared_copy"] = (key, out, remove)
        return out

    # ------------------------------------------------------------------ pickling
    def __copy__(self):
        # The tensors shared, as a shallow copy; the shared directory stays the
        # original's (removed with it).
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.__dict__.pop("_shared_copy", None)
        return out

    def __reduce_ex__(self, protocol):
        directory = self.__dict__.get("_shared_directory")
        if directory is not None:
            return _open_shared_trajectory, (directory,)
        return super().__reduce_ex__(protocol)

    def __getstate__(self):
        # Tensors as NumPy arrays (exact, on the CPU): skops cannot read torch tensors, and
        # a trajectory recorded next to a GPU must load without one. An on-disk
        # trajectory pickles a reference to its directory (see ChunkStore.__getstate__).
        state = super().__getstate__()
        state.pop("_shared_copy", None)
        state.pop("_shared_directory", None)
        if self.storage == "memory":
            state["_params"] = _to_numpy(self._params)
            state["_states"] = {k: _to_numpy(v) for k, v in self._states.items()}
        return state

    def __setstate__(self, state):
        state = dict(state)
        if not isinstance(state["_params"], DiskRows):
            state["_params"] = _to_tensor(state["_params"])
            state["_states"] = {k: _to_tensor(v) for k, v in state["_states"].items()}
        # The per-step arrays (steps, step sizes, batches) as writable copies where the
        # loader handed back read-only ones (joblib.load(..., mmap_mode="r")): the sweeps
        # pass them to torch, which warns on a read-only array (it cannot protect it).
        for key, value in state.items():
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                state[key] = np.array(value)
        for key in _EXTRAS:  # pickled before recorders set them
            state.setdefault("_" + key, None)
        super().__setstate__(state)


def interval_means(values: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, bool]:
    """Each recorded interval's mean of the per-step ``values`` (rows of a 1-D or 2-D
    array, one per optimizer step), and whether any interval's values differ.

    An interval whose values are all equal takes its first one exactly, so that a path
    without a schedule stores the step size it was given; one whose values differ (a
    scheduler) takes their mean, so that ``mean * (steps[k + 1] - steps[k])`` is the
    interval's total step size (the path kernel's weight of its point).
    """
    starts = np.asarray(steps[:-1], dtype=np.int64)
    if not len(starts):
        return np.zeros((0, *values.shape[1:])), False
    first = values[starts]
    sums = np.add.reduceat(values, starts, axis=0)
    same = np.maximum.reduceat(values, starts, axis=0) == np.minimum.reduceat(
        values, starts, axis=0)
    counts = np.diff(steps).reshape(-1, *([1] * (values.ndim - 1)))
    return np.where(same, first, sums / counts), not bool(same.all())


def mean_batch_weights(offsets: np.ndarray) -> np.ndarray:
    """Each batch entry's weight in a loss that is its batch's mean, ``1 / |B_t|``, for
    the batches that ``offsets`` delimit."""
    sizes = np.diff(offsets)
    return np.repeat(1.0 / np.maximum(sizes, 1), sizes)


def _save_aside(payload: dict, path: str) -> None:
    """``torch.save(payload, path)`` written aside and renamed over ``path``.

    torch.save truncates its file first: a save that failed (a full disk, an object it
    cannot write, a stopped process) destroyed the trajectory saved there before, and a
    process loading ``path`` while another saved it read a partial file. The name aside
    is this save's own (:func:`~skpathkernel._path._storage.aside`), so that concurrent
    saves do not write one file; it is created by ``open``, so it gets a new file's
    permissions, and a refusal is an ``OSError`` naming ``path`` (torch's said "open
    file failed", without a name). The file is fsynced before the rename and the folder
    after: a power failure leaves the old file or the new one, not an empty one.

    What torch.save writing in place kept is kept: a file the process may not write is
    refused, a link is written through (the file it names is replaced, the link stays),
    and a file replaced keeps its permissions and, where the process may set them, its
    owner and group (a file saved readable by a service's group stays so, whatever the
    saving job's umask).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a trajectory in memory is saved to a file, "
                                "this is a directory", path)
    target = os.path.realpath(path)
    try:
        before = os.stat(target)
    except OSError:
        before = None
    if before is not None and not os.access(target, os.W_OK):
        # torch.save, writing in place, was refused a file the process may not write (one
        # made read-only to keep it); a rename needs the folder's permission alone.
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    def write(f):
        if before is not None:
            _keep_mode_and_owner(f.name, before)
        torch.save(payload, f)

    # Named by the path asked for, not by the name written aside.
    replace_durably(target, write, name=path)


def _read_description(path: str, directory: str | None) -> dict:
    """The payload :meth:`Trajectory.save` wrote to ``path`` (the file, or
    ``trajectory.pt`` in ``directory``), checked to be one."""
    meta = os.path.join(directory, META_FILE) if directory else path
    try:
        payload = torch.load(meta, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{os.fspath(meta)!r} is missing: {os.fspath(path)!r} is not a saved "
            "skpathkernel trajectory.") from None
    except (RuntimeError, EOFError, KeyError, IndexError, struct.error, OSError) as exc:
        if isinstance(exc, OSError) and exc.filename is not None:
            raise  # the file itself refused (permissions, a directory): named
        # Not a file torch.save wrote: an empty file failed with a bare EOFError, a
        # truncated one in words about a zip archive or (cut at most places) with a
        # bare OSError(22, 'Invalid argument'), text with KeyError(<a byte>), four
        # bytes with a struct.error, one byte with IndexError('pop from empty list').
        raise ValueError(f"{os.fspath(path)!r} is not a skpathkernel trajectory "
                         f"file: torch.load failed ({type(exc).__name__}).") from exc
    except pickle.UnpicklingError as exc:
        # A pickle of code, but also a .npy or a CSV file: torch's message suggested
        # weights_only=False, which Trajectory.load does not take and which would run
        # the code of an untrusted pickle. Still an UnpicklingError, in our words.
        raise UnpicklingError(
            f"{os.fspath(path)!r} is not a skpathkernel trajectory file: "
            "torch.load(weights_only=True) refused its contents (objects other than "
            "tensors and plain values, or not a torch file at all); nothing in it was "
            "executed.") from exc
    if not isinstance(payload, dict) or payload.get("format") != "skpathkernel.Trajectory":
        raise ValueError(f"{os.fspath(path)!r} is not a skpathkernel trajectory file.")
    if payload["version"] > _FORMAT_VERSION:
        raise ValueError(
            f"Trajectory file format version {payload['version']} is newer than this "
            f"skpathkernel understands ({_FORMAT_VERSION}); upgrade skpathkernel."
        )
    return payload


def _first_difference(ours: dict, theirs: dict, skip=("format", "version", "id"),
                      prefix: str = "") -> str | None:
    """The first key (dotted) whose value differs between two descriptions, or None;
    the keys ``skip`` are not compared (an older version's description, the
    recording's identity, which the caller compares)."""
    for key in sorted(set(ours) | set(theirs)):
        if key in skip:
            continue
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _first_difference(a, b, skip, f"{prefix}{key}.")
            if inner is not None:
                return inner
            continue
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            # Bit for bit: a not-a-number step size equals itself.
            same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == b.dtype and a.shape == b.shape
                    and _to_numpy(a).tobytes() == _to_numpy(b).tobytes())
        else:
            same = a == b
        if not same:
            return prefix + key
    return None


def _keep_mode_and_owner(path: str, before: os.stat_result) -> None:
    """Give the file ``path`` the permissions, owner and group of ``before``, as far as
    this process may (another account's owner only as root; a group it is in)."""
    os.chmod(path, stat.S_IMODE(before.st_mode))
    if not hasattr(os, "chown"):  # Windows: no owners to keep
        return
    for uid in (before.st_uid, -1):
        try:
            os.chown(path, uid, before.st_gid)
            return
        except OSError:
            pass


def _open_shared_trajectory(directory: str) -> Trajectory:
    """The trajectory :meth:`Trajectory._shared` wrote to ``directory``, mapped (one
    object per process, see :func:`~skpathkernel._path._storage.open_shared`)."""

    def build(state, arrays):
        out = object.__new__(Trajectory)
        out.__setstate__({**state, "_params": arrays["params"],
                          "_states": {k.removeprefix("state-"): v for k, v in arrays.items()
                                      if k.startswith("state-")}})
        out.__dict__["_shared_directory"] = directory
        return out

    return open_shared(directory, build)


def _open_series(directory: str, payload: dict):
    """The saved series of an on-disk trajectory, checking that its chunk files exist."""
    spec = payload["storage"]
    store = ChunkStore(directory, chunk_rows=spec["chunk_rows"], owned=False,
                       id=spec.get("id"))
    dtype = getattr(torch, spec["dtype"])
    n_params = int(spec["n_params"])
    expected = sum(int(np.prod(s)) for s in payload["shapes"])
    if n_params != expected:
        raise ValueError(f"{os.path.join(directory, META_FILE)!r} describes {n_params} "
                         f"parameters but parameter shapes totalling {expected}.")
    rows = {}
    compression = spec.get("compression")
    for name, n in spec["rows"].items():
        series = Series(store, name, n_params, dtype, n, delta_dtype=(
            getattr(torch, compression) if compression and name == "params" else None))
        store.series[name] = series
        for chunk in range(-(-int(n) // store.chunk_rows)):
            if not os.path.exists(series.path(chunk)):
                first = chunk * store.chunk_rows
                raise TrajectoryFileError(
                    f"Trajectory chunk file {series.path(chunk)!r} (vectors {first}.."
                    f"{min(first + store.chunk_rows, n) - 1} of {name!r}, recorded points "
                    f"from {first}) is missing.")
        rows[name] = DiskRows(series, n, spec["tail"] if name == "params" else None)
    return rows.pop("params"), rows


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return dense(t).detach().cpu().numpy()


def _to_tensor(a) -> torch.Tensor:
    # Loaders may hand back read-only arrays, which torch cannot share: copy those.
    return torch.from_numpy(np.require(a, requirements=["C_CONTIGUOUS", "WRITEABLE"]))


def _stop_populating(stop: threading.Event, thread: threading.Thread) -> None:
    """Stop a recorder's page mapping and wait for its thread: a recorder dropped before
    it finished (a fit interrupted by Ctrl-C or an error) left the thread running, and an
    interpreter that exited at once aborted in it (``terminate called without an active
    exception``). At most one mapping call (``CHUNK_BYTES``) to wait for."""
    stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join()


class TrajectoryRecorder:
    """Buffers that a training loop fills, one copy per recorded point.

    With ``n_steps`` known (the estimators) the buffers are preallocated at their final
    size, so recording never allocates. With ``n_steps=None`` (a user's own loop, see
    :class:`~skpathkernel.PathRecorder`) they start small and grow by parts
    (:class:`~._buffers.Segments`), each as large as what they hold up to a chunk file's
    rows, then a chunk file's rows ("auto") or a sixteenth of what they hold (so that
    their mappings stay few on a long path): growing copies nothing, and the host-memory check
    runs for every part. :meth:`finish` joins the parts into one tensor, releasing each
    as it is copied.

    Parameters
    ----------
    params : sequence of torch.nn.Parameter
        The module's parameters, in ``named_parameters`` order.
    names : sequence of str
    n_steps : int or None
        Optimizer steps the loop will take; None when unknown (buffers grow).
    record_every : int
    solver : SolverSpec
    n_samples : int
        Number of training samples the batches index into.
    batch_size : int or None
        The largest batch (sizes the batch index buffer); None when unknown.
    dtype : torch.dtype
    storage : {"memory", "disk", "auto"}, default="memory"
        Where the parameter and optimizer-state vectors go: preallocated buffers in
        memory, or chunk files in a fresh temporary directory under ``directory`` (see
        :mod:`skpathkernel._path._storage`). "auto" records in memory and moves to disk when
        the vectors would pass ``memory_budget`` bytes, which its buffers never do (with
        ``n_steps`` known, the caller decides up front).
    directory : path-like or None, default=None
        Parent of the on-disk trajectory's directory; None is the system's temp dir.
    memory_budget : int, default=2**30
        Sizes the chunk files and "auto"'s parts of growing buffers (at most 1/32 of it
        each; other parts grow past it with the path) and bounds "auto".
    compression : {None, "float16", "bfloat16"}, default=None
        On disk, store each recorded point's parameters as its difference from the
        previous stored point in this dtype (see ``_storage.Series``).
    extends : Trajectory or None, default=None
        An on-disk path that this recording continues (its last point is this one's
        first): the vectors are appended to its series, in its directory, and
        :meth:`finish` returns the new segment alone (the rows from ``len(extends) - 1``
        on of those series; see ``extend_trajectory``), without describing the directory,
        which still describes ``extends`` until the caller describes the whole path.
    pool : bool, default=False
        Whether every step draws its batch from all ``n_samples`` rows (an estimator's
        fit call): the trajectory then records that pool (``pools``), with
        ``sample_weight``. False: the pool is unknown (a user's loop).
    sample_weight : ndarray of shape (n_samples,), default=None
        The call's sample weights (None: unweighted), with ``pool``.
    first_step : int, default=0
        The optimizer steps taken before this recording (a resumed
        :class:`~skpathkernel.PathRecorder`'s path): the step count recorded for an
        optimizer that keeps none (SGD) counts from there.
    """

    _INITIAL_STEPS = 64
    # Step counts kept on their device before one transfer reads them: bounds their
    # memory (a few MB of CUDA blocks) at one wait every this many recorded steps.
    _MAX_PENDING_COUNTS = 4096

    def __init__(self, params, names, *, n_steps, record_every, solver, n_samples,
                 batch_size, dtype, storage="memory", directory=None,
                 memory_budget=2**30, compression=None, extends=None, pool=False,
                 sample_weight=None, first_step=0):
        self._params = list(params)
        self._first_step = int(first_step)
        self._pool = bool(pool)
        self._pool_weights = (None if sample_weight is None
                              else np.array(sample_weight, dtype=np.float64))
        self._names = list(names)
        self._shapes = [tuple(p.shape) for p in self._params]
        self.n_steps = None if n_steps is None else int(n_steps)
        self.record_every = int(record_every)
        self.solver = solver
        self.n_samples = int(n_samples)
        self._dtype = dtype
        cap_steps = self._INITIAL_STEPS if n_steps is None else int(n_steps)
        n_points = self.n_points_for(cap_steps, record_every)
        self._n_params = sum(p.numel() for p in self._params)
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self._directory = directory
        self._memory_budget = int(memory_budget)
        self._compression = None if compression is None else getattr(torch, compression)
        self._auto = storage == "auto"
        device = self._params[0].device
        # The devices whose streams copy into pinned memory: the parameters', which need
        # not be the current one (a module moved to "cuda:1", or split over two GPUs).
        self._devices = tuple(dict.fromkeys(p.device for p in self._params
                                            if p.device.type == "cuda"))
        self._pin = device.type == "cuda" and storage == "memory"
        self._cpu = device.type == "cpu"
        self._written: list[int] | None = None  # points written, for the page mapping
        self._base = 0  # the first point's row in the series (a continued on-disk path)
        self._extends = extends is not None
        # The rows each growth adds once the buffers hold as many (those of a chunk file).
        self._segment_rows = chunk_rows_for(self._n_params, self._itemsize,
                                            self._memory_budget)
        self._fit_points = None  # the most points "auto" keeps in memory
        if n_steps is None:
            # No first part larger than the later ones: joining the parts (a read of the
            # path) holds one part beside the path, and 65 points of a large network
            # were most of the path (745 MiB beside 1844 MiB at 3M parameters).
            n_points = min(n_points, self._segment_rows)
        to_disk = storage == "disk"
        if self._auto and n_steps is None:
            # "auto" bounds the first buffers too, not only their growth: _INITIAL_STEPS
            # points of a large network (65 of 11M float32 parameters: 2.9 GB) would be
            # held in memory, past any budget, before the first move to disk. A budget
            # above the host's free memory goes to disk too.
            fit = self.points_within(self._n_params, len(solver.state_keys), self._itemsize,
                                     self._memory_budget)
            n_points = min(n_points, max(fit, 1))
            self._fit_points = fit
            to_disk = fit < 1 or not _fits_in_memory(self._buffers_nbytes(n_points))
        if extends is not None:
            self._append_to(extends)
        elif to_disk:
            self._to_disk(0)
        else:
            _check_fits_in_memory(self._buffers_nbytes(n_points), record_every)
            # Not the bound self._empty: the buffers would keep the recorder alive in a
            # cycle, past its finalizer that stops the page mapping's thread.
            empty = partial(_empty_rows, self._n_params, dtype, self._pin, n_steps is None)
            self._buf = Segments(empty, n_points)
            self._states = {key: Segments(empty, n_points - 1) for key in solver.state_keys}
            if self._cpu and n_steps is not None:
                # The preallocated buffers' pages mapped on a background thread, up to 64
                # MiB ahead of the copies (a copy into unmapped pages cost three times one
                # into mapped ones); stopped when the recorder finishes or is dropped.
                stop = threading.Event()
                self._stop_populating, self._written = stop, [0]
                row = self._n_params * self._itemsize
                ahead = partial(lambda written: (written[0] + 1) * row + 2 * CHUNK_BYTES,
                                self._written)
                # Its own thread: one recorder kept alive past its run (a traceback) never
                # holds up the next one's mapping.
                thread = threading.Thread(target=populate, args=(
                    [b.parts[0] for b in (self._buf, *self._states.values())], stop,
                    ahead), daemon=True,
                    name="skpathkernel-pages")
                weakref.finalize(self, _stop_populating, stop, thread)
                thread.start()
        self._state_steps = np.zeros(n_points - 1, dtype=np.int64)
        # (point, a copy of the optimizer's step count) not yet read into _state_steps:
        # read in one transfer when the path is asked for, as reading each (a count on
        # the GPU, fused Adam's) would stall every step until the GPU caught up.
        self._pending_counts: list[tuple[int, torch.Tensor]] = []
        self._steps = np.zeros(n_points, dtype=np.int64)
        self._update_room()
        # Every step's step size: a schedule may change it between recorded points, and
        # the replay of a thinned interval takes each step's own (8 bytes a step, as its
        # batch offset).
        self._step_lr = np.zeros(cap_steps, dtype=np.float64)
        batch_cap = cap_steps * (1 if batch_size is None else int(batch_size))
        self._batch_idx = np.empty(batch_cap, dtype=np.int64)
        self._batch_off = np.zeros(cap_steps + 1, dtype=np.int64)
        self._batch_w: np.ndarray | None = None  # the batch weights, once there are some
        self._k = 0  # next point to write
        self._n_batch = 0
        self._non_blocking = self._pin
        ends = np.cumsum([p.numel() for p in self._params])
        self._slices = list(zip(ends - [p.numel() for p in self._params], ends))
        # Flat views of the recorded sets of tensors (the parameters, each state key),
        # keyed by their first tensor's address.
        self._views: dict[int, tuple[list[int], list[torch.Tensor]]] = {}

    def _synchronize(self) -> None:
        """Wait for the asynchronous copies into pinned memory. On the parameters'
        devices: ``torch.cuda.synchronize()`` alone waits for the current device, and a
        path recorded from another GPU was read before its copies had landed."""
        for device in self._devices:
            torch.cuda.synchronize(device)

    def _empty(self, rows):
        return _empty_rows(self._n_params, self._dtype, self._pin, False, rows)

    @property
    def on_disk(self) -> bool:
        return isinstance(self._buf, Series)

    def _to_disk(self, n_points: int) -> None:
        """Record to chunk files from now on, writing the ``n_points`` points so far."""
        store = ChunkStore.create(self._directory, chunk_rows=chunk_rows_for(
            self._n_params, self._itemsize, self._memory_budget))
        old_buf, old_states = getattr(self, "_buf", None), getattr(self, "_states", {})
        self._buf = store.add_series("params", self._n_params, self._dtype,
                                     delta_dtype=self._compression)
        self._states = {key: store.add_series(key, self._n_params, self._dtype)
                        for key in self.solver.state_keys}
        self._pin = self._non_blocking = False
        if hasattr(self, "_steps"):
            self._update_room()
        if self.n_steps is not None and self.n_points_for(
                self.n_steps, self.record_every) < store.chunk_rows:
            # A recording shorter than a chunk (a partial_fit call) maps only the pages
            # it writes.
            for series in (self._buf, *self._states.values()):
                series._allocate(ahead=False)
        for k in range(n_points):
            self._write_row(self._buf, k, [old_buf[k]], int(self._steps[k]), whole=True)
        for key, series in self._states.items():
            for k in range(max(n_points - 1, 0)):
                self._write_row(series, k, [old_states[key][k]], k * self.record_every,
                                whole=True)

    def _append_to(self, path: Trajectory) -> None:
        """Record into the series of the on-disk ``path``, from its last point on."""
        if path.storage != "disk" or any(rows.start for rows in (path._params,
                                                                 *path._states.values())):
            raise ValueError("Only an estimator's whole on-disk path can be extended.")
        self._base = len(path) - 1
        # Its last point is stored unless it is held in memory (a tail): then this
        # recording's first point, the same vector, is written in its place.
        path._params.series.rewind(path._params.n, append=True)
        for rows in path._states.values():
            rows.series.rewind(rows.n, append=True)
        self._buf = path._params.series
        self._states = {key: path._states[key].series for key in self.solver.state_keys}
        self._pin = self._non_blocking = False

    def _write_row(self, target, k: int, tensors, step: int, whole: bool = False) -> None:
        """Row ``k`` of ``target``: the parameter-shaped ``tensors``, or one flat vector."""
        if isinstance(target, Series):
            row = self._base + k
            if row < target.n_rows:  # the continued path's last point, stored already
                return
            self._copy_flat(tensors, target.slot(row), whole)
            target.commit(row, step)
        else:
            self._copy_flat(tensors, target.slot(k), whole)

    @staticmethod
    def n_points_for(n_steps: int, record_every: int) -> int:
        """Points recorded: the initialization, every k-th step, and always the last one."""
        n = 1 + n_steps // record_every
        if n_steps % record_every:
            n += 1
        return n

    @staticmethod
    def nbytes_for(n_params, n_steps, record_every, n_state, itemsize) -> int:
        n_points = TrajectoryRecorder.n_points_for(n_steps, record_every)
        return (n_points + (n_points - 1) * n_state) * n_params * itemsize

    def _buffers_nbytes(self, n_points: int) -> int:
        """Bytes of in-memory buffers for ``n_points`` points and their states."""
        n_state = len(self.solver.state_keys)
        return (n_points + (n_points - 1) * n_state) * self._n_params * self._itemsize

    @staticmethod
    def points_within(n_params, n_state, itemsize, max_bytes) -> int:
        """The most points (each but the first with ``n_state`` state vectors) that fit
        in ``max_bytes``: ``(m + (m - 1) n_state) * n_params * itemsize <= max_bytes``."""
        return (max_bytes // (n_params * itemsize) + n_state) // (1 + n_state)

    @staticmethod
    def auto_record_every(n_params, n_steps, n_state, itemsize, max_bytes) -> int:
        """The smallest ``record_every`` whose points fit in ``max_bytes`` (1 when all do).

        The points are the parameters (``n_params`` values each) plus ``n_state`` optimizer
        state vectors per step point. At least the initialization and the last point are
        kept, so a path whose two end points alone exceed ``max_bytes`` keeps only those.
        """
        n_steps = max(int(n_steps), 1)
        max_points = TrajectoryRecorder.points_within(n_params, n_state, itemsize, max_bytes)
        if max_points < 2:
            return n_steps
        every = -(-n_steps // (max_points - 1))
        return int(min(max(every, 1), n_steps))

    # ------------------------------------------------------------------ growth
    def _grow_points(self, needed: int) -> None:
        """Make room for ``needed`` points (only when the number of steps is unknown).

        In memory each buffer gets one more part (nothing is copied), of as many rows as
        it holds up to ``_segment_rows`` (outside "auto", a sixteenth of it where that is
        more). "auto" allocates no row past the points that
        fit in ``memory_budget`` and moves to disk when ``needed`` points would pass it,
        or where the host's available memory is short of the new parts.
        """
        if needed <= self._room:  # every step's check: one comparison
            return
        have = len(self._steps)
        if needed > have:
            self._grow_small(max(needed, 2 * have), have)
        if self.on_disk or (needed <= len(self._buf) and all(
                needed - 1 <= len(b) for b in self._states.values())):
            # (A read's join leaves the states more rows than the points, or fewer.)
            self._update_room()
            return
        held = len(self._buf)
        # Each part is a mapping of its own: in memory, parts of a small budget's chunk
        # (one row each under 1 MiB) would bring a long path near Linux's 65,530 mappings,
        # so they grow with the path there (a sixteenth of it: the spare rows are not
        # resident until written). "auto" keeps the chunk, its parts within the budget.
        part = self._segment_rows if self._auto else max(self._segment_rows, held // 16)
        rows = max(needed, held + min(held, part))
        if self._auto:
            rows = min(rows, self._fit_points)
        new = (rows - held + sum(max(rows - 1 - len(b), 0) for b in self._states.values())
               ) * self._n_params * self._itemsize
        if self._auto and (rows < needed or not _fits_in_memory(new)):
            # A budget above the host's free memory: to disk, not a MemoryError in the
            # middle of the user's training loop.
            self._to_disk(self._k)
            return
        _check_fits_in_memory(new, self.record_every)
        self._buf.reserve(rows)
        for buf in self._states.values():
            buf.reserve(rows - 1)
        self._update_room()

    def _update_room(self) -> None:
        """``_room``: the points that every buffer has rows for."""
        self._room = len(self._steps)
        if not self.on_disk:
            self._room = min(self._room, len(self._buf),
                             *(len(b) + 1 for b in self._states.values()))

    def _grow_small(self, rows: int, have: int) -> None:
        pad = rows - have
        self._steps = np.concatenate([self._steps, np.zeros(pad, dtype=np.int64)])
        self._state_steps = np.concatenate([self._state_steps, np.zeros(pad, dtype=np.int64)])

    def _flat_views(self, tensors) -> list[torch.Tensor]:
        """Detached flat views of ``tensors``, made once per set of storages.

        The optimizer updates the parameters and its state in place, so the views made at
        the first copy stay valid; a tensor given new storage (``p.data = ...``, a loaded
        optimizer state) has a new address, and its views are made again. A view keeps its
        storage alive, so an old address cannot come back for another tensor. Saves a
        ``detach`` and a ``reshape`` per tensor per copy on the training thread.
        """
        ptrs = [t.data_ptr() for t in tensors]
        cached = self._views.get(ptrs[0])
        if cached is not None and cached[0] == ptrs:
            return cached[1]
        views = [t.detach().reshape(-1) for t in tensors]
        if [v.data_ptr() for v in views] == ptrs:  # views, not copies (contiguous tensors)
            if len(self._views) > len(self.solver.state_keys):  # stale sets: let them go
                self._views.clear()
            self._views[ptrs[0]] = (ptrs, views)
        return views

    def _copy_flat(self, tensors, out_row, whole=False):
        if whole:  # one flat vector (moving recorded points to disk)
            out_row.copy_(tensors[0])
            return
        flat = self._flat_views(tensors)
        if not self._cpu:  # from the GPU: a copy per tensor (asynchronous into pinned memory)
            for t, (start, end) in zip(flat, self._slices):
                out_row[start:end].copy_(t, non_blocking=self._non_blocking)
            return
        # One concatenation straight into the row: no temporary, one kernel (measured
        # 20-25% faster than a copy per parameter at P = 300k).
        torch.cat(flat, out=out_row)

    # ------------------------------------------------------------------ recording
    def record_point(self, step: int) -> None:
        self._grow_points(self._k + 1)
        self._steps[self._k] = step
        self._write_row(self._buf, self._k, self._params, step)
        self._k += 1
        if self._written is not None:
            self._written[0] = self._k  # how far the background mapping may go

    def keeps_in_memory(self, every: int) -> bool:
        """Whether the points after every ``every``-th step are recorded, in memory."""
        return not self.on_disk and every % self.record_every == 0

    def points_in_memory(self, steps) -> torch.Tensor:
        """The recorded points after each of ``steps`` optimizer steps, as rows of a view
        of the buffer (valid until :meth:`finish`; see :meth:`keeps_in_memory`)."""
        if self._non_blocking:
            self._synchronize()  # the copies into pinned memory are asynchronous
        return self._buf.take(np.searchsorted(self._steps[: self._k], steps))

    def wants_point(self, step: int) -> bool:
        """Whether the point reached after ``step`` optimizer steps is recorded."""
        return step % self.record_every == 0 or step == self.n_steps

    def record_batch(self, indices: np.ndarray, weights: np.ndarray | None = None) -> None:
        """The step's batch; ``weights``: each sample's weight in the step's loss (a fit
        with ``sample_weight``), None for the batch mean."""
        n = len(indices)
        if self._n_batch + 2 > len(self._batch_off):
            self._batch_off = np.concatenate(
                [self._batch_off, np.zeros(len(self._batch_off), dtype=np.int64)])
        start = self._batch_off[self._n_batch]
        if start + n > len(self._batch_idx):
            size = max(start + n, 2 * len(self._batch_idx))
            self._batch_idx = np.concatenate(
                [self._batch_idx, np.empty(size - len(self._batch_idx), dtype=np.int64)])
        self._batch_idx[start : start + n] = indices
        if weights is not None or self._batch_w is not None:
            self._record_weights(start, n, weights)
        self._batch_off[self._n_batch + 1] = start + n
        self._n_batch += 1

    def _record_weights(self, start: int, n: int, weights) -> None:
        """Keep the batch weights, once a step had some: earlier steps took the mean."""
        if self._batch_w is None:
            self._batch_w = mean_batch_weights(self._batch_off[: self._n_batch + 1])
        if start + n > len(self._batch_w):
            self._batch_w = np.concatenate(
                [self._batch_w[:start], np.empty(max(n, start), dtype=np.float64)])
        self._batch_w[start : start + n] = 1.0 / max(n, 1) if weights is None else weights

    def record_step(self, step: int, lr: float, optimizer: torch.optim.Optimizer) -> None:
        """Called after optimizer step ``step`` (0-based) has been applied with step size lr."""
        k = step // self.record_every  # the point this step leaves
        if step >= len(self._step_lr):
            self._step_lr = np.concatenate([self._step_lr, np.zeros(max(step + 1,
                                                                        len(self._step_lr)))])
        self._step_lr[step] = lr
        if step % self.record_every == 0:
            self._grow_points(k + 2)
            if self._states:
                states = [optimizer.state[p] for p in self._params]
                for key, buf in self._states.items():
                    # A parameter the loss has not reached (unused in the forward, a head
                    # not trained yet) has no state: torch.optim skips it, and its moments
                    # are the zeros it would start from.
                    self._write_row(buf, k, [s[key] if key in s else torch.zeros_like(p)
                                             for s, p in zip(states, self._params)], step)
                count = next((s for s in states if s), {}).get("step")
                if torch.is_tensor(count):
                    self._pending_counts.append((k, count.clone()))
                    if len(self._pending_counts) >= self._MAX_PENDING_COUNTS:
                        self._read_counts()
                else:  # SGD counts like the loop; some optimizers keep a number
                    self._state_steps[k] = int(self._first_step + step + 1 if count is None
                                               else float(count))

    def _read_counts(self) -> None:
        """Write the pending step counts into ``_state_steps``, read in one transfer
        (``int(float(count))`` of each, as read one by one)."""
        if not self._pending_counts:
            return
        rows, counts = zip(*self._pending_counts)
        self._pending_counts = []
        if len({(c.device, c.dtype) for c in counts}) == 1:
            values = torch.stack(counts).tolist()
        else:  # torch.stack needs one device and dtype
            values = [c.item() for c in counts]
        self._state_steps[list(rows)] = [int(float(v)) for v in values]

    @property
    def n_recorded_steps(self) -> int:
        """Optimizer steps recorded so far."""
        return self._n_batch

    def finish(self, n_steps: int | None = None, last: torch.Tensor | None = None
               ) -> Trajectory:
        """The trajectory recorded so far, or its first ``n_steps`` optimizer steps.

        If the last step kept did not land on a recorded point (``record_every > 1``, a run
        stopped early, or a truncation), the parameters after it are appended as the last
        point: ``last`` (a flat vector) when given, else the current parameters, in a
        copy. In memory the points are one tensor: a view of the buffers' first part where
        it holds them, else a copy into which the parts are joined, each released as it
        is copied (:meth:`~._buffers.Segments.leading`; the recorder then writes after
        it); in a user's loop, the appended last point apart from them
        (:class:`~._buffers.TailedRows`). Without ``n_steps`` recording can go on (a
        user's loop); with it (the
        estimators' end of training) the kept part is copied out of buffers preallocated
        for a longer run, so that their memory is released.
        """
        if self._non_blocking:
            self._synchronize()
        self._read_counts()
        if n_steps is not None and hasattr(self, "_stop_populating"):
            self._stop_populating.set()  # the end of training: no more rows to map
        if self.on_disk and self._buf.overflow is not None:
            raise ValueError(f"Cannot store the recorded path: {self._buf.overflow}")
        n_done = self._n_batch if n_steps is None else int(n_steps)
        if not 0 <= n_done <= self._n_batch:
            raise ValueError(f"n_steps={n_steps} is outside [0, {self._n_batch}] (the steps "
                             "recorded).")
        n_points = int(np.searchsorted(self._steps[: self._k], n_done, side="right"))
        disk, base = self.on_disk, self._base
        steps = self._steps[:n_points]
        tail = None
        if n_points and steps[-1] != n_done:
            tail = self._empty(1)
            if last is None:
                if n_done != self._n_batch:
                    raise ValueError("Truncating between recorded points needs `last`, the "
                                     "parameters after the last step kept.")
                self._copy_flat(self._params, tail[0])
            else:
                tail[0].copy_(last.reshape(-1))
            if self._non_blocking:
                self._synchronize()
            tail = tail[0]
            steps = np.append(steps, n_done)
        copied, spare = disk, 0
        if disk:
            params = DiskRows(self._buf, base + n_points, tail, base)
        else:
            # Spare rows after a joined path (a user's loop goes on): the next reads
            # find the points in one part again until they fill them. Mapped, they are
            # resident only once written: as many as the path's, so that a loop reading
            # it often joins at doubled sizes (each point copied O(1) times), and under
            # "auto" all that the budget holds, so that no later join holds the joined
            # path beside its copy (twice the path: 115 MiB under a 64 MiB budget). One
            # part's rows joined the whole path again every part (quadratic; review
            # s51). Pinned memory is resident at once, and rows beyond a part's only
            # where the host's available memory holds them (the check of each growth,
            # which they spare): else one part's.
            if self.n_steps is None:
                part = min(n_points, self._segment_rows)
                room = (n_points if self._fit_points is None
                        else max(self._fit_points - n_points, 0))
                spare = min(part, room)
                if not self._pin and room > part and _fits_in_memory(
                        room * (1 + len(self._states)) * self._n_params * self._itemsize):
                    spare = room
            if self.n_steps is None:
                # A user's loop: the last point apart (TailedRows), as the next
                # recorded point takes the row after the path's.
                params, copied = self._buf.leading(n_points, spare=spare)
                if tail is not None:
                    params = TailedRows(params, tail)
            else:
                params, copied = self._buf.leading(n_points, tail)
        n_points += tail is not None
        step_lrs = self._step_lr[:n_done].copy()
        lrs, varies = interval_means(step_lrs, steps)
        states = {k: DiskRows(v, base + n_points - 1, start=base) if disk
                  else v.leading(n_points - 1, spare=spare)[0]
                  for k, v in self._states.items()}
        self._update_room()  # a join leaves the buffers other rows
        n_indices = self._batch_off[n_done]
        batch_idx, batch_off = self._batch_idx[:n_indices], self._batch_off[: n_done + 1]
        batch_w = None if self._batch_w is None else self._batch_w[:n_indices].copy()
        state_steps = self._state_steps[: n_points - 1]
        if n_steps is not None and disk:
            # The end of training: the files then hold every point (the buffers go with
            # the recorder), and the directory describes the path, ready to move.
            self._buf.store.flush(release=True)
        elif n_steps is not None and self.n_steps is not None and n_done < self.n_steps:
            # A run that stopped early: copies, so that the buffers (sized for max_iter
            # epochs) are released with the recorder.
            params = params if copied else params.clone()
            states = {k: v.clone() for k, v in states.items()}
            steps, batch_idx = steps.copy(), batch_idx.copy()
            batch_off, state_steps = batch_off.copy(), state_steps.copy()
        trajectory = Trajectory(
            names=self._names,
            shapes=self._shapes,
            params=params,
            steps=steps,
            learning_rates=lrs,
            batch_indices=batch_idx,
            batch_offsets=batch_off,
            states=states,
            state_steps=state_steps,
            solver=self.solver,
            n_samples=self.n_samples,
            record_every=self.record_every,
            batch_weights=batch_w,
            step_lrs=step_lrs if varies else None,
            pools=[[0, 0, self.n_samples]] if self._pool else None,
            pool_weights=self._pool_weights if self._pool else None,
        )
        if n_steps is not None and disk and not self._extends:
            trajectory._write_meta()
        return trajectory


def _empty_rows(n_params: int, dtype: torch.dtype, pin: bool, mapped: bool, rows: int
                ) -> torch.Tensor:
    """Rows of a recording buffer: pinned (copies from a GPU), or with ``mapped`` (the
    parts of growing buffers, which a read joins and releases) a mapping of their own,
    returned to the system when released. Not the preallocated buffers, never joined:
    ``torch.empty`` reuses the pages a process released, where a fresh mapping's pages
    are faulted in by the first writes (in a loop of recordings of 2000 parameters,
    2 us more per step)."""
    if pin:
        return torch.empty((rows, n_params), dtype=dtype, pin_memory=True)
    if mapped:
        return mapped_empty(rows, n_params, dtype)
    return torch.empty((rows, n_params), dtype=dtype)


# Linux's estimate of the memory that can be allocated without swapping, page cache
# that can be dropped included (``MemAvailable``).
_MEMINFO = "/proc/meminfo"


def _available_memory() -> int | None:
    # Not the free pages alone (``SC_AVPHYS_PAGES``): the page cache that an on-disk
    # trajectory's chunk files leave behind counted as taken, and a review's loop was
    # refused 1 GB with 0.8 GB free of 13.5 GB available.
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: let the allocator decide
        return None


def host_vector(tensors, dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` flattened and concatenated on the host in ``dtype``: a path's vector."""
    return torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in tensors])


def is_stored_point(ours: torch.Tensor, stored: torch.Tensor, before: torch.Tensor | None,
                    delta_dtype: torch.dtype | None) -> bool:
    """Whether ``ours`` is the point a path stored as ``stored``: bit for bit, or, stored
    as its rounded difference (``delta_dtype``) from the point ``before`` it, within that
    rounding (relative, or a subnormal's step) and the sum's."""
    if delta_dtype is None or before is None:
        return bool(torch.equal(stored, ours))
    small, full = torch.finfo(delta_dtype), torch.finfo(stored.dtype)
    bound = (small.eps * (stored - before).abs()
             + small.eps * small.smallest_normal + full.eps * stored.abs())
    return bool(((stored - ours).abs() <= bound).all())


def _fits_in_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` fit in the host's available memory (with a 10% margin)."""
    available = _available_memory()
    return available is None or nbytes <= 0.9 * available


def _check_fits_in_memory(nbytes: int, record_every: int) -> None:
    """Refuse, before training starts, a trajectory that cannot fit in host memory."""
    if not _fits_in_memory(nbytes):
        available = _available_memory()
        raise MemoryError(
            f"Recording this path needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB) of host "
            f"memory but only {available:,} bytes are available. Record fewer points "
            f"(record_every={record_every} now; a larger value keeps every k-th step), train "
            "fewer epochs, or use a smaller network."
        )

