"""Where the training data stands inside an epoch, so a mid-epoch checkpoint continues exactly.

A checkpoint saved after ``k`` batches of epoch ``E`` must resume with batch ``k + 1`` of the
*same* shuffled order, with every RNG as it was. :class:`DataPosition` makes that possible for the
training loader of one ``fit``, in one of three ways, chosen per loader when Lightning sets it up:

``sampler``
    A plain ``torch.utils.data.DataLoader`` over a map-style dataset, with any sampler whose order
    is a function of the RNG state at the start of the epoch (``RandomSampler``,
    ``SequentialSampler``, ``DistributedSampler``, ``BatchSampler`` and samplers built the same
    way), ``num_workers`` 0 or more. Its index sampler is wrapped: at the start of every epoch the
    wrapper records the global RNG states and those of the loader's own ``torch.Generator``\\ s
    (and a sampler's ``state_dict()`` if it has one). A checkpoint stores that record and ``k``;
    on resume the wrapper puts the record back before the loader draws its shuffle, pulls ``k``
    batches of *indices* from the sampler (no sample is loaded), then sets the RNG states of the
    save point and hands on batch ``k + 1``.
``stateful``
    A loader with ``state_dict``/``load_state_dict`` (``torchdata``'s ``StatefulDataLoader``, or
    your own): its state at the save point is stored and loaded back before it is iterated.
``replay``
    Anything else (an ``IterableDataset`` without state, several training loaders): exactness
    is impossible, one warning says so, and a mid-epoch checkpoint replays its epoch from the
    first batch (the loop counters saved are those of the start of the epoch).

The number of batches ``k`` is what the model consumed (Lightning's batch index), never what a
prefetcher or a worker fetched ahead. Each rank records its own position and RNG states.

Limits: per-sample randomness drawn inside worker processes (random augmentation with
``num_workers > 0``) is not replayed for the skipped batches, so derive it from the sample index
if it must be exact; with ``persistent_workers=True`` the workers keep the seeds they were started
with, so a resumed run's workers are seeded differently.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, TypeGuard

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_bpk import _lightning_compat, trainer_state

__all__ = ["POSITION_KEY", "REPLAY", "SAMPLER", "STATEFUL", "DataPosition", "loader_kind"]

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
        return self.tracker.start_epoch(self.inner)


class _Tracker:
    """The position of one training DataLoader (``sampler`` kind)."""

    def __init__(self, loader: DataLoader, pending: dict | None, rng: dict | None) -> None:
        self.loader = loader
        self.pending, self.rng = pending, rng
        self.start: dict | None = None  # the snapshot taken at the start of the current epoch
        attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        # DataLoader forbids reassigning its sampler after __init__; the wrapper is transparent.
        object.__setattr__(loader, attribute, _PositionedSampler(getattr(loader, attribute), self))
        create = loader._get_iterator

        def get_iterator() -> Any:
            # An epoch-end checkpoint: the epoch's iterator is created from its RNG states (its
            # worker base seed is drawn here), however often Lightning creates one before use.
            if self.pending is not None and self.pending["batches"] == 0:
                self._apply(self.pending["start"])
            return create()

        object.__setattr__(loader, "_get_iterator", get_iterator)

    def snapshot(self) -> dict:
        sampler: Any = getattr(self.loader, "sampler", None)
        state: dict[str, Any] = {
            "rng": trainer_state.capture_rng(),
            "generators": [g.get_state() for g in _generators(self.loader)],
        }
        if _stateful(sampler):
            state["sampler"] = sampler.state_dict()
        return state

    def _apply(self, snapshot: dict) -> None:
        trainer_state.restore_rng(snapshot["rng"])
        _set_states(_generators(self.loader), snapshot["generators"])
        sampler: Any = getattr(self.loader, "sampler", None)
        if "sampler" in snapshot and _stateful(sampler):
            sampler.load_state_dict(snapshot["sampler"])

    def start_epoch(self, inner: Any) -> Iterator[Any]:
        """The index iterator of a new DataLoader iterator (a new epoch, or a multi-worker
        loader's second call in its constructor, whose first iterator is never used)."""
        pending = self.pending
        if pending is None or pending["batches"] == 0:
            return self._fresh(inner)
        return self._resume(inner, pending)

    def _fresh(self, inner: Any) -> Iterator[Any]:
        # Runs at the first pull: the state the sampler's shuffle is drawn from (the loader
        # drew its worker base seed before, when it created its iterator).
        self.pending = None
        self.start = self.snapshot()
        yield from inner

    def _resume(self, inner: Any, pending: dict) -> Iterator[Any]:
        self.pending = None
        self.start = pending["start"]
        self._apply(self.start)
        iterator = iter(inner)
        for _ in range(pending["batches"]):  # indices only: no sample of these is loaded
            if next(iterator, _END) is _END:
                return
        if self.rng is not None:
            trainer_state.restore_rng(self.rng)  # the save point's states, after the shuffle
        yield from iterator


_END = object()


class DataPosition:
    """Tracks the training loader of one ``fit`` (see the module docstring).

    Lifecycle: :meth:`attach` once per ``fit`` (before Lightning sets up the training data),
    :meth:`resume_from` when a checkpoint is restored, :meth:`capture` at every save.
    """

    def __init__(self) -> None:
        self.kind = REPLAY
        self._tracker: _Tracker | None = None
        self._loader: Any = None
        self._pending: dict | None = None  # this rank's position from the restored checkpoint
        self._rng: dict | None = None  # this rank's RNG states at the save point
        self._rng_at_first_batch: dict | None = None
        self._warned = False

    def attach(self, trainer: pl.Trainer) -> None:
        """Take over the training loaders Lightning sets up from now on (this trainer only)."""
        _lightning_compat.intercept_train_dataloaders(trainer, self._install)

    def detach(self, trainer: pl.Trainer) -> None:
        """Undo :meth:`attach`."""
        _lightning_compat.release_train_dataloaders(trainer)

    def _install(self, loader: Any, count: int) -> None:
        if count > 1:  # several training loaders: none of them resumes exactly
            if self._tracker is not None:
                self._tracker.pending = None
            self.kind, self._tracker = REPLAY, None
            self._warn(loader)
            return
        self.kind, self._loader, self._tracker = loader_kind(loader), loader, None
        pending, self._pending = self._pending, None
        if pending is not None and self._rng is not None:
            # Building the loader may have drawn from the RNGs (torchdata's RandomSampler seeds
            # its generator then); the original run did that before the save point.
            trainer_state.restore_rng(self._rng)
        if pending is not None and pending.get("kind") != self.kind:
            pending = None  # another kind of loader than at the save: nothing to carry over
        if self.kind == SAMPLER:
            self._tracker = _Tracker(
                loader, None if pending is None else pending[SAMPLER], self._rng
            )
            # Lightning warns that a loader without state_dict cannot resume mid-epoch; this
            # one can (through the wrapper above), so it gets an empty state for Lightning.
            loader.state_dict = dict
            loader.load_state_dict = _ignore
        elif self.kind == STATEFUL and pending is not None:
            if pending.get(STATEFUL) is not None:  # mid-epoch: through its own state
                loader.load_state_dict(pending[STATEFUL])
                self._rng_at_first_batch = self._rng  # its iterator draws differently
            else:  # at an epoch's end: a new epoch from the save point's generator states
                _set_states(_generators(loader), pending.get("generators", []))
        else:
            self._warn(loader)

    def before_batch(self) -> None:
        """Call before every training batch: a resumed ``stateful`` loader drew its seeds when
        it was iterated, so the save point's RNG states are set again before its first batch."""
        rng, self._rng_at_first_batch = self._rng_at_first_batch, None
        if rng is not None:
            trainer_state.restore_rng(rng)

    def _warn(self, loader: Any) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"the training data ({type(loader).__name__}) cannot resume in the middle of an "
            "epoch (an iterable dataset without state_dict/load_state_dict, or several training "
            "loaders): a checkpoint saved mid-epoch replays that epoch from its first batch",
            stacklevel=2,
        )

    # -- saving ------------------------------------------------------------------------------

    @property
    def exact(self) -> bool:
        """Whether a mid-epoch checkpoint of the current loader resumes exactly."""
        return self.kind != REPLAY

    def capture(self, consumed: int, epoch_end: bool) -> dict:
        """This rank's position after ``consumed`` batches of the current epoch (or at its end)."""
        position: dict[str, Any] = {"kind": self.kind, "batches": 0 if epoch_end else consumed}
        if self.kind == SAMPLER and self._tracker is not None:
            if epoch_end or self._tracker.start is None:
                start = self._tracker.snapshot()  # the next epoch starts from here
            else:
                start = self._tracker.start
            position[SAMPLER] = {"batches": position["batches"], "start": start}
        elif self.kind == STATEFUL and not epoch_end:
            position[STATEFUL] = self._loader.state_dict()
        elif self.kind == STATEFUL:  # its generators may live across epochs (torchdata's do)
            position["generators"] = [g.get_state() for g in _generators(self._loader)]
        position["rng"] = trainer_state.capture_rng()
        return position

    # -- resuming ----------------------------------------------------------------------------

    def resume_from(self, position: dict | None) -> None:
        """Restore this rank's RNG states now and keep the data position for the loader."""
        self._pending = position
        self._rng = None if position is None else position.get("rng")
        if self._rng is not None:
            trainer_state.restore_rng(self._rng)


def _ignore(state: Any) -> None:
    del state
