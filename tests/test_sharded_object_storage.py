"""Sharded (FSDP2) checkpoints on a real S3-protocol server: moto's ThreadedMotoServer on
127.0.0.1 reached through s3fs (the fixtures of tests/test_object_storage.py), written by 2 gloo
CPU ranks in standalone scripts run under a timeout that kills their process group.

- raw DCP (tests/scripts/dcp_ranks.py ``s3``): every rank uploads its shards, the coordinator
  commits; this process then loads the checkpoint alone (2 -> 1 ranks, ranged reads);
- ``BurnpackCheckpoint`` under ``ModelParallelStrategy`` (tests/scripts/lightning_fsdp.py with a
  URL root): a failing upload on rank 1 fails the save on both ranks and commits nothing; the
  next run resumes from the bucket and ends bit-identical to the run that never stopped.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
import warnings

import fsspec
import pytest
import test_object_storage as object_storage
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.memory import MemoryFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from lightning_bpk import burnpack, cli
from lightning_bpk.checkpointer import Checkpointer, get_latest_checkpoint_number
from lightning_bpk.dcp import (
    BurnpackStorageReader,
    BurnpackStorageWriter,
    is_sharded,
    load_full_state_dict,
    read_index,
)
from lightning_bpk.lightning import sharded
from lightning_bpk.store import object_store

from conftest import SCRIPTS, run_process

# one moto server for these tests too, and a fresh bucket per test
s3_endpoint, bucket, _keys = object_storage.s3_endpoint, object_storage.bucket, object_storage._keys
RUN_TIMEOUT = 150
pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT)


def layout(url: str) -> list[str]:
    """The keys below ``url``, each save id replaced by ``<save>``."""
    return [re.sub(r"\.[0-9a-f]{8}\.", ".<save>.", key) for key in _keys(url)]


def checkpoint(n: int) -> list[str]:
    """The objects of sharded checkpoint ``n`` saved by 2 ranks."""
    data = [
        "scheduler.bpk",
        "sharded.index.bpk",
        "sharded.rank-0.<save>.bpk",
        "sharded.rank-1.<save>.bpk",
        "trainer.bpk",
    ]
    return [f"ckpt.{n}/{name}" for name in data] + [f"sentinel_checkpoint_complete.{n}"]


def test_raw_dcp_fsdp2_saved_on_2_ranks_into_s3_loads_in_one_process(bucket, tmp_path):
    from dcp_ranks import app_state, full_state, model

    url = f"s3://{bucket}/dcp"
    done = run_process(
        [sys.executable, SCRIPTS / "dcp_ranks.py", "s3", "--root", tmp_path],
        env={**os.environ, "DCP_URL": url},
        timeout=RUN_TIMEOUT,
        check=True,
    )
    assert "OK rank=0" in done.stdout and "OK rank=1" in done.stdout, done.stderr[-3000:]
    assert layout(f"{url}/fsdp") == [
        "sharded.index.bpk",
        "sharded.rank-0.<save>.bpk",  # one object per rank
        "sharded.rank-1.<save>.bpk",
    ]
    # the failed save: rank 0's upload is left (DCP has no hook after a failed write), nothing
    # names it; no index
    assert layout(f"{url}/failed") == ["sharded.rank-0.<save>.bpk"]
    assert not is_sharded(f"{url}/failed")

    # 2 -> 1: DCP's planner loads the FSDP2 shards into a plain module and Adam, no process group
    net = model(1)
    optim = torch.optim.Adam(net.parameters(), lr=0.01)
    state = app_state(net, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, storage_reader=BurnpackStorageReader(f"{url}/fsdp"))
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, optim, state["optim"])
    got = full_state(net, optim)
    flat = load_full_state_dict(f"{url}/fsdp")  # assembled from the chunks' byte ranges
    with burnpack.read(tmp_path / "s3-reference.bpk") as pack:
        want = pack.tensors()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key].to(value.dtype), value), key
        if key.startswith("model."):
            assert torch.equal(flat[key], value), key


def run(root: str, cwd, *args: str) -> tuple[int, str]:
    done = run_process(
        [sys.executable, SCRIPTS / "lightning_fsdp.py", "--root", root, "--epochs", "2", *args],
        timeout=RUN_TIMEOUT,
        cwd=cwd,
    )
    return done.returncode, done.stdout + done.stderr


def test_fsdp2_run_saves_to_s3_survives_a_failed_put_and_resumes_bit_identically(bucket, tmp_path):
    url = f"s3://{bucket}/run"
    base = f"{url}/checkpoints"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # Two epochs; the save of epoch 1 fails: rank 1's upload of its shards gives up. fit stops
    # with CheckpointSaveError on both ranks, and the script writes the state it trained.
    status, log = run(
        url, cwd, "--keep", "1", "--fail-at-epoch", "1", "--fail-put", "--tolerate-save-error",
        "--out", str(tmp_path / "straight.bpk"),
    )  # fmt: skip
    assert status == 0, log[-4000:]
    for rank in (0, 1):
        assert (
            f"SAVE FAILED rank={rank}: writing the shards of checkpoint 1 failed: rank 1: "
            f"ShardedCheckpointError: {base}/ckpt.1/sharded.rank-1." in log
        ), log[-4000:]
    assert "ConnectionError: injected (5 attempts); earlier checkpoints are untouched" in log
    # checkpoint 0 as saved, one object per rank; what rank 0 had uploaded for 1 is gone
    assert layout(base) == [".lightning_bpk.owner.1", *checkpoint(0)]
    assert get_latest_checkpoint_number(base, verify=True) == 0

    # The next run resumes from checkpoint 0 in the bucket and trains epoch 1 again.
    status, log = run(url, cwd, "--keep", "1", "--out", str(tmp_path / "resumed.bpk"))
    assert status == 0, log[-4000:]
    for rank in (0, 1):
        assert f"FINISHED rank={rank} epoch=2 step=6 restored=0" in log, log[-4000:]
    with burnpack.read(tmp_path / "straight.bpk") as pack:
        straight = pack.tensors()
    with burnpack.read(tmp_path / "resumed.bpk") as pack:
        resumed = pack.tensors()
    assert sorted(straight) == sorted(resumed)
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key  # bit-identical, model and optimizer

    # retention (keep 1) removed checkpoint 0, sentinel and data
    assert layout(base) == [".lightning_bpk.owner.2", *checkpoint(1)]
    full = load_full_state_dict(f"{base}/ckpt.1")  # 2 -> 1 in this process, ranged reads
    for key, value in straight.items():
        if key.startswith("model."):
            assert torch.equal(full[key], value), key
    for command in ("verify", "ls"):
        assert cli.main([command, base]) == 0
    for command in ("verify", "inspect"):  # the sharded checkpoint itself, by URL
        assert cli.main([command, f"{base}/ckpt.1"]) == 0
    assert os.listdir(cwd) == []  # nothing went to a local folder named after the URL


# --- in this process, on memory:// ----------------------------------------------------------------


def test_raw_dcp_on_memory_is_written_once_and_damage_is_named():
    """One process: the round trip (a bool tensor and a plain value too), the write-once rule,
    and a truncated or damaged object named by the checks that ranged reads run."""
    url = f"memory://sharded-{uuid.uuid4().hex[:8]}/step-1"
    state = {"w": torch.arange(12.0).reshape(3, 4), "mask": torch.tensor([True, False])}
    state["opt"] = {"lr": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(state, storage_writer=BurnpackStorageWriter(url))
        target = {"w": torch.zeros(3, 4), "mask": torch.zeros(2, dtype=torch.bool)}
        target["opt"] = {"lr": 0.0}
        dcp.load(target, storage_reader=BurnpackStorageReader(url))
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["mask"], state["mask"])
        assert target["opt"] == {"lr": 0.5}
        with pytest.raises(CheckpointException, match="written once"):
            dcp.save(state, storage_writer=BurnpackStorageWriter(url))
    index = read_index(url)
    assert index.check_files(verify_tensors=True) == []
    store = object_store(url)
    (rank_file,) = index.files
    good = store.read(rank_file)
    start = burnpack.loads(good).data_start  # the first tensor's first byte
    store.put(rank_file, good[:start] + bytes([good[start] ^ 1]) + good[start + 1 :])
    assert index.check_files() == []  # sizes only
    (problem,) = index.check_files(verify_tensors=True)
    assert f"{url}/{rank_file}" in problem and "fails its checksum" in problem
    store.put(rank_file, good[:-1])
    assert index.check_files() == [
        f"{url}/{rank_file}: {len(good) - 1} bytes, the index records {len(good)}"
    ]


class ReadRecordingFileSystem(MemoryFileSystem):
    """memory:// that records every read request as ``(path, start, end)``."""

    protocol = "recorded"
    store: dict = {}  # noqa: RUF012 - fsspec's MemoryFileSystem keeps its files on the class
    pseudo_dirs: list = [""]  # noqa: RUF012
    reads: list = []  # noqa: RUF012

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.reads.append((path, start, end))
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation("recorded", ReadRecordingFileSystem, clobber=True)


