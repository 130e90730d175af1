"""Hostile input and the named limits: a corpus of crafted files (truncation at every boundary,
bad magic and versions, over-limit sizes, tagged, indefinite and deep CBOR, wrong types, bad
offsets) each raising the right error with a bounded message naming the file; the tensor
count and file size limits; JSON in metadata bounded before it is parsed; mutation fuzzing
(hypothesis and seeded) where only BurnpackErrors may escape."""

from __future__ import annotations

import json
import random
import struct

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bpk import burnpack

from _burnpack_helpers import _DEFAULT_SCHEME, MNIST, f32, mk, parse_fully

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


# =============================== mutation fuzzing ==============================================


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


# =============================== JSON held in a metadata value =================================


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
