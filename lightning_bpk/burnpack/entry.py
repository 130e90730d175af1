"""A tensor to write (:class:`TensorEntry`) and the raw bytes of a tensor, zero-copy where it
lies on the CPU: what the writer streams and the reader and in-place loader view."""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_bpk.burnpack.base import _TORCH_TO_BURN, DType, _carrier

__all__ = ["BytesLike", "TensorEntry", "tensor_bytes"]


BytesLike = bytes | bytearray | memoryview
"""What :func:`~lightning_bpk.burnpack.loads` reads and a :class:`TensorEntry` may hold: any
contiguous byte buffer, used without a copy."""


class TensorEntry:
    """A tensor to write: Burn dtype, shape, bytes (or a provider of them) and an optional param id.

    ``data`` is a bytes-like object, a ``torch.Tensor`` or a zero-argument callable returning
    either (a *deferred* tensor, called exactly once while writing; ``nbytes`` is then required).
    ``torch_dtype`` names the torch dtype of a tensor Burn has no dtype for, stored as ``dtype``
    (the same bytes; a complex one with a trailing dimension of 2): :meth:`from_tensor` sets both.
    ``digest``: the xxh3-64 hex digest of the bytes, when whoever made them hashed them as they
    were made (a staged copy, hashed chunk by chunk while each chunk is in cache), or a
    zero-argument callable asked for it once the bytes are written (None: not known). The
    writer records it as the tensor's checksum without reading the bytes a second time: it is
    trusted, so a wrong one makes every verified read of the tensor fail.

    >>> TensorEntry("F32", [2], b"\\x00" * 8, param_id=7).nbytes
    8
    >>> e = TensorEntry.from_tensor(torch.zeros(3, dtype=torch.complex64))
    >>> e.dtype, e.shape, e.torch_dtype
    ('F32', (3, 2), 'complex64')
    """

    __slots__ = ("data", "digest", "dtype", "nbytes", "param_id", "shape", "torch_dtype")

    def __init__(
        self,
        dtype: DType,
        shape: Iterable[int],
        data: BytesLike | torch.Tensor | Callable[[], BytesLike | torch.Tensor],
        param_id: int | None = None,
        nbytes: int | None = None,
        torch_dtype: str | None = None,
        digest: str | Callable[[], str | None] | None = None,
    ) -> None:
        self.dtype = dtype
        self.torch_dtype = torch_dtype
        self.digest = digest
        self.shape = tuple(operator.index(d) for d in shape)  # 2.5 is an error, not 2
        self.data = data
        self.param_id = param_id
        if nbytes is None:
            if callable(data) and not isinstance(data, torch.Tensor):
                raise ValueError("a deferred TensorEntry needs nbytes")
            nbytes = _nbytes_of(data)
        self.nbytes = int(nbytes)

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        param_id: int | None = None,
        digest: str | Callable[[], str | None] | None = None,
    ) -> TensorEntry:
        """Describe a torch tensor; its bytes are taken zero-copy when it is contiguous on CPU.
        A dtype Burn has none for (fp8, fp4, complex) is stored in one of the same bytes and
        named in the descriptor (key ``torch_dtype``)."""
        dtype, torch_name = _carrier(tensor.dtype)
        shape = (*tensor.shape, 2) if tensor.dtype.is_complex else tuple(tensor.shape)
        return cls(
            dtype,
            shape,
            tensor,
            param_id=param_id,
            nbytes=tensor.numel() * tensor.element_size(),
            torch_dtype=torch_name,
            digest=digest,
        )


def _nbytes_of(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


# dtypes numpy can view directly (not bfloat16); the others are reinterpreted as uint8 first.
_NUMPY_DTYPES = frozenset(
    d for d in _TORCH_TO_BURN if d not in (torch.bfloat16, torch.uint16, torch.uint32, torch.uint64)
)


# Tensor classes whose bytes are their storage's at data_ptr() (a subclass such as DTensor may
# hold them elsewhere).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous on CPU."""
    if (
        type(tensor) in _PLAIN_TENSORS
        and tensor.is_cpu
        and tensor.layout is torch.strided
        and tensor.dtype in _TORCH_TO_BURN
        and tensor.is_contiguous()
    ):
        # The storage's bytes as they lie: 2 us a tensor where numpy's view took 6 (5,000
        # tensors are written and read in tens of milliseconds, so it counts).
        size = tensor.nbytes
        if not size:
            return memoryview(b"")
        array = (ctypes.c_char * size).from_address(tensor.data_ptr())
        array._tensor = tensor  # type: ignore[attr-defined]  # the view keeps the tensor alive
        return memoryview(array).cast("B")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # ndarray has the buffer protocol; numpy's stubs declare it for Python 3.12+ only
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _as_bytes(data: Any) -> memoryview:
    if isinstance(data, torch.Tensor):
        return tensor_bytes(data)
    return memoryview(data).cast("B")
