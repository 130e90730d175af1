"""Issue 22 safety net: a save failing at each of its storage calls in turn, on local disk and on
``memory://`` (the fault-injecting ``faulty://`` filesystem of ``tests/test_storage.py``).

Local faults are injected at the standard library's calls (``os.open`` of a file to write,
``os.fsync``, ``os.rename``/``os.replace``, ``os.mkdir``, ``os.unlink``/``os.rmdir``), not at
the package's private helpers, so the table keeps its meaning while the code under it changes;
object-store faults at each fsspec call of each kind. Each call of a save fails in turn, either
once (the code's own undo then runs unhindered) or for good (every later call of that kind
fails too: a disk gone read-only, a store that stopped answering).

On both backends, for a new N and for a re-save of the newest N:

- a save that raises raises an I/O error (an ``OSError``, such as ``StorageError`` or
  ``BurnpackIOError``, or a ``RecordError`` of kind ``"io"`` naming the record) whose chain
  names the injected failure; the sentinels are the ones there were, nothing is left that a
  search warns about, and every checkpoint saved before it is complete, verifies and loads its
  own data (for a re-save: the old N's);
- a save that returns committed, and a failure after the commit (dropping the superseded copy,
  garbage collection) is a :class:`CheckpointWarning`, never an exception: a save that raises
  has not replaced anything;
- either way, the next save succeeds and leaves nothing behind but checkpoints.

On main before issue 22 lands, the local ``resave`` rows fail: when removing the old copy of N
fails (an ``os.unlink`` after the new sentinel is written), ``save_checkpoint`` raises although
it committed the new N, so a caller is told the save failed while N was replaced. They are
expected to pass once the re-save drops the superseded copy as a warning, as garbage
collection does and as the object-store commit does.
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _backends as b
import pytest
from test_storage import FaultyFileSystem, _fast_retries  # noqa: F401 - an autouse fixture

from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    get_latest_checkpoint_number,
    verify_checkpoint,
)
from lightning_bpk.records import RecordChecksumError, RecordError

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


@pytest.fixture(autouse=True)
def _clean_faulty() -> Iterator[None]:
    FaultyFileSystem.store.clear()
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.calls.clear()
    yield
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.store.clear()


def _three_checkpoints(base: Path | str) -> Checkpointer:
    c = Checkpointer(base, checkpoint_duration=5)
    for n in range(3):
        c.save_checkpoint(n, b.tensors_payload(n))
    return c


def _saves(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: bool, n: int
) -> Iterator[tuple[str, b.Where, Checkpointer, BaseException | None, list]]:
    """Three checkpoints, then saving ``n`` with one call failing: each call of each kind in
    turn. Yields ``(call, where, checkpointer, what the save raised, warnings)``."""
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
    c = _three_checkpoints(where.base)
    arm(None, 0)
    c.save_checkpoint(n, data)
    counts = disarm()
    assert sum(counts.values()) > 5, counts  # the table is not empty
    for kind, total in sorted(counts.items()):
        for k in range(1, total + 1):
            where = b.make_where(backend, tmp_path, protocol="faulty")
            c = _three_checkpoints(where.base)
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
            yield f"{kind} call {k} of {total}", where, c, failed, caught


def _chain(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 10:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return " <- ".join(parts)


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "for-good"])
@pytest.mark.parametrize("resave", [False, True], ids=["new", "resave"])
@pytest.mark.parametrize("backend", b.BACKENDS)
def test_a_failure_at_every_call_keeps_every_earlier_checkpoint(
    tmp_path: Path, monkeypatch, backend: str, resave: bool, persistent: bool
) -> None:
    n = 2 if resave else 3
    for call, where, c, failed, caught in _saves(backend, tmp_path, monkeypatch, persistent, n):
        if failed is not None:
            # an I/O failure, typed as one: an OSError (StorageError, BurnpackIOError) or a
            # RecordError of kind "io" naming the record; never a checksum or validation error
            assert isinstance(failed, (OSError, RecordError)), (call, _chain(failed))
            if isinstance(failed, RecordError):
                assert failed.kind == "io", (call, _chain(failed))
                assert not isinstance(failed, RecordChecksumError), (call, _chain(failed))
            assert "injected" in _chain(failed), (call, _chain(failed))
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
        else:  # committed; a failure after the commit (GC) only warns
            assert {w.category for w in caught} <= {CheckpointWarning}, (call, caught)
            assert get_latest_checkpoint_number(where.base, verify=True) == n, call
            b.assert_tensors_payload(c.load_checkpoint(n), n, extra=[1, 2])
            for m in range(n):
                b.assert_tensors_payload(c.load_checkpoint(m), m)
        # The next save (no faults) succeeds, and only checkpoints remain.
        c.save_checkpoint(4, b.tensors_payload(4))
        assert get_latest_checkpoint_number(where.base, verify=True) == 4, call
        assert b.leftovers(where) == [], (call, b.leftovers(where))
