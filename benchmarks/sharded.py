"""Sharded save and load on 2 gloo CPU ranks: ``BurnpackStorageWriter``/``Reader`` vs torch DCP's
default ``FileSystemWriter``/``Reader``, side by side in the same run, on the same tensors.

The state is 16 float32 tensors (1 GiB in total, or 64 MiB with ``--quick``), each a ``DTensor``
sharded along dim 0 over the 2 ranks (FSDP2's layout), so each rank writes and reads half.
A save is timed from a barrier before it to a barrier after it (the slowest rank); a load reads
into the existing shards, its files first dropped from the page cache and read back once
(``methods.recache``: DCP's buffered writes would otherwise leave its files cached and burnpack's
``O_DIRECT`` writes leave none).

Asynchronous saves, side by side in the same rounds: ``AsyncCheckpointSaver.save_sharded`` (what
``BurnpackCheckpoint(async_save=True)`` runs under FSDP2: each rank copies its shards into reused
staging buffers, the writer threads write and commit over a gloo group of their own) against
DCP's ``async_save`` in thread mode with a ``DefaultStager`` (on CPU it needs
``StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
use_non_blocking_copy=False)``) and a gloo group of its own. Each is timed twice from the same
barrier: until the training thread may go on (ours: the call returns; DCP's: its staging is
complete) and until the checkpoint is durable (every rank). Beside them, one plain copy of
each rank's shards into buffers allocated and touched before: what staging cannot beat.

The first round is a warm-up that also checks each load produced the saved values; then
``reps`` rounds in a shuffled order, median and range. Per-rank peak extra RSS is measured in
the last round (``/proc/self/clear_refs`` resets the high-water mark before each call; the
largest of the two ranks is shown).

The ranks are fresh interpreters (this script with ``--rank``), never forks of the caller, and
run under a deadline (:mod:`bounded`): a rank that fails or hangs kills both and names its row.

Run by ``benchmarks/run.py`` (``make bench``) or alone::

    .venv/bin/python benchmarks/sharded.py [--quick] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import bounded
import methods
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_bpk.dcp import BurnpackStorageReader, BurnpackStorageWriter

MiB = 1024 * 1024
GiB = 1024 * MiB
TENSORS = 16
WORLD = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=300)  # a rank waiting on a dead peer gives up

SAVES = {
    "burnpack (BurnpackStorageWriter)": lambda d: BurnpackStorageWriter(d),
    "DCP FileSystemWriter (sync_files)": lambda d: dcp.FileSystemWriter(d),
}
LOADS = {
    "burnpack (BurnpackStorageReader)": lambda d: BurnpackStorageReader(d),
    "DCP FileSystemReader": lambda d: dcp.FileSystemReader(d),
}
DIRECTORY = {  # which save's directory each load reads
    "burnpack (BurnpackStorageReader)": "burnpack (BurnpackStorageWriter)",
    "DCP FileSystemReader": "DCP FileSystemWriter (sync_files)",
}


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {name}")


def _run(call, measure_rss: bool) -> tuple[float, int]:
    """(seconds of the slowest rank, this rank's peak RSS above its start)."""
    if measure_rss:
        Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kib("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    call()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return elapsed, (_status_kib("VmHWM") - baseline) * 1024 if measure_rss else 0


# Asynchronous saves: what blocks the training thread, and until durable.
ASYNC_OURS = "burnpack async (AsyncCheckpointSaver.save_sharded)"
ASYNC_DCP = "DCP async_save (thread, DefaultStager)"
COPY = "one copy of the shards into faulted buffers"


def _max(value: float) -> float:
    """The largest ``value`` over the ranks (the slowest rank's)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


class _Async:
    """Both asynchronous savers of a rank, reused across rounds (staging allocated once)."""

    def __init__(self, root: Path, state: dict) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from lightning_bpk.checkpointer import Checkpointer
        from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

        self.state = state
        self.saver = AsyncCheckpointSaver()
        # retention never collects here: the previous checkpoint is removed outside the timed
        # window, as DCP's directory is (deleting 1 GiB is not part of making one durable)
        self.checkpointer = Checkpointer(root / "burnpack-async", checkpoint_duration=2**20)
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        self.group = dist.new_group(backend="gloo")
        self.dcp_root = root / "dcp-async"
        self.buffers = [torch.empty_like(v.to_local()).zero_() for v in state.values()]
        self.number = 0  # of the last save, ours or DCP's
        self.saved: int | None = None  # our last checkpoint

    def ours(self) -> tuple[float, float]:
        self.number += 1
        dist.barrier()
        start = time.perf_counter()
        self.saver.save_sharded(self.checkpointer, self.number, {"model": self.state})
        blocked = time.perf_counter() - start
        self.saver.wait()
        durable = time.perf_counter() - start
        dist.barrier()
        if dist.get_rank() == 0 and self.saved is not None:
            self.checkpointer.remove_checkpoints([self.saved])
        self.saved = self.number
        return _max(blocked), _max(durable)

    def dcp(self) -> tuple[float, float]:
        self.number += 1
        directory = self.dcp_root / str(self.number)
        dist.barrier()
        start = time.perf_counter()
        response = dcp.async_save(
            {"model": self.state},
            storage_writer=dcp.FileSystemWriter(directory),
            process_group=self.group,
            async_stager=self.stager,
        )
        response.staging_completion.result()
        blocked = time.perf_counter() - start
        response.upload_completion.result()
        durable = time.perf_counter() - start
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
        return _max(blocked), _max(durable)

    def copy(self) -> float:
        dist.barrier()
        start = time.perf_counter()
        for buffer, value in zip(self.buffers, self.state.values(), strict=True):
            buffer.copy_(value.to_local())
        return _max(time.perf_counter() - start)

    def close(self) -> None:
        self.saver.close()
        self.stager.close()


def worker(rank: int, port: int, root: str, total: int, reps: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = total // TENSORS // 4 // 256
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(rows, 256, generator=g) for _ in range(TENSORS)]
    state = {f"layer{i}.weight": distribute_tensor(t, mesh, [Shard(0)]) for i, t in enumerate(full)}
    del full
    times: dict[str, list[float]] = {k: [] for k in [*SAVES, *LOADS]}
    blocked: dict[str, list[float]] = {ASYNC_OURS: [], ASYNC_DCP: [], COPY: []}
    durable: dict[str, list[float]] = {ASYNC_OURS: [], ASYNC_DCP: []}
    savers = _Async(Path(root), state)
    peaks: dict[str, int] = {}
    order = random.Random(1)
    for rnd in range(reps + 1):
        last = rnd == reps
        kinds = [ASYNC_OURS, ASYNC_DCP, COPY]
        order.shuffle(kinds)
        for kind in kinds:
            bounded.row(f"{kind}, round {rnd}")
            if kind == COPY:
                copied = savers.copy()
                if rnd:
                    blocked[COPY].append(copied)
                continue
            went_on, done = savers.ours() if kind == ASYNC_OURS else savers.dcp()
            if rnd:
                blocked[kind].append(went_on)
                durable[kind].append(done)
        saves = list(SAVES)
        order.shuffle(saves)
        for label in saves:
            bounded.row(f"{label} save, round {rnd}")
            directory = Path(root) / label.split()[0]
            shutil.rmtree(directory, ignore_errors=True) if rank == 0 else None
            dist.barrier()
            writer = SAVES[label](directory)
            elapsed, peak = _run(lambda w=writer: dcp.save(state, storage_writer=w), last)
            if rnd:
                times[label].append(elapsed)
            if last:
                peaks[label] = peak
        expected = {k: v.to_local().clone() for k, v in state.items()} if rnd == 0 else None
        loads = list(LOADS)
        order.shuffle(loads)
        for label in loads:
            bounded.row(f"{label} load, round {rnd}")
            for v in state.values():
                v.to_local().zero_()
            directory = Path(root) / DIRECTORY[label].split()[0]
            if rank == 0:  # both loads from a warm cache, whatever the writer left there
                methods.recache(directory, cold=False)
            dist.barrier()
            reader = LOADS[label](directory)
            elapsed, peak = _run(lambda r=reader: dcp.load(state, storage_reader=r), last)
            if rnd:
                times[label].append(elapsed)
            if last:
                peaks[label] = peak
            if expected is not None:
                for k, v in state.items():
                    assert torch.equal(v.to_local(), expected[k]), f"{label}: {k}"
    savers.close()
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        worst = {k: max(p[k] for p in gathered) for k in peaks}
        largest_shard = max(v.to_local().numel() * 4 for v in state.values())
        measured = {"times": times, "peaks": worst, "largest_shard": largest_shard}
        measured |= {"blocked": blocked, "durable": durable}
        Path(out).write_text(json.dumps(measured))
    dist.destroy_process_group()


@dataclass
class ShardedResult:
    """Medians, ranges and peaks of one run, for the report of ``benchmarks/run.py``."""

    total: int
    times: dict[str, list[float]]
    peaks: dict[str, int]
    largest_shard: int
    blocked: dict[str, list[float]]  # until the training thread may go on (COPY: the copy)
    durable: dict[str, list[float]]  # until the checkpoint is durable on every rank

    def median(self, label: str) -> float:
        return statistics.median(self.times[label])

    def ratios(self) -> list[tuple[str, float]]:
        """(what, ratio) for each of the issues' targets, each met when <= 1."""
        labels = list(self.times)
        size = f"{self.total / MiB:.0f} MiB"
        blocked = {k: statistics.median(v) for k, v in self.blocked.items()}
        durable = {k: statistics.median(v) for k, v in self.durable.items()}
        return [
            (
                f"2-rank sharded save, {size}: burnpack / DCP",
                self.median(labels[0]) / self.median(labels[1]),
            ),
            (
                f"2-rank sharded load, {size}: burnpack / DCP",
                self.median(labels[2]) / self.median(labels[3]),
            ),
            (
                f"2-rank sharded async save, {size}: training thread blocked / "
                "(1.2 x one copy of its shards)",
                blocked[ASYNC_OURS] / (1.2 * blocked[COPY]),
            ),
            (
                f"2-rank sharded async save, {size}: until durable, burnpack / DCP async_save",
                durable[ASYNC_OURS] / durable[ASYNC_DCP],
            ),
        ]

    def markdown(self) -> list[str]:
        lines = [
            f"## Sharded: 2 ranks, {self.total / MiB:.0f} MiB in 16 DTensors (Shard(0))",
            "",
            "Each rank writes and reads its half through torch DCP; gloo CPU processes, one "
            "disk. Peak extra RSS is the larger of the two ranks' (largest shard "
            f"{self.largest_shard / MiB:.1f} MiB).",
            "",
            "| method | median | range | GiB/s | peak extra RSS per rank |",
            "|---|---|---|---|---|",
        ]
        for label, times in self.times.items():
            med = statistics.median(times)
            lines.append(
                f"| {label} | {med:.3f} s | {min(times):.3f}-{max(times):.3f} s | "
                f"{self.total / med / 1024**3:.2f} | {self.peaks[label] / MiB:.1f} MiB |"
            )
        lines += [
            "",
            "Asynchronous saves (slowest rank): how long the training thread waits (ours: the "
            "call; DCP's: until its staging is complete) and how long until the checkpoint is "
            "durable on every rank, beside one plain copy of each rank's shards into buffers "
            "touched before.",
            "",
            "| method | training thread waits | range | durable after | range |",
            "|---|---|---|---|---|",
        ]
        for label, waits in self.blocked.items():
            done = self.durable.get(label)
            after = "-" if done is None else f"{statistics.median(done):.3f} s"
            spread = "-" if done is None else f"{min(done):.3f}-{max(done):.3f} s"
            lines.append(
                f"| {label} | {statistics.median(waits) * 1000:.1f} ms | "
                f"{min(waits) * 1000:.1f}-{max(waits) * 1000:.1f} ms | {after} | {spread} |"
            )
        return lines


def measure(directory: Path, *, quick: bool, reps: int) -> ShardedResult:
    total = (64 if quick else 1024) * MiB
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = directory / "sharded.json"
    root = directory / "sharded"
    root.mkdir(exist_ok=True)
    common = ["--port", str(port), "--total", str(total), "--reps", str(reps)]
    common += ["--root", str(root), "--out", str(out)]
    ranks = [[__file__, "--rank", str(r), *common] for r in range(WORLD)]
    # minutes per GiB and round on a loaded 2-core VM would be a hang, not a measurement
    timeout = 300 + 120 * (reps + 1) * total / GiB
    bounded.run_group(ranks, what=f"sharded, {total / MiB:.0f} MiB on 2 ranks", timeout=timeout)
    data = json.loads(out.read_text())
    shutil.rmtree(root, ignore_errors=True)
    return ShardedResult(
        total,
        data["times"],
        data["peaks"],
        data["largest_shard"],
        data["blocked"],
        data["durable"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    for flag in ("--rank", "--port", "--total"):  # one rank (started by measure)
        parser.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port, args.root, args.total, args.reps, args.out)
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-sharded-") as tmp:
        result = measure(Path(tmp), quick=args.quick, reps=args.reps)
    print("\n".join(result.markdown()))


if __name__ == "__main__":
    main()
