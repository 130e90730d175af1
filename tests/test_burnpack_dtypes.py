"""torch dtypes Burn has no name for (fp8, fp4, complex): stored in a Burn dtype of the same
bytes with the torch dtype named in the descriptor, read back as that torch dtype."""

from __future__ import annotations

import math

import cbor2
import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack.base import HEADER_SIZE

CARRIED = {
    torch.float8_e4m3fn: "U8",
    torch.float8_e5m2: "U8",
    torch.float8_e4m3fnuz: "U8",
    torch.float8_e5m2fnuz: "U8",
    torch.float8_e8m0fnu: "U8",
    torch.float4_e2m1fn_x2: "U8",
    torch.complex32: "F16",
    torch.complex64: "F32",
    torch.complex128: "F64",
}


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    if dtype.is_complex:
        return torch.randn(*shape, 2).view(torch.complex64).squeeze(-1).to(dtype)
    return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)


def _descriptors(data: bytes) -> dict:
    size = int.from_bytes(data[6:10], "little")
    return cbor2.loads(data[HEADER_SIZE : HEADER_SIZE + size])["tensors"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", list(CARRIED), ids=str)
def test_a_dtype_burn_lacks_round_trips_bit_exactly(dtype):
    tensor = _sample(dtype)
    data = burnpack.dumps({"t": tensor, "empty": _sample(dtype, (0, 2))})
    pack = burnpack.loads(data)
    back = pack.tensor("t")
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    assert pack.tensor("empty").dtype == dtype and pack.tensor("empty").shape == (0, 2)
    desc = _descriptors(data)["t"]
    assert desc["dtype"] == CARRIED[dtype]  # what Burn reads: a dtype it knows, the same bytes
    assert desc["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert desc["shape"] == ([3, 4, 2] if dtype.is_complex else [3, 4])
    assert pack.entries["t"].torch_spec() == ((3, 4), dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", list(CARRIED), ids=str)
def test_an_empty_tensor_reads_under_deterministic_mode(dtype):
    """Lightning's ``deterministic=True`` makes ``torch.empty`` fill memory, which torch cannot
    do for fp4 pairs: reading an empty tensor of any carried dtype still works."""
    data = burnpack.dumps({"empty": _sample(dtype, (0, 2))})
    torch.use_deterministic_algorithms(True)  # tests/conftest.py puts it back
    assert burnpack.loads(data).tensor("empty").shape == (0, 2)


def test_complex_is_stored_as_its_real_and_imaginary_parts():
    z = torch.tensor([1 + 2j, -3.5 + 0.25j], dtype=torch.complex64)
    entry = burnpack.TensorEntry.from_tensor(z)
    pack = burnpack.loads(burnpack.dumps({"z": entry}))
    assert torch.equal(pack.tensor("z"), z)
    stored = torch.frombuffer(bytearray(pack.raw("z")), dtype=torch.float32)
    assert stored.tolist() == [1.0, 2.0, -3.5, 0.25]  # Burn sees an F32 [2, 2]


def test_a_dtype_no_file_can_hold_is_refused_naming_tensor_and_dtype():
    with pytest.raises(burnpack.ValidationError, match=r"tensor 'q'.*torch\.bits8"):
        burnpack.dumps({"q": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)})


@pytest.mark.parametrize(
    ("torch_dtype", "dtype", "shape"),
    [
        ("float8_e4m3fn", "F32", [2]),
        ("complex64", "F32", [3]),
        ("bits8", "U8", [2]),
        (7, "U8", [2]),
    ],
)
def test_a_torch_dtype_that_does_not_fit_is_refused(torch_dtype, dtype, shape):
    entry = burnpack.TensorEntry(
        dtype, shape, bytes(math.prod(shape) * (4 if dtype == "F32" else 1))
    )
    entry.torch_dtype = torch_dtype
    with pytest.raises(burnpack.ValidationError, match="tensor 't': torch_dtype"):
        burnpack.dumps({"t": entry})
    good = burnpack.dumps({"t": burnpack.TensorEntry(dtype, shape, bytes(entry.nbytes))})
    size = int.from_bytes(good[6:10], "little")
    meta = cbor2.loads(good[HEADER_SIZE : HEADER_SIZE + size])
    meta["tensors"]["t"]["torch_dtype"] = torch_dtype
    blob = cbor2.dumps(meta)
    forged = good[:6] + len(blob).to_bytes(4, "little") + blob
    forged += bytes(burnpack.data_section_start(len(blob)) - len(forged)) + good[256:]
    with pytest.raises(burnpack.MetadataError, match="tensor 't': torch_dtype"):
        burnpack.loads(forged)
