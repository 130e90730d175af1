"""transformers' weight-conversion vocabulary as :class:`~lightning_bpk.interop.remap.KeyRemapper`
rules: :class:`WeightRenaming`, :class:`WeightConverter` and the reversible ops.

The names, arguments and semantics are those of Hugging Face transformers v5
(``transformers/core_model_loading.py``, read in 5.23.0), so a table from its
``conversion_mapping.py`` pastes in as it is. Mixtral's::

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

**Ops** (``ConversionOps``): each has ``convert(input_dict, source_patterns, target_patterns)``
mapping ``{pattern: [tensors]}`` to ``{pattern: tensor}`` and a ``reverse_op``: :class:`Chunk` <->
:class:`Concatenate`, :class:`MergeModulelist` (``torch.stack``) <-> :class:`SplitModulelist`,
:class:`Transpose`, :class:`PermuteForRope` (the number of heads is given, where transformers
reads it from the model config) and :class:`Interleave`, each undone by its reverse. A converter
applies its ops in order on load, and on save the reverse ops in reverse order.

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
from typing import Any

import torch

from lightning_bpk.interop.rules import (
    Item,
    Items,
    RemapError,
    Rule,
    derived_param_id,
    replace_items,
    trace_step,
)

Tensors = torch.Tensor | list[torch.Tensor]

# transformers' WeightTransform: a pattern ending in a word character ends on a name boundary.
_WORD_END = re.compile(r"[a-zA-Z0-9]$")
# transformers' process_target_pattern: lookarounds removed, the first group becomes \1.
_LOOKAROUND = re.compile(r"\(\?.+?\)?\)")
_GROUP = re.compile(r"\(.+?\)")


def _first(tensors: Tensors) -> torch.Tensor:
    return tensors[0] if isinstance(tensors, list) else tensors


def natural_key(name: str) -> list[tuple]:
    """transformers' ``dot_natural_key``: numbers sort as numbers (``layers.2`` < ``layers.10``).

    >>> sorted(["e.10.w", "e.2.w"], key=natural_key)
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


# --- ops -----------------------------------------------------------------------------------------


class ConversionOps:
    """One reversible step of a :class:`WeightConverter` (transformers' ``ConversionOps``)."""

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        raise NotImplementedError

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]


def _undefined(op: ConversionOps, why: str) -> RemapError:
    return RemapError(f"{op!r}: undefined operation ({why})")


class Chunk(ConversionOps):
    """One tensor into ``len(target_patterns)`` equal chunks along ``dim`` (``qkv`` -> q, k, v);
    reverse: :class:`Concatenate`."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        if len(input_dict) > 1:
            raise _undefined(self, "more than one source")
        tensor = _first(next(iter(input_dict.values())))
        chunks = torch.chunk(tensor, len(target_patterns), dim=self.dim)
        return {t: c.contiguous() for t, c in zip(target_patterns, chunks, strict=False)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Concatenate(self.dim)


class Concatenate(ConversionOps):
    """The sources' tensors, in the order of ``source_patterns``, joined along ``dim`` into the
    one target; reverse: :class:`Chunk`."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        if len(target_patterns) > 1:
            raise _undefined(self, "more than one target")
        parts: list[torch.Tensor] = []
        for pattern in source_patterns:
            if pattern in input_dict:
                value = input_dict[pattern]
                parts.extend(value if isinstance(value, list) else [value])
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Chunk(self.dim)


