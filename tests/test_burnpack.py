"""Tests of the burnpack container: Burn's conformance tests (burn-pack's tests/*.rs), golden
bytes, the real Burn fixture, every dtype and scalar kind, zero-copy reading, streaming and
atomic writes, strict reading of hostile input, and property-based round trips plus a short
fuzz."""

from __future__ import annotations

import errno
import functools
import gc
import hashlib
import json
import logging
import math
import os
import random
import struct
import sys
import textwrap
import tracemalloc
import weakref
from pathlib import Path

import cbor2
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_bpk import _fs, burnpack
from lightning_bpk.burnpack import Scalar, TensorEntry, _inplace, _parallel, reader

from conftest import MNIST_BPK, run_process

MNIST = MNIST_BPK
MNIST_SIZE, MNIST_META, MNIST_TENSORS = 1_044_776, 1398, 18


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def mk(dtype, shape, data, **kw):
    """A TensorEntry from bytes."""
    return TensorEntry(dtype, shape, data, **kw)


def deferred(calls: list[str], name: str, data: bytes, nbytes: int | None = None, dtype="F32"):
    """A deferred entry whose provider logs its calls; shape derived for F32/U8."""
    item = 4 if dtype == "F32" else 1
    shape = [len(data) // item] if nbytes is None else [nbytes // item]

    def provider() -> bytes:
        calls.append(name)
        return data

    return TensorEntry(dtype, shape, provider, nbytes=len(data) if nbytes is None else nbytes)


def abc_deferred(calls: list[str]) -> dict[str, TensorEntry]:
    """The lazy_writer.rs fixture: a[2,2] = 1.., b[3] = 100.., c[64] = 1000.. (all f32)."""
    a = deferred(calls, "a", f32(1, 2, 3, 4))
    a.shape = (2, 2)
    return {
        "a": a,
        "b": deferred(calls, "b", f32(100, 101, 102)),
        "c": deferred(calls, "c", f32(*range(1000, 1064))),
    }


def abc_resident() -> dict[str, TensorEntry]:
    return {
        "a": mk("F32", [2, 2], f32(1, 2, 3, 4)),
        "b": mk("F32", [3], f32(100, 101, 102)),
        "c": mk("F32", [64], f32(*range(1000, 1064))),
    }


def listdir(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# =============================== Burn's burn-pack tests: header.rs =============================


def test_01_header_size_and_magic_constants():
    assert burnpack.HEADER_SIZE == 10
    assert burnpack.base._MAGIC == 0x4255524E
    assert burnpack.base._MAGIC.to_bytes(4, "little") == b"NRUB" == burnpack.base._MAGIC_BYTES


def test_02_header_round_trip_metadata_size_1234():
    # Python has no Header type: build a pack whose metadata is exactly 1234 bytes.
    base = len(burnpack.dumps({}, metadata={"k": ""}, checksums=False)[10:].rstrip(b"\0"))
    pad = "x" * (1234 - base - 2)  # the text header grows from 1 to 3 bytes past 23 chars
    data = burnpack.dumps({}, metadata={"k": pad}, checksums=False)
    assert data[:10] == b"NRUB" + struct.pack("<HI", 1, 1234)
    pack = burnpack.loads(data)
    assert (pack.version, pack.metadata_size) == (1, 1234)


def test_03_bad_magic_deadbeef_is_invalid_magic_number():
    data = bytearray(burnpack.dumps({}))
    data[:4] = (0xDEADBEEF).to_bytes(4, "little")
    with pytest.raises(burnpack.MagicError, match="magic"):
        burnpack.loads(bytes(data))


def test_04_four_byte_input_is_invalid_header():
    with pytest.raises(burnpack.HeaderError, match="insufficient bytes"):
        burnpack.loads(b"NRUB")


# =============================== alignment.rs ==================================================


def test_05_data_section_start_is_aligned_for_metadata_sizes():
    sizes = [0, 1, 10, 245, 246, 247, 4096]
    starts = [burnpack.writer.data_section_start(m) for m in sizes]
    assert starts == [256, 256, 256, 256, 256, 512, 4352]
    for m, s in zip(sizes, starts, strict=True):
        assert s % 256 == 0 and 10 + m <= s < 10 + m + 256


@pytest.mark.parametrize("checksums", [False, True])
def test_06_size_equals_len_of_dumps(checksums):
    tensors = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])}
    assert burnpack.size(tensors, checksums=checksums) == len(
        burnpack.dumps(tensors, checksums=checksums)
    )


def test_07_written_file_is_identical_to_dumps_and_reads_back(tmp_path):
    tensors = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])}
    path = burnpack.write(tmp_path / "x.bpk", tensors)
    assert path.read_bytes() == burnpack.dumps(tensors)
    with burnpack.read(path) as pack:
        values = pack.tensor("a").tolist() + pack.tensor("b").tolist()
    assert values == [1.0, 2.0, 3.0, 4.0]


