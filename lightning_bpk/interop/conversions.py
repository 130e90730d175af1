"""transformers' weight-conversion vocabulary as :class:`~lightning_bpk.interop.remap.KeyRemapper`
rules: :class:`WeightRenaming`, :class:`WeightConverter` and the reversible ops (defined in
:mod:`lightning_bpk.interop.ops`; all importable from :mod:`lightning_bpk.interop`).

The names, arguments and semantics are those of Hugging Face transformers v5
(``transformers/core_model_loading.py``, read in 5.23.0), so a table from its
``conversion_mapping.py`` pastes in as it is. Mixtral's::

    >>> from lightning_bpk.interop import Concatenate, MergeModulelist
    >>> mixtral = [
    ...     WeightRenaming(".block_sparse_moe.", ".mlp."),
    ...     WeightConverter(
    ...         source_patterns=[".experts.*.w1.weight", ".experts.*.w3.weight"],
    ...         target_patterns=".experts.gate_up_proj",
    ...         operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    ...     ),
    ...     WeightConverter(".experts.*.w2.weight", ".experts.down_proj", [MergeModulelist(0)]),
    ... ]

**Patterns** are transformers' too: a pattern is a regex searched anywhere in the name (``.``
matches any character, as there), ``*.`` stands for one list index (``experts.*.w1``), a pattern
ending in a letter or digit ends on a name boundary (``weight`` does not match ``weight_scale``),
and a renaming's target may use ``\\1`` for a capture group of its source. The match is replaced
by the (first) target pattern, so ``model.layers.0.mlp.experts.3.w1.weight`` becomes
``model.layers.0.mlp.experts.gate_up_proj``; every name that becomes the same target is converted
together, each source pattern's tensors in natural order of their names (``2`` before ``10``).

**Ops** (``ConversionOps``, in :mod:`lightning_bpk.interop.ops`, importable from here too):
:class:`Chunk` <-> :class:`Concatenate`, :class:`MergeModulelist` <-> :class:`SplitModulelist`,
:class:`Transpose`, :class:`PermuteForRope` and :class:`Interleave`, each undone by its reverse.
A converter applies its ops in order on load, and on save the reverse ops in reverse order.

**Order**, as in transformers: within a run of consecutive ``WeightRenaming``/``WeightConverter``
rules in a :class:`~lightning_bpk.interop.remap.KeyRemapper`, every renaming applies first, in
order, then each name goes through at most one converter (the first whose pattern matches); save
applies the reversed converters first, then the reversed renamings in reverse order.

**Stricter than transformers** where it would load a wrong layout silently: a converter group
whose ``*`` indices are not ``0..n-1``, or whose source patterns hold different index sets, or
where a pattern matched nothing, is an error naming the pattern and every key concerned. All such
problems of one load or save are reported together in one :class:`RemapError`. Saving checks
that each name it writes loads back to the module's name.

**Param ids.** A fused tensor takes the id of its first source (in the order above); a split
tensor's first part keeps the id and the other parts get ids derived from it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch

# transformers keeps its ops in the module of its rules, so the ``name as name`` imports make them
# importable from here too (not in __all__: documented once, in lightning_bpk.interop.ops).
from lightning_bpk.interop._placing import placement
from lightning_bpk.interop.ops import Chunk as Chunk
from lightning_bpk.interop.ops import Concatenate as Concatenate
from lightning_bpk.interop.ops import (
    ConversionOps,
    Tensors,
    first_tensor,
)
from lightning_bpk.interop.ops import Interleave as Interleave
from lightning_bpk.interop.ops import MergeModulelist as MergeModulelist
from lightning_bpk.interop.ops import PermuteForRope as PermuteForRope
from lightning_bpk.interop.ops import SplitModulelist as SplitModulelist
from lightning_bpk.interop.ops import Transpose as Transpose
from lightning_bpk.interop.rules import (
    Item,
    Items,
    RemapError,
    Rule,
    derived_param_id,
    replace_items,
    trace_step,
)

# transformers' WeightTransform: a pattern ending in a word character ends on a name boundary.
_WORD_END = re.compile(r"[a-zA-Z0-9]$")
# transformers' process_target_pattern: lookarounds removed, the first group becomes \1.
_LOOKAROUND = re.compile(r"\(\?.+?\)?\)")
_GROUP = re.compile(r"\(.+?\)")


def _natural_key(name: str) -> list[tuple]:
    """transformers' ``dot_natural_key``: numbers sort as numbers (``layers.2`` < ``layers.10``).

    >>> sorted(["e.10.w", "e.2.w"], key=_natural_key)
    ['e.2.w', 'e.10.w']
    """
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            digits = part[len(text) :]
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


# --- transforms ----------------------------------------------------------------------------------


def _as_list(patterns: str | Sequence[str]) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns)


class WeightTransform(Rule):
    """What :class:`WeightRenaming` and :class:`WeightConverter` share: patterns compiled and
    processed exactly as transformers does, and its ``rename_source_key``."""

    traced = True

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]):
        sources, targets = _as_list(source_patterns), _as_list(target_patterns)
        if not sources or not targets:
            raise RemapError(f"{type(self).__name__}: needs source and target patterns")
        self._original = (list(sources), list(targets))
        groups = set()
        for i, pattern in enumerate(targets):
            pattern = _LOOKAROUND.sub("", pattern.removeprefix("^"))
            found = _GROUP.search(pattern)
            if found:
                groups.add(found.group(0))
                pattern = pattern.replace(found.group(0), r"\1", 1)
            targets[i] = pattern.replace(r"\.", ".")
        if len(groups) > 1:
            raise RemapError(f"{self._name()}: different capture groups in targets {groups}")
        group = next(iter(groups), None)
        for i, pattern in enumerate(sources):
            if r"\1" in pattern:
                if group is None:
                    raise RemapError(f"{self._name()}: {pattern!r} uses \\1, no target has a group")
                pattern = pattern.replace(r"\1", group, 1)
            if len(sources) == len(targets) and self._original[1][i].startswith("^"):
                pattern = pattern if pattern.startswith("^") else "^" + pattern
            sources[i] = pattern
        self.source_patterns, self.target_patterns = sources, targets
        self.scope_prefix: str | None = None
        self.base_model_prefix: str | None = None
        branches = []
        for i, pattern in sorted(enumerate(sources), key=lambda item: -len(item[1])):
            body = pattern.replace("*.", r".*\.")
            if _WORD_END.search(body):
                body += r"(?!\w)"
            branches.append(f"(?P<g{i}>{body})")
        try:
            self._compiled = re.compile("|".join(branches))
        except re.error as e:
            raise RemapError(f"{self._name()}: bad pattern: {e}") from e

    def _name(self) -> str:
        scope = getattr(self, "scope_prefix", None)
        where = f" under {scope!r}" if scope else ""
        return f"{type(self).__name__}({self._original[0]!r} -> {self._original[1]!r}{where})"

    def __str__(self) -> str:
        return self._name()

    def __repr__(self) -> str:
        return self._name()

    def scoped(self, scope_prefix: str | None, base_model_prefix: str | None) -> WeightTransform:
        """This transform limited to names under a sub-model (transformers' ``scope_prefix``:
        ``model.vision_tower`` for a sub-model's own mapping, matched with or without the
        model's ``base_model_prefix`` in front). Returns ``self``."""
        self.scope_prefix, self.base_model_prefix = scope_prefix, base_model_prefix
        return self

    def _scoped_match(self, key: str) -> tuple[str | None, str, re.Match[str]] | None:
        """transformers' ``_scoped_match``: ``(prefix consumed, rest, match)`` or ``None``."""
        prefix = None
        if self.scope_prefix is not None:
            scope = f"{self.scope_prefix}." if self.scope_prefix else ""
            base = f"{self.base_model_prefix}." if self.base_model_prefix else ""
            if key.startswith(base + scope):
                prefix = base + scope
            elif key.startswith(scope):
                prefix = scope
            else:
                return None
            key = key.removeprefix(prefix)
        m = self._compiled.search(key)
        return None if m is None else (prefix, key, m)

    def rename_source_key(self, key: str) -> tuple[str, str | None]:
        """``(new name, the source pattern that matched)``, or ``(key, None)`` without a match."""
        matched = self._scoped_match(key)
        if matched is None:
            return key, None
        prefix, rest, m = matched
        group = next(g for g, v in m.groupdict().items() if v is not None)
        replacement = self.target_patterns[0]
        if r"\1" in replacement:
            replacement = replacement.replace(r"\1", m.group(self._compiled.groupindex[group] + 1))
        renamed = rest.replace(m.group(0), replacement, 1)
        return (prefix or "") + renamed, self.source_patterns[int(group[1:])]


class WeightRenaming(WeightTransform):
    """Rename every name the source pattern matches (transformers' ``WeightRenaming``); saving
    applies the swapped renaming and checks that it loads back.

    >>> WeightRenaming(".block_sparse_moe.", ".mlp.").rename_source_key("l.0.block_sparse_moe.gate")
    ('l.0.mlp.gate', '.block_sparse_moe.')
    """

    phase = "rename"
    renames_only = True

    def reverse_transform(self) -> WeightRenaming:
        reverse = WeightRenaming(self._original[1], self._original[0])
        return reverse.scoped(self.scope_prefix, self.base_model_prefix)  # type: ignore[return-value]

    def _map(self, items: Items, rule: WeightTransform, check: WeightTransform | None):
        out: Items = {}
        touched, problems, links = 0, [], []
        for name, item in items.items():
            new, pattern = rule.rename_source_key(name)
            if pattern is not None:
                touched += 1
                links.append(([name], [new]))
                if check is not None and check.rename_source_key(new)[0] != name:
                    problems.append(
                        f"{name!r} saves as {new!r}, which loads back as "
                        f"{check.rename_source_key(new)[0]!r}"
                    )
            if new in out:
                problems.append(f"two tensors map to {new!r}")
            out[new] = item
        if problems:
            raise RemapError(f"{self}: " + "; ".join(problems))
        trace_step(links)
        return out, touched

    def forward(self, items: Items) -> tuple[Items, int]:
        return self._map(items, self, None)

    def backward(self, items: Items) -> tuple[Items, int]:
        return self._map(items, self.reverse_transform(), self)


class PrefixChange(WeightRenaming):
    """Add or remove a whole leading part of every name (transformers' ``PrefixChange``):
    ``PrefixChange(prefix_to_remove="vision_model")`` turns ``vision_model.x`` into ``x``, and
    ``prefix_to_add`` does the opposite where the prefix is not there yet, after the optional
    ``model_prefix``; its reverse swaps the two.

    >>> PrefixChange(prefix_to_remove="vision_model").rename_source_key("vision_model.enc.w")[0]
    'enc.w'
    """

    def __init__(
        self,
        prefix_to_add: str | None = None,
        prefix_to_remove: str | None = None,
        model_prefix: str | None = None,
    ) -> None:
        if (prefix_to_add is None) == (prefix_to_remove is None):
            raise RemapError("PrefixChange: give exactly one of prefix_to_add, prefix_to_remove")
        self.prefix_to_add, self.prefix_to_remove = prefix_to_add, prefix_to_remove
        self.model_prefix = model_prefix or ""
        prefix = rf"{self.model_prefix}\." if self.model_prefix else ""
        if prefix_to_add is not None:
            super().__init__(
                rf"^{prefix}(?:(?!{prefix_to_add}\.))(.+)", rf"{prefix}{prefix_to_add}\.\1"
            )
        else:
            super().__init__(rf"^{prefix}{prefix_to_remove}\.(.+)", rf"{prefix}\1")

    def reverse_transform(self) -> WeightRenaming:
        reverse = PrefixChange(self.prefix_to_remove, self.prefix_to_add, self.model_prefix)
        return reverse.scoped(self.scope_prefix, self.base_model_prefix)  # type: ignore[return-value]


class WeightConverter(WeightTransform):
    """Convert the tensors matching ``source_patterns`` into ``target_patterns`` through
    ``operations`` (transformers' ``WeightConverter``): one-to-one, many-to-one (fusing) or
    one-to-many (splitting), never many-to-many. Saving runs the reverse ops in reverse order.

    >>> import torch
    >>> from lightning_bpk.interop import Concatenate
    >>> fuse = WeightConverter(["gate.weight", "up.weight"], "gate_up.weight", [Concatenate(0)])
    >>> items, _ = fuse.forward({"mlp.gate.weight": (torch.zeros(1, 2), 7),
    ...                          "mlp.up.weight": (torch.ones(1, 2), 8)})
    >>> {n: (t.tolist(), pid) for n, (t, pid) in items.items()}
    {'mlp.gate_up.weight': ([[0.0, 0.0], [1.0, 1.0]], 7)}
    """

    phase = "convert"

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Sequence[ConversionOps],
    ) -> None:
        super().__init__(source_patterns, target_patterns)
        self.operations = list(operations)
        if not self.operations:
            raise RemapError(f"{self}: needs at least one operation")
        if len(self.source_patterns) > 1 and len(self.target_patterns) > 1:
            raise RemapError(f"{self}: one-to-many, many-to-one or one-to-one only")
        for op in self.operations:
            if not isinstance(op, ConversionOps):
                raise TypeError(f"{self}: {op!r} is not a ConversionOps")

    def _name(self) -> str:
        return f"{super()._name()[:-1]}, {getattr(self, 'operations', [])!r})"

    def reverse_transform(self) -> WeightConverter:
        ops = [op.reverse_op for op in reversed(self.operations)]
        reverse = WeightConverter(self._original[1], self._original[0], ops)
        return reverse.scoped(self.scope_prefix, self.base_model_prefix)  # type: ignore[return-value]

    def forward(self, items: Items) -> tuple[Items, int]:
        return self.convert_items(items, frozenset())

    def backward(self, items: Items) -> tuple[Items, int]:
        return self.reverse_transform().convert_items(items, frozenset(), check=self)

    def convert_items(
        self,
        items: Items,
        exclude: frozenset[str],
        check: WeightConverter | None = None,
        origin: Mapping[str, str] | None = None,
        where: Callable[[str], str] | None = None,
    ) -> tuple[Items, int]:
        """Convert every group of matching names not in ``exclude``; ``check`` (the forward
        converter, when saving) must map each output back to the name it came from. Problems
        name keys by ``origin`` (their names in the file, before the renamings) where given."""
        origin = origin or {}
        groups: dict[str, dict[str, list[str]]] = {}
        for name in items:
            if name in exclude:
                continue
            renamed, pattern = self.rename_source_key(name)
            if pattern is not None:
                groups.setdefault(renamed, {}).setdefault(pattern, []).append(name)
        problems: list[str] = []
        converted: list[tuple[list[str], Items]] = []
        for renamed, by_pattern in groups.items():
            names = self._check_group(renamed, by_pattern, problems, origin)
            if names is None or not _same_shapes(names, items, problems, origin, where):
                continue
            try:
                out = self._convert_group(renamed, names, items)
            except (RuntimeError, ValueError, IndexError, RemapError) as e:
                keys = [origin.get(n, n) for ns in names.values() for n in ns]
                problems.append(f"{renamed!r} from {keys}: {e}")
                continue
            if check is not None:
                source = next(iter(names.values()))[0]
                problems += [
                    f"{new!r} loads back as {check.rename_source_key(new)[0]!r}, not {source!r}"
                    for new in out
                    if check.rename_source_key(new)[0] != source
                ]
            converted.append(([n for ns in names.values() for n in ns], out))
        if problems:
            raise RemapError(f"{self}: " + "; ".join(problems))
        if converted:
            items = replace_items(items, converted, str(self))
        return items, len(converted)

    def _check_group(
        self,
        renamed: str,
        by_pattern: dict[str, list[str]],
        problems: list[str],
        origin: Mapping[str, str],
    ) -> dict[str, list[str]] | None:
        """The group's names per source pattern, in load order; None (and problems) if the
        group is incomplete or its ``*`` indices are not ``0..n-1`` for every pattern."""
        found = [origin.get(n, n) for names in by_pattern.values() for n in names]
        ordered: dict[str, list[str]] = {}
        counts = set()
        bad = len(problems)
        for pattern in self.source_patterns:
            names = sorted(by_pattern.get(pattern, []), key=_natural_key)
            if not names:
                problems.append(f"{pattern!r} matches no key for {renamed!r} (found {found})")
                continue
            if "*." in pattern:
                star = re.compile(pattern.replace("*.", r"(?P<star>.*)\."))
                indices = [_star(star, n) for n in names]
                if indices != [str(i) for i in range(len(names))]:
                    problems.append(
                        f"{pattern!r} for {renamed!r}: indices {indices} are not 0..n-1 "
                        f"(keys {[origin.get(n, n) for n in names]})"
                    )
                counts.add(len(names))
            elif len(names) > 1:
                keys = [origin.get(n, n) for n in names]
                problems.append(f"{pattern!r} matches several keys for {renamed!r}: {keys}")
            ordered[pattern] = names
        if len(counts) > 1:
            problems.append(f"{renamed!r}: the patterns hold different numbers of keys ({found})")
        return ordered if len(problems) == bad else None

    def _convert_group(self, renamed: str, names: dict[str, list[str]], items: Items) -> Items:
        """Run the ops on one group and name the results as transformers does; results bound
        for a tensor of :func:`~lightning_bpk.interop._placing.placing` are built in it."""
        tensors: dict[str, Tensors] = {p: [items[n][0] for n in ns] for p, ns in names.items()}
        full = renamed.replace("*.", "0.") if "*." in renamed else renamed
        results = self._placed(full, tensors)
        if results is None:
            results = self._run_ops(tensors)
        named = _result_names(full, results)
        pid = items[next(iter(names.values()))[0]][1]
        out: dict[str, Item] = {}
        for k, (key, value) in enumerate(results.items()):
            out[named[key]] = (first_tensor(value), pid if k == 0 else derived_param_id(pid, k))
        return out

    def _run_ops(self, tensors: dict[str, Tensors]) -> dict[str, Tensors]:
        for op in self.operations:
            tensors = op.convert(
                tensors, source_patterns=self.source_patterns, target_patterns=self.target_patterns
            )
        return tensors

    def _placed(self, full: str, tensors: dict[str, Tensors]) -> dict[str, Tensors] | None:
        """The ops' results built in the tensors :func:`~lightning_bpk.interop._placing.placing`
        gives for their names: the ops run on meta tensors for every stage's names and shapes,
        then backward from the destinations (:meth:`ConversionOps.input_views`) to a view for
        each source tensor, which is copied into it: one copy, no new memory. None, with
        nothing written, unless every result has a destination of its shape and dtype and
        every op runs backward."""
        into = placement()
        if not into:
            return None
        stages: list[dict[str, Tensors]] = [
            {
                p: [t.to("meta") for t in (ts if isinstance(ts, list) else [ts])]
                for p, ts in tensors.items()
            }
        ]
        for op in self.operations:
            stages.append(
                op.convert(
                    stages[-1],
                    source_patterns=self.source_patterns,
                    target_patterns=self.target_patterns,
                )
            )
        named = _result_names(full, stages[-1])
        dests: dict[str, Tensors] = {}
        for key, meta in stages[-1].items():
            dest = into.get(named[key])
            if not (
                isinstance(meta, torch.Tensor)
                and dest is not None
                and (dest.shape, dest.dtype) == (meta.shape, meta.dtype)
            ):
                return None
            dests[key] = dest
        with torch.no_grad():
            views = dests
            for op, before in zip(reversed(self.operations), reversed(stages[:-1]), strict=True):
                back = op.input_views(views, before, self.source_patterns, self.target_patterns)
                if back is None:
                    return None
                views = back
            pairs = _pairs(views, tensors)
            if pairs is None:
                return None
            for view, source in pairs:
                view.copy_(source)
        return dests


