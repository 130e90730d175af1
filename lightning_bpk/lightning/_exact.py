"""What Lightning's own checkpoint leaves out, saved by the callback so a resume stays exact.

Lightning restores model, optimizers, schedulers, loops and callback states, but three things a
run depends on are not in its dict, so a run resumed from it (ours, or ``ModelCheckpoint``'s
``ckpt_path="last"``) ends differently from one that never stopped. Each save of the callback
adds them under :data:`EXACT_KEY` (:func:`capture`) and :class:`LostState` gives them back:

- **ReduceLROnPlateau's epoch step.** Lightning steps plateau schedulers after the epoch-end
  hooks, where the checkpoint is saved, with the monitored metric of that moment; resuming from
  that checkpoint it skips the step ("metrics are not saved"). Each plateau scheduler due at that
  epoch end is saved with the metric's value, and stepped with it (through the module's
  ``lr_scheduler_step``, as Lightning does) when training restarts. Lightning skips the step at
  the end of an epoch a mid-epoch resume restarted in as well: it is taken there, after the save.
- **Which parameters are frozen** (``requires_grad``). ``BaseFinetuning`` freezes its modules in
  ``setup`` and unfreezes them at one epoch (``BackboneFinetuning``'s
  ``unfreeze_backbone_at_epoch``); resumed after it, they stayed frozen for good. The names of
  the frozen parameters are saved and their flags restored right after the checkpoint is loaded
  (after ``setup`` froze them; ``BaseFinetuning`` itself restores its optimizer param groups).
- **Epoch-level metric accumulators** of a mid-epoch save: what ``self.log(..., on_epoch=True)``
  of a tensor has summed so far (Lightning's result collection: its value and batch count) and
  the states of every ``torchmetrics.Metric`` of the module. The metric states are restored with
  the checkpoint; a logged tensor's sum joins the resumed run's first value of it in the same
  order of additions (``saved + new`` where the run that never stopped added ``new`` to
  ``saved``), so the epoch's value is bit-identical.

What cannot be given back is named by a warning at resume (a metric or scheduler the resumed
module no longer has).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_bpk.lightning import _compat, _log_continuity

__all__ = ["EXACT_KEY", "LostState", "capture"]

EXACT_KEY = "lightning_bpk_exact"
"""Top-level key of a checkpoint: what this module saves beside Lightning's own dict."""


def capture(trainer: pl.Trainer, epoch_end: bool) -> dict[str, Any]:
    """What a save of ``trainer`` now needs beside Lightning's dict (every key optional)."""
    module = trainer.lightning_module
    state: dict[str, Any] = {
        "frozen": [n for n, p in module.named_parameters() if not p.requires_grad]
    }
    if epoch_end:
        plateau = _plateau_steps(trainer)
        if plateau:
            state["plateau"] = plateau
        return state
    logged = _logged_sums(trainer)
    if logged:
        state["logged"] = logged
    metrics = {
        name: {"states": _copied(metric.metric_state), "updates": metric._update_count}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric) and name and metric._update_count
    }
    if metrics:
        state["metrics"] = metrics
    return state


def _copied(states: dict[str, Any]) -> dict[str, Any]:
    """A metric's states, copied (torchmetrics updates some in place; an asynchronous save
    writes them after training went on)."""
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else [t.detach().clone() for t in v]
        for k, v in states.items()
    }


