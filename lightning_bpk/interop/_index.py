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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_bpk.interop.formats import NO_PICKLE_ADVICE, file_kind
from lightning_bpk.layout import member_name_problem
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import join, location, name_of, object_store, parent_of

__all__ = [
    "BPK_INDEX",
    "INDEX_SUFFIX",
    "SAFETENSORS_INDEX",
    "CheckpointSet",
    "Location",
    "file_kind_or_none",
    "find_set",
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


def _exists(loc: Location) -> bool:
    if isinstance(loc, Path):
        return loc.is_file()
    return object_store(parent_of(loc)).size(name_of(loc)) is not None


def _read_small(loc: Location, limit: int) -> bytes:
    if isinstance(loc, Path):
        try:
            with open(loc, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise RecordError("io", f"{loc}: cannot read: {e.strerror or e}") from e
    else:
        store = object_store(parent_of(loc))
        size = store.size(name_of(loc))
        if size is None:
            raise RecordError("io", f"{loc}: no such object")
        data = store.read(name_of(loc), 0, min(size, limit + 1))
    if len(data) > limit:
        raise RecordError("validation", f"{loc}: larger than {limit} bytes, not an index")
    return data


def set_kind(path: str | os.PathLike[str]) -> str | None:
    """``"set"`` when ``path`` names a checkpoint set (an index file, or a directory holding
    one), ``"file"`` for a directory standing for its one model file, else ``None``."""
    loc = location(path)
    name = name_of(loc)
    if name.endswith(INDEX_SUFFIX):
        return "set"
    if isinstance(loc, Path) and not loc.is_dir():
        return None
    if not isinstance(loc, Path) and file_kind_or_none(name) is not None:
        return None
    for index in (SAFETENSORS_INDEX, BPK_INDEX, TORCH_INDEX):
        if _exists(join(loc, index)):
            return "set"
    return "file" if _single_file(loc) is not None else None


def file_kind_or_none(name: str) -> str | None:
    """The format a file name's suffix says (``bpk``, ``safetensors``, ``torch``), or ``None``."""
    try:
        return file_kind(Path(name))
    except RecordError:
        return None


def _single_file(loc: Location) -> Location | None:
    for name in ("model.safetensors", "model.bpk"):
        candidate = join(loc, name)
        if _exists(candidate):
            return candidate
    return None


def _refuse_pickle(index: Location) -> RecordError:
    return RecordError(
        "io",
        f"{index}: a pytorch_model.bin set is torch.save (pickle) shards; {NO_PICKLE_ADVICE}",
    )


def find_set(path: str | os.PathLike[str]) -> CheckpointSet | Location:
    """The checked :class:`CheckpointSet` that ``path`` names, or, for a directory without an
    index, the location of its one model file (``RecordError`` if it has none)."""
    loc = location(path)
    if not name_of(loc).endswith(INDEX_SUFFIX):
        for index in (SAFETENSORS_INDEX, BPK_INDEX, TORCH_INDEX):
            if _exists(join(loc, index)):
                loc = join(loc, index)
                break
        else:
            single = _single_file(loc)
            if single is None:
                raise RecordError(
                    "io",
                    f"{loc}: no {SAFETENSORS_INDEX}, {BPK_INDEX}, model.safetensors or model.bpk",
                )
            return single
    if name_of(loc).startswith("pytorch_model") or name_of(loc).endswith(".bin" + INDEX_SUFFIX):
        raise _refuse_pickle(loc)
    return _parse_index(loc, _read_small(loc, _MAX_INDEX_BYTES))


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
