"""Tests of skpathkernel.datasets: the synthetic generators and the printed-glyph loaders."""

import doctest
import re
import sys

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.neighbors import KNeighborsClassifier
from sklearn.svm import SVC
from sklearn.utils._param_validation import InvalidParameterError

import skpathkernel._glyphs as glyphs
from skpathkernel import datasets
from skpathkernel.datasets import (
    load_printed_digits,
    load_printed_letters,
    make_circle,
    make_ellipse,
    make_linear_extrapolation,
    make_sine,
    make_square_wave,
)


@pytest.mark.parametrize("module", [datasets, glyphs])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_public_names():
    for name in ("load_printed_digits", "load_printed_letters", "make_circle", "make_ellipse"):
        assert name in datasets.__all__
        assert hasattr(datasets, name)


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("n_samples", [10, 11, 400])
def test_make_circle_shapes_balance_and_geometry(n_samples):
    X, y = make_circle(n_samples, inner_radius_sq=0.8, random_state=0)
    assert X.shape == (n_samples, 2)
    assert y.shape == (n_samples,)
    assert set(np.unique(y)) == {-1, 1}
    assert (y == 1).sum() == n_samples // 2
    assert (y == -1).sum() == n_samples - n_samples // 2
    r2 = (X**2).sum(axis=1)
    assert np.abs(r2[y == 1] - 1.0).max() < 1e-12
    assert r2[y == -1].max() <= 0.8
    # Shuffled, not sorted by class.
    assert not (np.all(y[: n_samples // 2] == 1) and n_samples > 20)


def test_make_circle_inner_radius_and_spread():
    X, y = make_circle(2000, inner_radius_sq=0.5, random_state=1)
    r2 = (X[y == -1] ** 2).sum(axis=1)
    assert r2.max() <= 0.5
    # Uniform in the disk: the squared radius is uniform on [0, 0.5], mean 0.25.
    assert abs(r2.mean() - 0.25) < 0.02
    # The ring covers all angles.
    angles = np.arctan2(X[y == 1, 1], X[y == 1, 0])
    assert np.histogram(angles, bins=8, range=(-np.pi, np.pi))[0].min() > 0


def test_make_circle_determinism():
    X1, y1 = make_circle(50, random_state=3)
    X2, y2 = make_circle(50, random_state=3)
    X3, _ = make_circle(50, random_state=4)
    np.testing.assert_array_equal(X1, X2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.allclose(X1, X3)
    X4, _ = make_circle(50, random_state=np.random.RandomState(3))
    np.testing.assert_array_equal(X1, X4)


@pytest.mark.parametrize("anisotropy", [100.0, 4.0])
def test_make_ellipse_geometry(anisotropy):
    X, y = make_ellipse(301, inner_radius_sq=0.9, anisotropy=anisotropy, random_state=0)
    assert X.shape == (301, 2)
    assert (y == 1).sum() == 150 and (y == -1).sum() == 151
    q = anisotropy * X[:, 0] ** 2 + X[:, 1] ** 2
    assert np.abs(q[y == 1] - 1.0).max() < 1e-12
    assert q[y == -1].max() <= 0.9
    assert np.abs(X[:, 0]).max() <= 1.0 / np.sqrt(anisotropy) + 1e-12


def test_make_ellipse_determinism():
    a = make_ellipse(40, random_state=7)
    b = make_ellipse(40, random_state=7)
    c = make_ellipse(40, random_state=8)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.allclose(a[0], c[0])


def test_make_sine_and_square_wave():
    X, y = make_sine(7)
    assert X.shape == (7, 1) and y.shape == (7,)
    assert X[0, 0] == -np.pi and X[-1, 0] == np.pi
    np.testing.assert_allclose(np.diff(X[:, 0]), 2 * np.pi / 6)
    np.testing.assert_allclose(y, np.sin(X[:, 0]), atol=0, rtol=0)

    X, y = make_square_wave(9, low=0.1, high=6.0)
    np.testing.assert_array_equal(y, np.sign(np.sin(X[:, 0])))
    assert set(np.unique(y)) == {-1.0, 1.0}


def test_make_sine_noise_is_seeded():
    _, y0 = make_sine(50)
    _, y1 = make_sine(50, noise=0.1, random_state=0)
    _, y2 = make_sine(50, noise=0.1, random_state=0)
    _, y3 = make_sine(50, noise=0.1, random_state=1)
    np.testing.assert_array_equal(y1, y2)
    assert not np.allclose(y1, y3)
    resid = y1 - y0
    assert 0.05 < resid.std() < 0.2


def test_make_linear_extrapolation_ranges():
    Xtr, ytr, Xte, yte = make_linear_extrapolation(50, 30)
    assert Xtr.shape == (50, 1) and ytr.shape == (50,)
    assert Xte.shape == (30, 1) and yte.shape == (30,)
    assert Xtr.min() == 0.0 and Xtr.max() < 2.0
    np.testing.assert_allclose(np.diff(Xtr[:, 0]), 2.0 / 50)
    assert Xte.min() == 2.0 and Xte.max() == 4.0
    np.testing.assert_allclose(ytr, 2 * Xtr[:, 0] + 1)
    np.testing.assert_allclose(yte, 2 * Xte[:, 0] + 1)


def test_make_linear_extrapolation_parameters():
    Xtr, ytr, Xte, yte = make_linear_extrapolation(
        4, 3, train_range=(-1.0, 1.0), test_range=(5.0, 6.0), slope=-0.5, intercept=3.0
    )
    assert Xtr.ravel().tolist() == [-1.0, -0.5, 0.0, 0.5]
    assert Xte.ravel().tolist() == [5.0, 5.5, 6.0]
    np.testing.assert_allclose(ytr, -0.5 * Xtr[:, 0] + 3.0)
    np.testing.assert_allclose(yte, -0.5 * Xte[:, 0] + 3.0)


@pytest.mark.parametrize("make, params", [
    (make_circle, dict(inner_radius_sq=-1.0)),  # read NaN (the square root of it)
    (make_circle, dict(inner_radius_sq=1.5)),  # an "inner" disk beyond the circle
    (make_circle, dict(n_samples=1)),  # one class only
    (make_circle, dict(n_samples=-3)),
    (make_ellipse, dict(anisotropy=-1.0)),  # read NaN
    (make_ellipse, dict(inner_radius_sq=1.0)),
    (make_sine, dict(noise=-1.0)),
    (make_square_wave, dict(n_samples=0)),
    (make_circle, dict(random_state="seed")),
    (make_linear_extrapolation, dict(n_train=0)),
    (make_linear_extrapolation, dict(n_test=2.5)),
    # Non-finite ends and coefficients: NaN data, or inf - inf in the grid.
    (make_sine, dict(low=np.nan)),
    (make_square_wave, dict(high=np.inf)),
    (make_linear_extrapolation, dict(slope=np.nan)),
    (make_linear_extrapolation, dict(intercept=-np.inf)),
])
def test_generators_refuse_invalid_parameters(make, params):
    """As scikit-learn's own generators: an InvalidParameterError (a ValueError and a
    TypeError) naming the parameter, never NaN or an empty set."""
    name = next(iter(params))
    with pytest.raises(InvalidParameterError, match=f"'{name}' parameter of {make.__name__}"):
        make(**params)


@pytest.mark.parametrize("make, params, match", [
    # One number was read as the grid's start and the point count as its end (silently:
    # 50 points from 0 to 49); three were linspace's count, a TypeError.
    (make_linear_extrapolation, dict(train_range=(0.0,)), "train_range must be two finite"),
    (make_linear_extrapolation, dict(test_range=(2.0, 3.0, 4.0)), "test_range must be two"),
    (make_linear_extrapolation, dict(train_range=(0.0, np.nan)), "train_range must be two"),
    # Reversed or empty intervals: a descending or constant grid, so a "training domain"
    # that lies beyond the test one.
    (make_linear_extrapolation, dict(train_range=(2.0, 0.0)), "train_range must be an int"),
    (make_linear_extrapolation, dict(test_range=(3.0, 3.0)), "test_range must be an int"),
    (make_sine, dict(low=np.pi, high=-np.pi), r"\[low, high\] must be an interval"),
    (make_square_wave, dict(low=1.0, high=1.0), r"\[low, high\] must be an interval"),
])
def test_generators_refuse_bad_ranges(make, params, match):
    with pytest.raises(ValueError, match=match):
        make(**params)


@pytest.mark.parametrize("params", [
    dict(low=0.0, high=2 * np.pi),
    dict(n_samples=5, low=-1.0, high=1.0),
])
def test_square_wave_takes_two_values_at_the_zeros_of_sin(params):
    # A grid point at 0 had sign(sin 0) = 0: a third class for a classifier fitted on it.
    X, y = make_square_wave(**params)
    assert set(y.tolist()) == {-1.0, 1.0}
    zero = np.flatnonzero(X[:, 0] == 0.0)
    assert zero.size == 1 and y[zero[0]] == 1.0


def test_grids_are_float64_whatever_the_type_of_their_ends():
    X, y = make_sine(5, low=np.float32(0.0), high=np.float32(1.0))
    assert X.dtype == np.float64 and y.dtype == np.float64


def test_generators_accept_their_boundaries():
    X, y = make_circle(2, inner_radius_sq=0.0, random_state=0)
    assert sorted(y.tolist()) == [-1, 1] and np.abs(X[y == -1]).max() == 0.0
    assert make_sine(1)[0].shape == (1, 1)
    Xtr, *_ = make_linear_extrapolation(1, 1, train_range=[0.0, 1.0])  # a list too
    assert Xtr.ravel().tolist() == [0.0]


# --------------------------------------------------------------------------- glyphs


@pytest.fixture(scope="module")
def printed_digits():
    # 20 per class: every bundled font once per digit.
    return load_printed_digits(n_per_class=20, random_state=0)


@pytest.fixture(scope="module")
def printed_letters():
    return load_printed_letters(n_per_class=20, random_state=0)


def _assert_digits_format(data, images):
    assert data.dtype == np.float64 and images.dtype == np.float64
    assert data.min() == 0.0 and data.max() == 16.0
    np.testing.assert_array_equal(data, np.round(data))
    np.testing.assert_array_equal(images.reshape(len(images), -1), data)
    # Every image has ink, and none is solid.
    assert (data.sum(axis=1) > 0).all()
    assert (data.sum(axis=1) < 64 * 16 / 2).all()


def test_printed_digits_bunch(printed_digits):
    b = printed_digits
    assert b.data.shape == (200, 64)
    assert b.images.shape == (200, 8, 8)
    assert b.target.shape == (200,) and b.target.dtype.kind == "i"
    np.testing.assert_array_equal(b.target, np.repeat(np.arange(10), 20))
    np.testing.assert_array_equal(b.target_names, np.arange(10))
    assert len(b.feature_names) == 64 and b.feature_names[9] == "pixel_1_1"
    _assert_digits_format(b.data, b.images)
    # Fonts cycle within each class, the same way for every class, and DESCR names them.
    fonts = b.font.reshape(10, 20)
    assert (fonts == fonts[0]).all()
    assert len(set(fonts[0])) == 20
    for name in fonts[0]:
        assert name in b.DESCR


def test_printed_digits_class_order_and_subset():
    X, y = load_printed_digits(n_per_class=3, digits=(7, 3), return_X_y=True)
    assert X.shape == (6, 64)
    assert y.tolist() == [7, 7, 7, 3, 3, 3]
    b = load_printed_digits(n_per_class=3, digits=[7, 3])
    np.testing.assert_array_equal(b.data, X)
    np.testing.assert_array_equal(b.target_names, [7, 3])
    # With fewer samples than fonts, DESCR names exactly the fonts used.
    listed = [line[6:] for line in b.DESCR.splitlines() if line.startswith("    - ")]
    assert listed == ["DejaVu Sans", "DejaVu Serif", "DejaVu Sans Mono"]
    assert b.font.tolist() == listed * 2


def test_printed_digits_determinism():
    a = load_printed_digits(n_per_class=5)
    b = load_printed_digits(n_per_class=5, random_state=0)
    c = load_printed_digits(n_per_class=5, random_state=np.random.RandomState(0))
    np.testing.assert_array_equal(a.data, b.data)
    np.testing.assert_array_equal(a.data, c.data)
    d = load_printed_digits(n_per_class=5, random_state=1)
    differ = (a.data != d.data).any(axis=1)
    assert differ.mean() > 0.8
    # Same classes and fonts; only the jitter changed.
    np.testing.assert_array_equal(a.target, d.target)
    np.testing.assert_array_equal(a.font, d.font)


def test_printed_digits_orientation(printed_digits):
    b = printed_digits
    rows = b.images.sum(axis=2)  # ink per row
    cols = b.images.sum(axis=1)  # ink per column
    # "7": a bar at the top, a single stroke at the bottom (catches a vertical flip).
    sevens = b.target == 7
    assert (rows[sevens, 0] > rows[sevens, 7]).mean() >= 0.9
    # "1" is tall and narrow, normalised to the full height.
    ones = b.target == 1
    assert (rows[ones] > 0).sum(axis=1).mean() >= 7
    assert (cols[ones] > 0).sum(axis=1).mean() < (rows[ones] > 0).sum(axis=1).mean()


def test_printed_digits_recognised_by_a_load_digits_classifier(printed_digits):
    # A classifier that has only seen sklearn's handwritten digits reads the printed ones:
    # an RBF SVC measured 0.765 here (chance: 0.10).
    X, y = load_digits(return_X_y=True)
    clf = SVC().fit(X, y)
    accuracy = (clf.predict(printed_digits.data) == printed_digits.target).mean()
    assert accuracy >= 0.5, accuracy
    # And every digit is recognised at least three times as often as chance (measured
    # minimum 0.5, for 1, 6 and 8).
    per_class = [
        (clf.predict(printed_digits.data[printed_digits.target == d]) == d).mean()
        for d in range(10)
    ]
    assert min(per_class) >= 0.3, per_class


def test_printed_letters_bunch(printed_letters):
    b = printed_letters
    assert b.data.shape == (100, 64) and b.images.shape == (100, 8, 8)
    np.testing.assert_array_equal(b.target, np.repeat(np.arange(5), 20))
    assert b.target_names.tolist() == ["M", "N", "U", "V", "A"]
    _assert_digits_format(b.data, b.images)
    X, y = load_printed_letters(n_per_class=20, return_X_y=True)
    np.testing.assert_array_equal(X, b.data)
    np.testing.assert_array_equal(y, b.target)


def test_printed_letters_are_distinguishable(printed_letters):
    # Leave-one-font-out 1-nearest-neighbour: each font's letters are classified from the
    # other fonts' renders. Measured mean 0.98.
    b = printed_letters
    accuracies = []
    for font in np.unique(b.font):
        test = b.font == font
        knn = KNeighborsClassifier(n_neighbors=1).fit(b.data[~test], b.target[~test])
        accuracies.append((knn.predict(b.data[test]) == b.target[test]).mean())
    assert len(accuracies) == 20
    assert np.mean(accuracies) >= 0.8, accuracies


def test_printed_letters_options():
    b = load_printed_letters(letters="VA", n_per_class=2, random_state=5)
    assert b.target.tolist() == [0, 0, 1, 1]
    assert b.target_names.tolist() == ["V", "A"]
    c = load_printed_letters(letters=("V", "A"), n_per_class=2, random_state=5)
    np.testing.assert_array_equal(b.data, c.data)
    d = load_printed_letters(letters=("V", "A"), n_per_class=2, random_state=6)
    assert not np.array_equal(b.data, d.data)


def test_fonts_without_the_glyph_are_skipped():
    # The Computer Modern TrueType files have no Unicode Greek; the DejaVu and STIX ones do.
    b = load_printed_letters(letters=("Ω", "A"), n_per_class=20)
    assert not any("Computer Modern" in f for f in b.font)
    assert len(set(b.font)) == 16
    _assert_digits_format(b.data, b.images)
    with pytest.raises(ValueError, match="none of matplotlib's bundled fonts"):
        load_printed_letters(letters=("中",))
    # A blank glyph (the empty braille cell, in DejaVu) has nothing to draw: it failed in
    # matplotlib's TextPath with "'list' object has no attribute 'flags'".
    with pytest.raises(ValueError, match="none of matplotlib's bundled fonts draws"):
        load_printed_letters(letters=("A", "\u2800"))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"n_per_class": 0}, ValueError),
        ({"n_per_class": 2.5}, TypeError),
        ({"n_per_class": True}, TypeError),
        ({"digits": (10,)}, ValueError),
        ({"digits": (-1, 2)}, ValueError),
        ({"digits": ()}, ValueError),
        ({"digits": (1, 1)}, ValueError),
        ({"digits": "12"}, ValueError),
        ({"digits": (1.0, 2)}, ValueError),
    ],
)
def test_printed_digits_bad_input(kwargs, error):
    with pytest.raises(error):
        load_printed_digits(**kwargs)


