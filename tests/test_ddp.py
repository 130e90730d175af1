"""DDP with 2 gloo CPU processes, run as a standalone script (Lightning's launcher re-runs the
command line, so never inside pytest): only rank 0 writes, both ranks resume from the same
checkpoint, and a SIGTERM to one rank saves and stops both without a deadlock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk.checkpointer import get_latest_checkpoint_number
from lightning_bpk.lightning import trainer_state
from lightning_bpk.lightning.data_position import POSITION_KEY
from lightning_bpk.records import ModuleRecord, StateRecord
from lightning_bpk.store.local import LOCK_FILE_NAME

from conftest import SCRIPTS, run_process

SCRIPT = SCRIPTS / "lightning_tiny.py"
RUN_TIMEOUT = 120  # a deadlock fails the test (the process group is killed) instead of hanging
BATCHES_PER_EPOCH = 3  # 48 samples split over 2 ranks, batch size 8

pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT)


def run(root: Path, *args: str) -> tuple[int, str, str, int]:
    """Run the 2-process script; returns (status, stdout, stderr, pid of rank 0)."""
    command = [sys.executable, SCRIPT, "--root", root, "--devices", "2", *args]
    done = run_process(command, timeout=RUN_TIMEOUT)  # a hang kills rank 1 too: same session
    return done.returncode, done.stdout, done.stderr, done.pid


def _lines_from(path: Path, step: int) -> list[str]:
    return [line for line in path.read_text().splitlines() if int(line.split()[2]) >= step]


@pytest.mark.parametrize("term_rank", [1, 0])
def test_sigterm_to_one_rank_saves_once_and_both_ranks_resume_from_it(tmp_path, term_rank):
    epochs = "3" if term_rank == 1 else "2"
    ids = ["--ids", str(tmp_path / "run.ids")]
    status, out, err, pid = run(
        tmp_path,
        "--epochs",
        epochs,
        "--term-at-step",
        str(BATCHES_PER_EPOCH + 1),
        "--term-rank",
        str(term_rank),
        *ids,
    )
    assert status == 0, err[-3000:]
    assert "FINISHED" not in out
    checkpoints = tmp_path / "checkpoints"
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 1
    value = StateRecord.load(checkpoints / "ckpt.1" / "trainer.bpk").value
    assert value[trainer_state.PREEMPTED_KEY] == {"epoch": 1, "batches": 2, "replay": False}
    # each rank's own RNG states and data position (its DistributedSampler shard)
    positions = value[POSITION_KEY]
    assert len(positions) == 2
    assert not torch.equal(positions[0]["rng"]["torch"], positions[1]["rng"]["torch"])
    # the save lock records the writer's pid: rank 0 (the launched process), never rank 1
    assert (checkpoints / LOCK_FILE_NAME).read_text().strip() == str(pid)
    if term_rank == 0:
        return  # resuming is the same code path for both; run it once to stay fast

    out_file = ["--out", str(tmp_path / "resumed.bpk")]
    status, out, err, pid = run(tmp_path, "--epochs", epochs, *ids, *out_file)
    assert status == 0, err[-3000:]
    assert "FINISHED rank=0 epoch=3 step=9 restored=1" in out
    assert "FINISHED rank=1 epoch=3 step=9 restored=1" in out
    assert (checkpoints / LOCK_FILE_NAME).read_text().strip() == str(pid)
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 2

    # an uninterrupted run: from the save point (global step 5) on, each rank saw the same
    # batches of its own shard, and the weights end bit-identical
    reference = tmp_path / "reference"
    ref_ids = ["--ids", str(reference / "ref.ids"), "--out", str(reference / "ref.bpk")]
    status, out, err, _ = run(reference, "--epochs", epochs, *ref_ids)
    assert status == 0, err[-3000:]
    for rank in (0, 1):
        resumed = (tmp_path / f"run.ids.rank{rank}").read_text().splitlines()
        resumed = resumed[BATCHES_PER_EPOCH + 2 :]  # the lines the stopped run wrote first
        assert resumed == _lines_from(reference / f"ref.ids.rank{rank}", BATCHES_PER_EPOCH + 2)
    expected = ModuleRecord.load(reference / "ref.bpk").tensors
    got = ModuleRecord.load(tmp_path / "resumed.bpk").tensors
    assert all(torch.equal(got[k], expected[k]) for k in expected)
