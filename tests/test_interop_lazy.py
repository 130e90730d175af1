"""open_tensors: a file or set opened lazily, slices reading only their own bytes."""

from __future__ import annotations

import pytest
import safetensors
import safetensors.torch
import torch

from lightning_bpk import burnpack
from lightning_bpk.interop import Content, open_tensors, write_set
from lightning_bpk.records import RecordChecksumError


@pytest.fixture()
def files(tmp_path):
    torch.manual_seed(0)
    state = {
        "big": torch.randn(64, 256),  # 64 KiB
        "mask": torch.tensor([[True, False], [False, True]]),
        "w8": torch.randn(8, 4).to(torch.float8_e4m3fn),
    }
    st = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, st, metadata={"format": "pt"})
    bpk = burnpack.write(tmp_path / "m.bpk", state)
    return state, {"safetensors": st, "bpk": bpk}


@pytest.mark.parametrize("kind", ["safetensors", "bpk"])
def test_slices_equal_safe_open_and_read_only_their_bytes(files, kind):
    state, paths = files
    with safetensors.safe_open(paths["safetensors"], framework="pt") as ref:
        expected = ref.get_slice("big")[16:32]
    with open_tensors(paths[kind]) as f:
        assert list(f.keys()) == list(f.keys()) and set(f.keys()) == set(state)
        assert f.get_shape("big") == (64, 256) and f.get_dtype("w8") == torch.float8_e4m3fn
        part = f.get_slice("big")
        assert part.get_shape() == (64, 256) and part.get_dtype() == torch.float32
        assert torch.equal(part[16:32], expected)
        assert f.bytes_read == 16 * 256 * 4  # a quarter of the tensor, not all of it
        assert torch.equal(part[:, 3], state["big"][:, 3])  # one element per row
        assert f.bytes_read == 16 * 256 * 4 + 64 * 4
        assert torch.equal(part[5, 10:20:3], state["big"][5, 10:20:3])
        assert torch.equal(part[..., -1], state["big"][..., -1])
        assert torch.equal(f.get_slice("mask")[1], state["mask"][1])
        w8 = f.get_slice("w8")[2:4]
        assert w8.dtype == torch.float8_e4m3fn
        assert torch.equal(w8.view(torch.uint8), state["w8"][2:4].view(torch.uint8))
        assert torch.equal(f.get_tensor("big"), state["big"])
        # partial reads of a .bpk cannot be checked against a whole-tensor checksum: said so
        assert f.unverified == ({"big", "mask", "w8"} if kind == "bpk" else set())
        with pytest.raises(IndexError, match="'big': 3 indices for 2 dims"):
            part[1, 2, 3]
        with pytest.raises(IndexError, match="out of range"):
            part[64]
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.get_slice("nope")


def test_a_whole_slice_is_verified_a_partial_one_is_not(files, tmp_path):
    _, paths = files
    data = bytearray(paths["bpk"].read_bytes())
    with burnpack.read(paths["bpk"]) as pack:
        start = pack.data_start + pack.entries["big"].data_offsets[0]
    data[start + 100 * 4] ^= 0xFF  # row 0, column 100 of "big"
    damaged = tmp_path / "damaged.bpk"
    damaged.write_bytes(bytes(data))
    with open_tensors(damaged) as f:
        assert f.get_slice("big")[1:].shape == (63, 256)  # not the damaged row: read, unchecked
        assert f.unverified == {"big"}
        with pytest.raises(RecordChecksumError, match="big"):
            f.get_slice("big")[:]
        with pytest.raises(RecordChecksumError, match="big"):
            f.get_tensor("big")


def test_a_set_is_sliced_across_its_shards(files, tmp_path):
    state, _ = files
    index = write_set(Content(dict(state)), tmp_path / "set", max_shard_size="40KB")
    with open_tensors(index) as f:
        assert torch.equal(f.get_slice("big")[:, 100:104], state["big"][:, 100:104])
        assert f.bytes_read == 64 * 4 * 4
        assert f.metadata() == {}
