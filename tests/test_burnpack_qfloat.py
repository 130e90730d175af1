"""Burn's QFloat tensors decoded and encoded by the scheme's arithmetic, checked on small cases
computed by hand, through a real .bpk file."""

from __future__ import annotations

import struct

import cbor2
import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import qfloat
from lightning_bpk.burnpack.base import HEADER_SIZE


def _through_file(entry: burnpack.TensorEntry) -> tuple[bytes, burnpack.Pack]:
    data = burnpack.dumps({"q": entry})
    return data, burnpack.loads(data)


def test_q8s_per_tensor_by_hand():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    data, pack = _through_file(qfloat.encode(x, "Q8S"))
    scale = struct.unpack("<f", struct.pack("<f", 4.0 / 127))[0]  # max|x| / 127, as f32
    # 1/scale = 31.75 -> 32; -2 -> -63.5 -> -64 (ties to even); 0.5 -> 15.875 -> 16; 4 -> 127
    assert bytes(pack.raw("q")) == bytes([32, 0xC0, 16, 127]) + struct.pack("<f", scale)
    expected = torch.tensor([[32.0, -64.0], [16.0, 127.0]]) * scale
    info = pack.entries["q"]
    assert torch.equal(qfloat.decode(info.dtype, info.shape, pack.raw("q")), expected)
    size = int.from_bytes(data[6:10], "little")
    dtype = cbor2.loads(data[HEADER_SIZE : HEADER_SIZE + size])["tensors"]["q"]["dtype"]
    assert list(dtype["QFloat"]) == ["value", "store", "mode", "tensor", "block"]  # Burn's order
    assert dtype["QFloat"]["tensor"] == "F32" and dtype["QFloat"]["block"] is None


def test_q8s_block_scales_by_hand():
    """Blocks of 2 along the last dim of a [2, 4] tensor: a 2x2 grid of scales, row-major."""
    x = torch.tensor([[1.0, -2.0, 0.0, 0.0], [0.25, 0.5, 127.0, -63.5]])
    entry = qfloat.encode(x, "Q8S", block=[2])
    assert entry.dtype["QFloat"]["block"] == {
        "size": {"storage": [2, 0, 0, 0, 0], "len": 1},
        "dtype": "F32",
    }
    _, pack = _through_file(entry)
    raw = bytes(pack.raw("q"))
    # [1, -2] / (2/127) = 63.5 -> 64 (ties to even), -127 = 0x81; [0, 0] stay 0;
    # [0.25, 0.5] / (0.5/127) = 63.5 -> 64, 127; [127, -63.5] / 1 = 127, -63.5 -> -64 = 0xC0
    assert raw[:8] == bytes([64, 0x81, 0, 0, 64, 127, 127, 0xC0])
    scales = struct.unpack("<4f", raw[8:])
    assert scales == pytest.approx([2 / 127, 1.0, 0.5 / 127, 1.0])  # an all-zero block keeps 1
    decoded = qfloat.decode(entry.dtype, entry.shape, raw)
    torch.testing.assert_close(decoded, x, atol=0.02, rtol=0.02)
    assert decoded[1, 2].item() == pytest.approx(127.0)


def test_fp8_values_and_q8f():
    x = torch.tensor([1.0, -2.0, 0.5, 4.0])
    e4m3 = qfloat.encode(x, "E4M3")  # scale 4/448: the values become 112, -224, 56, 448
    stored = torch.frombuffer(bytearray(e4m3.data[:4]), dtype=torch.float8_e4m3fn).float()
    assert stored.tolist() == [112.0, -224.0, 56.0, 448.0]
    torch.testing.assert_close(qfloat.decode(e4m3.dtype, (4,), e4m3.data), x)
    e5m2 = qfloat.encode(x, "E5M2")
    torch.testing.assert_close(qfloat.decode(e5m2.dtype, (4,), e5m2.data), x)
    q8f = qfloat.encode(torch.tensor([-127.5, 127.5, 1.0, 0.0]), "Q8F")  # scale 127.5/127.5
    assert bytes(q8f.data[:4]) == bytes([0x80, 127, 1, 0])  # -127.5 -> -128: the full range
    assert struct.unpack("<f", bytes(q8f.data[4:])) == (1.0,)


def test_packed_u32_reads_the_same_bytes_and_unknown_schemes_are_named():
    entry = qfloat.encode(torch.tensor([1.0, -2.0, 0.5]), "Q8S")
    packed = {"QFloat": {**entry.dtype["QFloat"], "store": {"PackedU32": 0}}}
    assert len(entry.data) == 8  # 3 values padded to a word, then the scale
    torch.testing.assert_close(
        qfloat.decode(packed, (3,), entry.data), qfloat.decode(entry.dtype, (3,), entry.data)
    )
    q4 = {"QFloat": {**entry.dtype["QFloat"], "value": "Q4F"}}
    with pytest.raises(burnpack.ValidationError, match=r"value='Q4F'.*only 8-bit values"):
        qfloat.decode(q4, (3,), entry.data)
    with pytest.raises(burnpack.ValidationError, match="7 bytes, expected 8"):
        qfloat.decode(entry.dtype, (3,), entry.data[:7])
    with pytest.raises(burnpack.ValidationError, match=r"block \[3\] does not divide"):
        qfloat.encode(torch.zeros(2, 4), block=[3])
