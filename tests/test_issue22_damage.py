"""Issue 22 safety net: the damage table on local disk and on ``memory://``, with the same
exception types on both.

Each damage is done through the public layout (the sentinel's manifest names the data
directory or prefix; see ``tests/_backends.py``). On both backends: the verifying search skips
the damaged checkpoint with a :class:`CheckpointWarning` naming it and the reason and falls
back to the newest complete one, which loads; loading the damaged one raises the same
exception type on both (a checksum failure is a :class:`RecordChecksumError`, so a
``burnpack.ChecksumError`` too, whatever the backend: the promise of ``errors.py``).

On main before issue 22 lands, the rows where the two backends' twin implementations differ
fail on ``memory``; they are expected to pass once one checkpoint implementation serves both.
"""

from __future__ import annotations

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
    verify_checkpoint,
)
from lightning_bpk.records import RecordChecksumError, RecordError

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
    assert verify_checkpoint(where.base, 1) == []
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
    # The next save works and the directory resumes from it.
    c.save_checkpoint(3, b.tensors_payload(3))
    assert get_latest_checkpoint_number(where.base, verify=True) == 3
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
