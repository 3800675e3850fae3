"""A trained network and its recorded path: what every consumer of a fitted network reads.

:class:`TrainedNetwork` holds the module, the :class:`~skpathkernel.Trajectory`, the loss
it was trained with, its dtype and device, and the training inputs and targets that the
recorded batches index. The estimators build one in ``fit`` (``network_``),
:class:`~skpathkernel.RecordedNetwork` builds one from its parameters, and the OOD
detector exposes its inner estimator's. The kernels, the decomposition, the plotting
displays and the diagnostics take it, or anything that exposes it, through
:func:`network_of`.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections.abc import Callable

import numpy as np
import torch
from scipy.sparse import issparse
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.multioutput import MultiOutputClassifier, MultiOutputRegressor
from sklearn.pipeline import Pipeline
from sklearn.utils.validation import check_is_fitted

from .._analysis._attribution import (
    check_indicator,
    check_output,
    class_indices,
    output_weights,
    query_codes,
)
from .._analysis._decomposition import (
    block_align,
    check_tol,
    finish,
    merge,
    merge_steps,
    node_chunk,
    step_ranges,
)
from .._analysis._decomposition import decompose as decompose_path
from .._analysis._unrolled import AttributionScores, unrolled_scores, warn_tied_padding
from .._checkpoint import functional_call, plain_checkpoints
from .._device import forward_input, to_input_tensor, to_numpy, to_tensor
from .._memory import feature_block_rows, map_fixed_blocks, rows_per_block
from .._modules import copy_module, runs_module
from .._parallel import local_processes, map_calls, map_row_blocks, n_row_blocks, n_tasks
from .._path._losses import LOSSES, Loss
from .._path._storage import TrajectoryFileError
from .._path._training import (
    RECORDED_ADVICE,
    check_modes_now,
    draws_in_training,
    warn_drawing_now,
    warn_drawn,
    warn_random_forward,
)
from .._path._trajectory import Trajectory
from .._tangent import warn_on_fallback
from .._validation import check_flag, check_memory_budget, is_option
from .._warnings import VersionedStateMixin, caller_stacklevel
from ._docs import ATTRIBUTE, DECOMPOSE, SELF_INFLUENCE, shared_doc
from ._inputs import (
    FEATURES,
    FLOAT,
    TOKENS,
    block_widths,
    check_ids,
    check_input,
    check_module_takes,
)

__all__ = ["TrainedNetwork", "as_loss", "check_attribute_args", "check_decompose_args",
           "check_step_applies", "network_of", "pipeline_last_step", "warn_not_finite",
           "with_last_step"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _PerSampleLoss(Loss):
    """A user's ``per_sample(output, target) -> (B,)`` as a library loss."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def per_sample(self, output, target):
        return self.fn(output, target)


def as_loss(loss) -> Loss:
    """A :class:`~._losses.Loss` from a library name, a Loss, or a per-sample callable."""
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]()
    if callable(loss) and not isinstance(loss, str):
        return _PerSampleLoss(loss)
    raise ValueError(
        f"loss must be one of {sorted(LOSSES)} or a callable per_sample(output, "
        f"target) -> (B,), got {loss!r}."
    )


def check_decompose_args(method, weighting, n_nodes, tol=None) -> None:
    """The arguments of every ``decompose`` and ``attribute``, checked before any work."""
    if not is_option(method, "exact", "first_order", "second_order"):
        raise ValueError(
            f"method must be 'exact', 'first_order' or 'second_order', got {method!r}."
        )
    if not is_option(weighting, "realized", "expected"):
        raise ValueError(f"weighting must be 'realized' or 'expected', got {weighting!r}.")
    if n_nodes is not None and (isinstance(n_nodes, bool)
                                or not isinstance(n_nodes, numbers.Integral) or n_nodes < 1):
        raise ValueError(
            f"n_nodes must be a positive integer (Gauss-Legendre nodes per step) or None, "
            f"got {n_nodes!r}."
        )
    check_tol(tol)
    if n_nodes is not None and tol is not None:
        # Two answers to one question: a fixed count has no error control to hold tol.
        raise ValueError(
            f"Pass n_nodes (a fixed number of nodes per step, no error control) or tol "
            f"(nodes chosen per step to hold it), not both: got n_nodes={n_nodes!r} and "
            f"tol={tol!r}.")


def check_attribute_args(method, weighting, n_nodes, tol=None) -> None:
    """The arguments of every ``attribute``, checked before any work."""
    if is_option(method, "unrolled"):
        if not is_option(weighting, "realized"):
            raise ValueError("method='unrolled' differentiates the realized path (each "
                             "step's own batch): weighting must be 'realized', got "
                             f"{weighting!r}.")
        # Unused by the unrolled derivative, but refused when invalid, as for every method.
        check_decompose_args("exact", weighting, n_nodes, tol)
        return
    if not is_option(method, "exact", "first_order", "second_order"):
        raise ValueError("method must be 'unrolled', 'exact', 'first_order' or "
                         f"'second_order', got {method!r}.")
    check_decompose_args(method, weighting, n_nodes, tol)


def _is_indicator(y: np.ndarray | None) -> bool:
    """Whether ``y`` is a 0/1 indicator of two or more columns: the targets that
    "log_loss" trains as a multilabel classifier's (soft targets are not)."""
    return (y is not None and y.ndim == 2 and y.shape[1] > 1
            and bool(np.isin(y, (0, 1)).all()))


def _target_codes(y: np.ndarray, multilabel: bool = False,
                  loss: str | None = None) -> np.ndarray:
    """The class of every training target: codes as they are, else the positive or
    largest target column (+-1 or one-hot targets of a squared-error classifier);
    ``multilabel``: the labels that are on, per target column (0/1 targets, or +-1
    for a ``loss`` other than "log_loss"); other values are refused (a soft target
    has no label that is on)."""
    y = np.asarray(y)
    if multilabel:
        y = y.reshape(len(y), -1)
        allowed, what = ((0, 1), "0/1") if loss == "log_loss" else ((-1, 0, 1), "0/1 or +-1")
        bad = np.unique(y[~np.isin(y, allowed)])
        if bad.size:
            raise ValueError(
                f"The margin of a multilabel network needs {what} training targets"
                f" (the labels that are on), but y_fit holds "
                f"{bad[:5].tolist()}; soft or probability targets have no labels: "
                "explain an output column (output=k), or build the network with "
                "multilabel=False.")
        return (y > 0).astype(np.intp)
    if np.issubdtype(y.dtype, np.integer) and y.ndim == 1:
        return y
    y = y.reshape(len(y), -1)  # a target column per output, floats or integers
    return (y[:, 0] > 0).astype(np.intp) if y.shape[1] == 1 else np.argmax(y, axis=1)


# The kernel classes by name, for kneighbors: skpathkernel.kernels builds them on
# TrainedNetwork and registers them here when it is imported (the package imports it).
KERNELS: dict[str, type] = {}


# The verbs that run the module hold its lock (see skpathkernel._modules.module_lock).
# The probes of the input forms run it in eval mode; the analyses in its own modes, and
# warn when those draw at random.
_runs_own_module = runs_module(lambda net: net.module)
_analyses_own_module = runs_module(lambda net: net.module, check=warn_drawing_now)
# The outputs trace nothing that would refuse a layer mixing the batch (the kernels' and
# features' tracing does): they refuse it themselves.
_outputs_own_module = runs_module(lambda net: net.module, check=check_modes_now)


