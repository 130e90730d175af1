"""Loading a callback's checkpoint outside fit: load_module into a class, an instance, a module
built on ``meta``; ``LightningModule.load_from_checkpoint`` on a ``ckpt.N`` directory."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.lightning.loading import load_module
from lightning_bpk.records import RecordError

from lightning_tiny import TinyModel, make_trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 2-epoch run of a TinyModel(hidden=12, lr=0.02): checkpoint 1 and its final weights."""
    root = tmp_path_factory.mktemp("trained")
    L.seed_everything(0)
    model = TinyModel(hidden=12, lr=0.02)
    make_trainer(str(root), 2, [BurnpackCheckpoint()]).fit(model)
    return root / "checkpoints" / "ckpt.1", model.state_dict()


def _same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_class_is_built_from_the_saved_hyper_parameters(trained):
    path, weights = trained
    model = load_module(path, TinyModel)
    assert (model.hparams.hidden, model.hparams.lr) == (12, 0.02)
    _same(model, weights)
    tuned = load_module(str(path), TinyModel, lr=1e-4)  # one hyper-parameter changed
    assert (tuned.hparams.hidden, tuned.hparams.lr) == (12, 1e-4)


def test_load_from_checkpoint_reads_a_checkpoint_directory(trained):
    path, weights = trained
    model = TinyModel.load_from_checkpoint(path)
    assert model.hparams.hidden == 12
    _same(model, weights)


def test_a_module_built_on_meta_is_materialised(trained):
    path, weights = trained
    with torch.device("meta"):
        empty = TinyModel(hidden=12)
    loaded = load_module(path, empty)
    assert loaded is empty
    assert {t.device.type for t in loaded.state_dict().values()} == {"cpu"}
    assert all(p.requires_grad for p in loaded.parameters())
    _same(loaded, weights)


def test_an_instance_of_another_shape_or_with_hyper_parameters_is_refused(trained):
    path, _ = trained
    with pytest.raises(RecordError, match="shape mismatch"):
        load_module(path, TinyModel(hidden=5))
    with pytest.raises(TypeError, match=r"\['lr'\] given with a TinyModel instance"):
        load_module(path, TinyModel(hidden=12), lr=0.1)
