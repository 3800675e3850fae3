"""Images, sequences and token ids: X of shape (n, ...) with a user's ``module``.

Every method that takes X accepts the shape ``fit`` saw. The references are independent:
per-sample autograd loops (tests/_reference.py), dense Hessians, scikit-learn's own
estimators on precomputed Grams, and, for the plumbing, the same network fed flat rows
that it unflattens itself (which must give the same numbers to round-off).
"""

import copy
import pickle

import numpy as np
import pytest
import skops.io as sio
import torch
from _reference import features_loop, jacobian_loop, module_at
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.datasets import load_digits
from sklearn.frozen import FrozenEstimator
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.svm import SVC
from torch import nn

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    TangentFeatures,
    TangentFeatureSVM,
)
from skpathkernel.diagnostics import hessian_trace
from skpathkernel.kernels import TangentKernel, path_weights

_DIGITS = load_digits()
IMAGES = (_DIGITS.images[:30] / 16.0).reshape(-1, 1, 8, 8)
Y_IMAGES = _DIGITS.target[:30] % 3
_RNG = np.random.RandomState(0)
SEQUENCES = _RNG.normal(size=(24, 4, 3))
Y_SEQUENCES = SEQUENCES[:, :, 0].sum(1)
TOKENS = _RNG.randint(0, 6, size=(24, 3))
Y_TOKENS = TOKENS.sum(1) % 2

# Modules see what they are handed: (dtype, shape) of every call's input.
SEEN: list[tuple[torch.dtype, tuple[int, ...]]] = []
FACTORY_ARGS: list[tuple[int, int]] = []


class _Watch(nn.Module):
    def forward(self, x):
        SEEN.append((x.dtype, tuple(x.shape[1:])))
        return x


def cnn(n_features_in, n_outputs):
    FACTORY_ARGS.append((n_features_in, n_outputs))
    # tanh, not ReLU: the exact decomposition integrates the Jacobian along each step by
    # quadrature, exact for smooth networks only.
    return nn.Sequential(_Watch(), nn.Conv2d(1, 2, 3, stride=2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(18, n_outputs))


def flat_cnn(n_features_in, n_outputs):
    """The same network on flat rows: it unflattens them itself (the twin of ``cnn``)."""
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 2, 3, stride=2), nn.Tanh(),
                         nn.Flatten(), nn.Linear(18, n_outputs))


def sequence_net(n_features_in, n_outputs):
    FACTORY_ARGS.append((n_features_in, n_outputs))
    # A Linear on (n, S, d): shared over the positions.
    return nn.Sequential(_Watch(), nn.Linear(3, 5), nn.Tanh(), nn.Flatten(),
                         nn.Linear(20, n_outputs))


def token_net(n_features_in, n_outputs):
    FACTORY_ARGS.append((n_features_in, n_outputs))
    return nn.Sequential(_Watch(), nn.Embedding(6, 4), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * n_features_in, n_outputs))


KINDS = {
    "images": (cnn, IMAGES, Y_IMAGES),
    "sequences": (sequence_net, SEQUENCES, Y_SEQUENCES),
    "tokens": (token_net, TOKENS, Y_TOKENS),
}
F64 = dict(dtype="float64", random_state=0)


