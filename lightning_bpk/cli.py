"""The ``lightning-bpk`` command line (also ``python -m lightning_bpk``).

Each subcommand is one ``_cmd_<name>(args) -> int`` function registered in :func:`build_parser`,
so ``ls``, ``verify``, ``convert`` or ``diff`` can be added beside ``inspect`` without touching
the others. A bad file is reported on stderr with its path and exit status :data:`EXIT_BAD_FILE`.

Commands: ``inspect FILE``, ``ls DIR`` (checkpoints; a run directory stands for its
``checkpoints/``), ``verify FILE|DIR``, ``convert SRC DST`` (``.bpk``, ``.safetensors``;
``.pt``/``.ckpt`` as source only), ``diff A B`` (files, or two checkpoint directories). Each
also takes a checkpoint set (``model.safetensors.index.json`` or ``model.bpk.index.json`` with
its shards, or their directory; see :mod:`lightning_bpk.interop.sets`): ``inspect`` shows its
shards and tensors, ``ls`` its shards, ``verify`` checks index, headers and checksums,
``convert`` reads it whole (``--max-shard-size`` writes a set), ``diff`` compares it as one
file. Every
command takes ``--json``. Exit status: 0 ok, 1 differences or damage found (:data:`EXIT_FOUND`),
2 usage error or unreadable input (:data:`EXIT_BAD_FILE`). Long work shows progress on stderr
when it is a terminal. Text output escapes control characters (a tensor name or metadata value
cannot drive the terminal); ``--json`` escapes them as JSON does.

Example::

    $ lightning-bpk inspect model.bpk
    $ lightning-bpk inspect model.bpk --json | jq .tensors
    $ lightning-bpk ls runs/exp1
    $ lightning-bpk convert runs/exp1/ckpt.9/model.bpk model.safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import burnpack, checkpointer, storage
from lightning_bpk._sharded_names import ShardedCheckpointError, is_sharded
from lightning_bpk.interop import Content, convert
from lightning_bpk.interop import sets as interop_sets
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX, MODEL_FILE
from lightning_bpk.object_checkpoints import fetch_pack
from lightning_bpk.records.base import RecordError
from lightning_bpk.trainer_state import REQUIRED_KEYS

__all__ = [
    "EXIT_BAD_FILE",
    "EXIT_FOUND",
    "EXIT_OK",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_FOUND = 1  # differences (diff) or damage (verify, ls) found
EXIT_BAD_FILE = 2  # argparse also exits with 2 on usage errors: "the input was not usable"


def _dtype_text(dtype: burnpack.DType) -> str:
    """A compact dtype label: ``F32``, ``Bool(Native)``, ``QFloat(Q8F)``."""
    if isinstance(dtype, str):
        return dtype
    ((variant, payload),) = dtype.items()
    if isinstance(payload, dict):
        payload = payload.get("value", "...")
    return f"{variant}({payload})"


def _json_value(scalar: burnpack.Scalar) -> bool | int | float | str:
    """A scalar's value for strict JSON, which has no NaN or infinity: those become text."""
    value = scalar.value
    return value if not isinstance(value, float) or math.isfinite(value) else repr(value)


