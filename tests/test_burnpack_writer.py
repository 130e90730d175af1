"""Writing files (burnpack.writer): O_DIRECT and the page cache give the same bytes as dumps,
atomic writes survive injected faults (ENOSPC at every write call, a kernel file-size limit),
checksums are patched into the metadata in place, suffix rules."""

from __future__ import annotations

import errno
import logging
import os
import sys
import textwrap

import pytest
import torch
import xxhash

from lightning_bpk import _fs, burnpack

from _burnpack_helpers import TORCH_DTYPES, listdir
from conftest import run_process

# =============================== atomicity under injected faults ===============================


def _odd_sizes() -> dict[str, torch.Tensor]:
    """Every dtype at an odd length (the file is no multiple of a block), one byte, empty."""
    out = {
        f"{burn}/odd": torch.arange(7 * 3, dtype=torch.int64).to(t)[:7]
        for burn, t in TORCH_DTYPES.items()
    }
    out.update(
        {
            "bool": torch.tensor([True, False, True]),
            "one byte": torch.tensor([5], dtype=torch.uint8),
            "empty": torch.empty(0, 3),
            "zero-dim": torch.tensor(2.5),
        }
    )
    return out


def _many_across_buffers() -> dict[str, torch.Tensor]:
    """3,000 tensors (the metadata spans many blocks: its checksums are patched on disk) and
    large ones across the sink's buffers."""
    g = torch.Generator().manual_seed(3)
    out = {f"small.{i}": torch.randn(i % 97 + 1, generator=g) for i in range(3000)}
    out.update({f"large.{i}": torch.randn(1_500_001 + i, generator=g) for i in range(4)})
    return out


@pytest.mark.parametrize(
    "tensors",
    [_odd_sizes, dict, lambda: {"one": torch.tensor([1], dtype=torch.int8)}, _many_across_buffers],
    ids=["every-dtype-odd-sizes", "empty-pack", "single-byte", "many-across-buffers"],
)
@pytest.mark.parametrize("checksums", [True, False])
def test_o_direct_writes_the_bytes_of_the_page_cache_path(
    direct_dir, monkeypatch, caplog, tensors, checksums
):
    """Byte identity with Burn's layout: O_DIRECT (for every size here), the page cache and
    ``dumps`` give the same file."""
    content = tensors()
    metadata = {"note": "odd"}
    expected = burnpack.dumps(content, metadata=metadata, checksums=checksums)
    caplog.set_level(logging.DEBUG, logger="lightning_bpk")
    monkeypatch.setattr(_fs, "DIRECT_MIN", 0)
    direct = burnpack.write(direct_dir / "d.bpk", content, metadata=metadata, checksums=checksums)
    monkeypatch.setattr(_fs, "DIRECT_MIN", len(expected) + 1)
    paged = burnpack.write(direct_dir / "p.bpk", content, metadata=metadata, checksums=checksums)
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_bpk"]
    assert "with O_DIRECT" in said[0] and "through the page cache" in said[1]
    assert direct.read_bytes() == expected and paged.read_bytes() == expected
    assert len(expected) % 4096  # every file ends in a partial block: padded, then cut back
    with burnpack.read(direct) as pack:
        pack.verify()


