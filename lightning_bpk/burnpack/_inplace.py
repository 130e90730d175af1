"""Loading straight into existing tensors: the pieces of :func:`~lightning_bpk.burnpack.read_into`.

A large tensor's bytes are read with ``os.preadv`` straight into the target's memory in steps of
:data:`READ_STEP`, each step hashed right after it lands (it is still in the core's cache): every
byte crosses memory once and is verified on the way. Small tensors are copied from the file's
mapping, a run of them per unit (one ``preadv`` each would cost a system call per few KiB). The
work is cut into units for :func:`_parallel.run <lightning_bpk.burnpack._parallel.run>`: a large
tensor alone, or a run of small tensors of up to :data:`READ_STEP` bytes together; ``preadv``
and xxhash release the GIL, so two units run on two cores.

Why ``preadv`` and not the mapping for large tensors: reading through a mapping first maps every
4 KiB page of the page cache into the process, and what that costs depends on how the file came
into the cache. Measured on a quiet 2-core VM, touching one byte per page of a cached 64 MiB file
took 0.2 ms when a buffered write had left it in the cache (large folios) and 5 ms when a read
after an ``O_DIRECT`` write had (the writers here write ``O_DIRECT``). ``read_into`` of 64 MiB in
16 tensors, interleaved with safetensors' ``load_file`` + ``copy_`` (which hashes nothing):
8.8 ms through the mapping, 6.2 ms with ``preadv``, safetensors 5.6 ms on its own buffered-written
file; with both files dropped and read back into the cache the same way, 11.1, 6.5 and 7.8 ms.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from lightning_bpk import _fs
from lightning_bpk.burnpack import _parallel
from lightning_bpk.burnpack.base import (
    BurnpackIOError,
    ChecksumError,
    DType,
    _stored_dtype,
    _torch_dtype,
)
from lightning_bpk.burnpack.entry import tensor_bytes

__all__ = ["READ_STEP", "Into", "damaged", "fill", "writable_bytes"]

READ_STEP = 1024 * 1024
"""Bytes read and then hashed per step: the hash reads what ``preadv`` just wrote, from the
core's 1 MiB L2 cache here (1 MiB steps 6.2 ms for 64 MiB; 256 KiB and 2 MiB steps no faster).
Smaller tensors are handed to a thread together, up to this many bytes per unit."""


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
    offset: int  # where its bytes start in the file
    stored: memoryview  # its bytes in the file's mapping
    flat: memoryview  # the target's bytes
    address: int  # where they lie in memory
    expected: str | None  # the digest to check, None when not verified


def fill(source: str, fd: int, items: list[Into]) -> None:
    """Copy every item into its target from the open file ``fd`` (named ``source``), two threads
    at once; targets that share memory (one tensor under two names) are filled one at a time,
    each checked before the next is copied."""
    if _overlapping(items):
        for item in items:
            _large(source, fd, item)
        return
    units: list[Callable[[], None]] = []
    for batch in _parallel.batches(items, lambda i: i.flat.nbytes, READ_STEP):
        if len(batch) == 1:
            units.append(functools.partial(_large, source, fd, batch[0]))
        else:
            units.append(functools.partial(_small, source, batch))
    _parallel.run(units)


def _large(source: str, fd: int, item: Into) -> None:
    hasher = xxhash.xxh3_64()
    for at in range(0, item.flat.nbytes, READ_STEP):
        step = item.flat[at : at + READ_STEP]
        _read_exact(source, fd, step, item.offset + at)
        if item.expected is not None:
            hasher.update(step)
    if item.expected is not None and hasher.hexdigest() != item.expected:
        raise damaged(source, item.name)


def _read_exact(source: str, fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` on; a file that shrank since it was
    parsed (truncated in place by another program) is a :class:`BurnpackIOError`."""
    try:
        done = _fs.read_full(fd, view, offset)
    except OSError as e:
        raise BurnpackIOError(f"cannot read {source}: {e.strerror or e}") from e
    if done < view.nbytes:
        raise BurnpackIOError(
            f"{source}: the file ended at byte {offset + done} while reading it (it was "
            "truncated after it was opened)"
        )


def _small(source: str, batch: list[Into]) -> None:
    for item in batch:
        if item.expected is not None and xxhash.xxh3_64_hexdigest(item.stored) != item.expected:
            raise damaged(source, item.name)
        item.flat[:] = item.stored  # a few KiB: the copy costs less than releasing the GIL


def _overlapping(items: list[Into]) -> bool:
    """Whether two targets share memory (tied weights)."""
    spans = sorted((i.address, i.flat.nbytes) for i in items)
    return any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans))
