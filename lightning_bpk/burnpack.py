"""Burn's burnpack v1 container (``.bpk``), read and written byte-compatibly with Burn.

Layout of a file::

    0      4       6              10                        data_start (multiple of 256)
    | NRUB | 01 00 | metadata_size | CBOR metadata | zeros  | tensor 0 | zeros | tensor 1 | ...

The CBOR metadata is ``{"tensors": {name: {"dtype", "shape", "data_offsets", "param_id"?}},
"metadata"?: {str: str}, "scalars"?: {str: Scalar}}`` encoded exactly as Burn's ``ciborium``
writer does, so a file written here is byte-identical to Burn's for the same content.

Beyond Burn, every tensor written here carries an xxh3-64 checksum in the ``metadata`` map
under the reserved prefix :data:`CHECKSUM_PREFIX` (Burn ignores it), and reading is stricter:
offsets must be aligned, in bounds, non-overlapping and match ``shape x dtype``.

Byte order: the format stores every tensor little-endian and :meth:`Pack.tensor` views those
bytes directly, so this module assumes a little-endian host (x86-64, AArch64: every platform
torch ships wheels for). A big-endian host would need a byteswap on read and write.

Example::

    >>> import torch
    >>> from lightning_bpk import burnpack
    >>> data = burnpack.dumps({"w": torch.ones(2, 2)}, scalars={"step": 3})
    >>> pack = burnpack.loads(data)
    >>> pack.tensor("w").sum().item(), pack.scalars["step"]
    (4.0, Scalar.Int(3))
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import numbers
import operator
import os
import stat
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import cbor2
import numpy
import torch
import xxhash

from lightning_bpk import _fs
from lightning_bpk.errors import LightningBpkError

__all__ = [
    "CHECKSUM_PREFIX",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAGIC_BYTES",
    "MAX_CBOR_DEPTH",
    "MAX_FILE_SIZE",
    "MAX_METADATA_SIZE",
    "MAX_RANK",
    "MAX_TENSOR_COUNT",
    "MAX_TENSOR_SIZE",
    "TENSOR_ALIGNMENT",
    "BurnpackError",
    "BurnpackIOError",
    "BytesLike",
    "ChecksumError",
    "DType",
    "HeaderError",
    "MagicError",
    "MetadataError",
    "Pack",
    "Scalar",
    "ScalarKind",
    "SizeMismatchError",
    "TensorEntry",
    "TensorInfo",
    "TensorNotFoundError",
    "TensorsArg",
    "ValidationError",
    "VersionError",
    "burn_dtype",
    "data_section_start",
    "dumps",
    "loads",
    "read",
    "read_into",
    "resolve_path",
    "size",
    "tensor_bytes",
    "torch_dtype",
    "with_suffix",
    "write",
]

# --- Format constants (Burn's values; the reason for each is beside it) -------------------------

MAGIC = 0x4255524E  # "BURN" as a little-endian u32, so the file starts with b"NRUB"
MAGIC_BYTES = MAGIC.to_bytes(4, "little")
FORMAT_VERSION = 1  # the only version Burn writes; readers reject anything newer
HEADER_SIZE = 10  # magic u32 + version u16 + metadata_size u32
TENSOR_ALIGNMENT = 256  # data section and every tensor start are 256-byte aligned (mmap/SIMD)
MAX_METADATA_SIZE = 100 * 1024 * 1024  # checked before allocating: a header cannot demand 4 GiB
MAX_TENSOR_COUNT = 100_000  # bounds the work of parsing a hostile index
MAX_TENSOR_SIZE = 10 * 1024**3  # one tensor at most 10 GiB, as Burn on 64-bit targets
MAX_CBOR_DEPTH = 128  # nesting limit of the metadata decoder (stack safety)
MAX_FILE_SIZE = 100 * 1024**3  # larger files are refused before anything is mapped
MAX_RANK = 64  # no real tensor has more dimensions; bounds shape parsing

# Reserved metadata prefix for per-tensor checksums: "lightning_bpk/xxh3/<tensor name>" -> 16 hex.
CHECKSUM_PREFIX = "lightning_bpk/xxh3/"
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

ScalarKind = str  # "Int" | "UInt" | "Float" | "Bool"


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
        if kind == "Int" or kind == "UInt":
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Scalar.{kind} needs an int, got {type(value).__name__}")
            value = int(value)  # numpy/torch integers become plain ints
            lo, hi = (_I64_MIN, _I64_MAX) if kind == "Int" else (0, _U64_MAX)
            if not lo <= value <= hi:
                raise ValueError(f"{value} does not fit Scalar.{kind} ({lo}..{hi})")
        elif kind == "Float":
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

DType = str | dict  # Burn's dtype value as it appears in the metadata


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


def burn_dtype(dtype: torch.dtype) -> DType:
    """Burn's dtype value for a torch dtype (``torch.float32`` -> ``"F32"``).

    >>> burn_dtype(torch.bool)
    {'Bool': 'Native'}
    """
    try:
        return _TORCH_TO_BURN[dtype]
    except KeyError:
        raise ValidationError(f"torch dtype {dtype} has no burnpack equivalent") from None


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a tensor of Burn dtype ``dtype`` reads as (Bool variants -> torch.bool)."""
    info = _dtype_info(dtype)
    if info is None or info.torch_dtype is None:
        raise ValidationError(f"dtype {dtype!r} has no torch equivalent")
    return torch.bool if isinstance(dtype, dict) else info.torch_dtype


