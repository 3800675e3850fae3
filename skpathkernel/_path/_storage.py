"""A trajectory's per-point vectors on disk: chunk files written while training, read lazily.

A recorded path is a few long series of P-vectors (the parameters at every point, Adam's
or RMSprop's second moments at every step). On disk each series is a folder of chunk
files, ``<directory>/<series>/<chunk:06d>.npy``, each holding ``chunk_rows`` consecutive
vectors as a plain ``.npy`` array: written with ``numpy.save`` and read with
``numpy.load(allow_pickle=False)``, so reading a trajectory never runs code from a file.
The rest (step indices, step sizes, batches, solver) is small and lives in memory, and in
``<directory>/trajectory.pt`` (``torch.load(weights_only=True)``) once synced.

Writing fills a one-chunk buffer and, when full, hands it to a writer thread and fills a
second one meanwhile: the file write overlaps training instead of stalling it. Buffers are
page-aligned and chunk files of a MiB or more are written with ``O_DIRECT`` where the file
system allows (the ``.npy`` header padded to 4096 bytes, still a plain ``.npy`` file): the
disk reads the buffer itself, so neither the page-cache copy nor the write-back takes the
cores that train. Each file goes to a temporary name of its own (two processes writing
into one directory never write one file) renamed over the chunk's, so a chunk file is
either complete or absent whenever the process stops. A directory that outlives the
process (saved, or pickled) is made durable when it is described: the files written
since are fsynced, then the description is written aside, fsynced, renamed into place and
its folder fsynced, so that after a power failure the description names files that hold
what it describes (a temporary directory, gone with the process, is not). Reading keeps the last two
chunks of a series in memory: a forward or backward sweep over the path (the path kernel,
the decomposition's adjoint) reads each chunk once, and memory stays at two chunks per
series whatever the number of points. A sweep that moves to the next chunk (or the
previous one, backwards) starts reading the one after on a reader thread while it uses
this one: at most three chunks per series, at most 3/32 of ``memory_budget``.

A fit that continues an on-disk path (``partial_fit``, ``warm_start``) appends to its
series in place (:meth:`Series.rewind`: the partly filled last chunk is read back into the
write buffer, and its file is later replaced, by a rename, with one holding the same
first rows) and keeps the training set beside them (:class:`DiskArray`,
``<directory>/data/``). The description ``trajectory.pt`` is written last, so the
directory describes the previous path, whole, until the longer one is complete.

Faults
------
- A write that fails (``OSError``: a full disk, a quota) keeps that chunk, and every later
  one, in memory (noticed when the next chunk is full, or at the end of recording), with
  a warning naming the file and the optimizer step: recording goes on and nothing
  recorded is lost; :meth:`Trajectory.save <skpathkernel.Trajectory.save>`
  later writes those chunks where the directory is moved.
- A chunk file that is missing, truncated, or holds vectors of another length or dtype (a
  file from another network's directory) raises :class:`TrajectoryFileError` (an
  ``OSError``) naming the file and the recorded points it held.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import pickle
import re
import shutil
import stat
import sys
import tempfile
import threading
import uuid
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "ChunkStore", "DiskArray", "DiskRows", "TrajectoryFileError",
           "chunk_rows_for", "free_disk"]

# Target size of one chunk file: large enough that file overhead is negligible, small
# enough that two chunks per series stay far below any memory_budget (at most 1/32 of it).
CHUNK_BYTES = 32 * 2**20
_CACHED_CHUNKS = 2
META_FILE = "trajectory.pt"
# How to point an object at a directory moved after it was made or pickled: said by every
# error about a directory that is not where the object looks.
RELOCATE_HINT = (
    "If the directory was moved (a model shipped with it, a pickle loaded elsewhere), "
    "point the model at its new place: est.relocate_trajectory(new_directory) for an "
    "estimator or a RecordedNetwork, trajectory.relocate(new_directory) for a Trajectory.")


class TrajectoryFileError(OSError):
    """A chunk file of an on-disk trajectory is missing, truncated or not this path's."""


