"""Tied tensors (one tensor under two names, ``lm_head.weight`` and the input embedding):
which ties a module declares, and untying those a file stores twice with different values, as
transformers does, so neither value is dropped. Shared by ``apply_remapped`` and the loaders."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

__all__ = ["Untied", "retie", "tied_weights", "untie_stored", "untied_while"]


def tied_weights(module: nn.Module) -> dict[str, str]:
    """The module's tie declarations, ``{tied name: the name it shares}``, as transformers
    declares them (``get_expanded_tied_weights_keys``, which honours the config's
    ``tie_word_embeddings``), kept only where the module really shares the tensor; ``{}`` for
    a module that declares none. Only these may be absent from a file in a strict load."""
    expand = getattr(module, "get_expanded_tied_weights_keys", None)
    declared = expand(all_submodels=True) if callable(expand) else {}
    if not isinstance(declared, Mapping):
        return {}
    state = module.state_dict(keep_vars=True)
    return {
        t: s
        for t, s in declared.items()
        if isinstance(t, str)
        and isinstance(s, str)
        and t in state
        and s in state
        and state[t] is state[s]
    }


@dataclass
class Untied:
    """A tied tensor given a parameter of its own for a load: ``owner.attr`` held ``shared``."""

    name: str
    tie: str
    owner: nn.Module
    attr: str
    shared: nn.Parameter


def untie_stored(
    module: nn.Module, stored: Collection[str], ties: Mapping[str, str]
) -> list[Untied]:
    """Give each tied tensor of ``ties`` (``{tied name: the name it shares}``) that ``stored``
    (the names a load will set) holds under both names a parameter of its own, a copy, so each
    name loads its own value; :func:`retie` ties back those that turn out equal."""
    state = module.state_dict(keep_vars=True)
    untied = []
    for name, tie in ties.items():
        shared = state.get(name)
        if name not in stored or tie not in stored or shared is not state.get(tie):
            continue
        prefix, _, attr = name.rpartition(".")
        owner = module.get_submodule(prefix)
        if not isinstance(shared, nn.Parameter) or getattr(owner, attr, None) is not shared:
            continue  # a buffer, or a parameter not held as an attribute: left tied
        param = cast(nn.Parameter, shared)  # Parameter's metaclass defeats narrowing
        own = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
        setattr(owner, attr, own)
        untied.append(Untied(name, tie, owner, attr, param))
    return untied


def retie(untied: list[Untied], where: object) -> list[str]:
    """After the load: tie back each of ``untied`` whose value equals its tie's; the others stay
    untied, as transformers leaves a checkpoint's different ``lm_head.weight``, with a warning
    naming them and ``where`` (the file). Returns the names left untied."""
    kept = []
    for u in untied:
        own = getattr(u.owner, u.attr)
        if own.shape == u.shared.shape and torch.equal(own.detach(), u.shared.detach()):
            setattr(u.owner, u.attr, u.shared)
        else:
            kept.append(u.name)
    if kept:
        pairs = ", ".join(f"{u.name!r} (tied to {u.tie!r})" for u in untied if u.name in kept)
        warnings.warn(
            f"{where}: the file holds different values for {pairs}: untied, each loaded "
            "with its own, as transformers does",
            stacklevel=3,
        )
    return kept


@contextmanager
def untied_while(
    module: nn.Module, stored: Collection[str], ties: Mapping[str, str], where: object
) -> Iterator[list[Untied]]:
    """:func:`untie_stored` for the block (a load), then :func:`retie`, even when it fails."""
    untied = untie_stored(module, stored, ties)
    try:
        yield untied
    finally:
        retie(untied, where)
