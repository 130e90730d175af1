"""Lightning dict <-> records and files: exact types, positional optimizer state, RNG, errors."""

from __future__ import annotations

import datetime
import random
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.lightning import trainer_state
from lightning_bpk.lightning.trainer_state import DROPPED_KEY, RNG_KEY
from lightning_bpk.records import ModuleRecord, OptimizerRecord, RecordError
from lightning_bpk.runtime import rng


def _draws() -> tuple:
    return torch.rand(3), np.random.rand(3), random.random()


def test_rng_states_round_trip_through_a_file(tmp_path):
    path = trainer_state._save_file({"x": 1}, tmp_path / "c.ckpt")  # captures the RNG states
    expected = _draws()
    saved = trainer_state.load(path)[RNG_KEY]
    _draws()  # move every generator on
    rng.restore_rng(saved)
    again = _draws()
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]
    assert set(saved) >= {"torch", "numpy", "python"}


def test_unencodable_hyperparameters_are_dropped_by_name_with_a_warning():
    checkpoint = {
        "hyper_parameters": {"lr": 0.1, "loss": torch.nn.MSELoss(), "betas": (0.9, 0.99)},
        "hparams_type": dict,
        "epoch": 3,
    }
    with pytest.warns(UserWarning, match="'loss'"):
        out = trainer_state._storable(checkpoint)
    assert out["hyper_parameters"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert out[DROPPED_KEY] == ["hparams_type", "hyper_parameters.loss"]
    assert "hparams_type" not in out and checkpoint["hparams_type"] is dict  # input untouched


def test_other_unencodable_state_is_left_out_with_a_warning_naming_its_key(tmp_path):
    checkpoint = {"epoch": 1, "extra": {"obj": object(), "kept": [1, lambda: 0]}}
    with pytest.warns(UserWarning, match=r"\['extra'\]\['obj'\]") as caught:
        path = trainer_state._save_file(checkpoint, tmp_path / "c.ckpt")
    assert any("['extra']['kept'][1]" in str(w.message) for w in caught)
    loaded = trainer_state.load(path)
    assert loaded["epoch"] == 1 and loaded["extra"] == {"kept": [1, None]}


def test_user_types_pickle_free_storage_can_encode_are_stored_and_restored(tmp_path):
    """What a user puts into the checkpoint: paths, sets, tuple keys, dates, deques."""
    extra = {
        "path": Path("/data/run-1"),
        "seen": {3, 1, 2},
        "frozen": frozenset({"a"}),
        "by_pair": {(0, "train"): 1.5, (1, "val"): 2.5},
        "started": datetime.datetime(2026, 12, 5, 22, 0, tzinfo=datetime.UTC),
        "day": datetime.date(2026, 12, 5),
        "elapsed": datetime.timedelta(seconds=90, microseconds=5),
        "recent": deque([0.5, 0.25], maxlen=3),
    }
    path = trainer_state._save_file({"epoch": 2, "extra": extra}, tmp_path / "c.ckpt")
    loaded = trainer_state.load(path)["extra"]
    assert loaded == extra
    assert {k: type(v) for k, v in loaded.items()} == {k: type(v) for k, v in extra.items()}
    assert loaded["recent"].maxlen == 3


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(
        [
            {"params": net[2].parameters(), "lr": 0.01},
            {"params": list(net[0].parameters()) + list(net[1].parameters())},
        ],
        lr=0.1,
        betas=(0.8, 0.9),
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        net(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    return net, optimizer, scheduler


def test_records_round_trip_to_lightnings_dict_exactly(tmp_path):
    net, optimizer, scheduler = _trained()
    checkpoint = {
        "epoch": 2,
        "global_step": 2,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": net.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {"X{'a': 1}": {"best": torch.tensor(0.5), "k": {0: None}}},
    }
    data = trainer_state.to_records(checkpoint, net, [optimizer], [scheduler])
    assert sorted(data) == ["model", "optim", "scheduler", "trainer"]
    assert isinstance(data["optim"], OptimizerRecord)
    assert "state_dict" not in data["trainer"].value and RNG_KEY in data["trainer"].value
    Checkpointer(tmp_path).save_checkpoint(2, data)

    loaded = trainer_state.load(tmp_path / "ckpt.2")
    assert list(loaded["state_dict"]) == list(net.state_dict())
    for name, tensor in net.state_dict().items():
        assert torch.equal(loaded["state_dict"][name], tensor)
        assert loaded["state_dict"][name].dtype == tensor.dtype  # num_batches_tracked stays int64
    got, want = loaded["optimizer_states"][0], optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert type(got["param_groups"][0]["betas"]) is tuple
    assert sorted(got["state"]) == sorted(want["state"])  # int keys, not strings
    for i, s in want["state"].items():
        for key, value in s.items():
            assert torch.equal(got["state"][i][key], value)
            assert got["state"][i][key].dtype == value.dtype
    assert loaded["lr_schedulers"] == [scheduler.state_dict()]
    assert loaded["callbacks"]["X{'a': 1}"]["k"] == {0: None}
    assert loaded["callbacks"]["X{'a': 1}"]["best"].shape == ()
    assert loaded["loops"] == checkpoint["loops"]

    _, fresh_optimizer, _ = _trained()
    fresh_optimizer.load_state_dict(loaded["optimizer_states"][0])  # what Lightning does
    assert fresh_optimizer.state_dict()["param_groups"] == want["param_groups"]


def test_single_file_keeps_exact_types(tmp_path):
    checkpoint = {
        "state_dict": OrderedDict(w=torch.arange(3.0)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": []}],
        "betas": (0.9, 0.999),
        "none": None,
        "flag": True,
        "big": 2**70,
    }
    path = trainer_state._save_file(checkpoint, tmp_path / "sub" / "manual")
    assert path == tmp_path / "sub" / "manual"  # exactly the path Lightning asked for
    assert path.read_bytes()[:4] == b"NRUB"
    loaded = trainer_state.load(path)
    assert type(loaded["state_dict"]) is OrderedDict
    assert list(loaded["optimizer_states"][0]["state"]) == [0]
    assert loaded["optimizer_states"][0]["state"][0]["step"].shape == ()
    assert loaded["betas"] == (0.9, 0.999) and type(loaded["betas"]) is tuple
    assert (loaded["none"], loaded["flag"], loaded["big"]) == (None, True, 2**70)


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        trainer_state.load(tmp_path / "nope.ckpt")
    (tmp_path / "ckpt.3").mkdir()
    with pytest.raises(RecordError, match="no sentinel for checkpoint 3"):
        trainer_state.load(tmp_path / "ckpt.3")
    (tmp_path / "weird").mkdir()
    with pytest.raises(RecordError, match="not a checkpoint directory"):
        trainer_state.load(tmp_path / "weird")
    ModuleRecord.from_module(torch.nn.Linear(1, 1)).save(tmp_path / "m.bpk")
    with pytest.raises(RecordError, match="'module' record, not a checkpoint"):
        trainer_state.load(tmp_path / "m.bpk")


def test_cuda_rng_states_are_kept_per_device_and_old_lists_still_load(tmp_path):
    # A checkpoint of a 2-GPU single process (new form) and of an older version (a list per
    # device) both store and read back their CUDA states by device index; on a machine without
    # CUDA restoring them sets the other generators and leaves CUDA alone.
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(2)]
    for key, cuda in [("cuda_devices", {"0": states[0], "1": states[1]}), ("cuda", states)]:
        captured = {**rng.capture_rng(), key: cuda}
        expected = torch.rand(3)
        path = trainer_state._save_file({"rng": captured}, tmp_path / f"{key}.ckpt")
        loaded = trainer_state.load(path)["rng"]
        by_device = rng._cuda_states(loaded)
        assert sorted(by_device) == [0, 1]
        assert all(torch.equal(by_device[i], states[i]) for i in range(2))
        if not torch.cuda.is_available():
            rng.restore_rng(loaded)
            assert torch.equal(torch.rand(3), expected)
