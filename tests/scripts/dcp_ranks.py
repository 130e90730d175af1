"""Raw torch.distributed.checkpoint through lightning_bpk.dcp on W gloo CPU processes.

Run by tests/test_dcp.py as a standalone script (process group per run, killed as a group on a
timeout). Scenarios:

- ``save``: DTensors of one full tensor in every 1-D layout (replicated, sharded along dim 0,
  along dim 1), an FSDP2 model + Adam state after two steps and a tensor-parallel model
  (``ColwiseParallel``/``RowwiseParallel``), each saved through ``BurnpackStorageWriter``;
  rank 0 also writes the gathered full state dicts (the references).
- ``load``: loads every saved layout into every layout, the FSDP2 state into a freshly
  initialised FSDP2 model and the tensor-parallel one into both a tensor-parallel and an FSDP2
  model, on this world size; the gathered results must equal the references.
- ``faults``: a failure injected in each writer/reader method on each rank fails the call on
  every rank, commits nothing, and the directory's earlier checkpoint still loads.
- ``s3``: an FSDP2 model + Adam state saved by every rank to the object-store URL in
  ``$DCP_URL`` (``fsdp/``; rank 0 writes the gathered reference ``s3-reference.bpk``); a failing
  upload on rank 1 fails a second save (``failed/``) on every rank and commits nothing, and a
  save into the committed URL is refused on every rank.

Prints ``OK rank=<r>`` per rank on success; any mismatch raises (non-zero exit status).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import launch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_bpk import burnpack
from lightning_bpk.dcp import BurnpackStorageReader, BurnpackStorageWriter, is_sharded
from lightning_bpk.errors import StorageError
from lightning_bpk.store import ObjectStore

LAYOUTS = {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}
FULL = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10) / 3  # 7 rows: uneven on 2, 3
TIMEOUT = timedelta(seconds=60)  # bounded collectives: a stuck rank fails, never hangs


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3))


def fsdp(seed: int, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = model(seed)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def tensor_parallel(seed: int, mesh) -> nn.Module:
    """Megatron-style: the first Linear split by output rows, the second by input columns."""
    return parallelize_module(model(seed), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def full_model(net: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))


def full_state(net: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Gathered, flattened model + optimizer tensors (the reference a load must reproduce)."""
    options = StateDictOptions(full_state_dict=True)
    flat = {f"model.{k}": v for k, v in get_model_state_dict(net, options=options).items()}
    osd = get_optimizer_state_dict(net, optim, options=options)
    for fqn, states in osd["state"].items():
        for key, value in states.items():
            flat[f"optim.{fqn}.{key}"] = value
    flat["optim.lr"] = torch.tensor([g["lr"] for g in osd["param_groups"]])
    return flat


def app_state(net: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, optim)}


def scenario_save(root: Path, rank: int, world: int, mesh) -> None:
    for name, placement in LAYOUTS.items():
        tensor = distribute_tensor(FULL.clone(), mesh, [placement])
        dcp.save({"t": tensor}, storage_writer=BurnpackStorageWriter(root / f"dt-{name}"))
    net, optim = fsdp(0, mesh)
    for step in range(2):
        torch.manual_seed(100 + step)  # the same batch on every rank
        net(torch.randn(4, 6)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    dcp.save(app_state(net, optim), storage_writer=BurnpackStorageWriter(root / "fsdp"))
    reference = full_state(net, optim)
    if rank == 0:
        burnpack.write(root / "reference.bpk", reference)
    tp = tensor_parallel(2, mesh)
    dcp.save({"model": get_model_state_dict(tp)}, storage_writer=BurnpackStorageWriter(root / "tp"))
    tp_reference = full_model(tp)
    if rank == 0:
        burnpack.write(root / "tp-reference.bpk", tp_reference)


def scenario_load(root: Path, rank: int, world: int, mesh) -> None:
    for saved in LAYOUTS:
        for name, placement in LAYOUTS.items():
            target = distribute_tensor(torch.zeros_like(FULL), mesh, [placement])
            dcp.load({"t": target}, storage_reader=BurnpackStorageReader(root / f"dt-{saved}"))
            assert torch.equal(target.full_tensor(), FULL), f"{saved} -> {name}"
    net, optim = fsdp(1, mesh)  # other initial values: everything must come from the files
    state = app_state(net, optim)
    dcp.load(state, storage_reader=BurnpackStorageReader(root / "fsdp"))
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, optim, state["optim"])
    got = full_state(net, optim)
    with burnpack.read(root / "reference.bpk") as pack:
        want = pack.tensors()
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for key, value in want.items():
            assert torch.equal(got[key].to(value.dtype), value), key
    assert isinstance(state["model"]["0.weight"], DTensor)
    # tensor parallel (Shard(0) / Shard(1) weights) into tensor parallel and into FSDP2
    with burnpack.read(root / "tp-reference.bpk") as pack:
        want = pack.tensors()
    for net in (tensor_parallel(3, mesh), fsdp(3, mesh)[0]):
        target = {"model": get_model_state_dict(net)}
        dcp.load(target, storage_reader=BurnpackStorageReader(root / "tp"))
        set_model_state_dict(net, target["model"])
        got = full_model(net)
        for key, value in want.items():
            assert torch.equal(got[key], value), key