def test_a_load_fetches_the_index_the_head_and_only_the_chunk_it_needs():
    url = f"recorded://bucket-{uuid.uuid4().hex[:8]}/step-1"
    a, b = torch.arange(4096.0), -torch.arange(4096.0)  # 16 KiB each, in one rank file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save({"a": a, "b": b}, storage_writer=BurnpackStorageWriter(url))
        ReadRecordingFileSystem.reads.clear()
        target = {"b": torch.zeros(4096)}
        dcp.load(target, storage_reader=BurnpackStorageReader(url))
    assert torch.equal(target["b"], b)
    reads = list(ReadRecordingFileSystem.reads)
    index = read_index(url)
    (rank_file,) = index.files
    head = index.files[rank_file]["head_size"]
    with burnpack.loads(object_store(url).read(rank_file)) as pack:
        start, end = (head + offset for offset in pack.entries["b"].data_offsets)
    assert sorted((s, e) for p, s, e in reads if p.endswith(rank_file)) == [(0, head), (start, end)]
    assert {p.rpartition("/")[2] for p, _, _ in reads} == {"sharded.index.bpk", rank_file}


def test_a_superseded_run_stops_before_any_rank_writes_a_shard():
    """The lease applies to sharded saves: rank 0 checks it before the ranks write, and every
    rank learns the outcome (here one rank: no process group)."""
    url = f"memory://sharded-{uuid.uuid4().hex[:8]}/run"
    zombie = Checkpointer(url)
    zombie.take_over()
    Checkpointer(url).take_over()  # a newer run
    from lightning_bpk.runtime.sharded import save  # both integrations', every rank's

    shards = {"model": {"w": torch.ones(4)}}
    with pytest.raises(
        sharded.ShardedCheckpointError,
        match=r"preparing checkpoint 0 failed on rank 0: CheckpointSupersededError: .*superseded",
    ):
        save(zombie, 0, shards, {})
    assert sorted(object_store(url).list("")) == [".lightning_bpk.owner.2"]


