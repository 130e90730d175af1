"""Checkpointer: Dopamine parity, then the deliberate fixes.

The upstream ``CheckpointerTest`` cases (google/dopamine,
``dopamine/discrete_domains/checkpointer_test.py``) are ported one by one (``test_upstream_*``),
with their file lists; "data file ``prefix.N``" became "data directory ``prefix.N``".

What a save commits under a crash or a failing call is pinned in
``tests/test_checkpointer_commit.py``, what reading finds (damage, verify, discovery) in
``tests/test_checkpointer_view.py``, and what choosing a checkpoint to resume from reads in
``tests/test_checkpointer_resume.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _backends as b
import gin
import pytest
import torch

from lightning_bpk import burnpack, checkpointer
from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointLockedError,
    CheckpointWarning,
    get_latest_checkpoint_number,
)
from lightning_bpk.checkpointer.manifest import MANIFEST_FORMAT
from lightning_bpk.records import Record, RecordError, StateRecord
from lightning_bpk.store import local as store_local
from lightning_bpk.store.local import LOCK_FILE_NAME

from conftest import run_process

SENTINEL = b.SENTINEL
DOPAMINE_DICT = {"data1": 1, "data2": "two", "data3": (3, "three")}


def names(base: Path) -> list[str]:
    """Directory listing without the lock file (which the first save creates)."""
    return sorted(p.name for p in base.iterdir() if p.name != LOCK_FILE_NAME)


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


# --- upstream tests ------------------------------------------------------------------------------


def test_upstream_initialization(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"No path provided to Checkpointer\."):
        Checkpointer("")
    with pytest.raises(ValueError, match=r"No path provided to Checkpointer\."):
        Checkpointer(None)  # type: ignore[arg-type]
    # Upstream uses '/does/not/exist', which only fails for non-root users: as root it is simply
    # created (Dopamine makes the directory). A path below a regular file cannot be created by
    # anyone, root included.
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    bad = blocker / "does" / "not" / "exist"
    with pytest.raises(ValueError, match=f"Unable to create checkpoint path: {bad}."):
        Checkpointer(bad)
    with pytest.raises(ValueError, match="Unable to create checkpoint path"):
        Checkpointer(blocker)  # exists, but is not a directory
    Checkpointer(tmp_path / "new")
    Checkpointer(tmp_path / "new")  # constructing again on the existing directory works
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize("prefix", [None, "custom_prefix"])
def test_upstream_log_to_file_with_valid_directory(tmp_path: Path, prefix: str | None) -> None:
    kwargs = {} if prefix is None else {"checkpoint_file_prefix": prefix}
    c = Checkpointer(tmp_path, **kwargs)
    c.save_checkpoint(1729, DOPAMINE_DICT)
    assert (tmp_path / f"{prefix or 'ckpt'}.1729").is_dir()
    assert c.load_checkpoint(1729) == DOPAMINE_DICT
    assert type(c.load_checkpoint(1729)["data3"]) is tuple
    assert c.load_checkpoint(1730) is None


def test_upstream_latest_with_invalid_dir() -> None:
    assert get_latest_checkpoint_number("/does/not/exist") == -1


def test_upstream_latest_with_empty_dir(tmp_path: Path) -> None:
    assert get_latest_checkpoint_number(tmp_path) == -1


def test_upstream_latest_with_override() -> None:
    assert get_latest_checkpoint_number("/ignored", override_number=1729) == 1729


def test_upstream_latest(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(1729, {"value": 1729})
    c.save_checkpoint(1730, {"value": 1730})
    assert get_latest_checkpoint_number(tmp_path) == 1730


def _assert_kept(base: Path, prefix: str, loop: int, present) -> None:
    for i in range(loop):
        for name in (f"{prefix}.{i}", f"{SENTINEL}.{i}"):
            assert (base / name).exists() == present(i), (name, present(i))


def test_upstream_garbage_collection(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_file_prefix="custom_prefix")
    for i in range(11):
        c.save_checkpoint(i, {"i": i})
    _assert_kept(tmp_path, "custom_prefix", 11, lambda i: i >= 7)


def test_upstream_garbage_collection_with_checkpoint_frequency(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_file_prefix="custom_prefix", checkpoint_frequency=3)
    for i in range(4 * 3 + 6 + 1):
        c.save_checkpoint(i, {"i": i})
    _assert_kept(tmp_path, "custom_prefix", 19, lambda i: i > 6 and i % 3 == 0)


def test_upstream_garbage_collection_with_checkpoint_duration(tmp_path: Path) -> None:
    c = Checkpointer(
        tmp_path, checkpoint_file_prefix="custom_prefix", checkpoint_frequency=3,
        checkpoint_duration=6,
    )  # fmt: skip
    for i in range(40):
        c.save_checkpoint(i, {"i": i})
    _assert_kept(tmp_path, "custom_prefix", 40, lambda i: i > 21 and i % 3 == 0)


def test_upstream_garbage_collection_with_keep_every(tmp_path: Path) -> None:
    c = Checkpointer(
        tmp_path, checkpoint_file_prefix="custom_prefix", checkpoint_frequency=3,
        checkpoint_duration=6, keep_every=3,
    )  # fmt: skip
    for i in range(40):
        c.save_checkpoint(i, {"i": i})
    # Upstream's comment lists 3, 6, 12, 15 as deleted; its assertion also requires 21 gone.
    _assert_kept(tmp_path, "custom_prefix", 40, lambda i: i % 3 == 0 and (i > 21 or i % 9 == 0))


# --- more parity with Dopamine's checkpointer.py ------------------------------------------------


@pytest.mark.parametrize(
    ("f", "d", "k", "last", "left"),
    [
        (1, 4, None, 9, [6, 7, 8, 9]),
        (1, 4, None, 10, [7, 8, 9, 10]),
        (3, 4, None, 18, [9, 12, 15, 18]),
        (3, 6, None, 39, [24, 27, 30, 33, 36, 39]),
        (3, 6, 3, 39, [0, 9, 18, 24, 27, 30, 33, 36, 39]),
        (1, 4, 1, 9, list(range(10))),  # SPR.gin's keep_every = 1 keeps everything
    ],
)
def test_retention_worked_examples(tmp_path, f, d, k, last, left) -> None:
    c = Checkpointer(tmp_path, checkpoint_frequency=f, checkpoint_duration=d, keep_every=k)
    for i in range(last + 1):
        c.save_checkpoint(i, {"i": i})
    assert names(tmp_path) == sorted(
        [f"ckpt.{i}" for i in left] + [f"{SENTINEL}.{i}" for i in left]
    )


def test_override_short_circuits(tmp_path: Path) -> None:
    Checkpointer(tmp_path).save_checkpoint(3, {"x": 1})
    assert get_latest_checkpoint_number(tmp_path, override_number=-5) == -5
    assert get_latest_checkpoint_number(tmp_path, override_number=0) == 0
    assert get_latest_checkpoint_number("/does/not/exist", override_number=7) == 7
    assert not Path("/does/not/exist").exists()


def test_base_directory_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    assert get_latest_checkpoint_number(tmp_path / "f") == -1


def test_frequency_skip_writes_nothing(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_frequency=2)
    assert c.save_checkpoint(3, {"x": 1}) is None
    assert list(tmp_path.iterdir()) == []
    assert c.save_checkpoint(4, {"x": 1}) == tmp_path / "ckpt.4"
    assert c.load_checkpoint(3) is None and c.load_checkpoint(4) == {"x": 1}


def test_custom_sentinel_identifier(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, sentinel_file_identifier="agent")
    c.save_checkpoint(4, {"x": 1})
    assert (tmp_path / "sentinel_agent_complete.4").is_file()
    assert get_latest_checkpoint_number(tmp_path) == -1
    assert get_latest_checkpoint_number(tmp_path, sentinel_file_identifier="agent") == 4
    assert c.latest_checkpoint_number() == 4


# --- data, records, keys, paths -----------------------------------------------------------------


class _TensorsRecord(Record):
    """A minimal real record: named tensors, to check records come back as record objects."""

    kind = "test_tensors"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def to_content(self):
        return self.tensors, {}, {}

    @classmethod
    def from_pack(cls, pack: burnpack.Pack) -> _TensorsRecord:
        return cls(pack.tensors())


def test_records_and_plain_data_round_trip(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    w = torch.randn(4, 3)
    c.save_checkpoint(
        2,
        {
            "model": _TensorsRecord({"w": w}),
            "optim-1": StateRecord({"lr": 0.1}),
            "trainer": {"e": 1},
        },
    )
    assert sorted(os.listdir(c.checkpoint_path(2))) == ["model.bpk", "optim-1.bpk", "trainer.bpk"]
    loaded = c.load_checkpoint(2)
    assert list(loaded) == ["model", "optim-1", "trainer"]
    assert isinstance(loaded["model"], _TensorsRecord) and torch.equal(
        loaded["model"].tensors["w"], w
    )
    assert loaded["optim-1"] == {"lr": 0.1} and loaded["trainer"] == {"e": 1}
    manifest = json.loads(c.sentinel_path(2).read_bytes())
    assert manifest["format"] == MANIFEST_FORMAT and manifest["iteration"] == 2
    assert manifest["data"] == "ckpt.2"
    assert {k: v["kind"] for k, v in manifest["files"].items()} == {
        "model": "test_tensors", "optim-1": "state", "trainer": "state",
    }  # fmt: skip
    assert manifest["files"]["model"]["size"] == (c.checkpoint_path(2) / "model.bpk").stat().st_size


def test_load_selected_keys(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(0, b.tensors_payload(0))
    assert c.load_checkpoint(0, keys=["trainer"]) == {"trainer": b.tensors_payload(0)["trainer"]}
    with pytest.raises(KeyError, match=r"'optim'.*holds \['model', 'trainer'\]"):
        c.load_checkpoint(0, keys=["optim", "trainer"])
    assert c.load_checkpoint(1, keys=["trainer"]) is None


def test_load_onto_a_device(tmp_path: Path) -> None:
    """``device=`` puts every tensor there (``cpu`` here: the data as saved; a CUDA device is
    tests/test_gpu.py's); a device that cannot hold tensors is refused before anything is
    read, naming it."""
    c = Checkpointer(tmp_path)
    c.save_checkpoint(0, b.tensors_payload(0))
    for device in ("cpu", torch.device("cpu")):
        b.assert_tensors_payload(c.load_checkpoint(0, device=device), 0)
    for n in (0, 7):  # a checkpoint, and one that does not exist: neither is read
        with pytest.raises(ValueError, match="'meta': it holds no data"):
            c.load_checkpoint(n, device="meta")


def test_paths(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_file_prefix="run", sentinel_file_identifier="x")
    assert c.checkpoint_path(12) == tmp_path / "run.12"
    assert c.sentinel_path(12) == tmp_path / "sentinel_x_complete.12"
    assert c.save_checkpoint(12, {}) == tmp_path / "run.12"
    assert c.load_checkpoint(12) == {}  # an empty checkpoint is still a checkpoint


@pytest.mark.parametrize("key", ["", ".hidden", "a/b", "..", "-x", "x" * 129, "é", 3])
def test_unsafe_keys_are_refused_before_writing(tmp_path: Path, key: Any) -> None:
    c = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint 0 data key {key!r} is not a safe")):
        c.save_checkpoint(0, {"ok": 1, key: 2})
    assert list(tmp_path.iterdir()) == []


def test_bad_data_is_refused(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="must be a mapping"):
        c.save_checkpoint(0, 1729)  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="checkpoint 0 key 'trainer'"):
        c.save_checkpoint(0, {"model": {"w": torch.ones(2)}, "trainer": {"f": lambda: 0}})
    assert names(tmp_path) == []  # the staged model file went with the staging directory


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpoint_frequency": 0}, "checkpoint_frequency must be an int >= 1, got 0"),
        ({"checkpoint_frequency": 1.5}, "checkpoint_frequency"),
        ({"checkpoint_frequency": True}, "checkpoint_frequency"),
        ({"checkpoint_duration": 0}, "checkpoint_duration must be an int >= 1, got 0"),
        ({"checkpoint_duration": -4}, "checkpoint_duration"),
        ({"keep_every": 0}, "keep_every must be an int >= 1, got 0"),
        ({"keep_every": "3"}, "keep_every"),
        ({"checkpoint_file_prefix": ""}, "checkpoint_file_prefix '' is not a safe file name"),
        ({"checkpoint_file_prefix": "a/b"}, "checkpoint_file_prefix"),
        ({"sentinel_file_identifier": "x y"}, "sentinel_file_identifier"),
    ],
)
def test_invalid_settings(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Checkpointer(tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()  # validated before the directory is created


def test_invalid_iteration_numbers(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="must be an int, not str"):
        c.save_checkpoint("7", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not bool"):
        c.load_checkpoint(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="-1 means 'no checkpoint'"):
        c.save_checkpoint(-1, {})
    assert list(tmp_path.iterdir()) == []


# --- settings and removal -----------------------------------------------------------------------


def test_check_settings_refuses_what_the_constructor_refuses(tmp_path: Path) -> None:
    checkpointer._check_settings()  # the defaults
    for kwargs in (
        {"checkpoint_duration": 0},
        {"keep_every": 0},
        {"checkpoint_frequency": 2.5},
        {"checkpoint_file_prefix": "../x"},
    ):
        with pytest.raises(ValueError) as info:
            checkpointer._check_settings(**kwargs)
        with pytest.raises(ValueError, match=re.escape(str(info.value))):
            Checkpointer(tmp_path, **kwargs)


def test_remove_checkpoints_removes_sentinels_then_data(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_duration=10)
    for n in range(4):
        c.save_checkpoint(n, {"n": n})
    c.remove_checkpoints([3, 1, 7])  # 7 does not exist: nothing to do
    assert names(tmp_path) == [
        "ckpt.0",
        "ckpt.2",
        f"{SENTINEL}.0",
        f"{SENTINEL}.2",
    ]


# --- GC deviations ------------------------------------------------------------------------------


def test_sentinel_without_data_is_not_latest_and_gc_removes_it(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(7, {"n": 7})
    c.save_checkpoint(9, {"n": 9})
    shutil.rmtree(tmp_path / "ckpt.9")
    with pytest.warns(
        CheckpointWarning, match=r"checkpoint 9 .* skipped: .*ckpt.9: data is missing"
    ):
        assert get_latest_checkpoint_number(tmp_path) == 7
    assert c.load_checkpoint(9) is None
    c.save_checkpoint(8, {"n": 8})
    assert names(tmp_path) == ["ckpt.7", "ckpt.8", f"{SENTINEL}.7", f"{SENTINEL}.8"]


def test_gc_keeps_the_last_d_whatever_a_crash_or_settings_change_left(tmp_path: Path) -> None:
    Checkpointer(tmp_path, checkpoint_duration=100).save_checkpoint(0, {"n": 0})
    for n in (1, 2, 3, 10):  # Dopamine keeps all five (only n - 4 is ever looked at)
        Checkpointer(tmp_path).save_checkpoint(n, {"n": n})
    kept = (1, 2, 3, 10)  # the last d = 4; a jump in numbers does not cost more checkpoints
    assert names(tmp_path) == sorted(
        [f"ckpt.{n}" for n in kept] + [f"{SENTINEL}.{n}" for n in kept]
    )
    (tmp_path / "ckpt.3.extra").write_bytes(b"")  # other names are never touched
    (tmp_path / "tf_ckpt-3.index").write_bytes(b"")
    (tmp_path / "ckpt.4").mkdir()  # data without sentinel below N: swept
    Checkpointer(tmp_path).save_checkpoint(11, {"n": 11})
    kept = (2, 3, 10, 11)
    assert names(tmp_path) == sorted(
        [f"ckpt.{n}" for n in kept]
        + [f"{SENTINEL}.{n}" for n in kept]
        + ["ckpt.3.extra", "tf_ckpt-3.index"]
    )


def test_gc_after_a_crash_between_sentinel_and_gc_catches_up(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_duration=2)
    for n in range(3):
        c.save_checkpoint(n, {"n": n})
    # A crash right after sentinel 3 would leave 1 behind (Dopamine never looks at it again).
    Checkpointer(tmp_path, checkpoint_duration=100).save_checkpoint(3, {"n": 3})
    assert get_latest_checkpoint_number(tmp_path) == 3
    c.save_checkpoint(4, {"n": 4})
    assert names(tmp_path) == ["ckpt.3", "ckpt.4", f"{SENTINEL}.3", f"{SENTINEL}.4"]


def test_gc_never_touches_newer_checkpoints(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_duration=1)
    c.save_checkpoint(20, {"n": 20})
    c.save_checkpoint(5, {"n": 5})  # e.g. resumed from an override
    assert get_latest_checkpoint_number(tmp_path) == 20
    assert c.load_checkpoint(5) == {"n": 5}


def test_gc_failure_warns_after_a_complete_save(tmp_path, monkeypatch) -> None:
    c = Checkpointer(tmp_path, checkpoint_duration=1)
    c.save_checkpoint(0, {"n": 0})
    monkeypatch.setattr(store_local, "_remove", _raise_eio)
    with pytest.warns(CheckpointWarning, match="checkpoint 1 .* is complete, but removing"):
        c.save_checkpoint(1, {"n": 1})
    assert c.latest_checkpoint_number(verify=True) == 1


def _raise_eio(path: Path) -> None:
    raise OSError(errno.EIO, "injected", str(path))


def test_leftovers_of_a_crashed_save_are_cleaned(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    (tmp_path / "ckpt.5.999-0.tmp").mkdir()
    (tmp_path / "ckpt.5.999-0.tmp" / "model.bpk").write_bytes(b"partial")
    (tmp_path / "ckpt.4.12-3.tmp").write_bytes(b"")
    (tmp_path / f"{SENTINEL}.5.999-1.tmp").write_bytes(b"{")
    foreign = [
        "other.5.1-1.tmp",
        "ckpt.x.1-1.tmp",
        "ckpt.5.tmp",
        "sentinel_other_complete.5.1-2.tmp",
    ]
    for name in foreign:
        (tmp_path / name).write_bytes(b"")
    c.save_checkpoint(5, {"n": 5})
    assert names(tmp_path) == sorted(["ckpt.5", f"{SENTINEL}.5", *foreign])


# --- locking ------------------------------------------------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from lightning_bpk.checkpointer import Checkpointer
    from lightning_bpk.records import StateRecord

    class Slow(StateRecord):
        kind = "test_slow_state"

        def to_content(self):
            print("saving", flush=True)  # the lock is held now
            sys.stdin.readline()  # until the parent lets go
            return super().to_content()

    Checkpointer(sys.argv[1]).save_checkpoint(7, {"slow": Slow({"x": 1})})
    print("done", flush=True)
    """
)