class TrainedNetwork(VersionedStateMixin):
    """A trained network and its recorded optimisation path.

    What the kernels, the decomposition, the plotting displays and the diagnostics read
    from a fitted estimator, as one object: the fitted estimators expose theirs as
    ``network_``, :class:`~skpathkernel.RecordedNetwork` as ``network_`` too, and
    :class:`~skpathkernel.kernels.TangentKernel`, :class:`~skpathkernel.kernels.PathKernel` and the
    displays accept it wherever they accept a fitted estimator. It is a plain object, not
    an estimator: nothing in it is refitted, and it pickles with its module and its
    trajectory (an on-disk trajectory pickles as :class:`~skpathkernel.Trajectory` does).

    Parameters
    ----------
    module : torch.nn.Module
        The network, called as ``module(X)`` (through ``torch.func.functional_call`` with
        a recorded point's parameters) on a tensor of shape ``(n_samples, ...)``.
    trajectory : Trajectory
        Its recorded path; its parameter names and shapes must be the module's.
    loss : "squared_error", "log_loss", callable or None, default=None
        The per-sample loss whose batch mean each step minimized (a callable
        ``per_sample(output, target) -> (B,)``, called with the module's outputs
        flattened per sample, shape ``(B, C)``, as every analysis reads them). Needed by
        the decomposition only.
    X_fit : ndarray of shape (n_samples, ...) or None, default=None
        The training inputs that the recorded batches index, in the form the network
        takes (floats, or integer token ids). Needed by the decomposition; also fixes
        the form every later ``X`` must have. Without it, ``X`` of a form the module
        cannot run is refused, naming its shape and dtype.
    y_fit : ndarray of shape (n_samples,) or (n_samples, n_targets) or None, default=None
        Their targets in the form the loss takes: integer class codes stay integers
        (except for "squared_error"), anything else is cast to the network's dtype; for
        "log_loss" a 2-D target (an indicator of the outputs' shape) is multilabel.
    sample_weight : ndarray of shape (n_samples,) or None, default=None
        The training samples' weights, when the path was trained on their weighted
        mean loss (``np.average``'s, relative); None: the plain mean. The per-batch
        normalized weights the trajectory records do not determine them across
        batches: the diagnostics read the training objective from these.
    multilabel : bool or None, default=None
        Whether the outputs are one logit per label of a multilabel classifier, whose
        margin (``output="margin"``) is the sum of the labels' signed logits. None:
        multilabel when ``loss`` is "log_loss" and ``y_fit`` is a 0/1 indicator of two
        or more columns, which that loss trains as multilabel; otherwise not. Soft or
        probability targets (and a multilabel classifier trained with "squared_error",
        +-1 targets) must pass ``multilabel=`` explicitly; the multilabel margin
        refuses training targets that are not 0/1 (+-1 with "squared_error").
    input_kind : {"features", "float", "int64"} or None, default=None
        How later inputs are checked: "features" (2-D floats), "float" (floats of the
        shape of ``X_fit``), "int64" (token ids). None: read from ``X_fit``.
    device : str or None, default=None
        Where the module lives; None reads it from the module's parameters.
    memory_budget : int, default=2**30
        Bytes one block of a kernel or decomposition computation may use.

    Attributes
    ----------
    dtype : str
        "float32" or "float64", the trajectory's.
    n_params : int
        Trainable parameters recorded.
    input_shape : tuple of int or None
        The trailing shape of ``X_fit`` (None without it).
    multilabel : bool
        Whether the margin is the multilabel one (see the parameter).

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine, TangentKernel, TrainedNetwork
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> net = est.network_
    >>> isinstance(net, TrainedNetwork), net.dtype, net.n_params == est.n_params_
    (True, 'float64', True)
    >>> bool(np.allclose(TangentKernel(net)(X), TangentKernel(est)(X)))
    True
    """

    # The layers that drew at random in the fit that recorded the path (dropout in
    # training mode): set by the estimators, which know the modes they trained in.
    _drawn: tuple[str, ...] = ()

    def __init__(self, module: torch.nn.Module, trajectory: Trajectory, *, loss=None,
                 X_fit=None, y_fit=None, input_kind: str | None = None,
                 device: str | None = None, memory_budget: int = 2**30,
                 sample_weight=None, multilabel: bool | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if trajectory.dtype not in _DTYPE_NAMES:
            raise ValueError(f"The trajectory's dtype must be float32 or float64, got "
                             f"{trajectory.dtype}.")
        _check_module_matches(module, trajectory)
        self.module = module
        self.trajectory = trajectory
        self.loss = None if loss is None else as_loss(loss)
        if X_fit is not None:
            X_fit = _as_array(X_fit, "X_fit (X_train)")
            if input_kind is None:
                integer = X_fit.dtype.kind in "iu"
                input_kind = TOKENS if integer else FEATURES if X_fit.ndim == 2 else FLOAT
        self.X_fit = X_fit
        self.y_fit = None if y_fit is None else _as_array(y_fit, "y_fit (y_train)")
        self.sample_weight = (None if sample_weight is None
                              else np.asarray(sample_weight, dtype=np.float64))
        self.multilabel = self._infers_multilabel() if multilabel is None else bool(multilabel)
        self.input_kind = input_kind
        if device is None:
            first = next(iter(module.parameters()), None)
            device = str(first.device) if first is not None else "cpu"
        self.device = str(device)
        # int() took 1.5, True, or 0 and -5 (refused at the first kernel, in words about
        # its block), and "x" failed with int()'s own message.
        self.memory_budget = check_memory_budget(memory_budget)
        # Why X_fit and y_fit are None where the fit had them: an estimator loaded where
        # the files holding them are not (see relocate_trajectory); said by what needs them.
        self._unread_fit: str | None = None

    # ------------------------------------------------------------------ description
    @property
    def dtype(self) -> str:
        """"float32" or "float64", the trajectory's."""
        return _DTYPE_NAMES[self.trajectory.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``: the trajectory's, checked when built."""
        return self.trajectory.dtype

    @property
    def torch_device(self) -> torch.device:
        """``device`` as a ``torch.device``."""
        return torch.device(self.device)

    @property
    def n_params(self) -> int:
        """Trainable parameters recorded."""
        return self.trajectory.n_params

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """The trailing shape of ``X_fit`` (None without it)."""
        return None if self.X_fit is None else tuple(int(d) for d in self.X_fit.shape[1:])

    @property
    def n_features_in(self) -> int | None:
        """Values per input, ``prod(input_shape)`` (None without ``X_fit``)."""
        shape = self.input_shape
        return None if shape is None else int(math.prod(shape))

    def __repr__(self) -> str:
        n = "no training inputs" if self.X_fit is None else f"{len(self.X_fit)} training inputs"
        return (f"{type(self).__name__}({type(self.module).__name__}, {len(self.trajectory)} "
                f"recorded points, {self.n_params} parameters, {self.dtype} on {self.device}, "
                f"{n})")

    def replace(self, **changes) -> TrainedNetwork:
        """A shallow copy with some attributes replaced (``module``, ``device``, ...).

        Parameters
        ----------
        **changes
            New values of existing attributes, by name.

        Returns
        -------
        network : TrainedNetwork
            The copy; ``self`` is unchanged.

        Raises
        ------
        TypeError
            If a name is not an attribute of the network.
        ValueError
            If ``X_fit`` is replaced by a different number of samples while the
            training samples' ``sample_weight`` is kept.
        """
        weights = changes.get("sample_weight", self.sample_weight)
        X_fit = changes.get("X_fit")
        if X_fit is not None and weights is not None and len(X_fit) != len(weights):
            # The kept weights would weigh other samples (or fail later in the
            # diagnostics, with a message about a sample_weight nobody passed).
            raise ValueError(
                f"X_fit is replaced by {len(X_fit)} samples, but the network keeps the "
                f"sample_weight of the {len(weights)} it was fitted on (the weighted "
                "training loss): replace both, e.g. replace(X_fit=X, sample_weight=None) "
                "(est.network_ = est.network_.replace(...) for an estimator's X_fit_) "
                "for unweighted samples.")
        new = copy.copy(self)
        if "module" in changes:
            # Measured on the module replaced.
            new.__dict__.pop("_widths", None)
            new.__dict__.pop("_taken", None)
        for name, value in changes.items():
            if name not in new.__dict__:
                raise TypeError(f"TrainedNetwork has no attribute {name!r} to replace.")
            setattr(new, name, value)
        return new

    # ------------------------------------------------------------------ inputs
    def check(self, X, name: str = "X", *, allow_flat: bool = False) -> np.ndarray:
        """``X`` checked against the network's input form, as a NumPy array it takes.

        Parameters
        ----------
        X : array-like or tensor of shape (n_samples, ...)
            The inputs to check.
        name : str, default="X"
            How errors name it.
        allow_flat : bool, default=False
            Also accept flat rows of ``n_features_in`` values for inputs of shape
            ``(n, ...)`` (scikit-learn's kernel consumers pass 2-D arrays).

        Returns
        -------
        X : ndarray
            ``X`` in the network's input form.
        """
        if isinstance(X, torch.Tensor):
            X = X.detach().cpu().numpy()
        if self.input_shape is None:
            if (self._takes_as_is(X)
                    and (X.shape[1:], X.dtype.str) in self.__dict__.get("_taken", ())):
                return X
            X = check_input(None, None, None, X, name)
            self._check_takes(X)
            if X.dtype == np.int64:  # every call's ids, against the embeddings
                check_ids(self.module, X, name)
            return X
        if self._takes_as_is(X):
            return X
        return check_input(self.input_shape, self.input_kind, self.module, X, name,
                           allow_flat=allow_flat)

    @_runs_own_module
    def _check_training_inputs(self) -> None:
        """Refuse training inputs ``X_fit`` that the module cannot run.

        Given with a recorded path (``X_train``), they fix the form of every later
        ``X``: ones of a wrong width, or integers for a float network, would refuse every
        right query, in words about the query. One forward pass of a row or two.

        Raises
        ------
        ValueError
            Naming ``X_train``'s shape and dtype, and what the module said.
        """
        if self.X_fit is not None and len(self.X_fit):
            check_module_takes(self.module, self.X_fit, dtype=self.torch_dtype,
                               device=self.torch_device, name="X_train")

    @_runs_own_module
    def _check_takes(self, X: np.ndarray) -> None:
        """Without training inputs nothing fixes the input form: refuse ``X`` that the
        module cannot take (a wrong width, integers for a float network) with a message
        naming its shape and dtype, not with torch's error from inside a kernel. Once
        per trailing shape and dtype (a forward pass of a row or two)."""
        form = (X.shape[1:], X.dtype.str)
        taken = self.__dict__.setdefault("_taken", set())
        if form not in taken:
            check_module_takes(self.module, X, dtype=self.torch_dtype,
                               device=self.torch_device)
            taken.add(form)
            if self.__dict__.pop("_probe_draws", False):
                # A recorded loop's network without training inputs (the one-point route
                # of a pretrained model): its first analysis's inputs are the first it has
                # for the probes that X_train gets at as_network (see _recorded_network):
                # the random draws', then the fallback's, which the estimators' fit and a
                # loop with X_train warn of and this one reached without a word.
                warn_recorded_probes(self.module, self.tensor(X[:64]))

    def _takes_as_is(self, X) -> bool:
        """Whether ``check_input`` would return ``X`` itself, unchanged and unrefused.

        A plain finite float array of the fitted shape: the common case of a kernel's
        call, checked without ``check_array``'s general machinery (its 0.05-0.2 ms were
        10% of a 2 ms Gram). Anything else, an error included, goes through
        ``check_input``, which words the refusal.
        """
        if (type(X) is not np.ndarray or X.dtype not in _FLOAT_DTYPES or X.ndim < 2
                or X.size == 0):
            return False
        shape, kind = self.input_shape, self.input_kind
        if kind == FEATURES:
            fits = X.ndim == 2 and X.shape[1:] == shape
        elif kind == FLOAT:
            fits = X.shape[1:] == shape
        else:
            fits = kind is None and shape is None
        if not fits:
            return False
        # The sum is finite only if every value is (an overflowing sum of finite values
        # just takes the general route, silently).
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(X.sum()))

    def tensor(self, X: np.ndarray) -> torch.Tensor:
        """A checked ``X`` as the network's input tensor (token ids as int64).

        Parameters
        ----------
        X : ndarray
            Inputs returned by :meth:`check`.

        Returns
        -------
        X : torch.Tensor
            On the network's device, in its dtype (token ids as int64).
        """
        return to_input_tensor(X, dtype=self.torch_dtype, device=self.torch_device)

    def params_at(self, step: int) -> dict[str, torch.Tensor]:
        """The parameters at recorded point ``step``, by name, on the network's device.

        The last point read is kept (one point: a path kernel's walk replaces it at every
        step), so that repeated kernel calls at one point neither read an on-disk chunk
        nor move it to the device again. A trajectory's recorded points never change, so
        the trajectory object, the point and the device identify it; the kept point is
        not pickled.

        Parameters
        ----------
        step : int
            Recorded point, 0 for the initialization; negative values count from the end.

        Returns
        -------
        params : dict of str to torch.Tensor
            The parameters by name, in the module's shapes; a new dict at every call.
        """
        traj = self.trajectory
        k = step % len(traj) if -len(traj) <= step < len(traj) else step
        key = (traj, k, self.device)
        # One read and one write of a tuple: concurrent threads see a whole entry.
        kept = self.__dict__.get("_kept_point")
        if kept is not None and kept[0] is traj and kept[1:3] == key[1:]:
            return dict(kept[3])
        params = dict(traj.unflatten(traj.parameters(k).to(self.torch_device)))
        self.__dict__["_kept_point"] = (*key, params)
        return dict(params)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_kept_point", None)
        state.pop("_widths", None)
        state.pop("_taken", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        # A network pickled before these attributes existed: an unweighted fit, and the
        # margin a network built from the same arguments has. In __dict__, where
        # replace() looks for them.
        self.__dict__.setdefault("sample_weight", None)
        if "multilabel" not in self.__dict__:
            self.multilabel = self._infers_multilabel()

    def _infers_multilabel(self) -> bool:
        """``multilabel=None``'s value: "log_loss" on a 0/1 indicator of 2+ columns."""
        return bool(self.loss is not None and self.loss.name == "log_loss"
                    and _is_indicator(self.y_fit))

    @_runs_own_module
    def activation_widths(self, X=None) -> list[int]:
        """Values per sample of the module's activations, which bound a block's memory.

        The default MLP's ``nn.Linear`` widths for 2-D features; for any other network
        measured on one forward pass of the first training input (kept), or without
        training inputs of the first row of ``X`` (a checked array).

        Parameters
        ----------
        X : ndarray of shape (n_samples, ...), default=None
            Inputs to measure on when the network keeps no training inputs.

        Returns
        -------
        widths : list of int
            Values per sample of the input, the outputs and every activation.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.random.RandomState(0).randn(20, 3); y = X.sum(axis=1)
        >>> est = PathKernelMachine(hidden_layer_sizes=(8, 4), max_iter=2, tol=None,
        ...                         random_state=0).fit(X, y)
        >>> est.network_.activation_widths()
        [8, 4, 1]
        """
        kept = self.__dict__.get("_widths")
        if kept is not None:
            return kept
        row = self.X_fit[:1] if self.X_fit is not None else X[:1]
        linear_only = self.input_kind == FEATURES
        widths = block_widths(self.module, None if linear_only else self.tensor(row),
                              linear_only=linear_only)
        if self.X_fit is not None or linear_only:
            self.__dict__["_widths"] = widths
        return widths

    @_outputs_own_module
    def outputs(self, X, step: int | None = -1) -> np.ndarray:
        """Network outputs ``f(X; theta_step)``, float64 (n, C), in blocks under the budget.

        Every block has the same number of rows (the last one padded), so that the
        number of rows passed does not choose other matrix-product kernels. A row's
        output still moves with its position in the block by float rounding (the BLAS
        splits a product's rows into panels: about 1e-7 relative in float32).

        Parameters
        ----------
        X : array-like or tensor of shape (n_samples, ...)
            In the network's input form.
        step : int or None, default=-1
            Recorded point (negative counts from the end); None: the module's own
            parameters (the fitted network, what the estimators predict with).

        Returns
        -------
        outputs : ndarray of shape (n_samples, n_outputs)
        """
        X = self.check(X)
        widths = [X[0].size, *self.activation_widths(X)] if len(X) else [1]
        block = output_block_rows(self.memory_budget, widths, self.torch_dtype, fixed=True)
        params = None if step is None else self.params_at(step)
        return module_outputs(self.module, self.tensor(X), block, params=params)

    def targets(self) -> torch.Tensor:
        """``y_fit`` as the loss takes it: class codes as int64, anything else in dtype.

        Returns
        -------
        y : torch.Tensor
            On the network's device; regression targets of shape ``(n_samples, 1)`` when
            ``y_fit`` was one-dimensional.
        """
        y = self.y_fit
        squared = self.loss is not None and self.loss.name == "squared_error"
        if np.issubdtype(y.dtype, np.integer) and not squared:
            return to_tensor(y, dtype=torch.long, device=self.torch_device)
        if squared and y.ndim == 1:
            y = y.reshape(-1, 1)
        return to_tensor(np.asarray(y, dtype=np.float64), dtype=self.torch_dtype,
                         device=self.torch_device)

    # ------------------------------------------------------------------ decomposition
    @shared_doc(
        DECOMPOSE,
        note="\n\nOn the network's own outputs: the estimators map the result into the "
             "units of their targets.",
        X="array-like or tensor of shape (n_queries, ...)\n    Queries in the network's "
          "input form.",
        extra_params="""
weights : ndarray of shape (n_queries, n_outputs) or None, default=None
    Decompose the contracted output ``w_q . f(x_q)`` instead of every output.
units : callable or None, default=None
    Maps the result into other units (the estimators' target scaling).""",
        raises="""

Raises
------
ValueError
    Without training inputs, targets or loss, or when they do not match the
    recorded batches.""",
        examples="",
    )
    @_analyses_own_module
    def decompose(self, X, *, method: str = "exact", weighting: str = "realized",
                  n_nodes: int | None = None, tol: float | None = None,
                  n_jobs: int | None = None, weights=None, units=None):
        return self._decompose(X, method=method, weighting=weighting, n_nodes=n_nodes,
                               tol=tol, n_jobs=n_jobs, weights=weights, units=units)

    def _decompose(self, X, *, method, weighting, n_nodes, tol, n_jobs, weights, units,
                   verb: str = "decompose"):
        """``decompose`` for every caller: ``verb``, the method the user called
        (``attribute`` and ``explain`` decompose too), names it in the warnings."""
        check_decompose_args(method, weighting, n_nodes, tol)
        X = self.check(X)
        # Its errors here, not on the workers; the serial call decomposes with these
        # tensors (a second conversion held a float32 path's training data twice, beside
        # the memory plan: 27 kB of a 120 kB budget on a 32-32-2 MLP).
        data = self._training_data()
        X_fit = data[0]
        # The causes by name, for every method: the exact one's closure check measures
        # the miss but can only guess at why (it names the quadrature first).
        analysis = f"{verb}(method={method!r})"
        warn_drawn(self._drawn, analysis)
        warn_tied_padding(self.module, self.trajectory, X_fit, analysis, "contributions")
        # chunk: the queries whose nodes are chosen together, the same in every block.
        kwargs = dict(method=method, weighting=weighting, n_nodes=n_nodes, tol=tol,
                      chunk=node_chunk(self.trajectory, method, len(X)))
        # Query blocks start at the serial call's node chunks where it chooses nodes.
        align = block_align(self.trajectory, method, n_nodes, len(X))
        ranges = step_ranges(self.trajectory, method, weighting, len(X),
                             n_tasks(n_jobs, len(self.trajectory) - 1), n_nodes=n_nodes,
                             tol=tol)
        if ranges is None and min(n_row_blocks(n_jobs, X), -(-len(X) // align)) == 1:
            return finish(*self._decompose_block(X, weights, kwargs, data), units, verb)
        net = self.for_workers(by_reference=local_processes())
        weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        if ranges is not None:  # every worker a range of steps for all queries
            parts = map_calls(_decompose_steps, n_jobs, [(*r, X, weights, net, kwargs)
                                                         for r in ranges])
            return finish(*merge_steps(parts), units, verb)
        # Row blocks of the queries with their rows of the weights.
        rows = np.arange(len(X))
        # Cut where the serial call's node choices are: its numbers.
        parts = map_row_blocks(_decompose_rows, rows, n_jobs, X, weights, net, kwargs,
                               align=align)
        return finish(*merge(parts), units, verb)

    def _decompose_block(self, X, weights, kwargs, data=None):
        """``(result, checks)`` of the queries X in the network's units, no warnings
        (``data``: the training tensors where the caller made them)."""
        X_fit, Y_fit = self._training_data() if data is None else data
        return decompose_path(
            self.module, self.trajectory, X_fit, Y_fit, self.loss, self.tensor(X),
            memory_budget=self.memory_budget, weights=weights, warn=False, **kwargs)

    # ------------------------------------------------------------------ attribution
    @shared_doc(
        ATTRIBUTE,
        note="\n\nOn the network's own outputs: ``y`` holds output columns (class "
             "indices), not labels.",
        X="array-like or tensor of shape (n_queries, ...)\n    Queries in the network's "
          "input form.",
        y="array-like of int of shape (n_queries,) or (n_queries, n_outputs), "
          "default=None\n    With ``output=\"margin\"``: each query's class as an output "
          "column (a 0/1\n    indicator row per query for a ``multilabel`` network, "
          "whose margin is the\n    sum of its logits signed +1 for a label that is on, "
          "-1 for one that is off,\n    as the multilabel classifier's); None takes the "
          "largest output (or a\n    positive single output) as the class (the positive "
          "outputs as the labels).\n    Given with ``output=None``, refused: only the "
          "margin reads it.",
        output_default="None: output 0 of a single-output network (several outputs need "
                       "a choice).",
        examples="",
    )
    @_analyses_own_module
    def attribute(self, X, y=None, *, method: str = "exact", weighting: str = "realized",
                  output=None, n_nodes: int | None = None, tol: float | None = None,
                  n_jobs: int | None = None) -> np.ndarray:
        return self._attribute(X, y, method=method, weighting=weighting, output=output,
                               n_nodes=n_nodes, tol=tol, n_jobs=n_jobs)

    @_analyses_own_module
    def _attribute(self, X, y, *, method, weighting, output, n_nodes, tol, n_jobs,
                   margin: str = "allowed", encode=None, scale=None,
                   multilabel: bool | None = None, standardized=None,
                   also: str = "", verb: str = "attribute") -> np.ndarray:
        """``attribute`` for every caller: ``margin`` as in ``check_output``; ``encode``
        maps the callers' labels to output columns; ``scale`` (C,): the explained
        output is ``scale * f`` (a regressor's target units); ``multilabel``: the
        margin is the multilabel one (see :mod:`.._analysis._attribution`), ``y`` an
        indicator row per query; None: the network's own ``multilabel``;
        ``standardized``: ``(n_rows, constant)`` of a regressor's ``normalize_y`` (see
        :func:`~.._analysis._unrolled.unrolled_scores`), None for none; ``also``: the
        caller's other choices of ``output``, named by its errors (``check_output``);
        ``verb``: the method the user called, named by the decomposition's warnings."""
        check_attribute_args(method, weighting, n_nodes, tol)
        multilabel = self.multilabel if multilabel is None else multilabel
        X = self.check(X)
        prediction = self.outputs(X)
        n_outputs = prediction.shape[1]
        if y is not None and output is None and margin == "allowed" and n_outputs == 1:
            # Output 0 would be explained and the classes dropped without a word (several
            # outputs ask for a choice in check_output).
            raise ValueError("y holds the queries' classes, which only output='margin' "
                             "reads: pass output='margin' to explain their margins, or "
                             "leave y out to explain output 0.")
        output = check_output(output, n_outputs, margin, also, n_queries=len(prediction))
        if encode is None:
            def encode(y):
                if multilabel:
                    return check_indicator(y, n_outputs)
                return class_indices(y, max(n_outputs, 2))
        # A classifier's labels given with another output explain nothing, but are still
        # checked (one per query, of the fitted classes): a wrong y is a mistake either way.
        is_margin = isinstance(output, str)  # checked: "margin", an int or weights
        codes = (query_codes(prediction, y, encode, multilabel)
                 if is_margin or (y is not None and margin == "default") else None)
        weights = output_weights(output, prediction, codes)
        if scale is not None:
            weights = weights * np.asarray(scale, dtype=np.float64).reshape(-1)
        if method == "unrolled":
            X_fit, Y_fit = self._training_data()
            return unrolled_scores(
                self, X_fit, Y_fit, self.tensor(X), weights, n_jobs=n_jobs,
                standardized=None if standardized is None else (prediction, *standardized))
        return self._decompose(X, method=method, weighting=weighting, n_nodes=n_nodes,
                               tol=tol, weights=weights, n_jobs=n_jobs, units=None,
                               verb=verb).contributions[:, :, 0]

    @_analyses_own_module
    def kneighbors(self, X=None, n_neighbors: int = 100, *, kernel: str = "tangent",
                   step: int = -1, normalized: bool = True, return_distance: bool = True):
        """Training points nearest to each query under a kernel.

        The computation behind the estimators' ``kneighbors``, whose parameters these
        are, over ``X_fit``. The path kernel's Gram against the training set and both
        diagonals come from one walk over the path (blocks of recorded points at once
        for a plain MLP).

        Parameters
        ----------
        X : array-like of shape (n_queries, ...), default=None
            Queries in the network's input form. None: every training sample is a
            query whose neighbours are the other training samples (a sample is never
            its own neighbour, even where another sample is at distance 0 from it), as
            scikit-learn's ``kneighbors(X=None)``.
        n_neighbors : int, default=100
            Neighbours per query, at most the number of training samples (less one
            with ``X=None``).
        kernel : {"tangent", "path"}, default="tangent"
            The tangent kernel at ``step`` or the path kernel summed over the path.
        step : int, default=-1
            Recorded point of the tangent kernel; with ``kernel="path"`` only the default
            (the path kernel sums over every recorded point).
        normalized : bool, default=True
            Distances of the cosine-normalised kernel, ``sqrt(2 - 2 k)`` (a zero feature,
            whose normalized kernel and diagonal are 0, at distance 1); otherwise the
            kernel's own feature-space distance.
        return_distance : bool, default=True
            Return the distances as well as the indices.

        Returns
        -------
        distances : ndarray of shape (n_queries, n_neighbors)
            Only when ``return_distance=True``; increasing along each row.
        indices : ndarray of shape (n_queries, n_neighbors)
            Indices into ``X_fit``; among equal distances, the lower index first.
        """
        if not is_option(kernel, "tangent", "path"):
            raise ValueError(f"kernel must be 'tangent' or 'path', got {kernel!r}.")
        check_flag(normalized, "normalized")  # read by an ``if`` before the kernel's check
        # Read by an ``if`` after all the work: "no" returned distances, an array failed
        # there in NumPy's words.
        check_flag(return_distance, "return_distance")
        check_step_applies(kernel, step)
        X_fit = self._training_data_inputs()
        query_is_train = X is None
        _check_n_neighbors(n_neighbors, X_fit.shape[0], query_is_train=query_is_train)
        # The kernels' own normalisation (cosine; 0 against a zero feature).
        k = (KERNELS["tangent"](self, step=step, normalized=normalized)
             if kernel == "tangent" else KERNELS["path"](self, normalized=normalized))
        n_train = X_fit.shape[0]
        Xq = X_fit if query_is_train else self.check(X)
        # Blocks of queries under memory_budget: a block's Gram, squared distances,
        # distances and sort order (float64 and int64, N each per query), not Q x N at
        # once (N x N without X).
        rows = rows_per_block(self.memory_budget, 32 * n_train,
                              "kneighbors' distances to the training set")
        dist_parts, ind_parts = [], []
        for start in range(0, Xq.shape[0], rows):
            block = slice(start, min(start + rows, Xq.shape[0]))
            if query_is_train and block.stop - block.start == n_train:
                dist = _distances(self, k, None, X_fit)
            else:
                dist = _distances(self, k, Xq[block], X_fit)
            if query_is_train:
                # A sample is not its own neighbour, by index rather than by distance:
                # its distance to itself is 0 only up to rounding (a near-duplicate can
                # come out nearer), and an exact duplicate must stay a neighbour.
                # scikit-learn drops the sample from its k + 1 nearest, the same
                # neighbours but where more than k others tie at its own distance.
                own = np.arange(block.stop - block.start)
                dist[own, block.start + own] = np.inf
            # A copy: the slice would keep the block's whole sort order alive.
            ind = np.argsort(dist, axis=1, kind="stable")[:, :n_neighbors].copy()
            ind_parts.append(ind)
            dist_parts.append(np.take_along_axis(dist, ind, axis=1))
        ind = np.concatenate(ind_parts)
        if not return_distance:
            return ind
        return np.concatenate(dist_parts), ind

    def _training_data_inputs(self) -> np.ndarray:
        self._check_fit_read()
        if self.X_fit is None:
            raise ValueError("kneighbors needs the training inputs: this network has no "
                             "X_fit.")
        return self.X_fit

    @_analyses_own_module
    def explain(self, X, n_neighbors: int = 10, *, method: str = "exact", output=None,
                n_jobs: int | None = None, margin: str = "allowed", encode=None,
                scale=None, units=None, multilabel: bool | None = None):
        """The training points that moved each prediction the most.

        The computation behind the estimators' ``explain``, whose parameters
        ``X, n_neighbors, method, output, n_jobs`` these are; ``margin``, ``encode``,
        ``scale`` and ``multilabel`` are those of :meth:`attribute`'s callers, ``units`` maps a
        decomposition of every output into the caller's units (``output="all"``).

        A scalar output (the predicted class's margin, or one output column) is
        explained by :meth:`attribute`'s contracted route: one scalar output per query
        through the whole path, not every output. ``output="all"`` ranks by the
        contributions summed in absolute value over every output, from the full
        :meth:`decompose`.

        Parameters
        ----------
        X : array-like of shape (n_queries, ...)
            Queries in the network's input form.
        n_neighbors : int, default=10
            Training points per query, largest contribution first.
        method : {"exact", "first_order", "second_order"}, default="exact"
            The decomposition's method (see :meth:`decompose`).
        output : "margin", int, array-like of float or "all", default=None
            The scalar output explained (as in :meth:`attribute`: a class's margin, an
            output column or the outputs' weighted sum), or "all" outputs.
        n_jobs : int, default=None
            Query blocks on joblib workers, as in :meth:`decompose`.
        margin : {"allowed", "default", "no"}, default="allowed"
            Whether ``output="margin"`` is allowed, the default, or refused.
        encode : callable, default=None
            Maps the caller's labels to output columns.
        scale : array-like of shape (n_outputs,), default=None
            The explained output is ``scale * f`` (a regressor's target units).
        units : callable, default=None
            Maps a decomposition of every output into the caller's units.
        multilabel : bool or None, default=None
            The margin is a multilabel classifier's: the sum of the predicted labels'
            signed logits. None: the network's ``multilabel``.

        Returns
        -------
        indices : ndarray of shape (n_queries, n_neighbors)
            Rows of ``X_fit`` (an estimator's ``X_fit_``), largest contribution first.
        contributions : ndarray of shape (n_queries, n_neighbors, n_explained)
            Their contributions: one column for a scalar output, ``n_outputs`` for "all".
        """
        # Checked before the decomposition: as kneighbors, never fewer than asked.
        _check_n_neighbors(n_neighbors, self.trajectory.n_samples)
        # The decomposition's methods only, for either output: attribute's own error
        # would offer 'unrolled', which explain refuses.
        check_decompose_args(method, "realized", None, None)
        if isinstance(output, str) and output == "all":
            contributions = self._decompose(
                X, method=method, weighting="realized", n_nodes=None, tol=None,
                n_jobs=n_jobs, weights=None, units=units, verb="explain").contributions
        else:
            scores = self._attribute(X, None, method=method, weighting="realized",
                                     output=output, n_nodes=None, tol=None, n_jobs=n_jobs,
                                     margin=margin, encode=encode, scale=scale,
                                     multilabel=multilabel, also="'all'", verb="explain")
            contributions = scores[:, :, None]
        k = int(n_neighbors)
        magnitude = np.abs(contributions).sum(axis=2)
        order = np.argsort(-magnitude, axis=1, kind="stable")[:, :k]
        return order, np.take_along_axis(contributions, order[:, :, None], axis=1)

    @shared_doc(SELF_INFLUENCE, examples="",
                label='with ``output="margin"``, the margin of its training target: its '
                      "class code, or the positive or largest target column (the "
                      "multilabel margin of its label set for a ``multilabel`` "
                      "network)")
    @_analyses_own_module
    def self_influence(self, *, output=None, n_jobs: int | None = None) -> np.ndarray:
        return self._self_influence(output=output, n_jobs=n_jobs)

    @_analyses_own_module
    def _self_influence(self, *, output, n_jobs, margin: str = "allowed",
                        scale=None, multilabel: bool | None = None,
                        standardized=None) -> np.ndarray:
        multilabel = self.multilabel if multilabel is None else multilabel
        X_fit, Y_fit = self._training_data()
        prediction = self.outputs(X_fit)
        output = check_output(output, prediction.shape[1], margin,
                              n_queries=len(prediction))
        codes = (_target_codes(self.y_fit, multilabel, self.loss.name)
                 if isinstance(output, str) else None)
        weights = output_weights(output, prediction, codes)
        if scale is not None:
            weights = weights * np.asarray(scale, dtype=np.float64).reshape(-1)
        scores = unrolled_scores(
            self, X_fit, Y_fit, X_fit, weights, n_jobs=n_jobs, diagonal=True,
            standardized=None if standardized is None else (prediction, *standardized))
        return np.asarray(scores)[:, 0].view(AttributionScores)._take_measures(scores)

    def _check_fit_read(self) -> None:
        if self.__dict__.get("_unread_fit"):  # absent in a network pickled before
            raise TrajectoryFileError(f"The training set was not read when this model was "
                                      f"loaded: {self._unread_fit}")

    def _training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Training inputs and targets as tensors, checked against the recorded batches."""
        self._check_fit_read()
        if self.X_fit is None or self.y_fit is None or self.loss is None:
            raise ValueError("decompose needs the training inputs, their targets and the "
                             "loss: pass X_train, y_train (X_fit, y_fit) and loss.")
        n_samples, n = self.trajectory.n_samples, len(self.X_fit)
        if n_samples != n:
            raise ValueError(
                f"The trajectory's batches index {n_samples} samples but X_train has {n}; "
                "record with PathRecorder(..., n_samples=len(X_train)) and "
                "recorder.set_batch(indices) at every step."
            )
        # Checked here, not when the network is built: a RecordedNetwork with inputs the
        # decomposition refuses still has its kernels.
        X_fit, Y_fit = self.tensor(self.check(self.X_fit, "X_train")), self.targets()
        if len(Y_fit) != n:
            raise ValueError(f"y_train has {len(Y_fit)} rows but X_train has {n}.")
        if Y_fit.is_floating_point() and not bool(torch.isfinite(Y_fit).all()):
            # The loss's gradients would be NaN: every contribution NaN, without a word.
            raise ValueError("y_train contains NaN or infinity; the decomposition needs "
                             "the finite targets the recorded steps trained on.")
        self._check_loss(X_fit, Y_fit)
        return X_fit, Y_fit

    def _check_loss(self, X: torch.Tensor, Y: torch.Tensor) -> None:
        """Refuse a loss that does not give one value per sample from these targets.

        Probed on the first two rows of ``X`` and ``Y`` (tensors as the loss takes
        them) at the first recorded point, before a long computation: a user's
        per-sample loss, and the library's on targets declared in another form (float
        class codes for "log_loss" on several outputs failed deep inside with torch's
        "expected target dtype to be Long"; one target column for "squared_error" on
        several outputs was broadcast against all of them, another loss silently).
        """
        # On the outputs as every analysis hands them, one row per sample (B, C): a
        # loss written for a module's (B, T, C) outputs must fail here, not inside a
        # decomposition or the unrolled sweep (or silently, by broadcasting).
        custom = isinstance(self.loss, _PerSampleLoss)
        what = "The loss" if custom else f"loss={self.loss.name!r}"
        with torch.no_grad():
            out = functional_call(self.module, self.params_at(0), (forward_input(X[:2]),))
            out = out.reshape(len(out), -1)
            C = out.shape[1]
            if (not custom and self.loss.name == "log_loss" and C > 1 and Y.dim() == 1
                    and not Y.is_floating_point() and len(Y)):
                # Every row's code, not the probe's two: beyond the outputs, cross_entropy
                # raised "Target 7 is out of bounds" from inside the computation on the
                # CPU, and on a GPU it is a device-side assert, after which every CUDA
                # call of the process fails.
                low, high = int(Y.min()), int(Y.max())
                if low < 0 or high >= C:
                    raise ValueError(
                        f"{what} takes integer class codes in [0, {C}) for the network's "
                        f"{C} outputs, but y_train holds {low if low < 0 else high}.")
            if (not custom and self.loss.name == "squared_error"
                    and tuple(Y.shape[1:]) != tuple(out.shape[1:])):
                flat = int(np.prod(Y.shape[1:])) == out.shape[1] and Y.dim() > 2
                raise ValueError(
                    f"{what} compares every output with its own target, but y_train has "
                    f"{tuple(Y.shape[1:])} values per sample and the network "
                    f"{out.shape[1]} outputs."
                    + (" Every analysis flattens the module's outputs per sample (an "
                       "image's pixels in C order): flatten the targets the same way, "
                       "y_train.reshape(len(y_train), -1)." if flat else ""))
            try:
                probe = self.loss.per_sample(out, Y[:2])
            except (RuntimeError, ValueError, IndexError) as exc:
                hint = ("" if custom or self.loss.name != "log_loss" else
                        " log_loss takes integer class codes (several outputs), 0/1 "
                        "targets (one output) or a 0/1 indicator of the outputs' shape.")
                raise ValueError(
                    f"{what} is called as per_sample(output, target) with the "
                    "module's outputs flattened per sample, shape (B, C) (here "
                    f"{tuple(out.shape)}), and the targets as y_train gives them "
                    f"({Y.dtype}, shape {tuple(Y.shape)}); it raised "
                    f"{type(exc).__name__}: {exc}.{hint}") from exc
        if probe.shape != (len(X[:2]),):
            raise ValueError(
                f"{what} must return one value per sample, shape (B,), from the "
                "module's outputs flattened per sample, shape (B, C); it returned "
                f"shape {tuple(probe.shape)}."
            )

    # ------------------------------------------------------------------ workers
    def with_own_module(self) -> TrainedNetwork:
        """A copy with its own copy of the module, for a concurrent task.

        Concurrent tasks can share one network (threads, a Dask worker's thread pool)
        and the engine hooks the module it runs.

        Returns
        -------
        network : TrainedNetwork
            A copy sharing everything but the module.
        """
        return self.replace(module=copy_module(self.module))

    def for_workers(self, *, by_reference: bool = False) -> TrainedNetwork:
        """A copy whose on-disk trajectory is referenced, for tasks pickled to workers.

        Pickling the trajectory itself would make its temporary directory permanent
        (see :class:`~skpathkernel.Trajectory`); a trajectory in memory is shared, or
        with ``by_reference`` (worker processes of this machine) written once to files
        that the workers map (:meth:`~skpathkernel.Trajectory.for_workers`).

        Parameters
        ----------
        by_reference : bool, default=False
            Send an in-memory trajectory as the name of its shared files.

        Returns
        -------
        network : TrainedNetwork
            A copy whose trajectory pickles as a reference to its files.
        """
        return self.replace(trajectory=self.trajectory.for_workers(
            by_reference=by_reference))


def output_block_rows(memory_budget: int, widths, dtype: torch.dtype, *,
                      fixed: bool) -> int:
    """Rows of a block of network outputs under ``memory_budget``.

    ``widths``: values per sample of the input, the outputs and every activation; the
    widest bounds a block's memory (8 of it per row: autograd-free, but a layer's input,
    output and temporaries coexist). ``fixed``: at most ``FIXED_BLOCK`` rows, the size
    every block of :func:`map_fixed_blocks` has.
    """
    row = 8 * max(widths) * torch.empty((), dtype=dtype).element_size()
    return (feature_block_rows if fixed else rows_per_block)(memory_budget, row, "Prediction")


def module_outputs(module: torch.nn.Module, X: torch.Tensor, block: int, *, params=None,
                   fixed: bool = True) -> np.ndarray:
    """``module(X)`` as float64 NumPy of shape (n, C), in blocks of ``block`` rows.

    ``params``: parameters by name to call the module with (``functional_call``), None
    for its own. ``fixed``: every block exactly ``block`` rows (see
    :func:`map_fixed_blocks`); otherwise the last one is shorter.
    """

    def run(xb):
        # Checkpointed regions plainly (functional_call's do): a reentrant one warns that
        # no input requires grad.
        with torch.no_grad(), plain_checkpoints():
            xb = forward_input(xb)  # a module may write into its input
            out = module(xb) if params is None else functional_call(module, params, (xb,))
        return to_numpy(out.reshape(len(xb), -1))

    if not len(X):
        out = run(X)
    elif fixed:
        out = map_fixed_blocks(run, X, block)
    else:
        out = np.concatenate([run(X[i : i + block]) for i in range(0, len(X), block)])
    return out.astype(np.float64, copy=False)


def warn_not_finite(outputs: np.ndarray) -> np.ndarray:
    """``outputs``, with a RuntimeWarning naming the rows where the network's own output
    is NaN or inf.

    A classifier's ``predict`` turned such a row into a label without a word (``argmax``
    of NaN is the first class, ``NaN > 0`` is False): an attention whose every key is
    masked (a sequence of padding alone) outputs NaN in any dtype.
    """
    bad = np.flatnonzero(~np.isfinite(outputs).reshape(len(outputs), -1).all(axis=1))
    if len(bad):
        rows = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warnings.warn(
            f"The network's outputs are NaN or inf at {len(bad)} of {len(outputs)} inputs "
            f"(rows {rows}): its forward is not finite there (e.g. an attention whose every "
            "key is masked, a sequence of padding alone, or a mean over no unmasked "
            "position), and a classifier's labels and probabilities of those rows mean "
            "nothing. Leave such inputs out, or make the forward finite on them.",
            RuntimeWarning, stacklevel=caller_stacklevel())
    return outputs


def _decompose_rows(rows, X, weights, net: TrainedNetwork, kwargs):
    """One query block's ``(result, checks)`` on a joblib worker (its own module: the
    engine hooks the module it runs, and threads share the network)."""
    block = slice(int(rows[0]), int(rows[-1]) + 1)
    return net.with_own_module()._decompose_block(
        X[block], None if weights is None else weights[block], kwargs)


def _decompose_steps(start, stop, X, weights, net: TrainedNetwork, kwargs):
    """The ``(result, checks)`` of the steps of intervals ``[start, stop)`` for every
    query, on a joblib worker."""
    return net.with_own_module()._decompose_block(
        X, weights, {**kwargs, "intervals": (start, stop)})


def _as_array(values, name: str) -> np.ndarray:
    """Training data as an array of rows. A sparse matrix, or a scalar, became a 0-d
    array taken for one sample of shape ``()``: every later call then failed in words
    about the queries' shape, or in ``len()`` of an unsized object."""
    if issparse(values):
        raise TypeError(f"{name} must be dense; got a sparse matrix: pass its "
                        ".toarray().")
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) \
        else np.asarray(values)
    if array.ndim == 0:
        raise ValueError(f"{name} must hold one row per sample, shape (n_samples, ...); "
                         f"got {values!r}.")
    return array


