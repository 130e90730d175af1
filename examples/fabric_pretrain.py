"""Pretrain a tiny language model with a hand-written Lightning Fabric loop, litgpt-style,
checkpointed by ``lightning_bpk.fabric.CheckpointManager``.

The loop is litgpt's ``pretrain.py`` in small: a state dict of model, optimizer, data loader,
``iter_num`` and ``step_count``; a save every ``--save_interval`` optimizer steps into
``--out_dir`` numbered by step, with the model's config and the run's hyper-parameters written
beside the checkpoints; a final consolidated model in ``out_dir/final/``. What litgpt leaves to
luck is done here: a sentinel commits each checkpoint, so a run killed during a save is
restored from the previous one (litgpt picks the highest-numbered ``step-*`` file); the data
loader's position and the RNG states are saved, so a resumed run continues with the next batch
exactly; old checkpoints are collected (Dopamine retention); SIGTERM saves and exits 0.

The model is Lightning's demo ``Transformer`` (litgpt 0.5.13 pins ``huggingface-hub<1.4``,
which this project's ``transformers`` does not install beside) with a tiny config, trained on
synthetic tokens (a noisy affine sequence over a small vocabulary: no download)::

    python examples/fabric_pretrain.py --out_dir out/pretrain
    python examples/fabric_pretrain.py --out_dir out/pretrain --max_steps 60   # continues

    out/pretrain/
    ├── model_config.yaml, hyperparameters.yaml
    ├── step.20/ ... step.40/          checkpoints (data), each committed by its sentinel
    ├── sentinel_checkpoint_complete.40
    └── final/lit_model.bpk, model.safetensors, model_config.yaml

Run it again with the same ``--out_dir`` and it continues from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_bpk.fabric import CheckpointManager, ResumableLoader


@dataclasses.dataclass
class Config:
    """The model's config (litgpt keeps its ``Config`` in ``model_config.yaml``)."""

    vocab_size: int = 64
    ninp: int = 32
    nhead: int = 2
    nhid: int = 64
    nlayers: int = 1
    dropout: float = 0.1
    block_size: int = 16


class SyntheticTokens(Dataset):
    """``samples`` token sequences of ``block_size + 1``: ``t[i+1] = (5 t[i] + 3) % vocab``,
    one token in eight replaced by noise; the same for a given seed."""

    def __init__(self, config: Config, samples: int = 512, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(config.vocab_size, (samples, 1), generator=g)
        steps = [start]
        for _ in range(config.block_size):
            steps.append((5 * steps[-1] + 3) % config.vocab_size)
        tokens = torch.cat(steps, dim=1)
        noise = torch.rand(tokens.shape, generator=g) < 0.125
        self.tokens = torch.where(noise, torch.randint_like(tokens, config.vocab_size), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def make_model(config: Config) -> nn.Module:
    fields = ("vocab_size", "ninp", "nhead", "nhid", "nlayers", "dropout")
    return Transformer(**{k: getattr(config, k) for k in fields})


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    output = model(inputs, target)
    return nn.functional.nll_loss(output.reshape(-1, output.size(-1)), target.reshape(-1))


def train(
    fabric: L.Fabric,
    state: dict[str, Any],
    loader: ResumableLoader,
    manager: CheckpointManager,
    max_steps: int,
    **save: Any,
) -> None:
    """litgpt's loop in small: ``iter_num`` counts batches, ``step_count`` optimizer steps;
    ``save`` goes to every save (an adapter fine-tune's ``filter``)."""
    model, optimizer = state["model"], state["optimizer"]
    while state["step_count"] < max_steps:
        for tokens in loader:
            loss = loss_of(model, tokens)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["iter_num"] += 1
            state["step_count"] += 1
            fabric.print(f"step {state['step_count']} loss {loss.item():.4f}", flush=True)
            manager.save_if_due(state["step_count"], state, **save)
            if state["step_count"] >= max_steps:
                break
    if manager.last_saved_step != state["step_count"]:
        manager.save(state["step_count"], state, **save)
    manager.wait()


def write_yaml(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="out/pretrain")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--save_interval", type=int, default=10)
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out_dir, config = Path(args.out_dir), Config()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="auto")
    fabric.launch()
    fabric.seed_everything(args.seed)
    if fabric.global_rank == 0:  # litgpt's save_config and save_hyperparameters
        write_yaml(out_dir / "model_config.yaml", dataclasses.asdict(config))
        write_yaml(out_dir / "hyperparameters.yaml", vars(args))
    model = make_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    data = DataLoader(SyntheticTokens(config), batch_size=args.batch_size, shuffle=True)
    loader = ResumableLoader(fabric.setup_dataloaders(data))
    manager = CheckpointManager(
        fabric,
        out_dir,
        checkpoint_file_prefix="step",
        every_n_train_steps=args.save_interval,
        checkpoint_duration=args.keep,
        async_save=True,
    )
    state = {"model": model, "optimizer": optimizer, "train_dataloader": loader}
    state.update(iter_num=0, step_count=0)
    restored = manager.restore(state)
    if restored.step is not None:
        fabric.print(f"resumed at step {state['step_count']}")
    train(fabric, state, loader, manager, args.max_steps)
    if fabric.global_rank == 0:
        final = out_dir / "final"
        final.mkdir(parents=True, exist_ok=True)
        manager.export(final / "lit_model.bpk", key="model")
        manager.export(final / "model.safetensors", key="model")
        write_yaml(final / "model_config.yaml", dataclasses.asdict(config))
        fabric.print(f"final model in {final}")
    manager.close()


if __name__ == "__main__":
    main()
