"""One checkpoint as found in a :class:`~lightning_bpk.store.Store`, read-only; and the choices
made from a directory listing (newest complete, resume). The same code on every backend.

A :class:`CheckpointView` is iteration N's sentinel and data: :meth:`~CheckpointView.problems`
says why it is not usable (quick: the sentinel parses, the data exists with the recorded
sizes, nothing else is there; full: also every head digest and tensor checksum), and
:meth:`~CheckpointView.load` reads it back, checking each file's size and head against the
manifest before its tensors are read. A view reads its sentinel once, however many checks and
loads it serves, and takes the directory listing its caller already made: one resume on any
backend lists the directory once and reads each sentinel once.

A read that finds damage is made once more before the checkpoint is called damaged (bytes
garbled on the way are not the object's); a :class:`~lightning_bpk.errors.StorageError` (the
store still failing after its retries) propagates: it says nothing about the checkpoint, so
resume must not skip to an older one for it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from lightning_bpk import _device, burnpack
from lightning_bpk.checkpointer.manifest import (
    MAX_SENTINEL_SIZE,
    FileEntry,
    Manifest,
    Metric,
    parse,
)
from lightning_bpk.errors import StorageError, summarise
from lightning_bpk.layout import (
    DEFAULT_IDENTIFIER,
    DEFAULT_PREFIX,
    RECORD_SUFFIX,
    _data_names,
    _numbered,
    _sentinel_stem,
    data_name,
    parse_data_name,
    parse_sentinel_name,
    sentinel_name,
)
from lightning_bpk.records.base import RecordError, StateRecord, _record_from_pack
from lightning_bpk.records.files import open_pack
from lightning_bpk.store import Store, location, open_parent, open_store
from lightning_bpk.store.local import RefusedFileError

T = TypeVar("T")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged, incomplete, unverifiable) or could not be removed."""


def has_key(keys: Collection[str], required: str) -> bool:
    """Whether ``keys`` hold ``required``: one key, or alternatives ``"a|b"`` of which any will
    do (a sharded checkpoint's ``sharded.index`` stands for ``model``: ``"model|sharded.index"``).
    """
    return any(k in keys for k in required.split("|"))


def sentinels(listing: Mapping[str, int | None], identifier: str) -> dict[int, str]:
    """``{N: name}`` of the sentinel names in a listing."""
    return {n: name for name, n in _numbered(listing, _sentinel_stem(identifier))}


def complete_numbers(
    listing: Mapping[str, int | None], identifier: str, prefix: str, at_most: int | None = None
) -> list[int]:
    """The numbers with both a sentinel and data in a listing (up to ``at_most``), ascending:
    the complete checkpoints, before any manifest is read.

    >>> listing = {"ckpt.3": None, "sentinel_x_complete.3": 234, "ckpt.4": None,
    ...            "sentinel_x_complete.5": 234}
    >>> complete_numbers(listing, "x", "ckpt"), complete_numbers(listing, "x", "ckpt", 2)
    ([3], [])
    """
    data = _data_names(listing, prefix)
    found = sentinels(listing, identifier)
    return sorted(m for m in found if m in data and (at_most is None or m <= at_most))


def _read_twice(
    read: Callable[[], T],
    damage: type[Exception] | tuple[type[Exception], ...] = (burnpack.BurnpackError, RecordError),
) -> T:
    """``read()``, and once more if it found ``damage``: bytes garbled or cut short on the way
    (which a store's retries cannot see when the answer looked whole) are not damage, so a
    checkpoint is called damaged only when a second read agrees."""
    try:
        return read()
    except StorageError:
        raise
    except damage:
        return read()


def _keys_of(present: Iterable[str]) -> list[str]:
    """The data keys of a data directory without a manifest (Dopamine's sentinel): its files."""
    return sorted(n[: -len(RECORD_SUFFIX)] for n in present if n.endswith(RECORD_SUFFIX))


