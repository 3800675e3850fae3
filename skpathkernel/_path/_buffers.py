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

A recorder that does not know how many points it will hold (``PathRecorder``) keeps them
in :class:`Segments` instead: parts added as they fill, so that growing never holds a
buffer and its copy at once, and the points are one tensor only when read.
"""

import bisect
import mmap
import threading
import weakref

import numpy as np
import torch

__all__ = ["Segments", "TailedRows", "appended", "compact", "dense", "mapped_empty",
           "reallocations"]

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
    which for a view returned by :func:`appended` holds its buffer's spare rows. Of
    :class:`TailedRows`, their one tensor."""
    if isinstance(tensor, TailedRows):
        return tensor.dense()
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


class TailedRows:
    """A path's points in memory as the recorder's rows and, apart, a last point that
    no recorded one is (the current parameters of a loop read between recorded points,
    ``record_every > 1``).

    The next recorded point takes the row after the recorded ones: joined to them in one
    tensor, the last point made every such read copy the whole path (quadratic in a
    loop that reads its path every step, review s51). Quacks like the
    ``(n_points, P)`` tensor that a :class:`~skpathkernel.Trajectory` holds, for what it
    reads of it (``len``, ``shape``, ``dtype``, ``numel``, ``element_size`` and
    ``rows[k]`` for an int ``k``), as the on-disk rows do; :meth:`dense` (and
    :func:`compact`) give the one tensor, to save, pickle or extend.
    """

    def __init__(self, rows: torch.Tensor, tail: torch.Tensor):
        self.rows, self.tail = rows, tail

    def __len__(self) -> int:
        return len(self.rows) + 1

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), self.rows.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def numel(self) -> int:
        return len(self) * self.rows.shape[1]

    def element_size(self) -> int:
        return self.rows.element_size()

    def __getitem__(self, k: int) -> torch.Tensor:
        k = int(k)
        if k in (len(self.rows), -1):
            return self.tail
        return self.rows[k if k >= 0 else k + 1]

    def dense(self) -> torch.Tensor:
        """The rows then the last point, in one new tensor."""
        return torch.cat([self.rows, self.tail[None]])


def dense(rows):
    """``rows`` as one tensor (:class:`TailedRows` joined, a tensor itself)."""
    return rows.dense() if isinstance(rows, TailedRows) else rows


