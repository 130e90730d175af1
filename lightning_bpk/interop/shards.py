"""Load a full (unsharded) ``.bpk`` or ``.safetensors`` file straight into a sharded module:
each rank reads only the bytes of its own shards.

:func:`load_into_shards` is :func:`~lightning_bpk.interop.loading.load_remapped` for a module
whose parameters are ``DTensor`` (FSDP2's ``fully_shard``, tensor parallel's
``parallelize_module``, ``distribute_tensor``): for each ``DTensor`` it computes the box of the
full tensor this rank holds, from its device mesh and placements (``Shard(d)``, ``Replicate()``,
uneven shards as torch cuts them), and reads that box from the file with positional reads into
a buffer of the shard's size. In a row-major tensor a box is one byte range per run of its
partial dims (a ``Shard(0)`` slice is one range, a ``Shard(1)`` slice of a matrix one range per
row), so no rank reads, or holds, a full tensor. Plain tensors load whole, as in
``load_remapped``. Nothing is collective: every rank plans and reads on its own.

**Conversions** run per shard where they commute with the sharding: every rule's effect on
dims is followed from the file tensor to the module tensor (renames keep them, ``Transpose``
swaps two, ``MergeModulelist`` adds one, ``SplitModulelist``/``Unstack`` remove one), and an op
that works along a dim (``Concatenate``, ``Chunk``, ``Split``, ``Interleave``, the rows of
``PermuteForRope``) must find it whole in the module's shard. A cut along the dim
``MergeModulelist`` stacks (FSDP2's ``Shard(0)`` of fused experts) selects list elements: the
rank reads only its elements' tensors and hands them to the rules under indices from 0
(``experts.4.w1`` as ``experts.0.w1`` on the rank holding experts 4 to 7), checked on meta
tensors first to give exactly its shard.
Where it does not, or where tensors converted together would need different slices of one file
tensor, or for a rule this module does not know, a :class:`~lightning_bpk.records.RecordError`
names the file, the rule, the parameter and its placement before anything is read.

**What is checked.** Before any shard is written, as ``load_remapped``: the file's header
(a ``.bpk`` file's layout, offsets, sizes and dtypes; a safetensors header through the
``safetensors`` package), the conversions, and the module's names, global shapes and dtypes,
all problems reported together. A ``.bpk`` file's per-tensor xxh3 checksums cover whole tensors,
so a rank that reads a slice cannot check them: ``verify=True`` hashes every tensor the rank
loads from in full first (reading each of them whole once, through the page cache), and a
damaged file then changes nothing. Safetensors files carry no checksums.

``torch.save`` files cannot be read in ranges (pickle) and are refused: convert them first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from lightning_bpk import burnpack
from lightning_bpk.interop._dims import follow
from lightning_bpk.interop._plan import (
    DEFAULT_WORKERS,
    Planned,
    apply_problems,
    destinations,
    group_items,
    plan,
    run_tasks,
    tie,
)
from lightning_bpk.interop._ranges import Box, RangedFiles
from lightning_bpk.interop._sources import Source, open_source
from lightning_bpk.interop._ties import tied_weights
from lightning_bpk.interop.remap import KeyRemapper
from lightning_bpk.interop.rules import Items, RemapError
from lightning_bpk.records._params import load_tensor, set_param_id
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import StorageError

__all__ = [
    "ShardedLoad",
    "load_into_shards",
]


@dataclass
class ShardedLoad:
    """What :func:`load_into_shards` did on this rank."""

    unmatched: list[str]  # rules that matched nothing, as load_remapped returns them
    bytes_read: int = 0  # tensor bytes this rank read from the file (verify=True included)


def _shard_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Box:
    """The ``[start, stop)`` range per dim of the full tensor of ``shape`` that the rank at
    ``coordinate`` of a mesh of ``mesh_shape`` holds, as torch cuts it (``torch.chunk`` per
    ``Shard``, mesh dims in order; a rank past the last chunk holds an empty range).

    >>> _shard_box((7, 4), (2,), (1,), [Shard(0)])
    ((4, 7), (0, 4))
    >>> _shard_box((7, 4), (2, 2), (1, 0), [Shard(1), Shard(0)])
    ((0, 4), (2, 4))
    """
    for placement in placements:
        if isinstance(placement, _StridedShard) or not isinstance(placement, Shard | Replicate):
            raise ValueError(f"placement {placement!r} is not Shard(dim) or Replicate()")
    local, offset = _compute_local_shape_and_global_offset(
        tuple(shape), tuple(mesh_shape), list(coordinate), placements
    )
    return tuple((o, o + n) for o, n in zip(offset, local, strict=True))


# --- the loader ----------------------------------------------------------------------------------


def _placement(tensor: DTensor) -> str:
    return f"{list(tensor.placements)} on a mesh of {tuple(tensor.device_mesh.shape)}"


def load_into_shards(
    path: str | os.PathLike[str],
    module: nn.Module,
    remapper: KeyRemapper | None = None,
    *,
    verify: bool = False,
    workers: int = DEFAULT_WORKERS,
    allow_partial: bool = False,
    allow_unused: bool = False,
    validate: bool = True,
    dtype_policy: str = "from_record",
    ties: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardedLoad:
    """Load a full ``.bpk`` or ``.safetensors`` file, or a checkpoint set of them (an index or
    a directory, local or at a URL), into ``module``, whose tensors may be ``DTensor`` shards,
    through ``remapper``; each rank reads only its own shards' byte ranges, across the set's
    files (see the module docs). Call it on every rank; it needs no collective. Same checks and
    options as :func:`~lightning_bpk.interop.loading.load_remapped` (no adapter: give its layout
    changes as rules); a ``DTensor`` keeps its dtype (``dtype_policy="cast_to_module"`` casts
    the file's). ``verify=True`` checks a ``.bpk`` file's checksums of the tensors read, in full.
    ``storage_options`` go to fsspec for a URL.

    Example, on each rank of an FSDP2 model::

        fully_shard(model)
        load_into_shards("model.safetensors", model, KeyRemapper([Rename(r"^model\\.", "")]))
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    remapper = remapper if remapper is not None else KeyRemapper([])
    ties = tied_weights(module) if ties is None else dict(ties)
    with open_source(path, storage_options) as source:
        if source.spans is None:
            raise RecordError(
                "io",
                f"{path}: a torch.save file cannot be read in byte ranges; convert it to "
                ".safetensors or .bpk first (lightning_bpk.interop.convert)",
            )
        options = {
            "allow_partial": allow_partial,
            "allow_unused": allow_unused,
            "validate": validate,
            "dtype_policy": dtype_policy,
        }
        planned, targets, boxes, renames = _checked_plan(
            path, source, module, remapper, ties, options
        )
        files = RangedFiles(storage_options)
        try:
            done = ShardedLoad(planned.result.unmatched)
            if verify and source.verify is not None:  # first: a damaged file changes nothing
                run_tasks(source.verify, sorted(boxes), workers)
                done.bytes_read += sum(source.spans[n].end - source.spans[n].start for n in boxes)
            load = _Loader(path, source, planned, remapper, targets, boxes, renames, files)
            load.cast = dtype_policy == "cast_to_module"
            run_tasks(load.group, planned.groups, workers)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e
        except StorageError as e:
            raise RecordError("io", str(e)) from e
        done.bytes_read += files.bytes_read
    return done


def _checked_plan(
    path: str | os.PathLike[str],
    source: Source,
    module: nn.Module,
    remapper: KeyRemapper,
    ties: Mapping[str, str],
    options: dict,
) -> tuple[Planned, dict[str, torch.Tensor], dict[str, Box], dict[str, str]]:
    """The plan, the tensors it loads into, each file tensor's box and the names of selected
    list elements; every problem (apply's checks, the boxes, the selections) raised together,
    before anything is read."""
    planned = plan(source, remapper, ties)
    problems = apply_problems(planned, source, module, **options)
    targets = {
        name: target
        for name, target in destinations(module, planned.result.tensors, None).items()
        if tuple(target.shape) == tuple(planned.result.tensors[name][0].shape)
    }
    boxes, renames = _boxes(source, planned, targets, options["dtype_policy"], problems)
    if not problems:
        _check_selections(planned, source, remapper, boxes, renames, targets, problems)
    if problems:
        raise RecordError("validation", [f"{path}: {p}" for p in problems])
    return planned, targets, boxes, renames


@dataclass
class _Loader:
    """Reads a group's boxes and writes the converted tensors into their targets."""

    path: str | os.PathLike[str]
    source: Source
    planned: Planned
    remapper: KeyRemapper
    targets: dict[str, torch.Tensor]
    boxes: dict[str, Box]
    renames: dict[str, str]
    files: RangedFiles
    cast: bool = False
    into: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.into = _read_into(self.planned, self.source, self.targets)

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self.source.specs[name]
        assert self.source.spans is not None  # checked by load_into_shards
        span = self.source.spans[name]
        box = self.boxes.get(name, tuple((0, n) for n in shape))
        tensor = self.files.read(span, shape, box, self.into.get(name))
        if dtype == torch.bool and span.stored != torch.bool:
            return tensor != 0  # a Burn Bool(U8)/Bool(U32)
        return tensor

    def group(self, group: list[str]) -> None:
        needed = [n for n in group if self.source.aliases.get(n, n) in self.boxes]
        if not needed:
            return  # feeds nothing this module loads
        items = group_items(self.source, needed, self.read)
        items = {self.renames.get(n, n): v for n, v in items.items()}
        loaded = tie(self.remapper.load(items).tensors, self.planned.tied)
        for name, (tensor, pid) in loaded.items():
            target = self.targets.get(name)
            if target is not None:
                self.write(name, target, tensor, pid)

    def write(self, name: str, target: torch.Tensor, tensor: torch.Tensor, pid: int | None) -> None:
        local = _local(target)
        if local.shape != tensor.shape:  # the plan rules this out
            raise RuntimeError(
                f"{self.path}: '{name}': read {list(tensor.shape)} for a local shard "
                f"of {list(local.shape)}"
            )
        if tensor is local or isinstance(target, DTensor):  # in place: only the id is left
            if tensor is not local:
                with torch.no_grad():
                    local.copy_(tensor)
            if pid is not None:
                set_param_id(target, pid)
        else:
            load_tensor(target, tensor, pid, self.cast)


def _local(target: torch.Tensor) -> torch.Tensor:
    """The tensor a load writes: a DTensor's local shard, or the plain tensor itself."""
    if isinstance(target, DTensor):
        with torch.no_grad():
            return target.to_local()
    return target


def _read_into(
    planned: Planned, source: Source, targets: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """File name -> the module tensor to read it into, in place: where the rules only rename it
    and the target is contiguous, of the stored dtype, on the CPU (no second copy)."""
    unchanged = {id(t): n for n, (t, _) in planned.meta.items()}
    spans = source.spans or {}
    into: dict[str, torch.Tensor] = {}
    for name, target in targets.items():
        file_name = unchanged.get(id(planned.result.tensors[name][0]))
        if file_name is None:
            continue
        stored = source.aliases.get(file_name, file_name)
        local = _local(target)
        if (
            local.is_contiguous()
            and local.device.type == "cpu"
            and local.dtype == spans[stored].stored == source.specs[stored][1]
        ):
            into.setdefault(stored, local)
    return into


def _boxes(
    source: Source,
    planned: Planned,
    targets: dict[str, torch.Tensor],
    dtype_policy: str,
    problems: list[str],
) -> tuple[dict[str, Box], dict[str, str]]:
    """The box of each file tensor this rank reads (stored names), and the names it loads them
    under where it stacks only some of a list (``experts.4.w1`` as ``experts.0.w1``); problems
    where a target's shard cannot be read as a box through the rules."""
    names = list(source.specs) + list(source.aliases)
    ndims = {n: len(source.specs[source.aliases.get(n, n)][0]) for n in names}
    dims = follow(planned.steps, names, ndims)
    for tied, tied_to in planned.tied.items():  # filled from its tie: the same file tensors
        dims[tied] = dims[tied_to]
    needs: dict[str, dict[str, Box]] = {}  # stored name -> target -> the box it needs
    renames: dict[str, str] = {}
    for name, target in targets.items():
        shape = tuple(target.shape)
        box: Box = tuple((0, n) for n in shape)
        if isinstance(target, DTensor):
            where = f"parameter '{name}' ({_placement(target)})"
            coordinate = target.device_mesh.get_coordinate()
            try:
                if coordinate is None:  # not in the mesh: holds nothing
                    box = tuple((0, 0) for _ in shape)
                else:
                    box = _shard_box(shape, target.device_mesh.shape, coordinate, target.placements)
            except ValueError as e:
                problems.append(f"{where}: {e}, which a full file cannot be read into")
                continue
            if target.device_mesh.device_type == "meta" or _local(target).is_meta:
                problems.append(f"{where}: on the meta device (allocate it first: to_empty)")
                continue
            dtype = planned.result.tensors[name][0].dtype
            if dtype != target.dtype and dtype_policy != "cast_to_module":
                problems.append(
                    f"{where}: the file's {dtype} cannot replace a sharded {target.dtype} "
                    "parameter in place (use dtype_policy='cast_to_module')"
                )
            whole = dims[name].whole
            cut = [d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d]) and d in whole]
            if cut:
                problems.append(
                    f"{where}: {', '.join(sorted({whole[d] for d in cut}))} works along its "
                    f"sharded dim {', '.join(map(str, cut))}, so it does not commute with the "
                    "sharding (load the file unconverted, or shard another dim)"
                )
                continue
        for file_name, file_dims in dims[name].origin.items():
            pick = dims[name].picks.get(file_name)
            if pick is not None and box[pick.dim] != (0, shape[pick.dim]):
                start, stop = box[pick.dim]  # this rank stacks elements start..stop-1
                if not start <= pick.index < stop:
                    continue
                if pick.head is None:
                    problems.append(
                        f"parameter '{name}' ({_placement(target)}): '{file_name}' is stacked "  # type: ignore[arg-type]
                        f"along its sharded dim {pick.dim} under no index in its name"
                    )
                    continue
                renames[file_name] = f"{pick.head}{pick.index - start}{pick.tail}"
            stored = source.aliases.get(file_name, file_name)
            full = source.specs[stored][0]
            # a cut dim is worked along by no rule, so it has the same extent in the file
            need = tuple(
                box[d] if d is not None and box[d] != (0, shape[d]) else (0, full[j])
                for j, d in enumerate(file_dims)
            )
            needs.setdefault(stored, {})[name] = need
    boxes: dict[str, Box] = {}
    for stored, by_target in needs.items():
        distinct = set(by_target.values())
        if len(distinct) > 1:
            problems.append(
                f"tensor '{stored}' feeds tensors sharded differently, each needing another part "
                f"of it: {', '.join(f'{t!r} needs {list(b)}' for t, b in by_target.items())}"
            )
        boxes[stored] = distinct.pop()
    return boxes, renames


def _check_selections(
    planned: Planned,
    source: Source,
    remapper: KeyRemapper,
    boxes: dict[str, Box],
    renames: dict[str, str],
    targets: dict[str, torch.Tensor],
    problems: list[str],
) -> None:
    """Run the rules on meta tensors of what each group stacking only some of its lists will
    read: they must give exactly the targets' shards."""
    for group in planned.groups:
        if not any(n in renames for n in group):
            continue
        meta: Items = {}
        for n in group:
            stored = source.aliases.get(n, n)
            if stored in boxes:
                shape = [b - a for a, b in boxes[stored]]
                meta[renames.get(n, n)] = (torch.empty(shape, device="meta"), None)
        try:
            out = remapper.load(meta).tensors
        except RemapError as e:
            problems.append(f"stacking only this rank's elements of {sorted(renames)}: {e}")
            continue
        for name, (tensor, _) in out.items():
            if name in targets and tuple(tensor.shape) != tuple(_local(targets[name]).shape):
                problems.append(
                    f"parameter '{name}': stacking only this rank's elements gives "
                    f"{list(tensor.shape)}, not its shard's {list(_local(targets[name]).shape)}"
                )
