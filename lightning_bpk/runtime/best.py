"""The standing of one run's checkpoints: the k best by a metric, and the last, for both
integrations (the Lightning callback's ``best_model_path``, ``best_k_models``...; the Fabric
manager's ``best_step``...).

What is kept is decided by the retention rule of the core
(:class:`~lightning_bpk.checkpointer._best.BestK`, beside Dopamine's rule, applied by every
save's garbage collection) from the metric each manifest records; this is the same rule applied
to the same values, so the standing names exactly the checkpoints the directory keeps as the best.
:meth:`Standing.attach` points it at a directory, read at the first question or save (so a
resume costs no extra listing; exact whatever run saved them), and :meth:`Standing.saved`
follows each save.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.checkpointer._commit import recorded_metrics
from lightning_bpk.checkpointer._view import complete_numbers

__all__ = ["Standing", "metric_value"]


def metric_value(value: Any) -> float | None:
    """A logged metric as the float a manifest records: a number or a one-element tensor
    (NaN and infinities kept; ranked as :mod:`lightning_bpk.checkpointer._best` says); None
    stays None (not logged). Anything else is a ``TypeError`` naming its type."""
    if value is None:
        return None
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a monitored metric must be a number, got {type(value).__name__}")
    return float(value)


class Standing:
    """The checkpoints of one run by their recorded metric (``rule``: None when nothing is
    monitored: only :attr:`last` is known) and where each lies."""

    def __init__(self, rule: BestK | None) -> None:
        self.rule = rule
        self._values: dict[int, float | None] = {}  # candidates kept in the directory
        self._last: int | None = None  # the newest checkpoint saved (or found at a resume)
        self._paths: dict[int, Path | str] = {}
        self._checkpointer: Checkpointer | None = None
        self._unread = False  # attached, not read yet

    def attach(self, checkpointer: Checkpointer) -> None:
        """From now on, the standing of ``checkpointer``'s directory: read at the first
        question or save (:meth:`_read`), not now."""
        self._checkpointer = checkpointer
        self._paths = {}
        self._unread = True

    def _read(self) -> None:
        """Read the standing from the directory, once after :meth:`attach`: every complete
        checkpoint's recorded metric (one listing, one read of each sentinel; read-only)."""
        checkpointer = self._checkpointer
        if not self._unread or checkpointer is None:
            return
        self._unread = False
        store = checkpointer.store
        listing = store.list("")
        identifier = checkpointer.sentinel_file_identifier
        complete = complete_numbers(listing, identifier, checkpointer.checkpoint_file_prefix)
        self._last = complete[-1] if complete else None
        self._values = {}
        if self.rule is not None:
            metrics = recorded_metrics(store, identifier, listing, complete)
            self._values = {m: self.rule.value_of(metric) for m, metric in metrics.items()}
            self._prune()

    def saved(self, number: int, value: float | None) -> None:
        """Checkpoint ``number`` was saved with the monitored ``value`` (None: not logged)."""
        self._read()
        self._last = number
        self._paths.pop(number, None)  # a re-save lies elsewhere
        if self.rule is not None:
            self._values[number] = value
            self._prune()

    def _prune(self) -> None:
        """Forget the checkpoints no longer among the k best (the retention removes them)."""
        assert self.rule is not None
        kept = self.rule.kept(self._values)
        self._values = {m: v for m, v in self._values.items() if m in kept}

    def best_k(self) -> list[int]:
        """The k best checkpoints, best first."""
        self._read()
        return [] if self.rule is None else self.rule.ranked(self._values)

    @property
    def best(self) -> int | None:
        """The best checkpoint (None: none with the metric yet)."""
        ranked = self.best_k()
        return ranked[0] if ranked else None

    @property
    def kth(self) -> int | None:
        """The worst of the k best (the one the next better checkpoint displaces)."""
        ranked = self.best_k()
        return ranked[-1] if ranked else None

    @property
    def last(self) -> int | None:
        """The newest checkpoint saved (or found in the directory)."""
        self._read()
        return self._last

    def value(self, number: int | None) -> float | None:
        """The recorded value of checkpoint ``number`` (None: unknown)."""
        self._read()
        return None if number is None else self._values.get(number)

    def path(self, number: int | None) -> Path | str | None:
        """Where checkpoint ``number``'s data lies (a ``ckpt.N`` directory, or its URL)."""
        if number is None or self._checkpointer is None:
            return None
        if number not in self._paths:
            self._paths[number] = self._checkpointer.checkpoint_path(number)
        return self._paths[number]

    def paths(self) -> Mapping[Path | str, float]:
        """The k best checkpoints' data, best first, with their values."""
        result: dict[Path | str, float] = {}
        for m in self.best_k():
            path, value = self.path(m), self._values[m]
            if path is not None and value is not None:  # ranked: it has a value
                result[path] = value
        return result