def _check_module_matches(module: torch.nn.Module, trajectory: Trajectory) -> None:
    """Refuse a trajectory recorded from another network (e.g. a directory of another run)."""
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    for name, shape in zip(trajectory.names, trajectory.shapes):
        if shapes.get(name) != tuple(shape):
            where = ("" if trajectory.directory is None
                     else f" (on disk in {trajectory.directory!r})")
            have = "missing" if name not in shapes else f"of shape {shapes[name]}"
            raise ValueError(
                f"The trajectory{where} was recorded from another network: its parameter "
                f"{name!r} has shape {tuple(shape)}, the module's is {have}."
                + _wrapper_hint(module, trajectory, shapes)
            )


def _wrapper_hint(module: torch.nn.Module, trajectory: Trajectory, shapes: dict) -> str:
    """Where ``module`` wraps the recorded network (its parameters are the path's under
    one prefix: a DistributedDataParallel's ``module.``), a sentence naming the submodule
    to pass instead; else an empty string."""
    first = trajectory.names[0]
    for key in shapes:
        prefix = key[: len(key) - len(first)]
        if not (prefix.endswith(".") and key.endswith("." + first)):
            continue
        if all(shapes.get(prefix + n) == tuple(s)
               for n, s in zip(trajectory.names, trajectory.shapes)):
            return (f" But the module holds every recorded parameter under the prefix "
                    f"{prefix!r} ({prefix + first!r}): it wraps the recorded network, as a "
                    "DistributedDataParallel does (PathRecorder records one through its "
                    "`.module`). Pass the wrapped network, "
                    f"module.get_submodule({prefix[:-1]!r}) (`ddp.module`), or build it "
                    "with recorder.as_estimator(X_train, y_train).")
    return ""


