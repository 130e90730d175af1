"""The Lightning integration: everything that knows about a ``Trainer``.

A thin adapter over the run layer (:mod:`lightning_bpk.runtime`: the resume policy, save and
agree, the sharded save, the async saver, cadence, preemption and SLURM requeue, loader
positions, RNG states), which it feeds the trainer's state; the Fabric integration beside it,
:mod:`lightning_bpk.fabric`, is the other adapter over the same layer and neither imports the
other. ``BurnpackCheckpoint`` (:mod:`lightning_bpk.lightning.callback`) holds its settings and
hooks and composes its collaborators, each testable without a Trainer:

- ``_resume``: loading the chosen checkpoint in Lightning's ``resume_start``, and the checks
  around a resume (a file as ``ckpt_path``, other optimizer classes, checkpoints the run would
  save over), in the callback's words;
- ``_save_data``: what one save holds, taken from the trainer (Lightning's own dict, this
  package's additions, the records or the shards);
- ``triggers``: when the epoch-end save is the one to make, and whether the run finished;
- ``_best``: ``ModelCheckpoint``'s attributes (``best_model_path``...), the ``ckpt_path`` names
  ``"best"`` and ``"last"`` outside ``fit``, and the loggers told of each commit.
- ``_runs``: runs that share a folder or a Trainer (smoke tests and tuners that neither resume
  nor save, several callbacks, gin bindings the callback cannot apply);
- ``_exact``: what Lightning itself loses on a resume (``ReduceLROnPlateau``'s step, frozen
  parameters, epoch-level metric sums), saved and put back; ``_log_continuity``: the logger
  version a resumed run continues in.

Beside them: :mod:`~lightning_bpk.lightning.trainer_state` (Lightning's checkpoint dict as
records; no storage I/O of its own), :mod:`~lightning_bpk.lightning.checkpoint_io` (the
``CheckpointIO`` plugin), :mod:`~lightning_bpk.lightning.sharded` (FSDP2 / tensor-parallel
state out of and back into Lightning's dict), :mod:`~lightning_bpk.lightning.data_position`
(the data's position in an epoch of a ``fit``), :mod:`~lightning_bpk.lightning.loading` (a
checkpoint into a ``LightningModule`` for inference or fine-tuning), and ``_compat``, every
touch of Lightning's private API fenced in one module. Each is imported by its own path
(``lightning_bpk.lightning.callback``, ...); ``lightning_bpk`` re-exports the callback and the
IO plugin.

Nothing is imported here, so importing one module does not import the others.
"""

__all__: list[str] = []
