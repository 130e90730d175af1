"""The metadata of a burnpack file, decoded strictly: hostile CBOR (tags, depth, trailing
bytes, wrong types) becomes a :class:`~lightning_bpk.burnpack.MetadataError` naming what is
wrong, and each tensor's descriptor a checked :class:`TensorInfo`, before the reader uses any
size or offset in it (:mod:`lightning_bpk.burnpack.reader`)."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cbor2
import torch

from lightning_bpk.burnpack.base import (
    _I64_MAX,
    _MAX_CBOR_DEPTH,
    _SIMPLE_DTYPES,
    _TORCH_DTYPE_KEY,
    _U64_MAX,
    MAX_RANK,
    DType,
    MetadataError,
    Scalar,
    _carried_spec,
    _dtype_info,
    _short,
    _torch_dtype,
)

__all__ = ["TensorInfo", "decode_metadata", "parse_descriptor", "parse_scalar", "parse_string_map"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's descriptor as stored: Burn dtype, shape, offsets relative to the data section,
    and, for a tensor Burn has no dtype for, the torch dtype it is read as (``carried``: its
    Burn ``dtype`` is a stand-in of the same bytes, named by the descriptor key ``torch_dtype``)."""

    dtype: DType
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    param_id: int | None
    carried: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]

    def torch_spec(self) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the tensor as torch reads it: a carried complex tensor drops
        the trailing 2 of its stored real and imaginary parts; ``BurnpackError`` for QFloat."""
        if self.carried is None:
            return self.shape, _torch_dtype(self.dtype)
        return self.shape[:-1] if self.carried.is_complex else self.shape, self.carried


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


def decode_metadata(blob: memoryview) -> dict:
    """The CBOR map of the metadata section, decoded with limits (depth, no tags, no trailing
    bytes); a :class:`MetadataError` saying what is wrong otherwise."""
    decoder = cbor2.CBORDecoder(
        io.BytesIO(blob),
        max_depth=_MAX_CBOR_DEPTH,
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


_INT = {int}


def _is_uint(value: object, limit: int) -> bool:
    # ``type() is int`` also excludes bool; cbor2 decodes integers as plain ints.
    return type(value) is int and 0 <= value <= limit


def parse_descriptor(name: object, desc: object) -> TensorInfo:
    """Tensor ``name``'s descriptor checked: a known dtype, a bounded shape, offsets that fit
    its bytes, an optional digest; a :class:`MetadataError` naming the tensor otherwise."""
    # Hot for packs with many tensors (5,000 in a few ms): error messages are only formatted on
    # failure, and the common cases are tested first with builtins, not calls.
    if type(name) is not str:
        raise MetadataError(f"tensor name {_short(name)} is not a text string")
    if type(desc) is not dict:
        raise MetadataError(f"tensor '{name}': descriptor is not a map")
    dtype: Any = desc.get("dtype")
    shape, offsets = desc.get("shape"), desc.get("data_offsets")
    if dtype is None or shape is None or offsets is None:
        for key in ("dtype", "shape", "data_offsets"):
            if key not in desc:
                raise MetadataError(f"tensor '{name}': missing field '{key}'")
    if (_SIMPLE_DTYPES.get(dtype) if type(dtype) is str else _dtype_info(dtype)) is None:
        raise MetadataError(f"tensor '{name}': unknown dtype {_short(dtype)}")
    # torch sizes are int64, so a larger dimension could never be materialized. ``type() is
    # int`` also excludes bool; cbor2 decodes integers as plain ints.
    if not (
        type(shape) is list
        and len(shape) <= MAX_RANK
        and (not shape or (set(map(type, shape)) == _INT and min(shape) >= 0))
        and (not shape or max(shape) <= _I64_MAX)
    ):
        raise MetadataError(
            f"tensor '{name}': shape must be a list of at most {MAX_RANK} dimensions, "
            f"each in 0..2**63-1, got {_short(shape)}"
        )
    if not (type(offsets) is list and len(offsets) == 2 and set(map(type, offsets)) == _INT):
        offsets = None
    else:
        start, end = offsets
        if not (0 <= start <= _U64_MAX and 0 <= end <= _U64_MAX):
            offsets = None
    if offsets is None:
        raise MetadataError(
            f"tensor '{name}': data_offsets must be [start, end] as u64, got "
            f"{_short(desc['data_offsets'])}"
        )
    param_id = desc.get("param_id")
    if param_id is not None and not _is_uint(param_id, _U64_MAX):
        raise MetadataError(f"tensor '{name}': param_id must be a u64, got {_short(param_id)}")
    carried = desc.get(_TORCH_DTYPE_KEY)
    if carried is None:
        return TensorInfo(dtype, tuple(shape), (start, end), param_id)
    spec = _carried_spec(carried, dtype, tuple(shape))
    if spec is None:
        raise MetadataError(
            f"tensor '{name}': {_TORCH_DTYPE_KEY} {_short(carried)} is not a torch dtype stored "
            f"as {_short(dtype)} with shape {_short(shape)}"
        )
    return TensorInfo(dtype, tuple(shape), (start, end), param_id, spec[0])


def parse_scalar(name: object, value: object) -> Scalar:
    """Scalar ``name`` as stored (``{kind: value}``), checked against its kind's range."""
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


def parse_string_map(value: object) -> dict[str, str]:
    """The ``metadata`` map: text keys to text values only."""
    if not isinstance(value, dict):
        raise MetadataError("'metadata' must be a map of text to text")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise MetadataError(f"metadata entry {_short(k)}: keys and values must be text")
    return value
