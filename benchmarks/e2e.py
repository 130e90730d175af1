"""End-to-end cost of per-epoch checkpoints: the digits example trained with and without them.

Drives ``examples/train_digits.py`` through its API (``DigitsModel``, ``DigitsData``) with the
Trainer settings its ``train()`` uses (and one intra-op thread), in four variants run
interleaved: no checkpoint callback, Lightning's own ``ModelCheckpoint()`` (a torch.save of the
whole dict every epoch), ``BurnpackCheckpoint()`` (synchronous saves) and
``BurnpackCheckpoint(async_save=True)``. Each run is a whole ``trainer.fit`` in a fresh
directory, teardown included (so the async variant pays for waiting on its last write). Two
overheads are reported: the whole fit's (the median over the rounds of the ratio to the same
round's run without a callback), and the per-step one the targets are judged by
(:func:`fabric.step_overhead`: each step's time against its own run's typical step, what recurs
at the same place in every checkpoint period summed). Fits of a few seconds drift by 10-20 %
between runs on these VMs, so whole-fit ratios swing by more than the 2 % target; the per-step
measure does not see that drift. It cannot see a cost spread evenly over every step either (each
variant's typical step is listed beside it, but those drift like whole fits): the callback's
hooks that run at every step, saving or not, are timed apart by :func:`measure_cost`.

The example's epochs are short (~35 ms: 24 batches of a tiny MLP) while each save has a fixed
cost, so a second, clearly labelled measurement passes over the same data ``REPEAT`` times per
epoch (same model, same checkpoint) to show the overhead at a more realistic epoch length. The
time the training thread spends inside each save (``BurnpackCheckpoint._save``: Lightning's
``dump_checkpoint``, building the records, the staging copy) is reported too.

:func:`measure_steps` checkpoints every ``STEP_INTERVAL`` optimizer steps instead (on the longer
epochs), against Lightning's own ``ModelCheckpoint(every_n_train_steps=50)``, and reports what
``every_n_train_steps="auto"`` chose for overhead budgets of 1, 2 and 5 %; the training thread's
time in each save is split into the first save of a run and the later ones.

``benchmarks/save_parts.py`` splits one save: the first asynchronous save of a large state, and
where a digits save's time goes (training thread, writer thread, fsyncs).

``benchmarks/fabric.py`` adds the row of a hand-written Lightning Fabric loop: a checkpoint every
``STEP_INTERVAL`` steps by ``CheckpointManager`` (async and not) against ``fabric.save``.

Run alone (prints the tables; ``make bench`` runs them too and writes ``docs/benchmarks.md``)::

    .venv/bin/python benchmarks/e2e.py            # every end-to-end row (~6 min, 2 idle cores)
    .venv/bin/python benchmarks/e2e.py --quick    # fewer rounds and steps, smaller state
    .venv/bin/python benchmarks/e2e.py --only steps fabric
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import ConcatDataset

from lightning_bpk.lightning.callback import BurnpackCheckpoint

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
import fabric  # noqa: E402  (a sibling: benchmarks/fabric.py)
import train_digits  # noqa: E402  (the example is a script, not a package)

EPOCHS = 20  # the example's default is 10; more epochs, less per-run noise
QUICK_EPOCHS = 10
REPEAT = 10  # data passes per epoch of the "longer epochs" measurement
STEP_INTERVAL = 50  # optimizer steps between checkpoints in measure_steps
STEP_EPOCHS = 4  # of the longer epochs (235 steps each): 18 checkpoints per run
_PAIRED = (  # how the overhead columns are computed (fabric.paired_overhead, step_overhead)
    "Whole-fit overheads are medians over the rounds of the ratio to the same round's run "
    "without checkpoints (teardown and the last save's wait included). Per-step overheads, "
    "the target's measure, are the steady-state cost of a checkpoint period: every step's "
    "time against its own run's typical step, what recurs at the same place in each period "
    "summed (`fabric.step_overhead`), less the same for the run without checkpoints:"
)
_HEADER = [
    "| variant | median fit time | range | whole fit | typical step | added per period "
    "| per step |",
    "|---|---|---|---|---|---|---|",
]
BUDGETS = (0.01, 0.02, 0.05)  # max_overhead values tried with every_n_train_steps="auto"
# Issue 23's bound for async checkpoints per epoch (the longer epochs) and every STEP_INTERVAL
# steps; also below Lightning's ModelCheckpoint in the same run (each row's ``limit``).
OVERHEAD_LIMIT = 0.02


class _RepeatedData(train_digits.DigitsData):
    """The example's data, each epoch passing over the training set ``REPEAT`` times."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_set = ConcatDataset([self.train_set] * REPEAT)


