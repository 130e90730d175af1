"""The root of every error this package raises on purpose: catch :class:`LightningBpkError`.

Each layer has its own error class, all derived from the root; where a user would reasonably
catch a built-in exception, the class derives from that too::

    LightningBpkError
    ├── burnpack.BurnpackError                  a .bpk file cannot be read or written
    │   ├── HeaderError, MagicError, VersionError, MetadataError, ValidationError,
    │   │   TensorNotFoundError, SizeMismatchError
    │   ├── ChecksumError                       stored bytes fail their xxh3 checksum
    │   └── BurnpackIOError (also OSError)      open/read/write/rename failed (a full disk, ...)
    ├── state.StateError (also ValueError)      a value has no pickle-free form, or stored
    │                                           state does not decode
    ├── records.RecordError                     a record cannot be read, written or applied;
    │   │                                       ``kind`` is "io", "validation" or "checksum"
    │   └── RecordChecksumError (also burnpack.ChecksumError)
    ├── interop.RemapError (also ValueError)    a key remapping does not apply
    ├── dcp.ShardedCheckpointError (also RuntimeError)
    │                                           a sharded (DCP) checkpoint cannot be written
    │                                           or read; names the rank file
    ├── StorageError (also OSError)             a store failed after its retries, or a URL
    │   │                                       cannot be served; names the URL
    │   └── DirectoryGoneError                  the directory was deleted while a run used it
    ├── MissingDriverError (also ImportError)   the fsspec driver of a URL is not installed
    ├── store.local.RefusedFileError (also ValueError)
    │                                           a symlink, FIFO or directory where a file was
    │                                           to be read (never followed)
    ├── CheckpointLockedError (also RuntimeError)
    │                                           another process is saving into the directory
    ├── lease.CheckpointSupersededError (also RuntimeError)
    │                                           a newer run took over the directory
    ├── runtime._writer.WriterProcessDied (also RuntimeError)
    │                                           an async save's writer process died
    ├── CheckpointSaveError (also RuntimeError)
    │                                           a save failed; earlier checkpoints are intact
    └── CheckpointResumeError (also RuntimeError)
                                                fit cannot start from the checkpoints as they
                                                are (nothing changed on disk)

A checksum failure stays one on its way up: a damaged tensor in a checkpoint raises
:class:`~lightning_bpk.records.RecordChecksumError` from a record load or
:meth:`~lightning_bpk.checkpointer.Checkpointer.load_checkpoint`, which is both a
``RecordError`` and a :class:`~lightning_bpk.burnpack.ChecksumError`. Bad arguments (a negative
iteration number, an unknown setting) raise the usual ``ValueError``/``TypeError``; warnings
about skipped checkpoints are :class:`~lightning_bpk.checkpointer.CheckpointWarning`.

>>> from lightning_bpk import burnpack
>>> try:
...     burnpack.loads(b"not a burnpack")
... except LightningBpkError as e:
...     print(type(e).__name__)
MagicError
"""

from __future__ import annotations

__all__ = [
    "CheckpointLockedError",
    "CheckpointResumeError",
    "CheckpointSaveError",
    "DirectoryGoneError",
    "LightningBpkError",
    "MissingDriverError",
    "StorageError",
    "summarise",
]

# A list of problems longer than this is summarised in messages ("... and N more").
_SHOWN_PROBLEMS = 5


class LightningBpkError(Exception):
    """Base class of every error lightning-bpk raises on purpose (see the module docstring)."""


class CheckpointResumeError(LightningBpkError, RuntimeError):
    """``fit`` cannot start from the checkpoints as they are; nothing was changed on disk.

    gin's ``override_number`` names a checkpoint that is missing or incomplete, the run would
    save over complete checkpoints it did not resume past (see ``overwrite``), the checkpoint
    holds the state of other optimizer or scheduler classes than the module configures, or the
    training data cannot continue its epoch under a changed setting (batch size, world size,
    ``accumulate_grad_batches``). Raised from :mod:`lightning_bpk.lightning.callback` and
    :mod:`lightning_bpk.lightning.data_position`; importable from either, and from
    ``lightning_bpk``.
    """


class CheckpointSaveError(LightningBpkError, RuntimeError):
    """Saving a checkpoint failed (on rank 0); earlier checkpoints are untouched, unless the
    checkpoint directory itself was deleted under the run, which the message then says.
    Raised from :mod:`lightning_bpk.lightning.callback`; importable from it and from
    ``lightning_bpk``."""


class StorageError(LightningBpkError, OSError):
    """A storage operation failed (after retries), or a URL cannot be served; names the URL."""


class DirectoryGoneError(StorageError):
    """The checkpoint directory (or its whole bucket) was deleted while a run used it: every
    checkpoint that was in it is gone too, so no "earlier checkpoints are untouched" holds."""


class MissingDriverError(LightningBpkError, ImportError):
    """The fsspec driver for a URL's protocol is not installed."""


class CheckpointLockedError(LightningBpkError, RuntimeError):
    """Another process (or checkpointer) is saving into the same directory right now."""


def summarise(problems: list[str]) -> str:
    """The first few problems joined with "; ", and how many more there are: a message stays
    short whatever a hostile file lists (an index naming 200,000 absent files made one of
    15 MB).

    >>> summarise([f"f{i}: missing" for i in range(7)])
    'f0: missing; f1: missing; f2: missing; f3: missing; f4: missing; ... and 2 more'
    """
    shown = "; ".join(problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    return shown + (f"; ... and {more} more" if more > 0 else "")
