"""The storage layer and the object-store commit protocol, on ``memory://`` and on a
fault-injecting fsspec filesystem that fails at the k-th call of each kind.

The same protocol against a real S3 server (moto over HTTP through s3fs) is in
``tests/test_object_storage.py``.
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    Staged,
    choose_resume,
    get_latest_checkpoint_number,
    list_checkpoints,
    verify_checkpoint,
)
from lightning_bpk.records import ModuleRecord, files
from lightning_bpk.store import (
    MissingDriverError,
    ObjectStore,
    StorageError,
    join,
    location,
    name_of,
    object_store,
    open_store,
    parent_of,
)
from lightning_bpk.store import objects as store_objects
from lightning_bpk.store.lease import CheckpointSupersededError, Lease

from conftest import check_a_50_gib_claim_is_refused


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setattr(store_objects, "BASE_WAIT", 0.001)
    monkeypatch.setattr(store_objects, "COMPLETION_WAIT", 0.05)


def _url() -> str:
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/run"


def _data(n: int) -> dict:
    torch.manual_seed(n)
    return {"model": ModuleRecord.from_module(torch.nn.Linear(4, 3)), "trainer": {"step": n}}


def _keys(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


# --- URLs ---------------------------------------------------------------------------------------


def test_location_keeps_urls_and_makes_local_paths(tmp_path):
    assert location("s3://b/run/") == "s3://b/run"
    assert location(f"file://{tmp_path}") == tmp_path
    assert location(str(tmp_path)) == tmp_path
    assert join("s3://b/run", "ckpt.1") == "s3://b/run/ckpt.1"
    assert parent_of("s3://b/run/ckpt.1") == "s3://b/run"


def test_missing_driver_names_the_extra(monkeypatch):
    def no_driver(url, **kwargs):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_driver)
    with pytest.raises(MissingDriverError, match=r"pip install 'lightning-bpk\[gcs\]'"):
        open_store("gs://bucket/run")


def test_unknown_protocol_is_an_error_naming_the_url():
    with pytest.raises(StorageError, match="nosuch://b/run"):
        open_store("nosuch://b/run")


def test_a_memory_url_is_stored_in_memory_and_never_in_a_local_folder(tmp_path, monkeypatch):
    """The old bug: Path("memory://b/run") made a local folder 'memory:' in the working dir."""
    monkeypatch.chdir(tmp_path)
    url = _url()
    checkpointer = Checkpointer(url)
    assert checkpointer.save_checkpoint(0, _data(0)) == f"{url}/ckpt.0"
    assert os.listdir(tmp_path) == []
    assert _keys(url) == [
        "ckpt.0/model.bpk",
        "ckpt.0/trainer.bpk",
        "sentinel_checkpoint_complete.0",
    ]
    assert get_latest_checkpoint_number(url, verify=True) == 0
    loaded = checkpointer.load_checkpoint(0)
    assert loaded["trainer"] == {"step": 0}
    assert torch.equal(loaded["model"].tensors["weight"], _data(0)["model"].tensors["weight"])


def test_an_object_is_read_in_at_most_read_streams_ranged_requests(monkeypatch):
    monkeypatch.setattr(store_objects, "READ_CHUNK", 1024)
    store = object_store(_url())
    data = os.urandom(100 * 1024 + 5)
    store.put("blob", data)
    requests = []
    cat_ranges = MemoryFileSystem.cat_ranges

    def counted(self, paths, starts, ends, **kwargs):
        requests.extend(zip(starts, ends, strict=True))
        return cat_ranges(self, paths, starts, ends, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", counted)
    buffer = bytearray(len(data) - 5)
    store.read_into("blob", buffer, offset=5)
    assert bytes(buffer) == data[5:]
    assert len(requests) == store_objects.READ_STREAMS  # 12.8 KiB each, not 100 of READ_CHUNK


# --- the protocol on memory:// ------------------------------------------------------------------


def test_retention_resave_and_listing_in_the_store():
    url = _url()
    checkpointer = Checkpointer(url, checkpoint_duration=2)
    for n in range(4):
        checkpointer.save_checkpoint(n, _data(n))
    assert [(e.number, e.complete) for e in list_checkpoints(url)] == [(3, True), (2, True)]
    checkpointer.save_checkpoint(3, _data(30))  # re-save: the sentinel goes first, then data
    assert checkpointer.load_checkpoint(3)["trainer"] == {"step": 30}
    assert verify_checkpoint(url, 3) == []
    assert not any(k.startswith("ckpt.1") or k.startswith("ckpt.0") for k in _keys(url))


@pytest.mark.parametrize(
    "damage",
    ["truncated", "missing object", "sentinel without data", "foreign object", "flipped byte"],
)
def test_damaged_latest_is_skipped_with_a_warning(damage):
    url = _url()
    checkpointer = Checkpointer(url)
    checkpointer.save_checkpoint(0, _data(0))
    checkpointer.save_checkpoint(1, _data(1))
    fs, root = fsspec.core.url_to_fs(url)
    model = f"{root}/ckpt.1/model.bpk"
    if damage == "truncated":
        fs.pipe_file(model, fs.cat_file(model)[:-100])
    elif damage == "missing object":
        fs.rm_file(model)
    elif damage == "sentinel without data":
        fs.rm(f"{root}/ckpt.1", recursive=True)
    elif damage == "foreign object":
        fs.pipe_file(f"{root}/ckpt.1/stray.bin", b"x")
    else:
        raw = bytearray(fs.cat_file(model))
        raw[-1] ^= 0xFF
        fs.pipe_file(model, bytes(raw))
    with pytest.warns(CheckpointWarning, match="checkpoint 1 .* skipped"):
        assert get_latest_checkpoint_number(url, verify=True) == 0


def test_a_manifest_claiming_50_gib_is_refused_before_anything_is_allocated():
    """A hostile (or damaged) manifest claims 50 GiB for model.bpk: loading compares the claim
    with the object's size first and raises a RecordError naming the object (the old code
    allocated the claimed size: MemoryError); the quick checks skip it the same way."""
    url = _url()
    check_a_50_gib_claim_is_refused(url, _data(0))


def test_resume_loads_in_one_read_and_falls_back_past_a_damaged_object():
    """What the callback's resume uses on object stores: verify while loading."""
    url = _url()
    checkpointer = Checkpointer(url)
    for n in (0, 1):
        checkpointer.save_checkpoint(n, _data(n))
    fs, root = fsspec.core.url_to_fs(url)
    raw = bytearray(fs.cat_file(f"{root}/ckpt.1/model.bpk"))
    raw[-1] ^= 0xFF  # a tensor byte: only its checksum tells
    fs.pipe_file(f"{root}/ckpt.1/model.bpk", bytes(raw))
    store = object_store(url)
    assert get_latest_checkpoint_number(url) == 1  # the quick checks pass
    with pytest.warns(CheckpointWarning, match="checkpoint 1 .* skipped"):
        number, data, _ = choose_resume(store, "checkpoint", "ckpt", ("model",), at_most=1)
    assert number == 0 and data["trainer"] == {"step": 0}


