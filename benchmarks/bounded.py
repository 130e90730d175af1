"""The benchmarks' child processes: fresh interpreters, one process group, a deadline.

A child is never forked from the benchmark process (which has run threads by then: the async
saver, torch's pools, a fork would copy a lock one of them holds and wait on it forever); each is
started as ``sys.executable`` with its arguments, all of one call in one new process group. If
one exits with an error, or the deadline passes, the whole group is killed and
:class:`BenchmarkError` says which benchmark (``what``) failed, and the last progress line
(``row: ...``, see :func:`row`) each child printed: the row it was measuring.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROW_PREFIX = "row: "
POLL_SECONDS = 0.2


class BenchmarkError(RuntimeError):
    """A benchmark's child failed or ran past its deadline; the message names the row."""


def row(label: str) -> None:
    """Print the row this child measures now (on stdout, flushed): what a failure reports."""
    print(f"{ROW_PREFIX}{label}", flush=True)


def _last_row(output: str) -> str:
    rows = [line[len(ROW_PREFIX) :] for line in output.splitlines() if line.startswith(ROW_PREFIX)]
    return rows[-1] if rows else "before its first row"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every member has exited and been reaped
        os.killpg(pgid, signal.SIGKILL)


def run_group(
    commands: Sequence[Sequence[str]], *, what: str, timeout: float, cwd: str | Path | None = None
) -> list[str]:
    """Run each of ``commands`` (arguments for a fresh ``sys.executable``) at once in one new
    process group; every child's stdout once all succeeded. A failure or ``timeout`` seconds
    without all of them done kills the group and raises :class:`BenchmarkError`."""
    with tempfile.TemporaryDirectory(prefix="lightning-bpk-bench-child-") as logs:
        outputs = [Path(logs) / f"{i}.out" for i in range(len(commands))]
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for command, out in zip(commands, outputs, strict=True):
                with open(out, "wb") as sink:
                    processes.append(
                        subprocess.Popen(
                            [sys.executable, *command],
                            cwd=cwd,
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            process_group=processes[0].pid if processes else 0,
                        )
                    )
            failure = _wait(processes, timeout)
        finally:
            if processes:
                _kill_group(processes[0].pid)  # what is left (nothing, after a success)
                for p in processes:
                    p.wait()
        texts = [out.read_text(errors="replace") for out in outputs]
    if failure is not None:
        at = "; ".join(f"child {i} at {_last_row(t)!r}" for i, t in enumerate(texts))
        tails = "\n".join(f"--- child {i}:\n{t[-2000:]}" for i, t in enumerate(texts))
        raise BenchmarkError(f"{what}: {failure} ({at}); its process group was killed\n{tails}")
    return texts


def _wait(processes: Sequence[subprocess.Popen[bytes]], timeout: float) -> str | None:
    """None once every process exited 0; else what went wrong (the first error, or the time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                return f"child {i} exited with status {code}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_SECONDS)
    return f"no result after {timeout:.0f} s"
