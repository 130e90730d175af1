"""The resume policy of a run, written once for the Lightning callback and the Fabric manager.

Two decisions, both made by rank 0 and read-only unless ``overwrite`` says otherwise:

- **what to resume** (:func:`choose`): the newest checkpoint that verifies as it is read (the
  checkpointer's one resume choice, :func:`~lightning_bpk.checkpointer.choose_resume`: what it
  read is kept for the restore, so each file is read once), or the one an override names
  (gin's ``get_latest_checkpoint_number.override_number``, or the manager's
  ``override_number``), which must be complete; the answer is a :class:`ResumeChoice`;
- **never saving over another run's checkpoints** (:func:`in_the_way`): before its first save
  a run looks for complete checkpoints numbered from the first number it may save on (the
  epoch or global step it starts at for the callback; the step of its first save for the
  manager), other than the one it resumed from. Saving from there would replace them or leave
  them newer than this run's own, so a later resume would mix two runs. With ``overwrite``
  they are removed first; otherwise the run stops, naming them, unless none of them is usable
  (a damaged one is replaced anyway: the resume choice fell back past it).

Both integrations also refuse gin bindings of the core they cannot apply
(:func:`unapplied_bindings`): each builds its ``Checkpointer`` and chooses what to resume with
its own settings, so such a binding would change nothing without a word.

The bound is one for both integrations: ``>= start``, the resumed checkpoint excluded (the
Lightning callback's; the manager used ``> step``, which let its first save replace another
run's checkpoint of the same step without a word).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gin

from lightning_bpk.checkpointer import (
    Checkpointer,
    _bound_override_number,
    choose_resume,
    get_latest_checkpoint_number,
    list_checkpoints,
    verify_checkpoint,
)
from lightning_bpk.errors import summarise
from lightning_bpk.layout import SHARDED_INDEX_KEY, _numbered, _sentinel_stem
from lightning_bpk.store import Store, identity, open_store

__all__ = ["ResumeChoice", "choose", "in_the_way", "superseded_by_a_newer", "unapplied_bindings"]

log = logging.getLogger("lightning_bpk")


# The core's gin configurables an integration builds or calls with its own settings, and the
# parameters of each that a setting of the same name on the integration replaces.
_CORE_CONFIGURABLES = {
    "lightning_bpk.checkpointer.Checkpointer": (
        "checkpoint_file_prefix",
        "sentinel_file_identifier",
        "checkpoint_frequency",
        "checkpoint_duration",
        "keep_every",
        "storage_options",
    ),
    "lightning_bpk.checkpointer.get_latest_checkpoint_number": (
        "sentinel_file_identifier",
        "checkpoint_file_prefix",
        "verify",
        "storage_options",
    ),
}
_HONOURED = {"override_number"}  # get_latest_checkpoint_number's, read by choose()


def unapplied_bindings(owner: str, renamed: Mapping[str, str] | None = None) -> str | None:
    """The error for gin bindings ``owner`` cannot apply (None: there are none): any parameter
    of ``Checkpointer`` or ``get_latest_checkpoint_number`` but ``override_number``, since an
    integration builds its checkpointer and chooses its resume with its own settings.

    The message names the setting of ``owner`` to bind instead: the one of the same name, or
    the one ``renamed`` gives for a parameter (``{"checkpoint_frequency":
    "every_n_train_steps"}``); for a parameter no setting replaces, it says to remove it."""
    found = []
    for selector, replaced in _CORE_CONFIGURABLES.items():
        try:
            bound = gin.get_bindings(selector)
        except ValueError:  # not registered: nothing bound
            continue
        for name in sorted(set(bound) - _HONOURED):
            short = selector.rpartition(".")[2]
            own = (renamed or {}).get(name, name) if name in replaced else None
            what = f"bind {owner}.{own}" if own else "remove it"
            found.append(f"{short}.{name} = {bound[name]!r} ({what})")
    if not found:
        return None
    return (
        f"gin binds settings {owner} does not read: "
        + "; ".join(found)
        + f". {owner} builds its Checkpointer and chooses what to resume with its own "
        "settings, so these would change nothing; only "
        "get_latest_checkpoint_number.override_number applies under it"
    )


@dataclass(frozen=True)
class ResumeChoice:
    """What :func:`choose` found: checkpoint ``number`` (-1: none); ``data``, what rank 0 read
    choosing it (None when it read nothing: a sharded checkpoint, whose ranks read their own
    parts, ``verify=False``, or an override) and ``location``, where that data lies (None when
    it read nothing: the checkpointer knows). ``problem``: why the override cannot be resumed
    (then ``number`` is -1 and ``complete`` lists the complete checkpoints there)."""

    number: int = -1
    data: dict[str, Any] | None = None
    location: Path | str | None = None
    problem: str | None = None
    complete: list[int] = field(default_factory=list)
    override: int | None = None


def choose(
    directory: str | os.PathLike[str],
    identifier: str,
    prefix: str,
    required_keys: Sequence[str],
    *,
    verify: bool = True,
    override: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    store: Store | None = None,
) -> ResumeChoice:
    """The checkpoint of ``directory`` to resume (rank 0; read-only): ``override`` (or gin's
    ``override_number``) when set and >= 0, which must pass the quick checks (sentinel, names
    and sizes; its bytes are verified as the restore reads them); else the newest complete
    one, every byte verified as it is read when ``verify`` (falling back past damaged ones),
    sentinels and sizes only otherwise. ``store``: the directory's, if already open."""
    if override is None:
        override = _bound_override_number()
    names: dict[str, Any] = dict(
        sentinel_file_identifier=identifier,
        checkpoint_file_prefix=prefix,
        storage_options=storage_options,
    )
    if override is None and verify:  # every byte verified as it is read, once
        choice = choose_resume(
            store or open_store(directory, storage_options),
            identifier,
            prefix,
            required_keys,
            at_most=2**63,
            unloaded=(SHARDED_INDEX_KEY,),
        )
        return ResumeChoice(choice.number, choice.data, choice.location)
    if override is None:  # sentinels and file sizes only; read when restored
        latest = get_latest_checkpoint_number(directory, required_keys=required_keys, **names)
        return ResumeChoice(latest)
    if override < 0:
        return ResumeChoice(override=override)
    problems = verify_checkpoint(
        directory, override, full=False, required_keys=required_keys, **names
    )
    if not problems:
        return ResumeChoice(override, override=override)
    complete = [e.number for e in list_checkpoints(directory, **names) if e.complete]
    return ResumeChoice(problem=summarise(problems), complete=complete, override=override)


