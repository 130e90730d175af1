"""The names a checkpoint directory is made of, defined once.

Dopamine's defaults name data ``ckpt.N`` and sentinels ``sentinel_checkpoint_complete.N``; the
Lightning callback saves one record file per key inside the data directory (``model.bpk``,
``optim.bpk``, ``optim-1.bpk``, ..., ``scheduler.bpk``, ``trainer.bpk``). Every module that
builds or parses one of these names takes it from here. No dependencies: every layer may use it.

>>> sentinel_name(DEFAULT_IDENTIFIER, 7), MODEL_FILE
('sentinel_checkpoint_complete.7', 'model.bpk')
>>> parse_sentinel_name("sentinel_checkpoint_complete.12")
('checkpoint', 12)
>>> parse_sentinel_name("sentinel_checkpoint_complete.012") is None  # one spelling per number
True
>>> data_name("ckpt", 7), parse_data_name("ckpt.7~0123456789abcdef", "ckpt")
('ckpt.7', 7)
>>> member_name_problem("__0_0.bpk") is None, member_name_problem("../../etc/passwd")
(True, "'../../etc/passwd' is not a plain name inside its checkpoint (component '..')")

Names read from a file (a manifest's file list, a sharded index's rank files) are hostile until
checked: :func:`member_name_problem` is the one rule every reader applies before it opens one.
On disk, a checkpoint is made of real files and directories: a symlink inside a checkpoint (or
a ``ckpt.N`` that is one) is refused by every reader, never followed, so what is verified is
what is loaded.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator

__all__ = [
    "DEFAULT_IDENTIFIER",
    "DEFAULT_PREFIX",
    "MODEL_FILE",
    "RECORD_SUFFIX",
    "RUN_SUBDIRECTORY",
    "TRAINER_FILE",
    "data_name",
    "member_name_problem",
    "parse_data_name",
    "parse_sentinel_name",
    "sentinel_name",
]

DEFAULT_PREFIX = "ckpt"
"""Dopamine's default ``checkpoint_file_prefix``: data directories are ``{prefix}.N``."""
DEFAULT_IDENTIFIER = "checkpoint"
"""Dopamine's default ``sentinel_file_identifier``: sentinels are
``sentinel_{identifier}_complete.N``."""
RECORD_SUFFIX = ".bpk"
"""Every record file in a data directory is ``{key}{RECORD_SUFFIX}``."""
MODEL_KEY = "model"
"""Key of the LightningModule's :class:`~lightning_bpk.records.ModuleRecord`."""
OPTIMIZER_KEY = "optim"
"""Key of optimizer 0's record; further optimizers are ``optim-1``, ``optim-2``, ..."""
SCHEDULER_KEY = "scheduler"
"""Key of LR scheduler 0's record; further schedulers are ``scheduler-1``, ..."""
TRAINER_KEY = "trainer"
"""Key of everything else in Lightning's checkpoint dict, plus the RNG states."""
MODEL_FILE = MODEL_KEY + RECORD_SUFFIX
"""``model.bpk``: the weights, what export and conversion read from a checkpoint directory."""
TRAINER_FILE = TRAINER_KEY + RECORD_SUFFIX
"""``trainer.bpk``: loop counters, callback states, hyper-parameters, RNG states."""
NUMBER_PATTERN = r"(0|[1-9][0-9]*)"
"""Regex of an iteration number in a name: one spelling per number (``7``, never ``07``,
``-7`` or ``7_0``), so name and number map one to one."""

VERSION_MARK = "~"
"""A re-saved N's data is ``{prefix}.{N}~<hex>``: a name never used before, so the copy the old
sentinel names stays whole until the new sentinel replaces it (``~`` is in no safe name)."""
RUN_SUBDIRECTORY = "checkpoints"
"""Where the Lightning callback saves inside a run's ``default_root_dir`` (``lightning-bpk ls
RUN`` looks there too)."""

SHARDED_PREFIX = "sharded"
"""The name stem of a sharded (DCP) checkpoint's files: ``sharded.rank-R.ID.bpk`` and the
index (``_sharded_index_name``)."""
SHARDED_INDEX_KEY = f"{SHARDED_PREFIX}.index"
"""The sharded index's data key in a checkpoint (beside :data:`TRAINER_KEY`)."""
PARAM_IDS_KEY = "param_ids"
"""In a sharded checkpoint's state, beside the module under :data:`MODEL_KEY`: its parameter
name -> u64 param id map, so the consolidated ``ModuleRecord`` keeps Burn's param ids."""

