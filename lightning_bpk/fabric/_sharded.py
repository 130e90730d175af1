"""A Fabric loop's sharded model (``ModelParallelStrategy``: FSDP2, tensor parallel), over the run
layer's sharded save: :mod:`lightning_bpk.runtime.sharded`, the same as the Lightning callback's.

``ModelParallelStrategy`` refuses every ``CheckpointIO`` plugin and calls
``torch.distributed.checkpoint`` itself, so the manager saves such a model as the callback does:
every rank writes its shards of the module and its optimizers (:func:`shards`: their DCP state)
with the burnpack DCP writer into the checkpoint's staging prefix, and rank 0 commits them with
the ``trainer`` record, the sentinel last (:func:`lightning_bpk.runtime.sharded.save`, through
:class:`~lightning_bpk.runtime.saves.Saves`). Restoring loads them in place on any number of
ranks (:func:`load`: DCP's planner reshards).

A sharded checkpoint holds one module (the sharded one) and the optimizers that train it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_bpk import dcp
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.errors import CheckpointSaveError
from lightning_bpk.fabric._state import Filters, Parts
from lightning_bpk.layout import TRAINER_KEY
from lightning_bpk.records import ModuleRecord
from lightning_bpk.runtime import sharded


def is_sharded(checkpointer: Checkpointer, number: int, storage_options: Any = None) -> bool:
    """Checkpoint ``number`` is a sharded one (its data holds the index of the shards)."""
    path = checkpointer.checkpoint_path(number)
    return dcp.is_sharded(path, storage_options=storage_options)


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


def shards(parts: Parts, where: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's DCP state of the sharded module ``where`` names and its optimizers."""
    module = parts.modules[where["module"]]
    optimizers = [parts.optimizers[k] for k in where["optimizers"]]
    return sharded.dcp_state(module, get_model_state_dict(module), optimizers)


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
    sharded.load_into(location, module, optimizers, storage_options=storage_options)
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
        return dcp.module_record(path, storage_options=storage_options)
    data = checkpointer.load_checkpoint(number, [key])
    if data is None:
        raise FileNotFoundError(f"checkpoint {number} in {checkpointer.base_directory} is gone")
    return cast(ModuleRecord, data[key])
