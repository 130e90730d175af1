"""BurnpackCheckpoint with real in-process Trainers: layout, retention, resume choice, failures."""

from __future__ import annotations

import errno
import itertools
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import gin
import lightning as L
import pytest
import torch

from lightning_bpk import _fs
from lightning_bpk.checkpointer import (
    CheckpointWarning,
    get_latest_checkpoint_number,
    verify_checkpoint,
)
from lightning_bpk.lightning import trainer_state
from lightning_bpk.lightning.callback import (
    BurnpackCheckpoint,
    CheckpointResumeError,
    CheckpointSaveError,
)
from lightning_bpk.records import (
    LrSchedulerRecord,
    ModuleRecord,
    OptimizerRecord,
    StateRecord,
    load_record,
)

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)


class _StartEpoch(L.Callback):
    """Remembers the epoch and step training (re)started at."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch, self.step = trainer.current_epoch, trainer.global_step


def _fit(root: Path, epochs: int, ckpt_path: object = None, **options: object):
    L.seed_everything(0)
    callback, start = BurnpackCheckpoint(**options), _StartEpoch()
    model = TinyModel()
    trainer = make_trainer(str(root), epochs, [callback, start])
    trainer.fit(model, ckpt_path=ckpt_path)
    return callback, start, model


def _numbers(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[1]) for p in directory.glob("ckpt.*"))


def test_layout_records_and_retention(tmp_path):
    callback, _, model = _fit(tmp_path, 3, checkpoint_duration=2)
    directory = tmp_path / "checkpoints"
    assert _numbers(directory) == [1, 2]  # checkpoint 0 collected: 2 - 1*2 = 0
    assert sorted(p.name for p in (directory / "ckpt.2").iterdir()) == [
        "model.bpk",
        "optim.bpk",
        "scheduler.bpk",
        "trainer.bpk",
    ]
    assert verify_checkpoint(directory, 2) == []
    assert isinstance(load_record(directory / "ckpt.2" / "model.bpk"), ModuleRecord)
    optim = load_record(directory / "ckpt.2" / "optim.bpk")
    assert isinstance(optim, OptimizerRecord)
    assert any(name.endswith(".momentum.moment_1") for name in optim.to_content()[0])
    scheduler = load_record(directory / "ckpt.2" / "scheduler.bpk")
    assert isinstance(scheduler, LrSchedulerRecord) and scheduler.state["last_epoch"] == 3
    trainer = load_record(directory / "ckpt.2" / "trainer.bpk")
    assert isinstance(trainer, StateRecord)
    value = trainer.value
    assert (value["epoch"], value["global_step"]) == (2, 18)
    assert value["hyper_parameters"] == {"hidden": 16, "lr": 0.05}
    assert value["pytorch-lightning_version"] == L.__version__
    assert value["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    assert set(value[trainer_state.RNG_KEY]) >= {"torch", "numpy", "python"}
    saved = ModuleRecord.load(directory / "ckpt.2" / "model.bpk").tensors
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert callback.last_saved_number == 2 and callback.restored_number is None


def test_frequency_and_keep_every(tmp_path):
    _fit(tmp_path, 6, checkpoint_frequency=2, checkpoint_duration=1, keep_every=2)
    # saved 0, 2, 4; after 4, everything <= 4 - 2*1 goes except multiples of 2*2; the last
    # epoch, 5, is saved whatever the frequency (a finished run is saved, so it stays finished)
    assert _numbers(tmp_path / "checkpoints") == [0, 4, 5]


def test_resume_continues_at_the_next_epoch_and_logs_it(tmp_path, caplog):
    _fit(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        callback, start, _ = _fit(tmp_path, 4)
    assert callback.restored_number == 1
    assert (start.epoch, start.step) == (2, 12)
    assert "continuing training at epoch 2 (global step 12) after checkpoint 1" in caplog.text
    assert "saved at the end of epoch 1" in caplog.text
    assert _numbers(tmp_path / "checkpoints") == [0, 1, 2, 3]


def _override(number: int) -> None:
    gin.bind_parameter(
        "lightning_bpk.checkpointer.get_latest_checkpoint_number.override_number", number
    )


def _snapshot(root: Path, *, bookkeeping: bool = True) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: modification time and content (without the directory lock
    and ownership lease when ``bookkeeping`` is False)."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and (bookkeeping or not p.name.startswith(".lightning_bpk."))
    }


def test_resume_false_and_explicit_ckpt_path_and_gin_override(tmp_path):
    _fit(tmp_path, 3)
    directory = tmp_path / "checkpoints"
    callback, start, _ = _fit(tmp_path, 4, ckpt_path=directory / "ckpt.2")
    assert (callback.restored_number, start.epoch) == (None, 3)  # explicit path wins

    _override(3)  # the one the explicit run saved
    try:
        callback, start, _ = _fit(tmp_path, 5)
    finally:
        gin.clear_config()
    assert (callback.restored_number, start.epoch) == (3, 4)

    callback, start, _ = _fit(tmp_path, 1, resume=False, overwrite=True)
    assert (callback.restored_number, start.epoch) == (None, 0)


def test_override_number_of_a_missing_checkpoint_stops_in_setup_and_changes_nothing(tmp_path):
    _fit(tmp_path, 4, checkpoint_duration=2)  # keeps 2 and 3
    before = _snapshot(tmp_path)
    for number in (0, 7):  # collected, and a typo
        _override(number)
        try:
            with pytest.raises(
                CheckpointResumeError,
                match=rf"checkpoint {number} .*override_number = {number}.*no sentinel.*"
                r"Complete checkpoints there: \[3, 2\]\. Nothing was changed",
            ):
                _fit(tmp_path, 6)
        finally:
            gin.clear_config()
    assert _snapshot(tmp_path) == before
    _override(1)
    try:
        with pytest.raises(CheckpointResumeError, match="Complete checkpoints there: none"):
            _fit(tmp_path / "elsewhere", 2)
    finally:
        gin.clear_config()
    assert not (tmp_path / "elsewhere").exists()


def test_a_run_never_saves_over_checkpoints_it_did_not_resume_past(tmp_path, caplog):
    _fit(tmp_path, 3)
    directory = tmp_path / "checkpoints"
    before = _snapshot(tmp_path, bookkeeping=False)
    with pytest.raises(CheckpointResumeError, match=r"starts from scratch .*\[2, 1, 0\]"):
        _fit(tmp_path, 3, resume=False)
    with pytest.raises(CheckpointResumeError, match=r"resumes from .*ckpt\.0 .*\[2, 1\]"):
        _fit(tmp_path, 3, ckpt_path=directory / "ckpt.0")
    _override(1)
    try:
        with pytest.raises(CheckpointResumeError, match=r"epoch 2\), .* \[2\] .*overwrite"):
            _fit(tmp_path, 3)
    finally:
        gin.clear_config()
    # Nothing saved, nothing removed; the refused runs did take the directory's ownership lease
    # (in setup, before the epoch they start at is known), which is no checkpoint.
    assert _snapshot(tmp_path, bookkeeping=False) == before

    gin.parse_config("lightning_bpk.BurnpackCheckpoint.overwrite = True")  # explicit, from gin
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_bpk"):
            _, start, _ = _fit(tmp_path, 1, resume=False)
    finally:
        gin.clear_config()
    assert "overwrite=True: removing checkpoints [2, 1, 0]" in caplog.text
    assert (start.epoch, _numbers(directory)) == (0, [0])  # no checkpoint of the old run left


class _WithOptimizer(TinyModel):
    def __init__(self, optimizer: type, **options: object) -> None:
        super().__init__()
        self.optimizer, self.options = optimizer, options

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer(self.parameters(), lr=0.05, **self.options)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@pytest.mark.parametrize(
    ("optimizer", "options"),
    [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {})],
    ids=["SGD", "AdamW"],
)
def test_resuming_into_another_optimizer_class_names_both(tmp_path, optimizer, options):
    _fit(tmp_path, 1)  # TinyModel: Adam
    trainer = make_trainer(str(tmp_path), 2, [BurnpackCheckpoint()])
    name = f"{optimizer.__module__}.{optimizer.__qualname__}"
    with pytest.raises(
        CheckpointResumeError,
        match=rf"ckpt\.0: optimizer 0 was saved as torch\.optim\.adam\.Adam, the module "
        rf"configures {re.escape(name)}",
    ):
        trainer.fit(_WithOptimizer(optimizer, **options))
    assert _numbers(tmp_path / "checkpoints") == [0]  # stopped before training


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"checkpoint_duration": 0}, "checkpoint_duration must be an int >= 1, got 0"),
        ({"keep_every": 0}, "keep_every must be an int >= 1, got 0"),
        ({"checkpoint_frequency": 2.5}, "checkpoint_frequency must be an int >= 1, got 2.5"),
        ({"checkpoint_file_prefix": "../x"}, "checkpoint_file_prefix '../x' is not a safe"),
        ({"sentinel_file_identifier": "a b"}, "sentinel_file_identifier 'a b' is not a safe"),
    ],
)
def test_invalid_settings_are_refused_when_the_callback_is_built(options, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        BurnpackCheckpoint(**options)


def test_resume_falls_back_past_a_done_sentinel_without_trainer_bpk(tmp_path):
    _fit(tmp_path, 3)
    directory = tmp_path / "checkpoints"
    (directory / "sentinel_checkpoint_complete.2").write_bytes(b"done")  # Dopamine-style
    (directory / "ckpt.2" / "trainer.bpk").unlink()
    with pytest.warns(CheckpointWarning, match=r"checkpoint 2 .* skipped: .*trainer\.bpk: missing"):
        callback, start, _ = _fit(tmp_path, 3)
    assert (callback.restored_number, start.epoch) == (1, 2)
    assert verify_checkpoint(directory, 2) == []  # saved again, complete this time


def test_resume_skips_a_damaged_checkpoint(tmp_path):
    _fit(tmp_path, 3)
    model_file = tmp_path / "checkpoints" / "ckpt.2" / "model.bpk"
    raw = bytearray(model_file.read_bytes())
    raw[-1] ^= 0xFF  # flip a bit in the last tensor's data: only the checksum notices
    model_file.write_bytes(raw)
    with pytest.warns(CheckpointWarning, match="checkpoint 2 .* skipped"):
        callback, start, _ = _fit(tmp_path, 3)
    assert (callback.restored_number, start.epoch) == (1, 2)


class _ObjectHparams(TinyModel):
    def __init__(self, loss: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_unencodable_hyperparameter_is_named_and_the_rest_is_saved(tmp_path):
    L.seed_everything(0)
    trainer = make_trainer(str(tmp_path), 1, [BurnpackCheckpoint()])
    with pytest.warns(UserWarning, match="hyper-parameter 'loss' is not saved"):
        trainer.fit(_ObjectHparams(loss=torch.nn.MSELoss()))
    value = StateRecord.load(tmp_path / "checkpoints" / "ckpt.0" / "trainer.bpk").value
    assert value[trainer_state.DROPPED_KEY] == ["hyper_parameters.loss"]
    assert value["hyper_parameters"] == {"hidden": 16, "lr": 0.05}


class _DiskFullFromEpoch(L.Callback):
    """Every file write fails with ENOSPC from epoch ``epoch`` on (a fault at the write call)."""

    def __init__(self, epoch: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.epoch, self.monkeypatch = epoch, monkeypatch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:

            def full_disk(f: object, data: object) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            self.monkeypatch.setattr(_fs, "write_all", full_disk)


def test_disk_full_raises_clearly_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    L.seed_everything(0)
    trainer = make_trainer(
        str(tmp_path), 4, [BurnpackCheckpoint(), _DiskFullFromEpoch(2, monkeypatch)]
    )
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint 2 .* No space left"):
        trainer.fit(TinyModel())
    monkeypatch.undo()
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "ckpt.0",
        "ckpt.1",
        "sentinel_checkpoint_complete.0",
        "sentinel_checkpoint_complete.1",
    ]
    assert verify_checkpoint(directory, 0) == [] and verify_checkpoint(directory, 1) == []


def _saved(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The numbers of the "saved checkpoint N" log lines."""
    return [int(m) for m in re.findall(r"saved checkpoint (\d+) at ", caplog.text)]