def _describe(pack: burnpack.Pack) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-ready data (tensors in data-section order)."""
    order = pack.data_order
    return {
        "file": pack.source,
        "header": {
            "version": pack.version,
            "metadata_size": pack.metadata_size,
            "data_start": pack.data_start,
            "file_size": pack.file_size,
        },
        "tensors": [
            {
                "name": name,
                "dtype": pack.entries[name].dtype,
                "shape": list(pack.entries[name].shape),
                "bytes": pack.entries[name].nbytes,
                "data_offsets": list(pack.entries[name].data_offsets),
                "param_id": pack.entries[name].param_id,
                "checksum": pack.checksums.get(name),
            }
            for name in order
        ],
        "scalars": {k: {"kind": s.kind, "value": _json_value(s)} for k, s in pack.scalars.items()},
        "metadata": dict(pack.metadata),
    }


def _escape(c: str) -> str:
    return c if c.isprintable() else repr(c)[1:-1]


def _printable(text: str) -> str:
    r"""``text`` with every non-printable character but the line breaks (control codes, ANSI
    escapes, bidi overrides) escaped as in a Python string literal.

    >>> _printable("a\x1b[2Jb\nc\u202ed")
    'a\\x1b[2Jb\nc\\u202ed'
    """
    return "\n".join(
        line if line.isprintable() else "".join(map(_escape, line)) for line in text.split("\n")
    )


def _table(rows: list[list[str]]) -> str:
    rows = [[_printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _format_text(info: dict[str, Any]) -> str:
    """The human-readable ``inspect`` report of :func:`_describe`'s output."""
    h = info["header"]
    lines = [
        f"file: {info['file']}",
        f"burnpack v{h['version']}: metadata {h['metadata_size']} bytes, "
        f"data section at {h['data_start']}, file {h['file_size']} bytes",
        "",
        f"tensors ({len(info['tensors'])}, data order):",
    ]
    if info["tensors"]:
        rows = [["name", "dtype", "shape", "bytes", "param_id", "checksum"]]
        rows += [
            [
                t["name"],
                _dtype_text(t["dtype"]),
                "[" + ", ".join(map(str, t["shape"])) + "]",
                str(t["bytes"]),
                "-" if t["param_id"] is None else str(t["param_id"]),
                "xxh3" if t["checksum"] else "-",
            ]
            for t in info["tensors"]
        ]
        lines.append(_table(rows))
    lines += ["", f"scalars ({len(info['scalars'])}):"]
    lines += [f"  {k} = {s['kind']}({s['value']!r})" for k, s in info["scalars"].items()]
    lines += ["", f"metadata ({len(info['metadata'])}):"]
    lines += [f"  {k} = {v!r}" for k, v in info["metadata"].items()]
    return "\n".join(lines)


def _describe_sharded(index: Any) -> dict[str, Any]:
    """What ``inspect`` shows for a sharded checkpoint directory (its ``dcp.Index``): its global
    tensors and files."""
    return {
        "directory": str(index.directory),
        "files": index.files,
        "tensors": [
            {"name": name, "dtype": t["dtype"], "shape": t["shape"], "chunks": t["chunks"]}
            for name, t in index.tensors.items()
        ],
        "objects": sorted(index.objects),
    }


def _sharded_text(info: dict[str, Any]) -> str:
    lines = [
        f"sharded checkpoint: {info['directory']}",
        f"files ({len(info['files'])}): " + ", ".join(sorted(info["files"])),
        "",
        f"tensors ({len(info['tensors'])}, full shapes):",
    ]
    rows = [["name", "dtype", "shape", "chunks"]]
    rows += [
        [t["name"], _dtype_text(t["dtype"]), str(t["shape"]), str(len(t["chunks"]))]
        for t in info["tensors"]
    ]
    lines += [_table(rows), "", f"objects ({len(info['objects'])}):"]
    lines += [f"  {name}" for name in info["objects"]]
    return "\n".join(lines)


def _open_pack(target: str) -> burnpack.Pack:
    """A local file (memory-mapped) or an object of a store (ranged reads into memory)."""
    location = storage.location(target)
    if isinstance(location, Path):
        return burnpack.read(location)
    store = storage.object_store(storage.parent_of(location))
    size = store.size(storage.name_of(location))
    if size is None:
        raise OSError(f"{location}: no such object")
    return fetch_pack(store, storage.name_of(location), size)


@contextlib.contextmanager
def _local_copies(*targets: str, only: str | None = None) -> Iterator[list[Path]]:
    """A local path for each argument of ``convert`` and ``diff``, whose readers (safetensors,
    ``torch.load``) need files: a path as it is; a URL copied into a temporary folder, removed
    afterwards: an object as a file, a prefix (a checkpoint's data) as a folder of the objects
    directly under it (``only`` that one if it is there)."""
    with tempfile.TemporaryDirectory(prefix="lightning_bpk-cli-") as scratch:
        yield [_local_copy(t, Path(scratch) / str(i), only) for i, t in enumerate(targets)]


