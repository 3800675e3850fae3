"""Displays: their data against independent computations, and the Display contract."""

import subprocess
import sys
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import sklearn
import torch
from _reference import jacobian_loop, module_at, own_loop, zero_feature_network
from sklearn.decomposition import KernelPCA
from sklearn.exceptions import NotFittedError
from sklearn.manifold import TSNE
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    plotting,
)
from skpathkernel.datasets import make_circle
from skpathkernel.plotting import (
    KernelEvolutionDisplay,
    KernelMatrixDisplay,
    KernelNeighborsDisplay,
    RankGapDisplay,
    TangentEmbeddingDisplay,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _loop_jacobian(est, point, X):
    """(n, C, P) at recorded point ``point``: the autograd loop of tests/_reference.py."""
    return jacobian_loop(module_at(est, point), X).numpy()


def _loop_gram(est, point, X, Y=None, normalized=True):
    JX = _loop_jacobian(est, point, X)
    JY = JX if Y is None else _loop_jacobian(est, point, Y)
    C = JX.shape[1]
    K = np.einsum("ncp,mcp->nm", JX, JY) / C
    if normalized:
        dx = np.einsum("ncp,ncp->n", JX, JX) / C
        dy = np.einsum("ncp,ncp->n", JY, JY) / C
        K = K / np.sqrt(np.outer(dx, dy))
    return K


@pytest.fixture(scope="module")
def circle():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(40, 2))
    y = np.where((X**2).sum(1) > 0.5, 1, -1)
    # SGD (the old default, pinned): the path-kernel reference below is unpreconditioned.
    clf = PathKernelClassifier(hidden_layer_sizes=(7, 5), max_iter=8, learning_rate_init=0.3,
                               solver="sgd", dtype="float64", device="cpu",
                               random_state=0).fit(X, y)
    return clf, X, y


@pytest.fixture(scope="module")
def multiclass():
    rng = np.random.RandomState(1)
    X = rng.normal(size=(18, 3))
    y = np.repeat([2, 0, 1], 6)
    clf = PathKernelClassifier(hidden_layer_sizes=(6,), max_iter=5, solver="adam",
                               learning_rate_init=0.05, dtype="float64", device="cpu",
                               random_state=0).fit(X, y)
    return clf, X, y


# --------------------------------------------------------------------------- contract
def test_import_does_not_import_pyplot():
    code = ("import sys, skpathkernel.plotting; "
            "print('matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("make", [
    lambda c: KernelMatrixDisplay.from_estimator(c[0], c[1], c[2], ax=c[3]),
    lambda c: KernelNeighborsDisplay.from_estimator(c[0], [[0.5, 0.5]], 5, y=c[2], ax=c[3]),
    lambda c: KernelEvolutionDisplay.from_estimator(c[0], [0, 0], c[1][:2], ax=c[3]),
    lambda c: RankGapDisplay.from_estimator(c[0], c[1][:10], c[1][10:15], ax=c[3]),
    lambda c: TangentEmbeddingDisplay.from_estimator(c[0], c[1], c[2], method="pca",
                                                     ax=c[3]),
])
def test_ax_honoured_and_attributes_set(circle, make):
    clf, X, y = circle
    fig, axes = plt.subplots(1, 2)
    disp = make((clf, X, y, axes[1]))
    assert disp.ax_ is axes[1]
    assert disp.figure_ is fig
    assert axes[1].has_data() and not axes[0].has_data()
    # ax=None makes a new figure.
    disp.plot()
    assert disp.figure_ is not fig


# --------------------------------------------------------------------------- matrix
@pytest.mark.parametrize("step", [0, 3, -1])
def test_kernel_matrix_equals_loop_gram_ordered_by_class(circle, step):
    clf, X, y = circle
    disp = KernelMatrixDisplay.from_estimator(clf, X, y, step=step)
    order = np.argsort(y, kind="stable")
    np.testing.assert_array_equal(disp.order, order)
    np.testing.assert_array_equal(disp.y, y[order])
    expected = _loop_gram(clf, step, X[order])
    np.testing.assert_allclose(disp.kernel_matrix, expected, rtol=1e-9, atol=1e-12)
    # One boundary between the two classes, drawn horizontally and vertically.
    n_neg = int((y == -1).sum())
    assert len(disp.boundary_lines_) == 2
    assert disp.boundary_lines_[0].get_ydata()[0] == pytest.approx(n_neg - 0.5)
    assert disp.im_.get_array().shape == (40, 40)


def test_kernel_matrix_block_means_multiclass(multiclass):
    clf, X, y = multiclass
    disp = KernelMatrixDisplay.from_estimator(clf, X, y, display_labels=["a", "b", "c"])
    K = _loop_gram(clf, -1, X)
    expected = np.empty((3, 3))
    for a in range(3):
        for b in range(3):
            block = K[np.ix_(y == a, y == b)]
            if a == b:  # off-diagonal entries only
                block = block[~np.eye(len(block), dtype=bool)]
            expected[a, b] = block.mean()
    np.testing.assert_allclose(disp.block_means(), expected, rtol=1e-9)
    assert [t.get_text() for t in disp.ax_.get_xticklabels()] == ["a", "b", "c"]


def test_kernel_matrix_takes_nan_labels_for_one_class(multiclass):
    # NaN != NaN: each NaN row was a block of its own, with boundaries between them,
    # and display_labels naming the np.unique classes passed from_estimator's check,
    # then was refused by plot's count of blocks after the kernel was computed.
    clf, X, y = multiclass
    labels = y.astype(float)
    labels[[1, 7, 14]] = np.nan
    disp = KernelMatrixDisplay.from_estimator(clf, X, labels,
                                              display_labels=["a", "b", "c", "none"])
    assert [t.get_text() for t in disp.ax_.get_xticklabels()] == ["a", "b", "c", "none"]
    assert len(disp.boundary_lines_) == 6  # 3 boundaries, horizontal and vertical
    K = _loop_gram(clf, -1, X)
    groups = [labels == 0, labels == 1, labels == 2, np.isnan(labels)]
    expected = np.empty((4, 4))
    for a, rows in enumerate(groups):
        for b, cols in enumerate(groups):
            block = K[np.ix_(rows, cols)]
            if a == b:  # off-diagonal entries only
                block = block[~np.eye(len(block), dtype=bool)]
            expected[a, b] = block.mean()
    np.testing.assert_allclose(disp.block_means(), expected, rtol=1e-9)


def test_kernel_matrix_display_labels_without_y_are_refused(circle, monkeypatch):
    # They name the class blocks of y: without it they were silently not drawn.
    clf, X, _ = circle
    calls = []
    monkeypatch.setattr("skpathkernel.plotting.step_kernel",
                        lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="display_labels name the class blocks of y"):
        KernelMatrixDisplay.from_estimator(clf, X[:4], display_labels=["a", "b"])
    assert calls == []  # before the kernel
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="display_labels name the class blocks of y"):
        KernelMatrixDisplay(np.eye(2), display_labels=["a", "b"]).plot(ax=ax)
    assert not ax.has_data()


def test_from_estimator_takes_every_option_of_plot(circle):
    # As scikit-learn's displays: from_estimator takes what plot draws with. vmin, vmax,
    # boundary_kw (KernelMatrixDisplay) and legend (RankGapDisplay) were refused as
    # unexpected keyword arguments.
    clf, X, y = circle
    disp = KernelMatrixDisplay.from_estimator(clf, X[:10], y[:10], vmin=-1, vmax=1,
                                              boundary_kw={"color": "red"})
    assert disp.im_.get_clim() == (-1, 1)
    assert disp.boundary_lines_ and all(
        matplotlib.colors.same_color(line.get_color(), "red")
        for line in disp.boundary_lines_)
    rank = RankGapDisplay.from_estimator(clf, X[:5], X[5:8], steps=[-1], legend=False)
    assert rank.ax_.get_legend() is None
    assert RankGapDisplay.from_estimator(clf, X[:5], X[5:8], steps=[-1]).ax_.get_legend()


def test_kernel_matrix_im_kw_reaches_imshow(circle):
    """As ConfusionMatrixDisplay's im_kw: an unnormalized kernel's range on a log scale
    (no keyword reached imshow beyond cmap, vmin and vmax), the image still carrying the
    dense loop Gram."""
    clf, X, y = circle
    norm = matplotlib.colors.LogNorm()
    disp = KernelMatrixDisplay.from_estimator(clf, X[:10], normalized=False,
                                              im_kw={"norm": norm, "aspect": "auto"})
    assert disp.im_.norm is norm and disp.ax_.get_aspect() == "auto"
    np.testing.assert_allclose(disp.im_.get_array(), _loop_gram(clf, -1, X[:10],
                                                                normalized=False),
                               rtol=1e-10)
    # The user's keywords win over the display's own; plot takes them too.
    disp.plot(im_kw={"interpolation": "bilinear", "cmap": "magma"})
    assert disp.im_.get_interpolation() == "bilinear" and disp.im_.get_cmap().name == "magma"


def test_kernel_matrix_path_kernel_unnormalized(circle):
    from skpathkernel.kernels import path_weights

    clf, X, _ = circle
    disp = KernelMatrixDisplay.from_estimator(clf, X[:12], kernel="path", normalized=False)
    expected = sum(w * _loop_gram(clf, k, X[:12], normalized=False)
                   for k, w in path_weights(clf.trajectory_))
    np.testing.assert_allclose(disp.kernel_matrix, expected, rtol=1e-9)
    assert disp.boundary_lines_ == []


# --------------------------------------------------------------------------- neighbours
@pytest.mark.parametrize("step", [0, -1])
def test_neighbors_equal_brute_force(circle, step):
    clf, X, y = circle
    anchors = np.array([[0.7, 0.0], [-0.2, 0.3]])
    disp = KernelNeighborsDisplay.from_estimator(clf, anchors, 7, y=y, step=step)
    K = _loop_gram(clf, step, anchors, X)
    expected = np.argsort(-K, axis=1, kind="stable")[:, :7]
    # Compare as sets: ties at the cut would be ordered arbitrarily.
    for got, exp in zip(disp.neighbors, expected):
        assert set(got.tolist()) == set(exp.tolist())
    labels = y[expected]
    purity = np.array([max((r == 1).mean(), (r == -1).mean()) for r in labels])
    np.testing.assert_allclose(disp.purity(), purity)
    assert len(disp.neighbor_scatters_) == 2


def test_neighbors_euclidean_and_default_labels(circle):
    clf, X, y = circle
    anchor = np.array([[0.1, -0.4]])
    disp = KernelNeighborsDisplay.from_estimator(clf, anchor, 6, kernel="euclidean")
    d = np.linalg.norm(X - anchor, axis=1)
    assert set(disp.neighbors[0].tolist()) == set(np.argsort(d)[:6].tolist())
    np.testing.assert_array_equal(disp.y, clf.predict(X))


def test_neighbors_rejects_bad_input(circle, multiclass):
    clf, X, y = circle
    with pytest.raises(ValueError, match="kernel must be"):
        KernelNeighborsDisplay.from_estimator(clf, [[0, 0]], 3, kernel="rbf")
    with pytest.raises(ValueError, match="2-D inputs"):
        KernelNeighborsDisplay.from_estimator(multiclass[0], [[0, 0, 0]], 3)
    with pytest.raises(ValueError, match="shape"):
        KernelNeighborsDisplay.from_estimator(clf, [[0, 0]], 3, y=y[:5])


@pytest.mark.parametrize("kernel, step", [("tangent", -1), ("tangent", 2),
                                          ("euclidean", -1)])
