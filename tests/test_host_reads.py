"""A fit reads its tensors' values on the host a few times per epoch, never per step.

On a GPU each such read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``) waits for every kernel queued before it, so a read per step keeps the CPU from
queueing the next step while the GPU runs this one. Counted here on the CPU
(``benchmarks.bench_fit_syncs.host_reads``): a
``TorchDispatchMode`` sees the dispatched ops that read a value (``_local_scalar_dense``,
behind ``.item()`` / ``float`` / ``bool``; ``nonzero`` and the other ops whose result's
size depends on values), and ``Tensor.tolist`` / ``Tensor.cpu``, which dispatch nothing on
the CPU, are counted by wrapping them. The reference is the fit's own epoch count: the
stopping rule reads the epoch's loss once an epoch, and the rest is per fit. The CUDA
version (the synchronizations themselves) is in test_cuda.py.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from numpy.testing import assert_array_equal

from benchmarks.bench_fit_syncs import host_reads
from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._path._training import Resume
from skpathkernel._path._trajectory import TrajectoryRecorder


def _count_reads(fit):
    """``fit()``, the host reads it made (dispatched ones, and tolist / cpu calls) outside
    ``Resume.capture``, and the captures: each reads the optimizer's state to the host
    where it is taken (per fit, and per best epoch under early stopping), when the
    epoch's loss and score were just read and the GPU has nothing left to run."""
    captured = []
    capture = Resume.capture.__func__

    def counted(cls, *args, **kwargs):
        out, counts = host_reads(lambda: capture(cls, *args, **kwargs))
        captured.append(counts["syncs"] + counts["tolist"] + counts["cpu"])
        return out

    with mock.patch.object(Resume, "capture", classmethod(counted)):
        est, counts = host_reads(fit)
    return est, counts["syncs"] + counts["tolist"] + counts["cpu"] - sum(captured), \
        len(captured)


def _regression(n=200, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5))
    return X, np.sin(X[:, 0]) + X[:, 1] * X[:, 2]


def _classification(n=200, seed=0):
    X, _ = _regression(n, seed)
    return X, (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5).astype(int)


# Sixteen rows a step: 13 steps an epoch (12 of early stopping's 180 training rows).
_CASES = {
    "regressor, adam": lambda: PathKernelMachine(
        batch_size=16, max_iter=6, random_state=0).fit(*_regression()),
    "classifier, adam": lambda: PathKernelClassifier(
        batch_size=16, max_iter=6, random_state=0).fit(*_classification()),
    "early stopping": lambda: PathKernelClassifier(
        batch_size=16, max_iter=6, early_stopping=True, random_state=0).fit(
            *_classification()),
    "sgd, nesterov, adaptive": lambda: PathKernelMachine(
        solver="sgd", momentum=0.9, learning_rate="adaptive", learning_rate_init=0.01,
        n_iter_no_change=1, tol=0.5, batch_size=16, max_iter=6, random_state=0).fit(
            *_regression()),
    "sample_weight, rmsprop": lambda: PathKernelMachine(
        solver="rmsprop", batch_size=16, max_iter=6, random_state=0).fit(
            *_regression(), sample_weight=np.linspace(0.5, 2.0, 200)),
}


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("case", list(_CASES))
def test_a_fit_reads_values_per_epoch_not_per_step(case):
    fit = _CASES[case]
    fit()  # what the first fit of a process does once (imports, first calls)
    est, reads, captures = _count_reads(fit)
    epochs = len(est.loss_curve_)
    assert est.t_ >= 12 * epochs  # the steps a read per step would add
    # Per epoch: the epoch's loss (and early stopping's validation score, its outputs to
    # the host); per fit: the initial norm and loss, the batch sizes, the final
    # parameters' check, the optimizer's state and the recorded step counts.
    assert reads <= 2 * epochs + 10, (reads, epochs, est.t_)
    assert captures <= epochs + 1, (captures, epochs)


def test_partial_fit_reads_values_a_few_times_a_call():
    X, y = _regression()
    est = PathKernelMachine(batch_size=16, random_state=0)
    est.partial_fit(X, y)
    _, reads, captures = _count_reads(lambda: [est.partial_fit(X, y) for _ in range(3)])
    assert reads <= 3 * 8, reads  # 13 steps a call
    assert captures == 3


def test_step_counts_read_in_batches_are_the_optimizers(monkeypatch):
    """The recorder keeps the optimizer's step counts on their device and reads them
    together: across several such reads (4 counts each), and across a continued fit, the
    recorded counts are Adam's, which counts its steps from 1 along the whole path."""
    monkeypatch.setattr(TrajectoryRecorder, "_MAX_PENDING_COUNTS", 4)
    X, y = _regression(60)
    est = PathKernelMachine(batch_size=16, max_iter=3, tol=None, warm_start=True,
                            random_state=0).fit(X, y)
    assert_array_equal(est.trajectory_._state_steps, np.arange(1, 13))
    est.fit(X, y)  # three more epochs, continuing the path and Adam's count
    traj = est.trajectory_
    assert_array_equal(traj._state_steps, np.arange(1, 25))
    assert [float(traj.optimizer_state(k)["step"]) for k in (0, 11, 12, 23)] == [
        1.0, 12.0, 13.0, 24.0]


def snapshot_is_a_copy(device) -> list:
    """Early stopping's snapshot of the best epoch (``Resume.capture``) holds the values of
    the moment it was taken, not of later steps (fused Adam's step counts are views of
    one tensor that every step updates in place); returns its arrays."""
    device = torch.device(device)
    net = torch.nn.Linear(16, 16).to(device)
    opt = torch.optim.Adam(net.parameters(), fused=True)

    def step():
        opt.zero_grad()
        net(torch.ones(8, 16, device=device)).square().sum().backward()
        opt.step()

    step()
    want = {i: {k: v.detach().cpu().numpy().copy() if torch.is_tensor(v) else v
                for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    snapshot = Resume.capture(opt, torch.Generator(), learning_rate=1e-3, samples_seen=8,
                              rule=(), first_loss=1.0, initial_norm=1.0, device=device)
    step()  # moves every tensor the snapshot copied
    for i, state in want.items():
        for key, value in state.items():
            assert_array_equal(snapshot.optimizer_state[i][key], value)
            assert not np.array_equal(opt.state_dict()["state"][i][key].cpu(), value)
    return [v for s in snapshot.optimizer_state.values() for v in s.values()]


def test_best_epoch_snapshot_is_a_host_copy():
    assert all(isinstance(v, np.ndarray) for v in snapshot_is_a_copy("cpu"))
