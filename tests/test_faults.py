"""Faults: divergence, a missing GPU, and memory budgets (API.md, "Errors and bad input").

Every estimator that trains a network stops a diverging fit with an error naming the step
and keeps its previous fit; device="cuda" without CUDA is a clear error; computations
give the same numbers in small blocks as in large ones, and one whose single row does not
fit the budget says so, with the bytes, before any work.
"""

import copy
import re

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from sklearn.frozen import FrozenEstimator
from test_bad_input import ESTIMATORS, X, assert_unchanged, snapshot

import skpathkernel._analysis._decomposition as decomposition_module
import skpathkernel._tangent as tangent_module
from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
)
from skpathkernel._path._training import TrainingDivergedError
from skpathkernel.diagnostics import hessian_trace

# The old defaults, pinned: the tests below restore them after provoking a fault.
SMALL = dict(hidden_layer_sizes=(4,), max_iter=3, random_state=0, solver="sgd",
             learning_rate_init=0.01, activation="tanh", batch_size=None, tol=None)
ALL = tuple(ESTIMATORS)


def _fit(name, **params):
    make, y, _ = ESTIMATORS[name]
    return make(**{**SMALL, **params}).fit(X, y)


def _trainer(est):
    """Where the training parameters are set: the trainer, or a meta-estimator's."""
    return getattr(est, "estimator", None) or est


class _NaNAfter(torch.nn.Module):
    """A small MLP whose output turns NaN at its ``k``-th training forward pass."""

    def __init__(self, n_in, n_out, k):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(n_in, 4), torch.nn.Tanh(),
                                       torch.nn.Linear(4, n_out))
        self.k, self.calls = k, 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls > self.k:
                out = out * float("nan")
        return out


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("k", [0, 4, 7])
def test_divergence_at_any_step_names_it_and_keeps_the_previous_fit(name, k):
    est = _fit(name)
    before = snapshot(est)
    # 12 samples in batches of 5: three steps per epoch, so step k is in epoch k // 3.
    _trainer(est).set_params(module=lambda n_in, n_out: _NaNAfter(n_in, n_out, k),
                             batch_size=5, max_iter=4)
    # Step 0's loss is the initial network's, before any update: not the step size's doing.
    cause = "initial parameters" if k == 0 else "smaller learning_rate_init"
    with pytest.raises(TrainingDivergedError,
                       match=rf"optimizer step {k} \(epoch {k // 3}\).*{cause}"):
        # New data with another number of features: nothing of it may stay either.
        est.fit(np.hstack([X, X]), ESTIMATORS[name][1])
    _trainer(est).set_params(module=None, batch_size=None, max_iter=SMALL["max_iter"])
    assert_unchanged(est, before)


@pytest.mark.parametrize("name", ALL)
def test_a_huge_learning_rate_diverges_with_a_clear_error(name):
    est = _fit(name)
    before = snapshot(est)
    loss = _trainer(est).loss
    # Squared error: its gradient grows with the output, so the parameters blow up
    # (the log-loss gradient is bounded and would only drift).
    _trainer(est).set_params(learning_rate_init=1e8, activation="identity", max_iter=30,
                             loss="squared_error")
    with pytest.raises(TrainingDivergedError, match="smaller learning_rate_init.*1e\\+08"):
        est.fit(X * 1e3, ESTIMATORS[name][1])
    _trainer(est).set_params(learning_rate_init=0.01, activation="tanh",
                             max_iter=SMALL["max_iter"], loss=loss)
    assert_unchanged(est, before)


@pytest.mark.parametrize("name", ALL)
def test_cuda_without_cuda_is_a_clear_error_for_every_estimator(name, monkeypatch):
    est = _fit(name, device="cpu")
    before = snapshot(est)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _trainer(est).set_params(device="cuda")
    with pytest.raises(ValueError, match="device='cuda' was requested.*no CUDA device"):
        est.fit(X, ESTIMATORS[name][1])
    _trainer(est).set_params(device="cpu")
    assert_unchanged(est, before)


# --------------------------------------------------------------------------- budgets
TINY = 4096  # bytes: blocks of a few rows for these networks, below fit's 1 MiB minimum


def _with_budget(est, budget):
    other = copy.copy(est)
    other.memory_budget = budget
    return other