class MergeModulelist(ConversionOps):
    """Each source's list of tensors (``experts.*.w1``) stacked along ``dim`` into one tensor;
    reverse: :class:`SplitModulelist`. Alone it names the result after the target; first in a
    chain of several sources it keeps each source's name for the next op."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        merged: dict[str, Tensors] = {}
        for pattern, tensors in input_dict.items():
            if len(input_dict) == 1:
                if len(target_patterns) != 1:
                    raise _undefined(self, "one source, several targets")
                pattern = target_patterns[0]
            merged[pattern] = (
                tensors if isinstance(tensors, torch.Tensor) else torch.stack(tensors, dim=self.dim)
            )
        return merged

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitModulelist(self.dim)


class SplitModulelist(ConversionOps):
    """Each tensor unstacked along ``dim`` into a numbered list: ``*`` in the target (or, last in
    a chain, in each source) becomes the index; reverse: :class:`MergeModulelist`."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        out: dict[str, Tensors] = {}
        for pattern, tensors in input_dict.items():
            tensor = _first(tensors)
            if len(input_dict) == 1:
                if len(target_patterns) != 1:
                    raise _undefined(self, "one source, several targets")
                pattern = target_patterns[0]
            count = tensor.size(self.dim)
            chunks = torch.chunk(tensor, count, dim=self.dim)
            out.update(
                {pattern.replace("*", str(i)): c.squeeze(self.dim) for i, c in enumerate(chunks)}
            )
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return MergeModulelist(self.dim)


def _single_target(op: ConversionOps, input_dict, source_patterns, target_patterns) -> str:
    """transformers' naming for one-tensor ops: the target when alone or last in a chain, the
    source when first in a one-to-many chain."""
    if len(input_dict) != 1:
        raise _undefined(op, "needs exactly one tensor")
    if len(target_patterns) > 1:
        if len(source_patterns) != 1:
            raise _undefined(op, "several sources and several targets")
        return source_patterns[0]
    return target_patterns[0]


class Transpose(ConversionOps, Rule):
    """Swap dims ``dim0`` and ``dim1``, as a rule or as an op (one class, two roles).

    - ``Transpose(pattern, dim0=0, dim1=1)``, a rule: swap the dims of every tensor whose name
      fully matches ``pattern``, on load and again on save (the names do not change);
    - ``Transpose(dim0=0, dim1=1)``, transformers' op of that name, for a
      :class:`WeightConverter`'s operations; its reverse swaps the dims back.

    >>> Transpose(r".+\\.w", 0, 1).forward({"a.w": (torch.zeros(2, 3), None)})[0]["a.w"][0].shape
    torch.Size([3, 2])
    """

    traced = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pattern = kwargs.pop("pattern", None)
        if args and isinstance(args[0], str):
            pattern, args = args[0], args[1:]
        dims = dict(zip(("dim0", "dim1"), args, strict=False)) | kwargs
        unknown = set(dims) - {"dim0", "dim1"}
        if unknown or len(args) > 2 or not isinstance(pattern, str | None):
            raise TypeError(f"Transpose([pattern,] dim0, dim1): unexpected {sorted(unknown)}")
        self.pattern: str | None = pattern
        self.dim0 = int(dims.get("dim0", 0))
        self.dim1 = int(dims.get("dim1", 1))

    def __repr__(self) -> str:
        if self.pattern is None:
            return f"Transpose(dim0={self.dim0}, dim1={self.dim1})"
        return f"Transpose({self.pattern!r}, {self.dim0}, {self.dim1})"

    __str__ = __repr__

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        target = _single_target(self, input_dict, source_patterns, target_patterns)
        tensor = _first(next(iter(input_dict.values())))
        return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}

    @property
    def reverse_op(self) -> ConversionOps:
        return Transpose(dim0=self.dim1, dim1=self.dim0)

    def forward(self, items: Items) -> tuple[Items, int]:
        pattern = self.pattern
        if pattern is None:
            raise RemapError(f"{self}: without a pattern it is an op, for a WeightConverter")
        out: Items = {}
        touched = 0
        for name, (tensor, pid) in items.items():
            if re.fullmatch(pattern, name):
                if tensor.dim() <= max(self.dim0, self.dim1, -1 - min(self.dim0, self.dim1)):
                    raise RemapError(f"{self}: {name!r} has shape {list(tensor.shape)}")
                tensor = tensor.transpose(self.dim0, self.dim1).contiguous()
                touched += 1
            out[name] = (tensor, pid)
        return out, touched

    backward = forward


