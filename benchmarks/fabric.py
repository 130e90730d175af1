"""The Fabric row of ``make bench``: what a checkpoint every 50 steps costs a hand-written loop.

A Lightning Fabric loop (one device, one intra-op thread) trains an MLP of ~1.6 M parameters
(AdamW: ~19 MiB of model and optimizer state) on in-memory data through a
``ResumableLoader``, in four variants run interleaved: no checkpoints;
``fabric.save(path, state)`` with Fabric's default plugin (``torch.save``, a new file every
``STEP_INTERVAL`` steps, as litgpt saves); ``CheckpointManager.save_if_due`` synchronous; and
the same with ``async_save=True``. Every saving variant saves the same state (model, optimizer,
the loader's position, the step). Each run is a whole loop in a fresh directory, ending with the
write in flight waited for (``manager.close()``). A round runs every variant once, back to back
(the order rotates). Two overheads are reported:

- **whole loop**: the median over the rounds of a variant's loop time over that round's loop
  without checkpoints (the load of other processes on a shared machine drifts from minute to
  minute; back-to-back runs cancel some of it, not all: these ratios swing by several percent);
- **per step** (:func:`step_overhead`, the target's measure): the time at the end of every step
  is recorded, each step is compared with its own run's typical step, and what recurs at the
  same place in every checkpoint period is summed. It is the steady-state cost of a save, what
  a run of days pays, without the drift between runs (the last save's wait is left out).

The loop thread's CPU time (``time.thread_time``: what the saves take from the loop itself,
whatever else runs) is reported beside them. The target is the issue's: the async manager costs
at most ``LIMIT`` of the loop's time and no more than ``fabric.save``.

Run alone (``make bench`` runs it too, through ``benchmarks/run.py``)::

    .venv/bin/python benchmarks/fabric.py            # ~5 min on 2 idle cores
    .venv/bin/python benchmarks/fabric.py --quick    # fewer steps and rounds
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bpk.fabric import CheckpointManager, ResumableLoader

STEP_INTERVAL = 50  # optimizer steps between checkpoints
LIMIT = 0.02  # the bound on the async manager's overhead
STEPS, QUICK_STEPS = 300, 150
WIDTH, BATCH = 768, 128  # ~1.6 M parameters; a step takes tens of milliseconds on one thread
VARIANTS = {
    "none": "no checkpoints",
    "fabric.save": f"`fabric.save` every {STEP_INTERVAL} steps (default plugin: `torch.save`)",
    "sync": f"`CheckpointManager(every_n_train_steps={STEP_INTERVAL})`",
    "async": f"`CheckpointManager(every_n_train_steps={STEP_INTERVAL}, async_save=True)`",
}


def paired_overhead(runs: dict[str, list[float]], variant: str, base: str = "none") -> float:
    """The median over the rounds of ``variant``'s time over the same round's ``base`` time,
    minus one. Runs of a few seconds on these VMs drift by 10-20 % between rounds (other
    tenants); a round's variants run back to back, so their ratio cancels most of the drift
    that a ratio of medians taken across rounds keeps."""
    pairs = zip(runs[variant], runs[base], strict=True)
    return statistics.median(v / b for v, b in pairs) - 1


@dataclass
class PeriodCost:
    """What one checkpoint period costs in steady state, from per-step timings."""

    step: float  # the typical step: median over the runs of each run's median quiet step
    added: float  # seconds a period takes beyond ``period`` typical steps
    period: int  # steps between checkpoints

    @property
    def time(self) -> float:
        return self.period * self.step + self.added


def period_cost(runs: list[list[float]], period: int) -> PeriodCost:
    """The steady-state cost of a period of ``period`` steps, from each run's step laps.

    Each run is the ``perf_counter`` at the end of every step; its first ``period`` steps
    (warm-up, the first save's staging allocation) are left out. A step's *excess* is its
    duration minus its own run's typical step (the median at positions 30-90 % into the period,
    away from the saves); the period's added time is the sum over positions of the median excess
    at that position, over every period of every run. Measured this way, a run slowed down as a
    whole by other tenants (10-20 % from minute to minute on these VMs) does not count, nor does
    a stall that hits one step at random, while a cost that recurs at the same place in every
    period does. What it cannot see is a slowdown spread evenly over every step: the typical
    steps (:attr:`PeriodCost.step`, per variant) are reported for that.
    """
    quiet = range(int(period * 0.3), int(period * 0.9))
    typical: list[float] = []
    excess: list[list[float]] = [[] for _ in range(period)]
    for laps in runs:
        steps = [(i, b - a) for i, (a, b) in enumerate(itertools.pairwise(laps), 1) if i >= period]
        if not any(i % period in quiet for i, _ in steps):
            raise ValueError(f"a run of {len(laps)} steps has no full period of {period} to time")
        step = statistics.median(d for i, d in steps if i % period in quiet)
        typical.append(step)
        for i, d in steps:
            excess[i % period].append(d - step)
    added = sum(statistics.median(e) for e in excess if e)
    return PeriodCost(statistics.median(typical), added, period)


def step_overhead(
    laps: dict[str, list[list[float]]], variant: str, period: int, base: str = "none"
) -> float:
    """``variant``'s steady-state overhead over ``base``: its added time per period of
    ``period`` steps less ``base``'s (an epoch's end costs the same validation in both), over
    ``base``'s period (see :func:`period_cost`)."""
    of, against = period_cost(laps[variant], period), period_cost(laps[base], period)
    return (of.added - against.added) / against.time


