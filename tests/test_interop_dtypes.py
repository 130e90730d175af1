"""Every dtype torch and safetensors share, through ``.safetensors`` <-> ``.bpk`` and the
command line: byte-identical round trips, files as the ``safetensors`` package writes them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from lightning_bpk import burnpack, cli
from lightning_bpk.interop import SAFETENSORS_INFO_KEY, convert, read_content
from lightning_bpk.records.base import RecordError

ST_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.complex64,
]  # fmt: skip


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bits of ``dtype`` (every bit pattern, NaNs included: compared as bytes)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def mixed_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        f"layer.{k}.{str(d).removeprefix('torch.')}": _random(d, (3, 2))
        for k, d in enumerate(ST_DTYPES)
    }


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def test_every_dtype_round_trips_safetensors_bpk_byte_identically(tmp_path):
    state = mixed_state()
    original = tmp_path / "model.safetensors"
    safetensors.torch.save_file(state, original, metadata={"format": "pt"})  # as transformers
    bpk = convert(original, tmp_path / "model.bpk")
    back = convert(bpk, tmp_path / "back.safetensors")
    assert back.read_bytes() == original.read_bytes()
    pack = burnpack.read(bpk)
    for name, tensor in state.items():
        got = pack.tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert bytes(burnpack.tensor_bytes(got)) == bytes(burnpack.tensor_bytes(tensor)), name
    again = convert(back, tmp_path / "again.bpk")
    assert again.read_bytes() == bpk.read_bytes()
    official = safetensors.torch.load_file(back)
    assert official.keys() == state.keys()
    assert all(official[n].dtype == t.dtype for n, t in state.items())


def test_a_bpk_with_every_dtype_round_trips_through_safetensors(tmp_path):
    state = mixed_state()
    state["z128"] = torch.randn(2, dtype=torch.complex128)  # only .bpk can hold this one
    bpk = burnpack.write(tmp_path / "a.bpk", state, metadata={"note": "x"})
    with pytest.raises(RecordError, match=r"tensor 'z128'.*complex128 has no safetensors"):
        convert(bpk, tmp_path / "a.safetensors")
    del state["z128"]
    bpk = burnpack.write(tmp_path / "a.bpk", state, metadata={"note": "x"})
    st = convert(bpk, tmp_path / "a.safetensors")
    meta = _header(st)["__metadata__"]
    assert meta["format"] == "pt" and meta["note"] == "x"
    assert json.loads(meta[SAFETENSORS_INFO_KEY])["format_added"] is True
    assert convert(st, tmp_path / "b.bpk").read_bytes() == bpk.read_bytes()


def test_written_safetensors_say_format_pt_and_inject_nothing(tmp_path):
    state = {"b": torch.ones(2), "a": torch.zeros(3, dtype=torch.float16)}
    original = tmp_path / "o.safetensors"
    safetensors.torch.save_file(state, original, metadata={"format": "pt"})
    content = read_content(original)
    assert content.metadata["format"] == "pt"
    st = convert(convert(original, tmp_path / "o.bpk"), tmp_path / "c.safetensors")
    assert _header(st)["__metadata__"] == {"format": "pt"}  # nothing of ours
    with safetensors.safe_open(st, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_fp4_shape_counts_values_in_the_header(tmp_path):
    packed = torch.tensor([[0x21, 0x43]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    st = tmp_path / "f4.safetensors"
    safetensors.torch.save_file({"w": packed}, st)
    assert _header(st)["w"]["shape"] == [1, 4]
    assert read_content(st).tensors["w"].shape == (1, 2)
    bad = bytearray(st.read_bytes())
    bad[:] = bad.replace(b'"shape":[1,4]', b'"shape":[1,3]')
    st.write_bytes(bytes(bad))
    with pytest.raises(RecordError, match="tensor 'w'"):
        read_content(st)


def _cli(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str]:
    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().out


def test_fp8_and_complex_files_pass_inspect_verify_convert_diff(tmp_path, capsys):
    state = {
        "w8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "scale": torch.tensor([2.0**-3], dtype=torch.float32).to(torch.float8_e8m0fnu),
        "z": torch.randn(3, dtype=torch.complex64),
    }
    st = tmp_path / "q.safetensors"
    safetensors.torch.save_file(state, st, metadata={"format": "pt"})
    bpk = tmp_path / "q.bpk"
    assert _cli(capsys, "convert", st, bpk)[0] == 0
    for path in (st, bpk):
        code, out = _cli(capsys, "inspect", path, "--json")
        assert code == 0, path
        rows = {t["name"]: t for t in json.loads(out)["tensors"]}
        assert rows["w8"]["shape"] == [4, 4]
        assert _cli(capsys, "verify", path)[0] == 0
    code, out = _cli(capsys, "inspect", bpk, "--json")
    rows = {t["name"]: t for t in json.loads(out)["tensors"]}
    assert rows["w8"]["torch_dtype"] == "float8_e4m3fn" and rows["z"]["shape"] == [3, 2]
    assert "U8 as float8_e4m3fn" in _cli(capsys, "inspect", bpk)[1]
    code, out = _cli(capsys, "inspect", st, "--json")
    assert {t["name"]: t["dtype"] for t in json.loads(out)["tensors"]} == {
        "scale": "F8_E8M0",
        "w8": "F8_E4M3",
        "z": "C64",
    }
    assert _cli(capsys, "diff", st, bpk)[0] == 0
    other = dict(state, w8=(state["w8"].float() * 2).to(torch.float8_e4m3fn))
    safetensors.torch.save_file(other, tmp_path / "r.safetensors", metadata={"format": "pt"})
    code, out = _cli(capsys, "diff", bpk, tmp_path / "r.safetensors", "--json")
    assert code == 1
    rows = {r["name"]: r for r in json.loads(out)["tensors"]}
    assert rows["w8"]["status"] == "values differ" and rows["z"]["status"] == "same"
