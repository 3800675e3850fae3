"""What every network-training estimator shares.

Parameters and their constraints, input validation, building the module, training it
while recording the path (``fit`` -> ``trajectory_``), predicting in memory-bounded
blocks, and pickling across devices (pickle runs code when loading: load only files you
trust, or use skops, see ``__getstate__``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import os
import warnings
from abc import ABCMeta, abstractmethod

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import BaseEstimator
from sklearn.metrics import r2_score
from sklearn.model_selection import train_test_split
from sklearn.utils import check_array, check_consistent_length, check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import (
    _check_feature_names_in,
    _check_sample_weight,
    check_is_fitted,
    column_or_1d,
)

from .. import _tangent
from .._analysis._attribution import dense_indicator
from .._device import (
    differentiable,
    resolve_device,
    resolve_dtype,
    seeded_torch,
    to_input_tensor,
    to_numpy,
    to_tensor,
)
from .._memory import feature_block_rows, map_fixed_blocks, rows_per_block
from .._modules import copy_module, runs_module, without_fastpath
from .._network._inputs import (
    block_widths,
    check_representable,
    fitted_input,
    probe_module,
    validate_input,
)
from .._network._trained import (
    TrainedNetwork,
    module_outputs,
    network_of,
    output_block_rows,
    warn_not_finite,
)
from .._parallel import (
    by_reference,
    dask_worker_threads,
    limit_torch_threads,
    map_row_blocks,
    n_row_blocks,
)
from .._path._buffers import appended
from .._path._losses import LOSSES
from .._path._storage import DiskArray, TrajectoryFileError, dtype_name
from .._path._training import (
    drawing_layers,
    draws_in_training,
    extend_trajectory,
    refuse_training_mode_layers,
    resolve_batch_size,
    resume_training_modes,
    train,
    training_threads,
    trains_without_cudnn,
    warn_drawing_now,
    warn_random_forward,
)
from .._path._trajectory import SolverSpec, Trajectory
from .._progress import Progress
from .._tangent import warn_on_fallback

# The engine is called as _tangent.<function>, looked up at call time, so that a test
# stubbing an engine function out reaches every call.
from .._validation import count, validate_params
from .._warnings import VersionedStateMixin, caller_stacklevel
from ..kernels import NetworkKernelsMixin

__all__ = ["BasePathKernelNetwork", "FittedAttribute", "NetworkAttributesMixin", "data_like_fit",
           "make_mlp"]

# Every fit validates X (and y) with these: float arrays, finite, at least two samples (a
# kernel machine over a single training point has nothing to compare; sklearn's own
# message, "Found array with 1 sample(s) ... a minimum of 2", names the problem).
FIT_CHECKS = dict(dtype=[np.float64, np.float32], ensure_min_samples=2)


# The default MLP's activations, by the name ``activation`` takes ("logistic" is
# MLPClassifier's name for the sigmoid).
ACTIVATIONS = {
    "relu": torch.nn.ReLU,
    "tanh": torch.nn.Tanh,
    "logistic": torch.nn.Sigmoid,
    "gelu": torch.nn.GELU,
    "softplus": torch.nn.Softplus,
    "identity": torch.nn.Identity,
}


# The hyper-parameters of SolverSpec that each solver's update reads (see
# FunctionalOptimizer); the others (beta_1 for sgd, momentum for adam) change nothing on
# the path, and a warm start or partial_fit after set_params changed one continues it,
# as scikit-learn's MLPs ignore the parameters their solver does not use.
_SOLVER_READS = {
    "sgd": ("momentum", "nesterov", "weight_decay"),
    "adam": ("beta_1", "beta_2", "epsilon", "weight_decay"),
    "adamw": ("beta_1", "beta_2", "epsilon", "weight_decay"),
    "rmsprop": ("rmsprop_alpha", "epsilon", "weight_decay"),
}


def _update_rule(spec: SolverSpec) -> tuple:
    """The solver's name and the hyper-parameters its update reads."""
    return (spec.name, *(getattr(spec, name) for name in _SOLVER_READS[spec.name]))


# The estimator's parameter behind each SolverSpec field (rmsprop_alpha has none: torch's
# default, which every fit uses).
_SOLVER_PARAMS = {"name": "solver", "momentum": "momentum", "nesterov": "nesterovs_momentum",
                  "beta_1": "beta_1", "beta_2": "beta_2", "epsilon": "epsilon",
                  "weight_decay": "alpha", "rmsprop_alpha": "rmsprop_alpha"}


def _update_rule_changes(before: SolverSpec, now: SolverSpec) -> str:
    """The estimator's parameters whose change alters the update rule, ``name=new (was
    old)``: the refusal names what the user set, not the SolverSpec's fields."""
    fields = ("name",) if before.name != now.name else _SOLVER_READS[now.name]
    if before.momentum != now.momentum:
        fields = [f for f in fields if f != "nesterov"]  # follows momentum (> 0)

    def value(v):
        return repr(v) if isinstance(v, (str, bool)) else f"{float(v):g}"
    return ", ".join(
        f"{_SOLVER_PARAMS[f]}={value(getattr(now, f))} (was {value(getattr(before, f))})"
        for f in fields if getattr(before, f) != getattr(now, f))


def make_mlp(n_features: int, n_outputs: int, hidden_layer_sizes, activation: str):
    """The default network: ``Linear -> activation -> ... -> Linear``."""
    sizes = [n_features, *hidden_layer_sizes]
    layers: list[torch.nn.Module] = []
    for d_in, d_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(d_in, d_out), ACTIVATIONS[activation]()]
    layers.append(torch.nn.Linear(sizes[-1], n_outputs))
    return torch.nn.Sequential(*layers)


