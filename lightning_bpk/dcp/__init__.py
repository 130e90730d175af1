"""Burnpack behind ``torch.distributed.checkpoint`` (DCP): sharded checkpoints without pickle.

:class:`BurnpackStorageWriter` and :class:`BurnpackStorageReader` are DCP storage layers: DCP's
planner decides which chunk of which tensor each rank writes or reads (and reshards between
layouts and world sizes); these classes only move bytes. A checkpoint directory holds::

    sharded.rank-0.3f2a9c1e.bpk   rank 0's chunks, one burnpack tensor each (xxh3-checked)
    sharded.rank-1.3f2a9c1e.bpk   rank 1's chunks; every rank writes its own file, all at once
    sharded.index.bpk             the global index (JSON in the burnpack metadata), written last

The writer and the reader are written once, against :class:`~lightning_bpk.store.Store`
(:func:`~lightning_bpk.store.open_store` picks the backend from the path or URL: a local
directory, or ``s3://``, ``gs://``, ``memory://`` ... whose names are keys below the URL); no
line of them asks which backend it has::

    BurnpackStorageWriter                          BurnpackStorageReader, load_full_state_dict
      write_data: scratch(rank file)  ──┐            read_index: size, read (the index)
      finish:     list, put(index),     │            check_files: list (sizes), refused
                  remove(stale files)   │            per rank file: map + fetch(head),
                                        ▼            per chunk: read_into (or fetch)
                                     Store
          local disk: fsync + rename, preadv, mmap │ object store: upload (multipart, retried),
          symlinks refused                          │ ranged reads, create-only PUT

The protocol (DCP calls every step on every rank, the coordinator's in the middle):

1. ``prepare_global_plan`` (coordinator): give each rank a file name carrying this save's id,
   so no file of the committed checkpoint is ever overwritten;
2. ``write_data`` (every rank): write its chunks into its file at a scratch path of the store,
   which publishes it durably (local disk: fsync, rename, fsync the directory; object store: an
   upload, multipart when big, retried and bounded); report each chunk's file and name, and
   the file's size and head digest;
3. ``finish`` (coordinator, only after every rank's ``write_data`` succeeded): confirm every
   rank's file with one listing (present, with the size that rank reported), write the index
   (the commit point: it exists only once every rank's file is durable), then remove rank files
   the new index does not name (earlier or failed saves).

The index is written create-only (a conditional PUT on S3 and GCS), so on object storage a
checkpoint is written once: saving into a URL that holds one already is refused in
``prepare_global_plan``, before any rank writes. On local disk a re-save replaces the index
atomically (readers that opened the old files keep reading them). Under the checkpointer
(``BurnpackStorageWriter(staging, commit=False)``) the ranks write into the checkpoint's own
staging prefix, the index is an ordinary file there, and the checkpointer's sentinel, written
last, is the one commit.

DCP collects every rank's exception after planning and after writing and raises
``CheckpointException`` on every rank, so a failure anywhere fails the save everywhere; nothing
is committed and the directory's previous checkpoint (if any) still loads.

Reading checks the whole index first (:mod:`lightning_bpk.dcp._index`), then each rank file
a rank needs: its head against the index's digest (on local disk the file is mapped, on an
object store one ranged read fetches just the head), then only the byte ranges of the chunks
that rank needs, each checked against its xxh3 checksum. The same damage gives the same
exception, naming the same file, on every backend.

Nothing is pickled: tensors are burnpack tensors, the index is JSON, and a non-tensor value
(an optimizer's ``lr``, say) is stored as a :class:`~lightning_bpk.records.StateRecord` blob.
Loading such a value hands DCP's planner ``torch.save`` bytes produced here, in memory, from
the decoded value (the planner's only interface for objects); nothing read from disk is
unpickled.

Example (one process, no process group)::

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> path = tempfile.mkdtemp()
    >>> _ = dcp.save({"w": torch.arange(4.0)}, storage_writer=BurnpackStorageWriter(path))
    >>> state = {"w": torch.zeros(4)}
    >>> dcp.load(state, storage_reader=BurnpackStorageReader(path))
    >>> state["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_bpk.errors import LightningBpkError
from lightning_bpk.layout import SHARDED_PREFIX, _sharded_index_name
from lightning_bpk.store import open_store

if TYPE_CHECKING:
    from lightning_bpk.dcp._packs import INDEX_KEY as INDEX_KEY
    from lightning_bpk.dcp._packs import Index, read_index
    from lightning_bpk.dcp._reader import (
        BurnpackStorageReader,
        load_full_state_dict,
        load_nested,
        module_record,
    )
    from lightning_bpk.dcp._writer import INDEX_KIND as INDEX_KIND
    from lightning_bpk.dcp._writer import SHARD_KIND as SHARD_KIND
    from lightning_bpk.dcp._writer import BurnpackStorageWriter

__all__ = [
    "BurnpackStorageReader",
    "BurnpackStorageWriter",
    "Index",
    "ShardedCheckpointError",
    "is_sharded",
    "load_full_state_dict",
    "load_nested",
    "module_record",
    "read_index",
]


class ShardedCheckpointError(LightningBpkError, RuntimeError):
    """A sharded checkpoint could not be written or read; the message names the file."""


def is_sharded(
    directory: str | os.PathLike[str],
    prefix: str = SHARDED_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> bool:
    """True when ``directory`` (a local path or an object-store URL) holds a committed sharded
    checkpoint: its index exists. Cheap: it needs neither torch.distributed nor the rest of
    this package."""
    return open_store(directory, storage_options).size(_sharded_index_name(prefix)) is not None


# Importing torch.distributed.checkpoint costs seconds, and the command line and interop only
# need is_sharded and the error above to tell a sharded directory apart: the writer and reader
# are imported on first use. INDEX_KEY, INDEX_KIND and SHARD_KIND (the index's metadata key, the
# record kinds the checkpointer's manifest records) are importable from here too, outside the
# documented surface.
_LAZY = {
    "INDEX_KEY": "_packs",
    "Index": "_packs",
    "read_index": "_packs",
    "BurnpackStorageReader": "_reader",
    "load_full_state_dict": "_reader",
    "load_nested": "_reader",
    "module_record": "_reader",
    "INDEX_KIND": "_writer",
    "SHARD_KIND": "_writer",
    "BurnpackStorageWriter": "_writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
