"""Every touch of Fabric's private API, fenced in one module (as ``lightning/_compat.py`` does
for the Trainer's): the objects behind Fabric's wrappers, the pass counter of its data loader
wrapper, and the cluster environment of its strategy."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.wrappers import (
    _FabricDataLoader,
    _FabricModule,
    _FabricOptimizer,
    _unwrap_compiled,
)


def unwrap(obj: Any) -> Any:
    """The user's own module or optimizer behind ``fabric.setup`` (and ``torch.compile``):
    the module whose ``state_dict`` has no ``module.`` prefix under DDP, the optimizer whose
    parameters are the module's. Anything else comes back as it is."""
    obj = _unwrap_compiled(obj)[0]
    if isinstance(obj, _FabricModule):
        return _unwrap_compiled(obj._original_module)[0]
    if isinstance(obj, _FabricOptimizer):
        return obj.optimizer
    return obj


def inner_loader(loader: Any) -> Any:
    """The DataLoader behind ``fabric.setup_dataloaders``' wrapper (else ``loader`` itself)."""
    return loader._dataloader if isinstance(loader, _FabricDataLoader) else loader


def set_passes(loader: Any, passes: int) -> None:
    """Make Fabric's wrapper count ``passes`` passes begun: it gives a ``DistributedSampler``
    that number as its epoch (``set_epoch``) when the next pass begins."""
    if isinstance(loader, _FabricDataLoader):
        loader._num_iter_calls = passes


def cluster_environment(strategy: Any) -> ClusterEnvironment | None:
    """The cluster environment a Fabric strategy runs in (None: a single-device strategy)."""
    environment = getattr(strategy, "cluster_environment", None)
    return environment if isinstance(environment, ClusterEnvironment) else None
