"""Dopamine's checkpointer protocol (sentinel files, frequency, retention), made crash-safe.

``base_directory`` may also be a URL (``s3://bucket/run``, ``gs://...``, ``memory://...``): the
same layout and manifest are then committed on the object store by
:mod:`lightning_bpk.object_checkpoints` (no rename there: upload, confirm, sentinel last and
create-only). :meth:`Checkpointer.take_over` makes a run the directory's owner
(:mod:`lightning_bpk.lease`): a superseded writer stops before its next write.

The names, arguments and retention arithmetic are Google Dopamine's
(``dopamine/discrete_domains/checkpointer.py``); what changed is how the bytes reach the disk and
what a sentinel promises. A checkpoint directory looks like this (defaults ``prefix="ckpt"``,
``identifier="checkpoint"``)::

    base_directory/
    ├── .lightning_bpk.lock                    flock target while a save runs (never deleted)
    ├── ckpt.7/                                iteration 7's data: one burnpack per data key
    │   ├── model.bpk                          a Record saved as is (ModuleRecord, ...)
    │   ├── optim.bpk
    │   └── trainer.bpk                        plain nested data, saved as a StateRecord
    ├── sentinel_checkpoint_complete.7         manifest (JSON), written last: "7 is complete"
    ├── ckpt.8/ ...
    ├── sentinel_checkpoint_complete.8
    └── ckpt.9.4242-0.tmp/                     staging directory of a save in flight (or of a
                                               crashed one; removed by the next save)

Saving iteration N (when ``N % checkpoint_frequency == 0``), under the directory lock:

1. remove temporaries an earlier crashed save left (only names this checkpointer produces);
2. write every entry into the staging directory ``ckpt.N.<pid>-<k>.tmp`` (each file fsynced,
   and the directory after each rename, by :func:`lightning_bpk._fs.atomic_file`);
3. if ``ckpt.N`` already exists: move sentinel N aside first (N stops being "complete") and
   fsync, then move the old data aside; rename the staging directory to ``ckpt.N``; fsync
   ``base_directory``;
4. write the sentinel atomically (scratch file, fsync, rename, fsync ``base_directory``);
5. delete what step 3 moved aside, then garbage-collect (below), sentinels before data.

An exception anywhere in steps 2-4 (a full disk, an I/O error) undoes what was done, with
renames only, so a failed save leaves the directory exactly as it found it.

A crash (even SIGKILL or power loss) at any point therefore leaves every earlier complete
checkpoint as it was, and a sentinel only ever names data that is already durable. The one
window with a cost is re-saving an existing N: if the process dies between steps 3 and 4, the
old N is no longer complete and resume falls back to the checkpoint before it (the old bytes
are never half-destroyed; they sit in temporaries that the next save removes).

**The sentinel is a manifest**, not Dopamine's ``b'done'``: format tag and version, the
iteration, the data directory name and, per file, its key, record kind, size and the xxh3-64 of
its head (the header and CBOR metadata up to the data section). The head holds the per-tensor
xxh3 checksums every record file carries, so hashing the few-KiB head at save time pins every
byte that matters without reading the tensors back (a whole-file hash would cost one more full
read per save, about 0.1 s/GiB here; verification costs the same either way, since it checks
the tensor checksums at ~28 GiB/s). Only the zero padding between tensors is not covered.
A sentinel holding exactly ``b'done'`` (written by Dopamine) still counts as complete when its
data exists, but it is unverifiable; verifying it says so.

Deviations from Dopamine, all deliberate:

- ``data`` is a mapping of safe keys to records or plain data (no pickle); a Dopamine pickle
  ``ckpt.N`` file is counted by :func:`get_latest_checkpoint_number` but never loaded.
- Sentinel discovery lists the directory (no glob, so ``run[x]`` paths work), accepts only
  canonical decimal suffixes (``7``, not ``007``, ``-7``, ``1_000`` or ``7.<pid>-<k>.tmp``),
  skips a bad one instead of returning -1 for the whole directory, ignores directories, and does
  not report a checkpoint whose sentinel is damaged or whose data is missing (it warns with a
  :class:`CheckpointWarning` naming the checkpoint and the reason, then falls back to the next).
- Garbage collection keeps "the last d" literally instead of looking at one candidate: after
  saving N it keeps the ``d`` newest complete checkpoints numbered ``<= N`` plus the multiples
  of ``keep_every*f``, and removes the other checkpoints ``<= N`` (for an uninterrupted run this
  is exactly Dopamine's result: ``N - f*d`` goes). So a crash between sentinel and GC, a jump in
  iteration numbers or a change of ``f``/``d`` between runs leaves no orphans, and never costs
  more than Dopamine's promise (saving 0, 1, 2, 3, 10 keeps 1, 2, 3, 10; Dopamine keeps all
  five). Sentinels whose data is missing, and data ``< N`` without a sentinel, are removed.
  Checkpoints newer than N are never touched. A GC failure warns instead of failing a save
  that is already complete.
- Settings are validated: frequency, duration and keep_every must be ints >= 1, iteration
  numbers ints >= 0; prefix, identifier and data keys must be safe file names.
- Two processes saving into one directory at once: the second gets
  :class:`CheckpointLockedError` (``fcntl.flock``, non-blocking) naming the directory and the pid
  holding the lock. Loading takes no lock and writes nothing, so every rank can load at once.

Example::

    >>> import tempfile, torch
    >>> checkpointer = Checkpointer(tempfile.mkdtemp(), checkpoint_duration=2)
    >>> for n in range(4):
    ...     _ = checkpointer.save_checkpoint(n, {"trainer": {"step": n, "w": torch.ones(2) * n}})
    >>> get_latest_checkpoint_number(checkpointer.base_directory)
    3
    >>> checkpointer.load_checkpoint(3)["trainer"]["step"], checkpointer.load_checkpoint(1)
    (3, None)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import reprlib
import shutil
import stat
import time
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from lightning_bpk import _fs, _gin, burnpack, storage
from lightning_bpk.errors import CheckpointLockedError
from lightning_bpk.layout import (
    DEFAULT_IDENTIFIER,
    DEFAULT_PREFIX,
    NUMBER_PATTERN,
    RECORD_SUFFIX,
    member_name_problem,
    sentinel_name,
    sentinel_stem,
)
from lightning_bpk.lease import Lease
from lightning_bpk.records.base import (
    Record,
    RecordChecksumError,
    RecordError,
    StateRecord,
    load_record,
)

__all__ = [
    "LEGACY_SENTINEL",
    "LOCK_FILE_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "MAX_SENTINEL_SIZE",
    "RECORD_SUFFIX",
    "RUN_SUBDIRECTORY",
    "CheckpointEntry",
    "CheckpointLockedError",
    "CheckpointWarning",
    "Checkpointer",
    "check_settings",
    "get_latest_checkpoint_number",
    "has_key",
    "list_checkpoints",
    "number_matches",
    "summarise",
    "verify_checkpoint",
]

# Directory-wide, so checkpointers with different prefixes or identifiers cannot interleave
# either; hidden and never deleted (unlinking a flock target would let two holders coexist).
LOCK_FILE_NAME = ".lightning_bpk.lock"
# How long a save that found the lock taken waits to learn whether a newer run is taking the
# directory over (it holds the lock only while it writes its lease: milliseconds).
_TAKE_OVER_WAIT = 10.0
MANIFEST_FORMAT = "lightning_bpk/checkpoint"
# Bumped on incompatible manifest changes; readers refuse (skip) newer manifests.
MANIFEST_VERSION = 1
# Dopamine's sentinel content: still accepted as "complete", but carries nothing to verify.
LEGACY_SENTINEL = b"done"
# A manifest lists a few entries; anything larger is damage, and is refused before reading it.
MAX_SENTINEL_SIZE = 16 * 1024 * 1024
# Keys become file names inside the data directory: a conservative portable alphabet, no leading
# dot (hidden files, "." and ".."), no separators, short enough for name + ".bpk" + scratch suffix.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_SCRATCH = r"\.[0-9]+-[0-9]+" + re.escape(_fs.SCRATCH_SUFFIX)  # what _fs.scratch_path appends
_DIGEST = re.compile(r"[0-9a-f]{16}")
# A re-saved N's data on an object store: "<prefix>.<N>~<hex>" ("~" is in no safe name).
_VERSION_MARK = "~"
_DATA_VERSION = re.compile(r"[0-9a-f]{8,32}")
# Where BurnpackCheckpoint saves inside a run's default_root_dir (``lightning-bpk ls RUN`` looks
# there too).
RUN_SUBDIRECTORY = "checkpoints"
# A problem list longer than this is summarised in warnings ("... and N more").
_SHOWN_PROBLEMS = 5
# Values quoted in messages are cut to a readable length (a damaged manifest may hold megabytes).
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 160
_HEAD_DAMAGED = "header/metadata bytes differ from the manifest's xxh3 (damaged)"
# The rule of lightning_bpk.layout: a checkpoint is made of real files and directories.
_SYMLINK = "is a symlink: refused, never followed (a checkpoint is made of real files)"


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged, incomplete, unverifiable) or could not be removed."""


