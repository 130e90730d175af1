"""Sharded checkpoints for Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel).

When the model's state dict holds ``DTensor`` shards,
:class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint` saves through here: every rank writes
its
own shards of the model and optimizer state with :class:`~lightning_bpk.dcp.BurnpackStorageWriter`
(one burnpack file per rank, all at once), and rank 0 then publishes them with the schedulers
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

A save is one collective, and one commit (:func:`_save`): rank 0 checks the lease and chooses
the checkpoint's staging prefix (:meth:`~lightning_bpk.checkpointer.Checkpointer.begin`), every
rank writes its shards there (the DCP writer with ``commit=False``), and rank 0 commits them with
the other records through :meth:`~lightning_bpk.checkpointer.Checkpointer.save_checkpoint`, whose
sentinel, written last, is the one commit; every rank learns the outcome. If any rank fails,
every rank raises, rank 0 removes what was written, and every earlier checkpoint stays as it
was. With ``async_save=True`` the training thread only copies each rank's shards into reused
staging buffers and the same collective runs on every rank's writer thread, over a process
group of its own (:meth:`~lightning_bpk.lightning.async_save.AsyncCheckpointSaver.save_sharded`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_bpk.checkpointer import Checkpointer, Retention, Staged
from lightning_bpk.checkpointer._view import open_data_directory
from lightning_bpk.checkpointer.manifest import FileEntry
from lightning_bpk.dcp import (
    INDEX_KIND,
    SHARD_KIND,
    BurnpackStorageReader,
    BurnpackStorageWriter,
    ShardedCheckpointError,
    _index,
    is_sharded,
    load_nested,
    module_record,
)
from lightning_bpk.layout import (
    MODEL_KEY,
    PARAM_IDS_KEY,
    RECORD_SUFFIX,
    SHARDED_PREFIX,
    sharded_index_name,
)
from lightning_bpk.lightning import trainer_state
from lightning_bpk.records import RecordError, param_ids
from lightning_bpk.records.optimizer import BURN_NAMES
from lightning_bpk.store import location, open_store

__all__ = [
    "ShardedCheckpointError",
    "Shards",
    "is_sharded",
    "lightning_dict",
    "load",
    "module_record",
    "save_shards",
]


def _holds_dtensors(checkpoint: Mapping[str, Any]) -> bool:
    """True when Lightning's dict carries a sharded model (``DTensor`` values)."""
    state_dict = checkpoint.get("state_dict") or {}
    return any(isinstance(v, DTensor) for v in state_dict.values())


# --- optimizer state: Lightning's (fqn-keyed) <-> ours (param-id keyed, Burn's names) -------------