# --- a hostile index in a bucket, over HTTP -----------------------------------------------------


def test_a_hostile_index_in_a_bucket_opens_nothing_local_nor_outside_its_prefix(
    bucket, tmp_path, capsys
):
    """The index names the rank file by an absolute local path (a valid copy of it lies there)
    and, in a second checkpoint, by ``../``: convert from s3:// once read that local file and
    wrote its data out. Now every reader refuses, naming the index and the name."""
    import test_sharded_index as hostile

    url = f"s3://{bucket}/run/ckpt"
    doc = hostile.write_checkpoint(url)
    (rank_file,) = doc["files"]
    canary = tmp_path / "outside" / "evil.bpk"
    canary.parent.mkdir()
    canary.write_bytes(object_store(url).read(rank_file))
    hostile._rename_rank_file(doc, str(canary))
    hostile._write_index(url, hostile.json.dumps(doc))
    converted = tmp_path / "converted.bpk"
    named = r"s3://.*sharded\.index\.bpk: file '/.*evil\.bpk' is not a plain name"
    with hostile.recording() as opened:
        assert cli.main(["convert", url, str(converted)]) == cli.EXIT_BAD_FILE
        assert re.search(named, capsys.readouterr().err) and not converted.exists()
        with pytest.raises(sharded.ShardedCheckpointError, match=named):
            load_full_state_dict(url)
        hostile._rename_rank_file(doc, f"../{rank_file}")  # the run's prefix, beside ckpt/
        object_store(f"s3://{bucket}/run").put(rank_file, object_store(url).read(rank_file))
        hostile._write_index(url, hostile.json.dumps(doc))
        with pytest.raises(CheckpointException, match=rf"'\.\./{rank_file}' is not a plain name"):
            dcp.load({"w": torch.zeros(4, 4)}, storage_reader=BurnpackStorageReader(url))
    assert not [p for p in opened if str(canary.parent) in p], opened
