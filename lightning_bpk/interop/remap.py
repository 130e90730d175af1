"""Key remapping between a file's tensor names and a module's: ordered, reversible rules.

A :class:`KeyRemapper` holds an ordered list of rules. Loading applies them in order to the
file's tensors (file names -> module names); saving applies their inverses in reverse order
(module names -> file names), so what was loaded saves back to the same names, shapes, bytes
and param ids. Four kinds of rule:

- :class:`Rename` ``(pattern, replacement)``: ``re.sub`` on every name, capture groups allowed
  (``Rename(r"^model\\.", "")``, ``Rename(r"(.+)\\.gamma", r"\\1.weight")``);
- :class:`Split` a fused tensor into parts along a dim on load, concatenated on save (``qkv`` ->
  ``q``, ``k``, ``v``);
- :class:`Unstack` one tensor into a numbered list of tensors on load, stacked on save;
- :class:`Transpose` two dims of matching tensors on load, and back on save (without a pattern,
  ``Transpose(dim0, dim1)`` is transformers' op of that name, for a ``WeightConverter``).

transformers' vocabulary (``WeightRenaming``, ``WeightConverter`` and its ops, in
:mod:`lightning_bpk.interop.conversions`) are rules too, and mix with these: a run of
consecutive transformers rules behaves as transformers runs a mapping.

**How a rule is inverted.** A rename's inverse is given explicitly (``inverse=(pattern,
replacement)``) or derived when the pattern is *simple*: optional ``^``, then literal text
(``\\.``-style escapes allowed) and capture groups, then optional ``$``, with every group used
exactly once in the replacement. The derived inverse matches the replacement's literal text
with each group reference turned back into that group's regex, and rebuilds the pattern's
literal text: ``(.+)\\.gamma -> \\1.weight`` inverts to ``(.+)\\.weight -> \\1.gamma``. Anything
else (``\\d``, ``*``, alternation outside a group) needs an explicit inverse. Saving checks each
step: the forward rule applied to the inverted name must give the name back, else a
:class:`RemapError` names the rule and the key. A forward rule that maps two different names
to one (``gamma -> weight`` where plain ``weight`` keys exist too) cannot be inverted by any
rule: narrow its pattern (``(.+norm)\\.gamma``) or use the layer-aware adapters in
:mod:`lightning_bpk.interop.adapters`.

Rules describe the *file* format, so saving inverts every rule: ``Rename(r"^model\\.", "")``
strips ``model.`` where present on load and puts it on every name on save. A rule that matched
nothing on load (reported in :attr:`RemapResult.unmatched`) usually means the rules do not
describe that file.

Split/Unstack patterns are matched against whole names (``re.fullmatch``) and must be simple
too, because saving rebuilds the fused name from the parts' names.

**Param ids.** A split's first part takes the fused tensor's id and the other parts get ids
derived from it; concatenating on save takes the first part's id back, so a load/save round
trip keeps every id.

Example::

    >>> import torch
    >>> qkv = Split(r"(.+)\\.qkv", [r"\\1.q", r"\\1.k", r"\\1.v"])
    >>> remap = KeyRemapper([Rename(r"^model\\.", ""), qkv])
    >>> loaded = remap.load({"model.attn.qkv": (torch.arange(6.0), 7)})
    >>> list(loaded.tensors), loaded.unmatched
    (['attn.q', 'attn.k', 'attn.v'], [])
    >>> saved = remap.save(loaded.tensors)
    >>> list(saved.tensors), saved.tensors["model.attn.qkv"][0].tolist()
    (['model.attn.qkv'], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_bpk.interop._patterns import (
    INDEX_FIELD,
    Group,
    SimplePattern,
    derive_inverse,
    parse_simple,
    template_regex,
)
from lightning_bpk.interop._ties import tied_weights, untied_while
from lightning_bpk.interop.conversions import WeightConverter
from lightning_bpk.interop.ops import Transpose as Transpose  # a rule too (documented in ops)
from lightning_bpk.interop.rules import (
    Item,
    Items,
    RemapError,
    Rule,
    derived_param_id,
    replace_items,
    run_step,
    trace_step,
)
from lightning_bpk.records.module import Adapter, ModuleRecord

__all__ = [
    "KeyRemapper",
    "RemapResult",
    "Rename",
    "Split",
    "Unstack",
    "apply_remapped",
    "derive_inverse",
    "record_remapped",
]

# One tensor as the remapper moves it: the data and its param id (None: not yet assigned).


# Characters a simple pattern may escape as literal text (``\.``, ``\-``, ...).
def _replace(items: Items, old: Iterable[str], new: Items, where: str) -> Items:
    """``items`` with the keys ``old`` removed and ``new`` inserted where the first old key was."""
    return replace_items(items, [(list(old), new)], where)


# --- rules ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rename(Rule):
    """``re.sub(pattern, replacement, name)`` on load; the inverse rule on save.

    >>> Rename(r"(.+)\\.gamma", r"\\1.weight").inverse
    ('(.+)\\\\.weight', '\\\\g<1>.gamma')
    """

    pattern: str
    replacement: str
    inverse: tuple[str, str] | None = None
    traced = True
    renames_only = True

    def __post_init__(self) -> None:
        re.compile(self.pattern)
        inverse = self.inverse or derive_inverse(self.pattern, self.replacement)
        object.__setattr__(self, "inverse", inverse)
        re.compile(inverse[0])

    def __str__(self) -> str:
        return f"Rename({self.pattern!r} -> {self.replacement!r})"

    def _map(
        self, items: Items, pattern: str, replacement: str, check: tuple[str, str] | None
    ) -> tuple[Items, int]:
        out: Items = {}
        touched = 0
        links = []
        for name, item in items.items():
            new = re.sub(pattern, replacement, name)
            if new != name:
                touched += 1
                links.append(([name], [new]))
                if check is not None and re.sub(check[0], check[1], new) != name:
                    raise RemapError(
                        f"{self}: cannot invert for {name!r} (saved as {new!r}, which loads "
                        f"back as {re.sub(check[0], check[1], new)!r}); give inverse="
                    )
            if new in out:
                raise RemapError(f"{self}: two tensors map to {new!r}")
            out[new] = item
        trace_step(links)
        return out, touched

    def forward(self, items: Items) -> tuple[Items, int]:
        return self._map(items, self.pattern, self.replacement, None)

    def backward(self, items: Items) -> tuple[Items, int]:
        assert self.inverse is not None  # set by __post_init__
        return self._map(items, *self.inverse, (self.pattern, self.replacement))


@dataclass(frozen=True)
class Split(Rule):
    """A fused tensor split into ``targets`` along ``dim`` on load, concatenated on save.

    ``sizes`` gives each part's extent along ``dim`` (default: equal parts).

    >>> rule = Split(r"(.+)\\.qkv\\.(weight|bias)", [r"\\1.q.\\2", r"\\1.k.\\2", r"\\1.v.\\2"])
    >>> items, _ = rule.forward({"attn.qkv.bias": (torch.arange(3.0), None)})
    >>> list(items)
    ['attn.q.bias', 'attn.k.bias', 'attn.v.bias']
    """

    pattern: str
    targets: Sequence[str]
    dim: int = 0
    sizes: Sequence[int] | None = None
    _simple: SimplePattern = field(init=False, repr=False, compare=False)
    _first: re.Pattern = field(init=False, repr=False, compare=False)
    traced = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if len(self.targets) < 1:
            raise RemapError(f"{self}: needs at least one target")
        if self.sizes is not None and len(self.sizes) != len(self.targets):
            raise RemapError(f"{self}: {len(self.sizes)} sizes for {len(self.targets)} targets")
        simple = parse_simple(self.pattern)
        groups = {p.number: p.regex for p in simple.pieces if isinstance(p, Group)}
        object.__setattr__(self, "_simple", simple)
        regex = template_regex(self.targets[0], groups, str(self))
        object.__setattr__(self, "_first", re.compile(regex))

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.pattern!r} -> {list(self.targets)!r})"

    def _source_name(self, m: re.Match) -> str:
        """Rebuild the fused name from a match of the first target's regex."""
        return "".join(
            m.group(f"g{p.number}") if isinstance(p, Group) else p for p in self._simple.pieces
        )

    def _names(self, m: re.Match, count: int) -> list[str]:
        """The part names for a match of ``pattern`` (``count`` matters to Unstack only)."""
        return [m.expand(t) for t in self.targets]

    def _check_dim(self, name: str, tensor: torch.Tensor) -> int:
        if tensor.dim() == 0 or not -tensor.dim() <= self.dim < tensor.dim():
            raise RemapError(
                f"{self}: {name!r} of shape {list(tensor.shape)} has no dim {self.dim}"
            )
        return tensor.shape[self.dim]

    def _parts(self, name: str, tensor: torch.Tensor) -> Sequence[torch.Tensor]:
        extent = self._check_dim(name, tensor)
        count = len(self.targets)
        if self.sizes is not None:
            sizes = list(self.sizes)
        elif extent % count:
            raise RemapError(
                f"{self}: {name!r} has {extent} along dim {self.dim}, "
                f"not divisible into {count} parts"
            )
        else:
            sizes = [extent // count] * count
        if sum(sizes) != extent:
            raise RemapError(
                f"{self}: {name!r} has {extent} along dim {self.dim}, sizes sum to {sum(sizes)}"
            )
        return [p.contiguous() for p in torch.split(tensor, sizes, self.dim)]

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, self.dim)

    def _group_names(self, m: re.Match, items: Items) -> list[str]:
        """The part names to join for a match of ``pattern`` on save."""
        return self._names(m, len(self.targets))

    def forward(self, items: Items) -> tuple[Items, int]:
        touched = 0
        for name in list(items):
            m = re.fullmatch(self.pattern, name)
            if m is None:
                continue
            tensor, pid = items[name]
            parts = self._parts(name, tensor)
            names = self._names(m, len(parts))
            new = {
                n: (p, pid if k == 0 else derived_param_id(pid, k))
                for k, (n, p) in enumerate(zip(names, parts, strict=True))
            }
            items = _replace(items, [name], new, str(self))
            touched += 1
        return items, touched

    def backward(self, items: Items) -> tuple[Items, int]:
        touched = 0
        for name in list(items):
            if name not in items:
                continue  # consumed as a later part of an earlier group
            m = self._first.fullmatch(name)
            if m is None:
                continue
            source = self._source_name(m)
            sm = re.fullmatch(self.pattern, source)
            if sm is None:
                raise RemapError(f"{self}: {name!r} saves as {source!r}, which the pattern rejects")
            names = self._group_names(sm, items)
            missing = [n for n in names if n not in items]
            if missing:
                raise RemapError(f"{self}: cannot rebuild {source!r}, missing {missing}")
            joined = self._join([items[n][0] for n in names])
            items = _replace(items, names, {source: (joined, items[names[0]][1])}, str(self))
            touched += 1
        return items, touched


