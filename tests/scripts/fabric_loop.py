"""A hand-written Lightning Fabric loop checkpointed by ``CheckpointManager`` (run by
tests/test_fabric_e2e.py)::

    python fabric_loop.py --root DIR [--steps 20] [--every 4] [--strategy single|ddp|fsdp]
        [--devices 2] [--ids FILE] [--out FILE] [--workers N] [--async-save]
        [--kill-at-step K | --kill-in-save K | --term-at-step K [--term-rank R]] [--restore-only]

A small MLP with dropout trains on shuffled samples that carry their id, a save every
``--every`` optimizer steps (``save_if_due``) and a last one at the end. ``--strategy ddp`` runs
DDP, ``fsdp`` FSDP2 through ``ModelParallelStrategy`` (``fully_shard`` per layer), on
``--devices`` gloo CPU processes. The ranks are forks of the first process, made after the
imports with the environment an external launcher sets (Fabric's own launcher runs the script
again, paying the seconds of importing torch and Lightning once more per rank).

``--ids FILE`` appends ``step id id ...`` per batch to ``FILE.rank<R>``. ``--out FILE`` writes
the final model and optimizer state (gathered, named by parameter) as a burnpack, on rank 0.
``--kill-at-step K`` SIGKILLs every rank after step K, ``--kill-in-save K`` while checkpoint K
is being saved (its data published, its sentinel not yet written: a torn checkpoint),
``--term-at-step K`` sends SIGTERM to rank ``--term-rank`` after step K (the ranks agree, save
at the next step and exit 0). ``--restore-only`` restores the newest checkpoint and writes
``--out`` without training. ``--lora BASE`` fine-tunes adapters instead: the model's weights load
from the file ``BASE`` (written there first if it does not exist), only a low-rank adapter beside
each Linear trains, and checkpoints hold only the adapters (``filter``: ``trainable``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_tiny import exit_now, exit_stopped  # a sibling: the script's own directory

SAMPLES, BATCH_SIZE, FEATURES, SEED = 48, 4, 6, 1234


class Samples(Dataset):
    """``SAMPLES`` samples that carry their id (so the data order can be compared)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 16), nn.Linear(16, 1)
    )


class Adapted(nn.Linear):
    """A Linear (its weight and bias load from the base file) plus a trainable low-rank
    update ``lora_B @ lora_A`` (LoRA)."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__(base.in_features, base.out_features)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_A.T) @ self.lora_B.T


def adapted(model: nn.Module, base: Path) -> nn.Module:
    """``model`` with an adapter beside every Linear, its weights from ``base`` (made from this
    model when missing), only the adapters trainable."""
    from lightning_bpk.fabric import load_raw
    from lightning_bpk.interop import save_module_record
    from lightning_bpk.records import ModuleRecord

    if not base.exists():
        save_module_record(ModuleRecord.from_module(model), base)
    model = nn.Sequential(*(Adapted(m) if isinstance(m, nn.Linear) else m for m in model))
    load_raw(base, model, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def make_fabric(strategy: str, devices: int) -> L.Fabric:
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        chosen: Any = ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=devices, tensor_parallel_size=1
        )
    else:
        chosen = "ddp" if strategy == "ddp" else "auto"
    return L.Fabric(accelerator="cpu", devices=devices, strategy=chosen)


def full_state(fabric: L.Fabric, model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors named by parameter (gathered from every rank: a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from lightning_bpk.fabric._compat import unwrap

    module, opt = unwrap(model), unwrap(optimizer)
    if fabric.world_size > 1:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(module, options=options)
        per_param = get_optimizer_state_dict(module, opt, options=options).get("state", {})
    else:
        weights = module.state_dict()
        per_param = {name: opt.state[p] for name, p in module.named_parameters() if p in opt.state}
    flat = {f"model.{k}": v.detach().clone() for k, v in weights.items()}
    for name, states in per_param.items():
        for key, value in states.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).detach().clone()
    return flat


def kill_in_save(number: int) -> None:
    """SIGKILL every rank once checkpoint ``number``'s data is published, before its sentinel."""
    from lightning_bpk.store.local import LocalStore

    original = LocalStore.publish

    def publish(self: LocalStore, staging: Any, prefix: str) -> None:
        original(self, staging, prefix)
        if prefix.partition("~")[0].endswith(f".{number}"):
            os.killpg(os.getpgrp(), signal.SIGKILL)

    LocalStore.publish = publish  # type: ignore[method-assign]


