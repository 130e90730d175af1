"""What the backend-parametrized tables share: one checkpoint directory on local disk or on an
fsspec object store, reached and damaged through the public on-disk layout only, and the fsspec
filesystems that count, crash or fail under the code that writes and reads it.

A checkpoint ``N`` is its sentinel ``sentinel_<identifier>_complete.N`` (a JSON manifest whose
``data`` names the data directory or prefix: ``ckpt.N``, or ``ckpt.N~<hex>`` for a re-save)
and the files under that data name. Every helper here finds files by listing and by reading
the manifest, never through the package's private classes, so the tests that use it keep
meaning the same thing while the code under them is rewritten.

Both backends are driven through fsspec (``LocalFileSystem`` for a local directory), so one
helper serves both.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from lightning_bpk.records import ModuleRecord
from lightning_bpk.store import objects as store_objects

SENTINEL = "sentinel_checkpoint_complete"
BACKENDS = ("local", "memory")
_SENTINEL_NAME = re.compile(re.escape(SENTINEL) + r"\.(0|[1-9][0-9]*)")  # one spelling a number


def tensors_payload(n: int) -> dict[str, Any]:
    """Iteration ``n``'s data: a model record's worth of tensors and plain trainer data (the
    metadata string ``itN`` is what the metadata damage flips)."""
    g = torch.Generator().manual_seed(n)
    return {
        "model": {"w": torch.randn(300, generator=g), "b": torch.arange(5, dtype=torch.int16)},
        "trainer": {"iteration": n, "tag": f"it{n}"},
    }


def record_payload(n: int) -> dict[str, Any]:
    """Step ``n``'s data as a run saves it: a ``Linear(4, 3)``'s :class:`ModuleRecord` (seeded
    by ``n``) and the trainer's step."""
    torch.manual_seed(n)
    return {"model": ModuleRecord.from_module(torch.nn.Linear(4, 3)), "trainer": {"step": n}}


def assert_tensors_payload(loaded: dict[str, Any] | None, n: int, **extra: Any) -> None:
    """``loaded`` is exactly :func:`tensors_payload` ``(n)`` (plus ``extra`` entries)."""
    assert loaded is not None, f"checkpoint {n} did not load"
    expected = {**tensors_payload(n), **extra}
    assert list(loaded) == list(expected)
    for name, t in expected["model"].items():
        assert loaded["model"][name].dtype == t.dtype and torch.equal(loaded["model"][name], t)
    for key in expected:
        if key != "model":
            assert loaded[key] == expected[key], key


@dataclass
class Where:
    """A checkpoint directory: ``base`` is what the checkpointer is given (a ``Path`` or a
    URL); ``fs`` and ``root`` reach the same bytes through fsspec."""

    backend: str
    base: Path | str
    fs: Any
    root: str

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        """Every file below the directory, relative to it (the lock and lease files too)."""
        return sorted(p[len(self.root) + 1 :] for p in self.fs.find(self.root))

    def read(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.key(name)))

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.key(name), data)

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.key(name))

    def sentinel(self, n: int) -> str:
        return f"{SENTINEL}.{n}"

    def data_name(self, n: int) -> str:
        """The data directory or prefix sentinel ``n``'s manifest names."""
        return str(json.loads(self.read(self.sentinel(n)))["data"])

    def data_file(self, n: int, file: str) -> str:
        return f"{self.data_name(n)}/{file}"

    def snapshot(self) -> dict[str, bytes | None]:
        """Name -> bytes of every file but the lock (flock target) and lease files, and name ->
        ``None`` of every directory (an empty one left behind counts)."""
        found = self.fs.find(self.root, withdirs=True, detail=True)
        return {
            path[len(self.root) + 1 :]: None
            if info["type"] == "directory"
            else self.read(path[len(self.root) + 1 :])
            for path, info in sorted(found.items())
            if path != self.root and not path[len(self.root) + 1 :].startswith(".lightning_bpk")
        }


def complete_numbers(where: Where) -> list[int]:
    """The numbers of every sentinel in the directory."""
    found = (_SENTINEL_NAME.fullmatch(name) for name in where.names())
    return sorted(int(m.group(1)) for m in found if m is not None)


def leftovers(where: Where) -> list[str]:
    """Files that belong to no sentinel's data (the lock and lease files excepted)."""
    data = {where.data_name(n) for n in complete_numbers(where)}
    return [
        name
        for name in where.names()
        if not name.startswith(".lightning_bpk")
        and not _SENTINEL_NAME.fullmatch(name)
        and name.split("/")[0] not in data
    ]


def where_of(base: Path | str) -> Where:
    """The checkpoint directory ``base`` (a local path or a URL), which may exist already."""
    fs, root = fsspec.core.url_to_fs(str(base))
    backend = "local" if isinstance(fs, LocalFileSystem) else "object"
    return Where(backend, base, fs, root.rstrip("/"))


