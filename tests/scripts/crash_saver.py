"""A checkpoint saver to SIGKILL, and the checks to run on its directory afterwards.

Run as a script it saves iterations ``--start``, ``--start + 1``, ... into ``BASE`` with
:class:`~lightning_bpk.checkpointer.Checkpointer` (the settings in :data:`SETTINGS`), printing
``ready`` once imported and each iteration number once its save returned. It is killed either

- from outside, at a random moment (the parent sends SIGKILL after a random delay), or
- by itself with ``--kill-at K``: just before its K-th filesystem operation (``write``,
  ``fsync``, ``mkdir``, ``rename``/``replace``/``link``, ``unlink``/``rmdir``), so every step of the
  publish sequence and of garbage collection can be hit on purpose. It is still a real SIGKILL
  of a real process: nothing after that point runs, no ``finally``, no atexit.

The importable half (:func:`payload`, :func:`check_after_kill`, :func:`run_kill`) is shared
by ``tests/test_checkpointer_crash.py`` (a handful of kills) and ``benchmarks/crash_soak.py``
(hundreds).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import _fs
from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    get_latest_checkpoint_number,
)
from lightning_bpk.records import StateRecord

# Short retention with keep_every, so kills also land in garbage collection and its sparing.
SETTINGS = {"checkpoint_frequency": 1, "checkpoint_duration": 3, "keep_every": 4}
# The operations --kill-at counts: every kind of step the publish sequence and GC consist of.
_KILL_POINTS = ("fsync", "mkdir", "rename", "replace", "link", "unlink", "rmdir")
# Tensor sizes: big enough that writing takes a measurable part of a save, small enough that
# a save takes milliseconds (the default suite must stay fast).
_MODEL_NUMEL = 64 * 1024
_OPTIM_NUMEL = 16 * 1024
SCRIPT = Path(__file__).resolve()


def payload(n: int) -> dict[str, Any]:
    """Iteration ``n``'s data: different bytes for every n, so a mixed-up load cannot pass."""
    g = torch.Generator().manual_seed(n)
    return {
        "model": {"w": torch.randn(_MODEL_NUMEL, generator=g), "b": torch.arange(n, n + 7)},
        "optim": StateRecord({"step": n, "exp_avg": torch.rand(_OPTIM_NUMEL, generator=g)}),
        "trainer": {"iteration": n, "name": f"it{n}", "loss": n / 7, "rng": (n, None, True)},
    }


def assert_same(expected: Any, actual: Any, where: str = "$") -> None:
    """Bit-exact equality for nested data with tensors (type, dtype, shape and bytes)."""
    if isinstance(expected, StateRecord):
        expected = expected.value
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def sentinel_numbers(base: Path) -> list[int]:
    """Numbers of every canonical sentinel in ``base``."""
    stem = "sentinel_checkpoint_complete."
    return sorted(
        int(p.name[len(stem) :])
        for p in base.iterdir()
        if p.name.startswith(stem) and p.name[len(stem) :].isdigit()
    )


