"""Nested Python data <-> burnpack content (tensors, scalars, metadata), with no pickle.

Lightning's checkpoint dict mixes tensors with ints, floats, strings, tuples, ``None`` and
int-keyed dicts. This codec stores each leaf where a reader of the ``.bpk`` expects it and
records the shape of the structure as JSON, so every value comes back with its exact type:

==========================  ===================================================================
Python value                stored as
==========================  ===================================================================
``torch.Tensor``            a tensor (0-d included, dtype kept)
``numpy.ndarray``           a tensor, decoded back to an ndarray
``bytes``, ``bytearray``    a U8 tensor
``bool``/``int``            a ``Bool``/``Int`` scalar (``UInt`` past i64; decimal text past u64)
``float``                   a ``Float`` scalar (NaN and infinities included)
``str``                     a ``metadata`` entry
``None``                    only in the structure
dict/list/tuple             only in the structure; dict keys may be str, int, float, bool, None,
                            tuple or frozenset of those, Path or a date (``OrderedDict`` and
                            ``Counter`` keep their type)
set/frozenset/``deque``     only in the structure (a deque keeps its ``maxlen``)
``pathlib.Path``            its text in the structure
``datetime``/``date``       ISO text in the structure (a ``timedelta``: days, seconds, microseconds)
==========================  ===================================================================

With ``inline=True`` (the loop state of a :class:`~lightning_bpk.records.StateRecord`) bools,
ints, floats and strings stay in the structure too: one JSON encode stores them all.

Leaf names are the dotted path to the leaf (``optimizer_states.0.param_groups.0.lr``); a ``.``
or ``%`` inside a key is percent-escaped, and a name that would start with the reserved
prefix ``lightning_bpk/`` has its first letter escaped. The structure lives in the metadata entry
``lightning_bpk/state``. Two hooks let a caller lay leaves out the way another reader expects
(the optimizer record uses them for Burn's names): ``name_path`` maps a leaf's path to the path
that names it, and ``as_scalar`` picks 0-d tensors to store as scalars (the dtype stays in the
structure, so they decode as the same 0-d tensor). Anything else (a user object, a lambda)
raises :class:`StateError` naming where it sits, e.g. ``$['hyper_parameters']['loss_fn']``, or
with lenient encoding (``dropped``) is left out and named.

>>> import torch
>>> content = encode({"step": 3, "betas": (0.9, 0.999), "w": torch.ones(2)})
>>> sorted(content.tensors), sorted(content.scalars)
(['w'], ['betas.0', 'betas.1', 'step'])
>>> decode(content)["betas"]
(0.9, 0.999)
"""

from __future__ import annotations

import datetime
import json
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import Scalar
from lightning_bpk.errors import LightningBpkError

__all__ = [
    "Content",
    "PathHook",
    "ScalarHook",
    "StateError",
    "decode",
    "encode",
]

# Metadata entry holding the JSON structure; the "/" keeps it apart from escaped leaf names.
_STRUCTURE_KEY = "lightning_bpk/state"
# Names under this prefix belong to the package (record kind, checksums, aliases): leaf names
# never start with it, so user keys like "lightning_bpk/record" cannot overwrite them.
_RESERVED_PREFIX = "lightning_bpk/"
# Bumped when the structure encoding changes incompatibly; readers refuse newer versions.
# Version 2 adds leaves kept in the structure (inline bools, ints, floats and strings; paths,
# dates, sets, deques) and tuple keys; a structure that uses none of them is still written as 1.
_STRUCTURE_VERSION = 2
# Name of a leaf that is the whole value (``encode(3)``).
_ROOT_NAME = "__root__"
# Deeper structures are refused: they only arise from hostile or runaway data.
_MAX_DEPTH = 64
# The structure tree's JSON nests 3 levels per dict level (node, its items, an item), so a tree
# of _MAX_DEPTH levels is 3 * _MAX_DEPTH + 2 deep; anything deeper is refused before it is parsed.
_TREE_JSON_DEPTH = 3 * _MAX_DEPTH + 2

_I64_MIN, _U64_MAX = -(2**63), 2**64 - 1


class StateError(LightningBpkError, ValueError):
    """A value cannot be encoded, or stored content does not decode; the message names where."""


