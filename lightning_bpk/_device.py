"""Copies between an accelerator and host memory, off the training stream.

Two directions, each chosen by capability (where the tensor lives and whether CUDA is
available), never by a flag:

- **device to host** (:class:`DeviceToHost`, for snapshots): the host buffers are pinned (the
  caller allocates them once with :func:`host_buffer` and reuses them), the copies are issued
  ``non_blocking`` on one side stream per device that first waits for the device's current
  (training) stream, and :meth:`DeviceToHost.settle` returns a :class:`Ready` the reader waits
  on before touching the buffers. The training stream waits for the copies on the device (no
  host wait): a kernel queued after the save cannot change a tensor before it was copied.
  *Late* copies (``copy(..., late=True)``: parameters and optimizer state, which only the next
  optimizer step changes) go on a second side stream that the training stream does not wait
  for now: they run beside the next forward and backward, and the step waits for them, on the
  device, through :meth:`Ready.order_device` (:mod:`lightning_bpk.runtime.overlap`).
- **host to device** (:class:`HostToDevice`, for loads): host tensors go through two reused
  pinned bounce buffers, so filling one (reading the file's pages) overlaps the transfer of the
  other.

A CPU tensor takes a plain ``copy_`` and nothing waits: the same code runs on CPU-only machines,
where these branches are the ones tested.

>>> buffer = host_buffer(8, pinned=False)
>>> copies = DeviceToHost()
>>> copies.copy(buffer.view(torch.float32), torch.tensor([1.0, 2.0]))
>>> ready = copies.settle(); ready.wait(); buffer.view(torch.float32).tolist()
[1.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_bpk._nested import copy_nested

# Bytes of one host-to-device bounce buffer (two are used in turn).
BOUNCE_BYTES = 64 * 1024 * 1024


def accelerated(device: torch.device) -> bool:
    """True when copies to or from ``device`` go through pinned memory and a side stream: a CUDA
    device on a machine where CUDA is available.

    >>> accelerated(torch.device("cpu")), accelerated(torch.device("meta"))
    (False, False)
    """
    return device.type == "cuda" and torch.cuda.is_available()


def on_accelerator(tensor: torch.Tensor) -> bool:
    """:func:`accelerated` for the device ``tensor`` is on, without building that device
    (~1 us a call, at every tensor of every snapshot).

    >>> on_accelerator(torch.ones(1))
    False
    """
    return tensor.is_cuda and torch.cuda.is_available()


def storage_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts: its storage's, so a view of a tensor (a slice of a
    parameter, a tensor inside a staging buffer) counts as that tensor's memory."""
    return tensor.untyped_storage().data_ptr()


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, for every dtype a file can hold: the
    one-byte dtypes torch has no fill kernel for (fp4 pairs, ``bits8``) are allocated as bytes
    and viewed, since under ``torch.use_deterministic_algorithms(True)`` (Lightning's
    ``deterministic=True``) ``torch.empty`` fills new memory and fails for them.

    >>> empty((0, 2), torch.float4_e2m1fn_x2).shape
    torch.Size([0, 2])
    """
    if dtype.itemsize == 1:
        return torch.empty(tuple(shape), dtype=torch.uint8).view(dtype)
    return torch.empty(tuple(shape), dtype=dtype)


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory as a uint8 tensor, page-locked when ``pinned`` (needed for a
    truly asynchronous copy from or to a device; only possible where CUDA is available)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def target_device(device: str | torch.device) -> torch.device:
    """The device a load without a target module puts its tensors on, checked before anything
    is read: ``cpu``, or a CUDA device that exists here. Anything else is a ``ValueError``
    naming it (a ``meta`` tensor cannot hold loaded data).

    >>> target_device("cpu")
    device(type='cpu')
    >>> target_device("meta")
    Traceback (most recent call last):
    ...
    ValueError: cannot load onto device 'meta': it holds no data; load onto 'cpu' or a CUDA device
    """
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"cannot load onto device {device!r}: {e}") from e
    if found.type == "cpu":
        return found
    if found.type == "meta":
        raise ValueError(
            f"cannot load onto device {str(device)!r}: it holds no data; "
            "load onto 'cpu' or a CUDA device"
        )
    if found.type != "cuda":
        raise ValueError(
            f"cannot load onto device {str(device)!r}: loads go to 'cpu' or a CUDA device"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"cannot load onto device {str(device)!r}: CUDA is not available here")
    index = torch.cuda.current_device() if found.index is None else found.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"cannot load onto device {str(device)!r}: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class Ready:
    """What a reader of staged buffers waits on: the copies' completion events (none for host
    copies, which are complete when issued); ``late``: the events of late copies, per device,
    that the training stream has not waited for yet."""

    def __init__(self, events: Iterable[Any] = (), late: Mapping[torch.device, Any] | None = None):
        self._events = list(events)
        self._late = dict(late or {})

    def wait(self) -> None:
        """Block the calling thread until every copy has landed."""
        for event in (*self._events, *self._late.values()):
            event.synchronize()

    @property
    def late(self) -> bool:
        """True while late copies are not yet ordered before the training stream's work."""
        return bool(self._late)

    def order_device(self) -> None:
        """Make each device's current stream wait for the late copies (on the device, no host
        wait): what an optimizer step queued afterwards cannot change a tensor before it was
        copied."""
        late, self._late = self._late, {}
        for device, event in late.items():
            torch.cuda.current_stream(device).wait_event(event)


