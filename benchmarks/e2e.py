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

:func:`measure_first_save` times the first asynchronous save of a large state (a model and its
Adam moments, 1.5 GiB; 96 MiB with ``--quick``) with and without the staging buffers reserved
ahead on the writer thread (what the callback does after the first optimizer step).

:func:`measure_cost` splits one async save (every ``STEP_INTERVAL`` steps) into the training
thread's and the writer thread's CPU and wall time, and counts its fsyncs: where the fixed cost
per save goes.

``benchmarks/fabric.py`` adds the row of a hand-written Lightning Fabric loop: a checkpoint every
``STEP_INTERVAL`` steps by ``CheckpointManager`` (async and not) against ``fabric.save``.

Run alone (prints the tables; ``make bench`` runs them too and writes ``docs/benchmarks.md``)::

    .venv/bin/python benchmarks/e2e.py            # every end-to-end row (~6 min, 2 idle cores)
    .venv/bin/python benchmarks/e2e.py --quick    # fewer rounds and steps, smaller state
    .venv/bin/python benchmarks/e2e.py --only steps first-save
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

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

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
# measure_first_save: LAYERS square float32 Linear layers of WIDTH (+ two Adam moments each)
LAYERS, WIDTH, QUICK_WIDTH = 8, 4096, 1024


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
            f"{len(self.first)}). ModelCheckpoint's own part of a save at the same steps "
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
    """Interleaved runs: no checkpoints, Lightning's ModelCheckpoint and ours every
    ``STEP_INTERVAL`` steps; then one "auto" run per budget in ``BUDGETS``."""
    reps = reps or (2 if quick else 5)
    epochs = 1 if quick else STEP_EPOCHS
    blocked: list[float] = []
    first: list[float] = []

    def variants() -> dict[str, list[L.Callback]]:
        return {
            "none": [],
            "lightning": [ModelCheckpoint(every_n_train_steps=STEP_INTERVAL)],
            "async": [
                _TimedCheckpoint(blocked, first, every_n_train_steps=STEP_INTERVAL, async_save=True)
            ],
        }

    def warmed_up() -> None:
        blocked.clear()
        first.clear()

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
    return StepOverhead(times, laps, blocked, first, auto, dumped[1:], epochs)


@dataclass
class FirstSave:
    """The training thread's time in the first async saves of a large state."""

    nbytes: int  # model and optimizer state
    unreserved: float  # first save, staging buffers allocated and faulted in on this thread
    reserve: float  # writer thread: reserving (allocating and faulting in) those buffers
    reserved: float  # first save after the reservation: a copy
    steady: float  # the save after that

    def markdown(self) -> list[str]:
        gib = self.nbytes / 2**30
        return [
            f"First asynchronous save of a {gib:.2f} GiB state ({LAYERS} float32 Linear layers "
            "and their Adam moments, `AsyncCheckpointSaver` into a `Checkpointer`): the time "
            "the training thread spends in `save_checkpoint`, records built from the live "
            "objects included:",
            "",
            "| save | blocks the training thread |",
            "|---|---|",
            f"| first save, staging allocated on the training thread | "
            f"{self.unreserved * 1000:.0f} ms |",
            f"| staging reserved ahead on the writer thread (not blocking) | "
            f"{self.reserve * 1000:.0f} ms |",
            f"| first save after the reservation | {self.reserved * 1000:.0f} ms |",
            f"| next save | {self.steady * 1000:.0f} ms |",
        ]


