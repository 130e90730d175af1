"""The checkpointer's protocol on object stores (S3, GCS, ``memory://``): no rename, so commit
with a manifest written last.

The layout is the local one, as keys below the URL (``s3://bucket/run/ckpt.7/model.bpk``,
``s3://bucket/run/sentinel_checkpoint_complete.7``), so the same tools read both. Saving N:

1. the records are written to a local staging directory (the local protocol's ``_stage``: each
   file fsynced) and described for the manifest (size, head digest);
2. the lease is checked (:mod:`lightning_bpk.lease`): a superseded run stops here;
3. the data name is chosen: ``ckpt.N`` when the store holds no data of N, else
   ``ckpt.N~<16 hex>``, a name never used before, so a re-save never touches the copy the
   sentinel of N names and no sentinel names bytes other than those it was written for. Data of
   N without a sentinel of N (left by a failed or crashed save) is deleted first;
4. every file is uploaded (large files as multipart uploads) with bounded retries;
5. one listing of the data prefix confirms every object is present with its size;
6. the lease is checked again and the sentinel is written: **create-only** (a conditional PUT
   on S3 and GCS) for a new N, so if another writer committed N in between this save fails
   instead of overwriting its commit; for a re-save of N one PUT replaces the old manifest by the
   new one (an object is replaced whole: readers see the old checkpoint or the new, never
   neither). A sentinel write that raised is read back: it may have landed; so is a create
   refused as "exists" (:meth:`~lightning_bpk.storage.ObjectStore.create`): the retry of our own
   PUT whose answer was lost finds our bytes there, which is a commit, not a conflict;
7. a re-save deletes the old copy of N's data; garbage collection (the local arithmetic), after
   one more lease check: sentinels are deleted before their data, so a checkpoint is incomplete
   before it is partial, and an old copy of a re-saved N that a crash left is deleted too.

A sharded save (:mod:`lightning_bpk.sharded`) splits this: rank 0 runs steps 2-3 first
(:func:`prepare`), every rank then uploads its shards into the data prefix chosen there and rank
0 confirms them, and :func:`save` with those objects as :class:`Uploaded` runs 1 and 4-7 for the
other records, listing every object in the manifest. A sharded re-save of N therefore keeps the
old copy until its new sentinel is written, as any re-save does.

A failure anywhere in 2-6 raises (a :class:`~lightning_bpk.storage.StorageError` after the
retries) and leaves every other checkpoint, and an earlier save of the same N, as it was; what
was uploaded for N is removed on a best-effort basis (never after losing the lease, nor when the
sentinel's fate is unknown). An object is never visible half-written on these stores, so a crash
at any point leaves at most unreferenced data, which later garbage collection removes.

Reads stream: a record object is fetched with ranged reads into memory, its head (header and
metadata) first and checked against the manifest's digest before the tensor bytes are fetched;
the tensor checksums are verified as the record is decoded. Nothing goes to a temporary folder.
A read that finds damage is made once more before the checkpoint is called damaged (bytes
garbled on the way are not the object's), and a :class:`~lightning_bpk.storage.StorageError`
(the store still failing after its retries) propagates: it says nothing about the checkpoint,
so resume must not skip to an older one for it.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import xxhash

from lightning_bpk import burnpack
from lightning_bpk import checkpointer as ck
from lightning_bpk.layout import NUMBER_PATTERN, sentinel_stem
from lightning_bpk.records.base import RecordError, StateRecord, record_from_pack
from lightning_bpk.storage import ObjectStore, StorageError, name_of

T = TypeVar("T")

__all__ = [
    "RemoteCheckpoint",
    "Uploaded",
    "collect_garbage",
    "commit",
    "discard",
    "fetch_pack",
    "latest",
    "list_checkpoints",
    "load_newest",
    "prepare",
    "remove",
    "save",
]


def _sentinels(listing: Mapping[str, int | None], identifier: str) -> dict[int, str]:
    """``{N: name}`` for the sentinel objects of a listing."""
    return {
        int(match.group(1)): name
        for name, match in ck.number_matches(listing, sentinel_stem(identifier))
        if listing[name] is not None
    }


def _data_entries(listing: Mapping[str, int | None], prefix: str) -> dict[int, list[str]]:
    """``{N: [names]}`` for the data prefixes of a listing: ``prefix.N`` and the re-saves
    ``prefix.N~<hex>`` (the plain name first)."""
    stem = re.escape(prefix) + r"\." + NUMBER_PATTERN
    compiled = re.compile(stem + f"(?:{re.escape(ck._VERSION_MARK)}{ck._DATA_VERSION.pattern})?")
    found: dict[int, list[str]] = {}
    for name in sorted(listing):
        match = compiled.fullmatch(name)
        if match and listing[name] is None:
            found.setdefault(int(match.group(1)), []).append(name)
    return found


def list_checkpoints(store: ObjectStore, identifier: str, prefix: str) -> list[ck.CheckpointEntry]:
    """:func:`lightning_bpk.checkpointer.list_checkpoints` on a store (one listing)."""
    listing = store.list("")
    sentinels = _sentinels(listing, identifier)
    data = _data_entries(listing, prefix)
    return [
        ck.CheckpointEntry(
            n,
            store.url_of(data[n][0]) if n in data else None,
            store.url_of(sentinels[n]) if n in sentinels else None,
        )
        for n in sorted(set(sentinels) | set(data), reverse=True)
    ]


class RemoteCheckpoint:
    """One iteration's sentinel and data in a store; read-only."""

    def __init__(self, store: ObjectStore, n: int, identifier: str, prefix: str | None) -> None:
        self.store = store
        self.iteration = n
        self.prefix = prefix
        self.sentinel_key = f"{sentinel_stem(identifier)}.{n}"
        self.sentinel = store.url_of(self.sentinel_key)
        self._manifest: tuple[ck._Manifest | None] | None = None  # once read and parsed

    def read_manifest(self) -> ck._Manifest | None:
        """Parse the sentinel. Raises FileNotFoundError (absent) or ValueError (damaged).

        A manifest read once is kept: the checks and the load of one resume choice (which call
        this in turn) see the same manifest and fetch it once."""
        if self._manifest is None:
            size = self.store.size(self.sentinel_key)
            if size is None:
                raise FileNotFoundError(self.sentinel)
            if size > ck.MAX_SENTINEL_SIZE:
                raise ValueError(f"sentinel is larger than {ck.MAX_SENTINEL_SIZE} bytes")
            manifest = _read_twice(
                lambda: ck._parse_manifest(self.store.read(self.sentinel_key), self.iteration),
                ValueError,
            )
            ck._check_data_name(manifest, self.prefix, self.iteration)
            self._manifest = (manifest,)
        return self._manifest[0]

    def data_name(self, manifest: ck._Manifest | None) -> str:
        return ck._data_name(manifest, self.prefix, self.iteration)

    def problems(self, *, full: bool, required_keys: Sequence[str] = ()) -> list[str]:
        """Why this checkpoint is not usable ([] if it is): the local checks, on objects."""
        manifest, unreadable = ck._read_manifest_or_problem(self)
        if unreadable:
            return unreadable
        name = self.data_name(manifest)
        data_url = self.store.url_of(name)
        present = self.store.list(name)
        if not present:
            return [f"{data_url}: data is missing (sentinel without data)"]
        if manifest is None:
            stored = {n[: -len(ck.RECORD_SUFFIX)] for n in present if n.endswith(ck.RECORD_SUFFIX)}
            missing = [k for k in required_keys if not ck.has_key(stored, k)]
            if missing:  # nothing lists the files, so a lost one is only noticed here
                return [
                    f"{data_url}/{k.split('|')[0]}{ck.RECORD_SUFFIX}: missing (b'done' sentinel)"
                    for k in missing
                ]
            if not full:
                return []
            warnings.warn(
                f"checkpoint {self.iteration} in {self.store.url} has Dopamine's b'done' "
                "sentinel: no manifest, so only the tensor checksums inside its files can be "
                "verified",
                ck.CheckpointWarning,
                stacklevel=4,
            )
            problems = []
            for file in sorted(n for n in present if n.endswith(ck.RECORD_SUFFIX)):
                problems.extend(self._damage(f"{name}/{file}", present[file] or 0, None))
            return problems
        problems = ck._unlisted_keys(self.sentinel, manifest, required_keys)
        expected = {key + ck.RECORD_SUFFIX: e for key, e in manifest.files.items()}
        for file in sorted(set(present) - set(expected)):
            problems.append(f"{data_url}/{file}: unexpected object, not in the manifest")
        for file, entry in expected.items():
            url = f"{data_url}/{file}"
            if file not in present:
                problems.append(f"{url}: listed in the manifest but missing")
            elif present[file] != entry.size:
                problems.append(f"{url}: {present[file]} bytes, manifest records {entry.size}")
            elif full:
                problems.extend(self._damage(f"{name}/{file}", entry.size, entry))
        return problems

    def _damage(self, key: str, size: int, entry: ck._FileEntry | None) -> list[str]:
        """Why object ``key`` is damaged ([] if every byte checks), read twice before saying
        so (:func:`_read_twice`). A store that keeps failing raises its StorageError: that
        says nothing about the checkpoint, which must not be skipped for it."""
        try:
            _read_twice(lambda: fetch_pack(self.store, key, size, entry).verify())
        except StorageError:
            raise
        except (burnpack.BurnpackError, OSError, RecordError) as e:
            return [str(e)]
        return []

    def load(self, keys: Iterable[str] | None) -> dict[str, Any] | None:
        """:meth:`Checkpointer.load_checkpoint` on a store."""
        try:
            manifest = ck._read_manifest_to_load(self)
        except FileNotFoundError:
            return None
        name = self.data_name(manifest)
        present = self.store.list(name)
        if not present:
            return None
        held = (
            sorted(f[: -len(ck.RECORD_SUFFIX)] for f in present if f.endswith(ck.RECORD_SUFFIX))
            if manifest is None
            else list(manifest.files)
        )
        wanted = held if keys is None else list(keys)
        missing = [k for k in wanted if k not in held]
        if missing:
            raise KeyError(
                f"checkpoint {self.iteration} ({self.store.url_of(name)}) has no entries "
                f"{missing}; it holds {sorted(held)}"
            )
        loaded = {}
        for key in wanted:
            loaded[key] = self._load_one(name, key, present, manifest)
        return loaded

    def _load_one(
        self,
        name: str,
        key: str,
        present: Mapping[str, int | None],
        manifest: ck._Manifest | None,
    ) -> Any:
        """Entry ``key``'s record (plain data: its value), its size the listed one."""
        file = key + ck.RECORD_SUFFIX
        url = self.store.url_of(f"{name}/{file}")
        size = present.get(file)
        if size is None:  # absent, or a prefix instead of an object
            raise RecordError("io", f"{url}: missing")
        entry = None if manifest is None else manifest.files[key]
        try:
            record = _read_twice(
                lambda: record_from_pack(fetch_pack(self.store, f"{name}/{file}", size, entry))
            )
        except burnpack.BurnpackError as e:
            raise RecordError("io", str(e)) from e
        except StorageError:
            raise  # the store failed (after retries): nothing is known about the data
        except OSError as e:
            raise RecordError("io", f"{url}: {e}") from e
        return record.value if isinstance(record, StateRecord) else record


