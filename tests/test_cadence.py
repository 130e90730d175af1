"""lightning_bpk.runtime.cadence without a framework: the step, time and "auto" triggers driven
by clocks the test holds."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from lightning_bpk.runtime.cadence import AUTO_FIRST_SAVE, SaveTriggers


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(max_overhead=0), "max_overhead must be in"),
        (dict(max_overhead=1.5), "max_overhead must be in"),
        (dict(every_n_train_steps=0), "every_n_train_steps must be"),
        (dict(every_n_train_steps=True), "every_n_train_steps must be"),
        (dict(every_n_train_steps="often"), "every_n_train_steps must be"),
        (dict(train_time_interval=timedelta(0)), "train_time_interval must be"),
        (dict(train_time_interval=30), "train_time_interval must be"),
    ],
)
def test_settings_that_cannot_trigger_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        SaveTriggers(**settings)


def test_numbering_follows_the_triggers():
    assert not SaveTriggers().step_numbered
    assert SaveTriggers(every_n_train_steps=3).step_numbered
    assert SaveTriggers(every_n_train_steps="auto").step_numbered
    assert SaveTriggers(train_time_interval=timedelta(minutes=5)).step_numbered


def test_every_n_steps_falls_due_at_multiples_and_only_at_optimizer_steps():
    triggers = SaveTriggers(every_n_train_steps=3)
    assert [s for s in range(1, 10) if triggers.step_due(s)] == [3, 6, 9]
    triggers.batch_started(4)
    assert not triggers.stepped(4)  # inside gradient accumulation
    assert triggers.stepped(5)
    assert not SaveTriggers(every_n_train_steps="auto").step_due(10)
    assert not SaveTriggers().step_due(10)


def test_the_time_trigger_counts_from_the_fit_start_and_from_each_save():
    clock = Clock(0.0)
    triggers = SaveTriggers(train_time_interval=timedelta(seconds=30), monotonic=clock)
    clock.now = 100.0  # the time before the fit (setup, a resume) does not count
    triggers.fit_started(global_step=0)
    clock.now = 129.9
    assert not triggers.rank0_due(1)
    clock.now = 130.0
    assert triggers.rank0_due(2)
    triggers.saved(2, triggers.save_started())
    clock.now = 159.0
    assert not triggers.rank0_due(3)
    clock.now = 160.0
    assert triggers.rank0_due(4)


def _run_auto(triggers: SaveTriggers, perf: Clock, steps: int, step_s: float, save_s: float):
    """Drive ``triggers`` through ``steps`` optimizer steps of ``step_s`` seconds each, saving
    (for ``save_s`` seconds) whenever it says so; the steps saved after."""
    saved = []
    triggers.fit_started(global_step=0)
    for step in range(1, steps + 1):
        triggers.batch_started(step - 1)
        perf.now += step_s
        if triggers.rank0_due(step):
            started = triggers.save_started()
            perf.now += save_s
            triggers.saved(step, started)
            saved.append(step)
    return saved


def test_auto_measures_a_save_early_then_keeps_saves_under_the_overhead(caplog):
    perf = Clock(0.0)
    triggers = SaveTriggers(every_n_train_steps="auto", max_overhead=0.5, perf_counter=perf)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        saved = _run_auto(triggers, perf, steps=40, step_s=0.0625, save_s=0.3)
    # 0.3 s per save / (50 % of 0.0625 s per step) = 9.6: a save every 10 steps
    assert saved == [AUTO_FIRST_SAVE, 20, 30, 40]
    assert triggers.auto_interval == 10
    lines = [r.getMessage() for r in caplog.records if "every_n_train_steps='auto'" in r.message]
    assert len(lines) == 1 and "saving every 10 steps" in lines[0]  # logged when it changes


def test_auto_does_not_time_the_step_that_held_a_save():
    """The step after a save starts its clock anew: a slow save never looks like a slow step."""
    perf = Clock(0.0)
    triggers = SaveTriggers(every_n_train_steps="auto", max_overhead=0.5, perf_counter=perf)
    _run_auto(triggers, perf, steps=AUTO_FIRST_SAVE, step_s=0.0625, save_s=100.0)
    triggers.batch_started(AUTO_FIRST_SAVE)
    perf.now += 0.0625
    triggers.rank0_due(AUTO_FIRST_SAVE + 1)  # first step after the save: not measured
    triggers.batch_started(AUTO_FIRST_SAVE + 1)
    perf.now += 0.0625
    triggers.rank0_due(AUTO_FIRST_SAVE + 2)
    # 100 s per save / (50 % of 0.0625 s per step): 3200; had the save counted as a step
    # (100.06 s), the average step would be ~10 s and the interval 20
    assert triggers.auto_interval is not None and triggers.auto_interval >= 3000
