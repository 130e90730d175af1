"""The sharded save, written once: every rank writes its shards, rank 0 commits them.

A sharded run (FSDP2 / tensor parallel, or replicated state written by every rank with
``distributed_save``) saves a checkpoint in three steps, one collective, one commit
(:func:`save`):

1. rank 0 checks the lease and chooses the checkpoint's staging prefix
   (:meth:`~lightning_bpk.checkpointer.Checkpointer.begin`), and every rank learns it;
2. every rank writes its shards of the DCP state there with
   :class:`~lightning_bpk.dcp.BurnpackStorageWriter` (``commit=False``: the index is an
   ordinary file of the staging prefix);
3. rank 0 commits them with the other records through
   :meth:`~lightning_bpk.checkpointer.Checkpointer.save_checkpoint`, whose sentinel, written last
   once every rank's file is durable, is the one commit; every rank learns the outcome.

If any rank fails, every rank raises, rank 0 removes what was written, and every earlier
checkpoint stays as it was. The Lightning callback and the Fabric manager build the DCP state
(:func:`dcp_state`: the model's shards under ``model``, each optimizer's state keyed by
parameter id under ``optim``, ``optim-1``...) and call :func:`save`, on the training thread or,
for an asynchronous save, on every rank's writer thread over a process group of its own
(:meth:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver.save_sharded`); :func:`load_into`
loads such a checkpoint back in place, resharded to this run's layout by DCP's planner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

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

from lightning_bpk.checkpointer import Checkpointer, Retention, Staged
from lightning_bpk.checkpointer.manifest import FileEntry
from lightning_bpk.dcp import (
    INDEX_KIND,
    SHARD_KIND,
    BurnpackStorageReader,
    BurnpackStorageWriter,
    ShardedCheckpointError,
    _index,
)
from lightning_bpk.layout import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    PARAM_IDS_KEY,
    RECORD_SUFFIX,
    _numbered_key,
    _sharded_index_name,
)
from lightning_bpk.records import param_ids
from lightning_bpk.records.optimizer import BURN_NAMES
from lightning_bpk.store import location, open_store

__all__ = ["Shards", "dcp_state", "load_into", "save"]


# --- optimizer state: torch's (fqn-keyed) <-> ours (param-id keyed, Burn's names) ----------------


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


def dcp_state(
    module: nn.Module,
    model_state: Mapping[str, Any],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, Any]:
    """The DCP state of a sharded save of ``module`` (its ``model_state``: a state dict of
    ``DTensor`` shards, or plain tensors) and its ``optimizers``: the model under ``model``,
    parameter ids under ``param_ids``, each optimizer's state keyed by parameter id (Burn's
    names) under ``optim``, ``optim-1``..."""
    ids = param_ids(module)
    state: dict[str, Any] = {
        MODEL_KEY: dict(model_state),
        PARAM_IDS_KEY: {name: ids[name] for name in model_state if name in ids},
    }
    for i, optimizer in enumerate(optimizers):
        osd = get_optimizer_state_dict(module, optimizer)
        state[_numbered_key(OPTIMIZER_KEY, i)] = _to_ids(osd, optimizer, ids)
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
            INDEX_KIND if name == _sharded_index_name() else SHARD_KIND,
            info["size"],
            info["head_size"],
            info["head_xxh3"],
        )
        for name, info in writer.files.items()
    }
    return Shards(staged, files)


def save(
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


def load_into(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Load the model and optimizer shards of the sharded checkpoint directory ``path`` straight
    into ``module`` and ``optimizers`` (sharded or not, on any number of ranks: every rank calls
    this; without a process group, in this process alone, into a plain ``nn.Module``). ``path``
    may be a URL (each rank fetches only the byte ranges of its shards)."""
    found = location(path)
    _index.refuse_links(open_store(found, storage_options), "")  # before reading
    state = dcp_state(module, get_model_state_dict(module), optimizers)
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
        ours = state[_numbered_key(OPTIMIZER_KEY, i)]
        set_optimizer_state_dict(module, optimizer, _to_fqns(ours, optimizer, ids))