def test_neighbors_display_holds_their_distances(circle, kernel, step):
    """The display held the neighbours' indices only: how near they are (the numbers a
    figure's caption quotes) had to be computed again. Against the loop Gram's
    ``sqrt(2 - 2 K_hat)`` and the Euclidean norm, brute force."""
    clf, X, y = circle
    anchors = np.array([[0.3, -0.2], [-0.6, 0.5]])
    disp = KernelNeighborsDisplay.from_estimator(clf, anchors, 6, y=y, kernel=kernel,
                                                 step=step)
    if kernel == "euclidean":
        full = np.linalg.norm(anchors[:, None] - X[None], axis=-1)
    else:
        full = np.sqrt(np.clip(2 - 2 * _loop_gram(clf, step, anchors, X), 0, None))
    np.testing.assert_allclose(disp.distances,
                               np.take_along_axis(full, disp.neighbors, axis=1),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(disp.distances, np.sort(full, axis=1)[:, :6],
                               rtol=1e-9, atol=1e-12)


def _assert_values_on_colour_bar(disp, values):
    """Each neighbour's face colour is ``coolwarm`` of its value on the values' range,
    with a colour bar, and ``purity``, which counts labels, refuses them."""
    import matplotlib as mpl

    assert disp.colorbar_ is not None
    norm = mpl.colors.Normalize(values.min(), values.max())
    disp.figure_.canvas.draw()  # the values' colours are mapped when drawn
    for idx, scatter in zip(disp.neighbors, disp.neighbor_scatters_):
        np.testing.assert_allclose(scatter.get_facecolors(),
                                   mpl.colormaps["coolwarm"](norm(values[idx])), atol=1e-12)
    with pytest.raises(ValueError, match="continuous"):
        disp.purity()


def test_neighbors_of_a_regressor_draw_values_on_a_colour_bar():
    """A regressor's continuous predictions (or targets) were coded by rank as classes:
    colours spaced by rank, not value, no scale, and a purity of 1 / n_neighbors for any
    neighbourhood. Values are drawn on the map by value, with a colour bar; purity,
    which counts labels, is refused."""
    X, y = make_circle(n_samples=30, random_state=0)
    target = np.sin(3 * X[:, 0]) + X[:, 1]
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
                            random_state=0).fit(X, target)
    anchors = np.array([[0.1, 0.2], [-0.5, 0.3]])
    for given, values in ((None, reg.predict(X)), (target, target)):
        disp = KernelNeighborsDisplay.from_estimator(reg, anchors, 5, y=given)
        _assert_values_on_colour_bar(disp, values)
    # Labels said to be labels (continuous=False) stay classes, without a colour bar, and
    # keep their purity.
    disp = KernelNeighborsDisplay.from_estimator(reg, anchors, 5, y=y, continuous=False)
    assert disp.colorbar_ is None
    np.testing.assert_allclose(
        disp.purity(), [np.unique(y[i], return_counts=True)[1].max() / 5
                        for i in disp.neighbors])


def test_neighbors_of_integer_valued_regression_targets_are_values():
    """A regression target of integer values in a float array (scikit-learn's
    ``load_diabetes``: 214 distinct values, all integers) is "multiclass" to
    ``type_of_target``: the display drew each value as a class of its own (colours by
    rank, no colour bar) and gave a purity of ``1 / n_neighbors``. A regressor's float
    targets are values (its int ones too, see
    test_a_regressors_int_targets_are_values_a_classifiers_labels); ``continuous`` says
    it for a display built by hand, and keeps a regressor's int grouping classes."""
    X, labels = make_circle(n_samples=30, random_state=0)
    target = np.round(40 * X[:, 0] + 7 * X[:, 1] + 150)  # float64, integer-valued
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
                            random_state=0).fit(X, target)
    anchors = np.array([[0.1, 0.2], [-0.5, 0.3]])
    disp = KernelNeighborsDisplay.from_estimator(reg, anchors, 5, y=target,
                                                 kernel="euclidean")
    assert disp.colorbar_ is not None
    by_hand = KernelNeighborsDisplay(X, target, anchors, disp.neighbors,
                                     continuous=True).plot()
    for shown in (disp, by_hand):
        _assert_values_on_colour_bar(shown, target)
    # The same values as labels, said so by hand: classes, with their purity.
    as_labels = KernelNeighborsDisplay(X, target, anchors, disp.neighbors,
                                       continuous=False).plot()
    assert as_labels.colorbar_ is None
    np.testing.assert_allclose(as_labels.purity(), [
        np.unique(target[i], return_counts=True)[1].max() / 5 for i in disp.neighbors])
    disp = KernelNeighborsDisplay.from_estimator(reg, anchors, 5, y=labels,
                                                 kernel="euclidean", continuous=False)
    assert disp.colorbar_ is None and disp.purity().shape == (2,)


# --------------------------------------------------------------------------- evolution
def test_kernel_evolution_equals_loop(circle):
    clf, X, _ = circle
    x = np.array([0.0, 0.0])
    Y = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [1.2, 0.0]])
    disp = KernelEvolutionDisplay.from_estimator(clf, x, Y, steps=[0, 2, -1])
    expected = np.vstack([_loop_gram(clf, k, x[None], Y)[0] for k in (0, 2, -1)])
    np.testing.assert_allclose(disp.kernel_values, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(disp.kernel_values[:, 0], 1.0)
    traj_steps = np.asarray(clf.trajectory_.steps)
    np.testing.assert_array_equal(disp.steps, traj_steps[[0, 2, len(traj_steps) - 1]])
    assert len(disp.lines_) == 4
    np.testing.assert_allclose(disp.lines_[2].get_ydata(), expected[:, 2])


def test_kernel_evolution_all_steps_default(circle):
    clf, X, _ = circle
    disp = KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3])
    assert disp.kernel_values.shape == (len(clf.trajectory_), 2)
    with pytest.raises(IndexError):
        KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], steps=[100])


def _cnn(n_features_in, n_outputs):
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, stride=2), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(18, n_outputs))


def test_kernel_evolution_names_the_form_of_one_input():
    """x is one input without its sample axis: a flattened image was read as rows and
    refused as not of shape (n_samples, ...), which x is documented not to have."""
    images = np.random.RandomState(0).uniform(size=(10, 1, 8, 8))
    est = PathKernelMachine(module=_cnn, max_iter=2, dtype="float64", random_state=0)
    est.fit(images, images.mean(axis=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"x is one input of shape \(1, 8, 8\).*\(64,\)"):
        KernelEvolutionDisplay.from_estimator(est, images[0].ravel(), images[1:3])
    disp = KernelEvolutionDisplay.from_estimator(est, images[0], images[1:3], steps=[-1])
    np.testing.assert_allclose(disp.kernel_values, _loop_gram(est, -1, images[:1], images[1:3]),
                               rtol=1e-9)


def test_kernel_evolution_spells_out_small_inputs_of_several_axes():
    """An input of at most 4 values is spelled out in the legend: for a 2 x 2 input
    each row of y_j is an array, and formatting it as a number failed with numpy's
    "unsupported format string passed to numpy.ndarray.__format__"."""
    X = np.random.RandomState(0).uniform(size=(10, 2, 2))

    def module(n_features_in, n_outputs):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3),
                                   torch.nn.Tanh(), torch.nn.Linear(3, n_outputs))

    est = PathKernelMachine(module=module, max_iter=2, tol=None, dtype="float64",
                            random_state=0).fit(X, X.sum(axis=(1, 2)))
    disp = KernelEvolutionDisplay.from_estimator(est, X[0], X[1:3], steps=[0, -1])
    expected = np.vstack([_loop_gram(est, k, X[:1], X[1:3])[0] for k in (0, -1)])
    np.testing.assert_allclose(np.column_stack([line.get_ydata() for line in disp.lines_]),
                               expected, rtol=1e-9)
    legend = [t.get_text() for t in disp.ax_.get_legend().get_texts()]
    assert legend == ["y=(" + ", ".join(f"{v:.3g}" for v in row) + ")"
                      for row in X[1:3].reshape(2, 4).tolist()]
    assert disp.ax_.get_ylabel().endswith(
        "x=(" + ", ".join(f"{v:.3g}" for v in X[0].ravel().tolist()) + ")")


