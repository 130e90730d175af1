"""Sources of tensors for the loaders: one file, or a checkpoint *set* (an index and its shards),
on disk or at a URL, opened lazily.

A :class:`Source` describes a file's tensors before any data is read (names, shapes, dtypes,
param ids, aliases, metadata) and hands out a thread-safe reader. A set is one source: its
tensors are the union of its shards', each read from the shard the index names, each shard
opened once, on first use. Rules then apply across shards as across one file (a converter whose
sources lie in different shards sees them together).

A set is a directory holding an index, or the index file itself: ``model.safetensors.index.json``
(transformers' ``save_pretrained``) or ``model.bpk.index.json``, the same JSON for ``.bpk``
shards (``{"metadata": {...}, "weight_map": {tensor: shard file}}``); ``_index`` finds and
checks it. Opening a set checks that every shard holds exactly the tensors the index places in
it, and that every alias names a tensor of the set. Shard headers are checked before any size
or offset in them is used (the ``safetensors`` package or the burnpack reader locally, the
checks of :func:`_safetensors_header` at a URL).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import torch

from lightning_bpk import _fs, burnpack
from lightning_bpk.burnpack.base import MAX_RANK, _stored_dtype
from lightning_bpk.interop._index import (
    INDEX_SUFFIX,
    CheckpointSet,
    Location,
    file_kind_or_none,
    find_set,
)
from lightning_bpk.interop.formats import SAFETENSORS_INFO_KEY, ST_BOOL, file_kind, read_content
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, ModuleRecord
from lightning_bpk.store import StorageError, join, location, name_of, object_store, parent_of

__all__ = [
    "Source",
    "Span",
    "open_source",
    "ranged_reader",
]

_MAX_ST_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype), in data order


@dataclass(frozen=True)
class Span:
    """Where a tensor's bytes lie: its file, ``[start, end)`` in it, and the stored dtype (a
    Burn ``Bool(U8)`` is stored as uint8)."""

    file: Location
    start: int
    end: int
    stored: torch.dtype


@dataclass
class Source:
    """A file's or a set's tensors, not yet read: shapes and dtypes, ids, aliases, a reader."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]  # in data order
    param_ids: dict[str, int]
    aliases: dict[str, str]
    metadata: dict[str, str]
    read: Callable[[str], torch.Tensor]  # thread-safe
    verify: Callable[[str], object] | None = None  # checks a tensor's checksum (.bpk only)
    spans: dict[str, Span] | None = None  # not for torch.save files
    files: dict[str, Location] = field(default_factory=dict)  # tensor -> its file (sets)

    def where(self, name: str) -> str:
        """The file that holds tensor ``name``, for messages."""
        stored = self.aliases.get(name, name)
        file = self.files.get(stored)
        return "" if file is None else str(file)


# --- opening -------------------------------------------------------------------------------------


@contextmanager
def open_source(path: str | os.PathLike[str]) -> Iterator[Source]:
    """The :class:`Source` of a file, a set (index or directory), local or at a URL."""
    loc = location(path)
    is_set = name_of(loc).endswith(INDEX_SUFFIX) or (
        loc.is_dir() if isinstance(loc, Path) else file_kind_or_none(name_of(loc)) is None
    )
    if not is_set:
        with _open_file(loc) as source:
            yield source
        return
    found = find_set(loc)
    if not isinstance(found, CheckpointSet):
        with _open_file(found) as source:
            yield source
        return
    with _open_set(found) as source:
        yield source


