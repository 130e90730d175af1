"""The command line on sharded (DCP) checkpoints: describe, verify and convert them.

Importing :mod:`lightning_bpk.dcp` (torch.distributed.checkpoint) takes seconds, so this module
imports it inside each function: only a command given a sharded directory pays for it, and
``lightning-bpk --help`` starts fast. A command
first tells a sharded directory apart with :func:`lightning_bpk.dcp.is_sharded`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_bpk.cli._output import dtype_text, table
from lightning_bpk.dcp import ShardedCheckpointError, is_sharded


def describe_sharded(target: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``inspect`` shows for a sharded checkpoint directory (local or a URL prefix): its
    global tensors and files, read from its index."""
    from lightning_bpk import dcp

    index = dcp.read_index(target)
    return {
        "directory": str(index.directory),
        "files": index.files,
        "tensors": [
            {"name": name, "dtype": t["dtype"], "shape": t["shape"], "chunks": t["chunks"]}
            for name, t in index.tensors.items()
        ],
        "objects": sorted(index.objects),
    }


def sharded_text(info: dict[str, Any]) -> str:
    """The human-readable ``inspect`` report of :func:`describe_sharded`'s output."""
    lines = [
        f"sharded checkpoint: {info['directory']}",
        f"files ({len(info['files'])}): " + ", ".join(sorted(info["files"])),
        "",
        f"tensors ({len(info['tensors'])}, full shapes):",
    ]
    rows = [["name", "dtype", "shape", "chunks"]]
    rows += [
        [t["name"], dtype_text(t["dtype"]), str(t["shape"]), str(len(t["chunks"]))]
        for t in info["tensors"]
    ]
    lines += [table(rows), "", f"objects ({len(info['objects'])}):"]
    lines += [f"  {name}" for name in info["objects"]]
    return "\n".join(lines)


def index_problems(data: Path | str) -> list[str]:
    """What is wrong with the index of a sharded checkpoint's data (nothing for another one):
    the manifest's checks cover the index's bytes, this what they say (names, geometry)."""
    if not is_sharded(data):
        return []
    from lightning_bpk import dcp

    try:
        dcp.read_index(data)
    except ShardedCheckpointError as e:
        return [str(e)]
    return []


def verify_sharded(target: Path | str) -> dict[str, Any]:
    """``verify`` of a sharded directory: its index, then every rank file and tensor checksum.
    An index that cannot be read (or is hostile) is damage, reported, not raised."""
    from lightning_bpk import dcp

    try:
        index = dcp.read_index(target)
    except ShardedCheckpointError as e:
        problems, count = [str(e)], 0
    else:
        problems = index.check_files(verify_tensors=True)
        count = sum(len(t["chunks"]) for t in index.tensors.values())
    return {
        "file": str(target),
        "ok": not problems,
        "problems": problems,
        "tensors": count,
        "checksums": count,
    }


def save_model(src: str, dst: Path) -> Path:
    """Assemble the model of the sharded checkpoint data at ``src`` (read in place, with ranged
    reads on an object store) and save it at ``dst`` (``.bpk`` or ``.safetensors``)."""
    from lightning_bpk.dcp import module_record
    from lightning_bpk.interop import save_module_record

    return save_module_record(module_record(src), dst)
