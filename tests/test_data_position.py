"""Exact mid-epoch resume, in process: a real Trainer stopped by an exception at a chosen step
(on disk exactly what a SIGKILL leaves: saves are synchronous), then a new Trainer and model
resume from the newest checkpoint. Each resumed run must see the uninterrupted run's batches
from the save point on and end with bit-identical weights. (SIGKILL and DDP: test_e2e_resume,
test_ddp.)"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader

from lightning_bpk import BurnpackCheckpoint, CheckpointResumeError
from lightning_bpk.checkpointer import get_latest_checkpoint_number
from lightning_bpk.lightning import trainer_state
from lightning_bpk.lightning.data_position import (
    POSITION_KEY,
    REPLAY,
    SAMPLER,
    STATEFUL,
    loader_kind,
)
from lightning_bpk.records import StateRecord

from lightning_tiny import BATCH_SIZE, SEED, Stream, TinyModel, make_trainer

pytestmark = pytest.mark.timeout(300)


class Crash(Exception):
    """Stands in for a SIGKILL: training stops dead after the given global step."""


class CrashAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Crash


class Stateful(TinyModel):
    def train_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(self._data(0, 48), batch_size=BATCH_SIZE, shuffle=True)


class TermAt(CrashAt):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # the callback saves at the next batch end


def fit(root: Path, crash: int | None = None, model_type=TinyModel, callbacks=(), **options):
    """One run (fresh or resumed): returns (weights or None if it stopped, callback, id lines).

    ``crash``: stop dead after that global step (or ``("term", step)``: send SIGTERM there)."""
    L.seed_everything(SEED)
    model = model_type(one_cycle=options.pop("one_cycle", False))
    model.ids_file = root.with_suffix(".ids")
    before = model.ids_file.read_text().splitlines() if model.ids_file.exists() else []
    callback = BurnpackCheckpoint(every_n_train_steps=options.pop("every", None))
    if isinstance(crash, tuple):
        extra = [TermAt(crash[1])]
    else:
        extra = [CrashAt(crash)] if crash is not None else []
    trainer = make_trainer(
        str(root), options.pop("epochs", 4), [callback, *extra, *callbacks], **options
    )
    try:
        trainer.fit(model)
    except (Crash, SystemExit):
        weights = None
    else:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    lines = model.ids_file.read_text().splitlines()[len(before) :]
    return weights, callback, lines


def assert_exact(reference, resumed) -> None:
    assert list(resumed) == list(reference)
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name  # bitwise, not allclose


def steps(lines: list[str]) -> list[int]:
    return [int(line.split()[2]) for line in lines]


def resume_case(tmp_path, crashes, model_type=TinyModel, **options):
    """Reference run, then runs stopped after each step in ``crashes`` (see :func:`fit`), then a
    run to the end; each resumed run's id lines must be the reference's from its checkpoint's
    step on."""
    reference, _, ref_lines = fit(tmp_path / "ref", model_type=model_type, **dict(options))
    root = tmp_path / "run"
    for crash in [*crashes, None]:
        latest = get_latest_checkpoint_number(root / "checkpoints") if root.exists() else -1
        step = (
            0
            if latest < 0
            else StateRecord.load(root / "checkpoints" / f"ckpt.{latest}" / "trainer.bpk").value[
                "global_step"
            ]
        )
        weights, callback, lines = fit(root, crash, model_type=model_type, **dict(options))
        assert lines == [line for line in ref_lines if int(line.split()[2]) >= step][: len(lines)]
    assert_exact(reference, weights)
    return callback


@pytest.mark.parametrize(
    "options, crashes",
    [
        # a per-step OneCycleLR sized from estimated_stepping_batches (the data is set up inside
        # configure_optimizers, before the checkpoint is applied): a crash (an epoch-end resume),
        # then SIGTERM mid-epoch (it used to replay the epoch and step OneCycleLR past its end)
        (dict(one_cycle=True, epochs=3), [8, ("term", 15)]),
        # gradient accumulation 2: saves only at optimizer steps, never inside a window
        (dict(every=2, accumulate_grad_batches=2, epochs=2), [3]),
        # validation twice per epoch: a save due before a validation waits until after it
        (dict(every=3, val_check_interval=0.5, epochs=2), [4, 10]),
        # max_steps instead of max_epochs (per-epoch checkpoints), ending mid-epoch
        (dict(max_steps=16, epochs=-1), [10]),
    ],
    ids=["one_cycle", "accumulate", "val_check_interval", "max_steps"],
)
def test_crash_and_resume_is_exact(tmp_path, options, crashes):
    resume_case(tmp_path, crashes, **options)


def test_stateful_dataloader_resumes_through_its_own_state(tmp_path):
    resume_case(tmp_path, [9], model_type=Stateful, every=3, epochs=2)
    value = StateRecord.load(tmp_path / "run" / "checkpoints" / "ckpt.9" / "trainer.bpk").value
    assert value[POSITION_KEY][0]["loaders"][0]["kind"] == STATEFUL


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_each_loader_of_a_combined_loader_is_positioned(tmp_path, mode):
    """A CombinedLoader of two shuffled loaders (6 and 3 batches per epoch), crashed after steps
    7 and SIGTERMed after step 9 (saved after 10: in max_size_cycle the shorter loader is in
    its second pass there, in max_size it is exhausted); min_size (3 batches per epoch) after
    steps 4 and 7 (saved after 8)."""
    model_type = functools.partial(TinyModel, data=mode)
    crashes = [4, ("term", 7)] if mode == "min_size" else [7, ("term", 9)]
    resume_case(
        tmp_path, crashes, model_type=model_type, every=2, epochs=3 if mode == "min_size" else 2
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    latest = get_latest_checkpoint_number(checkpoints)
    value = StateRecord.load(checkpoints / f"ckpt.{latest}" / "trainer.bpk").value
    assert [p["kind"] for p in value[POSITION_KEY][0]["loaders"]] == [SAMPLER, SAMPLER]


def test_iterable_dataset_without_state_warns_once_and_reads_up_to_the_save(tmp_path, recwarn):
    """Crashed after step 9 (checkpoint 8, epoch 1 batch 2), then to the end: the resumed run
    continues at step 8 (not at the epoch's start, 6) and, as this dataset draws its order from
    the global RNG, exactly; one warning per fit says what is done and when it is exact."""
    model_type = functools.partial(TinyModel, data="iterable")
    callback = resume_case(tmp_path, [9], model_type=model_type, every=4, epochs=2)
    messages = [str(w.message) for w in recwarn if "cannot be positioned" in str(w.message)]
    assert messages  # once per process (Python's warning filter): test_e2e_resume counts it
    assert "exact only if the dataset yields the same batches" in messages[0]
    value = StateRecord.load(tmp_path / "run" / "checkpoints" / "ckpt.8" / "trainer.bpk").value
    assert value[trainer_state.PREEMPTED_KEY] == {"epoch": 1, "batches": 2, "replay": False}
    assert value["global_step"] == 8 and callback.restored_number == 8


def test_loader_kinds():
    data = TinyModel()._data(0, 8)
    assert loader_kind(DataLoader(data, shuffle=True)) == SAMPLER
    assert loader_kind(DataLoader(Stream(data))) == REPLAY
    from torchdata.stateful_dataloader import StatefulDataLoader

    assert loader_kind(StatefulDataLoader(data)) == STATEFUL


@pytest.mark.parametrize("how", ["max_epochs", "max_steps", "early_stopping"])
def test_a_finished_run_stays_finished_and_says_so(tmp_path, how, caplog):
    options = {"max_epochs": dict(epochs=2), "max_steps": dict(max_steps=9, epochs=-1)}.get(how, {})
    callbacks = []
    if how == "early_stopping":  # patience 0 on a loss that cannot improve: stops after epoch 1
        callbacks = [EarlyStopping("val_loss", patience=0, mode="max", stopping_threshold=None)]
        options = dict(epochs=10)
    every = 4 if how == "max_steps" else None  # step-numbered, or the default per epoch
    _, first, _ = fit(tmp_path / "run", callbacks=callbacks, every=every, **dict(options))
    saved = first.last_saved_number
    with caplog.at_level("INFO", logger="lightning_bpk"):
        _, again, more = fit(tmp_path / "run", callbacks=callbacks, every=every, **dict(options))
    assert more == []  # not one more batch
    assert again.restored_number == saved and again.last_saved_number is None
    assert "already finished" in caplog.text
    assert get_latest_checkpoint_number(tmp_path / "run" / "checkpoints") == saved


def test_time_trigger_saves_at_step_boundaries_numbered_by_global_step(tmp_path):
    from datetime import timedelta

    L.seed_everything(SEED)
    callback = BurnpackCheckpoint(train_time_interval=timedelta(microseconds=1))
    trainer = make_trainer(str(tmp_path), 1, [callback], accumulate_grad_batches=2)
    trainer.fit(TinyModel())
    # due after every batch, saved only after the 3 optimizer steps (6 batches, accumulating 2)
    numbers = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "checkpoints").glob("ckpt.*"))
    assert numbers == [1, 2, 3] and callback.last_saved_number == 3


@pytest.mark.parametrize(
    "settings",
    [
        dict(every_n_train_steps=0),
        dict(every_n_train_steps=2.5),
        dict(train_time_interval=60),
        dict(every_n_train_steps=10, checkpoint_frequency=2),
    ],
)
def test_invalid_triggers_are_refused_at_construction(settings):
    with pytest.raises(ValueError, match=r"every_n_train_steps|train_time_interval|frequency"):
        BurnpackCheckpoint(**settings)


class _ComputedSteps(TinyModel):
    """TinyModel whose optimizer steps take 20 ms, as a real model's compute does: "auto" weighs
    a save against the step time, and TinyModel's sub-millisecond steps make every save look
    expensive (on a loaded machine, more than the run's remaining steps)."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)  # the step's compute, not a wait for anything
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("budget", [1.0, 1e-6])
def test_auto_interval_keeps_saves_under_the_overhead_budget(tmp_path, caplog, budget):
    L.seed_everything(SEED)
    callback = BurnpackCheckpoint(
        every_n_train_steps="auto", max_overhead=budget, checkpoint_duration=100
    )
    with caplog.at_level("INFO", logger="lightning_bpk"):
        make_trainer(str(tmp_path), 6, [callback], num_sanity_val_steps=0).fit(_ComputedSteps())
    # the first save (after 10 steps) measured the cost; the interval follows from it
    assert "every_n_train_steps='auto'" in caplog.text and callback.auto_interval is not None
    numbers = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "checkpoints").glob("ckpt.*"))
    saved_between = [n for n in numbers if 10 < n < 36]  # 36: the final save
    # a 100 % budget saves again within the run (a save costs well under the 26 remaining steps
    # of 20 ms, even on a loaded machine); a budget of a millionth never again
    assert len(saved_between) >= 1 if budget == 1.0 else saved_between == []


