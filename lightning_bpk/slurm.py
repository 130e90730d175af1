"""The public path of :mod:`lightning_bpk.lightning.slurm`, which holds the code."""

from lightning_bpk.lightning.slurm import (
    job_id,
    log_restart,
    requeue,
    requeue_signal,
    restart_count,
)

__all__ = [
    "job_id",
    "log_restart",
    "requeue",
    "requeue_signal",
    "restart_count",
]
