"""Record the optimisation path of your own training loop.

:class:`PathRecorder` attaches to a ``torch.optim`` optimizer and records every
``optimizer.step()`` into the same :class:`~skpathkernel.Trajectory` that the estimators
build; :class:`RecordedNetwork` wraps the recorded path so that
:class:`~skpathkernel.kernels.TangentKernel`, :class:`~skpathkernel.kernels.PathKernel` and the
exact per-training-point decomposition work on it as on a fitted estimator.

How recording works
-------------------
The recorder registers a step post-hook on the optimizer
(``optimizer.register_step_post_hook``): the parameters, the optimizer's second moments
and the step size are copied right after each update, *inside* ``optimizer.step()``. So the
step size recorded is the one the update used whatever the order of ``scheduler.step()``
in the loop, a step skipped by ``torch.amp.GradScaler`` is not recorded, and no call can
be forgotten. The samples of a step, when the decomposition is wanted, are declared with
:meth:`PathRecorder.set_batch` before ``optimizer.step()`` (once per micro-batch under
gradient accumulation). Parameters frozen (``requires_grad=False``) when the recorder is
created are constants of the path; freezing or unfreezing one later is refused, as is a
frozen one that holds a ``.grad`` (torch.optim steps it), and a constant that changes
anyway (another optimizer on part of the module) is warned about. A ``torch.compile``d
module is recorded and analysed as the module it compiled.

Supported optimizers: ``torch.optim.SGD`` (``momentum``, ``nesterov``, ``weight_decay``),
``Adam``, ``AdamW`` (``betas``, ``eps``, ``weight_decay``) and ``RMSprop`` (``alpha``,
``eps``, ``weight_decay``): the update rules that the kernels' preconditioner and the
decomposition's adjoint recursion model. Options that change the rule (``dampening``
with momentum, ``amsgrad``, ``centered``, RMSprop ``momentum``, ``maximize``,
``differentiable``) are refused. Parameter groups may have their own learning rates and
weight decays (AdamW's usual groups: no decay on biases and norms), recorded as
per-parameter step sizes (:meth:`Trajectory.step_size_scales
<skpathkernel.Trajectory.step_size_scales>`, folded into the preconditioner) and
weight decays; the other hyper-parameters are one per trajectory.

What happens between ``backward()`` and ``optimizer.step()`` is checked at every step:
``torch.nn.utils.clip_grad_norm_`` multiplies every gradient by one factor, which is
recorded (:attr:`Trajectory.gradient_scales <skpathkernel.Trajectory.gradient_scales>`)
so that the per-point split stays exact; a change that is not one factor for every
parameter (``clip_grad_value_``, gradient noise, custom gradient surgery) is refused
before the step, as are dropout in training mode (its masks are random draws the
decomposition cannot replay) and BatchNorm in training mode (it mixes the samples of a
batch and updates running statistics that the path does not record).
``torch.amp.GradScaler``: pass it as ``grad_scaler``; skipped steps are not optimizer
steps and are not recorded, and the scale is undone (also by a ``fused=True`` optimizer,
which ``scaler.step`` calls on an overflow too, with a flag its kernel reads).
Under ``torch.nn.parallel.DistributedDataParallel`` every rank declares its shard and
one rank records the global batch: see the user guide, "Training on several processes".

What the decomposition means, and when it is exact, for losses that are not per-sample
supervised (diffusion, GANs) is in the user guide: "Theory", section "What is exact, and
what it means, for any loss".
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.utils.validation import (
    _check_feature_names,
    _check_feature_names_in,
    _get_feature_names,
)
from torch.nn.parallel import DistributedDataParallel

from .._device import to_input_tensor
from .._estimators._base import (
    FittedNetworkMixin,
    NetworkAttributesMixin,
    declare_feature_dtype,
    tangent_feature_names,
)
from .._network._docs import ATTRIBUTE, DECOMPOSE, SELF_INFLUENCE, shared_doc
from .._network._inputs import check_representable
from .._network._trained import TrainedNetwork, warn_not_finite, warn_recorded_probes
from .._validation import check_memory_budget
from .._warnings import VersionedStateMixin
from ..kernels import NetworkKernelsMixin
from ._training import (
    extend_trajectory,
    mode_dependent_layers,
    refused_in_mode,
    undrawn,
)
from ._trajectory import (
    SolverSpec,
    Trajectory,
    TrajectoryRecorder,
    host_vector,
    interval_means,
    is_stored_point,
    mean_batch_weights,
)

__all__ = ["PathRecorder", "RecordedNetwork", "solver_spec_from_optimizer"]

# Options whose non-default values change the update rule away from what the kernels'
# preconditioner and the decomposition's recursion model, per optimizer class.
_REFUSED = {
    "SGD": {"dampening": 0, "maximize": False, "differentiable": False},
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


def _loss_coefficients(weights, n: int) -> tuple[np.ndarray | None, str | None]:
    """``set_batch``'s ``weights`` as float64 and None, or None and what is wrong with
    them (raised by the caller, at once in one process, at the step under DDP)."""
    if isinstance(weights, torch.Tensor):
        if weights.is_complex() or weights.dtype == torch.bool:
            return None, f"weights must be real numbers, got a {weights.dtype} tensor."
        # float64 before numpy, which has no bfloat16.
        weights = weights.detach().to("cpu", torch.float64).numpy()
    w = np.asarray(weights)
    if w.dtype.kind not in "iuf":
        # A boolean mask or strings are not coefficients: refused, not cast.
        return None, (f"weights must be real numbers (each sample's coefficient in the "
                      f"loss), got dtype {w.dtype}.")
    if w.shape != (n,):
        return None, (f"weights must have shape ({n},), one per index of the batch, got "
                      f"shape {w.shape}.")
    w = w.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(w))
    if len(bad):
        return None, (f"weights must be finite, but {len(bad)} of {n} are not (entry "
                      f"{bad[0]} is {w[bad[0]]}).")
    return w, None


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
        differ = sorted(k for k in set(first) | set(other)
                        if k != "weight_decay" and first.get(k) != other.get(k))
        if differ:
            raise ValueError(
                f"Parameter group {i} of the {kind} optimizer has hyper-parameters that "
                f"differ from group 0 ({', '.join(differ)}): the trajectory records each "
                "group's learning rate and weight decay (per-parameter step sizes), but "
                "one momentum / betas / eps / alpha for the whole network. Make the "
                "groups agree on those."
            )
    for option, default in _REFUSED[kind].items():
        value = first.get(option, default)
        if option == "dampening" and _as_float(first.get("momentum", 0.0)) == 0:
            continue  # it only scales the momentum buffer: plain SGD ignores it
        if value != default:
            raise ValueError(
                f"PathRecorder does not support torch.optim.{kind} with {option}={value!r}: "
                "it changes the update rule that the path kernel and the exact "
                f"decomposition model. Use {option}={default!r}."
            )
    # The largest: each parameter's own is recorded relative to it.
    wd = max(_as_float(g.get("weight_decay", 0.0)) for g in groups)
    if kind == "SGD":
        momentum = _as_float(first["momentum"])
        return SolverSpec(name="sgd", momentum=momentum, weight_decay=wd,
                          nesterov=bool(first.get("nesterov", False)) and momentum > 0)
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

# GradScaler.step's code: its subclasses (torch.cuda.amp's, torch.cpu.amp's) inherit it.
_SCALER_STEP = torch.amp.GradScaler.step.__code__


def _called_by_grad_scaler() -> bool:
    """Whether an enabled ``torch.amp.GradScaler``'s ``step()`` is taking the optimizer
    step being recorded (a caller's frame runs its code). A disabled one
    (``GradScaler(enabled=use_amp)``) scales and unscales nothing.

    Asked at every step whose factor is not 1 (a clipped loop's, every step): the frames'
    code objects are compared, and only the scaler's frame has its locals read (reading
    every frame's, the check took 19 us of a 696 us step, the code's compare 6 us).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _SCALER_STEP:
            return frame.f_locals["self"].is_enabled()
        frame = frame.f_back
    return False


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Which parameters' fingerprints differ: a diverged parameter's NaN norm, NaN
    before and now, is not a change."""
    return torch.ne(now, before) & ~(now.isnan() & before.isnan())


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module that DistributedDataParallel and ``torch.compile`` wrap (in either
    order), or the module itself.

    A compiled module holds the same parameters under ``_orig_mod.``-prefixed names: the
    path is recorded under the module's own names, and the analyses run its eager
    forward, which they trace themselves (run compiled, each of their calls recompiled
    until dynamo's limit, with its warnings).
    """
    *_, module = _wrappers(module)
    return module


def _wrappers(module: torch.nn.Module):
    """``module``, then each module that DistributedDataParallel or ``torch.compile``
    wraps in it, outermost first (:func:`_unwrap`'s is the last)."""
    # Only a process that has imported dynamo (torch.compile does) can hold a compiled
    # module: importing it here would cost every recorder seconds.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        yield module
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
            module = module._orig_mod
        else:
            return


def _process_group() -> tuple[int, int]:
    """(world size, rank) of torch.distributed's default group; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


_RESUME = ("save a checkpoint as {'model': module.state_dict(), 'optim': "
           "optimizer.state_dict()} with recorder.trajectory.save(path), taken together, "
           "and resume with module.load_state_dict, optimizer.load_state_dict and "
           "PathRecorder(module, optimizer, ..., resume_from=Trajectory.load(path))")


def _names_list(names) -> str:
    return f"{', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''}"


def _resume_problem(path: Trajectory, named, optimizer, spec: SolverSpec, groups,
                    n_samples: int | None) -> str | None:
    """Why the recording of ``module``'s ``named`` parameters by ``optimizer`` cannot
    continue ``path`` (None when it can): the same parameters, at the path's last point,
    with the path's optimizer, whose state is the one the path ends with.

    ``groups``: each recorded parameter's optimizer group. Reads ``path``'s last point
    (and its last optimizer state), changes nothing.
    """
    names = [n for n, _ in named]
    params = [p for _, p in named]
    if path.names != tuple(names):
        missing = [n for n in path.names if n not in names]
        extra = [n for n in names if n not in path.names]
        what = "; ".join(
            ([f"the trajectory records {_names_list(missing)}, which this recorder does "
              "not"] if missing else [])
            + ([f"this recorder records {_names_list(extra)}, which the trajectory does "
                "not"] if extra else [])) or "they are in another order"
        return (f"the trajectory's parameters are not the ones this recorder records: "
                f"{what} (the module's trained parameters in named_parameters order: a "
                "parameter renamed, frozen, unfrozen or left out of the optimizer since)")
    shapes = [tuple(p.shape) for p in params]
    bad = [n for n, a, b in zip(names, path.shapes, shapes) if tuple(a) != b]
    if bad:
        return (f"parameter(s) {_names_list(bad)} have other shapes than the trajectory "
                "records (another network)")
    if path.dtype != params[0].dtype:
        return (f"the module's parameters are {params[0].dtype}, the trajectory's "
                f"{path.dtype}")
    if path.n_samples != (n_samples or 0):
        return (f"the trajectory's batches index n_samples={path.n_samples or None} "
                f"training samples, the recorder's n_samples={n_samples}: a path indexes one "
                "training set (pass its n_samples)")
    theirs, ours = path.solver_spec.to_dict(), spec.to_dict()
    differ = [k for k in theirs if theirs[k] != ours[k]]
    if differ:
        return ("the optimizer is not the one the trajectory was recorded with: "
                + ", ".join(f"{k}={ours[k]!r} (the trajectory's {theirs[k]!r})"
                            for k in differ)
                + "; a path has one optimizer and one set of hyper-parameters")
    n_groups = len(optimizer.param_groups)
    wds = [_as_float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups]
    path_groups = (path._group_lrs.shape[1] if path._group_lrs is not None
                   else 1 if path.n_steps else None)
    if ((path_groups is not None and path_groups != n_groups)
            or (path._param_groups is not None and tuple(path._param_groups) != tuple(groups))
            or (path._group_weight_decays is not None
                and path._group_weight_decays.tolist() != wds)
            or (path._group_weight_decays is None and path._param_groups is not None
                and len(set(wds)) > 1)):
        return ("the optimizer's parameter groups (which parameters each holds, their "
                "weight decays) are not the trajectory's")
    compressed = path.compression is not None and len(path) > 1
    if not is_stored_point(host_vector(params, path.dtype), path.parameters(-1),
                           path.parameters(-2) if compressed else None,
                           getattr(torch, path.compression) if compressed else None):
        return (f"the module's parameters are not the trajectory's last point (after "
                f"optimizer step {path.n_steps}): load the module's state_dict saved with "
                "this trajectory (a loop that changes the parameters after "
                "optimizer.step(), weight clipping or a projection, saves them before the "
                "change, which is the path's last point, and makes it after resuming)")
    return _state_problem(path, names, params, optimizer)


def _state_problem(path: Trajectory, names, params, optimizer) -> str | None:
    """Why ``optimizer``'s state is not the one ``path`` ends with (None when it is)."""
    n = path.n_steps
    states = [optimizer.state.get(p, {}) for p in params]
    fix = ("load the optimizer's state_dict saved with this trajectory "
           "(optimizer.load_state_dict)")
    if not n:
        taken = [name for name, st in zip(names, states) if st]
        if taken:
            return (f"the trajectory has taken no optimizer step, but the optimizer holds "
                    f"state for {_names_list(taken)}: create it afresh")
        return None
    kind = path.solver
    if kind == "sgd":
        if not path.solver_spec.momentum:
            return None  # plain SGD keeps no state
        missing = [name for name, st in zip(names, states)
                   if st.get("momentum_buffer") is None]
        if missing:
            return (f"the trajectory ends after optimizer step {n}, but the optimizer has "
                    f"no momentum buffer for {_names_list(missing)} (a fresh optimizer "
                    f"would restart the momentum): {fix}")
        return None
    counts = [(name, None if "step" not in st else int(float(st["step"])))
              for name, st in zip(names, states)]
    off = [f"{name!r} ({'none' if c is None else c})" for name, c in counts if c != n]
    if off:
        return (f"the optimizer's step counts are not the trajectory's {n} optimizer "
                f"steps: parameter(s) {', '.join(off[:5])}{' ...' if len(off) > 5 else ''}"
                f" (a fresh optimizer has none; another checkpoint's has another): {fix}")
    if path.steps[-1] - path.steps[-2] == 1:
        # The state recorded at the last step is the optimizer's now, bit for bit.
        recorded = path.optimizer_state(-1)
        for key in path.state_keys:
            if not torch.equal(host_vector([st[key] for st in states], path.dtype),
                               recorded[key]):
                return (f"the optimizer's {key} is not the one the trajectory recorded at "
                        f"its last optimizer step ({n}): {fix}")
    return None


def _momentum_mismatch(path: Trajectory, named, optimizer, groups) -> list[str]:
    """The parameters whose heavy-ball SGD momentum buffer is not the one ``path``'s last
    step moved them by (empty where it is, or where that step cannot tell).

    torch.optim.SGD (without Nesterov) takes ``theta <- theta - lr * buf`` with the
    buffer after the step, so the last two points give it up to the rounding of that
    update: a buffer of another step (an optimizer checkpoint taken at another step
    than the module's) misses it by ``lr`` times a gradient's change. SGD keeps no step
    count that would tell it otherwise. A parameter changed between the two points
    outside ``optimizer.step()`` (weight clipping) misses it too, which a resumed loop
    may rightly do: so this warns, and refuses nothing. Checked where the last two
    points are consecutive steps held exactly (not ``compression``'s rounded rows);
    ``groups``: each parameter's optimizer group."""
    spec = path.solver_spec
    if (spec.name != "sgd" or not spec.momentum or spec.nesterov or not path.n_steps
            or path.compression is not None or path.steps[-1] - path.steps[-2] != 1):
        return []
    # The last step's step size of each parameter's group.
    if path._step_group_lrs is not None:
        rates = np.asarray(path._step_group_lrs[path.n_steps - 1], dtype=np.float64)
    elif path._group_lrs is not None:
        rates = np.asarray(path._group_lrs[-1], dtype=np.float64)  # a one-step interval
    else:
        rates = np.full(max(groups) + 1, float(path.step_learning_rates[-1]))
    before = path.parameters(-2).double()
    after = path.parameters(-1).double()
    eps = torch.finfo(path.dtype).eps
    tiny = torch.finfo(path.dtype).smallest_normal
    offset, off = 0, []
    for (name, p), group in zip(named, groups):
        buf = optimizer.state[p]["momentum_buffer"].detach().reshape(-1)
        buf = buf.to("cpu", torch.float64)
        end = offset + buf.numel()
        move = float(rates[group]) * buf
        # Two roundings (the product, the sum), each within eps / 2 of its result.
        bound = 2 * eps * (move.abs() + after[offset:end].abs()) + 2 * tiny
        if ((before[offset:end] - move - after[offset:end]).abs() > bound).any():
            off.append(name)
        offset = end
    return off


def _resumed_storage(path: Trajectory, storage: str, compression) -> str:
    """Where a recording that continues ``path`` goes: its storage. Refuses another."""
    where = ("in memory" if path.storage == "memory"
             else f"on disk in {path.directory!r}")
    if storage not in ("auto", path.storage):
        raise ValueError(
            f"Cannot resume the recording: the trajectory is kept {where}, and "
            f"storage={storage!r} cannot continue it there. Pass storage={path.storage!r} "
            "(or 'auto', which continues it where it is). Nothing was changed.")
    if compression != path.compression:
        raise ValueError(
            f"Cannot resume the recording: the trajectory is kept {where} with "
            f"compression={path.compression!r}; compression={compression!r} cannot "
            f"continue it. Pass compression={path.compression!r}. Nothing was changed.")
    if path.storage == "disk":
        if any(rows.start for rows in (path._params, *path._states.values())):
            raise ValueError("Cannot resume the recording from a part of an on-disk "
                             "trajectory: load the whole path (Trajectory.load). Nothing "
                             "was changed.")
        path._store.check_extendable("PathRecorder(resume_from=...)", path.n_steps)
    return path.storage


class _WeakHook:
    """A hook that calls ``recorder.<name>(*args, *hook_args)`` while the recorder lives.

    Hooks hold their callables, and a parameter's hooks are held by its tensor's C++
    side, which the garbage collector does not see: bound methods there kept a recorder
    that was never ``close()``d (its buffers, the whole path) alive after the last
    reference to it, with its module and optimizer, for the rest of the process. The
    recorder's finalizer removes the tensors' hooks; its optimizer's, no-ops then, are
    removed by the next recorder of it (:func:`_remove_dead_step_hooks`).
    """

    def __init__(self, recorder: PathRecorder, name: str, *args):
        self._ref = weakref.ref(recorder)
        self._method, self._args = getattr(type(recorder), name), args

    @property
    def recorder(self) -> PathRecorder | None:
        return self._ref()

    def __call__(self, *args):
        recorder = self._ref()
        if recorder is not None:
            return self._method(recorder, *self._args, *args)
        return None


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _remove_dead_step_hooks(optimizer) -> None:
    """Remove the step hooks of recorders freed without ``close()`` from ``optimizer``.

    Their finalizer leaves them (no-ops, see :class:`_WeakHook`): it runs wherever the
    garbage collector frees a recorder in a reference cycle, also while
    ``optimizer.step()`` iterates over these hooks (a later hook allocating), and a
    removal there raised "OrderedDict mutated during iteration" out of the user's step
    (review s52). A new recorder is not made inside a step."""
    for hooks in (getattr(optimizer, "_optimizer_step_pre_hooks", {}),
                  getattr(optimizer, "_optimizer_step_post_hooks", {})):
        for key in [k for k, h in hooks.items()
                    if isinstance(h, _WeakHook) and h.recorder is None]:
            del hooks[key]


def _kept(step: int) -> str:
    """What a recorder that failed at optimizer step ``step`` keeps readable."""
    if step == 0:
        return "the trajectory holds the initial point only"
    return f"the trajectory ends after step {step - 1}"


class PathRecorder:
    """Record the optimisation path of a training loop that you write yourself.

    Attaches a step post-hook to ``optimizer``: every ``optimizer.step()`` records the
    parameters (every ``record_every`` steps, plus the current ones when the trajectory is
    read), the optimizer's second moments that define the preconditioner, and the step
    size read from ``optimizer.param_groups`` at that step, so learning-rate schedulers
    are recorded whatever the order of ``scheduler.step()`` in the loop (schedulers that
    also change momentum or betas, such as ``OneCycleLR`` with ``cycle_momentum=True``,
    are refused when the recorder is created, or at the step that changes them if
    created after it: one set of them is recorded). The initial parameters are recorded
    when the recorder is created, which must be before the first ``optimizer.step()``.
    A recorded parameter changed between two steps (weight clipping, a max-norm
    projection, ``load_state_dict``) is recorded as part of the next step, with a
    warning at that step naming it.

    For the per-training-point decomposition, give ``n_samples`` and declare each step's
    samples with :meth:`set_batch` before ``optimizer.step()``; what the decomposition
    means, and when it is exact, for losses that are not per-sample supervised (diffusion,
    GANs) is in the user guide (:ref:`theory-any-loss`).

    A recording that is interrupted resumes as training does, from state dicts: checkpoint
    ``{"model": module.state_dict(), "optim": optimizer.state_dict()}`` with
    ``recorder.trajectory.save(path)`` at the same step, and after the restart load both
    state dicts and create ``PathRecorder(module, optimizer, n_samples=N,
    resume_from=Trajectory.load(path))``: its :attr:`trajectory` is then one path from
    the first initialization to the last step, as the uninterrupted loop records it (the
    user guide: :ref:`own-loop-resume`). The recorder itself refuses ``pickle``,
    ``torch.save`` and ``copy``: its hooks would not come with it, and a loaded copy
    would record nothing. Its hooks do not keep it alive: a recorder that is dropped
    without :meth:`close` stops recording and is freed (trajectories read from it stay).

    Parameters
    ----------
    module : torch.nn.Module
        The network, called as ``module(X)`` on a tensor of inputs of shape
        ``(n_samples, ...)`` (floats, or int64 token ids). Its parameters
        that the optimizer updates are recorded (in ``named_parameters`` order); it must
        have no cross-sample state and no random draws in training mode (BatchNorm and
        dropout in training mode are refused at the step, naming the layer) for the
        kernels and the decomposition to describe it, and no sparse gradients
        (embeddings with ``sparse=True``, which the recorder's checks of each step cannot
        take, are refused). A ``DistributedDataParallel``
        module is recorded through its ``.module``.
    optimizer : torch.optim.SGD, Adam, AdamW or RMSprop
        Fresh (no step taken yet), or with ``resume_from``, in the state the path ends
        with. Hyper-parameters are read from its parameter groups;
        options that change the update rule (``dampening`` with momentum, ``amsgrad``,
        ``centered``, RMSprop ``momentum``, ``maximize``, ``differentiable``) and groups
        that differ in momentum, betas, eps or alpha are refused.
    record_every : int, default=1
        Record the parameters every ``record_every`` steps; 1 is needed by the
        decomposition. With more, a recorded point stands for the mean step size of its
        interval in the path kernel; every step's own step size is kept where a
        scheduler changes it between recorded points (the unrolled attribution replays
        them).
    n_samples : int, default=None
        Size of the training set that :meth:`set_batch` indexes into. When given, every
        step must declare its batch; when None, batches are not recorded (the kernels
        work, the decomposition does not). The recorder does not know which samples
        each step drew its batch from: ``decompose(weighting="expected")`` credits every
        step to all ``n_samples``, each ``1 / n_samples``.
    storage : {"memory", "disk", "auto"}, default="memory"
        Where the recorded vectors go: memory buffers that grow by parts (as large as
        what they hold, up to a chunk file's size; past 16 of those, a sixteenth of the
        path, except under "auto") without copying what they hold, or
        chunk files in a fresh temporary directory under ``directory``, written as
        recording goes and read lazily (see the estimators' ``trajectory_storage``).
        "auto" records in memory and moves what it holds to disk when the path would
        pass ``memory_budget`` bytes (its buffers never hold more), or where the host's
        available memory is short of the next part.
        ``trajectory.save(path)`` moves the directory (a rename) and keeps it;
        otherwise it is deleted with the last trajectory using it. A full disk keeps
        the rest in memory, with a warning naming the file and the step.
    directory : str, path-like or None, default=None
        Parent of the on-disk trajectory's directory; None is the system's temporary
        directory.
    memory_budget : int, default=2**30
        The size bound of ``storage="auto"`` (an int, at least 2**20); chunk files,
        and the parts that memory buffers grow by under "auto", hold at most 1/32 of it.
    compression : {None, "float16", "bfloat16"}, default=None
        On disk, store each point's parameters as its difference from the previous
        stored point in this dtype (lossy: see the estimators'
        ``trajectory_compression``; the decomposition's ``error`` reports the cost).
    writer_rank : int, default=0
        Under ``torch.distributed`` (an initialized process group of several
        processes): the rank that writes the trajectory. Every rank declares its own
        shard with :meth:`set_batch`; the recorder gathers the global batch of every
        step to this rank, and the others record nothing. On gloo, free the process
        group last, from a reference of your own, as the distributed guide's script
        does (hold ``dist.group.WORLD``, collect DDP's wrapper, destroy the group, drop
        the reference): a gloo thread may still have a gather's tensors to drop, which
        takes the GIL, and a group that DDP's reducer frees in a garbage collection
        joins that thread holding the GIL, which hangs the rank.
    grad_scaler : torch.amp.GradScaler or None, default=None
        The scaler of a mixed-precision loop, whose scale the gradients of
        ``backward()`` carry until ``scaler.step`` undoes it.
    resume_from : Trajectory or None, default=None
        The path that an interrupted recording of this loop saved
        (``recorder.trajectory.save(path)``, read back with ``Trajectory.load(path)``),
        to continue: the module must hold its last point exactly (within the rounding
        of a compressed on-disk path's stored point) and the optimizer the
        state it ends with (``load_state_dict`` of both, saved at that step), with the
        path's parameters (names, shapes, dtype), optimizer class, hyper-parameters
        (``lr`` aside: each step's is recorded), parameter groups and ``n_samples``.
        Adam's, AdamW's and RMSprop's step counts must be the path's steps (and their
        second moments the ones recorded at its last step, where it recorded them:
        ``record_every=1``); SGD's momentum buffers must be there once the path has
        steps; no other recorder may still record the optimizer. Anything else is
        refused with a ``ValueError`` saying what differs, which changes nothing.
        SGD keeps no step count: momentum buffers that are not the ones the path's
        last step moved the parameters by (``theta - lr * buf`` without Nesterov, where
        its last two points are consecutive steps stored exactly), an optimizer
        checkpoint of another step or parameters changed after that step (weight
        clipping), warn.
        The path continues where it is kept: in memory (``storage`` "memory" or
        "auto"), or on disk in its own directory, whose files it appends to
        (``storage`` "disk" or "auto", ``compression`` the path's; the directory's
        description stays the saved path's until the next ``save``, so a run that
        dies before it leaves the checkpoint as it was). ``record_every``
        counts from the resumed step. The step numbers (:attr:`n_steps`, warnings and
        errors) count the path's steps too. Under torch.distributed every rank passes
        it.

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
        writer_rank: int = 0,
        grad_scaler=None,
        resume_from: Trajectory | None = None,
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
        # The estimators' floor (their _parameter_constraints): the recorder's budget
        # sizes its chunks on disk and the analyses of the network it hands on.
        check_memory_budget(memory_budget, low=2**20)
        self._world, self._rank = _process_group()
        if (isinstance(writer_rank, bool) or not isinstance(writer_rank, numbers.Integral)
                or not 0 <= writer_rank < self._world):
            raise ValueError(f"writer_rank must be a rank in [0, {self._world}), got "
                             f"{writer_rank!r}.")
        self.solver_spec = solver_spec_from_optimizer(optimizer)
        # OneCycleLR / CyclicLR with cycle_momentum=True write these bookkeeping entries
        # into the groups when created: one created before the recorder cycles momentum
        # or beta_1 from its first step, which one recorded set cannot describe (one
        # created after is refused at the step that changes them).
        cycling = [i for i, g in enumerate(optimizer.param_groups)
                   if "base_momentum" in g and "max_momentum" in g
                   and _as_float(g["base_momentum"]) != _as_float(g["max_momentum"])]
        if cycling:
            g = optimizer.param_groups[cycling[0]]
            raise ValueError(
                f"Parameter group {cycling[0]} of the optimizer cycles its momentum (or "
                f"beta_1) between base_momentum={_as_float(g['base_momentum'])!r} and "
                f"max_momentum={_as_float(g['max_momentum'])!r}: "
                "a scheduler such as OneCycleLR or CyclicLR with cycle_momentum=True "
                "changes a hyper-parameter other than the learning rate during "
                "training, and the trajectory records one set of them. Create the "
                "scheduler with cycle_momentum=False (the learning rates it schedules "
                "are recorded).")
        inner = _unwrap(module)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in inner.named_parameters() if id(p) in in_optimizer]
        if len(named) != len(in_optimizer):
            raise ValueError(
                f"The optimizer updates {len(in_optimizer) - len(named)} tensors that are "
                "not parameters of the module; the recorder needs every updated tensor to "
                "be a named module parameter. To record a part of a model (a VAE's "
                "decoder), give that part its own optimizer (SGD, Adam, AdamW and RMSprop "
                "update each parameter on its own, so two optimizers train as one does "
                "where the loop around them does too: gradients clipped over all the "
                "parameters at once, not part by part, a learning-rate scheduler stepped "
                "for each optimizer, and no GradScaler, which skips each optimizer's step "
                "on its own), or record the module that holds every parameter."
            )
        # torch.optim skips a parameter without a gradient: one frozen now
        # (requires_grad=False) is a constant of the path, as a parameter the optimizer
        # does not hold. Freezing or unfreezing one later is refused at the step.
        self._watched = named
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("Every parameter the optimizer updates is frozen "
                             "(requires_grad=False): there is no path to record.")
        params = [p for _, p in named]
        if resume_from is not None and not isinstance(resume_from, Trajectory):
            raise TypeError(f"resume_from must be a Trajectory (Trajectory.load(path)) or "
                            f"None, got {type(resume_from).__name__}.")
        if resume_from is None and any(optimizer.state.get(p) for p in params):
            raise ValueError(
                "The optimizer has already taken steps: create the PathRecorder before the "
                "first optimizer.step(), so that the path starts where the optimizer state "
                "does. To continue a recording that was interrupted, pass the path it "
                "recorded as resume_from: " + _RESUME + "."
            )
        recorded = {id(p) for p in params}
        sparse = [name or type(inner).__name__ for name, m in inner.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                  and m.sparse and id(m.weight) in recorded]
        if sparse:
            # Their sparse gradients have none of the elementwise operations that the
            # step's checks run on gradients (the kernels and the decomposition read
            # them densely).
            raise ValueError(
                f"Layer(s) {', '.join(map(repr, sparse))} of the module are embeddings "
                "with sparse=True, whose sparse gradients the recorder's checks of each "
                "optimizer step do not take. Create them with sparse=False: the "
                "gradients hold the same values, dense, and the path is the same.")
        meta = [n for n, p in named if p.is_meta]
        if meta:
            # Recording copies the initial point at once, which failed with torch's
            # "Cannot copy out of meta tensor; no data!".
            raise ValueError(
                f"Parameter(s) {', '.join(map(repr, meta))} of the module are on the "
                "'meta' device, which holds shapes but no values: there is no path to "
                "record. Materialize the module first (module.to_empty(device=...) and "
                "initialize it, or load_state_dict(..., assign=True)), then create the "
                "optimizer and the recorder.")
        dtypes = {p.dtype for p in params}
        if len(dtypes) == 1 and next(iter(dtypes)).is_floating_point:
            # Every point of the path would be non-finite: the kernels then failed as an
            # overflow to be cured by scaling the inputs, and decompose blamed its
            # quadrature.
            bad = [n for n, p in named
                   if not bool(torch.isfinite(p.detach()).all())]
            if bad:
                raise ValueError(
                    f"Parameter(s) {', '.join(map(repr, bad[:5]))}"
                    f"{' ...' if len(bad) > 5 else ''} of the module hold NaN or inf "
                    "values before the first step: no recorded point would be finite. "
                    "Initialize (or load) finite parameters before creating the "
                    "recorder.")
        self._warned_diverged = False
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
            raise ValueError(
                f"The recorded parameters must all be float32 or all float64, got {dtypes}."
            )
        groups = optimizer.param_groups
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        param_groups = [group_of[id(p)] for p in params]
        if resume_from is not None:
            # Every check before anything is set: a refusal changes nothing.
            live = [h for h in getattr(optimizer, "_optimizer_step_post_hooks", {}).values()
                    if isinstance(getattr(h, "recorder", None), PathRecorder)]
            if live:
                # Both would record the steps; on disk, into one series.
                raise ValueError("Cannot resume the recording: another PathRecorder still "
                                 "records this optimizer; close() it first. Nothing was "
                                 "changed.")
            problem = _resume_problem(resume_from, named, optimizer, self.solver_spec,
                                      param_groups, n_samples)
            if problem is not None:
                raise ValueError(f"Cannot resume the recording from this trajectory: "
                                 f"{problem}. Nothing was changed.")
            off = _momentum_mismatch(resume_from, named, optimizer, param_groups)
            if off:
                warnings.warn(
                    f"PathRecorder: the optimizer's momentum buffers of {_names_list(off)} "
                    "are not the ones the resumed trajectory's last optimizer step "
                    f"({resume_from.n_steps}) moved the parameters by: an optimizer "
                    "state_dict saved at another step than the module's (load the one "
                    "saved with this trajectory: SGD keeps no step count to tell), or "
                    "parameters changed after that optimizer.step() (weight clipping, a "
                    "projection). With another step's momentum the resumed training is not "
                    "the one the path records: decompose warns by how much it misses.",
                    UserWarning, stacklevel=2)
            if self._rank == writer_rank:
                storage = _resumed_storage(resume_from, storage, compression)
        self.module = module
        # Whether DistributedDataParallel(module), wrapping it after this recorder was
        # created, may have moved its parameters: it copies rank 0's to the other ranks,
        # so not on rank 0, nor where the recorder was created on the wrapper.
        self._ddp_may_move = self._rank != 0 and not any(
            isinstance(m, DistributedDataParallel) for m in _wrappers(module))
        self.optimizer = optimizer
        self.writer_rank = int(writer_rank)
        self.grad_scaler = grad_scaler
        self.record_every = int(record_every)
        self.n_samples = None if n_samples is None else int(n_samples)
        self.storage = storage
        self.directory = directory
        self.memory_budget = int(memory_budget)
        self.compression = compression
        self._params, self._names = params, [n for n, _ in named]
        self._recorded = {id(p) for p in params}
        # The module's other parameters are constants of the path, read at their current
        # values whenever a recorded point is evaluated: their version counters (bumped
        # by every in-place write, another optimizer's step included) say if one moved.
        self._constants = [(n, p, p._version) for n, p in inner.named_parameters()
                           if id(p) not in self._recorded]
        self._warned_constants = False
        # The recorded parameters' fingerprints right after the last recorded step (after
        # the initial point at first): what the next step starts from. Not version
        # counters: writes through p.data (WGAN's p.data.clamp_) and new storage
        # (p.data = ...) leave them unchanged.
        self._fingerprint = None
        # Where and in what dtype they were: a module converted since (module.double(),
        # .cpu()) holds the same values, whose norms differ in their round-off.
        self._homes = [(p.device, p.dtype) for p in params]
        self._devices = len({p.device for p in params})
        self._recorder = None
        if self._rank == self.writer_rank:  # the other ranks only take part in the gather
            self._recorder = TrajectoryRecorder(
                params, self._names, n_steps=None, record_every=self.record_every,
                solver=self.solver_spec, n_samples=self.n_samples or 0, batch_size=None,
                dtype=params[0].dtype, storage=storage, directory=directory,
                memory_budget=self.memory_budget, compression=compression,
                extends=resume_from if storage == "disk" else None,
                first_step=0 if resume_from is None else resume_from.n_steps,
            )
            self._recorder.record_point(0)
            self._fingerprint = self._fingerprints()
        self._param_groups = param_groups
        wds = [_as_float(g.get("weight_decay", 0.0)) for g in groups]
        self._group_wds = wds if len(set(wds)) > 1 else None
        self._mode_layers = mode_dependent_layers(inner)
        # The path recorded before this recorder (resume_from): its steps are counted in
        # the step numbers, and the trajectory is that path followed by this recording.
        self._resumed = resume_from
        self._first_step = 0 if resume_from is None else resume_from.n_steps
        self._step = self._first_step
        self._pending = None
        # The step's set_batch calls (micro-batches): each one's size and loss
        # coefficients (None: the default, its mean over the step's micro-batches).
        self._micro: list[tuple[int, np.ndarray | None]] = []
        self._pending_scale = None  # the GradScaler's scale at the step's first set_batch
        self._pending_problem = None  # a bad set_batch, raised at the step on every rank
        self._ready = None  # what the step about to be taken records
        self._declared_scale = None  # from clip_grad_norm_
        self._warned_unscaled = False  # a GradScaler's step without grad_scaler
        self._warned_skip = False  # a parameter torch.optim skipped without a gradient
        self._adam_skipped: set[int] = set()  # whose Adam step count fell behind
        # Each parameter's gradient from backward(), with _scaler_updates() then.
        self._seen: dict[int, tuple[torch.Tensor, int | None]] = {}
        # Whether each backward() since the last step added onto a nonzero .grad: their
        # flag tensors (read with one host sync at the step), False once one found it
        # absent (known on the host). _leftover: the flag a backward() found, taken up
        # after its accumulation.
        self._leftover: dict[int, torch.Tensor | bool] = {}
        self._stale: dict[int, list[torch.Tensor] | bool] = {}
        self._scales: list[float] = []
        self._weights: list[np.ndarray | None] = []
        self._group_lrs: list[list[float]] = []
        self._error = None
        self._hyper = _hyper_parameters(optimizer)
        # Weak: a recorder dropped without close() is freed, its hooks removed by its
        # finalizer (see _WeakHook), its optimizer's by the next recorder of it.
        _remove_dead_step_hooks(optimizer)
        self._handles = [optimizer.register_step_pre_hook(_WeakHook(self, "_before_step")),
                         optimizer.register_step_post_hook(_WeakHook(self, "_after_step"))]
        if self._world == 1:
            # The gradients that backward() leaves, to find what changed them before the
            # step. Under DDP they are the rank's own, before the all-reduce: there
            # clipping is declared through clip_grad_norm_ instead.
            self._handles += [p.register_post_accumulate_grad_hook(
                _WeakHook(self, "_on_grad", i)) for i, p in enumerate(params)]
            # Not serialized (torch.multiprocessing warned of each when sending the
            # module), as no hook is: the recorder stays in this process.
            self._handles += [p.register_hook(torch.utils.hooks.unserializable_hook(
                _WeakHook(self, "_before_grad", i))) for i, p in enumerate(params)]
        # The tensors' hooks only: autograd iterates over them with PyDict_Next, which a
        # removal does not disturb, where optimizer.step() iterates over its own in
        # Python, which a removal in the middle (the garbage collector freeing a
        # recorder in a cycle) makes raise: those are left as no-ops, removed by
        # _remove_dead_step_hooks.
        weakref.finalize(self, _remove_hooks, self._handles[2:]).atexit = False

    # ------------------------------------------------------------------ recording
    def set_batch(self, indices, weights=None) -> None:
        """Declare the training samples of the next ``optimizer.step()``.

        The decomposition credits the step to them with their coefficients in the
        loss that ``backward()`` differentiated: ``weights``, or by default the
        mean's, ``1 / batch_size``.

        With gradient accumulation (several ``backward()`` per step), call it once per
        micro-batch: the calls since the last step are the step's batch, each
        micro-batch's points weighing ``1 / (n_micro * its size)`` by default, the mean
        of the micro-batch means that ``(loss / n_micro).backward()`` accumulates (with
        micro-batches of one size, ``1 / batch_size``); under DistributedDataParallel,
        ``1 / (n_ranks * n_micro * its size)``, with each rank's own micro-batches
        (those of a ``no_sync()`` block and the synchronizing one). Declarations of a
        step that the ``grad_scaler`` skipped are dropped; a loop that skips
        ``optimizer.step()`` itself must not declare that step's batch.

        An empty ``indices`` declares that no sample's loss is in the step (or the
        micro-batch): an empty micro-batch adds nothing and is not counted in
        ``n_micro``, a rank's empty shard under DistributedDataParallel (uneven inputs)
        sends no sample, and a step whose whole batch is empty is credited to no sample
        of its own; its movement (momentum, weight decay) is decomposed as any other
        step's, exactly, as long as its gradient is indeed zero. A wrongly declared
        batch, empty or not, shows in :meth:`RecordedNetwork.decompose`'s reconstruction
        check, which warns when the contributions miss the network's prediction.

        Parameters
        ----------
        indices : array-like of int, shape (batch_size,)
            Indices into the ``n_samples`` training inputs whose losses the step's (or
            the micro-batch's) loss is made of; empty for none (see above).
        weights : array-like or tensor of shape (batch_size,), default=None
            Each sample's coefficient in the loss that this step's (or this
            micro-batch's) ``backward()`` differentiated, in the order of ``indices``:
            its gradient is ``sum_i weights[i] * grad l_i``, ``l_i`` the per-sample
            loss given to the analyses. For ``(w * loss_i).sum() / w.sum()``, pass
            ``w / w.sum()``; for ``(w * loss_i).mean()``, ``w / batch_size``; for
            ``loss_i.sum()``, ones. They are the coefficients of the loss as the
            ``backward()`` saw it, before the recorder's own rules: with gradient
            accumulation, your division by ``n_micro`` included (``(w * loss_i).sum()
            / w.sum() / n_micro`` is ``w / w.sum() / n_micro``), as the default
            ``1 / (n_micro * its size)`` is that of ``(loss.mean() / n_micro)``;
            micro-batches without weights keep that default. Under
            DistributedDataParallel, your rank's: the recorder divides them by
            ``n_ranks``, as DDP's average of the ranks' gradients does. With a
            ``GradScaler``, those of the loss before ``scaler.scale``; norm clipping
            is recorded on its own. Finite, of any sign (a negative coefficient is a
            loss the step ascends). None: the mean. ``attribute(method="unrolled")``
            and ``self_influence`` keep each step's total ``S_t = sum_i weights[i]``
            when they re-weight a point (the step's loss ``S_t sum_i u_i weights[i]
            l_i / sum_i u_i weights[i]`` for point weights ``u``), and refuse a step
            whose weights sum to 0 without all being 0.
        """
        if self.n_samples is None:
            raise ValueError(
                "set_batch needs the size of the training set: create the recorder with "
                "PathRecorder(module, optimizer, n_samples=N)."
            )
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        idx = np.asarray(indices)
        problem = None
        if idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
            problem = f"indices must be a 1-D array of integers, got {idx!r}."
        elif idx.size and (idx.min() < 0 or idx.max() >= self.n_samples):
            problem = (f"Batch indices must lie in [0, {self.n_samples}) (n_samples), got "
                       f"[{idx.min()}, {idx.max()}].")
        w = None
        if problem is None and weights is not None:
            w, problem = _loss_coefficients(weights, len(idx))
        if problem is not None and self._world == 1:
            raise ValueError(problem)
        # Under DDP every rank raises it at the step, naming this rank: raising here
        # alone would leave the other ranks waiting in the gather.
        self._pending_problem = problem
        if problem:
            self._pending, self._micro = None, []
            return
        # A second call before the step adds a micro-batch (gradient accumulation):
        # keeping only the last would credit the whole step to it. Unless a GradScaler
        # skipped the step they were declared for: scaler.update() then lowered the
        # scale, which nothing else changes between two steps.
        idx = idx.astype(np.int64, copy=False)
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = float(self.grad_scaler.get_scale())
            if self._pending is not None and scale != self._pending_scale:
                self._pending, self._micro = None, []
            if self._pending is None:
                self._pending_scale = scale
        self._pending = idx if self._pending is None else np.concatenate([self._pending,
                                                                           idx])
        self._micro.append((len(idx), w))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the recorded parameters, recorded.

        Needed under DistributedDataParallel, where the recorder cannot see the
        gradients before the all-reduce; in one process calling torch's own function
        is recorded as well (the recorder compares the gradients the step uses with
        those of ``backward()``). Call it where you would call torch's, after
        ``backward()`` (after ``scaler.unscale_(optimizer)`` with a GradScaler).

        Parameters
        ----------
        max_norm : float
            Largest norm of all gradients together, as torch's ``max_norm``.
        norm_type : float, default=2.0
            The norm's order, as torch's ``norm_type``.
        error_if_nonfinite : bool, default=False
            Raise when the norm is NaN or infinite, as torch does.

        Returns
        -------
        total_norm : torch.Tensor
            The gradients' norm before clipping, as torch returns it.

        Raises
        ------
        ValueError
            For a ``max_norm`` that is NaN or negative, before any gradient is changed
            (torch takes them: NaN made every gradient NaN, a negative one reversed
            them, and the path recorded either).
        """
        try:  # a 0-d tensor or array as torch takes it; not a bool or a string
            value = (None if isinstance(max_norm, (bool, np.bool_, str, bytes))
                     else float(max_norm))
        except (TypeError, ValueError):
            value = None
        if value is None or not value >= 0:
            raise ValueError(f"max_norm must be a non-negative number (inf: no clipping), "
                             f"got {max_norm!r}.")
        total = torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type,
                                               error_if_nonfinite)
        # torch's own factor, computed by the same operations on the same tensor.
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        self._declared_scale = float(coef)
        return total

    # ------------------------------------------------------------------ the step
    def _scaler_updates(self):
        """A count that GradScaler.update() advances (its scale is updated in place),
        or None without an enabled scaler."""
        scale = getattr(self.grad_scaler, "_scale", None)
        return scale._version if isinstance(scale, torch.Tensor) else None

    def _before_grad(self, i: int, grad: torch.Tensor) -> None:
        # Runs before backward() adds to .grad (and for torch.autograd.grad too, which
        # adds nothing: only _on_grad, after an accumulation, takes the flag up). Every
        # backward() until one finds .grad absent (a zero one is known at the step's
        # sync), not only the step's first: a backward() into the parameters before
        # their zero_grad() (DCGAN's generator loss reaching the recorded discriminator,
        # a diagnostic gradient after the step) adds onto the last step's gradient,
        # which the zero_grad() then clears.
        if self._stale.get(i) is not False:
            g = self._params[i].grad
            self._leftover[i] = False if g is None else g.detach().any()

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        leftover = self._leftover.pop(i, None)
        if leftover is False:
            self._stale[i] = False
        elif leftover is not None and self._stale.get(i) is not False:
            self._stale.setdefault(i, []).append(leftover)
        self._seen[i] = (p.grad.detach().clone(), self._scaler_updates())

    def _check_accumulated(self, step: int) -> None:
        """Fail when a step's gradient was added onto the last step's (no zero_grad)."""
        stale = [(i, flag) for i, flags in self._stale.items() if flags is not False
                 for flag in flags]
        self._stale, self._leftover = {}, {}
        if not stale:
            return
        # One host sync for the whole step (on a GPU each bool() waits for the device),
        # on one device for a module split over several. A parameter is stale when every
        # backward() since the last step found its .grad nonzero.
        device = stale[0][1].device
        nonzero = torch.stack([flag.to(device) for _, flag in stale]).cpu().tolist()
        clean = {i for (i, _), bad in zip(stale, nonzero) if not bad}
        names = [self._names[i] for i in sorted({i for i, _ in stale} - clean)]
        if names:
            self._fail(
                f"at optimizer step {step} backward() added the gradient onto a nonzero "
                f".grad of parameter(s) {', '.join(map(repr, names[:5]))}"
                f"{' ...' if len(names) > 5 else ''}, left from before: the step uses "
                "the sum of this step's gradient and an earlier one's, which the "
                "decomposition would credit to this step's batch alone. Call "
                "optimizer.zero_grad() before each step's backward() (or after each "
                "optimizer.step()); for gradient accumulation over micro-batches, declare "
                "each with set_batch and zero the gradients once per step.", ValueError)

    def _gather_failed(self, what: str, step: int, exc: Exception):
        # A timeout says only that another rank never came: name the ways that happens.
        # DDP's join() (uneven inputs) is one: a rank out of batches leaves the loop, and
        # its shadow of DDP's all-reduces does not take part in the recorder's gathers.
        self._fail(f"the gather of optimizer step {step}'s {what} failed ({exc}): a rank "
                   "died, or stopped taking the optimizer steps the others take (a rank "
                   "out of batches under DistributedDataParallel's join(), which the "
                   "recorder does not take part in: let such a rank go on stepping with "
                   f"an empty batch, set_batch([])); {_kept(step)}.", cause=exc)

    def _fail(self, message: str, exc=RuntimeError, cause=None):
        self._error = message
        raise exc(f"PathRecorder: {message}") from cause

    def _before_step(self, optimizer, args, kwargs) -> None:
        step = self._step
        if self._error is not None:
            raise RuntimeError(f"PathRecorder stopped recording at optimizer step {step}: "
                               f"{self._error} (close() the recorder to train on).")
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            # A fused optimizer (fused=True) under a GradScaler: scaler.step calls
            # optimizer.step() even on an overflow, with the flag its kernel reads to
            # leave the parameters and the state alone. That is no step: drop what was
            # declared for it, as for the steps a GradScaler skips itself.
            self._pending = self._pending_problem = None
            self._micro, self._seen = [], {}
            self._leftover, self._stale = {}, {}
            self._declared_scale = self._ready = None
            return
        if len(optimizer.param_groups) != len(self._hyper):
            self._fail(f"at optimizer step {step} the optimizer has "
                       f"{len(optimizer.param_groups)} parameter groups, {len(self._hyper)} "
                       "when the recorder was created (add_param_group): the recorded "
                       "parameters are fixed when recording starts. Give the optimizer "
                       "every parameter from the start.", ValueError)
        for name, p in self._watched:
            if p.requires_grad != (id(p) in self._recorded):
                # torch.optim skips a frozen parameter, which the recorded path would
                # step with the loss's gradient (and an unfrozen one is not recorded).
                self._fail(f"at optimizer step {step} parameter {name!r} is "
                           f"{'un' if p.requires_grad else ''}frozen (requires_grad="
                           f"{p.requires_grad}), which it was not when the recorder was "
                           "created: the parameters that train are fixed when recording "
                           "starts. Freeze parameters before creating the PathRecorder "
                           "(they are then constants of the path).", ValueError)
            if not p.requires_grad and p.grad is not None:
                # torch.optim steps every parameter that has a .grad, frozen or not: a
                # frozen one's, left from before it was frozen (zeroed, not cleared, by
                # zero_grad(set_to_none=False)), moves it by its own value or by its
                # group's weight decay while the record holds it as a constant (and a
                # zero one without decay writes it in place, which the constants' check
                # could not tell from a change).
                self._fail(
                    f"at optimizer step {step} parameter {name!r} is frozen "
                    "(requires_grad=False) but holds a gradient (.grad, left from before "
                    "it was frozen; zero_grad(set_to_none=False) zeroes it but keeps it): "
                    "torch.optim steps every parameter that has one, with its group's "
                    "weight decay and momentum, while the record holds it as a constant. "
                    "Set the frozen parameters' .grad to None "
                    "(module.zero_grad(set_to_none=True) before recording, or "
                    "optimizer.zero_grad() with its default set_to_none=True), or leave "
                    "them out of the optimizer.", ValueError)
        if _hyper_parameters(optimizer) != self._hyper:
            # e.g. OneCycleLR / CyclicLR cycling momentum or betas: the trajectory stores
            # one set of hyper-parameters; the learning rates may vary per step.
            self._fail(f"at optimizer step {step} a hyper-parameter other than the "
                       f"learning rate changed: {self._hyper} became "
                       f"{_hyper_parameters(optimizer)} (a scheduler cycling momentum? "
                       "use cycle_momentum=False).")
        for name, layer, why in self._mode_layers:
            if layer.training:
                fix = (f"Build it with {undrawn(layer)}"
                       if isinstance(layer, torch.nn.RNNBase)
                       else "Train with that layer in eval mode (layer.eval())")
                self._fail(
                    f"at optimizer step {step} layer {name!r} ({layer}) is in training "
                    f"mode: {why}, and the decomposition cannot replay this step. {fix}, "
                    "or record without it.")
            if refused_in_mode(layer):
                # A BatchNorm without running statistics: eval mode does not help.
                self._fail(
                    f"at optimizer step {step} layer {name!r} ({layer}) keeps no running "
                    f"statistics, so in eval mode too {why}, and the decomposition cannot "
                    "replay this step. Build it with track_running_stats=True and train "
                    "with it in eval mode (layer.eval()), or use a per-sample layer "
                    "(LayerNorm or GroupNorm).")
        if not self._warned_constants:
            self._warn_moved_constants(step)
        if self._fingerprint is not None:
            self._warn_moved_between_steps(step)
        if self._recorder is not None and not self._warned_skip:
            self._warn_skipped(step, optimizer)
        if self._world == 1:
            self._check_accumulated(step)
        scale = self._gradient_scale(step, optimizer)
        # The next step compares only what its own backward() passes give: a parameter
        # they leave out keeps the gradient zero_grad(set_to_none=False) zeroed, not
        # this step's.
        self._seen = {}
        if self._world > 1:
            batch, weights = self._gather(step)
        else:
            if self.n_samples is not None and self._pending is None:
                self._fail(f"optimizer step {step} had no batch declared: call "
                           "recorder.set_batch(indices) before every optimizer.step().")
            batch = self._pending if self._pending is not None else np.empty(0, np.int64)
            weights = None
            if self._weighted() or len({k for k, _ in self._micro if k}) > 1:
                weights = self._coefficients()
                if np.all(weights == 1.0 / max(len(weights), 1)):
                    weights = None  # the batch's mean: the default
        self._pending = self._pending_problem = None
        self._micro = []
        lrs = [_as_float(g["lr"]) for g in optimizer.param_groups]
        self._ready = (batch, weights, scale, lrs)

    def _warn_moved_constants(self, step: int) -> None:
        """Warn, once, when a parameter outside the record has been written since the
        recorder was created (another optimizer holding part of the module)."""
        moved = [name for name, p, version in self._constants if p._version != version]
        if moved:
            self._warned_constants = True
            warnings.warn(
                f"PathRecorder: at optimizer step {step} parameter(s) "
                f"{', '.join(map(repr, moved[:5]))}{' ...' if len(moved) > 5 else ''} "
                "changed since the recorder was created, but the recorded optimizer does "
                "not update them (another optimizer, or an in-place change): the record "
                "holds them as constants, and the kernels and the decomposition evaluate "
                "every recorded point with their current values, so they do not describe "
                "this training (decompose warns by how much). Give every parameter that "
                "trains to the recorded optimizer (a parameter group may have its own lr "
                "and weight decay). (Warned once.)", UserWarning, stacklevel=3)

    def _fingerprints(self, params=None) -> torch.Tensor:
        """Each recorded parameter's 2-norm (or of ``params``, copies of them), one
        reduction pass over them all: equal for equal values, whatever their storage."""
        # Without autograd: the norms of parameters that require gradients would carry
        # a grad_fn (a graph per step, kept until the next one).
        with torch.no_grad():
            norms = torch._foreach_norm(self._params if params is None else params)
        if self._devices > 1:  # a module split over devices
            norms = [n.to(norms[0].device) for n in norms]
        return torch.stack(norms)

    def _warn_diverged(self, norms: torch.Tensor, step: int) -> None:
        """Warn, once, when the recorded parameters' ``norms`` after optimizer ``step``
        are not finite: a diverged loop recorded on without a word, and its kernels then
        failed as an overflow to be cured by scaling the inputs."""
        if self._warned_diverged or step < 0 or bool(torch.isfinite(norms).all()):
            return
        self._warned_diverged = True
        names = [self._names[i]
                 for i in (~torch.isfinite(norms)).nonzero().reshape(-1).tolist()]
        warnings.warn(
            f"PathRecorder: recorded parameter(s) {', '.join(map(repr, names[:5]))}"
            f"{' ...' if len(names) > 5 else ''} hold NaN or inf values after optimizer "
            f"step {step}: training diverged, and the kernels, features and "
            "decompositions of every point recorded since are not finite. Lower the "
            "learning rate or clip the gradients (torch.nn.utils.clip_grad_norm_, which "
            "the recorder records). (Warned once.)", UserWarning, stacklevel=3)

    def _warn_moved_between_steps(self, step: int) -> None:
        """Warn, once, when a recorded parameter changed since the recorder recorded
        the last step (or the initial point): the next step's record takes the change
        as part of that step."""
        before, self._fingerprint = self._fingerprint, None
        now = self._fingerprints()
        before = before.to(now.device)  # should the module have moved since
        if torch.equal(now, before):  # one host sync
            self._fingerprint = before  # still the values the last step left
            return
        self._warn_diverged(now, step - 1)
        moved = _changed(now, before).nonzero()
        if not len(moved):
            self._fingerprint = now
            return
        names = [self._names[i] for i in moved.reshape(-1).tolist()]
        when = f"after optimizer step {step - 1}" if step else "since the recorder was created"
        warnings.warn(
            f"PathRecorder: recorded parameter(s) {', '.join(map(repr, names[:5]))}"
            f"{' ...' if len(names) > 5 else ''} changed {when}, outside "
            "optimizer.step() (weight clipping, a max-norm projection, load_state_dict, "
            "a re-initialisation): the record takes the change as part of optimizer "
            f"step {step}, which the step's gradient does not explain, so the "
            "decomposition will not be exact (decompose warns by how much) and the "
            "kernels describe a path with that jump. To record such a loop exactly, make "
            "the change part of the loss (a penalty instead of clipping), or change the "
            "parameters before creating the recorder."
            + (" Under DistributedDataParallel, a recorder created before the module was "
               "wrapped sees DistributedDataParallel(module) copy rank 0's parameters "
               "to every rank: create it after wrapping (on the wrapper or its "
               ".module)." if step == 0 and self._world > 1 and self._ddp_may_move else "")
            + " (Warned once.)",
            UserWarning, stacklevel=3)

    def _warn_moved_since_last_step(self) -> None:
        """Warn when the recorded parameters changed since the last recorded step: steps
        the recorder did not see (a replaced optimizer, training on after ``close()``)
        are in no trajectory, which then ends at parameters the module no longer has."""
        # Read where and as they were recorded: a conversion since changes no value.
        now = self._fingerprints([
            p if (p.device, p.dtype) == home else p.detach().to(*home)
            for p, home in zip(self._params, self._homes)])
        before = self._fingerprint.to(now.device)
        if torch.equal(now, before) or not bool(_changed(now, before).any()):
            return
        when = (f"after optimizer step {self._step - 1}, the last one recorded"
                if self._step else "since the recorder was created")
        warnings.warn(
            f"PathRecorder: the module's recorded parameters changed {when}, and no "
            "recorded step explains the change (the optimizer replaced by a new one, "
            "training continued after close() or the with-block, a parameter changed in "
            "place): the trajectory holds the recorded steps only, so the kernels, "
            "predictions and decomposition do not describe the current network (the "
            "decomposition misses the change, or stops before it). Record every "
            "step with the optimizer given to the recorder, or create a new recorder for "
            "the new optimizer.", UserWarning, stacklevel=3)

    def _warn_skipped(self, step: int, optimizer) -> None:
        """Warn, once, when torch.optim skips a recorded parameter for want of a gradient
        where its rule would move it with a zero gradient, or when Adam's count of a
        parameter's steps fell behind at such a skip."""
        names, behind = [], []
        counts = self.solver_spec.name in ("adam", "adamw")
        for i, (name, p, g) in enumerate(zip(self._names, self._params,
                                              self._param_groups)):
            if p.grad is not None:
                # Adam counts each parameter's own steps for its bias corrections: one
                # skipped before it had any state (no gradient at the first step) moved
                # nothing then, but from now on it is corrected with a smaller count
                # than the one the recorded path uses for every parameter.
                if i in self._adam_skipped:
                    behind.append(name)
                continue
            if counts:
                self._adam_skipped.add(i)
            state = optimizer.state.get(p, {})
            # What moves a parameter of zero gradient: weight decay, a momentum buffer,
            # Adam's first moment. The recorded path steps it so; torch.optim does not.
            if (_as_float(optimizer.param_groups[g].get("weight_decay", 0.0)) > 0
                    or state.get("momentum_buffer") is not None or "exp_avg" in state):
                names.append(name)
        if behind and not names:
            self._warned_skip = True
            warnings.warn(
                f"PathRecorder: at optimizer step {step} parameter(s) "
                f"{', '.join(map(repr, behind[:5]))}{' ...' if len(behind) > 5 else ''} "
                "have taken fewer Adam steps than the optimizer step count: at an earlier "
                "step they had no gradient (backward() left them out of the graph) and "
                "torch.optim skipped them, so their bias corrections now count fewer "
                "steps than the recorded path's, which counts every step. The "
                "decomposition will not be exact (decompose warns by how much). To "
                "record such a loop exactly, give them a zero gradient before "
                "optimizer.step() (p.grad = torch.zeros_like(p)) at every step. (Warned "
                "once.)", UserWarning, stacklevel=3)
        elif names:
            self._warned_skip = True
            warnings.warn(
                f"PathRecorder: at optimizer step {step} parameter(s) "
                f"{', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''} "
                "have no gradient (backward() left them out of the graph), so torch.optim "
                "skips them: their momentum, Adam moments or weight decay do not move them "
                "this step, where the recorded path steps them with a zero gradient. If the "
                "network's outputs depend on them, the decomposition will not be exact "
                "(decompose warns by how much). To record such a loop exactly, give them "
                "a zero gradient before optimizer.step() (p.grad = torch.zeros_like(p)), "
                "or freeze the parameters the network never uses before creating the "
                "recorder. (Warned once.)", UserWarning, stacklevel=3)

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._ready is None:  # an overflow the fused kernel skipped
            return
        batch, weights, scale, lrs = self._ready
        self._ready = None
        step = self._step
        self._step += 1
        self._declared_scale = None
        rec = self._recorder
        if rec is None:
            return
        self._scales.append(scale)
        self._weights.append(weights)
        if len(lrs) > 1:
            self._group_lrs.append(lrs)
        rec.record_batch(batch)
        step -= self._first_step  # the step of this recording
        rec.record_step(step, max(lrs), optimizer)
        if rec.wants_point(step + 1):
            rec.record_point(step + 1)
        if self._fingerprint is not None:  # None once warned
            self._fingerprint = self._fingerprints()

    def _gradient_scale(self, step: int, optimizer) -> float:
        """The factor the gradients of backward() are multiplied by in the step."""
        declared = self._declared_scale
        if self._world > 1:
            return 1.0 if declared is None else declared
        pairs = []
        updates = self._scaler_updates()
        for i, p in enumerate(self._params):
            if p.grad is None:
                continue
            seen, seen_updates = self._seen.get(i, (None, None))
            if seen is None or seen_updates != updates:
                # Set by hand, not by backward(), or left by the backward() of an
                # overflow the GradScaler skipped (no step hook ran; scaler.update() has
                # run since): nothing to compare it with (the decomposition's own check
                # judges what it did).
                continue
            pairs.append((p.grad.detach(), seen))
        # One host sync for the whole step, not one per parameter (on a GPU each
        # torch.equal waits for the device).
        found = any(g.shape != s.shape for g, s in pairs) or bool(
            pairs and torch.stack([torch.ne(g, s).any() for g, s in pairs]).any())
        unscale = 1.0
        # A fused optimizer under a GradScaler (fused=True, no unscale_ before the step)
        # divides the gradients by the loss's scale in its own kernel: relative to the
        # loss's gradient, the step's factor is then the one found below.
        fused_unscales = getattr(optimizer, "grad_scale", None) is not None
        if (not fused_unscales and self.grad_scaler is not None
                and self.grad_scaler.is_enabled()):
            # backward() saw the scaled loss; scaler.step unscaled the gradients.
            unscale = float(self.grad_scaler.get_scale())
            found = True
        if not found:
            return 1.0 if declared is None else declared
        pairs = [(g.double(), s.double()) for g, s in pairs if g.numel()]
        if pairs:
            dot, norm2, top = torch.stack([torch.stack(
                [(g * s).sum(), (s * s).sum(), s.abs().max()]) for g, s in pairs]).cpu().T
            dot, norm2, top = float(dot.sum()), float(norm2.sum()), float(top.max())
        else:
            dot = norm2 = top = 0.0
        c = dot / norm2 if norm2 > 0 else 1.0
        eps = float(torch.finfo(self._params[0].dtype).eps)
        worst = float(torch.stack([(g - c * s).abs().max() for g, s in pairs]).max()
                      ) if pairs else 0.0
        # One factor for every entry, to the round-off of one multiplication (of two,
        # with a GradScaler's unscaling).
        if worst > 8 * eps * (abs(c) * top + 1e-300):
            world = _process_group()[0]
            if world > 1:
                # Created before init_process_group, the recorder took the run for one
                # process's: DDP's all-reduce, averaging the ranks' gradients after
                # backward(), is what changed them.
                self._fail(
                    f"at optimizer step {step} the gradients the optimizer is about to "
                    "use are not those of backward() times one factor, and torch."
                    f"distributed's process group has {world} processes, while there was "
                    "none when the "
                    "recorder was created: under DistributedDataParallel the all-reduce "
                    "averages the ranks' gradients after backward(), which a recorder of "
                    "one process cannot split over the training points. Create the "
                    "PathRecorder after init_process_group, on every rank (each declares "
                    "its shard; the writer_rank records the global batch).", ValueError)
            self._fail(
                f"at optimizer step {step} the gradients the optimizer is about to use "
                "are not those of backward() times one factor (they depart from the best "
                f"factor {c:.6g} by up to {worst:.3g}): value clipping (clip_grad_value_), "
                "gradient noise or custom gradient surgery changes each entry on its own, "
                "and the decomposition cannot split such a step over the training points. "
                "Norm clipping (clip_grad_norm_) is recorded exactly; remove the rest.",
                ValueError)
        def is_declared(factor):  # the clip recorder.clip_grad_norm_ declared
            return declared is not None and abs(declared - factor) <= 8 * eps * abs(declared)

        if (self.grad_scaler is None and not fused_unscales and c != 1 and not is_declared(c)
                and not self._warned_unscaled and _called_by_grad_scaler()):
            # A GradScaler's step() takes this step and unscale_ divided the gradients
            # by its scale (2**k, times a clip's factor if one followed): the recorder,
            # not given it, takes the scaled loss's gradients for the declared loss's and
            # every step's share comes out 2**k times too small. Told by the caller, not
            # by the factor: dividing accumulated gradients by n_micro = 2, 4, 8 is also
            # a power of two, and exact. (A factor recorder.clip_grad_norm_ declared is
            # that clip, whatever its value.)
            self._warned_unscaled = True
            exact = math.frexp(c)[0] == 0.5
            warnings.warn(
                f"PathRecorder: optimizer step {step} is taken by a torch.amp.GradScaler's "
                "step(), but the recorder was given no grad_scaler: the gradients the "
                "optimizer is about to use are those of backward() times "
                + (f"exactly 2**{math.frexp(c)[1] - 1}" if exact else f"{c:.6g}")
                + ", as the scaler's unscaling leaves them, which the recorder "
                "records as a clip, so the decomposition misses (decompose warns by how "
                "much), and the steps the scaler skips are counted into the next step's "
                "batch. Pass grad_scaler=scaler to PathRecorder. (Warned once.)",
                UserWarning, stacklevel=3)
        c *= unscale
        if is_declared(c):
            return declared
        return c

    def _gather(self, step: int):
        """Every rank's shard of this step, on the writing rank; raises on every rank
        when one rank's declaration is wrong."""
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        local = self._pending
        status = (2 if self._pending_problem else
                  1 if local is None and self.n_samples is not None else 0)
        n = 0 if local is None else len(local)
        # The sizes of the rank's micro-batches travel after its indices: under gradient
        # accumulation a point's weight depends on its own micro-batch, not on the shard.
        micro = [k for k, _ in self._micro if k] if n else []
        header = torch.tensor([step, n, status, len(micro), bool(n and self._weighted())],
                              dtype=torch.int64, device=device)
        headers = [torch.empty_like(header) for _ in range(self._world)]
        try:
            dist.all_gather(headers, header)
        except Exception as exc:  # a rank that stopped: recorded steps stay readable
            self._gather_failed("batches", step, exc)
        H = torch.stack(headers).cpu().numpy()
        problems = []
        for r, (s, _, st, _, _) in enumerate(H):
            if s != step:
                problems.append(f"rank {r} is at optimizer step {s}, rank {self._rank} at "
                                f"{step}")
            elif st == 1:
                problems.append(f"rank {r} declared no batch (set_batch) for optimizer "
                                f"step {step}")
            elif st == 2:
                problems.append(f"rank {r} declared a wrong batch for optimizer step {step}"
                                + (f": {self._pending_problem}" if r == self._rank else ""))
        if problems:
            self._pending = self._pending_problem = None
            self._micro = []
            self._fail("; ".join(problems) + ". Every rank must call "
                       "recorder.set_batch(its shard's global indices) before every "
                       "optimizer.step().", ValueError)
        sizes, n_micro = H[:, 1], H[:, 3]
        buf = torch.full((int((sizes + n_micro).max()),), -1, dtype=torch.int64,
                         device=device)
        if n:
            buf[:n] = torch.as_tensor(local, device=device)
            buf[n : n + len(micro)] = torch.as_tensor(micro, device=device)
        writer = self._rank == self.writer_rank
        bufs = [torch.empty_like(buf) for _ in range(self._world)] if writer else None
        try:
            dist.gather(buf, bufs, dst=self.writer_rank)
        except Exception as exc:
            self._gather_failed("batches", step, exc)
        given = None
        if H[:, 4].any():
            # A rank declared its loss coefficients (set_batch(..., weights)): every rank
            # sends its samples' coefficients, the default ones where it gave none.
            buf = torch.zeros((int(sizes.max()),), dtype=torch.float64, device=device)
            if n:
                buf[:n] = torch.as_tensor(self._coefficients(), device=device)
            given = [torch.empty_like(buf) for _ in range(self._world)] if writer else None
            try:
                dist.gather(buf, given, dst=self.writer_rank)
            except Exception as exc:
                self._gather_failed("batch weights", step, exc)
        if not writer:
            return None, None
        bufs = [b.cpu().numpy() for b in bufs]
        batch = np.concatenate([b[:k] for b, k in zip(bufs, sizes)])
        if given is not None:
            # DDP averages the ranks' gradients: each rank's coefficients over n_ranks.
            weights = np.concatenate([b.cpu().numpy()[:k] for b, k in zip(given, sizes)]
                                     ) / self._world
            if np.all(weights == 1.0 / max(len(batch), 1)):
                return batch, None
            return batch, weights
        # DDP averages the ranks' gradients, and (loss / m_r).backward() on each of a
        # rank's m_r micro-batches averages their means: a sample of a micro-batch of
        # k on rank r weighs 1 / (R m_r k); 1 / (R n_r) for a shard in one piece.
        weights = np.concatenate([np.full(k, 1.0 / (self._world * m * k))
                                  for b, n_r, m in zip(bufs, sizes, n_micro)
                                  for k in b[n_r : n_r + m]] or [np.empty(0)])
        if np.all(weights == 1.0 / max(len(batch), 1)):
            return batch, None  # the batch's mean: the default
        return batch, weights

    def _weighted(self) -> bool:
        """Whether a micro-batch of the step declared its loss coefficients."""
        return any(w is not None for _, w in self._micro)

    def _coefficients(self) -> np.ndarray:
        """The coefficients of this process's declared samples of the step in the loss
        its backward() passes differentiated, in their order: each micro-batch's own
        (``set_batch``'s ``weights``) or, where it gave none, ``1 / (n_micro * k)`` for
        a micro-batch of ``k`` (``(mean / n_micro).backward()``), ``n_micro`` counting
        the step's non-empty micro-batches."""
        parts = [(k, w) for k, w in self._micro if k]
        return np.concatenate([np.full(k, 1.0 / (len(parts) * k)) if w is None else w
                               for k, w in parts] or [np.empty(0)])

    def __reduce_ex__(self, protocol):
        # A copy would hold no hooks (torch.optim pickles none, nor tensors theirs): it
        # trained on without recording a step, silently, or, copied in this process,
        # shared the optimizer with this recorder's hooks.
        raise TypeError(
            "A PathRecorder cannot be pickled or copied (torch.save of a checkpoint "
            "holding it, copy.deepcopy): it records through hooks on the optimizer and "
            "the parameters, which no copy would carry, so a loaded copy would record "
            "nothing more. To checkpoint a recorded loop and resume it: " + _RESUME + ".")

    def close(self) -> None:
        """Stop recording (remove the hooks); the trajectory stays readable."""
        _remove_hooks(self._handles)

    def __enter__(self) -> PathRecorder:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # ------------------------------------------------------------------ reading
    @property
    def n_steps(self) -> int:
        """Optimizer steps recorded so far (with ``resume_from``, the path's too)."""
        return self._step

    @property
    def trajectory(self) -> Trajectory:
        """The path recorded so far, as a :class:`~skpathkernel.Trajectory`.

        The current parameters are its last point (recorded now if the last step was not
        a multiple of ``record_every``); recording can continue afterwards. In memory,
        points that lie in several of the buffers' parts are copied into one array,
        each part released as it is copied. After a
        refused step the path ends before it (with a warning saying where and why):
        steps are refused before they are taken, so what was recorded stays whole.
        """
        if self._recorder is None:
            raise RuntimeError(f"Rank {self._rank} does not write the trajectory: rank "
                               f"{self.writer_rank} does (writer_rank).")
        if self._fingerprint is not None:  # the last step's, which no next step checked
            self._warn_diverged(self._fingerprint, self._step - 1)
            self._warn_moved_since_last_step()
        if self._error is not None:
            warnings.warn(f"The recording stopped: the trajectory ends after optimizer "
                          f"step {self._step - 1} ({self._step} steps): {self._error}",
                          UserWarning, stacklevel=2)
        traj = self._recorder.finish()
        n = traj.n_steps
        scales = np.asarray(self._scales[:n])
        weights = None
        if any(w is not None for w in self._weights[:n]):
            weights = np.concatenate([
                mean_batch_weights(traj._batch_offsets[t : t + 2]) if w is None else w
                for t, w in enumerate(self._weights[:n])])
        group_lrs = step_group_lrs = None
        if self._group_lrs:
            # Each interval's mean per group, as learning_rates holds the largest's, so
            # that the scales of step_size_scales are the ratios of the total step sizes;
            # every step's own where a scheduler changed one inside an interval.
            per_step = np.asarray(self._group_lrs[:n], dtype=np.float64)
            group_lrs, varies = interval_means(per_step, traj.steps)
            step_group_lrs = per_step if varies else None
        traj._attach(
            gradient_scales=None if np.all(scales == 1.0) else scales,
            batch_weights=weights, group_lrs=group_lrs, step_group_lrs=step_group_lrs,
            param_groups=self._param_groups if (group_lrs is not None
                                                or self._group_wds) else None,
            group_weight_decays=self._group_wds)
        if self._resumed is None:
            return traj
        # One path from the first initialization: the resumed one, then this recording
        # (on disk, recorded into its series).
        return extend_trajectory(self._resumed, traj, 0, self._resumed.n_samples)

    def as_estimator(self, X_train=None, y_train=None, *, loss="squared_error",
                     memory_budget: int = 2**30) -> RecordedNetwork:
        """The recorded path as a :class:`RecordedNetwork` (kernels, decomposition).

        Parameters
        ----------
        X_train : array-like or tensor of shape (n_samples, ...), default=None
            The training inputs the recorded batches index into, as in :meth:`as_network`.
        y_train : array-like or tensor of shape (n_samples,) or (n_samples, n_targets), \
default=None
            Their targets, as in :meth:`as_network`.
        loss : "squared_error", "log_loss" or callable, default="squared_error"
            The per-sample loss whose batch mean each step minimized ("squared_error":
            ``1/2`` the mean over the outputs of ``(f_c - y_c)^2``, not their sum).
        memory_budget : int, default=2**30
            Bytes one block of a kernel or decomposition computation may use.

        Returns
        -------
        estimator : RecordedNetwork
            Fitted by construction, with the network of :meth:`as_network` as its
            ``network_``.
        """
        return RecordedNetwork(_unwrap(self.module), self.trajectory, X_train=X_train,
                               y_train=y_train, loss=loss, memory_budget=memory_budget)

    def as_network(self, X_train=None, y_train=None, *, loss="squared_error",
                   memory_budget: int = 2**30) -> TrainedNetwork:
        """The recorded path as a :class:`~skpathkernel.TrainedNetwork`.

        The network of :meth:`as_estimator` (its ``network_``) without the estimator
        around it: what :class:`~skpathkernel.kernels.TangentKernel`,
        :class:`~skpathkernel.kernels.PathKernel`, the displays and the decomposition
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
            The per-sample loss whose batch mean each step minimized ("squared_error":
            ``1/2`` the mean over the outputs of ``(f_c - y_c)^2``, not their sum).
        memory_budget : int, default=2**30
            Bytes one block of a kernel or decomposition computation may use.

        Returns
        -------
        network : TrainedNetwork
            The module and its recorded path, with the training data and loss.

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
        return _recorded_network(self.module, self.trajectory, loss, X_train, y_train,
                                 memory_budget)


def _recorded_network(module, trajectory, loss, X_train, y_train,
                      memory_budget) -> TrainedNetwork:
    """The :class:`TrainedNetwork` of a recorded loop (``as_network``, and
    ``RecordedNetwork.network_``), its training inputs checked."""
    net = TrainedNetwork(_unwrap(module), trajectory, loss=loss, X_fit=X_train, y_fit=y_train,
                         memory_budget=memory_budget)
    net._check_training_inputs()
    if net.X_fit is not None and len(net.X_fit):
        # A layer that draws without a type the recorder knows (torchvision's
        # StochasticDepth, timm's DropPath) left in training mode: the analyses drew anew
        # at every call, without a word, and decompose blamed its quadrature. 64 rows: a
        # per-sample draw at p = 0.1 repeats on all of them with probability 3e-6.
        x = to_input_tensor(net.X_fit[:64], dtype=net.torch_dtype, device=net.torch_device)
        warn_recorded_probes(net.module, x)
    else:
        # Without them (PathRecorder(model, SGD(lr=0)).as_estimator(), a pretrained model
        # left in training mode) the first analysis's inputs are probed, once: nothing
        # else warned, and every prediction and kernel drew anew.
        net.__dict__["_probe_draws"] = True
    return net


_DECLARED = ("\n\nOver the declared training inputs, with the declared loss: exact "
             "(``error`` at round-off) when that loss reproduces the optimizer's "
             "gradients; see the user guide (:ref:`theory-any-loss`) for what the "
             "contributions mean otherwise.")
_X_TRAIN_FORM = ("array-like of shape (n_queries, n_features) or (n_queries, ...)\n"
                 "    In the form of ``X_train``.")


class RecordedNetwork(FittedNetworkMixin, NetworkKernelsMixin, NetworkAttributesMixin,
                      TransformerMixin, VersionedStateMixin, BaseEstimator):
    """A recorded path and its network, usable where the library takes a fitted estimator.

    Exposes the recorded network as a :class:`~skpathkernel.TrainedNetwork`
    (``network_``, built from the current parameters), which
    :class:`~skpathkernel.kernels.TangentKernel` and :class:`~skpathkernel.kernels.PathKernel`
    read, the two kernels as ``tangent_kernel_`` and ``path_kernel_``, and the estimators'
    verbs: :meth:`decompose`, :meth:`attribute`, :meth:`explain`, :meth:`kneighbors`,
    :meth:`transform` (the tangent features, with scikit-learn's ``set_output`` and
    :meth:`get_feature_names_out`) and :meth:`self_influence`. It
    is fitted by construction: :meth:`fit` does nothing (as
    ``sklearn.frozen.FrozenEstimator``), and ``clone`` returns an equally fitted copy.

    Parameters
    ----------
    module : torch.nn.Module
        The network whose path was recorded; called through ``torch.func.functional_call``
        with the recorded parameters, so its own current values are not used.
    trajectory : Trajectory
        The path recorded by a :class:`~skpathkernel.PathRecorder` of ``module``.
    X_train : array-like or tensor of shape (n_samples, n_features) or (n_samples, ...)
        The training inputs the recorded batches index into, in the form the network
        takes: floats (2-D features, images, sequences) or integer token ids (handed to
        the network as int64). Needed by :meth:`decompose`; also fixes ``n_features_in_``
        and ``input_shape_``, the form every later ``X`` must have (refused, naming it,
        when the module cannot run it); a DataFrame's string column names are
        ``feature_names_in_``, which every later ``X`` with names must have, in their
        order (scikit-learn's check: other or reordered columns are refused, not read by
        position). Without it, any
        ``(n, ...)`` array that the module can run is taken as it is (one it cannot is
        refused with a ``ValueError`` naming its shape and dtype).
    y_train : array-like or tensor of shape (n_samples,) or (n_samples, n_targets)
        Their targets, in the form the loss takes (integer class codes for multi-class
        "log_loss", a 0/1 indicator matrix of the outputs' shape for multilabel
        "log_loss"; a 1-D ``y`` is made a column for "squared_error").
    loss : "squared_error", "log_loss" or callable, default="squared_error"
        The per-sample loss whose batch mean each step minimized: the library's names
        (:class:`~skpathkernel.PathKernelMachine`'s conventions) or
        ``per_sample(output, target) -> tensor of shape (B,)``, called with the
        module's outputs flattened per sample, shape ``(B, C)``.
    memory_budget : int, default=2**30
        Bytes one block of a kernel or decomposition computation may use.

    Attributes
    ----------
    network_ : TrainedNetwork
        The network built from the current parameters (again after ``set_params``).
    module_ : torch.nn.Module
    trajectory_ : Trajectory
    device_ : str
    dtype, dtype_ : str
        "float32" or "float64", the trajectory's dtype.
    n_params_ : int
    X_fit_ : ndarray of shape (n_samples, n_features) or (n_samples, ...), or None
        ``X_train`` as the network takes it (floats, or int64 token ids); None without
        ``X_train``.
    train_indices_ : ndarray of int of shape (n_samples,), or None
        ``arange(n_samples)``: ``X_fit_`` is ``X_train``, row for row (the estimators'
        ``train_indices_`` map their ``X_fit_`` to ``fit``'s ``X``, which this
        ``fit`` ignores); None without ``X_train``.
    n_features_in_ : int
        Values per sample, ``prod(input_shape_)``; only when ``X_train`` is given.
    input_shape_ : tuple of int
        The trailing shape of ``X_train`` (``(n_features,)`` for 2-D inputs); only when
        ``X_train`` is given.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        The column names of ``X_train``, only when it is a DataFrame with string column
        names.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine, RecordedNetwork
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> net = RecordedNetwork(est.module_, est.trajectory_, X_train=X, y_train=y)
    >>> bool(np.allclose(net.path_kernel_(X), est.path_kernel_(X)))
    True
    >>> phi = net.transform(X[:3])  # the tangent features, as the estimators'
    >>> phi.shape == (3, net.n_params_), bool(np.allclose(phi @ phi.T,
    ...                                               net.tangent_kernel_(X[:3])))
    (True, True)
    >>> ind = net.kneighbors(X[:2], n_neighbors=3, return_distance=False)
    >>> bool(np.array_equal(ind, est.kneighbors(X[:2], n_neighbors=3)[1]))
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
            net = _recorded_network(self.module, self.trajectory, self.loss, self.X_train,
                                    self.y_train, self.memory_budget)
            # Read before the network's array has dropped them; scikit-learn's check
            # (names of mixed types are refused) with the other inputs'.
            names = _get_feature_names(self.X_train)
            cached = self.__dict__["_cache"] = (params, net, names)
        return cached[1]

    @property
    def feature_names_in_(self) -> np.ndarray:
        """Column names of ``X_train``; only when it is a DataFrame with string names."""
        self._network()
        names = self.__dict__["_cache"][2]
        if names is None:
            raise AttributeError("feature_names_in_ is only set when X_train is a "
                                 "DataFrame with string column names.")
        return names

    def _check_names(self, X) -> None:
        """Refuse other or reordered columns than ``X_train``'s (as the estimators'
        verbs refuse them; an array of values warns that it has none). Without names
        in ``X_train`` any ``X`` passes as it did: nothing was declared to check."""
        if hasattr(self, "feature_names_in_"):
            _check_feature_names(self, X, reset=False)

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
        """Values per sample, ``prod(input_shape_)``; only when ``X_train`` is given."""
        n = self._network().n_features_in
        if n is None:
            raise AttributeError("n_features_in_ is only set when X_train is given.")
        return n

    @property
    def train_indices_(self) -> np.ndarray | None:
        """``arange(n_samples)`` of ``X_train`` (``X_fit_``); None without it."""
        X_fit = self._network().X_fit
        return None if X_fit is None else np.arange(len(X_fit))

    @property
    def input_shape_(self) -> tuple[int, ...]:
        """The trailing shape of ``X_train``; only when ``X_train`` is given."""
        shape = self._network().input_shape
        if shape is None:
            raise AttributeError("input_shape_ is only set when X_train is given.")
        return shape

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_cache", None)  # rebuilt from the parameters
        return state

    def relocate_trajectory(self, directory) -> RecordedNetwork:
        """Read the on-disk path from ``directory``, where its directory was moved.

        ``trajectory.relocate(directory)``: see
        :meth:`Trajectory.relocate <skpathkernel.Trajectory.relocate>`, which checks that
        ``directory`` holds this path and changes nothing otherwise. A pickled
        RecordedNetwork references an on-disk path's directory by the name it had, and
        every call reads it (``predict`` too: the path's last point).

        Parameters
        ----------
        directory : str or os.PathLike
            The path's directory at its new place.

        Returns
        -------
        self : RecordedNetwork
            This network, reading from ``directory``.
        """
        # The module too: a path saved without a recording identity is told from another
        # network's by its last point, which is the module's parameters (under the
        # names the path records: a compiled or DDP module's own).
        self.trajectory._relocate(directory, _unwrap(self.module))
        return self

    def fit(self, X=None, y=None) -> RecordedNetwork:
        """Do nothing: the network was trained by the recorded loop.

        Parameters
        ----------
        X : None
            Ignored.
        y : None
            Ignored.

        Returns
        -------
        self : RecordedNetwork
            Unchanged.
        """
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return True

    def _validate_X(self, X):
        # The network's own check, as its kernels take X: X_train is optional, and
        # without it any (n, ...) array the module runs is taken (scikit-learn's
        # validate_data would read an n_features_in_ it does not have).
        net = self._network()
        self._check_names(X)
        X = net.check(X)
        check_representable(X, net.torch_dtype)
        return X

    def _outputs_per_sample(self, X) -> int:
        # An own loop declares no number of outputs: one sample's forward pass counts
        # them (as the meta-estimators count a RecordedNetwork's in fit).
        return self._network().outputs(X[:1]).shape[1]

    def transform(self, X) -> np.ndarray:
        """Tangent features phi(x) = d f(x; theta_T) / d theta at the last recorded point.

        As the estimators' ``transform``: inner products of the rows are the tangent
        kernel ``tangent_kernel_``.

        Parameters
        ----------
        X : array-like or tensor of shape (n_samples, ...)
            In the form of ``X_train`` when it was given.

        Returns
        -------
        phi : ndarray of shape (n_samples, `n_params_`) or (n_samples, n_outputs * `n_params_`)
            One row per sample, columns in ``trajectory_`` flat order, in the network's
            dtype. For several outputs, the flattened Jacobian divided by
            ``sqrt(n_outputs)``, whose inner products are the trace kernel.
        """
        return self._tangent_features(X)

    def get_feature_names_out(self, input_features=None):
        """Names of the tangent features: ``"<parameter>[<index>]"``, e.g. ``"0.weight[3]"``.

        With several outputs, ``"out<c>:<parameter>[<index>]"``, as the estimators'.
        The outputs are counted on the first sample of ``X_train`` (an own loop declares
        none), which is needed: without it, a ``ValueError``. Also what
        ``set_output(transform="pandas")`` names :meth:`transform`'s columns with.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Only checked against ``feature_names_in_`` (or ``n_features_in_``), as
            scikit-learn's transformers do; the names come from the network's parameters.

        Returns
        -------
        feature_names_out : ndarray of str objects
        """
        X_fit = self._network().X_fit
        if X_fit is None or not len(X_fit):
            raise ValueError(
                "get_feature_names_out counts the network's outputs on a sample of "
                "X_train, which this RecordedNetwork was made without: pass X_train "
                "(PathRecorder.as_estimator(X_train, ...)).")
        _check_feature_names_in(self, input_features, generate_names=False)
        return tangent_feature_names(self.trajectory_, self._outputs_per_sample(X_fit))

    def __sklearn_tags__(self):
        # Tangent features come out in the network's dtype, whatever X's (after
        # TransformerMixin's preserves_dtype=["float64"]).
        return declare_feature_dtype(super().__sklearn_tags__(), self)

    def predict(self, X) -> np.ndarray:
        """Network outputs ``f(X; theta_T)`` at the last recorded point.

        Parameters
        ----------
        X : array-like or tensor of shape (n_samples, ...)
            In the form of ``X_train`` when it was given.

        Returns
        -------
        outputs : ndarray of shape (n_samples, n_outputs)
            The raw network outputs (logits for a classification loss).
        """
        self._check_names(X)
        return warn_not_finite(self._network().outputs(X))

    @shared_doc(DECOMPOSE, note=_DECLARED, X=_X_TRAIN_FORM, extra_params="", raises="",
                examples="")
    def decompose(self, X, *, method: str = "exact", weighting: str = "realized",
                  n_nodes: int | None = None, tol: float | None = None,
                  n_jobs: int | None = None):
        self._check_names(X)
        return self._network().decompose(X, method=method, weighting=weighting,
                                         n_nodes=n_nodes, tol=tol, n_jobs=n_jobs)

    @shared_doc(ATTRIBUTE, note=_DECLARED, X=_X_TRAIN_FORM,
                y="array-like of int of shape (n_queries,) or (n_queries, n_outputs), "
                  "default=None\n    With ``output=\"margin\"``: the queries' classes as "
                  "output columns (with\n    ``loss=\"log_loss\"`` and a ``y_train`` "
                  "that is a 0/1 indicator of two or more\n    columns, multilabel: a 0/1 "
                  "indicator row per query, and the margin is the\n    sum of the logits "
                  "signed +1 for a label that is on, -1 for one that is\n    off; soft "
                  "targets are not label sets: ``network_.replace(multilabel=True)``\n    "
                  "says otherwise); None takes the largest output (or a positive single\n"
                  "    output) as the class (the positive outputs as the labels). Given with\n"
                  "    ``output=None``, refused: only the margin reads it.",
                output_default="None: output 0 of a single-output network (several outputs "
                               "need a choice).",
                examples="")
    def attribute(self, X, y=None, *, method: str = "exact", weighting: str = "realized",
                  output=None, n_nodes: int | None = None, tol: float | None = None,
                  n_jobs: int | None = None) -> np.ndarray:
        self._check_names(X)
        return self._network().attribute(X, y, method=method, weighting=weighting,
                                          output=output, n_nodes=n_nodes, tol=tol,
                                          n_jobs=n_jobs)

    def explain(self, X, n_neighbors: int = 10, *, method: str = "exact", output=None,
                n_jobs: int | None = None):
        """The training points that moved each prediction the most.

        For each query, the training points with the largest contribution ``|a_i(x)|``
        to the explained output, as the estimators' ``explain``: a scalar output
        (``output="margin"`` or an output index, as in :meth:`attribute`) through
        :meth:`attribute`'s contracted route, or ``output="all"``, ranked by ``|a_i(x)|``
        summed over every output of :meth:`decompose`.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features) or (n_queries, ...)
            In the form of ``X_train``.
        n_neighbors : int, default=10
            Training points per query, largest contribution first (at most the number
            of training samples).
        method : {"exact", "first_order", "second_order"}, default="exact"
            How the contributions are computed, as in :meth:`decompose`.
        output : "margin", int, array-like of float or "all", default=None
            The output explained. None: output 0 of a single-output network (several
            outputs need a choice). "margin" explains the largest output's margin (the
            positive outputs' for a multilabel loss), as :meth:`attribute` does with
            ``y=None``; output weights explain the outputs' weighted sum, as in
            :meth:`attribute`.
        n_jobs : int, default=None
            Query blocks on joblib workers, as in :meth:`decompose`.

        Returns
        -------
        indices : ndarray of shape (n_queries, n_neighbors)
            Rows of ``X_train`` (``X_fit_``), largest contribution first.
        contributions : ndarray of shape (n_queries, n_neighbors, n_explained)
            Their contributions: one column for a scalar output, ``n_outputs`` for "all".
        """
        self._check_names(X)
        return self._network().explain(X, n_neighbors, method=method, output=output,
                                        n_jobs=n_jobs)

    @shared_doc(SELF_INFLUENCE, examples="",
                label='with ``output="margin"``, the margin of its declared target: its '
                      "class code, or the positive or largest target column (the "
                      "multilabel margin of its label set for ``loss=\"log_loss\"`` and a "
                      "``y_train`` that is a 0/1 indicator of two or more columns)")
    def self_influence(self, *, output=None, n_jobs: int | None = None) -> np.ndarray:
        return self._network().self_influence(output=output, n_jobs=n_jobs)
