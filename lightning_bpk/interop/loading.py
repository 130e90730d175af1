"""Load a file into a module through a :class:`~lightning_bpk.interop.remap.KeyRemapper`,
reading, verifying and converting tensors on a bounded thread pool.

:func:`load_remapped` does what ``apply_remapped(load_module_record(path), module, remapper)``
does, with the same checks and result, in three steps:

1. **Plan, without reading any tensor data**: the rules run on ``meta`` tensors of the file's
   shapes and dtypes, so every conversion problem (an incomplete expert list, a shape ``Chunk``
   or ``PermuteForRope`` cannot handle) is reported at once before any byte is read, and the
   steps' name links (see :func:`~lightning_bpk.interop.remap.tracing`) split the file's tensors
   into independent groups: the tensors converted together (all experts' ``w1``/``w3`` of one
   layer), or a single tensor that is only renamed.
2. **Materialise on the pool**: each group is a task that reads its tensors (a ``.bpk`` tensor
   is checksum-verified as it is read), then runs the rules on them. Hashing (xxhash), the copies
   of reading and torch's ``stack``/``cat`` release the GIL, so the tasks overlap; at most
   ``workers`` run at once and at most ``2 * workers`` groups are read ahead of the one being
   collected, which bounds the extra memory.
3. **Apply**: :meth:`ModuleRecord.apply` checks names, shapes and dtypes of the result and
   reports missing, unused and mismatched tensors together before it changes the module.

``workers=1`` runs the tasks in order on the calling thread. A rule without ``traced`` (a
user's own :class:`~lightning_bpk.interop.remap.Rule` subclass) makes the whole file one group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from torch import nn

from lightning_bpk import burnpack
from lightning_bpk.interop.formats import _ST_BOOL, SAFETENSORS_INFO_KEY, _kind, read_content
from lightning_bpk.interop.remap import Item, Items, KeyRemapper, Links, tracing
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, Adapter, ModuleRecord

# transformers loads with min(4, cores) threads: more mostly contend for the same disk and memory.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)


@dataclass
class _Source:
    """A file's tensors, not yet read: shapes and dtypes, ids, aliases, and a reader."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]  # in data order
    param_ids: dict[str, int]
    aliases: dict[str, str]
    metadata: dict[str, str]
    read: Callable[[str], torch.Tensor]  # thread-safe; verifies checksums where the file has them


