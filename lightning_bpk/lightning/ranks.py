"""Rank agreement: the collectives every rank's checkpoint decisions go through.

Only global rank 0 writes and only rank 0's clock times saves, but a preemption signal may reach
any one rank and a failed write is known on rank 0 alone: every rank must take the same decision
at the same point, or one waits forever in a collective the others never enter. :class:`Ranks`
is the callback's one door to those collectives (an all-reduce MAX of small integers, a gather
of picklable values on rank 0), built from the trainer's strategy in ``setup`` or, in tests,
from any reduce and gather functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["Ranks"]

# reduce(tensor) -> the element-wise maximum of that tensor over all ranks
Reduce = Callable[[torch.Tensor], torch.Tensor]
# gather(value, out) fills out (a list of world_size, on rank 0; None elsewhere) in rank order
Gather = Callable[[Any, "list[Any] | None"], None]


def _gather_object(value: Any, out: list[Any] | None) -> None:
    import torch.distributed as dist

    dist.gather_object(value, out, dst=0)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks, and the collectives that make them agree.

    Every rank must call each method at the same point of training, as with any collective.
    """

    world_size: int
    is_global_zero: bool
    reduce: Reduce
    device: torch.device
    gather_object: Gather = _gather_object

    @classmethod
    def of(cls, trainer: pl.Trainer) -> Ranks:
        """The ranks of ``trainer``'s strategy (its ``reduce`` with MAX, its root device)."""
        strategy = trainer.strategy
        return cls(
            world_size=trainer.world_size,
            is_global_zero=trainer.is_global_zero,
            reduce=lambda tensor: strategy.reduce(tensor, reduce_op="max"),
            device=strategy.root_device,
        )

    def agree(self, value: int) -> int:
        """The maximum of ``value`` over all ranks."""
        tensor = torch.tensor(value, dtype=torch.int64, device=self.device)
        return int(self.reduce(tensor).item())

    def agree_all(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum of ``values`` over all ranks, in one collective."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self.reduce(tensor).tolist()]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (``None`` on the others), in rank order."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
        self.gather_object(value, gathered)
        return gathered
