"""Burn's store adapters: key filters, layer renumbering, half precision, and shape mismatches
a relaxed load skips (never silently)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_bpk.interop import (
    HalfPrecisionAdapter,
    KeyFilter,
    KeyRemapper,
    PyTorchToBurnAdapter,
    RemapError,
    Renumber,
    load_remapped,
    peft_rules,
    save_pretrained,
)
from lightning_bpk.records import ModuleRecord, RecordError


def _stack(n: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))
    model.head = nn.Linear(2, 1)
    return model


def test_a_key_filter_loads_only_what_it_keeps(tmp_path):
    source = _stack(3)
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(dict(source.state_dict()), path)
    target = _stack(3, seed=1)
    before = target.head.weight.detach().clone()
    keep = KeyRemapper([KeyFilter(regex=[r"^layers\.[01]\."], full_paths=["layers.2.bias"])])
    with pytest.raises(RecordError, match=r"head\.weight"):  # filtered out: missing, strictly
        load_remapped(path, target, keep)
    load_remapped(path, target, keep, allow_partial=True)
    assert torch.equal(target.layers[1].weight, source.layers[1].weight)
    assert torch.equal(target.layers[2].bias, source.layers[2].bias)
    assert not torch.equal(target.layers[2].weight, source.layers[2].weight)
    assert torch.equal(target.head.weight, before)
    saved = safetensors.torch.load_file(save_pretrained(target, tmp_path / "s.safetensors", keep))
    assert sorted(saved) == [
        "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight", "layers.2.bias",
    ]  # fmt: skip


def test_renumber_loads_pruned_layers_into_contiguous_ones(tmp_path):
    source = _stack(6)
    state = {
        k: v
        for k, v in source.state_dict().items()
        if not k.startswith(("layers.1.", "layers.3.", "layers.4."))
    }
    path = tmp_path / "pruned.safetensors"
    safetensors.torch.save_file(state, path)
    target = _stack(3, seed=1)
    with pytest.raises(RecordError, match=r"layers\.1\.weight"):
        load_remapped(path, target)  # without renumbering: layers.5 is unused, layers.1 missing
    load_remapped(path, target, KeyRemapper([Renumber(r"^layers\.(\d+)\.")]))
    for new, old in enumerate((0, 2, 5)):
        assert torch.equal(target.layers[new].weight, source.layers[old].weight)
    with pytest.raises(RemapError, match="exactly one group"):
        Renumber(r"layers\.\d+")


def test_half_precision_adapter_halves_what_is_recorded():
    net = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    adapter = HalfPrecisionAdapter(PyTorchToBurnAdapter())
    record = ModuleRecord.from_module(net, adapter=adapter)
    assert record.tensors["0.weight"].dtype == torch.float16
    assert record.tensors["0.weight"].shape == (3, 2)  # Burn's [in, out], then halved
    assert "1.gamma" in record.tensors
    back = ModuleRecord.from_bytes(record.to_bytes()).apply(
        nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)), adapter=adapter
    )
    assert back[0].weight.dtype == torch.float32
    torch.testing.assert_close(back[0].weight, net[0].weight, rtol=1e-3, atol=1e-3)
    ints = ModuleRecord.from_module(nn.BatchNorm1d(2), adapter=HalfPrecisionAdapter())
    assert ints.tensors["num_batches_tracked"].dtype == torch.int64  # only float32 is halved


def test_a_relaxed_load_names_every_shape_mismatch_it_skips(tmp_path):
    source = _stack(2)
    state = dict(source.state_dict())
    state["head.weight"] = torch.ones(1, 3)
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, path)
    target = _stack(2, seed=1)
    before = target.head.weight.detach().clone()
    with pytest.raises(RecordError, match=r"head\.weight"):
        load_remapped(path, target)
    with pytest.warns(
        UserWarning,
        match=r"skipped 1 shape mismatches.*'head.weight': \[1, 3\] in "
        r"the file, \[1, 2\] in the module",
    ):
        load_remapped(path, target, validate=False)
    assert torch.equal(target.head.weight, before)
    assert torch.equal(target.layers[0].weight, source.layers[0].weight)


def test_a_relaxed_load_returns_what_it_applied_skipped_left_missing_unused_and_cast(tmp_path):
    source = _stack(2)
    state = {k: v.double() for k, v in source.state_dict().items() if k != "layers.1.bias"}
    state["head.weight"] = torch.ones(1, 3, dtype=torch.float64)
    state["extra.w"] = torch.ones(1, dtype=torch.float64)
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, path)
    target = _stack(2, seed=1)
    with pytest.warns(UserWarning, match="skipped 1 shape mismatches"):
        result = load_remapped(
            path,
            target,
            allow_partial=True,
            allow_unused=True,
            validate=False,
            dtype_policy="cast_to_module",
        )
    assert result == []  # no rule went unmatched: still the list it always was
    assert result.skipped == ["head.weight"]
    assert result.missing == ["layers.1.bias"]
    assert result.unused == ["extra.w"]
    assert result.applied == ["head.bias", "layers.0.bias", "layers.0.weight", "layers.1.weight"]
    assert result.cast == result.applied  # float64 in the file, float32 in the module
    assert target.layers[0].weight.dtype == torch.float32
    assert "skipped=1" in repr(result)


def _lora_model(seed: int) -> nn.Module:
    """Layers as peft injects LoRA: ``q_proj.base_layer`` and ``q_proj.lora_A.default``."""
    torch.manual_seed(seed)
    model = nn.Module()
    for proj in ("q_proj", "v_proj"):
        layer = nn.Module()
        layer.base_layer = nn.Linear(4, 4)
        layer.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        layer.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})
        setattr(model, proj, layer)
    return model


def test_lora_adapters_export_with_peft_names(tmp_path):
    model = _lora_model(0)
    path = save_pretrained(model, tmp_path / "adapter_model.safetensors", peft_rules())
    saved = safetensors.torch.load_file(path)
    assert sorted(saved) == [
        f"base_model.model.{p}.lora_{ab}.weight" for p in ("q_proj", "v_proj") for ab in "AB"
    ]  # the adapter's name left out, the base weights not saved: peft's adapter file
    again = _lora_model(1)
    load_remapped(path, again, peft_rules(), allow_partial=True)
    assert torch.equal(again.v_proj.lora_B["default"].weight, model.v_proj.lora_B["default"].weight)
    assert not torch.equal(again.q_proj.base_layer.weight, model.q_proj.base_layer.weight)
    with pytest.raises(RemapError, match="not one peft would use"):
        peft_rules("a.b")
