"""lightning_bpk.runtime.preemption without a framework: real signals raised in this process
(``signal.raise_signal`` runs the Python handler before it returns), the handlers Lightning
restores at teardown stood in for by the plain dict it keeps them in."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from collections.abc import Iterator

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_bpk.runtime import preemption as module
from lightning_bpk.runtime.preemption import PREEMPTION_SIGNALS, Preemption, signal_number

USED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _handlers_back() -> Iterator[None]:
    """Every signal this file touches gets its handler back, whatever a test did."""
    saved = {s: signal.getsignal(s) for s in USED}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    atexit.unregister(module._ignore_at_exit)


def test_signals_are_read_as_numbers_signals_or_names():
    assert (int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGINT)) == PREEMPTION_SIGNALS
    given = Preemption(["TERM", "sigusr1", signal.SIGINT, int(signal.SIGUSR2)])
    assert given.signals == (15, 10, 2, 12)
    assert all(type(s) is int for s in given.signals)
    for bad in ("SIGNOPE", True, 100_000, 1.5):
        with pytest.raises(ValueError, match="preemption_signals"):
            signal_number(bad)


def test_a_signal_only_sets_the_flag_and_the_previous_handler_still_runs():
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    preemption = Preemption([signal.SIGUSR1])
    preemption.install({})
    assert preemption.flag() == 0
    signal.raise_signal(signal.SIGUSR1)
    assert preemption.requested and not preemption.requeue_requested
    assert preemption.flag() == 1
    assert seen == [signal.SIGUSR1]  # the user's handler ran too
    preemption.restore()
    signal.raise_signal(signal.SIGUSR1)  # the user's handler alone again
    assert seen == [signal.SIGUSR1, signal.SIGUSR1]


def test_the_requeue_signal_is_handled_and_told_apart():
    preemption = Preemption([signal.SIGTERM])
    preemption.requeue_signal = int(signal.SIGUSR2)  # SLURMEnvironment(requeue_signal=...)
    preemption.install({})
    signal.raise_signal(signal.SIGUSR2)
    assert preemption.flag() == 2  # one all-reduce MAX tells "a signal" and "requeue" apart
    preemption.restore()


def test_agreement_accumulates_and_a_new_fit_resets_it():
    preemption = Preemption(PREEMPTION_SIGNALS)
    preemption.agree(0)
    assert not preemption.agreed and not preemption.requeue_agreed
    preemption.agree(1)
    assert preemption.agreed and not preemption.requeue_agreed
    preemption.agree(2)
    preemption.agree(0)  # a later batch end where no rank saw one: still agreed
    assert preemption.agreed and preemption.requeue_agreed
    preemption.reset()
    assert not preemption.agreed and not preemption.requeue_agreed


def test_no_signals_no_handlers():
    preemption = Preemption([])
    before = signal.getsignal(signal.SIGTERM)
    preemption.install({})
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_nothing_is_installed():
    preemption = Preemption([signal.SIGUSR1])
    before = signal.getsignal(signal.SIGUSR1)
    errors: list[BaseException] = []

    def install() -> None:
        try:
            preemption.install({})
        except BaseException as e:  # pragma: no cover - the failure this test looks for
            errors.append(e)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(timeout=60)
    assert not errors and signal.getsignal(signal.SIGUSR1) is before


def test_the_stop_exits_with_status_0_and_says_where(caplog):
    # the Lightning callback stops with Lightning's SIGTERMException, the Fabric manager with
    # a plain SystemExit: both without code, exit status 0
    preemption = Preemption([signal.SIGTERM], stop_error=SIGTERMException)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"), pytest.raises(SIGTERMException):
        preemption.stop(True, 7, None, "at the end of epoch 7")
    assert preemption.stopping
    assert "saved checkpoint 7 at the end of epoch 7; stopping (exit status 0)" in caplog.text
    assert SIGTERMException().code is None  # a SystemExit without code: exit status 0
    with pytest.raises(SystemExit) as stopped:
        Preemption([signal.SIGTERM]).stop(False, 7, None, "at step 7")
    assert stopped.value.code is None


def test_after_the_stop_a_repeated_signal_cannot_kill_the_exiting_process():
    originals = {int(signal.SIGTERM): signal.SIG_DFL}  # what Lightning's teardown reinstalls
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    preemption = Preemption([signal.SIGTERM], stop_error=SIGTERMException)
    preemption.install(originals)
    signal.raise_signal(signal.SIGTERM)
    with pytest.raises(SIGTERMException) as stopped:
        preemption.stop(False, 3, None, "after batch 4 of epoch 1")
    preemption.on_exception(originals, stopped.value)
    assert originals[signal.SIGTERM] is module._ignore_while_stopping
    signal.raise_signal(signal.SIGTERM)  # our handler is still there: only the flag
    signal.signal(signal.SIGTERM, originals[signal.SIGTERM])  # Lightning's teardown
    signal.raise_signal(signal.SIGTERM)  # ignored, not fatal
    module._ignore_at_exit([signal.SIGTERM])  # interpreter finalization: ignored outright
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_a_new_fit_after_a_stop_brings_the_default_handler_back():
    originals = {int(signal.SIGTERM): module._ignore_while_stopping}
    signal.signal(signal.SIGTERM, module._ignore_while_stopping)
    preemption = Preemption([signal.SIGTERM])
    preemption.install(originals)
    assert originals[signal.SIGTERM] == signal.SIG_DFL
    preemption.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_any_other_end_of_training_restores_the_handlers():
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    preemption = Preemption([signal.SIGUSR1])
    preemption.install({})
    assert signal.getsignal(signal.SIGUSR1) == preemption._on_signal
    preemption.on_exception({}, ValueError("a training error"))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
