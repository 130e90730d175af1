"""benchmarks/overlap.py: the added loop time per save (synthetic steps with a known answer),
issue 37's targets read off a result, and one real run per variant of a tiny model, so
``make bench``'s section cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_BENCHMARKS))  # overlap.py imports its sibling methods.py
_SPEC = importlib.util.spec_from_file_location("bench_overlap", _BENCHMARKS / "overlap.py")
assert _SPEC is not None and _SPEC.loader is not None
overlap = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_overlap"] = overlap  # dataclasses look their module up while defining classes
_SPEC.loader.exec_module(overlap)

pytestmark = pytest.mark.timeout(300)


def test_added_time_spans_the_save_until_durable_and_a_tail():
    steps = [0.01] * 60 + [0.03, 0.02, 0.012] + [0.01] * 60
    # durable in the saving step: that step and TAIL (2) more
    assert overlap.added_per_save(steps, [61], [61]) == [pytest.approx(0.032)]
    # durable two steps later: the window grows, the steady steps after add nothing
    assert overlap.added_per_save(steps, [61], [63]) == [pytest.approx(0.032)]
    # a window that ends before the slow steps does not see them
    assert overlap.added_per_save(steps, [1], [1]) == [pytest.approx(0.0)]


def _result(
    rows, durable=1.1, raw=1.0, targets=("added", "blocked", "durable", "below DCP async_save")
):
    size = overlap.Size(8, 8, 1, 4, targets=targets)
    return overlap.SizeResult("s", size, 1, 0.1, 0.1, rows, durable, raw)


def test_targets_are_ratios_to_one_copy_raw_direct_and_the_peers():
    rows = {
        overlap.OVERLAPPED: (0.01, 0.04, 0.0),  # blocked 0.1x one copy, added 0.4x
        "DCP async_save": (0.0, 0.08, 0.0),
        "ModelCheckpoint": (0.0, 0.02, 0.0),
    }
    found = {
        what.split(": ", 1)[1]: (measured, limit)
        for what, measured, limit in _result(rows).targets()
    }
    assert found[f"added loop time per save / one copy ({overlap.OVERLAPPED})"] == (
        pytest.approx(0.4),
        overlap.ADDED_VS_COPY,
    )
    assert found[f"blocked time per save / one copy ({overlap.OVERLAPPED})"] == (
        pytest.approx(0.1),
        overlap.BLOCKED_VS_COPY,
    )
    assert found[f"save to durable / raw O_DIRECT write ({overlap.OVERLAPPED})"] == (
        pytest.approx(1.1),
        overlap.DURABLE_VS_DIRECT,
    )
    dcp = found[f"added loop time per save / DCP async_save's ({overlap.OVERLAPPED})"]
    assert dcp == (pytest.approx(0.5), 1.0)
    # a run without the peers (--variants) has no peer target rather than a wrong one
    alone = _result({overlap.OVERLAPPED: (0.01, 0.04, 0.0)}, targets=("below DCP async_save",))
    assert alone.targets() == []


def test_every_variant_saves_and_reports_a_row(tmp_path):
    size = overlap.Size(8, 8, 1, 4, every=5, saves=1)
    result = overlap.measure_size(tmp_path, "tiny", size)
    assert list(result.rows) == list(overlap.VARIANTS)  # "none": the noise floor's row
    for name, (blocked, added, overhead) in result.rows.items():
        assert added == added and overhead == overhead  # measured, not NaN
        assert (blocked > 0) == (name != "none")
    assert result.nbytes == 3 * 4 * (8 * 8 + 8 * 10)
    assert result.durable > 0 and result.raw_direct > 0
    page = overlap.OverlapResult([result], "0").markdown()
    assert any(line.startswith(f"| {overlap.OVERLAPPED} |") for line in page)
    assert any(line.startswith(f"| {overlap.FLOOR} |") for line in page)
