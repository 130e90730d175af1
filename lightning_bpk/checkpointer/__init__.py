"""Dopamine's checkpointer protocol (sentinel files, frequency, retention), made crash-safe.

``base_directory`` may also be a URL (``s3://bucket/run``, ``gs://...``, ``memory://...``): the
checkpointer is written once, over a :class:`~lightning_bpk.store.Store` (a local directory or
an object store), and the same layout and manifest are committed the same way on both.
:meth:`Checkpointer.take_over` makes a run the directory's owner (:mod:`lightning_bpk.store.lease`):
a superseded writer stops before its next write.

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
    ├── ckpt.8~3f2a9c1e0b4d5a67/               a re-save of 8: a name never used before
    ├── sentinel_checkpoint_complete.8         names ckpt.8~3f2a9c1e0b4d5a67
    └── ckpt.9.4242-0.tmp/                     staging directory of a save in flight (or of a
                                               crashed one; removed by the next save)

Saving iteration N (when ``N % checkpoint_frequency == 0``) is the one commit of
:mod:`lightning_bpk.checkpointer._commit`, whose docstring lists its steps: the records are staged,
published
under a data name never used before and confirmed, and the sentinel is written last. A failed
save raises and leaves every earlier checkpoint, including an earlier save of the same N, as it
was; a crash at any moment (even SIGKILL or power loss) leaves the newest complete N complete,
because a sentinel only ever names data that is already durable and whole.

**The sentinel is a manifest** (:mod:`lightning_bpk.checkpointer.manifest`), not Dopamine's
``b'done'``: it
names the data directory and the size and head digest of each file, so a checkpoint is verified
without a second copy of its bytes. Data directories of older versions (always ``ckpt.N``) keep
loading, and a sentinel holding exactly ``b'done'`` (written by Dopamine) still counts as
complete when its data exists, but it is unverifiable; verifying it says so.

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

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gin
import torch

from lightning_bpk import _gin
from lightning_bpk.checkpointer import _commit
from lightning_bpk.checkpointer._best import BestK
from lightning_bpk.checkpointer._commit import Retention, Staged
from lightning_bpk.checkpointer._view import (
    CheckpointEntry,
    CheckpointView,
    CheckpointWarning,
    Resume,
    choose_resume,
    latest,
    list_checkpoints,
)
from lightning_bpk.checkpointer.manifest import FileEntry, quote
from lightning_bpk.errors import CheckpointLockedError, StorageError
from lightning_bpk.layout import (
    DEFAULT_IDENTIFIER,
    DEFAULT_PREFIX,
    _iteration,
    _safe_name,
    data_name,
    sentinel_name,
)
from lightning_bpk.store import Store, location, open_store
from lightning_bpk.store.lease import Lease

__all__ = [
    "CheckpointEntry",
    "CheckpointLockedError",
    "CheckpointWarning",
    "Checkpointer",
    "Resume",
    "choose_resume",
    "get_latest_checkpoint_number",
    "list_checkpoints",
    "verify_checkpoint",
]

# How long a save that found the lock taken waits to learn whether a newer run is taking the
# directory over (it holds the lock only while it writes its lease: milliseconds).
_TAKE_OVER_WAIT = 10.0

# gin's selectors stay those of this module's real name (see lightning_bpk._gin)
_GIN_MODULE = "lightning_bpk.checkpointer"
_gin_configurable = _gin.configurable(_GIN_MODULE)


def _names(identifier: str, prefix: str | None) -> tuple[str, str | None]:
    _safe_name(identifier, "sentinel_file_identifier")
    if prefix is not None:
        _safe_name(prefix, "checkpoint_file_prefix")
    return identifier, prefix


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
    identifier, prefix = _names(sentinel_file_identifier, checkpoint_file_prefix)
    store = open_store(base_directory, storage_options)
    return latest(store, identifier, prefix, verify, tuple(required_keys))


def _bound_override_number() -> int | None:
    """What gin binds :func:`get_latest_checkpoint_number`'s ``override_number`` to (None:
    nothing), known without touching the filesystem."""
    try:
        return gin.query_parameter(f"{_GIN_MODULE}.get_latest_checkpoint_number.override_number")
    except ValueError:
        return None


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
    identifier, prefix = _names(sentinel_file_identifier, checkpoint_file_prefix)
    store = open_store(base_directory, storage_options)
    view = CheckpointView(store, _iteration(iteration_number), identifier, prefix)
    return view.problems(full=full, required_keys=tuple(required_keys))


# --- the checkpointer ---------------------------------------------------------------------------


def _setting(value: object, name: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {quote(value)}")


def _check_settings(
    checkpoint_file_prefix: str = "ckpt",
    sentinel_file_identifier: str = "checkpoint",
    checkpoint_frequency: int = 1,
    checkpoint_duration: int = 4,
    keep_every: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first invalid :class:`Checkpointer` setting.

    What the constructor checks, without touching the filesystem, so a Lightning callback can
    refuse bad settings when it is built rather than when ``fit`` starts.

    >>> _check_settings(checkpoint_duration=0)
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
    sparing multiples of ``keep_every * checkpoint_frequency`` when ``keep_every`` is set, and
    with ``best`` (:class:`~lightning_bpk.checkpointer._best.BestK`) the k best by a metric: a
    save records its value with ``retention=checkpointer.retention.scored(value)``.
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
        *,
        best: BestK | None = None,
    ) -> None:
        if not base_directory:
            raise ValueError("No path provided to Checkpointer.")
        _check_settings(
            checkpoint_file_prefix,
            sentinel_file_identifier,
            checkpoint_frequency,
            checkpoint_duration,
            keep_every,
        )
        # a Path for local directories, the URL for object stores (never Path("s3://..."))
        self.base_directory: Any = location(base_directory)
        self.checkpoint_file_prefix = checkpoint_file_prefix
        self.sentinel_file_identifier = sentinel_file_identifier
        self.checkpoint_frequency = checkpoint_frequency
        self.checkpoint_duration = checkpoint_duration
        self.keep_every = keep_every
        # The best-k rule kept beside Dopamine's (lightning_bpk.checkpointer._best); a save
        # passes its metric as retention=checkpointer.retention.scored(value).
        self.best = best
        # Set by take_over(): then every commit and garbage collection first checks that no
        # newer run took over the directory (lightning_bpk.store.lease).
        self.lease: Lease | None = None
        self.store: Store = open_store(self.base_directory, storage_options)
        try:
            # unreachable, wrong credentials, no bucket: fail now; a local directory is made
            self.store.check(create=True)
        except StorageError:
            raise
        except OSError as e:
            raise ValueError(
                f"Unable to create checkpoint path: {base_directory}. ({e.strerror or e})"
            ) from e

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.base_directory)!r}, {self.checkpoint_file_prefix!r}, "
            f"{self.sentinel_file_identifier!r}, checkpoint_frequency={self.checkpoint_frequency},"
            f" checkpoint_duration={self.checkpoint_duration}, keep_every={self.keep_every})"
        )

    @property
    def retention(self) -> Retention:
        """This checkpointer's retention settings, what a save collects garbage with."""
        return Retention(
            self.checkpoint_frequency, self.checkpoint_duration, self.keep_every, self.best
        )

    @property
    def _names(self) -> _commit.Names:
        return _commit.Names(self.store, self.checkpoint_file_prefix, self.sentinel_file_identifier)

    # -- paths ---------------------------------------------------------------------------------

    def checkpoint_path(self, iteration_number: int) -> Path | str:
        """The data directory (a URL on object stores) of ``iteration_number``: the one its
        sentinel names (a re-saved N's is ``<prefix>.<N>~<hex>``), else ``<prefix>.<N>``
        (which may not exist)."""
        view = self._view(iteration_number)
        try:
            name = view.data_name(view.read_manifest())
        except (OSError, ValueError):
            name = data_name(self.checkpoint_file_prefix, view.iteration)
        return location(self.store.url_of(name))

    def sentinel_path(self, iteration_number: int) -> Path | str:
        """The sentinel (manifest) of iteration ``iteration_number`` (it may not exist)."""
        name = sentinel_name(self.sentinel_file_identifier, _iteration(iteration_number))
        return location(self.store.url_of(name))

    def _view(self, iteration_number: int) -> CheckpointView:
        return CheckpointView(
            self.store,
            _iteration(iteration_number),
            self.sentinel_file_identifier,
            self.checkpoint_file_prefix,
        )

    def take_over(self) -> Lease:
        """Own the directory from now on: a newer lease than any before (a run that held one
        stops at its next write; see :mod:`lightning_bpk.store.lease`). Waits for a save in flight
        in a local directory, so the take-over falls between two saves."""
        with self.store.exclusive(wait=True):
            self.lease = Lease.acquire(self.store)
        return self.lease

    # -- reading -------------------------------------------------------------------------------

    def latest_checkpoint_number(self, verify: bool = False) -> int:
        """:func:`get_latest_checkpoint_number` for this checkpointer's prefix and identifier
        (gin bindings of that function, such as ``override_number``, do not apply here)."""
        return latest(
            self.store, self.sentinel_file_identifier, self.checkpoint_file_prefix, verify
        )

    def verify_checkpoint(self, iteration_number: int) -> list[str]:
        """Every problem found with checkpoint ``iteration_number`` (empty: it verifies)."""
        return self._view(iteration_number).problems(full=True)

    def load_checkpoint(
        self,
        iteration_number: int,
        keys: Iterable[str] | None = None,
        *,
        device: str | torch.device = "cpu",
    ) -> dict[str, Any] | None:
        """The data saved for ``iteration_number``, or ``None`` if it has no complete checkpoint.

        Records come back as record objects, plain data (saved as a ``StateRecord``) as its
        value. ``keys`` loads only those entries (``KeyError`` names any that were not saved).
        ``device``: where the tensors go, ``cpu`` or a CUDA device (checksums are verified on
        the host first; see :meth:`Record.to <lightning_bpk.records.Record.to>`).
        Each file's size and header bytes are checked against the manifest, and tensors against
        their checksums; a damaged checkpoint raises :class:`RecordError` naming the file.
        Read-only and lock-free.
        """
        return self._view(iteration_number).load(keys, device)

    # -- writing -------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        iteration_number: int,
        data: Mapping[str, Any],
        *,
        retention: Retention | None = None,
        staged: Staged | None = None,
        described: Mapping[str, FileEntry] | None = None,
    ) -> Path | str | None:
        """Save ``data`` as iteration ``iteration_number``; returns its directory, or ``None``
        when the iteration is skipped by ``checkpoint_frequency``.

        ``data`` maps keys (safe file names) to :class:`Record` objects or to plain nested data
        (saved as a ``StateRecord``). A failed save raises and leaves every earlier checkpoint,
        including an earlier save of the same N, as it was. Raises
        :class:`CheckpointLockedError` while another process is saving into this directory.

        ``retention`` saves whatever the frequency and collects garbage with those settings
        (a forced save: preemption, the end of training). ``staged`` (from :meth:`begin`)
        commits the files other processes already wrote into its prefix with ``data``;
        ``described`` gives the manifest entries of those their writer knows.
        """
        n = _iteration(iteration_number)
        if retention is None and n % self.checkpoint_frequency != 0:
            if staged is not None:
                self.discard(staged)
            return None
        if not isinstance(data, Mapping):
            raise TypeError(
                f"checkpoint data must be a mapping of keys to records or plain data, "
                f"not {type(data).__name__}"
            )
        for key in data:
            _safe_name(key, f"checkpoint {n} data key")
        try:
            url = _commit.commit(
                self._names,
                n,
                data,
                lease=self.lease,
                retention=retention or self.retention,
                staged=staged,
                described=described,
            )
        except CheckpointLockedError:
            if self.lease is not None:  # a newer run taking over holds the lock: say so instead
                self._wait_for_lock(_TAKE_OVER_WAIT)
                self.lease.check()
            raise
        return location(url)

    def begin(self, iteration_number: int) -> Staged:
        """Where other processes write files of checkpoint ``iteration_number`` before
        :meth:`save_checkpoint` with ``staged`` commits them (a sharded save's ranks); checks
        the lease. :meth:`discard` removes them if the save is abandoned."""
        return _commit.begin(self._names, _iteration(iteration_number), self.lease)

    def discard(self, staged: Staged) -> None:
        """Remove the files of an abandoned save (unless a newer run owns the directory)."""
        _commit.discard(self._names, staged, self.lease)

    def _wait_for_lock(self, seconds: float) -> None:
        """Return once the directory lock is free (taken and released), or after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                with self.store.exclusive():
                    return
            except CheckpointLockedError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)

    def remove_checkpoints(self, numbers: Iterable[int]) -> None:
        """Delete the checkpoints ``numbers``, under the directory lock: their sentinels first,
        then their data, so a crash midway never leaves a sentinel without data.

        For a run that starts over on purpose (``BurnpackCheckpoint(overwrite=True)``).
        """
        _commit.remove(self._names, [_iteration(n) for n in numbers], self.lease)
