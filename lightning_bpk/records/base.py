"""What every record shares: bytes/file round trips, the record-kind tag and :class:`RecordError`.

A record is one burnpack file. Its kind (``module``, ``optimizer``, ``lr_scheduler``, ``state``)
is written to the metadata entry ``lightning_bpk/record``, so :func:`load_record` can open any
record without being told what it is. Burn ignores unknown metadata, so the tag costs nothing in
compatibility; files Burn wrote carry no tag and load through the class the caller names.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from lightning_bpk import _device, burnpack, state
from lightning_bpk._nested import copy_nested
from lightning_bpk.records import files
from lightning_bpk.records._kind import (
    KINDS,
    RECORD_KIND_KEY,
    RecordChecksumError,
    RecordError,
    RecordErrorKind,
)
from lightning_bpk.records._kind import record_from_pack as _record_from_pack

__all__ = [
    "Record",
    "RecordChecksumError",
    "RecordError",
    "RecordErrorKind",
    "StateRecord",
    "load_record",
]

R = TypeVar("R", bound="Record")
# Where a snapshot puts a tensor (see Record._snapshot): its path in the record -> the copy.
_Stage = Callable[[tuple, torch.Tensor], torch.Tensor]


def _class_name(obj: object) -> str:
    """``module.qualname`` of ``obj``'s class, as records store it (``torch.optim.adam.Adam``)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Record:
    """Base class: subclasses say how they map to burnpack content and back."""

    kind: ClassVar[str]
    _registry: ClassVar[dict[str, Any]] = KINDS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            KINDS[cls.kind] = cls

    # -- what subclasses provide --

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        """``(tensors, scalars, metadata)`` to write; tensors may be ``burnpack.TensorEntry``."""
        raise NotImplementedError

    @classmethod
    def from_pack(cls: type[R], pack: burnpack.Pack) -> R:
        """Build the record from an open pack (tensors may stay zero-copy views of it)."""
        raise NotImplementedError

    def _snapshot(self, stage: _Stage) -> Record | None:
        """This record as it is now, for a writer to encode later: a copy whose
        :meth:`to_content` (run there) gives the content this one gives now, every tensor it
        holds replaced by ``stage(path, tensor)`` (a copy the caller owns; ``stage`` may raise
        to decline, e.g. for a tensor it must place by its offset in the file), every container
        copied. An asynchronous save to a writer process takes it on the training thread, so
        the encoding (names, scalars, the structure's JSON) leaves the training process.

        None where the record is encoded now: by default (a module's tensors are named as they
        are, so there is little to move), and where it holds a leaf that is not plain data or a
        tensor (only the codec can tell whether it stores, and its error or warning belongs to
        the save that met it)."""
        return None

    # -- shared behaviour --

    def content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], dict[str, str]]:
        """``(tensors, scalars, metadata)`` exactly as written: :meth:`to_content` plus the kind
        tag. For writers that need the parts (another format, a path without suffix rule)."""
        tensors, scalars, metadata = self.to_content()
        return tensors, scalars, {**metadata, RECORD_KIND_KEY: self.kind}

    def to_bytes(self) -> bytes:
        """The record as burnpack bytes."""
        tensors, scalars, metadata = self.content()
        try:
            return burnpack.dumps(tensors, scalars=scalars, metadata=metadata)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e

    def save(
        self, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
    ) -> Path | str:
        """Write the record durably and whole at a path or URL (``.bpk`` added when ``path``
        has no suffix; ``storage_options`` go to fsspec) through
        :func:`lightning_bpk.records.files.write_record`; returns where it was written. A
        failed write (a full disk) is a :class:`RecordError` of kind ``"io"`` and leaves an
        existing file as it was."""
        try:
            return files.write_record(self, files.with_bpk_suffix(path), storage_options)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e

    @classmethod
    def from_bytes(
        cls: type[R], data: bytes | bytearray | memoryview, *, device: str | torch.device = "cpu"
    ) -> R:
        """Parse a record from burnpack bytes, its tensors on ``device`` (see :meth:`load`)."""
        target = _device.target_device(device)
        try:
            pack = burnpack.loads(data)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e
        return cls._from_checked_pack(pack).to(target)

    @classmethod
    def load(
        cls: type[R],
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        storage_options: Mapping[str, Any] | None = None,
    ) -> R:
        """Read a record file at a path or URL (Burn's rule: ``.bpk`` is tried when ``path``
        has no suffix; ``storage_options`` go to fsspec), through
        :func:`lightning_bpk.records.files.open_record`.

        ``device``: where its tensors go, ``cpu`` or a CUDA device (checked before the file is
        read; a ``ValueError`` names any other). Checksums are verified on the host first, then
        the tensors are copied to a CUDA device through reused pinned bounce buffers."""
        target = _device.target_device(device)
        with files.open_record(path, storage_options) as pack:
            return cls._from_checked_pack(pack).to(target)

    def to(self: R, device: str | torch.device) -> R:
        """This record with its tensors on ``device``: ``cpu`` (the record itself: a loaded
        record's tensors are on the host) or a CUDA device, where every tensor it holds (in
        attributes, nested in dicts, lists and tuples) is replaced by a copy, a tensor held
        twice copied once. Any other device is a ``ValueError`` naming it.

        >>> record = StateRecord({"w": torch.ones(2)})
        >>> record.to("cpu") is record
        True
        """
        target = _device.target_device(device)
        return self if target.type == "cpu" else self._moved_to(target)

    def _moved_to(self: R, target: torch.device) -> R:
        """This record, every tensor it holds replaced by a copy on the checked ``target``."""
        vars(self).update(_device._moved(dict(vars(self)), target))
        return self

    @classmethod
    def _from_checked_pack(cls: type[R], pack: burnpack.Pack) -> R:
        found = pack.metadata.get(RECORD_KIND_KEY)
        if found is not None and found != cls.kind:
            raise RecordError(
                "validation", f"{pack.source} holds a {found!r} record, not {cls.kind!r}"
            )
        try:
            return cls.from_pack(pack)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e
        except state.StateError as e:
            raise RecordError("validation", f"{pack.source}: {e}") from e


