"""What the burnpack reader and writer share: format constants, errors, scalars, dtypes."""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from lightning_bpk.errors import LightningBpkError

__all__ = [
    "CHECKSUM_PREFIX",
    "BurnpackError",
    "BurnpackIOError",
    "ChecksumError",
    "DType",
    "HeaderError",
    "MagicError",
    "MetadataError",
    "Scalar",
    "ScalarKind",
    "SizeMismatchError",
    "TensorNotFoundError",
    "ValidationError",
    "VersionError",
]


# --- Format constants (Burn's values; the reason for each is beside it) -------------------------

_MAGIC = 0x4255524E  # "BURN" as a little-endian u32, so the file starts with b"NRUB"
_MAGIC_BYTES = _MAGIC.to_bytes(4, "little")
_FORMAT_VERSION = 1  # the only version Burn writes; readers reject anything newer
HEADER_SIZE = 10  # magic u32 + version u16 + metadata_size u32
TENSOR_ALIGNMENT = 256  # data section and every tensor start are 256-byte aligned (mmap/SIMD)
MAX_METADATA_SIZE = 100 * 1024 * 1024  # checked before allocating: a header cannot demand 4 GiB
_MAX_TENSOR_COUNT = 100_000  # bounds the work of parsing a hostile index
_MAX_TENSOR_SIZE = 10 * 1024**3  # one tensor at most 10 GiB, as Burn on 64-bit targets
_MAX_CBOR_DEPTH = 128  # nesting limit of the metadata decoder (stack safety)
_MAX_JSON_DEPTH = 128  # default nesting limit of JSON held in a metadata value (stack safety)
MAX_FILE_SIZE = 100 * 1024**3  # larger files are refused before anything is mapped
MAX_RANK = 64  # no real tensor has more dimensions; bounds shape parsing

CHECKSUM_PREFIX = "lightning_bpk/xxh3/"
"""The reserved metadata prefix of the per-tensor checksums: ``lightning_bpk/xxh3/<tensor name>``
maps to the tensor's xxh3-64 digest as 16 hex digits. Burn ignores these entries; this reader
verifies them, and refuses a user metadata key that starts with it."""
_CHECKSUM_PLACEHOLDER = "0" * 16  # same length as a real digest, so metadata size is known upfront
_HEX_DIGITS = frozenset("0123456789abcdef")


def _is_digest(text: str) -> bool:
    """True for what ``xxh3_64_hexdigest`` produces: 16 lowercase hex digits."""
    return len(text) == len(_CHECKSUM_PLACEHOLDER) and _HEX_DIGITS.issuperset(text)


_I64_MIN, _I64_MAX, _U32_MAX, _U64_MAX = -(2**63), 2**63 - 1, 2**32 - 1, 2**64 - 1

# --- Errors -------------------------------------------------------------------------------------


class BurnpackError(LightningBpkError):
    """Base class of every error raised while reading or writing a burnpack."""


class HeaderError(BurnpackError):
    """The input is shorter than its header or than the metadata the header announces."""


class MagicError(BurnpackError):
    """The first four bytes are not ``NRUB``: this is not a burnpack file."""


class VersionError(BurnpackError):
    """The header names a format version this reader does not understand."""


class MetadataError(BurnpackError):
    """The CBOR metadata is malformed, too deep, or does not follow Burn's schema."""


class ValidationError(BurnpackError):
    """A limit is exceeded or offsets, shapes and sizes are inconsistent."""


class TensorNotFoundError(BurnpackError):
    """The pack has no tensor of the requested name."""


class ChecksumError(BurnpackError):
    """A tensor's bytes do not match the checksum recorded when it was written."""


class SizeMismatchError(BurnpackError):
    """A deferred tensor produced a different number of bytes than it declared."""


class BurnpackIOError(BurnpackError, OSError):
    """A file could not be opened, read, written or renamed."""


# --- Scalars ------------------------------------------------------------------------------------

ScalarKind = str
"""The kind of a :class:`Scalar`: ``"Int"``, ``"UInt"``, ``"Float"`` or ``"Bool"``."""


