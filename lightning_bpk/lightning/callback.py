"""``BurnpackCheckpoint``: save every epoch (or k steps), resume exactly, survive preemption.

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

**Step and time triggers.** ``every_n_train_steps=k`` also saves after every k-th optimizer
step, ``train_time_interval=timedelta(...)`` when that much time passed since the last save (rank
0's clock; the decision reaches every rank in the all-reduce the preemption flag already uses).
Saves happen only at optimizer-step boundaries, never inside gradient accumulation; a save that
falls due right before a validation run waits until after it, and one on an epoch's last batch
becomes that epoch's end save. With either trigger set, **checkpoint N is the one saved after
global step N** (epoch-end, preemption and final saves too); without, N is the epoch.

**Resuming.** In ``setup`` rank 0 finds the newest checkpoint that verifies
(:func:`~lightning_bpk.checkpointer.get_latest_checkpoint_number` with ``verify=True``, which
falls back past damaged ones and honours gin's ``override_number``, which must name a complete
checkpoint: otherwise :class:`CheckpointResumeError` before anything is created); the number
is shared with every rank. Lightning 2.6 chooses ``ckpt_path`` before any callback runs, so the
callback intercepts the trainer's ``_checkpoint_connector.resume_start`` once: when ``fit`` got no
``ckpt_path`` it loads checkpoint N there, and Lightning restores everything in its own order
(model, callbacks, precision, loops, optimizers, schedulers). An explicit ``ckpt_path`` wins (a
checkpoint directory of ours works there too, without the IO plugin); ``resume=False`` starts
fresh.

**Exactly where it stopped.** Every save records, per rank, the RNG states (Python, NumPy,
torch, CUDA) and the training data's position (:mod:`lightning_bpk.data_position`): for a plain
DataLoader the RNG and generator states its sampler shuffled from and the number of batches the
model consumed; for a ``StatefulDataLoader`` its own state. Each rank restores its own when the
checkpoint is loaded, before ``configure_optimizers`` (which may set the data up early through
``estimated_stepping_batches``), and the data resumes with the next batch of the same order, its
consumed indices skipped without loading their samples. Loop counters, ``global_step`` and
per-step schedulers are Lightning's own, saved mid-epoch as they were: the continued run is
bit-identical to one that never stopped. Each loader of a dict, list or ``CombinedLoader`` is
positioned on its own; an iterable dataset without state is read again up to the save point and
the batches consumed before it are discarded (one warning says so: exact only if the dataset
yields the same batches again), the counters continuing from the save all the same.

**Never saving over another run.** At ``on_train_start`` rank 0 looks for complete checkpoints
numbered from the epoch the run starts at on (other than the one it resumed from), which its
saves would replace: there are some after ``resume=False``, an explicit older ``ckpt_path`` or
an older ``override_number``. ``fit`` then stops with :class:`CheckpointResumeError` naming them,
unless ``overwrite=True``, which removes them first. A checkpoint of other optimizer or
scheduler classes is refused at ``on_fit_start``, before Lightning loads its state.

**Preemption.** During training, SIGTERM and SIGUSR1 only set a flag (the previous handlers
still run, except Lightning's own SIGTERM notifier, whose in-handler broadcast can deadlock DDP).
At the next ``on_train_batch_end`` at an optimizer-step boundary all ranks agree on the flag
(all-reduce MAX), save as above (by epoch number E, whatever the frequency, without a step
trigger; a later save of E replaces it), and stop with
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` (a ``SystemExit`` without
code: exit status 0). A signal during validation is acted on at the next batch end or the
epoch's end. A mid-epoch checkpoint is marked in ``trainer.bpk`` under
``lightning_bpk_preempted`` (epoch, batches consumed, whether it replays). From then on a
repeated signal (schedulers send more than one) is ignored until the process has exited, so the
exit status stays 0; a later ``fit`` in the same process brings the default handlers back.

**SLURM.** Under SLURM (Lightning's ``SLURMEnvironment``, auto-requeue on) Lightning's own
SIGUSR1 handler, which saves and requeues inside the handler, does not run either; when the
requeue signal stopped training, global rank 0 runs ``scontrol requeue`` after the save is
complete, and the requeued job resumes from it (:mod:`lightning_bpk.slurm`).

**A finished run stays finished.** The save at the end of training (``max_epochs`` or
``max_steps`` reached, or ``trainer.should_stop`` as EarlyStopping sets it) is always made,
whatever the frequency, and marked. Run again with the same limits, the callback says the run
already finished and Lightning trains nothing; raise ``max_epochs``/``max_steps`` to continue.
A run stopped by ``max_time`` is finished for as long as ``max_time`` is at most the training
time it had (Lightning's Timer restores that time with its state); a larger ``max_time``, or
none, continues it, and the Timer stops it when the total reaches the new limit.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_bpk import _gin, object_checkpoints, sharded, storage, trainer_state
from lightning_bpk.checkpointer import (
    RUN_SUBDIRECTORY,
    Checkpointer,
    check_settings,
    get_latest_checkpoint_number,
    list_checkpoints,
    summarise,
    verify_checkpoint,
)
from lightning_bpk.errors import CheckpointResumeError, LightningBpkError
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX
from lightning_bpk.lightning import _compat, slurm, triggers
from lightning_bpk.lightning.async_save import AsyncCheckpointSaver
from lightning_bpk.lightning.data_position import POSITION_KEY, DataPosition
from lightning_bpk.lightning.triggers import describe as _describe
from lightning_bpk.lightning.triggers import finished as _finished
from lightning_bpk.lightning.triggers import still_finished as _still_finished
from lightning_bpk.records import ModuleRecord, OptimizerRecord

__all__ = [
    "FINISHED_KEY",
    "PREEMPTION_SIGNALS",
    "BurnpackCheckpoint",
    "CheckpointResumeError",
    "CheckpointSaveError",
]

log = logging.getLogger("lightning_bpk")

# Signals that mean "you are about to be stopped" (SIGTERM: Kubernetes, SageMaker, SLURM at the
# time limit; SIGUSR1: SLURM's --signal default for requeue).
# Plain ints, so a configuration system can write them out (LightningCLI saves its config as
# YAML, which cannot represent a signal.Signals).
PREEMPTION_SIGNALS = (int(signal.SIGTERM), int(signal.SIGUSR1))


def _signal_number(value: object) -> int:
    """A signal given as a number, a ``signal.Signals`` or a name (``"SIGTERM"``, ``"TERM"``)."""
    if isinstance(value, str):
        name = value.strip().upper()
        found = getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name, None)
        if found is not None:
            return int(found)
    elif (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value in {int(s) for s in signal.valid_signals()}
    ):
        return int(value)
    raise ValueError(
        f"preemption_signals: {value!r} is not a signal of this platform (give a number, a "
        "signal.Signals or a name such as 'SIGTERM')"
    )


# every_n_train_steps="auto" saves once after this many steps to measure what a save costs.
AUTO_FIRST_SAVE = 10
# Top-level key of a checkpoint saved when the run ended (why, and the limit it reached).
FINISHED_KEY = "lightning_bpk_finished"


class CheckpointSaveError(LightningBpkError, RuntimeError):
    """Saving a checkpoint failed (on rank 0); earlier checkpoints are untouched, unless the
    checkpoint directory itself was deleted under the run, which the message then says."""


def _untouched(error: BaseException) -> str:
    """What a failed save's message promises about the checkpoints before it: untouched, unless
    the directory itself was deleted (a :class:`~lightning_bpk.storage.DirectoryGoneError`
    anywhere in the chain), where they are gone with it and its message says so."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, storage.DirectoryGoneError):
            return ""
        cause = cause.__cause__ or cause.__context__
    return "; earlier checkpoints are untouched"