def network_of(obj) -> TrainedNetwork:
    """The :class:`TrainedNetwork` of a fitted estimator, a RecordedNetwork or itself.

    Every consumer of a fitted network (kernels, decomposition, displays, diagnostics)
    reads it through this accessor: a fitted skpathkernel estimator's ``network_`` (also
    through :class:`sklearn.frozen.FrozenEstimator`, which forwards attributes), with the
    estimator's current ``memory_budget``.

    Raises
    ------
    NotFittedError
        For an estimator that is not fitted.
    TypeError
        For an object that is neither an estimator nor a TrainedNetwork, or a fitted
        estimator without a network.
    """
    if isinstance(obj, TrainedNetwork):
        return obj
    try:
        check_is_fitted(obj, "network_")
    except NotFittedError:
        if not _fitted(obj):
            raise
        # A fitted estimator of another library (Ridge, a Pipeline): not fitting it again
        # is not what would help.
        raise TypeError(
            f"{type(obj).__name__} exposes no fitted network (network_): pass a fitted "
            f"skpathkernel estimator, a RecordedNetwork or a TrainedNetwork."
            f"{_wrapped_network_hint(obj)}"
        ) from None
    net = obj.network_
    if not isinstance(net, TrainedNetwork):
        raise TypeError(f"{type(obj).__name__}.network_ is not a TrainedNetwork.")
    # The budget is a parameter of the estimator: set_params(memory_budget=...) after fit
    # changes how the fitted network is computed with, not the network.
    budget = getattr(obj, "memory_budget", None)
    if budget is not None and int(budget) != net.memory_budget:
        net = net.replace(memory_budget=int(budget))
    return net


