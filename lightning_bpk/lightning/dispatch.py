"""Where the callback's checkpoints come from and go to: the resume choice, and each save.

:class:`CheckpointDispatch` is the part of
:class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint` that talks to the
:class:`~lightning_bpk.checkpointer.Checkpointer`: rank 0 chooses the checkpoint to resume from
(``_choose_resume``, the checkpointer's one resume choice: it keeps what it read,
``_preloaded``), Lightning's ``resume_start`` loads it (``_intercept_resume``), and ``_save``
builds the checkpoint, has rank 0 write it (with the retention of its settings as an argument
for a save made whatever the frequency) and makes every rank learn the outcome. The callback
inherits it; the hooks that decide *when* live there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_bpk.checkpointer import (
    Checkpointer,
    Retention,
    bound_override_number,
    choose_resume,
    get_latest_checkpoint_number,
    list_checkpoints,
    verify_checkpoint,
)
from lightning_bpk.checkpointer._view import summarise
from lightning_bpk.errors import CheckpointResumeError, CheckpointSaveError
from lightning_bpk.layout import SHARDED_INDEX_KEY
from lightning_bpk.lightning import _compat, _resume, sharded, trainer_state
from lightning_bpk.lightning.async_save import AsyncCheckpointSaver
from lightning_bpk.lightning.data_position import POSITION_KEY, DataPosition
from lightning_bpk.lightning.ranks import Ranks
from lightning_bpk.lightning.triggers import FINISHED_KEY, SaveTriggers, finished
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.store import DirectoryGoneError, open_store

__all__ = ["CheckpointDispatch", "CheckpointSaveError"]

log = logging.getLogger("lightning_bpk")


def _untouched(error: BaseException) -> str:
    """What a failed save's message promises about the checkpoints before it: untouched, unless
    the directory itself was deleted (a :class:`~lightning_bpk.errors.DirectoryGoneError`
    anywhere in the chain), where they are gone with it and its message says so."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, DirectoryGoneError):
            return ""
        cause = cause.__cause__ or cause.__context__
    return "; earlier checkpoints are untouched"