def _record_full_batch_sgd(net, X, y, n_steps):
    """A user's loop: full-batch SGD at 0.1 on the squared error, recorded."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with PathRecorder(net, opt, n_samples=len(X)) as rec:
        for _ in range(n_steps):
            opt.zero_grad()
            (0.5 * (net(X) - y) ** 2).mean().backward()
            rec.set_batch(torch.arange(len(X)))
            opt.step()
    return rec


def test_kernel_evolution_of_a_recorded_token_network_without_its_inputs():
    """A network kept without its training inputs has no input form: one input of token
    ids (1-D) was read as rows and refused; it is one input."""
    rng = np.random.RandomState(0)
    X, y = torch.as_tensor(rng.randint(0, 5, size=(8, 3))), torch.randn(8, 1,
                                                                        dtype=torch.float64)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Flatten(),
                              torch.nn.Linear(6, 1)).double()
    recorded = _record_full_batch_sgd(net, X, y, n_steps=2).as_estimator()
    disp = KernelEvolutionDisplay.from_estimator(recorded, X[0].numpy(), X[1:4].numpy(),
                                                 normalized=False)
    J = jacobian_loop(net, X[:4].numpy())[:, 0].numpy()
    np.testing.assert_allclose(disp.kernel_values[-1], J[0] @ J[1:4].T, rtol=1e-10)


def test_kernel_evolution_refuses_a_sparse_x(circle):
    # np.asarray made it a 0-d object array: "setting an array element with a sequence".
    clf, X, _ = circle
    with pytest.raises(TypeError, match="Sparse data was passed for x"):
        KernelEvolutionDisplay.from_estimator(clf, sp.csr_matrix(X[:1]), X[1:3])


# --------------------------------------------------------------------------- rank gap
def test_rank_gap_equals_svd_rank():
    # ReLU units whose kink lies right of the training range are dead there and come
    # alive on the test range: the seeds' figure 7 mechanism, exactly.
    X_train = np.linspace(0, 1, 12).reshape(-1, 1)
    X_test = np.linspace(2, 4, 6).reshape(-1, 1)
    est = PathKernelMachine(hidden_layer_sizes=(6,), activation="relu", max_iter=4,
                            learning_rate_init=0.01, dtype="float64", device="cpu",
                            random_state=3).fit(X_train, 2 * X_train.ravel() + 1)
    # Above the Gram route's floor sqrt(n * eps) ~ 6e-8, far below the smallest
    # genuine singular value (~1e-2 relative).
    rtol = 1e-5
    disp = RankGapDisplay.from_estimator(est, X_train, X_test, rtol=rtol)
    for i, k in enumerate(range(len(est.trajectory_))):
        # Both counts against the training features' largest singular value.
        top = np.linalg.svd(_loop_jacobian(est, k, X_train)[:, 0, :], compute_uv=False)[0]
        for X, got in ((X_train, disp.rank_train[i]),
                       (np.vstack([X_train, X_test]), disp.rank_joint[i])):
            J = _loop_jacobian(est, k, X)[:, 0, :]
            s = np.linalg.svd(J, compute_uv=False)
            assert got == int((s > rtol * top).sum())
    np.testing.assert_array_equal(disp.rank_gap, disp.rank_joint - disp.rank_train)
    assert disp.rank_gap.max() > 0  # the setting shows a gap, so the check has teeth
    assert disp.rtol == rtol and len(disp.lines_) == 2


def test_rank_gap_default_rtol(circle):
    clf, X, _ = circle
    disp = RankGapDisplay.from_estimator(clf, X[:10], X[10:20], steps=[-1])
    assert disp.rtol == pytest.approx(np.sqrt(20 * np.finfo(np.float64).eps))
    with pytest.raises(ValueError, match="rtol"):
        RankGapDisplay.from_estimator(clf, X[:10], X[10:20], rtol=2.0)


@pytest.mark.parametrize("labels", ["ab", 3])
def test_labels_that_are_not_a_sequence_are_refused(circle, labels):
    # A string was taken for one label per character; an int failed in len().
    clf, X, _ = circle
    y = np.array([0, 0, 1, 1])
    with pytest.raises(TypeError, match="display_labels must be a sequence of labels"):
        KernelMatrixDisplay.from_estimator(clf, X[:4], y, display_labels=labels)
    with pytest.raises(TypeError, match="labels must be a sequence of labels"):
        KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], labels=labels)


def test_an_array_for_a_string_option_is_named(circle):
    # The option's check compared elementwise and failed with numpy's "truth value of
    # an array is ambiguous".
    clf, X, _ = circle
    with pytest.raises(ValueError, match="kernel must be one of"):
        KernelMatrixDisplay.from_estimator(clf, X[:5], kernel=np.array(["tangent"] * 2))
    with pytest.raises(ValueError, match="method must be 'auto'"):
        TangentEmbeddingDisplay.from_estimator(clf, X[:5], method=np.array(["pca"] * 2))


@pytest.mark.parametrize("rtol", ["0.1", [0.1], True])
def test_rank_gap_rtol_of_another_type_is_a_clear_type_error(circle, rtol):
    # A string or a list failed inside np.isfinite or the comparison, in numpy's words;
    # True was taken for 1 and refused as out of range.
    clf, X, _ = circle
    with pytest.raises(TypeError, match=r"rtol must be a float in \[0, 1\) or None"):
        RankGapDisplay.from_estimator(clf, X[:10], X[10:20], steps=[-1], rtol=rtol)


# --------------------------------------------------------------------------- embedding
def test_tangent_embedding_pca_equals_kernel_pca_of_loop_gram(circle):
    clf, X, y = circle
    disp = TangentEmbeddingDisplay.from_estimator(clf, X, y, step=0, method="pca")
    expected = KernelPCA(n_components=2, kernel="precomputed").fit_transform(
        _loop_gram(clf, 0, X))
    # Kernel PCA components are defined up to sign.
    for j in range(2):
        sign = np.sign(disp.embedding[:, j] @ expected[:, j])
        np.testing.assert_allclose(sign * disp.embedding[:, j], expected[:, j], atol=1e-7)
    assert "kernel PCA" in disp.ax_.get_title()
    assert "step 0" in disp.ax_.get_title()


def test_tangent_embedding_distances_place_a_zero_feature_at_the_origin(monkeypatch):
    """t-SNE's precomputed distances are those of the normalized dense Jacobian features,
    a zero feature (x = 0 in a network without biases) at the origin: 1 from the others,
    0 from another zero row (it was put at sqrt(2) from everything)."""
    net, X = zero_feature_network()
    seen = []

    class Capture(TSNE):
        def fit_transform(self, D, y=None):
            seen.append(D)
            return np.zeros((len(D), 2))

    monkeypatch.setattr(plotting, "TSNE", Capture)
    TangentEmbeddingDisplay.from_estimator(net, X, method="tsne")
    phi = jacobian_loop(net.module, X).reshape(len(X), -1).numpy()
    norm = np.linalg.norm(phi, axis=1, keepdims=True)
    phi = np.divide(phi, norm, out=np.zeros_like(phi), where=norm > 0)
    np.testing.assert_allclose(seen[0], np.linalg.norm(phi[:, None] - phi[None], axis=2),
                               atol=1e-7)
    assert seen[0][2, 5] == 0.0


@pytest.mark.parametrize("method", ["pca", "tsne"])
def test_tangent_embedding_is_an_array_under_a_global_pandas_output(circle, method):
    """set_config(transform_output="pandas") made the documented ndarray a DataFrame."""
    clf, X, y = circle
    disp = TangentEmbeddingDisplay.from_estimator(clf, X[:20], y[:20], method=method)
    with sklearn.config_context(transform_output="pandas"):
        under_pandas = TangentEmbeddingDisplay.from_estimator(clf, X[:20], y[:20],
                                                              method=method)
    assert type(under_pandas.embedding) is np.ndarray
    np.testing.assert_array_equal(under_pandas.embedding, disp.embedding)


def test_tangent_embedding_auto_names_its_method(circle):
    clf, X, y = circle
    disp = TangentEmbeddingDisplay.from_estimator(clf, X[:20], y[:20], method="auto")
    try:
        import umap  # noqa: F401

        name = "UMAP"
    except ImportError:
        name = "t-SNE"
    assert disp.method == name and name in disp.ax_.get_title()
    assert disp.embedding.shape == (20, 2)
    with pytest.raises(ValueError, match="method"):
        TangentEmbeddingDisplay.from_estimator(clf, X, method="mds")


class _UMAPLike:
    """umap-learn 0.5's UMAP as far as its warnings go (read in umap/umap_.py): one
    for a precomputed metric, one when a seed overrides n_jobs other than 1, one when
    n_neighbors is not below the number of samples. The embedding is made up."""

    def __init__(self, n_neighbors=15, metric="euclidean", random_state=None, n_jobs=-1):
        self.n_neighbors, self.metric = n_neighbors, metric
        self.random_state, self.n_jobs = random_state, n_jobs

    def fit_transform(self, D):
        if self.metric == "precomputed":
            warnings.warn("using precomputed metric; inverse_transform will be unavailable",
                          stacklevel=2)
        if self.n_jobs != 1 and self.random_state is not None:
            warnings.warn(f"n_jobs value {self.n_jobs} overridden to 1 by setting "
                          "random_state. Use no seed for parallelism.", stacklevel=2)
        if self.n_neighbors >= D.shape[0]:
            warnings.warn("n_neighbors is larger than the dataset size; truncating to "
                          "X.shape[0] - 1", stacklevel=2)
        return np.random.RandomState(0).normal(size=(D.shape[0], 2))


@pytest.mark.parametrize("n", [12, 40])
def test_tangent_embedding_umap_warns_nothing_of_its_own_choices(circle, monkeypatch, n):
    # UMAP told the display's user of the display's choices: a precomputed metric has
    # no inverse_transform, the default seed runs on one job, and (under 16 samples)
    # its 15 neighbours are truncated to n - 1.
    clf, X, y = circle
    umap = type(sys)("umap")
    umap.UMAP = _UMAPLike
    monkeypatch.setitem(sys.modules, "umap", umap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        disp = TangentEmbeddingDisplay.from_estimator(clf, X[:n], y[:n], method="auto")
    assert disp.method == "UMAP" and disp.embedding.shape == (n, 2)


def test_displays_refuse_label_sets_with_a_clear_error():
    """A multilabel classifier's predictions and targets are label sets (n, L): the
    displays colour and count one label per sample, and say so instead of failing inside
    matplotlib or returning a purity of the indicator's 0/1 entries."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(30, 2))
    Y = np.c_[X[:, 0] > 0, X[:, 1] > 0].astype(int)
    est = PathKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, random_state=0).fit(X, Y)
    with pytest.raises(ValueError, match="pass one label column"):
        KernelNeighborsDisplay.from_estimator(est, [[0.0, 0.0]], n_neighbors=5,
                                              kernel="euclidean")
    disp = KernelNeighborsDisplay.from_estimator(est, [[0.0, 0.0]], n_neighbors=5,
                                                 kernel="euclidean", y=Y[:, 0])
    # One label column: the share of the anchor's neighbours in its commonest label.
    column = Y[np.asarray(disp.neighbors)[0], 0]
    assert disp.purity()[0] == np.bincount(column).max() / len(column)
    disp.y = Y
    with pytest.raises(ValueError, match="pass one label column"):
        disp.purity()
    with pytest.raises(ValueError, match="pass one label column"):
        TangentEmbeddingDisplay.from_estimator(est, X, Y, method="pca")
    with pytest.raises(ValueError, match="pass one label column"):
        KernelMatrixDisplay.from_estimator(est, X, Y)


def test_displays_refuse_dataframe_columns_other_than_the_fit():
    # The estimator's verbs refuse columns renamed or reordered since fit; the displays
    # took them by position and drew the kernel of other features.
    rng = np.random.RandomState(1)
    df = pd.DataFrame(rng.uniform(-1, 1, size=(30, 2)), columns=["u", "v"])
    y = np.where(df.u * df.v > 0, 1, -1)
    clf = PathKernelClassifier(hidden_layer_sizes=(5,), max_iter=2, tol=None, dtype="float64",
                               random_state=0).fit(df, y)
    calls = {
        "matrix": lambda Z: KernelMatrixDisplay.from_estimator(clf, Z.iloc[:8]),
        "neighbors": lambda Z: KernelNeighborsDisplay.from_estimator(clf, Z.iloc[:2],
                                                                      n_neighbors=5),
        "evolution": lambda Z: KernelEvolutionDisplay.from_estimator(clf, Z.iloc[:1],
                                                                      Z.iloc[:6]),
        "rank gap": lambda Z: RankGapDisplay.from_estimator(clf, Z.iloc[:20], Z.iloc[20:]),
        "embedding": lambda Z: TangentEmbeddingDisplay.from_estimator(clf, Z, y=y),
    }
    for call in calls.values():
        with warnings.catch_warnings():
            # Nothing to warn about (the neighbors display predicted on X_fit_, which has
            # lost its names, and warned that X has none).
            warnings.simplefilter("error")
            call(df)  # the fit's columns, in order
        for bad in (df[["v", "u"]], df.set_axis(["u", "w"], axis=1)):
            with pytest.raises(ValueError, match="feature names"):
                call(bad)
    # The matrix drawn from the DataFrame is the autograd loop's Gram of its values.
    shown = KernelMatrixDisplay.from_estimator(clf, df.iloc[:8]).kernel_matrix
    np.testing.assert_allclose(shown, _loop_gram(clf, -1, df.to_numpy()[:8].copy()), rtol=1e-10,
                               atol=1e-12)


def test_displays_take_a_pipeline_as_its_last_step_on_transformed_inputs():
    """As scikit-learn's displays take a fitted Pipeline: the network is its last step's,
    read on the inputs the steps before it give that step (the README's model is
    make_pipeline(StandardScaler(), PathKernelClassifier()))."""
    rng = np.random.RandomState(2)
    X = rng.uniform(-3, 5, size=(30, 2)) * [1.0, 20.0]
    y = np.where(X[:, 0] > 1, 1, -1)
    pipe = make_pipeline(StandardScaler(), PathKernelClassifier(
        hidden_layer_sizes=(5,), max_iter=3, tol=None, dtype="float64", random_state=0))
    pipe.fit(X, y)
    clf, Z = pipe[-1], pipe[0].transform(X)
    assert np.abs(Z - X).max() > 1  # the steps change the inputs: the check can fail
    same = [
        (lambda e, A: KernelMatrixDisplay.from_estimator(e, A[:9], y[:9]), "kernel_matrix"),
        (lambda e, A: KernelNeighborsDisplay.from_estimator(e, A[:2], 4), "neighbors"),
        (lambda e, A: KernelEvolutionDisplay.from_estimator(e, A[0], A[1:4]), "kernel_values"),
        (lambda e, A: RankGapDisplay.from_estimator(e, A[:20], A[20:]), "rank_joint"),
        (lambda e, A: TangentEmbeddingDisplay.from_estimator(e, A[:12], method="pca"),
         "embedding"),
    ]
    for make, attr in same:
        np.testing.assert_allclose(getattr(make(pipe, X), attr), getattr(make(clf, Z), attr),
                                   rtol=1e-12, atol=1e-14)
    # The matrix is the autograd loop's Gram of the transformed inputs.
    shown = KernelMatrixDisplay.from_estimator(pipe, X[:6]).kernel_matrix
    np.testing.assert_allclose(shown, _loop_gram(clf, -1, Z[:6]), rtol=1e-10, atol=1e-12)
    with pytest.raises(NotFittedError):
        KernelMatrixDisplay.from_estimator(make_pipeline(StandardScaler(), clf.__class__()), X)


