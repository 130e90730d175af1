"""The callback's resume, in Lightning's terms: loading the chosen checkpoint, and the checks.

The run layer chooses what to resume and finds the checkpoints a run would save over
(:mod:`lightning_bpk.runtime.resume`); here Lightning's ``resume_start`` is routed to the
chosen checkpoint when ``fit`` got no ``ckpt_path`` (:func:`intercept`), and the checks say
what to do instead, in the callback's words: a ``ckpt_path`` that names one file of a
checkpoint (:func:`member_of_checkpoint`), an override that names no complete checkpoint
(:func:`override_problem`), a checkpoint of other optimizer or scheduler classes
(:func:`check_classes`), complete checkpoints this run's saves would replace
(:func:`save_over_problem`). Each is read-only. :func:`take_folder` makes the choice on rank 0
and takes the folder over, every rank learning the outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.errors import CheckpointResumeError, LightningBpkError
from lightning_bpk.layout import parse_sentinel_name
from lightning_bpk.lightning import _compat, _exact, _runs, sharded, trainer_state
from lightning_bpk.lightning.triggers import FINISHED_KEY, describe, still_finished
from lightning_bpk.runtime import resume
from lightning_bpk.runtime.ranks import Ranks
from lightning_bpk.runtime.resume import ResumeChoice
from lightning_bpk.store import location, name_of, open_store, parent_of

log = logging.getLogger("lightning_bpk")


def member_of_checkpoint(path: Any, storage_options: Mapping[str, Any] | None) -> str | None:
    """The error for a ``ckpt_path`` that names a file inside a checkpoint directory
    (``ckpt.3/model.bpk``: one file is not a checkpoint), naming the directory to pass instead;
    ``None`` for any other path (Lightning's reader then reports it)."""
    target = location(path)
    directory = parent_of(target)
    number = name_of(directory).partition("~")[0].rpartition(".")[2]
    if not number.isdigit():
        return None
    try:
        names = open_store(parent_of(directory), storage_options).list("")
    except (OSError, LightningBpkError):
        return None  # not readable: Lightning's own reader reports the path
    sentinels = [parse_sentinel_name(name) for name in names]
    if not any(parsed is not None and parsed[1] == int(number) for parsed in sentinels):
        return None
    return (
        f"ckpt_path {target} is a file inside checkpoint {number} ({directory}); a "
        f"checkpoint is its whole directory: pass ckpt_path={str(directory)!r}"
    )


def restored_at(checkpoint: Mapping[str, Any]) -> tuple[str, int | None]:
    """Where in training a loaded checkpoint was saved, for the "restored" log line, and the
    batches of its epoch a mid-epoch save had consumed when the resumed run continues after
    them (``None``: the epoch's end, or an epoch replayed from its first batch)."""
    preempted = checkpoint.get(trainer_state.PREEMPTED_KEY)
    if not preempted:
        return f"the end of epoch {checkpoint.get('epoch')}", None
    batches = preempted["batches"]
    where = f"epoch {checkpoint.get('epoch')}, after {batches} batch"
    where += "es" if batches != 1 else ""
    if preempted.get("replay", True):
        return where + " (that epoch is replayed from its first batch)", None
    return where, batches


def check_classes(trainer: pl.Trainer, classes: dict) -> None:
    """Refuse other optimizer or scheduler classes before Lightning loads the checkpoint's
    state into them (Adam's state in SGD fails at its first step, in AdamW it silently
    changes meaning).

    Lightning loads the saved scheduler states pairwise into the schedulers configured at fit
    start; states beyond those belong to schedulers a callback creates later and restores
    from its own state (StochasticWeightAveraging's SWALR), so they are not refused."""
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    classes = dict(classes)
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
    problems = trainer_state._class_mismatches(classes, trainer.optimizers, schedulers)
    if problems:
        raise CheckpointResumeError(
            f"cannot resume from {trainer.ckpt_path}: {'; '.join(problems)}. Resume with the "
            "optimizers and schedulers it was saved with; to switch, load only the weights "
            "(ModuleRecord.load(...).apply(model)) and start a new run"
        )


def log_last(directory: Any, number: int) -> None:
    """Say what ``ckpt_path="last"`` found in ``directory`` (rank 0): it resumes the newest
    complete checkpoint ``number``, or starts from scratch."""
    log.info(
        'ckpt_path="last": %s',
        f"the newest complete checkpoint in {directory} is {number}"
        if number >= 0
        else f"no complete checkpoint in {directory} yet; training starts from scratch",
    )


def override_problem(choice: ResumeChoice, directory: Any) -> str | None:
    """Why gin's ``override_number`` cannot be resumed (None: it can, or none is bound)."""
    if choice.problem is None:
        return None
    n = choice.override
    return (
        f"cannot resume from checkpoint {n} in {directory} (gin "
        f"get_latest_checkpoint_number.override_number = {n}): {choice.problem}. "
        f"Complete checkpoints there: {choice.complete or 'none'}. Nothing was changed; bind "
        "override_number to one of them, or unbind it to resume from the newest"
    )


def take_folder(
    trainer: pl.Trainer,
    dirpath: Any,
    ranks: Ranks,
    make: Callable[[Any], Checkpointer],
    choose_in: Callable[[Any], ResumeChoice] | None,
    *,
    idle: str | None,
    last_requested: bool,
) -> tuple[Checkpointer, ResumeChoice]:
    """A fit's checkpointer over ``dirpath`` (``make``) and what it resumes, on every rank.

    Rank 0 chooses (``choose_in``; None: no resume) before anything is created (read-only),
    then owns the directory (:meth:`~lightning_bpk.checkpointer.Checkpointer.take_over`) and
    chooses again if a run saving there meanwhile committed a newer checkpoint; every rank
    learns the outcome, or the :class:`CheckpointResumeError`. An ``idle`` fit (a smoke test, a
    tuner: :mod:`lightning_bpk.lightning._runs`) neither resumes nor takes the folder over.
    ``last_requested``: ``fit(ckpt_path="last")`` found no file of Lightning's (logged).
    """
    chosen, made = ResumeChoice(), None
    resuming = None if idle else choose_in

    def choose() -> tuple[int, str | None]:
        nonlocal chosen, made
        chosen = resuming(dirpath) if resuming is not None else chosen
        problem = override_problem(chosen, dirpath)
        if problem is None:
            made = make(dirpath)
            if idle:
                log.info("BurnpackCheckpoint neither resumes nor saves in %s", idle)
                return chosen.number, None
            made.take_over()  # this run owns it (lightning_bpk.store.lease)
            if resuming is not None and resume.superseded_by_a_newer(chosen, made):
                chosen = resuming(dirpath)
        return chosen.number, problem

    number, error = ranks.decide(
        choose, lambda e: (-1, f"cannot look for a checkpoint to resume from in {dirpath}: {e}")
    )
    if error is not None:
        raise CheckpointResumeError(error)
    if last_requested and trainer.is_global_zero:
        log_last(dirpath, number)
    trainer.strategy.barrier("BurnpackCheckpoint.setup")  # rank 0 created the directory
    checkpointer = made if made is not None else make(dirpath)  # made: rank 0's, choosing
    return checkpointer, chosen if trainer.is_global_zero else ResumeChoice(number)


def save_over_problem(
    trainer: pl.Trainer,
    checkpointer: Checkpointer,
    step_numbered: bool,
    overwrite: bool,
    verify: bool,
    storage_options: Mapping[str, Any] | None,
) -> str | None:
    """Rank 0, before the first step: the error for a run that would save over complete
    checkpoints of another (:func:`lightning_bpk.runtime.resume.in_the_way`; None: none, or
    ``overwrite`` removed them)."""
    # the number of this run's first save is at least its starting epoch or global step
    start = trainer.global_step if step_numbered else trainer.current_epoch
    start_name = f"global step {start}" if step_numbered else f"epoch {start}"
    newer = resume.in_the_way(
        checkpointer,
        start,
        start_name,
        trainer.ckpt_path,
        overwrite=overwrite,
        verify=verify,
        required_keys=trainer_state.REQUIRED_KEYS,
        storage_options=storage_options,
    )
    if not newer:
        return None
    base = checkpointer.base_directory
    source = f"resumes from {trainer.ckpt_path}" if trainer.ckpt_path else "starts from scratch"
    return (
        f"this run {source} ({start_name}), and {base} holds complete "
        f"checkpoints {newer} that its saves would replace. Nothing was changed. To "
        "continue the newest, run with resume=True and neither ckpt_path nor "
        "override_number; to start over or go back, set BurnpackCheckpoint(overwrite=True) "
        "(gin: BurnpackCheckpoint.overwrite = True), which removes them first; or save into "
        "another dirpath"
    )


def intercept(
    trainer: pl.Trainer,
    choice: ResumeChoice,
    checkpointer: Checkpointer | None,
    storage_options: Mapping[str, Any] | None,
    resumed: Callable[[int], None],
) -> None:
    """Make the trainer's next ``resume_start`` load ``choice`` when ``fit`` got no
    ``ckpt_path`` (calling ``resumed(number)``): what rank 0 read choosing it, once, or what
    every rank reads now (a sharded checkpoint: each rank its part). A ``ckpt_path`` that is a
    checkpoint directory of ours is read here too, in ``fit``, ``validate``, ``test`` and
    ``predict`` (there with no choice: ``ResumeChoice()`` and no ``checkpointer``); any other
    goes Lightning's way."""
    preloaded = [choice.data]

    def resume_start(
        original: Any, checkpoint_path: Any, weights_only: bool | None
    ) -> tuple[Any, dict[str, Any]] | None:
        path = checkpoint_path
        if path is None and choice.number >= 0:
            assert checkpointer is not None  # a choice comes with its checkpointer
            path = choice.location or checkpointer.checkpoint_path(choice.number)
        ours = checkpoint_path is None and path is not None
        if not ours and (path is None or not trainer_state.is_checkpoint_directory(path)):
            if path is not None and (problem := member_of_checkpoint(path, storage_options)):
                raise CheckpointResumeError(problem)
            original(checkpoint_path, weights_only)  # Lightning's path: its IO, its checks
            return None
        if ours:
            resumed(choice.number)
            rank_zero_info(f"BurnpackCheckpoint: resuming from checkpoint {path}")
        data, preloaded[0] = preloaded[0], None
        if ours and data is not None:  # rank 0 read it choosing
            return path, trainer_state.from_records(data, str(path))
        if sharded.is_sharded(path, storage_options=storage_options):  # FSDP2 etc.
            return path, sharded._restore(trainer, path, storage_options)  # each rank its part
        return path, trainer_state.load(path, storage_options)

    _compat.intercept_resume_start(trainer, resume_start)


class Resumed:
    """What the checkpoint of ours one fit resumed from says beyond Lightning's own state.

    ``number``: that checkpoint (None: the fit did not resume from ours); ``batches``: the
    batches of the current epoch it had consumed (0: none, or the epoch is replayed);
    ``replay_floor``: step-numbered saves up to this number would repeat a replayed epoch;
    ``finished``: why the run has nothing left to train (None: it goes on). Its optimizer and
    scheduler classes are checked once, at the first chance (:meth:`check_classes`).
    """

    def __init__(self) -> None:
        self.number: int | None = None
        self.batches = 0
        self.replay_floor = -1
        self.finished: str | None = None
        self._classes: dict | None = None
        self._fit_started = False
        self.lost = _exact.LostState()  # what Lightning's restore leaves out

    def loaded(self, trainer: pl.Trainer, checkpoint: dict[str, Any], by_step: bool) -> None:
        """Lightning loaded ``checkpoint`` (``by_step``: checkpoints are numbered by step); one
        of ours numbered the other way is refused (:func:`~lightning_bpk.lightning._runs.
        numbering_problem`)."""
        if self.number is not None:
            problem = _runs.numbering_problem(checkpoint, self.number, by_step, trainer.ckpt_path)
            if problem is not None:
                raise CheckpointResumeError(problem)
        self._classes = checkpoint.get(trainer_state.CLASSES_KEY)
        self.lost.loaded(trainer, checkpoint)
        if self._fit_started:  # strategies that restore after setup (FSDP, DeepSpeed)
            self.check_classes(trainer)
        where, batches = restored_at(checkpoint)
        self.batches = batches or 0
        if batches is not None and by_step and self.number is not None:
            self.replay_floor = self.number
        ended = checkpoint.get(FINISHED_KEY)
        if ended and self.number is not None and still_finished(trainer, ended, checkpoint):
            self.finished = describe(ended)
        if trainer.is_global_zero:
            log.info("restored %s, saved at %s", trainer.ckpt_path, where)

    def fit_started(self, trainer: pl.Trainer, base: Any) -> None:
        """Check the classes; a finished run stops before its first batch (Lightning's fit
        loop does when ``should_stop`` is set)."""
        self._fit_started = True
        self.check_classes(trainer)
        if self.finished is None:
            return
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.info(
                "the run in %s already finished at checkpoint %s (%s); nothing to train "
                "(resume=False or another directory trains again)",
                base,
                self.number,
                self.finished,
            )

    def check_classes(self, trainer: pl.Trainer) -> None:
        """Refuse other optimizer or scheduler classes (once, at the first chance)."""
        classes, self._classes = self._classes, None
        if classes is not None:
            check_classes(trainer, classes)

    def train_started(self, trainer: pl.Trainer, batch: int | None = None) -> None:
        """Say where training continues (``batch``: the batch of the epoch it continues at when
        the data continues in samples, a batch size changed), and rebuild what a mid-epoch
        resume needs."""
        self.lost.train_started(trainer)
        if self.number is None:
            return
        batch = self.batches if batch is None else batch
        if trainer.is_global_zero:
            log.info(
                "continuing training at epoch %d%s (global step %d) after checkpoint %d",
                trainer.current_epoch,
                f", batch {batch}" if batch else "",
                trainer.global_step,
                self.number,
            )
        if _compat.resume_swa_mid_epoch(trainer):
            log.info("StochasticWeightAveraging's SWALR rebuilt for the resumed epoch")
