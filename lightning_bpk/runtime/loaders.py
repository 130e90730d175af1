"""How one data loader's position in its pass is kept: the trackers that both
:class:`~lightning_bpk.lightning.data_position.DataPosition` (a Lightning ``fit``) and
:class:`~lightning_bpk.fabric.ResumableLoader` (a hand-written Fabric loop) put around a loader.
Nothing here knows a ``Trainer``: the caller says how many batches were consumed.

A checkpoint saved after ``k`` batches of a pass must resume with batch ``k + 1`` of the *same*
order, with every RNG as it was. :func:`track` chooses one of three ways by the loader
(:func:`loader_kind`):

``sampler``
    A plain ``torch.utils.data.DataLoader`` over a map-style dataset, with any sampler whose order
    is a function of the RNG state at the start of the epoch (``RandomSampler``,
    ``SequentialSampler``, ``DistributedSampler``, ``BatchSampler`` and samplers built the same
    way), ``num_workers`` 0 or more. Its index sampler is wrapped: at the start of every pass
    the wrapper records the global RNG states and those of the loader's own ``torch.Generator``\\ s
    (and a sampler's ``state_dict()`` if it has one). A checkpoint stores that record and the
    loader's position; on resume the wrapper puts the record back before the loader draws its
    shuffle, pulls that many batches of *indices* from the sampler (no sample is loaded), then
    sets the RNG states of the save point and hands on the next batch.
``stateful``
    A loader with ``state_dict``/``load_state_dict`` (``torchdata``'s ``StatefulDataLoader``,
    litdata's ``StreamingDataLoader``, or your own): its state at the save point is stored and
    loaded back before it is iterated.
``replay``
    A DataLoader over an ``IterableDataset`` without state: it cannot be positioned without
    reading it. On resume its iterator is created from the RNG states it was created from at the
    save, and the batches consumed before the save are read again and discarded; exact when the
    dataset yields the same sequence from the same RNG states, which a stream from outside (a
    socket, a shared queue) does not.

Each tracker's :meth:`capture` gives the position (plain data for a checkpoint);
:meth:`resume` takes a saved one back before the loader's next pass. A :class:`LoaderGroup` is
what the loaders of one set-up share (the rank, the world size, the RNG states an epoch that
follows an end-of-epoch checkpoint starts from).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeGuard

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_bpk.runtime import _resample
from lightning_bpk.runtime._data_warnings import replay_message, workers_message
from lightning_bpk.runtime.rng import capture_rng, restore_rng

__all__ = [
    "REPLAY",
    "SAMPLER",
    "STATEFUL",
    "LoaderGroup",
    "Tracker",
    "continuation",
    "has_state",
    "loader_kind",
    "loader_length",
    "replay_message",
    "track",
    "workers_warning",
]

SAMPLER = "sampler"
"""A DataLoader over a map-style dataset, positioned through its index sampler."""
STATEFUL = "stateful"
"""A loader with its own ``state_dict``/``load_state_dict``, positioned through that state."""
REPLAY = "replay"
"""A DataLoader over an iterable dataset without state: re-read up to the save point."""


def _generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader and its samplers draw from (deduplicated)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _set_states(generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
    if len(generators) == len(states):  # the same loader set-up as at the save
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)


def has_state(obj: Any) -> TypeGuard[Any]:
    """``obj`` has ``state_dict`` and ``load_state_dict`` (a stateful loader, sampler, dataset)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def loader_kind(loader: Any) -> str:
    """How a training loader's position is kept: :data:`SAMPLER`, :data:`STATEFUL` or
    :data:`REPLAY` (see the module docstring)."""
    if has_state(loader):
        return STATEFUL
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return SAMPLER
    return REPLAY


def loader_length(loader: Any) -> float:
    """The batches in one pass of ``loader`` (``inf`` when it has no length)."""
    try:
        return float(len(loader))
    except TypeError:  # an iterable dataset without __len__
        return float("inf")


def _snapshot(loader: Any, global_rng: bool = True) -> dict:
    """The states a loader's pass is drawn from: global RNGs, its generators, its sampler's."""
    sampler: Any = getattr(loader, "sampler", None)
    state: dict[str, Any] = {"generators": [g.get_state() for g in _generators(loader)]}
    if global_rng:
        state["rng"] = capture_rng()
    if has_state(sampler):
        state["sampler"] = sampler.state_dict()
    return state


