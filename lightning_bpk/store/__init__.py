"""Where checkpoints live: one typed :class:`Store` seam, two backends, chosen by the URL.

Every byte the package writes or reads below a checkpoint directory goes through a
:class:`Store`: a small key/value view of one directory or URL prefix whose keys are
``/``-separated names below it (``ckpt.7/model.bpk``). The checkpointer, the lease and the
sharded (DCP) writer are written once against it; only the two backends know where the bytes go::

                         Checkpointer · Lease · DCP writer/reader · records.files
                                              │
                                        Store (Protocol)
   list · size · read · read_into · read_ranges · open_file · put(create_only) · sink · scratch
         staging · publish · remove · remove_prefix · exclusive · map · refused · check
                    ┌─────────────────────────┴─────────────────────────┐
             LocalStore (local.py)                            ObjectStore (objects.py)
      fsync + rename, link-or-fail create,         fsspec: bounded retries with jitter, multipart
      flock, mmap/preadv reads, no symlinks        uploads, ranged reads, conditional PUT,
                                                   read-back of an "exists" answer

What differs between the backends is a capability of the backend, never an ``if`` at a call
site: ``publish`` is a rename plus a directory fsync locally and "the files are already there"
remotely (``staging`` returns the final prefix); ``sink`` writes past the page cache locally
(``O_DIRECT``, see :mod:`lightning_bpk._fs`) and through it remotely, where the scratch file is
read back at once for the upload; ``exclusive`` is an ``flock`` locally and a
no-op remotely, where the lease (:mod:`lightning_bpk.store.lease`) fences; ``map`` maps the file
copy-on-write locally and fills an anonymous mapping by ranged reads remotely.

:func:`open_store` picks the backend from the protocol fsspec's ``url_to_fs`` would pick (none
or ``file://``: local). A URL whose driver is not installed is refused with the extra to
install::

    >>> open_store("memory://bucket/run").url
    'memory://bucket/run'
    >>> is_local("s3://bucket/run"), is_local("run/checkpoints"), is_local("file:///tmp/x")
    (False, True, True)
"""

from __future__ import annotations

import builtins
import mmap
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import fsspec
import fsspec.core

from lightning_bpk._fs import Sink
from lightning_bpk.errors import DirectoryGoneError, MissingDriverError, StorageError
from lightning_bpk.store.local import LocalStore
from lightning_bpk.store.objects import ObjectStore

__all__ = [
    "DirectoryGoneError",
    "LocalStore",
    "Mapped",
    "MissingDriverError",
    "ObjectStore",
    "StorageError",
    "Store",
    "identity",
    "is_local",
    "join",
    "local_path",
    "location",
    "name_of",
    "object_store",
    "open_parent",
    "open_store",
    "parent_of",
]

# Protocols served by the local backend (fsspec's names for the local filesystem).
LOCAL_PROTOCOLS = ("file", "local")
# The pip extra that installs each protocol's driver.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class Mapped(Protocol):
    """What :meth:`Store.map` returns: ``buffer`` (closed by whoever owns it) and ``fetch``."""

    buffer: mmap.mmap

    def fetch(self, start: int, end: int) -> None:
        """Make bytes ``[start, end)`` of ``buffer`` hold the object's bytes."""
        ...


