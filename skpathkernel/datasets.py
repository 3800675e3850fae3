"""Guo, He & Morel's (2026) data sets, generated offline, deterministic with ``random_state``.

The synthetic tasks of Guo, He & Morel (2026): the circle and ellipse classification tasks
of figures 1, 3, 9 and 10, the 1-D regressions of figure 2 and the linear extrapolation
task of figures 7 and 8, and printed digits and letters rendered from the fonts that ship
with matplotlib, 8x8 like :func:`sklearn.datasets.load_digits`. CIFAR-10 (figure 2 g-h)
is read from a copy the user already has on disk: nothing is downloaded.
"""

from __future__ import annotations

import os
import pickle
from numbers import Real

import numpy as np
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, validate_params

from ._glyphs import frame_bunch, load_printed_digits, load_printed_letters
from ._validation import count

# A finite real: sklearn's Interval refuses NaN, and "neither" refuses -inf and +inf.
_FINITE = Interval(Real, None, None, closed="neither")

__all__ = [
    "load_cifar10",
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


@validate_params(
    {"n_samples": [count(2)],
     # [0, 1): the inner disk strictly inside the outer curve (a negative one read NaN).
     "inner_radius_sq": [Interval(Real, 0, 1, closed="left")],
     "random_state": ["random_state"]},
    prefer_skip_nested_validation=True,
)
def make_circle(n_samples=400, *, inner_radius_sq=0.8, random_state=None):
    """The circle task of Guo, He & Morel (2026): +1 on the unit circle, -1 inside a smaller disk.

    Class +1 lies on ``x1^2 + x2^2 = 1``; class -1 is uniform in the disk
    ``x1^2 + x2^2 <= inner_radius_sq`` (0.8 in figure 1, 0.9 in figure 3).

    Parameters
    ----------
    n_samples : int, default=400
        Total number of points, split evenly between the classes.
    inner_radius_sq : float, default=0.8
        Squared radius of the inner disk.
    random_state : int, RandomState instance or None, default=None
        Seed of the random points, for reproducible output.

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


@validate_params(
    {"n_samples": [count(2)],
     # [0, 1): the inner disk strictly inside the outer curve (a negative one read NaN).
     "inner_radius_sq": [Interval(Real, 0, 1, closed="left")],
     "anisotropy": [Interval(Real, 0, None, closed="neither")],
     "random_state": ["random_state"]},
    prefer_skip_nested_validation=True,
)
def make_ellipse(n_samples=400, *, inner_radius_sq=0.9, anisotropy=100.0, random_state=None):
    """The anisotropic variant of figure 3: ``100 x1^2 + x2^2 = 1`` (+1) vs ``<= 0.9`` (-1).

    Parameters
    ----------
    n_samples : int, default=400
        Total number of points, split evenly between the classes.
    inner_radius_sq : float, default=0.9
        Squared radius of the inner ellipse, in the units of the outer one.
    anisotropy : float, default=100.0
        The coefficient of ``x1^2``.
    random_state : int, RandomState instance or None, default=None
        Seed of the random points, for reproducible output.

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


# The parameters and returns that make_sine and make_square_wave share.
_GRID_DOC = """
    Parameters
    ----------
    n_samples : int, default=100
        Number of grid points.
    low, high : float, default=-pi, pi
        Ends of the grid, both included; finite, with ``low < high``.
    noise : float, default=0.0
        Standard deviation of the Gaussian noise added to ``y``.
    random_state : int, RandomState instance or None, default=None
        Seed of the noise, for reproducible output.

    Returns
    -------
    X : ndarray of shape (n_samples, 1)
        The grid, as one feature column.
    y : ndarray of shape (n_samples,)
        The targets.
"""


def _check_range(low, high, what):
    """``low < high``: a reversed or empty interval gave a descending or constant grid."""
    if not low < high:
        raise ValueError(f"{what} must be an interval with low < high, got ({low!r}, "
                         f"{high!r}).")


def _grid_1d(n_samples, low, high, noise, random_state, func):
    _check_range(low, high, "[low, high]")
    rng = check_random_state(random_state)
    # float(): a float32 end made the grid float32 (NumPy 2 keeps a NumPy scalar's dtype).
    X = np.linspace(float(low), float(high), n_samples).reshape(-1, 1)
    y = func(X[:, 0]) + noise * rng.standard_normal(n_samples)
    return X, y


@validate_params(
    {"n_samples": [count(1)], "low": [_FINITE],
     "high": [_FINITE], "noise": [Interval(Real, 0, None, closed="left")],
     "random_state": ["random_state"]},
    prefer_skip_nested_validation=True,
)
def make_sine(n_samples=100, *, low=-np.pi, high=np.pi, noise=0.0, random_state=None):
    """``y = sin(x)`` on an even grid of ``[low, high]`` (figure 2a).
{grid}
    Examples
    --------
    >>> from skpathkernel.datasets import make_sine
    >>> X, y = make_sine(n_samples=5)
    >>> X.shape, y.shape
    ((5, 1), (5,))
    """
    return _grid_1d(n_samples, low, high, noise, random_state, np.sin)


@validate_params(
    {"n_samples": [count(1)], "low": [_FINITE],
     "high": [_FINITE], "noise": [Interval(Real, 0, None, closed="left")],
     "random_state": ["random_state"]},
    prefer_skip_nested_validation=True,
)
def make_square_wave(n_samples=100, *, low=-np.pi, high=np.pi, noise=0.0, random_state=None):
    """The square wave ``sign(sin(x))`` on an even grid of ``[low, high]`` (figure 2c).

    ``y`` is +1 where ``sin(x) >= 0`` and -1 elsewhere: at a zero of ``sin`` (a grid
    point at 0, as on ``[0, 2 pi]`` or ``[-1, 1]``) ``sign`` gave 0, a third value of a
    two-valued target.
{grid}
    Examples
    --------
    >>> from skpathkernel.datasets import make_square_wave
    >>> X, y = make_square_wave(n_samples=4, low=0.5, high=4.0)
    >>> y.tolist()
    [1.0, 1.0, 1.0, -1.0]
    """
    return _grid_1d(n_samples, low, high, noise, random_state,
                    lambda x: np.where(np.sin(x) >= 0, 1.0, -1.0))


make_sine.__doc__ = make_sine.__doc__.format(grid=_GRID_DOC)
make_square_wave.__doc__ = make_square_wave.__doc__.format(grid=_GRID_DOC)


@validate_params(
    {"n_train": [count(1)],
     "n_test": [count(1)],
     "train_range": ["array-like"], "test_range": ["array-like"], "slope": [_FINITE],
     "intercept": [_FINITE]},
    prefer_skip_nested_validation=True,
)
def make_linear_extrapolation(n_train=50, n_test=50, *, train_range=(0.0, 2.0),
                              test_range=(2.0, 4.0), slope=2.0, intercept=1.0):
    """The 1-D regression ``y = 2x + 1`` of figures 7-8: train on [0, 2), test beyond.

    Parameters
    ----------
    n_train : int, default=50
        Number of training points, evenly spaced over ``train_range`` without its right end.
    n_test : int, default=50
        Number of test points, evenly spaced over ``test_range`` with both ends.
    train_range : tuple of float, default=(0.0, 2.0)
        The training domain ``(low, high)``: finite, with ``low < high``.
    test_range : tuple of float, default=(2.0, 4.0)
        Where the network is asked to extrapolate, ``(low, high)`` as ``train_range``.
    slope : float, default=2.0
        Slope of the line.
    intercept : float, default=1.0
        Intercept of the line.

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
    train_range = _interval(train_range, "train_range")
    test_range = _interval(test_range, "test_range")
    X_train = np.linspace(*train_range, n_train, endpoint=False).reshape(-1, 1)
    X_test = np.linspace(*test_range, n_test).reshape(-1, 1)
    f = lambda x: slope * x[:, 0] + intercept  # noqa: E731
    return X_train, f(X_train), X_test, f(X_test)


def _interval(value, name):
    """``(low, high)`` as two finite floats with low < high: one number was read as the
    grid's start with the point count as its end, three as linspace's count."""
    try:
        bounds = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        bounds = None
    if bounds is None or bounds.shape != (2,) or not np.all(np.isfinite(bounds)):
        raise ValueError(f"{name} must be two finite numbers (low, high), got {value!r}.")
    _check_range(float(bounds[0]), float(bounds[1]), name)
    return float(bounds[0]), float(bounds[1])


_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings, bytes and NumPy arrays, nothing else: a batch file
    cannot run code while it loads."""

    _ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        # Protocol-2 pickles written by Python 3 spell bytes as _codecs.encode(str).
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a CIFAR-10 batch file.")


def _read_batch(path):
    with open(path, "rb") as fh:
        batch = _ArrayUnpickler(fh, encoding="bytes").load()
    # Python 2 pickles: byte-string keys.
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in batch.items()}


