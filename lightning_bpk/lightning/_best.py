"""The callback as Lightning's ``Checkpoint`` citizen: ``ModelCheckpoint``'s attributes, the
``ckpt_path`` names ``"best"`` and ``"last"``, and the loggers.

:class:`BestModels` gives :class:`~lightning_bpk.lightning.BurnpackCheckpoint` the attributes
Lightning and the loggers read from a checkpoint callback (``best_model_path``,
``best_model_score``, ``best_k_models``, ``kth_best_model_path``, ``kth_value``,
``last_model_path``, ``current_score``), each path a ``ckpt.N`` directory (or its URL), from the
run layer's :class:`~lightning_bpk.runtime.best.Standing`: read from the manifests when first
asked after ``setup`` (so correct after a resume), then followed save by save. Without
``monitor`` the best model is the last, as ``ModelCheckpoint(monitor=None)`` has it.

``ckpt_path="best"`` (also the default of ``validate``/``test``/``predict`` called without a
model after ``fit``) is Lightning's own: it reads ``best_model_path``, read from the directory
first when this process has not fitted. ``ckpt_path="last"`` where no ``ModelCheckpoint`` file
exists is the newest complete checkpoint of the directory (in ``fit``, the callback resumes it
itself: :mod:`lightning_bpk.lightning.callback`). A ``ckpt.N`` directory is loaded without the IO
plugin (:func:`lightning_bpk.lightning._resume.intercept`).

After each checkpoint is committed, every logger's ``after_save_checkpoint(callback)`` runs (with
``async_save``, once the write is durable: at the next save or at the end of ``fit``). Lightning's
MLflow logger logs only files it finds at those paths; for an ``MLFlowLogger`` with
``log_model`` set, each committed local checkpoint directory is logged as the artifacts
``ckpt.N/<key>.bpk`` (``log_model="all"``: every one; ``True``: the best ones, at the end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_bpk.checkpointer import Checkpointer, get_latest_checkpoint_number
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.lightning import _compat, _runs, trainer_state
from lightning_bpk.runtime.best import Standing, metric_value
from lightning_bpk.store import open_store


def _text(path: Path | str | None) -> str:
    return "" if path is None else str(path)


def _tensor(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value)


class BestModels:
    """``ModelCheckpoint``'s attributes and the loggers' calls for one checkpoint callback
    (module docstring), kept by the callback as ``best``; the callback exposes the attributes
    Lightning reads as its own."""

    def __init__(self, monitor: str | None, mode: str, save_top_k: int) -> None:
        if monitor is None and save_top_k != 1:
            raise ValueError(f"save_top_k={save_top_k!r} keeps the best by a metric: set monitor")
        self.monitor = monitor
        self.standing = Standing(None if monitor is None else BestK(monitor, mode, save_top_k))
        self.read = False  # the directory's best and last were read (setup, or "best")
        self._current_score: float | None = None
        self._announce = False  # an asynchronous save the loggers have not heard of yet

    @property
    def best_model_path(self) -> str:
        """The best checkpoint's directory (without ``monitor``: the last); ``""``: none."""
        standing = self.standing
        return _text(standing.path(standing.last if self.monitor is None else standing.best))

    @property
    def best_model_score(self) -> torch.Tensor | None:
        """The best checkpoint's value of ``monitor`` (None: nothing monitored or saved)."""
        return _tensor(self.standing.value(self.standing.best))

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """The k best checkpoints' directories and values, best first."""
        return {str(p): torch.tensor(v) for p, v in self.standing.paths().items()}

    @property
    def kth_best_model_path(self) -> str:
        """The worst of the k best (the next better checkpoint displaces it)."""
        return _text(self.standing.path(self.standing.kth))

    @property
    def kth_value(self) -> torch.Tensor | None:
        """The value of :attr:`kth_best_model_path`."""
        return _tensor(self.standing.value(self.standing.kth))

    @property
    def last_model_path(self) -> str:
        """The newest checkpoint saved (or found at ``setup``)."""
        return _text(self.standing.path(self.standing.last))

    @property
    def current_score(self) -> torch.Tensor | None:
        """The value of ``monitor`` the last save of this fit recorded."""
        return _tensor(self._current_score)

    def follow(self, checkpointer: Checkpointer) -> None:
        """Follow the best and last checkpoints of ``checkpointer``'s directory (read when first
        asked: a resume lists nothing more)."""
        self.standing.attach(checkpointer)
        self.read = True

    def monitored(self, trainer: pl.Trainer) -> float | None:
        """The value of ``monitor`` for the save being made, as ``ModelCheckpoint`` finds it
        (``callback_metrics``, plus ``epoch`` and ``step``). Missing: a
        ``MisconfigurationException`` once validation has run (``ModelCheckpoint``'s error),
        before that a warning, and the checkpoint is not among the best."""
        if self.monitor is None:
            return None
        candidates: dict[str, Any] = dict(trainer.callback_metrics)
        candidates.setdefault("epoch", trainer.current_epoch)
        candidates.setdefault("step", trainer.global_step)
        if self.monitor not in candidates:
            message = (
                f"BurnpackCheckpoint(monitor={self.monitor!r}) could not find the monitored key "
                f"in the logged metrics: {sorted(candidates)}. HINT: did you call "
                f"self.log({self.monitor!r}, value) in the LightningModule?"
            )
            if _compat.validation_has_run(trainer):
                raise MisconfigurationException(message)
            rank_zero_warn(message)
            return None
        return metric_value(candidates[self.monitor])

    def saved(
        self, trainer: pl.Trainer, callback: Any, number: int, value: float | None, later: bool
    ) -> None:
        """``callback`` saved checkpoint ``number`` with ``value``; the loggers hear of it now,
        or (``later``: written in the background) once it is durable (:meth:`announce`)."""
        self.announce(trainer, callback)  # the one before: durable now (this save waited for it)
        self._current_score = value
        self.standing.saved(number, value)
        self._announce = later
        if not later:
            self._tell_loggers(trainer, callback)

    def announce(self, trainer: pl.Trainer, callback: Any, final: bool = False) -> None:
        """Tell the loggers of the asynchronous save that is durable now (if any); ``final``
        (the end of ``fit``, every save durable): MLflow's ``log_model=True`` logs the best."""
        if self._announce:
            self._announce = False
            self._tell_loggers(trainer, callback)
        for logger in trainer.loggers if final else ():
            if _compat.mlflow_log_model(logger) is True:
                _mlflow_log_directories(logger, list(self.best_k_models) or [self.best_model_path])

    def _tell_loggers(self, trainer: pl.Trainer, callback: Any) -> None:
        """Every logger's ``after_save_checkpoint``; MLflow's with ``log_model="all"`` also
        gets the directory."""
        for logger in trainer.loggers:
            logger.after_save_checkpoint(callback)
            if _compat.mlflow_log_model(logger) == "all":
                _mlflow_log_directories(logger, [self.last_model_path])


