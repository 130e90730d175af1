"""One run owns a checkpoint directory: a generation-numbered lease that fences a zombie writer.

The policy, the same on local disk and on object stores: **the newest run takes over.** A run
that starts (the callback's ``setup``, before the first batch) creates the next lease object
``.lightning_bpk.owner.<G>`` create-only (``O_EXCL`` locally, a conditional PUT on S3 and GCS)
holding its pid, host and start time. Before every commit (sentinel) and every garbage
collection the writer lists the leases once; if a higher generation exists it raises
:class:`CheckpointSupersededError` naming the new owner, having deleted nothing. So a preempted
job that is still running while its replacement starts (a zombie), or a second run started by
mistake in the same directory, stops at its next write instead of mixing checkpoints with the
newer run: never both.

Why take-over rather than refusing the newer run: on a spot machine the older run is usually
dead or dying and cannot release anything, and whether a pid on another host is alive cannot be
known from the bucket. The superseded run's error says who took over, so the mistake of starting
two runs in one directory is visible at once.

Older lease objects are removed by the new owner after it created its own; the newest is never
removed (it is what the zombie compares against).

A zombie's write can still land *after* the take-over: a create-only PUT that checked the lease,
then sat in the network while the new owner took over and collected garbage. So a lease keeps
the names the directory held right after it was taken (:attr:`Lease.known`, to which the owner
adds what it writes); the checkpointer removes a sentinel that appears later, is not this
lease's own and names an older lease (or none) as its writer: a late write of a superseded run.

    >>> import tempfile
    >>> from lightning_bpk.store import open_store
    >>> store = open_store(tempfile.mkdtemp())
    >>> first = Lease.acquire(store)
    >>> second = Lease.acquire(store)
    >>> second.check()
    >>> first.generation, second.generation
    (1, 2)
    >>> try:
    ...     first.check()
    ... except CheckpointSupersededError as e:
    ...     print("superseded" in str(e))
    True
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_bpk.errors import DirectoryGoneError, LightningBpkError, StorageError
from lightning_bpk.store import Store

__all__ = ["LEASE_STEM", "CheckpointSupersededError", "Lease", "lease_name"]

LEASE_STEM = ".lightning_bpk.owner"
_LEASE = re.compile(re.escape(LEASE_STEM) + r"\.(0|[1-9][0-9]*)")
# Create-only races lost in a row before giving up (another run acquiring at the same moment).
_ACQUIRE_ATTEMPTS = 20


class CheckpointSupersededError(LightningBpkError, RuntimeError):
    """A newer run took over the checkpoint directory; this run must stop writing there."""


def _generations(listing: Mapping[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_LEASE.fullmatch, listing) if m is not None)


def lease_name(generation: int) -> str:
    return f"{LEASE_STEM}.{generation}"


@dataclass
class Lease:
    """This run's ownership of ``store``'s directory (see the module docstring)."""

    store: Store
    generation: int
    owner: dict[str, Any]
    # names the directory held just after the take-over, and those this run wrote since
    known: set[str] = field(default_factory=set)

    @classmethod
    def acquire(cls, store: Store) -> Lease:
        """Take over the directory: create the next generation's lease object create-only."""
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        for _ in range(_ACQUIRE_ATTEMPTS):
            existing = _generations(store.list(""))
            generation = (existing[-1] if existing else 0) + 1
            body = json.dumps({**owner, "generation": generation}).encode()
            if store.put(lease_name(generation), body, create_only=True):
                store.remove(lease_name(g) for g in existing)
                # listed after the lease exists: whatever a superseded run writes from now on
                # is not in it
                return cls(store, generation, owner, set(store.list("")))
        raise CheckpointSupersededError(
            f"{store.url}: could not take over the directory: other runs kept creating leases "
            f"({_ACQUIRE_ATTEMPTS} attempts)"
        )

    def check(self, listing: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`CheckpointSupersededError` if a newer run took over (one listing, or
        ``listing``: the directory's, made by the caller just now), or a
        :class:`~lightning_bpk.errors.DirectoryGoneError` if the directory itself is gone."""
        if listing is None:
            listing = self.store.list("")
        generations = _generations(listing)
        if generations and generations[-1] == self.generation:
            return
        if not generations:  # not even this run's lease: the directory went under the run
            self._gone()
        newest = generations[-1]
        raise CheckpointSupersededError(
            f"{self.store.url}: this run (pid {self.owner['pid']} on {self.owner['host']}, "
            f"started {self.owner['started']}, lease {self.generation}) was superseded by "
            f"{self._describe(newest)}; it stops writing here and deletes nothing"
        )

    def _gone(self) -> None:
        """The directory holds no lease, not even this run's: it (or its bucket) was deleted or
        emptied while the run used it (what is there now, if anything, was written since).
        Say that, and that the checkpoints went with it."""
        try:
            self.store.check()  # an object store: is the bucket there?
        except StorageError as e:
            raise DirectoryGoneError(
                f"{e}: it was deleted while this run used it, and every checkpoint in it with "
                "it; this run stops writing there"
            ) from e
        except OSError:
            pass  # a local directory that is gone: said below
        raise DirectoryGoneError(
            f"{self.store.url}: the checkpoint directory was deleted or emptied while this run "
            "used it (its lease is gone, and every checkpoint that was there with it); this run "
            "stops writing there"
        )

    def _describe(self, generation: int) -> str:
        try:
            doc = json.loads(self.store.read(lease_name(generation)))
            return (
                f"a newer run (pid {doc.get('pid')} on {doc.get('host')}, started "
                f"{doc.get('started')}, lease {generation})"
            )
        except (OSError, ValueError):
            return f"a newer run (lease {generation})"
