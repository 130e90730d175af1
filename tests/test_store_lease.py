"""The lease (``lightning_bpk.store.lease``): a run that takes a checkpoint directory over
fences every older writer, which stops before its next write and deletes nothing, on local disk
and on ``memory://``.

The lease against a real S3 server (a lost answer to its create-only PUT, a zombie process
fenced by a newer run) is in ``tests/test_object_storage.py``.
"""

from __future__ import annotations

import os

import _backends as b
import pytest

from lightning_bpk.checkpointer import (
    Checkpointer,
    get_latest_checkpoint_number,
    list_checkpoints,
)
from lightning_bpk.store import open_store
from lightning_bpk.store.lease import CheckpointSupersededError, Lease


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_superseded_writer_stops_before_its_next_write_and_deletes_nothing(tmp_path, where):
    url = str(b.make_where(where, tmp_path).base)
    old = Checkpointer(url, checkpoint_duration=1)
    old.take_over()
    old.save_checkpoint(0, b.record_payload(0))
    new = Checkpointer(url, checkpoint_duration=1)
    new.take_over()
    with pytest.raises(CheckpointSupersededError, match=r"superseded by a newer run \(pid"):
        old.save_checkpoint(1, b.record_payload(1))
    assert [e.number for e in list_checkpoints(url)] == [0]  # nothing written, nothing deleted
    new.save_checkpoint(1, b.record_payload(1))
    assert get_latest_checkpoint_number(url, verify=True) == 1


def test_the_lease_keeps_only_the_newest_generation(tmp_path):
    store = open_store(tmp_path)
    leases = [Lease.acquire(store) for _ in range(3)]
    assert [lease.generation for lease in leases] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == [".lightning_bpk.owner.3"]
    leases[2].check()
