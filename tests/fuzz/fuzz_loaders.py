"""A seeded fuzzer of every public loader (run by hand, not by pytest): hostile bytes through
the burnpack reader, record loading, the safetensors import, a checkpoint's sentinel and records,
a sharded checkpoint's index and ``lightning-bpk verify`` (the targets and the oracle:
``tests/fuzz/loaders.py``), under a memory limit and a per-input time limit.

    .venv/bin/python tests/fuzz/fuzz_loaders.py --inputs 1000000 --jobs 2 \\
        --save tests/fixtures/fuzz

Input ``i`` of seed ``s`` is made by a generator seeded with ``(s, i)`` alone, so any finding is
reproduced by its numbers (``--only-input I``). Each input is one valid seed file of its target
with one to four mutations: bit flips, interesting bytes, truncation, a chunk deleted,
duplicated, inserted or spliced from another seed, and for the JSON inside (a sentinel, a
safetensors header, an index) a field replaced by a hostile value (a huge, negative or
non-finite number, a wrong type, a deep nesting, a long string). One input in twenty instead
flips a single bit of a seed's checksummed tensor data, which the load must refuse.

Findings (an exception outside the package's errors, a hang past ``--timeout``, a missed
corruption) are counted by kind and their inputs written under ``--save``/<target>/ once per
distinct cause; ``tests/test_fuzz_regressions.py`` replays every input kept there. The exit
status is 1 when anything was found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for fuzz.loaders

from fuzz.loaders import TARGETS, Missed, Seed, Untyped, check

# Inputs per target, out of 100 (the cheap parsers get more; a sharded load costs ~10 ms).
WEIGHTS = {
    "burnpack": 30,
    "record": 18,
    "safetensors": 20,
    "sentinel": 10,
    "checkpoint-record": 10,
    "dcp-index": 4,
    "cli-verify": 8,
}
# A value written as 5,000 nested lists (past the standard library's recursion limit), put
# into the JSON text in place of this placeholder after it is serialised.
_DEEP = "__lightning_bpk_fuzz_deep__"
_DEEP_TEXT = "[" * 5000 + "]" * 5000
INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x22, 0x5B, 0x7B, 0x30, 0x2D)
HOSTILE = (
    -1,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    1e308,
    float("inf"),
    float("nan"),
    "",
    "../../etc/passwd",
    "x" * 5000,
    [],
    {},
    None,
    True,
    _DEEP,
    [0, 2**63, 3],
    {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]},
)


class _Hang(BaseException):
    """An input ran past the time limit (a BaseException: the oracle's catch-all lets it by)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _Hang


def _json_span(blob: bytes) -> tuple[int, int] | None:
    """Where JSON sits in ``blob``: all of it, or a safetensors header after its 8-byte size."""
    if blob[:1] == b"{":
        return 0, len(blob)
    if len(blob) > 8:
        size = int.from_bytes(blob[:8], "little")
        if 2 <= size <= len(blob) - 8 and blob[8:9] == b"{":
            return 8, 8 + size
    return None


def _mutate_json(blob: bytes, rng: random.Random) -> bytes | None:
    span = _json_span(blob)
    if span is None:
        return None
    try:
        document = json.loads(blob[span[0] : span[1]])
    except (ValueError, RecursionError):  # not JSON, or a nesting an earlier mutation made
        return None
    paths: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append((node, key))
                walk(value)
        elif isinstance(node, list):
            for index, value in enumerate(node):
                paths.append((node, index))
                walk(value)

    walk(document)
    if not paths:
        return None
    parent, key = rng.choice(paths)
    value = parent[key]  # type: ignore[index]
    # JSON inside a string (this package's info entry in a safetensors header): mutated inside
    nested = isinstance(value, str) and rng.random() < 0.7
    inner = _mutate_json(value.encode(), rng) if nested else None
    parent[key] = rng.choice(HOSTILE) if inner is None else inner.decode(errors="replace")  # type: ignore[index]
    text = json.dumps(document, allow_nan=True).replace(f'"{_DEEP}"', _DEEP_TEXT).encode()
    if span[0] == 8:
        return len(text).to_bytes(8, "little") + text + blob[span[1] :]
    return text + blob[span[1] :]


def _mutate(blob: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    if rng.random() < 0.35:  # a structured mutation, where the input holds JSON
        mutated = _mutate_json(blob, rng)
        if mutated is not None:
            return mutated
    data = bytearray(blob)
    kind = rng.randrange(8)
    if not data:
        return bytes(rng.randbytes(rng.randrange(1, 64)))
    at = rng.randrange(len(data))
    if kind == 0:
        data[at] ^= 1 << rng.randrange(8)
    elif kind == 1:
        data[at] = rng.choice(INTERESTING)
    elif kind == 2:
        del data[at:]
    elif kind == 3:
        del data[at : at + rng.randrange(1, 64)]
    elif kind == 4:
        end = min(len(data), at + rng.randrange(1, 64))
        data[at:at] = data[at:end]
    elif kind == 5:
        data[at:at] = rng.randbytes(rng.randrange(1, 32))
    elif kind == 6:
        other = rng.choice(others)
        cut = rng.randrange(len(other) + 1)
        data = data[:at] + bytearray(other[cut:])
    else:
        for i in range(at, min(len(data), at + 8)):  # a little-endian field: a huge value
            data[i] = 0xFF if rng.random() < 0.8 else 0x7F
    return bytes(data)


def make_input(seed: int, index: int, seeds: dict[str, list[Seed]]) -> tuple[str, bytes, bool]:
    """Input ``index``: its target, its bytes, and whether it is a checksum corruption."""
    rng = random.Random(f"{seed}:{index}")
    target = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    pool = seeds[target]
    chosen = rng.choice(pool)
    if chosen.checked and rng.random() < 0.05:
        start, end = rng.choice(chosen.checked)
        data = bytearray(chosen.data)
        data[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
        return target, bytes(data), True
    blob = chosen.data
    others = [s.data for s in pool]
    for _ in range(rng.randrange(1, 5)):
        blob = _mutate(blob, rng, others)
    return target, blob, False


def _cause(error: BaseException) -> str:
    """A finding's cause, for counting distinct ones: its type and the loader's message with
    the numbers taken out."""
    text = "".join(c if not c.isdigit() else "#" for c in str(error)[:120])
    return f"{type(error).__name__}: {text}"


def _worker(job: tuple[int, range, dict]) -> dict:
    seed, indices, options = job
    limit = options["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _on_alarm)
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-", dir=options["scratch"]))
    seeds = {name: target.seeds(scratch) for name, target in TARGETS.items()}
    counts: Counter[str] = Counter()
    findings: dict[str, tuple[str, int]] = {}
    save = Path(options["save"]) if options["save"] else None
    for index in indices:
        target, blob, corrupted = make_input(seed, index, seeds)
        if options["targets"] and target not in options["targets"]:
            continue
        counts[f"{target}:inputs"] += 1
        kind = None
        signal.setitimer(signal.ITIMER_REAL, options["timeout"])
        try:
            check(target, blob, scratch, corrupted=corrupted)
        except _Hang:
            kind, cause = "hang", f"over {options['timeout']} s"
        except Untyped as e:
            kind, cause = "untyped", _cause(e.__cause__ or e)
        except Missed as e:
            kind, cause = "missed", str(e)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if kind is None:
            continue
        counts[f"{target}:{kind}"] += 1
        key = f"{target} {kind} {cause}"
        if key not in findings:
            findings[key] = (target, index)
            if save is not None:
                folder = save / target / ("corrupted" if corrupted else "hostile")
                folder.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256(blob).hexdigest()[:16]
                (folder / f"{digest}.bin").write_bytes(blob)
    return {"counts": dict(counts), "findings": {k: list(v) for k, v in findings.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--targets", default="", help="comma-separated; default: all")
    parser.add_argument("--memory-mb", type=int, default=6144, help="address space per job")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per input")
    parser.add_argument("--save", default="", help="folder for the inputs of findings")
    parser.add_argument("--only-input", type=int, default=None, help="run just this input")
    parser.add_argument("--scratch", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {sorted(TARGETS)}")
    options = {
        "memory_mb": args.memory_mb,
        "timeout": args.timeout,
        "save": args.save,
        "targets": targets,
        "scratch": args.scratch,
    }
    if args.only_input is not None:
        jobs = [(args.seed, range(args.only_input, args.only_input + 1), options)]
    else:
        jobs = [(args.seed, range(j, args.inputs, args.jobs), options) for j in range(args.jobs)]
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        results = pool.map(_worker, jobs)
    counts: Counter[str] = Counter()
    findings: dict[str, list] = {}
    for result in results:
        counts.update(result["counts"])
        for key, where in result["findings"].items():
            findings.setdefault(key, where)
    summary = {
        "seed": args.seed,
        "inputs": sum(v for k, v in counts.items() if k.endswith(":inputs")),
        "seconds": round(time.monotonic() - started, 1),
        "counts": dict(sorted(counts.items())),
        "distinct_findings": {k: {"target": t, "input": i} for k, (t, i) in findings.items()},
    }
    print(json.dumps(summary, indent=2))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
