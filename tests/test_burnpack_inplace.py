"""read_into (burnpack._inplace): loading into existing tensors in place, storage kept and
autograd told, tied targets, the checked copy path for other dtypes and views, and damaged or
truncated files named before a target is left silently wrong."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import _inplace, reader

from _burnpack_helpers import _mixed

# =============================== read_into: loading into existing tensors ======================


# steps of 1000 bytes: large tensors copied in several steps, one partial, small ones in batches
@pytest.mark.parametrize("step", [1000, 2**20], ids=["steps", "batched"])
def test_read_into_fills_existing_storage_in_place(tmp_path, monkeypatch, step):
    monkeypatch.setattr(_inplace, "READ_STEP", step)
    source = _mixed()
    path = burnpack.write(tmp_path / "m.bpk", source)
    targets = {k: torch.zeros_like(v) for k, v in source.items()}
    pointers = {k: t.data_ptr() for k, t in targets.items()}
    versions = {k: t._version for k, t in targets.items()}
    burnpack.read_into(path, targets)
    assert all(torch.equal(targets[k], source[k]) for k in source)
    assert {k: t.data_ptr() for k, t in targets.items()} == pointers
    assert all(t._version > versions[k] for k, t in targets.items())  # autograd sees the write
    partial = {k: torch.zeros_like(source[k]) for k in list(source)[::3]}  # gaps between them
    burnpack.read_into(path, partial)
    assert all(torch.equal(t, source[k]) for k, t in partial.items())


def test_read_into_one_tensor_under_two_names(tmp_path):
    """Targets sharing memory are read one at a time, each checked before the next."""
    path = burnpack.write(tmp_path / "t.bpk", {"a": torch.ones(3), "b": torch.full((3,), 2.0)})
    shared = torch.zeros(3)
    burnpack.read_into(path, {"a": shared, "b": shared})
    assert shared.tolist() == [2.0, 2.0, 2.0]


def test_read_into_casts_views_and_bools_through_the_checked_path(tmp_path):
    source = {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}
    path = burnpack.write(tmp_path / "m.bpk", source)
    as_f64 = torch.zeros(2, 3, dtype=torch.float64)
    transposed = torch.zeros(3, 2).t()  # not contiguous
    flags = torch.zeros(2, dtype=torch.bool)
    burnpack.read_into(path, {"w": as_f64, "flags": flags})
    burnpack.read_into(path, {"w": transposed})
    assert as_f64.tolist() == transposed.tolist() == source["w"].tolist()
    assert flags.tolist() == [True, False]


def test_read_into_refuses_missing_names_and_other_shapes_before_touching_anything(tmp_path):
    path = burnpack.write(tmp_path / "m.bpk", {"a": torch.ones(4), "b": torch.ones(2)})
    a = torch.zeros(4)
    with pytest.raises(burnpack.TensorNotFoundError, match="'nope'"):
        burnpack.read_into(path, {"a": a, "nope": torch.zeros(1)})
    with pytest.raises(burnpack.ValidationError, match=r"'b' has shape \[2\], the target \[3\]"):
        burnpack.read_into(path, {"a": a, "b": torch.zeros(3)})
    assert a.sum().item() == 0
    with pytest.raises(burnpack.BurnpackIOError, match=r"absent\.bpk"):
        burnpack.read_into(tmp_path / "absent.bpk", {"a": a})


@pytest.mark.parametrize("step", [1000, 2**20], ids=["steps", "batched"])
def test_read_into_detects_a_flipped_byte_and_names_the_tensor(tmp_path, monkeypatch, step):
    monkeypatch.setattr(_inplace, "READ_STEP", step)
    source = _mixed()
    path = burnpack.write(tmp_path / "f.bpk", source)
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    for name in ("w", "s17"):  # a large tensor and a small one in a batch
        data[pack.data_start + pack.entries[name].data_offsets[0] + 7] ^= 0x01
    path.write_bytes(data)
    targets = {k: torch.zeros_like(v) for k, v in source.items()}
    with pytest.raises(burnpack.ChecksumError, match=rf"{path}: tensor '(w|s17)'"):
        burnpack.read_into(path, targets)
    w = torch.zeros(3, 700)
    burnpack.read_into(path, {"w": w}, verify=False)
    assert w.view(torch.uint8).flatten()[7].item() != 0 and not torch.equal(w, source["w"])


def test_read_into_names_a_file_truncated_after_it_was_parsed(tmp_path, monkeypatch):
    """Another program truncating the file in place between the parse and the reads: the short
    read is an error naming the file, never a target silently left half-filled."""
    source = {"w": torch.randn(4096)}
    path = burnpack.write(tmp_path / "t.bpk", source)
    parse = reader._map

    def parse_then_truncate(fd, p):
        pack = parse(fd, p)
        os.truncate(p, pack.data_start + 1000)
        return pack

    monkeypatch.setattr(reader, "_map", parse_then_truncate)
    with pytest.raises(burnpack.BurnpackIOError, match=rf"{path}: the file ended at byte "):
        burnpack.read_into(path, {"w": torch.zeros(4096)})
