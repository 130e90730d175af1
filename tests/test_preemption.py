"""Preemption: a signal sets a flag, the next batch end saves and stops with status 0, the next
start continues with the next batch, exactly as if it had never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_bpk.checkpointer import Checkpointer, get_latest_checkpoint_number
from lightning_bpk.lightning import trainer_state
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.records import ModuleRecord, StateRecord
from lightning_bpk.runtime.preemption import _ignore_while_stopping

from conftest import TINY_REFERENCE_EPOCHS, TINY_SCRIPT, run_process
from lightning_tiny import TinyModel, make_trainer

SCRIPT = TINY_SCRIPT
RUN_TIMEOUT = 90
BATCHES_PER_EPOCH = 6

pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT)


def _trainer_value(root: Path, n: int) -> dict:
    # the data its sentinel names: a re-saved N's is ckpt.N~<hex>
    data = Checkpointer(root / "checkpoints").checkpoint_path(n)
    return StateRecord.load(data / "trainer.bpk").value


def _ids_from(path: Path, step: int) -> list[str]:
    """The id log's lines from global step ``step`` on (``epoch batch_idx step ids``)."""
    return [line for line in path.read_text().splitlines() if int(line.split()[2]) >= step]


def test_sigterm_saves_stops_with_status_0_and_the_next_start_continues_exactly(
    tmp_path, tiny_reference
):
    # num_workers=2: the data order must not depend on what the workers had prefetched. The
    # reference is the session's uninterrupted run (conftest), which fetches in the main process:
    # workers change where a batch is fetched, never which samples it holds.
    common = ["--epochs", str(TINY_REFERENCE_EPOCHS), "--workers", "2"]
    command = [sys.executable, SCRIPT, "--root", tmp_path, *common]
    command += ["--ids", str(tmp_path / "run.ids")]
    term_step = 2 * BATCHES_PER_EPOCH + 2  # the module sends it after batch 2 of epoch 2
    stopped = run_process([*command, "--term-at-step", term_step], timeout=RUN_TIMEOUT)
    assert stopped.returncode == 0, stopped.stderr
    assert "FINISHED" not in stopped.stdout  # fit did not return: the process stopped
    assert "saved checkpoint 2 after batch 2 of epoch 2" in stopped.stderr
    assert get_latest_checkpoint_number(tmp_path / "checkpoints") == 2
    value = _trainer_value(tmp_path, 2)
    assert value[trainer_state.PREEMPTED_KEY] == {"epoch": 2, "batches": 3, "replay": False}
    assert value["global_step"] == term_step + 1
    # Lightning's own loop counters, mid-epoch: the resumed run continues with batch 3
    progress = value["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert progress["processed"] == 3

    resumed = run_process([*command, "--out", tmp_path / "resumed.bpk"], timeout=RUN_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    assert "saved at epoch 2, after 3 batches" in resumed.stderr
    assert "replayed" not in resumed.stderr
    assert "continuing training at epoch 2, batch 3 (global step 15) after checkpoint 2" in (
        resumed.stderr
    )
    assert "epoch=4 step=24 restored=2" in resumed.stdout
    assert trainer_state.PREEMPTED_KEY not in _trainer_value(tmp_path, 2)  # replaced at epoch end
    # the resumed run saw exactly the reference's batches from the save point on, and nothing else
    resumed_ids = (tmp_path / "run.ids").read_text().splitlines()[term_step + 1 :]
    assert resumed_ids == _ids_from(tiny_reference / "ref.ids", term_step + 1)
    expected = ModuleRecord.load(tiny_reference / "ref.bpk").tensors
    got = ModuleRecord.load(tmp_path / "resumed.bpk").tensors
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_ctrl_c_saves_at_the_next_step_exits_cleanly_and_resumes_bit_identically(
    tmp_path, tiny_reference
):
    command = [sys.executable, SCRIPT, "--root", tmp_path, "--epochs", TINY_REFERENCE_EPOCHS]
    step = BATCHES_PER_EPOCH + 2  # after batch 2 of epoch 1
    stopped = run_process(
        [*command, "--term-at-step", step, "--term-signal", "SIGINT"], timeout=RUN_TIMEOUT
    )
    assert stopped.returncode == 0, stopped.stderr
    assert "Ctrl-C: saving at the next step boundary" in stopped.stderr
    assert "saved checkpoint 1 after batch 2 of epoch 1" in stopped.stderr
    assert "KeyboardInterrupt" not in stopped.stdout + stopped.stderr
    assert _trainer_value(tmp_path, 1)[trainer_state.PREEMPTED_KEY]["batches"] == 3

    resumed = run_process([*command, "--out", tmp_path / "resumed.bpk"], timeout=RUN_TIMEOUT)
    assert "epoch=4 step=24 restored=1" in resumed.stdout
    expected = ModuleRecord.load(tiny_reference / "ref.bpk").tensors
    got = ModuleRecord.load(tmp_path / "resumed.bpk").tensors
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_second_ctrl_c_aborts_at_once_without_saving(tmp_path):
    command = [sys.executable, SCRIPT, "--root", tmp_path, "--epochs", TINY_REFERENCE_EPOCHS]
    step = BATCHES_PER_EPOCH + 2
    options = ["--term-at-step", step, "--term-signal", "SIGINT", "--term-count", 2]
    aborted = run_process([*command, *options], timeout=RUN_TIMEOUT, check=False)
    assert aborted.returncode == 1, aborted.stderr  # Lightning's KeyboardInterrupt shutdown
    assert "Ctrl-C: saving at the next step boundary" in aborted.stderr  # the first one
    assert "Detected KeyboardInterrupt" in aborted.stdout + aborted.stderr
    assert "saved checkpoint 1" not in aborted.stderr
    assert get_latest_checkpoint_number(tmp_path / "checkpoints") == 0  # epoch 0's end


def test_repeated_sigterm_while_saving_and_exiting_does_not_kill_the_process(tmp_path):
    # Schedulers repeat their signal (and a requeue sends SIGTERM): from the first training epoch
    # until the process is gone it gets SIGTERM every 50 ms, through the save, Lightning's
    # teardown (which used to reinstall the fatal default) and interpreter finalization.
    command = [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--epochs", "40"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if "saved checkpoint 0 at" in line:  # our handlers are installed by now
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        assert training.wait(RUN_TIMEOUT), "".join(lines)
        sent = 0
        while process.poll() is None and time.monotonic() < deadline:
            os.kill(process.pid, signal.SIGTERM)
            sent += 1
            time.sleep(0.05)
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    reader.join(10)
    log = "".join(lines)
    assert returncode == 0, f"exit status {returncode} after {sent} SIGTERMs\n{log}"
    assert sent >= 2
    assert log.count("stopping (exit status 0)") == 1, log
    assert get_latest_checkpoint_number(tmp_path / "checkpoints") >= 1


class _SignalAt(L.Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigusr1_in_epoch_0_chains_the_user_handler_and_continues_after_it(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    term_before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        L.seed_everything(0)
        trainer = make_trainer(
            str(tmp_path), 2, [BurnpackCheckpoint(), _SignalAt(2, signal.SIGUSR1)]
        )
        with pytest.raises(SystemExit) as stop:
            trainer.fit(TinyModel())
        assert stop.value.code is None  # exit status 0
        assert calls == [signal.SIGUSR1]  # the user's handler still ran
        assert signal.getsignal(signal.SIGUSR1) is not None
        assert signal.getsignal(signal.SIGUSR1).__name__ == "<lambda>"  # and is back in place
        # the process is stopping: a further SIGTERM must not kill it before it exits ...
        assert signal.getsignal(signal.SIGTERM) is _ignore_while_stopping
        # ... unless it goes on with another fit, which brings the default back
        make_trainer(str(tmp_path / "other"), 1, [BurnpackCheckpoint()]).fit(TinyModel())
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGTERM, term_before)
    value = _trainer_value(tmp_path, 0)
    # callbacks run before Checkpoint callbacks: the flag is seen at the same batch end
    assert value[trainer_state.PREEMPTED_KEY] == {"epoch": 0, "batches": 2, "replay": False}

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.at = (trainer.current_epoch, trainer.global_step)

    start, callback = Start(), BurnpackCheckpoint()
    make_trainer(str(tmp_path), 2, [callback, start]).fit(TinyModel())
    assert start.at == (0, 2) and callback.restored_number == 0  # after the 2 batches done
    assert get_latest_checkpoint_number(tmp_path / "checkpoints") == 1
