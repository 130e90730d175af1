"""When Lightning's epoch-end save is the one to make, and when a run is finished.

**Epoch ends.** A step or time save (:class:`~lightning_bpk.runtime.cadence.SaveTriggers`, fed
the trainer's counters by :class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint`) that
falls due on an epoch's last batch becomes that epoch's end save (:func:`epoch_ends_here`).

**Finished.** The callback marks the checkpoint saved when training ends with why it ended
(:func:`finished`, under :data:`FINISHED_KEY`); a re-run reads it back and trains nothing while
:func:`still_finished` holds under its own limits: ``max_epochs`` and ``max_steps`` no larger,
``max_time`` no larger than the training time the run had (Lightning's Timer restores that time
with its state), or an early stop (a decision, not a limit).
"""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer

from lightning_bpk.lightning import _compat

__all__ = [
    "FINISHED_KEY",
    "describe",
    "epoch_ends_here",
    "finished",
    "still_finished",
]

# Top-level key of a checkpoint saved when the run ended (why, and the limit it reached).
FINISHED_KEY = "lightning_bpk_finished"


def epoch_ends_here(trainer: pl.Trainer) -> bool:
    """This batch ends the epoch (its last batch, ``max_steps``, or ``should_stop``): the
    epoch-end save, after the validation that follows, is the one to make."""
    max_steps = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
    last = _compat.is_last_batch(trainer)
    return bool(last or max_steps or trainer.should_stop)


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
