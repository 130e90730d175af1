"""Reading a sharded checkpoint's index (:func:`read_index`, checked by
:mod:`lightning_bpk._sharded_index` before anything it names is opened) and its rank files
(:class:`_Packs`: heads checked against the index, chunks read and checked one at a time)."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_bpk import _sharded_index, burnpack, storage
from lightning_bpk._sharded_names import (
    DEFAULT_PREFIX,
    ShardedCheckpointError,
    index_name,
    index_path,
)
from lightning_bpk.dcp._format import INDEX_KEY, SAVE_ID_KEY, fetch_head, head
from lightning_bpk.records.base import RecordError, StateRecord

__all__ = ["Index", "read_index"]


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
                if head(path)[2] != expected["head_xxh3"]:
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
            if fetch_head(store, file, mapping, head_size) != expected["head_xxh3"]:
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
