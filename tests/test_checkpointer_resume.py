"""Choosing the checkpoint to resume from (``choose_resume``, ``lightning_bpk.checkpointer._view``)
reads little: each sentinel at most once and a bounded number of listings, through every entry
point, on an object store and on local disk.

Counted on an object store with ``counting://`` (``memory://`` under its own protocol that
records each outermost read and listing call; ``tests/_backends.py``) and on local disk with an
audit hook (``open`` of a sentinel; ``os.listdir``/``os.scandir`` of anything in the run
directory): no mock of the package's own code.

The bounds asserted, per entry-point call:

- every sentinel is read (its bytes fetched) at most once;
- a resume (``get_latest_checkpoint_number``, the callback's resume up to the first training
  step, ``BurnpackCheckpointIO.load_checkpoint`` of a checkpoint directory) lists at most
  :data:`RESUME_LISTINGS` times: the directory, the chosen checkpoint's data, and (the
  callback) the lease, which lists :data:`TAKE_OVER_LISTINGS` more: the directory again once it
  holds it (what was there then, so that a superseded run's later writes are told apart);
- the CLI's ``ls`` and ``verify`` of a directory of ``K`` checkpoints list at most ``K + 2``
  times (the directory, each checkpoint's data, one spare).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _backends as b
import lightning as L
import pytest

from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    choose_resume,
    get_latest_checkpoint_number,
)
from lightning_bpk.cli import main as cli_main
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.lightning.checkpoint_io import BurnpackCheckpointIO
from lightning_bpk.store import ObjectStore, object_store

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)

RESUME_LISTINGS = 3
TAKE_OVER_LISTINGS = 1
CHECKPOINTS = 2  # what the fixture's fit saved


# --- the choice itself -------------------------------------------------------------------------


def test_resume_loads_in_one_read_and_falls_back_past_a_damaged_object(tmp_path):
    """What the callback's resume uses on object stores: verify while loading."""
    where = b.make_where("memory", tmp_path)
    url = str(where.base)
    checkpointer = Checkpointer(url)
    for n in (0, 1):
        checkpointer.save_checkpoint(n, b.record_payload(n))
    raw = bytearray(where.read("ckpt.1/model.bpk"))
    raw[-1] ^= 0xFF  # a tensor byte: only its checksum tells
    where.write("ckpt.1/model.bpk", bytes(raw))
    store = object_store(url)
    assert get_latest_checkpoint_number(url) == 1  # the quick checks pass
    with pytest.warns(CheckpointWarning, match="checkpoint 1 .* skipped"):
        number, data, _ = choose_resume(store, "checkpoint", "ckpt", ("model",), at_most=1)
    assert number == 0 and data["trainer"] == {"step": 0}


def test_the_choice_reads_only_the_chosen_sentinel(tmp_path, monkeypatch):
    """The checks and the load of one choice share the manifest they read."""
    url = str(b.make_where("memory", tmp_path).base)
    Checkpointer(url).save_checkpoint(0, b.record_payload(0))
    store = object_store(url)
    reads: list[str] = []
    read = ObjectStore.read

    def counted(self, key):
        reads.append(key)
        return read(self, key)

    monkeypatch.setattr(ObjectStore, "read", counted)
    number, data, _ = choose_resume(store, "checkpoint", "ckpt", ("model",), at_most=0)
    assert number == 0 and data["trainer"] == {"step": 0}
    assert reads == ["sentinel_checkpoint_complete.0"]


# --- what every entry point reads and lists ------------------------------------------------------


class _Counts:
    """What one entry-point call read and listed: sentinel name -> reads, and listings."""

    def __init__(self) -> None:
        self.sentinel_reads: Counter[str] = Counter()
        self.listings: list[str] = []

    def check(self, max_listings: int) -> None:
        reread = {name: k for name, k in self.sentinel_reads.items() if k > 1}
        assert reread == {}, f"sentinels read more than once: {reread}; listings {self.listings}"
        assert len(self.listings) <= max_listings, (
            f"{len(self.listings)} listings > {max_listings}: {self.listings}"
        )


