"""Re-runs that must continue: a real Trainer in a subprocess, SIGKILLed, started again with the
same command, and compared bit for bit with a run that never stopped (``lightning_tiny.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk.records import ModuleRecord

from conftest import TINY_SCRIPT, run_process

RUN_TIMEOUT = 120
EPOCHS = 4
# SWA from epoch 2 (1-based): its SWALR replaces StepLR when the second epoch (0-based 1) starts,
# step 12 is the first of epoch 2, so the kill after step 17 falls after SWA started and after
# the save of step 15, mid-epoch.
SWA = ["--swa", "2", "--ema", "--every-n-steps", "5"]
KILL_AT = 17

pytestmark = pytest.mark.timeout(6 * RUN_TIMEOUT)


def _run(root: Path, *options: object, check: bool = True):
    command = [sys.executable, TINY_SCRIPT, "--root", root, "--epochs", EPOCHS, *options]
    return run_process(command, timeout=RUN_TIMEOUT, check=check)


def _same_tensors(a: Path, b: Path) -> None:
    left, right = ModuleRecord.load(a).tensors, ModuleRecord.load(b).tensors
    assert sorted(left) == sorted(right)
    unequal = [k for k in left if not torch.equal(left[k], right[k])]
    assert not unequal, f"{a} and {b} differ in {unequal}"


@pytest.fixture(scope="module")
def swa_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted SWA + EMA run: ``ref.bpk`` its final (averaged) weights, ``ref.bpk.ema``
    the EMA callback's copy."""
    root = tmp_path_factory.mktemp("swa-reference")
    _run(root / "run", *SWA, "--out", root / "ref.bpk")
    return root / "ref.bpk"


@pytest.mark.parametrize("mode", [[], ["--io-plugin"]], ids=["callback", "with-io-plugin"])
def test_swa_and_ema_callback_states_survive_sigkill_after_swa_started(
    tmp_path, swa_reference, mode
):
    killed = _run(tmp_path, *SWA, *mode, "--kill-at-step", KILL_AT, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "Swapping scheduler `StepLR` for `SWALR`" in killed.stderr
    out = tmp_path / "out.bpk"
    resumed = _run(tmp_path, *SWA, *mode, "--out", out)
    assert "restored=15" in resumed.stdout  # the step-15 save, made while SWA was averaging
    # the saved SWALR state is SWA's own to restore (from its callback state), as it does
    assert "SWALR'] beyond the 0 configured at fit start" in resumed.stderr
    # Lightning skips on_train_epoch_start when it restarts mid-epoch, where SWA builds it
    assert "SWALR rebuilt for the resumed epoch" in resumed.stderr
    _same_tensors(out, swa_reference)  # SWA's average (n_averaged and all) became the weights
    _same_tensors(Path(f"{out}.ema"), Path(f"{swa_reference}.ema"))
