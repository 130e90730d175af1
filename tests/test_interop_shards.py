"""load_into_shards: a full .bpk/.safetensors file straight into DTensor shards, each rank reading
only its own byte ranges, conversions included where they commute with the sharding.

The multi-rank case runs tests/scripts/shard_load.py (2 gloo CPU processes, FSDP2 and tensor
parallel, bytes read counted by the loader and by the kernel). The single-process cases look at
one rank of a larger mesh through torch's fake process group (no communication: the loader
needs none), with real DTensors and real files.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from test_interop_loading import Untraced
from test_records_module import module_from_names
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_bpk import burnpack
from lightning_bpk.interop import (
    Concatenate,
    Interleave,
    KeyRemapper,
    MergeModulelist,
    PermuteForRope,
    Rename,
    Split,
    Transpose,
    Unstack,
    WeightConverter,
    load_into_shards,
    load_remapped,
    save_module_record,
)
from lightning_bpk.interop._ranges import byte_runs
from lightning_bpk.interop.shards import _shard_box
from lightning_bpk.records import ModuleRecord, RecordChecksumError, RecordError

from conftest import SCRIPTS, run_process

# --- two real ranks ------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_two_ranks_fsdp2_and_tensor_parallel_read_only_their_shards(tmp_path):
    done = run_process(
        [sys.executable, SCRIPTS / "shard_load.py", "--root", tmp_path, "--world", 2],
        timeout=120,
        check=True,
    )
    for rank in range(2):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"OK rank={rank} "))
        # per load: bytes the kernel saw this rank read / bytes of every tensor in the file:
        # about half, or 2 and 1 of 3 experts
        for what, read, total in re.findall(r"(\S+)=(\d+)/(\d+)", line):
            share = 0.7 if what.startswith("fsdp-experts") else 0.55
            assert int(read) < share * int(total), (rank, what, read, total)
        assert len(re.findall(r"=(\d+)/(\d+)", line)) == 10, line
        assert "fsdp-experts-set=" in line and "fsdp-bpk-set=" in line


# --- the ranges ----------------------------------------------------------------------------------


def _chunked(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The oracle: torch.chunk per Shard, mesh dims in order (a rank past the last chunk gets
    an empty slice)."""
    out = full
    for n, c, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Shard):
            chunks = torch.chunk(out, n, placement.dim)
            out = chunks[c] if c < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((7, 5), (2,), [Shard(0)]),
        ((7, 5), (3,), [Shard(1)]),
        ((3, 5), (4,), [Shard(0)]),  # more ranks than rows: the last holds nothing
        ((5, 2), (4,), [Shard(0)]),  # ceil-sized chunks: 2, 2, 1, 0
        ((7, 5), (2,), [Replicate()]),
        ((9,), (2,), [Shard(0)]),
        ((7, 5, 3), (2, 3), [Shard(0), Shard(1)]),
        ((7, 5), (2, 2), [Shard(0), Shard(0)]),  # one dim cut twice
        ((7, 5), (2, 3), [Replicate(), Shard(1)]),  # HSDP-like
        ((7, 5), (3, 2), [Shard(1), Shard(0)]),
    ],
)
def test_shard_box_cuts_as_torch_chunk(shape, mesh_shape, placements):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for coordinate in torch.cartesian_prod(*(torch.arange(n) for n in mesh_shape)).reshape(
        -1, len(mesh_shape)
    ):
        coordinate = coordinate.tolist()
        box = _shard_box(shape, mesh_shape, coordinate, placements)
        got = full[tuple(slice(a, b) for a, b in box)]
        assert torch.equal(got, _chunked(full, mesh_shape, coordinate, placements)), coordinate


def test_shard_box_refuses_partial_and_strided():
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(ValueError, match="Partial"):
        _shard_box((4, 4), (2,), (0,), [Partial()])
    with pytest.raises(ValueError, match="is not Shard"):
        _shard_box((4, 4), (2, 2), (0, 0), [Shard(0), _StridedShard(0, split_factor=2)])