def test_the_evolution_display_takes_one_input_of_any_form_through_a_pipeline():
    """x has no sample axis: an array, a Series or a one-row DataFrame (what the steps
    may need), images too, goes through the steps as one row; more rows are refused."""
    rng = np.random.RandomState(3)
    df = pd.DataFrame(rng.normal(size=(20, 2)) * [1.0, 30.0], columns=["u", "v"])
    y = np.where(df.u > 0, 1, -1)
    net = dict(hidden_layer_sizes=(4,), max_iter=2, tol=None, dtype="float64", random_state=0)
    pipe = make_pipeline(StandardScaler().set_output(transform="pandas"),
                         PathKernelClassifier(**net)).fit(df, y)
    Z = pipe[0].transform(df).to_numpy()
    expected = KernelEvolutionDisplay.from_estimator(pipe[-1], Z[0], Z[1:4]).kernel_values
    for x in (df.iloc[0], df.iloc[:1], df.to_numpy()[0]):
        with warnings.catch_warnings():
            # Only the array: the scaler was fitted with names (scikit-learn's own warning).
            warnings.simplefilter("error" if hasattr(x, "iloc") else "ignore", UserWarning)
            got = KernelEvolutionDisplay.from_estimator(pipe, x, df.iloc[1:4]).kernel_values
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="one input, without the sample axis; got 2 rows"):
        KernelEvolutionDisplay.from_estimator(pipe, df.iloc[:2], df.iloc[1:4])
    # Images: x keeps its trailing shape; and a pipeline of the estimator alone.
    images = rng.normal(size=(12, 1, 4, 4))
    yi = np.arange(12) % 2
    cnn = PathKernelClassifier(module=lambda i, o: torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(16, o)), **net)
    doubled = make_pipeline(FunctionTransformer(lambda A: 2 * A), cnn).fit(images, yi)
    expected = KernelEvolutionDisplay.from_estimator(doubled[-1], 2 * images[0],
                                                     2 * images[1:3]).kernel_values
    np.testing.assert_allclose(KernelEvolutionDisplay.from_estimator(
        doubled, images[0], images[1:3]).kernel_values, expected, rtol=1e-12, atol=1e-14)
    alone = make_pipeline(PathKernelClassifier(**net)).fit(Z, y)
    np.testing.assert_allclose(
        KernelMatrixDisplay.from_estimator(alone, Z[:5]).kernel_matrix,
        KernelMatrixDisplay.from_estimator(alone[-1], Z[:5]).kernel_matrix)


def test_euclidean_neighbors_refuse_anchors_of_another_feature_count(circle):
    # The kernel neighbours are checked by kneighbors; the Euclidean ones failed in NumPy
    # ("operands could not be broadcast") or, for one feature, broadcast it against both
    # columns and failed drawing ("index 1 is out of bounds").
    clf, X, _ = circle
    for anchors in ([[0.3]], [[0.3, 0.0, 0.0]]):
        with pytest.raises(ValueError, match=r"anchors have \d features, .* expecting 2"):
            KernelNeighborsDisplay.from_estimator(clf, anchors, 3, kernel="euclidean")


def test_kernel_evolution_refuses_several_rows_as_x(circle):
    # x is one input: rows were flattened into one, so two rows of a 1-feature network
    # were taken as one input of 2 features, and the error blamed "X has 4 features".
    clf, X, _ = circle
    with pytest.raises(ValueError, match="one input, without the sample axis; got 2 rows"):
        KernelEvolutionDisplay.from_estimator(clf, X[:2], X[2:4])
    # One row with its sample axis is one input.
    got = KernelEvolutionDisplay.from_estimator(clf, X[:1], X[2:4], steps=[0, -1])
    expected = np.vstack([_loop_gram(clf, k, X[:1], X[2:4])[0] for k in (0, -1)])
    np.testing.assert_allclose(got.kernel_values, expected, rtol=1e-9, atol=1e-12)


def test_tangent_embedding_gives_every_class_its_own_colour(circle):
    # tab10 has 10 entries: indexing it past the last returned the last colour, so
    # classes 9, 10 and 11 were drawn, and named in the legend, in one colour.
    clf, X, _ = circle
    y = np.array([f"c{i:02d}" for i in range(12)])[np.arange(len(X)) % 12]
    disp = TangentEmbeddingDisplay.from_estimator(clf, X, y, method="pca")
    points = disp.scatter_.get_facecolors()
    classes = np.unique(y)
    colours = {tuple(points[np.flatnonzero(y == c)[0]]) for c in classes}
    assert len(colours) == len(classes)
    for c in classes:  # one colour per class
        assert len({tuple(p) for p in points[y == c]}) == 1
    # The legend names each class with its points' colour.
    legend = disp.ax_.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == list(classes)
    for handle, c in zip(legend.legend_handles, classes):
        np.testing.assert_allclose(handle.get_facecolor()[0],
                                   points[np.flatnonzero(y == c)[0]])


@pytest.mark.parametrize("display, args", [
    (KernelMatrixDisplay, ([[0.0, 0.0]],)),
    (KernelNeighborsDisplay, ([[0.0, 0.0]], 3)),
    (KernelEvolutionDisplay, ([0.0, 0.0], [[0.0, 0.0]])),
    (RankGapDisplay, ([[0.0, 0.0]], [[1.0, 1.0]])),
    (TangentEmbeddingDisplay, ([[0.0, 0.0]] * 3,)),
])
def test_from_estimator_without_matplotlib_fails_before_computing(circle, monkeypatch,
                                                                 display, args):
    # As scikit-learn's displays: the ImportError came only from plot, after the kernels
    # (minutes on a CNN) had been computed for nothing.
    import skpathkernel.plotting as plotting

    def computing(*args, **kwargs):
        raise AssertionError("computed before checking for matplotlib")

    monkeypatch.setattr(plotting, "network_of", computing)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=f"{display.__name__}.from_estimator requires "
                                          "matplotlib"):
        display.from_estimator(circle[0], *args)


def test_label_lists_of_the_wrong_length_are_refused_before_computing(circle, monkeypatch):
    # They failed in plot, after the kernels: an IndexError ("list index out of range")
    # for too few curve labels, matplotlib's "FixedLocator locations" for block labels.
    import skpathkernel.plotting as plotting

    clf, X, y = circle
    step_kernel = plotting.step_kernel

    def computing(*args, **kwargs):
        raise AssertionError("computed before checking the labels")

    monkeypatch.setattr(plotting, "step_kernel", computing)
    with pytest.raises(ValueError, match=r"labels must name each row of Y \(3\), got 1"):
        KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:4], labels=["a"])
    with pytest.raises(ValueError, match=r"display_labels must name each class \(2\), got 3"):
        KernelMatrixDisplay.from_estimator(clf, X, y, display_labels=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"labels must name each row of Y \(2\), got 3"):
        KernelEvolutionDisplay(np.arange(2), np.zeros((2, 2)), x=X[0], Y=X[:2],
                               labels=["a", "b", "c"]).plot()
    with pytest.raises(ValueError, match=r"display_labels must name each class \(2\), got 1"):
        KernelMatrixDisplay(np.eye(3), y=[0, 0, 1], display_labels=["a"]).plot()
    # Right lengths draw them, in order.
    monkeypatch.setattr(plotting, "step_kernel", step_kernel)
    disp = KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], labels=["p", "q"])
    assert [t.get_text() for t in disp.ax_.get_legend().get_texts()] == ["p", "q"]


def test_tangent_embedding_refuses_too_few_samples(circle):
    # One sample failed inside KernelPCA ("index 1 is out of bounds"), two inside t-SNE
    # on a perplexity the display chose ("perplexity (2.0) must be less than n_samples").
    clf, X, _ = circle
    with pytest.raises(ValueError, match="at least 2 samples, got 1"):
        TangentEmbeddingDisplay.from_estimator(clf, X[:1], method="pca")
    with pytest.raises(ValueError, match="at least 3 samples, got 2"):
        TangentEmbeddingDisplay.from_estimator(clf, X[:2], method="tsne")
    disp = TangentEmbeddingDisplay.from_estimator(clf, X[:3], method="tsne")
    assert disp.embedding.shape == (3, 2)


def test_steps_given_out_of_order_are_drawn_along_the_path(circle):
    # steps=[-1, 0, 2] drew the curves from the last step back to 0 and on to 2 (a
    # zigzag against "optimizer step"), and the rank's stairs in that order.
    clf, X, _ = circle
    last = len(clf.trajectory_) - 1
    traj_steps = np.asarray(clf.trajectory_.steps)
    disp = KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], steps=[-1, 0, 2, last])
    np.testing.assert_array_equal(disp.steps, traj_steps[[0, 2, last]])
    expected = np.vstack([_loop_gram(clf, k, X[:1], X[1:3])[0] for k in (0, 2, last)])
    np.testing.assert_allclose(disp.kernel_values, expected, rtol=1e-9, atol=1e-12)
    for line, column in zip(disp.lines_, expected.T):
        np.testing.assert_array_equal(line.get_xdata(), traj_steps[[0, 2, last]])
        np.testing.assert_allclose(line.get_ydata(), column, rtol=1e-9, atol=1e-12)
    rank = RankGapDisplay.from_estimator(clf, X[:10], X[10:15], steps=[-1, 0])
    np.testing.assert_array_equal(rank.steps, traj_steps[[0, last]])
    assert np.all(np.diff(rank.lines_[0].get_xdata()) > 0)


def test_kernel_evolution_refuses_a_series_x_with_other_names():
    # A Series is the natural one input of a DataFrame-fitted network; its names were
    # not checked, so one with the columns swapped was taken by position (the curves
    # moved by 0.15) and one with a renamed column was taken as it was.
    rng = np.random.RandomState(1)
    df = pd.DataFrame(rng.uniform(-1, 1, size=(30, 2)), columns=["u", "v"])
    y = np.where(df.u * df.v > 0, 1, -1)
    clf = PathKernelClassifier(hidden_layer_sizes=(5,), max_iter=2, tol=None,
                               dtype="float64", random_state=0).fit(df, y)
    Y = df.iloc[1:4]
    got = KernelEvolutionDisplay.from_estimator(clf, df.iloc[0], Y, steps=[-1])
    np.testing.assert_allclose(got.kernel_values,
                               _loop_gram(clf, -1, df.to_numpy()[:1].copy(), Y.to_numpy().copy()),
                               rtol=1e-10, atol=1e-12)
    for x in (df.iloc[0][["v", "u"]], df.iloc[0].set_axis(["u", "w"])):
        with pytest.raises(ValueError, match="feature names"):
            KernelEvolutionDisplay.from_estimator(clf, x, Y)


