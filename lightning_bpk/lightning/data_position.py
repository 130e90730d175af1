"""Where the training data stands inside an epoch, so a mid-epoch checkpoint continues exactly.

A checkpoint saved after ``k`` batches of epoch ``E`` must resume with batch ``k + 1`` of the
*same* order, with every RNG as it was and Lightning's counters (``global_step``, batch index)
as saved. :class:`DataPosition` does that for every training loader of one ``fit``: a single
loader, or each loader of a dict, list or ``CombinedLoader`` (modes ``max_size_cycle``,
``min_size`` and ``max_size``; Lightning does not train with ``sequential``). Each loader is
positioned in one of three ways, chosen when Lightning sets it up:

``sampler`` (a plain DataLoader over a map-style dataset, any sampler, any ``num_workers``),
``stateful`` (a loader with ``state_dict``/``load_state_dict``, such as ``torchdata``'s
``StatefulDataLoader``) or ``replay`` (a DataLoader over an iterable dataset without state, read
again up to the save point; one warning says so): the trackers of
:mod:`~lightning_bpk.runtime.loaders`, which a Fabric loop's
:class:`~lightning_bpk.fabric.ResumableLoader` uses too. The counters continue from the save.

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
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_bpk.errors import CheckpointResumeError
from lightning_bpk.lightning import _compat
from lightning_bpk.runtime import _resample
from lightning_bpk.runtime._data_warnings import unpositioned_message
from lightning_bpk.runtime.loaders import (
    REPLAY,
    SAMPLER,
    STATEFUL,
    LoaderGroup,
    Tracker,
    continuation,
    loader_kind,
    loader_length,
    replay_message,
    track,
    workers_warning,
)
from lightning_bpk.runtime.rng import restore_rng

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
        self._group = LoaderGroup(None)
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
            self._group = LoaderGroup(self._rng if epoch_end else None, world_size, rank)
            self._position, self._resumed_at = pending, None
            if pending is not None and self._rng is not None:
                # Building the loader may have drawn from the RNGs (torchdata's RandomSampler
                # seeds its generator then); the original run did that before the save point.
                restore_rng(self._rng)
        index = count - 1
        pending = self._pending_loaders[index] if index < len(self._pending_loaders) else None
        kind = loader_kind(loader)
        if pending is not None and pending.get("kind") != kind:
            pending = None  # another kind of loader than at the save: nothing to carry over
        if kind == REPLAY and not isinstance(loader, DataLoader):
            self._loaders.append(None)
            self._warn_once("unpositioned", unpositioned_message(loader))
            return
        if kind == STATEFUL and pending is not None and not pending["epoch_end"]:
            self._rng_at_first_batch = self._rng  # its iterator draws differently
        tracker = track(loader, None, self._rng, self._group)
        if pending is not None and not pending["epoch_end"]:
            pending = self._continue(tracker, pending)
        if count == 1:
            self._check_accumulation()
        tracker.resume(pending, self._rng)
        self._loaders.append(tracker)
        if kind == REPLAY:
            self._warn_once(REPLAY, replay_message(loader))
        if pending is not None:
            self._warn_workers(loader, kind, pending)

    def _continue(self, tracker: Tracker, pending: dict) -> dict:
        """A saved mid-epoch position as the loader continues it: in samples when the batch
        size or world size changed (:func:`~lightning_bpk.runtime.loaders.continuation`)."""
        saved_world_size = (self._position or {}).get("world_size")
        continued = continuation(
            tracker, pending, self._group.world_size, saved_world_size, self._where
        )
        plan = continued.get("resample")
        if plan is None:
            return continued
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
                getattr(getattr(tracker, "batch_sampler", None), "batch_size", None),
                plan["batches"],
            )
        return continued

    def _check_accumulation(self) -> None:
        """A changed ``accumulate_grad_batches``: see :func:`_resample.check_accumulation`."""
        position = self._position or {}
        assert self._trainer is not None
        batches = self._resumed_at if self._resumed_at is not None else position.get("batches", 0)
        _resample.check_accumulation(
            position.get("accumulate"), self._trainer.accumulate_grad_batches, batches, self._where
        )

    @property
    def resumed_at(self) -> int | None:
        """The batch of the epoch a resume in samples (another batch size or world size)
        continues at; None: the saved position's own."""
        return self._resumed_at

    def before_batch(self) -> None:
        """Call before every training batch: a resumed ``stateful`` loader drew its seeds when
        it was iterated, so the save point's RNG states are set again before its first batch."""
        rng, self._rng_at_first_batch = self._rng_at_first_batch, None
        if rng is not None:
            restore_rng(rng)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _warn_workers(self, loader: Any, kind: str, pending: dict) -> None:
        """Random draws inside worker processes are not restored (see the module docstring)."""
        message = workers_warning(loader, kind, pending)
        if message is not None:
            self._warn_once("workers", message)

    # -- saving ------------------------------------------------------------------------------

    def capture(self, consumed: int, epoch_end: bool, rng: dict) -> dict:
        """This rank's position after ``consumed`` batches of the current epoch (or at its end);
        ``rng``: this rank's RNG states now (:func:`~lightning_bpk.runtime.rng.capture_rng`,
        taken once per save)."""
        mode = "max_size_cycle"
        if len(self._loaders) > 1 and self._trainer is not None:
            mode = _compat.train_combined_mode(self._trainer)
        batches = 0 if epoch_end else consumed
        lengths = [loader_length(slot.loader) for slot in self._loaders if slot is not None]
        prefetched = float("inf") in lengths
        loaders: list[dict | None] = [
            None
            if slot is None
            else slot.capture(
                within_pass(mode, batches, loader_length(slot.loader), prefetched), epoch_end
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
            "rng": rng,
        }

    # -- resuming ----------------------------------------------------------------------------

    def resume_from(self, position: dict | None) -> None:
        """Restore this rank's RNG states now and keep the data position for the loaders."""
        self._pending = position
        self._rng = None if position is None else position.get("rng")
        if self._rng is not None:
            restore_rng(self._rng)

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
