"""``make demo``: train on the digits, crash for real, start again, continue at epoch N+1.

1. ``examples/train_digits.py`` runs in a subprocess and SIGKILLs itself in the middle of
   epoch 3 (after checkpoints 0, 1 and 2 are complete);
2. what is on disk is shown: the checkpoint directory and ``lightning-bpk inspect`` of one file;
3. the same command runs again: it finds checkpoint 2, restores it through Lightning and goes
   on at epoch 3 until the end (checkpoints 3..5 are written, the oldest collected).

Everything lands in ``./demo-run`` (removed first). Takes well under a minute.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = Path("demo-run")
CRASH_AFTER_EPOCH = 2
COMMAND = [
    sys.executable,
    str(ROOT / "examples" / "train_digits.py"),
    "--base_dir",
    str(RUN_DIR),
    "--gin_file",
    str(ROOT / "lightning_bpk" / "gin" / "digits.gin"),
    "--gin_binding",
    "train.max_epochs = 6",
]
TIMEOUT = 120  # seconds per training run


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def show_disk() -> None:
    checkpoints = RUN_DIR / "checkpoints"
    for path in sorted(checkpoints.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            files = ", ".join(f"{p.name} ({p.stat().st_size} B)" for p in sorted(path.iterdir()))
            print(f"  {path.name}/  {files}")
        else:
            print(f"  {path.name}")


def train(*extra: str) -> int:
    """Run the training script, echoing its lines that matter; return its exit status."""
    process = subprocess.run(
        [*COMMAND, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order it was written
        text=True,
        timeout=TIMEOUT,
    )
    for line in process.stdout.splitlines():
        if line.startswith(("lightning_bpk", "train_digits", "BurnpackCheckpoint")):
            print("  " + line)
    return process.returncode


def main() -> int:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    banner(f"run 1: train, then crash (SIGKILL) in the middle of epoch {CRASH_AFTER_EPOCH + 1}")
    status = train("--stop_after_epoch", str(CRASH_AFTER_EPOCH))
    if status != -signal.SIGKILL:
        print(f"expected the run to be SIGKILLed, got exit status {status}")
        return 1
    print(f"  exit status {status} (killed by SIGKILL)")

    banner(f"on disk after the crash: {RUN_DIR}/checkpoints")
    show_disk()
    trainer_file = RUN_DIR / "checkpoints" / f"ckpt.{CRASH_AFTER_EPOCH}" / "trainer.bpk"
    banner(f"lightning-bpk inspect {trainer_file} (first lines)")
    inspect = subprocess.run(
        [sys.executable, "-m", "lightning_bpk", "inspect", str(trainer_file)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    print("\n".join("  " + line for line in inspect.stdout.splitlines()[:14]))

    banner("run 2: the same command again -> resumes by itself")
    status = train()
    if status != 0:
        print(f"the resumed run failed with exit status {status}")
        return 1

    banner("on disk at the end (newest 4 kept)")
    show_disk()
    return 0


if __name__ == "__main__":
    sys.exit(main())
