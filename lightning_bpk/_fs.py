"""Durable file primitives shared by every layer that writes: atomic publish, fsync, sinks.

**Publishing.** The recipe is the one every careful checkpointer converges on: write a scratch
file in the *target* directory (a rename is only atomic within one filesystem), fsync it,
``os.replace`` it over the destination, then fsync the directory so the rename itself survives a
power loss.

**Sinks.** A writer that knows a file's size before its first byte (the burnpack writer plans
every offset first) streams it into a :class:`Sink`: ``write`` appends, ``patch`` rewrites bytes
already written (a pack's checksums, known once its data is written). :func:`open_sink` and
:func:`atomic_sink` choose one of two:

- :class:`DirectSink` writes with ``O_DIRECT``: the bytes are copied into a few page-aligned
  buffers, reused by every write of the process, and one I/O thread ``pwrite``\\ s each full one
  while the caller fills the next. The last block is padded to the alignment and the file is
  truncated back to its exact size; a patch of bytes already on disk reads the aligned blocks
  around them back and writes them again. It skips the page cache, whose first touch of fresh
  memory costs these VMs more than the disk (a buffered durable write of 1 GiB took 1.7-3.3 s
  where ``O_DIRECT`` took 0.8-1.3 s, measured side by side). Memory that is already aligned is
  written from where it lies, with no copy (an async saver's staging buffers, laid out as the
  file, can be written this way).
- :class:`BufferedSink` writes through the page cache: small pieces are gathered into one buffer
  and written together, large ones as they come.

The rule: ``O_DIRECT`` when the file is at least :data:`DIRECT_MIN` bytes (below that both paths
cost the same, about one fsync), the filesystem reports that it supports it (``statx``
``STATX_DIOALIGN``, Linux 6.1+; before that, the logical block size of the block device it lives
on, from ``/sys/dev/block``) and ``fcntl`` accepts the flag; the page cache otherwise (tmpfs,
overlay and network filesystems report no alignment and have no block device). Which path a file
took is logged at debug level by the ``lightning_bpk`` logger.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import io
import itertools
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import numpy

__all__ = [
    "DIRECT_MIN",
    "SCRATCH_MARK",
    "SCRATCH_SUFFIX",
    "BufferedSink",
    "DirectSink",
    "MemorySink",
    "Sink",
    "Worker",
    "aligned_buffer",
    "atomic_file",
    "atomic_sink",
    "direct_alignment",
    "fsync_dir",
    "open_sink",
    "read_full",
    "scratch_path",
    "write_all",
]

# Scratch names carry this suffix so a later save can recognise and remove leftovers of a crash.
SCRATCH_SUFFIX = ".tmp"
SCRATCH_MARK = r"\.[0-9]+-[0-9]+" + re.escape(SCRATCH_SUFFIX)
"""What :func:`scratch_path` appends to a name (``.<pid>-<counter>.tmp``), as a regular
expression: how a later save recognises the leftovers of a crash."""

DIRECT_MIN = 256 * 1024
"""Files smaller than this are written through the page cache: measured here, a durable write
of 4-256 KiB costs the same either way (about one fsync); from 1 MiB on ``O_DIRECT`` is faster
and steadier."""

# The buffers of DirectSink: two of 8 MiB (one filled while the other is written; larger ones
# gained nothing here, and one thread saturates the disk). A patch that spans more is done in
# pieces of this size.
_BUFFER_SIZE = 8 * 1024 * 1024
_BUFFERS = 2
# BufferedSink gathers pieces smaller than this into one buffer (5,000 tensors of 4 KiB: 20
# writes instead of 10,000).
_GATHER_SIZE = 1024 * 1024

_log = logging.getLogger("lightning_bpk")
T = TypeVar("T")
_counter = itertools.count()

Bytes = bytes | bytearray | memoryview | mmap.mmap


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename or unlink inside it) to stable storage."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(f: BinaryIO | _At, data: Bytes) -> None:
    """Write every byte of ``data``; a raw file may accept fewer bytes than offered. Every byte
    this package writes to a file goes through here (tests inject faults at this call)."""
    view = memoryview(data).cast("B")
    while view:
        written = f.write(view)
        if written is None or written <= 0:  # pragma: no cover - raw files always report a count
            raise OSError(f"short write to {getattr(f, 'name', '?')}")
        view = view[written:]


def read_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` with the bytes of the open file ``fd`` from ``offset`` on (``preadv`` may
    return fewer bytes than asked); the count read, short of ``view.nbytes`` only where the file
    ends first. What a short count means is the caller's to say."""
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def scratch_path(target: Path) -> Path:
    """A sibling name for staging ``target``: ``<name>.<pid>-<counter>.tmp``."""
    return target.with_name(f"{target.name}.{os.getpid()}-{next(_counter)}{SCRATCH_SUFFIX}")


