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

import contextlib
import dataclasses
import io
import itertools
import mmap
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_bpk import _fs, _sharded_index, burnpack, storage
from lightning_bpk._sharded_names import (
    DEFAULT_PREFIX,
    ShardedCheckpointError,
    index_name,
    index_path,
    is_sharded,
)
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError, StateRecord

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

INDEX_FORMAT = _sharded_index.FORMAT
INDEX_VERSION = _sharded_index.VERSION
INDEX_KEY = "lightning_bpk/dcp_index"  # burnpack metadata entry holding the JSON index
SAVE_ID_KEY = "lightning_bpk/dcp_save"  # every rank file names the save it belongs to
SHARD_KIND = "dcp_shard"
SAVE_ID_CHARS = 8  # of the save id in rank file names: distinct names per save
INDEX_KIND = "dcp_index"


def _rank_file(prefix: str, rank: int, save_id: str) -> str:
    return f"{prefix}.rank-{rank}.{save_id[:SAVE_ID_CHARS]}.bpk"


def _chunk_name(index: MetadataIndex) -> str:
    """The burnpack tensor name of a chunk: the fqn, plus ``@offsets`` when it is a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def _head(path: Path) -> tuple[int, int, str]:
    """A written file's size, its head's size and the xxh3 of its head (header and metadata,
    with the tensor checksums)."""
    with burnpack.read(path) as pack:
        head_size = pack.data_start
    with open(path, "rb") as f:
        digest = xxhash.xxh3_64_hexdigest(f.read(head_size))
    return path.stat().st_size, head_size, digest


def _stale_rank_files(prefix: str, names: Iterable[str], live: set[str]) -> list[str]:
    """Rank files of earlier or failed saves among ``names``: any not in ``live``."""
    pattern = re.compile(re.escape(prefix) + r"\.rank-[0-9]+\..*")
    return [name for name in names if pattern.fullmatch(name) and name not in live]


# --- writing ------------------------------------------------------------------------------------


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
            size, head_size, head = self._write_rank_file(
                file, entries, {RECORD_KIND_KEY: SHARD_KIND, SAVE_ID_KEY: save_id}
            )
            for item in plan.items:
                location = _sharded_index.Location(
                    file, _chunk_name(item.index), size, head, head_size
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
            return _head(target)
        scratch = Path(tempfile.mkdtemp(prefix="lightning_bpk-upload-"))
        try:
            local = scratch / file
            self.write_file(local, entries, metadata)
            described = _head(local)
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
                store.remove(_stale_rank_files(self.prefix, list(listing), set(files)))
            return
        directory = self._directory()
        assert isinstance(directory, Path)
        with _fs.atomic_file(index_path(directory, self.prefix)) as f:
            _fs.write_all(f, index)
        # Committed: rank files of earlier or failed saves are garbage now (removed after the
        # index, so a crash here leaves extra files, never an index naming missing ones).
        names = [entry.name for entry in os.scandir(directory)]
        for name in _stale_rank_files(self.prefix, names, set(files)):
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
        return _servable(checkpoint_id)

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


# --- the index ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Index:
    """A parsed sharded-checkpoint index: which chunk of which tensor lies in which file."""

    directory: Path | str  # a local directory, or the URL of an object-store prefix
    save_id: str
    files: dict[str, dict[str, Any]]  # file name -> {"size", "head_xxh3"[, "head_size"]}
    tensors: dict[str, dict[str, Any]]  # fqn -> {"dtype", "shape", "requires_grad", "chunks"}
    objects: dict[str, dict[str, Any]]  # fqn -> {"file", "name"}
    planner_data: Any
    store: storage.ObjectStore | None = None  # the store of a URL directory
    # per rank file, what the index places there (checked when the file is opened)
    placed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)

    def where(self, file: str) -> str:
        """The path or URL of one of the checkpoint's files, for messages."""
        return str(storage.join(self.directory, file))

    def metadata(self) -> Metadata:
        """The index as DCP's ``Metadata`` (what a planner needs to plan a load)."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[str, str]] = {}
        for fqn, t in self.tensors.items():
            chunks = []
            for i, c in enumerate(t["chunks"]):
                chunks.append(
                    ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                )
                storage[MetadataIndex(fqn, c["offsets"], i)] = (c["file"], c["name"])
            props = TensorProperties(
                dtype=burnpack.torch_dtype(t["dtype"]), requires_grad=t["requires_grad"]
            )
            state[fqn] = TensorStorageMetadata(props, torch.Size(t["shape"]), chunks)
        for fqn, o in self.objects.items():
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = (o["file"], o["name"])
        planner_data = self.planner_data
        if isinstance(planner_data, dict):  # DefaultSavePlanner's flattening: key -> path tuple
            planner_data = {
                k: tuple(v) if isinstance(v, list) else v for k, v in planner_data.items()
            }
        return Metadata(state, planner_data=planner_data, storage_data=storage)

    def check_files(self, *, verify_tensors: bool = False) -> list[str]:
        """Problems with the rank files (sizes, head digests, save ids; optionally every tensor)."""
        if self.store is not None:
            return self._check_objects(self.store, verify_tensors)
        problems = []
        assert isinstance(self.directory, Path)
        for name, expected in self.files.items():
            path = self.directory / name
            try:
                size = _sharded_index.real_file(self.directory, name).st_size
            except FileNotFoundError:
                problems.append(f"{path}: listed in the index but missing")
                continue
            except ShardedCheckpointError as e:
                problems.append(str(e))
                continue
            if size != expected["size"]:
                problems.append(f"{path}: {size} bytes, the index records {expected['size']}")
                continue
            try:
                if _head(path)[2] != expected["head_xxh3"]:
                    problems.append(f"{path}: header/metadata differ from the index (damaged)")
                    continue
                with burnpack.read(path) as pack:
                    _sharded_index.check_rank_file(self.placed.get(name, {}), pack)
                    if verify_tensors:
                        pack.verify()
            except (burnpack.BurnpackError, ShardedCheckpointError) as e:
                problems.append(str(e))
        return problems

    def _check_objects(self, store: storage.ObjectStore, verify_tensors: bool) -> list[str]:
        """:meth:`check_files` on an object store: one listing for the sizes; the heads (and
        with ``verify_tensors`` every chunk) with ranged reads."""
        listing = store.list("")
        problems = []
        for name, expected in self.files.items():
            found = listing.get(name)
            if found is None:
                problems.append(f"{self.where(name)}: listed in the index but missing")
            elif found != expected["size"]:
                problems.append(
                    f"{self.where(name)}: {found} bytes, the index records {expected['size']}"
                )
            elif verify_tensors:
                with _opened(self, verify=True) as packs:
                    try:
                        pack = packs.pack(name)
                        for chunk in pack.names:
                            packs.tensor(name, chunk)
                    except (ShardedCheckpointError, burnpack.BurnpackError, OSError) as e:
                        problems.append(str(e))
        return problems


def read_index(
    directory: str | os.PathLike[str],
    prefix: str = DEFAULT_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> Index:
    """Parse the index of the sharded checkpoint in ``directory`` (a local directory or an
    object-store URL; raises naming the file)."""
    location = storage.location(directory)
    store = None
    if isinstance(location, Path):
        path: Path | str = index_path(location, prefix)
    else:
        store = storage.object_store(location, storage_options)
        path = store.url_of(index_name(prefix))
    try:
        if store is None:
            assert isinstance(path, Path) and isinstance(location, Path)
            _sharded_index.real_directory(location)
            _sharded_index.real_file(location, index_name(prefix))
            with burnpack.read(path) as pack:
                raw = pack.metadata.get(INDEX_KEY)
        else:
            raw = burnpack.loads(_read_index_object(store, index_name(prefix))).metadata.get(
                INDEX_KEY
            )
    except FileNotFoundError as e:
        raise ShardedCheckpointError(f"{path}: no sharded checkpoint index there") from e
    except (burnpack.BurnpackError, OSError) as e:
        raise ShardedCheckpointError(f"{path}: not a sharded checkpoint index ({e})") from e
    doc = _sharded_index.parse(raw, str(path))
    return Index(
        location,
        doc.save_id,
        doc.files,
        doc.tensors,
        doc.objects,
        doc.planner_data,
        store,
        doc.placed,
    )


def _read_index_object(store: storage.ObjectStore, name: str) -> bytes:
    """The bytes of an index object, its size checked before they are fetched: an index is a
    header and metadata only."""
    size = store.size(name)
    if size is None:
        raise FileNotFoundError(store.url_of(name))
    if size > burnpack.HEADER_SIZE + burnpack.MAX_METADATA_SIZE + burnpack.TENSOR_ALIGNMENT:
        raise ShardedCheckpointError(f"{store.url_of(name)}: {size} bytes, too big for an index")
    return store.read(name)


# --- reading ------------------------------------------------------------------------------------


class _Packs:
    """Rank files opened once per read and checked against the index.

    Chunks are read with ``pread`` (on an object store: ranged reads of just the chunk's bytes)
    into a fresh tensor and verified there, and only the chunk in use is kept (callers go chunk
    by chunk), so a rank's peak extra memory is about its largest chunk, whatever the size of
    the files (a memory-mapped read would count every page of them).
    """

    def __init__(self, index: Index, verify: bool) -> None:
        self.index = index
        self.verify = verify
        self.packs: dict[str, burnpack.Pack] = {}
        self.current: tuple[tuple[str, str], torch.Tensor] | None = None
        # an object's pack parses its head in an anonymous mapping of the object's size: the
        # pages of the data section are never touched, so they take no memory (see _open_object)
        self.mappings: dict[str, mmap.mmap] = {}

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if self.current is None or self.current[0] != (file, name):
            self.current = None  # free the previous chunk before reading the next
            self.current = ((file, name), self._read(file, name))
        return self.current[1]

    def _info(self, file: str, name: str) -> tuple[burnpack.Pack, burnpack.TensorInfo, torch.dtype]:
        pack = self.pack(file)
        try:
            info = pack.entries[name]
            return pack, info, burnpack.torch_dtype(info.dtype)
        except (KeyError, burnpack.BurnpackError) as e:
            raise ShardedCheckpointError(f"{pack.source}: chunk '{name}': {e}") from e

    def _read(self, file: str, name: str) -> torch.Tensor:
        pack, info, dtype = self._info(file, name)
        if dtype == torch.bool:  # bytes must be checked to be 0/1: Pack.tensor does that
            if file in self.mappings:  # fetch the chunk into the object's mapping first
                start = pack.data_start + info.data_offsets[0]
                view = memoryview(self.mappings[file])[start : start + info.nbytes]
                self._pread(file, pack, name, info, view)
            return pack.tensor(name, verify=self.verify).clone()
        data = torch.empty(info.nbytes, dtype=torch.uint8)
        self._pread(file, pack, name, info, burnpack.tensor_bytes(data))
        return data.view(dtype).reshape(info.shape)

    def read_into(self, file: str, name: str, target: torch.Tensor) -> bool:
        """Read a whole chunk straight into ``target``'s memory when it can take the stored bytes
        as they are (contiguous CPU tensor of the same dtype and shape); False otherwise."""
        pack, info, dtype = self._info(file, name)
        if (
            dtype == torch.bool
            or target.dtype != dtype
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or tuple(target.shape) != info.shape
            or target.numel() == 0
        ):
            return False
        self._pread(file, pack, name, info, burnpack.tensor_bytes(target))
        return True

    def _pread(
        self,
        file: str,
        pack: burnpack.Pack,
        name: str,
        info: burnpack.TensorInfo,
        view: memoryview,
    ) -> None:
        """Read the chunk's bytes into ``view`` and check them against its checksum."""
        start = pack.data_start + info.data_offsets[0]
        if self.index.store is not None:
            try:
                self.index.store.read_into(file, view, offset=start)
            except OSError as e:
                raise ShardedCheckpointError(f"{pack.source}: chunk '{name}': {e}") from e
        else:
            with open(pack.source, "rb", buffering=0) as f:
                done = 0
                while done < len(view):
                    got = os.preadv(f.fileno(), [view[done:]], start + done)
                    if got <= 0:
                        raise ShardedCheckpointError(f"{pack.source}: truncated in chunk '{name}'")
                    done += got
        expected = pack.checksums.get(name)
        if self.verify and expected is not None and xxhash.xxh3_64_hexdigest(view) != expected:
            raise ShardedCheckpointError(
                f"{pack.source}: chunk '{name}' fails its checksum (the file is damaged)"
            )

    def pack(self, file: str) -> burnpack.Pack:
        if file not in self.packs:
            expected = self.index.files.get(file)
            if expected is None:
                raise ShardedCheckpointError(
                    f"{self.index.where(file)}: not one of the files of the index "
                    f"{self.index.where(index_name())}"
                )
            try:
                if self.index.store is None:
                    assert isinstance(self.index.directory, Path)
                    _sharded_index.real_file(self.index.directory, file)
                    pack = burnpack.read(self.index.directory / file)
                else:
                    pack = self._open_object(self.index.store, file, expected)
            except (burnpack.BurnpackError, FileNotFoundError) as e:
                raise ShardedCheckpointError(f"cannot read rank file: {e}") from e
            try:
                if pack.metadata.get(SAVE_ID_KEY) != self.index.save_id:
                    raise ShardedCheckpointError(
                        f"{self.index.where(file)}: belongs to another save than the index "
                        f"{self.index.where(index_name())}"
                    )
                _sharded_index.check_rank_file(self.index.placed.get(file, {}), pack)
            except ShardedCheckpointError:
                pack.close()
                raise
            self.packs[file] = pack
        return self.packs[file]

    def _open_object(
        self, store: storage.ObjectStore, file: str, expected: Mapping[str, Any] | None
    ) -> burnpack.Pack:
        """Parse an object's head, fetched with one ranged read and checked against the index.

        The pack sees an anonymous mapping of the object's full size holding just the head;
        chunks are then fetched on their own (:meth:`_pread`), so nothing else is downloaded.
        """
        url = store.url_of(file)
        if expected is None or not expected.get("head_size"):
            raise ShardedCheckpointError(f"{url}: the index does not describe this file")
        size, head_size = int(expected["size"]), int(expected["head_size"])
        if not 0 < head_size <= size <= burnpack.MAX_FILE_SIZE:
            raise ShardedCheckpointError(f"{url}: the index records impossible sizes")
        mapping = mmap.mmap(-1, size)
        try:
            if _fetch_head(store, file, mapping, head_size) != expected["head_xxh3"]:
                raise ShardedCheckpointError(
                    f"{url}: header/metadata differ from the index (damaged)"
                )
            pack = burnpack.Pack(mapping, source=url)
        except BaseException as e:
            with contextlib.suppress(BufferError):
                mapping.close()
            if isinstance(e, OSError):
                raise ShardedCheckpointError(f"{url}: {e}") from e
            raise
        self.mappings[file] = mapping
        return pack

    def close(self) -> None:
        self.current = None
        for pack in self.packs.values():
            pack.close()
        self.packs.clear()
        for mapping in self.mappings.values():
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapping.close()
        self.mappings.clear()


def _fetch_head(store: storage.ObjectStore, file: str, mapping: mmap.mmap, head_size: int) -> str:
    """Read the first ``head_size`` bytes of object ``file`` into ``mapping``; their xxh3."""
    view = memoryview(mapping)[:head_size]
    try:
        store.read_into(file, view)
        return xxhash.xxh3_64_hexdigest(view)
    finally:
        view.release()  # the mapping can be closed only once no view of it is left


@contextlib.contextmanager
def _opened(index: Index, verify: bool) -> Iterator[_Packs]:
    packs = _Packs(index, verify)
    try:
        yield packs
    finally:
        packs.close()


def _object(packs: _Packs, file: str, name: str, fqn: str) -> Any:
    blob = packs.tensor(file, name)
    try:
        return StateRecord.from_bytes(blob.numpy().tobytes()).value
    except RecordError as e:
        raise ShardedCheckpointError(f"object '{fqn}' in {file}: {e}") from e


class BurnpackStorageReader(StorageReader):
    """DCP storage reader for checkpoints written by :class:`BurnpackStorageWriter`.

    Each rank opens only the rank files holding chunks it needs and copies the overlapping
    part of each chunk into its own tensors; every tensor read is checked against its xxh3
    checksum (``verify=False`` skips that). ``path`` may be an object-store URL
    (``storage_options`` go to fsspec): then only the heads of those files and the byte ranges
    of those chunks are fetched.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        verify: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else storage.location(path)
        self.prefix = prefix
        self.verify = verify
        self.storage_options = storage_options
        self.index: Index | None = None
        self.storage_data: dict[MetadataIndex, tuple[str, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = storage.location(checkpoint_id)
        self.index = None
        self.storage_data = {}

    @property
    def checkpoint_id(self) -> Path | str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ShardedCheckpointError("no checkpoint directory: pass path or checkpoint_id")
        self.index = read_index(self.path, self.prefix, self.storage_options)
        problems = self.index.check_files()
        if problems:
            raise ShardedCheckpointError("; ".join(problems))
        return self.index.metadata()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self.index is None:  # DCP always reads the metadata first; be safe if not
            self.read_metadata()
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.index is not None
        with _opened(self.index, self.verify) as packs:
            for req in sorted(plan.items, key=lambda r: self.storage_data[r.storage_index]):
                file, name = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    value = _object(packs, file, name, req.storage_index.fqn)
                    buffer = io.BytesIO()
                    torch.save(value, buffer)  # the planner's interface; made here, not read
                    buffer.seek(0)
                    planner.load_bytes(req, buffer)
                    continue
                target = planner.resolve_tensor(req).detach()
                whole = not any(req.storage_offsets)  # same layout: one read, no extra copy
                if not (whole and packs.read_into(file, name, target)):
                    self._copy_part(packs, file, name, req, target)
                planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _copy_part(packs: _Packs, file: str, name: str, req: Any, target: torch.Tensor) -> None:
        """Copy the part of a stored chunk that ``req`` asks for (another layout) into target."""
        stored = packs.tensor(file, name)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            stored = stored.narrow(dim, start, length)
        if target.size() != stored.size():
            raise ShardedCheckpointError(
                f"{file}: chunk '{name}' gives {list(stored.size())}, the target "
                f"{list(target.size())}"
            )
        with torch.no_grad():
            target.copy_(stored)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _servable(checkpoint_id) and is_sharded(checkpoint_id)
        except OSError:
            return False


def _servable(checkpoint_id: str | os.PathLike[str]) -> bool:
    """A local path, or a URL whose fsspec driver is installed."""
    try:
        storage.open_store(checkpoint_id)
    except (storage.StorageError, storage.MissingDriverError):
        return False
    return True


# --- without a process group ----------------------------------------------------------------------


def load_full_state_dict(
    directory: str | os.PathLike[str],
    *,
    prefix: str = DEFAULT_PREFIX,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full (unsharded) flat state dict of a sharded checkpoint, in this process alone.

    Keys are DCP's flattened keys (``state_dict.layer.weight``, ``optimizer_0.state...``); each
    tensor is assembled from its chunks, whatever the world size that saved it. Objects come back
    as their plain-data values. No process group is needed. ``directory`` may be a URL.
    """
    index = read_index(directory, prefix, storage_options)
    problems = index.check_files()
    if problems:
        raise ShardedCheckpointError("; ".join(problems))
    out: dict[str, Any] = {}
    with _opened(index, verify) as packs:
        for fqn, t in index.tensors.items():  # read_index checked that the chunks tile it
            full = torch.empty(t["shape"], dtype=burnpack.torch_dtype(t["dtype"]))
            for c in t["chunks"]:
                region = full
                for dim, (start, length) in enumerate(zip(c["offsets"], c["sizes"], strict=True)):
                    region = region.narrow(dim, start, length)
                region.copy_(packs.tensor(c["file"], c["name"]))
            out[fqn] = full
        for fqn, o in index.objects.items():
            out[fqn] = _object(packs, o["file"], o["name"], fqn)
    return out


def _put(root: dict, path: tuple, value: Any) -> None:
    """Set ``value`` at ``path`` (keys and list indices) in ``root``, creating what is missing."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = [] if isinstance(following, int) else {}
            node[key] = child
        node = child
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def load_nested(
    directory: str | os.PathLike[str],
    *,
    prefix: str = DEFAULT_PREFIX,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The state dict as it was saved (nested again by the planner's key paths), every tensor
    full-size, in this process alone (``directory`` may be a URL).

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> path = tempfile.mkdtemp()
    >>> state = {"opt": {"groups": [{"lr": 0.1}], "w": torch.ones(2)}}
    >>> _ = dcp.save(state, storage_writer=BurnpackStorageWriter(path))
    >>> load_nested(path)["opt"]["groups"]
    [{'lr': 0.1}]
    """
    flat = load_full_state_dict(
        directory, prefix=prefix, verify=verify, storage_options=storage_options
    )
    mapping = read_index(directory, prefix, storage_options).metadata().planner_data
    if not isinstance(mapping, dict):
        return flat
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key, (key,))
        _put(nested, tuple(path), value)
    return nested
