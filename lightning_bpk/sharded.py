"""The public path of :mod:`lightning_bpk.lightning.sharded`, which holds the code."""

from lightning_bpk.lightning.sharded import (
    ShardedCheckpointError,
    Shards,
    holds_dtensors,
    is_sharded,
    lightning_dict,
    load,
    module_record,
    publish,
    records,
    restore,
    save_shards,
)

__all__ = [
    "ShardedCheckpointError",
    "Shards",
    "holds_dtensors",
    "is_sharded",
    "lightning_dict",
    "load",
    "module_record",
    "publish",
    "records",
    "restore",
    "save_shards",
]
