"""The state codec: exact types through a real burnpack round trip, clear errors for the rest."""

from __future__ import annotations

import datetime
import json
import math
import re
from collections import Counter, OrderedDict, deque, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_bpk import burnpack, state
from lightning_bpk.burnpack import Scalar
from lightning_bpk.records import StateRecord
from lightning_bpk.state import _STRUCTURE_KEY, Content, StateError, decode, encode

FIXTURES = Path(__file__).resolve().parent / "fixtures"
I64_MIN, I64_MAX, U64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def through_pack(obj: object, **hooks: object) -> object:
    """encode -> burnpack bytes -> parse -> decode, as a record does."""
    content = encode(obj, **hooks)
    data = burnpack.dumps(content.tensors, scalars=content.scalars, metadata=content.metadata)
    return decode(burnpack.loads(data))


def assert_exact(a: object, b: object) -> None:
    """Equal values of identical types all the way down (NaN equals NaN, -0.0 keeps its sign)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
        for k in a:
            assert_exact(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_exact(x, y)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    else:
        assert a == b


def _kinds(node: object) -> set[str]:
    """Every node kind in a structure tree (dict keys and set elements that are nodes too;
    a leaf kept inline counts as ``inline``)."""
    if node is None:
        return {"null"}
    if not isinstance(node, list):
        return {"inline"}
    kind, arg = node[0], node[1]
    if kind in "DOC":
        children = [c for item in arg for c in item]
    elif kind in "LUQSF":
        children = arg
    else:
        children = []
    return {kind}.union(*map(_kinds, children))


_EVERY_KIND = OrderedDict(
    b=True, i=3, I=2**70, f=0.5, s="x", t=torch.ones(1), z=torch.tensor(4.0),
    n=np.ones(1), y=b"y", Y=bytearray(b"Y"), L=[None], U=(1,), D={1: 2}, C=Counter("c"),
    Q=deque([1], maxlen=2), S={2}, F=frozenset({3}), P=Path("/x"), J=datetime.date(2026, 1, 2),
    T=datetime.datetime(2026, 1, 2, 3, 4, 5, 6), W=datetime.timedelta(1, 2, 3),
)  # fmt: skip


def test_every_node_kind_is_documented_in_the_format_page() -> None:
    named = encode(_EVERY_KIND, as_scalar=lambda path: path == ("z",))
    inline = encode(_EVERY_KIND, inline=True, as_scalar=lambda path: path == ("z",))
    kinds = set()
    for content in (named, inline):
        kinds |= _kinds(json.loads(content.metadata[_STRUCTURE_KEY])["tree"])
    assert len(kinds) == 24  # every branch of the encoder
    page = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    table = page.split("### The structure of nested data")[1]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {kind for cell in cells for kind in re.findall(r'`\[?"?(\w+)', cell)}
    assert kinds == documented
    for hooks in ({}, {"inline": True}):
        value = through_pack(_EVERY_KIND, as_scalar=lambda path: path == ("z",), **hooks)
        assert_exact(value, _EVERY_KIND)


def test_inline_encoding_is_one_structure_and_decodes_to_the_same_exact_types() -> None:
    value = {
        "epoch": 3, "loss": float("nan"), "neg": -0.0, "big": 2**90, "flag": False, "name": "x",
        "loops": {"fit": {"ready": 4, "completed": 3}}, "w": torch.ones(2), 7: (1, "a", None),
    }  # fmt: skip
    content = encode(value, inline=True)
    assert content.scalars == {} and list(content.tensors) == ["w"]
    assert list(content.metadata) == [_STRUCTURE_KEY]
    assert json.loads(content.metadata[_STRUCTURE_KEY])["version"] == 2
    assert_exact(through_pack(value, inline=True), value)


def test_a_structure_of_named_leaves_only_is_still_written_as_version_1() -> None:
    content = encode({"lr": 0.1, "betas": (0.9, 0.99)})
    assert json.loads(content.metadata[_STRUCTURE_KEY])["version"] == 1


def test_a_state_record_of_the_old_format_still_loads() -> None:
    """tests/fixtures/burnpack/state-v1.bpk: a StateRecord written before leaves were inline."""
    record = StateRecord.load(FIXTURES / "burnpack" / "state-v1.bpk")
    with burnpack.read(FIXTURES / "burnpack" / "state-v1.bpk") as pack:
        assert '"version":1' in pack.metadata[_STRUCTURE_KEY] and len(pack.scalars) == 10
    value = record.value
    assert value["loops"]["fit_loop"]["epoch_progress"]["total"] == {"ready": 4, "completed": 3}
    assert_exact(value["betas"], (0.9, 0.999))
    assert_exact(value["od"], OrderedDict(a=-0.0))
    assert_exact(value["milestones"], Counter({10: 1}))
    assert value["big"] == 2**70 and value["flag"] is True and value["epoch"] == 3
    assert math.isinf(value["callbacks"]["ModelCheckpoint{'monitor': None}"]["kth_value"])
    assert torch.equal(value["w"], torch.arange(4, dtype=torch.float32))


def test_lenient_encoding_leaves_out_what_it_cannot_store_and_names_it() -> None:
    dropped: list[str] = []
    value = {"ok": 1, "fn": print, "items": [1, object()], "keys": {(1, object()): 2}}
    content = encode(value, inline=True, dropped=dropped)
    assert decode(content) == {"ok": 1, "items": [1, None], "keys": {}}
    assert [d.split(":")[0] for d in dropped[:2]] == ["$['fn']", "$['items'][1]"]
    assert dropped[2].startswith("$['keys'][(1, <object") and len(dropped) == 3


def test_nested_plain_data_keeps_exact_types() -> None:
    value = {
        "epoch": 3,
        1: "int key",
        "1": "str key beside it",
        2.5: "float key",
        None: "none key",
        False: "bool key",
        "nested": {"list": [1, 2.0, None, True, "x"], "tuple": (1, (2, [3]))},
        "empty": {"d": {}, "l": [], "t": ()},
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "counter": Counter({2: 2, 5: 1}),
    }
    out = through_pack(value)
    assert_exact(value, out)
    assert type(out["ordered"]) is OrderedDict and type(out["counter"]) is Counter


@pytest.mark.parametrize(
    "number", [0, -1, I64_MAX, I64_MAX + 1, U64_MAX, U64_MAX + 1, I64_MIN, I64_MIN - 1, 10**40]
)
def test_integers_of_any_size(number: int) -> None:
    assert_exact({"n": number}, through_pack({"n": number}))


def test_int_scalar_kinds() -> None:
    content = encode({"a": 5, "b": I64_MAX + 1, "c": True})
    assert content.scalars == {
        "a": Scalar.Int(5),
        "b": Scalar.UInt(I64_MAX + 1),
        "c": Scalar.Bool(True),
    }
    assert encode({"huge": -(2**70)}).metadata["huge"] == str(-(2**70))


@pytest.mark.parametrize("number", [0.0, -0.0, 1e-300, math.inf, -math.inf, math.nan, 0.1])
def test_floats_including_signed_zero_and_nan(number: float) -> None:
    assert_exact([number], through_pack([number]))


@pytest.mark.parametrize(
    "text", ["", "héllo wörld ✓ 日本", "a.b.c", "100%", "\x00", "lightning_bpk/x"]
)
def test_strings_as_values_and_keys(text: str) -> None:
    value = {text: text, "k": {text: [text]}}
    out = through_pack(value)
    assert_exact(value, out)


def test_reserved_names_cannot_overwrite_package_metadata() -> None:
    content = encode({"lightning_bpk/state": "mine", "lightning_bpk/record": "also mine"})
    assert not any(
        k.startswith(state._RESERVED_PREFIX) for k in content.metadata if k != _STRUCTURE_KEY
    )
    from lightning_bpk.records import StateRecord

    value = {"lightning_bpk/record": "user value"}
    assert StateRecord.from_bytes(StateRecord(value).to_bytes()).value == value


ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensors_of_every_dtype_and_shape(dtype: torch.dtype) -> None:
    base = (
        torch.arange(6).reshape(2, 3) % 2 if dtype == torch.bool else torch.arange(6).reshape(2, 3)
    )
    value = {
        "t": base.to(dtype),
        "zero_d": torch.tensor(1).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
        "strided": base.to(dtype).t(),
    }
    assert_exact(value, through_pack(value))


def test_shared_tensor_is_stored_once_and_comes_back_shared() -> None:
    shared = torch.arange(4.0)
    content = encode({"a": shared, "b": [shared], "c": shared.clone()})
    assert len(content.tensors) == 2
    out = through_pack({"a": shared, "b": [shared]})
    assert out["a"] is out["b"][0]


def test_numpy_arrays_bytes_and_bytearray() -> None:
    value = {
        "f": np.arange(6, dtype=np.float32).reshape(3, 2),
        "zero_d": np.array(7, dtype=np.int16),
        "bool": np.array([True, False]),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "bytes": b"\x00\x01binary\xff",
        "no_bytes": b"",
        "bytearray": bytearray(b"abc"),
        "scalar": np.float64(2.5),
    }
    out = through_pack(value)
    assert out.pop("scalar") == 2.5
    value.pop("scalar")
    assert_exact(value, out)
    big_endian = np.arange(3, dtype=">f4")
    assert np.array_equal(through_pack(big_endian), big_endian)


def test_zero_d_tensors_as_scalars_keep_their_dtype() -> None:
    value = {
        "step": torch.tensor(3.0),
        "frac": torch.tensor(0.1),
        "negzero": torch.tensor(-0.0, dtype=torch.float64),
        "nan": torch.tensor(math.nan, dtype=torch.bfloat16),
        "neg": torch.tensor(-5),
        "big": torch.tensor(U64_MAX, dtype=torch.uint64),
        "flag": torch.tensor(True),
        "half": torch.tensor(2.0, dtype=torch.float16),
    }
    content = encode(value, as_scalar=lambda path: True)
    assert content.tensors == {}
    assert content.scalars["step"] == Scalar.UInt(3)
    assert content.scalars["frac"].kind == "Float"
    assert content.scalars["negzero"] == Scalar.Float(-0.0)
    assert content.scalars["neg"] == Scalar.Int(-5)
    assert content.scalars["big"] == Scalar.UInt(U64_MAX)
    assert content.scalars["flag"] == Scalar.Bool(True)
    out = through_pack(value, as_scalar=lambda path: True)
    assert_exact(value, out)
    assert math.copysign(1, out["negzero"].item()) == -1


def test_name_path_hook_names_leaves() -> None:
    content = encode({"state": {7: {"exp_avg": torch.ones(2)}}}, name_path=lambda p: ("x", *p[1:]))
    assert list(content.tensors) == ["x.7.exp_avg"]
    # colliding names get a suffix instead of overwriting
    content = encode({"a": 1, "b": 2}, name_path=lambda p: ("same",))
    assert sorted(content.scalars) == ["same", "same~1"]
    assert decode(content) == {"a": 1, "b": 2}


hashable_keys = st.one_of(
    st.text(max_size=8), st.integers(-(2**70), 2**70), st.none(), st.booleans()
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.lists(st.floats(width=32, allow_nan=False), max_size=4).map(
        lambda xs: torch.tensor(xs, dtype=torch.float32)
    ),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(hashable_keys, children, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_hypothesis_round_trip(value: object) -> None:
    assert_exact(value, through_pack(value))


class Custom:
    pass


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"fn": lambda: 0}, r"\$\['fn'\]: cannot store a builtins.function"),
        ({"a": [1, {2, Custom()}]}, r"\$\['a'\]\[1\]: dict key or set element .*Custom"),
        ({"obj": Custom()}, r"\$\['obj'\]: cannot store a .*Custom"),
        ({"c": torch.zeros(2, dtype=torch.complex64)}, r"\$\['c'\]: tensor dtype torch.complex64"),
        ({"s": torch.zeros(2).to_sparse()}, r"\$\['s'\]: torch.sparse_coo tensors"),
        ({(1, 2j): 0}, r"\$\[\(1, 2j\)\]: dict key or set element 2j of type complex"),
        ({"p": Point(1, 2)}, r"\$\['p'\]: cannot store a .*Point"),
        ({"o": np.array([object()], dtype=object)}, r"\$\['o'\]: numpy dtype object"),
    ],
)
def test_unrepresentable_values_name_their_path(value: object, where: str) -> None:
    with pytest.raises(StateError, match=where):
        encode(value)


def test_too_deep_structure_is_refused_on_encode() -> None:
    value: list = []
    for _ in range(state._MAX_DEPTH + 5):
        value = [value]
    with pytest.raises(StateError, match="nesting deeper than"):
        encode(value)


def hostile(tree: object, *, tensors=None, scalars=None, metadata=None, raw=None) -> Content:
    structure = raw if raw is not None else json.dumps({"version": 1, "tree": tree})
    return Content(tensors or {}, scalars or {}, {**(metadata or {}), _STRUCTURE_KEY: structure})


def deep(levels: int) -> object:
    node: object = None
    for _ in range(levels):
        node = ["L", [node]]
    return node


@pytest.mark.parametrize(
    "content",
    [
        hostile(None, raw="{not json"),
        hostile(None, raw="[" * 100_000 + "]" * 100_000),
        hostile(None, raw='"just a string"'),
        hostile(None, raw=json.dumps({"version": 99, "tree": None})),
        hostile(deep(state._MAX_DEPTH + 10)),
        hostile({"kind": "D"}),
        hostile(["D", [["k"]]]),
        hostile(["D", [[["list-key"], None]]]),
        hostile(["D", "not a list"]),
        hostile(["Q", 1]),
        hostile([["unhashable"], 1]),
        hostile(["i", "missing"]),
        hostile(["i", ["unhashable"]]),
        hostile(["t", ["unhashable"]]),
        hostile(["t", "absent"]),
        hostile(["f", "x"], scalars={"x": Scalar.Int(1)}),
        hostile(["b", "x"], scalars={"x": Scalar.Float(1.0)}),
        hostile(["i", "x"], scalars={"x": Scalar.Bool(True)}),
        hostile(["I", "x"], metadata={"x": "12abc"}),
        hostile(["s", "nope"]),
        hostile(["y", "t"], tensors={"t": torch.zeros(2)}),
        hostile(["n", "t"], tensors={"t": torch.zeros(2, dtype=torch.bfloat16)}),
        hostile(["z", "x", "F32"]),
        hostile(["z", "x", "NOPE"], scalars={"x": Scalar.UInt(1)}),
        hostile(["z", "x", {"Bool": "Native"}], scalars={"x": Scalar.UInt(1)}),
        hostile(["z", "x", "I8"], scalars={"x": Scalar.Float(1.5)}),
        hostile(["z", "x", "I8"], scalars={"x": Scalar.UInt(300)}),
        hostile(["z", "x"]),
        hostile(["i", "x", "extra"], scalars={"x": Scalar.Int(1)}),
        Content({}, {}, {}),
    ],
)
def test_hostile_structures_raise_state_error(content: Content) -> None:
    with pytest.raises(StateError):
        decode(content)


def test_hostile_structure_inside_a_real_pack() -> None:
    data = burnpack.dumps(
        {}, metadata={_STRUCTURE_KEY: json.dumps({"version": 1, "tree": ["t", "w"]})}
    )
    with pytest.raises(StateError, match="tensor 'w' is missing"):
        decode(burnpack.loads(data))


def test_a_structure_nested_past_the_limit_is_refused_before_it_is_parsed():
    content = encode([1])
    tree = "null"
    for _ in range(450):  # 900 JSON levels: json.loads parses it, walking it needs the stack
        tree = '["L",[' + tree + "]]"
    content.metadata[_STRUCTURE_KEY] = json.dumps({"version": 1, "tree": None}).replace(
        "null", tree
    )
    with pytest.raises(StateError, match=r"JSON nested 901 levels deep \(at most 194\)"):
        decode(content)
    nested: object = 1
    for _ in range(state._MAX_DEPTH):
        nested = {"k": nested}
    assert decode(encode(nested)) == nested  # the deepest state encode accepts still decodes
