"""End-to-end cost of per-epoch checkpoints: the digits example trained with and without them.

Drives ``examples/train_digits.py`` through its API (``DigitsModel``, ``DigitsData``) with the
Trainer settings its ``train()`` uses, in three variants run interleaved: no checkpoint callback,
``BurnpackCheckpoint()`` (synchronous saves) and ``BurnpackCheckpoint(async_save=True)``. Each
run is a whole ``trainer.fit`` in a fresh directory, teardown included (so the async variant
pays for waiting on its last write). The overhead is the median's excess over no callback.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L

from lightning_bpk.callback import BurnpackCheckpoint

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
import train_digits  # noqa: E402  (the example is a script, not a package)

EPOCHS = 20  # the example's default is 10; more epochs, less per-run noise
QUICK_EPOCHS = 10


@dataclass
class Overhead:
    """Median fit times per variant and the async variant's overhead over no checkpointing."""

    times: dict[str, list[float]]
    epochs: int

    def median(self, variant: str) -> float:
        return statistics.median(self.times[variant])

    @property
    def overhead(self) -> float:
        best = "async" if "async" in self.times else "sync"
        return self.median(best) / self.median("none") - 1

    def markdown(self) -> list[str]:
        base = self.median("none")
        lines = [
            f"`examples/train_digits.py` model and data, {self.epochs} epochs, one checkpoint "
            f"per epoch, {len(self.times['none'])} interleaved runs per variant (whole `fit`):",
            "",
            "| variant | median fit time | range | overhead |",
            "|---|---|---|---|",
        ]
        for variant, times in self.times.items():
            med = statistics.median(times)
            lines.append(
                f"| {variant} | {med:.3f} s | {min(times):.3f} - {max(times):.3f} s | "
                f"{(med / base - 1) * 100:+.1f} % |"
            )
        return lines


def _variants() -> dict[str, list[L.Callback]]:
    variants = {"none": [], "sync": [BurnpackCheckpoint()]}
    if "async_save" in inspect.signature(BurnpackCheckpoint).parameters:
        variants["async"] = [BurnpackCheckpoint(async_save=True)]
    return variants


def _fit(root: Path, epochs: int, callbacks: list[L.Callback]) -> float:
    L.seed_everything(0, workers=True, verbose=False)
    trainer = L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # no default ModelCheckpoint: only the variant's callback saves (Lightning refuses
        # enable_checkpointing=False beside a Checkpoint callback)
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(train_digits.DigitsModel(), datamodule=train_digits.DigitsData())
    return time.perf_counter() - start


def measure(directory: Path, *, quick: bool, reps: int | None = None) -> Overhead:
    """Interleaved ``fit`` runs of every variant after one warm-up run each."""
    epochs = QUICK_EPOCHS if quick else EPOCHS
    reps = reps or (3 if quick else 7)
    names = list(_variants())
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(reps + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            with tempfile.TemporaryDirectory(dir=directory) as root:
                elapsed = _fit(Path(root), epochs, _variants()[name])
            if rnd:
                times[name].append(elapsed)
        print(f"  end to end: round {rnd}/{reps} done", flush=True)
    return Overhead(times, epochs)
