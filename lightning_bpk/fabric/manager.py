"""``CheckpointManager``: automatic, exact, pickle-free checkpoints for a hand-written Fabric loop.

Built from the ``Fabric`` object and a directory (or ``s3://``, ``gs://`` ... URL), it saves
the dict you would pass to ``fabric.save`` as checkpoint ``step`` through the one
:class:`~lightning_bpk.checkpointer.Checkpointer` commit (records, then the sentinel last), and
restores the newest *complete* one in place::

    fabric = L.Fabric(...); fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = ResumableLoader(fabric.setup_dataloaders(train_loader))
    manager = CheckpointManager(fabric, "out/checkpoints", every_n_train_steps=100)
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    manager.restore(state)                     # the newest complete checkpoint, if any
    while state["step"] < max_steps:
        for batch in loader:
            ...                                # forward, backward, optimizer.step()
            state["step"] += 1
            manager.save_if_due(state["step"], state)
    manager.save(state["step"], state)         # the last one, whatever the cadence
    manager.close()                            # waits for an asynchronous write

**Restore** (:meth:`CheckpointManager.restore`, on every rank): rank 0 chooses the newest
checkpoint whose sentinel is there and whose every byte verifies as it is read (a damaged one
is skipped with a :class:`~lightning_bpk.checkpointer.CheckpointWarning` naming the file, a
torn one, killed during its save, has no sentinel and is never seen), or gin's
``get_latest_checkpoint_number.override_number`` / ``override_number``; then every rank loads
modules, optimizers (state keyed by parameter id), stateful objects and data loaders in place,
its own RNG states last, and gets the remainder and the step.

**Saves**: :meth:`~CheckpointManager.save` now, or :meth:`~CheckpointManager.save_if_due`
after every optimizer step, which saves when ``every_n_train_steps`` (a number or ``"auto"``,
which keeps saves under ``max_overhead`` of the loop's time) or ``train_time_interval`` falls
due (the run layer's :class:`~lightning_bpk.runtime.cadence.SaveTriggers`; rank 0's clock
decides, every rank follows), and on a preemption signal (SIGTERM, SIGUSR1: a flag only, the
ranks agree at the step boundary, save, wait for the write, requeue a SLURM job, then exit
with status 0). Retention is Dopamine's: the ``checkpoint_duration`` newest, plus every
``keep_every``-th save, and with ``monitor`` also the ``save_top_k`` best by the ``metric=``
given to each save (:attr:`CheckpointManager.best_step`). ``async_save`` writes on a
background thread (:class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`): the loop
waits for a copy into reused buffers only. The manager owns its directory
(:meth:`Checkpointer.take_over`): a run started later in the same directory takes it over, and
this one stops at its next save.

**Sharded models** (``ModelParallelStrategy`` with FSDP2 or tensor parallelism, which refuses
any ``CheckpointIO`` plugin): every rank writes its own shards through the burnpack DCP writer
into the checkpoint's staging prefix and rank 0 commits them with the sentinel
(:mod:`lightning_bpk.runtime.sharded`); restoring reshards to any number of ranks, and
:meth:`~CheckpointManager.export` writes one consolidated Burn-readable ``.bpk``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_bpk import _gin
from lightning_bpk.checkpointer import Checkpointer, _check_settings
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.errors import CheckpointResumeError, CheckpointSaveError
from lightning_bpk.fabric import _sharded, _state
from lightning_bpk.fabric._preemption import FabricPreemption
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX, TRAINER_KEY
from lightning_bpk.records import ModuleRecord, StateRecord
from lightning_bpk.runtime import resume
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.best import Standing, metric_value
from lightning_bpk.runtime.cadence import SaveTriggers
from lightning_bpk.runtime.preemption import PREEMPTION_SIGNALS
from lightning_bpk.runtime.ranks import Ranks
from lightning_bpk.runtime.rng import restore_rng
from lightning_bpk.runtime.saves import Saves
from lightning_bpk.store import location

__all__ = ["CheckpointManager", "Restored"]

log = logging.getLogger("lightning_bpk")


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` did: the ``remainder`` (what the checkpoint holds
    that the state did not ask for, as ``fabric.load`` returns it) and the ``step`` restored
    (None: no checkpoint, the loop starts from scratch)."""

    remainder: dict[str, Any]
    step: int | None


