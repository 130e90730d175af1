"""SIGKILL a real saving subprocess at random points; the directory must stay consistent.

A handful of kills (the 200+ kill run is ``benchmarks/crash_soak.py``). After every kill: every
sentinel has its data and verifies, the newest checkpoint loads bit-exactly, and the next save
cleans the temporaries. See ``tests/scripts/crash_saver.py`` for the saver and the checks.
A crash modelled before every storage operation of a save, on local disk and on an object
store, is in ``tests/test_checkpointer_commit.py``.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_bpk.checkpointer import Checkpointer

import crash_saver  # tests/scripts, on the path through conftest

# Filesystem operations in the saver's first two saves (a fresh save makes ~25-30, a re-save
# ~33): kill points are drawn from this range so they cover staging, swap, sentinel and GC.
_OPS_RANGE = (1, 70)


def test_killed_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20260301)
    results = [crash_saver.run_kill(tmp_path, rng) for _ in range(3)]
    assert results[-1]["latest"] >= 0
    crash_saver.finish_and_check(tmp_path)


def test_killed_at_random_filesystem_operations(tmp_path: Path) -> None:
    rng = random.Random(7)
    # Start from a few committed checkpoints so the first kills hit re-saves and GC too.
    crash_saver.finish_and_check(tmp_path, saves=5)
    for _ in range(4):
        crash_saver.run_kill(tmp_path, rng, kill_at=rng.randint(*_OPS_RANGE))
    crash_saver.finish_and_check(tmp_path)


def test_power_loss_order_files_then_rename_then_sentinel(tmp_path: Path, monkeypatch) -> None:
    """What survives a power loss is what was fsynced, so the commit's order of fsyncs is its
    crash guarantee: every file of the checkpoint and its folder are fsynced before the folder
    gets its name ``ckpt.N``, that rename is made durable (its parent fsynced) before the
    sentinel is linked, the sentinel's bytes are fsynced before it gets its name, and the link
    is fsynced before the save returns (and retention deletes anything). Files are told apart
    by inode: scratch names come and go."""
    events: list[tuple[str, int]] = []  # ("fsync", inode) or (rename/link, inode of the target)
    lock = threading.Lock()
    real = {name: getattr(os, name) for name in ("fsync", "rename", "link")}

    def fsync(fd: int) -> None:
        real["fsync"](fd)
        with lock:
            events.append(("fsync", os.fstat(fd).st_ino))

    def moved(name: str) -> Callable[..., None]:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real[name](src, dst, *args, **kwargs)
            with lock:
                events.append((name, os.stat(dst).st_ino))

        return move

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("rename", "link"):
        monkeypatch.setattr(os, name, moved(name))
    Checkpointer(tmp_path).save_checkpoint(0, crash_saver.payload(0))
    monkeypatch.undo()

    def first(what: str, inode: int) -> int:
        assert (what, inode) in events, (what, inode, events)
        return events.index((what, inode))

    data, parent = tmp_path / "ckpt.0", tmp_path.stat().st_ino
    renamed = first("rename", data.stat().st_ino)
    for file in data.iterdir():  # bytes and names of the files, durable before the rename
        assert first("fsync", file.stat().st_ino) < renamed, file.name
    assert first("fsync", data.stat().st_ino) < renamed
    sentinel = (tmp_path / "sentinel_checkpoint_complete.0").stat().st_ino
    linked = first("link", sentinel)
    after_rename = [i for i, e in enumerate(events) if e == ("fsync", parent) and i > renamed]
    assert after_rename and after_rename[0] < linked  # the rename is durable before the link
    assert first("fsync", sentinel) < linked  # the sentinel's bytes are durable before its name
    assert ("fsync", parent) in events[linked + 1 :]  # and the name before the save returns
