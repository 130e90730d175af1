"""Lightning's checkpoint dict <-> burnpack records, plus the RNG states Lightning does not save.

Shared by :class:`~lightning_bpk.lightning.callback.BurnpackCheckpoint` (a checkpoint directory of
records through the :class:`~lightning_bpk.checkpointer.Checkpointer`) and
:class:`~lightning_bpk.lightning.checkpoint_io.BurnpackCheckpointIO` (one file per Lightning path).

**A checkpoint directory** (what the callback writes)::

    ckpt.7/
    ├── model.bpk        ModuleRecord of the LightningModule (state_dict names, u64 param ids)
    ├── optim.bpk        OptimizerRecord of optimizer 0, keyed by parameter id
    ├── optim-1.bpk      ... one per further optimizer
    ├── scheduler.bpk    LrSchedulerRecord of scheduler 0 (scalars only)
    ├── scheduler-1.bpk  ...
    └── trainer.bpk      StateRecord: every other key of Lightning's dict (epoch, global_step,
                         loops, callbacks, hyper_parameters, precision/datamodule state,
                         pytorch-lightning_version, on_save_checkpoint additions) + RNG states

**A single file** (what the IO writes at the path Lightning chooses, e.g. ``last.ckpt``): one
StateRecord holding Lightning's whole dict (optimizer state positional, with int keys, as
Lightning has it) plus the RNG states. :func:`load` reads either form back into Lightning's dict.

**Hyper-parameters** the state codec cannot store (a user object, a type, a lambda) are left out
with a warning naming each one, and listed under :data:`DROPPED_KEY`: the model is rebuilt by the
user's code on resume, so they are not needed to continue training, and refusing to checkpoint at
all would be worse. What a user's ``on_save_checkpoint`` or a callback's state adds is stored
when the codec can store it without pickle (plain data, tensors, ``Path``, sets, tuple keys,
dates, ``deque``); anything else is left out of the checkpoint with a warning naming its key,
never a stopped run (a lenient :class:`~lightning_bpk.records.StateRecord`).

**RNG states** (torch, CUDA when available, numpy, Python ``random``) go under :data:`RNG_KEY`;
Lightning ignores the key, :func:`~lightning_bpk.runtime.rng.restore_rng` puts them back (the
callback does, at fit start); :mod:`lightning_bpk.runtime.rng` captures them, per device.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import state
from lightning_bpk.checkpointer._view import open_data_directory
from lightning_bpk.layout import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    SCHEDULER_KEY,
    SHARDED_INDEX_KEY,
    TRAINER_KEY,
    _numbered_key,
)
from lightning_bpk.records import (
    LrSchedulerRecord,
    ModuleRecord,
    OptimizerRecord,
    Record,
    RecordError,
    StateRecord,
    files,
)
from lightning_bpk.records.base import _class_name
from lightning_bpk.runtime.rng import capture_rng
from lightning_bpk.store import location

__all__ = [
    "from_records",
    "is_checkpoint_directory",
    "load",
    "to_records",
]

# What resume cannot do without (the optimizers and schedulers may be none); a sharded
# checkpoint's index stands for the model (its shards hold the model; Checkpointer's has_key).
REQUIRED_KEYS = (f"{MODEL_KEY}|{SHARDED_INDEX_KEY}", TRAINER_KEY)
# Top-level keys this package adds to Lightning's dict (Lightning ignores unknown keys).
RNG_KEY = "lightning_bpk_rng"
DROPPED_KEY = "lightning_bpk_dropped_hyperparameters"
PREEMPTED_KEY = "lightning_bpk_preempted"
# Added by load() to a checkpoint directory's dict (never saved): the optimizer and scheduler
# classes its records were saved from, for ``_class_mismatches``.
CLASSES_KEY = "lightning_bpk_classes"
# Lightning keys holding hyper-parameters (values may be arbitrary user objects) ...
HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
# ... and the OmegaConf container *type* it stores beside them (a class: never storable).
HPARAM_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
# Hyper-parameter values of these exact types always store (the rest are tried first).
_PLAIN = (bool, int, float, str)
# Keys whose content lives in the module/optimizer/scheduler records, not in trainer.bpk.
_RECORD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers")


# --- Lightning dict -> storable data --------------------------------------------------------------


def _storable(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of Lightning's dict without the hyper-parameters the codec cannot store.

    Each dropped one is named in a warning and listed under :data:`DROPPED_KEY`.

    >>> _storable({"hyper_parameters": {"lr": 0.1, "fn": print}})[DROPPED_KEY]
    ['hyper_parameters.fn']
    """
    out = dict(checkpoint)
    dropped = []
    for key in HPARAM_TYPE_KEYS:
        if key in out:
            del out[key]
            dropped.append(key)
    for key in HPARAM_KEYS:
        hparams = out.get(key)
        if not isinstance(hparams, Mapping):
            continue
        kept = {}
        for name, value in hparams.items():
            if value is None or type(value) in _PLAIN:
                kept[name] = value  # stored as it is: no trial encode, at every save
                continue
            try:
                state.encode({name: value})
            except state.StateError as e:
                dropped.append(f"{key}.{name}")
                warnings.warn(
                    f"hyper-parameter {name!r} is not saved in the checkpoint: {e}",
                    stacklevel=2,
                )
            else:
                kept[name] = value
        out[key] = kept
    if dropped:
        out[DROPPED_KEY] = dropped
    return out


