"""The tiny Lightning run of lightning_tiny.py, sharded with FSDP2 under ``ModelParallelStrategy``
on gloo CPU processes, checkpointed by ``BurnpackCheckpoint`` (run by tests/test_sharded.py)::

    python lightning_fsdp.py --root DIR --epochs 3 --devices 2 [--kill-at-step K] [--out FILE]
        [--ddp] [--async-save [--trace]] [--kill-in-write N --kill-rank R]

``--fail-at-epoch E --fail-rank R``: rank R's shard write of checkpoint E fails with ENOSPC
(injected at the write call); with ``--fail-put`` its upload to the object store fails instead
(``--root s3://...``: checkpoints go to the bucket). ``--tolerate-save-error``: a failed save
ends fit, and the script still writes ``--out`` (the state fit had trained).
``--keep N``: ``checkpoint_duration``.
``--ddp`` runs plain DDP instead, with ``BurnpackCheckpoint(distributed_save=True)``: the ranks
split the writing of the replicated state.
``--async-save``: ``BurnpackCheckpoint(async_save=True)``; with ``--trace`` each rank's writer
holds checkpoint N's write until its training thread asks for the next save (or tears down), and
prints ``TRACE rank=R`` lines of what each thread did in which order.
``--kill-in-write N --kill-rank R``: rank R SIGKILLs itself once its file of checkpoint N is
written, before it is published (on the writer thread when the save is asynchronous).

``--kill-at-step K`` SIGKILLs the whole process group (every rank) after global step K.
``--out`` writes the gathered full model and optimizer state as a burnpack for exact comparison.
The collectives time out after a minute: a rank whose peer died fails instead of hanging.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
import threading
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from lightning_tiny import (
    SEED,
    TinyModel,
    finish_run,
    make_trainer,
)  # a sibling: the script's own directory


class ShardedTiny(TinyModel):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Gathered model + optimizer tensors (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    flat = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    osd = get_optimizer_state_dict(model, optimizer, options=options)
    for fqn, states in osd.get("state", {}).items():  # empty except on rank 0
        for key, value in states.items():
            flat[f"optim.{fqn}.{key}"] = value
    return flat


def _checkpoint_number(where: object) -> int:
    """The checkpoint a write belongs to, from its staging path or key (``ckpt.N...``): the
    epoch of an epoch-numbered checkpoint, known on the writer thread too."""
    return int(re.search(r"ckpt\.([0-9]+)", str(where)).group(1))


def inject_failure(model: L.LightningModule, number: int, rank: int, put: bool) -> None:
    """Make ``rank``'s shard file write fail with ENOSPC during the save of checkpoint
    ``number``, or with ``put`` its upload to the object store (as when the store's retries
    give up)."""
    from lightning_bpk.dcp import BurnpackStorageWriter
    from lightning_bpk.store import ObjectStore, StorageError
    from lightning_bpk.store import objects as store_objects

    owner, name = (ObjectStore, "upload") if put else (BurnpackStorageWriter, "write_file")
    original = getattr(owner, name)

    def failing(self, target, *args):
        where = self.url_of(args[0]) if put else self.path
        if _checkpoint_number(where) == number and model.trainer.global_rank == rank:
            if put:
                raise StorageError(
                    f"upload to {self.url_of(args[0])}: ConnectionError: injected "
                    f"({store_objects.ATTEMPTS} attempts)"
                )
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(target))
        return original(self, target, *args)

    setattr(owner, name, failing)


def kill_in_write(model: L.LightningModule, number: int, rank: int) -> None:
    """SIGKILL ``rank`` once its file of checkpoint ``number`` is written, before it is
    published."""
    from lightning_bpk.dcp import BurnpackStorageWriter

    original = BurnpackStorageWriter.write_file

    def write_then_die(self, target, *args):
        original(self, target, *args)
        if _checkpoint_number(self.path) == number and model.trainer.global_rank == rank:
            print(f"KILLED rank={rank} in the write of checkpoint {number}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    BurnpackStorageWriter.write_file = write_then_die


class Trace:
    """What each thread did, in order (``--trace``): the training thread's requests and
    snapshots of each save, the writer thread's writes. The writer holds checkpoint N's write
    until the training thread asks for a later save (or tears down), so a next save that did
    not wait for the write in flight would show up as a snapshot taken before the write ended."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.asked = threading.Condition()
        self.last_asked = -1

    def add(self, what: str) -> None:
        with self.asked:
            self.events.append(f"{what}@{threading.current_thread().name}")

    def install(self) -> None:
        from lightning_bpk.runtime import async_save, sharded

        save, snapshot = sharded.save, async_save.AsyncCheckpointSaver.save_sharded
        trace = self

        def traced_save(checkpointer, number, *args, **kwargs):
            trace.add(f"write {number} start")
            with trace.asked:
                later = trace.asked.wait_for(lambda: trace.last_asked > number, timeout=60)
            assert later, "the training thread never asked for a later save"
            try:
                return save(checkpointer, number, *args, **kwargs)
            finally:
                trace.add(f"write {number} end")

        def traced_snapshot(self, checkpointer, number, *args, **kwargs):
            result = snapshot(self, checkpointer, number, *args, **kwargs)
            trace.add(f"snapshot {number}")
            return result

        sharded.save = traced_save
        async_save.AsyncCheckpointSaver.save_sharded = traced_snapshot

    def ask(self, number: int) -> None:
        """The training thread asks for save ``number`` (teardown: a number above any)."""
        self.add(f"ask {number}")
        with self.asked:
            self.last_asked = number
            self.asked.notify_all()