def _local_copy(target: str, scratch: Path, only: str | None) -> Path:
    location = storage.location(target)
    if isinstance(location, Path):
        return location
    scratch.mkdir()
    name = storage.name_of(location)
    parent = storage.object_store(storage.parent_of(location))
    if parent.size(name) is not None:
        parent.download(name, scratch / name)
        return scratch / name
    store = storage.object_store(location)
    objects = [key for key, size in store.list("").items() if size is not None]
    if only in objects:
        objects = [only]
    if not objects:
        raise OSError(f"{location}: no such object, nor objects under it")
    (scratch / name).mkdir()
    for key in objects:
        store.download(key, scratch / name / key)
    return scratch / name


def _is_safetensors(target: str) -> bool:
    return storage.name_of(storage.location(target)).lower().endswith(".safetensors")


def _source_text(info: dict[str, Any]) -> str:
    """The ``inspect`` report of a checkpoint set or a ``.safetensors`` file."""
    lines = [f"{info['format']}: {info.get('index', info['source'])}"]
    if "shards" in info:
        rows = [["shard", "tensors", "bytes"]]
        rows += [[s["name"], str(s["tensors"]), str(s["bytes"])] for s in info["shards"]]
        lines += ["", f"shards ({len(info['shards'])}):", _table(rows)]
    lines += ["", f"tensors ({len(info['tensors'])}):"]
    if info["tensors"]:
        rows = [["name", "dtype", "shape", "bytes", "param_id"]]
        rows += [
            [
                t["name"],
                t["dtype"],
                "[" + ", ".join(map(str, t["shape"])) + "]",
                str(t["bytes"]),
                "-" if t["param_id"] is None else str(t["param_id"]),
            ]
            for t in info["tensors"]
        ]
        lines.append(_table(rows))
    lines += ["", f"metadata ({len(info['metadata'])}):"]
    lines += [f"  {k} = {v!r}" for k, v in info["metadata"].items()]
    return "\n".join(lines)


def _cmd_inspect(args: argparse.Namespace) -> int:
    if interop_sets.is_set(args.file) or _is_safetensors(args.file):
        info = interop_sets.describe_source(args.file)
        _emit(args, info, _source_text(info))
        return EXIT_OK
    if is_sharded(args.file):  # a local directory or a URL prefix
        from lightning_bpk import dcp  # seconds to import: only for a sharded directory

        info = _describe_sharded(dcp.read_index(args.file))
        print(json.dumps(info, indent=2) if args.json else _sharded_text(info))
        return EXIT_OK
    with _open_pack(args.file) as pack:
        info = _describe(pack)
    _emit(args, info, _format_text(info))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subparser sets ``func`` to its ``_cmd_*`` handler."""
    parser = argparse.ArgumentParser(
        prog="lightning-bpk", description="Inspect Burn burnpack (.bpk) files."
    )
    _add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad file or usage).

    >>> main(["inspect", "/nonexistent.bpk"])
    2
    """
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpointer.CheckpointWarning)
        try:
            return args.func(args)
        except BrokenPipeError:  # `| head` closed stdout early: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        except (burnpack.BurnpackError, RecordError, OSError, ShardedCheckpointError) as e:
            _report(args, "error", str(e))
            return EXIT_BAD_FILE
        finally:
            for w in caught:
                _report(args, "warning", str(w.message))


def _report(args: argparse.Namespace, what: str, message: str) -> None:
    print(_printable(f"lightning-bpk {args.command}: {what}: {message}"), file=sys.stderr)


# --- ls, verify, convert, diff ------------------------------------------------------------------