def test_neighbors_of_a_bare_network_ask_for_y(circle):
    # A TrainedNetwork has kneighbors but no predict: y=None failed with
    # "'TrainedNetwork' object has no attribute 'predict'"; given y, it is drawn.
    clf, X, y = circle
    with pytest.raises(TypeError, match="pass the training labels as y"):
        KernelNeighborsDisplay.from_estimator(clf.network_, [[0.5, 0.5]], 4)
    disp = KernelNeighborsDisplay.from_estimator(clf.network_, [[0.5, 0.5]], 4, y=y)
    K = _loop_gram(clf, -1, np.array([[0.5, 0.5]]), X)
    assert set(disp.neighbors[0].tolist()) == set(np.argsort(-K[0])[:4].tolist())


def test_euclidean_neighbors_refuse_a_bool_count(circle):
    # isinstance(True, numbers.Integral): True was taken for one neighbour, where the
    # kernels' neighbours (kneighbors) refuse it.
    clf, X, y = circle
    for kernel in ("tangent", "euclidean"):
        with pytest.raises(ValueError, match=r"n_neighbors must be an integer in \[1, 40\]"):
            KernelNeighborsDisplay.from_estimator(clf, [[0.5, 0.5]], True, y=y,
                                                  kernel=kernel)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"step": "a"}, ValueError, "step='a' applies to kernel='tangent'"),
    ({"step": 1.0}, ValueError, "step=1.0 applies to kernel='tangent'"),
    ({"step": 0}, ValueError, "step=0 applies to kernel='tangent'"),
    ({"step": True}, ValueError, "step=True applies to kernel='tangent'"),
    ({"normalized": "no"}, TypeError, "normalized must be a bool"),
])
def test_euclidean_neighbors_check_the_kernel_options(circle, kwargs, error, match):
    # Unused by the Euclidean distances, they were taken whatever they were; a step is
    # refused as kneighbors refuses one with the path kernel, which reads none either.
    clf, X, y = circle
    with pytest.raises(error, match=match):
        KernelNeighborsDisplay.from_estimator(clf, [[0.5, 0.5]], 3, y=y, kernel="euclidean",
                                              **kwargs)


def test_a_step_the_path_kernel_would_ignore_is_refused(circle):
    """KernelMatrixDisplay(kernel="path", step=3) drew the whole path's kernel under the
    caller's step=3 (kneighbors refused the same pair); the default step is taken."""
    clf, X, y = circle
    with pytest.raises(ValueError, match="step=3 applies to kernel='tangent'"):
        KernelMatrixDisplay.from_estimator(clf, X, y, kernel="path", step=3)
    disp = KernelMatrixDisplay.from_estimator(clf, X, kernel="path", normalized=False)
    np.testing.assert_allclose(disp.kernel_matrix, clf.path_kernel_(X), rtol=1e-12)


def test_neighbors_of_a_recorded_network():
    """A RecordedNetwork is taken by every display: the kernel neighbours failed with
    "'RecordedNetwork' object has no attribute 'kneighbors'", y=None coloured by its
    predict (raw outputs, shape (n, 1)) and was refused as a multilabel indicator, and
    one kept without X_train failed with "'NoneType' object has no attribute 'ndim'"."""
    rng = np.random.RandomState(0)
    X = torch.as_tensor(rng.uniform(-1, 1, size=(12, 2)))
    target = torch.as_tensor(np.sin(3 * X[:, :1].numpy()))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                              torch.nn.Linear(4, 1)).double()
    rec = _record_full_batch_sgd(net, X, target, n_steps=3)
    recorded = rec.as_estimator(X, target)
    labels = np.arange(12) % 3
    anchors = np.array([[0.3, -0.2], [-0.5, 0.4]])
    for step in (0, -1):
        disp = KernelNeighborsDisplay.from_estimator(recorded, anchors, 4, y=labels,
                                                     step=step)
        K = _loop_gram(recorded, step, anchors, X.numpy())
        for got, row, drawn in zip(disp.neighbors, K, disp.neighbor_scatters_):
            assert set(got.tolist()) == set(np.argsort(-row)[:4].tolist())
            np.testing.assert_array_equal(drawn.get_offsets(), X.numpy()[got])
    with pytest.raises(TypeError, match="pass the training labels as y"):
        KernelNeighborsDisplay.from_estimator(recorded, anchors, 4)
    with pytest.raises(ValueError, match="needs the training inputs"):
        KernelNeighborsDisplay.from_estimator(rec.as_estimator(), anchors, 4, y=labels)


def test_neighbors_of_an_outlier_detector_are_coloured_by_its_predictions():
    # Refusing y=None for what predicts no labels (a RecordedNetwork) keeps the
    # estimators that do: an outlier detector's +1 / -1.
    X = np.random.RandomState(0).uniform(-1, 1, size=(20, 2))
    det = OODRankDetector(PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, tol=None,
                                            dtype="float64", random_state=0))
    det.fit(X, X[:, 0])
    disp = KernelNeighborsDisplay.from_estimator(det, [[0.1, 0.2]], 3)
    np.testing.assert_array_equal(disp.y, det.predict(X))


def test_string_classes_and_a_two_output_regressor_against_references():
    """String labels order the blocks and ticks as sorted; a regressor's outputs enter
    every display through the trace kernel, the features' full Jacobian."""
    rng = np.random.RandomState(4)
    X = rng.uniform(-1, 1, size=(15, 2))
    names = np.array(["cat", "ant", "bee"])[np.arange(15) % 3]
    net = dict(hidden_layer_sizes=(4,), max_iter=3, tol=None, solver="sgd",
               learning_rate_init=0.2, dtype="float64", random_state=0)
    clf = PathKernelClassifier(**net).fit(X, names)
    disp = KernelMatrixDisplay.from_estimator(clf, X, names)
    order = np.argsort(names, kind="stable")
    np.testing.assert_allclose(disp.kernel_matrix, _loop_gram(clf, -1, X[order]),
                               rtol=1e-9, atol=1e-12)
    assert [t.get_text() for t in disp.ax_.get_xticklabels()] == ["ant", "bee", "cat"]
    np.testing.assert_allclose(disp.ax_.get_xticks(), [2, 7, 12])  # block centres
    reg = PathKernelMachine(**net).fit(X, np.c_[np.sin(3 * X[:, 0]), X[:, 1] ** 2])
    disp = KernelMatrixDisplay.from_estimator(reg, X[:6], step=1, normalized=False)
    np.testing.assert_allclose(disp.kernel_matrix, _loop_gram(reg, 1, X[:6], normalized=False),
                               rtol=1e-9, atol=1e-12)
    ranks = RankGapDisplay.from_estimator(reg, X[:4], X[4:7], steps=[0, -1], rtol=1e-6)
    for i, k in enumerate((0, -1)):
        for rows, got in ((X[:4], ranks.rank_train[i]), (X[:7], ranks.rank_joint[i])):
            s = np.linalg.svd(_loop_jacobian(reg, k, rows).reshape(len(rows), -1),
                              compute_uv=False)
            assert got == int((s > 1e-6 * s.max()).sum())
    embedding = TangentEmbeddingDisplay.from_estimator(reg, X, method="pca").embedding
    F = _loop_jacobian(reg, -1, X).reshape(len(X), -1)
    F = F / np.linalg.norm(F, axis=1, keepdims=True)  # K_hat's features
    U, S, _ = np.linalg.svd(F - F.mean(0), full_matrices=False)
    np.testing.assert_allclose(np.abs(embedding), np.abs(U[:, :2] * S[:2]), atol=1e-9)


def test_titles_name_the_recorded_point_and_its_optimizer_step():
    """With record_every=3 point 3 is optimizer step 9 (the x-axes count optimizer
    steps): the titles said "recorded step 3"."""
    X, y = make_circle(n_samples=40, random_state=0)
    clf = PathKernelClassifier(hidden_layer_sizes=(4,), batch_size=40, max_iter=10, tol=None,
                               record_every=3, random_state=0).fit(X, y)
    # Full batch: one step per epoch, points at steps 0, 3, 6, 9 and the last, 10.
    for step, expected in ((3, "recorded point 3 (optimizer step 9)"),
                           (-1, "recorded point 4 (optimizer step 10)")):
        titles = [
            KernelMatrixDisplay.from_estimator(clf, X, y, step=step).ax_.get_title(),
            KernelNeighborsDisplay.from_estimator(clf, X[:1], n_neighbors=5,
                                                  step=step).ax_.get_title(),
            TangentEmbeddingDisplay.from_estimator(clf, X, y, step=step,
                                                   method="pca").ax_.get_title(),
        ]
        assert all(expected in t for t in titles), titles


def test_keywords_that_clash_with_the_displays_own_fail_early_or_win(circle, monkeypatch):
    """A colour of the user's where the embedding colours by class is refused before
    the embedding is computed; a line label of the user's is drawn (it raised)."""
    clf, X, y = circle
    monkeypatch.setattr("skpathkernel.plotting.KernelPCA", None)  # must not be reached
    for key in ("c", "color"):
        with pytest.raises(ValueError, match=f"{key}= conflicts with the colouring"):
            TangentEmbeddingDisplay.from_estimator(clf, X, y, method="pca", **{key: "red"})
    monkeypatch.undo()
    disp = TangentEmbeddingDisplay.from_estimator(clf, X, method="pca", color="red")
    assert np.allclose(disp.scatter_.get_facecolors()[:, :3], [1, 0, 0])
    disp = KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], label="mine")
    assert [line.get_label() for line in disp.lines_] == ["mine", "mine"]


@pytest.mark.parametrize("integers", [False, True])
def test_tangent_embedding_of_regression_targets_draws_values_on_a_colour_bar(integers):
    """Continuous y made one legend entry per sample (np.unique of floats); it is drawn
    on a sequential map, each point's colour the map's at its value. So is a regressor's
    float target of integers (load_diabetes'), which type_of_target calls "multiclass"
    and the display drew as one class per value."""
    import matplotlib as mpl

    X, y = make_circle(n_samples=30, random_state=0)
    target = np.sin(3 * X[:, 0]) + X[:, 1]
    if integers:
        target = np.round(40 * target + 150)
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None,
                            random_state=0).fit(X, target)
    disp = TangentEmbeddingDisplay.from_estimator(reg, X, target, method="pca")
    assert disp.ax_.get_legend() is None and disp.colorbar_ is not None
    norm = mpl.colors.Normalize(target.min(), target.max())
    disp.figure_.canvas.draw()  # the values' colours are mapped when drawn
    np.testing.assert_allclose(disp.scatter_.get_facecolors(),
                               mpl.colormaps["viridis"](norm(target)), atol=1e-12)
    # Labels said to be labels stay classes with a legend.
    disp = TangentEmbeddingDisplay.from_estimator(reg, X, y, method="pca", continuous=False)
    assert disp.colorbar_ is None and len(disp.ax_.get_legend().get_texts()) == 2
    # Said by hand: values, or the same numbers as labels.
    E = disp.embedding
    assert TangentEmbeddingDisplay(E, target, continuous=True).plot().colorbar_ is not None
    as_labels = TangentEmbeddingDisplay(E, target, continuous=False).plot()
    assert as_labels.colorbar_ is None
    assert len(as_labels.ax_.get_legend().get_texts()) == len(np.unique(target))


@pytest.mark.parametrize("integer_valued", [False, True])
def test_kernel_matrix_refuses_a_regression_target_as_classes(integer_valued):
    """A regressor's float target was taken as classes: sorted, with a boundary line
    between every two rows of distinct values (19 pairs of lines for 20 rows). Refused
    now, before any kernel is computed; the same regressor with int labels (a grouping)
    still outlines its blocks."""
    X, labels = make_circle(n_samples=20, random_state=0)
    target = 40 * X[:, 0] + 7 * X[:, 1] + 150
    target = np.round(target) if integer_valued else target
    reg = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, tol=None, dtype="float64",
                            random_state=0).fit(X, target)
    with pytest.raises(ValueError, match="continuous values"):
        KernelMatrixDisplay.from_estimator(reg, X, target)
    disp = KernelMatrixDisplay.from_estimator(reg, X, labels)
    assert len(disp.boundary_lines_) == 2 * (len(np.unique(labels)) - 1)
    plt.close("all")