def test_resume_reads_each_sentinel_once(monkeypatch):
    """The checks and the load of one choice share the manifest they read."""
    url = _url()
    Checkpointer(url).save_checkpoint(0, _data(0))
    store = object_store(url)
    reads: list[str] = []
    read = ObjectStore.read

    def counted(self, key):
        reads.append(key)
        return read(self, key)

    monkeypatch.setattr(ObjectStore, "read", counted)
    number, data, _ = choose_resume(store, "checkpoint", "ckpt", ("model",), at_most=0)
    assert number == 0 and data["trainer"] == {"step": 0}
    assert reads == ["sentinel_checkpoint_complete.0"]


# --- a filesystem that fails at the k-th call of each kind --------------------------------------


class FaultyFileSystem(MemoryFileSystem):
    """memory:// whose k-th call of a kind raises: ``faults[kind] = (k, times, exception)``
    fails calls k .. k+times-1 of that kind (counting from 1)."""

    protocol = "faulty"
    store: dict = {}  # noqa: RUF012 - fsspec's MemoryFileSystem keeps its files on the class
    pseudo_dirs: list = [""]  # noqa: RUF012
    faults: dict = {}  # noqa: RUF012
    calls: dict = {}  # noqa: RUF012

    def _count(self, kind: str) -> None:
        n = self.calls[kind] = self.calls.get(kind, 0) + 1
        k, times, error = self.faults.get(kind, (0, 0, None))
        if k <= n < k + times:
            raise error(f"injected failure of {kind} call {n}")

    def put_file(self, *args, **kwargs):
        self._count("put")
        return super().put_file(*args, **kwargs)

    def pipe_file(self, *args, **kwargs):
        self._count("pipe")
        result = super().pipe_file(*args, **kwargs)
        self._count("pipe-landed")  # a write that took effect, but whose answer was lost
        return result

    def rm_file(self, *args, **kwargs):
        self._count("rm")
        return super().rm_file(*args, **kwargs)

    def rm(self, *args, **kwargs):
        self._count("rm")
        return super().rm(*args, **kwargs)

    def ls(self, *args, **kwargs):
        self._count("ls")
        return super().ls(*args, **kwargs)

    def info(self, *args, **kwargs):
        self._count("info")
        return super().info(*args, **kwargs)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


