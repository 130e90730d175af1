"""``diff A B``: compare two record files, checkpoint sets or checkpoint directories.

Tensors are compared by name (shape, dtype, bytes, largest absolute difference, ``param_id``),
then scalars and metadata entry by entry (an encoded state's leaves by their dotted paths); two
checkpoint directories file by file. Either side may be a URL (copied into a temporary folder
first) or a sharded checkpoint (its assembled model). Any difference exits with
:data:`~lightning_bpk.cli.EXIT_FOUND`; with ``--ignore-metadata`` a difference of metadata alone
is shown, flagged ``metadata_only``, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import burnpack, state
from lightning_bpk.cli._locations import local_copies
from lightning_bpk.cli._output import EXIT_FOUND, EXIT_OK, emit, json_value, progress, table
from lightning_bpk.dcp import is_sharded
from lightning_bpk.interop import Content
from lightning_bpk.interop import sets as interop_sets
from lightning_bpk.layout import MODEL_FILE, RECORD_SUFFIX
from lightning_bpk.state import _STRUCTURE_KEY
from lightning_bpk.store import join, location


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
    """The file's scalars by name; for a state encoded inline (a trainer or loop state, whose
    leaves live in its one structure entry: :mod:`lightning_bpk.state`), also each leaf that is
    not a tensor, by its dotted path, so a changed counter shows as itself."""
    rows = {k: {"kind": s.kind, "value": json_value(s)} for k, s in content.scalars.items()}
    if _inline_state(content):
        with contextlib.suppress(state.StateError):
            packed = state.Content(
                dict(content.tensors), dict(content.scalars), dict(content.metadata)
            )
            _leaves(state.decode(packed), "", rows)
    return rows


def _inline_state(content: Content) -> bool:
    """Whether ``content`` holds a state whose leaves are inline (structure version 2)."""
    raw = content.metadata.get(_STRUCTURE_KEY)
    try:
        return raw is not None and json.loads(raw).get("version", 1) >= 2
    except (ValueError, AttributeError):
        return False  # not a structure this reads: its metadata entry is compared as text


# The scalar kinds of burnpack, for leaves of these Python types.
_KINDS = {bool: "Bool", int: "Int", float: "Float", str: "Str"}


def _leaves(value: Any, path: str, out: dict[str, dict[str, Any]]) -> None:
    """The non-tensor leaves of a decoded state, by dotted path (tensors are compared as such)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _leaves(item, f"{path}.{key}" if path else str(key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _leaves(item, f"{path}.{i}" if path else str(i), out)
    elif not isinstance(value, torch.Tensor):
        kind = _KINDS.get(type(value), type(value).__name__)
        shown: Any = repr(value)  # a Path, a datetime...: compared by their text
        if value is None or kind in ("Bool", "Int", "Str"):
            shown = value
        elif kind == "Float" and math.isfinite(value):
            shown = value  # strict JSON has no NaN or infinity: those stay text
        out.setdefault(path or "<root>", {"kind": kind, "value": shown})


def _metadata(content: Content) -> Mapping[str, str]:
    """The file's metadata, without an encoded state's structure (its leaves are compared as
    scalars)."""
    return {k: v for k, v in content.metadata.items() if k != _STRUCTURE_KEY}


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
    rows = _diff_contents(ca, cb, progress(f"diff {a.name}"))
    different = [r for r in rows if r["status"] != "same"]
    if args.atol is not None:
        different = [
            r
            for r in different
            if not (r["status"] == "values differ" and r["max_abs_diff"] <= args.atol)
        ]
    scalars = _diff_entries(_scalars(ca), _scalars(cb), atol)
    metadata = _diff_entries(_metadata(ca), _metadata(cb))
    entries_differ = [
        (what, r)
        for what, entries in (("scalar", scalars), ("metadata", metadata))
        for r in entries
        if r["status"] != "same"
    ]
    metadata_only = not different and all(w == "metadata" for w, _ in entries_differ)
    counted = [] if metadata_only and args.ignore_metadata else entries_differ
    shown = rows if args.all else different
    tensor_table = [["name", "status", "shape", "dtype", "max_abs_diff"]]
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
        tensor_table.append([r["name"], r["status"], shape, dtype, diff])
    shown_entries = (
        [(w, r) for w, entries in (("scalar", scalars), ("metadata", metadata)) for r in entries]
        if args.all
        else entries_differ
    )
    lines = [table(tensor_table)] if len(tensor_table) > 1 else []
    if shown_entries:
        entry_table = [["entry", "name", "status", "A", "B"]]
        entry_table += [
            [what, r["name"], r["status"], _entry_text(r["a"]), _entry_text(r["b"])]
            for what, r in shown_entries
        ]
        lines.append(table(entry_table))
    n_scalars = sum(w == "scalar" for w, _ in entries_differ)
    lines.append(
        f"{len(rows)} tensors, {len(different)} differ; {len(scalars)} scalars, {n_scalars} "
        f"differ; {len(metadata)} metadata entries, {len(entries_differ) - n_scalars} differ"
    )
    info = {
        "a": names[0] if names else str(a),
        "b": names[1] if names else str(b),
        "identical": not different and not counted,
        "metadata_only": bool(entries_differ) and metadata_only,
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


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two files or checkpoint directories; either may be a URL (copied first)."""
    with local_copies(args.a, args.b) as (a, b):
        return _diff(a, b, args)


def _diff(a: Path, b: Path, args: argparse.Namespace) -> int:
    def shown(path: Path, local: Path, argument: str) -> str:
        """A path inside the local copy of ``argument`` (the argument itself when it is a
        local path), named below the argument as given."""
        return str(join(location(argument), *path.relative_to(local).parts))

    sets = interop_sets.is_set(a) or interop_sets.is_set(b)
    if not (a.is_dir() and b.is_dir()) or is_sharded(a) or is_sharded(b) or sets:
        fa, fb = _model_file(a), _model_file(b)
        names = (shown(fa, a, args.a), shown(fb, b, args.b))
        info, text = _diff_files(fa, fb, args, names)
        emit(args, info, text)
        return EXIT_OK if info["identical"] else EXIT_FOUND
    # Two checkpoint directories: every record file, matched by name.
    names_a = {p.name for p in a.glob("*" + RECORD_SUFFIX)}
    names_b = {p.name for p in b.glob("*" + RECORD_SUFFIX)}
    if not names_a and not names_b:
        raise OSError(
            f"{shown(a, a, args.a)} and {shown(b, b, args.b)}: no {RECORD_SUFFIX} files to compare"
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
    emit(
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