# --------------------------------------------------------------------------- s54
def test_neighbors_and_rank_gap_take_keywords_for_their_artists(circle):
    """KernelNeighborsDisplay and RankGapDisplay took no matplotlib keywords where the
    other displays do (im_kw, **line_kw, **scatter_kw): each artist gets its own, over
    the display's defaults, and the data and colours by y stay what they were."""
    import matplotlib as mpl

    clf, X, y = circle
    anchors = np.array([[0.2, 0.1], [-0.4, 0.5]])
    disp = KernelNeighborsDisplay.from_estimator(
        clf, anchors, 4, y=y, kernel="euclidean", scatter_kw={"s": 3, "alpha": 0.5},
        neighbor_kw={"marker": "*", "s": 40}, anchor_kw={"color": "tab:green", "s": 50})
    # Brute-force Euclidean neighbours, as drawn.
    brute = np.argsort(np.linalg.norm(anchors[:, None] - X[None], axis=-1), axis=1,
                       kind="stable")[:, :4]
    np.testing.assert_array_equal(disp.neighbors, brute)
    assert disp.scatter_.get_sizes().tolist() == [3] and disp.scatter_.get_alpha() == 0.5
    star = mpl.markers.MarkerStyle("*")
    star = star.get_path().transformed(star.get_transform()).vertices
    disp.figure_.canvas.draw()
    norm = mpl.colors.Normalize(0, 1)
    codes = (y == 1).astype(float)  # classes -1, 1 coded 0, 1
    for idx, scatter in zip(brute, disp.neighbor_scatters_):
        np.testing.assert_array_equal(scatter.get_offsets(), X[idx])
        assert scatter.get_sizes().tolist() == [40]
        np.testing.assert_allclose(scatter.get_paths()[0].vertices, star)
        np.testing.assert_allclose(scatter.get_facecolors(),
                                   mpl.colormaps["coolwarm"](norm(codes[idx])), atol=1e-12)
    # The legend names each anchor with the marker its neighbours have.
    for handle in disp.ax_.get_legend().legend_handles:
        np.testing.assert_allclose(handle.get_paths()[0].vertices, star)
    np.testing.assert_allclose(disp.anchor_scatter_.get_facecolors(),
                               [mpl.colors.to_rgba("tab:green")])
    assert disp.anchor_scatter_.get_sizes().tolist() == [50]
    # The colours are y's: a colour of the user's is refused before anything is drawn.
    for kw in ({"scatter_kw": {"color": "k"}}, {"neighbor_kw": {"c": "k"}}):
        with pytest.raises(ValueError, match="colouring of the points by y"):
            disp.plot(ax=disp.ax_, **kw)
        with pytest.raises(ValueError, match="colouring of the points by y"):
            KernelNeighborsDisplay.from_estimator(clf, anchors, 4, y=y, **kw)
    with pytest.raises(TypeError, match="anchor_kw must be a dict"):
        disp.plot(anchor_kw=["x"])

    rank = RankGapDisplay.from_estimator(clf, X[:10], X[10:14], linewidth=3, where="mid")
    for line, ranks, colour in zip(rank.lines_, (rank.rank_train, rank.rank_joint),
                                   ("tab:blue", "tab:red")):
        assert line.get_linewidth() == 3 and line.get_drawstyle() == "steps-mid"
        assert line.get_color() == colour
        np.testing.assert_array_equal(line.get_ydata(), ranks)
    rank.plot(color="black")
    assert [line.get_color() for line in rank.lines_] == ["black", "black"]
    assert [line.get_linestyle() for line in rank.lines_] == ["-", "--"]


def _colour_bar_displays():
    """Displays built by hand, one of each, the three with colour bars first."""
    rng = np.random.RandomState(0)
    X = rng.normal(size=(12, 2))
    values = rng.normal(size=12)
    K = np.corrcoef(rng.normal(size=(12, 5)))
    return [
        KernelMatrixDisplay(K, y=np.repeat([0, 1, 2], 4)),
        KernelNeighborsDisplay(X, values, X[:2], np.array([[0, 3, 4], [1, 5, 6]]),
                               continuous=True),
        TangentEmbeddingDisplay(X, values, continuous=True),
        RankGapDisplay(np.arange(4), [1, 2, 2, 3], [1, 3, 3, 4], rtol=1e-7),
        KernelEvolutionDisplay(np.arange(4), rng.normal(size=(4, 2)), x=X[0], Y=X[1:3]),
    ]


@pytest.mark.parametrize("index", range(5))
def test_plotting_again_on_the_same_axes_redraws_with_one_colour_bar(index):
    """A second plot(ax=ax_) stacked a second colour bar beside the first (and drew
    the lines, points and legend entries twice). scikit-learn's ConfusionMatrixDisplay
    makes a new figure when no axes is given, as these do; on the axes it drew on, the
    display now replaces its drawing."""
    disp = _colour_bar_displays()[index].plot()
    fig, ax = disp.figure_, disp.ax_
    n_axes, n_children = len(fig.axes), len(ax.get_children())
    assert n_axes == (2 if index < 3 else 1)
    legend = ax.get_legend()
    n_entries = None if legend is None else len(legend.get_texts())
    position = ax.get_position().bounds
    disp.plot(ax=ax)
    assert disp.figure_ is fig and len(fig.axes) == n_axes
    assert len(ax.get_children()) == n_children
    assert (None if ax.get_legend() is None else len(ax.get_legend().get_texts())) \
        == n_entries
    np.testing.assert_allclose(ax.get_position().bounds, position)
    if index < 3:
        assert disp.colorbar_.ax in fig.axes
    # No axes: a new figure, the first one left as it was.
    disp.plot()
    assert disp.figure_ is not fig and len(fig.axes) == n_axes
    assert len(disp.figure_.axes) == n_axes
    # Another axes of the first figure: the first drawing and its colour bar stay.
    other = fig.add_subplot(2, 2, 4)
    disp.plot(ax=other)
    assert len(fig.axes) == 2 * n_axes  # the other axes, and its colour bar if any
    assert len(ax.get_children()) == n_children


def test_tsne_takes_its_keywords_checked_before_the_kernel(circle, monkeypatch):
    """t-SNE's perplexity was fixed at min(30, max(2, (n - 1) / 3)) with no way to
    pass another (nor UMAP's or KernelPCA's options). method_kw reaches the estimator;
    a perplexity not under the number of samples, which TSNE refused only in fit after
    the kernel, the keywords the display sets itself, and method_kw with method="auto"
    (whose estimator depends on what is installed) are refused first."""
    clf, X, _ = circle
    A = X[:9]
    K = _loop_gram(clf, -1, A)
    D = np.sqrt(np.clip(2 - 2 * K, 0, None))
    np.fill_diagonal(D, 0.0)
    kw = {"perplexity": 4.5, "max_iter": 250, "early_exaggeration": 6.0}
    disp = TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne", method_kw=kw,
                                                  random_state=0)
    by_hand = TSNE(n_components=2, metric="precomputed", init="random", random_state=0,
                   **kw).fit_transform(D)
    np.testing.assert_allclose(disp.embedding, by_hand, rtol=1e-5, atol=1e-5)
    default = TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne", random_state=0)
    assert np.abs(default.embedding - disp.embedding).max() > 1e-2  # the keywords mattered
    # Kernel PCA's options too: a dense solver gives the same directions (up to sign).
    pca = TangentEmbeddingDisplay.from_estimator(clf, A, method="pca",
                                                 method_kw={"eigen_solver": "dense"})
    ref = KernelPCA(n_components=2, kernel="precomputed").fit_transform(K)
    np.testing.assert_allclose(np.abs(pca.embedding), np.abs(ref), atol=1e-8)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was computed before the refusal")

    monkeypatch.setattr(plotting, "step_kernel", no_kernel)
    for method, kw, match in [
        ("tsne", {"perplexity": 9}, "perplexity=9 .* needs at least 10 samples, got 9"),
        ("tsne", {"perplexity": 0.0}, r"method_kw: The 'perplexity' parameter of TSNE must "
                                      r"be a float in the range \(0.0, inf\)"),
        ("tsne", {"metric": "euclidean"}, "metric is set by the display"),
        ("tsne", {"random_state": 1}, "random_state is set by the display"),
        ("pca", {"n_components": 3}, "n_components is set by the display"),
        ("auto", {"perplexity": 3}, "name the method"),
    ]:
        with pytest.raises(ValueError, match=match):
            TangentEmbeddingDisplay.from_estimator(clf, A, method=method, method_kw=kw)
    with pytest.raises(TypeError, match="'perplexity' parameter of TSNE must be a float"):
        TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne",
                                               method_kw={"perplexity": "3"})
    with pytest.raises(TypeError, match="'perplexit' is not an option of TSNE"):
        TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne",
                                               method_kw={"perplexit": 3})


