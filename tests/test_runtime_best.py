"""The standing of a run's checkpoints (lightning_bpk.runtime.best): read from the manifests
at its first use after ``attach`` (a resume lists nothing more), then followed save by save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.runtime.best import Standing, metric_value


def _checkpointer(base: Path, rule: BestK | None) -> Checkpointer:
    return Checkpointer(base, checkpoint_duration=1, best=rule)


def test_read_at_first_use_then_followed(tmp_path: Path, monkeypatch) -> None:
    rule = BestK("score", "min", 2)
    writer = _checkpointer(tmp_path, rule)
    for n, value in enumerate([0.5, 0.3, 0.9, 0.2, 0.6]):
        writer.save_checkpoint(n, {"n": n}, retention=writer.retention.scored(value))
    reader = _checkpointer(tmp_path, rule)
    listings: list[str] = []
    listed = type(reader.store).list
    monkeypatch.setattr(
        type(reader.store), "list", lambda store, key: listings.append(key) or listed(store, key)
    )
    standing = Standing(rule)
    standing.attach(reader)
    assert listings == []  # nothing read yet
    assert (standing.best_k(), standing.best, standing.kth, standing.last) == ([3, 1], 3, 1, 4)
    assert listings == [""]  # one listing, then from memory
    assert standing.path(3) == tmp_path / "ckpt.3" and standing.value(3) == 0.2
    standing.saved(5, 0.1)
    assert standing.best_k() == [5, 3] and standing.last == 5
    assert list(standing.paths()) == [tmp_path / "ckpt.5", tmp_path / "ckpt.3"]


def test_without_a_rule_only_the_last_is_known(tmp_path: Path) -> None:
    writer = _checkpointer(tmp_path, None)
    writer.save_checkpoint(7, {"n": 7})
    standing = Standing(None)
    standing.attach(writer)
    assert (standing.last, standing.best, standing.best_k(), dict(standing.paths())) == (
        7, None, [], {}
    )  # fmt: skip


def test_metric_values() -> None:
    assert metric_value(None) is None and metric_value(3) == 3.0
    assert metric_value(torch.tensor(0.25)) == 0.25
    with pytest.raises(TypeError, match="str"):
        metric_value("0.5")
