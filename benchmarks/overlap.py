"""What a periodic checkpoint costs the training loop, per way of saving, at four sizes.

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
loop time per save** (the steps from the saving one until the save is durable and ``TAIL``
more, each against the run's median step; the ``none`` row sums the same spans at the same
steps of the run without saves: the noise floor) and the **overhead at every 50 steps** (added
time over 50 median steps of the ``none`` run), medians over the saves after a warm-up save.
``one copy`` is the time of one copy of the whole state into reused buffers, what issue 37's
targets are measured against.
Per size it also times the overlapped + process variant's save until durable (committed)
against a raw ``O_DIRECT`` write + fsync of the same bytes (``methods.raw_direct_write``).

    .venv/bin/python benchmarks/overlap.py           # digits, the MLP, ~300 MiB, 1.5 GiB (~20 min)
    .venv/bin/python benchmarks/overlap.py --quick   # digits, 24 MiB and 96 MiB (a minute)
    .venv/bin/python benchmarks/overlap.py --only 300   # one size
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import methods
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _atomic_save
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord, OptimizerRecord, StateRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.rng import capture_rng

EVERY = 50  # steps between saves (the two large states: fewer, see SIZES)
TAIL = 2  # steps after a save became durable that its added time still counts
DURABLE_ROUNDS = 3  # saves timed until durable, and raw O_DIRECT writes, per size
MiB = 1024 * 1024
# Issue 37's targets (at most), each a ratio to one copy of the state or to a raw O_DIRECT write
ADDED_VS_COPY = 0.5  # the ~300 MiB state: added loop time per save
BLOCKED_VS_COPY = 0.2  # the ~300 MiB and 1.5 GiB states: blocked time per save
DURABLE_VS_DIRECT = 1.2  # the 1.5 GiB state: save to durable against raw O_DIRECT
OVERLAPPED = "async overlapped + process"
PEERS = ("DCP async_save", "ModelCheckpoint")


@dataclass(frozen=True)
class Size:
    """A state to train: Linear layers without bias (``width_in`` -> ``hidden`` x ``layers``
    -> 10) + Adam, a batch of ``batch`` rows; a save every ``every`` steps, ``saves`` measured
    after a warm-up save. ``targets``: issue 37's limits checked on it (``"added"``,
    ``"blocked"``, ``"durable"``, ``"below <variant>"``: see :meth:`SizeResult.targets`)."""

    width_in: int
    hidden: int
    layers: int
    batch: int
    every: int = EVERY
    saves: int = 4
    targets: tuple[str, ...] = ()


SIZES = {
    "digits example (MLP 64-64-10)": Size(
        64, 64, 1, 32, saves=20, targets=("below ModelCheckpoint",)
    ),
    "MLP, 0.4 M parameters (784-512-10)": Size(
        784, 512, 1, 32, saves=20, targets=("below ModelCheckpoint",)
    ),
    # Steps of ~0.3 s and ~2 s here: a save durable within a few steps, so saves every 10 and 8
    # steps are each measured alone, and many of them keep the section to minutes; overheads are
    # still reported at every 50 steps (added time over 50 median steps).
    "~300 MiB state (25 M parameters)": Size(
        2048,
        2048,
        6,
        8,
        every=10,
        saves=12,
        targets=("added", "blocked", *(f"below {peer}" for peer in PEERS)),
    ),
    "1.5 GiB state (134 M parameters)": Size(
        4096, 4096, 8, 1, every=8, saves=4, targets=("blocked", "durable")
    ),
}
QUICK_SIZES = {
    "digits example (MLP 64-64-10)": Size(64, 64, 1, 32, saves=6),
    "24 MiB state": Size(1024, 1024, 2, 8, every=10, saves=4),
    "96 MiB state": Size(1024, 1024, 8, 2, every=10, saves=4),
}
FLOOR = "I/O floor: copy beside, O_DIRECT in a process"
VARIANTS = (
    "none",
    FLOOR,
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
    """One variant's run: every step's time, and per save (1-based steps) where it started,
    the step at whose end it was durable and the training thread's blocked time."""

    steps: list[float] = field(default_factory=list)
    saved_at: list[int] = field(default_factory=list)
    durable_at: list[int] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)


