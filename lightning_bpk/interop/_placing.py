"""Where a rule builds its results: :func:`placing` hands the rules the tensors their results
are bound for, so a fused tensor is built where it will live rather than in new memory.

The parallel loader (:func:`~lightning_bpk.interop.loading.load_remapped`) passes the module's
tensors; a :class:`~lightning_bpk.interop.conversions.WeightConverter` whose ops all run
backward (:meth:`~lightning_bpk.interop.ops.ConversionOps.input_views`) then copies each file
tensor once, into its slice. Fresh memory costs more to fault in than its bytes cost to copy
(on this project's 2-core machine: 61 ms to allocate and fill 254 MiB, 7 ms to copy them), so
Mixtral's fused experts built in their parameters load a 254 MiB checkpoint in a third of the
time ``torch.stack``/``torch.cat`` and a copy took (``benchmarks/hub_load.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import torch

__all__ = [
    "placement",
    "placing",
]

_INTO: contextvars.ContextVar[Mapping[str, torch.Tensor] | None] = contextvars.ContextVar(
    "lightning_bpk_remap_into", default=None
)


@contextlib.contextmanager
def placing(into: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """While the block runs (in this thread or task), a rule that builds a tensor under a name
    of ``into`` may write it straight into ``into[name]`` and give that tensor as its result.
    The caller names only tensors whose value is final when built: no later rule reads or
    changes them (see ``_plan``'s ``built``)."""
    token = _INTO.set(into)
    try:
        yield
    finally:
        _INTO.reset(token)


def placement() -> Mapping[str, torch.Tensor]:
    """The tensors :func:`placing` gives, by name (empty outside ``placing``).

    >>> with placing({"w": torch.zeros(2)}):
    ...     sorted(placement())
    ['w']
    >>> dict(placement())
    {}
    """
    return _INTO.get() or {}
