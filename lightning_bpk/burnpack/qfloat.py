"""Burn's quantized tensors (dtype ``{"QFloat": QuantScheme}``) decoded to torch and encoded
from torch, for the schemes whose arithmetic is plain: 8-bit values ``Q8F``/``Q8S`` (integers)
and ``E4M3``/``E5M2`` (fp8), symmetric, with one scale per tensor or one per block.

The reader and writer carry QFloat tensors as opaque bytes (their length is not
``shape x element size``); this module gives them values. A ``QuantScheme`` is the map Burn
writes (keys in this order)::

    {"value": "Q8S", "store": "Native" | {"PackedU32": 0}, "mode": "Symmetric",
     "tensor": "F32" | None, "block": {"size": {"storage": [32, 0, 0, 0, 0], "len": 1},
     "dtype": "F32"} | None}

and the bytes are the values (one byte each, row-major; ``PackedU32`` packs four to a
little-endian u32, the same bytes, padded to whole words), padded to 4 bytes, then the scales
(one per tensor, or one per block in row-major order over the block grid; a block covers the
trailing ``len`` dims). ``real = value x scale``. Encoding takes the scale so the largest
magnitude of the tensor (or block) lands on the value type's largest: ``127`` for ``Q8S``
(``-127..127``), ``255/2`` for ``Q8F`` (``-128..127``, the full range), 448 for ``E4M3``, 57344
for ``E5M2``. The field set of ``QuantScheme`` follows cubecl at the revision Burn pins and may
differ in other Burn versions; 4- and 2-bit values and lookup modes are refused by name.

Example::

    >>> import torch
    >>> entry = encode(torch.tensor([1.0, -2.0, 0.5, 4.0]), "Q8S")
    >>> entry.dtype["QFloat"]["value"], entry.nbytes  # 4 values, then one F32 scale
    ('Q8S', 8)
    >>> decode(entry.dtype, entry.shape, entry.data)
    tensor([ 1.0079, -2.0157,  0.5039,  4.0000])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_bpk.burnpack.base import DType, ValidationError
from lightning_bpk.burnpack.entry import BytesLike, TensorEntry, tensor_bytes

__all__ = ["decode", "encode", "scheme"]

# value type -> (stored torch dtype, largest magnitude the scale maps to, clamp range)
_VALUES: dict[str, tuple[torch.dtype, float, tuple[float, float]]] = {
    "Q8S": (torch.int8, 127.0, (-127.0, 127.0)),
    "Q8F": (torch.int8, 127.5, (-128.0, 127.0)),
    "E4M3": (torch.float8_e4m3fn, 448.0, (-448.0, 448.0)),
    "E5M2": (torch.float8_e5m2, 57344.0, (-57344.0, 57344.0)),
}
_SCALES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "UE8M0": torch.float8_e8m0fnu,
}
_MAX_DIMS = 5  # cubecl's BlockSize holds up to 5 dims


def scheme(
    value: str = "Q8S",
    *,
    block: Sequence[int] | None = None,
    scale_dtype: str = "F32",
    store: str | dict[str, int] = "Native",
) -> dict[str, Any]:
    """A ``QuantScheme`` map (the payload of ``{"QFloat": ...}``): per-tensor scale, or per
    ``block`` (its size over the trailing dims)."""
    if value not in _VALUES or scale_dtype not in _SCALES:
        raise ValidationError(
            f"QFloat value {value!r} with {scale_dtype!r} scales is not one this codec handles "
            f"(values {sorted(_VALUES)}, scales {sorted(_SCALES)})"
        )
    if block is None:
        return {"value": value, "store": store, "mode": "Symmetric", "tensor": scale_dtype,
                "block": None}  # fmt: skip
    dims = [int(d) for d in block]
    if not 0 < len(dims) <= _MAX_DIMS or min(dims) < 1:
        raise ValidationError(f"QFloat block size {dims} must have 1 to 5 positive dims")
    size = {"storage": dims + [0] * (_MAX_DIMS - len(dims)), "len": len(dims)}
    return {"value": value, "store": store, "mode": "Symmetric", "tensor": None,
            "block": {"size": size, "dtype": scale_dtype}}  # fmt: skip


def _parse(dtype: DType) -> tuple[str, str, list[int] | None]:
    """``(value, scale dtype, block dims or None)`` of a QFloat dtype this codec handles."""
    s = dtype.get("QFloat") if isinstance(dtype, dict) else None
    if not isinstance(s, dict):
        raise ValidationError(f"dtype {dtype!r} is not QFloat")
    value, store, mode = s.get("value"), s.get("store"), s.get("mode")
    packed = isinstance(store, dict) and set(store) == {"PackedU32"}
    if value not in _VALUES or mode != "Symmetric" or not (store == "Native" or packed):
        raise ValidationError(
            f"QFloat scheme value={value!r} store={store!r} mode={mode!r}: only 8-bit values "
            f"({', '.join(sorted(_VALUES))}), Native or PackedU32, Symmetric are decoded"
        )
    block = s.get("block")
    if block is None:
        if s.get("tensor") not in _SCALES:
            raise ValidationError(f"QFloat scheme has no scale dtype this codec reads: {s!r}")
        return value, s["tensor"], None
    size = block.get("size", {}) if isinstance(block, dict) else {}
    dims = list(size.get("storage", []))[: size.get("len", 0)]
    if not dims or block.get("dtype") not in _SCALES or min(dims) < 1:
        raise ValidationError(f"QFloat block {block!r} is not one this codec reads")
    return value, block["dtype"], dims


def _grid(shape: Sequence[int], block: list[int] | None) -> tuple[list[int], list[int]]:
    """``(block over every dim, blocks per dim)``: the block aligned to the trailing dims."""
    if block is None:
        return list(shape), [1] * len(shape)
    if len(block) > len(shape):
        raise ValidationError(f"QFloat block {block} has more dims than shape {list(shape)}")
    full = [1] * (len(shape) - len(block)) + block
    if any(n % b for b, n in zip(full, shape, strict=True)):
        raise ValidationError(f"QFloat block {block} does not divide shape {list(shape)}")
    return full, [n // b for b, n in zip(full, shape, strict=True)]


def _blocked(x: torch.Tensor, full: list[int], counts: list[int]) -> torch.Tensor:
    """``x`` viewed as ``[c0, b0, c1, b1, ...]``: blocks along the odd dims."""
    return x.reshape([v for pair in zip(counts, full, strict=True) for v in pair])


def _padded(n: int) -> int:
    return -(-n // 4) * 4


def decode(dtype: DType, shape: Sequence[int], data: BytesLike) -> torch.Tensor:
    """The float32 values of a QFloat tensor's bytes (``Pack.raw``): values x scales."""
    value, scale_name, block = _parse(dtype)
    numel = math.prod(shape)
    full, counts = _grid(shape, block)
    n_scales = math.prod(counts)
    scale_dtype = _SCALES[scale_name]
    need = _padded(numel) + _padded(n_scales * scale_dtype.itemsize)
    raw = memoryview(data).cast("B")
    if raw.nbytes != need:
        raise ValidationError(
            f"QFloat {value} tensor of shape {list(shape)}: {raw.nbytes} bytes, expected {need}"
        )
    buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    values = buffer[:numel].view(_VALUES[value][0]).to(torch.float32)
    start = _padded(numel)
    scales = buffer[start : start + n_scales * scale_dtype.itemsize].view(scale_dtype)
    blocks = _blocked(values, full, counts)
    grid = scales.to(torch.float32).reshape([v for c in counts for v in (c, 1)])
    return (blocks * grid).reshape(list(shape))