@dataclass(frozen=True)
class Unstack(Split):
    """One tensor unbound along ``dim`` into the numbered tensors ``target`` (a template with
    ``{i}``) on load, stacked back on save: ``Unstack(r"experts\\.w", "experts.{i}.w")``."""

    targets: Sequence[str] = ()

    def __init__(self, pattern: str, target: str, dim: int = 0) -> None:
        if INDEX_FIELD not in target:
            raise RemapError(f"Unstack({pattern!r}): target {target!r} needs {INDEX_FIELD}")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "targets", (target,))
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "sizes", None)
        self.__post_init__()

    def _names(self, m: re.Match, count: int) -> list[str]:
        return [m.expand(self.targets[0].replace(INDEX_FIELD, str(i))) for i in range(count)]

    def _parts(self, name: str, tensor: torch.Tensor) -> Sequence[torch.Tensor]:
        self._check_dim(name, tensor)
        return [p.contiguous() for p in torch.unbind(tensor, self.dim)]

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts, self.dim)

    def _group_names(self, m: re.Match, items: Items) -> list[str]:
        count = 0
        while m.expand(self.targets[0].replace(INDEX_FIELD, str(count))) in items:
            count += 1
        return self._names(m, count)


# --- the remapper -------------------------------------------------------------------------------


