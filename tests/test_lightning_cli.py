"""examples/lightning_cli.py as a user runs it: LightningCLI, the callback configured in YAML
(``trainer.callbacks``), SIGKILLed, and the same command run again continues, bit-identically."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk.records import ModuleRecord

from conftest import EXAMPLES, run_process

SCRIPT = EXAMPLES / "lightning_cli.py"
CONFIG = EXAMPLES / "cli" / "config.yaml"
TIMEOUT_S = 180
FINAL = 32  # 4 epochs of 8 batches: checkpoints are numbered by global step (every 5 steps)

pytestmark = pytest.mark.timeout(4 * TIMEOUT_S)


def _fit(root: Path, *options: str):
    command = [sys.executable, SCRIPT, "fit", "--config", CONFIG]
    command += ["--trainer.default_root_dir", root, *options]
    return run_process(command, timeout=TIMEOUT_S, cwd=root.parent)


def test_lightning_cli_run_killed_and_run_again_continues_exactly(tmp_path):
    run = tmp_path / "run"
    killed = _fit(run, "--model.kill_after_step", "17")
    assert killed.returncode == -9, killed.stderr[-3000:]  # no RepresenterError at start
    assert (run / "config.yaml").exists()  # LightningCLI saved the config it ran
    resumed = _fit(run)  # the same command: config.yaml is overwritten, not refused
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing training at epoch 1, batch 7 (global step 15) after checkpoint 15" in (
        resumed.stderr
    )
    reference = _fit(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    ours = ModuleRecord.load(run / "checkpoints" / f"ckpt.{FINAL}" / "model.bpk").tensors
    theirs = ModuleRecord.load(
        tmp_path / "reference" / "checkpoints" / f"ckpt.{FINAL}" / "model.bpk"
    ).tensors
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