def _count_kernels(monkeypatch):
    """Replace the kernel by one that counts its calls and fails: a refusal must come
    before it (the expensive part)."""
    calls = []

    def no_kernel(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the kernel was computed before the refusal")

    monkeypatch.setattr(plotting, "step_kernel", no_kernel)
    return calls


@pytest.mark.parametrize("method, kw, error, match", [
    # Combinations with the display's precomputed distances / kernel, refused by the
    # estimators only in fit, on the kernel.
    ("tsne", {"init": "pca"}, ValueError, "init='pca' takes the principal components"),
    ("pca", {"fit_inverse_transform": True}, ValueError, "fit_inverse_transform=True"),
    ("pca", {"remove_zero_eig": True}, ValueError, "remove_zero_eig=True drops"),
    # An initial embedding that is not one 2-D point per sample (TSNE failed in a
    # reshape, or in a cast for ints).
    ("tsne", {"init": np.zeros((8, 2))}, ValueError,
     r"init must be an array of finite floats of shape \(9, 2\).* got float64 of shape "
     r"\(8, 2\)"),
    ("tsne", {"init": np.zeros((9, 2), dtype=int)}, ValueError, "got int64 of shape"),
    ("tsne", {"init": np.full((9, 2), np.nan)}, ValueError, "array of finite floats"),
    # Types and ranges: scikit-learn's _parameter_constraints, which fit checks first.
    ("tsne", {"perplexity": True}, TypeError, "perplexity must be a float, got True"),
    ("tsne", {"max_iter": 10}, ValueError,
     r"method_kw: The 'max_iter' parameter of TSNE must be an int in the range \[250"),
    ("tsne", {"learning_rate": "fast"}, ValueError, "'learning_rate' parameter of TSNE"),
    ("tsne", {"early_exaggeration": 0.5}, ValueError, "'early_exaggeration' parameter"),
    ("tsne", {"method": "fast"}, ValueError, "'method' parameter of TSNE"),
    ("tsne", {"init": [[0.0, 0.0]] * 9}, TypeError, "'init' parameter of TSNE"),
    ("pca", {"eigen_solver": "lapack"}, ValueError, "'eigen_solver' parameter of KernelPCA"),
    ("pca", {"tol": -1.0}, ValueError, "'tol' parameter of KernelPCA"),
    ("pca", {"max_iter": 0}, ValueError, "'max_iter' parameter of KernelPCA"),
    # Unknown names, named with the closest option.
    ("pca", {"gama": 1.0}, TypeError,
     r"'gama' is not an option of KernelPCA \(did you mean 'gamma'\?\)"),
    ("tsne", {"no_such_option": 1}, TypeError, r"'no_such_option' is not an option of TSNE\.$"),
])
def test_embedding_options_are_checked_before_the_kernel(circle, monkeypatch, method, kw,
                                                         error, match):
    """Every method_kw option that TSNE or KernelPCA refused only in fit, after the
    tangent kernel, is refused first, naming the option; no kernel, no figure."""
    clf, X, _ = circle
    calls = _count_kernels(monkeypatch)
    figures = plt.get_fignums()
    with pytest.raises(error, match=match):
        TangentEmbeddingDisplay.from_estimator(clf, X[:9], method=method, method_kw=kw)
    assert calls == [] and plt.get_fignums() == figures


def test_an_initial_embedding_of_the_users_reaches_tsne(circle):
    """A float init of one point per sample passes the checks and is t-SNE's start: the
    embedding is TSNE's from that init by hand, and another init moves it."""
    clf, X, _ = circle
    A = X[:9]
    K = _loop_gram(clf, -1, A)
    D = np.sqrt(np.clip(2 - 2 * K, 0, None))
    np.fill_diagonal(D, 0.0)
    init = np.random.RandomState(1).normal(size=(9, 2)) * 1e-4
    kw = {"init": init, "perplexity": 3.0, "max_iter": 250}
    disp = TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne", method_kw=kw)
    by_hand = TSNE(metric="precomputed", random_state=0, **kw).fit_transform(D)
    np.testing.assert_allclose(disp.embedding, by_hand, rtol=1e-5, atol=1e-5)
    other = TangentEmbeddingDisplay.from_estimator(clf, A, method="tsne",
                                                   method_kw={**kw, "init": -init})
    assert np.abs(other.embedding - disp.embedding).max() > 1e-2


class _UMAPOptions(_UMAPLike):
    """_UMAPLike with the umap-learn options the display checks itself."""

    def __init__(self, n_neighbors=15, metric="euclidean", random_state=None, n_jobs=-1,
                 init="spectral", unique=False):
        super().__init__(n_neighbors, metric, random_state, n_jobs)
        self.init, self.unique = init, unique


@pytest.mark.parametrize("n, kw, error, match", [
    # umap-learn truncated n_neighbors past the samples with a warning, after the kernel.
    (12, {"n_neighbors": 12}, ValueError,
     r"UMAP embedding with n_neighbors=12 .* needs at least 13 samples, got 12"),
    (12, {"n_neighbors": 1}, ValueError, "n_neighbors must be an int of at least 2"),
    (12, {"n_neighbors": 4.5}, ValueError, r"n_neighbors must be an int .* got 4\.5"),
    (12, {"n_neighbors": True}, ValueError, "n_neighbors must be an int"),
    (12, {"unique": True}, ValueError, "unique=True drops duplicate input rows"),
    (12, {"init": np.zeros((12, 3))}, ValueError, r"shape \(12, 2\)"),
    (12, {"n_neighbours": 4}, TypeError, "did you mean 'n_neighbors'"),
    # The display's own n_neighbors (n - 1 = 1) was under umap's least, 2.
    (2, {}, ValueError, "UMAP embedding needs at least 3 samples, got 2"),
])
def test_umap_options_are_checked_before_the_kernel(circle, monkeypatch, n, kw, error,
                                                    match):
    """umap-learn is not installed in the test environment: a stand-in with its
    signature checks the display's own checks of UMAP's sample-dependent and
    precomputed-distance options (umap's other value checks stay its own, in fit)."""
    clf, X, _ = circle
    umap = type(sys)("umap")
    umap.UMAP = _UMAPOptions
    monkeypatch.setitem(sys.modules, "umap", umap)
    calls = _count_kernels(monkeypatch)
    with pytest.raises(error, match=match):
        TangentEmbeddingDisplay.from_estimator(clf, X[:n], method="umap", method_kw=kw)
    assert calls == []


def test_umap_takes_an_initial_embedding_of_ints(circle, monkeypatch):
    """umap-learn converts an init array to float32 (``check_array(self.init,
    dtype=np.float32)`` in its fit), so one of ints is a start to it; the display refused
    it with t-SNE's rule (floats only: t-SNE descends on the array in its own dtype). It
    reaches UMAP as given; a non-finite or misshapen one is still refused."""
    clf, X, _ = circle
    made = []

    class Capture(_UMAPOptions):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(kw)

    umap = type(sys)("umap")
    umap.UMAP = Capture
    monkeypatch.setitem(sys.modules, "umap", umap)
    init = np.arange(24).reshape(12, 2)
    disp = TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap",
                                                  method_kw={"init": init})
    assert disp.embedding.shape == (12, 2) and made[-1]["init"] is init
    calls = _count_kernels(monkeypatch)
    for bad in (np.full((12, 2), np.nan), init[:11], init.astype(str)):
        with pytest.raises(ValueError, match="init must be an array of finite numbers"):
            TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap",
                                                   method_kw={"init": bad})
    assert calls == []


def test_a_regressors_int_targets_are_values_a_classifiers_labels():
    """An int regression target (counts, ages) was drawn as one class per value, with
    a legend entry each, because type_of_target calls ints "multiclass". The estimator
    decides: a regressor's y is values whatever its dtype; a classifier's, and y under
    a network without an estimator's type, are read by type_of_target; continuous=
    says it either way."""
    import matplotlib as mpl

    X, labels = make_circle(n_samples=30, random_state=0)
    target = np.round(40 * X[:, 0] + 7 * X[:, 1] + 150).astype(np.int64)
    net = dict(hidden_layer_sizes=(4,), max_iter=3, tol=None, dtype="float64",
               random_state=0)
    reg = PathKernelMachine(**net).fit(X, target)
    anchors = np.array([[0.1, 0.2], [-0.5, 0.3]])
    disp = KernelNeighborsDisplay.from_estimator(reg, anchors, 5, y=target,
                                                 kernel="euclidean")
    _assert_values_on_colour_bar(disp, target.astype(float))
    emb = TangentEmbeddingDisplay.from_estimator(reg, X, target, method="pca")
    assert emb.ax_.get_legend() is None and emb.colorbar_ is not None
    emb.figure_.canvas.draw()
    norm = mpl.colors.Normalize(target.min(), target.max())
    np.testing.assert_allclose(emb.scatter_.get_facecolors(),
                               mpl.colormaps["viridis"](norm(target)), atol=1e-12)
    # Said to be labels: classes.
    emb = TangentEmbeddingDisplay.from_estimator(reg, X, target, method="pca",
                                                 continuous=False)
    assert emb.colorbar_ is None
    assert len(emb.ax_.get_legend().get_texts()) == len(np.unique(target))
    # A classifier's labels, int or float of integers, are classes; so are int labels
    # under a network without an estimator's type, whose float values are values.
    groups = np.digitize(X[:, 0], [-0.5, 0.0, 0.5])  # 4 classes
    clf = PathKernelClassifier(**net).fit(X, groups)
    for y in (groups, groups.astype(float)):
        disp = KernelNeighborsDisplay.from_estimator(clf, anchors, 5, y=y,
                                                     kernel="euclidean")
        assert disp.colorbar_ is None
        np.testing.assert_allclose(disp.purity(), [
            np.unique(groups[i], return_counts=True)[1].max() / 5 for i in disp.neighbors])
        emb = TangentEmbeddingDisplay.from_estimator(clf, X, y, method="pca")
        assert emb.colorbar_ is None and len(emb.ax_.get_legend().get_texts()) == 4
    emb = TangentEmbeddingDisplay.from_estimator(reg.network_, X, target, method="pca")
    assert emb.colorbar_ is None
    emb = TangentEmbeddingDisplay.from_estimator(reg.network_, X, target + 0.5,
                                                 method="pca")
    assert emb.colorbar_ is not None
    with pytest.raises(TypeError, match="continuous must be a bool"):
        TangentEmbeddingDisplay.from_estimator(reg, X, target, continuous="yes")


def test_displays_follow_a_nested_pipeline_and_refuse_ambiguous_wrappers():
    """A pipeline whose last step is a pipeline is followed down (both transforms, then
    the network), against doing it by hand; a bag and one estimator per output, whose
    networks saw other inputs or targets, are refused with the hint naming them."""
    from sklearn.ensemble import BaggingRegressor
    from sklearn.multioutput import MultiOutputRegressor

    rng = np.random.RandomState(4)
    X = rng.normal(size=(16, 2)) * [1.0, 10.0] + 2.0
    y = np.sin(X[:, 0])
    net = dict(hidden_layer_sizes=(3,), max_iter=2, tol=None, dtype="float64",
               random_state=0)
    inner = make_pipeline(FunctionTransformer(lambda A: 2 * A - 1), PathKernelMachine(**net))
    pipe = make_pipeline(StandardScaler(), inner).fit(X, y)
    Z = 2 * pipe[0].transform(X) - 1
    shown = KernelMatrixDisplay.from_estimator(pipe, X[:6]).kernel_matrix
    np.testing.assert_allclose(shown, _loop_gram(pipe[-1][-1], -1, Z[:6]), rtol=1e-10,
                               atol=1e-12)
    bag = BaggingRegressor(PathKernelMachine(**net), n_estimators=2, random_state=0).fit(X, y)
    with pytest.raises(TypeError, match=r"estimators_\[0\] holds one"):
        KernelMatrixDisplay.from_estimator(bag, X[:4])
    multi = MultiOutputRegressor(PathKernelMachine(**net)).fit(X, np.c_[y, -y])
    with pytest.raises(TypeError, match="one fitted estimator per target"):
        RankGapDisplay.from_estimator(multi, X[:4], X[4:6])


def test_umap_takes_its_keywords_over_the_displays_own(circle, monkeypatch):
    """method_kw reaches UMAP over the display's choices (n_neighbors, n_jobs); the
    metric and the seed stay the display's."""
    clf, X, y = circle
    made = []

    class Capture(_UMAPLike):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(kw)

        def fit_transform(self, D):
            return np.zeros((len(D), 2))

    umap = type(sys)("umap")
    umap.UMAP = Capture
    monkeypatch.setitem(sys.modules, "umap", umap)
    TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap", random_state=3,
                                           method_kw={"n_neighbors": 4, "n_jobs": 2})
    TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap", random_state=3)
    assert made == [
        {"n_neighbors": 4, "n_jobs": 2, "metric": "precomputed", "random_state": 3},
        {"n_neighbors": 11, "n_jobs": 1, "metric": "precomputed", "random_state": 3}]
    with pytest.raises(ValueError, match="metric is set by the display"):
        TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap",
                                               method_kw={"metric": "cosine"})


@pytest.mark.parametrize("index", range(3))
def test_a_redraw_reuses_its_colour_bar_beside_the_users_and_after_clear(index):
    """Review of s54's redraw: removing the display's colour bar gave the axes back the
    room it had when the bar was made, over a colour bar the user added since (the heat
    map covered it); after ax.clear() the removal failed in matplotlib
    (AttributeError: 'NoneType' object has no attribute 'set_subplotspec'); and a
    drawing on A, then B, then A again stacked a second bar on A. The redraw now draws
    its bar into the previous bar's axes."""
    disp = _colour_bar_displays()[index]
    fig, (A, B) = plt.subplots(1, 2)
    disp.plot(ax=A)
    n_children = len(A.get_children())
    mine = A.scatter([0.0], [0.0], c=[1.0])
    users = fig.colorbar(mine, ax=A)
    disp.plot(ax=A)
    fig.canvas.draw()
    assert len(fig.axes) == 4 and users.ax in fig.axes and mine in A.get_children()
    assert disp.colorbar_.mappable in A.get_children()
    # Side by side, not overlapping: the drawing, the user's bar, the display's.
    boxes = sorted((a.get_position().x0, a.get_position().x1) for a in (A, users.ax,
                                                                        disp.colorbar_.ax))
    assert all(left[1] <= right[0] + 1e-9 for left, right in zip(boxes, boxes[1:]))
    disp.plot(ax=B)
    disp.plot(ax=A)
    assert len(fig.axes) == 5 and len(A.get_children()) == n_children + 1  # + mine
    A.clear()
    disp.plot(ax=A)
    assert len(fig.axes) == 5 and disp.colorbar_.mappable in A.get_children()


