"""Tests of the durable file primitives: atomic publish, scratch cleanup, fsync helpers."""

from __future__ import annotations

import errno
import io
import itertools
import os

import pytest

from lightning_bpk import _fs


def test_atomic_file_publishes_on_success(tmp_path):
    target = tmp_path / "out.bin"
    with _fs.atomic_file(target) as f:
        _fs.write_all(f, b"hello")
        assert not target.exists()  # nothing visible until the block succeeds
        assert len(os.listdir(tmp_path)) == 1
    assert target.read_bytes() == b"hello"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_atomic_file_replaces_existing_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with _fs.atomic_file(target) as f:
        _fs.write_all(f, b"new content")
    assert target.read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_atomic_file_failure_keeps_old_file_and_removes_scratch(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"), _fs.atomic_file(target) as f:
        _fs.write_all(f, b"partial")
        raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_atomic_file_keyboard_interrupt_also_cleans_up(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt), _fs.atomic_file(target) as f:
        _fs.write_all(f, b"partial")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_atomic_file_rename_onto_directory_fails_cleanly(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    with pytest.raises(OSError), _fs.atomic_file(target) as f:
        _fs.write_all(f, b"data")
    assert os.listdir(tmp_path) == ["dir"] and os.listdir(target) == []


def test_scratch_name_is_a_sibling_with_pid_and_counter(tmp_path):
    target = tmp_path / "model.bpk"
    scratch = _fs.scratch_path(target)
    assert scratch.parent == tmp_path
    assert scratch.name.startswith(f"model.bpk.{os.getpid()}-")
    assert scratch.name.endswith(_fs.SCRATCH_SUFFIX)
    assert _fs.scratch_path(target) != scratch  # the counter moves on


def test_atomic_file_skips_an_existing_scratch_name(tmp_path, monkeypatch):
    target = tmp_path / "m.bpk"
    monkeypatch.setattr(_fs, "_counter", itertools.count(7))
    taken = tmp_path / f"m.bpk.{os.getpid()}-7{_fs.SCRATCH_SUFFIX}"
    taken.write_bytes(b"someone else's scratch")
    with _fs.atomic_file(target) as f:
        scratch = f"m.bpk.{os.getpid()}-8{_fs.SCRATCH_SUFFIX}"
        assert sorted(os.listdir(tmp_path)) == sorted([taken.name, scratch])
        _fs.write_all(f, b"mine")
    assert target.read_bytes() == b"mine"
    assert taken.read_bytes() == b"someone else's scratch"  # never clobbered


def test_atomic_file_in_missing_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError), _fs.atomic_file(tmp_path / "no" / "x"):
        pass


class _Trickle(io.BytesIO):
    """A sink that accepts at most 3 bytes per call, like a raw file may."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, data) -> int:
        self.calls += 1
        return super().write(bytes(memoryview(data)[:3]))


def test_write_all_loops_over_short_writes():
    sink = _Trickle()
    _fs.write_all(sink, b"0123456789")
    assert sink.getvalue() == b"0123456789" and sink.calls == 4


def test_write_all_accepts_non_byte_memoryviews():
    sink = io.BytesIO()
    view = memoryview(bytearray(range(8))).cast("I")  # 2 items of 4 bytes
    _fs.write_all(sink, view)
    assert sink.getvalue() == bytes(range(8))


def test_write_all_propagates_enospc(tmp_path):
    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as err:
        _fs.write_all(Full(), b"x")
    assert err.value.errno == errno.ENOSPC


def test_fsync_dir(tmp_path):
    _fs.fsync_dir(tmp_path)  # a real directory syncs without error
    with pytest.raises(FileNotFoundError):
        _fs.fsync_dir(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        _fs.fsync_dir(tmp_path / "file")
