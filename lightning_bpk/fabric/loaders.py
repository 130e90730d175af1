"""``ResumableLoader``: a data loader of a hand-written loop whose position travels in a checkpoint.

A Fabric loop iterates its loader itself, so nothing knows how far into an epoch a checkpoint
was saved. :class:`ResumableLoader` wraps the loader (what ``fabric.setup_dataloaders``
returned, a plain ``DataLoader``, torchdata's ``StatefulDataLoader``, litdata's
``StreamingDataLoader``, or any loader with ``state_dict``/``load_state_dict``), counts the
batches it hands out, and is a stateful object itself: put it in the state dict you save and
restore, and a resumed run continues with the next batch of the same order::

    loader = ResumableLoader(fabric.setup_dataloaders(DataLoader(data, shuffle=True)))
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    manager.restore(state)               # or fabric.load(path, state)
    for batch in loader:                 # the rest of the saved epoch, then the next ones
        ...

It is positioned by the same trackers as the Lightning callback's loaders
(:mod:`lightning_bpk.runtime.loaders`): a ``DataLoader`` over a map-style dataset, with any
sampler and any ``num_workers``, re-draws the saved pass's order from the RNG states it was
drawn from and skips the consumed batches as indices (no sample is loaded twice); a loader with
its own state is restored through that state; a ``DataLoader`` over an iterable dataset without
state is read again up to the save point (a warning says so). The pass counter that Fabric's
wrapper gives a ``DistributedSampler`` as its epoch is restored too. Its state holds the RNG
states at the save point, set again once the resumed pass has drawn its order.

A save counts the batches handed out so far in the current pass, so save after the step that
used the last one (not between fetching a batch and training on it). With another batch size or
number of ranks than at the save, a ``DataLoader`` continues the saved epoch in samples: the
samples not yet consumed are split over the new ranks (:mod:`lightning_bpk.runtime._resample`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from lightning_bpk.fabric import _compat
from lightning_bpk.runtime import loaders as positions
from lightning_bpk.runtime.rng import capture_rng, restore_rng

__all__ = ["ResumableLoader"]

# what a saved state holds (plain data; the tracker's position under "position")
_VERSION = 1


def _data_ranks(loader: Any) -> tuple[int, int]:
    """``(world size, rank)`` of the data: a ``DistributedSampler``'s replicas (the
    data-parallel ranks, which under tensor parallelism are fewer than the processes)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler.num_replicas, sampler.rank
    return 1, 0


