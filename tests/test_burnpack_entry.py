"""A tensor to write (burnpack.entry): an entry's shape and deferred size, and a tensor's bytes
taken zero-copy from its storage."""

from __future__ import annotations

import gc

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import TensorEntry

from _burnpack_helpers import _ALL_DTYPES


def test_entry_shape_must_be_integers():
    with pytest.raises(TypeError):
        TensorEntry("F32", [2.5], b"\0" * 8)
    with pytest.raises(ValueError, match="nbytes"):
        TensorEntry("F32", [2], lambda: b"")


def test_tensor_bytes_are_the_storage_and_keep_the_tensor_alive():
    for dtype in _ALL_DTYPES:
        t = torch.arange(6).to(dtype)
        view = burnpack.tensor_bytes(t)
        assert bytes(view) == t.view(torch.uint8).numpy().tobytes() and view.nbytes == t.nbytes
    view = burnpack.tensor_bytes(torch.arange(1000.0))
    gc.collect()  # the tensor has no other reference
    assert torch.frombuffer(bytearray(view), dtype=torch.float32).tolist() == list(range(1000))
    param = torch.nn.Parameter(torch.ones(3))
    assert bytes(burnpack.tensor_bytes(param)) == bytes(burnpack.tensor_bytes(param.detach()))
    strided = torch.arange(12.0).reshape(3, 4).t()  # copied into a contiguous tensor
    assert bytes(burnpack.tensor_bytes(strided)) == strided.contiguous().numpy().tobytes()
