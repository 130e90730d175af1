"""Quantized checkpoints as conversions, against transformers' own dequantization: tiny
DeepSeek-style block-FP8 and gpt_oss MXFP4 checkpoints built here, loaded into modules."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_bpk.interop import (
    KeyRemapper,
    RemapError,
    WeightConverter,
    load_remapped,
    save_pretrained,
)
from lightning_bpk.interop.quant import Fp8Dequantize, Fp8Quantize, Mxfp4Dequantize

pytest.importorskip("transformers", minversion="5.23")
from transformers.integrations import finegrained_fp8, mxfp4

FP8_RULE = WeightConverter(
    ["weight", "weight_scale_inv"], "weight", [Fp8Dequantize(dtype=torch.float32)]
)


def _deepseek_checkpoint(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two linears quantized as DeepSeek-V3 stores them: e4m3 weights, one float32 scale per
    128x128 block (a 256x384 weight has a 2x3 grid), biases and norms unquantized."""
    torch.manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in (("0", (256, 384)), ("2", (128, 256))):
        weight, inv = Fp8Quantize((128, 128)).quantize(torch.randn(shape))
        state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = weight, inv
        state[f"{name}.bias"] = torch.randn(shape[0])
    safetensors.torch.save_file(state, path, metadata={"format": "pt"})
    return state


def test_block_fp8_dequantizes_as_transformers(tmp_path):
    state = _deepseek_checkpoint(tmp_path / "fp8.safetensors")
    assert state["0.weight_scale_inv"].shape == (2, 3)
    theirs = finegrained_fp8.Fp8Dequantize(None)
    model = nn.Sequential(nn.Linear(384, 256), nn.ReLU(), nn.Linear(256, 128))
    assert load_remapped(tmp_path / "fp8.safetensors", model, KeyRemapper([FP8_RULE])) == []
    for name in ("0", "2"):
        expected = theirs._dequantize_one(
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"], output_dtype=torch.float32
        )
        assert torch.equal(model.get_parameter(f"{name}.weight").detach(), expected), name
        assert torch.equal(model.get_parameter(f"{name}.bias").detach(), state[f"{name}.bias"])


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu, torch.bfloat16])
def test_fp8_scales_of_every_kind_dequantize_as_transformers(scale_dtype):
    torch.manual_seed(1)
    weight = torch.randn(64, 96).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 134, (2, 3), dtype=torch.uint8)
    if scale_dtype == torch.uint8:
        scales = exponents
    elif scale_dtype == torch.float8_e8m0fnu:
        scales = exponents.view(torch.float8_e8m0fnu)
    else:
        scales = torch.randn(2, 3).to(scale_dtype)
    ours = Fp8Dequantize(torch.bfloat16).dequantize(weight, scales)
    theirs = finegrained_fp8.Fp8Dequantize(None)._dequantize_one(
        weight, scales, output_dtype=torch.bfloat16
    )
    assert torch.equal(ours, theirs)
    fp4 = torch.randint(-128, 127, (64, 48), dtype=torch.int8)  # FP4 pairs: 96 values a row
    assert torch.equal(
        Fp8Dequantize(torch.float32).dequantize(
            fp4, scales.float() if scales.dtype.itemsize > 1 else scales
        ),
        finegrained_fp8.Fp8Dequantize(None)._dequantize_one(
            fp4, scales.float() if scales.dtype.itemsize > 1 else scales, output_dtype=torch.float32
        ),
    )


