"""``ls`` and ``verify``: the checkpoints of a directory (``ckpt.N`` and their sentinels), or
files and checkpoint sets.

A checkpoint is complete when its sentinel is there; ``ls`` and ``verify`` read every byte of
each complete one (its manifest's checksums, the data keys a resume needs, a sharded index's
names and geometry), and report damage with :data:`~lightning_bpk.cli.EXIT_FOUND`. A run
directory stands for its ``checkpoints/``; a URL is read in place.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_bpk import burnpack, checkpointer, storage
from lightning_bpk._sharded_names import is_sharded
from lightning_bpk.cli._locations import is_safetensors, mtime
from lightning_bpk.cli._output import EXIT_FOUND, EXIT_OK, emit, progress, size_text, table
from lightning_bpk.cli._sharded import index_problems, verify_sharded
from lightning_bpk.interop import sets as interop_sets
from lightning_bpk.records import files


def _checkpoint_rows(
    base: Path | str, identifier: str, prefix: str, verify: bool, required_keys: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every checkpoint in ``base`` (newest first): number, complete, verified, size, time,
    problems. ``verified`` is None when ``verify`` is off; a checkpoint without one of
    ``required_keys`` does not verify."""
    rows = []
    for report in checkpointer.report_checkpoints(
        base, identifier, prefix, verify=verify, required_keys=required_keys
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
            }
        )
    return rows


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _checkpoint_base(path: Path, args: argparse.Namespace) -> Path:
    """``path``, or a run directory's ``checkpoints/`` (where BurnpackCheckpoint saves by
    default) when ``path`` holds no checkpoints itself and that folder exists."""
    inner = path / checkpointer.RUN_SUBDIRECTORY
    if not checkpointer.list_checkpoints(path, args.identifier, args.prefix) and inner.is_dir():
        return inner
    return path


def _required(args: argparse.Namespace) -> list[str]:
    return [k for k in args.require.split(",") if k]


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
    base = storage.location(args.dir)
    if isinstance(base, str):
        storage.object_store(base).check()  # a wrong URL fails here, naming it
    elif not base.is_dir():
        raise OSError(f"{base}: not a directory")
    else:
        base = _checkpoint_base(base, args)
    rows = _checkpoint_rows(
        base, args.identifier, args.prefix, not args.no_verify, required_keys=_required(args)
    )
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
    text = table(rows_text) if rows else f"{base}: no checkpoints"
    if base != Path(args.dir):
        text = f"{base}:\n{text}"
    text += "".join(f"\n{r['number']}: {p}" for r in rows for p in r["problems"])
    emit(args, {"directory": str(base), "checkpoints": rows}, text)
    return EXIT_FOUND if any(r["verified"] is False for r in rows) else EXIT_OK


def _verify_file(path: Path | str) -> dict[str, Any]:
    """Structure and checksums of one ``.bpk`` (or structure of a ``.safetensors``) file, a
    local one or an object of a store (read with ranged requests)."""
    result: dict[str, Any] = {"file": str(path), "ok": True, "problems": []}
    if is_safetensors(str(path)):
        return interop_sets.verify_source(path)
    try:
        with files.read_pack(path) as pack:
            result["tensors"] = len(pack)
            result["checksums"] = len(pack.checksums)
            report = progress(f"verify {storage.name_of(path)}")
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


def _verify_directory(
    target: Path | str, args: argparse.Namespace
) -> tuple[Path | str, list[dict[str, Any]]]:
    """``verify`` of a directory or a URL prefix: its checkpoints (a run directory's
    ``checkpoints/``); without any, its ``.bpk`` files (or the one object a URL names).
    Returns the directory verified (``checkpoints/`` for a run directory) and the results."""
    if isinstance(target, str):
        storage.object_store(target).check()  # a wrong URL fails here, naming it
    else:
        target = _checkpoint_base(target, args)
    rows = _checkpoint_rows(
        target, args.identifier, args.prefix, verify=True, required_keys=_required(args)
    )
    if rows:
        return target, [
            {"checkpoint": r["number"], "ok": bool(r["verified"]), "problems": r["problems"]}
            if r["complete"]
            else {"checkpoint": r["number"], "ok": True, "problems": [], "incomplete": True}
            for r in rows
        ]
    if isinstance(target, str):
        return target, [_verify_file(target)]
    files = sorted(target.glob("*.bpk"))
    if not files:
        raise OSError(f"{target}: no checkpoints and no .bpk files to verify")
    return target, [_verify_file(f) for f in files]


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
    target = storage.location(args.target)
    results: list[dict[str, Any]]
    if interop_sets.is_set(args.target) or is_safetensors(args.target):
        results = [interop_sets.verify_source(args.target)]
    elif is_sharded(target):  # a checkpoint's data (local or a URL), any DCP directory of ours
        results = [verify_sharded(target)]
    elif isinstance(target, str) or target.is_dir():
        target, results = _verify_directory(target, args)
    elif target.exists():
        results = [_verify_file(target)]
    else:
        raise OSError(f"{target}: no such file or directory")
    ok = all(r["ok"] for r in results)
    emit(args, {"target": str(target), "ok": ok, "results": results}, _verify_text(results))
    return EXIT_OK if ok else EXIT_FOUND
