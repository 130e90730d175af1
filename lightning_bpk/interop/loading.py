"""Load a file into a module through a :class:`~lightning_bpk.interop.remap.KeyRemapper`,
reading, verifying and converting tensors on a bounded thread pool.

:func:`load_remapped` does what ``apply_remapped(load_module_record(path), module, remapper)``
does, with the same checks and result, in three steps:

1. **Plan and check, without reading any tensor data**: the rules run on ``meta`` tensors of
   the file's shapes and dtypes, so every conversion problem (an incomplete expert list, a shape
   ``Chunk`` or ``PermuteForRope`` cannot handle) is reported at once before any byte is read;
   then :meth:`ModuleRecord.apply` checks the planned names, shapes and dtypes against a meta
   stand-in of the module and reports missing, unused and mismatched tensors together. The
   steps' name links (see :func:`~lightning_bpk.interop.remap.tracing`) split the file's tensors
   into independent groups: the tensors converted together (all experts' ``w1``/``w3`` of one
   layer), or a single tensor that is only renamed.
2. **Verify**: a ``.bpk`` file's checksums are all checked (on the pool) before anything is
   written, so a damaged file leaves the module as it was.
3. **Materialise on the pool**: each group is a task that reads its tensors, runs the rules on
   them and copies the results into the module's tensors, as ``apply`` would. Hashing (xxhash),
   reading, torch's ``stack``/``cat`` and the copies release the GIL, so the tasks overlap; at
   most ``workers`` run at once, and a group's converted tensors are freed when it is done
   (``apply_remapped`` holds every converted tensor until it applies them).

``workers=1`` runs the tasks in order on the calling thread. A rule without ``traced`` (a
user's own :class:`~lightning_bpk.interop.remap.Rule` subclass) makes the whole file one group.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import safetensors
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bpk import burnpack
from lightning_bpk.burnpack.base import _parsed_dtype_info
from lightning_bpk.interop.formats import _ST_BOOL, SAFETENSORS_INFO_KEY, _kind, read_content
from lightning_bpk.interop.remap import (
    Item,
    Items,
    KeyRemapper,
    Links,
    RemapResult,
    Step,
    observing,
    tracing,
)
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import (
    _PARAM_ID_ATTR,
    ALIAS_PREFIX,
    Adapter,
    ModuleRecord,
    _owner,
)

# transformers loads with min(4, cores) threads: more mostly contend for the same disk and memory.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
T = TypeVar("T")


@dataclass
class _Source:
    """A file's tensors, not yet read: shapes and dtypes, ids, aliases, and a reader."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]  # in data order
    param_ids: dict[str, int]
    aliases: dict[str, str]
    metadata: dict[str, str]
    read: Callable[[str], torch.Tensor]  # thread-safe
    verify: Callable[[str], object] | None = None  # checks a tensor's checksum (.bpk only)
    # name -> (start, end) of its bytes in the file and their dtype; not for torch.save files
    spans: dict[str, tuple[int, int, torch.dtype]] | None = None


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
            {n: pid for n in order if (pid := pack.entries[n].param_id) is not None},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            pack.tensor,
            pack.raw,
            {n: _span(pack, n) for n in order},
        )


def _span(pack: burnpack.Pack, name: str) -> tuple[int, int, torch.dtype]:
    """Where tensor ``name``'s bytes lie in the file, and their dtype (a Burn ``Bool(U8)`` is
    stored as uint8)."""
    info = pack.entries[name]
    stored = _parsed_dtype_info(info.dtype).torch_dtype
    if stored is None:  # refused before: quantized tensors have no torch dtype
        raise RecordError("validation", f"{pack.source}: tensor '{name}' is quantized (QFloat)")
    start, end = info.data_offsets
    return pack.data_start + start, pack.data_start + end, stored


