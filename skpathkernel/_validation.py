"""Checks of scalar arguments shared by the public classes."""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["check_index"]


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
