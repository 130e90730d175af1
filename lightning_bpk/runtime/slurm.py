"""SLURM auto-requeue, for the Lightning callback and the Fabric manager alike.

Lightning's own SLURM handler saves and runs ``scontrol requeue`` *inside* the signal handler
(which can deadlock DDP). The run instead saves at the next step boundary on every rank; once
that checkpoint is complete (sentinel written, an asynchronous write flushed), global rank 0
calls :func:`requeue` exactly once, outside any signal handler, and every rank exits with
status 0. SLURM starts the job again with ``SLURM_RESTART_COUNT`` > 0, and the new run resumes
from the newest checkpoint by itself (:func:`log_restart` says so).

This happens only when Lightning runs under SLURM (its ``SLURMEnvironment`` was detected, i.e.
the script runs under ``srun`` or with ``--ntasks``), that environment's ``auto_requeue`` is on
(Lightning's default) and so is the callback's (or manager's) ``auto_requeue``, and the signal
that stopped training was the environment's requeue signal (SIGUSR1 by default, as in
Lightning: SIGTERM means the scheduler itself is ending the job, by ``scancel`` or its own
preemption). Which signal that is, each integration asks its framework
(:func:`lightning_bpk.lightning._compat.slurm_requeue_signal`,
:func:`lightning_bpk.fabric._preemption.requeue_signal`); what follows it is here.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping

__all__ = ["job_id", "log_restart", "requeue", "restart_count"]

log = logging.getLogger("lightning_bpk")

# scontrol retries an unreachable controller for its MessageTimeout (10 s by default) itself.
_SCONTROL_TIMEOUT = 60.0


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """This job's id for ``scontrol``: ``{array job}_{task}`` for an array task, as Lightning.

    Example::

        >>> job_id({"SLURM_JOB_ID": "812"})
        '812'
        >>> job_id({"SLURM_JOB_ID": "812", "SLURM_ARRAY_JOB_ID": "800", "SLURM_ARRAY_TASK_ID": "2"})
        '800_2'
    """
    environ = os.environ if environ is None else environ
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        job = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job = environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        raise ValueError(f"unexpected SLURM job id {job!r} in the environment")
    return job


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times SLURM has restarted this job (``SLURM_RESTART_COUNT``; 0 if unset)."""
    environ = os.environ if environ is None else environ
    return int(environ.get("SLURM_RESTART_COUNT") or 0)


def requeue(checkpoint: str) -> bool:
    """Run ``scontrol requeue`` for this job; log the outcome and return whether it worked.

    Call it once, on global rank 0, after ``checkpoint`` (the saved preemption checkpoint,
    named in the log) is complete. A failure is logged with scontrol's output and changes
    nothing on disk: submitting the job again continues from ``checkpoint``.
    """
    outcome: str | None
    try:
        job = job_id()
    except (KeyError, ValueError) as e:
        job, outcome = "?", f"no usable job id in the environment: {e!r}"
    else:
        outcome = _scontrol_requeue(job)
        if outcome is None:
            log.info(
                "requeued SLURM job %s (`scontrol requeue %s`); it resumes from %s",
                job,
                job,
                checkpoint,
            )
            return True
    log.error(
        "requeueing SLURM job %s failed (%s); the checkpoint %s is saved: submit the job again "
        "to continue from it",
        job,
        outcome,
        checkpoint,
    )
    return False


def _scontrol_requeue(job: str) -> str | None:
    """Run ``scontrol requeue job``: ``None`` if it worked, else what went wrong."""
    command = ["scontrol", "requeue", job]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not run `{' '.join(command)}`: {e}"
    if result.returncode == 0:
        return None
    output = " ".join((result.stdout + result.stderr).split())
    return f"`{' '.join(command)}` failed with exit status {result.returncode}: {output}"


def log_restart(resumed_from: str | os.PathLike[str] | None) -> None:
    """On a job SLURM has restarted (requeued), say so and what this run continues from.

    ``resumed_from`` names the checkpoint the run resumed from (``None``: none, from scratch).
    Nothing is logged outside SLURM or on the job's first run.
    """
    count = restart_count()
    job = os.environ.get("SLURM_JOB_ID")
    if count <= 0 or job is None:
        return
    start = (
        f"this run continues from {resumed_from}"
        if resumed_from
        else "no checkpoint to continue from: this run starts afresh"
    )
    log.info("SLURM job %s was requeued (restart %d): %s", job, count, start)
