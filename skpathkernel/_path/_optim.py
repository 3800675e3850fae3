"""The estimators' optimizers: torch.optim's update functions behind a lighter object.

``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time one of its methods
runs (they are wrapped to be skipped by ``torch.compile``): seconds once per process
(3-6 s measured on a 2-core machine), more than a whole default fit on a small data set.
:class:`FunctionalOptimizer` calls the same functional update that
``torch.optim.SGD / Adam / AdamW / RMSprop.step`` call (``torch.optim.adam.adam``, ...),
with the same arguments and the same state tensors, so each step's arithmetic is
torch.optim's, and it keeps the parts of the optimizer interface that the training
loop, the recorder and :class:`~skpathkernel._path._training.Resume` read
(``param_groups``, ``state``, ``zero_grad``, ``state_dict``, ``load_state_dict``).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _adam
from torch.optim.adamw import adamw as _adamw
from torch.optim.rmsprop import rmsprop as _rmsprop
from torch.optim.sgd import sgd as _sgd
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ._trajectory import SolverSpec

__all__ = ["FunctionalOptimizer"]


def _fusable(params) -> bool:
    """Whether torch has a fused kernel for these parameters (as torch.optim checks)."""
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


class FunctionalOptimizer:
    """SGD, Adam, AdamW or RMSprop on ``params`` with ``spec``'s hyper-parameters.

    Fused (one kernel for every parameter's update) where torch has a fused kernel for
    these parameters, as ``torch.optim``'s ``fused=True``, else torch.optim's default
    implementation; RMSprop, which has no fused kernel, takes the multi-tensor
    (``foreach``) one. The state holds what torch.optim's
    holds, under the same keys and with the same dtypes and devices.

    Parameters
    ----------
    params : list of torch.Tensor
        The parameters to update, one group.
    spec : SolverSpec
        The rule and its hyper-parameters.
    lr : float
        The step size, ``param_groups[0]["lr"]`` (which a schedule may change).
    """

    def __init__(self, params, spec: SolverSpec, lr: float):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        if spec.name not in ("sgd", "adam", "adamw", "rmsprop"):
            raise ValueError(f"Unknown solver {spec.name!r}.")
        self.spec = spec
        self.fused = spec.name != "rmsprop" and _fusable(self.params)
        # One device and dtype: torch.optim's fused update would make one group of them
        # and call its kernel once; that call is made here directly (the grouping costs
        # more than the kernel on a small network).
        self._direct = self.fused and len({(p.device, p.dtype) for p in self.params}) == 1
        self.param_groups = [{"params": self.params, "lr": float(lr)}]
        self.state: dict[torch.Tensor, dict] = {p: {} for p in self.params}
        # The state tensors of every parameter, listed per key once they exist (a step
        # that updates all parameters reads them from here, not from ``state`` parameter
        # by parameter); dropped when the state is replaced (load_state_dict).
        self._state_lists: dict[str, list[torch.Tensor]] | None = None
        # With the fused kernel: the step counts as 0-d views of one vector, so that a
        # step counts them with one add_ (torch._foreach_add_ over 0-d tensors takes
        # several times as long as that).
        self._step_counts: torch.Tensor | None = None

    # ------------------------------------------------------------------ state
    def _step_tensor(self, p) -> torch.Tensor:
        # torch.optim keeps the step count on the parameter's device, in float32, when
        # fused; otherwise on the CPU in the default scalar dtype.
        if self.fused:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return torch.zeros((), dtype=dtype)

    def _init_state(self, p) -> dict:
        state = self.state[p]
        if not state and self.spec.name != "sgd":
            state["step"] = self._step_tensor(p)
            key = "square_avg" if self.spec.name == "rmsprop" else "exp_avg_sq"
            if key == "exp_avg_sq":
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients, or with ``set_to_none=False`` zero them in place, as
        ``torch.optim.Optimizer.zero_grad``."""
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """One update with the gradients in ``p.grad``; parameters without one are skipped."""
        if torch.is_grad_enabled():  # the update is not part of any graph
            with torch.no_grad():
                self._step()
        else:
            self._step()

    def _step(self) -> None:
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        spec, lr = self.spec, self.param_groups[0]["lr"]
        if spec.name == "sgd":
            self._sgd(params, grads, lr)
            return
        lists = self._state_lists if len(params) == len(self.params) else None
        if lists is None:
            states = [self._init_state(p) for p in params]
            lists = {key: [s[key] for s in states] for key in states[0]}
            if len(params) == len(self.params):
                self._state_lists = lists
                if self._direct:
                    self._share_step_counts(lists)
        steps = lists["step"]
        if spec.name == "rmsprop":
            _rmsprop(
                params,
                grads,
                lists["square_avg"],
                [],
                [],
                steps,
                lr=lr,
                alpha=spec.rmsprop_alpha,
                eps=spec.epsilon,
                weight_decay=spec.weight_decay,
                momentum=0.0,
                centered=False,
                foreach=True,
                maximize=False,
                differentiable=False,
                capturable=False,
                has_complex=False,
            )
            return
        exp_avgs, exp_avg_sqs = lists["exp_avg"], lists["exp_avg_sq"]
        rule = dict(amsgrad=False, lr=lr, beta1=spec.beta_1, beta2=spec.beta_2,
                    weight_decay=spec.weight_decay, eps=spec.epsilon, maximize=False,
                    grad_scale=None, found_inf=None)  # fmt: skip
        if self._direct:  # torch.optim.adam._fused_adam's one group
            if self._step_counts is not None and lists is self._state_lists:
                self._step_counts.add_(1)
            else:
                torch._foreach_add_(steps, 1)
            kernel = torch._fused_adamw_ if spec.name == "adamw" else torch._fused_adam_
            kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, **rule)
            return
        # AdamW through its own function: torch < 2.7's ``adam`` has no
        # ``decoupled_weight_decay`` (torch.optim.AdamW called ``adamw`` there).
        update = _adamw if spec.name == "adamw" else _adam
        update(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
               fused=self.fused or None, capturable=False, differentiable=False,
               has_complex=False, **rule)  # fmt: skip

    def _share_step_counts(self, lists) -> None:
        """Every parameter's step count as a view of one vector (same values, dtype and
        device; ``state[p]["step"]`` stays a 0-d tensor, as torch.optim's)."""
        counts = torch.stack(lists["step"])
        lists["step"] = list(counts.unbind())
        for p, count in zip(self.params, lists["step"], strict=True):
            self.state[p]["step"] = count
        self._step_counts = counts

    def _sgd(self, params, grads, lr) -> None:
        spec = self.spec
        momentum = spec.momentum
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum else []
        rule = dict(weight_decay=spec.weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                    nesterov=bool(spec.nesterov and momentum > 0), maximize=False,
                    grad_scale=None, found_inf=None)  # fmt: skip
        if self._direct:  # torch.optim.sgd._fused_sgd's one group
            first = bool(momentum) and all(b is None for b in buffers)
            if first:
                buffers = [torch.empty_like(g) for g in grads]
            torch._fused_sgd_(params, grads, buffers, is_first_step=first, **rule)
        else:
            _sgd(params, grads, buffers, has_sparse_grad=False, foreach=None,
                 fused=self.fused or None, **rule)  # fmt: skip
        if momentum:  # the update fills new buffers in the list on its first step
            for p, buf in zip(params, buffers, strict=True):
                self.state[p]["momentum_buffer"] = buf

    # ------------------------------------------------------------------ (de)serialization
    def state_dict(self) -> dict:
        """``{"state": {i: state of parameter i}, "param_groups": [...]}``, as torch.optim.

        The state's tensors are the optimizer's own (not copies), as torch.optim's.
        """
        return {
            "state": {i: dict(self.state[p]) for i, p in enumerate(self.params) if self.state[p]},
            "param_groups": [
                {"lr": self.param_groups[0]["lr"], "params": list(range(len(self.params)))}
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict["state"]`` (the step size stays this optimizer's).

        Cast as torch.optim casts: floating state to each parameter's dtype and device;
        the step count to float32 on the parameter's device when fused, else as given.
        """
        for i, p in enumerate(self.params):
            saved = state_dict["state"].get(i, {})
            self.state[p] = {k: self._cast(p, k, v) for k, v in saved.items()}
        self._state_lists = self._step_counts = None

    def _cast(self, p, key, value):
        if not torch.is_tensor(value):
            return value
        if key == "step":
            return value.to(dtype=torch.float32, device=p.device) if self.fused else value
        if p.is_floating_point():
            return value.to(dtype=p.dtype, device=p.device)
        return value.to(device=p.device)
