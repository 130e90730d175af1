"""The bytes Burn reads and writes: the golden 272-byte example, Burn's real MNIST file read
and rewritten byte for byte, every dtype (bool variants, QFloat passed through opaquely,
zero-dim and empty tensors), and the CBOR encoding of scalars and metadata."""

from __future__ import annotations

import hashlib
import struct

import cbor2
import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import Scalar, TensorEntry

from _burnpack_helpers import (
    _DEFAULT_SCHEME,
    MNIST,
    TORCH_DTYPES,
    _entries_in_data_order,
    f32,
    listdir,
    mk,
)

MNIST_SIZE, MNIST_META, MNIST_TENSORS = 1_044_776, 1398, 18


# =============================== golden bytes and the Burn fixture =============================


GOLDEN_META = bytes.fromhex(
    "a2 67 74656e736f7273 a1 66 776569676874 a4 65 6474797065 63 463332 65 7368617065 82 02 02"
    " 6c 646174615f6f666673657473 82 00 10 68 706172616d5f6964 18 2a 68 6d65746164617461 a1"
    " 68 70726f6475636572 6e 6275726e2d7061636b20646f6373"
)


def test_golden_272_byte_example_is_byte_exact():
    data = burnpack.dumps(
        {"weight": mk("F32", [2, 2], f32(1, 2, 3, 4), param_id=42)},
        metadata={"producer": "burn-pack docs"},
        checksums=False,
    )
    expected = (
        bytes.fromhex("4e52554201006200 0000")
        + GOLDEN_META
        + bytes(148)
        + bytes.fromhex("0000803f 00000040 00004040 00008040")
    )
    assert len(GOLDEN_META) == 98 and len(data) == 272
    assert data == expected


@pytest.fixture(scope="module")
def mnist() -> burnpack.Pack:
    return burnpack.read(MNIST)


def test_mnist_fixture_is_the_file_its_readme_describes():
    digest = hashlib.sha256(MNIST.read_bytes()).hexdigest()
    assert digest == "b63e660152b3865b1b630c97af6df1fcbc04206648d3a03b3636fcc795ecc472"
    assert digest in (MNIST.parents[1] / "README.md").read_text()


def test_mnist_fixture_reads_with_expected_layout(mnist):
    assert (mnist.file_size, mnist.metadata_size, mnist.data_start) == (
        MNIST_SIZE,
        MNIST_META,
        1536,
    )
    assert len(mnist.names) == MNIST_TENSORS and mnist.names == sorted(mnist.names)
    assert mnist.metadata == {} and mnist.scalars == {} and mnist.checksums == {}
    bias = mnist.entries["conv1.conv.bias"]
    assert (bias.dtype, bias.shape, bias.data_offsets, bias.param_id) == (
        "F32",
        (64,),
        (2304, 2560),
        9505838338724798577,
    )
    assert mnist.entries["fc1.weight"].shape == (1600, 128)
    assert mnist.entries["fc3.bias"].data_offsets == (1043200, 1043240)
    assert all(info.param_id is not None for info in mnist.entries.values())
    # Burn wrote them in module order: weight before bias, gamma before beta
    block = ["conv.weight", "conv.bias", "norm.gamma", "norm.beta", "norm.running_mean"]
    linear = ["weight", "bias"]
    assert mnist.data_order == [
        *(f"conv{i}.{n}" for i in (1, 2) for n in [*block, "norm.running_var"]),
        *(f"fc{i}.{n}" for i in (1, 2, 3) for n in linear),
    ]


def test_mnist_fixture_values_are_real_weights(mnist):
    raw = MNIST.read_bytes()
    w = mnist.tensor("fc3.bias")
    assert torch.equal(w, torch.frombuffer(bytearray(raw[-40:]), dtype=torch.float32))
    var = mnist.tensor("conv1.norm.running_var")
    assert bool((var > 0).all())  # batch-norm variances are positive
    assert all(torch.isfinite(t).all() for t in mnist.tensors().values())


