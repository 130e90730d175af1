"""AsyncCheckpointSaver: untorn snapshots, reused staging, one save in flight, errors surfaced."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import xxhash

from lightning_bpk import _device, burnpack
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import (
    ModuleRecord,
    OptimizerRecord,
    RecordError,
    StateRecord,
    load_record,
)
from lightning_bpk.runtime._staging import StagingArea, freeze
from lightning_bpk.runtime.async_save import _WRITER_THREAD_NAME, AsyncCheckpointSaver

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0  # seconds; generous for a loaded 2-core CI machine, never reached when things work


class GatedCheckpointer(Checkpointer):
    """A real Checkpointer whose saves start only once ``gate`` is set, so a test can act while
    a save is provably still in flight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started = threading.Event()

    def save_checkpoint(self, iteration_number, data):
        self.started.set()
        assert self.gate.wait(WAIT), "test never opened the gate"
        return super().save_checkpoint(iteration_number, data)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()


def _snapshot(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": {k: v.clone() for k, v in net.state_dict().items()},
        "optim": [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()],
    }


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


@pytest.mark.parametrize(
    ("setting", "writer"), [(False, None), (True, "thread"), ("process", "process")]
)
def test_an_async_save_setting_names_its_saver(setting, writer):
    saver = AsyncCheckpointSaver.from_setting(setting)
    kind = None if saver is None else "process" if saver._writer is not None else "thread"
    assert kind == writer


@pytest.mark.parametrize("setting", ["thread", 1, None])
def test_an_unknown_async_save_setting_is_named(setting):
    with pytest.raises(ValueError, match=f"async_save={setting!r}: use False, True"):
        AsyncCheckpointSaver.from_setting(setting)


def test_snapshot_is_not_torn_by_steps_taken_while_the_write_is_in_flight(tmp_path):
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    _train(net, optimizer, 3)
    expected = _snapshot(net, optimizer)
    checkpointer = GatedCheckpointer(tmp_path)
    saver = AsyncCheckpointSaver()
    data = {
        "model": ModuleRecord.from_module(net),
        "optim": OptimizerRecord.from_optimizer(optimizer, net),
        "trainer": {"step": 3, "lr": optimizer.param_groups[0]["lr"]},
    }
    saver.save_checkpoint(checkpointer, 3, data)
    assert checkpointer.started.wait(WAIT)
    _train(net, optimizer, 50)  # in-place updates of params and Adam moments, write pending
    optimizer.param_groups[0]["lr"] = 0.5
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(-3.0)
    checkpointer.gate.set()
    saver.close()

    loaded = checkpointer.load_checkpoint(3)
    fresh = _net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    loaded["model"].apply(fresh)
    loaded["optim"].apply(fresh_opt, fresh)
    for name, value in fresh.state_dict().items():
        assert _bitwise_equal(value, expected["params"][name]), name
    for got, want in zip(fresh_opt.state.values(), expected["optim"], strict=True):
        assert all(_bitwise_equal(got[k], want[k]) for k in want)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert loaded["trainer"] == {"step": 3, "lr": 0.1}


def test_staging_buffers_are_allocated_once_and_reused(tmp_path):
    net = _net()
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver() as saver:
        saver.save_checkpoint(checkpointer, 0, {"model": ModuleRecord.from_module(net)})
        allocations = saver.staging.allocations
        pointers = {k: b.data_ptr() for k, b in saver.staging.buffers.items()}
        assert allocations == len(net.state_dict())
        assert saver.staging.nbytes == sum(t.nbytes for t in net.state_dict().values())
        for n in range(1, 4):
            saver.save_checkpoint(checkpointer, n, {"model": ModuleRecord.from_module(net)})
            saver.wait()
            assert saver.staging.allocations == allocations
            assert {k: b.data_ptr() for k, b in saver.staging.buffers.items()} == pointers


def test_reserve_allocates_on_the_writer_thread_and_the_first_save_only_copies(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    threads = []
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver() as saver:
        original = saver.staging.reserve
        saver.staging.reserve = lambda wanted: (
            threads.append(threading.current_thread().name),
            original(wanted),
        )
        saver.reserve({"model": ModuleRecord.from_module(net)})
        saver.wait()
        reserved = saver.staging.allocations
        assert reserved == len(net.state_dict())
        assert threads and threads[0].startswith(_WRITER_THREAD_NAME)
        saver.save_checkpoint(checkpointer, 0, {"model": ModuleRecord.from_module(net)})
        assert saver.staging.allocations == reserved  # nothing allocated on this thread
    saved = checkpointer.load_checkpoint(0)["model"].tensors
    assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())


