"""copy_nested: what a copy of nested data shares with the original, and what it does not."""

from __future__ import annotations

import datetime
from collections import Counter, OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_bpk._nested import copy_nested


def _staged(path: tuple, tensor: torch.Tensor) -> tuple:
    return ("staged", path, tensor.clone())


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2], "b": {"c": (3, [4])}},
        OrderedDict(z=[1], a=[2]),
        Counter(a=2, b=1),
        deque([[1], [2]], maxlen=5),
        {1, 2},
        [np.arange(3)],
        bytearray(b"ab"),
    ],
    ids=["dicts lists tuples", "OrderedDict", "Counter", "deque", "set", "ndarray", "bytearray"],
)
def test_every_container_is_rebuilt_as_its_kind_and_holds_nothing_of_the_original(value):
    copied = copy_nested(value, _staged)
    assert type(copied) is type(value)
    if isinstance(value, deque):
        assert copied.maxlen == value.maxlen and list(copied) == list(value)
        assert copied[0] is not value[0]
    elif isinstance(value, list):
        assert copied[0] is not value[0] and np.array_equal(copied[0], value[0])
    else:
        assert copied == value
    assert copied is not value
    if type(value) is dict:
        assert copied["b"]["c"][1] is not value["b"]["c"][1]


def test_each_tensor_becomes_what_the_caller_returns_for_its_path():
    w = torch.ones(2)
    copied = copy_nested({"opt": [{"w": w}], "t": (w,)}, _staged)
    assert copied["opt"][0]["w"][:2] == ("staged", ("opt", 0, "w"))
    assert copied["t"][0][:2] == ("staged", ("t", 0))


@pytest.mark.parametrize(
    "leaf",
    [
        3,
        2.5,
        "s",
        b"b",
        None,
        True,
        1j,
        frozenset({1}),
        torch.float16,
        torch.device("cpu"),
        Path("/x"),
        datetime.date(2026, 1, 1),
        datetime.timedelta(days=1),
        np.float32(1.5),
    ],
    ids=lambda v: type(v).__name__,
)
def test_immutable_leaves_are_kept_as_they_are(leaf):
    assert copy_nested({"k": [leaf]}, _staged)["k"][0] is leaf


def test_any_other_leaf_goes_through_other():
    class Thing:
        pass

    class Pair(tuple):
        pass

    seen: list = []
    thing, pair = Thing(), Pair((1, [2]))
    copied = copy_nested({"a": thing, "b": [pair]}, _staged, lambda v: seen.append(v) or "x")
    assert copied == {"a": "x", "b": ["x"]} and seen == [thing, pair]
    assert copy_nested({"a": thing}, _staged)["a"] is thing  # by default: kept
