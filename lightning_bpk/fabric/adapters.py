"""Adapter fine-tuning (LoRA and other parameter-efficient methods) with Fabric: the frozen base
loads from a weights file, a checkpoint holds only what training changes.

A fine-tune resumes exactly from the trainable parameters, their optimizer state and the loop's
own state (step, data position, RNG states): the frozen base is the same file every time, so
saving it again each step costs disk and time for nothing. litgpt's LoRA saves the adapter
weights alone, without optimizer state, and cannot resume::

    model = GPT(config)                                   # with LoRA layers: lora_A, lora_B
    load_raw("base/model.safetensors", model, strict=False)   # the base (lora_* absent)
    for name, p in model.named_parameters():              # only the adapter trains
        p.requires_grad = "lora_" in name
    optimizer = torch.optim.AdamW(trainable_parameters(model))
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    manager.restore(state)                                # the adapter, its moments, the rest
    ...
    manager.save_if_due(step, state, filter={"model": trainable(model)})

:func:`trainable` is the ``filter`` that keeps a module's trainable tensors; the checkpoint's
model record then holds those alone (plus the Adam moments of the same parameters in the
optimizer record), and :meth:`~lightning_bpk.fabric.CheckpointManager.restore` loads them over
the base, leaving the frozen tensors as :func:`load_raw` loaded them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bpk.fabric import _compat

__all__ = ["load_raw", "trainable", "trainable_parameters"]


def load_raw(path: str | os.PathLike[str], module: Any, strict: bool = True) -> None:
    """Load a plain weights file into ``module`` in place, as ``fabric.load_raw`` does for a
    ``torch.save`` file: a ``.bpk`` (Burn's or this package's), a ``.safetensors``, a checkpoint
    set (an index or its directory), local or at a URL; nothing is unpickled.

    ``strict=False`` lets the module have tensors the file lacks (an adapter's) and the file
    have tensors the module lacks; checked before anything changes
    (:class:`~lightning_bpk.records.RecordError` listing every problem). A module set up for
    FSDP2 / tensor parallelism reads only its own shards' bytes on each rank.
    """
    from lightning_bpk.interop import load_into_shards, load_remapped

    module = _compat.unwrap(module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_raw loads into a module, not a {type(module).__name__}")
    if any(isinstance(p, DTensor) for p in module.parameters()):
        load_into_shards(path, module, allow_partial=not strict, allow_unused=not strict)
    else:
        load_remapped(path, module, allow_partial=not strict, allow_unused=not strict)


def trainable(module: Any) -> Callable[[str, Any], bool]:
    """The ``filter`` that keeps a module's trainable parameters (``requires_grad``) when it is
    saved: ``manager.save(step, state, filter={"model": trainable(model)})``. Decided when
    called, from the parameters' names (as ``state_dict`` names them)."""
    module = _compat.unwrap(module)
    names = {name for name, p in module.named_parameters() if p.requires_grad}

    def keep(name: str, value: Any) -> bool:
        del value
        return name in names

    return keep


def trainable_parameters(module: Any) -> Iterator[nn.Parameter]:
    """The parameters of ``module`` that train (``requires_grad``), for the optimizer."""
    return (p for p in _compat.unwrap(module).parameters() if p.requires_grad)
