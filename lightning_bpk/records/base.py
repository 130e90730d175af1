"""What every record shares: bytes/file round trips, the record-kind tag and :class:`RecordError`.

A record is one burnpack file. Its kind (``module``, ``optimizer``, ``lr_scheduler``, ``state``)
is written to the metadata entry ``lightning_bpk/record``, so :func:`load_record` can open any
record without being told what it is. Burn ignores unknown metadata, so the tag costs nothing in
compatibility; files Burn wrote carry no tag and load through the class the caller names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch

from lightning_bpk import _device, burnpack, state
from lightning_bpk.errors import LightningBpkError

__all__ = [
    "Record",
    "RecordChecksumError",
    "RecordError",
    "RecordErrorKind",
    "StateRecord",
    "load_record",
]

RECORD_KIND_KEY = "lightning_bpk/record"
"""The metadata entry that names a record's kind (``module``, ``optimizer``, ...)."""

R = TypeVar("R", bound="Record")


RecordErrorKind = Literal["io", "validation", "checksum"]
"""What :attr:`RecordError.kind` says went wrong: the file could not be read or written (``io``),
its content is not a valid record (``validation``), or its bytes changed (``checksum``)."""
_LABELS: dict[str, str] = {
    "io": "Record I/O error",
    "validation": "Record validation error",
    "checksum": "Record checksum error",
}


class RecordError(LightningBpkError):
    """A record could not be read, written or applied.

    ``kind`` is ``"io"`` (the file or its bytes), ``"validation"`` (content that does not fit
    the target) or ``"checksum"`` (bytes that fail their checksum: always a
    :class:`RecordChecksumError`); ``problems`` lists every problem found, sorted, and the
    message shows them all.
    """

    kind: RecordErrorKind

    def __init__(self, kind: RecordErrorKind, problems: str | Iterable[str]) -> None:
        if kind not in ("io", "validation") and not (
            kind == "checksum" and isinstance(self, RecordChecksumError)
        ):
            raise ValueError(f"RecordError kind must be 'io' or 'validation', not {kind!r}")
        self.kind = kind
        self.problems = sorted([problems] if isinstance(problems, str) else problems)
        super().__init__(f"{_LABELS[kind]}: " + "; ".join(self.problems))

    @classmethod
    def from_format_error(cls, error: burnpack.BurnpackError) -> RecordError:
        """The record error for a failure of the format layer: a checksum failure stays one
        (:class:`RecordChecksumError`), anything else is an ``"io"`` error."""
        if isinstance(error, burnpack.ChecksumError):
            return RecordChecksumError(str(error))
        return RecordError("io", str(error))


class RecordChecksumError(RecordError, burnpack.ChecksumError):
    """Stored bytes fail their checksum: the file is damaged (not missing, not mismatched).

    Both a :class:`RecordError` (kind ``"checksum"``) and a
    :class:`~lightning_bpk.burnpack.ChecksumError`, so ``except burnpack.ChecksumError`` catches
    a damaged tensor whether a pack, a record or a checkpoint load found it.
    """

    def __init__(self, problems: str | Iterable[str]) -> None:
        super().__init__("checksum", problems)


def _class_name(obj: object) -> str:
    """``module.qualname`` of ``obj``'s class, as records store it (``torch.optim.adam.Adam``)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Record:
    """Base class: subclasses say how they map to burnpack content and back."""

    kind: ClassVar[str]
    _registry: ClassVar[dict[str, type[Record]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            Record._registry[cls.kind] = cls

    # -- what subclasses provide --

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        """``(tensors, scalars, metadata)`` to write; tensors may be ``burnpack.TensorEntry``."""
        raise NotImplementedError

    @classmethod
    def from_pack(cls: type[R], pack: burnpack.Pack) -> R:
        """Build the record from an open pack (tensors may stay zero-copy views of it)."""
        raise NotImplementedError

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

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the record atomically (``.bpk`` added when ``path`` has no suffix)."""
        tensors, scalars, metadata = self.content()
        try:
            return burnpack.write(path, tensors, scalars=scalars, metadata=metadata)
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
        cls: type[R], path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
    ) -> R:
        """Read a record file (Burn's rule: ``.bpk`` is tried when ``path`` has no suffix).

        ``device``: where its tensors go, ``cpu`` or a CUDA device (checked before the file is
        read; a ``ValueError`` names any other). Checksums are verified on the host first, then
        the tensors are copied to a CUDA device through reused pinned bounce buffers."""
        target = _device.target_device(device)
        try:
            pack = burnpack.read(path)
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e
        with pack:
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

    >>> StateRecord.from_bytes(StateRecord({"epoch": 3}).to_bytes()).value
    {'epoch': 3}
    """

    kind = "state"

    def __init__(self, value: Any) -> None:
        self.value = value

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        try:
            content = state.encode(self.value)
        except state.StateError as e:
            raise RecordError("validation", str(e)) from e
        return content.tensors, content.scalars, content.metadata

    @classmethod
    def from_pack(cls, pack: burnpack.Pack) -> StateRecord:
        return cls(state.decode(pack))


def load_record(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> Record:
    """Open any record this package wrote, choosing the class from its kind tag; its tensors
    on ``device`` (see :meth:`Record.load`)."""
    target = _device.target_device(device)
    try:
        pack = burnpack.read(path)
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    with pack:
        return _record_from_pack(pack).to(target)


def _record_from_pack(pack: burnpack.Pack) -> Record:
    """The record held by an open pack (a file, or an object read into memory), choosing the
    class from its kind tag."""
    kind = pack.metadata.get(RECORD_KIND_KEY)
    record_cls = Record._registry.get(kind) if kind is not None else None
    if record_cls is None:
        raise RecordError(
            "validation",
            f"{pack.source} has no known record kind ({RECORD_KIND_KEY} = {kind!r})",
        )
    return record_cls._from_checked_pack(pack)
