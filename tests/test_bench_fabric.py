"""benchmarks/fabric.py's per-step overhead, the measure ``make bench``'s end-to-end targets are
judged by: a cost that recurs at the same place in every checkpoint period counts in full, a
run slowed down as a whole or a stall at a random step does not, and an epoch's end that every
variant pays cancels out. Synthetic step laps, so each case has a known answer."""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("bench_fabric", _BENCHMARKS / "fabric.py")
assert _SPEC is not None and _SPEC.loader is not None
fabric = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_fabric"] = fabric  # dataclasses look their module up while defining classes
_SPEC.loader.exec_module(fabric)

PERIOD, STEP = 50, 0.002


def _laps(durations: list[float]) -> list[float]:
    """The ``perf_counter`` at the end of each step, from the steps' durations."""
    return list(itertools.accumulate(durations, initial=100.0))


def _run(
    steps: int = 1000,
    step: float = STEP,
    added: dict[int, float] | None = None,
    seed: int = 0,
    stalls: int = 0,
) -> list[float]:
    """Steps of ``step`` seconds with 2 % jitter; ``added[p]`` more at position ``p`` of every
    period; ``stalls`` steps at random places 20x longer."""
    rng = random.Random(seed)
    durations = [step * rng.uniform(0.99, 1.01) for _ in range(steps)]
    for i in range(len(durations)):
        durations[i] += (added or {}).get((i + 1) % PERIOD, 0.0)
    for i in rng.sample(range(steps), stalls):
        durations[i] *= 20
    return _laps(durations)


def test_a_cost_recurring_every_period_counts_in_full() -> None:
    save = {0: 0.006, 1: 0.002, 2: 0.001}  # a save's step and the two after it: 9 ms a period
    laps = {
        "none": [_run(seed=s) for s in range(5)],
        "async": [_run(added=save, seed=10 + s) for s in range(5)],
    }
    cost = fabric.period_cost(laps["async"], PERIOD)
    assert cost.added == pytest.approx(0.009, abs=0.0003)
    assert cost.step == pytest.approx(STEP, rel=0.01)
    assert fabric.step_overhead(laps, "async", PERIOD) == pytest.approx(0.009 / 0.1, rel=0.05)


def test_a_run_slowed_down_as_a_whole_and_random_stalls_do_not_count() -> None:
    laps = {
        "none": [_run(seed=s) for s in range(5)],
        # other tenants: every step of these runs 30 % slower, and a few long stalls
        "busy": [_run(step=STEP * 1.3, seed=20 + s, stalls=5) for s in range(5)],
    }
    assert abs(fabric.step_overhead(laps, "busy", PERIOD)) < 0.005
    assert fabric.period_cost(laps["busy"], PERIOD).step == pytest.approx(STEP * 1.3, rel=0.01)


def test_an_epoch_end_every_variant_pays_cancels_out() -> None:
    validation = {0: 0.020}
    laps = {
        "none": [_run(added=validation, seed=s) for s in range(3)],
        "lightning": [_run(added={0: 0.023}, seed=30 + s) for s in range(3)],
    }
    assert fabric.period_cost(laps["none"], PERIOD).added == pytest.approx(0.020, abs=0.0003)
    expected = 0.003 / (PERIOD * STEP + 0.020)
    assert fabric.step_overhead(laps, "lightning", PERIOD) == pytest.approx(expected, rel=0.1)


def test_a_run_too_short_to_hold_a_period_is_refused() -> None:
    with pytest.raises(ValueError, match="no full period of 50"):
        fabric.period_cost([_run(steps=60)], PERIOD)