def fetch_pack(
    store: ObjectStore, key: str, size: int, entry: ck._FileEntry | None = None
) -> burnpack.Pack:
    """Read object ``key`` into memory with ranged reads and parse it. ``size`` is the object's
    size as the store reports it (a listing, a stat), never a manifest's claim: with a manifest
    ``entry`` the two must agree before a byte is allocated.

    With a manifest ``entry`` the head (header and metadata) is fetched and checked against the
    recorded digest before any tensor byte is requested. Tensors are checked against their
    checksums when they are read from the returned pack.
    """
    url = store.url_of(key)
    if size > burnpack.MAX_FILE_SIZE:
        raise burnpack.ValidationError(f"{url}: {size} bytes exceeds the maximum file size")
    if entry is not None and (entry.size != size or entry.head_size > size):
        # before anything is allocated: a manifest's sizes are claims until the object agrees
        raise RecordError(
            "io",
            f"{url}: {size} bytes, manifest records {entry.size} (head {entry.head_size})",
        )
    buffer = bytearray(size)
    start = 0
    if entry is not None:
        store.read_into(key, memoryview(buffer)[: entry.head_size])
        if xxhash.xxh3_64_hexdigest(memoryview(buffer)[: entry.head_size]) != entry.head_xxh3:
            raise RecordError(
                "io", f"{url}: header/metadata bytes differ from the manifest's xxh3 (damaged)"
            )
        start = entry.head_size
    store.read_into(key, memoryview(buffer)[start:], offset=start)
    return burnpack.Pack(buffer, source=url)


