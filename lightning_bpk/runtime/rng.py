"""The global RNG states (torch, CUDA, NumPy, Python ``random``) as plain data, and back.

A resumed run must draw exactly what the run that never stopped would have drawn: every save
records each rank's states (:func:`capture_rng`) and every resume puts them back
(:func:`restore_rng`), under Lightning (the callback's trainer record, a loader's position) and
in a Fabric loop (the manager's trainer record, :class:`~lightning_bpk.fabric.ResumableLoader`)
alike. CUDA states are kept per device index (``cuda_devices``): a single process captures and
restores every device's, a rank of a distributed run (DDP, FSDP2: one device per rank) only its
own device's, so no rank touches (or creates a context on) another rank's GPU, and a checkpoint
saved with more devices than are here restores those that exist.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from lightning_bpk.errors import CheckpointResumeError

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The global RNG states of torch, CUDA (when available), numpy and Python, as plain data.

    >>> sorted(capture_rng())[:3]
    ['numpy', 'python', 'torch']
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # the 624 keys as a tensor, not a numpy array: weights-only unpicklers (fabric.load,
        # torch.load(weights_only=True)) refuse numpy arrays
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        # 625 ints as one tensor rather than 625 scalar entries (through numpy: ~4x faster
        # than torch.tensor from a tuple of ints, and this runs at every save)
        "python": {
            "version": version,
            "state": torch.from_numpy(np.array(internal, dtype=np.int64)),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        devices = _cuda_devices(torch.cuda.device_count(), _own_cuda_device())
        states["cuda_devices"] = {str(i): torch.cuda.get_rng_state(i) for i in devices}
    return states


def _own_cuda_device() -> int | None:
    """The one CUDA device this process's RNG states are its own on: the current device of a
    rank of a distributed run; None for a single process (every device is its own)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.cuda.current_device()
    return None


def _cuda_devices(count: int, own: int | None) -> list[int]:
    """The CUDA device indexes whose RNG states a process captures and restores: all ``count``
    of them for a single process, else only its ``own``.

    >>> _cuda_devices(4, None), _cuda_devices(4, 2)
    ([0, 1, 2, 3], [2])
    """
    return list(range(count)) if own is None else [own]


def _cuda_states(states: Mapping[str, Any]) -> dict[int, torch.Tensor]:
    """The CUDA RNG states of captured ``states`` by device index: ``cuda_devices`` (``{"0":
    state}``), or the ``cuda`` list (one per device) of a checkpoint this package saved before.

    >>> state = torch.zeros(16, dtype=torch.uint8)
    >>> list(_cuda_states({"cuda": [state, state]}))
    [0, 1]
    >>> list(_cuda_states({"cuda_devices": {"3": state}}))
    [3]
    """
    if "cuda_devices" in states:
        return {int(index): state for index, state in states["cuda_devices"].items()}
    return dict(enumerate(states.get("cuda", [])))


def restore_rng(states: Mapping[str, Any]) -> None:
    """Set the global RNG states :func:`capture_rng` returned (CUDA only when both have it: on
    each device of this process, see the module docstring, that the states name).

    The states come from a file: each is checked on a generator of its own before any global
    one is set, so a malformed state is a :class:`~lightning_bpk.errors.CheckpointResumeError`
    naming the field, and changes nothing.

    >>> s = capture_rng(); a = torch.rand(1); restore_rng(s); torch.equal(a, torch.rand(1))
    True
    """
    torch_state = _field(states, "torch", _checked_torch)
    numpy_state = _field(
        states,
        "numpy",
        lambda s: _checked_numpy(
            (s["kind"], _numpy_keys(s["keys"]), s["pos"], s["has_gauss"], s["gauss"])
        ),
    )
    python_state = _field(
        states,
        "python",
        lambda s: _checked_python((s["version"], tuple(s["state"].tolist()), s["gauss_next"])),
    )
    saved = _field(states, "cuda", _cuda_states, whole=True)
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if saved and torch.cuda.is_available():
        for index in _cuda_devices(torch.cuda.device_count(), _own_cuda_device()):
            if index in saved:
                torch.cuda.set_rng_state(saved[index], index)


T = TypeVar("T")


def _field(
    states: Mapping[str, Any], name: str, check: Callable[[Any], T], *, whole: bool = False
) -> T:
    """``check(states[name])`` (``whole``: of ``states``), any failure of it a
    ``CheckpointResumeError`` naming the field."""
    try:
        return check(states if whole else states[name])
    except Exception as e:
        raise CheckpointResumeError(
            f"the checkpoint's RNG state is malformed ({name!r}: {type(e).__name__}: "
            f"{str(e)[:200]}); nothing was restored"
        ) from e


def _checked_torch(state: torch.Tensor) -> torch.Tensor:
    torch.Generator().set_state(state)  # a state of the wrong size or type is refused here
    return state


def _numpy_keys(keys: Any) -> Any:
    """NumPy's Mersenne Twister keys as ``set_state`` takes them: from the tensor
    :func:`capture_rng` stores, or the array older checkpoints hold."""
    if not isinstance(keys, torch.Tensor):
        return keys
    values = keys.numpy()
    if values.size and not (values.min() >= 0 and values.max() < 2**32):
        raise ValueError("numpy keys outside 0..2**32-1")
    return values.astype(np.uint32)


def _checked_numpy(state: tuple[Any, ...]) -> tuple[Any, ...]:
    np.random.RandomState().set_state(state)
    return state


def _checked_python(state: tuple[Any, ...]) -> tuple[Any, ...]:
    random.Random().setstate(state)
    return state
