"""A tiny, deterministic Lightning run for the integration tests, usable in-process or as a script.

Shuffled DataLoader, dropout, Adam and StepLR: every source of state a resume must restore.
As a script (run by the end-to-end, preemption and DDP tests)::

    python lightning_tiny.py --root DIR --epochs 4 [--kill-at-step K] [--term-at-step K]
        [--term-rank R] [--devices 2] [--out FILE] [--fsize-limit BYTES --fsize-at-step K]
        [--every-n-steps N] [--workers W] [--ids FILE] [--one-cycle] [--max-steps M]
        [--swa EPOCH] [--ema] [--io-plugin] [--async-save] [--auto-steps] [--max-time SECONDS]
        [--data KIND] [--batch-size B] [--accumulate A] [--augment] [--persistent-workers]
        [--shared-seed]

``--out`` writes the final parameters as a burnpack (a ModuleRecord) for bit-exact comparison.
``--kill-at-step K`` SIGKILLs the process itself after global step K (mid-epoch when K is not a
multiple of the batches per epoch); ``--term-at-step K`` sends SIGTERM (``--term-signal``,
``--term-count`` times) to rank ``--term-rank``;
``--fsize-limit`` caps file sizes (RLIMIT_FSIZE, SIGXFSZ ignored) from step ``--fsize-at-step``.
``--ids FILE`` appends ``epoch batch_idx global_step id,id,...`` per training batch (``FILE.rankR``
under DDP): every sample carries a unique id, so a resumed run's data order can be compared.
``--swa EPOCH`` adds Lightning's StochasticWeightAveraging from that (1-based) epoch, ``--ema`` an
:class:`EmaWeights` callback (``--out`` then also writes its copy to ``FILE.ema``),
``--io-plugin`` BurnpackCheckpointIO beside the callback, ``--async-save`` and ``--auto-steps``
(``every_n_train_steps="auto"``) the callback's options, ``--max-time`` Lightning's ``max_time``.
``--data`` chooses the training data (:data:`DATA_KINDS`): ``plain`` (the shuffled DataLoader),
``dict`` (that loader and a second, shorter one, ids from 1000 on, as a dict: Lightning's
``max_size_cycle``), ``max_size_cycle`` / ``min_size`` / ``max_size`` (the two in a
``CombinedLoader`` of that mode), ``iterable`` (an ``IterableDataset`` shuffling itself from the
global RNG, without state) or ``stateful`` (torchdata's ``StatefulDataLoader``). ``--augment``
adds ``torch.rand`` noise to every sample where it is loaded (in the workers, with
``--workers``); with ``--data stateful`` the noise comes from the dataset's own generator,
which its ``state_dict`` holds.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import resource
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

SAMPLES = 48  # 6 batches of 8 per epoch: small enough for seconds, enough for mid-epoch kills
BATCH_SIZE = 8
FEATURES = 6
SEED = 1234
SECOND_SAMPLES, SECOND_IDS = 24, 1000  # the second loader of --data dict/CombinedLoader
DATA_KINDS = ("plain", "dict", "max_size_cycle", "min_size", "max_size", "iterable", "stateful")


class Augmented(Dataset):
    """A map-style dataset adding ``torch.rand`` noise to each sample's features as it is
    loaded (in a worker process when the loader has workers)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y, i = self.data[index]
        return x + self.noise(), y, i

    def noise(self) -> torch.Tensor:
        return torch.rand(FEATURES)


