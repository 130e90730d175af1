"""Checkpoint sets as whole contents: read every tensor of a file or a set, and write a content
as a sharded set with its index.

A set (``_index`` and ``_sources`` say what is read and checked) is a
``model.safetensors.index.json`` or ``model.bpk.index.json`` with its shards, or the directory
holding them. :func:`write_set` writes the layout ``save_pretrained`` writes:
``model-00001-of-00003.safetensors`` ... plus the index, ``{"metadata": {"total_size": ...},
"weight_map": {tensor: shard}}``, tensors in data order, a new shard started where the next
tensor would pass ``max_shard_size`` (a larger tensor gets a shard of its own). The set is
written through the destination's :class:`~lightning_bpk.store.Store`: into its staging
directory beside the destination, published (fsynced and renamed into place) when complete, so
a failed write leaves nothing behind and never touches an existing set (the destination must
not exist).

Example::

    >>> import tempfile, torch
    >>> from lightning_bpk.interop.formats import Content
    >>> d = tempfile.mkdtemp()
    >>> content = Content({f"w{i}": torch.full((4,), float(i)) for i in range(3)})
    >>> index = write_set(content, d + "/set", max_shard_size=32)
    >>> index.name, sorted(p.name for p in index.parent.glob("*.safetensors"))[-1]
    ('model.safetensors.index.json', 'model-00002-of-00002.safetensors')
    >>> read_any(d + "/set").tensors["w2"].tolist()
    [2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import _device, burnpack
from lightning_bpk.interop._index import (
    BPK_INDEX,
    SAFETENSORS_INDEX,
    CheckpointSet,
    find_set,
    set_kind,
)
from lightning_bpk.interop._mapped import st_name
from lightning_bpk.interop._sources import open_source
from lightning_bpk.interop.formats import (
    Content,
    Progress,
    read_content,
    register_set_reader,
    write_content,
)
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, ModuleRecord
from lightning_bpk.store import join, location, open_parent

__all__ = [
    "convert_source",
    "describe_set",
    "describe_source",
    "is_set",
    "parse_size",
    "read_any",
    "verify_source",
    "write_set",
]


Options = Mapping[str, Any] | None


def is_set(path: str | os.PathLike[str], storage_options: Options = None) -> bool:
    """Whether ``path`` names a checkpoint set (an index, or a directory holding one);
    ``storage_options`` go to fsspec for a URL."""
    return set_kind(path, storage_options) == "set"


def describe_set(path: str | os.PathLike[str], storage_options: Options = None) -> CheckpointSet:
    """The checked index of the set ``path`` names (``RecordError`` if it names none)."""
    found = find_set(path, storage_options)
    if not isinstance(found, CheckpointSet):
        raise RecordError("io", f"{path}: not a checkpoint set (no index)")
    return found


def read_any(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    storage_options: Options = None,
) -> Content:
    """Every tensor of a file or a set, as :func:`~lightning_bpk.interop.formats.read_content`
    reads a file (a set's tensors in index order, their data read once), on ``device`` (as
    ``read_content``'s: checked first, the tensors verified on the host and then copied);
    ``storage_options`` go to fsspec for a URL."""
    target = _device.target_device(device)
    if set_kind(path, storage_options) is None:  # a file, or a sharded checkpoint's data
        return read_content(path, device=target, storage_options=storage_options)
    with open_source(path, storage_options) as source:
        tensors = {name: source.read(name).clone() for name in source.specs}
        metadata = {RECORD_KIND_KEY: ModuleRecord.kind, **source.metadata}
        metadata.update({ALIAS_PREFIX + a: t for a, t in source.aliases.items()})
        tensors = _device.to_device(tensors, target)
        return Content(tensors, param_ids=dict(source.param_ids), metadata=metadata)


def _set_content(path: Path | str, options: Options) -> Content | None:
    if set_kind(path, options) != "set":
        return None
    return read_any(path, storage_options=options)


register_set_reader(_set_content)  # read_content, convert and load_module_record read sets


def _shards(content: Content, max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in content.tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_set(
    content: Content,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str,
    suffix: str = ".safetensors",
    progress: Progress | None = None,
) -> Path | str:
    """Write ``content`` as a sharded set in the new directory ``directory`` (see the module
    docs); returns the index's path. ``max_shard_size`` is bytes, or a size as transformers
    spells it (``"5GB"``, ``"500MB"``, ``"2GiB"``: :func:`parse_size`)."""
    if isinstance(max_shard_size, str):
        max_shard_size = parse_size(max_shard_size)
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1 byte, not {max_shard_size}")
    if suffix not in (".safetensors", ".bpk"):
        raise RecordError("io", f"{directory}: a set's shards are .safetensors or .bpk")
    store, name = open_parent(directory)
    target = location(directory)
    if store.size(name) is not None or store.list(name):
        raise RecordError("io", f"{target}: exists; a set is written into a new directory")
    staging = store.staging(name)
    try:
        groups = _shards(content, max_shard_size)
        weight_map: dict[str, str] = {}
        for k, names in enumerate(groups):
            shard = f"model-{k + 1:05d}-of-{len(groups):05d}{suffix}"
            held = set(names)
            part = Content(
                {n: content.tensors[n] for n in names},
                param_ids={n: p for n, p in content.param_ids.items() if n in held},
                dtypes={n: d for n, d in content.dtypes.items() if n in held},
                metadata={  # an alias goes with the shard of the tensor it names
                    k: v
                    for k, v in content.metadata.items()
                    if not k.startswith(ALIAS_PREFIX) or v in held
                },
            )
            write_content(store.url_of(f"{staging}/{shard}"), part, progress)
            weight_map.update(dict.fromkeys(names, shard))
        total = sum(t.numel() * t.element_size() for t in content.tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index_name = SAFETENSORS_INDEX if suffix == ".safetensors" else BPK_INDEX
        store.put(f"{staging}/{index_name}", json.dumps(index, indent=2).encode())
        store.publish(staging, name)
    except BaseException as e:
        store.remove_prefix(staging)
        if isinstance(e, FileExistsError):  # an empty directory of that name, or a racing one
            raise RecordError(
                "io", f"{target}: exists; a set is written into a new directory"
            ) from e
        raise
    return join(target, index_name)


# --- what the command line shows ----------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype, else torch's (``complex128`` has no safetensors name)."""
    try:
        return st_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def describe_source(
    path: str | os.PathLike[str], storage_options: Options = None
) -> dict[str, Any]:
    """What ``inspect`` shows for a set or a ``.safetensors`` file, as JSON-ready data: its
    files (a set's index and shards), every tensor's dtype, shape, bytes, file and param id,
    and the metadata. Nothing but headers is read."""
    kind = set_kind(path, storage_options)
    found = find_set(path, storage_options) if kind is not None else None
    with open_source(path, storage_options) as source:
        sizes = {name: _nbytes(shape, dtype) for name, (shape, dtype) in source.specs.items()}
        tensors = [
            {
                "name": name,
                "dtype": _dtype_name(dtype),
                "shape": list(shape),
                "bytes": sizes[name],
                "file": source.where(name) or str(path),
                "param_id": source.param_ids.get(name),
            }
            for name, (shape, dtype) in source.specs.items()
        ]
        info: dict[str, Any] = {
            "source": str(path),
            "format": "set" if isinstance(found, CheckpointSet) else "file",
            "tensors": tensors,
            "aliases": dict(source.aliases),
            "metadata": dict(source.metadata),
        }
    if isinstance(found, CheckpointSet):
        info["index"] = str(found.index)
        info["shards"] = [
            {
                "name": shard,
                "tensors": sum(1 for s in found.weight_map.values() if s == shard),
                "bytes": sum(n for t, n in sizes.items() if found.weight_map.get(t) == shard),
            }
            for shard in found.shards
        ]
    return info


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def verify_source(path: str | os.PathLike[str], storage_options: Options = None) -> dict[str, Any]:
    """What ``verify`` reports for a set or a ``.safetensors`` file: every check of opening it
    (index, shard names, headers, index against shards), then every ``.bpk`` shard's
    checksums; ``{"file", "ok", "problems", "tensors", "checksums"}``."""
    result: dict[str, Any] = {"file": str(path), "ok": True, "problems": [], "checksums": 0}
    try:
        with open_source(path, storage_options) as source:
            result["tensors"] = len(source.specs)
            if source.verify is not None:
                for name in source.specs:
                    try:
                        source.verify(name)
                        result["checksums"] += 1
                    except burnpack.ChecksumError:
                        where = source.where(name) or str(path)
                        result["problems"].append(f"{where}: tensor '{name}' fails its checksum")
    except RecordError as e:
        if e.kind == "io":
            raise
        result["problems"] += list(e.problems)
    result["ok"] = not result["problems"]
    return result


def convert_source(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | None = None,
    suffix: str = ".safetensors",
    progress: Progress | None = None,
) -> Path | str:
    """``src`` (a file or a set, local or at a URL) written as one file ``dst`` (by suffix), or,
    with ``max_shard_size``, as a set in the new directory ``dst``; returns what was written
    (a set's index)."""
    content = read_any(src)
    if max_shard_size is not None:
        return write_set(
            content, dst, max_shard_size=max_shard_size, suffix=suffix, progress=progress
        )
    return write_content(dst, content, progress)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """A size as transformers' ``max_shard_size`` spells it: ``5GB``, ``500MB``, ``2GiB``, or
    bytes.

    >>> parse_size("5GB"), parse_size("1KiB"), parse_size("100")
    (5000000000, 1024, 100)
    """
    value = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if value.endswith(unit):
            number = value[: -len(unit)].strip()
            break
    else:
        unit, number = "B", value
    try:
        size = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size (5GB, 500MB, 2GiB, or bytes)") from None
    if size < 1:
        raise ValueError(f"{text!r}: a shard size must be at least 1 byte")
    return size
