"""The callback as a Lightning citizen (lightning_bpk.lightning._best): best-k by a metric with
a real Trainer, ModelCheckpoint's attributes, ``ckpt_path="best"|"last"|<ckpt.N>`` and the
default of an evaluation after ``fit``, killed and resumed runs (local disk; moto over HTTP in
test_object_storage_best.py), and a real MLflow logger recording each checkpoint."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from best_run import SCORES, ScoredModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_bpk.checkpointer import list_checkpoints
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.records import ModuleRecord

from conftest import SCRIPTS, run_process
from lightning_tiny import TinyModel, make_trainer

RUN_TIMEOUT = 120
EPOCHS = len(SCORES)
# the two best of SCORES by "min" (NaN worst, ties to the older): epochs 3 (0.2) and 1 (0.3)
BEST = [3, 1]

pytestmark = pytest.mark.timeout(4 * RUN_TIMEOUT)


def _callback(root: Path, **options: Any) -> BurnpackCheckpoint:
    settings: dict[str, Any] = dict(checkpoint_duration=1, monitor="score", save_top_k=2)
    settings.update(options)
    return BurnpackCheckpoint(dirpath=root / "checkpoints", **settings)


def _complete(root: Path) -> list[int]:
    return sorted(e.number for e in list_checkpoints(root / "checkpoints") if e.complete)


def _weights_of(path: str | Path) -> dict[str, torch.Tensor]:
    return ModuleRecord.load(Path(path) / "model.bpk").tensors


def _same(model: torch.nn.Module, path: str | Path) -> bool:
    saved = _weights_of(path)
    return all(torch.equal(v.detach(), saved[k]) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, BurnpackCheckpoint]:
    """One run of EPOCHS epochs keeping the two best by ``score`` plus the last."""
    root = tmp_path_factory.mktemp("fitted")
    callback = _callback(root)
    trainer = make_trainer(str(root), EPOCHS, [callback])
    trainer.fit(ScoredModel())
    return root, trainer, callback


def test_best_k_plus_the_last_are_kept_with_their_metric(fitted) -> None:
    root, _, callback = fitted
    assert _complete(root) == sorted([*BEST, EPOCHS - 1])
    directory = root / "checkpoints"
    assert callback.best_model_path == str(directory / "ckpt.3")
    assert callback.best_model_score is not None
    assert math.isclose(callback.best_model_score.item(), 0.2, rel_tol=1e-6)
    assert [Path(p).name for p in callback.best_k_models] == ["ckpt.3", "ckpt.1"]
    assert callback.kth_best_model_path == str(directory / "ckpt.1")
    assert callback.kth_value is not None
    assert math.isclose(callback.kth_value.item(), 0.3, rel_tol=1e-6)
    assert callback.last_model_path == str(directory / f"ckpt.{EPOCHS - 1}")
    assert callback.current_score is not None
    assert math.isclose(callback.current_score.item(), SCORES[-1], rel_tol=1e-6)
    manifest = json.loads((directory / "sentinel_checkpoint_complete.3").read_text())
    assert manifest["metric"]["name"] == "score" and manifest["metric"]["mode"] == "min"


def test_the_same_choice_as_model_checkpoint_on_the_same_metric(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ours = _callback(tmp_path, checkpoint_duration=1, save_top_k=3)
    reference = ModelCheckpoint(dirpath=tmp_path / "mc", monitor="score", save_top_k=3)
    make_trainer(str(tmp_path), EPOCHS, [ours, reference]).fit(ScoredModel())
    chosen = sorted(int(Path(p).name.split(".")[1]) for p in ours.best_k_models)
    theirs = sorted(int(Path(p).name.split("=")[1].split("-")[0]) for p in reference.best_k_models)
    assert chosen == theirs == [1, 3, 6]
    assert _complete(tmp_path) == [1, 3, 6, EPOCHS - 1]


def test_evaluation_after_fit_defaults_to_the_best(fitted) -> None:
    _, trainer, callback = fitted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "the best model ... will be used"
        trainer.test()  # no model: Lightning's default is ckpt_path="best"
    assert trainer.ckpt_path == callback.best_model_path
    assert _same(trainer.lightning_module, callback.best_model_path)
    trainer.validate(ckpt_path="best")
    assert trainer.ckpt_path == callback.best_model_path


def test_ckpt_path_last_and_a_directory_in_validate_test_predict(fitted) -> None:
    root, trainer, callback = fitted
    model = ScoredModel()
    trainer.validate(model, ckpt_path="last")
    assert trainer.ckpt_path == callback.last_model_path
    assert _same(model, callback.last_model_path)
    one = root / "checkpoints" / "ckpt.1"
    trainer.test(model, ckpt_path=str(one))
    assert trainer.ckpt_path == str(one) and _same(model, one)
    trainer.predict(model, dataloaders=model.val_dataloader(), ckpt_path="best")
    assert _same(model, callback.best_model_path)


def test_a_new_process_reads_best_and_last_from_the_directory(fitted) -> None:
    root, _, callback = fitted
    fresh = _callback(root)
    trainer = make_trainer(str(root), EPOCHS, [fresh])
    model = ScoredModel()
    trainer.test(model, ckpt_path="best")
    assert trainer.ckpt_path == callback.best_model_path and _same(model, callback.best_model_path)
    assert fresh.best_k_models.keys() == callback.best_k_models.keys()
    trainer.test(model, ckpt_path="last")
    assert trainer.ckpt_path == callback.last_model_path


def test_fit_from_the_best(fitted, tmp_path: Path) -> None:
    callback = fitted[2]
    again = make_trainer(str(tmp_path), EPOCHS + 1, [_callback(tmp_path)])
    model = ScoredModel()
    again.fit(model, ckpt_path=callback.best_model_path)
    assert again.ckpt_path == callback.best_model_path
    # epochs 4.. in a new directory: the two best of those (0.4, 0.3) and the last
    assert _complete(tmp_path) == [5, 6, EPOCHS]


def test_without_monitor_the_best_is_the_last(tmp_path: Path) -> None:
    callback = BurnpackCheckpoint(dirpath=tmp_path / "checkpoints")
    trainer = make_trainer(str(tmp_path), 2, [callback])
    trainer.fit(TinyModel())
    last = str(tmp_path / "checkpoints" / "ckpt.1")
    assert callback.best_model_path == callback.last_model_path == last
    assert callback.best_k_models == {} and callback.best_model_score is None
    with pytest.raises(ValueError, match="set monitor"):
        BurnpackCheckpoint(save_top_k=3)
    with pytest.raises(ValueError, match="mode must be"):
        BurnpackCheckpoint(monitor="x", mode="lowest")


def test_a_missing_metric_warns_before_validation_and_raises_after(tmp_path: Path) -> None:
    step_saves = _callback(tmp_path / "a", monitor="absent", every_n_train_steps=2)
    trainer = make_trainer(str(tmp_path / "a"), 1, [step_saves], limit_val_batches=0)
    with pytest.warns(UserWarning, match="could not find the monitored key"):
        trainer.fit(TinyModel())  # no validation has run: warned, not among the best
    assert step_saves.best_k_models == {}
    epoch_saves = _callback(tmp_path / "b", monitor="absent")
    trainer = make_trainer(str(tmp_path / "b"), 1, [epoch_saves])
    with pytest.raises(MisconfigurationException, match="absent"):
        trainer.fit(TinyModel())  # after validation ran, as ModelCheckpoint


def _run(root: Path, *options: object, check: bool = True) -> Any:
    command = [sys.executable, SCRIPTS / "best_run.py", "--root", root, *options]
    return run_process(command, timeout=RUN_TIMEOUT, check=check)


def _result(stdout: str) -> dict[str, Any]:
    [line] = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ``RESULT`` of one uninterrupted best_run.py with a ModelCheckpoint beside ours: the
    reference of every killed-and-resumed case (the kill point does not change it)."""
    return _result(_run(tmp_path_factory.mktemp("reference"), "--model-checkpoint").stdout)