@pytest.mark.parametrize("letters", [(), ("MN",), ("M", "M"), (" ",), ("A", 3), "", None])
def test_printed_letters_bad_input(letters):
    with pytest.raises(ValueError, match="letters"):
        load_printed_letters(letters=letters)


@pytest.mark.parametrize(("make", "param"), [
    (make_sine, "n_samples"), (make_square_wave, "n_samples"),
    (make_linear_extrapolation, "n_train"), (make_linear_extrapolation, "n_test")])
def test_generators_refuse_a_bool_count(make, param):
    # validate_params takes True for 1: make_sine failed in NumPy ("expected a sequence
    # of integers"), make_linear_extrapolation made one point; n_per_class refuses it.
    with pytest.raises(TypeError,
                       match=rf"'{param}' parameter .* must be an int in the range .*Got True"):
        make(**{param: True})


@pytest.mark.parametrize(("letters", "shown"), [(5, "got 5."), (None, "got None.")])
def test_printed_letters_refusal_echoes_the_argument(letters, shown):
    # A non-sequence became () before the check, and the message said "got ()".
    with pytest.raises(ValueError, match=re.escape(shown)):
        load_printed_letters(letters=letters)


def test_render_is_cached():
    load_printed_digits(n_per_class=3, digits=(4,))
    before = glyphs._render_glyph.cache_info()
    a = load_printed_digits(n_per_class=3, digits=(4,), random_state=9)
    after = glyphs._render_glyph.cache_info()
    assert after.misses == before.misses
    assert after.hits == before.hits + 3
    coverage, _ = glyphs._render_glyph(*glyphs._available_fonts()[0][1:], "4")
    assert not coverage.flags.writeable
    assert a.data.shape == (3, 64)