class Fault(Exception):
    """The injected failure."""


def faulty(cls: type, method: str, rank: int):
    """A writer/reader that fails in ``method`` on ``rank`` (torch's FaultyStorageWriter idea)."""

    def broken(self, *args, **kwargs):
        if dist.get_rank() == rank:
            if method == "write_file":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            raise Fault(f"{method} on rank {rank}")
        return getattr(cls, method)(self, *args, **kwargs)

    return type(f"Faulty{cls.__name__}", (cls,), {method: broken})


@contextlib.contextmanager
def failing_upload(rank: int):
    """Every upload of this process fails as the store's retries giving up would, on ``rank``."""
    original = ObjectStore.upload

    def upload(self, local, key):
        if dist.get_rank() == rank:
            raise StorageError(f"upload to {self.url_of(key)}: ConnectionError: injected")
        return original(self, local, key)

    ObjectStore.upload = upload
    try:
        yield
    finally:
        ObjectStore.upload = original


WRITER_FAULTS = [
    ("set_up_storage_writer", None),
    ("prepare_local_plan", None),
    ("prepare_global_plan", 0),  # coordinator only
    ("write_data", None),
    ("write_file", None),  # the disk fills up in the middle of a rank's write
    ("finish", 0),
]
READER_FAULTS = [
    ("read_metadata", None),
    ("set_up_storage_reader", None),
    ("prepare_local_plan", None),
    ("prepare_global_plan", 0),
    ("read_data", None),
]


def expect_failure(call, what: str) -> None:
    try:
        call()
    except CheckpointException:  # on every rank (a BaseException in torch)
        return
    raise AssertionError(f"{what}: no error on rank {dist.get_rank()}")


def scenario_faults(root: Path, rank: int, world: int, mesh) -> None:
    root = root / "faults"
    good = root / "good"
    original = distribute_tensor(FULL.clone(), mesh, [Shard(0)])
    dcp.save({"t": original}, storage_writer=BurnpackStorageWriter(good))
    before = sorted(os.listdir(good))
    other = distribute_tensor(FULL.clone() + 1, mesh, [Shard(1)])
    for method, only in WRITER_FAULTS:
        for bad in [only] if only is not None else range(world):
            what = f"writer {method} on rank {bad}"
            writer = faulty(BurnpackStorageWriter, method, bad)
            fresh = root / f"fresh-{method}-{bad}"
            for directory in (good, fresh):
                expect_failure(
                    lambda d=directory, w=writer: dcp.save({"t": other}, storage_writer=w(d)), what
                )
            dist.barrier()
            assert not is_sharded(fresh), f"{what}: committed a fresh checkpoint"
            target = distribute_tensor(torch.zeros_like(FULL), mesh, [Replicate()])
            dcp.load({"t": target}, storage_reader=BurnpackStorageReader(good))
            assert torch.equal(target.full_tensor(), FULL), f"{what}: earlier checkpoint changed"
            dist.barrier()
    for method, only in READER_FAULTS:
        for bad in [only] if only is not None else range(world):
            reader = faulty(BurnpackStorageReader, method, bad)
            target = distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)])
            what = f"reader {method} on rank {bad}"
            expect_failure(
                lambda t=target, r=reader: dcp.load({"t": t}, storage_reader=r(good)), what
            )
    # a successful save into the same directory replaces it and sweeps the failed saves' files
    dcp.save({"t": other}, storage_writer=BurnpackStorageWriter(good))
    dist.barrier()
    assert len(os.listdir(good)) == len(before), (before, os.listdir(good))


def scenario_s3(root: Path, rank: int, world: int, mesh) -> None:
    url = os.environ["DCP_URL"]
    net, optim = fsdp(0, mesh)
    torch.manual_seed(100)  # the same batch on every rank
    net(torch.randn(4, 6)).pow(2).sum().backward()
    optim.step()
    dcp.save(app_state(net, optim), storage_writer=BurnpackStorageWriter(f"{url}/fsdp"))
    reference = full_state(net, optim)
    if rank == 0:
        burnpack.write(root / "s3-reference.bpk", reference)
    with failing_upload(rank=1):  # inside the store, after its retries: as a dead network
        expect_failure(
            lambda: dcp.save(
                app_state(net, optim), storage_writer=BurnpackStorageWriter(f"{url}/failed")
            ),
            "an upload failing on rank 1",
        )
    writer = BurnpackStorageWriter(f"{url}/fsdp")
    expect_failure(
        lambda: dcp.save(app_state(net, optim), storage_writer=writer),
        "a second save into a committed URL",
    )
    dist.barrier()
    assert not is_sharded(f"{url}/failed"), "a failed save committed"


def worker(rank: int, world: int, port: int, scenarios: str, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        for scenario in scenarios.split(","):  # one process group for several: fewer launches
            globals()[f"scenario_{scenario}"](Path(root), rank, world, mesh)
        dist.barrier()
        print(f"OK rank={rank}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", help="comma-separated: save, load, faults, s3")
    parser.add_argument("--root", required=True)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    launch(worker, args.world, args.scenarios, args.root)


if __name__ == "__main__":
    sys.exit(main())
