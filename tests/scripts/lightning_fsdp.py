"""The tiny Lightning run of lightning_tiny.py, sharded with FSDP2 under ``ModelParallelStrategy``
on gloo CPU processes, checkpointed by ``BurnpackCheckpoint`` (run by tests/test_sharded.py)::

    python lightning_fsdp.py --root DIR --epochs 3 --devices 2 [--kill-at-step K] [--out FILE]
        [--ddp]

``--fail-at-epoch E --fail-rank R``: rank R's shard write of epoch E's save fails with ENOSPC
(injected at the write call); with ``--fail-put`` its upload to the object store fails instead
(``--root s3://...``: checkpoints go to the bucket). ``--tolerate-save-error``: a failed save
ends fit, and the script still writes ``--out`` (the state fit had trained).
``--keep N``: ``checkpoint_duration``.
``--ddp`` runs plain DDP instead, with ``BurnpackCheckpoint(distributed_save=True)``: the ranks
split the writing of the replicated state.

``--kill-at-step K`` SIGKILLs the whole process group (every rank) after global step K.
``--out`` writes the gathered full model and optimizer state as a burnpack for exact comparison.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
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
    make_trainer,
    report_finished,
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


def inject_failure(model: L.LightningModule, epoch: int, rank: int, put: bool) -> None:
    """Make ``rank``'s shard file write fail with ENOSPC during the save of ``epoch``, or with
    ``put`` its upload to the object store (as when the store's retries give up)."""
    from lightning_bpk import storage
    from lightning_bpk.dcp import BurnpackStorageWriter
    from lightning_bpk.store import objects as store_objects

    owner, name = (storage.ObjectStore, "upload") if put else (BurnpackStorageWriter, "write_file")
    original = getattr(owner, name)

    def failing(self, target, *args):
        if model.trainer.current_epoch == epoch and model.trainer.global_rank == rank:
            if put:
                raise storage.StorageError(
                    f"upload to {self.url_of(args[0])}: ConnectionError: injected "
                    f"({store_objects.ATTEMPTS} attempts)"
                )
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(target))
        return original(self, target, *args)

    setattr(owner, name, failing)


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
    strategy = (
        "ddp"
        if args.ddp
        else ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    )
    callback = BurnpackCheckpoint(distributed_save=args.ddp, checkpoint_duration=args.keep)
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
    report_finished(trainer, callback)


if __name__ == "__main__":
    main(sys.argv[1:])
