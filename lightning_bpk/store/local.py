"""The local-disk backend of :class:`~lightning_bpk.store.Store`: a directory whose keys are
relative file names inside it.

Writes follow the recipe of :mod:`lightning_bpk._fs`: a scratch name in the *target* directory,
fsync, ``os.replace`` (or ``os.link`` for a create-only write, which fails atomically when the
name exists and never shows a half-written file), fsync of the directory. A prefix of files is
published by renaming its staging directory into place, then fsyncing the parent. A file written
*inside* a staging directory this process made (``LocalStore.staging``) is written in place
with no fsync of its own: nothing can see it under a final name before
``LocalStore.publish`` fsyncs every file and the folder, then renames; so a checkpoint of
three files costs one fsync per file and two per folder, not three per file. Reads use
``preadv`` into the caller's buffer; ``LocalStore.map`` maps the file itself copy-on-write
(a reader checks the head, then reads the tensors from the mapping). Nothing here follows a
symlink inside a checkpoint.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import functools
import inspect
import mmap
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

from lightning_bpk import _fs
from lightning_bpk.errors import CheckpointLockedError, LightningBpkError, StorageError

__all__ = ["LOCK_FILE_NAME", "LocalStore", "RefusedFileError"]

# Directory-wide, so checkpointers with different prefixes or identifiers cannot interleave
# either; hidden and never deleted (unlinking a flock target would let two holders coexist).
LOCK_FILE_NAME = ".lightning_bpk.lock"
_SYMLINK = "is a symlink: refused, never followed (a checkpoint is made of real files)"
# Lock files held open by exclusive(): a forked child (a DataLoader worker started while an
# asynchronous save holds the lock) closes its copies, or the flock, which belongs to the open
# file and not to the process, would stay held as long as the child lives.
_HELD: set[int] = set()
# The staging folders LocalStore.staging made in this process and publish has not renamed yet:
# files written below one of them are fsynced by that publish (this process's). A folder another
# process made (a rank's, possibly on another node of a shared filesystem, where this process's
# fsync would not reach the writer's cache) is not in it: its files are fsynced as written.
_OWN_STAGING: set[str] = set()
_PID_WIDTH = 15  # what exclusive() writes into the lock file: the pid, space-padded
# OSErrors that callers act on by their type (a name missing or taken, a refused file) pass
# through _typed as they are; this package's own errors too (BurnpackIOError, a lock held).
_MEANINGFUL = (
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    LightningBpkError,
)

F = TypeVar("F", bound=Callable[..., Any])


def _typed(method: F) -> F:
    """Make every other ``OSError`` of a :class:`LocalStore` method (EIO from a failing disk,
    EROFS, EDQUOT, ENOSPC, ...) a :class:`~lightning_bpk.errors.StorageError` naming the call,
    the store and the cause, with its ``errno`` kept: a failing disk is this package's error,
    as a failing object store is. A context-manager method's body is covered too (the caller's
    writes into a sink or scratch file)."""

    def convert(self: LocalStore, error: OSError) -> StorageError:
        return StorageError(
            error.errno, f"{method.__name__} in {self.root}: {error}", error.filename
        )

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def typed_generator(self: LocalStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return (yield from method(self, *args, **kwargs))
            except _MEANINGFUL:
                raise
            except OSError as e:
                raise convert(self, e) from e

        return cast(F, typed_generator)

    @functools.wraps(method)
    def typed(self: LocalStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except _MEANINGFUL:
            raise
        except OSError as e:
            raise convert(self, e) from e

    return cast(F, typed)


def _make_parent(path: Path) -> None:
    """Make ``path``'s folder, unless it is a staging folder this process made (which exists:
    no ``mkdir`` and ``stat`` per file written into it)."""
    if str(path.parent) not in _OWN_STAGING:
        path.parent.mkdir(parents=True, exist_ok=True)


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        os.close(fd)  # the child's copy only: never LOCK_UN, which would free the parent's lock
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class LocalStore:
    """Keys are relative paths inside the directory ``root`` (see the module docstring)."""

    replaces_in_place = True  # readers keep an opened file; a rename replaces atomically

    atomic_create = True  # os.link fails when the name exists

    def __init__(self, root: Path, *, follow_links: bool = False) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        # reads of files other tools wrote (a hub cache links its files) follow symlinks;
        # a checkpoint's never do
        self.follow_links = follow_links

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def url_of(self, key: str) -> str:
        return str(self._path(key))

    @_typed
    def check(self, *, create: bool = False) -> None:
        """Make the directory when ``create``; ``OSError`` when it cannot be, or when it is
        there but no directory (a missing one is fine without ``create``: a first save makes
        it)."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not os.path.lexists(self.root):
            return
        if not self.root.is_dir():  # mkdir(exist_ok) accepts an existing symlink loop
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.root))

    # -- reading --

    @_typed
    def list(self, prefix: str = "") -> dict[str, int | None]:
        """``{name: size}`` of the entries directly under ``prefix`` (directories: None).

        An entry removed by another process between the directory read and its ``lstat`` (a
        retention beside this listing) is left out, as if the listing had come a moment later:
        an object store's listing has no such gap, and a caller told of a name that is gone
        would fail on it anyway."""
        try:
            entries = list(os.scandir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found: dict[str, int | None] = {}
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=False)
                found[e.name] = None if is_dir else e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        return found

    @_typed
    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def _open(self, key: str) -> int:
        """A read descriptor of regular file ``key``: no symlink followed, no FIFO waited on."""
        path = self._path(key)
        nofollow = 0 if self.follow_links else os.O_NOFOLLOW
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RefusedFileError(f"{path} {_SYMLINK}", _SYMLINK) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RefusedFileError(f"{path} is not a regular file", "is not a regular file")
        return fd

    @_typed
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
            first = 0 if start is None else start
            last = size if end is None else min(end, size)
            buffer = bytearray(max(0, last - first))
            self._preadv(fd, key, memoryview(buffer), first, exact=False)
            return bytes(buffer[: last - first])
        finally:
            os.close(fd)

    @_typed
    def read_into(self, key: str, buffer: bytearray | memoryview, offset: int = 0) -> None:
        fd = self._open(key)
        try:
            self._preadv(fd, key, memoryview(buffer).cast("B"), offset, exact=True)
        finally:
            os.close(fd)

    @_typed
    def open_file(self, key: str) -> BinaryIO:
        """File ``key`` open for reading (seekable), for readers that take a file object."""
        return os.fdopen(self._open(key), "rb")

    @_typed
    def read_ranges(self, key: str, pieces: Iterable[tuple[bytearray | memoryview, int]]) -> None:
        """Fill each ``(buffer, offset)`` of ``pieces`` with the bytes of ``key`` from
        ``offset`` on, the file opened once (short: an error)."""
        fd = self._open(key)
        try:
            for buffer, offset in pieces:
                self._preadv(fd, key, memoryview(buffer).cast("B"), offset, exact=True)
        finally:
            os.close(fd)

    def _preadv(self, fd: int, key: str, view: memoryview, offset: int, *, exact: bool) -> None:
        done = _fs.read_full(fd, view, offset)
        if exact and done < view.nbytes:
            raise OSError(
                errno.EIO,
                f"{done} bytes at {offset}, expected {view.nbytes} (the file is shorter)",
                self.url_of(key),
            )

    @_typed
    def map(self, key: str, size: int) -> _Mapped:
        """The file mapped copy-on-write (``size`` is ignored: the file's own size counts), so
        tensors are zero-copy views that stay intact if the file is later replaced."""
        path = self._path(key)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not wait for a writer
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RefusedFileError(f"{path}: not a regular file", "not a regular file")
            return _Mapped(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
        finally:
            os.close(fd)  # the mapping keeps the file's pages reachable on its own

    @_typed
    def refused(self, prefix: str, names: Iterable[str] | None = None) -> builtins.list[str]:
        """A problem for ``prefix`` itself and for each entry below it that is a symlink: one
        walk that follows none, or (``names``: what a listing of ``prefix`` just found) one
        ``lstat`` of each."""
        top = self._path(prefix)
        if top.is_symlink():
            return [f"{top} {_SYMLINK}"]
        if names is not None:
            return [
                f"{top / name} {_SYMLINK}" for name in sorted(names) if (top / name).is_symlink()
            ]
        found = []
        for folder, directories, files in os.walk(top):  # a symlinked dir: listed, not entered
            for name in sorted(directories + files):
                if os.path.islink(os.path.join(folder, name)):
                    found.append(f"{os.path.join(folder, name)} {_SYMLINK}")
        return found

    # -- writing --

    @_typed
    def put(self, key: str, data: bytes, *, create_only: bool = False) -> bool:
        path = self._path(key)
        _make_parent(path)
        if not create_only:
            if self._staged(key):  # published (and fsynced) with its staging folder
                with _removed_on_failure(path), open(path, "wb", buffering=0) as f:
                    _fs.write_all(f, data)
            else:
                with _fs.atomic_file(path) as f:
                    _fs.write_all(f, data)
            return True
        scratch = _fs.scratch_path(path)
        try:
            # durable before it gets its name; the scratch name itself need not survive a crash
            with open(scratch, "xb", buffering=0) as f:
                _fs.write_all(f, data)
                os.fsync(f.fileno())
            try:
                os.link(scratch, path)  # atomic, fails if the name exists, shows whole bytes
            except FileExistsError:
                return self.holds(key, data)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(scratch)
        _fs.fsync_dir(path.parent)
        return True

    def create(self, key: str, data: bytes) -> bool:
        return self.put(key, data, create_only=True)

    def holds(self, key: str, data: bytes) -> bool:
        """Whether file ``key`` holds exactly ``data``."""
        try:
            return self.size(key) == len(data) and self.read(key) == data
        except (OSError, ValueError):
            return False

    @contextlib.contextmanager
    @_typed
    def sink(self, key: str, size: int) -> Iterator[_fs.Sink]:
        """A scratch file beside ``key`` (``O_DIRECT`` where the filesystem supports it),
        fsynced and renamed over ``key`` (see :func:`lightning_bpk._fs.atomic_sink`); inside
        a staging directory, ``key`` itself, left for :meth:`publish` to fsync."""
        path = self._path(key)
        _make_parent(path)
        if not self._staged(key):
            with _fs.atomic_sink(path, size) as sink:
                yield sink
            return
        with _removed_on_failure(path), _fs.open_sink(path, size) as sink:
            yield sink

    @contextlib.contextmanager
    @_typed
    def scratch(self, key: str) -> Iterator[Path]:
        """A path with the target's own name (writers that choose a format by suffix see it)
        inside a scratch directory beside the target; fsynced and renamed into place. Inside a
        staging directory: the target itself, removed if the block fails."""
        target = self._path(key)
        _make_parent(target)
        if self._staged(key):
            with _removed_on_failure(target):
                yield target
            return
        while True:
            folder = _fs.scratch_path(target)
            try:
                folder.mkdir()
                break
            except FileExistsError:
                continue
        scratch = folder / target.name
        try:
            yield scratch
            with open(scratch, "rb+", buffering=0) as f:
                os.fsync(f.fileno())
            os.replace(scratch, target)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        os.rmdir(folder)
        _fs.fsync_dir(target.parent)

    @_typed
    def staging(self, prefix: str) -> str:
        """A new scratch-named folder beside ``prefix`` (``ckpt.7.<pid>-<k>.tmp``): the files
        written below it are fsynced once, by :meth:`publish`."""
        while True:
            path = _fs.scratch_path(self._path(prefix))
            try:
                path.mkdir(parents=True)
            except FileExistsError:
                continue
            _OWN_STAGING.add(str(path))
            return path.relative_to(self.root).as_posix()

    def _staged(self, key: str) -> bool:
        """Whether ``key`` lies below a staging folder this process made (see _OWN_STAGING)."""
        return bool(_OWN_STAGING) and any(str(p) in _OWN_STAGING for p in self._path(key).parents)

    @_typed
    def publish(self, staging: Path | str, prefix: str) -> None:
        source = staging if isinstance(staging, Path) else self._path(staging)
        target = self._path(prefix)
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "publish needs a name never used", str(target))
        for folder, _, files in os.walk(source):  # nothing below a staging folder is fsynced yet
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _fs.fsync_dir(folder)
        try:
            os.rename(source, target)
            _OWN_STAGING.discard(str(source))
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            # another filesystem: copy beside the target first, so the rename stays atomic
            beside = self._path(self.staging(prefix))
            shutil.copytree(source, beside, dirs_exist_ok=True)
            self.publish(beside, prefix)
            return
        _fs.fsync_dir(target.parent)

    @_typed
    def remove(self, keys: Iterable[str]) -> None:
        touched = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                touched.add(path.parent)
        for folder in touched:
            _fs.fsync_dir(folder)

    @_typed
    def remove_prefix(self, prefix: str) -> None:
        _remove(self._path(prefix))
        _OWN_STAGING.discard(str(self._path(prefix)))

    @contextlib.contextmanager
    @_typed
    def exclusive(self, *, wait: bool = False) -> Iterator[None]:
        """``flock`` on :data:`LOCK_FILE_NAME` (non-blocking unless ``wait``); the holder's pid
        is written into it for the :class:`CheckpointLockedError` of the next one."""
        path = self.root / LOCK_FILE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _HELD.add(fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise CheckpointLockedError(
                    f"{self.root} is locked by another process saving a checkpoint "
                    f"(pid {holder}, lock {path}); two checkpointers cannot save into one "
                    "directory at once"
                ) from None
            # one fixed-width write covers any pid written before it: no truncate (a journaled
            # metadata change) per save
            os.pwrite(fd, f"{os.getpid():<{_PID_WIDTH}}\n".encode(), 0)
            yield
        finally:
            _HELD.discard(fd)
            os.close(fd)  # releases the flock


class RefusedFileError(LightningBpkError, ValueError):
    """A name that is not a regular file (a symlink, a FIFO, a directory) where a file was to
    be read; ``reason`` is the message without the path."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Mapped:
    """A local file's mapping: every byte is there already."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer

    def fetch(self, start: int, end: int) -> None:
        """Nothing to fetch."""


@contextlib.contextmanager
def _removed_on_failure(path: Path) -> Iterator[None]:
    """Remove ``path`` when the block fails: a failed write in a staging folder leaves no
    partial file behind."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # best effort: what failed first is the news
            os.unlink(path)
        raise


def _remove(path: Path) -> None:
    """Remove a file or a whole directory tree; already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
