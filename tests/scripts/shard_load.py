"""lightning_bpk.interop.load_into_shards on W gloo CPU processes.

Run by tests/test_interop_shards.py as a standalone script (a timeout kills the whole process
group). Writes a model's full state once as ``.bpk`` and ``.safetensors`` (and a converted
layout), then on every rank:

- an FSDP2 model (``fully_shard``, uneven ``Shard(0)``, and ``Shard(1)`` through
  ``shard_placement_fn``) and a tensor-parallel one
  (``ColwiseParallel``: ``Shard(0)``; ``RowwiseParallel``: ``Shard(1)`` weight, replicated bias)
  load each file; every local shard must equal the slice of the full tensor torch assigns to
  the rank, and the rank must have read about its shards' bytes, not the whole file: the
  loader's own count must equal the local shards' bytes, and the kernel's count of bytes this
  process read (``rchar`` of ``/proc/self/io``, the smaller of two loads: a module imported
  on first use reads its file once) must be within a few pages of it; the FSDP2 models must
  compute what the full model computes;
- 3 experts' separate ``w1``/``w3`` fused into one ``gate_up_proj`` (Mixtral's
  ``MergeModulelist(0)``, ``Concatenate(1)``) sharded by FSDP2 along the experts: each rank
  reads only its experts' tensors;
- the experts as a checkpoint set (one expert matrix a shard: a converter's sources in six
  files), and the full model as a set of ``.bpk`` shards: the same slices and reads;
- a converted layout (a prefix renamed, a weight stored transposed, one stored as two halves
  concatenated along dim 1) loads shard by shard into the FSDP2 model, and is refused for the
  tensor-parallel model (its ``Shard(1)`` weight is cut along the concatenation dim), with an
  error naming the rule, the parameter and its placement, before anything is loaded.

Prints ``OK rank=<r> ...`` per rank on success; any mismatch raises (non-zero exit status).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import launch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_bpk.interop import (
    Concatenate,
    KeyRemapper,
    MergeModulelist,
    Rename,
    Transpose,
    WeightConverter,
    load_into_shards,
    save_module_record,
    write_set,
)
from lightning_bpk.interop.formats import Content
from lightning_bpk.records import ModuleRecord, RecordError

TIMEOUT = timedelta(seconds=60)
IN, OUT = 256, 383  # 383 rows: uneven on 2 and 3 ranks
SLACK = 64 * 1024  # the file's header and the kernel's rounding, far below a shard's bytes
CONVERTED = KeyRemapper(
    [
        Rename(r"^model\.", ""),
        Transpose(r"up\.weight", 0, 1),
        WeightConverter(["down_a.weight", "down_b.weight"], "down.weight", [Concatenate(dim=1)]),
    ]
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, OUT)
        self.down = nn.Linear(OUT, IN)


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: t.detach().clone() for n, t in Net().state_dict().items()}


EXPERTS = KeyRemapper(
    [
        Rename(r"^model\.", ""),
        WeightConverter(
            [".experts.*.w1.weight", ".experts.*.w3.weight"],
            ".experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
    ]
)


def experts_file() -> dict[str, torch.Tensor]:
    """3 experts' separate w1/w3, as a Mixtral checkpoint stores them."""
    g = torch.Generator().manual_seed(2)
    return {
        f"model.moe.experts.{e}.w{w}.weight": torch.randn(64, IN, generator=g)
        for e in range(3)
        for w in (1, 3)
    }


def fused_experts(mesh) -> nn.Module:
    """The fused layout ([experts, 2 x 64, IN]), FSDP2 sharding the experts: 2 and 1 on 2."""
    net = nn.Module()
    net.moe = nn.Module()
    net.moe.experts = nn.Module()
    net.moe.experts.gate_up_proj = nn.Parameter(torch.zeros(3, 128, IN))
    return fully_shard(net, mesh=mesh)


def write_files(root: Path) -> None:
    full = reference()
    save_module_record(ModuleRecord(full), root / "full.bpk")
    save_module_record(ModuleRecord(full), root / "full.safetensors")
    down = full["down.weight"]
    converted = {
        "model.up.weight": full["up.weight"].t().contiguous(),
        "model.up.bias": full["up.bias"],
        "model.down_a.weight": down[:, :100].contiguous(),
        "model.down_b.weight": down[:, 100:].contiguous(),
        "model.down.bias": full["down.bias"],
    }
    save_module_record(ModuleRecord(converted), root / "converted.safetensors")
    save_module_record(ModuleRecord(experts_file()), root / "experts.safetensors")
    # the same as checkpoint sets: one expert matrix a shard (a converter's sources over 6
    # files), and the full model as .bpk shards
    experts = experts_file()
    write_set(Content(experts), root / "experts-set", max_shard_size=64 * IN * 4)
    write_set(Content(full), root / "full-set", max_shard_size=OUT * IN * 4, suffix=".bpk")


