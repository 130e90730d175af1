"""Interop: Burn <-> torch adapters (on Burn's real MNIST file), key remapping, file formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_bpk import burnpack
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.interop import (
    SAFETENSORS_INFO_KEY,
    BurnToPyTorchAdapter,
    KeyRemapper,
    PyTorchToBurnAdapter,
    RemapError,
    Rename,
    Split,
    Transpose,
    Unstack,
    apply_remapped,
    convert,
    derive_inverse,
    export_checkpoint,
    load_module_record,
    load_remapped,
    read_content,
    record_remapped,
    save_module_record,
)
from lightning_bpk.records import RecordError
from lightning_bpk.records.module import ModuleRecord, param_ids

from conftest import MNIST_BPK, import_example

FIXTURE = MNIST_BPK
MIN_DIGIT_ACCURACY = 0.80  # measured 89.5%; chance is 10%


def _example():
    return import_example("burn_mnist_interop")


# --- adapters on Burn's real file ----------------------------------------------------------------


def test_burn_mnist_classifies_real_digits():
    example = _example()
    net = example.load_burn_mnist(FIXTURE)
    images, labels = example.digits()
    acc = example.accuracy(net, images, labels)
    assert acc > MIN_DIGIT_ACCURACY, f"accuracy {acc:.2%}"
    # without the adapter the file does not even fit: Burn's names and layouts differ
    with pytest.raises(RecordError) as e:
        ModuleRecord.load(FIXTURE).apply(example.MnistNet())
    assert "Unused tensor: 'conv1.norm.gamma'" in str(e.value)
    assert "shape mismatch, expected [128, 1600] but record has [1600, 128]" in str(e.value)


def test_burn_mnist_converts_back_bit_for_bit():
    net = _example().load_burn_mnist(FIXTURE)
    back = ModuleRecord.from_module(net, adapter=PyTorchToBurnAdapter())
    with burnpack.read(FIXTURE) as pack:
        assert list(back.tensors) == pack.data_order
        for name in pack.names:
            assert back.param_ids[name] == pack.entries[name].param_id, name
            assert bytes(burnpack.tensor_bytes(back.tensors[name])) == bytes(pack.raw(name)), name
    tensors, _, _ = back.to_content()
    # Burn writes no checksums or metadata: the same content rebuilds Burn's file exactly
    assert burnpack.dumps(tensors, checksums=False) == FIXTURE.read_bytes()


def test_example_names_a_missing_file(tmp_path, capsys):
    assert _example().main([str(tmp_path / "absent.bpk")]) == 2
    assert "absent.bpk" in capsys.readouterr().out


def test_square_linear_weight_is_transposed_by_layer_type_not_shape():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, bias=False)  # square: shape says nothing
            self.emb = nn.Embedding(3, 3)  # same shape, same layout in Burn: untouched
            self.ln = nn.LayerNorm(3)
            self.gn = nn.GroupNorm(1, 3)
            self.inorm = nn.InstanceNorm1d(3, affine=True)
            self.bn = nn.BatchNorm1d(3)

    w = torch.arange(9.0).reshape(3, 3)
    burn = {"fc.weight": w, "emb.weight": w}
    for norm in ("ln", "gn", "inorm", "bn"):
        burn[f"{norm}.gamma"], burn[f"{norm}.beta"] = torch.full((3,), 2.0), torch.ones(3)
    burn["bn.running_mean"], burn["bn.running_var"] = torch.full((3,), 5.0), torch.full((3,), 6.0)
    net = ModuleRecord(burn).apply(Net(), adapter=BurnToPyTorchAdapter())  # strict: nothing missing
    assert torch.equal(net.fc.weight, w.t()) and torch.equal(net.emb.weight, w)
    assert torch.equal(net.bn.running_mean, burn["bn.running_mean"])
    for norm in (net.ln, net.gn, net.inorm, net.bn):
        assert torch.equal(norm.weight, burn["ln.gamma"]) and torch.equal(norm.bias, torch.ones(3))
    back = ModuleRecord.from_module(net, adapter=PyTorchToBurnAdapter())
    assert set(back.tensors) == set(burn)  # no num_batches_tracked, Burn has none
    assert all(torch.equal(back.tensors[n], burn[n]) for n in burn)


def test_adapter_problems_are_reported_together():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    record = ModuleRecord(
        {"0.weight": torch.ones(3, 2), "1.gamma": torch.ones(3), "x": torch.ones(1)}
    )
    with pytest.raises(RecordError) as e:
        record.apply(net, adapter=BurnToPyTorchAdapter())
    assert e.value.problems == [
        "Apply error: '0.weight': shape mismatch, expected [3, 2] but record has [2, 3]",
        "Missing tensor: '0.bias'",
        "Missing tensor: '1.bias'",
        "Missing tensor: '1.running_mean'",
        "Missing tensor: '1.running_var'",
        "Unused tensor: 'x'",
    ]


# --- key remapping -------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()


QKV_RULES = [
    Rename(r"^model\.", ""),
    Rename(r"(.+norm)\.gamma", r"\1.weight"),
    Rename(r"(.+norm)\.beta", r"\1.bias"),
    Split(r"(.+)\.qkv\.(weight|bias)", [r"\1.q.\2", r"\1.k.\2", r"\1.v.\2"]),
]


def _fused_file(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    fused = ModuleRecord(
        {
            "model.attn.qkv.weight": torch.randn(12, 4, generator=g),
            "model.attn.qkv.bias": torch.randn(12, generator=g),
            "model.attn.norm.gamma": torch.randn(4, generator=g),
            "model.attn.norm.beta": torch.randn(4, generator=g),
        },
        param_ids={
            "model.attn.qkv.weight": 11,
            "model.attn.qkv.bias": 12,
            "model.attn.norm.gamma": 2**64 - 1,
            "model.attn.norm.beta": 0,
        },
        metadata={"producer": "elsewhere"},
    )
    return fused.save(tmp_path / "fused.bpk")


def test_qkv_loads_split_and_saves_back_fused_byte_identical(tmp_path):
    path = _fused_file(tmp_path)
    remapper = KeyRemapper(QKV_RULES)
    record = ModuleRecord.load(path)
    net = Block()
    assert apply_remapped(record, net, remapper) == []
    w = record.tensors["model.attn.qkv.weight"]
    assert torch.equal(net.attn.q.weight, w[:4]) and torch.equal(net.attn.v.weight, w[8:])
    assert torch.equal(net.attn.norm.weight, record.tensors["model.attn.norm.gamma"])
    assert param_ids(net)["attn.q.weight"] == 11
    back, unmatched = record_remapped(net, remapper)
    assert unmatched == []
    back.metadata = record.metadata  # file metadata is not part of the module
    assert back.to_bytes() == path.read_bytes()


def test_unmatched_rules_are_reported(tmp_path):
    remapper = KeyRemapper([*QKV_RULES, Rename(r"(.+)\.scale", r"\1.alpha")])
    unmatched = apply_remapped(ModuleRecord.load(_fused_file(tmp_path)), Block(), remapper)
    assert unmatched == ["Rename('(.+)\\\\.scale' -> '\\\\1.alpha')"]
    _, unmatched = record_remapped(Block(), remapper)
    assert unmatched == ["Rename('(.+)\\\\.scale' -> '\\\\1.alpha')"]
    # rules describe the file format: a prefix stripped on load is added to every name on save
    back, _ = record_remapped(Block(), KeyRemapper([Rename(r"^encoder\.", "")]))
    assert next(iter(back.tensors)) == "encoder.attn.q.weight"


def test_remapped_load_reports_missing_unused_and_mismatch_together():
    record = ModuleRecord(
        {
            "model.attn.qkv.weight": torch.zeros(12, 4),
            "model.attn.qkv.bias": torch.zeros(12),
            "model.attn.norm.gamma": torch.zeros(5),  # wrong shape
            "model.extra": torch.zeros(1),  # matches nothing
        }
    )  # norm.beta missing
    with pytest.raises(RecordError) as e:
        apply_remapped(record, Block(), KeyRemapper(QKV_RULES))
    assert e.value.problems == [
        "Apply error: 'attn.norm.weight': shape mismatch, expected [4] but record has [5]",
        "Missing tensor: 'attn.norm.bias'",
        "Unused tensor: 'extra'",
    ]
    # the options of apply pass through; the mismatch validate=False skips is named
    with pytest.warns(UserWarning, match="'attn.norm.weight': shape mismatch"):
        apply_remapped(
            record,
            Block(),
            KeyRemapper(QKV_RULES),
            allow_partial=True,
            allow_unused=True,
            validate=False,
        )


def test_derived_inverses_and_their_limits():
    assert derive_inverse(r"^model\.", "") == ("^", "model.")
    assert derive_inverse(r"(.+)\.gamma", r"\1.weight") == (r"(.+)\.weight", r"\g<1>.gamma")
    assert derive_inverse(r"^(\w+)\.(\d+)\.w$", r"\2.\1") == (r"^(\d+)\.(\w+)$", r"\g<2>.\g<1>.w")
    for pattern, replacement in [(r"\d+", "n"), (r"a|b", "c"), (r"(a)(b)", r"\1"), ("x", "")]:
        with pytest.raises(RemapError):
            Rename(pattern, replacement)
    explicit = Rename(r"layers_(\d+)", r"layers.\1", inverse=(r"layers\.(\d+)", r"layers_\1"))
    result = KeyRemapper([explicit]).save({"layers.3.w": (torch.ones(1), None)})
    assert list(result.tensors) == ["layers_3.w"]
    wrong = Rename(r"^old\.", "new.", inverse=(r"^new\.", "wrong."))
    with pytest.raises(RemapError, match=r"cannot invert for 'new\.w'"):
        KeyRemapper([wrong]).save({"new.w": (torch.ones(1), None)})


def test_unstack_transpose_and_uneven_split_round_trip():
    g = torch.Generator().manual_seed(1)
    original = {
        "experts.w": (torch.randn(3, 2, 5, generator=g), 7),
        "proj": (torch.randn(2, 6, generator=g), None),
        "gqa": (torch.randn(8, 2, generator=g), 9),  # 4 query rows, 2 key rows, 2 value rows
    }
    remapper = KeyRemapper(
        [
            Unstack(r"experts\.w", "experts.{i}.w"),
            Transpose("proj"),
            Split("gqa", ["q", "k", "v"], sizes=[4, 2, 2]),
        ]
    )
    loaded = remapper.load(original).tensors
    assert list(loaded) == ["experts.0.w", "experts.1.w", "experts.2.w", "proj", "q", "k", "v"]
    assert torch.equal(loaded["experts.2.w"][0], original["experts.w"][0][2])
    assert loaded["proj"][0].shape == (6, 2) and loaded["k"][0].shape == (2, 2)
    assert loaded["experts.0.w"][1] == 7 and loaded["experts.1.w"][1] not in (None, 7)
    saved = remapper.save(loaded).tensors
    assert list(saved) == list(original)
    for name, (tensor, pid) in original.items():
        assert torch.equal(saved[name][0], tensor) and saved[name][1] == pid
    with pytest.raises(RemapError, match="not divisible into 3 parts"):
        KeyRemapper([Split("x", ["a", "b", "c"])]).load({"x": (torch.ones(4), None)})
    with pytest.raises(RemapError, match="missing"):
        KeyRemapper(QKV_RULES[3:]).save({"a.q.weight": (torch.ones(1), None)})


# --- formats -------------------------------------------------------------------------------------


def _mixed_record() -> ModuleRecord:
    return ModuleRecord(
        {
            "w16": torch.arange(6, dtype=torch.float16).reshape(2, 3),
            "wbf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "steps": torch.tensor(5, dtype=torch.int64),
            "u": torch.tensor([1, 2], dtype=torch.uint32),
            "w": torch.randn(4, 4, dtype=torch.float64),
        },
        param_ids={"w16": 1, "wbf": 2**64 - 1, "w": 3},
        metadata={"note": "hello", "format": "pt"},
    )


def test_bpk_safetensors_round_trip_is_byte_identical(tmp_path):
    bpk = _mixed_record().save(tmp_path / "a.bpk")
    st = convert(bpk, tmp_path / "a.safetensors")
    official = safetensors.torch.load_file(st)  # the reference reader accepts our writer's file
    assert official["wbf"].dtype == torch.bfloat16 and official["mask"].dtype == torch.bool
    with safetensors.safe_open(st, framework="pt") as f:
        assert f.metadata()["note"] == "hello" and SAFETENSORS_INFO_KEY in f.metadata()
    back = convert(st, tmp_path / "b.bpk")
    assert back.read_bytes() == bpk.read_bytes()
    record = load_module_record(st)
    assert record.param_ids == {"w16": 1, "wbf": 2**64 - 1, "w": 3}
    assert record.metadata == {"note": "hello", "format": "pt"}


def test_burn_file_and_burn_only_dtypes_survive_safetensors(tmp_path):
    st = convert(FIXTURE, tmp_path / "mnist.safetensors")
    back = convert(st, tmp_path / "mnist.bpk")
    with burnpack.read(FIXTURE) as a, burnpack.read(back) as b:
        assert a.names == b.names
        for n in a.names:
            assert a.entries[n] == b.entries[n] and bytes(a.raw(n)) == bytes(b.raw(n))
    flex = burnpack.write(
        tmp_path / "flex.bpk",
        [
            ("f", burnpack.TensorEntry("Flex32", [2], torch.ones(2))),
            (
                "b",
                burnpack.TensorEntry(
                    {"Bool": "U32"}, [2], torch.tensor([1, 0], dtype=torch.uint32)
                ),
            ),
        ],
        scalars={"lr": 0.1, "step": 3},
    )
    again = convert(convert(flex, tmp_path / "flex.safetensors"), tmp_path / "flex2.bpk")
    assert again.read_bytes() == flex.read_bytes()


def test_foreign_safetensors_becomes_a_module_record(tmp_path):
    net = nn.Linear(3, 2)
    path = tmp_path / "hf.safetensors"
    safetensors.torch.save_file(dict(net.state_dict()), path, metadata={"format": "pt"})
    bpk = convert(path, tmp_path / "hf.bpk")
    record = ModuleRecord.load(bpk)
    assert record.metadata == {"format": "pt"}
    other = record.apply(nn.Linear(3, 2))
    assert torch.equal(other.weight, net.weight)
    assert save_module_record(record, tmp_path / "again.safetensors").exists()


class Wrapped(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    def training_step(self, batch, _):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_ckpt_and_state_dict_import(tmp_path):
    model = Wrapped()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
    )
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    trainer.fit(model, data)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    record = load_module_record(ckpt)
    assert "net.1.num_batches_tracked" in record.tensors
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    apply_remapped(record, plain, KeyRemapper([Rename(r"^net\.", "")]))
    assert torch.equal(plain[1].running_mean, model.net[1].running_mean)
    bpk = convert(ckpt, tmp_path / "model.bpk")
    assert ModuleRecord.load(bpk).tensors.keys() == record.tensors.keys()
    pt = tmp_path / "sd.pt"
    torch.save(plain.state_dict(), pt)
    assert torch.equal(read_content(pt).tensors["2.weight"], plain[2].weight)


class NotAllowed:
    pass


class RunsCode:
    """A pickle that calls os.system when loaded: what a hostile .pt holds."""

    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("payload", [RunsCode(), NotAllowed()], ids=["os.system", "class"])
def test_a_hostile_pt_is_refused_without_torchs_weights_only_false_advice(tmp_path, payload):
    evil = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": payload}, evil)
    with pytest.raises(RecordError) as info:
        read_content(evil)
    message = str(info.value)
    assert "refused to unpickle" in message and "no weights_only=False fallback" in message
    assert ("system" if isinstance(payload, RunsCode) else "NotAllowed") in message
    # torch's advice to load it anyway, or to allowlist the global, is not passed on, nor is
    # its message chained underneath (a traceback would show it again), nor its ANSI codes
    for advice in ("set to `False`", "can still be loaded", "add_safe_globals", "\x1b"):
        assert advice not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_torch_files_are_never_unpickled_freely(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "obj": NotAllowed()}, evil)
    with pytest.raises(RecordError, match=r"evil.pt: refused to unpickle: .*NotAllowed"):
        read_content(evil)
    odd = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(1), "step": 3}, odd)
    with pytest.raises(RecordError, match="entry 'step' is a int, not a tensor"):
        read_content(odd)
    with pytest.raises(RecordError, match="import format only"):
        convert(FIXTURE, tmp_path / "out.pt")
    with pytest.raises(RecordError, match="unknown suffix"):
        convert(FIXTURE, tmp_path / "out.npz")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(RecordError, match=r"bad\.safetensors: not a readable safetensors file"):
        read_content(bad)


def test_export_checkpoint_model_to_safetensors(tmp_path):
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    checkpointer = Checkpointer(tmp_path / "run")
    ckpt_dir = checkpointer.save_checkpoint(
        4, {"model": ModuleRecord.from_module(net), "trainer": {"step": 4}}
    )
    out = export_checkpoint(ckpt_dir, tmp_path / "serve.safetensors")
    served = safetensors.torch.load_file(out)
    assert served.keys() == net.state_dict().keys()
    assert all(torch.equal(served[k], v) for k, v in net.state_dict().items())
    with pytest.raises(RecordError, match="no such model file"):
        export_checkpoint(tmp_path, tmp_path / "x.safetensors")
    with pytest.raises(RecordError, match=r"export writes \.safetensors"):
        export_checkpoint(ckpt_dir, tmp_path / "x.bpk")


@pytest.mark.parametrize("suffix", [".bpk", ".safetensors"])
def test_loads_without_a_module_take_a_device(suffix: str, tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    path = save_module_record(ModuleRecord.from_module(net), tmp_path / f"m{suffix}")
    expected = net.state_dict()
    for device in ("cpu", torch.device("cpu")):
        record = load_module_record(path, device=device)
        content = read_content(path, device=device)
        for tensors in (record.tensors, content.tensors):
            assert tensors.keys() == expected.keys()
            assert all(
                torch.equal(tensors[k], v) and tensors[k].is_cpu for k, v in expected.items()
            )
    for device, message in [("meta", "holds no data"), ("bogus", "'bogus'")]:
        with pytest.raises(ValueError, match=message):
            load_module_record(tmp_path / f"absent{suffix}", device=device)
        with pytest.raises(ValueError, match=message):
            read_content(tmp_path / f"absent{suffix}", device=device)


_INFO = {"order": ["w"], "param_ids": {"w": "7"}, "dtypes": {}, "scalars": {}}
# This package's info entry in a safetensors header, made hostile field by field (the text).
_HOSTILE_INFO = {
    "not JSON": "{",
    "nested past the recursion limit": "[" * 5000 + "]" * 5000,
    "a list": "[]",
    "an infinite param id": '{"order": ["w"], "param_ids": {"w": Infinity}}',
    "a param id past u64": json.dumps({**_INFO, "param_ids": {"w": 2**70}}),
    "param ids as a list": json.dumps({**_INFO, "param_ids": [1, 2]}),
    "order as a string": json.dumps({**_INFO, "order": "w"}),
    "order naming twice": json.dumps({**_INFO, "order": ["w", "w"]}),
    "order naming another tensor": json.dumps({**_INFO, "order": ["zzz"]}),
    "a dtype of the wrong type": json.dumps({**_INFO, "dtypes": {"w": 5}}),
    "scalars as a list": json.dumps({**_INFO, "scalars": [1]}),
    "a scalar past u64": json.dumps({**_INFO, "scalars": {"x": ["UInt", 2**70]}}),
    "a scalar of no kind": json.dumps({**_INFO, "scalars": {"x": [None, None]}}),
    "a float scalar not in hex": json.dumps({**_INFO, "scalars": {"x": ["Float", "one"]}}),
}


@pytest.mark.parametrize("case", list(_HOSTILE_INFO))
def test_a_hostile_info_entry_is_a_record_error_naming_the_file(tmp_path, case):
    """Every reader of a safetensors file this package wrote checks its info entry whole (one
    parser): a hostile one is a RecordError naming the file and the entry, never the JSON's or
    a conversion's own exception (RecursionError, OverflowError, AttributeError, ...)."""
    path = tmp_path / "model.safetensors"
    metadata = {SAFETENSORS_INFO_KEY: _HOSTILE_INFO[case]}
    path.write_bytes(safetensors.torch.save({"w": torch.ones(2)}, metadata=metadata))
    for read in (read_content, load_module_record):
        with pytest.raises(RecordError, match=rf"{path.name}: bad {SAFETENSORS_INFO_KEY} entry"):
            read(path)
    with pytest.raises(RecordError, match=path.name):
        load_remapped(path, nn.Linear(2, 1, bias=False))