def fork_ranks(devices: int) -> list[int]:
    """Become rank 0 of ``devices`` processes: the others are forks of this one, each told its
    rank as an external launcher tells it (``LOCAL_RANK``; Fabric then launches nothing).
    Returns the children's pids (none in a child)."""
    if devices == 1:
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    torch.set_num_threads(1)  # one core per rank
    children = []
    for rank in range(1, devices):
        pid = os.fork()
        if pid == 0:
            os.environ["LOCAL_RANK"] = str(rank)
            return []
        children.append(pid)
    os.environ["LOCAL_RANK"] = "0"
    return children


def wait_for(children: list[int]) -> None:
    """Rank 0: the other ranks' exit; a failed one fails this process too."""
    failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
    if failed:
        sys.exit(f"rank processes {failed} failed")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--strategy", choices=("single", "ddp", "fsdp"), default="single")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--ids")
    parser.add_argument("--out")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--term-at-step", type=int)
    parser.add_argument("--term-rank", type=int, default=0)
    parser.add_argument("--restore-only", action="store_true")
    parser.add_argument("--lora", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    if args.kill_in_save is not None:
        kill_in_save(args.kill_in_save)
    children = fork_ranks(args.devices)
    stopped: SystemExit | None = None
    try:
        train(args)
    except SystemExit as stop:  # a preemption stop: its status, checkpoint flushed on every rank
        stopped = stop
    finally:
        wait_for(children)
    if stopped is not None:
        exit_stopped(stopped, args.devices)
        raise stopped
    exit_now()  # skip the interpreter teardown that gloo can abort or hang (see exit_now)


def train(args: argparse.Namespace) -> None:
    from lightning_bpk import burnpack
    from lightning_bpk.fabric import (
        CheckpointManager,
        ResumableLoader,
        trainable,
        trainable_parameters,
    )

    fabric = make_fabric(args.strategy, args.devices)
    fabric.launch()
    fabric.seed_everything(SEED)
    model = make_model()
    if args.lora is not None:
        model = adapted(model, args.lora)
    if args.strategy == "fsdp":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    else:
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=0.01)
        model, optimizer = fabric.setup(model, optimizer)
    save: dict[str, Any] = {}
    if args.lora is not None:
        save["filter"] = {"model": trainable(model)}
    loader = DataLoader(Samples(), batch_size=BATCH_SIZE, shuffle=True, num_workers=args.workers)
    data = ResumableLoader(fabric.setup_dataloaders(loader, move_to_device=False))
    manager = CheckpointManager(
        fabric, args.root, every_n_train_steps=args.every, async_save=args.async_save
    )
    state = {"model": model, "optimizer": optimizer, "data": data, "step": 0}
    restored = manager.restore(state)
    print(f"RESTORED {restored.step} rank={fabric.global_rank}", flush=True)
    ids = None if args.ids is None else open(f"{args.ids}.rank{fabric.global_rank}", "a")  # noqa: SIM115
    while state["step"] < args.steps and not args.restore_only:
        for ids_batch, x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            step = state["step"]
            if ids is not None:
                ids.write(f"{step} {' '.join(map(str, ids_batch.tolist()))}\n")
                ids.flush()
            manager.save_if_due(step, state, **save)
            if step == args.kill_at_step and fabric.global_rank == 0:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            if step == args.term_at_step and fabric.global_rank == args.term_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if step >= args.steps:
                break
    if not args.restore_only and manager.last_saved_step != state["step"]:
        manager.save(state["step"], state, **save)
    manager.close()
    weights = full_state(fabric, model, optimizer)
    if args.out and fabric.is_global_zero:
        burnpack.write(Path(args.out), weights)
    print(f"FINISHED step={state['step']} rank={fabric.global_rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
