"""The Lightning integration: everything that knows about a ``Trainer``.

Built on the layers below it (:mod:`lightning_bpk.checkpointer`, :mod:`lightning_bpk.records`,
:mod:`lightning_bpk.store`, ...), which never import from here. ``BurnpackCheckpoint``
(imported from :mod:`lightning_bpk.lightning.callback`) is split by concern, each module testable
without a Trainer:

- ``callback``: the callback's settings and its Lightning hooks (setup, resume, when to save);
- ``dispatch``: where checkpoints come from and go to: the resume choice, loading it in
  Lightning's ``resume_start``, and each save (rank 0 writes, every rank learns the outcome);
- ``triggers``: when a step, time or ``"auto"`` save falls due, and whether the run finished;
- ``preemption``: SIGTERM / SIGUSR1 set a flag; save, then stop with exit status 0;
- ``ranks``: the collectives every rank's decisions go through;
- ``_resume``: the checks around a resume (a file as ``ckpt_path``, other optimizer classes,
  checkpoints the run would save over).

Beside them: :mod:`~lightning_bpk.lightning.trainer_state` (Lightning's checkpoint dict as
records, and the RNG states; no storage I/O of its own),
:mod:`~lightning_bpk.lightning.checkpoint_io` (the ``CheckpointIO`` plugin),
:mod:`~lightning_bpk.lightning.sharded` (FSDP2 / tensor-parallel saves through the burnpack DCP
writer, committed by the checkpointer's sentinel),
:mod:`~lightning_bpk.lightning.data_position` (the data's position in an epoch; ``_resample``
replays a changed batch size or world size) over :mod:`~lightning_bpk.lightning.loaders` (one
loader's position, without a Trainer),
:mod:`~lightning_bpk.lightning.async_save` (the background writer),
:mod:`~lightning_bpk.lightning.slurm` (SLURM's requeue), and ``_compat``, every touch of
Lightning's private API fenced in one module. Each is imported by its own path
(``lightning_bpk.lightning.callback``, ...); ``lightning_bpk`` re-exports the callback and the
IO plugin.

What works without a ``Trainer`` object (``trainer_state``, ``checkpoint_io``, ``loaders``,
``async_save``, ``ranks``, ``preemption``, ``slurm.requeue``, ``sharded``'s save and load) also
serves the Fabric integration beside this package, :mod:`lightning_bpk.fabric`.

Nothing is imported here, so importing one module does not import the others.
"""

__all__: list[str] = []