def chunk_rows_for(n_params: int, itemsize: int, memory_budget: int) -> int:
    """Vectors per chunk file: ``min(CHUNK_BYTES, memory_budget / 32)`` bytes, at least one."""
    target = min(CHUNK_BYTES, int(memory_budget) // 32)
    return max(1, target // max(1, n_params * itemsize))


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def free_disk(parent) -> int:
    """Free bytes where a trajectory directory under ``parent`` would go."""
    parent = tempfile.gettempdir() if parent is None else os.fspath(parent)
    while not os.path.exists(parent):  # created at recording time
        parent = os.path.dirname(os.path.abspath(parent))
    return shutil.disk_usage(parent).free


# Chunk files whose data starts at this offset (the .npy header padded to it), written
# from page-aligned buffers with O_DIRECT where the file system allows: the disk's DMA
# reads the buffer, so the write costs no page-cache copy and no write-back work on the
# cores that train (on a 2-core machine this was most of the recording's overhead).
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_MIN_BYTES = 2**20  # smaller chunks: one ordinary write is cheaper


def _npy_header(array: np.ndarray, shape: tuple | None = None) -> bytes:
    """An ``.npy`` (format 1.0) header for ``array`` (of ``shape`` rows of its kind when
    given), padded to ``_ALIGN`` bytes."""
    shape = tuple(array.shape) if shape is None else tuple(shape)
    fields = (f"{{'descr': {np.lib.format.dtype_to_descr(array.dtype)!r}, "
              f"'fortran_order': False, 'shape': {shape!r}, }}")
    body = fields.encode("latin1").ljust(_ALIGN - 10 - 1) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


def aligned_empty(rows: int, n_params: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``(rows, n_params)`` buffer whose data starts on a page boundary."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(rows * n_params * itemsize + _ALIGN, dtype=torch.uint8)
    offset = -raw.data_ptr() % _ALIGN
    return raw[offset : offset + rows * n_params * itemsize].view(dtype).view(rows, n_params)


def _write_direct(tmp: str, array: np.ndarray) -> bool:
    """Write ``array`` as an ``.npy`` file bypassing the page cache; False if refused."""
    if (not _O_DIRECT or array.nbytes < _DIRECT_MIN_BYTES or not array.flags.c_contiguous
            or array.ctypes.data % _ALIGN):
        return False
    data = memoryview(array.reshape(-1).view(np.uint8))
    # O_DIRECT: whole blocks (4096 bytes covers 512-byte and 4K sectors) from aligned memory.
    direct = len(data) - len(data) % _ALIGN
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a file system without O_DIRECT (tmpfs)
            return False
        raise
    try:
        done = 0
        while done < direct:
            done += os.pwrite(fd, data[done:direct], _ALIGN + done)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # alignment this file system does not take
            return False
        raise
    finally:
        os.close(fd)
    with open(tmp, "r+b") as f:  # the header and the last partial sector: ordinary writes
        f.write(_npy_header(array))
        f.seek(_ALIGN + direct)
        f.write(data[direct:])
    return True


def aside(path: str) -> str:
    """A name beside ``path`` for a file written there and then renamed over it, this
    write's own: with a fixed ``path + ".tmp"``, two processes saving into one directory
    wrote one file, and one renamed the other's half-written file into place."""
    return f"{path}.{uuid.uuid4().hex[:16]}.tmp"


def sync_directory(directory: str) -> None:
    """fsync ``directory``: the names renamed or created in it survive a power failure.

    POSIX only: elsewhere a directory cannot be opened, and NTFS journals renames.
    """
    if os.name == "posix":
        fsync_path(directory)


def fsync_path(path: str) -> None:
    """fsync the file or (POSIX) directory at ``path`` through a descriptor of its own."""
    # Windows's fsync (_commit, FlushFileBuffers) needs a handle that may write: on one
    # opened read-only it fails with EBADF.
    fd = os.open(path, os.O_RDONLY if os.name == "posix" else os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def renamed_over(path: str):
    """A name aside for the body to write, renamed over ``path`` when it returns; on
    failure, ``path`` is left as it was and the file aside removed."""
    tmp = aside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def replace_durably(path: str, write, *, durable: bool = True, name: str | None = None
                    ) -> None:
    """``write(f)`` to a file aside, renamed over ``path``: readers see the old file or
    the new one, whole; a failure leaves ``path`` as it was and no file aside.

    ``durable``: the file is fsynced before the rename and its folder after, so that a
    power failure cannot leave ``path`` renamed but empty (ext4 and XFS write a new
    file's data after the rename's metadata otherwise). A refused file aside raises an
    ``OSError`` naming ``name`` (``path`` by default), not the name aside.
    """
    with renamed_over(path) as tmp:
        try:
            f = open(tmp, "wb")
        except OSError as exc:
            raise type(exc)(exc.errno, exc.strerror,
                            path if name is None else name) from None
        with f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    if durable:
        sync_directory(os.path.dirname(path))


def _writable(array: np.ndarray) -> np.ndarray:
    """``array`` if C-contiguous and writable, else a copy that is (for torch.from_numpy)."""
    return np.require(array, requirements=["C", "WRITEABLE"])


def _write_chunk(path: str, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically: a failed write leaves no partial file."""
    with renamed_over(path) as tmp:
        if not _write_direct(tmp, array):
            with open(tmp, "wb") as f:
                np.save(f, array, allow_pickle=False)


# One writer thread (chunk files in order, and buffers' pages) and one reader thread (the
# next chunk of a sweep, see Series.chunk), started when first used.
_threads: dict[str, ThreadPoolExecutor] = {}
_THREAD_PREFIX = "skpathkernel-chunk-"
_threads_lock = threading.Lock()


def _on(name: str, task) -> Future:
    """Run ``task`` on the background thread ``name`` ("writer" or "reader"), in order."""
    with _threads_lock:
        if name not in _threads:
            _threads[name] = ThreadPoolExecutor(
                1, thread_name_prefix=_THREAD_PREFIX + name)
        try:
            future = _threads[name].submit(task)
        except RuntimeError:  # the interpreter is exiting (an atexit handler): no threads
            future = None
    if future is None:  # then in this thread
        future = Future()
        try:
            future.set_result(task())
        except Exception as exc:
            future.set_exception(exc)
    future.skpathkernel_pid = os.getpid()
    return future


def _drain(name: str) -> None:
    """Wait for the tasks queued so far on the background thread ``name``, if started."""
    with _threads_lock:
        started = name in _threads
    if started:
        _on(name, lambda: None).result()


def _orphaned(future: Future) -> bool:
    """A task still pending when this process was forked: the child never runs it."""
    return not future.done() and future.skpathkernel_pid != os.getpid()


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's threads, and the lock may have been held
    # by one of them (another thread was starting a thread) at the fork.
    global _threads_lock
    _threads.clear()
    _threads_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _submit_write(path: str, array: np.ndarray) -> Future:
    """Write a chunk on the writer thread."""
    # The module attribute at call time: tests replace _write_chunk to simulate a full disk.
    return _on("writer", lambda: _write_chunk(path, array))


# Read the next chunk of a sweep while the current one is used (see Series.chunk).
PREFETCH = True


def _madvise():
    # madvise(MADV_POPULATE_WRITE), Linux 5.14 and later; None elsewhere.
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()
_MADV_POPULATE_WRITE = 23


def populate(tensors, stop: threading.Event | None = None, ahead=None) -> bool:
    """Map the pages of ``tensors``' memory now, on this thread, without writing to them.

    A buffer's first write to each page is a page fault (the kernel zeroes the page): in a
    recording buffer, that first touch made a copy of a point cost three times a copy into
    mapped memory. ``MADV_POPULATE_WRITE`` maps the pages as a write would and leaves their
    contents alone, so it can run on a background thread while the training thread writes
    the same buffers: whichever comes first maps a page, nothing is overwritten. The
    tensors are taken ``CHUNK_BYTES`` at a time, all of them abreast (their rows fill at
    the same pace), until ``stop`` is set; with ``ahead`` (a callable: the byte offset into
    each tensor below which pages are wanted now) no further than that, waiting for the
    writes to move on, so that a run which stops early never maps its unused rows. False
    where the kernel cannot (not Linux, before 5.14): the pages are then mapped by the
    writes, as without this.
    """
    if _MADVISE is None:
        return False
    page = mmap.PAGESIZE
    spans = []
    for t in tensors:
        start = t.data_ptr()
        spans.append((-(-start // page) * page,
                      (start + t.numel() * t.element_size()) // page * page))
    offset = 0
    while stop is None or not stop.is_set():
        if ahead is not None and offset >= ahead():
            stop.wait(0.005)  # 64 MiB ahead are many steps: no need to poll faster
            continue
        left = False
        for start, end in spans:
            if start + offset < end:
                left = True
                if _MADVISE(start + offset, min(CHUNK_BYTES, end - start - offset),
                            _MADV_POPULATE_WRITE):
                    return False
        if not left:
            return True
        offset += CHUNK_BYTES
    return True


def _touched_empty(rows: int, n_params: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`aligned_empty` with its pages mapped (the page faults paid here, not later)."""
    buffer = aligned_empty(rows, n_params, dtype)
    if not populate([buffer]):
        buffer.zero_()
    return buffer


def _remove_directory(directory: str, pending: list, owner: int) -> None:
    if os.getpid() != owner:  # a forked child's copy: the directory is the parent's
        return
    if all(future.done() for future in pending):
        shutil.rmtree(directory, True)
        return
    # After the writes still queued (a write going on would recreate files in it): as a
    # task on the writer thread, which runs them in order. Not by waiting for them: the
    # garbage collector may run this on the writer thread itself.
    removal = _on("writer", lambda: shutil.rmtree(directory, True))
    if not threading.current_thread().name.startswith(_THREAD_PREFIX + "writer"):
        removal.result()


_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-z]\d+)', 'fortran_order': (True|False), "
    r"'shape': \(((?:\d+, ?)*\d*)\), \}\s*$")


def _directory_mode(path: str) -> int | None:
    """The permissions of the empty directory ``path``, or where it does not exist those
    a directory made there gets (the umask's, read from one made and removed beside it:
    reading the umask itself means setting it, for every thread at once)."""
    if os.path.isdir(path):
        return stat.S_IMODE(os.stat(path).st_mode)
    probe = f"{path}.{os.getpid()}-{threading.get_ident()}.mode"
    try:
        os.mkdir(probe)
    except OSError:
        return None  # the rename then fails too, in words naming the path, or keeps 0o700
    try:
        return stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        os.rmdir(probe)


def _same_directory(path: str, directory: str) -> bool:
    """Whether ``path`` names ``directory`` (by its file, not its spelling: a link)."""
    try:
        return os.path.samefile(path, directory)
    except OSError:  # either is not there
        return False


def _read_chunk(path: str) -> np.ndarray:
    """A chunk file's array, its .npy header parsed without ``ast``.

    ``np.load`` parses the header with ``ast.literal_eval``, and CPython 3.11's AST
    constructor keeps its recursion depth in per-interpreter state: run on the reader
    thread while another thread compiles, it can fail with "AST constructor recursion
    depth mismatch" (python/cpython#106905). numpy's public header readers
    (``np.lib.format.read_array_header_1_0`` / ``_2_0``) call ``ast.literal_eval`` too
    (tested), so only the magic string is read with numpy's. The chunks' headers are
    numpy's plain form; any other falls back to ``np.load``.
    """
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        size = int.from_bytes(f.read(2 if major == 1 else 4), "little")
        match = _NPY_HEADER.match(f.read(size).decode("latin1"))
        if match is None:  # not the plain form: numpy's own reader
            f.seek(0)
            return np.load(f, allow_pickle=False)
        dtype = np.dtype(match.group(1))
        shape = tuple(int(n) for n in match.group(3).replace(" ", "").split(",") if n)
        data = np.fromfile(f, dtype=dtype, count=math.prod(shape))
    return data.reshape(shape, order="F" if match.group(2) == "True" else "C")


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class _Lease:
    """What a temporary directory's removal is tied to: the stores reading it hold it."""

    __slots__ = ("__weakref__",)


class ChunkStore:
    """A directory of chunked series; owned (temporary) stores delete it when collected.

    Parameters
    ----------
    directory : str
    chunk_rows : int
        Vectors per chunk file.
    owned : bool
        Delete the directory when this object, and every deep copy of it, is garbage
        collected (a temporary recording); :meth:`move` and pickling give that up.
    id : str or None
        The recording's identity, written in its description: :meth:`relocate` tells a
        moved copy of this directory from another recording's. None for a directory
        described before identities were written.
    """

    def __init__(self, directory, *, chunk_rows: int, owned: bool, id: str | None = None):
        # Absolute: the files are those named now, whatever the working directory is
        # when they are read (after a chdir, or in a pickle loaded elsewhere).
        self._place = [os.path.abspath(directory)]
        self.chunk_rows = int(chunk_rows)
        self.id = id
        # Weak: a series references its store, and the series' holders (the path's rows,
        # a recorder) keep them; a strong cycle left a temporary directory, which goes
        # with the last store, on disk until the cyclic garbage collector ran.
        self.series: weakref.WeakValueDictionary[str, Series] = weakref.WeakValueDictionary()
        self.failure: str | None = None  # the first failed write, when one failed
        self._pending: list[Future] = []  # writes in flight, awaited before deleting
        # Files written and not fsynced yet (relative names), shared by deep copies.
        self._unsynced: set[str] = set()
        # What the directory's removal waits for: held by this store and its deep copies.
        self._lease = _Lease() if owned else None
        self._finalizer = (weakref.finalize(self._lease, _remove_directory, self.directory,
                                            self._pending, os.getpid()) if owned else None)
        # The description written last: its file's identity and the path's step count.
        self._described: tuple[int, int, int, int] | None = None

    @property
    def directory(self) -> str:
        """Where the files are: shared by deep copies, which :meth:`move` moves too."""
        return self._place[0]

    @classmethod
    def create(cls, parent, *, chunk_rows: int) -> ChunkStore:
        """A fresh temporary directory under ``parent`` (the system's temp dir if None)."""
        parent = tempfile.gettempdir() if parent is None else os.path.abspath(parent)
        os.makedirs(parent, exist_ok=True)
        directory = tempfile.mkdtemp(prefix="skpathkernel-trajectory-", dir=parent)
        return cls(directory, chunk_rows=chunk_rows, owned=True, id=uuid.uuid4().hex)

    @property
    def owned(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def disown(self) -> None:
        """Keep the directory when this object goes (it is referenced elsewhere)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = None

    def add_series(self, name: str, n_params: int, dtype: torch.dtype,
                   delta_dtype: torch.dtype | None = None) -> Series:
        series = Series(self, name, n_params, dtype, delta_dtype=delta_dtype)
        os.makedirs(os.path.join(self.directory, name), exist_ok=True)
        self.series[name] = series
        return series

    def flush(self, release: bool = False) -> None:
        """Write every series' partly filled chunk, so that the files hold every vector.

        ``release`` ends the recording: the write buffers are freed.
        """
        for series in list(self.series.values()):
            series.flush_partial()
            if release:
                series._buffer = series._spare = series._deltas = None

    def written(self, *parts: str) -> None:
        """The file ``parts`` (relative to the directory) was written: synced with the
        next description of a kept directory."""
        self._unsynced.add(os.path.join(*parts))

    def write_meta(self, payload: dict) -> None:
        """Write the description; for a directory that outlives this process (not
        temporary), after making the files it describes durable (see the module's
        docstring)."""
        durable = not self.owned
        if durable:
            self._sync_written()
        replace_durably(os.path.join(self.directory, META_FILE),
                        partial(torch.save, payload), durable=durable)
        self._described = (*self._meta_identity(), len(payload["batch_offsets"]) - 1)

    def _sync_written(self) -> None:
        """fsync the files written since the last sync, and their folders."""
        _drain("writer")  # a chunk write still queued: its file renamed in place first
        folders = set()
        for name in sorted(self._unsynced):
            path = os.path.normpath(os.path.join(self.directory, name))
            if os.path.isdir(path):  # os.pardir: the directory's own name, moved there
                folders.add(path)
                continue
            try:
                fsync_path(path)
            except FileNotFoundError:  # a chunk whose write failed: kept in memory
                continue
            folders.add(os.path.dirname(path))
        for folder in sorted(folders):
            sync_directory(folder)
        self._unsynced.clear()

    def _meta_identity(self) -> tuple[int, int, int] | None:
        # A new file at every description (written aside, renamed over the old one).
        try:
            st = os.stat(os.path.join(self.directory, META_FILE))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def check_extendable(self, what: str, n_steps: int) -> None:
        """Refuse to append to a directory that is gone, read-only, or that another object
        extended.

        Copies of an estimator (a pickle, ``copy.copy`` or ``copy.deepcopy``) reference
        one directory: the first to append rows past the shared path of ``n_steps`` steps
        makes its description the directory's, and a second one appending from the same
        point would overwrite those rows.
        """
        if not os.path.isdir(self.directory):
            raise TrajectoryFileError(
                f"The on-disk trajectory's directory {self.directory!r} is gone: {what} "
                "cannot extend the path recorded there. Nothing was changed. "
                f"{RELOCATE_HINT} Otherwise fit a new network (fit, or partial_fit on a "
                "new estimator).")
        # Written when the path is extended: the directory, each series' folder (chunk
        # files are replaced by renames) and the training set's folder and files.
        data = os.path.join(self.directory, "data")
        written = [self.directory, *(os.path.join(self.directory, name)
                                     for name in list(self.series))]
        if os.path.isdir(data):
            written += [data, *(os.path.join(data, name) for name in os.listdir(data))]
        locked = [path for path in written if not os.access(path, os.W_OK)]
        if locked:
            raise TrajectoryFileError(
                f"{locked[0]!r} is read-only: {what} cannot extend the on-disk path "
                f"recorded in {self.directory!r}. Nothing was changed; make it writable, "
                "or fit a new network.")
        identity = self._meta_identity()
        if self._described is not None and identity is None:
            raise TrajectoryFileError(
                f"The description of the on-disk trajectory, "
                f"{os.path.join(self.directory, META_FILE)!r}, is missing: {what} cannot "
                "extend a path the directory does not describe. Nothing was changed.")
        if self._described is not None and (*identity, n_steps) != self._described:
            raise TrajectoryFileError(
                f"The on-disk trajectory in {self.directory!r} was described again since "
                f"this estimator's path was (another copy of the estimator, sharing the "
                f"directory, extended it): {what} would overwrite what that copy "
                "recorded. Continue that copy, or save this path elsewhere first "
                "(trajectory_.save(path) on a copy made before).")

    def move(self, path) -> None:
        """Rename the directory to ``path`` (which must not exist, or be an empty folder,
        or be this directory already).

        A rename, not a copy: on another file system (where a rename cannot work) a copy,
        then the original removed. Chunks kept in memory after a failed write are
        written to the new place. The directory is no longer temporary.
        """
        path = os.path.abspath(path)  # as in __init__
        if _same_directory(path, self.directory):
            # A second save to where it was saved (a script run again, a save after
            # partial_fit): nothing to move, and the caller rewrites the description.
            path = self.directory
        else:
            self._rename(path)
            self._unsynced.add(os.pardir)
        self.disown()
        self._place[0] = path  # for the deep copies reading this directory too
        self.failure = None
        for series in list(self.series.values()):
            series.write_memory_chunks()

    def _rename(self, path: str) -> None:
        if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
            raise FileExistsError(
                f"Cannot save the trajectory to {path!r}: it exists and is not an empty "
                "directory (an on-disk trajectory is saved by renaming its directory)."
            )
        mode = _directory_mode(path)
        # A read ahead queued or running would look in the old place, or (Windows) hold
        # a file open there, which stops the rename: let it finish first.
        _drain("reader")
        try:
            os.replace(self.directory, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            self._copy_across(path, mode)
        # mkdtemp made the temporary directory private (0o700), and a rename keeps that:
        # a model saved by one account (a training job) could not be read by another (the
        # service). After the move, which a file system refusing chmod must not undo.
        if mode is not None:
            with contextlib.suppress(OSError):
                os.chmod(path, mode)

    def relocate(self, path: str, n_steps: int) -> None:
        """Read from ``path`` from now on: this directory, moved or copied there (checked
        by the caller, :meth:`Trajectory.relocate <skpathkernel.Trajectory.relocate>`),
        described for a path of ``n_steps`` steps. Deep copies follow, as for :meth:`move`.
        """
        _drain("reader")  # a read ahead queued at the old place
        self._place[0] = path
        identity = self._meta_identity()
        self._described = None if identity is None else (*identity, int(n_steps))
        for series in list(self.series.values()):
            series.forget()

    def missing(self) -> str:
        """Why a file of this directory is not there when the directory itself is not:
        said in the errors about its files (empty while the directory is there)."""
        if os.path.isdir(self.directory):
            return ""
        return (f" The trajectory's directory {self.directory!r} is not there (moved or "
                f"deleted since this object was made or pickled). {RELOCATE_HINT}")

    def _copy_across(self, path: str, mode: int | None) -> None:
        """Copy the directory to ``path`` on another file system, then remove it here.

        shutil.move did so, but left a copy cut short (a full disk there) at ``path``,
        which the next save there refused as not empty, and where removing the original
        failed part way after a whole copy, it raised with the object still reading the
        original, half removed. A copy cut short is removed (an empty folder given is
        made again), and once the copy is whole, the original's removal cannot fail the
        save.
        """
        given = os.path.isdir(path)
        if given:
            os.rmdir(path)
        try:
            shutil.copytree(self.directory, path, symlinks=True)
            # Every file is new there: synced with the description, as written files are.
            for folder, _, files in os.walk(path):
                self._unsynced.update(os.path.relpath(os.path.join(folder, name), path)
                                      for name in files)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            if given:
                with contextlib.suppress(OSError):
                    os.mkdir(path)
                    if mode is not None:
                        os.chmod(path, mode)
            raise
        shutil.rmtree(self.directory, ignore_errors=True)

    def __getstate__(self):
        # Pickles reference the directory, not its data: the directory must outlive this
        # process's copy, so a temporary one is kept from now on (and said so).
        if self.owned:
            warnings.warn(
                f"Pickling references the on-disk trajectory in {self.directory!r}, which is "
                "now kept when the estimator is deleted (it was temporary). Move it where "
                "you want it first with trajectory_.save(path); delete it when done.",
                UserWarning, stacklevel=2,
            )
            self.disown()
        self.flush()
        # Not the series: they reference this store and register themselves when
        # unpickled (skops refuses reference cycles).
        return {"directory": self.directory, "chunk_rows": self.chunk_rows,
                "failure": self.failure, "id": self.id,
                "described": None if self._described is None else list(self._described)}

    def __deepcopy__(self, memo):
        # A copy in this process (copy.deepcopy of an estimator) shares the directory, and
        # its ownership: a temporary directory goes with the last copy. Through pickling's
        # state, it would be kept for good, as for a process that may read it later.
        self.flush()
        out = object.__new__(type(self))
        memo[id(self)] = out
        out.__setstate__({"directory": self.directory, "chunk_rows": self.chunk_rows,
                          "failure": self.failure, "id": self.id,
                          "described": self._described})
        out._lease, out._finalizer, out._pending = self._lease, self._finalizer, self._pending
        out._unsynced = self._unsynced
        # Its place too: a copy saved (moved) elsewhere takes the others along, which
        # read the old place's files, gone with the rename.
        out._place = self._place
        return out

    def __setstate__(self, state):
        self._place = [state["directory"]]
        self.chunk_rows = state["chunk_rows"]
        self.series = weakref.WeakValueDictionary()
        self.failure = state["failure"]
        self.id = state.get("id")  # None in a pickle made before identities were kept
        self._lease = self._finalizer = None
        self._pending = []
        self._unsynced = set()
        described = state.get("described")
        self._described = None if described is None else tuple(int(v) for v in described)


class Series:
    """One chunked series of P-vectors: append while recording, read any row lazily.

    With ``delta_dtype`` (float16 or bfloat16) a chunk file holds its first vector in
    full precision and every later one as its difference from the previous *stored*
    vector, rounded to ``delta_dtype`` (error feedback: the rounding does not accumulate
    along the chunk, each stored vector is within one rounding of the recorded one).
    Readers get the stored path, ``first + d_1 + ... + d_j`` summed in the full dtype,
    bit for bit what the writer kept.
    """

    def __init__(self, store: ChunkStore, name: str, n_params: int, dtype: torch.dtype,
                 n_rows: int = 0, delta_dtype: torch.dtype | None = None):
        self.store = store
        self.name = name
        self.n_params = int(n_params)
        self.dtype = dtype
        self.delta_dtype = delta_dtype
        self.n_rows = int(n_rows)
        self._init_runtime()
        self._memory: dict[int, np.ndarray] = {}  # encoded chunks whose write failed

    def _init_runtime(self):
        self._buffer: torch.Tensor | None = None
        # The buffer being written, then free (at first, its allocation in the background).
        self._spare: torch.Tensor | Future | None = None
        self._writing: tuple[Future, int, int, np.ndarray, int | None] | None = None
        self._deltas: torch.Tensor | None = None
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._ahead: tuple[int, Future] | None = None  # the chunk being read ahead
        self._last: int | None = None  # the chunk read last: the sweep's direction
        self.overflow: str | None = None  # a step the compression could not hold
        self._lock = threading.Lock()

    @property
    def chunk_rows(self) -> int:
        return self.store.chunk_rows

    def path(self, chunk: int) -> str:
        return os.path.join(self.store.directory, self.name, f"{chunk:06d}.npy")

    # -------------------------------------------------------------- writing
    def slot(self, k: int) -> torch.Tensor:
        """The buffer row that vector ``k`` (the next one) is copied into."""
        if k != self.n_rows:
            raise RuntimeError(f"Series {self.name!r} is written in order: expected vector "
                               f"{self.n_rows}, got {k}.")
        if self._buffer is None:
            self._allocate()
        return self._buffer[k % self.chunk_rows]

    def _allocate(self, ahead: bool = True) -> None:
        """The write buffer; ``ahead``: its pages (and a second buffer's) mapped now, on
        the writer thread, for a recording that fills chunks. A continued path's few new
        rows map only the pages they write (mapping two chunks per series cost a short
        ``partial_fit`` call several times its training)."""
        self._buffer = aligned_empty(self.chunk_rows, self.n_params, self.dtype)
        if self.delta_dtype is not None:
            self._deltas = torch.empty((self.chunk_rows, self.n_params),
                                       dtype=self.delta_dtype)
        if not ahead:
            return
        # Its pages mapped on the writer thread, ahead of the copies into its rows.
        _on("writer", partial(populate, [self._buffer]))
        if self.delta_dtype is None and self._spare is None:
            # The second buffer's pages are mapped on the writer thread, idle until the
            # first chunk is full, instead of by the copies on the training thread.
            self._spare = _on("writer", lambda: _touched_empty(
                self.chunk_rows, self.n_params, self.dtype))

    def rewind(self, n_rows: int, *, append: bool) -> None:
        """Make the series its first ``n_rows`` vectors again (later ones are dropped).

        For a path that is continued (``append``: the vectors of the partly filled last
        chunk are read back into the write buffer, and the next vector is ``n_rows``) or
        an extension that failed (the series as the path it extended left it). Rows below
        ``n_rows`` are never written again: appending replaces the last chunk file, by a
        rename, with one that holds the same first rows and the new ones, so that the path
        described in the directory reads the same whenever the process stops.

        The chunk write in flight is awaited first. The disk refusing it is expected
        (:meth:`_settle` keeps that chunk in memory, with a warning); any other error of
        the write is raised once the series is rewound: the rows it keeps are the same
        either way (a chunk file is replaced only by a whole write), and the error is
        not hidden.
        """
        try:
            self._settle()
        except BaseException as exc:  # raised below, the series rewound
            failed = exc
        else:
            failed = None
        self.n_rows = int(n_rows)
        self.forget()
        self._buffer = self._spare = self._deltas = None
        self.overflow = None
        for chunk in [c for c in self._memory if c * self.chunk_rows >= self.n_rows]:
            del self._memory[chunk]
        if failed is not None:
            raise failed
        if not append:
            return
        self._allocate(ahead=False)
        rows = self.n_rows % self.chunk_rows
        if not rows:
            return
        chunk = self.n_rows // self.chunk_rows
        raw = self._memory.get(chunk)
        if raw is None:
            raw = self._read_checked(chunk)
        self._buffer[:rows] = self._decode(raw, rows)
        if self.delta_dtype is not None and rows > 1:
            head = self._head_rows
            self._deltas[1:rows] = torch.from_numpy(np.ascontiguousarray(
                raw[head:head + rows - 1]).view(np.int16)).view(self.delta_dtype)

    def commit(self, k: int, step: int) -> None:
        """Vector ``k`` (recorded at optimizer ``step``) is in its slot: write a full chunk."""
        i = k % self.chunk_rows
        if self.delta_dtype is not None and i:
            # The buffer keeps the stored path: what readers will reconstruct.
            d = self._deltas[i]
            d.copy_(self._buffer[i] - self._buffer[i - 1])
            # A finite step past the dtype's range (65504 in float16) stores inf, then nan,
            # for a finite path: noted, for finish() to refuse the path (a vector that is
            # itself not finite is a diverging run, which the trainer reports).
            if (self.overflow is None and not bool(torch.isfinite(d).all())
                    and bool(torch.isfinite(self._buffer[i]).all())):
                self.overflow = (
                    f"vector {k} of {self.name!r} (optimizer step {step}) differs from the "
                    f"previous point by up to "
                    f"{float((self._buffer[i] - self._buffer[i - 1]).abs().max()):.3g}, "
                    f"past {dtype_name(self.delta_dtype)}'s range: the stored path is not "
                    "finite from there. Use compression 'bfloat16' (float32's range) or "
                    "none.")
            torch.add(self._buffer[i - 1], d.to(self.dtype), out=self._buffer[i])
        self.n_rows = k + 1
        if self.n_rows % self.chunk_rows == 0:
            self._flush(k // self.chunk_rows, self.chunk_rows, step)

    def flush_partial(self) -> None:
        self._settle()
        rows = self.n_rows % self.chunk_rows
        if rows and self._buffer is not None:
            self._flush(self.n_rows // self.chunk_rows, rows, None, wait=True)

    def _encode(self, rows: int) -> np.ndarray:
        data = self._buffer[:rows]
        if self.delta_dtype is None:
            return data.numpy()
        # As 16-bit words: the first vector's bytes, then the rounded differences.
        first = data[0].numpy().view(np.uint16).reshape(-1, self.n_params)
        deltas = self._deltas[1:rows].view(torch.int16).numpy().view(np.uint16)
        return np.concatenate([first, deltas])

    def _decode(self, array: np.ndarray, rows: int) -> torch.Tensor:
        if self.delta_dtype is None:
            return torch.from_numpy(_writable(array[:rows]))
        head = self._head_rows
        out = torch.empty((rows, self.n_params), dtype=self.dtype)
        # Writable copies where ``array`` is a read-only map of a file (a directory's
        # chunk checked in place): torch warns that it does not support non-writable
        # tensors.
        out[0] = torch.from_numpy(_writable(array[:head]).reshape(-1).view(
            _NUMPY_DTYPES[self.dtype]))
        deltas = torch.from_numpy(_writable(array[head:head + rows - 1]).view(
            np.int16)).view(self.delta_dtype)
        for j in range(1, rows):  # the writer's additions, in its order
            torch.add(out[j - 1], deltas[j - 1].to(self.dtype), out=out[j])
        return out

    @property
    def _head_rows(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size() // 2

    def _file_shape(self, rows: int) -> tuple[int, int]:
        extra = 0 if self.delta_dtype is None else self._head_rows - 1
        return (rows + extra, self.n_params)

    def _flush(self, chunk: int, rows: int, step: int | None, wait: bool = False) -> None:
        self._settle()  # the previous chunk's write: its buffer is the next one
        if isinstance(self._spare, Future):
            self._spare = None if _orphaned(self._spare) else self._spare.result()
        data = self._encode(rows)
        self._cache.pop(chunk, None)
        if self.store.failure is not None:
            self._memory[chunk] = data.copy()
            return
        future = _submit_write(self.path(chunk), data)
        self.store.written(self.name, f"{chunk:06d}.npy")
        self.store._pending[:] = [f for f in self.store._pending if not f.done()] + [future]
        with self._lock:
            self._writing = (future, chunk, rows, data, step)
        if wait:  # a partly filled chunk: recording may go on into this buffer
            self._settle()
        elif self.delta_dtype is None:  # data is a view of the buffer: fill the other one
            self._buffer, self._spare = (
                self._spare if self._spare is not None
                else aligned_empty(self.chunk_rows, self.n_params, self.dtype),
                self._buffer)

    def _settle(self) -> None:
        """Wait for the chunk write in flight, if any; keep it in memory if it failed."""
        with self._lock:
            writing, self._writing = self._writing, None
            if writing is None:
                return
            future, chunk, rows, data, step = writing
            if _orphaned(future):  # the parent's writer thread writes it: read from memory
                self._memory[chunk] = data.copy()
                return
            exc = future.exception()
        # Settled: out of the store's writes in flight, which its finalizer holds. An
        # error raised from here holds the frames it goes through (this series, the
        # store): left there, it kept the store, and its directory, until exit.
        with contextlib.suppress(ValueError):
            self.store._pending.remove(future)
        if exc is None:
            self._memory.pop(chunk, None)
            return
        if not isinstance(exc, OSError):
            raise exc
        if self.store.failure is None:
            path = self.path(chunk)
            first = chunk * self.chunk_rows
            at = "" if step is None else f", optimizer step {step}"
            self.store.failure = (
                f"writing {path!r} (vectors {first}..{first + rows - 1} of "
                f"{self.name!r}{at}) failed: {exc}")
            warnings.warn(
                f"On-disk trajectory: {self.store.failure}. Recording continues with "
                "this and every later chunk in memory; nothing recorded is lost. Free "
                "space and move the trajectory with trajectory.save(path), which "
                "writes them.", UserWarning, stacklevel=3)
        self._memory[chunk] = data.copy()

    def write_memory_chunks(self) -> None:
        self._settle()
        for chunk in sorted(self._memory):
            _write_chunk(self.path(chunk), self._memory[chunk])
            self.store.written(self.name, f"{chunk:06d}.npy")
        self._memory.clear()

    # -------------------------------------------------------------- reading
    def row(self, k: int) -> torch.Tensor:
        chunk, i = divmod(int(k), self.chunk_rows)
        live = self.n_rows // self.chunk_rows
        if self._buffer is not None and chunk == live and k < self.n_rows:
            return self._buffer[i].clone()  # recording goes on into this buffer
        return self.chunk(chunk)[i]

    def _rows_in(self, chunk: int, n_rows: int | None = None) -> int:
        n_rows = self.n_rows if n_rows is None else n_rows
        return min(self.chunk_rows, n_rows - chunk * self.chunk_rows)

    def chunk(self, chunk: int) -> torch.Tensor:
        with self._lock:
            data = self._cache.get(chunk)
            if data is not None:
                self._cache.move_to_end(chunk)
            ahead = self._ahead if self._ahead and self._ahead[0] == chunk else None
            if ahead is not None:
                self._ahead = None
                if _orphaned(ahead[1]):  # queued in the parent before a fork: read here
                    ahead = None
        if data is None:
            if ahead is not None:
                data = ahead[1].result()  # a failed read raises here, as a direct one would
            else:
                self._settle()  # the chunk may be the one being written
                if chunk in self._memory:
                    data = self._decode(self._memory[chunk], self._rows_in(chunk))
                else:
                    data = self._load(chunk)
            with self._lock:
                self._cache[chunk] = data
                while len(self._cache) > _CACHED_CHUNKS:
                    self._cache.popitem(last=False)
        if chunk != self._last:
            if self._last is not None:
                self._read_ahead(chunk, chunk - self._last)
            self._last = chunk
        return data

    def _read_ahead(self, chunk: int, step: int) -> None:
        """Start reading the next chunk of a sweep (forward or backward) in the background.

        Only when the sweep moved by one chunk, and only a complete file of a chunk that
        is not cached: memory holds at most the two cached chunks plus this one.
        """
        nxt = chunk + step
        if (not PREFETCH or abs(step) != 1 or not 0 <= nxt * self.chunk_rows < self.n_rows
                or self._writing is not None or nxt in self._memory):
            return
        if self._buffer is not None and nxt >= self.n_rows // self.chunk_rows:
            return  # still being recorded
        with self._lock:
            if nxt in self._cache or (self._ahead and self._ahead[0] == nxt):
                return
            self._ahead = (nxt, _on("reader", lambda: self._load(nxt)))

    def forget(self) -> None:
        """Drop the chunks read so far (cached, or read ahead)."""
        with self._lock:
            self._cache.clear()
            self._ahead = None
            self._last = None

    def _load(self, chunk: int) -> torch.Tensor:
        return self._decode(self._read_checked(chunk), self._rows_in(chunk))

    def _read_checked(self, chunk: int, path: str | None = None,
                      n_rows: int | None = None) -> np.ndarray:
        """Chunk ``chunk``'s file as stored, checked to hold its rows of this series.

        ``path``: the file read instead, and only its header, the array mapped (a
        directory's files checked before the series reads from there), for the series'
        first ``n_rows`` vectors.
        """
        header = path is not None
        path = self.path(chunk) if path is None else path
        first = chunk * self.chunk_rows
        rows = self._rows_in(chunk, n_rows)
        where = f"{path!r} (vectors {first}..{first + rows - 1} of {self.name!r})"
        try:
            array = (np.load(path, mmap_mode="r", allow_pickle=False) if header
                     else _read_chunk(path))
        except FileNotFoundError:
            raise TrajectoryFileError(f"Trajectory chunk file {where} is missing."
                                      f"{'' if header else self.store.missing()}") from None
        except PermissionError as exc:
            # Not the file's contents: a directory saved private to another account.
            raise TrajectoryFileError(
                f"Trajectory chunk file {where} cannot be read: {exc.strerror} (the "
                "permissions of the file or of its directories refuse this process)."
            ) from None
        except (OSError, ValueError, EOFError) as exc:
            raise TrajectoryFileError(
                f"Trajectory chunk file {where} is truncated or corrupt: {exc}") from None
        want = _NUMPY_DTYPES[self.dtype] if self.delta_dtype is None else np.uint16
        shape = self._file_shape(rows)
        if array.ndim != 2 or array.shape[0] < shape[0] or array.shape[1] != shape[1] \
                or array.dtype != want:
            raise TrajectoryFileError(
                f"Trajectory chunk file {where} holds an array of shape {array.shape} and "
                f"dtype {array.dtype}, not {shape} {np.dtype(want).name} values: it is "
                "truncated or belongs to another network's trajectory."
            )
        return array

    def check_files(self, directory: str, n_rows: int) -> None:
        """Check that ``directory`` holds this series' first ``n_rows`` vectors, in files
        of the right shape and dtype (their headers only; chunks kept in memory after a
        failed write are not looked for)."""
        for chunk in range(-(-int(n_rows) // self.chunk_rows)):
            if chunk not in self._memory:
                self._read_checked(chunk, os.path.join(directory, self.name,
                                                       f"{chunk:06d}.npy"), n_rows)

    def stored_chunk(self, directory: str, chunk: int, n_rows: int) -> torch.Tensor:
        """Chunk ``chunk``'s vectors as stored in ``directory``, for a series of the
        first ``n_rows`` vectors (the file checked to be this series')."""
        path = os.path.join(directory, self.name, f"{chunk:06d}.npy")
        return self._decode(self._read_checked(chunk, path, n_rows),
                            self._rows_in(chunk, n_rows))

    def __getstate__(self):
        self._settle()
        return {"store": self.store, "name": self.name, "n_params": self.n_params,
                "dtype": dtype_name(self.dtype), "delta_dtype": dtype_name(self.delta_dtype),
                "n_rows": self.n_rows, "memory": dict(self._memory)}

    def __setstate__(self, state):
        self.store = state["store"]
        self.name = state["name"]
        self.n_params = state["n_params"]
        self.dtype = getattr(torch, state["dtype"])
        self.delta_dtype = state["delta_dtype"] and getattr(torch, state["delta_dtype"])
        self.n_rows = state["n_rows"]
        self._memory = {int(chunk): data for chunk, data in state["memory"].items()}
        self._init_runtime()
        self.store.series[self.name] = self


class DiskRows:
    """Vectors ``start`` to ``n - 1`` of a series (plus an optional last one in memory).

    Quacks like the ``(n_points, P)`` tensor that an in-memory trajectory holds, for what
    :class:`~skpathkernel.Trajectory` reads of it: ``len``, ``shape``, ``dtype`` and
    ``rows[k]`` for an int ``k``. ``start`` is 0 but for the segment a continued fit
    appends to its path's series.
    """

    def __init__(self, series: Series, n: int, tail: torch.Tensor | None = None,
                 start: int = 0):
        self.series = series
        self.n = int(n)
        self.tail = tail
        self.start = int(start)

    def __len__(self) -> int:
        return self.n - self.start + (self.tail is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.series.n_params)

    @property
    def dtype(self) -> torch.dtype:
        return self.series.dtype

    def element_size(self) -> int:
        """Bytes per stored value (2 for a series of float16 / bfloat16 differences)."""
        dtype = self.series.delta_dtype or self.dtype
        return torch.empty((), dtype=dtype).element_size()

    def numel(self) -> int:
        return len(self) * self.series.n_params

    def __getstate__(self):
        # The last point as a NumPy array: skops reads no torch tensors.
        return {"series": self.series, "n": self.n, "start": self.start,
                "tail": None if self.tail is None else self.tail.numpy()}

    def __setstate__(self, state):
        self.series, self.n = state["series"], state["n"]
        self.start = state.get("start", 0)
        tail = state["tail"]
        self.tail = None if tail is None else torch.from_numpy(_writable(tail))

    def __getitem__(self, k: int) -> torch.Tensor:
        k = int(k)
        if self.tail is not None and k == self.n - self.start:
            return self.tail
        return self.series.row(self.start + k)


class DiskArray:
    """Rows appended to one ``.npy`` file in a store's directory, read as a memmap.

    The training set of a path continued on disk (``partial_fit``, ``warm_start``):
    ``<directory>/data/<name>.npy``, a plain ``.npy`` file whose header is padded to 4096
    bytes, so that appending writes the new rows after the ``n_rows`` in use and then
    the header's new shape in place. How many rows belong to the path is the path's
    ``n_samples`` in the directory's description, written after the rows: a process that
    stops in between leaves rows past it, which the next append overwrites. Pickles as a
    reference to the file (through its store, like the path's chunk files).
    """

    def __init__(self, store: ChunkStore, name: str, dtype, row_shape, n_rows: int = 0):
        self.store = store
        self.name = name
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(int(d) for d in row_shape)
        self.n_rows = int(n_rows)

    @property
    def path(self) -> str:
        return self._path_in(self.store.directory)

    def _path_in(self, directory: str) -> str:
        return os.path.join(directory, "data", f"{self.name}.npy")

    @property
    def _row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.row_shape)

    def appended(self, rows: np.ndarray) -> DiskArray:
        """A new reference to the file with ``rows`` written after this one's rows.

        This object keeps its rows: an estimator copy made before still reads (and
        pickles) the training set of its own path.
        """
        out = DiskArray(self.store, self.name, self.dtype, self.row_shape, self.n_rows)
        out.append(rows)
        return out

    def append(self, rows: np.ndarray) -> None:
        """Write ``rows`` after the rows in use (then the header); an error leaves those."""
        rows = np.ascontiguousarray(rows)
        if rows.shape[1:] != self.row_shape or not np.can_cast(rows.dtype, self.dtype,
                                                               "same_kind"):
            raise ValueError(f"Rows of shape {rows.shape[1:]} and dtype {rows.dtype} cannot "
                             f"be appended to {self.path!r} ({self.row_shape} "
                             f"{self.dtype}).")
        rows = rows.astype(self.dtype, copy=False)
        if self.n_rows == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        n = self.n_rows + len(rows)
        with open(self.path, "r+b" if self.n_rows else "wb") as f:
            f.seek(_ALIGN + self.n_rows * self._row_bytes)
            f.write(memoryview(rows.reshape(-1).view(np.uint8)))
            f.seek(0)
            f.write(_npy_header(rows, (n, *self.row_shape)))
        self.store.written("data", f"{self.name}.npy")
        self.n_rows = n

    def array(self) -> np.ndarray:
        """The rows in use, read from the file as they are needed (read-only)."""
        self.check_file()
        try:
            return np.memmap(self.path, dtype=self.dtype, mode="r", offset=_ALIGN,
                             shape=(self.n_rows, *self.row_shape))
        except PermissionError as exc:
            # Its size is read from the directory: a file private to another account in
            # a directory the process may read passes getsize and is refused here.
            raise self._unreadable(self.path, exc) from None

    def _unreadable(self, path: str, exc: OSError) -> TrajectoryFileError:
        """The error for the file ``path`` refused (permissions) where it is read."""
        return TrajectoryFileError(f"The training data file {path!r} ({self.n_rows} "
                                   f"training rows) cannot be read: {exc.strerror}.")

    def check_file(self, directory: str | None = None) -> None:
        """Check that the file (in ``directory`` instead, where given) holds the rows."""
        path = self.path if directory is None else self._path_in(directory)
        where = f"{path!r} ({self.n_rows} training rows)"
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            missing = self.store.missing() if directory is None else ""
            raise TrajectoryFileError(f"The training data file {where} is missing."
                                      f"{missing}") from None
        except OSError as exc:
            raise self._unreadable(path, exc) from None
        if size < _ALIGN + self.n_rows * self._row_bytes:
            raise TrajectoryFileError(f"The training data file {where} is truncated.")

    def __getstate__(self):
        return {"store": self.store, "name": self.name, "dtype": self.dtype.str,
                "row_shape": list(self.row_shape), "n_rows": self.n_rows}

    def __setstate__(self, state):
        self.__init__(state["store"], state["name"], state["dtype"], state["row_shape"],
                      state["n_rows"])


# ------------------------------------------------------------------ shared arrays
# An in-memory path sent to worker processes (loky) travels as the name of a directory
# of .npy files written once, which every worker maps (copy-on-write: the pages are the
# page cache's, shared by all of them) instead of a pickled copy per task. The workers
# keep the last few directories they opened, so the tasks of one call and of the next
# find the path already mapped.
_SHARED_KEEP = 4
_shared_opened: OrderedDict = OrderedDict()
_shared_lock = threading.Lock()
_SHARED_META = "meta.pkl"


def _shared_parent(nbytes: int) -> str | None:
    """/dev/shm (memory, no disk write) when it has room for ``nbytes``, else the
    temporary directory."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * nbytes:
            return shm
    except OSError:
        pass
    return None


def share_arrays(arrays: dict, meta) -> str:
    """Write ``arrays`` (name to ndarray) and the picklable ``meta`` to a new private
    temporary directory, for :func:`open_shared`; the caller removes it."""
    nbytes = sum(a.nbytes for a in arrays.values())
    directory = tempfile.mkdtemp(prefix="skpathkernel-shared-", dir=_shared_parent(nbytes))
    try:
        for name, array in arrays.items():
            np.save(os.path.join(directory, name + ".npy"), np.ascontiguousarray(array))
        with open(os.path.join(directory, _SHARED_META), "wb") as f:
            pickle.dump((meta, sorted(arrays)), f, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def open_shared(directory: str, build):
    """``build(meta, arrays)`` of a directory of :func:`share_arrays`, the arrays mapped
    copy-on-write; the object built is kept per process and returned again."""
    with _shared_lock:
        # Maps of a directory its writer has removed would hold their memory until four
        # newer paths push them out.
        for gone in [d for d in _shared_opened if not os.path.isdir(d)]:
            del _shared_opened[gone]
        kept = _shared_opened.get(directory)
        if kept is not None:
            _shared_opened.move_to_end(directory)
            return kept
    try:
        with open(os.path.join(directory, _SHARED_META), "rb") as f:
            meta, names = pickle.load(f)
        arrays = {name: np.load(os.path.join(directory, name + ".npy"), mmap_mode="c")
                  for name in names}
    except FileNotFoundError:
        raise TrajectoryFileError(
            f"The trajectory was sent to this process as the directory {directory!r}, "
            "which is not readable here (a worker on another machine, or the call that "
            "wrote it has ended). Tasks on other machines get an on-disk trajectory in "
            "a shared directory (PathRecorder(storage='disk', directory=...)) or a copy."
        ) from None
    built = build(meta, arrays)
    with _shared_lock:
        _shared_opened[directory] = built
        while len(_shared_opened) > _SHARED_KEEP:
            _shared_opened.popitem(last=False)
    return built
