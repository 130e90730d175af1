"""The rest of an epoch in samples, for a resume on another batch size or number of ranks.

A mid-epoch checkpoint of a plain DataLoader records which order its sampler drew (an order
descriptor: a ``RandomSampler``'s RNG states, a ``DistributedSampler``'s seed and epoch, or a
``SequentialSampler``) and how many samples of that order the ranks consumed together. Resumed
with another ``batch_size`` or world size, the samples not yet consumed are split over the new
ranks exactly as a ``DistributedSampler`` splits an order (padded by repeating its first ones
unless ``drop_last``) and batched with the new batch size, so no sample of the epoch is seen
twice or lost (except the repeats a ``DistributedSampler`` pads with, as in any epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from lightning_bpk.errors import CheckpointResumeError
from lightning_bpk.runtime.rng import restore_rng


def geometry(batch_sampler: Any, world_size: int, resampled: dict | None) -> dict[str, Any]:
    """What a mid-epoch position of a DataLoader with this (unwrapped) batch sampler depends on:
    its batch size, the world size, the order descriptor, and, in an epoch that was itself
    continued in samples (``resampled``: that plan), the plan's order and sample offset."""
    if type(batch_sampler) is not BatchSampler:  # a custom batch sampler: batches, not samples
        return {"batch_size": None, "world_size": world_size, "order": None}
    shape = {"batch_size": batch_sampler.batch_size, "world_size": world_size}
    if resampled is not None:
        return dict(shape, order=resampled["order"], offset=resampled["offset"])
    return dict(shape, order=_order_descriptor(batch_sampler.sampler), offset=0)


def replan(
    pending: dict[str, Any], batch_sampler: Any, world_size: int, where: str
) -> dict[str, Any] | None:
    """The plan for continuing a saved mid-epoch position in samples, or None when the batches
    continue as they are (the same batch size and world size, an order of the loader's own).
    Raises :class:`CheckpointResumeError` where it cannot continue without a sample repeated
    or lost; ``where`` names the checkpoint and epoch for the message."""
    saved = pending.get("geometry") or {}
    now = geometry(batch_sampler, world_size, None)
    changed = [
        (setting, saved.get(key), now[key])
        for setting, key in (("batch_size", "batch_size"), ("world size", "world_size"))
        if saved.get(key) is not None and saved.get(key) != now[key]
    ]
    if not changed and not saved.get("offset"):
        return None
    if saved.get("order") is None or now["batch_size"] is None:
        settings = "; ".join(f"{name} was {old}, is now {new}" for name, old, new in changed)
        raise CheckpointResumeError(
            f"cannot continue {where} in the middle: {settings}, and the training data's "
            f"sampler ({type(getattr(batch_sampler, 'sampler', batch_sampler)).__name__} in "
            f"{type(batch_sampler).__name__}) has no order that can be drawn again on other "
            "ranks or cut into other batches (RandomSampler, SequentialSampler or "
            "DistributedSampler in a BatchSampler can). Resume with the saved setting, or "
            "from an end-of-epoch checkpoint"
        )
    consumed = int(saved["offset"]) + pending["batches"] * saved["batch_size"] * saved["world_size"]
    batches = consumed // (now["batch_size"] * world_size)
    offset = consumed - batches * now["batch_size"] * world_size
    return {"order": saved["order"], "consumed": consumed, "batches": batches, "offset": offset}


def _order_descriptor(sampler: Any) -> dict[str, Any] | None:
    """How to draw ``sampler``'s order of an epoch again on any number of ranks, or None."""
    if type(sampler) is DistributedSampler:
        n = len(sampler.dataset)  # type: ignore[arg-type]
        shuffle, seed, epoch = sampler.shuffle, sampler.seed, sampler.epoch
        return {"kind": "distributed", "n": n, "shuffle": shuffle, "seed": seed, "epoch": epoch}
    if type(sampler) is SequentialSampler:
        return {"kind": "sequential", "n": len(sampler)}
    plain = type(sampler) is RandomSampler and sampler.generator is None
    if plain and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return {"kind": "random", "n": len(sampler.data_source)}
    return None


