"""Reading checkpoints (``lightning_bpk.checkpointer._view``): which checkpoints a directory
holds, which one is the newest complete one, what verifying one finds, and what loading a
damaged one raises.

The damage table runs on local disk and on ``memory://``, each damage done through the public
layout (the sentinel's manifest names the data directory or prefix; see ``tests/_backends.py``).
On both backends: the verifying search skips the damaged checkpoint with a
:class:`CheckpointWarning` naming it and the reason and falls back to the newest complete one,
which loads; loading the damaged one raises the same exception type on both (a checksum failure
is a :class:`RecordChecksumError`, so a ``burnpack.ChecksumError`` too, whatever the backend:
the promise of ``errors.py``).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import _backends as b
import pytest

from lightning_bpk import burnpack
from lightning_bpk.checkpointer import (
    Checkpointer,
    CheckpointWarning,
    get_latest_checkpoint_number,
    list_checkpoints,
    verify_checkpoint,
)
from lightning_bpk.checkpointer.manifest import MANIFEST_FORMAT
from lightning_bpk.records import RecordChecksumError, RecordError

from conftest import check_a_50_gib_claim_is_refused, replace_with_symlink

# damage -> (seen by the quick search, what loading it does: an exception type, None for
# "returns None" (no complete checkpoint), or "loads" (damage that does not touch the data))
DAMAGE = {
    b.damage_truncate: (True, RecordError),
    b.damage_flip_payload: (False, RecordChecksumError),
    b.damage_flip_metadata: (False, RecordChecksumError),
    b.damage_delete_file: (True, RecordError),
    b.damage_stray_file: (True, "loads"),
    b.damage_empty_sentinel: (True, RecordError),
    b.damage_garbage_sentinel: (True, RecordError),
    b.damage_wrong_iteration: (True, RecordError),
    b.damage_missing_data: (True, None),
}


@pytest.mark.parametrize("backend", b.BACKENDS)
@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__[len("damage_") :])
def test_damaged_latest_is_skipped_and_raises_the_same_type(
    tmp_path: Path, backend: str, damage
) -> None:
    where = b.make_where(backend, tmp_path)
    c = Checkpointer(where.base)
    for n in range(3):
        c.save_checkpoint(n, b.tensors_payload(n))
    reason = damage(where, 2)
    quick, loading = DAMAGE[damage]
    with pytest.warns(CheckpointWarning, match=f"checkpoint 2 in .* skipped: .*{reason}"):
        assert get_latest_checkpoint_number(where.base, verify=True) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_latest_checkpoint_number(where.base) == (1 if quick else 2)
    assert [w.category for w in caught] == [CheckpointWarning] * int(quick)
    problems = verify_checkpoint(where.base, 2)
    assert problems and any(re.search(reason, p) for p in problems), problems
    assert c.verify_checkpoint(2) == problems  # the method says what the function says
    assert verify_checkpoint(where.base, 1) == [] and c.verify_checkpoint(1) == []
    b.assert_tensors_payload(c.load_checkpoint(1), 1)
    if loading is None:
        assert c.load_checkpoint(2) is None
    elif loading == "loads":
        b.assert_tensors_payload(c.load_checkpoint(2), 2)
    else:
        with pytest.raises(RecordError) as info:
            c.load_checkpoint(2)
        checksum = loading is RecordChecksumError
        # the same type on every backend: exactly RecordChecksumError for a checksum failure,
        # a RecordError that is not one for anything else
        assert type(info.value) is loading, (type(info.value), info.value)
        assert isinstance(info.value, burnpack.ChecksumError) == checksum
        assert (info.value.kind == "checksum") == checksum
    # The next save works (retention still counts the damaged one) and the directory resumes
    # from it.
    c.save_checkpoint(3, b.tensors_payload(3))
    assert get_latest_checkpoint_number(where.base, verify=True) == 3
    assert c.latest_checkpoint_number(verify=True) == 3
    b.assert_tensors_payload(c.load_checkpoint(3), 3)


@pytest.mark.parametrize("backend", b.BACKENDS)
def test_a_damaged_resaved_checkpoint_falls_back_the_same_way(tmp_path: Path, backend: str):
    """Damage found through the manifest of a re-saved N (whose data may be ``ckpt.N~<hex>``):
    the search skips it, the checkpoint before it loads, and the type is a checksum error."""
    where = b.make_where(backend, tmp_path)
    c = Checkpointer(where.base)
    for n in range(3):
        c.save_checkpoint(n, b.tensors_payload(n))
    c.save_checkpoint(2, b.tensors_payload(2))  # the re-save
    data = where.data_name(2)
    assert data == "ckpt.2" or data.startswith("ckpt.2~"), data
    b.damage_flip_payload(where, 2)
    with pytest.warns(CheckpointWarning, match="checkpoint 2 in .* skipped"):
        assert get_latest_checkpoint_number(where.base, verify=True) == 1
    with pytest.raises(RecordChecksumError):
        c.load_checkpoint(2)
    b.assert_tensors_payload(c.load_checkpoint(1), 1)


# --- what the searches and verify find -----------------------------------------------------------


def test_every_checkpoint_damaged_gives_minus_one(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    for n in range(2):
        c.save_checkpoint(n, {"n": n})
        c.sentinel_path(n).write_bytes(b"")
    with pytest.warns(CheckpointWarning):
        assert get_latest_checkpoint_number(tmp_path, verify=True) == -1


def test_verify_checkpoint_function_reads_only(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_file_prefix="p")
    c.save_checkpoint(3, b.tensors_payload(3))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert verify_checkpoint(tmp_path, 3) == []
    assert verify_checkpoint(tmp_path, 3, checkpoint_file_prefix="p") == []
    assert "not 'q.3'" in verify_checkpoint(tmp_path, 3, checkpoint_file_prefix="q")[0]
    assert verify_checkpoint(tmp_path, 4) == [
        f"{tmp_path}/{b.SENTINEL}.4: no sentinel (iteration 4 is not complete)"
    ]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_bad_suffixes_are_skipped_not_fatal(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path, checkpoint_duration=100)
    for n in (3, 12):
        c.save_checkpoint(n, {"n": n})
    for suffix in ("tmp", "5.bak", "", "007", "-7", "1_000", " 50", "99.1234-0.tmp"):
        (tmp_path / f"{b.SENTINEL}.{suffix}").write_bytes(b"done")
    (tmp_path / f"{b.SENTINEL}.500").mkdir()  # a directory is not a sentinel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_latest_checkpoint_number(tmp_path) == 12  # numeric, not lexicographic
    assert [str(w.message) for w in caught] == [
        f"checkpoint 500 in {tmp_path} skipped: {tmp_path}/{b.SENTINEL}.500: "
        "sentinel is not a regular file"
    ]


def test_glob_metacharacters_in_path(tmp_path: Path) -> None:
    base = tmp_path / "run[x]*?"
    Checkpointer(base).save_checkpoint(8, {"n": 8})
    assert get_latest_checkpoint_number(base) == 8


def test_dopamine_done_sentinel_counts_but_is_unverifiable(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(4, b.tensors_payload(4))
    c.sentinel_path(4).write_bytes(b"done")
    assert get_latest_checkpoint_number(tmp_path) == 4
    with pytest.warns(CheckpointWarning, match="b'done' sentinel: no manifest"):
        assert get_latest_checkpoint_number(tmp_path, verify=True) == 4
    with pytest.warns(CheckpointWarning, match="only the tensor checksums"):
        assert c.verify_checkpoint(4) == []
    b.assert_tensors_payload(c.load_checkpoint(4), 4)  # keys come from the directory listing
    model = c.checkpoint_path(4) / "model.bpk"
    raw = bytearray(model.read_bytes())
    raw[-5] ^= 0x01  # inside the last tensor: what the files carry themselves is still checked
    model.write_bytes(raw)
    with pytest.warns(CheckpointWarning, match="b'done' sentinel"):
        assert "failing their checksum: ['b']" in " ".join(c.verify_checkpoint(4))


def test_done_sentinel_without_a_required_file_fails_verify_and_is_skipped(tmp_path: Path) -> None:
    """Nothing lists a b'done' checkpoint's files, so a lost trainer.bpk is only noticed by
    asking for it: resume asks for model and trainer, and falls back past it."""
    c = Checkpointer(tmp_path)
    c.save_checkpoint(3, b.tensors_payload(3))
    c.save_checkpoint(4, b.tensors_payload(4))
    c.sentinel_path(4).write_bytes(b"done")
    (c.checkpoint_path(4) / "trainer.bpk").unlink()
    required = ("model", "trainer")
    problems = verify_checkpoint(tmp_path, 4, required_keys=required)
    assert problems == [
        f"{c.checkpoint_path(4) / 'trainer.bpk'}: missing (Dopamine's b'done' sentinel)"
    ]
    assert verify_checkpoint(tmp_path, 4, full=False, required_keys=required) == problems
    with pytest.warns(CheckpointWarning, match=r"checkpoint 4 .* skipped: .*trainer\.bpk: missing"):
        assert get_latest_checkpoint_number(tmp_path, verify=True, required_keys=required) == 3
    # a manifest that does not list a required key is refused the same way
    c.save_checkpoint(5, {"model": b.tensors_payload(5)["model"]})
    assert verify_checkpoint(tmp_path, 5, required_keys=required) == [
        f"{c.sentinel_path(5)}: the manifest lists no 'trainer' entry"
    ]
    assert verify_checkpoint(tmp_path, 5) == []  # the checkpointer itself requires nothing


def test_a_required_key_may_name_alternatives(tmp_path: Path) -> None:
    """A sharded checkpoint holds ``sharded.index`` (and rank files) where others hold
    ``model``: resume requires ``model|sharded.index``, so both kinds are found."""
    c = Checkpointer(tmp_path)
    model = b.tensors_payload(0)["model"]
    c.save_checkpoint(0, {"model": model, "trainer": {"n": 0}})
    c.save_checkpoint(1, {"sharded.index": model, "trainer": {"n": 1}})
    c.save_checkpoint(2, {"trainer": {"n": 2}})
    required = ("model|sharded.index", "trainer")
    assert verify_checkpoint(tmp_path, 0, required_keys=required) == []
    assert verify_checkpoint(tmp_path, 1, required_keys=required) == []
    assert verify_checkpoint(tmp_path, 2, required_keys=required) == [
        f"{c.sentinel_path(2)}: the manifest lists no 'model|sharded.index' entry"
    ]
    with pytest.warns(CheckpointWarning, match="checkpoint 2 .* skipped"):
        assert get_latest_checkpoint_number(tmp_path, verify=True, required_keys=required) == 1
    c.sentinel_path(1).write_bytes(b"done")  # no manifest: the files on disk are asked
    assert verify_checkpoint(tmp_path, 1, full=False, required_keys=required) == []


def test_a_huge_damaged_manifest_gives_short_messages(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(0, {"n": 0})
    for n, doc in (
        (1, {"data": "x" * 1_000_000}),  # one huge value
        (2, {"data": "ckpt.2", "files": {f"k{i}": {} for i in range(10_000)}}),
    ):
        c.checkpoint_path(n).mkdir()
        manifest = {"format": MANIFEST_FORMAT, "version": 1, "iteration": n, **doc}
        c.sentinel_path(n).write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_latest_checkpoint_number(tmp_path) == 0
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all(len(m) < 1000 for m in messages), [len(m) for m in messages]
    # a manifest whose 10 000 listed files are all missing: the first few, and a count
    doc = {"data": "ckpt.2", "files": {}}
    for i in range(10_000):
        doc["files"][f"k{i}"] = {
            "file": f"k{i}.bpk",
            "kind": "state",
            "size": 1,
            "head_size": 1,
            "head_xxh3": "0" * 16,
        }
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "iteration": 2, **doc}
    c.sentinel_path(2).write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match=r"k4\.bpk: listed .*; \.\.\. and 9995 more$") as w:
        assert get_latest_checkpoint_number(tmp_path) == 0
    assert all(len(str(r.message)) < 2000 for r in w)


def test_dopamine_pickle_checkpoint_is_counted_but_never_unpickled(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(4, {"n": 4})
    (tmp_path / "ckpt.5").write_bytes(b"\x80\x04K\x05.")  # pickle.dumps(5)
    (tmp_path / f"{b.SENTINEL}.5").write_bytes(b"done")
    assert get_latest_checkpoint_number(tmp_path) == 5  # Dopamine's answer
    with pytest.warns(CheckpointWarning, match=r"checkpoint 5 .* skipped: .*Dopamine pickle"):
        assert get_latest_checkpoint_number(tmp_path, verify=True) == 4
    with pytest.raises(RecordError, match=r"ckpt\.5 is not a lightning_bpk data directory"):
        c.load_checkpoint(5)


@pytest.mark.parametrize("link", ["record file", "data directory", "sentinel"])
def test_a_symlink_in_a_checkpoint_is_refused_by_every_reader(tmp_path: Path, link: str) -> None:
    """The rule of lightning_bpk.layout: a checkpoint is made of real files and directories.
    The linked bytes are the checkpoint's own, intact; verify, load and the resume choice all
    refuse them anyway, naming the link (the old code loaded a linked record file and accepted
    a linked ckpt.N everywhere)."""
    base = tmp_path / "run"
    c = Checkpointer(base)
    for n in (0, 1):
        c.save_checkpoint(n, b.tensors_payload(n))
    inside = {
        "record file": base / "ckpt.1" / "model.bpk",
        "data directory": base / "ckpt.1",
        "sentinel": base / f"{b.SENTINEL}.1",
    }[link]
    linked = replace_with_symlink(inside, tmp_path / "elsewhere" / inside.name)
    refused = re.escape(str(linked)) + ".*symlink: refused, never followed"
    assert any(re.search(refused, p) for p in verify_checkpoint(base, 1)), verify_checkpoint(
        base, 1
    )
    assert any(re.search(refused, p) for p in verify_checkpoint(base, 1, full=False))
    with pytest.raises(RecordError, match=refused):
        c.load_checkpoint(1)
    for verify in (False, True):
        with pytest.warns(CheckpointWarning, match=refused):
            assert get_latest_checkpoint_number(base, verify=verify) == 0
    b.assert_tensors_payload(c.load_checkpoint(0), 0)


def test_list_checkpoints_shows_complete_and_partial_numbers(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path)
    c.save_checkpoint(0, {"n": 0})
    c.save_checkpoint(1, {"n": 1})
    (tmp_path / "ckpt.2").mkdir()  # data without sentinel
    (tmp_path / f"{b.SENTINEL}.3").write_bytes(b"done")  # sentinel without data
    entries = list_checkpoints(tmp_path)
    assert [(e.number, e.complete) for e in entries] == [
        (3, False),
        (2, False),
        (1, True),
        (0, True),
    ]
    assert entries[2].data == tmp_path / "ckpt.1"
    assert entries[2].sentinel == tmp_path / f"{b.SENTINEL}.1"
    assert list_checkpoints(tmp_path / "missing") == []


def test_a_manifest_claiming_50_gib_is_refused_before_anything_is_allocated(tmp_path):
    """A hostile (or damaged) manifest claims 50 GiB for model.bpk: loading compares the claim
    with the object's size first and raises a RecordError naming the object (the old code
    allocated the claimed size: MemoryError); the quick checks skip it the same way."""
    url = str(b.make_where("memory", tmp_path).base)
    check_a_50_gib_claim_is_refused(url, b.record_payload(0))