def _regressor(kind, **kw):
    module, X, y = KINDS[kind]
    # Plain SGD (the old default, pinned): the path-kernel reference below is unweighted.
    params = dict(module=module, solver="sgd", learning_rate_init=0.05, max_iter=4, **F64)
    return PathKernelMachine(**{**params, **kw}).fit(X, y.astype(float))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_module_gets_x_as_given_and_the_fitted_shape_is_recorded(kind):
    module, X, _ = KINDS[kind]
    SEEN.clear()
    FACTORY_ARGS.clear()
    est = _regressor(kind)
    values = int(np.prod(X.shape[1:]))
    assert FACTORY_ARGS == [(values, 1)]
    assert est.n_features_in_ == values
    assert est.input_shape_ == X.shape[1:]
    assert not hasattr(est, "feature_names_in_")
    expected = torch.int64 if kind == "tokens" else torch.float64
    assert est.X_fit_.dtype == (np.int64 if kind == "tokens" else np.float64)
    SEEN.clear()
    est.predict(X[:3])
    est.transform(X[:3])
    assert SEEN and set(SEEN) == {(expected, X.shape[1:])}


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64])
def test_token_ids_of_any_integer_dtype_reach_the_module_as_int64(dtype):
    SEEN.clear()
    clf = PathKernelClassifier(module=token_net, max_iter=2, **F64)
    clf.fit(TOKENS.astype(dtype), Y_TOKENS)
    ref = PathKernelClassifier(module=token_net, max_iter=2, **F64).fit(TOKENS, Y_TOKENS)
    assert {d for d, _ in SEEN} == {torch.int64}
    assert_array_equal(clf.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    assert_array_equal(clf.decision_function(TOKENS.astype(dtype)), ref.decision_function(TOKENS))


# 4000 draws estimate the kernel closely, more than some of these networks' features.
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.DataDimensionalityWarning")
@pytest.mark.parametrize("kind", list(KINDS))
def test_features_and_kernels_match_a_per_sample_loop(kind):
    _, X, _ = KINDS[kind]
    est = _regressor(kind)
    A, B = X[:5], X[5:9]
    phi = features_loop(module_at(est), A)
    assert_allclose(est.transform(A), phi, rtol=1e-10, atol=1e-12)
    phi_b = features_loop(module_at(est), B)
    assert_allclose(est.tangent_kernel_(A, B), phi @ phi_b.T, rtol=1e-10, atol=1e-12)
    assert_allclose(TangentKernel(est).diag(A), (phi * phi).sum(1), rtol=1e-10)
    # Plain SGD: the path kernel is sum_k w_k J_k J_k^T over the recorded steps.
    K = sum(w * jacobian_loop(module_at(est, k), A)[:, 0].numpy()
            @ jacobian_loop(module_at(est, k), B)[:, 0].numpy().T
            for k, w in path_weights(est.trajectory_))
    assert_allclose(est.path_kernel_(A, B), K, rtol=1e-10, atol=1e-12)
    # scikit-learn's kernel consumers pass 2-D arrays: flat rows are the same inputs.
    assert_array_equal(est.tangent_kernel_(A.reshape(5, -1), B), est.tangent_kernel_(A, B))
    # The seeded projection estimates the same kernel: E[z z'^T] = K, here on 4000 draws.
    net = (PathKernelMachine if kind == "sequences" else PathKernelClassifier)(
        module=KINDS[kind][0], max_iter=2, **F64)
    tf = TangentFeatures(net, n_components=4000, random_state=0)
    Z = tf.fit(X, KINDS[kind][2]).transform(A)
    K = features_loop(module_at(tf), A) @ features_loop(module_at(tf), A).T
    assert np.abs(Z @ Z.T - K).max() < 0.1 * np.abs(K).max()


def test_an_image_network_equals_its_flattened_twin():
    """Every method on (n, 1, 8, 8) images against the same network fed flat rows."""
    flat = IMAGES.reshape(len(IMAGES), -1)
    kw = dict(solver="adam", learning_rate_init=0.02, max_iter=6, **F64)
    nd = PathKernelClassifier(module=cnn, **kw).fit(IMAGES, Y_IMAGES)
    tw = PathKernelClassifier(module=flat_cnn, **kw).fit(flat, Y_IMAGES)
    assert_allclose(nd.trajectory_.parameters(-1), tw.trajectory_.parameters(-1), rtol=1e-12)
    Q, Qf = IMAGES[:4], flat[:4]
    assert_allclose(nd.predict_proba(Q), tw.predict_proba(Qf), rtol=1e-10)
    res, ref = nd.decompose(Q), tw.decompose(Qf)
    assert res.error < 1e-10
    assert_allclose(res.contributions, ref.contributions, rtol=1e-9, atol=1e-12)
    assert_array_equal(nd.explain(Q, n_neighbors=3)[0], tw.explain(Qf, n_neighbors=3)[0])
    for kernel in ("tangent", "path"):
        d, i = nd.kneighbors(Q, n_neighbors=4, kernel=kernel)
        d_ref, i_ref = tw.kneighbors(Qf, n_neighbors=4, kernel=kernel)
        assert_array_equal(i, i_ref)
        assert_allclose(d, d_ref, rtol=1e-8, atol=1e-10)
    h = hessian_trace(nd, Q, Y_IMAGES[:4], n_samples=5, random_state=0)
    h_ref = hessian_trace(tw, Qf, Y_IMAGES[:4], n_samples=5, random_state=0)
    assert_allclose(h.estimates, h_ref.estimates, rtol=1e-9)
    ood = OODRankDetector(FrozenEstimator(nd)).fit(IMAGES)
    ood_ref = OODRankDetector(FrozenEstimator(tw)).fit(flat)
    outside = IMAGES[::-1, :, ::-1].copy()  # flipped digits
    assert_allclose(ood.score_samples(outside), ood_ref.score_samples(outside.reshape(30, -1)),
                    rtol=1e-7, atol=1e-10)
    assert ood.rank_gap(outside[:5]) == ood_ref.rank_gap(outside[:5].reshape(5, -1))


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_token_ids_decompose_exactly(solver):
    clf = PathKernelClassifier(module=token_net, solver=solver, learning_rate_init=0.05,
                               max_iter=8, **F64).fit(TOKENS, Y_TOKENS)
    res = clf.decompose(TOKENS[:3])
    assert res.error < 1e-10
    assert_allclose(res.prediction[:, 0], clf.decision_function(TOKENS[:3]), rtol=1e-12)
    # The contributions move the prediction: the decomposition is not all initial value.
    assert np.abs(res.contributions).sum() > 1e-3


def wide_token_net(n_features_in, n_outputs):
    # A table far wider than the ids read, with a padding row: its factors are ids.
    return nn.Sequential(nn.Embedding(3000, 4, padding_idx=2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * n_features_in, n_outputs))


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_wide_vocabulary_token_ids_decompose_exactly(solver):
    clf = PathKernelClassifier(module=wide_token_net, solver=solver, learning_rate_init=0.05,
                               momentum=0.9, max_iter=6, **F64).fit(TOKENS, Y_TOKENS)
    res = clf.decompose(TOKENS[:3])
    assert res.error < 1e-10
    assert_allclose(res.prediction[:, 0], clf.decision_function(TOKENS[:3]), rtol=1e-12)
    assert np.abs(res.contributions).sum() > 1e-3


def test_every_estimator_trains_and_scores_on_images():
    svm = TangentFeatureSVM(PathKernelClassifier(module=cnn, max_iter=3, **F64),
                            svm_kernel="path", normalize=False)
    tf = TangentFeatures(PathKernelClassifier(module=cnn, max_iter=3, **F64)).fit(IMAGES,
                                                                                 Y_IMAGES)
    # The SVM on the path kernel is SVC on the path-kernel Gram of the training images.
    K = svm.fit(IMAGES, Y_IMAGES).path_kernel_(IMAGES)
    ref = SVC(kernel="precomputed", C=svm.C_).fit(K, Y_IMAGES)
    assert_array_equal(svm.predict(IMAGES[:6]), ref.predict(K[:6]))
    assert tf.transform(IMAGES[:2]).shape == (2, 3 * tf.n_params_)
    det = OODRankDetector(PathKernelMachine(module=cnn, max_iter=3, **F64)).fit(IMAGES)
    assert det.n_outputs_ == 64 and det.task_ == "reconstruction"
    assert det.predict(IMAGES[:3]).shape == (3,)


def test_pipelines_grid_search_cross_validation_and_pickles_take_nd_inputs(tmp_path):
    pipe = make_pipeline(TangentFeatures(PathKernelClassifier(module=cnn, max_iter=3, **F64)),
                         LogisticRegression(max_iter=500))
    assert pipe.fit(IMAGES, Y_IMAGES).score(IMAGES, Y_IMAGES) > 0.5
    base = PathKernelClassifier(module=token_net, solver="adam", **F64)
    search = GridSearchCV(base, {"max_iter": [2, 10]}, cv=2).fit(TOKENS, Y_TOKENS)
    best = base.set_params(**search.best_params_).fit(TOKENS, Y_TOKENS)
    assert_array_equal(search.predict(TOKENS), best.predict(TOKENS))
    folds = StratifiedKFold(3)
    scores = cross_val_score(PathKernelClassifier(module=cnn, max_iter=3, **F64), IMAGES,
                             Y_IMAGES, cv=folds)
    manual = [PathKernelClassifier(module=cnn, max_iter=3, **F64)
              .fit(IMAGES[tr], Y_IMAGES[tr]).score(IMAGES[te], Y_IMAGES[te])
              for tr, te in folds.split(IMAGES, Y_IMAGES)]
    assert_allclose(scores, manual)
    for est, X in ((best, TOKENS), (pipe[0], IMAGES)):
        loaded = pickle.loads(pickle.dumps(est))
        assert loaded.input_shape_ == est.input_shape_
        assert_array_equal(loaded.transform(X[:3]), est.transform(X[:3]))
        path = tmp_path / "est.skops"
        sio.dump(est, path)
        loaded = sio.load(path, trusted=sio.get_untrusted_types(file=path))
        assert_array_equal(loaded.transform(X[:3]), est.transform(X[:3]))


def test_sklearn_kernel_consumers_take_nd_inputs_directly_or_as_flat_rows():
    est = _regressor("tokens")
    X, y = TOKENS, Y_TOKENS.astype(float)
    K = est.tangent_kernel_(X)
    # SVC(kernel=callable) hands X through as it is: (n, ...) arrays work directly.
    svc = SVC(kernel=est.tangent_kernel_).fit(X, Y_TOKENS)
    ref = SVC(kernel="precomputed").fit(K, Y_TOKENS)
    assert_allclose(svc.decision_function(X[:5]), ref.decision_function(K[:5]), rtol=1e-8)
    # KernelRidge and GaussianProcessRegressor validate X as 2-D: pass flat rows.
    img = _regressor("images")
    flat = IMAGES.reshape(len(IMAGES), -1)
    Ki = img.tangent_kernel_(IMAGES)
    kr = KernelRidge(kernel=img.tangent_kernel_, alpha=1e-2).fit(flat, Y_IMAGES)
    kr_ref = KernelRidge(kernel="precomputed", alpha=1e-2).fit(Ki, Y_IMAGES)
    assert_allclose(kr.predict(flat[:4]), kr_ref.predict(Ki[:4]), rtol=1e-8)
    gp = GaussianProcessRegressor(kernel=TangentKernel(est), alpha=1e-3, optimizer=None)
    mean = gp.fit(X, y).predict(X[:4])  # token ids: 2-D already
    closed = K[:4] @ np.linalg.solve(K + 1e-3 * np.eye(len(K)), y)
    assert_allclose(mean, closed, rtol=1e-6)


def test_displays_take_nd_inputs():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from skpathkernel.plotting import (
        KernelEvolutionDisplay,
        KernelMatrixDisplay,
        RankGapDisplay,
        TangentEmbeddingDisplay,
    )

    est = _regressor("images")
    X = IMAGES[:8]
    phi = features_loop(module_at(est), X)
    K = phi @ phi.T
    K_hat = K / np.sqrt(np.outer(np.diag(K), np.diag(K)))
    disp = KernelMatrixDisplay.from_estimator(est, X)
    assert_allclose(disp.kernel_matrix, K_hat, rtol=1e-9)
    evo = KernelEvolutionDisplay.from_estimator(est, X[0], X[1:4], steps=[-1])
    assert_allclose(evo.kernel_values[0], K_hat[0, 1:4], rtol=1e-9)
    ranks = RankGapDisplay.from_estimator(est, X[:5], X[5:], steps=[-1])
    assert ranks.rank_train[0] == np.linalg.matrix_rank(phi[:5], tol=ranks.rtol
                                                        * np.linalg.norm(phi[:5], 2))
    emb = TangentEmbeddingDisplay.from_estimator(est, X, method="pca")
    assert emb.embedding.shape == (8, 2)
    plt.close("all")


def test_hessian_trace_on_token_ids_estimates_the_dense_trace():
    est = _regressor("tokens", max_iter=3)
    X, y = TOKENS[:10], Y_TOKENS[:10].astype(float)
    res = hessian_trace(est, X, y, n_samples=400, random_state=0)
    # The dense Hessian of the mean per-sample loss 1/2 (f - y)^2, parameter by parameter.
    module = module_at(est)
    params = [p for p in module.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in params])

    def loss(flat):
        chunks, start = {}, 0
        for (name, p) in module.named_parameters():
            chunks[name] = flat[start : start + p.numel()].reshape(p.shape)
            start += p.numel()
        out = torch.func.functional_call(module, chunks, (torch.as_tensor(X),))[:, 0]
        return 0.5 * ((out - torch.as_tensor(y)) ** 2).mean()

    exact = float(torch.autograd.functional.hessian(loss, theta).diagonal().sum())
    assert abs(res.trace - exact) < 5 * res.stderr + 1e-12