@pytest.mark.parametrize("kill_at", [3, 6])
def test_killed_and_resumed_keeps_exactly_the_best_and_dopamines(
    tmp_path: Path, kill_at: int, uninterrupted: dict[str, Any]
) -> None:
    reference = uninterrupted
    killed = _run(tmp_path / "run", "--kill-at-epoch", kill_at, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _result(_run(tmp_path / "run").stdout)
    assert resumed["restored"] == kill_at - 1
    assert resumed["best_k"] == reference["best_k"] == BEST
    assert sorted(reference["model_checkpoint"]) == sorted(BEST)
    assert _complete(tmp_path / "run") == sorted([*BEST, EPOCHS - 1])  # the k best + the last d=1


def test_a_real_mlflow_logger_records_each_checkpoint(tmp_path: Path, monkeypatch) -> None:
    mlflow = pytest.importorskip("mlflow", reason="`make test` installs mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store, offline
    from lightning.pytorch.loggers import MLFlowLogger

    calls: list[str] = []

    class Recording(MLFlowLogger):
        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            calls.append(checkpoint_callback.last_model_path)
            super().after_save_checkpoint(checkpoint_callback)

    uri = (tmp_path / "mlruns").as_uri()
    logger = Recording(experiment_name="best", tracking_uri=uri, log_model="all")
    callback = _callback(tmp_path)
    trainer = make_trainer(str(tmp_path), 3, [callback], logger=logger)
    trainer.fit(ScoredModel())
    directory = tmp_path / "checkpoints"
    assert calls == [str(directory / f"ckpt.{n}") for n in range(3)]  # after each commit
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    logged = sorted(a.path for a in client.list_artifacts(logger.run_id))
    assert logged == ["ckpt.0", "ckpt.1", "ckpt.2"]
    files = sorted(a.path for a in client.list_artifacts(logger.run_id, "ckpt.2"))
    assert "ckpt.2/model.bpk" in files and "ckpt.2/trainer.bpk" in files
    local = Path(client.download_artifacts(logger.run_id, "ckpt.2", str(tmp_path / "dl")))
    downloaded = ModuleRecord.load(local / "model.bpk").tensors
    assert downloaded.keys() == _weights_of(directory / "ckpt.2").keys()


def test_with_async_save_loggers_hear_of_each_checkpoint_once_durable(tmp_path, monkeypatch):
    """The loggers hear of an asynchronous save once it is committed (at the next save, the
    last one when fit ends); MLflow's log_model=True logs the best directories at the end."""
    mlflow = pytest.importorskip("mlflow", reason="`make test` installs mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    directory = tmp_path / "checkpoints"
    told: list[tuple[str, list[int]]] = []

    class Recording(MLFlowLogger):
        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            # the checkpoint it is told of, and what is committed then
            told.append((Path(checkpoint_callback.last_model_path).name, _complete(tmp_path)))
            super().after_save_checkpoint(checkpoint_callback)

    uri = (tmp_path / "mlruns").as_uri()
    logger = Recording(experiment_name="async", tracking_uri=uri, log_model=True)
    callback = _callback(tmp_path, async_save=True, checkpoint_duration=4)  # none removed
    make_trainer(str(tmp_path), 4, [callback], logger=logger).fit(ScoredModel())
    assert [name for name, _ in told] == [f"ckpt.{n}" for n in range(4)]
    assert all(n in numbers for n, (_, numbers) in enumerate(told))  # each one committed
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    assert sorted(a.path for a in client.list_artifacts(logger.run_id)) == ["ckpt.1", "ckpt.3"]
    assert callback.best_model_path == str(directory / "ckpt.3")


def test_overwrite_leaves_no_removed_checkpoint_among_the_best(tmp_path: Path) -> None:
    make_trainer(str(tmp_path), 4, [_callback(tmp_path)]).fit(ScoredModel())
    assert _complete(tmp_path) == [1, 3]
    again = _callback(tmp_path, resume=False, overwrite=True)
    trainer = make_trainer(str(tmp_path), 1, [again])
    trainer.fit(ScoredModel())
    assert _complete(tmp_path) == [0]
    assert (
        list(again.best_k_models)
        == [again.best_model_path]
        == [str(tmp_path / "checkpoints" / "ckpt.0")]
    )
