"""``BurnpackCheckpoint``: save every epoch, resume by itself, survive preemption.

One line of setup::

    trainer = L.Trainer(callbacks=[BurnpackCheckpoint()])
    trainer.fit(model)            # a second run with the same directory continues where it was

**Saving.** At the end of every training epoch N (Lightning's 0-based ``current_epoch``, after
validation, when ``N % checkpoint_frequency == 0``) the dict Lightning itself builds
(``dump_checkpoint``, so loops, callback states and hooks are exactly Lightning's) is split by
:mod:`lightning_bpk.trainer_state` into ``model.bpk``, ``optim.bpk``..., ``scheduler.bpk``...
and ``trainer.bpk`` (with the RNG states), and saved as checkpoint N by a
:class:`~lightning_bpk.checkpointer.Checkpointer` in ``dirpath`` (default
``{default_root_dir}/checkpoints``)::

    checkpoints/
    ├── ckpt.3/{model,optim,scheduler,trainer}.bpk
    ├── sentinel_checkpoint_complete.3
    └── ckpt.4/ ... sentinel_checkpoint_complete.4

Only global rank 0 writes; all ranks then agree on the outcome, so a failed save (a full disk)
raises :class:`CheckpointSaveError` on every rank and leaves every earlier checkpoint intact.

**Resuming.** In ``setup`` rank 0 finds the newest checkpoint that verifies
(:func:`~lightning_bpk.checkpointer.get_latest_checkpoint_number` with ``verify=True``, which
falls back past damaged ones and honours gin's ``override_number``); the number is shared with
every rank. Lightning 2.6 chooses ``ckpt_path`` before any callback runs, so the callback
intercepts the trainer's ``_checkpoint_connector.resume_start`` once: when ``fit`` got no
``ckpt_path`` it loads checkpoint N there, and Lightning restores everything in its own order
(model, callbacks, precision, loops, optimizers, schedulers), continuing at epoch N+1. An
explicit ``ckpt_path`` wins (a checkpoint directory of ours works there too, without the IO
plugin); ``resume=False`` starts fresh. The RNG states are restored at ``on_fit_start``, the
last hook before Lightning creates the training DataLoader iterator (sanity validation runs in
``isolate_rng``), so the continued run is bit-identical to one that never stopped. Under DDP
rank 0's states are saved and every rank restores them (exact when all ranks were seeded alike,
as ``seed_everything`` does; per-rank streams that differ are not captured).

**Preemption.** During training, SIGTERM and SIGUSR1 only set a flag (the previous handlers
still run, except Lightning's own SIGTERM notifier, whose in-handler broadcast can deadlock DDP).
At the next ``on_train_batch_end`` all ranks agree on the flag (all-reduce MAX), save, and stop
with :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` (a ``SystemExit``
without code: exit status 0). A signal during validation is acted on at epoch end, after the
regular save. From then on a repeated signal (schedulers send more than one) is ignored until the
process has exited, so the exit status stays 0; a later ``fit`` in the same process brings the
default handlers back.

**SLURM.** Under SLURM (Lightning's ``SLURMEnvironment``, auto-requeue on) Lightning's own
SIGUSR1 handler, which saves and requeues inside the handler, does not run either; when the
requeue signal stopped training, global rank 0 runs ``scontrol requeue`` after the save is
complete, and the requeued job resumes from it (:mod:`lightning_bpk.slurm`).

**What a mid-epoch save replays.** A plain DataLoader cannot resume mid-epoch, so a checkpoint
saved after ``k`` batches of epoch E holds the model, optimizer, schedulers and RNG as they were
after those ``k`` batches, but Lightning's loop counters as they were at the start of epoch E
(those of checkpoint E-1; none for E = 0). It is saved as number E (forced, whatever the
frequency) and marked in ``trainer.bpk`` under ``lightning_bpk_preempted``. Resuming from it
runs epoch E again from its first batch, with the next shuffle of the RNG stream: the ``k``
batches' updates are kept and all of epoch E's data is seen once more; ``global_step`` goes back
to its value at the start of epoch E (the optimizer's own step counts, e.g. Adam's, keep the
``k`` steps), and a per-step scheduler keeps its ``k`` steps. The end-of-epoch save of E then
replaces the marked checkpoint (with ``checkpoint_frequency > 1`` and E not a multiple of it,
the marked checkpoint stays until garbage collection passes it).
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import gin
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_bpk import _lightning_compat, sharded, slurm, trainer_state
from lightning_bpk.async_save import AsyncCheckpointSaver
from lightning_bpk.checkpointer import Checkpointer, get_latest_checkpoint_number
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX

__all__ = [
    "PREEMPTION_SIGNALS",
    "BurnpackCheckpoint",
    "CheckpointSaveError",
]

log = logging.getLogger("lightning_bpk")

# Signals that mean "you are about to be stopped" (SIGTERM: Kubernetes, SageMaker, SLURM at the
# time limit; SIGUSR1: SLURM's --signal default for requeue).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class CheckpointSaveError(LightningBpkError, RuntimeError):
    """Saving a checkpoint failed (on rank 0); earlier checkpoints are untouched."""


def _agree(trainer: pl.Trainer, value: int) -> int:
    """The maximum of ``value`` over all ranks (every rank must call this at the same point)."""
    tensor = torch.tensor(value, dtype=torch.int64, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="max").item())


def _others(handler: object) -> list[Callable[..., Any]]:
    """The callables a previously installed handler runs, without Lightning's own ones."""
    handlers = _lightning_compat.composed_signal_handlers(handler)
    return [
        h for h in handlers if callable(h) and not _lightning_compat.is_lightning_signal_handler(h)
    ]


