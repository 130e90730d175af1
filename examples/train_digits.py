"""Train a small MLP on handwritten digits with automatic burnpack checkpoints.

The data (1797 8x8 images, 10 classes) is committed beside it (``digits_data``): no download.
Configuration is gin, as in Dopamine: ``--gin_file`` (repeatable) then ``--gin_binding``
(repeatable) overrides::

    python examples/train_digits.py --base_dir runs/digits --gin_file lightning_bpk/gin/digits.gin
    python examples/train_digits.py --base_dir runs/digits \\
        --gin_file lightning_bpk/gin/digits.gin --gin_file lightning_bpk/gin/keep_every_5.gin \\
        --gin_binding 'train.max_epochs = 30'

Run it again with the same ``--base_dir`` and it continues after the newest complete
checkpoint (``{base_dir}/checkpoints/ckpt.N``) at epoch N+1. ``--stop_after_epoch N`` makes the
process SIGKILL itself in the middle of epoch N+1 (after the first batches), which is what
``make demo`` uses to show a crash and the resume.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import gin
import lightning as L
import torch
from digits_data import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bpk import BurnpackCheckpoint

VALIDATION_SAMPLES = 297  # the last 297 images; 1500 for training


@gin.configurable
class DigitsModel(L.LightningModule):
    """64 -> hidden -> 10 MLP with dropout, Adam and a per-epoch StepLR."""

    def __init__(
        self,
        hidden: int = 64,
        dropout: float = 0.2,
        learning_rate: float = 1e-2,
        lr_step: int = 5,
        lr_gamma: float = 0.5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=self.hparams.lr_step, gamma=self.hparams.lr_gamma
        )
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@gin.configurable
class DigitsData(L.LightningDataModule):
    """The digits as float tensors scaled to [0, 1]; shuffled training batches."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        images, labels = load_digits()
        x = torch.tensor(images.reshape(len(images), -1), dtype=torch.float32) / 16.0
        y = torch.tensor(labels)
        self.train_set = TensorDataset(x[:-VALIDATION_SAMPLES], y[:-VALIDATION_SAMPLES])
        self.val_set = TensorDataset(x[-VALIDATION_SAMPLES:], y[-VALIDATION_SAMPLES:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class _KillMidEpoch(L.Callback):
    """SIGKILL this process after a few batches of epoch ``epoch`` (a crash, not a clean stop)."""

    def __init__(self, epoch: int, batch: int = 3) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            print(f"train_digits: SIGKILL in epoch {self.epoch}, batch {batch_idx}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


@gin.configurable
def train(
    base_dir: str,
    max_epochs: int = 10,
    seed: int = 0,
    stop_after_epoch: int | None = None,
) -> L.Trainer:
    """Fit DigitsModel on DigitsData with a BurnpackCheckpoint in ``{base_dir}/checkpoints``."""
    L.seed_everything(seed, workers=True)
    callbacks: list[L.Callback] = [BurnpackCheckpoint()]
    if stop_after_epoch is not None:
        callbacks.append(_KillMidEpoch(stop_after_epoch + 1))
    trainer = L.Trainer(
        default_root_dir=base_dir,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = DigitsModel()
    trainer.fit(model, datamodule=DigitsData())
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    print(f"train_digits: finished epoch {trainer.current_epoch - 1}, {metrics}", flush=True)
    return trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_dir", required=True, help="run directory (checkpoints inside)")
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file(s)")
    parser.add_argument("--gin_binding", action="append", default=[], help="gin overrides")
    parser.add_argument("--stop_after_epoch", type=int, help="SIGKILL mid-way through N+1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for name in ("lightning.pytorch", "lightning.fabric"):  # keep the output to our lines
        logging.getLogger(name).setLevel(logging.WARNING)
    gin.parse_config_files_and_bindings(args.gin_file, args.gin_binding)
    train(args.base_dir, stop_after_epoch=args.stop_after_epoch)


if __name__ == "__main__":
    main()