def _user_metadata(pack: burnpack.Pack) -> dict[str, str]:
    """The pack's metadata without entries this package reserves for itself."""
    return {k: v for k, v in pack.metadata.items() if k != RECORD_KIND_KEY}


class StateRecord(Record):
    """Nested plain data (no pickle) as one record: Lightning's loop counters, RNG states, ...

    ``lenient``: a value pickle-free storage cannot hold (a user object in a callback's state)
    is left out, with a warning naming where it sat, instead of failing the record (a run's
    loop state: the run goes on; it loads as any state record).

    >>> StateRecord.from_bytes(StateRecord({"epoch": 3}).to_bytes()).value
    {'epoch': 3}
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     loop = StateRecord({"epoch": 1, "cb": {"obj": object()}}, lenient=True)
    ...     _ = loop.to_content()
    >>> "$['cb']['obj']" in str(caught[0].message)
    True
    """

    kind = "state"

    def __init__(self, value: Any, *, lenient: bool = False) -> None:
        self.value = value
        self.lenient = lenient

    def _snapshot(self, stage: _Stage) -> Record | None:
        odd: list[Any] = []
        value = copy_nested(self.value, stage, odd.append)
        if odd:  # a leaf only the codec can judge (a user object): encoded now, as it raises
            return None
        snapshot = copy.copy(self)
        snapshot.value = value
        return snapshot

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        dropped: list[str] | None = [] if self.lenient else None
        try:  # inline: the loop state in one pass
            content = state.encode(self.value, inline=True, dropped=dropped)
        except state.StateError as e:
            raise RecordError("validation", str(e)) from e
        for problem in dropped or ():
            warnings.warn(f"left out of the checkpoint: {problem}", stacklevel=2)
        return content.tensors, content.scalars, content.metadata

    @classmethod
    def from_pack(cls, pack: burnpack.Pack) -> StateRecord:
        return cls(state.decode(pack))


def load_record(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> Record:
    """Open any record this package wrote, at a path or URL, choosing the class from its kind
    tag; its tensors on ``device`` (see :meth:`Record.load`)."""
    target = _device.target_device(device)
    with files.open_record(path, storage_options) as pack:
        record: Record = _record_from_pack(pack)
        return record.to(target)
