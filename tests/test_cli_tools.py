"""The ``lightning-bpk`` console script's ls, verify, convert and diff, run as real subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bpk import burnpack, cli
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import LrSchedulerRecord
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


def test_diff_compares_scalars_and_metadata(tmp_path, capsys):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    before = LrSchedulerRecord.from_scheduler(scheduler).save(tmp_path / "s0.bpk")
    optimizer.step()
    scheduler.step()
    after = LrSchedulerRecord.from_scheduler(scheduler).save(tmp_path / "s1.bpk")
    assert main(capsys, "diff", before, before)[0] == 0
    code, out, _ = main(capsys, "diff", before, after, "--json")
    assert code == 1  # no tensors at all, yet they differ
    report = json.loads(out)
    assert report["identical"] is False and report["tensors"] == []
    rows = {r["name"]: r for r in report["scalars"]}
    assert rows["last_epoch"]["status"] == "values differ"
    assert (rows["last_epoch"]["a"]["value"], rows["last_epoch"]["b"]["value"]) == (0, 1)
    assert rows["step_size"]["status"] == "same"
    text = main(capsys, "diff", before, after)[1]
    assert re.search(r"scalar +last_epoch +values differ +Int\(0\) +Int\(1\)", text)

    tensors = {"w": torch.ones(2)}
    a = burnpack.write(tmp_path / "a.bpk", tensors, metadata={"note": "first", "same": "x"})
    b = burnpack.write(tmp_path / "b.bpk", tensors, metadata={"note": "second", "same": "x"})
    code, out, _ = main(capsys, "diff", a, b, "--json")
    assert code == 1
    assert [(r["name"], r["status"]) for r in json.loads(out)["metadata"]] == [
        ("note", "values differ"),
        ("same", "same"),
    ]
    assert json.loads(out)["metadata_only"] is True
    # a metadata-only difference need not fail a comparison of weights
    code, out, _ = main(capsys, "diff", a, b, "--json", "--ignore-metadata")
    assert code == 0 and json.loads(out)["identical"] and json.loads(out)["metadata_only"]
    assert "note" in main(capsys, "diff", a, b, "--ignore-metadata")[1]  # still shown
    other = burnpack.write(tmp_path / "c.bpk", {"w": torch.zeros(2)}, metadata={"note": "x"})
    assert main(capsys, "diff", a, other, "--ignore-metadata")[0] == 1  # tensors still count


def test_diff_of_two_checkpoint_directories(run_dir, tmp_path, capsys):
    code, out, _ = main(capsys, "diff", run_dir / "ckpt.0", run_dir / "ckpt.1", "--json")
    assert code == 1
    files = {f["file"]: f for f in json.loads(out)["files"]}
    assert sorted(files) == ["model.bpk", "trainer.bpk"]
    assert files["model.bpk"]["identical"]  # the same net was saved twice
    assert not files["trainer.bpk"]["identical"]
    assert [r["name"] for r in files["trainer.bpk"]["scalars"] if r["status"] != "same"] == ["step"]
    text = main(capsys, "diff", run_dir / "ckpt.0", run_dir / "ckpt.1")[1]
    assert "model.bpk: same" in text and "trainer.bpk: differs" in text
    assert text.rstrip().endswith("2 files, 1 differ")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir / "ckpt.1", copy)
    assert main(capsys, "diff", run_dir / "ckpt.1", copy)[0] == 0
    (copy / "trainer.bpk").unlink()
    code, out, _ = main(capsys, "diff", run_dir / "ckpt.1", copy)
    assert code == 1 and "trainer.bpk: only in A" in out
    # a directory beside a file stands for its model, as in `convert`
    assert main(capsys, "diff", run_dir / "ckpt.1", run_dir / "ckpt.0" / "model.bpk")[0] == 0


def test_ls_and_verify_find_a_run_directorys_checkpoints(run_dir, tmp_path, capsys):
    run = tmp_path / "exp1"
    run.mkdir()
    run_dir.rename(run / "checkpoints")  # where BurnpackCheckpoint saves by default
    code, out, _ = main(capsys, "ls", run)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"{run / 'checkpoints'}:" and lines[1].split()[0] == "number"
    assert [line.split()[0] for line in lines[2:]] == ["2", "1", "0"]
    code, out, _ = main(capsys, "verify", run)
    assert code == 0 and out.splitlines()[0] == "checkpoint 2: OK"
    assert main(capsys, "ls", tmp_path)[1].strip() == f"{tmp_path}: no checkpoints"


def test_verify_fails_a_done_sentinel_without_trainer_bpk(run_dir, capsys):
    (run_dir / "sentinel_checkpoint_complete.2").write_bytes(b"done")  # Dopamine-style
    (run_dir / "ckpt.2" / "trainer.bpk").unlink()
    code, out, _ = main(capsys, "verify", run_dir)
    assert code == 1
    assert "checkpoint 2: DAMAGED" in out and "trainer.bpk: missing" in out
    code, out, err = main(capsys, "verify", run_dir, "--require", "")  # any keys will do
    assert code == 0 and "checkpoint 2: OK" in out
    assert "lightning-bpk verify: warning: checkpoint 2 in" in err  # unverifiable, said once
    assert main(capsys, "ls", run_dir)[0] == 1


def test_inspect_and_diff_escape_control_characters(tmp_path, capsys):
    hostile = "w\x1b[2J\x07\r\u202e"  # clear screen, bell, carriage return, bidi override
    path = burnpack.write(
        tmp_path / "evil.bpk", {hostile: torch.ones(1)}, metadata={"k\x1b]0;t\x07": "v\x1b[31m"}
    )
    other = burnpack.write(tmp_path / "other.bpk", {hostile: torch.zeros(1)})
    for args in (("inspect", path), ("diff", path, other, "--all")):
        code, out, _ = main(capsys, *args)
        assert code in (0, 1)
        assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
        assert "w\\x1b[2J\\x07\\r\\u202e" in out
    info = json.loads(main(capsys, "inspect", path, "--json")[1])  # JSON escapes them itself
    assert info["tensors"][0]["name"] == hostile and info["metadata"] == {
        "k\x1b]0;t\x07": "v\x1b[31m"
    }


def test_ls_shows_a_symlinked_sentinels_own_time_and_verify_refuses_it(run_dir, capsys):
    """A sentinel replaced by a symlink (to /dev/zero): ``ls`` never follows it for its time
    column (it showed the target's), and ``verify`` refuses the link."""
    sentinel = run_dir / "sentinel_checkpoint_complete.1"
    sentinel.unlink()
    sentinel.symlink_to("/dev/zero")
    os.utime(sentinel, (86400 * 365, 86400 * 365), follow_symlinks=False)  # 1971
    code, out, _ = main(capsys, "ls", run_dir, "--json")
    assert code == 1  # damage found
    rows = {r["number"]: r for r in json.loads(out)["checkpoints"]}
    assert rows[1]["time"][:4] in ("1970", "1971"), rows[1]  # the link's own, in any zone
    assert rows[1]["verified"] is False and "symlink" in " ".join(rows[1]["problems"])
    assert main(capsys, "verify", run_dir)[0] == 1
