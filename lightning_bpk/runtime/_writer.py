"""The writer process: an asynchronous save's commit outside the training process's interpreter.

With ``AsyncCheckpointSaver(process=True)`` the staging buffers live in shared memory and the
saver's writer thread, instead of committing the snapshot itself, hands it to one child process
(spawned at the first save, kept for the next ones): every staging buffer is sent to the child
once (a handle to its shared memory, not its bytes), each save sends the checkpointer, the
iteration and the records with each tensor named by its buffer, offset, dtype and shape (a
record encoded at the save as its content; a :class:`Snapshot`, the loop state or a small
optimizer's, as its record's attributes, which the child encodes), and the child builds the
records over those buffers (it only reads them) and runs the ordinary
``Checkpointer.save_checkpoint``: data fsynced, then the sentinel, then garbage collection. The
planning, encoding and fsync bookkeeping of the commit so no longer compete with training for
the interpreter lock; the writer thread only waits on the pipe.

Guarantees, as for the thread writer: one save in flight (the writer thread waits for the
child's answer), errors re-raised by the next call (the child's exception itself when it
crosses the pipe, else a ``RuntimeError`` with its type, message and traceback). A child that dies
(SIGKILL, out of memory) fails the save it was writing with :class:`WriterProcessDied`, which
the next call raises; that checkpoint was never committed (the sentinel comes last), those
before it are untouched, and the next save starts a new child. A training process that dies
closes the pipe: the child finishes the save it is writing, if any, and exits.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as mp

from lightning_bpk import _device, burnpack
from lightning_bpk._nested import copy_nested
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.records.base import Record

# Name of the child (ps, py-spy).
_PROCESS_NAME = "lightning_bpk-writer"


class StagedRecord(Record):
    """A record's content frozen at snapshot time; saved as a record of the original kind."""

    def __init__(
        self,
        kind: str,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        metadata: Mapping[str, str],
    ) -> None:
        # instance attribute: this class registers no kind of its own
        self.kind = kind  # type: ignore[misc]
        self._frozen = (tensors, scalars, metadata)

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        return self._frozen


# A digest as a TensorEntry takes it: the text, or a provider asked once the bytes are copied.
Digest = str | Callable[[], str | None]


class Snapshot(Record):
    """A record's snapshot (:meth:`Record._snapshot <lightning_bpk.records.Record>`), encoded
    where it is written: on the writer thread, or in the writer process, which it is sent to as
    it is (:func:`_portable`). Its content gives each tensor a late copy made the digest taken
    as it was copied (:class:`~lightning_bpk.runtime._staging.LateCopy`), found by where the
    tensor's bytes lie and how many there are (whatever object the encoding wraps it in)."""

    def __init__(self, record: Record, digests: Mapping[tuple[int, int], Digest]) -> None:
        # instance attribute: this class registers no kind of its own
        self.kind = record.kind  # type: ignore[misc]
        self.record, self.digests = record, digests

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        tensors, scalars, metadata = self.record.to_content()
        if self.digests:
            tensors = {name: self._hashed(value) for name, value in tensors.items()}
        return tensors, scalars, metadata

    def _hashed(self, value: Any) -> Any:
        data = value.data if isinstance(value, burnpack.TensorEntry) else value
        if not isinstance(data, torch.Tensor) or not data.numel():
            return value
        digest = self.digests.get((data.data_ptr(), data.nbytes))
        if digest is None:
            return value
        if isinstance(value, burnpack.TensorEntry):
            return entry_with(value, data, digest)
        return burnpack.TensorEntry.from_tensor(value, digest=digest)


def entry_with(
    entry: burnpack.TensorEntry, data: Any, digest: Digest | None
) -> burnpack.TensorEntry:
    """``entry`` with ``data`` (its bytes, staged) and ``digest`` in place of its own."""
    return burnpack.TensorEntry(
        entry.dtype,
        entry.shape,
        data,
        param_id=entry.param_id,
        nbytes=entry.nbytes,
        torch_dtype=entry.torch_dtype,
        digest=digest,
    )


class _InBuffer(NamedTuple):
    """A snapshot's tensor as the writer process is sent it: where it lies in a staging buffer
    (``storage``: the buffer's, as :func:`_describe` names it), and its digest if known."""

    storage: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: str | None