# gin's selectors stay those of this module's real name (see lightning_bpk._gin)
_gin_configurable = _gin.configurable("lightning_bpk.checkpointer")


# --- names --------------------------------------------------------------------------------------


def _quote(value: object) -> str:
    """``repr(value)`` cut to a readable length."""
    return _QUOTE.repr(value)


def summarise(problems: list[str]) -> str:
    """The first few problems joined with "; ", and how many more there are."""
    shown = "; ".join(problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    return shown + (f"; ... and {more} more" if more > 0 else "")


def _safe_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{what} {_quote(value)} is not a safe file name (1-128 characters from "
            "A-Z a-z 0-9 _ . -, not starting with '.' or '-')"
        )
    return value


def _iteration(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"iteration number must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"iteration number must be >= 0 (-1 means 'no checkpoint'), got {value}")
    return value


def _matching(base: Path, pattern: str) -> Iterator[tuple[re.Match[str], Path]]:
    """Entries of ``base`` whose whole name matches ``pattern``; none if ``base`` is missing or
    not a directory (Dopamine's "-1 for a missing directory")."""
    compiled = re.compile(pattern)
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        match = compiled.fullmatch(entry.name)
        if match:
            yield match, Path(entry.path)


def number_matches(names: Iterable[str], stem: str) -> Iterator[tuple[str, re.Match[str]]]:
    """The names ``stem.N`` (canonical N) among ``names``, with their matches (group 1: N)."""
    compiled = re.compile(re.escape(stem) + r"\." + NUMBER_PATTERN)
    for name in names:
        match = compiled.fullmatch(name)
        if match:
            yield name, match


def _numbers(base: Path, stem: str) -> dict[int, Path]:
    """``{N: path}`` for the entries of ``base`` named ``stem.N``."""
    pattern = re.escape(stem) + r"\." + NUMBER_PATTERN
    return {int(m.group(1)): p for m, p in _matching(base, pattern)}


@dataclass(frozen=True)
class CheckpointEntry:
    """What the directory holds for one iteration number: its data and/or its sentinel."""

    number: int
    data: Path | str | None  # a URL string on object stores
    sentinel: Path | str | None

    @property
    def complete(self) -> bool:
        """Both halves exist (whether they verify is :func:`verify_checkpoint`'s question)."""
        return self.data is not None and self.sentinel is not None


def list_checkpoints(
    base_directory: str | os.PathLike[str],
    sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
    checkpoint_file_prefix: str = DEFAULT_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> list[CheckpointEntry]:
    """Every iteration number with data or a sentinel in ``base_directory``, newest first.

    Read-only and cheap (one directory listing); tools such as ``lightning-bpk ls`` use it.

    >>> import tempfile
    >>> base = tempfile.mkdtemp()
    >>> _ = Checkpointer(base).save_checkpoint(0, {"n": 0})
    >>> [(e.number, e.complete) for e in list_checkpoints(base)]
    [(0, True)]
    """
    if not storage.is_local(base_directory):
        store = storage.object_store(base_directory, storage_options)
        return _objects().list_checkpoints(store, sentinel_file_identifier, checkpoint_file_prefix)
    base = storage.local_path(base_directory)
    sentinels = _numbers(base, sentinel_stem(sentinel_file_identifier))
    data = _numbers(base, checkpoint_file_prefix)
    return [
        CheckpointEntry(n, data.get(n), sentinels.get(n))
        for n in sorted(set(sentinels) | set(data), reverse=True)
    ]


def _objects() -> Any:
    """The object-store protocol (:mod:`lightning_bpk.object_checkpoints`), which builds on this
    module's manifest and retention and so is imported on first use."""
    from lightning_bpk import object_checkpoints

    return object_checkpoints


def _remove(path: Path) -> None:
    """Remove a file or a whole directory tree; already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --- the manifest -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FileEntry:
    kind: str
    size: int
    head_size: int
    head_xxh3: str


@dataclass(frozen=True)
class _Manifest:
    data: str  # data directory name, e.g. "ckpt.7"
    files: dict[str, _FileEntry]  # data key -> entry, in save order


def _head_digest(path: Path, head_size: int) -> str:
    with open(path, "rb") as f:
        return xxhash.xxh3_64_hexdigest(f.read(head_size))


def _describe(path: Path, kind: str) -> _FileEntry:
    """Manifest entry of a record file just written (reads only its head)."""
    with burnpack.read(path) as pack:
        head_size = pack.data_start
    size = path.stat().st_size
    return _FileEntry(kind, size, head_size, _head_digest(path, head_size))


def _encode_manifest(iteration: int, manifest: _Manifest) -> bytes:
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "iteration": iteration,
        "data": manifest.data,
        "files": {
            key: {"file": key + RECORD_SUFFIX, **vars(entry)}
            for key, entry in manifest.files.items()
        },
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def _parse_manifest(raw: bytes, iteration: int) -> _Manifest | None:
    """The manifest in a sentinel's bytes; ``None`` for Dopamine's ``b'done'``.

    Raises ``ValueError`` saying what is wrong with anything else.
    """
    if raw == LEGACY_SENTINEL:
        return None
    if not raw:
        raise ValueError("empty sentinel")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("sentinel is neither a manifest (JSON) nor Dopamine's b'done'") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"sentinel is not a {MANIFEST_FORMAT} manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"manifest version {_quote(doc.get('version'))} is not supported (this reader knows "
            f"{MANIFEST_VERSION})"
        )
    if doc.get("iteration") != iteration:
        raise ValueError(
            f"manifest is for iteration {_quote(doc.get('iteration'))}, not {iteration}"
        )
    data = doc.get("data")
    if not isinstance(data, str) or not _names_data(data, None, iteration):
        raise ValueError(f"manifest names data {_quote(data)}, not '<prefix>.{iteration}'")
    problem = member_name_problem(data)
    if problem is not None:
        raise ValueError(f"manifest data directory: {problem}")
    _safe_name(data.partition(_VERSION_MARK)[0], "manifest data directory")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ValueError("manifest has no 'files' map")
    entries = {}
    for key, entry in files.items():
        _safe_name(key, "manifest key")
        problem = member_name_problem(entry.get("file")) if isinstance(entry, dict) else None
        if problem is not None:
            raise ValueError(f"manifest entry {_quote(key)}: {problem}")
        fields = ("kind", "size", "head_size", "head_xxh3")
        if (
            not isinstance(entry, dict)
            or entry.get("file") != key + RECORD_SUFFIX
            or not isinstance(entry.get("kind"), str)
            or any(not _is_count(entry.get(f)) for f in ("size", "head_size"))
            or not _DIGEST.fullmatch(str(entry.get("head_xxh3")))
        ):
            raise ValueError(f"manifest entry {_quote(key)} is malformed")
        entries[key] = _FileEntry(*(entry[f] for f in fields))
    return _Manifest(data, entries)


def _names_data(data: str, prefix: str | None, iteration: int) -> bool:
    """Whether ``data`` is a data name of ``iteration`` (of checkpointer ``prefix``, or of any):
    ``<prefix>.<N>``, or ``<prefix>.<N>~<hex>`` (a re-save of N on an object store, whose data
    goes beside the old copy under a name never used before)."""
    base, mark, version = data.partition(_VERSION_MARK)
    if mark and not _DATA_VERSION.fullmatch(version):
        return False
    return base == f"{prefix}.{iteration}" if prefix is not None else base.endswith(f".{iteration}")


def _data_name(manifest: _Manifest | None, prefix: str | None, iteration: int) -> str:
    """The data a sentinel stands for: the manifest's, or (Dopamine's ``b'done'``, which names
    none) ``<prefix>.<N>``."""
    return manifest.data if manifest is not None else f"{prefix or DEFAULT_PREFIX}.{iteration}"


def _check_data_name(manifest: _Manifest | None, prefix: str | None, iteration: int) -> None:
    """Raise ``ValueError`` when a manifest names data of another checkpointer prefix."""
    if (
        manifest is not None
        and prefix is not None
        and not _names_data(manifest.data, prefix, iteration)
    ):
        raise ValueError(f"manifest names data {manifest.data!r}, not {f'{prefix}.{iteration}'!r}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# --- reading and checking a checkpoint (no lock, no writes) -------------------------------------


class _Checkpoint:
    """One iteration's sentinel and data as found on disk; read-only."""

    def __init__(self, base: Path, iteration: int, identifier: str, prefix: str | None) -> None:
        self.iteration = iteration
        self.sentinel = base / sentinel_name(identifier, iteration)
        self.base = base
        self.prefix = prefix

    def read_manifest(self) -> _Manifest | None:
        """Parse the sentinel. Raises FileNotFoundError (absent) or ValueError (damaged)."""
        # O_NONBLOCK: a FIFO planted under a sentinel name must not hang the reader;
        # O_NOFOLLOW: nor is a symlink followed (lightning_bpk.layout's rule).
        try:
            fd = os.open(self.sentinel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"the sentinel {_SYMLINK}") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("sentinel is not a regular file")
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_SENTINEL_SIZE + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_SENTINEL_SIZE:
            raise ValueError(f"sentinel is larger than {MAX_SENTINEL_SIZE} bytes")
        manifest = _parse_manifest(raw, self.iteration)
        _check_data_name(manifest, self.prefix, self.iteration)
        return manifest

    def data_path(self, manifest: _Manifest | None) -> Path:
        return self.base / _data_name(manifest, self.prefix, self.iteration)

    def problems(self, *, full: bool, required_keys: Sequence[str] = ()) -> list[str]:
        """Why this checkpoint is not usable ([] if it is).

        Quick (``full=False``): the sentinel parses, the data exists, every listed file has its
        recorded size, nothing else is in the directory and every key of ``required_keys`` is
        there: one small read and a few stats. ``full``: also the head digests and every tensor
        checksum (reads all bytes).
        """
        manifest, unreadable = _read_manifest_or_problem(self)
        if unreadable:
            return unreadable
        data = self.data_path(manifest)
        linked = _symlinks(data)
        if linked:
            return linked
        if not data.exists():
            return [f"{data}: data is missing (sentinel without data)"]
        if manifest is None:
            missing = _missing_keys(data, required_keys)
            if missing:  # nothing lists the files, so a lost one is only noticed here
                return [
                    f"{_record_path(data, k.split('|')[0])}: missing (Dopamine's b'done' sentinel)"
                    for k in missing
                ]
            return self._legacy_problems(data) if full else []
        if not data.is_dir():
            return [f"{data}: data is not a directory"]
        problems = _unlisted_keys(self.sentinel, manifest, required_keys)
        expected = {key + RECORD_SUFFIX: e for key, e in manifest.files.items()}
        present = {entry.name: entry for entry in os.scandir(data)}
        for name in sorted(set(present) - set(expected)):
            problems.append(f"{data / name}: unexpected file, not in the manifest")
        for name, entry in expected.items():
            path = data / name
            if name in present and not present[name].is_file(follow_symlinks=False):
                problems.append(f"{path}: not a regular file")
            else:
                problems.extend(_file_problems(path, entry, head=full, tensors=full))
        return problems

    def _legacy_problems(self, data: Path) -> list[str]:
        """Full check of a Dopamine-sentinel checkpoint: only what the files themselves carry."""
        if not data.is_dir():
            return [_not_a_data_directory(data)]
        warnings.warn(
            f"checkpoint {self.iteration} in {self.base} has Dopamine's b'done' sentinel: no "
            "manifest, so only the tensor checksums inside its files can be verified",
            CheckpointWarning,
            stacklevel=4,
        )
        return [p for key in _keys_on_disk(data) for p in _tensor_problems(_record_path(data, key))]


def _symlinks(data: Path) -> list[str]:
    """A problem for ``data`` itself and for each entry below it that is a symlink (one walk
    that follows none): every reader refuses such a checkpoint, naming the link."""
    if data.is_symlink():
        return [f"{data} {_SYMLINK}"]
    found = []
    for folder, directories, files in os.walk(data):  # a symlinked directory: listed, not entered
        for name in sorted(directories + files):
            if os.path.islink(os.path.join(folder, name)):
                found.append(f"{os.path.join(folder, name)} {_SYMLINK}")
    return found


def _not_a_data_directory(data: Path) -> str:
    return f"{data} is not a lightning_bpk data directory (a Dopamine pickle?); not loadable"


def _keys_on_disk(data: Path) -> list[str]:
    """The data keys of a directory without a manifest (Dopamine sentinel): its ``.bpk`` files."""
    return sorted(p.name[: -len(RECORD_SUFFIX)] for p in data.glob("*" + RECORD_SUFFIX))


def _missing_keys(data: Path, required_keys: Sequence[str]) -> list[str]:
    """The keys of ``required_keys`` a data directory without a manifest has no file for."""
    on_disk = _keys_on_disk(data)
    return [k for k in required_keys if not has_key(on_disk, k)]


def has_key(keys: Collection[str], required: str) -> bool:
    """Whether ``keys`` hold ``required``: one key, or alternatives ``"a|b"`` of which any will
    do (a sharded checkpoint's ``sharded.index`` stands for ``model``: ``"model|sharded.index"``).
    """
    return any(k in keys for k in required.split("|"))


def _read_manifest_or_problem(checkpoint: Any) -> tuple[_Manifest | None, list[str]]:
    """``checkpoint.read_manifest()`` (local or remote), or the one problem that stops every
    other check: no sentinel, or a damaged one."""
    try:
        return checkpoint.read_manifest(), []
    except FileNotFoundError:
        sentinel, n = checkpoint.sentinel, checkpoint.iteration
        return None, [f"{sentinel}: no sentinel (iteration {n} is not complete)"]
    except storage.StorageError:
        raise  # the store failed after its retries: not damage, nothing to skip for
    except (OSError, ValueError) as e:
        return None, [f"{checkpoint.sentinel}: {e}"]


def _read_manifest_to_load(checkpoint: Any) -> _Manifest | None:
    """``checkpoint.read_manifest()`` (local or remote) for a load: ``FileNotFoundError`` when
    there is no sentinel (nothing to load), a :class:`RecordError` naming a damaged one."""
    try:
        return checkpoint.read_manifest()
    except (FileNotFoundError, storage.StorageError):
        raise
    except (OSError, ValueError) as e:
        raise RecordError("io", f"{checkpoint.sentinel}: {e}") from e


def _unlisted_keys(
    sentinel: object, manifest: _Manifest, required_keys: Sequence[str]
) -> list[str]:
    """A problem for each of ``required_keys`` the manifest does not list."""
    return [
        f"{sentinel}: the manifest lists no {k!r} entry"
        for k in required_keys
        if not has_key(manifest.files, k)
    ]


def _record_path(data: Path, key: str) -> Path:
    return data / (key + RECORD_SUFFIX)


def _tensor_problems(path: Path) -> list[str]:
    """Every tensor of the record file against its checksum (reads all its bytes)."""
    try:
        with burnpack.read(path) as pack:
            pack.verify()
    except burnpack.BurnpackError as e:
        return [str(e)]
    return []


def _file_problems(path: Path, entry: _FileEntry, *, head: bool, tensors: bool) -> list[str]:
    """Check one record file against its manifest entry: size always (a stat), then optionally
    the head digest (a few KiB) and every tensor checksum (all bytes)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{path}: listed in the manifest but missing"]
    if size != entry.size:
        return [f"{path}: {size} bytes, manifest records {entry.size}"]
    if head and _head_digest(path, entry.head_size) != entry.head_xxh3:
        return [f"{path}: {_HEAD_DAMAGED}"]
    return _tensor_problems(path) if tensors else []


def _sentinel_numbers(base: Path, identifier: str) -> list[int]:
    return sorted(_numbers(base, sentinel_stem(identifier)), reverse=True)


def _latest(
    base: Path, identifier: str, prefix: str | None, verify: bool, required_keys: Sequence[str]
) -> int:
    for n in _sentinel_numbers(base, identifier):
        problems = _Checkpoint(base, n, identifier, prefix).problems(
            full=verify, required_keys=required_keys
        )
        if not problems:
            return n
        warnings.warn(
            f"checkpoint {n} in {base} skipped: " + summarise(problems),
            CheckpointWarning,
            stacklevel=3,
        )
    return -1


@_gin_configurable
def get_latest_checkpoint_number(
    base_directory: str | os.PathLike[str],
    override_number: int | None = None,
    sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
    checkpoint_file_prefix: str | None = None,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    required_keys: Sequence[str] = (),
) -> int:
    """The newest complete checkpoint's iteration number in ``base_directory``, or -1.

    ``override_number`` is returned as is, without touching the filesystem (Dopamine). A missing
    or empty directory gives -1. A candidate counts when its sentinel parses and its data exists
    with the recorded file sizes; with ``verify=True`` every byte is also checked against the
    manifest and the tensor checksums (what resume should use). A candidate that fails is skipped
    with a :class:`CheckpointWarning` saying why, and the next older one is tried.
    ``checkpoint_file_prefix`` (None: any, as named by each manifest; ``"ckpt"`` for Dopamine
    sentinels) restricts the search to one checkpointer's data. ``base_directory`` may be a URL
    (``s3://bucket/run``, one listing; ``storage_options`` go to fsspec). ``required_keys`` skips
    checkpoints without those data keys (the Lightning callback needs ``model`` and ``trainer``;
    this matters for Dopamine's ``b'done'`` sentinels, which list no files).

    >>> get_latest_checkpoint_number("/does/not/exist"), get_latest_checkpoint_number("/x", 12)
    (-1, 12)
    """
    if override_number is not None:
        return override_number
    identifier = _safe_name(sentinel_file_identifier, "sentinel_file_identifier")
    if checkpoint_file_prefix is not None:
        _safe_name(checkpoint_file_prefix, "checkpoint_file_prefix")
    if not storage.is_local(base_directory):
        store = storage.object_store(base_directory, storage_options)
        return _objects().latest(
            store, identifier, checkpoint_file_prefix, verify, tuple(required_keys)
        )
    return _latest(
        storage.local_path(base_directory),
        identifier,
        checkpoint_file_prefix,
        verify,
        tuple(required_keys),
    )


def verify_checkpoint(
    base_directory: str | os.PathLike[str],
    iteration_number: int,
    sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
    checkpoint_file_prefix: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    full: bool = True,
    required_keys: Sequence[str] = (),
) -> list[str]:
    """Every problem found with checkpoint ``iteration_number`` (empty: it verifies).

    Reads all of its bytes (``full=False``: only the sentinel, and the names and sizes of the
    files, as :func:`get_latest_checkpoint_number` without ``verify``); never writes. Every key of
    ``required_keys`` must be in the checkpoint. A Dopamine ``b'done'`` sentinel with its data
    present gives no problems but a :class:`CheckpointWarning` that it is unverifiable.

    >>> verify_checkpoint("/does/not/exist", 3)
    ['/does/not/exist/sentinel_checkpoint_complete.3: no sentinel (iteration 3 is not complete)']
    """
    identifier = _safe_name(sentinel_file_identifier, "sentinel_file_identifier")
    if checkpoint_file_prefix is not None:
        _safe_name(checkpoint_file_prefix, "checkpoint_file_prefix")
    n = _iteration(iteration_number)
    if not storage.is_local(base_directory):
        store = storage.object_store(base_directory, storage_options)
        remote = _objects().RemoteCheckpoint(store, n, identifier, checkpoint_file_prefix)
        return remote.problems(full=full, required_keys=tuple(required_keys))
    return _Checkpoint(
        storage.local_path(base_directory), n, identifier, checkpoint_file_prefix
    ).problems(full=full, required_keys=tuple(required_keys))


# --- the checkpointer ---------------------------------------------------------------------------


def _setting(value: object, name: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {_quote(value)}")


def check_settings(
    checkpoint_file_prefix: str = "ckpt",
    sentinel_file_identifier: str = "checkpoint",
    checkpoint_frequency: int = 1,
    checkpoint_duration: int = 4,
    keep_every: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first invalid :class:`Checkpointer` setting.

    What the constructor checks, without touching the filesystem, so a Lightning callback can
    refuse bad settings when it is built rather than when ``fit`` starts.

    >>> check_settings(checkpoint_duration=0)
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_duration must be an int >= 1, got 0
    """
    _safe_name(checkpoint_file_prefix, "checkpoint_file_prefix")
    _safe_name(sentinel_file_identifier, "sentinel_file_identifier")
    _setting(checkpoint_frequency, "checkpoint_frequency")
    _setting(checkpoint_duration, "checkpoint_duration")
    _setting(keep_every, "keep_every", optional=True)


@_gin_configurable
class Checkpointer:
    """Saves and loads iteration checkpoints in ``base_directory`` (Dopamine's class).

    ``save_checkpoint(N, data)`` writes only when ``N % checkpoint_frequency == 0`` and then
    garbage-collects everything older than ``N - checkpoint_frequency * checkpoint_duration``,
    sparing multiples of ``keep_every * checkpoint_frequency`` when ``keep_every`` is set.
    See the module docstring for the layout and the crash-safety argument.

    >>> import tempfile
    >>> c = Checkpointer(tempfile.mkdtemp(), checkpoint_frequency=2)
    >>> c.save_checkpoint(3, {"x": 1}) is None, c.save_checkpoint(4, {"x": 1}).name
    (True, 'ckpt.4')
    """

    def __init__(
        self,
        base_directory: str | os.PathLike[str],
        checkpoint_file_prefix: str = DEFAULT_PREFIX,
        sentinel_file_identifier: str = DEFAULT_IDENTIFIER,
        checkpoint_frequency: int = 1,
        checkpoint_duration: int = 4,
        keep_every: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not base_directory:
            raise ValueError("No path provided to Checkpointer.")
        check_settings(
            checkpoint_file_prefix,
            sentinel_file_identifier,
            checkpoint_frequency,
            checkpoint_duration,
            keep_every,
        )
        # a Path for local directories, the URL for object stores (never Path("s3://..."))
        # (typed Any: a Path in every local code path below, a str only where _remote is set)
        self.base_directory: Any = storage.location(base_directory)
        self.checkpoint_file_prefix = checkpoint_file_prefix
        self.sentinel_file_identifier = sentinel_file_identifier
        self.checkpoint_frequency = checkpoint_frequency
        self.checkpoint_duration = checkpoint_duration
        self.keep_every = keep_every
        # Set by take_over(): then every commit and garbage collection first checks that no
        # newer run took over the directory (lightning_bpk.lease).
        self.lease: Lease | None = None
        self._store = storage.open_store(self.base_directory, storage_options)
        if isinstance(self._store, storage.ObjectStore):
            self._store.check()  # unreachable, wrong credentials, no bucket: fail now
            return
        local = storage.local_path(self.base_directory)
        try:
            local.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"Unable to create checkpoint path: {base_directory}. ({e.strerror or e})"
            ) from e
        if not local.is_dir():  # mkdir(exist_ok) accepts an existing symlink loop
            raise ValueError(f"Unable to create checkpoint path: {base_directory}. (not a dir)")

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.base_directory)!r}, {self.checkpoint_file_prefix!r}, "
            f"{self.sentinel_file_identifier!r}, checkpoint_frequency={self.checkpoint_frequency},"
            f" checkpoint_duration={self.checkpoint_duration}, keep_every={self.keep_every})"
        )

    # -- paths ---------------------------------------------------------------------------------

    @property
    def _remote(self) -> storage.ObjectStore | None:
        return self._store if isinstance(self._store, storage.ObjectStore) else None

    def checkpoint_path(self, iteration_number: int) -> Path | str:
        """The data directory (a URL on object stores) of ``iteration_number`` (may not exist;
        on an object store a re-saved N's data is ``<this>~<hex>``, named by its manifest)."""
        name = f"{self.checkpoint_file_prefix}.{_iteration(iteration_number)}"
        return storage.join(self.base_directory, name)

    def sentinel_path(self, iteration_number: int) -> Path | str:
        """The sentinel (manifest) of iteration ``iteration_number`` (it may not exist)."""
        name = sentinel_name(self.sentinel_file_identifier, _iteration(iteration_number))
        return storage.join(self.base_directory, name)

    def _checkpoint(self, iteration_number: int) -> Any:
        args = (
            _iteration(iteration_number),
            self.sentinel_file_identifier,
            self.checkpoint_file_prefix,
        )
        if self._remote is not None:
            return _objects().RemoteCheckpoint(self._remote, *args)
        return _Checkpoint(self.base_directory, *args)

    def take_over(self) -> Lease:
        """Own the directory from now on: a newer lease than any before (a run that held one
        stops at its next write; see :mod:`lightning_bpk.lease`). Waits for a save in flight
        in a local directory, so the take-over falls between two saves."""
        if self._remote is None:
            with self._lock(wait=True):
                self.lease = Lease.acquire(self._store)
        else:
            self.lease = Lease.acquire(self._store)
        return self.lease

    # -- reading -------------------------------------------------------------------------------

    def latest_checkpoint_number(self, verify: bool = False) -> int:
        """:func:`get_latest_checkpoint_number` for this checkpointer's prefix and identifier
        (gin bindings of that function, such as ``override_number``, do not apply here)."""
        if self._remote is not None:
            return _objects().latest(
                self._remote, self.sentinel_file_identifier, self.checkpoint_file_prefix, verify
            )
        return _latest(
            self.base_directory,
            self.sentinel_file_identifier,
            self.checkpoint_file_prefix,
            verify,
            required_keys=(),
        )

    def verify_checkpoint(self, iteration_number: int) -> list[str]:
        """Every problem found with checkpoint ``iteration_number`` (empty: it verifies)."""
        return self._checkpoint(iteration_number).problems(full=True)

    def load_checkpoint(
        self, iteration_number: int, keys: Iterable[str] | None = None
    ) -> dict[str, Any] | None:
        """The data saved for ``iteration_number``, or ``None`` if it has no complete checkpoint.

        Records come back as record objects, plain data (saved as a ``StateRecord``) as its
        value. ``keys`` loads only those entries (``KeyError`` names any that were not saved).
        Each file's size and header bytes are checked against the manifest, and tensors against
        their checksums; a damaged checkpoint raises :class:`RecordError` naming the file.
        Read-only and lock-free.
        """
        checkpoint = self._checkpoint(iteration_number)
        if self._remote is not None:
            return checkpoint.load(keys)
        try:
            manifest = _read_manifest_to_load(checkpoint)
        except FileNotFoundError:
            return None
        data = checkpoint.data_path(manifest)
        linked = _symlinks(data)
        if linked:
            raise RecordError("io", linked)
        if not data.exists():
            return None
        if not data.is_dir():
            raise RecordError("io", _not_a_data_directory(data))
        # A Dopamine sentinel has no manifest: the directory listing is all there is.
        available = _keys_on_disk(data) if manifest is None else list(manifest.files)
        wanted = available if keys is None else list(keys)
        missing = [k for k in wanted if k not in available]
        if missing:
            raise KeyError(
                f"checkpoint {checkpoint.iteration} ({data}) has no entries {missing}; "
                f"it holds {available}"
            )
        loaded = {}
        for key in wanted:
            path = _record_path(data, key)
            if manifest is not None:
                problems = _file_problems(path, manifest.files[key], head=True, tensors=False)
                if problems and problems[0].endswith(_HEAD_DAMAGED):
                    raise RecordChecksumError(problems)
                if problems:
                    raise RecordError("io", problems)
            record = load_record(path)
            loaded[key] = record.value if isinstance(record, StateRecord) else record
        return loaded

    # -- writing -------------------------------------------------------------------------------

    def save_checkpoint(self, iteration_number: int, data: Mapping[str, Any]) -> Path | str | None:
        """Save ``data`` as iteration ``iteration_number``; returns its directory, or ``None``
        when the iteration is skipped by ``checkpoint_frequency``.

        ``data`` maps keys (safe file names) to :class:`Record` objects or to plain nested data
        (saved as a ``StateRecord``). A failed save raises and leaves every earlier checkpoint,
        including an earlier save of the same N, as it was. Raises
        :class:`CheckpointLockedError` while another process is saving into this directory.
        """
        n = _iteration(iteration_number)
        if n % self.checkpoint_frequency != 0:
            return None
        if not isinstance(data, Mapping):
            raise TypeError(
                f"checkpoint data must be a mapping of keys to records or plain data, "
                f"not {type(data).__name__}"
            )
        for key in data:
            _safe_name(key, f"checkpoint {n} data key")
        if self._remote is not None:
            return _objects().save(self, self._remote, n, data)
        try:
            with self._lock():
                if self.lease is not None:
                    self.lease.check()
                self._remove_leftovers()
                target = self._publish(n, data)
                self._collect_garbage(n)
        except CheckpointLockedError:
            if self.lease is not None:  # a newer run taking over holds the lock: say so instead
                self._wait_for_lock(_TAKE_OVER_WAIT)
                self.lease.check()
            raise
        return target

    @contextlib.contextmanager
    def _lock(self, wait: bool = False) -> Any:
        path = self.base_directory / LOCK_FILE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise CheckpointLockedError(
                    f"{self.base_directory} is locked by another process saving a checkpoint "
                    f"(pid {holder}, lock {path}); two checkpointers cannot save into one "
                    "directory at once"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _wait_for_lock(self, seconds: float) -> None:
        """Return once the directory lock is free (taken and released), or after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                with self._lock():
                    return
            except CheckpointLockedError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)

    def _remove_leftovers(self) -> None:
        """Delete what a crashed save of this checkpointer left: staging or displaced data
        directories and sentinel scratch files (``<name>.<pid>-<k>.tmp``)."""
        for stem in (self.checkpoint_file_prefix, sentinel_stem(self.sentinel_file_identifier)):
            pattern = re.escape(stem) + r"\." + NUMBER_PATTERN + _SCRATCH
            for _, path in list(_matching(self.base_directory, pattern)):
                _remove(path)

    def _publish(self, n: int, data: Mapping[str, Any]) -> Path:
        """Stage, swap into place, write the sentinel (steps 2-5 of the module docstring)."""
        target = Path(self.checkpoint_path(n))  # local: Paths
        sentinel = Path(self.sentinel_path(n))
        staging, files = self._stage(n, data)
        old_sentinel: Path | None = None
        old_data: Path | None = None
        swapped = False
        try:
            if os.path.lexists(target):
                # N becomes incomplete before its old data is touched: a crash from here on
                # falls back to an older checkpoint, never to a half-replaced N.
                if os.path.lexists(sentinel):
                    moved = _fs.scratch_path(sentinel)
                    os.rename(sentinel, moved)
                    old_sentinel = moved
                    _fs.fsync_dir(self.base_directory)
                moved = _fs.scratch_path(target)
                os.rename(target, moved)
                old_data = moved
            os.rename(staging, target)
            swapped = True
            _fs.fsync_dir(self.base_directory)
            with _fs.atomic_file(sentinel) as f:
                _fs.write_all(f, _encode_manifest(n, _Manifest(target.name, files)))
        except BaseException:
            self._roll_back(staging, target, sentinel, swapped, old_data, old_sentinel)
            raise
        for leftover in (old_data, old_sentinel):
            if leftover is not None:
                _remove(leftover)
        return target

    def _roll_back(
        self,
        staging: Path,
        target: Path,
        sentinel: Path,
        swapped: bool,
        old_data: Path | None,
        old_sentinel: Path | None,
    ) -> None:
        """Undo a failed :meth:`_publish` with renames only (no free space needed)."""
        with contextlib.suppress(OSError):
            if swapped:
                # Any sentinel N now is the new one: the old one was moved aside or never existed.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sentinel)
                os.rename(target, staging)
            _remove(staging)
            if old_data is not None:
                os.rename(old_data, target)
            if old_sentinel is not None:
                os.rename(old_sentinel, sentinel)
            _fs.fsync_dir(self.base_directory)

    def _stage(
        self, n: int, data: Mapping[str, Any], under: Path | None = None
    ) -> tuple[Path, dict[str, _FileEntry]]:
        """Write every entry into a fresh staging directory; return it and the manifest entries.

        Each file is fsynced and renamed into the staging directory, which is fsynced after each
        rename (:func:`_fs.atomic_file`), so the staged data is durable before it is published.
        The staging directory is made in ``under`` (default: the base directory; a local
        scratch folder for an object store's upload).
        """
        name = f"{self.checkpoint_file_prefix}.{n}"
        while True:
            staging = _fs.scratch_path((under or Path(self.base_directory)) / name)
            try:
                staging.mkdir()
                break
            except FileExistsError:
                continue
        files = {}
        try:
            for key, value in data.items():
                record = value if isinstance(value, Record) else StateRecord(value)
                try:
                    path = record.save(_record_path(staging, key))
                except RecordError as e:
                    raise RecordError(
                        e.kind, [f"checkpoint {n} key {key!r}: {p}" for p in e.problems]
                    ) from e
                files[key] = _describe(path, record.kind)
        except BaseException:
            with contextlib.suppress(OSError):
                _remove(staging)
            raise
        return staging, files

    def _doomed(self, n: int, sentinels: set[int], data: set[int]) -> tuple[set[int], set[int]]:
        """Retention after saving ``n``, given the numbers with a sentinel and with data: the
        sentinels to delete (first) and the data to delete (then); the docstring below."""
        f, d, k = self.checkpoint_frequency, self.checkpoint_duration, self.keep_every
        complete = sorted((m for m in sentinels if m in data and m <= n), reverse=True)
        kept = set(complete[:d]) | {n}
        doomed = {
            m
            for m in sentinels | data
            if m <= n and m not in kept and not (k is not None and m % (k * f) == 0)
        }
        orphans = {m for m in sentinels if m not in data and m != n}
        return (doomed | orphans) & sentinels, doomed & data

    def remove_checkpoints(self, numbers: Iterable[int]) -> None:
        """Delete the checkpoints ``numbers``, under the directory lock: their sentinels first
        (one fsync), then their data, so a crash midway never leaves a sentinel without data.

        For a run that starts over on purpose (``BurnpackCheckpoint(overwrite=True)``).
        """
        wanted = sorted({_iteration(n) for n in numbers})
        if self._remote is not None:
            _objects().remove(self, self._remote, wanted)
            return
        with self._lock():
            stem = sentinel_stem(self.sentinel_file_identifier)
            sentinels = _numbers(self.base_directory, stem)
            data = _numbers(self.base_directory, self.checkpoint_file_prefix)
            for n in wanted:
                if n in sentinels:
                    _remove(sentinels[n])
            _fs.fsync_dir(self.base_directory)
            for n in wanted:
                if n in data:
                    _remove(data[n])

    def _collect_garbage(self, n: int) -> None:
        """Keep the ``d`` newest complete checkpoints ``<= n`` and the ``keep_every`` milestones;
        remove the rest ``<= n`` and sentinels whose data is gone; all sentinels first (one
        fsync), then the data.

        Dopamine removes only ``n - f*d``; this gives the same result for an uninterrupted run
        and also catches what crashes, gaps or changed settings left behind.
        """
        sentinels = _numbers(self.base_directory, sentinel_stem(self.sentinel_file_identifier))
        data = _numbers(self.base_directory, self.checkpoint_file_prefix)
        doomed_sentinels, doomed_data = self._doomed(n, set(sentinels), set(data))
        try:
            for m in sorted(doomed_sentinels):
                _remove(sentinels[m])
            _fs.fsync_dir(self.base_directory)
            for m in sorted(doomed_data):
                _remove(data[m])
        except OSError as e:
            warnings.warn(
                f"checkpoint {n} in {self.base_directory} is complete, but removing old "
                f"checkpoints failed: {e}",
                CheckpointWarning,
                stacklevel=3,
            )
