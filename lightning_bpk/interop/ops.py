"""transformers' reversible conversion ops (``ConversionOps``), for a
:class:`~lightning_bpk.interop.conversions.WeightConverter`'s ``operations``.

Each has ``convert(input_dict, source_patterns, target_patterns)`` mapping
``{pattern: [tensors]}`` to ``{pattern: tensor}`` and a ``reverse_op``: :class:`Chunk` <->
:class:`Concatenate`, :class:`MergeModulelist` (``torch.stack``) <-> :class:`SplitModulelist`,
:class:`Transpose`, :class:`PermuteForRope` (the number of heads is given, where transformers
reads it from the model config) and :class:`Interleave`, each undone by its reverse. The names,
arguments and semantics are transformers 5.23's (``transformers/core_model_loading.py``).
:class:`Transpose` with a pattern is also a rule of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from lightning_bpk.interop.rules import Items, RemapError, Rule

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionOps",
    "Interleave",
    "MergeModulelist",
    "PermuteForRope",
    "SplitModulelist",
    "Tensors",
    "Transpose",
    "first_tensor",
]

Tensors = torch.Tensor | list[torch.Tensor]
"""What a :class:`ConversionOps` converts under one name: a tensor, or the list a pattern
matched (as transformers' ops take them)."""


def first_tensor(tensors: Tensors) -> torch.Tensor:
    """The tensor itself, or the first of a list (what an op reads its shape and dtype from)."""
    return tensors[0] if isinstance(tensors, list) else tensors


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

    def input_views(
        self,
        into: dict[str, Tensors],
        inputs: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
    ) -> dict[str, Tensors] | None:
        """Where this op's inputs must be written for its results to land in ``into`` (their
        destinations, keyed as :meth:`convert` keys its results): views of those tensors, keyed
        and shaped as ``inputs`` (the inputs, or meta tensors of their shapes: only their
        structure is read). The op run backward on views, no data moved; None (the default)
        where it cannot run so, as for an op that splits or permutes: its result is computed
        in new memory, then copied."""
        return None

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
        tensor = first_tensor(next(iter(input_dict.values())))
        chunks = torch.chunk(tensor, len(target_patterns), dim=self.dim)
        return {t: c.contiguous() for t, c in zip(target_patterns, chunks, strict=False)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Concatenate(self.dim)


def _in_order(
    inputs: dict[str, Tensors], patterns: list[str]
) -> list[tuple[str, list[torch.Tensor]]]:
    """The tensors of each of ``patterns`` that ``inputs`` holds, in that order, as lists: the
    order :class:`Concatenate` joins them in."""
    return [(p, v if isinstance(v := inputs[p], list) else [v]) for p in patterns if p in inputs]


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
        parts = [t for _, tensors in _in_order(input_dict, source_patterns) for t in tensors]
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}

    def input_views(
        self,
        into: dict[str, Tensors],
        inputs: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
    ) -> dict[str, Tensors] | None:
        """The target's slices along ``dim``, one per part in :meth:`convert`'s order.

        >>> inputs = {"a": torch.ones(1, 2), "b": [torch.ones(2, 2)]}
        >>> views = Concatenate(0).input_views({"w": torch.zeros(3, 2)}, inputs, ["a", "b"], ["w"])
        >>> [v.shape[0] for v in (views["a"], *views["b"])]
        [1, 2]
        """
        dest = into.get(target_patterns[0])
        if (
            len(target_patterns) > 1
            or not isinstance(dest, torch.Tensor)
            or set(inputs) - set(source_patterns)
        ):
            return None
        ordered = _in_order(inputs, source_patterns)
        parts = [t for _, tensors in ordered for t in tensors]
        if any(t.dim() != dest.dim() for t in parts):
            return None
        sizes = [t.shape[self.dim] for t in parts]
        if sum(sizes) != dest.shape[self.dim]:
            return None
        pieces = iter(dest.split(sizes, self.dim))
        views = {p: [next(pieces) for _ in tensors] for p, tensors in ordered}
        return {p: v if isinstance(inputs[p], list) else v[0] for p, v in views.items()}

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

    def input_views(
        self,
        into: dict[str, Tensors],
        inputs: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
    ) -> dict[str, Tensors] | None:
        """Each list's destination unbound along ``dim``: element ``i`` of the list is written
        into slice ``i`` (a single tensor passes through, as in :meth:`convert`)."""
        if len(inputs) == 1 and len(target_patterns) != 1:
            return None
        views: dict[str, Tensors] = {}
        for pattern, tensors in inputs.items():
            dest = into.get(target_patterns[0] if len(inputs) == 1 else pattern)
            if not isinstance(dest, torch.Tensor):
                return None
            whole = isinstance(tensors, torch.Tensor)
            views[pattern] = dest if whole else list(dest.unbind(self.dim))
        return views

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
            tensor = first_tensor(tensors)
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
        tensor = first_tensor(next(iter(input_dict.values())))
        return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}

    def input_views(
        self,
        into: dict[str, Tensors],
        inputs: dict[str, Tensors],
        source_patterns: list[str],
        target_patterns: list[str],
    ) -> dict[str, Tensors] | None:
        """The destination with the two dims swapped back: the input is written transposed."""
        if len(inputs) != 1 or (len(target_patterns) > 1 and len(source_patterns) != 1):
            return None
        target = _single_target(self, inputs, source_patterns, target_patterns)
        (source, tensors), dest = next(iter(inputs.items())), into.get(target)
        if not isinstance(dest, torch.Tensor) or (isinstance(tensors, list) and len(tensors) != 1):
            return None
        view = dest.transpose(self.dim0, self.dim1)
        return {source: [view] if isinstance(tensors, list) else view}

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
        tensor = first_tensor(next(iter(input_dict.values())))
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
                tensors = self._permute(first_tensor(tensors))
            out[target] = tensors
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return PermuteForRope(self.num_heads, self.permute_layer_names, inverse=not self.inverse)
