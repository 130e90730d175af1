"""The ``lightning-bpk`` command line (also ``python -m lightning_bpk``).

Each subcommand is one ``cmd_<name>(args) -> int`` handler registered in ``_add_commands``,
in a private module by concern (``_records``: ``inspect``, ``convert``; ``_checkpoints``: ``ls``,
``verify``; ``_diff``; ``_sharded`` for DCP directories; ``_output`` and ``_locations`` shared),
so a command can be added beside the others without touching them. A bad file is reported on
stderr with its path and exit status :data:`EXIT_BAD_FILE`.

Commands: ``inspect FILE``, ``ls DIR`` (checkpoints; a run directory stands for its
``checkpoints/``), ``verify FILE|DIR``, ``convert SRC DST`` (``.bpk``, ``.safetensors``;
``.pt``/``.ckpt`` as source only), ``diff A B`` (files, or two checkpoint directories). Each
also takes a checkpoint set (``model.safetensors.index.json`` or ``model.bpk.index.json`` with
its shards, or their directory; see :mod:`lightning_bpk.interop.sets`): ``inspect`` shows its
shards and tensors, ``ls`` its shards, ``verify`` checks index, headers and checksums,
``convert`` reads it whole (``--max-shard-size`` writes a set), ``diff`` compares it as one
file. Every
command takes ``--json``. Exit status: 0 ok, 1 differences or damage found (:data:`EXIT_FOUND`),
2 usage error or unreadable input (:data:`EXIT_BAD_FILE`). Long work shows progress on stderr
when it is a terminal. Text output escapes control characters (a tensor name or metadata value
cannot drive the terminal); ``--json`` escapes them as JSON does.

Example::

    $ lightning-bpk inspect model.bpk
    $ lightning-bpk inspect model.bpk --json | jq .tensors
    $ lightning-bpk ls runs/exp1
    $ lightning-bpk convert runs/exp1/ckpt.9/model.bpk model.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from lightning_bpk import burnpack, checkpointer
from lightning_bpk.cli._checkpoints import cmd_ls, cmd_verify
from lightning_bpk.cli._diff import cmd_diff
from lightning_bpk.cli._output import EXIT_BAD_FILE, EXIT_FOUND, EXIT_OK, printable
from lightning_bpk.cli._records import cmd_convert, cmd_inspect
from lightning_bpk.dcp import ShardedCheckpointError
from lightning_bpk.layout import DEFAULT_IDENTIFIER, DEFAULT_PREFIX
from lightning_bpk.lightning.trainer_state import REQUIRED_KEYS
from lightning_bpk.records.base import RecordError

__all__ = [
    "EXIT_BAD_FILE",
    "EXIT_FOUND",
    "EXIT_OK",
    "main",
]


def _build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subparser sets ``func`` to its ``cmd_*`` handler."""
    parser = argparse.ArgumentParser(
        prog="lightning-bpk", description="Inspect Burn burnpack (.bpk) files."
    )
    _add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad file or usage).

    >>> main(["inspect", "/nonexistent.bpk"])
    2
    """
    args = _build_parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpointer.CheckpointWarning)
        try:
            return args.func(args)
        except BrokenPipeError:  # `| head` closed stdout early: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        except (burnpack.BurnpackError, RecordError, OSError, ShardedCheckpointError) as e:
            _report(args, "error", str(e))
            return EXIT_BAD_FILE
        finally:
            for w in caught:
                _report(args, "warning", str(w.message))


def _report(args: argparse.Namespace, what: str, message: str) -> None:
    print(printable(f"lightning-bpk {args.command}: {what}: {message}"), file=sys.stderr)


def _add_commands(sub: argparse._SubParsersAction) -> None:
    """Register every command (``inspect``, ``ls``, ``verify``, ``convert``, ``diff``): the one
    place a command is added."""

    def command(
        name: str, func: Callable[[argparse.Namespace], int], summary: str
    ) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=summary)
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
        parser.set_defaults(func=func)
        return parser

    def checkpoint_names(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="checkpoint data prefix")
        parser.add_argument("--identifier", default=DEFAULT_IDENTIFIER, help="sentinel identifier")
        parser.add_argument(
            "--require",
            default=",".join(REQUIRED_KEYS),
            metavar="KEYS",
            help="comma-separated data keys every checkpoint must hold (default: "
            f"{','.join(REQUIRED_KEYS)}, what BurnpackCheckpoint needs to resume; '' for none)",
        )

    inspect = command("inspect", cmd_inspect, "show header, tensors, scalars and metadata")
    inspect.add_argument(
        "file",
        help="a .bpk file ('.bpk' is added if missing), a .safetensors file, a checkpoint set "
        "(model.safetensors.index.json or its directory) or a sharded checkpoint directory",
    )
    ls = command("ls", cmd_ls, "list checkpoints: number, complete, verified, size, time")
    ls.add_argument(
        "dir", help="a checkpointer base directory, a run directory, or a checkpoint set (shards)"
    )
    ls.add_argument("--no-verify", action="store_true", help="skip reading every byte")
    checkpoint_names(ls)
    verify = command("verify", cmd_verify, "check structure and checksums (exit 1 on damage)")
    verify.add_argument(
        "target",
        help="a .bpk/.safetensors file, a checkpoint set, a checkpoint base directory or a "
        "directory of .bpk files",
    )
    checkpoint_names(verify)
    convert = command("convert", cmd_convert, "convert between .bpk, .safetensors, .pt/.ckpt")
    convert.add_argument(
        "src",
        help=".bpk, .safetensors, .pt/.pth/.bin, .ckpt, a checkpoint set (an index or its "
        "directory) or a checkpoint directory (its model)",
    )
    convert.add_argument("dst", help=".bpk or .safetensors; with --max-shard-size a new directory")
    convert.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="write a sharded set with its index, shards of at most SIZE (5GB, 500MB, bytes)",
    )
    convert.add_argument(
        "--shard-format", choices=("safetensors", "bpk"), default="safetensors", help="shard format"
    )
    diff = command(
        "diff",
        cmd_diff,
        "compare tensors (names, shapes, dtypes, values), scalars and metadata (exit 1)",
    )
    diff.add_argument(
        "a", help="a file, a checkpoint set, or a checkpoint directory (all its .bpk files)"
    )
    diff.add_argument("b", help="a file, or a checkpoint directory")
    diff.add_argument("--atol", type=float, help="value differences up to this count as equal")
    diff.add_argument("--all", action="store_true", help="list identical entries too")
    diff.add_argument(
        "--ignore-metadata",
        action="store_true",
        help="metadata differences are shown but exit 0 (tensors and scalars decide)",
    )
