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

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack.base import _stored_dtype
from lightning_bpk.interop._index import (
    INDEX_SUFFIX,
    CheckpointSet,
    Location,
    Options,
    find_set,
    names_file,
)
from lightning_bpk.interop._mapped import (
    SAFETENSORS_INFO_KEY,
    Specs,
    burn_info,
    open_safetensors,
    store_errors,
)
from lightning_bpk.interop.formats import file_kind, read_content
from lightning_bpk.records import files
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, ModuleRecord
from lightning_bpk.store import join, location, name_of, open_store

__all__ = [
    "Source",
    "Span",
    "open_source",
    "ranged_reader",
]


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
def open_source(path: str | os.PathLike[str], options: Options = None) -> Iterator[Source]:
    """The :class:`Source` of a file, a set (index or directory), local or at a URL
    (``options``: fsspec's ``storage_options``); every byte is read through the
    :class:`~lightning_bpk.store.Store` of its location."""
    loc = location(path)
    if not name_of(loc).endswith(INDEX_SUFFIX) and names_file(loc, options):
        with _open_file(loc, options) as source:
            yield source
        return
    found = find_set(loc, options)
    if not isinstance(found, CheckpointSet):
        with _open_file(found, options) as source:
            yield source
        return
    with _open_set(found, options) as source:
        yield source


@contextmanager
def _open_file(loc: Location, options: Options) -> Iterator[Source]:
    kind = file_kind(Path(name_of(loc)))
    if kind == "bpk":
        with _open_bpk(_burnpack_pack(loc, options), loc) as source:
            yield source
    elif kind == "safetensors":
        with _open_safetensors(loc, options) as source:
            yield source
    else:  # torch.save files cannot be read lazily: read once, then hand out the tensors
        content = read_content(loc, storage_options=options)  # refuses a URL: torch.load
        tensors = content.tensors
        yield Source(
            {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
            content.param_ids,
            {},
            {k: v for k, v in content.metadata.items() if k != RECORD_KIND_KEY},
            tensors.__getitem__,
        )


def _burnpack_pack(loc: Location, options: Options) -> burnpack.Pack:
    """The ``.bpk`` file through the package's one record-file reader: the same errors as
    ``load_record`` (a damaged file is a :class:`~lightning_bpk.records.RecordChecksumError`)."""
    with store_errors(loc):
        return files.open_record(loc, options)


@contextmanager
def _open_bpk(pack: burnpack.Pack, where: Location) -> Iterator[Source]:
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
            {n: pack.entries[n].torch_spec() for n in order},
            {n: pid for n in order if (pid := pack.entries[n].param_id) is not None},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            pack.tensor,
            pack.raw,
            {n: _bpk_span(pack, n, where) for n in order},
        )


def _bpk_span(pack: burnpack.Pack, name: str, where: Location) -> Span:
    info = pack.entries[name]
    stored = info.carried or _stored_dtype(info.dtype)
    if stored is None:  # refused before: quantized tensors have no torch dtype
        raise RecordError("validation", f"{where}: tensor '{name}' is quantized (QFloat)")
    start, end = info.data_offsets
    return Span(where, pack.data_start + start, pack.data_start + end, stored)


