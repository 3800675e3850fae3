"""Where the package's warnings point (the user's line), and what their checks compare."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterable

import sklearn

__all__ = ["caller_stacklevel", "worse", "worst"]

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
