"""Attention's inference fast path off while a verb or a fit runs the network.

In eval mode, with no input that requires grad (``no_grad``, parameters that do not
require grad, forward-mode AD), ``nn.TransformerEncoder`` packs the sequences under a
``src_key_padding_mask`` into a nested tensor and returns zeros at the padded positions,
which the differentiable path computes like any other position. Training and every
gradient read the differentiable path: predictions and the decomposition's values must
read it too. The reference below is the module's own forward with gradients on.
"""

import threading

import numpy as np
import pytest
import torch
from joblib import parallel_config
from torch import nn

from skpathkernel import PathKernelMachine, PathRecorder
from skpathkernel._modules import _FASTPATH, fastpath_disabled

VOCAB, LENGTH = 12, 6


class _PaddedEncoder(nn.Module):
    """Token ids (0 pads) through a two-layer ``nn.TransformerEncoder`` with a padding
    mask, averaged over every position, pads included (the nested tensor's zeros then
    reach the output)."""

    def __init__(self, n_out, d=8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.1 * torch.randn(LENGTH, d))
        layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(d, n_out)

    def forward(self, ids):
        h = self.encoder(self.embed(ids) + self.pos, src_key_padding_mask=ids == 0)
        return self.head(h.mean(1))


def _padded_ids(n, seed):
    rng = np.random.RandomState(seed)
    X = np.zeros((n, LENGTH), dtype=np.int64)
    for i, length in enumerate(rng.randint(2, LENGTH, size=n)):  # every row padded
        X[i, :length] = rng.randint(1, VOCAB, length)
    return X


def _differentiable_forward(module, X):
    """The path training differentiates: gradients on, parameters requiring grad."""
    with torch.enable_grad():
        return module(torch.as_tensor(X)).detach().numpy()


@pytest.fixture(scope="module")
def fitted():
    X = _padded_ids(24, 0)
    y = np.array([x[x > 0].mean() / VOCAB for x in X])
    est = PathKernelMachine(module=lambda n_in, n_out: _PaddedEncoder(n_out), solver="adam",
                            learning_rate_init=0.01, batch_size=8, max_iter=2, tol=None,
                            normalize_y=False, dtype="float64", random_state=0)
    return est.fit(X, y), _padded_ids(4, 1)


def test_fixture_takes_the_nested_fast_path(fitted):
    # The premise: torch's own inference differs from the differentiable path here.
    est, X_query = fitted
    with torch.no_grad():
        fast = est.module_(torch.as_tensor(X_query)).numpy()
    assert np.abs(fast - _differentiable_forward(est.module_, X_query)).max() > 1e-3


def test_predict_and_decomposition_read_the_trained_function(fitted):
    est, X_query = fitted
    reference = _differentiable_forward(est.module_, X_query)[:, 0]
    np.testing.assert_allclose(est.predict(X_query), reference, rtol=0, atol=1e-12)
    res = est.decompose(X_query)
    np.testing.assert_allclose(res.prediction[:, 0], reference, rtol=0, atol=1e-12)
    closure = res.initial + res.contributions.sum(axis=1) + res.regularization
    np.testing.assert_allclose(closure, res.prediction, rtol=0, atol=1e-10)
    # Forward-mode AD under vmap raised on the nested tensor.
    assert np.isfinite(est.decompose(X_query, method="second_order").error)
    assert torch.backends.mha.get_fastpath_enabled() and _FASTPATH["holders"] == 0


def test_worker_processes_read_the_trained_function(fitted):
    # The switch is a process's: loky's workers compute the queries' outputs too.
    est, _ = fitted
    X_query = _padded_ids(8, 4)  # enough queries to be split between the workers
    serial = est.decompose(X_query)
    with parallel_config(backend="loky"):
        split = est.decompose(X_query, n_jobs=2)
    assert split.error < 1e-10
    np.testing.assert_allclose(split.contributions, serial.contributions, rtol=0,
                               atol=1e-12)


def test_recorded_loop_decomposes_exactly():
    torch.manual_seed(0)
    X = _padded_ids(16, 2)
    y = torch.as_tensor(np.array([x[x > 0].mean() / VOCAB for x in X]))[:, None]
    model = _PaddedEncoder(1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with PathRecorder(model, optimizer, n_samples=len(X)) as recorder:
        for rows in np.split(np.arange(len(X)), 2):
            recorder.set_batch(rows)
            optimizer.zero_grad()
            (0.5 * (model(torch.as_tensor(X[rows])) - y[rows]).pow(2).mean()).backward()
            optimizer.step()
    model.eval()
    X_query = _padded_ids(3, 3)
    res = recorder.as_network(X, y.numpy()).decompose(X_query)
    np.testing.assert_allclose(res.prediction, _differentiable_forward(model, X_query),
                               rtol=0, atol=1e-12)
    assert res.error < 1e-10


def test_switch_is_counted_across_threads():
    # Overlapping blocks on two threads: off until the last one ends, then restored.
    entered, release = threading.Barrier(2), threading.Event()
    seen = []

    def block():
        with fastpath_disabled():
            entered.wait()
            release.wait()
            seen.append(torch.backends.mha.get_fastpath_enabled())

    first = threading.Thread(target=block)
    first.start()
    with fastpath_disabled():
        entered.wait()
        release.set()
        first.join()
        seen.append(torch.backends.mha.get_fastpath_enabled())
    assert seen == [False, False]
    assert torch.backends.mha.get_fastpath_enabled() and _FASTPATH["holders"] == 0


def test_a_verb_starting_on_another_thread_leaves_a_forward_whole(fitted):
    # The input checks ran the network before the verb took the switch: with the fast
    # path on, nn.TransformerEncoder packs the padded sequences into a nested tensor, and
    # a verb on another thread turning the switch off before the attention layer read
    # them made predict raise (3 threads predicting at once: 2 raised).
    est, X_query = fitted
    inside, go = threading.Event(), threading.Event()

    def hold(layer, args):
        if not inside.is_set():
            inside.set()
            go.wait(30)

    errors = []

    def predict():
        try:
            errors.append(np.abs(est.predict(X_query) - reference).max())
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    reference = _differentiable_forward(est.module_, X_query)[:, 0]
    handle = est.module_.encoder.layers[0].register_forward_pre_hook(hold)
    try:
        thread = threading.Thread(target=predict)
        thread.start()
        assert inside.wait(30)
        with fastpath_disabled():  # another verb starts
            go.set()
            thread.join()
    finally:
        go.set()
        handle.remove()
    assert len(errors) == 1 and not isinstance(errors[0], BaseException), errors
    assert errors[0] < 1e-12
    assert torch.backends.mha.get_fastpath_enabled() and _FASTPATH["holders"] == 0