def _apply(loader: Any, snapshot: dict, global_rng: bool = True) -> None:
    if global_rng and "rng" in snapshot:
        restore_rng(snapshot["rng"])
    _set_states(_generators(loader), snapshot["generators"])
    sampler: Any = getattr(loader, "sampler", None)
    if "sampler" in snapshot and has_state(sampler):
        sampler.load_state_dict(snapshot["sampler"])


class LoaderGroup:
    """What the loaders of one set-up share: after an epoch-end checkpoint, the global RNG
    states the next epoch's iterators are created from. They are set by the first loader to
    create its iterator (again, should it create another before its first pull); the others
    are created after it, from the states it left, as in the original run."""

    def __init__(self, epoch_start: dict | None, world_size: int = 1, rank: int = 0) -> None:
        self.epoch_start = epoch_start
        self.world_size, self.rank = world_size, rank
        self._first: object | None = None

    def start_epoch(self, slot: object) -> None:
        if self.epoch_start is not None and self._first in (None, slot):
            self._first = slot
            restore_rng(self.epoch_start)

    def started(self) -> None:
        """The epoch's first pull happened: the states are not set again."""
        self.epoch_start = None

    def restart(self, epoch_start: dict | None) -> None:
        """Resumed from a checkpoint: the next epoch's iterators are created from
        ``epoch_start`` (an end-of-epoch checkpoint's RNG states; None: as the RNGs are)."""
        self.epoch_start, self._first = epoch_start, None


class _PositionedSampler:
    """Stands in for a DataLoader's index sampler; see the module docstring (``sampler``)."""

    def __init__(self, inner: Any, tracker: _Tracker) -> None:
        self.inner = inner
        self.tracker = tracker

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # sampler, set_epoch, batch_size...
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        # Runs when the DataLoader creates its iterator, before it draws its worker base seed.
        return self.tracker.start_pass(self.inner)


class _StatefulLoader:
    """The position of a loader with its own ``state_dict``/``load_state_dict``."""

    kind = STATEFUL

    def __init__(
        self, loader: Any, pending: dict | None, rng: dict | None, group: LoaderGroup
    ) -> None:
        del group  # the loader's own state holds what it needs
        self.loader = loader
        self.resume(pending, rng)

    def resume(self, pending: dict | None, rng: dict | None) -> None:
        """Continue from the saved position ``pending`` (None: from where the loader is)."""
        del rng  # the caller sets the save point's RNG states once the iterator exists
        loader = self.loader
        if pending is not None and not pending["epoch_end"]:
            loader.load_state_dict(pending["state"])  # mid-epoch: through its own state
        elif pending is not None:  # a new epoch from the save point's generator states
            _set_states(_generators(loader), pending.get("generators", []))

    def capture(self, within: int, epoch_end: bool) -> dict:
        position: dict[str, Any] = {"kind": self.kind, "batches": within, "epoch_end": epoch_end}
        position["batch_size"] = getattr(self.loader, "batch_size", None)
        if epoch_end:  # its generators may live across epochs (torchdata's do)
            position["generators"] = [g.get_state() for g in _generators(self.loader)]
        else:
            position["state"] = self.loader.state_dict()
        return position