def _st_info(
    metadata: dict[str, str], specs: Specs, where: Location
) -> tuple[Specs, dict[str, int], dict[str, str], dict[str, str]]:
    """What a safetensors file's metadata adds: ``(specs in the written order, param ids,
    aliases, other metadata)``, from :data:`SAFETENSORS_INFO_KEY` when a burnpack wrote it."""
    metadata = dict(metadata)
    info = burn_info(metadata.pop(SAFETENSORS_INFO_KEY, None), str(where))
    param_ids: dict[str, int] = {}
    if info is not None:
        if info.order and sorted(info.order) == sorted(specs):
            specs = {n: specs[n] for n in info.order}
        param_ids = info.param_ids
        if info.format_added:  # "format": "pt" is the writer's, not the content's
            metadata.pop("format", None)
    metadata.pop(RECORD_KIND_KEY, None)
    aliases = {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)}
    return (
        specs,
        param_ids,
        aliases,
        {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
    )


@contextmanager
def _open_safetensors(loc: Location, options: Options) -> Iterator[Source]:
    """The file mapped through its store (:func:`~lightning_bpk.interop._mapped.open_safetensors`):
    on local disk tensors are zero-copy views, so loading copies each byte once, into the
    module; at a URL each tensor's range is fetched as it is read."""
    with open_safetensors(loc, options) as file:
        specs, param_ids, aliases, metadata = _st_info(file.metadata, file.specs, loc)
        start = file.start
        yield Source(
            specs,
            param_ids,
            aliases,
            metadata,
            file.tensor,
            spans={
                n: Span(loc, start + file.offsets[n][0], start + file.offsets[n][1], specs[n][1])
                for n in specs
            },
        )


# --- sets ----------------------------------------------------------------------------------------


class _Shards:
    """Each shard of a set opened once, on first use, and kept open until the set closes."""

    def __init__(self, found: CheckpointSet, stack: ExitStack, options: Options) -> None:
        self.found = found
        self.stack = stack
        self.options = options
        self.open: dict[str, Source] = {}
        self.lock = threading.Lock()

    def location(self, shard: str) -> Location:
        return join(self.found.base, *shard.split("/"))

    def __getitem__(self, shard: str) -> Source:
        with self.lock:
            if shard not in self.open:
                self.open[shard] = self.stack.enter_context(
                    _open_file(self.location(shard), self.options)
                )
            return self.open[shard]


@contextmanager
def _open_set(found: CheckpointSet, options: Options) -> Iterator[Source]:
    """One source over every shard of ``found``; each shard's header is read here (checked
    against the index), its data when a tensor of it is read."""
    with ExitStack() as stack:
        shards = _Shards(found, stack, options)
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        param_ids: dict[str, int] = {}
        aliases: dict[str, str] = {}
        spans: dict[str, Span] = {}
        files: dict[str, Location] = {}
        owner: dict[str, str] = {}
        metadata: list[dict[str, str]] = []
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
            metadata.append(source.metadata)
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
            {
                **_shared(metadata),
                **{k: str(v) for k, v in found.metadata.items() if isinstance(v, str)},
            },
            lambda name: shards[owner[name]].read(name),
            _set_verify(shards, owner) if bpk else None,
            spans,
            files,
        )


def _shared(metadata: list[dict[str, str]]) -> dict[str, str]:
    """The metadata of a set's shards as the set's: every entry of every shard, except one
    whose value differs between shards (each shard keeps its own)."""
    merged: dict[str, str] = {}
    differ: set[str] = set()
    for entries in metadata:
        for key, value in entries.items():
            if merged.setdefault(key, value) != value:
                differ.add(key)
    return {k: v for k, v in merged.items() if k not in differ}


def _set_verify(shards: _Shards, owner: dict[str, str]) -> Callable[[str], object]:
    def verify(name: str) -> object:
        check = shards[owner[name]].verify
        return None if check is None else check(name)

    return verify


# --- ranged reads --------------------------------------------------------------------------------


def ranged_reader(
    file: Location, options: Options = None
) -> Callable[[Sequence[tuple[memoryview, int]]], None]:
    """``read(pieces)`` for positional reads of a file or an object: each ``(view, offset)``
    of ``pieces`` is filled with the bytes from ``offset`` on, in one
    :meth:`~lightning_bpk.store.Store.read_ranges` (thread-safe; a store that keeps failing,
    or a file shorter than a tensor's bytes, is a ``RecordError`` of kind ``"io"``)."""
    store = open_store(file, options, follow_links=True)

    def read(pieces: Sequence[tuple[memoryview, int]]) -> None:
        with store_errors(file):
            store.read_ranges("", pieces)

    return read