def _samples_of_epoch(lines: list[str], epoch: int, before_step: int | None = None) -> list[int]:
    return [
        int(i)
        for line in lines
        if int(line.split()[0]) == epoch
        and (before_step is None or int(line.split()[2]) < before_step)
        for i in line.split()[3].split(",")
    ]


def test_a_changed_accumulate_grad_batches_continues_only_at_a_window_boundary(tmp_path):
    """Saved after batch 2 of epoch 1 with accumulate_grad_batches=1 (checkpoint 8): resumed
    with 4 it is refused (batch 2 is inside a window of 4), naming both values, and nothing is
    trained; resumed with 2 (batch 2 is a boundary) it continues, and epoch 1 holds each
    sample once. A new batch size (4) continues in samples the same way."""
    fit(tmp_path / "run", crash=9, every=2, epochs=2)
    lines = (tmp_path / "run.ids").read_text().splitlines()
    with pytest.raises(CheckpointResumeError) as refused:
        fit(tmp_path / "run", every=2, epochs=2, accumulate_grad_batches=4)
    message = str(refused.value)
    assert "accumulate_grad_batches=4" in message and "accumulate_grad_batches=1" in message
    assert "epoch 1" in message and "ckpt.8" in message
    assert (tmp_path / "run.ids").read_text().splitlines() == lines  # not one batch more
    _, callback, resumed = fit(tmp_path / "run", every=2, epochs=2, accumulate_grad_batches=2)
    assert callback.restored_number == 8
    epoch_1 = _samples_of_epoch(lines, 1, before_step=8) + _samples_of_epoch(resumed, 1)
    assert sorted(epoch_1) == list(range(48))

    fit(tmp_path / "b4", crash=9, every=2, epochs=2)
    before = _samples_of_epoch((tmp_path / "b4.ids").read_text().splitlines(), 1, before_step=8)
    model_type = functools.partial(TinyModel, batch_size=4)
    _, _, resumed = fit(tmp_path / "b4", model_type=model_type, every=2, epochs=2)
    assert [line.split()[1] for line in resumed[:2]] == ["4", "5"]  # batch 4 of size 4 on
    assert sorted(before + _samples_of_epoch(resumed, 1)) == list(range(48))


