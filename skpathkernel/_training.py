"""The training loop that records the optimisation path.

The loop drives torch.optim's own optimizers, so the recorded path is exactly what
``torch.optim.SGD / Adam / AdamW / RMSprop`` do; the recorder only copies parameters and
optimizer state into preallocated CPU buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._losses import Loss
from ._trajectory import SolverSpec, Trajectory, TrajectoryRecorder

__all__ = ["TrainingDivergedError", "make_optimizer", "train"]


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
    n_iter: int
    n_steps: int


def train(
    module: torch.nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor,
    *,
    loss: Loss,
    solver: SolverSpec,
    learning_rate: float,
    batch_size: int | None,
    max_iter: int,
    shuffle: bool,
    generator: torch.Generator,
    record_every: int,
    progress=None,
) -> TrainResult:
    """Train ``module`` in place on (X, Y) and return the recorded path.

    ``batch_size=None`` is full-batch gradient descent. Batches are drawn on the CPU from
    ``generator`` so that a seed gives the same batches on every device.
    ``progress`` is an optional callable ``(epoch, loss)`` called after each epoch.
    """
    n = X.shape[0]
    B = n if batch_size is None else min(int(batch_size), n)
    steps_per_epoch = math.ceil(n / B)
    n_steps = max_iter * steps_per_epoch
    params = [p for p in module.parameters() if p.requires_grad]
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(params, solver, learning_rate)
    recorder = TrajectoryRecorder(
        params, names, n_steps=n_steps, record_every=record_every, solver=solver,
        n_samples=n, batch_size=B, dtype=params[0].dtype,
    )
    full_batch = B == n
    recorder.record_point(0)
    loss_curve: list[float] = []
    step = 0
    for epoch in range(max_iter):
        if shuffle and not full_batch:
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        order_np = order.numpy()
        order_dev = order.to(X.device)
        batch_losses = torch.empty(steps_per_epoch, dtype=torch.float64, device=X.device)
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
            # Weighted by batch size so that the epoch loss is the mean over samples.
            batch_losses[b] = batch_loss.detach() * xb.shape[0]
        finite = torch.isfinite(batch_losses)
        if not bool(finite.all()):
            bad = int(torch.nonzero(~finite)[0, 0])
            _raise_diverged(epoch * steps_per_epoch + bad, epoch, learning_rate)
        epoch_loss = float(batch_losses.sum()) / n
        loss_curve.append(epoch_loss)
        if progress is not None:
            progress(epoch, epoch_loss)
    trajectory = recorder.finish()
    if not bool(torch.isfinite(trajectory.parameters(-1)).all()):
        _raise_diverged(n_steps - 1, max_iter - 1, learning_rate)
    return TrainResult(trajectory, loss_curve, max_iter, n_steps)


def _raise_diverged(step: int, epoch: int, lr: float):
    raise TrainingDivergedError(
        f"Training diverged: the loss or the parameters became non-finite at optimizer "
        f"step {step} (epoch {epoch}). Try a smaller learning_rate_init (it was {lr:g})."
    )

