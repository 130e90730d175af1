"""``ls`` and ``verify``: the checkpoints of a directory (``ckpt.N`` and their sentinels), or
files and checkpoint sets.

A checkpoint is complete when its sentinel is there; ``ls`` shows the metric its manifest
records (a run that keeps the best by a metric), and ``ls`` and ``verify`` read every byte of
each complete one (its manifest's checksums, the data keys a resume needs, a sharded index's
names and geometry), and report damage with :data:`~lightning_bpk.cli.EXIT_FOUND`. A run
directory stands for its ``checkpoints/``; a URL is read in place.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any

from lightning_bpk import burnpack
from lightning_bpk.checkpointer._view import report_checkpoints
from lightning_bpk.checkpointer.manifest import Metric
from lightning_bpk.cli._locations import is_safetensors, mtime
from lightning_bpk.cli._output import EXIT_FOUND, EXIT_OK, emit, progress, size_text, table
from lightning_bpk.cli._sharded import index_problems, verify_sharded
from lightning_bpk.dcp import is_sharded
from lightning_bpk.interop import sets as interop_sets
from lightning_bpk.layout import RECORD_SUFFIX, RUN_SUBDIRECTORY
from lightning_bpk.records import files
from lightning_bpk.store import Store, location, name_of, open_parent, open_store


def _checkpoints(
    target: str, args: argparse.Namespace, verify: bool
) -> tuple[Store, dict[str, int | None], list[dict[str, Any]]]:
    """The store ``target`` names (a path or URL), its listing, and its checkpoints (newest
    first): number, complete, verified (None when not ``verify``), size, time, problems; a
    checkpoint without one of the ``--require`` keys does not verify. A run directory's
    ``checkpoints/`` (where BurnpackCheckpoint saves by default) stands for it when it holds
    none itself. An unreachable URL or a missing bucket fails here, naming it."""
    store = open_store(target)
    with contextlib.suppress(NotADirectoryError):  # a file: nothing is listed under it
        store.check()
    listing = store.list("")
    rows = _rows(store, listing, args, verify)
    if not rows and listing.get(RUN_SUBDIRECTORY, 0) is None:
        store = open_store(store.url_of(RUN_SUBDIRECTORY))
        listing = store.list("")
        rows = _rows(store, listing, args, verify)
    return store, listing, rows


def _rows(
    store: Store, listing: dict[str, int | None], args: argparse.Namespace, verify: bool
) -> list[dict[str, Any]]:
    required = [k for k in args.require.split(",") if k]
    rows = []
    for report in report_checkpoints(
        store, listing, args.identifier, args.prefix, verify=verify, required_keys=required
    ):
        entry, problems = report.entry, report.problems or []
        if problems == [] and report.problems is not None and entry.data is not None:
            problems = index_problems(entry.data)
        rows.append(
            {
                "number": entry.number,
                "complete": entry.complete,
                "verified": (not problems) if report.problems is not None else None,
                "size": report.size,
                "time": mtime(entry.sentinel or entry.data),  # type: ignore[arg-type]
                "path": str(entry.data or entry.sentinel),
                "problems": problems,
                "metric": _metric_row(report.metric),
            }
        )
    return rows


def _is_directory(target: str) -> bool:
    """Whether ``target``, which lists nothing, is an empty directory (not a file, or nothing):
    its parent's listing says."""
    parent, name = open_parent(target)
    return parent.list("").get(name, -1) is None  # a directory lists as None


def _metric_row(metric: Metric | None) -> dict[str, Any] | None:
    """The recorded metric as JSON has it: NaN and infinities as the manifest writes them
    (``"nan"``, ``"inf"``, ``"-inf"``), a save without the metric as ``null``."""
    if metric is None:
        return None
    value = metric.value
    shown = str(value) if value is not None and not math.isfinite(value) else value
    return {"name": metric.name, "value": shown, "mode": metric.mode}


