"""Checks the callback makes around a resume, before anything is trained or saved.

A ``ckpt_path`` that names one file of a checkpoint (:func:`member_of_checkpoint`), a
checkpoint of other optimizer or scheduler classes (:func:`check_classes`), and complete
checkpoints this run's saves would replace (:func:`newer_checkpoints`). Each is read-only, and
says what to do instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_bpk.checkpointer import Checkpointer, list_checkpoints, verify_checkpoint
from lightning_bpk.errors import CheckpointResumeError, LightningBpkError
from lightning_bpk.layout import parse_sentinel_name
from lightning_bpk.lightning import trainer_state
from lightning_bpk.store import location, name_of, open_store, parent_of

log = logging.getLogger("lightning_bpk")


def _identity(path: Any) -> str:
    """A checkpoint directory's identity for comparisons: the resolved local path, or the URL."""
    found = location(path)
    return str(found.resolve() if isinstance(found, Path) else found)


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


def newer_checkpoints(
    trainer: pl.Trainer,
    checkpointer: Checkpointer,
    start: int,
    start_name: str,
    overwrite: bool,
    verify: bool,
    names: dict[str, Any],
) -> str | None:
    """Rank 0, before the first step: complete checkpoints from ``start`` (the epoch or global
    step this run starts at, ``start_name`` in words) on, other than the one it resumed from,
    would be saved over. Remove them when ``overwrite`` is set; otherwise the error to stop
    with (nothing changed)."""
    base = checkpointer.base_directory
    resumed = _identity(trainer.ckpt_path) if trainer.ckpt_path else None
    newer = [
        e.number
        for e in list_checkpoints(base, **names)
        if e.complete and e.number >= start and _identity(e.data) != resumed
    ]
    if not newer:
        return None
    if overwrite:
        log.warning(
            "overwrite=True: removing checkpoints %s in %s, which this run (starting at "
            "%s) would save over",
            newer,
            base,
            start_name,
        )
        checkpointer.remove_checkpoints(newer)
        return None
    usable = any(  # damaged ones are replaced anyway (resume fell back past them)
        not verify_checkpoint(
            base, n, full=verify, required_keys=trainer_state.REQUIRED_KEYS, **names
        )
        for n in newer
    )
    if not usable:
        return None
    source = f"resumes from {trainer.ckpt_path}" if trainer.ckpt_path else "starts from scratch"
    return (
        f"this run {source} ({start_name}), and {base} holds complete "
        f"checkpoints {newer} that its saves would replace. Nothing was changed. To "
        "continue the newest, run with resume=True and neither ckpt_path nor "
        "override_number; to start over or go back, set BurnpackCheckpoint(overwrite=True) "
        "(gin: BurnpackCheckpoint.overwrite = True), which removes them first; or save into "
        "another dirpath"
    )