def test_08_one_byte_short_is_rejected():
    # Rust's write_into(size()-1) fails; the Python equivalent is a pack one byte short.
    data = burnpack.dumps({"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])})
    with pytest.raises(burnpack.ValidationError, match="truncated"):
        burnpack.loads(data[:-1])


def test_09_every_tensor_start_is_256_aligned():
    tensors = {"a": torch.zeros(3), "b": torch.zeros(1), "c": torch.zeros(2)}
    data = burnpack.dumps(tensors, checksums=False)
    pack = burnpack.loads(data)
    assert [pack.entries[n].data_offsets[0] for n in "abc"] == [0, 256, 512]
    assert len(data) == 776


# =============================== errors.rs =====================================================


def test_10_four_zero_bytes_is_invalid_header():
    with pytest.raises(burnpack.HeaderError):
        burnpack.loads(bytes(4))


def test_11_ten_bytes_with_bad_magic():
    with pytest.raises(burnpack.MagicError):
        burnpack.loads(b"XXXX" + struct.pack("<HI", 1, 0))


def test_12_version_2_is_unsupported():
    data = bytearray(burnpack.dumps({}))
    data[4:6] = (2).to_bytes(2, "little")
    with pytest.raises(burnpack.VersionError, match="version 2"):
        burnpack.loads(bytes(data))


def test_13_metadata_size_over_limit_fails_without_allocating():
    header = b"NRUB" + struct.pack("<HI", 1, burnpack.MAX_METADATA_SIZE + 1)
    tracemalloc.start()
    try:
        with pytest.raises(burnpack.ValidationError, match="exceeds maximum allowed size"):
            burnpack.loads(header)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_14_metadata_size_past_end_of_input():
    with pytest.raises(burnpack.HeaderError, match="metadata needs 4106"):
        burnpack.loads(b"NRUB" + struct.pack("<HI", 1, 4096))


def test_15_duplicate_tensor_name_on_write():
    tensors = [("w", torch.zeros(1)), ("w", torch.ones(1))]
    with pytest.raises(burnpack.ValidationError, match="Duplicate tensor name 'w'"):
        burnpack.dumps(tensors)


def test_16_pack_truncated_to_half_is_rejected():
    data = burnpack.dumps({"w": torch.zeros(512)})
    with pytest.raises(burnpack.ValidationError, match="File truncated"):
        burnpack.loads(data[: len(data) // 2])


# =============================== round_trip.rs =================================================


def test_17_weight_round_trip_with_param_id():
    data = burnpack.dumps({"weight": mk("F32", [2, 2], f32(1, 2, 3, 4), param_id=7)})
    pack = burnpack.loads(data)
    info = pack.entries["weight"]
    assert (pack.names, info.dtype, info.shape, info.param_id, info.nbytes) == (
        ["weight"],
        "F32",
        (2, 2),
        7,
        16,
    )
    assert pack.tensor("weight").tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_18_names_come_back_sorted():
    tensors = {n: torch.zeros(1) for n in ("zebra", "alpha", "mango")}
    pack = burnpack.loads(burnpack.dumps(tensors))
    assert pack.names == ["alpha", "mango", "zebra"]
    assert list(pack.tensors()) == ["alpha", "mango", "zebra"]
    assert list(pack) == ["alpha", "mango", "zebra"]


def test_19_each_name_gets_its_own_data_despite_gaps():
    tensors = {"z": torch.arange(5.0), "a": torch.arange(3.0) + 10, "m": torch.arange(7.0) + 20}
    pack = burnpack.loads(burnpack.dumps(tensors))
    for name, tensor in tensors.items():
        assert torch.equal(pack.tensor(name), tensor)


def test_20_metadata_round_trips_with_tensors_intact():
    meta = {"producer": "burn-pack", "format": "burnpack"}
    pack = burnpack.loads(burnpack.dumps({"w": torch.zeros(2, 3)}, metadata=meta))
    assert pack.metadata == meta
    assert (pack.entries["w"].dtype, pack.entries["w"].shape) == ("F32", (2, 3))


def test_21_param_id_some_and_none_round_trip():
    data = burnpack.dumps(
        {"a": mk("F32", [1], f32(1), param_id=123), "b": mk("F32", [1], f32(2))},
        checksums=False,
    )
    pack = burnpack.loads(data)
    assert (pack.entries["a"].param_id, pack.entries["b"].param_id) == (123, None)
    assert b"param_id" in data and data.count(b"param_id") == 1  # None is omitted


def test_22_empty_pack_has_no_tensors():
    data = burnpack.dumps({})
    assert len(data) == 256
    assert data[10:20] == bytes.fromhex("a16774656e736f7273a0")  # {"tensors": {}}
    pack = burnpack.loads(data)
    assert pack.names == [] and pack.tensors() == {} and len(pack) == 0


@pytest.mark.parametrize("dtype", ["F32", "F64", "I64", "I32", "I8", "U8", "BF16", "F16"])
def test_23_dtypes_preserve_bytes(dtype):
    itemsize = {"F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BF16": 2, "F16": 2}
    raw = b"".join(bytes([i + 1]) * itemsize[dtype] for i in range(3))
    pack = burnpack.loads(burnpack.dumps({"t": mk(dtype, [3], raw)}))
    info = pack.entries["t"]
    assert (info.dtype, info.shape, info.nbytes) == (dtype, (3,), len(raw))
    assert bytes(pack.raw("t")) == raw


def test_24_in_memory_round_trip_f32():
    pack = burnpack.loads(burnpack.dumps({"x": torch.tensor([1.5, 2.5, 3.5])}))
    assert pack.tensor("x").tolist() == [1.5, 2.5, 3.5]


def test_25_file_round_trip_gives_same_values(tmp_path):
    path = burnpack.write(tmp_path / "x.bpk", {"x": torch.tensor([1.5, 2.5, 3.5])})
    with burnpack.read(path) as pack:
        assert pack.tensor("x").tolist() == [1.5, 2.5, 3.5]


def test_26_large_u8_tensor_streams_identically(tmp_path):
    n = 8 * 1024 * 1024 + 4096
    data = bytes(i % 251 for i in range(251)) * (n // 251) + bytes(i % 251 for i in range(n % 251))
    path = burnpack.write(tmp_path / "big", {"u": mk("U8", [n], data)})
    with burnpack.read(path) as pack:
        assert bytes(pack.raw("u")) == data


def test_27_raw_returns_le_bytes_and_missing_is_not_found():
    pack = burnpack.loads(burnpack.dumps({"a": torch.tensor([1.0, 2.0])}))
    assert bytes(pack.raw("a")) == f32(1.0, 2.0)
    with pytest.raises(burnpack.TensorNotFoundError, match="'missing'"):
        pack.raw("missing")
    with pytest.raises(burnpack.TensorNotFoundError):
        pack.tensor("missing")


def test_28_file_round_trip_with_metadata_and_param_id(tmp_path):
    path = burnpack.write(
        tmp_path / "m.bpk", {"w": TensorEntry.from_tensor(torch.ones(2), 1)}, metadata={"k": "v"}
    )
    with burnpack.read(path) as pack:
        assert (pack.metadata, pack.entries["w"].param_id) == ({"k": "v"}, 1)
        assert pack.tensor("w").tolist() == [1.0, 1.0]


def test_29_suffix_added_on_write_and_found_on_read(tmp_path):
    path = burnpack.write(tmp_path / "model", {"w": torch.ones(1)})
    assert path == tmp_path / "model.bpk"
    assert listdir(tmp_path) == ["model.bpk"]
    with burnpack.read(tmp_path / "model") as pack:
        assert pack.names == ["w"]
    assert burnpack.writer._with_suffix("a/b.ckpt") == Path("a/b.ckpt")
    assert burnpack.reader._resolve_path(tmp_path / "model") == tmp_path / "model.bpk"


def test_30_scalars_round_trip_with_variants():
    scalars = {
        "step": Scalar.UInt(42),
        "lr": Scalar.Float(0.001),
        "flag": Scalar.Bool(True),
        "offset": Scalar.Int(-3),
    }
    pack = burnpack.loads(burnpack.dumps({}, scalars=scalars))
    assert pack.scalars == scalars
    assert [pack.scalars[k].kind for k in ("step", "lr", "flag", "offset")] == [
        "UInt",
        "Float",
        "Bool",
        "Int",
    ]


def test_31_no_scalars_means_empty_and_absent_on_disk():
    data = burnpack.dumps({"w": torch.ones(1)})
    assert burnpack.loads(data).scalars == {}
    assert b"scalars" not in data


# =============================== lazy_writer.rs ================================================


def test_32_size_calls_no_provider():
    calls: list[str] = []
    burnpack.size(abc_deferred(calls))
    assert calls == []


def test_33_dumps_calls_each_provider_once_in_order():
    calls: list[str] = []
    burnpack.dumps(abc_deferred(calls))
    assert calls == ["a", "b", "c"]


def test_34_deferred_container_equals_resident_container():
    assert burnpack.dumps(abc_deferred([])) == burnpack.dumps(abc_resident())


def test_35_declared_length_disagreeing_with_shape_fails_at_plan_time():
    calls: list[str] = []
    entry = deferred(calls, "a", f32(1, 2), nbytes=8)
    entry.shape = (2, 2)
    with pytest.raises(burnpack.ValidationError, match="declares 8 bytes") as err:
        burnpack.dumps({"a": entry})
    assert "need 16" in str(err.value) and calls == []


def test_36_qfloat_skips_the_shape_check():
    calls: list[str] = []
    qdtype = {"QFloat": _DEFAULT_SCHEME}
    entry = TensorEntry(qdtype, [3], lambda: calls.append("q") or b"\x01" * 8, nbytes=8)
    pack = burnpack.loads(burnpack.dumps({"q": entry}))
    assert bytes(pack.raw("q")) == b"\x01" * 8 and calls == ["q"]


def test_37_provider_returning_fewer_bytes_is_a_size_mismatch():
    entry = TensorEntry("F32", [4], lambda: f32(1, 2), nbytes=16)
    with pytest.raises(burnpack.SizeMismatchError, match="expected 16, got 8") as err:
        burnpack.dumps({"a": entry})
    assert "tensor 'a'" in str(err.value)


def test_38_provider_error_is_io_error_naming_the_tensor():
    def failing() -> bytes:
        raise OSError("device read failed")

    with pytest.raises(burnpack.BurnpackIOError) as err:
        burnpack.dumps({"a": TensorEntry("F32", [1], failing, nbytes=4)})
    assert "tensor 'a'" in str(err.value) and "device read failed" in str(err.value)


def test_39_atomic_write_failing_at_plan_time_leaves_directory_empty(tmp_path):
    entry = TensorEntry("F32", [2, 2], lambda: b"", nbytes=8)
    with pytest.raises(burnpack.ValidationError):
        burnpack.write(tmp_path / "m.bpk", {"a": entry})
    assert listdir(tmp_path) == []


def _failing_last(calls: list[str]) -> dict[str, TensorEntry]:
    tensors = abc_deferred(calls)

    def boom() -> bytes:
        calls.append("c")
        raise OSError("disk on fire")

    tensors["c"] = TensorEntry("F32", [64], boom, nbytes=256)
    return tensors


def test_40_atomic_write_with_failing_last_provider_leaves_nothing(tmp_path):
    calls: list[str] = []
    with pytest.raises(burnpack.BurnpackIOError, match="disk on fire"):
        burnpack.write(tmp_path / "m.bpk", _failing_last(calls))
    assert calls == ["a", "b", "c"] and listdir(tmp_path) == []


def test_41_atomic_write_failure_keeps_existing_file(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"old": torch.ones(3)})
    before = path.read_bytes()
    with pytest.raises(burnpack.BurnpackIOError):
        burnpack.write(path, _failing_last([]))
    assert path.read_bytes() == before and listdir(tmp_path) == ["m.bpk"]


def test_42_atomic_write_onto_a_directory_leaves_it_and_no_scratch(tmp_path):
    target = tmp_path / "m.bpk"
    target.mkdir()
    (target / "inside").write_text("keep")
    with pytest.raises(burnpack.BurnpackIOError, match=r"m\.bpk"):
        burnpack.write(target, abc_resident())
    assert listdir(tmp_path) == ["m.bpk"] and listdir(target) == ["inside"]


def test_43_atomic_write_over_existing_file_replaces_it(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"old": torch.ones(3)})
    burnpack.write(path, abc_deferred([]))
    with burnpack.read(path) as pack:
        assert pack.names == ["a", "b", "c"]
    assert listdir(tmp_path) == ["m.bpk"]


def test_44_non_atomic_write_failure_clobbers_existing_file(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"old": torch.ones(4096)})
    size_before = path.stat().st_size
    with pytest.raises(burnpack.BurnpackIOError):
        burnpack.write(path, _failing_last([]), atomic=False)
    assert path.exists() and path.stat().st_size < size_before
    with pytest.raises(burnpack.BurnpackError):
        burnpack.read(path)


# =============================== streaming_memory.rs ===========================================


class _Payload(bytearray):
    """bytearray that supports weak references, to watch provider outputs die."""


def test_45_streaming_frees_each_payload_before_the_next_provider(tmp_path):
    alive: list[weakref.ref] = []
    seen_alive: list[int] = []

    def provider(i: int):
        def make() -> _Payload:
            gc.collect()
            seen_alive.append(sum(r() is not None for r in alive))
            payload = _Payload(bytes([i]) * 2**20)
            alive.append(weakref.ref(payload))
            return payload

        return make

    tensors = {f"t{i}": TensorEntry("U8", [2**20], provider(i), nbytes=2**20) for i in range(4)}
    path = burnpack.write(tmp_path / "s.bpk", tensors)
    gc.collect()
    assert seen_alive == [0, 0, 0, 0]
    assert all(r() is None for r in alive)
    assert path.stat().st_size >= 4 * 2**20


def test_45b_peak_memory_is_about_one_tensor(tmp_path):
    mib = 2**20
    tensors = {
        f"t{i}": TensorEntry("U8", [4 * mib], lambda i=i: bytes([i]) * (4 * mib), nbytes=4 * mib)
        for i in range(8)
    }
    tracemalloc.start()
    try:
        burnpack.write(tmp_path / "p.bpk", tensors)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 4 * mib  # one tensor in flight, never the 32 MiB file


def test_45c_contiguous_tensor_is_written_without_copy(tmp_path):
    big = torch.ones(8 * 2**20, dtype=torch.uint8)
    tracemalloc.start()
    try:
        burnpack.write(tmp_path / "c.bpk", {"big": big})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


# =============================== in-crate unit tests ===========================================


def test_46_scalar_conversions_and_range_errors():
    for s in (Scalar.Int(-5), Scalar.UInt(200), Scalar.UInt(42)):
        assert burnpack.loads(burnpack.dumps({}, scalars={"s": s})).scalars["s"] == s
    with pytest.raises(ValueError, match="does not fit"):
        Scalar.Int(2**63)
    with pytest.raises(ValueError):
        Scalar.Int(-(2**63) - 1)
    with pytest.raises(ValueError):
        Scalar.UInt(-1)
    with pytest.raises(ValueError):
        Scalar.UInt(2**64)
    with pytest.raises(TypeError):
        Scalar.Int(1.5)
    with pytest.raises(TypeError):
        Scalar.Bool(1)
    with pytest.raises(TypeError):
        Scalar.Float(True)
    with pytest.raises(ValueError):
        Scalar.Float(10**400)
    with pytest.raises(ValueError):
        Scalar("Str", "x")
    assert Scalar.Float(3).value == 3.0 and isinstance(Scalar.Float(3).value, float)
    assert Scalar.Int(3) != Scalar.UInt(3) and Scalar.Int(3) != 3
    with pytest.raises(AttributeError):
        Scalar.Int(3).value = 4


def test_47_deferred_provider_runs_on_every_dumps_and_errors_keep_their_class():
    calls: list[str] = []
    tensors = abc_deferred(calls)
    first, second = burnpack.dumps(tensors), burnpack.dumps(tensors)
    assert first == second and calls == ["a", "b", "c"] * 2

    def fails() -> bytes:
        raise burnpack.SizeMismatchError("inner")

    with pytest.raises(burnpack.SizeMismatchError, match="tensor 'x': inner"):
        burnpack.dumps({"x": TensorEntry("F32", [1], fails, nbytes=4)})
    entry = TensorEntry("F32", [1], f32(1), param_id=5)
    assert (entry.dtype, entry.shape, entry.param_id, entry.nbytes) == ("F32", (1,), 5, 4)


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


def _entries_in_data_order(pack: burnpack.Pack) -> dict[str, TensorEntry]:
    order = pack.data_order
    return {
        n: TensorEntry(
            pack.entries[n].dtype, pack.entries[n].shape, pack.raw(n), pack.entries[n].param_id
        )
        for n in order
    }


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


_DEFAULT_SCHEME = {
    "value": "Q8F",
    "store": {"PackedU32": 0},
    "mode": "Symmetric",
    "tensor": None,
    "block": None,
}
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
    with pytest.raises(burnpack.ValidationError, match=r"tensor 'c'.*complex"):
        burnpack.dumps({"c": torch.zeros(2, dtype=torch.complex64)})


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


def test_entry_shape_must_be_integers():
    with pytest.raises(TypeError):
        TensorEntry("F32", [2.5], b"\0" * 8)
    with pytest.raises(ValueError, match="nbytes"):
        TensorEntry("F32", [2], lambda: b"")


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


# =============================== zero-copy, lazy reading =======================================


def _mapped_file(address: int) -> str | None:
    """The file backing ``address`` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


def test_read_maps_the_file_and_tensor_points_into_the_mapping(tmp_path):
    t = torch.arange(100_000, dtype=torch.float32)
    path = burnpack.write(tmp_path / "z.bpk", {"t": t})
    with burnpack.read(path) as pack:
        tracemalloc.start()
        try:
            view = pack.tensor("t")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert _mapped_file(view.data_ptr()) == str(path)
        assert peak < 10_000  # a 400 kB payload was not copied
        assert torch.equal(view, t)


def test_loads_views_the_given_buffer():
    data = bytearray(burnpack.dumps({"t": torch.arange(8.0)}))
    pack = burnpack.loads(data)
    t = pack.tensor("t")
    data[pack.data_start : pack.data_start + 4] = f32(42.0)  # mutate the source ...
    assert t[0].item() == 42.0  # ... and the tensor sees it: no copy was made
    assert pack.tensor("t", verify=False).data_ptr() == t.data_ptr()


def test_read_parses_only_header_and_metadata(tmp_path):
    path = burnpack.write(tmp_path / "l.bpk", {"t": torch.ones(1 << 20)})
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    data[-1] ^= 0xFF  # damage after parsing: opening did not hash the payload
    with pytest.raises(burnpack.ChecksumError):
        pack.tensor("t")


@pytest.mark.parametrize("atomic", [True, False])
def test_tensor_survives_rewrite_of_the_same_path(tmp_path, atomic):
    path = burnpack.write(tmp_path / "r.bpk", {"t": torch.full((4096,), 1.0)})
    pack = burnpack.read(path)
    t = pack.tensor("t")
    burnpack.write(path, {"t": torch.full((16,), 2.0)}, atomic=atomic)
    assert bool((t == 1.0).all()) and t.numel() == 4096
    pack.close()
    assert bool((t == 1.0).all())
    with burnpack.read(path) as fresh:
        assert fresh.tensor("t").tolist() == [2.0] * 16


def test_pack_context_manager_closes_and_tensors_survive(tmp_path):
    path = burnpack.write(tmp_path / "c.bpk", {"a": torch.arange(5.0), "b": torch.ones(2)})
    with burnpack.read(path) as pack:
        a = pack.tensor("a")
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(burnpack.BurnpackError, match="closed"):
        pack.tensor("b")
    assert pack.names == ["a", "b"] and pack.nbytes == path.stat().st_size
    del a
    gc.collect()
    pack.close()  # idempotent


def test_pack_closes_mapping_when_no_tensor_remains(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"a": torch.arange(5.0)})
    pack = burnpack.read(path)
    mapping = pack._mmap
    pack.close()
    assert mapping.closed


# =============================== checksums =====================================================


def test_flipped_payload_byte_raises_checksum_error_verify_false_skips(tmp_path):
    path = burnpack.write(tmp_path / "f.bpk", {"a": torch.ones(64), "b": torch.zeros(64)})
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    start = pack.data_start + pack.entries["b"].data_offsets[0]
    data[start + 7] ^= 0x01
    path.write_bytes(data)
    with burnpack.read(path) as damaged:
        assert damaged.tensor("a").sum().item() == 64  # undamaged tensors still load
        with pytest.raises(burnpack.ChecksumError, match=rf"{path}.*tensor 'b'"):
            damaged.tensor("b")
        assert damaged.tensor("b", verify=False).view(torch.uint8)[7].item() == 1
        with pytest.raises(burnpack.ChecksumError, match=r"\['b'\]"):
            damaged.verify()


def test_checksum_is_written_per_tensor_and_burn_files_have_none():
    data = burnpack.dumps({"a": torch.ones(2), "b": torch.ones(3)})
    pack = burnpack.loads(data)
    assert set(pack.checksums) == {"a", "b"} and pack.metadata == {}
    assert all(len(v) == 16 for v in pack.checksums.values())
    assert burnpack.loads(burnpack.dumps({"a": torch.ones(2)}, checksums=False)).checksums == {}


# =============================== read_into: loading into existing tensors =======================


def _mixed(n: int = 300) -> dict[str, torch.Tensor]:
    """Tensors of many sizes (1 byte to several read steps) in one file, padding between them."""
    g = torch.Generator().manual_seed(n)
    out = {f"s{i}": torch.randn(i % 37 + 1, generator=g) for i in range(n)}
    out.update({"w": torch.randn(3, 700, generator=g), "i": torch.arange(5, dtype=torch.int64)})
    out["u"] = torch.tensor([7], dtype=torch.uint8)
    return out


# steps of 1000 bytes: large tensors copied in several steps, one partial, small ones in batches
@pytest.mark.parametrize("step", [1000, 2**20], ids=["steps", "batched"])
def test_read_into_fills_existing_storage_in_place(tmp_path, monkeypatch, step):
    monkeypatch.setattr(_inplace, "READ_STEP", step)
    source = _mixed()
    path = burnpack.write(tmp_path / "m.bpk", source)
    targets = {k: torch.zeros_like(v) for k, v in source.items()}
    pointers = {k: t.data_ptr() for k, t in targets.items()}
    versions = {k: t._version for k, t in targets.items()}
    burnpack.read_into(path, targets)
    assert all(torch.equal(targets[k], source[k]) for k in source)
    assert {k: t.data_ptr() for k, t in targets.items()} == pointers
    assert all(t._version > versions[k] for k, t in targets.items())  # autograd sees the write
    partial = {k: torch.zeros_like(source[k]) for k in list(source)[::3]}  # gaps between them
    burnpack.read_into(path, partial)
    assert all(torch.equal(t, source[k]) for k, t in partial.items())


def test_read_into_one_tensor_under_two_names(tmp_path):
    """Targets sharing memory are read one at a time, each checked before the next."""
    path = burnpack.write(tmp_path / "t.bpk", {"a": torch.ones(3), "b": torch.full((3,), 2.0)})
    shared = torch.zeros(3)
    burnpack.read_into(path, {"a": shared, "b": shared})
    assert shared.tolist() == [2.0, 2.0, 2.0]


def test_read_into_casts_views_and_bools_through_the_checked_path(tmp_path):
    source = {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}
    path = burnpack.write(tmp_path / "m.bpk", source)
    as_f64 = torch.zeros(2, 3, dtype=torch.float64)
    transposed = torch.zeros(3, 2).t()  # not contiguous
    flags = torch.zeros(2, dtype=torch.bool)
    burnpack.read_into(path, {"w": as_f64, "flags": flags})
    burnpack.read_into(path, {"w": transposed})
    assert as_f64.tolist() == transposed.tolist() == source["w"].tolist()
    assert flags.tolist() == [True, False]


def test_read_into_refuses_missing_names_and_other_shapes_before_touching_anything(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"a": torch.ones(4), "b": torch.ones(2)})
    a = torch.zeros(4)
    with pytest.raises(burnpack.TensorNotFoundError, match="'nope'"):
        burnpack.read_into(path, {"a": a, "nope": torch.zeros(1)})
    with pytest.raises(burnpack.ValidationError, match=r"'b' has shape \[2\], the target \[3\]"):
        burnpack.read_into(path, {"a": a, "b": torch.zeros(3)})
    assert a.sum().item() == 0
    with pytest.raises(burnpack.BurnpackIOError, match=r"absent\.bpk"):
        burnpack.read_into(tmp_path / "absent.bpk", {"a": a})


@pytest.mark.parametrize("step", [1000, 2**20], ids=["steps", "batched"])
def test_read_into_detects_a_flipped_byte_and_names_the_tensor(tmp_path, monkeypatch, step):
    monkeypatch.setattr(_inplace, "READ_STEP", step)
    source = _mixed()
    path = burnpack.write(tmp_path / "f.bpk", source)
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    for name in ("w", "s17"):  # a large tensor and a small one in a batch
        data[pack.data_start + pack.entries[name].data_offsets[0] + 7] ^= 0x01
    path.write_bytes(data)
    targets = {k: torch.zeros_like(v) for k, v in source.items()}
    with pytest.raises(burnpack.ChecksumError, match=rf"{path}: tensor '(w|s17)'"):
        burnpack.read_into(path, targets)
    w = torch.zeros(3, 700)
    burnpack.read_into(path, {"w": w}, verify=False)
    assert w.view(torch.uint8).flatten()[7].item() != 0 and not torch.equal(w, source["w"])


def test_read_into_names_a_file_truncated_after_it_was_parsed(tmp_path, monkeypatch):
    """Another program truncating the file in place between the parse and the reads: the short
    read is an error naming the file, never a target silently left half-filled."""
    source = {"w": torch.randn(4096)}
    path = burnpack.write(tmp_path / "t.bpk", source)
    parse = reader._map

    def parse_then_truncate(fd, p):
        pack = parse(fd, p)
        os.truncate(p, pack.data_start + 1000)
        return pack

    monkeypatch.setattr(reader, "_map", parse_then_truncate)
    with pytest.raises(burnpack.BurnpackIOError, match=rf"{path}: the file ended at byte "):
        burnpack.read_into(path, {"w": torch.zeros(4096)})


# =============================== atomicity under injected faults ===============================


def _odd_sizes() -> dict[str, torch.Tensor]:
    """Every dtype at an odd length (the file is no multiple of a block), one byte, empty."""
    out = {
        f"{burn}/odd": torch.arange(7 * 3, dtype=torch.int64).to(t)[:7]
        for burn, t in TORCH_DTYPES.items()
    }
    out.update(
        {
            "bool": torch.tensor([True, False, True]),
            "one byte": torch.tensor([5], dtype=torch.uint8),
            "empty": torch.empty(0, 3),
            "zero-dim": torch.tensor(2.5),
        }
    )
    return out


def _many_across_buffers() -> dict[str, torch.Tensor]:
    """3,000 tensors (the metadata spans many blocks: its checksums are patched on disk) and
    large ones across the sink's buffers."""
    g = torch.Generator().manual_seed(3)
    out = {f"small.{i}": torch.randn(i % 97 + 1, generator=g) for i in range(3000)}
    out.update({f"large.{i}": torch.randn(1_500_001 + i, generator=g) for i in range(4)})
    return out


@pytest.mark.parametrize(
    "tensors",
    [_odd_sizes, dict, lambda: {"one": torch.tensor([1], dtype=torch.int8)}, _many_across_buffers],
    ids=["every-dtype-odd-sizes", "empty-pack", "single-byte", "many-across-buffers"],
)
@pytest.mark.parametrize("checksums", [True, False])
def test_o_direct_writes_the_bytes_of_the_page_cache_path(
    direct_dir, monkeypatch, caplog, tensors, checksums
):
    """Byte identity with Burn's layout: O_DIRECT (for every size here), the page cache and
    ``dumps`` give the same file."""
    content = tensors()
    metadata = {"note": "odd"}
    expected = burnpack.dumps(content, metadata=metadata, checksums=checksums)
    caplog.set_level(logging.DEBUG, logger="lightning_bpk")
    monkeypatch.setattr(_fs, "DIRECT_MIN", 0)
    direct = burnpack.write(direct_dir / "d.bpk", content, metadata=metadata, checksums=checksums)
    monkeypatch.setattr(_fs, "DIRECT_MIN", len(expected) + 1)
    paged = burnpack.write(direct_dir / "p.bpk", content, metadata=metadata, checksums=checksums)
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_bpk"]
    assert "with O_DIRECT" in said[0] and "through the page cache" in said[1]
    assert direct.read_bytes() == expected and paged.read_bytes() == expected
    assert len(expected) % 4096  # every file ends in a partial block: padded, then cut back
    with burnpack.read(direct) as pack:
        pack.verify()


@pytest.mark.parametrize("size", [64, 5_000_000], ids=["page-cache", "o-direct"])
def test_enospc_at_each_write_call_leaves_no_scratch_and_old_file(tmp_path, monkeypatch, size):
    path = burnpack.write(tmp_path / "e.bpk", {"old": torch.ones(8)})
    before = path.read_bytes()
    content = {"a": torch.ones(size // 4), "b": torch.arange(9.0)}
    real, calls = _fs.write_all, []

    def counting(f, data):
        calls.append(1)
        real(f, data)

    monkeypatch.setattr(_fs, "write_all", counting)
    burnpack.write(tmp_path / "dry.bpk", content)
    (tmp_path / "dry.bpk").unlink()
    assert calls
    for failing_call in range(1, len(calls) + 1):
        count = {"n": 0}

        def full_disk(f, data, failing_call=failing_call, count=count):
            count["n"] += 1
            if count["n"] == failing_call:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(f, data)

        monkeypatch.setattr(_fs, "write_all", full_disk)
        with pytest.raises(burnpack.BurnpackIOError, match="No space left") as err:
            burnpack.write(path, content)
        assert isinstance(err.value, OSError) and str(path) in str(err.value)
        assert path.read_bytes() == before and listdir(tmp_path) == ["e.bpk"]


def test_a_tmpfs_directory_saves_and_loads_through_the_page_cache(tmpfs_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_bpk")
    content = {"w": torch.randn(1_000_000), "b": torch.arange(5)}
    path = burnpack.write(tmpfs_dir / "m.bpk", content)
    assert any("through the page cache" in r.getMessage() for r in caplog.records)
    targets = {k: torch.zeros_like(v) for k, v in content.items()}
    burnpack.read_into(path, targets)
    assert all(torch.equal(targets[k], v) for k, v in content.items())
    with burnpack.read(path) as pack:
        assert torch.equal(pack.tensor("w"), content["w"])


def test_file_size_limit_in_subprocess_leaves_old_file(tmp_path):
    """A real kernel fault (EFBIG from RLIMIT_FSIZE) midway through the payload."""
    path = burnpack.write(tmp_path / "k.bpk", {"old": torch.ones(8)})
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from lightning_bpk import burnpack
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            burnpack.write({str(path)!r}, {{"big": torch.ones(1 << 20)}})
        except burnpack.BurnpackIOError as e:
            print("ERR", e)
        """
    )
    out = run_process([sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR") and "k.bpk" in out.stdout
    assert path.read_bytes() == before and listdir(tmp_path) == ["k.bpk"]


def test_write_into_missing_directory_is_an_io_error(tmp_path):
    with pytest.raises(burnpack.BurnpackIOError, match="nope"):
        burnpack.write(tmp_path / "nope" / "x.bpk", {"a": torch.ones(1)})


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(burnpack.BurnpackIOError, match="absent") as err:
        burnpack.read(tmp_path / "absent.bpk")
    assert isinstance(err.value, OSError)
    with pytest.raises(burnpack.ValidationError, match="not a regular file"):
        burnpack.read(tmp_path)
    fifo = tmp_path / "pipe.bpk"
    os.mkfifo(fifo)
    with pytest.raises(burnpack.ValidationError, match="not a regular file"):
        burnpack.read(fifo)  # must not block waiting for a writer
    (tmp_path / "tiny.bpk").write_bytes(b"NRUB")
    with pytest.raises(burnpack.HeaderError, match=r"tiny\.bpk"):
        burnpack.read(tmp_path / "tiny.bpk")


# =============================== hostile input =================================================

GOOD_TENSORS = {"w": torch.arange(300.0), "b": torch.ones(4)}


def craft(top, data: bytes = b"", *, version=1, meta_size=None, magic=b"NRUB", raw_meta=None):
    """A pack with arbitrary (possibly invalid) CBOR metadata followed by ``data``."""
    blob = cbor2.dumps(top) if raw_meta is None else raw_meta
    size = len(blob) if meta_size is None else meta_size
    pad = bytes(burnpack.writer.data_section_start(len(blob)) - 10 - len(blob))
    return magic + struct.pack("<HI", version, size) + blob + pad + data


def desc(dtype="F32", shape=(2,), offsets=(0, 8), **extra):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


TWO_F32 = f32(1, 2)


def one(d, data=TWO_F32, **top):
    return craft({"tensors": {"t": d}, **top}, data)


def _tags() -> list[tuple]:
    # tag 0/1 datetime, 2/3 bignum, 4 decimal, 28/29 shared refs, 35 regex, 258 set, 55799 magic:
    # cbor2 decodes these itself; they must never become objects.
    cases = []
    for tag, payload in [
        (0, "c074323031332d30332d32315432303a30343a30305a"),
        (1, "c11a514b67b0"),
        (2, "c2420100"),
        (3, "c34100"),
        (4, "c48221196ab3"),
        (28, "d81c80"),
        (29, "d81d00"),
        (35, "d8236161"),
        (258, "d9010280"),
        (55799, "d9d9f7a0"),
    ]:
        meta = b"\xa2\x67tensors\xa0\x68metadata" + b"\xa1\x61k" + bytes.fromhex(payload)
        cases.append(
            (f"tag-{tag}", craft(None, raw_meta=meta), burnpack.MetadataError, f"tag {tag}")
        )
    return cases


def _hostile_cases() -> list[tuple]:
    valid = burnpack.dumps(GOOD_TENSORS)
    n = len(valid)
    bad_version = lambda v: valid[:4] + struct.pack("<H", v) + valid[6:]  # noqa: E731
    empty_meta = b"\xa1\x67tensors\xa0"
    E = burnpack
    return [
        ("trunc-0", b"", E.HeaderError, "insufficient"),
        ("trunc-7", valid[:7], E.HeaderError, "insufficient"),
        ("trunc-8", valid[:8], E.HeaderError, "insufficient"),
        ("trunc-9", valid[:9], E.HeaderError, "insufficient"),
        ("trunc-10", valid[:10], E.HeaderError, "metadata needs"),
        ("trunc-half", valid[: n // 2], E.ValidationError, "truncated"),
        ("trunc-n-1", valid[:-1], E.ValidationError, "truncated"),
        ("trunc-empty-pack", burnpack.dumps({})[:100], E.ValidationError, "truncated"),
        ("bad-magic", b"BURN" + valid[4:], E.MagicError, "magic"),
        ("version-0", bad_version(0), E.VersionError, "version 0"),
        ("version-2", bad_version(2), E.VersionError, "version 2"),
        (
            "meta-over-limit",
            craft({}, meta_size=burnpack.MAX_METADATA_SIZE + 1),
            E.ValidationError,
            "potential DoS",
        ),
        (
            "meta-past-eof",
            b"NRUB" + struct.pack("<HI", 1, 4096) + empty_meta,
            E.HeaderError,
            "insufficient",
        ),
        ("garbage-cbor", craft(None, raw_meta=b"\xff\xfe\xfd"), E.MetadataError, "invalid CBOR"),
        ("empty-cbor", craft(None, raw_meta=b""), E.MetadataError, "invalid CBOR"),
        ("depth-200", craft(None, raw_meta=b"\x81" * 200 + b"\x00"), E.MetadataError, "depth"),
        (
            "indefinite-map",
            craft(None, raw_meta=b"\xbf\x67tensors\xa0\xff"),
            E.MetadataError,
            "indefinite",
        ),
        (
            "indefinite-text",
            craft(None, raw_meta=b"\xa1\x7f\x67tensors\xff\xa0"),
            E.MetadataError,
            "indefinite",
        ),
        (
            "duplicate-keys",
            craft(None, raw_meta=b"\xa2\x67tensors\xa0\x67tensors\xa0"),
            E.MetadataError,
            "Duplicate",
        ),
        (
            "array-map-key",
            craft(None, raw_meta=b"\xa2\x67tensors\xa0\x81\x00\x00"),
            E.MetadataError,
            "map key",
        ),
        (
            "huge-array-claim",
            craft(None, raw_meta=b"\xa1\x67tensors\x9b" + b"\xff" * 8),
            E.MetadataError,
            "invalid CBOR",
        ),
        (
            "huge-text-claim",
            craft(None, raw_meta=b"\xa1\x7b" + b"\x0f" + b"\xff" * 7),
            E.MetadataError,
            "invalid CBOR",
        ),
        *_tags(),
        ("cbor-trailing", craft(None, raw_meta=empty_meta + b"\x00"), E.MetadataError, "trailing"),
        (
            "cbor-trailing-64k",
            craft(None, raw_meta=empty_meta + bytes(70_000)),
            E.MetadataError,
            "70000 trailing",
        ),
        ("top-list", craft([1, 2]), E.MetadataError, "expected a map"),
        ("top-int", craft(7), E.MetadataError, "expected a map"),
        ("no-tensors", craft({"metadata": {}}), E.MetadataError, "missing 'tensors'"),
        ("tensors-list", craft({"tensors": []}), E.MetadataError, "'tensors' must be a map"),
        (
            "name-bytes",
            craft({"tensors": {b"t": desc()}}, f32(1, 2)),
            E.MetadataError,
            "not a text string",
        ),
        (
            "name-bad-utf8",
            craft(None, raw_meta=b"\xa1\x67tensors\xa1\x62\xff\xfe\xa0"),
            E.MetadataError,
            "invalid CBOR",
        ),
        ("desc-list", one([1]), E.MetadataError, "tensor 't': descriptor is not a map"),
        (
            "no-dtype",
            one({"shape": [2], "data_offsets": [0, 8]}),
            E.MetadataError,
            "tensor 't': missing field 'dtype'",
        ),
        (
            "no-shape",
            one({"dtype": "F32", "data_offsets": [0, 8]}),
            E.MetadataError,
            "tensor 't': missing field 'shape'",
        ),
        (
            "no-offsets",
            one({"dtype": "F32", "shape": [2]}),
            E.MetadataError,
            "tensor 't': missing field 'data_offsets'",
        ),
        ("dtype-unknown", one(desc("F128")), E.MetadataError, "tensor 't': unknown dtype 'F128'"),
        ("dtype-bare-bool", one(desc("Bool")), E.MetadataError, "tensor 't': unknown dtype"),
        (
            "dtype-bool-u16",
            one(desc({"Bool": "U16"})),
            E.MetadataError,
            "tensor 't': unknown dtype",
        ),
        ("dtype-int", one(desc(4)), E.MetadataError, "tensor 't': unknown dtype"),
        ("dtype-2-entry-map", one(desc({"Bool": "U8", "X": 1})), E.MetadataError, "unknown dtype"),
        (
            "shape-not-list",
            one(desc(shape=[2]) | {"shape": 2}),
            E.MetadataError,
            "tensor 't': shape",
        ),
        ("shape-negative", one(desc(shape=[-2])), E.MetadataError, "tensor 't': shape"),
        ("shape-float", one(desc(shape=[2.0])), E.MetadataError, "tensor 't': shape"),
        ("shape-bool", one(desc(shape=[True, True])), E.MetadataError, "tensor 't': shape"),
        ("shape-text", one(desc(shape=["2"])), E.MetadataError, "tensor 't': shape"),
        ("shape-over-i64", one(desc(shape=[2**63, 0])), E.MetadataError, "tensor 't': shape"),
        (
            "shape-rank-65",
            one(desc(shape=[1] * 65, offsets=(0, 4)), f32(1)),
            E.MetadataError,
            "tensor 't': shape",
        ),
        (
            "shape-overflow",
            one(desc(shape=[2**62, 2**62])),
            E.ValidationError,
            "tensor 't': 8 bytes stored",
        ),
        (
            "len-not-shape",
            one(desc(shape=[3])),
            E.ValidationError,
            "tensor 't': 8 bytes stored but shape [3]",
        ),
        ("offsets-3", one(desc(offsets=(0, 8, 16))), E.MetadataError, "tensor 't': data_offsets"),
        (
            "offsets-negative",
            one(desc(offsets=(-256, 8))),
            E.MetadataError,
            "tensor 't': data_offsets",
        ),
        (
            "offsets-float",
            one(desc(offsets=(0.0, 8.0))),
            E.MetadataError,
            "tensor 't': data_offsets",
        ),
        ("offsets-over-u64", one(desc(offsets=(0, 2**64))), E.MetadataError, "tag 2"),
        (
            "end-before-start",
            one(desc(offsets=(256, 8)), bytes(512)),
            E.ValidationError,
            "tensor 't': end offset 8 < start 256",
        ),
        (
            "misaligned",
            one(desc(offsets=(8, 16)), bytes(16)),
            E.ValidationError,
            "tensor 't': start 8 is not 256-byte aligned",
        ),
        ("out-of-bounds", one(desc(offsets=(256, 264))), E.ValidationError, "truncated"),
        (
            "huge-offset",
            one(desc(offsets=(2**64 - 256, 2**64 - 248))),
            E.ValidationError,
            "truncated",
        ),
        (
            "tensor-too-big",
            one(
                desc(
                    "U8",
                    shape=[burnpack.base._MAX_TENSOR_SIZE + 1],
                    offsets=(0, burnpack.base._MAX_TENSOR_SIZE + 1),
                )
            ),
            E.ValidationError,
            "Tensor 't' size",
        ),
        (
            "overlap",
            craft(
                {
                    "tensors": {
                        "a": desc(shape=[128], offsets=(0, 512)),
                        "b": desc(offsets=(256, 264)),
                    }
                },
                bytes(512),
            ),
            E.ValidationError,
            "overlap",
        ),
        ("param-id-negative", one(desc(param_id=-1)), E.MetadataError, "tensor 't': param_id"),
        ("param-id-text", one(desc(param_id="7")), E.MetadataError, "tensor 't': param_id"),
        ("param-id-bool", one(desc(param_id=True)), E.MetadataError, "tensor 't': param_id"),
        ("metadata-list", one(desc(), metadata=[]), E.MetadataError, "'metadata' must be a map"),
        (
            "metadata-int-value",
            one(desc(), metadata={"k": 1}),
            E.MetadataError,
            "metadata entry 'k'",
        ),
        ("scalars-list", one(desc(), scalars=[]), E.MetadataError, "'scalars' must be a map"),
        (
            "scalar-float-int",
            one(desc(), scalars={"s": {"Float": 1}}),
            E.MetadataError,
            "scalar 's': a Float payload",
        ),
        (
            "scalar-int-float",
            one(desc(), scalars={"s": {"Int": 1.5}}),
            E.MetadataError,
            "scalar 's'",
        ),
        (
            "scalar-uint-negative",
            one(desc(), scalars={"s": {"UInt": -1}}),
            E.MetadataError,
            "scalar 's'",
        ),
        (
            "scalar-int-over-i64",
            one(desc(), scalars={"s": {"Int": 2**63}}),
            E.MetadataError,
            "scalar 's'",
        ),
        (
            "scalar-bool-int",
            one(desc(), scalars={"s": {"Bool": 1}}),
            E.MetadataError,
            "scalar 's': a Bool",
        ),
        (
            "scalar-unknown-kind",
            one(desc(), scalars={"s": {"Str": "x"}}),
            E.MetadataError,
            "scalar 's': unknown scalar kind",
        ),
        (
            "scalar-two-kinds",
            one(desc(), scalars={"s": {"Int": 1, "UInt": 1}}),
            E.MetadataError,
            "scalar 's': expected a one-entry",
        ),
        ("scalar-bare", one(desc(), scalars={"s": 1}), E.MetadataError, "scalar 's'"),
        (
            "checksum-absent-tensor",
            one(desc(), metadata={burnpack.CHECKSUM_PREFIX + "ghost": "0" * 16}),
            E.ValidationError,
            "ghost",
        ),
        (
            "checksum-not-hex",
            one(desc(), metadata={burnpack.CHECKSUM_PREFIX + "t": "xyz"}),
            E.MetadataError,
            "not xxh3 hex",
        ),
        ("trailing-after-tensor", valid + b"\x00", E.ValidationError, "1 unexpected bytes"),
        (
            "trailing-after-empty-pack",
            burnpack.dumps({}) + b"junk",
            E.ValidationError,
            "4 unexpected bytes",
        ),
    ]


HOSTILE = _hostile_cases()


@pytest.mark.parametrize(
    ("label", "data", "error", "message"), HOSTILE, ids=[c[0] for c in HOSTILE]
)
def test_hostile_input_raises_the_right_error(label, data, error, message, tmp_path):
    with pytest.raises(error) as err:
        burnpack.loads(data)
    assert message in str(err.value), str(err.value)
    path = tmp_path / f"{label}.bpk"
    path.write_bytes(data)
    with pytest.raises(error) as err:
        burnpack.read(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_hostile_error_messages_are_bounded():
    huge = "x" * 1_000_000
    with pytest.raises(burnpack.MetadataError) as err:
        burnpack.loads(one(desc(huge)))
    assert len(str(err.value)) < 300


def test_tensor_count_over_limit(monkeypatch):
    data = burnpack.dumps({f"t{i}": torch.ones(1) for i in range(4)})
    monkeypatch.setattr(burnpack.reader, "_MAX_TENSOR_COUNT", 3)
    with pytest.raises(
        burnpack.ValidationError, match="File contains 4 tensors, exceeding maximum of 3"
    ):
        burnpack.loads(data)


def test_file_size_limit_is_checked_first(tmp_path, monkeypatch):
    path = burnpack.write(tmp_path / "s.bpk", {"a": torch.ones(100)})
    monkeypatch.setattr(burnpack.reader, "MAX_FILE_SIZE", 100)
    with pytest.raises(burnpack.ValidationError, match="exceeds maximum allowed size"):
        burnpack.read(path)


def test_unknown_descriptor_keys_and_null_param_id_are_accepted():
    d = desc(param_id=None) | {"future_field": [1, 2, 3]}
    pack = burnpack.loads(craft({"tensors": {"t": d}, "extra": 1}, f32(1, 2)))
    assert pack.entries["t"].param_id is None and pack.tensor("t").tolist() == [1.0, 2.0]


def test_descriptor_keys_in_any_order_are_accepted():
    d = {"data_offsets": [0, 8], "param_id": 3, "shape": [2], "dtype": "F32"}
    pack = burnpack.loads(craft({"scalars": {}, "tensors": {"t": d}}, f32(5, 6)))
    assert pack.entries["t"].param_id == 3 and pack.tensor("t").tolist() == [5.0, 6.0]


# =============================== property-based round trips ====================================

_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(Scalar.Int),
    st.integers(0, 2**64 - 1).map(Scalar.UInt),
    st.floats(allow_nan=True, allow_infinity=True).map(Scalar.Float),
    st.booleans().map(Scalar.Bool),
)
_metadata = st.dictionaries(
    _names.filter(lambda k: not k.startswith(burnpack.CHECKSUM_PREFIX)), _names, max_size=4
)
_ALL_DTYPES = [*TORCH_DTYPES.values(), torch.bool]


@st.composite
def _tensor(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(_ALL_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(
            shape
        )
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    return (
        torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if numel
        else torch.empty(shape, dtype=dtype)
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and burnpack.tensor_bytes(a).tobytes() == burnpack.tensor_bytes(b).tobytes()
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.dictionaries(_names, _tensor(), max_size=5),
    param_ids=st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=5, max_size=5),
    scalars=st.dictionaries(_names, _scalars, max_size=4),
    metadata=_metadata,
    checksums=st.booleans(),
)
def test_property_round_trip(tensors, param_ids, scalars, metadata, checksums):
    entries = {
        name: TensorEntry.from_tensor(t, pid)
        for (name, t), pid in zip(tensors.items(), param_ids, strict=False)
    }
    data = burnpack.dumps(entries, metadata=metadata, scalars=scalars, checksums=checksums)
    assert len(data) == burnpack.size(
        entries, metadata=metadata, scalars=scalars, checksums=checksums
    )
    pack = burnpack.loads(data)
    assert pack.names == sorted(tensors)
    assert pack.metadata == metadata and pack.scalars == scalars
    for k, s in scalars.items():
        if s.kind == "Float":
            assert struct.pack(">d", pack.scalars[k].value) == struct.pack(">d", s.value)
    for (name, t), pid in zip(tensors.items(), param_ids, strict=False):
        assert _same(pack.tensor(name), t)
        assert pack.entries[name].param_id == pid
    rewritten = burnpack.dumps(
        _entries_in_data_order(pack),
        metadata=pack.metadata,
        scalars=pack.scalars,
        checksums=checksums,
    )
    assert rewritten == data


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_mutated_packs_parse_or_raise_burnpack_errors(data):
    base = burnpack.dumps(
        {
            "w": torch.arange(6.0).reshape(2, 3),
            "b": torch.tensor([True, False]),
            "q": mk({"QFloat": _DEFAULT_SCHEME}, [2], b"\x01\x02\x03"),
        },
        metadata={"k": "v"},
        scalars={"s": 1.5, "n": -2},
    )
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "set", "truncate", "insert"]))
        if not blob:
            break
        i = data.draw(st.integers(0, len(blob) - 1))
        if action == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set":
            blob[i] = data.draw(st.integers(0, 255))
        elif action == "truncate":
            del blob[i:]
        else:
            blob[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    parse_fully(bytes(blob))


def parse_fully(blob: bytes) -> None:
    """Parse and touch every tensor: only BurnpackError subclasses may escape.

    The oracle of the fuzz tests here and of ``tests/fuzz/fuzz_burnpack.py``."""
    try:
        pack = burnpack.loads(blob)
        for name in pack.names:
            pack.raw(name)
        pack.tensors()
    except burnpack.BurnpackError:
        pass


def test_seeded_random_fuzz_of_valid_packs():
    rng = random.Random(20260821)
    seeds = [
        burnpack.dumps({}),
        burnpack.dumps(GOOD_TENSORS, scalars={"x": 0.1}, metadata={"m": "n"}),
        MNIST.read_bytes()[:4096],
        burnpack.dumps(
            {"b": torch.tensor([True]), "h": torch.ones(3, dtype=torch.float16)}, checksums=False
        ),
    ]
    for _ in range(1500):
        blob = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            if op < 0.6 and blob:
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            elif op < 0.8:
                del blob[rng.randrange(len(blob) + 1) :]
            else:
                pos = rng.randrange(len(blob) + 1)
                blob[pos:pos] = rng.randbytes(rng.randint(1, 16))
        parse_fully(bytes(blob))


def test_checksums_patched_in_place_around_user_metadata_and_scalars(tmp_path):
    """Digests land at offsets computed once: user keys sorting before and after the checksum
    run, multi-byte names, scalars, and big (hashed while written) and small tensors mixed."""
    tensors = {
        "é" * 30: torch.arange(300, dtype=torch.int16),
        "big": torch.rand(2**18 + 5),  # over _PARALLEL_HASH_MIN: hashed on the helper thread
        "b": torch.ones(3, dtype=torch.bool),
    }
    metadata = {"a": "0" * 16, "lightning_bpk/a": "x", "lightning_bpk/z": "0" * 16, "zz": "y"}
    scalars = {"lr": 0.5, "step": 7}
    path = burnpack.write(tmp_path / "m.bpk", tensors, metadata=metadata, scalars=scalars)
    with burnpack.read(path) as pack:
        pack.verify()
        assert pack.metadata == metadata and pack.scalars["step"] == burnpack.Scalar.Int(7)
        for name, t in tensors.items():
            assert xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(t)) == pack.checksums[name]
            assert torch.equal(pack.tensor(name), t)
    assert path.read_bytes() == burnpack.dumps(tensors, metadata=metadata, scalars=scalars)


def test_write_add_suffix_false_writes_exactly_the_path(tmp_path):
    path = burnpack.write(tmp_path / "manual", {"w": torch.ones(2)}, add_suffix=False)
    assert path == tmp_path / "manual"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manual"]
    assert burnpack.read(path).tensor("w").tolist() == [1.0, 1.0]


def test_json_in_a_metadata_value_is_bounded_before_it_is_parsed():
    value = {"a": ["[[[{", {"b": [1, '\\"]]']}]}  # brackets in strings, escaped quotes
    assert burnpack._decode_json(json.dumps(value), what="x", max_depth=4) == value
    with pytest.raises(burnpack.MetadataError, match=r"^x: JSON nested 5 levels deep \(at most 4"):
        burnpack._decode_json(json.dumps([value]), what="x", max_depth=4)
    deep = "[" * 100_000 + "]" * 100_000  # json.loads alone: RecursionError
    with pytest.raises(burnpack.MetadataError, match=r"^the index: JSON nested 100000 levels"):
        burnpack._decode_json(deep, what="the index")
    with pytest.raises(burnpack.MetadataError, match=r"^x: not valid JSON"):
        burnpack._decode_json('["unterminated', what="x")
    with pytest.raises(burnpack.MetadataError, match=r"^x: a bytes, not JSON text"):
        burnpack._decode_json(b"[]", what="x")


# =============================== two threads, no GC pauses (burnpack._parallel) ================


def test_many_damaged_tensors_checked_on_two_threads(tmp_path):
    source = _mixed()
    path = burnpack.write(tmp_path / "m.bpk", source)
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    for name in ("s5", "s250", "w"):
        data[pack.data_start + pack.entries[name].data_offsets[0]] ^= 0x10
    path.write_bytes(data)
    with burnpack.read(path) as damaged:
        with pytest.raises(burnpack.ChecksumError, match=r"tensor 's250'"):  # first by name
            damaged.tensors()
        with pytest.raises(burnpack.ChecksumError, match=r"\['s250', 's5', 'w'\]"):
            damaged.verify()
        damaged.check(["s6", "i"])  # intact ones pass, and are not hashed again
        assert {"s6", "i"} <= damaged._verified


def test_run_shares_units_and_raises_the_first_error():
    done: list[int] = []
    _parallel.run([functools.partial(done.append, i) for i in range(100)])
    assert sorted(done) == list(range(100))

    def fail() -> None:
        raise ValueError("unit failed")

    with pytest.raises(ValueError, match="unit failed"):
        _parallel.run([fail, *(functools.partial(done.append, i) for i in range(10))])


def test_copy_moves_every_byte_in_pieces(monkeypatch):
    monkeypatch.setattr(_parallel, "COPY_CHUNK", 1000)
    sources = [torch.randn(n) for n in (1, 250, 251, 4000)]
    targets = [torch.zeros_like(s) for s in sources]
    pairs = zip(targets, sources, strict=True)
    _parallel.copy((burnpack.tensor_bytes(t), burnpack.tensor_bytes(s)) for t, s in pairs)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_gc_pauses_nest_and_leave_a_disabled_collector_disabled():
    assert gc.isenabled()
    with _parallel.gc_paused():
        with _parallel.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _parallel.gc_paused():
            pass
        assert not gc.isenabled()  # the user's choice stands
    finally:
        gc.enable()


def test_tensor_bytes_are_the_storage_and_keep_the_tensor_alive():
    for dtype in _ALL_DTYPES:
        t = torch.arange(6).to(dtype)
        view = burnpack.tensor_bytes(t)
        assert bytes(view) == t.view(torch.uint8).numpy().tobytes() and view.nbytes == t.nbytes
    view = burnpack.tensor_bytes(torch.arange(1000.0))
    gc.collect()  # the tensor has no other reference
    assert torch.frombuffer(bytearray(view), dtype=torch.float32).tolist() == list(range(1000))
    param = torch.nn.Parameter(torch.ones(3))
    assert bytes(burnpack.tensor_bytes(param)) == bytes(burnpack.tensor_bytes(param.detach()))
    strided = torch.arange(12.0).reshape(3, 4).t()  # copied into a contiguous tensor
    assert bytes(burnpack.tensor_bytes(strided)) == strided.contiguous().numpy().tobytes()


def test_an_atexit_hook_still_saves_and_loads(direct_dir):
    """No new work reaches a thread once the interpreter shuts down: the I/O and the helper's
    work run on the caller's thread then."""
    script = textwrap.dedent(
        f"""
        import atexit, torch
        from lightning_bpk import burnpack

        def save_at_exit():
            source = {{f"w{{i}}": torch.full((1 << 20,), float(i)) for i in range(3)}}
            path = burnpack.write({str(direct_dir / "exit.bpk")!r}, source)
            targets = {{k: torch.zeros_like(v) for k, v in source.items()}}
            burnpack.read_into(path, targets)
            assert all(torch.equal(targets[k], v) for k, v in source.items())
            print("saved and loaded at exit")

        atexit.register(save_at_exit)
        burnpack.write({str(direct_dir / "warm.bpk")!r}, {{"w": torch.ones(1 << 20)}})  # threads up
        """
    )
    out = run_process([sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "saved and loaded at exit"
