"""The object-store backend of :class:`~lightning_bpk.store.Store`: an fsspec filesystem below
one root (``s3://``, ``gs://``, ``memory://``, ...).

Object stores have no rename and no directories: a "directory" is the prefix its keys share, an
object appears whole or not at all, and a file is published by uploading it (large files as
multipart uploads). Every call is retried on transient errors (timeouts, connection resets,
throttling, answers cut short or failing the driver's checksum) with exponential backoff and full
jitter, each wait bounded by :data:`MAX_WAIT` and the attempts by :data:`ATTEMPTS`; what still
fails raises :class:`~lightning_bpk.errors.StorageError` naming the URL, as does any other error
of a driver. A create-only write is a conditional PUT on S3 and GCS, and an "exists" answer is
read back (the retry of our own create whose answer was lost finds our bytes: a success).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import mmap
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec
import fsspec.core

from lightning_bpk import _fs
from lightning_bpk.errors import DirectoryGoneError, StorageError

__all__ = [
    "ObjectStore",
    "retry",
]

# Attempts per call and the longest single wait between two of them (seconds); the first wait is
# at most BASE_WAIT, doubling each time (full jitter: a uniform draw below that bound).
ATTEMPTS = 5
BASE_WAIT = 0.2
MAX_WAIT = 5.0
# Part size of multipart uploads to S3 (None: s3fs's default, 50 MiB parts for files of 100 MiB
# and more); parts go up concurrently.
UPLOAD_PART: int | None = None
# How long an upload whose multipart completion answer was lost waits for the object to appear
# (the server may still be assembling it: moto needs ~20 s for 1 GiB, s3fs waits 15 s for an
# answer) before uploading it again.
COMPLETION_WAIT = 60.0
# Ranged reads fetch at least this many bytes per request, and an object in at most READ_STREAMS
# requests, all in flight at once, so per-request costs stay bounded (moto copies the whole
# object for every ranged GET: 16 MiB ranges cost it 64 copies of a 1 GiB object).
READ_CHUNK = 16 * 1024 * 1024
READ_STREAMS = 8

T = TypeVar("T")


# --- retries ------------------------------------------------------------------------------------

# Errors that a retry cannot fix: the answer is definite (a StorageError is this module's own
# verdict: already retried, or final, such as a bucket found gone).
_PERMANENT = (
    StorageError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    NotImplementedError,
)


# Words in the names of driver errors (botocore, aiohttp, gcsfs) that reach us untranslated and
# that a second attempt can fix: throttling, dropped or reset connections, bodies cut short or
# garbled in transit (botocore's FlexibleChecksumError: the bytes received do not match the
# checksum the server sent for them; the object itself may well be whole).
_TRANSIENT_NAMES = (
    "Timeout",
    "Connection",
    "Throttl",
    "SlowDown",
    "ServerError",
    "Disconnected",
    "Payload",
    "IncompleteRead",
    "Checksum",
    "StreamingError",
)
# Packages whose other errors are wrapped in StorageError (a typed error naming the URL) instead
# of escaping raw: the drivers and the HTTP stacks below them.
_DRIVER_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "urllib3")


class _ShortRead(ConnectionError):
    """A read answered fewer bytes than asked for: transient (a re-read gets them all) until
    the retries are spent."""


def _transient(error: BaseException) -> bool:
    if isinstance(error, _PERMANENT):
        return False
    if isinstance(error, (OSError, TimeoutError, ConnectionError, socket.timeout)):
        return True
    name = type(error).__name__
    return any(w in name for w in _TRANSIENT_NAMES)


def _from_driver(error: BaseException) -> bool:
    return type(error).__module__.split(".")[0] in _DRIVER_PACKAGES


def retry(what: str, call: Callable[[], T], *, attempts: int = ATTEMPTS) -> T:
    """``call()``, retried on transient errors with backoff and jitter; the last error is raised
    as :class:`StorageError` whose message starts with ``what``. Permanent errors are raised as
    they are (``FileNotFoundError``, ...), except a driver's own exception types, which become a
    :class:`StorageError` at once: no raw botocore error reaches the caller."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if not _transient(e):
                if _from_driver(e) and not isinstance(e, _PERMANENT):
                    raise StorageError(f"{what}: {type(e).__name__}: {e}") from e
                raise
            if attempt == attempts - 1:
                raise StorageError(f"{what}: {type(e).__name__}: {e} ({attempts} attempts)") from e
            time.sleep(random.uniform(0, min(MAX_WAIT, BASE_WAIT * 2**attempt)))
    raise AssertionError("unreachable")  # pragma: no cover


