"""``make bench``, object storage: saves and loads to ``s3://`` on a local S3 server, side by side.

A moto S3 server runs in its own process on 127.0.0.1 (so its request handling does not share
the benchmark's interpreter lock) and every method talks to it over HTTP through s3fs, exactly
as it would to a cloud bucket:

- **burnpack**: ``Checkpointer(url).save_checkpoint`` (local scratch file, upload, size check,
  create-only sentinel) and ``load_checkpoint`` (ranged reads, checksums verified) + ``copy_``;
- **Lightning's TorchCheckpointIO**: ``torch.save`` into a memory buffer + one ``fs.pipe``, and
  ``torch.load`` through an fsspec file + ``copy_``;
- **torch DCP** with ``FsspecWriter`` / ``FsspecReader`` (single process), loading in place.

What dominates here is the server: moto handles each request in Python, copies the whole object
for every ranged GET and assembles a completed multipart upload for ~20 s per GiB (longer than
s3fs's 15 s read timeout, so completions are retried), so absolute numbers are far below a cloud
bucket's; the ratios say how much each format adds on top of moving the bytes.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord

MiB = 1024 * 1024
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


class Server:
    """``python -m moto.server`` on a free port of 127.0.0.1; the AWS_* variables point at it."""

    def __enter__(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.2)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        fsspec.filesystem("s3").clear_instance_cache()
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def _copy_into(sd: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, target in sd.items():
            target.copy_(tensors[k])


def methods(sd: dict[str, torch.Tensor], url: str) -> dict[str, Callable[[], None]]:
    """label -> one timed operation; saves come before the loads that read them."""
    fsspec.filesystem("s3").mkdir(url[5:].partition("/")[0])  # the bucket
    checkpointer = Checkpointer(f"{url}/bpk", checkpoint_duration=1)
    torch_io = TorchCheckpointIO()
    torch_path, dcp_path = f"{url}/torch/last.ckpt", f"{url}/dcp"

    def save_bpk() -> None:
        checkpointer.save_checkpoint(0, {"model": ModuleRecord(sd)})

    def load_bpk() -> None:
        _copy_into(sd, checkpointer.load_checkpoint(0)["model"].tensors)

    def save_torch() -> None:
        torch_io.save_checkpoint({"state_dict": sd}, torch_path)

    def load_torch() -> None:
        _copy_into(sd, torch_io.load_checkpoint(torch_path, weights_only=True)["state_dict"])

    def save_dcp() -> None:
        dcp.save(sd, storage_writer=FsspecWriter(dcp_path, sync_files=False))

    def load_dcp() -> None:
        dcp.load(sd, storage_reader=FsspecReader(dcp_path))

    return {
        "burnpack Checkpointer save": save_bpk,
        "Lightning TorchCheckpointIO save": save_torch,
        "DCP FsspecWriter save": save_dcp,
        "burnpack Checkpointer load": load_bpk,
        "Lightning TorchCheckpointIO load": load_torch,
        "DCP FsspecReader load (in place)": load_dcp,
    }


def _run(
    ops: dict[str, Callable[[], None]], reps: int
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """A warm-up round, then ``reps`` rounds; saves in shuffled order, then loads likewise.
    A method that raises is reported with its error and not run again (nor its load)."""
    times: dict[str, list[float]] = {label: [] for label in ops}
    failed: dict[str, str] = {}
    saves = [k for k in ops if k.endswith("save")]
    loads = [k for k in ops if k not in saves]
    for round_ in range(reps + 1):
        for group in (saves, loads):
            for label in random.sample(group, len(group)):
                if label in failed or _save_of(label) in failed:
                    continue
                start = time.perf_counter()
                try:
                    ops[label]()
                except Exception as e:
                    failed[label] = f"{type(e).__name__}: {e}"[:300].replace("|", "/")
                    continue
                elapsed = time.perf_counter() - start
                print(f"  {label}: {elapsed:.2f} s", file=sys.stderr, flush=True)  # progress
                if round_:
                    times[label].append(elapsed)
    return times, failed


def _save_of(label: str) -> str:
    """The save a load reads ("... load (in place)" -> "... save")."""
    return label.replace("Reader", "Writer").split(" load")[0] + " save"


def measure(states: dict[str, tuple[int, int]], reps: int) -> list[str]:
    """Markdown lines: one table per state, median and range, with MiB/s."""
    lines = [
        "## Object storage (s3:// on a local moto server)",
        "",
        *__doc__.split("\n\n", 1)[1].strip().splitlines(),
        "",
    ]
    with Server():
        for state, (count, nbytes) in states.items():
            generator = torch.Generator().manual_seed(0)
            sd = {
                f"layers.{i}.weight": torch.empty(nbytes // 4).uniform_(-1, 1, generator=generator)
                for i in range(count)
            }
            url = f"s3://bench-{uuid.uuid4().hex[:12]}/{len(lines)}"
            total = sum(t.nbytes for t in sd.values())
            times, failed = _run(methods(sd, url), reps)
            lines += [
                f"### {state}",
                "",
                "| method | median | range | MiB/s |",
                "|---|---|---|---|",
            ]
            for label, values in times.items():
                if not values:
                    why = failed.get(label) or failed.get(_save_of(label), "not run")
                    lines.append(f"| {label} | failed: {why} | | |")
                    continue
                median = statistics.median(values)
                lines.append(
                    f"| {label} | {median:.3f} s | {min(values):.3f}-{max(values):.3f} s | "
                    f"{total / MiB / median:.0f} |"
                )
            lines.append("")
            del sd
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--big", action="store_true", help="also the 1 GiB state")
    args = parser.parse_args()
    chosen = {"64 MiB (16 tensors)": (16, 4 * MiB)}
    if args.big:
        chosen["1 GiB (16 tensors)"] = (16, 64 * MiB)
    print("\n".join(measure(chosen, args.reps)))
