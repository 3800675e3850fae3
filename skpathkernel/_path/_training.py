"""The training loop that records the optimisation path.

The loop drives torch.optim's own optimizers, so the recorded path is exactly what
``torch.optim.SGD / Adam / AdamW / RMSprop`` do; the recorder only copies parameters and
optimizer state into preallocated CPU buffers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sklearn.exceptions import ConvergenceWarning

from ._losses import Loss
from ._storage import free_disk
from ._trajectory import SolverSpec, Trajectory, TrajectoryRecorder

__all__ = ["TrainingDivergedError", "make_optimizer", "resolve_batch_size", "train"]


class TrainingDivergedError(ValueError):
    """The training loss, or the parameters, became non-finite."""


def make_optimizer(params, spec: SolverSpec, lr: float) -> torch.optim.Optimizer:
    """The torch.optim optimizer that ``spec`` names, with its hyper-parameters."""
    betas = (spec.beta_1, spec.beta_2)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=spec.epsilon,
                                weight_decay=spec.weight_decay)
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=spec.epsilon,
                                 weight_decay=spec.weight_decay)
    if spec.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=spec.rmsprop_alpha, eps=spec.epsilon,
                                   weight_decay=spec.weight_decay)
    raise ValueError(f"Unknown solver {spec.name!r}.")


@dataclass
class TrainResult:
    trajectory: Trajectory
    loss_curve: list[float]
    n_iter: int  # epochs run
    n_steps: int  # optimizer steps taken (the trajectory may end earlier: early stopping)
    best_loss: float | None
    validation_scores: list[float] | None
    best_validation_score: float | None


def resolve_batch_size(batch_size, n_samples: int) -> int:
    """``None``: full batch; ``"auto"``: ``min(200, n_samples)`` (MLPClassifier's)."""
    if batch_size is None:
        return n_samples
    if isinstance(batch_size, str):
        return min(200, n_samples)
    return min(int(batch_size), n_samples)


class _StoppingRule:
    """MLPClassifier's convergence test, epoch by epoch (``_update_no_improvement_count``).

    Without validation: an epoch counts as "no improvement" when its training loss is not
    below the best loss so far minus ``tol``. With validation: when its score is not above
    the best score so far plus ``tol``. Training stops when more than ``n_iter_no_change``
    consecutive epochs did not improve; ``tol=None`` never stops.
    """

    def __init__(self, tol, n_iter_no_change, validating):
        self.tol, self.patience, self.validating = tol, n_iter_no_change, validating
        self.count = 0
        self.best_loss = math.inf
        self.best_score = -math.inf

    def update(self, loss: float, score: float | None) -> tuple[bool, bool]:
        """(whether this epoch is the best so far, whether training should stop now)."""
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
        return best, self.tol is not None and self.count > self.patience


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
) -> TrainResult:
    """Train ``module`` in place on (X, Y) and return the recorded path.

    ``batch_size=None`` is full-batch gradient descent, ``"auto"`` ``min(200, n)``.
    Batches are drawn on the CPU from ``generator`` so that a seed gives the same batches
    on every device. ``progress`` is an optional callable ``(epoch, loss)`` called after
    each epoch.

    Stopping follows MLPClassifier (see :class:`_StoppingRule`): with ``validation`` (a
    callable scoring the module on held-out data, higher is better) the score decides,
    and the module and the path end at the epoch with the best score; otherwise the
    training loss decides, and the path ends at the last step taken. A
    :class:`~sklearn.exceptions.ConvergenceWarning` says when ``max_iter`` epochs ran
    without meeting the rule (never with ``tol=None``, which runs all ``max_iter``).
    ``record_every="auto"`` records every step when the points of ``max_iter`` epochs fit
    in ``record_budget`` bytes, else every k-th step with the smallest k that fits.

    ``storage`` ("memory", "disk" or "auto": disk when the points of ``max_iter`` epochs
    exceed ``record_budget`` bytes) says where the points go; on disk, in a fresh
    temporary directory under ``directory``, and ``record_every="auto"`` keeps every
    step that fits in 90% of the disk's free space.
    """
    n = X.shape[0]
    B = resolve_batch_size(batch_size, n)
    steps_per_epoch = math.ceil(n / B)
    n_steps = max_iter * steps_per_epoch
    params = [p for p in module.parameters() if p.requires_grad]
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(params, solver, learning_rate)
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
    recorder = TrajectoryRecorder(
        params, names, n_steps=n_steps, record_every=record_every, solver=solver,
        n_samples=n, batch_size=B, dtype=params[0].dtype, storage=storage,
        directory=directory, memory_budget=record_budget, compression=compression,
    )
    full_batch = B == n
    sizes = torch.tensor([min(B, n - b * B) for b in range(steps_per_epoch)],
                         dtype=params[0].dtype, device=X.device)
    recorder.record_point(0)
    loss_curve: list[float] = []
    scores: list[float] | None = None if validation is None else []
    rule = _StoppingRule(tol, n_iter_no_change, validation is not None)
    best_step, best_params = n_steps, None
    step = 0
    stopped = False
    for epoch in range(max_iter):
        if shuffle and not full_batch:
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        order_np = order.numpy()
        order_dev = order.to(X.device)
        batch_losses = []
        for b in range(steps_per_epoch):
            if full_batch:
                xb, yb = X, Y
            else:
                idx = order_dev[b * B : (b + 1) * B]
                xb, yb = X[idx], Y[idx]
            optimizer.zero_grad(set_to_none=True)
            batch_loss = loss(module(xb), yb)
            batch_loss.backward()
            optimizer.step()
            recorder.record_batch(order_np[b * B : (b + 1) * B])
            recorder.record_step(step, learning_rate, optimizer)
            step += 1
            if recorder.wants_point(step):
                recorder.record_point(step)
            batch_losses.append(batch_loss.detach())
        # Weighted by batch size so that the epoch loss is the mean over samples; one
        # multiplication an epoch, not a product and a store per step (the same values:
        # each loss times its batch size in the loss's dtype, summed in float64).
        batch_losses = torch.stack(batch_losses)
        batch_losses = (batch_losses * sizes.to(batch_losses.dtype)).double()
        finite = torch.isfinite(batch_losses)
        if not bool(finite.all()):
            bad = int(torch.nonzero(~finite)[0, 0])
            _raise_diverged(epoch * steps_per_epoch + bad, epoch, learning_rate)
        epoch_loss = float(batch_losses.sum()) / n
        loss_curve.append(epoch_loss)
        score = None
        if validation is not None:
            with torch.no_grad():
                score = float(validation(module))
            scores.append(score)
        best, stop = rule.update(epoch_loss, score)
        if best and validation is not None:
            # The model is the best-scoring epoch's (MLPClassifier restores it too): keep
            # its parameters, the path will end there.
            best_step = step
            best_params = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
        if progress is not None:
            progress(epoch, epoch_loss)
        if stop:
            stopped = True
            break
    n_iter = len(loss_curve)
    if not stopped and tol is not None:
        warnings.warn(
            f"Maximum iterations ({max_iter}) reached and the optimization hasn't converged "
            f"yet: the {'validation score' if validation is not None else 'training loss'} "
            f"still improved by more than tol={tol:g} within the last "
            f"{n_iter_no_change + 1} epochs. Increase max_iter, or pass tol=None to train "
            "exactly max_iter epochs.",
            ConvergenceWarning,
            stacklevel=4,
        )
    if best_params is None:  # no validation, or no finite score: the last step is the model
        best_step = step
    else:
        torch.nn.utils.vector_to_parameters(best_params.to(params[0].device), params)
    # The module holds the path's last point: checked there, not read back from a file,
    # and before finish(), which refuses a path that compression could not store.
    if not all(bool(torch.isfinite(p).all()) for p in params):
        _raise_diverged(best_step - 1, n_iter - 1, learning_rate)
    trajectory = recorder.finish(best_step, best_params)
    return TrainResult(
        trajectory, loss_curve, n_iter, step,
        best_loss=None if validation is not None else min(loss_curve),
        validation_scores=scores,
        best_validation_score=None if validation is None else rule.best_score,
    )


def _raise_diverged(step: int, epoch: int, lr: float):
    raise TrainingDivergedError(
        f"Training diverged: the loss or the parameters became non-finite at optimizer "
        f"step {step} (epoch {epoch}). Try a smaller learning_rate_init (it was {lr:g})."
    )

