"""Tests of the durable file primitives: atomic publish, scratch cleanup, fsync helpers, and the
sinks (O_DIRECT against the page cache: same bytes, the fallback, faults at the write call)."""

from __future__ import annotations

import errno
import fcntl
import io
import itertools
import logging
import mmap
import os
import random
import signal
import time
from pathlib import Path

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


def test_read_full_fills_the_view_from_an_offset_and_counts_short_at_the_end(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        preadv = os.preadv
        # a preadv that returns at most 7 bytes a call: the loop keeps reading until full
        monkeypatch.setattr(os, "preadv", lambda f, views, at: preadv(f, [views[0][:7]], at))
        view = memoryview(bytearray(30))
        assert _fs.read_full(fd, view, 10) == 30 and bytes(view) == bytes(range(10, 40))
        tail = memoryview(bytearray(30))
        assert _fs.read_full(fd, tail, 90) == 10 and bytes(tail[:10]) == bytes(range(90, 100))
    finally:
        os.close(fd)


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


# =============================== sinks: O_DIRECT and the page cache ===============================


def _pieces(seed: int, total: int) -> list[bytes]:
    """``total`` random bytes cut at random places (1 byte to 3 MiB; some of 0 bytes)."""
    rng = random.Random(seed)
    data = rng.randbytes(total)
    cuts = [*sorted(rng.randrange(total + 1) for _ in range(40)), total]
    at, out = 0, []
    for cut in cuts:
        out.append(data[at:cut])
        at = cut
    return out


def _write(target: Path, pieces: list[bytes], patches: list[tuple[int, bytes]]) -> _fs.Sink:
    with _fs.atomic_sink(target, sum(map(len, pieces))) as sink:
        for piece in pieces:
            sink.write(piece)
        for offset, data in patches:
            sink.patch(offset, data)
    return sink


# sizes: under a block, not a multiple of one, just over a buffer, several buffers and a tail
@pytest.mark.parametrize("total", [1, 4095, 4097, 8 * 1024 * 1024 + 1, 21_000_017])
def test_direct_and_buffered_sinks_write_the_same_bytes(direct_dir, monkeypatch, total):
    monkeypatch.setattr(_fs, "DIRECT_MIN", 0)  # O_DIRECT for every size
    pieces = _pieces(total, total)
    expected = bytearray(b"".join(pieces))
    rng = random.Random(-total)
    patches = []
    for _ in range(6):  # on disk, in the buffer being filled, across both, at the very end
        offset = rng.randrange(total)
        data = rng.randbytes(min(total - offset, rng.choice([1, 100, 5000, 600_000])))
        patches.append((offset, data))
        expected[offset : offset + len(data)] = data
    direct = _write(direct_dir / "direct.bin", pieces, patches)
    monkeypatch.setattr(_fs, "DIRECT_MIN", total + 1)  # the page cache
    buffered = _write(direct_dir / "buffered.bin", pieces, patches)
    assert (direct.direct, buffered.direct) == (True, False)
    assert (direct_dir / "direct.bin").read_bytes() == expected
    assert (direct_dir / "buffered.bin").read_bytes() == expected
    assert listdir(direct_dir) == ["buffered.bin", "direct.bin"]


def test_an_empty_file_through_either_sink(direct_dir, monkeypatch):
    monkeypatch.setattr(_fs, "DIRECT_MIN", 0)
    for name in ("a", "b"):
        with _fs.atomic_sink(direct_dir / name, 0) as sink:
            sink.write(b"")
        assert (direct_dir / name).read_bytes() == b""
        monkeypatch.setattr(_fs, "DIRECT_MIN", 1)


def test_patching_bytes_not_written_yet_or_writing_after_finish_is_refused(direct_dir, monkeypatch):
    monkeypatch.setattr(_fs, "DIRECT_MIN", 0)
    with (
        pytest.raises(ValueError, match="not written yet"),
        _fs.atomic_sink(direct_dir / "x", 10) as sink,
    ):
        sink.write(b"0123456789")
        sink.patch(8, b"abc")
    assert listdir(direct_dir) == []
    with _fs.atomic_sink(direct_dir / "y", 10) as sink:
        sink.write(b"0123456789")
        sink.finish()  # once: the end of the block does not write or cut the file again
        with pytest.raises(ValueError, match="write after finish"):
            sink.write(b"more")
    assert (direct_dir / "y").read_bytes() == b"0123456789"


def test_the_debug_log_says_which_path_ran(direct_dir, tmpfs_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_bpk")
    big = bytes(_fs.DIRECT_MIN)
    for folder in (direct_dir, tmpfs_dir):
        with _fs.atomic_sink(folder / "big", len(big)) as sink:
            sink.write(big)
    with _fs.atomic_sink(direct_dir / "small", 10) as sink:
        sink.write(b"0123456789")
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_bpk"]
    assert f"writing {direct_dir / 'big'} with O_DIRECT" in said[0]
    assert f"writing {tmpfs_dir / 'big'} through the page cache (statx" in said[1]
    assert f"writing {direct_dir / 'small'} through the page cache (10 bytes <" in said[2]


def test_tmpfs_falls_back_to_the_page_cache(tmpfs_dir):
    fd = os.open(tmpfs_dir / "probe", os.O_RDWR | os.O_CREAT)
    try:
        assert _fs.direct_alignment(fd)[0] is None  # no alignment reported, no block device
    finally:
        os.close(fd)
    data = random.Random(0).randbytes(3 * 1024 * 1024 + 5)
    sink = _write(tmpfs_dir / "file", [data], [(7, b"patched")])
    assert not sink.direct
    assert (tmpfs_dir / "file").read_bytes() == data[:7] + b"patched" + data[14:]


def test_alignment_from_the_block_device_when_statx_does_not_say(direct_dir, monkeypatch):
    """Kernels before 6.1 report no direct I/O alignment: the block device's sizes count."""
    monkeypatch.setattr(_fs, "_statx_dio", lambda fd: None)
    fd = os.open(direct_dir / "probe", os.O_RDWR | os.O_CREAT)
    try:
        alignment, why = _fs.direct_alignment(fd)
    finally:
        os.close(fd)
    assert alignment is not None and alignment % mmap.PAGESIZE == 0
    assert why.startswith("logical block size")


def test_a_refused_o_direct_flag_falls_back(direct_dir, monkeypatch):
    real = fcntl.fcntl

    def refuse(fd, command, *args):
        if command == fcntl.F_SETFL:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, command, *args)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    data = bytes(range(256)) * 4096
    sink = _write(direct_dir / "f", [data], [])
    assert not sink.direct and (direct_dir / "f").read_bytes() == data


def _direct_writes(monkeypatch, fail_at: int | None) -> list[int]:
    """Count the calls of write_all made by O_DIRECT writes; raise ENOSPC at call ``fail_at``."""
    real, calls = _fs.write_all, []

    def counted(f, data):
        if isinstance(f, _fs._At):
            calls.append(len(calls) + 1)
            if len(calls) == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(f, data)

    monkeypatch.setattr(_fs, "write_all", counted)
    return calls


def test_a_full_disk_during_an_o_direct_write_keeps_the_old_file(direct_dir, monkeypatch):
    target = direct_dir / "f.bin"
    target.write_bytes(b"the earlier checkpoint")
    pieces = _pieces(1, 20_000_000)
    with monkeypatch.context() as m:
        calls = _direct_writes(m, None)
        _write(direct_dir / "dry.bin", pieces, [(3, b"xyz")])
    assert len(calls) >= 4  # the buffers, the tail, the patch's blocks
    for fail_at in range(1, len(calls) + 1):
        with monkeypatch.context() as m:
            _direct_writes(m, fail_at)
            with pytest.raises(OSError, match="No space left") as err:
                _write(target, pieces, [(3, b"xyz")])
        assert err.value.errno == errno.ENOSPC
        assert target.read_bytes() == b"the earlier checkpoint"
        assert listdir(direct_dir) == ["dry.bin", "f.bin"]  # no scratch file left


def test_aligned_memory_is_written_without_a_copy(direct_dir):
    """The seam for staging buffers laid out as the file: nothing passes the bounce buffers."""
    size = 20 * 1024 * 1024 + 300
    image = _fs.aligned_buffer(size + (-size) % mmap.PAGESIZE)
    data = random.Random(5).randbytes(size)
    image[:size] = data
    with _fs.atomic_sink(direct_dir / "image", size) as sink:
        sink.write(memoryview(image)[:size])
    assert sink.direct and sink.copied == size % sink._alignment
    assert (direct_dir / "image").read_bytes() == data


def test_memory_laid_out_as_the_file_passes_the_buffers_only_until_the_first_is_full(direct_dir):
    """A header, then a tensor whose memory lies at its file offset modulo the page (how an
    async saver stages it): the buffer the header started is filled from the tensor and
    written, and the rest of the tensor, aligned from there on, is written from where it lies."""
    header, size = 1000, 20 * 1024 * 1024 + 300
    image = _fs.aligned_buffer(header + size + (-(header + size)) % mmap.PAGESIZE)
    data = random.Random(6).randbytes(header + size)
    image[: header + size] = data
    with _fs.atomic_sink(direct_dir / "staged", header + size) as sink:
        sink.write(memoryview(image)[:header])
        sink.write(memoryview(image)[header : header + size])  # at file offset `header`
    assert sink.direct
    buffer = _fs._BUFFER_SIZE
    whole = (header + size - buffer) - (header + size - buffer) % sink._alignment
    assert sink.copied == header + size - whole  # the first buffer and the unaligned tail
    assert (direct_dir / "staged").read_bytes() == data


def test_a_forked_child_writes_with_its_own_io_thread(direct_dir):
    data = random.Random(7).randbytes(3 * 1024 * 1024)
    _write(direct_dir / "parent", [data], [])  # the parent's I/O thread exists now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _write(direct_dir / "child", [data], [])
            code = 0
        finally:
            os._exit(code)
    for _ in range(600):  # a child that hangs on the parent's vanished thread: killed after 60 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's O_DIRECT write hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert (direct_dir / "child").read_bytes() == data


def listdir(path: Path) -> list[str]:
    return sorted(os.listdir(path))