class Content(NamedTuple):
    """What a burnpack holds: tensors (in write order), typed scalars and string metadata."""

    tensors: dict[str, torch.Tensor]
    scalars: dict[str, Scalar]
    metadata: dict[str, str]


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace(".", "%2E") if "%" in key or "." in key else key


def _segment(key: object) -> str:
    return _escape(key if isinstance(key, str) else str(key))


def _child(dotted: str | None, key: object) -> str:
    """The dotted name of ``key`` under the node named ``dotted`` (``None``: the root)."""
    return _segment(key) if dotted is None else f"{dotted}.{_segment(key)}"


def _where(path: tuple) -> str:
    return "$" + "".join(f"[{k!r}]" for k in path)


# Dict types that decode as themselves (MultiStepLR's milestones are a Counter).
_DICT_TYPES: dict[str, type[dict]] = {"D": dict, "O": OrderedDict, "C": Counter}
_DICT_KINDS = {t: k for k, t in _DICT_TYPES.items()}

PathHook = Callable[[tuple], tuple]
"""``encode(name_path=...)``: maps a leaf's path (a tuple of keys and indices) to the path that
names it in the file, e.g. to lay an optimizer's state out under Burn's names."""
ScalarHook = Callable[[tuple], bool]
"""``encode(as_scalar=...)``: says, from its path, whether a 0-d tensor is stored as a burnpack
scalar instead of a tensor (its dtype stays in the structure, so it decodes the same)."""


# Leaves of these exact types stay in the structure when encoding ``inline`` (version 2): JSON
# keeps each one's type (an int has no point, a float always one, NaN and infinities included).
_INLINE = frozenset({str, int, float, bool})
# Node kinds of three elements (the others have two).
_THREE = ("z", "Q")
# What :meth:`_Encoder.lenient` returns for a dict item that lenient encoding leaves out.
_DROP = object()