@dataclass
class RemapResult:
    """Remapped tensors (name -> (tensor, param_id), in order) and rules that matched nothing."""

    tensors: Items
    unmatched: list[str]


class KeyRemapper:
    """An ordered list of :class:`Rule`; :meth:`load` applies them, :meth:`save` inverts them."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise TypeError(
                    f"{rule!r} is not a Rule (Rename, Split, Unstack, Transpose, WeightRenaming, "
                    "WeightConverter)"
                )

    def __repr__(self) -> str:
        return f"KeyRemapper([{', '.join(map(str, self.rules))}])"

    def load(
        self, tensors: Mapping[str, Item], *, where: Callable[[str], str] | None = None
    ) -> RemapResult:
        """File names -> module names; ``where(name)`` names the file of a tensor in messages
        (a set's shard)."""
        return self._run(tensors, self.rules, "forward", where)

    def applied(self, unmatched: Iterable[str]) -> KeyRemapper:
        """This remapper without the rules that matched nothing at load (``unmatched``, as a
        load returns it): what saving must undo to give back the loaded file's names, as
        transformers reverts only the renamings a load used (a legacy ``gamma -> weight``
        renaming a file did not need is not applied on save either)."""
        skip = set(unmatched)
        return KeyRemapper([rule for rule in self.rules if str(rule) not in skip])

    def save(self, tensors: Mapping[str, Item]) -> RemapResult:
        """Module names -> file names (every rule inverted, last rule first)."""
        return self._run(tensors, list(reversed(self.rules)), "backward")

    @staticmethod
    def _run(
        tensors: Mapping[str, Item],
        rules: list[Rule],
        direction: str,
        where: Callable[[str], str] | None = None,
    ) -> RemapResult:
        items: Items = dict(tensors)
        unmatched: list[str] = []
        k = 0
        while k < len(rules):
            if rules[k].phase is None:
                items, touched = run_step(rules[k], items, getattr(rules[k], direction))
                if not touched:
                    unmatched.append(str(rules[k]))
                k += 1
                continue
            end = k
            while end < len(rules) and rules[end].phase is not None:
                end += 1
            items = _run_block(items, rules[k:end], direction, unmatched, where)
            k = end
        return RemapResult(items, unmatched)


def _run_block(
    items: Items,
    block: list[Rule],
    direction: str,
    unmatched: list[str],
    where: Callable[[str], str] | None = None,
) -> Items:
    """Consecutive transformers rules, run as transformers runs a mapping: on load every
    renaming (in order), then each name through at most one converter (the first matching);
    on save (``block`` reversed) the converters first, then the renamings. Problems of all the
    converters are reported together."""
    renamings = [r for r in block if r.phase == "rename"]
    converters = [r for r in block if r.phase == "convert"]
    steps = renamings + converters if direction == "forward" else converters + renamings
    produced: set[str] = set()
    problems: list[str] = []
    origin = {n: n for n in items}  # on load, each name as the file has it (for messages)
    for rule in steps:
        if rule.phase == "rename":
            renamed, touched = run_step(rule, items, getattr(rule, direction))
            origin = {new: origin.get(old, old) for new, old in zip(renamed, items, strict=True)}
            items = renamed
        else:
            assert isinstance(rule, WeightConverter)  # the only rule of the "convert" phase
            converter = rule if direction == "forward" else rule.reverse_transform()
            before = set(items)
            try:
                items, touched = run_step(
                    rule,
                    items,
                    functools.partial(
                        converter.convert_items,
                        exclude=frozenset(produced),
                        check=None if direction == "forward" else rule,
                        origin=origin if direction == "forward" else None,
                        where=where,
                    ),
                )
            except RemapError as e:
                problems.append(str(e))
                continue
            produced |= set(items) - before
        if not touched:
            unmatched.append(str(rule))
    if problems:
        raise RemapError("\n".join(problems))
    return items


def apply_remapped(
    record: ModuleRecord,
    module: nn.Module,
    remapper: KeyRemapper,
    *,
    adapter: Adapter | None = None,
    ties: Mapping[str, str] | None = None,
    **apply_options: Any,
) -> list[str]:
    """Load ``record`` into ``module`` through ``remapper`` (then ``adapter``), with
    :meth:`ModuleRecord.apply`'s checks and options; returns the rules that matched nothing.
    Ties as :func:`~lightning_bpk.interop.loading.load_remapped` honours them (``ties``,
    default: the module's declarations): a tied tensor the record omits comes from its tie, and
    one it holds with a value of its own is untied and loaded with it.

    Missing, unused and mismatched keys are reported together in one ``RecordError``, named as
    the module names them.
    """
    items = {n: (t, record.param_ids.get(n)) for n, t in record.tensors.items()}
    items.update(
        {a: (record.tensors[t], record.param_ids.get(t)) for a, t in record.aliases.items()}
    )
    result = remapper.load(items)
    tensors = {n: t for n, (t, _) in result.tensors.items()}
    ties = tied_weights(module) if ties is None else dict(ties)
    remapped = ModuleRecord(
        tensors,
        param_ids={n: p for n, (_, p) in result.tensors.items() if p is not None},
        aliases={t: s for t, s in ties.items() if t not in tensors and s in tensors},
        metadata=record.metadata,
    )
    with untied_while(module, tensors if adapter is None else (), ties, "the record"):
        remapped.apply(module, adapter=adapter, **apply_options)
    return result.unmatched


def record_remapped(
    module: nn.Module, remapper: KeyRemapper, *, adapter: Adapter | None = None
) -> tuple[ModuleRecord, list[str]]:
    """Record ``module`` (through ``adapter``), then invert ``remapper``: the file's names and
    layouts. Returns the record and the rules that matched nothing."""
    record = ModuleRecord.from_module(module, adapter=adapter)
    result = remapper.save({n: (t, record.param_ids.get(n)) for n, t in record.tensors.items()})
    aliases = {}
    for alias, target in record.aliases.items():
        names = [
            list(remapper.save({n: (record.tensors[target], None)}).tensors)
            for n in (alias, target)
        ]
        if any(len(n) != 1 for n in names):
            raise RemapError(f"tied tensor {alias!r} -> {target!r} cannot be split or fused")
        aliases[names[0][0]] = names[1][0]
    remapped = ModuleRecord(
        {n: t for n, (t, _) in result.tensors.items()},
        param_ids={n: p for n, (_, p) in result.tensors.items() if p is not None},
        aliases=aliases,
        metadata=record.metadata,
    )
    return remapped, result.unmatched
