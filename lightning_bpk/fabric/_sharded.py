"""A Fabric loop's sharded model (``ModelParallelStrategy``: FSDP2, tensor parallel) through the
callback's sharded save: :mod:`lightning_bpk.lightning.sharded`, unchanged.

``ModelParallelStrategy`` refuses every ``CheckpointIO`` plugin and calls
``torch.distributed.checkpoint`` itself, so the manager saves such a model as the callback does:
every rank writes its shards of the module and its optimizers with the burnpack DCP writer into
the checkpoint's staging prefix (:func:`~lightning_bpk.lightning.sharded.save_shards`), and
rank 0 commits them with the ``trainer`` record, the sentinel last
(:func:`~lightning_bpk.lightning.sharded.publish`). Restoring loads them in place on any number
of ranks (:func:`~lightning_bpk.lightning.sharded.load`: DCP's planner reshards).

A sharded checkpoint holds one module (the sharded one) and the optimizers that train it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.errors import CheckpointSaveError
from lightning_bpk.fabric._state import Filters, Parts
from lightning_bpk.layout import TRAINER_KEY
from lightning_bpk.lightning import sharded
from lightning_bpk.records import ModuleRecord, StateRecord


def is_sharded(checkpointer: Checkpointer, number: int, storage_options: Any = None) -> bool:
    """Checkpoint ``number`` is a sharded one (its data holds the index of the shards)."""
    path = checkpointer.checkpoint_path(number)
    return sharded.is_sharded(path, storage_options=storage_options)


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def layout(parts: Parts, filters: Filters) -> dict[str, Any] | None:
    """``{"module": key, "optimizers": [keys]}`` when the state holds a sharded module (the
    ``trainer`` record keeps it), None otherwise; what a sharded save cannot hold is refused."""
    keys = [k for k, m in parts.modules.items() if _is_sharded(m)]
    if not keys:
        return None
    if len(parts.modules) != 1:
        raise ValueError(
            f"a sharded checkpoint holds one module, the state has {sorted(parts.modules)}; "
            f"save {keys[0]!r} with its optimizers, and the others beside it separately"
        )
    key = keys[0]
    if key in filters:
        raise ValueError(
            f"filter for key {key!r}: a sharded (DTensor) module is saved whole; filtering "
            "the shards is not supported"
        )
    for name in parts.optimizers:
        parts.owner(name)  # raises for an optimizer of another module
    return {"module": key, "optimizers": list(parts.optimizers)}


@dataclass(frozen=True)
class _Run:
    """What :func:`lightning_bpk.lightning.sharded.save_shards` reads of a Lightning
    ``Trainer`` (its rank, its strategy's ``broadcast``, the module and its optimizers), from a
    Fabric run: the same save, without a Trainer."""

    is_global_zero: bool
    strategy: Any
    lightning_module: nn.Module
    optimizers: list[Any] = field(default_factory=list)


def save(
    fabric: Any,
    checkpointer: Checkpointer,
    step: int,
    parts: Parts,
    where: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
) -> sharded.Shards | None:
    """Every rank writes its shards of checkpoint ``step`` (a collective); rank 0 gets what
    :func:`publish` commits. A failure anywhere raises on every rank, earlier checkpoints
    untouched."""
    module = parts.modules[where["module"]]
    optimizers = [parts.optimizers[k] for k in where["optimizers"]]
    run = _Run(fabric.is_global_zero, fabric.strategy, module, optimizers)
    checkpoint = {"state_dict": get_model_state_dict(module)}
    try:
        return sharded.save_shards(cast(Any, run), checkpointer, step, checkpoint, storage_options)
    except sharded.ShardedCheckpointError as e:  # raised on every rank alike
        raise CheckpointSaveError(f"{e}; earlier checkpoints are untouched") from e


def publish(
    checkpointer: Checkpointer, step: int, shards: sharded.Shards, trainer: StateRecord
) -> Any:
    """Rank 0: commit checkpoint ``step``: the shards every rank wrote into its staging prefix
    with the ``trainer`` record, the sentinel last (the one commit; returns its directory)."""
    data = {TRAINER_KEY: trainer}
    return checkpointer.save_checkpoint(step, data, staged=shards.staged, described=shards.files)


def load(
    checkpointer: Checkpointer,
    number: int,
    location: str,
    parts: Parts,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the sharded checkpoint ``number`` at ``location`` into the module and optimizers of
    ``parts`` in place (every rank; resharded to this run's layout) and return its data
    without them: the ``trainer`` record."""
    data = checkpointer.load_checkpoint(number, [TRAINER_KEY])
    if data is None:
        raise CheckpointSaveError(f"checkpoint {number} in {checkpointer.base_directory} is gone")
    trainer = data[TRAINER_KEY]
    where = trainer.get("sharded") if isinstance(trainer, dict) else None
    if not where:
        return data
    module = parts.modules.get(where["module"])
    if module is None:
        return data  # the caller did not ask for the module: the remainder says so
    optimizers = [parts.optimizers[k] for k in where["optimizers"] if k in parts.optimizers]
    if optimizers and len(optimizers) != len(where["optimizers"]):
        missing = [k for k in where["optimizers"] if k not in parts.optimizers]
        raise KeyError(f"checkpoint {number} shards the optimizers {missing} too: restore all")
    sharded.load(location, module, optimizers, storage_options=storage_options)
    return data


def module_record(
    checkpointer: Checkpointer,
    number: int,
    key: str,
    storage_options: Mapping[str, Any] | None = None,
) -> ModuleRecord:
    """The module under ``key`` of checkpoint ``number`` as one unsharded record (a sharded
    checkpoint's shards assembled in this process)."""
    if is_sharded(checkpointer, number, storage_options):
        trainer = checkpointer.load_checkpoint(number, [TRAINER_KEY])
        saved = ((trainer or {}).get(TRAINER_KEY) or {}).get("sharded") or {}
        if saved.get("module") != key:
            raise KeyError(f"checkpoint {number} shards the module {saved.get('module')!r}")
        path = checkpointer.checkpoint_path(number)
        return sharded.module_record(path, storage_options=storage_options)
    data = checkpointer.load_checkpoint(number, [key])
    if data is None:
        raise FileNotFoundError(f"checkpoint {number} in {checkpointer.base_directory} is gone")
    return cast(ModuleRecord, data[key])