def _build_module(spec: dict, n_features: int, n_outputs: int, seed: int,
                  device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    with seeded_torch(seed, device):
        if spec["module"] is None:
            hidden = spec["hidden_layer_sizes"]
            hidden = [hidden] if isinstance(hidden, numbers.Integral) else list(hidden)
            # int(2.5) would silently build a width-2 layer: only true integers pass.
            if any(isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1
                   for h in hidden):
                raise ValueError(
                    f"hidden_layer_sizes must contain positive integers, got {hidden}."
                )
            module = make_mlp(n_features, n_outputs, [int(h) for h in hidden],
                              spec["activation"])
        else:
            if isinstance(spec["module"], torch.nn.Module):
                # Calling it would run its forward on the two sizes (a TypeError from deep
                # inside it); a fit (and every clone of a search) builds a fresh network.
                raise TypeError(
                    "module must be a callable (n_features_in, n_outputs) -> "
                    f"torch.nn.Module that builds the network, not a network: got a "
                    f"{type(spec['module']).__name__} instance. Pass a factory, e.g. "
                    "module=MyNet, a class whose __init__ takes (n_features_in, n_outputs) "
                    "(unlike a lambda, it pickles).")
            module = spec["module"](n_features, n_outputs)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(
                    "module must be a callable (n_features_in, n_outputs) -> "
                    f"torch.nn.Module; it returned {type(module).__name__}."
                )
    module = module.to(device=device, dtype=dtype)
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("The module has no trainable parameters.")
    return module


# Estimator methods that run the fitted network's module hold its lock (see
# skpathkernel._modules.module_lock).
runs_fitted_module = runs_module(lambda est: network_of(est).module, check=warn_drawing_now)


def keep_previous_fit_on_error(fit):
    """Decorate a ``fit``: when it raises, the estimator is left exactly as it was.

    Validation itself writes to the estimator (``validate_data(reset=True)`` sets
    ``n_features_in_`` and ``feature_names_in_`` before training starts), so a fit that
    fails later (one class, divergence, a bad module) would otherwise leave a previous
    fit with the new data's number of features. The fit runs out of the caller's
    ``torch.inference_mode()`` (and ``no_grad``): a module and path built in it would hold
    inference tensors, which no later analysis can differentiate.
    """

    @functools.wraps(fit)
    def wrapper(self, *args, **kwargs):
        previous = self.__dict__.copy()
        try:
            with differentiable():
                return fit(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(previous)
            raise

    return wrapper


def reject_sparse_y(y) -> None:
    """``validate_data(multi_output=True)`` accepts a sparse y; no estimator here does."""
    if sp.issparse(y):
        raise TypeError(
            "Sparse data was passed for y, but dense data is required. Use '.toarray()' "
            "to convert to a dense numpy array."
        )


class FittedAttribute:
    """A fitted attribute that is read from where it lives, not copied there.

    ``source``: the attribute holding it (``"network_"``, the TrainedNetwork, or
    ``"estimator_"``), read as its ``name`` (default: the same name); None: stored on the
    instance itself (a subclass's own value where its base reads the network's).
    ``writable`` (with ``"network_"``): assigning replaces ``network_`` by a copy with the
    new value, so that a shallow copy of the estimator never changes the original's
    network. ``label``: how errors name the source (a private one by the public
    attribute it stands for).
    """

    def __init__(self, source: str | None = None, name: str | None = None,
                 writable: bool = False, label: str | None = None):
        self.source, self.name, self.writable = source, name, writable
        self.label = label or source

    def __set_name__(self, owner, attr):
        self.attr = attr
        self.name = self.name or attr

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            if self.source is None:
                return obj.__dict__[self.name]
            source = getattr(obj, self.source)
        except (AttributeError, KeyError):
            raise AttributeError(
                f"{type(obj).__name__!r} object has no attribute {self.attr!r} (not fitted)"
            ) from None
        try:
            return getattr(source, self.name)
        except AttributeError:
            # Fitted, from a source without it (a RecordedNetwork has no loss_curve_):
            # "not fitted" would send the user to fit again, which would not add it.
            raise AttributeError(
                f"{type(obj).__name__!r} object has no attribute {self.attr!r}: its "
                f"{self.label}, a {type(source).__name__}, has no {self.name!r}"
            ) from None

    def __set__(self, obj, value):
        if self.source is None:
            obj.__dict__[self.name] = value
        elif self.writable:
            obj.network_ = obj.network_.replace(**{self.name: value})
        else:
            raise AttributeError(f"{self.attr} is read from {self.source}; it cannot be set.")


class NetworkAttributesMixin:
    """The fitted network's attributes under the estimators' names, read from ``network_``.

    One source of truth: ``module_``, ``trajectory_``, ``device_``, ``dtype_``,
    ``n_params_``, ``X_fit_`` (and the encoded targets) are those of ``network_``.
    """

    module_ = FittedAttribute("network_", "module", writable=True)
    trajectory_ = FittedAttribute("network_", "trajectory")
    device_ = FittedAttribute("network_", "device", writable=True)
    dtype_ = FittedAttribute("network_", "dtype")
    n_params_ = FittedAttribute("network_", "n_params")
    X_fit_ = FittedAttribute("network_", "X_fit", writable=True)
    _Y_fit = FittedAttribute("network_", "y_fit")


class FittedNetworkMixin:
    """Reading a fitted ``network_``: input checks, tangent features, kernel neighbours.

    Shared by the estimators that train the network (:class:`BasePathKernelNetwork`) and
    the meta-estimators that read the network of their ``estimator_``.
    """

    def _budget(self) -> int:
        """Bytes a block may use: the estimator's current ``memory_budget``."""
        return network_of(self).memory_budget

    def _trained_by(self) -> BasePathKernelNetwork:
        """The estimator whose fit trained ``network_`` and encoded its targets: itself,
        or the one a subclass composes (an OODRankDetector's ``estimator_``)."""
        return self

    def relocate_trajectory(self, directory):
        """Read the path recorded on disk, and the training set kept beside it, from
        ``directory``, where their directory was moved.

        A model trained with ``trajectory_storage="disk"`` pickles (``pickle``,
        ``joblib``, ``skops``) a reference to its path's directory by the absolute
        name it had. Shipped with the pickle to another machine or place, the
        directory is elsewhere: ``predict`` still works, and every call that reads
        the path or the training set (``decompose``, ``attribute``, the kernels,
        ``transform`` at a past step, ``partial_fit``, ...) raises an ``OSError``
        naming the old place until the model is pointed at the new one with this.
        Nothing is moved or written. ``directory`` must hold this model's path
        (checked as :meth:`Trajectory.relocate <skpathkernel.Trajectory.relocate>`
        checks it) and, for a path continued by ``partial_fit`` or ``warm_start``, its
        training set (``data/``); otherwise nothing changes and an error says why.

        Parameters
        ----------
        directory : str or os.PathLike
            The path's directory at its new place.

        Returns
        -------
        self : object
            This estimator, reading from ``directory``.

        Raises
        ------
        ValueError
            For a path kept in memory (nothing to relocate), or a directory holding
            another model's path.
        OSError
            If ``directory``, or a file of the path or of the training set, is not
            there (``FileNotFoundError``, ``TrajectoryFileError``).

        Examples
        --------
        >>> import pickle, shutil, tempfile
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
        >>> tmp = tempfile.mkdtemp()
        >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None,
        ...                         trajectory_storage="disk", random_state=0).fit(X, y)
        >>> est.trajectory_.save(tmp + "/model-path")
        >>> before = est.decompose(X[:2]).contributions
        >>> blob = pickle.dumps(est)  # shipped with the directory
        >>> _ = shutil.move(tmp + "/model-path", tmp + "/elsewhere")
        >>> loaded = pickle.loads(blob).relocate_trajectory(tmp + "/elsewhere")
        >>> bool(np.array_equal(loaded.decompose(X[:2]).contributions, before))
        True
        >>> shutil.rmtree(tmp)
        """
        check_is_fitted(self)
        owner = self._trained_by()
        if owner is not self:  # a meta-estimator: its trainer's path (Frozen: forwarded)
            owner.relocate_trajectory(directory)
            return self
        net = self.network_
        trajectory = net.trajectory
        if trajectory.storage != "disk":
            raise ValueError(f"This {type(self).__name__}'s path is kept in memory "
                             "(trajectory_storage='memory'): there is no directory to "
                             "relocate.")
        directory = os.path.abspath(os.fspath(directory))
        # Every check before anything changes: a refused directory leaves the model
        # reading where it did.
        trajectory._check_holds(directory, net.module)
        data = self.__dict__.get("_disk_data")
        for array in data or ():
            array.check_file(directory)
        trajectory._store.relocate(directory, trajectory.n_steps)
        if data is not None:
            for array in data:
                # The path's store, not an equal one: skops does not keep shared
                # objects shared, and the training set moves with the path.
                array.store = trajectory._store
            X_fit, Y_fit = (array.array() for array in data)
            self.network_ = net.replace(X_fit=X_fit, y_fit=Y_fit, _unread_fit=None)
        return self

    def _validate_X(self, X):
        check_is_fitted(self)
        X = validate_input(self, X, reset=False)
        # The dtype the network was fitted in: set_params(dtype=...) affects the next fit.
        check_representable(X, self.network_.torch_dtype)
        return X

    @runs_fitted_module
    def _tangent_features(self, X, *, step=-1, output="trace", validated=False, n_jobs=None,
                          projection=None) -> np.ndarray:
        """phi(X) at recorded point ``step`` as a NumPy array in the network's dtype, or
        its seeded random projection: ``projection`` is ``(n_components, seed)``.

        ``validated``: ``X`` is in the network's form already (``X_fit_``, or rows the
        caller validated), not checked again: checked as a new ``X``, such an array
        has lost the column names of a DataFrame fit and would warn that it has none.
        ``n_jobs``: row blocks through joblib, each a whole number of the fixed-size
        blocks the serial call computes, so that every row is computed in the block, and
        with the padding, it has serially.
        """
        X = X if validated else self._validate_X(X)
        net = self.network_
        module, params, X_t = net.module, net.params_at(step), net.tensor(X)
        budget = self._budget()
        if projection is None:
            what = "Dense tangent features"
            row = self._check_feature_row_fits(what, self._outputs_per_sample(X))
        else:
            what, row = "The projected tangent features", projection[0] * X_t.element_size()
        block = feature_block_rows(budget, row, what)
        # The engine's check for hidden parameter reads runs once, not in every block.
        exclude = _tangent.hidden_reads(module, [params], [X_t], output=output,
                                        memory_budget=budget)
        n_blocks = min(n_row_blocks(n_jobs, X), -(-len(X) // block))
        if n_blocks <= 1:
            return _feature_blocks(module, params, X_t, output, budget, exclude, block,
                                   projection)
        # Tasks get the on-disk path by reference (pickling it would keep its temporary
        # directory for good), loky processes an in-memory one as its shared files.
        shared = net.for_workers(by_reference=by_reference(n_blocks))
        return np.concatenate(map_row_blocks(_feature_rows, X, n_jobs, shared, step, output,
                                             budget, exclude, block, projection,
                                             align=block))

    def _outputs_per_sample(self, X) -> int:
        """Outputs of the network per sample of ``X`` (validated): ``n_outputs_``."""
        return self.n_outputs_

    def _check_feature_row_fits(self, what, n_out=None):
        """One sample's dense tangent features (C x P values) must fit the budget;
        ``n_out``: the outputs per sample, None for ``n_outputs_``."""
        n_out = self.n_outputs_ if n_out is None else n_out
        itemsize = torch.empty((), dtype=self.network_.torch_dtype).element_size()
        row = n_out * self.n_params_ * itemsize
        rows_per_block(self._budget(), row,
                       f"{what} ({n_out} x {self.n_params_} values per sample)")
        return row

    def kneighbors(self, X=None, n_neighbors=100, *, kernel="tangent", step=-1, normalized=True,
                   return_distance=True):
        """Training points nearest to each query under a kernel (Guo, He & Morel 2026, figure 1).

        Nearness is the distance in the kernel's feature space,
        ``d(x, x_i)^2 = K(x, x) + K(x_i, x_i) - 2 K(x, x_i)``; with ``normalized=True``
        (Guo, He & Morel's normalized kernel ``K_hat``) it is ``sqrt(2 - 2 K_hat(x, x_i))``, so the
        nearest points are those with the highest normalized kernel. A point whose tangent
        feature is zero has no direction: ``K_hat`` is 0 against it and on its diagonal (as
        ``TangentKernel(normalized=True)`` gives it), the same formula places it at distance
        1 from every other point (0 from another such point), and the distances stay those
        of points in a feature space.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features) or (n_queries, ...), default=None
            The form of the training inputs (``input_shape_``). None: the queries are the
            training points, each one's neighbours the other training points (a point is
            never its own neighbour; a duplicate of it is), as scikit-learn's
            ``kneighbors(X=None)``.
        n_neighbors : int, default=100
            Number of training points returned per query: at most the number of training
            points, less one with ``X=None``.
        kernel : {"tangent", "path"}, default="tangent"
            The tangent kernel at recorded point ``step``, or the path kernel.
        step : int, default=-1
            Recorded point for the tangent kernel (0 is the initialization); with
            ``kernel="path"`` only the default, as the path kernel sums over every
            recorded point.
        normalized : bool, default=True
            Rank by the normalized kernel ``K_hat``, the cosine of the angle between the
            feature vectors, rather than by the raw kernel distance.
        return_distance : bool, default=True
            Whether to return the distances along with the indices.

        Returns
        -------
        distances : ndarray of shape (n_queries, n_neighbors)
            Only when ``return_distance=True``; increasing along each row.
        indices : ndarray of shape (n_queries, n_neighbors)
            Rows of ``X_fit_`` (``train_indices_`` maps them to ``X``); among equal
            distances, the lower index first.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
        >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, tol=None, random_state=0)
        >>> dist, ind = est.fit(X, y).kneighbors(X[:2], n_neighbors=3)
        >>> ind.shape, bool(np.all(np.diff(dist, axis=1) >= 0))
        ((2, 3), True)
        >>> ind = est.kneighbors(n_neighbors=3, return_distance=False)
        >>> ind.shape, bool(np.any(ind == np.arange(20)[:, None]))
        ((20, 3), False)
        """
        check_is_fitted(self)
        return self._neighbour_network().kneighbors(
            None if X is None else self._validate_X(X), n_neighbors, kernel=kernel, step=step,
            normalized=normalized, return_distance=return_distance)

    def _neighbour_network(self) -> TrainedNetwork:
        """The network whose ``X_fit`` :meth:`kneighbors` searches: ``X_fit_``'s."""
        return network_of(self)


def _feature_blocks(module, params, X_t, output, budget, exclude, block, projection):
    """phi of ``X_t`` (or its projection, see ``_tangent_features``) in fixed-size row
    blocks: a row's float32 features then do not depend on the rows passed with it."""
    if projection is None:
        def features(xb):
            return _tangent.tangent_features(module, params, xb, output=output,
                                             memory_budget=budget, exclude=exclude,
                                             check_hidden=False)
    else:
        def features(xb):
            return _tangent.project_tangent_features(
                module, params, xb, projection[0], random_state=projection[1],
                output=output, memory_budget=budget, exclude=exclude, check_hidden=False)
    return map_fixed_blocks(lambda xb: to_numpy(features(xb)), X_t, block)


def _feature_rows(X_rows, net, step, output, budget, exclude, block, projection):
    """One joblib task of ``_tangent_features``: its rows on its own copy of the module
    (the engine hooks the module it runs, and tasks on threads share the network)."""
    net = net.with_own_module()
    return _feature_blocks(net.module, net.params_at(step), net.tensor(X_rows), output,
                           budget, exclude, block, projection)


def _mean_and_std(Y: np.ndarray, weights: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and standard deviation of ``Y``, finite wherever ``Y`` is.

    NumPy's sum overflows above ``1.8e308 / n`` and its squared deviations above ~1e154,
    while the targets themselves are representable (validated finite): a scale of inf
    made every prediction ``mean + inf * f(x)``, inf or NaN. Such columns are computed on
    ``Y / max|Y|`` and scaled back; every other column is NumPy's, bit for bit.
    ``weights``: the samples' weights (``np.average``'s moments, as StandardScaler's
    with ``sample_weight``: a sample of weight 2 counts as two).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = _moments(Y, weights)
    bad = ~(np.isfinite(mean) & np.isfinite(std))
    if bad.any():
        big = np.abs(Y[:, bad]).max(axis=0)
        unit_mean, unit_std = _moments(Y[:, bad] / big, weights)
        mean[bad], std[bad] = unit_mean * big, unit_std * big
    return mean, std


def _constant_columns(mean: np.ndarray, std: np.ndarray, n: int) -> np.ndarray:
    """Columns whose spread is within the rounding of their moments: StandardScaler's
    bound ``var <= n eps var + (n mean eps)^2``, which holds where ``std`` is 0, taken
    without squares (targets of 1e300 have a finite ``std`` but an infinite ``var``).
    ``n`` is the number of rows (StandardScaler's is the weights' sum under sample
    weights): a uniform rescaling of the weights changes nothing here."""
    eps = np.finfo(np.float64).eps
    return std * np.sqrt(max(1.0 - n * eps, 0.0)) <= (n * eps) * np.abs(mean)


def _moments(Y, weights):
    if weights is None:
        return Y.mean(axis=0), Y.std(axis=0)
    mean = np.average(Y, axis=0, weights=weights)
    return mean, np.sqrt(np.average((Y - mean) ** 2, axis=0, weights=weights))


class BasePathKernelNetwork(FittedNetworkMixin, NetworkKernelsMixin, NetworkAttributesMixin,
                            VersionedStateMixin, BaseEstimator, metaclass=ABCMeta):
    """Base class for estimators that train a network and record its optimisation path.

    Subclasses encode targets (:meth:`_encode_targets`) and choose the loss; this class
    owns validation, the module, the training loop and the recorded trajectory.
    """

    # The training parameters, which only the two trainers own (the meta-estimators take
    # a trainer as estimator=); tests/test_params.py checks them against the signatures.
    _parameter_constraints: dict = {
        "hidden_layer_sizes": ["array-like", count(1)],
        "activation": [StrOptions(set(ACTIVATIONS))],
        "module": [callable, None],
        "solver": [StrOptions({"sgd", "adam", "adamw", "rmsprop"})],
        "learning_rate_init": [Interval(numbers.Real, 0, None, closed="neither")],
        "learning_rate": [StrOptions({"constant", "invscaling", "adaptive"})],
        "power_t": [Interval(numbers.Real, 0, None, closed="left")],
        "momentum": [Interval(numbers.Real, 0, 1, closed="left")],
        "nesterovs_momentum": ["boolean"],
        "alpha": [Interval(numbers.Real, 0, None, closed="left")],
        "beta_1": [Interval(numbers.Real, 0, 1, closed="left")],
        "beta_2": [Interval(numbers.Real, 0, 1, closed="left")],
        "epsilon": [Interval(numbers.Real, 0, None, closed="neither")],
        "batch_size": [count(1), StrOptions({"auto"}), None],
        "max_iter": [count(1)],
        "tol": [Interval(numbers.Real, 0, None, closed="left"), None],
        "n_iter_no_change": [count(1)],
        "early_stopping": ["boolean"],
        "validation_fraction": [Interval(numbers.Real, 0, 1, closed="neither")],
        "shuffle": ["boolean"],
        "record_every": [count(1), StrOptions({"auto"})],
        "device": [StrOptions({"auto", "cpu", "cuda"})],
        "dtype": [StrOptions({"float32", "float64"})],
        "memory_budget": [count(2**20)],
        "trajectory_storage": [StrOptions({"memory", "disk", "auto"})],
        "trajectory_dir": [str, os.PathLike, None],
        "trajectory_compression": [StrOptions({"float16", "bfloat16"}), None],
        "random_state": ["random_state"],
        "verbose": ["verbose"],
        "warm_start": ["boolean"],
    }

    # X_fit_'s rows in the X given to fit, kept by fit itself (early stopping's split).
    train_indices_ = FittedAttribute(None, "_train_rows")

    @abstractmethod
    def __init__(
        self,
        hidden_layer_sizes=(64, 64),
        *,
        activation="gelu",
        module=None,
        solver="adam",
        learning_rate_init=1e-3,
        learning_rate="constant",
        power_t=0.5,
        momentum=0.0,
        nesterovs_momentum=True,
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
        loss="squared_error",
        record_every="auto",
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        trajectory_storage="memory",
        trajectory_dir=None,
        trajectory_compression=None,
        random_state=None,
        verbose=0,
        warm_start=False,
    ):
        self.hidden_layer_sizes = hidden_layer_sizes
        self.activation = activation
        self.module = module
        self.solver = solver
        self.learning_rate_init = learning_rate_init
        self.learning_rate = learning_rate
        self.power_t = power_t
        self.momentum = momentum
        self.nesterovs_momentum = nesterovs_momentum
        self.alpha = alpha
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.batch_size = batch_size
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.shuffle = shuffle
        self.loss = loss
        self.record_every = record_every
        self.device = device
        self.dtype = dtype
        self.memory_budget = memory_budget
        self.trajectory_storage = trajectory_storage
        self.trajectory_dir = trajectory_dir
        self.trajectory_compression = trajectory_compression
        self.random_state = random_state
        self.verbose = verbose
        self.warm_start = warm_start

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _encode_targets(self, y, classes=None) -> tuple[np.ndarray, int, dict]:
        """Return (training targets, number of network outputs, fitted attributes).

        ``classes``: the labels to encode against (``partial_fit``'s, or a fitted
        network's being continued) instead of those found in ``y``.
        """

    def _target_tensor(self, Y: np.ndarray, dtype, device) -> torch.Tensor:
        return to_tensor(Y, dtype=dtype, device=device)

    def _check_continued_targets(self, y) -> None:
        """Refuse validated targets of another kind than those of the fit being continued
        (warm_start, partial_fit), before they are encoded."""

    def _network_targets(self, Y: np.ndarray) -> np.ndarray:
        """Encoded regression targets in the network's units: standardized with normalize_y.

        The fitted mean and scale, so that a loss on new targets is the training loss's.
        """
        scale = getattr(self, "_y_scale", None)
        return Y if scale is None else (np.asarray(Y, dtype=np.float64) - self._y_mean) / scale

    def _validate_y(self, X, y, **kwargs):
        return self._validate_fit_data(X, y, multi_output=True, y_numeric=True, **kwargs)

    def _validate_fit_data(self, X, y="no_validation", **kwargs):
        """``validate_data`` with the checks every fit shares (see ``FIT_CHECKS``).

        X comes back as the network takes it (:func:`._inputs.validate_input`): 2-D
        floats for the default MLP; with ``module``, floats or int64 token ids of shape
        ``(n_samples, ...)``. ``y="no_validation"`` (validate_data's convention)
        validates X alone; ``y=None`` is a supervised fit without targets, refused with
        scikit-learn's message.
        """
        dtype = resolve_dtype(self.dtype)
        # A user's module may take (n, ...) arrays and integer token ids (see _inputs).
        # A fit that continues another (reset=False) checks X against it and may add a
        # single sample; so may a stream's first call (``stream``: partial_fit), which
        # MLPRegressor and MLPClassifier take one sample at a time from the start.
        reset = kwargs.pop("reset", True)
        one_sample = kwargs.pop("stream", False) or not reset
        checks = dict(reset=reset, flexible=self.module is not None,
                      ensure_min_samples=1 if one_sample else FIT_CHECKS["ensure_min_samples"])
        if isinstance(y, str) and y == "no_validation":
            X = validate_input(self, X, **checks, **kwargs)
            check_representable(X, dtype)
            return X
        reject_sparse_y(y)
        X, y = validate_input(self, X, y, **checks, **kwargs)
        check_representable(X, dtype)
        if kwargs.get("y_numeric") and not getattr(self, "normalize_y", False):
            # Standardized targets are checked as the network gets them (_scale_targets).
            check_representable(np.asarray(y), dtype, "y")
        return X, y

    # ------------------------------------------------------------------ fitting
    def _solver_spec(self) -> SolverSpec:
        return SolverSpec(
            name=self.solver,
            momentum=self.momentum if self.solver == "sgd" else 0.0,
            nesterov=bool(self.nesterovs_momentum) and self.solver == "sgd"
            and self.momentum > 0,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            weight_decay=self.alpha,
        )

    def _outputs_hint(self, n_outputs: int) -> str:
        """What the network's outputs are, for a module that returns another width."""
        return " (one per column of y)"

    def _module_spec(self) -> dict:
        """What builds the network: stored at fit, so that unpickling rebuilds *that* one."""
        hidden = self.hidden_layer_sizes
        hidden = [hidden] if isinstance(hidden, numbers.Integral) else list(hidden)
        # Plain ints keep the spec readable by skops without trusting NumPy scalar types.
        # A bool is kept as it is, for _build_module to refuse: int(True) built a width-1
        # layer silently.
        hidden = [int(h) if isinstance(h, numbers.Integral) and not isinstance(h, bool)
                  else h for h in hidden]
        return {"module": self.module, "hidden_layer_sizes": hidden,
                "activation": self.activation}

    def _build_module(self, n_features: int, n_outputs: int, seed: int,
                      device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        return _build_module(self._module_spec(), n_features, n_outputs, seed, device, dtype)

    def _fit(self, X, y, *, sample_weight=None, incremental=False, classes=None):
        """Validate, train, and only then replace the fitted state (never half-fitted).

        ``incremental`` (``partial_fit``): one epoch, continuing the fitted network when
        there is one; ``warm_start`` continues it for a whole fit. ``sample_weight``: see
        :func:`_check_weights`.
        """
        if self.trajectory_compression is not None and self.trajectory_storage == "memory":
            raise ValueError(
                f"trajectory_compression={self.trajectory_compression!r} compresses an "
                "on-disk trajectory: use trajectory_storage='disk' (or 'auto')."
            )
        if incremental and self.early_stopping:
            raise ValueError("partial_fit does not support early_stopping=True: one pass "
                             "over each call's data leaves no epoch to score.")
        previous = self.network_ if (incremental or self.warm_start) and \
            hasattr(self, "network_") else None
        if previous is not None or incremental:
            self._check_continuable(previous)
        X, y = self._validate_y(X, y, reset=previous is None, stream=incremental)
        sample_weight = _check_weights(sample_weight, X)
        if previous is not None:
            self._check_continued_targets(y)
            classes = getattr(self, "classes_", None)
        Y, n_outputs, attrs = self._encode_targets(y, classes)
        if "classes_" not in attrs:
            Y = np.asarray(Y, dtype=np.float64)
        if previous is not None and n_outputs != self.n_outputs_:
            raise ValueError(f"y has {n_outputs} outputs but the network being continued "
                             f"was fitted with {self.n_outputs_}.")
        if sample_weight is not None and "classes_" in attrs and not incremental:
            _check_weighted_classes(y, sample_weight)
        # Stored: set_params(loss=...) after fit must not change the fitted network's loss.
        loss_name = attrs["_loss_name"] = self.loss
        seed, split_seed = fit_seeds(self.random_state)
        validation = None
        # train_indices_: X_fit_'s rows in this call's X (None once X_fit_ holds several
        # calls' rows, below).
        attrs["_train_rows"] = np.arange(len(X))
        X_all = X
        if self.early_stopping:
            # Held out before any work: the network never trains on these rows, so they
            # are not training points of the kernel machine (X_fit_ holds the others).
            train_idx, val_idx = _holdout(y, attrs.get("classes_"),
                                          self.validation_fraction, split_seed)
            X_val, y_val = X[val_idx], y[val_idx]
            X, Y = X[train_idx], Y[train_idx]
            attrs["_train_rows"] = train_idx
            w_val = None
            if sample_weight is not None:
                sample_weight, w_val = _split_weights(sample_weight, train_idx, val_idx)
                if "classes_" in attrs:
                    # The network learns from the training part only.
                    _check_weighted_classes(y[train_idx], sample_weight,
                                            " of early_stopping's training part")
        Y, y_val = self._scale_targets(Y, y_val if self.early_stopping else None, attrs,
                                       previous, sample_weight)
        spec = self._module_spec()
        if previous is None:
            device, dtype = resolve_device(self.device), resolve_dtype(self.dtype)
            module = _build_module(spec, self.n_features_in_, n_outputs, seed, device, dtype)
            layer_modes = refuse_training_mode_layers(module)
            if spec["module"] is not None:
                # Seeded as the construction: a lazy layer (nn.LazyLinear) draws its
                # initial weights in this first forward pass. On all of X: the held-out
                # rows too.
                with seeded_torch(seed, device):
                    probe_module(module, X_all, dtype=dtype, device=device,
                                 n_outputs=n_outputs, outputs_hint=self._outputs_hint(n_outputs))
                # 64 rows: a per-sample draw (stochastic depth at p = 0.1) repeats
                # itself on all of them with probability 3e-6.
                warn_random_forward(module, to_input_tensor(X_all[:64], dtype=dtype,
                                                            device=device))
        else:
            device, dtype = previous.torch_device, previous.torch_dtype
            # A copy: a fit that fails leaves the fitted network as it was. The fitted
            # module is in eval mode: back in the modes it was trained in.
            layer_modes = getattr(self, "_layer_modes", {})
            module = resume_training_modes(copy_module(previous.module), layer_modes)
        if self.early_stopping:
            validation = _validation_scorer(
                X_val, y_val, attrs.get("classes_"), dtype, device, self.memory_budget,
                [X_val[0].size, n_outputs,
                 *block_widths(module, to_input_tensor(X_val[:1], dtype=dtype, device=device),
                               linear_only=spec["module"] is None)], w_val)
        X_t = to_input_tensor(X, dtype=dtype, device=device)
        Y_t = self._target_tensor(Y, dtype, device)
        # A path on disk is continued in its own files: the new points are appended to
        # them, and the directory describes the longer path only once the training data
        # are there too (until then, the path it described before).
        extends = previous.trajectory if previous is not None and \
            previous.trajectory.storage == "disk" else None
        # What the directory describes now: the previous path, until _continued_path's
        # last write describes the longer one.
        described = None if extends is None else extends._store._described
        try:
            result = self._train(module, X_t, Y_t, loss_name, validation, seed, previous,
                                 incremental, extends, sample_weight)
            module.eval()
            if self.module is not None:  # the default MLP is nn.Linear only
                warn_on_fallback(module, X_t)
            # Kept at mean 1 (None: unweighted): training never sees a call's scale.
            fit_weights = mean_one(sample_weight)
            trajectory, X_fit, Y_fit = result.trajectory, X, Y
            disk_data = None
            if previous is not None:
                trajectory, X_fit, Y_fit, fit_weights, disk_data = _continued_path(
                    previous, getattr(self, "_disk_data", None), trajectory, X, Y,
                    fit_weights, same_data_allowed=not incremental)
                if trajectory.storage == "memory" and isinstance(self.record_every, str):
                    _warn_past_budget(previous.trajectory, trajectory, self.memory_budget)
                # Only a warm start on the same training rows keeps the previous X_fit_
                # (this call's rows, value for value); appended rows are no one call's.
                if X_fit is not previous.X_fit:
                    attrs["_train_rows"] = None
            elif trajectory.storage == "disk" and (incremental or self.warm_start):
                # A path that later calls extend: its training set grows on disk beside
                # it, not in memory.
                disk_data = _disk_training_set(trajectory, X, Y, dtype)
                X_fit, Y_fit = (a.array() for a in disk_data)
            # Committed inside the rewind's reach: an error (or an interrupt) after the
            # directory described the longer path left the series of the kept fit
            # extended and the directory describing a path that no fitted estimator
            # held, which refused every later partial_fit.
            attrs.update(
                network_=TrainedNetwork(
                    module, trajectory, loss=LOSSES[loss_name](), X_fit=X_fit, y_fit=Y_fit,
                    input_kind=self._input_kind, device=str(device),
                    memory_budget=self.memory_budget, sample_weight=fit_weights,
                    multilabel=attrs.get("_multilabel", False)),
                _network_spec=spec, n_outputs_=n_outputs, _resume=result.resume,
                _disk_data=disk_data, _layer_modes=layer_modes,
                **self._curves(result, previous is not None),
            )
            attrs["network_"]._drawn = tuple(drawing_layers(module, layer_modes))
            for name, value in attrs.items():
                setattr(self, name, value)
        except BaseException as exc:
            if extends is not None:  # the series as the path being continued left them
                # Every series is rewound, and the fit's own error is the one raised: a
                # chunk write that failed too is reported beside it, not in its place.
                for rows in (extends._params, *extends._states.values()):
                    try:
                        rows.series.rewind(rows.n, append=False)
                    except Exception as write_error:
                        warnings.warn(
                            f"Rewinding the on-disk path after {type(exc).__name__} also "
                            f"raised {write_error!r}; the path's rows are unchanged.",
                            RuntimeWarning, stacklevel=2)
                if extends._store._described != described:
                    # The directory describes the kept path again, as it did before.
                    extends._write_meta()
            raise
        return self

    def _check_continuable(self, previous) -> None:
        """Refuse, before any work, a fit that cannot extend the recorded path."""
        if previous is None:
            return
        if getattr(self, "_resume", None) is None:
            raise ValueError(
                "This fitted estimator holds no optimizer state to continue from (it was "
                "saved by a version that kept none for a path on disk): warm_start and "
                "partial_fit cannot extend its path. Fit a new network.")
        path = previous.trajectory
        where = "in memory" if path.storage == "memory" else f"on disk in {path.directory!r}"
        if self.trajectory_storage not in ("auto", path.storage):
            raise ValueError(
                f"The path that warm_start and partial_fit extend is kept {where}; "
                f"trajectory_storage={self.trajectory_storage!r} cannot continue it there. "
                f"Set it back to {path.storage!r} (or 'auto'), or fit a new network.")
        if path.storage == "disk":
            stored = dtype_name(path._params.series.delta_dtype)
            if self.trajectory_compression != stored:
                raise ValueError(
                    f"The path on disk is stored with trajectory_compression={stored!r}; "
                    f"{self.trajectory_compression!r} cannot continue it. Set it back, or "
                    "fit a new network.")
            path._store.check_extendable("warm_start and partial_fit", path.n_steps)
            for array in getattr(self, "_disk_data", None) or ():
                array.array()  # the training set's files: there and whole
            # Loaded where the directory was not, then only its trajectory relocated
            # (trajectory_.relocate): the training set is still unread, and the fit would
            # fail part way on it. relocate_trajectory reads it.
            previous._check_fit_read()
        if self._module_spec() != self._network_spec:
            raise ValueError(
                f"warm_start and partial_fit continue the fitted network, built with "
                f"{self._network_spec}; the estimator now asks for {self._module_spec()}. "
                "Set warm_start=False (or call fit) to train a new network.")
        before, now = previous.trajectory.solver_spec, self._solver_spec()
        if _update_rule(before) != _update_rule(now):
            raise ValueError(
                "warm_start and partial_fit continue the recorded path with its "
                f"optimizer, which {_update_rule_changes(before, now)} would change. A "
                "path has one optimizer: set these parameters back, or fit a new network.")
        if resolve_dtype(self.dtype) != previous.torch_dtype:
            raise ValueError(f"The fitted network is {previous.dtype}; dtype={self.dtype!r} "
                             "cannot continue it.")
        if self.loss != self._loss_name:
            raise ValueError(f"The fitted network was trained with loss={self._loss_name!r}; "
                             f"loss={self.loss!r} cannot continue its path.")

    def _scale_targets(self, Y, y_val, attrs, previous, sample_weight=None):
        """Regression targets in the network's units (``normalize_y``): standardized with
        the mean and scale of the first fit's training rows (weighted by their
        ``sample_weight``), kept by fits that continue it.
        """
        if "classes_" in attrs or not getattr(self, "normalize_y", False):
            attrs["_y_mean"] = attrs["_y_scale"] = None
            return Y, y_val
        if previous is None:
            # From the rows trained on only (no leak of the held-out ones); the network
            # learns the standardized targets, predict maps its outputs back.
            mean, scale = _mean_and_std(Y, sample_weight)
            # A constant target: only centered (StandardScaler's); its rounding leaves a
            # weighted spread of about 1e-16, which standardized it to +-1 and made the
            # scale (and the attribution through it) jump with the weights.
            scale[_constant_columns(mean, scale, len(Y))] = 1.0
            # The training set's first rows, which later fits extending it keep first:
            # the unrolled attribution differentiates the moments through their weights.
            attrs["_y_moment_rows"] = len(Y)
        else:
            mean, scale = self._y_mean, self._y_scale
        attrs["_y_mean"], attrs["_y_scale"] = mean, scale
        # What the network learns: y of any finite size standardizes to a few units,
        # unless a continued fit's new targets lie far outside the first fit's.
        Y = (Y - mean) / scale
        check_representable(Y, resolve_dtype(self.dtype), "y (standardized by normalize_y)")
        if y_val is not None:
            # R^2 is unchanged by mapping both sides with the same affine map.
            y_val = ((y_val.reshape(len(y_val), -1) - mean) / scale).reshape(y_val.shape)
        return Y, y_val

    def _standardization(self):
        """``(n_rows, constant)`` of ``normalize_y``'s moments for the unrolled
        attribution (see :func:`~.._analysis._unrolled.unrolled_scores`), or None: no
        standardized targets, or moments that are not the weighted ones of the training
        set's first rows (a warm start on the same data with other sample weights),
        which the scores then hold at the fit's values, with a warning."""
        if getattr(self, "_y_scale", None) is None:
            return None
        net = self.network_
        n_rows = getattr(self, "_y_moment_rows", None) or len(net.y_fit)
        T = np.asarray(net.y_fit[:n_rows], dtype=np.float64).reshape(n_rows, -1)
        weights = None if net.sample_weight is None else net.sample_weight[:n_rows]
        mean, std = _moments(T, weights)
        constant = std < 0.5  # standardized: a spread of 1, or 0 where only centered
        if np.abs(mean).max() > 1e-5 or np.abs(std[~constant] - 1.0).max(initial=0) > 1e-5:
            warnings.warn(
                "normalize_y's mean and scale are not the weighted moments of the "
                f"training set's first {n_rows} targets under its recorded sample "
                "weights (a warm start with other sample weights?): the unrolled scores "
                "hold them at the fit's values, as retrain_on_subsets(protocol='replay') "
                "then does.", UserWarning, stacklevel=caller_stacklevel())
            return None
        return n_rows, constant

    def _kept_standardization(self, keep: np.ndarray):
        """``(targets, mean, scale)`` of a replay on the points ``keep`` (a mask over the
        training set): ``normalize_y``'s moments taken anew over the kept rows of those
        that gave them, as a refit with the others' weights set to 0 takes them, and the
        network's targets restandardized by them; None where the fit's moments stay (no
        standardized targets, see :meth:`_standardization`, or none of those rows kept,
        with a warning: no refit exists then).
        """
        standardization = self._standardization()
        if standardization is None:
            return None
        n_rows, _ = standardization
        net = self.network_
        # The targets in y's units, where a refit decides what is constant (a column
        # that the kept rows leave constant gets the scale 1 there, not in the network's).
        Y = self._y_mean + self._y_scale * np.asarray(net.y_fit, dtype=np.float64).reshape(
            len(net.y_fit), -1)
        weights = np.ones(n_rows) if net.sample_weight is None else net.sample_weight[:n_rows]
        weights = weights * keep[:n_rows]
        if not weights.sum() > 0:
            warnings.warn(
                f"The replay keeps none of the first {n_rows} training points, whose "
                "targets gave normalize_y's mean and scale (a refit would have none to "
                "take them from): it holds the fit's.", UserWarning,
                stacklevel=caller_stacklevel())
            return None
        mean, scale = _mean_and_std(Y[:n_rows], weights)
        scale[_constant_columns(mean, scale, n_rows)] = 1.0
        return (Y - mean) / scale, mean, scale

    def _train(self, module, X_t, Y_t, loss_name, validation, seed, previous, incremental,
               extends=None, sample_weight=None):
        generator = torch.Generator().manual_seed(seed)
        max_iter = 1 if incremental else self.max_iter
        if isinstance(self.batch_size, numbers.Integral) and self.batch_size > len(X_t):
            # MLPClassifier's warning: the steps are full-batch, not the size asked for.
            warnings.warn(
                f"batch_size={self.batch_size} is larger than the {len(X_t)} training "
                f"samples: it is clipped to {len(X_t)} (every step on all of them), as "
                "MLPClassifier clips it.", UserWarning, stacklevel=caller_stacklevel())
        # On a Dask worker (GridSearchCV under the dask backend) the worker's cores are
        # shared by its task slots: keep torch's threads within them; a small network
        # trains on one (see training_threads).
        n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        threads = training_threads(resolve_batch_size(self.batch_size, len(X_t)), n_params,
                                   dask_worker_threads())
        schedule, learning_rate_init, power_t = self._schedule(
            incremental and previous is not None)
        bar = Progress(type(self).__name__, max_iter, enabled=bool(self.verbose),
                       each="{desc}: epoch {n}/{total}, loss = {loss:.6g}")
        # The draws of a layer that draws in training mode (dropout, which trains with a
        # warning) come from torch's global generator: seeded, as random_state promises,
        # and forked, so that fit leaves the caller's random state as it was. Exclusive
        # only where the training draws: its draws would otherwise interleave with another
        # fit's construction (another initialisation for its random_state) or training;
        # fits that draw nothing train at once on threads.
        # A recurrent layer built in eval mode on CUDA trains without cuDNN, whose kernel
        # has no backward in eval mode; attention trains without torch's inference fast
        # path, which the losses computed without a graph would otherwise read.
        with bar as tick, limit_torch_threads(threads), \
                seeded_torch(seed + 1, X_t.device, exclusive=draws_in_training(module)), \
                trains_without_cudnn(module), without_fastpath(module):
            return train(
                module, X_t, Y_t,
                loss=LOSSES[loss_name](),
                # A continued path keeps its optimizer (whose update rule
                # _check_continuable compared): the segment records the same spec.
                solver=self._solver_spec() if previous is None
                else previous.trajectory.solver_spec,
                learning_rate=learning_rate_init,
                batch_size=self.batch_size,
                max_iter=max_iter,
                shuffle=self.shuffle,
                generator=generator,
                record_every=self.record_every,
                tol=None if self.tol is None else float(self.tol),
                n_iter_no_change=int(self.n_iter_no_change),
                validation=validation,
                record_budget=int(self.memory_budget),
                progress=None if tick is None else lambda epoch, loss: tick(loss=loss),
                # A continued path stays where it is ("auto" follows it).
                storage=self.trajectory_storage if previous is None
                else previous.trajectory.storage,
                directory=self.trajectory_dir,
                compression=self.trajectory_compression,
                schedule=schedule,
                power_t=power_t,
                resume=None if previous is None else self._resumed(incremental),
                single_epoch=incremental,
                first_epoch=0 if previous is None else self.n_iter_,
                first_step=0 if previous is None else previous.trajectory.n_steps,
                extends=extends,
                sample_weight=sample_weight,
                # Read before the new points join a path on disk.
                path_start=None if previous is None
                else previous.trajectory.parameters(0).clone(),
            )

    def _schedule(self, continued: bool) -> tuple[str, float, float]:
        """``(learning_rate, learning_rate_init, power_t)`` of the fit's step sizes.

        ``partial_fit`` continuing a path keeps the schedule it followed, as
        MLPClassifier's ``partial_fit`` keeps its optimizer: ``set_params`` of these
        between calls changes the next ``fit``, not the stream's step sizes (which
        "invscaling" would otherwise recompute from the new values)."""
        own = (self.learning_rate, float(self.learning_rate_init), float(self.power_t))
        resume = getattr(self, "_resume", None)
        if not continued or resume is None:
            return own
        # None: a Resume pickled before the field was kept.
        kept = (resume.schedule, resume.learning_rate_init, resume.power_t)
        return tuple(o if k is None else k for o, k in zip(own, kept))

    def _resumed(self, incremental: bool):
        """The previous fit's Resume; a warm start whose ``learning_rate_init`` or
        ``learning_rate`` (the schedule) was changed starts its schedule at
        ``learning_rate_init``, as MLPClassifier's warm start does with a new optimizer
        (the optimizer's state, the moments, continue: one path), so that "constant"
        after "adaptive" or "invscaling" steps with ``learning_rate_init``, not with the
        step size the other schedule had reached. ``partial_fit`` keeps the schedule's
        step size, as MLPClassifier's does."""
        resume, lr_init = self._resume, float(self.learning_rate_init)
        schedule = self.learning_rate if self.solver == "sgd" else "constant"
        changed = (resume.learning_rate_init is not None
                   and resume.learning_rate_init != lr_init) or (
            resume.schedule is not None and resume.schedule != schedule)
        if incremental or not changed:
            return resume
        return dataclasses.replace(resume, learning_rate=lr_init, learning_rate_init=lr_init)

    def _curves(self, result, continued: bool) -> dict:
        """The fitted training curves: this fit's, after the previous fit's when continued."""
        curves = dict(
            loss_curve_=result.loss_curve,
            best_loss_=result.best_loss,
            validation_scores_=result.validation_scores,
            best_validation_score_=result.best_validation_score,
            n_iter_=result.n_iter,
            t_=result.n_steps,
        )
        if not continued:
            return curves
        curves["loss_curve_"] = self.loss_curve_ + result.loss_curve
        curves["n_iter_"] += self.n_iter_
        curves["t_"] += self.t_
        if result.best_loss is not None and self.best_loss_ is not None:
            curves["best_loss_"] = min(self.best_loss_, result.best_loss)
        if result.validation_scores is not None and self.validation_scores_ is not None:
            curves["validation_scores_"] = self.validation_scores_ + result.validation_scores
        return curves

    # ------------------------------------------------------------------ inference
    def _forward(self, X) -> np.ndarray:
        """Network outputs (n_samples, n_outputs), float64, in fixed-size blocks."""
        return warn_not_finite(network_of(self).outputs(self._validate_X(X), step=None))

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        """State for pickle, joblib and skops: NumPy arrays and plain values only.

        Loading a pickle executes code from the file: only unpickle estimators you
        trust. To share a model, save it with ``skops.io.dump`` and load it with
        ``skops.io.load(..., trusted=...)``, which trusts only the types you list (here
        only ``skpathkernel.*``) and never runs the file's code (see the user guide,
        "Saving and loading").
        """
        # The network travels as NumPy arrays plus the spec that built it, never as torch
        # objects: a CUDA-trained estimator then loads anywhere, and skops can persist it
        # while trusting only skpathkernel's own types (it cannot read torch tensors).
        # A copy: object.__getstate__ returns the live __dict__, which must keep network_.
        state = dict(super().__getstate__())
        net = state.pop("network_", None)
        if net is not None:
            X_fit, Y_fit = net.X_fit, net.y_fit
            if state.get("_disk_data") is not None and _on_disk(X_fit) and _on_disk(Y_fit):
                # Read from the files beside the path: referenced, like the path itself.
                X_fit = Y_fit = None
            state.update(
                _module_state={name: t.detach().cpu().numpy()
                               for name, t in net.module.state_dict().items()},
                trajectory_=net.trajectory, X_fit_=X_fit, _Y_fit=Y_fit,
                device_=net.device, dtype_=net.dtype, n_params_=net.n_params,
                # In the state even beside a training set on disk: one float per sample,
                # and the files hold what the path indexes, not how fit weighed it.
                _fit_weights=net.sample_weight,
            )
        return state

    def __setstate__(self, state):
        state = dict(state)
        module_state = state.pop("_module_state", None)
        # The network's parts, as __getstate__ stores them: network_ is rebuilt from them.
        parts = {name: state.pop(name, None) for name in
                 ("trajectory_", "X_fit_", "_Y_fit", "device_", "dtype_", "n_params_",
                  "_fit_weights")}
        super().__setstate__(state)
        if module_state is None:
            return
        unread = None
        if parts["X_fit_"] is None and state.get("_disk_data") is not None:
            try:
                parts["X_fit_"], parts["_Y_fit"] = (a.array() for a in state["_disk_data"])
            except TrajectoryFileError as exc:
                # Loaded where its directory is not (shipped elsewhere): predict reads
                # neither, and what reads the training set says where it was and how
                # to point the model at its new place (relocate_trajectory).
                unread = str(exc)
        device = torch.device(parts["device_"] or "cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "This estimator was trained on CUDA, which is not available here; "
                "its network was loaded onto the CPU.",
                UserWarning,
                stacklevel=2,
            )
            device = torch.device("cpu")
        dtype = resolve_dtype(parts["dtype_"])
        n_features = state["n_features_in_"]
        # The seed is irrelevant: every parameter and buffer is overwritten just below.
        module = _build_module(state["_network_spec"], n_features, state["n_outputs_"], 0,
                               device, dtype)
        module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                module_state.items()})
        self.network_ = TrainedNetwork(
            module.eval(), parts["trajectory_"],
            loss=LOSSES[state["_loss_name"]](),
            X_fit=parts["X_fit_"], y_fit=parts["_Y_fit"], input_kind=fitted_input(self)[1],
            device=str(device), memory_budget=state["memory_budget"],
            # A state saved before the weights were kept has none: the unweighted fit.
            sample_weight=parts["_fit_weights"],
            multilabel=state.get("_multilabel", False))
        self.network_._unread_fit = unread
        self.network_._drawn = tuple(drawing_layers(module, state.get("_layer_modes", {})))

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.non_deterministic = False
        # With a module, X may be (n, ...): images, sequences, token ids (see _inputs).
        tags.input_tags.three_d_array = self.module is not None
        return tags


def data_like_fit(estimator, X, y) -> tuple[np.ndarray, np.ndarray]:
    """New ``(X, y)`` validated and encoded as ``fit`` did the network's training data.

    By the estimator whose fit trained the network (``_trained_by``: an OODRankDetector's
    ``estimator_``): its input checks, its label encoding (``classes_``) and target
    scaling (``normalize_y``).
    """
    # X as the estimator's own verbs validate it, a meta-estimator's too: its column
    # names (it hands its estimator_ the values only, so a DataFrame of other or
    # reordered columns passed the estimator_'s checks and was read by position, and the
    # fit's own columns warned there that the estimator_ was fitted without names) and
    # its network's input form.
    X = estimator._validate_X(X)
    Y = _encode_like_fit(estimator._trained_by(), y)
    check_consistent_length(X, Y)
    return X, Y


def _encode_like_fit(estimator, y) -> np.ndarray:
    """``y`` encoded as ``fit`` encoded the training targets."""
    # Trained on a multilabel indicator (a PathKernelClassifier): its label columns.
    if getattr(estimator, "_multilabel", False):
        return estimator._encode_targets(check_array(dense_indicator(y), dtype=None),
                                         estimator.classes_)[0]
    if sp.issparse(y):
        # Only a label indicator is taken sparse (as fit takes it); check_array's own
        # refusal would not say why.
        raise TypeError(
            f"A sparse y is taken as a multilabel indicator only; this "
            f"{type(estimator).__name__} was fitted on "
            f"{'class labels' if hasattr(estimator, 'classes_') else 'dense targets'}: "
            "pass y as a dense array (y.toarray()).")
    # Trained on class labels (a PathKernelClassifier).
    if hasattr(estimator, "classes_"):
        y = column_or_1d(check_array(y, ensure_2d=False, dtype=None), warn=True)
        classes = estimator.classes_
        unseen = np.setdiff1d(y, classes)
        if unseen.size:
            raise ValueError(
                f"y contains labels not seen in fit: {unseen.tolist()}; the classes are "
                f"{classes.tolist()}."
            )
        # Encoding the classes ahead of y makes the encoder see exactly the fitted classes,
        # so y gets fit's codes (and one-hot / +-1 layout) whichever labels it contains.
        Y = estimator._encode_targets(np.concatenate([classes, y]))[0][len(classes) :]
    else:
        y = check_array(y, ensure_2d=False, dtype=[np.float64, np.float32])
        Y = estimator._encode_targets(y)[0]
        if Y.shape[1] != estimator.n_outputs_:
            raise ValueError(
                f"y has {Y.shape[1]} outputs but the network was fitted with "
                f"{estimator.n_outputs_}."
            )
        # In the units the network was trained in (standardized with normalize_y).
        Y = estimator._network_targets(Y)
    return Y


def declare_feature_dtype(tags, estimator):
    """Transformer tags: tangent features come out in the network's dtype, whatever X's.

    Called by every transformer's ``__sklearn_tags__`` after ``TransformerMixin``'s, which
    sets ``preserves_dtype=["float64"]`` and would otherwise overwrite it: a float32
    network preserves float32 only (float64 in, float32 out), a float64 network float64.
    """
    tags.transformer_tags.preserves_dtype = [estimator.dtype]
    return tags


def tangent_feature_names_out(estimator, input_features) -> np.ndarray:
    """``get_feature_names_out`` of the dense tangent features of a fitted ``estimator``:
    ``input_features`` checked against those seen in fit, as scikit-learn's transformers
    do, the names from the network's parameters (:func:`tangent_feature_names`)."""
    check_is_fitted(estimator)
    _check_feature_names_in(estimator, input_features, generate_names=False)
    return tangent_feature_names(estimator.trajectory_, estimator.n_outputs_)


def tangent_feature_names(trajectory, n_outputs: int) -> np.ndarray:
    """``"<parameter>[<index>]"`` for every flat parameter, per output when several."""
    names = [
        f"{name}[{i}]"
        for name, shape in zip(trajectory.names, trajectory.shapes)
        for i in range(int(np.prod(shape)))
    ]
    if n_outputs > 1:
        names = [f"out{c}:{n}" for c in range(n_outputs) for n in names]
    return np.asarray(names, dtype=object)


def _warn_past_budget(before: Trajectory, after: Trajectory, budget: int) -> None:
    """Say so, once, when a path continued in memory first holds more than
    ``memory_budget`` bytes of points: ``record_every="auto"`` bounds each fit's points,
    and a continuation keeps every point it records (its decomposition exact), so a
    stream of ``partial_fit`` calls grows without the bound its name suggests."""
    held, now = before._points_nbytes(), after._points_nbytes()
    if held <= budget < now:
        warnings.warn(
            f"The path continued by warm_start / partial_fit now holds {now / 2**20:.1f} "
            f"MiB of recorded points in memory, above memory_budget={budget} "
            f"({budget / 2**20:.1f} MiB), which bounds the points of one fit: "
            "continuations keep every point they record (in buffers that double when "
            "full: up to as much again held spare). "
            "For a long stream, start it with trajectory_storage='disk' (the path grows in "
            "its files), or with an integer record_every.", UserWarning,
            stacklevel=caller_stacklevel())


def _continued_path(previous: TrainedNetwork, disk_data, segment, X, Y, sample_weight,
                    *, same_data_allowed: bool):
    """(trajectory, X_fit, y_fit, sample_weight, disk_data) of a fit that continued
    ``previous``.

    On the previous training data (a warm start on the same X and y) the new batches
    index it as before; otherwise (``partial_fit``, or a warm start on other data) the
    training set becomes the previous one followed by the new rows, which the new
    batches index from there, so that the decomposition names every step's points. A
    path on disk keeps that training set in files beside it (``disk_data``, the files
    of the previous fit when it had them), and its directory then describes the
    extended path: the last write of the fit, so that a fit stopped before it leaves
    the directory describing the previous path, whose files are unchanged.

    The training set's weights (None: unweighted; ``sample_weight`` is this fit's,
    already at mean 1, see :func:`mean_one`) follow it: on the same data, this fit's,
    the objective that trained the latest points; on a grown training set, both parts'
    concatenated, an unweighted part weighing 1 per sample. Each part at mean 1 is
    what training does: every batch normalizes its own weights, so a call's overall
    scale never reaches the optimizer, and a call of n samples runs about n / batch
    steps, a total weight of about n.
    """
    same = (same_data_allowed and X.shape == previous.X_fit.shape
            and Y.shape == previous.y_fit.shape and np.array_equal(X, previous.X_fit)
            and np.array_equal(Y, previous.y_fit))
    if same:
        trajectory = extend_trajectory(previous.trajectory, segment, 0, len(X))
        X_fit, Y_fit = previous.X_fit, previous.y_fit
    else:
        n_prev = len(previous.X_fit)
        if previous.sample_weight is not None or sample_weight is not None:
            sample_weight = appended(*(
                np.ones(n) if w is None else w
                for w, n in ((previous.sample_weight, n_prev), (sample_weight, len(X)))))
        trajectory = extend_trajectory(previous.trajectory, segment, n_prev, n_prev + len(X))
        if trajectory.storage == "disk":
            if disk_data is None:
                disk_data = _disk_training_set(trajectory, previous.X_fit, previous.y_fit,
                                               previous.torch_dtype)
            disk_data = tuple(a.appended(rows) for a, rows in zip(disk_data, (X, Y)))
            X_fit, Y_fit = (a.array() for a in disk_data)
        else:
            # Views of buffers with spare rows: a stream of partial_fit calls copies
            # each row a bounded number of times, and earlier views keep their rows.
            X_fit, Y_fit = appended(previous.X_fit, X), appended(previous.y_fit, Y)
    if trajectory.storage == "disk":
        trajectory._write_meta()
    return trajectory, X_fit, Y_fit, sample_weight, disk_data


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _disk_training_set(trajectory, X, Y, dtype) -> tuple[DiskArray, DiskArray]:
    """Files in the path's directory holding ``X`` and the encoded targets ``Y``.

    Float inputs are kept in their dtype or the network's, whichever is wider: a later
    call's rows are cast to it, which loses nothing the network reads.
    """
    x_dtype = X.dtype if X.dtype.kind in "iu" else np.result_type(X.dtype,
                                                                  _NUMPY_DTYPES[dtype])
    empty = [DiskArray(trajectory._store, name, dt, rows.shape[1:])
             for name, dt, rows in (("X", x_dtype, X), ("y", Y.dtype, Y))]
    return tuple(a.appended(rows) for a, rows in zip(empty, (X, Y)))


def _on_disk(array) -> bool:
    """Whether ``array`` reads a file (a memmap, or a view of one)."""
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = getattr(array, "base", None)
    return False


def mean_one(weights: np.ndarray | None) -> np.ndarray | None:
    """Weights at mean 1, as a fit keeps them (they must not depend on a scale that
    training never sees) and as the SVM of TangentFeatureSVM takes them (``SVC``'s weights
    multiply ``C``); None where there are none or all are equal (every one 1)."""
    if weights is None or np.all(weights == weights[0]):
        return None
    return weights * (len(weights) / weights.sum())


def _check_weights(sample_weight, X) -> np.ndarray | None:
    """``sample_weight`` validated (scikit-learn's checks: one finite, non-negative weight
    per sample, not all 0) as float64, or None when every weight is the same.

    Weights are relative, as in ``np.average``: each batch's loss is their weighted mean,
    so equal weights are the unweighted fit, which then runs as it does without them (bit
    for bit), and multiplying every weight by a constant changes nothing.
    """
    if sample_weight is None:
        return None
    weights = _check_sample_weight(sample_weight, X, dtype=np.float64,
                                   ensure_non_negative=True)
    if not np.all(np.isfinite(weights)):
        # scikit-learn checks an array's weights but broadcasts a scalar unchecked: a NaN
        # one failed fit as a diverged loss and made partial_fit record a step of loss 0.
        raise ValueError(f"sample_weight must be finite, got {sample_weight!r}.")
    return None if np.all(weights == weights[0]) else weights


def _check_weighted_classes(y, sample_weight, where: str = "") -> None:
    """Refuse weights that leave fewer than two classes to learn (as one class is).
    ``where``: which part of the data (early stopping's training part), for the message.
    Multilabel targets are not checked: every label column is its own binary problem,
    learnt from any weighted sample (as MLPClassifier's)."""
    if np.ndim(y) == 2:
        return
    kept = np.unique(y[sample_weight > 0])
    if len(kept) < 2:
        # .item(): the label as the user wrote it, not numpy 2's np.int64(1).
        only = f"those of class {kept[0].item()!r}" if len(kept) else "none"
        raise ValueError(
            f"sample_weight is 0 on every sample{where} but {only}: the number of classes "
            "with positive weight has to be greater than one.")


def _split_weights(sample_weight, train_idx, val_idx):
    """The training and held-out parts of ``sample_weight``; each must weigh something."""
    parts = sample_weight[train_idx], sample_weight[val_idx]
    for part, what in zip(parts, ("training", "validation")):
        if not part.sum() > 0:
            raise ValueError(
                f"The {what} part of early_stopping's split has sample_weight 0 on every "
                "sample; change random_state or validation_fraction, or the weights.")
    return parts


def fit_seeds(random_state, *, peek: bool = False) -> tuple[int, int]:
    """The seeds a fit draws from ``random_state``: the module's and early stopping's split.

    ``peek``: drawn from a copy of the generator (a ``RandomState`` instance, or NumPy's
    global one for None), which is left as it was: the seeds its next fit draws, known
    before it trains (a meta-estimator's checks of the split read them).
    """
    rng = check_random_state(random_state)
    if peek and not isinstance(random_state, numbers.Integral):
        rng = copy.deepcopy(rng)
    seed, split_seed = (int(s) for s in rng.randint(np.iinfo(np.int32).max, size=2))
    return seed, split_seed


def holdout_rows(estimator, y) -> np.ndarray:
    """The rows of the class labels ``y`` that ``estimator.fit(X, y)`` will train on,
    before it trains: all of them, or early stopping's training part (the split its fit
    draws next, read without drawing it)."""
    # The trainer's own refusal of its parameters first (a validation_fraction above 1
    # was read as a split, a Generator as a seed), as its fit gives it.
    validate_params(estimator)
    if not estimator.early_stopping:
        return np.arange(len(y))
    split_seed = fit_seeds(estimator.random_state, peek=True)[1]
    return _holdout(y, np.unique(y), estimator.validation_fraction, split_seed)[0]


def _holdout(y, classes, fraction: float, seed: int):
    """Training and validation row indices for early stopping (MLPClassifier's split).

    Stratified for classification, except for multilabel targets (2-D ``y``, as
    MLPClassifier). Refused before any work when the validation part cannot hold two
    samples (a score needs them) and, for stratified classes, one sample per class, or
    when a class has a single sample (the stratified split needs two).
    """
    n = len(y)
    n_val = math.ceil(fraction * n)  # train_test_split's rounding
    n_train = n - n_val
    if np.ndim(y) == 2:
        classes = None
    need = 2 if classes is None else max(2, len(classes))
    what = "2 samples" if classes is None else (
        f"2 samples and one sample of each of the {len(classes)} classes")
    if n_val < need or n_train < need:
        part, size = ("validation", n_val) if n_val < need else ("training", n_train)
        raise ValueError(
            f"early_stopping with validation_fraction={fraction} leaves {size} of the "
            f"{n} samples for {part}; it needs at least {what}. "
            + ("Raise validation_fraction or pass more samples." if part == "validation"
               else "Lower validation_fraction or pass more samples.")
        )
    if classes is not None:
        # StratifiedShuffleSplit refuses a class seen once with an error that names
        # neither early_stopping nor a way out (MLPClassifier stratifies binary targets
        # only, so users of it do not expect the split to be stratified).
        labels, counts = np.unique(y, return_counts=True)
        single = labels[counts < 2]
        if single.size:
            raise ValueError(
                f"early_stopping holds out validation_fraction={fraction} of each class "
                "(a stratified split), which needs at least 2 samples of every class; "
                f"the classes {single.tolist()} have 1 sample each. "
                "Drop or merge them, or set early_stopping=False."
            )
    train_idx, val_idx = train_test_split(
        np.arange(n), test_size=fraction, random_state=seed,
        stratify=y if classes is not None else None)
    # Sorted: X_fit_ keeps the order of X.
    return np.sort(train_idx), val_idx


def _validation_scorer(X_val, y_val, classes, dtype, device, memory_budget, widths,
                       sample_weight=None):
    """``score(module)``: what ``est.score(X_val, y_val, sample_weight)`` gives for the
    module's outputs.

    Accuracy of the decoded labels (a margin's sign for two classes, the argmax of the
    logits otherwise; for multilabel ``y_val`` the subset accuracy of the positive logits)
    for classifiers, R^2 (averaged over outputs) for regressors; weighted by the held-out
    samples' ``sample_weight`` (MLPClassifier's).
    """

    block = output_block_rows(memory_budget, widths, dtype, fixed=False)
    X_t = to_input_tensor(X_val, dtype=dtype, device=device)

    def score(module):
        out = module_outputs(module, X_t, block, fixed=False)
        if classes is not None and y_val.ndim == 2:
            return float(np.average(np.all((out > 0) == (y_val > 0), axis=1),
                                    weights=sample_weight))
        if classes is not None:
            codes = (out[:, 0] > 0).astype(np.intp) if out.shape[1] == 1 else out.argmax(1)
            return float(np.average(classes[codes] == y_val, weights=sample_weight))
        return float(r2_score(y_val, out.reshape(y_val.shape), sample_weight=sample_weight))

    return score


def in_target_units(result, mean, scale):
    """Network outputs, or a decomposition of them, in the units of ``y``.

    With ``normalize_y`` the network learns ``(y - mean) / scale``: its outputs map back
    by ``mean + scale * f``, and its decomposition by the same affine map (the initial
    prediction takes the mean, every contribution and the error only the scale), which
    keeps it exact (its ``error`` is measured again in the units of ``y``). Without
    normalization (``scale is None``) nothing changes.
    """
    if scale is None:
        return result
    if isinstance(result, np.ndarray):
        return result * scale + mean
    mapped = dataclasses.replace(
        result,
        initial=result.initial * scale + mean,
        contributions=result.contributions * scale,
        regularization=result.regularization * scale,
        prediction=result.prediction * scale + mean,
    )
    if getattr(mapped, "step_errors", None) is not None:
        # Residuals, maxima over the outputs: the largest scale bounds them in y's units.
        mapped.step_errors = mapped.step_errors * float(np.max(scale))
    if getattr(mapped, "contribution_error", None) is not None:
        mapped.contribution_error = mapped.contribution_error * float(np.max(scale))
    if len(mapped.prediction):  # the error measured again, in the units of y
        mapped.error = float(np.max(np.abs(mapped.reconstruction - mapped.prediction)))
    return mapped
