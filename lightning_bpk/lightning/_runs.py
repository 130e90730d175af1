"""Which fits a ``BurnpackCheckpoint`` takes part in, and what it refuses before touching a folder.

Checked in the callback's ``setup``, read-only, before anything is chosen or created:

- **Runs that are not training runs** (:func:`idle_reason`): ``fast_dev_run`` (Lightning's
  smoke test; its ``ModelCheckpoint`` saves nothing either) and the fits Lightning's ``Tuner``
  makes (``lr_find``, ``scale_batch_size``: its finder callbacks exit early) neither resume,
  nor take the folder over, nor save: a smoke test cannot leave a checkpoint that a real run
  would then continue from, and a tuner tunes the model it was given.
- **Several callbacks in one Trainer** (:func:`conflict`): Lightning restores a trainer from
  one checkpoint, so at most one of them may resume, and no two may save into one folder.
- **gin bindings the callback cannot apply**
  (:func:`lightning_bpk.runtime.resume.unapplied_bindings`): the callback builds
  its ``Checkpointer`` and chooses its resume with its own settings, so a binding of
  ``Checkpointer.*`` or ``get_latest_checkpoint_number.*`` (except ``override_number``, which it
  honours) would change nothing; it is an error naming the callback setting to bind instead.
- **A change of numbering** (:func:`numbering_problem`): a folder's checkpoints are numbered by
  epoch or by global step; a run numbering the other way would mix the two, and resume, retain
  and refuse by numbers that mean different things.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

from lightning_bpk.layout import RUN_SUBDIRECTORY
from lightning_bpk.store import identity, join, location, parent_of

__all__ = [
    "conflict",
    "folder",
    "idle_reason",
    "numbering_problem",
    "resumer",
]


def idle_reason(trainer: pl.Trainer) -> str | None:
    """Why this fit is no training run the callback saves or resumes (None: it is one)."""
    fast_dev_run = getattr(trainer, "fast_dev_run", False)  # set by the Trainer's init
    if fast_dev_run:
        return f"fast_dev_run={fast_dev_run!r}"
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    for callback in callbacks:
        if isinstance(callback, (LearningRateFinder, BatchSizeFinder)) and callback._early_exit:
            return f"a tuning run ({type(callback).__name__} of Lightning's Tuner)"
    return None


def folder(callback: Any, trainer: pl.Trainer) -> Path | str:
    """Where ``callback`` saves in ``trainer``'s fit (each rank's view: rank 0's is broadcast)."""
    return callback.dirpath or join(location(trainer.default_root_dir), RUN_SUBDIRECTORY)


def conflict(trainer: pl.Trainer, mine: type) -> str | None:
    """The error for several callbacks of class ``mine`` in ``trainer`` that cannot work side by
    side (None: no conflict)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    ours: list[Any] = [c for c in callbacks if isinstance(c, mine)]
    if len(ours) < 2:
        return None
    folders = [identity(folder(c, trainer)) for c in ours]
    pairs = list(zip(ours, folders, strict=True))
    listed = ", ".join(f"#{i} {f} (resume={c.resume})" for i, (c, f) in enumerate(pairs))
    shared = sorted({f for f in folders if folders.count(f) > 1})
    if shared:
        return (
            f"{len(ours)} BurnpackCheckpoint callbacks in one Trainer save into the same folder "
            f"{shared[0]} ({listed}): give each its own dirpath"
        )
    resuming = [f for c, f in pairs if c.resume]
    if len(resuming) < 2:
        return None
    return (
        f"{len(resuming)} BurnpackCheckpoint callbacks in one Trainer resume ({listed}), but "
        "Lightning restores a trainer from one checkpoint. Keep resume=True on the one to "
        "continue from and give the others resume=False, overwrite=True: they then save into "
        "their folders from where the run continues, replacing their own checkpoints from "
        "that point on"
    )


def resumer(trainer: pl.Trainer, mine: type) -> Any:
    """The callback of class ``mine`` that loads the trainer's checkpoint: the one that resumes,
    else the first (it reads an explicit ``ckpt_path`` of ours)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    ours: list[Any] = [c for c in callbacks if isinstance(c, mine)]
    return next((c for c in ours if c.resume), ours[0] if ours else None)


def numbering_problem(
    checkpoint: Mapping[str, Any], number: int, step_numbered: bool, path: Any
) -> str | None:
    """The error for resuming checkpoint ``number`` (at ``path``) numbered the other way than
    this run numbers (``step_numbered``: by global step); None when it matches or cannot tell
    (a checkpoint whose epoch and global step are both ``number``)."""
    epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
    by_step, by_epoch = number == step, number == epoch
    if by_step in (by_epoch, step_numbered):
        return None
    theirs = "global step" if by_step else "epoch"
    ours = (
        "global step (every_n_train_steps or train_time_interval set)"
        if step_numbered
        else ("epoch (no every_n_train_steps or train_time_interval)")
    )
    switch = "every_n_train_steps" if by_step else "no every_n_train_steps/train_time_interval"
    return (
        f"{parent_of(location(path))} holds checkpoints numbered by {theirs} (checkpoint "
        f"{number} was saved at epoch {epoch}, global step {step}), and this run numbers "
        f"its checkpoints by {ours}; "
        "mixing them would resume, keep and refuse by numbers that mean different things. "
        f"Nothing was changed. Continue with the numbering the folder has ({switch}), or "
        "start the new numbering in another folder: BurnpackCheckpoint(dirpath=<new folder>) "
        f"with fit(ckpt_path={str(path)!r}) continues this run there"
    )