def test_mnist_rewrite_in_data_order_is_byte_identical(mnist, tmp_path):
    entries = _entries_in_data_order(mnist)
    assert burnpack.dumps(entries, checksums=False) == MNIST.read_bytes()
    path = burnpack.write(tmp_path / "mnist.bpk", entries, checksums=False)
    assert path.read_bytes() == MNIST.read_bytes()


def test_mnist_rewrite_with_checksums_keeps_burn_structure(mnist):
    data = burnpack.dumps(_entries_in_data_order(mnist))
    top = cbor2.loads(data[10 : 10 + struct.unpack_from("<I", data, 6)[0]])
    assert list(top) == ["tensors", "metadata"]  # struct order, as Burn's reader expects
    assert list(top["tensors"]) == mnist.names
    assert all(
        list(d) == ["dtype", "shape", "data_offsets", "param_id"] for d in top["tensors"].values()
    )
    assert all(k.startswith(burnpack.CHECKSUM_PREFIX) for k in top["metadata"])
    pack = burnpack.loads(data)
    assert pack.metadata == {} and set(pack.checksums) == set(mnist.names)
    pack.verify()
    for name in mnist.names:
        assert pack.entries[name].data_offsets == mnist.entries[name].data_offsets
        assert torch.equal(pack.tensor(name), mnist.tensor(name))


# =============================== dtypes (docs/format.md) =======================================


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.tensor([[-1.5, 0.0], [2.25, float("inf")]], dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([info.min, 0, 1, info.max], dtype=dtype).reshape(2, 2)


@pytest.mark.parametrize("burn", sorted(TORCH_DTYPES))
def test_every_numeric_dtype_round_trips(burn):
    t = _sample(TORCH_DTYPES[burn])
    assert burnpack._burn_dtype(t.dtype) == burn and burnpack._torch_dtype(burn) == t.dtype
    pack = burnpack.loads(burnpack.dumps({"t": t}))
    assert pack.entries["t"].dtype == burn
    back = pack.tensor("t")
    assert back.dtype == t.dtype and torch.equal(back, t)
    assert bytes(pack.raw("t")) == burnpack.tensor_bytes(t).tobytes()


def test_flex32_reads_as_float32():
    pack = burnpack.loads(burnpack.dumps({"f": mk("Flex32", [2], f32(1.0, 2.0))}))
    assert pack.entries["f"].dtype == "Flex32"
    assert pack.tensor("f").dtype == torch.float32 and pack.tensor("f").tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("variant", "raw", "cbor"),
    [
        ("Native", bytes([1, 0, 1]), "a164426f6f6c664e6174697665"),
        ("U8", bytes([1, 0, 7]), "a164426f6f6c625538"),
        ("U32", struct.pack("<3I", 1, 0, 2**31), "a164426f6f6c63553332"),
    ],
)
def test_bool_variants_read_back_as_torch_bool(variant, raw, cbor):
    dtype = {"Bool": variant}
    data = burnpack.dumps({"b": mk(dtype, [3], raw)}, checksums=False)
    assert bytes.fromhex(cbor) in data  # newtype variant, never a bare "Bool"
    pack = burnpack.loads(data)
    assert pack.entries["b"].dtype == dtype
    assert pack.tensor("b").dtype == torch.bool
    assert pack.tensor("b").tolist() == [True, False, True]
    assert bytes(pack.raw("b")) == raw


def test_torch_bool_tensor_is_written_as_native_bool():
    t = torch.tensor([True, False])
    pack = burnpack.loads(burnpack.dumps({"b": t}))
    assert pack.entries["b"].dtype == {"Bool": "Native"}
    assert torch.equal(pack.tensor("b"), t)
    with pytest.raises(burnpack.ValidationError, match="1 byte"):
        burnpack.dumps({"b": TensorEntry({"Bool": "U32"}, [2], t, nbytes=8)})


def test_native_bool_with_byte_other_than_0_or_1_is_rejected():
    pack = burnpack.loads(burnpack.dumps({"b": mk({"Bool": "Native"}, [2], b"\x01\x02")}))
    with pytest.raises(burnpack.ValidationError, match=r"tensor 'b'.*other than 0 and 1"):
        pack.tensor("b")