def _names(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    return {k: ".".join(v) for k, v in BURN_NAMES.get(type(optimizer), {}).items()}


def _to_ids(osd: Mapping[str, Any], optimizer: torch.optim.Optimizer, ids: dict[str, int]) -> dict:
    names = _names(optimizer)
    state = {
        str(ids[fqn]): {names.get(k, k): v for k, v in values.items()}
        for fqn, values in osd["state"].items()
    }
    groups = [dict(g, params=[ids[f] for f in g["params"]]) for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _to_fqns(
    ours: Mapping[str, Any], optimizer: torch.optim.Optimizer, ids: dict[str, int]
) -> dict:
    torch_names = {v: k for k, v in _names(optimizer).items()}
    fqns = {pid: fqn for fqn, pid in ids.items()}
    state = {
        fqns[int(pid)]: {torch_names.get(k, k): v for k, v in values.items()}
        for pid, values in ours["state"].items()
    }
    groups = [dict(g, params=[fqns[p] for p in g["params"]]) for g in ours["param_groups"]]
    return {"state": state, "param_groups": groups}


def _dcp_state(
    module: nn.Module,
    model_state: Mapping[str, Any],
    optimizers: Sequence[torch.optim.Optimizer],
    optimizer_states: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    ids = param_ids(module)
    state: dict[str, Any] = {
        MODEL_KEY: dict(model_state),
        PARAM_IDS_KEY: {name: ids[name] for name in model_state if name in ids},
    }
    for i, (optimizer, osd) in enumerate(zip(optimizers, optimizer_states, strict=True)):
        state[trainer_state.numbered_key(trainer_state.OPTIMIZER_KEY, i)] = _to_ids(
            osd, optimizer, ids
        )
    return state


# --- saving ---------------------------------------------------------------------------------------


class Shards(NamedTuple):
    """The coordinator's account of the shards every rank wrote into a checkpoint's staging
    prefix: where (:class:`~lightning_bpk.checkpointer.Checkpointer.begin`'s answer) and their
    manifest entries (the DCP writer described each file as it wrote it)."""

    staged: Staged
    files: Mapping[str, FileEntry]


def _failures(error: CheckpointException) -> str:
    """Each failed rank and its error, on one line (DCP's own text adds every traceback)."""
    return "; ".join(
        f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items()
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_coordinator(group: dist.ProcessGroup | None) -> bool:
    return not _distributed() or dist.get_rank(group) == 0


def _broadcast(value: Any, group: dist.ProcessGroup | None) -> Any:
    """The coordinator's ``value`` on every rank of ``group`` (None: the default group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _take_state(trainer: pl.Trainer, checkpoint: dict) -> dict[str, Any]:
    """The DCP state of a save (every rank, on the training thread): the model's shards under
    ``model`` and each optimizer's state keyed by parameter id under ``optim`` (``optim1``...),
    taken out of Lightning's ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` are
    removed: the rest goes into the records rank 0 commits beside the shards)."""
    module = trainer.lightning_module
    checkpoint.pop("optimizer_states", None)  # positional under DDP: ours are keyed by fqn
    optimizer_states = [get_optimizer_state_dict(module, o) for o in trainer.optimizers]
    return _dcp_state(module, checkpoint.pop("state_dict"), trainer.optimizers, optimizer_states)


def _write_shards(
    checkpointer: Checkpointer,
    number: int,
    state: Mapping[str, Any],
    group: dist.ProcessGroup | None,
    storage_options: Mapping[str, Any] | None,
) -> Shards | None:
    """Write every rank's shards of ``state`` (a collective over ``group``) into checkpoint
    ``number``'s own staging prefix, which the coordinator chose
    (:meth:`~lightning_bpk.checkpointer.Checkpointer.begin`: it checks the lease first).

    Sharded (DTensor) state: each rank writes its shards. Replicated state (DDP): DCP's planner
    gives each tensor to one rank, balancing the bytes, so every rank writes a share
    (``storage_options`` go to fsspec). Returns, on the coordinator, what
    ``save_checkpoint(staged=..., described=...)`` commits (elsewhere: None). A failure on any
    rank raises :class:`ShardedCheckpointError` on every rank, and the coordinator removes what
    was written.
    """
    coordinator = _is_coordinator(group)
    staged, failure = None, None
    if coordinator:
        try:
            staged = checkpointer.begin(number)
        except Exception as e:  # every rank must reach the broadcast, and learn of it
            failure = e
    target, error = _broadcast(
        (
            "" if staged is None else staged.url,
            None if failure is None else f"{type(failure).__name__}: {failure}",
        ),
        group,
    )
    if error is not None:
        raise ShardedCheckpointError(
            f"preparing checkpoint {number} failed on rank 0: {error}"
        ) from failure
    # commit=False: the index is an ordinary file of the staging prefix; the checkpointer's
    # sentinel, written by the commit after every rank's file is confirmed, is the one commit.
    writer = BurnpackStorageWriter(location(target), storage_options=storage_options, commit=False)
    try:
        dcp.save(dict(state), storage_writer=writer, process_group=group)
    except CheckpointException as e:  # raised on every rank alike
        if staged is not None:
            checkpointer.discard(staged)
        raise ShardedCheckpointError(
            f"writing the shards of checkpoint {number} failed: {_failures(e)}"
        ) from e
    if staged is None:
        return None
    files = {
        name[: -len(RECORD_SUFFIX)]: FileEntry(
            INDEX_KIND if name == sharded_index_name() else SHARD_KIND,
            info["size"],
            info["head_size"],
            info["head_xxh3"],
        )
        for name, info in writer.files.items()
    }
    return Shards(staged, files)


def save_shards(
    trainer: pl.Trainer,
    checkpointer: Checkpointer,
    number: int,
    checkpoint: dict,
    storage_options: Mapping[str, Any] | None = None,
) -> Shards | None:
    """Write the model and optimizer shards of ``checkpoint`` from every rank (a collective over
    the default group) into checkpoint ``number``'s own staging prefix (:func:`_write_shards`),
    for the caller to commit with ``save_checkpoint(staged=..., described=...)``: the sharded
    save of :class:`~lightning_bpk.fabric.CheckpointManager`, which passes a Fabric run as
    ``trainer`` (of which only ``lightning_module`` and ``optimizers`` are read).

    Removes ``state_dict`` and ``optimizer_states`` from ``checkpoint``; returns on rank 0 what
    to commit (on other ranks: None). A failure on any rank raises
    :class:`ShardedCheckpointError` on every rank, and rank 0 removes what was written.
    """
    state = _take_state(trainer, checkpoint)
    return _write_shards(checkpointer, number, state, None, storage_options)


def _save(
    checkpointer: Checkpointer,
    number: int,
    state: Mapping[str, Any],
    data: Mapping[str, Any] | None,
    *,
    group: dist.ProcessGroup | None = None,
    retention: Retention | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str | None:
    """Save checkpoint ``number`` of a sharded run: a collective over ``group`` (None: the
    default group), the same on the training thread (a synchronous save) and on the writer
    thread of an asynchronous one (its own group).

    Every rank writes its shards of ``state`` (:func:`_write_shards`); then the coordinator
    commits them with ``data`` (its records: schedulers, trainer state; other ranks pass None)
    through :meth:`~lightning_bpk.checkpointer.Checkpointer.save_checkpoint`, whose sentinel,
    written last, exists only once every rank's file is durable; and every rank learns the
    outcome. Returns the checkpoint's directory on the coordinator (None elsewhere, and where
    ``checkpoint_frequency`` skips ``number``). A failure anywhere raises on every rank: the
    coordinator's own error there, :class:`ShardedCheckpointError` elsewhere.
    """
    if retention is None and number % checkpointer.checkpoint_frequency:
        return None  # skipped alike on every rank, before anything is written
    shards = _write_shards(checkpointer, number, state, group, storage_options)
    path, error = None, None
    if shards is not None:
        try:
            path = checkpointer.save_checkpoint(
                number,
                data or {},
                retention=retention,
                staged=shards.staged,
                described=shards.files,
            )
        except Exception as e:  # every rank must reach the broadcast, and learn of it
            error = e
    failed = _broadcast(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if failed is not None:
        raise ShardedCheckpointError(f"rank 0 failed to commit checkpoint {number}: {failed}")
    return path


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
    and ``optimizers`` (sharded or not, on any number of ranks; every rank calls this), and the
    rest of Lightning's dict (loops, callbacks, schedulers, RNG states) as the return value.

    Without a process group it loads in this process alone, into a plain ``nn.Module``.
    ``path`` may be a URL (each rank fetches only the byte ranges of its shards).
    """
    found = location(path)
    checkpoint = _rest(found, storage_options)
    model_state = get_model_state_dict(module)
    optimizer_states = [get_optimizer_state_dict(module, o) for o in optimizers]
    state = _dcp_state(module, model_state, optimizers, optimizer_states)
    if not optimizers:
        state = {MODEL_KEY: state[MODEL_KEY], PARAM_IDS_KEY: state[PARAM_IDS_KEY]}
    try:
        reader = BurnpackStorageReader(found, storage_options=storage_options)
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:
        raise ShardedCheckpointError(f"loading the shards of {found} failed: {_failures(e)}") from e
    set_model_state_dict(module, state[MODEL_KEY])
    ids = param_ids(module)
    for i, optimizer in enumerate(optimizers):
        ours = state[trainer_state.numbered_key(trainer_state.OPTIMIZER_KEY, i)]
        set_optimizer_state_dict(module, optimizer, _to_fqns(ours, optimizer, ids))
    return checkpoint
