"""SIGKILL a real saving subprocess at random points; the directory must stay consistent.

A handful of kills (the 200+ kill run is ``benchmarks/crash_soak.py``). After every kill: every
sentinel has its data and verifies, the newest checkpoint loads bit-exactly, and the next save
cleans the temporaries. See ``tests/scripts/crash_saver.py`` for the saver and the checks.
"""

from __future__ import annotations

import random
from pathlib import Path

import crash_saver  # tests/scripts, on the path through conftest

# Filesystem operations in the saver's first two saves (a fresh save makes ~25-30, a re-save
# ~33): kill points are drawn from this range so they cover staging, swap, sentinel and GC.
_OPS_RANGE = (1, 70)


def test_killed_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20260301)
    results = [crash_saver.run_kill(tmp_path, rng) for _ in range(3)]
    assert results[-1]["latest"] >= 0
    crash_saver.finish_and_check(tmp_path)


def test_killed_at_random_filesystem_operations(tmp_path: Path) -> None:
    rng = random.Random(7)
    # Start from a few committed checkpoints so the first kills hit re-saves and GC too.
    crash_saver.finish_and_check(tmp_path, saves=5)
    for _ in range(4):
        crash_saver.run_kill(tmp_path, rng, kill_at=rng.randint(*_OPS_RANGE))
    crash_saver.finish_and_check(tmp_path)
