"""Quantized checkpoints as conversions: ops for a
:class:`~lightning_bpk.interop.conversions.WeightConverter` that dequantize at load and, where
the format allows, quantize again at save.

- :class:`Fp8Dequantize` <-> :class:`Fp8Quantize`: block-scaled FP8 (DeepSeek-V3 style, what
  transformers' ``FineGrainedFP8Config`` loads): ``W.weight`` in ``float8_e4m3fn`` ``[N, K]`` and
  ``W.weight_scale_inv`` (float32, or ``float8_e8m0fnu``/``uint8`` E8M0 exponents) with one
  value per block, ``[ceil(N/bn), ceil(K/bk)]``; despite its name the scale is the multiplier:
  ``real = fp8 x weight_scale_inv[block]``. The block size comes from the scale grid, which must
  divide the weight (transformers' ``Fp8Dequantize`` rule). Quantizing takes each block's
  largest magnitude to 448 (e4m3's largest), an all-zero block keeps scale 1.
- :class:`Mxfp4Dequantize`: gpt_oss MXFP4 experts, ``*_blocks`` (uint8, two E2M1 values a byte,
  low nibble first, ``[..., G, B]``) and ``*_scales`` (uint8 E8M0 exponents, ``[..., G]``):
  ``value = E2M1[nibble] x 2**(scale - 127)``, reshaped to ``[..., G*B*2]`` and transposed on
  dims 1 and 2, as transformers' ``convert_moe_packed_tensors`` does. One way: transformers saves
  it back unchanged (its reverse is an identity), so saving raises a ``RemapError`` here.

The arithmetic is transformers 5.23's (``integrations/finegrained_fp8.py``,
``integrations/mxfp4.py``): the results are ``torch.equal`` to its functions'.

Example, a DeepSeek-style checkpoint into a plain ``nn.Linear``::

    >>> import torch
    >>> from lightning_bpk.interop import KeyRemapper, WeightConverter
    >>> dequantize = WeightConverter(
    ...     ["weight", "weight_scale_inv"],
    ...     "weight",
    ...     [Fp8Dequantize(dtype=torch.float32, block_size=(1, 2))],  # DeepSeek: (128, 128)
    ... )
    >>> w = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    >>> saved = KeyRemapper([dequantize]).save({"l.weight": (w, None)}).tensors
    >>> sorted(saved), saved["l.weight"][0].dtype
    (['l.weight', 'l.weight_scale_inv'], torch.float8_e4m3fn)
    >>> loaded = KeyRemapper([dequantize]).load(saved).tensors["l.weight"][0]
    >>> torch.allclose(loaded, w)
    True
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_bpk.interop.ops import ConversionOps, Tensors
from lightning_bpk.interop.rules import RemapError

__all__ = ["E2M1_VALUES", "FP8_E4M3_MAX", "Fp8Dequantize", "Fp8Quantize", "Mxfp4Dequantize"]

FP8_E4M3_MAX = 448.0
"""The largest ``float8_e4m3fn`` value: a block's largest magnitude is scaled to it."""
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""The FP4 (E2M1) value of each nibble: bit 3 is the sign."""
_E8M0_BIAS = 127


def _e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Scales as float32 multipliers: E8M0 exponents (uint8 or ``float8_e8m0fnu``) decoded."""
    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - _E8M0_BIAS).exp2()
    return scales.to(torch.float32)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values a byte, low nibble first -> float32, the last dim twice as wide."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    pair = torch.stack([lut[(u8 & 0xF).long()], lut[((u8 >> 4) & 0xF).long()]], dim=-1)
    return pair.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


class _Dequantize(ConversionOps):
    """A converter of two sources, the values and their scales, each pair dequantized into
    one target (one tensor, or a list of them: the experts of a fused rule)."""

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        if len(source_patterns) != 2 or any(p not in input_dict for p in source_patterns):
            raise RemapError(f"{self!r}: needs two sources, the values and their scales")
        values, scales = (input_dict[p] for p in source_patterns)
        values = values if isinstance(values, list) else [values]
        scales = scales if isinstance(scales, list) else [scales]
        if len(values) != len(scales):
            raise RemapError(f"{self!r}: {len(values)} tensors but {len(scales)} scales")
        out = [self.dequantize(v, s) for v, s in zip(values, scales, strict=True)]
        return {target_patterns[0]: out if len(out) > 1 else out[0]}


