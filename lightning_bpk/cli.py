"""The ``lightning-bpk`` command line (also ``python -m lightning_bpk``).

Each subcommand is one ``_cmd_<name>(args) -> int`` function registered in :func:`build_parser`,
so ``ls``, ``verify``, ``convert`` or ``diff`` can be added beside ``inspect`` without touching
the others. A bad file is reported on stderr with its path and exit status :data:`EXIT_BAD_FILE`.

Example::

    $ lightning-bpk inspect model.bpk
    $ lightning-bpk inspect model.bpk --json | jq .tensors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_bpk import burnpack

EXIT_OK = 0
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


def describe(pack: burnpack.Pack) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-ready data (tensors in data-section order)."""
    order = sorted(pack.names, key=lambda n: pack.entries[n].data_offsets)
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


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def format_text(info: dict[str, Any]) -> str:
    """The human-readable ``inspect`` report of :func:`describe`'s output."""
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    with burnpack.read(args.file) as pack:
        info = describe(pack)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_text(info))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subparser sets ``func`` to its ``_cmd_*`` handler."""
    parser = argparse.ArgumentParser(
        prog="lightning-bpk", description="Inspect Burn burnpack (.bpk) files."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="show header, tensors, scalars and metadata")
    inspect.add_argument("file", help="path to a .bpk file ('.bpk' is added if missing)")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON")
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad file or usage).

    >>> main(["inspect", "/nonexistent.bpk"])
    2
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `| head` closed stdout early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except burnpack.BurnpackError as e:
        print(f"lightning-bpk {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_FILE
