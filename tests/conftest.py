"""What the whole suite shares: the committed fixtures, ``tests/scripts`` on the import path, and
one way to run a subprocess.

Test modules import these names directly (``from conftest import MNIST_BPK, run_process``):
pytest has already imported this file as the module ``conftest`` before it collects them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPTS = TESTS / "scripts"
FIXTURES = TESTS / "fixtures"
# Burn's own MNIST model (see tests/fixtures/README.md): the one file no code of ours wrote.
MNIST_BPK = FIXTURES / "burn" / "mnist-model.bpk"

# The fuzz harness needs atheris, which the suite does not install; --doctest-modules would
# import it (tests/scripts import fine: they only run when started as scripts).
collect_ignore = ["fuzz"]

# The helper scripts (lightning_tiny, crash_saver) are both run as scripts and imported by tests.
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


@dataclass(frozen=True)
class Finished:
    """A subprocess that ran to its end (or was killed): what ``run_process`` returns."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    pid: int


def run_process(
    command: Sequence[object],
    *,
    timeout: float = 120,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
    check: bool = False,
) -> Finished:
    """Run ``command`` to its end and return its exit status and text output.

    It runs in a session of its own, so a timeout kills the whole process group (a Lightning
    DDP run's other ranks, a script's children) and fails the test with the tail of stderr
    instead of hanging the suite. ``stderr`` may be a file descriptor (a pty, say);
    ``check=True`` fails the test on a non-zero exit status.
    """
    args = [str(part) for part in command]
    process = subprocess.Popen(
        args,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{args} still running after {timeout}s, killed:\n{(err or '')[-3000:]}")
    result = Finished(args, process.returncode, out, err or "", process.pid)
    if check and result.returncode != 0:
        pytest.fail(f"{args} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result
