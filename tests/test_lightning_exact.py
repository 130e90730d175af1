"""What Lightning's own checkpoint leaves out, given back at a resume: a run killed mid-way and
resumed ends as the one that never stopped (real Trainers, real folders, an in-process crash
after a save standing in for a kill)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_bpk.lightning.callback import BurnpackCheckpoint

from lightning_tiny import CrashAt, Crashed, TinyModel, make_trainer

pytestmark = pytest.mark.timeout(300)


class _EpochValues(L.Callback):
    """The epoch-level logged values at each epoch's end."""

    def __init__(self) -> None:
        self.values: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        self.values[trainer.current_epoch] = {
            k: metrics[k].clone() for k in ("loss_epoch", "mean_loss") if k in metrics
        }


class PlateauModel(TinyModel):
    """Adam under a ReduceLROnPlateau that halves the lr at every epoch end (never "better")."""

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=10.0
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"},
        }


class BackboneModel(TinyModel):
    """The first layer is the backbone BackboneFinetuning freezes, then unfreezes."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.net[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05)


class _Finetuning(BackboneFinetuning):
    """Unfreezes the backbone when epoch 1 starts."""

    def __init__(self) -> None:
        super().__init__(unfreeze_backbone_at_epoch=1)


class MetricModel(TinyModel):
    """Logs its loss per epoch twice: as a tensor and through a torchmetrics MeanMetric."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_metric = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss_epoch", loss, on_step=False, on_epoch=True)
        self.mean_metric(loss)
        self.log("mean_loss", self.mean_metric, on_step=False, on_epoch=True)
        return loss


def _fit(root: Path, model_class: type, epochs: int, *callbacks: L.Callback, **options: Any):
    L.seed_everything(0)
    model = model_class()
    checkpoint = BurnpackCheckpoint(**options)
    trainer = make_trainer(str(root), epochs, [checkpoint, *callbacks])
    trainer.fit(model)
    return trainer, model, checkpoint


def _killed_then_resumed(root: Path, model_class: type, step: int, *callbacks, **options):
    """Killed after global step ``step``, then run again; ``callbacks`` in the second run, new
    ones of their classes (built without arguments) in the first."""
    first = [type(c)() for c in callbacks]
    with pytest.raises(Crashed):
        _fit(root, model_class, 4, *first, CrashAt(step), **options)
    return _fit(root, model_class, 4, *callbacks, **options)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert all(torch.equal(left[k], right[k]) for k in left), "the weights differ"


@pytest.mark.parametrize(
    ("options", "saved"),
    [({}, 1), ({"every_n_train_steps": 4}, 8)],
    ids=["epoch-end-save", "mid-epoch-save"],
)
def test_reduce_lr_on_plateau_keeps_its_step_across_a_resume(tmp_path, options, saved):
    """Saved at the end of epoch 1, before Lightning's plateau step (which it skips when it
    resumes there), or mid-epoch (Lightning skips the step at the end of the resumed epoch)."""
    _, reference, _ = _fit(tmp_path / "ref", PlateauModel, 4, **options)
    kill = 15 if saved == 1 else 10
    trainer, resumed, checkpoint = _killed_then_resumed(
        tmp_path / "run", PlateauModel, kill, **options
    )
    assert checkpoint.restored_number == saved
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == reference.trainer.optimizers[0].param_groups[0]["lr"] == 0.05 / 16
    _same_weights(resumed, reference)


def test_backbone_finetuning_resumed_after_the_unfreeze_trains_the_backbone(tmp_path):
    _, reference, _ = _fit(tmp_path / "ref", BackboneModel, 4, _Finetuning())
    _, resumed, checkpoint = _killed_then_resumed(
        tmp_path / "run", BackboneModel, 15, _Finetuning()
    )
    assert checkpoint.restored_number == 1
    assert all(p.requires_grad for p in resumed.parameters())
    _same_weights(resumed, reference)


def test_epoch_level_metrics_after_a_mid_epoch_kill_count_the_whole_epoch(tmp_path):
    expected, got = _EpochValues(), _EpochValues()
    _, reference, _ = _fit(tmp_path / "ref", MetricModel, 4, expected, every_n_train_steps=4)
    _, resumed, checkpoint = _killed_then_resumed(
        tmp_path / "run", MetricModel, 5, got, every_n_train_steps=4
    )
    assert checkpoint.restored_number == 4  # batch 4 of the 6 of epoch 0
    assert sorted(got.values) == [0, 1, 2, 3]
    for epoch, values in got.values.items():
        assert sorted(values) == ["loss_epoch", "mean_loss"]
        for name, value in values.items():
            assert torch.equal(value, expected.values[epoch][name]), (epoch, name)
    _same_weights(resumed, reference)
