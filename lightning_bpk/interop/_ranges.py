"""Positional reads of boxes (a ``[start, stop)`` range per dim) of stored tensors: the byte
runs a box covers in a row-major tensor, read through each file's
:class:`~lightning_bpk.store.Store` in one ``read_ranges`` call per box. Shared by the sharded
loader (``shards``: each rank reads its shards' boxes) and lazy slices (``lazy``)."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from lightning_bpk import _device, burnpack
from lightning_bpk.interop._index import Location, Options
from lightning_bpk.interop._sources import Span, ranged_reader

__all__ = ["Box", "RangedFiles", "byte_runs"]

Box = tuple[tuple[int, int], ...]
"""A part of a tensor: per dim, ``[start, stop)`` in the full tensor."""


def byte_runs(shape: Sequence[int], itemsize: int, box: Box) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` in bytes of the contiguous runs of ``box`` in a row-major tensor of
    ``shape``, in the box's own row-major order: one run when the box spans whole trailing dims
    (a ``Shard(0)`` slice), else one per index of the dims before its last partial dim.

    >>> list(byte_runs((3, 4), 4, ((0, 3), (1, 3))))  # Shard(1)-like: one run per row
    [(4, 8), (20, 8), (36, 8)]
    >>> list(byte_runs((3, 4), 4, ((1, 3), (0, 4))))  # Shard(0)-like: one run
    [(16, 32)]
    """
    if any(stop <= start for start, stop in box):
        return
    if not box:  # a scalar
        yield 0, itemsize
        return
    partial = [d for d, (start, stop) in enumerate(box) if (start, stop) != (0, shape[d])]
    last = partial[-1] if partial else 0
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    start, stop = box[last]
    length = (stop - start) * strides[last]
    for index in itertools.product(*(range(a, b) for a, b in box[:last])):
        yield (
            sum(i * s for i, s in zip(index, strides, strict=False)) + start * strides[last],
            length,
        )


class RangedFiles:
    """Positional reads of boxes of tensors across a set's files, through each file's store
    (:meth:`~lightning_bpk.store.Store.read_ranges`: one call per box), counting the bytes read
    (thread-safe)."""

    def __init__(self, options: Options = None) -> None:
        self.options = options
        self.bytes_read = 0
        self._readers: dict[str, Callable[[Sequence[tuple[memoryview, int]]], None]] = {}
        self._lock = threading.Lock()

    def _reader(self, file: Location) -> Callable[[Sequence[tuple[memoryview, int]]], None]:
        with self._lock:
            if str(file) not in self._readers:
                self._readers[str(file)] = ranged_reader(file, self.options)
            return self._readers[str(file)]

    def read(
        self,
        span: Span,
        shape: Sequence[int],
        box: Box,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The ``box`` of the tensor of ``shape`` stored at ``span``, read into ``out``
        (contiguous, of the box's shape) or a new tensor."""
        if len(box) != len(shape) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(box, shape, strict=False)
        ):
            raise ValueError(f"{span.file}: box {list(box)} outside a tensor of {list(shape)}")
        if out is None:
            out = _device.empty([stop - begin for begin, stop in box], span.stored)
        flat = burnpack.tensor_bytes(out)  # zero-copy: reads land in ``out``
        pieces = []
        at = 0
        for offset, length in byte_runs(shape, out.element_size(), box):
            pieces.append((flat[at : at + length], span.start + offset))
            at += length
        self._reader(span.file)(pieces)
        with self._lock:
            self.bytes_read += at
        return out
