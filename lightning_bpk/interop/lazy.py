"""A file's or a set's tensors opened lazily, as ``safetensors.safe_open`` opens one: names,
shapes and dtypes from the headers, a whole tensor on request, and **slices that read only their
own bytes**.

:func:`open_tensors` takes a ``.bpk`` or ``.safetensors`` file or a checkpoint set (an index or
its directory), local or at a URL. ``get_slice(name)[rows, cols]`` reads the slice's box of the
stored tensor with positional reads (one byte range per run of the box: a slice of leading rows
is one range, a slice of columns one range per row) through the file's
:class:`~lightning_bpk.store.Store`, so a 24 MiB slice of a 56 MiB tensor reads 24 MiB.

**Checksums.** A ``.bpk`` file's xxh3 checksum covers a whole tensor, so a part of one cannot be
checked against it: a slice that covers its whole tensor, and :meth:`LazyTensors.get_tensor`,
are verified (a damaged tensor is a :class:`~lightning_bpk.records.RecordChecksumError`); a
partial slice is not, and its tensor's name is added to :attr:`LazyTensors.unverified`, which
says so. Safetensors files carry no checksums. ``torch.save`` files cannot be read in ranges
(pickle): a slice of one indexes the whole tensor, read once.

Example::

    >>> import tempfile, torch
    >>> from lightning_bpk import burnpack
    >>> path = burnpack.write(tempfile.mkdtemp() + "/m.bpk", {"w": torch.arange(12.0).view(3, 4)})
    >>> with open_tensors(path) as f:
    ...     f.get_shape("w"), f.get_slice("w")[1:, 2], f.bytes_read, sorted(f.unverified)
    ((3, 4), tensor([ 6., 10.]), 8, ['w'])
"""

from __future__ import annotations

import os
from collections.abc import Iterator, KeysView, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from lightning_bpk import burnpack
from lightning_bpk.interop._ranges import Box, RangedFiles
from lightning_bpk.interop._sources import Source, open_source
from lightning_bpk.records.base import RecordError

__all__ = ["LazyTensors", "TensorSlice", "open_tensors"]

Index = Any
"""What ``TensorSlice[...]`` takes: an int, a slice, ``...``, or a tuple of them."""


class TensorSlice:
    """One tensor of a :class:`LazyTensors`, not read yet: ``get_shape()``, ``get_dtype()``,
    and ``[index]`` (ints and slices per dim, ``...``; a step reads the box it spans) to read
    a part of it."""

    def __init__(self, tensors: LazyTensors, name: str) -> None:
        self._tensors = tensors
        self._name = name

    def get_shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self._tensors.get_shape(self._name)

    def get_dtype(self) -> torch.dtype:
        """The tensor's torch dtype."""
        return self._tensors.get_dtype(self._name)

    def __getitem__(self, index: Index) -> torch.Tensor:
        shape = self.get_shape()
        box, picks = _box(shape, index, self._name)
        return self._tensors._read_box(self._name, box)[picks]


class LazyTensors:
    """The tensors of an opened file or set (see the module docs); use :func:`open_tensors`."""

    def __init__(self, source: Source, ranged: RangedFiles, where: str) -> None:
        self._source = source
        self._ranged = ranged
        self._where = where
        self.unverified: set[str] = set()
        """Names of tensors read only in part, so not checked against their ``.bpk`` checksum."""

    def keys(self) -> KeysView[str]:
        """The tensor names, in data order."""
        return self._source.specs.keys()

    def metadata(self) -> dict[str, str]:
        """The string metadata (a safetensors ``__metadata__``, a ``.bpk`` file's map)."""
        return dict(self._source.metadata)

    def get_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (``KeyError`` naming the file if it has none)."""
        return tuple(self._spec(name)[0])

    def get_dtype(self, name: str) -> torch.dtype:
        """The torch dtype of tensor ``name``."""
        return self._spec(name)[1]

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, verified against its checksum (a ``.bpk`` file's)."""
        self._spec(name)
        self._verify(name)
        return self._source.read(name).clone()

    def get_slice(self, name: str) -> TensorSlice:
        """Tensor ``name``, to be read in part (``get_slice(name)[:, 2:4]``)."""
        self._spec(name)
        return TensorSlice(self, name)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read by slices so far (whole-tensor reads not counted)."""
        return self._ranged.bytes_read

    def _spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        stored = self._source.aliases.get(name, name)
        try:
            return self._source.specs[stored]
        except KeyError:
            raise KeyError(f"{self._where}: no tensor named {name!r}") from None

    def _verify(self, name: str) -> None:
        if self._source.verify is None:
            return
        try:
            self._source.verify(self._source.aliases.get(name, name))
        except burnpack.BurnpackError as e:
            raise RecordError.from_format_error(e) from e

    def _read_box(self, name: str, box: Box) -> torch.Tensor:
        stored = self._source.aliases.get(name, name)
        shape, dtype = self._source.specs[stored]
        whole = all(a == 0 and b == n for (a, b), n in zip(box, shape, strict=True))
        spans = self._source.spans
        if spans is None:  # a torch.save file: no byte ranges
            return self._source.read(stored)[tuple(slice(a, b) for a, b in box)]
        if whole:
            self._verify(stored)
        elif self._source.verify is not None:
            self.unverified.add(stored)
        out = self._ranged.read(spans[stored], shape, box)
        return out if out.dtype == dtype else out != 0  # Burn's Bool(U8/U32) storage


def _box(shape: tuple[int, ...], index: Index, name: str) -> tuple[Box, tuple[slice | int, ...]]:
    """The box of ``shape`` an index selects, and what to pick from that box: an int becomes a
    one-wide range then dropped, a stepped slice the range it spans then stepped."""
    items: tuple[Any, ...] = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError(f"tensor {name!r}: an index can have only one ellipsis")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = (slice(None),) * (len(shape) - len(items) + 1)
        items = items[:at] + fill + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(f"tensor {name!r}: {len(items)} indices for {len(shape)} dims")
    items = items + (slice(None),) * (len(shape) - len(items))
    box: list[tuple[int, int]] = []
    picks: list[slice | int] = []
    for item, n in zip(items, shape, strict=True):
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step < 1:
                raise IndexError(f"tensor {name!r}: slice step {step} (only forward steps)")
            stop = max(start, stop)
            box.append((start, stop))
            picks.append(slice(None, None, step))
        elif isinstance(item, int) and not isinstance(item, bool):
            i = item + n if item < 0 else item
            if not 0 <= i < n:
                raise IndexError(f"tensor {name!r}: index {item} out of range for size {n}")
            box.append((i, i + 1))
            picks.append(0)
        else:
            raise TypeError(f"tensor {name!r}: cannot index with {type(item).__name__}")
    return tuple(box), tuple(picks)


@contextmanager
def open_tensors(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Iterator[LazyTensors]:
    """Open a ``.bpk``/``.safetensors``/``torch.save`` file or a checkpoint set, local or at a
    URL (``storage_options`` go to fsspec), for lazy reads: only its headers are read here."""
    with open_source(path, storage_options) as source:
        yield LazyTensors(source, RangedFiles(storage_options), str(path))
