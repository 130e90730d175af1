"""lightning_bpk._device: the copies between host and device, on the paths a CPU-only machine
takes (the CUDA paths are pinned by tests/test_gpu.py where a GPU exists)."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_bpk import _device

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def _sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape) + len(str(dtype)))
    values = torch.randint(0, 200, shape, generator=generator)
    return values.to(dtype)


def test_capability_follows_the_device_and_cuda_availability() -> None:
    assert not _device.accelerated(torch.device("cpu"))
    assert not _device.accelerated(torch.device("meta"))
    assert _device.accelerated(torch.device("cuda", 0)) == torch.cuda.is_available()


def test_host_buffer_is_pinned_only_when_asked() -> None:
    buffer = _device.host_buffer(100, pinned=False)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 100 and not buffer.is_pinned()


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_to_host_copies_host_tensors_and_waits_on_nothing(dtype: torch.dtype) -> None:
    copies = _device.DeviceToHost()
    source = _sample((6, 5), dtype)
    strided = source.t()  # not contiguous: copied all the same
    into = torch.empty(5, 6, dtype=dtype)
    copies.copy(into, strided)
    ready = copies.settle()
    assert ready._events == []  # a host copy is complete when issued
    ready.wait()
    assert torch.equal(into, strided)


def test_ready_waits_for_every_event() -> None:
    released = threading.Event()
    waited: list[str] = []

    class Gate:  # stands for a CUDA event: synchronize() blocks until the copy has landed
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            assert released.wait(60)
            waited.append(self.name)

    ready = _device.Ready([Gate("a"), Gate("b")])
    thread = threading.Thread(target=ready.wait)
    thread.start()
    assert waited == []
    released.set()
    thread.join(60)
    assert waited == ["a", "b"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_host_to_device_copies_through_bounce_buffers_chunk_by_chunk(
    dtype: torch.dtype, chunk: int
) -> None:
    sources = [_sample((13, 11), dtype), _sample((), dtype), _sample((0, 4), dtype)]
    sources.append(_sample((8, 3), dtype).t())  # a non-contiguous source
    targets = [torch.zeros(s.shape, dtype=dtype) for s in sources]
    with _device.HostToDevice(torch.device("cpu"), chunk=chunk) as copier:
        for target, source in zip(targets, sources, strict=True):
            copier.copy(target, source)
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)


def test_upload_fills_every_target() -> None:
    sources = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 3, dtype=torch.bfloat16)]
    targets = [torch.empty_like(s) for s in sources]
    _device.upload(zip(targets, sources, strict=True))
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_target_device_accepts_cpu_and_refuses_what_cannot_hold_data() -> None:
    assert _device.target_device("cpu") == torch.device("cpu")
    assert _device.target_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="'meta': it holds no data"):
        _device.target_device(torch.device("meta"))
    with pytest.raises(ValueError, match="'no-such-device'"):
        _device.target_device("no-such-device")
    with pytest.raises(ValueError, match=r"'xpu'.*'cpu' or a CUDA device"):
        _device.target_device("xpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without CUDA")
def test_target_device_refuses_cuda_where_there_is_none() -> None:
    with pytest.raises(ValueError, match="'cuda:0': CUDA is not available"):
        _device.target_device("cuda:0")


def test_to_device_on_cpu_keeps_the_data_and_its_sharing() -> None:
    shared = torch.ones(4)
    value = {"a": shared, "b": [shared, 1, ("x", torch.zeros(2))]}
    assert _device.to_device(value, "cpu") is value
    with pytest.raises(ValueError, match="'meta'"):
        _device.to_device(value, "meta")


def test_moved_copies_every_tensor_once_and_keeps_the_structure() -> None:
    shared = torch.arange(6.0)
    value = {"a": shared, "b": [shared, 1, ("x", torch.zeros(2, dtype=torch.int64))]}
    moved = _device._moved(value, torch.device("cpu"))  # the CUDA path's copy, into host tensors
    assert moved["a"] is not shared and moved["b"][0] is moved["a"]
    assert torch.equal(moved["a"], shared) and moved["b"][1] == 1
    assert moved["b"][2][0] == "x" and torch.equal(
        moved["b"][2][1], torch.zeros(2, dtype=torch.int64)
    )
