"""Burnpack behind ``torch.distributed.checkpoint`` (DCP): sharded checkpoints without pickle.

:class:`BurnpackStorageWriter` and :class:`BurnpackStorageReader` are DCP storage layers: DCP's
planner decides which chunk of which tensor each rank writes or reads (and reshards between
layouts and world sizes); these classes only move bytes. A checkpoint directory holds::

    sharded.rank-0.3f2a9c1e.bpk   rank 0's chunks, one burnpack tensor each (xxh3-checked)
    sharded.rank-1.3f2a9c1e.bpk   rank 1's chunks; every rank writes its own file, all at once
    sharded.index.bpk             the global index (JSON in the burnpack metadata), written last

The protocol (DCP calls every step on every rank, the coordinator's in the middle):

1. ``prepare_global_plan`` (coordinator): give each rank a file name carrying this save's id,
   so no file of the committed checkpoint is ever overwritten;
2. ``write_data`` (every rank): write its chunks into its file (scratch name, fsync, rename,
   fsync the directory); report each chunk's file and name, and the file's size and head digest;
3. ``finish`` (coordinator, only after every rank's ``write_data`` succeeded): write the index
   atomically (the commit point: it exists only once every rank's file is durable), then remove
   rank files the new index does not name (earlier or failed saves).

DCP collects every rank's exception after planning and after writing and raises
``CheckpointException`` on every rank, so a failure anywhere fails the save everywhere; nothing
is committed and the directory's previous checkpoint (if any) still loads.

**On object storage** (``s3://bucket/run/step-100``, any fsspec URL but a local one) the same
names are keys below the URL. No rename exists there, so: each rank writes its file to a local
scratch folder and uploads it (a multipart upload when big; retried, bounded); the coordinator's
``finish`` lists the prefix once, checks that every rank's object is present with the size that
rank reported, and only then writes the index **create-only** (a conditional PUT on S3 and GCS):
the index is the commit point, so such a checkpoint is written once; saving into a URL that
holds one already is refused in ``prepare_global_plan``, before any rank writes. Reads fetch each
rank file's head (checked against the index's digest) and then only the byte ranges of the chunks
a rank needs, each checked against its xxh3 checksum.

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

from lightning_bpk._sharded_names import (
    DEFAULT_PREFIX,
    ShardedCheckpointError,
    index_path,
    is_sharded,
)
from lightning_bpk._sharded_names import index_name as index_name
from lightning_bpk.dcp._format import INDEX_FORMAT

# Importable from here too, outside the documented surface (an explicit re-export each): the
# record kinds the checkpointer's manifest records, the metadata keys, the index's version.
from lightning_bpk.dcp._format import INDEX_KEY as INDEX_KEY
from lightning_bpk.dcp._format import INDEX_KIND as INDEX_KIND
from lightning_bpk.dcp._format import INDEX_VERSION as INDEX_VERSION
from lightning_bpk.dcp._format import SAVE_ID_KEY as SAVE_ID_KEY
from lightning_bpk.dcp._format import SHARD_KIND as SHARD_KIND
from lightning_bpk.dcp._index import Index, read_index
from lightning_bpk.dcp._reader import BurnpackStorageReader, load_full_state_dict, load_nested
from lightning_bpk.dcp._writer import BurnpackStorageWriter

__all__ = [
    "DEFAULT_PREFIX",
    "INDEX_FORMAT",
    "BurnpackStorageReader",
    "BurnpackStorageWriter",
    "Index",
    "ShardedCheckpointError",
    "index_path",
    "is_sharded",
    "load_full_state_dict",
    "load_nested",
    "read_index",
]
