"""lightning_bpk.lightning.triggers without a Trainer: the "finished" decisions on a stand-in
with a trainer's limits."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_bpk.lightning.triggers import describe, finished, still_finished


def _stand_in(**limits) -> SimpleNamespace:
    """The trainer attributes ``finished`` reads, with no limits and no Timer."""
    values = dict(
        max_steps=-1,
        max_epochs=None,
        min_epochs=None,
        min_steps=None,
        global_step=0,
        current_epoch=0,
        should_stop=False,
        callbacks=[],
    )
    values.update(limits)
    return SimpleNamespace(**values)


def test_finished_says_which_limit_ended_the_run():
    assert finished(_stand_in(max_steps=8, global_step=8), epoch_end=False) == {
        "by": "max_steps",
        "limit": 8,
    }
    assert finished(_stand_in(max_epochs=3, current_epoch=2), epoch_end=True) == {
        "by": "max_epochs",
        "limit": 3,
    }
    assert finished(_stand_in(max_epochs=3, current_epoch=2), epoch_end=False) is None
    stopped = finished(_stand_in(should_stop=True, current_epoch=1), epoch_end=True)
    assert stopped == {"by": "should_stop", "limit": -1}
    # an early stop before min_epochs is not an end: Lightning trains on
    assert finished(_stand_in(should_stop=True, min_epochs=5), epoch_end=True) is None


def test_a_finished_run_stays_finished_until_its_limit_is_raised():
    by_epochs = {"by": "max_epochs", "limit": 3}
    assert still_finished(_stand_in(max_epochs=3), by_epochs, {})
    assert not still_finished(_stand_in(max_epochs=4), by_epochs, {})
    assert not still_finished(_stand_in(max_epochs=-1), by_epochs, {})
    early = {"by": "should_stop", "limit": -1}
    assert still_finished(_stand_in(max_epochs=100), early, {})  # a decision, not a limit
    assert describe(by_epochs) == "max_epochs=3 was reached"
    assert "stopped early" in describe(early)
    assert describe({"by": "max_time", "limit": 90.0, "elapsed": 91.5}) == (
        "max_time=0:01:30 was reached after 91.5 s"
    )