class CheckpointDispatch:
    """Resume choice and save dispatch of
    :class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint`
    (which sets these attributes in ``__init__`` and ``setup``)."""

    storage_options: dict[str, Any] | None
    checkpoint_file_prefix: str
    sentinel_file_identifier: str
    checkpoint_frequency: int
    checkpoint_duration: int
    keep_every: int | None
    verify: bool
    distributed_save: bool
    triggers: SaveTriggers
    checkpointer: Checkpointer | None
    restored_number: int | None
    last_saved_number: int | None
    _saver: AsyncCheckpointSaver | None
    _ranks: Ranks | None
    _position: DataPosition
    _resume_number: int
    _preloaded: dict[str, Any] | None
    _resume_location: Path | str | None
    _replay_floor: int
    _reserved: bool

    @property
    def step_numbered(self) -> bool:
        """Checkpoints are numbered by global step (a step or time trigger is set), not epoch."""
        return self.triggers.step_numbered

    def _names(self) -> dict[str, Any]:
        return dict(
            sentinel_file_identifier=self.sentinel_file_identifier,
            checkpoint_file_prefix=self.checkpoint_file_prefix,
            storage_options=self.storage_options,
        )

    def _choose_resume(self, dirpath: Path | str) -> tuple[int, str | None]:
        """``(number, error)``: the newest checkpoint that verifies as it is loaded (-1: none;
        what was read is kept for ``resume_start``, on every backend: each sentinel and file
        read once), or gin's ``override_number``, which must name a complete checkpoint.
        Read-only (rank 0)."""
        store = open_store(dirpath, self.storage_options)
        store.check()  # unreachable, bad credentials, no bucket: say which
        required = trainer_state.REQUIRED_KEYS
        number = bound_override_number()
        if number is None and not self.verify:  # sentinels and sizes only; read at resume
            return get_latest_checkpoint_number(
                dirpath, required_keys=required, **self._names()
            ), None
        if number is None:
            choice = choose_resume(
                store,
                self.sentinel_file_identifier,
                self.checkpoint_file_prefix,
                required,
                at_most=2**63,
                unloaded=(SHARDED_INDEX_KEY,),
            )
            self._preloaded, self._resume_location = choice.data, choice.location
            return choice.number, None
        if number < 0:
            return number, None
        problems = verify_checkpoint(
            dirpath, number, full=False, required_keys=required, **self._names()
        )
        if not problems:
            return number, None
        complete = [e.number for e in list_checkpoints(dirpath, **self._names()) if e.complete]
        return -1, (
            f"cannot resume from checkpoint {number} in {dirpath} (gin "
            f"get_latest_checkpoint_number.override_number = {number}): {summarise(problems)}. "
            f"Complete checkpoints there: {complete or 'none'}. Nothing was changed; bind "
            "override_number to one of them, or unbind it to resume from the newest"
        )

    def _make_checkpointer(self, dirpath: Path | str, **overrides: Any) -> Checkpointer:
        settings: dict[str, Any] = dict(
            storage_options=self.storage_options,
            checkpoint_file_prefix=self.checkpoint_file_prefix,
            sentinel_file_identifier=self.sentinel_file_identifier,
            checkpoint_frequency=self.checkpoint_frequency,
            checkpoint_duration=self.checkpoint_duration,
            keep_every=self.keep_every,
        )
        if self.step_numbered:  # the triggers choose the steps; the checkpointer keeps them all
            settings["checkpoint_frequency"] = 1
        settings.update(overrides)
        return Checkpointer(dirpath, **settings)

    def _intercept_resume(self, trainer: pl.Trainer) -> None:
        """Make the next ``resume_start`` load our checkpoint when ``fit`` got no ckpt_path."""

        def resume_start(
            original: Any, checkpoint_path: Any, weights_only: bool | None
        ) -> tuple[Any, dict[str, Any]] | None:
            path = checkpoint_path
            if path is None and self._resume_number >= 0:
                assert self.checkpointer is not None
                path = self._resume_location or self.checkpointer.checkpoint_path(
                    self._resume_number
                )
            ours = checkpoint_path is None and path is not None
            if not ours and (path is None or not trainer_state.is_checkpoint_directory(path)):
                if path is not None:
                    self._refuse_member_of_checkpoint(path)
                original(checkpoint_path, weights_only)  # Lightning's path: its IO, its checks
                return None
            if ours:
                self.restored_number = self._resume_number
                rank_zero_info(f"BurnpackCheckpoint: resuming from checkpoint {path}")
            if ours and self._preloaded is not None:  # rank 0 read it choosing
                data, self._preloaded = self._preloaded, None
                return path, trainer_state.from_records(data, str(path))
            if sharded.is_sharded(path, storage_options=self.storage_options):  # FSDP2 etc.
                # every rank reads its part
                return path, sharded._restore(trainer, path, self.storage_options)
            return path, trainer_state.load(path, self.storage_options)

        _compat.intercept_resume_start(trainer, resume_start)

    def _refuse_member_of_checkpoint(self, path: Any) -> None:
        """``ckpt_path`` names a file inside a checkpoint directory (``ckpt.3/model.bpk``):
        Lightning's reader would fail on it without naming it; stop, naming the directory."""
        problem = _resume.member_of_checkpoint(path, self.storage_options)
        if problem is not None:
            raise CheckpointResumeError(problem)

    def _reserve_staging(self, trainer: pl.Trainer) -> None:
        """After the first optimizer step (its state exists now), let the async saver allocate
        the model's and optimizers' staging buffers on its own thread, before any save: rank
        0's for a whole checkpoint, every rank's for the shards it writes of a sharded one."""
        self._reserved = True
        if self._saver is None:
            return
        module = trainer.lightning_module
        if self._sharded(trainer, {"state_dict": module.state_dict()}):
            checkpoint = {"state_dict": module.state_dict()}
            self._saver.reserve({}, shards=sharded._take_state(trainer, checkpoint))
            return
        if not trainer.is_global_zero:
            return
        data: dict[str, Any] = {trainer_state.MODEL_KEY: ModuleRecord.from_module(module)}
        for i, optimizer in enumerate(trainer.optimizers):
            key = trainer_state.numbered_key(trainer_state.OPTIMIZER_KEY, i)
            data[key] = OptimizerRecord.from_optimizer(optimizer, module)
        self._saver.reserve(data)

    def _save(
        self,
        trainer: pl.Trainer,
        number: int,
        consumed: int | None = None,
        preempted: bool = False,
        flush: bool = False,
    ) -> None:
        """Save checkpoint ``number`` (all ranks call this; rank 0 writes, or every rank its
        shards; all learn the result).

        ``consumed`` is the number of batches of this epoch a mid-epoch save comes after
        (``None``: the epoch's end). ``flush`` waits for an asynchronous write to be durable.
        """
        started = self.triggers.save_started()
        epoch_end = consumed is None
        if number <= self._replay_floor:
            return  # this replayed epoch has not yet passed the checkpoint it resumed from
        # Lightning's own dict builder; weights_only=False here means "include optimizers,
        # schedulers and callback states", not unpickling: nothing is ever loaded with pickle.
        checkpoint = _compat.dump_checkpoint(trainer)
        shards = None  # the DCP state of a sharded save, every rank's
        if self._sharded(trainer, checkpoint):
            shards = sharded._take_state(trainer, checkpoint)
        assert self._ranks is not None  # made in setup
        ranks = self._ranks.gather(self._position.capture(consumed or 0, epoch_end))
        extra: dict[str, Any] = {POSITION_KEY: ranks}
        ended = finished(trainer, epoch_end)
        if ended is not None:
            extra[FINISHED_KEY] = ended
        if not epoch_end:  # every loader is positioned: the loop counters are as they are
            extra[trainer_state.PREEMPTED_KEY] = {
                "epoch": trainer.current_epoch,
                "batches": consumed,
                "replay": False,
            }
        forced = preempted or ended is not None or not epoch_end
        retention = self._retention(number, forced)
        checkpoint = dict(checkpoint, **extra)
        error: BaseException | None = None
        try:
            if shards is not None:  # every rank writes its shards
                self._write_sharded(trainer, number, shards, checkpoint, retention, flush)
            elif trainer.is_global_zero:
                self._write(trainer, number, checkpoint, retention)
                if flush and self._saver is not None:
                    self._saver.wait()
        except Exception as e:
            error = e
        if self._ranks.agree(int(error is not None)):
            if error is None:
                raise CheckpointSaveError(
                    f"another rank failed to save checkpoint {number} (its log says why)"
                )
            raise CheckpointSaveError(self._failure(number, error)) from error
        self.last_saved_number = number
        self.triggers.saved(trainer.global_step, started)

    def _failure(self, number: int, error: BaseException) -> str:
        """What a failed save says: the error (and, for an asynchronous save's, which earlier
        save it comes from: its note), and what became of the checkpoints before it."""
        notes = getattr(error, "__notes__", [])
        if isinstance(error, sharded.ShardedCheckpointError):  # it names the checkpoint
            return " ".join([f"{error}{_untouched(error)}", *notes])
        detail = " ".join([str(error), *notes])
        assert self.checkpointer is not None  # made in setup
        return (
            f"saving checkpoint {number} into {self.checkpointer.base_directory} failed "
            f"({detail}){_untouched(error)}"
        )

    def _sharded(self, trainer: pl.Trainer, checkpoint: dict) -> bool:
        """Every rank writes its share: FSDP2 / tensor parallel, or ``distributed_save``."""
        return sharded._holds_dtensors(checkpoint) or (
            self.distributed_save and trainer.world_size > 1
        )

    def _retention(self, number: int, forced: bool) -> Retention | None:
        """The retention of a save made whatever the frequency (None: an ordinary save)."""
        assert self.checkpointer is not None
        if not forced or number % self.checkpointer.checkpoint_frequency == 0:
            return None
        # Saved whatever the frequency; the same retention (the last d, the same milestones).
        f, k = self.checkpoint_frequency, self.keep_every
        return Retention(1, self.checkpoint_duration, None if k is None else k * f)

    def _write(
        self, trainer: pl.Trainer, number: int, checkpoint: dict, retention: Retention | None
    ) -> None:
        """Rank 0 saves the whole checkpoint (asynchronously with a saver)."""
        assert self.checkpointer is not None
        checkpointer = self.checkpointer
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        data = trainer_state.to_records(
            checkpoint, trainer.lightning_module, trainer.optimizers, schedulers
        )
        if self._saver is not None:  # raises an earlier failure; logs once committed
            self._saver.save_checkpoint(
                checkpointer, number, data, self._log_saved(number), retention=retention
            )
            return
        # a subclass of Checkpointer may predate the retention argument: pass it only if set
        if retention is None:
            path = checkpointer.save_checkpoint(number, data)
        else:
            path = checkpointer.save_checkpoint(number, data, retention=retention)
        if path is not None:
            self._log_saved(number)(path)

    def _write_sharded(
        self,
        trainer: pl.Trainer,
        number: int,
        shards: dict[str, Any],
        checkpoint: dict,
        retention: Retention | None,
        flush: bool,
    ) -> None:
        """Every rank writes its ``shards`` and rank 0 commits them with the other records
        (asynchronously with a saver: every rank's writer thread; raises an earlier failure)."""
        assert self.checkpointer is not None
        data = None
        if trainer.is_global_zero:
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            data = trainer_state._other_records(checkpoint, schedulers)
        if self._saver is None:
            path = sharded._save(
                self.checkpointer,
                number,
                shards,
                data,
                retention=retention,
                storage_options=self.storage_options,
            )
            if path is not None:
                log.info("saved sharded checkpoint %d at %s", number, path)
            return
        logged = self._log_saved(number) if trainer.is_global_zero else None
        self._saver.save_sharded(
            self.checkpointer,
            number,
            shards,
            data,
            logged,
            retention=retention,
            storage_options=self.storage_options,
        )
        if flush:
            self._saver.wait()

    @staticmethod
    def _log_saved(number: int) -> Callable[[Path | str], None]:
        """The one "saved checkpoint N at PATH" line, for a synchronous or asynchronous save."""
        return lambda path: log.info("saved checkpoint %d at %s", number, path)

    def _flush(self) -> None:
        """Wait for an asynchronous write in flight; raise CheckpointSaveError if it failed."""
        if self._saver is None:
            return
        try:
            self._saver.close()
        except Exception as e:
            detail = " ".join([str(e), *getattr(e, "__notes__", [])])
            raise CheckpointSaveError(
                f"the last asynchronous checkpoint save failed ({detail}){_untouched(e)}"
            ) from e