def test_after_a_batch_size_change_the_log_names_the_batch_training_continues_at(tmp_path, caplog):
    """Checkpoint 8 follows batch 2 (batches of 8) of epoch 1: with batches of 4 the epoch
    continues at batch 4, and the log says so (it used to name batch 2)."""
    fit(tmp_path / "run", crash=9, every=2, epochs=2)
    model_type = functools.partial(TinyModel, batch_size=4)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        _, _, resumed = fit(tmp_path / "run", model_type=model_type, every=2, epochs=2)
    assert [line.split()[1] for line in resumed[:1]] == ["4"]
    assert "continuing training at epoch 1, batch 4 (global step 8)" in caplog.text


def test_a_loader_with_its_own_state_refuses_another_batch_size_mid_epoch(tmp_path):
    """A StatefulDataLoader counts its position in its own batches: resumed mid-epoch with
    another batch size it would skip the wrong samples, so the resume is refused, naming the
    setting with both values. (Crashed after step 10: checkpoint 9 is batch 3 of epoch 1.)"""
    fit(
        tmp_path / "run",
        crash=10,
        model_type=functools.partial(TinyModel, data="stateful"),
        every=3,
    )
    with pytest.raises(CheckpointResumeError, match="batch_size was 8, is now 4"):
        fit(
            tmp_path / "run",
            model_type=functools.partial(TinyModel, data="stateful", batch_size=4),
            every=3,
        )