class Interleave(ConversionOps):
    """De-interleave along ``dim``: ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]``
    (a fused gate/up stored interleaved becomes gate then up); ``inverse=True`` interleaves
    back, and is its reverse.

    >>> Interleave(0).convert({"w": torch.tensor([0, 10, 1, 11])}, ["w"], ["w"])["w"].tolist()
    [0, 1, 10, 11]
    """

    def __init__(self, dim: int = 0, inverse: bool = False) -> None:
        self.dim = dim
        self.inverse = inverse

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        tensor = _first(next(iter(input_dict.values())))
        shape = list(tensor.shape)
        if shape[self.dim] % 2:
            raise ValueError(f"{self!r}: dim {self.dim} of shape {shape} is odd")
        pair = [2, shape[self.dim] // 2] if self.inverse else [shape[self.dim] // 2, 2]
        shape[self.dim : self.dim + 1] = pair
        out = tensor.reshape(shape).transpose(self.dim, self.dim + 1).reshape(tensor.shape)
        return {target_patterns[0]: out.contiguous()}

    @property
    def reverse_op(self) -> ConversionOps:
        return Interleave(self.dim, inverse=not self.inverse)


class PermuteForRope(ConversionOps):
    """The rows of each of ``num_heads`` heads reordered from interleaved (complex) RoPE pairs to
    split halves: per head, view as ``(half, 2)`` and transpose to ``(2, half)``; ``inverse=True``
    goes back, and is its reverse. ``permute_layer_names`` limits it to sources whose pattern
    contains one of them (others pass through). transformers reads the head count from the model
    config (``num_attention_heads``); here it is given."""

    def __init__(
        self,
        num_heads: int,
        permute_layer_names: Sequence[str] | None = None,
        inverse: bool = False,
    ) -> None:
        if num_heads < 1:
            raise ValueError(f"PermuteForRope: num_heads must be >= 1, not {num_heads}")
        self.num_heads = num_heads
        self.permute_layer_names = (
            None if permute_layer_names is None else list(permute_layer_names)
        )
        self.inverse = inverse

    def _permute(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.shape[0] if tensor.dim() else 0
        if tensor.dim() not in (1, 2):
            return tensor
        if rows % (2 * self.num_heads):
            raise ValueError(
                f"{self!r}: {rows} rows are not {self.num_heads} heads of an even size"
            )
        half = rows // self.num_heads // 2
        head = (2, half) if self.inverse else (half, 2)
        rest = tensor.shape[1:]
        out = tensor.reshape(self.num_heads, *head, *rest).transpose(1, 2)
        return out.reshape(rows, *rest)

    def convert(
        self,
        input_dict: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, Tensors]:
        several = len(source_patterns) > 1 or len(target_patterns) > 1
        if len(source_patterns) > 1 and len(target_patterns) > 1:
            raise _undefined(self, "several sources and several targets")
        out: dict[str, Tensors] = {}
        for pattern, tensors in input_dict.items():
            target = pattern if several else target_patterns[0]
            names = self.permute_layer_names
            if names is None or any(n in pattern for n in names):
                if isinstance(tensors, list) and len(tensors) > 1:
                    raise ValueError(f"{self!r} expects a single tensor per key")
                tensors = self._permute(_first(tensors))
            out[target] = tensors
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return PermuteForRope(self.num_heads, self.permute_layer_names, inverse=not self.inverse)


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
            names = sorted(by_pattern.get(pattern, []), key=natural_key)
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
        """Run the ops on one group and name the results as transformers does."""
        tensors: dict[str, Tensors] = {p: [items[n][0] for n in ns] for p, ns in names.items()}
        for op in self.operations:
            tensors = op.convert(
                tensors, source_patterns=self.source_patterns, target_patterns=self.target_patterns
            )
        full = renamed.replace("*.", "0.") if "*." in renamed else renamed
        key = next((k for k in tensors if k in full), None)
        prefix, _, suffix = full.partition(key) if key is not None else ("", "", "")
        pid = items[next(iter(names.values()))[0]][1]
        out: dict[str, Item] = {}
        for k, (name, value) in enumerate(tensors.items()):
            full_name = prefix + name + suffix
            out[full_name] = (_first(value), pid if k == 0 else derived_param_id(pid, k))
        return out


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
    "Chunk",
    "Concatenate",
    "ConversionOps",
    "Interleave",
    "MergeModulelist",
    "PermuteForRope",
    "PrefixChange",
    "SplitModulelist",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "natural_key",
]