def _plain(value: bool | int | float | str) -> bool | int | float | str:
    """A subclass's value (an ``IntEnum``, a ``str`` subclass) as the exact built-in type."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(type(value))


def _text_node(value: object) -> list | None:
    """The version-2 node of a value kept as text in the structure (a ``pathlib.Path``, a
    ``datetime``, ``date`` or ``timedelta``); None for any other value."""
    if isinstance(value, Path):
        return ["P", str(value)]
    if isinstance(value, datetime.datetime):
        return ["T", value.isoformat()]
    if isinstance(value, datetime.date):
        return ["J", value.isoformat()]
    if isinstance(value, datetime.timedelta):
        return ["W", [value.days, value.seconds, value.microseconds]]
    return None


def _tensor_scalar(tensor: torch.Tensor) -> Scalar:
    """A 0-d tensor as a scalar: counters (integral values, e.g. a float ``step``) as ``UInt``
    (``Int`` when negative), other floats as ``Float``; the structure keeps the dtype."""
    value = tensor.item()
    if isinstance(value, bool):
        return Scalar.Bool(value)
    if isinstance(value, float):
        integral = math.isfinite(value) and value == int(value) and math.copysign(1, value) > 0
        if not integral or int(value) > _U64_MAX:  # -0.0, NaN, fractions, huge: keep a float
            return Scalar.Float(value)
        value = int(value)
    return Scalar("UInt" if value >= 0 else "Int", value)


class _Encoder:
    def __init__(
        self,
        name_path: PathHook | None,
        as_scalar: ScalarHook | None,
        inline: bool = False,
        dropped: list[str] | None = None,
    ) -> None:
        self.name_path = name_path
        self.as_scalar = as_scalar
        self.inline = inline
        self.dropped = dropped
        self.from_paths = inline or name_path is not None  # see dotted()
        # 2 once a node a version-1 reader does not know is written (every inline leaf is one)
        self.version = 2 if inline else 1
        self.content = Content({}, {}, {})
        self.used: set[str] = {_STRUCTURE_KEY}
        # id(tensor) -> (tensor, name): a tensor met twice is stored once; holding the tensor
        # keeps its id from being reused by a temporary made later in the walk.
        self.tensor_names: dict[int, tuple[torch.Tensor, str]] = {}

    def name_for(self, path: tuple, dotted: str | None) -> str:
        """The leaf's name: ``dotted`` (its path, escaped and joined as :meth:`node` built it)
        unless the ``name_path`` hook names it, made unique."""
        if self.name_path is not None:
            dotted = ".".join([_segment(k) for k in self.name_path(path)])
        elif self.inline:
            dotted = ".".join([_segment(k) for k in path])
        base = dotted or _ROOT_NAME
        if base.startswith(_RESERVED_PREFIX):
            base = f"%{ord(base[0]):02X}{base[1:]}"
        name, n = base, 1
        while name in self.used:  # e.g. keys 1 and "1" side by side
            name, n = f"{base}~{n}", n + 1
        self.used.add(name)
        return name

    def node(self, value: Any, path: tuple, dotted: str | None = None) -> Any:
        """The structure node of ``value`` at ``path``; ``dotted`` is the path's escaped segments
        joined by dots, built one segment per level (``None`` at the root)."""
        if type(value) in _INLINE and self.inline:
            return value  # the structure holds it: the one JSON encode stores it, exact type
        if len(path) > _MAX_DEPTH:
            raise StateError(f"{_where(path)}: nesting deeper than {_MAX_DEPTH} levels")
        if value is None:
            return None
        if isinstance(value, dict):
            kind = _DICT_KINDS.get(type(value), "D")  # other dict subclasses decode as dict
            items = []
            inline = self.inline
            for k, v in value.items():
                key = (
                    k if k is None or type(k) in _INLINE else self.lenient(self.key, k, (*path, k))
                )
                if key is _DROP:
                    continue
                if inline and type(v) in _INLINE:  # most of a loop state: no call at all
                    items.append([key, v])
                    continue
                child = self.lenient(self.node, v, (*path, k), self.dotted(dotted, k))
                if child is not _DROP:
                    items.append([key, child])
            return [kind, items]
        if isinstance(value, list):
            return ["L", self.items(value, path, dotted)]
        if isinstance(value, tuple) and type(value) is tuple:
            return ["U", self.items(value, path, dotted)]
        if self.inline and isinstance(value, (bool, int, float, str)):  # a subclass: IntEnum
            return self.node(_plain(value), path, dotted)
        if isinstance(value, bool):
            return ["b", self.scalar(path, dotted, Scalar.Bool(value))]
        if isinstance(value, int):
            if _I64_MIN <= value <= _U64_MAX:
                return ["i", self.scalar(path, dotted, Scalar.coerce(int(value)))]
            name = self.name_for(path, dotted)
            self.content.metadata[name] = str(int(value))
            return ["I", name]
        if isinstance(value, float):
            return ["f", self.scalar(path, dotted, Scalar.Float(float(value)))]
        if isinstance(value, str):
            name = self.name_for(path, dotted)
            self.content.metadata[name] = value
            return ["s", name]
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 and self.as_scalar is not None and self.as_scalar(path):
                dtype = self.check_dtype(value, path)
                return ["z", self.scalar(path, dotted, _tensor_scalar(value)), dtype]
            return ["t", self.tensor(value, path, dotted)]
        if isinstance(value, np.ndarray):
            return ["n", self.tensor(_from_numpy(value, path), path, dotted)]
        if isinstance(value, (bytes, bytearray)):
            data = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else None
            tensor = torch.zeros(0, dtype=torch.uint8) if data is None else data
            return ["y" if isinstance(value, bytes) else "Y", self.tensor(tensor, path, dotted)]
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return self.node(value.item(), path, dotted)
        if isinstance(value, deque):
            self.version = 2
            return ["Q", self.items(value, path, dotted), value.maxlen]
        if isinstance(value, (set, frozenset)):
            self.version = 2
            kind = "S" if isinstance(value, set) else "F"
            return [kind, [self.key(v, (*path, i)) for i, v in enumerate(value)]]
        text = _text_node(value)
        if text is not None:
            self.version = 2
            return text
        raise StateError(
            f"{_where(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
            "without pickle; convert it to plain data (dict/list/tuple/set/deque/str/int/float/"
            "bool/None/tensor/Path/datetime)"
        )

    def lenient(self, encode: Callable[..., Any], *args: Any) -> Any:
        """``encode(*args)``: a container item's node (or a dict key's); with a ``dropped`` list
        (lenient encoding) an item that cannot be stored is named in the list and
        :data:`_DROP` returned in its place."""
        if self.dropped is None:
            return encode(*args)
        try:
            return encode(*args)
        except StateError as e:
            self.dropped.append(str(e))
            return _DROP

    def items(self, values: Any, path: tuple, dotted: str | None) -> list:
        """The nodes of a sequence's items (one left out by lenient encoding becomes None)."""
        inline = self.inline
        nodes = [
            v
            if inline and type(v) in _INLINE  # kept as they are: no call per item
            else self.lenient(self.node, v, (*path, i), self.dotted(dotted, i))
            for i, v in enumerate(values)
        ]
        return [None if n is _DROP else n for n in nodes]

    def dotted(self, dotted: str | None, key: object) -> str | None:
        """A child's dotted name, built one level at a time; None when :meth:`name_for` names
        leaves from their paths instead (a ``name_path`` hook, or ``inline``, where the few
        named leaves are tensors)."""
        return None if self.from_paths else _child(dotted, key)

    def key(self, key: Any, path: tuple) -> Any:
        """A dict key or set element, kept in the structure: a plain value as it is, a tuple,
        frozenset, path or date as its node (version 2)."""
        if key is None or isinstance(key, (str, int, float)):
            return key
        if len(path) > _MAX_DEPTH:
            raise StateError(f"{_where(path)}: nesting deeper than {_MAX_DEPTH} levels")
        self.version = 2
        if type(key) is tuple:
            return ["U", [self.key(k, (*path, i)) for i, k in enumerate(key)]]
        if isinstance(key, frozenset):
            return ["F", [self.key(k, (*path, i)) for i, k in enumerate(key)]]
        text = _text_node(key)
        if text is None:
            raise StateError(
                f"{_where(path[:-1])}: dict key or set element {key!r} of type "
                f"{type(key).__name__} is not supported (use str, int, float, bool, None, "
                "tuple, frozenset, Path or a date)"
            )
        return text

    def scalar(self, path: tuple, dotted: str | None, scalar: Scalar) -> str:
        name = self.name_for(path, dotted)
        self.content.scalars[name] = scalar
        return name

    def tensor(self, tensor: torch.Tensor, path: tuple, dotted: str | None) -> str:
        shared = self.tensor_names.get(id(tensor))
        if shared is not None:
            return shared[1]
        self.check_dtype(tensor, path)
        name = self.name_for(path, dotted)
        self.content.tensors[name] = tensor.detach()
        self.tensor_names[id(tensor)] = (tensor, name)
        return name

    def check_dtype(self, tensor: torch.Tensor, path: tuple) -> Any:
        """Burn's dtype value for the tensor; StateError when it has none."""
        if tensor.layout != torch.strided:
            raise StateError(f"{_where(path)}: {tensor.layout} tensors are not supported")
        try:
            return burnpack._burn_dtype(tensor.dtype)
        except burnpack.BurnpackError:
            raise StateError(
                f"{_where(path)}: tensor dtype {tensor.dtype} has no burnpack equivalent"
            ) from None