@pytest.fixture
def faulty():
    FaultyFileSystem.store.clear()
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.calls.clear()
    yield FaultyFileSystem
    FaultyFileSystem.faults.clear()


def _save_failing_at_each_call(
    faulty, n: int, data: dict
) -> Iterator[tuple[tuple[str, int], str, Checkpointer, bool]]:
    """Save checkpoint 1, then save ``data`` as ``n`` with one call failing for good: each
    call of each kind in turn. Yields ``((kind, k), url, checkpointer, whether it raised)``."""
    faulty.store.clear()
    checkpointer = Checkpointer("faulty://b/count", checkpoint_duration=1)
    checkpointer.save_checkpoint(1, _data(1))
    faulty.calls.clear()
    checkpointer.save_checkpoint(n, data)
    counts = dict(faulty.calls)
    assert counts.get("put") and counts.get("pipe") and counts.get("ls") and counts.get("rm")
    for kind, total in counts.items():
        for k in range(1, total + 1):
            faulty.store.clear()
            url = f"faulty://b/{n}-{kind}-{k}"
            checkpointer = Checkpointer(url, checkpoint_duration=1)
            checkpointer.save_checkpoint(1, _data(1))
            faulty.calls.clear()
            faulty.faults[kind] = (k, 10**6, ConnectionError)
            failed = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)  # GC failures only warn
                try:
                    checkpointer.save_checkpoint(n, data)
                except OSError:
                    failed = True
            faulty.faults.clear()
            yield (kind, k), url, checkpointer, failed


def test_a_persistent_failure_at_every_call_keeps_earlier_checkpoints(faulty):
    """Each call of a save, in turn, fails for good: the save raises, checkpoint 1 stays
    complete and loadable, and checkpoint 2 is never committed half-written."""
    for call, url, checkpointer, failed in _save_failing_at_each_call(faulty, 2, _data(2)):
        latest = get_latest_checkpoint_number(url, verify=True)
        if failed:
            assert latest == 1, call
        assert latest in (1, 2), call
        assert checkpointer.load_checkpoint(latest)["trainer"] == {"step": latest}
        assert verify_checkpoint(url, latest) == []


def test_a_failed_resave_at_every_call_keeps_the_old_copy(faulty):
    """Re-saving checkpoint 1 (new bytes under the same number) fails at each call in turn, for
    good (a write whose answer is lost among them): the old checkpoint 1 stays complete and
    loadable, or, when the failure came after the commit, the new one is. The new copy goes
    under a data name never used before, so no sentinel names bytes it was not written for."""
    resave = {**_data(1), "trainer": {"step": 10}}
    for call, url, checkpointer, failed in _save_failing_at_each_call(faulty, 1, resave):
        assert get_latest_checkpoint_number(url, verify=True) == 1, call
        step = checkpointer.load_checkpoint(1)["trainer"]["step"]
        assert step == (1 if failed else 10), (call, failed)
        assert verify_checkpoint(url, 1) == []


def test_a_resave_puts_its_data_beside_the_old_copy_and_removes_the_old_copy_after():
    url = _url()
    checkpointer = Checkpointer(url, checkpoint_duration=2)
    checkpointer.save_checkpoint(1, _data(1))
    target = checkpointer.save_checkpoint(1, _data(10))
    assert re.fullmatch(re.escape(url) + r"/ckpt\.1~[0-9a-f]{16}", target)
    name = name_of(target)
    assert _keys(url) == sorted(
        [f"{name}/model.bpk", f"{name}/trainer.bpk", "sentinel_checkpoint_complete.1"]
    )
    assert [e.data for e in list_checkpoints(url)] == [target]
    assert checkpointer.load_checkpoint(1)["trainer"] == {"step": 10}
    # a crash between the new sentinel and removing the old copy: the next GC removes it
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/ckpt.1/model.bpk", b"old bytes")
    checkpointer.save_checkpoint(2, _data(2))
    assert not any(k.startswith("ckpt.1/") for k in _keys(url))
    assert checkpointer.load_checkpoint(1)["trainer"] == {"step": 10}


def _rank_upload(checkpointer: Checkpointer, staged: Staged, value: float) -> None:
    """What a sharded save's ranks leave in the staging prefix of ``staged``: one rank file."""
    record = ModuleRecord({"w": torch.full((4,), value)})
    files.save_record(record, checkpointer.store, f"{staged.key}/shard.bpk")