def test_auto_interval_after_a_resume_measures_first_instead_of_saving_every_step(tmp_path, caplog):
    _fit(tmp_path, 2, every_n_train_steps="auto")  # 12 steps: measured and saved at step 10
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        callback, start, _ = _fit(tmp_path, 6, every_n_train_steps="auto")
    assert start.step == 12 and callback.restored_number == 12
    saved = _saved(caplog)
    # a fresh process knows neither a step's time nor a save's cost: it measures them as a fresh
    # run does (a save 10 steps in), then keeps to the interval it chose; the final save is made
    assert saved[0] == 12 + 10 and saved[-1] == 36, saved
    assert callback.auto_interval is not None
    assert all(b - a >= min(callback.auto_interval, 36 - a) for a, b in itertools.pairwise(saved))
    assert len(saved) < 24 // 2  # not after every one of its 24 steps


def _fit_timed(root: Path, epochs: int, max_time: timedelta | None) -> tuple[L.Trainer, object]:
    L.seed_everything(0)
    callback = BurnpackCheckpoint()
    trainer = make_trainer(str(root), epochs, [callback], max_time=max_time)
    trainer.fit(TinyModel())
    return trainer, callback


def test_a_run_stopped_by_max_time_continues_with_a_larger_max_time_or_none(tmp_path, caplog):
    # Lightning's Timer stops at the end of the first step that ends past 1 ms: the first on
    # this VM, a later one of the 6 in epoch 0 where steps are faster
    tiny = timedelta(milliseconds=1)
    stopped, _ = _fit_timed(tmp_path, 3, tiny)
    steps = stopped.global_step
    assert 1 <= steps < 6  # in epoch 0 (TinyModel: 6 steps an epoch)
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        again, callback = _fit_timed(tmp_path, 3, tiny)  # the same max_time: still finished
    assert again.global_step == steps and callback.restored_number == 0
    assert "already finished at checkpoint 0 (max_time=0:00:00.001000 was reached" in caplog.text
    larger, callback = _fit_timed(tmp_path, 2, timedelta(hours=1))
    assert callback.restored_number == 0 and larger.current_epoch == 2
    assert larger.global_step == steps + 6  # epoch 0 ended at the stop (as Lightning ends it)
    unlimited, callback = _fit_timed(tmp_path, 3, None)
    assert callback.restored_number == 1 and unlimited.global_step == steps + 12