def warn_recorded_probes(module, x) -> None:
    """A recorded loop's probes of its network on inputs ``x`` (64 rows of X_train, or of
    its first analysis's inputs without them): a layer drawing at random in training mode
    (UserWarning), else the analyses' fallback (FallbackWarning), as the estimators' fit
    warns. A forward that draws disagrees with any rule, so its routes say nothing."""
    drawn = warn_random_forward(module, x, advice=RECORDED_ADVICE)
    if not (drawn or draws_in_training(module)):
        warn_on_fallback(module, x)


def pipeline_last_step(estimator, *inputs):
    """The estimator holding the network inside a fitted :class:`~sklearn.pipeline.Pipeline`
    or search, and ``inputs`` (None passes) as that estimator takes them; anything else is
    returned as given.

    A pipeline stands for its last step, on the inputs the steps before it transform
    (``pipe[-1]`` on ``pipe[:-1].transform(X)``; a pipeline ending in a pipeline is
    followed down); a search refitted on the whole data (GridSearchCV,
    RandomizedSearchCV, ``refit=True``) for its ``best_estimator_``, and a
    :class:`~sklearn.frozen.FrozenEstimator` for its estimator, on the inputs as they
    are; nested in each other, in any order. A fitted meta-estimator whose ``estimator_``
    is such a pipeline or search (``TangentFeatures(FrozenEstimator(pipe))``) stands for
    it. The kernels, the displays and the
    diagnostics take them so, as scikit-learn's displays take a pipeline. The wrappers
    whose network saw other inputs or targets (a bag, one estimator per output, a
    ``TransformedTargetRegressor``, whose prediction is not the network's output), a
    search without ``refit`` and an unfitted pipeline or search are returned as given,
    for :func:`network_of` to refuse with its hint or scikit-learn's NotFittedError."""
    chain = _followed(estimator)
    if not (hasattr(chain[-1], "network_") or isinstance(chain[-1], TrainedNetwork)):
        # A wrapper in the last step (TransformedTargetRegressor, a bag), or not fitted:
        # network_of refuses the whole object, with the hint naming the whole way
        # (pipe[-1].regressor_ on pipe[:-1].transform(X)), where the last step's hint
        # lost the pipeline's part of it.
        return (estimator, *inputs)
    for outer in chain[:-1]:
        # A search's best_estimator_ was refitted on the inputs as they are.
        if isinstance(outer, Pipeline):
            check_is_fitted(outer)
            if len(outer) > 1:  # steps before the last
                head = outer[:-1]
                inputs = tuple(None if a is None else head.transform(a) for a in inputs)
    return (chain[-1], *inputs)


