"""A record at a path or a URL: open it (optionally head-checked), read it, write it.

The one place where a record file meets a :class:`~lightning_bpk.store.Store`; the checkpointer,
the CLI and the Lightning ``CheckpointIO`` plugin all read and write record files through here.
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
from lightning_bpk.records.base import (
    RECORD_KIND_KEY,
    Record,
    RecordChecksumError,
    RecordError,
    _record_from_pack,
)
from lightning_bpk.store import Store, open_parent
from lightning_bpk.store import location as as_location
from lightning_bpk.store.local import RefusedFileError

__all__ = [
    "HEAD_DAMAGED",
    "Described",
    "Head",
    "describe",
    "open_pack",
    "read_pack",
    "read_record",
    "save_record",
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


def read_record(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Record:
    """The record at a path or URL; ``FileNotFoundError`` when there is none, a
    :class:`RecordError` naming the file for anything unreadable."""
    try:
        pack = read_pack(location, storage_options)
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    with pack:
        return _record_from_pack(pack)


def save_record(record: Record, store: Store, key: str) -> Described:
    """Write ``record`` as file ``key`` of ``store``, durably and whole (streamed: peak extra
    memory is about the largest tensor, not the file); what a manifest lists of it, computed
    from the bytes as they were written (nothing is read back). A full disk raises an
    ``OSError`` (:class:`~lightning_bpk.burnpack.BurnpackIOError`); other format errors a
    RecordError."""
    tensors, scalars, metadata = record.content()
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
    kind = metadata.get(RECORD_KIND_KEY, "dcp")
    return Described(kind, written.size, len(head), xxhash.xxh3_64_hexdigest(head))


def write_record(
    record: Record,
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write ``record`` at exactly ``location`` (a path or URL; no ``.bpk`` suffix rule), as
    :func:`save_record` does; returns the location."""
    store, key = open_parent(location, storage_options)
    save_record(record, store, key)
    return as_location(location)
