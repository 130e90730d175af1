"""Rank agreement: the collectives every rank's checkpoint decisions go through.

Only global rank 0 writes and only rank 0's clock times saves, but a preemption signal may reach
any one rank and a failed write is known on rank 0 alone: every rank must take the same decision
at the same point, or one waits forever in a collective the others never enter. :class:`Ranks`
is the run's one door to those collectives (an all-reduce MAX of small integers, a gather of
picklable values on rank 0, a broadcast of rank 0's), the small protocol each integration
implements with its framework's collectives (the Lightning callback with its strategy's
``reduce``/``broadcast``, the Fabric manager with ``fabric.all_reduce``/``broadcast``) or, in
tests, with any functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Ranks"]

# reduce(tensor) -> the element-wise maximum of that tensor over all ranks
Reduce = Callable[[torch.Tensor], torch.Tensor]
# gather(value, out) fills out (a list of world_size, on rank 0; None elsewhere) in rank order
Gather = Callable[[Any, "list[Any] | None"], None]
# broadcast(value) -> rank 0's value, on every rank
Broadcast = Callable[[Any], Any]


def _gather_object(value: Any, out: list[Any] | None) -> None:
    import torch.distributed as dist

    dist.gather_object(value, out, dst=0)


def _broadcast_object(value: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    broadcast: Broadcast = _broadcast_object

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

    def share(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        return value if self.world_size == 1 else self.broadcast(value)

    def decide(
        self,
        choose: Callable[[], Any],
        failed: Callable[[Exception], Any],
        *,
        reraise: bool = True,
    ) -> Any:
        """Rank 0's ``choose()``, on every rank (the other ranks do not call it). Where it
        raised, every rank gets ``failed(error)`` instead (every rank must reach the broadcast,
        and learn of the failure), and rank 0 raises the error itself after the broadcast when
        ``reraise`` (so its message names the original cause)."""
        value, error = None, None
        if self.is_global_zero:
            try:
                value = choose()
            except Exception as e:
                error, value = e, failed(e)
        value = self.share(value)
        if error is not None and reraise:
            raise error
        return value
