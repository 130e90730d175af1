"""The writer process: an async save committed by a child that reads shared staging memory;
errors, close, SIGKILL of the child and one save in flight keep the thread writer's guarantees."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
import torch

from lightning_bpk import state
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord, OptimizerRecord, RecordError
from lightning_bpk.runtime._writer import WriterProcessDied
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

pytestmark = pytest.mark.timeout(300)


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 8))
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    return net, optimizer


def _records(net, optimizer) -> dict:
    return {
        "model": ModuleRecord.from_module(net),
        "optim": OptimizerRecord.from_optimizer(optimizer, net),
        "trainer": {"step": 1, "betas": (0.9, 0.99)},
    }


def test_the_child_commits_the_snapshot_from_shared_staging_and_training_goes_on(tmp_path):
    net, optimizer = _state()
    checkpointer = Checkpointer(tmp_path)
    saved = []
    with AsyncCheckpointSaver(process=True) as saver:
        saver.watch([optimizer])
        expected = {k: v.clone() for k, v in net.state_dict().items()}
        saver.save_checkpoint(checkpointer, 0, _records(net, optimizer), saved.append)
        net(torch.randn(4, 512)).sum().backward()
        optimizer.step()  # waits for the late copy, then changes every parameter
        saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))  # buffers reused
        pid = saver._writer.pid
        assert pid is not None and pid != os.getpid()
        assert all(slot.raw.is_shared() for slot in saver.staging._slots.values())
    assert saved == [checkpointer.checkpoint_path(0)]
    first = checkpointer.load_checkpoint(0)
    assert all(torch.equal(first["model"].tensors[k], v) for k, v in expected.items())
    assert first["trainer"] == {"step": 1, "betas": (0.9, 0.99)}
    second = checkpointer.load_checkpoint(1)["model"].tensors
    assert all(torch.equal(second[k], v) for k, v in net.state_dict().items())
    assert checkpointer.verify_checkpoint(1) == []


def test_the_child_encodes_the_nested_state_and_the_optimizer_and_writes_the_same_files(
    tmp_path, monkeypatch
):
    # the loop state and the optimizer leave the training process as copies: the child names
    # and encodes them (with the checksums the late copies took), this process encodes nothing
    net, optimizer = _state()
    sync = Checkpointer(tmp_path / "sync")
    sync.save_checkpoint(0, _records(net, optimizer))
    encoded: list[str] = []
    encode = state.encode

    def recorded(*args, **kwargs):
        encoded.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(state, "encode", recorded)
    checkpointer = Checkpointer(tmp_path / "async")
    with AsyncCheckpointSaver(process=True) as saver:
        saver.watch([optimizer])
        saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
        saver.wait()
    assert encoded == []
    for name in ("optim.bpk", "trainer.bpk", "model.bpk"):
        want = (sync.checkpoint_path(0) / name).read_bytes()
        assert (checkpointer.checkpoint_path(0) / name).read_bytes() == want, name
    assert checkpointer.verify_checkpoint(0) == []


def test_a_failed_write_in_the_child_is_raised_by_the_next_save_and_loses_nothing(tmp_path):
    net, optimizer = _state()
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver(process=True) as saver:
        saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
        saver.wait()
        bad = {"trainer": {"fn": print}}  # fails on the caller's thread, as without a child
        with pytest.raises(RecordError):
            saver.save_checkpoint(checkpointer, 1, bad)
        gone = Checkpointer(tmp_path / "gone")
        shutil.rmtree(tmp_path / "gone")
        (tmp_path / "gone").write_text("a file where the directory was")
        saver.save_checkpoint(gone, 2, _records(net, optimizer))  # fails in the child
        with pytest.raises(OSError) as info:
            saver.save_checkpoint(checkpointer, 3, _records(net, optimizer))
        assert "checkpoint 2" in " ".join(info.value.__notes__)
        saver.save_checkpoint(checkpointer, 3, _records(net, optimizer))  # reported once
        saver.wait()
    assert checkpointer.verify_checkpoint(0) == []
    assert checkpointer.verify_checkpoint(3) == []


class _TwoPartError(Exception):
    """Pickles, but does not unpickle: its one argument cannot rebuild it."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(f"{what} at {where}")


