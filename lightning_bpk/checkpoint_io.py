"""The public path of :mod:`lightning_bpk.lightning.checkpoint_io`, which holds the code."""

from lightning_bpk.lightning.checkpoint_io import (
    BurnpackCheckpointIO,
)

__all__ = [
    "BurnpackCheckpointIO",
]
