"""A file another tool wrote, read through its location's :class:`~lightning_bpk.store.Store`:
the errors of a store as a ``RecordError`` naming the file, and a ``.safetensors`` file mapped
(:meth:`~lightning_bpk.store.Store.map`: on local disk the file itself, copy-on-write, so tensors
are zero-copy views; at a URL an anonymous mapping whose ranges are fetched as they are read),
its header checked before any size or offset in it is used.

Shared by :mod:`lightning_bpk.interop.formats` (a whole file as a ``Content``) and
``_sources`` (a file opened lazily for the loaders), so both read a safetensors file the same
way on local disk and at a URL.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import _device, burnpack
from lightning_bpk.burnpack.base import MAX_RANK, _short
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import open_store

SAFETENSORS_INFO_KEY = "lightning_bpk/burnpack"
"""The ``__metadata__`` entry (JSON) in which a safetensors file written from a burnpack keeps
what safetensors has no place for: the tensors' order, param ids, Burn dtypes and scalars."""
_MAX_SIZE = 2**63  # a torch size is an int64

__all__ = [
    "SAFETENSORS_INFO_KEY",
    "ST_BOOL",
    "BurnInfo",
    "SafetensorsFile",
    "Specs",
    "burn_info",
    "open_safetensors",
    "safetensors_header",
    "st_dtype",
    "st_name",
    "st_order",
    "st_shape",
    "store_errors",
]

ST_BOOL = "BOOL"
"""Safetensors' name of ``torch.bool``."""
# Every dtype name of the safetensors format that torch has a dtype for (the names its Rust
# writer uses; F32..U8 are Burn's names too). ``F4`` counts FP4 values in its shape, two to a
# byte, where torch's ``float4_e2m1fn_x2`` counts bytes: the last dimension differs by 2.
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    ST_BOOL: torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "C64": torch.complex64,
}
_ST_NAMES = {d: n for n, d in _ST_DTYPES.items()}
# The safetensors writer's data order: dtypes in reverse of this order (its Rust enum's), then
# names; a file written in it is byte-identical to the ``safetensors`` package's.
_ST_RANK = {
    n: k
    for k, n in enumerate(
        [
            "BOOL",
            "F4",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "F8_E8M0",
            "F8_E4M3FNUZ",
            "F8_E5M2FNUZ",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "C64",
            "F64",
            "I64",
            "U64",
        ]
    )
}
_ST_F4 = "F4"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Tensor name -> ``(shape, dtype)``, in data order."""


@contextmanager
def store_errors(loc: Path | str) -> Iterator[None]:
    """A store that keeps failing, or a file that cannot be mapped, as a ``RecordError`` of
    kind ``"io"`` naming ``loc``, its cause chained."""
    try:
        yield
    except RecordError:
        raise
    except (OSError, ValueError) as e:
        raise RecordError("io", f"{loc}: cannot read: {e}") from e


def st_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ``ValueError`` naming it when torch has none
    (or it is not one of the format's)."""
    try:
        return _ST_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"safetensors dtype {_short(name)} has no torch dtype") from None


