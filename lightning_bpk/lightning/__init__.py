"""The Lightning integration: everything that knows about a ``Trainer``.

Built on the layers below it (:mod:`lightning_bpk.checkpointer`, :mod:`lightning_bpk.records`,
:mod:`lightning_bpk.storage`, ...), which never import from here:

- :mod:`~lightning_bpk.lightning.callback`: ``BurnpackCheckpoint`` itself: its settings, setup
  and resume, and where a save goes (public path: :mod:`lightning_bpk.callback`);
- :mod:`~lightning_bpk.lightning.triggers`: whether the run is finished;
- :mod:`~lightning_bpk.lightning.data_position`, :mod:`~lightning_bpk.lightning.async_save`,
  :mod:`~lightning_bpk.lightning.slurm`: the data's position in an epoch, the background writer,
  SLURM's requeue;
- ``_compat``: every touch of Lightning's private API, fenced in one module.

Nothing is imported here, so importing one module does not import the others.
"""