class _Wrapped:
    """A DataLoader whose iterator creation is wrapped (the ``sampler`` and ``replay`` kinds):
    the position is the states its current pass started from and the batches consumed since."""

    kind = ""

    def __init__(
        self, loader: DataLoader, pending: dict | None, rng: dict | None, group: LoaderGroup
    ) -> None:
        self.loader, self.pending, self.rng, self.group = loader, pending, rng, group
        self.start: dict | None = None  # the snapshot taken at the start of the current pass
        create = loader._get_iterator

        def get_iterator() -> Any:
            self.group.start_epoch(self)  # after an epoch-end checkpoint, from its RNG states
            pending = self.pending
            if pending is not None and pending["epoch_end"]:
                _apply(self.loader, pending["start"], global_rng=False)
            return self._create(create)

        # DataLoader forbids reassigning some attributes after __init__; this one is plain.
        object.__setattr__(loader, "_get_iterator", get_iterator)
        # Lightning warns that a loader without state_dict cannot resume mid-epoch; this one
        # can (through the wrapper), so it gets an empty state for Lightning.
        loader.state_dict = dict
        loader.load_state_dict = _ignore

    def resume(self, pending: dict | None, rng: dict | None) -> None:
        """Continue from the saved position ``pending`` at the loader's next pass, with the save
        point's RNG states ``rng`` set before its first batch."""
        self.pending, self.rng = pending, rng

    def _create(self, create: Any) -> Any:
        return create()

    def capture(self, within: int, epoch_end: bool) -> dict:
        # at an epoch's end (or before the first pull) the next pass starts from here
        start = _snapshot(self.loader) if epoch_end or self.start is None else self.start
        batch_size = getattr(self.loader, "batch_size", None)
        return {
            "kind": self.kind,
            "batches": within,
            "epoch_end": epoch_end,
            "start": start,
            "batch_size": batch_size,
        }


class _Tracker(_Wrapped):
    """The position of a DataLoader over a map-style dataset (``sampler`` kind)."""

    kind = SAMPLER

    def __init__(
        self, loader: DataLoader, pending: dict | None, rng: dict | None, group: LoaderGroup
    ) -> None:
        attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        self.batch_sampler: Any = loader.batch_sampler  # None: batch_size=None
        self.resampled: dict | None = None  # this pass continues another run's in samples
        # DataLoader forbids reassigning its sampler after __init__; the wrapper is transparent.
        object.__setattr__(loader, attribute, _PositionedSampler(getattr(loader, attribute), self))
        super().__init__(loader, pending, rng, group)

    def capture(self, within: int, epoch_end: bool) -> dict:
        position = super().capture(within, epoch_end)
        resampled = None if epoch_end else self.resampled
        position["geometry"] = _resample.geometry(
            self.batch_sampler, self.group.world_size, resampled
        )
        return position

    def start_pass(self, inner: Any) -> Iterator[Any]:
        """The index iterator of a new DataLoader iterator (a new pass, or a multi-worker
        loader's second call in its constructor, whose first iterator is never used)."""
        pending = self.pending
        if pending is not None and "resample" in pending:
            return self._resample(pending)
        if pending is not None and not pending["epoch_end"]:
            return self._resume(inner, pending)
        return self._fresh(inner)

    def _resample(self, pending: dict) -> Iterator[Any]:
        """The rest of the saved epoch's order, in samples (:mod:`lightning_bpk._resample`)."""
        self.pending = None
        self.start, plan = pending["start"], pending["resample"]
        self.resampled = plan
        order = _resample.saved_order(plan["order"], self.start)
        sampler = self.batch_sampler.sampler
        drop_last = isinstance(sampler, torch.utils.data.DistributedSampler) and sampler.drop_last
        mine = _resample.remaining_for_rank(
            order, plan["consumed"], self.group.world_size, self.group.rank, drop_last
        )
        if self.rng is not None:
            restore_rng(self.rng)
        batch_sampler = self.batch_sampler
        yield from _resample.batches(mine, batch_sampler.batch_size, batch_sampler.drop_last)

    def _fresh(self, inner: Any) -> Iterator[Any]:
        # Runs at the first pull: the state the sampler's shuffle is drawn from (the loader
        # drew its worker base seed before, when it created its iterator).
        self.pending = None
        self.resampled = None
        self.group.started()
        self.start = _snapshot(self.loader)
        yield from inner

    def _resume(self, inner: Any, pending: dict) -> Iterator[Any]:
        self.pending = None
        self.start = pending["start"]
        _apply(self.loader, self.start)
        iterator = iter(inner)
        for _ in range(pending["batches"]):  # indices only: no sample of these is loaded
            if next(iterator, _END) is _END:
                break
        # The next batch's indices too: a lazy sampler draws its shuffle at its first pull, and
        # the original run had pulled them (prefetching) before the save.
        following = next(iterator, _END)
        if self.rng is not None:
            restore_rng(self.rng)  # the save point's states, after the shuffle
        if following is not _END:
            yield following
            yield from iterator


