"""CUDA against the CPU: what a user does with device="cuda" gives the CPU's numbers.

Every public estimator is fitted twice, on the GPU and on the CPU, with the same seed and
data, and everything it returns is compared: predictions, the recorded path, and the
verbs (decompose, attribute, explain, kneighbors, self_influence, the kernels). The test
files of the engine (test_rules.py), the Hessian probes (test_diagnostics.py) and the
unrolled attribution (test_unrolled.py) hold the other CUDA tests.

Tolerances. In float64 the two devices differ only in the order in which cuBLAS and the
CPU's BLAS sum their products: about 1e-15 relative per product of these tiny widths
(at most 64 terms), grown by at most a few orders over the ten-odd training steps. RTOL64
= 1e-9 leaves that margin, while a float32 tensor slipping into the float64 path (1e-7
relative), a wrong step or a shifted batch (1e-2 and more) fails it. Outputs that are
near zero (a decomposition's small contributions, kernel entries of nearly orthogonal
features) are compared with ATOL64 = 1e-12 times the scale of what they sum to. Float32
fits (FP32 products on both devices, ~6e-8 per operation) are held to 1e-4 after the
same ten steps.

Run on a GPU with ``bash benchmarks/device_check.sh``; without CUDA every test is skipped.
"""

import pickle
import warnings

import numpy as np
import pytest
import torch
from test_host_reads import snapshot_is_a_copy

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel.kernels import PathKernel, TangentKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = "cuda"
RTOL64, ATOL64 = 1e-9, 1e-12
RTOL32, ATOL32 = 1e-4, 1e-5


