"""Checkpoint sets as whole contents: read every tensor of a file or a set, and write a content
as a sharded set with its index.

A set (see :mod:`lightning_bpk.interop._sources` for what is read and checked) is a
``model.safetensors.index.json`` or ``model.bpk.index.json`` with its shards, or the directory
holding them. :func:`write_set` writes the layout ``save_pretrained`` writes:
``model-00001-of-00003.safetensors`` ... plus the index, ``{"metadata": {"total_size": ...},
"weight_map": {tensor: shard}}``, tensors in data order, a new shard started where the next
tensor would pass ``max_shard_size`` (a larger tensor gets a shard of its own). The set is
written into a scratch directory beside the destination and renamed into place when complete,
so a failed write leaves nothing behind and never touches an existing set (the destination
must not exist).

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
import shutil
from pathlib import Path

from lightning_bpk import _fs, storage
from lightning_bpk.interop._sources import (
    BPK_INDEX,
    SAFETENSORS_INDEX,
    CheckpointSet,
    find_set,
    open_source,
    set_kind,
)
from lightning_bpk.interop.formats import Content, Progress, read_content, write_content
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, ModuleRecord

__all__ = ["describe_set", "is_set", "read_any", "write_set"]


def is_set(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a checkpoint set (an index, or a directory holding one)."""
    return set_kind(path) == "set"


def describe_set(path: str | os.PathLike[str]) -> CheckpointSet:
    """The checked index of the set ``path`` names (``RecordError`` if it names none)."""
    found = find_set(path)
    if not isinstance(found, CheckpointSet):
        raise RecordError("io", f"{path}: not a checkpoint set (no index)")
    return found


def read_any(path: str | os.PathLike[str]) -> Content:
    """Every tensor of a file or a set, as :func:`~lightning_bpk.interop.formats.read_content`
    reads a file (a set's tensors in index order, their data read once)."""
    if set_kind(path) is None and storage.is_local(path):
        return read_content(storage.local_path(path))
    with open_source(path) as source:
        tensors = {name: source.read(name).clone() for name in source.specs}
        metadata = {RECORD_KIND_KEY: ModuleRecord.kind, **source.metadata}
        metadata.update({ALIAS_PREFIX + a: t for a, t in source.aliases.items()})
        return Content(tensors, param_ids=dict(source.param_ids), metadata=metadata)


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
    max_shard_size: int,
    suffix: str = ".safetensors",
    progress: Progress | None = None,
) -> Path:
    """Write ``content`` as a sharded set in the new directory ``directory`` (see the module
    docs); returns the index's path."""
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1 byte, not {max_shard_size}")
    if suffix not in (".safetensors", ".bpk"):
        raise RecordError("io", f"{directory}: a set's shards are .safetensors or .bpk")
    target = Path(directory)
    if target.exists():
        raise RecordError("io", f"{target}: exists; a set is written into a new directory")
    scratch = _fs.scratch_path(target)
    scratch.mkdir(parents=True)
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
            write_content(scratch / shard, part, progress)
            weight_map.update(dict.fromkeys(names, shard))
        total = sum(t.numel() * t.element_size() for t in content.tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        name = SAFETENSORS_INDEX if suffix == ".safetensors" else BPK_INDEX
        with _fs.atomic_file(scratch / name) as f:
            _fs.write_all(f, json.dumps(index, indent=2).encode())
        os.rename(scratch, target)
        _fs.fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target / name