def _from_numpy(array: np.ndarray, path: tuple) -> torch.Tensor:
    # np.ascontiguousarray would turn a 0-d array into shape (1,); copy keeps the shape.
    native = array.astype(array.dtype.newbyteorder("="), order="C", copy=True)
    try:
        return torch.from_numpy(native)
    except TypeError:
        raise StateError(f"{_where(path)}: numpy dtype {array.dtype} is not supported") from None


def encode(
    obj: Any,
    *,
    name_path: PathHook | None = None,
    as_scalar: ScalarHook | None = None,
    inline: bool = False,
    dropped: list[str] | None = None,
) -> Content:
    """Split nested Python data into burnpack tensors, scalars and metadata.

    Raises :class:`StateError` naming the path of the first value it cannot represent.
    ``name_path(path)`` returns the path whose segments name a leaf (default: ``path``);
    ``as_scalar(path)`` says whether a 0-d tensor there is stored as a scalar.

    ``inline``: bools, ints, floats and strings stay in the structure, which one C-encoded
    JSON document stores (version 2), rather than each becoming a named burnpack scalar or
    metadata entry: a loop state of hundreds of counters encodes in one pass (what
    :class:`~lightning_bpk.records.StateRecord` does; the optimizer and scheduler records keep
    named scalars, which Burn reads). ``dropped``: lenient encoding, where an item of a
    container that cannot be stored is left out (a dict's) or stored as None (a sequence's),
    and the error naming it is appended to the list.

    >>> encode({1: "a"}).metadata["1"]
    'a'
    >>> content = encode({"s": {"step": torch.tensor(3.0)}}, name_path=lambda p: ("x", *p[1:]),
    ...                  as_scalar=lambda p: p[-1] == "step")
    >>> content.scalars, decode(content)["s"]["step"]
    ({'x.step': Scalar.UInt(3)}, tensor(3.))
    """
    encoder = _Encoder(name_path, as_scalar, inline, dropped)
    tree = encoder.node(obj, ())
    encoder.content.metadata[_STRUCTURE_KEY] = json.dumps(
        {"version": encoder.version, "tree": tree}, separators=(",", ":"), allow_nan=True
    )
    return encoder.content


