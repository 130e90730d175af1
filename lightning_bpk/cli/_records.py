"""``inspect`` and ``convert``: one record file (``.bpk``, ``.safetensors``, ``.pt``/``.ckpt``),
a checkpoint set, or a sharded checkpoint directory, local or at a URL.

``inspect`` shows a ``.bpk`` file's header, tensors (in data-section order), scalars and
metadata; a set's shards and tensors; a sharded directory's global tensors. ``convert`` writes
``.bpk`` or ``.safetensors`` (or a set, with ``--max-shard-size``) through
:mod:`lightning_bpk.interop`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from lightning_bpk import burnpack
from lightning_bpk.cli._locations import is_safetensors, local_copies
from lightning_bpk.cli._output import (
    EXIT_OK,
    dtype_text,
    emit,
    json_value,
    progress,
    size_text,
    table,
)
from lightning_bpk.cli._sharded import describe_sharded, save_model, sharded_text
from lightning_bpk.dcp import is_sharded
from lightning_bpk.interop import convert
from lightning_bpk.interop import sets as interop_sets
from lightning_bpk.layout import MODEL_FILE
from lightning_bpk.records import files
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import location, name_of, open_parent


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
                **_carried(pack.entries[name]),
            }
            for name in order
        ],
        "scalars": {k: {"kind": s.kind, "value": json_value(s)} for k, s in pack.scalars.items()},
        "metadata": dict(pack.metadata),
    }


def _carried(info: burnpack.TensorInfo) -> dict[str, str]:
    """``torch_dtype`` of a tensor stored in a Burn stand-in dtype (fp8, fp4, complex)."""
    return {} if info.carried is None else {"torch_dtype": str(info.carried).split(".")[-1]}


def _tensor_lines(tensors: list[dict[str, Any]], title: str) -> list[str]:
    """The tensor table of ``inspect`` (a checksum column for ``.bpk`` files, whose rows have
    one)."""
    lines = ["", f"tensors ({len(tensors)}{title}):"]
    if not tensors:
        return lines
    checksums = "checksum" in tensors[0]
    rows = [["name", "dtype", "shape", "bytes", "param_id"] + (["checksum"] if checksums else [])]
    rows += [
        [
            t["name"],
            dtype_text(t["dtype"]) + (f" as {t['torch_dtype']}" if "torch_dtype" in t else ""),
            "[" + ", ".join(map(str, t["shape"])) + "]",
            str(t["bytes"]),
            "-" if t["param_id"] is None else str(t["param_id"]),
        ]
        + (["xxh3" if t["checksum"] else "-"] if checksums else [])
        for t in tensors
    ]
    return [*lines, table(rows)]


def _metadata_lines(metadata: dict[str, Any]) -> list[str]:
    return ["", f"metadata ({len(metadata)}):", *(f"  {k} = {v!r}" for k, v in metadata.items())]


def _format_text(info: dict[str, Any]) -> str:
    """The human-readable ``inspect`` report of :func:`_describe`'s output."""
    h = info["header"]
    lines = [
        f"file: {info['file']}",
        f"burnpack v{h['version']}: metadata {h['metadata_size']} bytes, "
        f"data section at {h['data_start']}, file {h['file_size']} bytes",
        *_tensor_lines(info["tensors"], ", data order"),
        "",
        f"scalars ({len(info['scalars'])}):",
    ]
    lines += [f"  {k} = {s['kind']}({s['value']!r})" for k, s in info["scalars"].items()]
    return "\n".join(lines + _metadata_lines(info["metadata"]))


def _source_text(info: dict[str, Any]) -> str:
    """The ``inspect`` report of a checkpoint set or a ``.safetensors`` file."""
    lines = [f"{info['format']}: {info.get('index', info['source'])}"]
    if "shards" in info:
        rows = [["shard", "tensors", "bytes"]]
        rows += [[s["name"], str(s["tensors"]), str(s["bytes"])] for s in info["shards"]]
        lines += ["", f"shards ({len(info['shards'])}):", table(rows)]
    lines += _tensor_lines(info["tensors"], "")
    return "\n".join(lines + _metadata_lines(info["metadata"]))


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect FILE``: a record file, a set or a sharded directory, in text or JSON."""
    if interop_sets.is_set(args.file) or is_safetensors(args.file):
        info = interop_sets.describe_source(args.file)
        emit(args, info, _source_text(info))
        return EXIT_OK
    if is_sharded(args.file):  # a local directory or a URL prefix
        info = describe_sharded(args.file)
        print(json.dumps(info, indent=2) if args.json else sharded_text(info))
        return EXIT_OK
    with files.read_pack(args.file) as pack:
        info = _describe(pack)
    emit(args, info, _format_text(info))
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert ``src`` to ``dst``; either may be a URL (an object store's output is written to
    a temporary file first, then uploaded)."""
    if args.max_shard_size is not None or interop_sets.is_set(args.src):
        return _convert_set(args)
    store, key = open_parent(args.dst)
    with contextlib.ExitStack() as stack:
        dst = stack.enter_context(store.scratch(key))  # published when the block ends
        written: Path | str
        if is_sharded(args.src):
            # a sharded checkpoint's data: read in place (ranged reads), never downloaded whole
            written = save_model(args.src, dst)
        else:
            (src,) = stack.enter_context(local_copies(args.src, only=MODEL_FILE))
            report = progress(f"convert {name_of(location(args.src))}")
            written = convert(src, dst, progress=report)
        size = Path(written).stat().st_size
    target = location(args.dst)
    info = {"src": args.src, "dst": str(target), "size": size}
    emit(args, info, f"wrote {target} ({size_text(size)})")
    return EXIT_OK


def _convert_set(args: argparse.Namespace) -> int:
    """``convert`` from a checkpoint set, or to one (``--max-shard-size``: ``dst`` is a new
    directory or prefix for the shards and their index); either may be a URL."""
    try:
        shard_size = (
            None if args.max_shard_size is None else interop_sets.parse_size(args.max_shard_size)
        )
    except ValueError as e:
        raise RecordError("io", f"--max-shard-size: {e}") from e
    written = interop_sets.convert_source(
        args.src,
        args.dst,
        max_shard_size=shard_size,
        suffix="." + args.shard_format,
        progress=progress(f"convert {name_of(location(args.src))}"),
    )
    store, key = open_parent(written)
    listed = store.list("")  # a set: its index, beside its shards
    size = sum(n or 0 for n in listed.values()) if shard_size is not None else listed[key] or 0
    emit(
        args,
        {"src": args.src, "dst": str(written), "size": size},
        f"wrote {written} ({size_text(size)})",
    )
    return EXIT_OK
