"""A record at a path or a URL: open it (optionally head-checked), read it, write it.

The one place where a record file meets a :class:`~lightning_bpk.store.Store`: the one reader
and the one writer of record files. ``Record.save``/``Record.load``/``load_record``, the
checkpointer, the interop loaders, the CLI and the Lightning ``CheckpointIO`` plugin all read and
write record files through here, so a damaged file raises the same
:class:`~lightning_bpk.records.RecordChecksumError` whoever reads it, on local disk or at a URL.
A file is opened through :meth:`Store.map <lightning_bpk.store.Store.map>`: on local disk the
file mapped copy-on-write (tensors are zero-copy views), on an object store an anonymous
mapping filled with ranged reads. With the head a manifest recorded, the head (header and CBOR
metadata, which hold every tensor's checksum) is fetched and checked first, so a damaged object
costs a few KiB, not its tensors; the tensors are checked against their checksums as they are
read. Writing streams into :meth:`Store.sink <lightning_bpk.store.Store.sink>`: ``O_DIRECT``,
fsync and rename locally, one upload remotely (the object appears whole or not at all).

>>> import tempfile, torch
>>> from lightning_bpk.records import StateRecord
>>> path = write_record(StateRecord({"w": torch.ones(2)}), tempfile.mkdtemp() + "/state.bpk")
>>> read_record(path).value["w"].tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import xxhash

from lightning_bpk import burnpack
from lightning_bpk.burnpack.writer import _write_to
from lightning_bpk.errors import StorageError
from lightning_bpk.records._kind import (
    RECORD_KIND_KEY,
    RecordChecksumError,
    RecordError,
    Stored,
    record_from_pack,
)
from lightning_bpk.store import Store, join, name_of, open_parent, parent_of
from lightning_bpk.store import location as as_location
from lightning_bpk.store.local import RefusedFileError

__all__ = [
    "HEAD_DAMAGED",
    "Described",
    "Head",
    "describe",
    "open_pack",
    "open_record",
    "read_pack",
    "read_record",
    "save_pack",
    "save_record",
    "with_bpk_suffix",
    "write_record",
]

HEAD_DAMAGED = "header/metadata bytes differ from the manifest's xxh3 (damaged)"
"""What a file whose head does not match its manifest's digest is called (a checksum error)."""


class Head(Protocol):
    """What a manifest records of a file: its size, its head's size and the head's xxh3."""

    @property
    def size(self) -> int: ...

    @property
    def head_size(self) -> int: ...

    @property
    def head_xxh3(self) -> str: ...


class Described(NamedTuple):
    """A written record file as a manifest lists it (see :class:`Head`) plus its record kind."""

    kind: str
    size: int
    head_size: int
    head_xxh3: str


def open_pack(
    store: Store, key: str, *, size: int | None = None, head: Head | None = None
) -> burnpack.Pack:
    """Open record file ``key`` of ``store``. ``size`` is what the store reports (a listing;
    default: asked now), never a manifest's claim: with a manifest ``head`` the two must agree
    before a byte is mapped, and the head must match its digest before the tensors are fetched
    (:class:`~lightning_bpk.records.RecordChecksumError` otherwise).

    ``FileNotFoundError`` when there is no such file; a
    :class:`~lightning_bpk.errors.StorageError` when the store keeps failing; a
    :class:`~lightning_bpk.burnpack.BurnpackError` or :class:`RecordError` naming the file for
    anything unreadable.
    """
    url = store.url_of(key)
    if size is None:
        size = store.size(key)
        if size is None:
            raise FileNotFoundError(f"{url}: no such file or object")
    if size > burnpack.MAX_FILE_SIZE:
        raise burnpack.ValidationError(f"{url}: {size} bytes exceeds the maximum file size")
    if head is not None and (head.size != size or head.head_size > size):
        # before anything is mapped: a manifest's sizes are claims until the store agrees
        raise RecordError(
            "io", f"{url}: {size} bytes, manifest records {head.size} (head {head.head_size})"
        )
    if size < burnpack.HEADER_SIZE:
        raise burnpack.HeaderError(
            f"{url}: Invalid header: insufficient bytes ({size} < {burnpack.HEADER_SIZE})"
        )
    try:
        mapped = store.map(key, size)
    except RefusedFileError as e:
        raise burnpack.ValidationError(f"{url}: {e.reason}") from None
    except (FileNotFoundError, StorageError):
        raise
    except OSError as e:
        raise burnpack.BurnpackIOError(f"cannot read {url}: {e.strerror or e}") from e
    buffer = mapped.buffer
    try:
        start = 0
        if head is not None:
            mapped.fetch(0, head.head_size)
            if _digest(buffer, head.head_size) != head.head_xxh3:
                raise RecordChecksumError(f"{url}: {HEAD_DAMAGED}")
            start = head.head_size
        mapped.fetch(start, len(buffer))
    except BaseException:
        # what failed is the news: a view still held somewhere (a traceback) only delays the
        # unmapping to the collector
        with contextlib.suppress(BufferError):
            buffer.close()
        raise
    return burnpack.Pack(buffer, source=url, _mmap=buffer)