class Scalar:
    """A typed scalar as Burn stores it: ``Int`` (i64), ``UInt`` (u64), ``Float`` (f64), ``Bool``.

    >>> Scalar.UInt(42) == Scalar.UInt(42), Scalar.UInt(42) == Scalar.Int(42)
    (True, False)
    >>> Scalar.coerce(2**63).kind
    'UInt'
    """

    __slots__ = ("kind", "value")
    kind: str
    value: int | float | bool

    def __init__(self, kind: str, value: int | float | bool) -> None:
        # ``type() is`` first: the ABC checks cost microseconds, and a save makes thousands.
        if kind == "Int" or kind == "UInt":
            if type(value) is not int:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError(f"Scalar.{kind} needs an int, got {type(value).__name__}")
                value = int(value)  # numpy/torch integers become plain ints
            lo, hi = (_I64_MIN, _I64_MAX) if kind == "Int" else (0, _U64_MAX)
            if not lo <= value <= hi:
                raise ValueError(f"{value} does not fit Scalar.{kind} ({lo}..{hi})")
        elif kind == "Float":
            if type(value) is not float:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError(f"Scalar.Float needs a number, got {type(value).__name__}")
                try:
                    value = float(value)
                except OverflowError:
                    raise ValueError(f"{value} does not fit Scalar.Float (f64)") from None
        elif kind == "Bool":
            if not isinstance(value, (bool, numpy.bool_)):
                raise TypeError(f"Scalar.Bool needs a bool, got {type(value).__name__}")
            value = bool(value)
        else:
            raise ValueError(
                f"unknown scalar kind {_short(kind)}; expected Int, UInt, Float or Bool"
            )
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Scalar is immutable")

    @classmethod
    def Int(cls, value: int) -> Scalar:
        """A signed 64-bit integer scalar."""
        return cls("Int", value)

    @classmethod
    def UInt(cls, value: int) -> Scalar:
        """An unsigned 64-bit integer scalar."""
        return cls("UInt", value)

    @classmethod
    def Float(cls, value: float) -> Scalar:
        """A 64-bit float scalar."""
        return cls("Float", value)

    @classmethod
    def Bool(cls, value: bool) -> Scalar:
        """A boolean scalar."""
        return cls("Bool", value)

    @classmethod
    def coerce(cls, value: Scalar | bool | int | float) -> Scalar:
        """Turn a plain Python value into a Scalar: bool -> Bool, int -> Int (UInt past i64),
        float -> Float (numpy scalars likewise). A Scalar is returned unchanged."""
        if type(value) is int:
            return cls("UInt" if value > _I64_MAX else "Int", value)
        if isinstance(value, Scalar):
            return value
        if isinstance(value, (bool, numpy.bool_)):
            return cls("Bool", bool(value))
        if isinstance(value, numbers.Integral):
            return cls("UInt" if value > _I64_MAX else "Int", value)
        if isinstance(value, numbers.Real):
            return cls("Float", value)
        raise TypeError(f"cannot store {type(value).__name__} as a burnpack scalar")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Scalar):
            return NotImplemented
        if self.kind != other.kind:
            return False
        if self.kind == "Float" and math.isnan(self.value) and math.isnan(other.value):
            return True
        return self.value == other.value

    def __hash__(self) -> int:
        # NaN hashes by identity in Python; all NaN Floats are equal here, so hash them alike.
        nan = self.kind == "Float" and math.isnan(self.value)
        return hash((self.kind, "nan" if nan else self.value))

    def __repr__(self) -> str:
        return f"Scalar.{self.kind}({self.value!r})"


# --- DTypes -------------------------------------------------------------------------------------

DType = str | dict
"""Burn's dtype value as it appears in a file's metadata: a name (``"F32"``, ``"BF16"``, ...) or a
one-entry map for the kinds Burn parametrizes (``{"Bool": "Native"}``, quantized ``QFloat``)."""


@dataclass(frozen=True)
class _DTypeInfo:
    itemsize: int  # bytes per element; 0 for the opaque QFloat
    torch_dtype: torch.dtype | None  # dtype of the stored bytes when viewed by torch


