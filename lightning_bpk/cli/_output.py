"""What every command prints: exit statuses, text made safe for a terminal, tables, ``--json``.

One place for the output rules of :mod:`lightning_bpk.cli`, so that each command's text and
JSON follow them the same way: text escapes control characters (a tensor name or a metadata
value cannot drive the terminal), JSON has no NaN or infinity, progress goes to stderr only
when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from lightning_bpk import burnpack

EXIT_OK = 0
EXIT_FOUND = 1  # differences (diff) or damage (verify, ls) found
EXIT_BAD_FILE = 2  # argparse also exits with 2 on usage errors: "the input was not usable"


def dtype_text(dtype: burnpack.DType) -> str:
    """A compact dtype label: ``F32``, ``Bool(Native)``, ``QFloat(Q8F)``."""
    if isinstance(dtype, str):
        return dtype
    ((variant, payload),) = dtype.items()
    if isinstance(payload, dict):
        payload = payload.get("value", "...")
    return f"{variant}({payload})"


def json_value(scalar: burnpack.Scalar) -> bool | int | float | str:
    """A scalar's value for strict JSON, which has no NaN or infinity: those become text."""
    value = scalar.value
    return value if not isinstance(value, float) or math.isfinite(value) else repr(value)


def _escape(c: str) -> str:
    return c if c.isprintable() else repr(c)[1:-1]


def printable(text: str) -> str:
    r"""``text`` with every non-printable character but the line breaks (control codes, ANSI
    escapes, bidi overrides) escaped as in a Python string literal.

    >>> printable("a\x1b[2Jb\nc\u202ed")
    'a\\x1b[2Jb\nc\\u202ed'
    """
    return "\n".join(
        line if line.isprintable() else "".join(map(_escape, line)) for line in text.split("\n")
    )


def table(rows: list[list[str]]) -> str:
    """``rows`` (the first one the header) as left-aligned columns, each cell made printable."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def emit(args: argparse.Namespace, info: Any, text: str) -> None:
    """Print a command's result: ``info`` as JSON with ``--json``, else ``text`` made printable."""
    print(json.dumps(info, indent=2) if args.json else printable(text))


def progress(label: str) -> Callable[[int, int, str], None] | None:
    """A per-item progress line on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None

    def report(done: int, total: int, name: str) -> None:
        end = "\n" if done == total else ""
        print(f"\r\033[K{label} {done}/{total} {name}", end=end, file=sys.stderr, flush=True)

    return report


def size_text(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB`` ... up to GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