def _ignore_while_stopping(signum: int, frame: FrameType | None) -> None:
    """Stands in for a default (fatal) disposition once a preemption stop has saved.

    Schedulers repeat their signal (SLURM signals every step, a requeue sends SIGTERM, a user
    presses twice); between the save and the process's exit that must not turn exit status 0
    into death by signal.
    """


def _ignore_at_exit(signums: Sequence[int]) -> None:
    """Interpreter finalization resets Python-level handlers to the default (fatal) one before
    torch and the other modules are torn down, so for that last stretch ignore them outright."""
    for signum in signums:
        if signal.getsignal(signum) is _ignore_while_stopping:
            signal.signal(signum, signal.SIG_IGN)


def _stop_ignoring(trainer: pl.Trainer, signums: Sequence[int]) -> None:
    """A new fit in a process that survived a preemption stop: the defaults are back."""
    originals = _lightning_compat.handlers_restored_at_teardown(trainer)
    for signum in signums:
        if originals.get(signum) is _ignore_while_stopping:
            originals[signum] = signal.SIG_DFL
        if signal.getsignal(signum) is _ignore_while_stopping:
            signal.signal(signum, signal.SIG_DFL)


@gin.configurable(module="lightning_bpk")
class BurnpackCheckpoint(Checkpoint):
    """Checkpoint every epoch in burnpack through a Dopamine-style Checkpointer, and resume.

    Args:
        dirpath: where checkpoints go; ``None`` means ``{trainer.default_root_dir}/checkpoints``.
        checkpoint_file_prefix: data directories are ``{prefix}.{N}``.
        sentinel_file_identifier: sentinels are ``sentinel_{identifier}_complete.{N}``.
        checkpoint_frequency: save the epochs that are multiples of this.
        checkpoint_duration: keep the last this many saved checkpoints.
        keep_every: also keep every ``keep_every``-th saved checkpoint forever (milestones).
            These five go to the :class:`~lightning_bpk.checkpointer.Checkpointer`.
        resume: continue from the newest complete checkpoint in ``dirpath`` when ``fit`` gets no
            ``ckpt_path`` (gin: ``get_latest_checkpoint_number.override_number`` picks another).
        verify: check every byte of the chosen checkpoint before resuming from it (falling
            back to older ones); ``False`` checks sentinels and file sizes only.
        preemption_signals: signals that trigger a save-and-stop (empty: none); under SLURM
            with auto-requeue, the environment's ``requeue_signal`` too.
        async_save: write checkpoints on a background thread
            (:class:`~lightning_bpk.async_save.AsyncCheckpointSaver`): training waits only for
            a copy into reused staging buffers. The checkpoint becomes complete (sentinel) once
            its data is durable; a failed write raises :class:`CheckpointSaveError` at the next
            save or at teardown; a preemption save and teardown wait for the write.
        auto_requeue: under SLURM with Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the
            default), when its requeue signal (SIGUSR1) stopped training, rank 0 runs
            ``scontrol requeue`` once the preemption checkpoint is complete
            (:mod:`lightning_bpk.slurm`); ``False``: save and stop only.
        distributed_save: with replicated state (DDP), every rank writes a share of the model
            and optimizer tensors (torch DCP through :mod:`lightning_bpk.sharded`), so a save's
            wall time can fall as ranks are added on a parallel filesystem; ``False`` (default):
            rank 0 alone writes. Sharded (FSDP2) state is always written by every rank.

    Example::

        >>> cb = BurnpackCheckpoint(dirpath="/tmp/run/ckpt", keep_every=5)
        >>> cb.checkpoint_frequency, cb.resume
        (1, True)
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        checkpoint_file_prefix: str = DEFAULT_PREFIX,
        sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
        checkpoint_frequency: int = 1,
        checkpoint_duration: int = 4,
        keep_every: int | None = None,
        resume: bool = True,
        verify: bool = True,
        preemption_signals: Sequence[int] = PREEMPTION_SIGNALS,
        async_save: bool = False,
        auto_requeue: bool = True,
        distributed_save: bool = False,
    ) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.checkpoint_file_prefix = checkpoint_file_prefix
        self.sentinel_file_identifier = sentinel_file_identifier
        self.checkpoint_frequency = checkpoint_frequency
        self.checkpoint_duration = checkpoint_duration
        self.keep_every = keep_every
        self.resume = resume
        self.verify = verify
        self.preemption_signals = tuple(preemption_signals)
        self.async_save = async_save
        self.auto_requeue = auto_requeue
        self.distributed_save = distributed_save
        self._saver = AsyncCheckpointSaver() if async_save else None  # used on rank 0 only
        self.checkpointer: Checkpointer | None = None
        self.restored_number: int | None = None  # the checkpoint this fit resumed from
        self.last_saved_number: int | None = None
        self._resume_number = -1
        self._rng: dict | None = None  # RNG states to restore at fit start
        self._fit_started = False
        self._boundary_loops: dict | None = None  # loop state at the start of this epoch
        self._preempt_requested = False
        self._requeue_signal: int | None = None  # set in setup when SLURM auto-requeue applies
        self._requeue_requested = False  # that signal arrived (on this rank)
        self._requeue_agreed = False  # ... on any rank, at the agreed step
        self._stopping = False  # a preemption stop is under way: the process is about to exit
        self._previous_handlers: dict[int, Any] = {}

    @property
    def state_key(self) -> str:
        return _lightning_compat.generate_state_key(
            self,
            dirpath=None if self.dirpath is None else str(self.dirpath),
            checkpoint_file_prefix=self.checkpoint_file_prefix,
        )

    # -- setup and resume ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dirpath = self.dirpath or Path(trainer.default_root_dir) / "checkpoints"
        dirpath = Path(trainer.strategy.broadcast(str(dirpath)))
        if trainer.is_global_zero:
            self.checkpointer = self._make_checkpointer(dirpath)
        trainer.strategy.barrier("BurnpackCheckpoint.setup")  # rank 0 created the directory
        if not trainer.is_global_zero:
            self.checkpointer = self._make_checkpointer(dirpath)
        self._fit_started = False
        self._rng = None
        self._boundary_loops = None
        self.restored_number = None
        number = -1
        if self.resume and trainer.is_global_zero:
            number = get_latest_checkpoint_number(
                dirpath,
                sentinel_file_identifier=self.sentinel_file_identifier,
                checkpoint_file_prefix=self.checkpoint_file_prefix,
                verify=self.verify,
            )
        self._resume_number = _agree(trainer, number) if self.resume else -1
        self._requeue_signal = slurm.requeue_signal(trainer) if self.auto_requeue else None
        self._intercept_resume(trainer)

    def _make_checkpointer(self, dirpath: Path, **overrides: Any) -> Checkpointer:
        settings: dict[str, Any] = dict(
            checkpoint_file_prefix=self.checkpoint_file_prefix,
            sentinel_file_identifier=self.sentinel_file_identifier,
            checkpoint_frequency=self.checkpoint_frequency,
            checkpoint_duration=self.checkpoint_duration,
            keep_every=self.keep_every,
        )
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
                path = self.checkpointer.checkpoint_path(self._resume_number)
            if path is None or not Path(path).is_dir():
                original(checkpoint_path, weights_only)  # Lightning's path: its IO, its checks
                return None
            if checkpoint_path is None:
                self.restored_number = self._resume_number
                rank_zero_info(f"BurnpackCheckpoint: resuming from checkpoint {path}")
            if sharded.is_sharded(path):  # FSDP2 / split writes: every rank reads its part
                return path, sharded.restore(trainer, path)
            return path, trainer_state.load(path)

        _lightning_compat.intercept_resume_start(trainer, resume_start)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._rng = checkpoint.get(trainer_state.RNG_KEY)
        if self._fit_started:  # strategies that restore after setup (FSDP, DeepSpeed)
            self._restore_rng()
        loops = checkpoint.get("loops")
        self._boundary_loops = copy.deepcopy(loops) if loops is not None else None
        preempted = checkpoint.get(trainer_state.PREEMPTED_KEY)
        if preempted:
            batches = preempted["batches"]
            where = (
                f"epoch {checkpoint.get('epoch')}, preempted after {batches} "
                f"batch{'es' if batches != 1 else ''} (that epoch is replayed from its first batch)"
            )
        else:
            where = f"the end of epoch {checkpoint.get('epoch')}"
        if trainer.is_global_zero:
            log.info("restored %s, saved at %s", trainer.ckpt_path, where)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = True
        self._restore_rng()

    def _restore_rng(self) -> None:
        if self._rng is not None:
            trainer_state.restore_rng(self._rng)
            self._rng = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.restored_number is not None:
            log.info(
                "continuing training at epoch %d (global step %d) after checkpoint %d",
                trainer.current_epoch,
                trainer.global_step,
                self.restored_number,
            )
        if trainer.is_global_zero:
            slurm.log_restart(None if trainer.ckpt_path is None else str(trainer.ckpt_path))
        self._install_signal_handlers(trainer)

    # -- saving --------------------------------------------------------------------------------

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._preemption_agreed(trainer):
            return
        epoch = trainer.current_epoch
        preempted = {"epoch": epoch, "batches": batch_idx + 1}
        self._save(trainer, epoch, preempted=preempted, flush=True)
        self._stop(trainer, f"after batch {batch_idx} of epoch {epoch}")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        preempted = self._preemption_agreed(trainer)
        if preempted or epoch % self.checkpoint_frequency == 0:
            self._save(trainer, epoch, flush=preempted)
        self._boundary_loops = copy.deepcopy(_lightning_compat.loops_state_dict(trainer))
        if preempted:
            self._stop(trainer, f"at the end of epoch {epoch}")

    def _save(
        self, trainer: pl.Trainer, number: int, preempted: dict | None = None, flush: bool = False
    ) -> None:
        """Save checkpoint ``number`` (all ranks call this; rank 0 writes, all learn the result).

        ``flush`` waits for an asynchronous write to be durable (before stopping on preemption).
        """
        # Lightning's own dict builder; weights_only=False here means "include optimizers,
        # schedulers and callback states", not unpickling: nothing is ever loaded with pickle.
        checkpoint = _lightning_compat.dump_checkpoint(trainer)
        staged: dict = {}
        if sharded.holds_dtensors(checkpoint) or (  # FSDP2 / tensor parallel, or by choice
            self.distributed_save and trainer.world_size > 1
        ):
            try:
                staged = sharded.save_shards(trainer, self.checkpointer, number, checkpoint)
            except sharded.ShardedCheckpointError as e:  # raised on every rank alike
                raise CheckpointSaveError(f"{e}; earlier checkpoints are untouched") from e
        error: BaseException | None = None
        if trainer.is_global_zero:
            try:
                self._write(trainer, number, checkpoint, preempted, staged)
                if flush and self._saver is not None:
                    self._saver.wait()
            except Exception as e:
                error = e
        if _agree(trainer, int(error is not None)):
            if error is not None:
                # an asynchronous save's error says which earlier save it comes from in a note
                detail = " ".join([str(error), *getattr(error, "__notes__", [])])
                assert self.checkpointer is not None  # rank 0's, made in setup
                raise CheckpointSaveError(
                    f"saving checkpoint {number} into {self.checkpointer.base_directory} failed "
                    f"({detail}); earlier checkpoints are untouched"
                ) from error
            raise CheckpointSaveError(f"rank 0 failed to save checkpoint {number}")
        self.last_saved_number = number

    def _write(
        self,
        trainer: pl.Trainer,
        number: int,
        checkpoint: dict,
        preempted: dict | None,
        staged: dict,
    ) -> None:
        assert self.checkpointer is not None
        checkpointer = self.checkpointer
        if preempted is not None:
            checkpoint = dict(checkpoint, **{trainer_state.PREEMPTED_KEY: preempted})
            checkpoint.pop("loops")
            if self._boundary_loops is not None:
                checkpoint["loops"] = self._boundary_loops
            # Saved whatever the frequency; the same retention (the last d, the same milestones).
            f, k = self.checkpoint_frequency, self.keep_every
            checkpointer = self._make_checkpointer(
                checkpointer.base_directory,
                checkpoint_frequency=1,
                keep_every=None if k is None else k * f,
            )
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        if staged:  # the shards are written; publish them with the rest, synchronously
            try:
                path = checkpointer.save_checkpoint(
                    number, {**staged, **sharded.records(checkpoint, schedulers)}
                )
            finally:
                sharded.discard(staged)
            log.info("saved sharded checkpoint %d at %s", number, path)
            return
        data = trainer_state.to_records(
            checkpoint, trainer.lightning_module, trainer.optimizers, schedulers
        )
        if self._saver is not None:
            self._saver.save_checkpoint(checkpointer, number, data)  # raises an earlier failure
            return
        path = checkpointer.save_checkpoint(number, data)
        if path is not None:
            log.info("saved checkpoint %d at %s", number, path)

    # -- preemption ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Never save here: the main thread may be anywhere (inside a collective, a write).
        self._preempt_requested = True
        self._requeue_requested |= signum == self._requeue_signal
        for handler in _others(self._previous_handlers.get(signum)):
            handler(signum, frame)

    def _install_signal_handlers(self, trainer: pl.Trainer) -> None:
        self._preempt_requested = self._requeue_requested = False
        self._stopping = False
        if self._previous_handlers:
            return
        signums = list(self.preemption_signals)
        if signums and self._requeue_signal is not None and self._requeue_signal not in signums:
            signums.append(self._requeue_signal)  # SLURMEnvironment(requeue_signal=...)
        _stop_ignoring(trainer, signums)
        for signum in signums:
            try:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: signals cannot be handled here
                break

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _preemption_agreed(self, trainer: pl.Trainer) -> bool:
        requested = int(self._preempt_requested) + int(self._requeue_requested)  # 0, 1 or 2
        agreed = requested if trainer.world_size == 1 else _agree(trainer, requested)
        self._requeue_agreed = agreed == 2  # a requeue signal reached some rank
        return agreed > 0

    def _stop(self, trainer: pl.Trainer, where: str) -> None:
        """Stop after the preemption save (complete and flushed on every rank by now)."""
        if trainer.is_global_zero:
            if self._requeue_agreed:
                assert self.checkpointer is not None and self.last_saved_number is not None
                slurm.requeue(str(self.checkpointer.checkpoint_path(self.last_saved_number)))
            log.info(
                "preemption signal: saved checkpoint %s %s; stopping (exit status 0)",
                self.last_saved_number,
                where,
            )
        self._stopping = True
        raise SIGTERMException()

    def _keep_ignoring_signals(self, trainer: pl.Trainer) -> None:
        """After a preemption stop, no further preemption signal may kill the exiting process.

        Our handler stays until Lightning's teardown reinstalls the handlers it found at fit
        start; where that was the fatal default, it reinstalls :func:`_ignore_while_stopping`
        instead (and :func:`_ignore_at_exit` covers interpreter finalization). Handlers the user
        installed come back as they were.
        """
        originals = _lightning_compat.handlers_restored_at_teardown(trainer)
        signums = [s for s in self._previous_handlers if originals.get(s) == signal.SIG_DFL]
        for signum in signums:
            originals[signum] = _ignore_while_stopping
        atexit.unregister(_ignore_at_exit)
        atexit.register(_ignore_at_exit, signums)
        self._previous_handlers = {}

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._stopping and isinstance(exception, SIGTERMException):
            self._keep_ignoring_signals(trainer)
        else:
            self._restore_signal_handlers()
        try:
            self._flush()
        except CheckpointSaveError as e:  # reported with, not instead of, the training error
            log.error("%s", e)
            exception.add_note(str(e))

    def _flush(self) -> None:
        """Wait for an asynchronous write in flight; raise CheckpointSaveError if it failed."""
        if self._saver is None:
            return
        try:
            self._saver.close()
        except Exception as e:
            detail = " ".join([str(e), *getattr(e, "__notes__", [])])
            raise CheckpointSaveError(
                f"the last asynchronous checkpoint save failed ({detail}); earlier checkpoints "
                "are untouched"
            ) from e

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_signal_handlers()
        # fit may have failed before Lightning restored anything
        _lightning_compat.release_resume_start(trainer)
        self._flush()  # the last checkpoint is complete when fit returns
