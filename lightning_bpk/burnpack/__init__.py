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

from lightning_bpk.burnpack.base import (
    CHECKSUM_PREFIX,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAGIC_BYTES,
    MAX_CBOR_DEPTH,
    MAX_FILE_SIZE,
    MAX_JSON_DEPTH,
    MAX_METADATA_SIZE,
    MAX_RANK,
    MAX_TENSOR_COUNT,
    MAX_TENSOR_SIZE,
    TENSOR_ALIGNMENT,
    BurnpackError,
    BurnpackIOError,
    ChecksumError,
    DType,
    HeaderError,
    MagicError,
    MetadataError,
    Scalar,
    ScalarKind,
    SizeMismatchError,
    TensorNotFoundError,
    ValidationError,
    VersionError,
    burn_dtype,
    decode_json,
    torch_dtype,
)
from lightning_bpk.burnpack.reader import (
    Pack,
    TensorInfo,
    loads,
    read,
    read_into,
    resolve_path,
)
from lightning_bpk.burnpack.writer import (
    BytesLike,
    TensorEntry,
    TensorsArg,
    data_section_start,
    dumps,
    size,
    tensor_bytes,
    with_suffix,
    write,
)

__all__ = [
    "CHECKSUM_PREFIX",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAGIC_BYTES",
    "MAX_CBOR_DEPTH",
    "MAX_FILE_SIZE",
    "MAX_JSON_DEPTH",
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
    "decode_json",
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