def st_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; ``ValueError`` naming it when the format has none
    (``complex128``, ``complex32``, the sub-byte integers, torch's quantized dtypes).

    >>> st_name(torch.float8_e4m3fn), st_name(torch.bool)
    ('F8_E4M3', 'BOOL')
    """
    try:
        return _ST_NAMES[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors equivalent") from None


def st_order(dtypes: Mapping[str, str]) -> list[str]:
    """Tensor names (``name -> safetensors dtype name``) in the order the ``safetensors``
    package lays their data out: widest dtype first (its enum's order), then by name."""
    return sorted(dtypes, key=lambda n: (-_ST_RANK[dtypes[n]], n))


def st_shape(name: str, shape: tuple[int, ...], *, to_torch: bool) -> tuple[int, ...]:
    """A tensor's shape in torch's terms (``to_torch``) or the header's: the same, except for
    ``F4``, whose header counts values where torch counts bytes of two; ``ValueError`` for an
    ``F4`` shape whose last dimension is not even (half a byte) or that has none."""
    if name != _ST_F4:
        return shape
    if not shape or (to_torch and shape[-1] % 2):
        raise ValueError(f"F4 shape {list(shape)} does not fill whole bytes")
    return (*shape[:-1], shape[-1] // 2 if to_torch else shape[-1] * 2)


def safetensors_header(
    read_at: Callable[[int, int], bytes], size: int, where: Path | str
) -> tuple[tuple[Specs, dict[str, tuple[int, int]], dict[str, str]], int]:
    """Parse and check a safetensors header: ``((specs, offsets, metadata), data start)``.
    Checked before use: the header length, JSON, every dtype, shape and offset pair, each
    tensor's byte count against its shape, every range inside the data and no two overlapping."""
    if size < 8:
        raise RecordError("validation", f"{where}: {size} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", read_at(0, 8))
    if length > min(_MAX_HEADER, size - 8):
        raise RecordError("validation", f"{where}: header length {length} exceeds the file")
    try:
        header = json.loads(read_at(8, 8 + length))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RecordError("validation", f"{where}: not a safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise RecordError("validation", f"{where}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RecordError("validation", f"{where}: '__metadata__' is not a map of strings")
    data = size - 8 - length
    specs: Specs = {}
    offsets: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
        try:
            dtype = st_dtype(entry["dtype"])
            shape = tuple(entry["shape"])
            if entry["dtype"] == _ST_F4 and all(type(n) is int for n in shape):
                shape = st_shape(_ST_F4, shape, to_torch=True)
            begin, end = entry["data_offsets"]
            ok = (
                len(shape) <= MAX_RANK
                and all(type(n) is int and 0 <= n < _MAX_SIZE for n in shape)
                and type(begin) is int
                and type(end) is int
                and 0 <= begin <= end <= data
            )
            numel, nonzero = 1, 1
            for n in shape if ok else ():  # only ints: ``numel * "a"`` would repeat a string
                numel *= n
                nonzero *= max(n, 1)
            # torch's sizes are int64 even where a 0 makes the tensor empty
            ok = ok and nonzero < _MAX_SIZE and end - begin == numel * dtype.itemsize
        except (KeyError, TypeError, ValueError, burnpack.BurnpackError) as e:
            raise RecordError("validation", f"{where}: tensor {name!r}: bad entry: {e}") from e
        if not ok:
            raise RecordError("validation", f"{where}: tensor {name!r}: bad shape or offsets")
        specs[name], offsets[name] = (shape, dtype), (begin, end)
    ranges = sorted(offsets.values())
    if any(a[1] > b[0] for a, b in itertools.pairwise(ranges)):
        raise RecordError("validation", f"{where}: tensors' byte ranges overlap")
    order = sorted(offsets, key=lambda n: offsets[n])
    return ({n: specs[n] for n in order}, offsets, metadata), 8 + length


@dataclass
class SafetensorsFile:
    """A mapped, checked safetensors file: tensors in data order, their byte ranges relative to
    ``start`` (where the data begins), the header's ``__metadata__``."""

    specs: Specs
    offsets: dict[str, tuple[int, int]]
    metadata: dict[str, str]
    start: int
    tensor: Callable[[str], torch.Tensor]  # a view of the mapping (thread-safe)


@contextmanager
def open_safetensors(
    loc: Path | str, options: Mapping[str, Any] | None
) -> Iterator[SafetensorsFile]:
    """The safetensors file at ``loc`` mapped through its store, its header checked
    (:func:`safetensors_header`); the mapping is closed when the block ends, unless tensors
    still view it (then when the last one goes)."""
    with store_errors(loc):
        store = open_store(loc, options, follow_links=True)
        size = store.size("")
        if size is None:
            raise RecordError("io", f"{loc}: no such file or object")
        if size < 8:
            raise RecordError("validation", f"{loc}: {size} bytes, not a safetensors file")
        mapped = store.map("", size)
    buffer = memoryview(mapped.buffer)

    def read_at(begin: int, end: int) -> bytes:
        with store_errors(loc):
            mapped.fetch(begin, end)
        return bytes(buffer[begin:end])

    try:
        (specs, offsets, metadata), start = safetensors_header(read_at, size, loc)

        def tensor(name: str) -> torch.Tensor:
            shape, dtype = specs[name]
            begin, end = offsets[name]
            if begin == end:
                return _device.empty(shape, dtype)
            with store_errors(loc):
                mapped.fetch(start + begin, start + end)
            view = buffer[start + begin : start + end]
            return torch.frombuffer(view, dtype=dtype).reshape(shape)

        yield SafetensorsFile(specs, offsets, metadata, start, tensor)
    finally:
        with contextlib.suppress(BufferError):  # views still alive keep the mapping
            buffer.release()
            mapped.buffer.close()


@dataclass(frozen=True)
class BurnInfo:
    """What :data:`SAFETENSORS_INFO_KEY` holds, checked: the tensors' order (None: not given),
    param ids, Burn dtypes and scalars."""

    order: list[str] | None
    param_ids: dict[str, int]
    dtypes: dict[str, burnpack.DType]
    scalars: dict[str, burnpack.Scalar]
    format_added: bool = False  # the writer added ``"format": "pt"``: not the content's


def burn_info(raw: str | None, where: Path | str) -> BurnInfo | None:
    """The checked :data:`SAFETENSORS_INFO_KEY` entry of a safetensors file (None: it has none,
    a file another tool wrote). The one reader of that entry: every field has its type, a param
    id fits u64, a scalar its kind; anything else is a ``RecordError`` naming the file and the
    field, never an exception of the JSON or of a conversion."""
    if raw is None:
        return None

    def bad(what: str) -> RecordError:
        return RecordError("validation", f"{where}: bad {SAFETENSORS_INFO_KEY} entry: {what}")

    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"not JSON ({type(e).__name__})") from None
    if not isinstance(info, dict):
        raise bad("not a JSON object")

    def mapping(field: str) -> dict[str, Any]:
        value = info.get(field, {})
        if not isinstance(value, dict):
            raise bad(f"{field!r} is not a map")
        return value

    order = info.get("order")
    if order is not None and (
        not isinstance(order, list)
        or not all(isinstance(n, str) for n in order)
        or len(set(order)) != len(order)
    ):
        raise bad("'order' is not a list of distinct tensor names")
    param_ids = {}
    for name, value in mapping("param_ids").items():
        text = str(value) if type(value) is int else value
        if not isinstance(text, str) or not text.isdecimal() or not 0 <= int(text) < 2**64:
            raise bad(f"param id of {_short(name)} is not a u64: {_short(value)}")
        param_ids[name] = int(text)
    dtypes = mapping("dtypes")
    for name, dtype in dtypes.items():
        if not isinstance(dtype, (str, dict)):
            raise bad(f"dtype of {_short(name)} is {_short(dtype)}")
    scalars = {}
    for name, pair in mapping("scalars").items():
        try:
            kind, value = pair
            if kind == "Float":
                value = float.fromhex(value)
            scalars[name] = burnpack.Scalar(kind, value)
        except (TypeError, ValueError) as e:
            raise bad(f"scalar {_short(name)}: {_short(pair)} ({e})") from None
    format_added = info.get("format_added", False)
    if not isinstance(format_added, bool):
        raise bad("'format_added' is not a bool")
    return BurnInfo(order, param_ids, dtypes, scalars, format_added)