class _Decoder:
    def __init__(self, tensors: Any, scalars: Mapping, metadata: Mapping, version: int) -> None:
        self.tensors = tensors
        self.scalars = scalars
        self.metadata = metadata
        self.version = version
        self.seen: dict[str, Any] = {}

    def leaf(self, table: Mapping, name: object, what: str, path: tuple) -> Any:
        if not isinstance(name, str) or name not in table:
            raise StateError(f"{_where(path)}: {what} {name!r} is missing from the pack")
        return table[name]

    def node(self, node: Any, path: tuple) -> Any:
        if node is None:
            return None
        if type(node) in _INLINE and self.version >= 2:
            return node
        if len(path) > _MAX_DEPTH or not isinstance(node, list) or len(node) not in (2, 3):
            raise StateError(f"{_where(path)}: malformed structure node {str(node)[:80]}")
        if not isinstance(node[0], str) or (len(node) == 3) != (node[0] in _THREE):
            raise StateError(f"{_where(path)}: malformed structure node {str(node)[:80]}")
        kind, arg = node[0], node[1]
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
        if kind == "z" and isinstance(node, list):
            return self.scalar_tensor(node, path)
        if kind in ("t", "n", "y", "Y"):
            if not isinstance(arg, str):
                raise StateError(f"{_where(path)}: tensor name {str(arg)[:80]} is not a string")
            if arg not in self.seen:
                self.seen[arg] = _tensor_as(kind, self.tensors(arg, path), path)
            return self.seen[arg]
        if kind in ("L", "U") and isinstance(arg, list):
            items = [self.node(v, (*path, i)) for i, v in enumerate(arg)]
            return items if kind == "L" else tuple(items)
        if kind in _DICT_TYPES and isinstance(arg, list):
            out: dict = _DICT_TYPES[kind]()
            for item in arg:
                if not isinstance(item, list) or len(item) != 2:
                    raise StateError(f"{_where(path)}: malformed dict item {str(item)[:80]}")
                key = self.key(item[0], path)
                out[key] = self.node(item[1], (*path, key))
            return out
        if self.version >= 2:
            return self.version2(kind, node, path)
        raise StateError(f"{_where(path)}: unknown structure node kind {str(kind)[:20]}")

    def version2(self, kind: str, node: list, path: tuple) -> Any:
        """A node kind version 2 added: a deque, set, frozenset, path or date."""
        arg = node[1]
        if kind == "Q" and isinstance(arg, list):
            maxlen = node[2]
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise StateError(f"{_where(path)}: malformed deque length {str(maxlen)[:40]}")
            return deque([self.node(v, (*path, i)) for i, v in enumerate(arg)], maxlen)
        if kind in ("S", "F") and isinstance(arg, list):
            items = [self.key(v, (*path, i)) for i, v in enumerate(arg)]
            return set(items) if kind == "S" else frozenset(items)
        return self.text(kind, arg, path)

    def key(self, key: Any, path: tuple) -> Any:
        """A dict key or set element: a plain value, or (version 2) a tuple, frozenset, path
        or date node."""
        if not isinstance(key, (list, dict)):
            return key
        if self.version < 2 or len(path) > _MAX_DEPTH or not key or not isinstance(key[0], str):
            raise StateError(f"{_where(path)}: malformed dict key {str(key)[:80]}")
        kind = key[0]
        if len(key) == 2 and kind in ("U", "F") and isinstance(key[1], list):
            items = [self.key(k, (*path, i)) for i, k in enumerate(key[1])]
            return tuple(items) if kind == "U" else frozenset(items)
        if len(key) == 2 and kind in ("P", "T", "J", "W"):
            return self.text(kind, key[1], path)
        raise StateError(f"{_where(path)}: malformed dict key {str(key)[:80]}")

    def text(self, kind: str, arg: Any, path: tuple) -> Any:
        """A path or date node (kept as text in the structure)."""
        try:
            if kind == "P" and isinstance(arg, str):
                return Path(arg)
            if kind == "T" and isinstance(arg, str):
                return datetime.datetime.fromisoformat(arg)
            if kind == "J" and isinstance(arg, str):
                return datetime.date.fromisoformat(arg)
            if kind == "W" and isinstance(arg, list) and all(type(x) is int for x in arg):
                return datetime.timedelta(*arg)
        except (ValueError, TypeError, OverflowError):
            raise StateError(f"{_where(path)}: malformed {kind!r} node {str(arg)[:80]}") from None
        raise StateError(f"{_where(path)}: unknown structure node kind {str(kind)[:20]}")

    def scalar_tensor(self, node: list, path: tuple) -> torch.Tensor:
        """A ``["z", scalar name, burn dtype]`` node: the 0-d tensor stored as a scalar."""
        _, name, dtype_value = node
        scalar = self.leaf(self.scalars, name, "scalar", path)
        try:
            dtype = burnpack._torch_dtype(dtype_value)
        except (burnpack.BurnpackError, TypeError):
            raise StateError(f"{_where(path)}: unknown dtype {str(dtype_value)[:40]}") from None
        value = scalar.value
        if dtype.is_floating_point:
            value = float(value)
        elif dtype == torch.bool:
            if scalar.kind != "Bool":
                raise StateError(f"{_where(path)}: scalar {name!r} is {scalar.kind}, not Bool")
        elif not isinstance(value, int) or isinstance(value, bool):
            raise StateError(f"{_where(path)}: scalar {name!r} is {scalar.kind}, not an integer")
        try:
            return torch.tensor(value, dtype=dtype)
        except (RuntimeError, OverflowError):
            raise StateError(f"{_where(path)}: {value!r} does not fit {dtype}") from None


