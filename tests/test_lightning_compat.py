"""Each touch of Lightning's private API (lightning_bpk/lightning/_compat.py), checked against the
installed Lightning: if an upgrade renames or reshapes one, the test named after it fails."""

from __future__ import annotations

import inspect
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.connectors import signal_connector

from lightning_bpk.lightning import _compat as compat

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)


class _Probe(L.Callback):
    """Runs the compat functions on a live trainer at the end of the first epoch."""

    def __init__(self) -> None:
        self.dumped: dict = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dumped = compat.dump_checkpoint(trainer)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[L.Trainer, _Probe]:
    probe = _Probe()
    trainer = make_trainer(
        str(tmp_path_factory.mktemp("compat")), 1, [probe], limit_train_batches=2
    )
    trainer.fit(TinyModel())
    return trainer, probe


def test_dump_checkpoint_is_lightnings_full_dict(fitted) -> None:
    _, probe = fitted
    for key in ("epoch", "global_step", "loops", "state_dict", "optimizer_states", "callbacks"):
        assert key in probe.dumped, key


def test_resume_start_interception_loads_our_dict_once(fitted, tmp_path: Path) -> None:
    trainer, probe = fitted
    connector = trainer._checkpoint_connector
    # Lightning's signature, which our one-shot replacement mimics
    params = list(inspect.signature(type(connector).resume_start).parameters)
    assert params[:3] == ["self", "checkpoint_path", "weights_only"]
    calls = []

    def resume_start(original, checkpoint_path, weights_only):
        calls.append((callable(original), checkpoint_path, weights_only))
        return tmp_path / "ckpt.3", dict(probe.dumped)

    compat.intercept_resume_start(trainer, resume_start)
    assert "resume_start" in vars(connector)
    connector.resume_start(None, True)
    assert calls == [(True, None, True)]
    assert "resume_start" not in vars(connector)  # one shot: back to the class method
    assert connector._ckpt_path == tmp_path / "ckpt.3"
    assert connector._loaded_checkpoint["global_step"] == probe.dumped["global_step"]
    connector._ckpt_path = connector._loaded_checkpoint = None

    compat.intercept_resume_start(trainer, resume_start)
    compat.release_resume_start(trainer)  # fit failed before Lightning called it
    assert "resume_start" not in vars(connector)


def test_lightning_signal_handlers_are_recognised() -> None:
    assert signal_connector.__name__ == compat.SIGNAL_CONNECTOR_MODULE
    trainer = L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu")
    connector = signal_connector._SignalConnector(trainer)
    assert compat.is_lightning_signal_handler(connector._sigterm_notifier_fn)
    assert not compat.is_lightning_signal_handler(print)
    composed = signal_connector._HandlersCompose([connector._sigterm_notifier_fn, print])
    assert compat.composed_signal_handlers(composed) == [connector._sigterm_notifier_fn, print]
    assert compat.composed_signal_handlers(signal.SIG_DFL) == [signal.SIG_DFL]
    # what the callback's preemption handler still runs: the user's, not Lightning's notifier
    assert compat.foreign_signal_handlers(composed) == [print]
    assert compat.foreign_signal_handlers(signal.SIG_DFL) == []


def test_generate_state_key_names_the_callback(tmp_path: Path) -> None:
    from lightning_bpk.lightning.callback import BurnpackCheckpoint

    key = compat.generate_state_key(BurnpackCheckpoint(tmp_path), dirpath=str(tmp_path))
    assert key.startswith("BurnpackCheckpoint{") and str(tmp_path) in key


