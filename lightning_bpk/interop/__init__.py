"""Interop with Burn and other tools: adapters, key remapping and file formats.

- :mod:`~lightning_bpk.interop.adapters`: :class:`BurnToPyTorchAdapter`,
  :class:`PyTorchToBurnAdapter` for ``ModuleRecord.apply``/``from_module``;
- :mod:`~lightning_bpk.interop.rules`: what every rule shares (:class:`Rule`,
  :class:`RemapError`, the items rules move and the tracing the loaders follow);
- :mod:`~lightning_bpk.interop.ops`: transformers' reversible ops :class:`Chunk`,
  :class:`Concatenate`, :class:`MergeModulelist`, :class:`SplitModulelist`,
  :class:`Transpose` (with a pattern, a rule of its own), :class:`PermuteForRope`,
  :class:`Interleave`;
- :mod:`~lightning_bpk.interop.conversions`: transformers' vocabulary as rules,
  :class:`WeightRenaming`, :class:`PrefixChange` and :class:`WeightConverter` (with the ops);
- :mod:`~lightning_bpk.interop.remap`: :class:`KeyRemapper` with :class:`Rename`,
  :class:`Split`, :class:`Unstack` rules, inverted on save;
- :mod:`~lightning_bpk.interop.hub`: :func:`rules_for` a model type or instance (transformers'
  registry when installed, this package's table otherwise), :func:`save_pretrained` back to
  the checkpoint's layout, :func:`tied_weights`;
- :mod:`~lightning_bpk.interop.loading`: :func:`load_remapped`, the same on a thread pool, from
  a file or a checkpoint set (a ``model.safetensors.index.json`` or ``model.bpk.index.json``
  and its shards, or their directory; local or at a URL);
- :mod:`~lightning_bpk.interop.shards`: :func:`load_into_shards`, a full file straight into an
  FSDP2 / tensor-parallel module, each rank reading only its shards' bytes;
- :mod:`~lightning_bpk.interop.sets`: :func:`read_any` file or set, :func:`write_set` a
  sharded set with its index, :func:`is_set`, :func:`describe_set`;
- :mod:`~lightning_bpk.interop.select`: Burn's store filters as rules, :class:`KeyFilter`
  (regex and full paths) and :class:`Renumber` (layer indices made contiguous);
- :mod:`~lightning_bpk.interop.quant`: quantized checkpoints as ops of a converter,
  :class:`Fp8Dequantize` <-> :class:`Fp8Quantize` (block-scaled FP8) and
  :class:`Mxfp4Dequantize` (gpt_oss);
- :mod:`~lightning_bpk.interop.lazy`: :func:`open_tensors`, a file or set opened as
  ``safetensors.safe_open`` opens one, whose slices read only their own bytes;
- :mod:`~lightning_bpk.interop.formats`: ``.bpk`` <-> ``.safetensors``, ``.pt``/``.ckpt``
  import (``weights_only=True``), checkpoint export.

The modules import only downward: ``rules`` <- ``ops`` <- ``conversions``, and ``rules`` <-
``_patterns``, both <- ``remap``; ``ops`` <- ``quant``; ``rules`` <- ``select``; ``_mapped`` (a
file read through its store: errors, the safetensors header) <- ``formats`` <- ``_index``
(finding and checking a set) <-
``_sources`` (files and sets opened) <- ``_plan`` (what both loaders share) <- ``loading``, and
``_ranges`` (boxes of stored tensors read in byte ranges), ``_dims`` <- ``shards``; ``_ranges``
<- ``lazy``; ``sets`` on ``_sources``; ``hub`` on top; ``_placing`` (the tensors a converter
builds its results in) <- ``conversions`` and ``loading``. No interop module imports a private
name of another.
"""

from lightning_bpk.interop._ties import tied_weights
from lightning_bpk.interop.adapters import (
    BurnToPyTorchAdapter,
    HalfPrecisionAdapter,
    PyTorchToBurnAdapter,
)
from lightning_bpk.interop.conversions import PrefixChange, WeightConverter, WeightRenaming
from lightning_bpk.interop.formats import (
    SAFETENSORS_INFO_KEY,
    Content,
    convert,
    export_checkpoint,
    load_module_record,
    read_content,
    save_module_record,
    write_content,
)
from lightning_bpk.interop.hub import (
    COVERED,
    BaseModelPrefix,
    peft_rules,
    rules_for,
    save_pretrained,
)
from lightning_bpk.interop.lazy import LazyTensors, TensorSlice, open_tensors
from lightning_bpk.interop.loading import LoadResult, load_remapped
from lightning_bpk.interop.ops import (
    Chunk,
    Concatenate,
    ConversionOps,
    Interleave,
    MergeModulelist,
    PermuteForRope,
    SplitModulelist,
    Transpose,
)
from lightning_bpk.interop.quant import Fp8Dequantize, Fp8Quantize, Mxfp4Dequantize
from lightning_bpk.interop.remap import (
    KeyRemapper,
    RemapResult,
    Rename,
    Split,
    Unstack,
    apply_remapped,
    derive_inverse,
    record_remapped,
)
from lightning_bpk.interop.rules import RemapError, Rule
from lightning_bpk.interop.select import KeyFilter, Renumber
from lightning_bpk.interop.sets import describe_set, is_set, read_any, write_set
from lightning_bpk.interop.shards import ShardedLoad, load_into_shards

__all__ = [
    "COVERED",
    "SAFETENSORS_INFO_KEY",
    "BaseModelPrefix",
    "BurnToPyTorchAdapter",
    "Chunk",
    "Concatenate",
    "Content",
    "ConversionOps",
    "Fp8Dequantize",
    "Fp8Quantize",
    "HalfPrecisionAdapter",
    "Interleave",
    "KeyFilter",
    "KeyRemapper",
    "LazyTensors",
    "LoadResult",
    "MergeModulelist",
    "Mxfp4Dequantize",
    "PermuteForRope",
    "PrefixChange",
    "PyTorchToBurnAdapter",
    "RemapError",
    "RemapResult",
    "Rename",
    "Renumber",
    "Rule",
    "ShardedLoad",
    "Split",
    "SplitModulelist",
    "TensorSlice",
    "Transpose",
    "Unstack",
    "WeightConverter",
    "WeightRenaming",
    "apply_remapped",
    "convert",
    "derive_inverse",
    "describe_set",
    "export_checkpoint",
    "is_set",
    "load_into_shards",
    "load_module_record",
    "load_remapped",
    "open_tensors",
    "peft_rules",
    "read_any",
    "read_content",
    "record_remapped",
    "rules_for",
    "save_module_record",
    "save_pretrained",
    "tied_weights",
    "write_content",
    "write_set",
]