def _metric_text(metric: dict[str, Any] | None) -> str:
    """``score=0.2 (min)``; ``score=- (min)`` when the save had no value; ``-`` without one."""
    if metric is None:
        return "-"
    value = metric["value"]
    shown = "-" if value is None else (f"{value:.6g}" if isinstance(value, float) else value)
    return f"{metric['name']}={shown} ({metric['mode']})"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def cmd_ls(args: argparse.Namespace) -> int:
    """``ls DIR``: the checkpoints of a directory (or a URL), or the shards of a set."""
    if interop_sets.is_set(args.dir):  # a checkpoint set: its shards
        info = interop_sets.describe_source(args.dir)
        shard_rows = [["shard", "tensors", "size"]]
        shard_rows += [
            [s["name"], str(s["tensors"]), size_text(s["bytes"])] for s in info["shards"]
        ]
        shards = {"index": info["index"], "shards": info["shards"]}
        emit(args, shards, f"{info['index']}:\n{table(shard_rows)}")
        return EXIT_OK
    store, listing, rows = _checkpoints(args.dir, args, not args.no_verify)
    if not listing and not _is_directory(args.dir):
        raise OSError(f"{store.url}: not a directory")
    rows_text = [["number", "complete", "verified", "size", "time"]]
    rows_text += [
        [
            str(r["number"]),
            _yes_no(r["complete"]),
            _yes_no(r["verified"]),
            size_text(r["size"]),
            r["time"],
        ]
        for r in rows
    ]
    if any(r["metric"] for r in rows):  # kept by the best-k rule too: the recorded metric
        rows_text[0].append("metric")
        for row, r in zip(rows_text[1:], rows, strict=True):
            row.append(_metric_text(r["metric"]))
    text = table(rows_text) if rows else f"{store.url}: no checkpoints"
    if store.url != str(location(args.dir)):  # a run directory's checkpoints/
        text = f"{store.url}:\n{text}"
    text += "".join(f"\n{r['number']}: {p}" for r in rows for p in r["problems"])
    emit(args, {"directory": store.url, "checkpoints": rows}, text)
    return EXIT_FOUND if any(r["verified"] is False for r in rows) else EXIT_OK


def _verify_file(path: str) -> dict[str, Any]:
    """Structure and checksums of one ``.bpk`` (or structure of a ``.safetensors``) file, a
    local one or an object of a store (read with ranged requests)."""
    result: dict[str, Any] = {"file": path, "ok": True, "problems": []}
    if is_safetensors(path):
        return interop_sets.verify_source(path)
    try:
        with files.read_pack(path) as pack:
            result["tensors"] = len(pack)
            result["checksums"] = len(pack.checksums)
            report = progress(f"verify {name_of(path)}")
            bad = []
            for k, name in enumerate(pack.names):
                try:
                    pack.raw(name)
                except burnpack.ChecksumError:
                    bad.append(name)
                if report is not None:
                    report(k + 1, len(pack), name)
            if bad:
                result["problems"] = [f"{path}: tensor '{n}' fails its checksum" for n in bad]
    except burnpack.BurnpackIOError:
        raise
    except burnpack.BurnpackError as e:
        result["problems"] = [str(e)]
    result["ok"] = not result["problems"]
    return result


def _verify_directory(target: str, args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """``verify`` of anything else: the checkpoints of a directory or a URL prefix (a run
    directory's ``checkpoints/``); without any, its ``.bpk`` files; a file or an object itself.
    Returns what was verified (``checkpoints/`` for a run directory) and the results."""
    store, listing, rows = _checkpoints(target, args, verify=True)
    if rows:
        return store.url, [
            {"checkpoint": r["number"], "ok": bool(r["verified"]), "problems": r["problems"]}
            if r["complete"]
            else {"checkpoint": r["number"], "ok": True, "problems": [], "incomplete": True}
            for r in rows
        ]
    if not listing and not _is_directory(target):  # a file or an object (or nothing)
        return target, [_verify_file(target)]
    names = sorted(
        n for n, size in listing.items() if size is not None and n.endswith(RECORD_SUFFIX)
    )
    if not names:
        raise OSError(f"{store.url}: no checkpoints and no .bpk files to verify")
    return store.url, [_verify_file(store.url_of(name)) for name in names]


def _verify_text(results: list[dict[str, Any]]) -> str:
    """One line per file or checkpoint verified: OK, incomplete, or DAMAGED with its problems."""
    lines = []
    for r in results:
        what = f"checkpoint {r['checkpoint']}" if "checkpoint" in r else r["file"]
        if r.get("incomplete"):
            lines.append(f"{what}: incomplete (no sentinel or no data), skipped")
        elif r["ok"]:
            detail = (
                ""
                if "tensors" not in r
                else f" ({r['tensors']} tensors, {r['checksums']} checksummed)"
            )
            lines.append(f"{what}: OK{detail}")
        else:
            lines += [f"{what}: DAMAGED"] + [f"  {p}" for p in r["problems"]]
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify TARGET``: structure and checksums of a file, a set, a sharded directory or
    every checkpoint of a directory; :data:`~lightning_bpk.cli.EXIT_FOUND` on damage."""
    target = args.target
    results: list[dict[str, Any]]
    if interop_sets.is_set(target) or is_safetensors(target):
        results = [interop_sets.verify_source(target)]
    elif is_sharded(target):  # a checkpoint's data (local or a URL), any DCP directory of ours
        results = [verify_sharded(location(target))]
    else:
        target, results = _verify_directory(target, args)
    ok = all(r["ok"] for r in results)
    emit(args, {"target": str(target), "ok": ok, "results": results}, _verify_text(results))
    return EXIT_OK if ok else EXIT_FOUND
