"""cuDNN off around the analyses of a recurrent network on CUDA, on the CPU.

torch's cuDNN RNN kernels have no backward in eval mode, no double backward and no vmap
rule, so every analysis of a fitted LSTM / GRU on a GPU turns cuDNN off
(``torch.backends.cudnn.enabled``, a switch of the process) while it runs. These tests
run where no GPU is: the package's own device checks (``_modules._cuda_in_use``,
``_modules._on_cuda``) are patched to call the CPU's parameters CUDA's, and the network
records the switch at every forward pass. The GPU's numbers are tests/test_cuda_rnn.py's.
"""

import threading

import numpy as np
import pytest
import torch
from joblib import parallel_config
from torch.nn.utils.parametrizations import weight_norm

from skpathkernel import PathKernelMachine, _modules, rules
from skpathkernel._analysis import _decomposition
from skpathkernel._modules import cudnn_disabled, running
from skpathkernel._parallel import map_calls

# The switch as each forward pass of the networks below saw it; TRAINED: those of the
# training steps (in training mode, with gradients: a fit's probes and losses run
# without, its check of the tangent routes in eval mode).
SEEN, TRAINED = [], []


class _Recurrent(torch.nn.Module):
    """(n, 6) features as 3 steps of 2 through an LSTM (or a Linear, ``rnn=False``), a
    head on the last step; records ``torch.backends.cudnn.enabled`` at each forward."""

    def __init__(self, n_out, rnn=True, built_in_eval=False):
        super().__init__()
        self.rnn = torch.nn.LSTM(2, 3, batch_first=True) if rnn else torch.nn.Linear(2, 3)
        self.head = torch.nn.Linear(3, n_out)
        if built_in_eval:
            self.rnn.eval()

    def forward(self, x):
        SEEN.append(torch.backends.cudnn.enabled)
        if torch.is_grad_enabled() and self.training:
            TRAINED.append(torch.backends.cudnn.enabled)
        x = x.reshape(-1, 3, 2)
        h = self.rnn(x)[0] if isinstance(self.rnn, torch.nn.RNNBase) else torch.tanh(
            self.rnn(x))
        return self.head(h[:, -1])


def _fit(**module_kw):
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 6))
    y = np.sin(2 * X[:, 0]) + X[:, 3]

    def build(n_features, n_outputs):
        return _Recurrent(n_outputs, **module_kw)

    est = PathKernelMachine(module=build, solver="adam", learning_rate_init=0.05,
                            batch_size=6, max_iter=2, dtype="float64", tol=None,
                            random_state=0).fit(X, y)
    return est, X