class Segments:
    """A recorder's in-memory rows, in tensors added as they fill: growing allocates the
    new rows only and copies nothing.

    A buffer that doubled held its old and its new tensor during the copy, up to 1.5
    times what it then held (2244 MiB under a 2048 MiB budget, review s50), and a budget
    check of the doubled size moved paths of half the budget to disk. ``empty(rows)``
    gives a ``(rows, n_cols)`` tensor; row ``k`` is in the part whose rows start at or
    before it. :meth:`leading` gives the first rows as one tensor (what a
    :class:`~skpathkernel.Trajectory` holds), without copying where one part holds them.

    Parameters
    ----------
    empty : callable
        ``empty(rows)``: a new uninitialized ``(rows, n_cols)`` tensor.
    rows : int
        Rows of the first part.
    """

    def __init__(self, empty, rows: int):
        self._empty = empty
        self.parts: list[torch.Tensor] = []
        self._starts: list[int] = []
        self._capacity = 0
        self._filled = 0  # rows below this may have been written (slot)
        self.add(rows)

    def __len__(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def add(self, rows: int) -> None:
        """Append a part of ``rows`` rows (uninitialized)."""
        self.parts.append(self._empty(rows))
        self._starts.append(self._capacity)
        self._capacity += rows

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in all, added as one part."""
        if rows > self._capacity:
            self.add(rows - self._capacity)

    def __getitem__(self, k: int) -> torch.Tensor:
        """Row ``k`` (a view)."""
        if len(self.parts) == 1:
            return self.parts[0][k]
        i = bisect.bisect_right(self._starts, k) - 1
        return self.parts[i][k - self._starts[i]]

    def slot(self, k: int) -> torch.Tensor:
        """Row ``k``, to be written."""
        if k >= self._filled:
            self._filled = k + 1
        if len(self.parts) == 1:  # (not through self[k]: a call less per recorded row)
            return self.parts[0][k]
        return self[k]

    def take(self, rows: np.ndarray) -> torch.Tensor:
        """The rows ``rows`` (a copy), as ``tensor[rows]`` gives them."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(self.parts) == 1:
            # 1-D: torch indexes with a 0-d tensor as with an int, giving a view.
            first = self.parts[0]
            return first[torch.from_numpy(rows.reshape(-1))].reshape(*rows.shape,
                                                                     first.shape[1])
        # Negative rows count from the end, as indexing counts them: bisect found them
        # no part (a wrong row or an IndexError), and no rows failed in torch.stack.
        flat = rows.reshape(-1)
        flat = np.where(flat < 0, flat + self._capacity, flat)
        if flat.size and not 0 <= flat.min() <= flat.max() < self._capacity:
            bad = rows.reshape(-1)[(flat < 0) | (flat >= self._capacity)][0]
            raise IndexError(f"index {bad} is out of bounds for {self._capacity} rows")
        first = self.parts[0]
        out = first.new_empty((flat.size, first.shape[1]))
        which = np.searchsorted(self._starts, flat, side="right") - 1
        for i in np.unique(which):
            at = np.flatnonzero(which == i)
            out[torch.from_numpy(at)] = self.parts[i][torch.from_numpy(
                flat[at] - self._starts[i])]
        return out.reshape(*rows.shape, first.shape[1])

    def leading(self, n: int, tail: torch.Tensor | None = None, spare: int = 0
                ) -> tuple[torch.Tensor, bool]:
        """Rows ``0`` to ``n - 1`` as one tensor (then ``tail``, one row, where given),
        and whether they were copied.

        Held by one part, a view of it. Else the rows are copied into a new tensor of
        ``n`` rows (with ``tail`` one more, with ``spare`` rows more after them), and each
        part is released (unless held elsewhere) as soon as its rows are copied: the new
        tensor's pages are mapped as they are written, so the memory held grows by one
        part at most, not by the rows copied (pinned memory is mapped at once). The new
        tensor's first ``n`` rows, and its spare rows where nothing follows them (no
        ``tail``, whose row the next writes would overwrite, and no rows written from
        ``n`` on, which stay where they are), then replace the parts copied.
        """
        if tail is None and n <= len(self.parts[0]):
            return self.parts[0][:n], False
        parts, starts, filled = self.parts, self._starts, self._filled
        if tail is not None or filled > n:  # no room after the rows: the next is taken
            spare = 0
        kept = n + spare
        out = self._empty(kept + (tail is not None))
        self.parts, self._starts = [out[:kept]], [0]
        self._capacity, rest = kept, []
        for i, start in enumerate(starts):
            part, parts[i] = parts[i], None  # released after its copy
            end = start + len(part)
            if start < n:
                out[start:min(end, n)].copy_(part[: min(end, n) - start])
            if end > n and filled > max(start, n):  # rows written after the first n
                rest.append(part[max(n - start, 0):])
            del part
        for part in rest:
            self.parts.append(part)
            self._starts.append(self._capacity)
            self._capacity += len(part)
        self._filled = max(filled, n)
        if tail is None:
            return out[:n], True
        out[n].copy_(tail)
        return out, True


def mapped_empty(rows: int, n_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``(rows, n_cols)`` tensor in a memory mapping of its own, which
    goes back to the system as soon as the tensor (and every view of it) is released.

    From ``torch.empty``, parts of a few MB came from the allocator's heap (glibc maps
    only blocks above a threshold that freeing other tensors raises, up to 32 MiB), and
    released parts stayed in the process: joining 30 parts of 2 MB held the path twice
    (113 MiB resident under a 64 MiB budget). The mapping's pages, zeroed by the
    system, are mapped as they are first written, as ``torch.empty``'s large blocks.
    """
    nbytes = rows * n_cols * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty((rows, n_cols), dtype=dtype)
    # Private: Python's default (MAP_SHARED) is shared memory, slower to fault in (a
    # third more time per recorded step), counted as shared, and written through by
    # forked children. The tensor holds the mapping (torch.frombuffer keeps its buffer).
    mapping = mmap.mmap(-1, nbytes, **_PRIVATE)
    return torch.frombuffer(mapping, dtype=dtype).view(rows, n_cols)


# Not on Windows, whose anonymous mappings are the process's own anyway.
_PRIVATE = ({"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS}
            if hasattr(mmap, "MAP_PRIVATE") else {})
