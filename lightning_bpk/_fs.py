"""Durable file primitives shared by every layer that writes: atomic publish and fsync.

The recipe is the one every careful checkpointer converges on: write a scratch file in the
*target* directory (a rename is only atomic within one filesystem), fsync it, ``os.replace`` it
over the destination, then fsync the directory so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "SCRATCH_SUFFIX",
    "atomic_file",
    "fsync_dir",
    "scratch_path",
    "write_all",
]

# Scratch names carry this suffix so a later save can recognise and remove leftovers of a crash.
SCRATCH_SUFFIX = ".tmp"

_counter = itertools.count()


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename or unlink inside it) to stable storage."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(f: BinaryIO, data: memoryview | bytes | bytearray) -> None:
    """Write every byte of ``data``; a raw file may accept fewer bytes than offered."""
    view = memoryview(data).cast("B")
    while view:
        written = f.write(view)
        if written is None or written <= 0:  # pragma: no cover - raw files always report a count
            raise OSError(f"short write to {getattr(f, 'name', '?')}")
        view = view[written:]


def scratch_path(target: Path) -> Path:
    """A sibling name for staging ``target``: ``<name>.<pid>-<counter>.tmp``."""
    return target.with_name(f"{target.name}.{os.getpid()}-{next(_counter)}{SCRATCH_SUFFIX}")


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[BinaryIO]:
    """Yield an unbuffered binary file that replaces ``target`` atomically on success.

    On any failure the scratch file is removed and an existing ``target`` is left untouched.
    """
    while True:
        scratch = scratch_path(target)
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        raise
    fsync_dir(target.parent)