def _ranks(fabric: Any) -> Ranks:
    strategy = fabric.strategy
    return Ranks(
        world_size=fabric.world_size,
        is_global_zero=fabric.is_global_zero,
        reduce=lambda tensor: strategy.all_reduce(tensor, reduce_op="max"),
        device=torch.device("cpu") if fabric.device.type == "cpu" else fabric.device,
        broadcast=fabric.broadcast,
    )


@_gin.configurable("lightning_bpk.fabric")
class CheckpointManager:
    """Saves and restores the checkpoints of a Fabric loop in ``directory`` (module docstring).

    Args:
        fabric: the launched ``lightning.Fabric``; every method is called on every rank.
        directory: where the checkpoints go: a local directory or a URL (``s3://bucket/run``;
            ``storage_options`` go to fsspec).
        checkpoint_duration: keep the newest this many checkpoints (Dopamine's).
        keep_every: also keep every ``keep_every``-th save forever (milestones: the steps that
            are multiples of ``keep_every * every_n_train_steps``; of ``keep_every`` steps when
            the cadence is not a number).
        every_n_train_steps: :meth:`save_if_due` saves at the steps that are multiples of this,
            or ``"auto"``: as often as keeps a save's cost on the loop under ``max_overhead``
            of its time (measured; the first save comes 10 steps in).
        train_time_interval: :meth:`save_if_due` also saves when this much time has passed.
        max_overhead: the share of the loop's time ``"auto"`` may spend in saves.
        async_save: write on a background thread; the loop pays for a copy of the tensors;
            ``"process"``: the commit runs in a writer process, off this interpreter's lock.
        verify: read every byte of the chosen checkpoint when restoring (falling back past a
            damaged one); ``False`` checks sentinels and sizes only and reads on load.
        override_number: restore this checkpoint instead of the newest (gin's
            ``get_latest_checkpoint_number.override_number`` too); it must be complete. Other
            gin bindings of ``Checkpointer`` or ``get_latest_checkpoint_number`` would change
            nothing here (the manager passes its own settings): they are a
            :class:`~lightning_bpk.errors.CheckpointResumeError` naming the setting to bind.
        overwrite: let this run replace complete checkpoints newer than its first save (after
            restoring an older one, or starting over in a used directory); by default its first
            save stops with :class:`~lightning_bpk.errors.CheckpointResumeError` naming them.
        preemption_signals: the signals that save at the next step boundary and exit 0
            (empty: none); under SLURM with auto-requeue also the environment's requeue signal.
        auto_requeue: under SLURM (Lightning's ``SLURMEnvironment(auto_requeue=True)``), when
            the requeue signal (SIGUSR1) stopped the loop, rank 0 runs ``scontrol requeue``
            once the checkpoint is complete.
        checkpoint_file_prefix: data directories are ``{prefix}.{step}``.
        sentinel_file_identifier: sentinels are ``sentinel_{identifier}_complete.{step}``.
        storage_options: passed to fsspec for a URL ``directory``.
        monitor: also keep the ``save_top_k`` best checkpoints by the metric passed to
            :meth:`save` / :meth:`save_if_due` as ``metric=`` (the Lightning callback's rule:
            :mod:`lightning_bpk.checkpointer._best`); recorded in each manifest.
        mode: ``"min"`` or ``"max"``: which way ``monitor`` is better.
        save_top_k: how many best checkpoints to keep (-1: all, 0: none beyond Dopamine's).
    """

    def __init__(
        self,
        fabric: Any,
        directory: str | os.PathLike[str],
        *,
        checkpoint_duration: int = 4,
        keep_every: int | None = None,
        every_n_train_steps: int | str | None = None,
        train_time_interval: timedelta | None = None,
        max_overhead: float = 0.02,
        async_save: bool | str = False,
        verify: bool = True,
        override_number: int | None = None,
        overwrite: bool = False,
        preemption_signals: Sequence[int | str] = PREEMPTION_SIGNALS,
        auto_requeue: bool = True,
        checkpoint_file_prefix: str = DEFAULT_PREFIX,
        sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
        storage_options: Mapping[str, Any] | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
    ) -> None:
        # its checkpoint_frequency is the cadence's: every_n_train_steps
        renamed = {"checkpoint_frequency": "every_n_train_steps"}
        problem = resume.unapplied_bindings("CheckpointManager", renamed)
        if problem is not None:
            raise CheckpointResumeError(problem)
        self.triggers = SaveTriggers(every_n_train_steps, train_time_interval, max_overhead)
        if monitor is None and save_top_k != 1:
            raise ValueError(f"save_top_k={save_top_k!r} keeps the best by a metric: set monitor")
        self.monitor = monitor
        self._standing = Standing(None if monitor is None else BestK(monitor, mode, save_top_k))
        _check_settings(
            checkpoint_file_prefix, sentinel_file_identifier, 1, checkpoint_duration, keep_every
        )
        if override_number is not None and (
            isinstance(override_number, bool) or not isinstance(override_number, int)
        ):
            raise ValueError(f"override_number must be an int or None, got {override_number!r}")
        self.fabric = fabric
        self.verify = verify
        self.override_number = override_number
        self.overwrite = overwrite
        self.storage_options = dict(storage_options) if storage_options is not None else None
        self.restored_step: int | None = None
        self.last_saved_step: int | None = None
        self._checked_newer = False
        self._restored_from: str | None = None  # the checkpoint restore() loaded
        self._ranks = _ranks(fabric)
        step = every_n_train_steps if isinstance(every_n_train_steps, int) else 1
        self.directory = location(fabric.broadcast(str(location(directory))))
        self.checkpointer = self._open(
            checkpoint_file_prefix,
            sentinel_file_identifier,
            checkpoint_duration,
            None if keep_every is None else keep_every * step,
        )
        self._standing.attach(self.checkpointer)  # the best so far, from the manifests
        saver = AsyncCheckpointSaver.from_setting(async_save)  # checked on every rank
        self._saver = saver if fabric.is_global_zero else None
        self._saves = Saves(self.checkpointer, self._ranks, self._saver, self.storage_options)
        self._reserved = False  # the async saver's staging buffers were requested
        self.preemption = FabricPreemption(preemption_signals, fabric.strategy, auto_requeue)

    def _open(self, prefix: str, identifier: str, duration: int, keep: int | None) -> Checkpointer:
        """Rank 0 makes the directory and takes it over (every rank learns whether it could);
        then every rank opens it."""

        def make() -> Checkpointer:
            return Checkpointer(
                self.directory,
                prefix,
                identifier,
                checkpoint_frequency=1,
                checkpoint_duration=duration,
                keep_every=keep,
                storage_options=self.storage_options,
                best=self._standing.rule,
            )

        made: list[Checkpointer] = []

        def take_over() -> None:
            made.append(make())
            made[0].take_over()  # this run owns the directory (lightning_bpk.store.lease)

        failed = self._ranks.decide(take_over, lambda e: f"{type(e).__name__}: {e}")
        if failed is not None:
            raise CheckpointSaveError(f"rank 0 cannot open {self.directory}: {failed}")
        return made[0] if made else make()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, {self.checkpointer!r})"

    @property
    def best_k_steps(self) -> list[int]:
        """The kept checkpoints among the ``save_top_k`` best by ``monitor``, best first."""
        return self._standing.best_k()

    @property
    def best_step(self) -> int | None:
        """The best checkpoint by ``monitor`` (None: nothing monitored, or none saved with it);
        ``checkpointer.checkpoint_path(best_step)`` is where it lies."""
        return self._standing.best

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, state: dict[str, Any] | None = None, strict: bool = True) -> Restored:
        """Restore the newest complete checkpoint (or the override) into ``state`` in place, as
        ``fabric.load`` does; returns the remainder and the step (None: nothing to restore).

        ``strict``: every key of ``state`` must be in the checkpoint, every tensor of a module
        too (except those a ``filter`` left out of its save). Call on every rank.
        """
        state = {} if state is None else state
        parts = _state.split(state)
        choice, sharded = self._choose()
        number = choice.number
        if number < 0:
            if self.fabric.is_global_zero:
                log.info("no complete checkpoint in %s: starting from scratch", self.directory)
            self.preemption.log_restart(None)
            return Restored({}, None)
        where = choice.location
        source = f"checkpoint {number} ({where})"
        data: dict[str, Any] | None
        if sharded:
            data = _sharded.load(self.checkpointer, number, str(where), parts, self.storage_options)
        else:
            data = choice.data
            if data is None:
                data = self.checkpointer.load_checkpoint(number)
            if data is None:
                raise CheckpointResumeError(f"{source} is no longer complete")
        trainer = data.get(TRAINER_KEY)
        if not isinstance(trainer, dict) or trainer.get("format") != _state.FORMAT:
            raise CheckpointResumeError(
                f"{source} was not written by a CheckpointManager (its trainer record is not "
                f"{_state.FORMAT!r}): restore it with what wrote it"
            )
        rank = self.fabric.global_rank
        remainder = _state.restore(parts, state, data, rank, strict, source)
        ranks = trainer["ranks"]
        restore_rng((ranks[rank] if rank < len(ranks) else ranks[0])["rng"])
        self.restored_step = int(trainer["step"])
        self._restored_from = str(where)
        self.triggers.fit_started(self.restored_step)
        if self.fabric.is_global_zero:
            log.info("restored %s at step %d", source, self.restored_step)
        self.preemption.log_restart(str(where))
        return Restored(remainder, self.restored_step)

    def _choose(self) -> tuple[resume.ResumeChoice, bool]:
        """The checkpoint to restore (:func:`lightning_bpk.runtime.resume.choose`), chosen by
        rank 0 and broadcast, and whether it is sharded; on rank 0 with what it read choosing
        (every rank reads it otherwise)."""
        chosen = resume.ResumeChoice()

        def choose() -> tuple[int, str, bool, str | None]:
            nonlocal chosen
            checkpointer = self.checkpointer
            chosen = resume.choose(
                self.directory,
                checkpointer.sentinel_file_identifier,
                checkpointer.checkpoint_file_prefix,
                (TRAINER_KEY,),
                verify=self.verify,
                override=self.override_number,
                storage_options=self.storage_options,
                store=checkpointer.store,
            )
            if chosen.problem is not None:
                n = chosen.override
                return (
                    -1,
                    "",
                    False,
                    (
                        f"cannot restore checkpoint {n} in {self.directory} (override_number"
                        f" = {n}): {chosen.problem}. Complete checkpoints there: "
                        f"{chosen.complete or 'none'}; nothing was changed"
                    ),
                )
            if chosen.number < 0:
                return -1, "", False, None
            if chosen.location is not None:  # the verified choice read all but a sharded index
                sharded = chosen.data is None
            else:
                sharded = _sharded.is_sharded(checkpointer, chosen.number, self.storage_options)
                where = checkpointer.checkpoint_path(chosen.number)
                chosen = dataclasses.replace(chosen, location=where)
            return chosen.number, str(chosen.location), sharded, None

        number, where, sharded, error = self._ranks.decide(
            choose,
            lambda e: (-1, "", False, f"cannot look for a checkpoint in {self.directory}: {e}"),
        )
        if error is not None:
            raise CheckpointResumeError(error)
        if self.fabric.is_global_zero:
            return chosen, sharded
        return resume.ResumeChoice(number, location=where), sharded

    # -- saving --------------------------------------------------------------------------------

    def save_if_due(
        self,
        step: int,
        state: Mapping[str, Any],
        filter: _state.Filters | None = None,
        *,
        metric: Any = None,
    ) -> bool:
        """Call after every optimizer step (on every rank, with the step just taken): saves
        ``state`` as checkpoint ``step`` when the cadence falls due, and on an agreed preemption
        signal saves, waits for the write, requeues a SLURM job and exits with status 0
        (``SystemExit``). ``metric``: as for :meth:`save`. Returns whether it saved."""
        if self._saver is not None and not self._reserved:
            self._reserve(state, filter or {})
        triggers = self.triggers
        rank0_due = self.fabric.is_global_zero and triggers.rank0_due(step)
        preempt, timed = self._ranks.agree_all([self.preemption.flag(), int(rank0_due)])
        self.preemption.agree(preempt)
        stepped = triggers.stepped(step)
        triggers.batch_started(step)
        if not stepped:
            return False  # the same step again (gradient accumulation): no new state
        if not (self.preemption.agreed or timed or triggers.step_due(step)):
            return False
        preempted = self.preemption.agreed
        self.save(step, state, filter, flush=preempted, metric=metric)
        if preempted:
            path = None
            if self.fabric.is_global_zero:
                path = str(self.checkpointer.checkpoint_path(step))
            self.preemption.stop(self.fabric.is_global_zero, step, path)
        return True

    def _reserve(self, state: Mapping[str, Any], filters: _state.Filters) -> None:
        """Rank 0 with ``async_save``, after the first optimizer step (its state exists now):
        the writer thread allocates and faults in the staging buffers of the module and
        optimizer records, so the first save costs the loop a copy too (sharded models write
        their shards themselves and need none)."""
        self._reserved = True
        parts = _state.split(state)
        if self._saver is None or _sharded.layout(parts, filters) is not None:
            return
        self._saver.reserve(_state.module_records(parts, filters))
        self._saver.watch(parts.optimizers.values())  # their steps wait for an overlapped copy

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        filter: _state.Filters | None = None,
        *,
        flush: bool = False,
        metric: Any = None,
    ) -> None:
        """Save ``state`` (what you would pass to ``fabric.save``) as checkpoint ``step`` now,
        on every rank. ``filter`` maps state keys to ``fn(name, value) -> bool`` selecting a
        module's tensors (an adapter's, say) or a dict's entries, as ``fabric.save``'s does; a
        filtered module restores with the tensors it lacks left as they are. ``flush`` waits
        for an asynchronous write. ``metric``: the value of ``monitor`` for this checkpoint (a
        number or a one-element tensor, the same on every rank; None: not among the best, with
        a warning). Raises :class:`~lightning_bpk.errors.CheckpointSaveError`
        on every rank if it failed (every earlier checkpoint stays as it was)."""
        parts = _state.split(state)
        filters = dict(filter or {})
        _state.check_filters(parts, filters)
        sharded = _sharded.layout(parts, filters)
        started = self.triggers.save_started()
        self._check_newer(step)
        ranks = self._ranks.gather(_state.rank_entry(parts))

        def records() -> dict[str, Any]:
            entry = _state.trainer_entry(parts, filters, step, ranks or [], sharded)
            data = {} if sharded is not None else _state.module_records(parts, filters)
            data[TRAINER_KEY] = StateRecord(entry)
            return data

        shards = None if sharded is None else _sharded.shards(parts, sharded)
        value, retention = metric_value(metric), None
        if self._standing.rule is not None:  # the metric goes into the manifest
            retention = self.checkpointer.retention.scored(value)
            if value is None and self.fabric.is_global_zero:
                log.warning("checkpoint %d: no metric= for monitor=%r given", step, self.monitor)
        # a sharded save runs on this thread: the saver is rank 0's alone
        self._saves.save(
            step, records, shards=shards, flush=flush, background=False, retention=retention
        )
        self._standing.saved(step, value)
        self.last_saved_step = step
        self.triggers.saved(step, started)

    def _check_newer(self, step: int) -> None:
        """Before this manager's first save, at ``step``: refuse to save over complete
        checkpoints of another run (:func:`lightning_bpk.runtime.resume.in_the_way`: those
        numbered ``step`` or more but the one restored), or remove them with ``overwrite``.
        Rank 0 decides; every rank learns."""
        if self._checked_newer:
            return
        self._checked_newer = True

        def check() -> str | None:
            newer = resume.in_the_way(
                self.checkpointer,
                step,
                f"step {step}",
                self._restored_from,
                overwrite=self.overwrite,
                verify=self.verify,
                required_keys=(TRAINER_KEY,),
                storage_options=self.storage_options,
            )
            if not newer:
                return None
            return (
                f"{self.directory} holds complete checkpoints {sorted(newer)}, newer than step "
                f"{step} this run saves now, so a restore would choose them over this "
                "run's: restore the newest (restore(state) without override_number), "
                "use another directory, or pass overwrite=True to remove them"
            )

        error = self._ranks.decide(
            check, lambda e: f"cannot check {self.directory} before saving: {e}", reraise=False
        )
        if error is not None:
            raise CheckpointResumeError(error)

    # -- the rest ------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until an asynchronous write in flight is complete; raise
        :class:`~lightning_bpk.errors.CheckpointSaveError` if it failed."""
        self._saves.wait()

    def close(self) -> None:
        """Wait for the write in flight (raising its failure), and put back the signal
        handlers found at construction. The manager can save again afterwards."""
        try:
            self._saves.close()
        finally:
            self.preemption.restore()

    def export(
        self, path: str | os.PathLike[str], step: int | None = None, key: str = "model"
    ) -> Path:
        """Write the module saved under ``key`` in checkpoint ``step`` (None: the newest
        complete one) as one consolidated file at ``path`` (``.bpk``, Burn-readable, or
        ``.safetensors``); from a sharded checkpoint, the shards of every rank assembled.
        Call it in one process (rank 0), not a collective; returns ``path``."""
        from lightning_bpk.interop import save_module_record

        number = self.checkpointer.latest_checkpoint_number() if step is None else step
        if number < 0:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        record = _sharded.module_record(self.checkpointer, number, key, self.storage_options)
        if not isinstance(record, ModuleRecord):
            raise ValueError(f"checkpoint {number} holds no module under {key!r}")
        return save_module_record(record, path)
