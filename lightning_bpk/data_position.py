"""The public path of :mod:`lightning_bpk.lightning.data_position`, which holds the code."""

from lightning_bpk.lightning.data_position import (
    POSITION_KEY,
    REPLAY,
    SAMPLER,
    STATEFUL,
    DataPosition,
    loader_kind,
    within_pass,
)

__all__ = [
    "POSITION_KEY",
    "REPLAY",
    "SAMPLER",
    "STATEFUL",
    "DataPosition",
    "loader_kind",
    "within_pass",
]