def test_only_a_changed_shape_reallocates_and_dropped_tensors_are_freed():
    area = StagingArea()
    first = area.copy("m", "a", torch.ones(4))
    area.copy("m", "b", torch.ones(2))
    area.prune()
    assert area.allocations == 2
    same = area.copy("m", "a", torch.zeros(4))
    grown = area.copy("m", "b", torch.zeros(3))
    assert same is first and area.allocations == 3 and grown.shape == (3,)
    area.copy("m", "a", torch.zeros(4, dtype=torch.float64))
    assert area.allocations == 4
    area.prune()
    area.copy("m", "a", torch.zeros(4, dtype=torch.float64))
    area.prune()  # "b" was not used since the last prune
    assert set(area.buffers) == {("m", "a")}


def test_host_tensors_are_staged_in_pageable_memory_and_nothing_waits():
    # The capability check picks the plain path for a CPU tensor (tests/test_gpu.py pins the
    # pinned one): no pinned buffer, no side stream, no event for the writer to wait on.
    area = StagingArea()
    area.copy("m", "a", torch.ones(4))
    area.reserve([("m", "b", (2, 3), torch.bfloat16, False)])
    assert not any(slot.raw.is_pinned() for slot in area._slots.values())
    ready = area.settle()
    assert ready._events == []
    ready.wait()
    assert area.buffers[("m", "a")].tolist() == [1.0] * 4


def test_the_writer_reads_the_buffers_only_once_the_copies_have_landed(tmp_path):
    # Where a GPU's tensors were staged, settle() hands the writer their copies' events. A gate
    # stands for one such event here (no CUDA on this machine): until it opens, the writer has
    # not started the checkpointer's save, and the training thread was not held up by it.
    landed = threading.Event()
    started = threading.Event()
    order: list[str] = []

    class Copy:  # a CUDA event's part in this: synchronize() returns once the copy landed
        def synchronize(self) -> None:
            assert landed.wait(WAIT)
            order.append("started" if started.is_set() else "waited first")

    class Copies(_device.DeviceToHost):
        def settle(self) -> _device.Ready:
            super().settle()
            return _device.Ready([Copy()])

    class Watched(Checkpointer):
        def save_checkpoint(self, iteration_number, data):
            started.set()
            return super().save_checkpoint(iteration_number, data)

    checkpointer = Watched(tmp_path)
    with AsyncCheckpointSaver() as saver:
        saver.staging._copies = Copies()
        saver.save_checkpoint(checkpointer, 0, {"model": ModuleRecord.from_module(_net())})
        assert saver.busy  # returned while the writer waits for the copies
        landed.set()
        saver.wait()
    assert order == ["waited first"] and started.is_set()
    assert checkpointer.load_checkpoint(0) is not None


