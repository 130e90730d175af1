"""Train a small model on one GPU with asynchronous checkpoints; optionally SIGKILL itself.

``gpu_resume.py BASE OUT --steps N [--every E] [--kill-at K] [--device D]``: resumes from the latest
checkpoint in ``BASE`` if there is one (model, Adam state and the RNG states, CUDA's included:
the data and the dropout masks are drawn on the GPU), trains to step ``N`` saving every ``E``
steps with :class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`, and writes the
final parameters to ``OUT``. With ``--kill-at K`` it sends itself SIGKILL at step ``K`` instead,
with a save possibly still in flight: no ``finally``, no atexit. ``tests/test_gpu.py`` checks
that a killed and resumed run ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch

from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.runtime import rng
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--device", default="cuda:0")  # cpu: the same run where no GPU is
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(256, 64)
    ).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    checkpointer = Checkpointer(args.base, checkpoint_frequency=args.every)
    start = 0
    latest = checkpointer.latest_checkpoint_number()
    if latest >= 0:
        loaded = checkpointer.load_checkpoint(latest)
        assert loaded is not None
        loaded["model"].apply(net)  # host -> device through the pinned bounce buffers
        loaded["optim"].apply(optimizer, net)
        rng.restore_rng(loaded["trainer"]["rng"])
        start = latest + 1
    with AsyncCheckpointSaver() as saver:
        for step in range(start, args.steps):
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randn(32, 64, device=device)
            loss = (net(x) - x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.every == 0:
                saver.save_checkpoint(
                    checkpointer,
                    step,
                    {
                        "model": ModuleRecord.from_module(net),
                        "optim": OptimizerRecord.from_optimizer(optimizer, net),
                        "trainer": {"rng": rng.capture_rng()},
                    },
                )
    torch.save({k: v.cpu() for k, v in net.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
