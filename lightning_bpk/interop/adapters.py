"""Burn <-> PyTorch adapters: Burn's names and layouts in the record, torch's in the module.

Burn and torch agree on most layers; where they differ, the difference is fixed by the layer
type, so the adapters decide from the *torch submodule that owns the tensor*, never from a
tensor's shape (a square ``Linear`` weight is transposed like any other):

==============================  =========================  ==================================
torch layer                     torch tensor               Burn tensor
==============================  =========================  ==================================
``nn.Linear`` (and subclasses)  ``weight [out, in]``       ``weight [in, out]``
BatchNorm*, LayerNorm,          ``weight`` / ``bias``      ``gamma`` / ``beta``
GroupNorm, InstanceNorm*
``nn.RMSNorm``                  ``weight``                 ``gamma``
``nn.PReLU``                    ``weight``                 ``alpha``
BatchNorm*                      ``num_batches_tracked``    none: not recorded, not expected
==============================  =========================  ==================================

Running statistics (``running_mean``/``running_var``), convolutions and embeddings have the same
names and layouts in both. Recurrent layers are not translated (Burn's gate layout differs).

Use :class:`BurnToPyTorchAdapter` to load a Burn record into a torch module and
:class:`PyTorchToBurnAdapter` to record a torch module the way Burn would; both implement the
whole mapping, so either one also works for the opposite call.

Example::

    >>> import torch
    >>> from lightning_bpk.records import ModuleRecord
    >>> burn = ModuleRecord({"weight": torch.ones(3, 2), "bias": torch.zeros(2)})  # Burn: [in, out]
    >>> net = burn.apply(torch.nn.Linear(3, 2), adapter=BurnToPyTorchAdapter())
    >>> list(net.weight.shape)
    [2, 3]
    >>> list(ModuleRecord.from_module(net, adapter=PyTorchToBurnAdapter()).tensors["weight"].shape)
    [3, 2]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "BurnToPyTorchAdapter",
    "HalfPrecisionAdapter",
    "PyTorchToBurnAdapter",
]

_NORMS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
)
# torch layer type -> {torch tensor name: Burn tensor name}
_RENAMES: tuple[tuple[tuple[type[nn.Module], ...], dict[str, str]], ...] = (
    (_NORMS, {"weight": "gamma", "bias": "beta"}),
    ((nn.RMSNorm,), {"weight": "gamma"}),
    ((nn.PReLU,), {"weight": "alpha"}),
)
# torch layer type -> tensors Burn stores transposed ([in, out] where torch has [out, in])
_TRANSPOSED: tuple[tuple[type[nn.Module], ...], frozenset[str]] = (
    (nn.Linear,),
    frozenset({"weight"}),
)
# torch layer type -> tensors Burn's equivalent layer does not have
_TORCH_ONLY: tuple[tuple[type[nn.Module], ...], frozenset[str]] = (
    (nn.modules.batchnorm._BatchNorm,),
    frozenset({"num_batches_tracked"}),
)


def _renames(layer: nn.Module | None) -> dict[str, str]:
    for types, table in _RENAMES:
        if isinstance(layer, types):
            return table
    return {}


def _transposed(
    layer: nn.Module | None, leaf: str, name: str, tensor: torch.Tensor
) -> torch.Tensor:
    types, leaves = _TRANSPOSED
    if not (isinstance(layer, types) and leaf in leaves):
        return tensor
    if tensor.dim() != 2:
        raise ValueError(f"'{name}': a Linear weight must be 2-d, got shape {list(tensor.shape)}")
    return tensor.t()


class _BurnLayout:
    """The whole torch <-> Burn mapping; the record side always has Burn's names and layout."""

    def from_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor] | None:
        """torch name/tensor -> Burn's, or ``None`` for a tensor Burn's layer does not have."""
        prefix, dot, leaf = name.rpartition(".")
        types, torch_only = _TORCH_ONLY
        if isinstance(layer, types) and leaf in torch_only:
            return None
        tensor = _transposed(layer, leaf, name, tensor)
        return prefix + dot + _renames(layer).get(leaf, leaf), tensor

    def to_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor]:
        """Burn name/tensor -> torch's."""
        prefix, dot, leaf = name.rpartition(".")
        inverse = {burn: torch_name for torch_name, burn in _renames(layer).items()}
        leaf = inverse.get(leaf, leaf)
        return prefix + dot + leaf, _transposed(layer, leaf, name, tensor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BurnToPyTorchAdapter(_BurnLayout):
    """Load a Burn record into a torch module: ``record.apply(module, adapter=...)``."""


class PyTorchToBurnAdapter(_BurnLayout):
    """Record a torch module in Burn's layout: ``ModuleRecord.from_module(module, adapter=...)``."""


class HalfPrecisionAdapter:
    """Burn's ``HalfPrecisionAdapter``: float32 tensors are recorded as float16 (half the
    bytes), and float16 ones loaded back as float32; other dtypes pass unchanged. ``inner``, an
    adapter it wraps (e.g. :class:`PyTorchToBurnAdapter`), maps names and layouts first on save
    and last on load.

    >>> import torch
    >>> from lightning_bpk.records import ModuleRecord
    >>> record = ModuleRecord.from_module(torch.nn.Linear(2, 2), adapter=HalfPrecisionAdapter())
    >>> record.tensors["weight"].dtype
    torch.float16
    >>> record.apply(torch.nn.Linear(2, 2), adapter=HalfPrecisionAdapter()).weight.dtype
    torch.float32
    """

    def __init__(self, inner: Any = None, *, half: torch.dtype = torch.float16) -> None:
        self.inner = inner
        self.half = half

    def from_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor] | None:
        """torch name/tensor -> the record's, float32 halved."""
        mapped = (
            (name, tensor) if self.inner is None else self.inner.from_module(name, tensor, layer)
        )
        if mapped is None:
            return None
        name, tensor = mapped
        return name, tensor.to(self.half) if tensor.dtype == torch.float32 else tensor

    def to_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor]:
        """Record name/tensor -> the module's, half precision back to float32."""
        if tensor.dtype == self.half:
            tensor = tensor.to(torch.float32)
        return (name, tensor) if self.inner is None else self.inner.to_module(name, tensor, layer)

    def __repr__(self) -> str:
        return f"HalfPrecisionAdapter({self.inner!r}, half={self.half})"
