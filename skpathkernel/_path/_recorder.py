"""Record the optimisation path of your own training loop.

:class:`PathRecorder` attaches to a ``torch.optim`` optimizer and records every
``optimizer.step()`` into the same :class:`~skpathkernel.Trajectory` that the estimators
build; :class:`RecordedNetwork` wraps the recorded path so that
:class:`~skpathkernel.TangentKernel`, :class:`~skpathkernel.PathKernel` and the exact
per-training-point decomposition work on it as on a fitted estimator.

How recording works
-------------------
The recorder registers a step post-hook on the optimizer
(``optimizer.register_step_post_hook``): the parameters, the optimizer's second moments
and the step size are copied right after each update, *inside* ``optimizer.step()``. So the
step size recorded is the one the update used whatever the order of ``scheduler.step()``
in the loop, a step skipped by ``torch.amp.GradScaler`` is not recorded, and no call can
be forgotten. The samples of a step, when the decomposition is wanted, are declared with
:meth:`PathRecorder.set_batch` before ``optimizer.step()``.

Supported optimizers: ``torch.optim.SGD`` (``momentum``, ``weight_decay``), ``Adam``,
``AdamW`` (``betas``, ``eps``, ``weight_decay``) and ``RMSprop`` (``alpha``, ``eps``,
``weight_decay``): the update rules that the kernels' preconditioner and the
decomposition's adjoint recursion model. Options that change the rule (``nesterov``,
``dampening``, ``amsgrad``, ``centered``, RMSprop ``momentum``, ``maximize``,
``differentiable``) are refused. Several parameter groups are accepted only with the same
hyper-parameters and the same step size in every group (e.g. groups made only to freeze
or order parameters): the trajectory has one step size per step.

What the decomposition means, and when it is exact, for losses that are not per-sample
supervised (diffusion, GANs) is in the user guide: "Theory", section "What is exact, and
what it means, for any loss".
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable

import numpy as np
import torch
from sklearn.base import BaseEstimator

from .._estimators._base import NetworkAttributesMixin
from .._network._docs import ATTRIBUTE, DECOMPOSE, SELF_INFLUENCE, shared_doc
from .._network._trained import TrainedNetwork
from ..kernels import NetworkKernelsMixin
from ._trajectory import SolverSpec, Trajectory, TrajectoryRecorder

__all__ = ["PathRecorder", "RecordedNetwork", "solver_spec_from_optimizer"]

# Options whose non-default values change the update rule away from what the kernels'
# preconditioner and the decomposition's recursion model, per optimizer class.
_REFUSED = {
    "SGD": {"nesterov": False, "dampening": 0, "maximize": False, "differentiable": False},
    "Adam": {"amsgrad": False, "maximize": False, "differentiable": False},
    "AdamW": {"amsgrad": False, "maximize": False, "differentiable": False},
    "RMSprop": {"centered": False, "momentum": 0, "maximize": False,
                "differentiable": False},
}
# Group entries that define the update rule besides the step size. Only these are
# compared between groups and across steps: schedulers add their own bookkeeping entries
# (initial_lr, max_lr, base_momentum, ...), and foreach / fused / capturable only choose
# an implementation.
_RULE_KEYS = ("momentum", "dampening", "nesterov", "betas", "eps", "alpha", "weight_decay",
              "amsgrad", "centered", "maximize", "differentiable", "decoupled_weight_decay")


def _as_float(v) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def solver_spec_from_optimizer(optimizer: torch.optim.Optimizer) -> SolverSpec:
    """The :class:`~skpathkernel._path._trajectory.SolverSpec` of a torch.optim optimizer.

    Reads the hyper-parameters from ``optimizer.param_groups`` and refuses optimizers and
    options whose update rule the path kernel and the decomposition do not model.

    Parameters
    ----------
    optimizer : torch.optim.SGD, Adam, AdamW or RMSprop

    Returns
    -------
    spec : SolverSpec

    Raises
    ------
    TypeError
        For another optimizer class.
    ValueError
        For an unsupported option, or parameter groups with different hyper-parameters.
    """
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                               torch.optim.RMSprop):
        raise TypeError(
            f"PathRecorder records torch.optim.SGD, Adam, AdamW and RMSprop; got {kind}. "
            "The path kernel and the decomposition model those update rules only."
        )
    groups = optimizer.param_groups
    first = _rule(groups[0])
    for i, g in enumerate(groups[1:], start=1):
        other = _rule(g)
        if other != first or _as_float(g["lr"]) != _as_float(groups[0]["lr"]):
            raise ValueError(
                f"Parameter group {i} of the {kind} optimizer has hyper-parameters that "
                "differ from group 0; a recorded trajectory has one step size and one set "
                "of hyper-parameters. Use one parameter group, or groups that agree."
            )
    for option, default in _REFUSED[kind].items():
        value = first.get(option, default)
        if value != default:
            raise ValueError(
                f"PathRecorder does not support torch.optim.{kind} with {option}={value!r}: "
                "it changes the update rule that the path kernel and the exact "
                f"decomposition model. Use {option}={default!r}."
            )
    wd = _as_float(first.get("weight_decay", 0.0))
    if kind == "SGD":
        return SolverSpec(name="sgd", momentum=_as_float(first["momentum"]), weight_decay=wd)
    if kind == "RMSprop":
        return SolverSpec(name="rmsprop", epsilon=_as_float(first["eps"]),
                          rmsprop_alpha=_as_float(first["alpha"]), weight_decay=wd)
    b1, b2 = (_as_float(b) for b in first["betas"])
    # torch.optim.Adam(decoupled_weight_decay=True) is AdamW's rule.
    decoupled = kind == "AdamW" or bool(first.get("decoupled_weight_decay", False))
    return SolverSpec(name="adamw" if decoupled else "adam", beta_1=b1, beta_2=b2,
                      epsilon=_as_float(first["eps"]), weight_decay=wd)


def _rule(group: dict) -> dict:
    return {k: group[k] for k in _RULE_KEYS if k in group}


def _hyper_parameters(optimizer) -> list[dict]:
    return [_rule(g) for g in optimizer.param_groups]


class PathRecorder:
    """Record the optimisation path of a training loop that you write yourself.

    Attaches a step post-hook to ``optimizer``: every ``optimizer.step()`` records the
    parameters (every ``record_every`` steps, plus the current ones when the trajectory is
    read), the optimizer's second moments that define the preconditioner, and the step
    size read from ``optimizer.param_groups`` at that step, so learning-rate schedulers
    are recorded whatever the order of ``scheduler.step()`` in the loop (schedulers that
    also change momentum or betas, such as ``OneCycleLR`` with ``cycle_momentum=True``,
    are refused at their first step: one set of them is recorded). The initial
    parameters are recorded when the recorder is created, which must be before the first
    ``optimizer.step()``.

    For the per-training-point decomposition, give ``n_samples`` and declare each step's
    samples with :meth:`set_batch` before ``optimizer.step()``; what the decomposition
    means, and when it is exact, for losses that are not per-sample supervised (diffusion,
    GANs) is in the user guide (:ref:`theory-any-loss`).

    Parameters
    ----------
    module : torch.nn.Module
        The network, called as ``module(X)`` on a tensor of inputs of shape
        ``(n_samples, ...)`` (floats, or int64 token ids). Its parameters
        that the optimizer updates are recorded (in ``named_parameters`` order); it must
        have no cross-sample state (no BatchNorm in train mode, no dropout) for the
        kernels and the decomposition to describe it.
    optimizer : torch.optim.SGD, Adam, AdamW or RMSprop
        Fresh (no step taken yet). Hyper-parameters are read from its parameter groups;
        see :func:`solver_spec_from_optimizer` for what is refused.
    record_every : int, default=1
        Record the parameters every ``record_every`` steps; 1 is needed by the
        decomposition. With more, a recorded point stands for the mean step size of its
        interval in the path kernel.
    n_samples : int, default=None
        Size of the training set that :meth:`set_batch` indexes into. When given, every
        step must declare its batch; when None, batches are not recorded (the kernels
        work, the decomposition does not).
    storage : {"memory", "disk", "auto"}, default="memory"
        Where the recorded vectors go: memory buffers that double when full, or chunk
        files in a fresh temporary directory under ``directory``, written as recording
        goes and read lazily (see the estimators' ``trajectory_storage``). "auto"
        records in memory and moves what it holds to disk when the vectors pass
        ``memory_budget`` bytes. ``trajectory.save(path)`` moves the directory (a
        rename) and keeps it; otherwise it is deleted with the last trajectory using
        it. A full disk keeps the rest in memory, with a warning naming the file and
        the step.
    directory : str, path-like or None, default=None
        Parent of the on-disk trajectory's directory; None is the system's temporary
        directory.
    memory_budget : int, default=2**30
        The size bound of ``storage="auto"``; chunk files hold at most 1/32 of it.
    compression : {None, "float16", "bfloat16"}, default=None
        On disk, store each point's parameters as its difference from the previous
        stored point in this dtype (lossy: see the estimators'
        ``trajectory_compression``; the decomposition's ``error`` reports the cost).

    Attributes
    ----------
    module : torch.nn.Module
    optimizer : torch.optim.Optimizer
    solver_spec : SolverSpec
        The optimizer and hyper-parameters read from it.

    See Also
    --------
    RecordedNetwork : The recorded path as an object the kernels accept.

    Examples
    --------
    >>> import torch
    >>> from skpathkernel import PathRecorder
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> X, y = torch.randn(8, 2), torch.randn(8, 1)
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    >>> with PathRecorder(net, opt, n_samples=8) as rec:
    ...     for step in range(4):
    ...         idx = torch.arange(4) + 4 * (step % 2)
    ...         opt.zero_grad()
    ...         (0.5 * (net(X[idx]) - y[idx]) ** 2).mean().backward()
    ...         rec.set_batch(idx)
    ...         opt.step()
    ...         sched.step()
    >>> traj = rec.trajectory
    >>> len(traj), traj.learning_rates.tolist()
    (5, [0.1, 0.1, 0.05, 0.05])
    >>> net_k = rec.as_estimator(X, y, loss="squared_error")
    >>> res = net_k.decompose(X[:2])
    >>> res.contributions.shape, bool(res.error < 1e-5)
    ((2, 8, 1), True)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        record_every: int = 1,
        n_samples: int | None = None,
        storage: str = "memory",
        directory: str | os.PathLike | None = None,
        memory_budget: int = 2**30,
        compression: str | None = None,
    ):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if not isinstance(record_every, numbers.Integral) or record_every < 1:
            raise ValueError(f"record_every must be a positive integer, got {record_every!r}.")
        if n_samples is not None and (not isinstance(n_samples, numbers.Integral)
                                      or n_samples < 1):
            raise ValueError(f"n_samples must be a positive integer or None, got {n_samples!r}.")
        if storage not in ("memory", "disk", "auto"):
            raise ValueError(f"storage must be 'memory', 'disk' or 'auto', got {storage!r}.")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path or None, got {directory!r}.")
        if compression not in (None, "float16", "bfloat16") or (
                compression is not None and storage == "memory"):
            raise ValueError(f"compression must be None, 'float16' or 'bfloat16', with "
                             f"storage 'disk' or 'auto'; got {compression!r} with "
                             f"storage={storage!r}.")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral) \
                or memory_budget < 2**20:
            raise ValueError(f"memory_budget must be an int >= 2**20, got {memory_budget!r}.")
        self.solver_spec = solver_spec_from_optimizer(optimizer)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in module.named_parameters() if id(p) in in_optimizer]
        if len(named) != len(in_optimizer):
            raise ValueError(
                "The optimizer updates tensors that are not parameters of the module; the "
                "recorder needs every updated tensor to be a named module parameter."
            )
        params = [p for _, p in named]
        if any(optimizer.state.get(p) for p in params):
            raise ValueError(
                "The optimizer has already taken steps: create the PathRecorder before the "
                "first optimizer.step(), so that the path starts where the optimizer state "
                "does."
            )
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
            raise ValueError(
                f"The recorded parameters must all be float32 or all float64, got {dtypes}."
            )
        self.module = module
        self.optimizer = optimizer
        self.record_every = int(record_every)
        self.n_samples = None if n_samples is None else int(n_samples)
        self.storage = storage
        self.directory = directory
        self.memory_budget = int(memory_budget)
        self.compression = compression
        self._recorder = TrajectoryRecorder(
            params, [n for n, _ in named], n_steps=None, record_every=self.record_every,
            solver=self.solver_spec, n_samples=self.n_samples or 0, batch_size=None,
            dtype=params[0].dtype, storage=storage, directory=directory,
            memory_budget=self.memory_budget, compression=compression,
        )
        self._recorder.record_point(0)
        self._pending = None
        self._max_index = -1
        self._error = None
        self._hyper = _hyper_parameters(optimizer)
        self._handle = optimizer.register_step_post_hook(self._after_step)

    # ------------------------------------------------------------------ recording
    def set_batch(self, indices) -> None:
        """Declare the training samples of the next ``optimizer.step()``.

        Parameters
        ----------
        indices : array-like of int, shape (batch_size,)
            Indices into the ``n_samples`` training inputs that the step's loss averages
            over (the decomposition credits the step to them with weight
            ``1 / batch_size``).
        """
        if self.n_samples is None:
            raise ValueError(
                "set_batch needs the size of the training set: create the recorder with "
                "PathRecorder(module, optimizer, n_samples=N)."
            )
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(f"indices must be a 1-D array of integers, got {idx!r}.")
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_samples):
            raise ValueError(
                f"Batch indices must lie in [0, {self.n_samples}) (n_samples), got "
                f"[{idx.min()}, {idx.max()}]."
            )
        self._pending = idx.astype(np.int64, copy=False)

    def _after_step(self, optimizer, args, kwargs) -> None:
        rec = self._recorder
        step = rec.n_recorded_steps
        lrs = {_as_float(g["lr"]) for g in optimizer.param_groups}
        if len(lrs) != 1:
            self._error = (f"at optimizer step {step} the parameter groups had different "
                           f"learning rates {sorted(lrs)}; one step size per step is needed.")
            raise RuntimeError(f"PathRecorder: {self._error}")
        if _hyper_parameters(optimizer) != self._hyper:
            # e.g. OneCycleLR / CyclicLR cycling momentum or betas: the trajectory stores
            # one set of hyper-parameters, only the step size may vary per step.
            self._error = (f"at optimizer step {step} a hyper-parameter other than the "
                           f"learning rate changed: {self._hyper} became "
                           f"{_hyper_parameters(optimizer)} (a scheduler cycling momentum? "
                           "use cycle_momentum=False).")
            raise RuntimeError(f"PathRecorder: {self._error}")
        if self.n_samples is not None and self._pending is None:
            self._error = (f"optimizer step {step} had no batch declared: call "
                           "recorder.set_batch(indices) before every optimizer.step().")
            raise RuntimeError(f"PathRecorder: {self._error}")
        batch = self._pending if self._pending is not None else np.empty(0, dtype=np.int64)
        self._pending = None
        rec.record_batch(batch)
        rec.record_step(step, lrs.pop(), optimizer)
        if rec.wants_point(step + 1):
            rec.record_point(step + 1)

    def close(self) -> None:
        """Stop recording (remove the hook); the trajectory stays readable."""
        self._handle.remove()

    def __enter__(self) -> PathRecorder:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # ------------------------------------------------------------------ reading
    @property
    def n_steps(self) -> int:
        """Optimizer steps recorded so far."""
        return self._recorder.n_recorded_steps

    @property
    def trajectory(self) -> Trajectory:
        """The path recorded so far, as a :class:`~skpathkernel.Trajectory`.

        The current parameters are its last point (recorded now if the last step was not
        a multiple of ``record_every``); recording can continue afterwards.
        """
        if self._error is not None:
            raise RuntimeError(f"The recording is incomplete: {self._error}")
        return self._recorder.finish()

    def as_estimator(self, X_train=None, y_train=None, *, loss="squared_error",
                     memory_budget: int = 2**30) -> RecordedNetwork:
        """The recorded path as a :class:`RecordedNetwork` (kernels, decomposition).

        Parameters are those of :class:`RecordedNetwork`.
        """
        return RecordedNetwork(self.module, self.trajectory, X_train=X_train,
                               y_train=y_train, loss=loss, memory_budget=memory_budget)

    def as_network(self, X_train=None, y_train=None, *, loss="squared_error",
                   memory_budget: int = 2**30) -> TrainedNetwork:
        """The recorded path as a :class:`~skpathkernel.TrainedNetwork`.

        The network of :meth:`as_estimator` (its ``network_``) without the estimator
        around it: what :class:`~skpathkernel.TangentKernel`,
        :class:`~skpathkernel.PathKernel`, the displays and the decomposition
        (:meth:`TrainedNetwork.decompose <skpathkernel.TrainedNetwork.decompose>`) take.

        Parameters
        ----------
        X_train : array-like or tensor of shape (n_samples, ...), default=None
            The training inputs the recorded batches index into, as for
            :class:`RecordedNetwork`.
        y_train : array-like or tensor of shape (n_samples,) or (n_samples, n_targets), \
default=None
            Their targets, in the form the loss takes.
        loss : "squared_error", "log_loss" or callable, default="squared_error"
            The per-sample loss whose batch mean each step minimized.
        memory_budget : int, default=2**30
            Bytes one block of a kernel or decomposition computation may use.

        Returns
        -------
        network : TrainedNetwork

        Examples
        --------
        >>> import numpy as np, torch
        >>> from skpathkernel import PathRecorder, TangentKernel
        >>> X, y = torch.randn(8, 2), torch.randn(8)
        >>> module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
        ...                              torch.nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(module.parameters(), lr=0.1)
        >>> with PathRecorder(module, opt, n_samples=8) as rec:
        ...     for _ in range(3):
        ...         rec.set_batch(np.arange(8))
        ...         opt.zero_grad()
        ...         (0.5 * (module(X)[:, 0] - y) ** 2).mean().backward()
        ...         opt.step()
        >>> net = rec.as_network(X, y)
        >>> TangentKernel(net)(X.numpy()).shape
        (8, 8)
        >>> res = net.decompose(X[:2].numpy())
        >>> bool(np.allclose(res.reconstruction, net.outputs(X[:2]), atol=1e-5))
        True
        """
        return TrainedNetwork(self.module, self.trajectory, loss=loss, X_fit=X_train,
                              y_fit=y_train, memory_budget=memory_budget)


