"""What one save of the callback holds, taken from a Lightning ``Trainer``.

The run layer writes it (:class:`~lightning_bpk.runtime.saves.Saves`); here Lightning's own dict
(``dump_checkpoint``: loops, callback states, hooks exactly Lightning's) gets this package's
additions (every rank's data position, why the run finished, where a mid-epoch save stands,
what Lightning's own dict leaves out: :mod:`~lightning_bpk.lightning._exact`)
and becomes records (:mod:`lightning_bpk.lightning.trainer_state`), or, for a sharded run, the
DCP state every rank writes plus the records rank 0 commits beside it
(:mod:`lightning_bpk.lightning.sharded`). :func:`reserve` lets an asynchronous saver allocate
its staging buffers for those records ahead of the first save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl

from lightning_bpk.layout import MODEL_KEY, OPTIMIZER_KEY, _numbered_key
from lightning_bpk.lightning import _compat, _exact, _log_continuity, sharded, trainer_state
from lightning_bpk.lightning.data_position import POSITION_KEY
from lightning_bpk.lightning.triggers import FINISHED_KEY, finished
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.rng import capture_rng


class SaveData(NamedTuple):
    """One save: ``records()`` builds rank 0's records (inside the save, so a value that cannot
    be stored fails it like a write); ``shards``: this rank's DCP state of a sharded save
    (None: rank 0 writes everything); ``forced``: made whatever the checkpoint frequency (the
    end of training, or mid-epoch)."""

    records: Callable[[], dict[str, Any]]
    shards: dict[str, Any] | None
    forced: bool


def is_sharded(trainer: pl.Trainer, checkpoint: dict, distributed_save: bool) -> bool:
    """Every rank writes its share: FSDP2 / tensor parallel, or ``distributed_save``."""
    return sharded._holds_dtensors(checkpoint) or (distributed_save and trainer.world_size > 1)


def collect(
    trainer: pl.Trainer,
    positions: Callable[[dict], list[Any] | None],
    consumed: int | None,
    distributed_save: bool,
) -> SaveData:
    """The save of ``trainer`` now (every rank): ``positions(rng)`` gathers every rank's data
    position on rank 0 (a collective; ``rng``: this rank's RNG states, which its position
    holds); ``consumed``, the batches of this epoch a mid-epoch save comes after (None: the
    epoch's end)."""
    epoch_end = consumed is None
    rng = capture_rng()  # once: this rank's position and rank 0's trainer record hold them
    # Lightning's own dict builder; weights_only=False there means "include optimizers,
    # schedulers and callback states", not unpickling: nothing is ever loaded with pickle.
    checkpoint = _compat.dump_checkpoint(trainer)
    shards = None
    if is_sharded(trainer, checkpoint, distributed_save):
        shards = sharded._take_state(trainer, checkpoint)
    checkpoint[POSITION_KEY] = positions(rng)
    checkpoint[_exact.EXACT_KEY] = _exact.capture(trainer, epoch_end)  # what Lightning drops
    checkpoint[_log_continuity.LOGGERS_KEY] = _log_continuity.capture(trainer)
    ended = finished(trainer, epoch_end)
    if ended is not None:
        checkpoint[FINISHED_KEY] = ended
    if not epoch_end:  # every loader is positioned: the loop counters are as they are
        checkpoint[trainer_state.PREEMPTED_KEY] = {
            "epoch": trainer.current_epoch,
            "batches": consumed,
            "replay": False,
        }
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]

    def records() -> dict[str, Any]:
        if shards is not None:  # the model and optimizers are in the shards
            return trainer_state._other_records(checkpoint, schedulers, rng)
        module = trainer.lightning_module
        return trainer_state.to_records(checkpoint, module, trainer.optimizers, schedulers, rng)

    return SaveData(records, shards, ended is not None or not epoch_end)


def reserve(trainer: pl.Trainer, saver: AsyncCheckpointSaver, distributed_save: bool) -> None:
    """After the first optimizer step (its state exists now), let the async saver allocate the
    model's and optimizers' staging buffers on its own thread, before any save: rank 0's for a
    whole checkpoint, every rank's for the shards it writes of a sharded one."""
    module = trainer.lightning_module
    if is_sharded(trainer, {"state_dict": module.state_dict()}, distributed_save):
        checkpoint = {"state_dict": module.state_dict()}
        saver.reserve({}, shards=sharded._take_state(trainer, checkpoint))
        return
    if not trainer.is_global_zero:
        return
    data: dict[str, Any] = {MODEL_KEY: ModuleRecord.from_module(module)}
    for i, optimizer in enumerate(trainer.optimizers):
        key = _numbered_key(OPTIMIZER_KEY, i)
        data[key] = OptimizerRecord.from_optimizer(optimizer, module)
    saver.reserve(data)
