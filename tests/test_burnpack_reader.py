"""Reading (burnpack.reader): tensors are zero-copy views of the file's mapping that stay valid
after close and after the file is replaced, only the header and metadata are parsed on open,
checksums are verified when a tensor is read, and errors name the file."""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack

from _burnpack_helpers import f32

# =============================== zero-copy, lazy reading =======================================


def _mapped_file(address: int) -> str | None:
    """The file backing ``address`` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


def test_read_maps_the_file_and_tensor_points_into_the_mapping(tmp_path):
    t = torch.arange(100_000, dtype=torch.float32)
    path = burnpack.write(tmp_path / "z.bpk", {"t": t})
    with burnpack.read(path) as pack:
        tracemalloc.start()
        try:
            view = pack.tensor("t")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert _mapped_file(view.data_ptr()) == str(path)
        assert peak < 10_000  # a 400 kB payload was not copied
        assert torch.equal(view, t)


def test_loads_views_the_given_buffer():
    data = bytearray(burnpack.dumps({"t": torch.arange(8.0)}))
    pack = burnpack.loads(data)
    t = pack.tensor("t")
    data[pack.data_start : pack.data_start + 4] = f32(42.0)  # mutate the source ...
    assert t[0].item() == 42.0  # ... and the tensor sees it: no copy was made
    assert pack.tensor("t", verify=False).data_ptr() == t.data_ptr()


def test_read_parses_only_header_and_metadata(tmp_path):
    path = burnpack.write(tmp_path / "l.bpk", {"t": torch.ones(1 << 20)})
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    data[-1] ^= 0xFF  # damage after parsing: opening did not hash the payload
    with pytest.raises(burnpack.ChecksumError):
        pack.tensor("t")


@pytest.mark.parametrize("atomic", [True, False])
def test_tensor_survives_rewrite_of_the_same_path(tmp_path, atomic):
    path = burnpack.write(tmp_path / "r.bpk", {"t": torch.full((4096,), 1.0)})
    pack = burnpack.read(path)
    t = pack.tensor("t")
    burnpack.write(path, {"t": torch.full((16,), 2.0)}, atomic=atomic)
    assert bool((t == 1.0).all()) and t.numel() == 4096
    pack.close()
    assert bool((t == 1.0).all())
    with burnpack.read(path) as fresh:
        assert fresh.tensor("t").tolist() == [2.0] * 16


def test_pack_context_manager_closes_and_tensors_survive(tmp_path):
    path = burnpack.write(tmp_path / "c.bpk", {"a": torch.arange(5.0), "b": torch.ones(2)})
    with burnpack.read(path) as pack:
        a = pack.tensor("a")
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(burnpack.BurnpackError, match="closed"):
        pack.tensor("b")
    assert pack.names == ["a", "b"] and pack.nbytes == path.stat().st_size
    del a
    gc.collect()
    pack.close()  # idempotent


def test_pack_closes_mapping_when_no_tensor_remains(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"a": torch.arange(5.0)})
    pack = burnpack.read(path)
    mapping = pack._mmap
    pack.close()
    assert mapping.closed


# =============================== checksums =====================================================


def test_flipped_payload_byte_raises_checksum_error_verify_false_skips(tmp_path):
    path = burnpack.write(tmp_path / "f.bpk", {"a": torch.ones(64), "b": torch.zeros(64)})
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    start = pack.data_start + pack.entries["b"].data_offsets[0]
    data[start + 7] ^= 0x01
    path.write_bytes(data)
    with burnpack.read(path) as damaged:
        assert damaged.tensor("a").sum().item() == 64  # undamaged tensors still load
        with pytest.raises(burnpack.ChecksumError, match=rf"{path}.*tensor 'b'"):
            damaged.tensor("b")
        assert damaged.tensor("b", verify=False).view(torch.uint8)[7].item() == 1
        with pytest.raises(burnpack.ChecksumError, match=r"\['b'\]"):
            damaged.verify()


def test_checksum_is_written_per_tensor_and_burn_files_have_none():
    data = burnpack.dumps({"a": torch.ones(2), "b": torch.ones(3)})
    pack = burnpack.loads(data)
    assert set(pack.checksums) == {"a", "b"} and pack.metadata == {}
    assert all(len(v) == 16 for v in pack.checksums.values())
    assert burnpack.loads(burnpack.dumps({"a": torch.ones(2)}, checksums=False)).checksums == {}


# =============================== errors name the file ==========================================


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(burnpack.BurnpackIOError, match="absent") as err:
        burnpack.read(tmp_path / "absent.bpk")
    assert isinstance(err.value, OSError)
    with pytest.raises(burnpack.ValidationError, match="not a regular file"):
        burnpack.read(tmp_path)
    fifo = tmp_path / "pipe.bpk"
    os.mkfifo(fifo)
    with pytest.raises(burnpack.ValidationError, match="not a regular file"):
        burnpack.read(fifo)  # must not block waiting for a writer
    (tmp_path / "tiny.bpk").write_bytes(b"NRUB")
    with pytest.raises(burnpack.HeaderError, match=r"tiny\.bpk"):
        burnpack.read(tmp_path / "tiny.bpk")
