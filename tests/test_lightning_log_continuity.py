"""A resumed run logs on in the same logger version, each step once (a real CSVLogger)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_bpk.lightning.callback import BurnpackCheckpoint

from lightning_tiny import CrashAt, Crashed, TinyModel, make_trainer

pytestmark = pytest.mark.timeout(300)


class LoggingModel(TinyModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def _fit(root: Path, *callbacks: L.Callback) -> BurnpackCheckpoint:
    L.seed_everything(0)
    checkpoint = BurnpackCheckpoint(every_n_train_steps=4)
    logger = CSVLogger(str(root / "logs"))
    trainer = make_trainer(
        str(root), 3, [checkpoint, *callbacks], logger=logger, log_every_n_steps=1
    )
    trainer.fit(LoggingModel())
    return checkpoint


@pytest.mark.parametrize(
    ("kill", "saved"),
    [(10, 8), (14, 12)],
    ids=["after-a-mid-epoch-save", "after-an-epoch-end-save"],
)
def test_a_resumed_run_logs_on_in_its_version_without_a_step_twice(tmp_path, kill, saved):
    _fit(tmp_path / "ref")
    with pytest.raises(Crashed):
        _fit(tmp_path / "run", CrashAt(kill))
    assert (tmp_path / "run" / "logs" / "lightning_logs" / "version_0" / "metrics.csv").exists()
    checkpoint = _fit(tmp_path / "run")
    assert checkpoint.restored_number == saved
    versions = sorted(p.name for p in (tmp_path / "run" / "logs" / "lightning_logs").iterdir())
    assert versions == ["version_0"]  # no version_1
    got = tmp_path / "run" / "logs" / "lightning_logs" / "version_0" / "metrics.csv"
    expected = tmp_path / "ref" / "logs" / "lightning_logs" / "version_0" / "metrics.csv"
    assert got.read_text().splitlines() == expected.read_text().splitlines()
