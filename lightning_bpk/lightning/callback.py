"""``BurnpackCheckpoint``: save every epoch (or k steps), resume exactly, survive preemption.

One line of setup::

    trainer = L.Trainer(callbacks=[BurnpackCheckpoint()])
    trainer.fit(model)            # a second run with the same directory continues where it was

**Saving.** At the end of every training epoch N (Lightning's 0-based ``current_epoch``, after
validation, when ``N % checkpoint_frequency == 0``) the dict Lightning itself builds
(``dump_checkpoint``, so loops, callback states and hooks are exactly Lightning's) is split by
:mod:`lightning_bpk.lightning.trainer_state` into ``model.bpk``, ``optim.bpk``...,
``scheduler.bpk``... and ``trainer.bpk`` (with the RNG states), and saved as checkpoint N by a
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
``every_n_train_steps="auto"`` chooses the interval: it measures the time of an optimizer step
and what a save costs the training thread, and saves as often as keeps that cost under
``max_overhead`` of training time (re-measured at every save, logged when it changes;
``train_time_interval`` still bounds the time between saves). Each fit, a resumed one too,
measures anew: its first save comes 10 steps after it starts.

**Asynchronous saves.** With ``async_save=True`` checkpoints are written on a background thread
(:class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`): training waits only for a
copy into reused staging buffers (and for building the records, ~3 ms of Python for a small
model). The buffers of the model and optimizer state are allocated and faulted in on that
thread right after the first optimizer step (when the optimizer state exists), so the first
save costs a copy too; a save joins that reservation before copying. The checkpoint becomes
complete (sentinel) once its data is durable; a failed write raises
:class:`CheckpointSaveError` at the next save or at teardown; a preemption save and teardown
wait for the write. With a URL ``dirpath`` this is "upload behind": the upload and commit run
on that thread. Sharded (FSDP2) state too: every rank copies its shards into its own staging
buffers and writes them on its writer thread, over a process group of their own; a write that
fails on one rank fails the next save on every rank. The parameters and optimizer state are
copied beside the next forward and backward, and the next optimizer step waits for that copy
(:mod:`lightning_bpk.runtime.overlap`). ``async_save="process"`` commits in a writer process
that reads shared staging memory, so the commit's Python never holds this interpreter's lock.

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
torch, CUDA) and the training data's position (:mod:`lightning_bpk.lightning.data_position`): for a
plain
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

**Preemption.** During training, SIGTERM, SIGUSR1 and Ctrl-C only set a flag (previous handlers
still run, except Lightning's own SIGTERM notifier, whose in-handler broadcast can deadlock DDP).
At the next ``on_train_batch_end`` at an optimizer-step boundary all ranks agree on the flag
(all-reduce MAX), save as above (by epoch number E, whatever the frequency, without a step
trigger; a later save of E replaces it), and stop with
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` (a ``SystemExit`` without
code: exit status 0). A signal during validation is acted on at the next batch end or the
epoch's end. A mid-epoch checkpoint is marked in ``trainer.bpk`` under
``lightning_bpk_preempted`` (epoch, batches consumed, whether it replays). From then on a
repeated signal (schedulers send more than one) is ignored until the process has exited, so the
exit status stays 0 (a second Ctrl-C aborts at once: :mod:`lightning_bpk.runtime.preemption`
says why Ctrl-C saves by default); a later ``fit`` brings the default handlers back.

**SLURM.** Under SLURM (Lightning's ``SLURMEnvironment``, auto-requeue on) Lightning's own
SIGUSR1 handler, which saves and requeues inside the handler, does not run either; when the
requeue signal stopped training, global rank 0 runs ``scontrol requeue`` after the save is
complete, and the requeued job resumes from it (:mod:`lightning_bpk.runtime.slurm`).

**A finished run stays finished.** The save at the end of training (``max_epochs`` or
``max_steps`` reached, or ``trainer.should_stop`` as EarlyStopping sets it) is always made,
whatever the frequency, and marked. Run again with the same limits, the callback says the run
already finished and Lightning trains nothing; raise ``max_epochs``/``max_steps`` to continue.
A run stopped by ``max_time`` is finished for as long as ``max_time`` is at most the training
time it had (Lightning's Timer restores that time with its state); a larger ``max_time``, or
none, continues it, and the Timer stops it when the total reaches the new limit.

The class holds its settings and hooks and composes the rest: the run layer
(:mod:`lightning_bpk.runtime`: the resume choice, save and agree, cadence, signals, rank
agreement) and, beside it, what is Lightning's (``_resume``: loading the chosen checkpoint and
the checks around it; ``_save_data``: what a save holds), listed in
:mod:`lightning_bpk.lightning`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_bpk import _gin
from lightning_bpk.checkpointer import Checkpointer, Retention, _check_settings
from lightning_bpk.errors import CheckpointResumeError, CheckpointSaveError
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX
from lightning_bpk.lightning import (
    _best,
    _compat,
    _resume,
    _runs,
    _save_data,
    loading,
    trainer_state,
)
from lightning_bpk.lightning.data_position import POSITION_KEY, DataPosition
from lightning_bpk.lightning.triggers import (
    FINISHED_KEY,
    epoch_ends_here,
    finished,
)
from lightning_bpk.runtime import resume, slurm
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.cadence import SaveTriggers
from lightning_bpk.runtime.preemption import PREEMPTION_SIGNALS, Preemption
from lightning_bpk.runtime.ranks import Ranks
from lightning_bpk.runtime.resume import ResumeChoice
from lightning_bpk.runtime.saves import Saves
from lightning_bpk.store import location, open_store

__all__ = [
    "FINISHED_KEY",
    "PREEMPTION_SIGNALS",
    "BurnpackCheckpoint",
    "CheckpointResumeError",
    "CheckpointSaveError",
]

log = logging.getLogger("lightning_bpk")


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
        monitor: also keep the ``save_top_k`` best checkpoints by this logged metric (as
            ``ModelCheckpoint``): a checkpoint stays while it is among them or the rules above
            keep it; its value is recorded in its manifest (:mod:`lightning_bpk.lightning._best`
            for the attributes, ``"best"``, NaN and a missing metric).
        mode: ``"min"`` or ``"max"``: which way ``monitor`` is better.
        save_top_k: how many best checkpoints to keep (-1: all, 0: none beyond the rules above).
        resume: continue from the newest complete checkpoint in ``dirpath`` when ``fit`` gets no
            ``ckpt_path`` (gin: ``get_latest_checkpoint_number.override_number`` picks another;
            one that is not complete stops ``setup`` with :class:`CheckpointResumeError`).
        overwrite: let this run remove, before its first step, the complete checkpoints in
            ``dirpath`` it would save over (to start over, or go back to an older one: see
            "Never saving over another run" above); ``False``: ``fit`` stops there with
            :class:`CheckpointResumeError` naming them, before anything is saved.
        verify: check every byte of the chosen checkpoint before resuming from it (falling
            back to older ones); ``False`` checks sentinels and file sizes only.
        preemption_signals: signals that trigger a save-and-stop (empty: none), as numbers,
            ``signal.Signals`` or names (``"SIGTERM"``), kept as plain ints; under SLURM
            with auto-requeue, the environment's ``requeue_signal`` too.
        every_n_train_steps: also save every this many optimizer steps (global steps), as
            Lightning's ``ModelCheckpoint`` does; checkpoints are then numbered by global step.
            ``"auto"`` chooses the interval (see "Step and time triggers" above).
        max_overhead: the share of training time ``"auto"`` may spend in saves.
        train_time_interval: also save when this much wall-clock time passed since the last
            save (rank 0's clock decides, all ranks follow); numbered by global step too.
        async_save: write checkpoints on a background thread; training waits only for a copy
            into reused staging buffers (see "Asynchronous saves" above); ``"process"``: the
            commit runs in a writer process, off this interpreter's lock.
        storage_options: passed to fsspec for a URL ``dirpath`` (credentials, endpoint).
        auto_requeue: under SLURM with Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the
            default), when its requeue signal (SIGUSR1) stopped training, rank 0 runs
            ``scontrol requeue`` once the preemption checkpoint is complete
            (:mod:`lightning_bpk.runtime.slurm`); ``False``: save and stop only.
        distributed_save: with replicated state (DDP), every rank writes a share of the model
            and optimizer tensors (torch DCP through :mod:`lightning_bpk.runtime.sharded`), so a
            save's wall time can fall as ranks are added on a parallel filesystem; ``False``
            (default): rank 0 alone writes. Sharded (FSDP2) state is always written by every rank.

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
        async_save: bool | str = False,
        every_n_train_steps: int | str | None = None,
        train_time_interval: timedelta | None = None,
        max_overhead: float = 0.02,
        auto_requeue: bool = True,
        storage_options: dict[str, Any] | None = None,
        distributed_save: bool = False,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
    ) -> None:
        super().__init__()
        self.best = _best.BestModels(monitor, mode, save_top_k)
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.triggers = SaveTriggers(every_n_train_steps, train_time_interval, max_overhead)
        if self.step_numbered and checkpoint_frequency != 1:
            raise ValueError(
                "checkpoint_frequency selects epochs; with every_n_train_steps or "
                "train_time_interval checkpoints are numbered by global step, so leave it at 1"
            )
        # Refused here rather than when fit starts (the Checkpointer checks the same).
        _check_settings(
            checkpoint_file_prefix,
            sentinel_file_identifier,
            checkpoint_frequency,
            checkpoint_duration,
            keep_every,
        )
        # never Path(url): Path("s3://b/run") is the local folder "s3:/b/run"
        self.dirpath = None if dirpath is None else location(dirpath)
        self.storage_options = storage_options
        self.checkpoint_file_prefix = checkpoint_file_prefix
        self.sentinel_file_identifier = sentinel_file_identifier
        self.checkpoint_frequency = checkpoint_frequency
        self.checkpoint_duration = checkpoint_duration
        self.keep_every = keep_every
        self.resume = resume
        self.overwrite = overwrite
        self.verify = verify
        self.preemption = Preemption(
            preemption_signals,
            others=_compat.foreign_signal_handlers,
            stop_error=SIGTERMException,
        )
        self.async_save = async_save
        self.auto_requeue = auto_requeue
        self.distributed_save = distributed_save
        self._saver = AsyncCheckpointSaver.from_setting(async_save)
        self._ranks: Ranks | None = None  # this fit's ranks (setup)
        self._saves: Saves | None = None  # this fit's saves (setup)
        self.checkpointer: Checkpointer | None = None
        self.last_saved_number: int | None = None
        self._position = DataPosition()
        self._resumed = _resume.Resumed()  # what the checkpoint this fit resumed from says
        self._reserved = False  # the async saver's staging buffers were requested
        self._last_requested = False  # fit(ckpt_path="last") found no file: ours is "last"
        self._idle: str | None = None  # why this fit neither resumes nor saves (lightning._runs)
        _compat.route_ckpt_path(_best.take_last, _best.read_before_best)
        loading.route_load_from_checkpoint()

    # The trigger and signal settings live with the objects that act on them.
    every_n_train_steps = property(lambda self: self.triggers.every_n_train_steps)
    train_time_interval = property(lambda self: self.triggers.train_time_interval)
    max_overhead = property(lambda self: self.triggers.max_overhead)
    auto_interval = property(
        lambda self: self.triggers.auto_interval, doc='What ``"auto"`` chose last (rank 0).'
    )
    preemption_signals = property(lambda self: self.preemption.signals)
    # ModelCheckpoint's attributes, which Lightning and the loggers read (lightning._best).
    best_model_path = property(lambda self: self.best.best_model_path)
    best_model_score = property(lambda self: self.best.best_model_score)
    best_k_models = property(lambda self: self.best.best_k_models)
    kth_best_model_path = property(lambda self: self.best.kth_best_model_path)
    kth_value = property(lambda self: self.best.kth_value)
    last_model_path = property(lambda self: self.best.last_model_path)
    current_score = property(lambda self: self.best.current_score)

    @property
    def state_key(self) -> str:
        return _compat.generate_state_key(
            self,
            dirpath=None if self.dirpath is None else str(self.dirpath),
            checkpoint_file_prefix=self.checkpoint_file_prefix,
        )

    @property
    def step_numbered(self) -> bool:
        """Checkpoints are numbered by global step (a step or time trigger is set), not epoch."""
        return self.triggers.step_numbered

    # -- setup and resume ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":  # validate/test/predict: a ckpt_path of ours loads without the plugin
            _resume.intercept(trainer, ResumeChoice(), None, self.storage_options, lambda n: None)
            return
        problem = resume.unapplied_bindings("BurnpackCheckpoint") or _runs.conflict(
            trainer, type(self)
        )
        if problem is not None:
            raise CheckpointResumeError(problem)
        self._idle = _runs.idle_reason(trainer)
        dirpath = location(trainer.strategy.broadcast(str(_runs.folder(self, trainer))))
        ranks = self._ranks = _compat.ranks(trainer)
        checkpointer, choice = _resume.take_folder(
            trainer,
            dirpath,
            ranks,
            self._make_checkpointer,
            self._choose_resume if self.resume else None,
            idle=self._idle,
            last_requested=self._last_requested,
        )
        self.checkpointer, self._last_requested = checkpointer, False
        self.best.follow(checkpointer)
        self._saves = Saves(checkpointer, ranks, self._saver, self.storage_options)
        self._position = DataPosition()
        self._position.attach(trainer)
        self._reserved = False
        self._resumed = _resume.Resumed()
        self.preemption.reset()
        self.triggers.due = None
        requeue = _compat.slurm_requeue_signal(trainer) if self.auto_requeue else None
        self.preemption.requeue_signal = requeue
        if _runs.resumer(trainer, type(self)) is self:  # Lightning loads one checkpoint
            options, resumed = self.storage_options, self._resumed_from
            _resume.intercept(trainer, choice, checkpointer, options, resumed)

    @property
    def restored_number(self) -> int | None:
        """The checkpoint this fit resumed from (None: none of ours)."""
        return self._resumed.number

    def _resumed_from(self, number: int) -> None:
        self._resumed.number = number

    def _choose_resume(self, dirpath: Any) -> ResumeChoice:
        """Rank 0, read-only: what to resume from ``dirpath`` and what it read choosing
        (:func:`lightning_bpk.runtime.resume.choose`; gin's ``override_number`` must name a
        complete checkpoint)."""
        store = open_store(dirpath, self.storage_options)
        store.check()  # unreachable, bad credentials, no bucket: say which
        return resume.choose(
            dirpath,
            self.sentinel_file_identifier,
            self.checkpoint_file_prefix,
            trainer_state.REQUIRED_KEYS,
            verify=self.verify,
            storage_options=self.storage_options,
            store=store,
        )

    def _make_checkpointer(self, dirpath: Any) -> Checkpointer:
        return Checkpointer(
            dirpath,
            self.checkpoint_file_prefix,
            self.sentinel_file_identifier,
            # the triggers choose the steps; the checkpointer keeps them all
            checkpoint_frequency=1 if self.step_numbered else self.checkpoint_frequency,
            checkpoint_duration=self.checkpoint_duration,
            keep_every=self.keep_every,
            storage_options=self.storage_options,
            best=self.best.standing.rule,
        )

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn != "fit":
            return  # evaluating a checkpoint: nothing of a run to resume
        # This rank's RNG states and data position, restored now: before configure_optimizers
        # (which may read estimated_stepping_batches, and so build and iterate the data) and
        # before anything else can draw from them.
        rng, ranks = checkpoint.get(trainer_state.RNG_KEY), checkpoint.get(POSITION_KEY)
        self._position.resume_from_ranks(ranks, rng, trainer, f"checkpoint {trainer.ckpt_path}")
        self._resumed.loaded(trainer, checkpoint, self.step_numbered)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        base = self.checkpointer.base_directory if self.checkpointer else "?"
        self._resumed.fit_started(trainer, base)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpointer = self.checkpointer
        assert self._ranks is not None and checkpointer is not None  # made in setup
        error = None
        if not self._idle:  # a smoke test or a tuner saves nothing: nothing to save over
            error = self._ranks.decide(  # rank 0 looks, every rank learns
                lambda: _resume.save_over_problem(
                    trainer,
                    checkpointer,
                    self.step_numbered,
                    self.overwrite,
                    self.verify,
                    self.storage_options,
                ),
                lambda e: f"cannot check {checkpointer.base_directory} before training: {e}",
                reraise=False,
            )
        if error is not None:
            raise CheckpointResumeError(error)
        self.best.follow(checkpointer)  # without what overwrite=True removed
        self._resumed.train_started(trainer, self._position.resumed_at)
        self.triggers.fit_started(trainer.global_step)
        if trainer.is_global_zero:
            path = trainer.ckpt_path
            slurm.log_restart(None if path is None else str(path))
        self.preemption.install(_compat.handlers_restored_at_teardown(trainer))

    # -- saving --------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.triggers.batch_started(trainer.global_step)
        self._position.before_batch()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._resumed.lost.merge(trainer)  # the sums a mid-epoch save held join the new ones
        if self._saver is not None and not self._reserved and trainer.global_step > 0:
            self._reserved = True  # the first optimizer step's state exists now
            _save_data.reserve(trainer, self._saver, self.distributed_save)
            self._saver.watch(trainer.optimizers)  # their steps wait for an overlapped copy
        triggers, step = self.triggers, trainer.global_step
        assert self._ranks is not None  # made in setup
        rank0_due = trainer.is_global_zero and triggers.rank0_due(step)
        preempt, timed = self._ranks.agree_all([self.preemption.flag(), int(rank0_due)])
        self.preemption.agree(preempt)
        if not triggers.stepped(step):
            return  # inside gradient accumulation: saves happen at optimizer-step boundaries
        if not (self.preemption.agreed or timed or triggers.step_due(step)):
            return
        triggers.due = batch_idx + 1
        if epoch_ends_here(trainer):
            return  # on_train_epoch_end saves, after the validation that follows this batch
        if _compat.validation_follows(trainer):
            return  # on_validation_end saves, so the resumed run does not validate again
        number, consumed, preempted = self._due(trainer)
        self._save(trainer, number, consumed=consumed, preempted=preempted, flush=preempted)
        if preempted:
            self._stop(trainer, f"after batch {consumed - 1} of epoch {trainer.current_epoch}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.triggers.due is None or trainer.sanity_checking or epoch_ends_here(trainer):
            return
        number, consumed, preempted = self._due(trainer)
        self._save(trainer, number, consumed=consumed, preempted=preempted, flush=preempted)
        if preempted:
            self._stop(trainer, f"after batch {consumed - 1} of epoch {trainer.current_epoch}")

    def _due(self, trainer: pl.Trainer) -> tuple[int, int, bool]:
        """The mid-epoch save that fell due: its number, the batches of this epoch it comes
        after, and whether the ranks agreed on a preemption (then it stops the run)."""
        consumed, self.triggers.due = self.triggers.due, None
        assert consumed is not None
        number = trainer.global_step if self.step_numbered else trainer.current_epoch
        return number, consumed, self.preemption.agreed

    def _save(
        self,
        trainer: pl.Trainer,
        number: int,
        consumed: int | None = None,
        preempted: bool = False,
        flush: bool = False,
    ) -> None:
        """Save checkpoint ``number`` (all ranks call this; rank 0 writes, or every rank its
        shards; all learn the result: :meth:`lightning_bpk.runtime.saves.Saves.save`).
        ``consumed``: the batches of this epoch a mid-epoch save comes after (None: the
        epoch's end); ``flush`` waits for an asynchronous write to be durable."""
        started = self.triggers.save_started()
        if number <= self._resumed.replay_floor or self._idle:
            return  # this replayed epoch has not yet passed the checkpoint it resumed from
        ranks, capture = self._ranks, self._position.capture
        assert ranks is not None and self._saves is not None  # made in setup
        value = self.best.monitored(trainer)
        save = _save_data.collect(
            trainer,
            lambda rng: ranks.gather(capture(consumed or 0, consumed is None, rng)),
            consumed,
            self.distributed_save,
        )
        retention = self._retention(number, preempted or save.forced)
        if self.monitor is not None:  # the metric goes into the manifest
            retention = (retention or self._saves.checkpointer.retention).scored(value)
        self._saves.save(number, save.records, shards=save.shards, retention=retention, flush=flush)
        self.last_saved_number = number
        self.best.saved(trainer, self, number, value, later=self._saver is not None and not flush)
        self.triggers.saved(trainer.global_step, started)

    def _retention(self, number: int, forced: bool) -> Retention | None:
        """The retention of a save made whatever the frequency (None: an ordinary save)."""
        assert self.checkpointer is not None
        if not forced or number % self.checkpointer.checkpoint_frequency == 0:
            return None
        # Saved whatever the frequency; the same retention (the last d, the same milestones).
        f, k = self.checkpoint_frequency, self.keep_every
        rule = self.best.standing.rule
        return Retention(1, self.checkpoint_duration, None if k is None else k * f, rule)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        self._resumed.lost.epoch_ended(trainer)
        assert self._ranks is not None  # made in setup
        self.preemption.agree(self._ranks.agree_all([self.preemption.flag()])[0])
        preempted = self.preemption.agreed
        ended = finished(trainer, epoch_end=True)
        if self.step_numbered:
            due = self.triggers.due is not None or preempted or ended is not None
            number = trainer.global_step
        else:
            due = preempted or ended is not None or epoch % self.checkpoint_frequency == 0
            number = epoch
        self.triggers.due = None
        saved_here = self.last_saved_number == number
        if due and not (saved_here and self.triggers.saved_step == trainer.global_step):
            self._save(trainer, number, preempted=preempted, flush=preempted)
        self._resumed.lost.epoch_saved(trainer)  # the plateau step Lightning skips restarting
        if preempted:
            self._stop(trainer, f"at the end of epoch {epoch}")

    def _stop(self, trainer: pl.Trainer, where: str) -> None:
        """Stop after the preemption save (complete and flushed on every rank by now)."""
        number, path = self.last_saved_number, None
        if self.preemption.requeue_agreed and self.checkpointer and number is not None:
            path = str(self.checkpointer.checkpoint_path(number))
        self.preemption.stop(trainer.is_global_zero, number, path, where)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.preemption.on_exception(_compat.handlers_restored_at_teardown(trainer), exception)
        try:
            self._close_saves()
        except CheckpointSaveError as e:  # reported with, not instead of, the training error
            log.error("%s", e)
            exception.add_note(str(e))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.preemption.restore()
        self._position.detach(trainer)
        # fit may have failed before Lightning restored anything
        _compat.release_resume_start(trainer)
        self._close_saves()  # the last checkpoint is complete when fit returns
        self.best.announce(trainer, self, final=stage == "fit")

    def _close_saves(self) -> None:
        """Wait for an asynchronous write in flight (raising CheckpointSaveError if it failed),
        and stop the writer thread."""
        if self._saves is not None:
            self._saves.close()