_SIMPLE_DTYPES: dict[str, _DTypeInfo] = {
    "F64": _DTypeInfo(8, torch.float64),
    "F32": _DTypeInfo(4, torch.float32),
    "Flex32": _DTypeInfo(4, torch.float32),
    "F16": _DTypeInfo(2, torch.float16),
    "BF16": _DTypeInfo(2, torch.bfloat16),
    "I64": _DTypeInfo(8, torch.int64),
    "I32": _DTypeInfo(4, torch.int32),
    "I16": _DTypeInfo(2, torch.int16),
    "I8": _DTypeInfo(1, torch.int8),
    "U64": _DTypeInfo(8, torch.uint64),
    "U32": _DTypeInfo(4, torch.uint32),
    "U16": _DTypeInfo(2, torch.uint16),
    "U8": _DTypeInfo(1, torch.uint8),
}
_BOOL_DTYPES: dict[str, _DTypeInfo] = {
    "Native": _DTypeInfo(1, torch.bool),
    "U8": _DTypeInfo(1, torch.uint8),
    "U32": _DTypeInfo(4, torch.uint32),
}
_QFLOAT = _DTypeInfo(0, None)

_TORCH_TO_BURN: dict[torch.dtype, DType] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: {"Bool": "Native"},
}


# torch dtypes Burn has no name for, *carried* in a Burn dtype of the same bytes: the descriptor
# names the Burn dtype (what Burn reads: the raw bits, or a complex tensor's real and imaginary
# parts as a trailing dimension of 2) and adds ``_TORCH_DTYPE_KEY`` with the torch dtype's
# name, which Burn ignores (serde skips unknown descriptor keys) and this reader honours.
_CARRIED: dict[torch.dtype, tuple[str, bool]] = {  # torch dtype -> (Burn dtype, complex)
    torch.float8_e4m3fn: ("U8", False),
    torch.float8_e5m2: ("U8", False),
    torch.float8_e4m3fnuz: ("U8", False),
    torch.float8_e5m2fnuz: ("U8", False),
    torch.float8_e8m0fnu: ("U8", False),
    torch.float4_e2m1fn_x2: ("U8", False),
    torch.complex32: ("F16", True),
    torch.complex64: ("F32", True),
    torch.complex128: ("F64", True),
}
_CARRIED_BY_NAME = {str(d).removeprefix("torch."): d for d in _CARRIED}
_TORCH_DTYPE_KEY = "torch_dtype"
"""The descriptor key naming the torch dtype of a tensor Burn has no dtype for (``float8_*``,
``float4_e2m1fn_x2``, ``complex*``): the tensor is stored in a Burn dtype of the same bytes."""


def _carrier(dtype: torch.dtype) -> tuple[DType, str | None]:
    """How a torch dtype is written: ``(Burn dtype, torch dtype name or None)``; the name is
    given only for a dtype Burn has none for, carried in a Burn dtype of the same bytes.

    >>> _carrier(torch.float8_e4m3fn), _carrier(torch.complex64), _carrier(torch.int8)
    (('U8', 'float8_e4m3fn'), ('F32', 'complex64'), ('I8', None))
    """
    carried = _CARRIED.get(dtype)
    if carried is None:
        return _burn_dtype(dtype), None
    return carried[0], str(dtype).removeprefix("torch.")


def _carried_spec(
    name: str, burn: DType, shape: tuple[int, ...]
) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The torch dtype and shape of a tensor whose descriptor names torch dtype ``name``,
    stored as Burn dtype ``burn`` with shape ``shape`` (a complex one has a trailing 2 the torch
    tensor has not); ``None`` when ``name`` is not a carried dtype or does not fit ``burn`` and
    ``shape``."""
    dtype = _CARRIED_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None or _CARRIED[dtype][0] != burn:
        return None
    if not _CARRIED[dtype][1]:
        return dtype, shape
    if not shape or shape[-1] != 2:
        return None
    return dtype, shape[:-1]


def _parsed_dtype_info(dtype: DType) -> _DTypeInfo:
    """:func:`_dtype_info` of a dtype that parsing already accepted (so never ``None``)."""
    info = _dtype_info(dtype)
    if info is None:  # pragma: no cover - _parse_descriptor refuses unknown dtypes
        raise ValidationError(f"unknown dtype {dtype!r}")
    return info


def _dtype_info(dtype: object) -> _DTypeInfo | None:
    """Look up a Burn dtype value; ``None`` when it is not one Burn defines."""
    if isinstance(dtype, str):
        return _SIMPLE_DTYPES.get(dtype)
    if isinstance(dtype, dict) and len(dtype) == 1:
        ((variant, payload),) = dtype.items()
        if variant == "Bool" and isinstance(payload, str):
            return _BOOL_DTYPES.get(payload)
        if variant == "QFloat" and isinstance(payload, dict):
            return _QFLOAT
    return None


def _burn_dtype(dtype: torch.dtype) -> DType:
    """Burn's dtype value for a torch dtype (``torch.float32`` -> ``"F32"``).

    >>> _burn_dtype(torch.bool)
    {'Bool': 'Native'}
    """
    try:
        return _TORCH_TO_BURN[dtype]
    except KeyError:
        hint = (
            f" (a TensorEntry.from_tensor stores it as {_CARRIED[dtype][0]} and names it)"
            if dtype in _CARRIED
            else ""
        )
        raise ValidationError(f"torch dtype {dtype} has no burnpack equivalent{hint}") from None


def _torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a tensor of Burn dtype ``dtype`` reads as (Bool variants -> torch.bool)."""
    info = _dtype_info(dtype)
    if info is None or info.torch_dtype is None:
        raise ValidationError(f"dtype {dtype!r} has no torch equivalent")
    return torch.bool if isinstance(dtype, dict) else info.torch_dtype


def _stored_dtype(dtype: DType) -> torch.dtype | None:
    """The torch dtype of the stored bytes of a tensor of Burn dtype ``dtype`` (the view of
    :meth:`~lightning_bpk.burnpack.Pack.raw`; a byte range can be read straight into it), or
    ``None`` for the opaque QFloat. It differs from :func:`_torch_dtype` for the Bool variants
    stored as integers. ``dtype`` is one a parsed header accepted (else :class:`ValidationError`).

    >>> _stored_dtype({"Bool": "U32"}), _torch_dtype({"Bool": "U32"}), _stored_dtype("F16")
    (torch.uint32, torch.bool, torch.float16)
    """
    return _parsed_dtype_info(dtype).torch_dtype


_REPR_LIMIT = 80  # hostile values can be megabytes long; error messages show a prefix


def _short(value: object) -> str:
    """``repr(value)`` cut to a readable length for error messages."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


# --- JSON held in a metadata value ----------------------------------------------------------------

# A JSON string (possessive: linear time on any input) and everything that is not a bracket.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]++")
_BRACKET_STEPS = str.maketrans({"[": "\x01", "{": "\x01", "]": "\xff", "}": "\xff"})  # +1, -1


def _json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest (brackets inside strings do not
    count), in linear time and without recursion."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text)).translate(_BRACKET_STEPS)
    if not brackets:
        return 0
    return int(numpy.frombuffer(brackets.encode("latin-1"), numpy.int8).cumsum().max())


def _decode_json(text: object, *, what: str, max_depth: int = _MAX_JSON_DEPTH) -> Any:
    """The value of a metadata entry holding JSON (upper layers keep their structure there).

    Nesting is measured before parsing, so a hostile value can never exhaust the stack of the
    parser or of the code that walks the result: deeper than ``max_depth``, not a string, or not
    JSON raises :class:`MetadataError` naming ``what``. Its size is already bounded by
    :data:`MAX_METADATA_SIZE`.

    >>> _decode_json('{"a": [1, "]]"]}', what="x")
    {'a': [1, ']]']}
    >>> _decode_json("[" * 200 + "]" * 200, what="the index")
    Traceback (most recent call last):
    ...
    lightning_bpk.burnpack.base.MetadataError: the index: JSON nested 200 levels deep (at most 128)
    """
    if not isinstance(text, str):
        raise MetadataError(f"{what}: a {type(text).__name__}, not JSON text")
    depth = _json_depth(text)
    if depth > max_depth:
        raise MetadataError(f"{what}: JSON nested {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise MetadataError(f"{what}: not valid JSON ({_short(str(e))})") from None
