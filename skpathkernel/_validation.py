"""Checks of arguments shared by the public classes."""

from __future__ import annotations

import numbers
import operator

import numpy as np
from sklearn import get_config
from sklearn.utils._param_validation import Interval
from sklearn.utils.validation import _check_feature_names, _get_feature_names

__all__ = ["check_column_names", "check_flag", "check_index", "check_memory_budget", "count",
           "is_option", "validate_params"]


def check_column_names(estimator, X) -> None:
    """Refuse named columns (a DataFrame) other than the fit's, in the fit's order.

    For the functions that read a fitted network without the estimator's own validation
    (kernels, displays): the estimator's verbs refuse such an ``X``, and taking its
    columns by position would compute on the wrong features. Unnamed arrays (what SVC
    and GaussianProcessRegressor hand a kernel), and any ``X`` for an estimator fitted
    without names (a ``RecordedNetwork``), pass without the verbs' warnings.
    """
    if (getattr(estimator, "feature_names_in_", None) is not None
            and _get_feature_names(X) is not None):
        _check_feature_names(estimator, X, reset=False)


class _Count(Interval):
    """An ``Interval`` of integers that refuses a bool, which its ``Integral`` type
    takes for 0 or 1 (``np.zeros((1, True))`` then failed in NumPy's words, or one
    point was made silently)."""

    def is_satisfied_by(self, val):
        return not isinstance(val, (bool, np.bool_)) and super().is_satisfied_by(val)


def validate_params(estimator) -> None:
    """``estimator._validate_params()`` unless ``sklearn.set_config(
    skip_parameter_validation=True)``, as scikit-learn's own ``fit`` methods skip it
    (their ``_fit_context``): called directly, it validated whatever the config said."""
    if not get_config()["skip_parameter_validation"]:
        estimator._validate_params()


def count(low: int) -> Interval:
    """The ``_parameter_constraints`` / ``validate_params`` constraint of a count of at
    least ``low``: an int, not a bool."""
    return _Count(numbers.Integral, low, None, closed="left")


def check_flag(value, name: str) -> None:
    """Refuse a ``value`` called ``name`` that is not a bool (NumPy's included): a flag
    read by an ``if`` would take any truthy object, and an array failed there."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}.")


def is_option(value, *options: str) -> bool:
    """Whether ``value`` is one of the string ``options``; False for anything else.

    ``value in options`` or ``value == option`` on an array compares elementwise, and
    the ``if`` around it then failed with numpy's "truth value of an array is
    ambiguous" instead of the caller's message naming the argument.
    """
    return isinstance(value, str) and value in options


def check_index(value, name: str, *, n: int | None = None, allow_none: bool = False):
    """``value`` checked as an index called ``name``.

    An int (NumPy integers and integer 0-d tensors too, never a bool), or None when
    ``allow_none``. With ``n``: within ``-n <= value < n``, returned non-negative.

    Raises
    ------
    TypeError
        For anything else than an int (or None when allowed).
    IndexError
        For an int out of range.
    """
    if value is None and allow_none:
        return None
    try:
        index = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r}.")
    if n is None:
        return index
    if not -n <= index < n:
        raise IndexError(f"{name} index {index} is out of range for {n} entries.")
    return index % n


def check_memory_budget(value, *, low: int = 1) -> int:
    """``value`` checked as a ``memory_budget`` of at least ``low`` bytes.

    The one check of the objects that take a budget outside ``_parameter_constraints``
    (``PathRecorder``, ``RecordedNetwork``): a float or a bool is refused (``int()``
    took 1.5 and True for one byte), and so is a budget below ``low`` (the first kernel
    then failed in words about its block).

    Raises
    ------
    TypeError
        For anything else than an int.
    ValueError
        For an int below ``low``.
    """
    budget = check_index(value, "memory_budget")
    if budget < low:
        least = "a positive number of bytes" if low == 1 else f"at least {low:,} bytes"
        raise ValueError(f"memory_budget must be {least}, got {budget!r}.")
    return budget


def once_differentiable(gradient) -> bool:
    """Whether ``gradient``'s graph (a tensor taken with ``create_graph=True`` and a seed
    that requires grad) goes through a backward marked ``@once_differentiable``: torch
    leaves its ``Error`` node there and differentiates around it, so second derivatives
    through the gradient would miss that part without a word. One walk of the graph."""
    seen, stack = set(), [gradient.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "Error":  # torch's DelayedError
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False