def _progress(label: str) -> Callable[[int, int, str], None] | None:
    """A per-item progress line on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None

    def report(done: int, total: int, name: str) -> None:
        end = "\n" if done == total else ""
        print(f"\r\033[K{label} {done}/{total} {name}", end=end, file=sys.stderr, flush=True)

    return report


def _size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _tree_size(path: Path | str) -> int:
    if isinstance(path, str):  # a URL: the sizes one listing reports
        return sum(size or 0 for size in storage.object_store(path).list("").values())
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mtime(path: Path | str) -> str:
    if isinstance(path, str):
        return "-"  # not asked of object stores: one request per checkpoint for a column
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime).astimezone()
    return stamp.isoformat(timespec="seconds")


def _emit(args: argparse.Namespace, info: Any, text: str) -> None:
    print(json.dumps(info, indent=2) if args.json else _printable(text))


def _checkpoint_rows(
    base: Path | str, identifier: str, prefix: str, verify: bool, required_keys: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every checkpoint in ``base`` (newest first): number, complete, verified, size, time,
    problems. ``verified`` is None when ``verify`` is off; a checkpoint without one of
    ``required_keys`` does not verify."""
    rows = []
    for entry in checkpointer.list_checkpoints(base, identifier, prefix):
        n, complete = entry.number, entry.complete
        problems = (
            checkpointer.verify_checkpoint(base, n, identifier, prefix, required_keys=required_keys)
            if verify and complete
            else []
        )
        if verify and complete and not problems and entry.data is not None:
            problems = _index_problems(entry.data)
        rows.append(
            {
                "number": n,
                "complete": complete,
                "verified": (not problems) if verify and complete else None,
                "size": _tree_size(entry.data) if entry.data is not None else 0,
                "time": _mtime(entry.sentinel or entry.data),  # type: ignore[arg-type]
                "path": str(entry.data or entry.sentinel),
                "problems": problems,
            }
        )
    return rows


def _index_problems(data: Path | str) -> list[str]:
    """What is wrong with the index of a sharded checkpoint's data (nothing for another one):
    the manifest's checks cover the index's bytes, this what they say (names, geometry)."""
    if not is_sharded(data):
        return []
    from lightning_bpk import dcp  # seconds to import: only for a sharded checkpoint

    try:
        dcp.read_index(data)
    except ShardedCheckpointError as e:
        return [str(e)]
    return []


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


def _cmd_ls(args: argparse.Namespace) -> int:
    if interop_sets.is_set(args.dir):  # a checkpoint set: its shards
        info = interop_sets.describe_source(args.dir)
        shard_rows = [["shard", "tensors", "size"]]
        shard_rows += [
            [s["name"], str(s["tensors"]), _size_text(s["bytes"])] for s in info["shards"]
        ]
        shards = {"index": info["index"], "shards": info["shards"]}
        _emit(args, shards, f"{info['index']}:\n{_table(shard_rows)}")
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
    table = [["number", "complete", "verified", "size", "time"]]
    table += [
        [
            str(r["number"]),
            _yes_no(r["complete"]),
            _yes_no(r["verified"]),
            _size_text(r["size"]),
            r["time"],
        ]
        for r in rows
    ]
    text = _table(table) if rows else f"{base}: no checkpoints"
    if base != Path(args.dir):
        text = f"{base}:\n{text}"
    text += "".join(f"\n{r['number']}: {p}" for r in rows for p in r["problems"])
    _emit(args, {"directory": str(base), "checkpoints": rows}, text)
    return EXIT_FOUND if any(r["verified"] is False for r in rows) else EXIT_OK


def _verify_file(path: Path) -> dict[str, Any]:
    """Structure and checksums of one ``.bpk`` (or structure of a ``.safetensors``) file."""
    result: dict[str, Any] = {"file": str(path), "ok": True, "problems": []}
    if path.suffix == ".safetensors":
        return interop_sets.verify_source(path)
    try:
        with burnpack.read(path) as pack:
            result["tensors"] = len(pack)
            result["checksums"] = len(pack.checksums)
            progress = _progress(f"verify {path.name}")
            bad = []
            for k, name in enumerate(pack.names):
                try:
                    pack.raw(name)
                except burnpack.ChecksumError:
                    bad.append(name)
                if progress is not None:
                    progress(k + 1, len(pack), name)
            if bad:
                result["problems"] = [f"{path}: tensor '{n}' fails its checksum" for n in bad]
    except burnpack.BurnpackIOError:
        raise
    except burnpack.BurnpackError as e:
        result["problems"] = [str(e)]
    result["ok"] = not result["problems"]
    return result


def _verify_object(url: str) -> dict[str, Any]:
    """:func:`_verify_file` for one object of a store, read with ranged requests."""
    store = storage.object_store(storage.parent_of(url))
    name = storage.name_of(url)
    size = store.size(name)
    if size is None:
        raise OSError(f"{url}: no such object")
    result: dict[str, Any] = {"file": url, "ok": True, "problems": []}
    try:
        pack = fetch_pack(store, name, size)
        result["tensors"], result["checksums"] = len(pack), len(pack.checksums)
        pack.verify()
    except burnpack.BurnpackError as e:
        result["problems"] = [str(e)]
    result["ok"] = not result["problems"]
    return result