def test_two_processes_saving_at_once(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(6, {"n": 6})
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "saving"
        with pytest.raises(CheckpointLockedError, match=f"{tmp_path} is locked .*pid {holder.pid}"):
            c.save_checkpoint(8, {"n": 8})
        assert not (tmp_path / "ckpt.8").exists()
        assert c.load_checkpoint(6) == {"n": 6}  # loading needs no lock
        assert get_latest_checkpoint_number(tmp_path, verify=True) == 6
    finally:
        out, _ = holder.communicate("go\n", timeout=60)
    assert holder.returncode == 0 and out.strip() == "done"
    c.save_checkpoint(8, {"n": 8})  # released by the holder's exit
    assert get_latest_checkpoint_number(tmp_path) == 8
    assert names(tmp_path) == sorted(f"{p}.{n}" for p in ("ckpt", SENTINEL) for n in (6, 7, 8))


# --- gin ----------------------------------------------------------------------------------------


def test_gin_bindings(tmp_path: Path, clean_gin) -> None:
    gin.parse_config(
        """
        Checkpointer.checkpoint_duration = 2
        Checkpointer.keep_every = 2
        get_latest_checkpoint_number.override_number = 12
        """
    )
    c = Checkpointer(tmp_path)
    assert (c.checkpoint_duration, c.keep_every) == (2, 2)
    for n in range(6):
        c.save_checkpoint(n, {"n": n})
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("ckpt.*")) == [0, 2, 4, 5]
    assert get_latest_checkpoint_number(tmp_path) == 12
    gin.clear_config()
    assert get_latest_checkpoint_number(tmp_path) == 5


