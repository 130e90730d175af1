"""What several ``tests/test_burnpack_*.py`` files share, defined once: small builders of
entries and bytes, the comparison of a tensor read back, Burn's fixture file, the dtype
tables, the default QFloat scheme, a mixed set of tensor sizes, and the fuzz oracle
:func:`parse_fully` (which ``tests/fuzz/fuzz_burnpack.py`` imports too).

Test modules import these names directly (``from _burnpack_helpers import f32``): ``tests/`` is
on the import path, as for ``conftest``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import TensorEntry

from conftest import MNIST_BPK

MNIST = MNIST_BPK


def f32(*values: float) -> bytes:
    """``values`` as little-endian f32 bytes: the stored form of an F32 tensor."""
    return struct.pack(f"<{len(values)}f", *values)


def mk(dtype, shape, data, **kw):
    """A TensorEntry from bytes."""
    return TensorEntry(dtype, shape, data, **kw)


def listdir(path: Path) -> list[str]:
    """The names in directory ``path``, sorted: what a failed write must (not) leave there."""
    return sorted(os.listdir(path))


def _entries_in_data_order(pack: burnpack.Pack) -> dict[str, TensorEntry]:
    """Every tensor of ``pack`` as an entry of its stored bytes, in data order: writing them
    again must give the same file."""
    order = pack.data_order
    return {
        n: TensorEntry(
            pack.entries[n].dtype, pack.entries[n].shape, pack.raw(n), pack.entries[n].param_id
        )
        for n in order
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes (NaNs and -0.0 included): what a reader must give
    back for a tensor that was written."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and burnpack.tensor_bytes(a).tobytes() == burnpack.tensor_bytes(b).tobytes()
    )


# Burn's numeric dtypes and the torch dtype each reads as (docs/format.md).
TORCH_DTYPES = {
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
}

# Every torch dtype a burnpack stores.
_ALL_DTYPES = [*TORCH_DTYPES.values(), torch.bool]

# cubecl's default QuantScheme, in its field order (the spec's section 3).
_DEFAULT_SCHEME = {
    "value": "Q8F",
    "store": {"PackedU32": 0},
    "mode": "Symmetric",
    "tensor": None,
    "block": None,
}


def _mixed(n: int = 300) -> dict[str, torch.Tensor]:
    """Tensors of many sizes (1 byte to several read steps) in one file, padding between them."""
    g = torch.Generator().manual_seed(n)
    out = {f"s{i}": torch.randn(i % 37 + 1, generator=g) for i in range(n)}
    out.update({"w": torch.randn(3, 700, generator=g), "i": torch.arange(5, dtype=torch.int64)})
    out["u"] = torch.tensor([7], dtype=torch.uint8)
    return out


def parse_fully(blob: bytes) -> None:
    """Parse and touch every tensor: only BurnpackError subclasses may escape.

    The oracle of the fuzz tests in ``tests/test_burnpack_limits.py`` and of
    ``tests/fuzz/fuzz_burnpack.py``."""
    try:
        pack = burnpack.loads(blob)
        for name in pack.names:
            pack.raw(name)
        pack.tensors()
    except burnpack.BurnpackError:
        pass