def _cmd_verify(args: argparse.Namespace) -> int:
    target = storage.location(args.target)
    results: list[dict[str, Any]]
    if interop_sets.is_set(args.target) or _is_safetensors(args.target):
        results = [interop_sets.verify_source(args.target)]
    elif is_sharded(target):  # a checkpoint's data (local or a URL), any DCP directory of ours
        from lightning_bpk import dcp

        try:
            index = dcp.read_index(target)
        except ShardedCheckpointError as e:  # unreadable or hostile: the checkpoint is damaged
            problems, count = [str(e)], 0
        else:
            problems = index.check_files(verify_tensors=True)
            count = sum(len(t["chunks"]) for t in index.tensors.values())
        results = [
            {"file": str(target), "ok": not problems, "problems": problems, "tensors": count}
        ]
        results[0]["checksums"] = count
    elif isinstance(target, str) or target.is_dir():
        if isinstance(target, str):
            storage.object_store(target).check()  # a wrong URL fails here, naming it
        else:
            target = _checkpoint_base(target, args)
        rows = _checkpoint_rows(
            target, args.identifier, args.prefix, verify=True, required_keys=_required(args)
        )
        if rows:
            results = [
                {"checkpoint": r["number"], "ok": bool(r["verified"]), "problems": r["problems"]}
                if r["complete"]
                else {"checkpoint": r["number"], "ok": True, "problems": [], "incomplete": True}
                for r in rows
            ]
        elif isinstance(target, str):
            results = [_verify_object(target)]
        else:
            files = sorted(target.glob("*.bpk"))
            if not files:
                raise OSError(f"{target}: no checkpoints and no .bpk files to verify")
            results = [_verify_file(f) for f in files]
    elif target.exists():
        results = [_verify_file(target)]
    else:
        raise OSError(f"{target}: no such file or directory")
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
    ok = all(r["ok"] for r in results)
    _emit(args, {"target": str(target), "ok": ok, "results": results}, "\n".join(lines))
    return EXIT_OK if ok else EXIT_FOUND


def _cmd_convert(args: argparse.Namespace) -> int:
    """Convert ``src`` to ``dst``; either may be a URL (an object store's output is written to
    a temporary file first, then uploaded)."""
    if args.max_shard_size is not None or interop_sets.is_set(args.src):
        return _convert_set(args)
    remote_dst = not storage.is_local(args.dst)
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        dst = Path(scratch) / storage.name_of(args.dst) if remote_dst else Path(args.dst)
        written: Path | str
        if not storage.is_local(args.src) and is_sharded(args.src):
            # a sharded checkpoint's data: read in place (ranged reads), never downloaded whole
            from lightning_bpk.interop import save_module_record
            from lightning_bpk.sharded import module_record

            written = save_module_record(module_record(args.src), dst)
        else:
            (src,) = stack.enter_context(_local_copies(args.src, only=MODEL_FILE))
            progress = _progress(f"convert {storage.name_of(storage.location(args.src))}")
            written = convert(src, dst, progress=progress)
        size = Path(written).stat().st_size
        if remote_dst:
            target = storage.location(args.dst)
            store = storage.object_store(storage.parent_of(target))
            store.upload(written, storage.name_of(target))
            written = target
    info = {"src": args.src, "dst": str(written), "size": size}
    _emit(args, info, f"wrote {written} ({_size_text(size)})")
    return EXIT_OK