def test_keywords_under_matplotlibs_aliases_replace_the_displays_own():
    """Review of s54's artist keywords: ls=, c=, lw=, ec=, fc= beside the display's
    linestyle=, color=, linewidths=, edgecolors=, c= failed in matplotlib ("Got both
    'linestyle' and 'ls'"), after the first artist was drawn; a norm in neighbor_kw
    failed beside the display's vmin/vmax after the training set was drawn, and an
    anchor's facecolor lost to the display's black with a warning. The user's keyword
    now replaces the display's, as scikit-learn's displays resolve aliases."""
    import matplotlib as mpl

    rank = RankGapDisplay(np.arange(4), [1, 2, 2, 3], [1, 3, 3, 4], rtol=1e-7)
    rank.plot(ls=":", c="k", lw=3)
    for line in rank.lines_:
        assert line.get_linestyle() == ":" and line.get_color() == "k"
        assert line.get_linewidth() == 3
    _, ax = plt.subplots()
    with pytest.raises(TypeError, match="aliases of one another"):
        rank.plot(ax=ax, ls=":", linestyle="-")
    assert ax.get_lines() == []
    rng = np.random.RandomState(0)
    X = rng.normal(size=(12, 2))
    near = KernelNeighborsDisplay(X, (X[:, 0] > 0).astype(int), X[:2],
                                  np.array([[0, 3, 4], [1, 5, 6]]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        near.plot(scatter_kw={"lw": 1.5}, neighbor_kw={"ec": "red", "linewidth": 2},
                  anchor_kw={"lw": 1, "fc": "tab:green", "marker": "o"})
    assert near.scatter_.get_linewidths().tolist() == [1.5]
    for scatter in near.neighbor_scatters_:
        np.testing.assert_allclose(scatter.get_edgecolors(), [mpl.colors.to_rgba("red")])
        assert scatter.get_linewidths().tolist() == [2]
    np.testing.assert_allclose(near.anchor_scatter_.get_facecolors(),
                               [mpl.colors.to_rgba("tab:green")])
    assert near.anchor_scatter_.get_linewidths().tolist() == [1]
    _, ax = plt.subplots()
    for kw in ({"norm": mpl.colors.Normalize(0, 1)}, {"cmap": "viridis"},
               {"facecolors": "k"}):
        with pytest.raises(ValueError, match="colouring of the points by y"):
            near.plot(ax=ax, neighbor_kw=kw)
    assert len(ax.collections) == 0
    matrix = KernelMatrixDisplay(np.eye(4), y=[0, 0, 1, 1]).plot(boundary_kw={"ls": ":"})
    assert {line.get_linestyle() for line in matrix.boundary_lines_} == {":"}


def test_continuous_labels_that_are_not_numbers_are_refused_before_the_kernels(
        circle, monkeypatch):
    """Review of s54: continuous=True with a classifier's string labels failed in numpy
    ("could not convert string to float") once the kernels and the embedding were
    computed, and in plot after the axes' previous drawing was removed."""
    clf, X, y = circle
    words = np.where(y == 1, "out", "in")

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was computed before the refusal")

    monkeypatch.setattr(plotting, "step_kernel", no_kernel)
    monkeypatch.setattr(type(clf), "kneighbors", no_kernel)
    with pytest.raises(ValueError, match="not numbers"):
        TangentEmbeddingDisplay.from_estimator(clf, X, words, method="pca", continuous=True)
    with pytest.raises(ValueError, match="not numbers"):
        KernelNeighborsDisplay.from_estimator(clf, X[:1], 3, y=words, continuous=True)
    disp = TangentEmbeddingDisplay(X, words).plot()
    n_children = len(disp.ax_.get_children())
    disp.continuous = True
    with pytest.raises(ValueError, match="not numbers"):
        disp.plot(ax=disp.ax_)
    assert len(disp.ax_.get_children()) == n_children
    # Numbers said to be values are drawn by value.
    codes = (y == 1).astype(int)
    disp = KernelNeighborsDisplay(X, codes, X[:1], np.array([[0, 1, 2]]), continuous=True)
    assert disp.plot().colorbar_ is not None


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("clear", [False, True])
def test_a_redraw_without_its_colour_bar_removes_it_and_gives_the_room_back(index, clear):
    """A redraw asking for no colour bar (colorbar=False, continuous=False, legend=False)
    removes the display's previous bar, also after ax.clear() took the image or points it
    maps: the axes get back the room of the same display drawn bar-less on a fresh
    figure, the reference. (Their anchor stays the bar's, (1, 0.5): matplotlib's
    Colorbar.remove restores the position, not the anchor.)"""
    off = [{"colorbar": False}, {}, {"legend": False}][index]

    def bar_less(disp):
        if index == 1:
            disp.continuous = False
        return disp

    reference = bar_less(_colour_bar_displays()[index]).plot(**off)
    reference.figure_.canvas.draw()
    disp = _colour_bar_displays()[index]
    fig, ax = plt.subplots()
    disp.plot(ax=ax)
    assert len(fig.axes) == 2
    if clear:
        ax.clear()
    bar_less(disp).plot(ax=ax, **off)
    fig.canvas.draw()
    assert disp.colorbar_ is None and fig.axes == [ax]
    np.testing.assert_allclose(ax.get_position(original=True).bounds,
                               reference.ax_.get_position(original=True).bounds)


def test_a_display_keeps_no_closed_figure_alive():
    """Each plot() without an axes makes a figure; the display's notes of its drawings
    (for a redraw) were kept on the display, keyed by axes, and held every figure it had
    drawn alive after plt.close, as long as the display lived (d4342cd held only the
    last). Reference: weak references to the figures, dead after a collection; the
    redraw still works and the display still pickles."""
    import gc
    import pickle
    import weakref

    disp = _colour_bar_displays()[0]
    figures = []
    for _ in range(3):
        disp.plot()
        figures.append(weakref.ref(disp.figure_))
        plt.close(disp.figure_)
    gc.collect()
    # The last one is the display's (ax_, figure_, im_), as scikit-learn's displays keep.
    assert [f() for f in figures[:-1]] == [None, None] and figures[-1]() is not None
    disp.plot()
    fig, ax = disp.figure_, disp.ax_
    disp.plot(ax=ax)
    assert len(fig.axes) == 2
    pickle.loads(pickle.dumps(disp))


def _refused_before_drawing(monkeypatch, error, match, draw):
    """``draw(ax)`` raises ``error`` matching ``match`` with no kernel computed, the given
    axes untouched and no figure made."""
    calls = _count_kernels(monkeypatch)
    fig, ax = plt.subplots()
    ax.set_title("mine")
    children, figures = len(ax.get_children()), plt.get_fignums()
    with pytest.raises(error, match=match):
        draw(ax)
    assert calls == [] and plt.get_fignums() == figures
    assert len(ax.get_children()) == children and ax.get_title() == "mine"


@pytest.mark.parametrize("steps", [[], [[0, 1]], [0.5], "0"])
def test_steps_that_are_not_a_list_of_ints_are_refused(circle, monkeypatch, steps):
    # The branch of _recorded_points that no test reached (s55 coverage).
    clf, X, _ = circle
    match = r"steps must be None or a non-empty 1-D sequence of ints\."
    _refused_before_drawing(monkeypatch, ValueError, match, lambda ax: (
        KernelEvolutionDisplay.from_estimator(clf, X[0], X[1:3], steps=steps, ax=ax)))
    _refused_before_drawing(monkeypatch, ValueError, match, lambda ax: (
        RankGapDisplay.from_estimator(clf, X[:4], X[4:6], steps=steps, ax=ax)))


def test_block_means_without_classes_is_refused():
    disp = KernelMatrixDisplay(np.eye(3))
    with pytest.raises(ValueError, match=r"block_means needs the class of each row \(y\)"):
        disp.block_means()
    # With them, the means are there (the refusal is about y alone).
    K = np.arange(16.0).reshape(4, 4)
    means = KernelMatrixDisplay(K, y=[0, 0, 1, 1]).block_means(include_diagonal=True)
    np.testing.assert_allclose(means, [[K[:2, :2].mean(), K[:2, 2:].mean()],
                                       [K[2:, :2].mean(), K[2:, 2:].mean()]])


def test_kernel_evolution_refuses_several_inputs_as_x(circle, monkeypatch):
    """x is one input: a features network's x of more than 2 axes, and several images
    for an image network (with its training inputs or without), are refused before the
    kernel, naming what was given."""
    clf, X, _ = circle
    _refused_before_drawing(
        monkeypatch, ValueError, r"x is one input of n_features values, got shape "
        r"\(1, 1, 2\)", lambda ax: KernelEvolutionDisplay.from_estimator(
            clf, X[:1, None], X[1:3], ax=ax))
    for with_inputs in (True, False):
        net, images = own_loop("cnn", X_train=with_inputs)
        _refused_before_drawing(
            monkeypatch, ValueError, "x must be one input, got 3 of them",
            lambda ax, net=net, images=images: KernelEvolutionDisplay.from_estimator(
                net, images[:3], images[3:5], ax=ax))


def test_tangent_embedding_refuses_umap_without_umap_learn_and_method_kw_not_a_dict(
        circle, monkeypatch):
    clf, X, _ = circle
    monkeypatch.setitem(sys.modules, "umap", None)  # not importable, installed or not
    _refused_before_drawing(monkeypatch, ImportError, "method='umap' needs umap-learn",
                            lambda ax: TangentEmbeddingDisplay.from_estimator(
                                clf, X, method="umap", ax=ax))
    _refused_before_drawing(
        monkeypatch, TypeError, "method_kw must be a dict of keyword arguments or None, got "
        "list", lambda ax: TangentEmbeddingDisplay.from_estimator(
            clf, X, method="pca", method_kw=[("eigen_solver", "dense")], ax=ax))


def test_an_embedder_taking_any_keyword_gets_them_all(circle, monkeypatch):
    """An embedding class whose constructor takes **kwargs has no unknown keywords: the
    names are not checked against its signature, and reach it."""
    clf, X, _ = circle
    made = []

    class AnyOption(_UMAPLike):
        def __init__(self, n_neighbors=15, **kw):
            super().__init__(n_neighbors, kw.pop("metric"), kw.pop("random_state"),
                             kw.pop("n_jobs", -1))
            made.append(kw)

    umap = type(sys)("umap")
    umap.UMAP = AnyOption
    monkeypatch.setitem(sys.modules, "umap", umap)
    TangentEmbeddingDisplay.from_estimator(clf, X[:12], method="umap",
                                           method_kw={"anything": 1})
    assert made == [{"anything": 1}]


def test_an_embedding_display_made_by_hand_is_titled_by_its_method():
    E = np.random.RandomState(0).normal(size=(5, 2))
    ax = TangentEmbeddingDisplay(E, method="t-SNE").plot().ax_
    assert ax.get_title() == "tangent features (t-SNE)"
    assert TangentEmbeddingDisplay(E).plot().ax_.get_title() == ""
