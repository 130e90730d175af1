"""The names, metadata keys and head digests of a sharded checkpoint's files, shared by the
writer (:mod:`._writer`) and the readers (:mod:`._index`).

A rank file's *head* is its header and metadata (the tensor checksums included): the index
records each file's size, head size and the xxh3 of its head, and a reader checks a file's head
against that digest before it trusts anything in it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_bpk import _sharded_index, burnpack
from lightning_bpk.store import MissingDriverError, StorageError, open_store

INDEX_FORMAT = _sharded_index.FORMAT
INDEX_VERSION = _sharded_index.VERSION
INDEX_KEY = "lightning_bpk/dcp_index"  # burnpack metadata entry holding the JSON index
SAVE_ID_KEY = "lightning_bpk/dcp_save"  # every rank file names the save it belongs to
SHARD_KIND = "dcp_shard"
SAVE_ID_CHARS = 8  # of the save id in rank file names: distinct names per save
INDEX_KIND = "dcp_index"


def rank_file(prefix: str, rank: int, save_id: str) -> str:
    return f"{prefix}.rank-{rank}.{save_id[:SAVE_ID_CHARS]}.bpk"


def chunk_name(index: MetadataIndex) -> str:
    """The burnpack tensor name of a chunk: the fqn, plus ``@offsets`` when it is a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def head(path: Path) -> tuple[int, int, str]:
    """A written file's size, its head's size and the xxh3 of its head (header and metadata,
    with the tensor checksums)."""
    with burnpack.read(path) as pack:
        head_size = pack.data_start
    with open(path, "rb") as f:
        digest = xxhash.xxh3_64_hexdigest(f.read(head_size))
    return path.stat().st_size, head_size, digest


def stale_rank_files(prefix: str, names: Iterable[str], live: set[str]) -> list[str]:
    """Rank files of earlier or failed saves among ``names``: any not in ``live``."""
    pattern = re.compile(re.escape(prefix) + r"\.rank-[0-9]+\..*")
    return [name for name in names if pattern.fullmatch(name) and name not in live]


def servable(checkpoint_id: str | os.PathLike[str]) -> bool:
    """A local path, or a URL whose fsspec driver is installed."""
    try:
        open_store(checkpoint_id)
    except (StorageError, MissingDriverError):
        return False
    return True