@contextlib.contextmanager
def _scratch(target: Path) -> Iterator[int]:
    """A new scratch file beside ``target``, open read-write; when the block succeeds it
    replaces ``target`` and the directory is fsynced (the caller fsyncs the file first). On any
    failure the scratch file is removed and an existing ``target`` is left untouched."""
    while True:
        scratch = scratch_path(target)
        try:
            fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            break
        except FileExistsError:
            continue
    try:
        try:
            yield fd
        finally:
            os.close(fd)
        os.replace(scratch, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        raise
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[BinaryIO]:
    """Yield an unbuffered binary file that replaces ``target`` atomically on success.

    On any failure the scratch file is removed and an existing ``target`` is left untouched.
    """
    with _scratch(target) as fd, os.fdopen(fd, "wb", buffering=0, closefd=False) as f:
        yield f
        os.fsync(fd)


@contextlib.contextmanager
def atomic_sink(target: Path, size: int, *, name: str | None = None) -> Iterator[Sink]:
    """A :class:`Sink` for the ``size`` bytes of a file that replaces ``target`` atomically and
    durably on success (as :func:`atomic_file`); ``name`` is what errors and logs call it."""
    with _scratch(target) as fd:
        with _sink_on(fd, name or str(target), size, direct=True) as sink:
            yield sink
        os.fsync(fd)


@contextlib.contextmanager
def open_sink(
    path: Path, size: int, *, direct: bool = True, name: str | None = None
) -> Iterator[Sink]:
    """A :class:`Sink` writing ``path`` in place (created or truncated; not fsynced: the caller
    publishes it). ``direct=False`` keeps the page cache (a file read back at once)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with _sink_on(fd, name or str(path), size, direct=direct) as sink:
            yield sink
    finally:
        os.close(fd)


class Sink(Protocol):
    """Where a streaming writer puts a file's bytes (see the module docstring)."""

    name: str
    direct: bool  # whether the bytes bypass the page cache

    def write(self, data: Bytes) -> None:
        """Append ``data`` (the sink may keep it until a later call or the end)."""
        ...

    def patch(self, offset: int, data: Bytes) -> None:
        """Replace bytes ``[offset, offset + len(data))``, all of them written already."""
        ...

    def finish(self) -> None:
        """Write out what the sink still holds (the end of its block does it too; a writer
        calls it to see the errors of the last write as its own)."""
        ...


@contextlib.contextmanager
def _sink_on(fd: int, name: str, size: int, *, direct: bool) -> Iterator[Sink]:
    sink: DirectSink | BufferedSink | None = None
    if direct and size >= DIRECT_MIN:
        alignment, why = direct_alignment(fd)
        if alignment is not None:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError as e:
                why = f"O_DIRECT refused: {e.strerror}"
            else:
                sink = DirectSink(fd, name, alignment)
                _log.debug("writing %s with O_DIRECT (%d-byte blocks, %s)", name, alignment, why)
    else:
        why = "read back at once" if not direct else f"{size} bytes < {DIRECT_MIN}"
    if sink is None:
        sink = BufferedSink(fd, name, size)
        _log.debug("writing %s through the page cache (%s)", name, why)
    try:
        yield sink
        sink.finish()
    finally:
        sink.release()


# --- O_DIRECT -----------------------------------------------------------------------------------

_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256  # struct statx; stx_dio_mem_align and stx_dio_offset_align lie at 152 and 156
_DIO_FIELDS = 152


def direct_alignment(fd: int) -> tuple[int | None, str]:
    """The alignment (bytes; a multiple of the page size) of offsets, lengths and memory for
    ``O_DIRECT`` on the open file ``fd``, and where it came from; ``(None, why not)`` when the
    filesystem cannot do direct I/O or does not say so."""
    reported = _statx_dio(fd)
    if reported is not None:
        memory, offset = reported
        if not offset:
            return None, "statx: no direct I/O on this filesystem"
        source = f"statx: memory {memory}, offsets {offset}"
    else:
        block = _logical_block_size(os.fstat(fd).st_dev)
        if block is None:
            return None, "statx reports no direct I/O alignment and there is no block device"
        memory = offset = block
        source = f"logical block size {block}"
    alignment = max(offset, mmap.PAGESIZE)
    if memory > mmap.PAGESIZE or alignment & (alignment - 1) or _BUFFER_SIZE % alignment:
        return None, f"unusual alignment ({source})"
    return alignment, source


@functools.cache
def _statx() -> Any:
    """The C library's ``statx`` (glibc 2.28+), None without one."""
    statx = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)
    if statx is not None:
        statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
        statx.argtypes += [ctypes.c_char_p]
        statx.restype = ctypes.c_int
    return statx


