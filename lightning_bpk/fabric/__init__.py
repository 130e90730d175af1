"""Lightning Fabric: the same automatic, exact, pickle-free checkpoints for hand-written loops.

- :class:`CheckpointManager` (:mod:`~lightning_bpk.fabric.manager`): saves the dict you would
  pass to ``fabric.save`` as checkpoint ``step`` (a sentinel commits it; Dopamine retention;
  step, time and ``"auto"`` cadence; preemption; async saves; object storage; sharded FSDP2 /
  tensor-parallel models) and restores the newest complete one in place;
- :class:`ResumableLoader` (:mod:`~lightning_bpk.fabric.loaders`): a data loader whose position
  in its epoch travels in the checkpoint, so a resumed loop continues with the next batch;
- :func:`load_raw`, :func:`trainable`, :func:`trainable_parameters`
  (:mod:`~lightning_bpk.fabric.adapters`): a frozen base from a ``.bpk`` or ``.safetensors``
  file, and adapter checkpoints that hold only what trains.

Without the manager, ``Fabric(plugins=[BurnpackCheckpointIO()])``
(:mod:`lightning_bpk.lightning.checkpoint_io`) makes ``fabric.save``/``fabric.load`` write and read
burnpack files instead of pickles, for one device and DDP.
"""

from lightning_bpk.fabric.adapters import load_raw, trainable, trainable_parameters
from lightning_bpk.fabric.loaders import ResumableLoader
from lightning_bpk.fabric.manager import CheckpointManager, Restored

__all__ = [
    "CheckpointManager",
    "Restored",
    "ResumableLoader",
    "load_raw",
    "trainable",
    "trainable_parameters",
]
