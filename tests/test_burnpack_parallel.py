"""burnpack._parallel: checksums and copies shared by two threads, the first error raised,
pauses of the cyclic garbage collector that nest, and the helper thread's work still done in
an atexit hook."""

from __future__ import annotations

import functools
import gc
import sys
import textwrap

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import _parallel

from _burnpack_helpers import _mixed
from conftest import run_process

# =============================== two threads, no GC pauses (burnpack._parallel) ================


def test_many_damaged_tensors_checked_on_two_threads(tmp_path):
    source = _mixed()
    path = burnpack.write(tmp_path / "m.bpk", source)
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    for name in ("s5", "s250", "w"):
        data[pack.data_start + pack.entries[name].data_offsets[0]] ^= 0x10
    path.write_bytes(data)
    with burnpack.read(path) as damaged:
        with pytest.raises(burnpack.ChecksumError, match=r"tensor 's250'"):  # first by name
            damaged.tensors()
        with pytest.raises(burnpack.ChecksumError, match=r"\['s250', 's5', 'w'\]"):
            damaged.verify()
        damaged.check(["s6", "i"])  # intact ones pass, and are not hashed again
        assert {"s6", "i"} <= damaged._verified


def test_run_shares_units_and_raises_the_first_error():
    done: list[int] = []
    _parallel.run([functools.partial(done.append, i) for i in range(100)])
    assert sorted(done) == list(range(100))

    def fail() -> None:
        raise ValueError("unit failed")

    with pytest.raises(ValueError, match="unit failed"):
        _parallel.run([fail, *(functools.partial(done.append, i) for i in range(10))])


def test_copy_moves_every_byte_in_pieces(monkeypatch):
    monkeypatch.setattr(_parallel, "COPY_CHUNK", 1000)
    sources = [torch.randn(n) for n in (1, 250, 251, 4000)]
    targets = [torch.zeros_like(s) for s in sources]
    pairs = zip(targets, sources, strict=True)
    _parallel.copy((burnpack.tensor_bytes(t), burnpack.tensor_bytes(s)) for t, s in pairs)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_gc_pauses_nest_and_leave_a_disabled_collector_disabled():
    assert gc.isenabled()
    with _parallel.gc_paused():
        with _parallel.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _parallel.gc_paused():
            pass
        assert not gc.isenabled()  # the user's choice stands
    finally:
        gc.enable()


def test_an_atexit_hook_still_saves_and_loads(direct_dir):
    """No new work reaches a thread once the interpreter shuts down: the I/O and the helper's
    work run on the caller's thread then."""
    script = textwrap.dedent(
        f"""
        import atexit, torch
        from lightning_bpk import burnpack

        def save_at_exit():
            source = {{f"w{{i}}": torch.full((1 << 20,), float(i)) for i in range(3)}}
            path = burnpack.write({str(direct_dir / "exit.bpk")!r}, source)
            targets = {{k: torch.zeros_like(v) for k, v in source.items()}}
            burnpack.read_into(path, targets)
            assert all(torch.equal(targets[k], v) for k, v in source.items())
            print("saved and loaded at exit")

        atexit.register(save_at_exit)
        burnpack.write({str(direct_dir / "warm.bpk")!r}, {{"w": torch.ones(1 << 20)}})  # threads up
        """
    )
    out = run_process([sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "saved and loaded at exit"
