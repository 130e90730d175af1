"""Nested data (dicts, lists, tuples, ...) copied with every tensor replaced: the one walk over
such trees, for a snapshot, a move to a device, a staged DCP state dict.

What is copied is what could change in place under the copy: every container a checkpoint's
nested data may hold (``dict`` and its ``OrderedDict``/``Counter`` kinds, ``list``, ``tuple``,
``deque`` with its ``maxlen``, ``set``) is rebuilt, a NumPy array or ``bytearray`` is copied,
each tensor becomes what the caller's ``tensor(path, t)`` returns, and immutable leaves (numbers,
strings, ``bytes``, ``None``, NumPy scalars, paths, dates, dtypes) are kept. Anything else (a
user object, a namedtuple, a mapping that is not a dict) goes through ``other`` (default: kept
as it is, which is right where the value is only looked at later, e.g. refused by type by the
state codec).

>>> import torch
>>> live = {"step": 3, "w": torch.zeros(2), "hist": [1, 2]}
>>> copied = copy_nested(live, lambda path, t: t.clone())
>>> live["hist"].append(3); _ = live["w"].add_(1)
>>> copied["hist"], copied["w"].tolist()
([1, 2], [0.0, 0.0])
"""

from __future__ import annotations

import datetime
import pathlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["copy_nested"]

# Leaves nothing can change in place: kept as they are (exact types: a subclass may add state).
_IMMUTABLE = frozenset(
    {
        int,
        float,
        complex,
        str,
        bytes,
        bool,
        type(None),
        frozenset,
        torch.dtype,
        torch.device,
        pathlib.PurePosixPath,
        pathlib.PurePath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
        datetime.datetime,
        datetime.date,
        datetime.timedelta,
    }
)
# Dict kinds rebuilt as themselves (any other dict subclass becomes a dict).
_DICT_KINDS = (OrderedDict, Counter)

Tensor = Callable[[tuple, torch.Tensor], Any]


def _keep(value: Any) -> Any:
    return value


def copy_nested(value: Any, tensor: Tensor, other: Callable[[Any], Any] = _keep) -> Any:
    """``value`` copied (see the module docstring), each tensor ``t`` replaced by
    ``tensor(path, t)``, ``path`` being the keys and indexes that lead to it; any leaf of
    another kind replaced by ``other(leaf)``."""
    return _copy(value, tensor, other, ())


def _copy(value: Any, tensor: Tensor, other: Callable[[Any], Any], path: tuple) -> Any:
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:  # the common case first: one comprehension, no call per plain leaf
        return {
            k: v if type(v) in _IMMUTABLE else _copy(v, tensor, other, (*path, k))
            for k, v in value.items()
        }
    if kind is list or kind is tuple:
        items = [
            v if type(v) in _IMMUTABLE else _copy(v, tensor, other, (*path, i))
            for i, v in enumerate(value)
        ]
        return items if kind is list else tuple(items)
    if isinstance(value, torch.Tensor):
        return tensor(path, value)
    if isinstance(value, dict):
        items_of = {k: _copy(v, tensor, other, (*path, k)) for k, v in value.items()}
        return kind(items_of) if kind in _DICT_KINDS else items_of
    if isinstance(value, list):
        return [_copy(v, tensor, other, (*path, i)) for i, v in enumerate(value)]
    if isinstance(value, deque):
        return deque(
            (_copy(v, tensor, other, (*path, i)) for i, v in enumerate(value)), value.maxlen
        )
    if isinstance(value, set):
        return set(value)  # elements are hashable: kept
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, np.generic):  # a NumPy scalar: immutable
        return value
    if isinstance(value, bytearray):
        return bytearray(value)
    return other(value)
