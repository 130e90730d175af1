"""The writing half of the DCP storage layer: :class:`BurnpackStorageWriter` (the protocol is
in :mod:`lightning_bpk.dcp`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_bpk import _fs, _sharded_index, burnpack, storage
from lightning_bpk._sharded_names import (
    DEFAULT_PREFIX,
    ShardedCheckpointError,
    index_name,
    index_path,
)
from lightning_bpk.dcp._format import (
    INDEX_KEY,
    INDEX_KIND,
    SAVE_ID_KEY,
    SHARD_KIND,
    chunk_name,
    head,
    rank_file,
    servable,
    stale_rank_files,
)
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError, StateRecord

__all__ = ["BurnpackStorageWriter"]


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

    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return burnpack.TensorEntry(burnpack.burn_dtype(dtype), shape, resolve, nbytes=nbytes)


class BurnpackStorageWriter(StorageWriter):
    """DCP storage writer: each rank writes its chunks as one burnpack file, in parallel with the
    others; the coordinator writes the JSON index last (see the module docstring).

    Args:
        path: the checkpoint directory (created if missing), or an object-store URL (a prefix
            of keys; see the module docstring); ``dcp.save(checkpoint_id=...)`` may give it
            instead.
        prefix: file names are ``{prefix}.rank-{r}.{id}.bpk`` and ``{prefix}.index.bpk``.
        storage_options: passed to fsspec for a URL (credentials, endpoint).

    Every byte a rank writes goes through :meth:`write_file` (one call per rank and save; for
    a URL into a local scratch file, which :meth:`put_file` then uploads). After a save, the
    coordinator's :attr:`files` describes every file it committed (the index too).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else storage.location(path)
        self.prefix = prefix
        self.storage_options = storage_options
        self.is_coordinator = False
        self.save_id = ""
        # file name -> {"size", "head_size", "head_xxh3"}: what finish committed (coordinator)
        self.files: dict[str, dict[str, Any]] = {}

    # -- DCP protocol ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = storage.location(checkpoint_id)

    @property
    def checkpoint_id(self) -> Path | str | None:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.save_id = uuid.uuid4().hex  # the coordinator's names every file of this save
        self.files = {}
        location = self._directory()
        if isinstance(location, Path):
            location.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = self._store()
        if store is not None and store.size(index_name(self.prefix)) is not None:
            raise ShardedCheckpointError(
                f"{store.url_of(index_name(self.prefix))}: a committed checkpoint is there "
                "already; on object storage a sharded checkpoint is written once (its index is "
                "created only if absent), so save into a new checkpoint_id"
            )
        # New names for every save: files of the committed checkpoint are never overwritten.
        return [
            dataclasses.replace(
                plan, storage_data=(rank_file(self.prefix, i, self.save_id), self.save_id)
            )
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not isinstance(plan.storage_data, tuple):
            raise ShardedCheckpointError("the global plan gave this rank no file name")
        file, save_id = plan.storage_data
        entries = {chunk_name(item.index): _entry(planner, item) for item in plan.items}
        results = []
        if entries:
            size, head_size, digest = self._write_rank_file(
                file, entries, {RECORD_KIND_KEY: SHARD_KIND, SAVE_ID_KEY: save_id}
            )
            for item in plan.items:
                location = _sharded_index.Location(
                    file, chunk_name(item.index), size, digest, head_size
                )
                results.append(WriteResult(item.index, entries[location.name].nbytes, location))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_rank_file(
        self, file: str, entries: Mapping[str, burnpack.TensorEntry], metadata: dict[str, str]
    ) -> tuple[int, int, str]:
        """Write this rank's file where the checkpoint lives; its size, head size and digest."""
        location = self._directory()
        if isinstance(location, Path):
            target = location / file
            self.write_file(target, entries, metadata)
            return head(target)
        scratch = Path(tempfile.mkdtemp(prefix="lightning_bpk-upload-"))
        try:
            local = scratch / file
            self.write_file(local, entries, metadata)
            described = head(local)
            self.put_file(local, file)
            return described
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def write_file(
        self, target: Path, entries: Mapping[str, burnpack.TensorEntry], metadata: dict[str, str]
    ) -> None:
        """Publish one rank file durably (scratch, fsync, rename, fsync the directory)."""
        try:
            burnpack.write(target, entries, metadata=metadata, add_suffix=False)
        except burnpack.BurnpackError as e:
            raise ShardedCheckpointError(str(e)) from e

    def put_file(self, local: Path, name: str) -> None:
        """Upload one rank file written to ``local`` as object ``name`` (retried, bounded)."""
        store = self._store()
        assert store is not None
        try:
            store.upload(local, name)
        except OSError as e:
            raise ShardedCheckpointError(f"{store.url_of(name)}: upload failed: {e}") from e

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        locations = {r.index: r.storage_data for rank in results for r in rank}
        document, files = _sharded_index.encode(metadata, locations, self.save_id)
        index = burnpack.dumps({}, metadata={RECORD_KIND_KEY: INDEX_KIND, INDEX_KEY: document})
        head_size = burnpack.loads(index).data_start
        self.files = {
            **files,
            index_name(self.prefix): {
                "size": len(index),
                "head_size": head_size,
                "head_xxh3": xxhash.xxh3_64_hexdigest(index[:head_size]),
            },
        }
        store = self._store()
        if store is not None:
            listing = self._commit_remote(store, files, index)
            # Committed: objects of earlier or failed saves are garbage now (the next save
            # retries what fails here).
            with contextlib.suppress(OSError):
                store.remove(stale_rank_files(self.prefix, list(listing), set(files)))
            return
        directory = self._directory()
        assert isinstance(directory, Path)
        with _fs.atomic_file(index_path(directory, self.prefix)) as f:
            _fs.write_all(f, index)
        # Committed: rank files of earlier or failed saves are garbage now (removed after the
        # index, so a crash here leaves extra files, never an index naming missing ones).
        names = [entry.name for entry in os.scandir(directory)]
        for name in stale_rank_files(self.prefix, names, set(files)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)

    def _commit_remote(
        self, store: storage.ObjectStore, files: Mapping[str, Mapping[str, Any]], index: bytes
    ) -> dict[str, int | None]:
        """Confirm every rank's object (one listing), then create the index; the listing."""
        listing = store.list("")
        for name, expected in files.items():
            found = listing.get(name)
            if found != expected["size"]:
                raise ShardedCheckpointError(
                    f"{store.url_of(name)}: uploaded, but the store lists "
                    f"{'nothing' if found is None else f'{found} bytes'} instead of "
                    f"{expected['size']} bytes; the checkpoint is not committed"
                )
        if not store.create(index_name(self.prefix), index):
            raise ShardedCheckpointError(
                f"{store.url_of(index_name(self.prefix))}: another save committed a checkpoint "
                "here while this one wrote its shards; not overwritten"
            )
        return listing

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)  # asked before set-up: no save id yet

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return servable(checkpoint_id)

    def _directory(self) -> Path | str:
        if self.path is None:
            raise ShardedCheckpointError("no checkpoint directory: pass path or checkpoint_id")
        return self.path

    def _store(self) -> storage.ObjectStore | None:
        """The object store of a URL checkpoint (``None`` for a local directory)."""
        location = self._directory()
        if isinstance(location, Path):
            return None
        return storage.object_store(location, self.storage_options)