def saved_order(descriptor: dict[str, Any], start: dict[str, Any]) -> list[int]:
    """The whole order the saved run's sampler drew in the epoch of the save (unpadded).
    ``start`` holds the global RNG states that pass was drawn from (they are set)."""
    n = int(descriptor["n"])
    if descriptor["kind"] == "distributed":
        if not descriptor["shuffle"]:
            return list(range(n))
        generator = torch.Generator()  # as DistributedSampler.__iter__ draws it
        generator.manual_seed(int(descriptor["seed"]) + int(descriptor["epoch"]))
        return torch.randperm(n, generator=generator).tolist()
    if descriptor["kind"] == "sequential":
        return list(range(n))
    restore_rng(start["rng"])  # a RandomSampler seeds itself from these
    return [int(i) for i in RandomSampler(range(n))]


def remaining_for_rank(
    order: list[int], consumed: int, world_size: int, rank: int, drop_last: bool
) -> list[int]:
    """The indices of ``order`` after its first ``consumed``, split over ``world_size`` ranks
    as DistributedSampler splits an order: this ``rank``'s share.

    >>> remaining_for_rank(list(range(10)), 4, 2, 1, drop_last=False)
    [5, 7, 9]
    >>> remaining_for_rank(list(range(9)), 4, 2, 0, drop_last=False)  # padded with 4
    [4, 6, 8]
    """
    rest = order[consumed:]
    if world_size > 1 and rest:
        if drop_last:
            rest = rest[: len(rest) - len(rest) % world_size]
        else:
            padding = -len(rest) % world_size
            rest = rest + (rest * (padding // len(rest) + 1))[:padding]
    return rest[rank::world_size]


def batches(indices: list[int], batch_size: int, drop_last: bool) -> Iterator[list[int]]:
    """``indices`` in batches of ``batch_size`` (the last one short unless ``drop_last``)."""
    for first in range(0, len(indices), batch_size):
        batch = indices[first : first + batch_size]
        if len(batch) == batch_size or not drop_last:
            yield batch


def check_accumulation(saved: int | None, now: int, batches: int, where: str) -> None:
    """A changed ``accumulate_grad_batches`` continues only where the save point (``batches``
    into the epoch) is a boundary of the new accumulation windows, since an optimizer step
    would otherwise come after part of a window; anything else is refused, naming both values.

    >>> check_accumulation(1, 2, 4, "epoch 1 of ckpt.8")  # batch 4: a boundary of windows of 2
    """
    if saved is None or saved == now or batches % now == 0:
        return
    raise CheckpointResumeError(
        f"cannot continue {where} after batch {batches} with accumulate_grad_batches={now}: "
        f"the checkpoint was saved with accumulate_grad_batches={saved}, and batch {batches} "
        f"is not a boundary of windows of {now}, so the next optimizer step would accumulate "
        "only part of one. Resume with the saved value, or from an end-of-epoch checkpoint"
    )


def check_unchanged(settings: dict[str, tuple[Any, Any]], data: str, where: str) -> None:
    """Refuse a mid-epoch resume of training data that counts its position in its own batches
    (``data`` describes it) when one of ``settings`` (name: ``(saved, now)``; a saved None is
    unknown) changed, naming each with both values."""
    changes = [(name, old, new) for name, (old, new) in settings.items() if old not in (None, new)]
    if changes:
        text = "; ".join(f"{name} was {old}, is now {new}" for name, old, new in changes)
        raise CheckpointResumeError(
            f"cannot continue {where} in the middle: {text}, and the training data ({data}) "
            "counts its position in its own batches, not in samples. Resume with the saved "
            "setting, or from an end-of-epoch checkpoint"
        )