def test_a_step_numbered_run_names_its_start_as_a_global_step(tmp_path):
    _fit(tmp_path, 1, every_n_train_steps=4)
    with pytest.raises(CheckpointResumeError, match=r"starts from scratch \(global step 0\)"):
        _fit(tmp_path, 1, every_n_train_steps=4, resume=False)


def test_ckpt_path_last_means_the_newest_complete_checkpoint_said_once(tmp_path, caplog, recwarn):
    with caplog.at_level(logging.INFO, logger="lightning_bpk"):
        callback, start, _ = _fit(tmp_path, 1, ckpt_path="last")  # nothing saved yet
        assert callback.restored_number is None and start.epoch == 0
        assert f'ckpt_path="last": no complete checkpoint in {tmp_path / "checkpoints"} yet' in (
            caplog.text
        )
        callback, start, _ = _fit(tmp_path, 2, ckpt_path="last")
    assert callback.restored_number == 0 and start.epoch == 1
    newest = f'ckpt_path="last": the newest complete checkpoint in {tmp_path / "checkpoints"} is 0'
    assert newest in caplog.text
    # Lightning's "No checkpoint will be loaded" would contradict that: not shown
    assert not [w for w in recwarn if "no last checkpoint" in str(w.message)]


@pytest.mark.parametrize("name", ["model.bpk", "trainer.bpk"])
def test_ckpt_path_of_a_file_inside_a_checkpoint_names_the_directory(tmp_path, name):
    _fit(tmp_path, 1)
    directory = tmp_path / "checkpoints" / "ckpt.0"
    with pytest.raises(CheckpointResumeError) as refused:
        _fit(tmp_path, 2, ckpt_path=directory / name)
    assert str(refused.value) == (
        f"ckpt_path {directory / name} is a file inside checkpoint 0 ({directory}); a "
        f"checkpoint is its whole directory: pass ckpt_path={str(directory)!r}"
    )


