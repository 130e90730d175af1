"""The page ``benchmarks/run.py`` writes: the results, the targets of the issues, the chart."""

from __future__ import annotations

import datetime
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import chart
import e2e
import methods
import overlap
import save_parts
import sharded

# Targets of issue 6 (ratios of medians measured in the same run; at most).
VS_SAFETENSORS = 1.0
SAVE_VS_RAW = 1.5
LOAD_VS_RAW = 1.1
OPEN_LIMIT_S = 0.010
E2E_LIMIT = 0.02
PEAK_SLACK = 16 * methods.MiB  # peak extra RSS while saving <= largest tensor + this
# Targets of issue 23 (throughput ratios in the same run; at least).
SLOWEST_VS_DIRECT = 0.85  # 1 GiB save: the slowest round against raw O_DIRECT's median
VS_BUFFERED_PEER = 1.0  # 1 GiB save: the median against the fastest buffered peer's
LOAD_VS_SAFETENSORS = 1.0  # loads at 64 MiB and 1 GiB, and 5,000 x 4 KiB save and load
BUFFERED_PEERS = ("torch.save + fsync", "safetensors save_file + fsync", "DCP save (sync_files)")
LARGE = ("64 MiB (16 tensors)", "1 GiB (16 tensors)")


@dataclass
class Result:
    label: str
    family: str
    kind: str  # "save" | "load" | "open"
    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """max / min: 1.0 for a perfectly repeatable method."""
        return max(self.times) / min(self.times)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _table(results: list[Result], nbytes: int) -> list[str]:
    lines = [
        "| | method | median | range | spread | GiB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rate = f"{nbytes / r.median / 1024**3:.2f}" if r.kind != "open" else ""
        lines.append(
            f"| {r.kind} | {r.label} | {_fmt(r.median)} | {_fmt(min(r.times))} - "
            f"{_fmt(max(r.times))} | {r.spread:.2f} | {rate} |"
        )
    return lines


@dataclass
class Target:
    what: str
    measured: float
    limit: float
    unit: str = "x"
    at_least: bool = False  # a throughput ratio (more is better); else a time or size limit

    @property
    def met(self) -> bool:
        return self.measured >= self.limit if self.at_least else self.measured <= self.limit

    def row(self) -> str:
        def show(v: float) -> str:
            if self.unit == "s":
                return f"{v * 1000:.2f} ms"
            if self.unit == "B":
                return f"{v / methods.MiB:.1f} MiB"
            if self.unit == "%":
                return f"{v * 100:.2f} %"
            return f"{v:.2f}x"

        verdict = "met" if self.met else "**missed**"
        bound = (">= " if self.at_least else "<= ") + show(self.limit)
        return f"| {self.what} | {show(self.measured)} | {bound} | {verdict} |"


def _issue6(state: str, res: dict[str, Result]) -> list[Target]:
    med = {k: r.median for k, r in res.items()}
    save, load = med["burnpack.write"], med["burnpack.read_into"]
    out = [
        Target(
            f"{state}: save / safetensors",
            save / med["safetensors save_file + fsync"],
            VS_SAFETENSORS,
        )
    ]
    if state.startswith("5,000"):
        out.append(
            Target(
                f"{state}: load / safetensors",
                load / med["safetensors load_file + copy_"],
                VS_SAFETENSORS,
            )
        )
    else:
        out.append(
            Target(f"{state}: save / raw write+fsync", save / med["raw write + fsync"], SAVE_VS_RAW)
        )
        out.append(
            Target(
                f"{state}: load into params / raw readinto", load / med["raw readinto"], LOAD_VS_RAW
            )
        )
    if state.startswith("1 GiB"):
        opened = res["burnpack.read (header + metadata)"].median
        out.append(Target(f"{state}: open a pack", opened, OPEN_LIMIT_S, "s"))
    return out


def _issue23(state: str, res: dict[str, Result]) -> list[Target]:
    """Throughput ratios (burnpack's against the reference's): at least the limit."""
    med = {k: r.median for k, r in res.items()}
    write = res["burnpack.write"]
    out = []
    if state.startswith("1 GiB") and "raw O_DIRECT write + fsync" in med:
        out.append(
            Target(
                f"{state}: save, slowest round / raw O_DIRECT median (issue 23)",
                med["raw O_DIRECT write + fsync"] / max(write.times),
                SLOWEST_VS_DIRECT,
                at_least=True,
            )
        )
    if state.startswith("1 GiB"):
        fastest = min(BUFFERED_PEERS, key=lambda k: med[k])
        out.append(
            Target(
                f"{state}: save, median / fastest buffered peer ({fastest}) (issue 23)",
                med[fastest] / write.median,
                VS_BUFFERED_PEER,
                at_least=True,
            )
        )
    safetensors = med["safetensors load_file + copy_"]
    loads = ["burnpack.read_into"] + (["ModuleRecord.load + apply"] if state in LARGE else [])
    for label in loads:
        out.append(
            Target(
                f"{state}: {label} / safetensors load_file + copy_ (issue 23)",
                safetensors / med[label],
                LOAD_VS_SAFETENSORS,
                at_least=True,
            )
        )
    if state.startswith("5,000"):
        out.append(
            Target(
                f"{state}: burnpack.write / safetensors save_file + fsync (issue 23)",
                med["safetensors save_file + fsync"] / write.median,
                LOAD_VS_SAFETENSORS,
                at_least=True,
            )
        )
    return out


def targets(
    by_state: dict[str, dict[str, Result]],
    peaks: dict[str, dict[str, int]],
    benches: dict[str, methods.Bench],
    e2e_results: list[Any],
    sharded_result: sharded.ShardedResult | None,
) -> list[Target]:
    out = [t for state, res in by_state.items() for t in _issue6(state, res)]
    for state, peak in peaks.items():
        limit = benches[state].largest + PEAK_SLACK
        out.append(
            Target(f"{state}: peak extra RSS, burnpack.write", peak["burnpack.write"], limit, "B")
        )
    for result in e2e_results:
        if isinstance(result, overlap.OverlapResult):
            out += [Target(what, measured, limit) for what, measured, limit in result.targets()]
            continue
        if isinstance(result, save_parts.FirstSave):
            continue  # a table of its own, no target
        if isinstance(result, e2e.StepOverhead):
            what = (
                f"digits, every {e2e.STEP_INTERVAL} steps: the training thread's part of an "
                "async save / ModelCheckpoint's dump_checkpoint + torch.save into memory"
            )
            dumped = statistics.median(result.dumped)
            out.append(Target(what, statistics.median(result.blocked) / dumped, 1.0))
            what = what.replace("an async save", 'an async_save="process" save')
            out.append(Target(what, statistics.median(result.blocked_process) / dumped, 1.0))
        what = getattr(result, "what", "training with async per-epoch checkpoints: overhead")
        if result.repeat != 1 and not hasattr(result, "what"):
            what += f" (extra row: data passed {result.repeat}x per epoch, longer epochs)"
        out.append(Target(what, result.overhead, getattr(result, "limit", E2E_LIMIT), "%"))
    if sharded_result is not None:
        out += [Target(what, ratio, 1.0) for what, ratio in sharded_result.ratios()]
    return out + [t for state, res in by_state.items() for t in _issue23(state, res)]


def write(
    path: Path,
    info: dict[str, str],
    by_state: dict[str, dict[str, Result]],
    benches: dict[str, methods.Bench],
    peaks: dict[str, dict[str, int]],
    e2e_results: list[Any],
    sharded_result: sharded.ShardedResult | None,
    reps: int,
    elapsed: float,
    object_store_lines: list[str],
) -> None:
    svg = path.parent / "img" / (path.stem + ".svg")  # beside the report, never over the repo's
    svg.parent.mkdir(parents=True, exist_ok=True)
    panels = [
        (
            f"{state}: {kind} (median, bar = min-max)",
            [
                chart.Bar(r.label, r.family, r.median, min(r.times), max(r.times))
                for r in res.values()
                if r.kind == kind
            ],
        )
        for state, res in by_state.items()
        for kind in ("save", "load")
    ]
    svg.write_text(chart.render(panels))
    goals = targets(by_state, peaks, benches, e2e_results, sharded_result)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{' '.join(['benchmarks/run.py', *sys.argv[1:]])}` on "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} in {elapsed / 60:.1f} min "
        f"({reps} rounds after a warm-up, interleaved; median, range and spread = max/min). "
        "Do not edit: `make bench` rewrites this page.",
        "",
        "## Machine",
        "",
        *(f"- **{k}:** {v}" for k, v in info.items()),
        "",
        "## Targets (issues 6 and 23)",
        "",
        "| target | measured | limit | |",
        "|---|---|---|---|",
        *(t.row() for t in goals),
        "",
        "Saves are durable: every method ends with the file fsynced (burnpack also renames a "
        "scratch file into place and fsyncs the directory, and checksums every tensor; it writes "
        "with `O_DIRECT` where the filesystem supports it). Loads read into the module's "
        "existing parameters; burnpack verifies every checksum on the way. Each load's file is "
        "read once through the page cache first (an `O_DIRECT` writer leaves nothing there); "
        "the `cold:` rows drop it from the page cache instead.",
        "",
        f"![save and load times](img/{svg.name})",
        "",
    ]
    for state, res in by_state.items():
        b = benches[state]
        lines += [f"## {state}", "", *_table(list(res.values()), b.nbytes), ""]
        if state in peaks:
            lines += [
                f"Peak extra RSS while saving (largest tensor {b.largest / methods.MiB:.2f} MiB):",
                "",
                "| method | peak extra RSS |",
                "|---|---|",
                *(f"| {k} | {v / methods.MiB:.1f} MiB |" for k, v in peaks[state].items()),
                "",
            ]
    if sharded_result is not None:
        lines += [*sharded_result.markdown(), ""]
    if e2e_results:
        lines += ["## End to end", ""]
        for result in e2e_results:
            lines += [*result.markdown(), ""]
    lines += object_store_lines
    path.write_text("\n".join(lines))
