"""What both loaders share: planning a load on meta tensors, checking it against the module,
grouping the tensors converted together, and writing results into the module's tensors.

:func:`plan` runs the rules on meta tensors of a source's shapes and dtypes (every conversion
problem is raised before any byte is read), adds the tensors the module's tie declarations
fill from another (see :func:`~lightning_bpk.interop.hub.tied_weights`), and splits the
source's tensors into the groups converted together. ``_Shadow`` stands for a module in
:meth:`ModuleRecord.apply`'s checks without changing it; :func:`destinations` finds the
module tensor each planned name loads into; :func:`run_tasks` runs the groups on a bounded
thread pool.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from lightning_bpk.interop._dims import Dims, follow
from lightning_bpk.interop._sources import Source
from lightning_bpk.interop.remap import KeyRemapper, RemapResult
from lightning_bpk.interop.rules import Item, Items, Links, Step, observing, tracing
from lightning_bpk.records._params import owning_module
from lightning_bpk.records.base import RecordError
from lightning_bpk.records.module import Adapter, ModuleRecord

__all__ = [
    "DEFAULT_WORKERS",
    "Planned",
    "apply_problems",
    "destinations",
    "group_items",
    "groups_of",
    "plan",
    "run_tasks",
    "tie",
]

DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
"""Threads of the parallel loaders: transformers' ``min(4, cores)``; more mostly contend for the
same disk and memory."""
T = TypeVar("T")


def groups_of(names: list[str], aliases: Mapping[str, str], links: Links) -> list[list[str]]:
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


def destinations(
    module: nn.Module, planned: Items, adapter: Adapter | None
) -> dict[str, torch.Tensor]:
    """Record name -> the module tensor it is loaded into, as ``apply`` loads them: a tied
    tensor only from the first of its names (in the module's order) that the record has."""
    module_name = {
        name: adapter.to_module(name, t, owning_module(module, name))[0] if adapter else name
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


@dataclass
class Planned:
    """What the rules make of a file's tensors, found on meta tensors (no data read)."""

    result: RemapResult  # module names -> meta tensors and param ids
    record: ModuleRecord  # the same as a record, to check against the module
    groups: list[list[str]]  # file names (aliases included) converted together
    steps: list[Step]  # every rule applied, in order
    meta: Items  # the file's tensors (aliases included) as the rules took them
    tied: dict[str, str] = field(default_factory=dict)  # filled from another: target -> source
    built: set[str] = field(default_factory=set)  # results one step built and none touched since


def plan(source: Source, remapper: KeyRemapper, ties: Mapping[str, str] | None = None) -> Planned:
    """Run ``remapper`` on meta tensors of ``source``'s shapes: every conversion problem is
    raised here, before any byte is read. ``ties`` (module name -> the module name it is tied
    to) fill a tied tensor the source lacks from its tie's source."""
    names = list(source.specs) + list(source.aliases)
    meta: Items = {}
    for name in names:
        stored = source.aliases.get(name, name)
        shape, dtype = source.specs[stored]
        meta[name] = (torch.empty(shape, dtype=dtype, device="meta"), source.param_ids.get(stored))
    with tracing() as links, observing() as steps:
        result = remapper.load(meta, where=source.where)
    found = result.tensors
    tied = {t: s for t, s in (ties or {}).items() if t not in found and s in found}
    result.tensors = tie(result.tensors, tied)
    record = ModuleRecord(
        {n: t for n, (t, _) in result.tensors.items()},
        param_ids={n: p for n, (_, p) in result.tensors.items() if p is not None},
    )
    groups = (
        groups_of(names, source.aliases, links)
        if all(rule.traced for rule in remapper.rules)
        else [names]
    )
    return Planned(result, record, groups, steps, meta, tied, _built_once(steps, found))


def _built_once(steps: list[Step], final: Items) -> set[str]:
    """The names of ``final`` whose tensor one step built and no later step touched: their
    rule may build them in their destination (:func:`~lightning_bpk.interop._placing.placing`),
    since nothing reads or changes them after it."""
    built: dict[str, list[torch.Tensor]] = {}
    for step in steps:
        for name, (tensor, _) in step.after.items():
            if name not in step.before or step.before[name][0] is not tensor:
                built.setdefault(name, []).append(tensor)
    return {n for n, (t, _) in final.items() if len(b := built.get(n, [])) == 1 and b[0] is t}


def tie(items: Items, tied: Mapping[str, str]) -> Items:
    """``items`` with each tied target that ``tied`` names added as its source's tensor."""
    extra = {t: (items[s][0], None) for t, s in tied.items() if s in items and t not in items}
    return {**items, **extra} if extra else items


def group_items(
    source: Source, group: list[str], read: Callable[[str], torch.Tensor]
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


def run_tasks(task: Callable[[T], object], groups: list[T], workers: int) -> None:
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


_QUOTED = re.compile(r"'([^']+)'")


def apply_problems(
    planned: Planned, source: Source, module: nn.Module, **options: object
) -> list[str]:
    """Every problem :meth:`ModuleRecord.apply` finds with the planned tensors against
    ``module`` (nothing is changed), each naming the file tensors its module tensor comes from
    and, for a set, their shards: ``'w': shape mismatch, expected [4] but record has [3] (from
    'model.w' in model-00002-of-00003.safetensors)``."""
    try:
        planned.record.apply(_Shadow(module), **options)  # type: ignore[arg-type]
    except RecordError as e:
        if e.kind != "validation":
            raise
        names = list(planned.meta)
        dims = follow(planned.steps, names, {n: planned.meta[n][0].dim() for n in names})
        return [_with_origin(p, planned, source, dims) for p in e.problems]
    return []


def _with_origin(problem: str, planned: Planned, source: Source, dims: Mapping[str, Dims]) -> str:
    """``problem`` with the file tensors (and shards) of the module tensor it names first."""
    found = _QUOTED.search(problem)
    origin = None if found is None else dims.get(planned.tied.get(found[1], found[1]))
    if found is None or origin is None:
        return problem
    parts = []
    for file_name in origin.origin:
        where = source.where(file_name)
        if file_name != found[1] or where:
            parts.append(f"{file_name!r}" + (f" in {where}" if where else ""))
    return f"{problem} (from {', '.join(parts)})" if parts else problem
