"""Small Grams (session s55): the autograd check on the Gram's own capture, and the
captures' passes counted per call."""

import copy

import pytest
import torch
from _reference import jacobian_loop
from torch import nn

from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import _capture, _gram, tangent_gram


class _Counted(nn.Module):
    """Linear-tanh-Linear (3 outputs) counting its forward passes and, by a hook on the
    hidden activation, the backward passes that reach it (a batched pass calls it once)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.forwards = 0
        self.backwards = 0

    def _count(self, grad):
        self.backwards += 1

    def forward(self, x):
        self.forwards += 1
        h = torch.tanh(self.l1(x))
        if h.requires_grad:
            h.register_hook(self._count)
        return self.l2(h)


class _SortedBy(nn.Module):
    """The batch sorted by its first feature (stable) before l1 and put back after it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        order = torch.sort(x[:, 0], stable=True).indices
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.l2(torch.tanh(self.l1(x[order])[back]))


def _reference_gram(module, params, X, Y=None):
    """Trace Gram from the per-sample autograd loop (tests/_reference.py), float64."""
    ref = copy.deepcopy(module).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
    J = jacobian_loop(ref, X.double())
    JY = J if Y is None else jacobian_loop(ref, Y.double())
    return torch.einsum("ncp,mcp->nm", J, JY) / J.shape[1]


def _close(a, b, rtol=1e-10):
    a, b = a.double(), b.double()
    assert float((a - b).abs().max() / b.abs().max()) <= rtol


R = _gram.OWN_CHECK_ROWS


@pytest.mark.parametrize("check, n, forwards",
                         [(True, 1, 3), (True, 2, 3), (True, 3, 3), (True, 4, 4),
                          (True, 8, 4), (True, R, 4), (True, R + 1, 4), (False, 1, 2),
                          (False, 4, 2), (False, 5, 3), (False, 8, 3), (False, R + 1, 3)])
def test_a_small_symmetric_gram_captures_its_rows_once(check, n, forwards):
    # The module's forward passes in one call. Checked: the output count (one row), the
    # capture of the rows x0..x_{n-1}, x0 and the autograd check's forward of them; their
    # first n rows are the Gram's block (a capture of X of its own before session s55:
    # 4). More than the check's four rows are captured so only where a capture of x0
    # says they fit the budget (_unplanned_fits): one more forward, 4. Over
    # OWN_CHECK_ROWS rows the check takes check_rows' cycle and X is captured apart.
    # Unchecked (a path's steps after hidden_reads): the output count and one capture of
    # X's rows, probe and block at once (3 before: the probe of x0 apart); over four
    # rows the capture of x0 first, 3.
    torch.manual_seed(0)
    module = _Counted().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(n, 4, dtype=torch.float64)
    module.forwards = 0
    K = tangent_gram(module, params, X, check_hidden=check)
    assert module.forwards == forwards
    _close(K, _reference_gram(module, params, X))


def test_the_small_captures_take_one_batched_backward_pass():
    # Three outputs over a few rows: their backprops in one batched pass (the tap's
    # backward runs once per pass, batched or not), then the check's batched pass.
    # One pass per output before session s55: three per capture, one for the check.
    torch.manual_seed(0)
    module = _Counted().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(5, 4, dtype=torch.float64)
    module.backwards = 0
    K = tangent_gram(module, params, X)
    # x0's capture (_unplanned_fits: six rows are more than the check's four), the
    # capture of x0..x4, x0, the check.
    assert module.backwards == 3
    _close(K, _reference_gram(module, params, X))
    # The sites' gradients of the captured rows x0..x4, x0 for the three outputs: 6 rows
    # of l1's 6 and l2's 3 outputs, float64. Over a 128th of the budget: one pass per
    # output again (x0's capture and the check's pass still batched).
    size = 3 * 6 * (6 + 3) * 8
    for budget, passes in [(128 * size, 3), (128 * size - 1, 1 + 3 + 1)]:
        module.backwards = 0
        _close(tangent_gram(module, params, X, memory_budget=budget),
               _reference_gram(module, params, X))
        assert module.backwards == passes


