"""When a run is finished, and what a ``ckpt_path`` given to ``fit`` may not be.

:class:`~lightning_bpk.callback.BurnpackCheckpoint` marks the checkpoint saved when training
ends with why it ended (:func:`finished`, under ``FINISHED_KEY``); a re-run reads it back and
trains nothing while :func:`still_finished` holds under its own limits: ``max_epochs`` and
``max_steps`` no larger, ``max_time`` no larger than the training time the run had (Lightning's
Timer restores that time with its state), or an early stop (a decision, not a limit).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer

from lightning_bpk import storage
from lightning_bpk.lightning import _compat
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.layout import parse_sentinel_name

__all__ = ["describe", "finished", "member_of_checkpoint", "still_finished"]


def finished(trainer: pl.Trainer, epoch_end: bool) -> dict | None:
    """Why the fit loop stops after this point, or ``None`` while it goes on."""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return {"by": "max_steps", "limit": trainer.max_steps}
    epochs = trainer.current_epoch + int(epoch_end)
    if epoch_end and trainer.max_epochs not in (None, -1) and epochs >= trainer.max_epochs:
        return {"by": "max_epochs", "limit": trainer.max_epochs}
    min_ok = epochs >= (trainer.min_epochs or 0) and trainer.global_step >= (trainer.min_steps or 0)
    if trainer.should_stop and min_ok:
        timer = _timer(trainer)
        if timer is not None and (timer.time_remaining() or 0.0) <= 0:  # Lightning's max_time
            elapsed = timer.time_elapsed()
            return {"by": "max_time", "limit": _max_time(timer), "elapsed": elapsed}
        return {"by": "should_stop", "limit": -1}
    return None


def _timer(trainer: pl.Trainer) -> Timer | None:
    """The Timer callback that enforces ``Trainer(max_time=...)``, if any."""
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]  # type: ignore[attr-defined]
    return timers[0] if timers else None


def _max_time(timer: Timer) -> float | None:
    """The Timer's duration in seconds (``None``: no limit)."""
    return _compat.timer_duration(timer)


def still_finished(trainer: pl.Trainer, finished: dict, checkpoint: dict) -> bool:
    """Whether a run that ``finished`` is still finished under this trainer's limits."""
    by, limit = finished["by"], finished["limit"]
    if by == "max_steps":
        return trainer.max_steps not in (None, -1) and limit >= trainer.max_steps
    if by == "max_epochs":
        return trainer.max_epochs not in (None, -1) and limit >= trainer.max_epochs
    if by == "max_time":  # the Timer restores the time trained so far, and goes on from it
        timer = _timer(trainer)
        duration = None if timer is None else _max_time(timer)
        elapsed = finished.get("elapsed")
        if not isinstance(elapsed, (int, float)):
            return True  # not what this package saves: keep it finished rather than guess
        return duration is not None and duration <= elapsed
    return True  # stopped early (EarlyStopping, should_stop): a decision, not a limit


def describe(finished: dict) -> str:
    """Why a run finished, for the "already finished" log line."""
    if finished["by"] == "should_stop":
        return "it was stopped early (trainer.should_stop, e.g. by EarlyStopping)"
    if finished["by"] == "max_time":
        limit, elapsed = finished.get("limit"), finished.get("elapsed")
        if isinstance(limit, (int, float)) and isinstance(elapsed, (int, float)):
            return f"max_time={timedelta(seconds=limit)} was reached after {elapsed:.1f} s"
    return f"{finished['by']}={finished['limit']} was reached"


def member_of_checkpoint(path: Any, storage_options: Mapping[str, Any] | None) -> str | None:
    """The error for a ``ckpt_path`` that names a file inside a checkpoint directory
    (``ckpt.3/model.bpk``: one file is not a checkpoint), naming the directory to pass instead;
    ``None`` for any other path (Lightning's reader then reports it)."""
    target = storage.location(path)
    directory = storage.parent_of(target)
    number = storage.name_of(directory).partition("~")[0].rpartition(".")[2]
    if not number.isdigit():
        return None
    try:
        beside = storage.parent_of(directory)
        if isinstance(beside, Path):
            names: Sequence[str] = os.listdir(beside) if beside.is_dir() else []
        else:
            names = list(storage.object_store(beside, storage_options).list(""))
    except (OSError, LightningBpkError):
        return None  # not readable: Lightning's own reader reports the path
    sentinels = [parse_sentinel_name(name) for name in names]
    if not any(parsed is not None and parsed[1] == int(number) for parsed in sentinels):
        return None
    return (
        f"ckpt_path {target} is a file inside checkpoint {number} ({directory}); a "
        f"checkpoint is its whole directory: pass ckpt_path={str(directory)!r}"
    )