@pytest.fixture
def on_cuda(monkeypatch):
    """The package's checks call every tensor CUDA's (a GPU's fit, seen from the CPU)."""
    monkeypatch.setattr(_modules, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(_modules, "_on_cuda", lambda tensor: True)
    SEEN.clear()
    TRAINED.clear()
    yield
    SEEN.clear()
    TRAINED.clear()


def _analyse(est, X):
    Q = X[:3] + 0.1
    est.decompose(Q)
    est.explain(Q, n_neighbors=3)  # calls attribute, which calls decompose and outputs
    est.tangent_kernel_(Q, X)
    est.path_kernel_(Q)
    est.attribute(Q, method="unrolled")
    est.predict(Q)


def test_analyses_of_a_recurrent_network_on_cuda_run_without_cudnn(on_cuda):
    est, X = _fit()
    assert TRAINED and all(TRAINED)  # training mode has a backward: the steps keep cuDNN
    # The fit's check of the tangent routes (its FallbackWarning) runs the fitted
    # module in eval mode with a backward: without cuDNN.
    assert False in SEEN
    SEEN.clear()
    _analyse(est, X)
    assert SEEN and not any(SEEN)
    assert torch.backends.cudnn.enabled and _modules._CUDNN["holders"] == 0


def test_a_network_without_rnn_or_on_the_cpu_keeps_cudnn(on_cuda, monkeypatch):
    est, X = _fit(rnn=False)  # convolutions and the rest keep cuDNN's speed
    _analyse(est, X)
    est, X = _fit()
    monkeypatch.setattr(_modules, "_on_cuda", lambda tensor: tensor.is_cuda)  # CPU's
    SEEN.clear()
    _analyse(est, X)
    assert SEEN and all(SEEN)


def test_a_recurrent_layer_built_in_eval_mode_trains_without_cudnn(on_cuda):
    """cuDNN's RNN has no backward in eval mode: such a fit on CUDA raised at its first
    step. Without cuDNN there for the training; restored after."""
    est, X = _fit(built_in_eval=True)
    assert TRAINED and not any(TRAINED)
    assert torch.backends.cudnn.enabled and _modules._CUDNN["holders"] == 0


def test_cudnn_switch_is_counted_across_nested_verbs_threads_and_errors(on_cuda):
    first, second = torch.nn.LSTM(2, 3), torch.nn.LSTM(2, 3)
    entered, leave = threading.Event(), threading.Event()
    errors = []

    def other():
        try:
            with running(second):
                entered.set()
                leave.wait(10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for before in (True, False):
        torch.backends.cudnn.enabled = before
        try:
            with running(first):
                assert not torch.backends.cudnn.enabled
                with running(first):  # a verb another calls
                    assert not torch.backends.cudnn.enabled
                assert not torch.backends.cudnn.enabled
                thread = threading.Thread(target=other)
                thread.start()
                assert entered.wait(10)
            # The other thread's verb still runs: the switch stays off under it.
            assert not torch.backends.cudnn.enabled
            leave.set()
            thread.join(10)
            assert not errors
            assert torch.backends.cudnn.enabled is before
            with pytest.raises(ZeroDivisionError), running(first):
                raise ZeroDivisionError
            assert torch.backends.cudnn.enabled is before
            assert _modules._CUDNN["holders"] == 0
        finally:
            torch.backends.cudnn.enabled = True
            entered.clear()
            leave.clear()


def test_worker_processes_run_without_cudnn_where_the_caller_does():
    """A verb's tasks on loky processes run there without cuDNN too: the switch is the
    caller's process's, which a worker process does not share."""
    probe = torch._C._get_cudnn_enabled  # a builtin: pickled by reference
    with parallel_config(backend="loky"):
        assert map_calls(probe, 2, [(), ()]) == [True, True]
        with cudnn_disabled():
            assert map_calls(probe, 2, [(), ()]) == [False, False]
    assert torch.backends.cudnn.enabled


class _Cells(torch.nn.Module):
    """(n, 6) features as 3 steps of 2 through a loop of a GRU cell, a head on its last
    state: torch's cells never use cuDNN, but run as fused cells on CUDA too."""

    def __init__(self, n_out):
        super().__init__()
        self.cell = torch.nn.GRUCell(2, 3)
        self.head = torch.nn.Linear(3, n_out)

    def forward(self, x):
        h = None
        for step in x.reshape(-1, 3, 2).unbind(1):
            h = self.cell(step, h)
        return self.head(h)


@pytest.mark.parametrize("cells", [False, True])
def test_second_order_decomposition_of_recurrent_layers_on_cuda_by_reverse_mode(
        monkeypatch, cells):
    """On CUDA torch runs LSTM / GRU (without cuDNN) and its cells as fused cells, which
    have no forward-mode derivative: the second-order decomposition's products there are
    two reverse passes (``_jvp_by_reverse``), the same as forward over reverse."""
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(12, 6))
    Y = np.c_[np.sin(2 * X[:, 0]) + X[:, 3], X[:, 1] * X[:, 4]]

    def build(n_features, n_outputs):
        return _Cells(n_outputs) if cells else _Recurrent(n_outputs)

    est = PathKernelMachine(module=build, solver="adam", learning_rate_init=0.05,
                            batch_size=6, max_iter=2, dtype="float64", tol=None,
                            random_state=0).fit(X, Y)
    Q = X[:3] + 0.1
    want = est.decompose(Q, method="second_order")  # forward over reverse, on the CPU
    first = est.decompose(Q, method="first_order").contributions
    calls = []
    reverse = _decomposition._jvp_by_reverse

    def counted(*args):
        calls.append(1)
        return reverse(*args)

    monkeypatch.setattr(_decomposition, "_jvp_by_reverse", counted)
    monkeypatch.setattr(_modules, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(_modules, "_on_cuda", lambda tensor: True)
    got = est.decompose(Q, method="second_order")
    assert calls
    curvature = np.abs(want.contributions - first).max()
    assert curvature > 1e-6 * np.abs(first).max()  # the products are not nothing
    np.testing.assert_allclose(got.contributions, want.contributions, rtol=0,
                               atol=1e-12 * np.abs(want.contributions).max())
    np.testing.assert_allclose(got.prediction, want.prediction, rtol=1e-12)


def test_public_rule_checks_of_a_recurrent_module_on_cuda_run_without_cudnn(on_cuda):
    """layer_routes and check_rule (public) run the module with a backward, in its own
    mode: an LSTM in eval mode on CUDA raised in cuDNN's backward."""
    module = _Recurrent(2).double().eval()
    X = torch.randn(5, 6, dtype=torch.float64)
    rules.layer_routes(module, X)
    assert SEEN and not any(SEEN)
    SEEN.clear()
    assert rules.check_rule(module, X) < 1e-8
    assert SEEN and not any(SEEN)
    assert torch.backends.cudnn.enabled and _modules._CUDNN["holders"] == 0


def test_a_parametrized_recurrent_layer_counts_as_recurrent_on_cuda(on_cuda):
    """A recurrent layer whose weights are all parametrized (weight norm, no bias) holds
    its parameters in its parametrizations, none of its own: the scan found no recurrent
    layer on CUDA, and the analyses ran it with cuDNN, which raises on a GPU."""
    lstm = torch.nn.LSTM(2, 3, bias=False)
    for name in ("weight_ih_l0", "weight_hh_l0"):
        weight_norm(lstm, name)
    assert not list(lstm.parameters(recurse=False))
    module = torch.nn.Sequential(torch.nn.ModuleList([lstm]))
    assert _modules.recurrent_on_cuda(module)
    with running(module):
        assert not torch.backends.cudnn.enabled
    assert torch.backends.cudnn.enabled


def test_public_rule_checks_take_their_module_by_keyword(on_cuda):
    """rules.layer_routes(module=..., X=...) and check_rule(module=..., X=...): the
    wrapper that runs them as verbs took the module positionally only, and raised
    "missing 1 required positional argument: 'self'"."""
    module = _Recurrent(2).double().eval()
    X = torch.randn(5, 6, dtype=torch.float64)
    routes = rules.layer_routes(module=module, X=X)
    assert [r.name for r in routes] == [r.name for r in rules.layer_routes(module, X)]
    assert rules.check_rule(module=module, X=X, rtol=1e-8) < 1e-8
    assert SEEN and not any(SEEN)  # run as the verbs run: without cuDNN
    assert torch.backends.cudnn.enabled and _modules._CUDNN["holders"] == 0