@contextmanager
def _open(path: Path) -> Iterator[_Source]:
    kind = _kind(path)
    if kind == "bpk":
        with _open_bpk(path) as source:
            yield source
    elif kind == "safetensors":
        with _open_safetensors(path) as source:
            yield source
    else:  # torch.save files cannot be read lazily: read once, then hand out the tensors
        content = read_content(path)
        tensors = content.tensors
        yield _Source(
            {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
            content.param_ids,
            {},
            {k: v for k, v in content.metadata.items() if k != RECORD_KIND_KEY},
            tensors.__getitem__,
        )


@contextmanager
def _open_bpk(path: Path) -> Iterator[_Source]:
    try:
        pack = burnpack.read(path)
    except burnpack.BurnpackError as e:
        raise RecordError("io", str(e)) from e
    with pack:
        found = pack.metadata.get(RECORD_KIND_KEY)
        if found is not None and found != ModuleRecord.kind:
            raise RecordError("validation", f"{pack.source} holds a {found!r} record, not 'module'")
        quantized = [
            n for n, i in pack.entries.items() if isinstance(i.dtype, dict) and "QFloat" in i.dtype
        ]
        if quantized:
            raise RecordError(
                "validation",
                [f"{pack.source}: tensor '{n}' is quantized (QFloat)" for n in quantized],
            )
        order = sorted(pack.names, key=lambda n: pack.entries[n].data_offsets)
        metadata = {k: v for k, v in pack.metadata.items() if k != RECORD_KIND_KEY}
        yield _Source(
            {
                n: (pack.entries[n].shape, burnpack.torch_dtype(pack.entries[n].dtype))
                for n in order
            },
            {n: pack.entries[n].param_id for n in order if pack.entries[n].param_id is not None},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            pack.tensor,
        )


@contextmanager
def _open_safetensors(path: Path) -> Iterator[_Source]:
    try:
        handle = safetensors.safe_open(path, framework="pt")
    except (OSError, safetensors.SafetensorError) as e:
        raise RecordError("io", f"{path}: not a readable safetensors file: {e}") from e
    with handle as f:
        metadata = dict(f.metadata() or {})
        names = list(f.keys())
        specs = {}
        for name in names:
            sliced = f.get_slice(name)
            dtype = sliced.get_dtype()
            specs[name] = (
                tuple(sliced.get_shape()),
                torch.bool if dtype == _ST_BOOL else burnpack.torch_dtype(dtype),
            )
        info = json.loads(metadata.pop(SAFETENSORS_INFO_KEY, "{}"))
        if info.get("order") and sorted(info["order"]) == sorted(specs):
            specs = {n: specs[n] for n in info["order"]}
        metadata.pop(RECORD_KIND_KEY, None)
        yield _Source(
            specs,
            {n: int(v) for n, v in info.get("param_ids", {}).items()},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            f.get_tensor,
        )


def _groups(names: list[str], aliases: Mapping[str, str], links: Links) -> list[list[str]]:
    """Partition the file's names (aliases included) into the sets converted together."""
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a: str, b: str) -> str:
        ra, rb = find(a), find(b)
        parent[rb] = ra
        return ra

    for alias, target in aliases.items():
        union(target, alias)
    current = {n: n for n in names}  # a name after the steps so far -> a file name of its group
    for step in links:
        removed, added = set(), {}
        for old, new in step:
            roots = [current[o] for o in old if o in current]
            if not roots:
                continue
            root = roots[0]
            for other in roots[1:]:
                root = union(root, other)
            removed.update(old)
            added.update(dict.fromkeys(new, root))
        for name in removed:
            current.pop(name, None)
        current.update(added)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def load_remapped(
    path: str | os.PathLike[str],
    module: nn.Module,
    remapper: KeyRemapper | None = None,
    *,
    workers: int = DEFAULT_WORKERS,
    adapter: Adapter | None = None,
    **apply_options: bool | str,
) -> list[str]:
    """Load a ``.bpk``, ``.safetensors`` or ``torch.save`` file into ``module`` through
    ``remapper`` (then ``adapter``), on up to ``workers`` threads (see the module docs); returns
    the rules that matched nothing. Same result, checks and options as
    ``apply_remapped(load_module_record(path), module, remapper, ...)``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    remapper = remapper if remapper is not None else KeyRemapper([])
    path = Path(path)
    with _open(path) as source:
        names = list(source.specs) + list(source.aliases)
        meta: Items = {}
        for name in names:
            stored = source.aliases.get(name, name)
            shape, dtype = source.specs[stored]
            meta[name] = (
                torch.empty(shape, dtype=dtype, device="meta"),
                source.param_ids.get(stored),
            )
        with tracing() as links:
            plan = remapper.load(meta)
        if all(rule.traced for rule in remapper.rules):
            groups = _groups(names, source.aliases, links)
        else:
            groups = [names]

        def task(group: list[str]) -> Items:
            read: dict[str, torch.Tensor] = {}
            items: dict[str, Item] = {}
            for name in group:
                stored = source.aliases.get(name, name)
                if stored not in read:
                    read[stored] = source.read(stored)
                items[name] = (read[stored], source.param_ids.get(stored))
            return remapper.load(items).tensors

        try:
            results = _run(task, groups, workers)
        except burnpack.BurnpackError as e:
            raise RecordError("io", str(e)) from e
        tensors: Items = {}
        for result in results:
            tensors.update(result)
        record = ModuleRecord(
            {n: tensors[n][0] for n in plan.tensors},
            param_ids={n: tensors[n][1] for n in plan.tensors if tensors[n][1] is not None},
            metadata=source.metadata,
        )
        record.apply(module, adapter=adapter, **apply_options)
    return plan.unmatched


def _run(task: Callable[[list[str]], Items], groups: list[list[str]], workers: int) -> list[Items]:
    """``task`` on every group, on at most ``workers`` threads; results in the groups' order."""
    if workers == 1:
        return [task(g) for g in groups]
    with ThreadPoolExecutor(workers, "lightning_bpk-load") as pool:
        futures = [pool.submit(task, g) for g in groups]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


__all__ = ["DEFAULT_WORKERS", "load_remapped"]