@dataclass
class FabricOverhead:
    """Loop times per variant, and the loop's time in each save of the async manager."""

    times: dict[str, list[float]]  # wall time of each round's loop, per variant
    cpu: dict[str, list[float]]  # the loop thread's CPU time, likewise
    laps: dict[str, list[list[float]]]  # per round, the perf_counter at the end of each step
    blocked: list[float]  # seconds the loop spent in each async save
    steps: int
    nbytes: int  # model and optimizer state
    repeat: int = 1  # (read by benchmarks/run.py's target rows)
    what: str = (
        f"Fabric loop, async `CheckpointManager` every {STEP_INTERVAL} steps: overhead "
        f"(limit: {LIMIT * 100:g} %, and no more than `fabric.save`'s)"
    )

    def overhead_of(self, variant: str, of: str = "times") -> float:
        """:func:`paired_overhead` of ``variant`` (``of="cpu"``: the loop thread's CPU time)."""
        return paired_overhead(getattr(self, of), variant)

    def step_overhead(self, variant: str) -> float:
        """:func:`step_overhead` of ``variant``: its steady-state cost per save period."""
        return step_overhead(self.laps, variant, STEP_INTERVAL)

    @property
    def overhead(self) -> float:
        return self.step_overhead("async")

    @property
    def limit(self) -> float:
        return min(LIMIT, self.step_overhead("fabric.save"))

    def markdown(self) -> list[str]:
        base = statistics.median(self.times["none"])
        blocked = sorted(self.blocked)
        lines = [
            f"A hand-written Lightning Fabric loop (`benchmarks/fabric.py`): an MLP and AdamW, "
            f"{self.nbytes / 2**20:.0f} MiB of model and optimizer state, {self.steps} steps "
            f"({base / self.steps * 1000:.1f} ms each without checkpoints), a checkpoint every "
            f"{STEP_INTERVAL} steps, {len(self.times['none'])} interleaved runs per variant. "
            f"Each async save keeps the loop for {statistics.median(blocked) * 1000:.1f} ms "
            f"(median of {len(blocked)}; range {blocked[0] * 1000:.1f} - "
            f"{blocked[-1] * 1000:.1f} ms). Whole-loop overheads are medians over the rounds of "
            "the ratio to the same round's loop without checkpoints (the last save waited for "
            f"included); per-step overheads are the steady-state cost of a {STEP_INTERVAL}-step "
            "period, from every step's time against its own loop's typical step (the target's "
            "measure, `fabric.step_overhead`):",
            "",
            "| variant | median loop time | range | whole loop | loop thread CPU | overhead "
            "| typical step | added per period | per step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for variant, times in self.times.items():
            med, cpu = statistics.median(times), statistics.median(self.cpu[variant])
            cost = period_cost(self.laps[variant], STEP_INTERVAL)
            lines.append(
                f"| {VARIANTS[variant]} | {med:.3f} s | {min(times):.3f} - {max(times):.3f} s | "
                f"{self.overhead_of(variant) * 100:+.1f} % | {cpu:.3f} s | "
                f"{self.overhead_of(variant, 'cpu') * 100:+.1f} % | {cost.step * 1000:.2f} ms | "
                f"{cost.added * 1000:.1f} ms | {self.step_overhead(variant) * 100:+.2f} % |"
            )
        return lines


def _train_step(fabric: L.Fabric, state: dict, batch: list) -> int:
    """One optimizer step on ``batch``; the step count after it."""
    x, y = batch
    fabric.backward(nn.functional.cross_entropy(state["model"](x), y))
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["step"] += 1
    return state["step"]


def _run(
    root: Path, variant: str, steps: int, blocked: list[float], laps: list[float]
) -> tuple[float, float, int]:
    """One whole loop of ``variant``: its wall time, its thread's CPU time, and the bytes of
    its model and optimizer state; ``laps`` gets the time at the end of each step."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0, verbose=False)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4096, WIDTH, generator=g), torch.randint(10, (4096,), generator=g)
    )
    loader = ResumableLoader(
        fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    )
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    manager = None
    if variant in ("sync", "async"):
        manager = CheckpointManager(
            fabric, root, every_n_train_steps=STEP_INTERVAL, async_save=variant == "async"
        )
    start, cpu = time.perf_counter(), time.thread_time()
    while state["step"] < steps:
        for batch in loader:
            step = _train_step(fabric, state, batch)
            if manager is not None:
                before = time.perf_counter()
                if manager.save_if_due(step, state) and variant == "async":
                    blocked.append(time.perf_counter() - before)
            elif variant == "fabric.save" and step % STEP_INTERVAL == 0:
                fabric.save(root / f"step-{step:08d}" / "lit_model.pth", state)
            laps.append(time.perf_counter())
            if step >= steps:
                break
    if manager is not None:
        manager.close()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    inner = model.module
    nbytes = sum(p.numel() * p.element_size() * 3 for p in inner.parameters())  # + 2 moments
    return elapsed, cpu, nbytes


def measure(directory: Path, *, quick: bool, reps: int | None = None) -> FabricOverhead:
    """Interleaved loops of every variant (the order rotates each round), after a warm-up round."""
    reps = reps or (3 if quick else 9)
    steps = QUICK_STEPS if quick else STEPS
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    laps: dict[str, list[list[float]]] = {name: [] for name in names}
    blocked: list[float] = []
    nbytes = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: the other core is the async writer's
    logger = logging.getLogger("lightning_bpk")
    level = logger.level
    logger.setLevel(logging.WARNING)  # no "saved checkpoint" line per save
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fabric's "srun is available" hint, each run
            for rnd in range(reps + 1):
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    run_laps: list[float] = []
                    with tempfile.TemporaryDirectory(dir=directory) as root:
                        elapsed, used, nbytes = _run(Path(root), name, steps, blocked, run_laps)
                    if rnd:
                        times[name].append(elapsed)
                        cpu[name].append(used)
                        laps[name].append(run_laps)
                if not rnd:
                    blocked.clear()  # keep what the measured rounds blocked
                print(f"  fabric loop: round {rnd}/{reps} done", flush=True)
    finally:
        torch.set_num_threads(threads)
        logger.setLevel(level)
    return FabricOverhead(times, cpu, laps, blocked, steps, nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description="the Fabric row of make bench, alone")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--reps", type=int, default=None, help="rounds after the warm-up")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-fabric-") as tmp:
        result = measure(Path(tmp), quick=args.quick, reps=args.reps)
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"took {(time.perf_counter() - start) / 60:.1f} min\n")
    print("\n".join(result.markdown()))
    verdict = "met" if result.overhead <= result.limit else "MISSED"
    measured, limit = result.overhead * 100, result.limit * 100
    print(f"\n{result.what}: {measured:.2f} % (limit {limit:.2f} %): {verdict}")


if __name__ == "__main__":
    main()