def _adam_state(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``LAYERS`` square layers after one Adam step (so the moments exist)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def measure_first_save(directory: Path, *, quick: bool) -> FirstSave:
    """The first async save of a fresh saver without, then with, the staging reserved ahead."""
    model, optimizer = _adam_state(QUICK_WIDTH if quick else WIDTH)

    def records() -> dict[str, object]:
        return {
            "model": ModuleRecord.from_module(model),
            "optim": OptimizerRecord.from_optimizer(optimizer, model),
        }

    def save(saver: AsyncCheckpointSaver, checkpointer: Checkpointer, n: int) -> float:
        start = time.perf_counter()
        saver.save_checkpoint(checkpointer, n, records())
        elapsed = time.perf_counter() - start
        saver.wait()
        return elapsed

    times = []
    for reserve in (False, True):
        with tempfile.TemporaryDirectory(dir=directory) as root:
            checkpointer = Checkpointer(root, checkpoint_duration=1)
            with AsyncCheckpointSaver() as saver:
                start = time.perf_counter()
                if reserve:
                    saver.reserve(records())
                    saver.wait()
                reserving = time.perf_counter() - start
                times.append((save(saver, checkpointer, 0), reserving))
                if reserve:
                    steady = save(saver, checkpointer, 1)
                nbytes = saver.staging.nbytes
        print(f"  first save ({'reserved' if reserve else 'not reserved'}) done", flush=True)
    (unreserved, _), (reserved, reserving) = times
    return FirstSave(nbytes, unreserved, reserving, reserved, steady)


class _CostedCheckpointer(Checkpointer):
    """Records the writer thread's CPU and wall time of each commit (the whole write)."""

    def __init__(self, costs: list[tuple[float, float]], like: Checkpointer) -> None:
        super().__init__(
            like.base_directory,
            like.checkpoint_file_prefix,
            like.sentinel_file_identifier,
            like.checkpoint_frequency,
            like.checkpoint_duration,
            like.keep_every,
        )
        self.costs = costs

    def save_checkpoint(self, *args: object, **kwargs: object) -> object:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return super().save_checkpoint(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            self.costs.append((time.thread_time() - cpu, time.perf_counter() - wall))


class _CostedCheckpoint(_TimedCheckpoint):
    """The training thread's CPU time in each save, its checkpointer's writer costs, and the
    wall time of its hooks that run at every step (saving or not)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__([], **kwargs)
        self.cpu: list[float] = []
        self.writer: list[tuple[float, float]] = []
        self.hooks: list[float] = []  # per step that did not save: seconds in its hooks
        self._started = 0.0

    def on_train_batch_start(self, *args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)  # type: ignore[arg-type]
        self._started = time.perf_counter() - start

    def on_train_batch_end(self, *args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        saves = len(self.cpu)
        super().on_train_batch_end(*args, **kwargs)  # type: ignore[arg-type]
        if len(self.cpu) == saves:  # a step that saved is counted in the rows of its save
            self.hooks.append(self._started + time.perf_counter() - start)

    def _save(self, *args: object, **kwargs: object) -> None:
        cpu = time.thread_time()
        super()._save(*args, **kwargs)
        self.cpu.append(time.thread_time() - cpu)

    def _make_checkpointer(self, dirpath: object, **overrides: object) -> Checkpointer:
        like = super()._make_checkpointer(dirpath, **overrides)  # type: ignore[arg-type]
        return _CostedCheckpointer(self.writer, like)


@dataclass
class SaveCost:
    """Where one async save's time goes (the every-STEP_INTERVAL-steps run), per save."""

    training_cpu: list[float]  # the training thread's CPU time in the save
    training_wall: list[float]  # ... and its wall time (blocked)
    writer_cpu: list[float]  # the writer thread's CPU time (the commit, every file)
    writer_wall: list[float]
    syncs: float  # fsync calls per save
    hooks: list[float]  # the callback's hooks, per step that did not save

    def markdown(self) -> list[str]:
        def ms(values: list[float]) -> str:
            return f"{statistics.median(values) * 1000:.2f} ms"

        return [
            f"Where an async save of the digits example goes (a checkpoint every {STEP_INTERVAL} "
            f"steps, medians of {len(self.training_cpu)} saves): thread CPU time is what "
            "competes with training for the cores and the GIL; wall time includes waiting "
            "(fsyncs, the GIL).",
            "",
            "| | CPU | wall |",
            "|---|---|---|",
            f"| training thread (blocked in the save) | {ms(self.training_cpu)} | "
            f"{ms(self.training_wall)} |",
            f"| writer thread (files, fsyncs, sentinel, retention) | {ms(self.writer_cpu)} | "
            f"{ms(self.writer_wall)} |",
            f"| fsync calls per save | {self.syncs:.1f} | |",
            f"| every step that does not save: the callback's hooks (median of "
            f"{len(self.hooks)}) | | {statistics.median(self.hooks) * 1e6:.1f} µs |",
        ]


def measure_cost(directory: Path, *, quick: bool) -> SaveCost:
    """One instrumented run with a checkpoint every ``STEP_INTERVAL`` steps (after a warm-up)."""
    calls = [0]
    fsync = os.fsync

    def counted(fd: int) -> None:
        calls[0] += 1
        fsync(fd)

    callback = _CostedCheckpoint(every_n_train_steps=STEP_INTERVAL, async_save=True)
    with tempfile.TemporaryDirectory(dir=directory) as root:
        _fit(Path(root), 1, [BurnpackCheckpoint(async_save=True)], 1)  # warm-up
        os.fsync = counted
        try:
            _fit(Path(root) / "measured", 1 if quick else STEP_EPOCHS, [callback], REPEAT)
        finally:
            os.fsync = fsync
    writer = callback.writer
    return SaveCost(
        callback.cpu,
        callback._blocked,
        [cpu for cpu, _ in writer],
        [wall for _, wall in writer],
        calls[0] / max(1, len(writer)),
        callback.hooks,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="the end-to-end rows of make bench, alone")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller state")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("epochs", "steps", "first-save", "fabric", "cost"),
        default=("epochs", "steps", "first-save", "fabric", "cost"),
    )
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()
    start = time.perf_counter()
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    results: list[Overhead | StepOverhead | FirstSave | fabric.FabricOverhead | SaveCost] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-e2e-") as tmp:
        if "epochs" in args.only:
            results.append(measure(Path(tmp), quick=args.quick))
            if not args.quick:
                results.append(measure(Path(tmp), quick=False, repeat=REPEAT))
        if "steps" in args.only:
            results.append(measure_steps(Path(tmp), quick=args.quick))
        if "first-save" in args.only:
            results.append(measure_first_save(Path(tmp), quick=args.quick))
        if "fabric" in args.only:  # a hand-written Fabric loop (benchmarks/fabric.py)
            results.append(fabric.measure(Path(tmp), quick=args.quick))
        if "cost" in args.only:
            results.append(measure_cost(Path(tmp), quick=args.quick))
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"took {(time.perf_counter() - start) / 60:.1f} min\n")
    for result in results:
        print("\n".join(result.markdown()), end="\n\n")


if __name__ == "__main__":
    main()
