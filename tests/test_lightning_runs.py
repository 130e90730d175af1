"""Which fits BurnpackCheckpoint saves and resumes in, with real Trainers and real folders:
smoke tests and tuners leave nothing, several callbacks in one Trainer, a folder's numbering,
and gin bindings the callback cannot apply."""

from __future__ import annotations

from pathlib import Path

import gin
import lightning as L
import pytest
from lightning.pytorch.tuner import Tuner

from lightning_bpk.lightning.callback import BurnpackCheckpoint, CheckpointResumeError

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(300)

GIN_DIR = Path(__file__).resolve().parent.parent / "lightning_bpk" / "gin"


def _fit(root: Path, epochs: int, *callbacks: BurnpackCheckpoint, **options: object):
    L.seed_everything(0)
    model = TinyModel()
    ckpt_path = options.pop("ckpt_path", None)
    trainer = make_trainer(str(root), epochs, list(callbacks), **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _numbers(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[1].partition("~")[0]) for p in directory.glob("ckpt.*"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the ownership bookkeeping, with its content."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".lightning_bpk.")
    }


def test_fast_dev_run_saves_nothing_and_the_real_run_then_starts_at_epoch_0(tmp_path, caplog):
    _fit(tmp_path, 3, BurnpackCheckpoint(), fast_dev_run=True)
    assert _numbers(tmp_path / "checkpoints") == []  # it used to write ckpt.0
    assert "neither resumes nor saves in fast_dev_run=True" in caplog.text
    callback = BurnpackCheckpoint()
    trainer, _ = _fit(tmp_path, 2, callback)
    assert callback.restored_number is None and trainer.global_step == 12
    assert _numbers(tmp_path / "checkpoints") == [0, 1]


def test_a_smoke_test_or_a_tuner_in_a_real_runs_folder_neither_resumes_nor_changes_it(tmp_path):
    _fit(tmp_path, 2, BurnpackCheckpoint())
    before = _files(tmp_path / "checkpoints")
    callback = BurnpackCheckpoint()
    trainer, _ = _fit(tmp_path, 4, callback, fast_dev_run=2)
    assert callback.restored_number is None and trainer.global_step == 2  # not resumed
    L.seed_everything(0)
    callback, model = BurnpackCheckpoint(), TinyModel()
    trainer = make_trainer(str(tmp_path), 4, [callback])
    Tuner(trainer).lr_find(model, num_training=5)
    assert callback.restored_number is None  # it tuned the model it was given
    assert _files(tmp_path / "checkpoints") == before


def test_two_resuming_callbacks_are_refused_at_setup_and_the_advice_works(tmp_path):
    def callbacks(**second: object) -> list[BurnpackCheckpoint]:
        return [
            BurnpackCheckpoint(dirpath=tmp_path / "epochs"),
            BurnpackCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=4, **second),
        ]

    with pytest.raises(CheckpointResumeError, match=r"2 BurnpackCheckpoint callbacks .* resume"):
        _fit(tmp_path, 2, *callbacks())
    assert not (tmp_path / "epochs").exists()  # refused before anything was created
    first = callbacks(resume=False, overwrite=True)
    _fit(tmp_path, 2, *first)
    assert _numbers(tmp_path / "epochs") == [0, 1]
    assert _numbers(tmp_path / "steps") == [4, 8, 12]
    again = callbacks(resume=False, overwrite=True)
    trainer, _ = _fit(tmp_path, 3, *again)  # the re-run continues the resuming one's folder
    assert again[0].restored_number == 1 and trainer.global_step == 18
    assert _numbers(tmp_path / "epochs") == [0, 1, 2]
    assert _numbers(tmp_path / "steps") == [4, 8, 16, 18]  # its 12, ahead of the run, went
    with pytest.raises(CheckpointResumeError, match="save into the same folder"):
        _fit(tmp_path, 2, BurnpackCheckpoint(), BurnpackCheckpoint(resume=False))


def test_a_switch_of_numbering_is_refused_even_with_overwrite_and_the_advice_works(tmp_path):
    _fit(tmp_path, 2, BurnpackCheckpoint(every_n_train_steps=4))  # by global step: 4 .. 12
    folder = tmp_path / "checkpoints"
    before = _files(folder)
    for overwrite in (False, True):
        with pytest.raises(
            CheckpointResumeError,
            match=r"numbered by global step \(checkpoint 12 was saved at epoch 1, global step "
            r"12\).*by epoch.*Nothing was changed",
        ):
            _fit(tmp_path, 4, BurnpackCheckpoint(overwrite=overwrite))
        assert _files(folder) == before  # overwrite=True deleted nothing
    callback = BurnpackCheckpoint(dirpath=tmp_path / "by-epoch")
    trainer, _ = _fit(tmp_path, 4, callback, ckpt_path=str(folder / "ckpt.12"))
    assert trainer.global_step == 24 and _numbers(tmp_path / "by-epoch") == [2, 3]
    callback = BurnpackCheckpoint(every_n_train_steps=4)  # the folder's own numbering goes on
    trainer, _ = _fit(tmp_path, 3, callback)
    assert callback.restored_number == 12 and trainer.global_step == 18


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            "Checkpointer.checkpoint_duration = 2",
            "Checkpointer.checkpoint_duration = 2 (bind BurnpackCheckpoint.checkpoint_duration)",
        ),
        ("get_latest_checkpoint_number.verify = False", "get_latest_checkpoint_number.verify"),
        (GIN_DIR / "checkpointer.gin", "Checkpointer.keep_every = None"),
    ],
)
def test_a_gin_binding_the_callback_cannot_apply_is_an_error(tmp_path, config, named):
    if isinstance(config, Path):
        gin.parse_config_file(str(config))
    else:
        gin.parse_config(config)
    try:
        with pytest.raises(
            CheckpointResumeError,
            match="does not read: .*" + named.replace("(", r"\(").replace(")", r"\)"),
        ):
            _fit(tmp_path, 1, BurnpackCheckpoint())
    finally:
        gin.clear_config()
    assert not (tmp_path / "checkpoints").exists()


def test_the_gin_files_for_the_callback_apply_under_it(tmp_path):
    for name in ("digits.gin", "every_2_epochs.gin", "keep_every_5.gin"):
        gin.parse_config_file(str(GIN_DIR / name), skip_unknown=True)
    try:
        callback = BurnpackCheckpoint()
        _fit(tmp_path, 3, callback)
    finally:
        gin.clear_config()
    assert (callback.checkpoint_frequency, callback.keep_every) == (2, 5)
    assert _numbers(tmp_path / "checkpoints") == [0, 2]
