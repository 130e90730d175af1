"""The writing half of the DCP storage layer: :class:`BurnpackStorageWriter` (the protocol is
in :mod:`lightning_bpk.dcp`), written once against :class:`~lightning_bpk.store.Store`: each
rank's file through ``scratch`` (published durably by the store), the coordinator's index
through ``put``, the confirmation through one ``list`` and the sweep through ``remove``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_bpk import burnpack
from lightning_bpk.dcp import ShardedCheckpointError, _index
from lightning_bpk.dcp._packs import INDEX_KEY, SAVE_ID_KEY, servable
from lightning_bpk.layout import SHARDED_PREFIX, _sharded_index_name
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError, StateRecord
from lightning_bpk.records.files import Described, describe
from lightning_bpk.store import Store, location, open_store

SHARD_KIND = "dcp_shard"
"""The record kind of a rank file (in the burnpack metadata and the checkpoint manifest)."""
INDEX_KIND = "dcp_index"
"""The record kind of the DCP index file."""
_SAVE_ID_CHARS = 8  # of the save id in rank file names: distinct names per save


def _rank_file(prefix: str, rank: int, save_id: str) -> str:
    return f"{prefix}.rank-{rank}.{save_id[:_SAVE_ID_CHARS]}.bpk"


def _chunk_name(index: MetadataIndex) -> str:
    """The burnpack tensor name of a chunk: the fqn, plus ``@offsets`` when it is a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def _stale_rank_files(prefix: str, names: Iterable[str], live: set[str]) -> list[str]:
    """Rank files of earlier or failed saves among ``names``: any not in ``live``."""
    pattern = re.compile(re.escape(prefix) + r"\.rank-[0-9]+\..*")
    return [name for name in names if pattern.fullmatch(name) and name not in live]


def _entry(planner: SavePlanner, item: WriteItem) -> burnpack.TensorEntry:
    """The burnpack entry of one write item; a tensor's bytes are resolved lazily, while written,
    so a rank holds at most one resolved chunk beyond its own state at a time."""
    if item.type == WriteItemType.BYTE_IO:
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise ShardedCheckpointError(
                f"'{item.index.fqn}' is not a tensor and planner {type(planner).__name__} has no "
                "lookup_object: burnpack stores objects as plain data, never as pickle"
            )
        try:
            blob = StateRecord(lookup(item.index)).to_bytes()
        except RecordError as e:
            raise ShardedCheckpointError(
                f"'{item.index.fqn}' cannot be stored without pickle: {e}"
            ) from e
        return burnpack.TensorEntry("U8", [len(blob)], blob)
    data = item.tensor_data
    assert data is not None
    dtype = data.properties.dtype
    shape = tuple(data.chunk.sizes)
    numel = 1
    for d in shape:
        numel *= d

    def resolve() -> torch.Tensor:
        tensor = planner.resolve_data(item)
        assert isinstance(tensor, torch.Tensor)
        return tensor.detach().to("cpu", dtype).contiguous()

    nbytes = numel * dtype.itemsize
    return burnpack.TensorEntry(burnpack._burn_dtype(dtype), shape, resolve, nbytes=nbytes)