def check_after_kill(base: Path) -> int:
    """The invariants after a kill; returns the latest complete iteration (-1 if none).

    Every sentinel has its data and verifies; the quick and the verifying search agree without
    a single warning (a process kill damages nothing already published); the latest checkpoint
    loads bit-exactly.
    """
    checkpointer = Checkpointer(base, **SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        for n in sentinel_numbers(base):
            assert checkpointer.checkpoint_path(n).is_dir(), f"sentinel {n} without its data"
            assert checkpointer.verify_checkpoint(n) == [], f"checkpoint {n} does not verify"
        latest = get_latest_checkpoint_number(base)
        assert get_latest_checkpoint_number(base, verify=True) == latest
    if latest >= 0:
        assert_same(payload(latest), checkpointer.load_checkpoint(latest))
    return latest


def expected_retention(last: int) -> set[int]:
    """What an uninterrupted run 0..last keeps under :data:`SETTINGS` (Dopamine's rule)."""
    f, d, k = (
        SETTINGS["checkpoint_frequency"],
        SETTINGS["checkpoint_duration"],
        SETTINGS["keep_every"],
    )
    return {m for m in range(0, last + 1, f) if m > last - f * d or m % (k * f) == 0}


def _spawn(base: Path, start: int, count: int, kill_at: int | None) -> subprocess.Popen:
    args = [sys.executable, str(SCRIPT), str(base), "--start", str(start), "--count", str(count)]
    if kill_at is not None:
        args += ["--kill-at", str(kill_at)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def run_kill(
    base: Path, rng: random.Random, *, kill_at: int | None = None, max_delay: float = 0.4
) -> dict[str, Any]:
    """One saver run that ends in SIGKILL, then :func:`check_after_kill`.

    Resumes like a trainer: from the latest checkpoint + 1, or (one run in four) by re-saving
    the latest, which exercises replacing a complete checkpoint. ``kill_at`` None: killed from
    outside after a random delay once the saver is ready. Returns what happened: the kill point
    (``"timed"`` or the operation it preceded), whether it re-saved, saves completed, latest
    before and after.
    """
    before = get_latest_checkpoint_number(base)
    start = before if before >= 0 and rng.random() < 0.25 else before + 1
    proc = _spawn(base, start, 10_000 if kill_at is None else 50, kill_at)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    if kill_at is None:
        time.sleep(rng.uniform(0, max_delay))
        proc.send_signal(signal.SIGKILL)
    lines = proc.stdout.read().splitlines()
    saved = [int(line) for line in lines if line.isdigit()]
    point = next((line.split()[1] for line in lines if line.startswith("kill-before")), "timed")
    returncode = proc.wait()
    assert returncode == -signal.SIGKILL, f"saver exited with {returncode}, not by SIGKILL"
    latest = check_after_kill(base)
    # The save in flight may or may not have committed; nothing earlier may be lost.
    if saved:
        assert latest in (saved[-1], saved[-1] + 1), (saved, latest)
    elif start > before:
        assert latest in (before, start), (before, start, latest)
    else:  # killed while re-saving the latest: it or an older kept one survives
        assert 0 <= latest <= before, (before, latest)
    return {
        "point": point,
        "resave": start <= before,
        "saved": len(saved),
        "before": before,
        "latest": latest,
    }


def finish_and_check(base: Path, saves: int = 6) -> int:
    """Run the saver to completion from the latest + 1; then no temporaries may remain and
    exactly the retention rule's checkpoints exist. Returns the last iteration saved."""
    start = get_latest_checkpoint_number(base) + 1
    proc = _spawn(base, start, saves, None)
    out, _ = proc.communicate()
    assert proc.returncode == 0, f"saver failed with {proc.returncode}"
    last = start + saves - 1
    assert int(out.split()[-1]) == last
    leftovers = [p.name for p in base.iterdir() if p.name.endswith(_fs.SCRATCH_SUFFIX)]
    assert leftovers == [], leftovers
    # GC swept everything the rule deletes; the final run's own last d saves are all there.
    kept = set(sentinel_numbers(base))
    assert kept <= expected_retention(last), sorted(kept - expected_retention(last))
    assert set(range(last - SETTINGS["checkpoint_duration"] + 1, last + 1)) <= kept
    assert check_after_kill(base) == last
    return last


def _arm_self_kill(kill_at: int) -> None:
    """Replace the counted operations with versions that SIGKILL this process at call K."""
    calls = 0

    def counted(fn: Any, name: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == kill_at:
                print(f"kill-before {name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapper

    for name in _KILL_POINTS:
        setattr(os, name, counted(getattr(os, name), name))
    _fs.write_all = counted(_fs.write_all, "write")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    checkpointer = Checkpointer(args.base, **SETTINGS)
    if args.kill_at is not None:
        _arm_self_kill(args.kill_at)
    print("ready", flush=True)
    for i in range(args.count):
        n = args.start + i
        checkpointer.save_checkpoint(n, payload(n))
        print(n, flush=True)


if __name__ == "__main__":
    main()
