"""End to end, real subprocesses: SIGKILL mid-epoch, start again, end bit-identical; disk full."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk.checkpointer import get_latest_checkpoint_number, verify_checkpoint
from lightning_bpk.records import ModuleRecord

from conftest import TINY_REFERENCE_EPOCHS, TINY_SCRIPT, Finished, run_process

SCRIPT = TINY_SCRIPT
RUN_TIMEOUT = 90  # seconds per training subprocess; a hang fails the test instead of blocking CI
EPOCHS = TINY_REFERENCE_EPOCHS  # the shared reference run's length
BATCHES_PER_EPOCH = 6  # lightning_tiny: 48 samples, batch size 8

pytestmark = pytest.mark.timeout(4 * RUN_TIMEOUT)


def run(root: Path, *args: str) -> Finished:
    """Run the tiny training script to completion (or death) and return the process."""
    command = [sys.executable, SCRIPT, "--root", root, "--epochs", EPOCHS, *args]
    return run_process(command, timeout=RUN_TIMEOUT)


def params(path: Path) -> dict[str, torch.Tensor]:
    return ModuleRecord.load(path).tensors


@pytest.fixture
def reference(tiny_reference) -> Path:
    """The session's uninterrupted run (conftest's ``tiny_reference``, shared with
    test_preemption; checkpoint triggers do not change training): ``ref.bpk`` holds its final
    weights, ``ref.ids`` its batches, ``ref/`` its checkpoints."""
    return tiny_reference


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path, reference):

    kill_step = 2 * BATCHES_PER_EPOCH + 3  # in the middle of epoch 2
    killed = run(tmp_path / "run", "--kill-at-step", str(kill_step))
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "checkpoints"
    assert get_latest_checkpoint_number(checkpoints) == 1

    resumed = run(tmp_path / "run", "--out", str(tmp_path / "resumed.bpk"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from checkpoint" in resumed.stderr
    assert "continuing training at epoch 2 (global step 12) after checkpoint 1" in resumed.stderr
    assert f"epoch={EPOCHS} step={EPOCHS * BATCHES_PER_EPOCH} restored=1" in resumed.stdout

    expected, got = params(reference / "ref.bpk"), params(tmp_path / "resumed.bpk")
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name  # bitwise, not allclose
    for n in range(EPOCHS):  # the resumed run's checkpoints match the reference run's too
        ref_model = params(reference / "ref" / "checkpoints" / f"ckpt.{n}" / "model.bpk")
        run_model = params(checkpoints / f"ckpt.{n}" / "model.bpk")
        assert all(torch.equal(ref_model[k], run_model[k]) for k in ref_model), n


def _lines_from(path: Path, step: int) -> list[str]:
    """Id-log lines (``epoch batch_idx global_step ids``) of batches after global step ``step``."""
    return [line for line in path.read_text().splitlines() if int(line.split()[2]) >= step]


def test_sigkill_at_several_points_with_step_checkpoints_continues_exactly(tmp_path, reference):
    """Checkpoints every 4 steps (6 batches per epoch). Killed mid-epoch between saves (10),
    on the last batch of an epoch before its save (12: the second resume within epoch 1) and
    right after a save (16); every restart sees the uninterrupted run's batches from its
    checkpoint on, none replayed, none skipped, and the end is bit-identical."""
    root, ids = tmp_path / "run", tmp_path / "run.ids"
    common = ["--every-n-steps", "4", "--ids", str(ids)]
    resumed_from = []
    for kill in (10, 12, 16, None):
        before = len(ids.read_text().splitlines()) if ids.exists() else 0
        latest = get_latest_checkpoint_number(root / "checkpoints") if root.exists() else -1
        extra = ["--kill-at-step", str(kill)] if kill else ["--out", str(tmp_path / "resumed.bpk")]
        process = run(root, *common, *extra)
        assert process.returncode == (-signal.SIGKILL if kill else 0), process.stderr
        lines = ids.read_text().splitlines()[before:]
        start = max(latest, 0)  # step-numbered: checkpoint N was saved after global step N
        assert lines == _lines_from(reference / "ref.ids", start)[: len(lines)]
        assert int(lines[0].split()[2]) == start
        resumed_from.append(latest)
    assert resumed_from == [-1, 8, 8, 16]
    expected, got = params(reference / "ref.bpk"), params(tmp_path / "resumed.bpk")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_file_size_limit_fails_the_save_and_keeps_earlier_checkpoints(tmp_path):
    # From the first step of epoch 1 on no file may exceed 1 KiB (RLIMIT_FSIZE, SIGXFSZ ignored):
    # checkpoint 0 is written before, checkpoint 1's model/optimizer files cannot be.
    failed = run(tmp_path, "--fsize-limit", "1024", "--fsize-at-step", str(BATCHES_PER_EPOCH + 1))
    assert failed.returncode == 1
    assert "CheckpointSaveError: saving checkpoint 1 into" in failed.stderr
    assert (
        "File too large" in failed.stderr and "earlier checkpoints are untouched" in failed.stderr
    )
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "ckpt.0",
        "sentinel_checkpoint_complete.0",
    ]
    assert verify_checkpoint(checkpoints, 0) == []
