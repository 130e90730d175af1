"""Nested Python data <-> burnpack content (tensors, scalars, metadata), with no pickle.

Lightning's checkpoint dict mixes tensors with ints, floats, strings, tuples, ``None`` and
int-keyed dicts. This codec stores each leaf where a reader of the ``.bpk`` expects it and
records the shape of the structure as JSON, so every value comes back with its exact type:

=====================  ===============================================================
Python value           stored as
=====================  ===============================================================
``torch.Tensor``       a tensor (0-d included, dtype kept)
``numpy.ndarray``      a tensor, decoded back to an ndarray
``bytes``              a U8 tensor
``bool``/``int``       a ``Bool``/``Int`` scalar (``UInt`` past i64; decimal text past u64)
``float``              a ``Float`` scalar (NaN and infinities included)
``str``                a ``metadata`` entry
``None``               only in the structure
dict/list/tuple        only in the structure; dict keys may be str, int, float, bool, None
=====================  ===============================================================

Leaf names are the dotted path to the leaf (``optimizer_states.0.param_groups.0.lr``); a ``.``
or ``%`` inside a key is percent-escaped. The structure lives in the metadata entry
:data:`STRUCTURE_KEY`. Anything else (a user object, a lambda, a set) raises :class:`StateError`
naming where it sits, e.g. ``$['hyper_parameters']['loss_fn']``.

>>> import torch
>>> content = encode({"step": 3, "betas": (0.9, 0.999), "w": torch.ones(2)})
>>> sorted(content.tensors), sorted(content.scalars)
(['w'], ['betas.0', 'betas.1', 'step'])
>>> decode(content)["betas"]
(0.9, 0.999)
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import Scalar

# Metadata entry holding the JSON structure; the "/" keeps it apart from escaped leaf names.
STRUCTURE_KEY = "lightning_bpk/state"
# Bumped when the structure encoding changes incompatibly; readers refuse newer versions.
STRUCTURE_VERSION = 1
# Name of a leaf that is the whole value (``encode(3)``).
ROOT_NAME = "__root__"
# Deeper structures are refused: they only arise from hostile or runaway data.
MAX_DEPTH = 64

_I64_MIN, _U64_MAX = -(2**63), 2**64 - 1


class StateError(ValueError):
    """A value cannot be encoded, or stored content does not decode; the message names where."""


class Content(NamedTuple):
    """What a burnpack holds: tensors (in write order), typed scalars and string metadata."""

    tensors: dict[str, torch.Tensor]
    scalars: dict[str, Scalar]
    metadata: dict[str, str]


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace(".", "%2E")


def _segment(key: object) -> str:
    return _escape(key if isinstance(key, str) else str(key))


def _where(path: tuple) -> str:
    return "$" + "".join(f"[{k!r}]" for k in path)


class _Encoder:
    def __init__(self) -> None:
        self.content = Content({}, {}, {})
        self.used: set[str] = {STRUCTURE_KEY}
        # id(tensor) -> (tensor, name): a tensor met twice is stored once; holding the tensor
        # keeps its id from being reused by a temporary made later in the walk.
        self.tensor_names: dict[int, tuple[torch.Tensor, str]] = {}

    def name_for(self, path: tuple) -> str:
        base = ".".join(_segment(k) for k in path) or ROOT_NAME
        name, n = base, 1
        while name in self.used:  # e.g. keys 1 and "1" side by side
            name, n = f"{base}~{n}", n + 1
        self.used.add(name)
        return name

    def node(self, value: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH:
            raise StateError(f"{_where(path)}: nesting deeper than {MAX_DEPTH} levels")
        if value is None:
            return None
        if isinstance(value, bool):
            return ["b", self.scalar(path, Scalar.Bool(value))]
        if isinstance(value, int):
            if _I64_MIN <= value <= _U64_MAX:
                return ["i", self.scalar(path, Scalar.coerce(int(value)))]
            name = self.name_for(path)
            self.content.metadata[name] = str(int(value))
            return ["I", name]
        if isinstance(value, float):
            return ["f", self.scalar(path, Scalar.Float(float(value)))]
        if isinstance(value, str):
            name = self.name_for(path)
            self.content.metadata[name] = value
            return ["s", name]
        if isinstance(value, torch.Tensor):
            return ["t", self.tensor(value, path)]
        if isinstance(value, np.ndarray):
            return ["n", self.tensor(_from_numpy(value, path), path)]
        if isinstance(value, (bytes, bytearray)):
            return ["y", self.tensor(torch.tensor(list(value), dtype=torch.uint8), path)]
        if isinstance(value, (dict, OrderedDict)):
            kind = "O" if isinstance(value, OrderedDict) else "D"
            items = []
            for k, v in value.items():
                if not (k is None or isinstance(k, (str, int, float))):
                    raise StateError(
                        f"{_where(path)}: dict key {k!r} of type {type(k).__name__} "
                        "is not supported (use str, int, float, bool or None)"
                    )
                items.append([k, self.node(v, (*path, k))])
            return [kind, items]
        if isinstance(value, list):
            return ["L", [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if isinstance(value, tuple) and type(value) is tuple:
            return ["U", [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return self.node(value.item(), path)
        raise StateError(
            f"{_where(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
            "without pickle; convert it to plain data (dict/list/tuple/str/int/float/bool/None/"
            "tensor)"
        )

    def scalar(self, path: tuple, scalar: Scalar) -> str:
        name = self.name_for(path)
        self.content.scalars[name] = scalar
        return name

    def tensor(self, tensor: torch.Tensor, path: tuple) -> str:
        shared = self.tensor_names.get(id(tensor))
        if shared is not None:
            return shared[1]
        if tensor.layout != torch.strided:
            raise StateError(f"{_where(path)}: {tensor.layout} tensors are not supported")
        try:
            burnpack.burn_dtype(tensor.dtype)
        except burnpack.BurnpackError:
            raise StateError(
                f"{_where(path)}: tensor dtype {tensor.dtype} has no burnpack equivalent"
            ) from None
        name = self.name_for(path)
        self.content.tensors[name] = tensor.detach()
        self.tensor_names[id(tensor)] = (tensor, name)
        return name


def _from_numpy(array: np.ndarray, path: tuple) -> torch.Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError:
        raise StateError(f"{_where(path)}: numpy dtype {array.dtype} is not supported") from None


def encode(obj: Any) -> Content:
    """Split nested Python data into burnpack tensors, scalars and metadata.

    Raises :class:`StateError` naming the path of the first value it cannot represent.

    >>> encode({1: "a"}).metadata["1"]
    'a'
    """
    encoder = _Encoder()
    tree = encoder.node(obj, ())
    encoder.content.metadata[STRUCTURE_KEY] = json.dumps(
        {"version": STRUCTURE_VERSION, "tree": tree}, separators=(",", ":"), allow_nan=True
    )
    return encoder.content


class _Decoder:
    def __init__(self, tensors: Any, scalars: Mapping, metadata: Mapping) -> None:
        self.tensors = tensors
        self.scalars = scalars
        self.metadata = metadata
        self.seen: dict[str, Any] = {}

    def leaf(self, table: Mapping, name: object, what: str, path: tuple) -> Any:
        if not isinstance(name, str) or name not in table:
            raise StateError(f"{_where(path)}: {what} {name!r} is missing from the pack")
        return table[name]

    def node(self, node: Any, path: tuple) -> Any:
        if node is None:
            return None
        if len(path) > MAX_DEPTH or not isinstance(node, list) or len(node) != 2:
            raise StateError(f"{_where(path)}: malformed structure node {str(node)[:80]}")
        kind, arg = node
        if kind in ("b", "i", "f"):
            scalar = self.leaf(self.scalars, arg, "scalar", path)
            expected = {"b": ("Bool",), "i": ("Int", "UInt"), "f": ("Float",)}[kind]
            if scalar.kind not in expected:
                raise StateError(f"{_where(path)}: scalar {arg!r} is {scalar.kind}, not {expected}")
            return scalar.value
        if kind == "s":
            return self.leaf(self.metadata, arg, "metadata entry", path)
        if kind == "I":
            text = self.leaf(self.metadata, arg, "metadata entry", path)
            try:
                return int(text)
            except ValueError:
                raise StateError(f"{_where(path)}: {text[:40]!r} is not an integer") from None
        if kind in ("t", "n", "y"):
            if arg in self.seen:
                return self.seen[arg]
            tensor = self.tensors(arg, path)
            value = tensor if kind == "t" else tensor.numpy() if kind == "n" else bytes(tensor)
            self.seen[arg] = value
            return value
        if kind in ("L", "U") and isinstance(arg, list):
            items = [self.node(v, (*path, i)) for i, v in enumerate(arg)]
            return items if kind == "L" else tuple(items)
        if kind in ("D", "O") and isinstance(arg, list):
            out: dict = {} if kind == "D" else OrderedDict()
            for item in arg:
                if not isinstance(item, list) or len(item) != 2:
                    raise StateError(f"{_where(path)}: malformed dict item {str(item)[:80]}")
                key, child = item
                if isinstance(key, (list, dict)):
                    raise StateError(f"{_where(path)}: malformed dict key {str(key)[:80]}")
                out[key] = self.node(child, (*path, key))
            return out
        raise StateError(f"{_where(path)}: unknown structure node kind {kind!r}")


def decode(source: burnpack.Pack | Content, *, verify: bool = True) -> Any:
    """Rebuild the value :func:`encode` split, from a :class:`Content` or an open ``Pack``.

    Tensors read from a pack are zero-copy views of it (checksum-verified unless
    ``verify=False``).

    >>> decode(encode([1, None, "x"]))
    [1, None, 'x']
    """
    if isinstance(source, burnpack.Pack):

        def tensor(name: object, path: tuple) -> torch.Tensor:
            if not isinstance(name, str) or name not in source:
                raise StateError(f"{_where(path)}: tensor {name!r} is missing from the pack")
            return source.tensor(name, verify=verify)

        scalars, metadata = source.scalars, source.metadata
    else:

        def tensor(name: object, path: tuple) -> torch.Tensor:
            if not isinstance(name, str) or name not in source.tensors:
                raise StateError(f"{_where(path)}: tensor {name!r} is missing from the pack")
            return source.tensors[name]

        scalars, metadata = source.scalars, source.metadata
    raw = metadata.get(STRUCTURE_KEY)
    if raw is None:
        raise StateError(f"no '{STRUCTURE_KEY}' metadata entry: this pack holds no encoded state")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StateError(f"'{STRUCTURE_KEY}' is not valid JSON: {str(e)[:80]}") from None
    if not isinstance(header, dict) or "tree" not in header:
        raise StateError(f"'{STRUCTURE_KEY}' lacks a structure tree")
    if header.get("version") != STRUCTURE_VERSION:
        raise StateError(
            f"state structure version {header.get('version')!r} is not supported "
            f"(this reader knows {STRUCTURE_VERSION})"
        )
    return _Decoder(tensor, scalars, metadata).node(header["tree"], ())
