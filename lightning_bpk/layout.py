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

__all__ = [
    "DEFAULT_IDENTIFIER",
    "DEFAULT_PREFIX",
    "MODEL_FILE",
    "MODEL_KEY",
    "NUMBER_PATTERN",
    "OPTIMIZER_KEY",
    "RECORD_SUFFIX",
    "SCHEDULER_KEY",
    "TRAINER_FILE",
    "TRAINER_KEY",
    "member_name_problem",
    "parse_sentinel_name",
    "sentinel_name",
    "sentinel_stem",
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

_SENTINEL = re.compile(r"sentinel_(.+)_complete\." + NUMBER_PATTERN)


def sentinel_stem(identifier: str) -> str:
    """The sentinel name without its number: ``sentinel_{identifier}_complete``."""
    return f"sentinel_{identifier}_complete"


def sentinel_name(identifier: str, number: int) -> str:
    """The sentinel file name of iteration ``number``."""
    return f"{sentinel_stem(identifier)}.{number}"


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
