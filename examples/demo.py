"""Interim demo: save a tiny model's state as a burnpack and show what ``inspect`` sees.

Run with ``make demo`` (or ``.venv/bin/python examples/demo.py``). It writes
``./demo-run/model.bpk`` (atomic, with per-tensor checksums), reads it back zero-copy to check
every tensor, and prints the ``lightning-bpk inspect`` report. The Lightning demo replaces it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_bpk import burnpack, cli

OUT_DIR = Path("demo-run")


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    state = model.state_dict()
    OUT_DIR.mkdir(exist_ok=True)
    path = burnpack.write(
        OUT_DIR / "model",
        state,
        scalars={"epoch": 3, "global_step": 1200, "lr": 0.001, "converged": False},
        metadata={"producer": "lightning-bpk demo", "model": "Sequential(4-8-2)"},
    )
    with burnpack.read(path) as pack:
        for name, tensor in state.items():
            assert torch.equal(pack.tensor(name), tensor), name
    print(f"wrote {path} ({path.stat().st_size} bytes); all {len(state)} tensors read back equal\n")
    return cli.main(["inspect", str(path)])


if __name__ == "__main__":
    raise SystemExit(main())
