"""Reading a sharded checkpoint through its :class:`~lightning_bpk.store.Store`: the index
(:func:`read_index`, checked whole by :mod:`lightning_bpk.dcp._index` before anything it names
is opened) and the rank files (:class:`_Packs`: each file's head checked against the index, its
chunks read one at a time and checked against their checksums).

Every byte comes through the store, the same calls on every backend: ``size`` and ``read`` for
the index, ``list`` for the rank files' sizes, ``map`` for a rank file's head (local disk: the
file mapped, nothing copied; an object store: one ranged read into an anonymous mapping of the
file's size) and ``read_into`` for each chunk (``preadv``, or ranged reads, straight into the
tensor that keeps it). ``refused`` applies the rule that a checkpoint is real files: a symlink
on the way to the index or a rank file is refused, never followed (object stores hold none).
"""

from __future__ import annotations

import contextlib
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

from lightning_bpk import burnpack
from lightning_bpk.burnpack.writer import data_section_start
from lightning_bpk.dcp import ShardedCheckpointError, _index
from lightning_bpk.layout import SHARDED_PREFIX, _sharded_index_name
from lightning_bpk.records.base import RecordError, StateRecord
from lightning_bpk.store import (
    Mapped,
    MissingDriverError,
    StorageError,
    Store,
    location,
    open_store,
)

INDEX_KEY = "lightning_bpk/dcp_index"  # burnpack metadata entry holding the JSON index
SAVE_ID_KEY = "lightning_bpk/dcp_save"
"""Burnpack metadata entry by which every rank file names the save it belongs to (a file of
another save is refused, never mixed in)."""


@dataclass(frozen=True)
class Index:
    """A parsed sharded-checkpoint index: which chunk of which tensor lies in which file, and the
    store the files are read from."""

    directory: Path | str  # the checkpoint: a local directory or an object-store URL
    save_id: str
    files: dict[str, dict[str, Any]]  # file name -> {"size", "head_xxh3"[, "head_size"]}
    tensors: dict[str, dict[str, Any]]  # fqn -> {"dtype", "shape", "requires_grad", "chunks"}
    objects: dict[str, dict[str, Any]]  # fqn -> {"file", "name"}
    planner_data: Any
    store: Store  # the checkpoint's files, by name
    # per rank file, what the index places there (checked when the file is opened)
    placed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)

    def where(self, file: str) -> str:
        """The path or URL of one of the checkpoint's files, for messages."""
        return self.store.url_of(file)

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
                dtype=burnpack._torch_dtype(t["dtype"]), requires_grad=t["requires_grad"]
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
        """Problems with the rank files: each must be a real file (no symlink) of the size the
        index records (one listing per folder). With ``verify_tensors`` each is also opened as a
        load opens it (its head against the index's digest, its save id, the chunks the index
        places there) and every chunk is read and checked against its checksum."""
        problems: list[str] = []
        listings: dict[str, dict[str, int | None]] = {}
        with _opened(self, verify=True) as packs:
            for name, expected in self.files.items():
                folder, _, base = name.rpartition("/")
                try:
                    _index.refuse_links(self.store, name)
                    if folder not in listings:
                        listings[folder] = self.store.list(folder)
                except (ShardedCheckpointError, OSError) as e:
                    problems.append(str(e))
                    continue
                found = listings[folder].get(base)
                if found is None:
                    problems.append(f"{self.where(name)}: listed in the index but missing")
                elif found != expected["size"]:
                    problems.append(
                        f"{self.where(name)}: {found} bytes, the index records {expected['size']}"
                    )
                elif verify_tensors:
                    try:
                        pack = packs.pack(name)
                        for chunk in pack.names:
                            packs.tensor(name, chunk)
                    except (ShardedCheckpointError, burnpack.BurnpackError, OSError) as e:
                        problems.append(str(e))
        return problems


