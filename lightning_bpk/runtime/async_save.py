"""Asynchronous checkpoint saves: the training thread only copies tensors into reused buffers.

A synchronous save blocks training for the whole durable write (about 0.4-0.9 s per GiB on a
virtio disk, more with first-touch memory). :class:`AsyncCheckpointSaver` splits it in two:

1. **on the caller's thread**, each record's content (``Record.to_content``: tensors, scalars,
   string metadata, all computed from the live objects now) is frozen: every tensor is copied
   into a *staging buffer* owned by the saver. The buffers are allocated on the first save and
   reused by every later one (keyed by data key and tensor name; one is reallocated only when
   that tensor's shape or dtype changes), so a save costs a memory copy, never a fresh clone of
   the model (which on these VMs costs ~10x more: fresh memory is slow to fault in);
2. **on one background writer thread**, the frozen records go through the unchanged synchronous
   path, e.g. :meth:`Checkpointer.save_checkpoint`: data written and fsynced, then the sentinel,
   then garbage collection, in that order. A sentinel therefore never names data that is not yet
   durable, and old checkpoints are only collected after the new one is complete.

**On a GPU** (a tensor on a CUDA device, chosen by capability, no flag) the staging buffers are
pinned host memory and the copies are issued ``non_blocking`` on a side stream that first waits
for the training stream; the training stream then waits for them on the device (so a kernel
queued after the save returns cannot change a tensor before it was copied), and the writer
thread waits on their event before it reads (:mod:`lightning_bpk._device`). Nothing of the
state is copied on the device.

Rules, each one a failure mode seen in other libraries:

- **At most one save in flight.** A new save first waits for the previous one (its staging
  buffers are about to be overwritten), so saves are serialized and never reorder.
- **Errors are never swallowed.** An exception of the background write is re-raised, unchanged
  (with a note saying which save it came from), by the next :meth:`save_checkpoint`, by
  :meth:`wait` or by :meth:`close`, whichever comes first.
- **Snapshots are never torn.** Everything the writer reads is a copy taken before ``save_*``
  returned, so optimizer steps taken while the write runs cannot leak into the checkpoint.
- **Nothing is lost at the end.** :meth:`close` (and leaving a ``with`` block) waits for the
  write in flight and re-raises its error; call it before reading what was saved.

Example::

    >>> import tempfile, torch
    >>> from lightning_bpk.checkpointer import Checkpointer, Retention
    >>> from lightning_bpk.records import ModuleRecord
    >>> net = torch.nn.Linear(2, 2)
    >>> checkpointer = Checkpointer(tempfile.mkdtemp())
    >>> with AsyncCheckpointSaver() as saver:
    ...     saver.save_checkpoint(checkpointer, 0, {"model": ModuleRecord.from_module(net)})
    ...     with torch.no_grad():
    ...         _ = net.weight.add_(1.0)  # training goes on; the snapshot is already taken
    >>> saved = checkpointer.load_checkpoint(0)["model"].tensors["weight"]
    >>> torch.equal(saved + 1.0, net.weight)
    True
"""

from __future__ import annotations

import contextlib
import copy
import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_bpk import _device, burnpack
from lightning_bpk.checkpointer import Checkpointer, Retention
from lightning_bpk.records.base import Record, StateRecord
from lightning_bpk.runtime import sharded
from lightning_bpk.runtime._writer import StagedRecord, WriterProcess
from lightning_bpk.runtime.overlap import StepGate

__all__ = [
    "AsyncCheckpointSaver",
]

# Name of the writer thread (visible in py-spy, faulthandler dumps and thread listings).
_WRITER_THREAD_NAME = "lightning_bpk-async-save"
# A staging buffer of at least this many bytes starts where its bytes lie within a page of
# the file written from it (a page of room per buffer), so an O_DIRECT writer writes it with
# no copy; below it a copy into the writer's own buffers costs little.
_PLACED_MIN = 8 * 1024 * 1024
_PAGE = mmap.PAGESIZE
# Staging owner of :meth:`AsyncCheckpointSaver.save_record` snapshots, whatever their path.
_RECORD_OWNER = "<record>"
# Staging owner of the shards of :meth:`AsyncCheckpointSaver.save_sharded`.
_SHARDS_OWNER = "<shards>"
# No process group made yet (None: made, and there is no distributed run).
_NO_GROUP = object()


