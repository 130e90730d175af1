"""BurnpackCheckpoint under Lightning's ModelParallelStrategy (FSDP2 on 2 gloo CPU ranks).

tests/scripts/lightning_fsdp.py runs as a standalone script (Lightning's launcher re-runs the
command line) under a timeout that kills its whole process group.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack, cli
from lightning_bpk.checkpointer import get_latest_checkpoint_number
from lightning_bpk.dcp import load_full_state_dict
from lightning_bpk.lightning import sharded
from lightning_bpk.records import RECORD_KIND_KEY, default_param_id

from conftest import SCRIPTS, run_process
from lightning_tiny import TinyModel

RUN_TIMEOUT = 150


def run(root: Path, *args: str) -> tuple[int, str]:
    done = run_process(
        [sys.executable, SCRIPTS / "lightning_fsdp.py", "--root", root, *args], timeout=RUN_TIMEOUT
    )
    return done.returncode, done.stdout + done.stderr


def finished(log: str, ranks: int, epoch: int, step: int, restored: object) -> None:
    for rank in range(ranks):
        line = f"FINISHED rank={rank} epoch={epoch} step={step} restored={restored}"
        assert line in log, log[-4000:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted 3-epoch run on 2 ranks, saving asynchronously with ``--trace``: its
    gathered final state (the reference of every resumed run here) and its log."""
    root = tmp_path_factory.mktemp("straight")
    out = root / "a.bpk"
    status, log = run(root, "--epochs", "3", "--async-save", "--trace", "--out", str(out))
    assert status == 0, log[-4000:]
    finished(log, 2, 3, 9, None)
    return out, log


def assert_same_state(straight: Path, resumed: Path) -> dict[str, torch.Tensor]:
    """The two gathered states are bit-identical (model and optimizer); the straight one."""
    with burnpack.read(straight) as a, burnpack.read(resumed) as b:
        want, got = a.tensors(), b.tensors()
        assert sorted(want) == sorted(got)
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        return {k: v.clone() for k, v in want.items()}


@pytest.mark.timeout(6 * RUN_TIMEOUT)
def test_fsdp2_killed_mid_epoch_resumes_bit_identically_and_reshards_2_to_1_to_2(
    tmp_path, straight
):
    root = tmp_path / "killed"
    status, log = run(root, "--epochs", "3", "--kill-at-step", "5")  # epoch 1, 2nd of 3 batches
    assert status != 0 and "FINISHED" not in log
    checkpoints = root / "checkpoints"
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 0
    status, log = run(root, "--epochs", "3", "--out", str(tmp_path / "b.bpk"))
    assert status == 0, log[-4000:]
    finished(log, 2, 3, 9, 0)
    reference = assert_same_state(straight[0], tmp_path / "b.bpk")
    # every rank wrote its own shards; the checkpoint verifies byte for byte
    data = checkpoints / "ckpt.2"
    assert sorted(p.name.split(".")[1] for p in data.glob("sharded.rank-*")) == [
        "rank-0",
        "rank-1",
    ]
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 2

    # consolidated in this process (no process group): the gathered full state exactly
    full = load_full_state_dict(data)
    for key, value in reference.items():
        if key.startswith("model."):
            assert torch.equal(full[key], value), key
        else:
            fqn, name = key[len("optim.") :].rsplit(".", 1)
            burn = {
                "exp_avg": "momentum.moment_1",
                "exp_avg_sq": "momentum.moment_2",
                "step": "momentum.time",
            }
            pid = default_param_id(fqn)
            assert torch.equal(full[f"optim.state.{pid}.{burn.get(name, name)}"], value), key

    # a plain, unsharded module and optimizer in one process
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        module = TinyModel()
        optimizer = torch.optim.Adam(module.parameters(), lr=1.0)
        rest = sharded.load(data, module, [optimizer])
    assert rest["epoch"] == 2 and rest["global_step"] == 9
    for name, param in module.state_dict().items():
        assert torch.equal(param, reference[f"model.{name}"]), name
    assert optimizer.param_groups[0]["lr"] == straight_lr(rest)

    # the records API and the command line: one unsharded file Burn can read
    record = sharded.module_record(data)
    assert record.param_ids == {n: default_param_id(n) for n, _ in module.named_parameters()}
    fresh = TinyModel()
    record.apply(fresh)
    for name, param in fresh.state_dict().items():
        assert torch.equal(param, reference[f"model.{name}"]), name
    for out in ("model.bpk", "model.safetensors"):
        assert cli.main(["convert", str(data), str(tmp_path / out)]) == 0
        assert cli.main(["diff", str(data), str(tmp_path / out)]) == 0  # identical
    with burnpack.read(tmp_path / "model.bpk") as pack:
        assert pack.metadata[RECORD_KIND_KEY] == "module"
        for name, value in pack.tensors().items():
            assert torch.equal(value, reference[f"model.{name}"]), name
    assert cli.main(["verify", str(data)]) == 0
    assert cli.main(["verify", str(checkpoints)]) == 0
    assert cli.main(["ls", str(checkpoints)]) == 0
    assert cli.main(["inspect", str(data)]) == 0

    # 2 -> 1 rank: resumes from the sharded checkpoint and continues (6 batches per epoch)
    status, log = run(root, "--epochs", "4", "--devices", "1")
    assert status == 0, log[-4000:]
    finished(log, 1, 4, 15, 2)
    assert [p.name.split(".")[1] for p in (checkpoints / "ckpt.3").glob("sharded.rank-*")] == [
        "rank-0"
    ]
    # 1 -> 2 ranks: the single-rank checkpoint is split again and epoch 4 trains on both ranks;
    # then rank 1's disk fills up in the save of checkpoint 4 (this run doubles as the full-disk
    # test: one Lightning launch less in a slow suite)
    status, log = run(root, "--epochs", "5", "--fail-at-epoch", "4", "--fail-rank", "1")
    assert status != 0 and "FINISHED" not in log
    assert f"resuming from checkpoint {checkpoints / 'ckpt.3'}" in log, log[-4000:]
    for rank in (0, 1):  # every rank fails, naming the rank whose disk filled up
        assert (
            f"[rank{rank}]: lightning_bpk.errors.CheckpointSaveError: writing the shards of "
            "checkpoint 4 failed: rank 1: StorageError: [Errno 28] scratch in "
            in log
            and "No space left on device (injected)" in log
        ), log[-4000:]
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 3  # earlier ones kept
    visible = {p.name for p in checkpoints.iterdir() if not p.name.startswith(".")}
    assert {"ckpt.3", "sentinel_checkpoint_complete.3"} <= visible
    assert not [n for n in visible if n.endswith(".4") or ".dcp." in n]  # no staging left


