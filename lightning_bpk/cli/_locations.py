"""Where a command's argument lives: a local path or a URL of an object store.

The command line's remaining choices between local disk and an object store are gathered here:
copying a URL into a temporary folder for the readers that need a file (safetensors,
``torch.load``), and the time column of ``ls`` (not asked of object stores). Reading a ``.bpk``
in place is :mod:`lightning_bpk.records.files`, through the ``Store``.
"""

from __future__ import annotations

import contextlib
import datetime
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lightning_bpk.store import location, name_of, object_store, parent_of


@contextlib.contextmanager
def local_copies(*targets: str, only: str | None = None) -> Iterator[list[Path]]:
    """A local path for each argument of ``convert`` and ``diff``, whose readers (safetensors,
    ``torch.load``) need files: a path as it is; a URL copied into a temporary folder, removed
    afterwards: an object as a file, a prefix (a checkpoint's data) as a folder of the objects
    directly under it (``only`` that one if it is there)."""
    with tempfile.TemporaryDirectory(prefix="lightning_bpk-cli-") as scratch:
        yield [_local_copy(t, Path(scratch) / str(i), only) for i, t in enumerate(targets)]


def _local_copy(target: str, scratch: Path, only: str | None) -> Path:
    found = location(target)
    if isinstance(found, Path):
        return found
    scratch.mkdir()
    name = name_of(found)
    parent = object_store(parent_of(found))
    if parent.size(name) is not None:
        parent.download(name, scratch / name)
        return scratch / name
    store = object_store(found)
    objects = [key for key, size in store.list("").items() if size is not None]
    if only in objects:
        objects = [only]
    if not objects:
        raise OSError(f"{found}: no such object, nor objects under it")
    (scratch / name).mkdir()
    for key in objects:
        store.download(key, scratch / name / key)
    return scratch / name


def is_safetensors(target: str) -> bool:
    """Whether ``target`` (a path or a URL) names a ``.safetensors`` file."""
    return name_of(location(target)).lower().endswith(".safetensors")


def mtime(path: Path | str) -> str:
    """A local file's own modification time (ISO 8601, local zone); ``-`` for a URL."""
    if isinstance(path, str):
        return "-"  # not asked of object stores: one request per checkpoint for a column
    # lstat: the time of the name itself (a symlinked sentinel is refused, never followed)
    stamp = datetime.datetime.fromtimestamp(path.lstat().st_mtime).astimezone()
    return stamp.isoformat(timespec="seconds")
