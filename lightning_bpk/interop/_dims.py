"""Following each tensor's dims through the rules, from the file tensor to the module tensor,
for the shard loader: which dim of the file a module dim came from, which dims an op worked
along (a shard cut there does not commute with the op), and where a ``MergeModulelist``
stacked a list (a cut there selects list elements).

Renames (any rule with ``renames_only``) keep the dims, ``Transpose`` swaps two,
``MergeModulelist`` adds one, ``SplitModulelist``/``Unstack`` remove one; ``Concatenate``,
``Chunk``, ``Split``, ``Interleave`` and the rows of ``PermuteForRope`` work along theirs. A
rule or op not known here leaves every dim where it was and marks each as worked along.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lightning_bpk.interop import ops
from lightning_bpk.interop.conversions import WeightConverter
from lightning_bpk.interop.ops import Transpose
from lightning_bpk.interop.remap import Split, Unstack
from lightning_bpk.interop.rules import Step

__all__ = [
    "Dims",
    "follow",
]


@dataclass(frozen=True)
class _Pick:
    """A file tensor stacked by MergeModulelist: it is element ``index`` along ``dim``, and its
    name is ``head + str(index) + tail`` (``head`` None: the index is not in its file name)."""

    dim: int
    index: int
    head: str | None
    tail: str


@dataclass
class Dims:
    """A tensor in the middle of the rules: for each file tensor it comes from, where that
    tensor's dims are now (None: gone) and, if it was stacked, where; and which dims an op
    worked along (dim -> the op)."""

    origin: dict[str, list[int | None]]
    whole: dict[int, str] = field(default_factory=dict)
    picks: dict[str, _Pick] = field(default_factory=dict)

    def mapped(self, dims: list[int | None], whole: dict[int, str]) -> Dims:
        """After a step that moves dim ``i`` to ``dims[i]`` and works along ``whole``."""
        return Dims(
            {s: [None if d is None else dims[d] for d in ds] for s, ds in self.origin.items()},
            {m: why for d, why in self.whole.items() if (m := dims[d]) is not None} | whole,
            {
                s: _Pick(m, p.index, p.head, p.tail)
                for s, p in self.picks.items()
                if (m := dims[p.dim]) is not None
            },
        )


class _Unknown(Exception):
    """A rule or op whose effect on dims this module does not know."""


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


Moves = tuple[list[int | None], set[int]]  # where each dim goes (None: gone), dims worked along


def _swap(ndim: int, dim0: int, dim1: int) -> Moves:
    dims: list[int | None] = list(range(ndim))
    a, b = _norm(dim0, ndim), _norm(dim1, ndim)
    dims[a], dims[b] = b, a
    return dims, set()


def _drop(ndim: int, dim: int) -> Moves:
    gone = _norm(dim, ndim)
    return [None if d == gone else d - (d > gone) for d in range(ndim)], set()


def _op_moves(op: ops.ConversionOps, ndim: int, first: bool) -> Moves:
    """What ``op`` does to the dims of ``ndim``-dim tensors; ``first``: it takes the converter's
    lists of tensors (only then does MergeModulelist stack, adding a dim)."""
    if isinstance(op, ops.Chunk | ops.Concatenate | ops.Interleave):
        return list(range(ndim)), {_norm(op.dim, ndim)}
    if isinstance(op, ops.PermuteForRope):
        return list(range(ndim)), {0}
    if isinstance(op, ops.Transpose):
        return _swap(ndim, op.dim0, op.dim1)
    if isinstance(op, ops.MergeModulelist):
        if not first:
            return list(range(ndim)), set()
        new = _norm(op.dim, ndim + 1)
        return [d if d < new else d + 1 for d in range(ndim)], {new}
    if isinstance(op, ops.SplitModulelist):
        return _drop(ndim, op.dim)
    raise _Unknown


def _rule_moves(step: Step, ndim: int) -> tuple[list[int | None], set[int], int | None]:
    """What the rule of ``step`` does to the dims of an ``ndim``-dim tensor it converts, and
    the dim a MergeModulelist stacked its list along (a selection of the list commutes with a
    cut there: each rank stacks only its elements)."""
    rule = step.rule
    if rule.renames_only:
        return list(range(ndim)), set(), None
    if isinstance(rule, Transpose):
        return (*_swap(ndim, rule.dim0, rule.dim1), None)
    if isinstance(rule, Unstack):
        return (*_drop(ndim, rule.dim), None)
    if isinstance(rule, Split):
        return list(range(ndim)), {_norm(rule.dim, ndim)}, None
    if isinstance(rule, WeightConverter):
        moves: list[int | None] = list(range(ndim))
        whole: set[int] = set()
        stacked: int | None = None
        for k, op in enumerate(rule.operations):
            dims, works = _op_moves(op, ndim, k == 0)
            moves = [None if d is None else dims[d] for d in moves]
            whole = {d for d in (dims[w] for w in whole) if d is not None}
            stacked = None if stacked is None else dims[stacked]
            ndim = len({d for d in dims if d is not None} | works)  # a stacked dim is new
            if k == 0 and isinstance(op, ops.MergeModulelist):
                (stacked,) = works
            else:
                whole |= works
        return moves, whole, stacked
    raise _Unknown


def _pick(step: Step, name: str, file_name: str, dim: int) -> _Pick:
    """Where the converter of ``step`` stacks ``name`` (its ``*`` index), and where that index
    is in ``file_name``."""
    rule: WeightConverter = step.rule  # type: ignore[assignment]
    pattern = rule.rename_source_key(name)[1] or ""
    found = None
    if pattern.count("*.") == 1:  # the converter numbers one list per pattern
        found = re.search(pattern.replace("*.", r"(?P<star>\d+)\."), name)
    if found is None:
        return _Pick(dim, 0, None, "")
    index, tail = int(found["star"]), name[found.end("star") :]
    end = f"{index}{tail}"
    head = file_name[: -len(end)] if file_name.endswith("." + end) else None
    return _Pick(dim, index, head, tail)


def _unknown(step: Step) -> str:
    return f"{step.rule} (a rule whose effect on dims is not known here)"


def follow(steps: list[Step], names: list[str], ndims: dict[str, int]) -> dict[str, Dims]:
    """Each tensor after the rules (by module name) -> where its file tensors' dims went."""
    state = {n: Dims({n: list(range(ndims[n]))}) for n in names}
    # made by an untraced rule: may come from any file tensor, read whole
    unknown: dict[str, list[int | None]] = {n: [None] * ndims[n] for n in names}

    def moved(step: Step, name: str, dims: Dims, ndim: int) -> Dims:
        try:
            moves, works, stacked = _rule_moves(step, ndim)
        except _Unknown:  # every dim stays where it was, and must be whole
            return dims.mapped(list(range(ndim)), dict.fromkeys(range(ndim), _unknown(step)))
        out = dims.mapped(moves, dict.fromkeys(works, str(step.rule)))
        if stacked is not None:
            out.picks.update({f: _pick(step, name, f, stacked) for f in dims.origin})
        return out

    for step in steps:
        after: dict[str, Dims] = {}
        for olds, news in step.pairs:
            merged = Dims({})
            for old in olds:
                part = moved(step, old, state[old], step.before[old][0].dim())
                merged.origin.update(part.origin)
                merged.whole.update(part.whole)
                merged.picks.update(part.picks)
            after.update(dict.fromkeys(news, merged))
        for name, (tensor, _) in step.after.items():
            if name in after:
                continue
            if name not in state:  # made by a rule that did not report it (not traced)
                whole = dict.fromkeys(range(tensor.dim()), _unknown(step))
                after[name] = Dims(dict(unknown), whole)
            elif step.before[name][0] is tensor:
                after[name] = state[name]
            else:  # changed in place (Transpose)
                after[name] = moved(step, name, state[name], step.before[name][0].dim())
        state = after
    return state