def _convert_set(args: argparse.Namespace) -> int:
    """``convert`` from a checkpoint set (local or a URL), or to one (``--max-shard-size``:
    ``dst`` is a new local directory for the shards and their index)."""
    if not storage.is_local(args.dst):
        raise OSError(f"{args.dst}: a set is converted to a local file or directory")
    try:
        shard_size = (
            None if args.max_shard_size is None else interop_sets.parse_size(args.max_shard_size)
        )
    except ValueError as e:
        raise RecordError("io", f"--max-shard-size: {e}") from e
    written = interop_sets.convert_source(
        args.src,
        storage.local_path(args.dst),
        max_shard_size=shard_size,
        suffix="." + args.shard_format,
        progress=_progress(f"convert {storage.name_of(storage.location(args.src))}"),
    )
    size = _tree_size(written.parent if shard_size is not None else written)
    _emit(
        args,
        {"src": args.src, "dst": str(written), "size": size},
        f"wrote {written} ({_size_text(size)})",
    )
    return EXIT_OK


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| (NaN in both places counts as equal, NaN in one as infinite)."""
    if a.numel() == 0:
        return 0.0
    x, y = a.detach().to(torch.float64), b.detach().to(torch.float64)
    both_nan = x.isnan() & y.isnan()
    d = (x - y).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
    return d.max().item()


def _diff_contents(
    a: Content, b: Content, progress: Callable[[int, int, str], None] | None = None
) -> list[dict[str, Any]]:
    """Tensor-by-tensor comparison of two :class:`~lightning_bpk.interop.Content` objects."""
    names = list(a.tensors) + [n for n in b.tensors if n not in a.tensors]
    rows = []
    for k, name in enumerate(names):
        ta, tb = a.tensors.get(name), b.tensors.get(name)
        row: dict[str, Any] = {"name": name}
        if ta is None or tb is None:
            row["status"] = "only in A" if tb is None else "only in B"
        else:
            row.update(
                shape_a=list(ta.shape),
                shape_b=list(tb.shape),
                dtype_a=str(ta.dtype).removeprefix("torch."),
                dtype_b=str(tb.dtype).removeprefix("torch."),
                param_id_a=a.param_ids.get(name),
                param_id_b=b.param_ids.get(name),
            )
            if ta.shape != tb.shape:
                row["status"] = "shape differs"
            else:
                row["max_abs_diff"] = _max_abs_diff(ta, tb)
                same_bytes = ta.dtype == tb.dtype and bytes(burnpack.tensor_bytes(ta)) == bytes(
                    burnpack.tensor_bytes(tb)
                )
                if same_bytes:
                    row["status"] = "same"
                elif ta.dtype != tb.dtype:
                    row["status"] = "dtype differs"
                else:
                    row["status"] = "values differ"
            if row["status"] == "same" and row["param_id_a"] != row["param_id_b"]:
                row["status"] = "param_id differs"
        rows.append(row)
        if progress is not None:
            progress(k + 1, len(names), name)
    return rows


def _scalars(content: Content) -> dict[str, dict[str, Any]]:
    return {k: {"kind": s.kind, "value": _json_value(s)} for k, s in content.scalars.items()}


def _close(x: Any, y: Any, atol: float) -> bool:
    """Equal, or numbers within ``atol`` (NaN equals NaN; bools and text compare exactly)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    if not numbers:
        return x == y
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y or abs(x - y) <= atol


def _diff_entries(
    a: Mapping[str, Any], b: Mapping[str, Any], atol: float = 0.0
) -> list[dict[str, Any]]:
    """Entry-by-entry comparison of two files' scalars (``{"kind", "value"}`` maps) or metadata
    (strings): rows of ``name``, ``status`` (same, values differ, kind differs, only in A/B) and
    the values ``a`` and ``b``.

    >>> _diff_entries({"last_epoch": {"kind": "Int", "value": 3}},
    ...              {"last_epoch": {"kind": "Int", "value": 4}})[0]["status"]
    'values differ'
    """
    rows = []
    for name in list(a) + [n for n in b if n not in a]:
        row: dict[str, Any] = {"name": name, "a": a.get(name), "b": b.get(name)}
        if name not in a or name not in b:
            row["status"] = "only in A" if name not in b else "only in B"
        else:
            va, vb = a[name], b[name]
            if isinstance(va, dict) and isinstance(vb, dict):
                if va["kind"] != vb["kind"]:
                    row["status"] = "kind differs"
                    rows.append(row)
                    continue
                va, vb = va["value"], vb["value"]
            row["status"] = "same" if _close(va, vb, atol) else "values differ"
        rows.append(row)
    return rows


