"""Staging buffers: where an asynchronous save's snapshot lives while the writer reads it.

:class:`StagingArea` holds reused CPU buffers (shared memory for a writer process, pinned memory
for a GPU's tensors) keyed by owner and tensor name; :func:`freeze` snapshots a record into it,
each large tensor placed where its bytes lie in the file the writer will write (so an O_DIRECT
writer needs no copy) or, for nested state and small records written by a writer process, staged
under their paths and left for the child to encode.
:mod:`lightning_bpk.runtime.async_save` owns one area per saver.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from lightning_bpk import _device, burnpack
from lightning_bpk.records.base import Record, StateRecord
from lightning_bpk.runtime._writer import Snapshot, StagedRecord, entry_with

# A staging buffer of at least this many bytes starts where its bytes lie within a page of
# the file written from it (a page of room per buffer), so an O_DIRECT writer writes it with
# no copy; below it a copy into the writer's own buffers costs little.
PLACED_MIN = 8 * 1024 * 1024
PAGE = mmap.PAGESIZE


# Bytes of a late copy hashed per piece: the piece is still in cache when it is hashed.
_HASHED_CHUNK = 1024 * 1024


class LateCopy:
    """A host copy left to the writer thread (:attr:`StagingArea.late`): ``src`` into the
    staging buffer ``dst``, hashed as it is copied, so the file's checksum of the tensor
    (:attr:`digest`, an xxh3-64 hex digest) costs no second pass over its bytes."""

    __slots__ = ("digest", "dst", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src
        self.digest: str | None = None  # set by run()

    def run(self) -> None:
        """Copy, piece by piece, each piece hashed right after it lands (one pass over the
        bytes; xxhash releases the interpreter lock); a source that is not contiguous, or of
        another dtype, is copied whole, then hashed."""
        dst, src = self.dst, self.src
        hasher = xxhash.xxh3_64()
        if not (src.is_contiguous() and src.dtype == dst.dtype and src.shape == dst.shape):
            dst.copy_(src)
            hasher.update(burnpack.tensor_bytes(dst))
        else:
            into = dst.reshape(-1).view(torch.uint8)
            out_of = src.reshape(-1).view(torch.uint8)
            for start in range(0, into.numel(), _HASHED_CHUNK):
                piece = into[start : start + _HASHED_CHUNK]
                piece.copy_(out_of[start : start + _HASHED_CHUNK])
                hasher.update(burnpack.tensor_bytes(piece))
        self.digest = hasher.hexdigest()

    def result(self) -> str | None:
        """The digest once :meth:`run` ran (what a written entry asks: see ``TensorEntry``)."""
        return self.digest


@dataclass
class _Slot:
    """One staging buffer: ``view`` (the tensor a snapshot holds) inside ``raw``, the memory
    (touched once, reused; pinned when it stages a tensor of an accelerator); for a ``DTensor``,
    ``shard`` is the DTensor around ``view``."""

    raw: torch.Tensor
    view: torch.Tensor
    shard: DTensor | None = None


class StagingArea:
    """CPU buffers that snapshots are copied into, allocated once and reused.

    Buffers are keyed by ``(owner, tensor name)``; a buffer is replaced only when the tensor's
    shape or dtype changes, and buffers no snapshot used last time are dropped by :meth:`prune`.

    A tensor on an accelerator (CUDA) is staged in pinned memory by a non-blocking copy on a
    side stream (:class:`lightning_bpk._device.DeviceToHost`): nothing of it is copied on the
    device, and the buffers are complete only once the :meth:`settle` after the snapshot has
    been waited on (the writer does, before it reads).

    >>> area = StagingArea()
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
        # host copies left to the writer thread (parameters, optimizer state), by their key
        self.late: dict[tuple[str, str], LateCopy] = {}
        # owners whose record declined a snapshot for a tensor it holds (see freeze): encoded
        # at the save from then on, not first staged by path again at every save
        self.declined: set[str] = set()

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
        a buffer of :data:`PLACED_MIN` bytes or more then starts at the same offset within a
        memory page, so an ``O_DIRECT`` writer writes it from where it lies, with no copy.

        The one place where a snapshot's bytes are copied (a device's tensors too: the copy
        lands in host memory, pinned, and is complete once :meth:`settle`'s result is waited
        on). ``stable``: the storages only the next optimizer step changes
        (:meth:`~lightning_bpk.runtime.overlap.StepGate.stable`): a tensor in one is copied
        late (:mod:`lightning_bpk.runtime.overlap`), a host tensor's copy left in :attr:`late`
        (a :class:`LateCopy` under ``(owner, name)``)."""
        key = (owner, name)
        # detached, the source records nothing for autograd: no no_grad() block (a few us a
        # tensor, at every save)
        source = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        pinned = _device.on_accelerator(source)
        slot = self._place(key, source.shape, source.dtype, at, pinned)
        late = bool(stable) and _device.storage_ptr(source) in stable
        if late and not pinned:
            self.late[key] = LateCopy(slot.view, source)
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
        slot = self._slots.get(key)
        if (
            at is None
            and slot is not None
            and slot.view.shape == shape
            and slot.view.dtype == dtype
            and slot.view.data_ptr() == slot.raw.data_ptr()
            and (not pinned or slot.raw.is_pinned())
        ):
            return slot  # as last time: the steady state, at every save
        nbytes = shape.numel() * dtype.itemsize
        if (
            slot is None
            or slot.view.dtype != dtype
            or slot.raw.numel() < nbytes
            or (pinned and not slot.raw.is_pinned())
        ):
            room = PAGE if nbytes >= PLACED_MIN else 0
            raw = _device.host_buffer(nbytes + room, pinned=pinned and not self.shared)
            if self.shared:
                # Touched first, then moved into shared memory (one copy fills every page):
                # O_DIRECT writes from pages that were instead faulted in through the shared
                # mapping ran 2-3x slower here (288 MiB: ~630 ms against ~200 ms).
                raw.zero_()
                raw.share_memory_()
            slot = self._slots[key] = _Slot(raw, raw[:nbytes].view(dtype).view(shape))
            self.allocations += 1
        start = 0
        if at is not None and slot.raw.numel() >= nbytes + PAGE:
            start = (at - slot.raw.data_ptr()) % PAGE
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
            if self.allocations != before and not self.shared:  # shared: touched in _place
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
    area: StagingArea,
    owner: str,
    name: str,
    value: Any,
    at: int | None = None,
    stable: frozenset[int] = frozenset(),
) -> Any:
    """A tensor or :class:`burnpack.TensorEntry` with its bytes moved into staging (placed for
    file offset ``at``, late when in ``stable``: see :meth:`StagingArea.copy`)."""
    if isinstance(value, torch.Tensor):
        view = area.copy(owner, name, value, at, stable)
        late = _late_digest(area, owner, name, view)
        return view if late is None else burnpack.TensorEntry.from_tensor(view, digest=late)
    if not isinstance(value, burnpack.TensorEntry):
        return value  # not a tensor: the writer reports it as the synchronous path would
    data = value.data
    if callable(data) and not isinstance(data, torch.Tensor):
        data = data()  # a deferred provider reads live state: call it now, not on the writer
    digest = value.digest
    if isinstance(data, torch.Tensor):
        data = area.copy(owner, name, data, at, stable)
        digest = _late_digest(area, owner, name, data) or digest
    elif not isinstance(data, bytes):
        data = bytes(data)  # bytearray/memoryview may change under the writer
    return entry_with(value, data, digest)


def _late_digest(
    area: StagingArea, owner: str, name: str, view: Any
) -> Callable[[], str | None] | None:
    """The digest provider of ``view`` when :meth:`StagingArea.copy` left it to a late copy,
    which hashes it as it copies (None: copied now, the writer hashes it)."""
    late = area.late.get((owner, name))
    return late.result if late is not None and late.dst is view else None


class _Declined(Exception):
    """A tensor a snapshot does not stage by its path: one of :data:`PLACED_MIN` bytes or more,
    whose buffer its offset in the file places, or one the codec refuses (not strided), whose
    error the save itself raises (see :func:`freeze`)."""


def freeze(
    area: StagingArea, owner: str, value: Any, stable: frozenset[int] = frozenset()
) -> Record:
    """Snapshot a record (or plain data, as a :class:`StateRecord`) into ``area`` (what lies in
    ``stable`` copied late).

    The result shares no mutable memory with ``value``: tensors live in staging buffers,
    containers are copied, scalars and strings are immutable.

    For a writer process (``area.shared``), a record that offers a snapshot
    (:meth:`Record._snapshot`: nested state, an optimizer's, of plain data and tensors) and
    holds no tensor of :data:`PLACED_MIN` bytes is returned as that snapshot, each tensor staged
    under its path in the record: the child encodes it (names, scalars, the structure's JSON),
    outside this interpreter, so what the codec alone refuses (a dict key of another type, a
    dtype the format lacks) fails the write. Any other record, and every record for a writer
    thread, is encoded now, raising here what it cannot store, each tensor staged under its
    name in the file and a large one placed where its bytes lie in the file. (A writer
    thread's encoding would hold the interpreter lock training waits for: on the digits example
    the whole loop took ~1.2 ms a save longer that way, for ~1.1 ms less blocked in the save.)
    """
    record = value if isinstance(value, Record) else StateRecord(value)
    snapshot = _snapshot(area, owner, record, stable) if area.shared else None
    if snapshot is not None:
        return snapshot
    tensors, scalars, metadata = record.to_content()
    at = _offsets(StagedRecord(record.kind, tensors, scalars, metadata))
    frozen = {
        name: _freeze_entry(area, owner, name, t, at.get(name), stable)
        for name, t in tensors.items()
    }
    return StagedRecord(record.kind, frozen, dict(scalars), dict(metadata))


def _snapshot(
    area: StagingArea, owner: str, record: Record, stable: frozenset[int]
) -> Record | None:
    """``record``'s snapshot, its tensors staged under their paths, to be encoded by the writer
    (:class:`~lightning_bpk.runtime._writer.Snapshot`); None when :func:`_by_path` gives none
    (then the staging it took is left unread: its late copies are dropped)."""
    names: list[str] = []
    digests: dict[tuple[int, int], Callable[[], str | None]] = {}

    def put(name: str, tensor: torch.Tensor) -> torch.Tensor:
        names.append(name)
        view = area.copy(owner, name, tensor, None, stable)
        digest = _late_digest(area, owner, name, view)
        if digest is not None and view.numel():
            digests[view.data_ptr(), view.nbytes] = digest
        return view

    snapshot = _by_path(area, owner, record, put)
    if snapshot is None:
        for name in names:
            area.late.pop((owner, name), None)
        return None
    return Snapshot(snapshot, digests)


def _by_path(
    area: StagingArea, owner: str, record: Record, put: Callable[[str, torch.Tensor], torch.Tensor]
) -> Record | None:
    """:meth:`Record._snapshot` with each tensor replaced by ``put(name, tensor)``, ``name``
    its path in the record (a tensor held twice is put once); None when the record offers no
    snapshot or holds a tensor it declines (:class:`_Declined`). A decline is remembered in
    :attr:`StagingArea.declined`: a large tensor stays large, so ``owner``'s later calls give
    None at once rather than staging its small tensors by path again at every save."""
    if owner in area.declined:
        return None
    staged: dict[int, torch.Tensor] = {}

    def stage(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        view = staged.get(id(tensor))
        if view is not None:
            return view
        if tensor.layout != torch.strided or _nbytes(tensor) >= PLACED_MIN:
            raise _Declined
        # the path's repr: one name per path, never a file's name (those never start with "(")
        view = staged[id(tensor)] = put(repr(path), tensor)
        return view

    try:
        return record._snapshot(stage)
    except _Declined:
        area.declined.add(owner)
        return None


def staged_tensors(area: StagingArea, owner: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs :func:`freeze` stages for ``value`` under ``owner`` in
    ``area`` (what a saver allocates ahead: :meth:`StagingArea.reserve`)."""
    record = value if isinstance(value, Record) else StateRecord(value)
    found: list[tuple[str, torch.Tensor]] = []

    def put(name: str, tensor: torch.Tensor) -> torch.Tensor:
        found.append((name, tensor))
        return tensor

    if area.shared and _by_path(area, owner, record, put) is not None:
        return found
    pairs = []
    for name, entry in record.to_content()[0].items():
        tensor = entry.data if isinstance(entry, burnpack.TensorEntry) else entry
        if isinstance(tensor, torch.Tensor):
            pairs.append((name, tensor))
    return pairs


def _offsets(record: Record) -> dict[str, int]:
    """The file offset of each tensor of ``record`` that is staged where it lies in the file
    (:data:`PLACED_MIN` bytes or more): the writer plans the same content the same way. No
    plan when there is none (a few small tensors: nothing to gain)."""
    tensors, scalars, metadata = record.content()
    if not any(_nbytes(t) >= PLACED_MIN for t in tensors.values()):
        return {}
    at = burnpack.offsets(tensors, metadata=metadata, scalars=scalars)
    return {name: at[name] for name, t in tensors.items() if _nbytes(t) >= PLACED_MIN}


def _nbytes(value: Any) -> int:
    if isinstance(value, burnpack.TensorEntry):
        return value.nbytes
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