class _Laps(L.Callback):
    """Records the time at the end of every training step (for :func:`fabric.period_cost`)."""

    def __init__(self, laps: list[float]) -> None:
        self.laps = laps

    def on_train_batch_end(self, *args: object) -> None:
        self.laps.append(time.perf_counter())


def _row(
    label: str,
    variant: str,
    times: dict[str, list[float]],
    laps: dict[str, list[list[float]]],
    period: int,
) -> str:
    """``variant``'s row under ``_HEADER``: ``times`` are every variant's fit times, ``laps``
    their step laps, ``period`` the steps between checkpoints."""
    runs, cost = times[variant], fabric.period_cost(laps[variant], period)
    return (
        f"| {label} | {statistics.median(runs):.3f} s | {min(runs):.3f} - {max(runs):.3f} s | "
        f"{fabric.paired_overhead(times, variant) * 100:+.1f} % | {cost.step * 1000:.2f} ms | "
        f"{cost.added * 1000:.1f} ms | {fabric.step_overhead(laps, variant, period) * 100:+.2f} % |"
    )


class _TimedCheckpoint(BurnpackCheckpoint):
    """Records how long each save blocks the training thread (the first save of the run also
    in ``first``, when given)."""

    def __init__(
        self, blocked: list[float], first: list[float] | None = None, **kwargs: object
    ) -> None:
        super().__init__(**kwargs)
        self._blocked, self._first = blocked, first
        self._saved = False

    def _save(self, *args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        super()._save(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if self._first is not None and not self._saved:
            self._first.append(elapsed)
        else:
            self._blocked.append(elapsed)
        self._saved = True


@dataclass
class Overhead:
    """Median fit times per variant and the async variant's overhead over no checkpointing."""

    times: dict[str, list[float]]
    epochs: int
    repeat: int  # passes over the training set per epoch
    blocked: list[float]  # seconds the training thread spent in each async save
    laps: dict[str, list[list[float]]]  # per run, the time at the end of each step

    def median(self, variant: str) -> float:
        return statistics.median(self.times[variant])

    @property
    def period(self) -> int:
        """Steps per epoch (one checkpoint each), counted in the runs' laps."""
        steps = len(self.laps["none"][0])
        assert steps % self.epochs == 0, f"{steps} steps are not {self.epochs} equal epochs"
        return steps // self.epochs

    @property
    def overhead(self) -> float:
        variant = "async" if "async" in self.times else "sync"
        return fabric.step_overhead(self.laps, variant, self.period)

    @property
    def limit(self) -> float:
        """At most ``OVERHEAD_LIMIT``, and below Lightning's ``ModelCheckpoint`` in this run."""
        return min(OVERHEAD_LIMIT, fabric.step_overhead(self.laps, "lightning", self.period))

    def markdown(self) -> list[str]:
        base = self.median("none")
        data = "data" if self.repeat == 1 else f"data passed {self.repeat}x per epoch"
        lines = [
            f"`examples/train_digits.py` model and {data}, {self.epochs} epochs, one "
            f"checkpoint per epoch, {len(self.times['none'])} interleaved runs per variant "
            f"(whole `fit`). An epoch lasts {base / self.epochs * 1000:.0f} ms without "
            "checkpoints; each async save blocks the training thread for "
            f"{statistics.median(self.blocked) * 1000:.1f} ms (median of {len(self.blocked)}; "
            "Lightning's `dump_checkpoint`, building the records, the staging copy). "
            f"{_PAIRED}",
            "",
            *_HEADER,
        ]
        names = {"lightning": "Lightning `ModelCheckpoint()`"}
        for variant in self.times:
            label = names.get(variant, variant)
            lines.append(_row(label, variant, self.times, self.laps, self.period))
        return lines


def _variants(blocked: list[float]) -> dict[str, list[L.Callback]]:
    return {
        "none": [],
        "lightning": [ModelCheckpoint()],  # its default: the last epoch's, every epoch
        "sync": [BurnpackCheckpoint()],
        "async": [_TimedCheckpoint(blocked, async_save=True)],
    }


def _fit(
    root: Path,
    epochs: int,
    callbacks: list[L.Callback],
    repeat: int = 1,
    laps: list[float] | None = None,
) -> float:
    """One whole ``fit`` of the example with ``callbacks``: its wall time; ``laps`` (when given)
    gets the time at the end of every training step."""
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
        callbacks=callbacks if laps is None else [*callbacks, _Laps(laps)],
    )
    # One intra-op thread: the model's ops are far too small to gain from two, and on a shared
    # 2-core machine a second OpenMP thread spin-waits for a descheduled peer (10x the CPU time).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        data = train_digits.DigitsData() if repeat == 1 else _RepeatedData()
        trainer.fit(train_digits.DigitsModel(), datamodule=data)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def measure(directory: Path, *, quick: bool, reps: int | None = None, repeat: int = 1) -> Overhead:
    """Interleaved ``fit`` runs of every variant after one warm-up run each; ``repeat`` passes
    over the training data per epoch."""
    epochs = QUICK_EPOCHS if quick else EPOCHS
    reps = reps or (3 if quick else 7)
    blocked: list[float] = []
    times, laps = _rounds(
        directory,
        lambda: _variants(blocked),
        epochs,
        repeat,
        reps,
        f"end to end (data x{repeat})",
        blocked.clear,  # keep what the measured rounds blocked, not the warm-up's
    )
    return Overhead(times, epochs, repeat, blocked, laps)


def _rounds(
    directory: Path,
    variants: Callable[[], dict[str, list[L.Callback]]],
    epochs: int,
    repeat: int,
    reps: int,
    label: str,
    warmed_up: Callable[[], None],
) -> tuple[dict[str, list[float]], dict[str, list[list[float]]]]:
    """A warm-up round, then ``reps`` rounds of one ``fit`` per variant (fresh callbacks from
    ``variants()``; the order rotates each round): each run's fit time and step laps."""
    names = list(variants())
    times: dict[str, list[float]] = {name: [] for name in names}
    laps: dict[str, list[list[float]]] = {name: [] for name in names}
    for rnd in range(reps + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            run_laps: list[float] = []
            with tempfile.TemporaryDirectory(dir=directory) as root:
                elapsed = _fit(Path(root), epochs, variants()[name], repeat, run_laps)
            if rnd:
                times[name].append(elapsed)
                laps[name].append(run_laps)
        if not rnd:
            warmed_up()
        print(f"  {label}: round {rnd}/{reps} done", flush=True)
    return times, laps


@dataclass
class StepOverhead:
    """Fit times with a checkpoint every ``STEP_INTERVAL`` steps, and what "auto" chose."""

    times: dict[str, list[float]]
    laps: dict[str, list[list[float]]]  # per run, the time at the end of each step
    blocked: list[float]  # seconds the training thread spent in each later async save
    first: list[float]  # ... in the first save of each run
    auto: dict[float, tuple[int | None, int]]  # budget -> (interval chosen, checkpoints saved)
    dumped: list[float]  # ModelCheckpoint's own part at the same steps (see _DumpCost)
    blocked_process: list[float]  # ... each later save with async_save="process"
    first_process: list[float]  # ... its first save of each run
    epochs: int = STEP_EPOCHS
    repeat: int = REPEAT
    what: str = (
        f"training with async checkpoints every {STEP_INTERVAL} steps: overhead (limit: "
        f"{OVERHEAD_LIMIT:.0%}, or Lightning's ModelCheckpoint's in this run if lower)"
    )

    @property
    def overhead(self) -> float:
        return fabric.step_overhead(self.laps, "async", STEP_INTERVAL)

    @property
    def limit(self) -> float:
        """At most ``OVERHEAD_LIMIT``, and below Lightning's ``ModelCheckpoint`` in this run."""
        return min(OVERHEAD_LIMIT, fabric.step_overhead(self.laps, "lightning", STEP_INTERVAL))

    def markdown(self) -> list[str]:
        base = statistics.median(self.times["none"])
        steps = len(self.laps["none"][0])
        lines = [
            f"`examples/train_digits.py` model, data passed {self.repeat}x per epoch, "
            f"{self.epochs} epoch{'s' if self.epochs != 1 else ''} "
            f"({steps} optimizer steps), a "
            f"checkpoint every {STEP_INTERVAL} steps, {len(self.times['none'])} interleaved runs "
            f"per variant. An optimizer step takes {base / steps * 1000:.2f} ms without "
            "checkpoints. Each async save blocks the training thread for "
            f"{statistics.median(self.blocked) * 1000:.1f} ms (median of {len(self.blocked)}; "
            f"range {min(self.blocked) * 1000:.1f} - {max(self.blocked) * 1000:.1f} ms), the "
            f"first save of a run for {statistics.median(self.first) * 1000:.1f} ms (median of "
            f'{len(self.first)}); with `async_save="process"` (the writer process encodes '
            "the loop state and the optimizer) for "
            f"{statistics.median(self.blocked_process) * 1000:.1f} ms (median of "
            f"{len(self.blocked_process)}), and for "
            f"{statistics.median(self.first_process) * 1000:.0f} ms at the first save of a run "
            f"(median of {len(self.first_process)}): it waits for the writer process, started "
            "at setup, to come up (the child imports torch and the script, as `spawn` does), "
            "which a fit this short cannot hide; its whole-fit column counts that once per run. "
            "ModelCheckpoint's own part of a save at the same steps "
            "(`dump_checkpoint` + `torch.save` into memory, before any file is written): "
            f"{statistics.median(self.dumped) * 1000:.1f} ms (median of {len(self.dumped)}). "
            f"{_PAIRED}",
            "",
            *_HEADER,
        ]
        names = {
            "none": "no checkpoints",
            "lightning": f"Lightning `ModelCheckpoint(every_n_train_steps={STEP_INTERVAL})`",
            "async": f"`BurnpackCheckpoint(every_n_train_steps={STEP_INTERVAL}, async_save=True)`",
            "process": (
                f'`BurnpackCheckpoint(every_n_train_steps={STEP_INTERVAL}, async_save="process")`'
            ),
        }
        for variant in self.times:
            lines.append(_row(names[variant], variant, self.times, self.laps, STEP_INTERVAL))
        lines += [
            "",
            '`every_n_train_steps="auto"` (async) on the same run, one run per budget:',
            "",
            "| max_overhead | interval chosen (last) | checkpoints saved |",
            "|---|---|---|",
            *(
                f"| {budget * 100:g} % | {interval} steps | {saved} |"
                for budget, (interval, saved) in self.auto.items()
            ),
        ]
        return lines


class _DumpCost(L.Callback):
    """Times, every ``STEP_INTERVAL`` steps, what Lightning's ``ModelCheckpoint`` does on the
    training thread before it writes a byte: ``dump_checkpoint`` (the whole checkpoint dict)
    and ``torch.save`` of it into memory (``_atomic_save`` serializes into a ``BytesIO``, then
    writes that to the file)."""

    def __init__(self, costs: list[float]) -> None:
        self.costs = costs

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step % STEP_INTERVAL:
            return
        start = time.perf_counter()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        torch.save(checkpoint, io.BytesIO())
        self.costs.append(time.perf_counter() - start)


class _CountingCheckpoint(BurnpackCheckpoint):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.saves = 0

    def _save(self, *args: object, **kwargs: object) -> None:
        super()._save(*args, **kwargs)
        self.saves += 1


def measure_steps(directory: Path, *, quick: bool, reps: int | None = None) -> StepOverhead:
    """Interleaved runs: no checkpoints, Lightning's ModelCheckpoint and ours (a writer thread,
    a writer process) every ``STEP_INTERVAL`` steps; then one "auto" run per budget in
    ``BUDGETS``."""
    reps = reps or (2 if quick else 5)
    epochs = 1 if quick else STEP_EPOCHS
    blocked: list[float] = []
    first: list[float] = []
    blocked_process: list[float] = []
    first_process: list[float] = []

    def variants() -> dict[str, list[L.Callback]]:
        return {
            "none": [],
            "lightning": [ModelCheckpoint(every_n_train_steps=STEP_INTERVAL)],
            "async": [
                _TimedCheckpoint(blocked, first, every_n_train_steps=STEP_INTERVAL, async_save=True)
            ],
            "process": [
                _TimedCheckpoint(
                    blocked_process,
                    first_process,
                    every_n_train_steps=STEP_INTERVAL,
                    async_save="process",
                )
            ],
        }

    def warmed_up() -> None:
        for measured in (blocked, first, blocked_process, first_process):
            measured.clear()

    label = f"every {STEP_INTERVAL} steps"
    times, laps = _rounds(directory, variants, epochs, REPEAT, reps, label, warmed_up)
    auto: dict[float, tuple[int | None, int]] = {}
    for budget in BUDGETS:
        callback = _CountingCheckpoint(
            every_n_train_steps="auto", max_overhead=budget, async_save=True
        )
        with tempfile.TemporaryDirectory(dir=directory) as root:
            _fit(Path(root), epochs, [callback], REPEAT)
        auto[budget] = (callback.auto_interval, callback.saves)
    dumped: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory) as root:
        _fit(Path(root), epochs, [_DumpCost(dumped)], REPEAT)
    return StepOverhead(
        times, laps, blocked, first, auto, dumped[1:], blocked_process, first_process, epochs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="the end-to-end rows of make bench, alone")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller state")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("epochs", "steps", "fabric"),
        default=("epochs", "steps", "fabric"),
    )
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()
    start = time.perf_counter()
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    results: list[Overhead | StepOverhead | fabric.FabricOverhead] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-e2e-") as tmp:
        if "epochs" in args.only:
            results.append(measure(Path(tmp), quick=args.quick))
            if not args.quick:
                results.append(measure(Path(tmp), quick=False, repeat=REPEAT))
        if "steps" in args.only:
            results.append(measure_steps(Path(tmp), quick=args.quick))
        if "fabric" in args.only:  # a hand-written Fabric loop (benchmarks/fabric.py)
            results.append(fabric.measure(Path(tmp), quick=args.quick))
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"took {(time.perf_counter() - start) / 60:.1f} min\n")
    for result in results:
        print("\n".join(result.markdown()), end="\n\n")


if __name__ == "__main__":
    main()