_AUDIT: list[Any] = []  # [(root, counts)] while a local count runs


def _audit(event: str, args: tuple) -> None:
    if not _AUDIT:
        return
    root, counts = _AUDIT[0]
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path, mode = os.fsdecode(args[0]), args[1]
        writing = mode is not None and any(c in str(mode) for c in "wax+")
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writing = writing or bool(flags & (os.O_WRONLY | os.O_RDWR))
        name = os.path.basename(path)
        if not writing and path.startswith(root) and name.startswith(b.SENTINEL + "."):
            counts.sentinel_reads[name] += 1
    elif event in ("os.listdir", "os.scandir") and args and args[0] is not None:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(root):
            counts.listings.append(os.fsdecode(path))


sys.addaudithook(_audit)


@contextlib.contextmanager
def counting(where: b.Where) -> Iterator[_Counts]:
    """Count what the block reads and lists in ``where``'s directory."""
    counts = _Counts()
    if where.backend == "local":
        _AUDIT.append((where.root, counts))
        try:
            yield counts
        finally:
            _AUDIT.clear()
        return
    b.CountingFileSystem.reset_counts()
    try:
        yield counts
    finally:
        for _, key in b.CountingFileSystem.reads:
            name = key.rsplit("/", 1)[-1]
            if name.startswith(b.SENTINEL + "."):
                counts.sentinel_reads[name] += 1
        counts.listings = [key for _, key in b.CountingFileSystem.listings]


def _fit(base: Path | str, root: Path, epochs: int, callbacks: list) -> BurnpackCheckpoint:
    L.seed_everything(0)
    callback = BurnpackCheckpoint(dirpath=base)
    make_trainer(str(root), epochs, [callback, *callbacks]).fit(TinyModel())
    return callback


@pytest.fixture(scope="module", params=b.BACKENDS)
def where(request, tmp_path_factory) -> b.Where:
    """A run directory a two-epoch fit saved checkpoints 0 and 1 into (one per backend). The
    callback's resume, last in this file, trains on in it; the other tests only read."""
    tmp = tmp_path_factory.mktemp(f"resume-{request.param}")
    where = b.make_where(request.param, tmp, protocol="counting")
    _fit(where.base, tmp / "root", 2, [])
    return where


@pytest.mark.parametrize("verify", [False, True], ids=["quick", "verify"])
def test_the_search_reads_each_sentinel_once_and_lists_little(where: b.Where, verify: bool) -> None:
    with counting(where) as counts:
        assert get_latest_checkpoint_number(where.base, verify=verify) == 1
    counts.check(RESUME_LISTINGS)


def test_checkpoint_io_loading_a_directory_reads_each_sentinel_once_and_lists_little(
    where: b.Where,
) -> None:
    path = f"{where.base}/{where.data_name(1)}"
    with counting(where) as counts:
        loaded = BurnpackCheckpointIO().load_checkpoint(path)
    assert loaded["epoch"] == 1
    counts.check(RESUME_LISTINGS)


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_cli_ls_and_verify_read_each_sentinel_once_and_list_each_checkpoint_once(
    where: b.Where, command: str, capsys
) -> None:
    with counting(where) as counts:
        assert cli_main([command, str(where.base)]) == 0, capsys.readouterr()
    counts.check(CHECKPOINTS + 2)


class _CountUntilTraining(L.Callback):
    """Stops counting when training starts: the resume (setup, choice, restore) is done."""

    def __init__(self, stop: Any) -> None:
        self.stop = stop

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop()


def test_the_callback_resume_reads_each_sentinel_once_and_lists_little(
    where: b.Where, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        counts = stack.enter_context(counting(where))
        callback = _fit(where.base, tmp_path / "root", 3, [_CountUntilTraining(stack.close)])
    assert callback.restored_number == 1
    counts.check(RESUME_LISTINGS + TAKE_OVER_LISTINGS)