def encode(
    tensor: torch.Tensor,
    value: str = "Q8S",
    *,
    block: Sequence[int] | None = None,
    scale_dtype: str = "F32",
    param_id: int | None = None,
) -> TensorEntry:
    """A :class:`TensorEntry` of ``tensor`` quantized to a QFloat scheme (:func:`scheme`), for
    :func:`~lightning_bpk.burnpack.write`: symmetric, one scale per tensor or per ``block``."""
    qs = scheme(value, block=block, scale_dtype=scale_dtype)
    stored, top, (lo, hi) = _VALUES[value]
    x = tensor.detach().to(torch.float32).cpu()
    full, counts = _grid(tuple(x.shape), None if block is None else list(block))
    blocks = _blocked(x, full, counts)
    dims = tuple(range(1, blocks.dim(), 2))
    amax = blocks.abs().amax(dim=dims, keepdim=True) if dims else blocks.abs()
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    scale = scale.to(_SCALES[scale_dtype]).to(torch.float32)  # the scale as stored
    q = (blocks / scale).clamp(lo, hi)
    q = q.round().to(stored) if stored == torch.int8 else q.to(stored)
    values = bytes(tensor_bytes(q.reshape(-1).contiguous().view(torch.uint8)))
    scales = bytes(tensor_bytes(scale.reshape(-1).to(_SCALES[scale_dtype]).contiguous()))
    data = values.ljust(_padded(len(values)), b"\0") + scales.ljust(_padded(len(scales)), b"\0")
    return TensorEntry({"QFloat": qs}, tuple(x.shape), data, param_id=param_id)
