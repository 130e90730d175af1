"""lightning_bpk.dcp: burnpack as torch.distributed.checkpoint's storage layer.

Multi-rank cases run tests/scripts/dcp_ranks.py (gloo CPU processes, a timeout that kills the
whole process group): every 1-D DTensor layout saved and loaded in every other one, an FSDP2
model + Adam state resharded 2 -> 3 and 2 -> 1 ranks, and a fault in each writer/reader method on
each rank. Single-process cases need no process group (DCP's no-dist mode).
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_bpk import burnpack, cli
from lightning_bpk.dcp import (
    INDEX_KEY,
    BurnpackStorageReader,
    BurnpackStorageWriter,
    ShardedCheckpointError,
    is_sharded,
    load_full_state_dict,
    read_index,
)
from lightning_bpk.layout import _sharded_index_name
from lightning_bpk.records import ModuleRecord
from lightning_bpk.store import Store, open_store

from conftest import SCRIPTS, run_process

SCRIPT = SCRIPTS / "dcp_ranks.py"
RUN_TIMEOUT = 120


def run(scenarios: str, root: Path, world: int) -> str:
    done = run_process(
        [sys.executable, SCRIPT, scenarios, "--root", root, "--world", world],
        timeout=RUN_TIMEOUT,
        check=True,
    )
    for rank in range(world):
        assert f"OK rank={rank}" in done.stdout, done.stdout + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(autouse=True)
def _quiet_no_dist():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_every_layout_and_fsdp2_state_reshard_across_world_sizes_and_faults_fail_all_ranks(
    tmp_path,
):
    # 2 ranks: save every layout; then a fault in each writer/reader method on each rank
    # fails the call on every rank, commits nothing, and the earlier checkpoint still loads
    run("save,faults", tmp_path, 2)
    fresh = sorted(p for p in (tmp_path / "faults").iterdir() if p.name.startswith("fresh-"))
    assert len(fresh) == 10  # every injected writer fault on every rank it can hit
    assert not any(is_sharded(p) for p in fresh)

    files = sorted(os.listdir(tmp_path / "fsdp"))
    assert files[0] == "sharded.index.bpk" and len(files) == 3, files  # one file per rank
    run("load", tmp_path, 3)  # 2 -> 3 ranks, every layout into every layout
    run("load", tmp_path, 1)  # 2 -> 1

    # consolidation in this process, no process group: the gathered full state dict exactly
    full = load_full_state_dict(tmp_path / "fsdp")
    with burnpack.read(tmp_path / "reference.bpk") as pack:
        for key, value in pack.tensors().items():
            if key.startswith("model."):
                assert torch.equal(full["model." + key[len("model.") :]], value), key
            elif key != "optim.lr":
                fqn, name = key[len("optim.") :].rsplit(".", 1)
                assert torch.equal(full[f"optim.state.{fqn}.{name}"], value), key
    assert full["optim.param_groups.0.lr"] == 0.01  # an object, stored as plain data


def save(path: Path, state: dict) -> None:
    dcp.save(state, storage_writer=BurnpackStorageWriter(path))


def test_objects_are_stored_as_plain_data_and_the_index_is_json(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"lr": 0.5, "betas": [0.9, 0.99]}}
    save(tmp_path, state)
    with burnpack.read(tmp_path / _sharded_index_name()) as pack:
        document = json.loads(pack.metadata[INDEX_KEY])
    assert document["tensors"]["w"]["shape"] == [2, 3]
    for name in os.listdir(tmp_path):
        assert b"\x80\x04" not in (tmp_path / name).read_bytes()[:64]  # no pickle protocol header
    target = {"w": torch.zeros(2, 3), "meta": {"lr": 0.0, "betas": [0.0, 0.0]}}
    dcp.load(target, storage_reader=BurnpackStorageReader(tmp_path))
    assert torch.equal(target["w"], state["w"]) and target["meta"] == state["meta"]


def test_a_value_that_needs_pickle_is_refused_with_its_name(tmp_path):
    with pytest.raises(BaseException, match=r"'odd'.*without pickle"):
        save(tmp_path, {"odd": object()})
    assert not is_sharded(tmp_path)


def test_a_second_save_replaces_the_first_and_sweeps_its_files(tmp_path):
    save(tmp_path, {"w": torch.ones(3)})
    first = set(os.listdir(tmp_path))
    save(tmp_path, {"w": torch.full((3,), 2.0)})
    second = set(os.listdir(tmp_path))
    assert len(second) == 2 and first & second == {"sharded.index.bpk"}
    assert torch.equal(load_full_state_dict(tmp_path)["w"], torch.full((3,), 2.0))


def test_damaged_or_mixed_files_are_refused_naming_the_file(tmp_path):
    save(tmp_path / "a", {"w": torch.ones(64)})
    save(tmp_path / "b", {"w": torch.zeros(64)})
    index = read_index(tmp_path / "a")
    (rank_file,) = index.files
    data = bytearray((tmp_path / "a" / rank_file).read_bytes())
    data[-8] ^= 0xFF  # flip a byte of the tensor
    (tmp_path / "a" / rank_file).write_bytes(bytes(data))
    with pytest.raises(ShardedCheckpointError, match=rank_file):
        load_full_state_dict(tmp_path / "a")
    assert read_index(tmp_path / "a").check_files(verify_tensors=True)
    # a rank file of another save under the expected name: refused by its save id
    (other,) = read_index(tmp_path / "b").files
    os.replace(tmp_path / "b" / other, tmp_path / "a" / rank_file)
    with pytest.raises(ShardedCheckpointError, match=r"another save|differ"):
        load_full_state_dict(tmp_path / "a")


def test_a_directory_without_index_is_not_a_checkpoint(tmp_path):
    assert not is_sharded(tmp_path)
    assert not BurnpackStorageReader.validate_checkpoint_id(tmp_path)
    with pytest.raises(ShardedCheckpointError, match=r"sharded\.index\.bpk"):
        read_index(tmp_path)
    with pytest.raises(BaseException, match=r"sharded\.index\.bpk"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=BurnpackStorageReader(tmp_path))


def test_the_command_line_reads_a_sharded_directory(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save(ckpt, {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "param_ids": {"w": 7}})
    assert cli.main(["inspect", str(ckpt)]) == 0
    assert "model.w" in capsys.readouterr().out
    assert cli.main(["verify", str(ckpt)]) == 0
    assert cli.main(["convert", str(ckpt), str(tmp_path / "m.bpk")]) == 0
    record = ModuleRecord.load(tmp_path / "m.bpk")
    assert torch.equal(record.tensors["w"], torch.arange(4.0)) and record.param_ids == {"w": 7}
    assert cli.main(["diff", str(ckpt), str(tmp_path / "m.bpk")]) == 0

    (rank_file,) = read_index(ckpt).files
    data = bytearray((ckpt / rank_file).read_bytes())
    data[-8] ^= 0xFF
    (ckpt / rank_file).write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(ckpt)]) == 1
    assert rank_file in capsys.readouterr().out


# --- the same damage, the same error, on local disk and on an object store -----------------------


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _tensor_byte(store: Store, rank_file: str, other: bytes) -> None:
    data = store.read(rank_file)
    store.put(rank_file, _flip(data, burnpack.loads(data).data_start))


def _head_byte(store: Store, rank_file: str, other: bytes) -> None:
    store.put(rank_file, _flip(store.read(rank_file), burnpack.HEADER_SIZE + 4))


def _truncated(store: Store, rank_file: str, other: bytes) -> None:
    store.put(rank_file, store.read(rank_file)[:-1])


def _missing(store: Store, rank_file: str, other: bytes) -> None:
    store.remove([rank_file])


def _other_save(store: Store, rank_file: str, other: bytes) -> None:
    store.put(rank_file, other)  # the same chunks and sizes, written by another save


def _garbage_index(store: Store, rank_file: str, other: bytes) -> None:
    store.put("sharded.index.bpk", b"not a burnpack" * 8)


def _no_index(store: Store, rank_file: str, other: bytes) -> None:
    store.remove(["sharded.index.bpk"])


DAMAGE = {
    "a tensor byte": _tensor_byte,
    "a head byte": _head_byte,
    "truncated": _truncated,
    "missing": _missing,
    "another save's file": _other_save,
    "garbage index": _garbage_index,
    "no index": _no_index,
}


def _outcome(call) -> str:
    """What ``call`` did: its result, or the type(s) and message(s) of what it raised (DCP's
    wrapping unwrapped per rank)."""
    try:
        return f"ok: {call()!r}"
    except CheckpointException as e:
        return "; ".join(f"{type(f).__name__}: {f}" for f, _ in e.failures.values())
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _damaged(where: Path | str, damage) -> dict[str, str]:
    """Every reader's outcome on a checkpoint at ``where`` damaged by ``damage``, with the
    checkpoint's location and the save id written as placeholders."""
    state = {"w": torch.arange(64.0), "m": torch.tensor([True, False])}
    save(f"{where}-other", {"w": torch.zeros(64), "m": torch.tensor([False, True])})
    save(where, state)
    store = open_store(where)
    (rank_file,) = read_index(where).files
    (other,) = read_index(f"{where}-other").files
    damage(store, rank_file, open_store(f"{where}-other").read(other))
    target = {"w": torch.zeros(64), "m": torch.zeros(2, dtype=torch.bool)}
    outcomes = {
        "load_full_state_dict": _outcome(lambda: sorted(load_full_state_dict(where))),
        "dcp.load": _outcome(lambda: dcp.load(target, storage_reader=BurnpackStorageReader(where))),
        "check_files": _outcome(lambda: read_index(where).check_files()),
        "verify": _outcome(lambda: read_index(where).check_files(verify_tensors=True)),
        "is_sharded": _outcome(lambda: is_sharded(where)),
    }
    return {
        k: re.sub(r"sharded\.rank-0\.[0-9a-f]{8}", "<rank>", v.replace(str(where), "<ckpt>"))
        for k, v in outcomes.items()
    }


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_refused_alike_on_local_disk_and_memory(damage, tmp_path):
    """One implementation reads both backends: each reader gives the same outcome (the same
    exception types, the same messages naming the same file) on local disk and memory://."""
    url = f"memory://dcp-{uuid.uuid4().hex[:8]}/ckpt"
    local = _damaged(tmp_path / "ckpt", DAMAGE[damage])
    try:
        remote = _damaged(url, DAMAGE[damage])
    finally:
        open_store(url.rpartition("/")[0]).remove_prefix("")
    assert local == remote
    if damage not in ("no index",):  # every other damage is refused by every reader
        assert "ShardedCheckpointError" in local["load_full_state_dict"], local
        assert local["dcp.load"].startswith(("ShardedCheckpointError", "AssertionError")), local
    assert "<rank>" in local["verify"] or "index" in local["verify"], local


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_under_a_callers_commit_the_index_is_an_ordinary_file_and_nothing_is_swept(
    backend, tmp_path
):
    """``commit=False`` (the checkpointer's mode): the ranks write into the caller's staging
    prefix, the index is written there whatever is there already, nothing is removed, and
    ``files`` describes every file written (the index too) as the store lists it."""
    root = tmp_path if backend == "local" else f"memory://dcp-{uuid.uuid4().hex[:8]}"
    store = open_store(root)
    staging = store.staging("ckpt.3")
    where = store.url_of(staging)
    dcp.save({"w": torch.ones(8)}, storage_writer=BurnpackStorageWriter(where, commit=False))
    first = set(open_store(where).list(""))
    writer = BurnpackStorageWriter(where, commit=False)
    dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=writer)  # not refused, not swept
    listing = open_store(where).list("")
    assert first < set(listing) and len(listing) == 3, listing
    assert {name: info["size"] for name, info in writer.files.items()} == {
        name: size for name, size in listing.items() if name not in first - {"sharded.index.bpk"}
    }
    store.publish(staging, "ckpt.3")  # the caller's commit
    assert torch.equal(load_full_state_dict(store.url_of("ckpt.3"))["w"], torch.full((8,), 2.0))
    if backend == "memory":
        store.remove_prefix("")
