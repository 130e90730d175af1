"""``make bench``, remapped loading: a Mixtral checkpoint (per-expert tensors) into transformers'
Mixtral model (fused experts), through the Mixtral mapping of ``lightning_bpk.interop``.

Side by side on the same files, the page cache warm:

- today's sequential path, ``apply_remapped(load_module_record(path), model, remapper)``;
- :func:`~lightning_bpk.interop.loading.load_remapped` with ``workers=1`` and on the pool;
- transformers' own ``MixtralForCausalLM.from_pretrained`` of the same safetensors file, with its
  thread pool (the default) and without (``HF_DEACTIVATE_ASYNC_LOAD=1``). It builds the model
  skeleton on the meta device as part of the call; ours load into an existing model (resuming).

Every method runs once as a warm-up that checks the loaded weights, then ``--reps`` shuffled
rounds; the table gives the median and the range. The table replaces the one between the
``remap-bench`` markers of ``docs/interop.md``::

    .venv/bin/python benchmarks/remap_load.py            # 4 layers x 8 experts, ~200 MiB, 5 rounds
    .venv/bin/python benchmarks/remap_load.py --quick    # 2 layers, 3 rounds
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

from lightning_bpk.interop import (
    Concatenate,
    KeyRemapper,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    apply_remapped,
    convert,
    load_module_record,
)
from lightning_bpk.interop.loading import DEFAULT_WORKERS, load_remapped

transformers.utils.logging.disable_progress_bar()
REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "interop.md"
BEGIN, END = "<!-- remap-bench:begin -->", "<!-- remap-bench:end -->"
MIXTRAL = KeyRemapper(
    [
        WeightRenaming(".block_sparse_moe.", ".mlp."),
        WeightConverter(
            [".experts.*.w1.weight", ".experts.*.w3.weight"],
            ".experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter([".experts.*.w2.weight"], ".experts.down_proj", [MergeModulelist(dim=0)]),
    ]
)


def config(layers: int) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 rounds")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-doc", action="store_true", help="print only, leave the docs alone")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    cfg = config(2 if args.quick else 4)
    torch.manual_seed(0)
    source = transformers.MixtralForCausalLM(cfg)
    expected = _state(source)
    nbytes = sum(t.nbytes for t in expected.values())
    target = transformers.MixtralForCausalLM(cfg)
    with tempfile.TemporaryDirectory(prefix="lightning-bpk-remap-bench-") as tmp:
        hf_dir = Path(tmp) / "hf"
        source.save_pretrained(hf_dir)
        st = hf_dir / "model.safetensors"
        bpk = convert(st, Path(tmp) / "mixtral.bpk")
        del source

        def ours(path: Path, workers: int | None) -> Callable[[], None]:
            def run() -> None:
                if workers is None:
                    apply_remapped(load_module_record(path), target, MIXTRAL)
                else:
                    load_remapped(path, target, MIXTRAL, workers=workers)

            return run

        def theirs(threads: bool) -> Callable[[], dict]:
            def run() -> dict:
                if threads:
                    os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
                else:
                    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
                try:
                    return _state(transformers.MixtralForCausalLM.from_pretrained(hf_dir))
                finally:
                    os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)

            return run

        n = DEFAULT_WORKERS
        methods: dict[str, Callable[[], dict | None]] = {
            "safetensors: `apply_remapped(load_module_record(...))` (sequential, before)": ours(
                st, None
            ),
            "safetensors: `load_remapped(workers=1)`": ours(st, 1),
            f"safetensors: `load_remapped(workers={n})`": ours(st, n),
            ".bpk: `apply_remapped(load_module_record(...))` (sequential, before)": ours(bpk, None),
            ".bpk: `load_remapped(workers=1)`": ours(bpk, 1),
            f".bpk: `load_remapped(workers={n})`": ours(bpk, n),
            "transformers `from_pretrained` (its thread pool)": theirs(True),
            "transformers `from_pretrained` (`HF_DEACTIVATE_ASYNC_LOAD=1`)": theirs(False),
        }
        times: dict[str, list[float]] = {label: [] for label in methods}
        cpu: dict[str, list[float]] = {label: [] for label in methods}
        for rnd in range(reps + 1):
            order = list(methods)
            if rnd:
                random.Random(rnd).shuffle(order)
            for label in order:
                if not rnd:
                    with torch.no_grad():
                        for t in target.state_dict().values():
                            t.zero_()
                start, start_cpu = time.perf_counter(), time.process_time()
                loaded = methods[label]()
                elapsed = time.perf_counter() - start
                used = time.process_time() - start_cpu
                if not rnd:
                    got = loaded if loaded is not None else _state(target)
                    bad = [k for k, t in expected.items() if not torch.equal(got[k], t)]
                    if bad:
                        raise AssertionError(f"{label} loaded wrong weights: {bad[:3]}")
                else:
                    times[label].append(elapsed)
                    cpu[label].append(used)
            print(f"round {rnd}/{reps} done", flush=True)
    table = report(times, cpu, nbytes, cfg, reps)
    print(table)
    if not args.no_doc:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def report(
    times: dict[str, list[float]], cpu: dict[str, list[float]], nbytes: int, cfg, reps: int
) -> str:
    base = statistics.median(times[next(iter(times))])
    lines = [
        f"Mixtral, {cfg.num_hidden_layers} layers x {cfg.num_local_experts} experts "
        f"(hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}): "
        f"{nbytes / 2**20:.0f} MiB of float32, "
        f"{cfg.num_hidden_layers * cfg.num_local_experts * 3} expert tensors fused into "
        f"{cfg.num_hidden_layers * 2}. {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; median of {reps} rounds "
        "(min-max). CPU: the process's CPU time (all threads) for the same load.",
        "",
        "| method | time | MiB/s | vs sequential safetensors | CPU |",
        "|---|---|---|---|---|",
    ]
    for label, ts in times.items():
        med = statistics.median(ts)
        lines.append(
            f"| {label} | {med * 1000:.0f} ms ({min(ts) * 1000:.0f}-{max(ts) * 1000:.0f}) "
            f"| {nbytes / 2**20 / med:.0f} | {base / med:.2f}x "
            f"| {statistics.median(cpu[label]) * 1000:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
