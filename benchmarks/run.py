"""``make bench``: durable saves and loads of burnpack vs torch.save, safetensors and DCP.

Everything runs in one process, side by side, on the same tensors and the same disk; what is
compared is in ``benchmarks/methods.py`` (the limits: raw buffered and raw ``O_DIRECT`` writes,
raw ``readinto``; burnpack's writers and loaders; torch.save, safetensors, DCP ``save`` and DCP
``async_save`` in thread mode), the page and its targets in ``benchmarks/report.py``. Beside
them:

- **object storage**: the same saves and loads to ``s3://`` on a local moto server, burnpack
  vs Lightning's ``TorchCheckpointIO`` vs DCP's ``FsspecWriter`` (``benchmarks/object_store.py``);
- **opening** a pack (header and metadata only) and **peak extra RSS while saving** (a fresh
  subprocess per method: warm-up save, reset the high-water mark through
  ``/proc/self/clear_refs``, save again, read ``VmHWM``);
- **sharded** saves and loads on 2 gloo ranks, ``BurnpackStorageWriter``/``Reader`` vs DCP's
  ``FileSystemWriter``/``Reader`` (``benchmarks/sharded.py``; ``--no-sharded`` skips them);
- **a checkpoint every 50 steps** of a plain loop at three state sizes, per way of saving
  (sync, async thread, async overlapped + writer process, DCP ``async_save``,
  ``ModelCheckpoint``'s ``torch.save``): the training thread's blocked time, the added loop
  time per save and the overhead (``benchmarks/overlap.py``).

States: 16 float32 tensors of 64 MiB in total, 16 of 1 GiB in total, and 5,000 tensors of
4 KiB. Every method runs once as a warm-up (these VMs fault never-touched memory in at several
seconds per GiB, which would otherwise dominate), then ``--reps`` interleaved rounds (the order
is shuffled each round); the tables give the median, the range and the spread (max/min). The
warm-up round also checks that each load really produced the saved bytes. The end-to-end section
trains the example with and without checkpoints (per epoch, every 50 steps, and a Fabric loop;
interleaved runs) and reports each overhead two ways: over the whole run, and per step in
steady state (``fabric.step_overhead``, the measure the targets are judged by).

It writes ``docs/benchmarks.md`` and ``docs/img/benchmarks.svg``::

    .venv/bin/python benchmarks/run.py            # full: all states, 5 rounds (~15-20 min)
    .venv/bin/python benchmarks/run.py --quick    # 64 MiB + small tensors, 3 rounds (~3 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bounded
import e2e
import fabric
import numpy
import object_store
import overlap
import report
import safetensors
import save_parts
import sharded
import torch
import xxhash
from methods import (
    COLD_LOADS,
    LOADS,
    METHODS,
    QUICK_STATES,
    SAVES,
    STATES,
    Bench,
    Method,
    Model,
    direct_supported,
    prepare,
    save_raw_direct,
)
from report import Result

from lightning_bpk import burnpack

REPO = Path(__file__).resolve().parent.parent
OPEN_REPS = 30  # opening a pack takes microseconds to milliseconds: many repetitions
PEAK_RSS_TIMEOUT = 600  # two saves of at most 1 GiB: far longer is a hang (bounded.py)


def _digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(t)) for k, t in tensors.items()}


# --- measuring ------------------------------------------------------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rows(saves: list[Method], loads: list[Method]) -> dict[str, Result]:
    rows = {}
    for kind, ms in (("save", saves), ("load", loads)):
        for m in ms:
            rows[m.label] = Result(m.label, m.family, kind, [])
            if m.durable is not None:
                rows[m.durable] = Result(m.durable, m.family, kind, [])
    return rows


def measure(b: Bench, reps: int, saves: list[Method], loads: list[Method]) -> list[Result]:
    """Warm-up round (with a correctness check of every load), then ``reps`` shuffled rounds."""
    expected = _digest(b.sd)
    results = _rows(saves, loads)
    for rnd in range(reps + 1):
        warm_up = rnd == 0
        for group in (saves, loads):
            # A shuffled order, not a rotation: a rotation keeps each method's predecessor, and
            # on these VMs a writer that follows a temp+rename writer reuses the page cache the
            # replaced file just freed while its successor faults in fresh memory (ModuleRecord.save
            # measured 1.35 s right after burnpack.write's 2.15 s on the same write path).
            for m in random.Random(rnd).sample(group, len(group)) if rnd else group:
                if warm_up and group is loads:
                    with torch.no_grad():
                        for t in b.sd.values():
                            t.zero_()
                prepare(b, m)
                elapsed = _timed(lambda m=m: m.run(b))
                durable = elapsed + _timed(lambda m=m: m.after(b)) if m.after else elapsed
                if warm_up and group is loads and _digest(b.sd) != expected:
                    raise AssertionError(f"{b.name}: {m.label} did not load the saved bytes")
                if not warm_up:
                    results[m.label].times.append(elapsed)
                    if m.durable is not None:
                        results[m.durable].times.append(durable)
        print(f"  {b.name}: round {rnd}/{reps} done", flush=True)
    pack_path = b.path("state.bpk")
    opens = [_timed(lambda: burnpack.read(pack_path).close()) for _ in range(OPEN_REPS + 1)][1:]
    opened = Result("burnpack.read (header + metadata)", "burnpack", "open", opens)
    return [*results.values(), opened]


def peak_rss_child(state: str, method: str, directory: str) -> None:
    """Subprocess body: peak RSS above the baseline during one (warm) save, printed as JSON."""
    count, nbytes = STATES[state]
    b = Bench(state, Model(count, nbytes), Path(directory))
    m = METHODS[method]
    m.run(b)  # warm-up: imports, allocator, page cache, async staging buffers
    if m.after is not None:
        m.after(b)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status_kib("VmRSS")
    m.run(b)
    peak = _status_kib("VmHWM")
    if m.after is not None:
        m.after(b)
    print(json.dumps({"extra_bytes": (peak - baseline) * 1024}))


def _status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def peak_rss(state: str, directory: Path, saves: list[Method]) -> dict[str, int]:
    """Peak extra RSS of every save method on ``state``, each in a fresh subprocess."""
    peaks = {}
    for m in saves:
        sub = directory / "rss"
        sub.mkdir(exist_ok=True)
        (out,) = bounded.run_group(
            [[__file__, "--peak-rss-child", state, m.label, str(sub)]],
            what=f"peak RSS of {m.label}, {state}",
            timeout=PEAK_RSS_TIMEOUT,
            cwd=REPO,
        )
        peaks[m.label] = json.loads(out.strip().splitlines()[-1])["extra_bytes"]
        shutil.rmtree(sub)
    return peaks


# --- the machine --------------------------------------------------------------------------------


def _mount_of(path: Path) -> str:
    best = ("", "?", "?", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, point, fstype, options = line.split()[:4]
        if str(path.resolve()).startswith(point) and len(point) >= len(best[0]):
            best = (point, device, fstype, options)
    return f"{best[2]} on {best[1]} (mounted at {best[0]}, {best[3]})"


def machine(directory: Path) -> dict[str, str]:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = _meminfo_kib("MemTotal")
    return {
        "CPU": f"{cpu}, {os.cpu_count()} cores",
        "RAM": f"{mem_kib / 1024**2:.1f} GiB",
        "Filesystem": _mount_of(directory),
        "Kernel": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "Libraries": (
            f"torch {torch.__version__}, safetensors {safetensors.__version__}, "
            f"numpy {numpy.__version__}, xxhash {xxhash.VERSION}"
        ),
    }


def _meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB and small tensors, 3 rounds")
    parser.add_argument("--reps", type=int, default=None, help="rounds after the warm-up")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--no-e2e", action="store_true", help="skip the training run")
    parser.add_argument("--no-s3", action="store_true", help="skip the object-storage rows")
    parser.add_argument("--no-sharded", action="store_true", help="skip the 2-rank DCP rows")
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--peak-rss-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_rss_child:
        peak_rss_child(*args.peak_rss_child)
        return
    args.reps = args.reps or (3 if args.quick else 5)
    states = QUICK_STATES if args.quick else tuple(STATES)
    start = time.perf_counter()
    by_state: dict[str, dict[str, Result]] = {}
    benches: dict[str, Bench] = {}
    peaks: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lightning-bpk-bench-") as tmp:
        info = machine(Path(tmp))
        info["Load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        saves = SAVES
        why_not = direct_supported(Path(tmp))
        if why_not is not None:  # the limit cannot be measured here; burnpack writes buffered
            info["O_DIRECT"] = f"not on this filesystem ({why_not}): no raw O_DIRECT row"
            saves = [m for m in SAVES if m.run is not save_raw_direct]
        for state in states:
            count, nbytes = STATES[state]
            directory = Path(tmp) / str(len(benches))
            directory.mkdir()
            b = Bench(state, Model(count, nbytes), directory)
            benches[state] = b
            loads = LOADS + (COLD_LOADS if state in report.LARGE else [])
            try:
                by_state[state] = {r.label: r for r in measure(b, args.reps, saves, loads)}
            finally:
                b.close()
            peak_state = "1 GiB (16 tensors)" if not args.quick else "64 MiB (16 tensors)"
            if state == peak_state:
                peaks[state] = peak_rss(state, directory, saves)
            del b.model, b.sd  # free the state before the next one
            shutil.rmtree(directory)
        sharded_result = None
        if not args.no_sharded:
            sharded_result = sharded.measure(Path(tmp), quick=args.quick, reps=args.reps)
        e2e_results: list[
            e2e.Overhead
            | e2e.StepOverhead
            | save_parts.FirstSave
            | fabric.FabricOverhead
            | overlap.OverlapResult
        ] = []
        if not args.no_e2e:
            e2e_results.append(e2e.measure(Path(tmp), quick=args.quick))
            if not args.quick:
                e2e_results.append(e2e.measure(Path(tmp), quick=False, repeat=e2e.REPEAT))
            e2e_results.append(e2e.measure_steps(Path(tmp), quick=args.quick))
            e2e_results.append(save_parts.measure_first_save(Path(tmp), quick=args.quick))
            e2e_results.append(fabric.measure(Path(tmp), quick=args.quick))
            e2e_results.append(overlap.measure(Path(tmp), quick=args.quick))
        s3_states = {k: STATES[k] for k in ("64 MiB (16 tensors)", "1 GiB (16 tensors)")}
        if args.quick:
            s3_states.pop("1 GiB (16 tensors)")
        s3_lines = [] if args.no_s3 else object_store.measure(s3_states, args.reps)
        info["Load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report.write(
        Path(args.out),
        info,
        by_state,
        benches,
        peaks,
        e2e_results,
        sharded_result,
        args.reps,
        time.perf_counter() - start,
        s3_lines,
    )
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
