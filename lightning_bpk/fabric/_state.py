"""The dict a Fabric loop saves, as checkpoint records, and back into the live objects.

What users pass to ``fabric.save`` is split by kind (:func:`split`): modules and optimizers
become :class:`~lightning_bpk.records.ModuleRecord` and
:class:`~lightning_bpk.records.OptimizerRecord` files under their own key (optimizer state keyed
by parameter id, so it survives a reordered ``parameters()``); everything else goes into the
``trainer`` record (:data:`~lightning_bpk.layout.TRAINER_KEY`, plain data, no pickle): plain
values, the ``state_dict()`` of other stateful objects, and per rank the RNG states and the data
loaders' states (every rank's own, gathered on rank 0)::

    ckpt.120/
    ├── model.bpk         ModuleRecord (only the tensors a ``filter`` kept)
    ├── optimizer.bpk     OptimizerRecord of the optimizer under "optimizer"
    └── trainer.bpk       {"step": 120, "kinds": {...}, "values": {...}, "stateful": {...},
                           "filtered": [...], "ranks": [{"rng": ..., "loaders": {...}}, ...]}

:func:`restore` puts a loaded checkpoint back in place, as ``fabric.load`` does: modules,
optimizers and stateful objects are loaded into, plain values are written into the caller's
dict, and what the caller did not ask for comes back as the remainder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_bpk.fabric import _compat
from lightning_bpk.fabric.loaders import ResumableLoader
from lightning_bpk.layout import TRAINER_KEY, _safe_name
from lightning_bpk.records import ModuleRecord, OptimizerRecord, RecordError
from lightning_bpk.runtime.loaders import has_state
from lightning_bpk.runtime.rng import capture_rng

FORMAT = "lightning_bpk.fabric/1"
"""The ``format`` of a manager's ``trainer`` record (a callback's checkpoint has none)."""
MODULE = "module"
"""The kind of a ``torch.nn.Module`` in the state (its own record file)."""
OPTIMIZER = "optimizer"
"""The kind of a ``torch.optim.Optimizer`` (its own record file, state keyed by parameter id)."""
LOADER = "loader"
"""The kind of a data loader with state (every rank's own, in the ``trainer`` record)."""
STATEFUL = "stateful"
"""The kind of another object with ``state_dict``/``load_state_dict`` (rank 0's state)."""
VALUE = "value"
"""The kind of plain data (rank 0's; written back into the caller's dict on restore)."""

Filters = Mapping[str, Callable[[str, Any], bool]]
"""``filter=``: state keys to ``fn(name, value) -> bool``, as ``fabric.save`` takes it."""


@dataclass
class Parts:
    """A Fabric state dict split by kind (the objects behind Fabric's wrappers)."""

    modules: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    loaders: dict[str, Any] = field(default_factory=dict)  # state per rank: data loaders
    stateful: dict[str, Any] = field(default_factory=dict)  # state_dict() saved by rank 0
    values: dict[str, Any] = field(default_factory=dict)

    def kinds(self) -> dict[str, str]:
        """Every key and its kind."""
        kinds = {k: MODULE for k in self.modules}
        kinds.update(dict.fromkeys(self.optimizers, OPTIMIZER))
        kinds.update(dict.fromkeys(self.loaders, LOADER))
        kinds.update(dict.fromkeys(self.stateful, STATEFUL))
        kinds.update(dict.fromkeys(self.values, VALUE))
        return kinds

    def owner(self, key: str) -> nn.Module:
        """The module whose parameters the optimizer under ``key`` updates."""
        wanted = {id(p) for g in self.optimizers[key].param_groups for p in g["params"]}
        for module in self.modules.values():
            if wanted <= {id(p) for p in module.parameters()}:
                return module
        raise RecordError(
            "validation",
            f"the optimizer under {key!r} updates parameters of no module in the state "
            f"(modules: {sorted(self.modules)}); save the module it trains beside it",
        )


def split(state: Mapping[str, Any]) -> Parts:
    """``state`` by kind; a key that cannot name a record file, or the reserved
    :data:`~lightning_bpk.layout.TRAINER_KEY`, is refused, as is a plain ``DataLoader``
    (it has no state: wrap it in :class:`~lightning_bpk.fabric.ResumableLoader`)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"the state must be a dict of names to objects, not {type(state).__name__}")
    parts = Parts()
    for key, value in state.items():
        if not isinstance(key, str) or key == TRAINER_KEY:
            raise ValueError(f"state key {key!r} is reserved or not a string")
        obj = _compat.unwrap(value)
        inner = _compat.inner_loader(obj)
        if isinstance(obj, nn.Module):
            parts.modules[_safe_name(key, "state key")] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            parts.optimizers[_safe_name(key, "state key")] = obj
        elif isinstance(obj, ResumableLoader) or (
            isinstance(inner, DataLoader) and has_state(inner)
        ):
            parts.loaders[key] = obj if isinstance(obj, ResumableLoader) else inner
        elif isinstance(inner, DataLoader):
            raise TypeError(
                f"state key {key!r}: a {type(inner).__name__} has no state to save; wrap it in "
                "lightning_bpk.fabric.ResumableLoader so that its position is saved"
            )
        elif has_state(obj):
            parts.stateful[key] = obj
        else:
            parts.values[key] = value
    return parts


def check_filters(parts: Parts, filters: Filters) -> None:
    """Fabric's rules for ``filter=`` (a dict of callables on state keys), and ours: a filter
    selects the tensors of a module or the entries of a dict, not an optimizer's state (which
    follows its parameters) nor a loader's position."""
    if not isinstance(filters, Mapping):
        raise TypeError(f"filter must be a dict of state keys to callables, not {filters!r}")
    kinds = parts.kinds()
    unknown = sorted(set(filters) - set(kinds))
    if unknown:
        raise ValueError(
            f"the filter keys {unknown} are not present in the state keys {sorted(kinds)}"
        )
    for key, fn in filters.items():
        if not callable(fn):
            raise TypeError(f"filter for key {key!r} must be a callable, given {fn!r}")
        if kinds[key] in (OPTIMIZER, LOADER):
            raise ValueError(
                f"filter for key {key!r}: a {kinds[key]}'s state cannot be filtered (an "
                "optimizer's state follows the parameters of the module it trains: filter the "
                "module)"
            )


