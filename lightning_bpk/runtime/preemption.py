"""Preemption and Ctrl-C: a signal only sets a flag; the run saves at a safe point, then stops.

During training, SIGTERM, SIGUSR1 and SIGINT (:data:`PREEMPTION_SIGNALS`) set a flag on this rank
(:class:`Preemption`, one per callback or manager); the handlers installed before still run,
except those the integration leaves out (``others``: the Lightning callback drops Lightning's
own SIGTERM notifier, whose in-handler broadcast can deadlock DDP). The integration makes the
ranks agree on the flag at the next optimizer-step boundary, saves, and calls
:meth:`Preemption.stop`, which requeues a SLURM job when its requeue signal was agreed
(:mod:`lightning_bpk.runtime.slurm`) and raises ``stop_error`` (a ``SystemExit`` without code:
exit status 0; Lightning's ``SIGTERMException`` for the callback). From then on a repeated
signal is ignored until the process has exited, so that status stays 0; a later run in the same
process brings the default handlers back.

**Ctrl-C** (SIGINT) is one of them by default: a run interrupted by hand would otherwise lose
everything since its last save (Python raises ``KeyboardInterrupt`` wherever the main thread is,
and Lightning shuts down without saving, exit status 1), while the next step boundary is at most
one step away and the save is the one a preemption makes. The first Ctrl-C says so on stderr;
a second one before the stop raises ``KeyboardInterrupt`` at once, as if none had been handled
(no save, Lightning's own shutdown): waiting is never forced. Leave SIGINT out of the signals
(``preemption_signals=("SIGTERM", "SIGUSR1")``) for Python's behaviour.

Nothing here knows a framework: the handlers to reinstall at the end are passed in as a dict
(Lightning's teardown keeps them in one; the Fabric manager keeps its own).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from collections.abc import Callable, MutableMapping, Sequence
from types import FrameType
from typing import Any

from lightning_bpk.runtime import slurm

__all__ = ["PREEMPTION_SIGNALS", "Preemption", "signal_number"]

log = logging.getLogger("lightning_bpk")

# Signals that mean "you are about to be stopped" (SIGTERM: Kubernetes, SageMaker, SLURM at the
# time limit; SIGUSR1: SLURM's --signal default for requeue; SIGINT: Ctrl-C, see the module doc).
# Plain ints, so a configuration system can write them out (LightningCLI saves its config as
# YAML, which cannot represent a signal.Signals).
PREEMPTION_SIGNALS = (int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGINT))
_INTERRUPTED = b"Ctrl-C: saving at the next step boundary, then stopping (Ctrl-C again aborts)\n"

# signal number -> the handler Lightning's teardown reinstalls (its signal connector's dict)
Originals = MutableMapping[int, Any]


def signal_number(value: object) -> int:
    """A signal given as a number, a ``signal.Signals`` or a name (``"SIGTERM"``, ``"TERM"``)."""
    if isinstance(value, str):
        name = value.strip().upper()
        found = getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name, None)
        if found is not None:
            return int(found)
    elif (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value in {int(s) for s in signal.valid_signals()}
    ):
        return int(value)
    raise ValueError(
        f"preemption_signals: {value!r} is not a signal of this platform (give a number, a "
        "signal.Signals or a name such as 'SIGTERM')"
    )


def _callables(handler: object) -> list[Callable[..., Any]]:
    """The callables a previously installed handler runs: itself, if it is one."""
    return [handler] if callable(handler) else []


def _ignore_while_stopping(signum: int, frame: FrameType | None) -> None:
    """Stands in for a default (fatal) disposition once a preemption stop has saved.

    Schedulers repeat their signal (SLURM signals every step, a requeue sends SIGTERM, a user
    presses twice); between the save and the process's exit that must not turn exit status 0
    into death by signal.
    """


def _ignore_at_exit(signums: Sequence[int]) -> None:
    """Interpreter finalization resets Python-level handlers to the default (fatal) one before
    torch and the other modules are torn down, so for that last stretch ignore them outright."""
    for signum in signums:
        if signal.getsignal(signum) is _ignore_while_stopping:
            signal.signal(signum, signal.SIG_IGN)


def _stop_ignoring(originals: Originals, signums: Sequence[int]) -> None:
    """A new fit in a process that survived a preemption stop: the defaults are back."""
    for signum in signums:
        if originals.get(signum) is _ignore_while_stopping:
            originals[signum] = signal.SIG_DFL
        if signal.getsignal(signum) is _ignore_while_stopping:
            signal.signal(signum, signal.SIG_DFL)


class Preemption:
    """This rank's preemption flags and signal handlers, for one callback.

    ``requested``: a preemption signal arrived on this rank; ``requeue_requested``: it was the
    requeue signal (:attr:`requeue_signal`, set by the callback when SLURM auto-requeue applies).
    ``agreed`` / ``requeue_agreed``: the same, on any rank, as the ranks agreed at a step
    boundary; ``stopping``: the stop after the save is under way.
    """

    def __init__(
        self,
        signals: Sequence[int | str],
        *,
        others: Callable[[object], list[Callable[..., Any]]] = _callables,
        stop_error: Callable[[], BaseException] = SystemExit,
    ) -> None:
        self.signals = tuple(signal_number(v) for v in signals)
        self._others = others  # the previous handler's callables that still run on a signal
        self._stop_error = stop_error
        self.requeue_signal: int | None = None
        self.requested = self.requeue_requested = False
        self.agreed = self.requeue_agreed = False
        self.stopping = False
        self._previous: dict[int, Any] = {}

    def flag(self) -> int:
        """What this rank contributes to the agreement: 0 (nothing), 1 (a signal) or 2 (the
        requeue signal), so that one all-reduce MAX tells both."""
        return int(self.requested) + int(self.requeue_requested)

    def agree(self, agreed: int) -> None:
        """Take the ranks' agreed :meth:`flag` (its maximum); agreed stays agreed."""
        self.agreed = self.agreed or agreed > 0
        self.requeue_agreed = self.requeue_agreed or agreed == 2

    def reset(self) -> None:
        """A new fit: nothing agreed yet."""
        self.agreed = self.requeue_agreed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Never save here: the main thread may be anywhere (inside a collective, a write).
        if signum == signal.SIGINT:
            if self.requested:  # the second Ctrl-C: abort now, as Python would have
                raise KeyboardInterrupt
            os.write(2, _INTERRUPTED)
        self.requested = True
        self.requeue_requested |= signum == self.requeue_signal
        for handler in self._others(self._previous.get(signum)):
            if handler is not signal.default_int_handler:  # KeyboardInterrupt: handled here
                handler(signum, frame)

    def install(self, originals: Originals) -> None:
        """Handle the signals from now on (training starts); ``originals``: what Lightning's
        teardown will reinstall. Outside the main thread signals cannot be handled: none are."""
        self.requested = self.requeue_requested = False
        self.stopping = False
        if self._previous:
            return
        signums = list(self.signals)
        if signums and self.requeue_signal is not None and self.requeue_signal not in signums:
            signums.append(self.requeue_signal)  # SLURMEnvironment(requeue_signal=...)
        _stop_ignoring(originals, signums)
        for signum in signums:
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: signals cannot be handled here
                break

    def restore(self) -> None:
        """Put back the handlers :meth:`install` found (where ours is still installed)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def stop(self, is_global_zero: bool, number: int | None, path: str | None, where: str) -> None:
        """Stop after the preemption save of checkpoint ``number`` at ``path`` (complete and
        flushed on every rank by now): rank 0 requeues the SLURM job if the requeue signal was
        agreed; every rank raises ``stop_error`` (exit status 0)."""
        if is_global_zero:
            if self.requeue_agreed:
                assert path is not None
                slurm.requeue(path)
            log.info(
                "preemption signal: saved checkpoint %s %s; stopping (exit status 0)",
                number,
                where,
            )
        self.stopping = True
        raise self._stop_error()

    def keep_ignoring(self, originals: Originals) -> None:
        """After a preemption stop, no further preemption signal may kill the exiting process.

        Our handler stays until Lightning's teardown reinstalls the handlers it found at fit
        start; where that was the fatal default, it reinstalls :func:`_ignore_while_stopping`
        instead (and :func:`_ignore_at_exit` covers interpreter finalization). Handlers the user
        installed come back as they were; Ctrl-C's handler comes back now (a Ctrl-C while the
        process exits aborts the exit, as Python's own handler does).
        """
        interrupt = signal.SIGINT  # Ctrl-C, where nothing restores it later: Python's again
        ours = signal.getsignal(interrupt) == self._on_signal
        if ours and interrupt in self._previous and interrupt not in originals:
            signal.signal(interrupt, self._previous[interrupt] or signal.SIG_DFL)
        signums = [s for s in self._previous if originals.get(s) == signal.SIG_DFL]
        for signum in signums:
            originals[signum] = _ignore_while_stopping
        atexit.unregister(_ignore_at_exit)
        atexit.register(_ignore_at_exit, signums)
        self._previous = {}

    def on_exception(self, originals: Originals, exception: BaseException) -> None:
        """Training ended with ``exception``: our own stop keeps ignoring the signals, any
        other ending restores the handlers."""
        if self.stopping and isinstance(exception, SystemExit):
            self.keep_ignoring(originals)
        else:
            self.restore()