def _read_twice(
    read: Callable[[], T],
    damage: type[Exception] | tuple[type[Exception], ...] = (burnpack.BurnpackError, RecordError),
) -> T:
    """``read()``, and once more if it found ``damage``: bytes garbled or cut short on the way
    (which the store's retries cannot see when the answer looked whole) are not damage, so a
    checkpoint is called damaged only when a second read agrees."""
    try:
        return read()
    except damage:
        return read()


def latest(
    store: ObjectStore,
    identifier: str,
    prefix: str | None,
    verify: bool,
    required_keys: Sequence[str] = (),
) -> int:
    """:func:`lightning_bpk.checkpointer.get_latest_checkpoint_number` on a store: the newest
    sentinel whose checkpoint passes the checks; skipped ones warn with the reason."""
    listing = store.list("")
    for n in sorted(_sentinels(listing, identifier), reverse=True):
        problems = RemoteCheckpoint(store, n, identifier, prefix).problems(
            full=verify, required_keys=required_keys
        )
        if not problems:
            return n
        warnings.warn(
            f"checkpoint {n} in {store.url} skipped: " + "; ".join(problems),
            ck.CheckpointWarning,
            stacklevel=3,
        )
    return -1


def load_newest(
    store: ObjectStore,
    identifier: str,
    prefix: str | None,
    required_keys: Sequence[str],
    at_most: int,
    unloaded: Sequence[str] = (),
) -> tuple[int, dict[str, Any] | None]:
    """Resume's verify and load in one read: the newest checkpoint ``<= at_most`` that passes
    the quick checks (sentinel, sizes, required keys) and loads, every byte verified as it is
    read (head digests, tensor checksums), with what it holds. A damaged one is skipped with a
    :class:`~lightning_bpk.checkpointer.CheckpointWarning`, falling back to the one before.

    A checkpoint holding one of the ``unloaded`` keys (a sharded checkpoint's index: every
    rank then reads its own part) is verified in full instead, every object read once, and
    comes with ``None`` for what it holds."""
    listing = store.list("")
    for n in sorted((m for m in _sentinels(listing, identifier) if m <= at_most), reverse=True):
        checkpoint = RemoteCheckpoint(store, n, identifier, prefix)
        problems = checkpoint.problems(full=False, required_keys=required_keys)
        if not problems:
            try:
                manifest = checkpoint.read_manifest()
                if manifest is not None and any(k in manifest.files for k in unloaded):
                    problems = checkpoint.problems(full=True, required_keys=required_keys)
                    if not problems:
                        return n, None
                else:
                    data = checkpoint.load(None)
                    if data is not None:
                        return n, data
                    problems = [f"{checkpoint.sentinel}: its data is gone"]
            except StorageError:
                raise  # not damage: the store failed after its retries
            except (RecordError, OSError, KeyError, ValueError) as e:
                problems = [str(e)]
        warnings.warn(
            f"checkpoint {n} in {store.url} skipped: " + ck.summarise(problems),
            ck.CheckpointWarning,
            stacklevel=3,
        )
    return -1, None