def make_where(backend: str, tmp_path: Path, protocol: str = "memory") -> Where:
    """A fresh, empty checkpoint directory on ``backend`` (``"local"``: below ``tmp_path``;
    ``"memory"``: a new bucket of the fsspec filesystem ``protocol``)."""
    if backend == "local":
        base: Path | str = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
        base.mkdir()
    else:
        base = f"{protocol}://bucket-{uuid.uuid4().hex[:8]}/run"
    fs, root = fsspec.core.url_to_fs(str(base))
    return Where(backend, base, fs, root.rstrip("/"))


# --- damage, through the layout -----------------------------------------------------------------


def damage_truncate(w: Where, n: int) -> str:
    raw = w.read(w.data_file(n, "model.bpk"))
    w.write(w.data_file(n, "model.bpk"), raw[:-1])
    return "model.bpk: .* bytes, manifest records"


def damage_flip_payload(w: Where, n: int) -> str:
    raw = bytearray(w.read(w.data_file(n, "model.bpk")))
    raw[-5] ^= 0x01  # inside the last tensor
    w.write(w.data_file(n, "model.bpk"), bytes(raw))
    return "fail.* checksum"


def damage_flip_metadata(w: Where, n: int) -> str:
    raw = bytearray(w.read(w.data_file(n, "trainer.bpk")))
    raw[raw.index(b"it%d" % n)] ^= 0x20  # the string "itN" -> "ItN": still valid CBOR
    w.write(w.data_file(n, "trainer.bpk"), bytes(raw))
    return "header/metadata bytes differ"


def damage_delete_file(w: Where, n: int) -> str:
    w.remove(w.data_file(n, "trainer.bpk"))
    return "trainer.bpk: listed in the manifest but missing"


def damage_stray_file(w: Where, n: int) -> str:
    w.write(w.data_file(n, "extra.bpk"), b"")
    return "extra.bpk: unexpected file"


def damage_empty_sentinel(w: Where, n: int) -> str:
    w.write(w.sentinel(n), b"")
    return "empty sentinel"


def damage_garbage_sentinel(w: Where, n: int) -> str:
    w.write(w.sentinel(n), b"\x00garbage{")
    return "neither a manifest"


def damage_wrong_iteration(w: Where, n: int) -> str:
    doc = json.loads(w.read(w.sentinel(n)))
    doc["iteration"] = n - 1
    w.write(w.sentinel(n), json.dumps(doc).encode())
    return f"manifest is for iteration {n - 1}, not {n}"


def damage_missing_data(w: Where, n: int) -> str:
    data = w.data_name(n)
    for name in w.names():
        if name.startswith(data + "/"):
            w.remove(name)
    if w.fs.exists(w.key(data)):  # a local directory (object stores have no empty prefixes)
        w.fs.rm(w.key(data), recursive=True)
    return "data is missing"


# --- a filesystem that counts what is read and listed -------------------------------------------

_READS = ("cat_file", "cat_ranges", "cat", "_open", "open", "read_block", "get_file", "head")
_LISTINGS = ("ls", "find", "walk", "glob", "du", "listdir")


class CountingFileSystem(MemoryFileSystem):
    """``memory://`` under its own protocol, ``counting://``, that records every outermost call
    that reads bytes (``reads``: ``(method, key)``) or lists (``listings``: ``(method, key)``).

    Only the outermost call counts (fsspec's ``find`` calls ``ls``, ``cat_ranges`` calls
    ``cat_file``): one request of the code under test is one entry.
    """

    protocol = "counting"
    store: dict = {}  # noqa: RUF012 - MemoryFileSystem keeps its files on the class
    pseudo_dirs: list = [""]  # noqa: RUF012
    reads: list = []  # noqa: RUF012
    listings: list = []  # noqa: RUF012
    _local = threading.local()  # call depth, per thread (ranged reads run in a pool)

    @classmethod
    def reset_counts(cls) -> None:
        cls.reads.clear()
        cls.listings.clear()


