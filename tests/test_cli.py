"""Tests of the ``lightning-bpk`` command line, driven through the real console script."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack, cli
from lightning_bpk.cli._output import dtype_text

from conftest import MNIST_BPK, Finished, run_process

SCRIPT = Path(sys.executable).with_name("lightning-bpk")
MNIST = MNIST_BPK


def run(*args: str, module: bool = False) -> Finished:
    command = [sys.executable, "-m", "lightning_bpk"] if module else [str(SCRIPT)]
    return run_process([*command, *args])


@pytest.fixture(scope="module")
def pack_path(tmp_path_factory) -> Path:
    return burnpack.write(
        tmp_path_factory.mktemp("cli") / "demo",
        {
            "fc.weight": burnpack.TensorEntry.from_tensor(torch.ones(3, 2), param_id=7),
            "mask": torch.tensor([True, False]),
        },
        scalars={"epoch": 3, "lr": 0.5, "nan": float("nan")},
        metadata={"producer": "test"},
    )


def test_every_command_is_registered_with_a_handler():
    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == ["convert", "diff", "inspect", "ls", "verify"]
    for name, command in sub.choices.items():
        assert callable(command.get_default("func")), name
        assert any("--json" in a.option_strings for a in command._actions), name


def test_console_script_is_installed():
    assert SCRIPT.exists(), f"run: .venv/bin/pip install -e '.[dev]' (missing {SCRIPT})"


def test_inspect_text_shows_header_tensors_scalars_metadata(pack_path):
    out = run("inspect", str(pack_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    size = pack_path.stat().st_size
    assert f"file {size} bytes" in text and "burnpack v1" in text and "data section at" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name"))
    assert lines[header].split() == ["name", "dtype", "shape", "bytes", "param_id", "checksum"]
    assert lines[header + 1].split() == ["fc.weight", "F32", "[3,", "2]", "24", "7", "xxh3"]
    assert lines[header + 2].split() == ["mask", "Bool(Native)", "[2]", "2", "-", "xxh3"]
    assert "epoch = Int(3)" in text and "lr = Float(0.5)" in text
    assert "producer = 'test'" in text


def test_inspect_json_is_machine_readable(pack_path):
    out = run("inspect", str(pack_path), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)  # strict JSON: NaN is reported as text
    assert info["header"] == {
        "version": 1,
        "metadata_size": info["header"]["metadata_size"],
        "data_start": 512,
        "file_size": pack_path.stat().st_size,
    }
    assert [t["name"] for t in info["tensors"]] == ["fc.weight", "mask"]
    weight = info["tensors"][0]
    assert (weight["dtype"], weight["shape"], weight["bytes"], weight["param_id"]) == (
        "F32",
        [3, 2],
        24,
        7,
    )
    assert len(weight["checksum"]) == 16
    assert info["tensors"][1]["dtype"] == {"Bool": "Native"}
    assert info["scalars"]["epoch"] == {"kind": "Int", "value": 3}
    assert info["scalars"]["nan"] == {"kind": "Float", "value": "nan"}
    assert info["metadata"] == {"producer": "test"}


def test_python_dash_m_works_and_adds_the_suffix(pack_path):
    out = run("inspect", str(pack_path.with_suffix("")), "--json", module=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["file"] == str(pack_path)


def test_bad_file_exits_2_naming_the_file(tmp_path):
    bad = tmp_path / "broken.bpk"
    bad.write_bytes(b"NRUB\x02\x00\x00\x00\x00\x00")
    out = run("inspect", str(bad))
    assert out.returncode == 2
    assert str(bad) in out.stderr and "version" in out.stderr and out.stdout == ""
    missing = run("inspect", str(tmp_path / "absent.bpk"))
    assert missing.returncode == 2 and "absent.bpk" in missing.stderr


def test_usage_errors_exit_2():
    assert run().returncode == 2
    assert run("frobnicate").returncode == 2


def test_main_in_process_on_burn_fixture(capsys):
    assert cli.main(["inspect", str(MNIST), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["tensors"]) == 18 and info["tensors"][0]["name"] == "conv1.conv.weight"
    assert info["header"]["data_start"] == 1536
    assert all(t["checksum"] is None for t in info["tensors"])


def test_qfloat_dtype_label():
    scheme = {"value": "Q8F", "store": "Native", "mode": "Symmetric", "tensor": None, "block": None}
    assert dtype_text({"QFloat": scheme}) == "QFloat(Q8F)"
    assert dtype_text({"Bool": "U32"}) == "Bool(U32)"
    assert dtype_text("BF16") == "BF16"
