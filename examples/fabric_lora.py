"""Fine-tune the pretrained tiny model with LoRA adapters in a Fabric loop that resumes exactly.

litgpt's ``finetune/lora.py`` saves only the adapter weights, without their optimizer state,
and cannot resume. Here the frozen base loads from the pretraining's ``.bpk`` or
``.safetensors`` file (``load_raw``, no pickle), and every checkpoint holds only what trains
(the ``trainable`` filter: the ``lora_A``/``lora_B`` tensors), their AdamW moments, the data
position and the RNG states, so a killed run continues bit for bit from its newest complete
checkpoint::

    python examples/fabric_pretrain.py --out_dir out/pretrain
    python examples/fabric_lora.py --base out/pretrain/final/model.safetensors --out_dir out/lora
    python examples/fabric_lora.py --base out/pretrain/final/model.safetensors --out_dir out/lora

The second run continues from the first's newest checkpoint (or finds it finished).
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

import lightning as L
import torch
from fabric_pretrain import Config, SyntheticTokens, make_model, train  # the sibling example
from torch import nn
from torch.utils.data import DataLoader

from lightning_bpk.fabric import (
    CheckpointManager,
    ResumableLoader,
    load_raw,
    trainable,
    trainable_parameters,
)


class LoRALinear(nn.Linear):
    """A ``Linear`` (its ``weight``/``bias`` keep their names, so the base file loads into it)
    plus a trainable low-rank update ``lora_B @ lora_A``, scaled by ``alpha / r``."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (x @ self.lora_A.T) @ self.lora_B.T
        return super().forward(x) + update * self.scaling


def add_lora(model: nn.Module, r: int) -> nn.Module:
    """Every ``Linear`` of the feed-forward blocks and the output head gets an adapter; only
    the adapters train."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, LoRALinear(child, r=r))
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the pretrained weights (.bpk/.safetensors)")
    parser.add_argument("--out_dir", default="out/lora")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--save_interval", type=int, default=5)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(args.seed)
    config = Config()
    model = add_lora(make_model(config), args.rank)
    load_raw(args.base, model, strict=False)  # the base; the adapters are not in the file
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.learning_rate)
    model, optimizer = fabric.setup(model, optimizer)
    # another task: the same kind of tokens from another seed
    data = DataLoader(SyntheticTokens(config, samples=128, seed=1), batch_size=args.batch_size)
    loader = ResumableLoader(fabric.setup_dataloaders(data))
    manager = CheckpointManager(fabric, Path(args.out_dir), every_n_train_steps=args.save_interval)
    state = {"model": model, "optimizer": optimizer, "train_dataloader": loader}
    state.update(iter_num=0, step_count=0)
    restored = manager.restore(state)
    if restored.step is not None:
        fabric.print(f"resumed at step {state['step_count']}")
    train(fabric, state, loader, manager, args.max_steps, filter={"model": trainable(model)})
    manager.close()


if __name__ == "__main__":
    main()