def _statx_dio(fd: int) -> tuple[int, int] | None:
    """``(memory, offset)`` alignment from ``statx(STATX_DIOALIGN)`` (zeros: no direct I/O), or
    None when the C library or the kernel (before 6.1) or the filesystem does not report it."""
    statx = _statx()
    if statx is None:
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buffer) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buffer, 0)
    if not mask & _STATX_DIOALIGN:
        return None
    memory, offset = struct.unpack_from("<II", buffer, _DIO_FIELDS)
    return memory, offset


@functools.cache
def _logical_block_size(device: int) -> int | None:
    """The logical block size of the block device behind ``st_dev``, None when there is none
    (device major 0: tmpfs, overlay, NFS, FUSE)."""
    major, minor = os.major(device), os.minor(device)
    if major == 0:
        return None
    base = Path(f"/sys/dev/block/{major}:{minor}")
    for queue in (base / "queue", base / ".." / "queue"):  # a partition's queue is its disk's
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "logical_block_size").read_text())
    return None


class Worker:
    """One thread, started on first use, for work that releases the GIL. A child made by
    ``fork`` gets a new one (the thread does not survive a fork); once the interpreter shuts
    down, work runs on the caller's thread (no new work reaches a thread then: an ``atexit``
    hook that saves)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on the thread (see the class docstring)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            executor = self._executor
        try:
            return executor.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            future: Future[T] = Future()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
            return future


_io = Worker("lightning_bpk-io")  # writes the buffers of every DirectSink


def aligned_buffer(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory starting on a page boundary, as ``O_DIRECT`` needs."""
    return mmap.mmap(-1, size)


class _Shared:
    """The free buffers every DirectSink of the process shares. A child process made by
    ``fork`` starts with none (a parent's sink may be using them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[mmap.mmap] = []

    def take(self, count: int) -> list[mmap.mmap]:
        with self.lock:
            taken, self.free = self.free[:count], self.free[count:]
        return taken + [aligned_buffer(_BUFFER_SIZE) for _ in range(count - len(taken))]

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self.lock:  # kept for the next sink: reused memory costs nothing to touch
            self.free += buffers[: max(0, _BUFFERS - len(self.free))]


_shared = _Shared()


def _forget_after_fork() -> None:
    global _shared
    _shared = _Shared()


os.register_at_fork(after_in_child=_forget_after_fork)


class _At:
    """A descriptor as a raw file positioned at ``offset`` (``pwrite``: no seek, no ``fstat``
    of a file object), for :func:`write_all`."""

    __slots__ = ("fd", "name", "offset")

    def __init__(self, fd: int, offset: int, name: str) -> None:
        self.fd, self.offset, self.name = fd, offset, name

    def write(self, view: memoryview) -> int:
        written = os.pwrite(self.fd, view, self.offset)
        self.offset += written
        return written


def _address(view: memoryview) -> int:
    """The memory address of a byte view's first byte (read-only views too)."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