def test_a_one_query_cross_gram_reuses_the_checked_capture_of_its_row():
    # K(x, Y): the check's rows start with x (then Y's first rows), whose capture is the
    # row block's; Y's own block is captured as before.
    torch.manual_seed(0)
    module = _Counted().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X, Y = torch.randn(1, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    module.forwards = 0
    K = tangent_gram(module, params, X, Y)
    assert module.forwards == 4  # output count, check capture and forward, Y's capture
    _close(K, _reference_gram(module, params, X, Y))


def test_a_small_gram_checks_all_its_rows():
    # A sort whose key ties on the first two and the last samples leaves check_rows'
    # cycle x0, x1, x7, x0 in place: l1 kept its rule and the Gram paired sorted rows with
    # the samples (49% off with OWN_CHECK_ROWS = 0). The check of the Gram's own rows
    # x0..x7, x0 sees the sort: l1 goes to the fallback, the Gram is the loop's.
    torch.manual_seed(0)
    module = _SortedBy().double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(8, 3, dtype=torch.float64)
    X[:, 0] = torch.tensor([5.0, 5, 2, 8, 1, 9, 3, 5], dtype=torch.float64)
    assert _capture.check_rows(X, 2**30)[0][:, 0].tolist() == [5.0, 5, 5, 5]
    _close(tangent_gram(module, params, X), _reference_gram(module, params, X))
    probe = _gram._prepared(module, params, X, "trace", 2**30, own=True)[3]
    assert "l1.weight" in probe.fallback


def test_own_check_rows_are_a_cycle_of_all_rows():
    X = torch.arange(6.0)[:, None]
    assert _gram._own_check_rows(X, 2**20)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert _gram._own_check_rows(X[:1], 2**20)[:, 0].tolist() == [0]
    # Another axis of the cycle's length, copies over an eighth of the budget, or more
    # rows than OWN_CHECK_ROWS: check_rows' cycle instead.
    assert _gram._own_check_rows(X.expand(6, 7), 2**20) is None
    budget = 8 * _capture._CHECK_COPIES * 7 * 4
    assert _gram._own_check_rows(X, budget) is not None
    assert _gram._own_check_rows(X, budget - 1) is None
    assert _gram._own_check_rows(torch.zeros(_gram.OWN_CHECK_ROWS + 1, 1), 2**20) is None


def test_a_small_batched_pass_sums_batchnorm_sites(monkeypatch):
    # An eval BatchNorm not on a convolution's output (not folded) has its site's
    # backprops summed as they come (_ChannelSums): in a small capture's batched pass,
    # every output's at once. The Gram is still the per-sample loop's.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.Flatten(),
                           nn.Linear(64, 3))
    module[2].running_mean.normal_()
    module[2].running_var.uniform_(0.5, 2)
    module = module.eval().double()
    params = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in module.named_parameters()}
    X = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    summed = []
    real = _capture._batched_into
    monkeypatch.setattr(_capture, "_batched_into",
                        lambda out, seeds, zs, sums=None: summed.append(len(sums or {}))
                        or real(out, seeds, zs, sums))
    _close(tangent_gram(module, params, X), _reference_gram(module, params, X))
    assert summed and all(s == 1 for s in summed)


class _RepeatedActivations(nn.Module):
    """A graph 800 times its factors (tests/test_memory.py's): about 1 MiB a row."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 16).double()

    def forward(self, x):
        return torch.exp(torch.sin(torch.tanh(self.lin(x).repeat(1, 2048)))).sum(1, keepdim=True)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("n", [8, R])
def test_a_small_grams_own_capture_keeps_within_the_budget(check, n):
    # The own rows were captured before any plan, at any budget: 16 rows of this network
    # peaked at 21 MiB (20 unchecked) with a budget of 8 MiB. Now more than the check's
    # four rows only where x0's capture says they fit; else the planned blocks.
    torch.manual_seed(0)
    net = _RepeatedActivations()
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = torch.randn(n, 4, dtype=torch.float64)
    budget = 8 * 2**20
    tangent_gram(net, params, X[:3], memory_budget=budget)  # one-time allocations
    K, peak = cpu_peak_bytes(lambda: tangent_gram(net, params, X, memory_budget=budget,
                                                  check_hidden=check))
    assert peak <= budget, (peak, budget)
    _close(K, _reference_gram(net, params, X))
