"""Loading straight into existing tensors: the pieces of :func:`~lightning_bpk.burnpack.read_into`.

Each tensor's bytes are copied from the file's mapping into the target's memory in steps of
:data:`READ_STEP`, each step hashed first (which brings it into the CPU cache) and then copied
from the cache, by ``numpy.copyto`` (the GIL released): every byte is read from memory once and
verified on the way. The work is cut into units for :func:`_parallel.run
<lightning_bpk.burnpack._parallel.run>`: a large tensor alone, or a run of small tensors of up to
:data:`READ_STEP` bytes together. Measured side by side on a quiet 2-core VM, 64 MiB in 16
tensors: 5.0-9.3 ms this way, 7.5-14.8 ms with ``preadv`` into the targets (the kernel's copy,
then the hash), against 6.5-8.5 ms for safetensors' ``load_file`` + ``copy_``, which hashes
nothing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy
import torch
import xxhash

from lightning_bpk.burnpack import _parallel
from lightning_bpk.burnpack.base import ChecksumError, DType, _stored_dtype, _torch_dtype
from lightning_bpk.burnpack.writer import tensor_bytes

__all__ = ["READ_STEP", "Into", "damaged", "fill", "writable_bytes"]

READ_STEP = 1024 * 1024
"""Bytes hashed and then copied per step: the copy reads what the hash just brought into the
core's cache (1 MiB steps: 5.8 ms for 64 MiB, 4 MiB steps slower, 256 KiB steps 7.3 ms). Smaller
tensors are handed to a thread together, up to this many bytes per unit."""


def damaged(source: str, name: str) -> ChecksumError:
    """The error of a tensor whose bytes do not match their checksum."""
    return ChecksumError(f"{source}: tensor '{name}' fails its checksum (file is damaged)")


def writable_bytes(tensor: torch.Tensor, dtype: DType) -> memoryview | None:
    """A writable byte view of ``tensor``'s own storage, or ``None`` when the stored bytes of a
    tensor of Burn dtype ``dtype`` cannot be copied in as they are (another torch dtype, bools,
    which need Pack.tensor's 0/1 check, non-contiguous, not on the CPU, empty)."""
    if tensor.dtype != (_plain(dtype) if isinstance(dtype, str) else _torch_view(dtype)):
        return None
    if not tensor.is_cpu or not tensor.is_contiguous():
        return None
    flat = tensor_bytes(tensor)  # zero-copy for a contiguous CPU tensor
    return flat if flat.nbytes else None


@functools.cache
def _plain(dtype: str) -> torch.dtype | None:
    return _torch_view(dtype)


def _torch_view(dtype: DType) -> torch.dtype | None:
    """The torch dtype whose bytes are the stored ones, None for bools (ValidationError for a
    dtype torch has no equivalent of)."""
    view = _torch_dtype(dtype)
    return view if _stored_dtype(dtype) is view and view is not torch.bool else None


@dataclass(slots=True)
class Into:
    """One tensor :func:`read_into` copies straight into its target's bytes."""

    name: str
    start: int  # offset in the data section
    stored: memoryview  # its bytes in the file's mapping
    flat: memoryview  # the target's bytes
    address: int  # where they lie in memory
    expected: str | None  # the digest to check, None when not verified


def fill(source: str, items: list[Into]) -> None:
    """Copy every item into its target, two threads at once; targets that share memory (one
    tensor under two names) are filled one at a time, each checked before the next is copied."""
    if _overlapping(items):
        for item in items:
            _large(source, item)
        return
    units: list[Callable[[], None]] = []
    for batch in _parallel.batches(items, lambda i: i.flat.nbytes, READ_STEP):
        if len(batch) == 1:
            units.append(functools.partial(_large, source, batch[0]))
        else:
            units.append(functools.partial(_small, source, batch))
    _parallel.run(units)


def _large(source: str, item: Into) -> None:
    hasher = xxhash.xxh3_64()
    for at in range(0, item.flat.nbytes, READ_STEP):
        step = item.stored[at : at + READ_STEP]
        if item.expected is not None:
            hasher.update(step)
        numpy.copyto(
            numpy.frombuffer(item.flat[at : at + READ_STEP], dtype=numpy.uint8),
            numpy.frombuffer(step, dtype=numpy.uint8),
        )
    if item.expected is not None and hasher.hexdigest() != item.expected:
        raise damaged(source, item.name)


def _small(source: str, batch: list[Into]) -> None:
    for item in batch:
        if item.expected is not None and xxhash.xxh3_64_hexdigest(item.stored) != item.expected:
            raise damaged(source, item.name)
        item.flat[:] = item.stored  # a few KiB: the copy costs less than releasing the GIL


def _overlapping(items: list[Into]) -> bool:
    """Whether two targets share memory (tied weights)."""
    spans = sorted((i.address, i.flat.nbytes) for i in items)
    return any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans))
