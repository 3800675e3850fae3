"""The gradient of the default MLP's batch loss without the autograd engine.

On the small networks of a default fit the autograd engine's bookkeeping (recording the
graph in the forward pass, walking it in the backward pass) costs more than the
arithmetic: a forward and backward pass of iris' default network (64, 64) took 583 us
through autograd and 383 us by hand (one thread, a loaded machine). :class:`MLPGradient`
computes the same gradient with the very kernels autograd's backward formulas call
(``addmm``'s ``mm`` products in the same operand order, ``gelu_backward``,
``nll_loss_backward``, ...), so the gradient, and with it the recorded path, is the one
autograd gives, bit for bit (tests compare every parameter's gradient bitwise). Anything
else (another layer, a hook, a custom loss) takes autograd (:meth:`MLPGradient.build`
returns None).
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module_hooks

from ._losses import LogLoss, Loss, SquaredError

__all__ = ["MLPGradient"]

_aten = torch.ops.aten


def _relu_backward(layer, grad, z, a):
    return _aten.threshold_backward.default(grad, a, 0)  # relu's formula: on its result


def _tanh_backward(layer, grad, z, a):
    return _aten.tanh_backward.default(grad, a)


def _gelu_backward(layer, grad, z, a):
    return _aten.gelu_backward.default(grad, z, approximate=layer.approximate)


def _sigmoid_backward(layer, grad, z, a):
    return _aten.sigmoid_backward.default(grad, a)


def _softplus_backward(layer, grad, z, a):
    return _aten.softplus_backward.default(grad, z, layer.beta, layer.threshold)


# Autograd's backward formula of each activation module (derivatives.yaml).
_ACTIVATIONS = {
    torch.nn.ReLU: _relu_backward,
    torch.nn.Tanh: _tanh_backward,
    torch.nn.GELU: _gelu_backward,
    torch.nn.Softplus: _softplus_backward,
    torch.nn.Sigmoid: _sigmoid_backward,
    torch.nn.Identity: None,
}
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _plain(layer: torch.nn.Module) -> bool:
    """No hooks, and a layer whose gradient this module writes out."""
    if any(getattr(layer, h) for h in _MODULE_HOOKS):
        return False
    if type(layer) is torch.nn.Linear:
        # addmm's backward formulas below assume the weight's own layout (a
        # column-major weight.t()): a fresh Linear's.
        w = layer.weight
        return layer.bias is not None and w.dim() == 2 and w.stride() == (w.shape[1], 1)
    return type(layer) in _ACTIVATIONS and not getattr(layer, "inplace", False)


class MLPGradient:
    """``loss(module(xb), yb)`` and its gradient, written into each parameter's ``grad``.

    For a ``torch.nn.Sequential`` of ``Linear`` (with bias) and ReLU / Tanh / GELU /
    Softplus / Sigmoid / Identity layers on 2-D inputs, with the library's squared error
    or log loss; build it with :meth:`build`.
    """

    def __init__(self, module: torch.nn.Sequential, loss: Loss):
        self.layers = list(module)
        self.loss = loss
        self.params = list(module.parameters())
        self._mean_grad = {}  # batch shape -> the loss's means' backward, made once
        self._target = None  # (labels, their version, as floats) of the last binary batch
        # Each layer's parameters and functions looked up once: a step of a default
        # network is a few dozen small kernels, and Module.__getattr__ and the per-layer
        # dispatch cost as much as several of them. The Parameter objects stay the same
        # (the optimizer updates them in place), so holding them is safe.
        self._plan = []
        for layer in self.layers:
            if type(layer) is torch.nn.Linear:
                self._plan.append((layer.weight, layer.bias, None, None))
            else:
                self._plan.append((None, None, layer.forward, _ACTIVATIONS[type(layer)]))
        self._is_squared = type(loss) is SquaredError

    @classmethod
    def build(cls, module, loss: Loss, X: torch.Tensor) -> MLPGradient | None:
        """The hand-written gradient of ``module``, or None where autograd must run."""
        if type(module) is not torch.nn.Sequential or type(loss) not in (SquaredError, LogLoss):
            return None
        if any(getattr(_module_hooks, h, None) for h in _GLOBAL_HOOKS):
            return None
        if not len(module) or not all(_plain(layer) for layer in module):
            return None
        params = list(module.parameters())
        if not all(
            p.requires_grad
            and type(p) is torch.nn.Parameter
            and not p._backward_hooks
            and not p._post_accumulate_grad_hooks
            for p in params
        ):
            return None
        if (
            X.dim() != 2
            or not X.is_floating_point()
            or type(X) is not torch.Tensor
            or any(p.dtype != X.dtype or p.device != X.device for p in params)
        ):
            return None
        return cls(module, loss)

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """The batch loss (a scalar tensor); every parameter's ``grad`` set to its gradient.

        ``weights``: each sample's weight in the batch loss (``Loss.weighted``), None for
        the mean.
        """
        if torch.is_grad_enabled():  # nothing here is part of a graph
            with torch.no_grad():
                return self._forward_backward(xb, yb, weights)
        return self._forward_backward(xb, yb, weights)

    def _forward_backward(self, xb, yb, weights=None):
        plan = self._plan
        inputs, outputs = [], []
        a = xb
        for weight, bias, forward, _ in plan:
            inputs.append(a)
            # F.linear on a 2-D input with a bias is this addmm.
            a = torch.addmm(bias, a, weight.t()) if weight is not None else forward(a)
            outputs.append(a)
        batch_loss, grad = self._loss_and_output_grad(a, yb, weights)
        for i in range(len(plan) - 1, -1, -1):
            weight, bias, _, backward = plan[i]
            if weight is not None:
                x = inputs[i]
                # addmm's formulas (mm_mat2_backward on the column-major weight.t(),
                # then t(); the bias's broadcast summed back over the batch).
                weight.grad = grad.t().mm(x)
                bias.grad = grad.sum(0)
                if i == 0:
                    break
                grad = _mm_mat1_backward(grad, weight, x)
            elif i == 0:
                break
            elif backward is not None:
                grad = backward(self.layers[i], grad, inputs[i], outputs[i])
        return batch_loss

    def _loss_and_output_grad(self, out, yb, weights=None):
        """The batch loss and its gradient with respect to the network's output, as the
        backward pass of ``Loss.__call__`` (``Loss.weighted`` with ``weights``) computes
        them."""
        n = out.shape[0]
        if weights is not None:
            # The weighted sum's backward hands each sample its weight, where the mean's
            # hands it 1 / n: the same formulas below, with these factors.
            return self._weighted_loss_and_grad(out, yb, weights)
        # mean's backward: the ones it expands, divided by the number of samples.
        g = self._mean_grad.get(n)
        if g is None:
            g = self._mean_grad[n] = torch.ones(n, dtype=out.dtype, device=out.device) / n
        if self._is_squared:
            diff = out - yb
            batch_loss = (0.5 * diff.pow(2).mean(dim=1)).mean()
            # The two means' backward depends on the batch's shape only: made once.
            key = (n, out.shape[1])
            g2 = self._mean_grad.get(key)
            if g2 is None:
                g2 = self._mean_grad[key] = (g * 0.5).unsqueeze(1).expand_as(out) / out.shape[1]
            return batch_loss, g2 * (2.0 * diff)
        if out.shape[1] == 1:  # binary_cross_entropy_with_logits on the margin
            # A full batch is the same labels every step: converted once.
            last = self._target
            if last is not None and last[0] is yb and last[1] == yb._version:
                target = last[2]
            else:
                target = yb.to(out.dtype)
                self._target = (yb, yb._version, target)
            margin = out[:, 0]
            batch_loss = torch.nn.functional.binary_cross_entropy_with_logits(
                margin, target, reduction="none"
            ).mean()
            return batch_loss, ((margin.sigmoid() - target) * g).unsqueeze(1)
        if yb.dim() == 2:  # multilabel: the logistic loss of every label, summed
            target = yb.to(out.dtype)  # the same tensor when already in dtype
            batch_loss = torch.nn.functional.binary_cross_entropy_with_logits(
                out, target, reduction="none"
            ).sum(dim=1).mean()
            # sum's backward expands the mean's over the labels.
            return batch_loss, (out.sigmoid() - target) * g.unsqueeze(1)
        # cross_entropy = nll_loss(log_softmax(out)), with their backward kernels.
        logp = torch.log_softmax(out, 1)
        per_sample, total = _aten.nll_loss_forward.default(logp, yb, None, 0, -100)
        g = _aten.nll_loss_backward.default(g, logp, yb, None, 0, -100, total)
        return per_sample.mean(), torch._log_softmax_backward_data(g, logp, 1, out.dtype)

    def _weighted_loss_and_grad(self, out, yb, g):
        """``_loss_and_output_grad`` of ``sum_i g_i l_i``."""
        if self._is_squared:
            diff = out - yb
            batch_loss = (0.5 * diff.pow(2).mean(dim=1) * g).sum()
            g2 = (g * 0.5).unsqueeze(1).expand_as(out) / out.shape[1]
            return batch_loss, g2 * (2.0 * diff)
        if out.shape[1] == 1:
            margin, target = out[:, 0], yb.to(out.dtype)
            per_sample = torch.nn.functional.binary_cross_entropy_with_logits(
                margin, target, reduction="none")
            return (per_sample * g).sum(), ((margin.sigmoid() - target) * g).unsqueeze(1)
        if yb.dim() == 2:  # multilabel: the logistic loss of every label, summed
            target = yb.to(out.dtype)
            per_sample = torch.nn.functional.binary_cross_entropy_with_logits(
                out, target, reduction="none").sum(dim=1)
            return (per_sample * g).sum(), (out.sigmoid() - target) * g.unsqueeze(1)
        logp = torch.log_softmax(out, 1)
        per_sample, total = _aten.nll_loss_forward.default(logp, yb, None, 0, -100)
        grad = _aten.nll_loss_backward.default(g, logp, yb, None, 0, -100, total)
        return ((per_sample * g).sum(),
                torch._log_softmax_backward_data(grad, logp, 1, out.dtype))


def _mm_mat1_backward(grad, weight, x):
    """The gradient of ``addmm``'s ``mat1`` (the layer's input) as autograd computes it:
    in column-major order when the input was column-major."""
    if x.stride(0) == 1 and x.stride(1) == x.shape[0]:
        return weight.t().mm(grad.t()).t()
    return grad.mm(weight)