def test_gin_full_selector_and_invalid_binding(tmp_path: Path, clean_gin) -> None:
    gin.bind_parameter("lightning_bpk.checkpointer.Checkpointer.checkpoint_frequency", 0)
    with pytest.raises(ValueError, match="checkpoint_frequency must be an int >= 1"):
        Checkpointer(tmp_path)


def test_repo_gin_file_parses(tmp_path: Path, clean_gin) -> None:
    gin_dir = Path(__file__).parents[1] / "lightning_bpk" / "gin"
    gin.parse_config_file(str(gin_dir / "checkpointer.gin"))
    c = Checkpointer(tmp_path)
    settings = (c.checkpoint_frequency, c.checkpoint_duration, c.keep_every)
    assert settings == (1, 4, None) and c.sentinel_file_identifier == "checkpoint"
    c.save_checkpoint(0, {})
    assert get_latest_checkpoint_number(tmp_path) == 0  # one macro feeds both identifiers


_REIMPORT = """
import importlib, runpy, gin
import lightning_bpk.checkpointer as first
second = importlib.reload(first)  # re-executes the module: same gin selectors again
runpy.run_path(first.__file__, run_name="__main__")  # and once more, as a script
gin.parse_config("Checkpointer.checkpoint_duration = 3")  # the short name is still unambiguous
print(second.Checkpointer("{base}").checkpoint_duration)
"""


def test_reimport_does_not_raise_duplicate_registration(tmp_path: Path) -> None:
    result = run_process([sys.executable, "-c", _REIMPORT.format(base=tmp_path)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"