# --- Writing ------------------------------------------------------------------------------------

BytesLike = bytes | bytearray | memoryview


class TensorEntry:
    """A tensor to write: Burn dtype, shape, bytes (or a provider of them) and an optional param id.

    ``data`` is a bytes-like object, a ``torch.Tensor`` or a zero-argument callable returning
    either (a *deferred* tensor, called exactly once while writing; ``nbytes`` is then required).

    >>> TensorEntry("F32", [2], b"\\x00" * 8, param_id=7).nbytes
    8
    """

    __slots__ = ("data", "dtype", "nbytes", "param_id", "shape")

    def __init__(
        self,
        dtype: DType,
        shape: Iterable[int],
        data: BytesLike | torch.Tensor | Callable[[], BytesLike | torch.Tensor],
        param_id: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        self.dtype = dtype
        self.shape = tuple(operator.index(d) for d in shape)  # 2.5 is an error, not 2
        self.data = data
        self.param_id = param_id
        if nbytes is None:
            if callable(data) and not isinstance(data, torch.Tensor):
                raise ValueError("a deferred TensorEntry needs nbytes")
            nbytes = _nbytes_of(data)
        self.nbytes = int(nbytes)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, param_id: int | None = None) -> TensorEntry:
        """Describe a torch tensor; its bytes are taken zero-copy when it is contiguous on CPU."""
        return cls(
            burn_dtype(tensor.dtype),
            tensor.shape,
            tensor,
            param_id=param_id,
            nbytes=tensor.numel() * tensor.element_size(),
        )


def _nbytes_of(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


# dtypes numpy can view directly (not bfloat16); the others are reinterpreted as uint8 first.
_NUMPY_DTYPES = frozenset(
    d for d in _TORCH_TO_BURN if d not in (torch.bfloat16, torch.uint16, torch.uint32, torch.uint64)
)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous on CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # ndarray has the buffer protocol; numpy's stubs declare it for Python 3.12+ only
    if t.dtype in _NUMPY_DTYPES:  # one call instead of four: counts with thousands of tensors
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _as_bytes(data: Any) -> memoryview:
    if isinstance(data, torch.Tensor):
        return tensor_bytes(data)
    return memoryview(data).cast("B")


class _Float:
    """A float to be encoded in the smallest lossless CBOR width (as ciborium does)."""

    __slots__ = ("encoded",)

    def __init__(self, value: float) -> None:
        bits = struct.pack(">d", value)
        for code, fmt in ((b"\xf9", ">e"), (b"\xfa", ">f")):
            try:
                narrow = struct.pack(fmt, value)
            except OverflowError:
                continue
            if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == bits:
                self.encoded = code + narrow
                return
        self.encoded = b"\xfb" + bits


def _encode_default(encoder: cbor2.CBOREncoder, value: object) -> None:
    if isinstance(value, _Float):
        encoder.write(value.encoded)
        return
    raise MetadataError(f"cannot encode {type(value).__name__} in burnpack metadata")


def _cbor_value(value: Any) -> Any:
    """Prepare a dtype value (possibly QFloat's nested struct) for encoding, floats narrowed."""
    if isinstance(value, float):
        return _Float(value)
    if isinstance(value, dict):
        return {k: _cbor_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cbor_value(v) for v in value]
    return value


@dataclass
class _Planned:
    name: str
    entry: TensorEntry
    start: int  # relative to the data section
    end: int


@dataclass
class _Plan:
    tensors: list[_Planned]
    metadata: dict[str, str]
    scalars: dict[str, Scalar]
    checksums: bool
    encoded: bytes = b""  # the metadata blob (checksum placeholders), set once planning succeeds
    # offset in ``encoded`` of each tensor's checksum placeholder, by tensor name
    digest_offsets: dict[str, int] = field(default_factory=dict)

    def encode_metadata(self) -> None:
        """Encode the metadata once, with placeholders, and find where each digest goes.

        Digests are patched into ``encoded`` in place after the data is written (re-encoding
        would cost as much again: ~10 ms for 5,000 tensors).
        """
        descriptors = {}
        for p in sorted(self.tensors, key=lambda p: p.name):
            desc: dict[str, Any] = {
                "dtype": _cbor_value(p.entry.dtype),
                "shape": list(p.entry.shape),
                "data_offsets": [p.start, p.end],
            }
            if p.entry.param_id is not None:
                desc["param_id"] = p.entry.param_id
            descriptors[p.name] = desc
        top: dict[str, Any] = {"tensors": descriptors}
        metadata = dict(self.metadata)
        if self.checksums:
            for p in self.tensors:
                metadata[CHECKSUM_PREFIX + p.name] = _CHECKSUM_PLACEHOLDER
        keys = sorted(metadata)
        if metadata:
            top["metadata"] = {k: metadata[k] for k in keys}
        if self.scalars:
            top["scalars"] = {
                k: {s.kind: _Float(s.value) if s.kind == "Float" else s.value}
                for k, s in sorted(self.scalars.items())
            }
        self.encoded = _cbor(top)
        if not (self.checksums and self.tensors):
            return
        # Keys sharing the prefix are adjacent once sorted, so the checksum entries are one run
        # of the metadata map; what follows the run (later user keys, then the scalars) is
        # encoded on its own to find where the run ends.
        first = next(i for i, k in enumerate(keys) if k.startswith(CHECKSUM_PREFIX))
        after = first + len(self.tensors)
        tail = sum(len(_cbor(k)) + len(_cbor(metadata[k])) for k in keys[after:])
        if "scalars" in top:
            tail += len(_cbor("scalars")) + len(_cbor(top["scalars"]))
        position = len(self.encoded) - tail
        value_size = len(_cbor(_CHECKSUM_PLACEHOLDER))
        for key in reversed(keys[first:after]):
            position -= value_size  # the digest text: a 1-byte header, then 16 hex digits
            self.digest_offsets[key[len(CHECKSUM_PREFIX) :]] = position + 1
            position -= _text_size(key)

    def patched(self, digests: Mapping[str, str]) -> bytearray:
        """``encoded`` with every placeholder replaced by its tensor's digest."""
        blob = bytearray(self.encoded)
        for name, offset in self.digest_offsets.items():
            blob[offset : offset + len(_CHECKSUM_PLACEHOLDER)] = digests[name].encode()
        return blob

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, default=_encode_default)