_SENTINEL = re.compile(r"sentinel_(.+)_complete\." + NUMBER_PATTERN)
_DATA_VERSION = re.compile(r"[0-9a-f]{8,32}")
# Keys become file names inside the data directory: a conservative portable alphabet, no leading
# dot (hidden files, "." and ".."), no separators, short enough for name + ".bpk" + scratch suffix.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _numbered_key(base: str, index: int) -> str:
    """Key of the ``index``-th optimizer/scheduler record: ``optim``, ``optim-1``, ``optim-2``...

    >>> _numbered_key(OPTIMIZER_KEY, 0), _numbered_key(OPTIMIZER_KEY, 2)
    ('optim', 'optim-2')
    """
    return base if index == 0 else f"{base}-{index}"


def _safe_name(value: object, what: str) -> str:
    """``value`` when it is a safe file name (prefix, identifier, data key), else ``ValueError``
    saying what it is for."""
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        shown = repr(value) if len(repr(value)) <= 160 else repr(value)[:157] + "..."
        raise ValueError(
            f"{what} {shown} is not a safe file name (1-128 characters from "
            "A-Z a-z 0-9 _ . -, not starting with '.' or '-')"
        )
    return value


def _iteration(value: object) -> int:
    """``value`` when it is an iteration number (an int >= 0), else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"iteration number must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"iteration number must be >= 0 (-1 means 'no checkpoint'), got {value}")
    return value


def _numbered(names: Iterable[str], stem: str) -> Iterator[tuple[str, int]]:
    """The names ``stem.N`` (canonical N) among ``names``, with their N."""
    compiled = re.compile(re.escape(stem) + r"\." + NUMBER_PATTERN)
    for name in names:
        match = compiled.fullmatch(name)
        if match:
            yield name, int(match.group(1))


def data_name(prefix: str, number: int) -> str:
    """The plain data name of iteration ``number``: ``{prefix}.{number}``."""
    return f"{prefix}.{number}"


def _fresh_data_name(prefix: str, number: int) -> str:
    """A data name of ``number`` never used before: ``{prefix}.{number}~<16 hex>``."""
    return f"{data_name(prefix, number)}{VERSION_MARK}{secrets.token_hex(8)}"


def parse_data_name(name: str, prefix: str | None) -> int | None:
    """N of a data name ``{prefix}.{N}`` or ``{prefix}.{N}~<hex>`` (``prefix`` None: any
    prefix), else None."""
    base, mark, version = name.partition(VERSION_MARK)
    if mark and not _DATA_VERSION.fullmatch(version):
        return None
    stem, dot, number = base.rpartition(".")
    if not dot or not re.fullmatch(NUMBER_PATTERN, number):
        return None
    if prefix is not None and stem != prefix:
        return None
    if prefix is None and not _SAFE_NAME.fullmatch(stem):
        return None
    return int(number)


def _data_names(names: Iterable[str], prefix: str) -> dict[int, list[str]]:
    """``{N: [names]}`` of the data names of ``prefix`` among ``names`` (the plain one first)."""
    found: dict[int, list[str]] = {}
    for name in sorted(names):
        number = parse_data_name(name, prefix)
        if number is not None:
            found.setdefault(number, []).append(name)
    return found


def _sentinel_stem(identifier: str) -> str:
    """The sentinel name without its number: ``sentinel_{identifier}_complete``."""
    return f"sentinel_{identifier}_complete"


def sentinel_name(identifier: str, number: int) -> str:
    """The sentinel file name of iteration ``number``."""
    return f"{_sentinel_stem(identifier)}.{number}"


def parse_sentinel_name(name: str) -> tuple[str, int] | None:
    """``(identifier, number)`` of a sentinel file name; ``None`` for any other name."""
    match = _SENTINEL.fullmatch(name)
    return None if match is None else (match.group(1), int(match.group(2)))


def member_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a file inside a checkpoint, or ``None`` when it can.

    A member name is a relative POSIX path: one or more ``/``-separated components, none of them
    empty, ``.`` or ``..``, with no backslash or NUL anywhere. So it resolves inside its
    checkpoint's directory or prefix on every backend: joined to a local directory it cannot
    climb out or become absolute, and joined to an object-store prefix it names a key below it.
    """
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if "\\" in name or "\x00" in name:
        return f"{name!r} is not a plain name inside its checkpoint (a backslash or NUL)"
    if name.startswith("/"):
        return f"{name!r} is not a plain name inside its checkpoint (an absolute path)"
    for component in name.split("/"):
        if component in ("", ".", ".."):
            return f"{name!r} is not a plain name inside its checkpoint (component {component!r})"
    return None


def _sharded_index_name(prefix: str = SHARDED_PREFIX) -> str:
    """The file (or object) name of the index inside a sharded checkpoint."""
    return f"{prefix}.index.bpk"
