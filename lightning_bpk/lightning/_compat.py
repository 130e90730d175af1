"""Every use of Lightning's private API, in one place.

Lightning offers no public hook for what the callback needs in a few spots: building the
checkpoint dict exactly as Lightning does, loading our checkpoint when ``fit`` got no
``ckpt_path`` (Lightning chooses the path before any callback runs), telling Lightning's own
signal handlers from a user's and choosing what its teardown reinstalls, the cluster
environment it detected (SLURM), ``ckpt_path="last"``/``"best"`` where no ModelCheckpoint has a
file, whether validation has run, an MLflow logger's ``log_model``, the Timer's ``max_time``,
and what StochasticWeightAveraging misses on a mid-epoch resume. Each
function here wraps one such touch; ``tests/test_lightning_compat.py`` checks each against the
installed Lightning, so an upgrade that moves one fails there, by name, instead of somewhere
inside a training run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

from lightning_bpk.runtime.ranks import Ranks

# The module whose handlers Lightning installs for SIGTERM (and SIGUSR1 under SLURM).
SIGNAL_CONNECTOR_MODULE = "lightning.pytorch.trainer.connectors.signal_connector"

ResumeStart = Callable[[Any, "bool | None"], None]


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's own checkpoint dict (loops, callback states, hooks), as ``ModelCheckpoint``
    gets it; ``weights_only=False`` means "with optimizers and schedulers", not unpickling."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def intercept_resume_start(
    trainer: pl.Trainer,
    resume_start: Callable[[ResumeStart, Any, bool | None], tuple[Any, dict[str, Any]] | None],
) -> None:
    """Route the trainer's next ``resume_start(checkpoint_path, weights_only)`` through
    ``resume_start(original, checkpoint_path, weights_only)``, once.

    It returns ``None`` after calling ``original`` itself (Lightning's own path), or
    ``(path, checkpoint)``: Lightning then restores that dict exactly as one it read itself
    (migrated first) and reports ``path`` as ``trainer.ckpt_path``.
    """
    connector = trainer._checkpoint_connector
    original = type(connector).resume_start.__get__(connector)

    def one_shot(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        del connector.resume_start  # back to the class method
        loaded = resume_start(original, checkpoint_path, weights_only)
        if loaded is not None:
            path, checkpoint = loaded
            connector._ckpt_path = path
            connector._loaded_checkpoint = _pl_migrate_checkpoint(checkpoint, path)

    connector.resume_start = one_shot  # type: ignore[method-assign]


def release_resume_start(trainer: pl.Trainer) -> None:
    """Undo :func:`intercept_resume_start` if ``fit`` ended before Lightning called it."""
    connector = trainer._checkpoint_connector
    if "resume_start" in vars(connector):
        del connector.resume_start


def build_module(cls: type[Any], checkpoint: dict[str, Any], strict: bool, hparams: dict) -> Any:
    """``cls`` built and loaded from Lightning's ``checkpoint`` dict exactly as
    ``load_from_checkpoint`` does (saved hyper-parameters, ``hparams`` overriding them, its
    ``on_load_checkpoint``, ``load_state_dict(strict)``), without reading a file."""
    from lightning.pytorch.core.saving import _load_state

    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(hparams)
    return _load_state(cls, checkpoint, strict=strict, **hparams)


# Who reads a path for load_from_checkpoint before Lightning does (route_checkpoint_reader).
_READERS: list[Callable[[Any], dict[str, Any] | None]] = []


def route_checkpoint_reader(read: Callable[[Any], dict[str, Any] | None]) -> None:
    """Let ``read(path)`` answer ``load_from_checkpoint``'s read of ``path`` first (None: not
    its to read; Lightning's reader then reads it); Lightning's reader is wrapped once per
    process, and each ``read`` is asked once per path."""
    from lightning.pytorch.core import saving

    if read not in _READERS:
        _READERS.append(read)
    original = saving.pl_load
    if getattr(original, "_lightning_bpk_routed", False):
        return

    def pl_load(path: Any, *args: Any, **kwargs: Any) -> Any:
        for reader in list(_READERS):
            checkpoint = reader(path)
            if checkpoint is not None:
                return checkpoint
        return original(path, *args, **kwargs)

    pl_load._lightning_bpk_routed = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load  # type: ignore[assignment]


def train_results(trainer: pl.Trainer) -> Any:
    """The training loop's result collection: what ``self.log`` accumulates for the epoch."""
    return trainer.fit_loop.epoch_loop._results


def plateau_step_skipped(trainer: pl.Trainer) -> bool:
    """At an epoch's end, Lightning will skip its ReduceLROnPlateau step (it does while the fit
    loop restarts) where it would otherwise take it (every batch of the epoch ran)."""
    fit_loop = trainer.fit_loop
    return fit_loop.restarting and fit_loop.epoch_loop._num_ready_batches_reached()


def is_lightning_signal_handler(handler: object) -> bool:
    """Lightning's own signal-connector handlers (bound methods of its signal connector)."""
    owner = getattr(handler, "__self__", None)
    return type(owner).__module__ == SIGNAL_CONNECTOR_MODULE


def composed_signal_handlers(handler: object) -> list[Any]:
    """The callables a handler runs: the list inside Lightning's ``_HandlersCompose``, or the
    handler itself."""
    inner = getattr(handler, "signal_handlers", None)
    return list(inner) if isinstance(inner, list) else [handler]


def foreign_signal_handlers(handler: object) -> list[Any]:
    """The callables a previously installed signal handler runs, without Lightning's own ones
    (its SIGTERM notifier broadcasts inside the handler, which can deadlock DDP)."""
    handlers = composed_signal_handlers(handler)
    return [h for h in handlers if callable(h) and not is_lightning_signal_handler(h)]


def handlers_restored_at_teardown(trainer: pl.Trainer) -> dict[int, Any]:
    """The signal handlers Lightning found at fit start and reinstalls at its teardown, by
    signal number; changing an entry changes what teardown reinstalls (empty before fit)."""
    return trainer._signal_connector._original_handlers


def cluster_environment(trainer: pl.Trainer) -> ClusterEnvironment | None:
    """The cluster environment Lightning detected or was given (``SLURMEnvironment``, ...)."""
    return trainer._accelerator_connector.cluster_environment


def slurm_requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal that asks for a SLURM requeue, or ``None`` when auto-requeue does not apply:
    not ``None`` only when Lightning detected SLURM for ``trainer`` with
    ``SLURMEnvironment(auto_requeue=True)`` (the default); see :mod:`lightning_bpk.runtime.slurm`.
    """
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def generate_state_key(callback: Callback, **kwargs: Any) -> str:
    """``Callback._generate_state_key``: the key of a callback's state in the checkpoint."""
    return callback._generate_state_key(**kwargs)


def intercept_train_dataloaders(trainer: pl.Trainer, install: Callable[[Any, int], None]) -> None:
    """Call ``install(dataloader, n)`` on each training dataloader the fit loop sets up from now
    on (the n-th of this set-up), after Lightning processed it (distributed sampler injected)
    and before it is first iterated.

    Lightning builds them in ``fit_loop.setup_data`` (early, when the module reads
    ``estimated_stepping_batches``) and iterates them at once; the strategy's
    ``process_dataloader`` is the last step in between, so it is intercepted while
    ``setup_data`` runs (evaluation loaders are set up elsewhere and are not seen).
    """
    fit_loop, strategy = trainer.fit_loop, trainer.strategy
    original_setup = type(fit_loop).setup_data.__get__(fit_loop)
    original_process = type(strategy).process_dataloader.__get__(strategy)

    def setup_data() -> None:
        count = 0

        def process_dataloader(dataloader: Any) -> Any:
            nonlocal count
            dataloader = original_process(dataloader)
            count += 1
            install(dataloader, count)
            return dataloader

        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
        try:
            original_setup()
        finally:
            del strategy.process_dataloader

    fit_loop.setup_data = setup_data  # type: ignore[method-assign]


def release_train_dataloaders(trainer: pl.Trainer) -> None:
    """Undo :func:`intercept_train_dataloaders`."""
    if "setup_data" in vars(trainer.fit_loop):
        del trainer.fit_loop.setup_data


def shift_batch_progress(trainer: pl.Trainer, delta: int) -> None:
    """Move the training epoch loop's batch counters (``batch_progress``: total and current)
    by ``delta`` batches: in the checkpoint Lightning is about to restore when it has not
    restored its loops yet (the data was set up early, for ``estimated_stepping_batches``),
    else in the live loop."""
    loaded = trainer._checkpoint_connector._loaded_checkpoint
    if loaded:
        progress = loaded["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for counters in (progress["total"], progress["current"]):
            for key in ("ready", "started", "processed", "completed"):
                counters[key] += delta
        return
    live = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (live.total, live.current):
        for key in ("ready", "started", "processed", "completed"):
            setattr(tracker, key, getattr(tracker, key) + delta)


def train_combined_mode(trainer: pl.Trainer) -> str:
    """The mode of the ``CombinedLoader`` the fit loop trains from (``max_size_cycle`` when
    ``train_dataloader`` returned a loader, a list or a dict)."""
    loader = trainer.fit_loop._combined_loader
    return "max_size_cycle" if loader is None else str(loader._mode)


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether the training epoch loop runs validation right after the current batch (what it
    asks itself next, in ``on_advance_end``)."""
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher))


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the current training batch is the epoch's last (as the epoch loop knows it)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def resume_swa_mid_epoch(trainer: pl.Trainer) -> list[Callback]:
    """Give StochasticWeightAveraging the epoch start a mid-epoch restart skips; the callbacks
    it was given to.

    Lightning calls ``on_train_epoch_start`` only when an epoch starts, not when a restart lands
    inside one (or at its end), and SWA builds its SWALR there, from the state it restored.
    Without it the rest of the resumed epoch trains with no scheduler, and the next epoch starts
    one SWALR step behind. Called once, before the first batch, for an SWA that restored the
    state of a started SWALR in one of its averaging epochs; its averaging is not repeated
    (it averaged this epoch already: ``_latest_update_epoch``).
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    loop = trainer.fit_loop
    if not (loop.restarted_mid_epoch or loop.restarted_on_epoch_end):
        return []
    given: list[Callback] = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, StochasticWeightAveraging):
            continue
        if callback._initialized or callback._scheduler_state is None:
            continue
        if callback.swa_start <= trainer.current_epoch <= callback.swa_end:
            callback.on_train_epoch_start(trainer, trainer.lightning_module)
            given.append(callback)
    return given


def timer_duration(timer: Callback) -> float | None:
    """The ``max_time`` a :class:`~lightning.pytorch.callbacks.Timer` enforces, in seconds
    (``None``: none). Its public ``time_remaining() + time_elapsed()`` reads the clock twice."""
    duration = timer._duration  # type: ignore[attr-defined]
    return None if duration is None else float(duration)


def validation_has_run(trainer: pl.Trainer) -> bool:
    """Whether the fit loop's validation has run (``ModelCheckpoint`` then raises for a
    missing monitored metric instead of warning)."""
    return bool(trainer.fit_loop.epoch_loop.val_loop._has_run)


def mlflow_log_model(logger: object) -> bool | str:
    """An ``MLFlowLogger``'s ``log_model`` setting (``False`` for any other logger)."""
    from lightning.pytorch.loggers import MLFlowLogger

    if not isinstance(logger, MLFlowLogger):
        return False
    mode: bool | str = logger._log_model
    return mode


# Who answers ckpt_path="last" when Lightning finds no "last" file, and who reads its best
# checkpoints before Lightning resolves "best" (route_ckpt_path).
_LAST_TAKERS: list[Callable[[pl.Trainer, bool], Any]] = []
_BEST_READERS: list[Callable[[pl.Trainer], None]] = []
_NO_LAST = "there is no last checkpoint available"


def route_ckpt_path(
    take_last: Callable[[pl.Trainer, bool], Any], read_best: Callable[[pl.Trainer], None]
) -> None:
    """Let callbacks answer ``ckpt_path="last"`` and ``"best"``; installed once per process,
    for every trainer.

    Lightning resolves ``ckpt_path`` in ``fit``/``validate``/``test``/``predict`` before any
    callback runs. ``read_best(trainer)`` runs first when it will resolve ``"best"`` (given, or
    the default of an evaluation called without a model), so a callback can read its best
    checkpoint from its directory; Lightning then reads ``best_model_path`` itself. Where
    Lightning finds no ``"last"`` file of its own (no ModelCheckpoint or OnExceptionCheckpoint
    file), it warns "No checkpoint will be loaded" and goes on with ``ckpt_path=None``;
    ``take_last(trainer, fitting)`` is asked then: while fitting, True when a callback will
    resume from its own newest checkpoint (and says so), and that warning, which would
    contradict it, is not shown; otherwise the path to load (None: none, and the warning
    stays). Every other warning is shown.
    """
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.states import TrainerFn

    if take_last not in _LAST_TAKERS:
        _LAST_TAKERS.append(take_last)
    if read_best not in _BEST_READERS:
        _BEST_READERS.append(read_best)
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, "_lightning_bpk_routed", False):
        return

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, **kwargs: Any) -> Any:
        fitting = state_fn == TrainerFn.FITTING
        if ckpt_path == "best" or (ckpt_path is None and not fitting):
            for read in list(_BEST_READERS):
                read(self.trainer)
        if ckpt_path != "last":
            return original(self, state_fn, ckpt_path, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = original(self, state_fn, ckpt_path, **kwargs)
        taken: Any = None
        for take in list(_LAST_TAKERS) if path is None else []:
            taken = take(self.trainer, fitting)
            if taken:
                break
        for w in caught:
            if not (taken and _NO_LAST in str(w.message)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return path if fitting or not taken else taken

    _parse_ckpt_path._lightning_bpk_routed = True  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path  # type: ignore[method-assign,assignment]


def ranks(trainer: pl.Trainer) -> Ranks:
    """The ranks of ``trainer``'s strategy: its ``reduce`` with MAX, its ``broadcast``, its root
    device (the run layer's rank agreement, in Lightning's collectives)."""
    strategy = trainer.strategy
    return Ranks(
        world_size=trainer.world_size,
        is_global_zero=trainer.is_global_zero,
        reduce=lambda tensor: strategy.reduce(tensor, reduce_op="max"),
        device=strategy.root_device,
        broadcast=strategy.broadcast,
    )