def test_a_sharded_resave_keeps_the_old_copy_until_its_sentinel(faulty, tmp_path):
    """A sharded save's ranks upload into the prefix ``begin`` chose before rank 0 commits:
    a re-save of N gets a fresh prefix, so when its sentinel write fails the old N stays whole
    (and the failed upload is removed); when it succeeds the old copy is removed."""
    url = "faulty://b/sharded"
    checkpointer = Checkpointer(url, checkpoint_duration=1)

    def resave(value: float) -> str:
        staged = checkpointer.begin(1)
        _rank_upload(checkpointer, staged, value)
        checkpointer.save_checkpoint(1, {"trainer": {"v": value}}, staged=staged)
        return staged.url

    assert resave(1.0) == f"{url}/ckpt.1"
    faulty.faults["pipe"] = (1, 10**6, ConnectionError)  # the sentinel's write, for good
    with pytest.raises(OSError, match="injected failure of pipe"):
        resave(2.0)
    faulty.faults.clear()
    assert _keys(url) == [
        "ckpt.1/shard.bpk",
        "ckpt.1/trainer.bpk",
        "sentinel_checkpoint_complete.1",
    ]
    loaded = checkpointer.load_checkpoint(1)
    assert loaded["trainer"] == {"v": 1.0}
    assert torch.equal(loaded["shard"].tensors["w"], torch.full((4,), 1.0))
    target = resave(3.0)
    assert re.fullmatch(re.escape(url) + r"/ckpt\.1~[0-9a-f]{16}", target)
    name = name_of(target)
    assert _keys(url) == [
        f"{name}/shard.bpk",
        f"{name}/trainer.bpk",
        "sentinel_checkpoint_complete.1",
    ]
    assert checkpointer.load_checkpoint(1)["trainer"] == {"v": 3.0}
    assert verify_checkpoint(url, 1) == []


def test_transient_failures_are_retried_and_the_save_succeeds(faulty):
    url = "faulty://b/transient"
    checkpointer = Checkpointer(url)
    for kind in ("put", "pipe", "ls", "info"):
        faulty.faults[kind] = (1, 2, TimeoutError)  # the first two calls of each kind fail
    checkpointer.save_checkpoint(0, _data(0))
    faulty.faults.clear()
    assert get_latest_checkpoint_number(url, verify=True) == 0


def test_an_upload_whose_multipart_completion_was_lost_is_retried(faulty):
    """s3fs raises FileNotFoundError (NoSuchUpload) when completing a multipart upload failed
    and aborting it found nothing (seen with a 1 GiB upload to a loaded server); when the object
    does not appear within COMPLETION_WAIT, it is uploaded again."""
    url = "faulty://b/lost-upload"
    checkpointer = Checkpointer(url)
    faulty.faults["put"] = (1, 1, FileNotFoundError)
    checkpointer.save_checkpoint(0, _data(0))
    assert get_latest_checkpoint_number(url, verify=True) == 0


def test_retries_are_bounded_and_the_error_names_the_url(faulty):
    checkpointer = Checkpointer("faulty://b/bounded")
    faulty.faults["put"] = (1, 10**6, ConnectionError)
    with pytest.raises(StorageError, match=r"faulty://b/bounded/ckpt\.0/.*5 attempts"):
        checkpointer.save_checkpoint(0, _data(0))
    assert faulty.calls["put"] == store_objects.ATTEMPTS


def test_a_permanent_error_is_not_retried(faulty):
    checkpointer = Checkpointer("faulty://b/denied")
    faulty.faults["put"] = (1, 10**6, PermissionError)
    with pytest.raises(PermissionError):
        checkpointer.save_checkpoint(0, _data(0))
    assert faulty.calls["put"] == 1


# --- the lease ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_superseded_writer_stops_before_its_next_write_and_deletes_nothing(tmp_path, where):
    url = str(tmp_path / "run") if where == "local" else _url()
    old = Checkpointer(url, checkpoint_duration=1)
    old.take_over()
    old.save_checkpoint(0, _data(0))
    new = Checkpointer(url, checkpoint_duration=1)
    new.take_over()
    with pytest.raises(CheckpointSupersededError, match=r"superseded by a newer run \(pid"):
        old.save_checkpoint(1, _data(1))
    assert [e.number for e in list_checkpoints(url)] == [0]  # nothing written, nothing deleted
    new.save_checkpoint(1, _data(1))
    assert get_latest_checkpoint_number(url, verify=True) == 1


def test_the_lease_keeps_only_the_newest_generation(tmp_path):
    store = open_store(tmp_path)
    leases = [Lease.acquire(store) for _ in range(3)]
    assert [lease.generation for lease in leases] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == [".lightning_bpk.owner.3"]
    leases[2].check()


def test_a_local_url_with_file_protocol_is_the_local_protocol(tmp_path):
    checkpointer = Checkpointer(f"file://{tmp_path}/run")
    assert checkpointer.base_directory == Path(tmp_path / "run")
    checkpointer.save_checkpoint(0, {"x": 1})
    assert (tmp_path / "run" / "sentinel_checkpoint_complete.0").is_file()