def with_last_step(estimator, model):
    """``estimator`` with ``model`` in place of the estimator that
    :func:`pipeline_last_step` finds in it: shallow copies of the pipelines and searches
    on the way (their fitted steps shared), ``model`` itself where there are none. What
    a replayed network is called through, as the fitted wrapper is."""
    for outer in reversed(_followed(estimator)[:-1]):
        outer = copy.copy(outer)
        if isinstance(outer, Pipeline):
            outer.steps = [*outer.steps[:-1], (outer.steps[-1][0], model)]
        elif isinstance(outer, FrozenEstimator):
            outer.estimator = model
        else:
            outer.best_estimator_ = model
        model = outer
    return model


def _followed(estimator) -> list:
    """``estimator`` and the estimators inside it that :func:`pipeline_last_step` follows
    (a pipeline's last step, a refitted search's ``best_estimator_``, a
    FrozenEstimator's estimator, the pipeline or search a fitted meta-estimator reads),
    outermost first."""
    chain = [estimator]
    while True:
        last = chain[-1]
        if isinstance(last, Pipeline) and len(last):
            chain.append(last[-1])
        elif isinstance(last, FrozenEstimator):
            # The kernels' guide compares fitted networks in a search as frozen ones
            # (kernel__estimator: [FrozenEstimator(a), ...]); a frozen pipeline forwards
            # no network_, its last step holds it.
            chain.append(last.estimator)
        elif _is_refit_search(last):
            chain.append(last.best_estimator_)
        elif callable(getattr(last, "_network_wrapper", None)) \
                and last._network_wrapper() is not None:
            # A fitted meta-estimator (TangentFeatures, ...) reading the network of a
            # pipeline or a search stands for it: its network takes X as that wrapper
            # hands it to its last step, not as the meta-estimator is given it.
            chain.append(last._network_wrapper())
        else:
            return chain