_BLOCK_SCHEME = {
    "value": "Q4S",
    "store": {"PackedNative": 2},
    "mode": "Lookup",
    "tensor": "F16",
    "block": {"size": {"storage": [32, 1, 1, 1, 1], "len": 1}, "dtype": "UE8M0"},
}


@pytest.mark.parametrize("scheme", [_DEFAULT_SCHEME, _BLOCK_SCHEME])
def test_qfloat_passes_through_opaquely(scheme):
    dtype = {"QFloat": scheme}
    raw = bytes(range(13))  # not shape x anything: QFloat bytes are opaque
    data = burnpack.dumps({"q": mk(dtype, [4, 8], raw), "w": torch.ones(1)}, checksums=False)
    assert cbor2.dumps(dtype) in data  # the dtype value is stored verbatim, in field order
    pack = burnpack.loads(data)
    assert pack.entries["q"].dtype == dtype
    assert list(pack.entries["q"].dtype["QFloat"]) == list(scheme)
    assert bytes(pack.raw("q")) == raw
    assert list(pack.tensors()) == ["w"]
    with pytest.raises(burnpack.ValidationError, match="quantized"):
        pack.tensor("q")
    # byte-exact round trip of what was read
    assert burnpack.dumps(_entries_in_data_order(pack), checksums=False) == data


def test_unknown_torch_dtype_is_rejected_naming_the_tensor():
    with pytest.raises(burnpack.ValidationError, match=r"tensor 'c'.*bits8"):
        burnpack.dumps({"c": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)})


@pytest.mark.parametrize("dtype", ["F128", "Bool", {"Bool": "U16"}, {"QFloat": "Q8F"}, {"X": 1}])
def test_unknown_burn_dtype_is_rejected_on_write(dtype):
    with pytest.raises(burnpack.ValidationError, match="unknown dtype"):
        burnpack.dumps({"t": mk(dtype, [1], b"\0")})


def test_zero_dim_and_empty_tensors():
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "after": torch.arange(3, dtype=torch.int64),
        "trailing_empty": torch.zeros(0),
    }
    data = burnpack.dumps(tensors)
    pack = burnpack.loads(data)
    for name, t in tensors.items():
        back = pack.tensor(name)
        assert back.shape == t.shape and back.dtype == t.dtype and torch.equal(back, t)
    # a trailing empty tensor still gets an aligned start: the file grows to it (Burn does this)
    assert len(data) == pack.data_start + pack.entries["trailing_empty"].data_offsets[0]


def test_non_contiguous_and_requires_grad_tensors_are_written_by_value():
    base = torch.arange(12.0).reshape(3, 4)
    p = torch.nn.Parameter(torch.ones(2))
    pack = burnpack.loads(burnpack.dumps({"t": base.t(), "p": p}))
    assert torch.equal(pack.tensor("t"), base.t()) and torch.equal(pack.tensor("p"), p.detach())


# =============================== scalars and metadata ==========================================


def test_scalar_bytes_match_spec_example():
    data = burnpack.dumps(
        {},
        scalars={
            "step": Scalar.UInt(42),
            "lr": Scalar.Float(0.001),
            "flag": Scalar.Bool(True),
            "offset": Scalar.Int(-3),
        },
    )
    meta = data[10 : 10 + struct.unpack_from("<I", data, 6)[0]]
    assert meta == (
        b"\xa2\x67tensors\xa0\x67scalars\xa4"
        b"\x64flag\xa1\x64Bool\xf5"
        b"\x62lr\xa1\x65Float\xfb\x3f\x50\x62\x4d\xd2\xf1\xa9\xfc"
        b"\x66offset\xa1\x63Int\x22"
        b"\x64step\xa1\x64UInt\x18\x2a"
    )


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (3.0, "f94200"),
        (0.0, "f90000"),
        (-0.0, "f98000"),
        (1.5, "f93e00"),
        (65504.0, "f97bff"),
        (float("inf"), "f97c00"),
        (float("-inf"), "f9fc00"),
        (float("nan"), "f97e00"),
        (100000.0, "fa47c35000"),
        (0.1, "fb3fb999999999999a"),
        (0.001, "fb3f50624dd2f1a9fc"),
        (1e300, "fb7e37e43c8800759c"),
    ],
)
def test_float_scalars_use_smallest_lossless_width(value, encoded):
    data = burnpack.dumps({}, scalars={"x": value}, checksums=False)
    assert b"\x65Float" + bytes.fromhex(encoded) in data
    back = burnpack.loads(data).scalars["x"]
    assert back.kind == "Float"
    assert struct.pack(">d", back.value) == struct.pack(">d", value)