@pytest.mark.parametrize("size", [64, 5_000_000], ids=["page-cache", "o-direct"])
def test_enospc_at_each_write_call_leaves_no_scratch_and_old_file(tmp_path, monkeypatch, size):
    path = burnpack.write(tmp_path / "e.bpk", {"old": torch.ones(8)})
    before = path.read_bytes()
    content = {"a": torch.ones(size // 4), "b": torch.arange(9.0)}
    real, calls = _fs.write_all, []

    def counting(f, data):
        calls.append(1)
        real(f, data)

    monkeypatch.setattr(_fs, "write_all", counting)
    burnpack.write(tmp_path / "dry.bpk", content)
    (tmp_path / "dry.bpk").unlink()
    assert calls
    for failing_call in range(1, len(calls) + 1):
        count = {"n": 0}

        def full_disk(f, data, failing_call=failing_call, count=count):
            count["n"] += 1
            if count["n"] == failing_call:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(f, data)

        monkeypatch.setattr(_fs, "write_all", full_disk)
        with pytest.raises(burnpack.BurnpackIOError, match="No space left") as err:
            burnpack.write(path, content)
        assert isinstance(err.value, OSError) and str(path) in str(err.value)
        assert path.read_bytes() == before and listdir(tmp_path) == ["e.bpk"]


def test_a_tmpfs_directory_saves_and_loads_through_the_page_cache(tmpfs_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_bpk")
    content = {"w": torch.randn(1_000_000), "b": torch.arange(5)}
    path = burnpack.write(tmpfs_dir / "m.bpk", content)
    assert any("through the page cache" in r.getMessage() for r in caplog.records)
    targets = {k: torch.zeros_like(v) for k, v in content.items()}
    burnpack.read_into(path, targets)
    assert all(torch.equal(targets[k], v) for k, v in content.items())
    with burnpack.read(path) as pack:
        assert torch.equal(pack.tensor("w"), content["w"])


def test_file_size_limit_in_subprocess_leaves_old_file(tmp_path):
    """A real kernel fault (EFBIG from RLIMIT_FSIZE) midway through the payload."""
    path = burnpack.write(tmp_path / "k.bpk", {"old": torch.ones(8)})
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from lightning_bpk import burnpack
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            burnpack.write({str(path)!r}, {{"big": torch.ones(1 << 20)}})
        except burnpack.BurnpackIOError as e:
            print("ERR", e)
        """
    )
    out = run_process([sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR") and "k.bpk" in out.stdout
    assert path.read_bytes() == before and listdir(tmp_path) == ["k.bpk"]


def test_write_into_missing_directory_is_an_io_error(tmp_path):
    with pytest.raises(burnpack.BurnpackIOError, match="nope"):
        burnpack.write(tmp_path / "nope" / "x.bpk", {"a": torch.ones(1)})


# =============================== checksums patched in place, suffixes ==========================


def test_checksums_patched_in_place_around_user_metadata_and_scalars(tmp_path):
    """Digests land at offsets computed once: user keys sorting before and after the checksum
    run, multi-byte names, scalars, and big (hashed while written) and small tensors mixed."""
    tensors = {
        "é" * 30: torch.arange(300, dtype=torch.int16),
        "big": torch.rand(2**18 + 5),  # over _PARALLEL_HASH_MIN: hashed on the helper thread
        "b": torch.ones(3, dtype=torch.bool),
    }
    metadata = {"a": "0" * 16, "lightning_bpk/a": "x", "lightning_bpk/z": "0" * 16, "zz": "y"}
    scalars = {"lr": 0.5, "step": 7}
    path = burnpack.write(tmp_path / "m.bpk", tensors, metadata=metadata, scalars=scalars)
    with burnpack.read(path) as pack:
        pack.verify()
        assert pack.metadata == metadata and pack.scalars["step"] == burnpack.Scalar.Int(7)
        for name, t in tensors.items():
            assert xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(t)) == pack.checksums[name]
            assert torch.equal(pack.tensor(name), t)
    assert path.read_bytes() == burnpack.dumps(tensors, metadata=metadata, scalars=scalars)


def test_a_digest_an_entry_comes_with_is_the_checksum_written(tmp_path):
    # a digest taken as the bytes were made (a staged copy) is recorded as it is, a provider
    # asked once; one that is no xxh3-64 hex digest is refused naming the tensor, and a wrong
    # one is trusted, so a verified read of that tensor fails
    big, small = torch.rand(2**18 + 5), torch.arange(6, dtype=torch.int16)
    asked: list[str] = []

    def provider() -> str:
        asked.append("small")
        return xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(small))

    tensors = {
        "big": burnpack.TensorEntry.from_tensor(
            big, digest=xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(big))
        ),
        "small": burnpack.TensorEntry.from_tensor(small, digest=provider),
    }
    path = burnpack.write(tmp_path / "m.bpk", tensors)
    assert asked == ["small"]
    assert path.read_bytes() == burnpack.dumps({"big": big, "small": small})
    for bad in ("0" * 15, "G" * 16, 7):
        entry = burnpack.TensorEntry.from_tensor(small, digest=lambda bad=bad: bad)
        with pytest.raises(burnpack.ValidationError, match="tensor 'odd': digest"):
            burnpack.dumps({"odd": entry})
    wrong = burnpack.TensorEntry.from_tensor(small, digest="0123456789abcdef")
    pack = burnpack.loads(burnpack.dumps({"w": wrong}))
    with pytest.raises(burnpack.ChecksumError, match="'w'"):
        pack.tensor("w")


def test_write_add_suffix_false_writes_exactly_the_path(tmp_path):
    path = burnpack.write(tmp_path / "manual", {"w": torch.ones(2)}, add_suffix=False)
    assert path == tmp_path / "manual"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manual"]
    assert burnpack.read(path).tensor("w").tolist() == [1.0, 1.0]
