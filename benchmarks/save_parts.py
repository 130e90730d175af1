"""Where one asynchronous save's time goes, in two measurements.

:func:`measure_first_save` times the first asynchronous save of a large state (a model and its
Adam moments, 1.5 GiB; 96 MiB with ``--quick``) with and without the staging buffers reserved
ahead on the writer thread (what the callback does after the first optimizer step).

:func:`measure_cost` splits one async save of the digits example (a checkpoint every
``e2e.STEP_INTERVAL`` steps, on ``benchmarks/e2e.py``'s longer epochs) into the training
thread's and the writer thread's CPU and wall time, and counts its fsyncs: where the fixed cost
per save goes. It also times the callback's hooks at the steps that do not save.

Run alone (``make bench`` runs the first; the second is for looking into a save)::

    .venv/bin/python benchmarks/save_parts.py             # both (~2 min, 2 idle cores)
    .venv/bin/python benchmarks/save_parts.py --quick     # a smaller state, one epoch
    .venv/bin/python benchmarks/save_parts.py --only cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import e2e
import torch

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

# measure_first_save: LAYERS square float32 Linear layers of WIDTH (+ two Adam moments each)
LAYERS, WIDTH, QUICK_WIDTH = 8, 4096, 1024
STEP_INTERVAL = e2e.STEP_INTERVAL


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


class _CostedCheckpoint(e2e._TimedCheckpoint):
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
        e2e._fit(Path(root), 1, [BurnpackCheckpoint(async_save=True)], 1)  # warm-up
        os.fsync = counted
        try:
            epochs = 1 if quick else e2e.STEP_EPOCHS
            e2e._fit(Path(root) / "measured", epochs, [callback], e2e.REPEAT)
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
    parser = argparse.ArgumentParser(description="where one asynchronous save's time goes")
    parser.add_argument("--quick", action="store_true", help="a smaller state, one epoch")
    parser.add_argument(
        "--only", nargs="+", choices=("first-save", "cost"), default=("first-save", "cost")
    )
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    results: list[FirstSave | SaveCost] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-save-") as tmp:
        if "first-save" in args.only:
            results.append(measure_first_save(Path(tmp), quick=args.quick))
        if "cost" in args.only:
            results.append(measure_cost(Path(tmp), quick=args.quick))
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    for result in results:
        print("\n".join(result.markdown()), end="\n\n")


if __name__ == "__main__":
    main()