@pytest.fixture(scope="module")
def machine():
    rng = np.random.RandomState(1)
    Xm = rng.normal(size=(30, 2))
    y = np.column_stack([np.sin(Xm[:, 0]), Xm[:, 1]])
    est = PathKernelMachine(hidden_layer_sizes=(6,), solver="adam", max_iter=4,
                            batch_size=10, dtype="float64", random_state=0).fit(Xm, y)
    return est, Xm


def test_tiny_budget_gives_the_same_numbers(machine, monkeypatch):
    est, Xm = machine
    small = _with_budget(est, TINY)
    # The engine really works in small blocks: count its captures.
    calls = []
    capture = tangent_module._gram.capture

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return capture(*args, **kwargs)

    for f in (lambda e: e.predict(Xm), lambda e: e.transform(Xm),
              lambda e: TangentKernel(e)(Xm), lambda e: TangentKernel(e).diag(Xm),
              lambda e: PathKernel(e)(Xm[:7], Xm), lambda e: PathKernel(e, output=1)(Xm),
              lambda e: e.kneighbors(Xm[:4], 5)[1],
              lambda e: hessian_trace(e, n_samples=3, random_state=0).trace):
        expected = f(est)
        with monkeypatch.context() as m:
            m.setattr(tangent_module._gram, "capture", counted)
            assert_allclose(f(small), expected, rtol=1e-10, atol=1e-12)
    assert 1 <= max(calls) < 10
    # decompose's exact method also keeps a query's outputs at every recorded point: one
    # query needs more than TINY. Just above the least budget it accepts, it works one
    # query at a time.
    least = _least_budget(lambda e: e.decompose(Xm[:3]), est)
    blocks = []
    factored_block = decomposition_module._factored_block

    def counted_block(ctx, Xq, *args, **kwargs):
        blocks.append(Xq.shape[0])
        return factored_block(ctx, Xq, *args, **kwargs)

    big = est.decompose(Xm[:3])
    with monkeypatch.context() as m:
        m.setattr(decomposition_module, "_factored_block", counted_block)
        tiny = _with_budget(est, least + 1).decompose(Xm[:3])
    assert blocks == [1, 1, 1]
    assert_allclose(tiny.contributions, big.contributions, rtol=1e-9, atol=1e-12)
    assert tiny.error < 1e-9


def _least_budget(f, est):
    """The least memory_budget at which ``f(est)`` runs, from the requirements its
    refusals state (each names the bytes one sample needs)."""
    budget = 1
    while True:
        try:
            f(_with_budget(est, budget))
            return budget
        except ValueError as error:
            need = re.search(r"Raise memory_budget to at least ([\d,]+)\.", str(error))
            assert need is not None, str(error)
            budget = int(need[1].replace(",", ""))


def test_decompose_counts_the_stored_outputs_and_refuses_below_its_need(machine):
    est, Xm = machine
    least = _least_budget(lambda e: e.decompose(Xm[:3]), est)
    # The least budget is stated for what it counts: a query and a batch row beside what
    # the call holds for all of its queries (not "a single sample" alone).
    with pytest.raises(ValueError, match=rf"needs {least:,} bytes for one query and one "
                                         rf"batch row beside what the call holds for its "
                                         rf"3 queries, more than "
                                         rf"memory_budget={least - 1:,} bytes"):
        _with_budget(est, least - 1).decompose(Xm[:3])
    # The same network trained for longer: only the outputs at the extra recorded points
    # (float64, one per output) add to what the call needs, for each of its 3 queries
    # (every query's outputs are held for the whole call: the check walks again).
    longer = copy.deepcopy(est).set_params(max_iter=8, tol=None).fit(Xm, est.predict(Xm))
    extra = len(longer.trajectory_) - len(est.trajectory_)
    assert extra > 0
    n_out = est.predict(Xm[:1]).shape[1]
    assert (_least_budget(lambda e: e.decompose(Xm[:3]), longer)
            == least + 3 * 8 * n_out * extra)


