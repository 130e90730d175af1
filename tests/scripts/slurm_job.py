"""The training step of the SLURM tests' job scripts (``exec srun python slurm_job.py ...``).

lightning_tiny's model and trainer with ``BurnpackCheckpoint``; on the job's first run it
pauses at the end of validation of ``--pause-epoch`` until a preemption signal has reached the
callback (so the test can signal a run that is known to be training), which makes the stop
happen at that epoch's end. It prints ``START``/``EXIT`` lines (the latter at interpreter exit,
so only for an orderly stop) and ``FINISHED`` when ``fit`` returns (after which the process ends
at once, without ``EXIT``: lightning_tiny's ``finish_run``). A DDP job's stop runs the exit
handlers (``EXIT`` among them), then ends without the interpreter's teardown, which gloo can
abort (lightning_tiny's ``exit_stopped``).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import time
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).parent))
from lightning_tiny import SEED, TinyModel, exit_stopped, finish_run, make_trainer

PAUSE_LIMIT = 120.0  # seconds; a signal that never comes lets training finish (and the test fail)


class PauseForSignal(L.Callback):
    """Hold the first run at the end of an epoch's validation until a signal was handled."""

    def __init__(self, epoch: int, flag_holder: object, marker: Path) -> None:
        self.epoch, self.flag_holder, self.marker = epoch, flag_holder, marker

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch != self.epoch:
            return
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            return
        if trainer.is_global_zero:
            self.marker.touch()
        deadline = time.monotonic() + PAUSE_LIMIT
        while not self.flag_holder.preemption.requested and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv: list[str]) -> None:
    from lightning_bpk import BurnpackCheckpoint, ModuleRecord

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--pause-epoch", type=int)
    parser.add_argument("--no-requeue", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    rank = os.environ.get("SLURM_PROCID", "0")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    print(f"START rank={rank} restart={restart} pid={os.getpid()}", flush=True)
    atexit.register(print, f"EXIT rank={rank} restart={restart}", flush=True)

    L.seed_everything(SEED, workers=True)
    model = TinyModel()
    callback = BurnpackCheckpoint(auto_requeue=not args.no_requeue)
    callbacks: list[L.Callback] = [callback]
    if args.pause_epoch is not None:
        marker = Path(args.root) / "paused"
        callbacks.insert(0, PauseForSignal(args.pause_epoch, callback, marker))
    extra = {}
    if args.devices > 1:
        extra = dict(strategy="ddp", devices=args.devices, use_distributed_sampler=True)
    trainer = make_trainer(args.root, args.epochs, callbacks, **extra)
    try:
        trainer.fit(model)
    except SystemExit as stop:  # a preemption stop: its status, checkpoint flushed on every rank
        exit_stopped(stop, args.devices)
        raise
    if args.out and trainer.is_global_zero:
        ModuleRecord.from_module(model).save(args.out)
    finish_run(trainer, callback)


if __name__ == "__main__":
    main(sys.argv[1:])
