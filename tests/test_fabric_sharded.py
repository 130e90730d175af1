"""A Fabric loop on FSDP2 through ``ModelParallelStrategy`` (2 gloo CPU ranks,
tests/scripts/fabric_loop.py), which refuses every CheckpointIO plugin: the manager writes every
rank's shards with the burnpack DCP writer and commits them with one sentinel. SIGKILLed
mid-epoch and rerun, it ends ``torch.equal`` to an uninterrupted run; its last checkpoint
restores into one plain process (2 -> 1 reshard), whose data continues the saved epoch in
samples; and it exports one Burn-readable file."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_bpk import burnpack
from lightning_bpk.fabric import CheckpointManager, ResumableLoader

from fabric_loop import BATCH_SIZE, SAMPLES, Samples, full_state, make_model
from test_fabric_e2e import STEPS, assert_equal_states, complete, lines, loop, succeeded

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:The `srun` command")]

FSDP = ["--strategy", "fsdp", "--devices", 2]


def test_fsdp2_killed_mid_epoch_resumes_exactly_and_reshards_to_one_process(tmp_path):
    succeeded(loop(tmp_path / "ref", tmp_path / "ref.ids", *FSDP, out=tmp_path / "ref.bpk"))
    killed = loop(tmp_path / "run", tmp_path / "a.ids", *FSDP, "--kill-at-step", 10)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert complete(tmp_path / "run") == [4, 8]
    shards = sorted(p.name for p in (tmp_path / "run" / "ckpt.8").iterdir())
    assert shards[0] == "sharded.index.bpk" and len(shards) == 4  # + 2 rank files, trainer
    resumed = succeeded(loop(tmp_path / "run", tmp_path / "b.ids", *FSDP, out=tmp_path / "run.bpk"))
    assert "RESTORED 8 rank=0" in resumed.stdout and "RESTORED 8 rank=1" in resumed.stdout
    assert_equal_states(tmp_path / "ref.bpk", tmp_path / "run.bpk")
    for rank in (0, 1):
        assert lines(tmp_path / "b.ids", rank) == lines(tmp_path / "ref.ids", rank)[8:]

    # 2 -> 1: the last checkpoint (step 20: 2 batches into epoch 3) into one plain process
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = ResumableLoader(DataLoader(Samples(), batch_size=BATCH_SIZE, shuffle=True))
    manager = CheckpointManager(fabric, tmp_path / "run")
    state = {"model": model, "optimizer": optimizer, "data": data, "step": 0}
    assert manager.restore(state).step == STEPS == state["step"]
    flat = full_state(fabric, model, optimizer)
    with burnpack.read(tmp_path / "run.bpk") as saved:
        assert sorted(saved.entries) == sorted(flat)
        assert all(torch.equal(saved.tensor(k), v) for k, v in flat.items())
    # the rest of epoch 3 on one rank: every sample the two ranks had not consumed, once
    consumed = [
        int(i)
        for rank in (0, 1)
        for line in lines(tmp_path / "b.ids", rank)[-2:]
        for i in line.split()[1:]
    ]
    rest = [int(i) for ids, _, _ in data for i in ids]
    assert sorted(rest + consumed) == list(range(SAMPLES))
    assert data.epoch == 4  # the next pass is epoch 4, as on two ranks

    manager.export(tmp_path / "model.bpk")
    with burnpack.read(tmp_path / "model.bpk") as pack:
        assert sorted(pack.entries) == sorted(model.state_dict())
        assert all(torch.equal(pack.tensor(k), v) for k, v in model.state_dict().items())