def _filtered(record: ModuleRecord, keep: Callable[[str, Any], bool]) -> ModuleRecord:
    """The entries of ``record`` that ``keep(name, tensor)`` accepts (tied names included)."""
    tensors = {n: t for n, t in record.tensors.items() if keep(n, t)}
    aliases = {}
    for alias, target in record.aliases.items():
        if keep(alias, record.tensors[target]):
            if target in tensors:
                aliases[alias] = target
            else:
                tensors[alias] = record.tensors[target]  # its target was left out: stored here
    ids = {n: record.param_ids[n] for n in tensors if n in record.param_ids}
    for alias, target in record.aliases.items():
        if alias in tensors and target in record.param_ids:
            ids[alias] = record.param_ids[target]
    return ModuleRecord(tensors, param_ids=ids, aliases=aliases, metadata=record.metadata)


def module_records(parts: Parts, filters: Filters) -> dict[str, Any]:
    """The module and optimizer records of ``parts`` (tensors are the live ones: snapshot or
    write them before the next step)."""
    check_filters(parts, filters)
    data: dict[str, Any] = {}
    for key, module in parts.modules.items():
        record = ModuleRecord.from_module(module)
        data[key] = _filtered(record, filters[key]) if key in filters else record
    for key in parts.optimizers:
        data[key] = OptimizerRecord.from_optimizer(parts.optimizers[key], parts.owner(key))
    return data


def _apply_filter(key: str, filters: Filters, value: Any) -> Any:
    if key in filters and isinstance(value, Mapping):
        return {k: v for k, v in value.items() if filters[key](k, v)}
    return value


