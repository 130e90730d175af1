"""Record base: RecordError, the kind tag, StateRecord, load_record, failed saves lose nothing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from lightning_bpk import _fs, burnpack
from lightning_bpk._nested import copy_nested
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.records import (
    RECORD_KIND_KEY,
    LrSchedulerRecord,
    ModuleRecord,
    OptimizerRecord,
    Record,
    RecordChecksumError,
    RecordError,
    StateRecord,
    load_record,
)

from conftest import MNIST_BPK

MNIST = MNIST_BPK


def test_record_error_sorts_and_lists_every_problem() -> None:
    err = RecordError("validation", ["b problem", "a problem", "c problem"])
    assert err.kind == "validation"
    assert err.problems == ["a problem", "b problem", "c problem"]
    assert str(err) == "Record validation error: a problem; b problem; c problem"
    assert str(RecordError("io", "disk")) == "Record I/O error: disk"
    with pytest.raises(ValueError, match="'io' or 'validation'"):
        RecordError("other", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'io' or 'validation'"):
        RecordError("checksum", "x")  # only RecordChecksumError is one


def test_format_errors_map_to_record_errors_keeping_checksum_failures() -> None:
    damaged = RecordError.from_format_error(burnpack.ChecksumError("t: bytes fail"))
    assert type(damaged) is RecordChecksumError and damaged.kind == "checksum"
    assert str(damaged) == "Record checksum error: t: bytes fail"
    assert isinstance(damaged, (burnpack.ChecksumError, RecordError, LightningBpkError))
    other = RecordError.from_format_error(burnpack.MagicError("not a burnpack"))
    assert type(other) is RecordError and other.kind == "io"


def test_every_kind_is_registered() -> None:
    expected = {
        "state": StateRecord,
        "module": ModuleRecord,
        "optimizer": OptimizerRecord,
        "lr_scheduler": LrSchedulerRecord,
    }
    assert {k: Record._registry.get(k) for k in expected} == expected  # other tests add kinds


def test_state_record_bytes_and_file_round_trip(tmp_path: Path) -> None:
    value = {"epoch": 2, "rng": torch.arange(5, dtype=torch.uint8), "name": "run", "t": (1, None)}
    again = StateRecord.from_bytes(StateRecord(value).to_bytes()).value
    assert again["t"] == (1, None) and torch.equal(again["rng"], value["rng"])
    path = StateRecord(value).save(tmp_path / "loops")
    assert path == tmp_path / "loops.bpk"
    assert StateRecord.load(tmp_path / "loops").value["epoch"] == 2  # .bpk found without suffix
    explicit = StateRecord(value).save(tmp_path / "loops.state")
    assert explicit.name == "loops.state"  # a suffix is kept as given
    assert isinstance(load_record(explicit), StateRecord)
    with burnpack.read(path) as pack:
        assert pack.metadata[RECORD_KIND_KEY] == "state"


def test_unencodable_state_is_a_validation_error_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=r"\$\['f'\]: cannot store") as info:
        StateRecord({"f": object()}).save(tmp_path / "x")
    assert info.value.kind == "validation"
    assert list(tmp_path.iterdir()) == []


def test_load_record_needs_a_known_kind(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="no known record kind") as info:
        load_record(MNIST)  # Burn writes no kind tag: name the class instead
    assert info.value.kind == "validation"
    odd = tmp_path / "odd.bpk"
    burnpack.write(odd, {}, metadata={RECORD_KIND_KEY: "weird"})
    with pytest.raises(RecordError, match="'weird'"):
        load_record(odd)


@pytest.mark.parametrize("cls", [ModuleRecord, OptimizerRecord, LrSchedulerRecord])
def test_wrong_kind_is_a_validation_error(cls: type[Record], tmp_path: Path) -> None:
    path = StateRecord({"a": 1}).save(tmp_path / "state")
    with pytest.raises(RecordError, match=rf"'state' record, not '{cls.kind}'") as info:
        cls.load(path)
    assert info.value.kind == "validation"


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (lambda d: d[:5], "io"),
        (lambda d: b"XXXX" + d[4:], "io"),
        (lambda d: d[:-1], "io"),
        (lambda d: d + b"\x00", "io"),
        # a flipped tensor bit stays a checksum failure, not a file that looks missing
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    ],
    ids=["short", "magic", "truncated", "trailing", "bitflip"],
)
def test_damaged_bytes_and_files_are_io_or_checksum_errors(damage, kind, tmp_path: Path) -> None:
    data = damage(StateRecord({"w": torch.arange(8.0)}).to_bytes())
    with pytest.raises(RecordError) as info:
        StateRecord.from_bytes(data)
    assert info.value.kind == kind
    assert isinstance(info.value, burnpack.ChecksumError) == (kind == "checksum")
    path = tmp_path / "bad.bpk"
    path.write_bytes(data)
    with pytest.raises(RecordError) as info:
        load_record(path)
    assert info.value.kind == kind and str(path) in str(info.value)


def test_missing_file_is_an_io_error(tmp_path: Path) -> None:
    with pytest.raises(RecordError) as info:
        StateRecord.load(tmp_path / "absent")
    assert info.value.kind == "io" and "absent" in str(info.value)


def test_failed_save_keeps_the_previous_file(tmp_path: Path, monkeypatch) -> None:
    path = StateRecord({"v": 1, "w": torch.zeros(4)}).save(tmp_path / "keep.bpk")
    before = path.read_bytes()
    calls = []

    def full_disk(f, data) -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "write_all", full_disk)
    with pytest.raises(RecordError) as info:
        StateRecord({"v": 2, "w": torch.ones(4)}).save(path)
    monkeypatch.undo()
    assert calls and info.value.kind == "io" and "No space left" in str(info.value)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.bpk"]  # no scratch left behind
    assert StateRecord.load(path).value["v"] == 1


def _records() -> dict[str, Record]:
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    net[1].weight = net[0].weight  # tied: stored once, an alias names it twice
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return {
        "module": ModuleRecord.from_module(net),
        "optimizer": OptimizerRecord.from_optimizer(optimizer, net),
        "state": StateRecord({"step": 7, "rng": [torch.arange(5), (1.5, "x")]}),
    }


@pytest.mark.parametrize("kind", ["module", "optimizer", "state"])
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_loads_onto_cpu_by_name_or_device(kind: str, device, tmp_path: Path) -> None:
    record = _records()[kind]
    path = record.save(tmp_path / kind)
    for loaded in (
        type(record).load(path, device=device),
        load_record(path, device=device),
        type(record).from_bytes(record.to_bytes(), device=device),
    ):
        assert loaded.to_bytes() == record.to_bytes()


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (torch.device("meta"), "'meta': it holds no data"),
        ("no-such-device", "'no-such-device'"),
        ("xpu", "'xpu': loads go to 'cpu' or a CUDA device"),
    ],
)
def test_a_device_that_cannot_take_the_tensors_is_refused_before_reading(
    device, message: str, tmp_path: Path
) -> None:
    missing = tmp_path / "never-read.bpk"  # refused first: no "no such file" error
    for load in (ModuleRecord.load, load_record):
        with pytest.raises(ValueError, match=message):
            load(missing, device=device)
    with pytest.raises(ValueError, match=message):
        StateRecord.from_bytes(b"not even a pack", device=device)
    with pytest.raises(ValueError, match=message):
        StateRecord({"w": torch.ones(1)}).to(device)


@pytest.mark.parametrize("kind", ["module", "optimizer", "state"])
def test_moving_a_record_copies_every_tensor_it_holds_and_keeps_the_rest(kind: str) -> None:
    # The CUDA load's generic move (a copy per tensor, a shared tensor once), run into host
    # memory: every record kind survives it byte for byte.
    record = _records()[kind]
    before = record.to_bytes()
    held: list[torch.Tensor] = []
    copy_nested(vars(record), lambda _, t: held.append(t))
    moved = record._moved_to(torch.device("cpu"))
    after: list[torch.Tensor] = []
    copy_nested(vars(record), lambda _, t: after.append(t))
    assert moved is record and moved.to_bytes() == before
    assert len(after) == len(held) > 0
    assert not {id(t) for t in held} & {id(t) for t in after}  # every one a copy
    assert len({id(t) for t in after}) == len({id(t) for t in held})  # shared ones stay shared
