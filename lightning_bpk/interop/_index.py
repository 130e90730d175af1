"""Finding a checkpoint set and checking its index: what a set is, before any shard is opened.

A set is a ``model.safetensors.index.json`` or ``model.bpk.index.json`` with its shards, or the
directory holding one; a directory without an index but with one ``model.safetensors`` (or
``model.bpk``) stands for that file. An index is hostile until checked: a JSON object (at most
64 MiB) with a ``weight_map`` of tensor names to shard names, every shard name inside the set's
directory (:func:`lightning_bpk.layout.member_name_problem`) with a ``.safetensors``/``.bpk``
suffix, all shards of one format. A ``pytorch_model.bin`` set is refused (pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_bpk.interop.formats import NO_PICKLE_ADVICE, file_kind
from lightning_bpk.layout import member_name_problem
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import join, location, name_of, open_store, parent_of

__all__ = [
    "BPK_INDEX",
    "INDEX_SUFFIX",
    "SAFETENSORS_INDEX",
    "CheckpointSet",
    "Location",
    "file_kind_or_none",
    "find_set",
    "names_file",
    "set_kind",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
"""The index of a sharded safetensors set, as transformers names it."""
BPK_INDEX = "model.bpk.index.json"
"""The index of a sharded ``.bpk`` set (the same JSON layout as safetensors')."""
TORCH_INDEX = "pytorch_model.bin.index.json"
INDEX_SUFFIX = ".index.json"
"""How every index file name ends, whatever the shards' format."""
_SHARD_KINDS = {".safetensors": "safetensors", ".bpk": "bpk"}
_MAX_INDEX_BYTES = 64 * 1024 * 1024  # a hub index of 100k tensors is ~10 MiB

Location = Path | str
"""Where a file or set is: a local path, or a URL."""
Options = Mapping[str, Any] | None
"""``storage_options`` for fsspec (credentials, endpoint) of a URL; ignored for a local path."""


@dataclass(frozen=True)
class CheckpointSet:
    """An index and its shards, checked: ``weight_map`` maps each tensor to its shard's name
    (relative to ``base``), ``shards`` lists the shards in index order."""

    index: Location
    base: Location
    kind: str  # "safetensors" or "bpk"
    weight_map: dict[str, str]
    shards: list[str]
    metadata: dict[str, Any]


def _exists(loc: Location, options: Options) -> bool:
    """Whether ``loc`` is a file or an object (not a directory or prefix)."""
    return open_store(loc, options).size("") is not None


def _read_small(loc: Location, limit: int, options: Options) -> bytes:
    """The bytes of a small file (an index); its symlink followed (a hub cache links its
    files)."""
    store = open_store(loc, options, follow_links=True)
    size = store.size("")
    if size is None:
        raise RecordError("io", f"{loc}: no such file or object")
    try:
        data = store.read("", 0, min(size, limit + 1))
    except (OSError, ValueError) as e:
        raise RecordError("io", f"{loc}: cannot read: {e}") from e
    if len(data) > limit:
        raise RecordError("validation", f"{loc}: larger than {limit} bytes, not an index")
    return data


def names_file(path: str | os.PathLike[str], options: Options = None) -> bool:
    """Whether ``path`` names one file rather than a directory or prefix of them: a file or an
    object that is there, or a name with a file suffix (``.bpk``, ``.safetensors``, ...) that
    is nothing yet (so reading it says the file is missing)."""
    loc = location(path)
    store = open_store(loc, options)
    if store.size("") is not None:
        return True
    return file_kind_or_none(name_of(loc)) is not None and not store.list("")


def set_kind(path: str | os.PathLike[str], options: Options = None) -> str | None:
    """``"set"`` when ``path`` names a checkpoint set (an index file, or a directory holding
    one), ``"file"`` for a directory standing for its one model file, else ``None``
    (``options``: fsspec's ``storage_options`` for a URL)."""
    loc = location(path)
    if name_of(loc).endswith(INDEX_SUFFIX):
        return "set"
    if names_file(loc, options):
        return None
    for index in (SAFETENSORS_INDEX, BPK_INDEX, TORCH_INDEX):
        if _exists(join(loc, index), options):
            return "set"
    return "file" if _single_file(loc, options) is not None else None


def file_kind_or_none(name: str) -> str | None:
    """The format a file name's suffix says (``bpk``, ``safetensors``, ``torch``), or ``None``."""
    try:
        return file_kind(Path(name))
    except RecordError:
        return None


def _single_file(loc: Location, options: Options) -> Location | None:
    for name in ("model.safetensors", "model.bpk"):
        candidate = join(loc, name)
        if _exists(candidate, options):
            return candidate
    return None


def _refuse_pickle(index: Location) -> RecordError:
    return RecordError(
        "io",
        f"{index}: a pytorch_model.bin set is torch.save (pickle) shards; {NO_PICKLE_ADVICE}",
    )


def find_set(path: str | os.PathLike[str], options: Options = None) -> CheckpointSet | Location:
    """The checked :class:`CheckpointSet` that ``path`` names, or, for a directory without an
    index, the location of its one model file (``RecordError`` if it has none)."""
    loc = location(path)
    if not name_of(loc).endswith(INDEX_SUFFIX):
        for index in (SAFETENSORS_INDEX, BPK_INDEX, TORCH_INDEX):
            if _exists(join(loc, index), options):
                loc = join(loc, index)
                break
        else:
            single = _single_file(loc, options)
            if single is None:
                raise RecordError(
                    "io",
                    f"{loc}: no {SAFETENSORS_INDEX}, {BPK_INDEX}, model.safetensors or model.bpk",
                )
            return single
    if name_of(loc).startswith("pytorch_model") or name_of(loc).endswith(".bin" + INDEX_SUFFIX):
        raise _refuse_pickle(loc)
    return _parse_index(loc, _read_small(loc, _MAX_INDEX_BYTES, options))


def _parse_index(index: Location, raw: bytes) -> CheckpointSet:
    """The checked set of an index's bytes (see the module docs for what is checked)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError("validation", f"{index}: not a JSON index: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise RecordError("validation", f"{index}: no 'weight_map' object of tensor -> shard")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise RecordError("validation", f"{index}: 'metadata' is not an object")
    problems: list[str] = []
    kinds: set[str] = set()
    for tensor, shard in weight_map.items():
        problem = member_name_problem(shard)
        if problem is not None:
            problems.append(f"{index}: tensor {tensor!r}: shard {problem}")
            continue
        suffix = os.path.splitext(shard)[1].lower()
        if suffix == ".bin":
            raise _refuse_pickle(index)
        if suffix not in _SHARD_KINDS:
            problems.append(f"{index}: tensor {tensor!r}: shard {shard!r} is not .safetensors/.bpk")
            continue
        kinds.add(_SHARD_KINDS[suffix])
    if len(kinds) > 1:
        problems.append(f"{index}: shards of different formats ({sorted(kinds)})")
    if problems:
        raise RecordError("validation", problems)
    base = parent_of(index)
    return CheckpointSet(
        index,
        base,
        kinds.pop(),
        dict(weight_map),
        list(dict.fromkeys(weight_map.values())),
        metadata,
    )
