"""The seeds' data sets, generated offline and deterministic with ``random_state``.

The synthetic tasks of Guo, He & Morel (2026): the circle and ellipse classification tasks
of figures 1, 3, 9 and 10, the 1-D regressions of figure 2 and the linear extrapolation
task of figures 7 and 8, and printed digits and letters rendered from the fonts that ship
with matplotlib, 8x8 like :func:`sklearn.datasets.load_digits`.
"""

from __future__ import annotations

import numpy as np
from sklearn.utils import check_random_state

from ._glyphs import load_printed_digits, load_printed_letters

__all__ = [
    "load_printed_digits",
    "load_printed_letters",
    "make_circle",
    "make_ellipse",
    "make_linear_extrapolation",
    "make_sine",
    "make_square_wave",
]


def _ring_and_disk(n_samples, inner_radius_sq, scale_x1, random_state):
    """Half the samples on ``s x1^2 + x2^2 = 1`` (+1), half inside ``<= r^2`` (-1)."""
    rng = check_random_state(random_state)
    n_out = n_samples // 2
    n_in = n_samples - n_out
    theta = rng.uniform(0.0, 2.0 * np.pi, n_out)
    ring = np.column_stack([np.cos(theta) / np.sqrt(scale_x1), np.sin(theta)])
    # Uniform in the disk of radius sqrt(r^2): radius ~ sqrt(U) * r.
    phi = rng.uniform(0.0, 2.0 * np.pi, n_in)
    rad = np.sqrt(rng.uniform(0.0, inner_radius_sq, n_in))
    disk = np.column_stack([rad * np.cos(phi) / np.sqrt(scale_x1), rad * np.sin(phi)])
    X = np.vstack([ring, disk])
    y = np.concatenate([np.ones(n_out, dtype=np.int64), -np.ones(n_in, dtype=np.int64)])
    perm = rng.permutation(n_samples)
    return X[perm], y[perm]


def make_circle(n_samples=400, *, inner_radius_sq=0.8, random_state=None):
    """The seeds' circle task: +1 on the unit circle, -1 inside a smaller disk.

    Class +1 lies on ``x1^2 + x2^2 = 1``; class -1 is uniform in the disk
    ``x1^2 + x2^2 <= inner_radius_sq`` (0.8 in figure 1, 0.9 in figure 3).

    Parameters
    ----------
    n_samples : int, default=400
        Total number of points, split evenly between the classes.
    inner_radius_sq : float, default=0.8
        Squared radius of the inner disk.
    random_state : int, RandomState instance or None, default=None

    Returns
    -------
    X : ndarray of shape (n_samples, 2)
    y : ndarray of shape (n_samples,) with values in {-1, +1}

    Examples
    --------
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=10, random_state=0)
    >>> X.shape, sorted(set(y.tolist()))
    ((10, 2), [-1, 1])
    """
    return _ring_and_disk(n_samples, inner_radius_sq, 1.0, random_state)


def make_ellipse(n_samples=400, *, inner_radius_sq=0.9, anisotropy=100.0, random_state=None):
    """The anisotropic variant of figure 3: ``100 x1^2 + x2^2 = 1`` (+1) vs ``<= 0.9`` (-1).

    Parameters
    ----------
    n_samples : int, default=400
    inner_radius_sq : float, default=0.9
    anisotropy : float, default=100.0
        The coefficient of ``x1^2``.
    random_state : int, RandomState instance or None, default=None

    Returns
    -------
    X : ndarray of shape (n_samples, 2)
    y : ndarray of shape (n_samples,) with values in {-1, +1}

    Examples
    --------
    >>> from skpathkernel.datasets import make_ellipse
    >>> X, y = make_ellipse(n_samples=8, random_state=0)
    >>> bool(abs(100 * X[y == 1, 0] ** 2 + X[y == 1, 1] ** 2 - 1).max() < 1e-12)
    True
    """
    return _ring_and_disk(n_samples, inner_radius_sq, anisotropy, random_state)


def _grid_1d(n_samples, low, high, noise, random_state, func):
    rng = check_random_state(random_state)
    X = np.linspace(low, high, n_samples).reshape(-1, 1)
    y = func(X[:, 0]) + noise * rng.standard_normal(n_samples)
    return X, y


def make_sine(n_samples=100, *, low=-np.pi, high=np.pi, noise=0.0, random_state=None):
    """``y = sin(x)`` on an even grid of ``[low, high]`` (figure 2a).

    Examples
    --------
    >>> from skpathkernel.datasets import make_sine
    >>> X, y = make_sine(n_samples=5)
    >>> X.shape, y.shape
    ((5, 1), (5,))
    """
    return _grid_1d(n_samples, low, high, noise, random_state, np.sin)


def make_square_wave(n_samples=100, *, low=-np.pi, high=np.pi, noise=0.0, random_state=None):
    """``y = sign(sin(x))`` on an even grid of ``[low, high]`` (figure 2c).

    Examples
    --------
    >>> from skpathkernel.datasets import make_square_wave
    >>> X, y = make_square_wave(n_samples=4, low=0.5, high=4.0)
    >>> y.tolist()
    [1.0, 1.0, 1.0, -1.0]
    """
    return _grid_1d(n_samples, low, high, noise, random_state, lambda x: np.sign(np.sin(x)))


def make_linear_extrapolation(n_train=50, n_test=50, *, train_range=(0.0, 2.0),
                              test_range=(2.0, 4.0), slope=2.0, intercept=1.0):
    """The 1-D regression ``y = 2x + 1`` of figures 7-8: train on [0, 2), test beyond.

    Returns
    -------
    X_train, y_train, X_test, y_test : ndarrays
        ``X_*`` of shape (n, 1); the training grid excludes its right end.

    Examples
    --------
    >>> from skpathkernel.datasets import make_linear_extrapolation
    >>> Xtr, ytr, Xte, yte = make_linear_extrapolation(n_train=4, n_test=2)
    >>> Xtr.ravel().tolist(), ytr.tolist()
    ([0.0, 0.5, 1.0, 1.5], [1.0, 2.0, 3.0, 4.0])
    """
    X_train = np.linspace(*train_range, n_train, endpoint=False).reshape(-1, 1)
    X_test = np.linspace(*test_range, n_test).reshape(-1, 1)
    f = lambda x: slope * x[:, 0] + intercept  # noqa: E731
    return X_train, f(X_train), X_test, f(X_test)