class _LockedError(Exception):
    """Does not pickle: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _two_part(message: str) -> Exception:
    return _TwoPartError(message, "the disk")


class FailsWith(Checkpointer):
    """A real Checkpointer that raises ``make(message)`` in the writer process instead of
    saving (``make``: a module-level function, so the checkpointer crosses the pipe)."""

    def __init__(self, directory, make) -> None:
        super().__init__(directory)
        self.make = make

    def save_checkpoint(self, iteration_number, data, **kwargs):
        raise self.make(f"no room for checkpoint {iteration_number}")


@pytest.mark.parametrize(
    ("make", "kind"), [(_two_part, "_TwoPartError"), (_LockedError, "_LockedError")]
)
def test_a_child_error_that_cannot_cross_the_pipe_is_raised_as_its_text(tmp_path, make, kind):
    net, optimizer = _state()
    checkpointer = Checkpointer(tmp_path / "good")
    with AsyncCheckpointSaver(process=True) as saver:
        saver.save_checkpoint(FailsWith(tmp_path / "failing", make), 0, _records(net, optimizer))
        with pytest.raises(RuntimeError, match=f"{kind}: no room for checkpoint 0"):
            saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))
        saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))  # the pipe is intact
        saver.wait()
    assert checkpointer.verify_checkpoint(1) == []


class KilledWhileWriting(Checkpointer):
    """A real Checkpointer whose process is SIGKILLed in the middle of writing checkpoint 1
    (after its data files, before the sentinel): the writer process dies mid-save."""

    def save_checkpoint(self, iteration_number, data, **kwargs):
        if iteration_number == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().save_checkpoint(iteration_number, data, **kwargs)


def test_a_child_killed_while_writing_fails_that_save_and_the_next_starts_anew(tmp_path):
    net, optimizer = _state()
    checkpointer = KilledWhileWriting(tmp_path)
    with AsyncCheckpointSaver(process=True) as saver:
        saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
        saver.wait()
        first = saver._writer.pid
        saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))
        with pytest.raises(WriterProcessDied, match=r"exit code -9.*checkpoint 1.*untouched"):
            saver.save_checkpoint(checkpointer, 2, _records(net, optimizer))
        saver.save_checkpoint(checkpointer, 2, _records(net, optimizer))
        saver.wait()
        assert saver._writer.pid not in (None, first)
    assert checkpointer.verify_checkpoint(0) == [] and checkpointer.verify_checkpoint(2) == []
    assert not os.path.exists(checkpointer.sentinel_path(1))


def test_a_child_killed_between_saves_is_reported_by_the_next_save(tmp_path):
    net, optimizer = _state()
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver(process=True) as saver:
        saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
        saver.wait()
        process = saver._writer._process
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=60)
        with pytest.raises(WriterProcessDied, match=r"exit code -9.*intact"):
            saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))
        saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))
        saver.wait()
        assert saver._writer.pid not in (None, process.pid)
    assert checkpointer.verify_checkpoint(0) == [] and checkpointer.verify_checkpoint(1) == []


def test_close_ends_the_child_once_its_write_is_committed(tmp_path):
    net, optimizer = _state()
    checkpointer = Checkpointer(tmp_path)
    saver = AsyncCheckpointSaver(process=True)
    saver.reserve(_records(net, optimizer))  # starts the child, on the writer thread
    saver.wait()
    process = saver._writer._process
    assert process is not None and process.is_alive()
    saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
    saver.close()
    assert checkpointer.verify_checkpoint(0) == []
    process.join(timeout=60)
    assert process.exitcode == 0


_KILL_PARENT = """
import os, signal, sys, torch
sys.path[:0] = {path!r}
from test_writer import _records, _state
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
net, optimizer = _state()
checkpointer = Checkpointer({directory!r})
saver = AsyncCheckpointSaver(process=True)
saver.save_checkpoint(checkpointer, 0, _records(net, optimizer))
saver.wait()
print(saver._writer.pid, flush=True)
saver.save_checkpoint(checkpointer, 1, _records(net, optimizer))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_training_process_leaves_its_checkpoints_whole_and_the_child_exits(tmp_path):
    import select
    import subprocess
    import sys

    script = _KILL_PARENT.format(path=sys.path, directory=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    child = int(run.stdout.split()[0])
    try:
        exited = os.pidfd_open(child)
    except ProcessLookupError:
        exited = None  # already gone
    if exited is not None:
        readable, _, _ = select.select([exited], [], [], 120)
        os.close(exited)
        assert readable, "the writer process outlived its training process"
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer.verify_checkpoint(0) == []
    if os.path.exists(checkpointer.sentinel_path(1)):  # the child finished what it was given
        assert checkpointer.verify_checkpoint(1) == []