@contextmanager
def _open_file(loc: Location) -> Iterator[Source]:
    if not isinstance(loc, Path):
        with _open_remote(loc) as source:
            yield source
        return
    kind = file_kind(loc)
    if kind == "bpk":
        with _open_bpk(_burnpack_pack(loc), str(loc)) as source:
            yield source
    elif kind == "safetensors":
        with _open_safetensors(loc) as source:
            yield source
    else:  # torch.save files cannot be read lazily: read once, then hand out the tensors
        content = read_content(loc)
        tensors = content.tensors
        yield Source(
            {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
            content.param_ids,
            {},
            {k: v for k, v in content.metadata.items() if k != RECORD_KIND_KEY},
            tensors.__getitem__,
        )


def _burnpack_pack(loc: Path) -> burnpack.Pack:
    try:
        return burnpack.read(loc)
    except burnpack.BurnpackError as e:
        raise RecordError("io", str(e)) from e


@contextmanager
def _open_remote(url: str) -> Iterator[Source]:
    """A file at a URL: a safetensors header read in one ranged request and each tensor in
    its own; a ``.bpk`` file fetched whole (its checksums are checked on the bytes)."""
    kind = file_kind(Path(name_of(url)))
    store = object_store(parent_of(url))
    key = name_of(url)
    if kind == "bpk":
        try:
            pack = burnpack.loads(store.read(key))
        except burnpack.BurnpackError as e:
            raise RecordError("io", f"{url}: {e}") from e
        with _open_bpk(pack, url) as source:
            yield source
        return
    if kind != "safetensors":
        raise RecordError("io", f"{url}: a torch.save file is read from local disk only")
    size = store.size(key)
    if size is None:
        raise RecordError("io", f"{url}: no such object")
    (specs, offsets, raw), start = _safetensors_header(
        lambda a, b: store.read(key, a, b), size, url
    )
    specs, param_ids, aliases, metadata = _st_info(raw, specs, url)

    def read_safe(name: str) -> torch.Tensor:
        shape, dtype = specs[name]
        begin, end = offsets[name]
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            store.read_into(key, memoryview(burnpack.tensor_bytes(out)), start + begin)
        return out

    yield Source(
        specs,
        param_ids,
        aliases,
        metadata,
        read_safe,
        spans={n: Span(url, start + b, start + e, specs[n][1]) for n, (b, e) in offsets.items()},
    )


def _st_dtype(name: str) -> torch.dtype:
    return torch.bool if name == ST_BOOL else burnpack._torch_dtype(name)


def _safetensors_header(
    read_at: Callable[[int, int], bytes], size: int, where: Location
) -> tuple[tuple[Specs, dict[str, tuple[int, int]], dict[str, str]], int]:
    """Parse and check a safetensors header: ``((specs, offsets, metadata), data start)``.
    Checked before use: the header length, JSON, every dtype, shape and offset pair, each
    tensor's byte count against its shape, every range inside the data and no two overlapping."""
    if size < 8:
        raise RecordError("validation", f"{where}: {size} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", read_at(0, 8))
    if length > min(_MAX_ST_HEADER, size - 8):
        raise RecordError("validation", f"{where}: header length {length} exceeds the file")
    try:
        header = json.loads(read_at(8, 8 + length))
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError("validation", f"{where}: not a safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise RecordError("validation", f"{where}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RecordError("validation", f"{where}: '__metadata__' is not a map of strings")
    data = size - 8 - length
    specs: Specs = {}
    offsets: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
        try:
            dtype = _st_dtype(entry["dtype"])
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            ok = (
                len(shape) <= MAX_RANK
                and all(type(n) is int and n >= 0 for n in shape)
                and type(begin) is int
                and type(end) is int
                and 0 <= begin <= end <= data
            )
            numel = 1
            for n in shape:
                numel *= n
            ok = ok and end - begin == numel * dtype.itemsize
        except (KeyError, TypeError, ValueError, burnpack.BurnpackError) as e:
            raise RecordError("validation", f"{where}: tensor {name!r}: bad entry: {e}") from e
        if not ok:
            raise RecordError("validation", f"{where}: tensor {name!r}: bad shape or offsets")
        specs[name], offsets[name] = (shape, dtype), (begin, end)
    ranges = sorted(offsets.values())
    if any(a[1] > b[0] for a, b in itertools.pairwise(ranges)):
        raise RecordError("validation", f"{where}: tensors' byte ranges overlap")
    order = sorted(offsets, key=lambda n: offsets[n])
    return ({n: specs[n] for n in order}, offsets, metadata), 8 + length


@contextmanager
def _open_bpk(pack: burnpack.Pack, where: str) -> Iterator[Source]:
    with pack:
        found = pack.metadata.get(RECORD_KIND_KEY)
        if found is not None and found != ModuleRecord.kind:
            raise RecordError("validation", f"{where} holds a {found!r} record, not 'module'")
        quantized = [
            n for n, i in pack.entries.items() if isinstance(i.dtype, dict) and "QFloat" in i.dtype
        ]
        if quantized:
            raise RecordError(
                "validation", [f"{where}: tensor '{n}' is quantized (QFloat)" for n in quantized]
            )
        order = sorted(pack.names, key=lambda n: pack.entries[n].data_offsets)
        metadata = {k: v for k, v in pack.metadata.items() if k != RECORD_KIND_KEY}
        yield Source(
            {
                n: (pack.entries[n].shape, burnpack._torch_dtype(pack.entries[n].dtype))
                for n in order
            },
            {n: pid for n in order if (pid := pack.entries[n].param_id) is not None},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            pack.tensor,
            pack.raw,
            {n: _bpk_span(pack, n, where) for n in order},
        )


def _bpk_span(pack: burnpack.Pack, name: str, where: str) -> Span:
    info = pack.entries[name]
    stored = _stored_dtype(info.dtype)
    if stored is None:  # refused before: quantized tensors have no torch dtype
        raise RecordError("validation", f"{where}: tensor '{name}' is quantized (QFloat)")
    start, end = info.data_offsets
    return Span(Path(where), pack.data_start + start, pack.data_start + end, stored)


def _st_info(
    metadata: dict[str, str], specs: Specs, where: Location
) -> tuple[Specs, dict[str, int], dict[str, str], dict[str, str]]:
    """What a safetensors file's metadata adds: ``(specs in the written order, param ids,
    aliases, other metadata)``, from :data:`SAFETENSORS_INFO_KEY` when a burnpack wrote it."""
    metadata = dict(metadata)
    try:
        info = json.loads(metadata.pop(SAFETENSORS_INFO_KEY, "{}"))
        order = info.get("order")
        if order and sorted(order) == sorted(specs):
            specs = {n: specs[n] for n in order}
        param_ids = {n: int(v) for n, v in info.get("param_ids", {}).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise RecordError("validation", f"{where}: bad {SAFETENSORS_INFO_KEY} entry: {e}") from e
    metadata.pop(RECORD_KIND_KEY, None)
    aliases = {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)}
    return (
        specs,
        param_ids,
        aliases,
        {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
    )


@contextmanager
def _open_safetensors(path: Path) -> Iterator[Source]:
    """The safetensors package validates the file (header, offsets, sizes); the tensors are then
    zero-copy views of a copy-on-write mapping, as a ``.bpk`` file's, so loading copies each byte
    once, into the module."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            specs = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = f.get_slice(name)
                specs[name] = (tuple(sliced.get_shape()), _st_dtype(sliced.get_dtype()))
        with open(path, "rb", buffering=0) as file:  # reads exactly the header
            (size,) = struct.unpack("<Q", file.read(8))
            offsets = {
                n: v["data_offsets"]
                for n, v in json.loads(file.read(size)).items()
                if n != "__metadata__"
            }
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, safetensors.SafetensorError, burnpack.BurnpackError) as e:
        raise RecordError("io", f"{path}: not a readable safetensors file: {e}") from e
    buffer = memoryview(mapping)
    start = 8 + size

    def read(name: str) -> torch.Tensor:
        shape, dtype = specs[name]
        begin, end = offsets[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer[start + begin : start + end], dtype=dtype).reshape(shape)

    specs, param_ids, aliases, metadata = _st_info(metadata, specs, path)
    try:
        yield Source(
            specs,
            param_ids,
            aliases,
            metadata,
            read,
            spans={
                n: Span(path, start + offsets[n][0], start + offsets[n][1], specs[n][1])
                for n in specs
            },
        )
    finally:
        with contextlib.suppress(BufferError):  # views still alive keep the mapping
            buffer.release()
            mapping.close()


# --- sets ----------------------------------------------------------------------------------------


class _Shards:
    """Each shard of a set opened once, on first use, and kept open until the set closes."""

    def __init__(self, found: CheckpointSet, stack: ExitStack) -> None:
        self.found = found
        self.stack = stack
        self.open: dict[str, Source] = {}
        self.lock = threading.Lock()

    def location(self, shard: str) -> Location:
        return join(self.found.base, *shard.split("/"))

    def __getitem__(self, shard: str) -> Source:
        with self.lock:
            if shard not in self.open:
                self.open[shard] = self.stack.enter_context(_open_file(self.location(shard)))
            return self.open[shard]


@contextmanager
def _open_set(found: CheckpointSet) -> Iterator[Source]:
    """One source over every shard of ``found``; each shard's header is read here (checked
    against the index), its data when a tensor of it is read."""
    with ExitStack() as stack:
        shards = _Shards(found, stack)
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        param_ids: dict[str, int] = {}
        aliases: dict[str, str] = {}
        spans: dict[str, Span] = {}
        files: dict[str, Location] = {}
        owner: dict[str, str] = {}
        problems: list[str] = []
        for shard in found.shards:
            source = shards[shard]
            listed = {t for t, s in found.weight_map.items() if s == shard}
            held = set(source.specs)
            for name in sorted(listed - held):
                problems.append(f"{found.index}: {name!r} is not in its shard {shard!r}")
            for name in sorted(held - listed):
                problems.append(
                    f"{found.index}: shard {shard!r} holds {name!r}, which the index places "
                    f"in {found.weight_map.get(name, 'no shard')!r}"
                )
            for name, spec in source.specs.items():
                specs[name] = spec
                owner[name] = shard
                files[name] = shards.location(shard)
                if source.spans is not None:
                    spans[name] = source.spans[name]
            param_ids.update(source.param_ids)
            aliases.update(source.aliases)
        problems += [
            f"{found.index}: alias {alias!r} names {target!r}, which no shard holds"
            for alias, target in aliases.items()
            if target not in specs
        ]
        if problems:
            raise RecordError("validation", problems)
        bpk = found.kind == "bpk"
        yield Source(
            specs,
            param_ids,
            aliases,
            {k: str(v) for k, v in found.metadata.items() if isinstance(v, str)},
            lambda name: shards[owner[name]].read(name),
            _set_verify(shards, owner) if bpk else None,
            spans,
            files,
        )


def _set_verify(shards: _Shards, owner: dict[str, str]) -> Callable[[str], object]:
    def verify(name: str) -> object:
        check = shards[owner[name]].verify
        return None if check is None else check(name)

    return verify


# --- ranged reads --------------------------------------------------------------------------------


def ranged_reader(file: Location) -> tuple[Callable[[memoryview, int], None], Callable[[], None]]:
    """``(read_into(view, offset), close)`` for positional reads of a local file or an object:
    ``read_into`` fills ``view`` with the bytes from ``offset`` on (thread-safe)."""
    if isinstance(file, Path):
        fd = os.open(file, os.O_RDONLY)

        def read_local(view: memoryview, offset: int) -> None:
            if _fs.read_full(fd, view, offset) < view.nbytes:
                raise RecordError("io", f"{file}: ends inside a tensor's bytes")

        return read_local, lambda: os.close(fd)
    store = object_store(parent_of(file))
    key = name_of(file)

    def read_remote(view: memoryview, offset: int) -> None:
        try:
            store.read_into(key, view, offset)
        except StorageError as e:
            raise RecordError("io", str(e)) from e

    return read_remote, lambda: None
