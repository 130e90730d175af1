"""load_remapped: the same result as apply_remapped(load_module_record(...)), read, verified and
converted on a thread pool; groups found from the rules; problems found before any data is read."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
import torch.utils._pytree as pytree
from test_interop_conversions import MIXTRAL, fused_model, legacy_state
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_bpk import burnpack, cli
from lightning_bpk.interop import (
    BurnToPyTorchAdapter,
    Chunk,
    Concatenate,
    KeyRemapper,
    RemapError,
    Rename,
    Rule,
    Split,
    WeightConverter,
    apply_remapped,
    load_module_record,
    save_module_record,
)
from lightning_bpk.interop._plan import groups_of
from lightning_bpk.interop.loading import load_remapped
from lightning_bpk.interop.rules import tracing
from lightning_bpk.records import RecordChecksumError, RecordError, load_record
from lightning_bpk.records.module import ModuleRecord, param_ids


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


@pytest.mark.parametrize("suffix", [".bpk", ".safetensors", ".pt"])
@pytest.mark.parametrize("workers", [1, 3])
def test_same_result_as_apply_remapped(tmp_path, suffix, workers):
    state = legacy_state(layers=3)
    ids = {n: 500 + k for k, n in enumerate(state)}
    path = tmp_path / f"mixtral{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        save_module_record(ModuleRecord(state, param_ids=ids), path)
    remapper = KeyRemapper(MIXTRAL)
    expected = fused_model(3)
    unmatched = apply_remapped(load_module_record(path), expected, remapper)
    model = fused_model(3)
    assert load_remapped(path, model, remapper, workers=workers) == unmatched == []
    ours = _state(model)
    for name, tensor in _state(expected).items():
        assert torch.equal(ours[name], tensor), name
    assert param_ids(model) == param_ids(expected)


class _DataOps(TorchDispatchMode):
    """The aten ops that ran on tensors holding data (the meta tensors of planning left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(not t.is_meta for t in tensors):
            self.ran.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("suffix", [".bpk", ".safetensors"])
def test_fused_experts_are_built_in_their_parameters(tmp_path, suffix):
    """Each expert's w1/w2/w3 is copied once, straight into its slice of the fused parameter:
    no stacked or concatenated tensor is built in new memory and copied again."""
    state = legacy_state(layers=2)
    path = save_module_record(ModuleRecord(state), tmp_path / f"mixtral{suffix}")
    model = fused_model(2)
    experts = model.layers[1].mlp.experts.gate_up_proj
    storage = experts.untyped_storage().data_ptr()
    with _DataOps() as ops:
        load_remapped(path, model, KeyRemapper(MIXTRAL), workers=1)
    assert not {"cat", "stack"} & set(ops.ran), sorted(set(ops.ran))
    assert ops.ran.count("copy_") == len(state)  # one copy per file tensor, none after
    assert experts.untyped_storage().data_ptr() == storage
    expected = fused_model(2)
    apply_remapped(load_module_record(path), expected, KeyRemapper(MIXTRAL))
    for name, tensor in _state(expected).items():
        assert torch.equal(_state(model)[name], tensor), name


class _TransposedView(Rule):
    """A user's rule that changes a tensor after the converter built it, returning a view."""

    traced = True

    def forward(self, items):
        return {n: (t.transpose(0, 1) if n == "fused" else t, p) for n, (t, p) in items.items()}, 1

    backward = forward


def test_a_result_a_later_rule_changes_is_built_in_new_memory(tmp_path):
    """Only a tensor no later rule reads or changes is built in place: here a rule transposes
    the fused tensor (as a view of it), which built in the parameter would copy over itself."""
    parts = {"a": torch.randn(2, 4), "b": torch.randn(2, 4)}
    path = ModuleRecord(parts).save(tmp_path / "ab.bpk")
    remapper = KeyRemapper(
        [WeightConverter(["^a", "^b"], "fused", [Concatenate(0)]), _TransposedView()]
    )
    net = nn.Module()
    net.register_buffer("fused", torch.zeros(4, 4))
    assert load_remapped(path, net, remapper, workers=1) == []
    assert torch.equal(net.fused, torch.cat([parts["a"], parts["b"]]).T)


def test_groups_follow_the_rules():
    state = legacy_state(layers=2)
    meta = {n: (torch.empty(t.shape, device="meta"), None) for n, t in state.items()}
    with tracing() as links:
        KeyRemapper(MIXTRAL).load(meta)
    groups = sorted(sorted(g) for g in groups_of(list(state), {}, links))
    w13 = [f"layers.0.block_sparse_moe.experts.{e}.w{w}.weight" for w in (1, 3) for e in range(3)]
    assert sorted(w13) in groups
    assert ["layers.1.block_sparse_moe.gate.weight"] in groups
    assert len(groups) == 2 * 3  # per layer: gate, w1+w3, w2


def test_tied_weights_and_plain_files(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    source = Tied()
    path = ModuleRecord.from_module(source).save(tmp_path / "tied.bpk")
    target = Tied()
    assert load_remapped(path, target) == []
    assert torch.equal(target.head.weight, source.embed.weight)
    assert target.head.weight is target.embed.weight


def _damage(path, name: str) -> None:
    with burnpack.read(path) as pack:
        offset = pack.data_start + pack.entries[name].data_offsets[0]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_conversion_problems_come_before_any_read(tmp_path):
    """An incomplete expert list is reported from the file's header alone: the damaged tensor
    (which a read would reject) is never read."""
    state = legacy_state(layers=1)
    del state["layers.0.block_sparse_moe.experts.2.w3.weight"]
    path = ModuleRecord(state).save(tmp_path / "m.bpk")
    _damage(path, "layers.0.block_sparse_moe.experts.0.w1.weight")
    with pytest.raises(RemapError, match="different numbers of keys"):
        load_remapped(path, fused_model(1), KeyRemapper(MIXTRAL), workers=2)


def test_a_damaged_file_changes_nothing(tmp_path):
    """Checksums are verified before any group is written: the damaged tensor's group comes
    last, after groups that would otherwise already be in the module."""
    path = ModuleRecord(legacy_state(layers=1)).save(tmp_path / "m.bpk")
    name = "layers.0.block_sparse_moe.experts.2.w2.weight"
    _damage(path, name)
    model = fused_model(1)
    before = _state(model)
    for workers in (1, 2):
        with pytest.raises(RecordError, match=f"'{name}' fails its checksum"):
            load_remapped(path, model, KeyRemapper(MIXTRAL), workers=workers)
        assert all(torch.equal(t, before[n]) for n, t in _state(model).items())


def test_apply_problems_reported_together(tmp_path):
    path = ModuleRecord(legacy_state(layers=2)).save(tmp_path / "m.bpk")
    model = fused_model(1)
    with pytest.raises(RecordError) as info:
        load_remapped(path, model, KeyRemapper(MIXTRAL), workers=2)
    assert "Unused tensor: 'layers.1.mlp.experts.gate_up_proj'" in str(info.value)
    assert "Unused tensor: 'layers.1.mlp.gate.weight'" in str(info.value)


class Untraced(Rule):
    """A user's rule that does not report its links: the file loads as one group."""

    def forward(self, items):
        return {n.replace("attn.", "attention."): v for n, v in items.items()}, len(items)

    def backward(self, items):
        return {n.replace("attention.", "attn."): v for n, v in items.items()}, len(items)


def test_untraced_rules_still_load_correctly(tmp_path):
    qkv = torch.arange(24.0).reshape(6, 4)
    path = ModuleRecord({"model.attn.qkv": qkv}).save(tmp_path / "f.bpk")
    net = nn.Module()
    net.attention = nn.Module()
    for part in "qkv":
        net.attention.register_buffer(part, torch.zeros(2, 4))
    remapper = KeyRemapper(
        [Rename(r"^model\.", ""), Untraced(), Split(r"(.+)\.qkv", [r"\1.q", r"\1.k", r"\1.v"])]
    )
    assert load_remapped(path, net, remapper, workers=2) == []
    assert torch.equal(net.attention.v, qkv[4:])


def test_workers_must_be_positive(tmp_path):
    path = ModuleRecord({"w": torch.zeros(1)}).save(tmp_path / "w.bpk")
    with pytest.raises(ValueError, match="workers"):
        load_remapped(path, nn.Module(), workers=0)


def test_burn_file_through_rules_and_adapter(tmp_path):
    from test_interop_conversions import TorchBlock

    g = torch.Generator().manual_seed(5)
    burn = {
        "attn.qkv.weight": torch.randn(4, 12, generator=g),
        "attn.qkv.bias": torch.randn(12, generator=g),
        "attn.norm.gamma": torch.randn(4, generator=g),
        "attn.norm.beta": torch.randn(4, generator=g),
    }
    path = ModuleRecord(burn).save(tmp_path / "burn.bpk")
    remapper = KeyRemapper(
        [
            WeightConverter("qkv.weight", ["q.weight", "k.weight", "v.weight"], [Chunk(dim=1)]),
            WeightConverter("qkv.bias", ["q.bias", "k.bias", "v.bias"], [Chunk(dim=0)]),
        ]
    )
    expected, net = nn.Module(), nn.Module()
    expected.attn, net.attn = TorchBlock(), TorchBlock()
    adapter = BurnToPyTorchAdapter()
    apply_remapped(load_module_record(path), expected, remapper, adapter=adapter)
    assert load_remapped(path, net, remapper, workers=2, adapter=adapter) == []
    for name, tensor in _state(expected).items():
        assert torch.equal(_state(net)[name], tensor), name


def test_options_as_apply(tmp_path):
    """validate=False skips a mismatched tensor, allow_unused/allow_partial as apply, and a
    dtype change follows dtype_policy."""
    path = ModuleRecord(
        {
            "weight": torch.ones(2, 3, dtype=torch.float64),
            "bias": torch.ones(5),
            "extra": torch.ones(1),
        }
    ).save(tmp_path / "m.bpk")
    net = nn.Linear(3, 2)
    bias = net.bias.detach().clone()
    with pytest.raises(RecordError) as info:
        load_remapped(path, net)
    assert "shape mismatch" in str(info.value) and "Unused tensor: 'extra'" in str(info.value)
    assert torch.equal(net.bias, bias)
    load_remapped(path, net, validate=False, allow_unused=True, dtype_policy="cast_to_module")
    assert net.weight.dtype == torch.float32 and torch.equal(net.weight, torch.ones(2, 3))
    assert torch.equal(net.bias, bias)
    load_remapped(path, net, validate=False, allow_unused=True)
    assert net.weight.dtype == torch.float64


def test_safetensors_dtypes_and_empty_tensors(tmp_path):
    """Zero-copy views of a safetensors file: bf16, bool, int64 and empty tensors load as the
    official reader reads them."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 2).to(torch.bfloat16))
            self.register_buffer("mask", torch.tensor([True, False, True]))
            self.register_buffer("steps", torch.tensor([7, -2], dtype=torch.int64))
            self.register_buffer("nothing", torch.zeros(0, 4))

    source = Mixed()
    path = save_module_record(ModuleRecord.from_module(source), tmp_path / "m.safetensors")
    target = Mixed()
    assert load_remapped(path, target, workers=2) == []
    for name, tensor in _state(source).items():
        got = _state(target)[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


# --- one damage, one exception type, through every public reader, on both backends -------------


def _damaged_record(backend: str, tmp_path) -> tuple[str, str]:
    """A module record whose tensor ``w`` has one flipped byte, on local disk or at a
    ``memory://`` URL (damaged through fsspec, as another program would); ``(location, w)``."""
    base = str(tmp_path) if backend == "local" else f"memory://damage-{uuid.uuid4().hex[:8]}"
    where = f"{base}/model.bpk"
    ModuleRecord({"w": torch.arange(64.0), "b": torch.ones(3)}).save(where)
    fs, key = fsspec.core.url_to_fs(where)
    data = bytearray(fs.cat_file(key))
    with burnpack.loads(bytes(data)) as pack:
        data[pack.data_start + pack.entries["w"].data_offsets[0] + 5] ^= 0x01
    fs.pipe_file(key, bytes(data))
    return where, "w"


def _through_load_record(where: str) -> None:
    load_record(where)


def _through_record_load(where: str) -> None:
    ModuleRecord.load(where)


def _through_load_remapped(where: str) -> None:
    net = nn.Module()
    net.register_buffer("w", torch.zeros(64))
    net.register_buffer("b", torch.zeros(3))
    load_remapped(where, net)


def _through_load_module_record(where: str) -> None:
    load_module_record(where)


@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.parametrize(
    "reader",
    [
        _through_load_record,
        _through_record_load,
        _through_load_remapped,
        _through_load_module_record,
    ],
)
def test_a_damaged_tensor_raises_a_checksum_error_through_every_reader(tmp_path, backend, reader):
    """The same flipped byte is a RecordChecksumError (a burnpack.ChecksumError and a
    RecordError of kind "checksum") naming the tensor, whichever public reader finds it, on
    local disk and on an object store: no reader flattens it into an I/O error."""
    where, tensor = _damaged_record(backend, tmp_path)
    with pytest.raises(RecordChecksumError, match=f"'{tensor}'") as info:
        reader(where)
    assert isinstance(info.value, burnpack.ChecksumError) and info.value.kind == "checksum"


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_verify_names_the_damaged_tensor_and_exits_non_zero(tmp_path, backend, capsys):
    where, tensor = _damaged_record(backend, tmp_path)
    assert cli.main(["verify", where]) == cli.EXIT_FOUND
    out = capsys.readouterr().out
    assert "DAMAGED" in out and f"tensor '{tensor}' fails its checksum" in out


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_a_missing_file_is_an_io_error_through_every_reader(tmp_path, backend):
    """Nothing there: a RecordError of kind "io" naming the file, its cause chained."""
    base = str(tmp_path) if backend == "local" else f"memory://missing-{uuid.uuid4().hex[:8]}"
    where = f"{base}/absent.bpk"
    for reader in (_through_load_record, _through_load_remapped, _through_load_module_record):
        with pytest.raises(RecordError, match=r"absent\.bpk") as info:
            reader(where)
        assert info.value.kind == "io" and info.value.__cause__ is not None, reader
