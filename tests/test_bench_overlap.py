"""benchmarks/overlap.py: the added loop time per save (synthetic steps with a known answer)
and one real run per variant of a tiny model, so ``make bench``'s section cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("bench_overlap", _BENCHMARKS / "overlap.py")
assert _SPEC is not None and _SPEC.loader is not None
overlap = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_overlap"] = overlap  # dataclasses look their module up while defining classes
_SPEC.loader.exec_module(overlap)

pytestmark = pytest.mark.timeout(300)


def test_added_time_is_the_saving_window_beyond_the_median_step():
    steps = [0.01] * 60 + [0.03, 0.02, 0.012] + [0.01] * 60
    added = overlap.added_per_save(steps, [61])
    assert added == [pytest.approx(0.032)]
    assert overlap.added_per_save(steps, [1]) == [pytest.approx(0.0)]


def test_every_variant_saves_every_50_steps_and_reports_a_row(tmp_path):
    result = overlap.measure_size(tmp_path, "tiny", (8, 8, 1, 4), saves=1)
    assert list(result.rows) == [v for v in overlap.VARIANTS if v != "none"]
    for blocked, added, overhead in result.rows.values():
        assert blocked > 0 and added == added and overhead == overhead  # measured, not NaN
    assert result.nbytes == 3 * 4 * (8 * 8 + 8 * 10)
    page = overlap.OverlapResult([result], 1, "0").markdown()
    assert any(line.startswith("| async overlapped + process |") for line in page)
