"""The callback's resume, in Lightning's terms: loading the chosen checkpoint, and the checks.

The run layer chooses what to resume and finds the checkpoints a run would save over
(:mod:`lightning_bpk.runtime.resume`); here Lightning's ``resume_start`` is routed to the
chosen checkpoint when ``fit`` got no ``ckpt_path`` (:func:`intercept`), and the checks say
what to do instead, in the callback's words: a ``ckpt_path`` that names one file of a
checkpoint (:func:`member_of_checkpoint`), an override that names no complete checkpoint
(:func:`override_problem`), a checkpoint of other optimizer or scheduler classes
(:func:`check_classes`), complete checkpoints this run's saves would replace
(:func:`save_over_problem`). Each is read-only.
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
from lightning_bpk.lightning import _compat, sharded, trainer_state
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
    problems = trainer_state.class_mismatches(classes, trainer.optimizers, schedulers)
    if problems:
        raise CheckpointResumeError(
            f"cannot resume from {trainer.ckpt_path}: {'; '.join(problems)}. Resume with the "
            "optimizers and schedulers it was saved with; to switch, load only the weights "
            "(ModuleRecord.load(...).apply(model)) and start a new run"
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


def save_over_problem(trainer: pl.Trainer, base: Any, newer: list[int], start_name: str) -> str:
    """The error for a run that would save over the complete checkpoints ``newer`` of ``base``
    (:func:`lightning_bpk.runtime.resume.in_the_way`), starting at ``start_name``."""
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
    checkpointer: Checkpointer,
    storage_options: Mapping[str, Any] | None,
    resumed: Callable[[int], None],
) -> None:
    """Make the trainer's next ``resume_start`` load ``choice`` when ``fit`` got no
    ``ckpt_path`` (calling ``resumed(number)``): what rank 0 read choosing it, once, or what
    every rank reads now (a sharded checkpoint: each rank its part). A ``ckpt_path`` that is a
    checkpoint directory of ours is read here too; any other goes Lightning's way."""
    preloaded = [choice.data]

    def resume_start(
        original: Any, checkpoint_path: Any, weights_only: bool | None
    ) -> tuple[Any, dict[str, Any]] | None:
        path = checkpoint_path
        if path is None and choice.number >= 0:
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