def _digest(buffer: Any, head_size: int) -> str:
    view = memoryview(buffer)[:head_size]
    try:
        return xxhash.xxh3_64_hexdigest(view)
    finally:
        view.release()


def describe(store: Store, key: str, size: int | None = None) -> Described:
    """The manifest entry of record file ``key`` as it lies in the store: reads its head only
    (a few KiB), never its tensors."""
    url = store.url_of(key)
    size = store.size(key) if size is None else size
    if size is None:
        raise FileNotFoundError(f"{url}: no such file or object")
    if size < burnpack.HEADER_SIZE:
        raise burnpack.HeaderError(f"{url}: Invalid header: insufficient bytes ({size})")
    (meta_size,) = struct.unpack("<I", store.read(key, 6, burnpack.HEADER_SIZE))
    metadata_end = min(size, burnpack.HEADER_SIZE + meta_size)
    mapped = store.map(key, size)
    try:
        mapped.fetch(0, metadata_end)
        pack = burnpack.Pack(mapped.buffer, source=url)  # parses the head; no tensor is read
        kind = pack.metadata.get(RECORD_KIND_KEY, "dcp")
        head_size = pack.data_start
        pack.close()
        if head_size > metadata_end:
            mapped.fetch(metadata_end, head_size)  # the padding up to the data section
        digest = _digest(mapped.buffer, head_size)
    finally:
        mapped.buffer.close()
    return Described(kind, size, head_size, digest)


def read_pack(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> burnpack.Pack:
    """The record file at a path or URL (memory-mapped, or with ranged reads into memory).
    Burn's reader rule: ``.bpk`` is added to a name without suffix that does not exist."""
    store, key = open_parent(location, storage_options)
    size = store.size(key)
    if size is None and "." not in key and store.size(key + ".bpk") is not None:
        key += ".bpk"
        size = None
    return open_pack(store, key, size=size)


def open_record(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> burnpack.Pack:
    """:func:`read_pack` for the public readers (``load_record``, ``Record.load``, interop):
    anything unreadable is a :class:`RecordError` naming the file, with its cause chained (a
    missing file an ``"io"`` one, damaged bytes a :class:`RecordChecksumError`); a store that
    keeps failing stays a :class:`~lightning_bpk.errors.StorageError` naming the URL."""
    try:
        return read_pack(location, storage_options)
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    except FileNotFoundError as e:
        raise RecordError("io", f"cannot read {e}") from e


def read_record(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Stored:
    """The record at a path or URL; ``FileNotFoundError`` when there is none, a
    :class:`RecordError` naming the file for anything unreadable."""
    try:
        pack = read_pack(location, storage_options)
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    with pack:
        return record_from_pack(pack)


def save_record(record: Stored, store: Store, key: str) -> Described:
    """Write ``record`` as file ``key`` of ``store``, durably and whole (streamed: peak extra
    memory is about the largest tensor, not the file); what a manifest lists of it, computed
    from the bytes as they were written (nothing is read back). A full disk raises an
    ``OSError`` (:class:`~lightning_bpk.burnpack.BurnpackIOError`); other format errors a
    RecordError."""
    tensors, scalars, metadata = record.content()
    return save_pack(store, key, tensors, scalars=scalars, metadata=metadata)


def save_pack(
    store: Store,
    key: str,
    tensors: burnpack.TensorsArg,
    *,
    scalars: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Described:
    """The one writer of ``.bpk`` files: ``tensors`` (names to tensors or
    :class:`~lightning_bpk.burnpack.TensorEntry`, in data order), ``scalars`` and
    ``metadata`` streamed into :meth:`Store.sink <lightning_bpk.store.Store.sink>` (local:
    ``O_DIRECT`` where supported, fsync and rename; remote: one upload), as
    :func:`save_record` writes a record, for writers of other contents (interop's)."""
    try:
        written = _write_to(
            functools.partial(store.sink, key),
            store.url_of(key),
            tensors,
            scalars=scalars,
            metadata=metadata,
        )
    except burnpack.BurnpackIOError:
        raise
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    head = written.head
    kind = dict(metadata or {}).get(RECORD_KIND_KEY, "dcp")
    return Described(kind, written.size, len(head), xxhash.xxh3_64_hexdigest(head))


def write_record(
    record: Stored,
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write ``record`` at exactly ``location`` (a path or URL; no ``.bpk`` suffix rule), as
    :func:`save_record` does; returns the location."""
    store, key = open_parent(location, storage_options)
    save_record(record, store, key)
    return as_location(location)


def with_bpk_suffix(location: str | os.PathLike[str]) -> Path | str:
    """``location`` (a path or URL) with ``.bpk`` appended when its name has no suffix (Burn's
    rule for writers).

    >>> with_bpk_suffix("s3://bucket/run/model"), with_bpk_suffix("run/model.safetensors")
    ('s3://bucket/run/model.bpk', PosixPath('run/model.safetensors'))
    """
    loc = as_location(location)
    name = name_of(loc)
    if Path(name).suffix:
        return loc
    return join(parent_of(loc), name + ".bpk")
