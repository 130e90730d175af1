"""Coverage-guided fuzz target for the burnpack reader (atheris; run by hand, not by pytest).

Every input must either parse (and then materialize every tensor) or raise a ``BurnpackError``
subclass; anything else (KeyError, RecursionError, MemoryError, struct.error, a hang) is a bug.

    .venv/bin/pip install -c constraints.txt atheris
    .venv/bin/python tests/fuzz/fuzz_burnpack.py -atheris_runs=200000 -max_len=4096 [CORPUS_DIR]

Seeds (valid packs) are added to CORPUS_DIR when it is empty, so mutations start from real files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared oracle

with atheris.instrument_imports():
    import torch

    from lightning_bpk import burnpack

    from _burnpack_helpers import parse_fully


def seeds() -> list[bytes]:
    return [
        burnpack.dumps({}),
        burnpack.dumps(
            {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([True, False])},
            metadata={"k": "v"},
            scalars={"step": 3, "lr": 0.001, "flag": True, "big": 2**63},
        ),
        burnpack.dumps({"h": torch.ones(3, dtype=torch.float16)}, checksums=False),
    ]


def main() -> None:
    corpus = next((Path(a) for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus is not None:
        corpus.mkdir(parents=True, exist_ok=True)
        if not any(corpus.iterdir()):
            for i, seed in enumerate(seeds()):
                (corpus / f"seed-{i}.bpk").write_bytes(seed)
    atheris.Setup(sys.argv, parse_fully)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