class BurnpackStorageWriter(StorageWriter):
    """DCP storage writer: each rank writes its chunks as one burnpack file, in parallel with the
    others; the coordinator writes the JSON index last (see :mod:`lightning_bpk.dcp`).

    Args:
        path: the checkpoint directory (created if missing), or an object-store URL (a prefix
            of keys); ``dcp.save(checkpoint_id=...)`` may give it instead.
        prefix: file names are ``{prefix}.rank-{r}.{id}.bpk`` and ``{prefix}.index.bpk``.
        storage_options: passed to fsspec for a URL (credentials, endpoint).
        commit: ``True`` (the default, the writer used on its own): the index is the commit
            (step 3 of the protocol in :mod:`lightning_bpk.dcp`). ``False``: the caller
            commits; ``path`` is a staging prefix it made for this save (the location of a
            :meth:`lightning_bpk.store.Store.staging` prefix), ``finish`` writes the index
            there as an ordinary file and removes nothing, and the caller confirms, publishes
            and writes its own sentinel last (the checkpointer does, with :attr:`files` in its
            manifest).

    After a save, the coordinator's :attr:`files` describes every file it wrote (the index
    too): name -> size, head size and head digest.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        prefix: str = SHARDED_PREFIX,
        storage_options: Mapping[str, Any] | None = None,
        commit: bool = True,
    ) -> None:
        super().__init__()
        self.path = None if path is None else location(path)
        self.prefix = prefix
        self.storage_options = storage_options
        self.commit = commit
        self._opened: tuple[Path | str, Store] | None = None
        self.is_coordinator = False
        self.save_id = ""
        # file name -> {"size", "head_size", "head_xxh3"}: what finish wrote (coordinator)
        self.files: dict[str, dict[str, Any]] = {}

    # -- DCP protocol ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = location(checkpoint_id)

    @property
    def checkpoint_id(self) -> Path | str | None:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.save_id = uuid.uuid4().hex  # the coordinator's names every file of this save
        self.files = {}
        try:
            self._store().check(create=True)
        except OSError as e:
            raise ShardedCheckpointError(f"{self._store().url}: cannot be written: {e}") from e

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store, index = self._store(), _sharded_index_name(self.prefix)
        if self.commit and not store.replaces_in_place and store.size(index) is not None:
            raise ShardedCheckpointError(
                f"{store.url_of(index)}: a committed checkpoint is there already; on object "
                "storage a sharded checkpoint is written once (its index is created only if "
                "absent), so save into a new checkpoint_id"
            )
        # New names for every save: files of the committed checkpoint are never overwritten.
        return [
            dataclasses.replace(
                plan, storage_data=(_rank_file(self.prefix, i, self.save_id), self.save_id)
            )
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not isinstance(plan.storage_data, tuple):
            raise ShardedCheckpointError("the global plan gave this rank no file name")
        file, save_id = plan.storage_data
        entries = {_chunk_name(item.index): _entry(planner, item) for item in plan.items}
        results = []
        if entries:
            head = self._write_rank_file(
                file, entries, {RECORD_KIND_KEY: SHARD_KIND, SAVE_ID_KEY: save_id}
            )
            for item in plan.items:
                location = _index.Location(
                    file, _chunk_name(item.index), head.size, head.head_xxh3, head.head_size
                )
                results.append(WriteResult(item.index, entries[location.name].nbytes, location))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_rank_file(
        self, file: str, entries: Mapping[str, burnpack.TensorEntry], metadata: dict[str, str]
    ) -> Described:
        """Write this rank's file through the store; its size, head size and head digest."""
        store = self._store()
        described = None
        try:
            with store.scratch(file) as scratch:
                self.write_file(scratch, entries, metadata)  # its errors are raised as they are
                described = describe(open_store(scratch.parent), scratch.name)
        except OSError as e:
            if described is None:
                raise
            # written, then publishing failed: the rename, or the upload after its retries
            raise ShardedCheckpointError(f"{store.url_of(file)}: not published: {e}") from e
        return described

    def write_file(
        self, target: Path, entries: Mapping[str, burnpack.TensorEntry], metadata: dict[str, str]
    ) -> None:
        """Write one rank file at ``target``, a local scratch path that the store publishes
        (fsynced and renamed, or uploaded) once this returns."""
        try:
            burnpack.write(target, entries, metadata=metadata, atomic=False, add_suffix=False)
        except burnpack.BurnpackError as e:
            raise ShardedCheckpointError(str(e)) from e

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        locations = {r.index: r.storage_data for rank in results for r in rank}
        document, files = _index.encode(metadata, locations, self.save_id)
        index = burnpack.dumps({}, metadata={RECORD_KIND_KEY: INDEX_KIND, INDEX_KEY: document})
        head_size = burnpack.loads(index).data_start
        name = _sharded_index_name(self.prefix)
        self.files = {
            **files,
            name: {
                "size": len(index),
                "head_size": head_size,
                "head_xxh3": xxhash.xxh3_64_hexdigest(index[:head_size]),
            },
        }
        store = self._store()
        if not self.commit:  # the caller's sentinel commits: the index is one of its files
            store.put(name, index)
            return
        listing = _confirmed(store, files)
        if not store.put(name, index, create_only=not store.replaces_in_place):
            raise ShardedCheckpointError(
                f"{store.url_of(name)}: another save committed a checkpoint here while this one "
                "wrote its shards; not overwritten"
            )
        # Committed: rank files of earlier or failed saves are garbage now (removed after the
        # index, so a crash here leaves extra files, never an index naming missing ones; the
        # next save retries what fails here).
        with contextlib.suppress(OSError):
            store.remove(_stale_rank_files(self.prefix, list(listing), set(files)))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)  # asked before set-up: no save id yet

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return servable(checkpoint_id)

    def _store(self) -> Store:
        """The store of the checkpoint (opened once per path)."""
        if self.path is None:
            raise ShardedCheckpointError("no checkpoint directory: pass path or checkpoint_id")
        if self._opened is None or self._opened[0] != self.path:
            self._opened = (self.path, open_store(self.path, self.storage_options))
        return self._opened[1]


def _confirmed(store: Store, files: Mapping[str, Mapping[str, Any]]) -> dict[str, int | None]:
    """The checkpoint's listing, once every rank's file is in it with the size that rank
    reported (one listing)."""
    listing = store.list("")
    for name, expected in files.items():
        found = listing.get(name)
        if found != expected["size"]:
            raise ShardedCheckpointError(
                f"{store.url_of(name)}: written, but the store lists "
                f"{'nothing' if found is None else f'{found} bytes'} instead of "
                f"{expected['size']} bytes; the checkpoint is not committed"
            )
    return listing
