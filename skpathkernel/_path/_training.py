"""The training loop that records the optimisation path.

The loop drives torch.optim's own update functions (:class:`FunctionalOptimizer`), so
the recorded path is exactly what ``torch.optim.SGD / Adam / AdamW / RMSprop`` do; the
recorder only copies parameters and optimizer state into preallocated CPU buffers. The
default MLP's gradient is written out by hand (:class:`MLPGradient`: autograd's values,
without its engine). A fit may continue an earlier one (``warm_start``,
``partial_fit``): the optimizer state, the step-size schedule and the stopping rule pick
up where they stopped (:class:`Resume`), and the new segment of the path is appended to
the recorded one (:func:`extend_trajectory`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from .._checkpoint import functional_call, plain_checkpoints
from .._device import forked_rng, forward_input
from .._modules import copy_module, cudnn_disabled, norm_hooks, recurrent_on_cuda
from .._warnings import caller_stacklevel
from ._buffers import appended, dense
from ._losses import Loss
from ._mlp_step import MLPGradient
from ._optim import FunctionalOptimizer
from ._storage import DiskRows, free_disk
from ._trajectory import SolverSpec, Trajectory, TrajectoryRecorder

__all__ = [
    "DIVERGENCE_LOSS_RATIO",
    "DIVERGENCE_NORM_RATIO",
    "DivergenceWarning",
    "Resume",
    "TrainingDivergedError",
    "check_modes_now",
    "draws_in_training",
    "drawing_layers",
    "extend_trajectory",
    "make_optimizer",
    "mode_dependent_layers",
    "refuse_training_mode_layers",
    "refused_in_mode",
    "resolve_batch_size",
    "resume_training_modes",
    "set_learning_rate",
    "train",
    "training_step",
    "trains_without_cudnn",
    "training_threads",
    "warn_drawing_now",
    "warn_drawn",
    "warn_random_forward",
]

# Thresholds of the divergence warning. A descent method lowers the training loss: an
# epoch loss 100 times the one training started from (_start_loss), never back
# below it, has gone the wrong way by two orders of magnitude, far beyond the noise of
# minibatches. The parameter norm of a trained MLP
# stays within a small factor of its initialization's (benchmarks/results/defaults.md
# reports both growths over the defaults benchmark, where neither warning fires);
# 1000x, with a last epoch loss not below the start, is a network that left
# the region training is about (parameters that grow while the loss falls can be
# training at work: a linear layer on features in tiny units). Both are checked on
# values the loop has anyway (the epoch losses, one norm an epoch).
DIVERGENCE_LOSS_RATIO = 100.0
DIVERGENCE_NORM_RATIO = 1000.0


class TrainingDivergedError(ValueError):
    """The training loss, or the parameters, became non-finite.

    Raised by ``fit`` and ``partial_fit``; the estimator keeps its previous fit, if any.
    The message names the optimizer step and suggests a smaller ``learning_rate_init``,
    or, when the initial network's loss (a new path's step 0) is already non-finite,
    scaling the data or ``dtype="float64"``.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine, TrainingDivergedError
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="sgd",
    ...                         learning_rate_init=1e6, max_iter=5, tol=None, random_state=0)
    >>> try:
    ...     est.fit(X, y)
    ... except TrainingDivergedError as exc:
    ...     print("diverged:", "smaller learning_rate_init" in str(exc))
    diverged: True
    """


class DivergenceWarning(ConvergenceWarning):
    """Training ran to the end with finite values, but diverged.

    Raised as a warning when an epoch's loss went over 100 times the loss training
    started from and the last epoch's is not back below that start, or when the
    parameters grew over 1000-fold while the loss did not come down. Values
    that overflow raise :class:`TrainingDivergedError` instead.

    Examples
    --------
    >>> import warnings
    >>> import numpy as np
    >>> from skpathkernel import DivergenceWarning, PathKernelMachine
    >>> rng = np.random.RandomState(0)
    >>> X = rng.randn(40, 3); y = X @ [1.0, -2.0, 0.5]
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam",
    ...                         learning_rate_init=1e6, max_iter=20, random_state=0)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = est.fit(X, y)
    >>> any(issubclass(w.category, DivergenceWarning) for w in caught)
    True
    """


# Why a layer's forward depends on its mode. Layers that mix the samples of a batch or move
# buffers the path does not record are refused in training mode (API.md's contract covers
# modules "without cross-sample state"); layers that draw at random train as built, with a
# warning (a per-sample module must train, and the analyses report their error).
_DRAWS = "its random draws make each step's gradient, and no recorded point holds them"
_MIXES = ("it normalises with the batch's own statistics, which mix the samples of a batch, "
          "or updates running statistics that the path does not record")
_POWER = ("its power iteration updates the singular vectors it normalises with (buffers) at "
          "every forward pass, which the path does not record")


def mode_dependent_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """The layers whose training-mode forward no recorded path describes, and why.

    Dropout (and attention dropout, a stacked RNN's dropout, RReLU) draws random masks or
    slopes that no recorded point holds; BatchNorm normalises with the statistics of the
    batch, which mixes its samples, and updates running statistics, buffers that the path
    does not record (as
    does InstanceNorm with ``track_running_stats``, whose eval mode then reads them);
    spectral normalisation (torch's parametrization, or its older hook) updates its
    singular vectors at every forward pass. In eval mode each is a fixed per-sample
    function of the parameters, except a BatchNorm without running statistics, which
    normalises with the batch in both modes (listed with ``training`` checked by
    :func:`refused_in_mode`). Listed whatever their mode.
    """
    found = []
    for name, layer in module.named_modules():
        name = name or "(the module)"
        if _draws(layer):
            found.append((name, layer, _DRAWS))
        elif isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) or (
                isinstance(layer, torch.nn.modules.instancenorm._InstanceNorm)
                and layer.track_running_stats):
            found.append((name, layer, _MIXES))
        elif _spectral(layer):
            found.append((name, layer, _POWER))
    return found


_DRAWING = (torch.nn.modules.dropout._DropoutNd, torch.nn.MultiheadAttention, torch.nn.RReLU,
            torch.nn.RNNBase)


def undrawn(layer: torch.nn.Module) -> str:
    """How to build ``layer``, which draws at random in training mode, without its draws,
    by its own arguments. A recurrent layer's is ``dropout=0``: it has no ``p``, and
    torch's cuDNN RNN has no backward in eval mode ("cudnn RNN backward can only be
    called in training mode"), so on a GPU a layer in eval mode trains without cuDNN
    (:func:`trains_without_cudnn`), slower."""
    if isinstance(layer, torch.nn.RNNBase):
        return "dropout=0, not layer.eval(), which on CUDA trains without cuDNN's RNN kernels"
    # Each layer's own argument: attention's is dropout, RReLU's a fixed slope.
    if isinstance(layer, torch.nn.MultiheadAttention):
        return "layer.eval(), or dropout=0"
    if isinstance(layer, torch.nn.RReLU):
        return "layer.eval(), or lower=upper"
    return "layer.eval(), or p=0"


def _draws(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` draws at random in training mode: dropout (also between the
    stacked layers of an LSTM / GRU / RNN), RReLU."""
    if not isinstance(layer, _DRAWING):  # one test of the other layers: every analysis asks
        return False
    if isinstance(layer, torch.nn.RReLU):
        return True
    if isinstance(layer, torch.nn.RNNBase):
        # torch drops between stacked layers only: one layer ignores its dropout.
        return layer.dropout > 0 and layer.num_layers > 1
    return (layer.dropout if isinstance(layer, torch.nn.MultiheadAttention) else layer.p) > 0


def _spectral(layer: torch.nn.Module) -> bool:
    return isinstance(layer, _SpectralNorm) or any(
        isinstance(hook, SpectralNorm) for hook in norm_hooks(layer))


def refused_in_mode(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` computes, in its current mode, what no recorded path describes:
    a BatchNorm in training mode or in any mode without running statistics (it normalises
    with the batch), an InstanceNorm tracking statistics or a spectral normalisation in
    training mode (they move buffers at every forward pass)."""
    if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
        return layer.training or layer.running_mean is None
    # An InstanceNorm without running statistics is per sample and moves nothing, in
    # either mode (check_modes_now asks this of every layer, not only of
    # mode_dependent_layers').
    return layer.training and (
        (isinstance(layer, torch.nn.modules.instancenorm._InstanceNorm)
         and layer.track_running_stats) or _spectral(layer))


def drawing_layers(module: torch.nn.Module, modes: dict[str, bool] | None = None
                   ) -> list[str]:
    """The names of the layers of ``module`` that draw at random in training mode (the
    layers of :func:`mode_dependent_layers` that draw: dropout, RReLU) and are in it: in
    their own mode, or in ``modes`` (name: training, as :func:`refuse_training_mode_layers`
    returns them), the layers that drew in a fit that trained the module in those modes."""
    # Without mode_dependent_layers' other tests: every analysis call asks (see
    # warn_drawing_now).
    found = []
    for name, layer in module.named_modules():
        name = name or "(the module)"
        if _draws(layer) and (layer.training if modes is None else modes.get(name, False)):
            found.append(name)
    return found


def draws_in_training(module: torch.nn.Module) -> bool:
    """Whether a layer of ``module`` in training mode draws from torch's global generator
    (see :func:`drawing_layers`)."""
    return bool(drawing_layers(module))


def warn_drawn(layers, analysis: str) -> None:
    """Warn that ``analysis`` is not exact where ``layers`` (:func:`drawing_layers` of the
    fit) drew at random in training: for the analyses that measure no error that would
    show it (the exact decomposition's closure check and the unrolled scores' replay do),
    and for those that do, which name no cause."""
    if layers:
        warnings.warn(
            f"{analysis}: the layer(s) {list(layers)[:3]} trained in training mode, where "
            f"{_DRAWS}; the analysis describes the network without those draws (in eval "
            "mode), so it is not exact (only the exact decomposition's closure check "
            "measures by how much). Build "
            "them in eval mode in the module factory (layer.eval(), or p=0) for exact "
            "analyses.", UserWarning, stacklevel=caller_stacklevel())


def _any_drawing_now(module: torch.nn.Module) -> bool:
    """Whether a layer of ``module`` in training mode draws at random: every analysis call
    asks, so without the names ``named_modules`` builds, nor a filtered generator (39 us
    instead of 197 us on a 122-module TransformerEncoder, whose forward of 4 x 16 tokens
    takes 4.2 ms; 1.7 instead of 5.0 us on the default MLP)."""
    stack = [module]
    while stack:
        layer = stack.pop()
        if layer is None:  # a child registered as None
            continue
        if layer.training and _draws(layer):
            return True
        stack.extend(layer._modules.values())
    return False


def warn_drawing_now(module: torch.nn.Module) -> None:
    """Warn, before an analysis runs ``module``, that its layers that draw at random are in
    training mode now (:func:`drawing_layers`): every forward pass of the analysis draws
    anew, so its result varies from call to call and no error it measures names that
    cause. What a fit drew, with the layers in eval mode now, is :func:`warn_drawn`'s."""
    if _any_drawing_now(module):
        layers = drawing_layers(module)
        warnings.warn(
            f"The layer(s) {layers[:3]} are in training mode now, where each forward pass "
            "draws anew at random (dropout its masks, RReLU its slopes): the kernels, features, "
            "decompositions, attributions and predictions of this network each draw their "
            "own, so they vary from call to call and describe no fixed network. Call "
            "module.eval() before analysing it (the estimators' networks are in eval mode "
            "after fit).", UserWarning, stacklevel=caller_stacklevel())


def check_modes_now(module: torch.nn.Module) -> None:
    """Refuse, before the network's outputs are computed, a layer whose current mode no
    recorded path describes (:func:`refused_in_mode`: a BatchNorm in training mode, ...),
    and warn of layers that draw at random now (:func:`warn_drawing_now`).

    The kernels and features refuse such a layer when they trace the module; the outputs
    (``predict``) ran it as it was: a BatchNorm in training mode normalised each query
    with the statistics of the block it was computed in (padding rows included), so
    that a query's output depended on the others, and overwrote its running statistics,
    the function every later analysis describes.
    """
    stack = [module]
    while stack:  # without named_modules' names unless one is refused (warn_drawing_now)
        layer = stack.pop()
        if layer is None:  # a child registered as None
            continue
        if refused_in_mode(layer):
            name = next(n for n, sub in module.named_modules() if sub is layer)
            raise ValueError(
                f"Layer {name or '(the module)'!r} ({type(layer).__name__}) "
                f"{'is in training mode' if layer.training else 'keeps no running statistics'}: "
                f"{_POWER if _spectral(layer) else _MIXES}, so computing the network's "
                "outputs would make each one depend on the other inputs or rewrite those "
                "buffers, and describe no network of the path. "
                + ("Call module.eval() first (BatchNorm then normalises with its running "
                   "statistics)." if layer.training else
                   "Build it with track_running_stats=True and train in eval mode."))
        # Reversed: the first refused layer in the module's order is the one named.
        stack.extend(reversed(layer._modules.values()))
    warn_drawing_now(module)


def refuse_training_mode_layers(module: torch.nn.Module) -> dict[str, bool]:
    """Refuse, before training, a layer of :func:`mode_dependent_layers` that mixes the
    batch in its mode; warn of one that draws at random in training mode. Returns every
    submodule's mode (name: training), which a continued fit restores: a user's layer whose
    forward reads ``self.training`` trains in the mode it was built in all along the path."""
    modes = {name or "(the module)": layer.training for name, layer in module.named_modules()}
    drawing = []
    for name, layer, why in mode_dependent_layers(module):
        if refused_in_mode(layer) and why == _POWER:
            raise ValueError(
                f"Layer {name!r} ({layer}) is in training mode: {why}, so neither the "
                "kernels nor decompose would describe the training. Build it in eval mode "
                "in the module factory (layer.eval(): the singular vectors then stay as "
                "built), or train without spectral normalisation.")
        if refused_in_mode(layer):
            raise ValueError(
                f"Layer {name!r} ({layer}) normalises with the batch: {why}, so neither the "
                "kernels nor decompose would describe the training. Build it in eval mode "
                "with running statistics in the module factory (layer.eval(): BatchNorm "
                "then normalises with its running statistics, which stay fixed), or use a "
                "per-sample layer instead (LayerNorm or GroupNorm).")
        elif why == _DRAWS and layer.training:
            drawing.append((name, layer))
    if drawing:
        # One warning for all: a transformer of a library holds a dropout in every
        # block (a 2-layer BERT, 8), and one warning each buried the rest of the fit's.
        (name, layer), more = drawing[0], drawing[1:]
        also = ""
        if more:
            listed = ", ".join(repr(n) for n, _ in more[:3])
            also = (f" (and {len(more)} more layer{'s' * (len(more) > 1)} drawing in "
                    f"training mode: {listed}{', ...' if len(more) > 3 else ''})")
        warnings.warn(
            f"Layer {name!r} ({layer}){also} is in training mode: {_DRAWS}. It trains as "
            "built, but the kernels, decompose and attribute describe the network without "
            "those draws (it is in eval mode after fit), so they are not exact and report "
            "their error. Build it without them in the module factory "
            f"({undrawn(layer)}{', or module.eval() for all' if more else ''}) for exact "
            "analyses.",
            UserWarning, stacklevel=caller_stacklevel())
    return modes


# Two forward passes of a module on the same input that differ by more than this,
# relative to the output's largest entry, draw at random: a dropout draw moves outputs by
# their own size, while a deterministic forward repeats itself exactly on the CPU (and to
# round-off with nondeterministic CUDA kernels).
RANDOM_FORWARD_TOL = 1e-6


_FACTORY_ADVICE = (
    "It trains as built, but no recorded point holds those draws or that state, so the "
    "kernels, decompose and attribute, which describe the network in eval mode, are not "
    "exact and report their error. Build the module in eval mode (module.eval()) in the "
    "factory for exact analyses.")
# A recorded loop's module is analysed in the modes it is in (the estimators' in eval).
RECORDED_ADVICE = (
    "Such a layer is invisible to the recorder's checks of the layers' types, as it is to "
    "the record: its draws in training are on no recorded point, so decompose and "
    "attribute miss by them (decompose reports by how much), and every analysis of the "
    "module in these modes draws anew, so its kernels, features, decompositions and "
    "predictions vary from call to call. Call module.eval() before the analyses, and "
    "train with the draws off (module.eval(), or a rate of 0) for exact ones.")


def warn_random_forward(module: torch.nn.Module, x: torch.Tensor, *,
                        advice: str = _FACTORY_ADVICE) -> bool:
    """Warn when ``module``, in the modes it was built in, returns different outputs for
    the same input twice: a random layer that :func:`mode_dependent_layers` does not know
    (``F.dropout`` in a forward, stochastic depth / DropPath, noise), whose draws no
    recorded point holds. Two passes on ``x`` without gradients, on a forked random
    generator (the training's draws stay as they were), of a copy: a forward that moves the
    module's state (buffers, or a step count kept as a plain attribute) moves the copy's,
    and the training starts from the module as built. A non-finite output is left to the
    training's divergence check (NaN differs from itself). A module that cannot be
    copied is not probed. ``advice`` ends the warning: what to do, for the caller. Returns
    whether it warned."""
    if draws_in_training(module):
        return False  # refuse_training_mode_layers warned of it (and the analyses do)
    try:
        probe = copy_module(module)
    except (RuntimeError, TypeError):  # a module holding what deepcopy refuses (a lock)
        return False  # a probe is not worth failing the fit for
    devices = []
    if x.device.type == "cuda":
        devices = [torch.cuda.current_device() if x.device.index is None else x.device.index]
    # Checkpointed regions plainly: a reentrant one warns that no input requires grad.
    with torch.no_grad(), forked_rng(devices), plain_checkpoints():
        first, second = probe(forward_input(x)), probe(forward_input(x))
    if not isinstance(first, torch.Tensor) or not first.numel():
        return False
    if not (torch.isfinite(first).all() and torch.isfinite(second).all()):
        return False
    scale = float(first.abs().max()) or 1.0
    if not float((first - second).abs().max()) <= RANDOM_FORWARD_TOL * scale:
        warnings.warn(
            "The module returned different outputs for the same input in two forward passes "
            "in the modes it was built in: a layer draws at random (F.dropout, stochastic "
            "depth / DropPath, noise) or updates state its forward reads (a buffer it "
            f"counts or averages in). {advice}",
            UserWarning, stacklevel=caller_stacklevel())
        return True
    return False


def resume_training_modes(module: torch.nn.Module, modes: dict[str, bool] | None = None
                          ) -> torch.nn.Module:
    """``module`` in the modes a fit trained it in, to continue the path: each submodule's
    as ``modes`` (from :func:`refuse_training_mode_layers`) lists it. A fit pickled before
    every submodule was listed kept only the :func:`mode_dependent_layers`' modes: the
    others then take training mode, and an unlisted dependent layer eval mode."""
    modes = modes or {}
    dependent = {name for name, _, _ in mode_dependent_layers(module)}
    for name, layer in module.named_modules():
        name = name or "(the module)"
        # The flag itself: train() would set the submodules' too.
        layer.training = bool(modes.get(name, name not in dependent))
    return module


def make_optimizer(params, spec: SolverSpec, lr: float) -> FunctionalOptimizer:
    """The optimizer that ``spec`` names, with its hyper-parameters.

    torch.optim's own update functions, fused where torch has a kernel for these
    parameters (about half the cost per step of a small network), behind an object that
    does not import ``torch._dynamo`` (see :class:`FunctionalOptimizer`).
    """
    return FunctionalOptimizer(params, spec, lr)


# A step that multiplies fewer values than this (batch rows x parameters) runs on one
# thread: torch's OpenMP threads cost more to wake than such a step takes, and on cores
# that other processes share they stall (iris' default fit on a loaded 2-core machine:
# 76 s on two threads, 1.1 s on one).
SINGLE_THREAD_WORK = 2**23


def training_threads(batch_rows: int, n_params: int, limit: int | None) -> int | None:
    """Torch threads for training: 1 for a small step, else ``limit`` (None: torch's)."""
    if batch_rows * n_params < SINGLE_THREAD_WORK:
        return 1
    return limit


def trains_without_cudnn(module: torch.nn.Module):
    """A block that trains ``module``: with cuDNN off (:func:`~.._modules.cudnn_disabled`)
    where it holds a recurrent layer on CUDA in eval mode, whose cuDNN kernel has no
    backward ("cudnn RNN backward can only be called in training mode": a module built
    in eval mode, or a fitted one replayed); else as it is, cuDNN's recurrent kernels
    (one backward per step) being right and fast in training mode."""
    if recurrent_on_cuda(module, eval_only=True):
        return cudnn_disabled()
    return contextlib.nullcontext()


def training_step(module, optimizer, loss: Loss, xb, yb,
                  gradient: MLPGradient | None = None,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """One optimizer step on the batch ``(xb, yb)``; returns the batch loss.

    The step of the training loop and of every replay of it (``metrics.retrain_on_subsets``).
    ``gradient``: the module's hand-written gradient (:class:`MLPGradient`, the same
    values as autograd's), or None for autograd. ``weights``: each sample's weight in the
    batch loss (:func:`batch_betas`), None for the mean.
    """
    if gradient is not None:
        batch_loss = gradient(xb, yb) if weights is None else gradient(xb, yb, weights)
    else:
        optimizer.zero_grad(set_to_none=True)
        # (n, C) as every analysis reads it: a one-output network may return (n,), which
        # the squared error against (n, 1) targets broadcast to (n, n) (R^2 about 0).
        out = module(xb).reshape(len(xb), -1)
        batch_loss = loss(out, yb) if weights is None else loss.weighted(out, yb, weights)
        batch_loss.backward()
    optimizer.step()
    return batch_loss


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def batch_betas(sample_weight: np.ndarray, idx: np.ndarray, dtype: torch.dtype,
                device, batch_size: int | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """The weights of the samples ``idx`` in their batch's loss, ``beta_i = s_i / sum_j
    s_j`` (``np.average``'s; all 0 when the batch's weights sum to 0: its data gradient
    is then 0), as the steps use them (``dtype`` on ``device``) and, in float64, exactly
    those values for the trajectory. ``batch_size``: ``idx`` is an epoch's order, cut into
    consecutive batches of that size (None: one batch), whose weights go to the device in
    one copy rather than one per step."""
    s = sample_weight[idx]
    B = len(s) if batch_size is None else batch_size
    beta = np.zeros_like(s)
    for start in range(0, len(s), B):
        part = s[start : start + B]
        total = part.sum()
        if total > 0:
            beta[start : start + B] = part / total
    beta = beta.astype(_NUMPY_DTYPES[dtype])
    return torch.from_numpy(beta).to(device), beta.astype(np.float64)


def set_learning_rate(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class TrainResult:
    trajectory: Trajectory
    loss_curve: list[float]
    n_iter: int  # epochs run
    n_steps: int  # optimizer steps taken (the trajectory may end earlier: early stopping)
    best_loss: float | None
    validation_scores: list[float] | None
    best_validation_score: float | None
    resume: Resume  # where a later fit continues: the end of the trajectory


def resolve_batch_size(batch_size, n_samples: int) -> int:
    """``None``: full batch; ``"auto"``: ``min(200, n_samples)`` (MLPClassifier's)."""
    if batch_size is None:
        return n_samples
    if isinstance(batch_size, str):
        return min(200, n_samples)
    return min(int(batch_size), n_samples)


@dataclass
class Resume:
    """Where training continues: the optimizer's state, the schedule, the stopping rule,
    the batch generator and what the divergence check compares with.

    Tensors are kept as NumPy arrays (so that an estimator holding a Resume pickles and
    persists with skops like the rest of its state).
    """

    optimizer_state: dict  # optimizer.state_dict()["state"]
    learning_rate: float  # the schedule's current step size ("adaptive" lowers it)
    samples_seen: int  # sklearn's t_: what "invscaling" decays with
    generator_state: np.ndarray  # the batch order's torch.Generator
    rule: tuple[int, float, float]  # the stopping rule's (count, best loss, best score)
    first_loss: float  # the path's starting loss (_start_loss) and initial parameter
    initial_norm: float  # norm, which the divergence warning compares with throughout
    # The learning_rate_init the schedule started from (None: a Resume pickled before it
    # was kept), so that a warm start can tell a new one from the schedule's own changes.
    learning_rate_init: float | None = None
    # torch's global generator (and the CUDA device's), which layers drawing in training
    # mode (dropout) read: a continuation draws on from where the fit stopped, as the batch
    # order does, instead of repeating the first fit's draws (None: pickled before).
    draws_state: tuple | None = None
    # The schedule the step size followed ("constant" for every solver but sgd; None:
    # pickled before it was kept), so that a warm start can tell a new schedule.
    schedule: str | None = None
    # The schedule's power_t (None: pickled before it was kept), which partial_fit
    # continues with, as it continues the schedule and its learning_rate_init.
    power_t: float | None = None

    @classmethod
    def capture(cls, optimizer, generator, *, learning_rate, samples_seen, rule,
                first_loss, initial_norm, learning_rate_init=None,
                device: torch.device | None = None, schedule=None,
                power_t=None) -> Resume:
        # Read to the host where taken (early stopping's best epoch so far too): a copy
        # kept on the GPU would hold up to twice the optimizer state beside training's,
        # and reading here waits for nothing, the epoch's loss and score having been read.
        state = {i: {k: v.detach().cpu().numpy().copy() if torch.is_tensor(v) else v
                     for k, v in s.items()}
                 for i, s in optimizer.state_dict()["state"].items()}
        cuda = (torch.cuda.get_rng_state(device).numpy().copy()
                if device is not None and device.type == "cuda" else None)
        return cls(state, float(learning_rate), int(samples_seen),
                   generator.get_state().numpy().copy(), tuple(rule), float(first_loss),
                   float(initial_norm),
                   None if learning_rate_init is None else float(learning_rate_init),
                   (torch.get_rng_state().numpy().copy(), cuda), schedule,
                   None if power_t is None else float(power_t))

    def load_into(self, optimizer, generator, device: torch.device | None = None) -> None:
        """Restore the state, keeping the optimizer's own hyper-parameters (load_state_dict
        would otherwise overwrite them with the saved ones), and the draws' generators."""
        full = optimizer.state_dict()
        full["state"] = {i: {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray)
                             else v for k, v in s.items()}
                         for i, s in self.optimizer_state.items()}
        optimizer.load_state_dict(full)
        generator.set_state(torch.from_numpy(np.array(self.generator_state)))
        if self.draws_state is not None:
            cpu, cuda = self.draws_state
            torch.set_rng_state(torch.from_numpy(np.array(cpu)))
            if cuda is not None and device is not None and device.type == "cuda":
                torch.cuda.set_rng_state(torch.from_numpy(np.array(cuda)), device)


class _Schedule:
    """MLPClassifier's step-size schedules for SGD (``sklearn.neural_network``'s
    ``SGDOptimizer``); every other solver keeps ``learning_rate_init``.

    "invscaling": an epoch that starts after ``t`` samples were seen uses
    ``learning_rate_init / (t + 1) ** power_t``. "adaptive": the step size is divided by 5
    whenever the stopping rule finds more than ``n_iter_no_change`` epochs without
    improvement, and training stops (instead) once it is at most 1e-6.
    """

    def __init__(self, kind, lr_init, power_t, lr=None):
        self.kind, self.lr_init, self.power_t = kind, float(lr_init), float(power_t)
        self.lr = self.lr_init if lr is None else float(lr)

    def epoch_lr(self, samples_seen: int) -> float:
        if self.kind == "invscaling":
            self.lr = self.lr_init / (samples_seen + 1) ** self.power_t
        return self.lr

    def stalled(self) -> bool:
        """The rule found no improvement: whether to stop (True) or go on, slower."""
        if self.kind != "adaptive" or self.lr <= 1e-6:
            return True
        self.lr /= 5.0
        return False


class _StoppingRule:
    """MLPClassifier's convergence test, epoch by epoch (``_update_no_improvement_count``).

    Without validation: an epoch counts as "no improvement" when its training loss is not
    below the best loss so far minus ``tol``. With validation: when its score is not above
    the best score so far plus ``tol``. More than ``n_iter_no_change`` consecutive epochs
    without improvement stall training (see :meth:`_Schedule.stalled`); ``tol=None``
    never stops.
    """

    def __init__(self, tol, n_iter_no_change, validating, state=None):
        self.tol, self.patience, self.validating = tol, n_iter_no_change, validating
        self.count, self.best_loss, self.best_score = state or (0, math.inf, -math.inf)

    @property
    def state(self) -> tuple[int, float, float]:
        return self.count, self.best_loss, self.best_score

    def update(self, loss: float, score: float | None) -> tuple[bool, bool]:
        """(whether this epoch is the best so far, whether training stalled)."""
        tol = 0.0 if self.tol is None else self.tol
        if self.validating:
            # A NaN score compares False both ways: it never improves, never is the best.
            self.count = self.count + 1 if not score >= self.best_score + tol else 0
            best = score > self.best_score
            if best:
                self.best_score = score
        else:
            self.count = self.count + 1 if not loss <= self.best_loss - tol else 0
            best = loss < self.best_loss
        self.best_loss = min(self.best_loss, loss)
        return best, self.count > self.patience


def _make_recorder(params, names, *, n, B, n_steps, solver, record_every, storage,
                   record_budget, directory, compression, extends=None,
                   sample_weight=None) -> TrajectoryRecorder:
    """The recorder of one fit: storage and ``record_every`` resolved for ``n_steps``.

    ``record_every="auto"`` records every step when the points of ``n_steps`` steps fit
    in ``record_budget`` bytes, else every k-th step with the smallest k that fits.
    ``storage`` ("memory", "disk" or "auto": disk when those points exceed
    ``record_budget`` bytes) says where the points go; on disk, in a fresh temporary
    directory under ``directory``, and ``record_every="auto"`` keeps every step that
    fits in 90% of the disk's free space. ``extends``: an on-disk path this recording
    appends to (see :class:`TrajectoryRecorder`), whose storage it keeps. The fit draws
    every batch from its ``n`` rows, weighted by ``sample_weight``: the pool it records.
    """
    if extends is not None:
        storage, directory, compression = "disk", extends.directory, None
    n_params, n_state = sum(p.numel() for p in params), len(solver.state_keys)
    itemsize = params[0].element_size()
    if storage == "auto":
        every = 1 if isinstance(record_every, str) else record_every
        nbytes = TrajectoryRecorder.nbytes_for(n_params, n_steps, every, n_state, itemsize)
        storage = "disk" if nbytes > record_budget else "memory"
    if isinstance(record_every, str):
        budget = record_budget if storage == "memory" else int(0.9 * free_disk(directory))
        record_every = TrajectoryRecorder.auto_record_every(
            n_params, n_steps, n_state, itemsize, budget)
    return TrajectoryRecorder(
        params, names, n_steps=n_steps, record_every=record_every, solver=solver,
        n_samples=n, batch_size=B, dtype=params[0].dtype, storage=storage,
        directory=directory, memory_budget=record_budget, compression=compression,
        extends=extends, pool=True, sample_weight=sample_weight,
    )


def _run_epoch(module, optimizer, loss, recorder, X, Y, order, B, step, lr, gradient=None,
               sample_weight=None):
    """One pass over the samples in ``order``, recorded; returns the batch losses (tensor).

    ``sample_weight`` (float64, one per sample): each batch's loss is their weighted mean.
    """
    # The hand-written gradient builds no graph: the whole epoch runs without one.
    with torch.no_grad() if gradient is not None else contextlib.nullcontext():
        n = X.shape[0]
        order_np = order.numpy()
        if B == n:  # full batch: one step on all rows, whatever their order
            # Autograd's module gets a copy (the other batches are copies too): one
            # writing into its input would rewrite X, and the next epoch would read that.
            batches = [(X if gradient is not None else forward_input(X), Y)]
        else:
            order_dev = order.to(X.device)
            if X.dim() <= 2 and Y.dim() <= 2 and X.is_contiguous() and Y.is_contiguous():
                # The rows X[idx] copies, in the same (contiguous) layout, without Python's
                # indexing machinery: 7 of the 22 us that X[idx], Y[idx] took on diabetes.
                batches = ((X.index_select(0, idx), Y.index_select(0, idx))
                           for idx in order_dev.split(B))
            else:  # another layout, which indexing keeps (channels_last, column-major)
                batches = ((X[idx], Y[idx]) for idx in order_dev.split(B))
        batch_losses = []
        if sample_weight is not None:
            # In the parameters' dtype: X may hold integer token ids.
            betas, recorded = batch_betas(sample_weight, order_np,
                                          optimizer.param_groups[0]["params"][0].dtype,
                                          X.device, B)
        for start, (xb, yb) in zip(range(0, n, B), batches):
            idx = order_np[start : start + B]
            if sample_weight is None:
                batch_loss = training_step(module, optimizer, loss, xb, yb, gradient)
                recorder.record_batch(idx)
            else:
                batch_loss = training_step(module, optimizer, loss, xb, yb, gradient,
                                           betas[start : start + B])
                recorder.record_batch(idx, recorded[start : start + B])
            # Autograd's loss holds its graph until detached; the hand-written one has none.
            batch_losses.append(batch_loss if gradient is not None else batch_loss.detach())
            recorder.record_step(step, lr, optimizer)
            step += 1
            if recorder.wants_point(step):
                recorder.record_point(step)
        return batch_losses


def _epoch_loss(batch_losses, sizes, total, first_step, epoch, lr,
                initial: bool = False, size_values: list[float] | None = None) -> float:
    """Mean loss over the samples of an epoch; non-finite raises, naming the step.

    ``batch_losses``: the epoch's batch losses (0-d tensors); ``sizes``: the batch sizes
    in the losses' dtype; ``total``: their sum (the samples); ``initial``: step 0 is the
    path's first (see :func:`_raise_diverged`); ``size_values``: ``sizes.tolist()``, read
    once per fit rather than from the GPU every epoch.
    """
    # Weighted by batch size so that the epoch loss is the mean over samples: each loss
    # times its batch size in the loss's dtype, summed in float64.
    dtype = batch_losses[0].dtype
    if len(batch_losses) <= 2 and dtype in (torch.float32, torch.float64):
        # One or two batches (every default fit on fewer than 400 samples): the same
        # values in Python floats, without a tensor op. A product of two float32 values
        # is exact in float64, so rounding it to float32 is torch's float32 product; a
        # sum of two float64 values is rounded once in either.
        if size_values is None:
            size_values = sizes.tolist()
        terms = [b.item() * w for b, w in zip(batch_losses, size_values)]
        if dtype == torch.float32:
            with np.errstate(over="ignore"):  # an overflow is inf, as in torch
                terms = [float(np.float32(t)) for t in terms]
        loss = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    else:
        weighted = (torch.stack(batch_losses) * sizes).double()
        terms, loss = weighted, float(weighted.sum())
    # A non-finite batch loss makes the sum non-finite: one check of the sum, not of
    # every batch (a sum that overflows from finite float64 terms is kept, as before).
    if not math.isfinite(loss):
        bad = [i for i, v in enumerate(terms) if not math.isfinite(float(v))]
        if bad:
            _raise_diverged(first_step + bad[0], epoch, lr, initial)
    return loss / total


def _start_loss(first_epoch_loss: float, first_batch_loss, initial_loss) -> float:
    """The loss a new path's divergence check compares with: the first epoch's, unless it
    is over ``DIVERGENCE_LOSS_RATIO`` times the first batch's at the initial parameters;
    then the initial network's on every row (``initial_loss()``, one forward pass), when
    lower.

    Training that runs away within its first epoch puts the blow-up in that epoch's mean
    (Adam at ``learning_rate_init=1`` on standardized diabetes averaged 2.6e5 over its first
    epoch from 0.49 at the start, ended at 6.5e4, R^2 = -7.6e4, without a warning). The
    first batch alone is no reference: it may be unlike the rest (a first batch of zero
    targets among 97%, or of zero sample weights, whose loss is 0), which would make a
    healthy fit warn; it only says when to measure the start.
    """
    if first_epoch_loss <= DIVERGENCE_LOSS_RATIO * float(first_batch_loss):
        return first_epoch_loss
    return min(first_epoch_loss, initial_loss())


def _initial_loss(module, names, params, theta0, X, Y, loss, B, sample_weight) -> float:
    """The loss of ``module`` at the flat ``theta0`` of its parameters ``params`` (named
    ``names``) on every row (their weighted mean under ``sample_weight``), in blocks of
    ``B`` rows, without a graph.

    The module keeps its training modes: a layer that draws (dropout) draws from torch's
    generators, whose states are restored, so that training and the caller's stream go
    on as without this pass."""
    values = dict(zip(names, (v.view_as(p) for v, p in zip(
        theta0.split([p.numel() for p in params]), params))))
    devices = [X.device] if X.device.type == "cuda" else []
    total = weight = 0.0
    with torch.no_grad(), forked_rng(devices):
        for start in range(0, X.shape[0], B):
            xb, yb = X[start : start + B], Y[start : start + B]
            out = functional_call(module, values, (forward_input(xb),)).reshape(len(xb), -1)
            per_sample = loss.per_sample(out, yb).double()
            w = (torch.ones_like(per_sample) if sample_weight is None else torch.as_tensor(
                sample_weight[start : start + B], dtype=torch.float64, device=X.device))
            total += float((per_sample * w).sum())
            weight += float(w.sum())
    return total / weight


def _param_norm(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
        [p.detach() for p in params]))))


def _epoch_norms(recorder, params, epoch_steps, norms, first_loss, loss_curve):
    """``norms`` (the initial norm, then one per epoch when they were taken as the epochs
    ran) completed from the recorded points at the ends of the epochs.

    The norms matter to the divergence warning only when the last epoch's loss is above
    the one it compares with (see :func:`_warn_if_diverging`); a path that keeps every epoch's end
    in memory computes them then, from the points, instead of once an epoch.
    """
    if not loss_curve[-1] > first_loss:
        return norms
    points = recorder.points_in_memory(epoch_steps)
    # The same tensors' values, each a contiguous slice of its point: the same norms.
    return norms + [_param_norm(list(torch.split(row, [p.numel() for p in params])))
                    for row in points]


def train(
    module: torch.nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor,
    *,
    loss: Loss,
    solver: SolverSpec,
    learning_rate: float,
    batch_size: int | str | None,
    max_iter: int,
    shuffle: bool,
    generator: torch.Generator,
    record_every: int | str,
    tol: float | None = None,
    n_iter_no_change: int = 10,
    validation: Callable[[torch.nn.Module], float] | None = None,
    record_budget: int = 2**30,
    progress=None,
    storage: str = "memory",
    directory=None,
    compression: str | None = None,
    schedule: str = "constant",
    power_t: float = 0.5,
    resume: Resume | None = None,
    single_epoch: bool = False,
    first_epoch: int = 0,
    first_step: int = 0,
    extends: Trajectory | None = None,
    sample_weight: np.ndarray | None = None,
    path_start: torch.Tensor | None = None,
) -> TrainResult:
    """Train ``module`` in place on (X, Y) and return the recorded path.

    ``batch_size=None`` is full-batch gradient descent, ``"auto"`` ``min(200, n)``.
    Batches are drawn on the CPU from ``generator`` so that a seed gives the same batches
    on every device. ``progress`` is an optional callable ``(epoch, loss)`` called after
    each epoch. ``schedule`` and ``power_t`` are MLPClassifier's ``learning_rate`` and
    ``power_t`` (see :class:`_Schedule`); ``resume`` continues a previous fit's optimizer,
    schedule and (with ``single_epoch``, ``partial_fit``'s one pass) stopping rule;
    ``first_epoch`` and ``first_step`` count the epochs and the path's optimizer steps
    before it (for the epoch and step numbers of the warnings and errors, which name
    them along the whole path, as ``loss_curve_`` and ``trajectory_.steps`` do);
    ``extends``, the on-disk path it continues, whose series the new points are appended
    to (the result's trajectory is the new segment: see :func:`extend_trajectory`).
    ``sample_weight`` (float64, one per row of X, None: all equal): each step's loss is
    the weighted mean over its batch (:func:`batch_betas`), whose weights the trajectory
    records (``batch_weights``); the epoch loss averages the batch losses by batch size
    (MLPClassifier's convention). ``path_start``: with ``resume``, the flat parameters
    at the first point of the path being continued, whose loss on (X, Y) is the start
    the divergence warning compares with when it is above the path's own start.

    Stopping follows MLPClassifier (see :class:`_StoppingRule`): with ``validation`` (a
    callable scoring the module on held-out data, higher is better) the score decides,
    and the module and the path end at the epoch with the best score; otherwise the
    training loss decides, and the path ends at the last step taken. A
    :class:`~sklearn.exceptions.ConvergenceWarning` says when ``max_iter`` epochs ran
    without meeting the rule (never with ``tol=None``, which runs all ``max_iter``), a
    :class:`DivergenceWarning` when the loss or the parameters ran away (see
    ``DIVERGENCE_LOSS_RATIO``). ``record_every``, ``storage``: see :func:`_make_recorder`.
    """
    n = X.shape[0]
    B = resolve_batch_size(batch_size, n)
    steps_per_epoch = math.ceil(n / B)
    params = [p for p in module.parameters() if p.requires_grad]
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    recorder = _make_recorder(
        params, names, n=n, B=B, n_steps=max_iter * steps_per_epoch, solver=solver,
        record_every=record_every, storage=storage, record_budget=record_budget,
        directory=directory, compression=compression, extends=extends,
        sample_weight=sample_weight)
    optimizer = make_optimizer(params, solver, learning_rate)
    gradient = MLPGradient.build(module, loss, X)
    sched = _Schedule(schedule if solver.name == "sgd" else "constant", learning_rate,
                      power_t, None if resume is None else resume.learning_rate)
    seen = 0 if resume is None else resume.samples_seen
    norms = [_param_norm(params) if resume is None else resume.initial_norm]
    if resume is not None:
        resume.load_into(optimizer, generator, X.device)
    sizes = torch.tensor([min(B, n - b * B) for b in range(steps_per_epoch)],
                         dtype=params[0].dtype, device=X.device)
    total, size_values = float(sizes.sum()), sizes.tolist()
    rows = torch.arange(n)  # the order of an epoch that does not shuffle
    # Every epoch's end recorded in memory: the parameter norms of the divergence check
    # are read from the points at the end, and only when the check needs them.
    norms_later = recorder.keeps_in_memory(steps_per_epoch)
    epoch_steps: list[int] = []
    recorder.record_point(0)
    loss_curve: list[float] = []
    scores: list[float] | None = None if validation is None else []
    rule = _StoppingRule(tol, n_iter_no_change, validation is not None,
                         resume.rule if resume is not None and single_epoch else None)

    def capture():
        first = reference if resume is None else resume.first_loss
        return Resume.capture(optimizer, generator, learning_rate=sched.lr,
                              samples_seen=seen, rule=rule.state, first_loss=first,
                              initial_norm=norms[0], learning_rate_init=sched.lr_init,
                              device=X.device, schedule=sched.kind,
                              power_t=sched.power_t)
    best = None  # (step, flat parameters, Resume) of the best-scoring epoch
    reference = None  # the loss the divergence check compares with (_start_loss)
    # The initial point, for the start's loss where the first epoch ran away (_start_loss).
    theta0 = (torch.cat([p.detach().reshape(-1) for p in params])
              if resume is None else None)
    step, stopped = 0, False
    for epoch in range(max_iter):
        lr = sched.epoch_lr(seen)
        set_learning_rate(optimizer, lr)
        order = torch.randperm(n, generator=generator) if shuffle and B < n else rows
        batch_losses = _run_epoch(module, optimizer, loss, recorder, X, Y, order, B, step, lr,
                                  gradient, sample_weight)
        epoch_loss = _epoch_loss(batch_losses, sizes, total, first_step + step,
                                 first_epoch + epoch, lr, initial=resume is None,
                                 size_values=size_values)
        if epoch == 0 and resume is None:
            reference = _start_loss(epoch_loss, batch_losses[0], functools.partial(
                _initial_loss, module, names, params, theta0, X, Y, loss, B, sample_weight))
            theta0 = None
        step += steps_per_epoch
        seen += n
        loss_curve.append(epoch_loss)
        epoch_steps.append(step)
        if not norms_later:
            norms.append(_param_norm(params))
        score = None
        if validation is not None:
            with torch.no_grad():
                score = float(validation(module))
            scores.append(score)
        is_best, stall = rule.update(epoch_loss, score)
        if stall and tol is not None:
            # tol=None switches the rule off (SGDClassifier's convention): no stop, and
            # no "adaptive" division either, which SGDClassifier then never makes.
            stopped = sched.stalled()
            rule.count = 0
        if is_best and validation is not None:
            # The model is the best-scoring epoch's (MLPClassifier restores it too): keep
            # its parameters and optimizer state, the path will end there.
            best = (step, torch.cat([p.detach().reshape(-1) for p in params]).cpu(),
                    capture())
        if progress is not None:
            progress(epoch, epoch_loss)
        if stopped or single_epoch:
            break
    if not stopped and not single_epoch and tol is not None:
        _warn_not_converged(max_iter, tol, n_iter_no_change, validation is not None, sched)
    first_loss = reference if resume is None else resume.first_loss
    if norms_later:
        norms = _epoch_norms(recorder, params, epoch_steps, norms, first_loss, loss_curve)
    if path_start is not None and _divergence(first_loss, loss_curve, norms) is not None:
        # A continued fit's data may be unlike the data the path started on (a stream
        # whose targets grow after its first partial_fit call): its loss is then far
        # above the path's start without anything running away. The start on these
        # rows is the path's initial network's loss on them, one forward pass.
        first_loss = max(first_loss, _initial_loss(
            module, names, params, path_start.to(X.device), X, Y, loss, B, sample_weight))
    _warn_if_diverging(first_loss, loss_curve, norms, learning_rate, first_epoch)
    if best is None:  # no validation, or no finite score: the last step is the model
        best = (step, None, capture())
    trajectory = _finish(recorder, params, best, first_epoch + len(loss_curve),
                         learning_rate, first_step)
    return TrainResult(
        trajectory, loss_curve, len(loss_curve), step,
        best_loss=None if validation is not None else min(loss_curve),
        validation_scores=scores,
        best_validation_score=None if validation is None else rule.best_score,
        resume=best[2],
    )


def _finish(recorder, params, best, n_iter, lr, first_step=0) -> Trajectory:
    """The recorded path up to the model's step ``best[0]``, the module set to its point.
    ``n_iter`` and ``first_step``: the path's epochs to this fit's end and its steps
    before this fit (for the error's numbers)."""
    step, flat, _ = best
    if flat is not None:  # the best-scoring epoch's parameters
        torch.nn.utils.vector_to_parameters(flat.to(params[0].device), params)
    # The module holds the path's last point: checked there, not read back from a file,
    # and before finish(), which refuses a path that compression could not store.
    # One read of every parameter's test (each read waits for the GPU).
    if not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        _raise_diverged(first_step + step - 1, n_iter - 1, lr)
    return recorder.finish(step, flat)


def _warn_not_converged(max_iter, tol, n_iter_no_change, validating, sched=None):
    """``sched``: the :class:`_Schedule`; "adaptive" stops only at its smallest step."""
    # What the rule waits for, not a claim that the loss improved: fewer than
    # n_iter_no_change + 1 epochs may have run, and "adaptive" restarts its count each
    # time it divides the step size.
    rule = (f"{n_iter_no_change + 1} consecutive epochs in which the "
            f"{'validation score' if validating else 'training loss'} did not improve by "
            f"more than tol={tol:g}")
    if sched is not None and sched.kind == "adaptive":
        rule += (f", at a step size of at most 1e-6 (learning_rate='adaptive' divides it "
                 f"by 5 at each such run; it is {sched.lr:g})")
    warnings.warn(
        f"Maximum iterations ({max_iter}) reached and the optimization hasn't converged "
        f"yet: the stopping rule waits for {rule}. Increase max_iter, or pass tol=None to "
        "train exactly max_iter epochs.",
        ConvergenceWarning,
        stacklevel=caller_stacklevel(),  # the user's line, also via a meta-estimator
    )


def _divergence(first_loss, loss_curve, norms) -> tuple[int, str] | None:
    """``(epoch, what ran away)`` when finite training ran away (thresholds above), else
    None; the arguments are :func:`_warn_if_diverging`'s."""
    limit = DIVERGENCE_LOSS_RATIO * first_loss
    norm_up = [e for e, v in enumerate(norms[1:]) if v > DIVERGENCE_NORM_RATIO * norms[0]]
    # Grown parameters alone may be training at work (a linear layer on features in
    # tiny units): they count when the loss did not come down either.
    if norm_up and loss_curve[-1] > first_loss:
        e = norm_up[0]
        return e, (f"the parameters' norm reached {norms[e + 1]:.3g}, more than "
                   f"{DIVERGENCE_NORM_RATIO:g} times its initial {norms[0]:.3g}")
    if max(loss_curve) > limit and loss_curve[-1] >= first_loss:
        # Up a hundredfold and never back below the start: also a network that blew up
        # and then settled where it predicts nothing (Adam at learning_rate_init=1 on
        # standardized digits: 848 over the first epoch from 2.3, then chance at 2.33).
        e = next(e for e, v in enumerate(loss_curve) if v > limit)
        return e, (f"the training loss reached {loss_curve[e]:.3g}, more than "
                   f"{DIVERGENCE_LOSS_RATIO:g} times the {first_loss:.3g} it started from")
    return None


def _warn_if_diverging(first_loss, loss_curve, norms, lr, epoch0=0):
    """:class:`DivergenceWarning` when finite training ran away (thresholds above).

    ``first_loss`` and ``norms[0]`` are the whole path's starting loss
    (:func:`_start_loss`; for a continued fit on other rows, the path's initial
    network's loss on them when higher) and initial parameter norm (a continued fit
    compares with them); ``norms[1:]`` follow the epochs of ``loss_curve``, the first of
    which is epoch ``epoch0``.
    """
    found = _divergence(first_loss, loss_curve, norms)
    if found is None:
        return
    e, what = found
    warnings.warn(
        f"Training diverged without overflowing: at epoch {epoch0 + e} {what}; the last "
        f"epoch's loss is {loss_curve[-1]:.3g}. The fitted network is not a trained one: "
        f"try a smaller learning_rate_init (it was {lr:g}).",
        DivergenceWarning,
        stacklevel=caller_stacklevel(),  # the user's line, also via a meta-estimator
    )


def extend_trajectory(first: Trajectory, second: Trajectory, offset: int,
                      n_samples: int) -> Trajectory:
    """``first`` followed by ``second``, which starts at ``first``'s last point.

    ``second``'s batches index its own training set, which starts at row ``offset`` of the
    combined one (``n_samples`` rows): 0 when it trained on the same data. The optimizer's
    state continued across the join (its step count too, which the recorded state steps
    are), so the combined path is one path, from the first initialization to the last
    step. On disk, ``second`` was recorded into ``first``'s series, from its last point
    on (``train(extends=first)``): the combined path reads them from their first row.
    In memory, the combined arrays are views of buffers with spare rows
    (:func:`~._buffers.appended`): a stream of continuations copies each row a bounded
    number of times in all, and ``first`` keeps its own rows unchanged.
    """
    if first.storage != second.storage:
        raise ValueError(f"Cannot join a path kept in {first.storage} with one kept in "
                         f"{second.storage}.")
    if first.storage == "disk":
        rows = second._params
        if rows.series is not first._params.series or rows.start != len(first) - 1:
            raise ValueError("The on-disk segment was not recorded after this path.")
        params = DiskRows(rows.series, rows.n, rows.tail)
        states = {k: DiskRows(v.series, v.n) for k, v in second._states.items()}
    else:
        params = appended(dense(first._params), dense(second._params)[1:])
        states = {k: appended(v, second._states[k]) for k, v in first._states.items()}
    n_first = first.n_steps
    # Each call's pool in the combined training set (a path recorded before pools were
    # kept drew from all of its rows).
    pools = pool_weights = None
    if first._pools is not None or second._pools is not None:
        (p1, w1), (p2, w2) = first._all_pools(), second._all_pools()
        pools = np.concatenate([p1, p2 + [n_first, offset, offset]])
        if first._pool_weights is not None or second._pool_weights is not None:
            pool_weights = np.concatenate([w1, w2])
    weights = step_lrs = scales = None
    if first._batch_weights is not None or second._batch_weights is not None:
        weights = appended(first._all_batch_weights(), second._all_batch_weights())
    if first._step_lrs is not None or second._step_lrs is not None:
        step_lrs = appended(first.step_learning_rates, second.step_learning_rates)
    if first._gradient_scales is not None or second._gradient_scales is not None:
        scales = appended(first.gradient_scales, second.gradient_scales)
    # A PathRecorder's parameter groups (an estimator's paths have none): both segments
    # were recorded with the same groups (PathRecorder's resume_from checks it), one
    # segment without per-group rows took one step size for every group.
    group_lrs = step_group_lrs = None
    n_groups = next((p._group_lrs.shape[1] for p in (first, second)
                     if p._group_lrs is not None), None)
    if n_groups is not None:
        group_lrs = appended(*(_group_rates(p, n_groups) for p in (first, second)))
        if first._step_group_lrs is not None or second._step_group_lrs is not None:
            step_group_lrs = appended(*(_group_rates(p, n_groups, every_step=True)
                                        for p in (first, second)))
    groups = first._param_groups if first._param_groups is not None else \
        second._param_groups
    decays = first._group_weight_decays if first._group_weight_decays is not None else \
        second._group_weight_decays
    return Trajectory(
        names=first.names, shapes=first.shapes,
        params=params,
        steps=appended(first.steps, second.steps[1:] + n_first),
        learning_rates=appended(first.learning_rates, second.learning_rates),
        batch_indices=appended(first._batch_indices, second._batch_indices + offset),
        batch_offsets=appended(first._batch_offsets,
                               second._batch_offsets[1:] + first._batch_offsets[-1]),
        states=states,
        state_steps=appended(first._state_steps, second._state_steps),
        solver=first.solver_spec, n_samples=n_samples,
        record_every=max(first.record_every, second.record_every),
        batch_weights=weights, step_lrs=step_lrs, pools=pools, pool_weights=pool_weights,
        gradient_scales=scales, group_lrs=group_lrs, step_group_lrs=step_group_lrs,
        param_groups=groups, group_weight_decays=decays,
    )


def _group_rates(path: Trajectory, n_groups: int, every_step: bool = False) -> np.ndarray:
    """Each parameter group's step size in each recorded interval of ``path`` (with
    ``every_step``, at each optimizer step), ``(n_rows, n_groups)``: the recorded ones,
    or the interval's (step's) one step size for every group where none were kept."""
    if every_step:
        if path._step_group_lrs is not None:
            return path._step_group_lrs[: path.n_steps]
        rows = (np.repeat(path._group_lrs, np.diff(path.steps), axis=0)
                if path._group_lrs is not None else path.step_learning_rates[:, None])
    else:
        rows = (path._group_lrs if path._group_lrs is not None
                else path.learning_rates[:, None])
    return np.broadcast_to(rows, (len(rows), n_groups)).astype(np.float64)


def _raise_diverged(step: int, epoch: int, lr: float, initial: bool = False):
    """``initial``: the path starts at this fit's first step (no ``warm_start`` or
    ``partial_fit`` continuation), whose loss is the initial network's."""
    if initial and step == 0:
        # Evaluated before the first update: no step size could have avoided it.
        raise TrainingDivergedError(
            "Training diverged: the loss was non-finite at optimizer step 0 (epoch 0), at "
            "the initial parameters, before any update: the network's outputs or the loss "
            "overflow on these inputs and targets, or the module returns NaN or inf. "
            "Scale X (e.g. StandardScaler), keep normalize_y=True for regression targets, "
            "or use dtype='float64'."
        )
    raise TrainingDivergedError(
        f"Training diverged: the loss or the parameters became non-finite at optimizer "
        f"step {step} (epoch {epoch}). Try a smaller learning_rate_init (it was {lr:g})."
    )