def _data(n=40, n_classes=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    angle = np.arctan2(X[:, 1], X[:, 0])
    y = np.floor((angle + np.pi) / (2 * np.pi) * n_classes).astype(int) % n_classes
    Y = np.column_stack([np.sin(2 * X[:, 0]) + X[:, 1], X[:, 0] * X[:, 1]])
    return X, y, Y, rng.normal(size=(6, 2)) * 1.5


def _close(got, want, rtol=RTOL64, atol=ATOL64, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


def _pair(make):
    """The same estimator fitted on the GPU and on the CPU."""
    return make(CUDA), make("cpu")


def _same_path(gpu, cpu, rtol=RTOL64, atol=ATOL64):
    tg, tc = gpu.trajectory_, cpu.trajectory_
    assert len(tg) == len(tc) and tg.n_params == tc.n_params
    np.testing.assert_array_equal(tg.steps, tc.steps)
    _close(tg.learning_rates, tc.learning_rates, rtol, atol, "learning_rates")
    # The batches are drawn on the CPU from random_state: the same samples on both devices.
    assert len(tg.batches) == len(tc.batches)
    for bg, bc in zip(tg.batches, tc.batches):
        np.testing.assert_array_equal(bg, bc)
    for k in range(len(tc)):
        _close(tg.parameters(k).cpu().numpy(), tc.parameters(k).cpu().numpy(), rtol, atol,
               f"recorded point {k}")
    _close(gpu.loss_curve_, cpu.loss_curve_, rtol, atol, "loss_curve_")


def _same_decomposition(gpu, cpu, X, **kw):
    a, b = gpu.decompose(X, **kw), cpu.decompose(X, **kw)
    for name in ("initial", "contributions", "regularization", "prediction"):
        _close(getattr(a, name), getattr(b, name), what=f"decompose {kw} {name}")
    if kw.get("method", "exact") == "exact":
        # Exact on the GPU too: the parts sum to the network's output.
        assert a.error < 1e-10 * max(1.0, float(np.max(np.abs(a.prediction))))


def _same_explanation(gpu, cpu, Q, n_neighbors):
    ig, cg = gpu.explain(Q, n_neighbors=n_neighbors)
    ic, cc = cpu.explain(Q, n_neighbors=n_neighbors)
    np.testing.assert_array_equal(ig, ic)
    _close(cg, cc, what="explain")


def _same_kernels(gpu, cpu, X, Q):
    for attr in ("tangent_kernel_", "path_kernel_"):
        _close(getattr(gpu, attr)(Q, X), getattr(cpu, attr)(Q, X), what=attr)
        _close(getattr(gpu, attr)(Q), getattr(cpu, attr)(Q), what=f"{attr} (X, None)")
    for kernel in ("tangent", "path"):
        dg, ig = gpu.kneighbors(Q, n_neighbors=5, kernel=kernel)
        dc, ic = cpu.kneighbors(Q, n_neighbors=5, kernel=kernel)
        np.testing.assert_array_equal(ig, ic)
        # sqrt(2 - 2 K_hat): an absolute error of the cosine, not relative to the distance.
        _close(dg, dc, rtol=1e-7, atol=1e-7, what=f"kneighbors {kernel}")


def _classifier(device, dtype="float64", **kw):
    params = dict(hidden_layer_sizes=(16,), solver="sgd", momentum=0.9,
                  learning_rate_init=0.1, batch_size=16, max_iter=4, tol=None, random_state=0)
    return PathKernelClassifier(device=device, dtype=dtype, **{**params, **kw})


def _regressor(device, dtype="float64", **kw):
    params = dict(hidden_layer_sizes=(12, 12), solver="adam", alpha=1e-3,
                  learning_rate_init=0.01, max_iter=12, tol=None, random_state=0)
    return PathKernelMachine(device=device, dtype=dtype, **{**params, **kw})


def test_classifier_minibatch_sgd():
    X, y, _, Q = _data()
    gpu, cpu = _pair(lambda d: _classifier(d).fit(X, y))
    assert gpu.device_ == CUDA and cpu.device_ == "cpu"
    _same_path(gpu, cpu)
    np.testing.assert_array_equal(gpu.predict(Q), cpu.predict(Q))
    _close(gpu.predict_proba(Q), cpu.predict_proba(Q), what="predict_proba")
    _close(gpu.decision_function(Q), cpu.decision_function(Q), what="decision_function")
    _close(gpu.transform(Q), cpu.transform(Q), what="transform")
    _same_decomposition(gpu, cpu, Q)
    _same_decomposition(gpu, cpu, Q, method="first_order")
    _close(gpu.attribute(Q), cpu.attribute(Q), what="attribute")
    _close(gpu.attribute(Q, y[:6]), cpu.attribute(Q, y[:6]), what="attribute with labels")
    _close(gpu.self_influence(), cpu.self_influence(), what="self_influence")
    _same_explanation(gpu, cpu, Q, 4)
    _same_kernels(gpu, cpu, X, Q)


def test_regressor_full_batch_adam_two_outputs():
    X, _, Y, Q = _data()
    gpu, cpu = _pair(lambda d: _regressor(d).fit(X, Y))
    _same_path(gpu, cpu)
    _close(gpu.predict(Q), cpu.predict(Q), what="predict")
    _same_decomposition(gpu, cpu, Q)
    _same_decomposition(gpu, cpu, Q, method="second_order")
    _close(gpu.attribute(Q, output=1), cpu.attribute(Q, output=1), what="attribute")
    _close(gpu.self_influence(output=0), cpu.self_influence(output=0), what="self_influence")
    # normalize_y (the default): the sweep's targets' products, on the device.
    _close(gpu.attribute(Q, method="unrolled", output=1),
           cpu.attribute(Q, method="unrolled", output=1), what="unrolled attribute")
    _same_explanation(gpu, cpu, Q, 3)
    _same_kernels(gpu, cpu, X, Q)


def test_partial_fit_continues_on_the_gpu():
    X, _, Y, Q = _data()

    def make(d):
        est = _regressor(d, max_iter=1)
        for _ in range(3):
            est.partial_fit(X, Y[:, 0])
        return est

    gpu, cpu = _pair(make)
    _same_path(gpu, cpu)
    _close(gpu.predict(Q), cpu.predict(Q), what="predict after partial_fit")
    _same_decomposition(gpu, cpu, Q)


def test_early_stopped_adam_records_the_cpus_counts_and_state():
    """The step counts (kept on the GPU and read at the end) and the best epoch's
    optimizer state (copied on the GPU, read once) are the CPU fit's."""
    X, _, Y, _ = _data(n=120)
    gpu, cpu = _pair(lambda d: _regressor(d, batch_size=16, early_stopping=True,
                                          max_iter=8).fit(X, Y))
    _same_path(gpu, cpu)
    np.testing.assert_array_equal(gpu.trajectory_._state_steps, cpu.trajectory_._state_steps)
    for i, state in cpu._resume.optimizer_state.items():
        for key, value in state.items():
            _close(gpu._resume.optimizer_state[i][key], value, what=f"resume {i} {key}")


def test_best_epoch_snapshot_holds_no_gpu_memory():
    """Early stopping's snapshot of the best epoch is read to the host where it is taken
    (the queue is empty then: the epoch's loss and score were just read), not kept on the
    GPU, where it would hold up to twice the optimizer's state beside training's (the
    CPU half: test_host_reads.py)."""
    assert all(isinstance(v, np.ndarray) for v in snapshot_is_a_copy(CUDA))


def _synchronizations(fit) -> tuple[int, object]:
    """The times ``fit()`` waited for the GPU, by torch's sync debug mode."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est = fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), est


def test_a_fit_waits_for_the_gpu_per_epoch_not_per_step():
    """A default network's fit in 13 steps an epoch waits for the GPU about as often as
    in one: per epoch (its loss, its batch order), not per step."""
    X, _, Y, _ = _data(n=200)
    waits = {}
    for batch_size in (16, None):
        def fit(b=batch_size):
            return PathKernelMachine(batch_size=b, max_iter=4, tol=None, device=CUDA,
                                     random_state=0).fit(X, Y)
        fit()  # the process's first calls (cuBLAS handles, ...) wait once
        waits[batch_size], est = _synchronizations(fit)
        assert est.t_ == (13 if batch_size else 1) * 4
    assert waits[16] > 0  # the mode sees the per-epoch reads
    assert waits[16] - waits[None] <= 2 * 4, waits


@pytest.mark.parametrize("n_components", [None, 7])
def test_tangent_features(n_components):
    X, _, Y, Q = _data()
    gpu, cpu = _pair(lambda d: TangentFeatures(_regressor(d), n_components=n_components,
                                               random_state=0).fit(X, Y))
    assert gpu.device_ == CUDA
    _same_path(gpu, cpu)
    _close(gpu.transform(Q), cpu.transform(Q), what="transform")
    np.testing.assert_array_equal(gpu.get_feature_names_out(), cpu.get_feature_names_out())
    _same_kernels(gpu, cpu, X, Q)


@pytest.mark.parametrize("svm_kernel", ["linear", "tangent", "path"])
def test_tangent_feature_svm(svm_kernel):
    X, y, _, Q = _data()
    gpu, cpu = _pair(lambda d: TangentFeatureSVM(_classifier(d), svm_kernel=svm_kernel,
                                                 random_state=0).fit(X, y))
    _same_path(gpu, cpu)
    _close(gpu.transform(Q), cpu.transform(Q), what="transform")
    _close(gpu.C_, cpu.C_, what="C_")
    # libsvm (on the CPU for both) stops at a KKT gap of SVC's tol = 1e-3, so inputs that
    # differ by 1e-12 can end at dual solutions that differ by up to that gap: with the
    # CPU fit's learning rate moved by 1e-12, the decision values moved by 2e-5 to 1.6e-4
    # of their scale. Compared to 1e-3 of the scale, and the labels wherever the two
    # best classes are further apart than 1e-2 of it.
    dg, dc = gpu.decision_function(Q), cpu.decision_function(Q)
    _close(dg, dc, rtol=0.0, atol=1e-3, what="decision_function")
    top2 = np.sort(dc, axis=1)[:, -2:] if dc.ndim == 2 else np.column_stack([dc, -dc])
    clear = np.abs(top2[:, 1] - top2[:, 0]) > 1e-2 * max(1.0, float(np.max(np.abs(dc))))
    np.testing.assert_array_equal(gpu.predict(Q)[clear], cpu.predict(Q)[clear])


@pytest.mark.parametrize("method", ["local", "residual", "alignment"])
@pytest.mark.parametrize("supervised", [True, False])
def test_ood_rank_detector(method, supervised):
    X, _, Y, Q = _data()
    target = (Y[:, 0],) if supervised else ()
    gpu, cpu = _pair(lambda d: OODRankDetector(_regressor(d), method=method, n_neighbors=8,
                                               random_state=0).fit(X, *target))
    _same_path(gpu, cpu)
    # Residuals outside a span go through a factorisation of a Gram whose condition
    # number can reach ~1e6 here: 1e-12 input differences become up to ~1e-8.
    _close(gpu.score_samples(Q), cpu.score_samples(Q), rtol=1e-7, atol=1e-8,
           what="score_samples")
    _close(gpu.offset_, cpu.offset_, rtol=1e-7, atol=1e-8, what="offset_")
    np.testing.assert_array_equal(gpu.predict(Q), cpu.predict(Q))
    assert gpu.rank_gap(Q) == cpu.rank_gap(Q)


def test_sklearn_kernels_on_a_cuda_trained_network():
    X, _, Y, Q = _data()
    gpu, cpu = _pair(lambda d: _regressor(d).fit(X, Y))
    for make in (lambda e: TangentKernel(e), lambda e: TangentKernel(e, step=3),
                 lambda e: TangentKernel(e, output=1, normalized=True),
                 lambda e: PathKernel(e), lambda e: PathKernel(e, start=2, stop=8),
                 lambda e: PathKernel(e, output=0, normalized=True)):
        kg, kc = make(gpu), make(cpu)
        _close(kg(Q, X), kc(Q, X), what=repr(kc))
        _close(kg(X), kc(X), what=f"{kc!r} (X, None)")
        _close(kg.diag(Q), kc.diag(Q), what=f"{kc!r} diag")


def test_float32_fit_stays_within_float32_of_the_cpu():
    X, y, _, Q = _data()
    gpu, cpu = _pair(lambda d: _classifier(d, dtype="float32").fit(X, y))
    assert gpu.trajectory_.dtype == torch.float32
    _same_path(gpu, cpu, RTOL32, ATOL32)
    _close(gpu.predict_proba(Q), cpu.predict_proba(Q), RTOL32, ATOL32, "predict_proba")
    res = gpu.decompose(Q)
    ref = cpu.decompose(Q)
    _close(res.prediction, ref.prediction, RTOL32, ATOL32, "decompose prediction")
    _close(res.contributions.sum(axis=1), ref.contributions.sum(axis=1), RTOL32, ATOL32,
           "decompose summed contributions")
    # The float32 decomposition's own closure, as on the CPU (float64 accumulation).
    assert res.error < 1e-4
    _close(gpu.path_kernel_(Q, X), cpu.path_kernel_(Q, X), RTOL32, ATOL32, "path_kernel_")


def test_cuda_fitted_estimators_pickle_and_load():
    X, y, Y, Q = _data()
    for est in (_classifier(CUDA).fit(X, y),
                OODRankDetector(_regressor(CUDA), method="residual").fit(X),
                TangentFeatures(_regressor(CUDA), n_components=5, random_state=0).fit(X, Y)):
        back = pickle.loads(pickle.dumps(est))
        # Loaded where CUDA is: the network goes back onto the GPU, with the same numbers.
        assert back.device_ == CUDA
        assert next(back.module_.parameters()).device.type == CUDA
        verb = ("predict_proba" if hasattr(est, "predict_proba") else
                "score_samples" if hasattr(est, "score_samples") else "transform")
        np.testing.assert_array_equal(getattr(back, verb)(Q), getattr(est, verb)(Q))
        _same_path(back, est, 0.0, 0.0)
    clf = pickle.loads(pickle.dumps(_classifier(CUDA).fit(X, y)))
    _same_decomposition(clf, _classifier("cpu").fit(X, y), Q)


def test_auto_picks_the_gpu():
    X, y, _, Q = _data()
    auto = _classifier("auto").fit(X, y)
    assert auto.device_ == CUDA
    np.testing.assert_array_equal(auto.predict_proba(Q), _classifier(CUDA).fit(X, y)
                                  .predict_proba(Q))


def test_gram_of_a_conv_net_stays_within_its_budget_on_the_gpu():
    # The GPU's capture chunks take what the kept blocks leave of the budget (the CPU's
    # take an eighth): the device's peak above what the call started with, less the
    # returned Gram, stays within memory_budget, and K is the CPU's.
    from torch import nn

    from skpathkernel._tangent import tangent_gram

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(16 * 12 * 12, 10))
    X = torch.randn(256, 3, 12, 12)
    params = {k: v.detach() for k, v in net.named_parameters()}
    budget = 2**28
    ref = tangent_gram(net, params, X, memory_budget=budget)
    gpu = net.to(CUDA)
    on = {k: v.to(CUDA) for k, v in params.items()}
    Xc = X.to(CUDA)
    tangent_gram(gpu, on, Xc, memory_budget=budget)  # cuDNN's workspaces, once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    K = tangent_gram(gpu, on, Xc, memory_budget=budget)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start - K.nbytes
    assert peak <= budget, (peak, budget)
    np.testing.assert_allclose(K.cpu().numpy(), ref.numpy(), rtol=1e-4,
                               atol=1e-5 * float(ref.abs().max()))


def test_token_ids_beyond_the_embedding_are_refused_without_a_device_assert():
    # On the GPU an embedding read beyond its rows is a device-side assert, after which
    # every CUDA call of the process fails: the ids are probed on a CPU copy instead,
    # and the fitted network (and every later test) goes on working.
    from torch import nn

    def token_net(n_features_in, n_outputs):
        return nn.Sequential(nn.Embedding(6, 4), nn.Tanh(), nn.Flatten(),
                             nn.Linear(4 * n_features_in, n_outputs))

    rng = np.random.default_rng(0)
    X = rng.integers(0, 6, size=(24, 3))
    y = (X.sum(1) % 2).astype(float)
    with pytest.raises(ValueError, match="largest token id is 15"):
        PathKernelMachine(module=token_net, max_iter=2, tol=None, device=CUDA,
                          random_state=0).fit(X + 10, y)
    est = PathKernelMachine(module=token_net, max_iter=2, tol=None, device=CUDA,
                            random_state=0).fit(X, y)
    bad = X[:2].copy()
    bad[1, 2] = 99
    for verb in (est.predict, est.transform, est.tangent_kernel_):
        with pytest.raises(ValueError, match="token id 99, out of range"):
            verb(bad)
    torch.cuda.synchronize()
    ref = PathKernelMachine(module=token_net, max_iter=2, tol=None, device="cpu",
                            random_state=0).fit(X, y)
    _close(est.predict(X[:4]), ref.predict(X[:4]), RTOL32, ATOL32, "predict after")