def fsdp(mesh, dim: int = 0) -> nn.Module:
    """FSDP2 sharding each weight along ``dim`` where it is even (FSDP2 cuts dims other than 0
    evenly only), else along dim 0 (uneven: 383 rows)."""
    torch.manual_seed(1)  # other values than the files': everything must come from them
    net = Net()

    def placement(p: nn.Parameter) -> Shard:
        return Shard(dim if p.dim() > dim and p.shape[dim] % mesh.size() == 0 else 0)

    fully_shard(net.up, mesh=mesh, shard_placement_fn=placement)
    fully_shard(net.down, mesh=mesh, shard_placement_fn=placement)
    return fully_shard(net, mesh=mesh)


def fsdp_dim1(mesh) -> nn.Module:
    return fsdp(mesh, dim=1)


def tensor_parallel(mesh) -> nn.Module:
    torch.manual_seed(1)
    return parallelize_module(Net(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def rchar() -> int:
    """Bytes this process has read through read()/pread() calls, as the kernel counts them."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def local_slices(tensor: DTensor) -> tuple[slice, ...]:
    """torch's own account of which part of the full tensor this rank holds."""
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def check(net: nn.Module, what: str, full: dict[str, torch.Tensor]) -> int:
    """Every local shard equals its slice of the full tensor; returns the local bytes."""
    local_bytes = 0
    for name, value in net.state_dict().items():
        assert isinstance(value, DTensor), (what, name)
        local = value.to_local()
        want = full[name][local_slices(value)]
        assert torch.equal(local, want), f"{what}: {name} differs from its slice"
        local_bytes += local.numel() * local.element_size()
    return local_bytes


def load(
    path: Path,
    net: nn.Module,
    remapper: KeyRemapper | None,
    what: str,
    full: dict[str, torch.Tensor] | None = None,
) -> str:
    """Load twice: the loader's reads happen both times, a one-off read of the process (a
    module imported on first use) at most once, so the smaller count is the loader's."""
    full = reference() if full is None else full
    dist.barrier()
    counts = []
    for _ in range(2):
        before = rchar()
        done = load_into_shards(path, net, remapper, workers=2)
        counts.append(rchar() - before)
    kernel = min(counts)
    local = check(net, what, full)
    if isinstance(net, Net) and what.startswith(
        "fsdp"
    ):  # FSDP2 computes with what it loaded (TP: 383 is uneven)
        x = torch.linspace(-1, 1, 3 * IN).reshape(3, IN)
        plain = Net()
        plain.load_state_dict(reference())
        with torch.no_grad():
            assert torch.allclose(net.down(net.up(x)), plain.down(plain.up(x)), atol=1e-5), what
    file_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert done.bytes_read == local, (what, done.bytes_read, local)
    assert local <= kernel <= local + SLACK, (what, counts, local)
    assert kernel < 0.7 * file_bytes, (what, kernel, file_bytes)  # at most 2 of 3 experts
    return f"{what}={kernel}/{file_bytes}"


def refused(path: Path, net: nn.Module, remapper: KeyRemapper, words: list[str]) -> None:
    before = {n: v.to_local().clone() for n, v in net.state_dict().items()}
    try:
        load_into_shards(path, net, remapper)
    except RecordError as e:
        for word in words:
            assert word in str(e), (word, str(e))
    else:
        raise AssertionError(f"{path} loaded into {words}")
    assert all(torch.equal(v.to_local(), before[n]) for n, v in net.state_dict().items())


def worker(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        root_path = Path(root)
        if rank == 0:  # here, not before the fork: torch's thread pool does not survive one
            write_files(root_path)
        dist.barrier()
        mesh = init_device_mesh("cpu", (world,))
        report = []
        for maker in (fsdp, fsdp_dim1, tensor_parallel):
            for suffix in ("bpk", "safetensors"):
                what = f"{maker.__name__}-{suffix}"
                report.append(load(root_path / f"full.{suffix}", maker(mesh), None, what))
        converted = root_path / "converted.safetensors"
        report.append(load(converted, fsdp(mesh), CONVERTED, "fsdp-converted"))
        fused = {
            n: t
            for n, (t, _) in EXPERTS.load(
                {n: (t, None) for n, t in experts_file().items()}
            ).tensors.items()
        }
        experts = root_path / "experts.safetensors"
        report.append(load(experts, fused_experts(mesh), EXPERTS, "fsdp-experts", fused))
        index = root_path / "experts-set" / "model.safetensors.index.json"
        report.append(load(index, fused_experts(mesh), EXPERTS, "fsdp-experts-set", fused))
        report.append(load(root_path / "full-set", fsdp(mesh), None, "fsdp-bpk-set"))
        refused(
            converted,
            tensor_parallel(mesh),
            CONVERTED,
            ["converted.safetensors", "Concatenate(dim=1)", "'down.weight'", "Shard(dim=1)"],
        )
        dist.barrier()
        # one write of the whole line (under PIPE_BUF: atomic), so ranks' lines never interleave
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"OK rank={rank} {' '.join(report)}\n".encode())
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    launch(worker, args.world, args.root)


if __name__ == "__main__":
    sys.exit(main())