def _result_names(full: str, results: Mapping[str, object]) -> dict[str, str]:
    """Each result key's full name, as transformers names a converter's results: the key found
    in the group's name ``full`` (``*`` as ``0``) is replaced by each key in turn."""
    key = next((k for k in results if k in full), None)
    prefix, _, suffix = full.partition(key) if key is not None else ("", "", "")
    return {k: prefix + k + suffix for k in results}


def _pairs(
    views: dict[str, Tensors], tensors: dict[str, Tensors]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each source tensor with the view it is written into; None where the views do not match
    the sources one to one in shape and dtype."""
    if views.keys() != tensors.keys():
        return None
    pairs = []
    for key, sources in tensors.items():
        targets = views[key]
        targets = targets if isinstance(targets, list) else [targets]
        sources = sources if isinstance(sources, list) else [sources]
        if len(targets) != len(sources):
            return None
        for view, source in zip(targets, sources, strict=True):
            if (view.shape, view.dtype) != (source.shape, source.dtype):
                return None
            pairs.append((view, source))
    return pairs


def _same_shapes(
    names: dict[str, list[str]],
    items: Items,
    problems: list[str],
    origin: Mapping[str, str],
    where: Callable[[str], str] | None,
) -> bool:
    """Whether every tensor of each source pattern has the first one's shape (a list of
    experts stacks only then); else a problem naming the file, the tensor and both shapes."""
    ok = True
    for names_of in names.values():
        first = names_of[0]
        want = list(items[first][0].shape)
        for name in names_of[1:]:
            got = list(items[name][0].shape)
            if got != want:
                file_name = origin.get(name, name)
                file = where(file_name) if where is not None else ""
                problems.append(
                    f"{file + ': ' if file else ''}tensor {file_name!r} has shape {got}, but "
                    f"{origin.get(first, first)!r} of the same list has {want}"
                )
                ok = False
    return ok


def _star(star: re.Pattern, name: str) -> str:
    m = star.search(name)
    return m.group("star") if m else "?"


__all__ = [
    "PrefixChange",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
]