class Uploaded(NamedTuple):
    """Objects other processes already put into a checkpoint's data prefix (a sharded save's
    ranks, into the prefix :func:`prepare` chose), with their manifest entries."""

    name: str
    files: Mapping[str, ck._FileEntry]


def save(
    checkpointer: ck.Checkpointer,
    store: ObjectStore,
    n: int,
    data: Mapping[str, Any],
    uploaded: Uploaded | None = None,
) -> str:
    """Save iteration ``n`` into ``store`` (steps 1-7 of the module docstring); its data URL.

    ``uploaded``: objects already in the data prefix :func:`prepare` chose (a sharded save's
    ranks): confirmed and listed in the manifest with the staged ones.
    """
    scratch = Path(tempfile.mkdtemp(prefix="lightning_bpk-upload-"))
    try:
        staging, files = checkpointer._stage(n, data, under=scratch)
        return commit(checkpointer, store, n, staging, files, uploaded)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def prepare(checkpointer: ck.Checkpointer, store: ObjectStore, n: int) -> str:
    """Steps 2-3 for a sharded save: check the lease and choose N's data prefix; its URL.

    The ranks then put their objects under that URL, and :func:`save` commits them as
    :class:`Uploaded`. As for any save, a re-save of N gets a name never used before, so the
    old copy stays whole until the new sentinel replaces the old one.
    """
    if checkpointer.lease is not None:
        checkpointer.lease.check()
    name, _, _ = _choose_data_name(checkpointer, store, n)
    return store.url_of(name)