class Fp8Dequantize(_Dequantize):
    """Sources ``[weight, weight_scale_inv]`` -> the weight in ``dtype`` (see the module docs);
    ``int8``/``float4_e2m1fn_x2`` weights are FP4 pairs, unpacked first. Reverse:
    :class:`Fp8Quantize` with ``block_size``."""

    def __init__(
        self, dtype: torch.dtype = torch.bfloat16, block_size: tuple[int, int] = (128, 128)
    ) -> None:
        self.dtype = dtype
        self.block_size: tuple[int, int] = (int(block_size[0]), int(block_size[1]))

    def dequantize(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """One weight times its block scales, in float32, cast to ``dtype``."""
        if weight.dtype in (torch.int8, torch.float4_e2m1fn_x2):
            values = _unpack_e2m1(weight)
        else:
            values = weight.to(torch.float32)
        rows, cols = values.shape[-2:]
        grid = scales.shape[-2:] if scales.dim() >= 2 else (1, 1)
        if rows % grid[0] or cols % grid[1]:
            raise RemapError(
                f"{self!r}: weight {list(values.shape)} is not divisible by its scale grid "
                f"{list(grid)}"
            )
        q = values.reshape(-1, grid[0], rows // grid[0], grid[1], cols // grid[1])
        s = _e8m0(scales).reshape(-1, grid[0], grid[1]).unsqueeze(-1).unsqueeze(2)
        return (q * s).to(self.dtype).reshape(values.shape)

    @property
    def reverse_op(self) -> ConversionOps:
        return Fp8Quantize(self.block_size, self.dtype)


class Fp8Quantize(ConversionOps):
    """One weight -> ``[weight, weight_scale_inv]``: ``float8_e4m3fn`` values and a float32
    scale per ``block_size`` block (its largest magnitude over 448; 1 for an all-zero block).
    Reverse: :class:`Fp8Dequantize` to ``dtype``."""

    def __init__(
        self, block_size: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.block_size: tuple[int, int] = (int(block_size[0]), int(block_size[1]))
        self.dtype = dtype

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 values, scale_inv grid)`` of one 2-d weight (or a stack of them)."""
        bn, bk = self.block_size
        rows, cols = weight.shape[-2:]
        if weight.dim() < 2 or rows % bn or cols % bk:
            raise RemapError(
                f"{self!r}: weight {list(weight.shape)} is not divisible into {bn}x{bk} blocks"
            )
        x = weight.to(torch.float32).reshape(-1, rows // bn, bn, cols // bk, bk)
        amax = x.abs().amax(dim=(2, 4), keepdim=True)
        scale = torch.where(amax > 0, FP8_E4M3_MAX / amax, torch.ones_like(amax))
        q = (x * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        inv = (1.0 / scale).reshape(*weight.shape[:-2], rows // bn, cols // bk)
        return q.reshape(weight.shape), inv

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        if len(input_dict) != 1 or len(target_patterns) != 2:
            raise RemapError(f"{self!r}: quantizes one weight into its values and scales")
        value = next(iter(input_dict.values()))
        weights = value if isinstance(value, list) else [value]
        pairs = [self.quantize(w) for w in weights]
        values = [q for q, _ in pairs]
        scales = [s for _, s in pairs]
        if len(pairs) == 1:
            return {target_patterns[0]: values[0], target_patterns[1]: scales[0]}
        return {target_patterns[0]: values, target_patterns[1]: scales}

    @property
    def reverse_op(self) -> ConversionOps:
        return Fp8Dequantize(self.dtype, self.block_size)


class Mxfp4Dequantize(_Dequantize):
    """Sources ``[*_blocks, *_scales]`` (gpt_oss MXFP4) -> the dequantized experts in ``dtype``
    (see the module docs). One way: its reverse refuses to save."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """transformers' ``convert_moe_packed_tensors``, in one piece."""
        if blocks.shape[:-1] != scales.shape or blocks.dim() < 3:
            raise RemapError(
                f"{self!r}: blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
            )
        *prefix, groups, width = blocks.shape
        lut = torch.tensor(E2M1_VALUES, dtype=self.dtype, device=blocks.device)
        u8 = blocks.to(torch.uint8).reshape(-1, width)
        out = torch.empty(u8.shape[0], width * 2, dtype=self.dtype, device=blocks.device)
        out[:, 0::2] = lut[(u8 & 0x0F).to(torch.int)]
        out[:, 1::2] = lut[(u8 >> 4).to(torch.int)]
        exponents = (scales.to(torch.int32) - _E8M0_BIAS).reshape(-1, 1)
        out = torch.ldexp(out, exponents).to(self.dtype)
        return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()

    @property
    def reverse_op(self) -> ConversionOps:
        return _Refuse("MXFP4 is dequantized one way (transformers saves it unchanged)")


class _Refuse(ConversionOps):
    """The reverse of a one-way op: saving through it is a RemapError saying why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        raise RemapError(f"cannot save {sorted(input_dict)}: {self.why}")

    @property
    def reverse_op(self) -> ConversionOps:
        raise RemapError(self.why)