def _text_size(text: str) -> int:
    """Bytes of ``text`` encoded as a CBOR text string: header (1-9 bytes, minimal) + UTF-8."""
    n = len(text.encode())
    return n + (1 if n < 24 else 2 if n < 2**8 else 3 if n < 2**16 else 5 if n < 2**32 else 9)


def _align(n: int) -> int:
    return -(-n // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def data_section_start(metadata_size: int) -> int:
    """Absolute offset of the data section for a metadata blob of ``metadata_size`` bytes.

    >>> [data_section_start(m) for m in (0, 246, 247)]
    [256, 256, 512]
    """
    return _align(HEADER_SIZE + metadata_size)


TensorsArg = Mapping[str, torch.Tensor | TensorEntry] | Iterable[tuple]


def _plan(
    tensors: TensorsArg,
    metadata: Mapping[str, str] | None,
    scalars: Mapping[str, Any] | None,
    checksums: bool,
) -> _Plan:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    planned: list[_Planned] = []
    seen: set[str] = set()
    offset = 0
    for name, value in items:
        if not isinstance(name, str):
            raise ValidationError(f"tensor name {name!r} is not a string")
        if name in seen:
            raise ValidationError(f"Duplicate tensor name '{name}'")
        seen.add(name)
        entry = value if isinstance(value, TensorEntry) else None
        if entry is None:
            if not isinstance(value, torch.Tensor):
                raise ValidationError(
                    f"tensor '{name}': expected a torch.Tensor or TensorEntry, "
                    f"got {type(value).__name__}"
                )
            try:
                entry = TensorEntry.from_tensor(value)
            except ValidationError as e:
                raise ValidationError(f"tensor '{name}': {e}") from None
        _check_entry(name, entry)
        start = _align(offset)
        planned.append(_Planned(name, entry, start, start + entry.nbytes))
        offset = start + entry.nbytes
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValidationError(f"metadata entry {k!r}: keys and values must be strings")
        if k.startswith(CHECKSUM_PREFIX):
            raise ValidationError(
                f"metadata key {k!r} uses the reserved prefix {CHECKSUM_PREFIX!r}"
            )
    scal = {}
    for k, v in (scalars or {}).items():
        if not isinstance(k, str):
            raise ValidationError(f"scalar name {k!r} is not a string")
        try:
            scal[k] = Scalar.coerce(v)
        except (TypeError, ValueError) as e:
            raise ValidationError(f"scalar '{k}': {e}") from None
    plan = _Plan(planned, meta, scal, checksums)
    try:
        plan.encode_metadata()
    except UnicodeEncodeError as e:  # lone surrogates cannot be stored as UTF-8 text
        raise ValidationError(f"{e.object!r} is not valid UTF-8 text: {e.reason}") from None
    if len(plan.encoded) > _U32_MAX:
        raise BurnpackIOError(f"metadata of {len(plan.encoded)} bytes does not fit the u32 header")
    return plan


def _check_entry(name: str, entry: TensorEntry) -> None:
    info = _dtype_info(entry.dtype)
    if info is None:
        raise ValidationError(f"tensor '{name}': unknown dtype {entry.dtype!r}")
    if any(not 0 <= d <= _I64_MAX for d in entry.shape):
        raise ValidationError(
            f"tensor '{name}': shape {list(entry.shape)} has a negative or over-i64 dim"
        )
    if entry.param_id is not None and not (
        isinstance(entry.param_id, int) and 0 <= entry.param_id <= _U64_MAX
    ):
        raise ValidationError(f"tensor '{name}': param_id {entry.param_id!r} is not a u64")
    if info is not _QFLOAT:
        need = math.prod(entry.shape) * info.itemsize
        if entry.nbytes != need:
            raise ValidationError(
                f"tensor '{name}' declares {entry.nbytes} bytes but its shape "
                f"{list(entry.shape)} and dtype {entry.dtype} need {need}"
            )
    data = entry.data
    if isinstance(data, torch.Tensor) and data.dtype == torch.bool and info.itemsize != 1:
        raise ValidationError(f"tensor '{name}': a torch.bool tensor must be stored as 1 byte")


def _materialize(p: _Planned) -> memoryview:
    """Call a deferred provider exactly once and check the length it returns."""
    data = p.entry.data
    if callable(data) and not isinstance(data, torch.Tensor):
        try:
            data = data()
        except BurnpackError as e:
            raise type(e)(f"tensor '{p.name}': {e}") from e
        except Exception as e:
            raise BurnpackIOError(f"tensor '{p.name}': {e}") from e
    view = _as_bytes(data)
    if view.nbytes != p.entry.nbytes:
        raise SizeMismatchError(
            f"tensor '{p.name}': deferred source has inconsistent length "
            f"(expected {p.entry.nbytes}, got {view.nbytes})"
        )
    return view


# Tensors of at least this many bytes are checksummed on a helper thread while this thread writes
# them: xxhash and os.write both release the GIL, so on two cores the hash costs no wall time.
# Below it, handing the work over costs more than hashing inline (xxh3 runs at ~10 GB/s).
_PARALLEL_HASH_MIN = 1024 * 1024
# Smaller tensors, the header and the zero padding are gathered into one buffer of this size per
# write: 5,000 tensors of 4 KiB take 20 writes instead of 10,000 (half the write time).
_GATHER_SIZE = 1024 * 1024


class _Gather:
    """Collects small pieces in one reused buffer and writes them to ``sink`` together."""

    def __init__(self, sink: BinaryIO, size: int) -> None:
        self._sink = sink
        self._buffer = memoryview(bytearray(size))
        self._used = 0

    def add(self, data: memoryview | bytes) -> None:
        n = len(data)
        if self._used + n > self._buffer.nbytes:
            self.flush()
            if n > self._buffer.nbytes:
                _fs.write_all(self._sink, data)
                return
        self._buffer[self._used : self._used + n] = data
        self._used += n

    def flush(self) -> None:
        if self._used:
            _fs.write_all(self._sink, self._buffer[: self._used])
            self._used = 0


def _write_plan(plan: _Plan, sink: BinaryIO) -> None:
    """Stream header, metadata and tensors to a seekable sink; patch checksums in at the end.

    Large tensors are hashed on a helper thread while they are written (each hash finishes
    before the next tensor's provider runs, so peak memory stays one tensor); small ones are
    hashed inline and gathered with the padding into few writes.
    """
    meta = plan.encoded
    data_start = data_section_start(len(meta))
    header = MAGIC_BYTES + struct.pack("<HI", FORMAT_VERSION, len(meta))
    # no larger than what is gathered: a pack of big tensors needs a few hundred bytes
    small = sum(p.entry.nbytes for p in plan.tensors if p.entry.nbytes < _PARALLEL_HASH_MIN)
    gather = _Gather(
        sink, min(_GATHER_SIZE, data_start + small + TENSOR_ALIGNMENT * len(plan.tensors))
    )
    gather.add(header + meta + bytes(data_start - HEADER_SIZE - len(meta)))
    position = 0
    digests: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        hasher: ThreadPoolExecutor | None = None
        for p in plan.tensors:
            if p.start > position:
                gather.add(bytes(p.start - position))
            view = _materialize(p)
            if view.nbytes < _PARALLEL_HASH_MIN:
                if plan.checksums:
                    digests[p.name] = xxhash.xxh3_64_hexdigest(view)
                gather.add(view)
            else:
                gather.flush()
                if plan.checksums:
                    if hasher is None:
                        hasher = stack.enter_context(ThreadPoolExecutor(1))
                    digest = hasher.submit(xxhash.xxh3_64_hexdigest, view)
                _fs.write_all(sink, view)
                if plan.checksums:
                    digests[p.name] = digest.result()
            del view  # drop this tensor's bytes before the next provider runs
            position = p.end
    gather.flush()
    if plan.digest_offsets:
        sink.seek(HEADER_SIZE)
        _fs.write_all(sink, plan.patched(digests))
        sink.seek(0, io.SEEK_END)


def dumps(
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> bytes:
    """Encode tensors, string metadata and typed scalars as burnpack bytes.

    ``tensors`` maps names to tensors or :class:`TensorEntry`; its order is the data order.
    ``checksums=False`` writes exactly what Burn would (no checksum entries).

    >>> len(dumps({}))  # an empty pack is one aligned block
    256
    """
    plan = _plan(tensors, metadata, scalars, checksums)
    buffer = io.BytesIO()
    _write_plan(plan, buffer)
    return buffer.getvalue()


def size(
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> int:
    """The exact byte size :func:`dumps` would produce, computed without calling any provider."""
    plan = _plan(tensors, metadata, scalars, checksums)
    return data_section_start(len(plan.encoded)) + plan.data_size


def with_suffix(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``.bpk`` appended when it has no suffix (Burn's rule for writers)."""
    p = Path(path)
    return p if p.suffix else p.with_name(p.name + ".bpk")


def write(
    path: str | os.PathLike[str],
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    atomic: bool = True,
    checksums: bool = True,
    add_suffix: bool = True,
) -> Path:
    """Write a burnpack file and return its path (``.bpk`` added when the path has no suffix,
    unless ``add_suffix=False``: then exactly ``path``, as Lightning's ``CheckpointIO`` needs).

    With ``atomic=True`` (default) the bytes go to a scratch file in the same directory, which is
    fsynced and renamed over ``path``: a failure leaves no scratch file and an existing file
    untouched. ``atomic=False`` is Burn's plain ``write_to_file``: a failure partway leaves a
    short, corrupt file in place of the old one. Offsets are planned before any I/O, each deferred
    provider is called once, in order, and tensors are streamed, so peak extra memory is about
    the largest tensor.

    >>> import tempfile, torch
    >>> write(tempfile.mkdtemp() + "/model", {"w": torch.zeros(3)}).name
    'model.bpk'
    """
    target = with_suffix(path) if add_suffix else Path(path)
    plan = _plan(tensors, metadata, scalars, checksums)
    try:
        if atomic:
            with _fs.atomic_file(target) as f:
                _write_plan(plan, f)
        else:
            # Burn truncates in place; unlinking first gives the same clobbering semantics but
            # keeps packs that still map the old file (their tensors are views) intact.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            with open(target, "wb", buffering=0) as f:
                _write_plan(plan, f)
    except BurnpackError as e:
        raise type(e)(f"{target}: {e}") from e
    except OSError as e:
        raise BurnpackIOError(f"cannot write {target}: {e.strerror or e}") from e
    return target


# --- Reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's descriptor as stored: Burn dtype, shape, offsets relative to the data section."""

    dtype: DType
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    param_id: int | None

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


class _RejectAllTags(dict):
    """``semantic_decoders`` for cbor2 that refuses every tag.

    Burn's metadata never contains tags, and cbor2 decodes many tags itself (datetime, bignum,
    decimal, regex, MIME, sets, shared references) *without* calling ``tag_hook``: a hostile file
    could otherwise smuggle arbitrary objects (or a ``re.compile``) into the parse.
    """

    def __getitem__(self, tag: int) -> Callable[..., Any]:
        def reject(*_: Any) -> Any:
            raise MetadataError(f"CBOR tag {tag} is not allowed in burnpack metadata")

        return reject


_REJECT_ALL_TAGS = _RejectAllTags()


def _decode_metadata(blob: memoryview) -> dict:
    decoder = cbor2.CBORDecoder(
        io.BytesIO(blob),
        max_depth=MAX_CBOR_DEPTH,
        allow_indefinite=False,
        allow_duplicate_keys=False,
        strict_hashable_types=True,  # map keys must be text/bytes: no hash-collision DoS
        semantic_decoders=_REJECT_ALL_TAGS,
    )
    try:
        top = decoder.decode()
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as e:
        if isinstance(e.__cause__, MetadataError):  # cbor2 wraps errors raised by decoders
            raise e.__cause__ from None
        raise MetadataError(f"invalid CBOR metadata: {e}") from None
    trailing = len(blob) - decoder.fp.tell()
    if trailing:
        raise MetadataError(f"{trailing} trailing bytes after the CBOR metadata item")
    if not isinstance(top, dict):
        raise MetadataError(f"metadata is a {type(top).__name__}, expected a map")
    return top


_REPR_LIMIT = 80  # hostile values can be megabytes long; error messages show a prefix


def _short(value: object) -> str:
    """``repr(value)`` cut to a readable length for error messages."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _is_uint(value: object, limit: int) -> bool:
    # ``type() is int`` also excludes bool; cbor2 decodes integers as plain ints.
    return type(value) is int and 0 <= value <= limit


def _parse_descriptor(name: object, desc: object) -> TensorInfo:
    # Hot for packs with many tensors: error messages are only formatted on failure.
    if not isinstance(name, str):
        raise MetadataError(f"tensor name {_short(name)} is not a text string")
    if not isinstance(desc, dict):
        raise MetadataError(f"tensor '{name}': descriptor is not a map")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in desc:
            raise MetadataError(f"tensor '{name}': missing field '{key}'")
    dtype = desc["dtype"]
    if _dtype_info(dtype) is None:
        raise MetadataError(f"tensor '{name}': unknown dtype {_short(dtype)}")
    shape = desc["shape"]
    # torch sizes are int64, so a larger dimension could never be materialized. Checked with
    # builtins over the whole list (no Python call per dimension); ``type() is int`` also
    # excludes bool, and cbor2 decodes integers as plain ints.
    if not (
        type(shape) is list
        and len(shape) <= MAX_RANK
        and all(type(d) is int for d in shape)
        and (not shape or (min(shape) >= 0 and max(shape) <= _I64_MAX))
    ):
        raise MetadataError(
            f"tensor '{name}': shape must be a list of at most {MAX_RANK} dimensions, "
            f"each in 0..2**63-1, got {_short(shape)}"
        )
    offsets = desc["data_offsets"]
    if not (type(offsets) is list and len(offsets) == 2):
        offsets = None
    else:
        start, end = offsets
        if not (_is_uint(start, _U64_MAX) and _is_uint(end, _U64_MAX)):
            offsets = None
    if offsets is None:
        raise MetadataError(
            f"tensor '{name}': data_offsets must be [start, end] as u64, got "
            f"{_short(desc['data_offsets'])}"
        )
    param_id = desc.get("param_id")
    if param_id is not None and not _is_uint(param_id, _U64_MAX):
        raise MetadataError(f"tensor '{name}': param_id must be a u64, got {_short(param_id)}")
    return TensorInfo(dtype, tuple(shape), (start, end), param_id)


def _parse_scalar(name: object, value: object) -> Scalar:
    if not isinstance(name, str):
        raise MetadataError(f"scalar name {_short(name)} is not a text string")
    if not isinstance(value, dict) or len(value) != 1:
        raise MetadataError(f"scalar '{name}': expected a one-entry map like {{'Int': 1}}")
    ((kind, payload),) = value.items()
    if kind == "Float" and not isinstance(payload, float):
        raise MetadataError(f"scalar '{name}': a Float payload must be a CBOR float")
    if kind == "Bool" and not isinstance(payload, bool):
        raise MetadataError(f"scalar '{name}': a Bool payload must be true or false")
    try:
        return Scalar(kind, payload)
    except (TypeError, ValueError) as e:
        raise MetadataError(f"scalar '{name}': {e}") from None


def _parse_string_map(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise MetadataError("'metadata' must be a map of text to text")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise MetadataError(f"metadata entry {_short(k)}: keys and values must be text")
    return value


class Pack:
    """A parsed burnpack: the index is read eagerly, tensor bytes lazily and without copies.

    Use as a context manager to release the file mapping deterministically. Tensors returned by
    :meth:`tensor` are views on the file's bytes; they stay valid after :meth:`close` (the mapping
    then lives as long as they do).
    """

    def __init__(self, buffer: Any, *, source: str = "<bytes>", _mmap: mmap.mmap | None = None):
        self._buffer = memoryview(buffer).cast("B")
        self._mmap = _mmap
        self._closed = False
        self._readonly = self._buffer.readonly
        self.source = source
        self.file_size = self._buffer.nbytes
        self._verified: set[str] = set()
        try:
            self._parse()
        except BurnpackError as e:
            self.close()
            raise type(e)(f"{source}: {e}") from None

    def _parse(self) -> None:
        buf = self._buffer
        total = buf.nbytes
        if total < HEADER_SIZE:
            raise HeaderError(f"Invalid header: insufficient bytes ({total} < {HEADER_SIZE})")
        if bytes(buf[:4]) != MAGIC_BYTES:
            raise MagicError(f"Invalid magic number {bytes(buf[:4])!r} (expected b'NRUB')")
        version, meta_size = struct.unpack_from("<HI", buf, 4)
        if version != FORMAT_VERSION:
            raise VersionError(f"Unsupported version {version} (this reader knows 1)")
        if meta_size > MAX_METADATA_SIZE:
            raise ValidationError(
                f"Metadata size {meta_size} exceeds maximum allowed size of "
                f"{MAX_METADATA_SIZE} bytes (potential DoS attack)"
            )
        if HEADER_SIZE + meta_size > total:
            raise HeaderError(
                f"Invalid header: insufficient bytes (metadata needs {HEADER_SIZE + meta_size}, "
                f"have {total})"
            )
        self.version = version
        self.metadata_size = meta_size
        self.data_start = data_section_start(meta_size)
        top = _decode_metadata(buf[HEADER_SIZE : HEADER_SIZE + meta_size])
        if "tensors" not in top:
            raise MetadataError("missing 'tensors' map")
        raw_tensors = top["tensors"]
        if not isinstance(raw_tensors, dict):
            raise MetadataError("'tensors' must be a map")
        if len(raw_tensors) > MAX_TENSOR_COUNT:
            raise ValidationError(
                f"File contains {len(raw_tensors)} tensors, exceeding maximum of {MAX_TENSOR_COUNT}"
            )
        entries = {name: _parse_descriptor(name, d) for name, d in raw_tensors.items()}
        metadata = _parse_string_map(top.get("metadata", {}))
        raw_scalars = top.get("scalars", {})
        if not isinstance(raw_scalars, dict):
            raise MetadataError("'scalars' must be a map")
        self.scalars: dict[str, Scalar] = {k: _parse_scalar(k, v) for k, v in raw_scalars.items()}
        self.checksums: dict[str, str] = {}
        self.metadata: dict[str, str] = {}
        for k, v in metadata.items():
            if k.startswith(CHECKSUM_PREFIX):
                if not _is_digest(v):
                    raise MetadataError(f"checksum entry {_short(k)}: {_short(v)} is not xxh3 hex")
                self.checksums[k[len(CHECKSUM_PREFIX) :]] = v
            else:
                self.metadata[k] = v
        self._validate_layout(entries, total)
        self.entries: dict[str, TensorInfo] = {k: entries[k] for k in sorted(entries)}
        self.names: list[str] = list(self.entries)
        self._data_order = tuple(sorted(self.names, key=lambda n: self.entries[n].data_offsets))
        unknown = sorted(set(self.checksums) - set(entries))
        if unknown:
            raise ValidationError(f"checksums recorded for absent tensors: {unknown[:5]}")

    def _validate_layout(self, entries: dict[str, TensorInfo], total: int) -> None:
        end_max = 0
        for name, info in sorted(entries.items(), key=lambda kv: kv[1].data_offsets):
            start, end = info.data_offsets
            if end < start:
                raise ValidationError(f"tensor '{name}': end offset {end} < start {start}")
            if end - start > MAX_TENSOR_SIZE:
                raise ValidationError(
                    f"Tensor '{name}' size {end - start} exceeds maximum {MAX_TENSOR_SIZE}"
                )
            if start % TENSOR_ALIGNMENT:
                raise ValidationError(f"tensor '{name}': start {start} is not 256-byte aligned")
            if start < end_max:
                raise ValidationError(f"tensor '{name}': bytes {start}..{end} overlap another")
            info_dtype = _parsed_dtype_info(info.dtype)
            if info_dtype is not _QFLOAT:
                need = math.prod(info.shape) * info_dtype.itemsize
                if need != end - start:
                    raise ValidationError(
                        f"tensor '{name}': {end - start} bytes stored but shape "
                        f"{list(info.shape)} and dtype {info.dtype} need {need}"
                    )
            end_max = max(end_max, end)
        # Stricter than Burn, which skips this check for a pack without tensors.
        expected = self.data_start + end_max
        if expected > total:
            raise ValidationError(
                f"File truncated: expected at least {expected} bytes, got {total} bytes"
            )
        if total > expected:
            raise ValidationError(
                f"{total - expected} unexpected bytes after the data section (file ends at "
                f"{expected})"
            )

    # -- access --

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.entries)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.entries[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.source}: no tensor named '{name}'") from None

    def raw(self, name: str, *, verify: bool = True) -> memoryview:
        """The stored bytes of tensor ``name`` (a zero-copy view), checksum-verified by default."""
        info = self._info(name)
        if self._closed:
            raise BurnpackError(f"{self.source}: pack is closed; tensor '{name}' is unavailable")
        start, end = info.data_offsets
        view = self._buffer[self.data_start + start : self.data_start + end]
        if verify and name not in self._verified:
            expected = self.checksums.get(name)
            if expected is not None and xxhash.xxh3_64_hexdigest(view) != expected:
                raise self._damaged(name)
            self._verified.add(name)
        return view

    def _damaged(self, name: str) -> ChecksumError:
        return ChecksumError(f"{self.source}: tensor '{name}' fails its checksum (file is damaged)")

    def tensor(self, name: str, *, verify: bool = True) -> torch.Tensor:
        """Tensor ``name`` as a torch tensor viewing the pack's bytes (copied only for Bool
        variants stored as U8/U32). QFloat tensors are opaque: use :meth:`raw`.

        >>> loads(dumps({"w": torch.ones(2)})).tensor("w")
        tensor([1., 1.])
        """
        with self._quiet_readonly():
            return self._tensor(name, verify)

    def tensors(self, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Every non-quantized tensor, by name (sorted)."""
        with self._quiet_readonly():
            return {
                n: self._tensor(n, verify)
                for n, info in self.entries.items()
                if _dtype_info(info.dtype) is not _QFLOAT
            }

    @contextlib.contextmanager
    def _quiet_readonly(self) -> Iterator[None]:
        """Silence torch's "buffer is not writable" warning for read-only sources (``bytes``).

        The tensors still share memory. Only entered when needed: ``catch_warnings`` costs
        microseconds per call and swaps process-wide warning state.
        """
        if not self._readonly:
            yield
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield

    def _tensor(self, name: str, verify: bool) -> torch.Tensor:
        info = self._info(name)
        dinfo = _parsed_dtype_info(info.dtype)
        if dinfo is _QFLOAT:
            raise ValidationError(
                f"{self.source}: tensor '{name}' is quantized (QFloat); read it with raw()"
            )
        view = self.raw(name, verify=verify)
        if view.nbytes == 0:
            return torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        assert dinfo.torch_dtype is not None  # only QFloat has none, refused above
        flat = torch.frombuffer(view, dtype=dinfo.torch_dtype)
        tensor = flat.reshape(info.shape)
        if isinstance(info.dtype, dict):  # Bool variants
            if dinfo.torch_dtype is torch.bool:
                if bool((flat.view(torch.uint8) > 1).any()):
                    raise ValidationError(
                        f"{self.source}: tensor '{name}' holds bool bytes other than 0 and 1"
                    )
            else:
                tensor = tensor != 0
        return tensor

    def verify(self) -> None:
        """Check every checksummed tensor; raise :class:`ChecksumError` naming all bad ones."""
        bad = []
        for name in self.names:
            try:
                self.raw(name)
            except ChecksumError:
                bad.append(name)
        if bad:
            raise ChecksumError(f"{self.source}: tensors failing their checksum: {bad}")

    @property
    def data_order(self) -> list[str]:
        """Tensor names in the order their bytes lie in the data section: the order the writer
        was given them (Burn: the module's visiting order). :attr:`names` is sorted by name.

        >>> import torch
        >>> pack = loads(dumps({"b": torch.ones(1), "a": torch.zeros(1)}))
        >>> pack.names, pack.data_order
        (['a', 'b'], ['b', 'a'])
        """
        return list(self._data_order)

    @property
    def nbytes(self) -> int:
        """Size of the whole pack in bytes."""
        return self.file_size

    def close(self) -> None:
        """Release the file mapping (deferred while tensors still view it)."""
        # While tensors still view the bytes, the mapping is unmapped when they are freed.
        self._closed = True
        with contextlib.suppress(BufferError):
            self._buffer.release()
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> Pack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Pack {self.source}: {len(self.entries)} tensors, {len(self.scalars)} scalars>"


def loads(data: BytesLike) -> Pack:
    """Parse burnpack bytes; tensors are views on ``data`` (no copy).

    >>> loads(dumps({}, metadata={"k": "v"})).metadata
    {'k': 'v'}
    """
    return Pack(data)


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Burn's reader rule: add ``.bpk`` only when ``path`` has no suffix and does not exist."""
    p = Path(path)
    if not p.suffix and not p.exists():
        return p.with_name(p.name + ".bpk")
    return p


def read(path: str | os.PathLike[str]) -> Pack:
    """Open a burnpack file lazily: only the header and metadata are read now.

    The file is memory-mapped copy-on-write, so tensors are zero-copy views that stay intact if
    the file is later replaced (writers here always replace, never rewrite in place; a foreign
    program that truncates the file in place would break the mapping, as with any mmap reader).

    >>> import tempfile, torch
    >>> path = write(tempfile.mkdtemp() + "/m.bpk", {"w": torch.arange(3.0)})
    >>> with read(path) as pack:
    ...     pack.names, pack.tensor("w").tolist()
    (['w'], [0.0, 1.0, 2.0])
    """
    p = resolve_path(path)
    fd = _open(p)
    try:
        return _map(fd, p)
    finally:
        os.close(fd)  # the mapping keeps the file's pages reachable on its own


def _open(p: Path) -> int:
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files).
        return os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise BurnpackIOError(f"cannot read {p}: {e.strerror or e}") from e


def _map(fd: int, p: Path) -> Pack:
    """Parse the open file ``fd`` (named ``p``) through a copy-on-write mapping."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{p}: not a regular file")
        if st.st_size > MAX_FILE_SIZE:
            raise ValidationError(
                f"{p}: File size {st.st_size} bytes exceeds maximum allowed size of "
                f"{MAX_FILE_SIZE} bytes"
            )
        if st.st_size < HEADER_SIZE:
            raise HeaderError(
                f"{p}: Invalid header: insufficient bytes ({st.st_size} < {HEADER_SIZE})"
            )
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise BurnpackIOError(f"cannot read {p}: {e.strerror or e}") from e
    return Pack(mapping, source=str(p), _mmap=mapping)


# Bytes hashed and then copied per step of :func:`read_into`: the copy reads what the hash just
# pulled into the CPU cache. Measured on the benchmark VM (1 GiB, 16 tensors): as fast as raw
# ``readinto`` warm and faster cold; 256 KiB steps were 30 % slower (per-call overhead).
_COPY_CHUNK = 4 * 1024 * 1024
# Tensors up to this size are copied with a memoryview assignment: 4 KiB tensors load ~25 % faster
# than through torch's copy_ (call overhead), while 4 MiB ones load ~20 % slower (torch's copy_
# is the faster memcpy for large blocks).
_MEMCPY_MAX = 256 * 1024


def _writable_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> memoryview | None:
    """A writable byte view of ``tensor``'s own storage, or ``None`` when the stored bytes
    cannot be copied in as they are (another dtype, non-contiguous, not on the CPU, empty)."""
    if (
        tensor.dtype != dtype
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() == 0
    ):
        return None
    return tensor_bytes(tensor)  # zero-copy for a contiguous CPU tensor


def read_into(
    path: str | os.PathLike[str], targets: Mapping[str, torch.Tensor], *, verify: bool = True
) -> None:
    """Load tensors of a burnpack file into existing tensors, in place (what resuming does).

    Every name in ``targets`` must be in the file, with the same shape. A contiguous CPU target
    of the stored dtype is filled from the memory-mapped file in steps of 4 MiB,
    each step hashed and then copied while it is still in the CPU cache (one pass over the
    bytes; measured 1.0-1.1x raw ``readinto``, where ``preadv`` into the target took 1.2-1.4x).
    Any other target (another dtype, a view, a GPU tensor) is filled with ``copy_`` after its
    checksum is verified.

    Everything is checked before any target is touched except the checksums of tensors copied
    step by step: if one fails, :class:`ChecksumError` names it and that target holds the
    damaged bytes (reload from an intact checkpoint).

    >>> import tempfile, torch
    >>> path = write(tempfile.mkdtemp() + "/m.bpk", {"w": torch.arange(3.0)})
    >>> w = torch.zeros(3); read_into(path, {"w": w}); w.tolist()
    [0.0, 1.0, 2.0]
    """
    with read(path) as pack:
        plan = []
        for name, target in targets.items():
            info = pack._info(name)
            if tuple(target.shape) != info.shape:
                raise ValidationError(
                    f"{pack.source}: tensor '{name}' has shape {list(info.shape)}, the target "
                    f"{list(target.shape)}"
                )
            dtype = torch_dtype(info.dtype)
            # bytes are the values (bool bytes need the 0/1 check of Pack.tensor)
            plain = _parsed_dtype_info(info.dtype).torch_dtype is dtype and dtype is not torch.bool
            flat = _writable_bytes(target, dtype) if plain else None
            plan.append((name, target, info, flat))
        buffer, data_start, checksums = pack._buffer, pack.data_start, pack.checksums
        with torch.no_grad():
            for name, target, info, flat in plan:
                if flat is None:
                    target.copy_(pack.tensor(name, verify=verify))
                    continue
                if info.nbytes <= _MEMCPY_MAX:  # one step, no torch call
                    flat[:] = pack.raw(name, verify=verify)
                    continue
                start, end = info.data_offsets
                start, end = data_start + start, data_start + end
                expected = checksums.get(name) if verify else None
                source = torch.frombuffer(buffer[start:end], dtype=torch.uint8)
                destination = torch.frombuffer(flat, dtype=torch.uint8)
                hasher = xxhash.xxh3_64()
                for at in range(0, end - start, _COPY_CHUNK):
                    if expected is not None:
                        hasher.update(buffer[start + at : min(start + at + _COPY_CHUNK, end)])
                    destination[at : at + _COPY_CHUNK].copy_(source[at : at + _COPY_CHUNK])
                if expected is not None and hasher.hexdigest() != expected:
                    raise pack._damaged(name)
