"""``BurnpackCheckpointIO``: Lightning's and Fabric's byte layer, in burnpack instead of
``torch.save``.

::

    trainer = L.Trainer(plugins=[BurnpackCheckpointIO()])
    trainer.save_checkpoint("run/manual.ckpt")       # a burnpack file, no pickle
    trainer.fit(model, ckpt_path="run/manual.ckpt")  # loads it back

    fabric = L.Fabric(plugins=[BurnpackCheckpointIO()])      # one device, DDP
    fabric.save("run/step-100.ckpt", {"model": model, "optimizer": optimizer, "step": 100})
    remainder = fabric.load("run/step-100.ckpt", {"model": model, "optimizer": optimizer})

Every path Lightning hands over (``trainer.save_checkpoint``, ``ModelCheckpoint``'s
``epoch=3-step=16.ckpt`` and ``last.ckpt``, ``OnExceptionCheckpoint``) becomes **one file** at
exactly that path, so ModelCheckpoint's naming, top-k deletion and ``ckpt_path="last"`` work
unchanged. It holds Lightning's whole dict as a StateRecord (see
:mod:`lightning_bpk.lightning.trainer_state`): optimizer state keeps its int keys, tuples stay
tuples,
0-d tensors stay tensors, and the RNG states are added. The write is atomic (scratch file beside
the target, fsync, rename), so a crash or a full disk leaves the previous file intact.

``load_checkpoint`` also accepts a checkpoint directory written by
:class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint` (``checkpoints/ckpt.7``), so one
plugin
loads both. Loading reads the same bytes on every rank and gives each the same dict; it writes
nothing. Lightning calls ``save``/``remove`` on global rank 0 only; neither uses collectives.

**With Fabric** (``Fabric(plugins=[BurnpackCheckpointIO()])``, single device and DDP; FSDP and
``ModelParallelStrategy`` refuse every CheckpointIO plugin: use
:class:`~lightning_bpk.fabric.CheckpointManager`, which saves their shards), ``fabric.save``
hands over the dict already converted (modules and optimizers as their ``state_dict``, after
``filter=``), and ``fabric.load`` restores in place from what ``load_checkpoint`` returns and
gives back the rest: the RNG states saved with the file are restored and taken out of it, so
the remainder holds exactly what was saved and not restored. Fabric never tears its strategy
down, so an ``async_save`` write is waited for by the next save, load or remove, by
``fabric.strategy.teardown()`` (or this plugin's :meth:`~BurnpackCheckpointIO.teardown`), which
raise its error, and at the latest when the process exits, which logs it. Under DDP, other
ranks' ``fabric.load`` does not wait for rank 0's write in flight: call ``teardown`` (on rank
0, then a barrier) before loading a file just saved asynchronously.

**RNG states.** ``load_checkpoint`` also puts back the global RNG states saved with the
checkpoint (torch, CUDA when present, numpy, Python ``random``), so ``ModelCheckpoint`` with
``fit(ckpt_path="last")`` continues bit-identically, shuffles and dropout included. Lightning
calls it when ``fit`` starts, before it builds the optimizers and the data iterators; random
numbers drawn in between (say, in ``configure_optimizers``) come out of the restored stream, as
they would not in a run that never stopped. ``validate``/``test``/``predict`` with a
``ckpt_path`` restore them as well. Under DDP every rank gets rank 0's states. A Trainer's
checkpoint keeps them in the dict (under :data:`~lightning_bpk.lightning.trainer_state.RNG_KEY`,
which the Trainer ignores and the callback reads); any other dict (Fabric's) has them taken out.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from lightning_bpk.lightning import trainer_state
from lightning_bpk.records import files
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.rng import restore_rng
from lightning_bpk.store import open_parent

__all__ = [
    "BurnpackCheckpointIO",
]

log = logging.getLogger("lightning_bpk")

# The key every checkpoint dict of Lightning's Trainer carries (its loader migrates by it);
# a dict without it is a Fabric state dict, which gets back exactly what was saved.
_TRAINER_VERSION_KEY = "pytorch-lightning_version"


def _drain_at_exit(ref: weakref.ReferenceType[AsyncCheckpointSaver]) -> None:
    """At interpreter exit (after the writer thread finished its write): say if it failed."""
    saver = ref()
    if saver is None:
        return
    try:
        saver.close()
    except Exception as e:
        detail = " ".join([str(e), *getattr(e, "__notes__", [])])
        log.error("the last asynchronous checkpoint write failed: %s: %s", type(e).__name__, detail)


class BurnpackCheckpointIO(CheckpointIO):
    """A :class:`~lightning.fabric.plugins.CheckpointIO` writing burnpack files (no pickle).

    >>> import tempfile, torch
    >>> io = BurnpackCheckpointIO()
    >>> path = tempfile.mkdtemp() + "/x.ckpt"
    >>> io.save_checkpoint({"epoch": 1, "optimizer_states": [{"state": {0: {}}}]}, path)
    >>> io.load_checkpoint(path)["optimizer_states"]
    [{'state': {0: {}}}]

    Paths may be URLs (``ModelCheckpoint(dirpath="s3://bucket/run")`` with this plugin): each
    file is written through the :class:`~lightning_bpk.store.Store` of its directory, as one
    object that appears whole or not at all (a failed upload leaves the previous object), and
    read back with ranged reads. ``storage_options`` go to fsspec for every path this plugin
    writes, reads or removes (credentials, an endpoint); ``trainer.save_checkpoint(...,
    storage_options=...)`` overrides them for that save. ``ModelCheckpoint``'s own look at its
    ``dirpath`` (does it exist, what is in it) goes through fsspec with its defaults, so the
    environment or an fsspec configuration must reach the store too.

    ``async_save=True`` writes on a background thread
    (:class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`): ``save_checkpoint``
    returns after copying the tensors into reused staging buffers. ``load_checkpoint`` and
    ``remove_checkpoint`` first wait for the write in flight (ModelCheckpoint removes the old
    file right after saving the new one), and a failed write raises at the next call or at
    ``teardown``.
    """

    def __init__(
        self, async_save: bool = False, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.storage_options = None if storage_options is None else dict(storage_options)
        self._saver = AsyncCheckpointSaver() if async_save else None
        self._at_exit: Any = None  # the exit-time drain, registered at the first async save

    def _wait(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Write ``checkpoint`` atomically as one burnpack file at ``path`` (a path or a URL:
        one object, through the store); ``storage_options``: this save's, instead of the
        plugin's."""
        options = self.storage_options if storage_options is None else dict(storage_options)
        record = trainer_state._file_record(checkpoint)
        write = functools.partial(files.write_record, storage_options=options)
        if self._saver is not None:
            self._saver.save_record(record, path, write)
            if self._at_exit is None:  # Fabric has no teardown of its own: drain at exit
                self._at_exit = functools.partial(_drain_at_exit, weakref.ref(self._saver))
                atexit.register(self._at_exit)
            return
        write(record, path)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
        state: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Read a file this IO wrote, or a BurnpackCheckpoint directory, into Lightning's dict,
        and restore the global RNG states saved with it (see the module docstring).

        Tensors come back on the CPU (``map_location`` is accepted for the interface; Lightning
        moves state to the device itself). ``weights_only`` is moot: nothing is unpickled.
        ``state`` (the argument newer Lightning versions pass) is a dict to load into: it is
        updated with the loaded entries and returned.
        """
        self._wait()
        loaded = trainer_state.load(path, self.storage_options)
        rng = loaded.get(trainer_state.RNG_KEY)
        if rng is not None:
            restore_rng(rng)
            if _TRAINER_VERSION_KEY not in loaded:  # Fabric's dict: exactly what was saved
                del loaded[trainer_state.RNG_KEY]
        if state is None:
            return loaded
        state.update(loaded)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete a checkpoint file (or a checkpoint directory); a missing path is fine."""
        self._wait()  # never delete an old checkpoint before the new one is durable
        store, name = open_parent(path, self.storage_options)
        store.remove_prefix(name)

    def teardown(self) -> None:
        """Wait for the write in flight and re-raise its error, if it failed."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._saver is not None:
            self._saver.close()
