"""The public path of :mod:`lightning_bpk.lightning.async_save`, which holds the code."""

from lightning_bpk.lightning.async_save import (
    AsyncCheckpointSaver,
)

__all__ = [
    "AsyncCheckpointSaver",
]
