"""Load a file into a module through a :class:`~lightning_bpk.interop.remap.KeyRemapper`,
reading, verifying and converting tensors on a bounded thread pool.

:func:`load_remapped` does what ``apply_remapped(load_module_record(path), module, remapper)``
does, with the same checks and result, in three steps:

1. **Plan and check, without reading any tensor data**: the rules run on ``meta`` tensors of
   the file's shapes and dtypes, so every conversion problem (an incomplete expert list, a shape
   ``Chunk`` or ``PermuteForRope`` cannot handle) is reported at once before any byte is read;
   then :meth:`ModuleRecord.apply` checks the planned names, shapes and dtypes against a meta
   stand-in of the module and reports missing, unused and mismatched tensors together. The
   steps' name links (see ``lightning_bpk.interop.rules.tracing``) split the file's tensors
   into independent groups: the tensors converted together (all experts' ``w1``/``w3`` of one
   layer), or a single tensor that is only renamed.
2. **Verify**: a ``.bpk`` file's checksums are all checked (on the pool) before anything is
   written, so a damaged file leaves the module as it was.
3. **Materialise on the pool**: each group is a task that reads its tensors, runs the rules on
   them and copies the results into the module's tensors, as ``apply`` would; a tensor a
   converter builds whole (experts stacked, gate and up fused) is built in its module tensor
   (:func:`~lightning_bpk.interop._placing.placing`): each file tensor is copied once, into its
   slice, and no fused tensor is allocated. Hashing (xxhash), reading, torch's ``stack``/``cat``
   and the copies release the GIL, so the tasks overlap; at most ``workers`` run at once, and
   a group's converted tensors are freed when it is done (``apply_remapped`` holds every
   converted tensor until it applies them).

``workers=1`` runs the tasks in order on the calling thread. A rule without ``traced`` (a
user's own :class:`~lightning_bpk.interop.rules.Rule` subclass) makes the whole file one group.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bpk import burnpack
from lightning_bpk.interop._placing import placing
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
from lightning_bpk.interop._sources import Source, open_source
from lightning_bpk.interop._ties import tied_weights, untied_while
from lightning_bpk.interop.remap import KeyRemapper, RemapResult
from lightning_bpk.records._params import load_tensor, owning_module
from lightning_bpk.records.base import RecordError
from lightning_bpk.records.module import Adapter


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
    ties: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Load a ``.bpk``, ``.safetensors`` or ``torch.save`` file, or a checkpoint set (an index
    or a directory: see :mod:`lightning_bpk.interop`), local or at a URL, into ``module``
    through ``remapper`` (then ``adapter``), on up to ``workers`` threads (see the module docs);
    returns the rules that matched nothing, as a :class:`LoadResult` that also says what a
    relaxed load applied, skipped, left missing or unused, and cast. Same checks and options
    as ``apply_remapped(load_module_record(path), module, remapper, ...)``.

    ``ties`` maps a module tensor name to the one it is tied to (default: the module's own tie
    declarations, see :func:`~lightning_bpk.interop.hub.tied_weights`); a tied tensor the file
    omits (``save_pretrained`` drops a tied ``lm_head.weight``) is loaded from its tie, and
    every other tensor is still required. ``storage_options`` go to fsspec for a URL.

    Errors are those of ``load_record``: a tensor failing its checksum is a
    :class:`~lightning_bpk.records.RecordChecksumError` naming it, an unreadable file a
    :class:`~lightning_bpk.records.RecordError` of kind ``"io"`` with its cause chained.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    remapper = remapper if remapper is not None else KeyRemapper([])
    ties = tied_weights(module) if ties is None else dict(ties)
    with open_source(path, storage_options) as source:
        planned = plan(source, remapper, ties)
        problems = apply_problems(  # every check of apply, and no change
            planned,
            source,
            module,
            allow_partial=allow_partial,
            allow_unused=allow_unused,
            validate=validate,
            dtype_policy=dtype_policy,
            adapter=adapter,
        )
        if problems:
            raise RecordError("validation", [f"{path}: {p}" for p in problems])
        stored = set(planned.result.tensors) - set(planned.tied)
        with untied_while(module, stored if adapter is None else (), ties, path):
            into = destinations(module, planned.result.tensors, adapter)
            shards = [n for n, t in into.items() if isinstance(t, DTensor)]
            if shards:
                raise RecordError(
                    "validation",
                    [
                        f"{path}: '{n}' is a DTensor shard: load with load_into_shards"
                        for n in shards
                    ],
                )
            cast = dtype_policy == "cast_to_module"
            # a tensor one rule builds whole (fused experts) is built in its module tensor
            places = {n: into[n] for n in planned.built if n in into} if adapter is None else {}
            load = _Load(source, planned, remapper, module, into, places, adapter, cast)
            try:
                if source.verify is not None:  # checksums first: a damaged file changes nothing
                    run_tasks(source.verify, list(source.specs), workers)
                run_tasks(load.group, planned.groups, workers)
            except burnpack.BurnpackError as e:
                raise RecordError.from_format_error(e) from e
            if load.skipped:
                warnings.warn(
                    f"{path}: validate=False skipped {len(load.skipped)} shape mismatches, which "
                    f"keep the module's values: {'; '.join(sorted(load.skipped.values()))}",
                    stacklevel=2,
                )
            return _outcome(module, planned.result, into, adapter, set(load.skipped), cast)


@dataclass
class _Load:
    """One load's tasks: each group read, converted and copied into the module's tensors."""

    source: Source
    planned: Planned
    remapper: KeyRemapper
    module: nn.Module
    into: Mapping[str, torch.Tensor]
    places: Mapping[str, torch.Tensor]  # what the rules may build in place (see _placing.placing)
    adapter: Adapter | None
    cast: bool
    skipped: dict[str, str] = field(default_factory=dict)  # one key per task: shared safely

    def group(self, group: list[str]) -> None:
        """Read ``group``, run the rules on it and load what they give into the module."""
        items = group_items(self.source, group, self.source.read)
        with placing(self.places):
            loaded = tie(self.remapper.load(items).tensors, self.planned.tied)
        for name, (tensor, pid) in loaded.items():
            if name not in self.into:
                continue  # unused (allowed), or a tied tensor loaded under its first name
            target = self.into[name]
            if self.adapter is not None:
                owner = owning_module(self.module, name)
                tensor = self.adapter.to_module(name, tensor, owner)[1]
            if tuple(tensor.shape) == tuple(target.shape):
                load_tensor(target, tensor, pid, self.cast)
            else:  # validate=False: skipped, and said so
                self.skipped[name] = (
                    f"{name!r}: {list(tensor.shape)} in the file, "
                    f"{list(target.shape)} in the module"
                )


class LoadResult(list[str]):
    """What :func:`load_remapped` did. The list itself is the rules that matched nothing (as
    it always returned); the attributes name module tensors (record names, before an adapter):

    - ``applied``: loaded from the file;
    - ``skipped``: shape mismatches ``validate=False`` left with the module's value;
    - ``missing``: module tensors the file gave no value (``allow_partial=True``);
    - ``unused``: file tensors the module has no place for (``allow_unused=True``);
    - ``cast``: loaded in the module's dtype rather than the file's (``cast_to_module``).
    """

    applied: list[str]
    skipped: list[str]
    missing: list[str]
    unused: list[str]
    cast: list[str]

    def __repr__(self) -> str:
        fields = ("applied", "skipped", "missing", "unused", "cast")
        counts = ", ".join(f"{f}={len(getattr(self, f))}" for f in fields)
        return f"LoadResult(unmatched={list(self)!r}, {counts})"


def _outcome(
    module: nn.Module,
    planned: RemapResult,
    into: Mapping[str, torch.Tensor],
    adapter: Adapter | None,
    skipped: set[str],
    cast: bool,
) -> LoadResult:
    """The :class:`LoadResult` of a finished load: ``into`` the destinations of the planned
    tensors, ``skipped`` those whose shapes differed."""
    state = module.state_dict(keep_vars=True)
    result = LoadResult(planned.unmatched)
    result.applied = sorted(n for n in into if n not in skipped)
    result.skipped = sorted(skipped)
    result.cast = sorted(
        n for n in result.applied if cast and planned.tensors[n][0].dtype != into[n].dtype
    )
    result.unused = sorted(
        n
        for n in planned.tensors
        if n not in into
        and (
            adapter.to_module(n, planned.tensors[n][0], owning_module(module, n))[0]
            if adapter
            else n
        )
        not in state
    )
    filled = {id(t) for t in into.values()}
    result.missing = sorted(
        n
        for n, t in state.items()
        if id(t) not in filled
        and (adapter is None or adapter.from_module(n, t, owning_module(module, n)) is not None)
    )
    return result


__all__ = [
    "LoadResult",
    "load_remapped",
]
