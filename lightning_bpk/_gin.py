"""gin registration of the package's configurables, usable right after ``import lightning_bpk``.

Dopamine-style configs bind parameters before anything is built::

    import gin, lightning_bpk
    gin.parse_config("get_latest_checkpoint_number.override_number = 2")

gin only knows a configurable once the module defining it has run, and those modules import torch
and Lightning, which ``import lightning_bpk`` must not pay for. So the package registers a
stand-in under each real selector (:data:`CONFIGURABLES`). The first time gin needs a stand-in's
parameters (to check a binding) or calls it, the defining module is imported; its registration
replaces the stand-in under the same selector, and since gin keeps bindings by selector they
apply to the real configurable unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import gin

T = TypeVar("T")

# gin selector -> the module that defines it (the attribute is the selector's last part).
CONFIGURABLES = {
    "lightning_bpk.BurnpackCheckpoint": "lightning_bpk.lightning.callback",
    "lightning_bpk.checkpointer.Checkpointer": "lightning_bpk.checkpointer",
    "lightning_bpk.checkpointer.get_latest_checkpoint_number": "lightning_bpk.checkpointer",
    "lightning_bpk.fabric.CheckpointManager": "lightning_bpk.fabric.manager",
}


def configurable(module: str) -> Callable[[T], T]:
    """``gin.configurable(module=module)``, replacing a stand-in and tolerant of re-execution.

    A fixed selector means running a file as ``__main__`` or from a second import path does not
    create an ambiguous second configurable. gin refuses to register a selector twice outside
    interactive mode (a stand-in, or a module re-executed by ``importlib.reload``), so the newer
    definition replaces the older one there.
    """

    def register(fn_or_cls: T) -> T:
        try:
            return gin.configurable(fn_or_cls, module=module)
        except ValueError:
            with gin.config.interactive_mode():
                return gin.configurable(fn_or_cls, module=module)

    return register


class _StandIn:
    """Registered in place of a configurable until its module is imported (see module doc)."""

    def __init__(self, module: str, name: str) -> None:
        self._module = module
        self.__name__ = name

    def _real(self) -> Any:
        return getattr(importlib.import_module(self._module), self.__name__)

    @property
    def __wrapped__(self) -> Any:
        # gin follows __wrapped__ to read a configurable's parameters; a class's are its
        # __init__'s.
        real = self._real()
        return cast(Any, real).__init__ if isinstance(real, type) else real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)


def register_stand_ins(configurables: Mapping[str, str] = CONFIGURABLES) -> None:
    """Register a stand-in for every configurable (selector -> defining module) not registered
    yet (idempotent)."""
    for selector, source in configurables.items():
        try:
            gin.get_configurable(selector)
        except ValueError:  # "Could not find ... in the Gin registry"
            module, _, name = selector.rpartition(".")
            gin.configurable(_StandIn(source, name), module=module)
