"""Record files on a store: what :func:`save_record` reports is what :func:`describe` reads back
from the file, on both backends, through the page cache and through ``O_DIRECT``."""

from __future__ import annotations

import uuid

import pytest
import torch

from lightning_bpk.records import ModuleRecord, StateRecord
from lightning_bpk.records.files import describe, open_pack, save_record
from lightning_bpk.store import open_store


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "run")
    return open_store(f"memory://bucket-{uuid.uuid4().hex[:8]}/run")


@pytest.mark.parametrize("numel", [3, 2_000_000], ids=["small", "large"])
def test_save_record_describes_the_file_as_written(store, numel):
    store.check(create=True)
    record = ModuleRecord({"w": torch.arange(float(numel)), "b": torch.ones(7)}, param_ids={"w": 1})
    described = save_record(record, store, "ckpt/model.bpk")
    assert described == describe(store, "ckpt/model.bpk")
    assert described.kind == "module" and described.size == store.size("ckpt/model.bpk")
    with open_pack(store, "ckpt/model.bpk", head=described) as pack:  # head digest checked
        assert torch.equal(pack.tensor("w"), record.tensors["w"])
    assert save_record(StateRecord({"epoch": 3}), store, "t.bpk").kind == "state"
