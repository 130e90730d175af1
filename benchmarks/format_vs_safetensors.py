"""Save and load a 1 GiB state (16 x 64 MiB float32): burnpack vs safetensors, one machine, one run.

Both saves are durable: burnpack ``write`` is atomic (scratch file, fsync, rename, directory
fsync); safetensors ``save_file`` is followed by an fsync of the file. Loads are "open, get every
tensor, touch every byte" (a sum), so lazy and eager readers do the same work; burnpack also
verifies its per-tensor checksums (a row with ``verify=False`` shows their cost), and a row
adds ``clone()`` to own the memory. Runs are interleaved after a warm-up; the page cache is warm for
every load (the file was just written). Prints median and [min, max] over ``--reps`` runs.

    .venv/bin/python benchmarks/format_vs_safetensors.py [--reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

from lightning_bpk import burnpack

TENSORS, TENSOR_MIB = 16, 64  # 1 GiB in large tensors, like a mid-size model's weights
MiB = 1024 * 1024


def make_state() -> dict[str, torch.Tensor]:
    numel = TENSOR_MIB * MiB // 4
    return {f"layers.{i}.weight": torch.randn(numel, dtype=torch.float32) for i in range(TENSORS)}


def save_bpk(state: dict[str, torch.Tensor], path: Path) -> None:
    burnpack.write(path, state)


def save_st(state: dict[str, torch.Tensor], path: Path) -> None:
    safetensors.torch.save_file(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.sum()) for t in tensors.values())


def load_bpk(path: Path, verify: bool = True) -> float:
    with burnpack.read(path) as pack:
        return touch(pack.tensors(verify=verify))


def load_bpk_owned(path: Path) -> float:
    with burnpack.read(path) as pack:
        return touch({n: t.clone() for n, t in pack.tensors().items()})


def load_st(path: Path) -> float:
    return touch(safetensors.torch.load_file(path))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()
    state = make_state()
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 1024**3
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bpk, st = Path(tmp) / "state.bpk", Path(tmp) / "state.safetensors"
        cases: dict[str, Callable[[], object]] = {
            "save  burnpack.write (atomic, fsync)": lambda: save_bpk(state, bpk),
            "save  safetensors.save_file + fsync": lambda: save_st(state, st),
            "load  burnpack.read + tensors + touch": lambda: load_bpk(bpk),
            "load  same, verify=False (no checksums)": lambda: load_bpk(bpk, verify=False),
            "load  burnpack.read + clone + touch": lambda: load_bpk_owned(bpk),
            "load  safetensors.load_file + touch": lambda: load_st(st),
        }
        for fn in cases.values():  # warm-up: allocator, page cache, lazy imports
            fn()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, fn in cases.items():
                times[name].append(timed(fn))
        size_bpk, size_st = bpk.stat().st_size, st.stat().st_size
    print(f"state: {TENSORS} x {TENSOR_MIB} MiB float32 = {gib:.2f} GiB; {args.reps} reps")
    print(f"file sizes: burnpack {size_bpk} B, safetensors {size_st} B\n")
    print(f"{'case':40s} {'median s':>9s} {'GiB/s':>7s}  range s")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:40s} {med:9.3f} {gib / med:7.2f}  [{min(ts):.3f}, {max(ts):.3f}]")


if __name__ == "__main__":
    main()