@dataclass
class _Slot:
    """One staging buffer: ``view`` (the tensor a snapshot holds) inside ``raw``, the memory
    (touched once, reused; pinned when it stages a tensor of an accelerator); for a ``DTensor``,
    ``shard`` is the DTensor around ``view``."""

    raw: torch.Tensor
    view: torch.Tensor
    shard: DTensor | None = None


class _StagingArea:
    """CPU buffers that snapshots are copied into, allocated once and reused.

    Buffers are keyed by ``(owner, tensor name)``; a buffer is replaced only when the tensor's
    shape or dtype changes, and buffers no snapshot used last time are dropped by :meth:`prune`.

    A tensor on an accelerator (CUDA) is staged in pinned memory by a non-blocking copy on a
    side stream (:class:`lightning_bpk._device.DeviceToHost`): nothing of it is copied on the
    device, and the buffers are complete only once the :meth:`settle` after the snapshot has
    been waited on (the writer does, before it reads).

    >>> area = _StagingArea()
    >>> a = area.copy("model", "w", torch.ones(3)); b = area.copy("model", "w", torch.zeros(3))
    >>> a is b, area.allocations, b.tolist()
    (True, 1, [0.0, 0.0, 0.0])
    """

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared  # buffers in shared memory, for a writer process to read
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._used: set[tuple[str, str]] = set()
        self.allocations = 0  # buffers allocated so far (stays flat once shapes are stable)
        self._copies = _device.DeviceToHost()
        # host copies left to the writer thread (parameters, optimizer state), as (dst, src)
        self.late: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(
        self,
        owner: str,
        name: str,
        tensor: torch.Tensor,
        at: int | None = None,
        stable: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Copy ``tensor`` into the staging buffer for ``(owner, name)`` and return the frozen
        view: the buffer, or for a ``DTensor`` (one rank's shard of a sharded tensor) a
        ``DTensor`` of the same layout around the buffer its local shard was copied into.

        ``at``: the offset the tensor's bytes will have in the file written from the snapshot;
        a buffer of :data:`_PLACED_MIN` bytes or more then starts at the same offset within a
        memory page, so an ``O_DIRECT`` writer writes it from where it lies, with no copy.

        The one place where a snapshot's bytes are copied (a device's tensors too: the copy
        lands in host memory, pinned, and is complete once :meth:`settle`'s result is waited
        on). ``stable``: the storages only the next optimizer step changes
        (:meth:`~lightning_bpk.runtime.overlap.StepGate.stable`): a tensor in one is copied
        late (:mod:`lightning_bpk.runtime.overlap`), a host tensor's copy left in :attr:`late`."""
        key = (owner, name)
        with torch.no_grad():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            source = local.detach()
            pinned = _device.accelerated(source.device)
            slot = self._place(key, source.shape, source.dtype, at, pinned)
            late = bool(stable) and source.untyped_storage().data_ptr() in stable
            if late and not pinned:
                self.late.append((slot.view, source))
            else:
                self._copies.copy(slot.view, source, late=late)
        self._used.add(key)
        if not isinstance(tensor, DTensor):
            return slot.view
        shard = slot.shard
        if (
            shard is None
            or shard.device_mesh != tensor.device_mesh
            or shard.placements != tensor.placements
            or shard.shape != tensor.shape
            or shard.stride() != tensor.stride()
        ):
            shard = slot.shard = DTensor.from_local(
                slot.view,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return shard

    def settle(self) -> _device.Ready:
        """End a snapshot: what its reader waits on before reading the buffers (nothing, unless
        tensors of an accelerator were copied)."""
        return self._copies.settle()

    def _place(
        self,
        key: tuple[str, str],
        shape: torch.Size,
        dtype: torch.dtype,
        at: int | None,
        pinned: bool = False,
    ) -> _Slot:
        """The slot of ``key`` for a tensor of ``shape`` and ``dtype`` (placed for file offset
        ``at``; in pinned memory when ``pinned``): the one it had when that fits, else a new
        one."""
        nbytes = shape.numel() * dtype.itemsize
        slot = self._slots.get(key)
        if (
            slot is None
            or slot.view.dtype != dtype
            or slot.raw.numel() < nbytes
            or (pinned and not slot.raw.is_pinned())
        ):
            room = _PAGE if nbytes >= _PLACED_MIN else 0
            raw = _device.host_buffer(nbytes + room, pinned=pinned and not self.shared)
            if self.shared:
                raw.share_memory_()
            slot = self._slots[key] = _Slot(raw, raw[:nbytes].view(dtype).view(shape))
            self.allocations += 1
        start = 0
        if at is not None and slot.raw.numel() >= nbytes + _PAGE:
            start = (at - slot.raw.data_ptr()) % _PAGE
        if slot.view.shape != shape or slot.view.data_ptr() != slot.raw.data_ptr() + start:
            slot.view = slot.raw[start : start + nbytes].view(dtype).view(shape)
            slot.shard = None
        return slot

    def reserve(self, wanted: list[tuple[str, str, tuple[int, ...], torch.dtype, bool]]) -> None:
        """Allocate and fault in buffers for ``(owner, name, shape, dtype, pinned)`` ahead of
        the first snapshot (fresh memory is slow to touch, pinning it slower still; see
        :meth:`AsyncCheckpointSaver.reserve`)."""
        for owner, name, shape, dtype, pinned in wanted:
            before = self.allocations
            slot = self._place((owner, name), torch.Size(shape), dtype, None, pinned)
            if self.allocations != before:
                slot.raw.zero_()  # touch every page now, not during the first save

    def prune(self) -> None:
        """Free buffers the snapshots since the last prune did not use (removed tensors)."""
        for key in set(self._slots) - self._used:
            del self._slots[key]
        self._used = set()

    def clear(self) -> None:
        """Free every buffer (the next save allocates them again)."""
        self._slots.clear()
        self._used = set()

    @property
    def buffers(self) -> dict[tuple[str, str], torch.Tensor]:
        """The buffers, by ``(owner, tensor name)``."""
        return {key: slot.view for key, slot in self._slots.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(slot.raw.numel() for slot in self._slots.values())


def _freeze_entry(
    area: _StagingArea,
    owner: str,
    name: str,
    value: Any,
    at: int | None = None,
    stable: frozenset[int] = frozenset(),
) -> Any:
    """A tensor or :class:`burnpack.TensorEntry` with its bytes moved into staging (placed for
    file offset ``at``, late when in ``stable``: see :meth:`_StagingArea.copy`)."""
    if isinstance(value, torch.Tensor):
        return area.copy(owner, name, value, at, stable)
    if not isinstance(value, burnpack.TensorEntry):
        return value  # not a tensor: the writer reports it as the synchronous path would
    data = value.data
    if callable(data) and not isinstance(data, torch.Tensor):
        data = data()  # a deferred provider reads live state: call it now, not on the writer
    if isinstance(data, torch.Tensor):
        data = area.copy(owner, name, data, at, stable)
    elif not isinstance(data, bytes):
        data = bytes(data)  # bytearray/memoryview may change under the writer
    return burnpack.TensorEntry(
        value.dtype, value.shape, data, param_id=value.param_id, nbytes=value.nbytes
    )


def _freeze(
    area: _StagingArea, owner: str, value: Any, stable: frozenset[int] = frozenset()
) -> Record:
    """Snapshot a record (or plain data, as a :class:`StateRecord`) into ``area`` (what lies in
    ``stable`` copied late).

    The result shares no mutable memory with ``value``: tensors live in staging buffers,
    scalars and strings are immutable.
    """
    record = value if isinstance(value, Record) else StateRecord(value)
    tensors, scalars, metadata = record.to_content()
    at = _offsets(StagedRecord(record.kind, tensors, scalars, metadata))
    frozen = {
        name: _freeze_entry(area, owner, name, t, at.get(name), stable)
        for name, t in tensors.items()
    }
    return StagedRecord(record.kind, frozen, dict(scalars), dict(metadata))


def _offsets(record: Record) -> dict[str, int]:
    """The file offset of each tensor of ``record`` that is staged where it lies in the file
    (:data:`_PLACED_MIN` bytes or more): the writer plans the same content the same way. No
    plan when there is none (a few small tensors: nothing to gain)."""
    tensors, scalars, metadata = record.content()
    if not any(_nbytes(t) >= _PLACED_MIN for t in tensors.values()):
        return {}
    at = burnpack.offsets(tensors, metadata=metadata, scalars=scalars)
    return {name: at[name] for name, t in tensors.items() if _nbytes(t) >= _PLACED_MIN}


def _nbytes(value: Any) -> int:
    if isinstance(value, burnpack.TensorEntry):
        return value.nbytes
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


# Leaves a snapshot shares with the live state: nothing can change them in place.
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _map_tree(value: Any, tensor: Callable[[str, torch.Tensor], Any], path: str = "") -> Any:
    """Nested state (dicts, lists, tuples: a DCP state dict) rebuilt with every tensor replaced
    by ``tensor(path, it)`` (``path``: where it lies, ``/model/net.0.weight``), immutable leaves
    kept and any other leaf deep-copied: nothing of the result changes with the live state."""
    if isinstance(value, torch.Tensor):
        return tensor(path, value)
    if isinstance(value, Mapping):
        return {k: _map_tree(v, tensor, f"{path}/{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_map_tree(v, tensor, f"{path}/{i}") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A new gloo group over every rank, for the writer threads' collectives (a collective
    itself: every rank creates it at the same point), with the default group's timeout, so a
    rank that died stops the others' writes as it stops their training."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    timeout, world = None, dist.group.WORLD
    with contextlib.suppress(AttributeError, RuntimeError):  # private: the default group's
        timeout = world._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    return dist.new_group(backend="gloo", timeout=timeout)


class AsyncCheckpointSaver:
    """Runs saves on one background thread after snapshotting their data into staging buffers.

    See the module docstring for the guarantees. ``process=True``: the staging buffers live in
    shared memory and a writer process commits each snapshot (reading those buffers only), so
    the commit's Python does not compete with training for the interpreter lock; same
    guarantees, and a writer process that dies fails its save, which the next call raises
    (local and object-store directories: a ``memory://`` store lives in this process only).
    Not thread-safe itself: call it from one thread (the training loop). ``close`` frees the
    staging buffers; the saver can be used again afterwards (buffers and thread are created on
    demand).
    """

    def __init__(self, *, process: bool = False) -> None:
        self.staging = _StagingArea(shared=process)
        # process=True: the commit runs in a writer process (lightning_bpk.runtime._writer)
        self._writer = WriterProcess() if process else None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_what = ""
        # the writer threads' process group of a sharded run (made by the first save_sharded)
        self._group: Any = _NO_GROUP
        self._lock = threading.Lock()  # guards _executor/_pending against a concurrent close()
        self._gate = StepGate()

    def watch(self, optimizers: Iterable[Any]) -> None:
        """Overlap later snapshots with training: the parameters and state of ``optimizers``
        (which only their steps change) are copied beside the next forward and backward, and
        the next step of any of them waits for that copy (:mod:`lightning_bpk.runtime.overlap`).
        A save then blocks its caller only for the buffers, RNG and loop state."""
        self._gate.watch(optimizers)

    def wait_snapshot(self) -> None:
        """Block until the last snapshot's late copies landed (a watched step does it too)."""
        self._gate.release()

    # -- submitting --------------------------------------------------------------------------

    def save_checkpoint(
        self,
        checkpointer: Checkpointer,
        iteration_number: int,
        data: Mapping[str, Any],
        on_saved: Callable[[Path | str], None] | None = None,
        *,
        retention: Retention | None = None,
    ) -> None:
        """Snapshot ``data`` now and save it as ``iteration_number`` in the background.

        Same arguments and checkpoint as :meth:`Checkpointer.save_checkpoint`. Waits for the
        previous save first and re-raises its error, if it failed. An iteration the checkpointer
        would skip (``checkpoint_frequency``, unless a ``retention`` forces the save) is skipped
        here too, without copying anything.
        ``on_saved(path)`` runs on the writer thread once the checkpoint is complete (its
        sentinel committed), e.g. to log it; not after a failed write.
        """
        self.wait()
        if retention is None and iteration_number % checkpointer.checkpoint_frequency:
            return
        stable = self._gate.stable()
        staged = {key: _freeze(self.staging, key, value, stable) for key, value in data.items()}
        self.staging.prune()
        what = f"checkpoint {iteration_number} in {checkpointer.base_directory}"

        buffers = [slot.raw for slot in self.staging._slots.values()]

        def save() -> Path | str | None:
            # a subclass of Checkpointer may predate the retention argument: pass it only if set
            if self._writer is not None:
                path = self._writer.save(checkpointer, iteration_number, staged, buffers, retention)
            elif retention is None:
                path = checkpointer.save_checkpoint(iteration_number, staged)
            else:
                path = checkpointer.save_checkpoint(iteration_number, staged, retention=retention)
            if path is not None and on_saved is not None:
                on_saved(path)
            return path

        self._submit(what, save)

    def reserve(self, data: Mapping[str, Any], *, shards: Mapping[str, Any] | None = None) -> None:
        """Allocate the staging buffers a later :meth:`save_checkpoint` of data shaped like
        ``data`` needs (and a later :meth:`save_sharded` of ``shards``: this rank's shards), and
        start the writer process of ``process=True``, on the writer thread, so the first save
        costs the training thread a copy only. Returns at once; the next save waits for it (as
        for any write in flight)."""
        self.wait()
        wanted = []
        for key, value in data.items():
            record = value if isinstance(value, Record) else StateRecord(value)
            for name, entry in record.to_content()[0].items():
                tensor = entry.data if isinstance(entry, burnpack.TensorEntry) else entry
                if isinstance(tensor, torch.Tensor):
                    pinned = _device.accelerated(tensor.device)
                    wanted.append((key, name, tuple(tensor.shape), tensor.dtype, pinned))

        def shard(path: str, tensor: torch.Tensor) -> None:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            pinned = _device.accelerated(local.device)
            wanted.append((_SHARDS_OWNER, path, tuple(local.shape), local.dtype, pinned))

        _map_tree(shards or {}, shard)

        def prepare() -> None:
            self.staging.reserve(wanted)
            if self._writer is not None:  # spawning it takes seconds
                self._writer.start()

        self._submit("staging buffers", prepare)

    def save_sharded(
        self,
        checkpointer: Checkpointer,
        iteration_number: int,
        state: Mapping[str, Any],
        data: Mapping[str, Any] | None = None,
        on_saved: Callable[[Path | str], None] | None = None,
        *,
        retention: Retention | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Snapshot this rank's shards of ``state`` now and save checkpoint
        ``iteration_number`` of a sharded run in the background: a collective, which every rank
        calls at the same point (as ``dcp.save``).

        ``state`` is a DCP state dict (nested dicts and lists of ``DTensor`` shards, tensors and
        plain values): each rank's shards are copied into its staging buffers (reused by every
        later save) and the same save as a synchronous one runs on each rank's writer thread
        (:func:`lightning_bpk.runtime.sharded.save`): every rank writes its file, then global
        rank 0 commits them with ``data`` (its records: schedulers, trainer state; other ranks pass
        None) and writes the sentinel last, once every rank's file is durable. The writer
        threads' collectives run over a gloo process group of their own, created at the first
        call, never the training's (collectives of two threads on one group would interleave).

        Waits for the previous save first and re-raises its error, on every rank: each rank's
        writer learns the outcome of the whole save, so a write that failed on one rank fails
        the next call on all of them. ``on_saved(path)`` runs on rank 0's writer thread once
        the checkpoint is complete.
        """
        self.wait()
        if retention is None and iteration_number % checkpointer.checkpoint_frequency:
            return
        with self._lock:
            if self._group is _NO_GROUP:
                self._group = _checkpoint_group()
            group = self._group
        shards = _map_tree(state, functools.partial(self.staging.copy, _SHARDS_OWNER))
        frozen = {key: _freeze(self.staging, key, value) for key, value in (data or {}).items()}
        self.staging.prune()
        what = f"checkpoint {iteration_number} in {checkpointer.base_directory}"

        def save() -> Path | str | None:
            path = sharded.save(
                checkpointer,
                iteration_number,
                shards,
                frozen,
                group=group,
                retention=retention,
                storage_options=storage_options,
            )
            if path is not None and on_saved is not None:
                on_saved(path)
            return path

        self._submit(what, save)

    def save_record(
        self,
        record: Any,
        path: str | os.PathLike[str],
        write: Callable[[Record, str | os.PathLike[str]], Any] | None = None,
    ) -> None:
        """Snapshot ``record`` (or plain data) now and write it to ``path`` in the background
        with ``write(snapshot, path)`` (default ``Record.save``: atomic, fsynced). Waits for the
        previous save first."""
        self.wait()
        # One owner for every path: Lightning names each file anew (epoch=3-step=16.ckpt), and
        # keying by path would reallocate every buffer on every save.
        staged = _freeze(self.staging, _RECORD_OWNER, record, self._gate.stable())
        self.staging.prune()
        self._submit(f"record {path}", write or Record.save, staged, path)

    def _submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the writer thread once the snapshot's copies have landed; the
        writer thread makes the late host copies first, and the next step of a watched
        optimizer waits for them (and for late device copies)."""
        ready = self.staging.settle()
        late, self.staging.late = self.staging.late, []
        copied = threading.Event()
        if late or ready.late:
            self._gate.hold(copied, ready)

        def run() -> Any:
            try:
                with torch.no_grad():
                    for dst, src in late:  # beside the caller's next forward and backward
                        dst.copy_(src)
            finally:
                copied.set()
            ready.wait()  # device-to-host copies still in flight: nothing reads them before
            return fn(*args)

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=_WRITER_THREAD_NAME)
            self._pending = self._executor.submit(run)
            self._pending_what = what

    # -- waiting -----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a save is being written."""
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is durable; return what it returned.

        Re-raises the save's exception, once: a failure is reported exactly one time.
        """
        self._gate.release()
        with self._lock:
            pending, what = self._pending, self._pending_what
            self._pending = None
        if pending is None:
            if self._writer is not None:
                self._writer.check()
            return None
        error = pending.exception()
        if error is not None:
            error.add_note(f"(raised by the asynchronous save of {what})")
            raise error
        return pending.result()

    def close(self) -> None:
        """Wait for the write in flight, stop the writer thread, free the staging buffers and
        the writer threads' process group, and re-raise the write's error if it failed."""
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
                group, self._group = self._group, _NO_GROUP
            if executor is not None:
                executor.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
            self.staging.clear()
            if group not in (_NO_GROUP, None) and dist.is_initialized():
                # gone already if the default group was destroyed (that destroys every group)
                with contextlib.suppress(ValueError, RuntimeError):
                    dist.destroy_process_group(group)

    def __enter__(self) -> AsyncCheckpointSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
