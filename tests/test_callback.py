"""BurnpackCheckpoint with real in-process Trainers: layout, retention, resume choice, failures."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import gin
import lightning as L
import pytest
import torch

from lightning_bpk import _fs, trainer_state
from lightning_bpk.callback import BurnpackCheckpoint, CheckpointSaveError
from lightning_bpk.checkpointer import CheckpointWarning, verify_checkpoint
from lightning_bpk.records import (
    LrSchedulerRecord,
    ModuleRecord,
    OptimizerRecord,
    StateRecord,
    load_record,
)

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)


class _StartEpoch(L.Callback):
    """Remembers the epoch and step training (re)started at."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch, self.step = trainer.current_epoch, trainer.global_step


def _fit(root: Path, epochs: int, ckpt_path: object = None, **options: object):
    L.seed_everything(0)
    callback, start = BurnpackCheckpoint(**options), _StartEpoch()
    model = TinyModel()
    trainer = make_trainer(str(root), epochs, [callback, start])
    trainer.fit(model, ckpt_path=ckpt_path)
    return callback, start, model


def _numbers(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[1]) for p in directory.glob("ckpt.*"))


def test_layout_records_and_retention(tmp_path):
    callback, _, model = _fit(tmp_path, 3, checkpoint_duration=2)
    directory = tmp_path / "checkpoints"
    assert _numbers(directory) == [1, 2]  # checkpoint 0 collected: 2 - 1*2 = 0
    assert sorted(p.name for p in (directory / "ckpt.2").iterdir()) == [
        "model.bpk",
        "optim.bpk",
        "scheduler.bpk",
        "trainer.bpk",
    ]
    assert verify_checkpoint(directory, 2) == []
    assert isinstance(load_record(directory / "ckpt.2" / "model.bpk"), ModuleRecord)
    optim = load_record(directory / "ckpt.2" / "optim.bpk")
    assert isinstance(optim, OptimizerRecord)
    assert any(name.endswith(".momentum.moment_1") for name in optim.to_content()[0])
    scheduler = load_record(directory / "ckpt.2" / "scheduler.bpk")
    assert isinstance(scheduler, LrSchedulerRecord) and scheduler.state["last_epoch"] == 3
    trainer = load_record(directory / "ckpt.2" / "trainer.bpk")
    assert isinstance(trainer, StateRecord)
    value = trainer.value
    assert (value["epoch"], value["global_step"]) == (2, 18)
    assert value["hyper_parameters"] == {"hidden": 16, "lr": 0.05}
    assert value["pytorch-lightning_version"] == L.__version__
    assert value["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    assert set(value[trainer_state.RNG_KEY]) >= {"torch", "numpy", "python"}
    saved = ModuleRecord.load(directory / "ckpt.2" / "model.bpk").tensors
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert callback.last_saved_number == 2 and callback.restored_number is None


def test_frequency_and_keep_every(tmp_path):
    _fit(tmp_path, 6, checkpoint_frequency=2, checkpoint_duration=1, keep_every=2)
    # saved 0, 2, 4; after 4, everything <= 4 - 2*1 goes except multiples of 2*2; the last
    # epoch, 5, is saved whatever the frequency (a finished run is saved, so it stays finished)
    assert _numbers(tmp_path / "checkpoints") == [0, 4, 5]


def test_resume_continues_at_the_next_epoch_and_logs_it(tmp_path, caplog):
    _fit(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        callback, start, _ = _fit(tmp_path, 4)
    assert callback.restored_number == 1
    assert (start.epoch, start.step) == (2, 12)
    assert "continuing training at epoch 2 (global step 12) after checkpoint 1" in caplog.text
    assert "saved at the end of epoch 1" in caplog.text
    assert _numbers(tmp_path / "checkpoints") == [0, 1, 2, 3]


def test_resume_false_and_explicit_ckpt_path_and_gin_override(tmp_path):
    _fit(tmp_path, 3)
    directory = tmp_path / "checkpoints"
    callback, start, _ = _fit(tmp_path, 1, resume=False)
    assert (callback.restored_number, start.epoch) == (None, 0)

    callback, start, _ = _fit(tmp_path, 4, ckpt_path=directory / "ckpt.1")
    assert (callback.restored_number, start.epoch) == (None, 2)  # explicit path wins

    gin.bind_parameter("lightning_bpk.checkpointer.get_latest_checkpoint_number.override_number", 1)
    try:
        callback, start, _ = _fit(tmp_path, 3)
    finally:
        gin.clear_config()
    assert (callback.restored_number, start.epoch) == (1, 2)


def test_resume_skips_a_damaged_checkpoint(tmp_path):
    _fit(tmp_path, 3)
    model_file = tmp_path / "checkpoints" / "ckpt.2" / "model.bpk"
    raw = bytearray(model_file.read_bytes())
    raw[-1] ^= 0xFF  # flip a bit in the last tensor's data: only the checksum notices
    model_file.write_bytes(raw)
    with pytest.warns(CheckpointWarning, match="checkpoint 2 .* skipped"):
        callback, start, _ = _fit(tmp_path, 3)
    assert (callback.restored_number, start.epoch) == (1, 2)


class _ObjectHparams(TinyModel):
    def __init__(self, loss: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_unencodable_hyperparameter_is_named_and_the_rest_is_saved(tmp_path):
    L.seed_everything(0)
    trainer = make_trainer(str(tmp_path), 1, [BurnpackCheckpoint()])
    with pytest.warns(UserWarning, match="hyper-parameter 'loss' is not saved"):
        trainer.fit(_ObjectHparams(loss=torch.nn.MSELoss()))
    value = StateRecord.load(tmp_path / "checkpoints" / "ckpt.0" / "trainer.bpk").value
    assert value[trainer_state.DROPPED_KEY] == ["hyper_parameters.loss"]
    assert value["hyper_parameters"] == {"hidden": 16, "lr": 0.05}


class _DiskFullFromEpoch(L.Callback):
    """Every file write fails with ENOSPC from epoch ``epoch`` on (a fault at the write call)."""

    def __init__(self, epoch: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.epoch, self.monkeypatch = epoch, monkeypatch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:

            def full_disk(f: object, data: object) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            self.monkeypatch.setattr(_fs, "write_all", full_disk)


def test_disk_full_raises_clearly_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    L.seed_everything(0)
    trainer = make_trainer(
        str(tmp_path), 4, [BurnpackCheckpoint(), _DiskFullFromEpoch(2, monkeypatch)]
    )
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint 2 .* No space left"):
        trainer.fit(TinyModel())
    monkeypatch.undo()
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "ckpt.0",
        "ckpt.1",
        "sentinel_checkpoint_complete.0",
        "sentinel_checkpoint_complete.1",
    ]
    assert verify_checkpoint(directory, 0) == [] and verify_checkpoint(directory, 1) == []