def _choose_data_name(
    checkpointer: ck.Checkpointer, store: ObjectStore, n: int, name: str | None = None
) -> tuple[str, bool, list[str]]:
    """Step 3: ``(name, resave, earlier)``: N's data name (``name`` when the caller's uploads
    already chose it), whether N is committed (a re-save), and the other data of N that a
    re-save deletes after its sentinel. Data of N without a sentinel of N (what failed or
    crashed saves left) is deleted now."""
    prefix = checkpointer.checkpoint_file_prefix
    listing = store.list("")
    resave = f"{sentinel_stem(checkpointer.sentinel_file_identifier)}.{n}" in listing
    earlier = [e for e in _data_entries(listing, prefix).get(n, []) if e != name]
    if not resave:
        for old in earlier:
            store.remove_prefix(old)
    if name is None:
        # a name never used before when N had data: the old copy stays whole until the new
        # sentinel, and no upload still landing from a failed save mixes into the new one
        name = f"{prefix}.{n}" if not earlier else f"{prefix}.{n}{ck._VERSION_MARK}{_version()}"
    return name, resave, earlier if resave else []


def commit(
    checkpointer: ck.Checkpointer,
    store: ObjectStore,
    n: int,
    staging: Path,
    files: Mapping[str, ck._FileEntry],
    uploaded: Uploaded | None = None,
) -> str:
    """Upload a staged checkpoint and write its sentinel last (steps 2-7; ``uploaded``: see
    :func:`save`)."""
    lease = checkpointer.lease
    sentinel = f"{sentinel_stem(checkpointer.sentinel_file_identifier)}.{n}"
    if lease is not None:
        lease.check()
    name, resave, earlier = _choose_data_name(
        checkpointer, store, n, None if uploaded is None else uploaded.name
    )
    ours = {} if uploaded is None else uploaded.files
    files = {**ours, **files}
    manifest = ck._encode_manifest(n, ck._Manifest(name, dict(files)))
    state = "uploading"  # -> "committed", or "unknown" when the sentinel's fate is not known
    try:
        for key in files:
            if key not in ours:
                store.upload(staging / (key + ck.RECORD_SUFFIX), f"{name}/{key}{ck.RECORD_SUFFIX}")
        present = store.list(name)
        for key, entry in files.items():
            found = present.get(key + ck.RECORD_SUFFIX)
            if found != entry.size:
                raise StorageError(
                    f"{store.url_of(name)}/{key}{ck.RECORD_SUFFIX}: uploaded, but the store "
                    f"lists {'nothing' if found is None else f'{found} bytes'} instead of "
                    f"{entry.size} bytes; checkpoint {n} not committed"
                )
        if lease is not None:
            lease.check()
        state = "unknown"
        try:
            # a re-save overwrites (one PUT: the old manifest or the new one, never neither)
            if resave:
                store.put(sentinel, manifest)
            elif not store.create(sentinel, manifest):
                state = "refused"
        except Exception:
            landed = _holds(store, sentinel, manifest)  # a write that raised may have landed
            if landed is False:
                state = "uploading"
            if not landed:
                raise
        if state == "refused":
            state = "uploading"
            raise StorageError(
                f"{store.url_of(sentinel)}: another writer committed checkpoint {n} while this "
                "one uploaded it; not overwritten"
            )
        state = "committed"
    finally:
        if state == "uploading":
            discard(checkpointer, store, store.url_of(name))
    if resave:
        _remove_quietly(store, earlier, f"the data checkpoint {n} replaced")
    collect_garbage(checkpointer, store, n)
    return store.url_of(name)