@pytest.mark.parametrize("kind", [ModuleRecord, StateRecord])
def test_large_tensors_are_staged_where_their_bytes_lie_in_the_file(kind, tmp_path):
    """A tensor of PLACED_MIN bytes or more starts at the same offset within a memory page as
    its bytes within the file written from the snapshot (an O_DIRECT writer writes it from
    there); the file is the one a synchronous save writes. Nested state holding one is encoded
    at the save for that, not left to the writer."""
    from lightning_bpk.runtime._staging import PAGE, PLACED_MIN

    torch.manual_seed(0)
    big = torch.randn(PLACED_MIN // 4 + 3)  # an odd size: the next tensor's offset moves
    state = {"a": big, "b": torch.randn(PLACED_MIN // 4), "small": torch.ones(5)}
    area = StagingArea()
    staged = freeze(area, "state", kind(state))
    sync = tmp_path / "sync.bpk"
    kind(state).save(sync)
    with burnpack.read(sync) as pack:
        offsets = {n: pack.data_start + pack.entries[n].data_offsets[0] for n in state}
    tensors = staged.content()[0]
    for name in ("a", "b"):
        assert (tensors[name].data.data_ptr() - offsets[name]) % PAGE == 0, name
    assert staged.to_bytes() == sync.read_bytes()


def test_nested_state_that_declines_a_snapshot_is_staged_by_file_name_from_its_second_save():
    """For a writer process, nested state holding a large tensor declines the snapshot after
    staging (by path) the small tensors met before it; its later saves go straight to the
    encoding, so those tensors are staged once a save, under their names in the file."""
    from lightning_bpk.runtime._staging import PLACED_MIN
    from lightning_bpk.runtime._writer import Snapshot

    state = {"a": torch.ones(3), "b": torch.ones(4), "big": torch.zeros(PLACED_MIN // 4)}
    area = StagingArea(shared=True)
    first = freeze(area, "state", StateRecord(state))
    area.prune()
    assert len(area.buffers) == 5  # "a" and "b" by path, then all three by name
    assert area.declined == {"state"}
    second = freeze(area, "state", StateRecord(state))
    area.prune()  # drops what this save did not stage
    assert sorted(name for owner, name in area.buffers) == ["a", "b", "big"]
    assert first.to_bytes() == second.to_bytes() == StateRecord(state).to_bytes()
    assert isinstance(freeze(area, "small", StateRecord({"a": torch.ones(3)})), Snapshot)
    assert area.declined == {"state"}


def test_state_holding_a_user_object_leaves_no_late_copy_of_its_declined_snapshot():
    """A record whose snapshot stops at a user object is encoded at the save instead: the late
    copies its snapshot had left (tensors by path) are dropped, so only the file's are made,
    and the next save tries the snapshot again (the object may be gone)."""
    weight = torch.ones(3)
    state = {"w": weight, "obj": object()}
    area = StagingArea(shared=True)
    stable = frozenset({_device.storage_ptr(weight)})
    with pytest.warns(UserWarning, match="obj"):
        staged = freeze(area, "state", StateRecord(state, lenient=True), stable)
    assert [name for owner, name in area.late] == ["w"]
    assert area.declined == set()
    for late in area.late.values():
        late.run()
    assert staged.content()[0]["w"].data.tolist() == [1.0, 1.0, 1.0]


def test_a_new_save_waits_for_the_one_in_flight(tmp_path):
    checkpointer = GatedCheckpointer(tmp_path)
    saver = AsyncCheckpointSaver()
    saver.save_checkpoint(checkpointer, 0, {"x": {"n": 0}})
    assert checkpointer.started.wait(WAIT)
    second = threading.Thread(target=saver.save_checkpoint, args=(checkpointer, 1, {"x": {"n": 1}}))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second save must wait for the first"
    assert not checkpointer.sentinel_path(0).exists()
    checkpointer.gate.set()
    second.join(WAIT)
    assert not second.is_alive()
    saver.close()
    assert checkpointer.load_checkpoint(0) == {"x": {"n": 0}}
    assert checkpointer.load_checkpoint(1) == {"x": {"n": 1}}


def test_sentinel_and_garbage_collection_only_after_the_write(tmp_path):
    checkpointer = GatedCheckpointer(tmp_path, checkpoint_duration=1)
    checkpointer.gate.set()
    saver = AsyncCheckpointSaver()
    saver.save_checkpoint(checkpointer, 0, {"x": {"n": 0}})
    saver.wait()
    checkpointer.gate.clear()
    saver.save_checkpoint(checkpointer, 1, {"x": {"n": 1}})
    assert checkpointer.started.wait(WAIT)
    # save() has returned: checkpoint 1 is not complete yet and 0 is still there
    assert not checkpointer.sentinel_path(1).exists()
    assert checkpointer.latest_checkpoint_number() == 0
    assert checkpointer.load_checkpoint(0) == {"x": {"n": 0}}
    checkpointer.gate.set()
    assert saver.wait() == checkpointer.checkpoint_path(1)
    assert checkpointer.latest_checkpoint_number() == 1
    assert not checkpointer.checkpoint_path(0).exists()  # collected after 1 completed
    saver.close()


def test_a_failed_write_surfaces_at_the_next_save_once_and_loses_nothing(tmp_path):
    base = tmp_path / "ckpt"
    checkpointer = Checkpointer(base)
    saver = AsyncCheckpointSaver()
    saver.save_checkpoint(checkpointer, 0, {"x": {"n": 0}})
    saver.wait()
    lock = base / ".lightning_bpk.lock"
    os.unlink(lock)
    os.mkdir(lock)  # a real OS error on the writer thread: the lock file cannot be opened
    saver.save_checkpoint(checkpointer, 1, {"x": {"n": 1}})
    with pytest.raises(IsADirectoryError) as raised:
        saver.save_checkpoint(checkpointer, 2, {"x": {"n": 2}})
    assert "asynchronous save of checkpoint 1" in "".join(raised.value.__notes__)
    os.rmdir(lock)
    saver.save_checkpoint(checkpointer, 2, {"x": {"n": 2}})  # reported once; saving goes on
    saver.close()
    assert checkpointer.load_checkpoint(0) == {"x": {"n": 0}}
    assert checkpointer.load_checkpoint(1) is None
    assert checkpointer.load_checkpoint(2) == {"x": {"n": 2}}


def test_close_waits_for_the_write_and_reraises_its_error(tmp_path):
    checkpointer = GatedCheckpointer(tmp_path)
    saver = AsyncCheckpointSaver()
    saver.save_checkpoint(checkpointer, 0, {"x": {"n": 0}})
    assert checkpointer.started.wait(WAIT)
    closer = threading.Thread(target=saver.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close must wait for the write in flight"
    checkpointer.gate.set()
    closer.join(WAIT)
    assert checkpointer.load_checkpoint(0) == {"x": {"n": 0}}
    assert saver.staging.nbytes == 0

    saver.save_checkpoint(checkpointer, 1, {"bad key!": {"n": 1}})  # reusable after close
    with pytest.raises(ValueError, match="not a safe file name"):
        saver.close()
    assert checkpointer.latest_checkpoint_number() == 0


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_nested_state_is_saved_as_it_was_when_the_save_returned(process, tmp_path, monkeypatch):
    # a writer thread's save encodes it on the caller's thread (the writer would hold the
    # interpreter lock training waits for); a writer process gets a copy (containers rebuilt,
    # tensors staged) and encodes it itself: either way, what training changes after the save
    # returns is not in the checkpoint
    encoded_on: list[str] = []
    to_content = StateRecord.to_content

    def recorded(self):
        encoded_on.append(threading.current_thread().name)
        return to_content(self)

    monkeypatch.setattr(StateRecord, "to_content", recorded)
    shared = torch.arange(3.0)
    live = {"hist": [1, {"best": 0.5}], "w": shared, "again": shared, "seen": {"a"}}
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver(process=process) as saver:
        saver.save_checkpoint(checkpointer, 0, {"loop": live})
        live["hist"].append(2)
        live["hist"][1]["best"] = 0.1
        live["seen"].add("b")
        shared.add_(1)
    assert encoded_on == ([] if process else [threading.current_thread().name])
    loaded = checkpointer.load_checkpoint(0)["loop"]
    assert loaded["hist"] == [1, {"best": 0.5}] and loaded["seen"] == {"a"}
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0]
    assert loaded["again"] is loaded["w"]  # a tensor held twice is one tensor in the file


def test_unstorable_data_fails_on_the_callers_thread(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver() as saver:
        with pytest.raises(RecordError, match="object"):
            saver.save_checkpoint(checkpointer, 0, {"x": {"fn": object()}})
        assert not saver.busy
    assert checkpointer.latest_checkpoint_number() == -1


def test_skipped_iterations_copy_and_write_nothing(tmp_path):
    checkpointer = Checkpointer(tmp_path, checkpoint_frequency=2)
    with AsyncCheckpointSaver() as saver:
        saver.save_checkpoint(checkpointer, 1, {"model": ModuleRecord.from_module(_net())})
        assert saver.staging.allocations == 0 and not saver.busy
    assert checkpointer.latest_checkpoint_number() == -1


def test_save_record_writes_a_snapshot_at_the_path(tmp_path):
    net = _net()
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    path = tmp_path / "model.bpk"
    with AsyncCheckpointSaver() as saver:
        saver.save_record(ModuleRecord.from_module(net), path)
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        saver.save_record({"epoch": 1}, tmp_path / "trainer.bpk")  # waits for the first
    record = load_record(path)
    assert all(_bitwise_equal(record.tensors[k], v) for k, v in expected.items())
    assert load_record(tmp_path / "trainer.bpk").value == {"epoch": 1}


def test_freeze_calls_deferred_providers_now_and_copies_mutable_bytes():
    area = StagingArea()
    live = torch.arange(4, dtype=torch.float32)
    raw = bytearray(b"\x01\x02")
    calls = []

    class Deferred(ModuleRecord):
        def to_content(self):
            def provider():
                calls.append(1)
                return live

            return (
                {
                    "w": burnpack.TensorEntry("F32", [4], provider, nbytes=16),
                    "b": burnpack.TensorEntry("U8", [2], raw),
                },
                {},
                {},
            )

    frozen = freeze(area, "m", Deferred({}))
    assert calls == [1]
    live.add_(100)
    raw[0] = 9
    tensors, _, _ = frozen.to_content()
    assert tensors["w"].data.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert bytes(tensors["b"].data) == b"\x01\x02"
    assert frozen.kind == "module"


def test_a_staged_entry_keeps_what_its_entry_says_of_its_bytes():
    # a torch dtype Burn has no name for (stored as U8, named in the descriptor) and a digest
    # taken when the bytes were made both survive the snapshot: the file reads back as fp8 and
    # records that checksum
    fp8 = torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn)
    digest = xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(fp8))

    class Carried(ModuleRecord):
        def to_content(self):
            return {"w": burnpack.TensorEntry.from_tensor(fp8, digest=digest)}, {}, {}

    frozen = freeze(StagingArea(), "m", Carried({}))
    entry = frozen.to_content()[0]["w"]
    assert (entry.dtype, entry.torch_dtype, entry.digest) == ("U8", "float8_e4m3fn", digest)
    pack = burnpack.loads(burnpack.dumps({"w": entry}))
    assert pack.tensor("w").dtype == torch.float8_e4m3fn and pack.checksums["w"] == digest


def test_writer_runs_on_one_named_background_thread(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    seen = set()

    class Spy(Checkpointer):
        def save_checkpoint(self, iteration_number, data):
            seen.add(threading.current_thread().name)
            return super().save_checkpoint(iteration_number, data)

    spy = Spy(checkpointer.base_directory)
    with AsyncCheckpointSaver() as saver:
        for n in range(3):
            saver.save_checkpoint(spy, n, {"x": {"n": n}})
    assert len(seen) == 1 and next(iter(seen)).startswith("lightning_bpk-async-save")
    assert threading.current_thread().name not in seen
    assert Path(spy.checkpoint_path(2)).is_dir()


# --- Lightning: BurnpackCheckpoint(async_save=True) ---------------------------------------


def _lightning():
    import lightning as L

    from lightning_tiny import TinyModel, make_trainer

    return L, TinyModel, make_trainer


class SlowCheckpointer(Checkpointer):
    """A real Checkpointer that sleeps before each save, so the last one is surely in flight
    when training ends."""

    def save_checkpoint(self, iteration_number, data):
        threading.Event().wait(0.3)
        return super().save_checkpoint(iteration_number, data)


def _fit(root: Path, callback, epochs: int = 3) -> None:
    L, TinyModel, make_trainer = _lightning()
    L.seed_everything(0)
    make_trainer(str(root), epochs, [callback]).fit(TinyModel())


@pytest.mark.parametrize("where", ["local", "memory"])
def test_save_sharded_commits_a_snapshot_of_the_shards_and_fails_the_next_save(
    tmp_path, monkeypatch, where
):
    """``save_sharded`` in one process (no process group: a world of one) on local disk and
    in memory://: the shards as they were when the call returned, committed with the records;
    a failed write is raised by the next call (once), nothing of it committed."""
    import uuid

    from lightning_bpk.dcp import BurnpackStorageWriter, load_full_state_dict

    base = tmp_path if where == "local" else f"memory://sharded-{uuid.uuid4().hex[:8]}/run"
    checkpointer = Checkpointer(base)
    weight = torch.arange(6.0)
    state = {"model": {"w": weight}, "optim": {"step": 3, "lr": [0.5, 0.25]}}
    with AsyncCheckpointSaver() as saver:
        saver.save_sharded(checkpointer, 0, state, {"trainer": {"epoch": 0}})
        weight.add_(100.0)  # after the snapshot: not in checkpoint 0
        state["optim"]["lr"][0] = 9.0
        saver.save_sharded(checkpointer, 1, state, {"trainer": {"epoch": 1}})
        original = BurnpackStorageWriter.write_file

        def full_disk(self, target, *args):  # checkpoint 2's shards only
            if "ckpt.2" in str(self.path):
                raise OSError(28, "No space left on device (injected)", str(target))
            return original(self, target, *args)

        monkeypatch.setattr(BurnpackStorageWriter, "write_file", full_disk)
        saver.save_sharded(checkpointer, 2, state)
        with pytest.raises(Exception, match="No space left on device") as raised:
            saver.save_sharded(checkpointer, 3, state)
        assert "(raised by the asynchronous save of checkpoint 2" in str(raised.value.__notes__)
    assert checkpointer.latest_checkpoint_number(verify=True) == 1  # 3 was never started
    first = load_full_state_dict(checkpointer.checkpoint_path(0))
    assert first["model.w"].tolist() == list(range(6)) and first["optim.lr"] == [0.5, 0.25]
    assert load_full_state_dict(checkpointer.checkpoint_path(1))["model.w"][0] == 100.0
    assert checkpointer.load_checkpoint(1, ["trainer"]) == {"trainer": {"epoch": 1}}


def test_async_training_writes_the_same_checkpoints_and_teardown_flushes(tmp_path):
    from lightning_bpk.lightning.callback import BurnpackCheckpoint

    class SlowAsync(BurnpackCheckpoint):
        def _make_checkpointer(self, dirpath, **overrides):
            settings = dict(checkpoint_duration=self.checkpoint_duration, **overrides)
            return SlowCheckpointer(dirpath, **settings)

    _fit(tmp_path / "sync", BurnpackCheckpoint(dirpath=tmp_path / "sync"))
    slow = SlowAsync(dirpath=tmp_path / "async", async_save=True)
    _fit(tmp_path / "async", slow)
    assert not slow._saver.busy  # fit returned only after the last write was durable
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    assert sorted(os.listdir(sync_dir)) == sorted(os.listdir(async_dir))
    for n in range(3):
        assert Checkpointer(async_dir).verify_checkpoint(n) == []
        for name in ("model.bpk", "optim.bpk", "scheduler.bpk"):
            a = (sync_dir / f"ckpt.{n}" / name).read_bytes()
            assert a == (async_dir / f"ckpt.{n}" / name).read_bytes(), (n, name)
        trainer_sync = load_record(sync_dir / f"ckpt.{n}" / "trainer.bpk").value
        trainer_async = load_record(async_dir / f"ckpt.{n}" / "trainer.bpk").value
        assert trainer_sync.keys() == trainer_async.keys()
        assert trainer_sync["loops"] == trainer_async["loops"]
        assert trainer_sync["epoch"] == trainer_async["epoch"] == n


class _SavedLines(logging.Handler):
    """Each "saved checkpoint N" line of the lightning_bpk logger: its thread, and whether N's
    sentinel existed when it was logged."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory, self.lines = directory, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("saved checkpoint "):
            number = message.split()[2]
            committed = (self.directory / f"sentinel_checkpoint_complete.{number}").exists()
            self.lines.append((message, record.threadName, committed))


def test_async_saves_log_each_checkpoint_once_it_is_committed(tmp_path):
    from lightning_bpk.lightning.callback import BurnpackCheckpoint

    lines = _SavedLines(tmp_path / "async")
    logger = logging.getLogger("lightning_bpk")
    logger.addHandler(lines)
    try:
        _fit(tmp_path, BurnpackCheckpoint(dirpath=tmp_path / "async", async_save=True))
    finally:
        logger.removeHandler(lines)
    assert [line[0] for line in lines.lines] == [
        f"saved checkpoint {n} at {tmp_path / 'async' / f'ckpt.{n}'}" for n in range(3)
    ]
    assert all(thread.startswith(_WRITER_THREAD_NAME) for _, thread, _ in lines.lines)
    assert all(committed for _, _, committed in lines.lines)  # logged after the sentinel


def test_callback_stages_model_and_optimizer_before_the_first_step_save(tmp_path):
    """The first step-triggered save finds a staging buffer of the right shape and dtype for
    every model and optimizer tensor (reserved on the writer thread after the first optimizer
    step), allocates none of them on the training thread, and writes the synchronous bytes."""
    from lightning_bpk.lightning.callback import BurnpackCheckpoint
    from lightning_bpk.lightning.trainer_state import TRAINER_KEY

    class Observed(BurnpackCheckpoint):
        before: dict | None = None
        after: dict | None = None

        def _save(self, trainer, number, **kwargs):
            first = self.before is None
            if first:
                self._saver.wait()  # join the reservation, as the save itself does first
                self.before = dict(self._saver.staging.buffers)
            super()._save(trainer, number, **kwargs)
            if first:
                self.after = dict(self._saver.staging.buffers)

    roots = {"sync": tmp_path / "sync", "async": tmp_path / "async"}
    observed = Observed(dirpath=roots["async"], every_n_train_steps=4, async_save=True)
    L, TinyModel, make_trainer = _lightning()
    for root, callback in (
        (roots["sync"], BurnpackCheckpoint(dirpath=roots["sync"], every_n_train_steps=4)),
        (roots["async"], observed),
    ):
        L.seed_everything(0)
        quick = dict(max_steps=4, limit_val_batches=0, num_sanity_val_steps=0)
        make_trainer(str(root), 1, [callback], **quick).fit(TinyModel())
    assert observed.before is not None and observed.after is not None
    module = TinyModel()
    # the model's tensors, and Adam's two moments per parameter (its step is a scalar)
    expected = len(module.state_dict()) + 2 * sum(1 for _ in module.parameters())
    staged = {key for key in observed.after if key[0] in ("model", "optim")}
    # every buffer the first save staged of the model and the optimizer was reserved before
    # it, and nothing else was
    assert set(observed.before) == staged and len(staged) == expected
    for key, buffer in observed.before.items():
        assert observed.after[key] is buffer, key  # copied into, never reallocated
    assert {owner for owner, _ in set(observed.after) - set(observed.before)} <= {TRAINER_KEY}
    assert sorted(os.listdir(roots["sync"])) == sorted(os.listdir(roots["async"]))
    for name in ("model.bpk", "optim.bpk"):
        want = (roots["sync"] / "ckpt.4" / name).read_bytes()
        assert (roots["async"] / "ckpt.4" / name).read_bytes() == want, name


def test_sharded_async_saves_copy_the_shards_into_buffers_reserved_after_the_first_step(
    tmp_path, monkeypatch
):
    """FSDP2 state (DTensors) saved asynchronously: the shards are copied into staging buffers
    this rank reserved after the first optimizer step (its local shard shapes), copied into
    again by every save, and the checkpoints hold what a synchronous run's hold."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning_fsdp import ShardedTiny

    from lightning_bpk.dcp import load_full_state_dict
    from lightning_bpk.lightning.callback import BurnpackCheckpoint
    from lightning_bpk.runtime.async_save import _SHARDS_OWNER

    L, _, make_trainer = _lightning()
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)  # Lightning sets them for this process's group
    seen = []

    class Observed(BurnpackCheckpoint):
        def _save(self, trainer, number, **kwargs):
            self._saver.wait()  # join the reservation (or the previous save)
            buffers = dict(self._saver.staging.buffers)
            super()._save(trainer, number, **kwargs)
            seen.append((number, buffers, dict(self._saver.staging.buffers)))

    quick = dict(max_steps=4, limit_val_batches=0, num_sanity_val_steps=0)
    for root, callback in (
        (tmp_path / "sync", BurnpackCheckpoint(every_n_train_steps=3)),
        (tmp_path / "async", Observed(async_save=True, every_n_train_steps=3)),
    ):
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        try:
            L.seed_everything(0)
            make_trainer(str(root), 1, [callback], strategy=strategy, **quick).fit(ShardedTiny())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert [number for number, _, _ in seen] == [3, 4]
    (_, reserved, after), (_, before_next, after_next) = seen
    shards = {key for key in after if key[0] == _SHARDS_OWNER}
    assert {key for key in reserved if key[0] == _SHARDS_OWNER} == shards  # reserved ahead
    assert any(key[1].startswith("/model/") for key in shards)
    assert any(key[1].startswith("/optim/state/") for key in shards)
    for key in shards:  # copied into, never reallocated
        assert reserved[key] is after[key] is before_next[key] is after_next[key], key
    for n in (3, 4):
        want = load_full_state_dict(tmp_path / "sync" / "checkpoints" / f"ckpt.{n}")
        got = load_full_state_dict(tmp_path / "async" / "checkpoints" / f"ckpt.{n}")
        assert sorted(want) == sorted(got)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert _bitwise_equal(got[key], value), (n, key)
            else:
                assert got[key] == value, (n, key)


def test_async_write_failure_raises_checkpoint_save_error_in_fit(tmp_path, monkeypatch):
    import errno

    from lightning_bpk import _fs
    from lightning_bpk.lightning.callback import BurnpackCheckpoint, CheckpointSaveError

    L, _, _ = _lightning()

    class DiskFullAtEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):  # runs before the save of the epoch
            if trainer.current_epoch == 1:
                callback._saver.wait()  # checkpoint 0 is durable; 1 will fail in the background

                def full_disk(f, data):
                    raise OSError(errno.ENOSPC, "No space left on device")

                monkeypatch.setattr(_fs, "write_all", full_disk)

    callback = BurnpackCheckpoint(dirpath=tmp_path / "ckpt", async_save=True)
    L_, TinyModel, make_trainer = _lightning()
    L_.seed_everything(0)
    trainer = make_trainer(str(tmp_path), 3, [DiskFullAtEpoch(), callback])
    with pytest.raises(CheckpointSaveError, match="No space left") as raised:
        trainer.fit(TinyModel())
    assert "asynchronous save of checkpoint 1" in str(raised.value)
    monkeypatch.undo()
    checkpointer = Checkpointer(tmp_path / "ckpt")
    assert checkpointer.latest_checkpoint_number(verify=True) == 0


def test_preemption_with_async_save_flushes_before_stopping(tmp_path):
    import signal

    from lightning_bpk.lightning.callback import BurnpackCheckpoint

    L, TinyModel, make_trainer = _lightning()
    L.seed_everything(0)
    model = TinyModel()
    model.on_step = lambda step: step == 8 and os.kill(os.getpid(), signal.SIGTERM)
    callback = BurnpackCheckpoint(dirpath=tmp_path / "ckpt", async_save=True)
    with pytest.raises(SystemExit):
        make_trainer(str(tmp_path), 5, [callback]).fit(model)
    checkpointer = Checkpointer(tmp_path / "ckpt")
    assert checkpointer.latest_checkpoint_number(verify=True) == 1  # epoch 1, mid-epoch save
    assert load_record(checkpointer.checkpoint_path(1) / "trainer.bpk").value[
        "lightning_bpk_preempted"
    ] == {"epoch": 1, "batches": 3, "replay": False}


def test_async_checkpoint_io_matches_sync_with_model_checkpoint_top_k(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bpk.lightning.checkpoint_io import BurnpackCheckpointIO

    L, TinyModel, make_trainer = _lightning()
    for mode in ("sync", "async"):
        L.seed_everything(0)
        checkpoint = ModelCheckpoint(
            dirpath=tmp_path / mode, monitor="step", mode="max", save_top_k=1, save_last=True
        )
        io = BurnpackCheckpointIO(async_save=mode == "async")
        make_trainer(str(tmp_path), 3, [checkpoint], plugins=[io]).fit(TinyModel())
    names = sorted(os.listdir(tmp_path / "sync"))
    assert names == sorted(os.listdir(tmp_path / "async")) and len(names) == 2  # top-1 + last
    io = BurnpackCheckpointIO()
    for name in names:
        sync, done = (
            io.load_checkpoint(tmp_path / "sync" / name),
            io.load_checkpoint(tmp_path / "async" / name),
        )
        assert sync["global_step"] == done["global_step"] and sync["loops"] == done["loops"]
        assert all(_bitwise_equal(v, done["state_dict"][k]) for k, v in sync["state_dict"].items())


def test_async_checkpoint_io_teardown_reraises_a_failed_write(tmp_path, monkeypatch):
    import errno

    from lightning_bpk import _fs
    from lightning_bpk.lightning.checkpoint_io import BurnpackCheckpointIO

    io = BurnpackCheckpointIO(async_save=True)
    io.save_checkpoint({"epoch": 0, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt")["epoch"] == 0  # waits for the write

    def full_disk(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "write_all", full_disk)
    io.save_checkpoint({"epoch": 1}, tmp_path / "b.ckpt")
    with pytest.raises(OSError, match="No space left"):
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]