def trace(log: str, rank: int) -> list[tuple[str, str]]:
    """Rank ``rank``'s ``--trace`` events: (what, which thread)."""
    line = next(line for line in log.splitlines() if line.startswith(f"TRACE rank={rank}: "))
    events = line.split(": ", 1)[1].split(" | ")
    return [tuple(event.rsplit("@", 1)) for event in events]  # type: ignore[misc]


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_fsdp2_async_saves_one_at_a_time_fail_on_every_rank_survive_a_killed_rank(
    tmp_path, straight
):
    """Asynchronous sharded saves on 2 ranks: training goes on while a save is written, the next
    save waits for it, a write that fails on one rank fails the next save on every rank, a rank
    SIGKILLed in its background write leaves the previous checkpoint the newest complete one,
    and a resumed run ends bit-identical to the uninterrupted one."""
    _, log = straight
    for rank in (0, 1):
        events = trace(log, rank)
        what = [w for w, _ in events]
        for w, thread in events:  # snapshots on the training thread, writes on the writer's
            expected = "lightning_bpk-async-save" if w.startswith("write") else "MainThread"
            assert thread.startswith(expected), (rank, events)
        for n in (1, 2):
            # the writer held save n-1 until the training thread asked for save n: training
            # went on while it was written; and save n's snapshot waited for that write
            assert what.index(f"ask {n}") < what.index(f"write {n - 1} end"), (rank, what)
            assert what.index(f"write {n - 1} end") < what.index(f"snapshot {n}"), (rank, what)
        assert what[-1] == "write 2 end", (rank, what)  # teardown waited for the last write

    root = tmp_path / "run"
    checkpoints = root / "checkpoints"
    # rank 1's write of checkpoint 1 fails: the next save (checkpoint 2) fails on every rank
    status, log = run(root, "--async-save", "--fail-at-epoch", "1", "--fail-rank", "1")
    assert status != 0 and "FINISHED" not in log
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: lightning_bpk.errors.CheckpointSaveError: writing the shards of "
            "checkpoint 1 failed: rank 1: StorageError: [Errno 28] scratch in "
            in log
            and "No space left on device (injected)" in log
        ), log[-4000:]
    assert "(raised by the asynchronous save of checkpoint 1 in" in log, log[-4000:]
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 0
    visible = {p.name for p in checkpoints.iterdir() if not p.name.startswith(".")}
    assert visible == {"ckpt.0", "sentinel_checkpoint_complete.0"}  # the failed save removed

    # resumed from 0; rank 1 is SIGKILLed once its file of checkpoint 2 is written
    status, log = run(root, "--async-save", "--kill-in-write", "2", "--kill-rank", "1")
    assert status != 0 and "KILLED rank=1 in the write of checkpoint 2" in log, log[-4000:]
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 1
    assert not (checkpoints / "sentinel_checkpoint_complete.2").exists()

    status, log = run(root, "--async-save", "--out", str(tmp_path / "b.bpk"))
    assert status == 0, log[-4000:]
    finished(log, 2, 3, 9, 1)
    assert_same_state(straight[0], tmp_path / "b.bpk")
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 2


def straight_lr(rest: dict) -> float:
    """The learning rate after the saved epochs: StepLR(gamma=0.7) from 0.05, per epoch."""
    return rest["lr_schedulers"][0]["_last_lr"][0]


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_ddp_ranks_split_the_writing_and_the_state_comes_back_exactly(tmp_path):
    status, log = run(tmp_path, "--ddp", "--epochs", "2", "--out", str(tmp_path / "a.bpk"))
    assert status == 0, log[-4000:]
    data = tmp_path / "checkpoints" / "ckpt.1"
    shares = {}
    for path in data.glob("sharded.rank-*"):
        with burnpack.read(path) as pack:
            shares[path.name.split(".")[1]] = len(pack)
    assert sorted(shares) == ["rank-0", "rank-1"] and all(shares.values()), shares

    # resuming the finished run restores the saved model and optimizer and trains no further
    status, log = run(tmp_path, "--ddp", "--epochs", "2", "--out", str(tmp_path / "b.bpk"))
    assert status == 0, log[-4000:]
    finished(log, 2, 2, 6, 1)
    with burnpack.read(tmp_path / "a.bpk") as a, burnpack.read(tmp_path / "b.bpk") as b:
        saved, restored = a.tensors(), b.tensors()
        assert sorted(saved) == sorted(restored)
        for key, value in saved.items():
            assert torch.equal(restored[key], value), key