class DirectSink:
    """Writes an ``O_DIRECT`` descriptor through reused page-aligned buffers, one written by the
    I/O thread while the caller fills the other (see the module docstring)."""

    direct = True

    def __init__(self, fd: int, name: str, alignment: int) -> None:
        self.name = name
        self._fd = fd
        self._alignment = alignment
        self._buffers = _shared.take(_BUFFERS)
        self._views = [memoryview(b) for b in self._buffers]
        self._writes: list[Future[None] | None] = [None] * _BUFFERS  # in flight from each
        self._index = 0  # the buffer being filled
        self._used = 0  # bytes in it
        self._start = 0  # file offset of its first byte (aligned)
        self.copied = 0  # bytes copied into the buffers (the rest was written from where it lay)
        self._finished = False

    def write(self, data: Bytes) -> None:
        if self._finished:
            raise ValueError(f"{self.name}: write after finish")
        view = memoryview(data).cast("B")
        while view:
            # At a buffer boundary, aligned memory is written from where it lies: a tensor
            # staged as the file lays it out passes the buffers only until the first one is
            # full (the header before it fills that one), the rest with no copy.
            if (
                not self._used
                and view.nbytes >= _BUFFER_SIZE
                and not _address(view) % mmap.PAGESIZE
            ):
                whole = view.nbytes - view.nbytes % self._alignment
                self._drain()
                write_all(_At(self._fd, self._start, self.name), view[:whole])
                self._start += whole
                view = view[whole:]
                continue
            buffer = self._views[self._index]
            n = min(view.nbytes, buffer.nbytes - self._used)
            buffer[self._used : self._used + n] = view[:n]
            self._used += n
            self.copied += n
            view = view[n:]
            if self._used == buffer.nbytes:
                self._submit()

    def _submit(self) -> None:
        """Hand the current buffer to the I/O thread and wait until the next one is free."""
        at = _At(self._fd, self._start, self.name)
        chunk = self._views[self._index][: self._used]
        self._writes[self._index] = _io.submit(write_all, at, chunk)
        self._start += self._used
        self._used = 0
        self._index = (self._index + 1) % _BUFFERS
        self._wait(self._index)

    def _wait(self, index: int) -> None:
        future, self._writes[index] = self._writes[index], None
        if future is not None:
            future.result()

    def _drain(self) -> None:
        for index in range(_BUFFERS):
            self._wait(index)

    def patch(self, offset: int, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset < 0 or end > self._start + self._used:
            raise ValueError(f"{self.name}: patch of bytes {offset}..{end} not written yet")
        current = self._views[self._index]
        if end > self._start:  # the part still in the buffer being filled
            begin = max(offset, self._start)
            current[begin - self._start : end - self._start] = view[begin - offset :]
        self._drain()
        # The part on disk: read the aligned blocks around it back, change them, write them.
        at = offset - offset % self._alignment
        while at < min(end, self._start):
            stop = min(at + _BUFFER_SIZE, self._start, end + (-end) % self._alignment)
            block = self._views[(self._index + 1) % _BUFFERS][: stop - at]
            if os.preadv(self._fd, [block], at) != block.nbytes:
                raise OSError(errno.EIO, "short read of blocks just written", self.name)
            lo, hi = max(offset, at), min(end, stop)
            block[lo - at : hi - at] = view[lo - offset : hi - offset]
            write_all(_At(self._fd, at, self.name), block)
            at = stop

    def finish(self) -> None:
        """Write what is left (padded to the alignment), then cut the file to its size; once
        (the end of the sink's block calls it again)."""
        if self._finished:
            return
        self._finished = True
        size = self._start + self._used
        padded = self._used + (-self._used) % self._alignment
        if padded:
            self._views[self._index][self._used : padded] = bytes(padded - self._used)
            self._used = padded
            self._submit()
        self._drain()
        if self._start != size:
            os.ftruncate(self._fd, size)

    def release(self) -> None:
        """Wait for writes in flight (they read the buffers), then return the buffers."""
        for future in self._writes:
            if future is not None:
                with contextlib.suppress(BaseException):
                    future.result()
        self._writes = [None] * _BUFFERS
        for view in self._views:
            view.release()
        _shared.give(self._buffers)
        self._buffers = []


class MemorySink:
    """The bytes in memory (``file``, a ``BytesIO``): the sink of ``burnpack.dumps``."""

    name = "<bytes>"
    direct = False

    def __init__(self) -> None:
        self.file = io.BytesIO()

    def write(self, data: Bytes) -> None:
        self.file.write(data)

    def patch(self, offset: int, data: Bytes) -> None:
        with self.file.getbuffer() as view:
            view[offset : offset + len(data)] = data

    def finish(self) -> None:
        """Nothing is held back."""


class BufferedSink:
    """Writes a file through the page cache: pieces smaller than the gather buffer are collected
    in it and written together, larger ones as they come."""

    direct = False

    def __init__(self, fd: int, name: str, size: int) -> None:
        self.name = name
        self._fd = fd
        self._gather = memoryview(bytearray(min(max(size, 1), _GATHER_SIZE)))
        self._used = 0
        self._start = 0  # file offset of the gather buffer's first byte

    def write(self, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        if self._used + view.nbytes > self._gather.nbytes:
            self._flush()
            if view.nbytes >= self._gather.nbytes:
                write_all(_At(self._fd, self._start, self.name), view)
                self._start += view.nbytes
                return
        self._gather[self._used : self._used + view.nbytes] = view
        self._used += view.nbytes

    def _flush(self) -> None:
        if self._used:
            write_all(_At(self._fd, self._start, self.name), self._gather[: self._used])
            self._start += self._used
            self._used = 0

    def patch(self, offset: int, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset < 0 or end > self._start + self._used:
            raise ValueError(f"{self.name}: patch of bytes {offset}..{end} not written yet")
        if offset >= self._start:  # still gathered: no write at all
            self._gather[offset - self._start : end - self._start] = view
            return
        self._flush()
        write_all(_At(self._fd, offset, self.name), view)

    def finish(self) -> None:
        self._flush()

    def release(self) -> None:
        self._gather.release()