class ResumableLoader:
    """Wraps ``loader`` so that its position in the current pass and its RNG states are part
    of ``state_dict()`` (see the module docstring). Iterate it instead of ``loader``; every other
    attribute (``batch_size``, ``dataset``, ``sampler`` ...) is ``loader``'s.

    Raises ``TypeError`` for a loader that cannot be positioned: one that is neither a
    ``DataLoader`` nor has ``state_dict``/``load_state_dict``.

    >>> import torch
    >>> loader = ResumableLoader(DataLoader(list(range(6)), batch_size=2, shuffle=True))
    >>> first = iter(loader); _ = next(first)
    >>> state = loader.state_dict()                   # one batch of the pass consumed
    >>> rest = [b.tolist() for b in first]
    >>> again = ResumableLoader(DataLoader(list(range(6)), batch_size=2, shuffle=True))
    >>> again.load_state_dict(state)
    >>> [b.tolist() for b in again] == rest
    True
    """

    def __init__(self, loader: Any) -> None:
        inner = _compat.inner_loader(loader)
        kind = positions.loader_kind(inner)
        if kind == positions.REPLAY and not isinstance(inner, DataLoader):
            raise TypeError(
                f"ResumableLoader cannot position a {type(inner).__name__}: give it a "
                "torch.utils.data.DataLoader or a loader with state_dict/load_state_dict"
            )
        self.loader = loader
        self._inner = inner
        self._group = positions.LoaderGroup(None, *_data_ranks(inner))
        self._tracker = positions.track(inner, None, None, self._group)
        self._passes = 0  # passes begun (iterators created), as Fabric's wrapper counts them
        self._consumed = 0  # batches handed out in the current pass
        self._in_pass = False
        self._skip = 0  # batches of a resumed pass consumed before the save
        self._rng_at_first_batch: dict | None = None
        self._tail = False  # restored at the end of a pass through the loader's own state
        if kind == positions.REPLAY:
            warnings.warn(positions.replay_message(inner), stacklevel=2)

    @property
    def epoch(self) -> int:
        """The index of the current pass (0 for the first), or of the next one between passes:
        what Fabric gives a ``DistributedSampler`` as its epoch."""
        return self._passes - 1 if self._in_pass else self._passes

    @property
    def kind(self) -> str:
        """How the position is kept: ``"sampler"``, ``"stateful"`` or ``"replay"``."""
        return self._tracker.kind

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __iter__(self) -> Iterator[Any]:
        self._consumed, self._skip = self._skip, 0
        self._passes += 1
        self._in_pass = True
        rng, self._rng_at_first_batch = self._rng_at_first_batch, None
        # A stateful loader restored from the end of a pass may first finish that pass, with
        # nothing left in it (torchdata's does; litdata's starts the next one): then the pass
        # this iteration stands for is the loader's next one.
        tail, self._tail = self._tail, False
        for _ in range(2 if tail else 1):
            for batch in self.loader:
                # a resumed stateful loader drew its seeds creating its iterator
                if rng is not None:
                    restore_rng(rng)
                    rng = None
                self._consumed += 1
                yield batch
            if self._consumed:
                break
        self._in_pass = False
        self._consumed = 0

    # -- the checkpoint ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches handed out so far in the current pass (its end once
        all are out), the pass counter and the RNG states now: plain data (tensors, ints)."""
        done = not self._in_pass or self._consumed >= positions.loader_length(self.loader)
        epoch = self._passes if done else self._passes - 1
        state = {
            "version": _VERSION,
            "position": self._tracker.capture(0 if done else self._consumed, done),
            "epoch": epoch,
            "world_size": self._group.world_size,
            "rng": capture_rng(),
        }
        if done and self.kind == positions.STATEFUL:
            # A loader may count its passes in its own state (litdata's next shuffle depends
            # on it), so it travels at the end of a pass too.
            state["loader_state"] = self._inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) at the next pass: the rest of the saved
        pass, or the pass after it when it was saved at its end."""
        try:
            position, epoch, rng = state["position"], int(state["epoch"]), state["rng"]
            saved_world_size = state.get("world_size")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a ResumableLoader state (no {e}): {sorted(state)}") from None
        if position.get("kind") != self.kind:
            raise ValueError(
                f"the saved position is of a {position.get('kind')!r} loader, this loader is "
                f"positioned as {self.kind!r} ({type(self._inner).__name__})"
            )
        epoch_end = bool(position["epoch_end"])
        if not epoch_end:
            where = f"pass {epoch} of the data (batch {position['batches']})"
            position = positions.continuation(
                self._tracker, position, self._group.world_size, saved_world_size, where
            )
        self._group.restart(rng if epoch_end else None)
        self._tracker.resume(position, rng)
        if self.kind == positions.STATEFUL and not epoch_end:
            self._rng_at_first_batch = rng
        if epoch_end and "loader_state" in state:
            self._inner.load_state_dict(state["loader_state"])
            self._tail = True
        plan = position.get("resample")
        self._skip = 0 if epoch_end else int((plan or position)["batches"])
        self._passes = epoch
        self._in_pass = False
        _compat.set_passes(self.loader, epoch)
        message = positions.workers_warning(self._inner, self.kind, position)
        if message is not None:
            warnings.warn(message, stacklevel=2)
