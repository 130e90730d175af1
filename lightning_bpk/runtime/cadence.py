"""Cadence: when a step, time or ``"auto"`` save falls due, framework-free.

:class:`SaveTriggers` holds the step and time triggers of a run and what they measure:
``every_n_train_steps`` (a number, or ``"auto"``: an optimizer step's time and a save's cost are
measured, and the interval keeps the saves under ``max_overhead`` of training time) and
``train_time_interval``. Each integration feeds it its counters (the Lightning callback its
trainer's ``global_step`` at each batch, the Fabric manager the step its loop passes to
``save_if_due``); rank 0's clock decides the time and ``"auto"`` triggers, and the integration
makes every rank follow (:class:`~lightning_bpk.runtime.ranks.Ranks`). The clocks are callables
given to it (``time.monotonic`` and ``time.perf_counter`` by default), so a test drives them
without a framework and without sleeping.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta

__all__ = ["AUTO_FIRST_SAVE", "SaveTriggers"]

log = logging.getLogger("lightning_bpk")

AUTO_FIRST_SAVE = 10
"""With ``every_n_train_steps="auto"``, the step of the first save, which measures what a save
costs (the interval is then chosen from it)."""
Clock = Callable[[], float]


def _check(
    every_n_train_steps: int | str | None,
    train_time_interval: timedelta | None,
    max_overhead: float,
) -> None:
    """Refuse settings that cannot trigger anything, naming the setting."""
    if not isinstance(max_overhead, (int, float)) or not 0 < max_overhead <= 1:
        raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead!r}")
    if (
        every_n_train_steps is not None
        and every_n_train_steps != "auto"
        and (
            isinstance(every_n_train_steps, bool)
            or not isinstance(every_n_train_steps, int)
            or every_n_train_steps < 1
        )
    ):
        raise ValueError(
            "every_n_train_steps must be a positive int, 'auto' or None, "
            f"got {every_n_train_steps!r}"
        )
    if train_time_interval is not None and (
        not isinstance(train_time_interval, timedelta) or train_time_interval.total_seconds() <= 0
    ):
        raise ValueError(
            f"train_time_interval must be a positive timedelta or None, got {train_time_interval!r}"
        )


class SaveTriggers:
    """The step and time triggers of one run, and the times they are decided on.

    The integration calls :meth:`fit_started`, then per batch :meth:`batch_started` and (at the
    batch end) :meth:`rank0_due` on rank 0, :meth:`stepped` and :meth:`step_due`; around each
    save :meth:`save_started` and :meth:`saved`. ``due`` holds the batches consumed when a
    save fell due that waits for the validation after them.
    """

    def __init__(
        self,
        every_n_train_steps: int | str | None = None,
        train_time_interval: timedelta | None = None,
        max_overhead: float = 0.02,
        monotonic: Clock = time.monotonic,
        perf_counter: Clock = time.perf_counter,
    ) -> None:
        _check(every_n_train_steps, train_time_interval, max_overhead)
        self.every_n_train_steps = every_n_train_steps
        self.train_time_interval = train_time_interval
        self.max_overhead = float(max_overhead)
        self._monotonic, self._perf_counter = monotonic, perf_counter
        self.auto_interval: int | None = None  # what "auto" chose last (rank 0)
        self._step_time: float | None = None  # moving average of an optimizer step (seconds)
        self._save_cost: float | None = None  # the training thread's time in the last save
        self._last_step_end: float | None = None
        self._last_save_time = monotonic()
        self.saved_step = -1  # global step of the last save
        self._step_before = 0  # global step when the current batch started
        self.due: int | None = None  # batches consumed when a save fell due after validation

    @property
    def step_numbered(self) -> bool:
        """Checkpoints are numbered by global step (a step or time trigger is set), not epoch."""
        return self.every_n_train_steps is not None or self.train_time_interval is not None

    def fit_started(self, global_step: int) -> None:
        """Training starts at ``global_step``: intervals count from here, and "auto" times this
        fit's steps, not the gap before it."""
        self._last_save_time = self._monotonic()
        self.saved_step = global_step
        self._last_step_end = None

    def batch_started(self, global_step: int) -> None:
        self._step_before = global_step

    def stepped(self, global_step: int) -> bool:
        """The batch that just ended took an optimizer step (not inside gradient accumulation):
        only there may a save happen."""
        return global_step != self._step_before

    def step_due(self, global_step: int) -> bool:
        """``every_n_train_steps=k`` (a number) and ``global_step`` is a multiple of k."""
        n = self.every_n_train_steps
        return isinstance(n, int) and global_step % n == 0

    def rank0_due(self, global_step: int) -> bool:
        """Rank 0's decisions: the time interval passed, or "auto" wants a save now."""
        if self.every_n_train_steps == "auto":
            now = self._perf_counter()
            if self._last_step_end is not None and global_step != self._step_before:
                step = now - self._last_step_end
                average = self._step_time
                self._step_time = step if average is None else 0.9 * average + 0.1 * step
            self._last_step_end = now
            if self._auto_due(global_step):
                return True
        return self._time_due()

    def _auto_due(self, global_step: int) -> bool:
        if self._step_time is None:
            return False  # no step measured yet (each save's step is not timed)
        since = global_step - max(self.saved_step, 0)  # this fit's start, or last save
        if self._save_cost is None:
            return since >= AUTO_FIRST_SAVE  # measure a save early, in this fit (also resumed)
        interval = max(1, math.ceil(self._save_cost / (self.max_overhead * self._step_time)))
        if self.auto_interval is None or not 0.5 <= interval / self.auto_interval <= 2:
            log.info(
                "every_n_train_steps='auto': a save costs the training thread %.1f ms, an "
                "optimizer step %.1f ms; saving every %d steps keeps it under %g%%",
                self._save_cost * 1000,
                self._step_time * 1000,
                interval,
                self.max_overhead * 100,
            )
            self.auto_interval = interval
        return since >= self.auto_interval

    def _time_due(self) -> bool:
        interval = self.train_time_interval
        return interval is not None and self._monotonic() - self._last_save_time >= (
            interval.total_seconds()
        )

    def save_started(self) -> float:
        """A save begins (the time interval counts from here); its start, for :meth:`saved`."""
        self._last_save_time = self._monotonic()
        return self._perf_counter()

    def saved(self, global_step: int, started: float) -> None:
        """The save begun at ``started`` completed at ``global_step``: its cost is measured, and
        the next step's time does not include it."""
        self.saved_step = global_step
        self._save_cost = self._perf_counter() - started
        self._last_step_end = None
