"""A Trainer run keeping the best checkpoints by a scripted metric (``score``: one value per
epoch, from ``SCORES``), for tests/test_callback_best.py: run whole, or SIGKILLed at the start of
an epoch and run again with the same command. Prints one ``RESULT {json}`` line at the end:
the callback's best checkpoints (epochs, best first), its best and last, and, with
``--model-checkpoint``, what a ``ModelCheckpoint`` on the same metric kept."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bpk.lightning.callback import BurnpackCheckpoint

from lightning_tiny import TinyModel, make_trainer

# NaN at epoch 4: ranked worst, as ModelCheckpoint ranks it; ties at epochs 1 and 6
SCORES = [0.5, 0.3, 0.9, 0.2, float("nan"), 0.4, 0.3, 0.8]


class ScoredModel(TinyModel):
    """TinyModel whose validation logs ``score`` = ``SCORES[epoch]`` (round again after the
    last); it can also be tested."""

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("score", SCORES[self.current_epoch % len(SCORES)])

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def test_dataloader(self) -> Any:
        return self.val_dataloader()


class KillAt(L.Callback):
    """SIGKILL this process when epoch ``epoch`` starts (the save of the one before is complete)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def _epoch(path: str) -> int:
    """The epoch of a ``ckpt.N`` directory or a ModelCheckpoint ``epoch=N-...`` file."""
    found = re.search(r"epoch=(\d+)", path) or re.search(r"\.(\d+)(~[0-9a-f]+)?$", path)
    assert found is not None, path
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--dirpath")
    parser.add_argument("--epochs", type=int, default=len(SCORES))
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--duration", type=int, default=1)
    parser.add_argument("--kill-at-epoch", type=int)
    parser.add_argument("--model-checkpoint", action="store_true")
    args = parser.parse_args()
    callback = BurnpackCheckpoint(
        dirpath=args.dirpath, checkpoint_duration=args.duration, monitor="score",
        save_top_k=args.top_k,
    )  # fmt: skip
    callbacks: list[Any] = [callback]
    reference = ModelCheckpoint(
        dirpath=os.path.join(args.root, "model-checkpoint"), monitor="score",
        save_top_k=args.top_k,
    )  # fmt: skip
    if args.model_checkpoint:
        callbacks.append(reference)
    if args.kill_at_epoch is not None:
        callbacks.append(KillAt(args.kill_at_epoch))
    trainer = make_trainer(args.root, args.epochs, callbacks)
    trainer.fit(ScoredModel())
    result = {
        "best_k": [_epoch(p) for p in callback.best_k_models],
        "best": _epoch(callback.best_model_path),
        "last": _epoch(callback.last_model_path),
        "restored": callback.restored_number,
    }
    if args.model_checkpoint:
        result["model_checkpoint"] = sorted(_epoch(p) for p in reference.best_k_models)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
