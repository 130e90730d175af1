"""Work the burnpack reader and writer share between two threads, and pauses of the cyclic GC.

Loads and saves on a 2-core machine were slow one run in three, with the same code and data.
Measured side by side (16 interleaved runs each, another process busy on the second core), two
causes, each removed here:

- **torch's intra-op thread pool.** ``copy_`` of a large tensor splits the copy between OpenMP
  threads that meet at a barrier; when another process holds the second core, the copy waits for
  it to be scheduled again: ``read_into`` of 64 MiB took 9-136 ms with torch's two threads and
  10-21 ms with one. Bulk copies here are independent pieces that the caller's thread and one
  helper thread take from a shared queue (:func:`run`): a descheduled thread delays only the
  piece it holds. ``os.preadv``, ``numpy.copyto`` and xxhash release the GIL, so two pieces run
  on two cores at once.
- **Python's cyclic garbage collector.** After enough container allocations CPython runs a full
  collection, which visits every object of the process: about 400,000 with torch and Lightning
  imported, 200 ms. Parsing, planning or building 5,000 tensors allocates that many containers;
  every run with a full collection was the slow one (270-330 ms against 65-100 ms).
  :func:`gc_paused` holds the collector off while they are built, as Mercurial's ``nogc`` does:
  they form no reference cycles, and temporaries freed before the pause ends never count
  towards a collection.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy

from lightning_bpk import _fs

__all__ = ["COPY_CHUNK", "batches", "copy", "gc_paused", "gc_paused_call", "run", "submit"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

COPY_CHUNK = 4 * 1024 * 1024
"""Bytes per piece of :func:`copy`: large enough that the per-piece overhead (a few
microseconds) is noise, small enough that two threads share a 64 MiB tensor evenly."""


class _State:
    """The pause count; a child made by ``fork`` starts afresh."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pauses = 0
        self.resume = False  # whether the collector was enabled when the first pause began


_state = _State()
_helper = _fs.Worker("lightning_bpk-work")


def _forget_after_fork() -> None:
    global _state
    _state = _State()


os.register_at_fork(after_in_child=_forget_after_fork)


def submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` on the process's one helper thread for work that releases the GIL (hashing,
    copying; see :class:`lightning_bpk._fs.Worker`)."""
    return _helper.submit(fn, *args)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector off for the block (nested and concurrent blocks: until
    the last one ends); a collector the user disabled stays disabled."""
    state = _state
    with state.lock:
        if state.pauses == 0:
            state.resume = gc.isenabled()
            gc.disable()
        state.pauses += 1
    try:
        yield
    finally:
        with state.lock:
            state.pauses -= 1
            if state.pauses == 0 and state.resume:
                gc.enable()


def gc_paused_call(fn: F) -> F:
    """Decorator form of :func:`gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def run(units: Sequence[Callable[[], None]]) -> None:
    """Run every unit, the caller's thread and the helper taking the next one from a shared
    queue; the first exception is raised once both stopped (the rest of the queue is skipped).
    A single unit runs on the caller's thread alone."""
    if len(units) <= 1:
        for unit in units:
            unit()
        return
    queue = iter(units)
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                unit = next(queue, None)
            if unit is None:
                return
            try:
                unit()
            except BaseException as e:
                failed.append(e)

    other = submit(work)
    work()
    other.result()
    if failed:
        raise failed[0]


def batches(items: list[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, cut into runs of at most ``limit`` bytes (an item over the limit
    alone): units of work worth handing to another thread.

    The first item always opens a run, whatever its size: an empty tensor (0 bytes) first in
    data order is an item like any other, and joins the run of the items after it.

    >>> batches([1, 2, 3, 9, 1], lambda n: n, 5)
    [[1, 2], [3], [9], [1]]
    >>> batches([0, 0, 3, 0], lambda n: n, 5), batches([], lambda n: n, 5)
    ([[0, 0, 3, 0]], [])
    """
    out: list[list[T]] = []
    total = 0
    for item in items:
        n = size(item)
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def copy(pairs: Iterable[tuple[memoryview, memoryview]]) -> None:
    """Copy each ``(destination, source)`` pair of equal-length byte views, in pieces of
    :data:`COPY_CHUNK` shared by two threads (:func:`run`)."""

    def piece(destination: memoryview, source: memoryview) -> Callable[[], None]:
        return lambda: numpy.copyto(
            numpy.frombuffer(destination, dtype=numpy.uint8),
            numpy.frombuffer(source, dtype=numpy.uint8),
        )

    run(
        [
            piece(destination[at : at + COPY_CHUNK], source[at : at + COPY_CHUNK])
            for destination, source in pairs
            for at in range(0, destination.nbytes, COPY_CHUNK)
        ]
    )