@pytest.mark.parametrize(
    ("value", "kind", "encoded"),
    [
        (True, "Bool", "f5"),
        (False, "Bool", "f4"),
        (0, "Int", "00"),
        (-1, "Int", "20"),
        (-(2**63), "Int", "3b7fffffffffffffff"),
        (2**63 - 1, "Int", "1b7fffffffffffffff"),
        (2**63, "UInt", "1b8000000000000000"),
        (2**64 - 1, "UInt", "1bffffffffffffffff"),
        (2.0, "Float", "f94000"),
    ],
)
def test_plain_python_values_become_scalars(value, kind, encoded):
    data = burnpack.dumps({}, scalars={"x": value}, checksums=False)
    assert f"{kind}".encode() + bytes.fromhex(encoded) in data
    back = burnpack.loads(data).scalars["x"]
    assert back == Scalar(kind, value) and back.kind == kind


def test_numpy_scalars_coerce():
    import numpy as np

    assert Scalar.coerce(np.int64(-2)) == Scalar.Int(-2)
    assert Scalar.coerce(np.uint64(2**64 - 1)) == Scalar.UInt(2**64 - 1)
    assert Scalar.coerce(np.float32(0.5)) == Scalar.Float(0.5)
    assert Scalar.coerce(np.bool_(True)) == Scalar.Bool(True)


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1, "x", None, [1], 10**400])
def test_out_of_range_or_wrong_type_scalars_fail_naming_the_key(bad):
    with pytest.raises(burnpack.ValidationError, match="scalar 'bad'"):
        burnpack.dumps({}, scalars={"bad": bad})


def test_nan_scalars_are_equal_and_hash_alike():
    a, b = Scalar.Float(float("nan")), Scalar.Float(-float("nan"))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_metadata_round_trips_sorted_and_unicode():
    meta = {"zeta": "last", "alpha": "first", "ключ": "значение ✓", "": "empty key"}
    data = burnpack.dumps({"w": torch.ones(1)}, metadata=meta, checksums=False)
    assert burnpack.loads(data).metadata == meta
    top = cbor2.loads(data[10 : 10 + struct.unpack_from("<I", data, 6)[0]])
    assert list(top["metadata"]) == sorted(meta)  # code-point order = Burn's UTF-8 byte order


def test_reserved_checksum_prefix_is_rejected_in_user_metadata():
    with pytest.raises(burnpack.ValidationError, match="reserved prefix"):
        burnpack.dumps({}, metadata={burnpack.CHECKSUM_PREFIX + "w": "0" * 16})


@pytest.mark.parametrize("meta", [{1: "x"}, {"k": 1}, {"k": None}])
def test_metadata_must_be_text(meta):
    with pytest.raises(burnpack.ValidationError, match="metadata entry"):
        burnpack.dumps({}, metadata=meta)


def test_lone_surrogate_name_fails_before_any_io(tmp_path):
    with pytest.raises(burnpack.ValidationError, match="UTF-8"):
        burnpack.write(tmp_path / "x.bpk", {"bad\udc80": torch.ones(1)})
    assert listdir(tmp_path) == []


def test_bad_tensor_arguments_are_validation_errors():
    with pytest.raises(burnpack.ValidationError, match=r"tensor 'x'.*list"):
        burnpack.dumps({"x": [1, 2]})
    with pytest.raises(burnpack.ValidationError, match="not a string"):
        burnpack.dumps({1: torch.ones(1)})
    with pytest.raises(burnpack.ValidationError, match="param_id"):
        burnpack.dumps({"x": TensorEntry.from_tensor(torch.ones(1), param_id=-1)})
    with pytest.raises(burnpack.ValidationError, match="tensor 'x'"):
        burnpack.dumps({"x": mk("F32", [-1], b"")})
