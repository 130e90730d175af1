"""The run layer: a training run's checkpoint policy, written once, under both integrations.

Between the checkpoint core (:mod:`lightning_bpk.checkpointer`, :mod:`lightning_bpk.dcp`) and
the two integrations (:mod:`lightning_bpk.lightning`, :mod:`lightning_bpk.fabric`), which
translate their framework's state into it and never import each other. Nothing here imports
Lightning: torch and the layers below only.

- ``resume``: what to resume, and refusing to save over another run's newer checkpoints (or
  removing them with ``overwrite``);
- ``saves``: save and agree: rank 0 commits (or every rank writes its shards), every rank
  learns the outcome;
- ``ranks``: the rank agreement protocol (all-reduce MAX, gather, broadcast) each integration
  implements with its framework's collectives;
- ``sharded``: the sharded save's three steps (stage, every rank writes, rank 0 commits) and
  the in-place load;
- ``async_save``: the background writer;
- ``cadence``: when a step, time or ``"auto"`` save falls due;
- ``best``: the standing of a run's checkpoints, the k best by a metric and the last (the
  core's best-k rule applied to the metrics the manifests record);
- ``preemption`` and ``slurm``: signals set a flag, the run saves and exits 0, and requeues a
  SLURM job;
- ``loaders`` (with ``_resample`` and ``_data_warnings``): a data loader's position in its
  pass; ``rng``: the RNG states.

Each is imported by its own path (``lightning_bpk.runtime.saves``, ...); nothing is imported
here.
"""

__all__: list[str] = []
