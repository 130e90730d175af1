"""The machinery every interop rule shares: the items a rule moves, the rule interface, and the
tracing that lets the loaders follow names and dims through the rules.

An *item* is one tensor as the rules move it, with its param id (``None``: not yet assigned);
*items* map names to items, in order. A :class:`Rule` maps items to items (``forward``: file
names to module names, ``backward``: the inverse). Rules that rename, split or fuse report which
names became which through :func:`trace_step`; ``tracing()`` collects those links (the
parallel loader groups the tensors converted together by them) and ``observing()`` records
every step with its items before and after (the shard loader follows each tensor's dims).

This module is the bottom of :mod:`lightning_bpk.interop`: every other interop module may
import it, and it imports none of them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import xxhash

from lightning_bpk.errors import LightningBpkError

__all__ = [
    "Item",
    "Items",
    "RemapError",
    "Rule",
    "Step",
    "derived_param_id",
    "observing",
    "replace_items",
    "run_step",
    "trace_step",
    "tracing",
]

Item = tuple[torch.Tensor, int | None]
"""One tensor as the rules move it, with its param id (``None``: not yet assigned)."""
Items = dict[str, Item]
"""What a :class:`Rule` maps: names to items, in order."""


class RemapError(LightningBpkError, ValueError):
    """A rule cannot be applied or inverted; the message names the rule and the key."""


def derived_param_id(param_id: int | None, index: int) -> int | None:
    """A stable id for part ``index`` (> 0) of a tensor whose id is ``param_id``."""
    if param_id is None:
        return None
    return xxhash.xxh3_64_intdigest(f"{param_id}/{index}".encode())


# While tracing (see :func:`tracing`): one entry per rule step that renamed, split or fused
# tensors, listing ``(input names, output names)`` pairs that all read the same input.
Links = list[list[tuple[list[str], list[str]]]]
_LINKS: contextvars.ContextVar[Links | None] = contextvars.ContextVar(
    "lightning_bpk_remap_links", default=None
)


@contextlib.contextmanager
def tracing() -> Iterator[Links]:
    """Record which names each rule step turned into which, in order. The parallel loader uses
    them to find the tensors that must be converted together."""
    links: Links = []
    token = _LINKS.set(links)
    try:
        yield links
    finally:
        _LINKS.reset(token)


def trace_step(pairs: list[tuple[list[str], list[str]]]) -> None:
    """Note that, in one step, each ``(old, new)`` pair's tensors ``old`` became ``new`` (a
    no-op unless ``tracing()``)."""
    links = _LINKS.get()
    if links is not None and pairs:
        links.append(pairs)


@dataclass(frozen=True)
class Step:
    """One rule applied, as :func:`observing` records it: the items before and after, and the
    ``(old names, new names)`` pairs the rule reported with :func:`trace_step`."""

    rule: Rule
    before: Items
    after: Items
    pairs: list[tuple[list[str], list[str]]]


_STEPS: contextvars.ContextVar[list[Step] | None] = contextvars.ContextVar(
    "lightning_bpk_remap_steps", default=None
)


@contextlib.contextmanager
def observing() -> Iterator[list[Step]]:
    """Record every rule a ``KeyRemapper`` applies, in order, as :class:`Step`. The
    shard loader uses them to follow each tensor's dims from the file to the module."""
    steps: list[Step] = []
    token = _STEPS.set(steps)
    try:
        yield steps
    finally:
        _STEPS.reset(token)


def run_step(
    rule: Rule, items: Items, call: Callable[[Items], tuple[Items, int]]
) -> tuple[Items, int]:
    """``call(items)`` for ``rule``, recorded while :func:`observing`."""
    steps = _STEPS.get()
    if steps is None:
        return call(items)
    outer = _LINKS.get()
    with tracing() as links:
        after, touched = call(items)
    if outer is not None:
        outer.extend(links)
    steps.append(Step(rule, items, after, [pair for step in links for pair in step]))
    return after, touched


def replace_items(items: Items, replacements: list[tuple[list[str], Items]], where: str) -> Items:
    """``items`` with, for each of the disjoint ``(old, new)`` replacements, the keys ``old``
    removed and ``new`` inserted where the first old key was, in one pass."""
    trace_step([(old, list(new)) for old, new in replacements])
    at = {old[0]: new for old, new in replacements}
    dropped = {name for old, _ in replacements for name in old}
    out: Items = {}
    for name, item in items.items():
        if name in at:
            for new_name, new_item in at[name].items():
                if new_name in out or (new_name in items and new_name not in dropped):
                    raise RemapError(f"{where}: produces {new_name!r}, which already exists")
                out[new_name] = new_item
        elif name not in dropped:
            if name in out:
                raise RemapError(f"{where}: produces {name!r}, which already exists")
            out[name] = item
    return out


class Rule:
    """A reversible step. ``forward`` maps file names to module names, ``backward`` inverts it;
    each returns the new items and how many names the step touched.

    A rule that renames, splits or fuses names reports it with :func:`trace_step` (the built-in
    rules do), which lets :func:`~lightning_bpk.interop.loading.load_remapped` convert
    independent tensors in parallel; it loads sequentially past any rule without ``traced``.
    """

    traced = False  # reports every name it changes through trace_step
    renames_only = False  # changes names, never a tensor (the shard loader reads through it)
    phase: str | None = None  # "rename"/"convert": transformers' vocabulary, run as a block

    def forward(self, items: Items) -> tuple[Items, int]:
        raise NotImplementedError

    def backward(self, items: Items) -> tuple[Items, int]:
        raise NotImplementedError