# Hostile tensor entries of a safetensors header: each is refused before any size is used.
_HOSTILE_HEADERS = {
    "a dimension past int64 beside a zero": {"dtype": "F32", "shape": [0, 2**63, 3]},
    "dimensions whose product passes int64": {"dtype": "F32", "shape": [0, 2**62, 4]},
    "a negative dimension": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]},
    "a string after a huge dimension": {"dtype": "F32", "shape": [2**70, "a"]},
    "offsets of the wrong type": {"dtype": "F32", "shape": [2], "data_offsets": "ab"},
    "an entry that is a list": [1, 2],
}


@pytest.mark.parametrize("case", list(_HOSTILE_HEADERS))
def test_a_hostile_safetensors_header_is_a_record_error(tmp_path, case):
    entry = _HOSTILE_HEADERS[case]
    if isinstance(entry, dict):
        entry = {"data_offsets": [0, 0], **entry}
    text = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(8))
    with pytest.raises(RecordError, match=r"model\.safetensors"):
        read_content(path)


def test_a_directory_with_one_model_file_reads_as_that_file(tmp_path):
    net = nn.Linear(3, 2)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    safetensors.torch.save_file(dict(net.state_dict()), folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    record = load_module_record(folder)
    assert torch.equal(record.tensors["weight"], net.weight.detach())
    safetensors.torch.save_file(dict(net.state_dict()), folder / "other.safetensors")
    with pytest.raises(RecordError, match=r"2 files of a known suffix \(model.safetensors, other"):
        load_module_record(folder)