def superseded_by_a_newer(choice: ResumeChoice, checkpointer: Checkpointer) -> bool:
    """Whether the directory held a newer checkpoint than ``choice`` when ``checkpointer``
    took it over (rank 0, right after :meth:`~lightning_bpk.checkpointer.Checkpointer.
    take_over`): a run still saving there between the choice, which is read-only, and the
    take-over (the preempted run on its way out, a zombie) committed it. The choice is then
    made again (the lease now fences that run), so the new run continues from the newest
    checkpoint instead of refusing to save over it. An override stands as chosen."""
    lease = checkpointer.lease
    if lease is None or choice.override is not None:
        return False
    stem = _sentinel_stem(checkpointer.sentinel_file_identifier)
    return any(n > choice.number for _, n in _numbered(lease.known, stem))


def in_the_way(
    checkpointer: Checkpointer,
    start: int,
    start_name: str,
    resumed: str | os.PathLike[str] | None,
    *,
    overwrite: bool,
    verify: bool,
    required_keys: Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Rank 0, before a run's first save: the complete checkpoints of ``checkpointer``'s
    directory numbered ``start`` (the first number the run may save; ``start_name`` in words)
    or more, other than the one it resumed from (``resumed``: its directory, None: none), that
    its saves would replace or leave newer than its own, newest first (module docstring).

    With ``overwrite`` they are removed (logged) and nothing is returned; otherwise they are
    returned when any of them is usable (verifies, every byte with ``verify``) for the caller
    to stop with, naming them; nothing is changed."""
    base = checkpointer.base_directory
    names: dict[str, Any] = dict(
        sentinel_file_identifier=checkpointer.sentinel_file_identifier,
        checkpoint_file_prefix=checkpointer.checkpoint_file_prefix,
        storage_options=storage_options,
    )
    mine = identity(resumed) if resumed else None
    newer = [
        e.number
        for e in list_checkpoints(base, **names)
        if e.complete and e.number >= start and (e.data is None or identity(e.data) != mine)
    ]
    if not newer:
        return []
    if overwrite:
        log.warning(
            "overwrite=True: removing checkpoints %s in %s, which this run (starting at "
            "%s) would save over",
            newer,
            base,
            start_name,
        )
        checkpointer.remove_checkpoints(newer)
        return []
    usable = any(  # damaged ones are replaced anyway (resume fell back past them)
        not verify_checkpoint(base, n, full=verify, required_keys=required_keys, **names)
        for n in newer
    )
    return newer if usable else []
