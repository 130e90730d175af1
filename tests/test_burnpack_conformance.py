"""Burn's own burnpack conformance tests, numbered as in the spec's list (burn-pack's
tests/*.rs and in-crate unit tests): the header, alignment, errors, round trips, the lazy
(deferred) writer and its atomic writes, streaming memory, scalar conversions."""

from __future__ import annotations

import gc
import struct
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import Scalar, TensorEntry

from _burnpack_helpers import _DEFAULT_SCHEME, f32, listdir, mk


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