def _write_direct(conn: Any, region: mmap.mmap, path: str) -> None:
    """The floor's child: per request, ``region`` written to ``path`` with ``O_DIRECT`` from
    where it lies (no copy) and fsynced; answers when durable."""
    view = memoryview(region)
    while conn.recv():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            offset = 0
            while offset < view.nbytes:
                offset += os.pwrite(fd, view[offset : offset + 64 * MiB], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        conn.send(True)


class _Floor:
    """The least any durable asynchronous save does: the state copied into page-aligned shared
    memory on a thread beside the next forward and backward (the next step waiting for it), then
    written with ``O_DIRECT`` straight from that memory by another process, no format, no
    checksum, no commit. What it adds to the loop is what the bytes alone cost here."""

    def __init__(self, directory: Path, tensors: list[torch.Tensor]) -> None:
        self.tensors, offsets, total = tensors, [], 0
        for t in tensors:
            offsets.append(total)
            total += t.nbytes + (-t.nbytes) % mmap.PAGESIZE
        self.region = mmap.mmap(-1, total)  # shared with the forked child
        flat = torch.frombuffer(self.region, dtype=torch.uint8)
        self.buffers = [
            flat[o : o + t.nbytes].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors, strict=True)
        ]
        context = multiprocessing.get_context("fork")  # the child makes system calls only
        self.conn, child = context.Pipe()
        path = str(directory / "floor.bin")
        self.child = context.Process(target=_write_direct, args=(child, self.region, path))
        self.child.start()
        self.copying: threading.Thread | None = None
        self.writing = False

    def save(self) -> None:
        self.wait()

        def copy_then_write() -> None:
            for dst, src in zip(self.buffers, self.tensors, strict=True):
                dst.copy_(src)
            self.conn.send(True)

        self.copying = threading.Thread(target=copy_then_write)
        self.copying.start()
        self.writing = True

    def before_step(self) -> None:
        if self.copying is not None:
            self.copying.join()
            self.copying = None

    def durable(self) -> bool:
        if self.writing and self.conn.poll():
            self.writing = not self.conn.recv()
        return not self.writing

    def wait(self) -> None:
        self.before_step()
        if self.writing:
            self.writing = not self.conn.recv()

    def close(self) -> None:
        self.wait()
        self.conn.send(False)
        self.child.join()


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
        self.floor = _Floor(directory, _state_tensors(net, opt)) if name == FLOOR else None

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
        elif self.floor is not None:
            self.floor.save()
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
        elif self.floor is not None:
            self.floor.before_step()
        elif self.dcp is not None:
            self.dcp.staging_completion.result()

    def durable(self) -> bool:
        """True once the last save is durable (without waiting for it)."""
        if self.saver is not None:
            return not self.saver.busy
        if self.floor is not None:
            return self.floor.durable()
        return self.dcp is None or self.dcp.upload_completion.done()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.floor is not None:
            self.floor.close()
        if self.dcp is not None:
            self.dcp.upload_completion.result()
        if self.stager is not None:
            self.stager.close()


