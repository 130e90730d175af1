"""End to end, real subprocesses: SIGKILL mid-epoch, start again, end bit-identical; disk full;
several training loaders, an iterable dataset, worker-side randomness; a batch size or world
size changed between runs."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.checkpointer import get_latest_checkpoint_number, verify_checkpoint
from lightning_bpk.records import ModuleRecord, OptimizerRecord, StateRecord

from conftest import TINY_REFERENCE_EPOCHS, TINY_SCRIPT, Finished, run_process
from lightning_tiny import SAMPLES

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


def test_a_model_whose_first_tensor_is_empty_is_killed_and_resumes_bit_identically(
    tmp_path, reference
):
    """A module whose first state entry has no elements (``register_buffer("mask",
    torch.zeros(0))`` declared first): every checkpoint of it verifies and loads (a reader once
    failed on an empty first tensor, so such a run could never resume), and a SIGKILLed run
    resumes and ends bit-identical to the run that never stopped (the buffer takes no part in
    training: the reference's weights are the same)."""
    kill_step = 2 * BATCHES_PER_EPOCH + 3
    killed = run(tmp_path / "run", "--empty-buffer", "--kill-at-step", str(kill_step))
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "checkpoints"
    assert get_latest_checkpoint_number(checkpoints, verify=True) == 1
    assert verify_checkpoint(checkpoints, 1) == []
    resumed = run(tmp_path / "run", "--empty-buffer", "--out", str(tmp_path / "resumed.bpk"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"epoch={EPOCHS} step={EPOCHS * BATCHES_PER_EPOCH} restored=1" in resumed.stdout
    expected, got = params(reference / "ref.bpk"), params(tmp_path / "resumed.bpk")
    assert got["mask"].numel() == 0
    with burnpack.read(checkpoints / "ckpt.3" / "model.bpk") as pack:
        assert pack.data_order[0] == "mask"  # the empty tensor leads the data section
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


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


# -- several training loaders, an iterable dataset, worker-side randomness (issue 21: 8, 15) -----


def run_data(root: Path, kind: str, *args: str, epochs: int = 3) -> Finished:
    """lightning_tiny with ``--data kind`` and step checkpoints every 5 steps."""
    command = [sys.executable, SCRIPT, "--root", root, "--epochs", epochs, "--data", kind]
    command += ["--every-n-steps", "5", *args]
    return run_process(command, timeout=RUN_TIMEOUT)


def assert_bitwise(expected_path: Path, got_path: Path) -> None:
    expected, got = params(expected_path), params(got_path)
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def adam_step_and_global_step(checkpoints: Path, number: int) -> tuple[float, int]:
    directory = checkpoints / f"ckpt.{number}"
    state = OptimizerRecord.load(directory / "optim.bpk").state_dict()["state"]
    steps = {float(s["step"]) for s in state.values()}
    assert len(steps) == 1, steps  # every parameter stepped as often
    return steps.pop(), StateRecord.load(directory / "trainer.bpk").value["global_step"]


def _stopped_then_resumed(
    tmp_path: Path, kind: str, stops: list[list[str]], *extra: str, epochs: int = 3
):
    """An uninterrupted run and one stopped at each of ``stops`` (``--kill-at-step K`` or
    ``--term-at-step K``) and started again to the end; both end bitwise equal, each restart
    sees the reference's batches from its checkpoint's step on, and every checkpoint's Adam
    step count is its global step."""
    out = ["--out", str(tmp_path / "ref.bpk")]
    ref = run_data(
        tmp_path / "ref", kind, "--ids", str(tmp_path / "ref.ids"), *extra, *out, epochs=epochs
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    root, ids = tmp_path / "run", tmp_path / "run.ids"
    checkpoints, outputs = root / "checkpoints", []
    for stop in [*stops, ["--out", str(tmp_path / "run.bpk")]]:
        latest = get_latest_checkpoint_number(checkpoints) if root.exists() else -1
        before = len(ids.read_text().splitlines()) if ids.exists() else 0
        process = run_data(root, kind, "--ids", str(ids), *extra, *stop, epochs=epochs)
        expected = -signal.SIGKILL if stop[0] == "--kill-at-step" else 0
        assert process.returncode == expected, process.stderr[-3000:]
        lines = ids.read_text().splitlines()[before:]
        assert lines == _lines_from(tmp_path / "ref.ids", max(latest, 0))[: len(lines)]
        outputs.append(process)
    assert_bitwise(tmp_path / "ref.bpk", tmp_path / "run.bpk")
    numbers = sorted(int(p.name.split(".")[1]) for p in checkpoints.glob("ckpt.*"))
    for number in numbers:
        adam, global_step = adam_step_and_global_step(checkpoints, number)
        assert adam == global_step == number, number
    return outputs


def test_a_dict_of_train_loaders_killed_mid_epoch_continues_bitwise(tmp_path):
    """A dict of two loaders (6 and 3 batches per epoch: Lightning's max_size_cycle) killed
    after step 11: checkpoint 10 is batch 4 of epoch 1, where the shorter loader is in its
    second pass. It used to be replayed from the epoch's start, with Adam's step count ahead of
    the global step, and then refused to save over checkpoint 10. (The CombinedLoader modes:
    test_data_position.)"""
    _stopped_then_resumed(tmp_path, "dict", [["--kill-at-step", "11"]], epochs=2)


def test_iterable_dataset_killed_and_rerun_twice_continues_without_collisions(tmp_path):
    """An IterableDataset without state, SIGKILLed after step 8 (checkpoint 5, mid-epoch 0),
    then SIGTERMed after step 9 (saved after step 10, mid-epoch 1), then to the end: every
    re-run of the same command continues (no CheckpointResumeError), no checkpoint number is
    saved twice, Adam's step count is the global step in every checkpoint, and, as this dataset
    draws its order from the global RNG, the end is bitwise the uninterrupted run's."""
    first, second, last = _stopped_then_resumed(
        tmp_path, "iterable", [["--kill-at-step", "8"], ["--term-at-step", "9"]], epochs=2
    )
    for process in (first, second, last):
        assert process.stderr.count("cannot be positioned without reading it") == 1
    assert "(global step 5) after checkpoint 5" in second.stderr
    assert "restored=10" in last.stdout and f"step={2 * BATCHES_PER_EPOCH}" in last.stdout


def test_worker_randomness_warns_once_and_a_stateful_dataloader_resumes_it_exactly(
    tmp_path, reference
):
    """torch.rand augmentation in 2 DataLoader workers: a plain DataLoader killed mid-epoch
    resumes with the same sample order and one warning that the batches differ; torchdata's
    StatefulDataLoader over a dataset whose generator is in its state_dict is bitwise exact."""
    root, ids = tmp_path / "plain", tmp_path / "plain.ids"
    common = ["--workers", "2", "--augment", "--ids", str(ids)]
    killed = run_data(
        root, "plain", *common, "--kill-at-step", "3", "--every-n-steps", "2", epochs=1
    )
    assert killed.returncode == -signal.SIGKILL
    assert "random draws made inside its worker processes" not in killed.stderr  # not resumed
    before = len(ids.read_text().splitlines())
    resumed = run_data(root, "plain", *common, "--every-n-steps", "2", epochs=1)  # from 2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("random draws made inside its worker processes") == 1
    assert "torch.rand augmentation" in resumed.stderr and "StatefulDataLoader" in resumed.stderr
    lines = ids.read_text().splitlines()[before:]
    assert lines == _lines_from(reference / "ref.ids", 2)[: len(lines)]  # the order is exact

    outputs = _stopped_then_resumed(
        tmp_path / "stateful",
        "stateful",
        [["--kill-at-step", "4"]],
        *["--workers", "2", "--augment", "--every-n-steps", "3"],
        epochs=1,
    )
    assert all("random draws made inside" not in p.stderr for p in outputs)


# -- changed settings between runs (issue 21: 13) ------------------------------------------------


def _epoch_samples(id_files: list[Path], epoch: int, before_step: int | None = None) -> list[int]:
    """The sample ids the id logs show for ``epoch`` (only batches before global step
    ``before_step``: those a killed run trained before the checkpoint it is resumed from)."""
    ids = []
    for path in id_files:
        for line in path.read_text().splitlines():
            e, _, step, batch = line.split()
            if int(e) == epoch and (before_step is None or int(step) < before_step):
                ids += [int(i) for i in batch.split(",")]
    return ids


@pytest.mark.parametrize(
    "first, second, kill",
    [
        (["--batch-size", "8"], ["--batch-size", "16"], 9),
        (["--devices", "2"], ["--devices", "1"], 4),
    ],
    ids=["batch-8-to-16", "ranks-2-to-1"],
)
def test_a_changed_batch_size_or_world_size_continues_the_epoch_in_samples(
    tmp_path, first, second, kill
):
    """Killed mid-epoch 1 with step checkpoints every 2 steps, resumed with another batch size
    or number of (gloo CPU) ranks: the epoch's samples, those trained before the checkpoint
    plus those the resumed run trained, are exactly the dataset, none twice, none lost. (The
    ranks share one seed, so their DistributedSamplers split one order.)"""
    root = tmp_path / "run"
    common = ["--epochs", "2", "--every-n-steps", "2", "--shared-seed"]
    killed = run(
        root, *common, *first, "--ids", str(tmp_path / "killed.ids"), "--kill-at-step", str(kill)
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = get_latest_checkpoint_number(root / "checkpoints")
    resumed = run(root, *common, *second, "--ids", str(tmp_path / "resumed.ids"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before = _epoch_samples(sorted(tmp_path.glob("killed.ids*")), 1, before_step=saved)
    after = _epoch_samples(sorted(tmp_path.glob("resumed.ids*")), 1)
    assert before and after
    assert sorted(before + after) == list(range(SAMPLES))
    assert "continues in samples" in resumed.stderr
