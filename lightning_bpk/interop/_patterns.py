"""Simple patterns: the regexes whose inverse can be derived (see
:mod:`lightning_bpk.interop.remap`): optional ``^``, literal text (``\\.``-style escapes) and
capture groups, optional ``$``; and replacement templates, with their group references and the
``{i}`` element index of an ``Unstack`` target.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_bpk.interop.rules import RemapError

__all__ = [
    "INDEX_FIELD",
    "Group",
    "SimplePattern",
    "derive_inverse",
    "parse_simple",
    "template_regex",
]

_LITERAL_ESCAPES = frozenset(string.punctuation + " ")
_META = frozenset(".^$*+?{}[]|()\\")
INDEX_FIELD = "{i}"
"""Where an ``Unstack`` target template puts the element index."""


@dataclass(frozen=True)
class Group:
    """A capture group of a simple pattern: its number and its body."""

    number: int  # 1-based, as in the pattern
    regex: str  # the group's body


@dataclass(frozen=True)
class _Ref:
    number: int  # a back-reference in a replacement template


@dataclass(frozen=True)
class SimplePattern:
    """A pattern made of literal text and capture groups only, so it can be inverted."""

    start: bool  # anchored with ^
    pieces: tuple[str | Group, ...]
    end: bool  # anchored with $


def _group_end(pattern: str, i: int) -> int:
    """Index of the ``)`` closing the group opened at ``pattern[i]``."""
    depth, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise RemapError(f"pattern {pattern!r}: unbalanced parenthesis")


def parse_simple(pattern: str) -> SimplePattern:
    """Split a simple pattern into literal text and capture groups; RemapError otherwise."""
    i, n = 0, len(pattern)
    start = pattern.startswith("^")
    i += start
    end = pattern.endswith("$") and not pattern.endswith("\\$") and n > i
    n -= end
    pieces: list[str | Group] = []
    literal: list[str] = []
    number = 0

    def flush() -> None:
        if literal:
            pieces.append("".join(literal))
            literal.clear()

    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n or pattern[i + 1] not in _LITERAL_ESCAPES:
                raise RemapError(
                    f"pattern {pattern!r} is not simple (escape {pattern[i : i + 2]!r})"
                )
            literal.append(pattern[i + 1])
            i += 2
        elif c == "(":
            close = _group_end(pattern, i)
            body = pattern[i + 1 : close]
            if body.startswith("?") or re.compile(body).groups:
                raise RemapError(f"pattern {pattern!r} is not simple (group {body!r})")
            flush()
            number += 1
            pieces.append(Group(number, body))
            i = close + 1
        elif c in _META:
            raise RemapError(f"pattern {pattern!r} is not simple ({c!r} outside a group)")
        else:
            literal.append(c)
            i += 1
    flush()
    return SimplePattern(start, tuple(pieces), end)


_REF = re.compile(r"\\(?:g<(\d+)>|(\d+))|\\(.)|([^\\]+)", re.S)


def _parse_template(template: str) -> list[str | _Ref]:
    """Split a replacement template into literal text and group references."""
    out: list[str | _Ref] = []
    for m in _REF.finditer(template):
        number = m.group(1) or m.group(2)
        if number:
            out.append(_Ref(int(number)))
        else:
            text = m.group(4) if m.group(4) is not None else m.group(3)
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)
    return out


def template_regex(template: str, groups: Mapping[int, str], where: str) -> str:
    """A regex matching what ``template`` expands to: each ``\\N`` becomes group N's regex as a
    named group ``gN`` (repeats become back-references); ``{i}`` becomes the group ``i``."""
    parts: list[str] = []
    seen: set[int] = set()
    for piece in _parse_template(template):
        if isinstance(piece, _Ref):
            if piece.number not in groups:
                raise RemapError(
                    f"{where}: template {template!r} refers to missing group {piece.number}"
                )
            name = f"g{piece.number}"
            parts.append(
                f"(?P={name})" if piece.number in seen else f"(?P<{name}>{groups[piece.number]})"
            )
            seen.add(piece.number)
        else:
            for k, chunk in enumerate(piece.split(INDEX_FIELD)):
                if k:
                    parts.append(r"(?P<i>\d+)")
                parts.append(re.escape(chunk))
    return "".join(parts)


def derive_inverse(pattern: str, replacement: str) -> tuple[str, str]:
    """The inverse ``(pattern, replacement)`` of a simple rename rule (see the module docs).

    >>> derive_inverse(r"(.+)\\.gamma", r"\\1.weight")
    ('(.+)\\\\.weight', '\\\\g<1>.gamma')
    >>> derive_inverse(r"^model\\.", "")
    ('^', 'model.')
    """
    where = f"rename {pattern!r} -> {replacement!r}"
    simple = parse_simple(pattern)
    groups = {p.number: p.regex for p in simple.pieces if isinstance(p, Group)}
    refs = [p.number for p in _parse_template(replacement) if isinstance(p, _Ref)]
    if sorted(refs) != sorted(groups):
        raise RemapError(f"{where}: every group must appear exactly once in the replacement")
    order = {number: k + 1 for k, number in enumerate(refs)}  # group N -> its number inverted
    body = "".join(
        f"({groups[p.number]})" if isinstance(p, _Ref) else re.escape(p)
        for p in _parse_template(replacement)
    )
    if not body and not (simple.start or simple.end):
        raise RemapError(f"{where}: the inverse would match everywhere; give inverse=")
    inv_pattern = ("^" if simple.start else "") + body + ("$" if simple.end else "")
    inv_replacement = "".join(
        f"\\g<{order[p.number]}>" if isinstance(p, Group) else p.replace("\\", "\\\\")
        for p in simple.pieces
    )
    return inv_pattern, inv_replacement
