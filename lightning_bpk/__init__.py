"""lightning-bpk: crash-safe, pickle-free PyTorch Lightning checkpoints in Burn's burnpack format.

The package is layered; each layer only uses the ones listed before it:

- :mod:`lightning_bpk.errors` and :mod:`lightning_bpk.layout`: the root of every error
  (:class:`~lightning_bpk.errors.LightningBpkError`) and the names on disk, used by all layers;
- :mod:`lightning_bpk.store`: the one typed ``Store`` seam, with a local-disk and an object-store
  backend (``s3://``, ``gs://``, any fsspec URL) chosen by the URL's protocol;
  :mod:`lightning_bpk.store.lease`: one run owns a directory;
- :mod:`lightning_bpk.burnpack`: the ``.bpk`` container, byte-compatible with Burn;
- :mod:`lightning_bpk.state`: nested Python data <-> tensors, scalars and metadata (no pickle);
- :mod:`lightning_bpk.records`: module, optimizer and LR-scheduler records, as Burn splits them;
- :mod:`lightning_bpk.checkpointer`: Dopamine's sentinel protocol and retention, made crash-safe,
  written once over the ``Store`` (one checkpoint view, one commit, one resume choice);
- :mod:`lightning_bpk.lightning.callback` / :mod:`lightning_bpk.lightning.checkpoint_io`: the
Lightning integration;
  :mod:`lightning_bpk.fabric` the same for hand-written Lightning Fabric loops;
- :mod:`lightning_bpk.interop` and :mod:`lightning_bpk.cli` sit beside them (Burn/PyTorch
  adapters, key remapping, safetensors; the ``lightning-bpk`` command).

Public names are imported lazily so ``import lightning_bpk`` stays cheap (type checkers see the
real objects through the ``TYPE_CHECKING`` imports below); the gin configurables are registered
right away all the same (see :mod:`lightning_bpk._gin`).

Log lines ("restored ...", "saved checkpoint ...") go to the ``lightning_bpk`` logger at INFO,
and show on stderr without any logging configuration, as Lightning's own do, prefixed
``lightning_bpk:`` (``lightning_bpk: saved checkpoint 3 at run/checkpoints/ckpt.3``). Once the
program configures logging (a handler on the root logger, before or after this import), they go
through that configuration instead, and only there.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_bpk import burnpack, interop, state
    from lightning_bpk.checkpointer import (
        Checkpointer,
        CheckpointLockedError,
        CheckpointWarning,
        get_latest_checkpoint_number,
        verify_checkpoint,
    )
    from lightning_bpk.dcp import BurnpackStorageReader, BurnpackStorageWriter
    from lightning_bpk.errors import LightningBpkError, StorageError
    from lightning_bpk.lightning.callback import (
        BurnpackCheckpoint,
        CheckpointResumeError,
        CheckpointSaveError,
    )
    from lightning_bpk.lightning.checkpoint_io import BurnpackCheckpointIO
    from lightning_bpk.records import (
        LrSchedulerRecord,
        ModuleRecord,
        OptimizerRecord,
        RecordChecksumError,
        RecordError,
        StateRecord,
        load_record,
        param_ids,
    )
    from lightning_bpk.store.lease import CheckpointSupersededError

from lightning_bpk import _gin

__version__ = "0.1.0"


class _UnconfiguredHandler(logging.StreamHandler):
    """Writes to stderr only while the root logger has no handler (logging not configured)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not any(isinstance(h, _UnconfiguredHandler) for h in _logger.handlers):  # importlib.reload
    _handler = _UnconfiguredHandler()
    _handler.setFormatter(logging.Formatter("lightning_bpk: %(message)s"))
    _logger.addHandler(_handler)

_gin.register_stand_ins()

_EXPORTS = {
    "burnpack": "lightning_bpk.burnpack",
    "state": "lightning_bpk.state",
    "interop": "lightning_bpk.interop",
    "LightningBpkError": "lightning_bpk.errors",
    "ModuleRecord": "lightning_bpk.records",
    "OptimizerRecord": "lightning_bpk.records",
    "LrSchedulerRecord": "lightning_bpk.records",
    "StateRecord": "lightning_bpk.records",
    "RecordError": "lightning_bpk.records",
    "RecordChecksumError": "lightning_bpk.records",
    "load_record": "lightning_bpk.records",
    "param_ids": "lightning_bpk.records",
    "Checkpointer": "lightning_bpk.checkpointer",
    "CheckpointLockedError": "lightning_bpk.checkpointer",
    "CheckpointWarning": "lightning_bpk.checkpointer",
    "get_latest_checkpoint_number": "lightning_bpk.checkpointer",
    "verify_checkpoint": "lightning_bpk.checkpointer",
    "StorageError": "lightning_bpk.errors",
    "CheckpointSupersededError": "lightning_bpk.store.lease",
    "BurnpackCheckpoint": "lightning_bpk.lightning.callback",
    "CheckpointSaveError": "lightning_bpk.errors",
    "CheckpointResumeError": "lightning_bpk.lightning.callback",
    "BurnpackCheckpointIO": "lightning_bpk.lightning.checkpoint_io",
    "BurnpackStorageWriter": "lightning_bpk.dcp",
    "BurnpackStorageReader": "lightning_bpk.dcp",
}

__all__ = [
    "BurnpackCheckpoint",
    "BurnpackCheckpointIO",
    "BurnpackStorageReader",
    "BurnpackStorageWriter",
    "CheckpointLockedError",
    "CheckpointResumeError",
    "CheckpointSaveError",
    "CheckpointSupersededError",
    "CheckpointWarning",
    "Checkpointer",
    "LightningBpkError",
    "LrSchedulerRecord",
    "ModuleRecord",
    "OptimizerRecord",
    "RecordChecksumError",
    "RecordError",
    "StateRecord",
    "StorageError",
    "burnpack",
    "get_latest_checkpoint_number",
    "interop",
    "load_record",
    "param_ids",
    "state",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'lightning_bpk' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
