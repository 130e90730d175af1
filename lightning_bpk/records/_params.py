"""How a loaded tensor lands in a module: in place, with the record's parameter id.

Shared by :class:`~lightning_bpk.records.ModuleRecord` and the interop loaders (remapped and
sharded loads), which fill modules tensor by tensor; not part of the public surface.
"""

from __future__ import annotations

import torch
from torch import nn

# Attribute on an nn.Parameter holding the u64 id it was loaded with.
_PARAM_ID_ATTR = "_lightning_bpk_param_id"


def owning_module(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule at the prefix of a dotted tensor name, or None when there is none: the
    ``layer`` an adapter is given for ``name`` (``module`` itself for a top-level name).

    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1))
    >>> owning_module(net, "0.weight") is net[0], owning_module(net, "9.weight")
    (True, None)
    """
    prefix = name.rpartition(".")[0]
    try:
        return module.get_submodule(prefix)
    except AttributeError:
        return None


def set_param_id(tensor: torch.Tensor, pid: int) -> None:
    """Give ``tensor`` (a module's parameter or buffer) the record id ``pid`` it was loaded
    with, so that a record made of its module later writes it back under that id."""
    setattr(tensor, _PARAM_ID_ATTR, pid)


def load_tensor(target: torch.Tensor, tensor: torch.Tensor, pid: int | None, cast: bool) -> None:
    """Load ``tensor`` into the module tensor ``target`` in place, as ``ModuleRecord.apply``
    does (shapes already checked): one copy (none where ``tensor`` is ``target``, which a
    loader built in place), casting to ``target``'s dtype when ``cast``, else
    ``target`` takes ``tensor``'s dtype (it stays the same object, so optimizers still hold it);
    then ``target`` takes the record's ``pid`` (:func:`set_param_id`), if any."""
    with torch.no_grad():
        _load(target, tensor, pid, cast)


def _load(target: torch.Tensor, tensor: torch.Tensor, pid: int | None, cast: bool) -> None:
    """:func:`load_tensor` inside ``torch.no_grad()`` (entered once for a whole module: per
    tensor it cost more than the copy of a small one)."""
    if tensor is target:
        pass  # already there: a loader built it in place
    elif cast or tensor.dtype == target.dtype:
        target.copy_(tensor)  # the one copy out of the record, casting if needed
    else:
        target.data = tensor.to(device=target.device, copy=True)
    if pid is not None:
        set_param_id(target, pid)
