"""Names and the error of sharded checkpoints, importable without torch.distributed.

:mod:`lightning_bpk.dcp` writes and reads them; the command line and interop only need to tell
a sharded directory apart, and importing DCP costs seconds, so they start here and import
:mod:`lightning_bpk.dcp` only for a directory that is one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning_bpk.errors import LightningBpkError
from lightning_bpk.store import open_store

DEFAULT_PREFIX = "sharded"
INDEX_DATA_KEY = f"{DEFAULT_PREFIX}.index"  # the index's data key in a checkpoint (beside trainer)
# The callback's DCP state: the module under ``model`` (layout.MODEL_KEY), and under this key its
# parameter name -> u64 param id map, so the consolidated ModuleRecord keeps Burn's param ids.
PARAM_IDS_KEY = "param_ids"


class ShardedCheckpointError(LightningBpkError, RuntimeError):
    """A sharded checkpoint could not be written or read; the message names the file."""


def index_name(prefix: str = DEFAULT_PREFIX) -> str:
    """The file (or object) name of the index inside a sharded checkpoint."""
    return f"{prefix}.index.bpk"


def is_sharded(
    directory: str | os.PathLike[str],
    prefix: str = DEFAULT_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> bool:
    """True when ``directory`` (a local path or an object-store URL) holds a committed sharded
    checkpoint: its index exists."""
    return open_store(directory, storage_options).size(index_name(prefix)) is not None
