"""ModuleRecord: Burn's load semantics, param ids, tied weights, buffers, files, Burn's file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bpk import burnpack
from lightning_bpk.records import (
    ModuleRecord,
    RecordChecksumError,
    RecordError,
    StateRecord,
    default_param_id,
    load_record,
    param_ids,
)

from conftest import MNIST_BPK, ROOT, run_process

MNIST = MNIST_BPK


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(8, 3)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def randomize(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen))
            else:
                t.fill_(int(torch.randint(0, 100, (), generator=gen)))
    return module


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_names_order_dtypes_and_buffers() -> None:
    net = Net()
    record = ModuleRecord.from_module(net)
    assert list(record.tensors) == list(net.state_dict())  # registration order
    assert record.tensors["bn.num_batches_tracked"].dtype == torch.int64
    # parameters carry ids, buffers do not
    assert set(record.param_ids) == {n for n, _ in net.named_parameters()}
    with burnpack.loads(record.to_bytes()) as pack:
        assert pack.entries["bn.num_batches_tracked"].dtype == "I64"
        assert pack.entries["bn.running_mean"].param_id is None
        assert pack.entries["fc.weight"].param_id == default_param_id("fc.weight")
        data_order = sorted(pack.names, key=lambda n: pack.entries[n].data_offsets)
        assert data_order == list(net.state_dict())


def test_bytes_round_trip_strict_load() -> None:
    src = randomize(Net(), 1)
    src.bn.num_batches_tracked.fill_(7)
    dst = ModuleRecord.from_bytes(ModuleRecord.from_module(src).to_bytes()).apply(Net())
    assert_same_state(src, dst)
    assert dst.bn.num_batches_tracked.item() == 7


def test_file_round_trip_adds_suffix_and_load_record(tmp_path: Path) -> None:
    src = randomize(Net(), 2)
    path = ModuleRecord.from_module(src).save(tmp_path / "model")
    assert path == tmp_path / "model.bpk" and path.exists() and not (tmp_path / "model").exists()
    assert_same_state(src, ModuleRecord.load(tmp_path / "model").apply(Net()))
    assert isinstance(load_record(path), ModuleRecord)


def test_loaded_tensors_are_views_on_the_bytes() -> None:
    data = bytearray(ModuleRecord({"w": torch.zeros(4)}).to_bytes())
    record = ModuleRecord.from_bytes(data)
    pack = burnpack.loads(bytes(data))
    offset = pack.data_start + pack.entries["w"].data_offsets[0]
    data[offset : offset + 4] = torch.tensor([1.5]).numpy().tobytes()
    assert record.tensors["w"][0].item() == 1.5


def test_apply_copies_out_of_the_record_and_keeps_parameter_identity() -> None:
    record = ModuleRecord.from_bytes(ModuleRecord.from_module(randomize(Net(), 3)).to_bytes())
    net = Net()
    weight = net.fc.weight
    record.apply(net)
    assert net.fc.weight is weight
    assert net.fc.weight.data_ptr() != record.tensors["fc.weight"].data_ptr()
    net.fc.weight.data.add_(1)  # the module owns its memory: the record is unchanged
    assert not torch.equal(net.fc.weight, record.tensors["fc.weight"])


def test_param_ids_follow_the_record_across_reload() -> None:
    src = Net()
    ids = {n: 1000 + i for i, (n, _) in enumerate(src.named_parameters())}
    record = ModuleRecord.from_module(src)
    record.param_ids = ids
    dst = ModuleRecord.from_bytes(record.to_bytes()).apply(Net())
    assert param_ids(dst) == ids
    # a record of the loaded module writes the loaded ids back
    assert ModuleRecord.from_module(dst).param_ids == ids


def test_default_ids_are_stable_across_processes() -> None:
    code = (
        "import torch; from lightning_bpk.records import param_ids; "
        "print(param_ids(torch.nn.Linear(2, 2))['weight'])"
    )
    out = run_process([sys.executable, "-c", code], cwd=ROOT, check=True).stdout
    assert int(out) == param_ids(nn.Linear(2, 2))["weight"] == default_param_id("weight")
    assert 0 <= int(out) < 2**64


def test_shape_missing_unused_are_reported_together_sorted() -> None:
    record = ModuleRecord.from_module(Net())
    record.tensors["fc.weight"] = torch.zeros(3, 9)
    del record.tensors["fc.bias"]
    record.tensors["extra"] = torch.zeros(1)
    record.tensors["another"] = torch.zeros(1)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(RecordError) as info:
        record.apply(net)
    err = info.value
    assert err.kind == "validation"
    assert err.problems == [
        "Apply error: 'fc.weight': shape mismatch, expected [3, 8] but record has [3, 9]",
        "Missing tensor: 'fc.bias'",
        "Unused tensor: 'another'",
        "Unused tensor: 'extra'",
    ]
    assert str(err).startswith("Record validation error: Apply error")
    # nothing was changed by the failed load
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_flags_relax_each_check() -> None:
    src = randomize(Net(), 4)
    record = ModuleRecord.from_module(src)
    record.tensors["fc.weight"] = torch.zeros(3, 9)
    del record.tensors["fc.bias"]
    record.tensors["extra"] = torch.zeros(1)
    with pytest.raises(RecordError, match="Missing") as info:
        record.apply(Net(), validate=False, allow_unused=True)
    assert len(info.value.problems) == 1
    with pytest.raises(RecordError, match="Unused"):
        record.apply(Net(), validate=False, allow_partial=True)
    with pytest.raises(RecordError, match="shape mismatch"):
        record.apply(Net(), allow_partial=True, allow_unused=True)
    net = Net()
    fc_before = net.fc.weight.clone()
    skipped = "skipped 1 shape mismatches.*'fc.weight': shape mismatch, expected \\[3, 8\\]"
    with pytest.warns(UserWarning, match=skipped):  # skipped, never silently
        record.apply(net, validate=False, allow_partial=True, allow_unused=True)
    assert torch.equal(net.fc.weight, fc_before)  # mismatched entry skipped
    assert torch.equal(net.conv.weight, src.conv.weight)


def test_dtype_policies() -> None:
    src = Net().double()
    randomize(src, 5)
    record = ModuleRecord.from_bytes(ModuleRecord.from_module(src).to_bytes())
    net = Net()
    weight = net.fc.weight
    record.apply(net)  # from_record: the module takes float64
    assert net.fc.weight.dtype == torch.float64 and net.fc.weight is weight
    assert net.bn.running_mean.dtype == torch.float64
    assert torch.equal(net.fc.weight, src.fc.weight)
    net = record.apply(Net(), dtype_policy="cast_to_module")
    assert net.fc.weight.dtype == torch.float32
    assert torch.equal(net.fc.weight, src.fc.weight.float())
    with pytest.raises(ValueError, match="dtype_policy"):
        record.apply(Net(), dtype_policy="nope")
    ints = ModuleRecord({"weight": torch.ones(3, 2, dtype=torch.int32), "bias": torch.ones(3)})
    with pytest.raises(RecordError, match="cannot hold a trainable parameter"):
        ints.apply(nn.Linear(2, 3))
    assert ints.apply(nn.Linear(2, 3), dtype_policy="cast_to_module").weight.dtype == torch.float32


def test_reordered_parameters_match_by_name() -> None:
    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 3)
            self.bn = nn.BatchNorm2d(2)
            self.conv = nn.Conv2d(1, 2, 3)

    src = randomize(Net(), 6)
    dst = ModuleRecord.from_module(src).apply(Reordered())
    for name, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], value)


def test_tied_weights_stored_once_and_loaded_into_both() -> None:
    src = randomize(Tied(), 7)
    record = ModuleRecord.from_module(src)
    assert list(record.tensors) == ["embed.weight"]
    assert record.aliases == {"head.weight": "embed.weight"}
    data = record.to_bytes()
    with burnpack.loads(data) as pack:  # a Burn reader sees the first name
        assert pack.names == ["embed.weight"]
    dst = ModuleRecord.from_bytes(data).apply(Tied())
    assert dst.head.weight is dst.embed.weight
    assert torch.equal(dst.head.weight, src.embed.weight)

    class Untied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)

    untied = ModuleRecord.from_bytes(data).apply(Untied())
    assert torch.equal(untied.head.weight, src.embed.weight)
    assert torch.equal(untied.embed.weight, src.embed.weight)
    assert param_ids(untied)["head.weight"] == param_ids(src)["embed.weight"]


def test_dangling_alias_is_rejected() -> None:
    with pytest.raises(RecordError, match="alias 'b' -> 'a'"):
        ModuleRecord({}, aliases={"b": "a"})


class Transposing:
    """A toy adapter: Linear weights stored transposed under Burn-like names."""

    def from_module(self, name: str, tensor: torch.Tensor, layer: nn.Module | None):
        if isinstance(layer, nn.Linear) and name.endswith("weight"):
            return name.replace("weight", "w_t"), tensor.t()
        return name, tensor

    def to_module(self, name: str, tensor: torch.Tensor, layer: nn.Module | None):
        if isinstance(layer, nn.Linear) and name.endswith("w_t"):
            return name.replace("w_t", "weight"), tensor.t()
        return name, tensor


def test_adapter_hooks_rename_and_transform() -> None:
    src = randomize(Net(), 8)
    record = ModuleRecord.from_module(src, adapter=Transposing())
    assert "fc.w_t" in record.tensors and record.tensors["fc.w_t"].shape == (8, 3)
    loaded = ModuleRecord.from_bytes(record.to_bytes())
    with pytest.raises(RecordError, match=r"Unused tensor: 'fc\.w_t'"):
        loaded.apply(Net())
    dst = loaded.apply(Net(), adapter=Transposing())
    assert_same_state(src, dst)


def test_non_tensor_state_and_unsupported_dtype_are_named() -> None:
    class Extra(nn.Linear):
        def get_extra_state(self) -> object:
            return {"v": 1}

        def set_extra_state(self, state: object) -> None:
            pass

    with pytest.raises(RecordError, match="'_extra_state': dict is not a tensor"):
        ModuleRecord.from_module(Extra(1, 1))
    net = nn.Module()
    net.register_buffer("z", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(RecordError, match=r"'z'.*complex64"):
        ModuleRecord.from_module(net)


def test_wrong_kind_and_damaged_files(tmp_path: Path) -> None:
    path = StateRecord({"a": 1}).save(tmp_path / "state")
    with pytest.raises(RecordError) as info:
        ModuleRecord.load(path)
    assert info.value.kind == "validation" and "'state' record, not 'module'" in str(info.value)
    good = ModuleRecord.from_module(Net()).save(tmp_path / "m.bpk")
    data = bytearray(good.read_bytes())
    data[-1] ^= 0xFF  # flip a bit inside the last tensor
    bad = tmp_path / "bad.bpk"
    bad.write_bytes(bytes(data))
    with pytest.raises(RecordChecksumError) as info:
        ModuleRecord.load(bad)
    # a damaged tensor stays a checksum failure through the record layer, not an I/O error
    assert info.value.kind == "checksum" and "checksum" in str(info.value)
    assert isinstance(info.value, burnpack.ChecksumError)
    assert not isinstance(info.value, burnpack.BurnpackIOError)
    (tmp_path / "trunc.bpk").write_bytes(bytes(data[:300]))
    with pytest.raises(RecordError) as info:
        ModuleRecord.load(tmp_path / "trunc.bpk")
    assert info.value.kind == "io"
    with pytest.raises(RecordError) as info:
        ModuleRecord.load(tmp_path / "absent.bpk")
    assert info.value.kind == "io"


def test_quantized_tensor_is_a_validation_error() -> None:
    scheme = {
        "QFloat": {
            "value": "Q8F",
            "store": {"PackedU32": 0},
            "mode": "Symmetric",
            "tensor": None,
            "block": None,
        }
    }
    data = burnpack.dumps({"q": burnpack.TensorEntry(scheme, [3], b"\x00" * 8)})
    with pytest.raises(RecordError, match="'q' is quantized") as info:
        ModuleRecord.from_bytes(data)
    assert info.value.kind == "validation"


# -- Burn's own file --------------------------------------------------------------------------


def module_from_names(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A torch module whose state_dict has exactly these names (running stats as buffers)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if leaf.startswith("running_"):
            owner.register_buffer(leaf, torch.zeros(shape))
        else:
            owner.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))
    return root


def test_burn_mnist_file_loads_applies_and_rewrites() -> None:
    record = ModuleRecord.load(MNIST)
    assert len(record.tensors) == 18
    assert record.param_ids["conv1.conv.bias"] == 9505838338724798577
    assert list(record.tensors)[:3] == ["conv1.conv.weight", "conv1.conv.bias", "conv1.norm.gamma"]
    net = module_from_names({n: tuple(t.shape) for n, t in record.tensors.items()})
    record.apply(net)
    assert torch.equal(net.fc1.weight, record.tensors["fc1.weight"])
    assert param_ids(net)["conv1.conv.bias"] == 9505838338724798577
    with burnpack.read(MNIST) as original, burnpack.loads(record.to_bytes()) as rewritten:
        assert rewritten.names == original.names
        for name in original.names:
            a, b = original.entries[name], rewritten.entries[name]
            assert (a.dtype, a.shape, a.param_id, a.data_offsets) == (
                b.dtype,
                b.shape,
                b.param_id,
                b.data_offsets,
            )
            assert torch.equal(original.tensor(name), rewritten.tensor(name))
    # and a record made from the loaded torch module carries the same ids
    again = ModuleRecord.from_module(net)
    assert {n: again.param_ids[n] for n in net.state_dict() if n in again.param_ids} == {
        n: record.param_ids[n] for n in again.param_ids
    }


def test_state_dict_expands_aliases_for_torch() -> None:
    src = randomize(Tied(), 9)
    record = ModuleRecord.from_bytes(ModuleRecord.from_module(src).to_bytes())
    sd = record.state_dict()
    assert list(sd) == ["embed.weight", "head.weight"] and sd["head.weight"] is sd["embed.weight"]
    dst = Tied()
    dst.load_state_dict(sd)
    assert torch.equal(dst.head.weight, src.head.weight)


def test_apply_copies_large_tensors_on_two_threads_exactly() -> None:
    """Tensors over 256 KiB go through the shared two-thread copy: same bytes, same objects,
    the record's ids, a version bump autograd can see; small ones and casts as before."""
    g = torch.Generator().manual_seed(1)
    net = nn.Sequential(nn.Linear(700, 300), nn.Linear(300, 7))  # 840 KiB, 8.4 KiB, ...
    source = nn.Sequential(nn.Linear(700, 300), nn.Linear(300, 7))
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    record = ModuleRecord.from_bytes(ModuleRecord.from_module(source).to_bytes())
    weight, version = net[0].weight, net[0].weight._version
    record.apply(net)
    assert net[0].weight is weight and weight._version > version
    pairs = zip(net.parameters(), source.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert param_ids(net) == param_ids(source)
    half = nn.Sequential(nn.Linear(700, 300), nn.Linear(300, 7)).half()
    record.apply(half, dtype_policy="cast_to_module")
    assert half[0].weight.dtype == torch.float16
    assert torch.equal(half[0].weight, source[0].weight.half())


def test_loading_thousands_of_tensors_runs_no_full_garbage_collection(tmp_path: Path) -> None:
    """A full collection visits every object of the process (about 200 ms with torch and
    Lightning imported): loading and saving 5,000 tensors must not set one off (see
    burnpack._parallel), as it did one round in three."""
    import gc

    net = nn.Sequential(*(nn.Linear(2, 2) for _ in range(2500)))
    path = ModuleRecord.from_module(net).save(tmp_path / "many.bpk")
    full: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.collect()  # no promoted objects pending from earlier tests
    gc.callbacks.append(watch)
    try:
        for _ in range(5):
            ModuleRecord.load(path).apply(net)
            ModuleRecord.from_module(net).save(path)
    finally:
        gc.callbacks.remove(watch)
    assert full == [] and gc.isenabled()


def test_apply_materialises_a_module_built_on_meta_tied_weights_included():
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    source.add_module("head", torch.nn.Linear(3, 4))
    source.head.weight = source[0].weight  # tied
    source.head.weight.requires_grad_(True)
    record = ModuleRecord.from_module(source)
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        empty.add_module("head", torch.nn.Linear(3, 4))
        empty.head.weight = empty[0].weight
    record.apply(empty)
    assert not any(t.is_meta for t in empty.state_dict().values())
    assert empty.head.weight is empty[0].weight  # still tied, one Parameter
    assert isinstance(empty[0].weight, torch.nn.Parameter) and empty[0].weight.requires_grad
    assert param_ids(empty) == param_ids(source)
    for name, tensor in source.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor), name


def test_apply_never_leaves_a_tensor_on_meta_even_with_allow_partial():
    with torch.device("meta"):
        empty = torch.nn.Linear(2, 2)
    with pytest.raises(RecordError, match="'bias' is on the meta device and the record"):
        ModuleRecord({"weight": torch.ones(2, 2)}).apply(empty, allow_partial=True)
    assert empty.weight.is_meta  # nothing changed
