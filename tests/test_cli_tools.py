"""The ``lightning-bpk`` console script's ls, verify, convert and diff, run as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bpk import burnpack, cli
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records.module import ModuleRecord

from conftest import MNIST_BPK, Finished, run_process

SCRIPT = Path(sys.executable).parent / "lightning-bpk"
FIXTURE = MNIST_BPK


def run(*args: object, stderr: int = subprocess.PIPE) -> Finished:
    """Run the installed console script; ``stderr`` may be a file descriptor (a pty)."""
    return run_process([SCRIPT, *args], stderr=stderr)


def main(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    """The same command line in-process (for detail checks; each command also runs as a process)."""
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _damage(path: Path) -> None:
    """Flip one byte inside the last tensor's data (the structure stays valid)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    checkpointer = Checkpointer(tmp_path / "run")
    for n in range(3):
        checkpointer.save_checkpoint(
            n, {"model": ModuleRecord.from_module(net), "trainer": {"step": n}}
        )
    return tmp_path / "run"


def test_script_is_installed():
    assert SCRIPT.exists(), "reinstall: .venv/bin/pip install -q -c constraints.txt -e '.[dev]'"


def test_ls_reports_complete_verified_size_time(run_dir):
    out = run("ls", run_dir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["number", "complete", "verified", "size", "time"]
    assert [line.split()[:3] for line in lines[1:]] == [[str(n), "yes", "yes"] for n in (2, 1, 0)]
    (run_dir / "sentinel_checkpoint_complete.2").unlink()  # as if the save of 2 crashed
    _damage(run_dir / "ckpt.1" / "model.bpk")
    out = run("ls", run_dir, "--json")
    assert out.returncode == 1  # damage found
    rows = {r["number"]: r for r in json.loads(out.stdout)["checkpoints"]}
    assert (rows[2]["complete"], rows[2]["verified"]) == (False, None)
    assert rows[1]["verified"] is False and "model.bpk" in rows[1]["problems"][0]
    assert rows[0]["verified"] is True and rows[0]["size"] > 0 and rows[0]["time"][:2] == "20"
    assert run("ls", run_dir / "missing").returncode == 2


def test_verify_files_and_directories(run_dir, tmp_path, capsys):
    model = run_dir / "ckpt.0" / "model.bpk"
    ok = run("verify", model)
    assert ok.returncode == 0 and "OK (7 tensors, 7 checksummed)" in ok.stdout  # BN buffers too
    code, out, _ = main(capsys, "verify", FIXTURE, "--json")  # Burn has no checksums: structure
    assert code == 0 and json.loads(out)["results"][0]["checksums"] == 0
    _damage(model)
    bad = run("verify", model)
    assert bad.returncode == 1 and "DAMAGED" in bad.stdout and "fails its checksum" in bad.stdout
    assert main(capsys, "verify", run_dir)[0] == 1
    assert main(capsys, "verify", run_dir / "ckpt.1")[0] == 0  # a plain directory of .bpk files
    truncated = tmp_path / "t.bpk"
    truncated.write_bytes(FIXTURE.read_bytes()[:5000])
    code, out, _ = main(capsys, "verify", truncated)
    assert code == 1 and "File truncated" in out
    missing = run("verify", tmp_path / "nope.bpk")
    assert missing.returncode == 2 and "nope.bpk" in missing.stderr


def test_convert_round_trip_and_refusals(run_dir, tmp_path, capsys):
    src = run_dir / "ckpt.2" / "model.bpk"
    st = tmp_path / "m.safetensors"
    out = run("convert", src, st, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["dst"] == str(st)
    assert main(capsys, "convert", st, tmp_path / "back.bpk")[0] == 0
    assert (tmp_path / "back.bpk").read_bytes() == src.read_bytes()
    assert main(capsys, "convert", run_dir / "ckpt.2", tmp_path / "serve.safetensors")[0] == 0
    assert (tmp_path / "serve.safetensors").read_bytes() == st.read_bytes()  # its model.bpk
    pt = tmp_path / "sd.pt"
    torch.save(nn.Linear(2, 2).state_dict(), pt)
    assert main(capsys, "convert", pt, tmp_path / "sd.bpk")[0] == 0
    assert burnpack.read(tmp_path / "sd.bpk").names == ["bias", "weight"]
    refused = run("convert", src, tmp_path / "out.ckpt")
    assert refused.returncode == 2 and "import format only" in refused.stderr
    code, _, err = main(capsys, "convert", tmp_path / "absent.safetensors", tmp_path / "x.bpk")
    assert code == 2 and "absent.safetensors" in err
    usage = run("convert", src)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_diff_names_shapes_dtypes_values(tmp_path, capsys):
    base = {"a": torch.zeros(3), "b": torch.ones(2, 2), "c": torch.arange(4), "d": torch.ones(2)}
    other = dict(base, a=torch.tensor([0.0, 0.5, 0.0]), b=torch.ones(4), c=torch.arange(4.0))
    del other["d"]
    other["e"] = torch.ones(1)
    pa = burnpack.write(tmp_path / "a.bpk", base)
    pb = burnpack.write(tmp_path / "b.bpk", other)
    same = run("diff", pa, pa)
    assert same.returncode == 0 and "4 tensors, 0 differ" in same.stdout
    out = run("diff", pa, pb, "--json")
    assert out.returncode == 1
    rows = {r["name"]: r for r in json.loads(out.stdout)["tensors"]}
    assert rows["a"]["status"] == "values differ" and rows["a"]["max_abs_diff"] == 0.5
    assert rows["b"]["status"] == "shape differs"
    assert rows["c"]["status"] == "dtype differs" and rows["c"]["max_abs_diff"] == 0.0
    assert rows["d"]["status"] == "only in A" and rows["e"]["status"] == "only in B"
    text = main(capsys, "diff", pa, pb)[1]
    assert "[2, 2] vs [4]" in text and "int64 vs float32" in text
    close = burnpack.write(tmp_path / "close.bpk", dict(base, a=torch.tensor([0.0, 1e-7, 0.0])))
    assert main(capsys, "diff", pa, close)[0] == 1
    assert main(capsys, "diff", pa, close, "--atol", "1e-6")[0] == 0
    st = tmp_path / "a.safetensors"
    assert main(capsys, "convert", pa, st)[0] == 0
    assert main(capsys, "diff", pa, st)[0] == 0  # across formats


def test_progress_only_on_a_terminal(tmp_path):
    pipe = run("convert", FIXTURE, tmp_path / "p.safetensors")
    assert pipe.returncode == 0 and pipe.stderr == ""
    leader, follower = os.openpty()
    try:
        out = run("convert", FIXTURE, tmp_path / "t.safetensors", stderr=follower)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the pty reports EIO once the child side is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
    assert out.returncode == 0
    assert b"convert mnist-model.bpk 18/18" in seen