def _mlflow_log_directories(logger: Any, paths: list[str]) -> None:
    """Log committed local checkpoint directories, which MLflow's own scan skips (it logs
    files), each once, as ``ckpt.N/<key>.bpk``."""
    logged: set[str] = vars(logger).setdefault("_lightning_bpk_logged", set())
    for path in paths:
        if not path or path in logged or not Path(path).is_dir():
            continue  # an object-store URL: MLflow logs local files only
        logger.experiment.log_artifacts(logger.run_id, path, artifact_path=Path(path).name)
        logged.add(path)


def take_last(trainer: pl.Trainer, fitting: bool) -> Any:
    """``ckpt_path="last"`` where Lightning found no file of its own: while fitting, whether a
    callback that resumes takes it as its newest complete checkpoint (it says which, in setup);
    otherwise the newest complete checkpoint of the first callback's directory (None: none)."""
    callbacks = _ours(trainer)
    if fitting:
        takers = [c for c in callbacks if c.resume]
        for callback in takers:
            callback._last_requested = True
        return bool(takers)
    for callback in callbacks:
        directory = _runs.folder(callback, trainer)
        number = get_latest_checkpoint_number(
            directory,
            sentinel_file_identifier=callback.sentinel_file_identifier,
            checkpoint_file_prefix=callback.checkpoint_file_prefix,
            storage_options=callback.storage_options,
            required_keys=trainer_state.REQUIRED_KEYS,
        )
        if number >= 0:
            return str(callback._make_checkpointer(directory).checkpoint_path(number))
    return None


def read_before_best(trainer: pl.Trainer) -> None:
    """Before Lightning resolves ``ckpt_path="best"``: each callback that has not read its
    directory yet (no ``fit`` in this process) reads its best and last checkpoints."""
    for callback in _ours(trainer):
        if not callback.best.read:
            directory = _runs.folder(callback, trainer)
            if open_store(directory, callback.storage_options).list(""):
                callback.best.follow(callback._make_checkpointer(directory))


def _ours(trainer: pl.Trainer) -> list[Any]:
    """The checkpoint callbacks of ``trainer`` that keep a :class:`BestModels`."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    return [c for c in callbacks if isinstance(getattr(c, "best", None), BestModels)]