def _identity(path: Any) -> str:
    """A checkpoint directory's identity for comparisons: the resolved local path, or the URL."""
    location = storage.location(path)
    return str(location.resolve() if isinstance(location, Path) else location)


def _agree(trainer: pl.Trainer, value: int) -> int:
    """The maximum of ``value`` over all ranks (every rank must call this at the same point)."""
    tensor = torch.tensor(value, dtype=torch.int64, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="max").item())


def _agree_all(trainer: pl.Trainer, values: Sequence[int]) -> list[int]:
    """Element-wise maximum of ``values`` over all ranks, in one collective."""
    if trainer.world_size == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
    return [int(v) for v in trainer.strategy.reduce(tensor, reduce_op="max").tolist()]


def _gather(trainer: pl.Trainer, value: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (``None`` on the others), in rank order."""
    if trainer.world_size == 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def _take_last(trainer: pl.Trainer) -> bool:
    """``fit(ckpt_path="last")`` where Lightning found no file of its own: a BurnpackCheckpoint
    that resumes takes it as "its newest complete checkpoint" (and says which, in setup)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    takers = [c for c in callbacks if isinstance(c, BurnpackCheckpoint) and c.resume]
    for callback in takers:
        callback._last_requested = True
    return bool(takers)


def _others(handler: object) -> list[Callable[..., Any]]:
    """The callables a previously installed handler runs, without Lightning's own ones."""
    handlers = _compat.composed_signal_handlers(handler)
    return [
        h for h in handlers if callable(h) and not _compat.is_lightning_signal_handler(h)
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
    originals = _compat.handlers_restored_at_teardown(trainer)
    for signum in signums:
        if originals.get(signum) is _ignore_while_stopping:
            originals[signum] = signal.SIG_DFL
        if signal.getsignal(signum) is _ignore_while_stopping:
            signal.signal(signum, signal.SIG_DFL)


@_gin.configurable("lightning_bpk")
class BurnpackCheckpoint(Checkpoint):
    """Checkpoint every epoch in burnpack through a Dopamine-style Checkpointer, and resume.

    Args:
        dirpath: where checkpoints go; ``None`` means ``{trainer.default_root_dir}/checkpoints``.
            A URL (``s3://bucket/run``, ``gs://...``) stores them there (see "Checkpoints on
            object storage" in the docs); the store is checked in ``setup``, before training.
        checkpoint_file_prefix: data directories are ``{prefix}.{N}``.
        sentinel_file_identifier: sentinels are ``sentinel_{identifier}_complete.{N}``.
        checkpoint_frequency: save the epochs that are multiples of this.
        checkpoint_duration: keep the last this many saved checkpoints.
        keep_every: also keep every ``keep_every``-th saved checkpoint forever (milestones).
            These five go to the :class:`~lightning_bpk.checkpointer.Checkpointer`.
        resume: continue from the newest complete checkpoint in ``dirpath`` when ``fit`` gets no
            ``ckpt_path`` (gin: ``get_latest_checkpoint_number.override_number`` picks another;
            one that is not complete stops ``setup`` with :class:`CheckpointResumeError`).
        overwrite: let this run replace complete checkpoints in ``dirpath`` that it did not
            resume past, i.e. numbered from the epoch it starts at: needed to start over
            (``resume=False``) in a directory with checkpoints, or to go back to an older one
            (``ckpt_path``, ``override_number``). Those checkpoints are removed, with a warning
            in the log, before the first training step, so the directory never mixes two runs.
            With the default ``False``, ``fit`` stops there with
            :class:`CheckpointResumeError` naming them, before anything is saved.
        verify: check every byte of the chosen checkpoint before resuming from it (falling
            back to older ones); ``False`` checks sentinels and file sizes only.
        preemption_signals: signals that trigger a save-and-stop (empty: none), as numbers,
            ``signal.Signals`` or names (``"SIGTERM"``), kept as plain ints; under SLURM
            with auto-requeue, the environment's ``requeue_signal`` too.
        every_n_train_steps: also save every this many optimizer steps (global steps), as
            Lightning's ``ModelCheckpoint`` does; checkpoints are then numbered by global step.
            ``"auto"`` chooses the interval: it measures the time of an optimizer step and what
            a save costs the training thread, and saves as often as keeps that cost under
            ``max_overhead`` of training time (re-measured at every save, logged when it
            changes; ``train_time_interval`` still bounds the time between saves). Each fit,
            a resumed one too, measures anew: its first save comes 10 steps after it starts.
        max_overhead: the share of training time ``"auto"`` may spend in saves.
        train_time_interval: also save when this much wall-clock time passed since the last
            save (rank 0's clock decides, all ranks follow); numbered by global step too.
        async_save: write checkpoints on a background thread
            (:class:`~lightning_bpk.async_save.AsyncCheckpointSaver`): training waits only for
            a copy into reused staging buffers (and for building the records, ~3 ms of Python
            for a small model). The buffers of the model and optimizer state are allocated and
            faulted in on that thread right after the first optimizer step (when the optimizer
            state exists), so the first save costs a copy too; a save joins that reservation
            before copying. The checkpoint becomes complete (sentinel) once
            its data is durable; a failed write raises :class:`CheckpointSaveError` at the next
            save or at teardown; a preemption save and teardown wait for the write. With a URL
            ``dirpath`` this is "upload behind": the upload and commit run on that thread.
        storage_options: passed to fsspec for a URL ``dirpath`` (credentials, endpoint).
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
        overwrite: bool = False,
        verify: bool = True,
        preemption_signals: Sequence[int | str] = PREEMPTION_SIGNALS,
        async_save: bool = False,
        every_n_train_steps: int | str | None = None,
        train_time_interval: timedelta | None = None,
        max_overhead: float = 0.02,
        auto_requeue: bool = True,
        storage_options: dict[str, Any] | None = None,
        distributed_save: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(max_overhead, (int, float)) or not 0 < max_overhead <= 1:
            raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead!r}")
        if (
            every_n_train_steps is not None
            and every_n_train_steps != "auto"
            and (
                isinstance(every_n_train_steps, bool)
                or not isinstance(every_n_train_steps, int)
                or every_n_train_steps < 1
            )
        ):
            raise ValueError(
                "every_n_train_steps must be a positive int, 'auto' or None, "
                f"got {every_n_train_steps!r}"
            )
        if train_time_interval is not None and (
            not isinstance(train_time_interval, timedelta)
            or train_time_interval.total_seconds() <= 0
        ):
            raise ValueError(
                "train_time_interval must be a positive timedelta or None, "
                f"got {train_time_interval!r}"
            )
        step_numbered = every_n_train_steps is not None or train_time_interval is not None
        if step_numbered and checkpoint_frequency != 1:
            raise ValueError(
                "checkpoint_frequency selects epochs; with every_n_train_steps or "
                "train_time_interval checkpoints are numbered by global step, so leave it at 1"
            )
        # Refused here rather than when fit starts (the Checkpointer checks the same).
        check_settings(
            checkpoint_file_prefix,
            sentinel_file_identifier,
            checkpoint_frequency,
            checkpoint_duration,
            keep_every,
        )
        # never Path(url): Path("s3://b/run") is the local folder "s3:/b/run"
        self.dirpath = None if dirpath is None else storage.location(dirpath)
        self.storage_options = storage_options
        self.checkpoint_file_prefix = checkpoint_file_prefix
        self.sentinel_file_identifier = sentinel_file_identifier
        self.checkpoint_frequency = checkpoint_frequency
        self.checkpoint_duration = checkpoint_duration
        self.keep_every = keep_every
        self.resume = resume
        self.overwrite = overwrite
        self.verify = verify
        self.preemption_signals = tuple(_signal_number(v) for v in preemption_signals)
        self.async_save = async_save
        self.every_n_train_steps = every_n_train_steps
        self.max_overhead = float(max_overhead)
        self.auto_interval: int | None = None  # what "auto" chose last (rank 0)
        self._step_time: float | None = None  # moving average of an optimizer step (seconds)
        self._save_cost: float | None = None  # the training thread's time in the last save
        self._last_step_end: float | None = None
        self.train_time_interval = train_time_interval
        self.auto_requeue = auto_requeue
        self.distributed_save = distributed_save
        self._saver = AsyncCheckpointSaver() if async_save else None  # used on rank 0 only
        self.checkpointer: Checkpointer | None = None
        self.restored_number: int | None = None  # the checkpoint this fit resumed from
        self.last_saved_number: int | None = None
        self._resume_number = -1
        self._preloaded: dict[str, Any] | None = None  # what rank 0 read choosing the resume
        self._position = DataPosition()
        self._classes: dict | None = None  # optimizer/scheduler classes to check at fit start
        self._fit_started = False
        self._preempt_requested = False
        self._preempt_agreed = False  # all ranks agreed; acted on at the next step boundary
        self._due: int | None = None  # batches consumed when a save fell due after validation
        self._step_before = 0  # global step when the current batch started
        self._last_save_time = time.monotonic()
        self._replay_floor = -1  # step-numbered saves up to this number repeat a replayed epoch
        self._finished: str | None = None  # why a resumed run has nothing left to train
        self._saved_step = -1  # global step of the last save
        self._resumed_batches = 0
        self._reserved = False  # the async saver's staging buffers were requested
        self._requeue_signal: int | None = None  # set in setup when SLURM auto-requeue applies
        self._requeue_requested = False  # that signal arrived (on this rank)
        self._requeue_agreed = False  # ... on any rank, at the agreed step
        self._stopping = False  # a preemption stop is under way: the process is about to exit
        self._previous_handlers: dict[int, Any] = {}
        self._last_requested = False  # fit(ckpt_path="last") found no file: ours is "last"
        _compat.route_last_ckpt_path(_take_last)

    @property
    def step_numbered(self) -> bool:
        """Checkpoints are numbered by global step (a step or time trigger is set), not epoch."""
        return self.every_n_train_steps is not None or self.train_time_interval is not None

    @property
    def state_key(self) -> str:
        return _compat.generate_state_key(
            self,
            dirpath=None if self.dirpath is None else str(self.dirpath),
            checkpoint_file_prefix=self.checkpoint_file_prefix,
        )

    # -- setup and resume ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dirpath = self.dirpath or storage.join(
            storage.location(trainer.default_root_dir), RUN_SUBDIRECTORY
        )
        dirpath = storage.location(trainer.strategy.broadcast(str(dirpath)))
        # Rank 0 chooses before anything is created (read-only); every rank learns the outcome.
        choice: tuple[int, str | None] = (-1, None)
        failure: Exception | None = None
        self._preloaded = None
        if self.resume and trainer.is_global_zero:
            try:
                choice = self._choose_resume(dirpath)
            except Exception as e:  # every rank must reach the broadcast, and learn of it
                failure = e
                choice = (-1, f"cannot look for a checkpoint to resume from in {dirpath}: {e}")
        number, error = trainer.strategy.broadcast(choice)
        if failure is not None:
            raise failure  # rank 0 keeps the original error (a StorageError naming the URL)
        if error is not None:
            raise CheckpointResumeError(error)
        if self._last_requested and trainer.is_global_zero:
            log.info(
                'ckpt_path="last": %s',
                f"the newest complete checkpoint in {dirpath} is {number}"
                if number >= 0
                else f"no complete checkpoint in {dirpath} yet; training starts from scratch",
            )
        self._last_requested = False
        if trainer.is_global_zero:
            self.checkpointer = self._make_checkpointer(dirpath)
            # this run owns the directory until another one takes over (lightning_bpk.lease)
            self.checkpointer.take_over()
        trainer.strategy.barrier("BurnpackCheckpoint.setup")  # rank 0 created the directory
        if not trainer.is_global_zero:
            self.checkpointer = self._make_checkpointer(dirpath)
        self._position = DataPosition()
        self._position.attach(trainer)
        self._reserved = False
        self._fit_started = False
        self._classes = None
        self._preempt_agreed = self._requeue_agreed = False
        self._due = None
        self._replay_floor = -1
        self._finished = None
        self.restored_number = None
        self._resume_number = number
        self._requeue_signal = slurm.requeue_signal(trainer) if self.auto_requeue else None
        self._intercept_resume(trainer)

    def _names(self) -> dict[str, Any]:
        return dict(
            sentinel_file_identifier=self.sentinel_file_identifier,
            checkpoint_file_prefix=self.checkpoint_file_prefix,
            storage_options=self.storage_options,
        )

    def _choose_resume(self, dirpath: Path | str) -> tuple[int, str | None]:
        """``(number, error)``: the newest checkpoint that verifies (-1: none), or gin's
        ``override_number``, which must name a complete checkpoint. Read-only (rank 0)."""
        if not storage.is_local(dirpath):  # unreachable, bad credentials, no bucket: say which
            storage.object_store(dirpath, self.storage_options).check()
        required = trainer_state.REQUIRED_KEYS
        local = storage.is_local(dirpath)
        number = get_latest_checkpoint_number(
            dirpath, verify=self.verify and local, required_keys=required, **self._names()
        )
        if number >= 0 and self.verify and not local:
            # one read of each object, not two: verified as it is loaded, kept for resume_start
            store = storage.object_store(dirpath, self.storage_options)
            number, self._preloaded = object_checkpoints.load_newest(
                store,
                self.sentinel_file_identifier,
                self.checkpoint_file_prefix,
                required,
                at_most=number,
                unloaded=(trainer_state.INDEX_KEY,),
            )
        if number < 0:
            return number, None
        # Only an override_number can fail here: the search returns a checked checkpoint.
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
                path = self.checkpointer.checkpoint_path(self._resume_number)
            ours = checkpoint_path is None and path is not None
            if not ours and (path is None or not trainer_state.is_checkpoint_directory(path)):
                if path is not None:
                    self._refuse_member_of_checkpoint(path)
                original(checkpoint_path, weights_only)  # Lightning's path: its IO, its checks
                return None
            if ours:
                self.restored_number = self._resume_number
                rank_zero_info(f"BurnpackCheckpoint: resuming from checkpoint {path}")
            if sharded.is_sharded(path, storage_options=self.storage_options):  # FSDP2 etc.
                # every rank reads its part
                return path, sharded.restore(trainer, path, self.storage_options)
            if ours and self._preloaded is not None:  # rank 0 read it choosing (object store)
                data, self._preloaded = self._preloaded, None
                return path, trainer_state.from_records(data, str(path))
            return path, trainer_state.load(path, self.storage_options)

        _compat.intercept_resume_start(trainer, resume_start)

    def _refuse_member_of_checkpoint(self, path: Any) -> None:
        """``ckpt_path`` names a file inside a checkpoint directory (``ckpt.3/model.bpk``):
        Lightning's reader would fail on it without naming it; stop, naming the directory."""
        problem = triggers.member_of_checkpoint(path, self.storage_options)
        if problem is not None:
            raise CheckpointResumeError(problem)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # This rank's RNG states and data position, restored now: before configure_optimizers
        # (which may read estimated_stepping_batches, and so build and iterate the data) and
        # before anything else can draw from them.
        rng = checkpoint.get(trainer_state.RNG_KEY)
        ranks = checkpoint.get(POSITION_KEY)
        self._position.resume_from_ranks(ranks, rng, trainer, f"checkpoint {trainer.ckpt_path}")
        self._classes = checkpoint.get(trainer_state.CLASSES_KEY)
        if self._fit_started:  # strategies that restore after setup (FSDP, DeepSpeed)
            self._check_classes(trainer)
        preempted = checkpoint.get(trainer_state.PREEMPTED_KEY)
        self._resumed_batches = 0  # batches of the current epoch the restored run consumed
        if preempted:
            batches = preempted["batches"]
            where = f"epoch {checkpoint.get('epoch')}, after {batches} batch"
            where += "es" if batches != 1 else ""
            if preempted.get("replay", True):
                where += " (that epoch is replayed from its first batch)"
            else:
                self._resumed_batches = batches
                if self.step_numbered and self.restored_number is not None:
                    self._replay_floor = self.restored_number
        else:
            where = f"the end of epoch {checkpoint.get('epoch')}"
        finished = checkpoint.get(FINISHED_KEY)
        if (
            finished
            and self.restored_number is not None
            and _still_finished(trainer, finished, checkpoint)
        ):
            self._finished = _describe(finished)
        if trainer.is_global_zero:
            log.info("restored %s, saved at %s", trainer.ckpt_path, where)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = True
        self._check_classes(trainer)
        if self._finished is not None:
            # Lightning's fit loop stops before its first batch when should_stop is set.
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.info(
                    "the run in %s already finished at checkpoint %s (%s); nothing to train "
                    "(resume=False or another directory trains again)",
                    self.checkpointer.base_directory if self.checkpointer else "?",
                    self.restored_number,
                    self._finished,
                )

    def _check_classes(self, trainer: pl.Trainer) -> None:
        """Refuse other optimizer or scheduler classes before Lightning loads the checkpoint's
        state into them (Adam's state in SGD fails at its first step, in AdamW it silently
        changes meaning).

        Lightning loads the saved scheduler states pairwise into the schedulers configured at fit
        start; states beyond those belong to schedulers a callback creates later and restores
        from its own state (StochasticWeightAveraging's SWALR), so they are not refused."""
        if self._classes is None:
            return
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        classes = dict(self._classes)
        saved = list(classes.get("lr_schedulers", []))
        if len(saved) > len(schedulers):
            classes["lr_schedulers"] = saved[: len(schedulers)]
            if trainer.is_global_zero:
                log.info(
                    "%s holds LR scheduler state(s) %s beyond the %d configured at fit start: "
                    "left to the callback that creates them (StochasticWeightAveraging restores "
                    "its SWALR from its own state)",
                    trainer.ckpt_path,
                    saved[len(schedulers) :],
                    len(schedulers),
                )
        problems = trainer_state.class_mismatches(classes, trainer.optimizers, schedulers)
        self._classes = None
        if problems:
            raise CheckpointResumeError(
                f"cannot resume from {trainer.ckpt_path}: {'; '.join(problems)}. Resume with the "
                "optimizers and schedulers it was saved with; to switch, load only the weights "
                "(ModuleRecord.load(...).apply(model)) and start a new run"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        error = None
        if trainer.is_global_zero:
            try:
                error = self._check_newer(trainer)
            except Exception as e:  # every rank must reach the broadcast, and learn of it
                base = self.checkpointer.base_directory if self.checkpointer else "?"
                error = f"cannot check {base} before training: {e}"
        error = trainer.strategy.broadcast(error)
        if error is not None:
            raise CheckpointResumeError(error)
        if trainer.is_global_zero and self.restored_number is not None:
            log.info(
                "continuing training at epoch %d%s (global step %d) after checkpoint %d",
                trainer.current_epoch,
                f", batch {self._resumed_batches}" if self._resumed_batches else "",
                trainer.global_step,
                self.restored_number,
            )
        if self.restored_number is not None and _compat.resume_swa_mid_epoch(trainer):
            log.info("StochasticWeightAveraging's SWALR rebuilt for the resumed epoch")
        self._last_save_time = time.monotonic()
        self._saved_step = trainer.global_step  # intervals count from here
        self._last_step_end = None  # "auto" times this fit's steps, not the gap before it
        if trainer.is_global_zero:
            path = trainer.ckpt_path
            slurm.log_restart(None if path is None else str(path))
        self._install_signal_handlers(trainer)

    def _start_name(self, start: int) -> str:
        """Where a run starts, as its checkpoints are numbered: a global step or an epoch."""
        return f"global step {start}" if self.step_numbered else f"epoch {start}"

    def _check_newer(self, trainer: pl.Trainer) -> str | None:
        """Rank 0, before the first step: complete checkpoints from the epoch this run starts at
        on (other than the one it resumed from) would be saved over. Remove them when
        ``overwrite`` is set; otherwise the error to stop with (nothing changed)."""
        assert self.checkpointer is not None
        base = self.checkpointer.base_directory
        # the number of this run's first save is at least its starting epoch or global step
        start = trainer.global_step if self.step_numbered else trainer.current_epoch
        resumed = _identity(trainer.ckpt_path) if trainer.ckpt_path else None
        newer = [
            e.number
            for e in list_checkpoints(base, **self._names())
            if e.complete and e.number >= start and _identity(e.data) != resumed
        ]
        if not newer:
            return None
        if self.overwrite:
            log.warning(
                "overwrite=True: removing checkpoints %s in %s, which this run (starting at "
                "%s) would save over",
                newer,
                base,
                self._start_name(start),
            )
            self.checkpointer.remove_checkpoints(newer)
            return None
        usable = any(  # damaged ones are replaced anyway (resume fell back past them)
            not verify_checkpoint(
                base,
                n,
                full=self.verify,
                required_keys=trainer_state.REQUIRED_KEYS,
                **self._names(),
            )
            for n in newer
        )
        if not usable:
            return None
        source = f"resumes from {trainer.ckpt_path}" if trainer.ckpt_path else "starts from scratch"
        return (
            f"this run {source} ({self._start_name(start)}), and {base} holds complete "
            f"checkpoints {newer} that its saves would replace. Nothing was changed. To "
            "continue the newest, run with resume=True and neither ckpt_path nor "
            "override_number; to start over or go back, set BurnpackCheckpoint(overwrite=True) "
            "(gin: BurnpackCheckpoint.overwrite = True), which removes them first; or save into "
            "another dirpath"
        )

    # -- saving --------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step
        self._position.before_batch()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._saver is not None and not self._reserved and trainer.global_step > 0:
            self._reserve_staging(trainer)
        preempt, timed = _agree_all(
            trainer,
            [
                int(self._preempt_requested) + int(self._requeue_requested),  # 0, 1 or 2
                int(trainer.is_global_zero and self._rank0_due(trainer)),
            ],
        )
        self._preempt_agreed = self._preempt_agreed or bool(preempt)
        self._requeue_agreed = self._requeue_agreed or preempt == 2  # SLURM's requeue signal
        if trainer.global_step == self._step_before:
            return  # inside gradient accumulation: saves happen at optimizer-step boundaries
        n = self.every_n_train_steps
        stepped = isinstance(n, int) and trainer.global_step % n == 0
        if not (self._preempt_agreed or timed or stepped):
            return
        self._due = batch_idx + 1
        if self._epoch_ends_here(trainer):
            return  # on_train_epoch_end saves, after the validation that follows this batch
        if _compat.validation_follows(trainer):
            return  # on_validation_end saves, so the resumed run does not validate again
        self._save_due(trainer)

    def _reserve_staging(self, trainer: pl.Trainer) -> None:
        """After the first optimizer step (its state exists now), let the async saver allocate
        the model's and optimizers' staging buffers on its own thread, before any save. Not for
        sharded saves, which never use them (and DTensors would reserve the global shapes)."""
        self._reserved = True
        module = trainer.lightning_module
        if not trainer.is_global_zero or self._saver is None:
            return
        if self._sharded(trainer, {"state_dict": module.state_dict()}):
            return
        data: dict[str, Any] = {trainer_state.MODEL_KEY: ModuleRecord.from_module(module)}
        for i, optimizer in enumerate(trainer.optimizers):
            key = trainer_state.numbered_key(trainer_state.OPTIMIZER_KEY, i)
            data[key] = OptimizerRecord.from_optimizer(optimizer, module)
        self._saver.reserve(data)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        due = self._due is not None and not trainer.sanity_checking
        if due and not self._epoch_ends_here(trainer):
            self._save_due(trainer)

    @staticmethod
    def _epoch_ends_here(trainer: pl.Trainer) -> bool:
        max_steps = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
        last = _compat.is_last_batch(trainer)
        return bool(last or max_steps or trainer.should_stop)

    def _rank0_due(self, trainer: pl.Trainer) -> bool:
        """Rank 0's decisions: the time interval passed, or "auto" wants a save now."""
        if self.every_n_train_steps == "auto":
            now = time.perf_counter()
            if self._last_step_end is not None and trainer.global_step != self._step_before:
                step = now - self._last_step_end
                average = self._step_time
                self._step_time = step if average is None else 0.9 * average + 0.1 * step
            self._last_step_end = now
            if self._auto_due(trainer):
                return True
        return self._time_due()

    def _auto_due(self, trainer: pl.Trainer) -> bool:
        if self._step_time is None:
            return False  # no step measured yet (each save's step is not timed)
        since = trainer.global_step - max(self._saved_step, 0)  # this fit's start, or last save
        if self._save_cost is None:
            return since >= AUTO_FIRST_SAVE  # measure a save early, in this fit (also resumed)
        interval = max(1, math.ceil(self._save_cost / (self.max_overhead * self._step_time)))
        if self.auto_interval is None or not 0.5 <= interval / self.auto_interval <= 2:
            log.info(
                "every_n_train_steps='auto': a save costs the training thread %.1f ms, an "
                "optimizer step %.1f ms; saving every %d steps keeps it under %g%%",
                self._save_cost * 1000,
                self._step_time * 1000,
                interval,
                self.max_overhead * 100,
            )
            self.auto_interval = interval
        return since >= self.auto_interval

    def _time_due(self) -> bool:
        interval = self.train_time_interval
        return interval is not None and time.monotonic() - self._last_save_time >= (
            interval.total_seconds()
        )

    def _save_due(self, trainer: pl.Trainer) -> None:
        """Save the mid-epoch checkpoint that fell due (and stop, if preempted)."""
        consumed, self._due = self._due, None
        assert consumed is not None
        epoch = trainer.current_epoch
        number = trainer.global_step if self.step_numbered else epoch
        preempted = self._preempt_agreed
        self._save(trainer, number, consumed=consumed, preempted=preempted, flush=preempted)
        if preempted:
            self._stop(trainer, f"after batch {consumed - 1} of epoch {epoch}")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        requeue = self._requeue_agreed  # agreed at an earlier batch end, acted on now
        self._preempt_agreed = self._preemption_agreed(trainer) or self._preempt_agreed
        self._requeue_agreed = self._requeue_agreed or requeue
        preempted = self._preempt_agreed
        finished = _finished(trainer, epoch_end=True)
        if self.step_numbered:
            due = self._due is not None or preempted or finished is not None
            number = trainer.global_step
        else:
            due = preempted or finished is not None or epoch % self.checkpoint_frequency == 0
            number = epoch
        self._due = None
        if due and not (
            self.last_saved_number == number and self._saved_step == trainer.global_step
        ):
            self._save(trainer, number, preempted=preempted, flush=preempted)
        if preempted:
            self._stop(trainer, f"at the end of epoch {epoch}")

    def _save(
        self,
        trainer: pl.Trainer,
        number: int,
        consumed: int | None = None,
        preempted: bool = False,
        flush: bool = False,
    ) -> None:
        """Save checkpoint ``number`` (all ranks call this; rank 0 writes, all learn the result).

        ``consumed`` is the number of batches of this epoch a mid-epoch save comes after
        (``None``: the epoch's end). ``flush`` waits for an asynchronous write to be durable.
        """
        self._last_save_time = time.monotonic()
        started = time.perf_counter()
        epoch_end = consumed is None
        if number <= self._replay_floor:
            return  # this replayed epoch has not yet passed the checkpoint it resumed from
        # Lightning's own dict builder; weights_only=False here means "include optimizers,
        # schedulers and callback states", not unpickling: nothing is ever loaded with pickle.
        checkpoint = _compat.dump_checkpoint(trainer)
        staged: Any = {}  # sharded.save_shards' result on rank 0
        if self._sharded(trainer, checkpoint):
            assert self.checkpointer is not None  # every rank's, made in setup
            try:
                staged = sharded.save_shards(
                    trainer, self.checkpointer, number, checkpoint, self.storage_options
                )
            except sharded.ShardedCheckpointError as e:  # raised on every rank alike
                raise CheckpointSaveError(f"{e}{_untouched(e)}") from e
        ranks = _gather(trainer, self._position.capture(consumed or 0, epoch_end))
        extra: dict[str, Any] = {POSITION_KEY: ranks}
        finished = _finished(trainer, epoch_end)
        if finished is not None:
            extra[FINISHED_KEY] = finished
        if not epoch_end:  # every loader is positioned: the loop counters are as they are
            extra[trainer_state.PREEMPTED_KEY] = {
                "epoch": trainer.current_epoch,
                "batches": consumed,
                "replay": False,
            }
        forced = preempted or finished is not None or not epoch_end
        error: BaseException | None = None
        if trainer.is_global_zero:
            try:
                self._write(trainer, number, dict(checkpoint, **extra), forced, staged)
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
                    f"({detail}){_untouched(error)}"
                ) from error
            raise CheckpointSaveError(f"rank 0 failed to save checkpoint {number}")
        self.last_saved_number = number
        self._saved_step = trainer.global_step
        self._save_cost = time.perf_counter() - started
        self._last_step_end = None  # the next step's time does not include this save

    def _sharded(self, trainer: pl.Trainer, checkpoint: dict) -> bool:
        """Every rank writes its share: FSDP2 / tensor parallel, or ``distributed_save``."""
        return sharded.holds_dtensors(checkpoint) or (
            self.distributed_save and trainer.world_size > 1
        )

    def _write(
        self, trainer: pl.Trainer, number: int, checkpoint: dict, forced: bool, staged: Any
    ) -> None:
        assert self.checkpointer is not None
        checkpointer = self.checkpointer
        if forced and number % checkpointer.checkpoint_frequency:
            # Saved whatever the frequency; the same retention (the last d, the same milestones).
            f, k = self.checkpoint_frequency, self.keep_every
            checkpointer = self._make_checkpointer(
                checkpointer.base_directory,
                checkpoint_frequency=1,
                keep_every=None if k is None else k * f,
            )
            checkpointer.lease = self.checkpointer.lease
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        if staged:  # the shards are written; publish them with the rest, synchronously
            rest = sharded.records(checkpoint, schedulers)
            path = sharded.publish(checkpointer, number, staged, rest)
            log.info("saved sharded checkpoint %d at %s", number, path)
            return
        data = trainer_state.to_records(
            checkpoint, trainer.lightning_module, trainer.optimizers, schedulers
        )
        if self._saver is not None:  # raises an earlier failure; logs once committed
            self._saver.save_checkpoint(checkpointer, number, data, self._log_saved(number))
            return
        path = checkpointer.save_checkpoint(number, data)
        if path is not None:
            self._log_saved(number)(path)

    @staticmethod
    def _log_saved(number: int) -> Callable[[Path | str], None]:
        """The one "saved checkpoint N at PATH" line, for a synchronous or asynchronous save."""
        return lambda path: log.info("saved checkpoint %d at %s", number, path)

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
        originals = _compat.handlers_restored_at_teardown(trainer)
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
                f"the last asynchronous checkpoint save failed ({detail}){_untouched(e)}"
            ) from e

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_signal_handlers()
        self._position.detach(trainer)
        # fit may have failed before Lightning restored anything
        _compat.release_resume_start(trainer)
        self._flush()  # the last checkpoint is complete when fit returns