@pytest.mark.parametrize(
    ("box", "runs"),
    [
        (((0, 4), (0, 3), (0, 5)), 1),  # everything
        (((1, 3), (0, 3), (0, 5)), 1),  # Shard(0): one range
        (((0, 4), (1, 3), (0, 5)), 4),  # Shard(1): one per index of dim 0
        (((1, 3), (0, 3), (2, 4)), 6),  # last dim cut: one per row
        (((0, 4), (3, 3), (0, 5)), 0),  # empty
    ],
)
def test_byte_runs_cover_exactly_the_box(box, runs):
    full = torch.randn(4, 3, 5)
    raw = bytes(burnpack.tensor_bytes(full))
    found = list(byte_runs(full.shape, 4, box))
    assert len(found) == runs
    got = b"".join(raw[offset : offset + length] for offset, length in found)
    want = full[tuple(slice(a, b) for a, b in box)].contiguous()
    assert got == bytes(burnpack.tensor_bytes(want))


# --- one rank of a larger mesh -------------------------------------------------------------------


@contextmanager
def rank_of(mesh_shape: tuple[int, ...], rank: int) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a mesh of ``mesh_shape`` (torch's fake process group). The
    mesh dims are named after the rank: DTensor reuses a mesh equal to one it saw before, and
    meshes of different fake ranks would compare equal."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=len_of(mesh_shape))
    try:
        names = tuple(f"rank{rank}-{d}" for d in range(len(mesh_shape)))
        yield init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def len_of(mesh_shape: tuple[int, ...]) -> int:
    return torch.Size(mesh_shape).numel()


def sharded(shape, mesh: DeviceMesh, placements, dtype=torch.float32) -> nn.Parameter:
    """A DTensor parameter of global ``shape`` whose local shard is full of NaN."""
    local, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    tensor = DTensor.from_local(
        torch.full(local, float("nan"), dtype=dtype),
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape).stride(),
    )
    return nn.Parameter(tensor)


def module_of(params: dict[str, nn.Parameter]) -> nn.Module:
    net = module_from_names({n: () for n in params})
    for name, param in params.items():
        owner, _, leaf = name.rpartition(".")
        net.get_submodule(owner).register_parameter(leaf, param)
    return net


def expected(file: dict[str, torch.Tensor], remapper: KeyRemapper) -> dict[str, torch.Tensor]:
    """The module's full tensors: the rules run on the whole file."""
    return {
        n: t for n, (t, _) in remapper.load({n: (t, None) for n, t in file.items()}).tensors.items()
    }