def test_fp8_saves_back_as_fp8_and_a_bad_grid_is_named(tmp_path):
    _deepseek_checkpoint(tmp_path / "fp8.safetensors")
    model = nn.Sequential(nn.Linear(384, 256), nn.ReLU(), nn.Linear(256, 128))
    rules = KeyRemapper([FP8_RULE])
    load_remapped(tmp_path / "fp8.safetensors", model, rules)
    back = safetensors.torch.load_file(save_pretrained(model, tmp_path / "back.safetensors", rules))
    assert back["0.weight"].dtype == torch.float8_e4m3fn and back["0.weight_scale_inv"].shape == (
        2,
        3,
    )
    again = nn.Sequential(nn.Linear(384, 256), nn.ReLU(), nn.Linear(256, 128))
    load_remapped(tmp_path / "back.safetensors", again, rules)
    # requantizing a dequantized fp8 weight is close, not exact: the block scales are recomputed
    torch.testing.assert_close(again[0].weight, model[0].weight, rtol=0.07, atol=1e-6)
    with pytest.raises(
        RemapError, match=r"weight \[64, 96\] is not divisible by its scale grid \[5, 3\]"
    ):
        Fp8Dequantize().dequantize(torch.zeros(64, 96), torch.ones(5, 3))


def test_fp8_block_arithmetic_by_hand():
    """One 2x4 weight, blocks of 1x2: each block's largest magnitude becomes 448."""
    w = torch.tensor([[1.0, -2.0, 0.0, 0.0], [0.5, 4.0, 7.0, -14.0]])
    q, inv = Fp8Quantize((1, 2)).quantize(w)
    assert q.float().tolist() == [[224.0, -448.0, 0.0, 0.0], [56.0, 448.0, 224.0, -448.0]]
    assert inv.flatten().tolist() == pytest.approx([2 / 448, 1.0, 4 / 448, 14 / 448])
    torch.testing.assert_close(Fp8Dequantize(torch.float32).dequantize(q, inv), w)


def _gpt_oss_blocks(experts: int, out: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = hidden // 32  # 32 values (16 bytes) a scale, as the MX format says
    blocks = torch.randint(0, 256, (experts, out, groups, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (experts, out, groups), dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantizes_as_transformers(tmp_path, dtype):
    torch.manual_seed(0)
    experts, hidden, intermediate = 3, 64, 32
    gate_up = _gpt_oss_blocks(experts, 2 * intermediate, hidden)
    down = _gpt_oss_blocks(experts, hidden, intermediate)
    state = {
        "mlp.experts.gate_up_proj_blocks": gate_up[0],
        "mlp.experts.gate_up_proj_scales": gate_up[1],
        "mlp.experts.down_proj_blocks": down[0],
        "mlp.experts.down_proj_scales": down[1],
    }
    safetensors.torch.save_file(state, tmp_path / "mxfp4.safetensors")

    class Experts(nn.Module):  # gpt_oss's layout: [experts, in, out]
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(
                torch.empty(experts, hidden, 2 * intermediate, dtype=dtype)
            )
            self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden, dtype=dtype))

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = Experts()
    rules = KeyRemapper(
        [
            WeightConverter([f"{p}_blocks", f"{p}_scales"], p, [Mxfp4Dequantize(dtype)])
            for p in ("gate_up_proj", "down_proj")
        ]
    )
    assert load_remapped(tmp_path / "mxfp4.safetensors", model, rules) == []
    for proj, (blocks, scales) in (("gate_up_proj", gate_up), ("down_proj", down)):
        expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(getattr(model.mlp.experts, proj).detach(), expected), proj
    with pytest.raises(RemapError, match="MXFP4 is dequantized one way"):
        rules.save({n: (t.detach(), None) for n, t in model.state_dict().items()})


def test_mxfp4_arithmetic_by_hand():
    """Byte 0x2F: low nibble 0xF = -6, high 0x2 = 1.0; scale 128 = 2**1."""
    blocks = torch.tensor([[[[0x2F]]]], dtype=torch.uint8)  # [1, 1, 1, 1]
    scales = torch.tensor([[[128]]], dtype=torch.uint8)
    out = Mxfp4Dequantize(torch.float32).dequantize(blocks, scales)
    assert out.shape == (1, 2, 1) and out.flatten().tolist() == [-12.0, 2.0]