@runtime_checkable
class Store(Protocol):
    """A directory or URL prefix as keys (``/``-separated names below :attr:`url`).

    Absent keys read as ``FileNotFoundError``; a store that keeps failing raises
    :class:`StorageError` naming the URL (after retries, on object stores).
    """

    url: str
    replaces_in_place: bool
    """Whether a committed object may be replaced by :meth:`put` (local disk: readers that
    opened the old file keep reading it, and the rename is atomic) or is written once (object
    storage: a commit is created only if absent, so two writers never both commit)."""

    def url_of(self, key: str) -> str:
        """The path or URL of ``key`` (for messages and for readers that take a location)."""
        ...

    def check(self, *, create: bool = False) -> None:
        """Fail now, naming the URL, if the store cannot be used (``create``: make a missing
        local directory)."""
        ...

    def list(self, prefix: str = "") -> dict[str, int | None]:
        """``{name: size}`` of the entries directly under ``prefix`` (sub-prefixes: None)."""
        ...

    def size(self, key: str) -> int | None:
        """The size of object ``key``; None if there is none (or it is a prefix)."""
        ...

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (all of it by default)."""
        ...

    def read_into(self, key: str, buffer: bytearray | memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` with the bytes of ``key`` from ``offset`` on (short: an error)."""
        ...

    def open_file(self, key: str) -> BinaryIO:
        """``key`` as a read-only, seekable binary file, for readers that take a file object
        (``torch.load``): local disk opens the file, an object store reads it in ranges."""
        ...

    def read_ranges(self, key: str, pieces: Iterable[tuple[bytearray | memoryview, int]]) -> None:
        """Fill each ``(buffer, offset)`` of ``pieces`` from ``key``, as :meth:`read_into`
        would one by one, in one go (local: the file opened once; remote: one batch of ranged
        reads issued together): the byte ranges of a tensor's shard, row by row."""
        ...

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> bool:
        """Write ``key`` whole and durably (readers see the old bytes or the new). With
        ``create_only`` it is written only if absent: False when it existed with other bytes
        (existing with exactly ``data`` is a retry of our own create: True)."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """``put(key, data, create_only=True)``."""
        ...

    def holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds exactly ``data`` (read back, never from a cache)."""
        ...

    def sink(self, key: str, size: int) -> AbstractContextManager[Sink]:
        """A :class:`~lightning_bpk._fs.Sink` to stream the ``size`` bytes of ``key`` into; on a
        clean exit they are published durably as ``key``, on an exception nothing is (local: a
        scratch file beside ``key``, written with ``O_DIRECT`` where the filesystem supports it,
        fsynced and renamed; remote: a local scratch file through the page cache, uploaded)."""
        ...

    def scratch(self, key: str) -> AbstractContextManager[Path]:
        """A local path to write a file at; on a clean exit it is published durably as
        ``key`` (local: fsync + rename; remote: upload, then the scratch file is deleted); on
        an exception it is removed and ``key`` is untouched."""
        ...

    def staging(self, prefix: str) -> str:
        """A fresh key prefix to write the files of ``prefix`` into before :meth:`publish`
        (local: a new scratch directory beside it; remote: ``prefix`` itself)."""
        ...

    def publish(self, staging: Path | str, prefix: str) -> None:
        """Make the files of ``staging`` (a local directory of files, or a prefix from
        :meth:`staging`) visible under ``prefix``, which must not exist, durably."""
        ...

    def remove(self, keys: Iterable[str]) -> None:
        """Delete objects; already gone is fine."""
        ...

    def remove_prefix(self, prefix: str) -> None:
        """Delete ``prefix`` and everything below it; already gone is fine."""
        ...

    def exclusive(self, *, wait: bool = False) -> AbstractContextManager[None]:
        """A section no other process runs for this store at the same time (local: ``flock``,
        :class:`~lightning_bpk.errors.CheckpointLockedError` when taken and not ``wait``;
        remote: nothing, the lease fences writers there)."""
        ...

    def map(self, key: str, size: int) -> Mapped:
        """Object ``key`` (of ``size`` bytes, as listed) as a mapping whose bytes are there once
        :meth:`Mapped.fetch` asked for them (local: the file mapped copy-on-write, every byte
        there at once; remote: an anonymous mapping filled by ranged reads), so a reader can
        check a head before the tensors are fetched and pay nothing extra on local disk."""
        ...

    def refused(self, prefix: str, names: Iterable[str] | None = None) -> builtins.list[str]:
        """Why the entries of ``prefix`` (or ``prefix`` itself) are not plain files and
        directories ([] on object stores: they have nothing else; ``names``: the entries a
        listing of ``prefix`` just found); a checkpoint holding a symlink is refused by every
        reader, never followed."""
        ...


def _protocol_of(url: str | os.PathLike[str]) -> str | None:
    """The URL's protocol (``"s3"``), or ``None`` for a plain path."""
    protocol, _ = fsspec.core.split_protocol(os.fspath(url))
    return protocol


