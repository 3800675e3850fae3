"""Arrays that a stream of fits extends at the end, in amortized time per added row.

``partial_fit`` and ``warm_start`` continue a recorded path: the path's points and
per-step arrays, and the training set its batches index, become the previous ones
followed by the new rows. Concatenated anew at every call, a stream of ``n`` calls
copied ``O(n^2)`` rows in all. :func:`appended` instead writes the new rows into spare
capacity after the filled part of a buffer (capacity doubled when it runs out, which
copies each row ``O(1)`` times on average) and returns a view of the filled part.

Ownership rule: a buffer remembers how many of its rows are filled, the end of the
longest view any call handed out. Only a view that ends there may append in place,
beyond every view's end; anyone else (an older view kept by the user, an estimator's
shallow copy that appends second) gets a new buffer. Rows that a view covers are
therefore never written again, so every holder of a path or a training set keeps seeing
what it saw. A view pickles (and copies) as its own rows: the spare capacity never
travels.
"""

import threading
import weakref

import numpy as np
import torch

__all__ = ["appended", "compact", "reallocations"]

# id(buffer) -> [weak reference to it, rows filled]. Keyed by id, as neither NumPy arrays
# nor tensors hash by identity; the entry leaves with its buffer.
_FILLED: dict[int, list] = {}
_LOCK = threading.Lock()
# The rows and the number of buffers each appended() allocated, for tests to count.
_COUNTS = {"reallocations": 0, "rows_copied": 0}


def reallocations() -> dict[str, int]:
    """How many buffers :func:`appended` has allocated, and how many previously filled
    rows it copied into them, since the process started."""
    return dict(_COUNTS)


def _is_torch(array) -> bool:
    return isinstance(array, torch.Tensor)


def _base(array):
    """The buffer ``array`` is a leading view of, or None."""
    base = array._base if _is_torch(array) else array.base
    if base is None or id(base) not in _FILLED or _FILLED[id(base)][0]() is not base:
        return None
    if _is_torch(array):
        leading = (array.data_ptr() == base.data_ptr() and array.dtype == base.dtype
                   and array.stride() == base.stride())
    else:
        leading = (array.__array_interface__["data"][0]
                   == base.__array_interface__["data"][0]
                   and array.dtype == base.dtype and array.strides == base.strides)
    return base if leading and array.shape[1:] == base.shape[1:] else None


def _result_dtype(array, parts):
    if _is_torch(array):
        dtype = array.dtype
        for part in parts:
            dtype = torch.promote_types(dtype, part.dtype)
        return dtype
    return np.result_type(array, *parts)


def appended(array, *parts):
    """``array`` followed by ``parts`` along the first axis, as ``np.concatenate`` or
    ``torch.cat`` gives it (the same values and dtype), but as a view of a buffer with
    spare rows: appending to that view again writes into them (see the module's
    ownership rule).

    Parameters
    ----------
    array : ndarray or torch.Tensor
        The rows so far: a view this function returned, or any array (then copied once).
    *parts : ndarray or torch.Tensor
        The rows to add, of ``array``'s kind and row shape.

    Returns
    -------
    out : ndarray or torch.Tensor
        The rows of ``array`` then of ``parts``; ``array`` itself is unchanged.
    """
    torch_side = _is_torch(array)
    if any(tuple(p.shape[1:]) != tuple(array.shape[1:]) for p in parts):
        # Assigned into the buffer, a part of other rows would broadcast silently.
        raise ValueError(f"Rows of shapes {[tuple(p.shape[1:]) for p in parts]} cannot "
                         f"follow rows of shape {tuple(array.shape[1:])}.")
    n_old = len(array)
    n_new = n_old + sum(len(p) for p in parts)
    dtype = _result_dtype(array, parts)
    with _LOCK:
        base = _base(array) if dtype == array.dtype else None
        in_place = (base is not None and _FILLED[id(base)][1] == n_old
                    and n_new <= len(base))
        if in_place:
            # Claimed before the rows are written: a second appender of the same view
            # (another thread, a shallow copy) now sees it is not the last and copies.
            _FILLED[id(base)][1] = n_new
    if not in_place:
        capacity = max(n_new, 2 * n_old, 8)
        shape = (capacity, *array.shape[1:])
        if torch_side:
            base = torch.empty(shape, dtype=dtype, device=array.device)
        else:
            base = np.empty(shape, dtype=dtype)
        base[:n_old] = array
        key = id(base)
        with _LOCK:
            _FILLED[key] = [weakref.ref(base), n_new]
            _COUNTS["reallocations"] += 1
            _COUNTS["rows_copied"] += n_old
        weakref.finalize(base, _FILLED.pop, key, None)
    start = n_old
    for part in parts:
        base[start:start + len(part)] = part
        start += len(part)
    return base[:n_new]


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` alone in its storage: ``torch.save`` writes a view's whole storage,
    which for a view returned by :func:`appended` holds its buffer's spare rows."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor
