"""The one commit of a checkpoint, its retention and its removals, over any
:class:`~lightning_bpk.store.Store`.

Saving iteration N, inside the store's exclusive section (``flock`` locally)::

    1. check the lease             a superseded run stops here, having written nothing
    2. clear leftovers             scratch names a crashed save of this checkpointer left, and
                                   data of N without a sentinel of N (failed saves)
    3. choose a name never used    ckpt.N, or ckpt.N~<hex> when data of N exists (a re-save)
    4. stage                       each record through Store.scratch into Store.staging(name)
                                   (a scratch directory locally, the final prefix remotely);
                                   rank files a sharded save put there already are described
    5. publish                     Store.publish: rename + fsync locally, nothing remotely
    6. confirm                     one listing: every file there with its size
    7. check the lease again
    8. sentinel last               the manifest (naming this run's lease), create-only for a
                                   new N (a conditional PUT: another writer's commit of N is
                                   never overwritten); one atomic replace for a re-save (the
                                   old copy or the new)
    9. drop the superseded copy    the data the old sentinel of N named
   10. collect garbage             late writes of a superseded run (a sentinel that appeared
                                   after the take-over naming an older lease: its PUT was held
                                   in the network), then the retention below, sentinels before
                                   their data

The sentinel always names a complete copy: a crash at any moment (even SIGKILL or power loss)
leaves the newest complete N complete, on every backend; what the crash left is unreferenced
data that step 2 or the garbage collection of a later save removes. A failure in steps 4-8
raises and removes what this save wrote (never after losing the lease); every other
checkpoint, including an earlier save of the same N, stays as it was.

The retention is Dopamine's, kept literally (:mod:`lightning_bpk.checkpointer` says how and why),
and with a best-k rule (:mod:`lightning_bpk.checkpointer._best`) also keeps the k best by the
metric each manifest records; checkpoints newer than N are never touched, and a failure warns:
the save stands.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_bpk import _fs
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.checkpointer._view import (
    CheckpointView,
    CheckpointWarning,
    complete_numbers,
    sentinels,
)
from lightning_bpk.checkpointer.manifest import FileEntry, Manifest, Metric, encode
from lightning_bpk.errors import StorageError
from lightning_bpk.layout import (
    NUMBER_PATTERN,
    RECORD_SUFFIX,
    VERSION_MARK,
    _data_names,
    _fresh_data_name,
    _sentinel_stem,
    data_name,
    sentinel_name,
)
from lightning_bpk.records.base import Record, RecordError, StateRecord
from lightning_bpk.records.files import describe, save_record
from lightning_bpk.store import Store
from lightning_bpk.store.lease import Lease


@dataclass(frozen=True)
class Retention:
    """Dopamine's retention settings: ``frequency`` f, ``duration`` d, ``keep_every`` k; and
    ``best``, the best-k rule kept beside them (:mod:`lightning_bpk.checkpointer._best`), with
    ``score``, the monitored value of the checkpoint a save commits (recorded in its manifest;
    None: not logged). :meth:`scored` gives the retention of one save."""

    frequency: int
    duration: int
    keep_every: int | None = None
    best: BestK | None = None
    score: float | None = None

    def scored(self, value: float | None) -> Retention:
        """This retention for a save whose monitored metric is ``value``."""
        return replace(self, score=None if value is None else float(value))

    def doomed(
        self,
        n: int,
        sentinels: set[int],
        data: set[int],
        metrics: Mapping[int, Metric | None] | None = None,
    ) -> tuple[set[int], set[int]]:
        """After saving ``n``, given the numbers with a sentinel and with data (and the metric
        each complete one's manifest records, for ``best``): the sentinels to delete (first)
        and the data to delete (then); see the module docstring."""
        f, d, k = self.frequency, self.duration, self.keep_every
        complete = sorted((m for m in sentinels if m in data and m <= n), reverse=True)
        kept = set(complete[:d]) | {n}
        if self.best is not None:
            values = {m: self.best.value_of((metrics or {}).get(m)) for m in complete}
            kept |= self.best.kept(values)
        doomed = {
            m
            for m in sentinels | data
            if m <= n and m not in kept and not (k is not None and m % (k * f) == 0)
        }
        orphans = {m for m in sentinels if m not in data and m != n}
        return (doomed | orphans) & sentinels, doomed & data


@dataclass(frozen=True)
class Names:
    """Whose checkpoints: a store, a checkpointer's prefix and sentinel identifier."""

    store: Store
    prefix: str
    identifier: str


@dataclass(frozen=True)
class Staged:
    """Where the files of checkpoint ``number`` are written before its commit: ``key`` (a
    staging prefix of the store; ``url`` is its path or URL, for writers that take one), to be
    published as the data ``name`` never used before."""

    number: int
    name: str
    key: str
    url: str


def _check(lease: Lease | None, listing: Mapping[str, int | None] | None = None) -> None:
    """Steps 1 and 7: the lease is still this run's (``listing``: the directory's, just made)."""
    if lease is not None:
        lease.check(listing)


def _stage_at(names: Names, listing: Mapping[str, int | None], n: int) -> Staged:
    """Step 3 (and the second half of step 2): where N is staged, under a data name never used
    before. Data of N without a sentinel of N is deleted now; with one (a re-save) it stays
    until the new sentinel replaces the old."""
    earlier = _data_names(listing, names.prefix).get(n, [])
    if sentinel_name(names.identifier, n) not in listing:
        for old in earlier:
            names.store.remove_prefix(old)
    # a fresh name when N had data: the old copy stays whole until the new sentinel, and no
    # upload still landing from a failed save mixes into the new one
    name = _fresh_data_name(names.prefix, n) if earlier else data_name(names.prefix, n)
    key = names.store.staging(name)
    return Staged(n, name, key, names.store.url_of(key))


def begin(names: Names, n: int, lease: Lease | None) -> Staged:
    """Steps 1-3 ahead of a save whose files other processes write (a sharded save's ranks):
    where to write them. :func:`commit` with ``staged`` then commits them."""
    listing = names.store.list("")
    _check(lease, listing)
    return _stage_at(names, listing, n)


def _leftovers(names: Names, listing: Iterable[str], keep: str | None) -> list[str]:
    """Step 2: the scratch names a crashed save of this checkpointer left (staging
    directories, sentinel scratch files), never ``keep``."""
    data = re.escape(names.prefix) + r"\." + NUMBER_PATTERN
    data += f"(?:{re.escape(VERSION_MARK)}[0-9a-f]+)?(?:\\.dcp)?(?:{_fs.SCRATCH_MARK})+"
    # a create-only sentinel is staged as a scratch file written through its own scratch file
    sentinel = re.escape(_sentinel_stem(names.identifier)) + r"\." + NUMBER_PATTERN
    sentinel += f"(?:{_fs.SCRATCH_MARK})+"
    pattern = re.compile(f"{data}|{sentinel}")
    return [name for name in listing if pattern.fullmatch(name) and name != keep]


def _stage(
    names: Names,
    staged: Staged,
    data: Mapping[str, Any],
    described: Mapping[str, FileEntry],
    prestaged: bool,
) -> dict[str, FileEntry]:
    """Step 4: write every entry of ``data`` into the staging prefix; the manifest entries of
    those and (``prestaged``: made by :func:`begin`) of the files other processes put there."""
    store = names.store
    files = dict(described)
    for file, size in sorted(store.list(staged.key).items() if prestaged else ()):
        key = file[: -len(RECORD_SUFFIX)]
        if file.endswith(RECORD_SUFFIX) and key not in files and key not in data:
            files[key] = FileEntry(*describe(store, f"{staged.key}/{file}", size))
    for key, value in data.items():
        record = value if isinstance(value, Record) else StateRecord(value)
        try:
            entry = save_record(record, store, f"{staged.key}/{key}{RECORD_SUFFIX}")
        except RecordError as e:
            raise RecordError(
                e.kind, [f"checkpoint {staged.number} key {key!r}: {p}" for p in e.problems]
            ) from e
        files[key] = FileEntry(*entry)
    return files


def _confirm(names: Names, staged: Staged, files: Mapping[str, FileEntry]) -> None:
    """Step 6: one listing of the published data holds every file with its size."""
    present = names.store.list(staged.name)
    for key, entry in files.items():
        found = present.get(key + RECORD_SUFFIX)
        if found != entry.size:
            raise StorageError(
                f"{names.store.url_of(staged.name)}/{key}{RECORD_SUFFIX}: written, but the store "
                f"lists {'nothing' if found is None else f'{found} bytes'} instead of "
                f"{entry.size} bytes; checkpoint {staged.number} not committed"
            )


def commit(
    names: Names,
    n: int,
    data: Mapping[str, Any],
    *,
    lease: Lease | None,
    retention: Retention,
    staged: Staged | None = None,
    described: Mapping[str, FileEntry] | None = None,
) -> str:
    """Save ``data`` as iteration ``n`` (steps 1-10 of the module docstring); its data's path
    or URL. ``staged``: from :func:`begin`, whose prefix may already hold files (``described``
    gives the manifest entries of those its writer knows; the rest are described from their
    heads). Raises :class:`~lightning_bpk.errors.CheckpointLockedError` when another process
    is saving into a local directory."""
    store = names.store
    with store.exclusive():
        listing = store.list("")
        _check(lease, listing)
        for leftover in _leftovers(names, listing, None if staged is None else staged.key):
            store.remove_prefix(leftover)
        prestaged = staged is not None  # other processes may have written files there
        if staged is None:
            staged = _stage_at(names, listing, n)
        sentinel = sentinel_name(names.identifier, n)
        resave = sentinel in listing
        superseded = [
            e for e in _data_names(listing, names.prefix).get(n, []) if e != staged.name and resave
        ]
        state = "writing"  # -> "committed", or "unknown" when the sentinel's fate is not known
        try:
            files = _stage(names, staged, data, described or {}, prestaged)
            store.publish(staged.key, staged.name)
            try:
                _confirm(names, staged, files)
            except StorageError:
                _check(lease)  # files gone because the directory is (DirectoryGoneError)?
                raise
            _check(lease)
            best = retention.best
            metric = None if best is None else best.metric(retention.score)
            manifest = encode(n, Manifest(staged.name, files, _generation(lease), metric))
            state = "unknown"
            try:
                # a re-save replaces (one atomic write: the old manifest or the new, never neither)
                created = store.put(sentinel, manifest, create_only=not resave)
            except Exception as e:
                landed = _holds(store, sentinel, manifest)  # a write that raised may have landed
                if landed is False:
                    state = "writing"
                if not landed:
                    raise
                warnings.warn(
                    f"checkpoint {n} in {store.url} is committed (its sentinel holds the new "
                    f"manifest), but writing the sentinel reported: {e}",
                    CheckpointWarning,
                    stacklevel=3,
                )
                created = True
            if not created:
                state = "writing"
                raise StorageError(
                    f"{store.url_of(sentinel)}: another writer committed checkpoint {n} while "
                    "this one wrote it; not overwritten"
                )
            state = "committed"
            if lease is not None:
                lease.known.add(sentinel)
        finally:
            if state == "writing":
                discard(names, staged, lease)
    _remove_quietly(store, superseded, f"the data checkpoint {n} replaced")
    collect_garbage(names, n, lease, retention)
    return store.url_of(staged.name)


def _holds(store: Store, key: str, data: bytes) -> bool | None:
    """Whether ``key`` holds ``data`` (None: the store cannot tell now)."""
    try:
        return store.holds(key, data)
    except OSError:
        return None


def discard(names: Names, staged: Staged, lease: Lease | None) -> None:
    """Remove what a failed save wrote for ``staged``, unless a newer run owns the directory
    now (best effort: a failure warns, and a later save removes the rest)."""
    try:
        _check(lease)
    except Exception:
        return  # superseded (or the directory is gone): nothing here is this run's to remove
    keys = dict.fromkeys([staged.key, staged.name])
    _remove_quietly(names.store, keys, f"the files of a failed save ({staged.name})")


def _remove_quietly(store: Store, prefixes: Iterable[str], what: str) -> None:
    """Remove data prefixes; a failure warns (the next garbage collection removes the rest)."""
    for prefix in prefixes:
        try:
            store.remove_prefix(prefix)
        except OSError as e:
            warnings.warn(
                f"removing {what} from {store.url_of(prefix)} failed: {e}",
                CheckpointWarning,
                stacklevel=4,
            )


def collect_garbage(names: Names, n: int, lease: Lease | None, retention: Retention) -> None:
    """Step 10 (module docstring): every doomed sentinel is deleted before any data, and the
    old copy of a re-saved N that a crash left beside the new one goes too."""
    store = names.store
    try:
        listing = store.list("")
        _check(lease, listing)
        if lease is not None and _sweep_late_writes(names, listing, lease):
            listing = store.list("")
        found = sentinels(listing, names.identifier)
        data = _data_names(listing, names.prefix)
        metrics = None
        if retention.best is not None:
            complete = complete_numbers(listing, names.identifier, names.prefix, n)
            metrics = recorded_metrics(store, names.identifier, listing, complete)
        doomed_sentinels, doomed_data = retention.doomed(n, set(found), set(data), metrics)
        store.remove(found[m] for m in sorted(doomed_sentinels))
        for m in sorted(doomed_data):
            for name in data[m]:
                store.remove_prefix(name)
        for m, copies in data.items():
            if len(copies) > 1 and m in found and m not in doomed_data and m <= n:
                view = CheckpointView(store, m, names.identifier, None, listing)
                try:
                    live = view.data_name(view.read_manifest())
                except (ValueError, FileNotFoundError):  # damaged: which copy is live is unknown
                    continue
                if live in copies:
                    for name in copies:
                        if name != live:
                            store.remove_prefix(name)
    except OSError as e:
        warnings.warn(
            f"checkpoint {n} in {store.url} is complete, but removing old checkpoints failed: {e}",
            CheckpointWarning,
            stacklevel=3,
        )


def recorded_metrics(
    store: Store, identifier: str, listing: Mapping[str, int | None], numbers: Iterable[int]
) -> dict[int, Metric | None]:
    """The metric the manifest of each checkpoint of ``numbers`` records (None: none, or a
    sentinel that cannot be read: such a checkpoint is never among the best)."""
    metrics: dict[int, Metric | None] = {}
    for m in numbers:
        try:
            manifest = CheckpointView(store, m, identifier, None, listing).read_manifest()
        except (ValueError, OSError):
            manifest = None
        metrics[m] = None if manifest is None else manifest.metric
    return metrics


def _generation(lease: Lease | None) -> int | None:
    return None if lease is None else lease.generation


def _sweep_late_writes(names: Names, listing: Mapping[str, Any], lease: Lease) -> bool:
    """Remove every sentinel that appeared after ``lease`` took the directory over and names an
    older lease (or none) as its writer, then its data: a superseded run's create-only PUT that
    checked its lease, was held in the network, and landed after this run's garbage collection
    had removed its data (a sentinel without data: the one invariant a zombie could break).
    Whether anything was removed. A sentinel whose manifest cannot be read is left to the
    verifying search, which skips it and says why."""
    store = names.store
    removed = False
    for m, sentinel in sorted(sentinels(listing, names.identifier).items()):
        if sentinel in lease.known:
            continue
        view = CheckpointView(store, m, names.identifier, None, listing)
        try:
            manifest = view.read_manifest()
        except (ValueError, OSError):
            continue
        writer = None if manifest is None else manifest.lease
        if writer is not None and writer >= lease.generation:
            lease.known.add(sentinel)  # this run's own (another checkpointer of it)
            continue
        store.remove([sentinel])
        if manifest is not None and manifest.data in listing:
            store.remove_prefix(manifest.data)
        warnings.warn(
            f"removed checkpoint {m} from {store.url}: a run superseded by this one (lease "
            f"{writer}, this run's is {lease.generation}) wrote its sentinel after the take-over",
            CheckpointWarning,
            stacklevel=4,
        )
        removed = True
    return removed


def remove(names: Names, numbers: Iterable[int], lease: Lease | None) -> None:
    """Delete checkpoints ``numbers``: their sentinels first, then their data, so a crash midway
    never leaves a sentinel without data."""
    store = names.store
    with store.exclusive():
        listing = store.list("")
        _check(lease, listing)
        wanted = sorted(set(numbers))
        found = sentinels(listing, names.identifier)
        data = _data_names(listing, names.prefix)
        store.remove(found[m] for m in wanted if m in found)
        for m in wanted:
            for name in data.get(m, []):
                store.remove_prefix(name)
