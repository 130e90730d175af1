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
``remap-bench`` markers of ``docs/interop.md``.

Then, on 2 gloo CPU processes, a full file into an FSDP2 model (``fully_shard`` per layer,
``Shard(0)``): each rank reading the whole file and copying its slices (``load_module_record``,
what a rank does without a shard-aware loader) against
:func:`~lightning_bpk.interop.shards.load_into_shards`, for the bytes each rank reads and the
wall time of the slowest rank; the table replaces the one between the ``shard-bench`` markers::

    .venv/bin/python benchmarks/remap_load.py            # 4 layers x 8 experts, ~200 MiB, 5 rounds
    .venv/bin/python benchmarks/remap_load.py --quick    # 2 layers, 3 rounds
    .venv/bin/python benchmarks/remap_load.py --only-shards   # the shard table alone
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import bounded
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_bpk.interop import (
    Concatenate,
    KeyRemapper,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    apply_remapped,
    convert,
    load_into_shards,
    load_module_record,
    save_module_record,
)
from lightning_bpk.interop.loading import DEFAULT_WORKERS, load_remapped
from lightning_bpk.records import ModuleRecord

transformers.utils.logging.disable_progress_bar()
REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "interop.md"
BEGIN, END = "<!-- remap-bench:begin -->", "<!-- remap-bench:end -->"
SHARD_BEGIN, SHARD_END = "<!-- shard-bench:begin -->", "<!-- shard-bench:end -->"
RANKS = 2
SHARD_TIMEOUT = 900  # seconds for every round of the sharded loads: far longer is a hang
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
    parser.add_argument("--only-shards", action="store_true", help="only the sharded loads")
    parser.add_argument("--shard-rank", nargs=5, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard_rank:  # one rank of the sharded loads (started by shards)
        rank, port, layers, width, reps = args.shard_rank
        _shard_worker(rank, port, args.root, layers, width, reps)
        return
    reps = args.reps or (3 if args.quick else 5)
    if not args.only_shards:
        remapped(args, reps)
    shards(args, reps)


def _write_doc(begin: str, end: str, table: str) -> None:
    text = DOC.read_text()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(f"{head}{begin}\n{table}{end}{tail}")


def remapped(args: argparse.Namespace, reps: int) -> None:
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
        _write_doc(BEGIN, END, table)


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


# --- a full file into FSDP2 shards, on RANKS processes ------------------------------------------


def _mlp(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _full_then_slice(path: Path, net: nn.Module) -> int:
    """Without a shard-aware loader: read the whole file (mapped, every checksum hashed), then
    copy this rank's slice of each tensor. Returns the tensor bytes read."""
    record = load_module_record(path)
    with torch.no_grad():
        for name, param in net.state_dict().items():
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            param.to_local().copy_(record.tensors[name][box])
    return sum(t.nbytes for t in record.tensors.values())


def _shard_worker(rank: int, port: int, root: str, layers: int, width: int, reps: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=RANKS,
        timeout=timedelta(seconds=300),
    )
    try:
        mesh = init_device_mesh("cpu", (RANKS,))
        net = _mlp(layers, width)
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        torch.manual_seed(0)
        expected = _state(_mlp(layers, width))
        methods: dict[str, Callable[[], int]] = {}
        for suffix in ("safetensors", "bpk"):
            path = Path(root) / f"mlp.{suffix}"
            methods[f"{suffix}: whole file on every rank, then its slices"] = lambda p=path: (
                _full_then_slice(p, net)
            )
            methods[f"{suffix}: `load_into_shards`"] = lambda p=path: (
                load_into_shards(p, net).bytes_read
            )
        methods["bpk: `load_into_shards(verify=True)`"] = lambda: (
            load_into_shards(Path(root) / "mlp.bpk", net, verify=True).bytes_read
        )
        results: dict[str, dict[str, list[float]]] = {m: {"s": [], "bytes": []} for m in methods}
        for rnd in range(reps + 1):
            order = list(methods)
            if rnd:
                random.Random(rnd).shuffle(order)
            for label in order:
                bounded.row(f"{label}, round {rnd}")
                with torch.no_grad():
                    for t in net.state_dict().values():
                        t.to_local().zero_()
                dist.barrier()
                start = time.perf_counter()
                nbytes = methods[label]()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                if not rnd:
                    for name, param in net.state_dict().items():
                        full = param.full_tensor()
                        if not torch.equal(full, expected[name]):
                            raise AssertionError(f"{label} loaded wrong weights: {name}")
                else:
                    results[label]["s"].append(elapsed.item())
                    results[label]["bytes"].append(nbytes)
        if rank == 0:
            Path(root, "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def shards(args: argparse.Namespace, reps: int) -> None:
    layers, width = (4, 1024) if args.quick else (8, 2048)
    torch.manual_seed(0)
    record = ModuleRecord(_state(_mlp(layers, width)))
    nbytes = sum(t.nbytes for t in record.tensors.values())
    with tempfile.TemporaryDirectory(prefix="lightning-bpk-shard-bench-") as tmp:
        for suffix in ("safetensors", "bpk"):
            save_module_record(record, Path(tmp) / f"mlp.{suffix}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [
            [__file__, "--shard-rank", *map(str, (r, port, layers, width, reps)), "--root", tmp]
            for r in range(RANKS)
        ]  # fresh interpreters: the parent's torch thread pool does not survive a fork
        bounded.run_group(ranks, what="sharded loads (load_into_shards)", timeout=SHARD_TIMEOUT)
        results = json.loads(Path(tmp, "results.json").read_text())
    lines = [
        f"{layers} x `Linear({width}, {width})` under FSDP2 (`Shard(0)`) on {RANKS} gloo CPU "
        f"processes: {nbytes / 2**20:.0f} MiB of float32 in one file, page cache warm. "
        f"{os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; median of {reps} rounds "
        "(min-max) of the slowest rank's time. Read: tensor bytes each rank reads.",
        "",
        "| method | read per rank | time | vs whole file |",
        "|---|---|---|---|",
    ]
    bases = {}
    for label, r in results.items():
        med = statistics.median(r["s"])
        kind = label.split(":")[0]
        bases.setdefault(kind, med)
        lines.append(
            f"| {label} | {statistics.median(r['bytes']) / 2**20:.1f} MiB "
            f"| {med * 1000:.0f} ms ({min(r['s']) * 1000:.0f}-{max(r['s']) * 1000:.0f}) "
            f"| {bases[kind] / med:.2f}x |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_doc:
        _write_doc(SHARD_BEGIN, SHARD_END, table)


if __name__ == "__main__":
    main()
