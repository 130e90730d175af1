"""``make bench``, a hub checkpoint set: a ~250 MiB Mixtral written by ``save_pretrained`` as a
sharded ``model.safetensors.index.json`` set (per-expert tensors, the hub's layout), loaded

- by this package into a constructed model: ``load_remapped(directory, model,
  rules_for(model))`` (the rules from transformers' registry, the experts fused across shards);
- by transformers: ``MixtralForCausalLM.from_pretrained(directory)`` (which also builds the
  model, on the meta device, as part of the call).

Each method runs once as a warm-up that checks every tensor against the other's, then
``--reps`` interleaved rounds (the order shuffled per round), the page cache warm; the table
gives the median and the range and replaces the one between the ``hub-bench`` markers of
``docs/interop.md``. The target is at least 1.5x faster than ``from_pretrained``::

    .venv/bin/python benchmarks/hub_load.py            # 5 layers x 8 experts, 253 MiB, 5 rounds
    .venv/bin/python benchmarks/hub_load.py --quick    # 2 layers, 3 rounds
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from remap_load import config  # the same Mixtral shape as the remapped-load rows

from lightning_bpk.interop import load_remapped, rules_for

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "interop.md"
BEGIN, END = "<!-- hub-bench:begin -->", "<!-- hub-bench:end -->"
TARGET = 1.5


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-doc", action="store_true", help="print the table only")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    cfg = config(2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as tmp:
        directory = Path(tmp) / "mixtral"
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(cfg).save_pretrained(directory, max_shard_size="50MB")
        shards = sorted(directory.glob("*.safetensors"))
        nbytes = sum(p.stat().st_size for p in shards)
        model = transformers.MixtralForCausalLM(cfg)  # constructed once, as when resuming
        rules = rules_for(model)

        def ours() -> None:
            load_remapped(directory, model, rules)

        def theirs() -> None:
            transformers.MixtralForCausalLM.from_pretrained(directory)

        ours()
        reference = transformers.MixtralForCausalLM.from_pretrained(directory).state_dict()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, reference[name]), name
        del reference
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        methods = {"ours": ours, "theirs": theirs}
        for _ in range(reps):
            order = list(methods)
            random.shuffle(order)
            for name in order:
                times[name].append(_timed(methods[name]))
    table = _table(times, nbytes, len(shards), cfg, reps)
    print(table)
    if not args.no_doc:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])


def _table(
    times: dict[str, list[float]],
    nbytes: int,
    shards: int,
    cfg: transformers.MixtralConfig,
    reps: int,
) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = med["theirs"] / med["ours"]
    mib = nbytes / 2**20
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = [
        f"Mixtral, {cfg.num_hidden_layers} layers x {cfg.num_local_experts} experts (hidden "
        f"{cfg.hidden_size}, intermediate {cfg.intermediate_size}): {mib:.0f} MiB of float32 in "
        f'{shards} shards written by `save_pretrained(max_shard_size="50MB")`; '
        f"{os.cpu_count()} cores, load average {load} at the end; median of {reps} interleaved "
        "rounds (min-max).",
        "",
        "| method | time | MiB/s | vs `from_pretrained` |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("ours", "`load_remapped(directory, model, rules_for(model))` into a constructed model"),
        ("theirs", "transformers `MixtralForCausalLM.from_pretrained(directory)`"),
    ):
        lo, hi = min(times[key]), max(times[key])
        rows.append(
            f"| {label} | {med[key] * 1000:.0f} ms ({lo * 1000:.0f}-{hi * 1000:.0f}) | "
            f"{mib / med[key]:.0f} | {med['theirs'] / med[key]:.2f}x |"
        )
    verdict = "met" if speedup >= TARGET else "NOT met"
    rows += [
        "",
        f"Target: at least {TARGET}x faster than `from_pretrained`: {verdict} ({speedup:.2f}x).",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