_DECLARED = ("\n\nOver the declared training inputs, with the declared loss: exact "
             "(``error`` at round-off) when that loss reproduces the optimizer's "
             "gradients; see the user guide (:ref:`theory-any-loss`) for what the "
             "contributions mean otherwise.")
_X_TRAIN_FORM = ("array-like of shape (n_queries, n_features) or (n_queries, ...)\n"
                 "    In the form of ``X_train``.")


class RecordedNetwork(NetworkKernelsMixin, NetworkAttributesMixin, BaseEstimator):
    """A recorded path and its network, usable where the library takes a fitted estimator.

    Exposes the recorded network as a :class:`~skpathkernel.TrainedNetwork`
    (``network_``, built from the current parameters), which
    :class:`~skpathkernel.TangentKernel` and :class:`~skpathkernel.PathKernel` read, the
    two kernels as ``tangent_kernel_`` and ``path_kernel_``, and :meth:`decompose`. It
    is fitted by construction: :meth:`fit` does nothing (as
    ``sklearn.frozen.FrozenEstimator``), and ``clone`` returns an equally fitted copy.

    Parameters
    ----------
    module : torch.nn.Module
        The network whose path was recorded; called through ``torch.func.functional_call``
        with the recorded parameters, so its own current values are not used.
    trajectory : Trajectory
    X_train : array-like or tensor of shape (n_samples, n_features) or (n_samples, ...)
        The training inputs the recorded batches index into, in the form the network
        takes: floats (2-D features, images, sequences) or integer token ids (handed to
        the network as int64). Needed by :meth:`decompose`; also fixes ``n_features_in_``
        and ``input_shape_``, the form every later ``X`` must have. Without it, any
        ``(n, ...)`` array is taken as it is.
    y_train : array-like or tensor of shape (n_samples,) or (n_samples, n_targets)
        Their targets, in the form the loss takes (integer class codes for multi-class
        "log_loss"; a 1-D ``y`` is made a column for "squared_error").
    loss : "squared_error", "log_loss" or callable, default="squared_error"
        The per-sample loss whose batch mean each step minimized: the library's names
        (:class:`~skpathkernel.PathKernelMachine`'s conventions) or
        ``per_sample(output, target) -> tensor of shape (B,)``.
    memory_budget : int, default=2**30
        Bytes one block of a kernel or decomposition computation may use.

    Attributes
    ----------
    network_ : TrainedNetwork
        The network built from the current parameters (again after ``set_params``).
    module_ : torch.nn.Module
    trajectory_ : Trajectory
    device_ : str
    dtype : str
        "float32" or "float64", the trajectory's dtype.
    n_params_ : int
    n_features_in_ : int
        Values per sample, ``prod(input_shape_)``; only when ``X_train`` is given.
    input_shape_ : tuple of int
        The trailing shape of ``X_train`` (``(n_features,)`` for 2-D inputs); only when
        ``X_train`` is given.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine, RecordedNetwork
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> net = RecordedNetwork(est.module_, est.trajectory_, X_train=X, y_train=y)
    >>> bool(np.allclose(net.path_kernel_(X), est.path_kernel_(X)))
    True
    """

    def __init__(self, module: torch.nn.Module, trajectory: Trajectory, *, X_train=None,
                 y_train=None, loss: str | Callable = "squared_error",
                 memory_budget: int = 2**30):
        self.module = module
        self.trajectory = trajectory
        self.X_train = X_train
        self.y_train = y_train
        self.loss = loss
        self.memory_budget = memory_budget
        # Refused now, as a constructor of a network that is fitted by construction: a
        # trajectory of another network, another dtype, an unknown loss. The network is
        # built again from the parameters whenever they change (set_params).
        self._network()

    def _network(self) -> TrainedNetwork:
        """The network of the current parameters, rebuilt when one of them changed."""
        params = tuple(getattr(self, name) for name in
                       ("module", "trajectory", "X_train", "y_train", "loss", "memory_budget"))
        cached = self.__dict__.get("_cache")
        # By identity, holding the objects: an id alone would be reused by a new object
        # once the old parameter is freed (set_params(y_train=None), then a new list).
        if cached is None or not all(a is b for a, b in zip(cached[0], params)):
            # As PathRecorder.as_network builds it from the same arguments.
            net = TrainedNetwork(self.module, self.trajectory, loss=self.loss,
                                 X_fit=self.X_train, y_fit=self.y_train,
                                 memory_budget=self.memory_budget)
            cached = self.__dict__["_cache"] = (params, net)
        return cached[1]

    @property
    def network_(self) -> TrainedNetwork:
        """The recorded network as a :class:`~skpathkernel.TrainedNetwork`."""
        return self._network()

    @property
    def dtype(self) -> str:
        """"float32" or "float64", the trajectory's dtype."""
        return self._network().dtype

    @property
    def n_features_in_(self) -> int:
        n = self._network().n_features_in
        if n is None:
            raise AttributeError("n_features_in_ is only set when X_train is given.")
        return n

    @property
    def input_shape_(self) -> tuple[int, ...]:
        shape = self._network().input_shape
        if shape is None:
            raise AttributeError("input_shape_ is only set when X_train is given.")
        return shape

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_cache", None)  # rebuilt from the parameters
        return state

    def fit(self, X=None, y=None) -> RecordedNetwork:
        """Do nothing: the network was trained by the recorded loop. Returns self."""
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return True

    def predict(self, X) -> np.ndarray:
        """Network outputs ``f(X; theta_T)`` at the last recorded point, shape (n, C)."""
        return self._network().outputs(X)

    @shared_doc(DECOMPOSE, note=_DECLARED, X=_X_TRAIN_FORM, extra_params="", raises="",
                examples="")
    def decompose(self, X, *, method: str = "exact", weighting: str = "realized",
                  n_nodes: int | None = None, tol: float | None = None):
        return self._network().decompose(X, method=method, weighting=weighting,
                                         n_nodes=n_nodes, tol=tol)

    @shared_doc(ATTRIBUTE, note=_DECLARED, X=_X_TRAIN_FORM,
                y="array-like of int of shape (n_queries,), default=None\n    With "
                  "``output=\"margin\"``: the queries' classes as output columns; None "
                  "takes\n    the largest output (or a positive single output) as the class.",
                output_default="None: output 0 of a single-output network (several outputs "
                               "need a choice).",
                examples="")
    def attribute(self, X, y=None, *, method: str = "exact", weighting: str = "realized",
                  output=None, n_nodes: int | None = None, tol: float | None = None,
                  n_jobs: int | None = None) -> np.ndarray:
        return self._network().attribute(X, y, method=method, weighting=weighting,
                                          output=output, n_nodes=n_nodes, tol=tol,
                                          n_jobs=n_jobs)

    @shared_doc(SELF_INFLUENCE, examples="",
                label='with ``output="margin"``, the margin of its declared target: its '
                      "class code, or the positive or largest target column")
    def self_influence(self, *, output=None, n_jobs: int | None = None) -> np.ndarray:
        return self._network().self_influence(output=output, n_jobs=n_jobs)