@contextmanager
def _open_safetensors(path: Path) -> Iterator[_Source]:
    """The safetensors package validates the file (header, offsets, sizes); the tensors are then
    zero-copy views of a copy-on-write mapping, as a ``.bpk`` file's, so loading copies each byte
    once, into the module."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            specs = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = f.get_slice(name)
                dtype = sliced.get_dtype()
                specs[name] = (
                    tuple(sliced.get_shape()),
                    torch.bool if dtype == _ST_BOOL else burnpack.torch_dtype(dtype),
                )
        with open(path, "rb") as file:
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

    info = json.loads(metadata.pop(SAFETENSORS_INFO_KEY, "{}"))
    if info.get("order") and sorted(info["order"]) == sorted(specs):
        specs = {n: specs[n] for n in info["order"]}
    metadata.pop(RECORD_KIND_KEY, None)
    try:
        yield _Source(
            specs,
            {n: int(v) for n, v in info.get("param_ids", {}).items()},
            {k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)},
            {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)},
            read,
            spans={n: (start + offsets[n][0], start + offsets[n][1], specs[n][1]) for n in specs},
        )
    finally:
        with contextlib.suppress(BufferError):  # views still alive keep the mapping
            buffer.release()
            mapping.close()


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


class _Shadow(nn.Module):
    """``module`` as :meth:`ModuleRecord.apply` sees it (``state_dict`` and ``get_submodule``),
    with meta tensors of the same shapes, dtypes, kinds and ties: applying a record of meta
    tensors to it runs every check of ``apply`` and changes nothing."""

    _real: nn.Module
    _state: dict[str, object]

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", module)
        twins: dict[int, torch.Tensor] = {}
        state: dict[str, object] = {}
        for name, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                if id(value) not in twins:  # a DTensor's twin has its global shape
                    meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
                    if isinstance(value, nn.Parameter):
                        meta = nn.Parameter(meta, requires_grad=value.requires_grad)
                    twins[id(value)] = meta
                value = twins[id(value)]
            state[name] = value
        object.__setattr__(self, "_state", state)

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, object]:  # type: ignore[override]
        return dict(self._state)

    def get_submodule(self, target: str) -> nn.Module:
        return self._real.get_submodule(target)


def _destinations(
    module: nn.Module, planned: Items, adapter: Adapter | None
) -> dict[str, torch.Tensor]:
    """Record name -> the module tensor it is loaded into, as ``apply`` loads them: a tied
    tensor only from the first of its names (in the module's order) that the record has."""
    module_name = {
        name: adapter.to_module(name, t, _owner(module, name))[0] if adapter else name
        for name, (t, _) in planned.items()
    }
    wanted = set(module_name.values())
    targets = module.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name, target in targets.items():
        if name in wanted and isinstance(target, torch.Tensor):
            first.setdefault(id(target), name)
    out = {}
    for name, mname in module_name.items():
        target = targets.get(mname)
        if isinstance(target, torch.Tensor) and first[id(target)] == mname:
            out[name] = target
    return out


def load_remapped(
    path: str | os.PathLike[str],
    module: nn.Module,
    remapper: KeyRemapper | None = None,
    *,
    workers: int = DEFAULT_WORKERS,
    adapter: Adapter | None = None,
    allow_partial: bool = False,
    allow_unused: bool = False,
    validate: bool = True,
    dtype_policy: str = "from_record",
) -> list[str]:
    """Load a ``.bpk``, ``.safetensors`` or ``torch.save`` file into ``module`` through
    ``remapper`` (then ``adapter``), on up to ``workers`` threads (see the module docs); returns
    the rules that matched nothing. Same result, checks and options as
    ``apply_remapped(load_module_record(path), module, remapper, ...)``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    remapper = remapper if remapper is not None else KeyRemapper([])
    with _open(Path(path)) as source:
        plan = _plan(source, remapper)
        plan.record.apply(  # every check of apply, and no change
            _Shadow(module),
            allow_partial=allow_partial,
            allow_unused=allow_unused,
            validate=validate,
            dtype_policy=dtype_policy,
            adapter=adapter,
        )
        destinations = _destinations(module, plan.result.tensors, adapter)
        shards = [n for n, t in destinations.items() if isinstance(t, DTensor)]
        if shards:
            raise RecordError(
                "validation",
                [f"{path}: '{n}' is a DTensor shard: load with load_into_shards" for n in shards],
            )
        cast = dtype_policy == "cast_to_module"

        def task(group: list[str]) -> None:
            items = _items(source, group, source.read)
            for name, (tensor, pid) in remapper.load(items).tensors.items():
                if name not in destinations:
                    continue  # unused (allowed), or a tied tensor loaded under its first name
                target = destinations[name]
                if adapter is not None:
                    tensor = adapter.to_module(name, tensor, _owner(module, name))[1]
                if tuple(tensor.shape) == tuple(target.shape):  # else validate=False skips it
                    _assign(target, tensor, pid, cast)

        try:
            if source.verify is not None:  # checksums first: a damaged file changes nothing
                _run(source.verify, list(source.specs), workers)
            _run(task, plan.groups, workers)
        except burnpack.BurnpackError as e:
            raise RecordError("io", str(e)) from e
    return plan.result.unmatched


@dataclass
class _Planned:
    """What the rules make of a file's tensors, found on meta tensors (no data read)."""

    result: RemapResult  # module names -> meta tensors and param ids
    record: ModuleRecord  # the same as a record, to check against the module
    groups: list[list[str]]  # file names (aliases included) converted together
    steps: list[Step]  # every rule applied, in order
    meta: Items  # the file's tensors (aliases included) as the rules took them


def _plan(source: _Source, remapper: KeyRemapper) -> _Planned:
    """Run ``remapper`` on meta tensors of ``source``'s shapes: every conversion problem is
    raised here, before any byte is read."""
    names = list(source.specs) + list(source.aliases)
    meta: Items = {}
    for name in names:
        stored = source.aliases.get(name, name)
        shape, dtype = source.specs[stored]
        meta[name] = (torch.empty(shape, dtype=dtype, device="meta"), source.param_ids.get(stored))
    with tracing() as links, observing() as steps:
        result = remapper.load(meta)
    record = ModuleRecord(
        {n: t for n, (t, _) in result.tensors.items()},
        param_ids={n: p for n, (_, p) in result.tensors.items() if p is not None},
    )
    groups = (
        _groups(names, source.aliases, links)
        if all(rule.traced for rule in remapper.rules)
        else [names]
    )
    return _Planned(result, record, groups, steps, meta)


def _items(
    source: _Source, group: list[str], read: Callable[[str], torch.Tensor]
) -> dict[str, Item]:
    """The group's tensors as the rules take them, each stored tensor read once (an alias
    shares its target's)."""
    tensors: dict[str, torch.Tensor] = {}
    items: dict[str, Item] = {}
    for name in group:
        stored = source.aliases.get(name, name)
        if stored not in tensors:
            tensors[stored] = read(stored)
        items[name] = (tensors[stored], source.param_ids.get(stored))
    return items


@torch.no_grad()
def _assign(target: torch.Tensor, tensor: torch.Tensor, pid: int | None, cast: bool) -> None:
    """Load ``tensor`` into ``target`` as :meth:`ModuleRecord.apply` does."""
    if cast or tensor.dtype == target.dtype:
        target.copy_(tensor)
    else:
        target.data = tensor.to(device=target.device, copy=True)
    if pid is not None:
        setattr(target, _PARAM_ID_ATTR, pid)


def _run(task: Callable[[T], object], groups: list[T], workers: int) -> None:
    """``task`` on every group, on at most ``workers`` threads; the first error is raised after
    the tasks already running finish, and the others are cancelled."""
    if workers == 1:
        for group in groups:
            task(group)
        return
    with ThreadPoolExecutor(workers, "lightning_bpk-load") as pool:
        futures = [pool.submit(task, g) for g in groups]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


__all__ = ["DEFAULT_WORKERS", "load_remapped"]