def _portable(snapshot: Snapshot, buffers: Mapping[int, torch.Tensor]) -> tuple:
    """What the writer process is sent of ``snapshot``: its record's class and attributes, each
    staged tensor an :class:`_InBuffer` (plain data otherwise: containers and immutable
    leaves), so the child encodes it, not this process's writer thread."""

    def located(_: tuple, tensor: torch.Tensor) -> Any:
        described = _describe(tensor, buffers)
        if not (isinstance(described, tuple) and described[0] == "staged"):
            return tensor  # not in a staging buffer (none is, in a snapshot): sent as it is
        _, storage, offset, dtype, shape = described
        digest = snapshot.digests.get((tensor.data_ptr(), tensor.nbytes))
        if callable(digest):
            digest = digest()  # the late copies have run by now
        return _InBuffer(storage, offset, dtype, shape, digest if tensor.numel() else None)

    record = snapshot.record
    return type(record), copy_nested(vars(record), located)


def _unportable(sent: tuple, buffers: Mapping[int, torch.Tensor]) -> Snapshot:
    """:func:`_portable` undone in the child, over the buffers it was sent."""
    cls, attributes = sent
    digests: dict[tuple[int, int], Digest] = {}
    tensors: dict[_InBuffer, torch.Tensor] = {}  # a tensor held twice: one tensor again

    def rebuilt(leaf: Any) -> Any:
        if not isinstance(leaf, _InBuffer):
            return leaf
        tensor = tensors.get(leaf)
        if tensor is None:
            where = ("staged", leaf.storage, leaf.offset, leaf.dtype, leaf.shape)
            tensor = tensors[leaf] = _rebuild(where, buffers)
        if leaf.digest is not None:
            digests[tensor.data_ptr(), tensor.nbytes] = leaf.digest
        return tensor

    record = object.__new__(cls)
    vars(record).update(copy_nested(attributes, lambda _, tensor: tensor, rebuilt))
    return Snapshot(record, digests)


class WriterProcessDied(LightningBpkError, RuntimeError):
    """The writer process ended while it was writing a checkpoint (never committed)."""


def _describe(value: Any, buffers: Mapping[int, torch.Tensor]) -> Any:
    """A tensor in a staging buffer as ``("staged", buffer, byte offset, dtype, shape)``; a
    :class:`burnpack.TensorEntry` with its data so described; anything else as it is."""
    if isinstance(value, burnpack.TensorEntry):
        digest = value.digest() if callable(value.digest) else value.digest  # copied by now
        entry = (value.dtype, value.shape, value.param_id, value.nbytes, value.torch_dtype, digest)
        return ("entry", entry, _describe(value.data, buffers))
    raw = buffers.get(_device.storage_ptr(value)) if isinstance(value, torch.Tensor) else None
    if raw is None:
        return value
    offset = value.data_ptr() - raw.data_ptr()
    return ("staged", _device.storage_ptr(raw), offset, value.dtype, tuple(value.shape))


def _rebuild(value: Any, buffers: Mapping[int, torch.Tensor]) -> Any:
    """:func:`_describe` undone in the child, over the buffers it was sent."""
    if isinstance(value, tuple) and value and value[0] == "entry":
        (dtype, shape, param_id, nbytes, torch_dtype, digest) = value[1]
        data = _rebuild(value[2], buffers)
        return burnpack.TensorEntry(
            dtype,
            shape,
            data,
            param_id=param_id,
            nbytes=nbytes,
            torch_dtype=torch_dtype,
            digest=digest,
        )
    if isinstance(value, tuple) and value and value[0] == "staged":
        _, key, offset, dtype, shape = value
        count = int(torch.Size(shape).numel()) * dtype.itemsize
        return buffers[key][offset : offset + count].view(dtype).view(shape)
    return value


def _send_error(conn: Any, error: BaseException) -> None:
    """Send the child's ``error`` in two messages: its text (type, message, traceback), then
    the exception itself, or None when it does not pickle; the parent raises the exception, or
    when that does not arrive whole a RuntimeError with the text
    (:meth:`WriterProcess._failure`)."""
    text = "".join(traceback.format_exception(error))
    conn.send(("failed", f"{type(error).__name__}: {error} (in the writer process)\n{text}"))
    try:
        conn.send(error)
    except Exception:  # pickling failed before a byte was sent: the pipe is intact
        conn.send(None)