def main(argv: list[str]) -> None:

    from lightning_bpk import BurnpackCheckpoint, CheckpointSaveError, burnpack

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--out")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--fail-at-epoch", type=int)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-put", action="store_true")
    parser.add_argument("--tolerate-save-error", action="store_true")
    parser.add_argument("--keep", type=int, default=4)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--kill-in-write", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    L.seed_everything(SEED, workers=True)
    model = TinyModel() if args.ddp else ShardedTiny()

    def on_step(step: int) -> None:
        if step == args.kill_at_step and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # every rank at once, mid-epoch

    model.on_step = on_step
    if args.fail_at_epoch is not None:
        inject_failure(model, args.fail_at_epoch, args.fail_rank, args.fail_put)
    if args.kill_in_write is not None:
        kill_in_write(model, args.kill_in_write, args.kill_rank)
    timeout = timedelta(seconds=60)
    strategy = (
        DDPStrategy(timeout=timeout)
        if args.ddp
        else ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1, timeout=timeout
        )
    )
    trace = Trace() if args.trace else None
    checkpoint = BurnpackCheckpoint if trace is None else _traced(trace)
    callback = checkpoint(
        distributed_save=args.ddp, checkpoint_duration=args.keep, async_save=args.async_save
    )
    if trace is not None:
        trace.install()
    trainer = make_trainer(
        args.root, args.epochs, [callback], strategy=strategy, devices=args.devices
    )
    try:
        trainer.fit(model)
    except CheckpointSaveError as e:
        if not args.tolerate_save_error:
            raise
        print(f"SAVE FAILED rank={trainer.global_rank}: {e}", flush=True)
    state = full_state(model, trainer.optimizers[0])
    if args.out and trainer.is_global_zero:
        burnpack.write(args.out, state)
    if trace is not None:
        print(f"TRACE rank={trainer.global_rank}: {' | '.join(trace.events)}", flush=True)
    finish_run(trainer, callback)


def _traced(trace: Trace) -> type:
    """The callback class, telling ``trace`` when a save is asked for and at teardown."""
    from lightning_bpk import BurnpackCheckpoint

    class Traced(BurnpackCheckpoint):
        def _save(self, trainer, number, **kwargs):
            trace.ask(number)
            super()._save(trainer, number, **kwargs)

        def teardown(self, trainer, pl_module, stage):
            trace.ask(sys.maxsize)
            super().teardown(trainer, pl_module, stage)

    return Traced


if __name__ == "__main__":
    main(sys.argv[1:])