def discard(checkpointer: ck.Checkpointer, store: ObjectStore, url: str) -> None:
    """Remove what a failed save uploaded into the data prefix at ``url``, unless a newer run
    owns the directory now (best effort: a failure warns, and the next garbage collection
    removes the rest)."""
    if _still_owner(checkpointer.lease):
        name = name_of(url)
        _remove_quietly(store, [name], f"the uploaded objects of a failed save ({name})")


def _version() -> str:
    return secrets.token_hex(8)


def _holds(store: ObjectStore, key: str, data: bytes) -> bool | None:
    """Whether object ``key`` holds ``data`` (None: the store cannot tell now)."""
    try:
        return store.holds(key, data)
    except OSError:
        return None


def _remove_quietly(store: ObjectStore, names: Iterable[str], what: str) -> None:
    """Remove data prefixes; a failure warns (the next garbage collection removes the rest)."""
    for name in names:
        try:
            store.remove_prefix(name)
        except OSError as e:
            warnings.warn(
                f"removing {what} from {store.url_of(name)} failed: {e}",
                ck.CheckpointWarning,
                stacklevel=4,
            )


def _still_owner(lease: Any) -> bool:
    if lease is None:
        return True
    try:
        lease.check()
    except Exception:
        return False
    return True


def remove(checkpointer: ck.Checkpointer, store: ObjectStore, numbers: Iterable[int]) -> None:
    """:meth:`Checkpointer.remove_checkpoints` in a store: the sentinels first, then the data."""
    if checkpointer.lease is not None:
        checkpointer.lease.check()
    wanted = sorted(numbers)
    listing = store.list("")
    sentinels = _sentinels(listing, checkpointer.sentinel_file_identifier)
    data = _data_entries(listing, checkpointer.checkpoint_file_prefix)
    store.remove(sentinels[m] for m in wanted if m in sentinels)
    for m in wanted:
        for name in data.get(m, []):
            store.remove_prefix(name)


def collect_garbage(checkpointer: ck.Checkpointer, store: ObjectStore, n: int) -> None:
    """The local retention (:meth:`Checkpointer._collect_garbage`) in a store: every doomed
    sentinel is deleted before any data object. A failure warns; the save stands."""
    try:
        if checkpointer.lease is not None:
            checkpointer.lease.check()
        listing = store.list("")
        sentinels = _sentinels(listing, checkpointer.sentinel_file_identifier)
        data = _data_entries(listing, checkpointer.checkpoint_file_prefix)
        doomed_sentinels, doomed_data = checkpointer._doomed(n, set(sentinels), set(data))
        store.remove(sentinels[m] for m in sorted(doomed_sentinels))
        for m in sorted(doomed_data):
            for name in data[m]:
                store.remove_prefix(name)
        for m, names in data.items():  # a re-save's old copy that a crash left beside the new
            if len(names) > 1 and m in sentinels and m not in doomed_data and m <= n:
                checkpoint = RemoteCheckpoint(store, m, checkpointer.sentinel_file_identifier, None)
                try:
                    live = checkpoint.data_name(checkpoint.read_manifest())
                except ValueError:  # a damaged sentinel: which copy is live is not known
                    continue
                if live in names:
                    for name in names:
                        if name != live:
                            store.remove_prefix(name)
    except OSError as e:
        warnings.warn(
            f"checkpoint {n} in {store.url} is complete, but removing old checkpoints failed: {e}",
            ck.CheckpointWarning,
            stacklevel=3,
        )
