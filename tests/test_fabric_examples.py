"""The litgpt-style Fabric examples run as a user runs them (real subprocesses, real training):
``examples/fabric_pretrain.py`` keeps litgpt's layout (checkpoints numbered by step, the model
config and hyper-parameters beside them, a consolidated ``final/``), and
``examples/fabric_lora.py`` fine-tunes adapters on the exported base and resumes, saving only
the adapters. (Bit-exact resume after a SIGKILL: test_fabric_e2e.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lightning_bpk import burnpack
from lightning_bpk.checkpointer import Checkpointer, list_checkpoints

from conftest import EXAMPLES, run_process

TIMEOUT_S = 240  # each run takes 5-20 s on 2 loaded cores; this only stops a hung one


def example(script: str, *args: object, cwd: Path) -> str:
    result = run_process([sys.executable, EXAMPLES / script, *args], cwd=cwd, timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{output[-4000:]}"
    return result.stdout


def test_pretrain_then_an_adapter_fine_tune_that_resumes(tmp_path):
    example(
        "fabric_pretrain.py",
        "--out_dir",
        "pre",
        "--max_steps",
        12,
        "--save_interval",
        4,
        cwd=tmp_path,
    )
    pre = tmp_path / "pre"
    assert yaml.safe_load((pre / "model_config.yaml").read_text())["vocab_size"] == 64
    assert yaml.safe_load((pre / "hyperparameters.yaml").read_text())["save_interval"] == 4
    assert [
        e.number for e in list_checkpoints(pre, checkpoint_file_prefix="step") if e.complete
    ] == [12, 8, 4]
    assert sorted(p.name for p in (pre / "step.12").iterdir()) == [
        "model.bpk",
        "optimizer.bpk",
        "trainer.bpk",
    ]
    with burnpack.read(pre / "final" / "lit_model.bpk") as pack:  # what Burn reads
        assert "decoder.weight" in pack.entries
    base = pre / "final" / "model.safetensors"
    lora = ["--base", base, "--out_dir", "lora", "--save_interval", 4]
    example("fabric_lora.py", *lora, "--max_steps", 8, cwd=tmp_path)
    out = example("fabric_lora.py", *lora, "--max_steps", 12, cwd=tmp_path)
    assert "resumed at step 8" in out and "step 9 loss" in out and "step 8 loss" not in out
    saved = Checkpointer(tmp_path / "lora").load_checkpoint(12)
    names = sorted(saved["model"].tensors)
    assert names and all(".lora_" in name for name in names)
    assert sorted(saved["optimizer"].paths.values()) == names
    assert saved["trainer"]["values"]["step_count"] == 12
