"""The best-k retention rule (lightning_bpk.checkpointer._best) beside Dopamine's, over a local
directory and an object store: what is kept, the metric recorded in each manifest, NaN, a
missing metric and ties as ModelCheckpoint has them, and retention after a resume (a new
Checkpointer over the same directory) exact from the manifests; ``lightning-bpk ls`` shows it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_bpk import cli
from lightning_bpk.checkpointer import Checkpointer, list_checkpoints
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.checkpointer.manifest import FileEntry, Manifest, Metric, encode, parse

NAN, INF = float("nan"), float("inf")


def _complete(base: str | Path) -> list[int]:
    return sorted(e.number for e in list_checkpoints(base) if e.complete)


def _save_all(checkpointer: Checkpointer, values: list[float | None], start: int = 0) -> None:
    for n, value in enumerate(values, start):
        checkpointer.save_checkpoint(n, {"n": n}, retention=checkpointer.retention.scored(value))


def _model_checkpoint_choice(values: list[float | None], k: int, mode: str) -> set[int]:
    """ModelCheckpoint's top-k bookkeeping, step by step (lightning 2.6's
    ``check_monitor_top_k`` and ``_update_best_and_save``): None is skipped, NaN becomes the
    worst value, a new one enters while fewer than k are kept or when strictly better than the
    k-th (the first of the worst, in insertion order), which it replaces."""
    kept: dict[int, float] = {}
    worst = math.inf if mode == "min" else -math.inf
    better = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    pick = max if mode == "min" else min
    for n, value in enumerate(values):
        if value is None:
            continue
        value = worst if math.isnan(value) else value
        if len(kept) < k:
            kept[n] = value
            continue
        kth = pick(kept, key=kept.__getitem__)
        if better(value, kept[kth]):
            del kept[kth]
            kept[n] = value
    return set(kept)


@pytest.mark.parametrize(
    ("values", "k", "mode"),
    [
        ([0.5, 0.3, 0.9, 0.2, NAN, 0.4, 0.3, 0.8], 2, "min"),
        ([0.5, 0.3, 0.9, 0.2, NAN, 0.4, 0.3, 0.8], 3, "max"),
        ([NAN, 0.1, None, INF, -INF, 2.0, None, 1.0], 3, "min"),
        ([NAN, NAN, 1.0, None, 0.5, 0.7, 0.2], 2, "max"),
        ([3.0, 1.0, 2.0, 0.5, 4.0, 0.25, 0.75], 1, "min"),
    ],
)
def test_the_k_best_are_model_checkpoints_and_dopamines_set_stays(
    tmp_path: Path, values: list[float | None], k: int, mode: str
) -> None:
    checkpointer = Checkpointer(tmp_path, checkpoint_duration=2, best=BestK("score", mode, k))
    _save_all(checkpointer, values)
    n = len(values) - 1
    assert _complete(tmp_path) == sorted(_model_checkpoint_choice(values, k, mode) | {n - 1, n})


def test_a_resume_continues_the_ranking_from_the_manifests(tmp_path: Path) -> None:
    values = [0.5, 0.3, 0.9, 0.2, 0.6, 0.4, 0.1, 0.8]
    rule = BestK("score", "min", 2)
    _save_all(Checkpointer(tmp_path, checkpoint_duration=1, best=rule), values[:4])
    assert _complete(tmp_path) == [1, 3]
    _save_all(Checkpointer(tmp_path, checkpoint_duration=1, best=rule), values[4:], start=4)
    assert _complete(tmp_path) == [3, 6, 7]


def test_a_checkpoint_of_another_metric_or_none_is_never_among_the_best(tmp_path: Path) -> None:
    _save_all(Checkpointer(tmp_path, checkpoint_duration=4, best=BestK("loss")), [0.1, 0.2])
    Checkpointer(tmp_path, checkpoint_duration=4).save_checkpoint(2, {"n": 2})
    checkpointer = Checkpointer(tmp_path, checkpoint_duration=1, best=BestK("acc", "max", 1))
    _save_all(checkpointer, [0.7, 0.9], start=3)
    assert _complete(tmp_path) == [4]  # acc 0.9 is the best and the last


def test_on_an_object_store_too() -> None:
    base = "memory://best-k/run"
    checkpointer = Checkpointer(base, checkpoint_duration=1, best=BestK("score", "max", 2))
    _save_all(checkpointer, [0.1, 0.9, 0.2, 0.8, 0.3])
    assert _complete(base) == [1, 3, 4]
    again = Checkpointer(base, checkpoint_duration=1, best=BestK("score", "max", 2))
    _save_all(again, [0.95], start=5)
    assert _complete(base) == [1, 5]


def test_keep_all_keep_none(tmp_path: Path) -> None:
    every = Checkpointer(tmp_path / "all", checkpoint_duration=1, best=BestK("s", "min", -1))
    _save_all(every, [3, 2, None, 1])
    assert _complete(tmp_path / "all") == [0, 1, 3]
    none = Checkpointer(tmp_path / "none", checkpoint_duration=1, best=BestK("s", "min", 0))
    _save_all(none, [3, 2, 1, 4])
    assert _complete(tmp_path / "none") == [3]


def test_the_manifest_records_the_metric_nan_and_infinities_as_json_strings() -> None:
    files = {"model": FileEntry("module", 300, 256, "0" * 16)}
    for value in (0.25, NAN, INF, -INF, None):
        raw = encode(3, Manifest("ckpt.3", files, 2, Metric("val_loss", value, "min")))
        json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
        metric = parse(raw, 3).metric
        assert metric is not None and metric.name == "val_loss" and metric.mode == "min"
        assert metric.value == value or (math.isnan(metric.value) and math.isnan(value))
    assert parse(encode(3, Manifest("ckpt.3", files)), 3).metric is None
    doc = json.loads(encode(3, Manifest("ckpt.3", files, None, Metric("m", 1.0, "max"))))
    bads = ({"name": "m", "value": "x", "mode": "max"}, {"name": "m", "value": 1, "mode": "up"})
    for bad in bads:
        doc["metric"] = bad
        with pytest.raises(ValueError, match="manifest metric"):
            parse(json.dumps(doc).encode(), 3)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        BestK("loss", "lowest")
    with pytest.raises(ValueError, match="save_top_k"):
        BestK("loss", "min", -2)
    with pytest.raises(ValueError, match="monitor"):
        BestK("")


def test_ls_shows_the_recorded_metric(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _save_all(Checkpointer(tmp_path, checkpoint_duration=1, best=BestK("score")), [0.5, NAN])
    assert cli.main(["ls", str(tmp_path), "--require="]) == 0
    text = capsys.readouterr().out
    assert "metric" in text and "score=0.5 (min)" in text and "score=nan (min)" in text
    assert cli.main(["ls", str(tmp_path), "--require=", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["metric"]["value"] for r in rows] == ["nan", 0.5]