def _entry_text(value: Any, limit: int = 60) -> str:
    """A scalar or metadata value for the text table, cut to ``limit`` characters."""
    if value is None:
        return "-"
    text = f"{value['kind']}({value['value']!r})" if isinstance(value, dict) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _diff_files(
    a: Path, b: Path, args: argparse.Namespace, names: tuple[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Compare two files: tensors, scalars and metadata; returns the JSON info and the text.
    ``names``: what to call them (the URLs of local copies)."""
    ca, cb = interop_sets.read_any(a), interop_sets.read_any(b)
    atol = args.atol if args.atol is not None else 0.0
    rows = _diff_contents(ca, cb, _progress(f"diff {a.name}"))
    different = [r for r in rows if r["status"] != "same"]
    if args.atol is not None:
        different = [
            r
            for r in different
            if not (r["status"] == "values differ" and r["max_abs_diff"] <= args.atol)
        ]
    scalars = _diff_entries(_scalars(ca), _scalars(cb), atol)
    metadata = _diff_entries(ca.metadata, cb.metadata)
    entries_differ = [
        (what, r)
        for what, entries in (("scalar", scalars), ("metadata", metadata))
        for r in entries
        if r["status"] != "same"
    ]
    shown = rows if args.all else different
    table = [["name", "status", "shape", "dtype", "max_abs_diff"]]
    for r in shown:
        shape = dtype = diff = "-"
        if "shape_a" in r:
            shape = (
                str(r["shape_a"])
                if r["shape_a"] == r["shape_b"]
                else f"{r['shape_a']} vs {r['shape_b']}"
            )
            dtype = (
                r["dtype_a"]
                if r["dtype_a"] == r["dtype_b"]
                else f"{r['dtype_a']} vs {r['dtype_b']}"
            )
        if "max_abs_diff" in r:
            diff = f"{r['max_abs_diff']:.6g}"
        table.append([r["name"], r["status"], shape, dtype, diff])
    shown_entries = (
        [(w, r) for w, entries in (("scalar", scalars), ("metadata", metadata)) for r in entries]
        if args.all
        else entries_differ
    )
    lines = [_table(table)] if len(table) > 1 else []
    if shown_entries:
        entry_table = [["entry", "name", "status", "A", "B"]]
        entry_table += [
            [what, r["name"], r["status"], _entry_text(r["a"]), _entry_text(r["b"])]
            for what, r in shown_entries
        ]
        lines.append(_table(entry_table))
    n_scalars = sum(w == "scalar" for w, _ in entries_differ)
    lines.append(
        f"{len(rows)} tensors, {len(different)} differ; {len(scalars)} scalars, {n_scalars} "
        f"differ; {len(metadata)} metadata entries, {len(entries_differ) - n_scalars} differ"
    )
    info = {
        "a": names[0] if names else str(a),
        "b": names[1] if names else str(b),
        "identical": not different and not entries_differ,
        "tensors": rows,
        "scalars": scalars,
        "metadata": metadata,
    }
    return info, "\n".join(lines)


def _model_file(path: Path) -> Path:
    """A checkpoint directory stands for its model file when compared with a file (as in
    ``convert``); a sharded one for the model its shards assemble into."""
    if not path.is_dir() or is_sharded(path) or interop_sets.is_set(path):
        return path
    return path / MODEL_FILE


def _cmd_diff(args: argparse.Namespace) -> int:
    """Compare two files or checkpoint directories; either may be a URL (copied first)."""
    with _local_copies(args.a, args.b) as (a, b):
        return _diff(a, b, args)


def _diff(a: Path, b: Path, args: argparse.Namespace) -> int:
    def shown(path: Path, local: Path, argument: str) -> str:
        """A path inside a local copy, named by the argument's URL."""
        if storage.is_local(argument):
            return str(path)
        relative = path.relative_to(local).as_posix()
        return argument.rstrip("/") + ("" if relative == "." else f"/{relative}")

    sets = interop_sets.is_set(a) or interop_sets.is_set(b)
    if not (a.is_dir() and b.is_dir()) or is_sharded(a) or is_sharded(b) or sets:
        fa, fb = _model_file(a), _model_file(b)
        names = (shown(fa, a, args.a), shown(fb, b, args.b))
        info, text = _diff_files(fa, fb, args, names)
        _emit(args, info, text)
        return EXIT_OK if info["identical"] else EXIT_FOUND
    # Two checkpoint directories: every record file, matched by name.
    names_a = {p.name for p in a.glob("*" + checkpointer.RECORD_SUFFIX)}
    names_b = {p.name for p in b.glob("*" + checkpointer.RECORD_SUFFIX)}
    if not names_a and not names_b:
        raise OSError(
            f"{shown(a, a, args.a)} and {shown(b, b, args.b)}: no "
            f"{checkpointer.RECORD_SUFFIX} files to compare"
        )
    files, texts = [], []
    for name in sorted(names_a | names_b):
        if name not in names_a or name not in names_b:
            side = "only in A" if name in names_a else "only in B"
            files.append({"file": name, "identical": False, "status": side})
            texts.append(f"{name}: {side}")
            continue
        names = (shown(a / name, a, args.a), shown(b / name, b, args.b))
        info, text = _diff_files(a / name, b / name, args, names)
        files.append({"file": name, **info})
        texts.append(f"{name}: {'same' if info['identical'] else 'differs'}\n{text}")
    identical = all(f["identical"] for f in files)
    summary = f"{len(files)} files, {sum(not f['identical'] for f in files)} differ"
    _emit(
        args,
        {
            "a": shown(a, a, args.a),
            "b": shown(b, b, args.b),
            "identical": identical,
            "files": files,
        },
        "\n\n".join([*texts, summary]),
    )
    return EXIT_OK if identical else EXIT_FOUND


def _add_commands(sub: argparse._SubParsersAction) -> None:
    """Register every command (``inspect``, ``ls``, ``verify``, ``convert``, ``diff``): the one
    place a command is added."""

    def command(
        name: str, func: Callable[[argparse.Namespace], int], summary: str
    ) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=summary)
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
        parser.set_defaults(func=func)
        return parser

    def checkpoint_names(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="checkpoint data prefix")
        parser.add_argument("--identifier", default=DEFAULT_IDENTIFIER, help="sentinel identifier")
        parser.add_argument(
            "--require",
            default=",".join(REQUIRED_KEYS),
            metavar="KEYS",
            help="comma-separated data keys every checkpoint must hold (default: "
            f"{','.join(REQUIRED_KEYS)}, what BurnpackCheckpoint needs to resume; '' for none)",
        )

    inspect = command("inspect", _cmd_inspect, "show header, tensors, scalars and metadata")
    inspect.add_argument(
        "file",
        help="a .bpk file ('.bpk' is added if missing), a .safetensors file, a checkpoint set "
        "(model.safetensors.index.json or its directory) or a sharded checkpoint directory",
    )
    ls = command("ls", _cmd_ls, "list checkpoints: number, complete, verified, size, time")
    ls.add_argument(
        "dir", help="a checkpointer base directory, a run directory, or a checkpoint set (shards)"
    )
    ls.add_argument("--no-verify", action="store_true", help="skip reading every byte")
    checkpoint_names(ls)
    verify = command("verify", _cmd_verify, "check structure and checksums (exit 1 on damage)")
    verify.add_argument(
        "target",
        help="a .bpk/.safetensors file, a checkpoint set, a checkpoint base directory or a "
        "directory of .bpk files",
    )
    checkpoint_names(verify)
    convert = command("convert", _cmd_convert, "convert between .bpk, .safetensors, .pt/.ckpt")
    convert.add_argument(
        "src",
        help=".bpk, .safetensors, .pt/.pth/.bin, .ckpt, a checkpoint set (an index or its "
        "directory) or a checkpoint directory (its model)",
    )
    convert.add_argument("dst", help=".bpk or .safetensors; with --max-shard-size a new directory")
    convert.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="write a sharded set with its index, shards of at most SIZE (5GB, 500MB, bytes)",
    )
    convert.add_argument(
        "--shard-format", choices=("safetensors", "bpk"), default="safetensors", help="shard format"
    )
    diff = command(
        "diff",
        _cmd_diff,
        "compare tensors (names, shapes, dtypes, values), scalars and metadata (exit 1)",
    )
    diff.add_argument(
        "a", help="a file, a checkpoint set, or a checkpoint directory (all its .bpk files)"
    )
    diff.add_argument("b", help="a file, or a checkpoint directory")
    diff.add_argument("--atol", type=float, help="value differences up to this count as equal")
    diff.add_argument("--all", action="store_true", help="list identical entries too")