def check_shards(net: nn.Module, full: dict[str, torch.Tensor]) -> int:
    local_bytes = 0
    for name, value in net.state_dict().items():
        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        want = full[name][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        assert torch.equal(value.to_local(), want), name
        local_bytes += want.numel() * want.element_size()
    return local_bytes


g = torch.Generator().manual_seed(3)
W = {  # per-expert tensors, as a Mixtral checkpoint has them
    **{f"experts.{e}.w1.weight": torch.randn(6, 8, generator=g) for e in range(3)},
    **{f"experts.{e}.w3.weight": torch.randn(6, 8, generator=g) for e in range(3)},
}
FUSE = WeightConverter(
    [".experts.*.w1.weight", ".experts.*.w3.weight"],
    ".experts.gate_up_proj",
    [MergeModulelist(dim=0), Concatenate(dim=1)],
)


@pytest.mark.parametrize("suffix", [".bpk", ".safetensors"])
def test_a_rank_reads_its_box_through_commuting_rules(tmp_path, suffix):
    """Rank 1 of (2, 2): experts fused (stacked on dim 0, concatenated on dim 1) into a tensor
    cut along its last dim, a transposed weight cut along rows (one range per row of the
    file's layout) and a renamed bias; it reads exactly its shards' bytes."""
    file = {"model.layer." + n: t for n, t in W.items()} | {
        "model.proj.weight": torch.randn(10, 12, generator=g),
        "model.proj.bias": torch.randn(7),
    }
    path = save_module_record(ModuleRecord(file), tmp_path / f"f{suffix}")
    remapper = KeyRemapper([Rename(r"^model\.", ""), Transpose(r"proj\.weight", 0, 1), FUSE])
    full = expected(file, remapper)
    with rank_of((2, 2), 1) as mesh:
        net = module_of(
            {
                "layer.experts.gate_up_proj": sharded((3, 12, 8), mesh, [Replicate(), Shard(2)]),
                "proj.weight": sharded((12, 10), mesh, [Shard(0), Shard(1)]),
                "proj.bias": sharded((7,), mesh, [Replicate(), Shard(0)]),
            }
        )
        done = load_into_shards(path, net, remapper)
        local_bytes = check_shards(net, full)
    assert done.unmatched == []
    assert done.bytes_read == local_bytes < sum(t.numel() * 4 for t in file.values()) / 2


@pytest.mark.parametrize(
    ("mesh_shape", "rank", "placements"),
    [
        ((2,), 0, [Shard(0)]),
        ((2,), 1, [Shard(0)]),
        ((2, 2), 3, [Shard(0), Shard(2)]),
    ],
)
def test_experts_stacked_along_the_sharded_dim_read_only_this_ranks(
    tmp_path, mesh_shape, rank, placements
):
    """FSDP2's default Shard(0) on fused experts: each rank reads and stacks only its own
    experts' tensors (3 experts on 2: ranks hold 2 and 1), listed under indices from 0."""
    file = {"model.layer." + n: t for n, t in W.items()}
    path = save_module_record(ModuleRecord(file), tmp_path / "moe.safetensors")
    remapper = KeyRemapper([Rename(r"^model\.", ""), FUSE])
    full = expected(file, remapper)
    with rank_of(mesh_shape, rank) as mesh:
        net = module_of({"layer.experts.gate_up_proj": sharded((3, 12, 8), mesh, placements)})
        done = load_into_shards(path, net, remapper)
        local_bytes = check_shards(net, full)
    experts = 1 if rank % 2 else 2  # 3 experts: 2 on the first rank of dim 0, 1 on the second
    assert done.bytes_read == local_bytes == experts * 2 * 6 * 8 * 4 // len_of(mesh_shape[1:])


@pytest.mark.parametrize(
    ("rule", "placement", "ok"),
    [
        (Split(r"(.+)\.qkv", [r"\1.q", r"\1.k"], dim=0), Shard(1), True),
        (Split(r"(.+)\.qkv", [r"\1.q", r"\1.k"], dim=0), Shard(0), False),
        (Unstack(r"(.+)\.qkv", r"\1.{i}", dim=0), Shard(0), True),  # each element's rows
        (WeightConverter("qkv", "q", [PermuteForRope(num_heads=2)]), Shard(1), True),
        (WeightConverter("qkv", "q", [PermuteForRope(num_heads=2)]), Shard(0), False),
        (WeightConverter("qkv", "q", [Interleave(dim=1)]), Shard(0), True),
        (WeightConverter("qkv", "q", [Interleave(dim=1)]), Shard(1), False),
        (Transpose(r".+qkv", 0, 1), Shard(0), True),
        (WeightConverter("qkv", "q", [MergeModulelist(dim=1)]), Shard(0), True),
    ],
)
def test_which_conversions_commute(tmp_path, rule, placement, ok):
    file = {"attn.qkv": torch.randn(8, 6, generator=g)}
    path = save_module_record(ModuleRecord(file), tmp_path / "f.bpk")
    remapper = KeyRemapper([rule])
    full = expected(file, remapper)
    with rank_of((3,), 2) as mesh:
        net = module_of({n: sharded(t.shape, mesh, [placement]) for n, t in full.items()})
        if ok:
            done = load_into_shards(path, net, remapper)
            assert done.bytes_read == check_shards(net, full)
            return
        with pytest.raises(RecordError) as info:
            load_into_shards(path, net, remapper)
        assert str(rule) in str(info.value) and repr(placement) in str(info.value)
        assert all(v.to_local().isnan().all() for v in net.state_dict().values())


def test_problems_reported_together_before_anything_is_read(tmp_path):
    """Missing, unused, mismatched, a dtype a shard cannot take, a fused tensor cut along its
    concatenation dim, an unknown rule on a sharded tensor, a shard not allocated: one error naming
    the file and each parameter, and not a shard written."""
    file = {"layer." + n: t for n, t in W.items()} | {
        "attn.w": torch.randn(4, 4),
        "wide": torch.randn(4, 5),
        "dbl": torch.randn(4, dtype=torch.float64),
        "extra": torch.randn(1),
        "meta": torch.randn(4),
    }
    path = save_module_record(ModuleRecord(file), tmp_path / "bad.safetensors")
    with rank_of((2,), 0) as mesh:
        net = module_of(
            {
                "layer.experts.gate_up_proj": sharded((3, 12, 8), mesh, [Shard(1)]),
                "attention.w": sharded((4, 4), mesh, [Shard(1)]),
                "wide": sharded((4, 6), mesh, [Shard(0)]),
                "dbl": sharded((4,), mesh, [Shard(0)]),
                "absent": sharded((2,), mesh, [Shard(0)]),
                "meta": nn.Parameter(
                    DTensor.from_local(torch.empty(2, device="meta"), mesh, [Shard(0)])
                ),
            }
        )
        with pytest.raises(RecordError) as info:
            load_into_shards(path, net, KeyRemapper([Untraced(), FUSE]))
        problems = info.value.problems
        assert all(p.startswith(str(path)) for p in problems), problems
        text = "\n".join(problems)
        for words in [
            ["Missing tensor: 'absent'"],
            ["Unused tensor: 'extra'"],
            ["'wide'", "shape mismatch"],
            ["'dbl'", "torch.float64", "cast_to_module"],
            ["'layer.experts.gate_up_proj'", "Concatenate(dim=1)", "Shard(dim=1)"],
            ["'attention.w'", "Untraced", "Shard(dim=1)"],
            ["'meta'", "meta device"],
        ]:
            assert any(all(w in p for w in words) for p in problems), (words, text)
        assert all(v.to_local().isnan().all() for n, v in net.state_dict().items() if n != "meta")
        # cast_to_module takes the float64 file into the float32 shard
        fine = module_of({"dbl": sharded((4,), mesh, [Shard(0)])})
        load_into_shards(path, fine, allow_unused=True, dtype_policy="cast_to_module")
        assert torch.equal(fine.dbl.to_local(), file["dbl"][:2].float())


def test_plain_tensors_load_as_load_remapped(tmp_path):
    source = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    for suffix in (".bpk", ".safetensors"):
        path = save_module_record(ModuleRecord.from_module(source), tmp_path / f"m{suffix}")
        a, b = (
            nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
            nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
        )
        done = load_into_shards(path, a)
        load_remapped(path, b)
        assert all(
            torch.equal(x, y)
            for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        )
        assert done.bytes_read == sum(t.numel() * 4 for t in source.state_dict().values())


def test_verify_checks_whole_tensors_and_torch_files_are_refused(tmp_path):
    """A slice cannot be checked against a whole tensor's checksum: without verify a damaged
    byte in the rank's slice loads; verify=True reads each tensor whole first and refuses it,
    changing nothing."""
    full = torch.arange(16.0).reshape(4, 4)
    path = ModuleRecord({"w": full}).save(tmp_path / "m.bpk")
    with burnpack.read(path) as pack:
        offset = pack.data_start + pack.entries["w"].data_offsets[0]
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0x40  # in row 0: rank 0's shard of Shard(0)
    path.write_bytes(bytes(data))
    with rank_of((2,), 0) as mesh:
        net = module_of({"w": sharded((4, 4), mesh, [Shard(0)])})
        with pytest.raises(RecordChecksumError, match="'w' fails its checksum"):
            load_into_shards(path, net, verify=True)
        assert net.w.to_local().isnan().all()
        assert load_into_shards(path, net).bytes_read == 2 * 4 * 4
        assert not torch.equal(net.w.to_local(), full[:2])  # the damage, undetected
    torch.save({"w": full}, tmp_path / "m.pt")
    with pytest.raises(RecordError, match="cannot be read in byte ranges"):
        load_into_shards(tmp_path / "m.pt", nn.Linear(4, 4))


def test_load_remapped_points_sharded_modules_here(tmp_path):
    """load_remapped refuses DTensor targets before writing anything (it used to fail in
    torch's copy, after other tensors were already loaded)."""
    path = save_module_record(
        ModuleRecord({"a": torch.ones(2), "w": torch.ones(4)}), tmp_path / "m.bpk"
    )
    with rank_of((2,), 0) as mesh:
        net = module_of({"a": nn.Parameter(torch.zeros(2)), "w": sharded((4,), mesh, [Shard(0)])})
        with pytest.raises(RecordError, match="'w' is a DTensor shard: load with load_into_shards"):
            load_remapped(path, net)
        assert torch.equal(net.a, torch.zeros(2))


def test_tied_shards_read_once(tmp_path):
    """A tied parameter (an embedding and an output head sharing one sharded weight) is saved
    once with an alias, and read once, into the shared shard."""
    weight = torch.randn(6, 4, generator=g)
    source = ModuleRecord({"embed.weight": weight}, aliases={"head.weight": "embed.weight"})
    for suffix in (".bpk", ".safetensors"):
        path = save_module_record(source, tmp_path / f"tied{suffix}")
        with rank_of((2,), 1) as mesh:
            shared = sharded((6, 4), mesh, [Shard(0)])
            net = module_of({"embed.weight": shared})
            net.add_module("head", nn.Module())
            net.head.weight = shared
            assert load_into_shards(path, net).bytes_read == 3 * 4 * 4
            assert torch.equal(shared.to_local(), weight[3:])