def _tensor_as(kind: str, tensor: torch.Tensor, path: tuple) -> Any:
    """A stored tensor as the type it was encoded from: tensor, ndarray, bytes or bytearray."""
    if kind == "t":
        return tensor
    if kind == "n":
        try:
            return tensor.numpy()
        except TypeError:
            raise StateError(f"{_where(path)}: {tensor.dtype} has no numpy equivalent") from None
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise StateError(f"{_where(path)}: bytes must be a 1-d U8 tensor, got {tensor.dtype}")
    data = tensor.numpy().tobytes()
    return data if kind == "y" else bytearray(data)


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
    raw = metadata.get(_STRUCTURE_KEY)
    if raw is None:
        raise StateError(f"no '{_STRUCTURE_KEY}' metadata entry: this pack holds no encoded state")
    try:
        header = burnpack._decode_json(raw, what=f"'{_STRUCTURE_KEY}'", max_depth=_TREE_JSON_DEPTH)
    except burnpack.MetadataError as e:
        raise StateError(str(e)) from None
    if not isinstance(header, dict) or "tree" not in header:
        raise StateError(f"'{_STRUCTURE_KEY}' lacks a structure tree")
    version = header.get("version")
    if type(version) is not int or version not in (1, 2):
        raise StateError(
            f"state structure version {version!r} is not supported "
            f"(this reader knows 1 to {_STRUCTURE_VERSION})"
        )
    return _Decoder(tensor, scalars, metadata, version).node(header["tree"], ())
