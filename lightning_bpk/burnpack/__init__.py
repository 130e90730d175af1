"""Burn's burnpack v1 container (``.bpk``), read and written byte-compatibly with Burn.

Layout of a file::

    0      4       6              10                        data_start (multiple of 256)
    | NRUB | 01 00 | metadata_size | CBOR metadata | zeros  | tensor 0 | zeros | tensor 1 | ...

The CBOR metadata is ``{"tensors": {name: {"dtype", "shape", "data_offsets", "param_id"?}},
"metadata"?: {str: str}, "scalars"?: {str: Scalar}}`` encoded exactly as Burn's ``ciborium``
writer does, so a file written here is byte-identical to Burn's for the same content.

torch dtypes Burn has no name for (fp8, fp4, complex) are stored in a Burn dtype of the same
bytes, the torch dtype named in a descriptor key Burn ignores (``torch_dtype``), and read back
as that dtype; :mod:`lightning_bpk.burnpack.qfloat` decodes and encodes Burn's quantized
``QFloat`` tensors.

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

from lightning_bpk.burnpack._metadata import TensorInfo
from lightning_bpk.burnpack.base import (
    CHECKSUM_PREFIX,
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
)

# The ``name as name`` imports are cross-layer internals (the storage, DCP, sharded and CLI layers
# import them from here): importable, but not public, so not in __all__ nor in the API docs.
from lightning_bpk.burnpack.base import HEADER_SIZE as HEADER_SIZE
from lightning_bpk.burnpack.base import MAX_FILE_SIZE as MAX_FILE_SIZE
from lightning_bpk.burnpack.base import MAX_METADATA_SIZE as MAX_METADATA_SIZE
from lightning_bpk.burnpack.base import MAX_RANK as MAX_RANK
from lightning_bpk.burnpack.base import TENSOR_ALIGNMENT as TENSOR_ALIGNMENT
from lightning_bpk.burnpack.base import _burn_dtype as _burn_dtype
from lightning_bpk.burnpack.base import _decode_json as _decode_json
from lightning_bpk.burnpack.base import _torch_dtype as _torch_dtype
from lightning_bpk.burnpack.entry import BytesLike, TensorEntry
from lightning_bpk.burnpack.entry import tensor_bytes as tensor_bytes
from lightning_bpk.burnpack.reader import Pack, loads, read, read_into
from lightning_bpk.burnpack.writer import (
    TensorsArg,
    data_section_start,
    dumps,
    offsets,
    size,
    write,
)

__all__ = [
    "CHECKSUM_PREFIX",
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
    "data_section_start",
    "dumps",
    "loads",
    "offsets",
    "read",
    "read_into",
    "size",
    "write",
]
