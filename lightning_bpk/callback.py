"""``BurnpackCheckpoint``: save every epoch (or k steps), resume exactly, survive preemption.

One line of setup::

    trainer = L.Trainer(callbacks=[BurnpackCheckpoint()])
    trainer.fit(model)            # a second run with the same directory continues where it was

**Saving.** At the end of every training epoch N (Lightning's 0-based ``current_epoch``, after
validation, when ``N % checkpoint_frequency == 0``) the dict Lightning itself builds
(``dump_checkpoint``, so loops, callback states and hooks are exactly Lightning's) is split by
:mod:`lightning_bpk.trainer_state` into ``model.bpk``, ``optim.bpk``..., ``scheduler.bpk``...
and ``trainer.bpk`` (with the RNG states), and saved as checkpoint N by a
:class:`~lightning_bpk.checkpointer.Checkpointer` in ``dirpath`` (default
``{default_root_dir}/checkpoints``)::

    checkpoints/
    ├── ckpt.3/{model,optim,scheduler,trainer}.bpk
    ├── sentinel_checkpoint_complete.3
    └── ckpt.4/ ... sentinel_checkpoint_complete.4

Only global rank 0 writes; all ranks then agree on the outcome, so a failed save (a full disk)
raises :class:`CheckpointSaveError` on every rank and leaves every earlier checkpoint intact.

**Step and time triggers.** ``every_n_train_steps=k`` also saves after every k-th optimizer
step, ``train_time_interval=timedelta(...)`` when that much time passed since the last save (rank
0's clock; the decision reaches every rank in the all-reduce the preemption flag already uses).
Saves happen only at optimizer-step boundaries, never inside gradient accumulation; a save that
falls due right before a validation run waits until after it, and one on an epoch's last batch
becomes that epoch's end save. With either trigger set, **checkpoint N is the one saved after
global step N** (epoch-end, preemption and final saves too); without, N is the epoch.

**Resuming.** In ``setup`` rank 0 finds the newest checkpoint that verifies
(:func:`~lightning_bpk.checkpointer.get_latest_checkpoint_number` with ``verify=True``, which
falls back past damaged ones and honours gin's ``override_number``, which must name a complete
checkpoint: otherwise :class:`CheckpointResumeError` before anything is created); the number
is shared with every rank. Lightning 2.6 chooses ``ckpt_path`` before any callback runs, so the
callback intercepts the trainer's ``_checkpoint_connector.resume_start`` once: when ``fit`` got no
``ckpt_path`` it loads checkpoint N there, and Lightning restores everything in its own order
(model, callbacks, precision, loops, optimizers, schedulers). An explicit ``ckpt_path`` wins (a
checkpoint directory of ours works there too, without the IO plugin); ``resume=False`` starts
fresh.

**Exactly where it stopped.** Every save records, per rank, the RNG states (Python, NumPy,
torch, CUDA) and the training data's position (:mod:`lightning_bpk.data_position`): for a plain
DataLoader the RNG and generator states its sampler shuffled from and the number of batches the
model consumed; for a ``StatefulDataLoader`` its own state. Each rank restores its own when the
checkpoint is loaded, before ``configure_optimizers`` (which may set the data up early through
``estimated_stepping_batches``), and the data resumes with the next batch of the same order, its
consumed indices skipped without loading their samples. Loop counters, ``global_step`` and
per-step schedulers are Lightning's own, saved mid-epoch as they were: the continued run is
bit-identical to one that never stopped. Each loader of a dict, list or ``CombinedLoader`` is
positioned on its own; an iterable dataset without state is read again up to the save point and
the batches consumed before it are discarded (one warning says so: exact only if the dataset
yields the same batches again), the counters continuing from the save all the same.

**Never saving over another run.** At ``on_train_start`` rank 0 looks for complete checkpoints
numbered from the epoch the run starts at on (other than the one it resumed from), which its
saves would replace: there are some after ``resume=False``, an explicit older ``ckpt_path`` or
an older ``override_number``. ``fit`` then stops with :class:`CheckpointResumeError` naming them,
unless ``overwrite=True``, which removes them first. A checkpoint of other optimizer or
scheduler classes is refused at ``on_fit_start``, before Lightning loads its state.

**Preemption.** During training, SIGTERM and SIGUSR1 only set a flag (the previous handlers
still run, except Lightning's own SIGTERM notifier, whose in-handler broadcast can deadlock DDP).
At the next ``on_train_batch_end`` at an optimizer-step boundary all ranks agree on the flag
(all-reduce MAX), save as above (by epoch number E, whatever the frequency, without a step
trigger; a later save of E replaces it), and stop with
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` (a ``SystemExit`` without
code: exit status 0). A signal during validation is acted on at the next batch end or the
epoch's end. A mid-epoch checkpoint is marked in ``trainer.bpk`` under
``lightning_bpk_preempted`` (epoch, batches consumed, whether it replays). From then on a
repeated signal (schedulers send more than one) is ignored until the process has exited, so the
exit status stays 0; a later ``fit`` in the same process brings the default handlers back.

**SLURM.** Under SLURM (Lightning's ``SLURMEnvironment``, auto-requeue on) Lightning's own
SIGUSR1 handler, which saves and requeues inside the handler, does not run either; when the
requeue signal stopped training, global rank 0 runs ``scontrol requeue`` after the save is
complete, and the requeued job resumes from it (:mod:`lightning_bpk.slurm`).

**A finished run stays finished.** The save at the end of training (``max_epochs`` or
``max_steps`` reached, or ``trainer.should_stop`` as EarlyStopping sets it) is always made,
whatever the frequency, and marked. Run again with the same limits, the callback says the run
already finished and Lightning trains nothing; raise ``max_epochs``/``max_steps`` to continue.
A run stopped by ``max_time`` is finished for as long as ``max_time`` is at most the training
time it had (Lightning's Timer restores that time with its state); a larger ``max_time``, or
none, continues it, and the Timer stops it when the total reaches the new limit.

This is the public path; the code lives in :mod:`lightning_bpk.lightning` (the callback in
``lightning_bpk.lightning.callback``, each of its concerns in a module beside it).
"""

from lightning_bpk.lightning.callback import (
    FINISHED_KEY,
    PREEMPTION_SIGNALS,
    BurnpackCheckpoint,
    CheckpointResumeError,
    CheckpointSaveError,
    log,  # noqa: F401
)

__all__ = [
    "FINISHED_KEY",
    "PREEMPTION_SIGNALS",
    "BurnpackCheckpoint",
    "CheckpointResumeError",
    "CheckpointSaveError",
]