def _is_refit_search(obj) -> bool:
    """Whether ``obj`` is a fitted scikit-learn search that refitted its best candidate on
    the whole data (``best_estimator_``, fitted on the inputs and targets the search got).

    By the search's attributes (``cv_results_`` and ``best_estimator_``), not its class:
    the halving searches and other libraries' (scikit-optimize's) keep the same contract,
    and scikit-learn exports no base class for it. And by its ``refit``: a search fitted
    again with ``refit=False`` keeps the ``best_estimator_`` of an earlier fit, which its
    own ``predict`` refuses; read, it would be a network its last fit never chose."""
    return (hasattr(obj, "cv_results_") and hasattr(obj, "best_estimator_")
            and bool(getattr(obj, "refit", True)))


def _wrapped_network_hint(obj) -> str:
    """Where a scikit-learn wrapper fitted around a network keeps it, for the error of a
    kernel or function given the wrapper (a pipeline, a search, TransformedTargetRegressor,
    MultiOutputRegressor, nested in one another), which names no way to the network
    inside."""
    route = _network_route(obj)
    if route is not None:
        if getattr(obj, "steps", None):
            where = ("For a pipeline ending in one, pass its last step" if route[0] == "[-1]"
                     else "For a pipeline, pass the estimator in its last step that holds one")
        else:
            where = "Pass the fitted estimator it holds"
        path, on = _route_code(obj, route)
        # TransformedTargetRegressor's network is trained on func(y).
        units = (", whose network was trained on the transformed targets"
                 if "regressor_" in path else "")
        return f" {where}, {path}{units}{on}."
    # A bag, one estimator per output or a search without refit, also where a pipeline
    # or a search holds it (the way to a bag's estimators named as the way to a network).
    holder = _followed(obj)[-1]
    if hasattr(holder, "cv_results_") and not _is_refit_search(holder):
        return (" A search fitted with refit=False keeps no fitted estimator: fit it with "
                "refit=True, and its best_estimator_ is the one read.")
    inner = getattr(holder, "estimators_", None)
    if not isinstance(inner, list):
        return ""
    found = [i for i, est in enumerate(inner) if _network_route(est) == ("", [])]
    route = _network_route(obj, holder=holder)
    if not found or route is None:
        return ""
    path, on = _route_code(obj, route)
    path = f"{path}." if path else ""
    if isinstance(holder, (MultiOutputRegressor, MultiOutputClassifier)):
        return (f" It holds one fitted estimator per target in {path}estimators_: pass one "
                f"of them, {path}estimators_[i]{on}.")
    # A bag's estimator saw a sample of the rows and estimators_features_'s columns, a
    # chain's X with the earlier targets appended: not X as it is.
    return (f" Its {path}estimators_[{found[0]}] holds one, fitted on the inputs "
            f"{type(holder).__name__} gave it, which need not be X as it is.")


