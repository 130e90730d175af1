"""A save commits whole or not at all (``lightning_bpk.checkpointer._commit``), on local disk and
on ``memory://``: a crash at any moment of a save, or a failure at any of its storage calls,
leaves every checkpoint that was complete complete and loadable, a re-save of the newest one
included, and the next save works and leaves nothing but checkpoints.

A SIGKILL of a real saving process, and the order of a save's fsyncs, are pinned in
``tests/test_checkpointer_crash.py``.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _backends as b
import pytest
import torch
from _backends import FaultyFileSystem, faulty  # noqa: F401 - a fixture, used by name

from lightning_bpk import _fs
from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    Staged,
    get_latest_checkpoint_number,
    list_checkpoints,
    verify_checkpoint,
)
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.records import ModuleRecord, RecordChecksumError, RecordError, files
from lightning_bpk.store import name_of


def _three_checkpoints(base: Path | str, duration: int) -> Checkpointer:
    c = Checkpointer(base, checkpoint_duration=duration)
    for n in range(3):
        c.save_checkpoint(n, b.tensors_payload(n))
    return c


# --- a crash at any moment ----------------------------------------------------------------------

_FD_OPS = ("fsync", "fdatasync", "write", "pwrite", "writev", "pwritev", "ftruncate")
_PATH_OPS = ("rename", "replace", "mkdir", "unlink", "remove", "rmdir", "truncate", "link")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class _LocalCrash:
    """The local twin of ``CrashingFileSystem``: counts the mutating stdlib calls on a
    directory while armed, and crashes before the ``crash_at``-th."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = str(root)
        self.crash_at: int | None = None
        self.mutations = 0
        self.at_crash: dict[str, bytes | None] | None = None
        self.first: str | None = None  # what the crash came before
        self.armed = False
        for name in (*_FD_OPS, *_PATH_OPS, "open"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))
        monkeypatch.setattr(builtins, "open", self._wrap("builtin open", builtins.open))

    def arm(self, root: Path, crash_at: int | None) -> None:
        self.root, self.crash_at, self.mutations = str(root), crash_at, 0
        self.at_crash = self.first = None
        self.armed = True

    def _mutates(self, name: str, args: tuple, kwargs: dict) -> bool:
        if name in _FD_OPS:
            return True
        path = args[0] if args else None
        if not isinstance(path, (str, bytes, os.PathLike)):
            return name in _PATH_OPS  # relative to a dir_fd (shutil.rmtree): inside
        inside = os.fsdecode(os.path.abspath(path)).startswith(self.root)
        if name == "open":
            flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
            return inside and bool(flags & _WRITE_FLAGS)
        if name == "builtin open":
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            return inside and any(c in mode for c in "wax+")
        return inside

    def _wrap(self, name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.armed and self._mutates(name, args, kwargs):
                if self.at_crash is not None:
                    raise b.Crash(f"{name} after the crash")
                self.mutations += 1
                if self.mutations == self.crash_at:
                    self.armed = False
                    self.at_crash = self._files()
                    self.armed = True
                    where = os.fsdecode(args[0]) if name in _PATH_OPS and args else ""
                    self.first = f"crash before {name}({where}) (mutation {self.mutations})"
                    raise b.Crash(self.first)
            return real(*args, **kwargs)

        return wrapper

    def _files(self) -> dict[str, bytes | None]:
        files: dict[str, bytes | None] = {}
        for directory, dirs, names in os.walk(self.root):
            for d in dirs:
                files[os.path.relpath(os.path.join(directory, d), self.root)] = None
            for n in names:
                path = os.path.join(directory, n)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, self.root)] = f.read()
        return files

    def disarm_and_restore(self) -> None:
        self.armed = False
        if self.at_crash is None:
            return
        shutil.rmtree(self.root)
        os.mkdir(self.root)
        for rel, data in sorted(self.at_crash.items()):
            path = os.path.join(self.root, rel)
            if data is None:
                os.makedirs(path, exist_ok=True)
            else:
                with open(path, "wb") as f:
                    f.write(data)


