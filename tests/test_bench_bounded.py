"""benchmarks/bounded.py: a benchmark's children never wait forever (``make bench`` once hung
for 9 minutes on 2 forked ranks). A hung child is killed with its group at the deadline, a
failed one takes its peers with it, and the error names the row each child was measuring."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bounded", Path(__file__).resolve().parent.parent / "benchmarks" / "bounded.py"
)
assert _SPEC is not None and _SPEC.loader is not None
bounded = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bounded)

DEADLINE = 8  # seconds: the children reach their hang long before, even on a loaded machine
HANG = "import os, signal; print('row: {row}', flush=True); {then}; signal.pause()"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_hung_child_is_killed_at_the_deadline_naming_its_row(tmp_path):
    pid_file = tmp_path / "pid"
    code = HANG.format(
        row="DCP save, round 2", then=f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
    )
    with pytest.raises(bounded.BenchmarkError) as caught:
        bounded.run_group([["-c", code]], what="sharded, 64 MiB", timeout=DEADLINE)
    message = str(caught.value)
    assert message.startswith(
        "sharded, 64 MiB: no result after 8 s (child 0 at 'DCP save, round 2')"
    )
    assert _pid_gone(int(pid_file.read_text()))


def test_a_failed_child_stops_its_hung_peer(tmp_path):
    hung = HANG.format(row="load, round 0", then="pass")
    failed = "print('row: save, round 1', flush=True); raise SystemExit(3)"
    with pytest.raises(
        bounded.BenchmarkError,
        match=r"^x: child 1 exited with status 3 \(child 0 at '.*'; child 1 at 'save, round 1'\)",
    ):
        bounded.run_group([["-c", hung], ["-c", failed]], what="x", timeout=120)


def test_children_that_succeed_give_their_output():
    assert bounded.run_group([["-c", "print(6 * 7)"]] * 2, what="x", timeout=120) == ["42\n"] * 2
