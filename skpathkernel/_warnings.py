"""Where the package's warnings point (the user's line), what their checks compare, and
the warning about a pickle made by another skpathkernel version."""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Iterable

import sklearn

from ._version import __version__

__all__ = ["InconsistentVersionWarning", "VersionedStateMixin", "caller_stacklevel",
           "worse", "worst"]

# The package's folder: frames whose code lies under it are skpathkernel's own.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# scikit-learn's wrappers of the package's own methods and functions: set_output's of
# every transform, validate_params' of the public functions (hessian_trace), and the
# mixins' methods that call the estimators' own (score calls predict, fit_transform fit:
# a warning of score pointed at sklearn/base.py). Their frames stand between the user's
# line and the package's.
_WRAPPERS = tuple(os.path.join(os.path.dirname(os.path.abspath(sklearn.__file__)), *name)
                  for name in (("utils", "_set_output.py"), ("utils", "_param_validation.py"),
                               ("base.py",)))


def caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside skpathkernel (and scikit-learn's wrappers
    of its methods), for a warning issued by the caller of this function: the user's
    line, whichever public method they called."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _own(os.path.abspath(frame.f_code.co_filename)):
        frame, level = frame.f_back, level + 1
    return level


def _own(path: str) -> bool:
    return path.startswith(_PACKAGE) or path in _WRAPPERS


def worse(a: float, b: float) -> float:
    """The larger of two measured errors, NaN if either is: ``max`` keeps its first
    argument against a NaN, which would report a NaN error as the other one, and a check
    ``error > limit`` is False on NaN. Checks compare with ``not error <= limit``."""
    return a if math.isnan(a) or b <= a else b


def worst(errors: Iterable[float], initial: float | None = None) -> float | None:
    """The largest of several measured errors, NaN if any is (see :func:`worse`);
    ``initial`` where there are none (None by default)."""
    errors = list(errors)
    if not errors:
        return initial
    return functools.reduce(worse, errors, *(() if initial is None else (initial,)))


class InconsistentVersionWarning(UserWarning):
    """An object is unpickled by another skpathkernel version than the one that pickled it.

    As scikit-learn's :class:`~sklearn.exceptions.InconsistentVersionWarning` for its own
    estimators: the state of a pickled estimator, network, trajectory or kernel is
    stamped with the version that wrote it (``_skpathkernel_version``), and a model
    pickled by one version may load into another version's objects wrongly, or not at
    all. Filter it (``warnings.filterwarnings("ignore",
    category=InconsistentVersionWarning)``) once the model is checked with this version,
    or fit it again with this version.

    Parameters
    ----------
    estimator_name : str
        The class of the object unpickled.
    current_version : str
        This skpathkernel's version.
    original_version : str
        The version that pickled the object ("unknown" for a pickle made before versions
        were stamped).

    Examples
    --------
    >>> import pickle, warnings
    >>> import numpy as np
    >>> from skpathkernel import InconsistentVersionWarning, PathKernelMachine
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = X.ravel() ** 2
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), max_iter=3, tol=None,
    ...                         random_state=0).fit(X, y)
    >>> state = est.__getstate__()
    >>> state["_skpathkernel_version"] = "0.0.1"  # as another version pickled it
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     est.__setstate__(state)
    >>> [w.message.original_version for w in caught
    ...  if issubclass(w.category, InconsistentVersionWarning)]
    ['0.0.1']
    """

    def __init__(self, *, estimator_name, current_version, original_version):
        self.estimator_name = estimator_name
        self.current_version = current_version
        self.original_version = original_version

    def __str__(self):
        return (f"Trying to unpickle {self.estimator_name} from skpathkernel version "
                f"{self.original_version} when using version {self.current_version}. This "
                "might lead to breaking code or invalid results. Use at your own risk.")


# The key of the version stamp in a pickled state (scikit-learn's is _sklearn_version).
VERSION_KEY = "_skpathkernel_version"


class VersionedStateMixin:
    """Pickled state stamped with the skpathkernel version, checked when unpickled.

    Before the classes' own ``__getstate__`` / ``__setstate__`` in the MRO's reverse:
    they call ``super()``, which reaches these, and then scikit-learn's (whose own stamp
    is only for ``sklearn.*`` classes).
    """

    def __getstate__(self):
        getstate = getattr(super(), "__getstate__", None)  # Python 3.10: object has none
        state = None if getstate is None else getstate()
        # object.__getstate__ returns the live __dict__: a new dict, stamped.
        return {**(self.__dict__ if state is None else state), VERSION_KEY: __version__}

    def __setstate__(self, state):
        state = dict(state)
        version = state.pop(VERSION_KEY, "unknown")
        if version != __version__:
            warnings.warn(InconsistentVersionWarning(
                estimator_name=type(self).__name__, current_version=__version__,
                original_version=version), stacklevel=caller_stacklevel())
        setstate = getattr(super(), "__setstate__", None)
        if setstate is None:
            self.__dict__.update(state)
        else:
            setstate(state)