def rank_entry(parts: Parts) -> dict[str, Any]:
    """This rank's part of the ``trainer`` record: its RNG states and its loaders' states."""
    return {
        "rng": capture_rng(),
        "loaders": {k: loader.state_dict() for k, loader in parts.loaders.items()},
    }


def trainer_entry(
    parts: Parts, filters: Filters, step: int, ranks: list[Any], sharded: dict | None
) -> dict[str, Any]:
    """The plain data of the ``trainer`` record (see the module docstring); ``ranks`` is every
    rank's :func:`rank_entry`, gathered."""
    return {
        "format": FORMAT,
        "step": step,
        "kinds": parts.kinds(),
        "filtered": sorted(k for k in filters if k in parts.modules),
        "values": {k: _apply_filter(k, filters, v) for k, v in parts.values.items()},
        "stateful": {
            k: _apply_filter(k, filters, o.state_dict()) for k, o in parts.stateful.items()
        },
        "ranks": ranks,
        "sharded": sharded,
    }


# --- restoring ------------------------------------------------------------------------------------


def _check_keys(parts: Parts, kinds: Mapping[str, str], strict: bool, source: str) -> None:
    wanted = parts.kinds()
    missing = [k for k in wanted if k not in kinds]
    if strict and missing:
        raise KeyError(
            f"{source} has no {missing} (it holds {sorted(kinds)}); pass strict=False to restore "
            "the rest"
        )
    wrong = [
        f"{k!r} is a {wanted[k]} here but was saved as a {kinds[k]}"
        for k in wanted
        if k in kinds and kinds[k] != wanted[k]
    ]
    if wrong:
        raise RecordError("validation", [f"{source}: {w}" for w in wrong])


def restore(
    parts: Parts,
    state: dict[str, Any],
    data: Mapping[str, Any],
    rank: int,
    strict: bool,
    source: str,
) -> dict[str, Any]:
    """Load ``data`` (a checkpoint's records by key, ``trainer`` as its plain data) into the
    objects of ``parts`` in place and the plain values into ``state``; return the remainder
    (what the checkpoint holds that ``state`` did not ask for). ``rank`` picks this rank's
    loaders' states (rank 0's for a rank the saving run did not have).

    Modules and optimizers already loaded by a sharded load are absent from ``data`` and
    skipped. A module saved through a ``filter`` may lack tensors (they come from elsewhere,
    e.g. a base model's file); with ``strict=False`` any may.
    """
    trainer = data[TRAINER_KEY]
    kinds: dict[str, str] = trainer["kinds"]
    _check_keys(parts, kinds, strict, source)
    filtered = set(trainer.get("filtered", ()))
    for key, module in parts.modules.items():
        if key in data:
            partial = key in filtered or not strict
            data[key].apply(module, allow_partial=partial, allow_unused=not strict)
    for key, optimizer in parts.optimizers.items():
        if key in data:
            data[key].apply(optimizer, parts.owner(key))
    for key, obj in parts.stateful.items():
        if key in trainer["stateful"]:
            obj.load_state_dict(trainer["stateful"][key])
    ranks = trainer["ranks"]
    own = ranks[rank] if rank < len(ranks) else ranks[0]
    for key, loader in parts.loaders.items():
        if key in own["loaders"]:
            loader.load_state_dict(own["loaders"][key])
    for key in parts.values:
        if key in trainer["values"]:
            state[key] = trainer["values"][key]
    return _remainder(parts, data, trainer, own)


def _remainder(
    parts: Parts, data: Mapping[str, Any], trainer: Mapping[str, Any], own: Mapping[str, Any]
) -> dict[str, Any]:
    asked = parts.kinds()
    remainder: dict[str, Any] = {}
    for key, kind in trainer["kinds"].items():
        if key in asked:
            continue
        if kind in (MODULE, OPTIMIZER) and key in data:
            remainder[key] = data[key].state_dict()
        elif kind == STATEFUL:
            remainder[key] = trainer["stateful"][key]
        elif kind == LOADER:
            remainder[key] = own["loaders"].get(key)
        elif kind == VALUE:
            remainder[key] = trainer["values"][key]
    return remainder
