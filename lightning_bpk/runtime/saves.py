"""Save and agree: one run's saves, written once for the Lightning callback and the Fabric manager.

:meth:`Saves.save` is where every save of both integrations goes, on every rank at the same
point: rank 0 builds the records (the integration passes a function, so a record that cannot
be stored fails inside the save like a write) and commits them through the
:class:`~lightning_bpk.checkpointer.Checkpointer` (or, with an
:class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`, snapshots them and commits on
its writer thread), or every rank writes its shards and rank 0 commits them with the records
(:func:`lightning_bpk.runtime.sharded.save`); then all ranks agree on the outcome
(:class:`~lightning_bpk.runtime.ranks.Ranks`), so a failed save (a full disk, a superseded
lease) raises :class:`~lightning_bpk.errors.CheckpointSaveError` on every rank, saying what
became of the checkpoints before it. An asynchronous write's failure is raised by the next
save, :meth:`Saves.wait` or :meth:`Saves.close`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_bpk.checkpointer import Checkpointer, Retention
from lightning_bpk.dcp import ShardedCheckpointError
from lightning_bpk.errors import CheckpointSaveError
from lightning_bpk.runtime import sharded
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.ranks import Ranks
from lightning_bpk.store import DirectoryGoneError

__all__ = ["Saves"]

log = logging.getLogger("lightning_bpk")

# rank 0's records of a save, built inside it (None on the other ranks)
Records = Callable[[], Mapping[str, Any]]


def _untouched(error: BaseException) -> str:
    """What a failed save's message promises about the checkpoints before it: untouched, unless
    the directory itself was deleted (a :class:`~lightning_bpk.errors.DirectoryGoneError`
    anywhere in the chain), where they are gone with it and its message says so."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, DirectoryGoneError):
            return ""
        cause = cause.__cause__ or cause.__context__
    return "; earlier checkpoints are untouched"


def _describe(error: BaseException) -> str:
    """An error and the notes an asynchronous save adds (which save it came from)."""
    return " ".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])])


def _log_saved(number: int) -> Callable[[Path | str], None]:
    """The one "saved checkpoint N at PATH" line, for a synchronous or asynchronous save."""
    return lambda path: log.info("saved checkpoint %d at %s", number, path)


class Saves:
    """The saves of one run into ``checkpointer``'s directory, among ``ranks``; ``saver``:
    the asynchronous writer (None: synchronous saves); ``storage_options`` go to fsspec for
    the shards of a sharded save. Every rank makes one, and calls :meth:`save` at the same
    points."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        ranks: Ranks,
        saver: AsyncCheckpointSaver | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.ranks = ranks
        self.saver = saver
        self.storage_options = storage_options

    def save(
        self,
        number: int,
        records: Records,
        *,
        shards: Mapping[str, Any] | None = None,
        retention: Retention | None = None,
        flush: bool = False,
        background: bool = True,
    ) -> None:
        """Save checkpoint ``number`` (a collective: every rank calls it). ``records()`` is
        called on rank 0 alone, inside the save; ``shards``: this rank's DCP state of a sharded
        save (every rank writes its own, rank 0 commits them with the records). ``retention``:
        that of a save made whatever the checkpointer's frequency (None: an ordinary save).
        ``flush`` waits for an asynchronous write to be durable; ``background=False`` writes
        shards on this thread even with a saver. Raises
        :class:`~lightning_bpk.errors.CheckpointSaveError` on every rank if any failed."""
        saver = self.saver
        error: BaseException | None = None
        try:
            if shards is not None:  # every rank writes its shards
                self._save_sharded(number, records, shards, retention, flush, background)
            elif self.ranks.is_global_zero:
                data = records()
                if saver is not None:  # raises an earlier failure; logs once committed
                    saver.save_checkpoint(
                        self.checkpointer, number, data, _log_saved(number), retention=retention
                    )
                    if flush:
                        saver.wait()
                # a subclass of Checkpointer may predate the retention argument: only if set
                elif retention is None:
                    self._saved(number, self.checkpointer.save_checkpoint(number, data))
                else:
                    path = self.checkpointer.save_checkpoint(number, data, retention=retention)
                    self._saved(number, path)
        except Exception as e:
            error = e
        if self.ranks.agree(int(error is not None)):
            if error is None:
                raise CheckpointSaveError(
                    f"another rank failed to save checkpoint {number} (its log says why)"
                )
            raise CheckpointSaveError(self._failure(number, error)) from error

    @staticmethod
    def _saved(number: int, path: Path | str | None) -> None:
        if path is not None:  # None: the checkpointer's frequency skipped it
            _log_saved(number)(path)

    def _save_sharded(
        self,
        number: int,
        records: Records,
        shards: Mapping[str, Any],
        retention: Retention | None,
        flush: bool,
        background: bool,
    ) -> None:
        """Every rank writes its ``shards`` and rank 0 commits them with its records
        (asynchronously with a saver: every rank's writer thread; raises an earlier failure)."""
        data = records() if self.ranks.is_global_zero else None
        options = self.storage_options
        if self.saver is None or not background:
            path = sharded.save(
                self.checkpointer,
                number,
                shards,
                data,
                retention=retention,
                storage_options=options,
            )
            if path is not None:
                log.info("saved sharded checkpoint %d at %s", number, path)
            return
        logged = _log_saved(number) if self.ranks.is_global_zero else None
        self.saver.save_sharded(
            self.checkpointer,
            number,
            shards,
            data,
            logged,
            retention=retention,
            storage_options=options,
        )
        if flush:
            self.saver.wait()

    def _failure(self, number: int, error: BaseException) -> str:
        """What a failed save says: the error (and, for an asynchronous save's, which earlier
        save it comes from: its note), and what became of the checkpoints before it."""
        if isinstance(error, ShardedCheckpointError):  # it names the checkpoint
            notes = getattr(error, "__notes__", [])
            return " ".join([f"{error}{_untouched(error)}", *notes])
        return (
            f"saving checkpoint {number} into {self.checkpointer.base_directory} failed "
            f"({_describe(error)}){_untouched(error)}"
        )

    def wait(self) -> None:
        """Block until an asynchronous write in flight is durable; raise
        :class:`~lightning_bpk.errors.CheckpointSaveError` if it failed."""
        if self.saver is None:
            return
        try:
            self.saver.wait()
        except Exception as e:
            raise CheckpointSaveError(
                f"the last asynchronous checkpoint save failed ({_describe(e)}){_untouched(e)}"
            ) from e

    def close(self) -> None:
        """:meth:`wait`, then stop the writer thread and free its staging buffers (the saver
        can write again afterwards)."""
        try:
            self.wait()
        finally:
            if self.saver is not None:
                self.saver.close()
