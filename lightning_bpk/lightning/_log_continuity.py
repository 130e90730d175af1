"""A resumed run logs on where it stopped: the same logger version, no step logged twice.

Lightning creates a logger's experiment (and with it a new ``version_N``) before any callback
runs, so a run resumed by the callback would log into a new version, and a killed run's rows
after the save point would stand beside the resumed run's rows for the same steps. Each save
records the version of every logger (:func:`capture`); when the checkpoint is loaded
(:func:`continue_versions`) a ``CSVLogger`` that chose a fresh version by itself (its folder
still empty) is moved back to the saved one: its rows from before the save point are kept,
those the killed run logged after it are dropped (the resumed run logs those steps again), and
the empty folder is removed. Any other logger whose version differs from the saved one is named
in a warning (a logger given an explicit ``version`` keeps it).
"""

from __future__ import annotations

import csv
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger

from lightning_bpk.lightning.trainer_state import PREEMPTED_KEY

__all__ = ["LOGGERS_KEY", "capture", "continue_versions"]

LOGGERS_KEY = "lightning_bpk_loggers"
"""Top-level key of a checkpoint: each logger's class and version when it was saved."""

log = logging.getLogger("lightning_bpk")


def capture(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Every logger's class name and version (None: it has none)."""
    return [
        {"type": type(logger).__qualname__, "version": _version(logger)}
        for logger in trainer.loggers
    ]


def _version(logger: Any) -> int | str | None:
    version = getattr(logger, "version", None)
    return version if isinstance(version, (int, str)) else None


def continue_versions(trainer: pl.Trainer, checkpoint: Mapping[str, Any]) -> None:
    """Move each logger back to the version ``checkpoint`` was saved in (module docstring)."""
    saved = checkpoint.get(LOGGERS_KEY) or []
    for logger, entry in zip(trainer.loggers, saved, strict=False):
        version = entry.get("version")
        if entry.get("type") != type(logger).__qualname__ or version is None:
            continue
        if _version(logger) == version:
            continue
        if isinstance(logger, CSVLogger) and _fresh(logger.log_dir):
            _continue_csv(trainer, logger, version, _logged_up_to(checkpoint))
        elif trainer.is_global_zero:
            warnings.warn(
                f"BurnpackCheckpoint resume: {type(logger).__name__} logs as version "
                f"{_version(logger)!r}, the run it resumes logged as {version!r}",
                stacklevel=2,
            )


def _fresh(directory: str) -> bool:
    """The folder a logger just made for a new version holds nothing yet."""
    fs = get_filesystem(directory)
    return not fs.exists(directory) or not fs.listdir(directory)


def _logged_up_to(checkpoint: Mapping[str, Any]) -> int | None:
    """The first logging step the resumed run logs (rows from it on were logged after the save
    by the run that stopped): Lightning's ``_batches_that_stepped`` at the save, which a batch's
    row is logged at before it is counted, so one more after a mid-epoch save (that batch's row
    came after the save)."""
    loops = checkpoint.get("loops") or {}
    epoch_loop = (loops.get("fit_loop") or {}).get("epoch_loop.state_dict") or {}
    step = epoch_loop.get("_batches_that_stepped")
    if not isinstance(step, int):
        return None
    mid_epoch = checkpoint.get(PREEMPTED_KEY) or {}
    return step + int(bool(mid_epoch) and not mid_epoch.get("replay", True))


def _continue_csv(trainer: pl.Trainer, logger: CSVLogger, version: Any, step: int | None) -> None:
    """Point ``logger`` at ``version`` again, keeping its rows logged before ``step``."""
    fresh = logger.log_dir
    logger._version = version
    metrics = os.path.join(logger.log_dir, "metrics.csv")
    fs = get_filesystem(metrics)
    rows: list[dict[str, str]] = []
    if trainer.is_global_zero and fs.isfile(metrics):
        with fs.open(metrics, "r", newline="") as file:
            rows = [r for r in csv.DictReader(file) if step is None or int(r["step"]) < step]
    if trainer.is_global_zero and fs.exists(fresh) and fresh != logger.log_dir:
        fs.rmdir(fresh)
    logger._experiment = None
    writer = logger.experiment  # a new writer removes the old file: it gets the kept rows
    if trainer.is_global_zero:
        writer.metrics = rows + writer.metrics
        log.info(
            "%s continues in %s (%d rows kept)", type(logger).__name__, logger.log_dir, len(rows)
        )
