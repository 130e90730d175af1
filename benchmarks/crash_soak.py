"""Crash soak: SIGKILL a real checkpoint saver hundreds of times and check every aftermath.

Each run resumes like a trainer (latest + 1, or one in four re-saves the latest) and is killed
either at a random moment or just before a random filesystem operation (write, fsync, mkdir,
rename/replace/link, unlink/rmdir). After every kill the directory must satisfy
``tests/scripts/crash_saver.py:check_after_kill``: every sentinel has its data and verifies, the
quick and the verifying search agree with no warning, and the latest loads bit-exactly. Every
50 kills (and at the end) the saver runs to completion and no temporary may remain.

    .venv/bin/python benchmarks/crash_soak.py --kills 200 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "crash_saver.py"
_SPEC = importlib.util.spec_from_file_location("crash_saver", _SCRIPT)
assert _SPEC is not None and _SPEC.loader is not None
crash_saver = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(crash_saver)

# Operations in the first two or three saves of a run (25-33 per save): the kill point range.
OPS_RANGE = (1, 90)
# Timed kills land anywhere in up to this many seconds of back-to-back saves.
MAX_DELAY = 0.5
# Run the saver to completion this often, to check the cleanup of temporaries and retention.
FINISH_EVERY = 50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="default: a fresh temp dir")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    base = args.dir or Path(tempfile.mkdtemp(prefix="crash-soak-"))
    points: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for i in range(1, args.kills + 1):
        kill_at = rng.randint(*OPS_RANGE) if rng.random() < 0.5 else None
        try:
            result = crash_saver.run_kill(base, rng, kill_at=kill_at, max_delay=MAX_DELAY)
        except AssertionError as e:
            print(f"FAILED at kill {i} (seed {args.seed}, dir {base}): {e}", file=sys.stderr)
            return 1
        points[result["point"]] += 1
        if result["resave"]:
            outcomes["re-save killed"] += 1
            if result["latest"] < result["before"]:
                outcomes["re-save killed in its swap window (fell back)"] += 1
        outcomes["saves completed before the kill"] += result["saved"]
        if i % FINISH_EVERY == 0 or i == args.kills:
            crash_saver.finish_and_check(base)
            outcomes["clean finishes (no temporaries, nothing kept beyond the retention rule)"] += 1
    elapsed = time.perf_counter() - started
    print(f"crash soak: {args.kills} SIGKILLs, seed {args.seed}, {elapsed:.0f} s, dir {base}")
    print("kill points: " + ", ".join(f"{k} {v}" for k, v in sorted(points.items())))
    for k, v in outcomes.items():
        print(f"  {k}: {v}")
    print(f"latest checkpoint now: {crash_saver.check_after_kill(base)}; all invariants held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
