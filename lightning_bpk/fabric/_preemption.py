"""Preemption for a Fabric loop: the run layer's :class:`Preemption`, wired to Fabric.

A signal only sets a flag (:class:`~lightning_bpk.runtime.preemption.Preemption`); the
manager's ``save_if_due`` makes the ranks agree on it at the next step boundary, saves, and
calls :meth:`FabricPreemption.stop`. Fabric has no teardown that puts signal handlers back, so
this does what Lightning's teardown does for the callback: the handlers found when the manager
was built come back (those that were the fatal default become "ignore", so a repeated signal
cannot turn exit status 0 into death by signal while the process exits).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_bpk.fabric import _compat
from lightning_bpk.runtime import slurm
from lightning_bpk.runtime.preemption import Preemption


def requeue_signal(strategy: Any) -> int | None:
    """The signal that asks for a SLURM requeue in a Fabric run, or None when auto-requeue does
    not apply (Lightning did not detect SLURM, or ``SLURMEnvironment(auto_requeue=False)``)."""
    environment = _compat.cluster_environment(strategy)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


class FabricPreemption:
    """This rank's preemption flags and handlers for one manager, installed at construction."""

    def __init__(self, signals: Sequence[int | str], strategy: Any, auto_requeue: bool) -> None:
        self._preemption = Preemption(signals)
        if auto_requeue:
            self._preemption.requeue_signal = requeue_signal(strategy)
        signums = set(self._preemption.signals)
        if signums and self._preemption.requeue_signal is not None:
            signums.add(self._preemption.requeue_signal)
        # what this process had installed, to put back (Lightning's teardown does that)
        self._originals: dict[int, Any] = {s: signal.getsignal(s) for s in sorted(signums)}
        self._preemption.install(self._originals)

    @property
    def agreed(self) -> bool:
        """The ranks agreed that a preemption signal arrived."""
        return self._preemption.agreed

    def flag(self) -> int:
        """What this rank contributes to the agreement (see ``Preemption.flag``)."""
        return self._preemption.flag()

    def agree(self, agreed: int) -> None:
        """Take the ranks' agreed flag (their maximum)."""
        self._preemption.agree(agreed)

    def stop(self, is_global_zero: bool, step: int, path: str | None) -> None:
        """After the preemption save of checkpoint ``step`` at ``path`` (complete and flushed):
        rank 0 requeues a SLURM job when the requeue signal was agreed; every rank keeps
        ignoring further signals and raises ``SystemExit`` with status 0."""
        self._preemption.keep_ignoring(self._originals)
        for signum, handler in self._originals.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except ValueError:  # not the main thread: nothing was installed
                break
        self._preemption.stop(is_global_zero, step, path, f"at step {step}")

    def restore(self) -> None:
        """Put back the handlers found at construction."""
        self._preemption.restore()

    @staticmethod
    def log_restart(resumed_from: str | None) -> None:
        """On a job SLURM requeued, say what this run continues from."""
        slurm.log_restart(resumed_from)
