"""Loading a checkpoint outside ``fit``: for inference, evaluation or fine-tuning.

One call loads a checkpoint directory of the callback (``…/checkpoints/ckpt.N``, a path or a
URL) or a file of ``BurnpackCheckpointIO`` into a ``LightningModule``::

    from lightning_bpk.lightning.loading import load_module

    model = load_module("runs/a/checkpoints/ckpt.7", MyModel)        # built from its hparams
    model = load_module("s3://bucket/run/ckpt.7", MyModel, lr=1e-4)  # one hparam changed
    with torch.device("meta"):                                       # no memory for the init
        empty = MyModel(hidden=4096)
    model = load_module("runs/a/checkpoints/ckpt.7", empty)          # materialised on the CPU

Given a class, it is built the way ``LightningModule.load_from_checkpoint`` builds it (the saved
hyper-parameters, keyword arguments overriding them; a hyper-parameter the pickle-free format
could not store was named by a warning at save time and must be passed here), its
``on_load_checkpoint`` hook runs, and the weights are loaded strictly. Given an instance, that
instance is loaded (its own hyper-parameters stay): every tensor of it that is on the ``meta``
device is replaced by the checkpoint's (as ``load_state_dict(assign=True)`` does), so a model
built on ``meta`` comes back whole; one the checkpoint does not hold is an error, never a tensor
left on ``meta`` (:meth:`~lightning_bpk.records.ModuleRecord.apply`). Nothing is unpickled.

``MyModel.load_from_checkpoint("…/ckpt.N")`` works too once this module is imported (the
callback imports it): Lightning's reader is routed to this package's for its checkpoint
directories, everything else stays Lightning's (:func:`route_load_from_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import lightning.pytorch as pl

from lightning_bpk.lightning import _compat, trainer_state
from lightning_bpk.records import ModuleRecord

__all__ = ["load_module", "route_load_from_checkpoint"]

M = TypeVar("M", bound=pl.LightningModule)


def load_module(
    checkpoint: str | os.PathLike[str],
    model: type[M] | M,
    *,
    strict: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    **hparams: Any,
) -> M:
    """Load ``checkpoint`` (a ``ckpt.N`` directory or a single-file checkpoint; a path or URL,
    ``storage_options`` for fsspec) into ``model``, a ``LightningModule`` class (built from the
    saved hyper-parameters, ``hparams`` overriding them) or instance (tensors on ``meta``
    materialised; ``hparams`` then refused), and return it. ``strict=False`` lets missing and
    unexpected tensors pass, as ``load_state_dict(strict=False)`` does (a missing one on
    ``meta`` still fails)."""
    data = trainer_state.load(checkpoint, storage_options)
    if isinstance(model, type):
        if not issubclass(model, pl.LightningModule):
            raise TypeError(f"load_module loads into a LightningModule, not {model.__name__}")
        return _compat.build_module(model, data, strict, hparams)
    if hparams:
        raise TypeError(
            f"hyper-parameters {sorted(hparams)} given with a {type(model).__name__} instance: "
            "an instance keeps its own; pass the class to build it from the checkpoint's"
        )
    model.on_load_checkpoint(data)
    record = ModuleRecord(data["state_dict"])
    record.apply(model, allow_partial=not strict, allow_unused=not strict)
    return model


def route_load_from_checkpoint() -> None:
    """Make ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read this
    package's checkpoint directories with :func:`~lightning_bpk.lightning.trainer_state.load`,
    once per process; every other path goes to Lightning's reader unchanged."""
    _compat.route_checkpoint_reader(_read_ours)


def _read_ours(path: Any) -> dict[str, Any] | None:
    """Lightning's dict for a checkpoint directory of ours, None for anything else."""
    if not isinstance(path, (str, os.PathLike)) or not trainer_state.is_checkpoint_directory(path):
        return None
    return trainer_state.load(path)
