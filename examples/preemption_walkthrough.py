"""Preemption, step by step: SIGTERM a training run, watch it save and exit 0, resume it.

This is what a cluster scheduler (SLURM at the time limit, Kubernetes, SageMaker spot) does to a
job: it sends SIGTERM and, a little later, SIGKILL. ``BurnpackCheckpoint`` turns SIGTERM (and
SIGUSR1) into "save at the next batch end, then stop cleanly":

1. ``examples/train_digits.py`` starts in a subprocess; as soon as it reports checkpoint 1, this
   script sends it SIGTERM, so the signal lands early in epoch 2;
2. the run saves checkpoint 2 after the batch it is in and exits with status 0;
3. the directory is listed with ``lightning-bpk ls``, and checkpoint 2 is shown to be marked as
   a mid-epoch (preemption) save;
4. the same command runs again: it resumes from checkpoint 2 with the next batch of epoch 2's
   shuffled order (no batch replayed or skipped), and trains to the end.

Run: ``.venv/bin/python examples/preemption_walkthrough.py [--base_dir runs/preemption]``
(the directory is emptied first). Takes about 20-40 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from lightning_bpk.lightning import trainer_state

ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 4  # epochs 0-3: long enough to be interrupted in epoch 2, short enough for a demo
SIGNAL_AFTER_CHECKPOINT = 1  # send SIGTERM once this checkpoint is saved
TIMEOUT_S = 120  # per training run; a healthy run takes seconds
# Lines worth showing from the training process (its own and lightning_bpk's log lines).
SHOWN_PREFIXES = ("lightning_bpk", "train_digits")


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def training_command(base_dir: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "examples" / "train_digits.py"),
        "--base_dir",
        str(base_dir),
        "--gin_file",
        str(ROOT / "lightning_bpk" / "gin" / "digits.gin"),
        "--gin_binding",
        f"train.max_epochs = {EPOCHS}",
    ]


def run_training(base_dir: Path, signal_after: int | None = None) -> int:
    """Run the training script, echo its log lines, optionally SIGTERM it once checkpoint
    ``signal_after`` is saved; return its exit status."""
    process = subprocess.Popen(
        training_command(base_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    try:
        for line in process.stdout:
            if line.startswith(SHOWN_PREFIXES):
                print("  | " + line.rstrip(), flush=True)
            if signal_after is not None and f"saved checkpoint {signal_after} " in line:
                process.send_signal(signal.SIGTERM)
                print(f"  >>> sent SIGTERM to pid {process.pid}", flush=True)
                signal_after = None
        return process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:  # only on an error above: do not leave it running
            process.kill()
            process.wait()


def lightning_bpk(*args: str) -> None:
    """Run the ``lightning-bpk`` command line and show its output."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_bpk", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    print("\n".join("  " + line for line in result.stdout.splitlines()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_dir", type=Path, default=Path("runs") / "preemption")
    args = parser.parse_args(argv)
    base_dir: Path = args.base_dir
    checkpoints = base_dir / "checkpoints"
    shutil.rmtree(base_dir, ignore_errors=True)

    banner(f"run 1: train {EPOCHS} epochs; SIGTERM once checkpoint 1 is saved")
    status = run_training(base_dir, signal_after=SIGNAL_AFTER_CHECKPOINT)
    print(f"  exit status {status}", "(a clean stop)" if status == 0 else "(unexpected!)")
    if status != 0:
        return 1

    banner(f"lightning-bpk ls {checkpoints}")
    lightning_bpk("ls", str(checkpoints))
    latest = max(int(p.name.split(".")[1]) for p in checkpoints.glob("ckpt.*"))
    saved = trainer_state.load(checkpoints / f"ckpt.{latest}")
    print(
        f"\n  checkpoint {latest}: epoch {saved['epoch']}, global_step {saved['global_step']}, "
        f"preempted: {saved.get(trainer_state.PREEMPTED_KEY)}"
    )

    banner("run 2: the same command again -> resumes by itself")
    status = run_training(base_dir)
    print(f"  exit status {status}")
    if status != 0:
        return 1

    banner(f"lightning-bpk ls {checkpoints} (the end-of-epoch save replaced the mid-epoch one)")
    lightning_bpk("ls", str(checkpoints))
    return 0


if __name__ == "__main__":
    sys.exit(main())
