"""The command line on checkpoint sets and plain .safetensors files: inspect, ls, verify,
convert (to one file, or to a sharded set with its index) and diff, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lightning_bpk.cli import EXIT_BAD_FILE, EXIT_FOUND, EXIT_OK, main
from lightning_bpk.interop.formats import Content
from lightning_bpk.interop.sets import describe_set, write_set

g = torch.Generator().manual_seed(9)
TENSORS = {f"layers.{i}.w": torch.randn(8, 8, generator=g) for i in range(5)}


@pytest.fixture(scope="module")
def bpk_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-set")
    return write_set(Content(dict(TENSORS)), root / "set", max_shard_size=600, suffix=".bpk")


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_inspect_and_ls_a_set(bpk_set, capsys):
    assert main(["inspect", str(bpk_set.parent), "--json"]) == EXIT_OK
    info = _json(capsys)
    assert info["format"] == "set" and len(info["shards"]) == 3
    assert [t["name"] for t in info["tensors"]] == list(TENSORS)
    assert info["tensors"][4]["file"].endswith("model-00003-of-00003.bpk")
    assert main(["inspect", str(bpk_set)]) == EXIT_OK
    assert "shards (3):" in capsys.readouterr().out
    assert main(["ls", str(bpk_set.parent), "--json"]) == EXIT_OK
    assert [s["tensors"] for s in _json(capsys)["shards"]] == [2, 2, 1]


def test_inspect_a_plain_safetensors_file(tmp_path, capsys):
    path = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"b": torch.ones(2, 3, dtype=torch.bfloat16)}, path)
    assert main(["inspect", str(path), "--json"]) == EXIT_OK
    (tensor,) = _json(capsys)["tensors"]
    assert (tensor["name"], tensor["dtype"], tensor["shape"], tensor["bytes"]) == (
        "b",
        "BF16",
        [2, 3],
        12,
    )
    assert main(["verify", str(path)]) == EXIT_OK


def test_verify_a_set_names_the_damaged_shard(bpk_set, tmp_path, capsys):
    assert main(["verify", str(bpk_set)]) == EXIT_OK
    assert "5 tensors, 5 checksummed" in capsys.readouterr().out
    damaged = tmp_path / "set"
    damaged.mkdir()
    for path in bpk_set.parent.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    shard = describe_set(damaged).weight_map["layers.2.w"]
    data = bytearray((damaged / shard).read_bytes())
    data[-10] ^= 0xFF  # inside the shard's last tensor, layers.3.w
    (damaged / shard).write_bytes(bytes(data))
    assert main(["verify", str(damaged)]) == EXIT_FOUND
    out = capsys.readouterr().out
    assert "DAMAGED" in out and f"{shard}: tensor 'layers.3.w' fails its checksum" in out


def test_convert_a_set_to_a_file_and_to_a_sharded_set_then_diff(bpk_set, tmp_path, capsys):
    single = tmp_path / "one.safetensors"
    assert main(["convert", str(bpk_set), str(single)]) == EXIT_OK
    loaded = safetensors.torch.load_file(single)
    assert all(torch.equal(loaded[n], t) for n, t in TENSORS.items())
    resharded = tmp_path / "resharded"
    args = ["convert", str(single), str(resharded), "--max-shard-size", "300B"]
    assert main(args) == EXIT_OK
    capsys.readouterr()
    assert len(describe_set(resharded).shards) == 5
    assert main(["diff", str(bpk_set.parent), str(resharded), "--json"]) == EXIT_OK
    assert _json(capsys)["identical"]
    assert main(["diff", str(resharded), str(single)]) == EXIT_OK
    # a set is never written over an existing directory
    assert main(args) == EXIT_BAD_FILE
    assert "exists" in capsys.readouterr().err
    assert main(["convert", str(single), str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2


def test_a_pytorch_model_bin_set_is_refused(tmp_path, capsys):
    torch.save({"w": torch.ones(1)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    index = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    for command in (
        ["inspect", str(tmp_path)],
        ["convert", str(tmp_path), str(tmp_path / "o.bpk")],
    ):
        assert main(command) == EXIT_BAD_FILE
        assert "unpickles nothing but tensors" in capsys.readouterr().err