def _serve(conn: Any) -> None:
    """The child: take buffers and saves until the training process closes the pipe."""
    buffers: dict[int, torch.Tensor] = {}
    conn.send(("ready", None))  # imports done: the parent's start() returns
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as e:  # a message that does not unpickle here: the save fails
            _send_error(conn, e)
            continue
        if message[0] == "buffer":
            buffers[message[1]] = message[2]
            continue
        _, checkpointer, number, records, retention = message
        try:
            data: dict[str, Record] = {}
            for key, (form, sent) in records.items():
                if form == "snapshot":  # encoded here, by the checkpointer
                    data[key] = _unportable(sent, buffers)
                    continue
                kind, tensors, scalars, meta = sent
                data[key] = StagedRecord(
                    kind,
                    {n: _rebuild(t, buffers) for n, t in tensors.items()},
                    {n: burnpack.Scalar(*s) for n, s in scalars.items()},
                    meta,
                )
            if retention is None:
                path = checkpointer.save_checkpoint(number, data)
            else:
                path = checkpointer.save_checkpoint(number, data, retention=retention)
            conn.send(("ok", path))
        except BaseException as e:
            _send_error(conn, e)


class WriterProcess:
    """The training process's end of the writer process (used from the saver's writer thread
    only; :meth:`close` from the training thread once that thread is idle)."""

    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Any = None
        self._sent: dict[int, torch.Tensor] = {}  # buffers the child holds, by storage

    def save(
        self,
        checkpointer: Any,
        number: int,
        staged: Mapping[str, Any],
        buffers: list[torch.Tensor],
        retention: Any,
    ) -> Any:
        """Have the child commit ``staged`` (records whose tensors lie in ``buffers``, shared
        memory) as checkpoint ``number``; return its path, raise its error."""
        if self._process is None or not self._process.is_alive():
            self.start()
        by_storage = {_device.storage_ptr(raw): raw for raw in buffers}
        records: dict[str, tuple[str, Any]] = {}
        for key, record in staged.items():
            if isinstance(record, Snapshot):  # the child encodes it
                records[key] = ("snapshot", _portable(record, by_storage))
                continue
            tensors, scalars, metadata = record.to_content()
            described = {n: _describe(t, by_storage) for n, t in tensors.items()}
            plain = {n: (s.kind, s.value) for n, s in scalars.items()}  # Scalar: no pickle
            records[key] = ("content", (record.kind, described, plain, dict(metadata)))
        try:
            for storage, raw in by_storage.items():
                if self._sent.get(storage) is not raw:
                    self._conn.send(("buffer", storage, raw))
                    self._sent[storage] = raw
            self._conn.send(("save", checkpointer, number, records, retention))
            answer, value = self._conn.recv()
            if answer == "failed":
                error = self._failure(value)
        except (EOFError, OSError, BrokenPipeError) as e:
            code = self._stopped()
            raise WriterProcessDied(
                f"the writer process died (exit code {code}) while writing checkpoint "
                f"{number}: it was not committed; checkpoints committed before it are untouched"
            ) from e
        if answer == "failed":
            raise error
        return value

    def _failure(self, text: str) -> BaseException:
        """The child's error after its ``text`` (:func:`_send_error`): the exception itself, or
        a RuntimeError with the text when it did not pickle there or does not unpickle here."""
        try:
            error = self._conn.recv()
        except (EOFError, OSError):
            raise
        except Exception:  # read whole, then failed to unpickle: the pipe is intact
            error = None
        return error if isinstance(error, BaseException) else RuntimeError(text)

    def start(self) -> None:
        """Spawn the child (seconds: it imports torch, and the main module as spawn does), ending
        one that ended or runs already."""
        self._stopped()
        context = mp.get_context("spawn")
        ours, theirs = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(theirs,), name=_PROCESS_NAME, daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        try:  # spawning imports torch and the main module: seconds, on the writer thread
            ours.recv()
        except (EOFError, OSError) as e:
            code = self._stopped()
            raise WriterProcessDied(f"the writer process did not start (exit code {code})") from e

    def _stopped(self) -> int | None:
        """Forget a child that ended (or end it); its exit code."""
        process, self._process = self._process, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._sent.clear()
        if process is None:
            return None
        process.join(timeout=60)
        return process.exitcode

    def check(self) -> None:
        """Raise :class:`WriterProcessDied` if the child ended while idle (killed between two
        saves): the next save says so, once, and the save after it starts a new child."""
        if self._process is None or self._process.is_alive():
            return
        code = self._stopped()
        raise WriterProcessDied(
            f"the writer process died (exit code {code}) between two saves: every checkpoint "
            "it committed is intact; the next save starts a new writer process"
        )

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first save)."""
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        """Close the pipe; the child exits once it has nothing left to write."""
        self._stopped()
