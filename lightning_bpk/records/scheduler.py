"""An LR scheduler's state as one burnpack of scalars (Burn's ``LrSchedulerRecord``).

The record is ``scheduler.state_dict()`` through :mod:`lightning_bpk.state`: numbers and bools
become scalars (``last_epoch``, ``base_lrs.0``, ``_last_lr.0``, ``best`` = inf), strings go to
``metadata`` (``mode`` = ``"min"``), and the structure keeps every exact type. There are no
tensors, ever: a state holding one (a tensor ``lr``) is refused with the keys named.

Composed schedulers (``SequentialLR``, ``ChainedScheduler``) store their children under index
prefixes as Burn's composed schedulers do: child ``i``'s keys are ``i.<key>`` (``0.last_epoch``,
``1.T_max``), nested to any depth, beside the parent's own keys.

``LambdaLR``/``MultiplicativeLR``/``CyclicLR`` save what torch saves: a plain function or lambda
cannot be saved and is recorded as ``None`` (the scheduler you load into must be built with the
same function); a callable object is saved as its ``__dict__``, which must be plain data.
The scheduler class is in metadata ``lightning_bpk/lr_scheduler`` and must match on apply.

Example::

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    >>> for _ in range(3):
    ...     opt.step(); sched.step()
    >>> record = LrSchedulerRecord.from_bytes(LrSchedulerRecord.from_scheduler(sched).to_bytes())
    >>> record.state["last_epoch"], record.state["base_lrs"]
    (3, [1.0])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from lightning_bpk import burnpack, state
from lightning_bpk._nested import copy_nested
from lightning_bpk.records.base import Record, RecordError, _class_name, _Stage

__all__ = [
    "LrSchedulerRecord",
    "SchedulerLike",
]

# Metadata entry naming the scheduler class (module.qualname).
_SCHEDULER_CLASS_KEY = "lightning_bpk/lr_scheduler"
# torch's key for the children of SequentialLR and ChainedScheduler.
_CHILDREN_KEY = "_schedulers"

SchedulerLike = LRScheduler | Any
"""What :class:`LrSchedulerRecord` captures and restores: any torch LR scheduler
(``ReduceLROnPlateau`` is an ``LRScheduler`` since torch 2.2)."""


def _indexed(state_dict: Mapping[str, Any]) -> dict[Any, Any]:
    """torch's state with children moved from ``_schedulers: [...]`` to keys ``0``, ``1``..."""
    out: dict[Any, Any] = {k: v for k, v in state_dict.items() if k != _CHILDREN_KEY}
    children = state_dict.get(_CHILDREN_KEY)
    if isinstance(children, list):
        out.update((i, _indexed(child)) for i, child in enumerate(children))
    elif children is not None:
        out[_CHILDREN_KEY] = children
    return out


def _torch_form(tree: Mapping[Any, Any]) -> dict[str, Any]:
    """Inverse of :func:`_indexed`."""
    out = {k: v for k, v in tree.items() if not isinstance(k, int)}
    children = sorted(k for k in tree if isinstance(k, int))
    if children:
        if children != list(range(len(children))):
            raise RecordError("validation", f"child scheduler indices {children} have gaps")
        out[_CHILDREN_KEY] = [_torch_form(tree[i]) for i in children]
    return out


def _copied(tree: dict[Any, Any]) -> tuple[dict[Any, Any], bool]:
    """``tree`` with every list and dict copied, and whether it is plain data: False when it
    holds a tensor or another value the codec must judge (kept as they are)."""
    odd: list[Any] = []

    def kept(leaf: Any) -> Any:
        odd.append(leaf)
        return leaf

    return copy_nested(tree, lambda _, tensor: kept(tensor), kept), not odd


class LrSchedulerRecord(Record):
    """A scheduler's ``state_dict()`` as scalars and strings; ``state`` is that dict with
    composed children under integer keys, ``scheduler_class`` the scheduler's class name."""

    kind = "lr_scheduler"

    def __init__(self, state: Mapping[Any, Any], scheduler_class: str) -> None:
        self.state = dict(state)
        self.scheduler_class = scheduler_class

    @classmethod
    def from_scheduler(cls, scheduler: SchedulerLike) -> LrSchedulerRecord:
        """Record ``scheduler.state_dict()``; raises :class:`RecordError` if it holds a tensor or
        anything else that is not plain data.

        The state is copied here (every list and dict): the record is the scheduler as it is
        now, whatever the scheduler does meanwhile (torch's ``state_dict()`` shares lists such
        as ``base_lrs`` with the scheduler)."""
        copied, plain = _copied(_indexed(scheduler.state_dict()))
        record = cls(copied, _class_name(scheduler))
        if not plain:  # a tensor, or a value only the codec can judge: fails now, naming it
            record._encode()
        return record

    def _snapshot(self, stage: _Stage) -> Record | None:
        copied, plain = _copied(self.state)
        return LrSchedulerRecord(copied, self.scheduler_class) if plain else None

    def state_dict(self) -> dict[str, Any]:
        """The state as torch's ``scheduler.state_dict()`` has it (children in ``_schedulers``)."""
        return _torch_form(self.state)

    def apply(self, scheduler: SchedulerLike) -> SchedulerLike:
        """Load the state into ``scheduler`` (same class, built on the resumed optimizer with
        the same functions for lambda-based schedulers) and return it."""
        if _class_name(scheduler) != self.scheduler_class:
            raise RecordError(
                "validation",
                f"record holds {self.scheduler_class} state, the scheduler is "
                f"{_class_name(scheduler)}",
            )
        scheduler.load_state_dict(self.state_dict())
        return scheduler

    # -- burnpack content --

    def _encode(self) -> state.Content:
        try:
            content = state.encode(self.state)
        except state.StateError as e:
            raise RecordError("validation", str(e)) from e
        if content.tensors:
            raise RecordError(
                "validation",
                [
                    f"'{n}' is a tensor; a scheduler record holds scalars only"
                    for n in content.tensors
                ],
            )
        return content

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        content = self._encode()
        return {}, content.scalars, {**content.metadata, _SCHEDULER_CLASS_KEY: self.scheduler_class}

    @classmethod
    def from_pack(cls, pack: burnpack.Pack) -> LrSchedulerRecord:
        problems = [
            f"{pack.source}: '{n}' is a tensor; a scheduler record holds scalars only"
            for n in pack.names
        ]
        recorded_class = pack.metadata.get(_SCHEDULER_CLASS_KEY)
        if recorded_class is None:
            problems.append(f"{pack.source}: no '{_SCHEDULER_CLASS_KEY}' metadata entry")
        if problems:
            raise RecordError("validation", problems)
        tree = state.decode(pack)
        if not isinstance(tree, dict):
            raise RecordError("validation", f"{pack.source}: the scheduler state is not a map")
        return cls(tree, str(recorded_class))  # not None: checked above