class DeviceToHost:
    """The device-to-host copies of snapshots, on one side stream per device (kept across
    snapshots); see the module docstring."""

    def __init__(self) -> None:
        # one side stream per device and kind of copy (late or not), reused
        self._streams: dict[tuple[torch.device, bool], Any] = {}
        # (device, late) copied from since the last settle
        self._open: dict[tuple[torch.device, bool], Any] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, late: bool = False) -> None:
        """Copy ``src`` into the host tensor ``dst``: a plain copy for a host tensor, else a
        ``non_blocking`` one on the device's side stream (``dst`` pinned), complete only once
        the :meth:`settle` that follows has been waited on; ``late``: on the stream the
        training stream waits for only at :meth:`Ready.order_device`."""
        if not on_accelerator(src):
            dst.copy_(src)
            return
        key = (src.device, late)
        stream = self._open.get(key)
        if stream is None:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))  # what training queued
            self._open[key] = stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=dst.is_pinned())
        src.record_stream(stream)  # its memory is not reused before the copy has read it

    def settle(self) -> Ready:
        """End the copies issued since the last call: each device's current stream waits for
        them (on the device: training goes on queueing), and the result waits for them on the
        host."""
        events, late = [], {}
        for (device, held), stream in self._open.items():
            event = torch.cuda.Event()
            event.record(stream)
            if held:
                late[device] = event
            else:
                torch.cuda.current_stream(device).wait_event(event)
                events.append(event)
        self._open.clear()
        return Ready(events, late)


class HostToDevice:
    """Host tensors copied into tensors of one device through reused bounce buffers: pinned and
    asynchronous on a side stream for a CUDA device, a plain chunked copy otherwise.

    >>> target = torch.zeros(5)
    >>> with HostToDevice(target.device, chunk=8) as upload:
    ...     upload.copy(target, torch.arange(5.0))
    >>> target.tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
    """

    def __init__(self, device: torch.device, *, chunk: int = BOUNCE_BYTES) -> None:
        self.device = device
        self._chunk = chunk
        self._fast = accelerated(device)
        self._buffers = [host_buffer(chunk, pinned=self._fast) for _ in range(2)]
        self._events: list[Any] = [None, None]  # the transfer last issued from each buffer
        self._turn = 0
        self._stream: Any = None
        if self._fast:
            self._stream = torch.cuda.Stream(device)
            # targets may have been allocated (or last used) on the current stream
            self._stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (contiguous, on this device) takes the bytes of the host tensor ``src`` (same
        dtype and shape), chunk by chunk."""
        source, target = _flat_bytes(src.contiguous()), _flat_bytes(dst)
        with torch.no_grad():
            for start in range(0, source.numel(), self._chunk):
                end = min(start + self._chunk, source.numel())
                turn, self._turn = self._turn, 1 - self._turn
                if self._events[turn] is not None:
                    self._events[turn].synchronize()  # this buffer's previous transfer is done
                bounce = self._buffers[turn][: end - start]
                bounce.copy_(source[start:end])
                if self._stream is None:
                    target[start:end].copy_(bounce)
                    continue
                with torch.cuda.stream(self._stream):
                    target[start:end].copy_(bounce, non_blocking=True)
                    event = self._events[turn] = torch.cuda.Event()
                    event.record(self._stream)

    def close(self) -> None:
        """The device's current stream waits for every transfer (the loaded tensors are used
        there), and the bounce buffers are released once their transfers are done."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._stream.synchronize()
        self._buffers = []

    def __enter__(self) -> HostToDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def upload(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each host tensor into its device tensor, ``(target, source)``, through one
    :class:`HostToDevice` per target device (bounce buffers allocated once per call)."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, source in pairs:
        by_device.setdefault(target.device, []).append((target, source))
    for device, items in by_device.items():
        largest = max(t.nbytes for t, _ in items)
        with HostToDevice(device, chunk=max(1, min(BOUNCE_BYTES, largest))) as copier:
            for target, source in items:
                copier.copy(target, source)


def to_device(value: Any, device: str | torch.device) -> Any:
    """Nested data (dicts, lists, tuples) with every host tensor moved to ``device`` (checked
    by :func:`target_device`), a tensor held under several names moved once; unchanged for
    ``cpu``.

    >>> shared = torch.ones(2)
    >>> moved = to_device({"a": shared, "b": [shared, 3]}, "cpu")
    >>> moved["b"][0] is moved["a"] is shared
    True
    """
    target = target_device(device)
    return value if target.type == "cpu" else _moved(value, target)


def _moved(value: Any, target: torch.device) -> Any:
    """:func:`to_device` for a checked ``target``: every tensor copied there, each once."""
    found: dict[int, torch.Tensor] = {}
    copy_nested(value, lambda _, t: found.setdefault(id(t), t))
    moved = {key: torch.empty(t.shape, dtype=t.dtype, device=target) for key, t in found.items()}
    upload((moved[key], t) for key, t in found.items())
    return copy_nested(value, lambda _, t: moved[id(t)])