@pytest.mark.parametrize("resave", [True, False], ids=["resave", "new"])
@pytest.mark.parametrize("backend", b.BACKENDS)
def test_a_crash_at_any_moment_keeps_the_newest_complete_checkpoint(
    tmp_path: Path, monkeypatch, backend: str, resave: bool
) -> None:
    """A crash is modelled exactly: just before the save's k-th mutating storage operation
    (each in turn), the state of the directory is recorded, the operation and every later one
    raise :class:`~_backends.Crash` (a ``BaseException``), and once the save has unwound the
    directory is put back as it was at that moment, so nothing the dying code did afterwards
    (an undo in an ``except`` or ``finally``) survives, as after a SIGKILL or a power cut of a
    process whose writes had reached the disk. Local operations are the standard library's
    (``os.open`` to write, ``os.write``/``pwrite``, ``os.fsync``, ``os.rename``/``replace``,
    ``os.mkdir``, ``os.unlink``/``rmdir``, ``os.truncate``, ``os.link``; builtin ``open`` to
    write), object-store ones every fsspec call that writes, uploads, copies, moves or deletes
    (``crashing://``, ``tests/_backends.py``).

    After every crash: the verifying and the quick search agree on the newest checkpoint
    without a warning (a crash damages nothing already published); for a re-save of N that is
    N itself, with either its old or its new data, bit-exact; every earlier checkpoint loads;
    the next save works and leaves nothing but checkpoints."""
    n = 2 if resave else 3
    data = {**b.tensors_payload(n), "extra": ["new"]}
    local = _LocalCrash(monkeypatch, tmp_path) if backend == "local" else None
    crashing = b.CrashingFileSystem

    def attempt(crash_at: int | None) -> tuple[b.Where, int, str | None]:
        where = b.make_where(backend, tmp_path, protocol="crashing")
        _three_checkpoints(where.base, duration=5)
        if local is not None:
            local.arm(Path(where.root), crash_at)
        else:
            crashing.arm(crash_at)
        crashed = None
        try:
            Checkpointer(where.base, checkpoint_duration=5).save_checkpoint(n, data)
        except b.Crash as e:
            crashed = str(e).split(" after the crash")[0] if local is None else local.first
            crashed = crashed or str(e)
        finally:
            if local is not None:
                mutations = local.mutations
                local.disarm_and_restore()
            else:
                mutations = crashing.mutations
                crashing.restore()
                crashing.crash_at = None
        return where, mutations, crashed

    _, total, crashed = attempt(None)
    assert crashed is None and total >= 3, total  # at least: the data files and the sentinel
    for k in range(1, total + 1):
        where, _, crashed = attempt(k)
        assert crashed is not None, k
        call = f"{crashed} of {total}"
        c = Checkpointer(where.base, checkpoint_duration=5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            latest = get_latest_checkpoint_number(where.base, verify=True)
            assert get_latest_checkpoint_number(where.base) == latest, call
        if resave:
            assert latest == 2, f"{call}: the newest complete checkpoint is {latest}, not 2"
        else:
            assert latest in (2, 3), call
        assert verify_checkpoint(where.base, latest) == [], call
        loaded = c.load_checkpoint(latest)
        if loaded is not None and "extra" in loaded:
            b.assert_tensors_payload(loaded, latest, extra=["new"])
        else:
            b.assert_tensors_payload(loaded, latest)
        for m in range(latest):
            b.assert_tensors_payload(c.load_checkpoint(m), m)
        c.save_checkpoint(4, b.tensors_payload(4))
        assert get_latest_checkpoint_number(where.base, verify=True) == 4, call
        assert b.leftovers(where) == [], (call, b.leftovers(where))


def test_the_crash_model_sees_the_documented_window(tmp_path: Path, monkeypatch) -> None:
    """The model is sharp enough to catch a known crash window: a save that renames its
    sentinel away and dies before writing it back leaves no sentinel. (A guard on the harness,
    independent of the package: it must pass on every version.)"""
    root = tmp_path / "window"
    root.mkdir()
    (root / "s").write_bytes(b"x")
    local = _LocalCrash(monkeypatch, tmp_path)
    local.arm(root, 2)
    with pytest.raises(b.Crash):
        try:
            os.rename(root / "s", root / "s.aside")
            os.rename(root / "s.aside", root / "s")  # the crash comes before this one
        finally:
            os.rename(root / "s.aside", root / "s")  # an undo that a real crash never runs
    local.disarm_and_restore()
    assert sorted(os.listdir(root)) == ["s.aside"]


# --- a failure at every storage call ------------------------------------------------------------
# Local faults are injected at the standard library's calls, not at the package's private
# helpers, so the table keeps its meaning while the code under it changes; object-store faults
# at each fsspec call of each kind (``faulty://``, ``tests/_backends.py``). Each call of a save
# fails in turn, either once (the code's own undo then runs unhindered) or for good (every later
# call of that kind fails too: a disk gone read-only, a store that stopped answering).

# The stdlib calls a local save's faults are injected at: the kind of call -> (the os functions
# of that kind, the error, whether a call counts (by its arguments)).
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _opens_to_write(args: tuple, kwargs: dict) -> bool:
    flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
    return bool(flags & _WRITE_FLAGS)


def _always(args: tuple, kwargs: dict) -> bool:
    return True


_ENOSPC = OSError(errno.ENOSPC, "No space left on device (injected)")
_EIO = OSError(errno.EIO, "I/O error (injected)")
LOCAL_KINDS: dict[str, tuple[tuple[str, ...], OSError, Callable[[tuple, dict], bool]]] = {
    "create": (("open",), _ENOSPC, _opens_to_write),
    "fsync": (("fsync", "fdatasync"), _EIO, _always),
    "rename": (("rename", "replace"), _EIO, _always),
    "mkdir": (("mkdir",), _ENOSPC, _always),
    "remove": (("unlink", "remove", "rmdir"), _EIO, _always),
}


class _LocalFaults:
    """Counts the stdlib calls of each kind in :data:`LOCAL_KINDS` while armed, and fails
    calls ``k .. k + times - 1`` of the one kind that is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self.fault: tuple[str, int, int] | None = None
        for kind, (names, error, counts) in LOCAL_KINDS.items():
            for name in names:
                monkeypatch.setattr(os, name, self._wrap(kind, getattr(os, name), error, counts))
        self.armed = False

    def _wrap(self, kind: str, real: Any, error: OSError, counts: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.armed and counts(args, kwargs):
                n = self.calls[kind] = self.calls.get(kind, 0) + 1
                if self.fault is not None and self.fault[0] == kind:
                    k, times = self.fault[1:]
                    if k <= n < k + times:
                        raise OSError(error.errno, f"{error.strerror} at {kind} call {n}")
            return real(*args, **kwargs)

        return wrapper


def _saves(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool, n: int
) -> Iterator[tuple[str, b.Where, Checkpointer, dict[str, bytes], BaseException | None, list]]:
    """Three checkpoints kept for 3 (a new 3 makes retention delete 0), then saving ``n``
    with one call failing: each call of each kind in turn. Yields ``(call, where, checkpointer,
    the files before the save, what the save raised, warnings)``."""
    data = {**b.tensors_payload(n), "extra": [1, 2]}
    times = 10**6 if persistent else 1
    if backend == "local":
        faults = _LocalFaults(monkeypatch)

        def arm(kind: str | None, k: int) -> None:
            faults.calls.clear()
            faults.fault = None if kind is None else (kind, k, times)
            faults.armed = True

        def disarm() -> dict[str, int]:
            faults.armed = False
            return dict(faults.calls)

    else:

        def arm(kind: str | None, k: int) -> None:
            FaultyFileSystem.calls.clear()
            if kind is not None:
                FaultyFileSystem.faults[kind] = (k, times, ConnectionError)

        def disarm() -> dict[str, int]:
            FaultyFileSystem.faults.clear()
            return dict(FaultyFileSystem.calls)

    where = b.make_where(backend, tmp_path, protocol="faulty")
    c = _three_checkpoints(where.base, duration=3)
    arm(None, 0)
    c.save_checkpoint(n, data)
    counts = disarm()
    assert sum(counts.values()) > 5, counts  # the table is not empty
    if backend == "memory":  # uploads, writes, listings and deletes all fail in turn
        assert {"put", "pipe", "ls", "rm"} <= counts.keys(), counts
    for kind, total in sorted(counts.items()):
        for k in range(1, total + 1):
            where = b.make_where(backend, tmp_path, protocol="faulty")
            c = _three_checkpoints(where.base, duration=3)
            before = where.snapshot()
            arm(kind, k)
            failed: BaseException | None = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    c.save_checkpoint(n, data)
                except Exception as e:
                    failed = e
                finally:
                    disarm()
            yield f"{kind} call {k} of {total}", where, c, before, failed, caught


def _chain(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 10:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return " <- ".join(parts)


@pytest.mark.usefixtures("faulty")
@pytest.mark.parametrize("persistent", [False, True], ids=["once", "for-good"])
@pytest.mark.parametrize("resave", [False, True], ids=["new", "resave"])
@pytest.mark.parametrize("backend", b.BACKENDS)
def test_a_failure_at_every_call_keeps_every_earlier_checkpoint(
    tmp_path: Path, monkeypatch, backend: str, resave: bool, persistent: bool
) -> None:
    """For a new N and for a re-save of the newest N:

    - a save that raises raises an I/O error (an ``OSError``, such as ``StorageError`` or
      ``BurnpackIOError``, or locally a ``RecordError`` of kind ``"io"`` naming the record)
      whose chain names the injected failure; the sentinels are the ones there were, nothing is
      left that a search warns about, and every checkpoint saved before it is complete,
      verifies and loads its own data (for a re-save: the old N's); after a single failure
      on local disk the directory is exactly as it was;
    - a save that returns committed, and a failure after the commit (dropping the superseded
      copy, retention deleting the oldest checkpoint) is a :class:`CheckpointWarning`, never an
      exception: a save that raises has not replaced anything;
    - either way, the next save succeeds and leaves nothing behind but checkpoints."""
    n = 2 if resave else 3
    saves = _saves(backend, tmp_path, monkeypatch, persistent, n)
    for call, where, c, before, failed, caught in saves:
        if failed is not None:
            # an I/O failure, typed as one: an OSError (StorageError, BurnpackIOError), or
            # locally a RecordError of kind "io" naming the record; never a checksum or
            # validation error
            io_error = OSError if backend == "memory" else (OSError, RecordError)
            assert isinstance(failed, io_error), (call, _chain(failed))
            # and typed: the package's error (StorageError, BurnpackIOError, RecordError), never
            # a raw OSError from a store call, on either backend
            assert isinstance(failed, LightningBpkError), (call, _chain(failed))
            if isinstance(failed, RecordError):
                assert failed.kind == "io", (call, _chain(failed))
                assert not isinstance(failed, RecordChecksumError), (call, _chain(failed))
            assert "injected" in _chain(failed), (call, _chain(failed))
            if backend == "local" and not persistent:  # the save's own undo ran unhindered
                assert where.snapshot() == before, call
            # no sentinel was added or lost, and nothing the search must warn about was left
            assert b.complete_numbers(where) == [0, 1, 2], (call, where.names())
            with warnings.catch_warnings():
                warnings.simplefilter("error", CheckpointWarning)
                assert get_latest_checkpoint_number(where.base, verify=True) == 2, call
                assert get_latest_checkpoint_number(where.base) == 2, call
            for m in range(3):  # every earlier checkpoint, the old N of a re-save included
                assert verify_checkpoint(where.base, m) == [], (call, m)
                loaded = c.load_checkpoint(m)
                assert loaded is not None and "extra" not in loaded, (call, _chain(failed))
                b.assert_tensors_payload(loaded, m)
        else:  # committed; a failure after the commit only warns
            categories = [w.category for w in caught]
            if backend == "local" and call.split()[0] in ("fsync", "rename"):
                # nothing retries these locally: the failure was after the commit, and said so
                assert CheckpointWarning in categories, (call, caught)
                assert persistent or len(categories) == 1, (call, caught)
            assert set(categories) <= {CheckpointWarning}, (call, caught)
            assert get_latest_checkpoint_number(where.base, verify=True) == n, call
            assert verify_checkpoint(where.base, n) == [], call
            b.assert_tensors_payload(c.load_checkpoint(n), n, extra=[1, 2])
            kept = b.complete_numbers(where)  # 0 goes unless deleting it failed
            assert kept[-1] == n and set(kept) >= {1, 2}, (call, kept)
            for m in kept[:-1]:
                b.assert_tensors_payload(c.load_checkpoint(m), m)
        # The next save (no faults) succeeds, and only checkpoints remain.
        c.save_checkpoint(4, b.tensors_payload(4))
        assert get_latest_checkpoint_number(where.base, verify=True) == 4, call
        assert b.leftovers(where) == [], (call, b.leftovers(where))


def test_failure_between_data_and_sentinel_keeps_latest(tmp_path, monkeypatch) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(1, {"x": 1})
    real = _fs.write_all

    def failing(f, data) -> None:  # the sentinel's bytes fail to reach its (scratch) file
        if Path(str(getattr(f, "name", ""))).name.startswith(b.SENTINEL):
            raise OSError(errno.EIO, "injected")
        real(f, data)

    monkeypatch.setattr(_fs, "write_all", failing)
    with pytest.raises(OSError, match="injected"):
        c.save_checkpoint(2, {"x": 2})
    assert get_latest_checkpoint_number(tmp_path) == 1
    assert c.load_checkpoint(2) is None
    assert b.where_of(tmp_path).snapshot().keys() == {"ckpt.1", "ckpt.1/x.bpk", f"{b.SENTINEL}.1"}


@pytest.mark.parametrize("resave", [False, True], ids=["new", "resave"])
def test_a_write_failing_at_every_call_leaves_the_directory_as_it_was(
    tmp_path: Path, monkeypatch, resave: bool
) -> None:
    """Each write of a save's bytes (``_fs.write_all``, which every byte the package writes to
    a file goes through: a short or failed ``write`` of an open file is not an ``os`` call the
    table above can fail) fails in turn with ``ENOSPC``: the directory is exactly as it was,
    or, when the failure came after the commit, the save warns and its data is intact."""
    target = 2 if resave else 3
    data = {**b.tensors_payload(target), "extra": [1, 2]}
    real = _fs.write_all
    calls: list[int] = []
    fail_at: list[int | None] = [None]  # the call that fails, once the checkpoints are there

    def write_all(f: Any, view: Any) -> None:
        calls.append(1)
        if len(calls) == fail_at[0]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(f, view)

    monkeypatch.setattr(_fs, "write_all", write_all)
    c = _three_checkpoints(tmp_path / "count", duration=4)
    calls.clear()
    c.save_checkpoint(target, data)
    total = len(calls)
    assert total > 0
    for k in range(1, total + 1):
        where = b.make_where("local", tmp_path)
        c = _three_checkpoints(where.base, duration=4)
        before = where.snapshot()
        calls.clear()
        fail_at[0] = k
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                c.save_checkpoint(target, data)
                failed = None
            except (OSError, RecordError) as e:
                failed = e
        fail_at[0] = None
        if failed is not None:  # the save failed: nothing changed
            assert "injected" in str(failed)
            assert where.snapshot() == before, f"failure at call {k} of {total}"
            assert c.latest_checkpoint_number(verify=True) == 2
        else:  # the failure hit garbage collection, after the commit: a warning, data intact
            assert [w.category for w in caught] == [CheckpointWarning], k
            assert c.latest_checkpoint_number(verify=True) == target
            assert c.load_checkpoint(target)["extra"] == [1, 2]
        for n in range(3 if failed is not None or not resave else 2):
            b.assert_tensors_payload(c.load_checkpoint(n), n)


# --- a re-save ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", b.BACKENDS)
def test_a_resave_puts_its_data_beside_the_old_copy_and_removes_the_old_copy_after(
    tmp_path: Path, backend: str
) -> None:
    """Re-saving N writes its data under a name never used before (``ckpt.N~<hex>``) beside the
    old copy, commits by N's sentinel, then removes the old copy: the second save wins, nothing
    displaced is left behind, and an old copy a crash left is removed by the next save."""
    where = b.make_where(backend, tmp_path)
    c = Checkpointer(where.base, checkpoint_duration=2)
    c.save_checkpoint(1, {**b.record_payload(1), "extra": [1]})
    target = c.save_checkpoint(1, b.record_payload(10))
    assert re.fullmatch(re.escape(str(where.base)) + r"/ckpt\.1~[0-9a-f]{16}", str(target))
    name = name_of(str(target))
    files = {name, f"{name}/model.bpk", f"{name}/trainer.bpk", f"{b.SENTINEL}.1"}
    assert where.snapshot().keys() == files  # the old copy and every scratch name are gone
    assert [e.data for e in list_checkpoints(where.base)] == [target]
    loaded = c.load_checkpoint(1)
    assert list(loaded) == ["model", "trainer"] and loaded["trainer"] == {"step": 10}
    weight = b.record_payload(10)["model"].tensors["weight"]
    assert torch.equal(loaded["model"].tensors["weight"], weight)  # the second save wins
    assert c.verify_checkpoint(1) == []
    # a crash between the new sentinel and removing the old copy: the next save removes it
    where.fs.makedirs(where.key("ckpt.1"), exist_ok=True)
    where.write("ckpt.1/model.bpk", b"old bytes")
    c.save_checkpoint(2, b.record_payload(2))
    assert not any(k.startswith("ckpt.1/") for k in where.names())
    assert c.load_checkpoint(1)["trainer"] == {"step": 10}


def test_retention_resave_and_listing_in_the_store(tmp_path):
    where = b.make_where("memory", tmp_path)
    url = str(where.base)
    checkpointer = Checkpointer(url, checkpoint_duration=2)
    for n in range(4):
        checkpointer.save_checkpoint(n, b.record_payload(n))
    assert [(e.number, e.complete) for e in list_checkpoints(url)] == [(3, True), (2, True)]
    checkpointer.save_checkpoint(
        3, b.record_payload(30)
    )  # re-save: the sentinel goes first, then data
    assert checkpointer.load_checkpoint(3)["trainer"] == {"step": 30}
    assert verify_checkpoint(url, 3) == []
    assert not any(k.startswith("ckpt.1") or k.startswith("ckpt.0") for k in where.names())


def _rank_upload(checkpointer: Checkpointer, staged: Staged, value: float) -> None:
    """What a sharded save's ranks leave in the staging prefix of ``staged``: one rank file."""
    record = ModuleRecord({"w": torch.full((4,), value)})
    files.save_record(record, checkpointer.store, f"{staged.key}/shard.bpk")


@pytest.mark.usefixtures("faulty")
def test_a_sharded_resave_keeps_the_old_copy_until_its_sentinel() -> None:
    """A sharded save's ranks upload into the prefix ``begin`` chose before rank 0 commits:
    a re-save of N gets a fresh prefix, so when its sentinel write fails the old N stays whole
    (and the failed upload is removed); when it succeeds the old copy is removed."""
    url = "faulty://b/sharded"
    checkpointer = Checkpointer(url, checkpoint_duration=1)

    def resave(value: float) -> str:
        staged = checkpointer.begin(1)
        _rank_upload(checkpointer, staged, value)
        checkpointer.save_checkpoint(1, {"trainer": {"v": value}}, staged=staged)
        return staged.url

    assert resave(1.0) == f"{url}/ckpt.1"
    FaultyFileSystem.faults["pipe"] = (1, 10**6, ConnectionError)  # the sentinel's write, for good
    with pytest.raises(OSError, match="injected failure of pipe"):
        resave(2.0)
    FaultyFileSystem.faults.clear()
    assert b.where_of(url).names() == [
        "ckpt.1/shard.bpk",
        "ckpt.1/trainer.bpk",
        "sentinel_checkpoint_complete.1",
    ]
    loaded = checkpointer.load_checkpoint(1)
    assert loaded["trainer"] == {"v": 1.0}
    assert torch.equal(loaded["shard"].tensors["w"], torch.full((4,), 1.0))
    target = resave(3.0)
    assert re.fullmatch(re.escape(url) + r"/ckpt\.1~[0-9a-f]{16}", target)
    name = name_of(target)
    assert b.where_of(url).names() == [
        f"{name}/shard.bpk",
        f"{name}/trainer.bpk",
        "sentinel_checkpoint_complete.1",
    ]
    assert checkpointer.load_checkpoint(1)["trainer"] == {"v": 3.0}
    assert verify_checkpoint(url, 1) == []
