"""Tensors without elements in a burnpack (``torch.zeros(0)``, shape ``[0, 3]``, ...): first,
in the middle, last, alone, several in a row and nothing else, read back through every reader
entry point, with and without checksum verification.

A zero-byte tensor still gets an aligned start (Burn's rule), so an empty tensor first in data
order shares offset 0 with the tensor after it. A checksum-verifying read of such a file used to
raise ``IndexError`` (``_parallel.batches`` only opened a batch when a size overflowed the
limit); the file itself was valid, and ``fixtures/burnpack/empty-first.bpk`` is one the writer
wrote before the fix.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_bpk import burnpack
from lightning_bpk.burnpack import _parallel, reader

from _burnpack_helpers import _same
from conftest import FIXTURES

Layout = list[tuple[str, torch.Tensor]]

_W = torch.arange(1.0, 7.0).reshape(2, 3)
_B = torch.tensor([7, -1, 3], dtype=torch.int64)
_HALF = torch.tensor(2.5, dtype=torch.float16)  # zero-dim: one element, not empty

# Writer order; names chosen so that name order and data order differ.
LAYOUTS: dict[str, Layout] = {
    "first": [("z_mask", torch.zeros(0)), ("w", _W), ("b", _B)],
    "middle": [("w", _W), ("rows", torch.zeros(0, 3, dtype=torch.int64)), ("b", _B)],
    "last": [("w", _W), ("b", _B), ("flags", torch.zeros(0, dtype=torch.bool))],
    "only": [("mask", torch.zeros(0))],
    "all": [
        ("z", torch.zeros(0)),
        ("rows", torch.zeros(0, 3, dtype=torch.int64)),
        ("flags", torch.zeros(0, dtype=torch.bool)),
        ("grid", torch.zeros(2, 0, 4, dtype=torch.bfloat16)),
    ],
    "run": [
        ("w", _W),
        ("e2", torch.zeros(0, dtype=torch.uint8)),
        ("e1", torch.zeros(3, 0)),
        ("e3", torch.zeros(0, dtype=torch.bool)),
        ("s", _HALF),
        ("b", _B),
    ],
}


def _from_raw(pack: burnpack.Pack, name: str, verify: bool) -> torch.Tensor:
    """Tensor ``name`` rebuilt from the bytes :meth:`Pack.raw` returns, so the raw path is
    compared like the others (dtype and shape from the pack's descriptor)."""
    info = pack.entries[name]
    out = torch.empty(info.shape, dtype=burnpack._torch_dtype(info.dtype))
    raw = bytes(pack.raw(name, verify=verify))
    out.reshape(-1).view(torch.uint8).copy_(torch.tensor(list(raw), dtype=torch.uint8))
    return out


def _loads_tensors(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    return burnpack.loads(path.read_bytes()).tensors(verify=verify)


def _loads_tensor(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    pack = burnpack.loads(path.read_bytes())
    return {n: pack.tensor(n, verify=verify) for n in pack.names}


def _loads_raw(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    pack = burnpack.loads(path.read_bytes())
    return {n: _from_raw(pack, n, verify) for n in pack.names}


def _read_tensors(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    with burnpack.read(path) as pack:
        return pack.tensors(verify=verify)


def _read_tensor(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    with burnpack.read(path) as pack:
        return {n: pack.tensor(n, verify=verify) for n in pack.data_order}


def _read_raw(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    with burnpack.read(path) as pack:
        return {n: _from_raw(pack, n, verify) for n in pack.names}


def _read_into(path: Path, layout: Layout, verify: bool) -> dict[str, torch.Tensor]:
    # Same dtype, contiguous: a non-empty target is read straight into, an empty one copied.
    targets = {n: torch.zeros_like(t) for n, t in layout}
    burnpack.read_into(path, targets, verify=verify)
    return targets


READERS: dict[str, Callable[[Path, Layout, bool], dict[str, torch.Tensor]]] = {
    "loads-tensors": _loads_tensors,
    "loads-tensor": _loads_tensor,
    "loads-raw": _loads_raw,
    "read-tensors": _read_tensors,
    "read-tensor": _read_tensor,
    "read-raw": _read_raw,
    "read_into": _read_into,
}


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("entry", sorted(READERS))
@pytest.mark.parametrize("position", sorted(LAYOUTS))
def test_empty_tensors_read_back_through_every_entry_point(tmp_path, position, entry, verify):
    layout = LAYOUTS[position]
    path = burnpack.write(tmp_path / "e.bpk", layout)
    back = READERS[entry](path, layout, verify)
    assert sorted(back) == sorted(n for n, _ in layout)
    for name, expected in layout:
        assert _same(back[name], expected), (name, back[name], expected)


@pytest.mark.parametrize("source", ["loads", "read"])
@pytest.mark.parametrize("position", sorted(LAYOUTS))
def test_check_and_verify_pass_and_still_name_a_damaged_tensor(tmp_path, position, source):
    """Every checksum (an empty tensor's is the digest of no bytes) checks out, and with an empty
    tensor in the run the others are still hashed: a damaged one is named."""
    layout = LAYOUTS[position]
    path = burnpack.write(tmp_path / "e.bpk", layout)
    with burnpack.loads(path.read_bytes()) if source == "loads" else burnpack.read(path) as pack:
        assert set(pack.checksums) == set(pack.names)
        pack.check(pack.data_order)
        pack.verify()
        assert pack._verified == set(pack.names)
    damaged = next((n for n, t in layout if t.numel()), None)
    if damaged is None:  # nothing but empty tensors: no byte to damage
        return
    data = bytearray(path.read_bytes())
    pack = burnpack.loads(data)
    data[pack.data_start + pack.entries[damaged].data_offsets[0]] ^= 0x01
    path.write_bytes(data)
    with burnpack.read(path) as broken:
        with pytest.raises(burnpack.ChecksumError, match=rf"\['{damaged}'\]"):
            broken.verify()
        with pytest.raises(burnpack.ChecksumError, match=rf"tensor '{damaged}'"):
            broken.tensors()


EMPTY_FIRST = FIXTURES / "burnpack" / "empty-first.bpk"
EMPTY_FIRST_CONTENT: Layout = [
    ("mask", torch.zeros(0)),
    ("weight", torch.tensor([[1.0, 2.0], [3.0, 4.0]])),
    ("rows", torch.zeros(0, 3, dtype=torch.int64)),
    ("bias", torch.tensor([0.5, -0.5])),
    ("flags", torch.zeros(0, dtype=torch.bool)),
]


def test_a_file_written_before_the_fix_reads_back(tmp_path):
    """``empty-first.bpk`` was written by the writer as it was when checksum-verifying reads of
    such files failed: the writer was right (Burn's layout), the reader was not."""
    raw = EMPTY_FIRST.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    assert digest in (EMPTY_FIRST.parents[1] / "README.md").read_text()
    # Burn's layout: the empty first tensor shares offset 0 with the next one, and the trailing
    # empty one is placed at an aligned start that the file is padded up to.
    with burnpack.read(EMPTY_FIRST) as pack:
        assert pack.data_order == [n for n, _ in EMPTY_FIRST_CONTENT]
        assert {n: pack.entries[n].data_offsets for n in pack.names} == {
            "bias": (256, 264),
            "flags": (512, 512),
            "mask": (0, 0),
            "rows": (256, 256),
            "weight": (0, 16),
        }
        assert pack.file_size == pack.data_start + 512
        pack.verify()
        back = pack.tensors()
    targets = {n: torch.ones_like(t) for n, t in EMPTY_FIRST_CONTENT}
    burnpack.read_into(EMPTY_FIRST, targets)
    for name, expected in EMPTY_FIRST_CONTENT:
        assert _same(back[name], expected) and _same(targets[name], expected)
    # what the writer writes for this content today, byte for byte: the fix left it as it was
    assert burnpack.dumps(EMPTY_FIRST_CONTENT) == raw


def test_batches_open_a_run_for_a_first_item_of_zero_bytes():
    """The root cause: a first item of size 0 never overflowed the limit, so no run was open."""
    size = len
    assert _parallel.batches([b""], size, 4) == [[b""]]
    assert _parallel.batches([b"", b"", b"abc", b""], size, 4) == [[b"", b"", b"abc", b""]]
    assert _parallel.batches([b"", b"abcdef", b"", b"a"], size, 4) == [
        [b""],
        [b"abcdef"],
        [b"", b"a"],
    ]
    assert _parallel.batches([], size, 4) == []


def test_a_file_emptied_between_fstat_and_mmap_is_a_header_error_naming_it(tmp_path, monkeypatch):
    """mmap refuses a zero-length file with a ValueError: a file another program truncates to 0
    bytes right after the size check must still give a burnpack error naming it."""
    path = burnpack.write(tmp_path / "gone.bpk", LAYOUTS["first"])
    real_fstat = os.fstat

    def fstat_then_truncate(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        os.truncate(path, 0)
        return result

    with monkeypatch.context() as patched, pytest.raises(burnpack.HeaderError) as err:
        patched.setattr(reader.os, "fstat", fstat_then_truncate)  # os.fstat for this read only
        burnpack.read(path)
    assert str(err.value).startswith(f"{path}: ") and "became empty" in str(err.value)