class _BatchProbe(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append((compat.validation_follows(trainer), compat.is_last_batch(trainer)))


def test_train_dataloader_interception_validation_follows_and_last_batch(tmp_path: Path) -> None:
    installed: list[tuple[object, int]] = []
    probe = _BatchProbe()
    # one_cycle reads estimated_stepping_batches: the data is set up inside configure_optimizers
    trainer = make_trainer(str(tmp_path), 1, [probe], val_check_interval=0.5)
    compat.intercept_train_dataloaders(trainer, lambda loader, n: installed.append((loader, n)))
    trainer.fit(TinyModel(one_cycle=True))
    assert len(installed) == 1 and installed[0][1] == 1  # the training loader, once
    assert installed[0][0] is trainer.train_dataloader
    # 6 batches, validation after batches 3 and 6
    assert probe.seen == [(False, False), (False, False), (True, False)] * 1 + [
        (False, False),
        (False, False),
        (True, True),
    ]
    compat.release_train_dataloaders(trainer)
    assert "setup_data" not in vars(trainer.fit_loop)


def test_handlers_restored_at_teardown_are_the_ones_found_at_fit_start(fitted) -> None:
    trainer, _ = fitted
    connector = trainer._signal_connector
    assert compat.handlers_restored_at_teardown(trainer) is connector._original_handlers
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        connector.register_signal_handlers()  # what fit does before training
        restored = compat.handlers_restored_at_teardown(trainer)
        assert restored[signal.SIGUSR2] == previous
        restored[signal.SIGUSR2] = signal.SIG_IGN
        connector.teardown()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN  # teardown reinstalled ours
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_cluster_environment_is_the_detected_or_given_one() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    plain = L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    assert isinstance(compat.cluster_environment(plain), LightningEnvironment)
    slurm = SLURMEnvironment(auto_requeue=False)
    given = L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu", plugins=[slurm])
    assert compat.cluster_environment(given) is slurm
    # the requeue signal: only under SLURM with auto-requeue on
    assert compat.slurm_requeue_signal(plain) is None
    assert compat.slurm_requeue_signal(given) is None  # auto_requeue=False
    requeued = SLURMEnvironment(requeue_signal=signal.SIGUSR2)
    on = L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu", plugins=[requeued])
    assert compat.slurm_requeue_signal(on) == signal.SIGUSR2


class _Crash(L.Callback):
    """Fails the fit after global step ``step`` (the callback's step saves before it are made)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("crash")


def _swa_fit(root: Path, *extra: L.Callback) -> tuple[L.Trainer, L.LightningModule]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_bpk import BurnpackCheckpoint

    L.seed_everything(0)
    model = TinyModel()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    callbacks = [swa, BurnpackCheckpoint(every_n_train_steps=5), *extra]
    trainer = make_trainer(str(root), 3, callbacks)
    trainer.fit(model)
    return trainer, model


def test_resume_swa_mid_epoch_rebuilds_the_swalr_of_the_resumed_epoch(tmp_path: Path) -> None:
    reference, reference_model = _swa_fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="crash"):
        _swa_fit(tmp_path / "run", _Crash(16))  # after the save of step 15, in SWA's epoch 2
    trainer, model = _swa_fit(tmp_path / "run")  # resumes at epoch 2, batch 3
    assert trainer.global_step == reference.global_step == 18
    [config] = trainer.lr_scheduler_configs
    assert type(config.scheduler).__name__ == "SWALR"
    state = config.scheduler.state_dict()
    assert state == reference.lr_scheduler_configs[0].scheduler.state_dict()
    assert state["_step_count"] == 3  # stepped at the ends of epochs 1 and 2, as never stopped
    for a, b in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert a.detach().equal(b.detach())


def test_timer_duration_is_max_time_in_seconds(tmp_path: Path) -> None:
    from datetime import timedelta

    from lightning.pytorch.callbacks import Timer

    trainer = make_trainer(str(tmp_path), 1, [], max_time=timedelta(milliseconds=1500))
    [timer] = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert compat.timer_duration(timer) == 1.5
    assert compat.timer_duration(Timer(duration=None)) is None


def _take_marked(trainer: L.Trainer, fitting: bool) -> object:
    return getattr(trainer, "_test_takes_last", False)


def _read_marked(trainer: L.Trainer) -> None:
    trainer._test_read_best = True  # type: ignore[attr-defined]


def test_route_ckpt_path_drops_only_the_contradicting_warning(tmp_path: Path) -> None:
    compat.route_ckpt_path(_take_marked, _read_marked)
    compat.route_ckpt_path(_take_marked, _read_marked)  # once per process, whoever asks again
    for takes in (False, True):
        trainer = make_trainer(str(tmp_path / str(takes)), 1, [], limit_train_batches=1)
        trainer._test_takes_last = takes  # type: ignore[attr-defined]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyModel(), ckpt_path="last")
        shown = [str(w.message) for w in caught if "no last checkpoint" in str(w.message)]
        assert len(shown) == (0 if takes else 1), shown
        assert trainer.ckpt_path is None and trainer.global_step == 1
    # outside fit, "last" is the path the taker gives (none: Lightning's warning stays)
    trainer.save_checkpoint(tmp_path / "given.ckpt")
    trainer._test_takes_last = str(tmp_path / "given.ckpt")  # type: ignore[attr-defined]
    trainer.validate(TinyModel(), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "given.ckpt")
    trainer._test_takes_last = None  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(TinyModel(), ckpt_path="last")
    assert [w for w in caught if "no last checkpoint" in str(w.message)]
    # "best" is read first, then resolved by Lightning (its default ModelCheckpoint's file)
    trainer.validate(TinyModel(), ckpt_path="best")
    assert trainer._test_read_best  # type: ignore[attr-defined]


def test_validation_has_run_and_mlflow_log_model(tmp_path: Path, monkeypatch) -> None:
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

    trainer = make_trainer(str(tmp_path), 1, [], limit_train_batches=1)
    assert not compat.validation_has_run(trainer)
    trainer.fit(TinyModel())
    assert compat.validation_has_run(trainer)
    assert compat.mlflow_log_model(CSVLogger(str(tmp_path))) is False
    pytest.importorskip("mlflow", reason="`make test` installs mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    assert compat.mlflow_log_model(MLFlowLogger(tracking_uri=uri, log_model="all")) == "all"


def test_build_module_builds_as_load_from_checkpoint_does(fitted) -> None:
    _, probe = fitted
    dumped = dict(probe.dumped, hyper_parameters={"hidden": 16, "lr": 0.05})
    model = compat.build_module(TinyModel, dumped, strict=True, hparams={"lr": 0.5})
    assert (model.hparams.hidden, model.hparams.lr) == (16, 0.5)
    weights = probe.dumped["state_dict"]
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_route_checkpoint_reader_answers_first_and_leaves_the_rest(tmp_path: Path) -> None:
    from lightning.pytorch.core import saving

    asked: list[object] = []
    compat.route_checkpoint_reader(asked.append)  # returns None: not its to read
    assert getattr(saving.pl_load, "_lightning_bpk_routed", False)
    with pytest.raises(FileNotFoundError):  # not ours: Lightning's reader reports it
        TinyModel.load_from_checkpoint(tmp_path / "missing.ckpt")
    assert asked == [tmp_path / "missing.ckpt"]
    compat._READERS.remove(asked.append)


def test_train_results_and_the_plateau_step_lightning_skips(fitted) -> None:
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    trainer, _ = fitted
    assert isinstance(compat.train_results(trainer), _ResultCollection)
    assert compat.plateau_step_skipped(trainer) is False  # a fit that did not restart