def _plateau_steps(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Scheduler index -> the monitored value, for every plateau scheduler Lightning steps right
    after this epoch's end hooks (its ``interval`` and ``frequency`` due, the metric there)."""
    steps = {}
    metrics = trainer.callback_metrics
    for i, config in enumerate(trainer.lr_scheduler_configs):
        due = (trainer.current_epoch + 1) % config.frequency == 0
        if config.reduce_on_plateau and config.interval == "epoch" and due:
            value = metrics.get(config.monitor or "")
            if isinstance(value, torch.Tensor):
                steps[str(i)] = value.detach().cpu().clone()
    return steps


def _logged_sums(trainer: pl.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the training loop's result collection accumulates for the epoch so far."""
    results = _compat.train_results(trainer)
    sums = {}
    for key, result in results.items():
        if not (result.is_tensor and result.meta.on_epoch) or result.has_reset:
            continue
        saved = {"value": result.value.detach().cpu().clone()}
        if result.meta.is_mean_reduction:
            saved["batches"] = result.cumulated_batch_size.detach().cpu().clone()
        sums[key] = saved
    return sums


class LostState:
    """What one resume gives back beyond Lightning's restore (module docstring)."""

    def __init__(self) -> None:
        self._plateau: dict[str, torch.Tensor] = {}
        self._logged: dict[str, dict[str, torch.Tensor]] = {}

    def loaded(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """The checkpoint was loaded (after ``setup``): frozen flags and metric states now."""
        state = checkpoint.get(EXACT_KEY) or {}
        module = trainer.lightning_module
        if "frozen" in state:
            frozen = set(state["frozen"])
            for name, parameter in module.named_parameters():
                parameter.requires_grad_(name not in frozen)
        modules = dict(module.named_modules())
        for name, saved in (state.get("metrics") or {}).items():
            metric = modules.get(name)
            if not isinstance(metric, Metric):
                _warn(f"torchmetrics metric {name!r} is not in the module any more")
                continue
            for attribute, value in saved["states"].items():
                setattr(metric, attribute, value)
            metric._update_count = saved["updates"]
            metric._computed = None
        _log_continuity.continue_versions(trainer, checkpoint)  # the logger's version too
        self._plateau = dict(state.get("plateau") or {})
        self._logged = dict(state.get("logged") or {})

    def train_started(self, trainer: pl.Trainer) -> None:
        """Training restarts: take the plateau steps Lightning skips at an epoch-end restart."""
        configs = trainer.lr_scheduler_configs
        for index, value in sorted(self._plateau.items()):
            if int(index) >= len(configs):
                _warn(f"ReduceLROnPlateau #{index} is not configured any more: not stepped")
                continue
            trainer.lightning_module.lr_scheduler_step(configs[int(index)].scheduler, value)
        self._plateau = {}

    def epoch_saved(self, trainer: pl.Trainer) -> None:
        """After the epoch-end save: at the end of the epoch a mid-epoch resume restarted in,
        Lightning skips its plateau step too; take it, with the metrics it would have used."""
        if not _compat.plateau_step_skipped(trainer):
            return
        configs = trainer.lr_scheduler_configs
        for index, value in sorted(_plateau_steps(trainer).items()):
            trainer.lightning_module.lr_scheduler_step(configs[int(index)].scheduler, value)

    def merge(self, trainer: pl.Trainer) -> None:
        """A training batch of the resumed run ended (its ``training_step`` logged): the saved
        sums join the values logged since, each once, the first time the run logged it."""
        if not self._logged:
            return
        results = _compat.train_results(trainer)
        for key in [k for k in self._logged if k in results]:
            saved, result = self._logged.pop(key), results[key]
            device = result.value.device
            if result.meta.is_mean_reduction:
                result.value = saved["value"].to(device) + result.value
                batches = saved["batches"].to(device)
                result.cumulated_batch_size = batches + result.cumulated_batch_size
            elif result.meta.is_sum_reduction:
                result.value = saved["value"].to(device) + result.value
            else:  # max or min
                result.value = result.meta.reduce_fx(saved["value"].to(device), result.value)

    def epoch_ended(self, trainer: pl.Trainer) -> None:
        """The resumed epoch ended: the last sums join; one never logged again is named."""
        self.merge(trainer)
        for key in self._logged:
            _warn(f"{key!r} was logged before the save only: no epoch value for it this epoch")
        self._logged = {}


def _warn(what: str) -> None:
    warnings.warn(f"BurnpackCheckpoint resume: {what}", stacklevel=3)
