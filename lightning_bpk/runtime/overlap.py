"""The overlapped snapshot: parameters and optimizer state copied beside the next forward and
backward, the next optimizer step waiting for the copy (CheckFreq, FAST'21).

Between a save at a step boundary and the next optimizer step, the only things that change are
what the forward and backward change: buffers (BatchNorm's running statistics), the RNG, the
loop state and the gradients. Parameters and optimizer state change only in the optimizer's
step. So an :class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver` that
:meth:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver.watch` es the optimizers copies
the rest on the caller's thread and returns, and copies each tensor that lies in a watched
optimizer's parameters or state (:meth:`StepGate.stable`) *late*: on the writer thread, before
it writes (on CPU), or on a side stream the training stream does not wait for yet (on CUDA).
:class:`StepGate` holds the next step of any watched optimizer until those copies have landed.

Where the step waits: every ``optimizer.step`` of a watched optimizer runs a step pre-hook.
A step without a closure (Fabric, a plain loop, AMP's ``GradScaler.step``) waits in the hook;
a step with a closure (Lightning: its forward and backward run inside the closure, after which
``on_before_optimizer_step`` and gradient clipping run and then the update) waits when the
closure returns, just before the update, so the copy overlaps that step's forward and
backward too. Gradient accumulation calls no step, so a copy may span several micro-batches;
manual optimization steps through the same ``optimizer.step``.

The one rule a user must keep: parameters change only in the optimizer's step (a weight
projection in ``training_step`` before the step would race the copy). A save with no watched
optimizer copies everything on the caller's thread, as before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_bpk import _device

__all__ = ["StepGate"]


def _optimizer(value: Any) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrapper (Fabric's ``_FabricOptimizer``,
    Lightning's ``LightningOptimizer``: both keep it as ``.optimizer``)."""
    while not isinstance(value, torch.optim.Optimizer):
        inner = getattr(value, "optimizer", None)
        if inner is None or inner is value:
            raise TypeError(f"{type(value).__name__} is not a torch optimizer")
        value = inner
    return value


class StepGate:
    """Holds the next step of the watched optimizers until a snapshot's late copies landed.

    >>> net = torch.nn.Linear(2, 2); opt = torch.optim.SGD(net.parameters(), lr=1.0)
    >>> gate = StepGate(); gate.watch([opt])
    >>> _device.storage_ptr(net.weight) in gate.stable()
    True
    >>> copied = threading.Event(); gate.hold(copied, _device.Ready())
    >>> copied.set(); net(torch.ones(2)).sum().backward(); opt.step()  # waits (here: done)
    >>> gate.held
    False
    """

    def __init__(self) -> None:
        self._watched: dict[int, tuple[weakref.ref, Any]] = {}  # id -> (optimizer, hook handle)
        self._copied: threading.Event | None = None
        self._ready: _device.Ready | None = None

    def watch(self, optimizers: Iterable[Any]) -> None:
        """Gate the steps of ``optimizers`` (torch optimizers or a framework's wrappers of
        them) from now on; their parameters and state are copied late by later snapshots."""
        for value in optimizers:
            optimizer = _optimizer(value)
            if id(optimizer) in self._watched and self._watched[id(optimizer)][0]() is optimizer:
                continue
            handle = optimizer.register_step_pre_hook(self._before_step)
            self._watched[id(optimizer)] = (weakref.ref(optimizer), handle)

    def stable(self) -> frozenset[int]:
        """The storages of every watched optimizer's parameters and state tensors: what only
        their steps change, and so what a snapshot may copy late."""
        found: set[int] = set()
        for ref, _ in list(self._watched.values()):
            optimizer = ref()
            if optimizer is None:
                continue
            for group in optimizer.param_groups:
                found.update(_device.storage_ptr(p) for p in group["params"])
            for state in optimizer.state.values():
                tensors = (v for v in state.values() if isinstance(v, torch.Tensor))
                found.update(_device.storage_ptr(v) for v in tensors)
        found.discard(0)  # empty tensors own no memory
        return frozenset(found)

    @property
    def held(self) -> bool:
        """True while a step would wait for late copies."""
        return self._copied is not None

    def hold(self, copied: threading.Event, ready: _device.Ready) -> None:
        """Hold the next step until ``copied`` is set (the host's late copies are done) and,
        on a device, until the training stream waits for ``ready``'s late copies."""
        self._copied, self._ready = copied, ready

    def release(self) -> None:
        """Wait for the held snapshot's late copies (nothing when none is held)."""
        copied, ready = self._copied, self._ready
        if copied is None or ready is None:
            return
        copied.wait()
        ready.order_device()
        self._copied = self._ready = None

    def close(self) -> None:
        """Stop gating: release what is held and remove the step hooks."""
        self.release()
        for _, handle in self._watched.values():
            handle.remove()
        self._watched.clear()

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """The step pre-hook: wait now, or for a closure's step once the closure returned (the
        update comes after it)."""
        if self._copied is None:
            return None
        # torch passes the step's own arguments, ``self`` first: (self, closure) or (self,)
        closure: Callable[[], Any] | None = kwargs.get(
            "closure", args[1] if len(args) > 1 else None
        )
        if closure is None:
            self.release()
            return None

        def closure_then_wait() -> Any:
            loss = closure()
            self.release()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs
