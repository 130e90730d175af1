"""Where the training data stands inside an epoch, so a mid-epoch checkpoint continues exactly.

A checkpoint saved after ``k`` batches of epoch ``E`` must resume with batch ``k + 1`` of the
*same* order, with every RNG as it was and Lightning's counters (``global_step``, batch index)
as saved. :class:`DataPosition` does that for every training loader of one ``fit``: a single
loader, or each loader of a dict, list or ``CombinedLoader`` (modes ``max_size_cycle``,
``min_size`` and ``max_size``; Lightning does not train with ``sequential``). Each loader is
positioned in one of three ways, chosen when Lightning sets it up:

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
    A loader with ``state_dict``/``load_state_dict`` (``torchdata``'s ``StatefulDataLoader``, or
    your own): its state at the save point is stored and loaded back before it is iterated.
``replay``
    A DataLoader over an ``IterableDataset`` without state: it cannot be positioned without
    reading it. On resume its iterator is created from the RNG states it was created from at the
    save, and the batches consumed before the save are read again and discarded (one warning says
    so); the counters continue from the save. Exact when the dataset yields the same sequence
    from the same RNG states, which a stream from outside (a socket, a shared queue) does not.

A loader's position is the number of its batches the model consumed in its current pass,
derived from Lightning's batch index (never from what a prefetcher or a worker fetched ahead)
and the combined loader's mode: in ``max_size_cycle`` a shorter loader that started again is in
a later pass. Each rank records its own position and RNG states.

Limits: random draws made inside DataLoader worker processes (augmentation with
``num_workers > 0``) are not restored: the workers of a resumed run start from new seeds, so the
rest of that epoch differs, and with ``persistent_workers=True`` every later epoch too (one
warning says so at resume). ``torchdata``'s ``StatefulDataLoader`` restores them when the dataset
keeps its randomness in its own ``state_dict`` (each worker's dataset state is saved).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any, TypeGuard

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_bpk.errors import CheckpointResumeError
from lightning_bpk.lightning import _compat, _data_warnings, _resample, trainer_state

__all__ = [
    "POSITION_KEY",
    "REPLAY",
    "SAMPLER",
    "STATEFUL",
    "DataPosition",
    "loader_kind",
    "within_pass",
]

log = logging.getLogger("lightning_bpk")

# Top-level key of Lightning's dict holding every rank's position and RNG states.
POSITION_KEY = "lightning_bpk_data"
SAMPLER, STATEFUL, REPLAY = "sampler", "stateful", "replay"


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


def _stateful(obj: Any) -> TypeGuard[Any]:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def loader_kind(loader: Any) -> str:
    """How a training loader's position is kept: :data:`SAMPLER`, :data:`STATEFUL` or
    :data:`REPLAY` (see the module docstring)."""
    if _stateful(loader):
        return STATEFUL
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return SAMPLER
    return REPLAY


def _length(loader: Any) -> float:
    try:
        return float(len(loader))
    except TypeError:  # an iterable dataset without __len__
        return float("inf")


def within_pass(mode: str, consumed: int, length: float, prefetched: bool = False) -> int:
    """Batches of one loader of a combined loader in ``mode`` the model consumed in that
    loader's current pass, after ``consumed`` combined batches of the epoch.

    In ``max_size_cycle`` a shorter loader starts a new pass when it runs out, at the fetch of
    the next batch: Lightning fetches a batch ahead (``prefetched``) only when the combined
    loader has no length, so otherwise a loader that has just run out is still at the end of
    its pass.

    >>> [within_pass("max_size_cycle", 7, n) for n in (10, 4, 7)]
    [7, 3, 7]
    >>> within_pass("max_size_cycle", 7, 7, prefetched=True), within_pass("max_size", 7, 4)
    (0, 4)
    """
    if mode == "max_size_cycle" and 0 < length <= consumed:
        within = int(consumed % length)
        return int(length) if within == 0 and not prefetched else within
    if mode == "max_size":
        return int(min(consumed, length))  # a shorter loader stays exhausted
    return consumed


def _snapshot(loader: Any, global_rng: bool = True) -> dict:
    """The states a loader's pass is drawn from: global RNGs, its generators, its sampler's."""
    sampler: Any = getattr(loader, "sampler", None)
    state: dict[str, Any] = {"generators": [g.get_state() for g in _generators(loader)]}
    if global_rng:
        state["rng"] = trainer_state.capture_rng()
    if _stateful(sampler):
        state["sampler"] = sampler.state_dict()
    return state


def _apply(loader: Any, snapshot: dict, global_rng: bool = True) -> None:
    if global_rng and "rng" in snapshot:
        trainer_state.restore_rng(snapshot["rng"])
    _set_states(_generators(loader), snapshot["generators"])
    sampler: Any = getattr(loader, "sampler", None)
    if "sampler" in snapshot and _stateful(sampler):
        sampler.load_state_dict(snapshot["sampler"])


class _Group:
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
            trainer_state.restore_rng(self.epoch_start)

    def started(self) -> None:
        """The epoch's first pull happened: the states are not set again."""
        self.epoch_start = None


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

    def __init__(self, loader: Any, pending: dict | None, rng: dict | None, group: _Group) -> None:
        del rng, group  # the loader's own state holds what it needs
        self.loader = loader
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

    def __init__(self, loader: DataLoader, pending: dict | None, rng: dict | None, group: _Group):
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

    def __init__(self, loader: DataLoader, pending: dict | None, rng: dict | None, group: _Group):
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
            trainer_state.restore_rng(self.rng)
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
            trainer_state.restore_rng(self.rng)  # the save point's states, after the shuffle
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
            trainer_state.restore_rng(self.rng)
        return iterator