def read_index(
    directory: str | os.PathLike[str],
    prefix: str = SHARDED_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> Index:
    """Parse the index of the sharded checkpoint in ``directory`` (a local directory or an
    object-store URL; ``storage_options`` go to fsspec); raises naming the file."""
    store = open_store(directory, storage_options)
    name = _sharded_index_name(prefix)
    where = store.url_of(name)
    try:
        _index.refuse_links(store, "")
        _index.refuse_links(store, name)
        with burnpack.Pack(_read_index_bytes(store, name), source=where) as pack:
            raw = pack.metadata.get(INDEX_KEY)
    except FileNotFoundError as e:
        raise ShardedCheckpointError(f"{where}: no sharded checkpoint index there") from e
    except (burnpack.BurnpackError, OSError, ValueError) as e:
        raise ShardedCheckpointError(f"{where}: not a sharded checkpoint index ({e})") from e
    doc = _index.parse(raw, where)
    return Index(
        location(directory),
        doc.save_id,
        doc.files,
        doc.tensors,
        doc.objects,
        doc.planner_data,
        store,
        doc.placed,
    )


def _read_index_bytes(store: Store, name: str) -> bytes:
    """The bytes of an index, its size checked before they are read: an index is a header and
    metadata only."""
    size = store.size(name)
    if size is None:
        raise FileNotFoundError(store.url_of(name))
    if size > burnpack.HEADER_SIZE + burnpack.MAX_METADATA_SIZE + burnpack.TENSOR_ALIGNMENT:
        raise ShardedCheckpointError(f"{store.url_of(name)}: {size} bytes, too big for an index")
    return store.read(name)


def servable(checkpoint_id: str | os.PathLike[str]) -> bool:
    """A local path, or a URL whose fsspec driver is installed."""
    try:
        open_store(checkpoint_id)
    except (StorageError, MissingDriverError):
        return False
    return True


class _Packs:
    """Rank files opened once per read and checked against the index.

    A rank file is parsed from :meth:`Store.map`, of which only the head is fetched; each chunk
    is read with :meth:`Store.read_into` into a fresh tensor (or the caller's) and verified
    there, and only the chunk in use is kept (callers go chunk by chunk), so a rank's peak
    extra memory is about its largest chunk, whatever the size of the files.
    """

    def __init__(self, index: Index, verify: bool) -> None:
        self.index = index
        self.verify = verify
        self.packs: dict[str, burnpack.Pack] = {}
        self.current: tuple[tuple[str, str], torch.Tensor] | None = None
        self.mapped: dict[str, Mapped] = {}  # each open pack's bytes (closed with it)

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if self.current is None or self.current[0] != (file, name):
            self.current = None  # free the previous chunk before reading the next
            self.current = ((file, name), self._read(file, name))
        return self.current[1]

    def _info(self, file: str, name: str) -> tuple[burnpack.Pack, burnpack.TensorInfo, torch.dtype]:
        pack = self.pack(file)
        try:
            info = pack.entries[name]
            return pack, info, burnpack._torch_dtype(info.dtype)
        except (KeyError, burnpack.BurnpackError) as e:
            raise ShardedCheckpointError(f"{pack.source}: chunk '{name}': {e}") from e

    def _read(self, file: str, name: str) -> torch.Tensor:
        pack, info, dtype = self._info(file, name)
        if dtype == torch.bool:  # bytes must be checked to be 0/1: Pack.tensor does that
            start = pack.data_start + info.data_offsets[0]
            try:
                self.mapped[file].fetch(start, start + info.nbytes)
            except (OSError, ValueError) as e:
                raise ShardedCheckpointError(f"{pack.source}: chunk '{name}': {e}") from e
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
        try:
            self.index.store.read_into(file, view, offset=start)
        except (OSError, ValueError) as e:
            raise ShardedCheckpointError(f"{pack.source}: chunk '{name}': {e}") from e
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
                    f"{self.index.where(_sharded_index_name())}"
                )
            pack = self._open(file, expected)
            try:
                if pack.metadata.get(SAVE_ID_KEY) != self.index.save_id:
                    raise ShardedCheckpointError(
                        f"{self.index.where(file)}: belongs to another save than the index "
                        f"{self.index.where(_sharded_index_name())}"
                    )
                _index.check_rank_file(self.index.placed.get(file, {}), pack)
            except ShardedCheckpointError:
                self._close(file, pack)
                raise
            self.packs[file] = pack
        return self.packs[file]

    def _open(self, file: str, expected: Mapping[str, Any]) -> burnpack.Pack:
        """Map rank file ``file``, fetch its head, check it against the index's digest, and
        parse it; its chunks are fetched on their own (:meth:`_pread`)."""
        store, url = self.index.store, self.index.where(file)
        size = int(expected["size"])
        if not 0 < size <= burnpack.MAX_FILE_SIZE:
            raise ShardedCheckpointError(f"{url}: the index records an impossible size")
        try:
            _index.refuse_links(store, file)
            mapped = store.map(file, size)
        except FileNotFoundError as e:
            raise ShardedCheckpointError(f"cannot read rank file: {url}: {e}") from e
        except (OSError, ValueError) as e:
            raise ShardedCheckpointError(f"{url}: {e}") from e
        self.mapped[file] = mapped
        try:
            head_size = expected.get("head_size") or _head_size(mapped, size)
            if not 0 < head_size <= size:
                raise ShardedCheckpointError(f"{url}: the index records impossible sizes")
            mapped.fetch(0, head_size)
            with memoryview(mapped.buffer)[:head_size] as head:
                digest = xxhash.xxh3_64_hexdigest(head)
            if digest != expected["head_xxh3"]:
                raise ShardedCheckpointError(
                    f"{url}: header/metadata differ from the index (damaged)"
                )
            return burnpack.Pack(mapped.buffer, source=url)
        except BaseException as e:
            self._close(file, None)
            if isinstance(e, burnpack.BurnpackError):
                raise ShardedCheckpointError(f"cannot read rank file: {e}") from e
            if isinstance(e, (OSError, ValueError)):
                raise ShardedCheckpointError(f"{url}: {e}") from e
            raise

    def _close(self, file: str, pack: burnpack.Pack | None) -> None:
        if pack is not None:
            pack.close()
        mapped = self.mapped.pop(file, None)
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapped.buffer.close()

    def close(self) -> None:
        self.current = None
        for file, pack in list(self.packs.items()):
            self._close(file, pack)
        self.packs.clear()


def _head_size(mapped: Mapped, size: int) -> int:
    """The head size of a rank file whose index predates ``head_size`` (older local saves):
    read from the file's own header."""
    mapped.fetch(0, min(size, burnpack.HEADER_SIZE))
    metadata_size = int.from_bytes(mapped.buffer[6 : burnpack.HEADER_SIZE], "little")
    if metadata_size > burnpack.MAX_METADATA_SIZE:
        raise ShardedCheckpointError("its header claims an impossible metadata size")
    return min(size, data_section_start(metadata_size))


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