@pytest.mark.parametrize("method", ["residual", "alignment", "local"])
def test_tiny_budget_gives_the_same_ood_scores(method):
    rng = np.random.RandomState(2)
    Xo = rng.normal(size=(25, 2))
    # More parameters (65) than points: the span has full rank N and does not depend on
    # which pivots the blocks pick (at rank saturation the residuals are round-off).
    net = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=3, dtype="float64",
                            random_state=0).fit(Xo, Xo[:, 0])
    # N = 25 points at 32 bytes per Gram entry: 5 columns of Gram rows per pass ("local");
    # the factorising methods' 25 pivots need 43,800 bytes (leverage_bytes: a max_rank
    # beyond the budget is capped by it), and pivot in blocks of 15 columns within 48 kB.
    small = _with_budget(net, 32 * 25 * 5 if method == "local" else 48_000)
    Xq = rng.normal(size=(9, 2)) * 3
    # local: 5 neighbours, so that groups of queries share a union of at most 11 points.
    kw = dict(method=method, contamination=0.2, max_rank=25, n_neighbors=5)
    big = OODRankDetector(FrozenEstimator(net), **kw).fit(Xo)
    tiny = OODRankDetector(FrozenEstimator(small), **kw).fit(Xo)
    if method != "local":  # the only one without a factorisation
        assert tiny.rank_ == big.rank_
    assert_allclose(tiny.score_samples(Xq), big.score_samples(Xq), atol=1e-7)
    assert abs(tiny.offset_ - big.offset_) < 1e-6


def _boom(*args, **kwargs):
    raise AssertionError("the computation started")


def test_a_row_larger_than_the_budget_is_refused_before_any_work(machine):
    est, Xm = machine
    P = est.n_params_
    small = _with_budget(est, 2 * 8 * P - 1)  # two outputs of P float64 values: 16 P bytes
    # Any tangent feature or decomposition runs the module: refused before it does.
    hook = small.module_.register_forward_pre_hook(_boom)
    try:
        for call in (lambda: small.transform(Xm), lambda: small.decompose(Xm[:2])):
            with pytest.raises(ValueError, match=rf"needs {16 * P:,} bytes for a single "
                                                 r"sample, more than memory_budget="):
                call()
    finally:
        hook.remove()
    tiny = _with_budget(est, 100)
    hook = tiny.module_.register_forward_pre_hook(_boom)
    try:
        with pytest.raises(ValueError, match=r"Prediction needs [\d,]+ bytes"):
            tiny.predict(Xm)
    finally:
        hook.remove()
    with pytest.raises(ValueError, match=r"hessian_trace needs [\d,]+ bytes"):
        hessian_trace(tiny, n_samples=2)


def test_ood_that_cannot_fit_the_budget_says_so_with_bytes():
    rng = np.random.RandomState(3)
    Xo = rng.normal(size=(40, 2))
    net = PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, dtype="float64",
                            random_state=0).fit(Xo, Xo[:, 0])
    det = OODRankDetector(FrozenEstimator(net)).fit(Xo)
    hook = net.module_.register_forward_pre_hook(_boom)  # no Gram started
    try:
        with pytest.raises(ValueError, match=r"fit \(40 training points\) needs 1,280 bytes"):
            OODRankDetector(FrozenEstimator(_with_budget(net, 1000))).fit(Xo)
    finally:
        hook.remove()
    with pytest.raises(ValueError, match=r"rank_gap needs .* 29,768 bytes .*memory_budget="):
        OODRankDetector(FrozenEstimator(_with_budget(net, 2**16))).fit(Xo[:30]).rank_gap(
            Xo[:31])
    before = det.score_samples(Xo[:3])
    det.estimator_.memory_budget = 8
    with pytest.raises(ValueError, match="bytes for a single sample"):
        det.score_samples(Xo[:3])
    det.estimator_.memory_budget = 2**30
    assert_allclose(det.score_samples(Xo[:3]), before)


@pytest.mark.parametrize("make", [
    PathKernelClassifier,
    lambda **kw: TangentFeatures(PathKernelClassifier(**kw)),
    lambda **kw: TangentFeatureSVM(PathKernelClassifier(**kw)),
])
def test_float32_overflowing_training_data_is_refused_not_diverged(make):
    y = np.resize([0, 1], len(X))
    with pytest.raises(ValueError, match="too large for the network's dtype float32"):
        make(**SMALL).fit(X * 1e300, y)
    make(**SMALL, dtype="float64").fit(X * 1e30, y)  # float64 holds it
