"""Record files on a store: what :func:`save_record` reports is what :func:`describe` reads back
from the file, on both backends, through the page cache and through ``O_DIRECT``."""

from __future__ import annotations

import uuid

import pytest
import torch
from _backends import FaultyFileSystem, faulty  # noqa: F401 - a fixture, used by name

from lightning_bpk.errors import StorageError
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


@pytest.mark.usefixtures("faulty")
@pytest.mark.parametrize("failures", [1, 10**6], ids=["once", "for-good"])
def test_a_failing_object_read_raises_the_store_error_with_its_cause(failures):
    """The ranged reads of a record file fail (once: the retry reads it; for good: the
    retries are spent). The caller gets the store's StorageError naming the object, with the
    driver's error as its cause: never the BufferError of closing a mapping that a view of the
    failed read still exported."""
    store = open_store("faulty://bucket/run")
    store.check(create=True)
    tensors = {"w": torch.arange(4096.0), "b": torch.ones(3)}
    save_record(ModuleRecord(tensors), store, "model.bpk")
    FaultyFileSystem.faults["cat_ranges"] = (1, failures, ConnectionError)
    if failures == 1:
        with open_pack(store, "model.bpk") as pack:
            assert torch.equal(pack.tensors()["w"], tensors["w"])
        return
    with pytest.raises(StorageError, match=r"faulty://bucket/run/model\.bpk") as error:
        open_pack(store, "model.bpk")
    assert isinstance(error.value.__cause__, ConnectionError)
    chain, seen = error.value, []
    while chain is not None:
        seen.append(type(chain))
        chain = chain.__cause__ or chain.__context__
    assert BufferError not in seen, seen
