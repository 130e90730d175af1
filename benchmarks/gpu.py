"""Saves and loads of a GPU-resident training state: lightning_bpk vs DCP and safetensors.

For each state size (``--sizes``, GiB; default 1, 4 and 16), a state of bf16 weights with fp32
Adam moments (10 bytes per parameter, in tensors of at most 256 Mi elements) lives on the GPU
as the parameters of one module. Side by side, on the same tensors and the same disk:

- **one pinned device-to-host copy** of the state into preallocated pinned buffers (the
  reference: the issue's target is an async save blocking at most 1.2x this);
- **lightning_bpk async save** (:class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`
  ``save_checkpoint``): the time the call blocks the training thread, the time until the
  training stream may run on (the copies it must wait for on the device), the time until the
  checkpoint is durable, and the device memory allocated beyond the state meanwhile;
- **DCP** ``async_save`` (thread mode) with ``DefaultStager(StagingOptions(use_pinned_memory=
  True, use_non_blocking_copy=True, use_async_staging=True))``: the call, until staged (when
  the state may change again), until durable, and the extra device memory;
- **loads into the device parameters**, the file's pages dropped from the cache first (cold):
  ``ModuleRecord.load(path).apply(module)`` and ``ModuleRecord.load(path, device="cuda")``
  vs ``safetensors.torch.load_file(path, device="cuda")`` (the anchor), checksums included for
  burnpack (safetensors has none).

Then a **step-overhead** run: a small transformer trained on the GPU for ``--steps`` steps,
with and without an async checkpoint every ``--every`` steps (interleaved runs, ``--reps`` of
each; the median is compared).

It prints a Markdown table and writes it to ``--out``. Not part of ``make bench``::

    .venv/bin/python benchmarks/gpu.py --sizes 1,4,16 --out gpu-benchmarks.md

Exit status: 0 after a run; **2 when torch sees no CUDA device** (a message says so, nothing is
measured). ``--device cpu`` runs the same code on the host (pageable buffers, no streams) with
small ``--sizes`` to check the script where no GPU is; those numbers are not a GPU's.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

EXIT_NO_CUDA = 2
GiB = 1024**3
_BYTES_PER_PARAM = 2 + 4 + 4  # bf16 weight, fp32 exp_avg, fp32 exp_avg_sq
_MAX_ELEMENTS = 256 * 1024 * 1024


def _state(gib: float, device: torch.device) -> nn.Module:
    """A module whose parameters are the state: ``w<i>`` bf16, ``m<i>``/``v<i>`` fp32."""
    params = int(gib * GiB / _BYTES_PER_PARAM)
    pieces = max(1, math.ceil(params / _MAX_ELEMENTS))
    state = nn.ParameterDict()
    for i in range(pieces):
        n = params // pieces + (1 if i < params % pieces else 0)
        state[f"w{i}"] = nn.Parameter(torch.randn(n, device=device, dtype=torch.bfloat16))
        state[f"m{i}"] = nn.Parameter(torch.randn(n, device=device))
        state[f"v{i}"] = nn.Parameter(torch.rand(n, device=device))
    return state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _drop_cache(path: Path) -> None:
    """Drop ``path`` (a file or every file under a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _extra_memory(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the device memory allocated beyond what was allocated before it."""
    if device.type != "cuda":
        return fn(), 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    _sync(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def _pinned_copy(state: nn.Module, device: torch.device) -> float:
    """One device-to-host copy of the state into preallocated (pinned on a GPU) buffers."""
    pinned = device.type == "cuda"
    sources = [p.detach() for p in state.parameters()]
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in sources]
    for dst, src in zip(buffers, sources, strict=True):  # first touch outside the timing
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for dst, src in zip(buffers, sources, strict=True):
        dst.copy_(src, non_blocking=pinned)
    _sync(device)
    return time.perf_counter() - start


def _ours(state: nn.Module, device: torch.device, scratch: Path, reps: int) -> dict[str, float]:
    from lightning_bpk.checkpointer import Checkpointer
    from lightning_bpk.records import ModuleRecord
    from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

    checkpointer = Checkpointer(scratch / "ours", checkpoint_duration=2)
    rows: dict[str, list[float]] = {"blocks": [], "stream": [], "durable": [], "memory": []}
    with AsyncCheckpointSaver() as saver:
        saver.save_checkpoint(checkpointer, 0, {"model": ModuleRecord.from_module(state)})
        saver.wait()  # the warm-up: staging buffers allocated and pinned, first touch done
        for rep in range(1, reps + 1):
            _sync(device)

            def save(rep: int = rep) -> tuple[float, float, float]:
                start = time.perf_counter()
                record = ModuleRecord.from_module(state)
                saver.save_checkpoint(checkpointer, rep, {"model": record})
                blocks = time.perf_counter() - start
                _sync(device)
                stream = time.perf_counter() - start
                saver.wait()
                return blocks, stream, time.perf_counter() - start

            (blocks, stream, durable), memory = _extra_memory(device, save)
            for key, value in zip(rows, (blocks, stream, durable, memory), strict=True):
                rows[key].append(value)
    return {k: statistics.median(v) for k, v in rows.items()}


def _dcp(state: nn.Module, device: torch.device, scratch: Path, reps: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    gpu = device.type == "cuda"
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=gpu,
            use_shared_memory=False,  # thread mode: no second process to share with
            use_async_staging=True,
            use_non_blocking_copy=gpu,
        )
    )
    sd = {k: v.detach() for k, v in state.state_dict().items()}
    rows: dict[str, list[float]] = {"blocks": [], "staged": [], "durable": [], "memory": []}
    for rep in range(reps + 1):  # rep 0: the warm-up (the stager caches its buffers)
        _sync(device)

        def save(rep: int = rep) -> tuple[float, float, float]:
            start = time.perf_counter()
            response = dcp.async_save(
                sd,
                checkpoint_id=scratch / f"dcp-{rep}",
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                async_stager=stager,
            )
            blocks = time.perf_counter() - start
            assert isinstance(response, AsyncSaveResponse)
            response.staging_completion.result()
            staged = time.perf_counter() - start
            response.upload_completion.result()
            return blocks, staged, time.perf_counter() - start

        (blocks, staged, durable), memory = _extra_memory(device, save)
        shutil.rmtree(scratch / f"dcp-{rep}", ignore_errors=True)
        if rep:
            for key, value in zip(rows, (blocks, staged, durable, memory), strict=True):
                rows[key].append(value)
    stager.close()
    return {k: statistics.median(v) for k, v in rows.items()}


def _loads(state: nn.Module, device: torch.device, scratch: Path, reps: int) -> dict[str, float]:
    import safetensors.torch

    from lightning_bpk.records import ModuleRecord

    bpk = ModuleRecord.from_module(state).save(scratch / "state.bpk")
    st = scratch / "state.safetensors"
    safetensors.torch.save_file({k: v.detach().cpu() for k, v in state.state_dict().items()}, st)
    methods: dict[str, Callable[[], Any]] = {
        "apply": lambda: ModuleRecord.load(bpk).apply(state),
        "to_device": lambda: ModuleRecord.load(bpk, device=device),
        "safetensors": lambda: safetensors.torch.load_file(st, device=str(device)),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(reps + 1):  # rep 0: the warm-up
        for name, load in methods.items():
            _drop_cache(bpk)
            _drop_cache(st)
            _sync(device)

            def run(load: Callable[[], Any] = load) -> None:
                result = load()
                _sync(device)
                del result

            elapsed, _ = _timed(run)
            if rep:
                times[name].append(elapsed)
    return {name: statistics.median(v) for name, v in times.items()}


def _train(device: torch.device, steps: int, every: int | None, scratch: Path) -> float:
    """Seconds for ``steps`` steps of a small transformer, checkpointing every ``every``."""
    from lightning_bpk.checkpointer import Checkpointer
    from lightning_bpk.records import ModuleRecord, OptimizerRecord
    from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = nn.TransformerEncoder(layer, 6).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 128, 512, device=device)
    checkpointer = Checkpointer(scratch, checkpoint_frequency=every or 1, checkpoint_duration=2)
    with AsyncCheckpointSaver() as saver:
        _sync(device)
        start = time.perf_counter()
        for step in range(steps):
            loss = model(x).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if every and step % every == 0:
                data = {
                    "model": ModuleRecord.from_module(model),
                    "optim": OptimizerRecord.from_optimizer(optimizer, model),
                }
                saver.save_checkpoint(checkpointer, step, data)
        _sync(device)
        elapsed = time.perf_counter() - start
    return elapsed


def _overhead(device: torch.device, steps: int, every: int, reps: int, scratch: Path) -> str:
    _train(device, min(steps, 2 * every), every, scratch / "warm")  # warm-up: kernels, buffers
    without, with_ = [], []
    for rep in range(reps):
        without.append(_train(device, steps, None, scratch / f"none-{rep}"))
        with_.append(_train(device, steps, every, scratch / f"ckpt-{rep}"))
    base, ckpt = statistics.median(without), statistics.median(with_)
    return (
        f"| {steps} steps, a checkpoint every {every} | {base:.2f} s | {ckpt:.2f} s | "
        f"{100 * (ckpt / base - 1):+.1f}% |"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16", help="state sizes in GiB, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per method")
    parser.add_argument("--steps", type=int, default=500, help="steps of the overhead run")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--out", default="gpu-benchmarks.md", help="Markdown file to write")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: torch sees no CUDA device on this machine; nothing measured "
            f"(exit {EXIT_NO_CUDA}). Run it on a machine with a GPU.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (check run)"
    lines = [
        f"# GPU checkpoint benchmark ({name}, torch {torch.__version__})",
        "",
        f"Medians of {args.reps} rounds after a warm-up. State: bf16 weights + fp32 Adam moments.",
        "",
        "| state | pinned D2H copy | bpk: blocks | bpk: stream free | bpk: durable "
        "| bpk: extra device mem | DCP: blocks | DCP: staged | DCP: durable "
        "| DCP: extra device mem | load: apply | load: device= | safetensors load_file |",
        "|---" * 13 + "|",
    ]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpu-bench-") as tmp:
        scratch = Path(tmp)
        for gib in sizes:
            state = _state(gib, device)
            copy = _pinned_copy(state, device)
            ours = _ours(state, device, scratch / f"{gib}", args.reps)
            shutil.rmtree(scratch / f"{gib}", ignore_errors=True)
            theirs = _dcp(state, device, scratch, args.reps)
            (scratch / "loads").mkdir(exist_ok=True)
            loads = _loads(state, device, scratch / "loads", args.reps)
            shutil.rmtree(scratch / "loads")
            row = (
                f"| {gib:g} GiB | {_ms(copy)} | {_ms(ours['blocks'])} | {_ms(ours['stream'])} "
                f"| {_ms(ours['durable'])} | {_mib(ours['memory'])} | {_ms(theirs['blocks'])} "
                f"| {_ms(theirs['staged'])} | {_ms(theirs['durable'])} "
                f"| {_mib(theirs['memory'])} | {_ms(loads['apply'])} "
                f"| {_ms(loads['to_device'])} | {_ms(loads['safetensors'])} |"
            )
            lines.append(row)
            print(row, flush=True)
            del state
            if device.type == "cuda":
                torch.cuda.empty_cache()
        lines += [
            "",
            "| step overhead | without checkpoints | with | overhead |",
            "|---|---|---|---|",
            _overhead(device, args.steps, args.every, args.reps, scratch / "train"),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