def is_local(url: str | os.PathLike[str]) -> bool:
    """True when ``url`` is a plain path or a ``file://`` URL (served by :class:`LocalStore`)."""
    if isinstance(url, Path):
        return True
    protocol = _protocol_of(url)
    return protocol is None or protocol in LOCAL_PROTOCOLS


def location(url: str | os.PathLike[str]) -> Path | str:
    """``url`` as the package keeps it: a :class:`~pathlib.Path` for local directories (a
    ``file://`` prefix removed), the URL string without trailing ``/`` for object stores.

    ``Path("s3://bucket/run")`` would silently become the local folder ``s3:/bucket/run``;
    every entry point goes through this function instead.

    >>> location("s3://bucket/run/"), location("file:///tmp/run")
    ('s3://bucket/run', PosixPath('/tmp/run'))
    """
    if is_local(url):
        text = os.fspath(url)
        if _protocol_of(text) is not None:
            text = fsspec.core.split_protocol(text)[1]
        return Path(text)
    return os.fspath(url).rstrip("/")


def identity(url: str | os.PathLike[str]) -> str:
    """Where ``url`` points, for comparing two names of one place: a local path resolved (links
    and ``..`` followed), a URL as :func:`location` keeps it.

    >>> identity("s3://bucket/run/") == identity("s3://bucket/run")
    True
    """
    found = location(url)
    return str(found.resolve() if isinstance(found, Path) else found)


def local_path(url: str | os.PathLike[str]) -> Path:
    """The local directory of a path or ``file://`` URL (``ValueError`` for an object store)."""
    loc = location(url)
    if not isinstance(loc, Path):
        raise ValueError(f"{loc} is not a local path")
    return loc


def join(base: Path | str, *names: str) -> Path | str:
    """``base / name / ...`` for a local path or a URL."""
    if isinstance(base, Path):
        return base.joinpath(*names)
    return "/".join([base.rstrip("/"), *names])


def name_of(url: Path | str) -> str:
    """The last component of a path or URL."""
    return url.name if isinstance(url, Path) else url.rstrip("/").rpartition("/")[2]


def parent_of(url: Path | str) -> Path | str:
    """The parent of a path or URL."""
    return url.parent if isinstance(url, Path) else url.rstrip("/").rpartition("/")[0]


def open_store(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    follow_links: bool = False,
) -> LocalStore | ObjectStore:
    """The :class:`Store` rooted at ``url``: a :class:`LocalStore` for a path or ``file://``
    URL, an :class:`ObjectStore` for any other protocol (nothing is created).
    ``follow_links``: reads follow symlinks (files other tools wrote, such as a hub cache's;
    a checkpoint's reads never do; object stores have no links)."""
    loc = location(url)
    if isinstance(loc, Path):
        return LocalStore(loc, follow_links=follow_links)
    try:
        fs, root = fsspec.core.url_to_fs(loc, **dict(storage_options or {}))
    except ImportError as e:
        protocol = _protocol_of(loc)
        extra = EXTRAS.get(protocol or "")
        hint = (
            f"pip install 'lightning-bpk[{extra}]'"
            if extra
            else f"install the fsspec driver for {protocol}://"
        )
        raise MissingDriverError(
            f"{loc}: the {protocol}:// driver is not installed ({hint}): {e}"
        ) from e
    except ValueError as e:
        raise StorageError(f"{loc}: not a storage URL fsspec knows: {e}") from e
    return ObjectStore(fs, root.rstrip("/"), loc)


def open_parent(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[LocalStore | ObjectStore, str]:
    """The store of the directory holding the file at ``url``, and the file's key in it."""
    loc = location(url)
    return open_store(parent_of(loc), storage_options), name_of(loc)


def object_store(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> ObjectStore:
    """The :class:`ObjectStore` of a URL (``ValueError`` for a local path)."""
    store = open_store(url, storage_options)
    if not isinstance(store, ObjectStore):
        raise ValueError(f"{url} is a local path, not an object-store URL")
    return store
