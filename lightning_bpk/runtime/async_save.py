"""Asynchronous checkpoint saves: the training thread only copies tensors into reused buffers.

A synchronous save blocks training for the whole durable write (about 0.4-0.9 s per GiB on a
virtio disk, more with first-touch memory). :class:`AsyncCheckpointSaver` splits it in two:

1. **on the caller's thread**, each record is frozen: every tensor is copied into a *staging
   buffer* owned by the saver, and the rest is encoded now (``Record.to_content``) or, for a
   writer process, copied as it is where it can be (nested state, a small optimizer's:
   containers rebuilt, immutable leaves kept) and encoded by the child. The buffers are
   allocated on the first save and reused by every later one (keyed by data key and tensor
   name or path; one is reallocated only when that tensor's shape or dtype changes), so a save
   costs a memory copy, never a fresh clone of the model (which on these VMs costs ~10x more:
   fresh memory is slow to fault in);
2. **on one background writer thread**, the frozen records go through the unchanged synchronous
   path, e.g. :meth:`Checkpointer.save_checkpoint`: data written and fsynced, then the
   sentinel, then garbage collection, in that order. A sentinel therefore never names data
   that is not yet durable, and old checkpoints are only collected after the new one is
   complete. A value the format cannot store fails that write, raised as any write's failure
   is (below).

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
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_bpk import _device
from lightning_bpk._nested import copy_nested
from lightning_bpk.checkpointer import Checkpointer, Retention
from lightning_bpk.records.base import Record
from lightning_bpk.runtime import sharded
from lightning_bpk.runtime._staging import StagingArea, freeze, staged_tensors
from lightning_bpk.runtime._writer import WriterProcess
from lightning_bpk.runtime.overlap import StepGate

__all__ = [
    "AsyncCheckpointSaver",
]

# Name of the writer thread (visible in py-spy, faulthandler dumps and thread listings).
_WRITER_THREAD_NAME = "lightning_bpk-async-save"
# Staging owner of :meth:`AsyncCheckpointSaver.save_record` snapshots, whatever their path.
_RECORD_OWNER = "<record>"
# Staging owner of the shards of :meth:`AsyncCheckpointSaver.save_sharded`.
_SHARDS_OWNER = "<shards>"
# No process group made yet (None: made, and there is no distributed run).
_NO_GROUP = object()


def _shard_name(path: tuple) -> str:
    """The staging name of a DCP state dict's tensor: its keys, ``/model/net.0.weight``."""
    return "".join(f"/{key}" for key in path)


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
        self.staging = StagingArea(shared=process)
        # process=True: the commit runs in a writer process (lightning_bpk.runtime._writer)
        self._writer = WriterProcess() if process else None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_what = ""
        # the writer threads' process group of a sharded run (made by the first save_sharded)
        self._group: Any = _NO_GROUP
        self._lock = threading.Lock()  # guards _executor/_pending against a concurrent close()
        self._gate = StepGate()

    @classmethod
    def from_setting(cls, async_save: bool | str) -> AsyncCheckpointSaver | None:
        """The saver an ``async_save`` setting of the callback or the Fabric manager asks for:
        ``False`` none (synchronous saves), ``True`` a writer thread, ``"process"`` a writer
        process (``process=True``: the script needs an ``if __name__ == "__main__":`` guard, as
        any spawned process does). Anything else is a ``ValueError`` naming it."""
        if async_save is False or async_save is True:
            return cls() if async_save else None
        if async_save == "process":
            return cls(process=True)
        raise ValueError(
            f"async_save={async_save!r}: use False, True (a writer thread) or 'process' "
            "(a writer process)"
        )

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
        staged = {key: freeze(self.staging, key, value, stable) for key, value in data.items()}
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
            for name, tensor in staged_tensors(self.staging, key, value):
                pinned = _device.accelerated(tensor.device)
                wanted.append((key, name, tuple(tensor.shape), tensor.dtype, pinned))

        def shard(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            pinned = _device.accelerated(local.device)
            name = _shard_name(path)
            wanted.append((_SHARDS_OWNER, name, tuple(local.shape), local.dtype, pinned))
            return tensor

        copy_nested(shards or {}, shard)

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
        # every tensor staged (a DTensor as its local shard), any other leaf deep-copied: the
        # writer thread's DCP save pickles such leaves, after training changed them
        shards = copy_nested(
            state,
            lambda path, t: self.staging.copy(_SHARDS_OWNER, _shard_name(path), t),
            copy.deepcopy,
        )
        frozen = {key: freeze(self.staging, key, value) for key, value in (data or {}).items()}
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
        staged = freeze(self.staging, _RECORD_OWNER, record, self._gate.stable())
        self.staging.prune()
        self._submit(f"record {path}", write or Record.save, staged, path)

    def _submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the writer thread once the snapshot's copies have landed; the
        writer thread makes the late host copies first, and the next step of a watched
        optimizer waits for them (and for late device copies)."""
        ready = self.staging.settle()
        late, self.staging.late = list(self.staging.late.values()), {}
        copied = threading.Event()
        if late or ready.late:
            self._gate.hold(copied, ready)

        def run() -> Any:
            try:
                with torch.no_grad():
                    for copy in late:  # beside the caller's next forward and backward
                        copy.run()
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
