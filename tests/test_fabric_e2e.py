"""A hand-written Fabric loop (tests/scripts/fabric_loop.py) SIGKILLed mid-epoch and run again:
its final weights and optimizer state are ``torch.equal`` to an uninterrupted run's, and every
rank sees the same samples from the save point on. One device (an adapter fine-tune, killed
while a checkpoint is being written) and DDP on 2 gloo ranks (killed, then preempted by a
SIGTERM to one rank). FSDP2: test_fabric_sharded.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.checkpointer import Checkpointer, list_checkpoints

from conftest import SCRIPTS, Finished, run_process

SCRIPT = SCRIPTS / "fabric_loop.py"
TIMEOUT_S = 240  # a run takes 5-20 s on 2 loaded cores; this only stops a hung one
STEPS = 20

pytestmark = pytest.mark.timeout(900)


def loop(root: Path, ids: Path, *args: object, out: Path | None = None) -> Finished:
    command = [sys.executable, SCRIPT, "--root", root, "--ids", ids, "--steps", STEPS, *args]
    if out is not None:
        command += ["--out", out]
    return run_process(command, timeout=TIMEOUT_S)


def succeeded(result: Finished) -> Finished:
    assert result.returncode == 0, f"exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def lines(ids: Path, rank: int = 0) -> list[str]:
    path = Path(f"{ids}.rank{rank}")
    return path.read_text().splitlines() if path.exists() else []


def assert_equal_states(a: Path, b: Path) -> None:
    with burnpack.read(a) as left, burnpack.read(b) as right:
        assert sorted(left.entries) == sorted(right.entries)
        assert any(name.startswith("optim.") for name in left.entries)
        for name in left.entries:
            assert torch.equal(left.tensor(name), right.tensor(name)), name


def complete(root: Path) -> list[int]:
    return sorted(e.number for e in list_checkpoints(root) if e.complete)


def test_one_device_adapter_run_killed_while_saving_resumes_bit_exactly(tmp_path):
    """Killed while checkpoint 10 is written (mid-epoch: 12 batches an epoch; asynchronous,
    one DataLoader worker): that torn checkpoint is never chosen, the run continues from 5."""
    base = tmp_path / "base.safetensors"
    options = ["--lora", base, "--every", 5, "--workers", 1, "--async-save"]
    succeeded(loop(tmp_path / "ref", tmp_path / "ref.ids", *options, out=tmp_path / "ref.bpk"))
    killed = loop(tmp_path / "run", tmp_path / "killed.ids", *options, "--kill-in-save", 10)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert complete(tmp_path / "run") == [5]
    assert (tmp_path / "run" / "ckpt.10").is_dir()  # its data, without a sentinel
    resumed = succeeded(
        loop(tmp_path / "run", tmp_path / "resumed.ids", *options, out=tmp_path / "run.bpk")
    )
    assert "RESTORED 5 rank=0" in resumed.stdout
    assert_equal_states(tmp_path / "ref.bpk", tmp_path / "run.bpk")
    reference = lines(tmp_path / "ref.ids")
    assert lines(tmp_path / "killed.ids") == reference[: len(lines(tmp_path / "killed.ids"))]
    assert lines(tmp_path / "resumed.ids") == reference[5:]
    # only the adapters (and their Adam moments) are in the checkpoints
    saved = Checkpointer(tmp_path / "run").load_checkpoint(STEPS)
    adapters = sorted(f"{i}.lora_{m}" for i in (0, 3, 4) for m in "AB")
    assert sorted(saved["model"].tensors) == adapters
    assert sorted(saved["optimizer"].paths.values()) == adapters
    assert all(
        set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["optimizer"].state.values()
    )


def test_ddp_killed_then_preempted_continues_exactly_on_every_rank(tmp_path):
    """DDP on 2 gloo ranks: SIGKILLed after step 10 (checkpoints 4 and 8 complete; 6 batches an
    epoch per rank), rerun and sent SIGTERM on rank 1 after step 13 (the ranks agree at step 14,
    save it and exit 0), rerun to the end."""
    ddp = ["--strategy", "ddp", "--devices", 2]
    succeeded(loop(tmp_path / "ref", tmp_path / "ref.ids", *ddp, out=tmp_path / "ref.bpk"))
    killed = loop(tmp_path / "run", tmp_path / "a.ids", *ddp, "--kill-at-step", 10)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert complete(tmp_path / "run") == [4, 8]
    preempted = succeeded(
        loop(tmp_path / "run", tmp_path / "b.ids", *ddp, "--term-at-step", 13, "--term-rank", 1)
    )
    assert "RESTORED 8 rank=0" in preempted.stdout and "RESTORED 8 rank=1" in preempted.stdout
    assert "preemption signal: saved checkpoint 14" in preempted.stderr
    assert "FINISHED" not in preempted.stdout
    assert complete(tmp_path / "run")[-1] == 14
    last = succeeded(loop(tmp_path / "run", tmp_path / "c.ids", *ddp, out=tmp_path / "run.bpk"))
    assert "RESTORED 14 rank=1" in last.stdout
    assert_equal_states(tmp_path / "ref.bpk", tmp_path / "run.bpk")
    for rank in (0, 1):
        reference = lines(tmp_path / "ref.ids", rank)
        assert lines(tmp_path / "a.ids", rank) == reference[:10]
        assert lines(tmp_path / "b.ids", rank) == reference[8:14]
        assert lines(tmp_path / "c.ids", rank) == reference[14:]