class CheckpointView:
    """Iteration ``iteration``'s sentinel and data in ``store``; read-only (module docstring).

    ``prefix`` restricts the data to one checkpointer's (None: whatever the manifest names);
    ``listing`` is the store's top-level listing when the caller has one.
    """

    def __init__(
        self,
        store: Store,
        iteration: int,
        identifier: str,
        prefix: str | None,
        listing: Mapping[str, int | None] | None = None,
    ) -> None:
        self.store = store
        self.iteration = iteration
        self.prefix = prefix
        self.sentinel_key = sentinel_name(identifier, iteration)
        self.sentinel = store.url_of(self.sentinel_key)
        self._listing = listing
        self._manifest: tuple[Manifest | None] | None = None  # once read and parsed
        self._data: dict[str, tuple[Mapping[str, int | None], list[str]]] = {}

    def data(self, name: str) -> tuple[Mapping[str, int | None], list[str]]:
        """The listing of data directory ``name`` and why it is refused ([]: it is not): one
        listing, made once however many checks and loads use it."""
        if name not in self._data:
            present = self.store.list(name)
            self._data[name] = (present, self.store.refused(name, present))
        return self._data[name]

    def listing(self) -> Mapping[str, int | None]:
        if self._listing is None:
            self._listing = self.store.list("")
        return self._listing

    # -- the sentinel --

    def read_manifest(self) -> Manifest | None:
        """The parsed sentinel (None: Dopamine's ``b'done'``). Raises ``FileNotFoundError``
        (absent) or ``ValueError`` (damaged); read once, then kept."""
        if self._manifest is None:
            listing = self.listing()
            if self.sentinel_key not in listing:
                raise FileNotFoundError(self.sentinel)
            size = listing[self.sentinel_key]
            if size is None:
                raise ValueError("sentinel is not a regular file")
            if size > MAX_SENTINEL_SIZE:
                raise ValueError(f"sentinel is larger than {MAX_SENTINEL_SIZE} bytes")
            self._manifest = (_read_twice(self._parse, ValueError),)
        return self._manifest[0]

    def _parse(self) -> Manifest | None:
        try:
            raw = self.store.read(self.sentinel_key)
        except RefusedFileError as e:
            raise ValueError(f"the sentinel {e.reason}") from None
        return parse(raw, self.iteration, self.prefix)

    def _manifest_or_problem(self) -> tuple[Manifest | None, list[str]]:
        """The manifest, or the one problem that stops every other check."""
        try:
            return self.read_manifest(), []
        except FileNotFoundError:
            return None, [
                f"{self.sentinel}: no sentinel (iteration {self.iteration} is not complete)"
            ]
        except StorageError:
            raise  # the store failed after its retries: not damage, nothing to skip for
        except (OSError, ValueError) as e:
            return None, [f"{self.sentinel}: {e}"]

    def data_keys(self) -> list[str]:
        """The data keys the sentinel lists ([] when it is unreadable; Dopamine's ``b'done'``,
        which lists none: the files of its data)."""
        try:
            manifest = self.read_manifest()
        except (OSError, ValueError):
            return []
        if manifest is not None:
            return list(manifest.files)
        return _keys_of(self.data(self.data_name(None))[0])

    def data_name(self, manifest: Manifest | None) -> str:
        """The data the sentinel stands for: the manifest's, or (``b'done'``, which names none)
        ``<prefix>.<N>``."""
        if manifest is not None:
            return manifest.data
        return data_name(self.prefix or DEFAULT_PREFIX, self.iteration)

    # -- checking --

    def problems(self, *, full: bool, required_keys: Sequence[str] = ()) -> list[str]:
        """Why this checkpoint is not usable ([] if it is); ``full`` reads every byte."""
        manifest, unreadable = self._manifest_or_problem()
        if unreadable:
            return unreadable
        name = self.data_name(manifest)
        url = self.store.url_of(name)
        listing = self.listing()
        if name not in listing:
            return [f"{url}: data is missing (sentinel without data)"]
        present, refused = self.data(name)
        if refused:
            return refused
        if manifest is None:  # Dopamine's sentinel: its data may even be a pickle file
            return self._legacy_problems(name, listing[name] is None, full, required_keys)
        if listing[name] is not None:
            return [f"{url}: data is not a directory"]
        problems = [
            f"{self.sentinel}: the manifest lists no {k!r} entry"
            for k in required_keys
            if not has_key(manifest.files, k)
        ]
        expected = {key + RECORD_SUFFIX: entry for key, entry in manifest.files.items()}
        for file in sorted(set(present) - set(expected)):
            problems.append(f"{url}/{file}: unexpected file, not in the manifest")
        for file, entry in expected.items():
            problems.extend(self._file_problems(f"{name}/{file}", present, entry, full))
        return problems

    def _file_problems(
        self, key: str, present: Mapping[str, int | None], entry: FileEntry | None, full: bool
    ) -> list[str]:
        url = self.store.url_of(key)
        file = key.rpartition("/")[2]
        if file not in present:
            return [f"{url}: listed in the manifest but missing"]
        size = present[file]
        if size is None:
            return [f"{url}: not a regular file"]
        if entry is not None and size != entry.size:
            return [f"{url}: {size} bytes, manifest records {entry.size}"]
        if not full:
            return []
        try:
            _read_twice(lambda: _verify(open_pack(self.store, key, size=size, head=entry)))
        except (burnpack.BurnpackError, RecordError) as e:
            return list(e.problems) if isinstance(e, RecordError) else [str(e)]
        except StorageError:
            raise
        except OSError as e:
            return [f"{url}: {e}"]
        return []

    def _legacy_problems(
        self, name: str, directory: bool, full: bool, required_keys: Sequence[str]
    ) -> list[str]:
        """A Dopamine-sentinel checkpoint: only what its files themselves carry."""
        url = self.store.url_of(name)
        present = self.data(name)[0] if directory else {}
        keys = _keys_of(present)
        missing = [k for k in required_keys if not has_key(keys, k)]
        if missing:  # nothing lists the files, so a lost one is only noticed here
            return [
                f"{url}/{k.split('|')[0]}{RECORD_SUFFIX}: missing (Dopamine's b'done' sentinel)"
                for k in missing
            ]
        if not full:
            return []
        if not directory:
            return [_not_a_data_directory(url)]
        warnings.warn(
            f"checkpoint {self.iteration} in {self.store.url} has Dopamine's b'done' sentinel: "
            "no manifest, so only the tensor checksums inside its files can be verified",
            CheckpointWarning,
            stacklevel=4,
        )
        return [
            p
            for k in keys
            for p in self._file_problems(f"{name}/{k}{RECORD_SUFFIX}", present, None, True)
        ]

    # -- loading --

    def load(
        self, keys: Iterable[str] | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, Any] | None:
        """The data saved (records, plain data as its value), its tensors on ``device``, or
        None when the checkpoint is not complete; ``KeyError`` names wanted keys it does not
        hold, a :class:`RecordError` the first damaged file."""
        target = _device.target_device(device)  # a bad device fails before anything is read
        try:
            manifest = self.read_manifest()
        except FileNotFoundError:
            return None
        except StorageError:
            raise
        except (OSError, ValueError) as e:
            raise RecordError("io", f"{self.sentinel}: {e}") from e
        name = self.data_name(manifest)
        url = self.store.url_of(name)
        listing = self.listing()
        if name not in listing:
            return None
        present, refused = self.data(name)
        if refused:
            raise RecordError("io", refused)
        if listing[name] is not None:
            raise RecordError("io", _not_a_data_directory(url))
        held = self.data_keys()
        wanted = held if keys is None else list(keys)
        missing = [k for k in wanted if k not in held]
        if missing:
            raise KeyError(
                f"checkpoint {self.iteration} ({url}) has no entries {missing}; it holds {held}"
            )
        entries = {} if manifest is None else manifest.files
        return {
            k: self._load_one(f"{name}/{k}{RECORD_SUFFIX}", present, entries.get(k), target)
            for k in wanted
        }

    def _load_one(
        self,
        key: str,
        present: Mapping[str, int | None],
        entry: FileEntry | None,
        target: torch.device,
    ) -> Any:
        problems = self._file_problems(key, present, entry, full=False)
        if problems:
            raise RecordError("io", problems)
        size = present[key.rpartition("/")[2]]
        try:
            record = _read_twice(lambda: _record(open_pack(self.store, key, size=size, head=entry)))
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e
        except StorageError:
            raise  # the store failed (after retries): nothing is known about the data
        except OSError as e:
            raise RecordError("io", f"{self.store.url_of(key)}: {e}") from e
        if isinstance(record, StateRecord):
            return _device.to_device(record.value, target)
        return record.to(target)