def test_a_recorded_loop_on_token_ids():
    torch.manual_seed(0)
    net = token_net(3, 1).double()
    X, y = torch.as_tensor(TOKENS), torch.as_tensor(Y_TOKENS, dtype=torch.float64)[:, None]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with PathRecorder(net, opt, n_samples=len(X)) as rec:
        for step in range(4):
            idx = torch.arange(12) + 12 * (step % 2)
            opt.zero_grad()
            (0.5 * (net(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
    recorded = rec.as_estimator(X, y)
    assert recorded.input_shape_ == (3,)
    res = recorded.decompose(TOKENS[:3])
    assert res.error < 1e-10
    phi = jacobian_loop(copy.deepcopy(net), TOKENS[:3])[:, 0].numpy()
    assert_allclose(recorded.tangent_kernel_(TOKENS[:3]), phi @ phi.T, rtol=1e-10)


class _Rows(nn.Module):
    """Records the number of rows of every call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x):
        self.calls.append(len(x))
        return x


def wide_cnn(n_features_in, n_outputs):
    # 64 values per image in, 32 x 8 x 8 = 2048 per image after the first convolution.
    return nn.Sequential(_Rows(), nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(2048, n_outputs))


def test_prediction_blocks_are_sized_by_the_widest_activation():
    est = PathKernelMachine(module=wide_cnn, max_iter=1, memory_budget=2**20, random_state=0)
    est.fit(IMAGES, Y_IMAGES.astype(float))
    rows = est.module_[0].calls
    rows.clear()
    est.predict(IMAGES)
    # float32: 8 x 2048 values x 4 bytes a row fit 16 rows in 1 MiB (the input, 64
    # values, would have allowed 512: all 30 images at once). The first call is the
    # one-sample pass that measures the activations. Every block has that many rows, the
    # last one padded (a row's float32 result must not depend on the rows beside it).
    assert rows[0] == 1
    block = 2**20 // (8 * 2048 * 4)
    assert rows[1:] == [block] * -(-len(IMAGES) // block)


def lazy_cnn(n_features_in, n_outputs):
    # nn.LazyLinear: the flattened size is read from the first forward pass.
    return nn.Sequential(nn.Conv2d(1, 2, 3, stride=2), nn.Tanh(), nn.Flatten(),
                         nn.LazyLinear(n_outputs))


def test_lazy_layers_are_initialized_reproducibly_without_touching_the_global_rng():
    state = torch.get_rng_state()
    fits = [PathKernelClassifier(module=lazy_cnn, max_iter=3, **F64).fit(IMAGES, Y_IMAGES)
            for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state)
    assert fits[0].n_params_ == (2 * 9 + 2) + (18 * 3 + 3)
    assert_array_equal(fits[0].trajectory_.parameters(0), fits[1].trajectory_.parameters(0))
    loaded = pickle.loads(pickle.dumps(fits[0]))
    assert_array_equal(loaded.predict_proba(IMAGES), fits[0].predict_proba(IMAGES))
    assert fits[0].decompose(IMAGES[:2]).error < 1e-10


@pytest.mark.parametrize("kind", ["images", "tokens"])
def test_reversed_views_are_taken_as_their_copies(kind):
    """NumPy calls an axis of length 1 contiguous whatever its stride: a row of a reversed
    view (X[::-1][:1]) reached torch, which refuses negative strides. A fit on a reversed
    view keeps such rows (its first one measures the activations), so every later method
    failed; a one-row query did on every network, the default MLP's too."""
    module, X, y = KINDS[kind]
    rev = X[::-1]
    assert rev[:1].flags.c_contiguous and rev.strides[0] < 0
    est = PathKernelClassifier(module=module, max_iter=2, **F64).fit(rev, y[::-1])
    ref = PathKernelClassifier(module=module, max_iter=2, **F64).fit(rev.copy(), y[::-1])
    assert_array_equal(est.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    row = X[::-1][:1]
    assert_array_equal(est.predict_proba(row), ref.predict_proba(row.copy()))
    assert_array_equal(est.transform(row), ref.transform(row.copy()))
    assert_array_equal(est.tangent_kernel_(row, X[:3]), ref.tangent_kernel_(row.copy(), X[:3]))
    assert_array_equal(est.decompose(row).contributions, ref.decompose(row.copy()).contributions)
    assert_array_equal(est.kneighbors(row, n_neighbors=3)[1],
                       ref.kneighbors(row.copy(), n_neighbors=3)[1])
    flat = X.reshape(len(X), -1).astype(np.float64)
    mlp = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, **F64).fit(flat, y)
    assert_array_equal(mlp.predict_proba(flat[::-1][:1]), mlp.predict_proba(flat[-1:]))


class _EntityEmbeddings(nn.Module):
    """A table per column (categorical features): 10 categories, then 3."""

    def __init__(self, n_outputs):
        super().__init__()
        self.first, self.second = nn.Embedding(10, 2), nn.Embedding(3, 2)
        self.head = nn.Linear(4, n_outputs)

    def forward(self, x):
        return self.head(torch.tanh(torch.cat([self.first(x[:, 0]), self.second(x[:, 1])], 1)))


def test_an_id_beyond_a_smaller_table_is_refused_in_any_row():
    """The check ran the network on the sample holding the largest id only: an id beyond
    the 3-row table in another sample reached torch's bare IndexError in every method
    (and in fit, after the check)."""
    rng = np.random.RandomState(0)
    X = np.c_[rng.randint(0, 10, 30), rng.randint(0, 3, 30)]
    y = X.sum(1) % 2
    X[0, 0] = 9  # the largest id, in a sample whose second id is valid
    est = PathKernelClassifier(module=lambda n, c: _EntityEmbeddings(c), max_iter=2,
                               **F64).fit(X, y)
    bad = X.copy()
    bad[7, 1] = 4
    match = r"out of range for one of the network's embeddings \(\[10, 3\] rows; .*\[9, 4\]"
    for method in (est.predict, est.transform, est.tangent_kernel_, est.decompose):
        with pytest.raises(ValueError, match=match):
            method(bad)
    before = est.predict_proba(X)
    with pytest.raises(ValueError, match=r"largest token id at each position is \[9, 4\]"):
        est.fit(bad, y)
    assert_array_equal(est.predict_proba(X), before)


class _Encoder(nn.Module):
    def __init__(self, n_outputs, batch_first):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(3, 1, 8, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(12, n_outputs)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1))


class _Recurrent(nn.Module):
    def __init__(self, n_outputs):
        super().__init__()
        self.rnn = nn.GRU(3, 4)  # batch_first=False: time is the first axis
        self.head = nn.Linear(16, n_outputs)

    def forward(self, x):
        return self.head(self.rnn(x)[0].flatten(1))


@pytest.mark.parametrize("module", [lambda n, c: _Encoder(c, batch_first=False),
                                    lambda n, c: _Recurrent(c)], ids=["attention", "gru"])
def test_a_module_that_mixes_the_samples_is_refused(module):
    """torch's sequence layers default to batch_first=False: on (n, S, d) they attend or
    recur over the samples. Such a network trained without a word, and its predictions
    then depended on the block they ran in (by 1.2 on an attention layer), its tangent
    kernel disagreed with transform and the exact decomposition was off by 0.1."""
    est = PathKernelMachine(module=module, max_iter=2, **F64)
    with pytest.raises(ValueError, match="depends on the other samples.*batch_first=True"):
        est.fit(SEQUENCES, Y_SEQUENCES)
    assert not hasattr(est, "network_")
    # With batch_first=True the same layer is per-sample, and every block agrees.
    est = PathKernelMachine(module=lambda n, c: _Encoder(c, batch_first=True), max_iter=2,
                            **F64).fit(SEQUENCES, Y_SEQUENCES)
    assert_allclose(est.predict(SEQUENCES[:6]),
                    [est.predict(SEQUENCES[i : i + 1])[0] for i in range(6)], rtol=1e-12)


def test_a_recorded_module_that_mixes_the_samples_is_refused():
    """fit's probe, for a user's loop: a batch_first=False GRU recorded by PathRecorder
    gave per-sample kernels of a network that never ran one sample at a time, without a
    word, and a decomposition off by 1.6% of its largest output."""
    X = torch.as_tensor(SEQUENCES)
    y = torch.as_tensor(Y_SEQUENCES).reshape(-1, 1)
    for batch_first in (False, True):
        torch.manual_seed(0)
        module = _Recurrent(1).double()
        if batch_first:
            module.rnn.batch_first = True
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        with PathRecorder(module, opt, n_samples=len(X)) as rec:
            for _ in range(3):
                opt.zero_grad()
                (0.5 * (module(X) - y).pow(2).mean()).backward()
                rec.set_batch(np.arange(len(X)))
                opt.step()
        if not batch_first:
            for make in (rec.as_estimator, rec.as_network):
                with pytest.raises(ValueError,
                                   match="depends on the other samples.*batch_first=True"):
                    make(SEQUENCES, y.numpy())
            continue
        # Per sample: recorded as before, and its kernel is the autograd reference's.
        net = rec.as_estimator(SEQUENCES, y.numpy())
        J = np.asarray(jacobian_loop(module, SEQUENCES[:5]))[:, 0]
        assert_allclose(TangentKernel(net)(SEQUENCES[:5]), J @ J.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["Int64", "UInt8"])
def test_token_ids_in_pandas_nullable_integer_columns_are_integers(dtype):
    """scikit-learn converts pandas' nullable integer columns (convert_dtypes, the nullable
    readers) to float64: token ids in them were refused as floats, at fit and after it
    (as "X has dtype float64")."""
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(TOKENS, columns=["a", "b", "c"])
    ref = PathKernelClassifier(module=token_net, max_iter=2, **F64).fit(frame, Y_TOKENS)
    est = PathKernelClassifier(module=token_net, max_iter=2, **F64).fit(frame.astype(dtype),
                                                                        Y_TOKENS)
    assert est.X_fit_.dtype == np.int64
    assert_array_equal(est.trajectory_.parameters(-1), ref.trajectory_.parameters(-1))
    assert_array_equal(ref.decision_function(frame.astype(dtype)), ref.decision_function(frame))
    assert_array_equal(ref.tangent_kernel_(frame.astype(dtype)), ref.tangent_kernel_(frame))
    # A missing id is refused as one, not taken as a float.
    with pytest.raises(ValueError, match="NaN"):
        ref.predict(frame.astype(dtype).mask(frame == 0))


# Embeddings standing for ones on a GPU: an id beyond their rows is no IndexError there
# but a device-side assert, after which every CUDA call of the process fails.
_ON_GPU: list[nn.Module] = []


def _device_assert(embedding, args):
    if any(embedding is m for m in _ON_GPU) and int(args[0].max()) >= embedding.num_embeddings:
        raise RuntimeError("CUDA error: device-side assert triggered")


def _gpu_token_net(n_features_in, n_outputs):
    net = token_net(n_features_in, n_outputs)
    net[1].register_forward_pre_hook(_device_assert)
    _ON_GPU.append(net[1])
    return net


def test_ids_beyond_the_embedding_never_reach_a_gpu_module(monkeypatch):
    """On a GPU the probe that finds ids beyond an embedding ran them through the
    network on the device, where the embedding's read is a device-side assert: fit
    failed with words about a module that needs an nn.Embedding, and predict raised
    the CUDA error, leaving the process's CUDA context (the fitted network's with it)
    unusable. The probe runs them on a CPU copy, where they are an IndexError."""
    from skpathkernel._network import _inputs

    def on_cpu(module):
        return not any(m is e for m in module.modules() for e in _ON_GPU)

    def make():
        return PathKernelMachine(module=_gpu_token_net, max_iter=2, tol=None, **F64)

    monkeypatch.setattr(_inputs, "_reads_ids_on_cpu", on_cpu, raising=False)
    with pytest.raises(ValueError, match=r"largest token id is 15.*embeddings have \[6\]"):
        make().fit(TOKENS + 10, Y_TOKENS * 1.0)
    est = make().fit(TOKENS, Y_TOKENS * 1.0)
    bad = TOKENS[:2].copy()
    bad[1, 2] = 99
    for verb in (est.predict, est.transform, est.tangent_kernel_, est.decompose):
        with pytest.raises(ValueError, match=r"token id 99, out of range.*\[6\] rows"):
            verb(bad)
    # Ids within the embedding run on the module itself, as before.
    assert_allclose(est.predict(TOKENS[:4]), est.predict(TOKENS)[:4], rtol=1e-12)



class _CannotRunOnTheCpu(nn.Module):
    """A copy whose forward makes tensors on "the GPU": it cannot run on the CPU."""

    def forward(self, x):
        raise RuntimeError("Expected all tensors to be on the same device")


def test_a_gpu_module_whose_copy_cannot_run_checks_ids_on_itself(monkeypatch):
    """The CPU copy that probes token ids for a GPU module is a safeguard: a copy that
    cannot run on the CPU (a forward making tensors on the GPU) leaves the probe to the
    module itself, as before, and valid ids work."""
    from skpathkernel._network import _inputs

    est = PathKernelMachine(module=token_net, max_iter=2, tol=None, **F64).fit(
        TOKENS, Y_TOKENS * 1.0)
    monkeypatch.setattr(_inputs, "_reads_ids_on_cpu", lambda module: False)
    monkeypatch.setattr(_inputs, "copy_module", lambda module: _CannotRunOnTheCpu())
    assert_allclose(est.predict(TOKENS[:3]), est.predict(TOKENS)[:3], rtol=1e-12)
    # The module itself, here on the CPU, still refuses an id beyond its embedding.
    with pytest.raises(ValueError, match=r"token id 9, out of range"):
        est.predict(TOKENS[:2] + 4)
