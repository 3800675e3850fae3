"""Per-sample training losses.

Every loss is defined per sample, ``l(y_i, f(x_i))``; the training objective is its mean
over the batch. Keeping the per-sample form lets the decomposition read the residuals
``r_i = dl/df (y_i, f(x_i))`` that weight each training point.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import once_differentiable

__all__ = ["LOSSES", "Loss"]


class Loss:
    """A per-sample loss ``per_sample(output, target) -> (B,)``; the batch loss is its mean."""

    name: str = ""

    def per_sample(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.per_sample(output, target).mean()

    def weighted(self, output: torch.Tensor, target: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """``sum_i weights_i l_i``: the batch loss of a fit with ``sample_weight``, whose
        ``weights`` are the batch's normalized weights (summing to 1, or all 0)."""
        return (self.per_sample(output, target) * weights).sum()

    def residuals(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``dl_i/df_i`` for every sample, shape (B, C)."""
        output = output.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.per_sample(output, target).sum(), output)
        return grad

    def output_hessian(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``d^2 l_i / df_i^2`` for every sample, shape (B, C, C): by autograd, one backward
        per output (the samples are independent); the built-in losses give closed forms."""
        with torch.enable_grad():
            output = output.detach().requires_grad_(True)
            losses = self.per_sample(output, target)
            # A seed that requires grad, so that a @once_differentiable backward leaves
            # the node check_twice_differentiable refuses (else its Hessian reads as 0).
            (grad,) = torch.autograd.grad(losses, output, create_graph=True,
                                          grad_outputs=torch.ones_like(losses).requires_grad_())
            if once_differentiable(grad):
                raise ValueError(
                    "The loss's backward cannot be differentiated: a custom "
                    "torch.autograd.Function in it has a backward marked "
                    "@once_differentiable, so its second derivatives would read as 0. "
                    "Write its backward with differentiable torch operations.")
            rows = [torch.zeros_like(output) if not grad.requires_grad else
                    torch.autograd.grad(grad[:, c].sum(), output, retain_graph=True,
                                        allow_unused=True)[0]
                    for c in range(output.shape[1])]
        return torch.stack([torch.zeros_like(output) if r is None else r for r in rows], 1)

    def target_hessian(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``d^2 l_i / df_i dy_i`` for every sample, shape (B, C, C) (output, then target
        column): how a target moves the residual. By autograd, one backward per output;
        the squared error gives its closed form."""
        with torch.enable_grad():
            output = output.detach().requires_grad_(True)
            target = target.detach().to(output.dtype).requires_grad_(True)
            (grad,) = torch.autograd.grad(self.per_sample(output, target).sum(), output,
                                          create_graph=True)
            rows = [torch.autograd.grad(grad[:, c].sum(), target, retain_graph=True,
                                        allow_unused=True)[0]
                    for c in range(output.shape[1])]
        return torch.stack([torch.zeros_like(target) if r is None else r.reshape(target.shape)
                            for r in rows], 1)


class SquaredError(Loss):
    """``l = 1/2 * mean_c (f_c - y_c)^2``: MLPRegressor's "squared_error" convention."""

    name = "squared_error"

    def per_sample(self, output, target):
        return 0.5 * (output - target).pow(2).mean(dim=1)

    def output_hessian(self, output, target):
        n, C = output.shape
        eye = torch.eye(C, dtype=output.dtype, device=output.device) / C
        return eye.expand(n, C, C)

    def target_hessian(self, output, target):
        return -self.output_hessian(output, target)


class LogLoss(Loss):
    """Logistic loss on a margin (one output), softmax cross-entropy on logits (integer
    class codes), or, for a 0/1 indicator target of the outputs' shape (multilabel), the
    logistic loss of every output summed over the labels: MLPClassifier's
    ``binary_log_loss``, whose residual is ``sigmoid(f) - y`` per label."""

    name = "log_loss"

    def per_sample(self, output, target):
        if output.shape[1] == 1:
            # 0/1 targets, also given as integer class codes, or as one column (n, 1),
            # BCEWithLogitsLoss's layout for one logit.
            if target.dim() == 2 and target.shape[1] == 1:
                target = target[:, 0]
            return F.binary_cross_entropy_with_logits(output[:, 0], target.to(output.dtype),
                                                      reduction="none")
        if target.dim() == 2:
            return F.binary_cross_entropy_with_logits(output, target.to(output.dtype),
                                                      reduction="none").sum(dim=1)
        return F.cross_entropy(output, target, reduction="none")

    def output_hessian(self, output, target):
        if output.shape[1] == 1 or target.dim() == 2:
            # A logistic loss per output: sigmoid' on the diagonal.
            p = torch.sigmoid(output)
            return torch.diag_embed(p * (1.0 - p))
        p = torch.softmax(output, dim=1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


LOSSES = {cls.name: cls for cls in (SquaredError, LogLoss)}