def _run(variant: _Variant, steps: int, every: int, batch: torch.Tensor) -> Run:
    """``steps`` steps, a save every ``every`` (``none``: the steps a save would start at are
    recorded, durable at once). Gradients are zeroed in place: a step that faults fresh memory
    in for its gradients varies more, and the measure is finer on steady steps."""
    run, net, opt = Run(), variant.net, variant.opt
    pending = 0.0  # blocked time of the last save, completed by the wait before the next step
    for step in range(1, steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        net(batch).square().mean().backward()
        waited = time.perf_counter()
        variant.before_step()
        if run.saved_at and run.saved_at[-1] == step - 1:
            run.blocked.append(pending + time.perf_counter() - waited)
        opt.step()
        if step % every == 0:
            saving = time.perf_counter()
            if variant.name != "none":
                variant.save(step)
            pending = time.perf_counter() - saving
            run.saved_at.append(step)
        run.steps.append(time.perf_counter() - start)
        if len(run.durable_at) < len(run.saved_at) and variant.durable():
            run.durable_at.append(step)
    run.durable_at += [steps] * (len(run.saved_at) - len(run.durable_at))  # durable at close
    variant.close()
    return run


def added_per_save(steps: list[float], saved_at: list[int], durable_at: list[int]) -> list[float]:
    """Per save started at step ``s`` and durable at the end of step ``d`` (1-based): the loop
    time the steps ``s`` to ``d + TAIL`` took beyond the run's median step (what the save cost
    the loop while it ran, and just after).

    >>> added_per_save([1.0] * 20 + [1.5, 1.25] + [1.0] * 20, [21], [21])
    [0.75]
    """
    typical = statistics.median(steps)
    return [
        sum(t - typical for t in steps[s - 1 : d + TAIL])
        for s, d in zip(saved_at, durable_at, strict=True)
    ]


def _state_tensors(net: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    """The parameters and the optimizer's state tensors: the bytes a checkpoint holds."""
    tensors = [p.detach() for p in net.parameters()]
    return tensors + [v for s in opt.state.values() for v in s.values() if v.dim() > 0]


def _one_copy(net: torch.nn.Module, opt: Any) -> float:
    """Median time of one copy of the model and optimizer state into reused buffers."""
    tensors = _state_tensors(net, opt)
    buffers = [t.clone() for t in tensors]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for dst, src in zip(buffers, tensors, strict=True):
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _durable(directory: Path, net: torch.nn.Module, opt: Any) -> tuple[float, float]:
    """Medians of :data:`DURABLE_ROUNDS` rounds: the overlapped + process variant's save from
    the call until its checkpoint is committed (late copies, the writer process's write, fsyncs,
    sentinel), and a raw ``O_DIRECT`` write + fsync of the same tensors into a new file, in
    alternating order. Both write new files only: nothing is collected, overwritten or removed
    until the end (freeing a large file's blocks is a removal's cost, and the device may still
    be busy with it when the next write starts)."""
    variant = _Variant(OVERLAPPED, directory, net, opt)
    assert variant.saver is not None
    variant.checkpointer = Checkpointer(directory / "kept", checkpoint_duration=DURABLE_ROUNDS + 2)
    tensors = _state_tensors(net, opt)
    durable, direct = [], []
    try:
        for round_ in range(DURABLE_ROUNDS + 1):  # the first: a warm-up
            raw = directory / f"raw-direct-{round_}.bin"
            for which in ("ours", "raw") if round_ % 2 else ("raw", "ours"):  # no order bias
                start = time.perf_counter()
                if which == "ours":
                    variant.save(round_)
                    variant.saver.wait()
                    durable.append(time.perf_counter() - start)
                else:
                    methods.raw_direct_write(raw, tensors)
                    direct.append(time.perf_counter() - start)
    finally:
        variant.close()
    return statistics.median(durable[1:]), statistics.median(direct[1:])


@dataclass
class SizeResult:
    name: str
    size: Size
    nbytes: int
    median_step: float  # of the none run
    one_copy: float
    rows: dict[str, tuple[float, float, float]]  # variant -> blocked, added, overhead
    durable: float  # the overlapped + process variant: save call to committed
    raw_direct: float  # raw O_DIRECT write + fsync of the same bytes

    def targets(self) -> list[tuple[str, float, float]]:
        """Issue 37's targets on this size: (what, measured, limit), each at most."""
        blocked, added, _ = self.rows[OVERLAPPED]
        out = []
        for target in self.size.targets:
            if target == "added":
                what = f"{self.name}: added loop time per save / one copy ({OVERLAPPED})"
                out.append((what, added / self.one_copy, ADDED_VS_COPY))
            elif target == "blocked":
                what = f"{self.name}: blocked time per save / one copy ({OVERLAPPED})"
                out.append((what, blocked / self.one_copy, BLOCKED_VS_COPY))
            elif target == "durable":
                what = f"{self.name}: save to durable / raw O_DIRECT write ({OVERLAPPED})"
                out.append((what, self.durable / self.raw_direct, DURABLE_VS_DIRECT))
            elif target.removeprefix("below ") in self.rows:  # absent: not run (--variants)
                peer = target.removeprefix("below ")
                what = f"{self.name}: added loop time per save / {peer}'s ({OVERLAPPED})"
                out.append((what, added / self.rows[peer][1], 1.0))
        return out

    def markdown(self) -> list[str]:
        copy = self.one_copy
        lines = [
            f"**{self.name}** ({self.nbytes / MiB:.1f} MiB, a save every {self.size.every} "
            f"steps, median step {self.median_step * 1000:.1f} ms, one copy "
            f"{copy * 1000:.1f} ms; {OVERLAPPED} save to durable {self.durable * 1000:.0f} ms "
            f"= {self.durable / self.raw_direct:.2f}x a raw O_DIRECT write of the same bytes, "
            f"{self.raw_direct * 1000:.0f} ms)",
            "",
            "| variant | blocked / save | / one copy | added loop time / save "
            f"| / one copy | overhead at every {EVERY} steps |",
            "|---|---|---|---|---|---|",
        ]
        for variant, (blocked, added, overhead) in self.rows.items():
            lines.append(
                f"| {variant} | {blocked * 1000:.2f} ms | {blocked / copy:.2f}x "
                f"| {added * 1000:.1f} ms | {added / copy:.2f}x | {overhead * 100:+.2f} % |"
            )
        return [*lines, ""]


def measure_size(
    directory: Path, name: str, size: Size, variants: tuple[str, ...] = VARIANTS
) -> SizeResult:
    net = _model(size.width_in, size.hidden, size.layers)
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    batch = torch.randn(size.batch, size.width_in)
    net(batch).square().mean().backward()
    opt.step()  # Adam's moments exist now
    nbytes = sum(p.nbytes * 3 for p in net.parameters())
    steps = size.every * (size.saves + 2) - 1  # a warm-up save, the measured ones, a tail
    runs: dict[str, Run] = {}
    for variant_name in variants:
        with tempfile.TemporaryDirectory(dir=directory) as root:
            variant = _Variant(variant_name, Path(root), net, opt)
            runs[variant_name] = _run(variant, steps, size.every, batch)
    base = statistics.median(runs["none"].steps)
    rows = {}
    for variant_name, run in runs.items():
        # a save after the last one measured only bounds the run; the first is a warm-up
        measured = slice(1, size.saves + 1)
        saved_at, durable_at = run.saved_at[measured], run.durable_at[measured]
        if variant_name == "none":  # the noise floor: at the same steps, the same spans
            late = runs[OVERLAPPED]
            spans = [d - s for s, d in zip(late.saved_at, late.durable_at, strict=True)]
            durable_at = [s + span for s, span in zip(saved_at, spans[measured], strict=True)]
        added = statistics.median(added_per_save(run.steps, saved_at, durable_at))
        blocked = statistics.median(run.blocked[measured]) if variant_name != "none" else 0.0
        rows[variant_name] = (blocked, added, added / (EVERY * base))
    with tempfile.TemporaryDirectory(dir=directory) as root:
        durable, raw_direct = _durable(Path(root), net, opt)
    one_copy = _one_copy(net, opt)
    return SizeResult(name, size, nbytes, base, one_copy, rows, durable, raw_direct)


@dataclass
class OverlapResult:
    """The section of the benchmarks page."""

    sizes: list[SizeResult]
    load: str

    def targets(self) -> list[tuple[str, float, float]]:
        """Issue 37's targets: (what, measured, limit), each at most."""
        return [t for size in self.sizes for t in size.targets()]

    def markdown(self) -> list[str]:
        lines = [
            "### A checkpoint every few steps: what each way of saving costs the loop",
            "",
            "`benchmarks/overlap.py`: a plain loop (one intra-op thread), model, Adam and a "
            "loop state saved periodically; medians over the saves after a warm-up save. "
            f"Blocked: the training thread inside the save call, plus its wait before the next "
            "step. Added loop time: the steps from the saving one until the save is durable "
            f"and {TAIL} more, each against its run's median step (row `none`: the same spans "
            "at the same steps of the run without saves, the noise floor). Overhead: added "
            f"time over {EVERY} median steps of the run without saves. Ratios are to one copy "
            "of the whole state into reused buffers. Load average during the run: "
            f"{self.load}.",
            "",
        ]
        return lines + [line for size in self.sizes for line in size.markdown()]


def measure(
    directory: Path, *, quick: bool, only: str | None = None, some: str | None = None
) -> OverlapResult:
    """Every size (``only``: the one whose name contains it), each printed as it is done;
    every variant (``some``: the ones whose names contain one of its comma-separated words,
    with ``none`` and the overlapped one always)."""
    variants = VARIANTS
    if some is not None:
        words = some.split(",")
        variants = tuple(
            v for v in VARIANTS if v in ("none", OVERLAPPED) or any(w in v for w in words)
        )
    torch.set_num_threads(1)
    results = []
    for name, size in (QUICK_SIZES if quick else SIZES).items():
        if only is not None and only not in name:
            continue
        results.append(measure_size(directory, name, size, variants))
        print("\n".join(results[-1].markdown()), file=sys.stderr, flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return OverlapResult(results, load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small states, two saves each")
    parser.add_argument("--only", default=None, help="the size whose name contains this")
    parser.add_argument("--variants", default=None, help="comma-separated words of names")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:  # on the disk, not a tmpfs
        result = measure(Path(tmp), quick=args.quick, only=args.only, some=args.variants)
    print("\n".join(result.markdown()))


if __name__ == "__main__":
    main()
