"""Burn's store filters as :class:`~lightning_bpk.interop.remap.KeyRemapper` rules: which
tensors a load or save takes (:class:`KeyFilter`, Burn's ``with_regex``/``with_full_path``),
and layer indices made contiguous (:class:`Renumber`, Burn's ``map_indices_contiguous``).

A filtered-out file tensor is not loaded (as an unused one; a module tensor it leaves without
a value is *missing*, so a partial load says ``allow_partial=True``); on save only the module
tensors the filter keeps are written.

Example::

    >>> import torch
    >>> from lightning_bpk.interop import KeyRemapper
    >>> items = {n: (torch.zeros(1), None) for n in ["enc.layers.0.w", "enc.layers.3.w", "head.w"]}
    >>> sorted(KeyRemapper([KeyFilter(regex=[r"^enc\\."])]).load(items).tensors)
    ['enc.layers.0.w', 'enc.layers.3.w']
    >>> sorted(KeyRemapper([Renumber(r"layers\\.(\\d+)\\.")]).load(items).tensors)
    ['enc.layers.0.w', 'enc.layers.1.w', 'head.w']
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lightning_bpk.interop.rules import Items, RemapError, Rule, trace_step

__all__ = ["KeyFilter", "Renumber"]


class KeyFilter(Rule):
    """Keep only the tensors whose name matches one of ``regex`` (searched anywhere) or is one
    of ``full_paths``; the same filter on load and on save. With neither, everything is kept."""

    traced = True
    renames_only = True

    def __init__(self, regex: Iterable[str] = (), full_paths: Iterable[str] = ()) -> None:
        self.regex = tuple(regex)
        self.full_paths = frozenset(full_paths)
        self._compiled = [re.compile(p) for p in self.regex]

    def keeps(self, name: str) -> bool:
        """Whether ``name`` passes the filter."""
        if not self.regex and not self.full_paths:
            return True
        return name in self.full_paths or any(p.search(name) for p in self._compiled)

    def _keep(self, items: Items) -> tuple[Items, int]:
        kept = {n: item for n, item in items.items() if self.keeps(n)}
        trace_step([([n], []) for n in items if n not in kept])
        return kept, len(items) - len(kept)

    def forward(self, items: Items) -> tuple[Items, int]:
        return self._keep(items)

    def backward(self, items: Items) -> tuple[Items, int]:
        return self._keep(items)

    def __str__(self) -> str:
        return f"KeyFilter(regex={list(self.regex)}, full_paths={sorted(self.full_paths)})"


class Renumber(Rule):
    """Make the index captured by ``pattern``'s one group contiguous from 0, per prefix (the
    name up to the index): ``layers.0``, ``layers.2``, ``layers.5`` load as ``layers.0``, ``.1``,
    ``.2`` (a checkpoint with pruned layers into a module without gaps). Saving keeps the
    module's indices: the original gaps are not recorded anywhere, so they are not restored.
    A name's new index depends on every other name, so a load through it is one group (not
    split across the loader's threads)."""

    def __init__(self, pattern: str = r"\.(\d+)\.") -> None:
        self.pattern = pattern
        self._compiled = re.compile(pattern)
        if self._compiled.groups != 1:
            raise RemapError(f"Renumber({pattern!r}): the pattern needs exactly one group")

    def forward(self, items: Items) -> tuple[Items, int]:
        found = {n: m for n in items if (m := self._compiled.search(n)) and m.group(1).isdigit()}
        indices: dict[str, set[int]] = {}
        for name, m in found.items():
            indices.setdefault(name[: m.start(1)], set()).add(int(m.group(1)))
        new_index = {
            prefix: {old: new for new, old in enumerate(sorted(seen))}
            for prefix, seen in indices.items()
        }
        out: Items = {}
        links = []
        for name, item in items.items():
            m = found.get(name)
            new = name
            if m is not None:
                index = new_index[name[: m.start(1)]][int(m.group(1))]
                new = name[: m.start(1)] + str(index) + name[m.end(1) :]
            if new in out:
                raise RemapError(f"{self}: two tensors map to {new!r}")
            if new != name:
                links.append(([name], [new]))
            out[new] = item
        trace_step(links)
        return out, len(links)

    def backward(self, items: Items) -> tuple[Items, int]:
        return dict(items), 0

    def __str__(self) -> str:
        return f"Renumber({self.pattern!r})"