class StatefulAugmented(Augmented):
    """Its noise comes from its own generator (seeded from the worker's seed when first used),
    which ``state_dict`` holds: torchdata's StatefulDataLoader saves each worker's copy."""

    generator: torch.Generator | None = None

    def _generator(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(torch.initial_seed())
        return self.generator

    def noise(self) -> torch.Tensor:
        return torch.rand(FEATURES, generator=self._generator())

    def state_dict(self) -> dict:
        return {"generator": self._generator().get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._generator().set_state(state["generator"])


class Stream(IterableDataset):
    """Yields a dataset's samples in an order drawn from the global torch RNG at each pass."""

    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        order = torch.randperm(len(self.data)).tolist()  # type: ignore[arg-type]
        return (self.data[i] for i in order)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


class Crashed(Exception):
    """What :class:`CrashAt` raises: training stops there as if the process had died (no later
    save; an asynchronous one in flight is finished by teardown)."""


class CrashAt(L.Callback):
    """Raises :class:`Crashed` after global step ``step`` (after the checkpoint callback's
    hook, so a save due at that step is made)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            raise Crashed


class TinyModel(L.LightningModule):
    """Linear -> ReLU -> Dropout -> Linear classifier with Adam and a per-epoch StepLR."""

    def __init__(
        self,
        hidden: int = 16,
        lr: float = 0.05,
        one_cycle: bool = False,
        workers: int = 0,
        data: str = "plain",
        batch_size: int = BATCH_SIZE,
        augment: bool = False,
        persistent_workers: bool = False,
        empty_buffer: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters("hidden", "lr")
        if empty_buffer:  # first in the state dict, so first in each record's data order
            self.register_buffer("mask", torch.zeros(0))
        self.one_cycle, self.workers = one_cycle, workers
        self.data, self.batch_size, self.augment = data, batch_size, augment
        self.persistent_workers = persistent_workers
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 3)
        )
        self.on_step = None  # optional callable(global_step), used to kill/signal mid-epoch
        self.ids_file: Path | None = None  # where each batch's sample ids are appended

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = list(batch.values()) if isinstance(batch, dict) else [batch]
        if isinstance(batch, list) and isinstance(batch[0], list):  # a CombinedLoader's
            parts = batch
        parts = [part for part in parts if part is not None]  # max_size: an exhausted loader
        x, y, ids = (torch.cat(column) for column in zip(*parts, strict=True))
        if self.ids_file is not None:
            with self.ids_file.open("a") as f:
                line = ",".join(str(i) for i in ids.tolist())
                f.write(f"{self.current_epoch} {batch_idx} {self.global_step} {line}\n")
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.on_step is not None:
            self.on_step(self.trainer.global_step)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        if self.one_cycle:  # per step, sized the usual way (this sets the data up early)
            total = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def _data(self, seed: int, n: int, first_id: int = 0) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, FEATURES, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        ids = torch.arange(first_id, first_id + n)  # the third column: a unique sample id
        return TensorDataset(x, y, ids)

    def _loader(self, dataset: Dataset, **options: Any) -> DataLoader:
        workers = self.workers
        options.update(batch_size=self.batch_size, num_workers=workers)
        if workers:
            options.update(
                multiprocessing_context="fork", persistent_workers=self.persistent_workers
            )
        if self.data == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(dataset, **options)
        return DataLoader(dataset, **options)

    def train_dataloader(self) -> Any:
        data: Dataset = self._data(0, SAMPLES)
        if self.augment:
            data = StatefulAugmented(data) if self.data == "stateful" else Augmented(data)
        if self.data == "iterable":
            return self._loader(Stream(data))
        first = self._loader(data, shuffle=True)
        if self.data in ("plain", "stateful"):
            return first
        second = self._loader(self._data(2, SECOND_SAMPLES, SECOND_IDS), shuffle=True)
        if self.data == "dict":
            return {"first": first, "second": second}
        return CombinedLoader([first, second], mode=self.data)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._data(1, 16), batch_size=BATCH_SIZE)


class EmaWeights(L.Callback):
    """A user's exponential moving average of the weights, kept in the callback's own state
    (``state_dict``/``load_state_dict``): what a resume must give back bit for bit."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.updates = 0
        self.ema: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        with torch.no_grad():
            for name, value in pl_module.state_dict().items():
                if name in self.ema:
                    self.ema[name].mul_(self.decay).add_(value, alpha=1 - self.decay)
                else:
                    self.ema[name] = value.detach().clone()
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "ema": dict(self.ema)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.decay, self.updates = state_dict["decay"], state_dict["updates"]
        self.ema = {k: v.clone() for k, v in state_dict["ema"].items()}


def make_trainer(root: str, epochs: int, callbacks: list, **kwargs: object) -> L.Trainer:
    """A quiet CPU Trainer: deterministic, no logger, no progress bar, no summary."""
    options = dict(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def finish_run(trainer: L.Trainer, callback: Any) -> NoReturn:
    """Print the line the tests read at the end of a run (this rank's final epoch and step, and
    the checkpoint it resumed from: ``callback.restored_number``, None for none), then
    :func:`exit_now`."""
    print(
        f"FINISHED rank={trainer.global_rank} epoch={trainer.current_epoch} "
        f"step={trainer.global_step} restored={callback.restored_number}",
        flush=True,
    )
    exit_now()


def exit_now(status: int = 0) -> NoReturn:
    """End a finished (or, on 2 ranks, a preempted) run with ``status`` at once: output
    flushed, no interpreter teardown.

    With torch 2.13 a gloo process that ends soon after a collective can die in that teardown:
    a gloo worker thread is still dropping the collective's tensors and waits for the GIL, so
    the interpreter's shutdown aborts it ("terminate called without an active exception",
    SIGABRT; pytorch#190489), and ``destroy_process_group`` deadlocks instead when the group's
    destructor, holding the GIL, joins that thread. Both were seen here, the abort in CI. Every
    file a run writes is closed, and every save joined, before its ``FINISHED`` line.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_stopped(stop: SystemExit, devices: int) -> None:
    """After ``fit`` (or a Fabric loop) left through a preemption stop's ``stop``: on 2 or more
    ``devices`` (a gloo group), run the exit handlers as any exit does (a script's ``EXIT``
    line, the library's own), then :func:`exit_now` with the stop's status, skipping the
    teardown that gloo can abort; on one, return, and the caller re-raises ``stop`` (an orderly
    exit)."""
    if devices > 1 and isinstance(stop.code, int):
        atexit._run_exitfuncs()
        exit_now(stop.code)


def main(argv: list[str] | None = None) -> None:
    from lightning_bpk import BurnpackCheckpoint, ModuleRecord

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--term-at-step", type=int)
    parser.add_argument("--term-rank", type=int, default=0)
    parser.add_argument("--term-signal", default="SIGTERM")
    parser.add_argument("--term-count", type=int, default=1)  # signals sent at that step
    parser.add_argument("--fsize-limit", type=int)
    parser.add_argument("--fsize-at-step", type=int, default=0)
    parser.add_argument("--frequency", type=int, default=1)
    parser.add_argument("--every-n-steps", type=int)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--one-cycle", action="store_true")
    parser.add_argument("--data", choices=DATA_KINDS, default="plain")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--empty-buffer", action="store_true")
    parser.add_argument("--shared-seed", action="store_true")
    parser.add_argument("--ids")
    parser.add_argument("--out")
    # -- callbacks, plugins and limits beside the checkpoint callback (engineer cb's block) --
    parser.add_argument("--swa", type=int)
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--io-plugin", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--auto-steps", action="store_true")
    parser.add_argument("--max-time", type=float)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    def limit_file_size() -> None:
        # A full disk, portably: writes past the limit fail with EFBIG instead of killing us.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Under DDP each rank gets its own RNG stream (different dropout masks), as a resume must
    # restore every rank's own states; DDP broadcasts rank 0's initial weights.
    # --shared-seed: one seed for all ranks, so their DistributedSamplers (seeded from it)
    # draw one order and split it, and the ranks' epochs together hold each sample once.
    L.seed_everything(SEED if args.shared_seed else SEED + rank, workers=True)
    model = TinyModel(
        one_cycle=args.one_cycle,
        workers=args.workers,
        data=args.data,
        batch_size=args.batch_size,
        augment=args.augment,
        persistent_workers=args.persistent_workers,
        empty_buffer=args.empty_buffer,
    )
    if args.ids:
        model.ids_file = Path(args.ids + (f".rank{rank}" if args.devices > 1 else ""))

    def on_step(step: int) -> None:
        if args.fsize_limit is not None and step == args.fsize_at_step:
            limit_file_size()
        if step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.term_at_step and rank == args.term_rank:
            os.kill(os.getpid(), getattr(signal, args.term_signal))
            for _ in range(args.term_count - 1):  # handled before it returns: one at a time
                signal.raise_signal(getattr(signal, args.term_signal))

    model.on_step = on_step
    extra: dict[str, Any] = {}
    if args.devices > 1:
        extra = dict(strategy="ddp", devices=args.devices, use_distributed_sampler=True)
    callback = BurnpackCheckpoint(
        checkpoint_frequency=args.frequency,
        every_n_train_steps="auto" if args.auto_steps else args.every_n_steps,
        async_save=args.async_save,
    )
    callbacks: list = [callback]
    if args.swa is not None:
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=args.swa))
    ema = EmaWeights() if args.ema else None
    callbacks += [ema] if ema is not None else []
    if args.io_plugin:
        from lightning_bpk import BurnpackCheckpointIO

        extra["plugins"] = [BurnpackCheckpointIO()]
    if args.max_time is not None:
        extra["max_time"] = timedelta(seconds=args.max_time)
    epochs = args.epochs if args.max_steps == -1 else -1
    extra["accumulate_grad_batches"] = args.accumulate
    trainer = make_trainer(args.root, epochs, callbacks, max_steps=args.max_steps, **extra)
    try:
        trainer.fit(model)
    except SystemExit as stop:  # a preemption stop: its status, checkpoint flushed on every rank
        exit_stopped(stop, args.devices)
        raise
    if args.out and trainer.is_global_zero:
        ModuleRecord.from_module(model).save(args.out)
        if ema is not None:
            ModuleRecord(ema.ema).save(args.out + ".ema")
    finish_run(trainer, callback)


if __name__ == "__main__":
    main(sys.argv[1:])
