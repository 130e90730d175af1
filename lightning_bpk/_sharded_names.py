"""Names and the error of sharded checkpoints, importable without torch.distributed.

:mod:`lightning_bpk.dcp` writes and reads them; the command line and interop only need to tell
a sharded directory apart, and importing DCP costs seconds, so they start here and import
:mod:`lightning_bpk.dcp` only for a directory that is one.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_bpk.errors import LightningBpkError

__all__ = ["DEFAULT_PREFIX", "INDEX_KEY", "ShardedCheckpointError", "index_path", "is_sharded"]

DEFAULT_PREFIX = "sharded"
INDEX_KEY = f"{DEFAULT_PREFIX}.index"  # the index's data key in a checkpoint (beside trainer)


class ShardedCheckpointError(LightningBpkError, RuntimeError):
    """A sharded checkpoint could not be written or read; the message names the file."""


def index_path(directory: str | os.PathLike[str], prefix: str = DEFAULT_PREFIX) -> Path:
    """Where the index of the sharded checkpoint in ``directory`` lives."""
    return Path(directory) / f"{prefix}.index.bpk"


def is_sharded(directory: str | os.PathLike[str], prefix: str = DEFAULT_PREFIX) -> bool:
    """True when ``directory`` holds a committed sharded checkpoint (its index exists)."""
    return index_path(directory, prefix).is_file()