def _verify(pack: burnpack.Pack) -> None:
    with pack:
        pack.verify()


def _record(pack: burnpack.Pack) -> Any:
    with pack:
        return _record_from_pack(pack)


def _not_a_data_directory(url: str) -> str:
    return f"{url} is not a lightning_bpk data directory (a Dopamine pickle?); not loadable"


def open_data_directory(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> CheckpointView | None:
    """The checkpoint whose data directory is ``path`` (``{base}/{prefix}.{N}``, or a re-save's
    ``{prefix}.{N}~<hex>``, for which ``{prefix}.{N}`` also stands); None when ``path`` is not
    a data directory. ``RecordError`` when it is one whose sentinel is missing or ambiguous (so
    it is not known to be complete)."""
    parent, name = open_parent(path, storage_options)
    refused = parent.refused(name, ())
    if refused:  # a data directory that is a symlink: refused, never followed
        raise RecordError("io", refused)
    listing = parent.list("")
    base = name.partition("~")[0]
    if not any(
        size is None and (key == name or key.partition("~")[0] == base)
        for key, size in listing.items()
    ):
        return None
    number = parse_data_name(name, None)
    if number is None:
        raise RecordError(
            "io", f"{location(path)}: not a checkpoint directory (expected '<prefix>.<number>')"
        )
    identifiers = [
        parsed[0]
        for parsed in map(parse_sentinel_name, listing)
        if parsed is not None and parsed[1] == number
    ]
    if len(identifiers) != 1:
        what = "no sentinel" if not identifiers else f"several sentinels {identifiers}"
        raise RecordError(
            "io",
            f"{location(path)}: {what} for checkpoint {number}, so it is not known to be complete",
        )
    return CheckpointView(parent, number, identifiers[0], base.rpartition(".")[0], listing)


# --- what a directory holds ---------------------------------------------------------------------


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
    >>> from lightning_bpk.checkpointer import Checkpointer
    >>> _ = Checkpointer(base).save_checkpoint(0, {"n": 0})
    >>> [(e.number, e.complete) for e in list_checkpoints(base)]
    [(0, True)]
    """
    store = open_store(base_directory, storage_options)
    return _entries(store, store.list(""), sentinel_file_identifier, checkpoint_file_prefix)


def _entries(
    store: Store, listing: Mapping[str, int | None], identifier: str, prefix: str
) -> list[CheckpointEntry]:
    found = sentinels(listing, identifier)
    data = _data_names(listing, prefix)
    return [
        CheckpointEntry(
            n,
            location(store.url_of(data[n][0])) if n in data else None,
            location(store.url_of(found[n])) if n in found else None,
        )
        for n in sorted(set(found) | set(data), reverse=True)
    ]


@dataclass(frozen=True)
class CheckpointReport:
    """One checkpoint as ``lightning-bpk ls`` shows it: what the directory holds for its
    number (``entry.data``: the data its sentinel names), its problems (None: not verified)
    and the bytes of its data."""

    entry: CheckpointEntry
    problems: list[str] | None
    size: int
    metric: Metric | None = None  # the monitored metric its manifest records (None: none)


def report_checkpoints(
    store: Store,
    listing: Mapping[str, int | None],
    identifier: str,
    prefix: str,
    *,
    verify: bool,
    required_keys: Sequence[str] = (),
) -> list[CheckpointReport]:
    """The checkpoints of ``store`` (``listing``: its listing) as :func:`list_checkpoints`
    finds them, each complete one verified (``verify``: every byte, as
    :func:`verify_checkpoint`) and sized: one listing of each checkpoint's data, each sentinel
    read once."""
    reports = []
    for entry in _entries(store, listing, identifier, prefix):
        view = CheckpointView(store, entry.number, identifier, prefix, listing)
        name = None if entry.data is None else str(entry.data).rpartition("/")[2]
        metric = None
        if entry.complete:
            with contextlib.suppress(OSError, ValueError):
                manifest = view.read_manifest()
                name = view.data_name(manifest)
                metric = None if manifest is None else manifest.metric
        problems = (
            view.problems(full=True, required_keys=required_keys)
            if verify and entry.complete
            else None
        )
        size = 0
        if name is not None and name in listing:
            size = listing[name] or sum(s or 0 for s in view.data(name)[0].values())
            entry = CheckpointEntry(entry.number, location(store.url_of(name)), entry.sentinel)
        reports.append(CheckpointReport(entry, problems, size, metric))
    return reports


# --- choices made from one listing ---------------------------------------------------------------


def latest(
    store: Store,
    identifier: str,
    prefix: str | None,
    verify: bool,
    required_keys: Sequence[str] = (),
) -> int:
    """The newest sentinel whose checkpoint passes the checks (``verify``: every byte), or -1;
    each skipped one warns with the reason. One listing; each sentinel read once."""
    listing = store.list("")
    for n in sorted(sentinels(listing, identifier), reverse=True):
        problems = CheckpointView(store, n, identifier, prefix, listing).problems(
            full=verify, required_keys=required_keys
        )
        if not problems:
            return n
        warnings.warn(
            f"checkpoint {n} in {store.url} skipped: " + summarise(problems),
            CheckpointWarning,
            stacklevel=3,
        )
    return -1


class Resume(NamedTuple):
    """The resume choice: checkpoint ``number`` (-1: none), the data it holds as it was read
    while choosing (None for a sharded checkpoint, whose ranks read their own parts, and when
    there is none), and where its data lies (None when there is none)."""

    number: int
    data: dict[str, Any] | None
    location: Path | str | None


def choose_resume(
    store: Store,
    identifier: str,
    prefix: str | None,
    required_keys: Sequence[str],
    at_most: int,
    unloaded: Sequence[str] = (),
) -> Resume:
    """The resume choice, on every backend: the newest checkpoint ``<= at_most`` that passes the
    quick checks and loads, every byte verified as it is read (head digests, tensor checksums),
    with the data it holds. A damaged one is skipped with a :class:`CheckpointWarning`, falling
    back to the one before. One listing of the directory and one of the chosen data; each
    sentinel read once; each file read once.

    A checkpoint holding one of the ``unloaded`` keys (a sharded checkpoint's index: every rank
    then reads its own part) is verified in full instead and comes with ``None``.
    """
    listing = store.list("")
    for n in sorted((m for m in sentinels(listing, identifier) if m <= at_most), reverse=True):
        view = CheckpointView(store, n, identifier, prefix, listing)
        problems = view.problems(full=False, required_keys=required_keys)
        if not problems:
            try:
                manifest = view.read_manifest()
                where = location(store.url_of(view.data_name(manifest)))
                if manifest is not None and any(k in manifest.files for k in unloaded):
                    problems = view.problems(full=True, required_keys=required_keys)
                    if not problems:
                        return Resume(n, None, where)
                else:
                    data = view.load(None)
                    if data is not None:
                        return Resume(n, data, where)
                    problems = [f"{view.sentinel}: its data is gone"]
            except StorageError:
                raise  # not damage: the store failed after its retries
            except (RecordError, OSError, KeyError, ValueError) as e:
                problems = [str(e)]
        warnings.warn(
            f"checkpoint {n} in {store.url} skipped: " + summarise(problems),
            CheckpointWarning,
            stacklevel=3,
        )
    return Resume(-1, None, None)