@pytest.mark.parametrize("loader", [load_printed_digits, load_printed_letters])
def test_missing_matplotlib_is_a_clear_import_error(loader, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install skpathkernel\[plot\]"):
        loader(n_per_class=1)


@pytest.mark.parametrize("loader", [load_printed_digits, load_printed_letters])
def test_printed_loaders_as_frame_like_load_digits(loader):
    # The reference is scikit-learn's own load_digits(as_frame=True): the same fields,
    # the same pandas types, the same column and target names.
    import pandas as pd

    ref = load_digits(as_frame=True)
    arrays = loader(n_per_class=2)
    b = loader(n_per_class=2, as_frame=True)
    assert set(ref) <= set(b)
    assert isinstance(b.data, pd.DataFrame) and isinstance(b.target, pd.Series)
    assert list(b.data.columns) == b.feature_names == arrays.feature_names
    assert list(b.frame.columns) == b.feature_names + [ref.target.name]
    assert b.target.name == ref.target.name
    np.testing.assert_array_equal(b.data.to_numpy(), arrays.data)
    np.testing.assert_array_equal(b.target.to_numpy(), arrays.target)
    np.testing.assert_array_equal(b.frame.to_numpy()[:, -1], arrays.target)
    assert arrays.frame is None and ref.frame is not None
    X, y = loader(n_per_class=2, as_frame=True, return_X_y=True)
    X_ref, y_ref = load_digits(as_frame=True, return_X_y=True)
    assert type(X) is type(X_ref) and type(y) is type(y_ref)
    pd.testing.assert_frame_equal(X, b.data)
    pd.testing.assert_series_equal(y, b.target)


def test_as_frame_without_pandas_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    with pytest.raises(ImportError, match=r"load_printed_digits\(as_frame=True\).*pip install"):
        load_printed_digits(n_per_class=1, as_frame=True)
