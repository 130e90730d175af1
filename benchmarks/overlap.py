"""What a checkpoint every 50 steps costs the training loop, per way of saving, at three sizes.

A plain PyTorch loop (forward, backward, ``optimizer.step``; one intra-op thread) trains a
model with Adam and saves every ``EVERY`` steps, model, optimizer state and a Lightning-like
loop state (~80 counters and the RNG states), in one of these variants, run one after another
on the same model:

- ``none``: no saves (the run's step times are the baseline);
- ``sync``: :meth:`Checkpointer.save_checkpoint` on the training thread;
- ``async thread``: :class:`AsyncCheckpointSaver` (the whole snapshot copied on the training
  thread, the write on a background thread);
- ``async overlapped + process``: ``AsyncCheckpointSaver(process=True)`` with the optimizer
  watched (buffers, RNG and loop state copied on the training thread; parameters and Adam's
  moments copied beside the next forward and backward, the next step waiting for that copy;
  staging in shared memory, the commit in a writer process);
- ``DCP async_save``: torch's ``dcp.async_save`` (thread mode, the ``DefaultStager`` options
  that work on a CPU: shared memory, asynchronous staging), the next step waiting for its
  staging as DCP requires;
- ``ModelCheckpoint``: what Lightning's ``ModelCheckpoint`` does at a save, ``torch.save`` of
  the checkpoint dict through Lightning's ``_atomic_save`` on the training thread.

Per variant and size it reports the training thread's **blocked time per save** (inside the
save call, plus the wait before the next step for the two variants that have one), the **added
loop time per save** (the saving step and the ``WINDOW - 1`` after it, each against the run's
median step) and the **overhead at every 50 steps** (added time over 50 median steps of the
``none`` run), medians over the saves after a warm-up save. ``one copy`` is the time of one
copy of the whole state into reused buffers, what issue 37's targets are measured against.

    .venv/bin/python benchmarks/overlap.py           # digits, ~250 MiB and 1.5 GiB states
    .venv/bin/python benchmarks/overlap.py --quick   # digits, 24 MiB and 96 MiB (a minute)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _atomic_save
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord, OptimizerRecord, StateRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.rng import capture_rng

EVERY = 50  # steps between saves
WINDOW = 10  # the saving step and the steps after it that a save's added time is summed over
MiB = 1024 * 1024
# name -> (input width, hidden width, hidden layers, batch): Linear layers without bias + Adam
SIZES = {
    "digits example (MLP 64-64-10)": (64, 64, 1, 32),
    "~250 MiB state": (2048, 2048, 5, 8),
    "1.5 GiB state": (4096, 4096, 8, 1),
}
QUICK_SIZES = {
    "digits example (MLP 64-64-10)": (64, 64, 1, 32),
    "24 MiB state": (1024, 1024, 2, 8),
    "96 MiB state": (1024, 1024, 8, 2),
}
VARIANTS = (
    "none",
    "sync",
    "async thread",
    "async overlapped + process",
    "DCP async_save",
    "ModelCheckpoint",
)


def _model(width_in: int, hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    parts: list[torch.nn.Module] = [torch.nn.Linear(width_in, hidden, bias=False)]
    for _ in range(layers - 1):
        parts += [torch.nn.ReLU(), torch.nn.Linear(hidden, hidden, bias=False)]
    return torch.nn.Sequential(*parts, torch.nn.ReLU(), torch.nn.Linear(hidden, 10, bias=False))


def _loop_state(step: int) -> dict[str, Any]:
    """A Lightning-like loop state: ~80 counters in nested dicts, and the RNG states."""
    progress = {"ready": step, "started": step, "processed": step, "completed": step}
    loops = {
        name: {"total": dict(progress), "current": dict(progress), "is_last_batch": False}
        for name in ("batch", "scheduler", "optimizer", "epoch", "val", "test", "predict")
    }
    return {"epoch": step // 1000, "global_step": step, "loops": loops, "rng": capture_rng()}


@dataclass
class Run:
    """One variant's run: every step's time, and per save the blocked time."""

    steps: list[float] = field(default_factory=list)
    saved_at: list[int] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)


class _Variant:
    """How one variant saves at ``step`` and what it waits for before the next step."""

    def __init__(self, name: str, directory: Path, net: torch.nn.Module, opt: Any) -> None:
        self.name, self.directory, self.net, self.opt = name, directory, net, opt
        self.checkpointer = Checkpointer(directory / "bpk", checkpoint_duration=2)
        self.saver: AsyncCheckpointSaver | None = None
        if name.startswith("async"):
            overlapped = name == "async overlapped + process"
            self.saver = AsyncCheckpointSaver(process=overlapped)
            self.saver.reserve(self._records(0))  # and starts the writer process
            self.saver.wait()
            if overlapped:
                self.saver.watch([opt])
        self.stager: DefaultStager | None = None
        self.dcp: Any = None

    def _records(self, step: int) -> dict[str, Any]:
        return {
            "model": ModuleRecord.from_module(self.net),
            "optim": OptimizerRecord.from_optimizer(self.opt, self.net),
            "trainer": StateRecord(_loop_state(step)),
        }

    def save(self, step: int) -> None:
        if self.name == "sync":
            self.checkpointer.save_checkpoint(step, self._records(step))
        elif self.saver is not None:
            self.saver.save_checkpoint(self.checkpointer, step, self._records(step))
        elif self.name == "DCP async_save":
            self._save_dcp(step)
        elif self.name == "ModelCheckpoint":
            checkpoint = {
                "state_dict": self.net.state_dict(),
                "optimizer_states": [self.opt.state_dict()],
                **_loop_state(step),
            }
            _atomic_save(checkpoint, self.directory / "last.ckpt")

    def _save_dcp(self, step: int) -> None:
        if self.dcp is not None:
            self.dcp.upload_completion.result()  # one save in flight
        if self.stager is None:
            options = StagingOptions(False, True, True, False)  # what works on a CPU
            self.stager = DefaultStager(options)
        state = {"model": self.net.state_dict(), "optim": self.opt.state_dict()}
        self.dcp = dcp.async_save(
            state,
            checkpoint_id=self.directory / f"dcp-{step}",
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self.stager,
        )

    def before_step(self) -> None:
        """Wait for what a step must not change before it is copied."""
        if self.saver is not None:
            self.saver.wait_snapshot()
        elif self.dcp is not None:
            self.dcp.staging_completion.result()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.dcp is not None:
            self.dcp.upload_completion.result()
        if self.stager is not None:
            self.stager.close()


def _run(variant: _Variant, steps: int, batch: torch.Tensor) -> Run:
    run, net, opt = Run(), variant.net, variant.opt
    pending = 0.0  # blocked time of the last save, completed by the wait before the next step
    for step in range(1, steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        net(batch).square().mean().backward()
        waited = time.perf_counter()
        variant.before_step()
        if run.saved_at and run.saved_at[-1] == step - 1:
            run.blocked.append(pending + time.perf_counter() - waited)
        opt.step()
        if step % EVERY == 0 and variant.name != "none":
            saving = time.perf_counter()
            variant.save(step)
            pending = time.perf_counter() - saving
            run.saved_at.append(step)
        run.steps.append(time.perf_counter() - start)
    variant.close()
    return run


def added_per_save(steps: list[float], saved_at: list[int]) -> list[float]:
    """Per save at step ``s`` (1-based): the loop time the saving step and the ``WINDOW - 1``
    after it took beyond the run's median step.

    >>> added_per_save([1.0] * 20 + [1.5, 1.25] + [1.0] * 20, [21])
    [0.75]
    """
    typical = statistics.median(steps)
    return [sum(t - typical for t in steps[s - 1 : s - 1 + WINDOW]) for s in saved_at]


def _one_copy(net: torch.nn.Module, opt: Any) -> float:
    """Median time of one copy of the model and optimizer state into reused buffers."""
    tensors = [p.detach() for p in net.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    buffers = [t.clone() for t in tensors]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for dst, src in zip(buffers, tensors, strict=True):
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class SizeResult:
    name: str
    nbytes: int
    median_step: float  # of the none run
    one_copy: float
    rows: dict[str, tuple[float, float, float]]  # variant -> blocked, added, overhead


def measure_size(directory: Path, name: str, shape: tuple[int, int, int, int], saves: int):
    width_in, hidden, layers, batch_size = shape
    net = _model(width_in, hidden, layers)
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    batch = torch.randn(batch_size, width_in)
    net(batch).square().mean().backward()
    opt.step()  # Adam's moments exist now
    nbytes = sum(p.nbytes * 3 for p in net.parameters())
    steps = EVERY * (saves + 1) + WINDOW  # a warm-up save, then the measured ones
    runs: dict[str, Run] = {}
    for variant_name in VARIANTS:
        with tempfile.TemporaryDirectory(dir=directory) as root:
            runs[variant_name] = _run(_Variant(variant_name, Path(root), net, opt), steps, batch)
    base = statistics.median(runs["none"].steps)
    rows = {}
    for variant_name, run in runs.items():
        if variant_name == "none":
            continue
        added = added_per_save(run.steps, run.saved_at[1:])
        blocked = statistics.median(run.blocked[1:])
        middle = statistics.median(added)
        rows[variant_name] = (blocked, middle, middle / (EVERY * base))
    return SizeResult(name, nbytes, base, _one_copy(net, opt), rows)


@dataclass
class OverlapResult:
    """The section of the benchmarks page."""

    sizes: list[SizeResult]
    saves: int
    load: str

    def markdown(self) -> list[str]:
        lines = [
            f"### A checkpoint every {EVERY} steps: what each way of saving costs the loop",
            "",
            "`benchmarks/overlap.py`: a plain loop (one intra-op thread), model, Adam and a "
            f"loop state saved every {EVERY} steps; medians over {self.saves} saves (2 for "
            "the largest state) after a warm-up save."
            f" Added loop time: the saving step and the {WINDOW - 1} after it, "
            "each against its run's median step. Overhead: added time over "
            f"{EVERY} median steps. Ratios are to one copy of the whole state into reused "
            f"buffers. Load average during the run: {self.load}.",
            "",
        ]
        for size in self.sizes:
            lines += [
                f"**{size.name}** ({size.nbytes / MiB:.1f} MiB, median step "
                f"{size.median_step * 1000:.1f} ms, one copy {size.one_copy * 1000:.1f} ms)",
                "",
                "| variant | blocked / save | / one copy | added loop time / save "
                f"| / one copy | overhead at every {EVERY} steps |",
                "|---|---|---|---|---|---|",
            ]
            for variant, (blocked, added, overhead) in size.rows.items():
                copy = size.one_copy
                lines.append(
                    f"| {variant} | {blocked * 1000:.2f} ms | {blocked / copy:.2f}x "
                    f"| {added * 1000:.1f} ms | {added / copy:.2f}x | {overhead * 100:+.2f} % |"
                )
            lines.append("")
        return lines


def measure(directory: Path, *, quick: bool) -> OverlapResult:
    torch.set_num_threads(1)
    saves = 2 if quick else 4
    sizes = QUICK_SIZES if quick else SIZES
    results = [
        # the largest state's steps are the longest: fewer saves keep the section to minutes
        measure_size(directory, name, shape, 2 if i == len(sizes) - 1 else saves)
        for i, (name, shape) in enumerate(sizes.items())
    ]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return OverlapResult(results, saves, load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small states, two saves each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Path(tmp), quick=args.quick)
    print("\n".join(result.markdown()))


if __name__ == "__main__":
    main()
