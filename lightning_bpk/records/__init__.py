"""Records: training state split the way Burn splits it, one burnpack file each.

- :class:`ModuleRecord`: a module's parameters and buffers, each parameter with a u64 ``param_id``;
- :class:`OptimizerRecord`: optimizer state keyed by parameter id, never by position;
- :class:`LrSchedulerRecord`: a scheduler's state as scalars only;
- :class:`StateRecord`: any nested plain data (through :mod:`lightning_bpk.state`).
"""

from lightning_bpk.records.base import (
    RECORD_KIND_KEY as RECORD_KIND_KEY,  # a cross-layer internal (DCP, sharded), not in __all__
)
from lightning_bpk.records.base import (
    Record,
    RecordChecksumError,
    RecordError,
    StateRecord,
    load_record,
)
from lightning_bpk.records.module import (
    Adapter,
    ModuleRecord,
    default_param_id,
    param_ids,
)
from lightning_bpk.records.optimizer import OptimizerRecord
from lightning_bpk.records.scheduler import LrSchedulerRecord

__all__ = [
    "Adapter",
    "LrSchedulerRecord",
    "ModuleRecord",
    "OptimizerRecord",
    "Record",
    "RecordChecksumError",
    "RecordError",
    "StateRecord",
    "default_param_id",
    "load_record",
    "param_ids",
]
