"""Griffe extension for the API pages: the package's reST-flavoured docstrings as Markdown.

The docstrings are written for ``help()`` and doctest, in reST habits; mkdocstrings renders
Markdown. Three constructs would read badly, so they are rewritten before rendering:

- roles such as ``:class:`~lightning_bpk.checkpointer.Checkpointer``` become cross-references
  (``[Checkpointer][lightning_bpk.checkpointer.Checkpointer]``) that mkdocs-autorefs resolves, so
  a reference to a public name that is not documented fails the strict build. Targets outside
  the public package (torch, Lightning, private modules) become code spans;
- ``>>>`` doctest blocks (Markdown would nest them as block quotes) become ``pycon`` code blocks;
- reST literal blocks (a paragraph ending in ``::`` then an indented block) become code blocks.

Loaded by ``mkdocs.yml`` (``extensions: - docs/griffe_sphinx_roles.py``).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

PACKAGE = "lightning_bpk"
# :class:`Name`, :func:`~pkg.mod.fn`, :mod:`text <pkg.mod>`, with an optional domain (:py:class:).
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`([^`]+)`")
EXPLICIT_TITLE = re.compile(r"(.+?)\s*<([^>]+)>")
DOCTEST_PROMPT = ">>> "
TREE_CHARS = "├└│"  # a directory picture, not code


def _resolve(target: str, obj: griffe.Object) -> str | None:
    """The documented path ``target`` names, seen from ``obj``'s module, or None when it is not
    a rendered public object of this package (then it is shown as code, not linked).

    Re-exports are followed to the defining module, which is where the API pages render them.
    A ``lightning_bpk`` path that exists nowhere is returned as is, so the strict build fails
    on it: that is a broken reference in a docstring.
    """
    head = target.partition(".")[0]
    if target == PACKAGE or target.startswith(PACKAGE + "."):
        path = target
    elif head in obj.module.members:
        path = obj.module.path + "." + target
    else:
        return None
    try:
        found = obj.modules_collection[path]
    except KeyError:
        return path
    found = found.final_target if found.is_alias else found
    # Undocumented constants are not rendered (show_if_no_docstring is off): nothing to link to.
    if found.is_attribute and not found.docstring:
        return None
    if any(part.startswith("_") for part in found.path.split(".")):
        return None
    return found.path


def _roles(text: str, obj: griffe.Object) -> str:
    def replace(match: re.Match[str]) -> str:
        content = match.group(1)
        explicit = EXPLICIT_TITLE.fullmatch(content)
        if explicit:
            title, target = explicit.groups()
        else:
            target = content.lstrip("~")
            title = target.rsplit(".", 1)[-1] if content.startswith("~") else target
        path = _resolve(target, obj)
        return f"`{title}`" if path is None else f"[`{title}`][{path}]"

    return ROLE.sub(replace, text)


def _language(body: str) -> str:
    """Highlighting for a literal block: doctest, shell session, directory tree/prose, Python."""
    first = body.lstrip()
    if first.startswith(DOCTEST_PROMPT):
        return "pycon"
    if first.startswith("$ "):
        return "console"
    if any(c in body for c in TREE_CHARS) or "/" in first.split("\n", 1)[0][-2:]:
        return "text"
    return "python"


def _blocks(text: str) -> str:
    """Fence doctest blocks and reST literal blocks, keeping their indentation level."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith(DOCTEST_PROMPT) or stripped == DOCTEST_PROMPT.strip():
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent) :])
                i += 1
            out += [indent + "```pycon", *(indent + b for b in block), indent + "```"]
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            # "Example::" -> "Example:"; a lone "::" disappears.
            lead = stripped[:-2].rstrip()
            if lead:
                out.append(indent + lead + ":")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_start = j
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(indent)
            ):
                j += 1
            while j > block_start and not lines[j - 1].strip():
                j -= 1
            body = textwrap.dedent("\n".join(lines[block_start:j]))
            if body.strip():
                language = _language(body)
                out += ["", indent + f"```{language}"]
                out += [indent + b if b else "" for b in body.splitlines()]
                out += [indent + "```", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrite reST roles, doctests and literal blocks in every docstring (see module doc)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _roles(_blocks(obj.docstring.value), obj)
