"""BurnpackCheckpointIO as Trainer(plugins=[...]): save_checkpoint, ModelCheckpoint, ckpt_path."""

from __future__ import annotations

import errno
import inspect
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bpk import _fs
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.lightning.checkpoint_io import BurnpackCheckpointIO
from lightning_bpk.records import ModuleRecord, RecordError

from conftest import replace_with_symlink
from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)


class _Start(L.Callback):
    """Records where training (re)started and the restored Adam state of the first parameter."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch = trainer.current_epoch
        state = trainer.optimizers[0].state.get(next(iter(pl_module.parameters())), {})
        self.adam_state = {k: v.clone() for k, v in state.items()}


def _trainer(root: Path, epochs: int, callbacks: list) -> L.Trainer:
    L.seed_everything(0)
    return make_trainer(str(root), epochs, callbacks, plugins=[BurnpackCheckpointIO()])


def test_save_checkpoint_then_fit_from_it_restores_everything(tmp_path):
    model = TinyModel()
    trainer = _trainer(tmp_path, 2, [])
    trainer.fit(model)
    path = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(path)
    assert path.read_bytes()[:4] == b"NRUB"  # burnpack, not a torch zip
    first = next(iter(model.parameters()))
    expected = {k: v.clone() for k, v in trainer.optimizers[0].state[first].items()}

    start = _Start()
    resumed = _trainer(tmp_path, 3, [start])
    resumed.fit(TinyModel(), ckpt_path=path)
    assert start.epoch == 2
    assert set(start.adam_state) == set(expected)
    assert all(torch.equal(start.adam_state[k], expected[k]) for k in expected)
    assert start.adam_state["step"].shape == ()


def test_model_checkpoint_top_k_last_and_resume_from_last(tmp_path):
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "mc", monitor="step", mode="max", save_top_k=2, save_last=True
    )
    _trainer(tmp_path, 4, [checkpoint]).fit(TinyModel())
    names = sorted(p.name for p in (tmp_path / "mc").iterdir())
    assert names == ["epoch=2-step=18.ckpt", "epoch=3-step=24.ckpt", "last.ckpt"]
    assert all((tmp_path / "mc" / n).read_bytes()[:4] == b"NRUB" for n in names)

    start = _Start()
    again = ModelCheckpoint(
        dirpath=tmp_path / "mc", monitor="step", mode="max", save_top_k=2, save_last=True
    )
    _trainer(tmp_path, 5, [again, start]).fit(TinyModel(), ckpt_path="last")
    assert start.epoch == 4
    assert sorted(p.name for p in (tmp_path / "mc").iterdir()) == [
        "epoch=3-step=24.ckpt",
        "epoch=4-step=30.ckpt",
        "last.ckpt",
    ]
    assert again.best_k_models[str(tmp_path / "mc" / "epoch=3-step=24.ckpt")].shape == ()


def test_io_loads_a_callback_directory_and_works_beside_the_callback(tmp_path):
    trainer = _trainer(tmp_path, 2, [BurnpackCheckpoint()])
    trainer.fit(TinyModel())
    trainer.save_checkpoint(tmp_path / "also.ckpt")  # the IO with the callback installed
    assert (tmp_path / "also.ckpt").read_bytes()[:4] == b"NRUB"

    start = _Start()
    fresh = _trainer(tmp_path / "other", 3, [start])
    fresh.fit(TinyModel(), ckpt_path=tmp_path / "checkpoints" / "ckpt.0")
    assert start.epoch == 1


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    io = BurnpackCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1}, path)

    def full_disk(f: object, data: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "write_all", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no scratch file left


def test_load_accepts_the_state_argument_and_fills_it(tmp_path):
    io = BurnpackCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"epoch": 3, "state_dict": {"w": torch.ones(2)}}, path)
    state = {"mine": 1}
    back = io.load_checkpoint(path, state=state)
    assert back is state and state["epoch"] == 3 and state["mine"] == 1
    assert torch.equal(state["state_dict"]["w"], torch.ones(2))
    assert "state" in inspect.signature(BurnpackCheckpointIO.load_checkpoint).parameters


def test_remove_and_storage_options(tmp_path):
    io = BurnpackCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"epoch": 0}, path)
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # already gone: fine
    assert not path.exists()
    # accepted, for URLs (fsspec's; a local path has none: tests/test_object_storage.py)
    BurnpackCheckpointIO(storage_options={"anon": True}).save_checkpoint({}, path)
    io.save_checkpoint({"epoch": 1}, path, storage_options={"anon": True})
    assert io.load_checkpoint(path)["epoch"] == 1


def _weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_resume_from_last_with_the_io_alone_is_bit_identical(tmp_path):
    """ModelCheckpoint + ``ckpt_path="last"``: the RNG states saved in the file are restored, so
    the resumed epochs shuffle and drop out exactly as in a run that never stopped."""

    def trainer(root: Path, epochs: int) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=root / "mc", save_last=True)
        return _trainer(root, epochs, [checkpoint])

    run = trainer(tmp_path / "straight", 3)  # seeds, then the model is built
    straight = TinyModel()
    run.fit(straight)
    trainer(tmp_path / "split", 1).fit(TinyModel())
    run = trainer(tmp_path / "split", 3)
    L.seed_everything(99)  # a new process: whatever state the global RNGs happen to be in
    resumed = TinyModel()
    run.fit(resumed, ckpt_path="last")
    expected, got = _weights(straight), _weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("link", ["record file", "data directory"])
def test_the_io_refuses_a_checkpoint_directory_holding_a_symlink(tmp_path, link):
    """The checkpoint rule (lightning_bpk.layout) holds for the plugin too: a ``ckpt.N`` that is
    a symlink, or one holding one, is refused naming the link, never followed."""
    base = tmp_path / "checkpoints"
    model = ModuleRecord({"w": torch.ones(2)})
    Checkpointer(base).save_checkpoint(3, {"model": model, "trainer": {"epoch": 1}})
    data = base / "ckpt.3"
    inside = data if link == "data directory" else data / "trainer.bpk"
    linked = replace_with_symlink(inside, tmp_path / "elsewhere" / inside.name)
    with pytest.raises(RecordError, match=re.escape(str(linked)) + ".*symlink"):
        BurnpackCheckpointIO().load_checkpoint(data)
