"""LightningCLI with BurnpackCheckpoint configured in YAML, killed and run again: it continues.

The whole run is one config file (``examples/cli/config.yaml``), the callback one entry of
``trainer.callbacks``::

    python examples/lightning_cli.py fit --config examples/cli/config.yaml \\
        --trainer.default_root_dir runs/cli
    # killed, preempted or done: the same command continues after the newest complete checkpoint
    python examples/lightning_cli.py fit --config examples/cli/config.yaml \\
        --trainer.default_root_dir runs/cli --trainer.max_epochs 6

LightningCLI writes the resolved configuration to ``{default_root_dir}/config.yaml`` when fit
starts and, by default, refuses to start when that file exists, which a second run of the same
command always finds. ``save_config_kwargs={"overwrite": True}`` (below) lets the re-run
replace it. ``--kill_after_step K`` makes the process SIGKILL itself after global step K, to
show a crash and the resume.
"""

from __future__ import annotations

import os
import signal

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    """A small MLP on a synthetic, seeded 3-class problem (no download), Adam and StepLR."""

    def __init__(self, hidden: int = 32, lr: float = 0.02, kill_after_step: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.trainer.global_step == self.hparams.kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no handler runs, nothing is flushed

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def main() -> None:
    # overwrite: the re-run of the same command replaces the config.yaml the first run saved
    LightningCLI(Classifier, seed_everything_default=0, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
