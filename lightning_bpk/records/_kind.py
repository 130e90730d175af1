"""What a record file says it is, and what reading one raises: the kind tag, the kinds known,
the error family.

Below both :mod:`lightning_bpk.records.base` (the :class:`~lightning_bpk.records.Record`
classes) and :mod:`lightning_bpk.records.files` (a record at a path or URL, the one reader and
writer of record files), so the classes save and load through ``files`` and ``files`` raises
the same errors and builds the same records. Users import these names from
:mod:`lightning_bpk.records`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

from lightning_bpk import burnpack
from lightning_bpk.errors import LightningBpkError

__all__ = [
    "KINDS",
    "RECORD_KIND_KEY",
    "RecordChecksumError",
    "RecordError",
    "RecordErrorKind",
    "Stored",
    "record_from_pack",
]

RECORD_KIND_KEY = "lightning_bpk/record"
"""The metadata entry that names a record's kind (``module``, ``optimizer``, ...)."""

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


class Stored(Protocol):
    """What the record-file reader returns and the writer takes, as a record shows it: its kind
    tag and its parts as written (every :class:`~lightning_bpk.records.Record`), so ``files``
    needs no import of the record classes, which save and load through it."""

    @property
    def kind(self) -> str:
        """The record's kind tag (a class constant of every record class)."""
        ...

    def content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], dict[str, str]]:
        """``(tensors, scalars, metadata)`` exactly as written."""
        ...


KINDS: dict[str, Any] = {}
"""Record kind -> its ``Record`` class: every subclass with a ``kind`` registers itself here."""


def record_from_pack(pack: burnpack.Pack) -> Any:
    """The record held by an open pack (a file, or an object read into memory), choosing the
    class from its kind tag."""
    kind = pack.metadata.get(RECORD_KIND_KEY)
    record_cls = KINDS.get(kind) if kind is not None else None
    if record_cls is None:
        raise RecordError(
            "validation",
            f"{pack.source} has no known record kind ({RECORD_KIND_KEY} = {kind!r})",
        )
    return record_cls._from_checked_pack(pack)