class ObjectStore:
    """A key/value view of an fsspec filesystem below ``root``, with bounded retries.

    Keys are ``/``-separated names relative to the root (``ckpt.7/model.bpk``). Directories do
    not exist on object stores: a "directory" is the prefix its keys share.
    """

    replaces_in_place = False  # a commit is created only if absent

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root
        self.url = url
        self.protocol = fsspec.core.split_protocol(url)[0]
        # S3 (s3fs >= 2024.x) and GCS refuse a second create of one key on the server side.
        self.atomic_create = self.protocol in ("s3", "s3a", "gs", "gcs")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _retry(self, what: str, key: str, call: Callable[[], T]) -> T:
        return retry(f"{what} {self.url_of(key)}", call)

    def _write(self, what: str, key: str, call: Callable[[], T]) -> T:
        """:meth:`_retry` for a write, which creates what it names: its ``FileNotFoundError``
        (S3's NoSuchBucket) means the bucket is gone, said at once (:meth:`_raise_if_gone`)."""
        try:
            return self._retry(what, key, call)
        except FileNotFoundError as e:
            self._raise_if_gone(e)
            raise

    def _raise_if_gone(self, error: FileNotFoundError) -> None:
        """Raise :class:`~lightning_bpk.errors.DirectoryGoneError` if the bucket no longer
        exists (one listing), so a write into a deleted bucket fails within seconds instead of
        being taken for a lost answer and awaited or retried."""
        try:
            self.check()
        except StorageError as gone:
            if isinstance(gone.__cause__, FileNotFoundError):
                raise DirectoryGoneError(
                    f"{gone}: it was deleted while this run used it, and every checkpoint in "
                    f"it with it ({type(error).__name__}: {error})"
                ) from error

    # -- reading --

    def check(self, *, create: bool = False) -> None:
        """Fail now, naming the URL, if the store cannot be reached or listed: an unreachable
        endpoint, wrong credentials or a missing bucket (what ``setup`` must catch before the
        first batch is trained). ``create`` changes nothing: a prefix needs no creating. A
        filesystem without buckets (``memory://``) has nothing to check."""
        split = getattr(self.fs, "split_path", None)
        if split is None:
            return
        try:
            # not retried here: the drivers retry connection errors themselves (botocore: ~10 s)
            self.fs.ls(split(self.root)[0], detail=False, refresh=True)  # the bucket must exist
            with contextlib.suppress(FileNotFoundError):  # an empty prefix: a new directory
                self.fs.ls(self.root, refresh=True)
        except FileNotFoundError as e:
            raise StorageError(f"{self.url}: the bucket does not exist ({e})") from e
        except PermissionError as e:
            raise StorageError(f"{self.url}: access denied (check the credentials): {e}") from e
        except Exception as e:
            raise StorageError(
                f"{self.url}: cannot reach the store: {type(e).__name__}: {e}"
            ) from e

    def list(self, prefix: str = "") -> dict[str, int | None]:
        """``{name: size}`` of the keys directly under ``prefix`` (sub-prefixes: None); one
        listing request, never served from a cache."""
        path = self._path(prefix)

        def ls() -> list[dict[str, Any]]:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(path)
            try:
                return self.fs.ls(path, detail=True, refresh=True)
            except FileNotFoundError:
                return []

        found = {}
        for entry in self._retry("list", prefix, ls):
            name = entry["name"].rstrip("/").rpartition("/")[2]
            if entry["name"].rstrip("/") == path.rstrip("/"):
                continue  # some filesystems list a file prefix as itself
            found[name] = None if entry.get("type") == "directory" else int(entry.get("size") or 0)
        return found

    def size(self, key: str) -> int | None:
        """The object's size, or None if it does not exist."""
        try:
            info = self._retry("stat", key, lambda: self.fs.info(self._path(key)))
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info.get("size") or 0)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``key`` (all of it by default)."""
        return self._retry(
            "read", key, lambda: self.fs.cat_file(self._path(key), start=start, end=end)
        )

    def read_into(self, key: str, buffer: bytearray | memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` with the object's bytes from ``offset`` on, with at most
        :data:`READ_STREAMS` ranged reads of at least :data:`READ_CHUNK` bytes issued together
        (s3fs and gcsfs run them concurrently)."""
        view = memoryview(buffer).cast("B")
        total = view.nbytes
        size = max(READ_CHUNK, -(-total // READ_STREAMS))
        pending = [(s, min(s + size, total)) for s in range(0, total, size)]
        path = self._path(key)

        def fetch() -> None:
            """Fetch the ranges still pending; a range that failed or came back short stays
            pending and raises (transient: the retry asks for it again)."""
            chunks = self.fs.cat_ranges(
                [path] * len(pending),
                [offset + s for s, _ in pending],
                [offset + e for _, e in pending],
            )
            failed: list[tuple[int, int]] = []
            error: BaseException | None = None
            for (s, e), chunk in zip(list(pending), chunks, strict=True):
                if isinstance(chunk, BaseException):
                    failed.append((s, e))
                    error = error or chunk
                elif len(chunk) != e - s:
                    failed.append((s, e))
                    error = error or _ShortRead(
                        f"{len(chunk)} bytes at {offset + s}, expected {e - s} (a short answer, "
                        "or the object is shorter than its listed size)"
                    )
                else:
                    view[s:e] = chunk
            pending[:] = failed
            if error is not None:
                raise error

        try:
            self._retry("read", key, fetch)
        finally:
            view.release()  # not left to a traceback: the caller may close what it views

    def open_file(self, key: str) -> BinaryIO:
        """Object ``key`` as a read-only, seekable file whose reads are ranged requests (the
        driver's buffered file: opening is retried here, its reads by the driver)."""
        opened: BinaryIO = self._retry("open", key, lambda: self.fs.open(self._path(key), "rb"))
        return opened

    def read_ranges(self, key: str, pieces: Iterable[tuple[bytearray | memoryview, int]]) -> None:
        """Fill each ``(buffer, offset)`` of ``pieces`` with the object's bytes from ``offset``
        on: one batch of ranged reads issued together (s3fs and gcsfs run them concurrently);
        a range that failed or came back short is asked for again by the retry."""
        views = [(memoryview(buffer).cast("B"), offset) for buffer, offset in pieces]
        pending = [i for i, (view, _) in enumerate(views) if view.nbytes]
        path = self._path(key)

        def fetch() -> None:
            chunks = self.fs.cat_ranges(
                [path] * len(pending),
                [views[i][1] for i in pending],
                [views[i][1] + views[i][0].nbytes for i in pending],
            )
            failed: list[int] = []
            error: BaseException | None = None
            for i, chunk in zip(list(pending), chunks, strict=True):
                view, offset = views[i]
                if isinstance(chunk, BaseException):
                    failed.append(i)
                    error = error or chunk
                elif len(chunk) != view.nbytes:
                    failed.append(i)
                    error = error or _ShortRead(
                        f"{len(chunk)} bytes at {offset}, expected {view.nbytes} (a short "
                        "answer, or the object is shorter than its listed size)"
                    )
                else:
                    view[:] = chunk
            pending[:] = failed
            if error is not None:
                raise error

        try:
            if pending:
                self._retry("read", key, fetch)
        finally:
            for view, _ in views:  # as read_into's
                view.release()

    def download(self, key: str, local: str | os.PathLike[str]) -> None:
        """Copy object ``key`` to a local file (for readers that need a file: the CLI's
        ``convert`` and ``diff`` of ``.safetensors`` and ``torch.save`` files)."""
        self._retry("download", key, lambda: self.fs.get_file(self._path(key), os.fspath(local)))

    # -- writing --

    def upload(self, local: str | os.PathLike[str], key: str) -> None:
        """Copy a local file to ``key`` (s3fs uploads big files in parts).

        A multipart upload whose completion request timed out may still be completed by the
        server: s3fs then retries the completion, which fails while the first one is still
        assembling the object (moto: a 500; S3: NoSuchUpload), aborts the upload, finds it gone
        and raises ``FileNotFoundError``. The upload did not fail then, its answer was lost:
        the object is awaited (:meth:`_landed`) instead of uploading every part again, which
        would only time out the same way.
        """
        options = {}
        if UPLOAD_PART is not None and self.protocol in ("s3", "s3a"):
            options["chunksize"] = UPLOAD_PART
        path = self._path(key)
        size = os.path.getsize(local)

        def put() -> None:
            try:
                self.fs.put_file(os.fspath(local), path, **options)
            except FileNotFoundError as e:
                self._raise_if_gone(e)
                if self._landed(key, size):
                    return
                raise ConnectionError(f"multipart upload lost at completion: {e}") from e

        self._retry("upload to", key, put)

    def _landed(self, key: str, size: int) -> bool:
        """Whether object ``key`` appears with ``size`` bytes within :data:`COMPLETION_WAIT`
        seconds (polled with growing waits of at most :data:`MAX_WAIT`)."""
        deadline = time.monotonic() + COMPLETION_WAIT
        wait = BASE_WAIT
        while True:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(self._path(key))
            found = self.size(key)
            if found is not None:
                return found == size
            if time.monotonic() + wait > deadline:
                return False
            time.sleep(wait)
            wait = min(MAX_WAIT, 2 * wait)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> bool:
        """Write ``key`` in one PUT (the object appears whole or not at all); with
        ``create_only`` only if it does not exist, False if it already did with other bytes.

        Create-only is atomic on S3 (``If-None-Match: *``) and GCS (``ifGenerationMatch=0``)
        through fsspec's ``mode="create"``; elsewhere (``memory://``) a check before the write.
        An "exists" answer is read back: an object holding exactly ``data`` is our own create
        whose first answer was lost (a retry then finds it), so True.
        """
        path = self._path(key)
        if not create_only:
            self._write("write", key, lambda: self.fs.pipe_file(path, data))
            return True
        if not self.atomic_create:
            if self.size(key) is not None:
                return self.holds(key, data)
            return self.put(key, data)

        def put() -> bool:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True

        if self._write("create", key, put):
            return True
        # "It exists" may be the answer to a retry of our own create whose first answer was
        # lost (by the driver's retries or by ours): then the object holds our bytes and the
        # create succeeded. Anything else was written by someone else.
        return self.holds(key, data)

    def create(self, key: str, data: bytes) -> bool:
        """``put(key, data, create_only=True)``."""
        return self.put(key, data, create_only=True)

    def holds(self, key: str, data: bytes) -> bool:
        """Whether object ``key`` holds exactly ``data`` (read back, never from a cache; an
        object of another size is not read). ``StorageError`` when the store cannot tell."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self._path(key))
        size = self.size(key)
        if size != len(data):
            return False
        try:
            return self.read(key) == data
        except FileNotFoundError:
            return False

    def remove(self, keys: Iterable[str]) -> None:
        """Delete objects; already gone is fine."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._retry("delete", key, functools.partial(self.fs.rm_file, self._path(key)))

    def remove_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix/`` (s3fs: batched deletes of up to 1000 keys)."""
        path = self._path(prefix)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)

        self._retry("delete", prefix, rm)

    @contextlib.contextmanager
    def scratch(self, key: str) -> Iterator[Path]:
        """A local scratch file that is uploaded as ``key`` on a clean exit; the one "write
        locally, then upload" of the package. Deleted either way."""
        folder = Path(tempfile.mkdtemp(prefix="lightning_bpk-upload-"))
        try:
            local = folder / key.rpartition("/")[2]
            yield local
            self.upload(local, key)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def sink(self, key: str, size: int) -> Iterator[_fs.Sink]:
        """A local scratch file (through the page cache: the upload reads it back at once),
        uploaded as ``key`` on a clean exit (see :meth:`scratch`)."""
        with (
            self.scratch(key) as local,
            _fs.open_sink(local, size, direct=False, name=self.url_of(key)) as sink,
        ):
            yield sink

    def staging(self, prefix: str) -> str:
        """``prefix`` itself: with no rename, files go straight to their final keys, under a
        name never used before (the checkpointer's rule), and the sentinel written last is
        what makes them a checkpoint."""
        return prefix

    def publish(self, staging: Path | str, prefix: str) -> None:
        """Upload every file of the local directory ``staging`` below ``prefix`` (a prefix
        from :meth:`staging` is already in place: nothing to do)."""
        if not isinstance(staging, Path):
            if staging != prefix:
                raise ValueError(f"{self.url_of(staging)} cannot be renamed to {prefix}")
            return
        for folder, _, files in os.walk(staging):
            for name in sorted(files):
                local = Path(folder) / name
                self.upload(local, f"{prefix}/{local.relative_to(staging).as_posix()}")

    @contextlib.contextmanager
    def exclusive(self, *, wait: bool = False) -> Iterator[None]:
        """Nothing: an object store has no lock; the lease fences writers there."""
        yield

    def map(self, key: str, size: int) -> _Fetched:
        """An anonymous mapping of ``size`` bytes (the size a listing reported, never a
        manifest's claim), filled by ranged reads as :meth:`_Fetched.fetch` asks."""
        return _Fetched(self, key, mmap.mmap(-1, size))

    def refused(self, prefix: str, names: Iterable[str] | None = None) -> builtins.list[str]:
        """Nothing: an object store holds objects only, no links."""
        return []


class _Fetched:
    """An object's bytes in an anonymous mapping, fetched range by range."""

    def __init__(self, store: ObjectStore, key: str, buffer: mmap.mmap) -> None:
        self.store = store
        self.key = key
        self.buffer = buffer

    def fetch(self, start: int, end: int) -> None:
        view = memoryview(self.buffer)[start:end]
        try:
            self.store.read_into(self.key, view, offset=start)
        finally:
            view.release()  # the mapping can be closed only once no view of it is left