class _Replayer(_Wrapped):
    """The position of a DataLoader over an iterable dataset without state (``replay`` kind):
    its iterator is created again from the states of the save's pass and advanced by reading
    the batches consumed before the save."""

    kind = REPLAY

    def _create(self, create: Any) -> Any:
        pending, self.pending = self.pending, None
        if pending is not None and not pending["epoch_end"]:
            _apply(self.loader, pending["start"])
        # The dataset's __iter__ (or the workers' seeds) draws from these states.
        self.start = _snapshot(self.loader)
        iterator = create()
        self.group.started()
        if pending is None or pending["epoch_end"]:
            return iterator
        for _ in range(pending["batches"]):  # read and discarded: consumed before the save
            if next(iterator, _END) is _END:
                break
        if self.rng is not None:
            restore_rng(self.rng)
        return iterator


_END = object()
_KINDS: dict[str, Any] = {SAMPLER: _Tracker, STATEFUL: _StatefulLoader, REPLAY: _Replayer}


class Tracker(Protocol):
    """What :func:`track` returns: the position of one loader."""

    kind: str
    loader: Any

    def capture(self, within: int, epoch_end: bool) -> dict:
        """The position after ``within`` batches of the current pass (or at its end), as plain
        data for a checkpoint."""
        ...

    def resume(self, pending: dict | None, rng: dict | None) -> None:
        """Continue from a position :meth:`capture` gave, with ``rng`` the save point's RNG
        states (``pending`` None: nothing to continue)."""
        ...


def track(loader: Any, pending: dict | None, rng: dict | None, group: LoaderGroup) -> Tracker:
    """Put the tracker of ``loader``'s kind (:func:`loader_kind`) around it, continuing from
    the saved position ``pending`` (if any) at its next pass. A loader of the ``sampler`` or
    ``replay`` kind is wrapped in place: its index sampler and its iterator creation. A
    ``pending`` of another kind than the loader's is ignored."""
    kind = loader_kind(loader)
    if pending is not None and pending.get("kind") != kind:
        pending = None  # another kind of loader than at the save: nothing to carry over
    tracker: Tracker = _KINDS[kind](loader, pending, rng, group)
    return tracker


def _ignore(state: Any) -> None:
    del state


def continuation(
    tracker: Tracker, pending: dict, world_size: int, saved_world_size: int | None, where: str
) -> dict:
    """How ``tracker`` continues the saved mid-epoch position ``pending`` on ``world_size``
    ranks (``saved_world_size``: at the save, None if unknown; ``where`` names the checkpoint
    and epoch for messages).

    A ``sampler`` loader whose batch size or world size changed continues in samples (the plan
    is under ``"resample"``: :mod:`lightning_bpk.runtime._resample`); one of the other kinds
    counts in its own batches and is refused (:class:`CheckpointResumeError` naming both
    values). Otherwise ``pending`` comes back as it is.
    """
    if tracker.kind == SAMPLER:
        batch_sampler = getattr(tracker, "batch_sampler", None)
        plan = _resample.replan(pending, batch_sampler, world_size, where)
        return pending if plan is None else dict(pending, resample=plan)
    _resample.check_unchanged(
        {
            "world size": (saved_world_size, world_size),
            "batch_size": (pending.get("batch_size"), getattr(tracker.loader, "batch_size", None)),
        },
        f"{type(tracker.loader).__name__}, positioned by {tracker.kind}",
        where,
    )
    return pending


def workers_warning(loader: Any, kind: str, pending: dict) -> str | None:
    """What a resume from ``pending`` cannot restore of ``loader``'s worker processes (their
    random draws), or None when nothing is lost (no workers, a new epoch of workers that are
    not persistent, or a dataset whose own state holds its randomness)."""
    workers = getattr(loader, "num_workers", 0)
    persistent = bool(getattr(loader, "persistent_workers", False))
    if workers == 0 or not (persistent or not pending["epoch_end"]):
        return None
    if kind == STATEFUL and has_state(getattr(loader, "dataset", None)):
        return None  # each worker's dataset state (its generators) is saved and restored
    return workers_message(loader, workers, persistent, kind == STATEFUL)
