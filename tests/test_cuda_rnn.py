"""Recurrent networks (LSTM, GRU) on CUDA against the CPU.

torch's cuDNN RNN kernels have no backward in eval mode, no double backward and no vmap
rule: the analyses run such a network with cuDNN off (skpathkernel._modules.running),
and its fit trains with cuDNN where the layer is in training mode (one backward a step).
Each network is fitted on the GPU and on the CPU with the same seed, in float64, and
the path, the kernels, transform, the exact decomposition (its closure) and the
second-order one (two reverse passes on CUDA, whose fused cells have no forward-mode
derivative), attribute
(also unrolled) and explain are compared at test_cuda.py's tolerances. Skipped without
CUDA (tests/test_recurrent_cudnn.py checks the switch itself on the CPU); run on a GPU
with ``bash benchmarks/device_check.sh``.
"""

import warnings

import numpy as np
import pytest
import torch
from test_cuda import (
    _close,
    _same_decomposition,
    _same_explanation,
    _same_kernels,
    _same_path,
)

from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel.rules import FallbackWarning, check_rule, layer_routes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Sequence(torch.nn.Module):
    """(n, 8) features as 4 steps of 2 through ``cell``, a head on the last step."""

    def __init__(self, n_out, cell, built_in_eval=False):
        super().__init__()
        self.rnn = cell(2, 5, batch_first=True)
        self.head = torch.nn.Linear(5, n_out)
        if built_in_eval:
            self.rnn.eval()

    def forward(self, x):
        return self.head(self.rnn(x.reshape(-1, 4, 2))[0][:, -1])


def _data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1, 1, size=(n, 8))
    Y = np.column_stack([np.sin(2 * X[:, 0]) + X[:, 5], X[:, 2] * X[:, 7]])
    y = (X[:, 0] + X[:, 6] > 0).astype(int) + (X[:, 3] > 0.5)
    return X, y, Y, rng.uniform(-1, 1, size=(5, 8))


def _build(cell, **kw):
    def build(n_features, n_outputs):
        return _Sequence(n_outputs, cell, **kw)
    return build


def _fit_pair(make, X, y):
    # fit's check of the tangent routes runs the module in eval mode with a backward: on
    # the GPU too the recurrent layer is on its rule (a Python recurrence, no cuDNN), so
    # no FallbackWarning (it once named the layer's fallback, swallowing cuDNN's error).
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        gpu = make("cuda").fit(X, y)
    assert {r.route for r in layer_routes(gpu.module_, X[:4]) if r.name == "rnn"} == {"rule"}
    cpu = make("cpu").fit(X, y)
    assert next(gpu.module_.parameters()).is_cuda
    return gpu, cpu


def _check_verbs(gpu, cpu, X, Q, **output):
    _same_path(gpu, cpu)
    _close(gpu.transform(Q), cpu.transform(Q), what="transform")
    _same_decomposition(gpu, cpu, Q)  # exact: its closure checked on the GPU too
    _close(gpu.attribute(Q, **output), cpu.attribute(Q, **output), what="attribute")
    _close(gpu.attribute(Q, method="unrolled", **output),
           cpu.attribute(Q, method="unrolled", **output), what="unrolled attribute")
    _same_explanation(gpu, cpu, Q, 4)
    _same_kernels(gpu, cpu, X, Q)
    # Each verb put the switch back as it found it.
    assert torch.backends.cudnn.enabled


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_regressor_on_cuda(cell):
    X, _, Y, Q = _data()
    gpu, cpu = _fit_pair(lambda d: PathKernelMachine(
        module=_build(cell), device=d, dtype="float64", solver="adam",
        learning_rate_init=0.02, batch_size=8, max_iter=3, tol=None, random_state=0), X, Y)
    _close(gpu.predict(Q), cpu.predict(Q), what="predict")
    # Its products by two reverse passes on CUDA (the fused cells have no forward mode).
    _same_decomposition(gpu, cpu, Q, method="second_order")
    _check_verbs(gpu, cpu, X, Q, output=1)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_classifier_on_cuda(cell):
    X, y, _, Q = _data()
    gpu, cpu = _fit_pair(lambda d: PathKernelClassifier(
        module=_build(cell), device=d, dtype="float64", solver="sgd", momentum=0.9,
        learning_rate_init=0.1, batch_size=8, max_iter=3, tol=None, random_state=0), X, y)
    _close(gpu.predict_proba(Q), cpu.predict_proba(Q), what="predict_proba")
    _check_verbs(gpu, cpu, X, Q)


def test_recurrent_layer_built_in_eval_mode_trains_on_cuda():
    """cuDNN's RNN has no backward in eval mode: the fit trains such a layer without it."""
    X, _, Y, Q = _data()
    gpu, cpu = _fit_pair(lambda d: PathKernelMachine(
        module=_build(torch.nn.LSTM, built_in_eval=True), device=d, dtype="float64",
        solver="adam", learning_rate_init=0.02, batch_size=8, max_iter=2, tol=None,
        random_state=0), X, Y[:, 0])
    _same_path(gpu, cpu)
    _same_decomposition(gpu, cpu, Q)
    assert torch.backends.cudnn.enabled


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_check_rule_of_a_recurrent_module_in_eval_mode_on_cuda(cell):
    module = _Sequence(2, cell).double().eval().cuda()
    X = torch.randn(6, 8, dtype=torch.float64, device="cuda")
    assert check_rule(module, X) < 1e-8
    assert torch.backends.cudnn.enabled