def _counted(name: str, into: str) -> Any:
    real = getattr(MemoryFileSystem, name)

    def wrapper(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        depth = getattr(cls._local, "depth", 0)
        outermost = depth == 0
        if name in ("_open", "open"):
            mode = args[0] if args else kwargs.get("mode", "rb")
            outermost = outermost and "r" in mode
        if outermost:
            keys = path if isinstance(path, list) else [path]
            for key in keys:
                getattr(cls, into).append((name, cls._strip_protocol(str(key))))
        cls._local.depth = depth + 1
        try:
            return real(self, path, *args, **kwargs)
        finally:
            cls._local.depth = depth

    wrapper.__name__ = name
    return wrapper


for _name in _READS:
    setattr(CountingFileSystem, _name, _counted(_name, "reads"))
for _name in _LISTINGS:
    setattr(CountingFileSystem, _name, _counted(_name, "listings"))

fsspec.register_implementation("counting", CountingFileSystem, clobber=True)


# --- a crash at any moment ----------------------------------------------------------------------


class Crash(BaseException):
    """The process died here: not an ``Exception``, so no retry or ``except Exception`` of the
    code under test outlives it (its ``finally`` blocks may run, but a crash test restores the
    state as it was at the moment of the crash, which undoes whatever they did)."""


_MUTATORS = (
    "pipe_file", "put_file", "put", "pipe", "rm_file", "rm", "cp_file", "copy", "mv", "touch",
    "mkdir", "makedirs", "rmdir", "_open", "open",
)  # fmt: skip


class CrashingFileSystem(MemoryFileSystem):
    """``memory://`` under its own protocol, ``crashing://``, whose process "dies" just before
    its ``crash_at``-th outermost mutating call (a write, upload, delete, copy or move): that
    call and every later one raise :class:`Crash`, and ``at_crash`` keeps the files exactly as
    they were at that moment (:meth:`restore` puts them back). ``crash_at=None`` counts only."""

    protocol = "crashing"
    store: dict = {}  # noqa: RUF012 - MemoryFileSystem keeps its files on the class
    pseudo_dirs: list = [""]  # noqa: RUF012
    mutations = 0
    crash_at: int | None = None
    at_crash: tuple[dict[str, bytes], list[str]] | None = None
    _local = threading.local()

    @classmethod
    def arm(cls, crash_at: int | None) -> None:
        cls.mutations, cls.crash_at, cls.at_crash = 0, crash_at, None

    @classmethod
    def restore(cls) -> None:
        """The files as they were when the crash came (a no-op if none came)."""
        if cls.at_crash is None:
            return
        (files, dirs), cls.crash_at, cls.at_crash = cls.at_crash, None, None
        cls.store.clear()
        fs = cls()
        for path, data in files.items():
            fs.pipe_file(path, data)
        cls.pseudo_dirs[:] = dirs


def _crashing(name: str) -> Any:
    real = getattr(MemoryFileSystem, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        depth = getattr(cls._local, "depth", 0)
        mutating = depth == 0
        if name in ("_open", "open"):
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "rb")
            mutating = mutating and any(c in mode for c in "wax+")
        if mutating and cls.crash_at is not None:
            if cls.at_crash is not None:
                raise Crash(f"{name} after the crash")
            cls.mutations += 1
            if cls.mutations == cls.crash_at:
                files = {p: bytes(f.getvalue()) for p, f in cls.store.items()}
                cls.at_crash = (files, list(cls.pseudo_dirs))
                raise Crash(f"crash before {name} (mutation {cls.mutations})")
        elif mutating:
            cls.mutations += 1
        cls._local.depth = depth + 1
        try:
            return real(self, *args, **kwargs)
        finally:
            cls._local.depth = depth

    wrapper.__name__ = name
    return wrapper


for _name in _MUTATORS:
    setattr(CrashingFileSystem, _name, _crashing(_name))

fsspec.register_implementation("crashing", CrashingFileSystem, clobber=True)


# --- a filesystem that fails at the k-th call of each kind --------------------------------------


class FaultyFileSystem(MemoryFileSystem):
    """``memory://`` under its own protocol, ``faulty://``, whose k-th call of a kind raises:
    ``faults[kind] = (k, times, exception)`` fails calls k .. k+times-1 of that kind (counting
    from 1); ``calls`` counts every call of each kind."""

    protocol = "faulty"
    store: dict = {}  # noqa: RUF012 - MemoryFileSystem keeps its files on the class
    pseudo_dirs: list = [""]  # noqa: RUF012
    faults: dict = {}  # noqa: RUF012
    calls: dict = {}  # noqa: RUF012

    def _count(self, kind: str) -> None:
        n = self.calls[kind] = self.calls.get(kind, 0) + 1
        k, times, error = self.faults.get(kind, (0, 0, None))
        if k <= n < k + times:
            raise error(f"injected failure of {kind} call {n}")

    def put_file(self, *args: Any, **kwargs: Any) -> Any:
        self._count("put")
        return super().put_file(*args, **kwargs)

    def pipe_file(self, *args: Any, **kwargs: Any) -> Any:
        self._count("pipe")
        result = super().pipe_file(*args, **kwargs)
        self._count("pipe-landed")  # a write that took effect, but whose answer was lost
        return result

    def rm_file(self, *args: Any, **kwargs: Any) -> Any:
        self._count("rm")
        return super().rm_file(*args, **kwargs)

    def rm(self, *args: Any, **kwargs: Any) -> Any:
        self._count("rm")
        return super().rm(*args, **kwargs)

    def ls(self, *args: Any, **kwargs: Any) -> Any:
        self._count("ls")
        return super().ls(*args, **kwargs)

    def info(self, *args: Any, **kwargs: Any) -> Any:
        self._count("info")
        return super().info(*args, **kwargs)

    def cat_ranges(self, *args: Any, **kwargs: Any) -> Any:
        self._count("cat_ranges")
        return super().cat_ranges(*args, **kwargs)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch) -> Any:
    """:class:`FaultyFileSystem`, empty and with no fault set, and the object store's retries
    made fast (a test module uses it by name: ``pytest.mark.usefixtures("faulty")``)."""
    monkeypatch.setattr(store_objects, "BASE_WAIT", 0.001)
    monkeypatch.setattr(store_objects, "COMPLETION_WAIT", 0.05)
    FaultyFileSystem.store.clear()
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.calls.clear()
    yield FaultyFileSystem
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.store.clear()