def test_preemption_signals_are_plain_ints_from_numbers_signals_or_names():
    import signal

    import yaml

    default = BurnpackCheckpoint().preemption_signals
    assert default == (15, 10, 2) and all(type(s) is int for s in default)  # Ctrl-C too
    assert yaml.safe_dump(list(default))  # a config system (LightningCLI) can write them out
    given = BurnpackCheckpoint(preemption_signals=["SIGTERM", "usr1", signal.SIGINT, 12])
    assert given.preemption_signals == (15, 10, 2, 12)
    assert all(type(s) is int for s in given.preemption_signals)
    with pytest.raises(ValueError, match=r"preemption_signals: 'SIGNOPE' is not a signal"):
        BurnpackCheckpoint(preemption_signals=["SIGNOPE"])


class _WarmUp(L.Callback):
    """A user's callback that adds a per-step scheduler of its own to the module's optimizer."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        warm_up = torch.optim.lr_scheduler.LinearLR(trainer.optimizers[0], 0.5, total_iters=9)
        trainer.lr_scheduler_configs.append(LRSchedulerConfig(warm_up, interval="step"))


def test_a_scheduler_a_callback_adds_at_fit_start_is_saved_and_restored(tmp_path):
    def fit(root: Path, epochs: int):
        L.seed_everything(0)
        model, callback = TinyModel(), BurnpackCheckpoint()
        trainer = make_trainer(str(root), epochs, [callback, _WarmUp()])
        trainer.fit(model)
        return trainer, model, callback

    fit(tmp_path / "run", 1)
    assert (tmp_path / "run" / "checkpoints" / "ckpt.0" / "scheduler-1.bpk").is_file()
    trainer, model, callback = fit(tmp_path / "run", 3)
    assert callback.restored_number == 0
    reference, reference_model, _ = fit(tmp_path / "reference", 3)
    states = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
    assert states == [c.scheduler.state_dict() for c in reference.lr_scheduler_configs]
    for a, b in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(a, b)


class _DeleteTheDirectory(L.Callback):
    """Deletes the run's whole memory:// directory after the first checkpoint, as a user or a
    lifecycle rule deleting the bucket mid-run would."""

    def __init__(self, url: str) -> None:
        self.url = url

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            import fsspec

            fsspec.filesystem("memory").rm(self.url, recursive=True)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_directory_deleted_mid_run_is_not_reported_as_untouched(
    tmp_path: Path, async_save: bool
) -> None:
    """The save after the deletion fails naming what happened; it must not promise that the
    earlier checkpoints are untouched: they went with the directory."""
    url = f"memory://deleted-mid-run-{async_save}/run"
    callback = BurnpackCheckpoint(dirpath=url, async_save=async_save)
    trainer = make_trainer(str(tmp_path), 3, [callback, _DeleteTheDirectory(url)])
    with pytest.raises(CheckpointSaveError) as error:
        trainer.fit(TinyModel())
    message = " ".join([str(error.value), *getattr(error.value, "__notes__", [])])
    assert "deleted" in message
    assert "untouched" not in message
    assert "superseded" not in message


def test_a_checkpoint_committed_between_the_choice_and_the_take_over_is_resumed(tmp_path):
    """The old run (a zombie, or the preempted run on its way out) commits checkpoint 2 after
    the new run chose checkpoint 1 and before it took the directory over. The new run chooses
    again once it holds the lease and continues from 2, instead of stopping because its saves
    would replace a newer complete checkpoint (which left both runs exiting 1: the old one
    fenced at its next save, the new one refused)."""
    base = tmp_path / "checkpoints"
    L.seed_everything(0)
    make_trainer(str(tmp_path), 3, [BurnpackCheckpoint(dirpath=base)]).fit(TinyModel())
    sentinel = base / "sentinel_checkpoint_complete.2"
    in_flight = tmp_path / "in-flight"
    sentinel.rename(in_flight)  # the old run's commit of 2, not landed yet

    class CommittedMeanwhile(BurnpackCheckpoint):
        def _choose_resume(self, dirpath: Any) -> Any:
            chosen = super()._choose_resume(dirpath)
            if in_flight.exists():
                in_flight.rename(sentinel)  # it lands now, between the choice and the take-over
            return chosen

    L.seed_everything(0)
    callback = CommittedMeanwhile(dirpath=base)
    make_trainer(str(tmp_path), 4, [callback]).fit(TinyModel())
    assert callback.restored_number == 2
    assert get_latest_checkpoint_number(base, verify=True) == 3
