"""Sharded checkpoints for Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel).

When the model's state dict holds ``DTensor`` shards,
:class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint` saves through here: every rank
writes its own shards of the model and optimizer state with
:class:`~lightning_bpk.dcp.BurnpackStorageWriter` (one burnpack file per rank, all at once), and
rank 0 then publishes them with the schedulers
and trainer state through the :class:`~lightning_bpk.checkpointer.Checkpointer`, whose sentinel
is written last as always::

    ckpt.7/
    ├── sharded.index.bpk              which chunk of which tensor lies where (JSON, no pickle)
    ├── sharded.rank-0.3f2a9c1e.bpk    rank 0's shards of the model and optimizer state
    ├── sharded.rank-1.3f2a9c1e.bpk    rank 1's shards
    ├── scheduler.bpk                  as in an unsharded checkpoint
    └── trainer.bpk

What the DCP files hold (flattened keys): ``model.<state_dict name>`` for the module, and per
optimizer ``optim.state.<param id>.<Burn name>`` (Adam's ``exp_avg`` is
``momentum.moment_1``, as in :class:`~lightning_bpk.records.OptimizerRecord`) plus its
``optim.param_groups.<g>.<hyper-parameter>`` with parameter ids under ``params``. Resuming loads
them through :class:`~lightning_bpk.dcp.BurnpackStorageReader` into the live (sharded) model and
optimizers, on any number of ranks: DCP's planner reshards.

A save is one collective and one commit, written once for both integrations
(:func:`lightning_bpk.runtime.sharded.save`); this module takes the DCP state out of Lightning's
dict (:func:`_take_state`) and gives Lightning's dict back when resuming (:func:`load`,
:func:`lightning_dict`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bpk.checkpointer._view import open_data_directory
from lightning_bpk.dcp import (
    ShardedCheckpointError,
    _index,
    is_sharded,
    load_nested,
    module_record,
)
from lightning_bpk.layout import MODEL_KEY, SHARDED_PREFIX
from lightning_bpk.lightning import trainer_state
from lightning_bpk.records import RecordError
from lightning_bpk.records.optimizer import BURN_NAMES
from lightning_bpk.runtime.sharded import dcp_state, load_into
from lightning_bpk.store import location, open_store

__all__ = [
    "ShardedCheckpointError",
    "is_sharded",
    "lightning_dict",
    "load",
    "module_record",
]


def _holds_dtensors(checkpoint: Mapping[str, Any]) -> bool:
    """True when Lightning's dict carries a sharded model (``DTensor`` values)."""
    state_dict = checkpoint.get("state_dict") or {}
    return any(isinstance(v, DTensor) for v in state_dict.values())


# --- saving ---------------------------------------------------------------------------------------


def _take_state(trainer: pl.Trainer, checkpoint: dict) -> dict[str, Any]:
    """The DCP state of a save (every rank, on the training thread): the model's shards under
    ``model`` and each optimizer's state keyed by parameter id under ``optim`` (``optim1``...),
    taken out of Lightning's ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` are
    removed: the rest goes into the records rank 0 commits beside the shards)."""
    checkpoint.pop("optimizer_states", None)  # positional under DDP: ours are keyed by fqn
    model_state = checkpoint.pop("state_dict")
    return dcp_state(trainer.lightning_module, model_state, trainer.optimizers)


# --- loading --------------------------------------------------------------------------------------


def _rest(path: Path | str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Lightning's dict without model and optimizer state, from the records beside the shards."""
    _index.refuse_links(open_store(path, storage_options), "")  # before reading
    view = open_data_directory(path, storage_options)
    if view is None:
        raise RecordError(
            "io", f"{path}: not a checkpoint directory (expected '<prefix>.<number>')"
        )
    data = view.load([k for k in view.data_keys() if not k.startswith(SHARDED_PREFIX)])
    if data is None or trainer_state.TRAINER_KEY not in data:
        raise ShardedCheckpointError(f"{path}: checkpoint {view.iteration} is not complete")
    checkpoint = dict(data[trainer_state.TRAINER_KEY])
    checkpoint["lr_schedulers"] = [
        r.state_dict() for r in trainer_state._numbered(data, trainer_state.SCHEDULER_KEY)
    ]
    return checkpoint


def _restore(
    trainer: pl.Trainer,
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Lightning's dict for resuming ``trainer`` from the sharded checkpoint ``path`` (a local
    directory or a URL; ``storage_options`` go to fsspec).

    A sharded model that is already set up (``ModelParallelStrategy`` restores after setup) gets
    its model and optimizer state loaded in place (:func:`load`); otherwise (DDP, one device) the
    returned dict carries the full ``state_dict`` and positional ``optimizer_states`` for
    Lightning to restore, as from an unsharded checkpoint.
    """
    module = trainer.lightning_module
    in_place = trainer.strategy.restore_checkpoint_after_setup and any(
        isinstance(p, DTensor) for p in module.parameters()
    )
    if in_place:
        return load(path, module, trainer.optimizers, storage_options=storage_options)
    return lightning_dict(path, storage_options)


def lightning_dict(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The whole checkpoint as Lightning's dict, in this process alone: the full model
    ``state_dict`` and, per optimizer, ``optimizer.state_dict()``'s positional form (parameters
    numbered in the order the saved groups list their ids)."""
    found = location(path)
    checkpoint = _rest(found, storage_options)
    nested = load_nested(found, storage_options=storage_options)
    checkpoint["state_dict"] = OrderedDict(nested[MODEL_KEY])
    checkpoint["optimizer_states"] = [
        _positional(ours) for ours in trainer_state._numbered(nested, trainer_state.OPTIMIZER_KEY)
    ]
    return checkpoint


def _positional(ours: Mapping[str, Any]) -> dict[str, Any]:
    torch_names = {".".join(v): k for names in BURN_NAMES.values() for k, v in names.items()}
    order = [pid for group in ours["param_groups"] for pid in group["params"]]
    position = {pid: i for i, pid in enumerate(order)}
    state = {
        position[int(pid)]: {torch_names.get(k, k): v for k, v in values.items()}
        for pid, values in ours.get("state", {}).items()
    }
    groups = [dict(g, params=[position[p] for p in g["params"]]) for g in ours["param_groups"]]
    return {"state": state, "param_groups": groups}


def load(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint directory: model and optimizer state straight into ``module``
    and ``optimizers`` (sharded or not, on any number of ranks; every rank calls this:
    :func:`~lightning_bpk.runtime.sharded.load_into`), and the rest of Lightning's dict (loops,
    callbacks, schedulers, RNG states) as the return value.

    Without a process group it loads in this process alone, into a plain ``nn.Module``.
    ``path`` may be a URL (each rank fetches only the byte ranges of its shards).
    """
    found = location(path)
    checkpoint = _rest(found, storage_options)
    load_into(found, module, optimizers, storage_options=storage_options)
    return checkpoint