def _route_code(obj, route) -> tuple[str, str]:
    """A :func:`_network_route` of ``obj`` as code: the way (``pipe[-1].regressor_``,
    ``best_estimator_[-1]``; empty for ``obj`` itself) and where it has earlier steps, the
    clause naming the inputs they transform (``pipe[:-1].transform(X)``)."""
    path, steps = route
    path = "pipe" + path if getattr(obj, "steps", None) else path[1:]
    inputs = "X"
    for before in steps:
        # The estimator at the end sees the inputs its pipelines' earlier steps transform.
        inputs = f"{'pipe' if before[0] == '[' else ''}{before.lstrip('.')}" \
                 f".transform({inputs})"
    return path, ("" if inputs == "X" else
                  f", on inputs transformed by the steps before it ({inputs})")


def _network_route(obj, depth: int = 4, holder=None) -> tuple[str, list[str]] | None:
    """The way from a fitted wrapper to the estimator holding the network
    (``".best_estimator_[-1]"``), or to ``holder`` where given, and the pipelines whose
    earlier steps transform its inputs, outermost first (``[".best_estimator_[:-1]"]``);
    None where there is none."""
    while holder is not None and isinstance(obj, FrozenEstimator) and obj is not holder:
        # It forwards its estimator's attributes: the way through it is the same.
        obj = obj.estimator
    if (hasattr(obj, "network_") if holder is None else obj is holder):
        return "", []
    if depth == 0:
        return None
    steps = getattr(obj, "steps", None)
    if steps:
        found = _network_route(steps[-1][1], depth - 1, holder)
        return None if found is None else (
            "[-1]" + found[0], ["[:-1]", *("[-1]" + step for step in found[1])])
    for name in ("best_estimator_", "regressor_", "estimator_"):
        # A search fitted again without refit keeps an earlier fit's best_estimator_.
        inner = (None if name == "best_estimator_" and not getattr(obj, "refit", True)
                 else getattr(obj, name, None))
        found = (None if inner is None or inner is obj
                 else _network_route(inner, depth - 1, holder))
        if found is not None:
            return f".{name}{found[0]}", [f".{name}{step}" for step in found[1]]
    return None


def _fitted(estimator) -> bool:
    try:
        check_is_fitted(estimator)
    except NotFittedError:
        return False
    return True


def check_step_applies(kernel: str, step) -> None:
    """Refuse a ``step`` other than the default -1 where ``kernel`` does not read it: the
    path kernel sums over every recorded point, and distances in input space have none.
    Ignored silently, a grid over ``step`` would compare equal results."""
    if kernel != "tangent" and not (isinstance(step, numbers.Integral)
                                    and not isinstance(step, bool) and step == -1):
        where = ("the path kernel sums over every recorded point (PathKernel(est, "
                 "start=..., stop=...) restricts it)" if kernel == "path"
                 else f"kernel={kernel!r} reads no recorded point")
        raise ValueError(f"step={step!r} applies to kernel='tangent'; {where}.")


def _distances(net, k, Xq, X_fit) -> np.ndarray:
    """Distances of the queries ``Xq`` (checked; None: the training set itself, its
    symmetric Gram in one pass) to every training input under ``net``'s kernel ``k``,
    ``sqrt(k(x, x) + k(y, y) - 2 k(x, y))`` with the diagonals ``k`` gives (normalized: 1,
    or 0 for a zero feature, which lies at distance 1 from every feature with a direction)."""
    if Xq is None:
        K = k(X_fit)
        dx = dy = K.diagonal()
    else:
        K, dx, dy = k._bind(net)._sums(Xq, X_fit)
    return np.sqrt(np.maximum(dx[:, None] + dy[None, :] - 2.0 * K, 0.0))


def _check_n_neighbors(n_neighbors, n_train: int, *, query_is_train: bool = False) -> None:
    """``n_neighbors`` an integer in ``[1, n_train]``, as sklearn's ``kneighbors`` asks;
    ``[1, n_train - 1]`` where the queries are the training samples themselves, each
    without itself (sklearn's ``n_neighbors < n_samples_fit`` for ``X=None``)."""
    high, what = ((n_train - 1, "the number of training samples less one: with X=None "
                   "a sample is not its own neighbour") if query_is_train
                  else (n_train, "the number of training samples"))
    if high < 1:
        raise ValueError(f"kneighbors() without X needs at least 2 training samples (a "
                         f"sample is not its own neighbour); this network has {n_train}.")
    if (isinstance(n_neighbors, bool) or not isinstance(n_neighbors, numbers.Integral)
            or not 0 < n_neighbors <= high):
        raise ValueError(
            f"n_neighbors must be an integer in [1, {high}] ({what}), got {n_neighbors!r}."
        )