_END = object()
_KINDS: dict[str, Any] = {SAMPLER: _Tracker, STATEFUL: _StatefulLoader, REPLAY: _Replayer}


def _saved_loaders(position: dict) -> list[dict | None]:
    """The per-loader positions of one rank's saved position (also of the one-loader form
    earlier versions saved: ``kind``, ``batches`` and the kind's own entry at the top)."""
    if "loaders" in position:
        return list(position["loaders"])
    batches, kind = position.get("batches", 0), position.get("kind")
    end = {"kind": kind, "batches": batches, "epoch_end": batches == 0}
    if kind == SAMPLER:
        return [dict(end, start=position[SAMPLER]["start"])]
    if kind == STATEFUL and position.get(STATEFUL) is not None:
        return [dict(end, epoch_end=False, state=position[STATEFUL])]
    if kind == STATEFUL:
        return [dict(end, epoch_end=True, generators=position.get("generators", []))]
    return [None]  # a replayed epoch: its loop counters are those of the epoch's start


class DataPosition:
    """Tracks the training loaders of one ``fit`` (see the module docstring).

    Lifecycle: :meth:`attach` once per ``fit`` (before Lightning sets up the training data),
    :meth:`resume_from` when a checkpoint is restored, :meth:`capture` at every save.
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._loaders: list[Any] = []  # None: a loader that is not a DataLoader
        self._pending: dict | None = None  # this rank's position from the restored checkpoint
        self._pending_loaders: list[dict | None] = []
        self._rng: dict | None = None  # this rank's RNG states at the save point
        self._rng_at_first_batch: dict | None = None
        self._group = _Group(None)
        self._warned: set[str] = set()
        self._position: dict | None = None  # the restored position, for the loaders' set-up
        self._resumed_at: int | None = None  # the batch index a resume in samples starts at
        self._where = "the checkpoint"  # "epoch E of <path>", for messages

    def attach(self, trainer: pl.Trainer) -> None:
        """Take over the training loaders Lightning sets up from now on (this trainer only)."""
        self._trainer = trainer
        _compat.intercept_train_dataloaders(trainer, self._install)

    def detach(self, trainer: pl.Trainer) -> None:
        """Undo :meth:`attach`."""
        _compat.release_train_dataloaders(trainer)

    def _install(self, loader: Any, count: int) -> None:
        if count == 1:  # a new set-up of the training data: the saved position applies once
            pending, self._pending = self._pending, None
            self._loaders = []
            self._pending_loaders = [] if pending is None else _saved_loaders(pending)
            epoch_end = pending is not None and pending.get("batches", 0) == 0
            assert self._trainer is not None
            world_size, rank = self._trainer.world_size, self._trainer.global_rank
            self._group = _Group(self._rng if epoch_end else None, world_size, rank)
            self._position, self._resumed_at = pending, None
            if pending is not None and self._rng is not None:
                # Building the loader may have drawn from the RNGs (torchdata's RandomSampler
                # seeds its generator then); the original run did that before the save point.
                trainer_state.restore_rng(self._rng)
        index = count - 1
        pending = self._pending_loaders[index] if index < len(self._pending_loaders) else None
        kind = loader_kind(loader)
        if pending is not None and pending.get("kind") != kind:
            pending = None  # another kind of loader than at the save: nothing to carry over
        if kind == REPLAY and not isinstance(loader, DataLoader):
            self._loaders.append(None)
            self._warn_once("unpositioned", _data_warnings.unpositioned_message(loader))
            return
        if kind == STATEFUL and pending is not None and not pending["epoch_end"]:
            self._rng_at_first_batch = self._rng  # its iterator draws differently
        if kind == SAMPLER and pending is not None and not pending["epoch_end"]:
            pending = self._in_samples(loader, pending)
        elif pending is not None and not pending["epoch_end"]:
            self._check_unchanged(loader, kind, pending)
        if count == 1:
            self._check_accumulation()
        self._loaders.append(_KINDS[kind](loader, pending, self._rng, self._group))
        if kind == REPLAY:
            self._warn_once(REPLAY, _data_warnings.replay_message(loader))
        if pending is not None:
            self._warn_workers(loader, kind, pending)

    def _in_samples(self, loader: DataLoader, pending: dict) -> dict:
        """A saved position continued in samples when the batch size or world size changed."""
        plan = _resample.replan(pending, loader.batch_sampler, self._group.world_size, self._where)
        if plan is None:
            return pending
        if len(self._pending_loaders) > 1:
            raise CheckpointResumeError(
                f"cannot continue {self._where} in the middle with another batch size or world "
                "size: it has several training loaders, whose batches pair up. Resume with the "
                "saved settings, or from an end-of-epoch checkpoint"
            )
        assert self._trainer is not None
        _compat.shift_batch_progress(self._trainer, plan["batches"] - pending["batches"])
        self._resumed_at = plan["batches"]
        if self._trainer.global_rank == 0:
            log.info(
                "%s continues in samples: %d of its order were consumed before the save, the "
                "rest is split over %d rank(s) in batches of %d (batch %d of the epoch on)",
                self._where,
                plan["consumed"],
                self._group.world_size,
                getattr(loader.batch_sampler, "batch_size", None),
                plan["batches"],
            )
        return dict(pending, resample=plan)

    def _check_unchanged(self, loader: Any, kind: str, pending: dict) -> None:
        """A loader positioned in batches of its own (``stateful``, ``replay``) cannot continue
        its epoch on another batch size or world size (:func:`_resample.check_unchanged`)."""
        _resample.check_unchanged(
            {
                "world size": ((self._position or {}).get("world_size"), self._group.world_size),
                "batch_size": (pending.get("batch_size"), getattr(loader, "batch_size", None)),
            },
            f"{type(loader).__name__}, positioned by {kind}",
            self._where,
        )

    def _check_accumulation(self) -> None:
        """A changed ``accumulate_grad_batches``: see :func:`_resample.check_accumulation`."""
        position = self._position or {}
        assert self._trainer is not None
        batches = self._resumed_at if self._resumed_at is not None else position.get("batches", 0)
        _resample.check_accumulation(
            position.get("accumulate"), self._trainer.accumulate_grad_batches, batches, self._where
        )

    def before_batch(self) -> None:
        """Call before every training batch: a resumed ``stateful`` loader drew its seeds when
        it was iterated, so the save point's RNG states are set again before its first batch."""
        rng, self._rng_at_first_batch = self._rng_at_first_batch, None
        if rng is not None:
            trainer_state.restore_rng(rng)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _warn_workers(self, loader: Any, kind: str, pending: dict) -> None:
        """Random draws inside worker processes are not restored (see the module docstring)."""
        workers = getattr(loader, "num_workers", 0)
        persistent = bool(getattr(loader, "persistent_workers", False))
        if workers == 0 or not (persistent or not pending["epoch_end"]):
            return
        if kind == STATEFUL and _stateful(getattr(loader, "dataset", None)):
            return  # each worker's dataset state (its generators) is saved and restored
        self._warn_once(
            "workers", _data_warnings.workers_message(loader, workers, persistent, kind == STATEFUL)
        )

    # -- saving ------------------------------------------------------------------------------

    def capture(self, consumed: int, epoch_end: bool) -> dict:
        """This rank's position after ``consumed`` batches of the current epoch (or at its end)."""
        mode = "max_size_cycle"
        if len(self._loaders) > 1 and self._trainer is not None:
            mode = _compat.train_combined_mode(self._trainer)
        batches = 0 if epoch_end else consumed
        lengths = [_length(slot.loader) for slot in self._loaders if slot is not None]
        prefetched = float("inf") in lengths
        loaders: list[dict | None] = [
            None
            if slot is None
            else slot.capture(
                within_pass(mode, batches, _length(slot.loader), prefetched), epoch_end
            )
            for slot in self._loaders
        ]
        assert self._trainer is not None
        return {
            "batches": batches,
            "epoch_end": epoch_end,
            "epoch": self._trainer.current_epoch,
            "accumulate": self._trainer.accumulate_grad_batches,
            "world_size": self._trainer.world_size,
            "loaders": loaders,
            "rng": trainer_state.capture_rng(),
        }

    # -- resuming ----------------------------------------------------------------------------

    def resume_from(self, position: dict | None) -> None:
        """Restore this rank's RNG states now and keep the data position for the loaders."""
        self._pending = position
        self._rng = None if position is None else position.get("rng")
        if self._rng is not None:
            trainer_state.restore_rng(self._rng)

    def resume_from_ranks(
        self, ranks: Any, rng: dict | None, trainer: pl.Trainer, source: str
    ) -> None:
        """:meth:`resume_from` this rank's entry of a checkpoint's :data:`POSITION_KEY` list
        (``rng``: the checkpoint's RNG states, for one without positions). Saved by another
        number of ranks, every rank continues from rank 0's data position, which the loaders
        continue in samples, and with its own saved RNG states (rank 0's on a new rank)."""
        if not isinstance(ranks, list) or not ranks:
            self.resume_from(None if rng is None else {"rng": rng})
            return
        position = ranks[trainer.global_rank] if trainer.global_rank < len(ranks) else None
        epoch = ranks[0].get("epoch")
        self._where = f"epoch {epoch} of {source}" if epoch is not None else source
        if len(ranks) == trainer.world_size:
            self.resume_from(position)
            return
        if trainer.is_global_zero:
            log.warning(
                "%s was saved by %d rank(s) and is resumed on %d: saved mid-epoch, the rest of "
                "its epoch's order is split over the new ranks; each rank continues with its "
                "own saved RNG states (rank 0's on a new rank), so random draws such as dropout "
                "differ from an uninterrupted run",
                source,
                len(ranks),
                trainer.world_size,
            )
        own_rng = (position or ranks[0]).get("rng")
        self.resume_from(dict(ranks[0], rng=own_rng))


def _ignore(state: Any) -> None:
    del state