def to_records(
    checkpoint: Mapping[str, Any],
    module: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    rng: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Split Lightning's dict into the files of a checkpoint directory (see module docstring).

    The module, optimizers and schedulers are recorded from the live objects (so optimizer state
    is keyed by parameter id); every other key goes to ``trainer`` with the RNG states ``rng``
    (:func:`~lightning_bpk.runtime.rng.capture_rng`'s; None: captured now).
    """
    data: dict[str, Any] = {MODEL_KEY: ModuleRecord.from_module(module)}
    for i, optimizer in enumerate(optimizers):
        data[_numbered_key(OPTIMIZER_KEY, i)] = OptimizerRecord.from_optimizer(optimizer, module)
    return data | _other_records(checkpoint, schedulers, rng)


def _other_records(
    checkpoint: Mapping[str, Any], schedulers: Sequence[Any], rng: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The schedulers' records and ``trainer`` (the other keys, with the RNG states ``rng``,
    None: captured now): what a sharded save's rank 0 writes beside the shards of the model
    and optimizers."""
    data: dict[str, Any] = {}
    for i, scheduler in enumerate(schedulers):
        data[_numbered_key(SCHEDULER_KEY, i)] = LrSchedulerRecord.from_scheduler(scheduler)
    rest = {k: v for k, v in _storable(checkpoint).items() if k not in _RECORD_KEYS}
    rest[RNG_KEY] = capture_rng() if rng is None else rng
    data[TRAINER_KEY] = StateRecord(rest, lenient=True)
    return data


# --- storable data -> Lightning dict --------------------------------------------------------------


def _numbered(data: Mapping[str, Any], base: str) -> list[Any]:
    items: list[Any] = []
    while _numbered_key(base, len(items)) in data:
        items.append(data[_numbered_key(base, len(items))])
    return items


def from_records(data: Mapping[str, Any], source: str = "<checkpoint>") -> dict[str, Any]:
    """Rebuild Lightning's dict from what :meth:`Checkpointer.load_checkpoint` returned.

    Optimizer state comes back positional, as ``optimizer.state_dict()`` has it, in the parameter
    order the optimizer had when it was saved (Lightning loads it by position).
    """
    missing = [k for k in (MODEL_KEY, TRAINER_KEY) if k not in data]
    if missing:
        raise RecordError("validation", f"{source}: no {missing} entries; it holds {sorted(data)}")
    trainer = data[TRAINER_KEY]
    model = data[MODEL_KEY]
    if not isinstance(trainer, dict) or not isinstance(model, ModuleRecord):
        raise RecordError("validation", f"{source}: '{TRAINER_KEY}'/'{MODEL_KEY}' have wrong kinds")
    checkpoint = dict(trainer)
    state_dict: OrderedDict[str, torch.Tensor] = OrderedDict(model.tensors)
    for alias, target in model.aliases.items():
        state_dict[alias] = model.tensors[target]
    checkpoint["state_dict"] = state_dict
    optimizers = _numbered(data, OPTIMIZER_KEY)
    schedulers = _numbered(data, SCHEDULER_KEY)
    checkpoint["optimizer_states"] = [r.state_dict() for r in optimizers]
    checkpoint["lr_schedulers"] = [r.state_dict() for r in schedulers]
    checkpoint[CLASSES_KEY] = {
        "optimizers": [r.optimizer_class for r in optimizers],
        "lr_schedulers": [r.scheduler_class for r in schedulers],
    }
    return checkpoint


def _class_mismatches(
    classes: Mapping[str, Sequence[str]],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
) -> list[str]:
    """How the live optimizers and schedulers differ from the classes (:data:`CLASSES_KEY`) a
    checkpoint was saved with, in number or class; empty when they match.

    Lightning loads optimizer state by position and does not look at the class: Adam's state in
    SGD fails at the first step, in AdamW it silently takes Adam's hyper-parameters.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    >>> _class_mismatches({"optimizers": ["torch.optim.adam.Adam"]}, [opt], [])
    ['optimizer 0 was saved as torch.optim.adam.Adam, the module configures torch.optim.sgd.SGD']
    """
    problems = []
    for what, key, live in (
        ("optimizer", "optimizers", optimizers),
        ("LR scheduler", "lr_schedulers", schedulers),
    ):
        saved = list(classes.get(key, []))
        configured = [_class_name(x) for x in live]
        if len(saved) != len(configured):
            problems.append(
                f"it holds {len(saved)} {what} state(s) {saved}, the module configures "
                f"{len(configured)} {configured}"
            )
            continue
        problems += [
            f"{what} {i} was saved as {a}, the module configures {b}"
            for i, (a, b) in enumerate(zip(saved, configured, strict=True))
            if a != b
        ]
    return problems


# --- files and directories --------------------------------------------------------------------


def _save_file(checkpoint: Mapping[str, Any], path: str | os.PathLike[str]) -> Path | str:
    """Write Lightning's whole dict (plus RNG states) as one burnpack at exactly ``path``.

    Atomic: a scratch file beside ``path`` is fsynced and renamed over it, so a failure leaves
    an existing file as it was. Raises :class:`RecordError` naming what cannot be stored.
    """
    return _write_record(_file_record(checkpoint), path)


def _file_record(checkpoint: Mapping[str, Any]) -> StateRecord:
    """The StateRecord ``_save_file`` writes: Lightning's storable dict plus RNG states."""
    value = _storable(checkpoint)
    value[RNG_KEY] = capture_rng()
    return StateRecord(value, lenient=True)


def _write_record(record: Record, path: str | os.PathLike[str]) -> Path | str:
    """Write ``record`` atomically at exactly ``path`` (a path or URL; no ``.bpk`` suffix rule),
    streamed (:func:`lightning_bpk.records.files.write_record`): the file appears whole or not
    at all. A full disk raises an ``OSError``; other format errors a RecordError."""
    return files.write_record(record, path)


def is_checkpoint_directory(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> bool:
    """True for a Checkpointer's data directory (``{base}/{prefix}.{N}``), local or a URL;
    ``{prefix}.{N}`` also stands for a re-save's ``{prefix}.{N}~<hex>``."""
    try:
        return open_data_directory(path, storage_options) is not None
    except RecordError:
        return True  # a data directory that is not known to be complete: load says so


def load(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read a checkpoint directory or a single-file checkpoint back into Lightning's dict.

    ``path`` may be a URL (read with ranged requests into memory, checksums verified).
    Read-only; the same bytes give every rank the same dict. Raises ``FileNotFoundError`` for a
    missing path and :class:`RecordError` (naming the file) for anything unreadable.
    """
    target = location(path)
    view = open_data_directory(target, storage_options)
    if view is not None:
        data = view.load()
        if data is None:
            raise RecordError("io", f"{target}: checkpoint {view.iteration} is not complete")
        return from_records(data, str(target))
    try:
        record = files.read_record(target, storage_options)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint not found: {target}") from None
    if not isinstance(record, StateRecord) or not isinstance(record.value, dict):
        raise RecordError(
            "validation", f"{target}: holds a {record.kind!r} record, not a checkpoint"
        )
    return record.value