def _cifar10_folder(data_home=None):
    """The ``cifar-10-batches-py`` folder under ``data_home`` (or ``data_home`` itself
    when it is that folder); ``data_home=None`` is scikit-learn's data home
    (``$SCIKIT_LEARN_DATA``, else ``~/scikit_learn_data``), not created."""
    if data_home is None:
        data_home = os.environ.get("SCIKIT_LEARN_DATA",
                                   os.path.join("~", "scikit_learn_data"))
    data_home = os.path.expanduser(os.fspath(data_home))
    if os.path.basename(os.path.normpath(data_home)) == _CIFAR_FOLDER:
        return data_home
    return os.path.join(data_home, _CIFAR_FOLDER)


def load_cifar10(*, data_home=None, subset="train", n_per_class=None, return_X_y=False,
                 as_frame=False):
    """CIFAR-10 from its python batches on disk (figure 2 g-h's data), never downloaded.

    Reads the ``cifar-10-batches-py`` folder of the official python version (the one
    ``torchvision.datasets.CIFAR10(root=data_home, download=True)`` leaves under
    ``data_home``). The batch files are pickles: they are read by an unpickler that
    accepts only arrays, dicts and strings.

    Parameters
    ----------
    data_home : str or path-like, default=None
        Folder holding ``cifar-10-batches-py/`` (or that folder itself). None:
        scikit-learn's data home, ``$SCIKIT_LEARN_DATA`` or ``~/scikit_learn_data``.
    subset : {"train", "test"}, default="train"
        ``data_batch_1`` to ``data_batch_5`` (50000 images) or ``test_batch`` (10000).
    n_per_class : int, default=None
        Keep the first ``n_per_class`` images of each class, in file order, ordered by
        class. None keeps every image in file order.
    return_X_y : bool, default=False
        Return ``(data, target)`` instead of a Bunch.
    as_frame : bool, default=False
        If True, ``data`` is a pandas DataFrame (columns ``feature_names``), ``target`` a
        Series named ``"target"``, and the Bunch's ``frame`` a DataFrame of both, as
        scikit-learn's loaders give them. Requires pandas.

    Returns
    -------
    data : Bunch
        ``data`` float64 of shape (n, 3072) in [0, 1], each row the red, green and blue
        32x32 planes (``data.reshape(-1, 3, 32, 32)`` is NCHW); ``target`` int64 in 0..9;
        ``target_names`` the ten class names; ``feature_names`` (``"red_0_0"`` to
        ``"blue_31_31"``, row then column); ``frame`` (None unless ``as_frame``).

    Raises
    ------
    FileNotFoundError
        When a batch file is missing; the message says where it was looked for and how
        to get it.

    Examples
    --------
    >>> from skpathkernel.datasets import load_cifar10
    >>> load_cifar10(data_home="/nonexistent")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: CIFAR-10 not found: /nonexistent/cifar-10-batches-py/data_batch_1 ...
    """
    if subset not in _CIFAR_FILES:
        raise ValueError(f"subset must be 'train' or 'test', got {subset!r}.")
    if n_per_class is not None and (isinstance(n_per_class, bool)
                                    or not isinstance(n_per_class, (int, np.integer))
                                    or n_per_class < 1):
        raise ValueError(f"n_per_class must be a positive int or None, got {n_per_class!r}.")
    folder = _cifar10_folder(data_home)
    X, y = [], []
    for name in _CIFAR_FILES[subset]:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"CIFAR-10 not found: {path} does not exist. Download the python version "
                f"({_CIFAR_URL}) and extract it into the data home (it makes "
                f"{_CIFAR_FOLDER}/), or run torchvision.datasets.CIFAR10(root=DATA_HOME, "
                "download=True); then pass data_home (skpathkernel reproduce --data-home) "
                "or set SCIKIT_LEARN_DATA.")
        batch = _read_batch(path)
        data = np.asarray(batch["data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3072:
            raise ValueError(f"{path}: 'data' must be (n, 3072) uint8, got {data.shape}.")
        X.append(data)
        y.append(np.asarray(batch["labels"], dtype=np.int64))
        if n_per_class is not None and np.all(
                np.bincount(np.concatenate(y), minlength=10)[:10] >= n_per_class):
            break  # the later batches are not needed
    X, y = np.concatenate(X), np.concatenate(y)
    if n_per_class is not None:
        keep = np.concatenate([np.flatnonzero(y == c)[:n_per_class] for c in range(10)])
        X, y = X[keep], y[keep]
    X = X.astype(np.float64) / 255.0
    meta = os.path.join(folder, "batches.meta")
    names = ([n.decode() if isinstance(n, bytes) else str(n)
              for n in _read_batch(meta)["label_names"]]
             if os.path.exists(meta) and not return_X_y else [str(c) for c in range(10)])
    features = [f"{plane}_{i}_{j}" for plane in ("red", "green", "blue")
                for i in range(32) for j in range(32)]
    return frame_bunch(X, y, features, return_X_y, as_frame, "load_cifar10",
                       target_names=np.array(names))
